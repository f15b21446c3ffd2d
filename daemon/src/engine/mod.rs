//! The engine: runs forward passes over a model's layer units and generates text.
//! `cpu_runner` / `cuda_runner` plan memory and build the `Pipeline` that runs the passes.

// Input from outside (files, requests, the disk) never meets an unwrap or expect here: an
// `expect` on a true invariant carries an #[allow] saying why it holds.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

pub mod bench_stream;
pub mod draft;
pub mod draft_model;
#[cfg(test)]
mod draft_tests;
pub mod follow_bench;
pub mod generate;
pub mod kv_block;
pub mod kv_disk;
pub mod kv_tiers;
pub mod placement;
pub mod prefix;
pub mod replace;
pub mod scheduler;
#[cfg(test)]
mod scheduler_tests;
pub mod self_draft;
pub mod sequence;
#[cfg(test)]
mod sequence_tests;
pub mod step;
#[cfg(test)]
mod test_model;

pub use scheduler::Failure;

use crate::backend::cpu::CpuBackend;
use crate::backend::cuda::{self, CudaBackend, DeviceInfo};
use crate::backend::{Backend, BackendError};
use crate::io::IoConfig;
use crate::io::IoError;
use crate::model::{ModelError, ModelOptions};
use crate::pipeline::PipelineError;
use crate::pipeline::{Pipeline, PipelineOptions};
use crate::plan::{HostInput, PlanInput};
use crate::store::{Manifest, Store};
use std::sync::Arc;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    /// The pipeline, or the I/O engine under it (an `IoError` converts to
    /// `Pipeline(PipelineError::Io)`: one way to reach it).
    #[error(transparent)]
    Pipeline(#[from] PipelineError),
    #[error(transparent)]
    Tokenizer(#[from] crate::text::tokenizer::TokenizerError),
    #[error(transparent)]
    Template(#[from] crate::text::template::TemplateError),
    #[error(transparent)]
    Plan(#[from] crate::plan::PlanError),
    #[error("{0}")]
    Invalid(String),
}

impl From<IoError> for EngineError {
    fn from(e: IoError) -> Self {
        EngineError::Pipeline(PipelineError::Io(e))
    }
}

impl EngineError {
    /// True when stored model data is bad (DATA_LOSS for a server).
    pub fn is_data_loss(&self) -> bool {
        matches!(self, EngineError::Pipeline(e) if e.is_data_loss())
    }
}

/// Plans memory for `store` and builds a CPU runner whose arena is exactly the planned
/// device budget (so the budget is enforced, as on a GPU). Device memory is host memory:
/// one budget, and streamed units run from their staging slots.
pub fn cpu_runner(
    store: Arc<Store>,
    input: &PlanInput,
    threads: usize,
    io: IoConfig,
    run: PipelineOptions,
) -> Result<Pipeline<CpuBackend>, EngineError> {
    cpu_runner_as(store, input, threads, io, run, true)
}

/// `cpu_runner` with the CPU acting as a discrete device (`CpuBackend::new_discrete`):
/// streamed units are copied into arena slots as on a GPU. For tests of that path.
pub fn cpu_runner_discrete(
    store: Arc<Store>,
    input: &PlanInput,
    threads: usize,
    io: IoConfig,
    run: PipelineOptions,
) -> Result<Pipeline<CpuBackend>, EngineError> {
    cpu_runner_as(store, input, threads, io, run, false)
}

fn cpu_runner_as(
    store: Arc<Store>,
    input: &PlanInput,
    threads: usize,
    io: IoConfig,
    run: PipelineOptions,
    unified: bool,
) -> Result<Pipeline<CpuBackend>, EngineError> {
    // The input `plan_for` plans with, as a discrete device where asked.
    let cpu = Chosen::Cpu { why: String::new() };
    let mut input = cpu.plan_input(store.manifest(), input, &io, threads);
    input.host.unified = unified;
    let plan = plan_within_host(store.manifest(), &mut input)?;
    let setup = |b: CpuBackend| {
        b.set_int8_activations(!input.opts.exact);
        b.reserve_scratch(&input.opts.scratch_shape(&store.manifest().arch));
        b
    };
    let backend = setup(if unified {
        CpuBackend::new(plan.device_budget, threads)?
    } else {
        CpuBackend::new_discrete(plan.device_budget, threads)?
    });
    // The devices beside it (tests of `--devices`): each a discrete CPU of its budget.
    let others = (plan.devices.iter())
        .map(|d| Ok(setup(CpuBackend::new_discrete(d.budget, threads)?)))
        .collect::<Result<Vec<_>, EngineError>>()?;
    let mut p = Pipeline::new(backend, store, plan, input.opts, io, run)?;
    p.add_devices(others)?;
    Ok(p)
}

/// Tokens per prefill step the planner may lower the chunk to when the host budget is short.
pub const BATCH_TOKENS_MIN: usize = 32;

/// Plans `input`; when the host budget is what is short, halves whichever of two
/// step shapes holds more memory, before giving up, and says so: the prefill chunk
/// (`max_batch_tokens`, whose workspace grows with it) down to `BATCH_TOKENS_MIN` (or the
/// batch), so prefill takes more passes and decode is the same; or the drafted rows one
/// pass may verify (`verify_rows`, each a vocabulary of logits in the arena and on the
/// host: 3 MiB a row for Gemma 3's tied 262k-token head), down to none, so the row budget
/// allots fewer tree rows (none: no drafting).
fn plan_within_host(m: &Manifest, input: &mut PlanInput) -> Result<crate::plan::Plan, EngineError> {
    // A step never holds more tokens than its sequences' contexts: a workspace sized past
    // that (512 tokens of prefill under a 256-token context) is memory no step can use,
    // which a binding host budget would rather keep for resident weights.
    let most = input
        .opts
        .max_context
        .saturating_mul(input.opts.kv_slots)
        .max(1);
    input.opts.max_batch_tokens = input.opts.max_batch_tokens.min(most);
    let asked = input.opts;
    loop {
        match crate::plan::plan(m, input) {
            Err(crate::plan::PlanError::Host(e)) if shrink_step(m, &mut input.opts) => {
                tracing::debug!(
                    "host budget short by {} bytes: trying a prefill chunk of {} tokens and {} verified rows",
                    e.need - e.budget,
                    input.opts.max_batch_tokens,
                    input.opts.verify_rows
                );
            }
            Err(e) => {
                input.opts = asked;
                return Err(e.into());
            }
            Ok(p) => {
                let o = &input.opts;
                if o.max_batch_tokens < asked.max_batch_tokens {
                    tracing::info!(
                        "prefill chunk lowered from {} to {} tokens to fit the host budget (its workspace)",
                        asked.max_batch_tokens,
                        o.max_batch_tokens
                    );
                }
                if o.verify_rows < asked.verify_rows {
                    tracing::info!(
                        "drafted rows a pass verifies lowered from {} to {} to fit the host budget (their logits){}",
                        asked.verify_rows,
                        o.verify_rows,
                        if o.verify_rows == 0 { ": no drafting" } else { "" }
                    );
                }
                return Ok(p);
            }
        }
    }
}

/// Halves the step shape that holds more memory (`plan_within_host`); false when neither
/// can shrink.
fn shrink_step(m: &Manifest, o: &mut crate::model::ModelOptions) -> bool {
    let least = BATCH_TOKENS_MIN.max(o.logit_rows());
    let cfg = &m.arch;
    let ws = |o: &crate::model::ModelOptions| crate::model::layout::workspace_bytes(cfg, o);
    let chunk = if o.max_batch_tokens > least {
        ws(o)
            - ws(&crate::model::ModelOptions {
                max_batch_tokens: least,
                ..*o
            })
    } else {
        0
    };
    // The arena's logits and workspace rows, and the host's logits (twice where a tied
    // head streams: counted either way, the larger share decides).
    let verify = ws(o)
        - ws(&crate::model::ModelOptions {
            verify_rows: 0,
            ..*o
        })
        + 8 * o.verify_rows as u64 * cfg.vocab as u64;
    if chunk == 0 && o.verify_rows == 0 {
        return false;
    }
    if verify >= chunk && o.verify_rows > 0 {
        o.verify_rows /= 2;
    } else {
        o.max_batch_tokens = (o.max_batch_tokens / 2).max(least);
    }
    true
}

/// The I/O engine's shape as the plan's upper bounds: reads in flight, their size, the
/// workers.
fn fit_reads(input: &mut PlanInput, io: &IoConfig) {
    input.host.reads_max_bytes = (io.read_buffers * io.request_bytes) as u64;
    input.host.request_bytes_max = io.request_bytes as u64;
    input.host.in_flight_max_bytes = io.in_flight_bytes as u64;
    input.host.workers = io.workers;
}

/// The host side of a plan for `sluiced run`, `serve` and `bench-stream`: the budget given
/// (`--host-memory`) or the default (a share of MemAvailable or of the memory cgroup's
/// room, logged), and the overhead measured now plus `extra` bytes the caller will
/// allocate outside the plan (logits rows, request state).
pub fn host_input(budget: Option<u64>, extra: u64) -> HostInput {
    let (budget, budget_source) = match budget {
        Some(b) => (Some(b), "--host-memory".to_string()),
        None => {
            let (b, why) = crate::hostmem::default_host_budget();
            tracing::info!("{why}");
            (b, why)
        }
    };
    HostInput {
        budget,
        budget_source,
        overhead: crate::hostmem::overhead_now(extra),
        ..HostInput::default()
    }
}

/// The KV cache type of `--kv-dtype`, else f32 under `--exact` and f16 otherwise.
pub fn kv_dtype_for(exact: bool, kv: Option<crate::backend::KvDtype>) -> crate::backend::KvDtype {
    kv.unwrap_or(if exact {
        crate::backend::KvDtype::F32
    } else {
        crate::backend::KvDtype::F16
    })
}

/// The integer dot products decode rows go through (`int_dots` in `run --json` and
/// Status): on the CPU's fast path the kernel this CPU takes ("avx512-vnni" or "avx2");
/// "" where none run (`--exact`, or CUDA, whose decode GEMVs take f32 activations).
/// The sampling a model's requests take where they leave a setting out: what its manifest
/// says the model recommends, `text::sampler::FAMILIAR` for the rest.
pub fn sampling_defaults(m: &crate::store::Manifest) -> crate::text::SamplingParams {
    let r = &m.meta.sampling;
    crate::text::SamplingParams::model_default(&crate::text::sampler::SamplingChoice {
        temperature: r.temperature,
        top_k: r.top_k.map(|k| k as usize),
        top_p: r.top_p,
        min_p: r.min_p,
        repetition_penalty: r.repetition_penalty,
    })
}

pub fn int_dots_for(backend: &str, exact: bool) -> &'static str {
    if exact || backend != "cpu" {
        ""
    } else {
        crate::backend::cpu::q8::dots_name()
    }
}

/// `--backend`: where the layers run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendChoice {
    /// CUDA when a usable device is there, else the CPU (saying why).
    Auto,
    Cpu,
    Cuda,
}

impl std::str::FromStr for BackendChoice {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "auto" => Ok(BackendChoice::Auto),
            "cpu" => Ok(BackendChoice::Cpu),
            "cuda" => Ok(BackendChoice::Cuda),
            _ => Err(format!("backend {s:?}: expected auto, cpu or cuda")),
        }
    }
}

