//! Hugging Face model directory importer: config.json, one or many *.safetensors (with
//! model.safetensors.index.json when sharded), tokenizer.json, tokenizer_config.json (chat
//! template, special tokens) and generation_config.json (end tokens).

use super::{
    mmap_file, push_unique, ImportError, ImportedModel, OpenAiMxfp4, SourceTensor, Strided, Widen,
};
use crate::dtype::DType;
use crate::store::arch::{
    every_but_nth, Arch, ArchConfig, ArchExt, MoeConfig, RopeScaling, SwigluClamp,
};
use crate::store::end_of_turn_tokens;
use crate::store::format::{RecommendedSampling, SourceMeta, SpecialTokens, TokenizerSpec};
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Bytes of a JSON file of a model (config, tokenizer config, index) at most: real ones are
/// kilobytes; a larger one is refused before it is read.
const JSON_BYTES_MAX: u64 = 64 << 20;
/// Bytes of tokenizer.json at most (the largest vocabularies' are tens of MiB).
const TOKENIZER_BYTES_MAX: u64 = 512 << 20;
/// Bytes of a safetensors header at most (a model with a million tensors needs ~100 MiB;
/// real checkpoints need well under 1 MiB per shard).
pub const SAFETENSORS_HEADER_MAX: u64 = 64 << 20;

/// Reads a whole file of at most `max` bytes (refused before anything is read otherwise).
fn read_bounded(path: &Path, max: u64, op: &'static str) -> Result<String, ImportError> {
    let io = |err| ImportError::Io {
        op,
        path: path.into(),
        err,
    };
    let len = std::fs::metadata(path).map_err(io)?.len();
    if len > max {
        return Err(ImportError::malformed(
            path,
            None,
            format!("{len} bytes; a model's file of this kind has at most {max}: refused"),
        ));
    }
    std::fs::read_to_string(path).map_err(io)
}

fn read_json(path: &Path) -> Result<Value, ImportError> {
    let text = read_bounded(path, JSON_BYTES_MAX, "read")?;
    serde_json::from_str(&text).map_err(|e| {
        ImportError::malformed(
            path,
            None,
            format!(
                "invalid JSON at line {} column {}: {e}",
                e.line(),
                e.column()
            ),
        )
    })
}

fn read_json_opt(path: &Path) -> Result<Option<Value>, ImportError> {
    if path.exists() {
        read_json(path).map(Some)
    } else {
        Ok(None)
    }
}

struct Config<'a> {
    v: &'a Value,
    path: &'a Path,
}

impl Config<'_> {
    fn u32_opt(&self, key: &str) -> Result<Option<u32>, ImportError> {
        match self.v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| {
                    ImportError::malformed(
                        self.path,
                        None,
                        format!("{key} is {v}, expected an unsigned integer"),
                    )
                }),
        }
    }
    fn u32(&self, key: &str) -> Result<u32, ImportError> {
        self.u32_opt(key)?
            .ok_or_else(|| ImportError::malformed(self.path, None, format!("{key} is missing")))
    }
    fn f32_opt(&self, key: &str) -> Result<Option<f32>, ImportError> {
        match self.v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v.as_f64().map(|x| Some(x as f32)).ok_or_else(|| {
                ImportError::malformed(self.path, None, format!("{key} is {v}, expected a number"))
            }),
        }
    }
    fn bool_opt(&self, key: &str) -> Result<Option<bool>, ImportError> {
        match self.v.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(ImportError::malformed(
                self.path,
                None,
                format!("{key} is {v}, expected true or false"),
            )),
        }
    }
}

fn arch_config(dir: &Path) -> Result<ArchConfig, ImportError> {
    let path = dir.join("config.json");
    arch_of_config(&read_json(&path)?, &path)
}

