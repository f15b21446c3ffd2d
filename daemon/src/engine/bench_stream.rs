//! `sluiced bench-stream`: does the overlap work, and does batching amortize streaming?
//! All figures come from one run: compute-only (every unit resident), streaming-only
//! (the plan's loads with compute skipped) and the real streamed pass in alternation, then
//! decode tokens/s at several batch sizes under the same budget.

use crate::backend::Backend;
use crate::engine::{on_backend, Chosen, EngineError, OnBackend};
use crate::io::IoConfig;
use crate::model::{ModelOptions, SeqStep};
use crate::pipeline::Pipeline;
use crate::plan::PlanInput;
use crate::store::Store;
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;

#[derive(Clone, Debug)]
pub struct BenchStreamOptions {
    /// The streamed run's device budget (None: the host budget decides).
    pub device_budget: Option<u64>,
    pub host_cache_budget: u64,
    /// The streamed run's host side (None: not limited).
    pub host: Option<crate::plan::HostInput>,
    pub prefetch: Option<usize>,
    pub expert_cache: Option<usize>,
    pub expert_eviction: crate::pipeline::Eviction,
    pub expert_prediction: crate::pipeline::Prediction,
    /// Loaded into every streamed run's pipeline (and planned for).
    pub expert_profile: Option<crate::pipeline::ExpertProfile>,
    pub threads: usize,
    pub io: IoConfig,
    pub batches: Vec<usize>,
    /// Decode steps timed per batch size.
    pub steps: usize,
    /// Prompt tokens prefilled per sequence before decoding.
    pub prompt_tokens: usize,
}

#[derive(Debug, Serialize)]
pub struct BatchResult {
    pub batch: usize,
    pub pass_s: f64,
    pub tokens_per_s: f64,
    /// tokens_per_s / (batch x the batch-1 rate).
    pub vs_linear: f64,
    pub load_stall_s_per_pass: f64,
    pub compute_s_per_pass: f64,
    /// A mixture whose experts stream: what the timed decode steps loaded and why.
    pub experts: Option<ExpertFigures>,
}

/// A mixture's streamed experts over the timed decode steps of one batch size.
#[derive(Debug, Serialize)]
pub struct ExpertFigures {
    /// Bytes read from disk per token generated (every read: dense parts, experts, units).
    pub bytes_read_per_token: f64,
    /// Bytes of the routed experts that missed the expert cache, per token.
    pub expert_bytes_missed_per_token: f64,
    /// bytes_read_per_token / expert_bytes_missed_per_token (target <= 1.2).
    pub read_vs_missed: f64,
    /// What streaming the same layers whole would read per token (their stored bytes
    /// per pass over the batch), and how many times less is read here.
    pub whole_layer_bytes_per_token: f64,
    pub whole_layer_vs_read: f64,
    /// Experts routed per token (over the streamed layers), and the share served by the
    /// expert cache.
    pub experts_routed_per_token: f64,
    pub cache_hit_rate: f64,
    /// Of the experts predicted before their layer routed, the share it chose.
    pub prediction_precision: f64,
}