/// The backend chosen, and for the CPU why CUDA was not.
#[derive(Clone, Debug)]
pub enum Chosen {
    Cpu { why: String },
    Cuda(DeviceInfo),
}

/// Checks what CUDA needs, in order: the driver library, a device, NVRTC (the kernels are
/// compiled at start) and cuBLAS. Never touches a library that is not there (cudarc
/// panics on a missing library).
pub fn cuda_usable(device: usize) -> Result<DeviceInfo, String> {
    let info = cuda::probe(device)?;
    cuda::nvrtc::library_present().map_err(|e| {
        format!(
            "{} is present, but the kernels cannot be compiled: {e}",
            info.name
        )
    })?;
    // SAFETY: only tries to open the library.
    if !unsafe { cudarc::cublas::sys::is_culib_present() } {
        return Err(format!(
            "{} is present, but cuBLAS is not (searched {:?}); install the CUDA toolkit or `pip install nvidia-cublas-cu12` and put its lib directory on LD_LIBRARY_PATH",
            info.name,
            cudarc::get_lib_name_candidates("cublas")
        ));
    }
    Ok(info)
}

/// Resolves `--backend`: `cuda` fails with the reason when CUDA is not usable, `auto`
/// falls back to the CPU and logs it.
pub fn choose_backend(choice: BackendChoice, device: usize) -> Result<Chosen, EngineError> {
    match choice {
        BackendChoice::Cpu => Ok(Chosen::Cpu {
            why: "--backend cpu".into(),
        }),
        BackendChoice::Cuda => cuda_usable(device)
            .map(Chosen::Cuda)
            .map_err(|e| EngineError::Invalid(format!("--backend cuda: {e}"))),
        BackendChoice::Auto => Ok(match cuda_usable(device) {
            Ok(i) => Chosen::Cuda(i),
            Err(why) => {
                tracing::info!("CPU backend: {why}");
                Chosen::Cpu { why }
            }
        }),
    }
}

