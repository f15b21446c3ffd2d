//! The rates `plan::placement` chooses with, measured on this machine with passes of the
//! model itself (`calibrate`), and `sluiced bench-placement`: every placement that fits,
//! its predicted pass time beside the one measured.
//!
//! Pipelines' passes, each the fastest of two or three: the planned placement with no host
//! layers streaming alone (`Pipeline::set_skip_compute`: the bytes it uploads over the
//! time, disk, decompression and copy together), and computing as well (how much of the
//! shorter hides behind the longer: `Rates::overlap`); then, with nothing streaming beside the
//! compute (the device's budget as large as it may be), a quarter of the layers on the
//! host, at one row and at `rows` rows (a prompt chunk): the device's rate over the
//! weights it computes and the host CPU's over its layers. The device's compute is the
//! pass's `compute_s` less the host's: on a synchronous backend (the CPU's) the compute
//! itself; on CUDA the time the host spends enqueueing it, less than the device's, which
//! at the rows a pass carries is far below the streaming it waits for. Last, a third
//! pipeline at the placement whose streaming and compute are predicted closest gives the
//! overlap where the choice is made (`balance_overlap`).
//!
//! The rates are kept in `$SLUICE_CACHE/placement/` (`cached_rates`), one file per store
//! (its manifest's hash), backend, device, numerics and way of measuring, so a restart
//! does not measure again: delete the file to measure afresh (a new disk, another load on
//! the machine).

use super::EngineError;
use crate::backend::Backend;
use crate::model::SeqStep;
use crate::pipeline::{PassStats, Pipeline};
use crate::plan::placement::{predict, ComputeRate, Prediction, Rates};
use crate::plan::{Placement, PlanInput};
use serde::Serialize;

/// Builds a pipeline for a plan input (the model's store on the chosen backend).
pub type Make<'a, B> = dyn Fn(&PlanInput) -> Result<Pipeline<B>, EngineError> + 'a;

/// A pass of `rows` rows (a prompt chunk at the start of slot 0; the model's vocabulary
/// `vocab` bounds the tokens), the fastest of `tries`.
fn pass<B: Backend>(
    r: &mut Pipeline<B>,
    rows: usize,
    tries: usize,
) -> Result<PassStats, EngineError> {
    let vocab = r.store.manifest().arch.vocab.max(2);
    let step = [SeqStep {
        slot: 0,
        pos: 0,
        tokens: (0..rows as u32)
            .map(|t| 1 + (t * 7) % (vocab - 1))
            .collect(),
        ..Default::default()
    }];
    let mut logits = Vec::new();
    r.step(&step, &mut logits)?;
    let mut best = r.last_pass().clone();
    for _ in 1..tries {
        r.step(&step, &mut logits)?;
        if r.last_pass().pass_time_s < best.pass_time_s {
            best = r.last_pass().clone();
        }
    }
    Ok(best)
}

/// Raw bytes of the units `r` computes on the device, and of those on the host.
fn computed_bytes<B: Backend>(r: &Pipeline<B>) -> (u64, u64) {
    let units = r.store.units();
    (0..units.len()).fold((0, 0), |(d, h), u| match r.plan.placement(u) {
        Placement::Host => (d, h + units[u].raw_len),
        _ => (d + units[u].raw_len, h),
    })
}

