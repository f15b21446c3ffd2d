//! The split: which units stay resident and through how many slots the rest stream, on a
//! discrete device (the device budget decides) and on a unified one (one host budget).

use super::costs::{choose_residency, oversized, FixedCosts, Gather, UnitCosts};
use super::error::{least_budget_error, HostBudgetError};
use super::experts::ExpertReserve;
use super::host::HostShape;
use super::{PlanError, PlanInput, STREAM_SLOTS_MIN};

/// What the split is made from.
pub(super) struct SplitInput<'a> {
    pub input: &'a PlanInput,
    pub costs: &'a UnitCosts<'a>,
    pub fixed: &'a FixedCosts,
    pub shape: &'a HostShape,
    /// The embedding's gathered rows, charged where the split streams it.
    pub gather: Gather,
    pub experts: &'a ExpertReserve,
}

/// The split for a unified backend (the CPU: one budget) or a discrete device.
pub(super) fn split(s: &SplitInput) -> Result<Split, PlanError> {
    if s.input.host.unified {
        plan_unified(s)
    } else {
        plan_discrete(s)
    }
}
/// Which units are resident and how the rest stream.
pub(super) struct Split {
    pub resident: Vec<bool>,
    /// Device streaming slots (0 on a unified backend).
    pub slots: usize,
    /// The slot size the split was chosen for (the slots may shrink to what streams).
    pub cap: u64,
    /// Host staging slots when the split chose them (unified), else None.
    pub staging: Option<usize>,
    pub device_budget: u64,
}

impl Split {
    /// Bytes of the units kept resident whole.
    pub fn resident_bytes(&self, raw: &[u64]) -> u64 {
        (0..raw.len())
            .filter(|&u| self.resident[u])
            .map(|u| raw[u])
            .sum()
    }
}

/// A discrete device (CUDA): the device budget decides the split, with two or three
/// device slots; the host stages `prefetch + 1` units.
fn plan_discrete(si: &SplitInput) -> Result<Split, PlanError> {
    let (raw, e, input) = (&si.fixed.raw, si.costs, si.input);
    let (kv, fixed, all_resident) = (si.fixed.kv, si.fixed.device, si.fixed.all_resident);
    let (gather, expert_cache) = (si.gather.device, si.experts.cache_bytes);
    let budget = input.device_budget.unwrap_or(all_resident);
    if all_resident <= budget {
        return Ok(Split {
            resident: vec![true; raw.len()],
            slots: 0,
            cap: 0,
            staging: None,
            device_budget: budget,
        });
    }
    // A third slot lets an asynchronous backend upload one unit ahead. The streamed
    // embedding's gathered rows are charged only where the split streams it (see
    // plan_unified).
    let counts = [STREAM_SLOTS_MIN + 1, STREAM_SLOTS_MIN];
    let search = |gather: u64| {
        let fixed = fixed + gather + expert_cache;
        choose_residency(raw, e, &counts, |s, n| {
            budget.checked_sub(fixed + n as u64 * s)
        })
    };
    let c = match search(0) {
        Some(c) if c.resident[0] || gather == 0 => Some(c),
        _ => search(gather),
    };
    let fixed = fixed + gather + expert_cache;
    let c =
        c.ok_or_else(|| least_budget_error(raw, e, budget, kv, fixed - kv, STREAM_SLOTS_MIN))?;
    Ok(Split {
        resident: c.resident,
        slots: c.slots,
        cap: c.slot_bytes,
        staging: None,
        device_budget: budget,
    })
}

