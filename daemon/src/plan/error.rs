//! Why a plan cannot be made: the device or the host budget is too small, each error
//! naming every role with its bytes and the least budget that runs.

use super::costs::{oversized, UnitCosts};
use super::HostInput;
use crate::util::fmt_bytes;

/// A plan that cannot be made: the device budget or the host budget is too small.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PlanError {
    #[error(transparent)]
    Device(#[from] DeviceBudgetError),
    #[error(transparent)]
    Host(#[from] HostBudgetError),
    /// A placement that cannot be (`--cpu-layers` past the model, or without a device).
    #[error("{0}")]
    Placement(String),
}

impl PlanError {
    /// The least budget (of the kind that was short) that runs.
    pub fn need(&self) -> u64 {
        match self {
            PlanError::Device(e) => e.need,
            PlanError::Host(e) => e.need,
            PlanError::Placement(_) => 0,
        }
    }
}

/// The device budget cannot hold even the smallest streaming plan; the numbers say what
/// it needs and the message what to change.
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
pub struct DeviceBudgetError {
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

/// The host budget cannot hold the least plan: every host role with its bytes.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error(
    "host budget {} ({budget} bytes) is too small: process overhead {} + read buffers {} + scratch (decoders, compute, logits and samplers) {} + {} {} + staging slots {}{}{} = {} ({need} bytes) at least; raise --host-memory, or lower --max-context / --max-batch / --draft-max{}",
    fmt_bytes(*budget),
    fmt_bytes(*overhead),
    fmt_bytes(*reads),
    fmt_bytes(*scratch),
    if *unified { "device arena (KV cache, workspace, units that must stay resident)" } else { "host cache" },
    fmt_bytes(*device),
    fmt_bytes(*staging),
    if *load_transient > 0 { format!(" + loading staging {}", fmt_bytes(*load_transient)) } else { String::new() },
    if *cpu_layers > 0 { format!(" + layers computed on the CPU (weights, KV cache, workspace, scratch) {}", fmt_bytes(*cpu_layers)) } else { String::new() },
    fmt_bytes(*need),
    if *cpu_layers > 0 { " / --cpu-layers" } else { "" }
)]
pub struct HostBudgetError {
    pub budget: u64,
    pub overhead: u64,
    pub reads: u64,
    pub scratch: u64,
    /// The arena on a unified backend (host cache on a discrete one).
    pub device: u64,
    pub staging: u64,
    pub load_transient: u64,
    /// The layers computed on the host CPU (`HostInput::cpu_layers`).
    pub cpu_layers: u64,
    pub need: u64,
    pub unified: bool,
}

impl HostBudgetError {
    /// The error for `h`'s budget with these roles: reads, scratch, the arena (unified) or
    /// host cache, staging, loading staging, the layers computed on the CPU; the need is
    /// their sum with the overhead.
    pub(super) fn new(
        h: &HostInput,
        [reads, scratch, held, staging, load_transient, cpu_layers]: [u64; 6],
    ) -> Self {
        HostBudgetError {
            budget: h.budget.unwrap_or(0),
            overhead: h.overhead,
            reads,
            scratch,
            device: held,
            staging,
            load_transient,
            cpu_layers,
            need: h.overhead + reads + scratch + held + staging + load_transient + cpu_layers,
            unified: h.unified,
        }
    }
}

/// The least device budget that runs: for some slot size, `slots` slots (2 on a discrete
/// device, 0 where units run from host staging) plus every unit larger than a slot kept
/// resident.
pub(super) fn least_budget_error(
    raw: &[u64],
    e: &UnitCosts,
    budget: u64,
    kv: u64,
    workspace: u64,
    slots: usize,
) -> PlanError {
    let fixed = kv + workspace;
    let (need, slot) = oversized(raw, e)
        .into_iter()
        .map(|(big, s)| (fixed + slots as u64 * s + big, s))
        .min()
        .unwrap_or((fixed, 0));
    PlanError::Device(DeviceBudgetError {
        budget,
        kv_cache: kv,
        workspace,
        slots,
        slot,
        oversized_resident: need - fixed - slots as u64 * slot,
        need,
    })
}
