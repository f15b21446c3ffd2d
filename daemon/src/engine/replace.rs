//! `--placement auto` while serving: the placement follows the batch. The scheduler
//! counts each pass's rows (`plan::placement::Follow`); once another count of host layers
//! has saved, by the predictions at the rows the passes carried, what a change costs, the
//! engine stops between two passes and changes: every slot's KV that anyone will read
//! (the running sequences' and the prefix cache's kept slots') is copied to the host
//! (`Pipeline::export_slot`), the pipeline is given up (its device and host memory with
//! it), the new placement's is built, and the KV written back into it
//! (`Pipeline::import_slot`). A sequence goes on from the same KV as the new placement
//! computes: on the CPU emulating a device, one device's tokens bit for bit; on a GPU the
//! host's layers round as the CPU's kernels do (as with `--cpu-layers`). What a change took
//! is measured and is the next one's cost. A pipeline that cannot be built at the new
//! placement leaves the old one built again, that placement is not tried again, and the
//! choice is followed from there.

use super::EngineError;
use crate::backend::Backend;
use crate::pipeline::{PassStats, Pipeline, SlotKv};
use crate::plan::placement::{Choice, Follow};
use crate::plan::PlanInput;
use serde::Serialize;
use std::time::Instant;

/// Builds the model's pipeline for a plan input (the store and backend fixed).
pub type Rebuild<B> = Box<dyn Fn(&PlanInput) -> Result<Pipeline<B>, EngineError> + Send>;

/// What Status says of the placement followed.
#[derive(Clone, Debug, Default, Serialize)]
pub struct Following {
    /// Host layers of the placement in use.
    pub cpu_layers: usize,
    /// Changes made, and those given up (the new placement failed to build).
    pub changes: u64,
    pub failed: u64,
    /// Seconds the last change stopped the engine for (what the next is reckoned to
    /// cost), and the KV bytes it carried across.
    pub last_change_s: f64,
    pub last_change_kv_bytes: u64,
    /// Seconds every change (and change given up) stopped the engine for.
    pub change_s_total: f64,
    /// The choice the last change made: the rows it was made for, every placement's
    /// prediction at them.
    #[serde(skip)]
    pub choice: Option<Choice>,
    /// The plan in use.
    #[serde(skip)]
    pub plan: Option<std::sync::Arc<crate::plan::Plan>>,
}

/// The placement's follower: the rule, how to build a pipeline, and what was done.
pub struct Replacer<B: Backend> {
    follow: Follow,
    input: PlanInput,
    rebuild: Rebuild<B>,
    pub status: Following,
    /// The replaced pipelines' pass totals and I/O counters, summed, and the tokens their
    /// mixtures routed to each expert.
    pub before: (PassStats, crate::io::IoStats),
    pub expert_tokens: Vec<Vec<u64>>,
}

impl<B: Backend> Replacer<B> {
    /// Follows from `input`'s placement (its `host.cpu_layers`), with `follow`'s rule,
    /// building pipelines with `rebuild`.
    pub fn new(follow: Follow, input: PlanInput, rebuild: Rebuild<B>) -> Replacer<B> {
        let status = Following {
            cpu_layers: follow.cpu_layers(),
            ..Following::default()
        };
        Replacer {
            follow,
            input,
            rebuild,
            status,
            before: Default::default(),
            expert_tokens: Vec::new(),
        }
    }

    /// Counts a pass of `rows` rows that took `measured` seconds; the choice to move to,
    /// when one has earned it.
    pub fn observe(&mut self, rows: usize, measured: f64) -> Option<Choice> {
        self.follow.observe(rows, Some(measured))
    }

    /// Changes `runner` to `choice`'s placement, the KV of `slots` (slot, positions
    /// written) carried across. The error, when neither the new placement nor the old
    /// could be built again: then there is no pipeline left and the KV is lost.
    pub fn change(
        &mut self,
        runner: Pipeline<B>,
        slots: &[(usize, usize)],
        choice: Choice,
    ) -> Result<Pipeline<B>, EngineError> {
        let t0 = Instant::now();
        let old = self.follow.cpu_layers();
        let kv: Vec<(usize, SlotKv)> = slots
            .iter()
            .map(|&(slot, written)| (slot, runner.export_slot(slot, written)))
            .collect();
        let kv_bytes: usize = kv.iter().map(|(_, k)| k.bytes()).sum();
        add_totals(&mut self.before, &runner);
        let mut routed = Vec::new();
        runner.expert_tokens_into(&mut routed);
        add_experts(&mut self.expert_tokens, &routed);
        // The old pipeline's memory goes first: the new one is planned within the same
        // budgets.
        drop(runner);
        let mut input = self.input.clone();
        input.host.cpu_layers = choice.cpu_layers;
        let (mut runner, now) = match (self.rebuild)(&input) {
            Ok(r) => (r, choice.cpu_layers),
            Err(e) => {
                tracing::warn!(
                    "placement auto: {} host layers not built ({e}); staying at {old}",
                    choice.cpu_layers
                );
                self.status.failed += 1;
                input.host.cpu_layers = old;
                ((self.rebuild)(&input)?, old)
            }
        };
        for (slot, k) in &kv {
            runner.import_slot(*slot, k).map_err(|e| {
                EngineError::Invalid(format!("placement auto: slot {slot}'s KV not carried: {e}"))
            })?;
        }
        let took = t0.elapsed().as_secs_f64();
        self.follow.moved(now, took);
        if now != choice.cpu_layers {
            self.follow.refuse(choice.cpu_layers);
        }
        if now == choice.cpu_layers {
            self.status.changes += 1;
            tracing::info!(
                "placement auto: {old} -> {now} host layers at {} rows a pass ({:.1} MB of KV carried in {:.2} s)",
                choice.rows,
                kv_bytes as f64 / 1e6,
                took
            );
            self.status.choice = Some(choice);
        }
        self.status.cpu_layers = now;
        self.status.last_change_s = took;
        self.status.change_s_total += took;
        self.status.last_change_kv_bytes = kv_bytes as u64;
        self.status.plan = Some(std::sync::Arc::new(runner.plan.clone()));
        Ok(runner)
    }
}

/// Adds a pipeline's totals to `to`.
fn add_totals<B: Backend>(to: &mut (PassStats, crate::io::IoStats), r: &Pipeline<B>) {
    to.0.add(r.total());
    to.1 = to.1.plus(&r.io().stats());
}

/// Adds per-layer, per-expert token counts `from` to `to` (shaped like it, or empty).
pub fn add_experts(to: &mut Vec<Vec<u64>>, from: &[Vec<u64>]) {
    if to.is_empty() {
        to.extend(from.iter().map(|l| vec![0; l.len()]));
    }
    for (t, f) in to.iter_mut().zip(from) {
        for (a, b) in t.iter_mut().zip(f) {
            *a += b;
        }
    }
}
