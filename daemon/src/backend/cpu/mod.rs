//! The CPU backend: device memory is host memory carved from a budgeted arena (so the
//! streaming path and its budget are real without a GPU), ops are multi-threaded with
//! a team of spinning threads (`team.rs`), dense tiles go through `matrixmultiply`'s sgemm, and quantized weights are
//! dequantized a tile of rows at a time (never a whole matrix).

pub mod kernels;
#[cfg(target_arch = "x86_64")]
mod kquant;
pub mod q8;
#[cfg(target_arch = "x86_64")]
mod simd;
mod team;

use super::{
    check_upload, AttnShape, AttnStep, Backend, BackendError, KvDtype, MatmulOut, MemBudget,
    ScratchShape, SeqSpan, WeightRef,
};
use crate::dtype::DType;
use crate::hostbuf::{AlignedBuf, IO_ALIGN};
use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// u16 cache elements as f16 (same size and alignment, every bit pattern valid).
fn bytemuck_f16(x: &mut [u16]) -> &mut [half::f16] {
    // SAFETY: f16 is a transparent u16.
    unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr() as *mut half::f16, x.len()) }
}

/// The KV cache's rows, whatever its element type: q . k and o += w v.
enum KvRows<'a> {
    F32(&'a [f32], &'a [f32]),
    F16(&'a [u16], &'a [u16]),
}

impl<'a> KvRows<'a> {
    fn of(kv: KvDtype, k: &'a CpuMem, v: &'a CpuMem) -> KvRows<'a> {
        match kv {
            KvDtype::F32 => KvRows::F32(k.f32s(), v.f32s()),
            KvDtype::F16 => KvRows::F16(k.u16s(), v.u16s()),
        }
    }

    /// q . (key row at `at`), in an order that depends only on the head dimension.
    fn dot(&self, at: usize, q: &[f32]) -> f32 {
        let n = q.len();
        match self {
            KvRows::F32(ks, _) => kernels::dot_f32(q, &ks[at..at + n]),
            KvRows::F16(ks, _) => kernels::dot_f16(q, &ks[at..at + n]),
        }
    }

    /// Scores of keys lo..lo + sc.len() against q, `row(j)` the element of key j: four at a
    /// time from lo (the grouping depends only on lo and the count, not on the batch;
    /// each score's bits are `dot`'s).
    fn scores(&self, q: &[f32], lo: usize, row: impl Fn(usize) -> usize, sc: &mut [f32]) {
        let mut j = 0;
        while j + 4 <= sc.len() {
            let at = std::array::from_fn(|r| row(lo + j + r));
            let four = match self {
                KvRows::F32(ks, _) => kernels::dot4_f32(q, ks, at),
                KvRows::F16(ks, _) => kernels::dot4_f16(q, ks, at),
            };
            sc[j..j + 4].copy_from_slice(&four);
            j += 4;
        }
        for (i, s) in sc.iter_mut().enumerate().skip(j) {
            *s = self.dot(row(lo + i), q);
        }
    }

    /// o += w[j] (value row of key lo + j) for every j, in order.
    fn weighted_sum(&self, w: &[f32], lo: usize, row: impl Fn(usize) -> usize, o: &mut [f32]) {
        let mut j = 0;
        while j + 4 <= w.len() {
            let at = std::array::from_fn(|r| row(lo + j + r));
            let four = std::array::from_fn(|r| w[j + r]);
            match self {
                KvRows::F32(_, vs) => kernels::axpy4_f32(four, vs, at, o),
                KvRows::F16(_, vs) => kernels::axpy4_f16(four, vs, at, o),
            }
            j += 4;
        }
        for (i, &wi) in w.iter().enumerate().skip(j) {
            self.axpy(row(lo + i), wi, o);
        }
    }

    /// o += w (value row at `at`).
    fn axpy(&self, at: usize, w: f32, o: &mut [f32]) {
        let n = o.len();
        match self {
            KvRows::F32(_, vs) => kernels::axpy_f32(w, &vs[at..at + n], o),
            KvRows::F16(_, vs) => kernels::axpy_f16(w, &vs[at..at + n], o),
        }
    }
}

/// Dequantized weights a thread's sgemm tile holds at most (512 KiB of f32), unless
/// TILE_ROWS_MIN rows need more.
const TILE_F32S: usize = 128 * 1024;
const TILE_ROWS_MIN: usize = 32;
/// At most 56 rows: matrixmultiply's sgemm allocates a packing buffer of KC x (MC + rows)
/// f32 a call (KC 256, MC 64), and 56 rows keep it under glibc's 128 KiB mmap threshold.
/// A larger one is mmapped, and once freed it raises the threshold, so that every later
/// one stays in the thread's heap: 224-row tiles left SmolLM2's resident set 2.7 MB larger,
/// which under a 96 MiB memory cgroup pushed the executable's pages out (decode 1.5
/// tokens/s instead of 47).
const TILE_ROWS_MAX: usize = 56;
/// sgemm's packing buffer for a tile of TILE_ROWS_MAX rows (see there).
const SGEMM_PACK_BYTES: usize = 256 * (64 + TILE_ROWS_MAX) * std::mem::size_of::<f32>();

/// Weight rows per sgemm tile for rows of `k`: as many as TILE_F32S holds, from
/// TILE_ROWS_MIN to TILE_ROWS_MAX, a multiple of 8. sgemm packs the whole block of
/// activations once a call, so a tile of few rows packs them again and again (32 rows
/// spent a fifth of SmolLM2's prefill packing; 56 rows run it 5-10% faster). Whatever the
/// tile, an output's bits are the same: its dot product over k, in sgemm's order.
fn tile_rows(k: usize) -> usize {
    (TILE_F32S / k.max(1) / 8 * 8).clamp(TILE_ROWS_MIN, TILE_ROWS_MAX)
}

/// The most f32 a tile takes for rows of at most `k_max`.
fn tile_f32s_max(k_max: usize) -> usize {
    (TILE_ROWS_MAX * k_max)
        .min(TILE_F32S)
        .max(TILE_ROWS_MIN * k_max)
}

/// A device allocation of the CPU backend: an arena buffer it owns, or (for a streamed
/// unit) a view of the I/O engine's staging slot that holds it.
pub struct CpuMem {
    ptr: *mut u8,
    len: usize,
    /// The buffer and the budget it was reserved from; None for a borrowed view.
    owned: Option<(AlignedBuf, Arc<MemBudget>)>,
}

// SAFETY: an owned CpuMem is an AlignedBuf (Send); a borrowed one points at a staging slot
// the pipeline keeps alive and unchanged while it is used (`borrow_host`'s contract).
unsafe impl Send for CpuMem {}

impl Drop for CpuMem {
    fn drop(&mut self) {
        if let Some((buf, budget)) = &self.owned {
            budget.release(buf.len() as u64);
        }
    }
}

impl CpuMem {
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: ptr..ptr+len is the owned buffer's start or the borrowed slot's bytes.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        assert!(
            self.owned.is_some(),
            "a borrowed staging slot is never written"
        );
        // SAFETY: an owned buffer of at least len bytes, exclusively borrowed.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    pub fn f32s(&self) -> &[f32] {
        // SAFETY: the buffer is 4096-aligned, every bit pattern is a valid f32, and the
        // length is rounded down to whole elements.
        unsafe { std::slice::from_raw_parts(self.ptr as *const f32, self.len / 4) }
    }

    /// The bytes as 16-bit elements (an f16 KV cache).
    pub fn u16s(&self) -> &[u16] {
        // SAFETY: 4096-aligned, every bit pattern is a valid u16, whole elements only.
        unsafe { std::slice::from_raw_parts(self.ptr as *const u16, self.len / 2) }
    }

    pub fn u16s_mut(&mut self) -> &mut [u16] {
        assert!(
            self.owned.is_some(),
            "a borrowed staging slot is never written"
        );
        // SAFETY: as above, with exclusive access through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut u16, self.len / 2) }
    }

    pub fn f32s_mut(&mut self) -> &mut [f32] {
        assert!(
            self.owned.is_some(),
            "a borrowed staging slot is never written"
        );
        // SAFETY: as above, with exclusive access through &mut self.
        unsafe { std::slice::from_raw_parts_mut(self.ptr as *mut f32, self.len / 4) }
    }
}

