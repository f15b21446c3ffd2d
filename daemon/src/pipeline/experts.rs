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

use super::{mem_of, Dst, Load, PassAt, PassStats, Pipeline, PipelineError};
use crate::backend::Backend;
use crate::io::Ticket;
use crate::store::arch::ArchConfig;
use crate::store::format::UnitKind;
use std::time::Instant;

/// How the expert cache chooses what to evict.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Eviction {
    /// The expert its layer routed the fewest tokens to so far, the least recently used
    /// among equals; a unified backend admits an expert only when it served at least as
    /// many tokens as the one it would evict.
    #[default]
    Frequency,
    /// The least recently used; every loaded expert is admitted (the baseline).
    Lru,
}

impl std::str::FromStr for Eviction {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "frequency" => Ok(Eviction::Frequency),
            "lru" => Ok(Eviction::Lru),
            _ => Err(format!("{s:?}: expected frequency or lru")),
        }
    }
}

/// How a layer's experts are predicted before it routes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Prediction {
    /// The next layer's router on this layer's hidden state (after its attention), where
    /// the next layer's dense part is resident, or on a unified backend is the next load
    /// (taken early); elsewhere, the previous step's choices.
    #[default]
    Lookahead,
    /// The previous step's choices at the layer.
    Previous,
    /// None: experts are read once routed.
    Off,
}

impl std::str::FromStr for Prediction {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "lookahead" => Ok(Prediction::Lookahead),
            "previous" => Ok(Prediction::Previous),
            "off" => Ok(Prediction::Off),
            _ => Err(format!("{s:?}: expected lookahead, previous or off")),
        }
    }
}

/// Of a loaded expert profile, the share of its routed tokens whose experts the plan keeps
/// resident (`ExpertProfile::hot_set`).
pub const PROFILE_HOT_SHARE: f64 = 0.5;

/// The tokens each expert of each decoder layer was routed (empty for a dense layer), as a
/// run measured them: saved to a file and loaded to warm a later run's expert cache.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct ExpertProfile {
    /// The model's name as its store gives it (shown in the error when a profile's layers
    /// and experts do not match the model loading it).
    pub model: String,
    pub layers: Vec<Vec<u64>>,
}

impl ExpertProfile {
    /// Reads a profile from `path` (JSON), checked against `cfg`: a layer per decoder
    /// layer, an expert count per expert of each sparse layer, none for a dense one.
    pub fn load(path: &std::path::Path, cfg: &ArchConfig) -> Result<ExpertProfile, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("read expert profile {}: {e}", path.display()))?;
        let p: ExpertProfile = serde_json::from_str(&text)
            .map_err(|e| format!("expert profile {}: {e}", path.display()))?;
        let want: Vec<usize> = (0..cfg.n_layers)
            .map(|i| match &cfg.moe {
                Some(m) if cfg.is_sparse(i) => m.n_experts as usize,
                _ => 0,
            })
            .collect();
        let got: Vec<usize> = p.layers.iter().map(Vec::len).collect();
        if got != want {
            return Err(format!(
                "expert profile {} (of model {:?}) has {} layers of {:?} experts; this model's are {} of {:?}: save a profile of this model (--save-expert-profile)",
                path.display(),
                p.model,
                got.len(),
                got.iter().max().copied().unwrap_or(0),
                want.len(),
                want.iter().max().copied().unwrap_or(0)
            ));
        }
        Ok(p)
    }

    /// The experts worth keeping resident: the fewest of the sparse layers' experts that
    /// together served `share` of the routed tokens (hottest first).
    pub fn hot_set(&self, share: f64) -> usize {
        let mut counts: Vec<u64> = self.layers.iter().flatten().copied().collect();
        counts.sort_unstable_by(|a, b| b.cmp(a));
        let total: u64 = counts.iter().sum();
        let want = (total as f64 * share).ceil() as u64;
        let mut sum = 0;
        counts
            .iter()
            .take_while(|&&c| {
                let short = sum < want && c > 0;
                sum += c;
                short
            })
            .count()
    }

    /// Writes the profile to `path` (JSON, replaced whole).
    pub fn save(&self, path: &std::path::Path) -> Result<(), String> {
        let text = serde_json::to_string(self).map_err(|e| e.to_string())?;
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, text)
            .and_then(|_| std::fs::rename(&tmp, path))
            .map_err(|e| format!("write expert profile {}: {e}", path.display()))
    }
}

