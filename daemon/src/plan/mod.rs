//! The memory planner: given the device budget, the host cache
//! budget, the batch and context limits and the manifest, decide what is resident, what
//! streams and through how many slots, and what the host keeps decompressed.
//!
//! Order of reservation: KV cache and workspace first (a step cannot run without them),
//! then streaming slots (at least 2: one computing, one loading), then whole units
//! resident, chosen to minimise the bytes streamed per pass, then the host cache.

use crate::model::decoder::{kv_cache_bytes, workspace_bytes};
use crate::model::ModelOptions;
use crate::store::format::{Manifest, UnitKind};
use crate::util::fmt_bytes;

#[cfg(test)]
mod tests;
use serde::Serialize;

/// Device allocations are rounded to this (the CPU arena's granularity; CUDA's is finer).
const ALLOC_ALIGN: u64 = 4096;
/// Streaming slots at least: one unit computes while the next uploads.
pub const STREAM_SLOTS_MIN: usize = 2;
/// Units requested from the I/O engine ahead of the one computing (host staging slots,
/// not device memory): enough to keep the disk and the decompression workers busy.
pub const PREFETCH_DEFAULT: usize = 4;

fn round(b: u64) -> u64 {
    b.div_ceil(ALLOC_ALIGN) * ALLOC_ALIGN
}

#[derive(Clone, Debug)]
pub struct PlanInput {
    /// Device memory the plan may use; None: whatever keeps every unit resident.
    pub device_budget: Option<u64>,
    /// Host memory for decompressed units that stream (0: none).
    pub host_cache_budget: u64,
    pub opts: ModelOptions,
    /// Units requested ahead of the one computing (default PREFETCH_DEFAULT).
    pub prefetch: Option<usize>,
    /// Device bytes the backend keeps for itself (CUDA: kernel metadata, cuBLAS scratch
    /// and workspace; CPU: 0), reserved before anything else.
    pub backend_reserved: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Placement {
    Resident,
    Streamed,
    /// Streamed to the device from a decompressed host copy (no disk, no decompression).
    HostCached,
}

#[derive(Clone, Debug, Serialize)]
pub struct UnitPlan {
    pub unit: String,
    pub placement: Placement,
    pub raw_bytes: u64,
    pub stored_bytes: u64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Plan {
    pub device_budget: u64,
    pub kv_cache_bytes: u64,
    pub workspace_bytes: u64,
    /// The backend's own scratch (see PlanInput::backend_reserved).
    pub backend_bytes: u64,
    pub stream_slots: usize,
    pub stream_slot_bytes: u64,
    pub resident_bytes: u64,
    pub host_cache_bytes: u64,
    pub prefetch: usize,
    pub units: Vec<UnitPlan>,
    /// Per forward pass: stored bytes read from disk, raw bytes copied from the host
    /// cache, raw bytes uploaded to the device.
    pub disk_bytes_per_pass: u64,
    pub host_cache_bytes_per_pass: u64,
    pub upload_bytes_per_pass: u64,
    /// The embedding is also the output head (tied) and streams: it loads twice a pass.
    pub embedding_loads_per_pass: usize,
}

/// The budget cannot hold even the smallest streaming plan; the numbers say what it
/// needs and the message what to change.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "device budget {} ({budget} bytes) is too small: KV cache {} + workspace {} (with backend scratch) + {slots} streaming slots of {} + {} of units larger than a slot kept resident = {} ({need} bytes) at least; raise --device-memory or lower --max-context / --max-batch",
    fmt_bytes(*budget),
    fmt_bytes(*kv_cache),
    fmt_bytes(*workspace),
    fmt_bytes(*slot),
    fmt_bytes(*oversized_resident),
    fmt_bytes(*need)
)]
pub struct PlanError {
    pub budget: u64,
    pub kv_cache: u64,
    /// Workspace and the backend's scratch.
    pub workspace: u64,
    pub slots: usize,
    /// Bytes of one streaming slot in the least plan.
    pub slot: u64,
    /// Units larger than that slot, which must stay resident.
    pub oversized_resident: u64,
    /// The least budget that runs.
    pub need: u64,
}

impl Plan {
    pub fn placement(&self, unit: usize) -> Placement {
        self.units[unit].placement
    }

    pub fn layers_resident(&self) -> usize {
        self.units
            .iter()
            .filter(|u| u.placement == Placement::Resident)
            .count()
    }

    pub fn layers_streamed(&self) -> usize {
        self.units.len() - self.layers_resident()
    }

    /// Device bytes the plan allocates at most.
    pub fn device_bytes(&self) -> u64 {
        self.kv_cache_bytes
            + self.workspace_bytes
            + self.backend_bytes
            + self.stream_slots as u64 * self.stream_slot_bytes
            + self.resident_bytes
    }

