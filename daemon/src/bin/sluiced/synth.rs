//! `sluiced synth`: a synthetic Llama-shaped store with random weights, for benchmarks;
//! `--moe EXPERTS/TOP_K` makes every layer a mixture of experts (Mixtral's layout) whose
//! router prefers some experts (`--router-skew`).

use super::util::{parse_codec, parse_dtype, parse_size_u32, progress_bar};
use anyhow::{bail, Result};
use sluice::store::{self, Codec};
use sluice::util::{fmt_bytes, parse_size};
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct SynthArgs {
    /// Output store directory.
    #[arg(short, long)]
    pub output: PathBuf,
    /// Decoder layers (or give --size).
    #[arg(long)]
    pub layers: Option<u32>,
    /// Pick the layer count so the model's raw size is about this (e.g. 4GiB).
    #[arg(long, value_parser = parse_size)]
    pub size: Option<u64>,
    /// Hidden size.
    #[arg(long, default_value_t = 2048)]
    pub hidden: u32,
    /// Matrix dtype: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q2_k, q3_k, q4_k, q5_k,
    /// q6_k, iq4_nl, iq4_xs or mxfp4 (K-quant-era formats need a hidden size and
    /// intermediate size that are multiples of their block, 256 for the _k and iq4_xs).
    #[arg(long, default_value = "bf16", value_parser = parse_dtype)]
    pub dtype: sluice::dtype::DType,
    /// Default: ~8/3 hidden rounded to 256.
    #[arg(long)]
    pub intermediate: Option<u32>,
    /// Attention heads (default: Llama proportions, head dim 64, or 128 from hidden 2048).
    #[arg(long)]
    pub heads: Option<u32>,
    /// Key/value heads (default: a quarter of the heads; all of them when --heads is given).
    #[arg(long)]
    pub kv_heads: Option<u32>,
    /// Vocabulary size.
    #[arg(long, default_value_t = 32000)]
    pub vocab: u32,
    /// Seed of the random weights.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Frame codec: none, lz4, zstd, zstd:N, float (16- and 32-bit floats: exponents
    /// Huffman-coded, sign and mantissa raw; other tensors raw) or float-fast (float's
    /// fast setting).
    #[arg(long, default_value = "zstd:1", value_parser = parse_codec)]
    pub codec: Codec,
    /// Uncompressed bytes per frame (e.g. 1MiB).
    #[arg(long, default_value = "1MiB", value_parser = parse_size_u32)]
    pub frame_size: u32,
    /// Every layer a mixture of EXPERTS gated MLPs, TOP_K per token (e.g. 64/4), in
    /// Mixtral's layout, instead of the dense MLP.
    #[arg(long, value_parser = parse_moe)]
    pub moe: Option<(u32, u32)>,
    /// Rows of each expert's MLP (default: 3/8 of hidden rounded up to 256, Qwen3-30B-A3B's
    /// proportion).
    #[arg(long)]
    pub expert_intermediate: Option<u32>,
    /// Router row e is scaled by (e + 1)^-SKEW: the larger, the more the low-numbered
    /// experts win (0: every expert alike).
    #[arg(long, default_value_t = 1.0)]
    pub router_skew: f32,
    /// Replace an existing store at the output path.
    #[arg(long)]
    pub force: bool,
}

/// EXPERTS/TOP_K, e.g. 64/4.
fn parse_moe(s: &str) -> Result<(u32, u32), String> {
    let (n, k) = s
        .split_once('/')
        .ok_or_else(|| format!("{s:?}: expected EXPERTS/TOP_K, e.g. 64/4"))?;
    let n: u32 = n
        .trim()
        .parse()
        .map_err(|e| format!("{s:?}: experts: {e}"))?;
    let k: u32 = k.trim().parse().map_err(|e| format!("{s:?}: top k: {e}"))?;
    if n == 0 || k == 0 || k > n {
        return Err(format!("{s:?}: need 1 <= TOP_K <= EXPERTS"));
    }
    Ok((n, k))
}

pub fn run(a: SynthArgs) -> Result<std::process::ExitCode> {
    let SynthArgs {
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
        moe,
        expert_intermediate,
        router_skew,
        force,
    } = a;
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
    if !router_skew.is_finite() || router_skew < 0.0 {
        bail!("--router-skew {router_skew} must be 0 or more");
    }
    spec.moe = moe.map(|(experts, top_k)| sluice::import::synth::SynthMoe {
        experts,
        top_k,
        intermediate: expert_intermediate.unwrap_or((hidden * 3 / 8).div_ceil(256) * 256),
        skew: router_skew,
    });
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    synth(
        output,
        layers,
        size,
        spec,
        store::writer::PackOptions {
            auto: None,
            codec,
            frame_size,
            threads,
            force,
            link: false,
        },
    )?;
    Ok(std::process::ExitCode::SUCCESS)
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
    // Every matrix's rows must be whole blocks of the dtype.
    let mut widths = vec![
        ("--hidden", spec.hidden),
        ("--intermediate", spec.intermediate),
    ];
    if let Some(m) = spec.moe {
        widths.push(("--expert-intermediate", m.intermediate));
    }
    for (flag, cols) in widths {
        if cols == 0 || spec.dtype.row_bytes(cols as u64).is_none() {
            bail!(
                "{flag} {cols} is not a whole number of {} blocks ({} values each)",
                spec.dtype,
                spec.dtype.block_elems()
            );
        }
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
    let ffn = match spec.moe {
        None => format!("intermediate {}", spec.intermediate),
        Some(m) => format!(
            "{} experts of {} rows, top {}, router skew {}",
            m.experts, m.intermediate, m.top_k, m.skew
        ),
    };
    println!(
        "wrote {}: {} layers x hidden {} ({}, {ffn}, heads {}/{}), {} raw -> {} stored (ratio {:.3}, {}) in {:.1} s",
        output.display(),
        spec.layers,
        spec.hidden,
        spec.dtype,
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
