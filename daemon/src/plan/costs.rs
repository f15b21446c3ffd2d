//! What streaming or keeping each unit costs, and the residency search over slot sizes.

use super::{layer_pieces, round, LayerPiece, SparseUnit, ALLOC_ALIGN};
use crate::model::decoder::{kv_cache_bytes_of, workspace_bytes};
use crate::model::ModelOptions;
use crate::store::format::{Manifest, UnitKind};

/// One way to split the units between resident and streamed.
pub(super) struct Candidate {
    /// Bytes streamed per pass (the tied embedding counts twice).
    pub streamed: u64,
    pub resident: Vec<bool>,
    /// Streamed units that load in pieces at this slot size.
    pub pieced: usize,
    pub slots: usize,
    pub slot_bytes: u64,
}

/// The split that streams the fewest bytes per pass, trying every slot size `s` from the
/// largest unit down and each slot count `n` of `counts`; `room(s, n)` is the memory left
/// for resident units with `n` slots of `s` (None: they do not fit). Units larger than the
/// slot must be resident, then units are kept resident greedily by the bytes they save per
/// pass. None when no slot size fits.
pub(super) fn choose_residency(
    raw: &[u64],
    e: &UnitCosts,
    counts: &[usize],
    room: impl Fn(u64, usize) -> Option<u64>,
) -> Option<Candidate> {
    let value = |u: usize| e.value(raw, u);
    // Among units of equal value, in bit-reversed index order: those left to stream are
    // then spread over the pass (each load overlaps resident units' compute) rather than
    // bunched at its end.
    let bits = usize::BITS - raw.len().max(1).leading_zeros();
    let spread = |u: usize| (u.reverse_bits() >> (usize::BITS - bits), u);
    let mut order: Vec<usize> = (0..raw.len()).collect();
    order.sort_by(|&x, &y| value(y).cmp(&value(x)).then(spread(x).cmp(&spread(y))));
    let mut sizes: Vec<u64> = (0..raw.len()).flat_map(|u| e.needs(raw, u)).collect();
    sizes.sort_unstable_by(|x, y| y.cmp(x));
    sizes.dedup();
    let mut best: Option<Candidate> = None;
    for &s in &sizes {
        for &n_slots in counts {
            let Some(mut left) = room(s, n_slots) else {
                continue;
            };
            let mut res = vec![false; raw.len()];
            // Units that cannot stream through slots of `s` must be resident.
            let mut ok = true;
            for u in 0..raw.len() {
                if !e.streams_at(raw, u, s) {
                    if raw[u] > left {
                        ok = false;
                        break;
                    }
                    left -= raw[u];
                    res[u] = true;
                }
            }
            if !ok {
                continue;
            }
            // A mixture's layer that can stream sparsely is not kept whole: the room is
            // worth more as resident dense parts (all their bytes saved every pass) and
            // expert cache slots (the experts routed most, of every layer) than as one
            // layer's experts, most of which a pass leaves unread.
            for &u in &order {
                if !res[u] && raw[u] <= left && !e.sparse_unit(u) {
                    left -= raw[u];
                    res[u] = true;
                }
            }
            let streamed: u64 = (0..raw.len()).filter(|&u| !res[u]).map(value).sum();
            let pieced = (0..raw.len())
                .filter(|&u| !res[u] && e.need(raw, u) > s)
                .count();
            // Prefer fewer bytes streamed, then whole loads over pieces, then more slots
            // (deeper prefetch).
            let better = best.as_ref().is_none_or(|b| {
                (streamed, pieced, std::cmp::Reverse(n_slots))
                    < (b.streamed, b.pieced, std::cmp::Reverse(b.slots))
            });
            if better {
                best = Some(Candidate {
                    streamed,
                    resident: res,
                    pieced,
                    slots: n_slots,
                    slot_bytes: s,
                });
            }
        }
    }
    best
}

