//! `sluiced`: the sluice daemon and its model tools. `main` parses the command line and
//! hands each command to its own file under `sluiced/`.

use clap::{Parser, Subcommand};

#[path = "sluiced/bench.rs"]
mod bench;
#[path = "sluiced/codec.rs"]
mod codec;
#[path = "sluiced/inspect.rs"]
mod inspect;
#[path = "sluiced/pack.rs"]
mod pack;
#[path = "sluiced/placement.rs"]
mod placement;
#[path = "sluiced/run.rs"]
mod run;
#[path = "sluiced/serve.rs"]
mod serve;
#[path = "sluiced/serve_args.rs"]
mod serve_args;
#[path = "sluiced/synth.rs"]
mod synth;
#[path = "sluiced/util.rs"]
mod util;

#[derive(Parser)]
#[command(
    name = "sluiced",
    version,
    about = "Run LLMs larger than accelerator memory by streaming compressed layers from NVMe"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Pack a GGUF file or a Hugging Face model directory into a sluice store.
    Pack(pack::PackArgs),
    /// Print a store's config, per-layer sizes and compression ratios.
    Inspect(inspect::InspectArgs),
    /// Read every frame of a store and check every checksum.
    Verify(inspect::VerifyArgs),
    /// Generate text from a prompt (CPU or CUDA backend) and report tokens/s.
    Run(Box<run::RunArgs>),
    /// Serve the model over gRPC (sluice.v1.Inference) and the OpenAI-compatible HTTP API
    /// (flags override the config file).
    Serve(Box<serve_args::ServeArgs>),
    /// Write a synthetic Llama-shaped store with random weights, for benchmarks.
    Synth(synth::SynthArgs),
    /// Measure streaming: overlap (pass time vs compute-only and streaming-only) and decode
    /// tokens/s at several batch sizes under a device budget.
    BenchStream(bench::BenchStreamArgs),
    /// Stream every layer of a store through the I/O engine and report rates against
    /// their limits measured in the same run.
    BenchIo(bench::BenchIoArgs),
    /// Measure the rates --placement auto chooses with, then every placement (the first
    /// layers on the host CPU, none to all) at each row count: predicted and measured pass
    /// times.
    BenchPlacement(placement::BenchPlacementArgs),
    /// Measure every frame codec on a model's tensors (a store, a safetensors file or a
    /// GGUF): ratio and one core's compress and decompress rates, per dtype.
    BenchCodec(bench::BenchCodecArgs),
    /// Measure the CUDA decode kernels (CUDA only): each GEMV's bandwidth against the
    /// device's copy bandwidth at 1, 8 and 64 rows, attention at contexts 512 to 32768.
    BenchKernels(bench::BenchKernelsArgs),
    /// Internal: renders chat templates for the daemon under a memory limit.
    #[command(name = "template-worker", hide = true)]
    TemplateWorker,
}

fn main() -> std::process::ExitCode {
    // Colour only for a person at a terminal: journald and log files get plain text, and
    // NO_COLOR (https://no-color.org) turns it off there too.
    let colour = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        .with_ansi(colour)
        .init();
    let cli = Cli::parse();
    if !matches!(cli.cmd, Cmd::Serve(_) | Cmd::TemplateWorker) {
        // The model tools write tables for pipes like `| head`: die quietly on a closed
        // pipe as Unix tools do, instead of panicking in println!. The daemon keeps the
        // default handling (ignored) for its sockets.
        // SAFETY: setting a signal disposition to SIG_DFL at start, before any thread exists.
        unsafe {
            libc::signal(libc::SIGPIPE, libc::SIG_DFL);
        }
    }
    let result = match cli.cmd {
        Cmd::Pack(a) => pack::run(a),
        Cmd::Inspect(a) => inspect::run(a),
        Cmd::Verify(a) => inspect::verify(a),
        Cmd::Run(a) => run::run(*a),
        Cmd::Serve(a) => {
            // Before any thread starts, so no thread has an arena beyond the cap.
            sluice::hostmem::limit_arenas(sluice::hostmem::SERVE_ARENAS);
            (*a).config()
                .and_then(serve::serve)
                .map(|()| std::process::ExitCode::SUCCESS)
        }
        Cmd::Synth(a) => synth::run(a),
        Cmd::BenchStream(a) => bench::run_stream(a),
        Cmd::BenchIo(a) => bench::run_io(a),
        Cmd::BenchCodec(a) => bench::run_codec(a),
        Cmd::BenchPlacement(a) => placement::run(a),
        Cmd::BenchKernels(a) => bench::run_kernels(a),
        Cmd::TemplateWorker => sluice::text::sandbox::worker_main()
            .map(|()| std::process::ExitCode::SUCCESS)
            .map_err(anyhow::Error::msg),
    };
    match result {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
