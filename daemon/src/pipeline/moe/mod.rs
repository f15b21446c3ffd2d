//! A mixture's layers that stream sparsely (`Plan::sparse`): the dense part of the layer
//! (norms, attention, router) is one load of the pass like any unit; once it has routed the
//! step, each expert the batch chose runs once for all the rows routed to it, from the
//! expert cache when it is there, else loaded (from the host cache, else from disk through
//! the I/O engine, ahead of every other read).
//!
//! Before a layer routes, its predicted experts are requested (the next layer's router
//! on this layer's hidden state, or the previous token's choices): once none of the running
//! layer's own experts is left to read, so their reads fill disk time that would go idle
//! until the layer routes, and never delay a read the running layer waits for. A
//! prediction the routing does not confirm is cancelled; an expert it missed is requested
//! once routed. At most `Plan::expert_reads` expert loads are outstanding: they have
//! staging slots of their own beside the units requested ahead.
//!
//! The expert cache keeps experts across steps in device slots (on a unified backend, in
//! the arena). It evicts by frequency: the expert its layer has routed the fewest tokens to
//! so far goes first, the least recently used among equals, and experts the running layer
//! still needs last. A unified backend runs a loaded expert straight from its staging slot
//! and copies it into the cache only when it has served at least as many tokens as the
//! expert it would evict (so a cold expert does not push out a hot one); a discrete device
//! runs every expert from the cache (one slot at least).
//!
//! An expert profile (`ExpertProfile`: the tokens each expert of each layer was routed in
//! an earlier run, saved with `--save-expert-profile`) seeds the frequency counts and fills
//! the cache at start, hottest first; its first `Plan::expert_hot_slots` slots are the
//! resident hot experts, which nothing evicts.

mod cache;
mod predict;
mod profile;
mod run;

pub use cache::Eviction;
pub use predict::Prediction;
pub use profile::{ExpertProfile, ProfileError, PROFILE_HOT_SHARE};

use super::{Load, PipelineError};
use crate::backend::Backend;
use crate::io::IoEngine;
use crate::io::{HeldSlot, Ticket};
use crate::plan::Plan;
use crate::store::Store;
use cache::ExpertCache;
use predict::Predictor;
use std::sync::Arc;

/// The pipeline's state for a mixture's layers that stream sparsely (empty for a dense
/// model).
pub(super) struct Moe<M> {
    /// Per unit, a sparse layer's resident dense part (`Plan::dense_resident`).
    pub(super) dense_mem: Vec<Option<M>>,
    /// The expert cache, and the expert loads requested and not yet run.
    pub(super) cache: ExpertCache<M>,
    pub(super) loads: Vec<ExpertLoad>,
    predictor: Predictor,
    /// A loaded expert profile's routing counts per decoder layer (empty: none).
    prior: Vec<Vec<u64>>,
    /// A layer's routed experts while they run (no allocation per layer).
    routed_buf: Vec<u32>,
    /// On a unified backend, the next layer's dense part taken early for the router
    /// lookahead (`run.rs`), lent until that layer runs.
    pub(super) early: Option<(Load, M, HeldSlot)>,
}

impl<M> Moe<M> {
    /// The state for `store` under `plan`: the resident dense parts of sparse layers loaded
    /// through the streaming engine `io` (its staging slots hold a dense part), the expert
    /// cache's slots allocated, predicting by `prediction`.
    pub(super) fn load<B: Backend<Mem = M>>(
        backend: &B,
        store: &Arc<Store>,
        plan: &Plan,
        io: &IoEngine,
        prediction: Prediction,
    ) -> Result<Self, PipelineError> {
        let n = store.units().len();
        // The resident dense parts of sparse layers, through the streaming engine (its
        // staging slots hold a dense part).
        let mut dense_mem: Vec<Option<B::Mem>> = (0..n).map(|_| None).collect();
        for (u, m) in dense_mem.iter_mut().enumerate() {
            let (Some(sp), Some(true)) = (&plan.sparse[u], plan.dense_resident.get(u)) else {
                continue;
            };
            let kind = store.units()[u].kind;
            let len = store.units()[u].part_span(sp.dense_frames.clone(), false) as usize;
            let ticket = io.request_part(u, sp.dense_frames.clone())?;
            let slot = io.wait(ticket)?;
            let mut mem = backend.alloc(len, &format!("dense part of {kind}"))?;
            backend.upload(&mut mem, &slot.data()[..len])?;
            *m = Some(mem);
        }
        let mut cache_slots = Vec::with_capacity(plan.expert_cache_slots);
        for i in 0..plan.expert_cache_slots {
            cache_slots.push(backend.alloc(
                plan.expert_slot_bytes as usize,
                &format!("expert cache slot {i}"),
            )?);
        }
        Ok(Moe {
            dense_mem,
            cache: ExpertCache::new(cache_slots),
            loads: Vec::with_capacity(plan.expert_reads),
            predictor: Predictor::new(n, prediction),
            prior: Vec::new(),
            routed_buf: Vec::new(),
            early: None,
        })
    }

    /// A pass begins (numbers the predictions).
    pub(super) fn begin_pass(&mut self) {
        self.predictor.begin_pass();
    }
}

/// An expert requested from the I/O engine (or, None, to come from the host cache).
pub(super) struct ExpertLoad {
    unit: usize,
    expert: u32,
    ticket: Option<Ticket>,
    /// Requested by prediction, before its layer routed.
    predicted: bool,
}
