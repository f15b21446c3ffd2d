//! The narrow interface the model needs from a device: allocate
//! within a budget, upload a staging slot into a device allocation, and the ops of a
//! Llama-family forward pass. Activations are f32 everywhere; weights stay in their stored
//! dtype and quantized weights are dequantized inside the kernels.
//!
//! `cpu` is always built and is what CI and the tests run; `cuda` implements the same trait
//! on an NVIDIA GPU (loaded at run time: the binary starts without CUDA installed).
//!
//! Ops may run asynchronously (CUDA enqueues them on a compute stream): their errors surface
//! through `check`, and only `download_f32` returns data to the host.

pub mod cpu;
pub mod cuda;
pub mod experts;

use crate::dtype::DType;
use crate::hostbuf::Pinner;
pub use experts::{ExpertCall, ExpertScratch, ExpertShape, GatedAct, RouteGating};
use serde::Serialize;
use std::ops::Range;
use std::sync::atomic::{AtomicU64, Ordering};

/// Element type of the KV cache: f16 (half the memory and the traffic per decode token;
/// the default) or f32 (the reference path, `--exact`). K and V rows are rounded to f16
/// (nearest even) when stored; scores and sums stay f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum KvDtype {
    F16,
    F32,
}

impl KvDtype {
    pub fn bytes(self) -> usize {
        match self {
            KvDtype::F16 => 2,
            KvDtype::F32 => 4,
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            KvDtype::F16 => "f16",
            KvDtype::F32 => "f32",
        })
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f16" => Ok(KvDtype::F16),
            "f32" => Ok(KvDtype::F32),
            _ => Err(format!("KV cache type {s:?}: expected f16 or f32")),
        }
    }
}

/// What the copy engine did for the asynchronous uploads so far (device-timed).
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct CopyStats {
    pub uploads: u64,
    pub bytes: u64,
    /// Seconds the copies took on the device, from each copy's start to its end.
    pub seconds: f64,
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("device memory budget exceeded: {what} needs {bytes} bytes, {used} of {limit} are in use ({free} free); raise --device-memory or lower --max-batch / --max-context")]
    OutOfBudget {
        what: String,
        bytes: u64,
        used: u64,
        limit: u64,
        free: u64,
    },
    #[error("allocation of {bytes} bytes for {what} failed")]
    Alloc { what: String, bytes: u64 },
    #[error("{0}")]
    Invalid(String),
    /// A device-side failure (driver, launch, copy): what was being done, on which device,
    /// and what the driver or library said.
    #[error("{op} on {device}: {cause}")]
    Device {
        op: String,
        device: String,
        cause: String,
    },
}

impl BackendError {
    pub fn device(
        op: impl Into<String>,
        device: impl Into<String>,
        cause: impl std::fmt::Display,
    ) -> Self {
        BackendError::Device {
            op: op.into(),
            device: device.into(),
            cause: cause.to_string(),
        }
    }
}

/// Device memory accounting: a hard limit, the bytes in use and the peak. Every device
/// allocation reserves here first, so a budget is enforced, not advised.
#[derive(Debug)]
pub struct MemBudget {
    limit: u64,
    used: AtomicU64,
    peak: AtomicU64,
}

impl MemBudget {
    pub fn new(limit: u64) -> MemBudget {
        MemBudget {
            limit,
            used: AtomicU64::new(0),
            peak: AtomicU64::new(0),
        }
    }

    pub fn limit(&self) -> u64 {
        self.limit
    }

    pub fn used(&self) -> u64 {
        self.used.load(Ordering::Acquire)
    }

    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Acquire)
    }

    pub fn reserve(&self, bytes: u64, what: &str) -> Result<(), BackendError> {
        let mut used = self.used.load(Ordering::Acquire);
        loop {
            let new = used
                .checked_add(bytes)
                .filter(|&n| n <= self.limit)
                .ok_or_else(|| BackendError::OutOfBudget {
                    what: what.to_string(),
                    bytes,
                    used,
                    limit: self.limit,
                    free: self.limit.saturating_sub(used),
                })?;
            match self
                .used
                .compare_exchange(used, new, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    self.peak.fetch_max(new, Ordering::AcqRel);
                    return Ok(());
                }
                Err(u) => used = u,
            }
        }
    }

    pub fn release(&self, bytes: u64) {
        let prev = self.used.fetch_sub(bytes, Ordering::AcqRel);
        debug_assert!(prev >= bytes, "released more than reserved");
    }
}

