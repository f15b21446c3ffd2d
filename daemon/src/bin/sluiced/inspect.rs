//! `sluiced inspect` and `sluiced verify`: what a store holds, and whether every frame
//! still matches its checksum.

use super::util::progress_bar;
use anyhow::{bail, Result};
use sluice::store::arch::Gating;
use sluice::store::{self, Store};
use sluice::util::fmt_bytes;
use std::path::PathBuf;
use std::time::Instant;

#[derive(clap::Args)]
pub struct InspectArgs {
    /// Store directory (from `sluiced pack`), or a store's name in the models directory.
    pub dir: PathBuf,
    /// Print one JSON object instead of tables.
    #[arg(long)]
    pub json: bool,
    /// Also list every tensor: its unit, type, shape, bytes and the XXH3-64 of its decoded
    /// bytes (reads and decodes the whole store; two stores hold a tensor alike exactly
    /// where the digests agree).
    #[arg(long)]
    pub tensors: bool,
}

pub fn run(a: InspectArgs) -> Result<std::process::ExitCode> {
    let InspectArgs { dir, json, tensors } = a;
    let store = Store::open(&sluice::util::store_path(&dir, None))?;
    let s = store::inspect::summarize(store.manifest());
    let digests = if tensors {
        let pb = progress_bar(store.manifest().stored_bytes(), "reading");
        let d = store::inspect::tensor_digests(&store, |b| pb.inc(b))?;
        pb.finish_and_clear();
        Some(d)
    } else {
        None
    };
    if json {
        let mut v = serde_json::to_value(&s)?;
        if let (Some(d), Some(o)) = (&digests, v.as_object_mut()) {
            o.insert("tensors".into(), serde_json::to_value(d)?);
        }
        println!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(std::process::ExitCode::SUCCESS);
    }
    print_summary(&dir, &s);
    for t in digests.iter().flatten() {
        let shape: Vec<String> = t.shape.iter().map(u64::to_string).collect();
        println!(
            "  {:<52} {:<6} {:<14} {:>10} {}",
            t.name,
            t.dtype.name(),
            shape.join("x"),
            fmt_bytes(t.bytes),
            t.xxh3
        );
    }
    Ok(std::process::ExitCode::SUCCESS)
}

#[derive(clap::Args)]
pub struct VerifyArgs {
    /// Store directory (from `sluiced pack`), or a store's name in the models directory.
    pub dir: PathBuf,
}

pub fn verify(a: VerifyArgs) -> Result<std::process::ExitCode> {
    let VerifyArgs { dir } = a;
    let store = Store::open(&sluice::util::store_path(&dir, None))?;
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
        bail!(
            "{}: {} of {} frames are bad (listed above); repack the model or restore weights.bin",
            dir.display(),
            report.faults.len(),
            report.frames
        )
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
    let r = c.arch.recipe();
    let e = &c.ext;
    let window = match (c.sliding_window, e.sliding_layers.len()) {
        (None, _) => "none".to_string(),
        (Some(w), 0) => format!("{w} on every layer"),
        (Some(w), n) => format!("{w} on {n} of {} layers", c.n_layers),
    };
    println!(
        "            sliding window {window}, local rope theta {}, q/k norm {}, post norms {}, activation {:?}, embedding scale {}, attention scale {}",
        e.rope_local_theta.map_or("-".into(), |t| t.to_string()),
        r.qk_norm,
        r.post_attn_norm.is_some(),
        r.activation,
        e.embed_scale.map_or("-".into(), |s| format!("{s:.4}")),
        e.attn_scale.map_or("-".into(), |s| format!("{s:.5}")),
    );
    if r.o_bias || r.attn_sinks || c.swiglu.is_some() {
        println!(
            "            output bias {}, attention sinks {}{}",
            r.o_bias,
            r.attn_sinks,
            c.swiglu.map_or(String::new(), |k| format!(
                ", SwiGLU clamp alpha {} limit {}",
                k.alpha, k.limit
            )),
        );
    }
    if let Some(m) = &c.moe {
        println!(
            "experts     {} of {} rows per sparse layer, top {}{}{}, dense layers {}",
            m.n_experts,
            m.intermediate,
            m.top_k,
            match (r.gating, m.norm_topk_prob) {
                (Gating::TopKSoftmax, _) => " (softmax over the top logits)",
                (Gating::SoftmaxTopK, true) => " (renormalized)",
                (Gating::SoftmaxTopK, false) => "",
            },
            if r.moe_bias {
                ", router and experts biased"
            } else {
                ""
            },
            if m.dense_layers.is_empty() {
                "none".to_string()
            } else {
                format!("{:?}", m.dense_layers)
            }
        );
    }
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
    if s.shared_codes > 0 {
        println!(
            "codes       {} shared by the small float frames ({} in the manifest)",
            s.shared_codes,
            fmt_bytes(s.shared_code_bytes)
        );
    }
    if let Some(l) = &s.linked {
        println!(
            "linked      weights read from {l} (pack --link): its stored bytes are that file's"
        );
    }
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
