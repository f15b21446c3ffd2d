//! Running a mixture's layer that streams sparsely: its dense part, the prediction and
//! requests of its experts, and each routed expert from the cache or its load.

use super::ExpertLoad;
use crate::backend::Backend;
use crate::pipeline::moe::{Eviction, ExpertProfile};
use crate::pipeline::{mem_of, Dst, Load, PassAt, PassStats, Pipeline, PipelineError};
use crate::store::format::UnitKind;
use std::time::Instant;

impl<B: Backend> Pipeline<B> {
    /// Runs sparse layer `u`: its dense part (the pass's next load), then the experts the
    /// step routed to, then the layer's end.
    pub(in crate::pipeline) fn sparse_layer(
        &mut self,
        u: usize,
        at: &mut PassAt,
        st: &mut PassStats,
    ) -> Result<(), PipelineError> {
        let used = if self.moe.dense_mem[u].is_some() {
            None
        } else {
            self.fetch(Load::Dense(u), at, st)?
        };
        self.predict(u, st)?;
        if !self.opts.skip_compute {
            let t0 = Instant::now();
            let mem = match &self.moe.dense_mem[u] {
                Some(m) => m,
                None => mem_of!(self, Load::Dense(u)),
            };
            self.model.sparse_begin(&self.backend, u, mem);
            st.compute_s += t0.elapsed().as_secs_f64();
        }
        // What the step chose here (measuring streaming alone: what the last computed
        // step chose).
        let mut routed = std::mem::take(&mut self.moe.routed_buf);
        routed.clear();
        routed.extend_from_slice(self.model.routed_experts(u));
        let (predicted, right) = self.moe.predictor.score(u, &routed);
        st.experts_predicted += predicted;
        st.experts_predicted_used += right;
        st.experts_routed += routed.len() as u64;
        // Predictions the routing did not confirm are cancelled (dropping their tickets).
        let wasted = self
            .moe
            .loads
            .iter()
            .filter(|l| l.unit == u && l.predicted && routed.binary_search(&l.expert).is_err())
            .count();
        self.moe
            .loads
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
                if !predicted && !self.moe.loads.iter().any(|l| l.unit == u) {
                    predicted = true;
                    let pred = self.moe.predictor.take(n);
                    let q = self.request_list(n, &pred, true, st);
                    self.moe.predictor.put(n, pred);
                    r = q.map(|()| next);
                }
            }
        }
        self.moe.routed_buf = routed;
        r?;
        if !self.opts.skip_compute {
            let t0 = Instant::now();
            let mem = match &self.moe.dense_mem[u] {
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
        let wanted = !self.opts.skip_compute && self.moe.predictor.lookahead_wanted(n);
        if !wanted {
            return Ok(None);
        }
        // The next layer's dense part is resident (on any backend): its router is there.
        if let (Some(mem), Some(_)) = (&self.moe.dense_mem[n], &self.plan.sparse[n]) {
            let t0 = Instant::now();
            self.model.lookahead_route(&self.backend, n, mem);
            st.compute_s += t0.elapsed().as_secs_f64();
            return Ok(self.take_lookahead(n));
        }
        let next_is_dense = self.loads.get(at.load) == Some(&Load::Dense(n));
        if !(self.unified && self.moe.early.is_none() && next_is_dense) {
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
        self.moe.early = Some((Load::Dense(n), mem, held));
        Ok(self.take_lookahead(n))
    }

    /// The router lookahead's prediction for unit `n` as this pass's: the unit, when it is
    /// to be requested.
    fn take_lookahead(&mut self, n: usize) -> Option<usize> {
        let experts = self.model.lookahead_experts(n);
        self.moe.predictor.set_lookahead(n, experts).then_some(n)
    }

    /// Requests the experts the step before chose at sparse layer `u` that are neither
    /// cached nor requested, once per pass, within the expert loads in flight.
    fn predict(&mut self, u: usize, st: &mut PassStats) -> Result<(), PipelineError> {
        let experts = self.model.routed_experts(u);
        if self.moe.predictor.set_previous(u, experts) != Some(true) {
            return Ok(());
        }
        let pred = self.moe.predictor.take(u);
        let r = self.request_list(u, &pred, true, st);
        self.moe.predictor.put(u, pred);
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
            if self.moe.loads.len() >= limit {
                break;
            }
            let loading = self.moe.loads.iter().any(|l| l.unit == u && l.expert == e);
            if loading || self.moe.cache.find(u, e).is_some() {
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
            self.moe.loads.push(ExpertLoad {
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
        if self.moe.loads.len() >= self.plan.expert_reads.max(1) {
            let last = self
                .moe
                .loads
                .iter()
                .rposition(|l| l.unit == u)
                .unwrap_or(self.moe.loads.len() - 1);
            // Dropping its ticket cancels the read.
            self.moe.loads.remove(last);
        }
        let ticket = if self.host_cache[u].is_some() {
            None
        } else {
            let frames = self.load_frames(Load::Expert(u, e));
            Some(self.io.request_part_urgent(u, frames)?)
        };
        self.moe.loads.push(ExpertLoad {
            unit: u,
            expert: e,
            ticket,
            predicted: false,
        });
        Ok(self.moe.loads.len() - 1)
    }

    /// What eviction weighs expert `e` of unit `u` by: the tokens routed to it so far, and
    /// in the loaded profile (frequency), or nothing (LRU).
    fn expert_weight(&self, u: usize, e: u32) -> u64 {
        if self.opts.expert_eviction == Eviction::Lru {
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
                count(self.model.expert_tokens(), i) + count(&self.moe.prior, i)
            }
            _ => 0,
        }
    }

    /// What the expert cache holds: (unit, expert, pinned) per occupied slot.
    pub fn cached_experts(&self) -> Vec<(usize, u32, bool)> {
        (0..self.moe.cache.slots.len())
            .filter_map(|s| self.moe.cache.holds[s].map(|(u, e)| (u, e, self.moe.cache.pinned[s])))
            .collect()
    }

    /// The routing counts so far (those of a loaded profile included): what
    /// `--save-expert-profile` writes.
    pub fn expert_profile(&self) -> ExpertProfile {
        let mut layers = self.model.expert_tokens().to_vec();
        for (l, p) in layers.iter_mut().zip(&self.moe.prior) {
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
        self.moe.prior = p.layers;
        let mut loaded = 0;
        for (s, &(_, u, e)) in hot.iter().take(self.moe.cache.slots.len()).enumerate() {
            let frames = self.load_frames(Load::Expert(u, e));
            let len = self.load_len(Load::Expert(u, e));
            let slot = self.io.wait(self.io.request_part(u, frames)?)?;
            self.backend
                .upload(&mut self.moe.cache.slots[s], &slot.data()[..len])?;
            self.moe.cache.put(s, u, e);
            self.moe.cache.pinned[s] = s < self.plan.expert_hot_slots;
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
        if let Some(s) = self.moe.cache.find(u, e) {
            st.expert_cache_hits += 1;
            self.moe.cache.touch(s);
            if !self.opts.skip_compute {
                let t0 = Instant::now();
                let mem = &self.moe.cache.slots[s];
                self.model
                    .forward_expert(&self.backend, u, e as usize, mem, base);
                self.backend.release_after(mem);
                st.compute_s += t0.elapsed().as_secs_f64();
            }
            return Ok(());
        }
        let at = match self
            .moe
            .loads
            .iter()
            .position(|l| l.unit == u && l.expert == e)
        {
            Some(at) => at,
            None => self.request_evicted(u, e)?,
        };
        let load = self.moe.loads.remove(at);
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
            if !self.opts.skip_compute {
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
            let victim = self.moe.cache.victim(|a, b| self.expert_weight(a, b), busy);
            if let Some((s, evicts)) = victim {
                let needed = self.moe.cache.holds[s].is_some_and(|(a, b)| busy(a, b));
                if !needed && evicts.is_none_or(|v| w >= v) {
                    self.moe.cache.holds[s] = None;
                    let t1 = Instant::now();
                    self.backend.upload(&mut self.moe.cache.slots[s], data)?;
                    st.upload_s += t1.elapsed().as_secs_f64();
                    self.moe.cache.put(s, u, e);
                }
            }
            return Ok(());
        }
        let (s, _) = self
            .moe
            .cache
            .victim(|a, b| self.expert_weight(a, b), busy)
            .expect("a discrete device's plan has an expert slot at least");
        // The slot holds nothing valid until the load is in.
        self.moe.cache.holds[s] = None;
        self.stage(Load::Expert(u, e), load.ticket, Dst::Expert(s), st)?;
        self.moe.cache.put(s, u, e);
        if !self.opts.skip_compute {
            let t0 = Instant::now();
            let mem = &self.moe.cache.slots[s];
            self.model
                .forward_expert(&self.backend, u, e as usize, mem, base);
            st.compute_s += t0.elapsed().as_secs_f64();
        }
        self.backend.release_after(&self.moe.cache.slots[s]);
        self.release_held(st)
    }
}
