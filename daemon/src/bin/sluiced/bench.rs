//! `sluiced bench-stream` and `sluiced bench-io`: figures and ratios from one run each.

use anyhow::{Context, Result};
use sluice::engine::{bench_stream, BackendChoice};
use sluice::store::{Codec, Store};
use sluice::util::{fmt_bytes, parse_size};
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct BenchStreamArgs {
    /// Store directory (from `sluiced pack` or `sluiced synth`), or a store's name in the
    /// models directory.
    pub dir: PathBuf,
    /// Device budget for the weights as a share of the model's raw size (e.g. 50%), on top
    /// of KV cache, workspace and streaming slots; or an absolute --device-memory.
    #[arg(long, default_value = "50%")]
    pub weights_budget: String,
    /// Total device budget (overrides --weights-budget).
    #[arg(long, value_parser = parse_size)]
    pub device_memory: Option<u64>,
    /// Host memory for decompressed copies of streamed layers (discrete GPUs).
    #[arg(long, value_parser = parse_size, default_value = "0")]
    pub host_cache: u64,
    /// Host memory the streamed run may use in all (on the CPU backend the arena too);
    /// without --device-memory it alone decides what streams.
    #[arg(long, value_parser = parse_size)]
    pub host_memory: Option<u64>,
    /// Layers requested ahead of the one computing (default: from the plan).
    #[arg(long)]
    pub prefetch: Option<usize>,
    /// Expert-cache slots for a mixture of experts whose layers stream (each holds one
    /// expert; default: as many as the memory left after the plan holds).
    #[arg(long)]
    pub expert_cache: Option<usize>,
    /// How the expert cache evicts: frequency or lru.
    #[arg(long, default_value = "frequency")]
    pub expert_eviction: sluice::pipeline::Eviction,
    /// How streamed experts are requested before their layer routes: lookahead, previous
    /// or off.
    #[arg(long, default_value = "lookahead")]
    pub expert_prediction: sluice::pipeline::Prediction,
    /// An expert profile (`sluiced run --save-expert-profile`) for the streamed runs.
    #[arg(long, value_name = "PATH")]
    pub expert_profile: Option<PathBuf>,
    /// Batch sizes to measure decode at, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
    pub batch: Vec<usize>,
    /// Decode steps measured per batch size.
    #[arg(long, default_value_t = 4)]
    pub steps: usize,
    /// Prompt tokens per sequence before the measured steps.
    #[arg(long, default_value_t = 4)]
    pub prompt_tokens: usize,
    /// Compute threads of the CPU backend (0: all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// auto, cpu or cuda.
    #[arg(long, default_value = "auto")]
    pub backend: BackendChoice,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
}

/// `--weights-budget PCT`'s device budget: KV cache, workspace and slots, and that share of
/// the weights (`bench_stream::budget_for_weights_share`).
pub fn weights_share_budget(
    weights_budget: &str,
    store: &Store,
    opts: sluice::model::ModelOptions,
    prefetch: Option<usize>,
    chosen: &sluice::engine::Chosen,
) -> Result<u64> {
    let pct: f64 = weights_budget
        .trim_end_matches('%')
        .parse()
        .with_context(|| {
            format!("--weights-budget {weights_budget:?}: expected a percentage like 50%")
        })?;
    Ok(bench_stream::budget_for_weights_share(
        store, opts, prefetch, pct, chosen,
    )?)
}

