//! Step metadata (token ids, positions, KV destinations, sequence bases): uploaded once
//! per step through preallocated pinned and device buffers, and only when it changed.

use super::handles::PinnedHost;
use crate::backend::{AttnStep, SeqSpan};
use cudarc::driver::{result, CudaEvent, CudaStream};

/// Step metadata on the device and the host copies it was made from, so it is uploaded
/// once per step, not once per layer.
pub(super) struct Meta {
    pub(super) host: PinnedHost,
    /// Per kind: the bytes the device holds, when `valid`.
    pub(super) held: [Vec<u8>; 4],
    pub(super) valid: [bool; 4],
    /// Per kind: recorded after the last copy out of its part of `host`.
    pub(super) copied: [CudaEvent; 4],
    /// Scratch for the per-row metadata of a step's spans.
    pub(super) pos: Vec<u32>,
    pub(super) kv: Vec<u64>,
    pub(super) base: Vec<u64>,
    /// Device address of the metadata allocation, and the rows it holds per kind.
    pub(super) dev: u64,
    pub(super) rows: usize,
    /// The expert metadata ring (after the per-row arrays): per slot, recorded after the
    /// copy out of its part of `host`; and the slot the next list takes.
    pub(super) expert_copied: Vec<CudaEvent>,
    pub(super) expert_next: usize,
}

/// Device addresses of a step's per-row metadata, and its last position.
pub(super) struct SpanMeta {
    /// u32 position of each row.
    pub(super) pos: u64,
    /// u64 element offset in the layer's KV cache where each row's K and V go.
    pub(super) kv_dst: u64,
    /// u64 element offset of each row's slot in the layer's KV cache.
    pub(super) base: u64,
    pub(super) max_pos: usize,
}
// SAFETY: `host` is a pinned allocation owned by the backend, used under its mutex.
unsafe impl Send for Meta {}

#[derive(Clone, Copy)]
pub(super) enum MetaKind {
    Ids,
    Pos,
    Kv,
    Base,
}

impl Meta {
    /// Uploads one metadata array on `stream` when it differs from what the device holds;
    /// returns its device address. Allocates nothing: the held copies have room for
    /// `rows` rows from the start.
    pub(super) fn upload<T: Copy>(
        &mut self,
        stream: &CudaStream,
        kind: MetaKind,
        data: &[T],
    ) -> Result<u64, String> {
        let m = self;
        let rows = m.rows;
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
        // SAFETY: u32 and u64 arrays viewed as their bytes.
        let bytes = unsafe {
            std::slice::from_raw_parts(data.as_ptr() as *const u8, std::mem::size_of_val(data))
        };
        let k = kind as usize;
        let same = m.valid[k] && m.held[k] == bytes;
        let dev = m.dev + off as u64;
        if same {
            return Ok(dev);
        }
        // The previous copy out of the pinned buffer must be done before it is rewritten.
        m.copied[kind as usize]
            .synchronize()
            .map_err(|e| e.to_string())?;
        // SAFETY: host holds rows * 24 bytes; off + bytes.len() <= rows * 24 by the check.
        let host = unsafe {
            std::slice::from_raw_parts_mut((m.host.ptr as *mut u8).add(off), bytes.len())
        };
        host.copy_from_slice(bytes);
        // SAFETY: dev..dev+len is inside the metadata allocation; host is pinned and is not
        // written again before `copied` completes.
        unsafe { result::memcpy_htod_async(dev, &host[..], stream.cu_stream()) }
            .map_err(|e| e.to_string())?;
        m.copied[kind as usize]
            .record(stream)
            .map_err(|e| e.to_string())?;
        m.held[k].clear();
        m.held[k].extend_from_slice(bytes);
        m.valid[k] = true;
        Ok(dev)
    }