/// Device slots of an expert each, and which expert each holds.
pub(super) struct ExpertCache<M> {
    pub(super) slots: Vec<M>,
    /// (unit, expert) per slot.
    holds: Vec<Option<(usize, u32)>>,
    /// Slots whose expert is never evicted (the resident hot experts).
    pinned: Vec<bool>,
    last_use: Vec<u64>,
    clock: u64,
}

impl<M> ExpertCache<M> {
    pub(super) fn new(slots: Vec<M>) -> Self {
        let n = slots.len();
        ExpertCache {
            slots,
            holds: vec![None; n],
            pinned: vec![false; n],
            last_use: vec![0; n],
            clock: 0,
        }
    }

    fn find(&self, unit: usize, expert: u32) -> Option<usize> {
        self.holds.iter().position(|&h| h == Some((unit, expert)))
    }

    fn touch(&mut self, slot: usize) {
        self.clock += 1;
        self.last_use[slot] = self.clock;
    }

    fn put(&mut self, slot: usize, unit: usize, expert: u32) {
        self.holds[slot] = Some((unit, expert));
        self.touch(slot);
    }

    /// The slot a new expert goes in, and the routed-token count of the expert it would
    /// evict (None: the slot is free). Free slots first; then the lowest `weight`, the
    /// least recently used among equals; slots whose expert `busy` says the running layer
    /// still needs only when nothing else is left. None when there are no slots.
    fn victim(
        &self,
        weight: impl Fn(usize, u32) -> u64,
        busy: impl Fn(usize, u32) -> bool,
    ) -> Option<(usize, Option<u64>)> {
        if let Some(free) = self.holds.iter().position(|h| h.is_none()) {
            return Some((free, None));
        }
        (0..self.slots.len())
            .filter(|&s| !self.pinned[s])
            .filter_map(|s| self.holds[s].map(|(u, e)| (s, u, e)))
            .min_by_key(|&(s, u, e)| (busy(u, e), weight(u, e), self.last_use[s]))
            .map(|(s, u, e)| (s, Some(weight(u, e))))
    }
}

/// Predictions made before their precision decides whether they are requested.
const PREDICTION_WARMUP: u64 = 64;

/// An expert requested from the I/O engine (or, None, to come from the host cache).
pub(super) struct ExpertLoad {
    unit: usize,
    expert: u32,
    ticket: Option<Ticket>,
    /// Requested by prediction, before its layer routed.
    predicted: bool,
}

