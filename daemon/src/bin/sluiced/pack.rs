//! `sluiced pack`: import a GGUF file or a Hugging Face directory and write a store.

use super::util::{parse_codec, parse_size_u32, progress_bar};
use anyhow::{bail, Context, Result};
use sluice::store::{self, Codec};
use sluice::util::fmt_bytes;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct PackArgs {
    /// A .gguf file, or a directory with config.json, *.safetensors and tokenizer.json.
    pub src: PathBuf,
    /// Output store directory (must not exist unless --force).
    #[arg(short, long, required_unless_present = "name", conflicts_with = "name")]
    pub output: Option<PathBuf>,
    /// Write the store into the models directory under this name (what requests and
    /// `sluice models` call it), instead of -o.
    #[arg(long)]
    pub name: Option<String>,
    /// The models directory --name writes into (default $SLUICE_MODELS_DIR, else
    /// $XDG_DATA_HOME/sluice/models, else ~/.local/share/sluice/models).
    #[arg(long)]
    pub models_dir: Option<PathBuf>,
    /// Frame codec: none, lz4, zstd, zstd:N, or float (16- and 32-bit floats: exponents
    /// Huffman-coded, sign and mantissa raw; other tensors raw).
    #[arg(long, default_value = "zstd:3", value_parser = parse_codec)]
    pub codec: Codec,
    /// Uncompressed bytes per frame (e.g. 1MiB).
    #[arg(long, default_value = "1MiB", value_parser = parse_size_u32)]
    pub frame_size: u32,
    /// Compression threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Replace an existing store at the output path.
    #[arg(long)]
    pub force: bool,
}

pub fn run(a: PackArgs) -> Result<std::process::ExitCode> {
    let PackArgs {
        src,
        output,
        name,
        models_dir,
        codec,
        frame_size,
        threads,
        force,
    } = a;
    let output = match (output, name) {
        (Some(o), _) => o,
        (None, Some(n)) => {
            if n.is_empty() || n.starts_with('.') || n.contains(['/', '\\']) {
                bail!("--name {n:?}: a model name is one path component, not starting with '.'");
            }
            let dir = models_dir
                .or_else(sluice::util::default_models_dir)
                .context(
                "--name: no models directory (give --models-dir, or set HOME or SLUICE_MODELS_DIR)",
            )?;
            std::fs::create_dir_all(&dir)
                .with_context(|| format!("create the models directory {}", dir.display()))?;
            dir.join(n)
        }
        (None, None) => bail!("give -o DIR or --name NAME"),
    };
    let t0 = Instant::now();
    let model = sluice::import::open(&src).with_context(|| format!("import {}", src.display()))?;
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
