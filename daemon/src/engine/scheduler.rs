//! The scheduler: one engine thread owns the runner and serves many requests with
//! continuous batching. Between passes it admits queued requests up to the maximum batch
//! (each takes a KV slot), builds one step of decode tokens and prefill chunks within the
//! token budget, runs it, samples each sequence, streams text, and evicts finished and
//! cancelled sequences at once. The request queue is bounded: a full queue is refused,
//! never grown.

use super::generate::{FinishReason, GenerateParams};
use super::EngineError;
use crate::backend::Backend;
use crate::model::SeqStep;
use crate::pipeline::Pipeline;
use crate::text::detok::{Detokenizer, StopMatcher};
use crate::text::{Sampler, Tokenizer};
use serde::Serialize;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{
    sync_channel, Receiver, RecvTimeoutError, SyncSender, TryRecvError, TrySendError,
};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::mpsc::UnboundedSender;

/// Why a request ended (the wire enum adds nothing to this).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Finish {
    Stop,
    Length,
    StopString,
    Context,
    Cancelled,
}

impl From<FinishReason> for Finish {
    fn from(f: FinishReason) -> Finish {
        match f {
            FinishReason::Stop => Finish::Stop,
            FinishReason::Length => Finish::Length,
            FinishReason::StopString => Finish::StopString,
            FinishReason::Context => Finish::Context,
        }
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Done {
    pub finish: Finish,
    pub prompt_token_ids: Vec<u32>,
    pub generated_token_ids: Vec<u32>,
    pub time_to_first_token_s: f64,
    pub prefill_tokens_per_s: f64,
    pub decode_tokens_per_s: f64,
    pub bytes_streamed: u64,
}

/// What a request's stream carries.
#[derive(Debug)]
pub enum Event {
    Piece {
        text: String,
        token_ids: Vec<u32>,
    },
    Done(Done),
    /// The step that carried the request failed (bad stored data: DATA_LOSS).
    Failed {
        data_loss: bool,
        message: String,
    },
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
}

/// Limits of the scheduler.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Requests waiting for a slot at most; beyond, submit answers QueueFull.
    pub queue_max: usize,
}

#[derive(Clone)]
pub struct Scheduler {
    tx: SyncSender<Request>,
    queued: Arc<AtomicUsize>,
    accepting: Arc<AtomicBool>,
    deadline: Arc<Mutex<Option<Instant>>>,
    status: Arc<Mutex<Status>>,
    pub tokenizer: Arc<Tokenizer>,
    pub max_context: usize,
    queue_max: usize,
}

struct Seq {
    req: Request,
    slot: usize,
    prefilled: usize,
    pos: usize,
    pending: Option<u32>,
    generated: Vec<u32>,
    unsent_ids: Vec<u32>,
    sampler: Sampler,
    detok: Detokenizer,
    stops: StopMatcher,
    t_admit: Instant,
    t_first: Option<Instant>,
    decode_steps: usize,
    bytes_streamed: u64,
}

impl Scheduler {
    /// Starts the engine thread with `runner`; returns the handle and the thread.
    pub fn start<B: Backend + 'static>(
        runner: Pipeline<B>,
        tokenizer: Arc<Tokenizer>,
        cfg: SchedulerConfig,
    ) -> (Scheduler, std::thread::JoinHandle<()>)
    where
        B::Mem: 'static,
    {
        // The channel holds the queue: the engine takes a request only when a slot is free.
        let (tx, rx) = sync_channel::<Request>(cfg.queue_max.max(1));
        let max_context = runner.options().max_context;
        let s = Scheduler {
            tx,
            queued: Arc::new(AtomicUsize::new(0)),
            accepting: Arc::new(AtomicBool::new(true)),
            deadline: Arc::new(Mutex::new(None)),
            status: Arc::new(Mutex::new(Status::default())),
            tokenizer,
            max_context,
            queue_max: cfg.queue_max.max(1),
        };
        let inner = s.clone();
        let h = std::thread::Builder::new()
            .name("sluice-engine".into())
            .spawn(move || inner.run(runner, rx))
            .expect("spawn the engine thread");
        (s, h)
    }

    /// Queues a request. A prompt the context cannot hold is refused here, before it
    /// takes a slot.
    pub fn submit(&self, req: Request) -> Result<(), SubmitError> {
        if !self.accepting.load(Ordering::Acquire) {
            return Err(SubmitError::ShuttingDown);
        }
        if req.prompt_ids.is_empty() {
            return Err(SubmitError::Invalid("the prompt is empty".into()));
        }
        if req.prompt_ids.len() >= self.max_context {
            return Err(SubmitError::Invalid(format!(
                "the prompt has {} tokens; the context holds {} (prompt plus generated tokens)",
                req.prompt_ids.len(),
                self.max_context
            )));
        }
        let vocab = self.tokenizer.vocab();
        if let Some(bad) = req.prompt_ids.iter().find(|&&t| t >= vocab) {
            return Err(SubmitError::Invalid(format!(
                "token id {bad} is past the vocabulary ({vocab})"
            )));
        }
        req.params
            .sampling
            .validate()
            .map_err(SubmitError::Invalid)?;
        self.queued.fetch_add(1, Ordering::AcqRel);
        match self.tx.try_send(req) {
            Ok(()) => Ok(()),
            Err(TrySendError::Full(_)) => {
                self.queued.fetch_sub(1, Ordering::AcqRel);
                Err(SubmitError::QueueFull(self.queue_max))
            }
            Err(TrySendError::Disconnected(_)) => {
                self.queued.fetch_sub(1, Ordering::AcqRel);
                Err(SubmitError::ShuttingDown)
            }
        }
    }

