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
    pub(super) held: [Vec<u8>; 5],
    pub(super) valid: [bool; 5],
    /// Per kind: recorded after the last copy out of its part of `host`.
    pub(super) copied: [CudaEvent; 5],
    /// Scratch for the per-row metadata of a step's spans.
    pub(super) span_rows: SpanRows,
    /// Device address of the metadata allocation, and the rows it holds per kind.
    pub(super) dev: u64,
    pub(super) rows: usize,
    /// The expert metadata ring (after the per-row arrays): per slot, recorded after the
    /// copy out of its part of `host`; and the slot the next list takes.
    pub(super) expert_copied: Vec<CudaEvent>,
    pub(super) expert_next: usize,
    /// The grouped-expert metadata slots (after the ring): per slot, recorded after the
    /// copy out of it; the slot the next chunk takes; where the slots start.
    pub(super) group_copied: Vec<CudaEvent>,
    pub(super) group_next: usize,
    pub(super) group_off: usize,
}

/// Slots of the grouped-expert metadata (`Meta::group`): a chunk's slot is rewritten only
/// after the chunk after it was enqueued.
pub(super) const GROUP_META_SLOTS: usize = 2;

/// Bytes of one grouped-expert metadata slot for chunks of up to `pairs` (expert, row)
/// pairs: six u64 arrays (gate, up, down and their biases' addresses) and five u32/f32
/// ones (activation row, weight, pair order, rows, starts; starts has one more).
pub(super) fn group_slot_bytes(pairs: usize) -> usize {
    (68 * pairs + 4).div_ceil(8) * 8
}

/// One grouped-expert chunk's metadata, built on the host: per pair its expert's
/// gate/up/down addresses (`w`), their biases' (`bias`, empty without biases), its
/// activation row and routing weight; per distinct step row (`row_ids`) its pairs in
/// ascending order, `pair_ids[starts[r]..starts[r + 1]]`.
#[derive(Default)]
pub(super) struct GroupHost {
    pub(super) w: [Vec<u64>; 3],
    pub(super) bias: [Vec<u64>; 3],
    pub(super) x_rows: Vec<u32>,
    pub(super) weights: Vec<f32>,
    pub(super) pair_ids: Vec<u32>,
    pub(super) row_ids: Vec<u32>,
    pub(super) starts: Vec<u32>,
    /// Scratch (not uploaded): (row, pair) sorted, and the routing's output.
    pub(super) order: Vec<(u32, u32)>,
    pub(super) route_experts: Vec<u32>,
    pub(super) route_weights: Vec<f32>,
}

impl GroupHost {
    pub(super) fn clear(&mut self) {
        for v in self.w.iter_mut().chain(self.bias.iter_mut()) {
            v.clear();
        }
        self.x_rows.clear();
        self.weights.clear();
        self.pair_ids.clear();
        self.row_ids.clear();
        self.starts.clear();
    }

    pub(super) fn pairs(&self) -> usize {
        self.x_rows.len()
    }

    /// Fills `row_ids`, `starts` and `pair_ids` from `x_rows` (`index_pairs`).
    pub(super) fn index(&mut self) {
        index_pairs(
            &self.x_rows,
            &mut self.order,
            (&mut self.row_ids, &mut self.starts, &mut self.pair_ids),
        );
    }
}

/// How `combine_rows` adds a grouped chunk's pairs into the step's rows, from each pair's
/// activation row (`x_rows`, pairs expert-major): the distinct rows ascending (`row_ids`),
/// and per row its pairs ascending, `pair_ids[starts[r]..starts[r + 1]]` — the order the
/// CPU backend adds experts into a row (expert by expert). `order` is scratch.
pub fn index_pairs(
    x_rows: &[u32],
    order: &mut Vec<(u32, u32)>,
    (row_ids, starts, pair_ids): (&mut Vec<u32>, &mut Vec<u32>, &mut Vec<u32>),
) {
    order.clear();
    order.extend(x_rows.iter().enumerate().map(|(p, &r)| (r, p as u32)));
    order.sort_unstable();
    row_ids.clear();
    starts.clear();
    pair_ids.clear();
    for (i, &(r, p)) in order.iter().enumerate() {
        if i == 0 || order[i - 1].0 != r {
            starts.push(i as u32);
            row_ids.push(r);
        }
        pair_ids.push(p);
    }
    starts.push(order.len() as u32);
}

