//! The decoder every architecture runs: pre-norm transformer layers of grouped-query
//! attention and a gated MLP, with the blocks an architecture switches on (q/k norm, norms
//! after attention and MLP, GeGLU, scaled embeddings, sliding-window layers with their own
//! RoPE base). Which blocks a layer has and what its tensors are called is the
//! architecture's `Recipe` (store/arch.rs); the numbers come from the `ArchConfig` the
//! importers fill.
//!
//! Written against the `Backend` trait so every backend runs the same code. A step runs a
//! batch of sequences, each with its new tokens (a prefill chunk, one decode token, or a
//! decode token and the drafts after it to verify), through one layer unit at a time: `forward_unit` is the loop body the streaming
//! pipeline drives, so one pass over the weights serves the whole batch.

mod head;
mod slots;
mod step;

use step::{check_steps, TreeRows};
pub use step::{SeqStep, TREE_ROOT};

use super::layout::Workspace;
pub use super::layout::{
    kv_cache_bytes, kv_cache_bytes_of, kv_layout, kv_layout_of, workspace_bytes, ModelOptions,
};
use super::moe::{route_rows, Mixture, PredictionStats};
use super::rope::rope_table;
use super::{Activation, ArchConfig, RopeScaling};
use crate::backend::experts::gated_mlp;
use crate::backend::{
    AttnShape, AttnStep, Backend, BackendError, ExpertCall, ExpertScratch, ExpertShape, GatedAct,
    LayerCache, MatmulOut, SeqSpan, WeightRef,
};
use crate::dtype::DType;
use crate::store::format::{LayerUnit, Manifest, UnitKind};
use crate::store::spec::{ExpertSpec, FfnSpec, LayerSpec, TensorSpec};
use std::ops::Range;

/// The phases of a dense decoder layer, in the order they run (`Decoder::layer_phases`):
/// attention (with every norm and bias of the layer: they lie first in its unit), then the
/// gate, up and down projections. A layer that streams in pieces (`plan::layer_pieces`)
/// runs each piece's phases as it lands.
pub const LAYER_PHASES: usize = 4;

/// Where a tensor is inside its unit's blob.
#[derive(Clone, Copy, Debug)]
pub struct TensorLoc {
    pub offset: usize,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
}

impl TensorLoc {
    fn at<'a, M>(&self, mem: &'a M) -> WeightRef<'a, M> {
        WeightRef {
            mem,
            offset: self.offset,
            dtype: self.dtype,
            rows: self.rows,
            cols: self.cols,
        }
    }
}

/// A decoder layer's tensors where they lie in its unit (`ArchConfig::layer_spec` bound),
/// its part of the KV cache (a ring for sliding-window layers), and whether it rotates
/// with the local (sliding-window) RoPE base.
#[derive(Clone, Debug)]
struct LayerTensors {
    w: LayerSpec<TensorLoc>,
    cache: LayerCache,
    local_rope: bool,
}

type Ffn = FfnSpec<TensorLoc>;
type ExpertLocs = ExpertSpec<TensorLoc>;

impl ExpertSpec<TensorLoc> {
    /// The same tensors in bytes that start at the unit's raw offset `raw_base`.
    fn rebased(&self, raw_base: usize) -> ExpertLocs {
        let r = |t: TensorLoc| TensorLoc {
            offset: t.offset - raw_base,
            ..t
        };
        ExpertLocs {
            w: self.w.map(r),
            b: self.b.map(|b| b.map(r)),
        }
    }
}