/// `--devices` as ordinals: "cuda:N" (or "N") each, no device twice.
pub fn parse_devices(list: &[String]) -> Result<Vec<usize>, EngineError> {
    let mut out = Vec::with_capacity(list.len());
    for d in list {
        let n = d.strip_prefix("cuda:").unwrap_or(d);
        let ordinal: usize = n.parse().map_err(|_| {
            EngineError::Invalid(format!(
                "--devices: {d:?} is not a device; name CUDA devices as cuda:0,cuda:1"
            ))
        })?;
        if out.contains(&ordinal) {
            return Err(EngineError::Invalid(format!(
                "--devices names cuda:{ordinal} twice"
            )));
        }
        out.push(ordinal);
    }
    Ok(out)
}

/// The plan's inputs for the devices beside the first (`--devices` after its first
/// entry) on the chosen backend: each probed, its budget its free memory less the
/// headroom; and the split, as given (`--split`) or in proportion to the budgets, the
/// first device's `first_budget` first.
pub fn other_devices(
    chosen: &Chosen,
    ordinals: &[usize],
    split: &[f64],
    first_budget: Option<u64>,
) -> Result<(Vec<crate::plan::DeviceInput>, Vec<f64>), EngineError> {
    if ordinals.is_empty() {
        if !split.is_empty() {
            return Err(EngineError::Invalid(
                "--split shares the layers among --devices: give the devices too".into(),
            ));
        }
        return Ok((Vec::new(), Vec::new()));
    }
    let Chosen::Cuda(first) = chosen else {
        return Err(EngineError::Invalid(
            "--devices: the CPU backend is one device, the host; several devices are GPUs (--backend cuda)".into(),
        ));
    };
    let mut devices = Vec::with_capacity(ordinals.len());
    for &o in ordinals {
        let info =
            cuda_usable(o).map_err(|e| EngineError::Invalid(format!("--devices cuda:{o}: {e}")))?;
        devices.push(crate::plan::DeviceInput {
            name: format!("cuda:{o} ({})", info.name),
            ordinal: o,
            budget: cuda_default_budget(&info),
            reserved: 0,
        });
    }
    let split = match split.is_empty() {
        false => split.to_vec(),
        true => std::iter::once(first_budget.unwrap_or_else(|| cuda_default_budget(first)))
            .chain(devices.iter().map(|d| d.budget))
            .map(|b| b as f64)
            .collect(),
    };
    Ok((devices, split))
}