pub struct CpuBackend {
    budget: Arc<MemBudget>,
    team: team::Team,
    threads: usize,
    /// Buffers the ops reuse on the calling thread (nothing is allocated per step).
    scratch: Mutex<Scratch>,
    /// Streamed units run from their staging slots (false: copied into arena slots, as a
    /// discrete GPU must, so the CPU tests cover that path too).
    unified: bool,
    /// Decode rows of q4_0/q4_1/q8_0 weights quantized to 8 bits (`q8.rs`); off under
    /// `--exact`.
    int8: std::sync::atomic::AtomicBool,
    /// The last `reserve_scratch`'s per-thread sizes and its number (0: none yet).
    reserved: Mutex<ThreadScratch>,
    reserve_epoch: AtomicU64,
}

#[derive(Default)]
struct Scratch {
    /// Per-block sums of the decode rows (q4 offset terms).
    xsums: Vec<f32>,
    /// (span, head) pairs of an attention op.
    tasks: Vec<(usize, usize)>,
    /// A norm weight or bias converted to f32.
    weights: Vec<f32>,
    /// Decode rows quantized to 8 bits.
    q8: Vec<q8::Q8Block>,
    /// The output head's decode rows quantized to 16 bits.
    q16: Vec<q8::Q16Block>,
    /// Grouped attention's tasks: (span, KV head, chunk or all, partial's offset).
    attn_tasks: Vec<(usize, usize, usize, usize)>,
    /// Softmax partials of the chunks of split decode rows.
    partials: Vec<f32>,
}

/// The activations a decode matmul's integer kernels see: f32 (the reference, `--exact`),
/// 8 bits (every matmul on the fast path) or 16 bits (the output head on the fast path).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Acts {
    F32,
    I8,
    I16,
}

/// How an op's independent tasks run: across the team, or in order on the calling thread
/// when the backend has one thread.
struct Par<'t> {
    team: Option<&'t team::Team>,
}

impl Par<'_> {
    fn for_each(&self, n: usize, f: impl Fn(usize) + Sync + Send) {
        match self.team {
            None => (0..n).for_each(f),
            Some(t) => t.for_each(n, &f),
        }
    }

    fn for_each_in<T: Sync>(&self, items: &[T], f: impl Fn(&T) + Sync + Send) {
        self.for_each(items.len(), |i| f(&items[i]));
    }
}

/// The compute threads `threads` asks for: itself, or with 0 every core.
fn compute_threads(threads: usize) -> usize {
    if threads == 0 {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    } else {
        threads
    }
}

impl CpuBackend {
    /// `threads` compute threads (0: all cores).
    pub fn new(budget_bytes: u64, threads: usize) -> Result<CpuBackend, BackendError> {
        let threads = compute_threads(threads);
        let team = team::Team::new(threads)
            .map_err(|e| BackendError::Invalid(format!("compute threads: {e}")))?;
        Ok(CpuBackend {
            budget: Arc::new(MemBudget::new(budget_bytes)),
            team,
            threads,
            scratch: Mutex::new(Scratch::default()),
            reserved: Mutex::new(ThreadScratch::default()),
            reserve_epoch: AtomicU64::new(0),
            unified: true,
            int8: std::sync::atomic::AtomicBool::new(false),
        })
    }

    /// Decode rows with 8-bit activations (the default path) or f32 (`--exact`, and what
    /// `new` starts with).
    pub fn set_int8_activations(&self, on: bool) {
        self.int8.store(on, Ordering::Relaxed);
    }

    pub fn int8_activations(&self) -> bool {
        self.int8.load(Ordering::Relaxed)
    }