/// A unified backend (the CPU): one budget holds the arena (KV cache, workspace, resident
/// units) and the staging slots the streamed units run from; `--device-memory`, when
/// given, caps the arena inside it.
fn plan_unified(si: &SplitInput) -> Result<Split, PlanError> {
    let (raw, e, input, h) = (&si.fixed.raw, si.costs, si.input, &si.input.host);
    let (fixed, all_resident) = (si.fixed.device, si.fixed.all_resident);
    let (reads, scratch, in_flight) = (si.shape.reads, si.shape.scratch(), si.shape.in_flight);
    let (expert_cache, expert_reads) = (si.experts.cache_bytes, si.experts.reads);
    let prefetch_want = si.shape.prefetch_want;
    let host_fixed = si.shape.fixed(h);
    let dev = input.device_budget;
    let host_room = h.budget.map(|b| b.checked_sub(host_fixed));
    let fits = |need: u64| {
        dev.is_none_or(|d| need <= d) && host_room.is_none_or(|r| r.is_some_and(|r| need <= r))
    };
    if fits(all_resident) {
        return Ok(Split {
            resident: vec![true; raw.len()],
            slots: 0,
            cap: 0,
            staging: None,
            device_budget: dev.unwrap_or(all_resident),
        });
    }
    // Streaming: room for the experts' cache and staging, and for the embedding's gathered
    // rows (see plan_once) where it streams. First without the rows, which a split that
    // keeps the embedding resident does not need (charging them anyway pushed SmolLM2's
    // tied embedding out at 64 MiB, to be streamed in row parts every step); again with
    // them only when that split streams the embedding.
    let search = |gather: Gather| {
        let (fixed, scratch) = (fixed + gather.device + expert_cache, scratch + gather.host);
        let host_room = h
            .budget
            .map(|b| b.checked_sub(h.overhead + reads + scratch));
        // Staging slots from prefetch + 1 down to two (one computing, one loading). Units are
        // staged ahead in bytes, not in units: first try depths whose slots hold the reads in
        // flight (small units need more of them ahead), then shallower ones.
        let deepest = prefetch_want + 1;
        // One computing, the reads in flight, and one more so the disk has the next unit
        // queued when a unit lands (1.2 GB Llama at 512 MiB: 2 slots 1.33 tokens/s, 3 1.75).
        // Reads that land in the slots count here as much as read buffers do.
        let want =
            |s: u64| (2 + in_flight.div_ceil(s.max(1)) as usize).clamp(STREAM_SLOTS_MIN, deepest);
        let room = |s: u64, n: usize| -> Option<u64> {
            let by_dev = match dev {
                Some(d) => Some(d.checked_sub(fixed)?),
                None => None,
            };
            let by_host = match host_room {
                Some(r) => Some(r?.checked_sub(fixed + (n + expert_reads) as u64 * s)?),
                None => None,
            };
            match (by_dev, by_host) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (Some(a), None) => Some(a),
                (None, Some(b)) => Some(b),
                (None, None) => Some(u64::MAX),
            }
        };
        let deep: Vec<usize> = (STREAM_SLOTS_MIN..=deepest).rev().collect();
        let c = choose_residency(raw, e, &deep, |sz, n| {
            if n >= want(sz) {
                room(sz, n)
            } else {
                None
            }
        })
        .or_else(|| choose_residency(raw, e, &deep, room));
        (c, fixed, scratch)
    };
    let (c, fixed, scratch) = match search(Gather::default()) {
        (Some(c), fixed, scratch) if c.resident[0] || si.gather == Gather::default() => {
            (Some(c), fixed, scratch)
        }
        _ => search(si.gather),
    };
    match c {
        Some(c) => {
            let arena = fixed
                + (0..raw.len())
                    .filter(|&u| c.resident[u])
                    .map(|u| raw[u])
                    .sum::<u64>();
            Ok(Split {
                resident: c.resident,
                slots: 0,
                cap: c.slot_bytes,
                staging: Some(c.slots),
                device_budget: dev.unwrap_or(arena),
            })
        }
        None => Err(unified_least(si, fixed, scratch)),
    }
}

/// The error of a unified split that found no plan: the least that runs is, for some
/// slot size, units larger than it resident (in the arena, within --device-memory), two
/// staging slots of it and, for a mixture, the slots its expert loads land in (as the
/// search counts them: without them the least a mixture's error named did not run).
/// `fixed` and `scratch`: the device's and the host's fixed roles as the last search
/// charged them.
fn unified_least(si: &SplitInput, fixed: u64, scratch: u64) -> PlanError {
    let (raw, e, h) = (&si.fixed.raw, si.costs, &si.input.host);
    let dev = si.input.device_budget;
    let least = oversized(raw, e)
        .into_iter()
        .filter(|&(big, _)| dev.is_none_or(|d| fixed + big <= d))
        .map(|(big, s)| {
            let staged = (STREAM_SLOTS_MIN + si.experts.reads) as u64 * s;
            (fixed + big, staged)
        })
        .min_by_key(|&(arena, staged)| arena + staged);
    let kv = si.fixed.kv;
    match (least, h.budget) {
        (Some((arena, staged)), Some(_)) => {
            let roles = [
                si.shape.reads,
                scratch,
                arena,
                staged,
                0,
                si.fixed.cpu.total(),
            ];
            PlanError::Host(HostBudgetError::new(h, roles))
        }
        _ => least_budget_error(raw, e, dev.unwrap_or(0), kv, fixed - kv, 0),
    }
}
