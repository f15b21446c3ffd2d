//! The streaming pipeline: every forward pass runs the layer units
//! in order; resident units run in place, streamed ones are requested from the I/O engine
//! `prefetch` units ahead, uploaded into a device streaming slot just before they run, and
//! the staging slot goes back to the engine as soon as the upload is done. Units with a
//! host-cache copy skip disk and decompression. One pass serves every sequence of the batch.
//!
//! A unit's upload does not wait for the whole unit: each time another `upload_chunk` bytes
//! at its start are decoded (frames finish in any order; the engine reports the contiguous
//! prefix), that part is copied while the rest is still being read and decompressed.
//!
//! With an asynchronous backend (CUDA) the loop only enqueues: the upload of a unit goes on
//! the copy stream, ordered after the compute that last read its slot (`release_after`),
//! and the unit's compute on the compute stream waits for that upload. The host waits for
//! an upload to finish reading its staging slot (`upload_wait`) only after the unit's
//! compute is enqueued, so disk, decompression, copy and compute all overlap; the host runs
//! at most as many units ahead of the device as there are streaming slots.
//!
//! Requests run `prefetch` loads ahead and wrap into the next pass (`top_up`), so its first
//! units load while this pass finishes; the I/O engine sends a later request's reads only as
//! the oldest's last are out (`io::FOLLOW_BYTES_DEFAULT`), so the disk serves the loads in
//! the order they are needed. Sent together, this project's VM's disk served them side by
//! side and both landed late: requesting ahead then helped SmolLM2 at 64 MiB and cost it
//! 25 % at 96 MiB.
//!
//! Loads other than whole units: a streamed embedding is never loaded whole; its lookup
//! gathers the step's rows (`gather.rs`), so an untied embedding costs a pass almost nothing
//! and is the first unit to stream. A tied one is also the output head: after the head
//! unit's final norm it streams through the ordinary slots in row parts (`Load::Part`,
//! `LayerUnit::row_parts`), each giving the logits of the rows it holds whole; the rows that
//! straddle two parts (at most one per boundary) are gathered once at start and kept on the
//! device. A tied embedding therefore streams once a pass through layer-sized slots instead
//! of needing a slot (or residency) of its own size; its parts are bit-identical to the
//! resident head (tested on SmolLM2, raw and zstd, copied and unified). A dense layer larger
//! than the slots streams in pieces (`Load::Piece`, `Plan::pieces`), each fetched as the one
//! before runs, its slot back once its phases are enqueued; outputs are bit-identical to
//! all-resident (tested copied and unified, compressed and raw).

use crate::backend::Backend;
use crate::backend::BackendError;
use crate::hostbuf::AlignedBuf;
use crate::io::IoError;
use crate::io::{IoConfig, IoEngine, Ticket};
use crate::model::ModelError;
use crate::model::{Decoder, ModelOptions, SeqStep};
use crate::plan::{Placement, Plan};
use crate::store::format::UnitKind;
use crate::store::Store;
use std::collections::VecDeque;
use std::sync::Arc;

/// What can stop a pass: the model's layout, the backend, or the I/O engine (which names
/// the unit, frame and offset of a data fault).
#[derive(Debug, thiserror::Error)]
pub enum PipelineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Io(#[from] IoError),
    #[error("host cache: cannot allocate {bytes} bytes for {unit}; lower --host-cache")]
    HostCacheAlloc { unit: UnitKind, bytes: u64 },
}

impl PipelineError {
    /// True when stored model data is bad (DATA_LOSS for a server).
    pub fn is_data_loss(&self) -> bool {
        matches!(self, PipelineError::Io(e) if e.is_data_loss())
    }

    /// True when the condition may pass (a read the disk did not answer in time).
    pub fn is_unavailable(&self) -> bool {
        matches!(self, PipelineError::Io(e) if e.is_unavailable())
    }
}
use std::time::Instant;

mod gather;
use gather::Gathered;
mod host;
mod kv;
mod load;
mod self_draft;
mod stats;
pub use kv::SlotKv;
pub use self_draft::SelfDraft;
pub use stats::PassStats;

/// Where an upload lands: a streaming slot, or a slot of the expert cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dst {
    Stream(usize),
    Expert(usize),
}

/// The device memory of `Dst` `$d` in pipeline `$p` (a macro: the backend stays free to
/// borrow beside it).
macro_rules! dst_mem {
    ($p:ident, $d:expr) => {
        match $d {
            Dst::Stream(i) => &mut $p.slots[i],
            Dst::Expert(i) => &mut $p.moe.cache.slots[i],
        }
    };
}