impl<B: Backend> Pipeline<B> {
    /// Runs sparse layer `u`: its dense part (the pass's next load), then the experts the
    /// step routed to, then the layer's end.
    pub(super) fn sparse_layer(
        &mut self,
        u: usize,
        at: &mut PassAt,
        st: &mut PassStats,
    ) -> Result<(), PipelineError> {
        let used = if self.dense_mem[u].is_some() {
            None
        } else {
            self.fetch(Load::Dense(u), at, st)?
        };
        self.predict(u, st)?;
        if !self.skip_compute {
            let t0 = Instant::now();
            let mem = match &self.dense_mem[u] {
                Some(m) => m,
                None => mem_of!(self, Load::Dense(u)),
            };
            self.model.sparse_begin(&self.backend, u, mem);
            st.compute_s += t0.elapsed().as_secs_f64();
        }
        // What the step chose here (measuring streaming alone: what the last computed
        // step chose).
        let mut routed = std::mem::take(&mut self.routed_buf);
        routed.clear();
        routed.extend_from_slice(self.model.routed_experts(u));
        let pred = &self.predicted[u];
        let right = pred
            .iter()
            .filter(|e| routed.binary_search(e).is_ok())
            .count() as u64;
        st.experts_predicted += pred.len() as u64;
        st.experts_predicted_used += right;
        let by = &mut self.prediction[usize::from(!self.predicted_by_lookahead[u])];
        by.0 += pred.len() as u64;
        by.1 += right;
        st.experts_routed += routed.len() as u64;
        // Predictions the routing did not confirm are cancelled (dropping their tickets).
        let wasted = self
            .expert_loads
            .iter()
            .filter(|l| l.unit == u && l.predicted && routed.binary_search(&l.expert).is_err())
            .count();
        self.expert_loads
            .retain(|l| l.unit != u || routed.binary_search(&l.expert).is_ok());
        st.expert_prefetches_wasted += wasted as u64;
        let mut r = self.lookahead(u, at, st);
        let next = r.as_ref().ok().copied().flatten();
        // The next layer's predicted experts are requested once none of this layer's is
        // left to read: a wrong prediction then costs only disk time that would have gone
        // idle until the next layer routes, never a read this layer waits for (measured on
        // the 64x4 synthetic at batch 1 with every dense part resident: requested as soon
        // as this layer's were, 42 % of them unused, they made the pass 1.3x slower than no
        // prediction).
        let mut predicted = false;
        for k in 0..routed.len() {
            if r.is_err() {
                break;
            }
            r = self.request_experts(u, &routed[k..]).map(|()| next);
            if r.is_ok() {
                r = self
                    .run_expert(u, routed[k], &routed[k + 1..], st)
                    .map(|()| next);
            }
            if let Ok(Some(n)) = r {
                if !predicted && !self.expert_loads.iter().any(|l| l.unit == u) {
                    predicted = true;
                    let pred = std::mem::take(&mut self.predicted[n]);
                    let q = self.request_list(n, &pred, true, st);
                    self.predicted[n] = pred;
                    r = q.map(|()| next);
                }
            }
        }
        self.routed_buf = routed;
        r?;
        if !self.skip_compute {
            let t0 = Instant::now();
            let mem = match &self.dense_mem[u] {
                Some(m) => m,
                None => mem_of!(self, Load::Dense(u)),
            };
            self.model.sparse_end(&self.backend, u, mem);
            st.compute_s += t0.elapsed().as_secs_f64();
        }
        self.computed(used, st)?;
        // The next sparse layer of the pass: its predicted experts load now, while the
        // units between run.
        let next = self.loads[at.load..].iter().find_map(|l| match l {
            Load::Dense(n) => Some(*n),
            _ => None,
        });
        if let Some(n) = next {
            self.predict(n, st)?;
        }
        Ok(())
    }

    /// Whether predictor `by` (0 the lookahead, 1 the previous step's choices) has its
    /// predictions requested: a wrong one costs a read the disk could have spent on a
    /// routed expert, so only while at least half of its predictions so far were right
    /// (after PREDICTION_WARMUP of them; they are counted either way).
    fn prediction_pays(&self, by: usize) -> bool {
        let (made, right) = self.prediction[by];
        made < PREDICTION_WARMUP || 2 * right >= made
    }

