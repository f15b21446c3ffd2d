//! `sluiced bench-placement`: the rates `--placement auto` chooses with, measured here,
//! then every placement that fits (the first layers on the host CPU, none to all) at each
//! row count, its predicted pass time beside the measured one. On the CPU backend the
//! device is the CPU acting as a discrete one (`CpuBackend::new_discrete`: streamed units
//! are copied into its slots, as to a GPU).

use anyhow::Result;
use sluice::backend::Backend;
use sluice::engine::placement::{bench, PlacementReport};
use sluice::engine::{BackendChoice, Chosen, EngineError, OnBackend};
use sluice::model::ModelOptions;
use sluice::plan::PlanInput;
use sluice::store::Store;
use sluice::util::{fmt_bytes, parse_size};
use std::path::PathBuf;
use std::sync::Arc;

#[derive(clap::Args)]
pub struct BenchPlacementArgs {
    /// Store directory, or a store's name in the models directory.
    pub dir: PathBuf,
    /// Device budget for the weights as a share of the model's raw size (e.g. 50%), on top
    /// of KV cache, workspace and streaming slots; or an absolute --device-memory.
    #[arg(long, default_value = "50%")]
    pub weights_budget: String,
    /// Total device budget (overrides --weights-budget).
    #[arg(long, value_parser = parse_size)]
    pub device_memory: Option<u64>,
    /// Layers requested ahead of the one computing (default: from the plan).
    #[arg(long)]
    pub prefetch: Option<usize>,
    /// Rows a pass carries, comma-separated: each placement is measured at each.
    #[arg(long, value_delimiter = ',', default_value = "1,8")]
    pub rows: Vec<usize>,
    /// Host layers to measure up to (default: every decoder layer).
    #[arg(long)]
    pub max_cpu_layers: Option<usize>,
    /// Passes per measurement; the fastest counts.
    #[arg(long, default_value_t = 3)]
    pub tries: usize,
    /// Compute threads, of the device on the CPU backend and of the host layers (0: all
    /// cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// auto, cpu or cuda.
    #[arg(long, default_value = "auto")]
    pub backend: BackendChoice,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    pub device: usize,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Serve a workload whose batch changes instead: the batches of its phases,
    /// comma-separated (e.g. 1,8,1), fixed at each placement chosen for them against
    /// following the batch (`serve --placement auto`). Each phase's decode rate.
    #[arg(long, value_delimiter = ',')]
    pub follow: Vec<usize>,
    /// Tokens each sequence of a --follow phase decodes.
    #[arg(long, default_value_t = 48)]
    pub follow_decode: usize,
    /// Tokens of each --follow sequence's prompt.
    #[arg(long, default_value_t = 16)]
    pub follow_prompt: usize,
    /// Times --follow serves its workload each way, the ways alternating.
    #[arg(long, default_value_t = 2)]
    pub rounds: usize,
    /// Threads of the host layers (default: --threads). On the CPU backend, a host with
    /// fewer threads than the emulated device makes the choice depend on the batch as a
    /// GPU's does.
    #[arg(long)]
    pub host_threads: Option<usize>,
}

