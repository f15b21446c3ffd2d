//! The I/O loop against a scripted reader: each read the loop pushes takes the next step
//! of a script (complete it, return fewer bytes, fail with an errno, or hold it until the
//! test lets go), so short reads, EIO and a cancel with reads in flight are exercised
//! deterministically. The bytes still come from the real packed file.

use super::reader::{Msg, Reader, Target};
use super::{IoConfig, IoEngine, IoError, PoolStatus, ReaderChoice};
use crate::dtype::DType;
use crate::import::synth::{self, SynthSpec};
use crate::store::writer::{pack, PackOptions};
use crate::store::Store;
use std::collections::VecDeque;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug)]
enum Step {
    /// Deliver the whole read.
    Full,
    /// Deliver only this many bytes (the loop must ask for the rest).
    Short(usize),
    /// Fail with this errno.
    Fail(i32),
    /// Keep the read in flight until `Script::release` is set, then deliver it.
    Hold,
}

#[derive(Default)]
struct Script {
    steps: Mutex<VecDeque<Step>>,
    release: AtomicBool,
    pushed: AtomicUsize,
    /// The most reads pushed and not yet answered at once.
    most_out: AtomicUsize,
    /// The file offset and byte length of every read pushed, in order.
    reads: Mutex<Vec<(u64, usize)>>,
}

struct Pending {
    op: usize,
    ptr: usize,
    len: usize,
    offset: u64,
    step: Step,
}

struct Scripted {
    file: File,
    script: Arc<Script>,
    pending: Vec<Pending>,
}

impl Reader for Scripted {
    fn push(
        &mut self,
        op: usize,
        _target: Target,
        ptr: *mut u8,
        len: usize,
        offset: u64,
    ) -> std::io::Result<()> {
        self.script.pushed.fetch_add(1, Ordering::SeqCst);
        self.script.reads.lock().unwrap().push((offset, len));
        let step = self
            .script
            .steps
            .lock()
            .unwrap()
            .pop_front()
            .unwrap_or(Step::Full);
        self.pending.push(Pending {
            op,
            ptr: ptr as usize,
            len,
            offset,
            step,
        });
        self.script
            .most_out
            .fetch_max(self.pending.len(), Ordering::SeqCst);
        Ok(())
    }

    fn wait(
        &mut self,
        rx: &Receiver<Msg>,
        msgs: &mut Vec<Msg>,
        done: &mut Vec<(usize, i32)>,
        timeout: Option<Duration>,
    ) -> std::io::Result<()> {
        let t0 = Instant::now();
        loop {
            while let Ok(m) = rx.try_recv() {
                msgs.push(m);
            }
            let release = self.script.release.load(Ordering::SeqCst);
            let file = &self.file;
            self.pending.retain(|p| {
                let n = match p.step {
                    Step::Hold if !release => return true,
                    Step::Full | Step::Hold => p.len,
                    Step::Short(n) => n.min(p.len),
                    Step::Fail(errno) => {
                        done.push((p.op, -errno));
                        return false;
                    }
                };
                // SAFETY: the loop keeps the buffer region [ptr, ptr + len) for this op
                // until its completion is handled, which is after this returns.
                let dst = unsafe { std::slice::from_raw_parts_mut(p.ptr as *mut u8, n) };
                let got = file.read_at(dst, p.offset).expect("pread the packed file");
                done.push((p.op, got as i32));
                false
            });
            if !msgs.is_empty() || !done.is_empty() || timeout.is_some_and(|t| t0.elapsed() >= t) {
                return Ok(());
            }
            match rx.recv_timeout(Duration::from_millis(2)) {
                Ok(m) => msgs.push(m),
                Err(RecvTimeoutError::Timeout) => {}
                Err(RecvTimeoutError::Disconnected) => {
                    return Err(std::io::Error::other("message channel closed"))
                }
            }
        }
    }
}

/// The codecs the loop tests run with: zstd (frames decoded out of read buffers) and none
/// (units read straight into their staging slots).
const CODECS: [&str; 2] = ["zstd:3", "none"];

/// A tiny synthetic model packed with small frames, so frames span 4 KiB reads.
fn packed(dir: &std::path::Path, codec: &str) -> Arc<Store> {
    packed_in(dir, codec, 4096)
}

