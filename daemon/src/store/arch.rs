//! One architecture config for every supported family, filled alike by the GGUF and the
//! Hugging Face importers so that the model code never looks at where a model came from.
//!
//! It is part of the manifest schema (written by `pack`, read by the model), so it lives
//! with the store format and changes with its format version.

use serde::{Deserialize, Serialize};
use std::fmt;

#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Llama 2/3 and models built on it (SmolLM2, TinyLlama, ...).
    Llama,
    /// Mistral: Llama layout, sliding-window attention in the original.
    Mistral,
    /// Qwen2: Llama layout with q/k/v biases.
    Qwen2,
    /// Qwen3: per-head RMSNorm on q and k, head dim set apart from hidden / heads.
    Qwen3,
    /// Gemma 3: scaled embeddings, norms around attention and MLP, GeGLU, q/k norm, five
    /// sliding-window layers to one global.
    Gemma3,
    /// Qwen3-MoE: Qwen3's attention, a mixture of experts in place of the MLP (softmax
    /// router, top-k, optionally renormalized), some layers dense (`mlp_only_layers`).
    Qwen3Moe,
    /// Mixtral: Mistral's layout with a mixture of experts (softmax, top-2, renormalized).
    Mixtral,
    /// gpt-oss: biases on every projection, a learned attention sink per head, sliding-window
    /// and full attention layers alternating, YaRN RoPE, and a mixture of experts with a
    /// biased router (top-k logits, then softmax over them) and biased experts whose gated
    /// MLP is the clamped SwiGLU (`SwigluClamp`).
    GptOss,
}

/// What a decoder layer of an architecture is made of, under `model.layers.{i}.` (Hugging
/// Face names: the GGUF importer maps to them). Every layer has q/k/v/o projections and a
/// gated MLP (`mlp.{gate,up,down}_proj`); the recipe names its norms and says which
/// optional blocks it has. Adding an architecture is a variant here with its recipe, and
/// its config mapping in the importers.
#[derive(Clone, Copy, Debug)]
pub struct Recipe {
    /// Before attention.
    pub attn_norm: &'static str,
    /// On the attention output, before the residual add (Gemma 2/3).
    pub post_attn_norm: Option<&'static str>,
    /// Before the MLP.
    pub ffn_norm: &'static str,
    /// On the MLP output, before the residual add (Gemma 2/3).
    pub post_ffn_norm: Option<&'static str>,
    /// Per-head RMSNorm of q and k before RoPE (`self_attn.q_norm` / `k_norm`).
    pub qk_norm: bool,
    pub activation: Activation,
    /// The output projection has a bias (`self_attn.o_proj.bias`).
    pub o_bias: bool,
    /// A learned sink logit per attention head (`self_attn.sinks`, f32 [heads]): it joins
    /// each query's softmax and takes its share of the weight, then is dropped.
    pub attn_sinks: bool,
    /// How a mixture's router turns logits into expert weights.
    pub gating: Gating,
    /// A mixture's router (`mlp.gate.bias`) and experts (`mlp.experts.{e}.*_proj.bias`)
    /// have biases.
    pub moe_bias: bool,
}

/// A mixture's router: which experts a row goes to and with what weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Gating {
    /// Softmax over every expert, the top k taken (renormalized when the config says so):
    /// Qwen3-MoE, Mixtral.
    SoftmaxTopK,
    /// The top k logits, then softmax over those k (gpt-oss).
    TopKSoftmax,
}

/// Llama 2/3, Mistral, Qwen2, SmolLM2: a norm before attention and before a SwiGLU MLP.
/// (Mistral's sliding window and Qwen2's biases are config.)
const LLAMA: Recipe = Recipe {
    attn_norm: "input_layernorm",
    post_attn_norm: None,
    ffn_norm: "post_attention_layernorm",
    post_ffn_norm: None,
    qk_norm: false,
    activation: Activation::Silu,
    o_bias: false,
    attn_sinks: false,
    gating: Gating::SoftmaxTopK,
    moe_bias: false,
};

/// Qwen3: Llama with q/k norm (and a head dim of its own, which is config).
const QWEN3: Recipe = Recipe {
    qk_norm: true,
    ..LLAMA
};

