//! The CUDA backend (DESIGN.md "Backends"): one context on one device, a compute stream
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
use super::{DeviceInfo, KERNELS};
use crate::backend::{
    AttnStep, Backend, BackendError, CopyStats, MemBudget, ScratchShape, SeqSpan, WeightRef,
};
use crate::dtype::DType;
use crate::hostbuf::{HostPinner, Pinner};
use cudarc::cublas::{result as blas, sys as bsys};
use cudarc::driver::{result, sys, CudaContext, CudaEvent, CudaFunction, CudaStream};
use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// Rows of a quantized weight dequantized per cuBLAS call are bounded by this tile.
const TILE_BYTES_MAX: u64 = 64 << 20;
/// cuBLAS workspace (NVIDIA recommends 32 MiB on Hopper), carved from the arena so that
/// cuBLAS allocates nothing while running.
const BLAS_WORKSPACE: u64 = 32 << 20;

/// Device memory the backend keeps for itself for this model and these limits: kernel
/// metadata (token ids, positions, KV offsets), f16/bf16 copies of prefill activations,
/// the dequantization tile and bias buffer of the cuBLAS path, and cuBLAS's workspace. The
/// memory plan counts it before anything else.
pub fn scratch_bytes(shape: &ScratchShape) -> u64 {
    let l = Layout::new(shape);
    l.meta + l.half + l.tile + l.bias + BLAS_WORKSPACE
}

struct Layout {
    rows: u64,
    meta: u64,
    half: u64,
    tile: u64,
    bias: u64,
}

impl Layout {
    fn new(shape: &ScratchShape) -> Layout {
        let r = |b: u64| b.div_ceil(4096) * 4096;
        let rows = shape.rows;
        let (h, q, i, v) = (shape.hidden, shape.q_dim, shape.intermediate, shape.vocab);
        let kmax = h.max(q).max(i);
        let widest = v.max(i).max(q).max(h);
        Layout {
            rows,
            // ids u32, positions u32, KV destinations u64, cache bases u64 per row.
            meta: r(rows * 24),
            half: r(rows * kmax * 2),
            tile: r((widest * kmax * 4).min(TILE_BYTES_MAX).max(kmax * 4 * 32)),
            bias: r(widest * 4),
        }
    }
}

/// The driver library is loadable (cudarc panics on first use when it is not).
pub fn driver_present() -> bool {
    // SAFETY: only tries to open the library.
    unsafe { sys::is_culib_present() }
}

/// Whether a CUDA device can be used, and what it is; the error says why not.
pub fn probe(ordinal: usize) -> Result<DeviceInfo, String> {
    if !driver_present() {
        return Err(
            "no NVIDIA driver library (libcuda.so.1) could be loaded: no driver installed, or not visible in this container".into(),
        );
    }
    result::init().map_err(|e| format!("CUDA driver initialisation failed: {e}"))?;
    let count = result::device::get_count().map_err(|e| format!("counting CUDA devices: {e}"))?;
    if count <= 0 {
        return Err("the NVIDIA driver reports no CUDA device".into());
    }
    if ordinal >= count as usize {
        return Err(format!(
            "CUDA device {ordinal} does not exist ({count} present)"
        ));
    }
    let ctx =
        CudaContext::new(ordinal).map_err(|e| format!("CUDA context on device {ordinal}: {e}"))?;
    info_of(&ctx)
}

fn info_of(ctx: &Arc<CudaContext>) -> Result<DeviceInfo, String> {
    let e = |what: &str, e: result::DriverError| format!("{what}: {e}");
    let (major, minor) = ctx
        .compute_capability()
        .map_err(|x| e("compute capability", x))?;
    let (free, total) = ctx.mem_get_info().map_err(|x| e("memory info", x))?;
    let mut driver = 0;
    // SAFETY: the driver is initialised (a context exists); writes one int.
    unsafe { sys::cuDriverGetVersion(&mut driver) };
    let smem = ctx
        .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .map_err(|x| e("shared memory limit", x))?;
    Ok(DeviceInfo {
        ordinal: ctx.ordinal(),
        name: ctx.name().unwrap_or_else(|_| "unknown".into()),
        compute_capability: (major, minor),
        total_bytes: total as u64,
        free_bytes: free as u64,
        driver_version: driver,
        max_shared_per_block: smem.max(0) as usize,
    })
}

/// A device allocation: a range of the backend's arena.
pub struct CudaMem {
    ptr: u64,
    off: usize,
    len: usize,
    arena: Arc<Mutex<Arena>>,
    budget: Arc<MemBudget>,
    /// Events of a streaming slot (made at its first asynchronous upload).
    ev: Option<SlotEvents>,
}

struct SlotEvents {
    end: CudaEvent,
    consumed: CudaEvent,
    /// Start and end of each part of the upload in flight (the copy's own time, without
    /// the gaps while the host waits for frames); made as needed, reused every upload.
    parts: Vec<(CudaEvent, CudaEvent)>,
    /// Parts of the upload in flight.
    used: Cell<usize>,
    /// An upload was enqueued and `upload_wait` has not seen it finish.
    pending: Cell<bool>,
    bytes: Cell<u64>,
}

impl CudaMem {
    /// The device address (for tests that compare backends).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }
}

impl Drop for CudaMem {
    fn drop(&mut self) {
        if let Ok(mut a) = self.arena.lock() {
            a.free(self.off, self.len);
        }
        self.budget.release(Arena::rounded(self.len) as u64);
    }
}