    /// A backend that acts as a discrete device: streamed units are copied into arena
    /// streaming slots (in parts, as they decode) and a host cache is possible, exactly as
    /// on a GPU. Tests of that path run on it; `sluiced` uses `new`.
    pub fn new_discrete(budget_bytes: u64, threads: usize) -> Result<CpuBackend, BackendError> {
        Ok(CpuBackend {
            unified: false,
            ..CpuBackend::new(budget_bytes, threads)?
        })
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Runs an op's body: its tasks across the team (the calling thread among them), or in
    /// order on this thread when there is one compute thread.
    fn run<R>(&self, body: impl FnOnce(&Par) -> R) -> R {
        self.reserve_here();
        let team = (self.threads > 1).then_some(&self.team);
        body(&Par { team })
    }

    /// What `reserve_scratch` reserves for this shape on `threads` compute threads (0:
    /// all cores): every thread's scratch and the shared 8-bit activations (the plan
    /// counts it as the backend's own).
    pub fn scratch_bytes(shape: &ScratchShape, threads: usize) -> u64 {
        let threads = compute_threads(threads);
        let sizes = ThreadScratch::of(shape, threads);
        let q8 =
            shape.rows as usize * sizes.k_max.div_ceil(32) * std::mem::size_of::<q8::Q8Block>();
        (threads * sizes.bytes() + q8) as u64
    }

    /// Gives every compute thread's scratch (GEMV sums, four-row results, attention
    /// scores, dequantized tiles) room for the largest op of this shape at once, so that no
    /// thread grows one mid-run (which thread runs which task is the pool's choice).
    pub fn reserve_scratch(&self, shape: &ScratchShape) {
        let sizes = ThreadScratch::of(shape, self.threads);
        {
            let mut s = self.scratch();
            let want = shape.rows as usize * sizes.k_max.div_ceil(32);
            let len = s.q8.len();
            s.q8.reserve(want.saturating_sub(len));
        }
        // The workers now; a thread that calls ops at its first op after this (`run`).
        *self.reserved.lock().unwrap_or_else(|e| e.into_inner()) = sizes;
        let epoch = RESERVE_EPOCH.fetch_add(1, Ordering::Relaxed) + 1;
        self.reserve_epoch.store(epoch, Ordering::Release);
        if self.threads > 1 {
            self.team.broadcast(&|t| {
                if t > 0 {
                    sizes.reserve();
                }
            });
        }
        self.reserve_here();
    }

    /// Reserves the calling thread's scratch for the last `reserve_scratch` shape, once
    /// per thread and shape.
    fn reserve_here(&self) {
        let epoch = self.reserve_epoch.load(Ordering::Acquire);
        if epoch == 0 || RESERVED.with(Cell::get) == epoch {
            return;
        }
        let sizes = *self.reserved.lock().unwrap_or_else(|e| e.into_inner());
        sizes.reserve();
        RESERVED.with(|r| r.set(epoch));
    }

    /// `Backend::matmuls` with the activations of decode rows 8-bit, 16-bit or f32: the
    /// decode rows are converted once for every product, and the products' tasks run as
    /// one op (a weight's output columns in chunks, every weight's chunks together).
    fn matmul_as(
        &self,
        x: &CpuMem,
        rows: usize,
        gemv_rows: usize,
        outs: &mut [MatmulOut<'_, CpuMem>],
        acts: Acts,
    ) {
        let n = outs.len();
        assert!(
            (1..=MAX_SHARED).contains(&n),
            "{n} products of one activation (1 to {MAX_SHARED})"
        );
        let k = outs[0].w.cols;
        for o in outs.iter_mut() {
            let m = o.w.rows;
            assert!(
                o.w.cols == k && x.len / 4 >= rows * k && o.out.len / 4 >= rows * m,
                "matmul shapes: x {} f32, out {} f32 for [{rows}, {k}] x [{m}, {}]^T",
                x.len / 4,
                o.out.len / 4,
                o.w.cols
            );
        }
        assert!(gemv_rows <= rows);
        let xs = &x.f32s()[..rows * k];
        let g = gemv_rows;
        let mm: [Matmul; MAX_SHARED] = std::array::from_fn(|i| {
            let o = &mut outs[i.min(n - 1)];
            let w = o.w;
            Matmul {
                dtype: w.dtype,
                wb: weight_bytes(&w),
                rb: w.dtype.row_bytes(k as u64).expect("validated") as usize,
                xs,
                k,
                m: w.rows,
                out: SharedPtr(o.out.f32s_mut().as_mut_ptr()),
                threads: self.threads,
                path: DecodePath::of(w.dtype, acts),
            }
        });
        let mm = &mm[..n];
        let mut scratch = self.scratch();
        let Scratch { xsums, q8, q16, .. } = &mut *scratch;
        // Each conversion of the decode rows once, for every product that takes it.
        let needs = |p: DecodePath| g > 0 && mm.iter().any(|m| m.path == p);
        if needs(DecodePath::Int8) {
            q8::quantize_rows(&xs[..g * k], k, q8);
        }
        if needs(DecodePath::Int16) {
            q8::quantize_rows(&xs[..g * k], k, q16);
        }
        if needs(DecodePath::Rows4) {
            kernels::block_sums_into(&xs[..g * k], xsums);
        }
        let acts = DecodeActs { q8, q16, xsums };
        self.run(|par| {
            // Single-token rows (decode) run through the dot-product kernels, whose result for
            // a row does not depend on the other rows; the rest (prefill chunks) through
            // dequantized tiles and sgemm, also row by row independent. So a sequence's
            // numbers are the same alone or in any batch.
            if g > 0 {
                decode_rows(par, mm, g, &acts);
            }
            if rows > g {
                prefill_rows(par, mm, g, rows - g);
            }
        });
        for o in outs.iter_mut() {
            if let Some(b) = o.bias {
                let m = o.w.rows;
                let bv = f32_vector(&b, &mut scratch.weights);
                for orow in o.out.f32s_mut()[..rows * m].chunks_exact_mut(m) {
                    for (v, bb) in orow.iter_mut().zip(bv) {
                        *v += bb;
                    }
                }
            }
        }
    }

    /// Attention over an f32 cache (`--exact`), a KV head at a time: each key and value is
    /// read once for the query heads that share it (up to GROUP_MAX at once), a row's
    /// scores over its whole visible context, then its softmax, then the weighted values,
    /// in chunks of ATTN_CHUNK keys. A task is a (span, KV head); when those are fewer
    /// than two a thread, a decode row's scores are computed a chunk of keys a task, then
    /// its weighted values a block of columns a task (each softmaxing the row again), so a
    /// long context keeps every thread busy. Every number has the bits of the
    /// head-at-a-time path (`KvRows::scores`, `softmax_scaled`, `KvRows::weighted_sum`):
    /// the same products and sums in the same order, however the work is cut.
    fn attention_grouped_f32(
        &self,
        qs: &[f32],
        (ks, vs): (&[f32], &[f32]),
        step: &AttnStep<'_>,
        sinks: Option<&[f32]>,
        optr: SharedPtr,
    ) {
        let (spans, shape, cache) = (step.spans, step.shape, step.cache);
        let (heads, kv_heads, hd) = (shape.heads, shape.kv_heads, shape.head_dim);
        let (group, width_q, scale) = (heads / kv_heads, heads * hd, shape.scale);
        let split = self.threads > 1 && spans.len() * kv_heads < 2 * self.threads;
        // A split row's columns in blocks of `width` (a multiple of 8), enough blocks for
        // two tasks a thread.
        let blocks = (2 * self.threads).div_ceil((spans.len() * kv_heads).max(1));
        let width = hd.div_ceil(blocks).next_multiple_of(8).min(hd);
        // A chunk's scores for the group's heads, rows ATTN_CHUNK apart.
        let block = group * ATTN_CHUNK;
        // Positions a query at p sees.
        let visible = |p: usize| p + 1 - cache.first_visible(p);
        let chunk_keys = |keys: &mut Vec<usize>, sp: &SeqSpan, p: usize, g: usize, c: usize| {
            let lo = cache.first_visible(p) + c * ATTN_CHUNK;
            keys.clear();
            keys.extend(
                (lo..(lo + ATTN_CHUNK).min(p + 1)).map(|j| cache.at(&shape, sp.slot, j) + g * hd),
            );
        };
        let mut scratch = self.scratch();
        let Scratch {
            attn_tasks,
            partials,
            ..
        } = &mut *scratch;
        // (span, KV head, chunk or ALL of them, where a chunk's scores go).
        let chunks_of = |sp: &SeqSpan| visible(sp.pos).div_ceil(ATTN_CHUNK);
        let at = attention_tasks(attn_tasks, (spans, kv_heads), split, chunks_of, block);
        partials.clear();
        partials.resize(at, 0.0);
        let pptr = SharedPtr(partials.as_mut_ptr());
        let tasks = &*attn_tasks;
        self.run(|par| {
            par.for_each_in(tasks, |&(si, g, c, at)| {
                let sp = spans[si];
                KEYS.with(|keys| {
                    let mut keys = keys.borrow_mut();
                    if c != ALL {
                        // SAFETY: this task's own block of the partials.
                        let out = unsafe { pptr.slice(at, block) };
                        chunk_keys(&mut keys, &sp, sp.pos, g, c);
                        let qg = &qs[sp.row * width_q + g * group * hd..][..group * hd];
                        kernels::group_scores_f32(qg, hd, ks, &keys, out, ATTN_CHUNK);
                        return;
                    }
                    SCORES.with(|sc| {
                        let mut sc = sc.borrow_mut();
                        for t in 0..sp.n {
                            let p = sp.pos + t;
                            let len = visible(p);
                            let row = (sp.row + t) * width_q;
                            let n_chunks = len.div_ceil(ATTN_CHUNK);
                            for (h0, gh) in head_subgroups(g, group) {
                                let qg = &qs[row + h0 * hd..][..gh * hd];
                                sc.resize(gh * len, 0.0);
                                for c in 0..n_chunks {
                                    chunk_keys(&mut keys, &sp, p, g, c);
                                    let out = &mut sc[c * ATTN_CHUNK..];
                                    kernels::group_scores_f32(qg, hd, ks, &keys, out, len);
                                }
                                for (i, row_sc) in sc.chunks_exact_mut(len).enumerate() {
                                    softmax_scaled(row_sc, scale, sinks.map(|s| s[h0 + i]));
                                }
                                // SAFETY: task (span, KV head) writes the columns of its own
                                // query heads in its own rows; no two tasks share one.
                                let o = unsafe { optr.slice(row + h0 * hd, gh * hd) };
                                o.fill(0.0);
                                for c in 0..n_chunks {
                                    chunk_keys(&mut keys, &sp, p, g, c);
                                    let w = &sc[c * ATTN_CHUNK..];
                                    kernels::group_pv_f32(w, len, hd, vs, &keys, o);
                                }
                            }
                        }
                    })
                });
            });
        });
        if at == 0 {
            return;
        }
        // The split rows' weighted values: (span, KV head, column block, its scores).
        let n = attn_tasks.len();
        for i in 0..n {
            let (si, g, c, at) = attn_tasks[i];
            if c == 0 {
                attn_tasks.extend((0..hd.div_ceil(width)).map(|b| (si, g, b, at)));
            }
        }
        attn_tasks.drain(..n);
        let (tasks, partials) = (&*attn_tasks, &*partials);
        self.run(|par| {
            par.for_each_in(tasks, |&(si, g, b, at)| {
                let sp = spans[si];
                let len = visible(sp.pos);
                let (row, c0) = (sp.row * width_q, b * width);
                let w = width.min(hd - c0);
                SCORES.with(|sc| {
                    KEYS.with(|keys| {
                        PARTIAL.with(|part| {
                            let (mut sc, mut keys) = (sc.borrow_mut(), keys.borrow_mut());
                            let mut part = part.borrow_mut();
                            for (h0, gh) in head_subgroups(g, group) {
                                sc.resize(gh * len, 0.0);
                                for (i, row_sc) in sc.chunks_exact_mut(len).enumerate() {
                                    let hr = h0 - g * group + i;
                                    for (c, piece) in row_sc.chunks_mut(ATTN_CHUNK).enumerate() {
                                        let from = at + c * block + hr * ATTN_CHUNK;
                                        piece.copy_from_slice(&partials[from..from + piece.len()]);
                                    }
                                    softmax_scaled(row_sc, scale, sinks.map(|s| s[h0 + i]));
                                }
                                part.clear();
                                part.resize(gh * w, 0.0);
                                for c in 0..len.div_ceil(ATTN_CHUNK) {
                                    chunk_keys(&mut keys, &sp, sp.pos, g, c);
                                    let p = &sc[c * ATTN_CHUNK..];
                                    kernels::group_pv_f32(p, len, w, &vs[c0..], &keys, &mut part);
                                }
                                for (i, o) in part.chunks_exact(w).enumerate() {
                                    // SAFETY: task (span, KV head, block) writes its own
                                    // columns of its own query heads in its own row.
                                    let dst = unsafe { optr.slice(row + (h0 + i) * hd + c0, w) };
                                    dst.copy_from_slice(o);
                                }
                            }
                        })
                    })
                });
            });
        });
    }

    /// Attention over an f16 cache, a KV head at a time: each key and value is converted
    /// once for the query heads that share it (up to GROUP_MAX at once), and a row's keys
    /// go in chunks of ATTN_CHUNK from its first visible position, each chunk's softmax
    /// partial merged into the row's in chunk order (`chunk_partial`, `merge_partial`).
    /// A task is a (span, KV head); when those are fewer than two a thread, the chunks of
    /// single-token spans (decode rows) become tasks of their own and merge after, so one
    /// sequence's long context keeps every thread busy. Either way a row's numbers are the
    /// same: the same partials merged in the same order.
    fn attention_grouped(
        &self,
        qs: &[f32],
        (ks, vs): (&[u16], &[u16]),
        step: &AttnStep<'_>,
        sinks: Option<&[f32]>,
        optr: SharedPtr,
    ) {
        let (spans, shape, cache) = (step.spans, step.shape, step.cache);
        let (heads, kv_heads, hd) = (shape.heads, shape.kv_heads, shape.head_dim);
        let (group, width_q, scale) = (heads / kv_heads, heads * hd, shape.scale);
        let rec = group * (2 + hd);
        let chunks_of = |sp: &SeqSpan| {
            let p = sp.pos + sp.n - 1;
            (p + 1 - cache.first_visible(p)).div_ceil(ATTN_CHUNK)
        };
        let split = self.threads > 1 && spans.len() * kv_heads < 2 * self.threads;
        let mut scratch = self.scratch();
        let Scratch {
            attn_tasks,
            partials,
            ..
        } = &mut *scratch;
        // (span, KV head, chunk or ALL of them in order, where its partial goes).
        let at = attention_tasks(attn_tasks, (spans, kv_heads), split, chunks_of, rec);
        partials.clear();
        partials.resize(at, 0.0);
        let pptr = SharedPtr(partials.as_mut_ptr());
        let tasks = &*attn_tasks;
        // The keys of row (span, t) in chunk c, for KV head g.
        let chunk_keys = |keys: &mut Vec<usize>, sp: &SeqSpan, t: usize, g: usize, c: usize| {
            let p = sp.pos + t;
            let lo = cache.first_visible(p) + c * ATTN_CHUNK;
            let hi = (lo + ATTN_CHUNK).min(p + 1);
            keys.clear();
            keys.extend((lo..hi).map(|j| cache.at(&shape, sp.slot, j) + g * hd));
        };
        let subgroups = |g: usize| head_subgroups(g, group);
        self.run(|par| {
            par.for_each_in(tasks, |&(si, g, c, at)| {
                let sp = spans[si];
                SCORES.with(|sc| {
                    KEYS.with(|keys| {
                        PARTIAL.with(|part| {
                            let (mut sc, mut keys) = (sc.borrow_mut(), keys.borrow_mut());
                            let mut part = part.borrow_mut();
                            part.resize(2 * rec, 0.0);
                            let (acc, cur) = part.split_at_mut(rec);
                            if c != ALL {
                                // SAFETY: this task's own record of the partials.
                                let out = unsafe { pptr.slice(at, rec) };
                                chunk_keys(&mut keys, &sp, 0, g, c);
                                for (h0, gh) in subgroups(g) {
                                    let qg = &qs[sp.row * width_q + h0 * hd..][..gh * hd];
                                    let r =
                                        &mut out[(h0 - g * group) * (2 + hd)..][..gh * (2 + hd)];
                                    chunk_partial(qg, hd, (ks, vs), &keys, scale, &mut sc, r);
                                }
                                return;
                            }
                            for t in 0..sp.n {
                                let p = sp.pos + t;
                                let n_chunks =
                                    (p + 1 - cache.first_visible(p)).div_ceil(ATTN_CHUNK);
                                let row = (sp.row + t) * width_q;
                                for (h0, gh) in subgroups(g) {
                                    let qg = &qs[row + h0 * hd..][..gh * hd];
                                    let w = gh * (2 + hd);
                                    for c in 0..n_chunks {
                                        chunk_keys(&mut keys, &sp, t, g, c);
                                        let r = if c == 0 { &mut acc[..w] } else { &mut cur[..w] };
                                        chunk_partial(qg, hd, (ks, vs), &keys, scale, &mut sc, r);
                                        if c > 0 {
                                            merge_partial(&mut acc[..w], &cur[..w], gh, hd);
                                        }
                                    }
                                    // SAFETY: task (span, KV head) writes the columns of its
                                    // own query heads in its own rows; no two tasks share one.
                                    let o = unsafe { optr.slice(row + h0 * hd, gh * hd) };
                                    let sk = sinks.map(|s| &s[h0..h0 + gh]);
                                    finish_partial(&acc[..w], gh, hd, sk, o);
                                }
                            }
                        })
                    })
                });
            });
        });
        // The split rows: their chunks' partials merged in chunk order (on this thread,
        // its partial buffer reused).
        PARTIAL.with(|part| {
            let mut acc = part.borrow_mut();
            let mut i = 0;
            while i < tasks.len() {
                let (si, g, c, at) = tasks[i];
                if c == ALL {
                    i += 1;
                    continue;
                }
                let n_chunks = chunks_of(&spans[si]);
                let row = spans[si].row * width_q;
                for (h0, gh) in subgroups(g) {
                    let (off, w) = ((h0 - g * group) * (2 + hd), gh * (2 + hd));
                    acc.clear();
                    acc.extend_from_slice(&partials[at + off..at + off + w]);
                    for k in 1..n_chunks {
                        let r = at + k * rec + off;
                        merge_partial(&mut acc, &partials[r..r + w], gh, hd);
                    }
                    // SAFETY: the pool is done; this (row, head group) is written once.
                    let o = unsafe { optr.slice(row + h0 * hd, gh * hd) };
                    finish_partial(&acc, gh, hd, sinks.map(|s| &s[h0..h0 + gh]), o);
                }
                i += n_chunks;
            }
        });
    }

    /// `x[i] = f(x[i], y[i])` for the first `n` elements, in pieces across the pool where
    /// `n` is a prefill's worth (an activation's exp or tanh costs more than its memory
    /// traffic); element by element, so the split does not change a bit.
    fn elementwise(
        &self,
        x: &mut CpuMem,
        y: &CpuMem,
        n: usize,
        f: impl Fn(f32, f32) -> f32 + Sync,
    ) {
        const PIECE: usize = 16 * 1024;
        let (xs, ys) = (&mut x.f32s_mut()[..n], &y.f32s()[..n]);
        if n < 2 * PIECE || self.threads == 1 {
            kernels::map2(xs, ys, f);
            return;
        }
        let xp = SharedPtr(xs.as_mut_ptr());
        self.run(|par| {
            par.for_each(n.div_ceil(PIECE), |c| {
                let (i0, i1) = (c * PIECE, ((c + 1) * PIECE).min(n));
                // SAFETY: piece c is elements i0..i1 only; pieces are disjoint.
                let xc = unsafe { xp.slice(i0, i1 - i0) };
                kernels::map2(xc, &ys[i0..i1], &f);
            });
        });
    }

    fn scratch(&self) -> std::sync::MutexGuard<'_, Scratch> {
        // A panicked op leaves only stale scratch contents behind.
        self.scratch.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn weight_bytes<'a>(w: &WeightRef<'a, CpuMem>) -> &'a [u8] {
    let rb = w.dtype.row_bytes(w.cols as u64).expect("validated shapes") as usize;
    &w.mem.bytes()[w.offset..w.offset + rb * w.rows]
}

fn f32_vector<'a>(w: &WeightRef<'a, CpuMem>, scratch: &'a mut Vec<f32>) -> &'a [f32] {
    let n = w.rows * w.cols;
    let bytes = weight_bytes(w);
    if w.dtype == DType::F32 && w.offset.is_multiple_of(4) {
        // SAFETY: 4-aligned (allocation aligned, offset checked), n f32 inside the bytes.
        return unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const f32, n) };
    }
    scratch.resize(n, 0.0);
    kernels::dequant_rows(w.dtype, bytes, bytes.len() / w.rows.max(1), w.cols, scratch);
    scratch
}