/// What to do with pipelines on whichever backend was chosen. A trait rather than a
/// closure because the body is generic over the backend type.
/// Plans memory for a store's pipeline on the chosen backend and builds it (`on_backend`).
pub type MakePipeline<'a, B> =
    dyn Fn(&Arc<Store>, &PlanInput) -> Result<Pipeline<B>, EngineError> + 'a;

/// `MakePipeline` owned and shared: what a thread that builds pipelines later keeps (the
/// engine's, changing the placement: `replace`).
pub type Maker<B> = Arc<
    dyn Fn(&Arc<Store>, &PlanInput) -> Result<Pipeline<B>, EngineError> + Send + Sync + 'static,
>;

pub trait OnBackend {
    type Output;
    /// `make` plans memory for an input and builds a pipeline of a store on the chosen
    /// backend (the model's, or another's: a draft model's).
    fn call<B: Backend + 'static>(self, make: &Maker<B>) -> Result<Self::Output, EngineError>
    where
        B::Mem: 'static;
}

/// What differs between the backends, in one place (with `on_backend`, which builds the
/// pipelines): their names, the device budget a plan defaults to, the device memory the
/// backend keeps for itself, and the input a plan is made from.
impl Chosen {
    /// "cpu" or "cuda".
    pub fn name(&self) -> &'static str {
        match self {
            Chosen::Cpu { .. } => "cpu",
            Chosen::Cuda(_) => "cuda",
        }
    }

    /// The device by its kind and ordinal ("cpu", "cuda0"): what measured rates are kept
    /// under (`placement::rates_key`).
    pub fn device_key(&self) -> String {
        match self {
            Chosen::Cpu { .. } => "cpu".into(),
            Chosen::Cuda(info) => format!("cuda{}", info.ordinal),
        }
    }

    /// The device memory plans may use when no budget is given: CUDA's free memory less
    /// `cuda_headroom`; None on the CPU, whose device memory is the host's (the host
    /// budget bounds it).
    pub fn default_device_budget(&self) -> Option<u64> {
        match self {
            Chosen::Cpu { .. } => None,
            Chosen::Cuda(info) => Some(cuda_default_budget(info)),
        }
    }

    /// Device memory the backend keeps for itself for this model and these limits (the
    /// plan counts it first).
    pub fn scratch_bytes(&self, m: &Manifest, opts: &ModelOptions) -> u64 {
        match self {
            Chosen::Cpu { .. } => 0,
            Chosen::Cuda(_) => cuda::scratch_bytes(&opts.scratch_shape(&m.arch)),
        }
    }

    /// The input the runner `on_backend` builds plans with: the CPU's device memory is
    /// host memory and its `threads` keep scratch beside it; CUDA counts its scratch and
    /// defaults the budget.
    fn plan_input(
        &self,
        m: &Manifest,
        input: &PlanInput,
        io: &IoConfig,
        threads: usize,
    ) -> PlanInput {
        let mut input = input.clone();
        // Layers computed on the host run on a CPU backend of `threads` beside the device.
        if input.host.cpu_layers > 0 {
            input.host.cpu_scratch =
                CpuBackend::scratch_bytes(&input.opts.scratch_shape(&m.arch), threads);
        }
        match self {
            Chosen::Cpu { .. } => {
                input.host.unified = true;
                input.host.compute_scratch =
                    CpuBackend::scratch_bytes(&input.opts.scratch_shape(&m.arch), threads);
            }
            Chosen::Cuda(info) => {
                input.backend_reserved = self.scratch_bytes(m, &input.opts);
                for d in &mut input.host.devices {
                    d.reserved = input.backend_reserved;
                }
                if input.device_budget.is_none() {
                    input.device_budget = Some(cuda_default_budget(info));
                }
            }
        }
        fit_reads(&mut input, io);
        input
    }
}