/// Registers host buffers with the driver (cuMemHostRegister): page-locked, mapped for
/// DMA, so copies from them run at the bus's speed and truly asynchronously.
struct CudaPinner {
    ctx: Arc<CudaContext>,
}

impl HostPinner for CudaPinner {
    fn pin(&self, ptr: *mut u8, len: usize) -> Result<(), String> {
        self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        // SAFETY: ptr..ptr+len is a live page-aligned allocation the caller keeps until unpin.
        let r = unsafe {
            sys::cuMemHostRegister_v2(ptr as *mut c_void, len, sys::CU_MEMHOSTREGISTER_PORTABLE)
        };
        r.result().map_err(|e| format!("cuMemHostRegister: {e}"))
    }

    fn unpin(&self, ptr: *mut u8) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: ptr was registered by pin and is still mapped.
            let _ = unsafe { sys::cuMemHostUnregister(ptr as *mut c_void) };
        }
    }
}

/// A cuBLAS handle, destroyed when dropped.
struct Blas(bsys::cublasHandle_t, Arc<CudaContext>);
// SAFETY: the handle is only used under the backend's mutex.
unsafe impl Send for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        let _ = self.1.bind_to_thread();
        // SAFETY: a live handle; the backend synchronized its streams before its fields drop.
        let _ = unsafe { blas::destroy_handle(self.0) };
    }
}

/// The one device allocation, freed when dropped.
struct DeviceAlloc {
    ptr: u64,
    ctx: Arc<CudaContext>,
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by malloc_sync; no work uses it (streams synchronized first).
        let _ = unsafe { result::free_sync(self.ptr) };
    }
}

/// Page-locked host memory from cuMemHostAlloc, freed when dropped.
struct PinnedHost {
    ptr: *mut c_void,
    ctx: Arc<CudaContext>,
}

impl Drop for PinnedHost {
    fn drop(&mut self) {
        let _ = self.ctx.bind_to_thread();
        // SAFETY: allocated by malloc_host; no copy reads it (streams synchronized first).
        let _ = unsafe { result::free_host(self.ptr) };
    }
}

/// Step metadata on the device and the host copies it was made from, so it is uploaded
/// once per step, not once per layer.
struct Meta {
    host: PinnedHost,
    /// Per kind: the bytes the device holds (None before the first upload).
    held: [Option<Vec<u8>>; 4],
    /// Per kind: recorded after the last copy out of its part of `host`.
    copied: [CudaEvent; 4],
}
// SAFETY: `host` is a pinned allocation owned by the backend, used under its mutex.
unsafe impl Send for Meta {}

#[derive(Clone, Copy)]
enum MetaKind {
    Ids,
    Pos,
    Kv,
    Base,
}

pub struct CudaBackend {
    ctx: Arc<CudaContext>,
    compute: Arc<CudaStream>,
    copy: Arc<CudaStream>,
    funcs: HashMap<String, CudaFunction>,
    blas: Mutex<Blas>,
    arena: Arc<Mutex<Arena>>,
    base: DeviceAlloc,
    budget: Arc<MemBudget>,
    layout: Layout,
    meta_dev: CudaMem,
    half: CudaMem,
    tile: CudaMem,
    bias: CudaMem,
    _blas_ws: CudaMem,
    meta: Mutex<Meta>,
    err: Mutex<Option<String>>,
    copies: Mutex<CopyStats>,
    info: DeviceInfo,
    /// Dynamic shared memory the attention kernel may use (its scores: one f32 per position).
    attn_smem: usize,
    pinner: Pinner,
}

// SAFETY: the raw pointers inside (arena base, pinned metadata) are owned by the backend;
// mutable state is behind mutexes, and the driver API is thread-safe for one context.
unsafe impl Send for CudaBackend {}
unsafe impl Sync for CudaBackend {}

fn dev_err(what: &str) -> impl Fn(result::DriverError) -> BackendError + '_ {
    move |e| BackendError::Device(format!("{what}: {e}"))
}

