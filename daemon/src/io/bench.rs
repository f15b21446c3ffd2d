//! `sluiced bench-io`: streams every layer of a store through the engine and compares the
//! rates with their limits measured in the same run: the raw read rate of the same engine
//! with decoding off, and one core's in-memory decode rate times the worker count. The
//! disk drifts from one pass to the next (here 1.0 to 2.3 GB/s between consecutive
//! passes), so read-only and decoding passes alternate and each decoding pass is held
//! against the read-only passes on either side of it.

use super::{IoConfig, IoEngine, IoError, IoStats};
use crate::store::Store;
use serde::Serialize;
use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::os::unix::fs::FileExt;
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone, Debug)]
pub struct BenchIoOptions {
    pub cfg: IoConfig,
    pub passes: usize,
    /// Requests kept outstanding by the consumer.
    pub ahead: usize,
    /// Stored bytes decoded on one core to measure the per-core decode rate.
    pub core_sample_bytes: u64,
}

#[derive(Debug, Serialize)]
pub struct Stalls {
    /// The consumer waited for a layer (the engine as a whole is the bottleneck).
    pub consumer_wait_s: f64,
    /// Reads waited for a free read buffer (decompression is the bottleneck).
    pub read_buffer_s: f64,
    /// Requests waited for a free staging slot (the consumer is the bottleneck).
    pub staging_slot_s: f64,
    /// Seconds with a read in flight, and decode seconds summed over workers.
    pub read_busy_s: f64,
    pub decompress_busy_s: f64,
}

#[derive(Debug, Serialize)]
pub struct BenchIoReport {
    pub engine: String,
    pub direct: bool,
    pub fallback_reason: String,
    pub cache_drop: String,
    pub queue_depth: usize,
    pub in_flight_bytes: usize,
    /// `IoConfig::follow_bytes`.
    pub follow_bytes: usize,
    pub request_bytes: usize,
    pub read_buffers: usize,
    pub workers: usize,
    pub passes: usize,
    pub units: usize,
    /// Per pass: bytes stored (compressed) and produced (decompressed).
    pub stored_bytes_per_pass: u64,
    pub raw_bytes_per_pass: u64,
    pub ratio: f64,
    pub seconds: f64,
    pub read_bytes: u64,
    pub read_gbps: f64,
    pub decompressed_bytes: u64,
    pub decompressed_gbps: f64,
    /// The same engine reading only (no decode): the disk's rate through this engine.
    pub raw_read_gbps: f64,
    /// One core decoding units from memory into a slot-sized buffer, raw bytes out per
    /// second: the per-core rate of the bound.
    pub core_decompress_gbps: f64,
    /// The same frames decoded into one frame-sized buffer that stays in cache (what
    /// `bench-codec` measures): the codec alone, without the writes to memory.
    pub core_decompress_hot_gbps: f64,
    /// min(raw read rate / ratio, workers x core rate): what decoding from disk can reach.
    pub bound_gbps: f64,
    /// The median over decoding passes of the pass's decompressed rate over its own bound
    /// (its read rate the mean of the read-only passes just before and after it).
    pub bound_ratio: f64,
    /// Each decoding pass's ratio to its own bound, in order.
    pub bound_ratios: Vec<f64>,
    pub short_reads: u64,
    pub stalls: Stalls,
}

/// Evicts the file from the page cache between passes when reads are buffered.
fn drop_cache(store: &Store, direct: bool) -> String {
    if direct {
        return "not needed (O_DIRECT)".into();
    }
    let mut how = Vec::new();
    if let Ok(f) = std::fs::File::open(store.weights_path()) {
        // SAFETY: plain syscall on a descriptor we own.
        if unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) } == 0 {
            how.push("fadvise(DONTNEED)");
        }
    }
    if std::fs::write("/proc/sys/vm/drop_caches", "1").is_ok() {
        how.push("drop_caches");
    }
    if how.is_empty() {
        "not permitted: later passes may read from the page cache".into()
    } else {
        how.join(" + ")
    }
}

