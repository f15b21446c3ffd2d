//! `sluiced`: the sluice daemon and its model tools (pack, inspect, verify).

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use sluice::engine::BackendChoice;
use sluice::store::{self, Codec, Store};
use sluice::util::{fmt_bytes, parse_size};
use std::path::PathBuf;
use std::time::Instant;

#[path = "sluiced/serve.rs"]
mod serve;

#[derive(Parser)]
#[command(
    name = "sluiced",
    version,
    about = "Run LLMs larger than accelerator memory by streaming compressed layers from NVMe"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Pack a GGUF file or a Hugging Face model directory into a sluice store.
    Pack {
        /// A .gguf file, or a directory with config.json, *.safetensors and tokenizer.json.
        src: PathBuf,
        /// Output store directory (must not exist unless --force).
        #[arg(short, long)]
        output: PathBuf,
        /// Frame codec: none, lz4, zstd or zstd:N.
        #[arg(long, default_value = "zstd:3", value_parser = parse_codec)]
        codec: Codec,
        /// Uncompressed bytes per frame (e.g. 1MiB).
        #[arg(long, default_value = "1MiB", value_parser = parse_size_u32)]
        frame_size: u32,
        /// Compression threads (default: all cores).
        #[arg(long)]
        threads: Option<usize>,
        /// Replace an existing store at the output path.
        #[arg(long)]
        force: bool,
    },
    /// Print a store's config, per-layer sizes and compression ratios.
    Inspect {
        dir: PathBuf,
        /// Print one JSON object instead of tables.
        #[arg(long)]
        json: bool,
    },
    /// Read every frame of a store and check every checksum.
    Verify { dir: PathBuf },
    /// Generate text from a prompt (CPU or CUDA backend) and report tokens/s.
    Run(RunArgs),
    /// Serve sluice.v1.Inference over gRPC (flags override the config file).
    Serve(ServeArgs),
    /// Write a synthetic Llama-shaped store with random weights, for benchmarks.
    Synth {
        #[arg(short, long)]
        output: PathBuf,
        /// Decoder layers (or give --size).
        #[arg(long)]
        layers: Option<u32>,
        /// Pick the layer count so the model's raw size is about this (e.g. 4GiB).
        #[arg(long, value_parser = parse_size)]
        size: Option<u64>,
        #[arg(long, default_value_t = 2048)]
        hidden: u32,
        /// Matrix dtype: f32, f16, bf16, q8_0, q4_0 or q4_1.
        #[arg(long, default_value = "bf16", value_parser = parse_dtype)]
        dtype: sluice::dtype::DType,
        /// Default: ~8/3 hidden rounded to 256.
        #[arg(long)]
        intermediate: Option<u32>,
        #[arg(long)]
        heads: Option<u32>,
        #[arg(long)]
        kv_heads: Option<u32>,
        #[arg(long, default_value_t = 32000)]
        vocab: u32,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, default_value = "zstd:1", value_parser = parse_codec)]
        codec: Codec,
        #[arg(long, default_value = "1MiB", value_parser = parse_size_u32)]
        frame_size: u32,
        #[arg(long)]
        force: bool,
    },
    /// Measure streaming: overlap (pass time vs compute-only and streaming-only) and decode
    /// tokens/s at several batch sizes under a device budget.
    BenchStream {
        dir: PathBuf,
        /// Device budget for the weights as a share of the model's raw size (e.g. 50%), on top
        /// of KV cache, workspace and streaming slots; or an absolute --device-memory.
        #[arg(long, default_value = "50%")]
        weights_budget: String,
        /// Total device budget (overrides --weights-budget).
        #[arg(long, value_parser = parse_size)]
        device_memory: Option<u64>,
        #[arg(long, value_parser = parse_size, default_value = "0")]
        host_cache: u64,
        #[arg(long)]
        prefetch: Option<usize>,
        #[arg(long, value_delimiter = ',', default_value = "1,8,32,64")]
        batch: Vec<usize>,
        #[arg(long, default_value_t = 4)]
        steps: usize,
        #[arg(long, default_value_t = 4)]
        prompt_tokens: usize,
        #[arg(long, default_value_t = 0)]
        threads: usize,
        /// auto, cpu or cuda.
        #[arg(long, default_value = "auto")]
        backend: BackendChoice,
        /// CUDA device ordinal.
        #[arg(long, default_value_t = 0)]
        device: usize,
        #[arg(long)]
        json: bool,
    },
    /// Stream every layer of a store through the I/O engine and report rates against
    /// their limits measured in the same run.
    BenchIo {
        dir: PathBuf,
        /// auto, uring or pread.
        #[arg(long, default_value = "auto")]
        engine: sluice::io::EngineChoice,
        /// Reads in flight.
        #[arg(long, default_value_t = sluice::io::QUEUE_DEPTH_DEFAULT)]
        qd: usize,
        /// Bytes per read request.
        #[arg(long, default_value = "4MiB", value_parser = parse_size)]
        request_size: u64,
        /// Read buffers (default: the queue depth).
        #[arg(long)]
        read_buffers: Option<usize>,
        /// Decompression workers (default: cores - 1).
        #[arg(long)]
        workers: Option<usize>,
        /// Staging slots; the benchmark keeps all but one requested ahead.
        #[arg(long, default_value_t = 4)]
        slots: usize,
        #[arg(long, default_value_t = 3)]
        passes: usize,
        /// Read through the page cache instead of O_DIRECT.
        #[arg(long)]
        buffered: bool,
        /// Only the read pass (decoding off): prints {"engine", "raw_read_gbps"}.
        #[arg(long)]
        raw_only: bool,
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
    },
}

