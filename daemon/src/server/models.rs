//! The models one daemon serves: its `--model` (loaded at start and never unloaded) and
//! every store in its models directory (listed with what its manifest says; loaded by the
//! first request that names it). A loaded model is one `Served`: its own plan, pipeline,
//! scheduler and engine thread. Loading plans the model beside the ones already loaded;
//! when it would not fit whole (its plan streams, or fails) idle models are unloaded,
//! least recently used first, until it does or none is left. An idle model unloads when
//! its keep-alive (the last request's `keep_alive`, else the daemon's default) runs out.
//!
//! One lock guards the table; loads run one at a time on a blocking thread, so a client
//! that goes away mid-load does not leave the table half-changed, and the requests that
//! wait for a model being loaded are woken when it is.

use super::api::{ApiError, ErrorKind, Frontend, Hold};
use super::metrics::Static;
use crate::plan::Plan;
use crate::store::Store;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long an idle model stays loaded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KeepAlive {
    Forever,
    /// Zero: unload as soon as the model is idle.
    For(Duration),
}

impl std::fmt::Display for KeepAlive {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KeepAlive::Forever => f.write_str("forever"),
            KeepAlive::For(d) => write!(f, "{} s", d.as_secs_f64()),
        }
    }
}

/// Ollama's keep_alive: a duration ("30s", "5m", "1h30m", "250ms"), a number of seconds,
/// a negative one for ever. Empty: None (the default applies).
pub fn parse_keep_alive(s: &str) -> Result<Option<KeepAlive>, String> {
    let t = s.trim();
    if t.is_empty() {
        return Ok(None);
    }
    let bad = || {
        format!("keep_alive {s:?}: want a duration such as \"30s\", \"5m\", \"1h\", a number of seconds, or a negative one to keep the model loaded")
    };
    if let Some(rest) = t.strip_prefix('-') {
        if rest.starts_with(['-', '+']) {
            return Err(bad());
        }
        // Any negative duration or number keeps the model loaded.
        return parse_keep_alive(rest)
            .map_err(|_| bad())
            .map(|_| Some(KeepAlive::Forever));
    }
    if let Ok(secs) = t.parse::<f64>() {
        return if secs.is_finite() && secs <= 1e9 {
            Ok(Some(KeepAlive::For(Duration::from_secs_f64(secs))))
        } else {
            Err(bad())
        };
    }
    let mut total = 0f64;
    let mut rest = t;
    while !rest.is_empty() {
        let n = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(bad)?;
        let value: f64 = rest[..n].parse().map_err(|_| bad())?;
        rest = &rest[n..];
        let u = rest
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(rest.len());
        let scale = match &rest[..u] {
            "ms" => 1e-3,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(bad()),
        };
        total += value * scale;
        rest = &rest[u..];
    }
    if total > 1e9 {
        return Err(bad());
    }
    Ok(Some(KeepAlive::For(Duration::from_secs_f64(total))))
}

/// What a store's manifest says, read without loading it.
#[derive(Clone, Debug, Default)]
pub struct StoreInfo {
    pub architecture: String,
    pub layers: u32,
    pub hidden: u32,
    pub vocab: u32,
    pub trained_context: u32,
    pub stored_bytes: u64,
    pub raw_bytes: u64,
    /// The file type the source declares (a GGUF's `general.file_type`: `Q4_K_M`), else
    /// the type of most weight matrices (`Q4_K`, `BF16`, ...).
    pub quantization: String,
}

impl StoreInfo {
    pub fn read(dir: &Path) -> Result<StoreInfo, String> {
        let store = Store::open(dir).map_err(|e| e.to_string())?;
        let m = store.manifest();
        // The type most weight matrices have: a K-quant mix such as Q4_K_M is mostly Q4_K,
        // though its embedding (often the largest tensor) may be Q6_K or Q8_0.
        let mut by_type: BTreeMap<String, usize> = BTreeMap::new();
        for t in m.units.iter().flat_map(|u| &u.tensors) {
            if t.shape.len() >= 2 && !t.name.contains("embed") {
                *by_type.entry(t.dtype.ggml_name()).or_default() += 1;
            }
        }
        let quantization = m.meta.file_type.clone().unwrap_or_else(|| {
            by_type
                .into_iter()
                .max_by_key(|(_, b)| *b)
                .map(|(t, _)| t)
                .unwrap_or_default()
        });
        Ok(StoreInfo {
            architecture: m.arch.arch.to_string(),
            layers: m.arch.n_layers,
            hidden: m.arch.hidden,
            vocab: m.arch.vocab,
            trained_context: m.arch.max_context,
            stored_bytes: m.stored_bytes(),
            raw_bytes: m.raw_bytes(),
            quantization,
        })
    }
}

