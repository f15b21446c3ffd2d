//! Synthetic Llama-shaped models for benchmarks (`sluiced synth`): the real layout, tensor
//! names and dtypes at any size, with seeded random weights. Random weights do not compress
//! like trained ones (their mantissas are noise, their exponents spread differently), so
//! compression ratios and decompression rates measured on them are not a real model's.

use super::{ImportedModel, SourceTensor};
use crate::dtype::DType;
use crate::store::arch::{Arch, ArchConfig, MoeConfig};
use crate::store::format::{GgufVocab, SpecialTokens, TokenizerSpec};
use crate::util::rng::Rng;
use half::{bf16, f16};
use std::collections::BTreeMap;
use std::path::PathBuf;

#[derive(Clone, Debug)]
pub struct SynthSpec {
    pub layers: u32,
    pub hidden: u32,
    pub intermediate: u32,
    pub heads: u32,
    pub kv_heads: u32,
    pub vocab: u32,
    /// dtype of the matrices; norms are f32.
    pub dtype: DType,
    pub seed: u64,
    /// A mixture of experts in every layer (Mixtral's layout) instead of the dense MLP.
    pub moe: Option<SynthMoe>,
}

/// `sluiced synth --moe EXPERTS/TOP_K`: every layer a mixture of `experts` gated MLPs of
/// `intermediate` rows, `top_k` per token, renormalized. Router row e is scaled by
/// (e + 1)^-`skew`, so low-numbered experts win the top k far more often (a skewed
/// popularity like a trained router's; `sluice status` shows the one measured).
#[derive(Clone, Copy, Debug)]
pub struct SynthMoe {
    pub experts: u32,
    pub top_k: u32,
    pub intermediate: u32,
    pub skew: f32,
}

impl SynthSpec {
    /// Llama proportions for a hidden size: head dim 64 (128 from hidden 2048), 4 query heads
    /// per kv head, intermediate ~8/3 hidden rounded to 256.
    pub fn llama_like(hidden: u32, layers: u32, dtype: DType) -> SynthSpec {
        let head_dim = if hidden >= 2048 { 128 } else { 64 };
        let heads = (hidden / head_dim).max(1);
        let kv_heads = if heads.is_multiple_of(4) {
            heads / 4
        } else {
            heads
        };
        let intermediate = (hidden * 8 / 3).div_ceil(256) * 256;
        SynthSpec {
            layers,
            hidden,
            intermediate,
            heads,
            kv_heads,
            vocab: 32000,
            dtype,
            seed: 1,
            moe: None,
        }
    }

    pub fn layer_bytes(&self) -> u64 {
        let (h, i) = (self.hidden as u64, self.intermediate as u64);
        let hd = h / self.heads as u64;
        let kv = self.kv_heads as u64 * hd;
        let rows = |r: u64, c: u64| self.dtype.tensor_bytes(&[r, c]).unwrap_or(0);
        let attn = rows(h, h) * 2 + rows(kv, h) * 2 + 2 * h * 4;
        match self.moe {
            None => attn + rows(i, h) * 2 + rows(h, i),
            Some(m) => {
                let (n, mi) = (m.experts as u64, m.intermediate as u64);
                attn + n * h * 4 + n * (rows(mi, h) * 2 + rows(h, mi))
            }
        }
    }

    pub fn fixed_bytes(&self) -> u64 {
        let rows = |r: u64, c: u64| self.dtype.tensor_bytes(&[r, c]).unwrap_or(0);
        2 * rows(self.vocab as u64, self.hidden as u64) + self.hidden as u64 * 4
    }
}

/// Roughly normal, mean 0, standard deviation `std` (sum of four uniforms).
fn normal(rng: &mut Rng, std: f32) -> f32 {
    let r = rng.next_u64();
    let u = |s: u32| ((r >> s) & 0xFFFF) as f32 / 65536.0;
    (u(0) + u(16) + u(32) + u(48) - 2.0) * std * 1.732
}

