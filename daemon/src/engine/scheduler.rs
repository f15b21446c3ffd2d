//! The scheduler: one engine thread owns the runner and serves many requests with
//! continuous batching. Between passes it admits queued requests up to the maximum batch
//! (each takes a KV slot), builds one step of decode tokens and prefill chunks within the
//! token budget, runs it, samples each sequence, streams text, and evicts finished and
//! cancelled sequences at once. The request queue is bounded: a full queue is refused,
//! never grown.

use super::draft::SpecStats;
use super::draft_model::DraftModel;
use super::kv_tiers::TierConfig;
use super::prefix::{PrefixCache, PrefixStats};
use super::replace::{Following, Replacer};
pub use super::sequence::{Done, Finish};
use super::sequence::{GenerateParams, Piece, SeqLimits, Sequence};
use super::step::StepBuilder;
use crate::backend::Backend;
use crate::model::SeqStep;
use crate::pipeline::Pipeline;
use crate::text::Tokenizer;
use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{
    sync_channel, Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError,
};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// What a request's stream carries.
#[derive(Debug)]
pub enum Event {
    Piece {
        text: String,
        token_ids: Vec<u32>,
        /// One per token id when the request asked for log-probabilities.
        logprobs: Vec<crate::text::TokenLogprob>,
    },
    Done(Done),
    /// The step that carried the request failed.
    Failed {
        failure: Failure,
        message: String,
    },
}

/// Why a request failed, as a server answers it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Failure {
    /// Stored data failed its checksum, could not be decoded, or could not be read.
    DataLoss,
    /// A condition that may pass (a read the disk did not answer in time): send it again.
    Unavailable,
    Internal,
}

impl From<Piece> for Event {
    fn from(p: Piece) -> Event {
        Event::Piece {
            text: p.text,
            token_ids: p.token_ids,
            logprobs: p.logprobs,
        }
    }
}

pub struct Request {
    pub prompt_ids: Vec<u32>,
    pub params: GenerateParams,
    pub events: UnboundedSender<Event>,
}

#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("the request queue is full ({0} waiting); retry later")]
    QueueFull(usize),
    #[error("the daemon is shutting down")]
    ShuttingDown,
    #[error("{0}")]
    Invalid(String),
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct StageRates {
    pub disk_read_bytes_per_s: f64,
    pub decompress_bytes_per_s: f64,
    pub upload_bytes_per_s: f64,
    pub compute_weight_bytes_per_s: f64,
    /// Seconds each stage took in the last pass (decompression per worker).
    pub disk_read_s: f64,
    pub decompress_s: f64,
    pub upload_s: f64,
    pub compute_s: f64,
    pub load_stall_s: f64,
    pub limiting_stage: String,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Status {
    pub queue_depth: usize,
    pub active_sequences: usize,
    pub passes: u64,
    pub last_pass_time_s: f64,
    pub decode_tokens_per_s: f64,
    pub bytes_streamed_total: u64,
    pub device_bytes_peak: u64,
    pub stages: StageRates,
    /// Every pass since the start, summed (bytes read, decompressed, uploaded, seconds of
    /// compute, upload and load stall), and the I/O engine's counters.
    pub totals: crate::pipeline::PassStats,
    pub io: crate::io::IoStats,
    /// The streaming I/O engine's pools now (read when the status is asked for).
    pub io_pools: crate::io::PoolStatus,
    /// A mixture of experts: per decoder layer, tokens routed to each expert (empty for a
    /// dense layer or model).
    pub expert_tokens: Vec<Vec<u64>>,
    /// Speculative decoding: drafted and accepted tokens, tokens a decode step yields.
    pub speculative: SpecStats,
    /// The prefix cache: what its tiers hold, prompts that reused KV, tokens not prefilled.
    pub prefix_cache: PrefixStats,
    /// `--placement auto` following the batch: the placement in use and its changes.
    pub following: Option<Following>,
}

/// Limits of the scheduler.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Requests waiting for a slot at most; beyond, submit answers QueueFull.
    pub queue_max: usize,
    /// Reuse the KV of prompt prefixes (`--prefix-cache`; `PrefixCache`).
    pub prefix_cache: bool,
    /// Its host and disk tiers (`--kv-cache-host`, `--kv-cache-dir`).
    pub kv_tiers: TierConfig,
}

