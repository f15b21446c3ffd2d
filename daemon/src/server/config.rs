//! `sluiced serve` configuration: a TOML file (`--config`, default /etc/sluice/sluiced.toml
//! when present) with command-line flags overriding it. deploy/sluiced.toml documents it.

use crate::util::ByteSize;
use serde::Deserialize;
use std::path::{Path, PathBuf};

pub const DEFAULT_CONFIG: &str = "/etc/sluice/sluiced.toml";

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServeConfig {
    /// Store directory (from `sluiced pack`), or a store's name in the models directory:
    /// loaded at start, never unloaded, the default of requests that name no model.
    pub model: Option<PathBuf>,
    /// Every store in this directory is served, loaded by the first request naming it
    /// (default, when `model` is not set: $SLUICE_MODELS_DIR, else
    /// ~/.local/share/sluice/models; the systemd unit's config: /var/lib/sluice/models).
    pub models_dir: Option<PathBuf>,
    /// How long a model from the models directory stays loaded after its last request, as
    /// Ollama's keep_alive ("5m", "30s", "0" unloads at once, "-1" never); requests may
    /// say their own.
    pub keep_alive: String,
    /// TCP address, e.g. "127.0.0.1:50051".
    pub listen: String,
    /// Also serve on this Unix socket.
    pub unix: Option<PathBuf>,
    /// The socket's group (it is created with mode 0660): members may connect.
    pub unix_group: Option<String>,
    /// The OpenAI-compatible HTTP API's address, e.g. "127.0.0.1:8080"; "off" disables it.
    pub http_listen: String,
    /// An API key requests must present (HTTP `Authorization: Bearer KEY`, gRPC
    /// `authorization` metadata). Prefer `api_key_file`: the config may be world-readable.
    pub api_key: Option<String>,
    /// A file of API keys, one per line (`#` comments).
    pub api_key_file: Option<PathBuf>,
    /// Listen beyond loopback without a key (anyone who reaches the port may use it).
    pub insecure_no_auth: bool,
    /// Paths that answer without a key: any of "/health", "/metrics".
    pub public_paths: Vec<String>,
    /// Bytes of one request body (HTTP) or message (gRPC).
    pub max_request_bytes: ByteSize,
    /// Chat messages (or completion prompts) in one request.
    pub max_messages: usize,
    /// Device memory budget, e.g. "8GiB"; unset: every layer resident.
    pub device_memory: Option<ByteSize>,
    /// Host memory for decompressed streamed layers.
    pub host_cache: ByteSize,
    /// Memory the whole daemon may use on the host, e.g. "16GiB" (on the CPU backend the
    /// arena too); unset: 80% of MemAvailable or of the memory cgroup's room.
    pub host_memory: Option<ByteSize>,
    /// Decoder layers computed on the host CPU from host memory beside the GPU, the first
    /// ones (llama.cpp's -ngl counted from the other end); 0: none.
    pub cpu_layers: usize,
    /// "device" (the host computes `cpu_layers`, none by default), "auto" (the host
    /// layers whose predicted pass time at a full batch, `max_batch` rows, is least, from
    /// this machine's rates measured with passes of each model, `sluiced bench-placement`;
    /// then following the rows the passes carry, `engine::replace`) or "auto-once" (chosen
    /// at load and kept: no change stops the engine).
    pub placement: String,
    /// Devices to split each model over, e.g. ["cuda:0", "cuda:1"]: the first streams and
    /// holds the embedding and head (replaces `device`), each other holds a span of the
    /// later layers resident within its free memory. Empty: `device` alone.
    pub devices: Vec<String>,
    /// Shares of the layers after the host's per device of `devices` (empty: in
    /// proportion to their memory budgets).
    pub split: Vec<f64>,
    /// The reference numerics (f32 activations, f32 KV cache).
    pub exact: bool,
    /// KV cache element type, "f16" or "f32" (unset: f16, f32 when exact).
    pub kv_dtype: Option<crate::backend::KvDtype>,
    /// Sequences per pass (KV-cache slots).
    pub max_batch: usize,
    /// Positions per sequence (prompt + generated).
    pub max_context: usize,
    /// Tokens per pass over all sequences (prefill chunk budget).
    pub batch_tokens: usize,
    /// Requests waiting for a slot at most; beyond, RESOURCE_EXHAUSTED.
    pub queue_max: usize,
    /// Layers requested ahead of the one computing.
    pub prefetch: Option<usize>,
    /// Expert-cache slots for a mixture whose layers stream (None: what memory leaves).
    pub expert_cache: Option<usize>,
    /// An expert profile (`sluiced run --save-expert-profile`) for the `model` store.
    pub expert_profile: Option<PathBuf>,
    /// A chat template (a Jinja file) for the `model` store, used instead of its own (a base
    /// model has none; some models ship a wrong one).
    pub chat_template: Option<PathBuf>,
    /// Compute threads of the CPU backend (0: all cores).
    pub threads: usize,
    /// "auto" (CUDA when a usable GPU is there, else the CPU), "cpu" or "cuda".
    pub backend: crate::engine::BackendChoice,
    /// CUDA device ordinal.
    pub device: usize,
    /// max_tokens when a request gives 0.
    pub max_tokens_default: u32,
    /// Seconds in-flight requests get to finish after SIGTERM before they are cancelled.
    pub shutdown_grace_s: u64,
    /// A read the disk has not answered for this long ("30s", "500ms") fails the requests
    /// that need its layer with UNAVAILABLE instead of holding them; "off" waits for ever.
    pub read_timeout: String,
    /// Speculative decoding for every model: "ngram" (prompt lookup), a draft model's
    /// store (a directory or a name in the models directory), used for every model whose
    /// vocabulary it has, or "self:TYPE" (each model drafting with itself, the units it
    /// streams quantized to TYPE); None: off.
    pub draft: Option<String>,
    /// Tokens a sequence drafts for one pass at most.
    pub draft_max: usize,
    /// Verify every proposal whole instead of the rows measured pass times pay for.
    pub draft_fixed: bool,
    /// Branches a drafted token tree may have besides its main chain (0: chains).
    pub draft_branches: usize,
    /// Reuse the KV of prompt prefixes that KV slots still hold (a conversation's earlier
    /// turns, a shared system prompt, `n` choices); false: every prompt is prefilled whole.
    pub prefix_cache: bool,
    /// The prefix cache's host tier: "auto" (a quarter of what the host budget leaves, at
    /// most 1 GiB), a size, or "off" (`plan::KvHostTier`).
    pub kv_cache_host: String,
    /// The prefix cache's disk tier: blocks kept in this directory across restarts (unset:
    /// no disk tier).
    pub kv_cache_dir: Option<std::path::PathBuf>,
    /// What the disk tier may hold.
    pub kv_cache_disk: ByteSize,
}

