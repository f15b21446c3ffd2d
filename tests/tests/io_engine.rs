//! The I/O engine end to end on real files: both readers (io_uring and pread), with and
//! without O_DIRECT, deliver every layer bit-exactly; faults fail only the layers they hit,
//! name file, layer, frame and offset, and leak no buffer.

use sluice::io::{IoConfig, IoEngine, ReaderChoice, ReaderKind};
use sluice::store::Store;
use sluice_tests::*;
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

fn packed(src: &Path, out: &Path, codec: &str, frame_size: u32) -> Arc<Store> {
    pack_store(src, out, codec, frame_size)
}

/// The engine configurations every test runs: each reader, O_DIRECT and buffered, and a
/// request size small enough that frames span several reads.
fn configs() -> Vec<(String, IoConfig)> {
    let mut v = Vec::new();
    for engine in [ReaderChoice::Uring, ReaderChoice::Pread] {
        for direct in [true, false] {
            for request_bytes in [8192usize, 64 << 10, 4 << 20] {
                let cfg = IoConfig {
                    reader: engine,
                    direct,
                    queue_depth: 8,
                    request_bytes,
                    read_buffers: 40,
                    staging_slots: 3,
                    workers: 2,
                    pread_threads: 4,
                    ..IoConfig::default()
                };
                v.push((
                    format!("{engine:?} direct={direct} request={request_bytes}"),
                    cfg,
                ));
            }
        }
    }
    v
}

fn engine(store: &Arc<Store>, cfg: &IoConfig) -> IoEngine {
    let e = IoEngine::new(store.clone(), cfg.clone()).unwrap();
    let want = if cfg.reader == ReaderChoice::Uring {
        ReaderKind::Uring
    } else {
        ReaderKind::Pread
    };
    // uring is used only with O_DIRECT when asked for auto; asked for explicitly it runs buffered too.
    assert_eq!(e.kind(), want);
    e
}