/// For each slot size: (bytes of units that cannot stream through it, which must be
/// resident, the size).
pub(super) fn oversized(raw: &[u64], e: &UnitCosts) -> Vec<(u64, u64)> {
    let mut sizes: Vec<u64> = (0..raw.len()).flat_map(|u| e.needs(raw, u)).collect();
    sizes.sort_unstable_by(|x, y| y.cmp(x));
    sizes.dedup();
    sizes
        .iter()
        .map(|&s| {
            let big = (0..raw.len())
                .filter(|&u| !e.streams_at(raw, u, s))
                .map(|u| raw[u])
                .sum::<u64>();
            (big, s)
        })
        .collect()
}

/// What streaming a unit costs, where it is not simply its bytes: a sparse layer of a
/// mixture (`SparseUnit`), and the embedding (unit 0). Its lookup reads only the frames that
/// hold the step's rows (a frame per distinct token), so an untied embedding needs no
/// staging slot at all; a tied one is also the output head, read once a pass in row parts
/// that each fit a slot (`LayerUnit::row_parts`).
pub(super) struct UnitCosts<'m> {
    pub unit: &'m crate::store::format::LayerUnit,
    /// The table and its row bytes; None: not a decoder's embedding (it stays resident).
    pub table: Option<(&'m crate::store::format::TensorEntry, u64)>,
    pub tied: bool,
    /// Parts are read straight into the slots (the unit is stored as raw).
    pub direct: bool,
    /// Bytes the lookup reads per pass, estimated: a frame per sequence of the batch.
    pub gather: u64,
    /// Per unit that can stream sparsely: (the slot bytes its largest load needs, the raw
    /// bytes a pass loads of it, estimated as the dense part and one expert per routing
    /// choice of a full batch, all of them at most).
    pub sparse: Vec<Option<(u64, u64)>>,
    /// Per dense layer that can load in pieces (`layer_pieces`): the slot bytes its
    /// largest piece needs, and the pieces.
    pub pieced: Vec<Option<(u64, Vec<LayerPiece>)>>,
}

impl<'m> UnitCosts<'m> {
    pub fn new(
        m: &'m Manifest,
        opts: &ModelOptions,
        sparse: &[Option<SparseUnit>],
        piece_min: u64,
    ) -> Self {
        let unit = &m.units[0];
        let table = unit
            .tensor("model.embed_tokens.weight")
            .filter(|_| unit.kind == UnitKind::Embedding)
            .and_then(|t| {
                let cols = *t.shape.last()?;
                Some((t, t.dtype.row_bytes(cols)?))
            })
            .filter(|&(_, rb)| rb > 0);
        let frame = unit.frame_stored_max();
        let sparse = sparse
            .iter()
            .zip(&m.units)
            .map(|(sp, lu)| {
                let sp = sp.as_ref()?;
                let moe = m.arch.moe.as_ref()?;
                let direct = lu.stored_as_raw();
                let need = sp
                    .experts
                    .iter()
                    .map(|x| round(lu.part_span(x.frames.clone(), direct)))
                    .chain([round(lu.part_span(sp.dense_frames.clone(), direct))])
                    .max()?;
                let n = sp.experts.len() as u64;
                let expert_raw = (lu.raw_len - sp.dense_raw) / n.max(1);
                let routed = (moe.top_k as u64 * opts.logit_rows() as u64).min(n);
                Some((need, sp.dense_raw + routed * expert_raw))
            })
            .collect();
        let pieced = (0..m.units.len())
            .map(|u| {
                let pieces = layer_pieces(m, u, piece_min)?;
                let lu = &m.units[u];
                let direct = lu.stored_as_raw();
                let need = pieces
                    .iter()
                    .map(|p| round(lu.part_span(p.frames.clone(), direct)))
                    .max()?;
                Some((need, pieces))
            })
            .collect();
        UnitCosts {
            unit,
            table,
            tied: m.arch.tied_embeddings,
            direct: unit.stored_as_raw(),
            gather: (frame * opts.logit_rows() as u64).min(unit.stored_len),
            sparse,
            pieced,
        }
    }

