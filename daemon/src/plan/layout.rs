//! How a unit can stream other than whole: a mixture's layer as its dense part and one
//! load per routed expert, a dense layer in pieces cut where its projections start.
//!
//! Pieces let more stay resident: the slots then hold pieces, not layers. On the 1.2 GB
//! random Llama (Q8_0, 44.6 MiB layers) at `--host-memory 768MiB`, `sluiced run
//! --max-context 256` planned 3 slots of 44.6 MiB (134 MiB) before pieces and 5 of 11.7 MiB
//! (58 MiB) after; `bench-stream --batch 1` kept 13 of its 26 units resident before and 15
//! after, and ran 3.94-4.15 tokens/s before and 4.46-4.78 after (three alternating rounds;
//! at 512 MiB 2.70-2.90 and 2.92-3.13).

pub use crate::model::decoder::LAYER_PHASES;
use crate::store::arch::MoeConfig;
use crate::store::format::{ExpertRange, Manifest, UnitKind, BLOB_ALIGN};
use serde::Serialize;
use std::ops::Range;

/// A decoder layer of a mixture of experts that streams sparsely: its dense part
/// (norms, attention, router) is one load, and each expert a step routes to is a load of
/// its own (`LayerUnit::experts`: one run of frames, a page-aligned raw range).
#[derive(Clone, Debug, Serialize)]
pub struct SparseUnit {
    /// The dense part's frames (the unit's first, up to the first expert's) and raw bytes.
    pub dense_frames: Range<usize>,
    pub dense_raw: u64,
    pub experts: Vec<ExpertRange>,
}

/// Unit `u` as a sparse unit, when it can stream that way: a layer of the mixture whose
/// experts are laid out one run each, after everything else of the layer.
pub fn sparse_unit(m: &Manifest, u: usize) -> Option<SparseUnit> {
    let unit = m.units.get(u)?;
    let UnitKind::Decoder(i) = unit.kind else {
        return None;
    };
    let moe = m.arch.moe.as_ref().filter(|_| m.arch.is_sparse(i))?;
    let experts = unit.experts()?;
    let first = experts.first()?;
    let last = experts.last()?;
    if experts.len() != moe.n_experts as usize
        || first.frames.start == 0
        || last.raw.end != unit.raw_len
    {
        return None;
    }
    Some(SparseUnit {
        dense_frames: 0..first.frames.start,
        dense_raw: first.raw.start,
        experts,
    })
}

/// A piece of a dense layer that streams in pieces: a run of its unit's frames holding
/// the whole tensors of consecutive phases (`LAYER_PHASES`), loaded into a staging slot
/// sized for it, and run as soon as it lands.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct LayerPiece {
    pub frames: Range<usize>,
    /// The raw offset in its unit of its first byte.
    pub raw_base: u64,
    pub phases: Range<usize>,
}

/// Unit `u` cut into pieces where a feed-forward projection starts a frame, so that a slot
/// need hold only the largest piece, not the layer: a dense decoder layer (a mixture's
/// layer streams its experts instead) laid out as `lay_out` writes one, its vectors and
/// attention first, then the gate, up and down projections. A store read straight into
/// the slots (stored as raw) is cut only where the frame starts O_DIRECT-aligned in the
/// file. A model with a norm after its feed-forward block (Gemma 2 and 3) keeps the first
/// piece, where that norm lies, until the last has run (`Decoder::first_piece_to_end`).
/// No piece is smaller than `min_bytes` (the plan's largest read request): a load smaller
/// than one read cannot keep the disk busy by itself, and each costs a request and a
/// hand-off (SmolLM2 stored raw at `--host-memory 64MiB`, in pieces of 0.55 MB against
/// layers of 2.1 MB streamed whole: 25.9-28.9 tokens/s against 29.8-36.7, three
/// alternating rounds of `bench-stream`, though it read 7 % less). None where no cut can
/// be made.
pub fn layer_pieces(m: &Manifest, u: usize, min_bytes: u64) -> Option<Vec<LayerPiece>> {
    let unit = m.units.get(u)?;
    let UnitKind::Decoder(i) = unit.kind else {
        return None;
    };
    if m.arch.is_sparse(i) {
        return None;
    }
    let mlp = ["gate_proj", "up_proj", "down_proj"]
        .map(|n| unit.tensor(&format!("model.layers.{i}.mlp.{n}.weight")));
    let [Some(gate), Some(up), Some(down)] = mlp else {
        return None;
    };
    let others_first = unit
        .tensors
        .iter()
        .filter(|t| ![gate, up, down].iter().any(|x| x.name == t.name))
        .all(|t| t.offset + t.len <= gate.offset);
    if !others_first || gate.offset >= up.offset || up.offset >= down.offset {
        return None;
    }
    let direct = unit.stored_as_raw();
    // (first frame, phase) where a piece may start.
    let cuts: Vec<(usize, usize)> = [gate, up, down]
        .iter()
        .enumerate()
        .filter_map(|(k, t)| {
            let f = unit.frames.iter().position(|f| f.raw_offset == t.offset)?;
            let aligned = unit.frames[f].file_offset.is_multiple_of(BLOB_ALIGN);
            (!direct || aligned).then_some((f, k + 1))
        })
        .collect();
    // Cuts that leave every piece `min_bytes` at least.
    let mut starts = vec![(0, 0)];
    for (f, phase) in cuts {
        let at = unit.frames[f].raw_offset;
        let from = unit.frames[starts[starts.len() - 1].0].raw_offset;
        if at - from >= min_bytes && unit.raw_len - at >= min_bytes {
            starts.push((f, phase));
        }
    }
    if starts.len() < 2 {
        return None;
    }
    let pieces = starts
        .iter()
        .enumerate()
        .map(|(j, &(f, phase))| {
            let (f_end, p_end) = starts
                .get(j + 1)
                .copied()
                .unwrap_or((unit.frames.len(), LAYER_PHASES));
            LayerPiece {
                frames: f..f_end,
                raw_base: unit.frames[f].raw_offset,
                phases: phase..p_end,
            }
        })
        .collect();
    Some(pieces)
}

/// Expert loads a step keeps in flight: one row's choices and as many again (a batch's
/// union, the predicted ones), within the experts there are.
pub(super) fn expert_loads_per_step(moe: &MoeConfig) -> usize {
    (2 * moe.top_k as usize)
        .min(moe.n_experts as usize)
        .clamp(1, 16)
}
