//! The tensors a model is made of, by role: written once per architecture (from its
//! `Recipe` and `ArchConfig`), flattened into the unit order the importers write and
//! checked against, and bound by the decoder to where each tensor lies in its unit.
//!
//! The spec types are generic over what a tensor is: a `TensorSpec` (name and shape) here,
//! a location in the unit's bytes in the decoder (`LayerSpec::try_map`).

use super::arch::ArchConfig;

/// A tensor's Hugging Face name and shape (rows first; one dimension for a vector).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    pub name: String,
    pub shape: Vec<u64>,
}

impl TensorSpec {
    fn new(name: String, shape: &[u64]) -> Self {
        TensorSpec {
            name,
            shape: shape.to_vec(),
        }
    }
}

/// One decoder layer's tensors by role; the optional ones are there when the recipe or
/// config has the block.
#[derive(Clone, Debug)]
pub struct LayerSpec<T> {
    pub attn_norm: T,
    pub q: T,
    pub k: T,
    pub v: T,
    pub qkv_bias: Option<[T; 3]>,
    /// Per-head norms of q and k.
    pub qk_norm: Option<[T; 2]>,
    pub o: T,
    pub o_bias: Option<T>,
    /// Per-head attention sink logits.
    pub sinks: Option<T>,
    pub post_attn_norm: Option<T>,
    pub ffn_norm: T,
    pub ffn: FfnSpec<T>,
    pub post_ffn_norm: Option<T>,
}

/// A layer's feed-forward block: a gated MLP, or a mixture of experts (its router and
/// each expert's gate, up and down projections).
#[derive(Clone, Debug)]
pub enum FfnSpec<T> {
    Dense {
        gate: T,
        up: T,
        down: T,
    },
    Moe {
        router: T,
        router_bias: Option<T>,
        experts: Vec<ExpertSpec<T>>,
    },
}

/// One expert's gate, up and down projections, and their biases where the model has them.
#[derive(Clone, Copy, Debug)]
pub struct ExpertSpec<T> {
    pub w: [T; 3],
    pub b: Option<[T; 3]>,
}

/// The head unit's tensors: the final norm, and the output projection unless it is tied
/// to the embedding.
#[derive(Clone, Debug)]
pub struct HeadSpec<T> {
    pub norm: T,
    pub lm_head: Option<T>,
}

fn map_arr<T, U, E, const N: usize>(
    a: &[T; N],
    f: &mut impl FnMut(&T) -> Result<U, E>,
) -> Result<[U; N], E> {
    let v: Vec<U> = a.iter().map(&mut *f).collect::<Result<_, E>>()?;
    match v.try_into() {
        Ok(a) => Ok(a),
        Err(_) => unreachable!("N elements in, N out"),
    }
}

fn map_opt<T, U, E>(o: &Option<T>, f: &mut impl FnMut(&T) -> Result<U, E>) -> Result<Option<U>, E> {
    o.as_ref().map(&mut *f).transpose()
}

impl<T> LayerSpec<T> {
    /// The same layer with each tensor mapped by `f`, in unit order (the first error
    /// stops it).
    pub fn try_map<U, E>(&self, mut f: impl FnMut(&T) -> Result<U, E>) -> Result<LayerSpec<U>, E> {
        let f = &mut f;
        Ok(LayerSpec {
            attn_norm: f(&self.attn_norm)?,
            q: f(&self.q)?,
            k: f(&self.k)?,
            v: f(&self.v)?,
            qkv_bias: self.qkv_bias.as_ref().map(|a| map_arr(a, f)).transpose()?,
            qk_norm: self.qk_norm.as_ref().map(|a| map_arr(a, f)).transpose()?,
            o: f(&self.o)?,
            o_bias: map_opt(&self.o_bias, f)?,
            sinks: map_opt(&self.sinks, f)?,
            post_attn_norm: map_opt(&self.post_attn_norm, f)?,
            ffn_norm: f(&self.ffn_norm)?,
            ffn: match &self.ffn {
                FfnSpec::Dense { gate, up, down } => FfnSpec::Dense {
                    gate: f(gate)?,
                    up: f(up)?,
                    down: f(down)?,
                },
                FfnSpec::Moe {
                    router,
                    router_bias,
                    experts,
                } => FfnSpec::Moe {
                    router: f(router)?,
                    router_bias: map_opt(router_bias, f)?,
                    experts: experts
                        .iter()
                        .map(|x| {
                            Ok(ExpertSpec {
                                w: map_arr(&x.w, f)?,
                                b: x.b.as_ref().map(|b| map_arr(b, f)).transpose()?,
                            })
                        })
                        .collect::<Result<_, E>>()?,
                },
            },
            post_ffn_norm: map_opt(&self.post_ffn_norm, f)?,
        })
    }