/// Hands `f` a builder of pipelines on the chosen backend (`cpu_runner` with `threads`, or
/// `cuda_runner` on the probed device).
pub fn on_backend<F: OnBackend>(
    chosen: &Chosen,
    threads: usize,
    io: &IoConfig,
    run: PipelineOptions,
    f: F,
) -> Result<F::Output, EngineError> {
    let io = io.clone();
    match chosen {
        Chosen::Cpu { .. } => f.call::<CpuBackend>(
            &(Arc::new(move |store: &Arc<Store>, input: &PlanInput| {
                cpu_runner(store.clone(), input, threads, io.clone(), run)
            }) as Maker<CpuBackend>),
        ),
        Chosen::Cuda(info) => {
            let info = info.clone();
            f.call(
                &(Arc::new(move |store: &Arc<Store>, input: &PlanInput| {
                    cuda_runner(store.clone(), input, &info, io.clone(), run)
                }) as Maker<_>),
            )
        }
    }
}

/// Device memory left free when no budget is given: the driver, cuBLAS and other
/// processes need some (1 GiB, or 2 % of the device when that is more).
pub fn cuda_headroom(total: u64) -> u64 {
    (total / 50).max(1 << 30)
}

/// CUDA's device budget when none is given: the free memory less `cuda_headroom`.
fn cuda_default_budget(info: &DeviceInfo) -> u64 {
    info.free_bytes
        .saturating_sub(cuda_headroom(info.total_bytes))
}