    /// The router lookahead of a unified backend, while sparse layer `u` has routed: when
    /// the pass's next load is the dense part of the next layer of the mixture, it is
    /// taken now (the load it waits for next anyway), and that layer's router on this
    /// layer's hidden state predicts its experts: the next layer's unit, its prediction
    /// made (and counted as made) but not yet requested.
    fn lookahead(
        &mut self,
        u: usize,
        at: &mut PassAt,
        st: &mut PassStats,
    ) -> Result<Option<usize>, PipelineError> {
        let n = u + 1;
        let wanted = !self.skip_compute
            && self.expert_prediction == Prediction::Lookahead
            && self
                .predicted_pass
                .get(n)
                .is_some_and(|&p| p != self.pass_no);
        if !wanted {
            return Ok(None);
        }
        // The next layer's dense part is resident (on any backend): its router is there.
        if let (Some(mem), Some(_)) = (&self.dense_mem[n], &self.plan.sparse[n]) {
            let t0 = Instant::now();
            self.model.lookahead_route(&self.backend, n, mem);
            st.compute_s += t0.elapsed().as_secs_f64();
            return Ok(self.take_lookahead(n));
        }
        let next_is_dense = self.loads.get(at.load) == Some(&Load::Dense(n));
        if !(self.unified && self.early.is_none() && next_is_dense) {
            return Ok(None);
        }
        if self.ahead.is_empty() {
            self.top_up()?;
        }
        let t = self
            .ahead
            .pop_front()
            .flatten()
            .expect("a unified backend's loads all have tickets");
        at.load += 1;
        let t0 = Instant::now();
        let held = self.io.wait(t)?.detach();
        st.load_stall_s += t0.elapsed().as_secs_f64();
        let len = self.load_len(Load::Dense(n));
        st.bytes_uploaded += len as u64;
        // SAFETY: `held` keeps the staging slot (unchanged) until the view is gone; both
        // stay together in `early`, then `borrowed`, dropped view first.
        let mem = unsafe { self.backend.borrow_host(&held.data()[..len]) }
            .expect("a unified backend lends host bytes");
        let t0 = Instant::now();
        self.model.lookahead_route(&self.backend, n, &mem);
        st.compute_s += t0.elapsed().as_secs_f64();
        self.early = Some((Load::Dense(n), mem, held));
        Ok(self.take_lookahead(n))
    }

    /// The router lookahead's prediction for unit `n` as this pass's: the unit, when it is
    /// to be requested.
    fn take_lookahead(&mut self, n: usize) -> Option<usize> {
        self.predicted_pass[n] = self.pass_no;
        let mut pred = std::mem::take(&mut self.predicted[n]);
        pred.clear();
        pred.extend_from_slice(self.model.lookahead_experts(n));
        self.predicted[n] = pred;
        self.predicted_by_lookahead[n] = true;
        self.prediction_pays(0).then_some(n)
    }

    /// Requests the experts the step before chose at sparse layer `u` that are neither
    /// cached nor requested, once per pass, within the expert loads in flight.
    fn predict(&mut self, u: usize, st: &mut PassStats) -> Result<(), PipelineError> {
        if self.predicted_pass[u] == self.pass_no {
            return Ok(());
        }
        self.predicted_pass[u] = self.pass_no;
        if self.expert_prediction == Prediction::Off {
            self.predicted[u].clear();
            return Ok(());
        }
        let mut pred = std::mem::take(&mut self.predicted[u]);
        pred.clear();
        pred.extend_from_slice(self.model.routed_experts(u));
        self.predicted_by_lookahead[u] = false;
        let r = if self.prediction_pays(1) {
            self.request_list(u, &pred, true, st)
        } else {
            Ok(())
        };
        self.predicted[u] = pred;
        r
    }

    /// Requests the first experts of `remaining` (the rest of the layer's routing, the
    /// next to run first) that are neither cached nor requested, within the loads in
    /// flight.
    fn request_experts(&mut self, u: usize, remaining: &[u32]) -> Result<(), PipelineError> {
        let mut st = PassStats::default();
        self.request_list(u, remaining, false, &mut st)
    }

    fn request_list(
        &mut self,
        u: usize,
        experts: &[u32],
        predicted: bool,
        st: &mut PassStats,
    ) -> Result<(), PipelineError> {
        // Predictions leave one load free: their layer runs its experts in order, and the
        // first of them it has neither cached nor requested must still get a read (with
        // every load taken by the layer's later experts it would wait for none of them).
        let limit = self.plan.expert_reads.max(1) - usize::from(predicted);
        for &e in experts {
            if self.expert_loads.len() >= limit {
                break;
            }
            let loading = self
                .expert_loads
                .iter()
                .any(|l| l.unit == u && l.expert == e);
            if loading || self.experts.find(u, e).is_some() {
                continue;
            }
            let ticket = if self.host_cache[u].is_some() {
                None
            } else {
                let frames = self.load_frames(Load::Expert(u, e));
                Some(self.io.request_part_urgent(u, frames)?)
            };
            if predicted && ticket.is_some() {
                st.expert_prefetches += 1;
            }
            self.expert_loads.push(ExpertLoad {
                unit: u,
                expert: e,
                ticket,
                predicted,
            });
        }
        Ok(())
    }

