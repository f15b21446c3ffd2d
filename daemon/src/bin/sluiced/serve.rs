//! `sluiced serve`: bring up the HTTP API (503 while loading), load the model, plan
//! memory, start the scheduler, serve gRPC on TCP (and a Unix socket) beside HTTP, tell
//! systemd when ready, drain on SIGTERM.

use anyhow::{bail, Context, Result};
use sluice::backend::Backend;
use sluice::engine::scheduler::{Scheduler, SchedulerConfig};
use sluice::engine::{EngineError, OnBackend};
use sluice::plan::Plan;
use sluice::server::api::{Frontend, ModelMeta, RequestLimits};
use sluice::server::auth::{check_exposure, ApiKeys, GrpcAuth};
use sluice::server::http::{HttpState, Public};
use sluice::server::metrics::{Metrics, Static};
use sluice::server::models::{KeepAlive, Loader, Models, ModelsConfig, Served, StoreInfo};
use sluice::server::service::Service;
use sluice::server::ServeConfig;
use sluice::store::Store;
use sluice::text::{ChatTemplate, Tokenizer};
use sluice_proto::v1::inference_server::InferenceServer;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tonic::service::interceptor::InterceptedService;

/// The backend `cfg` asks for (on the first of its `devices`), where its placement can be.
fn backend_of(cfg: &ServeConfig) -> Result<sluice::engine::Chosen> {
    let first = match sluice::engine::parse_devices(&cfg.devices)?.first() {
        Some(&d) => d,
        None => cfg.device,
    };
    let chosen = sluice::engine::choose_backend(cfg.backend, first)?;
    if let sluice::engine::Chosen::Cpu { .. } = chosen {
        if cfg.placement != "device" || cfg.cpu_layers > 0 {
            bail!("placement \"auto\" and cpu_layers place layers between the host CPU and a GPU: the CPU backend computes every layer on the host already (give --backend cuda, or leave them out)");
        }
    }
    Ok(chosen)
}

/// Builds the pipeline on the chosen backend and starts the scheduler's engine thread.
struct StartScheduler {
    store: Arc<Store>,
    /// A draft model's store (loaded whole beside the model), or a self-draft's.
    draft: Option<sluice::engine::draft_model::DraftSource>,
    /// The backend and reads the pipelines are built for (plans of a self-draft's rounds).
    chosen: sluice::engine::Chosen,
    io: sluice::io::IoConfig,
    threads: usize,
    input: sluice::plan::PlanInput,
    /// `placement = "auto"` or "auto-once": the host layers are chosen from measured
    /// rates first; "auto": and then follow the batch.
    auto_placement: bool,
    follow_batch: bool,
    profile: Option<sluice::pipeline::ExpertProfile>,
    tokenizer: Arc<Tokenizer>,
    cfg: SchedulerConfig,
}

impl OnBackend for StartScheduler {
    type Output = (
        Plan,
        Option<sluice::plan::placement::Choice>,
        Scheduler,
        std::thread::JoinHandle<()>,
        &'static str,
    );
    fn call<B: Backend + 'static>(
        self,
        make: &sluice::engine::Maker<B>,
    ) -> Result<Self::Output, EngineError>
    where
        B::Mem: 'static,
    {
        let plan = |m: &sluice::store::Manifest, i: &sluice::plan::PlanInput| {
            sluice::engine::plan_for(&self.chosen, m, i, &self.io, self.threads)
        };
        // A full batch of decode rows: the rows a busy daemon's passes carry. The
        // placement then follows the rows the passes carry (`engine::replace`).
        let (mut runner, draft, choice, replacer) = if self.auto_placement {
            let p = sluice::engine::placement::auto_built(
                &**make,
                &self.store,
                self.draft.as_ref(),
                (&self.chosen.device_key(), self.threads),
                &self.input,
                self.input.opts.kv_slots,
            )?;
            // What building the pipeline took is what a change of placement is reckoned
            // to cost until one is measured.
            let replacer = match self.follow_batch {
                true => Some(follower(
                    make,
                    (&self.store, self.profile.clone()),
                    &p.input,
                    p.rates,
                    p.build_s,
                )?),
                false => None,
            };
            (p.runner, p.draft, Some(p.choice), replacer)
        } else {
            let (runner, draft) = sluice::engine::draft_model::with_draft(
                &**make,
                &plan,
                &self.store,
                self.draft.as_ref(),
                &self.input,
            )?;
            (runner, draft, None, None)
        };
        if let Some(d) = &draft {
            tracing::info!("{}", d.describe());
        }
        if let Some(p) = self.profile {
            let n = runner.load_expert_profile(p)?;
            tracing::info!(
                "expert profile: {n} experts loaded into the expert cache, {} pinned",
                n.min(runner.plan.expert_hot_slots)
            );
        }
        let plan = runner.plan.clone();
        let name = runner.backend.name();
        let mut cfg = self.cfg;
        cfg.kv_tiers.host_bytes = plan.host.kv_cache_host_bytes;
        let (s, e) = Scheduler::start_following(runner, draft, replacer, self.tokenizer, cfg);
        Ok((plan, choice, s, e, name))
    }
}