/// A grouped attention's task for all of a (span, KV head)'s chunks of keys.
const ALL: usize = usize::MAX;

/// The tasks of a grouped attention into `tasks`: (span, KV head, ALL, 0) for each, or
/// where `split`, for a span of one row (a decode row), a task per chunk of its keys
/// (`chunks_of`): (span, KV head, chunk, where its `rec` floats of results go). Returns
/// the floats the chunks' results take.
fn attention_tasks(
    tasks: &mut Vec<(usize, usize, usize, usize)>,
    (spans, kv_heads): (&[SeqSpan], usize),
    split: bool,
    chunks_of: impl Fn(&SeqSpan) -> usize,
    rec: usize,
) -> usize {
    tasks.clear();
    let mut at = 0;
    for (si, sp) in spans.iter().enumerate() {
        for g in 0..kv_heads {
            if split && sp.n == 1 {
                for c in 0..chunks_of(sp) {
                    tasks.push((si, g, c, at));
                    at += rec;
                }
            } else {
                tasks.push((si, g, ALL, 0));
            }
        }
    }
    at
}

/// The query heads of KV head `g` (`group` of them) in runs of at most GROUP_MAX: (first
/// head, count).
fn head_subgroups(g: usize, group: usize) -> impl Iterator<Item = (usize, usize)> + Clone {
    (g * group..(g + 1) * group)
        .step_by(kernels::GROUP_MAX)
        .map(move |h0| (h0, ((g + 1) * group - h0).min(kernels::GROUP_MAX)))
}