#[derive(clap::Args)]
struct ServeArgs {
    /// Store directory.
    #[arg(long)]
    model: Option<PathBuf>,
    /// Config file (default /etc/sluice/sluiced.toml when it exists).
    #[arg(long)]
    config: Option<PathBuf>,
    /// TCP address (default 127.0.0.1:50051).
    #[arg(long)]
    listen: Option<String>,
    /// Also serve on this Unix socket.
    #[arg(long)]
    unix: Option<PathBuf>,
    #[arg(long)]
    device_memory: Option<String>,
    #[arg(long)]
    host_cache: Option<String>,
    #[arg(long)]
    max_batch: Option<usize>,
    #[arg(long)]
    max_context: Option<usize>,
    #[arg(long)]
    batch_tokens: Option<usize>,
    #[arg(long)]
    queue_max: Option<usize>,
    #[arg(long)]
    prefetch: Option<usize>,
    #[arg(long)]
    threads: Option<usize>,
    /// auto, cpu or cuda.
    #[arg(long)]
    backend: Option<BackendChoice>,
    /// CUDA device ordinal.
    #[arg(long)]
    device: Option<usize>,
    #[arg(long)]
    shutdown_grace_s: Option<u64>,
}

impl ServeArgs {
    fn config(self) -> Result<sluice::server::ServeConfig> {
        let mut c = sluice::server::ServeConfig::load(self.config.as_deref())
            .map_err(anyhow::Error::msg)?;
        macro_rules! set {
            ($($f:ident),*) => { $(if let Some(v) = self.$f { c.$f = v; })* };
        }
        set!(
            listen,
            max_batch,
            max_context,
            batch_tokens,
            queue_max,
            threads,
            shutdown_grace_s,
            host_cache,
            backend,
            device
        );
        if self.model.is_some() {
            c.model = self.model;
        }
        if self.unix.is_some() {
            c.unix = self.unix;
        }
        if self.device_memory.is_some() {
            c.device_memory = self.device_memory;
        }
        if self.prefetch.is_some() {
            c.prefetch = self.prefetch;
        }
        Ok(c)
    }
}

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["prompt", "prompt_file", "prompt_ids"])))]
struct RunArgs {
    /// Store directory (from `sluiced pack`).
    dir: PathBuf,
    #[arg(long)]
    prompt: Option<String>,
    /// Read the prompt from a file.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Token ids given directly, e.g. 1,2,3 (no template, no BOS added).
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Render the prompt as a user message with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// A system message (with --chat).
    #[arg(long)]
    system: Option<String>,
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    #[arg(long, default_value_t = 1.0)]
    top_p: f32,
    #[arg(long, default_value_t = 0.0)]
    min_p: f32,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Stop when the text contains this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Keep generating past end tokens (benchmarks).
    #[arg(long)]
    ignore_eos: bool,
    /// Positions of KV cache (default: the model's context, at most 4096).
    #[arg(long)]
    max_context: Option<usize>,
    /// Tokens per prefill step.
    #[arg(long, default_value_t = 512)]
    batch_tokens: usize,
    /// Device memory budget (e.g. 64MiB, 32GiB); below the model's size, layers stream.
    /// Default: enough for every layer resident.
    #[arg(long, value_parser = parse_size)]
    device_memory: Option<u64>,
    /// Host memory for decompressed copies of streamed layers.
    #[arg(long, value_parser = parse_size, default_value = "0")]
    host_cache: u64,
    /// Layers requested ahead of the one computing.
    #[arg(long)]
    prefetch: Option<usize>,
    /// Compute threads of the CPU backend (default: all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// auto (CUDA when a usable GPU is there, else the CPU, saying why), cpu or cuda.
    #[arg(long, default_value = "auto")]
    backend: BackendChoice,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// Print one JSON object instead of the text.
    #[arg(long)]
    json: bool,
}