/// The follower of the batch for placement "auto" (`engine::replace`): every placement
/// that fits `input`'s budgets, followed from `input`'s, a change reckoned to cost
/// `change_s` until one is measured; each pipeline it builds warms its expert cache from
/// `profile` as the first did.
fn follower<B: Backend + 'static>(
    make: &sluice::engine::Maker<B>,
    (store, profile): (&Arc<Store>, Option<sluice::pipeline::ExpertProfile>),
    input: &sluice::plan::PlanInput,
    rates: sluice::plan::placement::Rates,
    change_s: f64,
) -> Result<sluice::engine::replace::Replacer<B>, EngineError> {
    let shapes = sluice::plan::placement::shapes(store.manifest(), input)?;
    let follow =
        sluice::plan::placement::Follow::new(shapes, rates, input.host.cpu_layers, change_s);
    let (make, store) = (make.clone(), store.clone());
    Ok(sluice::engine::replace::Replacer::new(
        follow,
        input.clone(),
        Box::new(move |i| {
            let mut r = make(&store, i)?;
            if let Some(p) = &profile {
                r.load_expert_profile(p.clone())?;
            }
            Ok(r)
        }),
    ))
}

/// Loads models for the daemon: every one with the same limits, on the chosen backend.
struct ModelLoader {
    cfg: ServeConfig,
    chosen: sluice::engine::Chosen,
    metrics: Arc<Metrics>,
    limits: RequestLimits,
    read_timeout: Option<Duration>,
    /// The worker process every model's chat template renders in.
    templates: Arc<sluice::text::sandbox::TemplateSandbox>,
    /// The prefix cache's disk tier, shared by the models.
    kv_disk: Option<Arc<sluice::engine::kv_disk::DiskTier>>,
    /// The devices beside the first and the split (`devices`, `split`).
    devices: (Vec<sluice::plan::DeviceInput>, Vec<f64>),
}

impl ModelLoader {
    fn new(
        cfg: &ServeConfig,
        chosen: sluice::engine::Chosen,
        metrics: Arc<Metrics>,
        limits: RequestLimits,
    ) -> Result<ModelLoader> {
        let ordinals = sluice::engine::parse_devices(&cfg.devices)?;
        let devices = sluice::engine::other_devices(
            &chosen,
            ordinals.get(1..).unwrap_or_default(),
            &cfg.split,
            cfg.device_memory.map(|b| b.0),
        )?;
        Ok(ModelLoader {
            devices,
            cfg: cfg.clone(),
            chosen,
            metrics,
            limits,
            read_timeout: cfg.read_timeout().map_err(anyhow::Error::msg)?,
            templates: Arc::new(sluice::text::sandbox::TemplateSandbox::new(
                std::env::current_exe()
                    .context("the path of this sluiced, for its template worker")?,
            )),
            kv_disk: open_kv_disk(cfg),
        })
    }

    /// The I/O engine's settings for every model this daemon loads.
    fn io(&self) -> sluice::io::IoConfig {
        sluice::io::IoConfig {
            read_timeout: self.read_timeout,
            ..sluice::io::IoConfig::serving()
        }
    }