/// Keys a chunk of grouped f16 attention (`CpuBackend::attention_grouped`).
const ATTN_CHUNK: usize = 256;

/// The softmax partial of one chunk of keys for `gh` query heads `qg` (rows of `hd`):
/// `out` = [max score; gh], [sum of exp(score - max); gh], [sum of exp(score - max) *
/// value; gh rows of hd].
fn chunk_partial(
    qg: &[f32],
    hd: usize,
    (ks, vs): (&[u16], &[u16]),
    keys: &[usize],
    scale: f32,
    sc: &mut Vec<f32>,
    out: &mut [f32],
) {
    let (gh, n) = (qg.len() / hd, keys.len());
    sc.resize(gh * n, 0.0);
    kernels::group_scores_f16(qg, hd, ks, keys, sc);
    for (i, s) in sc.chunks_exact_mut(n).enumerate() {
        (out[i], out[gh + i]) = exp_scaled(s, scale);
    }
    kernels::group_pv_f16(sc, hd, vs, keys, &mut out[2 * gh..2 * gh + gh * hd]);
}

/// Merges the partial `new` into `acc` (both as `chunk_partial` writes them).
fn merge_partial(acc: &mut [f32], new: &[f32], gh: usize, hd: usize) {
    for i in 0..gh {
        let m = acc[i].max(new[i]);
        let (a, b) = ((acc[i] - m).exp(), (new[i] - m).exp());
        acc[i] = m;
        acc[gh + i] = acc[gh + i] * a + new[gh + i] * b;
        let o = 2 * gh + i * hd;
        for (x, &y) in acc[o..o + hd].iter_mut().zip(&new[o..o + hd]) {
            *x = *x * a + y * b;
        }
    }
}

/// The attention output of a merged partial: weighted values over the sum (with each
/// head's sink logit in the sum, where the model has sinks).
fn finish_partial(acc: &[f32], gh: usize, hd: usize, sinks: Option<&[f32]>, o: &mut [f32]) {
    for i in 0..gh {
        let inv = match sinks {
            None => 1.0 / acc[gh + i],
            Some(s) => sink_share(acc[i], acc[gh + i], s[i]),
        };
        let src = &acc[2 * gh + i * hd..2 * gh + (i + 1) * hd];
        for (x, &y) in o[i * hd..(i + 1) * hd].iter_mut().zip(src) {
            *x = y * inv;
        }
    }
}

/// Scores times `scale`, then exp(score - max) in place; returns (max, sum of the exps),
/// summed in order.
fn exp_scaled(sc: &mut [f32], scale: f32) -> (f32, f32) {
    let mut mx = f32::NEG_INFINITY;
    for s in sc.iter_mut() {
        *s *= scale;
        mx = mx.max(*s);
    }
    kernels::map1(sc, |s| kernels::exp_f32(s - mx));
    (mx, sc.iter().sum())
}

/// Scores times `scale`, then softmax in place: `exp_scaled`, then scaled by 1 / sum (the
/// sum with the sink's term, where there is a sink).
fn softmax_scaled(sc: &mut [f32], scale: f32, sink: Option<f32>) {
    let (mx, sum) = exp_scaled(sc, scale);
    let inv = match sink {
        None => 1.0 / sum,
        Some(s) => sink_share(mx, sum, s),
    };
    sc.iter_mut().for_each(|s| *s *= inv);
}

/// What exp(score - `mx`) is multiplied by to become a probability when a sink logit
/// joins the softmax (`sum` = the sum of the scores' exp(score - mx)): with m the larger of
/// mx and the sink, e^(mx - m) / (sum e^(mx - m) + e^(sink - m)).
fn sink_share(mx: f32, sum: f32, sink: f32) -> f32 {
    let m = mx.max(sink);
    let a = (mx - m).exp();
    a / (sum * a + (sink - m).exp())
}

/// A pointer that parallel tasks write through at disjoint places.
#[derive(Clone, Copy)]
struct SharedPtr(*mut f32);
// SAFETY: each use below writes disjoint elements from different tasks.
unsafe impl Send for SharedPtr {}
unsafe impl Sync for SharedPtr {}

impl SharedPtr {
    /// The address of element `i` (a method, so a closure captures the whole `SharedPtr`).
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }

    /// `len` elements from element `at`.
    ///
    /// # Safety
    /// The range is inside the allocation, and no other task reads or writes it while the
    /// slice lives.
    unsafe fn slice<'o>(self, at: usize, len: usize) -> &'o mut [f32] {
        // SAFETY: the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(at), len) }
    }
}

/// What each compute thread's own scratch must hold for a `ScratchShape`.
#[derive(Clone, Copy, Default)]
struct ThreadScratch {
    k_max: usize,
    chunk_max: usize,
    max_context: usize,
    /// Query heads and their dimensions (the attention partials).
    heads: usize,
    head_dim: usize,
}

impl ThreadScratch {
    fn of(shape: &ScratchShape, threads: usize) -> ThreadScratch {
        let k_max = shape.hidden.max(shape.q_dim).max(shape.intermediate) as usize;
        let m_max = shape
            .vocab
            .max(shape.intermediate)
            .max(shape.q_dim)
            .max(shape.hidden) as usize;
        let heads = shape.heads.max(1) as usize;
        ThreadScratch {
            k_max,
            chunk_max: decode_chunk(m_max, threads),
            max_context: shape.max_context,
            heads,
            head_dim: shape.q_dim as usize / heads,
        }
    }

    /// Attention partials: a row's running softmax partial and a chunk's for the query
    /// heads of a KV head (at most all of them, the f16 cache's path), or a block of
    /// columns for up to GROUP_MAX heads (the f32 cache's split rows).
    fn partial(self) -> usize {
        (2 * self.heads * (2 + self.head_dim)).max(kernels::GROUP_MAX * self.head_dim)
    }