/// The same model packed in frames of `frame_size` raw bytes.
fn packed_in(dir: &std::path::Path, codec: &str, frame_size: u32) -> Arc<Store> {
    let spec = SynthSpec::llama_like(64, 2, DType::F32);
    let model = synth::model(&spec);
    let units = model.units().expect("units");
    let out = dir.join("s");
    let opts = PackOptions {
        auto: None,
        codec: codec.parse().expect("codec"),
        frame_size,
        threads: 1,
        force: true,
        link: false,
    };
    pack(&model, &units, &out, &opts, |_| {}).expect("pack");
    let store = Store::open(&out).expect("open");
    assert_eq!(
        store.units().iter().all(|u| u.stored_as_raw()),
        codec == "none",
        "{codec}: the raw path is taken exactly for the raw store"
    );
    Arc::new(store)
}

fn config() -> IoConfig {
    IoConfig {
        reader: ReaderChoice::Pread,
        direct: false,
        queue_depth: 4,
        request_bytes: 4096,
        read_buffers: 8,
        staging_slots: 2,
        workers: 1,
        ..IoConfig::default()
    }
}

fn engine(store: &Arc<Store>, script: &Arc<Script>) -> IoEngine {
    engine_with(store, script, config())
}

fn engine_with(store: &Arc<Store>, script: &Arc<Script>, cfg: IoConfig) -> IoEngine {
    let file = File::open(store.weights_path()).expect("open weights");
    let script = script.clone();
    IoEngine::with_reader(store.clone(), cfg, move |_| {
        Box::new(Scripted {
            file,
            script,
            pending: Vec::new(),
        })
    })
    .expect("start the engine")
}

/// The unit as the plain pread path decodes it.
fn reference(store: &Store, unit: usize) -> Vec<u8> {
    let file = store.open_weights().expect("open");
    let u = &store.units()[unit];
    let mut dst = vec![0u8; u.raw_len as usize];
    let mut dec = store
        .frame_decoder(store.manifest().frame_raw_len_max() as usize)
        .expect("dec");
    store
        .read_unit(&file, unit, &mut Vec::new(), &mut dst, &mut dec)
        .expect("plain read");
    dst
}

/// Loads unit `u` through the engine and checks it against the plain pread path.
fn assert_loads_like_pread(e: &IoEngine, store: &Store, u: usize) {
    let got = e
        .wait(e.request(u).expect("request"))
        .expect("load")
        .data()
        .to_vec();
    assert!(
        got == reference(store, u),
        "unit {u} differs from the plain read"
    );
}

fn full(e: &IoEngine) -> PoolStatus {
    let s = e.pool_status();
    PoolStatus {
        read_buffers_free: s.read_buffers,
        slots_free: s.slots,
        ..s
    }
}

/// Pools return asynchronously (the loop frees them): poll for a bounded time.
fn wait_full(e: &IoEngine) {
    let t0 = Instant::now();
    while e.pool_status() != full(e) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "pools did not return to full: {:?}",
            e.pool_status()
        );
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn largest_unit(store: &Store) -> usize {
    (0..store.units().len())
        .max_by_key(|&u| store.units()[u].stored_len)
        .expect("units")
}

#[test]
fn short_reads_are_resubmitted_and_the_unit_is_bit_exact() {
    for codec in CODECS {
        short_reads_are_resubmitted_and_the_unit_is_bit_exact_with(codec);
    }
}

fn short_reads_are_resubmitted_and_the_unit_is_bit_exact_with(codec: &str) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = packed(tmp.path(), codec);
    let script = Arc::new(Script::default());
    // Every read first returns 1000 bytes (not a multiple of anything the loop assumes),
    // then 1 byte, then the rest.
    {
        let mut s = script.steps.lock().unwrap();
        for _ in 0..64 {
            s.extend([Step::Short(1000), Step::Short(1), Step::Full]);
        }
    }
    let e = engine(&store, &script);
    let u = largest_unit(&store);
    assert!(
        store.units()[u].frames.len() > 2,
        "the test needs a unit of several frames"
    );
    assert_loads_like_pread(&e, &store, u);
    assert!(e.stats().short_reads >= 2, "{:?}", e.stats());
    wait_full(&e);
}

#[test]
fn a_read_error_fails_its_unit_with_the_offset_and_the_next_load_works() {
    for codec in CODECS {
        a_read_error_fails_its_unit_with_the_offset_and_the_next_load_works_with(codec);
    }
}