    /// Unit `u` is a mixture's layer that can stream sparsely.
    pub fn sparse_unit(&self, u: usize) -> bool {
        matches!(self.sparse.get(u), Some(Some(_)))
    }

    /// The slot bytes unit `u` needs to stream (its sparse loads' largest, else the unit).
    pub fn need(&self, raw: &[u64], u: usize) -> u64 {
        match self.sparse.get(u) {
            Some(Some((need, _))) => *need,
            _ => raw[u],
        }
    }

    /// The slot sizes unit `u` can stream through: whole (`need`), and in pieces.
    pub fn needs(&self, raw: &[u64], u: usize) -> impl Iterator<Item = u64> {
        let pieced = self.pieced.get(u).and_then(|p| p.as_ref()).map(|p| p.0);
        [Some(self.need(raw, u)), pieced].into_iter().flatten()
    }

    /// The slot bytes unit `u` needs to stream through slots of `s` bytes: whole where it
    /// fits, else in pieces where those fit (None: neither).
    pub fn need_at(&self, raw: &[u64], u: usize, s: u64) -> Option<u64> {
        self.needs(raw, u).find(|&n| n <= s)
    }

    /// The pieces unit `u` loads in through slots of `s` bytes (None: it loads whole).
    pub fn pieces_at(&self, raw: &[u64], u: usize, s: u64) -> Option<Vec<LayerPiece>> {
        match self.pieced.get(u) {
            Some(Some((need, pieces))) if self.need(raw, u) > s && *need <= s => {
                Some(pieces.clone())
            }
            _ => None,
        }
    }

    /// The tied head's row parts through slots of `cap` bytes and the rows between them
    /// (None: the frames cannot be cut to fit).
    pub fn parts(&self, cap: u64) -> Option<(Vec<crate::store::format::RowPart>, Vec<u64>)> {
        let (t, rb) = self.table?;
        self.unit.row_parts(t, rb, cap, self.direct)
    }

    /// Unit `u` can stream through slots of `s` bytes.
    pub fn streams_at(&self, raw: &[u64], u: usize, s: u64) -> bool {
        if u != 0 || self.table.is_none() {
            return self.need_at(raw, u, s).is_some();
        }
        !self.tied || self.parts(s).is_some()
    }

    /// Bytes a pass streams if unit `u` is not resident (the planner keeps the most
    /// valuable units resident).
    pub fn value(&self, raw: &[u64], u: usize) -> u64 {
        match (u, self.table, self.sparse.get(u)) {
            (0, Some(_), _) => self.gather + if self.tied { raw[0] } else { 0 },
            (_, _, Some(Some((_, pass)))) => *pass,
            _ => raw[u],
        }
    }
}

/// The device's fixed roles and each unit's bytes, as allocated (rounded to
/// `ALLOC_ALIGN`).
pub(super) struct FixedCosts {
    /// K and V, one allocation each.
    pub kv: u64,
    pub workspace: u64,
    /// The backend's own (`PlanInput::backend_reserved`).
    pub backend: u64,
    /// A self-draft's (`PlanInput::self_draft_reserved`).
    pub self_draft: u64,
    /// Per unit, its raw bytes.
    pub raw: Vec<u64>,
    /// KV cache, workspace and the backend's: what a step cannot run without.
    pub device: u64,
    /// The layers computed on the host CPU: none of their bytes is the device's.
    pub cpu: CpuPart,
    /// `device` and every unit resident.
    pub all_resident: u64,
    /// The first unit computed on another device (`devices`; past the last decoder layer
    /// without other devices).
    pub others_from: usize,
}