/// The (expert, row) pairs one grouped chunk holds: what the gate, up and down scratch
/// (`gate`, `up`, `y` bytes, rows of `inter`, `inter` and `hidden` f32) and the metadata
/// slots (`meta_rows`) have room for; 0 when not one.
pub fn grouped_capacity(
    (gate, up, y): (usize, usize, usize),
    (inter, hidden): (usize, usize),
    meta_rows: usize,
) -> usize {
    if inter == 0 || hidden == 0 {
        return 0;
    }
    (gate / (inter * 4))
        .min(up / (inter * 4))
        .min(y / (hidden * 4))
        .min(meta_rows)
}

/// The chunks of `pairs` pairs (expert-major, as `experts_grouped` lists them) `cap` at a
/// time: consecutive ranges, so that each step row's pairs come chunk after chunk in the
/// order they are listed, ascending expert — with `index_pairs` inside a chunk, the
/// order the CPU backend adds experts into a row.
pub fn grouped_chunks(pairs: usize, cap: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let cap = cap.max(1);
    (0..pairs.div_ceil(cap)).map(move |k| k * cap..((k + 1) * cap).min(pairs))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The order the CPU backend adds a call's experts into each step row
    /// (`backend::experts::experts_each`): expert by expert in the call's order, each of
    /// its rows.
    fn cpu_order(calls: &[Vec<u32>]) -> Vec<Vec<usize>> {
        let rows = calls
            .iter()
            .flatten()
            .map(|&r| r as usize + 1)
            .max()
            .unwrap_or(0);
        let mut per_row = vec![Vec::new(); rows];
        for (e, c) in calls.iter().enumerate() {
            for &r in c {
                per_row[r as usize].push(e);
            }
        }
        per_row
    }

    #[test]
    fn chunks_add_each_rows_experts_in_the_cpu_backends_order() {
        // Calls of a decode step: per expert (ascending) the step rows routed to it.
        let cases: Vec<Vec<Vec<u32>>> = vec![
            vec![vec![0, 1, 2], vec![1], vec![0, 2], vec![2]],
            vec![vec![3], vec![0, 3], vec![], vec![1, 2, 3], vec![0]],
            (0..8)
                .map(|e| (0..5).filter(|r| (r + e) % 3 != 0).collect())
                .collect(),
        ];
        for calls in &cases {
            // Pairs expert-major, as `experts_grouped` lists them.
            let pairs: Vec<(usize, u32)> = (calls.iter().enumerate())
                .flat_map(|(e, c)| c.iter().map(move |&r| (e, r)))
                .collect();
            for cap in 1..=pairs.len() + 1 {
                let mut got = vec![Vec::new(); cpu_order(calls).len()];
                let mut seen = 0;
                for chunk in grouped_chunks(pairs.len(), cap) {
                    assert!(
                        chunk.len() <= cap && !chunk.is_empty(),
                        "{chunk:?} cap {cap}"
                    );
                    assert_eq!(chunk.start, seen, "chunks are consecutive");
                    seen = chunk.end;
                    let x_rows: Vec<u32> = pairs[chunk.clone()].iter().map(|p| p.1).collect();
                    let (mut row_ids, mut starts, mut ids) = (Vec::new(), Vec::new(), Vec::new());
                    index_pairs(
                        &x_rows,
                        &mut Vec::new(),
                        (&mut row_ids, &mut starts, &mut ids),
                    );
                    // combine_rows adds row row_ids[i]'s pairs ids[starts[i]..starts[i+1]].
                    for (i, &r) in row_ids.iter().enumerate() {
                        for &p in &ids[starts[i] as usize..starts[i + 1] as usize] {
                            got[r as usize].push(pairs[chunk.start + p as usize].0);
                        }
                    }
                }
                assert_eq!(seen, pairs.len(), "every pair in a chunk");
                assert_eq!(got, cpu_order(calls), "cap {cap}: {calls:?}");
            }
        }
    }

    #[test]
    fn a_chunk_holds_what_every_scratch_and_the_metadata_have_room_for() {
        // Gate and up hold 10 rows of 64, y 6 rows of 32, the metadata 8.
        let c = grouped_capacity((10 * 256, 10 * 256, 6 * 128), (64, 32), 8);
        assert_eq!(c, 6);
        assert_eq!(
            grouped_capacity((10 * 256, 10 * 256, 6 * 128), (64, 32), 3),
            3
        );
        assert_eq!(grouped_capacity((255, 10 * 256, 6 * 128), (64, 32), 8), 0);
        assert_eq!(grouped_capacity((1 << 20, 1 << 20, 1 << 20), (0, 32), 8), 0);
    }
}

/// Device addresses of a grouped chunk's arrays (`GroupHost`'s, in its order).
pub(super) struct GroupDev {
    pub(super) w: [u64; 3],
    pub(super) bias: [u64; 3],
    pub(super) x_rows: u64,
    pub(super) weights: u64,
    pub(super) pair_ids: u64,
    pub(super) row_ids: u64,
    pub(super) starts: u64,
}