fn a_read_error_fails_its_unit_with_the_offset_and_the_next_load_works_with(codec: &str) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = packed(tmp.path(), codec);
    let script = Arc::new(Script::default());
    script
        .steps
        .lock()
        .unwrap()
        .extend([Step::Full, Step::Fail(libc::EIO)]);
    let e = engine(&store, &script);
    let u = largest_unit(&store);
    let err = match e.wait(e.request(u).expect("request")) {
        Ok(_) => panic!("a unit whose read failed with EIO loaded"),
        Err(err) => err,
    };
    let msg = err.to_string();
    assert!(matches!(err, IoError::Data(_)), "{msg}");
    assert!(err.is_data_loss(), "{msg}");
    let second_read = store.units()[u].file_offset + 4096;
    assert!(
        msg.contains(&format!(
            "read of 4096 bytes at offset {second_read} failed"
        )) && msg.contains("Input/output error"),
        "the error names the read's offset and errno: {msg}"
    );
    wait_full(&e);
    // The script is spent: the same unit now loads, bit for bit.
    assert_loads_like_pread(&e, &store, u);
    assert_eq!(e.stats().units_failed, 1);
    wait_full(&e);
}

#[test]
fn a_ticket_dropped_with_reads_in_flight_frees_everything_once_they_land() {
    for codec in CODECS {
        a_ticket_dropped_with_reads_in_flight_frees_everything_once_they_land_with(codec);
    }
}

fn a_ticket_dropped_with_reads_in_flight_frees_everything_once_they_land_with(codec: &str) {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = packed(tmp.path(), codec);
    let script = Arc::new(Script::default());
    // The first read lands, the next ones stay in flight: the unit's first frame is
    // split across a landed and a held read when it spans them.
    script.steps.lock().unwrap().extend([
        Step::Full,
        Step::Hold,
        Step::Hold,
        Step::Hold,
        Step::Hold,
    ]);
    let e = engine(&store, &script);
    let u = largest_unit(&store);
    let t = e.request(u).expect("request");
    let t0 = Instant::now();
    while script.pushed.load(Ordering::SeqCst) < 4 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "reads were not issued"
        );
        std::thread::sleep(Duration::from_millis(1));
    }
    drop(t); // cancel with reads held in flight
    std::thread::sleep(Duration::from_millis(20));
    // Held reads keep what they read into until they land: their read buffers, or
    // their unit's staging slot (the kernel may still write there).
    let s = e.pool_status();
    assert!(
        s.slots_free < s.slots && (codec == "none" || s.read_buffers_free < s.read_buffers),
        "{codec}: held reads keep their buffers and slot until they land: {s:?}"
    );
    script.release.store(true, Ordering::SeqCst);
    wait_full(&e);
    assert_loads_like_pread(&e, &store, u);
    wait_full(&e);
}

#[test]
fn a_read_the_disk_does_not_answer_fails_its_waiters_after_the_limit_and_frees_all_when_it_lands() {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = packed(tmp.path(), "zstd:3");
    let script = Arc::new(Script::default());
    // Every read of the first two units stays in flight until released.
    script.steps.lock().unwrap().extend([Step::Hold; 64]);
    let limit = Duration::from_millis(150);
    let file = File::open(store.weights_path()).expect("open weights");
    let s2 = script.clone();
    let e = IoEngine::with_reader(
        store.clone(),
        IoConfig {
            read_timeout: Some(limit),
            ..config()
        },
        move |_| {
            Box::new(Scripted {
                file,
                script: s2,
                pending: Vec::new(),
            })
        },
    )
    .expect("start the engine");
    let n = store.units().len();
    assert!(n >= 3, "the test model has {n} units");
    let t0 = Instant::now();
    // Two units take both staging slots and stall; the third waits for a slot.
    let tickets: Vec<_> = (0..3).map(|u| e.request(u).expect("request")).collect();
    let mut errors = Vec::new();
    for t in tickets {
        match e.wait(t) {
            Ok(_) => panic!("a unit whose reads never landed loaded"),
            Err(err) => errors.push(err),
        }
    }
    let waited = t0.elapsed();
    assert!(
        waited < limit * 20,
        "the waiters were failed after {waited:?}, limit {limit:?}"
    );
    for (u, err) in errors.iter().enumerate() {
        let msg = err.to_string();
        assert!(matches!(err, IoError::Stalled { .. }), "unit {u}: {msg}");
        assert!(err.is_unavailable() && !err.is_data_loss(), "{msg}");
        // Unit 0's reads fill the queue and stall; unit 1 has a slot but no read buffer
        // or queue entry; unit 2 waits for a slot.
        let what = [
            "has not completed after",
            "for a read buffer, held by reads the disk has not answered",
            "for a staging slot, held by a read the disk has not answered",
        ][u];
        assert!(
            msg.contains(what) && msg.contains("read_timeout 0.15 s"),
            "unit {u}: {msg}"
        );
    }
    assert!(e.stats().reads_stalled >= 1, "{:?}", e.stats());
    // The stalled reads still own their buffers and slots (the kernel may write there).
    let s = e.pool_status();
    assert!(
        s.read_buffers_free < s.read_buffers && s.slots_free < s.slots,
        "stalled reads keep their buffers and slots until they land: {s:?}"
    );
    script.release.store(true, Ordering::SeqCst);
    wait_full(&e);
    script.steps.lock().unwrap().clear();
    for u in 0..3 {
        assert_loads_like_pread(&e, &store, u);
    }
    wait_full(&e);
}

