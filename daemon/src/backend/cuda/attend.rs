//! Attention on the device (`Backend::attention`: the checks, each row's splits, the
//! launches of kernels/attention.cu), the KV moves of token trees (`Backend::kv_move`) and
//! the prefix cache's copies between slots (`Backend::kv_copy`).

use super::device::ATTENTION_THREADS;
use super::device::{attention_launches, CudaBackend, ATTENTION_HEAD_DIM_MAX, ATTENTION_SPLIT};
use super::handles::CudaMem;
use super::kernels::{Dims, Kernel};
use super::meta::SpanMeta;
use crate::backend::{AttnShape, AttnStep, KvDtype, LayerCache, WeightRef};
use crate::dtype::DType;
use cudarc::driver::result;

impl CudaBackend {
    /// `Backend::attention`.
    pub(super) fn attend(
        &self,
        q: &CudaMem,
        (cache_k, cache_v): (&CudaMem, &CudaMem),
        step: &AttnStep<'_>,
        sinks: Option<WeightRef<'_, CudaMem>>,
        out: &mut CudaMem,
    ) -> Result<(), String> {
        let sh = step.shape;
        let sinks = sinks_address(sinks, sh.heads)?;
        let kvb = sh.kv.bytes() as u64;
        let rows = check_attention(step, (q, cache_k, cache_v, out))?;
        let wq = sh.heads * sh.head_dim;
        self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        let SpanMeta { pos, base, anc, .. } = self.spans_meta(step)?;
        let off = step.cache.base as u64 * kvb;
        let (ck, cv) = (cache_k.ptr + off, cache_v.ptr + off);
        let (heads, kvh, hd) = (sh.heads as i32, sh.kv_heads as i32, sh.head_dim as i32);
        let (cap, win) = (
            step.cache.cap as i32,
            step.cache.window.map_or(0, |w| w as i32),
        );
        // Each row's splits of ATTENTION_SPLIT positions (by row: spans name their
        // rows); rows go in launches whose partials fit the scratch (s_max records
        // per row, for every head). The list is kept: steps allocate nothing.
        let mut splits = self
            .attn_splits
            .lock()
            .map_err(|_| "attention lock poisoned")?;
        row_splits(step, rows, &mut splits);
        let record = (sh.heads * (sh.head_dim + 2) * 4) as u64;
        attention_launches(
            &splits,
            record,
            self.attn_part.len as u64,
            |r0, r1, s_max| {
                let n = (r1 - r0) as u32;
                let part_dims = Dims {
                    grid: (n, sh.kv_heads as u32, s_max as u32),
                    block: ATTENTION_THREADS,
                    smem: 0,
                };
                let qr = q.ptr + (r0 * wq * 4) as u64;
                let (pr, br) = (pos + (r0 * 4) as u64, base + (r0 * 8) as u64);
                let ar = anc + (r0 * 8) as u64;
                let part = self.attn_part.ptr;
                let (split, sm) = (ATTENTION_SPLIT as i32, s_max as i32);
                let kernel = match sh.kv {
                    KvDtype::F32 => Kernel::AttentionPartF32,
                    KvDtype::F16 => Kernel::AttentionPartF16,
                };
                self.kernels.attention_part(
                    &self.compute,
                    kernel,
                    part_dims,
                    qr,
                    ck,
                    cv,
                    part,
                    pr,
                    br,
                    ar,
                    heads,
                    kvh,
                    hd,
                    sh.scale,
                    cap,
                    win,
                    split,
                    sm,
                )?;
                let combine_dims = Dims {
                    grid: (n, sh.heads as u32, 1),
                    block: 128,
                    smem: 0,
                };
                self.kernels.attention_combine(
                    &self.compute,
                    Kernel::AttentionCombineF32,
                    combine_dims,
                    part,
                    out.ptr + (r0 * wq * 4) as u64,
                    pr,
                    heads,
                    hd,
                    win,
                    split,
                    sm,
                    sinks,
                )
            },
        )
    }

    /// `Backend::kv_move`: a device-to-device copy of each moved row, K and V, on the
    /// compute stream.
    pub(super) fn move_kv(
        &self,
        (cache_k, cache_v): (&mut CudaMem, &mut CudaMem),
        step: &AttnStep<'_>,
        slot: usize,
        moves: &[(u32, u32)],
    ) -> Result<(), String> {
        let sh = step.shape;
        let kvb = sh.kv.bytes();
        let bytes = sh.kv_heads * sh.head_dim * kvb;
        self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        for &(from, to) in moves {
            let (from, to) = (from as usize, to as usize);
            if from.max(to) >= sh.max_context || slot >= sh.slots {
                return Err(format!(
                    "KV move {from} -> {to} of slot {slot} outside the cache"
                ));
            }
            let src = step.cache.at(&sh, slot, from) * kvb;
            let dst = step.cache.at(&sh, slot, to) * kvb;
            // Different positions of one slot: they do not overlap.
            self.copy_kv_bytes((cache_k, cache_v), (src, dst), bytes)
                .map_err(|e| format!("layer {}: {e}", step.layer))?;
        }
        Ok(())
    }