/// Device addresses of a step's per-row metadata.
pub(super) struct SpanMeta {
    /// u32 position of each row.
    pub(super) pos: u64,
    /// u64 element offset in the layer's KV cache where each row's K and V go.
    pub(super) kv_dst: u64,
    /// u64 element offset of each row's slot in the layer's KV cache.
    pub(super) base: u64,
    /// u64 per row: its ancestors in its token tree, itself included (0: a causal row;
    /// `AttnStep::ancestors`).
    pub(super) anc: u64,
}
// SAFETY: `host` is a pinned allocation owned by the backend, used under its mutex.
unsafe impl Send for Meta {}

#[derive(Clone, Copy)]
pub(super) enum MetaKind {
    Ids,
    Pos,
    Kv,
    Base,
    Anc,
}

/// Bytes of per-row metadata (`MetaKind`'s arrays), before the expert ring.
pub(super) const ROW_META: u64 = 32;

impl Meta {
    /// Metadata for steps of up to `rows` rows, in `host` (pinned) and at `dev`, with the
    /// events of its per-row kinds and of its expert and grouped-expert slots.
    pub(super) fn new(
        (host, dev, rows): (PinnedHost, u64, usize),
        copied: [CudaEvent; 5],
        (expert_copied, group_copied): (Vec<CudaEvent>, Vec<CudaEvent>),
        group_off: usize,
    ) -> Meta {
        Meta {
            host,
            held: std::array::from_fn(|_| Vec::with_capacity(rows * 8)),
            valid: [false; 5],
            copied,
            span_rows: SpanRows::with_capacity(rows),
            dev,
            rows,
            expert_copied,
            expert_next: 0,
            group_copied,
            group_next: 0,
            group_off,
        }
    }

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
            MetaKind::Anc => (rows * 24, 8),
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
        // SAFETY: host holds rows * ROW_META bytes; off + bytes.len() <= rows * ROW_META by
        // the check.
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
        let off = m.rows * ROW_META as usize + slot * m.rows * 8;
        let n = rows.len() * 4;
        // SAFETY: the pinned buffer holds rows * (ROW_META + 8 x slots) bytes; this slot's two
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

    /// A grouped-expert chunk's metadata on the device through the next group slot, in one
    /// copy of what the chunk uses (its n pairs' arrays packed one after the other).
    pub(super) fn group(&mut self, stream: &CudaStream, g: &GroupHost) -> Result<GroupDev, String> {
        let m = self;
        let n = g.pairs();
        let r = g.row_ids.len();
        let biased = !g.bias[0].is_empty();
        let lens_ok = g.w.iter().all(|v| v.len() == n)
            && g.bias.iter().all(|v| v.len() == if biased { n } else { 0 })
            && g.weights.len() == n
            && g.pair_ids.len() == n
            && g.starts.len() == r + 1
            && r <= n;
        if n > m.rows || !lens_ok {
            return Err(format!(
                "a grouped expert chunk of {n} pairs and {r} rows; the backend was sized for {} (or its arrays disagree)",
                m.rows
            ));
        }
        let slot = m.group_next % m.group_copied.len().max(1);
        m.group_next = m.group_next.wrapping_add(1);
        let ev = m
            .group_copied
            .get(slot)
            .ok_or("no grouped expert metadata")?;
        ev.synchronize().map_err(|e| e.to_string())?;
        let cap = group_slot_bytes(m.rows);
        let off = m.group_off + slot * cap;
        // SAFETY: the pinned buffer holds the group slots from group_off on; this slot's
        // `cap` bytes lie inside it, and no copy reads them (its event has completed).
        let host = unsafe { std::slice::from_raw_parts_mut((m.host.ptr as *mut u8).add(off), cap) };
        let mut at = 0;
        let mut put = |bytes: &[u8]| {
            host[at..at + bytes.len()].copy_from_slice(bytes);
            at += bytes.len();
        };
        let mut offs = [0usize; 11];
        let mut o = 0;
        for (i, v) in g.w.iter().chain(&g.bias).enumerate() {
            offs[i] = o;
            v.iter().for_each(|x| put(&x.to_le_bytes()));
            o += v.len() * 8;
        }
        for (i, v) in [&g.x_rows, &g.pair_ids, &g.row_ids, &g.starts]
            .into_iter()
            .enumerate()
        {
            offs[6 + i] = o;
            v.iter().for_each(|x| put(&x.to_le_bytes()));
            o += v.len() * 4;
        }
        offs[10] = o;
        g.weights.iter().for_each(|x| put(&x.to_le_bytes()));
        let [w0, w1, w2, b0, b1, b2, x_rows, pair_ids, row_ids, starts, weights] = offs;
        let (w, bias) = ([w0, w1, w2], [b0, b1, b2]);
        let used = at;
        let dev = m.dev + off as u64;
        // SAFETY: device and pinned ranges inside their allocations (used <= cap: 68 bytes
        // a pair and 4 more at most); the host bytes stay unchanged until the event below
        // completes.
        unsafe { result::memcpy_htod_async(dev, &host[..used], stream.cu_stream()) }
            .map_err(|e| e.to_string())?;
        ev.record(stream).map_err(|e| e.to_string())?;
        let a = |o: usize| dev + o as u64;
        Ok(GroupDev {
            w: w.map(a),
            bias: bias.map(a),
            x_rows: a(x_rows),
            weights: a(weights),
            pair_ids: a(pair_ids),
            row_ids: a(row_ids),
            starts: a(starts),
        })
    }