    fn input(
        &self,
        device_room: Option<u64>,
        profile_hot: Option<usize>,
        draft: Option<&sluice::engine::draft::DraftConfig>,
    ) -> sluice::plan::PlanInput {
        let cfg = &self.cfg;
        let verify_rows = cfg.verify_rows(draft);
        sluice::plan::PlanInput {
            device_budget: device_room,
            host_cache_budget: cfg.host_cache.0,
            opts: sluice::model::ModelOptions {
                max_context: cfg.max_context,
                kv_slots: cfg.max_batch,
                max_batch_tokens: cfg.batch_tokens,
                kv_dtype: sluice::engine::kv_dtype_for(cfg.exact, cfg.kv_dtype),
                exact: cfg.exact,
                verify_rows,
            },
            prefetch: cfg.prefetch,
            expert_cache: cfg.expert_cache,
            expert_profile: profile_hot,
            backend_reserved: 0,
            self_draft_reserved: 0,
            // The scheduler's logits and samplers are the plan's (`plan::host::sampling`).
            host: sluice::plan::HostInput {
                kv_tier: match cfg.prefix_cache {
                    true => sluice::server::config::parse_kv_host(&cfg.kv_cache_host)
                        .unwrap_or(sluice::plan::KvHostTier::Auto),
                    false => sluice::plan::KvHostTier::Off,
                },
                kv_disk: cfg.prefix_cache && cfg.kv_cache_dir.is_some(),
                cpu_layers: cfg.cpu_layers,
                devices: self.devices.0.clone(),
                split: self.devices.1.clone(),
                ..sluice::engine::host_input(cfg.host_memory.map(|b| b.0), 0)
            },
        }
    }

    /// The drafter the model in `dir` serves with: its store directory's `draft` file, else
    /// `--draft` (None: it does not draft).
    fn drafter_of(&self, dir: &Path) -> Result<Option<String>> {
        Ok(match crate::util::draft_sidecar(dir)? {
            Some(d) => d,
            None => self.cfg.draft.clone(),
        })
    }

    /// The drafting `chosen` (`drafter_of`) gives the model `name`, and the draft model's
    /// store where that is a model: a draft model only when its vocabulary is the model's
    /// (`tok`'s), else no drafting (logged).
    fn draft_for(
        &self,
        name: &str,
        chosen: Option<String>,
        store: &Store,
        tok: Option<&Tokenizer>,
    ) -> Result<(
        Option<sluice::engine::draft::DraftConfig>,
        Option<sluice::engine::draft_model::DraftSource>,
    )> {
        use sluice::engine::draft_model::DraftSource;
        let cfg = &self.cfg;
        let config = cfg.draft_config_for(chosen.as_deref());
        let Some(d) = chosen.as_deref().filter(|d| *d != "ngram") else {
            return Ok((config, None));
        };
        if let Some(t) = sluice::engine::self_draft::parse(d) {
            if cfg.placement != "device" {
                bail!(
                    "draft {d} with placement {:?} is not supported yet (the self-draft shares the layers auto would move): give cpu_layers, or a draft model",
                    cfg.placement
                );
            }
            if cfg.cpu_layers > 0 || cfg.devices.len() > 1 {
                bail!("draft {d} with cpu_layers or several devices is not supported yet (the layers on the host or other devices have no quantized copy to draft with): give a draft model or --draft ngram");
            }
            let t = t.map_err(anyhow::Error::msg)?;
            let q = crate::util::self_draft_store(store, t, cfg.threads)?;
            return Ok((config, Some(DraftSource::SelfDraft(q))));
        }
        let tok = tok.context("a draft model's vocabulary is checked against the model's")?;
        let dir = sluice::util::store_path(Path::new(d), cfg.models_dir.as_deref());
        let mut store = Store::open(&dir).with_context(|| format!("draft {d}"))?;
        let dtok = Tokenizer::from_manifest(store.manifest())?;
        store.release_tokenizer_spec();
        if let Some(why) = sluice::engine::draft_model::vocab_mismatch(tok, &dtok) {
            tracing::warn!(
                model = name,
                "draft {d} cannot draft for this model ({why}): serving it without drafting"
            );
            return Ok((None, None));
        }
        Ok((config, Some(DraftSource::Model(Arc::new(store)))))
    }