/// Gemma 3: norms before and after attention and the MLP (Gemma's norm is x * (1 + w):
/// the importers store 1 + w, so a plain RMSNorm applies it), GeGLU with tanh GELU, q/k
/// norm. Its scaled embeddings, attention scale, sliding-window layers and their RoPE
/// base are config (`ArchExt`).
const GEMMA3: Recipe = Recipe {
    attn_norm: "input_layernorm",
    post_attn_norm: Some("post_attention_layernorm"),
    ffn_norm: "pre_feedforward_layernorm",
    post_ffn_norm: Some("post_feedforward_layernorm"),
    qk_norm: true,
    activation: Activation::GeluTanh,
    ..LLAMA
};

/// gpt-oss: Llama's norms, biases everywhere, attention sinks, the clamped SwiGLU and
/// top-k-then-softmax gating. (Its q/k/v biases, alternating windows and YaRN are config.)
const GPT_OSS: Recipe = Recipe {
    activation: Activation::SwigluClamp,
    o_bias: true,
    attn_sinks: true,
    gating: Gating::TopKSoftmax,
    moe_bias: true,
    ..LLAMA
};

impl Arch {
    pub fn recipe(self) -> &'static Recipe {
        match self {
            Arch::Llama | Arch::Mistral | Arch::Qwen2 | Arch::Mixtral => &LLAMA,
            Arch::Qwen3 | Arch::Qwen3Moe => &QWEN3,
            Arch::Gemma3 => &GEMMA3,
            Arch::GptOss => &GPT_OSS,
        }
    }
}

impl ArchExt {
    /// Gemma 3's: embeddings scaled by sqrt(hidden), scores by
    /// query_pre_attn_scalar ^ -0.5, the sliding layers with their own RoPE base.
    pub fn gemma3(
        hidden: u32,
        query_pre_attn_scalar: f64,
        sliding_layers: Vec<u32>,
        rope_local_theta: f32,
    ) -> ArchExt {
        ArchExt {
            embed_scale: Some((hidden as f32).sqrt()),
            attn_scale: Some(query_pre_attn_scalar.powf(-0.5) as f32),
            sliding_layers,
            rope_local_theta: Some(rope_local_theta),
        }
    }
}

/// The layers of a Gemma 3 model that use the sliding window: all but every `pattern`-th
/// (`sliding_window_pattern` 6, as llama.cpp's swa pattern).
pub fn every_but_nth(n_layers: u32, pattern: u32) -> Vec<u32> {
    (0..n_layers)
        .filter(|i| pattern == 0 || (i + 1) % pattern != 0)
        .collect()
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Gemma3 => "gemma3",
            Arch::Qwen3Moe => "qwen3moe",
            Arch::Mixtral => "mixtral",
            Arch::GptOss => "gpt-oss",
        })
    }
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub enum RopeScaling {
    /// Positions divided by `factor`.
    Linear { factor: f32 },
    /// Llama 3.1 frequency-dependent scaling (transformers `rope_type: llama3`).
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: u32,
    },
    /// Per-frequency divisors given outright (GGUF `rope_freqs.weight`, which llama.cpp's
    /// converter computes from the llama3 parameters), one per rotary pair.
    FreqFactors(Vec<f32>),
    /// YaRN (transformers `rope_type: yarn`, `_compute_yarn_parameters`): frequencies
    /// between the correction dims of `beta_fast` and `beta_slow` rotations over
    /// `original_max_position` ramp from extrapolated (unscaled) to interpolated (divided
    /// by `factor`); cos and sin are multiplied by `attention_factor`. `truncate` rounds
    /// the correction dims outward (transformers' default, and always in llama.cpp);
    /// gpt-oss's config turns it off.
    Yarn {
        factor: f32,
        original_max_position: u32,
        beta_fast: f32,
        beta_slow: f32,
        attention_factor: f32,
        truncate: bool,
    },
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct ArchConfig {
    pub arch: Arch,
    /// Human-readable model name from the source metadata (may be empty).
    pub name: String,
    pub n_layers: u32,
    pub hidden: u32,
    pub n_heads: u32,
    pub n_kv_heads: u32,
    pub head_dim: u32,
    pub intermediate: u32,
    pub vocab: u32,
    pub max_context: u32,
    pub rope_theta: f32,
    pub rope_scaling: Option<RopeScaling>,
    pub rms_eps: f32,
    /// The output head reuses the token embedding matrix.
    pub tied_embeddings: bool,
    /// q/k/v projections carry biases (Qwen2).
    pub qkv_bias: bool,
    /// Sliding-window attention size, when the source declares one (Mistral, Gemma 3):
    /// a query sees itself and the `window - 1` positions before it. Applied to the
    /// layers `ext.sliding_layers` names, or to every layer when that is empty.
    pub sliding_window: Option<u32>,
    /// Store format 2's additions (written after the format-1 manifest, see
    /// `store::format`); defaults for a format-1 store.
    #[serde(skip)]
    pub ext: ArchExt,
    /// Store format 3's: the mixture of experts of a MoE architecture (None: every layer
    /// has a dense MLP).
    #[serde(skip)]
    pub moe: Option<MoeConfig>,
    /// Store format 4's: the clamped SwiGLU's constants (gpt-oss; None for the others).
    #[serde(skip)]
    pub swiglu: Option<SwigluClamp>,
}