    /// The per-row metadata of a step's spans (`SpanRows`), on the device; built in the
    /// metadata's own scratch vectors (no allocation per layer).
    pub(super) fn spans(
        &mut self,
        stream: &CudaStream,
        step: &AttnStep<'_>,
    ) -> Result<SpanMeta, String> {
        let mut r = std::mem::take(&mut self.span_rows);
        let out = r.fill(step).and_then(|()| {
            Ok(SpanMeta {
                pos: self.upload(stream, MetaKind::Pos, &r.pos)?,
                kv_dst: self.upload(stream, MetaKind::Kv, &r.kv_dst)?,
                base: self.upload(stream, MetaKind::Base, &r.base)?,
                anc: self.upload(stream, MetaKind::Anc, &r.anc)?,
            })
        });
        self.span_rows = r;
        out
    }
}

/// A step's per-row metadata as the attention and KV-store kernels read it: per batch row,
/// its position (a tree row's: its depth past the span's start), the element offset in the
/// layer's part of the KV cache where its K and V go, the element offset of its slot, and
/// its tree ancestors (0 for a causal row). Built on the host by `fill`, a pure function of
/// the step that the emulated kernel tests use too.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SpanRows {
    pub pos: Vec<u32>,
    pub kv_dst: Vec<u64>,
    pub base: Vec<u64>,
    pub anc: Vec<u64>,
}

impl SpanRows {
    fn with_capacity(rows: usize) -> SpanRows {
        SpanRows {
            pos: Vec::with_capacity(rows),
            kv_dst: Vec::with_capacity(rows),
            base: Vec::with_capacity(rows),
            anc: Vec::with_capacity(rows),
        }
    }

    /// The rows of `step`, or why its spans do not fit its cache.
    pub fn of(step: &AttnStep<'_>) -> Result<SpanRows, String> {
        let mut r = SpanRows::default();
        r.fill(step)?;
        Ok(r)
    }

    /// Refills these vectors with the rows of `step` (keeping their room).
    pub fn fill(&mut self, step: &AttnStep<'_>) -> Result<(), String> {
        let sh = step.shape;
        let width = (sh.kv_heads * sh.head_dim) as u64;
        let rows: usize = step.spans.iter().map(|s| s.n).sum();
        for v in [&mut self.kv_dst, &mut self.base, &mut self.anc] {
            v.clear();
            v.resize(rows, 0);
        }
        self.pos.clear();
        self.pos.resize(rows, 0);
        for sp in step.spans {
            check_span(sp, step, rows)?;
            for t in 0..sp.n {
                let r = sp.row + t;
                self.pos[r] = step.row_keys(sp, t).pos as u32;
                self.anc[r] = step.ancestors.get(r).copied().unwrap_or(0);
                // Offsets inside the layer's part of the cache (the caller adds its base).
                self.kv_dst[r] = (step.cache.at(&sh, sp.slot, sp.pos + t) - step.cache.base) as u64;
                self.base[r] = (sp.slot * step.cache.cap) as u64 * width;
            }
        }
        Ok(())
    }
}

fn check_span(sp: &SeqSpan, step: &AttnStep<'_>, rows: usize) -> Result<(), String> {
    let sh = &step.shape;
    if !step.cache.fits(sh, sp.pos, sp.n) || sp.slot >= sh.slots || sp.row + sp.n > rows {
        return Err(format!("span {sp:?} outside the KV cache"));
    }
    // A tree row's ancestors are rows of its own span, the row itself the last of them.
    for t in 0..sp.n {
        let a = step.ancestors.get(sp.row + t).copied().unwrap_or(0);
        if a != 0 && (sp.n > 64 || 63 - a.leading_zeros() as usize != t) {
            return Err(format!(
                "span {sp:?}: row {t}'s tree ancestors {a:#x} are not its own"
            ));
        }
    }
    Ok(())
}