fn parse_dtype(s: &str) -> Result<sluice::dtype::DType, String> {
    sluice::dtype::ALL_DTYPES
        .iter()
        .copied()
        .find(|d| d.name() == s)
        .ok_or_else(|| format!("unknown dtype {s:?}: expected f32, f16, bf16, q8_0, q4_0 or q4_1"))
}

fn parse_codec(s: &str) -> Result<Codec, String> {
    s.parse()
}

fn parse_size_u32(s: &str) -> Result<u32, String> {
    let b = parse_size(s)?;
    u32::try_from(b).map_err(|_| format!("{s} is over 4 GiB"))
}

fn progress_bar(total: u64, what: &str) -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::new(total);
    let style = indicatif::ProgressStyle::with_template(
        "{msg} [{bar:40}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
    )
    .map(|s| s.progress_chars("=> "))
    .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar());
    pb.set_style(style);
    pb.set_message(what.to_string());
    pb
}

fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if let Cmd::Serve(a) = cli.cmd {
        // The daemon keeps the default SIGPIPE handling (ignored) for its sockets.
        return match a.config().and_then(serve::serve) {
            Ok(()) => std::process::ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e:#}");
                std::process::ExitCode::FAILURE
            }
        };
    }
    // The model tools write tables for pipes like `| head`: die quietly on a closed pipe
    // as Unix tools do, instead of panicking in println!.
    // SAFETY: setting a signal disposition to SIG_DFL at start, before any thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
    match run(cli) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run(cli: Cli) -> Result<std::process::ExitCode> {
    match cli.cmd {
        Cmd::Serve(_) => unreachable!("handled in main"),
        Cmd::BenchStream {
            dir,
            weights_budget,
            device_memory,
            host_cache,
            prefetch,
            batch,
            steps,
            prompt_tokens,
            threads,
            backend,
            device,
            json,
        } => {
            let store = std::sync::Arc::new(Store::open(&dir)?);
            let chosen = sluice::engine::choose_backend(backend, device)?;
            let m = store.manifest();
            let max_batch = *batch.iter().max().context("--batch is empty")?;
            let opts = sluice::model::ModelOptions {
                max_context: prompt_tokens + steps + 2,
                kv_slots: max_batch,
                max_batch_tokens: (max_batch * prompt_tokens).max(max_batch),
            };
            let budget = match device_memory {
                Some(b) => b,
                None => {
                    let pct: f64 = weights_budget.trim_end_matches('%').parse().with_context(|| format!("--weights-budget {weights_budget:?}: expected a percentage like 50%"))?;
                    // KV cache and workspace as the plan reserves them, plus the share of the
                    // weights, which must hold the streaming slots too.
                    let p = sluice::plan::plan(
                        m,
                        &sluice::plan::PlanInput {
                            device_budget: None,
                            host_cache_budget: 0,
                            opts,
                            prefetch,
                            backend_reserved: 0,
                        },
                    )?;
                    let scratch = match chosen {
                        sluice::engine::Chosen::Cuda(_) => {
                            sluice::backend::cuda::scratch_bytes(&opts.scratch_shape(&m.arch))
                        }
                        sluice::engine::Chosen::Cpu { .. } => 0,
                    };
                    p.kv_cache_bytes
                        + p.workspace_bytes
                        + scratch
                        + (p.resident_bytes as f64 * pct / 100.0) as u64
                }
            };
            let io = sluice::io::IoConfig {
                queue_depth: 32,
                read_buffers: 32,
                ..Default::default()
            };
            let o = sluice::engine::bench_stream::BenchStreamOptions {
                device_budget: budget,
                host_cache_budget: host_cache,
                prefetch,
                threads,
                io,
                batches: batch,
                steps,
                prompt_tokens,
            };
            let r = match chosen {
                sluice::engine::Chosen::Cpu { .. } => sluice::engine::bench_stream::bench_stream(
                    store.clone(),
                    &o,
                    &|input| {
                        sluice::engine::cpu_runner(store.clone(), input, threads, o.io.clone())
                    },
                )?,
                sluice::engine::Chosen::Cuda(info) => sluice::engine::bench_stream::bench_stream(
                    store.clone(),
                    &o,
                    &|input| sluice::engine::cuda_runner(store.clone(), input, &info, o.io.clone()),
                )?,
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&r)?);
            } else {
                println!("model {} raw, device budget {} ({} units resident, {} streamed); per pass {} from disk, {} uploaded", fmt_bytes(r.model_raw_bytes), fmt_bytes(r.device_budget), r.layers_resident, r.layers_streamed, fmt_bytes(r.disk_bytes_per_pass), fmt_bytes(r.upload_bytes_per_pass));
                println!("backend {}", r.backend);
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
            }
            Ok(std::process::ExitCode::SUCCESS)
        }
        Cmd::Run(a) => {
            run_prompt(a)?;
            Ok(std::process::ExitCode::SUCCESS)
        }
        Cmd::Synth {
            output,
            layers,
            size,
            hidden,
            dtype,
            intermediate,
            heads,
            kv_heads,
            vocab,
            seed,
            codec,
            frame_size,
            force,
        } => {
            let mut spec = sluice::import::synth::SynthSpec::llama_like(hidden, 0, dtype);
            spec.intermediate = intermediate.unwrap_or(spec.intermediate);
            spec.heads = heads.unwrap_or(spec.heads);
            spec.kv_heads = kv_heads.unwrap_or(if heads.is_some() {
                spec.heads
            } else {
                spec.kv_heads
            });
            spec.vocab = vocab;
            spec.seed = seed;
            let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
            synth(
                output,
                layers,
                size,
                spec,
                store::writer::PackOptions {
                    codec,
                    frame_size,
                    threads,
                    force,
                },
            )?;
            Ok(std::process::ExitCode::SUCCESS)
        }
        Cmd::BenchIo {
            dir,
            engine,
            qd,
            request_size,
            read_buffers,
            workers,
            slots,
            passes,
            buffered,
            raw_only,
            json,
        } => {
            let store = std::sync::Arc::new(Store::open(&dir)?);
            let defaults = sluice::io::IoConfig::default();
            let cfg = sluice::io::IoConfig {
                engine,
                direct: !buffered,
                queue_depth: qd,
                request_bytes: usize::try_from(request_size).context("--request-size")?,
                read_buffers: read_buffers.unwrap_or(qd),
                staging_slots: slots.max(2),
                workers: workers.unwrap_or(defaults.workers),
                pread_threads: qd.min(64),
                decompress: true,
                units: None,
                pinner: None,
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
        Cmd::Pack {
            src,
            output,
            codec,
            frame_size,
            threads,
            force,
        } => {
            let t0 = Instant::now();
            let model =
                sluice::import::open(&src).with_context(|| format!("import {}", src.display()))?;
            let units = model.units()?;
            let total: u64 = model.tensors.values().map(|t| t.len).sum();
            let opts = store::writer::PackOptions {
                codec,
                frame_size,
                threads: threads
                    .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get())),
                force,
            };
            let pb = progress_bar(total, "packing");
            let report = store::writer::pack(&model, &units, &output, &opts, |b| pb.inc(b))?;
            pb.finish_and_clear();
            let secs = t0.elapsed().as_secs_f64();
            println!(
                "packed {} -> {}: {} units, {} frames, {} raw -> {} stored (ratio {:.3}, {codec}) in {secs:.2} s ({:.0} MB/s of raw input)",
                src.display(),
                output.display(),
                report.units,
                report.frames,
                fmt_bytes(report.raw_bytes),
                fmt_bytes(report.stored_bytes),
                report.stored_bytes as f64 / report.raw_bytes.max(1) as f64,
                report.raw_bytes as f64 / secs / 1e6,
            );
            Ok(std::process::ExitCode::SUCCESS)
        }
        Cmd::Inspect { dir, json } => {
            let store = Store::open(&dir)?;
            let s = store::inspect::summarize(store.manifest());
            if json {
                println!("{}", serde_json::to_string_pretty(&s)?);
            } else {
                print_summary(&dir, &s);
            }
            Ok(std::process::ExitCode::SUCCESS)
        }
        Cmd::Verify { dir } => {
            let store = Store::open(&dir)?;
            let pb = progress_bar(store.manifest().stored_bytes(), "verifying");
            let t0 = Instant::now();
            let report = store::verify::verify(&store, |b| pb.inc(b))?;
            pb.finish_and_clear();
            for f in &report.faults {
                eprintln!("bad frame: {f}");
            }
            let secs = t0.elapsed().as_secs_f64();
            if report.faults.is_empty() {
                println!(
                    "ok: {} units, {} frames, {} stored, {} raw checked in {secs:.2} s",
                    report.units,
                    report.frames,
                    fmt_bytes(report.stored_bytes),
                    fmt_bytes(report.raw_bytes)
                );
                Ok(std::process::ExitCode::SUCCESS)
            } else {
                bail!("{}: {} of {} frames are bad (listed above); repack the model or restore weights.bin", dir.display(), report.faults.len(), report.frames)
            }
        }
    }
}

