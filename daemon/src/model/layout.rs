//! The memory a model instance takes beside its weights, under its limits
//! (`ModelOptions`): the KV cache's layout, the activation workspace, and what the planner
//! reserves for both before any weights.

use super::ArchConfig;
use crate::backend::{Backend, BackendError, KvDtype, LayerCache, ScratchShape};

/// Limits of one model instance; the memory plan derives them from config.
#[derive(Clone, Copy, Debug)]
pub struct ModelOptions {
    /// Positions per sequence in the KV cache.
    pub max_context: usize,
    /// Sequences the KV cache holds (the maximum batch).
    pub kv_slots: usize,
    /// Tokens one step may carry over all sequences (prefill chunk size).
    pub max_batch_tokens: usize,
    /// Element type of the KV cache.
    pub kv_dtype: KvDtype,
    /// The reference path (`--exact`): f32 activations into every matmul. Otherwise decode
    /// rows of quantized weights are quantized to 8 bits per 32-element block and use
    /// integer dot products where the backend has them.
    pub exact: bool,
    /// Drafted tokens one step may verify over all sequences (speculative decoding; 0:
    /// none): each gives a row of logits beside the one each sequence gets.
    pub verify_rows: usize,
}

impl ModelOptions {
    /// Rows of logits one step may give: one a sequence and the verified drafts.
    pub fn logit_rows(&self) -> usize {
        self.kv_slots + self.verify_rows
    }

    /// What a backend needs to size its scratch for this model under these limits.
    pub fn scratch_shape(&self, cfg: &ArchConfig) -> ScratchShape {
        ScratchShape {
            rows: self.max_batch_tokens.max(self.logit_rows()) as u64,
            hidden: cfg.hidden as u64,
            q_dim: cfg.q_dim(),
            heads: cfg.n_heads as u64,
            intermediate: ffn_rows(cfg),
            vocab: cfg.vocab as u64,
            max_context: self.max_context,
            top_k: cfg.moe.as_ref().map_or(0, |m| m.top_k as u64),
        }
    }
}

/// The activations of a step (and their kin), in device memory.
pub(super) struct Workspace<M> {
    pub(super) x: M,
    pub(super) xn: M,
    pub(super) proj: M,
    pub(super) q: M,
    pub(super) k: M,
    pub(super) v: M,
    pub(super) attn: M,
    pub(super) gate: M,
    pub(super) up: M,
    pub(super) last: M,
    pub(super) last_n: M,
    pub(super) logits: M,
    /// Room for q and k after their per-head norm (models with q/k norm).
    pub(super) qk_normed: Option<(M, M)>,
    /// A mixture of experts: the router's logits, one expert's rows gathered, and its
    /// output before it is added into `proj`.
    pub(super) moe: Option<(M, M, M)>,
    /// A mixture: the hidden state normed for the router lookahead (`lookahead_route`),
    /// apart from `xn`, which the running layer's experts still read.
    pub(super) lookahead_xn: Option<M>,
}

impl<M> Workspace<M> {
    /// Allocates the workspace of model `c` under `opts` from `backend`'s budget.
    pub(super) fn new<B: Backend<Mem = M>>(
        backend: &B,
        c: &ArchConfig,
        opts: &ModelOptions,
    ) -> Result<Self, BackendError> {
        let (h, q, kv, vocab) = (c.hidden as u64, c.q_dim(), c.kv_dim(), c.vocab as u64);
        let t = opts.max_batch_tokens;
        let s = opts.logit_rows();
        let a = |n: u64, what: &str| backend.alloc(n as usize * 4, what);
        let ffn = ffn_rows(c);
        Ok(Workspace {
            x: a(t as u64 * h, "activations")?,
            xn: a(t as u64 * h, "activations")?,
            proj: a(t as u64 * h, "activations")?,
            q: a(t as u64 * q, "activations")?,
            k: a(t as u64 * kv, "activations")?,
            v: a(t as u64 * kv, "activations")?,
            attn: a(t as u64 * q, "activations")?,
            gate: a(t as u64 * ffn, "activations")?,
            up: a(t as u64 * ffn, "activations")?,
            last: a(s as u64 * h, "activations")?,
            last_n: a(s as u64 * h, "activations")?,
            logits: a(s as u64 * vocab, "logits")?,
            qk_normed: if c.arch.recipe().qk_norm {
                Some((
                    a(t as u64 * q, "activations")?,
                    a(t as u64 * kv, "activations")?,
                ))
            } else {
                None
            },
            moe: match &c.moe {
                Some(m) => Some((
                    a(t as u64 * m.n_experts as u64, "router logits")?,
                    a(t as u64 * h, "activations")?,
                    a(t as u64 * h, "activations")?,
                )),
                None => None,
            },
            lookahead_xn: match &c.moe {
                Some(_) => Some(a(t as u64 * h, "activations")?),
                None => None,
            },
        })
    }
}