/// The architecture a parsed config.json (at `path`, for errors) describes.
pub(crate) fn arch_of_config(top: &Value, path: &Path) -> Result<ArchConfig, ImportError> {
    let path = path.to_path_buf();
    let model_type = top.get("model_type").and_then(Value::as_str).unwrap_or("");
    // A multimodal Gemma 3 keeps its language model's config under text_config.
    let v = match (model_type, top.get("text_config")) {
        ("gemma3", Some(t)) => t.clone(),
        _ => top.clone(),
    };
    let c = Config { v: &v, path: &path };
    let arch = match model_type {
        "llama" => Arch::Llama,
        "mistral" => Arch::Mistral,
        "qwen2" => Arch::Qwen2,
        "qwen3" => Arch::Qwen3,
        "gemma3" | "gemma3_text" => Arch::Gemma3,
        "qwen3_moe" => Arch::Qwen3Moe,
        "mixtral" => Arch::Mixtral,
        "gpt_oss" => Arch::GptOss,
        other => {
            return Err(ImportError::unsupported(
                &path,
                format!("model_type {other:?}; sluice supports llama, mistral, qwen2, qwen3, gemma3 (gemma3_text), qwen3_moe, mixtral and gpt_oss"),
            ))
        }
    };
    let gemma = arch == Arch::Gemma3;
    let oss = arch == Arch::GptOss;
    if gemma {
        for key in ["final_logit_softcapping", "attn_logit_softcapping"] {
            if let Some(x) = c.f32_opt(key)? {
                return Err(ImportError::unsupported(
                    &path,
                    format!("{key} = {x}: logit soft-capping (Gemma 2) is not supported"),
                ));
            }
        }
        if let Some(act) = v.get("hidden_activation").and_then(Value::as_str) {
            if act != "gelu_pytorch_tanh" {
                return Err(ImportError::unsupported(
                    &path,
                    format!("hidden_activation {act:?}; Gemma 3 uses gelu_pytorch_tanh"),
                ));
            }
        }
    }
    let hidden = c.u32("hidden_size")?;
    let n_heads = c.u32("num_attention_heads")?;
    let n_layers = c.u32("num_hidden_layers")?;
    // transformers 5 writes rope_parameters (per attention type for Gemma 3); older
    // configs rope_theta and rope_scaling.
    let rp = v.get("rope_parameters");
    let rp_global = rp.map(|r| r.get("full_attention").unwrap_or(r));
    let rp_local = rp.and_then(|r| r.get("sliding_attention"));
    let theta_of = |r: Option<&Value>| -> Result<Option<f32>, ImportError> {
        match r {
            Some(r) => Config { v: r, path: &path }.f32_opt("rope_theta"),
            None => Ok(None),
        }
    };
    let rope_theta = match theta_of(rp_global)? {
        Some(t) => t,
        None => c.f32_opt("rope_theta")?.unwrap_or(10000.0),
    };
    let scaling = match rp_global {
        Some(r) => Some(r),
        None => v.get("rope_scaling"),
    };
    let max_context = c.u32_opt("max_position_embeddings")?.unwrap_or(4096);
    let rope_scaling = rope_scaling(scaling, max_context, &path)?;
    let sliding_window = match arch {
        Arch::Mistral | Arch::Gemma3 | Arch::Mixtral | Arch::GptOss => {
            c.u32_opt("sliding_window")?
        }
        _ => None,
    };
    let moe = moe_config(arch, &c, n_layers)?;
    let sliding_layers = match v.get("layer_types").and_then(Value::as_array) {
        Some(types) if gemma || oss => {
            if types.len() != n_layers as usize {
                return Err(ImportError::malformed(
                    &path,
                    None,
                    format!(
                        "layer_types has {} entries for {n_layers} layers",
                        types.len()
                    ),
                ));
            }
            (0..n_layers)
                .filter(|&i| types[i as usize].as_str() == Some("sliding_attention"))
                .collect()
        }
        _ if gemma => every_but_nth(n_layers, c.u32_opt("sliding_window_pattern")?.unwrap_or(6)),
        // transformers' default for gpt-oss: sliding, full, sliding, ...
        _ if oss => (0..n_layers).step_by(2).collect(),
        _ => Vec::new(),
    };
    let ext = if gemma {
        let local = match theta_of(rp_local)? {
            Some(t) => t,
            None => c.f32_opt("rope_local_base_freq")?.unwrap_or(10000.0),
        };
        let scalar = c.f32_opt("query_pre_attn_scalar")?.unwrap_or(256.0) as f64;
        ArchExt::gemma3(hidden, scalar, sliding_layers, local)
    } else {
        ArchExt {
            sliding_layers,
            ..ArchExt::default()
        }
    };
    let cfg = ArchConfig {
        arch,
        name: path
            .parent()
            .and_then(Path::file_name)
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
        n_layers,
        hidden,
        n_heads,
        n_kv_heads: c.u32_opt("num_key_value_heads")?.unwrap_or(n_heads),
        head_dim: c
            .u32_opt("head_dim")?
            .unwrap_or(hidden.checked_div(n_heads).unwrap_or(0)),
        intermediate: c.u32("intermediate_size")?,
        vocab: c.u32("vocab_size")?,
        max_context,
        rope_theta,
        rope_scaling,
        rms_eps: c.f32_opt("rms_norm_eps")?.unwrap_or(1e-6),
        tied_embeddings: c.bool_opt("tie_word_embeddings")?.unwrap_or(gemma),
        qkv_bias: arch == Arch::Qwen2 || c.bool_opt("attention_bias")?.unwrap_or(oss),
        sliding_window,
        ext,
        moe,
        swiglu: if oss {
            Some(SwigluClamp {
                alpha: c.f32_opt("swiglu_alpha")?.unwrap_or(1.702),
                limit: c.f32_opt("swiglu_limit")?.unwrap_or(7.0),
            })
        } else {
            None
        },
    };
    if oss && !cfg.qkv_bias {
        return Err(ImportError::unsupported(
            &path,
            "attention_bias false: sluice reads gpt-oss with its attention biases",
        ));
    }
    cfg.validate()
        .map_err(|e| ImportError::malformed(&path, None, e))?;
    Ok(cfg)
}