/// A unit's upload starts once this much of it is decoded, and continues in parts of this
/// size as frames finish: large enough that each copy runs near the bus's rate, small enough
/// that a big layer's copy overlaps its own decompression.
pub const UPLOAD_CHUNK_DEFAULT: usize = 8 << 20;

/// How a pipeline runs: the policies a run chooses (the plan decides the memory).
#[derive(Clone, Copy, Debug)]
pub struct PipelineOptions {
    /// Skip the layer compute (measures streaming alone; `set_skip_compute` toggles it
    /// between passes).
    pub skip_compute: bool,
    /// The expert cache's eviction (frequency by default; LRU to compare).
    pub expert_eviction: Eviction,
    /// How a mixture's streamed experts are predicted before their layer routes.
    pub expert_prediction: Prediction,
    /// Measure the router lookahead as a predictor of a mixture's routing
    /// (`Decoder::lookahead_route`; costs a router per resident layer and step).
    pub measure_lookahead: bool,
    /// Bytes of a unit's decoded prefix worth an upload of their own.
    pub upload_chunk: usize,
    /// Threads of the host CPU backend that computes `Plan::cpu_layers`.
    pub cpu_threads: usize,
}

impl Default for PipelineOptions {
    fn default() -> Self {
        PipelineOptions {
            skip_compute: false,
            expert_eviction: Eviction::default(),
            expert_prediction: Prediction::default(),
            measure_lookahead: false,
            upload_chunk: UPLOAD_CHUNK_DEFAULT,
            cpu_threads: std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

/// One load of a pass: a whole unit, row part `.0` of the embedding for a tied head
/// (`Plan::head_parts`), piece `.1` of a dense layer that streams in pieces
/// (`Plan::pieces`), the dense part of a mixture's layer that streams sparsely
/// (`Plan::sparse`), or one expert of such a layer (requested once the layer routed, or
/// predicted before).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Load {
    Unit(usize),
    Part(usize),
    Piece(usize, usize),
    Dense(usize),
    Expert(usize, u32),
}

impl Load {
    fn unit(self) -> usize {
        match self {
            Load::Unit(u) | Load::Piece(u, _) | Load::Dense(u) | Load::Expert(u, _) => u,
            Load::Part(_) => 0,
        }
    }
}

pub struct Pipeline<B: Backend> {
    pub backend: B,
    pub model: Decoder<B>,
    pub store: Arc<Store>,
    pub plan: Plan,
    opts: PipelineOptions,
    resident: Vec<Option<B::Mem>>,
    slots: Vec<B::Mem>,
    host_cache: Vec<Option<AlignedBuf>>,
    io: IoEngine,
    /// Streamed loads of one pass in order (a tied head's embedding parts after the head).
    loads: Vec<Load>,
    /// A streamed embedding's lookup (None when the embedding is resident).
    gathered: Option<Gathered<B::Mem>>,
    /// Loads requested ahead, in `loads` order, across passes: the front is the next load
    /// the running (or next) pass needs. `next_issue` is the index in `loads` of the next
    /// request to make.
    ahead: VecDeque<Option<Ticket>>,
    next_issue: usize,
    /// I/O counters at the end of the last pass (reads between passes count for the next).
    io_mark: crate::io::IoStats,
    /// Staging slots an asynchronous upload may still be reading, by where it lands.
    held: Vec<(Dst, crate::io::HeldSlot)>,
    /// `held`'s twin, swapped in while the held slots are waited for (no allocation).
    held_spare: Vec<(Dst, crate::io::HeldSlot)>,
    /// A mixture's layers that stream sparsely: the expert cache, loads and predictions.
    moe: moe::Moe<B::Mem>,
    /// Which load each streaming slot holds during a pass.
    in_slot: Vec<Option<Load>>,
    /// A streaming slot kept for a layer's first piece until its last phase has run
    /// (`Decoder::first_piece_to_end`): `fetch` passes over it.
    pinned: Option<usize>,
    /// Device memory is host memory: streamed units run from their staging slots.
    unified: bool,
    /// On a unified backend, the units the running unit reads from staging slots: the
    /// unit, its view as device memory, and the slot (dropped in that order).
    borrowed: Vec<(Load, B::Mem, crate::io::HeldSlot)>,
    /// Upload parts made before their unit was complete, failed passes included.
    partial_uploads: u64,
    /// The decoder layers the host CPU computes beside the device (`Plan::cpu_layers`).
    host: Option<host::HostPart>,
    /// The spans of the devices beside this one (`Plan::devices`, `add_devices`).
    others: Vec<host::Part<B>>,
    last: PassStats,
    total: PassStats,
}

/// The I/O configuration `io_cfg` with reads as the plan sized them (in bytes in flight,
/// within the host budget).
fn planned_reads(plan: &Plan, io_cfg: IoConfig) -> IoConfig {
    IoConfig {
        read_buffers: plan.host.read_buffers,
        queue_depth: if plan.host.read_buffers > 0 {
            io_cfg.queue_depth.min(plan.host.reads_in_flight)
        } else {
            plan.host.reads_in_flight
        }
        .max(1),
        request_bytes: plan.host.request_bytes as usize,
        ..io_cfg
    }
}

/// The streamed loads of one pass in order, given which units are `resident`. The
/// embedding never loads whole when it streams: its lookup gathers rows and a tied head
/// reads it in parts, right after the head unit's final norm.
fn pass_loads<M>(
    plan: &Plan,
    resident: &[Option<M>],
    on_host: impl Fn(usize) -> bool,
) -> Vec<Load> {
    let n = resident.len();
    let mut loads = Vec::with_capacity(n + plan.head_parts.len());
    for (u, r) in resident.iter().enumerate().skip(1) {
        if r.is_none() && !on_host(u) {
            match (&plan.sparse[u], plan.dense_resident.get(u), &plan.pieces[u]) {
                (Some(_), Some(true), _) => {}
                (Some(_), _, _) => loads.push(Load::Dense(u)),
                (None, _, Some(pieces)) => {
                    loads.extend((0..pieces.len()).map(|k| Load::Piece(u, k)))
                }
                (None, _, None) => loads.push(Load::Unit(u)),
            }
        }
        if u == n - 1 {
            loads.extend((0..plan.head_parts.len()).map(Load::Part));
        }
    }
    loads
}

/// Where a pass is: the next load in `loads` and the next streaming slot.
#[derive(Default)]
struct PassAt {
    load: usize,
    slot: usize,
}

/// `mem_of` over a pipeline's fields (borrowed one by one, so the model stays free to
/// borrow mutably beside it).
macro_rules! mem_of {
    ($p:ident, $w:expr) => {
        mem_of(&$p.resident, &$p.in_slot, &$p.slots, &$p.borrowed, $w)
    };
}

/// The memory load `w` runs from: resident, in a streaming slot, or lent from its staging
/// slot.
fn mem_of<'a, M>(
    resident: &'a [Option<M>],
    in_slot: &[Option<Load>],
    slots: &'a [M],
    borrowed: &'a [(Load, M, crate::io::HeldSlot)],
    w: Load,
) -> &'a M {
    // Only whole units are resident (a part's unit, the embedding, then streams).
    if let (Load::Unit(_), Some(Some(m))) = (w, resident.get(w.unit())) {
        return m;
    }
    match in_slot.iter().rposition(|&x| x == Some(w)) {
        Some(s) => &slots[s],
        None => {
            &borrowed
                .iter()
                .find(|b| b.0 == w)
                .expect("loaded before its compute")
                .1
        }
    }
}

