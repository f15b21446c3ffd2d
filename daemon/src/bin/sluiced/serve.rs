//! `sluiced serve`: load the model, plan memory, start the scheduler, serve gRPC on TCP
//! (and a Unix socket), tell systemd when ready, drain on SIGTERM.

use anyhow::{bail, Context, Result};
use sluice::backend::Backend;
use sluice::engine::scheduler::{Scheduler, SchedulerConfig};
use sluice::engine::{BackendChoice, EngineError, OnBackend};
use sluice::pipeline::Pipeline;
use sluice::plan::Plan;
use sluice::server::service::{ModelMeta, Service};
use sluice::server::ServeConfig;
use sluice::store::Store;
use sluice::text::{ChatTemplate, Tokenizer};
use sluice::util::{fmt_bytes, ByteSize};
use sluice_proto::v1::inference_server::InferenceServer;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

#[derive(clap::Args)]
pub struct ServeArgs {
    /// Store directory (from `sluiced pack`).
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Config file (default /etc/sluice/sluiced.toml when it exists); flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// TCP address to listen on (default 127.0.0.1:50051).
    #[arg(long)]
    pub listen: Option<String>,
    /// Also serve on this Unix socket.
    #[arg(long)]
    pub unix: Option<PathBuf>,
    /// Device memory budget (e.g. 300MiB, 24GiB); below the model's size, layers stream.
    /// Default: every layer resident on the CPU; on CUDA the device's free memory minus
    /// headroom.
    #[arg(long, value_parser = parse_byte_size)]
    pub device_memory: Option<ByteSize>,
    /// Host memory for decompressed copies of streamed layers (default 0).
    #[arg(long, value_parser = parse_byte_size)]
    pub host_cache: Option<ByteSize>,
    /// Memory the whole daemon may use on the host (e.g. 16GiB): read buffers, staging,
    /// host cache, and on the CPU backend the arena; what does not fit streams. Default:
    /// 80% of MemAvailable (or of the memory cgroup's room when that is less).
    #[arg(long, value_parser = parse_byte_size)]
    pub host_memory: Option<ByteSize>,
    /// Sequences in one pass over the weights, i.e. KV-cache slots (default 8).
    #[arg(long)]
    pub max_batch: Option<usize>,
    /// Positions per sequence, prompt and generated tokens together (default 4096).
    #[arg(long)]
    pub max_context: Option<usize>,
    /// Tokens per pass over all sequences, the prefill chunk budget (default 512).
    #[arg(long)]
    pub batch_tokens: Option<usize>,
    /// Requests waiting for a slot at most; beyond, RESOURCE_EXHAUSTED (default 64).
    #[arg(long)]
    pub queue_max: Option<usize>,
    /// Layers requested ahead of the one computing while layers stream (default 4).
    #[arg(long)]
    pub prefetch: Option<usize>,
    /// Compute threads of the CPU backend (default 0: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// auto (CUDA when a usable GPU is there, else the CPU, saying why), cpu or cuda.
    #[arg(long)]
    pub backend: Option<BackendChoice>,
    /// CUDA device ordinal (default 0).
    #[arg(long)]
    pub device: Option<usize>,
    /// Seconds in-flight requests get to finish after SIGTERM before they are cancelled
    /// (default 30).
    #[arg(long)]
    pub shutdown_grace_s: Option<u64>,
    /// The reference numerics: f32 activations and an f32 KV cache (default: 8-bit
    /// activations for decode rows, f16 KV cache).
    #[arg(long)]
    pub exact: bool,
    /// KV cache element type (default f16; f32 under --exact).
    #[arg(long)]
    pub kv_dtype: Option<sluice::backend::KvDtype>,
}

fn parse_byte_size(s: &str) -> Result<ByteSize, String> {
    s.parse()
}