/// The plan the runner `on_backend` builds for `chosen` (with `threads` on the CPU) would
/// make of this input, made without allocating or loading anything: a daemon serving
/// several models asks it whether one fits beside the others before loading it, and a
/// self-draft's rounds ask it what streams (`self_draft::plan_room`).
pub fn plan_for(
    chosen: &Chosen,
    m: &Manifest,
    input: &PlanInput,
    io: &IoConfig,
    threads: usize,
) -> Result<crate::plan::Plan, EngineError> {
    let mut input = chosen.plan_input(m, input, io, threads);
    plan_within_host(m, &mut input)
}

/// Plans memory for `store` on the CUDA device `info` describes (from `choose_backend` or
/// `cuda_usable`) and builds its runner: the budget defaults to the device's free memory
/// minus `cuda_headroom`, and the device allocation is exactly what the plan uses (backend
/// scratch included).
pub fn cuda_runner(
    store: Arc<Store>,
    input: &PlanInput,
    info: &DeviceInfo,
    io: IoConfig,
    run: PipelineOptions,
) -> Result<Pipeline<CudaBackend>, EngineError> {
    let m = store.manifest();
    let mut input = Chosen::Cuda(info.clone()).plan_input(m, input, &io, 0);
    let plan = plan_within_host(m, &mut input)?;
    let shape = input.opts.scratch_shape(&m.arch);
    let backend = CudaBackend::new(info.ordinal, plan.device_bytes(), &shape)?;
    // The devices beside it (`--devices`): each holds its span (`plan::devices`).
    let others = (plan.devices.iter().zip(&input.host.devices))
        .map(|(span, d)| CudaBackend::new(d.ordinal, span.total(), &shape))
        .collect::<Result<Vec<_>, _>>()?;
    let mut p = Pipeline::new(backend, store, plan, input.opts, io, run)?;
    p.add_devices(others)?;
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn runner_with(max_context: usize, kv_slots: usize, batch_tokens: usize) -> ModelOptions {
        let tmp = tempfile::tempdir().expect("tempdir");
        let store = test_model::store(tmp.path());
        let input = crate::plan::test_input(max_context, kv_slots, batch_tokens);
        let r = cpu_runner(
            store,
            &input,
            1,
            IoConfig::single_stream(),
            Default::default(),
        )
        .expect("pipeline");
        *r.options()
    }

    /// A short host budget lowers the verified rows before the prefill chunk where they
    /// hold more (a large vocabulary's logits), to what fits; none left is an error that
    /// leaves the options as asked.
    #[test]
    fn a_short_host_budget_lowers_the_verified_rows_first_for_a_large_vocabulary() {
        let tmp = tempfile::tempdir().expect("tempdir");
        let store = test_model::tied_store(tmp.path(), 128, 32768);
        let m = store.manifest();
        let input = |budget: Option<u64>, verify_rows: usize| {
            let mut i = crate::plan::test_input(256, 2, 64);
            i.opts.verify_rows = verify_rows;
            i.host.budget = budget;
            i.host.unified = true;
            i
        };
        let plain = crate::plan::plan(m, &input(None, 0)).expect("plan");
        // 64 verified rows hold 8 MiB of logits in the arena and 16 on the host here.
        let budget = plain.host.total_bytes + (6 << 20);
        let mut i = input(Some(budget), 64);
        let p = plan_within_host(m, &mut i).expect("a plan with fewer verified rows");
        assert!(p.host.total_bytes <= budget);
        assert!(
            (1..64).contains(&i.opts.verify_rows),
            "verified rows {}",
            i.opts.verify_rows
        );
        assert_eq!(i.opts.max_batch_tokens, 64, "the chunk held less: kept");
        // Where not even the plain plan fits, the options come back as asked.
        let mut i = input(Some(plain.host.total_bytes / 4), 64);
        assert!(plan_within_host(m, &mut i).is_err());
        assert_eq!((i.opts.verify_rows, i.opts.max_batch_tokens), (64, 64));
    }

    /// The prefill chunk (and the workspace sized by it) never outgrows what the
    /// sequences' contexts can hold; below that it is what was asked.
    #[test]
    fn the_prefill_chunk_never_outgrows_the_contexts() {
        assert_eq!(runner_with(64, 2, 512).max_batch_tokens, 128);
        assert_eq!(runner_with(64, 1, 512).max_batch_tokens, 64);
        assert_eq!(runner_with(1024, 2, 512).max_batch_tokens, 512);
    }
}
