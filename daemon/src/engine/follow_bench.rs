//! `sluiced bench-placement --follow`: a workload whose batch changes, served by the
//! scheduler as `sluiced serve` serves it, once per way of placing the layers: fixed at
//! the placement chosen for each batch of the workload, and following the batch
//! (`engine::replace`). Each phase's decode rate, and the changes following made.

use super::replace::{Rebuild, Replacer};
use super::scheduler::{Event, Request, Scheduler, SchedulerConfig};
use super::sequence::GenerateParams;
use super::EngineError;
use crate::backend::Backend;
use crate::plan::placement::{choose_among, shapes, Follow, Rates};
use crate::plan::PlanInput;
use crate::store::Store;
use crate::text::Tokenizer;
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;

/// A phase of the workload: `batch` sequences at once, each prompted with `prompt` tokens
/// and decoding `decode`.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct Phase {
    pub batch: usize,
    pub prompt: usize,
    pub decode: usize,
}

/// A phase as served: its seconds and decoded tokens per second (the prompts' prefill
/// included in the time).
#[derive(Clone, Debug, Serialize)]
pub struct PhaseRun {
    pub batch: usize,
    pub seconds: f64,
    pub tokens_per_s: f64,
}

/// The workload served one way: "fixed N" (N host layers throughout) or "follow".
#[derive(Clone, Debug, Serialize)]
pub struct FollowRun {
    pub mode: String,
    pub round: usize,
    /// Host layers at the start.
    pub cpu_layers: usize,
    pub phases: Vec<PhaseRun>,
    pub seconds: f64,
    /// Following: the changes made and the seconds they stopped the engine for in all.
    pub changes: u64,
    pub change_s: f64,
}

/// Builds the model's pipeline for a plan input, owned and shared.
pub type Build<B> =
    Arc<dyn Fn(&PlanInput) -> Result<crate::pipeline::Pipeline<B>, EngineError> + Send + Sync>;

/// Serves `phases` `rounds` times each way (the ways alternating within a round): fixed
/// at each placement chosen for a phase's batch, and following from the one chosen for
/// the largest batch (what `serve` starts from). `make` builds the model's pipeline for
/// a plan input, `rates` are the measured ones.
pub fn bench_follow<B: Backend + 'static>(
    make: Build<B>,
    store: &Arc<Store>,
    input: &PlanInput,
    rates: Rates,
    phases: &[Phase],
    rounds: usize,
) -> Result<Vec<FollowRun>, EngineError>
where
    B::Mem: 'static,
{
    let tok = Arc::new(
        Tokenizer::from_manifest(store.manifest())
            .map_err(|e| EngineError::Invalid(format!("the model's tokenizer: {e}")))?,
    );
    let shapes = shapes(store.manifest(), input)?;
    let most = phases.iter().map(|p| p.batch).max().unwrap_or(1);
    let start = choose_among(&shapes, &rates, most).cpu_layers;
    let mut fixed: Vec<usize> = phases
        .iter()
        .map(|p| choose_among(&shapes, &rates, p.batch).cpu_layers)
        .collect();
    fixed.sort_unstable();
    fixed.dedup();
    let mut out = Vec::new();
    for round in 0..rounds {
        let mut modes: Vec<Option<usize>> = fixed.iter().map(|&n| Some(n)).collect();
        modes.push(None);
        if round % 2 == 1 {
            modes.reverse();
        }
        for mode in modes {
            let mut i = input.clone();
            i.host.cpu_layers = mode.unwrap_or(start);
            let t0 = Instant::now();
            let runner = make(&i)?;
            let replacer = match mode {
                Some(_) => None,
                None => {
                    let follow =
                        Follow::new(shapes.clone(), rates, start, t0.elapsed().as_secs_f64());
                    let m = make.clone();
                    let rebuild: Rebuild<B> = Box::new(move |i| m(i));
                    Some(Replacer::new(follow, i.clone(), rebuild))
                }
            };
            let cfg = SchedulerConfig {
                queue_max: most.max(1),
                prefix_cache: false,
                kv_tiers: Default::default(),
            };
            let (s, engine) = Scheduler::start_following(runner, None, replacer, tok.clone(), cfg);
            let mut run = FollowRun {
                mode: mode.map_or("follow".into(), |n| format!("fixed {n}")),
                round,
                cpu_layers: i.host.cpu_layers,
                phases: Vec::new(),
                seconds: 0.0,
                changes: 0,
                change_s: 0.0,
            };
            let vocab = store.manifest().arch.vocab.max(2);
            for (k, p) in phases.iter().enumerate() {
                let t = Instant::now();
                let tokens = serve_phase(&s, p, (k, vocab))?;
                let seconds = t.elapsed().as_secs_f64();
                run.phases.push(PhaseRun {
                    batch: p.batch,
                    seconds,
                    tokens_per_s: tokens as f64 / seconds.max(1e-9),
                });
                run.seconds += seconds;
            }
            let st = s.status();
            if let Some(f) = st.following {
                run.changes = f.changes;
                run.change_s = f.change_s_total;
            }
            s.shutdown(std::time::Duration::ZERO);
            drop(s);
            let _ = engine.join();
            out.push(run);
        }
    }
    Ok(out)
}

/// Serves one phase (the `k`th, whose prompts differ from the others'): its decoded
/// tokens.
fn serve_phase(s: &Scheduler, p: &Phase, (k, vocab): (usize, u32)) -> Result<usize, EngineError> {
    let mut rxs = Vec::with_capacity(p.batch);
    for b in 0..p.batch {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let seed = (k * 1000 + b) as u32;
        let prompt = (0..p.prompt as u32)
            .map(|t| 1 + (seed * 131 + t * 7919) % (vocab - 1))
            .collect();
        let params = GenerateParams::greedy(p.decode, true);
        s.submit(Request {
            prompt_ids: prompt,
            params,
            events: tx,
        })
        .map_err(|e| EngineError::Invalid(format!("the workload's request: {e}")))?;
        rxs.push(rx);
    }
    let mut tokens = 0;
    for mut rx in rxs {
        loop {
            match rx.blocking_recv() {
                Some(Event::Done(d)) => {
                    tokens += d.generated_token_ids.len();
                    break;
                }
                Some(Event::Failed { message, .. }) => {
                    return Err(EngineError::Invalid(format!(
                        "a workload request failed: {message}"
                    )))
                }
                Some(Event::Piece { .. }) => {}
                None => return Err(EngineError::Invalid("the engine ended mid-workload".into())),
            }
        }
    }
    Ok(tokens)
}