/// gpt-oss's gated MLP: gate = min(gate, limit), up = clamp(up, -limit, limit), out =
/// (up + 1) * gate * sigmoid(alpha * gate).
#[derive(Serialize, Deserialize, Clone, Copy, Debug, PartialEq)]
pub struct SwigluClamp {
    pub alpha: f32,
    pub limit: f32,
}

/// A mixture of experts in place of the MLP: a router (`mlp.gate`, a linear map from the
/// hidden state to one logit per expert), softmax over the experts in f32, the `top_k`
/// most probable (their probabilities renormalized to sum to 1 when `norm_topk_prob`),
/// and each chosen expert's gated MLP (`mlp.experts.{e}.{gate,up,down}_proj`, of
/// `intermediate` rows) weighted by its probability, summed over the chosen experts in
/// ascending expert order.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct MoeConfig {
    pub n_experts: u32,
    pub top_k: u32,
    /// Rows of each expert's gate and up projections.
    pub intermediate: u32,
    pub norm_topk_prob: bool,
    /// Layers with a dense MLP of `ArchConfig::intermediate` instead (Qwen3-MoE's
    /// `mlp_only_layers` and `decoder_sparse_step`), ascending.
    pub dense_layers: Vec<u32>,
}

/// Experts a layer may have at most (a sanity bound against crafted manifests; the
/// largest released models have 256).
pub const EXPERTS_MAX: u32 = 1024;

/// The MLP's gate activation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// SwiGLU: silu(gate) * up.
    Silu,
    /// GeGLU with the tanh approximation of GELU (Gemma).
    GeluTanh,
    /// The clamped SwiGLU of gpt-oss (constants in `ArchConfig::swiglu`).
    SwigluClamp,
}

/// What the architectures after format 1 added to the config.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
pub struct ArchExt {
    /// Token embeddings are multiplied by this (Gemma: sqrt(hidden), rounded to the
    /// activation dtype as transformers does).
    pub embed_scale: Option<f32>,
    /// Attention scores are scaled by this instead of 1 / sqrt(head dim) (Gemma 3:
    /// query_pre_attn_scalar ^ -0.5).
    pub attn_scale: Option<f32>,
    /// Layers that attend through `sliding_window` (empty: every layer, when a window is
    /// set). The others attend to the whole context.
    pub sliding_layers: Vec<u32>,
    /// RoPE base of the sliding-window layers, unscaled (Gemma 3: 10 000); the others use
    /// `rope_theta` with `rope_scaling`.
    pub rope_local_theta: Option<f32>,
}

impl ArchConfig {
    pub fn q_dim(&self) -> u64 {
        self.n_heads as u64 * self.head_dim as u64
    }

    pub fn kv_dim(&self) -> u64 {
        self.n_kv_heads as u64 * self.head_dim as u64
    }

    /// The tensors of decoder layer `i` and their shapes, in unit order
    /// (`layer_spec` flattened).
    pub fn layer_tensors(&self, i: u32) -> Vec<(String, Vec<u64>)> {
        let spec = self.layer_spec(i);
        spec.flatten()
            .into_iter()
            .map(|t| (t.name, t.shape))
            .collect()
    }

    /// Whether layer `i` has a mixture of experts (not a dense MLP).
    pub fn is_sparse(&self, i: u32) -> bool {
        self.moe
            .as_ref()
            .is_some_and(|m| !m.dense_layers.contains(&i))
    }

    /// The attention window of layer `layer`, if it is a sliding-window layer.
    pub fn window(&self, layer: u32) -> Option<u32> {
        let w = self.sliding_window?;
        (self.ext.sliding_layers.is_empty() || self.ext.sliding_layers.contains(&layer))
            .then_some(w)
    }