    pub fn status(&self) -> Status {
        let mut s = self.status.lock().expect("status lock").clone();
        s.queue_depth = self.queued.load(Ordering::Acquire);
        s
    }

    /// Stops admission; requests already admitted or queued finish, or are cancelled once
    /// `grace` has passed.
    pub fn shutdown(&self, grace: Duration) {
        self.accepting.store(false, Ordering::Release);
        *self.deadline.lock().expect("deadline lock") = Some(Instant::now() + grace);
    }

    fn run<B: Backend>(self, mut runner: Pipeline<B>, rx: Receiver<Request>) {
        let max_batch = runner.options().kv_slots;
        let budget = runner.options().max_batch_tokens;
        let mut free_slots: Vec<usize> = (0..max_batch).rev().collect();
        let mut active: Vec<Seq> = Vec::new();
        let mut logits = Vec::new();
        let mut decode_rate = 0.0;
        loop {
            // Admit while slots are free; block only when there is nothing to run.
            while let Some(&slot) = free_slots.last() {
                let next = if active.is_empty() {
                    match rx.recv_timeout(Duration::from_millis(50)) {
                        Ok(r) => Ok(r),
                        Err(RecvTimeoutError::Timeout) => Err(TryRecvError::Empty),
                        Err(RecvTimeoutError::Disconnected) => Err(TryRecvError::Disconnected),
                    }
                } else {
                    rx.try_recv()
                };
                match next {
                    Ok(req) => {
                        self.queued.fetch_sub(1, Ordering::AcqRel);
                        free_slots.pop();
                        let p = req.params.clone();
                        active.push(Seq {
                            slot,
                            prefilled: 0,
                            pos: 0,
                            pending: None,
                            generated: Vec::new(),
                            unsent_ids: Vec::new(),
                            sampler: Sampler::new(p.sampling),
                            detok: Detokenizer::default(),
                            stops: StopMatcher::new(p.stop.clone()),
                            t_admit: Instant::now(),
                            t_first: None,
                            decode_steps: 0,
                            bytes_streamed: 0,
                            req,
                        });
                    }
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => return,
                }
            }
            let past_deadline = self
                .deadline
                .lock()
                .expect("deadline lock")
                .is_some_and(|d| Instant::now() >= d);
            if past_deadline {
                // Grace is over: cancel what runs and what waits.
                for s in active.drain(..) {
                    free_slots.push(s.slot);
                    finish(&self.tokenizer, s, Finish::Cancelled, false);
                }
                while let Ok(req) = rx.try_recv() {
                    self.queued.fetch_sub(1, Ordering::AcqRel);
                    let _ = req.events.send(Event::Done(Done {
                        finish: Finish::Cancelled,
                        prompt_token_ids: req.prompt_ids,
                        generated_token_ids: Vec::new(),
                        time_to_first_token_s: 0.0,
                        prefill_tokens_per_s: 0.0,
                        decode_tokens_per_s: 0.0,
                        bytes_streamed: 0,
                    }));
                }
            }
            // A client that went away cancels its sequence; its slot is free at once.
            let mut i = 0;
            while i < active.len() {
                if active[i].req.events.is_closed() {
                    let s = active.swap_remove(i);
                    free_slots.push(s.slot);
                } else {
                    i += 1;
                }
            }
            if active.is_empty() {
                if !self.accepting.load(Ordering::Acquire)
                    && self.queued.load(Ordering::Acquire) == 0
                {
                    return;
                }
                self.publish(&runner, 0, decode_rate);
                continue;
            }
            // One step: every decoding sequence's next token, then prefill chunks in the
            // remaining token budget.
            let mut steps = Vec::new();
            let mut members = Vec::new();
            let mut left = budget;
            for (k, s) in active.iter().enumerate() {
                if let Some(t) = s.pending {
                    steps.push(SeqStep {
                        slot: s.slot,
                        pos: s.pos,
                        tokens: vec![t],
                    });
                    members.push(k);
                    left = left.saturating_sub(1);
                }
            }
            for (k, s) in active.iter().enumerate() {
                if s.pending.is_none() && s.prefilled < s.req.prompt_ids.len() && left > 0 {
                    let n = (s.req.prompt_ids.len() - s.prefilled).min(left);
                    steps.push(SeqStep {
                        slot: s.slot,
                        pos: s.pos,
                        tokens: s.req.prompt_ids[s.prefilled..s.prefilled + n].to_vec(),
                    });
                    members.push(k);
                    left -= n;
                }
            }
            let t0 = Instant::now();
            if let Err(e) = runner.step(&steps, &mut logits) {
                let data_loss = e.is_data_loss();
                tracing::error!("step of {} sequences failed: {e}", steps.len());
                let mut gone: Vec<usize> = members.clone();
                gone.sort_unstable_by(|a, b| b.cmp(a));
                for k in gone {
                    let s = active.swap_remove(k);
                    free_slots.push(s.slot);
                    let _ = s.req.events.send(Event::Failed {
                        data_loss,
                        message: e.to_string(),
                    });
                }
                continue;
            }
            let step_s = t0.elapsed().as_secs_f64();
            let pass_bytes = runner.last_pass().bytes_uploaded;
            let vocab = self.tokenizer.vocab() as usize;
            let mut finished = Vec::new();
            let mut decoded = 0usize;
            for (row, (&k, st)) in members.iter().zip(&steps).enumerate() {
                let s = &mut active[k];
                s.bytes_streamed += pass_bytes;
                s.pos += st.tokens.len();
                if s.pending.is_some() {
                    s.pending = None;
                    s.decode_steps += 1;
                    decoded += 1;
                } else {
                    s.prefilled += st.tokens.len();
                    if s.prefilled < s.req.prompt_ids.len() {
                        continue;
                    }
                }
                let token = s.sampler.sample(&logits[row * vocab..(row + 1) * vocab]);
                if s.t_first.is_none() {
                    s.t_first = Some(Instant::now());
                }
                s.generated.push(token);
                s.unsent_ids.push(token);
                let p = &s.req.params;
                if self.tokenizer.is_end(token) && !p.ignore_eos {
                    finished.push((k, Finish::Stop));
                    continue;
                }
                let (text, stopped) = s.stops.push(&s.detok.push(&self.tokenizer, token));
                if !text.is_empty() {
                    let ids = std::mem::take(&mut s.unsent_ids);
                    let _ = s.req.events.send(Event::Piece {
                        text,
                        token_ids: ids,
                    });
                }
                if stopped {
                    finished.push((k, Finish::StopString));
                } else if s.generated.len() >= p.max_tokens {
                    finished.push((k, Finish::Length));
                } else if s.pos + 1 > self.max_context {
                    finished.push((k, Finish::Context));
                } else {
                    s.pending = Some(token);
                }
            }
            if decoded > 0 {
                let rate = decoded as f64 / step_s;
                decode_rate = if decode_rate == 0.0 {
                    rate
                } else {
                    0.8 * decode_rate + 0.2 * rate
                };
            }
            finished.sort_unstable_by_key(|f| std::cmp::Reverse(f.0));
            for (k, why) in finished {
                let s = active.swap_remove(k);
                free_slots.push(s.slot);
                finish(&self.tokenizer, s, why, why != Finish::StopString);
            }
            self.publish(&runner, active.len(), decode_rate);
        }
    }