/// One loaded model.
pub struct Served {
    pub front: Arc<Frontend>,
    pub plan: Plan,
    /// Placement "auto"'s choice (None: as configured).
    pub placement: Option<crate::plan::placement::Choice>,
    pub stat: Static,
    pub backend: String,
    pub numerics: &'static str,
    /// `engine::int_dots_for`.
    pub int_dots: &'static str,
    pub kv_dtype: crate::backend::KvDtype,
    pub max_batch: usize,
    pub engine: Mutex<Option<std::thread::JoinHandle<()>>>,
}

impl Served {
    /// Device bytes its plan takes (on the CPU backend, the arena).
    pub fn device_bytes(&self) -> u64 {
        self.plan.device_bytes()
    }

    /// Stops admission, lets admitted requests finish within `grace`, joins the engine.
    pub fn stop(&self, grace: Duration) {
        self.front.sched.shutdown(grace);
        let h = lock(&self.engine).take();
        if let Some(h) = h {
            if h.join().is_err() {
                tracing::error!(model = %self.front.meta.name, "the engine thread panicked");
            }
        }
    }
}

/// Builds what a model needs on the daemon's backend; `serve.rs` has the one used.
pub trait Loader: Send + Sync {
    /// The plan `dir` would get if it loaded now within `device_room` (None: the backend's
    /// default), without loading it.
    fn plan(&self, dir: &Path, device_room: Option<u64>) -> Result<Plan, String>;
    /// Loads `dir` as the model `name`.
    fn load(&self, name: &str, dir: &Path, device_room: Option<u64>) -> Result<Served, String>;
}

enum State {
    Unloaded,
    Loading,
    Loaded(Arc<Served>),
}

struct Entry {
    dir: PathBuf,
    info: StoreInfo,
    pinned: bool,
    state: State,
    keep_alive: KeepAlive,
    /// Why the last load failed (said to the requests that waited for it).
    last_error: Option<String>,
}

impl Entry {
    fn served(&self) -> Option<&Arc<Served>> {
        match &self.state {
            State::Loaded(s) => Some(s),
            _ => None,
        }
    }

    /// Takes the loaded model out (the entry becomes unloaded); None if it was not loaded.
    fn take_served(&mut self) -> Option<Arc<Served>> {
        match std::mem::replace(&mut self.state, State::Unloaded) {
            State::Loaded(s) => Some(s),
            other => {
                self.state = other;
                None
            }
        }
    }
}

/// What a listing shows of one model.
#[derive(Clone, Debug)]
pub struct Listing {
    pub name: String,
    pub dir: PathBuf,
    pub info: StoreInfo,
    pub loaded: bool,
    pub pinned: bool,
    pub device_bytes: u64,
    pub host_bytes: u64,
    /// None: stays loaded (pinned, kept for ever, or busy); only for a loaded model.
    pub unload_in: Option<Duration>,
    pub active_requests: usize,
    /// KV bytes its prefix cache keeps in KV slots, in its host tier and on disk (0 when
    /// not loaded).
    pub prefix_cache_bytes: u64,
    pub kv_host_bytes: u64,
    pub kv_disk_bytes: u64,
    /// Unix seconds the model was found (OpenAI's `created`).
    pub created: u64,
}

pub struct ModelsConfig {
    /// Every store under this directory is served (None: only the pinned model).
    pub dir: Option<PathBuf>,
    pub keep_alive: KeepAlive,
    /// Device bytes all loaded models' plans share (None: each plans with the backend's
    /// default, which sees what the others took).
    pub device_total: Option<u64>,
    /// What `Status` reports of a model that is not loaded.
    pub max_batch: usize,
    pub max_context: usize,
    pub backend: String,
}