/// A weight tensor inside a device allocation: `rows` x `cols` of `dtype`, row-major,
/// starting `offset` bytes in.
pub struct WeightRef<'a, M> {
    pub mem: &'a M,
    pub offset: usize,
    pub dtype: DType,
    pub rows: usize,
    pub cols: usize,
}

/// One product of `Backend::matmuls`: out = x . w^T (+ bias).
pub struct MatmulOut<'a, M> {
    pub w: WeightRef<'a, M>,
    pub bias: Option<WeightRef<'a, M>>,
    pub out: &'a mut M,
}

// Manual impls: a derive would require `M: Copy`, but only the reference is copied.
impl<M> Clone for WeightRef<'_, M> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<M> Copy for WeightRef<'_, M> {}

/// One sequence's part of a batch step: `n` new tokens at batch rows `row..row + n`, at
/// positions `pos..pos + n` of KV-cache slot `slot`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqSpan {
    pub row: usize,
    pub n: usize,
    pub pos: usize,
    pub slot: usize,
}

/// Shapes of the attention step.
#[derive(Clone, Copy, Debug)]
pub struct AttnShape {
    /// Element type of the KV cache.
    pub kv: KvDtype,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    /// Positions per sequence (the longest a full-attention layer's slot holds).
    pub max_context: usize,
    /// KV-cache slots per layer.
    pub slots: usize,
    /// What scores are multiplied by (1 / sqrt(head dim) unless the model says otherwise).
    pub scale: f32,
}

/// One layer's part of the KV cache: where it starts, how many positions each slot holds,
/// and which positions a query sees.
///
/// A full-attention layer holds every position (`cap` = max context). A sliding-window
/// layer keeps a ring per slot: position p lives at p % `cap`, and `cap` is the window
/// plus the most tokens one step writes, so a step's new rows never overwrite positions
/// its own earlier queries still need.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayerCache {
    /// f32 elements before this layer's part of the K (and of the V) allocation.
    pub base: usize,
    /// Positions each slot holds.
    pub cap: usize,
    /// A query at p sees positions p - window < j <= p; None: all of 0..=p.
    pub window: Option<usize>,
}

impl LayerCache {
    /// f32 elements of this layer's K (or V) cache.
    pub fn elems(&self, shape: &AttnShape) -> usize {
        shape.slots * self.cap * shape.kv_heads * shape.head_dim
    }

    /// Element offset of position `pos` of `slot`.
    pub fn at(&self, shape: &AttnShape, slot: usize, pos: usize) -> usize {
        let width = shape.kv_heads * shape.head_dim;
        self.base + (slot * self.cap + pos % self.cap) * width
    }

    /// The positions of `positions` this layer still holds once its slot has written up to
    /// (not including) `written` (all of them in a full-attention layer; in a ring, those
    /// the last `cap` writes left), as runs that are contiguous in the slot: `(first
    /// position, count)`, at most two.
    pub fn held_runs(&self, positions: Range<usize>, written: usize) -> [(usize, usize); 2] {
        let start = positions.start.max(written.saturating_sub(self.cap));
        let end = positions.end.max(start);
        // Where the ring wraps inside [start, end), if it does.
        let wrap = (start / self.cap + 1) * self.cap;
        if end <= wrap {
            [(start, end - start), (end, 0)]
        } else {
            [(start, wrap - start), (wrap, end - wrap)]
        }
    }

    /// Whether a query at `pos` finds every position it attends to among those this layer
    /// holds once its slot has written up to `written` (`pos <= written`).
    pub fn sees_all(&self, pos: usize, written: usize) -> bool {
        self.first_visible(pos) >= written.saturating_sub(self.cap)
    }

    /// The first position a query at `pos` attends to.
    pub fn first_visible(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }

    /// Whether a span of `n` new tokens at `pos` fits: inside the context, and (in a ring)
    /// not so long that its last rows overwrite what its first query sees.
    pub fn fits(&self, shape: &AttnShape, pos: usize, n: usize) -> bool {
        let live = pos + n - self.first_visible(pos);
        pos + n <= shape.max_context && live <= self.cap
    }
}

