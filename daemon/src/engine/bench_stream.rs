//! `sluiced bench-stream`: does the overlap work, and does batching amortize streaming?
//! All figures come from one run: compute-only (every unit resident), streaming-only
//! (the plan's loads with compute skipped) and the real streamed pass, then decode
//! tokens/s at several batch sizes under the same budget.

use crate::backend::Backend;
use crate::engine::{backend_scratch_bytes, on_backend, Chosen, EngineError, OnBackend};
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
    pub streaming_only_pass_s: f64,
    pub streamed_pass_s: f64,
    /// streamed / max(compute-only, streaming-only): 1.0 is perfect overlap.
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
    pub batches: Vec<BatchResult>,
}

fn token_ids(n: usize, vocab: u32, seed: u64) -> Vec<u32> {
    let mut s = seed;
    (0..n)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            // Stay clear of the special ids at the start of most vocabularies.
            256 + ((s >> 33) % (vocab as u64 - 256).max(1)) as u32
        })
        .collect()
}

/// Prefills `batch` sequences, then times `steps` decode steps; returns (seconds per pass,
/// load stall per pass, compute per pass). Runs where the daemon runs its steps: on the
/// backend's executor.
fn decode_passes<B: Backend>(
    r: &mut Pipeline<B>,
    batch: usize,
    prompt: usize,
    steps: usize,
    vocab: u32,
) -> Result<(f64, f64, f64), EngineError> {
    let on = r.backend.executor();
    on.run(move || {
        let mut logits = Vec::new();
        let seqs: Vec<SeqStep> = (0..batch)
            .map(|b| SeqStep {
                slot: b,
                pos: 0,
                tokens: token_ids(prompt, vocab, b as u64 + 1),
            })
            .collect();
        let per_step = (r.options().max_batch_tokens / prompt).max(1);
        for chunk in seqs.chunks(per_step) {
            r.step(chunk, &mut logits)?;
        }
        // One untimed decode step warms the caches.
        let mut pos = prompt;
        let mut step = |r: &mut Pipeline<B>, pos: usize| -> Result<(), EngineError> {
            let s: Vec<SeqStep> = (0..batch)
                .map(|b| SeqStep {
                    slot: b,
                    pos,
                    tokens: token_ids(1, vocab, (pos * 131 + b) as u64),
                })
                .collect();
            Ok(r.step(&s, &mut logits)?)
        };
        step(r, pos)?;
        pos += 1;
        let t0 = Instant::now();
        let (mut stall, mut compute) = (0.0, 0.0);
        for _ in 0..steps {
            step(r, pos)?;
            pos += 1;
            stall += r.last_pass().load_stall_s;
            compute += r.last_pass().compute_s;
        }
        let n = steps as f64;
        Ok((t0.elapsed().as_secs_f64() / n, stall / n, compute / n))
    })
}

/// The model limits the benchmark runs under: a context for the prompt and the timed
/// steps, one KV slot per sequence of the largest batch.
pub fn model_options(batches: &[usize], prompt_tokens: usize, steps: usize) -> ModelOptions {
    let max_batch = batches.iter().copied().max().unwrap_or(1).max(1);
    ModelOptions {
        max_context: prompt_tokens + steps + 2,
        kv_slots: max_batch,
        max_batch_tokens: (max_batch * prompt_tokens).max(max_batch),
        kv_dtype: crate::backend::KvDtype::F32,
        exact: true,
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
            backend_reserved: 0,
            host: Default::default(),
        },
    )?;
    let scratch = backend_scratch_bytes(chosen, m, &opts);
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
            make: &dyn Fn(&PlanInput) -> Result<Pipeline<B>, EngineError>,
        ) -> Result<BenchStreamReport, EngineError> {
            bench_stream(self.0, self.1, make)
        }
    }
    on_backend(chosen, &store, o.threads, &o.io, Job(store.clone(), o))
}

/// Runs the benchmark with pipelines from `make` (one backend).
pub fn bench_stream<B: Backend>(
    store: Arc<Store>,
    o: &BenchStreamOptions,
    make: &dyn Fn(&PlanInput) -> Result<Pipeline<B>, EngineError>,
) -> Result<BenchStreamReport, EngineError> {
    let m = store.manifest();
    let vocab = m.arch.vocab;
    let opts = model_options(&o.batches, o.prompt_tokens, o.steps);
    let input = |budget: Option<u64>, host: Option<&crate::plan::HostInput>| PlanInput {
        device_budget: budget,
        host_cache_budget: o.host_cache_budget,
        opts,
        prefetch: o.prefetch,
        backend_reserved: 0,
        host: host.cloned().unwrap_or_default(),
    };

    // Compute alone: every unit resident, batch 1.
    let compute_only = {
        let mut r = make(&input(None, None))?;
        decode_passes(&mut r, 1, o.prompt_tokens, o.steps, vocab)?.0
    };
    let mut r = make(&input(o.device_budget, o.host.as_ref()))?;
    // Streaming alone: the same loads, compute skipped.
    r.skip_compute = true;
    let streaming_only = decode_passes(&mut r, 1, o.prompt_tokens, o.steps, vocab)?.0;
    r.skip_compute = false;
    let mut batches = Vec::new();
    let mut rate1 = 0.0;
    let mut copy_gbps = 0.0;
    for &b in &o.batches {
        let before = r.total().clone();
        let (pass, stall, compute) = decode_passes(&mut r, b, o.prompt_tokens, o.steps, vocab)?;
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
        });
    }
    let streamed = batches
        .iter()
        .find(|x| x.batch == 1)
        .map_or(0.0, |x| x.pass_s);
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
        overlap_ratio: streamed / compute_only.max(streaming_only),
        resident_tokens_per_s: 1.0 / compute_only,
        streamed_tokens_per_s: if streamed > 0.0 { 1.0 / streamed } else { 0.0 },
        copy_gbps,
        plain_h2d_gbps: plain,
        copy_vs_plain: if plain > 0.0 { copy_gbps / plain } else { 0.0 },
        host_bytes_budget: r.plan.host.budget,
        host_bytes_planned: r.plan.host.total_bytes,
        host_bytes_peak: crate::hostmem::peak_rss_bytes().unwrap_or(0),
        batches,
    })
}