impl Default for ServeConfig {
    fn default() -> Self {
        ServeConfig {
            model: None,
            models_dir: None,
            keep_alive: "5m".into(),
            listen: "127.0.0.1:50051".into(),
            unix: None,
            unix_group: None,
            http_listen: "127.0.0.1:8080".into(),
            api_key: None,
            api_key_file: None,
            insecure_no_auth: false,
            public_paths: vec!["/health".into(), "/metrics".into()],
            max_request_bytes: ByteSize(8 << 20),
            max_messages: 1024,
            device_memory: None,
            host_cache: ByteSize(0),
            host_memory: None,
            cpu_layers: 0,
            placement: "device".into(),
            devices: Vec::new(),
            split: Vec::new(),
            exact: false,
            kv_dtype: None,
            max_batch: 8,
            max_context: 4096,
            batch_tokens: 512,
            queue_max: 64,
            prefetch: None,
            expert_cache: None,
            expert_profile: None,
            chat_template: None,
            threads: 0,
            backend: crate::engine::BackendChoice::Auto,
            device: 0,
            max_tokens_default: 256,
            shutdown_grace_s: 30,
            read_timeout: "30s".into(),
            draft: None,
            draft_max: crate::engine::draft::DRAFT_MAX_DEFAULT,
            draft_fixed: false,
            draft_branches: 0,
            prefix_cache: true,
            kv_cache_host: "auto".into(),
            kv_cache_dir: None,
            kv_cache_disk: ByteSize(8 << 30),
        }
    }
}

/// `--kv-cache-host`: "auto", "off" (or 0), or a size.
pub fn parse_kv_host(s: &str) -> Result<crate::plan::KvHostTier, String> {
    use crate::plan::KvHostTier;
    match s.trim() {
        "auto" => Ok(KvHostTier::Auto),
        "off" | "0" => Ok(KvHostTier::Off),
        v => v
            .parse::<ByteSize>()
            .map(|b| KvHostTier::Bytes(b.0))
            .map_err(|e| format!("kv_cache_host {v:?}: {e} (or \"auto\", \"off\")")),
    }
}

impl ServeConfig {
    /// Speculative decoding's settings with the drafter `draft` (None: off).
    pub fn draft_config_for(
        &self,
        draft: Option<&str>,
    ) -> Option<crate::engine::draft::DraftConfig> {
        use crate::engine::draft::DraftKind;
        draft.map(|d| crate::engine::draft::DraftConfig {
            kind: DraftKind::of(d),
            max: self.draft_max,
            fixed: self.draft_fixed,
            branches: self.draft_branches,
        })
    }