pub fn run(a: BenchPlacementArgs) -> Result<std::process::ExitCode> {
    let store = Arc::new(Store::open(&sluice::util::store_path(&a.dir, None))?);
    if a.rows.is_empty() || a.rows.contains(&0) {
        anyhow::bail!("--rows {:?}: give row counts of at least 1", a.rows);
    }
    let chosen = sluice::engine::choose_backend(a.backend, a.device)?;
    let input = plan_input(&a, &store, &chosen)?;
    let threads = match a.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        t => t,
    };
    let max_cpu = a.max_cpu_layers.unwrap_or(usize::MAX);
    let io = sluice::io::IoConfig::serving();
    let run = sluice::pipeline::PipelineOptions {
        cpu_threads: a.host_threads.unwrap_or(threads).max(1),
        ..Default::default()
    };
    if !a.follow.is_empty() {
        return follow(&a, store, &chosen, input, (threads, io, run));
    }
    let m = store.manifest().clone();
    let r = match &chosen {
        Chosen::Cpu { .. } => bench(
            &|i: &PlanInput| {
                sluice::engine::cpu_runner_discrete(store.clone(), i, threads, io.clone(), run)
            },
            &m,
            &input,
            &a.rows,
            max_cpu,
            a.tries,
        )?,
        Chosen::Cuda(_) => {
            struct Job<'a>(Arc<Store>, &'a PlanInput, &'a [usize], usize, usize);
            impl OnBackend for Job<'_> {
                type Output = PlacementReport;
                fn call<B: Backend + 'static>(
                    self,
                    make: &sluice::engine::Maker<B>,
                ) -> Result<PlacementReport, EngineError> {
                    let m = self.0.manifest().clone();
                    let store = self.0.clone();
                    bench(&|i| make(&store, i), &m, self.1, self.2, self.3, self.4)
                }
            }
            sluice::engine::on_backend(
                &chosen,
                threads,
                &io,
                run,
                Job(store.clone(), &input, &a.rows, max_cpu, a.tries),
            )?
        }
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&r)?);
    } else {
        let device = match chosen {
            Chosen::Cpu { .. } => "the CPU acting as a discrete device".to_string(),
            Chosen::Cuda(ref info) => info.name.clone(),
        };
        let budget = input.device_budget.unwrap_or(0);
        println!(
            "device {device}, budget {}; host layers on {threads} threads",
            fmt_bytes(budget)
        );
        print_table(&r);
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// `--follow`: the workload served each way, the rates measured first.
fn follow(
    a: &BenchPlacementArgs,
    store: Arc<Store>,
    chosen: &Chosen,
    input: PlanInput,
    (threads, io, run): (
        usize,
        sluice::io::IoConfig,
        sluice::pipeline::PipelineOptions,
    ),
) -> Result<std::process::ExitCode> {
    use sluice::engine::follow_bench::{bench_follow, FollowRun, Phase};
    if a.follow.contains(&0) || a.follow_decode == 0 || a.follow_prompt == 0 {
        anyhow::bail!(
            "--follow {:?}: give batches of at least 1, and tokens to prompt and decode",
            a.follow
        );
    }
    let phases: Vec<Phase> = (a.follow.iter())
        .map(|&batch| Phase {
            batch,
            prompt: a.follow_prompt,
            decode: a.follow_decode,
        })
        .collect();
    struct Job<'a>(Arc<Store>, &'a PlanInput, &'a [Phase], usize);
    impl OnBackend for Job<'_> {
        type Output = (sluice::plan::placement::Rates, Vec<FollowRun>);
        fn call<B: Backend + 'static>(
            self,
            make: &sluice::engine::Maker<B>,
        ) -> Result<Self::Output, EngineError>
        where
            B::Mem: 'static,
        {
            let (m, store) = (make.clone(), self.0.clone());
            let make = Arc::new(move |i: &PlanInput| m(&store, i));
            let most = self.2.iter().map(|p| p.batch).max().unwrap_or(1);
            let rates = sluice::engine::placement::calibrate(&*make, self.1, most.max(8))?;
            let runs = bench_follow(make, &self.0, self.1, rates, self.2, self.3)?;
            Ok((rates, runs))
        }
    }
    let job = Job(store.clone(), &input, &phases, a.rounds.max(1));
    let (rates, runs) = match chosen {
        Chosen::Cpu { .. } => {
            let s = store.clone();
            let make: sluice::engine::Maker<sluice::backend::cpu::CpuBackend> =
                Arc::new(move |_: &Arc<Store>, i: &PlanInput| {
                    sluice::engine::cpu_runner_discrete(s.clone(), i, threads, io.clone(), run)
                });
            job.call(&make)?
        }
        Chosen::Cuda(_) => sluice::engine::on_backend(chosen, threads, &io, run, job)?,
    };
    if a.json {
        let j = serde_json::json!({"rates": rates, "phases": phases, "runs": runs});
        println!("{}", serde_json::to_string_pretty(&j)?);
        return Ok(std::process::ExitCode::SUCCESS);
    }
    println!(
        "{:>10} {:>5} {:>6}  {:>24}  {:>8} {:>8} {:>8}",
        "mode", "round", "start", "tok/s per phase", "total s", "changes", "change s"
    );
    for r in &runs {
        let per: Vec<String> = (r.phases.iter())
            .map(|p| format!("{}:{:.1}", p.batch, p.tokens_per_s))
            .collect();
        println!(
            "{:>10} {:>5} {:>6}  {:>24}  {:>8.2} {:>8} {:>8.2}",
            r.mode,
            r.round,
            r.cpu_layers,
            per.join(" "),
            r.seconds,
            r.changes,
            r.change_s
        );
    }
    Ok(std::process::ExitCode::SUCCESS)
}