/// Streams every unit `passes` times; returns the wall time.
fn stream(
    engine: &IoEngine,
    units: usize,
    passes: usize,
    ahead: usize,
    direct: bool,
) -> Result<(f64, String), IoError> {
    let mut total = 0.0;
    let mut cache = String::new();
    for _ in 0..passes {
        cache = drop_cache(engine.store(), direct);
        let t0 = Instant::now();
        let mut tickets = VecDeque::new();
        let mut next = 0;
        while next < units || !tickets.is_empty() {
            while next < units && tickets.len() < ahead {
                tickets.push_back(engine.request(next)?);
                next += 1;
            }
            if let Some(t) = tickets.pop_front() {
                drop(engine.wait(t)?);
            }
        }
        total += t0.elapsed().as_secs_f64();
    }
    Ok((total, cache))
}

/// One core decoding units from memory, raw bytes per second: each frame into its place in
/// a slot-sized buffer (as the engine decodes into staging slots; its pages touched
/// first, as a slot's are), and each frame into one frame-sized buffer that stays in
/// cache (as `bench-codec` measures a codec); the fastest of three passes over each unit.
fn core_decode_gbps(store: &Store, sample_bytes: u64) -> Result<(f64, f64), IoError> {
    let file = store.open_weights()?;
    let m = store.manifest();
    let mut dec = store
        .frame_decoder(m.frame_raw_len_max() as usize)
        .map_err(|e| IoError::Setup {
            path: store.weights_path().into(),
            msg: e.to_string(),
        })?;
    let mut frame = vec![0u8; m.frame_raw_len_max() as usize];
    let mut slot: Vec<u8> = Vec::new();
    let (mut decoded_raw, mut into_slot, mut into_frame, mut taken) = (0u64, 0.0, 0.0, 0u64);
    // Sample units spread over the model (the embedding differs from the layers).
    for (ui, u) in m.units.iter().enumerate() {
        if taken >= sample_bytes {
            break;
        }
        // Each frame's stored bytes, read where they are (a linked store's lie apart).
        let mut stored = vec![0u8; u.stored_len as usize];
        let mut at = Vec::with_capacity(u.frames.len());
        let mut s = 0usize;
        for f in &u.frames {
            let n = f.stored_len() as usize;
            file.read_exact_at(&mut stored[s..s + n], f.file_offset)
                .map_err(|e| crate::store::StoreError::io("read", store.weights_path(), e))?;
            at.push(s);
            s += n;
        }
        taken += u.stored_len;
        if slot.len() < u.raw_len as usize {
            slot.resize(u.raw_len as usize, 1);
        }
        // Each way three times, the fastest counting (a busy machine only slows a pass).
        for hot in [false, true] {
            let mut best = f64::INFINITY;
            for _ in 0..3 {
                let t0 = Instant::now();
                for (fi, (f, &s)) in u.frames.iter().zip(&at).enumerate() {
                    let (o, n) = (f.raw_offset as usize, f.raw_len as usize);
                    let dst = if hot {
                        &mut frame[..n]
                    } else {
                        &mut slot[o..o + n]
                    };
                    dec.decode(
                        f.codec,
                        &f.planes,
                        f.checksum,
                        &stored[s..s + f.stored_len() as usize],
                        dst,
                    )
                    .map_err(|fault| IoError::Data(store.frame_error(ui, fi, fault)))?;
                }
                best = best.min(t0.elapsed().as_secs_f64());
            }
            let t = best;
            if hot {
                into_frame += t;
            } else {
                into_slot += t;
            }
        }
        decoded_raw += u.raw_len;
    }
    let gbps = |secs: f64| decoded_raw as f64 / secs.max(1e-9) / 1e9;
    Ok((gbps(into_slot), gbps(into_frame)))
}

/// Reading only (decoding off): GB/s the engine reads over `passes` passes, for comparing
/// with fio run just before and after.
pub fn bench_raw_read(
    store: Arc<Store>,
    opts: &BenchIoOptions,
) -> Result<(String, f64, f64), IoError> {
    let e = IoEngine::new(
        store.clone(),
        IoConfig {
            decompress: false,
            ..opts.cfg.clone()
        },
    )?;
    let (secs, _) = stream(&e, store.units().len(), opts.passes, opts.ahead, e.direct())?;
    let st = e.stats();
    Ok((
        e.kind().to_string(),
        st.read_bytes as f64 / secs / 1e9,
        st.queue_depth_avg,
    ))
}