/// The mixture of experts of a Qwen3-MoE or Mixtral config.json (None for the others).
/// Qwen3-MoE: `num_experts` (transformers 5 may write `num_local_experts`),
/// `num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob` (transformers' default
/// false), and layer i sparse unless in `mlp_only_layers` or (i + 1) is not a multiple of
/// `decoder_sparse_step`; Mixtral: `num_local_experts` experts of `intermediate_size`,
/// every layer sparse, probabilities always renormalized.
fn moe_config(arch: Arch, c: &Config<'_>, n_layers: u32) -> Result<Option<MoeConfig>, ImportError> {
    let experts = || -> Result<u32, ImportError> {
        match c.u32_opt("num_experts")? {
            Some(n) => Ok(n),
            None => c.u32("num_local_experts"),
        }
    };
    match arch {
        Arch::Qwen3Moe => {
            let step = c.u32_opt("decoder_sparse_step")?.unwrap_or(1).max(1);
            let mlp_only: Vec<u32> = match c.v.get("mlp_only_layers") {
                None | Some(Value::Null) => Vec::new(),
                Some(Value::Array(a)) => a
                    .iter()
                    .map(|x| {
                        x.as_u64()
                            .and_then(|x| u32::try_from(x).ok())
                            .ok_or_else(|| {
                                ImportError::malformed(
                                    c.path,
                                    None,
                                    format!("mlp_only_layers holds {x}, not a layer index"),
                                )
                            })
                    })
                    .collect::<Result<_, _>>()?,
                Some(other) => {
                    return Err(ImportError::malformed(
                        c.path,
                        None,
                        format!("mlp_only_layers is {other}, not a list of layers"),
                    ))
                }
            };
            let n_experts = experts()?;
            let dense_layers = (0..n_layers)
                .filter(|i| mlp_only.contains(i) || n_experts == 0 || (i + 1) % step != 0)
                .collect();
            Ok(Some(MoeConfig {
                n_experts,
                top_k: c.u32("num_experts_per_tok")?,
                intermediate: c.u32("moe_intermediate_size")?,
                norm_topk_prob: c.bool_opt("norm_topk_prob")?.unwrap_or(false),
                dense_layers,
            }))
        }
        // Top-k logits then softmax (the recipe's gating): always normalized over the k.
        Arch::GptOss => Ok(Some(MoeConfig {
            n_experts: experts()?,
            top_k: c.u32_opt("num_experts_per_tok")?.unwrap_or(4),
            intermediate: c.u32("intermediate_size")?,
            norm_topk_prob: true,
            dense_layers: Vec::new(),
        })),
        Arch::Mixtral => Ok(Some(MoeConfig {
            n_experts: experts()?,
            top_k: c.u32_opt("num_experts_per_tok")?.unwrap_or(2),
            intermediate: c.u32("intermediate_size")?,
            norm_topk_prob: true,
            dense_layers: Vec::new(),
        })),
        _ => Ok(None),
    }
}