/// Where an attention step reads and writes: one layer, the batch's spans.
#[derive(Clone, Copy, Debug)]
pub struct AttnStep<'a> {
    pub layer: usize,
    pub spans: &'a [SeqSpan],
    pub shape: AttnShape,
    pub cache: LayerCache,
    /// Token trees (speculative decoding): per batch row, the rows of its span it attends
    /// to, itself included (bit i: the span's row i), or 0 for a causal row; empty when no
    /// span of the step is a tree. See `RowKeys`.
    pub ancestors: &'a [u64],
}

/// The rows of a token tree a span holds at most (one bit each in `AttnStep::ancestors`).
pub const TREE_ROWS_MAX: usize = 64;

/// The keys one query row attends to. A causal row at position p sees positions
/// `first_visible(p)..=p` of its slot. A token tree's row (a drafted node, verified in the
/// same pass as its siblings) is at position `root + depth`, its rope and window position;
/// it sees the committed positions before the tree's root and, past them, its ancestors and
/// itself: key j (a position, root <= j <= p) is the ancestor at depth j - root, whose K
/// and V its own row of the span wrote at `root + row`. So a node's keys are, in order, the
/// keys the same text gives a lone decode row, and every sum over them runs as that row's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowKeys {
    /// The row's position (rope, window).
    pub pos: usize,
    /// The span's first position (the tree's root).
    root: usize,
    /// Its ancestors in the span, itself included; 0: a causal row.
    ancestors: u64,
}

impl RowKeys {
    /// Where key `j` (a position the row sees, `j <= pos`) is in the slot.
    #[inline]
    pub fn key(&self, j: usize) -> usize {
        if self.ancestors == 0 || j < self.root {
            return j;
        }
        // The (j - root)-th ancestor row, counting from the root: its set bit.
        let mut m = self.ancestors;
        for _ in 0..j - self.root {
            m &= m - 1;
        }
        self.root + m.trailing_zeros() as usize
    }
}

impl AttnStep<'_> {
    /// Row `t` of span `sp`: its position and the keys it attends to.
    pub fn row_keys(&self, sp: &SeqSpan, t: usize) -> RowKeys {
        match self.ancestors.get(sp.row + t) {
            Some(&a) if a != 0 => RowKeys {
                pos: sp.pos + a.count_ones() as usize - 1,
                root: sp.pos,
                ancestors: a,
            },
            _ => RowKeys {
                pos: sp.pos + t,
                root: sp.pos,
                ancestors: 0,
            },
        }
    }
}

/// Ops take device allocations (`Mem`) holding f32 activations unless a `WeightRef` says
/// otherwise; sizes are in elements. Each op checks its shapes against the allocations.
pub trait Backend: Send + Sync {
    type Mem: Send;

    fn name(&self) -> &'static str;
    fn budget(&self) -> &MemBudget;
    /// Allocates `bytes` of device memory within the budget.
    fn alloc(&self, bytes: usize, what: &str) -> Result<Self::Mem, BackendError>;
    fn mem_len(&self, mem: &Self::Mem) -> usize;
    /// Copies host bytes (a staging slot) into a device allocation.
    fn upload(&self, dst: &mut Self::Mem, src: &[u8]) -> Result<(), BackendError>;
    /// Copies f32 values out of a device allocation (waiting for the ops before it).
    fn download_f32(&self, src: &Self::Mem, offset: usize, out: &mut [f32]);

    /// Errors of work the device ran asynchronously since the last call (a failed launch
    /// or copy), which the ops cannot return themselves. Synchronous backends: always Ok.
    fn check(&self) -> Result<(), BackendError> {
        Ok(())
    }
    /// Starts an upload into `dst` (a streaming slot) made of parts: the copies start after
    /// the ops that last read `dst` (see `release_after`).
    fn upload_begin(&self, _dst: &mut Self::Mem) -> Result<(), BackendError> {
        Ok(())
    }
    /// Copies `src` to `offset` in `dst`, possibly returning before the copy is done. `src`
    /// must stay valid and unchanged until `upload_wait(dst)` returns.
    fn upload_part(
        &self,
        dst: &mut Self::Mem,
        offset: usize,
        src: &[u8],
    ) -> Result<(), BackendError>;
    /// Ends the upload begun with `upload_begin`: ops enqueued from now on that read `dst`
    /// see every part.
    fn upload_end(&self, _dst: &mut Self::Mem) -> Result<(), BackendError> {
        Ok(())
    }
    /// An upload of one part at offset 0.
    fn upload_async(&self, dst: &mut Self::Mem, src: &[u8]) -> Result<(), BackendError> {
        self.upload_begin(dst)?;
        self.upload_part(dst, 0, src)?;
        self.upload_end(dst)
    }
    /// Blocks until the last upload into `dst` has read all of its sources.
    fn upload_wait(&self, _dst: &Self::Mem) -> Result<(), BackendError> {
        Ok(())
    }
    /// Marks the ops enqueued so far as the last readers of `mem`: the next upload into it
    /// (`upload_begin`) waits for them, not for everything.
    fn release_after(&self, _mem: &Self::Mem) {}
    /// The bytes in `range` of `mem` hold nothing anyone reads before writing them again
    /// (a finished sequence's KV): a backend whose memory is the process's may give their
    /// pages back to the system (the CPU does; they read as zero after). Returns the bytes
    /// given back. Default: none.
    fn discard(&self, _mem: &mut Self::Mem, _range: std::ops::Range<usize>) -> usize {
        0
    }
    /// Page-locks host buffers that uploads read from, when the device gains from it.
    /// Device memory is host memory (the CPU backend): streamed units run straight from
    /// the I/O engine's staging slots (`borrow_host`) and resident units are decoded
    /// straight into their allocation (`host_bytes_mut`), so nothing is copied twice.
    fn unified(&self) -> bool {
        false
    }