pub fn bench_io(store: Arc<Store>, opts: &BenchIoOptions) -> Result<BenchIoReport, IoError> {
    let units = store.units().len();
    let m = store.manifest();
    let (stored, raw) = (m.stored_bytes(), m.raw_bytes());
    let ratio = stored as f64 / raw.max(1) as f64;

    // 1. One core decoding from memory.
    let (core, core_hot) = core_decode_gbps(&store, opts.core_sample_bytes)?;

    // 2. Reading only (the disk's rate through this engine) and the whole engine (read +
    // checksum + decompress into staging slots), pass for pass: read, decode, read, ...
    let read_only = IoEngine::new(
        store.clone(),
        IoConfig {
            decompress: false,
            ..opts.cfg.clone()
        },
    )?;
    let engine = IoEngine::new(store.clone(), opts.cfg.clone())?;
    let read_pass = || -> Result<f64, IoError> {
        let before = read_only.stats().read_bytes;
        let (t, _) = stream(&read_only, units, 1, opts.ahead, read_only.direct())?;
        Ok((read_only.stats().read_bytes - before) as f64 / t / 1e9)
    };
    let mut raw_rates = vec![read_pass()?];
    let (mut secs, mut cache, mut ratios) = (0.0, String::new(), Vec::new());
    for _ in 0..opts.passes.max(1) {
        let before = engine.stats().decompressed_bytes;
        let (t, c) = stream(&engine, units, 1, opts.ahead, engine.direct())?;
        let produced = (engine.stats().decompressed_bytes - before) as f64 / t / 1e9;
        let after = read_pass()?;
        let around = (raw_rates[raw_rates.len() - 1] + after) / 2.0;
        raw_rates.push(after);
        let bound = (around / ratio).min(opts.cfg.workers as f64 * core);
        ratios.push(produced / bound);
        secs += t;
        cache = c;
    }
    let raw_read_gbps = raw_rates.iter().sum::<f64>() / raw_rates.len() as f64;
    let s: IoStats = engine.stats();
    let decompressed_gbps = s.decompressed_bytes as f64 / secs / 1e9;
    let bound = (raw_read_gbps / ratio).min(opts.cfg.workers as f64 * core);
    let mut sorted = ratios.clone();
    sorted.sort_by(f64::total_cmp);
    let median = sorted[sorted.len() / 2];
    Ok(BenchIoReport {
        engine: engine.kind().to_string(),
        direct: engine.direct(),
        fallback_reason: engine.fallback_reason().to_string(),
        cache_drop: cache,
        queue_depth: opts.cfg.queue_depth,
        in_flight_bytes: opts.cfg.in_flight_bytes,
        follow_bytes: opts.cfg.follow_bytes,
        request_bytes: opts.cfg.request_bytes,
        read_buffers: opts.cfg.read_buffers,
        workers: opts.cfg.workers,
        passes: opts.passes,
        units,
        stored_bytes_per_pass: stored,
        raw_bytes_per_pass: raw,
        ratio,
        seconds: secs,
        read_bytes: s.read_bytes,
        read_gbps: s.read_bytes as f64 / secs / 1e9,
        decompressed_bytes: s.decompressed_bytes,
        decompressed_gbps,
        raw_read_gbps,
        core_decompress_gbps: core,
        core_decompress_hot_gbps: core_hot,
        bound_gbps: bound,
        bound_ratio: median,
        bound_ratios: ratios,
        short_reads: s.short_reads,
        stalls: Stalls {
            consumer_wait_s: s.wait_stall_s,
            read_buffer_s: s.buffer_stall_s,
            staging_slot_s: s.slot_stall_s,
            read_busy_s: s.read_busy_s,
            decompress_busy_s: s.decompress_busy_s,
        },
    })
}