    /// Scores: whole rows of up to GROUP_MAX heads (the f32 cache's path), or a chunk of
    /// keys for as many (the f16 cache's).
    fn scores(self) -> usize {
        kernels::GROUP_MAX * self.max_context.max(ATTN_CHUNK)
    }

    fn tile(self) -> usize {
        tile_f32s_max(self.k_max)
    }

    /// The bytes `reserve` makes room for, and sgemm's packing buffer.
    fn bytes(self) -> usize {
        use std::mem::size_of;
        SGEMM_PACK_BYTES
            + kernels::thread_scratch_bytes(self.k_max)
            + self.chunk_max * (size_of::<[f32; 4]>() + size_of::<[f32; q8::ROWS_MAX]>())
            + (self.scores() + self.tile() + self.partial()) * size_of::<f32>()
            + ATTN_CHUNK * size_of::<usize>()
    }

    /// Grows this thread's scratch (GEMV sums, four-row results, attention scores and
    /// partials, the offsets of a chunk's keys, dequantized tiles) to hold the largest op of the shape
    /// at once, so that no thread grows one mid-run (which thread runs which task is not
    /// fixed).
    fn reserve(self) {
        fn grow<T>(v: &mut Vec<T>, n: usize) {
            let len = v.len();
            v.reserve(n.saturating_sub(len));
        }
        kernels::reserve_thread_scratch(self.k_max);
        RES4.with(|r| grow(&mut r.borrow_mut(), self.chunk_max));
        RES.with(|r| grow(&mut r.borrow_mut(), self.chunk_max));
        SCORES.with(|s| grow(&mut s.borrow_mut(), self.scores()));
        PARTIAL.with(|s| grow(&mut s.borrow_mut(), self.partial()));
        KEYS.with(|s| grow(&mut s.borrow_mut(), ATTN_CHUNK));
        TILE.with(|t| grow(&mut t.borrow_mut(), self.tile()));
    }
}

/// Numbers `reserve_scratch` calls process-wide, so a thread's `RESERVED` names one.
static RESERVE_EPOCH: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// The `reserve_scratch` call this thread's scratch was last grown for.
    static RESERVED: Cell<u64> = const { Cell::new(0) };
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    static SCORES: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// The KV-cache offsets of the positions one attention chunk sees.
    static KEYS: RefCell<Vec<usize>> = const { RefCell::new(Vec::new()) };
    /// A row's running softmax partial and the current chunk's.
    static PARTIAL: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
    /// A four-row GEMV task's results (the f32 path).
    static RES4: RefCell<Vec<[f32; 4]>> = const { RefCell::new(Vec::new()) };
    /// A GEMV task's results, up to q8::ROWS_MAX rows of each column.
    static RES: RefCell<Vec<[f32; q8::ROWS_MAX]>> = const { RefCell::new(Vec::new()) };
}

impl Backend for CpuBackend {
    type Mem = CpuMem;

    fn host_threads(&self) -> usize {
        self.threads()
    }

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn budget(&self) -> &MemBudget {
        &self.budget
    }

    fn alloc(&self, bytes: usize, what: &str) -> Result<CpuMem, BackendError> {
        let rounded = bytes.max(1).div_ceil(IO_ALIGN) * IO_ALIGN;
        self.budget.reserve(rounded as u64, what)?;
        match AlignedBuf::new(rounded) {
            Some(buf) => Ok(CpuMem {
                ptr: buf.as_ptr(),
                len: bytes,
                owned: Some((buf, self.budget.clone())),
            }),
            None => {
                self.budget.release(rounded as u64);
                Err(BackendError::Alloc {
                    what: what.to_string(),
                    bytes: bytes as u64,
                })
            }
        }
    }

    fn mem_len(&self, mem: &CpuMem) -> usize {
        mem.len
    }

    fn upload(&self, dst: &mut CpuMem, src: &[u8]) -> Result<(), BackendError> {
        self.upload_part(dst, 0, src)
    }

    fn upload_part(&self, dst: &mut CpuMem, offset: usize, src: &[u8]) -> Result<(), BackendError> {
        check_upload(dst.len, offset, src.len())?;
        dst.bytes_mut()[offset..offset + src.len()].copy_from_slice(src);
        Ok(())
    }

    fn unified(&self) -> bool {
        self.unified
    }

    unsafe fn borrow_host(&self, data: &[u8]) -> Option<CpuMem> {
        if !self.unified {
            return None;
        }
        Some(CpuMem {
            ptr: data.as_ptr() as *mut u8,
            len: data.len(),
            owned: None,
        })
    }