impl CudaBackend {
    /// Opens device `ordinal`, makes one device allocation of `arena_bytes` (the plan's
    /// device total, backend scratch included), loads the kernels and sets up cuBLAS.
    pub fn new(
        ordinal: usize,
        arena_bytes: u64,
        shape: &ScratchShape,
    ) -> Result<CudaBackend, BackendError> {
        if !driver_present() {
            return Err(BackendError::Device(
                "no NVIDIA driver library (libcuda.so.1) could be loaded".into(),
            ));
        }
        let ctx = CudaContext::new(ordinal).map_err(dev_err("CUDA context"))?;
        let info = info_of(&ctx).map_err(BackendError::Device)?;
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
        let attn_need = shape.max_context * 4;
        let compute = ctx.new_stream().map_err(dev_err("compute stream"))?;
        let copy = ctx.new_stream().map_err(dev_err("copy stream"))?;
        let funcs = load_kernels(&ctx, &info)?;
        let attn = funcs
            .get("attention_f32")
            .ok_or_else(|| BackendError::Device("kernel attention_f32 is not loaded".into()))?;
        let static_smem = attn.shared_size_bytes().unwrap_or(0).max(0) as usize;
        let attn_smem = info.max_shared_per_block.saturating_sub(static_smem);
        if attn_need > attn_smem {
            return Err(BackendError::Invalid(format!(
                "a context of {} positions needs {attn_need} bytes of shared memory per attention block for its scores; {} allows {attn_smem}: lower --max-context",
                shape.max_context, info.name
            )));
        }
        attn.set_attribute(
            sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            attn_smem as i32,
        )
        .map_err(dev_err("attention shared memory"))?;
        // SAFETY: a plain device allocation, owned (and freed) by the guard.
        let base = DeviceAlloc {
            ptr: unsafe { result::malloc_sync(arena_bytes.max(1) as usize) }.map_err(|e| {
                BackendError::Device(format!(
                    "allocating {arena_bytes} bytes on {}: {e}",
                    info.name
                ))
            })?,
            ctx: ctx.clone(),
        };
        let arena = Arc::new(Mutex::new(Arena::new(arena_bytes as usize)));
        let budget = Arc::new(MemBudget::new(arena_bytes));
        let carve = |bytes: u64, what: &str| -> Result<CudaMem, BackendError> {
            carve(&arena, &budget, base.ptr, bytes as usize, what)
        };
        let meta_dev = carve(layout.meta, "kernel metadata")?;
        let half = carve(layout.half, "half-precision activations")?;
        let tile = carve(layout.tile, "dequantization tile")?;
        let bias = carve(layout.bias, "bias")?;
        let blas_ws = carve(BLAS_WORKSPACE, "cuBLAS workspace")?;
        // SAFETY: only tries to open the library (cudarc panics on first use without it).
        if !unsafe { bsys::is_culib_present() } {
            return Err(BackendError::Device(format!(
                "cuBLAS could not be loaded (searched {:?})",
                cudarc::get_lib_name_candidates("cublas")
            )));
        }
        let handle = blas::create_handle()
            .map(|h| Blas(h, ctx.clone()))
            .map_err(|e| {
                BackendError::Device(format!(
                    "cuBLAS: {e:?} (is libcublas.so.12 or .13 installed and on the library path?)"
                ))
            })?;
        // SAFETY: a live handle; the stream and workspace outlive it (dropped after it).
        unsafe {
            blas::set_stream(handle.0, compute.cu_stream() as _)
                .map_err(|e| BackendError::Device(format!("cuBLAS stream: {e:?}")))?;
            bsys::cublasSetWorkspace_v2(handle.0, blas_ws.ptr as *mut c_void, blas_ws.len)
                .result()
                .map_err(|e| BackendError::Device(format!("cuBLAS workspace: {e:?}")))?;
        }
        // SAFETY: pinned host memory for the metadata, owned (and freed) by the guard.
        let host = PinnedHost {
            ptr: unsafe { result::malloc_host(layout.meta as usize, 0) }
                .map_err(dev_err("pinned metadata"))?,
            ctx: ctx.clone(),
        };
        let ev = || {
            ctx.new_event(Some(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING))
                .map_err(dev_err("event"))
        };
        let copied = [ev()?, ev()?, ev()?, ev()?];
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
            funcs,
            blas: Mutex::new(handle),
            arena,
            base,
            budget,
            layout,
            meta_dev,
            half,
            tile,
            bias,
            _blas_ws: blas_ws,
            meta: Mutex::new(Meta {
                host,
                held: [None, None, None, None],
                copied,
            }),
            err: Mutex::new(None),
            copies: Mutex::new(CopyStats::default()),
            info,
            attn_smem,
        })
    }

    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// A plain page-locked cuMemcpyHtoD of `bytes` (the reference the copy stream's
    /// bandwidth is compared with): median GB/s of `reps` copies.
    pub fn plain_h2d_gbps(&self, bytes: usize, reps: usize) -> Result<f64, BackendError> {
        self.ctx.bind_to_thread().map_err(dev_err("bind"))?;
        // SAFETY: pinned host and device buffers of `bytes`, owned (and freed) by the guards.
        let host = PinnedHost {
            ptr: unsafe { result::malloc_host(bytes, 0) }.map_err(dev_err("pinned buffer"))?,
            ctx: self.ctx.clone(),
        };
        let dev = DeviceAlloc {
            ptr: unsafe { result::malloc_sync(bytes) }.map_err(dev_err("device buffer"))?,
            ctx: self.ctx.clone(),
        };
        // SAFETY: host is `bytes` long; touching it first keeps page faults out of the timing.
        let src = unsafe { std::slice::from_raw_parts_mut(host.ptr as *mut u8, bytes) };
        src.fill(1);
        let mut rates = Vec::with_capacity(reps + 1);
        for _ in 0..reps.max(1) + 1 {
            let t = std::time::Instant::now();
            // SAFETY: dev and src are both `bytes` long; the copy is synchronous.
            unsafe { result::memcpy_htod_sync(dev.ptr, &src[..]) }
                .map_err(dev_err("cuMemcpyHtoD"))?;
            rates.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
        rates.remove(0); // the first copy warms the mapping
        rates.sort_by(|a, b| a.total_cmp(b));
        Ok(rates[rates.len() / 2])
    }

    fn record(&self, what: &str, r: Result<(), String>) {
        if let Err(e) = r {
            if let Ok(mut slot) = self.err.lock() {
                if slot.is_none() {
                    *slot = Some(format!("{what}: {e}"));
                }
            }
        }
    }

    fn func(&self, name: &str) -> Result<&CudaFunction, String> {
        self.funcs
            .get(name)
            .ok_or_else(|| format!("kernel {name} is not loaded"))
    }

    /// Launches `name` on the compute stream. `args` point at the argument values.
    fn launch(
        &self,
        name: &str,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        args: &mut [*mut c_void],
    ) -> Result<(), String> {
        let f = self.func(name)?;
        // SAFETY: the kernel's parameters are exactly `args` (checked by each caller against
        // the kernel source), every pointer argument is inside the arena, and the values
        // live until the launch returns (the driver copies them).
        unsafe {
            result::launch_kernel(
                f.cu_function(),
                grid,
                (block, 1, 1),
                smem,
                self.compute.cu_stream(),
                args,
            )
        }
        .map_err(|e| format!("launching {name}: {e}"))
    }

    /// Uploads one metadata array when it differs from what the device holds; returns its
    /// device address.
    fn meta<T: Copy>(&self, kind: MetaKind, data: &[T]) -> Result<u64, String> {
        let rows = self.layout.rows as usize;
        if data.len() > rows {
            return Err(format!(
                "{} rows in a step; the backend was sized for {rows}",
                data.len()
            ));
        }
        let (off, size) = match kind {
            MetaKind::Ids => (0, 4),
            MetaKind::Pos => (rows * 4, 4),
            MetaKind::Kv => (rows * 8, 8),
            MetaKind::Base => (rows * 16, 8),
        };
        if std::mem::size_of::<T>() != size {
            return Err(format!(
                "metadata of {} bytes per row, expected {size}",
                std::mem::size_of::<T>()
            ));
        }
        let mut m = self.meta.lock().map_err(|_| "metadata lock poisoned")?;
        // SAFETY: u32 and u64 arrays viewed as their bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data))
        };
        let same = m.held[kind as usize].as_deref() == Some(bytes);
        let dev = self.meta_dev.ptr + off as u64;
        if same {
            return Ok(dev);
        }
        // The previous copy out of the pinned buffer must be done before it is rewritten.
        m.copied[kind as usize]
            .synchronize()
            .map_err(|e| e.to_string())?;
        // SAFETY: host holds layout.meta bytes; off + bytes.len() <= rows * 24 by the check.
        let host = unsafe {
            std::slice::from_raw_parts_mut((m.host.ptr as *mut u8).add(off), bytes.len())
        };
        host.copy_from_slice(bytes);
        // SAFETY: dev..dev+len is inside the metadata allocation; host is pinned and is not
        // written again before `copied` completes.
        unsafe { result::memcpy_htod_async(dev, &host[..], self.compute.cu_stream()) }
            .map_err(|e| e.to_string())?;
        m.copied[kind as usize]
            .record(&self.compute)
            .map_err(|e| e.to_string())?;
        m.held[kind as usize] = Some(bytes.to_vec());
        Ok(dev)
    }

    fn matmul_inner(
        &self,
        x: &CudaMem,
        rows: usize,
        g: usize,
        w: WeightRef<'_, CudaMem>,
        bias: Option<WeightRef<'_, CudaMem>>,
        out: &mut CudaMem,
    ) -> Result<(), String> {
        let (m, k) = (w.rows, w.cols);
        if x.len < rows * k * 4 || out.len < rows * m * 4 || g > rows {
            return Err(format!(
                "shapes: x {} bytes, out {} bytes for [{rows}, {k}] x [{m}, {k}]^T",
                x.len, out.len
            ));
        }
        let rb = w.dtype.row_bytes(k as u64).ok_or("row size")? as usize;
        let wptr = w.mem.ptr + w.offset as u64;
        if w.offset + rb * m > w.mem.len {
            return Err(format!("weight of {} bytes past its allocation", rb * m));
        }
        let (mi, ki) = (m as i32, k as i32);
        if g > 0 {
            // Decode rows: one warp per weight row, dequantized in registers; a row's result
            // never depends on the other rows.
            let name = format!("gemv_{}", w.dtype.name());
            let (mut a0, mut a1, mut a2) = (wptr, x.ptr, out.ptr);
            let (mut a3, mut a4) = (mi, ki);
            self.launch(
                &name,
                (m.div_ceil(4) as u32, g as u32, 1),
                128,
                0,
                &mut [p(&mut a0), p(&mut a1), p(&mut a2), p(&mut a3), p(&mut a4)],
            )?;
        }
        let t = rows - g;
        if t > 0 {
            let xp = x.ptr + (g * k * 4) as u64;
            let op = out.ptr + (g * m * 4) as u64;
            let blas_h = self.blas.lock().map_err(|_| "cuBLAS lock poisoned")?;
            match w.dtype {
                DType::F32 => sgemm(blas_h.0, m, t, k, wptr, xp, op, m)?,
                DType::F16 | DType::BF16 => {
                    if (t * k * 2) as u64 > self.layout.half {
                        return Err(format!(
                            "{t} prefill rows exceed the half-precision scratch"
                        ));
                    }
                    let (conv, ty) = if w.dtype == DType::F16 {
                        ("f32_to_f16", bsys::cudaDataType::CUDA_R_16F)
                    } else {
                        ("f32_to_bf16", bsys::cudaDataType::CUDA_R_16BF)
                    };
                    let n = (t * k) as u64;
                    let (mut a0, mut a1, mut a2) = (xp, self.half.ptr, n);
                    self.launch(
                        conv,
                        (n.div_ceil(256) as u32, 1, 1),
                        256,
                        0,
                        &mut [p(&mut a0), p(&mut a1), p(&mut a2)],
                    )?;
                    let (alpha, beta) = (1f32, 0f32);
                    // out^T[m, t] = W[m, k] . X^T[k, t] in cuBLAS's column-major terms:
                    // W row-major is W^T column-major (ld k), X row-major is X^T (ld k).
                    // SAFETY: pointers inside the arena with the sizes checked above.
                    unsafe {
                        blas::gemm_ex(
                            blas_h.0,
                            bsys::cublasOperation_t::CUBLAS_OP_T,
                            bsys::cublasOperation_t::CUBLAS_OP_N,
                            mi,
                            t as i32,
                            ki,
                            &alpha as *const f32 as *const c_void,
                            wptr as *const c_void,
                            ty,
                            ki,
                            self.half.ptr as *const c_void,
                            ty,
                            ki,
                            &beta as *const f32 as *const c_void,
                            op as *mut c_void,
                            bsys::cudaDataType::CUDA_R_32F,
                            mi,
                            bsys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                            bsys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                        )
                    }
                    .map_err(|e| format!("cublasGemmEx: {e:?}"))?;
                }
                DType::Q8_0 | DType::Q4_0 | DType::Q4_1 => {
                    // Quantized: dequantize a tile of weight rows to f32, then sgemm it.
                    let tile_rows = (self.layout.tile as usize / (k * 4)).max(1).min(m);
                    let name = format!("dequant_{}", w.dtype.name());
                    let mut j0 = 0;
                    while j0 < m {
                        let nb = tile_rows.min(m - j0);
                        let n = (nb * k) as u64;
                        let (mut a0, mut a1, mut a2) = (wptr + (j0 * rb) as u64, self.tile.ptr, n);
                        self.launch(
                            &name,
                            (n.div_ceil(256) as u32, 1, 1),
                            256,
                            0,
                            &mut [p(&mut a0), p(&mut a1), p(&mut a2)],
                        )?;
                        sgemm(
                            blas_h.0,
                            nb,
                            t,
                            k,
                            self.tile.ptr,
                            xp,
                            op + (j0 * 4) as u64,
                            m,
                        )?;
                        j0 += nb;
                    }
                }
            }
        }
        if let Some(b) = bias {
            let n = b.rows * b.cols;
            if n != m {
                return Err(format!("bias of {n} values for {m} outputs"));
            }
            let bptr = match b.dtype {
                DType::F32 => b.mem.ptr + b.offset as u64,
                DType::F16 | DType::BF16 => {
                    let (mut a0, mut a1, mut a2) =
                        (b.mem.ptr + b.offset as u64, self.bias.ptr, n as u64);
                    self.launch(
                        &format!("dequant_{}", b.dtype.name()),
                        ((n as u64).div_ceil(256) as u32, 1, 1),
                        256,
                        0,
                        &mut [p(&mut a0), p(&mut a1), p(&mut a2)],
                    )?;
                    self.bias.ptr
                }
                d => return Err(format!("a {d:?} bias")),
            };
            let (mut a0, mut a1, mut a2, mut a3) = (out.ptr, bptr, rows as i32, mi);
            self.launch(
                "add_bias_f32",
                ((rows * m).div_ceil(256) as u32, 1, 1),
                256,
                0,
                &mut [p(&mut a0), p(&mut a1), p(&mut a2), p(&mut a3)],
            )?;
        }
        Ok(())
    }

    /// `name(x, y, n)`: an elementwise kernel that updates x from y.
    fn elementwise(
        &self,
        name: &str,
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
        let (mut a0, mut a1, mut a2) = (x.ptr, y.ptr, n as i32);
        self.launch(
            name,
            (n.div_ceil(256) as u32, 1, 1),
            256,
            0,
            &mut [p(&mut a0), p(&mut a1), p(&mut a2)],
        )
    }

    fn spans_meta(&self, step: &AttnStep<'_>) -> Result<(u64, u64, u64, usize), String> {
        let sh = step.shape;
        let width = (sh.kv_heads * sh.head_dim) as u64;
        let rows: usize = step.spans.iter().map(|s| s.n).sum();
        let mut pos = vec![0u32; rows];
        let mut kv = vec![0u64; rows];
        let mut base = vec![0u64; rows];
        let mut max_pos = 0;
        for sp in step.spans {
            check_span(sp, &step.shape, rows)?;
            for t in 0..sp.n {
                let r = sp.row + t;
                pos[r] = (sp.pos + t) as u32;
                kv[r] = ((sp.slot * sh.max_context + sp.pos + t) as u64) * width;
                base[r] = (sp.slot * sh.max_context) as u64 * width;
                max_pos = max_pos.max(sp.pos + t);
            }
        }
        Ok((
            self.meta(MetaKind::Pos, &pos)?,
            self.meta(MetaKind::Kv, &kv)?,
            self.meta(MetaKind::Base, &base)?,
            max_pos,
        ))
    }
}