/// The plan input the placements are measured in: one sequence, a pass of the most rows
/// asked for (with --follow: the largest batch, each sequence's prompt and tokens), the
/// device budget given or the share of the weights.
fn plan_input(a: &BenchPlacementArgs, store: &Store, chosen: &Chosen) -> Result<PlanInput> {
    let most = a.rows.iter().copied().max().unwrap_or(1).max(2);
    let batch = a.follow.iter().copied().max().unwrap_or(1).max(1);
    let context = match a.follow.is_empty() {
        true => most.max(64),
        false => (a.follow_prompt + a.follow_decode + 8).max(64),
    };
    let opts = ModelOptions {
        max_context: context,
        kv_slots: batch,
        max_batch_tokens: most.max(if a.follow.is_empty() { 0 } else { 64 }),
        kv_dtype: sluice::engine::kv_dtype_for(false, None),
        exact: false,
        verify_rows: 0,
    };
    let budget = match a.device_memory {
        Some(b) => b,
        None => {
            crate::bench::weights_share_budget(&a.weights_budget, store, opts, a.prefetch, chosen)?
        }
    };
    Ok(PlanInput {
        device_budget: Some(budget),
        host_cache_budget: 0,
        opts,
        prefetch: a.prefetch,
        expert_cache: None,
        expert_profile: None,
        backend_reserved: 0,
        self_draft_reserved: 0,
        host: sluice::engine::host_input(None, 0),
    })
}

fn print_table(r: &PlacementReport) {
    let gb = |x: f64| x / 1e9;
    println!(
        "rates: streaming {:.2} GB/s; device {:.2} GB/s of weights at one row, {:.2} per row beyond; CPU {:.2} GB/s, {:.2} per row; overlap {:.2}",
        gb(r.rates.stream_bytes_per_s.min(1e18)),
        gb(r.rates.device.weight_bytes_per_s),
        gb(r.rates.device.row_bytes_per_s),
        gb(r.rates.cpu.weight_bytes_per_s),
        gb(r.rates.cpu.row_bytes_per_s),
        r.rates.overlap,
    );
    println!(
        "{:>5} {:>10} {:>10} {:>10} {:>10} {:>12} {:>12} {:>8}",
        "rows",
        "cpu layers",
        "cpu ms",
        "device ms",
        "stream ms",
        "predicted ms",
        "measured ms",
        "ratio"
    );
    for m in &r.runs {
        let p = &m.predicted;
        println!(
            "{:>5} {:>10} {:>10.2} {:>10.2} {:>10.2} {:>12.2} {:>12.2} {:>8.3}{}",
            m.rows,
            p.cpu_layers,
            p.cpu_s * 1e3,
            p.device_s * 1e3,
            p.stream_s * 1e3,
            p.pass_s * 1e3,
            m.measured_pass_s * 1e3,
            m.ratio,
            if m.chosen { "  chosen" } else { "" }
        );
    }
}
