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
}

impl fmt::Display for Arch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
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
    /// Sliding-window attention size, when the source declares one (Mistral).
    pub sliding_window: Option<u32>,
}

impl ArchConfig {
    pub fn q_dim(&self) -> u64 {
        self.n_heads as u64 * self.head_dim as u64
    }

    pub fn kv_dim(&self) -> u64 {
        self.n_kv_heads as u64 * self.head_dim as u64
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