/// The activation of the model's gated MLPs.
fn gated_act(c: &ArchConfig) -> GatedAct {
    match (c.arch.recipe().activation, c.swiglu) {
        (Activation::Silu, _) => GatedAct::Silu,
        (Activation::GeluTanh, _) => GatedAct::GeluTanh,
        (Activation::SwigluClamp, Some(k)) => GatedAct::SwigluClamp {
            alpha: k.alpha,
            limit: k.limit,
        },
        (Activation::SwigluClamp, None) => {
            unreachable!("validated: a clamped SwiGLU has its constants")
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("model layout: {0}")]
    Layout(String),
    #[error("invalid step: {0}")]
    Step(String),
}

pub struct Decoder<B: Backend> {
    cfg: ArchConfig,
    opts: ModelOptions,
    shape: AttnShape,
    embed: TensorLoc,
    norm: TensorLoc,
    /// The output projection; in the embedding unit when tied.
    lm_head: TensorLoc,
    layers: Vec<LayerTensors>,
    unit_kinds: Vec<UnitKind>,
    rope: B::Mem,
    /// The sliding-window layers' RoPE table, when their base differs.
    rope_local: Option<B::Mem>,
    cache_k: B::Mem,
    cache_v: B::Mem,
    ws: Workspace<B::Mem>,
    // The step in progress. Single-token and verified spans come first (their rows take
    // the decode kernels).
    spans: Vec<SeqSpan>,
    /// The step's token trees and KV moves.
    tree: TreeRows,
    /// The batch rows whose logits the step gives, in the caller's step order (each span's
    /// last row, or every row of a verified span).
    logit_rows: Vec<usize>,
    gemv_rows: usize,
    positions: Vec<u32>,
    ids: Vec<u32>,
    rows: usize,
    /// The step's logits when the head ran in row parts (`head_norm`, `head_part`), and
    /// one part's rows on their way there.
    host_logits: Vec<f32>,
    part_logits: Vec<f32>,
    logits_on_host: bool,
    /// A mixture's routing state across steps (empty for a dense model).
    moe: Mixture,
    /// The decoder layers whose KV this decoder holds (all, unless another backend runs
    /// some: `new_part`).
    kv_held: std::ops::Range<usize>,
}

/// An empty Vec of `U` in the allocation of `v`: the standard library collects a Vec's
/// iterator into a Vec of a type of the same size and alignment in place (the alloc
/// tests check that no step allocates), so a layer's list of calls that borrow its weights
/// reuses the last layer's room.
fn recycle<T, U>(mut v: Vec<T>) -> Vec<U> {
    debug_assert!(
        std::mem::size_of::<T>() == std::mem::size_of::<U>()
            && std::mem::align_of::<T>() == std::mem::align_of::<U>()
    );
    v.clear();
    v.into_iter()
        .map(|_| unreachable!("the Vec is empty"))
        .collect()
}

/// The kinds of `m`'s units, checked to be the embedding, each decoder layer, the head.
fn unit_kinds(m: &Manifest) -> Result<Vec<UnitKind>, ModelError> {
    let n = m.arch.n_layers;
    let kinds: Vec<UnitKind> = m.units.iter().map(|u| u.kind).collect();
    let expected: Vec<UnitKind> = std::iter::once(UnitKind::Embedding)
        .chain((0..n).map(UnitKind::Decoder))
        .chain(std::iter::once(UnitKind::Head))
        .collect();
    if kinds != expected {
        return Err(ModelError::Layout(format!(
            "units {kinds:?} are not embedding, {n} decoder layers, head"
        )));
    }
    Ok(kinds)
}

/// Where tensor `spec` lies in `unit`, checked against the shape the spec gives it.
fn bind(unit: &LayerUnit, spec: &TensorSpec) -> Result<TensorLoc, ModelError> {
    let name = &spec.name;
    let t = unit
        .tensor(name)
        .ok_or_else(|| ModelError::Layout(format!("{} lacks tensor {name}", unit.kind)))?;
    let (rows, cols) = match spec.shape[..] {
        [cols] => (1, cols),
        [rows, cols] => (rows, cols),
        _ => unreachable!("layer specs are vectors and matrices"),
    };
    if t.shape != spec.shape {
        return Err(ModelError::Layout(format!(
            "{name} has shape {:?}, expected {:?}",
            t.shape, spec.shape
        )));
    }
    Ok(TensorLoc {
        offset: t.offset as usize,
        dtype: t.dtype,
        rows: rows as usize,
        cols: cols as usize,
    })
}

impl<B: Backend> Decoder<B> {
    /// Lays out the model from the manifest and allocates its KV cache, rotary table and
    /// workspace from the backend's budget (reserved before any weights).
    pub fn new(backend: &B, m: &Manifest, opts: ModelOptions) -> Result<Self, ModelError> {
        Decoder::new_part(backend, m, opts, 0..m.arch.n_layers as usize)
    }

    /// A decoder whose KV cache holds only the decoder layers in `kv_held`: the others run
    /// on another backend (a placement that computes some layers on the host), which
    /// holds theirs. Only layers in `kv_held` may run here.
    pub fn new_part(
        backend: &B,
        m: &Manifest,
        opts: ModelOptions,
        kv_held: std::ops::Range<usize>,
    ) -> Result<Self, ModelError> {
        let c = m.arch.clone();
        if opts.max_context == 0 || opts.kv_slots == 0 || opts.max_batch_tokens == 0 {
            return Err(ModelError::Layout(
                "max context, KV slots and batch tokens must be at least 1".into(),
            ));
        }
        let kinds = unit_kinds(m)?;
        let embed = bind(&m.units[0], &c.embedding_spec())?;
        let head = m.units.last().expect("checked");
        let head_spec = c.head_spec();
        let norm = bind(head, &head_spec.norm)?;
        let lm_head = match &head_spec.lm_head {
            Some(t) => bind(head, t)?,
            None => embed,
        };
        let (caches, cache_elems) = kv_layout_of(&c, &opts, kv_held.clone());
        let mut layers = Vec::with_capacity(c.n_layers as usize);
        for (i, u) in m.units[1..=c.n_layers as usize].iter().enumerate() {
            let w = c.layer_spec(i as u32).try_map(|t| bind(u, t))?;
            if let Some(t) = w.sinks.filter(|t| t.dtype != DType::F32) {
                return Err(ModelError::Layout(format!(
                    "model.layers.{i}.self_attn.sinks is {}, expected f32 (repack the model)",
                    t.dtype
                )));
            }
            let cache = caches[i];
            layers.push(LayerTensors {
                w,
                cache,
                local_rope: cache.window.is_some() && c.ext.rope_local_theta.is_some(),
            });
        }
        if let Some(RopeScaling::FreqFactors(f)) = &c.rope_scaling {
            if f.len() != c.head_dim as usize / 2 {
                return Err(ModelError::Layout(
                    "rope frequency factors do not match the head dim".into(),
                ));
            }
        }
        let shape = AttnShape {
            kv: opts.kv_dtype,
            heads: c.n_heads as usize,
            kv_heads: c.n_kv_heads as usize,
            head_dim: c.head_dim as usize,
            max_context: opts.max_context,
            slots: opts.kv_slots,
            scale: c.ext.attn_scale.unwrap_or(1.0 / (c.head_dim as f32).sqrt()),
        };
        // KV cache first, then workspace: the plan reserves them before any weights.
        let kvb = opts.kv_dtype.bytes();
        let cache_k = backend.alloc(cache_elems * kvb, "KV cache (keys)")?;
        let cache_v = backend.alloc(cache_elems * kvb, "KV cache (values)")?;
        let upload_table = |cfg: &ArchConfig| -> Result<B::Mem, ModelError> {
            let table = rope_table(cfg, opts.max_context);
            let mut mem = backend.alloc(table.len() * 4, "rotary table")?;
            let bytes: Vec<u8> = table.iter().flat_map(|f| f.to_le_bytes()).collect();
            backend.upload(&mut mem, &bytes)?;
            Ok(mem)
        };
        let rope = upload_table(&c)?;
        // The sliding-window layers' own base, unscaled (Gemma 3).
        let rope_local = match c.ext.rope_local_theta {
            Some(theta) => Some(upload_table(&ArchConfig {
                rope_theta: theta,
                rope_scaling: None,
                ..c.clone()
            })?),
            None => None,
        };
        let ws = Workspace::new(backend, &c, &opts)?;
        let moe = Mixture::new(&c, opts.max_batch_tokens);
        Ok(Decoder {
            cfg: c,
            opts,
            shape,
            embed,
            norm,
            lm_head,
            layers,
            unit_kinds: kinds,
            rope,
            rope_local,
            cache_k,
            cache_v,
            ws,
            spans: Vec::new(),
            tree: TreeRows::default(),
            logit_rows: Vec::with_capacity(opts.logit_rows()),
            gemv_rows: 0,
            positions: Vec::new(),
            ids: Vec::new(),
            rows: 0,
            host_logits: Vec::new(),
            part_logits: Vec::new(),
            logits_on_host: false,
            moe,
            kv_held,
        })
    }

    /// The hidden state of the step's rows (f32, `rows x hidden`): what one placement
    /// hands the next.
    pub fn hidden(&self) -> (&B::Mem, usize) {
        (&self.ws.x, self.rows * self.cfg.hidden as usize)
    }

    pub fn hidden_mut(&mut self) -> &mut B::Mem {
        &mut self.ws.x
    }

    /// Per decoder layer, the tokens each expert has served (empty for a dense layer).
    pub fn expert_tokens(&self) -> &[Vec<u64>] {
        &self.moe.expert_tokens
    }

    pub fn config(&self) -> &ArchConfig {
        &self.cfg
    }

    pub fn options(&self) -> &ModelOptions {
        &self.opts
    }

    pub fn units(&self) -> usize {
        self.unit_kinds.len()
    }

    /// Index of the unit whose blob the output projection reads (embedding when tied).
    pub fn lm_head_unit(&self) -> usize {
        if self.cfg.tied_embeddings {
            0
        } else {
            self.unit_kinds.len() - 1
        }
    }

    /// Starts a step: checks it against the limits and lays out the batch rows.
    pub fn begin(&mut self, steps: &[SeqStep]) -> Result<(), ModelError> {
        check_steps(steps, &self.opts, self.cfg.vocab)?;
        self.spans.clear();
        self.positions.clear();
        self.ids.clear();
        self.tree.clear();
        let trees = steps.iter().any(|s| !s.parents.is_empty());
        // Decode rows first (single tokens and verified spans), then prefill chunks, each
        // group in step order.
        let decodes = |s: &SeqStep| (s.tokens.len() == 1 && !s.prompt) || s.verify;
        let order = (0..steps.len())
            .filter(|&i| decodes(&steps[i]))
            .chain((0..steps.len()).filter(|&i| !decodes(&steps[i])));
        let mut row = 0;
        for i in order {
            let s = &steps[i];
            self.spans.push(SeqSpan {
                row,
                n: s.tokens.len(),
                pos: s.pos,
                slot: s.slot,
            });
            self.tree.push(s, trees, &mut self.positions);
            self.ids.extend_from_slice(&s.tokens);
            row += s.tokens.len();
        }
        self.gemv_rows = steps
            .iter()
            .filter(|s| decodes(s))
            .map(|s| s.tokens.len())
            .sum();
        self.rows = row;
        // Logit rows in the caller's step order: each group's rows were laid out in it.
        self.logit_rows.clear();
        let (mut decode_row, mut prefill_row) = (0, self.gemv_rows);
        for s in steps {
            let at = if decodes(s) {
                &mut decode_row
            } else {
                &mut prefill_row
            };
            let end = *at + s.tokens.len();
            self.logit_rows.extend(end - s.logit_rows()..end);
            *at = end;
        }
        self.logits_on_host = false;
        Ok(())
    }

    /// Runs unit `unit` of the step begun with `begin`, its weights in `mem`. The head needs
    /// the output projection's unit too when embeddings are tied: `lm_head` (else `None`).
    pub fn forward_unit(&mut self, b: &B, unit: usize, mem: &B::Mem, lm_head: Option<&B::Mem>) {
        let _span = tracing::trace_span!("unit", unit).entered();
        match self.unit_kinds[unit] {
            UnitKind::Embedding => {
                b.embedding(self.embed.at(mem), &self.ids, &mut self.ws.x);
                if let Some(s) = self.cfg.ext.embed_scale {
                    b.scale(&mut self.ws.x, s, self.rows * self.cfg.hidden as usize);
                }
            }
            UnitKind::Decoder(i) => self.decoder(b, i as usize, mem),
            UnitKind::Head => {
                let lm = if self.cfg.tied_embeddings {
                    lm_head.expect("tied head needs the embedding unit")
                } else {
                    mem
                };
                self.head(b, mem, lm);
            }
        }
    }

    fn decoder(&mut self, b: &B, i: usize, mem: &B::Mem) {
        assert!(
            self.kv_held.contains(&i),
            "decoder layer {i} runs where its KV cache is not held ({:?})",
            self.kv_held
        );
        self.attention(b, i, mem);
        let n_experts = self.routed_count(i);
        if n_experts > 0 {
            self.route(b, i, mem);
            self.experts(b, i, 0..n_experts, mem, 0);
        } else if let Ffn::Dense { gate, up, down } = &self.layers[i].w.ffn {
            let ws = &mut self.ws;
            gated_mlp(
                b,
                gated_act(&self.cfg),
                (&ws.xn, self.rows, self.gemv_rows),
                [gate, up, down].map(|t| t.at(mem)),
                None,
                (&mut ws.gate, &mut ws.up),
                &mut ws.proj,
            );
        }
        self.ffn_end(b, i, mem);
    }

    /// A layer's attention block and the norm before its feed-forward block (into `xn`).
    fn attention(&mut self, b: &B, i: usize, mem: &B::Mem) {
        let l = &self.layers[i];
        let (rows, c) = (self.rows, &self.cfg);
        let h = c.hidden as usize;
        let ws = &mut self.ws;
        b.rms_norm(&ws.x, l.w.attn_norm.at(mem), c.rms_eps, rows, &mut ws.xn);
        let bias = |k: usize| l.w.qkv_bias.map(|bs| bs[k].at(mem));
        b.matmuls(
            &ws.xn,
            rows,
            self.gemv_rows,
            &mut [
                MatmulOut {
                    w: l.w.q.at(mem),
                    bias: bias(0),
                    out: &mut ws.q,
                },
                MatmulOut {
                    w: l.w.k.at(mem),
                    bias: bias(1),
                    out: &mut ws.k,
                },
                MatmulOut {
                    w: l.w.v.at(mem),
                    bias: bias(2),
                    out: &mut ws.v,
                },
            ],
        );
        let (heads, kv_heads, hd) = (
            c.n_heads as usize,
            c.n_kv_heads as usize,
            c.head_dim as usize,
        );
        // Per-head RMSNorm of q and k (each head a row of head_dim), before RoPE.
        if let (Some([qn, kn]), Some((qo, ko))) = (l.w.qk_norm, ws.qk_normed.as_mut()) {
            b.rms_norm(&ws.q, qn.at(mem), c.rms_eps, rows * heads, qo);
            b.rms_norm(&ws.k, kn.at(mem), c.rms_eps, rows * kv_heads, ko);
            std::mem::swap(&mut ws.q, qo);
            std::mem::swap(&mut ws.k, ko);
        }
        let table = match (&self.rope_local, l.local_rope) {
            (Some(t), true) => t,
            _ => &self.rope,
        };
        b.rope(&mut ws.q, rows, heads, hd, &self.positions, table);
        b.rope(&mut ws.k, rows, kv_heads, hd, &self.positions, table);
        let step = AttnStep {
            layer: i,
            spans: &self.spans,
            shape: self.shape,
            cache: l.cache,
            ancestors: &self.tree.ancestors,
        };
        let caches = (&mut self.cache_k, &mut self.cache_v);
        self.tree.move_kv(b, caches, &step);
        b.kv_store(&ws.k, &ws.v, &mut self.cache_k, &mut self.cache_v, &step);
        b.attention(
            &ws.q,
            &self.cache_k,
            &self.cache_v,
            &step,
            l.w.sinks.map(|t| t.at(mem)),
            &mut ws.attn,
        );
        b.matmul(
            &ws.attn,
            rows,
            self.gemv_rows,
            l.w.o.at(mem),
            l.w.o_bias.map(|t| t.at(mem)),
            &mut ws.proj,
        );
        residual(
            b,
            &mut ws.x,
            &mut ws.proj,
            &mut ws.xn,
            l.w.post_attn_norm.map(|n| n.at(mem)),
            c.rms_eps,
            rows,
            h,
        );
        b.rms_norm(&ws.x, l.w.ffn_norm.at(mem), c.rms_eps, rows, &mut ws.xn);
    }

    /// The feed-forward block's output into the residual stream.
    fn ffn_end(&mut self, b: &B, i: usize, mem: &B::Mem) {
        let l = &self.layers[i];
        let (rows, c, ws) = (self.rows, &self.cfg, &mut self.ws);
        residual(
            b,
            &mut ws.x,
            &mut ws.proj,
            &mut ws.xn,
            l.w.post_ffn_norm.map(|n| n.at(mem)),
            c.rms_eps,
            rows,
            c.hidden as usize,
        );
    }

    /// A mixture's layer: the router on the normed rows, the step's routing (grouped by
    /// expert) and its statistics, and the block's output zeroed for the experts to add to.
    fn route(&mut self, b: &B, i: usize, mem: &B::Mem) {
        let Ffn::Moe {
            router,
            router_bias,
            ..
        } = &self.layers[i].w.ffn
        else {
            unreachable!("routed a dense layer")
        };
        let (rows, c, ws) = (self.rows, &self.cfg, &mut self.ws);
        let moe = c.moe.as_ref().expect("a mixture's layer has its config");
        let routes = self.moe.routes.as_mut().expect("a mixture has its routes");
        let (logits, _, _) = ws.moe.as_mut().expect("a mixture has its workspace");
        let n = moe.n_experts as usize;
        let bias = router_bias.map(|t| t.at(mem));
        b.matmul(&ws.xn, rows, self.gemv_rows, router.at(mem), bias, logits);
        route_rows(b, c, logits, rows, &mut self.moe.router_logits, routes);
        for (e, n) in self.moe.expert_tokens[i].iter_mut().enumerate() {
            *n += (routes.starts[e + 1] - routes.starts[e]) as u64;
        }
        // How the predictions made before this routing fare, then this step's choices.
        let chosen = |e: &u32| routes.starts[*e as usize + 1] > routes.starts[*e as usize];
        let (p, last) = (&mut self.moe.prediction, &mut self.moe.last_routed[i]);
        let routed = (0..n as u32).filter(chosen).count() as u64;
        p.previous.add(last, chosen, routed);
        let ahead = &mut self.moe.lookahead[i];
        if !ahead.is_empty() {
            p.lookahead.add(ahead, chosen, routed);
        }
        ahead.clear();
        last.clear();
        last.extend((0..n as u32).filter(chosen));
        b.zero(&mut ws.proj, rows * c.hidden as usize);
    }

    /// Experts of layer `i`'s mixture (0 for a dense layer).
    fn routed_count(&self, i: usize) -> usize {
        match &self.layers[i].w.ffn {
            Ffn::Moe { experts, .. } => experts.len(),
            Ffn::Dense { .. } => 0,
        }
    }

    /// Experts `es` of layer `i` on the rows routed to them, added into the block's output
    /// with their weights. `mem` holds the layer unit's raw bytes from offset `raw_base` on
    /// (the whole unit: 0; one expert alone: its range's start). Experts run in ascending
    /// order, so each row's sum goes in the order transformers adds them; the decode rows
    /// of all of them go as one call (a device runs them together), then the prefill rows.
    fn experts(&mut self, b: &B, i: usize, es: Range<usize>, mem: &B::Mem, raw_base: usize) {
        let Ffn::Moe { experts, .. } = &self.layers[i].w.ffn else {
            unreachable!("experts of a dense layer")
        };
        let (c, ws, g) = (&self.cfg, &mut self.ws, self.gemv_rows);
        let routes = self.moe.routes.as_ref().expect("a mixture has its routes");
        let (_, xe, ye) = ws.moe.as_mut().expect("a mixture has its workspace");
        let mut decode: Vec<ExpertCall<'_, B::Mem>> =
            recycle(std::mem::take(&mut self.moe.expert_calls.0));
        let mut prefill: Vec<ExpertCall<'_, B::Mem>> =
            recycle(std::mem::take(&mut self.moe.expert_calls.1));
        for e in es {
            let (er, ew) = routes.of(e);
            if er.is_empty() {
                continue;
            }
            let x = experts[e].rebased(raw_base);
            let (w, bias) = (x.w.map(|t| t.at(mem)), x.b.map(|b| b.map(|t| t.at(mem))));
            // An expert's rows keep their order, decode rows first.
            let split = er.partition_point(|&r| (r as usize) < g);
            let (rows, weights) = (&er[..split], &ew[..split]);
            if !rows.is_empty() {
                decode.push(ExpertCall {
                    w,
                    bias,
                    rows,
                    weights,
                });
            }
            let (rows, weights) = (&er[split..], &ew[split..]);
            if !rows.is_empty() {
                prefill.push(ExpertCall {
                    w,
                    bias,
                    rows,
                    weights,
                });
            }
        }
        for (calls, decode) in [(&decode, true), (&prefill, false)] {
            if calls.is_empty() {
                continue;
            }
            let shape = ExpertShape {
                hidden: c.hidden as usize,
                act: gated_act(c),
                decode,
            };
            let scratch = ExpertScratch {
                x: &mut *xe,
                gate: &mut ws.gate,
                up: &mut ws.up,
                y: &mut *ye,
            };
            b.experts(&ws.xn, shape, calls, scratch, &mut ws.proj);
        }
        self.moe.expert_calls = (recycle(decode), recycle(prefill));
    }

    /// The decoder layer of unit `unit` (a mixture's layer, else None).
    fn sparse_layer(&self, unit: usize) -> Option<usize> {
        match self.unit_kinds.get(unit) {
            Some(&UnitKind::Decoder(i)) if self.routed_count(i as usize) > 0 => Some(i as usize),
            _ => None,
        }
    }

    /// A mixture's layer run in parts, its experts loaded on their own: first its dense
    /// part (`mem` holds the unit's raw bytes from offset 0 up to its first expert at
    /// least: norms, attention, router), which runs the attention block and routes the
    /// step; then each routed expert (`routed_experts`, `forward_expert`) in ascending
    /// order; then `sparse_end`. The same ops in the same order as `forward_unit`, so the
    /// results are the same bits.
    pub fn sparse_begin(&mut self, b: &B, unit: usize, mem: &B::Mem) {
        let _span = tracing::trace_span!("unit", unit).entered();
        let i = self
            .sparse_layer(unit)
            .expect("sparse_begin on a mixture's layer");
        self.attention(b, i, mem);
        self.route(b, i, mem);
    }

    /// The experts the step routed to at unit `unit`'s layer, ascending (after
    /// `sparse_begin`; before it, those of the step before: a prediction).
    pub fn routed_experts(&self, unit: usize) -> &[u32] {
        match self.unit_kinds.get(unit) {
            Some(&UnitKind::Decoder(i)) => &self.moe.last_routed[i as usize],
            _ => &[],
        }
    }

    /// The router lookahead for the mixture's layer of unit `unit` (the next layer to run;
    /// `mem` holds its bytes from offset 0 through its router): its ffn norm and router
    /// applied to the hidden state as it is now (entering the layer before, or halfway
    /// through it, after its attention); the experts so chosen are that layer's
    /// prediction, which its routing then scores (`prediction_stats`). Changes nothing the
    /// step's outputs depend on.
    pub fn lookahead_route(&mut self, b: &B, unit: usize, mem: &B::Mem) {
        let Some(i) = self.sparse_layer(unit) else {
            return;
        };
        let l = &self.layers[i];
        let Ffn::Moe {
            router,
            router_bias,
            ..
        } = &l.w.ffn
        else {
            return;
        };
        let (rows, c, ws) = (self.rows, &self.cfg, &mut self.ws);
        let (Some(moe), Some(routes), Some((logits, _, _)), Some(xl)) = (
            c.moe.as_ref(),
            self.moe.lookahead_routes.as_mut(),
            ws.moe.as_mut(),
            ws.lookahead_xn.as_mut(),
        ) else {
            return;
        };
        let n = moe.n_experts as usize;
        b.rms_norm(&ws.x, l.w.ffn_norm.at(mem), c.rms_eps, rows, xl);
        let bias = router_bias.map(|t| t.at(mem));
        b.matmul(xl, rows, self.gemv_rows, router.at(mem), bias, logits);
        route_rows(b, c, logits, rows, &mut self.moe.router_logits, routes);
        let ahead = &mut self.moe.lookahead[i];
        ahead.clear();
        ahead.extend(
            (0..n as u32).filter(|&e| routes.starts[e as usize + 1] > routes.starts[e as usize]),
        );
    }

    /// The experts `lookahead_route` predicted for unit `unit`'s layer this step (empty
    /// once the layer has routed).
    pub fn lookahead_experts(&self, unit: usize) -> &[u32] {
        match self.unit_kinds.get(unit) {
            Some(&UnitKind::Decoder(i)) => &self.moe.lookahead[i as usize],
            _ => &[],
        }
    }

    /// How well each predictor foresaw the routing so far (`PredictionStats`).
    pub fn prediction_stats(&self) -> PredictionStats {
        self.moe.prediction
    }

    /// Expert `e` of the layer begun with `sparse_begin`: `mem` holds the unit's raw bytes
    /// from `raw_base` on (the expert's range at least).
    pub fn forward_expert(&mut self, b: &B, unit: usize, e: usize, mem: &B::Mem, raw_base: u64) {
        let i = self
            .sparse_layer(unit)
            .expect("an expert of a mixture's layer");
        self.experts(b, i, e..e + 1, mem, raw_base as usize);
    }

    /// The end of a mixture's layer run in parts (`mem` as for `sparse_begin`).
    pub fn sparse_end(&mut self, b: &B, unit: usize, mem: &B::Mem) {
        let i = self
            .sparse_layer(unit)
            .expect("sparse_end on a mixture's layer");
        self.ffn_end(b, i, mem);
    }

    /// Whether dense layer unit `unit` run in pieces needs its first piece (its vectors)
    /// again at the end: a norm after its feed-forward block (Gemma 2 and 3).
    pub fn first_piece_to_end(&self, unit: usize) -> bool {
        match self.unit_kinds[unit] {
            UnitKind::Decoder(i) => self.layers[i as usize].w.post_ffn_norm.is_some(),
            _ => false,
        }
    }

    /// Phases `phases` of dense decoder layer unit `unit` (`LAYER_PHASES`: 0
    /// attention with the norm before the feed-forward block, 1 gate, 2 up and the gated
    /// activation, 3 down and the residual): `mem` holds the unit's raw bytes from
    /// `raw_base` on (the phases' tensors at least), and `first` (where `mem` does not
    /// start at the unit) its first piece, whose vectors the residual may need
    /// (`first_piece_to_end`). Run over all four phases in order, in one call or several,
    /// a layer computes exactly what `forward_unit` does: the gate and up projections are
    /// the same rows' dot products whether made in one call or two.
    pub fn layer_phases(
        &mut self,
        b: &B,
        unit: usize,
        phases: Range<usize>,
        mem: &B::Mem,
        raw_base: u64,
        first: Option<&B::Mem>,
    ) {
        let UnitKind::Decoder(i) = self.unit_kinds[unit] else {
            panic!(
                "layer phases of {}, not a decoder layer",
                self.unit_kinds[unit]
            );
        };
        let i = i as usize;
        let _span = tracing::trace_span!("phases", unit, start = phases.start).entered();
        let base = raw_base as usize;
        let at = |t: &TensorLoc| TensorLoc {
            offset: t.offset - base,
            ..*t
        };
        for phase in phases {
            if phase == 0 {
                assert_eq!(base, 0, "attention runs from the unit's first piece");
                self.attention(b, i, mem);
                continue;
            }
            let Ffn::Dense { gate, up, down } = &self.layers[i].w.ffn else {
                panic!("feed-forward phases of layer {i}, which has no dense MLP");
            };
            let (rows, gemv_rows, ws) = (self.rows, self.gemv_rows, &mut self.ws);
            match phase {
                1 => b.matmul(
                    &ws.xn,
                    rows,
                    gemv_rows,
                    at(gate).at(mem),
                    None,
                    &mut ws.gate,
                ),
                2 => {
                    b.matmul(&ws.xn, rows, gemv_rows, at(up).at(mem), None, &mut ws.up);
                    gated_act(&self.cfg).apply(b, &mut ws.gate, &ws.up, rows * gate.rows);
                }
                3 => {
                    b.matmul(
                        &ws.gate,
                        rows,
                        gemv_rows,
                        at(down).at(mem),
                        None,
                        &mut ws.proj,
                    );
                    // The vectors lie in the first piece.
                    let vectors = match (base, first) {
                        (0, _) => mem,
                        (_, Some(f)) => f,
                        (_, None) => {
                            assert!(
                                self.layers[i].w.post_ffn_norm.is_none(),
                                "layer {i}'s norm after its feed-forward block is in its first piece"
                            );
                            mem
                        }
                    };
                    self.ffn_end(b, i, vectors);
                }
                _ => panic!("layer phase {phase} of {LAYER_PHASES}"),
            }
        }
    }

    /// The embedding table: its place in unit 0.
    pub fn embedding_loc(&self) -> TensorLoc {
        self.embed
    }

    /// The token ids of the step begun with `begin`, in batch-row order.
    pub fn step_ids(&self) -> &[u32] {
        &self.ids
    }

    /// The embedding unit's work from gathered rows instead of the whole table: `table`
    /// holds rows of the embedding (dtype and width as the table's), and row i of the
    /// step takes row `rows[i]` of it.
    pub fn embed_gathered(&mut self, b: &B, table: &B::Mem, rows: &[u32]) {
        let _span = tracing::trace_span!("unit", unit = 0).entered();
        debug_assert_eq!(rows.len(), self.rows);
        let loc = TensorLoc {
            offset: 0,
            rows: rows.iter().max().map_or(0, |&r| r as usize + 1),
            ..self.embed
        };
        b.embedding(loc.at(table), rows, &mut self.ws.x);
        if let Some(s) = self.cfg.ext.embed_scale {
            b.scale(&mut self.ws.x, s, self.rows * self.cfg.hidden as usize);
        }
    }
}

/// x += y, or x += norm(y) when the architecture norms a block's output first (`tmp` is
/// free room of the same size).
#[allow(clippy::too_many_arguments)] // the residual's buffers and the norm's parameters
fn residual<B: Backend>(
    b: &B,
    x: &mut B::Mem,
    y: &mut B::Mem,
    tmp: &mut B::Mem,
    norm: Option<WeightRef<'_, B::Mem>>,
    eps: f32,
    rows: usize,
    h: usize,
) {
    match norm {
        Some(w) => {
            b.rms_norm(y, w, eps, rows, tmp);
            b.add(x, tmp, rows * h);
        }
        None => b.add(x, y, rows * h),
    }
}