fn check_span(sp: &SeqSpan, sh: &crate::backend::AttnShape, rows: usize) -> Result<(), String> {
    if sp.pos + sp.n > sh.max_context || sp.slot >= sh.slots || sp.row + sp.n > rows {
        return Err(format!("span {sp:?} outside the KV cache"));
    }
    Ok(())
}

/// A kernel argument: the address of its value.
fn p<T>(v: &mut T) -> *mut c_void {
    v as *mut T as *mut c_void
}

/// out[t, m] (row stride ldo) = X[t, k] . W[m, k]^T, all f32, through cuBLAS (full f32
/// math: the default math mode does not use TF32).
#[allow(clippy::too_many_arguments)]
fn sgemm(
    h: bsys::cublasHandle_t,
    m: usize,
    t: usize,
    k: usize,
    w: u64,
    x: u64,
    out: u64,
    ldo: usize,
) -> Result<(), String> {
    let (alpha, beta) = (1f32, 0f32);
    // SAFETY: pointers inside the arena; sizes checked by the caller.
    unsafe {
        blas::sgemm(
            h,
            bsys::cublasOperation_t::CUBLAS_OP_T,
            bsys::cublasOperation_t::CUBLAS_OP_N,
            m as i32,
            t as i32,
            k as i32,
            &alpha,
            w as *const f32,
            k as i32,
            x as *const f32,
            k as i32,
            &beta,
            out as *mut f32,
            ldo as i32,
        )
    }
    .map_err(|e| format!("cublasSgemm: {e:?}"))
}