#[derive(Debug, Serialize)]
pub struct BenchStreamReport {
    pub backend: String,
    pub model_raw_bytes: u64,
    pub device_budget: u64,
    pub layers_resident: usize,
    pub layers_streamed: usize,
    pub disk_bytes_per_pass: u64,
    pub upload_bytes_per_pass: u64,
    pub compute_only_pass_s: f64,
    /// Streaming-only and streamed passes at batch 1 run in alternation (`steps` of each):
    /// each the median of its passes.
    pub streaming_only_pass_s: f64,
    pub streamed_pass_s: f64,
    /// streamed / max(compute-only, streaming-only), per pair of alternated passes, the
    /// median: 1.0 is perfect overlap.
    pub overlap_ratio: f64,
    /// Decode tokens/s at batch 1 with every unit resident, and streamed under the budget.
    pub resident_tokens_per_s: f64,
    pub streamed_tokens_per_s: f64,
    /// The streamed run's host budget, its plan's host total, and the process's peak
    /// resident set (VmHWM, over the whole benchmark).
    pub host_bytes_budget: Option<u64>,
    pub host_bytes_planned: u64,
    pub host_bytes_peak: u64,
    /// Copy-stream bandwidth while streaming (bytes uploaded / device time of the copies)
    /// over the streamed batch-1 passes; 0 for a synchronous backend.
    pub copy_gbps: f64,
    /// A plain page-locked host-to-device copy of one streaming slot's size, same run.
    pub plain_h2d_gbps: f64,
    /// copy_gbps / plain_h2d_gbps (target >= 0.9).
    pub copy_vs_plain: f64,
    /// A mixture: the expert cache's slots, those pinned from a profile, and the policies.
    pub expert_cache_slots: usize,
    pub expert_hot_slots: usize,
    pub expert_eviction: crate::pipeline::Eviction,
    pub expert_prediction: crate::pipeline::Prediction,
    pub batches: Vec<BatchResult>,
}

fn token_ids(n: usize, vocab: u32, seed: u64) -> Vec<u32> {
    let mut rng = crate::util::rng::Rng::new(seed);
    // Stay clear of the special ids at the start of most vocabularies.
    (0..n)
        .map(|_| 256 + rng.below((vocab as u64).saturating_sub(256).max(1)) as u32)
        .collect()
}

/// Prefills `batch` sequences of `prompt` tokens; returns the position decoding starts at.
fn prefill<B: Backend>(
    r: &mut Pipeline<B>,
    batch: usize,
    prompt: usize,
    vocab: u32,
    logits: &mut Vec<f32>,
) -> Result<usize, EngineError> {
    let seqs: Vec<SeqStep> = (0..batch)
        .map(|b| SeqStep {
            slot: b,
            pos: 0,
            tokens: token_ids(prompt, vocab, b as u64 + 1),
            verify: false,
            ..Default::default()
        })
        .collect();
    let per_step = (r.options().max_batch_tokens / prompt).max(1);
    for chunk in seqs.chunks(per_step) {
        r.step(chunk, logits)?;
    }
    Ok(prompt)
}

/// One decode step of `batch` sequences at `pos`.
fn decode_step<B: Backend>(
    r: &mut Pipeline<B>,
    batch: usize,
    pos: usize,
    vocab: u32,
    logits: &mut Vec<f32>,
) -> Result<(), EngineError> {
    let s: Vec<SeqStep> = (0..batch)
        .map(|b| SeqStep {
            slot: b,
            pos,
            tokens: token_ids(1, vocab, (pos * 131 + b) as u64),
            verify: false,
            ..Default::default()
        })
        .collect();
    Ok(r.step(&s, logits)?)
}

/// Prefills `batch` sequences, then times `steps` decode steps; returns (seconds per pass,
/// load stall per pass, compute per pass) and the pipeline's totals before the timed steps.
fn decode_passes<B: Backend>(
    r: &mut Pipeline<B>,
    batch: usize,
    prompt: usize,
    steps: usize,
    vocab: u32,
) -> Result<((f64, f64, f64), crate::pipeline::PassStats), EngineError> {
    let mut logits = Vec::new();
    let mut pos = prefill(r, batch, prompt, vocab, &mut logits)?;
    // One untimed decode step warms the caches.
    decode_step(r, batch, pos, vocab, &mut logits)?;
    pos += 1;
    let before = r.total().clone();
    let t0 = Instant::now();
    let (mut stall, mut compute) = (0.0, 0.0);
    for _ in 0..steps {
        decode_step(r, batch, pos, vocab, &mut logits)?;
        pos += 1;
        stall += r.last_pass().load_stall_s;
        compute += r.last_pass().compute_s;
    }
    let n = steps as f64;
    Ok((
        (t0.elapsed().as_secs_f64() / n, stall / n, compute / n),
        before,
    ))
}