    /// Copies `bytes` at `src` to `dst` in both the K and the V cache, on the compute
    /// stream; the two ranges must not overlap.
    fn copy_kv_bytes(
        &self,
        (cache_k, cache_v): (&CudaMem, &CudaMem),
        (src, dst): (usize, usize),
        bytes: usize,
    ) -> Result<(), String> {
        for mem in [cache_k, cache_v] {
            if src.max(dst) + bytes > mem.len || src.abs_diff(dst) < bytes {
                return Err("a KV copy outside the cache, or onto itself".into());
            }
            // SAFETY: both ranges are inside the allocation and do not overlap (checked).
            unsafe {
                result::memcpy_dtod_async(
                    mem.ptr + dst as u64,
                    mem.ptr + src as u64,
                    bytes,
                    self.compute.cu_stream(),
                )
            }
            .map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    /// `Backend::kv_read`: a device-to-host copy on the compute stream (after the steps
    /// before it), waited for.
    pub(super) fn read_kv(
        &self,
        cache: &CudaMem,
        offset: usize,
        out: &mut [u8],
    ) -> Result<(), String> {
        if offset + out.len() > cache.len {
            return Err(format!(
                "KV read of {} bytes at {offset} past a cache of {} bytes",
                out.len(),
                cache.len
            ));
        }
        self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        // SAFETY: the range is inside the allocation (checked); the stream is synchronized
        // before `out` is read.
        unsafe {
            result::memcpy_dtoh_async(out, cache.ptr + offset as u64, self.compute.cu_stream())
        }
        .map_err(|e| e.to_string())?;
        self.compute.synchronize().map_err(|e| e.to_string())
    }

    /// `Backend::kv_write`: a host-to-device copy on the compute stream (ordered with the
    /// steps around it), waited for so that `src` may be reused.
    pub(super) fn write_kv(
        &self,
        cache: &CudaMem,
        offset: usize,
        src: &[u8],
    ) -> Result<(), String> {
        if offset + src.len() > cache.len {
            return Err(format!(
                "KV write of {} bytes at {offset} past a cache of {} bytes",
                src.len(),
                cache.len
            ));
        }
        self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        // SAFETY: the range is inside the allocation (checked); `src` lives until the
        // stream is synchronized below.
        unsafe {
            result::memcpy_htod_async(cache.ptr + offset as u64, src, self.compute.cu_stream())
        }
        .map_err(|e| e.to_string())?;
        self.compute.synchronize().map_err(|e| e.to_string())
    }

    /// `Backend::kv_copy`: each run of positions the ring keeps contiguous, one
    /// device-to-device copy on the compute stream (ordered with the steps around it).
    pub(super) fn copy_kv(
        &self,
        (cache_k, cache_v): (&mut CudaMem, &mut CudaMem),
        (sh, cache): (&AttnShape, &LayerCache),
        (from, to): (usize, usize),
        positions: std::ops::Range<usize>,
    ) -> Result<(), String> {
        if from == to || from.max(to) >= sh.slots || positions.end > sh.max_context {
            return Err(format!(
                "KV copy of positions {positions:?} from slot {from} to slot {to} outside the cache"
            ));
        }
        let kvb = sh.kv.bytes();
        let width = sh.kv_heads * sh.head_dim;
        self.ctx.bind_to_thread().map_err(|e| e.to_string())?;
        for (first, n) in cache.held_runs(positions.clone(), positions.end) {
            if n == 0 {
                continue;
            }
            let src = cache.at(sh, from, first) * kvb;
            let dst = cache.at(sh, to, first) * kvb;
            // Different slots: they do not overlap.
            self.copy_kv_bytes((cache_k, cache_v), (src, dst), n * width * kvb)?;
        }
        Ok(())
    }
}

/// Checks an attention step against its allocations and the kernel's limits; returns the
/// step's rows.
fn check_attention(
    step: &AttnStep<'_>,
    (q, cache_k, cache_v, out): (&CudaMem, &CudaMem, &CudaMem, &CudaMem),
) -> Result<usize, String> {
    let sh = step.shape;
    let end = (step.cache.base + step.cache.elems(&sh)) * sh.kv.bytes();
    if end > cache_k.len || cache_v.len != cache_k.len {
        return Err(format!("layer {} outside the KV cache", step.layer));
    }
    if sh.head_dim > ATTENTION_HEAD_DIM_MAX
        || sh.kv_heads == 0
        || !sh.heads.is_multiple_of(sh.kv_heads)
    {
        return Err(format!(
            "{} query heads over {} KV heads of {} dims: the attention kernel takes whole groups of heads of at most {ATTENTION_HEAD_DIM_MAX} dims",
            sh.heads, sh.kv_heads, sh.head_dim
        ));
    }
    let rows: usize = step.spans.iter().map(|s| s.n).sum();
    let wq = sh.heads * sh.head_dim;
    if q.len < rows * wq * 4 || out.len < rows * wq * 4 {
        return Err("shapes".into());
    }
    Ok(rows)
}

/// The sinks' device address (one f32 per query head), or null.
fn sinks_address(sinks: Option<WeightRef<'_, CudaMem>>, heads: usize) -> Result<u64, String> {
    match sinks {
        None => Ok(0),
        Some(w) if w.dtype == DType::F32 && w.rows * w.cols == heads => {
            if w.offset + heads * 4 > w.mem.len {
                return Err("attention sinks outside their allocation".into());
            }
            Ok(w.mem.ptr + w.offset as u64)
        }
        Some(w) => Err(format!(
            "attention sinks are {} x {} {}; the kernel takes {heads} f32",
            w.rows, w.cols, w.dtype
        )),
    }
}

/// Each of the step's `rows` rows' splits of ATTENTION_SPLIT positions (of the positions
/// it sees, at its own position: `AttnStep::row_keys`), into `splits`.
fn row_splits(step: &AttnStep<'_>, rows: usize, splits: &mut Vec<usize>) {
    splits.clear();
    splits.resize(rows, 1);
    for sp in step.spans {
        for t in 0..sp.n {
            let p = step.row_keys(sp, t).pos;
            let seen = p + 1 - step.cache.first_visible(p);
            splits[sp.row + t] = seen.div_ceil(ATTENTION_SPLIT);
        }
    }
}