pub struct Models {
    table: Mutex<BTreeMap<String, Entry>>,
    /// Bumped whenever a model's state changes; waiters for a load watch it.
    changed: tokio::sync::watch::Sender<u64>,
    /// Loads (and the unloads that make room for them) one at a time.
    loading: Mutex<()>,
    loader: Box<dyn Loader>,
    pub cfg: ModelsConfig,
    created: u64,
    /// Shutdown began: nothing more is loaded.
    stopping: std::sync::atomic::AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A panic while holding the lock leaves the table as it was at the panic; keep serving.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The store directories under `dir` (each a directory with a manifest), by name.
fn scan(dir: &Path) -> Vec<(String, PathBuf)> {
    let Ok(rd) = std::fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<(String, PathBuf)> = rd
        .filter_map(Result::ok)
        .filter_map(|e| {
            let p = e.path();
            let name = e.file_name().to_str()?.to_string();
            (!name.starts_with('.') && p.join(crate::store::format::MANIFEST_FILE).is_file())
                .then_some((name, p))
        })
        .collect();
    out.sort();
    out
}

impl Models {
    pub fn new(cfg: ModelsConfig, loader: Box<dyn Loader>) -> Result<Arc<Models>, String> {
        if let Some(d) = &cfg.dir {
            if !d.is_dir() {
                return Err(format!(
                    "models directory {}: not a directory (create it, or pack a model into it with `sluiced pack SRC --name NAME`)",
                    d.display()
                ));
            }
        }
        let m = Arc::new(Models {
            table: Mutex::new(BTreeMap::new()),
            changed: tokio::sync::watch::channel(0).0,
            loading: Mutex::new(()),
            loader,
            cfg,
            created: unix_now(),
            stopping: Default::default(),
        });
        m.refresh();
        Ok(m)
    }

    /// Adds the daemon's `--model`, loaded, never unloaded.
    pub fn pin(&self, name: &str, dir: PathBuf, info: StoreInfo, served: Served) {
        let mut t = lock(&self.table);
        t.insert(
            name.to_string(),
            Entry {
                dir,
                info,
                pinned: true,
                state: State::Loaded(Arc::new(served)),
                keep_alive: KeepAlive::Forever,
                last_error: None,
            },
        );
        drop(t);
        self.bump();
    }

    fn bump(&self) {
        self.changed.send_modify(|g| *g = g.wrapping_add(1));
    }

    /// Rescans the models directory: stores packed since appear, removed ones that are not
    /// loaded go.
    pub fn refresh(&self) {
        let Some(dir) = &self.cfg.dir else { return };
        let found = scan(dir);
        let mut t = lock(&self.table);
        t.retain(|name, e| {
            e.pinned || !matches!(e.state, State::Unloaded) || found.iter().any(|(n, _)| n == name)
        });
        for (name, path) in found {
            if t.contains_key(&name) {
                continue;
            }
            match StoreInfo::read(&path) {
                Ok(info) => {
                    t.insert(
                        name,
                        Entry {
                            dir: path,
                            info,
                            pinned: false,
                            state: State::Unloaded,
                            keep_alive: self.cfg.keep_alive,
                            last_error: None,
                        },
                    );
                }
                Err(e) => tracing::warn!("models directory: {} is not served: {e}", path.display()),
            }
        }
    }

    /// The name a request means: its own, else the pinned model, else the one loaded, else
    /// the only one there is.
    fn name_of(&self, t: &BTreeMap<String, Entry>, model: &str) -> Result<String, ApiError> {
        if !model.is_empty() {
            if t.contains_key(model) {
                return Ok(model.to_string());
            }
            return Err(ApiError {
                kind: ErrorKind::ModelNotFound,
                message: format!(
                    "the model {model:?} is not served here; this daemon serves {} (GET /v1/models, `sluice models`{})",
                    names(t),
                    match &self.cfg.dir {
                        Some(d) => format!("; pack it into {} with `sluiced pack SRC --name {model}`", d.display()),
                        None => String::new(),
                    }
                ),
                param: Some("model"),
            });
        }
        if let Some((n, _)) = t.iter().find(|(_, e)| e.pinned) {
            return Ok(n.clone());
        }
        // Without a default (--model), a request that names no model goes nowhere unless the
        // daemon serves just one: which model happens to be loaded depends on keep-alive
        // timing, so it decides nothing.
        if t.len() == 1 {
            if let Some(n) = t.keys().next() {
                return Ok(n.clone());
            }
        }
        Err(ApiError::invalid(
            Some("model"),
            if t.is_empty() {
                match &self.cfg.dir {
                    Some(d) => format!("no model is served: {} holds no store; pack one into it with `sluiced pack SRC --name NAME`", d.display()),
                    None => "no model is served".to_string(),
                }
            } else {
                format!("name a model (\"model\" in the request, `sluice --model NAME`): this daemon serves {} and has no default (`sluiced serve --model NAME` sets one)", names(t))
            },
        ))
    }

