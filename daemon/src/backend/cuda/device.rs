//! The CUDA backend: one context on one device, a compute stream
//! and a copy stream, one device allocation carved into every role, the kernels of
//! kernels/ compiled by NVRTC for the device at start (cached on disk), and cuBLAS for the
//! prefill rows of dense and dequantized matrices.
//!
//! Ops are enqueued on the compute stream and return at once; their errors are kept and
//! reported by `check` (the pipeline calls it after every pass). Streaming slots carry
//! events: `end` closes the slot's last upload on the copy stream (the compute stream waits
//! for it; `upload_wait` sleeps on it), a start/end pair brackets each part of the upload
//! (the copy's own time, for its bandwidth), and `consumed` is recorded on the compute
//! stream after the last unit that read the slot, so the next upload into the slot waits
//! for exactly that work.

use super::arena::Arena;
use super::handles::{carve, dev_err, ArenaBase, Blas, CudaMem, CudaPinner, PinnedHost};
use super::kernels::{Dims, Kernel, KernelTable};
use super::meta::{
    group_slot_bytes, GroupHost, Meta, MetaKind, SpanMeta, GROUP_META_SLOTS, ROW_META,
};
use super::probe::{check_driver, driver_present, info_of};
use super::DeviceInfo;
use crate::backend::experts::experts_each;
use crate::backend::KvDtype;
use crate::backend::{
    AttnShape, AttnStep, Backend, BackendError, CopyStats, ExpertCall, ExpertScratch, ExpertShape,
    LayerCache, MemBudget, RouteGating, ScratchShape, WeightRef,
};
use crate::hostbuf::Pinner;
use cudarc::cublas::{result as blas, sys as bsys};
use cudarc::driver::{result, sys, CudaContext, CudaStream};
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// Threads of an attention block (ATT_WARPS warps in kernels/attention.cu) and the widest
/// head it takes (ATT_HD).
pub(super) const ATTENTION_THREADS: u32 = 256;
pub const ATTENTION_HEAD_DIM_MAX: usize = 256;
/// Positions one attention block takes: a row seeing n positions is spread over
/// ceil(n / ATTENTION_SPLIT) blocks per KV head, so one decode row at a long context still
/// fills the device.
pub const ATTENTION_SPLIT: usize = 1024;
/// The attention partials' scratch (max, sum and weighted V per row, split and head) is
/// sized for every row at the longest context, within this bound; beyond it a step's rows
/// go in several launches.
const ATTENTION_PART_MAX: u64 = 64 << 20;

/// Row ranges [r0, r1) of one attention step per launch, each with its most splits of a
/// row (the partials' stride), handed to `launch` in order, so that a launch's partials
/// (`record` bytes per row and split) fit `cap` bytes. The grouping changes no row's
/// result.
pub(super) fn attention_launches(
    splits: &[usize],
    record: u64,
    cap: u64,
    mut launch: impl FnMut(usize, usize, usize) -> Result<(), String>,
) -> Result<(), String> {
    let too_big = |s: usize| {
        format!(
            "a row of {s} attention splits needs {} bytes of partials; the scratch holds {cap}",
            s as u64 * record
        )
    };
    let (mut r0, mut s_max) = (0, 0);
    for (r, &s) in splits.iter().enumerate() {
        if s as u64 * record > cap {
            return Err(too_big(s));
        }
        let grown = s_max.max(s);
        if ((r + 1 - r0) * grown) as u64 * record > cap {
            launch(r0, r, s_max)?;
            (r0, s_max) = (r, s);
        } else {
            s_max = grown;
        }
    }
    if r0 < splits.len() {
        launch(r0, splits.len(), s_max)?;
    }
    Ok(())
}

/// Rows of a quantized weight dequantized per cuBLAS call are bounded by this tile.
const TILE_BYTES_MAX: u64 = 64 << 20;
/// Slots of the expert metadata ring (`Meta::expert_rows`): a slot's pinned bytes are
/// rewritten only after this many later gathers or scatters, whose copies have long run.
pub(super) const EXPERT_META_SLOTS: usize = 64;
/// cuBLAS workspace (NVIDIA recommends 32 MiB on Hopper), carved from the arena so that
/// cuBLAS allocates nothing while running.
const BLAS_WORKSPACE: u64 = 32 << 20;