/// Measures the rates for the store `make` builds pipelines of, within `input`'s budgets,
/// with passes of one row and of `rows` rows (at least two; at most what a pass and the
/// context take).
pub fn calibrate<B: Backend>(
    make: &Make<'_, B>,
    input: &PlanInput,
    rows: usize,
) -> Result<Rates, EngineError> {
    let rows = rows
        .clamp(2, input.opts.max_batch_tokens.max(2))
        .min(input.opts.max_context);
    let mut i = input.clone();
    i.host.cpu_layers = 0;
    let mut r = make(&i)?;
    pass(&mut r, 1, 1)?;
    let (stream_bytes_per_s, overlap) = if r.plan.upload_bytes_per_pass > 0 {
        r.set_skip_compute(true);
        let s = pass(&mut r, rows, 2)?;
        r.set_skip_compute(false);
        // How much a pass hides of the shorter of its streaming and its compute (at many
        // rows, where the compute is not lost in the streaming's noise).
        let p = pass(&mut r, rows, 2)?;
        let (stream, compute) = (s.pass_time_s, p.compute_s);
        let hidden = (stream + compute - p.pass_time_s) / stream.min(compute).max(1e-9);
        (
            s.bytes_uploaded as f64 / s.pass_time_s.max(1e-9),
            hidden.clamp(0.0, 1.0),
        )
    } else {
        // Nothing streams: no placement's prediction has streaming in it.
        (f64::MAX, 1.0)
    };
    let store = r.store.clone();
    let n = store.manifest().arch.n_layers as usize;
    drop(r);
    // The compute with nothing streaming beside it (the decompression workers would take
    // the host's cores): the device as large as it may be, a quarter of the layers (1 to
    // 8) on the host, where one layer's time would be mostly the part's fixed costs.
    i.host.cpu_layers = (n / 4).clamp(1, 8).min(n);
    i.device_budget = None;
    let mut r = make(&i)?;
    pass(&mut r, 1, 1)?;
    let (device_bytes, host_bytes) = computed_bytes(&r);
    let (one, many) = (pass(&mut r, 1, 3)?, pass(&mut r, rows, 3)?);
    let on_device = |s: &PassStats| s.compute_s - s.host_compute_s;
    let device = ComputeRate::fit(device_bytes, on_device(&one), on_device(&many), rows);
    let cpu = ComputeRate::fit(host_bytes, one.host_compute_s, many.host_compute_s, rows);
    drop(r);
    let mut rates = Rates {
        stream_bytes_per_s,
        device,
        cpu,
        overlap,
    };
    balance_overlap(make, store.manifest(), input, rows, &mut rates)?;
    Ok(rates)
}