    /// Loads the store at `dir` as `name`, with the expert profile at `profile` and the chat
    /// template `template` instead of the store's (the pinned model's `expert_profile` and
    /// `chat_template`).
    fn load_model(
        &self,
        name: &str,
        dir: &Path,
        device_room: Option<u64>,
        profile: Option<&Path>,
        template: Option<&str>,
    ) -> Result<Served> {
        let cfg = &self.cfg;
        let mut store = Store::open(dir)?;
        let mut tokenizer = Tokenizer::from_manifest(store.manifest())?;
        let template = template_source(name, dir, template, &store, &mut tokenizer)?;
        let tokenizer = Arc::new(tokenizer);
        store.release_tokenizer_spec();
        let store = Arc::new(store);
        let m = store.manifest();
        let template = match template.as_deref() {
            Some(src) => {
                let piece = |id: Option<u32>| id.map(|i| tokenizer.piece(i)).unwrap_or_default();
                Some(Arc::new(ChatTemplate::sandboxed(
                    src,
                    piece(m.special.bos),
                    piece(m.special.eos),
                    self.templates.clone(),
                )?))
            }
            None => None,
        };
        let profile = profile
            .map(|p| sluice::pipeline::ExpertProfile::load(p, &m.arch))
            .transpose()?;
        let hot = profile
            .as_ref()
            .map(|p| p.hot_set(sluice::pipeline::PROFILE_HOT_SHARE));
        let chosen = self.drafter_of(dir)?;
        let (draft, draft_store) =
            self.draft_for(name, chosen.clone(), &store, Some(&tokenizer))?;
        let drafter = chosen.filter(|_| draft.is_some()).unwrap_or_default();
        let io = self.io();
        let start = StartScheduler {
            store: store.clone(),
            draft: draft_store,
            chosen: self.chosen.clone(),
            io: io.clone(),
            threads: cfg.threads,
            input: self.input(device_room, hot, draft.as_ref()),
            auto_placement: cfg.placement != "device",
            follow_batch: cfg.placement == "auto",
            profile,
            tokenizer,
            cfg: SchedulerConfig {
                queue_max: cfg.queue_max,
                prefix_cache: cfg.prefix_cache,
                kv_tiers: sluice::engine::kv_tiers::TierConfig {
                    host_bytes: 0, // set from the plan once it is made
                    disk: self.kv_disk.clone(),
                },
            },
        };
        let (plan, placement, sched, engine, backend_name) =
            sluice::engine::on_backend(&self.chosen, cfg.threads, &io, Default::default(), start)?;
        tracing::info!("{name}: {}\n{}", dir.display(), plan.table());
        let kv_dtype = sluice::engine::kv_dtype_for(cfg.exact, cfg.kv_dtype);
        let numerics = if cfg.exact { "exact" } else { "fast" };
        let int_dots = sluice::engine::int_dots_for(backend_name, cfg.exact);
        let front = Arc::new(Frontend {
            usage: Arc::default(),
            sched,
            meta: model_meta(name, m, cfg.max_context),
            template,
            max_tokens_default: cfg.max_tokens_default,
            limits: self.limits,
            metrics: self.metrics.clone(),
            draft,
            drafter,
        });
        let stat = Static::of(name, backend_name, numerics, kv_dtype.to_string(), &plan);
        Ok(Served {
            front,
            plan,
            placement,
            stat,
            backend: backend_name.into(),
            numerics,
            int_dots,
            kv_dtype,
            max_batch: cfg.max_batch,
            engine: Mutex::new(Some(engine)),
        })
    }
}

/// The chat template of model `name` at `dir`: the config's (`template`: --chat-template,
/// the pinned model's), else the store directory's sidecar file, else the one the store
/// was packed with; `tokenizer` also ends generation at its end-of-turn tokens.
fn template_source(
    name: &str,
    dir: &Path,
    template: Option<&str>,
    store: &Store,
    tokenizer: &mut Tokenizer,
) -> Result<Option<String>> {
    let sidecar = crate::util::chat_template_sidecar(dir)?;
    let (template, from) = match (template, sidecar.as_deref()) {
        (Some(t), _) => (Some(t), "the config (--chat-template)"),
        (None, Some(t)) => (Some(t), crate::util::CHAT_TEMPLATE_SIDECAR),
        (None, None) => (store.manifest().chat_template.as_deref(), "the store"),
    };
    let template = template.map(str::to_owned);
    if let Some(t) = &template {
        let ends = tokenizer.end_turns_of(t);
        tracing::info!(
            model = name,
            "chat template from {from}, generation also ending at tokens {ends:?}"
        );
    }
    Ok(template)
}