impl<B: Backend> Pipeline<B> {
    /// Reserves KV cache and workspace, then streaming slots, then loads resident units
    /// and the host cache through the I/O engine.
    pub fn new(
        backend: B,
        store: Arc<Store>,
        plan: Plan,
        opts: ModelOptions,
        io_cfg: IoConfig,
        run: PipelineOptions,
    ) -> Result<Self, PipelineError> {
        let n_layers = store.manifest().arch.n_layers as usize;
        // Its layers: after the host's, before the other devices'.
        let end = plan.devices.first().map_or(n_layers, |d| d.layers.start);
        let model = Decoder::new_part(&backend, store.manifest(), opts, plan.cpu_layers..end)?;
        let host = host::host_part(&store, &plan, opts, run.cpu_threads)?;
        let io_cfg = planned_reads(&plan, io_cfg);
        let unified = backend.unified();
        let plan_slots = plan.stream_slots;
        let mut slots = Vec::with_capacity(plan_slots);
        for i in 0..plan.stream_slots {
            slots.push(backend.alloc(
                plan.stream_slot_bytes as usize,
                &format!("streaming slot {i}"),
            )?);
        }
        let n = store.units().len();
        let (resident, host_cache) = if unified {
            let resident = load::load_resident_direct(&backend, &store, &plan, io_cfg.workers)?;
            (resident, (0..n).map(|_| None).collect())
        } else {
            load::load_kept(&backend, &store, &plan, &io_cfg)?
        };
        let streamed: Vec<usize> = (0..n)
            .filter(|&u| {
                matches!(
                    plan.placement(u),
                    Placement::Streamed | Placement::HostCached
                )
            })
            .collect();
        let io = IoEngine::new(
            store.clone(),
            IoConfig {
                staging_slots: plan.host.staging_slots.max(1),
                units: Some(streamed),
                // Sized as planned, for what streams through slots: the embedding comes in
                // parts or only as gathered rows, so it sizes nothing (when nothing
                // streams through slots, the engine's one slot is a page).
                slot_bytes: Some(
                    (plan.host.staging_slot_bytes as usize).max(crate::hostbuf::IO_ALIGN),
                ),
                // The copy stream reads the staging slots by DMA.
                pinner: backend.pinner(),
                ..io_cfg
            },
        )?;
        let loads = pass_loads(&plan, &resident, |u| {
            matches!(plan.placement(u), Placement::Host | Placement::OtherDevice)
        });
        let gathered = match resident[0] {
            Some(_) => None,
            None => Some(Gathered::new(
                &backend,
                &store,
                &plan,
                model.embedding_loc(),
                opts.max_batch_tokens,
                host_cache[0].as_ref(),
            )?),
        };
        let moe = moe::Moe::load(&backend, &store, &plan, &io, run.expert_prediction)?;
        Ok(Pipeline {
            moe,
            opts: run,
            backend,
            model,
            store,
            plan,
            resident,
            slots,
            host_cache,
            io_mark: io.stats(),
            io,
            loads,
            gathered,
            ahead: VecDeque::new(),
            next_issue: 0,
            held: Vec::with_capacity(plan_slots),
            held_spare: Vec::with_capacity(plan_slots),
            unified,
            borrowed: Vec::with_capacity(2),
            in_slot: vec![None; plan_slots],
            pinned: None,
            partial_uploads: 0,
            host,
            others: Vec::new(),
            last: PassStats::default(),
            total: PassStats::default(),
        })
    }