/// The disk's read rate in GB/s over `files` (a model's source files): up to `max_bytes`
/// read in 4 MiB requests by four threads (so a drive that needs depth gets some), with
/// O_DIRECT where the file system takes it. Returns the rate and whether it went around
/// the page cache (a cached file reads at memory speed: the figure is then no disk's).
pub fn disk_read_gbps(
    files: &[std::path::PathBuf],
    max_bytes: u64,
) -> std::io::Result<(f64, bool)> {
    const REQ: u64 = 4 << 20;
    let mut chunks: Vec<(usize, u64, usize)> = Vec::new();
    let mut opened = Vec::new();
    let mut all_direct = true;
    let mut total = 0u64;
    for (i, p) in files.iter().enumerate() {
        let (f, direct) = super::open_direct(p)?;
        all_direct &= direct;
        let len = f.metadata()?.len();
        opened.push(f);
        let mut at = 0;
        // Whole blocks only (O_DIRECT reads stop at the last full block).
        while at + 4096 <= len && total < max_bytes {
            let n = (len - at).min(REQ).min(max_bytes - total) / 4096 * 4096;
            if n == 0 {
                break;
            }
            chunks.push((i, at, n as usize));
            at += n;
            total += n;
        }
    }
    if total == 0 {
        return Err(std::io::Error::other("no whole 4 KiB block to read"));
    }
    let next = std::sync::atomic::AtomicUsize::new(0);
    let t = Instant::now();
    std::thread::scope(|s| -> std::io::Result<()> {
        let workers: Vec<_> = (0..4)
            .map(|_| {
                s.spawn(|| -> std::io::Result<()> {
                    let mut b = crate::hostbuf::AlignedBuf::new(REQ as usize)
                        .ok_or_else(|| std::io::Error::other("out of memory"))?;
                    loop {
                        let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                        let Some(&(f, at, n)) = chunks.get(i) else {
                            return Ok(());
                        };
                        opened[f].read_exact_at(&mut b.as_mut_slice()[..n], at)?;
                    }
                })
            })
            .collect();
        for w in workers {
            w.join()
                .map_err(|_| std::io::Error::other("a reader thread panicked"))??;
        }
        Ok(())
    })?;
    Ok((
        total as f64 / t.elapsed().as_secs_f64().max(1e-9) / 1e9,
        all_direct,
    ))
}

/// What `engine_disk_gbps` measured.
#[derive(Clone, Debug)]
pub struct DiskProbe {
    /// The best pass's read rate, GB/s.
    pub gbps: f64,
    /// Every pass's rate, GB/s.
    pub passes: Vec<f64>,
    /// The engine's reader ("io_uring" or "pread").
    pub reader: String,
    /// Whether the reads went around the page cache (O_DIRECT); a cached file reads at
    /// memory speed, which is no disk's rate.
    pub direct: bool,
    pub queue_depth: usize,
    pub request_bytes: u64,
}

/// The disk's read rate as the I/O engine reads `store`: three passes by the engine itself
/// with `cfg` (its reader, O_DIRECT, request size and queue depth; decoding off, the page
/// cache dropped before each pass). `sluiced pack --codec auto` runs it on a scratch raw
/// store it writes where the store goes: the source file of a model says less, as it may
/// sit on another file system, and reading it any other way (fewer requests in flight,
/// plain reads) gives another figure (on this project's VM 4 threads of 4 MiB preads read
/// a third of what the engine then did).
pub fn engine_read_probe(store: Arc<Store>, cfg: &IoConfig) -> Result<DiskProbe, String> {
    let e = IoEngine::new(
        store.clone(),
        IoConfig {
            decompress: false,
            ..cfg.clone()
        },
    )
    .map_err(|e| e.to_string())?;
    let mut passes = Vec::new();
    for _ in 0..3 {
        let before = e.stats().read_bytes;
        let (secs, _) = stream(&e, store.units().len(), 1, cfg.queue_depth, e.direct())
            .map_err(|e| e.to_string())?;
        passes.push((e.stats().read_bytes - before) as f64 / secs.max(1e-9) / 1e9);
    }
    Ok(DiskProbe {
        gbps: passes.iter().cloned().fold(0.0, f64::max),
        passes,
        reader: e.kind().to_string(),
        direct: e.direct(),
        queue_depth: cfg.queue_depth,
        request_bytes: cfg.request_bytes as u64,
    })
}