/// Each layer's part of the KV cache under these options, and the f32 elements of the
/// whole K (or V) cache. A sliding-window layer's slot holds the window plus the longest
/// span one step may write (so a prefill chunk does not overwrite what its own first
/// queries see), never more than the context.
pub fn kv_layout(cfg: &ArchConfig, opts: &ModelOptions) -> (Vec<LayerCache>, usize) {
    kv_layout_of(cfg, opts, 0..cfg.n_layers as usize)
}

/// `kv_layout` where only the layers in `held` keep KV (the others run on another
/// backend, which holds theirs): every layer keeps its ring's shape, but only the held
/// ones take room.
pub fn kv_layout_of(
    cfg: &ArchConfig,
    opts: &ModelOptions,
    held: std::ops::Range<usize>,
) -> (Vec<LayerCache>, usize) {
    let width = cfg.kv_dim() as usize;
    let mut base = 0;
    let layers = (0..cfg.n_layers)
        .map(|i| {
            let window = cfg.window(i).map(|w| w as usize);
            let cap = window.map_or(opts.max_context, |w| {
                (w + opts.max_batch_tokens.saturating_sub(1)).min(opts.max_context)
            });
            let c = LayerCache { base, cap, window };
            if held.contains(&(i as usize)) {
                base += opts.kv_slots * cap * width;
            }
            c
        })
        .collect();
    (layers, base)
}

/// Bytes of KV cache of the layers in `held` (K and V).
pub fn kv_cache_bytes_of(
    cfg: &ArchConfig,
    opts: &ModelOptions,
    held: std::ops::Range<usize>,
) -> u64 {
    2 * kv_layout_of(cfg, opts, held).1 as u64 * opts.kv_dtype.bytes() as u64
}

/// Bytes of KV cache for these options (K and V, every layer, f32).
pub fn kv_cache_bytes(cfg: &ArchConfig, opts: &ModelOptions) -> u64 {
    2 * kv_layout(cfg, opts).1 as u64 * opts.kv_dtype.bytes() as u64
}

/// The widest feed-forward activation: the dense MLP's rows, or an expert's.
fn ffn_rows(cfg: &ArchConfig) -> u64 {
    let dense = if cfg.moe.is_none() || (0..cfg.n_layers).any(|i| !cfg.is_sparse(i)) {
        cfg.intermediate
    } else {
        0
    };
    dense.max(cfg.moe.as_ref().map_or(0, |m| m.intermediate)) as u64
}

/// Bytes of activation workspace (and rotary tables) for these options.
pub fn workspace_bytes(cfg: &ArchConfig, opts: &ModelOptions) -> u64 {
    let t = opts.max_batch_tokens as u64;
    let (h, q, kv, i, v) = (
        cfg.hidden as u64,
        cfg.q_dim(),
        cfg.kv_dim(),
        ffn_rows(cfg),
        cfg.vocab as u64,
    );
    // A mixture: router logits, an expert's gathered rows and its output.
    let moe = cfg
        .moe
        .as_ref()
        .map_or(0, |m| t * (m.n_experts as u64 + 3 * h));
    let s = opts.logit_rows() as u64;
    let qk = if cfg.arch.recipe().qk_norm {
        t * (q + kv)
    } else {
        0
    };
    let f32s = t * (3 * h + 2 * q + 2 * kv + 2 * i) + s * (2 * h + v) + qk + moe;
    let tables = if cfg.ext.rope_local_theta.is_some() {
        2
    } else {
        1
    };
    let rope = tables * opts.max_context as u64 * cfg.head_dim as u64;
    // Each allocation rounds up to 4096 bytes: the workspace's 12 buffers, q/k norm's 2, a
    // mixture's 3, the rotary tables, and a few to spare.
    let allocs = 12 + if qk > 0 { 2 } else { 0 } + if moe > 0 { 4 } else { 0 } + tables + 4;
    4 * (f32s + rope) + allocs * 4096
}