fn wait_pools_full(e: &IoEngine) {
    let t0 = Instant::now();
    loop {
        let p = e.pool_status();
        if p.read_buffers_free == p.read_buffers && p.slots_free == p.slots {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "pools did not return to full: {p:?}"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Streams every unit `passes` times with `ahead` requests in flight, comparing each.
fn stream_all(e: &IoEngine, want: &[Vec<u8>], passes: usize, ahead: usize) {
    let n = want.len();
    let order: Vec<usize> = (0..passes).flat_map(|_| 0..n).collect();
    let mut tickets = std::collections::VecDeque::new();
    let mut next = 0;
    for _ in 0..order.len() {
        while next < order.len() && tickets.len() < ahead {
            tickets.push_back(e.request(order[next]).unwrap());
            next += 1;
        }
        let t = tickets.pop_front().unwrap();
        let unit = t.unit();
        let g = e.wait(t).unwrap();
        assert!(g.data() == &want[unit][..], "unit {unit} differs");
    }
}

#[test]
fn every_reader_delivers_every_layer_bit_exactly() {
    let tmp = tempfile::tempdir().unwrap();
    for (src, codec) in [
        ("tiny-llama", "zstd:3"),
        ("tiny-llama-q.gguf", "lz4"),
        ("tiny-qwen2.gguf", "none"),
        ("tiny-qwen3", "float"),
    ] {
        let store = packed(&fixture(src), &tmp.path().join(src), codec, 4096);
        let want = decoded_units(&store);
        for (name, cfg) in configs() {
            let e = engine(&store, &cfg);
            stream_all(&e, &want, 3, 3);
            wait_pools_full(&e);
            let s = e.stats();
            assert_eq!(s.units_done as usize, 3 * want.len(), "{src} {name}");
            assert_eq!(
                s.decompressed_bytes,
                3 * want.iter().map(|w| w.len() as u64).sum::<u64>(),
                "{src} {name}"
            );
        }
    }
}

#[test]
fn smollm2_streams_through_both_readers() {
    let tmp = tempfile::tempdir().unwrap();
    let store = packed(&smollm2_gguf(), &tmp.path().join("s"), "zstd:3", 1 << 20);
    let want = decoded_units(&store);
    for engine_choice in [ReaderChoice::Uring, ReaderChoice::Pread] {
        let cfg = IoConfig {
            reader: engine_choice,
            queue_depth: 16,
            request_bytes: 1 << 20,
            read_buffers: 16,
            staging_slots: 4,
            ..IoConfig::default()
        };
        let e = engine(&store, &cfg);
        assert!(
            e.direct(),
            "O_DIRECT should work on this file system: {}",
            e.fallback_reason()
        );
        stream_all(&e, &want, 2, 4);
        wait_pools_full(&e);
        assert_eq!(e.stats().short_reads, 0);
    }
}

#[test]
fn a_corrupted_frame_fails_only_its_layer_and_leaks_nothing() {
    // zstd frames are decoded out of read buffers; a store packed with --codec none is
    // read straight into its staging slots, where only the checksum catches the flip.
    for codec in ["zstd:3", "none"] {
        corrupted_frame(codec);
    }
}

fn corrupted_frame(codec: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let store = packed(&fixture("tiny-llama"), &tmp.path().join("s"), codec, 4096);
    let want = decoded_units(&store);
    let bad_unit = 2;
    let f = store.units()[bad_unit].frames[3].clone();
    let w = store.weights_path().to_path_buf();
    let mut b = std::fs::read(&w).unwrap();
    b[(f.file_offset + f.stored_len() / 2) as usize] ^= 0x40;
    std::fs::write(&w, b).unwrap();
    for (name, cfg) in configs() {
        let e = engine(&store, &cfg);
        for pass in 0..2 {
            let tickets: Vec<_> = (0..want.len()).map(|u| e.request(u).unwrap()).collect();
            for t in tickets {
                let unit = t.unit();
                match e.wait(t) {
                    Ok(g) => {
                        assert_ne!(unit, bad_unit, "{name}: corrupted unit loaded");
                        assert!(g.data() == &want[unit][..]);
                    }
                    Err(err) => {
                        assert_eq!(
                            unit, bad_unit,
                            "{name} pass {pass}: unit {unit} failed: {err}"
                        );
                        assert!(err.is_data_loss());
                        let msg = err.to_string();
                        let want_msg = format!("layer 1, frame 3 at offset {}", f.file_offset);
                        assert!(
                            msg.contains("weights.bin") && msg.contains(&want_msg),
                            "{name}: {msg}"
                        );
                    }
                }
            }
        }
        wait_pools_full(&e);
        assert_eq!(e.stats().units_failed, 2, "{codec} {name}");
    }
}

#[test]
fn a_file_truncated_under_the_engine_fails_the_layers_past_the_end() {
    let tmp = tempfile::tempdir().unwrap();
    for (name, cfg) in configs() {
        let dir = tmp.path().join(name.replace([' ', '='], "_"));
        let store = packed(&fixture("tiny-llama"), &dir, "none", 4096);
        let want = decoded_units(&store);
        let e = engine(&store, &cfg);
        // Cut weights.bin inside layer 1's blob after the engine opened it.
        let cut = store.units()[2].file_offset + 4096;
        std::fs::OpenOptions::new()
            .write(true)
            .open(store.weights_path())
            .unwrap()
            .set_len(cut)
            .unwrap();
        for (unit, want) in want.iter().enumerate() {
            let r = e.wait(e.request(unit).unwrap());
            if unit < 2 {
                assert!(r.unwrap().data() == &want[..]);
            } else {
                let msg = r.err().expect("past the cut must fail").to_string();
                assert!(
                    msg.contains("weights.bin")
                        && (msg.contains("end of file") || msg.contains("Invalid argument")),
                    "{name}: {msg}"
                );
            }
        }
        wait_pools_full(&e);
    }
}

#[test]
fn a_failing_descriptor_fails_requests_cleanly() {
    // A directory opened as the weights file: every read fails with EISDIR.
    let tmp = tempfile::tempdir().unwrap();
    let store = packed(
        &fixture("tiny-llama"),
        &tmp.path().join("s"),
        "zstd:3",
        4096,
    );
    for (name, cfg) in configs() {
        let dir = std::fs::File::open(tmp.path()).unwrap();
        let e = IoEngine::with_file(store.clone(), dir, false, cfg.clone()).unwrap();
        for unit in 0..store.units().len() {
            let msg = e
                .wait(e.request(unit).unwrap())
                .err()
                .expect("reads must fail")
                .to_string();
            assert!(
                msg.contains("Is a directory")
                    && msg.contains(", frame ")
                    && msg.contains("failed: read of"),
                "{name}: {msg}"
            );
        }
        wait_pools_full(&e);
    }
}

#[test]
fn dropped_tickets_and_guards_return_their_slots() {
    let tmp = tempfile::tempdir().unwrap();
    let store = packed(
        &fixture("tiny-qwen2"),
        &tmp.path().join("s"),
        "zstd:3",
        4096,
    );
    let want = decoded_units(&store);
    for (name, cfg) in configs() {
        let e = engine(&store, &cfg);
        for round in 0..20 {
            // Request more than there are slots, drop some unwaited, hold and drop others.
            let tickets: Vec<_> = (0..8)
                .map(|i| e.request((i + round) % want.len()).unwrap())
                .collect();
            let mut kept = Vec::new();
            for (i, t) in tickets.into_iter().enumerate() {
                if i % 3 == 0 {
                    let unit = t.unit();
                    let g = e.wait(t).unwrap();
                    assert!(g.data() == &want[unit][..], "{name}");
                    kept.push(g);
                    if kept.len() == 2 {
                        kept.clear();
                    }
                }
            }
        }
        wait_pools_full(&e);
    }
    // Asking for a unit that does not exist is an error, not a panic.
    let e = IoEngine::new(store.clone(), IoConfig::default()).unwrap();
    assert!(e.request(99).is_err());
}

#[test]
fn a_store_packed_raw_reads_into_its_staging_slots_without_read_buffers() {
    let tmp = tempfile::tempdir().unwrap();
    let raw = packed(
        &fixture("tiny-llama"),
        &tmp.path().join("raw"),
        "none",
        4096,
    );
    let zstd = packed(
        &fixture("tiny-llama"),
        &tmp.path().join("z"),
        "zstd:3",
        4096,
    );
    assert!(raw.units().iter().all(|u| u.stored_as_raw()));
    assert!(!zstd.units().iter().any(|u| u.stored_as_raw()));
    let want = decoded_units(&raw);
    for (name, cfg) in configs() {
        // Slots registered with io_uring (READ_FIXED into them), and plain reads into them
        // (what a kernel that refuses the registration gets).
        for register_slots in [true, false] {
            let cfg = IoConfig {
                read_buffers: 0,
                register_slots,
                ..cfg.clone()
            };
            // With no read buffer at all, every byte must have gone straight into the slots
            // (and been checked there: the reference is the store's own verified decode).
            let e = engine(&raw, &cfg);
            let uring = cfg.reader == sluice::io::ReaderChoice::Uring;
            assert_eq!(
                e.slots_registered(),
                register_slots && uring,
                "{name}, register {register_slots}"
            );
            stream_all(&e, &want, 2, 3);
            wait_pools_full(&e);
            assert_eq!(
                e.stats().units_done as usize,
                2 * want.len(),
                "{name}, register {register_slots}"
            );
        }
        let cfg = IoConfig {
            read_buffers: 0,
            ..cfg
        };
        // A compressed store cannot do without them, nor a raw one told to use them.
        for (store, into_slots) in [(&zstd, true), (&raw, false)] {
            let cfg = IoConfig {
                read_into_slots: into_slots,
                ..cfg.clone()
            };
            let err = IoEngine::new(store.clone(), cfg)
                .err()
                .expect("no read buffers");
            assert!(err.to_string().contains("read buffers"), "{name}: {err}");
        }
    }
}

#[test]
fn reading_without_decoding_returns_every_buffer() {
    // bench-io measures the raw read rate with decoding off; frames that span reads must
    // still give their buffers back.
    let tmp = tempfile::tempdir().unwrap();
    let store = packed(&fixture("tiny-llama"), &tmp.path().join("s"), "none", 4096);
    for (name, cfg) in configs() {
        let e = engine(
            &store,
            &IoConfig {
                decompress: false,
                read_buffers: 4,
                ..cfg
            },
        );
        for _ in 0..3 {
            let tickets: Vec<_> = (0..store.units().len())
                .map(|u| e.request(u).unwrap())
                .collect();
            for t in tickets {
                drop(e.wait(t).unwrap());
            }
        }
        wait_pools_full(&e);
        assert_eq!(
            e.stats().units_done as usize,
            3 * store.units().len(),
            "{name}"
        );
    }
}

/// Records what the engine asks to page-lock; refuses when `fail` is set.
struct RecordingPinner {
    fail: bool,
    tries: std::sync::atomic::AtomicUsize,
    pinned: std::sync::Mutex<Vec<(usize, usize)>>,
    unpinned: std::sync::Mutex<Vec<usize>>,
}

impl sluice::hostbuf::HostPinner for RecordingPinner {
    fn pin(&self, ptr: *mut u8, len: usize) -> Result<(), String> {
        self.tries
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if self.fail {
            return Err("CUDA_ERROR_OUT_OF_MEMORY".into());
        }
        self.pinned.lock().unwrap().push((ptr as usize, len));
        Ok(())
    }
    fn unpin(&self, ptr: *mut u8) {
        self.unpinned.lock().unwrap().push(ptr as usize);
    }
}

#[test]
fn staging_slots_are_pinned_once_unpinned_before_they_are_freed_and_pageable_when_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let store = packed(
        &fixture("tiny-llama"),
        &tmp.path().join("s"),
        "lz4",
        64 << 10,
    );
    let want = decoded_units(&store);
    let p = Arc::new(RecordingPinner {
        fail: false,
        tries: Default::default(),
        pinned: Default::default(),
        unpinned: Default::default(),
    });
    let largest = store.units().iter().map(|u| u.raw_len).max().unwrap() as usize;
    let cfg = IoConfig {
        staging_slots: 3,
        pinner: Some(sluice::hostbuf::Pinner(p.clone())),
        ..configs()[0].1.clone()
    };
    let e = engine(&store, &cfg);
    {
        let pinned = p.pinned.lock().unwrap();
        assert_eq!(pinned.len(), 3, "one registration per staging slot");
        for &(ptr, len) in pinned.iter() {
            assert_eq!(ptr % 4096, 0);
            assert!(len >= largest && len % 4096 == 0);
        }
        assert!(p.unpinned.lock().unwrap().is_empty());
    }
    assert_eq!(e.pool_status().slots_pageable, 0);
    // Pinned slots deliver the same bytes; a held slot is released when dropped.
    stream_all(&e, &want, 1, 2);
    let t = e.request(1).unwrap();
    let held = e.wait(t).unwrap().detach();
    assert_eq!(held.data(), &want[1][..]);
    drop(held);
    wait_pools_full(&e);
    drop(e);
    let mut a: Vec<usize> = p.pinned.lock().unwrap().iter().map(|x| x.0).collect();
    let mut b = p.unpinned.lock().unwrap().clone();
    a.sort();
    b.sort();
    assert_eq!(a, b, "every pinned slot is unpinned");

    // A refused registration (some container runtimes refuse cuMemHostRegister) leaves
    // the slots pageable: the engine starts, says so in its pool status and delivers the
    // same bytes; after the first refusal the other slots are not tried.
    let bad = Arc::new(RecordingPinner {
        fail: true,
        tries: Default::default(),
        pinned: Default::default(),
        unpinned: Default::default(),
    });
    let cfg = IoConfig {
        pinner: Some(sluice::hostbuf::Pinner(bad.clone())),
        ..cfg
    };
    let e = IoEngine::new(store.clone(), cfg).expect("pageable staging slots still stream");
    assert_eq!(e.pool_status().slots_pageable, 3);
    assert_eq!(bad.tries.load(std::sync::atomic::Ordering::Relaxed), 1);
    stream_all(&e, &want, 1, 2);
    wait_pools_full(&e);
    drop(e);
    assert!(
        bad.unpinned.lock().unwrap().is_empty(),
        "nothing was pinned"
    );
}

#[test]
fn a_low_memlock_limit_names_the_unit_file_setting() {
    use sluice::hostbuf::memlock_hint;
    let h = memlock_hint(1 << 30, Some(64 << 10));
    assert!(h.contains("RLIMIT_MEMLOCK) is 65536 bytes"), "{h}");
    assert!(h.contains("LimitMEMLOCK=infinity"), "{h}");
    assert!(h.contains("ulimit -l"), "{h}");
    // No hint when the limit is not the reason.
    assert_eq!(memlock_hint(1 << 30, None), "");
    assert_eq!(memlock_hint(1 << 20, Some(1 << 30)), "");
}

#[test]
fn decoded_prefixes_are_exact_and_a_dropped_ticket_mid_load_returns_its_slot() {
    let tmp = tempfile::tempdir().unwrap();
    let store = packed(
        &fixture("tiny-llama"),
        &tmp.path().join("s"),
        "zstd:1",
        4096,
    );
    let want = decoded_units(&store);
    let unit = (0..want.len()).max_by_key(|&u| want[u].len()).unwrap();
    assert!(store.units()[unit].frames.len() > 4);
    for (name, cfg) in configs().into_iter().step_by(3) {
        let e = engine(&store, &cfg);
        for pass in 0..3 {
            let t = e.request(unit).unwrap();
            let mut have = 0;
            let mut parts = 0;
            while let Some(prefix) = e.wait_progress(&t, have + 1).unwrap() {
                assert!(prefix.len() > have, "{name}: no progress");
                assert_eq!(prefix, &want[unit][..prefix.len()], "{name}: prefix bytes");
                have = prefix.len();
                parts += 1;
                if pass == 2 {
                    break;
                }
            }
            if pass == 2 {
                // Drop the ticket mid-load (after its first part, if the load was not done
                // by then): the slot comes back.
                drop(t);
                wait_pools_full(&e);
                continue;
            }
            let g = e.wait(t).unwrap();
            assert_eq!(
                g.data(),
                &want[unit][..],
                "{name}: whole unit after {parts} parts"
            );
        }
        wait_pools_full(&e);
    }
}

/// Parts of a unit (runs of its frames) in slots smaller than the unit: each holds exactly
/// the unit's bytes from its first frame on, through both readers, straight into the slot
/// (raw) or decoded from read buffers (zstd); a part that cannot fit, a bad frame range
/// or a whole unit larger than the slots is refused with what to do.
#[test]
fn parts_of_a_unit_larger_than_a_slot_load_its_exact_bytes() {
    let tmp = tempfile::tempdir().unwrap();
    for codec in ["none", "zstd:3"] {
        let store = packed(
            &fixture("tiny-qwen2.gguf"),
            &tmp.path().join(codec),
            codec,
            4096,
        );
        let want = decoded_units(&store);
        let u = 0;
        let frames = store.units()[u].frames.len();
        assert!(frames >= 6, "{codec}: the embedding has {frames} frames");
        let slot = 3 * 4096;
        for (name, cfg) in configs() {
            let cfg = IoConfig {
                slot_bytes: Some(slot),
                read_buffers: if codec == "none" { 0 } else { 40 },
                ..cfg
            };
            let e = engine(&store, &cfg);
            let at = format!("{codec} {name}");
            let big = e.request(u).err().expect("larger than a slot");
            assert!(big.to_string().contains("in parts"), "{at}: {big}");
            let bad = e
                .request_part(u, frames..frames + 1)
                .err()
                .expect("past the end");
            assert!(bad.to_string().contains("frames"), "{at}: {bad}");
            let wide = e
                .request_part(u, 0..4)
                .err()
                .expect("four frames need 16 KiB");
            assert!(wide.to_string().contains("staging slot"), "{at}: {wide}");
            // Every run of up to three frames, several requested ahead.
            let runs: Vec<std::ops::Range<usize>> = (0..frames)
                .flat_map(|a| (a + 1..=(a + 3).min(frames)).map(move |b| a..b))
                .collect();
            let mut tickets = std::collections::VecDeque::new();
            let mut next = 0;
            for _ in 0..runs.len() {
                while next < runs.len() && tickets.len() < 3 {
                    tickets.push_back((
                        runs[next].clone(),
                        e.request_part(u, runs[next].clone()).unwrap(),
                    ));
                    next += 1;
                }
                let (r, t) = tickets.pop_front().unwrap();
                let fs = &store.units()[u].frames;
                let lo = fs[r.start].raw_offset as usize;
                let hi = (fs[r.end - 1].raw_offset + fs[r.end - 1].raw_len as u64) as usize;
                let g = e.wait(t).unwrap();
                assert!(g.data() == &want[u][lo..hi], "{at}: frames {r:?} differ");
            }
            wait_pools_full(&e);
        }
    }
}

/// Each expert of a mixture's layer is a run of whole frames starting a page of its own:
/// the dense part (attention, norms, router) and the experts cover the unit's frames once,
/// and each expert loads on its own into a slot the size of one expert, exactly its
/// tensors' bytes, read straight into the slot for a raw store (no read buffers) and
/// decoded from read buffers for a compressed one.
#[test]
fn each_expert_of_a_mixture_loads_on_its_own() {
    let tmp = tempfile::tempdir().unwrap();
    for codec in ["none", "zstd:3"] {
        let store = packed(
            &fixture("tiny-qwen3moe"),
            &tmp.path().join(codec),
            codec,
            4096,
        );
        let want = decoded_units(&store);
        let sparse: Vec<usize> = (0..store.units().len())
            .filter(|&u| {
                store.units()[u]
                    .tensors
                    .iter()
                    .any(|t| t.name.contains(".mlp.experts."))
            })
            .collect();
        assert_eq!(sparse, [1, 2], "{codec}");
        let mut slot = 0;
        for &u in &sparse {
            let unit = &store.units()[u];
            let ex = unit.experts().expect("the writer's layout");
            assert_eq!(ex.len(), 4, "{codec} unit {u}");
            // Dense frames first, then the experts' runs back to back, covering every frame.
            let mut next = ex[0].frames.start;
            assert!(next > 0, "{codec} unit {u}: the dense part has frames");
            for (e, x) in ex.iter().enumerate() {
                assert_eq!(x.frames.start, next, "{codec} unit {u} expert {e}");
                assert_eq!(
                    x.raw.start % 4096,
                    0,
                    "{codec} unit {u} expert {e}: page-aligned"
                );
                if codec == "none" {
                    assert_eq!(unit.frames[x.frames.start].file_offset % 4096, 0);
                }
                next = x.frames.end;
                slot = slot.max(unit.part_span(x.frames.clone(), codec == "none") as usize);
            }
            assert_eq!(next, unit.frames.len(), "{codec} unit {u}");
        }
        for (name, cfg) in configs() {
            let cfg = IoConfig {
                slot_bytes: Some(slot),
                read_buffers: if codec == "none" { 0 } else { 40 },
                units: Some(sparse.clone()),
                ..cfg
            };
            let e = engine(&store, &cfg);
            for &u in &sparse {
                for (i, x) in store.units()[u].experts().unwrap().iter().enumerate() {
                    let g = e
                        .wait(e.request_part(u, x.frames.clone()).unwrap())
                        .unwrap();
                    let (lo, hi) = (x.raw.start as usize, x.raw.end as usize);
                    assert!(
                        g.data() == &want[u][lo..hi],
                        "{codec} {name}: unit {u} expert {i} differs"
                    );
                }
            }
            wait_pools_full(&e);
        }
    }
}

/// A linked store (`pack --link`) reads each frame where the source holds its tensor (not
/// back to back: the writer's order is not the GGUF's, a mixture's experts are slices of
/// its merged tensors, and the last chunk of a GGUF runs past its end), through both
/// readers with and without O_DIRECT, and every unit comes out as the copied store's,
/// padding included; the same for a Hugging Face model kept in one safetensors file.
#[test]
fn linked_stores_deliver_the_copied_stores_bytes_through_every_reader() {
    let tmp = tempfile::tempdir().unwrap();
    for src in [
        "tiny-llama.gguf",
        "tiny-llama-q.gguf",
        "tiny-gemma3.gguf",
        "tiny-mixtral.gguf",
        "tiny-qwen3moe.gguf",
        "tiny-gptoss-mxfp4.gguf",
        "tiny-qwen3moe",
    ] {
        let copied = packed(
            &fixture(src),
            &tmp.path().join(format!("{src}-c")),
            "none",
            4096,
        );
        let model = sluice::import::open(&fixture(src)).unwrap();
        let units = model.units().unwrap();
        let dir = tmp.path().join(format!("{src}-l"));
        let opts = sluice::store::writer::PackOptions {
            frame_size: 4096,
            force: true,
            link: true,
            ..Default::default()
        };
        let report = sluice::store::writer::pack(&model, &units, &dir, &opts, |_| {}).unwrap();
        assert!(report.linked.is_some(), "{src}");
        let linked = Arc::new(Store::open(&dir).unwrap());
        let want = decoded_units(&copied);
        assert!(decoded_units(&linked) == want, "{src}: the plain reader");
        for (name, cfg) in configs() {
            let e = engine(&linked, &cfg);
            stream_all(&e, &want, 2, 3);
            wait_pools_full(&e);
            assert_eq!(
                e.stats().units_done as usize,
                2 * want.len(),
                "{src} {name}"
            );
        }
    }
}

/// `--link` is refused, saying why, for a source whose tensors are not in one file as
/// they are; `--codec auto` then packs a copy.
#[test]
fn link_is_refused_for_converted_or_split_sources() {
    let tmp = tempfile::tempdir().unwrap();
    for (src, why) in [
        ("tiny-gemma3", "widened to f32 on import"),
        ("tiny-llama", "in 2 files and a linked store reads one"),
    ] {
        let out = tmp.path().join(src);
        let err = sluiced_err(&[
            "pack",
            "--link",
            fixture(src).to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
        ]);
        assert!(err.contains("--link") && err.contains(why), "{src}: {err}");
        assert!(!out.exists(), "{src}: nothing is left behind");
    }
}