/// An urgent request takes the next free staging slot before requests queued earlier:
/// with both slots held, a plain request then an urgent one queued, freeing one slot
/// serves the urgent one (the plain one would otherwise hold it, unread by anyone).
#[test]
fn an_urgent_request_gets_the_next_slot_before_older_ones() {
    let dir = tempfile::tempdir().expect("tempdir");
    let store = packed(dir.path(), "zstd:1");
    let script = Arc::new(Script::default());
    let e = engine(&store, &script);
    let u = largest_unit(&store);
    let all = 0..store.units()[u].frames.len();
    let a = e.wait(e.request(u).expect("a")).expect("a loads");
    let b = e.wait(e.request(u).expect("b")).expect("b loads");
    let plain = e.request(u).expect("plain");
    let urgent = e.request_part_urgent(u, all).expect("urgent");
    drop(a);
    let (tx, rx) = std::sync::mpsc::channel();
    let mut plain = Some(plain);
    std::thread::scope(|s| {
        s.spawn(|| {
            let got = e.wait(urgent).map(|g| g.data().to_vec());
            let _ = tx.send(got);
        });
        let served_first = match rx.recv_timeout(Duration::from_secs(5)) {
            Ok(got) => {
                assert!(got.expect("urgent loads") == reference(&store, u));
                true
            }
            Err(RecvTimeoutError::Timeout) => {
                // Unblock the waiter: the plain request took the slot.
                plain.take();
                false
            }
            Err(RecvTimeoutError::Disconnected) => panic!("the waiter died"),
        };
        assert!(served_first, "the plain request took the slot first");
    });
    drop(b);
    let got = e.wait(plain.take().expect("kept")).expect("plain loads");
    assert!(got.data() == reference(&store, u).as_slice());
    drop(got);
    wait_full(&e);
}

#[test]
fn reads_in_flight_stay_within_the_byte_cap_and_the_unit_loads() {
    for codec in CODECS {
        // The cap holds two 4 KiB reads of the four the queue depth allows; without it
        // (the default 32 MiB) all four go out.
        assert_eq!(reads_out_with(codec, 2 * 4096), 2, "{codec}, capped");
        assert_eq!(reads_out_with(codec, 32 << 20), 4, "{codec}, uncapped");
    }
}

#[test]
fn the_next_units_reads_wait_until_the_oldest_units_are_below_the_follow_bytes() {
    for codec in CODECS {
        // The oldest unit's reads held out: with the default follow bytes (2 MiB, more
        // than both units) the next unit's reads join them; with 4 KiB (one read) none
        // goes until the oldest's have landed.
        assert!(next_reads_out_with(codec, 2 << 20) > 0, "{codec}, default");
        assert_eq!(next_reads_out_with(codec, 4096), 0, "{codec}, follow 4 KiB");
    }
}

/// Reads the engine sends for a second unit while the first's are all held out, with
/// `follow_bytes`; then, answered, both units load bit for bit.
fn next_reads_out_with(codec: &str, follow_bytes: usize) -> usize {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = packed(tmp.path(), codec);
    let units = store.units();
    // The two smallest units of three reads or more.
    let mut by_size: Vec<usize> = (0..units.len())
        .filter(|&u| units[u].stored_len >= 3 * 4096)
        .collect();
    by_size.sort_by_key(|&u| units[u].stored_len);
    let [a, b] = [by_size[0], by_size[1]];
    let reads = |u: usize| units[u].stored_len.div_ceil(4096) as usize;
    let script = Arc::new(Script::default());
    script.steps.lock().unwrap().extend([Step::Hold; 256]);
    let cfg = IoConfig {
        queue_depth: reads(a) + reads(b) + 4,
        read_buffers: reads(a) + reads(b) + 4,
        follow_bytes,
        ..config()
    };
    let e = engine_with(&store, &script, cfg);
    let (ta, tb) = (
        e.request(a).expect("request"),
        e.request(b).expect("request"),
    );
    let t0 = Instant::now();
    while script.pushed.load(Ordering::SeqCst) < reads(a) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the first unit's reads"
        );
        std::thread::sleep(Duration::from_millis(2));
    }
    std::thread::sleep(Duration::from_millis(50));
    let span = |u: usize| units[u].file_offset..units[u].file_offset + units[u].stored_len;
    let offsets: Vec<u64> = script.reads.lock().unwrap().iter().map(|r| r.0).collect();
    let of_b = offsets.iter().filter(|o| span(b).contains(o)).count();
    let of_a = offsets.iter().filter(|o| span(a).contains(o)).count();
    assert_eq!(
        of_a,
        reads(a),
        "{codec}: every read of the first unit went out"
    );
    script.release.store(true, Ordering::SeqCst);
    assert!(e.wait(ta).expect("load").data().to_vec() == reference(&store, a));
    assert!(e.wait(tb).expect("load").data().to_vec() == reference(&store, b));
    wait_full(&e);
    of_b
}