/// A `rope_scaling` (or transformers 5 `rope_parameters`) object; `max_context` is the
/// config's `max_position_embeddings`.
fn rope_scaling(
    rs: Option<&Value>,
    max_context: u32,
    path: &Path,
) -> Result<Option<RopeScaling>, ImportError> {
    let rs = match rs {
        None | Some(Value::Null) => return Ok(None),
        Some(rs) => rs,
    };
    let rc = Config { v: rs, path };
    let ty = rs
        .get("rope_type")
        .or_else(|| rs.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    Ok(match ty {
        "default" => None,
        "linear" => Some(RopeScaling::Linear {
            factor: rc.f32_opt("factor")?.unwrap_or(1.0),
        }),
        "llama3" => Some(RopeScaling::Llama3 {
            factor: rc.f32_opt("factor")?.unwrap_or(8.0),
            low_freq_factor: rc.f32_opt("low_freq_factor")?.unwrap_or(1.0),
            high_freq_factor: rc.f32_opt("high_freq_factor")?.unwrap_or(4.0),
            original_max_position: rc
                .u32_opt("original_max_position_embeddings")?
                .unwrap_or(8192),
        }),
        // As transformers' `_compute_yarn_parameters`.
        "yarn" => {
            let original = match rc.u32_opt("original_max_position_embeddings")? {
                Some(o) => o,
                None => max_context,
            };
            let factor = match rc.f32_opt("factor")? {
                Some(f) => f,
                None => max_context as f32 / original.max(1) as f32,
            };
            let mscale = |m: f32| {
                if factor <= 1.0 {
                    1.0
                } else {
                    0.1 * m * factor.ln() + 1.0
                }
            };
            let attention_factor = match (
                rc.f32_opt("attention_factor")?,
                rc.f32_opt("mscale")?,
                rc.f32_opt("mscale_all_dim")?,
            ) {
                (Some(a), _, _) => a,
                (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => mscale(m) / mscale(all),
                _ => mscale(1.0),
            };
            let beta = |key: &str, default: f32| -> Result<f32, ImportError> {
                Ok(rc.f32_opt(key)?.filter(|&b| b != 0.0).unwrap_or(default))
            };
            Some(RopeScaling::Yarn {
                factor,
                original_max_position: original,
                beta_fast: beta("beta_fast", 32.0)?,
                beta_slow: beta("beta_slow", 1.0)?,
                attention_factor,
                truncate: rc.bool_opt("truncate")?.unwrap_or(true),
            })
        }
        other => {
            return Err(ImportError::unsupported(
                path,
                format!("rope_scaling type {other:?}; sluice supports linear, llama3 and yarn"),
            ))
        }
    })
}

/// The text model's name of a tensor of a multimodal Gemma 3 checkpoint
/// (`language_model.model.*` as transformers 4 writes it, `model.language_model.*` as 5
/// does), None for its vision tower and projector; other names as they are.
fn language_model_name(arch: Arch, name: &str) -> Option<String> {
    if arch != Arch::Gemma3 {
        return Some(name.to_string());
    }
    for vision in ["vision_tower.", "multi_modal_projector."] {
        if name.starts_with(vision)
            || name
                .strip_prefix("model.")
                .is_some_and(|n| n.starts_with(vision))
        {
            return None;
        }
    }
    Some(
        match (
            name.strip_prefix("language_model."),
            name.strip_prefix("model.language_model."),
        ) {
            (Some(rest), _) => rest.to_string(),
            (None, Some(rest)) => format!("model.{rest}"),
            (None, None) => name.to_string(),
        },
    )
}

/// A mixture of experts' tensors under the store's names (Qwen3-MoE's on the Hub:
/// `mlp.gate`, `mlp.experts.{e}.{gate,up,down}_proj`): Mixtral's `block_sparse_moe.gate`
/// and `block_sparse_moe.experts.{e}.w1/w3/w2` (gate/up/down) renamed, and the fused
/// per-layer layout of transformers 5 (`mlp.experts.gate_up_proj` [experts, 2 x
/// intermediate, hidden], gate rows first, and `mlp.experts.down_proj` [experts, hidden,
/// intermediate]) cut into each expert's tensors (byte ranges of the same file, no copy).
/// Other tensors pass through as they are.
fn expert_tensors(
    cfg: &ArchConfig,
    name: String,
    t: SourceTensor,
    path: &Path,
) -> Result<Vec<(String, SourceTensor)>, ImportError> {
    let Some(moe) = &cfg.moe else {
        return Ok(vec![(name, t)]);
    };
    let Some((layer, rest)) = name
        .strip_prefix("model.layers.")
        .and_then(|r| r.split_once('.'))
    else {
        return Ok(vec![(name, t)]);
    };
    let p = format!("model.layers.{layer}");
    if cfg.arch == Arch::GptOss {
        return gpt_oss_tensors(cfg, &p, rest, name.clone(), t, path);
    }
    if let Some(rest) = rest.strip_prefix("block_sparse_moe.") {
        let renamed = match rest
            .strip_prefix("experts.")
            .and_then(|r| r.split_once('.'))
        {
            Some((e, w)) => {
                let proj = match w {
                    "w1.weight" => "gate_proj",
                    "w3.weight" => "up_proj",
                    "w2.weight" => "down_proj",
                    _ => return Ok(vec![(name, t)]),
                };
                format!("{p}.mlp.experts.{e}.{proj}.weight")
            }
            None => format!("{p}.mlp.{rest}"),
        };
        return Ok(vec![(renamed, t)]);
    }
    let fused = match rest {
        "mlp.experts.gate_up_proj" => 2,
        "mlp.experts.down_proj" => 1,
        _ => return Ok(vec![(name, t)]),
    };
    let (n, mi, h) = (
        moe.n_experts as u64,
        moe.intermediate as u64,
        cfg.hidden as u64,
    );
    let want = if fused == 2 {
        vec![n, 2 * mi, h]
    } else {
        vec![n, h, mi]
    };
    if t.shape != want || t.widen.is_some() {
        return Err(ImportError::unsupported(
            path,
            format!(
                "{name} has shape {:?}; sluice reads the fused experts as {want:?} ({n} experts, {mi} rows each, hidden {h})",
                t.shape
            ),
        ));
    }
    let es = t.dtype.block_bytes();
    let piece = mi * h * es;
    let mut out = Vec::with_capacity((n * fused) as usize);
    for e in 0..n {
        let projs: &[&str] = if fused == 2 {
            &["gate_proj", "up_proj"]
        } else {
            &["down_proj"]
        };
        for (k, proj) in projs.iter().enumerate() {
            let shape = if fused == 2 { vec![mi, h] } else { vec![h, mi] };
            out.push((
                format!("{p}.mlp.experts.{e}.{proj}.weight"),
                SourceTensor {
                    shape,
                    offset: t.offset + (e * fused + k as u64) * piece,
                    len: piece,
                    ..t.clone()
                },
            ));
        }
    }
    Ok(out)
}

/// gpt-oss's mixture under the store's names (`p` is the layer's prefix, `rest` the name
/// after it): `mlp.router` renamed `mlp.gate`; the fused experts (transformers'
/// `GptOssExperts`, input-major: `gate_up_proj` [experts, hidden, 2 x intermediate] with
/// gate and up in alternate columns, `down_proj` [experts, intermediate, hidden], and their
/// biases [experts, 2 x intermediate] and [experts, hidden]) cut into each expert's
/// gate/up/down weights and biases in the store's output-major layout (`Strided`). (The
/// MXFP4 checkpoints OpenAI publishes, `*_blocks` and `*_scales`, are refused before.)
fn gpt_oss_tensors(
    cfg: &ArchConfig,
    p: &str,
    rest: &str,
    name: String,
    t: SourceTensor,
    path: &Path,
) -> Result<Vec<(String, SourceTensor)>, ImportError> {
    if let Some(r) = rest.strip_prefix("mlp.router.") {
        return Ok(vec![(format!("{p}.mlp.gate.{r}"), t)]);
    }
    let Some(what) = rest.strip_prefix("mlp.experts.") else {
        return Ok(vec![(name, t)]);
    };
    let Some(moe) = &cfg.moe else {
        return Ok(vec![(name, t)]);
    };
    let (n, mi, h) = (
        moe.n_experts as u64,
        moe.intermediate as u64,
        cfg.hidden as u64,
    );
    // (source shape, per expert: (store name, start column, step, output shape)).
    type Piece = (&'static str, u64, u64, Vec<u64>);
    let (want, pieces): (Vec<u64>, Vec<Piece>) = match what {
        "gate_up_proj" => (
            vec![n, h, 2 * mi],
            vec![
                ("gate_proj.weight", 0, 2, vec![mi, h]),
                ("up_proj.weight", 1, 2, vec![mi, h]),
            ],
        ),
        "gate_up_proj_bias" => (
            vec![n, 2 * mi],
            vec![
                ("gate_proj.bias", 0, 2, vec![mi]),
                ("up_proj.bias", 1, 2, vec![mi]),
            ],
        ),
        "down_proj" => (
            vec![n, mi, h],
            vec![("down_proj.weight", 0, 1, vec![h, mi])],
        ),
        "down_proj_bias" => (vec![n, h], vec![("down_proj.bias", 0, 1, vec![h])]),
        _ => return Ok(vec![(name, t)]),
    };
    if t.shape != want || !matches!(t.dtype, DType::F32 | DType::F16 | DType::BF16) {
        return Err(ImportError::unsupported(
            path,
            format!(
                "{name} is {} {:?}; sluice reads gpt-oss's fused experts as f32, f16 or bf16 {want:?} ({n} experts of {mi} rows, hidden {h})",
                t.dtype, t.shape
            ),
        ));
    }
    let es = t.dtype.block_bytes();
    // Each expert's slab of the source: [hidden, 2 x mi], [mi, hidden], or one row.
    let (src_rows, src_cols) = match want.len() {
        3 => (want[1], want[2]),
        _ => (1, want[1]),
    };
    let slab = src_rows * src_cols * es;
    let mut out = Vec::with_capacity((n as usize) * pieces.len());
    for e in 0..n {
        for (part, start, step, shape) in &pieces {
            let elems: u64 = shape.iter().product();
            out.push((
                format!("{p}.mlp.experts.{e}.{part}"),
                SourceTensor {
                    shape: shape.clone(),
                    offset: t.offset + e * slab,
                    len: elems * es,
                    strided: Some(Strided {
                        src_rows,
                        src_cols,
                        start: *start,
                        step: *step,
                    }),
                    ..t.clone()
                },
            ));
        }
    }
    Ok(out)
}

/// A safetensors tensor's place: (file index, byte offset in it, shape).
type MxSource = (usize, u64, Vec<u64>);

/// OpenAI's gpt-oss experts in MXFP4 (`{p}.mlp.experts.gate_up_proj_blocks` U8 [experts, 2 x
/// intermediate (gate and up rows alternating), hidden / 32, 16] with `_scales` [experts,
/// 2 x intermediate, hidden / 32]; `down_proj_*` the same over [experts, hidden,
/// intermediate / 32]) as each expert's GGML MXFP4 gate, up and down weights
/// (`OpenAiMxfp4`): the same 4.25 bits a weight, no dequantization.
fn gpt_oss_mxfp4(
    cfg: &ArchConfig,
    base_name: &str,
    (bf, boff, bshape): MxSource,
    (sf, soff, sshape): MxSource,
    path: &Path,
) -> Result<Vec<(String, SourceTensor)>, ImportError> {
    let Some(moe) = &cfg.moe else {
        return Err(ImportError::unsupported(
            path,
            format!("{base_name}: MXFP4 tensors outside a mixture"),
        ));
    };
    let (n, mi, h) = (
        moe.n_experts as u64,
        moe.intermediate as u64,
        cfg.hidden as u64,
    );
    let (p, what) = base_name.rsplit_once(".mlp.experts.").ok_or_else(|| {
        ImportError::unsupported(
            path,
            format!("{base_name}_blocks: not a gpt-oss expert tensor"),
        )
    })?;
    // (source rows, source columns, per expert: (store name, first row, row step, rows)).
    type Part = (&'static str, u64, u64, u64);
    let (rows, cols, parts): (u64, u64, Vec<Part>) = match what {
        "gate_up_proj" => (
            2 * mi,
            h,
            vec![("gate_proj.weight", 0, 2, mi), ("up_proj.weight", 1, 2, mi)],
        ),
        "down_proj" => (h, mi, vec![("down_proj.weight", 0, 1, h)]),
        _ => {
            return Err(ImportError::unsupported(
                path,
                format!(
                    "{base_name}_blocks: sluice reads MXFP4 gate_up_proj and down_proj experts"
                ),
            ))
        }
    };
    let bpr = cols / 32;
    if cols % 32 != 0 || bshape != [n, rows, bpr, 16] || sshape != [n, rows, bpr] {
        return Err(ImportError::malformed(
            path,
            None,
            format!(
                "{base_name}_blocks {bshape:?} and _scales {sshape:?}; {n} experts of {rows} rows of {cols} need [{n}, {rows}, {bpr}, 16] and [{n}, {rows}, {bpr}]"
            ),
        ));
    }
    let mut out = Vec::with_capacity((n as usize) * parts.len());
    for e in 0..n {
        for &(part, row_start, row_step, out_rows) in &parts {
            out.push((
                format!("{p}.mlp.experts.{e}.{part}"),
                SourceTensor {
                    dtype: DType::Mxfp4,
                    shape: vec![out_rows, cols],
                    file: bf,
                    offset: boff + e * rows * bpr * 16,
                    len: out_rows * bpr * 17,
                    unpermute_heads: None,
                    synthetic_seed: None,
                    synthetic_row_skew: None,
                    widen: None,
                    strided: None,
                    openai_mxfp4: Some(OpenAiMxfp4 {
                        scales_file: sf,
                        scales_offset: soff + e * rows * bpr,
                        src_rows: rows,
                        blocks_per_row: bpr,
                        row_start,
                        row_step,
                    }),
                },
            ));
        }
    }
    Ok(out)
}

/// Whether a tensor is an RMSNorm weight (`*norm.weight`, `*_layernorm.weight`).
fn is_norm(name: &str) -> bool {
    name.ends_with("norm.weight")
}

/// The safetensors files of a model: the index's shards, or every *.safetensors file.
fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>, ImportError> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let v = read_json(&index)?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| ImportError::malformed(&index, None, "weight_map is missing"))?;
        let mut shards = BTreeSet::new();
        for (name, file) in map {
            let file = file.as_str().ok_or_else(|| {
                ImportError::malformed(
                    &index,
                    None,
                    format!("weight_map[{name}] is not a file name"),
                )
            })?;
            if file.contains('/') || file.contains("..") {
                return Err(ImportError::malformed(
                    &index,
                    None,
                    format!("weight_map[{name}] = {file:?} points outside the model directory"),
                ));
            }
            shards.insert(file.to_string());
        }
        return Ok(shards.into_iter().map(|f| dir.join(f)).collect());
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| ImportError::Io {
            op: "list",
            path: dir.into(),
            err: e,
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    if files.is_empty() {
        return Err(ImportError::malformed(dir, None, "no *.safetensors files (and no model.safetensors.index.json); sluice imports safetensors checkpoints only"));
    }
    Ok(files)
}

/// The id of a token given as a string or as `{"content": ...}` in tokenizer_config.json.
fn token_ref_id(v: Option<&Value>, lookup: &impl Fn(&str) -> Option<u32>) -> Option<u32> {
    let s = match v? {
        Value::String(s) => s.as_str(),
        Value::Object(o) => o.get("content")?.as_str()?,
        _ => return None,
    };
    lookup(s)
}

/// Refuses symlinks in the model directory that lead outside it: a downloaded directory
/// must not make sluice read (and pack into a store it may serve) files elsewhere. The one
/// layout allowed is the Hugging Face hub cache's, where `<repo>/snapshots/<rev>/*` link
/// to `<repo>/blobs/*`.
fn check_links(dir: &Path) -> Result<(), ImportError> {
    let io = |op, path: &Path, err| ImportError::Io {
        op,
        path: path.into(),
        err,
    };
    let root = std::fs::canonicalize(dir).map_err(|e| io("resolve", dir, e))?;
    let blobs = root
        .parent()
        .filter(|p| p.file_name().is_some_and(|n| n == "snapshots"))
        .and_then(Path::parent)
        .map(|repo| repo.join("blobs"));
    for entry in std::fs::read_dir(dir).map_err(|e| io("list", dir, e))? {
        let path = entry.map_err(|e| io("list", dir, e))?.path();
        let is_link = std::fs::symlink_metadata(&path)
            .map_err(|e| io("stat", &path, e))?
            .file_type()
            .is_symlink();
        if !is_link {
            continue;
        }
        // A dangling link is left for the reader of that file to report, if it is read.
        let Ok(target) = std::fs::canonicalize(&path) else {
            continue;
        };
        let allowed =
            target.starts_with(&root) || blobs.as_ref().is_some_and(|b| target.starts_with(b));
        if !allowed {
            return Err(ImportError::malformed(
                &path,
                None,
                format!(
                    "a symlink to {}, outside the model directory: refused (copy the file into the directory)",
                    target.display()
                ),
            ));
        }
    }
    Ok(())
}

/// The header length a safetensors file declares, refused past `SAFETENSORS_HEADER_MAX`
/// before the header is parsed.
pub(crate) fn check_header_bytes(path: &Path, map: &[u8]) -> Result<(), ImportError> {
    let n = map
        .get(..8)
        .and_then(|b| b.try_into().ok())
        .map(u64::from_le_bytes)
        .ok_or_else(|| {
            ImportError::malformed(path, Some(0), "shorter than a safetensors header")
        })?;
    if n > SAFETENSORS_HEADER_MAX {
        return Err(ImportError::malformed(
            path,
            Some(0),
            format!("the safetensors header claims {n} bytes; at most {SAFETENSORS_HEADER_MAX} are accepted"),
        ));
    }
    Ok(())
}

pub fn import(dir: &Path) -> Result<ImportedModel, ImportError> {
    check_links(dir)?;
    let arch = arch_config(dir)?;
    let mut files = Vec::new();
    let mut tensors = BTreeMap::new();
    let mut mxfp4: BTreeMap<String, [Option<MxSource>; 2]> = BTreeMap::new();
    for (fi, path) in safetensors_files(dir)?.into_iter().enumerate() {
        let map = mmap_file(&path)?;
        check_header_bytes(&path, &map)?;
        {
            let st = safetensors::SafeTensors::deserialize(&map).map_err(|e| {
                ImportError::malformed(&path, None, format!("invalid safetensors: {e}"))
            })?;
            let base = map.as_ptr() as usize;
            for (name, view) in st.tensors() {
                if name.ends_with("rotary_emb.inv_freq") {
                    continue; // recomputed from rope_theta
                }
                let name = match language_model_name(arch.arch, &name) {
                    Some(n) => n,
                    None => continue, // a multimodal Gemma 3's vision tower
                };
                if arch.tied_embeddings && name == "lm_head.weight" {
                    continue; // some checkpoints store the tied head anyway
                }
                // gpt-oss's MXFP4 experts: a blocks and a scales tensor each, paired once
                // every shard is read.
                let part = name
                    .strip_suffix("_blocks")
                    .map(|b| (b, 0))
                    .or_else(|| name.strip_suffix("_scales").map(|b| (b, 1)));
                if let (Arch::GptOss, Some((base_name, k))) = (arch.arch, part) {
                    if view.dtype() != safetensors::Dtype::U8 {
                        return Err(ImportError::malformed(
                            &path,
                            None,
                            format!(
                                "{name} is {:?}; MXFP4 blocks and scales are U8",
                                view.dtype()
                            ),
                        ));
                    }
                    let at = (view.data().as_ptr() as usize - base) as u64;
                    let shape: Vec<u64> = view.shape().iter().map(|&d| d as u64).collect();
                    mxfp4.entry(base_name.to_string()).or_default()[k] = Some((fi, at, shape));
                    continue;
                }
                let dtype = match view.dtype() {
                    safetensors::Dtype::F32 => DType::F32,
                    safetensors::Dtype::F16 => DType::F16,
                    safetensors::Dtype::BF16 => DType::BF16,
                    other => return Err(ImportError::unsupported(&path, format!("tensor {name} has dtype {other:?}; sluice imports F32, F16 and BF16 safetensors"))),
                };
                let data = view.data();
                // Gemma's norms are applied as x * (1 + w): store 1 + w; gpt-oss's sinks
                // are read as f32 (see `Widen`).
                let widen = if arch.arch == Arch::Gemma3 && is_norm(&name) {
                    Some(Widen {
                        from: dtype,
                        add: 1.0,
                    })
                } else if name.ends_with(".self_attn.sinks") && dtype != DType::F32 {
                    Some(Widen {
                        from: dtype,
                        add: 0.0,
                    })
                } else {
                    None
                };
                let t = SourceTensor {
                    dtype: if widen.is_some() { DType::F32 } else { dtype },
                    shape: view.shape().iter().map(|&d| d as u64).collect(),
                    file: fi,
                    offset: (data.as_ptr() as usize - base) as u64,
                    len: if widen.is_some() {
                        data.len() as u64 / dtype.block_bytes() * 4
                    } else {
                        data.len() as u64
                    },
                    unpermute_heads: None,
                    synthetic_seed: None,
                    synthetic_row_skew: None,
                    widen,
                    strided: None,
                    openai_mxfp4: None,
                };
                for (name, t) in expert_tensors(&arch, name, t, &path)? {
                    if tensors.insert(name.clone(), t).is_some() {
                        return Err(ImportError::malformed(
                            &path,
                            None,
                            format!("tensor {name} appears in two shards"),
                        ));
                    }
                }
            }
        }
        files.push((path, map));
    }
    for (base_name, pair) in mxfp4 {
        let names = |k: &str| format!("{base_name}_{k}");
        let [Some(blocks), Some(scales)] = pair else {
            return Err(ImportError::malformed(
                dir,
                None,
                format!(
                    "{} has no {}: MXFP4 experts need both",
                    names(if pair[0].is_some() {
                        "blocks"
                    } else {
                        "scales"
                    }),
                    names(if pair[0].is_some() {
                        "scales"
                    } else {
                        "blocks"
                    })
                ),
            ));
        };
        let path = files[blocks.0].0.clone();
        for (name, t) in gpt_oss_mxfp4(&arch, &base_name, blocks, scales, &path)? {
            if tensors.insert(name.clone(), t).is_some() {
                return Err(ImportError::malformed(
                    &path,
                    None,
                    format!("tensor {name} appears twice"),
                ));
            }
        }
    }

    let tok_path = dir.join("tokenizer.json");
    let tok_text = read_bounded(
        &tok_path,
        TOKENIZER_BYTES_MAX,
        "read (sluice needs the fast tokenizer file)",
    )?;
    let tok: Value = serde_json::from_str(&tok_text)
        .map_err(|e| ImportError::malformed(&tok_path, None, format!("invalid JSON: {e}")))?;
    let lookup = |s: &str| -> Option<u32> {
        let added = tok
            .get("added_tokens")
            .and_then(Value::as_array)
            .and_then(|a| {
                a.iter()
                    .find(|t| t.get("content").and_then(Value::as_str) == Some(s))
                    .and_then(|t| t.get("id")?.as_u64())
            });
        added
            .or_else(|| tok.get("model")?.get("vocab")?.get(s)?.as_u64())
            .and_then(|x| u32::try_from(x).ok())
    };
    let tc = read_json_opt(&dir.join("tokenizer_config.json"))?;
    let gc = read_json_opt(&dir.join("generation_config.json"))?;
    let chat_template = match tc.as_ref().and_then(|c| c.get("chat_template")) {
        Some(Value::String(s)) => Some(s.clone()),
        // A list of named templates: take "default".
        Some(Value::Array(a)) => a
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template")?.as_str())
            .map(str::to_string),
        _ => None,
    };
    let bos = token_ref_id(tc.as_ref().and_then(|c| c.get("bos_token")), &lookup);
    let eos = token_ref_id(tc.as_ref().and_then(|c| c.get("eos_token")), &lookup);
    let mut end_tokens = Vec::new();
    push_unique(&mut end_tokens, eos);
    match gc.as_ref().and_then(|g| g.get("eos_token_id")) {
        Some(Value::Array(ids)) => ids.iter().for_each(|id| {
            push_unique(
                &mut end_tokens,
                id.as_u64().and_then(|x| u32::try_from(x).ok()),
            )
        }),
        Some(id) => push_unique(
            &mut end_tokens,
            id.as_u64().and_then(|x| u32::try_from(x).ok()),
        ),
        None => {}
    }
    for id in end_of_turn_tokens(chat_template.as_deref(), lookup) {
        push_unique(&mut end_tokens, Some(id));
    }
    let special = SpecialTokens {
        bos,
        eos,
        end_tokens,
        pad: token_ref_id(tc.as_ref().and_then(|c| c.get("pad_token")), &lookup),
        unk: token_ref_id(tc.as_ref().and_then(|c| c.get("unk_token")), &lookup),
        add_bos: tc
            .as_ref()
            .and_then(|c| c.get("add_bos_token"))
            .and_then(Value::as_bool)
            .unwrap_or(false),
    };
    let meta = SourceMeta {
        file_type: None,
        sampling: gc
            .as_ref()
            .map(|g| recommended_sampling(g, dir))
            .unwrap_or_default(),
    };
    Ok(ImportedModel {
        source: dir.to_path_buf(),
        arch,
        tokenizer: TokenizerSpec::HfJson(tok_text),
        special,
        chat_template,
        meta,
        files,
        tensors,
    })
}

/// The sampling a `generation_config.json` recommends: its `temperature`, `top_k`,
/// `top_p`, `min_p` and `repetition_penalty`, with `"do_sample": false` meaning greedy (as
/// transformers' `generate` reads it). Values of the wrong type or out of range are left
/// out with a warning: they change no weight, and the model still packs.
fn recommended_sampling(g: &Value, dir: &Path) -> RecommendedSampling {
    let f = |key: &str| g.get(key).and_then(Value::as_f64).map(|x| x as f32);
    let mut s = RecommendedSampling {
        temperature: f("temperature"),
        top_k: g
            .get("top_k")
            .and_then(Value::as_u64)
            .and_then(|k| u32::try_from(k).ok()),
        top_p: f("top_p"),
        min_p: f("min_p"),
        repetition_penalty: f("repetition_penalty"),
    };
    if g.get("do_sample").and_then(Value::as_bool) == Some(false) {
        s = RecommendedSampling {
            temperature: Some(0.0),
            repetition_penalty: s.repetition_penalty,
            ..RecommendedSampling::default()
        };
    }
    if let Err(e) = s.check() {
        tracing::warn!(
            "{}: generation_config.json: {e}; its sampling is left out",
            dir.join("generation_config.json").display()
        );
        return RecommendedSampling::default();
    }
    s
}