    /// The plan as a table for the start-up log.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let line = |s: &mut String, k: &str, v: String| s.push_str(&format!("  {k:<28} {v}\n"));
        s.push_str("memory plan\n");
        line(&mut s, "device budget", fmt_bytes(self.device_budget));
        line(&mut s, "KV cache", fmt_bytes(self.kv_cache_bytes));
        line(&mut s, "workspace", fmt_bytes(self.workspace_bytes));
        if self.backend_bytes > 0 {
            line(&mut s, "backend scratch", fmt_bytes(self.backend_bytes));
        }
        line(
            &mut s,
            "streaming slots",
            format!(
                "{} x {}",
                self.stream_slots,
                fmt_bytes(self.stream_slot_bytes)
            ),
        );
        line(
            &mut s,
            "resident weights",
            format!(
                "{} ({} units)",
                fmt_bytes(self.resident_bytes),
                self.layers_resident()
            ),
        );
        line(&mut s, "device total", fmt_bytes(self.device_bytes()));
        line(
            &mut s,
            "host cache",
            format!(
                "{} ({} units)",
                fmt_bytes(self.host_cache_bytes),
                self.units
                    .iter()
                    .filter(|u| u.placement == Placement::HostCached)
                    .count()
            ),
        );
        line(&mut s, "prefetch depth", self.prefetch.to_string());
        // Host staging of the I/O engine: prefetch + 1 slots of the largest streamed unit.
        let staged = self
            .units
            .iter()
            .filter(|u| u.placement == Placement::Streamed)
            .map(|u| u.raw_bytes)
            .max()
            .unwrap_or(0);
        if staged > 0 {
            line(
                &mut s,
                "host staging",
                format!("{} x {}", self.prefetch + 1, fmt_bytes(staged)),
            );
        }
        line(
            &mut s,
            "per pass from disk",
            fmt_bytes(self.disk_bytes_per_pass),
        );
        line(
            &mut s,
            "per pass from host cache",
            fmt_bytes(self.host_cache_bytes_per_pass),
        );
        line(
            &mut s,
            "per pass uploaded",
            fmt_bytes(self.upload_bytes_per_pass),
        );
        // Runs of units with the same placement, e.g. "layers 0-11 resident".
        let mut i = 0;
        while i < self.units.len() {
            let p = self.units[i].placement;
            let mut j = i;
            while j + 1 < self.units.len() && self.units[j + 1].placement == p {
                j += 1;
            }
            let name = if i == j {
                self.units[i].unit.clone()
            } else {
                format!("{} .. {}", self.units[i].unit, self.units[j].unit)
            };
            s.push_str(&format!("  {name:<28} {p:?}\n"));
            i = j + 1;
        }
        s
    }
}

/// One way to split the units between resident and streamed.
struct Candidate {
    /// Bytes streamed per pass (the tied embedding counts twice).
    streamed: u64,
    resident: Vec<bool>,
    slots: usize,
    slot_bytes: u64,
}