/// The expert figures of `tokens` decode tokens between totals `a` and `b`, beside
/// `whole_per_pass` (the streamed sparse layers' stored bytes) over `passes` passes.
fn expert_figures(
    a: &crate::pipeline::PassStats,
    b: &crate::pipeline::PassStats,
    tokens: f64,
    whole_per_pass: u64,
    passes: f64,
) -> Option<ExpertFigures> {
    let routed = b.experts_routed - a.experts_routed;
    if routed == 0 {
        return None;
    }
    let read = (b.bytes_read - a.bytes_read) as f64 / tokens;
    let missed = (b.expert_bytes_loaded - a.expert_bytes_loaded) as f64 / tokens;
    let whole = whole_per_pass as f64 * passes / tokens;
    let ratio = |x: f64, y: f64| if y > 0.0 { x / y } else { 0.0 };
    let predicted = b.experts_predicted - a.experts_predicted;
    Some(ExpertFigures {
        bytes_read_per_token: read,
        expert_bytes_missed_per_token: missed,
        read_vs_missed: ratio(read, missed),
        whole_layer_bytes_per_token: whole,
        whole_layer_vs_read: ratio(whole, read),
        experts_routed_per_token: routed as f64 / tokens,
        cache_hit_rate: (b.expert_cache_hits - a.expert_cache_hits) as f64 / routed as f64,
        prediction_precision: ratio(
            (b.experts_predicted_used - a.experts_predicted_used) as f64,
            predicted as f64,
        ),
    })
}