    /// Checks the relations the forward pass relies on; the message says which one fails.
    pub fn validate(&self) -> Result<(), String> {
        let nonzero = [
            ("layers", self.n_layers),
            ("hidden size", self.hidden),
            ("attention heads", self.n_heads),
            ("kv heads", self.n_kv_heads),
            ("head dim", self.head_dim),
            ("intermediate size", self.intermediate),
            ("vocab size", self.vocab),
        ];
        for (what, v) in nonzero {
            if v == 0 {
                return Err(format!("{what} is 0"));
            }
        }
        if !self.n_heads.is_multiple_of(self.n_kv_heads) {
            return Err(format!(
                "{} attention heads are not a multiple of {} kv heads (grouped-query attention needs that)",
                self.n_heads, self.n_kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "head dim {} is odd; rotary embedding needs pairs",
                self.head_dim
            ));
        }
        if !(self.rms_eps > 0.0 && self.rms_eps < 1.0) {
            return Err(format!("rms eps {} is outside (0, 1)", self.rms_eps));
        }
        if self.rope_theta.is_nan() || self.rope_theta <= 0.0 {
            return Err(format!("rope theta {} is not positive", self.rope_theta));
        }
        if self.sliding_window == Some(0) {
            return Err("sliding window is 0".into());
        }
        if let Some(&l) = self
            .ext
            .sliding_layers
            .iter()
            .find(|&&l| l >= self.n_layers)
        {
            return Err(format!(
                "sliding-window layer {l} is past the {} layers",
                self.n_layers
            ));
        }
        for (what, v) in [
            ("embedding scale", self.ext.embed_scale),
            ("attention scale", self.ext.attn_scale),
            ("local rope theta", self.ext.rope_local_theta),
        ] {
            if let Some(v) = v {
                if !(v.is_finite() && v > 0.0) {
                    return Err(format!("{what} {v} is not a positive number"));
                }
            }
        }
        let moe_arch = matches!(self.arch, Arch::Qwen3Moe | Arch::Mixtral | Arch::GptOss);
        match (&self.swiglu, self.arch.recipe().activation) {
            (None, Activation::SwigluClamp) => {
                return Err(format!("{} needs its SwiGLU clamp constants", self.arch))
            }
            (Some(_), a) if a != Activation::SwigluClamp => {
                return Err(format!("{} has no clamped SwiGLU", self.arch))
            }
            (Some(s), _) if !(s.alpha.is_finite() && s.limit.is_finite() && s.limit > 0.0) => {
                return Err(format!(
                    "SwiGLU alpha {} and limit {} are not finite with a positive limit",
                    s.alpha, s.limit
                ))
            }
            _ => {}
        }
        if let Some(RopeScaling::Yarn {
            factor,
            original_max_position,
            beta_fast,
            beta_slow,
            attention_factor,
            ..
        }) = &self.rope_scaling
        {
            let ok = |v: f32| v.is_finite() && v > 0.0;
            if !(ok(*factor) && ok(*beta_fast) && ok(*beta_slow) && ok(*attention_factor))
                || *original_max_position == 0
            {
                return Err(format!(
                    "YaRN factor {factor}, betas {beta_fast}/{beta_slow}, attention factor \
                     {attention_factor} and original context {original_max_position} must be positive"
                ));
            }
        }
        match (&self.moe, moe_arch) {
            (None, true) => return Err(format!("{} needs a mixture-of-experts config", self.arch)),
            (Some(_), false) => return Err(format!("{} has no mixture of experts", self.arch)),
            (Some(m), true) => {
                if !(1..=EXPERTS_MAX).contains(&m.n_experts) {
                    return Err(format!(
                        "{} experts, outside 1 to {EXPERTS_MAX}",
                        m.n_experts
                    ));
                }
                if !(1..=m.n_experts).contains(&m.top_k) {
                    return Err(format!(
                        "{} experts per token, outside 1 to the {} experts",
                        m.top_k, m.n_experts
                    ));
                }
                if m.intermediate == 0 {
                    return Err("expert intermediate size is 0".into());
                }
                if !m.dense_layers.windows(2).all(|w| w[0] < w[1])
                    || m.dense_layers.last().is_some_and(|&l| l >= self.n_layers)
                {
                    return Err(format!(
                        "dense layers {:?} are not ascending layers below {}",
                        m.dense_layers, self.n_layers
                    ));
                }
            }
            (None, false) => {}
        }
        if let Some(RopeScaling::FreqFactors(f)) = &self.rope_scaling {
            if f.len() as u32 != self.head_dim / 2 {
                return Err(format!(
                    "{} rope frequency factors, expected head dim / 2 = {}",
                    f.len(),
                    self.head_dim / 2
                ));
            }
        }
        Ok(())
    }
}