impl ServeArgs {
    pub fn config(self) -> Result<sluice::server::ServeConfig> {
        let mut c = sluice::server::ServeConfig::load(self.config.as_deref())
            .map_err(anyhow::Error::msg)?;
        macro_rules! set {
            ($($f:ident),*) => { $(if let Some(v) = self.$f { c.$f = v; })* };
        }
        set!(
            listen,
            max_batch,
            max_context,
            batch_tokens,
            queue_max,
            threads,
            shutdown_grace_s,
            host_cache,
            backend,
            device
        );
        if self.model.is_some() {
            c.model = self.model;
        }
        if self.unix.is_some() {
            c.unix = self.unix;
        }
        if self.device_memory.is_some() {
            c.device_memory = self.device_memory;
        }
        if self.host_memory.is_some() {
            c.host_memory = self.host_memory;
        }
        if self.prefetch.is_some() {
            c.prefetch = self.prefetch;
        }
        if self.exact {
            c.exact = true;
        }
        if self.kv_dtype.is_some() {
            c.kv_dtype = self.kv_dtype;
        }
        Ok(c)
    }
}

/// Builds the pipeline on the chosen backend and starts the scheduler's engine thread.
struct StartScheduler {
    input: sluice::plan::PlanInput,
    tokenizer: Arc<Tokenizer>,
    cfg: SchedulerConfig,
}

impl OnBackend for StartScheduler {
    type Output = (Plan, Scheduler, std::thread::JoinHandle<()>, &'static str);
    fn call<B: Backend + 'static>(
        self,
        make: &dyn Fn(&sluice::plan::PlanInput) -> Result<Pipeline<B>, EngineError>,
    ) -> Result<Self::Output, EngineError>
    where
        B::Mem: 'static,
    {
        let runner = make(&self.input)?;
        let plan = runner.plan.clone();
        let name = runner.backend.name();
        let (s, e) = Scheduler::start(runner, self.tokenizer, self.cfg);
        Ok((plan, s, e, name))
    }
}

pub fn serve(cfg: ServeConfig) -> Result<()> {
    cfg.validate().map_err(anyhow::Error::msg)?;
    let dir = cfg
        .model
        .clone()
        .context("no model: pass --model DIR or set `model` in the config file")?;
    let mut store = Store::open(&dir)?;
    let tokenizer = Arc::new(Tokenizer::from_manifest(store.manifest())?);
    store.release_tokenizer_spec();
    let store = Arc::new(store);
    let m = store.manifest();
    let template = match &m.chat_template {
        Some(src) => {
            let piece = |id: Option<u32>| id.map(|i| tokenizer.piece(i)).unwrap_or_default();
            Some(Arc::new(ChatTemplate::new(
                src,
                piece(m.special.bos),
                piece(m.special.eos),
            )?))
        }
        None => None,
    };
    let opts = sluice::model::ModelOptions {
        max_context: cfg.max_context,
        kv_slots: cfg.max_batch,
        max_batch_tokens: cfg.batch_tokens,
        kv_dtype: sluice::engine::kv_dtype_for(cfg.exact, cfg.kv_dtype),
        exact: cfg.exact,
    };
    let device_budget = cfg.device_memory.map(|b| b.0);
    let host_cache = cfg.host_cache.0;
    let input = sluice::plan::PlanInput {
        device_budget,
        host_cache_budget: host_cache,
        opts,
        prefetch: cfg.prefetch,
        backend_reserved: 0,
        // Logits rows of a full batch are the scheduler's own allocation.
        host: sluice::engine::host_input(
            cfg.host_memory.map(|b| b.0),
            4 * m.arch.vocab as u64 * cfg.max_batch as u64,
        ),
    };
    let chosen = sluice::engine::choose_backend(cfg.backend, cfg.device)?;
    let start = StartScheduler {
        input,
        tokenizer,
        cfg: SchedulerConfig {
            queue_max: cfg.queue_max,
        },
    };
    let io = sluice::io::IoConfig::serving();
    let (plan, sched, engine, backend_name) =
        sluice::engine::on_backend(&chosen, &store, cfg.threads, &io, start)?;
    let budget = plan.device_budget;
    tracing::info!("{}\n{}", dir.display(), plan.table());
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "model".into());
    let meta = ModelMeta {
        name: name.clone(),
        architecture: m.arch.arch.to_string(),
        layers: m.arch.n_layers,
        hidden: m.arch.hidden,
        vocab: m.arch.vocab,
        context: cfg.max_context as u32,
        stored_bytes: m.stored_bytes(),
        raw_bytes: m.raw_bytes(),
    };
    let service = Service {
        sched: sched.clone(),
        meta,
        template,
        plan,
        backend: backend_name.into(),
        device_budget: budget,
        max_tokens_default: cfg.max_tokens_default,
        numerics: if cfg.exact { "exact" } else { "fast" },
        kv_dtype: sluice::engine::kv_dtype_for(cfg.exact, cfg.kv_dtype),
    };

    listen_until_stopped(&cfg, service, sched, engine, &name, budget)
}