    /// The loaded model a request names, loading it first when it is not (and waiting while
    /// another request loads it). The hold keeps it loaded until dropped; `keep_alive`
    /// becomes the model's keep-alive from now on.
    pub async fn resolve(
        self: &Arc<Self>,
        model: &str,
        keep_alive: Option<KeepAlive>,
    ) -> Result<(Arc<Served>, Hold), ApiError> {
        if !model.is_empty() && !lock(&self.table).contains_key(model) {
            self.refresh();
        }
        enum Next {
            Load(String, PathBuf),
            Wait,
        }
        let mut waited = false;
        loop {
            let mut rx = self.changed.subscribe();
            let next = {
                let mut t = lock(&self.table);
                let name = self.name_of(&t, model)?;
                let Some(e) = t.get_mut(&name) else {
                    return Err(ApiError::new(
                        ErrorKind::Internal,
                        "the model table changed",
                    ));
                };
                if let (Some(k), false) = (keep_alive, e.pinned) {
                    e.keep_alive = k;
                }
                match &e.state {
                    State::Loaded(s) => {
                        let hold = s.front.usage.hold();
                        return Ok((s.clone(), hold));
                    }
                    State::Loading => Next::Wait,
                    State::Unloaded if self.stopping.load(std::sync::atomic::Ordering::Acquire) => {
                        return Err(ApiError::new(
                            ErrorKind::Unavailable,
                            "the daemon is shutting down",
                        ));
                    }
                    State::Unloaded => {
                        // A load this request waited for failed: say why rather than retry.
                        if let (Some(err), true) = (&e.last_error, waited) {
                            return Err(load_failed(&name, err));
                        }
                        e.state = State::Loading;
                        e.last_error = None;
                        Next::Load(name, e.dir.clone())
                    }
                }
            };
            match next {
                Next::Load(name, dir) => {
                    let me = self.clone();
                    // The load finishes and is recorded even if this request goes away.
                    let _ =
                        tokio::task::spawn_blocking(move || me.load_blocking(&name, &dir)).await;
                }
                Next::Wait => {
                    let _ = rx.changed().await;
                }
            }
            waited = true;
        }
    }

    /// Device bytes left beside the loaded models other than `name`.
    fn device_room(&self, name: &str) -> Option<u64> {
        let total = self.cfg.device_total?;
        let used: u64 = lock(&self.table)
            .iter()
            .filter(|(n, _)| n.as_str() != name)
            .filter_map(|(_, e)| e.served().map(|s| s.device_bytes()))
            .sum();
        Some(total.saturating_sub(used))
    }

    /// The idle loaded model used least recently (not pinned, not `except`), taken out of
    /// the table.
    fn take_lru_idle(&self, except: &str) -> Option<(String, Arc<Served>)> {
        let mut t = lock(&self.table);
        let victim = t
            .iter()
            .filter(|(n, e)| n.as_str() != except && !e.pinned)
            .filter_map(|(n, e)| e.served().map(|s| (s, n)))
            .filter(|(s, _)| s.front.usage.active() == 0)
            .map(|(s, n)| (s.front.usage.idle_since(), n.clone()))
            .min()?
            .1;
        let s = t.get_mut(&victim)?.take_served()?;
        Some((victim, s))
    }

    fn unload(&self, name: &str, s: Arc<Served>, why: &str) {
        tracing::info!(model = %name, "unloading: {why}");
        s.stop(Duration::ZERO);
        drop(s);
        // The arena and buffers went back to the allocator; give the heap back too, so
        // the next plan measures what is really in use.
        // SAFETY: malloc_trim only returns free heap pages to the kernel.
        unsafe {
            libc::malloc_trim(0);
        }
        self.bump();
    }