    fn host_bytes_mut<'m>(&self, mem: &'m mut CpuMem) -> Option<&'m mut [u8]> {
        Some(mem.bytes_mut())
    }

    fn download_f32(&self, src: &CpuMem, offset: usize, out: &mut [f32]) {
        out.copy_from_slice(&src.f32s()[offset..offset + out.len()]);
    }

    fn embedding(&self, table: WeightRef<'_, CpuMem>, ids: &[u32], out: &mut CpuMem) {
        let cols = table.cols;
        let rb = table.dtype.row_bytes(cols as u64).expect("validated") as usize;
        let bytes = weight_bytes(&table);
        let o = &mut out.f32s_mut()[..ids.len() * cols];
        for (row, &id) in o.chunks_exact_mut(cols).zip(ids) {
            let id = id as usize;
            assert!(
                id < table.rows,
                "token id {id} past the {} embedding rows",
                table.rows
            );
            kernels::dequant_rows(table.dtype, &bytes[id * rb..(id + 1) * rb], rb, cols, row);
        }
    }

    fn rms_norm(
        &self,
        x: &CpuMem,
        w: WeightRef<'_, CpuMem>,
        eps: f32,
        rows: usize,
        out: &mut CpuMem,
    ) {
        let cols = w.cols * w.rows;
        let mut scratch = self.scratch();
        let wv = f32_vector(&w, &mut scratch.weights);
        let xs = &x.f32s()[..rows * cols];
        let os = &mut out.f32s_mut()[..rows * cols];
        for (xr, or) in xs.chunks_exact(cols).zip(os.chunks_exact_mut(cols)) {
            let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / cols as f32;
            let inv = 1.0 / (ss + eps).sqrt();
            for ((o, &v), &g) in or.iter_mut().zip(xr).zip(wv) {
                *o = g * (v * inv);
            }
        }
    }

    fn matmul(
        &self,
        x: &CpuMem,
        rows: usize,
        gemv_rows: usize,
        w: WeightRef<'_, CpuMem>,
        bias: Option<WeightRef<'_, CpuMem>>,
        out: &mut CpuMem,
    ) {
        self.matmuls(x, rows, gemv_rows, &mut [MatmulOut { w, bias, out }]);
    }

    fn matmuls(
        &self,
        x: &CpuMem,
        rows: usize,
        gemv_rows: usize,
        outs: &mut [MatmulOut<'_, CpuMem>],
    ) {
        let acts = if self.int8_activations() {
            Acts::I8
        } else {
            Acts::F32
        };
        self.matmul_as(x, rows, gemv_rows, outs, acts);
    }

    fn matmul_head(&self, x: &CpuMem, rows: usize, w: WeightRef<'_, CpuMem>, out: &mut CpuMem) {
        let acts = if self.int8_activations() {
            Acts::I16
        } else {
            Acts::F32
        };
        let outs = &mut [MatmulOut { w, bias: None, out }];
        self.matmul_as(x, rows, rows, outs, acts);
    }

    fn rope(
        &self,
        x: &mut CpuMem,
        rows: usize,
        heads: usize,
        head_dim: usize,
        positions: &[u32],
        table: &CpuMem,
    ) {
        let half = head_dim / 2;
        let t = table.f32s();
        let xs = &mut x.f32s_mut()[..rows * heads * head_dim];
        for (r, row) in xs.chunks_exact_mut(heads * head_dim).enumerate() {
            let cs = &t[positions[r] as usize * half * 2..(positions[r] as usize + 1) * half * 2];
            for h in row.chunks_exact_mut(head_dim) {
                let (a, b) = h.split_at_mut(half);
                for i in 0..half {
                    let (c, s) = (cs[2 * i], cs[2 * i + 1]);
                    let (x1, x2) = (a[i], b[i]);
                    a[i] = x1 * c - x2 * s;
                    b[i] = x2 * c + x1 * s;
                }
            }
        }
    }

    fn kv_store(
        &self,
        k: &CpuMem,
        v: &CpuMem,
        cache_k: &mut CpuMem,
        cache_v: &mut CpuMem,
        step: &AttnStep<'_>,
    ) {
        let (spans, shape, cache) = (step.spans, step.shape, step.cache);
        let width = shape.kv_heads * shape.head_dim;
        for (src, dst) in [(k, cache_k), (v, cache_v)] {
            let s = src.f32s();
            for sp in spans {
                assert!(
                    cache.fits(&shape, sp.pos, sp.n) && sp.slot < shape.slots,
                    "span {sp:?} outside the KV cache of layer {} ({cache:?})",
                    step.layer
                );
                for t in 0..sp.n {
                    let at = cache.at(&shape, sp.slot, sp.pos + t);
                    let row = &s[(sp.row + t) * width..(sp.row + t + 1) * width];
                    match shape.kv {
                        KvDtype::F32 => dst.f32s_mut()[at..at + width].copy_from_slice(row),
                        KvDtype::F16 => {
                            // Round to nearest even, as llama.cpp's f16 cache does.
                            use half::slice::HalfFloatSliceExt;
                            let d: &mut [half::f16] =
                                bytemuck_f16(&mut dst.u16s_mut()[at..at + width]);
                            d.convert_from_f32_slice(row);
                        }
                    }
                }
            }
        }
    }

    fn attention(
        &self,
        q: &CpuMem,
        cache_k: &CpuMem,
        cache_v: &CpuMem,
        step: &AttnStep<'_>,
        sinks: Option<WeightRef<'_, CpuMem>>,
        out: &mut CpuMem,
    ) {
        // The decoder stores sinks in f32 (read in place); another dtype is converted.
        let mut converted = Vec::new();
        let sinks = sinks.map(|w| f32_vector(&w, &mut converted));
        let (spans, shape, cache) = (step.spans, step.shape, step.cache);
        let AttnShape {
            heads,
            kv_heads,
            head_dim,
            max_context,
            scale,
            ..
        } = shape;
        let group = heads / kv_heads;
        let width_q = heads * head_dim;
        let qs = q.f32s();
        let kv = KvRows::of(shape.kv, cache_k, cache_v);
        let optr = SharedPtr(out.f32s_mut().as_mut_ptr());
        let mut scratch = self.scratch();
        let tasks = &mut scratch.tasks;
        tasks.clear();
        if let (KvRows::F16(ks, vs), true) = (&kv, kernels::has_group_f16(head_dim)) {
            drop(scratch);
            return self.attention_grouped(qs, (ks, vs), step, sinks, optr);
        }
        if let (KvRows::F32(ks, vs), true) = (&kv, head_dim.is_multiple_of(8)) {
            drop(scratch);
            return self.attention_grouped_f32(qs, (ks, vs), step, sinks, optr);
        }
        tasks.extend((0..spans.len()).flat_map(|i| (0..heads).map(move |h| (i, h))));
        let tasks = &*tasks;
        self.run(|par| {
            par.for_each_in(tasks, |&(si, h)| {
                let sp = spans[si];
                let g = h / group;
                SCORES.with(|sc| {
                    let mut sc = sc.borrow_mut();
                    // Room for the whole context once, not a doubling as positions grow.
                    let len = sc.len();
                    sc.reserve(max_context.saturating_sub(len));
                    for t in 0..sp.n {
                        // Attends to positions lo..=p (all of them, or its window).
                        let p = sp.pos + t;
                        let lo = cache.first_visible(p);
                        let kv_row = |j: usize| cache.at(&shape, sp.slot, j) + g * head_dim;
                        let qrow = &qs[(sp.row + t) * width_q + h * head_dim..][..head_dim];
                        sc.resize(p + 1 - lo, 0.0);
                        kv.scores(qrow, lo, kv_row, &mut sc);
                        softmax_scaled(&mut sc, scale, sinks.map(|s| s[h]));
                        // SAFETY: task (span, head) writes its own head's columns of its own
                        // rows; no two tasks share a (row, head).
                        let o =
                            unsafe { optr.slice((sp.row + t) * width_q + h * head_dim, head_dim) };
                        o.fill(0.0);
                        kv.weighted_sum(&sc, lo, kv_row, o);
                    }
                });
            });
        });
    }

    fn silu_mul(&self, gate: &mut CpuMem, up: &CpuMem, n: usize) {
        self.elementwise(gate, up, n, |g, u| silu(g) * u);
    }

    fn gelu_mul(&self, gate: &mut CpuMem, up: &CpuMem, n: usize) {
        self.elementwise(gate, up, n, |g, u| gelu_tanh(g) * u);
    }

    fn swiglu_clamp_mul(&self, gate: &mut CpuMem, up: &CpuMem, n: usize, alpha: f32, limit: f32) {
        self.elementwise(gate, up, n, move |g, u| {
            let g = g.min(limit);
            let u = u.clamp(-limit, limit);
            (u + 1.0) * (g / (1.0 + kernels::exp_f32(-alpha * g)))
        });
    }

    fn scale(&self, x: &mut CpuMem, s: f32, n: usize) {
        x.f32s_mut()[..n].iter_mut().for_each(|v| *v *= s);
    }

    fn add(&self, x: &mut CpuMem, y: &CpuMem, n: usize) {
        for (a, &b) in x.f32s_mut()[..n].iter_mut().zip(&y.f32s()[..n]) {
            *a += b;
        }
    }

    fn gather_rows(&self, src: &CpuMem, rows: &[u32], cols: usize, dst: &mut CpuMem) {
        let (s, d) = (src.f32s(), &mut dst.f32s_mut()[..rows.len() * cols]);
        for (o, &r) in d.chunks_exact_mut(cols).zip(rows) {
            let r = r as usize;
            o.copy_from_slice(&s[r * cols..(r + 1) * cols]);
        }
    }

    fn scatter_add_rows(
        &self,
        src: &CpuMem,
        rows: &[u32],
        weights: &[f32],
        cols: usize,
        dst: &mut CpuMem,
    ) {
        let (s, d) = (&src.f32s()[..rows.len() * cols], dst.f32s_mut());
        for ((x, &r), &w) in s.chunks_exact(cols).zip(rows).zip(weights) {
            let r = r as usize;
            for (o, &v) in d[r * cols..(r + 1) * cols].iter_mut().zip(x) {
                // A product, then a sum (Rust does not fuse them): the CUDA kernel's bits.
                *o += w * v;
            }
        }
    }

    fn zero(&self, x: &mut CpuMem, n: usize) {
        x.f32s_mut()[..n].fill(0.0);
    }

    fn copy_row(
        &self,
        src: &CpuMem,
        src_row: usize,
        dst: &mut CpuMem,
        dst_row: usize,
        cols: usize,
    ) {
        let s = &src.f32s()[src_row * cols..(src_row + 1) * cols];
        dst.f32s_mut()[dst_row * cols..(dst_row + 1) * cols].copy_from_slice(s);
    }
}

/// Products of one activation that `matmuls` runs as one op, at most.
const MAX_SHARED: usize = 4;

/// How a weight meets the decode rows: integer dots against their 8- or 16-bit blocks,
/// the four-row f32 kernels (with per-block sums), or the one-row f32 dots.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum DecodePath {
    Int8,
    Int16,
    Rows4,
    Rows,
}

impl DecodePath {
    /// Decode rows one weight read serves.
    fn group(self) -> usize {
        match self {
            DecodePath::Int8 | DecodePath::Int16 => q8::ROWS_MAX,
            DecodePath::Rows4 | DecodePath::Rows => 4,
        }
    }