    /// The layer's tensors in unit order: attention (its norm, q, k, v, their biases, the
    /// q/k norms, o and its bias, the sinks, the norm after it), then the MLP's norm, the
    /// MLP (a mixture: the router, then each expert's projections with their biases, expert
    /// by expert, so an expert is one contiguous run of the unit), then the norm after it.
    pub fn flatten(self) -> Vec<T> {
        let mut t = vec![self.attn_norm, self.q, self.k, self.v];
        t.extend(self.qkv_bias.into_iter().flatten());
        t.extend(self.qk_norm.into_iter().flatten());
        t.push(self.o);
        t.extend(self.o_bias);
        t.extend(self.sinks);
        t.extend(self.post_attn_norm);
        t.push(self.ffn_norm);
        match self.ffn {
            FfnSpec::Dense { gate, up, down } => t.extend([gate, up, down]),
            FfnSpec::Moe {
                router,
                router_bias,
                experts,
            } => {
                t.push(router);
                t.extend(router_bias);
                for x in experts {
                    match x.b {
                        Some(b) => {
                            for (w, b) in x.w.into_iter().zip(b) {
                                t.extend([w, b]);
                            }
                        }
                        None => t.extend(x.w),
                    }
                }
            }
        }
        t.extend(self.post_ffn_norm);
        t
    }
}

impl ArchConfig {
    /// The embedding unit's one tensor.
    pub fn embedding_spec(&self) -> TensorSpec {
        TensorSpec::new(
            "model.embed_tokens.weight".into(),
            &[self.vocab as u64, self.hidden as u64],
        )
    }

    /// The head unit's tensors.
    pub fn head_spec(&self) -> HeadSpec<TensorSpec> {
        let (h, vocab) = (self.hidden as u64, self.vocab as u64);
        HeadSpec {
            norm: TensorSpec::new("model.norm.weight".into(), &[h]),
            lm_head: (!self.tied_embeddings)
                .then(|| TensorSpec::new("lm_head.weight".into(), &[vocab, h])),
        }
    }

    /// Decoder layer `i`'s tensors by role, as its recipe and this config ask.
    pub fn layer_spec(&self, i: u32) -> LayerSpec<TensorSpec> {
        let (h, q, kv, inter, hd) = (
            self.hidden as u64,
            self.q_dim(),
            self.kv_dim(),
            self.intermediate as u64,
            self.head_dim as u64,
        );
        let r = self.arch.recipe();
        let p = format!("model.layers.{i}");
        let t = |name: &str, shape: &[u64]| TensorSpec::new(format!("{p}.{name}"), shape);
        let attn =
            |proj: &str, part: &str, shape: &[u64]| t(&format!("self_attn.{proj}.{part}"), shape);
        let norm = |name: &str| t(&format!("{name}.weight"), &[h]);
        LayerSpec {
            attn_norm: norm(r.attn_norm),
            q: attn("q_proj", "weight", &[q, h]),
            k: attn("k_proj", "weight", &[kv, h]),
            v: attn("v_proj", "weight", &[kv, h]),
            qkv_bias: self.qkv_bias.then(|| {
                [
                    attn("q_proj", "bias", &[q]),
                    attn("k_proj", "bias", &[kv]),
                    attn("v_proj", "bias", &[kv]),
                ]
            }),
            qk_norm: r.qk_norm.then(|| {
                [
                    attn("q_norm", "weight", &[hd]),
                    attn("k_norm", "weight", &[hd]),
                ]
            }),
            o: attn("o_proj", "weight", &[h, q]),
            o_bias: r.o_bias.then(|| attn("o_proj", "bias", &[h])),
            sinks: r
                .attn_sinks
                .then(|| t("self_attn.sinks", &[self.n_heads as u64])),
            post_attn_norm: r.post_attn_norm.map(norm),
            ffn_norm: norm(r.ffn_norm),
            ffn: match self.moe.as_ref().filter(|_| self.is_sparse(i)) {
                Some(moe) => {
                    let (n, mi) = (moe.n_experts as u64, moe.intermediate as u64);
                    let expert = |e: u64| {
                        let x = |proj: &str, part: &str, shape: &[u64]| {
                            t(&format!("mlp.experts.{e}.{proj}.{part}"), shape)
                        };
                        ExpertSpec {
                            w: [
                                x("gate_proj", "weight", &[mi, h]),
                                x("up_proj", "weight", &[mi, h]),
                                x("down_proj", "weight", &[h, mi]),
                            ],
                            b: r.moe_bias.then(|| {
                                [
                                    x("gate_proj", "bias", &[mi]),
                                    x("up_proj", "bias", &[mi]),
                                    x("down_proj", "bias", &[h]),
                                ]
                            }),
                        }
                    };
                    FfnSpec::Moe {
                        router: t("mlp.gate.weight", &[n, h]),
                        router_bias: r.moe_bias.then(|| t("mlp.gate.bias", &[n])),
                        experts: (0..n).map(expert).collect(),
                    }
                }
                None => FfnSpec::Dense {
                    gate: t("mlp.gate_proj.weight", &[inter, h]),
                    up: t("mlp.up_proj.weight", &[inter, h]),
                    down: t("mlp.down_proj.weight", &[h, inter]),
                },
            },
            post_ffn_norm: r.post_ffn_norm.map(norm),
        }
    }
}