fn carve(
    arena: &Arc<Mutex<Arena>>,
    budget: &Arc<MemBudget>,
    base: u64,
    bytes: usize,
    what: &str,
) -> Result<CudaMem, BackendError> {
    budget.reserve(Arena::rounded(bytes) as u64, what)?;
    let off = arena
        .lock()
        .map_err(|_| BackendError::Invalid("arena lock poisoned".into()))?
        .alloc(bytes);
    match off {
        Some(off) => Ok(CudaMem {
            ptr: base + off as u64,
            off,
            len: bytes,
            arena: arena.clone(),
            budget: budget.clone(),
            ev: None,
        }),
        None => {
            budget.release(Arena::rounded(bytes) as u64);
            Err(BackendError::Alloc {
                what: format!("{what} (the device allocation is fragmented)"),
                bytes: bytes as u64,
            })
        }
    }
}

/// Where compiled kernels are cached: $SLUICE_CACHE/kernels or ~/.cache/sluice/kernels.
fn cache_dir() -> Option<std::path::PathBuf> {
    let root = std::env::var_os("SLUICE_CACHE")
        .map(std::path::PathBuf::from)
        .or_else(|| {
            std::env::var_os("HOME").map(|h| std::path::Path::new(&h).join(".cache/sluice"))
        })?;
    Some(root.join("kernels"))
}