    /// Statistics of the last pass, and of all passes so far.
    pub fn last_pass(&self) -> &PassStats {
        &self.last
    }

    pub fn total(&self) -> &PassStats {
        &self.total
    }

    pub fn io(&self) -> &IoEngine {
        &self.io
    }

    /// Upload parts made before their unit had finished decompressing, over every pass
    /// (failed ones too).
    pub fn partial_uploads(&self) -> u64 {
        self.partial_uploads
    }

    /// Requests loads in pass order, wrapping into the next pass, until `prefetch` are
    /// outstanding: the next pass's first units load while this one finishes.
    fn top_up(&mut self) -> Result<(), PipelineError> {
        let prefetch = self.plan.prefetch.max(1);
        while !self.loads.is_empty() && self.ahead.len() < prefetch {
            let load = self.loads[self.next_issue];
            let t = if self.host_cache[load.unit()].is_some() {
                None
            } else {
                Some(match load {
                    Load::Unit(u) => self.io.request(u)?,
                    Load::Part(p) => self
                        .io
                        .request_part(0, self.plan.head_parts[p].frames.clone())?,
                    Load::Dense(u) | Load::Piece(u, _) => {
                        self.io.request_part(u, self.load_frames(load))?
                    }
                    Load::Expert(..) => unreachable!("experts load once routed"),
                })
            };
            self.ahead.push_back(t);
            self.next_issue = (self.next_issue + 1) % self.loads.len();
        }
        Ok(())
    }

    /// Uploads the unit of `t` into streaming slot `slot` as it decodes: each time another
    /// `upload_chunk` bytes at its start are ready, they are copied while the rest is still
    /// being read and decompressed; the staging slot is held until `upload_wait`.
    fn load_into(
        &mut self,
        t: Ticket,
        dst: Dst,
        len: usize,
        st: &mut PassStats,
    ) -> Result<(), PipelineError> {
        let chunk = self.opts.upload_chunk.max(1);
        let mut sent = 0;
        self.backend.upload_begin(dst_mem!(self, dst))?;
        let progressive = loop {
            let t0 = Instant::now();
            let r = self.io.wait_progress(&t, (sent + chunk).min(len));
            st.load_stall_s += t0.elapsed().as_secs_f64();
            match r {
                Ok(Some(prefix)) => {
                    let t1 = Instant::now();
                    let r = self
                        .backend
                        .upload_part(dst_mem!(self, dst), sent, &prefix[sent..]);
                    st.upload_s += t1.elapsed().as_secs_f64();
                    if let Err(e) = r {
                        break Err(PipelineError::from(e));
                    }
                    st.partial_uploads += 1;
                    self.partial_uploads += 1;
                    sent = prefix.len();
                }
                Ok(None) => break Ok(()),
                Err(e) => break Err(PipelineError::from(e)),
            }
        };
        if let Err(e) = progressive {
            // The staging slot is the engine's again once the ticket is dropped: no copy
            // may still be reading it by then.
            let _ = self.backend.upload_end(dst_mem!(self, dst));
            let _ = self.backend.upload_wait(dst_mem!(self, dst));
            drop(t);
            return Err(e);
        }
        // Complete: `wait` returns at once (it can only fail if the engine stopped).
        let t0 = Instant::now();
        let guard = self.io.wait(t)?.detach();
        st.load_stall_s += t0.elapsed().as_secs_f64();
        let t1 = Instant::now();
        self.backend
            .upload_part(dst_mem!(self, dst), sent, &guard.data()[sent..])?;
        self.backend.upload_end(dst_mem!(self, dst))?;
        st.upload_s += t1.elapsed().as_secs_f64();
        st.bytes_uploaded += len as u64;
        self.held.push((dst, guard));
        Ok(())
    }