/// Device memory the backend keeps for itself for this model and these limits: kernel
/// metadata (token ids, positions, KV offsets), f16/bf16 copies of prefill activations,
/// the dequantization tile and bias buffer of the cuBLAS path, and cuBLAS's workspace. The
/// memory plan counts it before anything else.
pub fn scratch_bytes(shape: &ScratchShape) -> u64 {
    let l = Layout::new(shape);
    l.meta + l.half + l.tile + l.bias + l.attn_part + BLAS_WORKSPACE
}

pub(super) struct Layout {
    pub(super) rows: u64,
    pub(super) meta: u64,
    /// Offsets in the metadata allocation of the grouped-expert slots and of the routing's
    /// output (device only: k experts and weights a row).
    pub(super) group_off: u64,
    pub(super) route_off: u64,
    pub(super) route_bytes: u64,
    pub(super) half: u64,
    pub(super) tile: u64,
    pub(super) bias: u64,
    /// Attention partials: a record per (row, split, head) of head_dim + 2 floats.
    pub(super) attn_part: u64,
}

impl Layout {
    fn new(shape: &ScratchShape) -> Layout {
        let r = |b: u64| b.div_ceil(4096) * 4096;
        let rows = shape.rows;
        let (h, q, i, v) = (shape.hidden, shape.q_dim, shape.intermediate, shape.vocab);
        let kmax = h.max(q).max(i);
        let widest = v.max(i).max(q).max(h);
        // ids u32, positions u32, KV destinations u64, cache bases u64, tree ancestors u64
        // per row; then the expert metadata ring: a row list (u32) and weights (f32) per
        // slot; then the grouped-expert slots; then the routing's output.
        let ring = rows * ROW_META + EXPERT_META_SLOTS as u64 * rows * 8;
        let group_off = ring.div_ceil(8) * 8;
        let route_off = group_off + (GROUP_META_SLOTS * group_slot_bytes(rows as usize)) as u64;
        let route_bytes = rows * shape.top_k * 8;
        // Every row at the longest context, within ATTENTION_PART_MAX, but always one such row.
        let row_part =
            (shape.max_context.div_ceil(ATTENTION_SPLIT) as u64) * (q + 2 * shape.heads) * 4;
        let attn_part = (rows * row_part).min(ATTENTION_PART_MAX).max(row_part);
        Layout {
            rows,
            meta: r(route_off + route_bytes),
            group_off,
            route_off,
            route_bytes,
            half: r(rows * kmax * 2),
            tile: r((widest * kmax * 4).min(TILE_BYTES_MAX).max(kmax * 4 * 32)),
            bias: r(widest * 4),
            attn_part: r(attn_part),
        }
    }
}

pub struct CudaBackend {
    pub(super) ctx: Arc<CudaContext>,
    pub(super) compute: Arc<CudaStream>,
    pub(super) copy: Arc<CudaStream>,
    pub(super) kernels: KernelTable,
    pub(super) blas: Mutex<Blas>,
    pub(super) arena: Arc<Mutex<Arena>>,
    pub(super) base: ArenaBase,
    pub(super) budget: Arc<MemBudget>,
    pub(super) layout: Layout,
    /// The metadata's arena range (`Meta` holds its address).
    pub(super) meta_dev: CudaMem,
    pub(super) half: CudaMem,
    /// The activations (device address, elements) whose bf16 copy `half` holds, while
    /// nothing has written them since.
    pub(super) half_src: Mutex<Option<(u64, usize)>>,
    pub(super) tile: CudaMem,
    pub(super) bias: CudaMem,
    pub(super) attn_part: CudaMem,
    /// Scratch for a step's attention splits per row (`attention`).
    pub(super) attn_splits: Mutex<Vec<usize>>,
    pub(super) _blas_ws: CudaMem,
    pub(super) meta: Mutex<Meta>,
    /// Scratch for a grouped-expert chunk's metadata (`experts`).
    pub(super) group: Mutex<GroupHost>,
    /// The first failure of enqueued work: what was being done, and why it failed.
    pub(super) err: Mutex<Option<(String, String)>>,
    pub(super) copies: Mutex<CopyStats>,
    pub(super) info: DeviceInfo,
    pub(super) pinner: Pinner,
}

// SAFETY: the raw pointers inside (arena base, pinned metadata) are owned by the backend;
// mutable state is behind mutexes, and the driver API is thread-safe for one context.
unsafe impl Send for CudaBackend {}
unsafe impl Sync for CudaBackend {}