pub fn run_stream(a: BenchStreamArgs) -> Result<std::process::ExitCode> {
    let BenchStreamArgs {
        dir,
        weights_budget,
        device_memory,
        host_cache,
        host_memory,
        prefetch,
        expert_cache,
        expert_eviction,
        expert_prediction,
        expert_profile,
        batch,
        steps,
        prompt_tokens,
        threads,
        backend,
        device,
        json,
    } = a;
    let store = std::sync::Arc::new(Store::open(&sluice::util::store_path(&dir, None))?);
    let expert_profile = match &expert_profile {
        Some(p) => Some(sluice::pipeline::ExpertProfile::load(
            p,
            &store.manifest().arch,
        )?),
        None => None,
    };
    let chosen = sluice::engine::choose_backend(backend, device)?;
    if batch.is_empty() {
        anyhow::bail!("--batch is empty");
    }
    let budget = match (device_memory, host_memory) {
        (Some(b), _) => Some(b),
        (None, Some(_)) => None,
        (None, None) => {
            let opts = bench_stream::model_options(&batch, prompt_tokens, steps);
            Some(weights_share_budget(
                &weights_budget,
                &store,
                opts,
                prefetch,
                &chosen,
            )?)
        }
    };
    let o = bench_stream::BenchStreamOptions {
        device_budget: budget,
        host_cache_budget: host_cache,
        host: host_memory.map(|b| sluice::engine::host_input(Some(b), 0)),
        prefetch,
        expert_cache,
        expert_eviction,
        expert_prediction,
        expert_profile,
        threads,
        io: sluice::io::IoConfig::serving(),
        batches: batch,
        steps,
        prompt_tokens,
    };
    let r = bench_stream::run(&chosen, store, &o)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        println!("model {} raw, device budget {} ({} units resident, {} streamed); per pass {} from disk, {} uploaded", fmt_bytes(r.model_raw_bytes), fmt_bytes(r.device_budget), r.layers_resident, r.layers_streamed, fmt_bytes(r.disk_bytes_per_pass), fmt_bytes(r.upload_bytes_per_pass));
        println!("backend {}", r.backend);
        if let Some(h) = r.host_bytes_budget {
            println!(
                "host budget {}: planned {}, peak {} (VmHWM)",
                fmt_bytes(h),
                fmt_bytes(r.host_bytes_planned),
                fmt_bytes(r.host_bytes_peak)
            );
        }
        println!("pass time: compute-only {:.2} ms, streaming-only {:.2} ms, streamed {:.2} ms -> streamed / max = {:.3}", r.compute_only_pass_s * 1e3, r.streaming_only_pass_s * 1e3, r.streamed_pass_s * 1e3, r.overlap_ratio);
        println!(
            "decode batch 1: {:.1} tokens/s all resident, {:.1} tokens/s streamed",
            r.resident_tokens_per_s, r.streamed_tokens_per_s
        );
        if r.copy_gbps > 0.0 {
            println!("copy stream while streaming {:.2} GB/s; plain pinned cuMemcpyHtoD {:.2} GB/s -> ratio {:.3}", r.copy_gbps, r.plain_h2d_gbps, r.copy_vs_plain);
        }
        println!(
            "{:>6} {:>10} {:>12} {:>10} {:>12} {:>12}",
            "batch", "pass ms", "tokens/s", "vs linear", "stall ms", "compute ms"
        );
        for b in &r.batches {
            println!(
                "{:>6} {:>10.2} {:>12.1} {:>10.3} {:>12.2} {:>12.2}",
                b.batch,
                b.pass_s * 1e3,
                b.tokens_per_s,
                b.vs_linear,
                b.load_stall_s_per_pass * 1e3,
                b.compute_s_per_pass * 1e3
            );
        }
        if r.batches.iter().any(|b| b.experts.is_some()) {
            println!(
                "experts: cache {} slots ({} pinned from a profile), eviction {:?}, prediction {:?}",
                r.expert_cache_slots, r.expert_hot_slots, r.expert_eviction, r.expert_prediction
            );
            println!(
                "{:>6} {:>12} {:>12} {:>9} {:>12} {:>9} {:>9} {:>9} {:>10}",
                "batch",
                "read/token",
                "missed/tok",
                "read/miss",
                "whole/token",
                "whole/rd",
                "routed/t",
                "hit rate",
                "precision"
            );
            for b in &r.batches {
                let Some(e) = &b.experts else { continue };
                println!(
                    "{:>6} {:>12} {:>12} {:>9.3} {:>12} {:>9.1} {:>9.1} {:>9.3} {:>10.3}",
                    b.batch,
                    fmt_bytes(e.bytes_read_per_token as u64),
                    fmt_bytes(e.expert_bytes_missed_per_token as u64),
                    e.read_vs_missed,
                    fmt_bytes(e.whole_layer_bytes_per_token as u64),
                    e.whole_layer_vs_read,
                    e.experts_routed_per_token,
                    e.cache_hit_rate,
                    e.prediction_precision
                );
            }
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}

#[derive(clap::Args)]
pub struct BenchIoArgs {
    /// Store directory (from `sluiced pack` or `sluiced synth`), or a store's name in the
    /// models directory.
    pub dir: PathBuf,
    /// auto, uring or pread.
    #[arg(long, default_value = "auto")]
    pub engine: sluice::io::ReaderChoice,
    /// Reads in flight.
    #[arg(long, default_value_t = sluice::io::QUEUE_DEPTH_DEFAULT)]
    pub qd: usize,
    /// Bytes per read request.
    #[arg(long, default_value = "4MiB", value_parser = parse_size)]
    pub request_size: u64,
    /// Bytes of reads in flight at most, whatever the queue depth (the disk serves what it
    /// holds side by side: fewer bytes out land the oldest reads sooner).
    #[arg(long, default_value = "32MiB", value_parser = parse_size)]
    pub in_flight: u64,
    /// Reads of a unit behind the oldest unfinished one go out only while fewer bytes than
    /// this are in flight (the disk then serves the units in order).
    #[arg(long, default_value = "2MiB", value_parser = parse_size)]
    pub follow: u64,
    /// Read buffers (default: the queue depth): those past the bytes in flight hold what
    /// has landed until a worker decodes it.
    #[arg(long)]
    pub read_buffers: Option<usize>,
    /// Decompression workers (default: cores - 1).
    #[arg(long)]
    pub workers: Option<usize>,
    /// Staging slots; the benchmark keeps all but one requested ahead.
    #[arg(long, default_value_t = 4)]
    pub slots: usize,
    /// Decoding passes over the store, each between two read-only passes (the disk drifts:
    /// each is held against the read rate measured around it).
    #[arg(long, default_value_t = 5)]
    pub passes: usize,
    /// Read through the page cache instead of O_DIRECT.
    #[arg(long)]
    pub buffered: bool,
    /// Only the read pass (decoding off): prints {"engine", "raw_read_gbps"}.
    #[arg(long)]
    pub raw_only: bool,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

pub fn run_io(a: BenchIoArgs) -> Result<std::process::ExitCode> {
    let BenchIoArgs {
        dir,
        engine,
        qd,
        request_size,
        in_flight,
        follow,
        read_buffers,
        workers,
        slots,
        passes,
        buffered,
        raw_only,
        json,
    } = a;
    let store = std::sync::Arc::new(Store::open(&sluice::util::store_path(&dir, None))?);
    let defaults = sluice::io::IoConfig::default();
    let cfg = sluice::io::IoConfig {
        reader: engine,
        direct: !buffered,
        queue_depth: qd,
        in_flight_bytes: usize::try_from(in_flight).context("--in-flight")?,
        follow_bytes: usize::try_from(follow).context("--follow")?,
        request_bytes: usize::try_from(request_size).context("--request-size")?,
        read_buffers: read_buffers.unwrap_or(qd),
        staging_slots: slots.max(2),
        workers: workers.unwrap_or(defaults.workers),
        pread_threads: qd.min(64),
        decompress: true,
        read_into_slots: defaults.read_into_slots,
        register_slots: defaults.register_slots,
        units: None,
        slot_bytes: None,
        pinner: None,
        read_timeout: defaults.read_timeout,
    };
    let opts = sluice::io::bench::BenchIoOptions {
        cfg,
        passes: passes.max(1),
        ahead: slots.max(2) - 1,
        core_sample_bytes: 512 << 20,
    };
    if raw_only {
        let (engine, gbps, depth) = sluice::io::bench::bench_raw_read(store, &opts)?;
        println!(
            "{}",
            serde_json::json!({"engine": engine, "raw_read_gbps": gbps, "queue_depth_avg": depth})
        );
        return Ok(std::process::ExitCode::SUCCESS);
    }
    let report = sluice::io::bench::bench_io(store, &opts)?;
    if json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print_bench_io(&report);
    }
    Ok(std::process::ExitCode::SUCCESS)
}

fn print_bench_io(r: &sluice::io::bench::BenchIoReport) {
    println!(
        "engine {}{} (qd {}, {} in flight at most, {} behind the oldest unit, request {}, {} read buffers, {} workers), {} passes over {} units",
        r.engine,
        if r.direct {
            " + O_DIRECT"
        } else {
            " (buffered)"
        },
        r.queue_depth,
        fmt_bytes(r.in_flight_bytes as u64),
        fmt_bytes(r.follow_bytes as u64),
        fmt_bytes(r.request_bytes as u64),
        r.read_buffers,
        r.workers,
        r.passes,
        r.units
    );
    if !r.fallback_reason.is_empty() {
        println!("fallback: {}", r.fallback_reason);
    }
    println!("page cache between passes: {}", r.cache_drop);
    println!(
        "per pass: {} stored -> {} raw (ratio {:.3})",
        fmt_bytes(r.stored_bytes_per_pass),
        fmt_bytes(r.raw_bytes_per_pass),
        r.ratio
    );
    println!();
    println!("{:<34} {:>10}", "rate", "GB/s");
    println!("{:<34} {:>10.3}", "read (compressed bytes)", r.read_gbps);
    println!(
        "{:<34} {:>10.3}",
        "decompressed bytes produced", r.decompressed_gbps
    );
    println!(
        "{:<34} {:>10.3}",
        "limit: raw read, decode off", r.raw_read_gbps
    );
    println!(
        "{:<34} {:>10.3}",
        "limit: one core decoding to a slot", r.core_decompress_gbps
    );
    println!(
        "{:<34} {:>10.3}",
        "  (into a cached frame buffer)", r.core_decompress_hot_gbps
    );
    println!(
        "{:<34} {:>10.3}",
        "bound min(read/ratio, workers*core)", r.bound_gbps
    );
    let each: Vec<String> = r.bound_ratios.iter().map(|x| format!("{x:.3}")).collect();
    println!(
        "{:<34} {:>10.3}  (median of passes, each against its neighbours' read rate: {})",
        "decompressed / bound",
        r.bound_ratio,
        each.join(" ")
    );
    println!();
    let st = &r.stalls;
    println!("{:<34} {:>10}", "stage time", "seconds");
    println!("{:<34} {:>10.3}", "wall", r.seconds);
    println!(
        "{:<34} {:>10.3}",
        "disk busy (a read in flight)", st.read_busy_s
    );
    println!(
        "{:<34} {:>10.3}",
        "decode busy (summed over workers)", st.decompress_busy_s
    );
    println!(
        "{:<34} {:>10.3}",
        "stall: consumer waiting for layers", st.consumer_wait_s
    );
    println!(
        "{:<34} {:>10.3}",
        "stall: reads waiting for buffers", st.read_buffer_s
    );
    println!(
        "{:<34} {:>10.3}",
        "stall: requests waiting for slots", st.staging_slot_s
    );
    if r.short_reads > 0 {
        println!("short reads resubmitted: {}", r.short_reads);
    }
}

#[derive(clap::Args)]
pub struct BenchCodecArgs {
    /// A store directory, a .safetensors file or a .gguf.
    pub src: PathBuf,
    /// Codecs to measure, comma-separated.
    #[arg(
        long,
        default_value = "none,lz4,zstd:1,zstd:3,float,float-fast",
        value_delimiter = ','
    )]
    pub codecs: Vec<Codec>,
    /// Frame size, as `pack --frame-size`.
    #[arg(long, default_value = "1MiB", value_parser = crate::util::parse_size_u32)]
    pub frame_size: u32,
    /// Bytes of each dtype measured at most (whole tensors in file order; at least one).
    #[arg(long, default_value = "256MiB", value_parser = parse_size)]
    pub max_bytes: u64,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// `sluiced bench-codec`: ratio and one core's compress and decompress rates of every
