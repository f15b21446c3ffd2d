//! `sluiced pack`: import a GGUF file or a Hugging Face directory and write a store.

use super::util::{parse_codec, parse_size_u32, progress_bar};
use anyhow::{bail, Context, Result};
use sluice::dtype::quantize::can_quantize;
use sluice::dtype::DType;
use sluice::store::quantize::Quantized;
use sluice::store::writer::{PackOptions, PackReport, PackSource, UnitSpec};
use sluice::store::{self, Codec};
use sluice::util::fmt_bytes;
use std::path::{Path, PathBuf};
use std::time::Instant;

#[derive(clap::Args)]
pub struct PackArgs {
    /// A .gguf file, a directory with config.json, *.safetensors and tokenizer.json, or a
    /// store (rewritten: quantized with --quantize, recompressed with --codec).
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
    /// Frame codec: none, lz4, zstd, zstd:N, float (16- and 32-bit floats: exponents
    /// Huffman-coded, sign and mantissa raw; other tensors raw), float-fast (float's
    /// fast setting: other planes coded only where that halves them, for fast disks), or
    /// auto: per tensor,
    /// the codec that delivers decompressed bytes fastest, min(disk / ratio, workers x
    /// decode rate), from rates measured here (pin them with --disk-gbps and
    /// --decode-workers for a store packed on one machine for another).
    #[arg(long, default_value = "zstd:3")]
    pub codec: String,
    /// With --codec auto: the disk's read rate in GB/s (default: measured where the store
    /// goes, by the I/O engine reading a scratch store as the daemon reads one).
    #[arg(long)]
    pub disk_gbps: Option<f64>,
    /// With --codec auto: decompression workers the store will be read with (default:
    /// this machine's cores - 1, as the I/O engine runs).
    #[arg(long)]
    pub decode_workers: Option<usize>,
    /// Uncompressed bytes per frame (e.g. 1MiB).
    #[arg(long, default_value = "1MiB", value_parser = parse_size_u32)]
    pub frame_size: u32,
    /// Compression threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// Replace an existing store at the output path.
    #[arg(long)]
    pub force: bool,
    /// Write only the manifest: its frames point at the source file's own bytes (a GGUF
    /// whose quantized blocks no codec shrinks), so the model is not on disk twice. The
    /// store then needs that file, unchanged, where it is now (its size, modification time
    /// and sampled checksums are checked at open). A linked store streams slower under a
    /// tight --host-memory (the source's tensors are not at aligned offsets), so
    /// `--codec auto` never links: where no codec saves 3 % it stores every tensor raw
    /// and says that --link would save the disk.
    #[arg(long, conflicts_with_all = ["codec", "disk_gbps", "decode_workers"])]
    pub link: bool,
    /// A chat template (a Jinja file) for the store: a base model has none, and some
    /// models ship a wrong one. Chat requests render with it and end at the end-of-turn
    /// tokens it uses. (A chat_template.jinja file in a store's directory does the same
    /// without repacking.)
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// Quantize the float weight matrices while packing, to q8_0, q4_0, q4_1, q5_0, q5_1,
    /// q2_k, q3_k, q4_k, q5_k or q6_k: ggml's reference quantizers, so the blocks are what
    /// `llama-quantize --pure` writes (a bf16 download made small enough, or a draft). Norms,
    /// biases, a mixture's router and tensors already quantized stay as they are; a K-quant
    /// matrix whose rows are not a multiple of 256 takes llama.cpp's fallback (q4_k -> q5_0,
    /// q5_k -> q5_1, q6_k -> q8_0; q2_k and q3_k -> q4_0).
    #[arg(long, value_name = "TYPE", conflicts_with = "link")]
    pub quantize: Option<String>,
}