    /// A mixture's row list (and weights) for one gather or scatter, on the device through
    /// the next slot of the expert ring: (rows address, weights address). A slot's pinned
    /// bytes are rewritten only once the copy out of them has run (EXPERT_META_SLOTS lists
    /// ago, so the wait is for a copy long done).
    pub(super) fn expert_rows(
        &mut self,
        stream: &CudaStream,
        rows: &[u32],
        weights: Option<&[f32]>,
    ) -> Result<(u64, u64), String> {
        let m = self;
        if rows.len() > m.rows {
            return Err(format!(
                "{} rows for an expert; the backend was sized for {}",
                rows.len(),
                m.rows
            ));
        }
        let slot = m.expert_next % m.expert_copied.len().max(1);
        m.expert_next = m.expert_next.wrapping_add(1);
        let ev = m.expert_copied.get(slot).ok_or("no expert metadata ring")?;
        ev.synchronize().map_err(|e| e.to_string())?;
        let off = m.rows * 24 + slot * m.rows * 8;
        let n = rows.len() * 4;
        // SAFETY: the pinned buffer holds rows * (24 + 8 x slots) bytes; this slot's two
        // arrays of `rows.len()` <= m.rows entries lie inside it, and no copy reads them
        // (its event has completed).
        let host =
            unsafe { std::slice::from_raw_parts_mut((m.host.ptr as *mut u8).add(off), m.rows * 8) };
        for (d, r) in host[..n].chunks_exact_mut(4).zip(rows) {
            d.copy_from_slice(&r.to_le_bytes());
        }
        if let Some(w) = weights {
            for (d, x) in host[m.rows * 4..m.rows * 4 + n].chunks_exact_mut(4).zip(w) {
                d.copy_from_slice(&x.to_le_bytes());
            }
        }
        let (rows_dev, weights_dev) = (m.dev + off as u64, m.dev + (off + m.rows * 4) as u64);
        // SAFETY: device and pinned ranges inside their allocations; the host bytes stay
        // unchanged until the event below completes.
        unsafe {
            result::memcpy_htod_async(rows_dev, &host[..n], stream.cu_stream())
                .map_err(|e| e.to_string())?;
            if weights.is_some() {
                result::memcpy_htod_async(
                    weights_dev,
                    &host[m.rows * 4..m.rows * 4 + n],
                    stream.cu_stream(),
                )
                .map_err(|e| e.to_string())?;
            }
        }
        ev.record(stream).map_err(|e| e.to_string())?;
        Ok((rows_dev, weights_dev))
    }

    /// The per-row metadata of a step's spans, on the device; built in the metadata's own
    /// scratch vectors (no allocation per layer).
    pub(super) fn spans(
        &mut self,
        stream: &CudaStream,
        step: &AttnStep<'_>,
    ) -> Result<SpanMeta, String> {
        let sh = step.shape;
        let width = (sh.kv_heads * sh.head_dim) as u64;
        let rows: usize = step.spans.iter().map(|s| s.n).sum();
        let m = self;
        let (mut pos, mut kv, mut base) = (
            std::mem::take(&mut m.pos),
            std::mem::take(&mut m.kv),
            std::mem::take(&mut m.base),
        );
        pos.clear();
        pos.resize(rows, 0);
        kv.clear();
        kv.resize(rows, 0);
        base.clear();
        base.resize(rows, 0);
        let mut max_pos = 0;
        for sp in step.spans {
            check_span(sp, step, rows)?;
            for t in 0..sp.n {
                let r = sp.row + t;
                pos[r] = (sp.pos + t) as u32;
                // Offsets inside the layer's part of the cache (the caller adds its base).
                kv[r] = (step.cache.at(&sh, sp.slot, sp.pos + t) - step.cache.base) as u64;
                base[r] = (sp.slot * step.cache.cap) as u64 * width;
                max_pos = max_pos.max(sp.pos + t);
            }
        }
        let out = SpanMeta {
            pos: m.upload(stream, MetaKind::Pos, &pos)?,
            kv_dst: m.upload(stream, MetaKind::Kv, &kv)?,
            base: m.upload(stream, MetaKind::Base, &base)?,
            max_pos,
        };
        (m.pos, m.kv, m.base) = (pos, kv, base);
        Ok(out)
    }
}

fn check_span(sp: &SeqSpan, step: &AttnStep<'_>, rows: usize) -> Result<(), String> {
    let sh = &step.shape;
    if !step.cache.fits(sh, sp.pos, sp.n) || sp.slot >= sh.slots || sp.row + sp.n > rows {
        return Err(format!("span {sp:?} outside the KV cache"));
    }
    Ok(())
}
