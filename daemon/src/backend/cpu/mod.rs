//! The CPU backend: device memory is host memory carved from a budgeted arena (so the
//! streaming path and its budget are real without a GPU), ops are multi-threaded with a
//! team of spinning threads (`team.rs`), each thread's scratch reserved ahead (nothing is
//! allocated per step). This file holds the memory, the scratch and the `Backend` impl;
//! the ops are split as the CUDA backend's are: matrix products in `matmul.rs` (decode
//! rows through `gemv.rs` and `q8.rs`, prefill rows through dequantized tiles and
//! `matrixmultiply`'s sgemm, never a whole matrix at once), attention in `attention/`,
//! element-wise ops in `elementwise.rs`.

mod attention;
mod elementwise;
#[cfg(target_arch = "x86_64")]
mod floatdot;
mod gemv;
#[cfg(target_arch = "x86_64")]
mod kquant;
mod matmul;
pub mod q8;
#[cfg(target_arch = "x86_64")]
mod simd;
mod team;

pub use elementwise::{gelu_tanh, silu};

/// A row range of a quantized matrix as f32 (`tests/tests/quants.rs` checks it against
/// gguf-py on real tensors).
pub use gemv::dequant_rows;

use super::{
    check_upload, AttnShape, AttnStep, Backend, BackendError, KvDtype, LayerCache, MatmulOut,
    MemBudget, ScratchShape, WeightRef,
};
use crate::dtype::DType;
use crate::hostbuf::{AlignedBuf, IO_ALIGN};
use attention::kernels::GROUP_MAX;
use attention::ATTN_CHUNK;
use matmul::{decode_chunk, tile_f32s_max, Acts, SGEMM_PACK_BYTES};
use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

/// u16 cache elements as f16 (same size and alignment, every bit pattern valid).
fn bytemuck_f16(x: &mut [u16]) -> &mut [half::f16] {
    // SAFETY: f16 is a transparent u16.
    unsafe { std::slice::from_raw_parts_mut(x.as_mut_ptr() as *mut half::f16, x.len()) }
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
    gemv::dequant_rows(w.dtype, bytes, bytes.len() / w.rows.max(1), w.cols, scratch);
    scratch
}

/// A pointer that parallel tasks write through at disjoint places.
#[derive(Clone, Copy)]
struct SharedPtr(*mut f32);
// SAFETY: each use below writes disjoint elements from different tasks.
unsafe impl Send for SharedPtr {}
unsafe impl Sync for SharedPtr {}

impl SharedPtr {
    /// The address of element `i` (a method, so a closure captures the whole `SharedPtr`).
    #[inline]
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }

    /// `len` elements from element `at`.
    ///
    /// # Safety
    /// The range is inside the allocation, and no other task reads or writes it while the
    /// slice lives.
    #[inline]
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
        (2 * self.heads * (2 + self.head_dim)).max(GROUP_MAX * self.head_dim)
    }

    /// Scores: whole rows of up to GROUP_MAX heads (the f32 cache's path), or a chunk of
    /// keys for as many (the f16 cache's).
    fn scores(self) -> usize {
        GROUP_MAX * self.max_context.max(ATTN_CHUNK)
    }

    fn tile(self) -> usize {
        tile_f32s_max(self.k_max)
    }

    /// The bytes `reserve` makes room for, and sgemm's packing buffer.
    fn bytes(self) -> usize {
        use std::mem::size_of;
        SGEMM_PACK_BYTES
            + gemv::thread_scratch_bytes(self.k_max)
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
        gemv::reserve_thread_scratch(self.k_max);
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

    fn discard(&self, mem: &mut CpuMem, range: std::ops::Range<usize>) -> usize {
        match &mut mem.owned {
            Some((buf, _)) => buf.discard(range.start..range.end.min(mem.len)),
            None => 0,
        }
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
            gemv::dequant_rows(table.dtype, &bytes[id * rb..(id + 1) * rb], rb, cols, row);
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

    fn kv_move(
        &self,
        cache_k: &mut CpuMem,
        cache_v: &mut CpuMem,
        step: &AttnStep<'_>,
        slot: usize,
        moves: &[(u32, u32)],
    ) {
        let (shape, cache) = (step.shape, step.cache);
        let width = shape.kv_heads * shape.head_dim;
        for &(from, to) in moves {
            let (from, to) = (from as usize, to as usize);
            assert!(
                from.max(to) < shape.max_context && slot < shape.slots,
                "KV move {from} -> {to} of slot {slot} outside the cache of layer {}",
                step.layer
            );
            let (src, dst) = (cache.at(&shape, slot, from), cache.at(&shape, slot, to));
            for mem in [&mut *cache_k, &mut *cache_v] {
                match shape.kv {
                    KvDtype::F32 => mem.f32s_mut().copy_within(src..src + width, dst),
                    KvDtype::F16 => mem.u16s_mut().copy_within(src..src + width, dst),
                }
            }
        }
    }

    fn kv_copy(
        &self,
        cache_k: &mut CpuMem,
        cache_v: &mut CpuMem,
        (shape, cache): (&AttnShape, &LayerCache),
        (from, to): (usize, usize),
        positions: std::ops::Range<usize>,
    ) {
        assert!(
            from != to && from.max(to) < shape.slots && positions.end <= shape.max_context,
            "KV copy of positions {positions:?} from slot {from} to slot {to} outside the cache"
        );
        let width = shape.kv_heads * shape.head_dim;
        for (first, n) in cache.held_runs(positions.clone(), positions.end) {
            if n == 0 {
                continue;
            }
            let (src, dst) = (cache.at(shape, from, first), cache.at(shape, to, first));
            for mem in [&mut *cache_k, &mut *cache_v] {
                match shape.kv {
                    KvDtype::F32 => mem.f32s_mut().copy_within(src..src + n * width, dst),
                    KvDtype::F16 => mem.u16s_mut().copy_within(src..src + n * width, dst),
                }
            }
        }
    }

    fn kv_read(&self, cache: &CpuMem, offset: usize, out: &mut [u8]) {
        out.copy_from_slice(&cache.bytes()[offset..offset + out.len()]);
    }

    fn kv_write(&self, cache: &mut CpuMem, offset: usize, src: &[u8]) {
        cache.bytes_mut()[offset..offset + src.len()].copy_from_slice(src);
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
        self.attend(q, cache_k, cache_v, step, sinks, out);
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
            (u + 1.0) * (g / (1.0 + elementwise::exp_f32(-alpha * g)))
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

#[cfg(test)]
mod tests;