    /// Runs one step of the batch over every unit and fills `logits` (a row per sequence).
    pub fn step(&mut self, steps: &[SeqStep], logits: &mut Vec<f32>) -> Result<(), PipelineError> {
        let r = self.pass(steps, logits);
        if r.is_err() {
            self.moe.early = None;
            self.pinned = None;
            self.borrowed.clear();
            // A staging slot goes back only once no copy reads it any more.
            for (d, guard) in std::mem::take(&mut self.held) {
                let _ = self.backend.upload_wait(dst_mem!(self, d));
                drop(guard);
            }
            // Expert loads requested for this pass are dropped (cancelled) too.
            self.moe.loads.clear();
            // Drop what was requested ahead (the tickets cancel); the next pass starts clean.
            self.ahead.clear();
            self.next_issue = 0;
        }
        r
    }

    fn pass(&mut self, steps: &[SeqStep], logits: &mut Vec<f32>) -> Result<(), PipelineError> {
        self.begin_parts(steps)?;
        self.moe.begin_pass();
        let t_pass = Instant::now();
        let mut st = PassStats {
            passes: 1,
            ..PassStats::default()
        };
        let n = self.resident.len();
        let tied = self.store.manifest().arch.tied_embeddings;
        self.top_up()?;
        let mut at = PassAt::default();
        let copy0 = self.backend.copy_stats();
        self.in_slot.fill(None);
        for u in 0..n {
            if u == 0 && self.gathered.is_some() {
                self.embed_gathered(&mut st)?;
                continue;
            }
            if self.on_host(u, &mut st)? {
                continue;
            }
            // The study of the router lookahead: the next layer's router on the hidden
            // state entering this one, where the next layer is resident.
            if let (true, false, true, Some(Some(next))) = (
                self.opts.measure_lookahead,
                self.opts.skip_compute,
                u > 0,
                self.resident.get(u + 1),
            ) {
                self.model.lookahead_route(&self.backend, u + 1, next);
            }
            if self.resident[u].is_none() && self.plan.sparse[u].is_some() {
                self.sparse_layer(u, &mut at, &mut st)?;
                continue;
            }
            if self.resident[u].is_none() && self.plan.pieces[u].is_some() {
                self.pieced_layer(u, &mut at, &mut st)?;
                continue;
            }
            let is_head = self.store.units()[u].kind == UnitKind::Head;
            let in_parts = is_head && !self.plan.head_parts.is_empty();
            let used = if self.resident[u].is_none() {
                self.fetch(Load::Unit(u), &mut at, &mut st)?
            } else {
                None
            };
            if !self.opts.skip_compute {
                let t0 = Instant::now();
                let mem = mem_of!(self, Load::Unit(u));
                if in_parts {
                    self.model.head_norm(&self.backend, mem);
                } else {
                    // A tied head with the embedding resident reads it there.
                    let lm = (tied && is_head).then(|| {
                        self.resident[0]
                            .as_ref()
                            .expect("a streamed tied embedding is read in head parts")
                    });
                    self.model.forward_unit(&self.backend, u, mem, lm);
                }
                st.compute_s += t0.elapsed().as_secs_f64();
            }
            self.computed(used, &mut st)?;
            if in_parts {
                for p in 0..self.plan.head_parts.len() {
                    let used = self.fetch(Load::Part(p), &mut at, &mut st)?;
                    if !self.opts.skip_compute {
                        let t0 = Instant::now();
                        let mem = mem_of!(self, Load::Part(p));
                        let part = &self.plan.head_parts[p];
                        self.model
                            .head_part(&self.backend, mem, part.raw_base, part.rows.clone());
                        st.compute_s += t0.elapsed().as_secs_f64();
                    }
                    self.computed(used, &mut st)?;
                }
                if let (Some(g), false) = (&self.gathered, self.opts.skip_compute) {
                    self.model
                        .head_rows(&self.backend, &g.seams, &self.plan.head_seams);
                }
            }
        }
        debug_assert!(at.load == self.loads.len());
        if !self.opts.skip_compute {
            self.model.logits(&self.backend, logits);
        } else {
            // Streaming alone: the pass ends when the last upload has landed.
            for s in &self.slots {
                self.backend.upload_wait(s)?;
            }
        }
        self.backend.check()?;
        self.account(st, copy0, t_pass);
        Ok(())
    }