/// Serves gRPC on TCP (and the Unix socket) until SIGTERM or SIGINT, then drains: stops
/// admission, lets in-flight requests finish within the grace period, joins the engine.
fn listen_until_stopped(
    cfg: &ServeConfig,
    service: Service,
    sched: Scheduler,
    engine: std::thread::JoinHandle<()>,
    name: &str,
    budget: u64,
) -> Result<()> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("sluice-grpc")
        .enable_all()
        .build()?;
    rt.block_on(async move {
        let (health, health_svc) = tonic_health::server::health_reporter();
        health.set_serving::<InferenceServer<Service>>().await;
        // Both reflection versions: grpcurl and older tools still speak v1alpha.
        let reflection = tonic_reflection::server::Builder::configure().register_encoded_file_descriptor_set(sluice_proto::FILE_DESCRIPTOR_SET).register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET).build_v1()?;
        let reflection_alpha = tonic_reflection::server::Builder::configure().register_encoded_file_descriptor_set(sluice_proto::FILE_DESCRIPTOR_SET).register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET).build_v1alpha()?;
        let inference = InferenceServer::new(service);
        let addr: std::net::SocketAddr = cfg.listen.parse().with_context(|| format!("listen address {:?}", cfg.listen))?;
        let tcp = tokio::net::TcpListener::bind(addr).await.with_context(|| format!("bind {addr}"))?;
        let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
        let shutdown = |mut rx: tokio::sync::watch::Receiver<bool>| async move {
            let _ = rx.wait_for(|s| *s).await;
        };
        let mut servers = Vec::new();
        let router = tonic::transport::Server::builder().add_service(health_svc.clone()).add_service(reflection.clone()).add_service(reflection_alpha.clone()).add_service(inference.clone());
        servers.push(tokio::spawn(router.serve_with_incoming_shutdown(tokio_stream::wrappers::TcpListenerStream::new(tcp), shutdown(stop_rx.clone()))));
        if let Some(path) = &cfg.unix {
            if path.exists() {
                std::fs::remove_file(path).with_context(|| format!("remove stale socket {}", path.display()))?;
            }
            let ul = tokio::net::UnixListener::bind(path).with_context(|| format!("bind {}", path.display()))?;
            let router = tonic::transport::Server::builder().add_service(health_svc).add_service(reflection).add_service(reflection_alpha).add_service(inference);
            servers.push(tokio::spawn(router.serve_with_incoming_shutdown(tokio_stream::wrappers::UnixListenerStream::new(ul), shutdown(stop_rx.clone()))));
        }
        tracing::info!(model = %name, %addr, unix = ?cfg.unix, device_budget = %fmt_bytes(budget), "serving sluice.v1.Inference");
        // READY only now: the model is planned, loaded and the listeners are bound.
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);

        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: draining"),
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: draining"),
        }
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
        health.set_not_serving::<InferenceServer<Service>>().await;
        // Stop admitting; in-flight requests finish or are cancelled after the grace period.
        sched.shutdown(Duration::from_secs(cfg.shutdown_grace_s));
        let joined = tokio::task::spawn_blocking(move || engine.join());
        if joined.await.is_err() {
            bail!("the engine thread failed during shutdown");
        }
        let _ = stop_tx.send(true);
        for s in servers {
            match tokio::time::timeout(Duration::from_secs(5), s).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => tracing::warn!("server: {e}"),
                Ok(Err(e)) => tracing::warn!("server task: {e}"),
                Err(_) => tracing::warn!("server did not stop within 5 s"),
            }
        }
        if let Some(path) = &cfg.unix {
            let _ = std::fs::remove_file(path);
        }
        tracing::info!("stopped");
        Ok(())
    })
}