/// Fills `dst` with random weights of `dtype`, like trained ones in magnitude: matrices
/// ~N(0, 1/sqrt(cols)), vectors (norms) around 1.
pub fn fill(dtype: DType, shape: &[u64], seed: u64, dst: &mut [u8]) {
    let mut rng = Rng::new(seed);
    let cols = *shape.last().unwrap_or(&1) as f32;
    let is_vector = shape.len() == 1;
    let std = if is_vector { 0.1 } else { 1.0 / cols.sqrt() };
    let mean = if is_vector { 1.0 } else { 0.0 };
    match dtype {
        DType::F32 => dst
            .chunks_exact_mut(4)
            .for_each(|c| c.copy_from_slice(&(mean + normal(&mut rng, std)).to_le_bytes())),
        DType::F16 => dst.chunks_exact_mut(2).for_each(|c| {
            c.copy_from_slice(&f16::from_f32(mean + normal(&mut rng, std)).to_le_bytes())
        }),
        DType::BF16 => dst.chunks_exact_mut(2).for_each(|c| {
            c.copy_from_slice(&bf16::from_f32(mean + normal(&mut rng, std)).to_le_bytes())
        }),
        DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => {
            let bb = dtype.block_bytes() as usize;
            for block in dst.chunks_exact_mut(bb) {
                let r = rng.next_u64();
                let scale = f16::from_f32(std * (0.15 + (r & 0xFF) as f32 / 2048.0));
                block[0..2].copy_from_slice(&scale.to_le_bytes());
                let mut at = 2;
                if dtype == DType::Q4_1 {
                    block[2..4]
                        .copy_from_slice(&f16::from_f32(-8.0 * scale.to_f32()).to_le_bytes());
                    at = 4;
                }
                for b in block[at..].chunks_mut(8) {
                    let v = rng.next_u64().to_le_bytes();
                    b.copy_from_slice(&v[..b.len()]);
                }
            }
        }
        // The K-quant-era formats: random bits under moderate scales.
        _ => {
            let n = dst.len() / dtype.block_bytes() as usize;
            dst.copy_from_slice(&crate::dtype::ggml::sample_blocks(dtype, n, &mut || {
                rng.next_u64()
            }));
        }
    }
}

/// Scales row r of a generated matrix by (r + 1)^-`skew` (f32 and 16-bit floats; other
/// dtypes are left as generated).
pub fn skew_rows(dtype: DType, shape: &[u64], skew: f32, dst: &mut [u8]) {
    let cols = *shape.last().unwrap_or(&1) as usize;
    let w = match dtype {
        DType::F32 => 4,
        DType::F16 | DType::BF16 => 2,
        _ => return,
    };
    for (r, row) in dst.chunks_exact_mut(cols * w).enumerate() {
        let s = (r as f32 + 1.0).powf(-skew);
        for c in row.chunks_exact_mut(w) {
            match dtype {
                DType::F32 => {
                    let v = f32::from_le_bytes([c[0], c[1], c[2], c[3]]) * s;
                    c.copy_from_slice(&v.to_le_bytes());
                }
                DType::F16 => {
                    let v = f16::from_le_bytes([c[0], c[1]]).to_f32() * s;
                    c.copy_from_slice(&f16::from_f32(v).to_le_bytes());
                }
                _ => {
                    let v = bf16::from_le_bytes([c[0], c[1]]).to_f32() * s;
                    c.copy_from_slice(&bf16::from_f32(v).to_le_bytes());
                }
            }
        }
    }
}