    /// Starts a step in every part's decoder: this device's, the host's, the others'.
    fn begin_parts(&mut self, steps: &[SeqStep]) -> Result<(), PipelineError> {
        self.model.begin(steps)?;
        if let Some(h) = &mut self.host {
            h.model.begin(steps)?;
        }
        for p in &mut self.others {
            p.model.begin(steps)?;
        }
        Ok(())
    }

    /// Runs unit `u` on the host CPU where the plan computes it there (`Plan::cpu_layers`);
    /// false where it runs on the device.
    fn on_host(&mut self, u: usize, st: &mut PassStats) -> Result<bool, PipelineError> {
        if let Some(p) = self.others.iter_mut().find(|p| p.runs(u)) {
            if !self.opts.skip_compute {
                let t0 = Instant::now();
                p.run(u, &self.backend, &mut self.model)?;
                st.compute_s += t0.elapsed().as_secs_f64();
            }
            return Ok(true);
        }
        let Some(h) = self.host.as_mut().filter(|h| h.runs(u)) else {
            return Ok(false);
        };
        if !self.opts.skip_compute {
            let t0 = Instant::now();
            h.run(u, &self.backend, &mut self.model)?;
            let t = t0.elapsed().as_secs_f64();
            st.compute_s += t;
            st.host_compute_s += t;
        }
        Ok(true)
    }

    /// A dense layer that streams in pieces (`Plan::pieces`): each piece is fetched as the
    /// one before runs, and its phases run as soon as it is in; its slot goes back once
    /// they are enqueued, so the slots hold pieces, not layers. A layer whose residual
    /// reads a vector of its first piece (`Decoder::first_piece_to_end`) keeps that piece
    /// until its last phase: lent (unified; its staging slot is then one fewer for the
    /// loads ahead) or in a pinned streaming slot (discrete; the others take the pieces
    /// after it).
    fn pieced_layer(
        &mut self,
        u: usize,
        at: &mut PassAt,
        st: &mut PassStats,
    ) -> Result<(), PipelineError> {
        let n = self.plan.pieces[u].as_ref().map_or(0, |p| p.len());
        let keep = self.model.first_piece_to_end(u);
        let first = Load::Piece(u, 0);
        for k in 0..n {
            let load = Load::Piece(u, k);
            let used = self.fetch(load, at, st)?;
            if keep && k == 0 {
                self.pinned = used;
            }
            if !self.opts.skip_compute {
                let t0 = Instant::now();
                let mem = mem_of!(self, load);
                let first_mem = (keep && k > 0).then(|| mem_of!(self, first));
                let piece = self.piece(u, k);
                self.model.layer_phases(
                    &self.backend,
                    u,
                    piece.phases.clone(),
                    mem,
                    piece.raw_base,
                    first_mem,
                );
                st.compute_s += t0.elapsed().as_secs_f64();
            }
            let kept = (keep && k + 1 < n).then_some(first);
            self.computed_keeping(used, kept, st)?;
        }
        // The first piece's slot: its next upload waits for the layer's last phase.
        if let Some(s) = self.pinned.take() {
            self.backend.release_after(&self.slots[s]);
        }
        Ok(())
    }

    /// The lookup of a streamed embedding: the step's rows read from the store (or the
    /// host cache) into their own table, uploaded, and the step's ids renumbered into it.
    fn embed_gathered(&mut self, st: &mut PassStats) -> Result<(), PipelineError> {
        let g = self
            .gathered
            .as_mut()
            .expect("called for a streamed embedding");
        let t0 = Instant::now();
        let read0 = g.rows.bytes_read;
        let cached = self.host_cache[0].as_ref().map(|b| b.as_slice());
        g.rows.gather(self.model.step_ids(), cached)?;
        st.bytes_gathered += g.rows.bytes_read - read0;
        st.load_stall_s += t0.elapsed().as_secs_f64();
        if g.rows.table.is_empty() {
            return Ok(());
        }
        self.backend.upload(&mut g.table, &g.rows.table)?;
        if !self.opts.skip_compute {
            let t0 = Instant::now();
            self.model
                .embed_gathered(&self.backend, &g.table, &g.rows.rows_of);
            st.compute_s += t0.elapsed().as_secs_f64();
        }
        Ok(())
    }