    /// A routed expert of layer `u` found neither in the cache nor requested when its turn
    /// came: it was cached when the layer requested its experts, then evicted for another
    /// of them (a discrete device whose unpinned slots all held experts the layer still
    /// needed). It is requested now, ahead of the rest; when the loads in flight are all
    /// taken, the layer's last requested one is cancelled to make room (it is requested
    /// again in its turn). Returns its place in `expert_loads`.
    fn request_evicted(&mut self, u: usize, e: u32) -> Result<usize, PipelineError> {
        if self.expert_loads.len() >= self.plan.expert_reads.max(1) {
            let last = self
                .expert_loads
                .iter()
                .rposition(|l| l.unit == u)
                .unwrap_or(self.expert_loads.len() - 1);
            // Dropping its ticket cancels the read.
            self.expert_loads.remove(last);
        }
        let ticket = if self.host_cache[u].is_some() {
            None
        } else {
            let frames = self.load_frames(Load::Expert(u, e));
            Some(self.io.request_part_urgent(u, frames)?)
        };
        self.expert_loads.push(ExpertLoad {
            unit: u,
            expert: e,
            ticket,
            predicted: false,
        });
        Ok(self.expert_loads.len() - 1)
    }

    /// What eviction weighs expert `e` of unit `u` by: the tokens routed to it so far, and
    /// in the loaded profile (frequency), or nothing (LRU).
    fn expert_weight(&self, u: usize, e: u32) -> u64 {
        if self.expert_eviction == Eviction::Lru {
            return 0;
        }
        let count = |layers: &[Vec<u64>], i: u32| {
            layers
                .get(i as usize)
                .and_then(|l| l.get(e as usize))
                .copied()
                .unwrap_or(0)
        };
        match self.store.units()[u].kind {
            UnitKind::Decoder(i) => {
                count(self.model.expert_tokens(), i) + count(&self.expert_prior, i)
            }
            _ => 0,
        }
    }

    /// What the expert cache holds: (unit, expert, pinned) per occupied slot.
    pub fn cached_experts(&self) -> Vec<(usize, u32, bool)> {
        (0..self.experts.slots.len())
            .filter_map(|s| self.experts.holds[s].map(|(u, e)| (u, e, self.experts.pinned[s])))
            .collect()
    }

    /// The routing counts so far (those of a loaded profile included): what
    /// `--save-expert-profile` writes.
    pub fn expert_profile(&self) -> ExpertProfile {
        let mut layers = self.model.expert_tokens().to_vec();
        for (l, p) in layers.iter_mut().zip(&self.expert_prior) {
            for (x, y) in l.iter_mut().zip(p) {
                *x += y;
            }
        }
        ExpertProfile {
            model: self.store.manifest().arch.name.clone(),
            layers,
        }
    }

    /// Loads a profile (checked by `ExpertProfile::load`): its counts join the frequency
    /// eviction's, and the expert cache fills with the experts of the streamed layers it
    /// routed most, hottest first, the first `Plan::expert_hot_slots` of them pinned.
    /// Returns how many experts were loaded.
    pub fn load_expert_profile(&mut self, p: ExpertProfile) -> Result<usize, PipelineError> {
        let mut hot: Vec<(u64, usize, u32)> = Vec::new();
        for (u, unit) in self.store.units().iter().enumerate() {
            let (UnitKind::Decoder(i), Some(_)) = (unit.kind, &self.plan.sparse[u]) else {
                continue;
            };
            if let Some(l) = p.layers.get(i as usize) {
                hot.extend(
                    l.iter()
                        .enumerate()
                        .filter(|&(_, &n)| n > 0)
                        .map(|(e, &n)| (n, u, e as u32)),
                );
            }
        }
        // Hottest first; ties to the earlier layer and expert.
        hot.sort_by(|a, b| b.0.cmp(&a.0).then((a.1, a.2).cmp(&(b.1, b.2))));
        self.expert_prior = p.layers;
        let mut loaded = 0;
        for (s, &(_, u, e)) in hot.iter().take(self.experts.slots.len()).enumerate() {
            let frames = self.load_frames(Load::Expert(u, e));
            let len = self.load_len(Load::Expert(u, e));
            let slot = self.io.wait(self.io.request_part(u, frames)?)?;
            self.backend
                .upload(&mut self.experts.slots[s], &slot.data()[..len])?;
            self.experts.put(s, u, e);
            self.experts.pinned[s] = s < self.plan.expert_hot_slots;
            loaded += 1;
        }
        self.io_mark = self.io.stats();
        Ok(loaded)
    }