/// codec, per dtype, on the same bytes.
pub fn run_codec(a: BenchCodecArgs) -> Result<std::process::ExitCode> {
    let groups =
        crate::codec::load(&a.src, a.max_bytes, a.frame_size).map_err(anyhow::Error::msg)?;
    let mut figures = Vec::new();
    for g in &groups {
        figures.push(
            crate::codec::measure(g, &a.codecs, a.frame_size as usize)
                .map_err(anyhow::Error::msg)?,
        );
    }
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "source": a.src.display().to_string(),
                "frame_size": a.frame_size,
                "groups": figures,
            })
        );
        return Ok(std::process::ExitCode::SUCCESS);
    }
    println!(
        "{}: frames of {}; one core each",
        a.src.display(),
        sluice::util::fmt_bytes(a.frame_size as u64)
    );
    for g in &figures {
        println!(
            "\n{} ({} tensors in {} frames cut as {}, {})",
            g.dtype,
            g.tensors,
            g.frames,
            match g.framing {
                crate::codec::Framing::Store => "the store's",
                crate::codec::Framing::Pack => "pack cuts them",
                crate::codec::Framing::Tensor => "one tensor at a time",
            },
            sluice::util::fmt_bytes(g.bytes)
        );
        println!(
            "  {:<8} {:>7} {:>15} {:>17}",
            "codec", "ratio", "compress GB/s", "decompress GB/s"
        );
        for c in &g.codecs {
            println!(
                "  {:<8} {:>7.4} {:>15.3} {:>17.3}",
                c.codec, c.ratio, c.compress_gbps, c.decompress_gbps
            );
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}

#[derive(clap::Args)]
pub struct BenchKernelsArgs {
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Timed samples per figure (each 20 launches in a row; the median is reported).
    #[arg(long, default_value_t = 9)]
    pub reps: usize,
    /// A store to time whole decode steps of, everything resident on the device, at
    /// batch 1, 8 and 64 (as bench-stream at --weights-budget 100%).
    #[arg(long, value_name = "DIR")]
    pub model: Option<PathBuf>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// The step time of a model all resident, per batch size.
#[derive(serde::Serialize)]
struct ResidentStep {
    batch: usize,
    step_s: f64,
    tokens_per_s: f64,
    /// This batch's step time over batch 1's.
    vs_batch_1: f64,
}

/// `sluiced bench-kernels` (CUDA only): each decode GEMV's effective bandwidth per weight
/// type at 1, 8 and 64 rows against the device's own copy bandwidth, attention at growing
/// contexts, and a mixture's decode step against the bytes of the experts it uses.
pub fn run_kernels(a: BenchKernelsArgs) -> Result<std::process::ExitCode> {
    let info = sluice::engine::cuda_usable(a.device).map_err(|e| {
        anyhow::anyhow!("bench-kernels measures the CUDA kernels and needs a CUDA device: {e}")
    })?;
    let r = sluice::backend::cuda::bench::run(info.ordinal, a.reps)?;
    let steps = match &a.model {
        Some(dir) => resident_steps(dir, info)?,
        None => Vec::new(),
    };
    if a.json {
        let mut v = serde_json::to_value(&r)?;
        v["resident_steps"] = serde_json::to_value(&steps)?;
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(std::process::ExitCode::SUCCESS);
    }
    println!(
        "{} (sm_{}{}): device-to-device copy {:.0} GB/s (bytes read + written)",
        r.device, r.compute_capability.0, r.compute_capability.1, r.copy_gbps
    );
    // The GEMV and mixture tables: (dtype, what, rows, rate) a line.
    use sluice::backend::cuda::bench::WeightRate;
    let table = |what: &str, lines: Vec<(&str, String, usize, &WeightRate)>| {
        println!(
            "{:>6} {what:>15} {:>5} {:>10} {:>10} {:>8} {:>8}",
            "dtype", "rows", "weights", "us", "GB/s", "vs copy"
        );
        for (dtype, what, rows, t) in lines {
            println!(
                "{dtype:>6} {what:>15} {rows:>5} {:>10} {:>10.1} {:>8.0} {:>8.3}",
                fmt_bytes(t.weight_bytes),
                t.seconds * 1e6,
                t.gbps,
                t.vs_copy
            );
        }
    };
    let gemv = r.gemv.iter();
    table(
        "m x k",
        gemv.map(|g| (&*g.dtype, format!("{}x{}", g.m, g.k), g.rows, &g.rate))
            .collect(),
    );
    println!(
        "{:>8} {:>24} {:>10} {:>9} {:>10}",
        "context", "heads / kv / dim, cache", "us", "vs first", "KV GB/s"
    );
    for t in &r.attention {
        println!(
            "{:>8} {:>24} {:>10.1} {:>9.2} {:>10.0}",
            t.context,
            format!(
                "{} / {} / {}, {}",
                t.heads, t.kv_heads, t.head_dim, t.kv_dtype
            ),
            t.seconds * 1e6,
            t.vs_first,
            t.kv_gbps
        );
    }
    let experts = r.experts.iter().map(|e| {
        let what = format!("top-{}, {} used", e.top_k, e.experts);
        (&*e.dtype, what, e.rows, &e.rate)
    });
    table("mixture step", experts.collect());
    if let Some(e) = &r.experts_error {
        println!("mixture step: failed: {e}");
    }
    if let Some(dir) = &a.model {
        println!("{}, all resident:", dir.display());
        println!(
            "{:>6} {:>10} {:>10} {:>11}",
            "batch", "step ms", "tokens/s", "vs batch 1"
        );
        for s in &steps {
            println!(
                "{:>6} {:>10.2} {:>10.1} {:>11.2}",
                s.batch,
                s.step_s * 1e3,
                s.tokens_per_s,
                s.vs_batch_1
            );
        }
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// Decode steps of the store at `dir` with every weight on the device, at batch 1, 8, 64.
fn resident_steps(
    dir: &std::path::Path,
    info: sluice::backend::cuda::DeviceInfo,
) -> Result<Vec<ResidentStep>> {
    let store = std::sync::Arc::new(Store::open(&sluice::util::store_path(dir, None))?);
    let chosen = sluice::engine::Chosen::Cuda(info);
    let batches = vec![1, 8, 64];
    let (steps, prompt_tokens) = (8, 16);
    let opts = bench_stream::model_options(&batches, prompt_tokens, steps);
    let budget = bench_stream::budget_for_weights_share(&store, opts, None, 100.0, &chosen)?;
    let o = bench_stream::BenchStreamOptions {
        device_budget: Some(budget),
        host_cache_budget: 0,
        host: None,
        prefetch: None,
        expert_cache: None,
        expert_eviction: Default::default(),
        expert_prediction: Default::default(),
        expert_profile: None,
        threads: 0,
        io: sluice::io::IoConfig::serving(),
        batches,
        steps,
        prompt_tokens,
    };
    let r = bench_stream::run(&chosen, store, &o)?;
    let one = r.batches.first().map_or(f64::NAN, |b| b.pass_s);
    Ok(r.batches
        .iter()
        .map(|b| ResidentStep {
            batch: b.batch,
            step_s: b.pass_s,
            tokens_per_s: b.tokens_per_s,
            vs_batch_1: b.pass_s / one,
        })
        .collect())
}