/// Measures the overlap again where it decides the choice: at the placement whose
/// streaming and compute are predicted closest (with host layers, streaming beside
/// compute), the overlap that makes its prediction its measured pass. The first
/// measurement (everything on the device, streaming far longer than compute) holds where
/// the compute leaves the machine idle; where the host's cores both compute and decompress
/// (the CPU backend on a small machine), a pass with both busy hides much less: on this
/// project's 2-core VM, SmolLM2 F16 at 8 rows, 0.95 all streamed against measured passes
/// 1.2-2x the predictions between 10 and 18 host layers.
fn balance_overlap<B: Backend>(
    make: &Make<'_, B>,
    m: &crate::store::Manifest,
    input: &PlanInput,
    rows: usize,
    rates: &mut Rates,
) -> Result<(), EngineError> {
    let mut best: Option<(f64, usize)> = None;
    let mut i = input.clone();
    for n in 1..=m.arch.n_layers as usize {
        i.host.cpu_layers = n;
        let Ok(p) = crate::plan::plan(m, &i) else {
            continue;
        };
        if p.upload_bytes_per_pass == 0 {
            break;
        }
        let q = predict(m, &p, rates, rows);
        let gap = (q.stream_s - q.cpu_s - q.device_s).abs();
        if best.is_none_or(|b| gap < b.0) {
            best = Some((gap, n));
        }
    }
    let Some((_, n)) = best else {
        return Ok(());
    };
    i.host.cpu_layers = n;
    // A placement the planner takes and the backend does not (its own reservations): the
    // overlap measured with everything on the device stands.
    let mut r = match make(&i) {
        Ok(r) => r,
        Err(e) => {
            tracing::debug!("placement: the overlap at {n} host layers not measured: {e}");
            return Ok(());
        }
    };
    pass(&mut r, 1, 1)?;
    let measured = pass(&mut r, rows, 3)?.pass_time_s;
    // The prediction falls as the overlap grows: the overlap whose prediction is the
    // measured pass, by bisection (0 where even none predicts less, 1 where all does).
    let at = |o: f64| {
        let mut x = *rates;
        x.overlap = o;
        predict(m, &r.plan, &x, rows).pass_s
    };
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    for _ in 0..30 {
        let mid = (lo + hi) / 2.0;
        if at(mid) > measured {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    tracing::debug!(
        "placement: overlap {:.2} all streamed, {:.2} at {n} host layers ({:.1} ms measured)",
        rates.overlap,
        (lo + hi) / 2.0,
        measured * 1e3
    );
    rates.overlap = (lo + hi) / 2.0;
    Ok(())
}

/// How the kept rates were measured: rates kept by an earlier way of measuring are measured
/// again (2: the overlap at the balanced placement, `balance_overlap`).
const RATES_VERSION: &str = "r2";

/// What the rates of a store are kept under: its manifest's hash, the backend and device
/// (`device`, e.g. "cuda0"), the host threads, the numerics and `RATES_VERSION`.
pub fn rates_key(store: &crate::store::Store, device: &str, threads: usize, exact: bool) -> String {
    let manifest = std::fs::read(store.dir().join(crate::store::format::MANIFEST_FILE))
        .map(|b| crate::util::xxh3(&b))
        .unwrap_or(0);
    let numerics = if exact { "exact" } else { "fast" };
    format!("{manifest:016x}-{device}-{threads}t-{numerics}-{RATES_VERSION}")
}

/// The rates kept under `key` in `cache` (`util::cache_root`), else measured now
/// (`calibrate`) and kept there; true when measured now. A cache that cannot be read or
/// written only means measuring (said in the log).
pub fn cached_rates<B: Backend>(
    cache: Option<&std::path::Path>,
    key: &str,
    make: &Make<'_, B>,
    input: &PlanInput,
    rows: usize,
) -> Result<(Rates, bool), EngineError> {
    let path = cache.map(|c| c.join("placement").join(format!("{key}.json")));
    if let Some(p) = &path {
        if let Ok(bytes) = std::fs::read(p) {
            match serde_json::from_slice::<Rates>(&bytes) {
                Ok(r) => return Ok((r, false)),
                Err(e) => tracing::warn!("{}: {e}; measuring the rates again", p.display()),
            }
        }
    }
    let rates = calibrate(make, input, rows)?;
    if let Some(p) = &path {
        let saved = serde_json::to_vec_pretty(&rates)
            .map_err(std::io::Error::other)
            .and_then(|json| crate::util::write_atomic(p, &json));
        if let Err(e) = saved {
            tracing::warn!("placement rates not kept at {}: {e}", p.display());
        }
    }
    Ok((rates, true))
}

/// `--placement auto`: the rates of `store` on `device` with `threads` host threads (kept,
/// or measured now and kept),
/// and the host layers whose predicted pass time at `rows` rows is least, said in the log.
pub fn auto<B: Backend>(
    make: &Make<'_, B>,
    store: &crate::store::Store,
    (device, threads): (&str, usize),
    input: &PlanInput,
    rows: usize,
) -> Result<(crate::plan::placement::Choice, Rates), EngineError> {
    let key = rates_key(store, device, threads, input.opts.exact);
    let cache = crate::util::cache_root();
    let (rates, now) = cached_rates(cache.as_deref(), &key, make, input, rows.max(8))?;
    let c = crate::plan::placement::choose(store.manifest(), input, &rates, rows)?;
    if let Some(p) = c.chosen() {
        let none = c.candidates.first().map_or(f64::NAN, |n| n.pass_s * 1e3);
        tracing::info!(
            "placement auto: {} layers on the host CPU at {rows} rows a pass, predicted {:.1} ms (CPU {:.1}, device {:.1}, streaming {:.1}); all on the device {none:.1} ms; rates {} ({key})",
            p.cpu_layers,
            p.pass_s * 1e3,
            p.cpu_s * 1e3,
            p.device_s * 1e3,
            p.stream_s * 1e3,
            if now { "measured now" } else { "kept from before" },
        );
    }
    Ok((c, rates))
}

/// What `auto_built` built: the model's pipeline at the chosen placement, its draft, the
/// choice, the rates, the input it was planned with (host layers set) and the seconds
/// the pipeline took to build.
pub struct Placed<B: Backend> {
    pub runner: crate::pipeline::Pipeline<B>,
    pub draft: Option<super::draft_model::DraftModel<B>>,
    pub choice: crate::plan::placement::Choice,
    pub rates: Rates,
    pub input: PlanInput,
    pub build_s: f64,
}

/// `--placement auto` with its pipeline built: a draft model first (`draft_first`: the
/// placement is chosen in the room it leaves), the host layers for `rows` rows a pass
/// (`auto`), then the model's pipeline.
pub fn auto_built<B: Backend>(
    make: &super::MakePipeline<B>,
    store: &std::sync::Arc<crate::store::Store>,
    draft: Option<&super::draft_model::DraftSource>,
    (device, threads): (&str, usize),
    input: &PlanInput,
    rows: usize,
) -> Result<Placed<B>, EngineError> {
    let (draft, mut input) = super::draft_model::draft_first(make, draft, input)?;
    let (choice, rates) = auto(&|i| make(store, i), store, (device, threads), &input, rows)?;
    input.host.cpu_layers = choice.cpu_layers;
    let t0 = std::time::Instant::now();
    let runner = make(store, &input)?;
    Ok(Placed {
        runner,
        draft,
        choice,
        rates,
        input,
        build_s: t0.elapsed().as_secs_f64(),
    })
}

/// One placement at one row count: predicted and measured.
#[derive(Clone, Debug, Serialize)]
pub struct Measured {
    pub rows: usize,
    pub chosen: bool,
    pub predicted: Prediction,
    pub measured_pass_s: f64,
    /// Measured over predicted.
    pub ratio: f64,
    /// The measured pass's parts: compute (the host's included), the host's, the wait
    /// for loads; and the units it streamed.
    pub measured_compute_s: f64,
    pub measured_host_s: f64,
    pub measured_stall_s: f64,
    pub layers_streamed: usize,
}

/// `sluiced bench-placement`'s figures: the rates, then per row count every placement that
/// fits, predicted and measured (each the fastest of `tries` passes).
#[derive(Clone, Debug, Serialize)]
pub struct PlacementReport {
    pub rates: Rates,
    pub rows: Vec<usize>,
    pub runs: Vec<Measured>,
}

/// Calibrates, chooses for each of `rows`, and measures every candidate placement (host
/// layers from none to `max_cpu_layers`) at each.
pub fn bench<B: Backend>(
    make: &Make<'_, B>,
    m: &crate::store::Manifest,
    input: &PlanInput,
    rows: &[usize],
    max_cpu_layers: usize,
    tries: usize,
) -> Result<PlacementReport, EngineError> {
    let calib_rows = rows.iter().copied().max().unwrap_or(8).max(2);
    let rates = calibrate(make, input, calib_rows)?;
    let mut runs = Vec::new();
    let mut choices = Vec::new();
    for &n in rows {
        choices.push(crate::plan::placement::choose(m, input, &rates, n)?);
    }
    let n_max = max_cpu_layers.min(m.arch.n_layers as usize);
    for cpu_layers in 0..=n_max {
        let mut i = input.clone();
        i.host.cpu_layers = cpu_layers;
        let Ok(mut r) = make(&i) else { continue };
        pass(&mut r, 1, 1)?;
        for (k, &n) in rows.iter().enumerate() {
            let st = pass(&mut r, n, tries)?;
            let predicted = predict(r.store.manifest(), &r.plan, &rates, n);
            runs.push(Measured {
                rows: n,
                chosen: choices[k].cpu_layers == cpu_layers,
                predicted,
                measured_pass_s: st.pass_time_s,
                ratio: st.pass_time_s / predicted.pass_s.max(1e-12),
                measured_compute_s: st.compute_s,
                measured_host_s: st.host_compute_s,
                measured_stall_s: st.load_stall_s,
                layers_streamed: r.plan.layers_streamed(),
            });
        }
    }
    Ok(PlacementReport {
        rates,
        rows: rows.to_vec(),
        runs,
    })
}