#[derive(Clone)]
pub struct Scheduler {
    tx: SyncSender<Request>,
    queued: Arc<AtomicUsize>,
    accepting: Arc<AtomicBool>,
    deadline: Arc<Mutex<Option<Instant>>>,
    status: Arc<Mutex<Status>>,
    /// The I/O engine's pools (the pipeline's: another after a change of placement).
    pools: Arc<Mutex<crate::io::PoolGauge>>,
    pub tokenizer: Arc<Tokenizer>,
    pub max_context: usize,
    queue_max: usize,
    prefix_cache: bool,
    kv_tiers: TierConfig,
    /// Requests to empty the prefix cache and what the engine did with them.
    clears: Arc<Mutex<Clears>>,
}

/// Requests to empty the prefix cache (`Scheduler::ask_clear`): how many were asked, how
/// many the engine has served, and the positions its last one gave up.
#[derive(Default)]
struct Clears {
    asked: u64,
    done: u64,
    dropped: u64,
}

/// Places held in the queue for one call's requests (`Scheduler::reserve`): each request
/// submitted through them takes one; those not taken are given back when they drop.
/// `queued` counts them from the start, and every request reaches the channel through
/// such places, so `queued <= queue_max` holds and the channel (of `queue_max` places)
/// has room for each of them.
pub struct Places<'a> {
    s: &'a Scheduler,
    left: usize,
}

impl Places<'_> {
    /// Queues a request in one of the places (`Scheduler::submit`'s checks).
    pub fn submit(&mut self, req: Request) -> Result<(), SubmitError> {
        self.s.validate(&req)?;
        self.send(req)
    }

    fn send(&mut self, req: Request) -> Result<(), SubmitError> {
        if self.left == 0 {
            return Err(SubmitError::Invalid(
                "more requests than the places held for them".into(),
            ));
        }
        match self.s.tx.try_send(req) {
            Ok(()) => {
                self.left -= 1;
                Ok(())
            }
            Err(TrySendError::Full(_)) => Err(SubmitError::QueueFull(self.s.queue_max)),
            Err(TrySendError::Disconnected(_)) => Err(SubmitError::ShuttingDown),
        }
    }
}

impl Drop for Places<'_> {
    fn drop(&mut self) {
        if self.left > 0 {
            self.s.queued.fetch_sub(self.left, Ordering::AcqRel);
        }
    }
}

/// An admitted request: its sequence and where its events go.
struct Active {
    seq: Sequence,
    events: UnboundedSender<Event>,
}

impl AsMut<Sequence> for Active {
    fn as_mut(&mut self) -> &mut Sequence {
        &mut self.seq
    }
}

impl AsRef<Sequence> for Active {
    fn as_ref(&self) -> &Sequence {
        &self.seq
    }
}

/// The engine thread's state between steps. Every buffer here is kept across steps.
struct EngineState<B: Backend> {
    runner: Pipeline<B>,
    rx: Receiver<Request>,
    free_slots: Vec<usize>,
    active: Vec<Active>,
    logits: Vec<f32>,
    /// The step being built: its first `n_steps` entries, one row group per member (the
    /// entries are reused step after step, token lists and all).
    steps: Vec<SeqStep>,
    n_steps: usize,
    /// Index into `active` of each entry of `steps`.
    members: Vec<usize>,
    /// Decode tokens per second, smoothed over steps.
    decode_rate: f64,
    /// Speculative decoding's counts since the start.
    spec: SpecStats,
    /// Builds each step, with drafts weighed by the passes measured so far.
    builder: StepBuilder,
    /// A draft model proposing the sequences' tokens before each step.
    draft: Option<DraftModel<B>>,
    /// KV of prompt prefixes that slots hold, for the sequences that share them.
    prefix: PrefixCache,
    /// `--placement auto` following the batch (`engine::replace`).
    replacer: Option<Replacer<B>>,
}