    fn load_blocking(&self, name: &str, dir: &Path) -> Option<(Arc<Served>, Hold)> {
        let _one = lock(&self.loading);
        // Make room: while the model would not be whole beside the loaded ones, unload the
        // idle one used least recently.
        loop {
            let room = self.device_room(name);
            let why = match self.loader.plan(dir, room) {
                Ok(p) if p.layers_streamed() == 0 => break,
                Ok(p) => format!(
                    "{name} would stream {} of its units beside it",
                    p.layers_streamed()
                ),
                Err(e) => format!("{name} does not fit beside it ({e})"),
            };
            match self.take_lru_idle(name) {
                Some((victim, s)) => self.unload(&victim, s, &why),
                None => break,
            }
        }
        let t0 = Instant::now();
        let r = self.loader.load(name, dir, self.device_room(name));
        let mut t = lock(&self.table);
        let mut held = None;
        if let Some(e) = t.get_mut(name) {
            match r {
                Ok(s) => {
                    tracing::info!(model = %name, seconds = t0.elapsed().as_secs_f64(), keep_alive = %e.keep_alive, "loaded");
                    let s = Arc::new(s);
                    held = Some((s.clone(), s.front.usage.hold()));
                    e.state = State::Loaded(s);
                }
                Err(err) => {
                    tracing::warn!(model = %name, "load failed: {err}");
                    e.state = State::Unloaded;
                    e.last_error = Some(err);
                }
            }
        }
        drop(t);
        self.bump();
        held
    }

    /// Unloads the idle models whose keep-alive ran out; run it every fraction of a second.
    pub fn reap(&self) {
        let now = Instant::now();
        let expired: Vec<(String, Arc<Served>)> = {
            let mut t = lock(&self.table);
            let names: Vec<String> = t
                .iter()
                .filter(|(_, e)| !e.pinned)
                .filter_map(|(n, e)| match (e.served(), e.keep_alive) {
                    (Some(s), KeepAlive::For(k))
                        if s.front.usage.active() == 0 && now >= s.front.usage.idle_since() + k =>
                    {
                        Some(n.clone())
                    }
                    _ => None,
                })
                .collect();
            names
                .into_iter()
                .filter_map(|n| {
                    let s = t.get_mut(&n)?.take_served()?;
                    Some((n, s))
                })
                .collect()
        };
        for (n, s) in expired {
            self.unload(&n, s, "its keep-alive ran out");
        }
    }

    /// The loaded model `model` means, if it is loaded (never loads).
    pub fn loaded(&self, model: &str) -> Result<(String, Option<Arc<Served>>), ApiError> {
        let t = lock(&self.table);
        let name = self.name_of(&t, model)?;
        let s = t.get(&name).and_then(Entry::served).cloned();
        Ok((name, s))
    }

    /// The loaded models `model` names: all of them for "", else the one it means when it
    /// is loaded (none when it is not; an unknown name is an error).
    pub fn loaded_now(&self, model: &str) -> Result<Vec<(String, Arc<Served>)>, ApiError> {
        if !model.is_empty() {
            let (name, s) = self.loaded(model)?;
            return Ok(s.map(|s| (name, s)).into_iter().collect());
        }
        Ok(lock(&self.table)
            .iter()
            .filter_map(|(n, e)| Some((n.clone(), e.served()?.clone())))
            .collect())
    }

    /// Empties the prefix cache of the loaded models `model` names ("": every loaded model),
    /// both wires' `cache clear`: per model, the positions of KV it gave up. Each engine does
    /// it between two steps; one that does not within 30 s answers UNAVAILABLE.
    pub async fn clear_prefix_caches(&self, model: &str) -> Result<Vec<(String, u64)>, ApiError> {
        let mut out = Vec::new();
        for (name, served) in self.loaded_now(model)? {
            let sched = &served.front.sched;
            let ticket = sched.ask_clear();
            let t0 = std::time::Instant::now();
            let dropped = loop {
                if let Some(n) = sched.clear_done(ticket) {
                    break n;
                }
                if t0.elapsed() > std::time::Duration::from_secs(30) {
                    return Err(ApiError::new(
                        super::api::ErrorKind::Unavailable,
                        format!("{name}: the engine did not empty its prefix cache within 30 s"),
                    ));
                }
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            };
            out.push((name, dropped));
        }
        Ok(out)
    }