impl CudaBackend {
    /// Opens device `ordinal`, makes one device allocation of `arena_bytes` (the plan's
    /// device total, backend scratch included), loads the kernels and sets up cuBLAS.
    pub fn new(
        ordinal: usize,
        arena_bytes: u64,
        shape: &ScratchShape,
    ) -> Result<CudaBackend, BackendError> {
        let dev = format!("CUDA device {ordinal}");
        if !driver_present() {
            return Err(BackendError::device(
                "opening the driver",
                &dev,
                "no NVIDIA driver library (libcuda.so.1) could be loaded",
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(dev_err(&dev, "creating a context"))?;
        let info = info_of(&ctx).map_err(|e| BackendError::device("probing", &dev, e))?;
        check_driver(&info).map_err(|e| BackendError::device("checking the driver", &dev, e))?;
        let dev = info.name.clone();
        // Event tracking would make cudarc record an event per kernel argument; the
        // backend orders its streams itself.
        // SAFETY: no cudarc-tracked allocations exist in this context's use here.
        unsafe { ctx.disable_event_tracking() };
        if info.free_bytes < arena_bytes {
            return Err(BackendError::OutOfBudget {
                what: format!("the device allocation on {}", info.name),
                bytes: arena_bytes,
                used: info.total_bytes - info.free_bytes,
                limit: info.total_bytes,
                free: info.free_bytes,
            });
        }
        let layout = Layout::new(shape);
        let rows = layout.rows as usize;
        let group_off = layout.group_off as usize;
        let compute = ctx.new_stream().map_err(dev_err(&dev, "compute stream"))?;
        let copy = ctx.new_stream().map_err(dev_err(&dev, "copy stream"))?;
        let kernels = KernelTable::load(&ctx, &info)?;
        let base = ArenaBase::new(&ctx, arena_bytes, &dev)?;
        let arena = Arc::new(Mutex::new(Arena::new(arena_bytes as usize)));
        let budget = Arc::new(MemBudget::new(arena_bytes));
        let carve = |bytes: u64, what: &str| -> Result<CudaMem, BackendError> {
            carve(&arena, &budget, &base, bytes as usize, what)
        };
        let meta_dev = carve(layout.meta, "kernel metadata")?;
        let meta_dev_ptr = meta_dev.ptr;
        let half = carve(layout.half, "half-precision activations")?;
        let tile = carve(layout.tile, "dequantization tile")?;
        let bias = carve(layout.bias, "bias")?;
        let attn_part = carve(layout.attn_part, "attention partials")?;
        let blas_ws = carve(BLAS_WORKSPACE, "cuBLAS workspace")?;
        let handle = blas_on(&ctx, &dev, &compute, &blas_ws)?;
        // SAFETY: pinned host memory for the metadata, owned (and freed) by the guard.
        let host = PinnedHost {
            ptr: unsafe { result::malloc_host(layout.meta as usize, 0) }
                .map_err(dev_err(&dev, "pinned metadata"))?,
            ctx: ctx.clone(),
        };
        let ev = || {
            ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(dev_err(&dev, "event"))
        };
        let copied = [ev()?, ev()?, ev()?, ev()?, ev()?];
        let expert_copied = (0..EXPERT_META_SLOTS)
            .map(|_| ev())
            .collect::<Result<Vec<_>, _>>()?;
        let group_copied = (0..GROUP_META_SLOTS)
            .map(|_| ev())
            .collect::<Result<Vec<_>, _>>()?;
        tracing::info!(
            "CUDA device {}: {} (sm_{}{}), {} free of {}, driver {}.{}; {} in one allocation",
            info.ordinal,
            info.name,
            info.compute_capability.0,
            info.compute_capability.1,
            crate::util::fmt_bytes(info.free_bytes),
            crate::util::fmt_bytes(info.total_bytes),
            info.driver_version / 1000,
            info.driver_version % 1000 / 10,
            crate::util::fmt_bytes(arena_bytes)
        );
        Ok(CudaBackend {
            pinner: Pinner(Arc::new(CudaPinner { ctx: ctx.clone() })),
            ctx,
            compute,
            copy,
            kernels,
            blas: Mutex::new(handle),
            arena,
            base,
            budget,
            layout,
            meta_dev,
            half,
            half_src: Mutex::new(None),
            tile,
            bias,
            attn_part,
            attn_splits: Mutex::new(Vec::with_capacity(rows)),
            _blas_ws: blas_ws,
            meta: Mutex::new(Meta::new(
                (host, meta_dev_ptr, rows),
                copied,
                (expert_copied, group_copied),
                group_off,
            )),
            group: Mutex::new(GroupHost::default()),
            err: Mutex::new(None),
            copies: Mutex::new(CopyStats::default()),
            info,
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// Uploads one metadata array (when it changed); returns its device address.
    fn meta<T: Copy>(&self, kind: MetaKind, data: &[T]) -> Result<u64, String> {
        let mut m = self.meta.lock().map_err(|_| "metadata lock poisoned")?;
        m.upload(&self.compute, kind, data)
    }

    /// The per-row metadata of a step's spans, on the device.
    /// A mixture's row list (and weights) on the device (`Meta::expert_rows`).
    fn expert_meta(&self, rows: &[u32], weights: Option<&[f32]>) -> Result<(u64, u64), String> {
        let mut m = self.meta.lock().map_err(|_| "metadata lock poisoned")?;
        m.expert_rows(&self.compute, rows, weights)
    }

    pub(super) fn spans_meta(&self, step: &AttnStep<'_>) -> Result<SpanMeta, String> {
        let mut m = self.meta.lock().map_err(|_| "metadata lock poisoned")?;
        m.spans(&self.compute, step)
    }

    pub(super) fn record(&self, what: &str, r: Result<(), String>) {
        // Every op but a matrix product writes activations (a matrix product writes only
        // its output, which `matmul_inner` checks): the bf16 copy in `half` may be stale.
        if what != "matmul" {
            self.forget_half();
        }
        if let Err(e) = r {
            if let Ok(mut slot) = self.err.lock() {
                if slot.is_none() {
                    *slot = Some((what.to_string(), e));
                }
            }
        }
    }

    /// The bf16 copy of prefill activations in `half` no longer matches its source.
    pub(super) fn forget_half(&self) {
        if let Ok(mut held) = self.half_src.lock() {
            *held = None;
        }
    }

    /// `kernel(x, y, n)`: an elementwise kernel that updates x from y.
    pub(super) fn elementwise(
        &self,
        kernel: Kernel,
        x: &mut CudaMem,
        y: &CudaMem,
        n: usize,
    ) -> Result<(), String> {
        if x.len < n * 4 || y.len < n * 4 {
            return Err(format!(
                "{n} elements past allocations of {} and {} bytes",
                x.len, y.len
            ));
        }
        self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        let dims = Dims::per_element(n as u64);
        self.kernels
            .elementwise(&self.compute, kernel, dims, x.ptr, y.ptr, n as i32)
    }
}

/// A cuBLAS handle on the compute stream with its workspace from the arena.
fn blas_on(
    ctx: &Arc<CudaContext>,
    dev: &str,
    compute: &CudaStream,
    ws: &CudaMem,
) -> Result<Blas, BackendError> {
    // SAFETY: only tries to open the library (cudarc panics on first use without it).
    if !unsafe { bsys::is_culib_present() } {
        return Err(BackendError::device(
            "loading cuBLAS",
            dev,
            format!(
                "not found (searched {:?})",
                cudarc::get_lib_name_candidates("cublas")
            ),
        ));
    }
    let handle = blas::create_handle()
        .map(|h| Blas(h, ctx.clone()))
        .map_err(|e| {
            BackendError::device(
                "creating a cuBLAS handle",
                dev,
                format!("{e:?} (is libcublas.so.12 or .13 installed and on the library path?)"),
            )
        })?;
    // SAFETY: a live handle; the stream and workspace outlive it (dropped after it).
    unsafe {
        blas::set_stream(handle.0, compute.cu_stream() as _).map_err(|e| {
            BackendError::device("setting the cuBLAS stream", dev, format!("{e:?}"))
        })?;
        bsys::cublasSetWorkspace_v2(handle.0, ws.ptr as *mut c_void, ws.len)
            .result()
            .map_err(|e| {
                BackendError::device("setting the cuBLAS workspace", dev, format!("{e:?}"))
            })?;
    }
    Ok(handle)
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        // The fields (cuBLAS handle, pinned metadata, the device allocation) free
        // themselves after this; nothing may still be running then. Allocations that
        // outlive the backend only return their range to the (shared) bookkeeping.
        let _ = self.ctx.bind_to_thread();
        let _ = self.compute.synchronize();
        let _ = self.copy.synchronize();
    }
}

impl Backend for CudaBackend {
    type Mem = CudaMem;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn budget(&self) -> &MemBudget {
        &self.budget
    }

    fn alloc(&self, bytes: usize, what: &str) -> Result<CudaMem, BackendError> {
        carve(&self.arena, &self.budget, &self.base, bytes, what)
    }

    fn mem_len(&self, mem: &CudaMem) -> usize {
        mem.len
    }

    fn upload(&self, dst: &mut CudaMem, src: &[u8]) -> Result<(), BackendError> {
        crate::backend::check_upload(dst.len, 0, src.len())?;
        self.forget_half();
        self.ctx
            .bind_to_thread()
            .map_err(dev_err(&self.info.name, "bind"))?;
        // On the compute stream: ordered after everything enqueued so far and before
        // anything enqueued later, and done when this returns. (A synchronous copy runs on
        // the legacy NULL stream, which the non-blocking compute stream does not wait for:
        // from pageable memory its DMA could still be landing while a kernel enqueued
        // after it reads dst.)
        // SAFETY: dst has room for src (checked); src lives until the stream is
        // synchronized below.
        unsafe { result::memcpy_htod_async(dst.ptr, src, self.compute.cu_stream()) }
            .map_err(dev_err(&self.info.name, "cuMemcpyHtoDAsync"))?;
        self.compute
            .synchronize()
            .map_err(dev_err(&self.info.name, "synchronize"))
    }

    fn download_f32(&self, src: &CudaMem, offset: usize, out: &mut [f32]) {
        self.record("download", self.download(src, offset, out));
    }

    fn check(&self) -> Result<(), BackendError> {
        match self.err.lock() {
            Ok(mut e) => match e.take() {
                Some((op, cause)) => Err(BackendError::device(op, &self.info.name, cause)),
                None => Ok(()),
            },
            Err(_) => Err(BackendError::device(
                "reading the error of enqueued work",
                &self.info.name,
                "the error slot is poisoned",
            )),
        }
    }

    fn upload_begin(&self, dst: &mut CudaMem) -> Result<(), BackendError> {
        self.begin_upload(dst)
    }

    fn upload_part(
        &self,
        dst: &mut CudaMem,
        offset: usize,
        src: &[u8],
    ) -> Result<(), BackendError> {
        self.upload_slot_part(dst, offset, src)
    }

    fn upload_end(&self, dst: &mut CudaMem) -> Result<(), BackendError> {
        self.end_upload(dst)
    }

    fn upload_wait(&self, dst: &CudaMem) -> Result<(), BackendError> {
        self.wait_upload(dst)
    }

    fn release_after(&self, mem: &CudaMem) {
        self.mark_consumed(mem)
    }

    fn pinner(&self) -> Option<Pinner> {
        Some(self.pinner.clone())
    }

    fn reference_copy_gbps(&self, bytes: usize) -> Option<f64> {
        self.plain_h2d_gbps(bytes, 5).ok()
    }

    fn copy_stats(&self) -> CopyStats {
        self.copies.lock().map(|c| *c).unwrap_or_default()
    }

    fn embedding(&self, table: WeightRef<'_, CudaMem>, ids: &[u32], out: &mut CudaMem) {
        let r = (|| -> Result<(), String> {
            let cols = table.cols;
            if out.len < ids.len() * cols * 4 {
                return Err("output too small".into());
            }
            if let Some(&bad) = ids.iter().find(|&&i| i as usize >= table.rows) {
                return Err(format!(
                    "token id {bad} past the {} embedding rows",
                    table.rows
                ));
            }
            self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
            let ids_dev = self.meta(MetaKind::Ids, ids)?;
            let dims = Dims {
                grid: (ids.len() as u32, 1, 1),
                block: 256,
                smem: 0,
            };
            self.kernels.embedding(
                &self.compute,
                Kernel::embedding(table.dtype),
                dims,
                table.mem.ptr + table.offset as u64,
                ids_dev,
                out.ptr,
                cols as i32,
            )
        })();
        self.record("embedding", r);
    }

    fn rms_norm(
        &self,
        x: &CudaMem,
        w: WeightRef<'_, CudaMem>,
        eps: f32,
        rows: usize,
        out: &mut CudaMem,
    ) {
        let r = (|| -> Result<(), String> {
            let cols = w.rows * w.cols;
            if x.len < rows * cols * 4 || out.len < rows * cols * 4 {
                return Err("shapes".into());
            }
            let Some(kernel) = Kernel::rms_norm(w.dtype) else {
                return Err(format!("a {:?} norm weight", w.dtype));
            };
            self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
            let dims = Dims {
                grid: (rows as u32, 1, 1),
                block: (cols.div_ceil(4).div_ceil(32) * 32).clamp(32, 1024) as u32,
                smem: 0,
            };
            self.kernels.rms_norm(
                &self.compute,
                kernel,
                dims,
                x.ptr,
                w.mem.ptr + w.offset as u64,
                out.ptr,
                cols as i32,
                eps,
            )
        })();
        self.record("rms_norm", r);
    }

    fn matmul(
        &self,
        x: &CudaMem,
        rows: usize,
        gemv_rows: usize,
        w: WeightRef<'_, CudaMem>,
        bias: Option<WeightRef<'_, CudaMem>>,
        out: &mut CudaMem,
    ) {
        let r = self
            .ctx
            .bind_to_thread()
            .map_err(|e| e.to_string())
            .and_then(|_| self.matmul_inner(x, rows, gemv_rows, w, bias, out));
        self.record("matmul", r);
    }

    fn rope(
        &self,
        x: &mut CudaMem,
        rows: usize,
        heads: usize,
        head_dim: usize,
        positions: &[u32],
        table: &CudaMem,
    ) {
        let r = (|| -> Result<(), String> {
            if x.len < rows * heads * head_dim * 4 || positions.len() < rows {
                return Err("shapes".into());
            }
            let half = head_dim / 2;
            if let Some(&bad) = positions[..rows]
                .iter()
                .find(|&&q| (q as usize + 1) * half * 2 * 4 > table.len)
            {
                return Err(format!("position {bad} past the rotary table"));
            }
            self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
            let pos = self.meta(MetaKind::Pos, &positions[..rows])?;
            let dims = Dims {
                grid: (rows as u32, heads as u32, 1),
                block: half.max(1) as u32,
                smem: 0,
            };
            self.kernels.rope(
                &self.compute,
                Kernel::RopeF32,
                dims,
                x.ptr,
                table.ptr,
                pos,
                heads as i32,
                head_dim as i32,
            )
        })();
        self.record("rope", r);
    }

    fn kv_store(
        &self,
        k: &CudaMem,
        v: &CudaMem,
        cache_k: &mut CudaMem,
        cache_v: &mut CudaMem,
        step: &AttnStep<'_>,
    ) {
        let r = (|| -> Result<(), String> {
            let sh = step.shape;
            let kvb = sh.kv.bytes() as u64;
            let end = (step.cache.base + step.cache.elems(&sh)) as u64 * kvb;
            if end > cache_k.len as u64 || cache_v.len != cache_k.len {
                return Err(format!("layer {} outside the KV cache", step.layer));
            }
            self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
            let rows: usize = step.spans.iter().map(|s| s.n).sum();
            let width = sh.kv_heads * sh.head_dim;
            if k.len < rows * width * 4 || v.len < rows * width * 4 {
                return Err("shapes".into());
            }
            let kv = self.spans_meta(step)?.kv_dst;
            let off = step.cache.base as u64 * kvb;
            let dims = Dims {
                grid: (rows as u32, 1, 1),
                block: 256,
                smem: 0,
            };
            let (ck, cv) = (cache_k.ptr + off, cache_v.ptr + off);
            match sh.kv {
                KvDtype::F32 => self.kernels.kv_store(
                    &self.compute,
                    Kernel::KvStoreF32,
                    dims,
                    k.ptr,
                    v.ptr,
                    ck,
                    cv,
                    kv,
                    width as i32,
                ),
                KvDtype::F16 => self.kernels.kv_store_h(
                    &self.compute,
                    Kernel::KvStoreF16,
                    dims,
                    k.ptr,
                    v.ptr,
                    ck,
                    cv,
                    kv,
                    width as i32,
                ),
            }
        })();
        self.record("kv_store", r);
    }

    fn kv_move(
        &self,
        cache_k: &mut CudaMem,
        cache_v: &mut CudaMem,
        step: &AttnStep<'_>,
        slot: usize,
        moves: &[(u32, u32)],
    ) {
        let r = self.move_kv((cache_k, cache_v), step, slot, moves);
        self.record("kv_move", r);
    }

    fn kv_copy(
        &self,
        cache_k: &mut CudaMem,
        cache_v: &mut CudaMem,
        place: (&AttnShape, &LayerCache),
        slots: (usize, usize),
        positions: std::ops::Range<usize>,
    ) {
        let r = self.copy_kv((cache_k, cache_v), place, slots, positions);
        self.record("kv_copy", r);
    }

    fn kv_read(&self, cache: &CudaMem, offset: usize, out: &mut [u8]) {
        self.record("kv_read", self.read_kv(cache, offset, out));
    }

    fn kv_write(&self, cache: &mut CudaMem, offset: usize, src: &[u8]) {
        self.record("kv_write", self.write_kv(cache, offset, src));
    }

    fn attention(
        &self,
        q: &CudaMem,
        cache_k: &CudaMem,
        cache_v: &CudaMem,
        step: &AttnStep<'_>,
        sinks: Option<WeightRef<'_, CudaMem>>,
        out: &mut CudaMem,
    ) {
        let r = self.attend(q, (cache_k, cache_v), step, sinks, out);
        self.record("attention", r);
    }

    fn silu_mul(&self, gate: &mut CudaMem, up: &CudaMem, n: usize) {
        let r = self.elementwise(Kernel::SiluMulF32, gate, up, n);
        self.record("silu_mul", r);
    }

    fn gelu_mul(&self, gate: &mut CudaMem, up: &CudaMem, n: usize) {
        let r = self.elementwise(Kernel::GeluMulF32, gate, up, n);
        self.record("gelu_mul", r);
    }

    fn swiglu_clamp_mul(&self, gate: &mut CudaMem, up: &CudaMem, n: usize, alpha: f32, limit: f32) {
        let r = (|| -> Result<(), String> {
            if gate.len < n * 4 || up.len < n * 4 {
                return Err(format!(
                    "{n} elements past allocations of {} and {} bytes",
                    gate.len, up.len
                ));
            }
            if n == 0 {
                return Ok(());
            }
            self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
            self.kernels.swiglu_clamp(
                &self.compute,
                Kernel::SwigluClampMulF32,
                Dims::per_element(n as u64),
                gate.ptr,
                up.ptr,
                n as i32,
                alpha,
                limit,
            )
        })();
        self.record("swiglu_clamp_mul", r);
    }

    fn scale(&self, x: &mut CudaMem, s: f32, n: usize) {
        let r = (|| -> Result<(), String> {
            if x.len < n * 4 {
                return Err(format!(
                    "{n} elements past an allocation of {} bytes",
                    x.len
                ));
            }
            self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
            let dims = Dims::per_element(n as u64);
            self.kernels
                .scale(&self.compute, Kernel::ScaleF32, dims, x.ptr, s, n as i32)
        })();
        self.record("scale", r);
    }

    fn add(&self, x: &mut CudaMem, y: &CudaMem, n: usize) {
        let r = self.elementwise(Kernel::AddF32, x, y, n);
        self.record("add", r);
    }

    fn gather_rows(&self, src: &CudaMem, rows: &[u32], cols: usize, dst: &mut CudaMem) {
        let r = (|| -> Result<(), String> {
            let top = rows.iter().max().map_or(0, |&r| r as usize + 1);
            if top * cols * 4 > src.len || rows.len() * cols * 4 > dst.len {
                return Err("rows outside the allocations".into());
            }
            if rows.is_empty() || cols == 0 {
                return Ok(());
            }
            self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
            let (rows_dev, _) = self.expert_meta(rows, None)?;
            self.kernels.gather_rows(
                &self.compute,
                Kernel::GatherRowsF32,
                Dims::per_row(rows.len()),
                src.ptr,
                rows_dev,
                dst.ptr,
                cols as i32,
            )
        })();
        self.record("gather_rows", r);
    }

    fn scatter_add_rows(
        &self,
        src: &CudaMem,
        rows: &[u32],
        weights: &[f32],
        cols: usize,
        dst: &mut CudaMem,
    ) {
        let r = (|| -> Result<(), String> {
            let top = rows.iter().max().map_or(0, |&r| r as usize + 1);
            if weights.len() != rows.len()
                || rows.len() * cols * 4 > src.len
                || top * cols * 4 > dst.len
            {
                return Err("rows outside the allocations".into());
            }
            if rows.is_empty() || cols == 0 {
                return Ok(());
            }
            self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
            let (rows_dev, weights_dev) = self.expert_meta(rows, Some(weights))?;
            self.kernels.scatter_add_rows(
                &self.compute,
                Kernel::ScatterAddRowsF32,
                Dims::per_row(rows.len()),
                src.ptr,
                rows_dev,
                weights_dev,
                dst.ptr,
                cols as i32,
            )
        })();
        self.record("scatter_add_rows", r);
    }

    fn experts(
        &self,
        x: &CudaMem,
        shape: ExpertShape,
        calls: &[ExpertCall<'_, CudaMem>],
        mut scratch: ExpertScratch<'_, CudaMem>,
        out: &mut CudaMem,
    ) {
        match self.experts_grouped(x, shape, calls, &mut scratch, out) {
            Ok(true) => {}
            Ok(false) => experts_each(self, x, shape, calls, scratch, out),
            Err(e) => self.record("experts", Err(e)),
        }
    }

    fn route_top_k(
        &self,
        logits: &CudaMem,
        shape: (usize, usize, usize),
        gating: RouteGating,
        chosen: &mut Vec<(u32, f32)>,
    ) -> bool {
        match self.route_on_device(logits, shape, gating, chosen) {
            Ok(done) => done,
            Err(e) => {
                // Routed on the host instead; the step fails at `check` with the cause.
                chosen.clear();
                self.record("route_top_k", Err(e));
                false
            }
        }
    }

    fn zero(&self, x: &mut CudaMem, n: usize) {
        let r = (|| -> Result<(), String> {
            if n * 4 > x.len {
                return Err(format!(
                    "{n} elements past an allocation of {} bytes",
                    x.len
                ));
            }
            self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
            // SAFETY: the range is inside the allocation (checked); all-zero bytes are 0.0f.
            unsafe { result::memset_d8_async(x.ptr, 0, n * 4, self.compute.cu_stream()) }
                .map_err(|e| e.to_string())
        })();
        self.record("zero", r);
    }

    fn copy_row(
        &self,
        src: &CudaMem,
        src_row: usize,
        dst: &mut CudaMem,
        dst_row: usize,
        cols: usize,
    ) {
        let r = (|| -> Result<(), String> {
            let bytes = cols * 4;
            if (src_row + 1) * bytes > src.len || (dst_row + 1) * bytes > dst.len {
                return Err("rows outside the allocations".into());
            }
            self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
            // SAFETY: both ranges are inside their allocations (checked).
            unsafe {
                result::memcpy_dtod_async(
                    dst.ptr + (dst_row * bytes) as u64,
                    src.ptr + (src_row * bytes) as u64,
                    bytes,
                    self.compute.cu_stream(),
                )
            }
            .map_err(|e| e.to_string())
        })();
        self.record("copy_row", r);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launches(
        splits: &[usize],
        record: u64,
        cap: u64,
    ) -> Result<Vec<(usize, usize, usize)>, String> {
        let mut out = Vec::new();
        attention_launches(splits, record, cap, |r0, r1, s| {
            out.push((r0, r1, s));
            Ok(())
        })?;
        Ok(out)
    }

    #[test]
    fn attention_launches_keep_each_launch_s_partials_within_the_scratch() {
        // Rows of 1, 3, 1, 2 and 1 splits; a record of 100 bytes; 400 bytes of scratch.
        let l = launches(&[1, 3, 1, 2, 1], 100, 400).unwrap();
        assert_eq!(l, vec![(0, 1, 1), (1, 2, 3), (2, 4, 2), (4, 5, 1)]);
        for &(r0, r1, s) in &l {
            assert!(((r1 - r0) * s) as u64 * 100 <= 400);
        }
        // Everything in one launch when it fits.
        assert_eq!(launches(&[2, 2, 2], 10, 1000).unwrap(), vec![(0, 3, 2)]);
        assert!(launches(&[], 10, 1000).unwrap().is_empty());
        // A row whose own splits do not fit is an error naming the sizes, before any
        // launch.
        let e = launches(&[1, 9], 100, 400).unwrap_err();
        assert!(e.contains("9 attention splits") && e.contains("900"), "{e}");
        let mut any = false;
        let _ = attention_launches(&[9, 1], 100, 400, |_, _, _| {
            any = true;
            Ok(())
        });
        assert!(!any, "a row that cannot fit launches nothing before it");
        // A launch's error stops the rest.
        let mut calls = 0;
        let e = attention_launches(&[3, 3, 3], 100, 400, |_, _, _| {
            calls += 1;
            Err("launch failed".into())
        });
        assert_eq!((e, calls), (Err("launch failed".to_string()), 1));
    }
}
