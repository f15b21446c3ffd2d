//! What streams through the slots once the split is made: each streamed unit's loads and
//! the slot size they need.

use super::costs::{Gather, UnitCosts};
use super::layout::expert_loads_per_step;
use super::{round, LayerPiece, SparseUnit};
use crate::store::format::{Manifest, RowPart};

/// What streams through the slots once the split is made: the units' loads (whole, in
/// pieces, a sparse layer's dense part and routed experts, a tied head's row parts) and
/// the slot size they need.
pub(super) struct Streamed {
    /// The embedding streams: its lookup gathers rows (`gather` is charged).
    pub gathered: bool,
    /// The row gather's bytes (zero unless `gathered`).
    pub gather: Gather,
    /// Per unit, the pieces a streamed dense layer larger than the slots loads in.
    pub pieces: Vec<Option<Vec<LayerPiece>>>,
    /// Per unit, a streamed layer of a mixture that loads its dense part and the routed
    /// experts.
    pub sparse: Vec<Option<SparseUnit>>,
    pub experts_streamed: usize,
    pub expert_slot_bytes: u64,
    /// Expert loads in flight (`expert_loads_per_step`, where experts stream).
    pub expert_reads: usize,
    pub head_parts: Vec<RowPart>,
    pub head_seams: Vec<u64>,
    /// A slot's bytes, device and host staging alike.
    pub slot_bytes: u64,
    /// Units load through slots (not when only an untied embedding streams).
    pub through_slots: bool,
    /// Device streaming slots (0 when nothing loads through them).
    pub slots: usize,
    /// Loads a pass makes through the slots: no more can be requested ahead of one.
    pub loads: usize,
}

impl Streamed {
    /// Device bytes of the streaming: the gathered rows' table and, on a discrete device,
    /// the slots.
    pub fn device_bytes(&self, unified: bool) -> u64 {
        let slots = if unified {
            0
        } else {
            self.slots as u64 * self.slot_bytes
        };
        self.gather.device + slots
    }

    /// For the split's `resident` units and its device `slots` (`cap`: the slot size it
    /// was chosen for).
    pub fn new(
        m: &Manifest,
        e: &UnitCosts,
        raw: &[u64],
        (resident, slots, cap): (&[bool], usize, u64),
        sparse_all: Vec<Option<SparseUnit>>,
        gather: Gather,
    ) -> Self {
        let streams = resident.iter().any(|r| !r);
        let gathered = streams && !resident[0];
        // Slots hold the largest streamed unit (the embedding never whole: its lookup
        // gathers rows, a tied head reads it in parts), and each head part; parts are cut
        // to fit slots of that size where they can, else of the size the split chose. A
        // dense layer larger than the slot the split chose loads in pieces.
        let pieces: Vec<Option<Vec<LayerPiece>>> = (0..raw.len())
            .map(|u| {
                (!resident[u] && u != 0)
                    .then(|| e.pieces_at(raw, u, cap))
                    .flatten()
            })
            .collect();
        let largest_streamed = (0..raw.len())
            .filter(|&u| !resident[u] && u != 0)
            .map(|u| {
                e.need_at(raw, u, cap)
                    .expect("the split streams only units whose loads fit its slots")
            })
            .max()
            .unwrap_or(0);
        let sparse: Vec<Option<SparseUnit>> = sparse_all
            .into_iter()
            .enumerate()
            .map(|(u, sp)| sp.filter(|_| !resident[u]))
            .collect();
        let experts_streamed: usize = sparse.iter().flatten().map(|sp| sp.experts.len()).sum();
        let expert_slot_bytes = sparse
            .iter()
            .flatten()
            .flat_map(|sp| sp.experts.iter().map(|x| round(x.raw.end - x.raw.start)))
            .max()
            .unwrap_or(0);
        let expert_reads = match (&m.arch.moe, experts_streamed) {
            (Some(moe), 1..) => expert_loads_per_step(moe),
            _ => 0,
        };
        let (head_parts, head_seams) = if gathered && m.arch.tied_embeddings {
            e.parts(largest_streamed)
                .or_else(|| e.parts(cap))
                .expect("the split streams the embedding only where its parts fit")
        } else {
            (Vec::new(), Vec::new())
        };
        let part_max = head_parts
            .iter()
            .map(|p| round(m.units[0].part_span(p.frames.clone(), e.direct)))
            .max()
            .unwrap_or(0);
        let through_slots = largest_streamed > 0 || !head_parts.is_empty();
        let loads = (1..raw.len())
            .filter(|&u| !resident[u])
            .map(|u| pieces[u].as_ref().map_or(1, |p| p.len()))
            .sum::<usize>()
            + head_parts.len();
        Streamed {
            gathered,
            gather: if gathered { gather } else { Gather::default() },
            pieces,
            sparse,
            experts_streamed,
            expert_slot_bytes,
            expert_reads,
            head_parts,
            head_seams,
            slot_bytes: largest_streamed.max(part_max),
            through_slots,
            slots: if through_slots { slots } else { 0 },
            loads,
        }
    }
}