    /// Drafted tokens one pass may verify over the batch with `draft`: each sequence's
    /// tree, within the pass's token budget (0 without drafting).
    pub fn verify_rows(&self, draft: Option<&crate::engine::draft::DraftConfig>) -> usize {
        draft.map_or(0, |d| {
            d.verify_rows(self.max_batch)
                .min(self.batch_tokens.saturating_sub(self.max_batch))
        })
    }
    /// `read_timeout` parsed: None for "off" (or 0).
    pub fn read_timeout(&self) -> Result<Option<std::time::Duration>, String> {
        let t = self.read_timeout.trim();
        let bad = || {
            format!("read_timeout {t:?}: want a duration such as \"30s\" or \"500ms\", or \"off\"")
        };
        if t == "off" {
            return Ok(None);
        }
        match super::models::parse_keep_alive(t) {
            Ok(Some(super::models::KeepAlive::For(d))) => Ok((!d.is_zero()).then_some(d)),
            _ => Err(bad()),
        }
    }

    /// Reads `path`, or the default file when it exists, or the defaults.
    pub fn load(path: Option<&Path>) -> Result<ServeConfig, String> {
        let (path, required) = match path {
            Some(p) => (p.to_path_buf(), true),
            None => (PathBuf::from(DEFAULT_CONFIG), false),
        };
        match std::fs::read_to_string(&path) {
            Ok(text) => toml::from_str(&text).map_err(|e| format!("{}: {e}", path.display())),
            Err(e) if !required && e.kind() == std::io::ErrorKind::NotFound => {
                Ok(ServeConfig::default())
            }
            Err(e) => Err(format!("read {}: {e}", path.display())),
        }
    }

    /// Relations between limits, each with its reason.
    pub fn validate(&self) -> Result<(), String> {
        if self.max_batch == 0 || self.max_context < 2 || self.queue_max == 0 {
            return Err(
                "max_batch and queue_max must be at least 1, max_context at least 2".into(),
            );
        }
        // Every decoding sequence puts one token in each pass.
        if self.batch_tokens < self.max_batch {
            return Err(format!("batch_tokens ({}) must be at least max_batch ({}): each decoding sequence adds a token to every pass", self.batch_tokens, self.max_batch));
        }
        if let Some(p) = self
            .public_paths
            .iter()
            .find(|p| !matches!(p.as_str(), "/health" | "/metrics"))
        {
            return Err(format!(
                "public_paths: {p:?} cannot be public; only \"/health\" and \"/metrics\" can"
            ));
        }
        super::models::parse_keep_alive(&self.keep_alive)?;
        self.read_timeout()?;
        match (self.placement.as_str(), self.cpu_layers) {
            ("device", _) => {}
            ("auto" | "auto-once", 0) => {}
            (p @ ("auto" | "auto-once"), n) => {
                return Err(format!(
                    "placement {p:?} chooses the host layers itself: leave out cpu_layers ({n})"
                ))
            }
            (p, _) => {
                return Err(format!(
                    "placement {p:?}: expected \"device\", \"auto\" or \"auto-once\""
                ))
            }
        }
        if self.max_request_bytes.0 < 1024 || self.max_messages == 0 {
            return Err(
                "max_request_bytes must be at least 1KiB and max_messages at least 1".into(),
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_documented_example_config_parses_and_unknown_keys_are_refused() {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../deploy/sluiced.toml"
        ))
        .expect("test setup");
        let c: ServeConfig = toml::from_str(&text).expect("test setup");
        c.validate().expect("test setup");
        assert!(c.model.is_some());
        let e = toml::from_str::<ServeConfig>("max_bacth = 3")
            .unwrap_err()
            .to_string();
        assert!(e.contains("max_bacth"), "{e}");
        // Sizes parse as the flags do, and say what is wrong when they do not.
        let c: ServeConfig = toml::from_str("device_memory = \"1.5GiB\"\nhost_cache = 4096")
            .expect("sizes as text and as a number");
        assert_eq!(c.device_memory, Some(ByteSize(3 << 29)));
        assert_eq!(c.host_cache, ByteSize(4096));
        let e = toml::from_str::<ServeConfig>("device_memory = \"12 parsecs\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("unknown unit"), "{e}");
    }

    #[test]
    fn a_placement_is_device_or_auto_and_auto_takes_no_cpu_layers() {
        let parse = |t: &str| toml::from_str::<ServeConfig>(t).expect("parses");
        assert!(parse("placement = \"auto\"").validate().is_ok());
        assert!(parse("placement = \"auto-once\"").validate().is_ok());
        let e = parse("placement = \"auto-once\"\ncpu_layers = 2")
            .validate()
            .unwrap_err();
        assert!(
            e.contains("auto-once") && e.contains("cpu_layers (2)"),
            "{e}"
        );
        assert!(parse("placement = \"device\"\ncpu_layers = 4")
            .validate()
            .is_ok());
        let e = parse("placement = \"auto\"\ncpu_layers = 4")
            .validate()
            .unwrap_err();
        assert!(e.contains("leave out cpu_layers (4)"), "{e}");
        let e = parse("placement = \"gpu\"").validate().unwrap_err();
        assert!(e.contains("\"device\", \"auto\" or \"auto-once\""), "{e}");
    }
}