    fn publish<B: Backend>(&self, runner: &Pipeline<B>, active: usize, decode_rate: f64) {
        let p = runner.last_pass();
        let t = runner.total();
        let io = runner.io().stats();
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
        let mut s = self.status.lock().expect("status lock");
        s.active_sequences = active;
        s.passes = t.passes;
        s.last_pass_time_s = p.pass_time_s;
        s.decode_tokens_per_s = decode_rate;
        s.bytes_streamed_total = t.bytes_uploaded;
        s.device_bytes_peak = runner.backend.budget().peak();
        s.stages = st;
    }
}

fn finish(tok: &Tokenizer, mut s: Seq, why: Finish, flush: bool) {
    if flush {
        let (tail, _) = s.stops.push(&s.detok.flush(tok));
        let tail = tail + &s.stops.finish();
        if !tail.is_empty() || !s.unsent_ids.is_empty() {
            let _ = s.req.events.send(Event::Piece {
                text: tail,
                token_ids: std::mem::take(&mut s.unsent_ids),
            });
        }
    }
    let now = Instant::now();
    let first = s.t_first.unwrap_or(now);
    let prefill = (first - s.t_admit).as_secs_f64();
    let decode = (now - first).as_secs_f64();
    let _ = s.req.events.send(Event::Done(Done {
        finish: why,
        prompt_token_ids: s.req.prompt_ids.clone(),
        generated_token_ids: s.generated,
        time_to_first_token_s: prefill,
        prefill_tokens_per_s: s.req.prompt_ids.len() as f64 / prefill.max(1e-9),
        decode_tokens_per_s: s.decode_steps as f64 / decode.max(1e-9),
        bytes_streamed: s.bytes_streamed,
    }));
}

impl From<EngineError> for SubmitError {
    fn from(e: EngineError) -> SubmitError {
        SubmitError::Invalid(e.to_string())
    }
}
