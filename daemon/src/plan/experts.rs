//! A mixture's experts in the plan: what the split reserves for them, and what the
//! memory it leaves holds (the dense parts of streamed layers, then the expert cache).

use super::costs::UnitCosts;
use super::layout::expert_loads_per_step;
use super::streamed::Streamed;
use super::{round, PlanInput, SparseUnit};
use crate::store::format::Manifest;

/// What the split leaves room for, should a mixture's layers stream: the expert cache's
/// slots (`--expert-cache`, else one on a discrete device, whose experts run from there;
/// none on a unified one, whose experts can run from staging) and the staging slots of
/// the expert loads in flight.
pub(super) struct ExpertReserve {
    /// The cache's slots kept for it whatever the dense parts take (`--expert-cache`, or
    /// the backend's least).
    pub cache_base: usize,
    /// Device bytes the split reserves for the cache: `cache_base` slots, or without
    /// `--expert-cache` a profile's hot set and a step's loads too.
    pub cache_bytes: u64,
    /// Staging slots of expert loads in flight.
    pub reads: usize,
}

impl ExpertReserve {
    pub fn new(
        m: &Manifest,
        input: &PlanInput,
        costs: &UnitCosts,
        sparse_all: &[Option<SparseUnit>],
    ) -> Self {
        let sparse = || {
            costs
                .sparse
                .iter()
                .zip(sparse_all)
                .filter_map(|(c, sp)| c.and(sp.as_ref()))
        };
        let expert_max = sparse()
            .flat_map(|sp| sp.experts.iter().map(|x| round(x.raw.end - x.raw.start)))
            .max()
            .unwrap_or(0);
        let experts_all: usize = sparse().map(|sp| sp.experts.len()).sum();
        let moe = m.arch.moe.as_ref();
        let loads_min = moe.map_or(1, expert_loads_per_step);
        let cache_base = match input.expert_cache {
            Some(n) => n.min(experts_all),
            None if input.host.unified => 0,
            None => 1,
        };
        // A profile's hot set and a step's loads come after the dense parts
        // (`ExpertResidency`), unless --expert-cache says.
        let cache_min = match (input.expert_cache, input.expert_profile) {
            (None, Some(hot)) => (hot + loads_min).min(experts_all).max(cache_base),
            _ => cache_base,
        };
        ExpertReserve {
            cache_base,
            cache_bytes: cache_min as u64 * expert_max,
            reads: match moe {
                Some(moe) if expert_max > 0 => expert_loads_per_step(moe),
                _ => 0,
            },
        }
    }
}

/// What the memory the split leaves holds of a mixture's streamed layers: first their
/// dense parts stay resident (each saves all its bytes every pass, more than an expert
/// slot can), then the expert cache takes the rest (the slots reserved for it are kept
/// for it).
pub(super) struct ExpertResidency {
    /// Per unit, a streamed sparse layer whose dense part is resident.
    pub dense_resident: Vec<bool>,
    pub dense_resident_bytes: u64,
    pub cache_slots: usize,
    /// Of those, the slots a profile's hottest experts hold for good.
    pub hot_slots: usize,
}

impl ExpertResidency {
    /// `left`: the memory the split leaves (None: not limited).
    pub fn new(
        input: &PlanInput,
        reserve: &ExpertReserve,
        st: &Streamed,
        left: Option<u64>,
    ) -> Self {
        let cache_kept = match input.expert_cache {
            Some(asked) => asked,
            None => reserve.cache_base,
        }
        .min(st.experts_streamed) as u64
            * st.expert_slot_bytes;
        let mut room = left.map(|l| l.saturating_sub(cache_kept));
        let dense_resident: Vec<bool> = st
            .sparse
            .iter()
            .map(|sp| {
                let Some(sp) = sp else { return false };
                let need = round(sp.dense_raw);
                let fits = room.is_none_or(|r| need <= r);
                if fits {
                    room = room.map(|r| r - need);
                }
                fits
            })
            .collect();
        let dense_resident_bytes: u64 = st
            .sparse
            .iter()
            .zip(&dense_resident)
            .filter(|(_, &d)| d)
            .filter_map(|(sp, _)| sp.as_ref().map(|sp| round(sp.dense_raw)))
            .sum();
        let cache_slots = match (st.experts_streamed, input.expert_cache) {
            (0, _) => 0,
            (n, Some(asked)) => asked.min(n),
            (n, None) => {
                let fits = room.map_or(n, |l| (l / st.expert_slot_bytes.max(1)) as usize);
                (fits + reserve.cache_base).min(n)
            }
        };
        // With a profile, the cache keeps room for one step's expert loads to come and go;
        // the rest holds the profile's hottest experts for good.
        let hot_slots = if input.expert_profile.is_some() {
            cache_slots.saturating_sub(st.expert_reads.max(1))
        } else {
            0
        };
        ExpertResidency {
            dense_resident,
            dense_resident_bytes,
            cache_slots,
            hot_slots,
        }
    }

    /// Device bytes of the expert cache.
    pub fn cache_bytes(&self, st: &Streamed) -> u64 {
        self.cache_slots as u64 * st.expert_slot_bytes
    }
}