impl<B: Backend> EngineState<B> {
    /// Frees the slot of a sequence that is over: the prefix cache keeps its KV (`valid`:
    /// its KV holds its text, which a failed step may have broken), else its KV memory is
    /// given back (`Pipeline::discard_slot`); the draft model's is given back either way.
    fn free_slot(&mut self, seq: &Sequence, valid: bool) {
        let slot = seq.slot();
        self.free_slots.push(slot);
        self.prefix.release(&self.runner, (seq, valid));
        if !self.prefix.enabled() || !valid {
            self.runner.discard_slot(slot);
        }
        if let Some(d) = &mut self.draft {
            d.discard_slot(&self.runner, slot);
        }
    }
}

/// What admission found.
enum Admitted {
    /// Keep running.
    Running,
    /// The queue is closed and empty: the engine thread ends.
    Closed,
}

impl Scheduler {
    /// Starts the engine thread with `runner` (and a draft model to propose tokens);
    /// returns the handle and the thread.
    pub fn start<B: Backend + 'static>(
        runner: Pipeline<B>,
        draft: Option<DraftModel<B>>,
        tokenizer: Arc<Tokenizer>,
        cfg: SchedulerConfig,
    ) -> (Scheduler, std::thread::JoinHandle<()>)
    where
        B::Mem: 'static,
    {
        Scheduler::start_following(runner, draft, None, tokenizer, cfg)
    }

    /// `start`, the placement following the batch with `replacer` (`engine::replace`;
    /// beside a draft model's own pipeline, not beside a self-draft, which lives in the
    /// model's: it is then left out, and said so).
    pub fn start_following<B: Backend + 'static>(
        runner: Pipeline<B>,
        draft: Option<DraftModel<B>>,
        mut replacer: Option<Replacer<B>>,
        tokenizer: Arc<Tokenizer>,
        cfg: SchedulerConfig,
    ) -> (Scheduler, std::thread::JoinHandle<()>)
    where
        B::Mem: 'static,
    {
        let self_draft = draft.as_ref().is_some_and(|d| d.plan().is_none());
        if self_draft && replacer.take().is_some() {
            tracing::warn!("placement auto does not follow the batch beside a self-draft");
        }
        // The channel holds the queue: the engine takes a request only when a slot is free.
        let (tx, rx) = sync_channel::<Request>(cfg.queue_max.max(1));
        let max_context = runner.options().max_context;
        let s = Scheduler {
            tx,
            queued: Arc::new(AtomicUsize::new(0)),
            accepting: Arc::new(AtomicBool::new(true)),
            deadline: Arc::new(Mutex::new(None)),
            // The experts' layout from the start (zero counts), before any step publishes.
            status: Arc::new(Mutex::new(Status {
                expert_tokens: {
                    let mut t = Vec::new();
                    runner.expert_tokens_into(&mut t);
                    t
                },
                ..Status::default()
            })),
            pools: Arc::new(Mutex::new(runner.io().pool_gauge())),
            tokenizer,
            max_context,
            queue_max: cfg.queue_max.max(1),
            prefix_cache: cfg.prefix_cache,
            kv_tiers: cfg.kv_tiers,
            clears: Arc::default(),
        };
        let inner = s.clone();
        // A thread that cannot be made at start leaves nothing to serve with: fatal.
        #[allow(clippy::expect_used)]
        let h = std::thread::Builder::new()
            .name("sluice-engine".into())
            .spawn(move || inner.run(runner, draft, replacer, rx))
            .expect("spawn the engine thread");
        (s, h)
    }

    /// Queues a request. A prompt the context cannot hold is refused here, before it
    /// takes a slot.
    pub fn submit(&self, req: Request) -> Result<(), SubmitError> {
        if !self.accepting.load(Ordering::Acquire) {
            return Err(SubmitError::ShuttingDown);
        }
        self.validate(&req)?;
        self.reserve(1)?.send(req)
    }

    /// Holds `n` places in the queue for the requests of one call, all or none: a call of
    /// several prompts that do not all fit is refused whole and leaves nothing queued
    /// (queued one by one, the first ones waited, cancelled, until the engine took them,
    /// and meanwhile filled the queue against other clients). More than the queue ever
    /// holds is invalid, not "retry later": such a call could never be admitted.
    pub fn reserve(&self, n: usize) -> Result<Places<'_>, SubmitError> {
        if !self.accepting.load(Ordering::Acquire) {
            return Err(SubmitError::ShuttingDown);
        }
        if n > self.queue_max {
            return Err(SubmitError::Invalid(format!(
                "{n} sequences in one call (prompts times n), and the queue holds {} requests: send at most {} a call (or raise `--queue-max`, `queue_max` in the config file)",
                self.queue_max, self.queue_max
            )));
        }
        let mut now = self.queued.load(Ordering::Acquire);
        loop {
            if now + n > self.queue_max {
                return Err(SubmitError::QueueFull(self.queue_max));
            }
            match self.queued.compare_exchange_weak(
                now,
                now + n,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(Places { s: self, left: n }),
                Err(seen) => now = seen,
            }
        }
    }

    fn validate(&self, req: &Request) -> Result<(), SubmitError> {
        self.check(&req.prompt_ids, &req.params)
    }

    /// The checks `submit` makes of a request (its prompt against the context and the
    /// vocabulary, its parameters), without queueing it: a caller that must take queue
    /// places for several requests checks each first, so that a full queue refuses only
    /// requests that could run.
    pub fn check(&self, prompt_ids: &[u32], params: &GenerateParams) -> Result<(), SubmitError> {
        super::sequence::validate(prompt_ids, params, self.limits()).map_err(SubmitError::Invalid)
    }

    fn limits(&self) -> SeqLimits {
        SeqLimits {
            max_context: self.max_context,
            vocab: self.tokenizer.vocab(),
        }
    }

    pub fn status(&self) -> Status {
        let mut s = self
            .status
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        s.queue_depth = self.queued.load(Ordering::Acquire);
        s.io_pools = self
            .pools
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .read();
        s
    }

    /// Asks the engine to empty the prefix cache before its next step (`sluice cache
    /// clear`); returns the ticket `clear_done` answers for.
    pub fn ask_clear(&self) -> u64 {
        let mut c = self
            .clears
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        c.asked += 1;
        c.asked
    }

    /// Once the engine has emptied the prefix cache for `ticket`: the positions of KV it
    /// gave up.
    pub fn clear_done(&self, ticket: u64) -> Option<u64> {
        let c = self
            .clears
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (c.done >= ticket).then_some(c.dropped)
    }

    /// Empties the prefix cache if asked to: the kept slots give up their KV, and their
    /// memory goes back (`Pipeline::discard_slot`).
    fn serve_clears<B: Backend>(&self, st: &mut EngineState<B>) {
        let c = self
            .clears
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if c.done == c.asked {
            return;
        }
        let asked = c.asked;
        drop(c);
        let dropped = st.prefix.clear();
        for &slot in &st.free_slots {
            st.runner.discard_slot(slot);
        }
        // Status says so before the asker hears it is done.
        self.publish(st, st.active.len());
        let mut c = self
            .clears
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        (c.done, c.dropped) = (asked, dropped);
    }

    /// Stops admission; requests already admitted or queued finish, or are cancelled once
    /// `grace` has passed.
    pub fn shutdown(&self, grace: Duration) {
        self.accepting.store(false, Ordering::Release);
        *self
            .deadline
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(Instant::now() + grace);
    }

    fn run<B: Backend>(
        self,
        runner: Pipeline<B>,
        draft: Option<DraftModel<B>>,
        replacer: Option<Replacer<B>>,
        rx: Receiver<Request>,
    ) {
        let max_batch = runner.options().kv_slots;
        let serial = runner.backend.unified();
        let prefix =
            PrefixCache::new(max_batch, self.prefix_cache).with_tiers(&runner, &self.kv_tiers);
        let mut st = EngineState {
            runner,
            rx,
            free_slots: (0..max_batch).rev().collect(),
            active: Vec::with_capacity(max_batch),
            logits: Vec::new(),
            steps: Vec::with_capacity(max_batch),
            n_steps: 0,
            members: Vec::with_capacity(max_batch),
            decode_rate: 0.0,
            spec: SpecStats::default(),
            builder: StepBuilder::new(serial),
            draft,
            prefix,
            replacer,
        };
        loop {
            self.serve_clears(&mut st);
            if let Admitted::Closed = self.admit(&mut st) {
                return;
            }
            self.cancel_past_deadline(&mut st);
            // A client that went away cancels its sequence; its slot is free at once.
            let mut i = 0;
            while i < st.active.len() {
                if st.active[i].events.is_closed() {
                    let a = st.active.swap_remove(i);
                    st.free_slot(&a.seq, true);
                } else {
                    i += 1;
                }
            }
            if st.active.is_empty() {
                if !self.accepting.load(Ordering::Acquire)
                    && self.queued.load(Ordering::Acquire) == 0
                {
                    return;
                }
                self.publish(&st, 0);
                continue;
            }
            st.prefix.before_step(&mut st.runner, &mut st.active);
            propose_drafts(&mut st);
            build_step(&mut st);
            let t0 = Instant::now();
            if let Err(e) = st.runner.step(&st.steps[..st.n_steps], &mut st.logits) {
                fail_step(&mut st, &e);
                continue;
            }
            st.builder
                .ran(&st.steps[..st.n_steps], st.runner.last_pass());
            self.apply_results(&mut st, t0.elapsed().as_secs_f64());
            let rows = st.steps[..st.n_steps].iter().map(|s| s.tokens.len()).sum();
            let took = st.runner.last_pass().pass_time_s;
            if let Some(c) = st.replacer.as_mut().and_then(|r| r.observe(rows, took)) {
                match self.change_placement(st, c) {
                    Some(s) => st = s,
                    None => return,
                }
            }
            self.publish(&st, st.active.len());
        }
    }

    /// Changes the placement to `choice`'s between two passes (`engine::replace`), the
    /// running sequences' and the kept slots' KV carried across. None when no pipeline
    /// could be built again: every running sequence fails, admission stops and the
    /// engine thread ends (the queued requests' streams end with it).
    fn change_placement<B: Backend>(
        &self,
        mut st: EngineState<B>,
        choice: crate::plan::placement::Choice,
    ) -> Option<EngineState<B>> {
        let Some(mut rp) = st.replacer.take() else {
            return Some(st);
        };
        let slots: Vec<(usize, usize)> = (st.active.iter())
            .map(|a| (a.seq.slot(), a.seq.written()))
            .chain(st.prefix.kept_slots())
            .collect();
        let tier_before = st.runner.plan.host.kv_cache_host_bytes;
        let EngineState {
            runner,
            rx,
            free_slots,
            active,
            logits,
            steps,
            n_steps,
            members,
            decode_rate,
            spec,
            builder,
            draft,
            prefix,
            replacer: _,
        } = st;
        match rp.change(runner, &slots, choice) {
            Ok(runner) => {
                *self
                    .pools
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = runner.io().pool_gauge();
                // The host tier grows or shrinks by what the new plan gives it more or
                // less than the old one did.
                let mut prefix = prefix;
                let now = runner.plan.host.kv_cache_host_bytes;
                if now != tier_before {
                    let budget = prefix.stats().tiers.host_budget_bytes;
                    prefix.set_host_budget((budget + now).saturating_sub(tier_before));
                }
                Some(EngineState {
                    runner,
                    rx,
                    free_slots,
                    active,
                    logits,
                    steps,
                    n_steps,
                    members,
                    decode_rate,
                    spec,
                    builder,
                    draft,
                    prefix,
                    replacer: Some(rp),
                })
            }
            Err(e) => {
                tracing::error!("placement auto: no pipeline left after a change ({e}); the model stops serving");
                self.accepting.store(false, Ordering::Release);
                for a in active {
                    let _ = a.events.send(Event::Failed {
                        failure: Failure::Internal,
                        message: format!("the model's pipeline could not be built again after a change of placement: {e}"),
                    });
                }
                None
            }
        }
    }

    /// Admits queued requests while KV slots are free; blocks (briefly) only when nothing
    /// runs.
    fn admit<B: Backend>(&self, st: &mut EngineState<B>) -> Admitted {
        while !st.free_slots.is_empty() {
            let next = if st.active.is_empty() {
                match st.rx.recv_timeout(Duration::from_millis(50)) {
                    Ok(r) => Ok(r),
                    Err(RecvTimeoutError::Timeout) => Err(TryRecvError::Empty),
                    Err(RecvTimeoutError::Disconnected) => Err(TryRecvError::Disconnected),
                }
            } else {
                st.rx.try_recv()
            };
            let req = match next {
                Ok(req) => req,
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => return Admitted::Closed,
            };
            self.queued.fetch_sub(1, Ordering::AcqRel);
            let at = st
                .prefix
                .choose_slot(&st.runner, &st.free_slots, &req.prompt_ids);
            let slot = st.free_slots[at];
            match Sequence::new(req.prompt_ids, req.params, slot, self.limits()) {
                Ok(seq) => {
                    st.free_slots.remove(at);
                    st.prefix.admitted(seq.prompt().len());
                    st.active.push(Active {
                        seq,
                        events: req.events,
                    });
                }
                // `submit` validated it against the same limits: unreachable in practice,
                // answered all the same.
                Err(message) => {
                    let _ = req.events.send(Event::Failed {
                        failure: Failure::Internal,
                        message,
                    });
                }
            }
        }
        Admitted::Running
    }

    /// Once the shutdown grace period is over: cancels what runs and what waits.
    fn cancel_past_deadline<B: Backend>(&self, st: &mut EngineState<B>) {
        let past_deadline = self
            .deadline
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .is_some_and(|d| Instant::now() >= d);
        if !past_deadline {
            return;
        }
        let mut gone = std::mem::take(&mut st.active);
        for a in gone.drain(..) {
            st.free_slot(&a.seq, true);
            let (_, done) = a.seq.close(Finish::Cancelled, &self.tokenizer);
            let _ = a.events.send(Event::Done(done));
        }
        st.active = gone;
        while let Ok(req) = st.rx.try_recv() {
            self.queued.fetch_sub(1, Ordering::AcqRel);
            let _ = req.events.send(Event::Done(Done {
                finish: Finish::Cancelled,
                prompt_token_ids: req.prompt_ids,
                generated_token_ids: Vec::new(),
                time_to_first_token_s: 0.0,
                prefill_tokens_per_s: 0.0,
                decode_tokens_per_s: 0.0,
                bytes_streamed: 0,
                cached_tokens: 0,
            }));
        }
    }

    /// Hands each member of the step that ran its logits row, streams new text, and closes
    /// the sequences that finished.
    fn apply_results<B: Backend>(&self, st: &mut EngineState<B>, step_s: f64) {
        let pass_bytes = st.runner.last_pass().bytes_uploaded;
        let vocab = self.tokenizer.vocab() as usize;
        let mut decoded = 0usize;
        let mut row = 0;
        for (&k, step) in st.members.iter().zip(&st.steps[..st.n_steps]) {
            let a = &mut st.active[k];
            let before = a.seq.generated().len();
            let decoding = a.seq.is_decoding();
            let rows = step.logit_rows();
            let logits = &st.logits[row * vocab..(row + rows) * vocab];
            row += rows;
            let p = a
                .seq
                .advance(step.tokens.len(), logits, &self.tokenizer, pass_bytes);
            if decoding {
                let emitted = a.seq.generated().len() - before;
                decoded += emitted;
                st.spec.record(step.tokens.len() - 1, emitted);
            }
            if let Some(p) = p {
                let _ = a.events.send(p.into());
            }
        }
        if decoded > 0 {
            let rate = decoded as f64 / step_s;
            st.decode_rate = if st.decode_rate == 0.0 {
                rate
            } else {
                0.8 * st.decode_rate + 0.2 * rate
            };
        }
        let mut k = st.active.len();
        while k > 0 {
            k -= 1;
            if let Some(why) = st.active[k].seq.finished() {
                let a = st.active.swap_remove(k);
                st.free_slot(&a.seq, true);
                let (tail, done) = a.seq.close(why, &self.tokenizer);
                if let Some(p) = tail {
                    let _ = a.events.send(p.into());
                }
                let _ = a.events.send(Event::Done(done));
            }
        }
    }

    fn publish<B: Backend>(&self, state: &EngineState<B>, active: usize) {
        let (runner, decode_rate, spec) = (&state.runner, state.decode_rate, &state.spec);
        let p = runner.last_pass();
        let mut t = runner.total().clone();
        let mut io = runner.io().stats();
        // The pipelines a change of placement replaced count too.
        if let Some(r) = &state.replacer {
            t.add(&r.before.0);
            io = io.plus(&r.before.1);
        }
        let workers = runner.io().config().workers.max(1) as f64;
        let raw: u64 = runner.store.manifest().raw_bytes();
        let mut st = StageRates {
            disk_read_bytes_per_s: io.read_bytes as f64 / io.read_busy_s.max(1e-9),
            decompress_bytes_per_s: io.decompressed_bytes as f64
                / (io.decompress_busy_s / workers).max(1e-9),
            upload_bytes_per_s: t.bytes_uploaded as f64 / t.upload_s.max(1e-9),
            compute_weight_bytes_per_s: raw as f64 * t.passes as f64 / t.compute_s.max(1e-9),
            upload_s: p.upload_s,
            compute_s: p.compute_s,
            load_stall_s: p.load_stall_s,
            ..StageRates::default()
        };
        st.disk_read_s = p.bytes_read as f64 / st.disk_read_bytes_per_s.max(1.0);
        st.decompress_s = p.bytes_decompressed as f64 / st.decompress_bytes_per_s.max(1.0);
        let stages = [
            ("disk_read", st.disk_read_s),
            ("decompress", st.decompress_s),
            ("upload", st.upload_s),
            ("compute", st.compute_s),
        ];
        st.limiting_stage = stages
            .iter()
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map_or("compute", |s| s.0)
            .to_string();
        let mut s = self
            .status
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        s.active_sequences = active;
        s.passes = t.passes;
        s.last_pass_time_s = p.pass_time_s;
        s.decode_tokens_per_s = decode_rate;
        s.bytes_streamed_total = t.bytes_uploaded;
        s.device_bytes_peak = runner.backend.budget().peak();
        s.stages = st;
        // In place: the same shape every step, so nothing is allocated after the first.
        runner.expert_tokens_into(&mut s.expert_tokens);
        if let Some(r) = &state.replacer {
            super::replace::add_experts(&mut s.expert_tokens, &r.expert_tokens);
        }
        s.totals = t;
        s.io = io;
        s.speculative = *spec;
        s.prefix_cache = state.prefix.stats();
        // Copied when a change (made or given up) altered it, not every pass: it holds
        // the last choice's candidates.
        if let Some(r) = &state.replacer {
            let seen = s.following.as_ref().map(|f| (f.changes, f.failed));
            if seen != Some((r.status.changes, r.status.failed)) {
                s.following = Some(r.status.clone());
            }
        }
    }
}