    /// A unified backend's view of host bytes as device memory, for weights only (no op
    /// writes through it). None on other backends.
    ///
    /// # Safety
    /// `data` must stay alive and unchanged while the returned memory is in use.
    unsafe fn borrow_host(&self, _data: &[u8]) -> Option<Self::Mem> {
        None
    }

    /// A unified backend's allocation as host bytes to fill (None on other backends).
    fn host_bytes_mut<'m>(&self, _mem: &'m mut Self::Mem) -> Option<&'m mut [u8]> {
        None
    }

    fn pinner(&self) -> Option<Pinner> {
        None
    }
    /// Device-timed figures of the asynchronous uploads so far.
    fn copy_stats(&self) -> CopyStats {
        CopyStats::default()
    }
    /// Host threads the ops run on (the CPU backend's team; 0 where a device computes).
    fn host_threads(&self) -> usize {
        0
    }
    /// GB/s of a plain host-to-device copy of `bytes` from page-locked memory, the
    /// reference the streamed uploads are compared with; None where there is no such copy.
    fn reference_copy_gbps(&self, _bytes: usize) -> Option<f64> {
        None
    }

    /// out[i] = table[ids[i]] (rows dequantized to f32).
    fn embedding(&self, table: WeightRef<'_, Self::Mem>, ids: &[u32], out: &mut Self::Mem);
    /// out = x * rsqrt(mean(x^2) + eps) * w, for `rows` rows of w.cols.
    fn rms_norm(
        &self,
        x: &Self::Mem,
        w: WeightRef<'_, Self::Mem>,
        eps: f32,
        rows: usize,
        out: &mut Self::Mem,
    );
    /// out[rows, w.rows] = x[rows, w.cols] @ w^T (+ bias). The first `gemv_rows` rows are
    /// single-token (decode) rows; a backend must give every row the same result whatever
    /// the other rows are, so that batching never changes a sequence's output.
    fn matmul(
        &self,
        x: &Self::Mem,
        rows: usize,
        gemv_rows: usize,
        w: WeightRef<'_, Self::Mem>,
        bias: Option<WeightRef<'_, Self::Mem>>,
        out: &mut Self::Mem,
    );
    /// Products of the same activations with several weights (q, k and v; gate and up),
    /// each exactly as `matmul` computes it. A backend may convert the activations once
    /// and run the products as one op. Default: `matmul` for each.
    fn matmuls(
        &self,
        x: &Self::Mem,
        rows: usize,
        gemv_rows: usize,
        outs: &mut [MatmulOut<'_, Self::Mem>],
    ) {
        for o in outs {
            self.matmul(x, rows, gemv_rows, o.w, o.bias, o.out);
        }
    }
    /// `matmul` for the output head, whose logits decide the token: activations keep at
    /// least 16 bits on every path (8-bit activations there flip near-ties: SmolLM2's chat
    /// answer to "What is the capital of France?" has a 0.08 top-2 margin). The CPU's fast
    /// path quantizes them to 16 bits (a step of max|x| / 32767 per 32), `--exact` keeps
    /// f32. Default: `matmul`.
    fn matmul_head(
        &self,
        x: &Self::Mem,
        rows: usize,
        w: WeightRef<'_, Self::Mem>,
        out: &mut Self::Mem,
    ) {
        self.matmul(x, rows, rows, w, None, out);
    }
    /// Rotates `heads` heads of each row in place (rotate-half pairs (i, i + d/2)), row r at
    /// position `positions[r]`, with the cos/sin table made by `rope_table`.
    fn rope(
        &self,
        x: &mut Self::Mem,
        rows: usize,
        heads: usize,
        head_dim: usize,
        positions: &[u32],
        table: &Self::Mem,
    );
    /// Copies the K and V at position `from` of `slot` to position `to`, for each pair of
    /// `moves` in order, in this layer's cache (`step.cache`): an accepted path of a token
    /// tree, from the rows its nodes ran at to the positions of their depths.
    fn kv_move(
        &self,
        cache_k: &mut Self::Mem,
        cache_v: &mut Self::Mem,
        step: &AttnStep<'_>,
        slot: usize,
        moves: &[(u32, u32)],
    );
    /// Copies the K and V of `positions` of slot `slots.0` to the same positions of slot
    /// `slots.1` in one layer's cache (`place`; a ring's positions where `LayerCache::at`
    /// puts them, the last `cap` of them where there are more): a
    /// prompt's prefix that another sequence computed (the prefix cache). Ordered with the
    /// ops before and after it, like `kv_move`; `from != to`.
    fn kv_copy(
        &self,
        cache_k: &mut Self::Mem,
        cache_v: &mut Self::Mem,
        place: (&AttnShape, &LayerCache),
        slots: (usize, usize),
        positions: Range<usize>,
    );
    /// Copies `out.len()` bytes at byte `offset` of a KV cache allocation to the host,
    /// after the ops before it: a prefix-cache block leaving for the host tier.
    fn kv_read(&self, cache: &Self::Mem, offset: usize, out: &mut [u8]);
    /// Copies `src` to byte `offset` of a KV cache allocation, ordered with the ops before
    /// and after it (`src` may be reused once this returns): a prefix-cache block coming
    /// back from the host or disk tier.
    fn kv_write(&self, cache: &mut Self::Mem, offset: usize, src: &[u8]);
    /// Writes the new K and V rows of each span into the layer's cache.
    fn kv_store(
        &self,
        k: &Self::Mem,
        v: &Self::Mem,
        cache_k: &mut Self::Mem,
        cache_v: &mut Self::Mem,
        step: &AttnStep<'_>,
    );
    /// Causal grouped-query attention of each span's new queries over its cached keys (a
    /// token tree's rows over their ancestors: `AttnStep::row_keys`).
    /// `sinks` (f32, one per query head; gpt-oss) joins each softmax as a logit of its own
    /// whose weight is then dropped: out = sum_j e^(s_j - m) v_j / (sum_j e^(s_j - m) +
    /// e^(sink - m)), m the largest of the scores and the sink.
    fn attention(
        &self,
        q: &Self::Mem,
        cache_k: &Self::Mem,
        cache_v: &Self::Mem,
        step: &AttnStep<'_>,
        sinks: Option<WeightRef<'_, Self::Mem>>,
        out: &mut Self::Mem,
    );
    /// gate = silu(gate) * up, n elements.
    fn silu_mul(&self, gate: &mut Self::Mem, up: &Self::Mem, n: usize);
    /// gate = gelu_tanh(gate) * up, n elements (GeGLU, GELU's tanh approximation).
    fn gelu_mul(&self, gate: &mut Self::Mem, up: &Self::Mem, n: usize);
    /// gpt-oss's clamped SwiGLU, n elements: g = min(gate, limit), u = clamp(up, -limit,
    /// limit), gate = (u + 1) * g * sigmoid(alpha * g).
    fn swiglu_clamp_mul(
        &self,
        gate: &mut Self::Mem,
        up: &Self::Mem,
        n: usize,
        alpha: f32,
        limit: f32,
    );
    /// x *= s, n elements.
    fn scale(&self, x: &mut Self::Mem, s: f32, n: usize);
    /// x += y, n elements.
    fn add(&self, x: &mut Self::Mem, y: &Self::Mem, n: usize);
    /// dst row i = src row `rows[i]`, `cols` f32 each (a mixture of experts gathers the
    /// rows routed to one expert). Default: through the host, a row at a time (correct on
    /// any backend; a device implements it with a kernel where it pays).
    fn gather_rows(&self, src: &Self::Mem, rows: &[u32], cols: usize, dst: &mut Self::Mem) {
        let mut row = vec![0f32; cols];
        for (i, &r) in rows.iter().enumerate() {
            self.download_f32(src, r as usize * cols, &mut row);
            let bytes: Vec<u8> = row.iter().flat_map(|v| v.to_le_bytes()).collect();
            // A workspace buffer sized for the step: an upload inside it cannot fail.
            let _ = self.upload_part(dst, i * cols * 4, &bytes);
        }
    }
    /// dst row `rows[i]` += weights[i] * src row i (a product, then a sum: no fused
    /// multiply-add, so every backend gives the same bits), `cols` f32 each; the rows are
    /// distinct. Default: through the host.
    fn scatter_add_rows(
        &self,
        src: &Self::Mem,
        rows: &[u32],
        weights: &[f32],
        cols: usize,
        dst: &mut Self::Mem,
    ) {
        let (mut s, mut d) = (vec![0f32; cols], vec![0f32; cols]);
        for (i, (&r, &w)) in rows.iter().zip(weights).enumerate() {
            self.download_f32(src, i * cols, &mut s);
            self.download_f32(dst, r as usize * cols, &mut d);
            let bytes: Vec<u8> = d
                .iter()
                .zip(&s)
                .flat_map(|(&dv, &sv)| (dv + w * sv).to_le_bytes())
                .collect();
            let _ = self.upload_part(dst, r as usize * cols * 4, &bytes);
        }
    }
    /// A mixture's experts on the rows routed to each (`calls`, in ascending expert
    /// order), each expert's output added into `out` (rows of `shape.hidden`) with the
    /// rows' weights: row r's sum goes over its experts in the order of the calls, from
    /// what `out` holds. Exactly the bits of `experts_each`, which is the default; a
    /// device runs a decode call's experts together where it has grouped kernels.
    fn experts(
        &self,
        x: &Self::Mem,
        shape: ExpertShape,
        calls: &[ExpertCall<'_, Self::Mem>],
        scratch: ExpertScratch<'_, Self::Mem>,
        out: &mut Self::Mem,
    ) {
        experts::experts_each(self, x, shape, calls, scratch, out);
    }
    /// Each of `rows` rows' top-k experts and routing weights from its router logits
    /// (`n_experts` per row), into `chosen` (`k` per row, in descending weight), as
    /// `Routes::route` computes them (the same experts; weights to a few ulp), where the
    /// backend does this itself: a device sends back k pairs a row, not every logit.
    /// Returns false where it does not (the default), and the caller routes on the host.
    fn route_top_k(
        &self,
        logits: &Self::Mem,
        (rows, n_experts, k): (usize, usize, usize),
        gating: RouteGating,
        chosen: &mut Vec<(u32, f32)>,
    ) -> bool {
        let _ = (logits, rows, n_experts, k, gating, chosen);
        false
    }
    /// x = 0, n elements. Default: an upload of zeros.
    fn zero(&self, x: &mut Self::Mem, n: usize) {
        let _ = self.upload_part(x, 0, &vec![0u8; n * 4]);
    }
    /// Copies `cols` f32 of row `src_row` of `src` to row `dst_row` of `dst`.
    fn copy_row(
        &self,
        src: &Self::Mem,
        src_row: usize,
        dst: &mut Self::Mem,
        dst_row: usize,
        cols: usize,
    );
}

/// The sizes a backend's scratch depends on (the model's shape and the step limits), so a
/// backend sizes itself without knowing the model's config.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScratchShape {
    /// Rows one step may carry: the larger of tokens per step and sequences per batch.
    pub rows: u64,
    pub hidden: u64,
    pub q_dim: u64,
    /// Query heads (of q_dim / heads dimensions each).
    pub heads: u64,
    pub intermediate: u64,
    pub vocab: u64,
    /// Positions per sequence in the KV cache.
    pub max_context: usize,
    /// Experts a mixture routes each row to (0 for a dense model).
    pub top_k: u64,
}

/// An upload of `len` bytes at `offset` must fit the allocation of `cap` bytes.
pub fn check_upload(cap: usize, offset: usize, len: usize) -> Result<(), BackendError> {
    if offset.checked_add(len).is_none_or(|end| end > cap) {
        return Err(BackendError::Invalid(format!(
            "upload of {len} bytes at offset {offset} into an allocation of {cap}"
        )));
    }
    Ok(())
}
