//! `sluiced serve`: load the model, plan memory, start the scheduler, serve gRPC on TCP
//! (and a Unix socket), tell systemd when ready, drain on SIGTERM.

use anyhow::{bail, Context, Result};
use sluice::engine::scheduler::{Scheduler, SchedulerConfig};
use sluice::server::service::{ModelMeta, Service};
use sluice::server::ServeConfig;
use sluice::store::Store;
use sluice::text::{ChatTemplate, Tokenizer};
use sluice::util::{fmt_bytes, parse_size};
use sluice_proto::v1::inference_server::InferenceServer;
use std::sync::Arc;
use std::time::Duration;

pub fn serve(cfg: ServeConfig) -> Result<()> {
    cfg.validate().map_err(anyhow::Error::msg)?;
    let dir = cfg
        .model
        .clone()
        .context("no model: pass --model DIR or set `model` in the config file")?;
    let store = Arc::new(Store::open(&dir)?);
    let m = store.manifest();
    let tokenizer = Arc::new(Tokenizer::from_manifest(m)?);
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
    };
    let device_budget = cfg
        .device_memory
        .as_deref()
        .map(parse_size)
        .transpose()
        .map_err(anyhow::Error::msg)
        .context("device_memory")?;
    let host_cache = parse_size(&cfg.host_cache)
        .map_err(anyhow::Error::msg)
        .context("host_cache")?;
    let input = sluice::plan::PlanInput {
        device_budget,
        host_cache_budget: host_cache,
        opts,
        prefetch: cfg.prefetch,
        backend_reserved: 0,
    };
    let io = sluice::io::IoConfig {
        queue_depth: 32,
        read_buffers: 32,
        ..Default::default()
    };
    let chosen = sluice::engine::choose_backend(cfg.backend, cfg.device)?;
    let sched_cfg = SchedulerConfig {
        queue_max: cfg.queue_max,
    };
    let (plan, sched, engine, backend_name) = match chosen {
        sluice::engine::Chosen::Cpu { .. } => {
            let runner = sluice::engine::cpu_runner(store.clone(), &input, cfg.threads, io)?;
            let plan = runner.plan.clone();
            let (s, e) = Scheduler::start(runner, tokenizer, sched_cfg);
            (plan, s, e, "cpu")
        }
        sluice::engine::Chosen::Cuda(info) => {
            let runner = sluice::engine::cuda_runner(store.clone(), &input, &info, io)?;
            let plan = runner.plan.clone();
            let (s, e) = Scheduler::start(runner, tokenizer, sched_cfg);
            (plan, s, e, "cuda")
        }
    };
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
    };

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