/// Compiles every kernel file for the device (a CUBIN for sm_XY, so the driver needs no
/// PTX JIT), caching the result by source, NVRTC version and architecture.
fn load_kernels(
    ctx: &Arc<CudaContext>,
    info: &DeviceInfo,
) -> Result<HashMap<String, CudaFunction>, BackendError> {
    let (major, minor) = info.compute_capability;
    let sm = format!("sm_{major}{minor}");
    let nv = super::nvrtc::version().map_err(BackendError::Device)?;
    let dir = cache_dir();
    let mut funcs = HashMap::new();
    for (op, src) in KERNELS {
        let full = super::source(src);
        let key =
            xxhash_rust::xxh3::xxh3_64(format!("{full}\n{sm}\nnvrtc {}.{}", nv.0, nv.1).as_bytes());
        let path = dir
            .as_ref()
            .map(|d| d.join(format!("{op}-{sm}-{key:016x}.cubin")));
        let compile = || -> Result<Vec<u8>, BackendError> {
            let (bin, log) = super::nvrtc::compile_cubin(op, &full, &sm)
                .map_err(|e| BackendError::Device(format!("compiling kernels/{op}.cu: {e}")))?;
            if !log.is_empty() {
                tracing::warn!("NVRTC on kernels/{op}.cu: {log}");
            }
            if let Some(p) = &path {
                if let Err(e) = write_atomic(p, &bin) {
                    tracing::warn!("kernel cache {}: {e}", p.display());
                }
            }
            Ok(bin)
        };
        let load = |bin: Vec<u8>| ctx.load_module(cudarc::nvrtc::Ptx::from_binary(bin));
        let module = match path.as_ref().and_then(|p| std::fs::read(p).ok()) {
            Some(cached) => match load(cached) {
                Ok(m) => m,
                Err(e) => {
                    // A cache file the driver refuses (damaged, or another driver's):
                    // compile again and replace it.
                    tracing::warn!("cached kernels/{op}.cu for {sm} refused ({e}); recompiling");
                    load(compile()?).map_err(|e| {
                        BackendError::Device(format!("loading kernels/{op}.cu for {sm}: {e}"))
                    })?
                }
            },
            None => load(compile()?).map_err(|e| {
                BackendError::Device(format!("loading kernels/{op}.cu for {sm}: {e}"))
            })?,
        };
        for name in super::entry_points(&full) {
            let f = module
                .load_function(&name)
                .map_err(|e| BackendError::Device(format!("kernel {name}: {e}")))?;
            funcs.insert(name, f);
        }
    }
    Ok(funcs)
}