    /// The next load of the pass (`load`, checked): lent from its staging slot (unified) or
    /// put in the next streaming slot, which it returns.
    fn fetch(
        &mut self,
        load: Load,
        at: &mut PassAt,
        st: &mut PassStats,
    ) -> Result<Option<usize>, PipelineError> {
        // Taken early (and counted then) for the router lookahead.
        if let Some(e) = self.moe.early.take() {
            debug_assert_eq!(e.0, load, "the early load is the next");
            self.borrowed.push(e);
            return Ok(None);
        }
        self.top_up()?;
        debug_assert_eq!(self.loads[at.load], load, "loads follow the pass order");
        at.load += 1;
        let t = self
            .ahead
            .pop_front()
            .expect("a load is requested for every streamed unit");
        // `prefetch` loads go out behind this one before it is waited for: it holds its
        // staging slot while it lands and runs (or uploads), and the plan made `prefetch`
        // more for the loads ahead. The I/O engine sends the reads of the loads behind the
        // oldest only as its last are out (`io::FOLLOW_BYTES_DEFAULT`), so they keep the
        // disk busy while a layer runs without delaying the load it waits for.
        self.top_up()?;
        if self.unified {
            self.borrow(load, t, st)?;
            return Ok(None);
        }
        let mut slot = at.slot;
        if self.pinned == Some(slot) {
            slot = (slot + 1) % self.slots.len();
        }
        debug_assert!(self.pinned != Some(slot), "two streaming slots at least");
        at.slot = (slot + 1) % self.slots.len();
        self.stage(load, t, Dst::Stream(slot), st)?;
        self.in_slot[slot] = Some(load);
        Ok(Some(slot))
    }

    /// Once a load's compute is enqueued: its streaming slot's next upload waits for that
    /// compute only, and its staging slot goes back to the I/O engine.
    fn computed(&mut self, used: Option<usize>, st: &mut PassStats) -> Result<(), PipelineError> {
        self.computed_keeping(used, None, st)
    }

    /// `computed`, but a unified backend keeps lending load `keep` (a layer's first
    /// piece its last phase still reads).
    fn computed_keeping(
        &mut self,
        used: Option<usize>,
        keep: Option<Load>,
        st: &mut PassStats,
    ) -> Result<(), PipelineError> {
        if let Some(s) = used {
            self.backend.release_after(&self.slots[s]);
        }
        // A unified backend's compute has read its staging slots: they go back.
        self.borrowed.retain(|b| Some(b.0) == keep);
        // Once its upload has read the staging slots, they go back to the I/O engine for
        // the next loads (every one waited for, even after a failed wait, before any is
        // released).
        self.release_held(st)?;
        self.top_up()
    }

    /// Raw bytes of a load: the unit's, the part's, or the frames' of a sparse layer's
    /// dense part or expert.
    fn load_len(&self, load: Load) -> usize {
        let units = self.store.units();
        match load {
            Load::Unit(u) => units[u].raw_len as usize,
            Load::Part(p) => self.plan.head_parts[p].raw_len as usize,
            Load::Dense(u) | Load::Expert(u, _) | Load::Piece(u, _) => {
                units[u].part_span(self.load_frames(load), false) as usize
            }
        }
    }

    /// Piece `k` of pieced layer `u`.
    fn piece(&self, u: usize, k: usize) -> &crate::plan::LayerPiece {
        &self.plan.pieces[u]
            .as_ref()
            .expect("a piece of a layer that streams in pieces")[k]
    }

    /// The frames of a sparse layer's load, a piece or a part.
    fn load_frames(&self, load: Load) -> std::ops::Range<usize> {
        let sp = |u: usize| {
            self.plan.sparse[u]
                .as_ref()
                .expect("a sparse load of a sparse layer")
        };
        match load {
            Load::Dense(u) => sp(u).dense_frames.clone(),
            Load::Expert(u, e) => sp(u).experts[e as usize].frames.clone(),
            Load::Unit(u) => 0..self.store.units()[u].frames.len(),
            Load::Part(p) => self.plan.head_parts[p].frames.clone(),
            Load::Piece(u, k) => self.piece(u, k).frames.clone(),
        }
    }