fn synth(
    output: PathBuf,
    layers: Option<u32>,
    size: Option<u64>,
    spec: sluice::import::synth::SynthSpec,
    opts: store::writer::PackOptions,
) -> Result<()> {
    use sluice::import::synth;
    if spec.vocab < 256 {
        bail!(
            "--vocab {} is below 256 (the synthetic vocabulary holds every byte)",
            spec.vocab
        );
    }
    if spec.heads == 0
        || !spec.hidden.is_multiple_of(spec.heads)
        || spec.kv_heads == 0
        || !spec.heads.is_multiple_of(spec.kv_heads)
    {
        bail!(
            "--heads {} must divide --hidden {} and be a multiple of --kv-heads {}",
            spec.heads,
            spec.hidden,
            spec.kv_heads
        );
    }
    let mut spec = spec;
    spec.layers = match (layers, size) {
        (Some(l), _) => l,
        (None, Some(bytes)) => {
            (bytes.saturating_sub(spec.fixed_bytes()) / spec.layer_bytes().max(1)).max(1) as u32
        }
        (None, None) => bail!("give --layers N or --size SIZE"),
    };
    let model = synth::model(&spec);
    let units = model.units()?;
    println!(
        "note: random weights do not compress like trained ones: ratios and decode rates measured on this store differ from a real model's (trained bf16 reaches ~0.68 with zstd:1 + byte split; random bf16 does worse)"
    );
    let total: u64 = model.tensors.values().map(|t| t.len).sum();
    let pb = progress_bar(total, "synth");
    let t0 = Instant::now();
    let report = store::writer::pack(&model, &units, &output, &opts, |b| pb.inc(b))?;
    pb.finish_and_clear();
    println!(
        "wrote {}: {} layers x hidden {} ({}, intermediate {}, heads {}/{}), {} raw -> {} stored (ratio {:.3}, {}) in {:.1} s",
        output.display(),
        spec.layers,
        spec.hidden,
        spec.dtype,
        spec.intermediate,
        spec.heads,
        spec.kv_heads,
        fmt_bytes(report.raw_bytes),
        fmt_bytes(report.stored_bytes),
        report.stored_bytes as f64 / report.raw_bytes.max(1) as f64,
        opts.codec,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

fn run_prompt(a: RunArgs) -> Result<()> {
    use sluice::text::{ChatMessage, ChatTemplate, Tokenizer};
    let store = std::sync::Arc::new(Store::open(&a.dir)?);
    let m = store.manifest();
    let tok = Tokenizer::from_manifest(m)?;
    let prompt_ids = if let Some(ids) = a.prompt_ids.clone() {
        if let Some(bad) = ids.iter().find(|&&i| i >= m.arch.vocab) {
            bail!(
                "--prompt-ids: token id {bad} is past the vocabulary ({})",
                m.arch.vocab
            );
        }
        ids
    } else {
        let text = match (&a.prompt, &a.prompt_file) {
            (Some(p), _) => p.clone(),
            (None, Some(f)) => std::fs::read_to_string(f)
                .with_context(|| format!("read --prompt-file {}", f.display()))?,
            (None, None) => unreachable!("clap requires one input"),
        };
        if a.chat {
            let src = m
                .chat_template
                .as_deref()
                .context("--chat: this model has no chat template")?;
            let piece = |id: Option<u32>| id.map(|i| tok.piece(i)).unwrap_or_default();
            let t = ChatTemplate::new(src, piece(m.special.bos), piece(m.special.eos))?;
            let mut msgs = Vec::new();
            if let Some(s) = &a.system {
                msgs.push(ChatMessage {
                    role: "system".into(),
                    content: s.clone(),
                });
            }
            msgs.push(ChatMessage {
                role: "user".into(),
                content: text,
            });
            tok.encode(&t.render(&msgs, true)?, false)?
        } else {
            tok.encode(&text, true)?
        }
    };
    let max_context = a
        .max_context
        .unwrap_or((m.arch.max_context as usize).min(4096));
    let opts = sluice::model::ModelOptions {
        max_context,
        kv_slots: 1,
        max_batch_tokens: a.batch_tokens.max(1),
    };
    let input = sluice::plan::PlanInput {
        device_budget: a.device_memory,
        host_cache_budget: a.host_cache,
        opts,
        prefetch: a.prefetch,
        backend_reserved: 0,
    };
    let io = sluice::io::IoConfig {
        queue_depth: 16,
        read_buffers: 16,
        ..Default::default()
    };
    match sluice::engine::choose_backend(a.backend, a.device)? {
        sluice::engine::Chosen::Cpu { .. } => {
            let runner = sluice::engine::cpu_runner(store.clone(), &input, a.threads, io)?;
            let threads = runner.backend.threads();
            run_generate(runner, &a, &tok, &prompt_ids, threads)
        }
        sluice::engine::Chosen::Cuda(info) => {
            let runner = sluice::engine::cuda_runner(store.clone(), &input, &info, io)?;
            run_generate(runner, &a, &tok, &prompt_ids, 0)
        }
    }
}

/// Generates for `sluiced run` on whichever backend was chosen.
fn run_generate<B: sluice::backend::Backend>(
    mut runner: sluice::pipeline::Pipeline<B>,
    a: &RunArgs,
    tok: &sluice::text::Tokenizer,
    prompt_ids: &[u32],
    threads: usize,
) -> Result<()> {
    use sluice::engine::generate::{generate, GenerateParams};
    use sluice::text::SamplingParams;
    use std::io::Write;
    if !a.json {
        eprint!("{}", runner.plan.table());
    }
    let params = GenerateParams {
        max_tokens: a.max_tokens,
        sampling: SamplingParams {
            temperature: a.temperature,
            top_k: a.top_k,
            top_p: a.top_p,
            min_p: a.min_p,
            seed: a.seed,
        },
        stop: a.stop.clone(),
        ignore_eos: a.ignore_eos,
    };
    let stdout = std::io::stdout();
    let out = generate(&mut runner, tok, prompt_ids, &params, |piece| {
        if !a.json {
            let mut l = stdout.lock();
            let _ = l.write_all(piece.as_bytes());
            let _ = l.flush();
        }
    })?;
    let b = &runner.backend;
    let total = runner.total().clone();
    let passes = total.passes.max(1) as f64;
    let plan = &runner.plan;
    if a.json {
        let j = serde_json::json!({
            "prompt_token_ids": out.prompt_token_ids,
            "generated_token_ids": out.generated_token_ids,
            "text": out.text,
            "finish_reason": out.finish_reason,
            "prompt_tokens": out.prompt_token_ids.len(),
            "generated_tokens": out.generated_token_ids.len(),
            "prefill_s": out.prefill_s,
            "decode_s": out.decode_s,
            "prefill_tokens_per_s": out.prefill_tokens_per_s(),
            "decode_tokens_per_s": out.decode_tokens_per_s(),
            "backend": b.name(),
            "threads": threads,
            "copy_device_s": total.copy_device_s,
            "copy_gbps": if total.copy_device_s > 0.0 { total.bytes_uploaded as f64 / total.copy_device_s / 1e9 } else { 0.0 },
            "device_bytes_budget": b.budget().limit(),
            "device_bytes_peak": b.budget().peak(),
            "layers_resident": plan.layers_resident(),
            "layers_streamed": plan.layers_streamed(),
            "bytes_streamed": total.bytes_uploaded,
            "bytes_read": total.bytes_read,
            "bytes_decompressed": total.bytes_decompressed,
            "bytes_from_host_cache": total.bytes_from_host_cache,
            "passes": total.passes,
            "pass_time_s": total.pass_time_s / passes,
            "compute_s": total.compute_s,
            "upload_s": total.upload_s,
            "stall_load_s": total.load_stall_s,
            "plan": plan,
        });
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        println!();
        eprintln!(
            "prefill: {} tokens in {:.3} s ({:.1} tokens/s); decode: {} tokens in {:.3} s ({:.1} tokens/s); finish: {:?}",
            out.prompt_token_ids.len(),
            out.prefill_s,
            out.prefill_tokens_per_s(),
            out.decode_steps,
            out.decode_s,
            out.decode_tokens_per_s(),
            out.finish_reason,
        );
        eprintln!(
            "passes: {}, {:.2} ms each; per pass {} read, {} uploaded; compute {:.3} s, upload {:.3} s, waiting for loads {:.3} s; device memory peak {} of {}",
            total.passes,
            total.pass_time_s / passes * 1e3,
            fmt_bytes((total.bytes_read as f64 / passes) as u64),
            fmt_bytes((total.bytes_uploaded as f64 / passes) as u64),
            total.compute_s,
            total.upload_s,
            total.load_stall_s,
            fmt_bytes(b.budget().peak()),
            fmt_bytes(b.budget().limit())
        );
    }
    Ok(())
}

fn print_bench_io(r: &sluice::io::bench::BenchIoReport) {
    println!(
        "engine {}{} (qd {}, request {}, {} read buffers, {} workers), {} passes over {} units",
        r.engine,
        if r.direct {
            " + O_DIRECT"
        } else {
            " (buffered)"
        },
        r.queue_depth,
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
        "limit: one core decoding", r.core_decompress_gbps
    );
    println!(
        "{:<34} {:>10.3}",
        "bound min(read/ratio, workers*core)", r.bound_gbps
    );
    println!("{:<34} {:>10.3}", "decompressed / bound", r.bound_ratio);
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

fn print_summary(dir: &std::path::Path, s: &store::inspect::Summary) {
    let c = &s.config;
    println!("store       {}", dir.display());
    println!("source      {}", s.source);
    println!("model       {} ({})", c.name, c.arch);
    println!(
        "config      layers {}, hidden {}, heads {}, kv heads {}, head dim {}, intermediate {}, vocab {}, context {}",
        c.n_layers, c.hidden, c.n_heads, c.n_kv_heads, c.head_dim, c.intermediate, c.vocab, c.max_context
    );
    println!(
        "            rope theta {}, rope scaling {}, rms eps {:e}, tied embeddings {}, qkv bias {}",
        c.rope_theta,
        c.rope_scaling
            .as_ref()
            .map_or("none".to_string(), |r| format!("{r:?}")),
        c.rms_eps,
        c.tied_embeddings,
        c.qkv_bias
    );
    let t = &s.tokenizer;
    println!(
        "tokenizer   {}{}{}, bos {:?}, eos {:?}, end tokens {:?}, add bos {}, chat template {}",
        t.kind,
        t.pre
            .as_ref()
            .map(|p| format!(" (pre {p})"))
            .unwrap_or_default(),
        if t.tokens > 0 {
            format!(", {} tokens, {} merges", t.tokens, t.merges)
        } else {
            String::new()
        },
        s.bos,
        s.eos,
        s.end_tokens,
        s.add_bos,
        if s.chat_template { "yes" } else { "no" }
    );
    println!(
        "store       codec {}, frame size {}, {} frames, {} raw, {} stored, ratio {:.3}",
        s.codec,
        fmt_bytes(s.frame_size as u64),
        s.frames,
        fmt_bytes(s.raw_bytes),
        fmt_bytes(s.stored_bytes),
        s.ratio
    );
    println!();
    println!(
        "{:<8} {:>8} {:>12} {:>12} {:>7}  {:>11}",
        "dtype", "tensors", "raw", "stored", "ratio", "compressed"
    );
    for d in &s.dtypes {
        println!(
            "{:<8} {:>8} {:>12} {:>12} {:>7.3}  {:>5}/{:<5}",
            d.dtype.name(),
            d.tensors,
            fmt_bytes(d.raw_bytes),
            fmt_bytes(d.stored_bytes),
            d.ratio,
            d.frames_compressed,
            d.frames
        );
    }
    println!();
    println!(
        "{:<12} {:>8} {:>7} {:>12} {:>12} {:>7}",
        "unit", "tensors", "frames", "raw", "stored", "ratio"
    );
    for u in &s.units {
        println!(
            "{:<12} {:>8} {:>7} {:>12} {:>12} {:>7.3}",
            u.name,
            u.tensors,
            u.frames,
            fmt_bytes(u.raw_bytes),
            fmt_bytes(u.stored_bytes),
            u.ratio
        );
    }
}