    /// Every model (or only the loaded ones), by name.
    pub fn list(&self, loaded_only: bool) -> Vec<Listing> {
        self.refresh();
        let now = Instant::now();
        lock(&self.table)
            .iter()
            .filter_map(|(name, e)| {
                let served = e.served();
                if loaded_only && served.is_none() {
                    return None;
                }
                let active = served.map_or(0, |s| s.front.usage.active());
                let unload_in = match (served, e.keep_alive, e.pinned) {
                    (Some(s), KeepAlive::For(k), false) if active == 0 => {
                        Some((s.front.usage.idle_since() + k).saturating_duration_since(now))
                    }
                    _ => None,
                };
                let prefix = served
                    .map(|s| s.front.sched.status().prefix_cache)
                    .unwrap_or_default();
                Some(Listing {
                    name: name.clone(),
                    dir: e.dir.clone(),
                    info: e.info.clone(),
                    loaded: served.is_some(),
                    pinned: e.pinned,
                    device_bytes: served.map_or(0, |s| s.device_bytes()),
                    host_bytes: served.map_or(0, |s| s.plan.host.total_bytes),
                    unload_in,
                    active_requests: active,
                    prefix_cache_bytes: prefix.kept_bytes,
                    kv_host_bytes: prefix.tiers.host_bytes,
                    kv_disk_bytes: prefix.tiers.disk.bytes,
                    created: self.created,
                })
            })
            .collect()
    }

    /// How many models are loaded (no directory rescan: metrics ask on every scrape).
    pub fn loaded_count(&self) -> usize {
        lock(&self.table)
            .values()
            .filter(|e| e.served().is_some())
            .count()
    }

    /// The loaded model to describe when none is named (metrics): the default, else the one
    /// used last.
    pub fn current(&self) -> Option<Arc<Served>> {
        if let Ok((_, Some(s))) = self.loaded("") {
            return Some(s);
        }
        lock(&self.table)
            .values()
            .filter_map(Entry::served)
            .max_by_key(|s| s.front.usage.idle_since())
            .cloned()
    }

    /// Stops every loaded model: admission ends, admitted requests get `grace` to finish.
    pub fn shutdown(&self, grace: Duration) {
        self.stopping
            .store(true, std::sync::atomic::Ordering::Release);
        // A load in progress finishes first (and is stopped with the rest).
        drop(lock(&self.loading));
        let all: Vec<Arc<Served>> = lock(&self.table)
            .values()
            .filter_map(Entry::served)
            .cloned()
            .collect();
        for s in &all {
            s.front.sched.shutdown(grace);
        }
        for s in &all {
            s.stop(grace);
        }
    }
}

fn names(t: &BTreeMap<String, Entry>) -> String {
    t.keys()
        .map(|n| format!("{n:?}"))
        .collect::<Vec<_>>()
        .join(", ")
}

fn load_failed(name: &str, err: &str) -> ApiError {
    ApiError::new(
        ErrorKind::Unavailable,
        format!("the model {name:?} could not be loaded: {err}"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keep_alive_durations() {
        let d = |s: f64| Ok(Some(KeepAlive::For(Duration::from_secs_f64(s))));
        assert_eq!(parse_keep_alive(""), Ok(None));
        assert_eq!(parse_keep_alive("0"), d(0.0));
        assert_eq!(parse_keep_alive("30"), d(30.0));
        assert_eq!(parse_keep_alive("1.5"), d(1.5));
        assert_eq!(parse_keep_alive("30s"), d(30.0));
        assert_eq!(parse_keep_alive("5m"), d(300.0));
        assert_eq!(parse_keep_alive("1h30m"), d(5400.0));
        assert_eq!(parse_keep_alive("250ms"), d(0.25));
        assert_eq!(parse_keep_alive("-1"), Ok(Some(KeepAlive::Forever)));
        assert_eq!(parse_keep_alive("-5m"), Ok(Some(KeepAlive::Forever)));
        for bad in ["5x", "m", "1e99", "five", "--1", "1h 30m"] {
            assert!(parse_keep_alive(bad).is_err(), "{bad}");
        }
    }
}