/// Streaming-only and streamed passes at batch 1, alternating, `pairs` of each: a disk
/// whose rate drifts within seconds (a cloud volume's) would otherwise decide the overlap
/// ratio by when each half ran. Each timed pass follows an untimed one of its own kind, so
/// it starts with the next pass's loads as far ahead as its kind leaves them (a streamed
/// pass's compute lets them get further, and the pass after it would read less). Returns
/// (streaming-only pass s, streamed pass s, overlap), each the median over the pairs, the
/// overlap of a pair being streamed / max(compute-only, its streaming-only pass).
fn alternating_passes<B: Backend>(
    r: &mut Pipeline<B>,
    prompt: usize,
    pairs: usize,
    vocab: u32,
    compute_only: f64,
) -> Result<(f64, f64, f64), EngineError> {
    let mut logits = Vec::new();
    let mut pos = prefill(r, 1, prompt, vocab, &mut logits)?;
    // One pass of a kind; timed ones add their wall time, seconds with a read in flight
    // and reads in flight x seconds to their kind's sums (0 streaming-only, 1 streamed).
    let mut io = [(0f64, 0f64, 0f64); 2];
    let mut pass = |r: &mut Pipeline<B>, skip: bool, timed: bool| -> Result<f64, EngineError> {
        r.set_skip_compute(skip);
        let before = r.io().stats();
        let t = Instant::now();
        let done = decode_step(r, 1, pos, vocab, &mut logits);
        let wall = t.elapsed().as_secs_f64();
        r.set_skip_compute(false);
        pos += 1;
        done?;
        if timed {
            let after = r.io().stats();
            let depth_s = |s: &crate::io::IoStats| s.queue_depth_avg * s.read_busy_s;
            let k = &mut io[usize::from(!skip)];
            k.0 += wall;
            k.1 += after.read_busy_s - before.read_busy_s;
            k.2 += depth_s(&after) - depth_s(&before);
        }
        Ok(wall)
    };
    let (mut only, mut streamed, mut ratio) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..pairs.max(1) {
        pass(r, true, false)?;
        let a = pass(r, true, true)?;
        pass(r, false, false)?;
        let b = pass(r, false, true)?;
        only.push(a);
        streamed.push(b);
        ratio.push(b / compute_only.max(a));
    }
    let [(so_wall, so_busy, so_depth), (st_wall, st_busy, st_depth)] = io;
    tracing::info!(
        "alternated passes: streaming-only disk busy {:.1}% at queue depth {:.1}; streamed {:.1}% at {:.1}",
        100.0 * so_busy / so_wall,
        so_depth / so_busy.max(1e-9),
        100.0 * st_busy / st_wall,
        st_depth / st_busy.max(1e-9)
    );
    Ok((median(&mut only), median(&mut streamed), median(&mut ratio)))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => 0.0,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

/// The model limits the benchmark runs under: a context for the prompt and the timed
/// steps, one KV slot per sequence of the largest batch.
pub fn model_options(batches: &[usize], prompt_tokens: usize, steps: usize) -> ModelOptions {
    let max_batch = batches.iter().copied().max().unwrap_or(1).max(1);
    ModelOptions {
        // The alternated passes: `steps` pairs, each pass after an untimed one.
        max_context: prompt_tokens + 4 * steps + 2,
        kv_slots: max_batch,
        max_batch_tokens: (max_batch * prompt_tokens).max(max_batch),
        kv_dtype: crate::backend::KvDtype::F32,
        exact: true,
        verify_rows: 0,
    }
}

/// The device budget that leaves `weights_pct` percent of the model's weights resident:
/// KV cache and workspace as the plan reserves them, the backend's scratch, and that
/// share of the weights (which must hold the streaming slots too).
pub fn budget_for_weights_share(
    store: &Store,
    opts: ModelOptions,
    prefetch: Option<usize>,
    weights_pct: f64,
    chosen: &Chosen,
) -> Result<u64, EngineError> {
    let m = store.manifest();
    let p = crate::plan::plan(
        m,
        &PlanInput {
            device_budget: None,
            host_cache_budget: 0,
            opts,
            prefetch,
            expert_cache: None,
            expert_profile: None,
            backend_reserved: 0,
            self_draft_reserved: 0,
            host: Default::default(),
        },
    )?;
    let scratch = chosen.scratch_bytes(m, &opts);
    Ok(p.kv_cache_bytes
        + p.workspace_bytes
        + scratch
        + (p.resident_bytes as f64 * weights_pct / 100.0) as u64)
}

/// Runs the benchmark on the chosen backend.
pub fn run(
    chosen: &Chosen,
    store: Arc<Store>,
    o: &BenchStreamOptions,
) -> Result<BenchStreamReport, EngineError> {
    struct Job<'a>(Arc<Store>, &'a BenchStreamOptions);
    impl OnBackend for Job<'_> {
        type Output = BenchStreamReport;
        fn call<B: Backend + 'static>(
            self,
            make: &crate::engine::Maker<B>,
        ) -> Result<BenchStreamReport, EngineError> {
            let store = self.0.clone();
            bench_stream(self.0, self.1, &|input: &PlanInput| make(&store, input))
        }
    }
    let run = crate::pipeline::PipelineOptions {
        expert_eviction: o.expert_eviction,
        expert_prediction: o.expert_prediction,
        ..Default::default()
    };
    on_backend(chosen, o.threads, &o.io, run, Job(store, o))
}