    /// Runs expert `e` of sparse layer `u` on its rows: from the expert cache, else from
    /// its load (requested by `request_experts`). `later` are the experts the layer runs
    /// after it (kept in the cache if they are there).
    fn run_expert(
        &mut self,
        u: usize,
        e: u32,
        later: &[u32],
        st: &mut PassStats,
    ) -> Result<(), PipelineError> {
        let base = self.load_base(Load::Expert(u, e));
        if let Some(s) = self.experts.find(u, e) {
            st.expert_cache_hits += 1;
            self.experts.touch(s);
            if !self.skip_compute {
                let t0 = Instant::now();
                let mem = &self.experts.slots[s];
                self.model
                    .forward_expert(&self.backend, u, e as usize, mem, base);
                self.backend.release_after(mem);
                st.compute_s += t0.elapsed().as_secs_f64();
            }
            return Ok(());
        }
        let at = match self
            .expert_loads
            .iter()
            .position(|l| l.unit == u && l.expert == e)
        {
            Some(at) => at,
            None => self.request_evicted(u, e)?,
        };
        let load = self.expert_loads.remove(at);
        let len = self.load_len(Load::Expert(u, e));
        st.experts_loaded += 1;
        st.expert_bytes_loaded += len as u64;
        let busy = |uu: usize, ee: u32| uu == u && later.binary_search(&ee).is_ok();
        if self.unified {
            let t = load
                .ticket
                .expect("a unified backend has no host cache: every load has a ticket");
            let t0 = Instant::now();
            let held = self.io.wait(t)?.detach();
            st.load_stall_s += t0.elapsed().as_secs_f64();
            st.bytes_uploaded += len as u64;
            let data = &held.data()[..len];
            if !self.skip_compute {
                let t0 = Instant::now();
                // SAFETY: `held` keeps the staging slot (unchanged) until the view is gone.
                let mem = unsafe { self.backend.borrow_host(data) }
                    .expect("a unified backend lends host bytes");
                self.model
                    .forward_expert(&self.backend, u, e as usize, &mem, base);
                drop(mem);
                st.compute_s += t0.elapsed().as_secs_f64();
            }
            // Into the cache when it is worth at least what it evicts, and that is not an
            // expert this layer still runs.
            let w = self.expert_weight(u, e);
            let victim = self.experts.victim(|a, b| self.expert_weight(a, b), busy);
            if let Some((s, evicts)) = victim {
                let needed = self.experts.holds[s].is_some_and(|(a, b)| busy(a, b));
                if !needed && evicts.is_none_or(|v| w >= v) {
                    self.experts.holds[s] = None;
                    let t1 = Instant::now();
                    self.backend.upload(&mut self.experts.slots[s], data)?;
                    st.upload_s += t1.elapsed().as_secs_f64();
                    self.experts.put(s, u, e);
                }
            }
            return Ok(());
        }
        let (s, _) = self
            .experts
            .victim(|a, b| self.expert_weight(a, b), busy)
            .expect("a discrete device's plan has an expert slot at least");
        // The slot holds nothing valid until the load is in.
        self.experts.holds[s] = None;
        self.stage(Load::Expert(u, e), load.ticket, Dst::Expert(s), st)?;
        self.experts.put(s, u, e);
        if !self.skip_compute {
            let t0 = Instant::now();
            let mem = &self.experts.slots[s];
            self.model
                .forward_expert(&self.backend, u, e as usize, mem, base);
            st.compute_s += t0.elapsed().as_secs_f64();
        }
        self.backend.release_after(&self.experts.slots[s]);
        self.release_held(st)
    }
}
