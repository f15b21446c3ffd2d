//! `sluiced`: the sluice daemon and its model tools (pack, inspect, verify).

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use sluice::store::{self, Codec, Store};
use sluice::util::{fmt_bytes, parse_size};
use std::path::PathBuf;
use std::time::Instant;

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