/// What the decoder layers computed on the host CPU hold there (`HostInput::cpu_layers`):
/// the host backend's arena (their weights, their KV cache, a workspace) and its threads'
/// scratch.
#[derive(Clone, Copy, Debug, Default)]
pub(super) struct CpuPart {
    pub layers: usize,
    pub weights: u64,
    pub kv: u64,
    pub workspace: u64,
    pub scratch: u64,
}

impl CpuPart {
    pub fn total(&self) -> u64 {
        self.weights + self.kv + self.workspace + self.scratch
    }
}

impl FixedCosts {
    pub fn new(m: &Manifest, input: &super::PlanInput) -> Self {
        let a = &m.arch;
        let (n, cpu_layers) = (a.n_layers as usize, input.host.cpu_layers);
        // The first device's layers; those after them are other devices' (`devices`).
        let first = super::devices::first_layers(m, input);
        let on_cpu = |u: usize| (1..=cpu_layers).contains(&u);
        let on_other = |u: usize| u > first.end && u <= n;
        let kv = 2 * round(kv_cache_bytes_of(a, &input.opts, first.clone()) / 2);
        let workspace = round(workspace_bytes(a, &input.opts));
        let backend = round(input.backend_reserved);
        let self_draft = round(input.self_draft_reserved);
        // A unit computed on the host or another device costs this device nothing.
        let raw: Vec<u64> = (m.units.iter().enumerate())
            .map(|(u, lu)| match on_cpu(u) || on_other(u) {
                true => 0,
                false => round(lu.raw_len),
            })
            .collect();
        let cpu = if cpu_layers == 0 {
            CpuPart::default()
        } else {
            CpuPart {
                layers: cpu_layers,
                weights: (1..=cpu_layers).map(|u| round(m.units[u].raw_len)).sum(),
                kv: 2 * round(kv_cache_bytes_of(a, &input.opts, 0..cpu_layers) / 2),
                workspace,
                scratch: round(input.host.cpu_scratch),
            }
        };
        let device = kv + workspace + backend + self_draft;
        FixedCosts {
            kv,
            workspace,
            backend,
            self_draft,
            all_resident: device + raw.iter().sum::<u64>(),
            raw,
            device,
            cpu,
            others_from: first.end + 1,
        }
    }
}

/// A streamed embedding's lookup: a device table of a step's rows, and on the host the
/// rows, a frame's read buffer and its decoded bytes (reserved in every streaming plan,
/// dropped when the embedding stays resident). A tied one is also the head, streamed in
/// row parts whose logits are gathered on the host, a vocabulary of f32 per logit row
/// (`Decoder::head_norm`): 9 MiB for Gemma 3 verifying an 8-token draft.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Gather {
    pub device: u64,
    pub host: u64,
}

impl Gather {
    pub fn new(m: &Manifest, opts: &ModelOptions, costs: &UnitCosts) -> Self {
        let Some((_, rb)) = costs.table else {
            return Gather::default();
        };
        // A step's rows, and for a tied head the seam rows between its parts (at most a
        // row per frame boundary), kept on the device.
        let seams = if m.arch.tied_embeddings {
            m.units[0].frames.len() as u64
        } else {
            0
        };
        let table = (opts.max_batch_tokens as u64 + seams) * rb;
        let head_logits = if m.arch.tied_embeddings {
            4 * opts.logit_rows() as u64 * m.arch.vocab as u64
        } else {
            0
        };
        Gather {
            device: round(table),
            host: round(
                gather_host_bytes(
                    m.frame_stored_len_max(),
                    u64::from(m.frame_raw_len_max()),
                    table,
                ) + head_logits,
            ),
        }
    }
}

/// Host bytes a streamed embedding's row gather holds (the pipeline's `RowGather`): a
/// frame's read buffer with its O_DIRECT alignment at both ends, the decoded frame and
/// the gathered rows.
pub fn gather_host_bytes(frame_stored_max: u64, frame_raw_max: u64, table_bytes: u64) -> u64 {
    frame_stored_max + 2 * ALLOC_ALIGN + frame_raw_max + table_bytes
}