pub fn run(a: PackArgs) -> Result<std::process::ExitCode> {
    let PackArgs {
        src,
        output,
        name,
        models_dir,
        codec,
        disk_gbps,
        decode_workers,
        frame_size,
        threads,
        force,
        link,
        chat_template,
        quantize,
    } = a;
    let quantize = quantize.as_deref().map(parse_quantize).transpose()?;
    let auto_codec = codec == "auto";
    let codec: Codec = if auto_codec {
        Codec::None
    } else {
        parse_codec(&codec).map_err(anyhow::Error::msg)?
    };
    if !auto_codec && (disk_gbps.is_some() || decode_workers.is_some()) {
        bail!("--disk-gbps and --decode-workers go with --codec auto");
    }
    if let Some(d) = disk_gbps.filter(|d| !(d.is_finite() && *d > 0.0)) {
        bail!("--disk-gbps {d}: expected a positive rate in GB/s");
    }
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
    let template = match &chat_template {
        Some(p) => Some(super::util::read_chat_template(p)?),
        None => None,
    };
    let threads =
        threads.unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let auto = if auto_codec {
        let disk = match disk_gbps {
            Some(d) => d,
            None => measured_disk(&output)?,
        };
        let workers = decode_workers
            .unwrap_or_else(|| sluice::io::IoConfig::default().workers)
            .max(1);
        Some(store::writer::AutoFor {
            disk_gbps: disk,
            workers,
        })
    } else {
        None
    };
    let opts = PackOptions {
        codec,
        auto,
        frame_size,
        threads,
        force,
        link,
    };
    let report = pack_any(&src, template, &output, &opts, quantize)?;
    for line in &report.auto {
        println!("{line}");
    }
    let codec = if auto_codec {
        "auto".to_string()
    } else {
        codec.to_string()
    };
    let secs = t0.elapsed().as_secs_f64();
    if let Some(linked) = &report.linked {
        println!(
            "linked {} -> {}: {} units, {} frames pointing at {} of {}; the store is a {} manifest in {secs:.2} s. Keep {} unchanged where it is: the store reads its weights from it",
            src.display(),
            output.display(),
            report.units,
            report.frames,
            fmt_bytes(report.stored_bytes),
            linked.display(),
            fmt_bytes(report.manifest_bytes),
            linked.display(),
        );
        return Ok(std::process::ExitCode::SUCCESS);
    }
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

/// Packs `src` into `output`: a GGUF file or a Hugging Face directory imported (with the
/// chat template `template`, if given), or a store rewritten (its tensors as they are);
/// quantized with `quantize`, framed and compressed as `opts` says.
fn pack_any(
    src: &Path,
    template: Option<String>,
    output: &Path,
    opts: &PackOptions,
    quantize: Option<DType>,
) -> Result<PackReport> {
    if !src.join(store::format::MANIFEST_FILE).is_file() {
        let mut model =
            sluice::import::open(src).with_context(|| format!("import {}", src.display()))?;
        model.chat_template = template.or(model.chat_template);
        return pack_shown(&model, &model.units()?, output, opts, quantize);
    }
    if template.is_some() || opts.link {
        bail!(
            "{}: --chat-template and --link take a GGUF file or a Hugging Face directory; a store's template is a chat_template.jinja file in its directory",
            src.display()
        );
    }
    let s = store::Store::open(src)?;
    let source = store::source::StoreSource::new(&s)?;
    let report = pack_shown(&source, &source.units(), output, opts, quantize)?;
    if let Err(e) = source.finish() {
        // A unit that could not be read was packed as zeros: not a store to keep.
        let _ = std::fs::remove_dir_all(output);
        return Err(e).with_context(|| format!("read {}", src.display()));
    }
    Ok(report)
}

/// Packs `model` (its matrices quantized to `quantize`, if given) under a progress bar,
/// then says what `--quantize` made of it.
fn pack_shown<S: PackSource>(
    model: &S,
    units: &[UnitSpec],
    output: &Path,
    opts: &PackOptions,
    quantize: Option<DType>,
) -> Result<PackReport> {
    let quantized = match quantize {
        Some(t) => Some(Quantized::new(model, t, opts.threads).map_err(anyhow::Error::msg)?),
        None => None,
    };
    let names = || units.iter().flat_map(|u| u.tensors.iter());
    let total: u64 = names()
        .filter_map(|n| match &quantized {
            Some(q) => q.tensor(n),
            None => model.tensor(n),
        })
        .map(|t| t.len)
        .sum();
    let pb = progress_bar(total, if opts.link { "linking" } else { "packing" });
    let report = match &quantized {
        Some(q) => store::writer::pack(q, units, output, opts, |b| pb.inc(b))?,
        None => store::writer::pack(model, units, output, opts, |b| pb.inc(b))?,
    };
    pb.finish_and_clear();
    if let Some(t) = quantize {
        for line in quantize_summary(model, names(), t) {
            println!("{line}");
        }
    }
    Ok(report)
}

/// `--quantize TYPE`'s type, by its name in any case.
fn parse_quantize(name: &str) -> Result<DType> {
    sluice::dtype::ALL_DTYPES
        .into_iter()
        .find(|t| t.name().eq_ignore_ascii_case(name) && can_quantize(*t))
        .with_context(|| {
            format!(
                "--quantize {name}: expected one of {}",
                store::quantize::quantizable().join(", ")
            )
        })
}

/// What `--quantize` made of the model: a line per (source type -> stored type) with its
/// tensors and bytes, and one for what it kept.
fn quantize_summary<'n>(
    model: &impl PackSource,
    names: impl Iterator<Item = &'n String>,
    to: DType,
) -> Vec<String> {
    use std::collections::BTreeMap;
    let mut groups: BTreeMap<(DType, Option<DType>), (usize, u64, u64)> = BTreeMap::new();
    for name in names {
        let Some(l) = model.tensor(name) else {
            continue;
        };
        let t = store::quantize::target(to, name, &l);
        let out = t.map_or(l.len, |t| {
            l.shape.iter().product::<u64>() / t.block_elems() * t.block_bytes()
        });
        let g = groups.entry((l.dtype, t)).or_default();
        *g = (g.0 + 1, g.1 + l.len, g.2 + out);
    }
    groups
        .into_iter()
        .map(|((from, t), (n, a, b))| match t {
            Some(t) => format!(
                "quantized {n} {from} tensor{} to {t}: {} -> {}{}",
                if n == 1 { "" } else { "s" },
                fmt_bytes(a),
                fmt_bytes(b),
                if t == to {
                    ""
                } else {
                    " (rows not whole blocks of the asked type: llama.cpp's fallback)"
                }
            ),
            None => format!(
                "kept {n} {from} tensor{} as {} ({})",
                if n == 1 { "" } else { "s" },
                if n == 1 { "it is" } else { "they are" },
                fmt_bytes(a)
            ),
        })
        .collect()
}