/// An imported model whose tensors are generated on copy.
pub fn model(spec: &SynthSpec) -> ImportedModel {
    let (h, i, v) = (
        spec.hidden as u64,
        spec.intermediate as u64,
        spec.vocab as u64,
    );
    let head_dim = spec.hidden / spec.heads;
    let (q, kv) = (
        spec.heads as u64 * head_dim as u64,
        spec.kv_heads as u64 * head_dim as u64,
    );
    let mut tensors = BTreeMap::new();
    let mut seeds = Rng::new(spec.seed);
    let mut add = |name: String, dtype: DType, shape: Vec<u64>, skew: Option<f32>| {
        let seed = seeds.next_u64();
        // Synthetic shapes are whole blocks by construction (the spec's sizes are checked).
        #[allow(clippy::expect_used)]
        let len = dtype
            .tensor_bytes(&shape)
            .expect("synthetic shapes are whole blocks");
        tensors.insert(
            name,
            SourceTensor {
                dtype,
                shape,
                file: 0,
                offset: 0,
                len,
                unpermute_heads: None,
                synthetic_seed: Some(seed),
                synthetic_row_skew: skew,
                widen: None,
                strided: None,
                openai_mxfp4: None,
            },
        );
    };
    let d = spec.dtype;
    add("model.embed_tokens.weight".into(), d, vec![v, h], None);
    for l in 0..spec.layers {
        let p = format!("model.layers.{l}");
        add(
            format!("{p}.input_layernorm.weight"),
            DType::F32,
            vec![h],
            None,
        );
        add(format!("{p}.self_attn.q_proj.weight"), d, vec![q, h], None);
        add(format!("{p}.self_attn.k_proj.weight"), d, vec![kv, h], None);
        add(format!("{p}.self_attn.v_proj.weight"), d, vec![kv, h], None);
        add(format!("{p}.self_attn.o_proj.weight"), d, vec![h, q], None);
        add(
            format!("{p}.post_attention_layernorm.weight"),
            DType::F32,
            vec![h],
            None,
        );
        match spec.moe {
            None => {
                add(format!("{p}.mlp.gate_proj.weight"), d, vec![i, h], None);
                add(format!("{p}.mlp.up_proj.weight"), d, vec![i, h], None);
                add(format!("{p}.mlp.down_proj.weight"), d, vec![h, i], None);
            }
            Some(m) => {
                let (n, mi) = (m.experts as u64, m.intermediate as u64);
                // The router in f32, as GGUF converters keep it.
                add(
                    format!("{p}.mlp.gate.weight"),
                    DType::F32,
                    vec![n, h],
                    Some(m.skew),
                );
                for e in 0..n {
                    let x = format!("{p}.mlp.experts.{e}");
                    add(format!("{x}.gate_proj.weight"), d, vec![mi, h], None);
                    add(format!("{x}.up_proj.weight"), d, vec![mi, h], None);
                    add(format!("{x}.down_proj.weight"), d, vec![h, mi], None);
                }
            }
        }
    }
    add("model.norm.weight".into(), DType::F32, vec![h], None);
    add("lm_head.weight".into(), d, vec![v, h], None);
    // A byte-level vocabulary (every byte a token, the rest unused) so the tokenizer builds.
    let mut tokens: Vec<String> = (0..256u32).map(|b| format!("<0x{b:02X}>")).collect();
    tokens.extend((256..spec.vocab).map(|i| format!("<unused{i}>")));
    ImportedModel {
        source: PathBuf::from(format!(
            "synthetic-{}x{}-{}",
            spec.layers, spec.hidden, spec.dtype
        )),
        arch: ArchConfig {
            arch: if spec.moe.is_some() {
                Arch::Mixtral
            } else {
                Arch::Llama
            },
            name: match spec.moe {
                None => format!(
                    "synthetic llama {} layers x {} hidden ({})",
                    spec.layers, spec.hidden, spec.dtype
                ),
                Some(m) => format!(
                    "synthetic mixture {} layers x {} hidden, {} experts of {} rows, top {} ({})",
                    spec.layers, spec.hidden, m.experts, m.intermediate, m.top_k, spec.dtype
                ),
            },
            n_layers: spec.layers,
            hidden: spec.hidden,
            n_heads: spec.heads,
            n_kv_heads: spec.kv_heads,
            head_dim,
            intermediate: spec.intermediate,
            vocab: spec.vocab,
            max_context: 4096,
            rope_theta: 10000.0,
            rope_scaling: None,
            rms_eps: 1e-5,
            tied_embeddings: false,
            qkv_bias: false,
            sliding_window: None,
            ext: Default::default(),
            moe: spec.moe.map(|m| MoeConfig {
                n_experts: m.experts,
                top_k: m.top_k,
                intermediate: m.intermediate,
                norm_topk_prob: true,
                dense_layers: Vec::new(),
            }),
            swiglu: None,
        },
        tokenizer: TokenizerSpec::Gguf(GgufVocab {
            model: "llama".into(),
            pre: None,
            token_types: vec![6; 256]
                .into_iter()
                .chain(std::iter::repeat_n(1, spec.vocab as usize - 256))
                .collect(),
            scores: vec![0.0; spec.vocab as usize],
            tokens,
            merges: Vec::new(),
            add_space_prefix: false,
        }),
        special: SpecialTokens::default(),
        chat_template: None,
        meta: Default::default(),
        files: Vec::new(),
        tensors,
    }
}