impl Loader for ModelLoader {
    /// The model's plan as `load` makes it: beside its draft model where it has one (the
    /// draft planned first and whole, its bytes out of the model's budgets).
    fn plan(&self, dir: &Path, device_room: Option<u64>) -> Result<Plan, String> {
        let store = Store::open(dir).map_err(|e| e.to_string())?;
        let m = store.manifest();
        let io = self.io();
        let name = dir.display().to_string();
        // A draft model's vocabulary is checked against the model's tokenizer, built only
        // then (a large vocabulary takes a while).
        let chosen = self.drafter_of(dir).map_err(|e| format!("{e:#}"))?;
        let (draft, draft_store) = match chosen.as_deref() {
            Some(d) if d != "ngram" => {
                let tok = match sluice::engine::self_draft::parse(d) {
                    Some(_) => None,
                    None => Some(Tokenizer::from_manifest(m).map_err(|e| e.to_string())?),
                };
                self.draft_for(&name, chosen, &store, tok.as_ref())
                    .map_err(|e| format!("{e:#}"))?
            }
            other => (self.cfg.draft_config_for(other), None),
        };
        let input = self.input(device_room, None, draft.as_ref());
        let plan = |m: &sluice::store::Manifest, i: &sluice::plan::PlanInput| {
            sluice::engine::plan_for(&self.chosen, m, i, &io, self.cfg.threads)
        };
        sluice::engine::draft_model::plan_with_draft(&plan, m, draft_store.as_ref(), &input)
            .map_err(|e| e.to_string())
    }

    fn load(&self, name: &str, dir: &Path, device_room: Option<u64>) -> Result<Served, String> {
        self.load_model(name, dir, device_room, None, None)
            .map_err(|e| format!("{e:#}"))
    }
}

/// Where the daemon listens, parsed and checked before anything loads.
struct Listen {
    grpc: std::net::SocketAddr,
    http: Option<std::net::SocketAddr>,
}

fn addresses(cfg: &ServeConfig, keys: &ApiKeys) -> Result<Listen> {
    let grpc: std::net::SocketAddr = cfg
        .listen
        .parse()
        .with_context(|| format!("listen address {:?} (want host:port)", cfg.listen))?;
    let http = match cfg.http_listen.as_str() {
        "off" | "" => None,
        a => Some(
            a.parse()
                .with_context(|| format!("http_listen {a:?} (want host:port, or off)"))?,
        ),
    };
    let all: Vec<_> = std::iter::once(grpc).chain(http).collect();
    check_exposure(&all, keys, cfg.insecure_no_auth).map_err(anyhow::Error::msg)?;
    Ok(Listen { grpc, http })
}

/// The gid of a group name (or a number).
fn group_id(name: &str) -> Result<u32> {
    if let Ok(n) = name.parse::<u32>() {
        return Ok(n);
    }
    let c = std::ffi::CString::new(name).with_context(|| format!("unix_group {name:?}"))?;
    // SAFETY: getgrnam_r writes only into `grp` and `buf`, whose sizes it is given;
    // `out` points at `grp` on success.
    unsafe {
        let mut grp: libc::group = std::mem::zeroed();
        let mut buf = vec![0 as libc::c_char; 1 << 16];
        let mut out = std::ptr::null_mut();
        let rc = libc::getgrnam_r(c.as_ptr(), &mut grp, buf.as_mut_ptr(), buf.len(), &mut out);
        if rc != 0 || out.is_null() {
            bail!("unix_group {name:?}: no such group (create it, or name another)");
        }
        Ok(grp.gr_gid)
    }
}