/// Runs the benchmark with pipelines from `make` (one backend).
pub fn bench_stream<B: Backend>(
    store: Arc<Store>,
    o: &BenchStreamOptions,
    make: &dyn Fn(&PlanInput) -> Result<Pipeline<B>, EngineError>,
) -> Result<BenchStreamReport, EngineError> {
    let (m, vocab) = (store.manifest(), store.manifest().arch.vocab);
    let opts = model_options(&o.batches, o.prompt_tokens, o.steps);
    let input = |budget: Option<u64>, host: Option<&crate::plan::HostInput>| PlanInput {
        device_budget: budget,
        host_cache_budget: o.host_cache_budget,
        opts,
        prefetch: o.prefetch,
        expert_cache: o.expert_cache,
        expert_profile: o
            .expert_profile
            .as_ref()
            .map(|p| p.hot_set(crate::pipeline::PROFILE_HOT_SHARE)),
        backend_reserved: 0,
        self_draft_reserved: 0,
        host: host.cloned().unwrap_or_default(),
    };
    // A streamed run's pipeline, with the expert profile asked for (`make` gives it the
    // expert policies).
    let streamed_run = |input: &PlanInput| -> Result<Pipeline<B>, EngineError> {
        let mut r = make(input)?;
        if let Some(p) = &o.expert_profile {
            r.load_expert_profile(p.clone())?;
        }
        Ok(r)
    };

    // Compute alone: every unit resident, batch 1.
    let compute_only = {
        let mut r = make(&input(None, None))?;
        (decode_passes(&mut r, 1, o.prompt_tokens, o.steps, vocab)?.0).0
    };
    // Streaming alone (the same loads, compute skipped) against the streamed pass, in
    // alternation, on a pipeline of its own so the batch runs below start as before.
    let (streaming_only, streamed, overlap) = {
        let mut r = streamed_run(&input(o.device_budget, o.host.as_ref()))?;
        alternating_passes(&mut r, o.prompt_tokens, o.steps, vocab, compute_only)?
    };
    let mut r = streamed_run(&input(o.device_budget, o.host.as_ref()))?;
    let whole_per_pass: u64 = (0..store.units().len())
        .filter(|&u| r.plan.sparse[u].is_some())
        .map(|u| store.units()[u].stored_len)
        .sum();
    let mut batches = Vec::new();
    let mut rate1 = 0.0;
    let mut copy_gbps = 0.0;
    for &b in &o.batches {
        let before = r.total().clone();
        let ((pass, stall, compute), timed) =
            decode_passes(&mut r, b, o.prompt_tokens, o.steps, vocab)?;
        let experts = expert_figures(
            &timed,
            r.total(),
            (b * o.steps) as f64,
            whole_per_pass,
            o.steps as f64,
        );
        if b == 1 {
            let t = r.total();
            let secs = t.copy_device_s - before.copy_device_s;
            if secs > 0.0 {
                copy_gbps = (t.bytes_uploaded - before.bytes_uploaded) as f64 / secs / 1e9;
            }
        }
        let rate = b as f64 / pass;
        if b == 1 {
            rate1 = rate;
        }
        batches.push(BatchResult {
            batch: b,
            pass_s: pass,
            tokens_per_s: rate,
            vs_linear: if rate1 > 0.0 {
                rate / (b as f64 * rate1)
            } else {
                0.0
            },
            load_stall_s_per_pass: stall,
            compute_s_per_pass: compute,
            experts,
        });
    }
    let plain = if r.plan.stream_slots > 0 {
        r.backend
            .reference_copy_gbps(r.plan.stream_slot_bytes as usize)
            .unwrap_or(0.0)
    } else {
        0.0
    };
    Ok(BenchStreamReport {
        backend: r.backend.name().to_string(),
        model_raw_bytes: m.raw_bytes(),
        device_budget: r.backend.budget().limit(),
        layers_resident: r.plan.layers_resident(),
        layers_streamed: r.plan.layers_streamed(),
        disk_bytes_per_pass: r.plan.disk_bytes_per_pass,
        upload_bytes_per_pass: r.plan.upload_bytes_per_pass,
        compute_only_pass_s: compute_only,
        streaming_only_pass_s: streaming_only,
        streamed_pass_s: streamed,
        overlap_ratio: overlap,
        resident_tokens_per_s: 1.0 / compute_only,
        streamed_tokens_per_s: if streamed > 0.0 { 1.0 / streamed } else { 0.0 },
        copy_gbps,
        plain_h2d_gbps: plain,
        copy_vs_plain: if plain > 0.0 { copy_gbps / plain } else { 0.0 },
        host_bytes_budget: r.plan.host.budget,
        host_bytes_planned: r.plan.host.total_bytes,
        host_bytes_peak: crate::hostmem::host_peak().0,
        expert_cache_slots: r.plan.expert_cache_slots,
        expert_hot_slots: r.plan.expert_hot_slots,
        expert_eviction: r.pipeline_options().expert_eviction,
        expert_prediction: r.pipeline_options().expert_prediction,
        batches,
    })
}