/// The draft model's proposals for the sequences that draft with it. A draft that fails
/// (its own read or device error) is dropped and the model serves on without it: the
/// requests did not ask for it and lose nothing.
fn propose_drafts<B: Backend>(st: &mut EngineState<B>) {
    let Some(d) = &mut st.draft else { return };
    let r = d.propose(&mut st.runner, &mut st.active);
    (st.spec.draft_passes, st.spec.draft_seconds) = (d.passes, d.seconds);
    if let Err(e) = r {
        tracing::error!("the draft model failed ({e}); serving on without it");
        st.draft = None;
        for a in &mut st.active {
            a.seq.clear_proposal();
        }
    }
}

/// One step: every decoding sequence's next token first (decode rows lead the batch, each
/// with the drafts the row budget pays for), then prefill chunks in the remaining token
/// budget (`StepBuilder`).
fn build_step<B: Backend>(st: &mut EngineState<B>) {
    let active = &st.active;
    st.n_steps = st.builder.build(
        active.len(),
        |k| &active[k].seq,
        st.runner.options(),
        &mut st.steps,
        &mut st.members,
    );
}

/// A failed step fails every sequence that was in it (DATA_LOSS for bad stored data,
/// UNAVAILABLE for a stalled disk).
fn fail_step<B: Backend>(st: &mut EngineState<B>, e: &crate::pipeline::PipelineError) {
    let failure = if e.is_data_loss() {
        Failure::DataLoss
    } else if e.is_unavailable() {
        Failure::Unavailable
    } else {
        Failure::Internal
    };
    tracing::error!("step of {} sequences failed: {e}", st.n_steps);
    st.members.sort_unstable_by(|a, b| b.cmp(a));
    for i in 0..st.members.len() {
        let a = st.active.swap_remove(st.members[i]);
        st.free_slot(&a.seq, false);
        let _ = a.events.send(Event::Failed {
            failure,
            message: e.to_string(),
        });
    }
}