/// The read rate of the disk under `src` (its model files, 1 GiB at most, O_DIRECT), said
/// in the log.
fn measured_disk(out: &std::path::Path) -> Result<f64> {
    // The store's file system, read as the daemon reads a store (its engine preset).
    let dir = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let cfg = sluice::io::IoConfig::serving();
    let probe = scratch_probe(&dir, &cfg)
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("--codec auto: measure the disk under {}", dir.display()))?;
    let passes: Vec<String> = probe.passes.iter().map(|g| format!("{g:.2}")).collect();
    println!(
        "--codec auto: the disk under {} reads at {:.2} GB/s (best of {} GB/s: the engine's {} reader, {}, {} reads of {} in flight); --disk-gbps pins it",
        dir.display(),
        probe.gbps,
        passes.join(", "),
        probe.reader,
        if probe.direct { "O_DIRECT" } else { "through the page cache" },
        probe.queue_depth,
        fmt_bytes(probe.request_bytes),
    );
    if !probe.direct {
        tracing::warn!("--codec auto: the file system under {} refused O_DIRECT: the rate is the page cache's, not the disk's; give --disk-gbps", dir.display());
    }
    Ok(probe.gbps)
}

/// `io::bench::engine_read_probe` on a scratch store of about 200 MiB of raw weights (codec
/// none, so the figure is the disk's, not a codec's) packed into `dir`, then removed.
fn scratch_probe(
    dir: &std::path::Path,
    cfg: &sluice::io::IoConfig,
) -> std::result::Result<sluice::io::bench::DiskProbe, String> {
    use sluice::import::synth::{self, SynthSpec};
    use sluice::store::writer::{pack, PackOptions};
    /// Removes the scratch store however this returns.
    struct Scratch(PathBuf);
    impl Drop for Scratch {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    let scratch = Scratch(dir.join(format!(".sluice-disk-probe-{}", std::process::id())));
    let spec = SynthSpec::llama_like(1024, 4, sluice::dtype::DType::BF16);
    let model = synth::model(&spec);
    let units = model.units().map_err(|e| e.to_string())?;
    let opts = PackOptions {
        codec: Codec::None,
        auto: None,
        frame_size: 1 << 20,
        threads: 1,
        force: true,
        link: false,
    };
    pack(&model, &units, &scratch.0, &opts, |_| {})
        .map_err(|e| format!("write a scratch store in {}: {e}", dir.display()))?;
    let store = sluice::store::Store::open(&scratch.0).map_err(|e| e.to_string())?;
    sluice::io::bench::engine_read_probe(std::sync::Arc::new(store), cfg)
}