/// The models directory: the one given, else the default one, also when --model names a
/// store in it (that store is the one kept loaded; the others load on request). A --model
/// outside every models directory is served alone.
fn models_dir(cfg: &ServeConfig) -> Result<Option<PathBuf>> {
    if let Some(d) = &cfg.models_dir {
        return Ok(Some(d.clone()));
    }
    if let Some(m) = &cfg.model {
        let default = sluice::util::default_models_dir();
        let store = sluice::util::store_path(m, None);
        let store = store.canonicalize().unwrap_or(store);
        return Ok(default.filter(|d| {
            let d = d.canonicalize().unwrap_or_else(|_| d.clone());
            store.parent() == Some(d.as_path())
        }));
    }
    match sluice::util::default_models_dir() {
        Some(d) if d.is_dir() => Ok(Some(d)),
        Some(d) => bail!(
            "no model: pass --model DIR, or --models-dir DIR, or pack a model into the default models directory with `sluiced pack SRC --name NAME` ({} does not exist yet)",
            d.display()
        ),
        None => bail!("no model: pass --model DIR or --models-dir DIR"),
    }
}

pub fn serve(cfg: ServeConfig) -> Result<()> {
    cfg.validate().map_err(anyhow::Error::msg)?;
    let dir = models_dir(&cfg)?;
    let keys = Arc::new(
        ApiKeys::load(cfg.api_key.as_deref(), cfg.api_key_file.as_deref())
            .map_err(anyhow::Error::msg)?,
    );
    let listen = addresses(&cfg, &keys)?;
    // Before anything binds: a backend that cannot be had fails the start at once.
    let chosen = backend_of(&cfg)?;
    let metrics = Arc::new(Metrics::default());
    let public = Public {
        health: cfg.public_paths.iter().any(|p| p == "/health"),
        metrics: cfg.public_paths.iter().any(|p| p == "/metrics"),
    };
    let limits = RequestLimits {
        max_request_bytes: cfg.max_request_bytes.0.min(usize::MAX as u64) as usize,
        max_messages: cfg.max_messages,
        ..RequestLimits::default()
    };
    let http_state = HttpState::new(keys.clone(), public, metrics.clone(), limits);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("sluice-net")
        .enable_all()
        .build()?;
    let (stop_tx, stop_rx) = tokio::sync::watch::channel(false);
    // Both ports are taken before the model loads, so a busy one fails the start at once.
    let grpc_tcp = rt
        .block_on(tokio::net::TcpListener::bind(listen.grpc))
        .with_context(|| format!("bind {} (listen)", listen.grpc))?;
    // HTTP comes up before the model loads: /health says 503 until it is served.
    let http_server = match listen.http {
        Some(addr) => {
            let tcp = rt
                .block_on(tokio::net::TcpListener::bind(addr))
                .with_context(|| format!("bind {addr} (http_listen; \"off\" disables it)"))?;
            let app = sluice::server::http::router(http_state.clone());
            let mut rx = stop_rx.clone();
            tracing::info!(%addr, "serving the OpenAI-compatible HTTP API (loading the model)");
            Some(rt.spawn(async move {
                axum::serve(tcp, app)
                    .with_graceful_shutdown(async move {
                        let _ = rx.wait_for(|s| *s).await;
                    })
                    .await
            }))
        }
        None => None,
    };

    // Every loaded model's plan shares an explicit budget; without one, the CPU plans
    // each within the host budget (which counts what is loaded) and CUDA within the
    // device's free memory at the start.
    let device_total = cfg
        .device_memory
        .map(|b| b.0)
        .or_else(|| chosen.default_device_budget());
    let backend = chosen.name();
    let keep_alive = sluice::server::models::parse_keep_alive(&cfg.keep_alive)
        .map_err(anyhow::Error::msg)?
        .unwrap_or(KeepAlive::For(Duration::from_secs(300)));
    let loader = ModelLoader::new(&cfg, chosen, metrics.clone(), limits)?;
    let kv_disk = loader.kv_disk.clone();
    let pinned = match &cfg.model {
        Some(m) => {
            let path = sluice::util::store_path(m, dir.as_deref());
            let name = path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| "model".into());
            let template = match &cfg.chat_template {
                Some(p) => Some(crate::util::read_chat_template(p)?),
                None => None,
            };
            let served = loader.load_model(
                &name,
                &path,
                device_total,
                cfg.expert_profile.as_deref(),
                template.as_deref(),
            )?;
            let info = StoreInfo::read(&path).map_err(anyhow::Error::msg)?;
            Some((name, path, info, served))
        }
        None if cfg.expert_profile.is_some() => {
            bail!("expert_profile is for the store given with --model (model in the config); none is given")
        }
        None if cfg.chat_template.is_some() => {
            bail!("chat_template is for the store given with --model (model in the config); none is given")
        }
        None => None,
    };
    let models = Models::new(
        ModelsConfig {
            dir: dir.clone(),
            keep_alive,
            device_total,
            max_batch: cfg.max_batch,
            max_context: cfg.max_context,
            backend: backend.into(),
        },
        Box::new(loader),
    )
    .map_err(anyhow::Error::msg)?;
    let what = match (&pinned, &dir) {
        (Some((n, ..)), Some(d)) => format!("{n} and the models in {}", d.display()),
        (Some((n, ..)), None) => n.clone(),
        (None, Some(d)) => format!("the models in {}", d.display()),
        (None, None) => String::new(),
    };
    if let Some((name, path, info, served)) = pinned {
        models.pin(&name, path, info, served);
    }
    let listed = models.list(false);
    tracing::info!(
        "models: {}",
        listed
            .iter()
            .map(|l| format!("{}{}", l.name, if l.loaded { " (loaded)" } else { "" }))
            .collect::<Vec<_>>()
            .join(", ")
    );
    http_state.set_ready(models.clone());
    let service = Service {
        models: models.clone(),
        metrics: metrics.clone(),
        limits,
    };
    let net = Net {
        listen,
        grpc_tcp,
        http_state,
        http_server,
        stop: (stop_tx, stop_rx),
        auth: GrpcAuth { keys, metrics },
    };
    let r = listen_until_stopped(&rt, &cfg, net, service, models, &what);
    // The prompts' KV blocks the engines queued for the disk tier, on disk before the next
    // start looks for them.
    if let Some(d) = kv_disk {
        d.flush();
    }
    r
}

