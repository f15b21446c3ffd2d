//! `sluiced serve`'s command line: every flag, each overriding its config file key
//! (`ServeArgs::config`).

use anyhow::Result;
use sluice::engine::BackendChoice;
use sluice::util::ByteSize;
use std::path::PathBuf;

#[derive(clap::Args)]
pub struct ServeArgs {
    /// A store directory (from `sluiced pack`), or a store's name in the models directory:
    /// loaded at start, never unloaded, the model of requests that name none.
    #[arg(long)]
    pub model: Option<PathBuf>,
    /// Serve every store in this directory, each loaded by the first request that names it
    /// (default without --model: $SLUICE_MODELS_DIR, else ~/.local/share/sluice/models).
    #[arg(long)]
    pub models_dir: Option<PathBuf>,
    /// How long a model from the models directory stays loaded after its last request
    /// ("30s", "5m", "1h"; "0" unloads it at once, "-1" never; default 5m); a request's
    /// keep_alive overrides it.
    #[arg(long, allow_hyphen_values = true)]
    pub keep_alive: Option<String>,
    /// Config file (default /etc/sluice/sluiced.toml when it exists); flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// TCP address to listen on (default 127.0.0.1:50051).
    #[arg(long)]
    pub listen: Option<String>,
    /// Also serve on this Unix socket (mode 0660).
    #[arg(long)]
    pub unix: Option<PathBuf>,
    /// The Unix socket's group: its members may connect.
    #[arg(long)]
    pub unix_group: Option<String>,
    /// The OpenAI-compatible HTTP API's address (default 127.0.0.1:8080; "off" disables it).
    #[arg(long)]
    pub http_listen: Option<String>,
    /// An API key clients must send (HTTP `Authorization: Bearer KEY`, gRPC `authorization`
    /// metadata). The environment keeps it out of `ps`.
    #[arg(long, env = "SLUICE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// A file of API keys, one per line.
    #[arg(long)]
    pub api_key_file: Option<PathBuf>,
    /// Listen beyond loopback without an API key: anyone who reaches the port may use it.
    #[arg(long)]
    pub insecure_no_auth: bool,
    /// Paths that answer without a key, comma-separated (default /health,/metrics; "" for
    /// none).
    #[arg(long, value_delimiter = ',')]
    pub public_paths: Option<Vec<String>>,
    /// Bytes of one request body (HTTP) or message (gRPC) at most (default 8MiB).
    #[arg(long, value_parser = parse_byte_size)]
    pub max_request_bytes: Option<ByteSize>,
    /// Chat messages (or completion prompts) in one request at most (default 1024).
    #[arg(long)]
    pub max_messages: Option<usize>,
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
    /// Decoder layers to compute on the host CPU from host memory beside the GPU, the
    /// first ones (llama.cpp's -ngl counted from the other end): their weights, KV cache
    /// and workspace take host memory instead of device memory (default 0).
    #[arg(long)]
    pub cpu_layers: Option<usize>,
    /// "device" (the host computes --cpu-layers, none by default), "auto" (the host
    /// layers whose predicted pass time at a full batch is least, from this machine's
    /// rates measured with passes of each model and kept in $SLUICE_CACHE/placement, then
    /// changed as the batch changes) or "auto-once" (chosen at load and kept).
    #[arg(long)]
    pub placement: Option<String>,
    /// Devices to split each model over, the first the one that streams and holds the
    /// embedding and head (e.g. cuda:0,cuda:1; replaces --device): each other device
    /// holds a span of the later layers resident within its free memory.
    #[arg(long, value_delimiter = ',')]
    pub devices: Option<Vec<String>>,
    /// Shares of the layers after the host's per device of --devices, in order (e.g. 3,1;
    /// default: in proportion to their memory budgets).
    #[arg(long, value_delimiter = ',')]
    pub split: Option<Vec<f64>>,
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
    /// Expert-cache slots for a mixture of experts whose layers stream (each holds one
    /// expert; default: as many as the memory left after the plan holds).
    #[arg(long)]
    pub expert_cache: Option<usize>,
    /// An expert profile (`sluiced run --save-expert-profile`) for the --model store: its
    /// expert cache starts with the hottest experts, part of it pinned.
    #[arg(long, value_name = "PATH")]
    pub expert_profile: Option<PathBuf>,
    /// A chat template (a Jinja file) for the --model store, used instead of its own: a base
    /// model has none, and some models ship a wrong one. Generation also ends at the
    /// end-of-turn tokens it uses.
    #[arg(long, value_name = "FILE")]
    pub chat_template: Option<PathBuf>,
    /// Compute threads of the CPU backend (default 0: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
    /// auto (CUDA when a usable GPU is there, else the CPU, saying why), cpu or cuda.
    #[arg(long)]
    pub backend: Option<BackendChoice>,
    /// CUDA device ordinal (default 0).
    #[arg(long)]
    pub device: Option<usize>,
    /// Tokens a request generates when it does not say (gRPC max_tokens 0, an OpenAI
    /// chat request without max_tokens); cut to the room the context leaves (default 256).
    #[arg(long)]
    pub max_tokens_default: Option<u32>,
    /// Seconds in-flight requests get to finish after SIGTERM before they are cancelled
    /// (default 30).
    #[arg(long)]
    pub shutdown_grace_s: Option<u64>,
    /// The reference numerics: f32 activations and an f32 KV cache (default: 8-bit
    /// activations for decode rows, 16-bit into the output head, f16 KV cache).
    #[arg(long)]
    pub exact: bool,
    /// KV cache element type (default f16; f32 under --exact).
    #[arg(long)]
    pub kv_dtype: Option<sluice::backend::KvDtype>,
    /// A read the disk has not answered for this long fails the requests that need its
    /// layer with UNAVAILABLE ("30s" by default, "500ms", "off" to wait for ever).
    #[arg(long)]
    pub read_timeout: Option<String>,
    /// Speculative decoding: `ngram` drafts each sequence's next tokens by prompt lookup
    /// (its own prompt and text); a store (a directory, or a name in the models directory)
    /// drafts them with that model, loaded whole beside each model whose vocabulary it has
    /// (a quantized copy: `sluiced pack --quantize`); `self:TYPE` drafts each model with
    /// itself, the units it streams from a resident copy quantized to TYPE (made once, in
    /// the cache directory). Each pass verifies the drafts with the batch; outputs are the
    /// model's own, token for token (default: off).
    #[arg(long, value_name = "ngram|STORE|self:TYPE")]
    pub draft: Option<String>,
    /// Tokens a sequence drafts for one pass at most (default 8).
    #[arg(long)]
    pub draft_max: Option<usize>,
    /// Verify every proposal whole (up to --draft-max) instead of the rows that measured
    /// pass times pay for: for experiments.
    #[arg(long)]
    pub draft_fixed: bool,
    /// Draft token trees: up to N other continuations per sequence besides its main chain,
    /// verified in the same pass (default 0: chains).
    #[arg(long, value_name = "N")]
    pub draft_branches: Option<usize>,
    /// Reuse the KV of prompt prefixes that KV slots still hold: a conversation's earlier
    /// turns, a system prompt or template shared by requests, a call's `n` choices
    /// (default on; `off` prefills every prompt whole, for comparison).
    #[arg(long, value_name = "on|off", value_parser = crate::util::parse_on_off)]
    pub prefix_cache: Option<bool>,
    /// Host memory for prompt KV blocks that left the KV slots, inside --host-memory:
    /// "auto" (default: a quarter of what the budget leaves, at most 1 GiB), a size, or
    /// "off".
    #[arg(long, value_name = "SIZE|auto|off")]
    pub kv_cache_host: Option<String>,
    /// Keep prompt KV blocks in this directory too, across restarts (a resumed
    /// conversation prefills only its new turn). One daemon per directory.
    #[arg(long, value_name = "DIR")]
    pub kv_cache_dir: Option<PathBuf>,
    /// What --kv-cache-dir may hold (default 8GiB); the least recently used go first.
    #[arg(long, value_name = "SIZE", value_parser = parse_byte_size)]
    pub kv_cache_disk: Option<ByteSize>,
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
            http_listen,
            max_tokens_default,
            max_request_bytes,
            max_messages,
            max_batch,
            max_context,
            batch_tokens,
            cpu_layers,
            placement,
            devices,
            split,
            queue_max,
            threads,
            shutdown_grace_s,
            host_cache,
            backend,
            device,
            draft_max,
            draft_branches,
            prefix_cache,
            kv_cache_host,
            kv_cache_disk
        );
        if self.kv_cache_dir.is_some() {
            c.kv_cache_dir = self.kv_cache_dir;
        }
        sluice::server::config::parse_kv_host(&c.kv_cache_host).map_err(anyhow::Error::msg)?;
        if self.draft.is_some() {
            c.draft = self.draft;
        }
        c.draft_fixed |= self.draft_fixed;
        if self.model.is_some() {
            c.model = self.model;
        }
        if self.models_dir.is_some() {
            c.models_dir = self.models_dir;
        }
        if let Some(k) = self.keep_alive {
            c.keep_alive = k;
        }
        if let Some(t) = self.read_timeout {
            c.read_timeout = t;
        }
        if self.unix.is_some() {
            c.unix = self.unix;
        }
        if self.unix_group.is_some() {
            c.unix_group = self.unix_group;
        }
        if self.api_key.is_some() {
            c.api_key = self.api_key;
        }
        if self.api_key_file.is_some() {
            c.api_key_file = self.api_key_file;
        }
        if self.insecure_no_auth {
            c.insecure_no_auth = true;
        }
        if let Some(p) = self.public_paths {
            c.public_paths = p.into_iter().filter(|p| !p.is_empty()).collect();
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
        if self.expert_cache.is_some() {
            c.expert_cache = self.expert_cache;
        }
        if self.expert_profile.is_some() {
            c.expert_profile = self.expert_profile;
        }
        if self.chat_template.is_some() {
            c.chat_template = self.chat_template;
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