/// Reads the engine sends for the largest unit while the disk answers none, with
/// `in_flight_bytes` out at most; then, answered, the unit loads bit for bit and no more
/// than that many were ever out.
fn reads_out_with(codec: &str, in_flight_bytes: usize) -> usize {
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = packed(tmp.path(), codec);
    let script = Arc::new(Script::default());
    script.steps.lock().unwrap().extend([Step::Hold; 64]);
    let cfg = IoConfig {
        in_flight_bytes,
        ..config()
    };
    let e = engine_with(&store, &script, cfg);
    let u = largest_unit(&store);
    assert!(
        store.units()[u].stored_len > 4 * 4096,
        "the test needs a unit of more than four reads"
    );
    let ticket = e.request(u).expect("request");
    // The loop sends what it may at once; give it time to send more than it should.
    let t0 = Instant::now();
    while script.pushed.load(Ordering::SeqCst) == 0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "no read went out");
        std::thread::sleep(Duration::from_millis(2));
    }
    std::thread::sleep(Duration::from_millis(50));
    let out = script.pushed.load(Ordering::SeqCst);
    script.release.store(true, Ordering::SeqCst);
    let got = e.wait(ticket).expect("load").data().to_vec();
    assert!(got == reference(&store, u), "{codec}: unit {u} differs");
    assert_eq!(
        script.most_out.load(Ordering::SeqCst),
        out,
        "{codec}: more reads went out once the first were answered"
    );
    wait_full(&e);
    out
}

#[test]
fn reads_of_large_requests_end_where_frames_end_so_no_frame_spans_two() {
    // 64 KiB frames (zstd: each stored in fewer bytes, so they do not start on blocks)
    // read in 1 MiB requests: each read ends with a frame, the next starts at the block
    // that frame ends in, and every frame lies in one read buffer (its worker decodes it
    // there, with nothing to join).
    let tmp = tempfile::tempdir().expect("tempdir");
    let store = packed_in(tmp.path(), "zstd:1", 64 << 10);
    let u = largest_unit(&store);
    let unit = &store.units()[u];
    let req = super::event_loop::FRAME_CUT_REQUEST_MIN;
    assert!(
        unit.stored_len > 3 * req as u64,
        "{} bytes: too few for several reads",
        unit.stored_len
    );
    // Requests back to back would cut frames: the test would pass without the cuts
    // otherwise.
    let cut = |f: &crate::store::format::Frame| {
        let (s, e) = (
            f.file_offset - unit.file_offset,
            f.file_offset - unit.file_offset + f.stored_len(),
        );
        s / req as u64 != (e - 1) / req as u64
    };
    assert!(unit.frames.iter().filter(|f| cut(f)).count() >= 2);
    let script = Arc::new(Script::default());
    let cfg = IoConfig {
        request_bytes: req,
        read_buffers: 4,
        ..config()
    };
    let e = engine_with(&store, &script, cfg);
    assert_loads_like_pread(&e, &store, u);
    let reads: Vec<(u64, u64)> = script
        .reads
        .lock()
        .unwrap()
        .iter()
        .map(|&(o, l)| (o, o + l as u64))
        .collect();
    for (i, f) in unit.frames.iter().enumerate() {
        let (s, e) = (f.file_offset, f.file_offset + f.stored_len());
        assert!(
            reads.iter().any(|&(a, b)| a <= s && e <= b),
            "frame {i} ({s}..{e}) is in no one read: {reads:?}"
        );
    }
    for w in reads.windows(2) {
        assert!(w[1].0 <= w[0].1, "a gap between reads: {w:?}");
        assert!(
            w[0].1 <= w[1].0 + 4096,
            "reads share more than a block: {w:?}"
        );
        assert!(w[1].1 - w[1].0 <= req as u64);
    }
    wait_full(&e);
}