fn write_atomic(path: &std::path::Path, data: &[u8]) -> std::io::Result<()> {
    if let Some(d) = path.parent() {
        std::fs::create_dir_all(d)?;
    }
    let tmp = path.with_extension(format!("tmp{}", std::process::id()));
    std::fs::write(&tmp, data)?;
    std::fs::rename(&tmp, path)
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
        carve(&self.arena, &self.budget, self.base.ptr, bytes, what)
    }

    fn mem_len(&self, mem: &CudaMem) -> usize {
        mem.len
    }

    fn upload(&self, dst: &mut CudaMem, src: &[u8]) -> Result<(), BackendError> {
        crate::backend::check_upload(dst.len, 0, src.len())?;
        self.ctx.bind_to_thread().map_err(dev_err("bind"))?;
        // Ordered after everything enqueued so far, done when this returns.
        self.compute.synchronize().map_err(dev_err("synchronize"))?;
        // SAFETY: dst has room for src (checked); the copy is synchronous.
        unsafe { result::memcpy_htod_sync(dst.ptr, src) }.map_err(dev_err("cuMemcpyHtoD"))
    }

    fn download_f32(&self, src: &CudaMem, offset: usize, out: &mut [f32]) {
        let r = (|| -> Result<(), String> {
            if (offset + out.len()) * 4 > src.len {
                return Err(format!(
                    "{} f32 at {offset} past an allocation of {} bytes",
                    out.len(),
                    src.len
                ));
            }
            self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
            // SAFETY: the range is inside src (checked); the stream is synchronized before
            // `out` is read.
            unsafe {
                result::memcpy_dtoh_async(
                    out,
                    src.ptr + (offset * 4) as u64,
                    self.compute.cu_stream(),
                )
            }
            .map_err(|e| e.to_string())?;
            self.compute.synchronize().map_err(|e| e.to_string())
        })();
        self.record("download", r);
    }

    fn check(&self) -> Result<(), BackendError> {
        match self.err.lock() {
            Ok(mut e) => match e.take() {
                Some(msg) => Err(BackendError::Device(format!(
                    "{msg} (on {})",
                    self.info.name
                ))),
                None => Ok(()),
            },
            Err(_) => Err(BackendError::Device("error slot poisoned".into())),
        }
    }

    fn upload_begin(&self, dst: &mut CudaMem) -> Result<(), BackendError> {
        self.ctx.bind_to_thread().map_err(dev_err("bind"))?;
        if dst.ev.is_none() {
            let ev = |flags| self.ctx.new_event(Some(flags)).map_err(dev_err("event"));
            dst.ev = Some(SlotEvents {
                end: ev(sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC)?,
                consumed: ev(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)?,
                parts: Vec::new(),
                used: Cell::new(0),
                pending: Cell::new(false),
                bytes: Cell::new(0),
            });
        }
        if dst.ev.as_ref().is_some_and(|e| e.pending.get()) {
            // Its previous upload was never waited for: account for it now.
            self.upload_wait(dst)?;
        }
        let ev = dst.ev.as_ref().expect("made above");
        // The slot's previous unit must have finished computing (an event never recorded
        // counts as complete).
        self.copy
            .wait(&ev.consumed)
            .map_err(dev_err("copy stream wait"))?;
        ev.bytes.set(0);
        ev.used.set(0);
        Ok(())
    }

    fn upload_part(
        &self,
        dst: &mut CudaMem,
        offset: usize,
        src: &[u8],
    ) -> Result<(), BackendError> {
        crate::backend::check_upload(dst.len, offset, src.len())?;
        self.ctx.bind_to_thread().map_err(dev_err("bind"))?;
        let Some(ev) = dst.ev.as_mut() else {
            return Err(BackendError::Invalid(
                "upload_part before upload_begin".into(),
            ));
        };
        let i = ev.used.get();
        if i == ev.parts.len() {
            let timed = || {
                self.ctx
                    .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(dev_err("event"))
            };
            ev.parts.push((timed()?, timed()?));
        }
        ev.parts[i].0.record(&self.copy).map_err(dev_err("event"))?;
        // SAFETY: the range is inside dst (checked); the caller keeps src unchanged until
        // upload_wait.
        unsafe { result::memcpy_htod_async(dst.ptr + offset as u64, src, self.copy.cu_stream()) }
            .map_err(dev_err("cuMemcpyHtoDAsync"))?;
        ev.parts[i].1.record(&self.copy).map_err(dev_err("event"))?;
        ev.used.set(i + 1);
        ev.bytes.set(ev.bytes.get() + src.len() as u64);
        Ok(())
    }

    fn upload_end(&self, dst: &mut CudaMem) -> Result<(), BackendError> {
        let Some(ev) = dst.ev.as_ref() else {
            return Err(BackendError::Invalid(
                "upload_end before upload_begin".into(),
            ));
        };
        ev.end.record(&self.copy).map_err(dev_err("event"))?;
        // Ops enqueued from now on read the slot only after the copies.
        self.compute
            .wait(&ev.end)
            .map_err(dev_err("compute stream wait"))?;
        ev.pending.set(true);
        Ok(())
    }

    fn upload_wait(&self, dst: &CudaMem) -> Result<(), BackendError> {
        let Some(ev) = &dst.ev else { return Ok(()) };
        if !ev.pending.get() {
            return Ok(());
        }
        self.ctx.bind_to_thread().map_err(dev_err("bind"))?;
        ev.end
            .synchronize()
            .map_err(dev_err("waiting for an upload"))?;
        ev.pending.set(false);
        let mut ms = 0f64;
        for (a, b) in &ev.parts[..ev.used.get()] {
            ms += a.elapsed_ms(b).map_err(dev_err("copy timing"))? as f64;
        }
        ev.used.set(0);
        if let Ok(mut c) = self.copies.lock() {
            c.uploads += 1;
            c.bytes += ev.bytes.get();
            c.seconds += ms / 1e3;
        }
        Ok(())
    }

    fn release_after(&self, mem: &CudaMem) {
        if let Some(ev) = &mem.ev {
            let r = self
                .ctx
                .bind_to_thread()
                .and_then(|_| ev.consumed.record(&self.compute))
                .map_err(|e| e.to_string());
            self.record("marking a slot consumed", r);
        }
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
            let name = format!("embedding_{}", table.dtype.name());
            let (mut a0, mut a1, mut a2, mut a3) = (
                table.mem.ptr + table.offset as u64,
                ids_dev,
                out.ptr,
                cols as i32,
            );
            self.launch(
                &name,
                (ids.len() as u32, 1, 1),
                256,
                0,
                &mut [p(&mut a0), p(&mut a1), p(&mut a2), p(&mut a3)],
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
            let name = match w.dtype {
                DType::F32 | DType::F16 | DType::BF16 => {
                    format!("rms_norm_{}", w.dtype.name())
                }
                d => return Err(format!("a {d:?} norm weight")),
            };
            self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
            let (mut a0, mut a1, mut a2, mut a3, mut a4) = (
                x.ptr,
                w.mem.ptr + w.offset as u64,
                out.ptr,
                cols as i32,
                eps,
            );
            let block = (cols.div_ceil(4).div_ceil(32) * 32).clamp(32, 1024) as u32;
            self.launch(
                &name,
                (rows as u32, 1, 1),
                block,
                0,
                &mut [p(&mut a0), p(&mut a1), p(&mut a2), p(&mut a3), p(&mut a4)],
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
            let (mut a0, mut a1, mut a2, mut a3, mut a4) =
                (x.ptr, table.ptr, pos, heads as i32, head_dim as i32);
            self.launch(
                "rope_f32",
                (rows as u32, heads as u32, 1),
                half.max(1) as u32,
                0,
                &mut [p(&mut a0), p(&mut a1), p(&mut a2), p(&mut a3), p(&mut a4)],
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
            let layer_bytes = (sh.layer_elems() * 4) as u64;
            if (step.layer as u64 + 1) * layer_bytes > cache_k.len as u64
                || cache_v.len != cache_k.len
            {
                return Err(format!("layer {} outside the KV cache", step.layer));
            }
            self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
            let rows: usize = step.spans.iter().map(|s| s.n).sum();
            let width = sh.kv_heads * sh.head_dim;
            if k.len < rows * width * 4 || v.len < rows * width * 4 {
                return Err("shapes".into());
            }
            let (_, kv, _, _) = self.spans_meta(step)?;
            let off = step.layer as u64 * layer_bytes;
            let (mut a0, mut a1, mut a2, mut a3, mut a4, mut a5) = (
                k.ptr,
                v.ptr,
                cache_k.ptr + off,
                cache_v.ptr + off,
                kv,
                width as i32,
            );
            self.launch(
                "kv_store_f32",
                (rows as u32, 1, 1),
                256,
                0,
                &mut [
                    p(&mut a0),
                    p(&mut a1),
                    p(&mut a2),
                    p(&mut a3),
                    p(&mut a4),
                    p(&mut a5),
                ],
            )
        })();
        self.record("kv_store", r);
    }

    fn attention(
        &self,
        q: &CudaMem,
        cache_k: &CudaMem,
        cache_v: &CudaMem,
        step: &AttnStep<'_>,
        out: &mut CudaMem,
    ) {
        let r = (|| -> Result<(), String> {
            let sh = step.shape;
            let layer_bytes = (sh.layer_elems() * 4) as u64;
            if (step.layer as u64 + 1) * layer_bytes > cache_k.len as u64 {
                return Err(format!("layer {} outside the KV cache", step.layer));
            }
            let rows: usize = step.spans.iter().map(|s| s.n).sum();
            let wq = sh.heads * sh.head_dim;
            if q.len < rows * wq * 4 || out.len < rows * wq * 4 {
                return Err("shapes".into());
            }
            self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
            let (pos, _, base, max_pos) = self.spans_meta(step)?;
            let smem = (max_pos + 1) * 4;
            if smem > self.attn_smem {
                return Err(format!(
                    "{} positions need {smem} bytes of shared memory; {} allows {}",
                    max_pos + 1,
                    self.info.name,
                    self.attn_smem
                ));
            }
            let off = step.layer as u64 * layer_bytes;
            let scale = 1.0 / (sh.head_dim as f32).sqrt();
            let (mut a0, mut a1, mut a2, mut a3, mut a4, mut a5) = (
                q.ptr,
                cache_k.ptr + off,
                cache_v.ptr + off,
                out.ptr,
                pos,
                base,
            );
            let (mut a6, mut a7, mut a8, mut a9) = (
                sh.heads as i32,
                sh.kv_heads as i32,
                sh.head_dim as i32,
                scale,
            );
            self.launch(
                "attention_f32",
                (rows as u32, sh.heads as u32, 1),
                128,
                smem as u32,
                &mut [
                    p(&mut a0),
                    p(&mut a1),
                    p(&mut a2),
                    p(&mut a3),
                    p(&mut a4),
                    p(&mut a5),
                    p(&mut a6),
                    p(&mut a7),
                    p(&mut a8),
                    p(&mut a9),
                ],
            )
        })();
        self.record("attention", r);
    }

    fn silu_mul(&self, gate: &mut CudaMem, up: &CudaMem, n: usize) {
        let r = self.elementwise("silu_mul_f32", gate, up, n);
        self.record("silu_mul", r);
    }

    fn add(&self, x: &mut CudaMem, y: &CudaMem, n: usize) {
        let r = self.elementwise("add_f32", x, y, n);
        self.record("add", r);
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