/// What serving needs besides the model: the addresses, the HTTP side already running,
/// the stop signal of every server, and the gRPC key check.
struct Net {
    listen: Listen,
    grpc_tcp: tokio::net::TcpListener,
    http_state: Arc<HttpState>,
    http_server: Option<tokio::task::JoinHandle<std::io::Result<()>>>,
    stop: (
        tokio::sync::watch::Sender<bool>,
        tokio::sync::watch::Receiver<bool>,
    ),
    auth: GrpcAuth,
}

/// Reaper ticks (a quarter second each) between heap trims: every 5 s.
const HEAP_TRIM_TICKS: u64 = 20;

/// Serves gRPC on TCP (and the Unix socket) beside the HTTP API until SIGTERM or SIGINT,
/// then drains: stops admission, lets in-flight requests finish within the grace period,
/// joins the engine.
fn listen_until_stopped(
    rt: &tokio::runtime::Runtime,
    cfg: &ServeConfig,
    net: Net,
    service: Service,
    models: Arc<Models>,
    name: &str,
) -> Result<()> {
    rt.block_on(async move {
        // Idle models whose keep-alive ran out are unloaded within a quarter second; every
        // HEAP_TRIM_TICKS ticks the free heap goes back to the kernel (`hostmem::trim_heap`),
        // so the resident set follows the load instead of its highest burst.
        let reaper = {
            let models = models.clone();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(Duration::from_millis(250));
                let mut n: u64 = 0;
                loop {
                    tick.tick().await;
                    n += 1;
                    let m = models.clone();
                    let trim = n.is_multiple_of(HEAP_TRIM_TICKS);
                    let _ = tokio::task::spawn_blocking(move || {
                        m.reap();
                        if trim {
                            let freed = sluice::hostmem::trim_heap();
                            if freed > 0 {
                                tracing::debug!("heap trimmed: {freed} bytes back to the kernel");
                            }
                        }
                    })
                    .await;
                }
            })
        };
        let (health, health_svc) = tonic_health::server::health_reporter();
        health.set_serving::<InferenceServer<Service>>().await;
        // Both reflection versions: grpcurl and older tools still speak v1alpha. They
        // describe the API, so they take the key as the API does.
        let reflection = InterceptedService::new(tonic_reflection::server::Builder::configure().register_encoded_file_descriptor_set(sluice_proto::FILE_DESCRIPTOR_SET).register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET).build_v1()?, net.auth.clone());
        let reflection_alpha = InterceptedService::new(tonic_reflection::server::Builder::configure().register_encoded_file_descriptor_set(sluice_proto::FILE_DESCRIPTOR_SET).register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET).build_v1alpha()?, net.auth.clone());
        let max = cfg.max_request_bytes.0.min(usize::MAX as u64) as usize;
        let inference = InterceptedService::new(InferenceServer::new(service).max_decoding_message_size(max), net.auth.clone());
        let addr = net.listen.grpc;
        let tcp = net.grpc_tcp;
        let (stop_tx, stop_rx) = net.stop;
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
            std::fs::set_permissions(path, std::os::unix::fs::PermissionsExt::from_mode(0o660)).with_context(|| format!("chmod 0660 {}", path.display()))?;
            if let Some(g) = &cfg.unix_group {
                std::os::unix::fs::chown(path, None, Some(group_id(g)?)).with_context(|| format!("chgrp {g} {}", path.display()))?;
            }
            let router = tonic::transport::Server::builder().add_service(health_svc).add_service(reflection).add_service(reflection_alpha).add_service(inference);
            servers.push(tokio::spawn(router.serve_with_incoming_shutdown(tokio_stream::wrappers::UnixListenerStream::new(ul), shutdown(stop_rx.clone()))));
        }
        tracing::info!(model = %name, %addr, http = ?net.listen.http, unix = ?cfg.unix, auth = net.auth.keys.enabled(), "serving sluice.v1.Inference");
        // READY only now: the model is planned, loaded and the listeners are bound.
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Ready]);

        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
        tokio::select! {
            _ = term.recv() => tracing::info!("SIGTERM: draining"),
            _ = tokio::signal::ctrl_c() => tracing::info!("SIGINT: draining"),
        }
        let _ = sd_notify::notify(false, &[sd_notify::NotifyState::Stopping]);
        // From the first moment of the drain, for the service and for the server as a whole
        // (the "" name load balancers ask about).
        health.set_not_serving::<InferenceServer<Service>>().await;
        health
            .set_service_status("", tonic_health::ServingStatus::NotServing)
            .await;
        net.http_state.set_draining();
        // Stop admitting; in-flight requests finish or are cancelled after the grace period.
        reaper.abort();
        let grace = Duration::from_secs(cfg.shutdown_grace_s);
        let m = models.clone();
        if tokio::task::spawn_blocking(move || m.shutdown(grace)).await.is_err() {
            bail!("stopping the models failed during shutdown");
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
        if let Some(h) = net.http_server {
            match tokio::time::timeout(Duration::from_secs(5), h).await {
                Ok(Ok(Ok(()))) => {}
                Ok(Ok(Err(e))) => tracing::warn!("http server: {e}"),
                Ok(Err(e)) => tracing::warn!("http server task: {e}"),
                Err(_) => tracing::warn!("the http server did not stop within 5 s"),
            }
        }
        if let Some(path) = &cfg.unix {
            let _ = std::fs::remove_file(path);
        }
        tracing::info!("stopped");
        Ok(())
    })
}

/// What the API says of a model loaded as `name` with a context of `context` positions.
fn model_meta(name: &str, m: &sluice::store::Manifest, context: usize) -> ModelMeta {
    ModelMeta {
        name: name.to_string(),
        architecture: m.arch.arch.to_string(),
        layers: m.arch.n_layers,
        hidden: m.arch.hidden,
        vocab: m.arch.vocab,
        context: context as u32,
        trained_context: m.arch.max_context,
        sampling: sluice::engine::sampling_defaults(m),
        stored_bytes: m.stored_bytes(),
        raw_bytes: m.raw_bytes(),
        created: std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
    }
}

/// The prefix cache's disk tier, when `--kv-cache-dir` asks for one and the directory can
/// be had (else a log line says why, and the daemon runs without it).
fn open_kv_disk(cfg: &ServeConfig) -> Option<Arc<sluice::engine::kv_disk::DiskTier>> {
    let dir = cfg.kv_cache_dir.as_ref().filter(|_| cfg.prefix_cache)?;
    match sluice::engine::kv_disk::DiskTier::open(dir, cfg.kv_cache_disk.0) {
        Ok(t) => Some(t),
        Err(e) => {
            tracing::warn!("KV cache on disk off: {e}");
            None
        }
    }
}