/// The split that streams the fewest bytes per pass within `budget` (of which `fixed`
/// is taken), trying every slot size from the largest unit down, two or three slots each:
/// units larger than the slot must be resident, then units are kept resident greedily by
/// the bytes they save per pass. None when no slot size fits.
fn choose_residency(raw: &[u64], tied: bool, budget: u64, fixed: u64) -> Option<Candidate> {
    // Value of keeping a unit resident: the bytes it would stream each pass (the tied
    // embedding streams twice: gather at the start, logits at the end).
    let value = |u: usize| raw[u] * if tied && u == 0 { 2 } else { 1 };
    let mut order: Vec<usize> = (0..raw.len()).collect();
    order.sort_by(|&x, &y| value(y).cmp(&value(x)).then(x.cmp(&y)));
    let mut sizes: Vec<u64> = raw.to_vec();
    sizes.sort_unstable_by(|x, y| y.cmp(x));
    sizes.dedup();
    let mut best: Option<Candidate> = None;
    for &s in &sizes {
        // A third slot lets an asynchronous backend upload one unit ahead.
        for n_slots in [STREAM_SLOTS_MIN + 1, STREAM_SLOTS_MIN] {
            let Some(mut left) = budget.checked_sub(fixed + n_slots as u64 * s) else {
                continue;
            };
            let mut res = vec![false; raw.len()];
            // Units larger than the slot must be resident.
            let mut ok = true;
            for u in 0..raw.len() {
                if raw[u] > s {
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
            for &u in &order {
                if !res[u] && raw[u] <= left {
                    left -= raw[u];
                    res[u] = true;
                }
            }
            let streamed: u64 = (0..raw.len()).filter(|&u| !res[u]).map(value).sum();
            // Prefer fewer bytes streamed, then more slots (deeper prefetch).
            let better = best.as_ref().is_none_or(|b| {
                streamed < b.streamed || (streamed == b.streamed && n_slots > b.slots)
            });
            if better {
                best = Some(Candidate {
                    streamed,
                    resident: res,
                    slots: n_slots,
                    slot_bytes: s,
                });
            }
        }
    }
    best
}

/// The least budget that runs: for some slot size, two slots plus every unit larger than
/// a slot kept resident.
fn least_budget_error(raw: &[u64], budget: u64, kv: u64, workspace: u64) -> PlanError {
    let fixed = kv + workspace;
    let mut sizes: Vec<u64> = raw.to_vec();
    sizes.sort_unstable_by(|x, y| y.cmp(x));
    sizes.dedup();
    let (need, slot) = sizes
        .iter()
        .map(|&s| {
            (
                fixed + STREAM_SLOTS_MIN as u64 * s + raw.iter().filter(|&&r| r > s).sum::<u64>(),
                s,
            )
        })
        .min()
        .unwrap_or((fixed, 0));
    PlanError {
        budget,
        kv_cache: kv,
        workspace,
        slots: STREAM_SLOTS_MIN,
        slot,
        oversized_resident: need - fixed - STREAM_SLOTS_MIN as u64 * slot,
        need,
    }
}

pub fn plan(m: &Manifest, input: &PlanInput) -> Result<Plan, PlanError> {
    let a = &m.arch;
    let opts = input.opts;
    if opts.max_context > a.max_context as usize {
        tracing::warn!(
            "context {} is beyond the model's trained context {}",
            opts.max_context,
            a.max_context
        );
    }
    // K and V are one allocation each.
    let kv = 2 * round(kv_cache_bytes(a, &opts) / 2);
    let ws = round(workspace_bytes(a, &opts));
    let backend = round(input.backend_reserved);
    let raw: Vec<u64> = m.units.iter().map(|u| round(u.raw_len)).collect();
    let all_resident = kv + ws + backend + raw.iter().sum::<u64>();
    let budget = input.device_budget.unwrap_or(all_resident);
    let tied = a.tied_embeddings;
    let prefetch = input.prefetch.unwrap_or(PREFETCH_DEFAULT).max(1);

    let (resident, slots, slot_bytes) = if all_resident <= budget {
        (vec![true; raw.len()], 0, 0)
    } else {
        let fixed = kv + ws + backend;
        let c = choose_residency(&raw, tied, budget, fixed)
            .ok_or_else(|| least_budget_error(&raw, budget, kv, ws + backend))?;
        // Shrink slots to the largest unit that actually streams.
        let slot_bytes = (0..raw.len())
            .filter(|&u| !c.resident[u])
            .map(|u| raw[u])
            .max()
            .unwrap_or(c.slot_bytes);
        (c.resident, c.slots, slot_bytes)
    };

    // Host cache: decompressed copies of streamed units, most bytes-per-pass first.
    let mut cached = vec![false; raw.len()];
    let mut host_left = input.host_cache_budget;
    let mut streamed_order: Vec<usize> = (0..raw.len()).filter(|&u| !resident[u]).collect();
    streamed_order.sort_by(|&x, &y| raw[y].cmp(&raw[x]).then(x.cmp(&y)));
    for u in streamed_order {
        if m.units[u].raw_len <= host_left {
            host_left -= m.units[u].raw_len;
            cached[u] = true;
        }
    }

    let mut units = Vec::with_capacity(raw.len());
    let (mut disk, mut host, mut upload) = (0u64, 0u64, 0u64);
    for (u, lu) in m.units.iter().enumerate() {
        let placement = if resident[u] {
            Placement::Resident
        } else if cached[u] {
            Placement::HostCached
        } else {
            Placement::Streamed
        };
        let loads = if tied && lu.kind == UnitKind::Embedding {
            2
        } else {
            1
        };
        match placement {
            Placement::Resident => {}
            Placement::Streamed => {
                disk += loads * lu.stored_len;
                upload += loads * lu.raw_len;
            }
            Placement::HostCached => {
                host += loads * lu.raw_len;
                upload += loads * lu.raw_len;
            }
        }
        units.push(UnitPlan {
            unit: lu.kind.to_string(),
            placement,
            raw_bytes: lu.raw_len,
            stored_bytes: lu.stored_len,
        });
    }
    let resident_bytes = (0..raw.len())
        .filter(|&u| resident[u])
        .map(|u| raw[u])
        .sum();
    let plan = Plan {
        device_budget: budget,
        kv_cache_bytes: kv,
        workspace_bytes: ws,
        backend_bytes: backend,
        stream_slots: slots,
        stream_slot_bytes: slot_bytes,
        resident_bytes,
        host_cache_bytes: input.host_cache_budget - host_left,
        prefetch: if slots == 0 { 0 } else { prefetch },
        embedding_loads_per_pass: if tied && !resident[0] {
            2
        } else {
            usize::from(!resident[0])
        },
        units,
        disk_bytes_per_pass: disk,
        host_cache_bytes_per_pass: host,
        upload_bytes_per_pass: upload,
    };
    // Assert in pairs: the plan fits the budget it was made for.
    assert!(
        plan.device_bytes() <= budget,
        "plan of {} bytes exceeds its budget {budget}",
        plan.device_bytes()
    );
    Ok(plan)
}