    fn of(dtype: DType, acts: Acts) -> DecodePath {
        let int = q8::covers(dtype);
        match acts {
            Acts::I8 if int => DecodePath::Int8,
            Acts::I16 if int => DecodePath::Int16,
            _ if kernels::has_gemv4(dtype) => DecodePath::Rows4,
            _ => DecodePath::Rows,
        }
    }
}

/// The decode rows converted for the products that need it (`DecodePath`).
struct DecodeActs<'a> {
    q8: &'a [q8::Q8Block],
    q16: &'a [q8::Q16Block],
    xsums: &'a [f32],
}

/// One matrix product's operands, shared by its tasks: weight rows `wb` (`rb` bytes each,
/// `m` of them), activations `xs` (rows of `k`), the output rows (`m` wide), and the path
/// its decode rows take.
#[derive(Clone, Copy)]
struct Matmul<'a> {
    dtype: DType,
    wb: &'a [u8],
    rb: usize,
    xs: &'a [f32],
    k: usize,
    m: usize,
    out: SharedPtr,
    threads: usize,
    path: DecodePath,
}

impl Matmul<'_> {
    fn decode_chunk(&self) -> usize {
        decode_chunk(self.m, self.threads)
    }

    /// Rows `r0..r0 + n` of the first `g` decode rows against weight rows `j0..j1`: into
    /// `res` (one column a row; returns true), or straight into the output (false).
    #[allow(clippy::too_many_arguments)] // a task's place and its operands
    fn decode_task(
        &self,
        acts: &DecodeActs<'_>,
        g: usize,
        r0: usize,
        n: usize,
        (j0, j1): (usize, usize),
        res: &mut [[f32; q8::ROWS_MAX]],
    ) -> bool {
        let Matmul {
            dtype,
            wb,
            rb,
            xs,
            k,
            m,
            out: optr,
            ..
        } = *self;
        let nb = k / 32;
        let w = &wb[j0 * rb..j1 * rb];
        // A short group repeats its last row (results dropped).
        let pick = |i: usize| (r0 + i).min(g - 1);
        match self.path {
            DecodePath::Int8 => {
                let rows: [&[q8::Q8Block]; q8::ROWS_MAX] =
                    std::array::from_fn(|i| &acts.q8[pick(i) * nb..(pick(i) + 1) * nb]);
                q8::gemv_rows(dtype, w, rb, &rows[..n], res);
                true
            }
            DecodePath::Int16 => {
                let rows: [&[q8::Q16Block]; q8::ROWS_MAX] =
                    std::array::from_fn(|i| &acts.q16[pick(i) * nb..(pick(i) + 1) * nb]);
                q8::gemv_rows16(dtype, w, rb, &rows[..n], res);
                true
            }
            DecodePath::Rows4 if n > 1 => {
                let xr: [&[f32]; 4] = std::array::from_fn(|i| &xs[pick(i) * k..(pick(i) + 1) * k]);
                let xsr: [&[f32]; 4] =
                    std::array::from_fn(|i| &acts.xsums[pick(i) * nb..(pick(i) + 1) * nb]);
                RES4.with(|r4| {
                    let mut r4 = r4.borrow_mut();
                    r4.clear();
                    r4.resize(res.len(), [0f32; 4]);
                    kernels::gemv4(dtype, w, rb, &xr, &xsr, &mut r4);
                    for (o, v) in res.iter_mut().zip(r4.iter()) {
                        o[..4].copy_from_slice(v);
                    }
                });
                true
            }
            DecodePath::Rows4 | DecodePath::Rows => {
                for r in r0..r0 + n {
                    // SAFETY: the task of chunk j0..j1 writes out[r][j0..j1] only.
                    let o = unsafe { optr.slice(r * m + j0, j1 - j0) };
                    kernels::gemv(dtype, w, rb, &xs[r * k..(r + 1) * k], o);
                }
                false
            }
        }
    }
}

/// Output columns per decode task of a product of `m` columns: about `TASKS_PER_THREAD`
/// tasks per thread (claimed as threads free up, so a thread that fell behind takes fewer),
/// at least 16 columns.
fn decode_chunk(m: usize, threads: usize) -> usize {
    const TASKS_PER_THREAD: usize = 4;
    m.div_ceil(threads * TASKS_PER_THREAD).max(16)
}

/// Task `t` of tasks numbered product by product, `count(mm)` of them each: (product, its
/// task).
fn locate<'a>(
    mm: &'a [Matmul<'a>],
    count: impl Fn(&Matmul) -> usize,
    mut t: usize,
) -> (&'a Matmul<'a>, usize) {
    for p in mm {
        let c = count(p);
        if t < c {
            return (p, t);
        }
        t -= c;
    }
    unreachable!("task past the products' tasks")
}

/// The first `g` rows of every product, in groups of up to `DecodePath::group` rows (a
/// weight block read once per group), each product's output chunk `j0..j1` a task; a
/// task's results are scattered into the output rows.
fn decode_rows(par: &Par, mm: &[Matmul], g: usize, acts: &DecodeActs<'_>) {
    let count = |p: &Matmul| p.m.div_ceil(p.decode_chunk());
    let total = mm.iter().map(count).sum();
    par.for_each(total, |t| {
        let (p, c) = locate(mm, count, t);
        let (m, chunk) = (p.m, p.decode_chunk());
        let (j0, j1) = (c * chunk, ((c + 1) * chunk).min(m));
        let group = p.path.group();
        RES.with(|res| {
            let mut res = res.borrow_mut();
            res.clear();
            res.resize(j1 - j0, [0f32; q8::ROWS_MAX]);
            for r0 in (0..g).step_by(group) {
                let n = (g - r0).min(group);
                if !p.decode_task(acts, g, r0, n, (j0, j1), &mut res) {
                    continue;
                }
                for i in 0..n {
                    // SAFETY: task c writes out[r][j0..j1] only; tasks are disjoint in j.
                    let o = unsafe { p.out.slice((r0 + i) * m + j0, j1 - j0) };
                    for (oj, rj) in o.iter_mut().zip(res.iter()) {
                        *oj = rj[i];
                    }
                }
            }
        });
    });
}

/// `t` prefill rows from row `g` on, of every product: weight tiles dequantized to f32,
/// then sgemm, a tile of each product's rows a task.
fn prefill_rows(par: &Par, mm: &[Matmul], g: usize, t: usize) {
    let count = |p: &Matmul| p.m.div_ceil(tile_rows(p.k));
    let total = mm.iter().map(count).sum();
    par.for_each(total, |task| {
        let (p, ti) = locate(mm, count, task);
        let Matmul {
            dtype,
            wb,
            rb,
            xs,
            k,
            m,
            out: optr,
            ..
        } = *p;
        let xt = &xs[g * k..(g + t) * k];
        let rows = tile_rows(k);
        let (j0, j1) = (ti * rows, ((ti + 1) * rows).min(m));
        let nb = j1 - j0;
        TILE.with(|tile| {
            let mut tile = tile.borrow_mut();
            tile.resize(rows * k, 0.0);
            kernels::dequant_rows(dtype, &wb[j0 * rb..j1 * rb], rb, k, &mut tile[..nb * k]);
            // SAFETY: C = X[t, k] . T^T lands in out[g.., j0..j1] (row stride m),
            // disjoint across tasks; A and B are live slices of the given sizes.
            unsafe {
                matrixmultiply::sgemm(
                    t,
                    k,
                    nb,
                    1.0,
                    xt.as_ptr(),
                    k as isize,
                    1,
                    tile.as_ptr(),
                    1,
                    k as isize,
                    0.0,
                    optr.at(g * m + j0),
                    m as isize,
                    1,
                );
            }
        });
    });
}

/// GELU with the tanh approximation, as transformers' `gelu_pytorch_tanh`:
/// 0.5 x (1 + tanh(u)), u = sqrt(2 / pi) (x + 0.044715 x^3), written as the equal
/// x / (1 + e^(-2u)), which loses nothing where tanh(u) nears -1 and vectorizes
/// (`kernels::exp_f32`).
#[inline(always)]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    x / (1.0 + kernels::exp_f32(-2.0 * SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)))
}

/// SiLU: x / (1 + e^-x).
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + kernels::exp_f32(-x))
}

#[cfg(test)]
mod tests;