    /// The raw offset in its unit of a load's first byte.
    fn load_base(&self, load: Load) -> u64 {
        match load {
            Load::Unit(_) | Load::Dense(_) => 0,
            Load::Part(p) => self.plan.head_parts[p].raw_base,
            Load::Piece(u, k) => self.piece(u, k).raw_base,
            Load::Expert(u, e) => {
                self.plan.sparse[u]
                    .as_ref()
                    .expect("an expert of a sparse layer")
                    .experts[e as usize]
                    .raw
                    .start
            }
        }
    }

    /// On a unified backend: waits for load `w` whole and lends its staging slot to the
    /// compute as device memory (no copy); the slot goes back once the load has run.
    fn borrow(
        &mut self,
        w: Load,
        ticket: Option<Ticket>,
        st: &mut PassStats,
    ) -> Result<(), PipelineError> {
        let len = self.load_len(w);
        let t =
            ticket.expect("a unified backend has no host cache: every streamed unit has a ticket");
        let t0 = Instant::now();
        let held = self.io.wait(t)?.detach();
        st.load_stall_s += t0.elapsed().as_secs_f64();
        // SAFETY: the slot stays held (and unchanged) in `borrowed` until the view is dropped.
        let mem = unsafe { self.backend.borrow_host(&held.data()[..len]) }
            .expect("a unified backend lends host bytes");
        st.bytes_uploaded += len as u64;
        self.borrowed.push((w, mem, held));
        Ok(())
    }

    /// Puts load `w` into streaming slot `slot`: from its I/O ticket (frame by frame), or
    /// from the host cache when it has no ticket.
    fn stage(
        &mut self,
        w: Load,
        ticket: Option<Ticket>,
        dst: Dst,
        st: &mut PassStats,
    ) -> Result<(), PipelineError> {
        let len = self.load_len(w);
        match ticket {
            Some(t) => self.load_into(t, dst, len, st),
            None => {
                let data = self.host_cache[w.unit()]
                    .as_ref()
                    .expect("host-cached unit");
                let base = self.load_base(w) as usize;
                let t1 = Instant::now();
                // The host cache lives as long as the pipeline: nothing to release.
                self.backend
                    .upload_async(dst_mem!(self, dst), &data.as_slice()[base..base + len])?;
                st.upload_s += t1.elapsed().as_secs_f64();
                st.bytes_uploaded += len as u64;
                st.bytes_from_host_cache += len as u64;
                Ok(())
            }
        }
    }

    /// Once a unit's compute is enqueued: waits until every held upload has read its
    /// staging slot, then hands the slots back to the I/O engine (every one waited for,
    /// even after a failed wait, before any is released).
    fn release_held(&mut self, st: &mut PassStats) -> Result<(), PipelineError> {
        let t1 = Instant::now();
        let mut waited = Ok(());
        let mut held = std::mem::take(&mut self.held_spare);
        std::mem::swap(&mut held, &mut self.held);
        for &(d, _) in &held {
            if let Err(e) = self.backend.upload_wait(dst_mem!(self, d)) {
                waited = waited.and(Err(e));
            }
        }
        // Dropping the guards hands the staging slots back to the I/O engine.
        held.clear();
        self.held_spare = held;
        st.upload_s += t1.elapsed().as_secs_f64();
        Ok(waited?)
    }

    /// The pass's copy, read and decompression figures, into the last and total stats.
    fn account(&mut self, mut st: PassStats, copy0: crate::backend::CopyStats, t_pass: Instant) {
        let copy1 = self.backend.copy_stats();
        st.copy_device_s = copy1.seconds - copy0.seconds;
        let io1 = self.io.stats();
        st.bytes_read = io1.read_bytes.saturating_sub(self.io_mark.read_bytes) + st.bytes_gathered;
        st.bytes_decompressed = io1
            .decompressed_bytes
            .saturating_sub(self.io_mark.decompressed_bytes);
        self.io_mark = io1;
        st.pass_time_s = t_pass.elapsed().as_secs_f64();
        self.total.add(&st);
        self.last = st;
    }

    pub fn options(&self) -> &ModelOptions {
        self.model.options()
    }

    /// The policies this pipeline runs with.
    pub fn pipeline_options(&self) -> &PipelineOptions {
        &self.opts
    }

    /// Skips the layer compute from the next pass on (or runs it again): a pass then
    /// measures streaming alone.
    pub fn set_skip_compute(&mut self, skip: bool) {
        self.opts.skip_compute = skip;
    }
}

// After the macros, which it uses.
mod moe;
pub use moe::{Eviction, ExpertProfile, Prediction, ProfileError, PROFILE_HOT_SHARE};
