//! `sluiced run`: one prompt without a daemon, on the chosen backend, with the plan, the
//! text and the pass statistics (or one JSON object).

use anyhow::{bail, Context, Result};
use sluice::backend::Backend;
use sluice::engine::{on_backend, BackendChoice, EngineError, OnBackend};
use sluice::io::IoConfig;
use sluice::pipeline::Pipeline;
use sluice::store::Store;
use sluice::text::answer::{Parse, ToolEvent};
use sluice::text::grammar::{Grammar, Trigger};
use sluice::text::harmony;
use sluice::text::sampler::OutputFormat;
use sluice::text::{ChatMessage, ChatTemplate, Tokenizer};
use sluice::util::{fmt_bytes, parse_size, store_path};
use sluice_proto::sampling::SamplingArgs;
use std::path::PathBuf;

#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("input").required(true).args(["prompt", "prompt_file", "prompt_ids"])))]
pub struct RunArgs {
    /// Store directory (from `sluiced pack`), or the name of a store in the models
    /// directory ($SLUICE_MODELS_DIR, else ~/.local/share/sluice/models).
    dir: PathBuf,
    /// The prompt text (a user message with --chat).
    #[arg(long)]
    prompt: Option<String>,
    /// Read the prompt from a file.
    #[arg(long)]
    prompt_file: Option<PathBuf>,
    /// Token ids given directly, e.g. 1,2,3 (no template, no BOS added).
    #[arg(long, value_delimiter = ',')]
    prompt_ids: Option<Vec<u32>>,
    /// Render the prompt as a user message with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// A system message (with --chat).
    #[arg(long)]
    system: Option<String>,
    /// A chat template (a Jinja file) to render --chat with instead of the store's: a base
    /// model has none, and some models ship a wrong one. Generation also ends at the
    /// end-of-turn tokens it uses.
    #[arg(long, value_name = "FILE", requires = "chat")]
    chat_template: Option<PathBuf>,
    /// Tokens to generate at most (the context may stop it sooner).
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Stop when the text contains this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Keep generating past end tokens (benchmarks).
    #[arg(long)]
    ignore_eos: bool,
    /// Add BIAS to token ID's logit before sampling, as ID=BIAS with BIAS in [-100, 100]
    /// (OpenAI's logit_bias; -100 all but bans the token; repeatable).
    #[arg(long, value_parser = parse_logit_bias, allow_negative_numbers = true)]
    logit_bias: Vec<(u32, f32)>,
    /// Generate one JSON object and end there (OpenAI's JSON mode): tokens that would make
    /// the text anything else are never sampled.
    #[arg(long)]
    json_object: bool,
    /// Generate one instance of the JSON schema in FILE and end there (OpenAI's structured
    /// outputs; its properties are written in the schema's order).
    #[arg(long, value_name = "FILE", conflicts_with = "json_object")]
    json_schema: Option<PathBuf>,
    /// Generate a text the regular expression matches whole, then end (Rust regex syntax;
    /// vLLM's guided_regex).
    #[arg(long, value_name = "REGEX", conflicts_with_all = ["json_object", "json_schema"])]
    regex: Option<String>,
    /// Generate a text of the Lark grammar in FILE, then end (llguidance's Lark syntax;
    /// vLLM's guided_grammar).
    #[arg(long, value_name = "FILE", conflicts_with_all = ["json_object", "json_schema", "regex"])]
    grammar: Option<PathBuf>,
    /// Positions of KV cache (default: the model's context, at most 4096).
    #[arg(long)]
    max_context: Option<usize>,
    /// Tokens per prefill step.
    #[arg(long, default_value_t = 512)]
    batch_tokens: usize,
    /// Decode this many copies of the prompt together, one pass per step for all (as
    /// llama.cpp's parallel sequences): sequence i samples with seed + i; the text shown is
    /// sequence 0's, --json lists every sequence, and decode tokens/s counts them all.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=256))]
    parallel: u32,
    /// Device memory budget (e.g. 64MiB, 32GiB); below the model's size, layers stream.
    /// Default: enough for every layer resident.
    #[arg(long, value_parser = parse_size)]
    device_memory: Option<u64>,
    /// Host memory for decompressed copies of streamed layers (discrete GPUs).
    #[arg(long, value_parser = parse_size, default_value = "0")]
    host_cache: u64,
    /// Memory the whole process may use on the host (e.g. 512MiB): read buffers, staging,
    /// host cache, and on the CPU backend the arena (KV cache, workspace, resident layers);
    /// what does not fit streams. Default: 80% of MemAvailable (or of the memory cgroup's
    /// room when that is less).
    #[arg(long, value_parser = parse_size)]
    host_memory: Option<u64>,
    /// Decoder layers to compute on the host CPU from host memory beside the GPU, the
    /// first ones (llama.cpp's -ngl counted from the other end): their weights, KV cache
    /// and workspace take host memory instead of device memory.
    #[arg(long, default_value = "0")]
    cpu_layers: usize,
    /// How many of the first decoder layers the host CPU computes: "device" (as
    /// --cpu-layers says, none by default) or "auto" (measures this machine's streaming,
    /// device and CPU rates with passes of the model, then takes the placement whose
    /// predicted pass time at the run's --parallel rows is least; see `sluiced
    /// bench-placement`).
    #[arg(long, default_value = "device", value_parser = ["device", "auto"])]
    placement: String,
    /// Devices to split the model over, the first the one that streams and holds the
    /// embedding and head (e.g. cuda:0,cuda:1; replaces --device): each other device
    /// holds a span of the later layers resident within its free memory.
    #[arg(long, value_delimiter = ',')]
    devices: Vec<String>,
    /// Shares of the layers after the host's per device of --devices, in order (e.g. 3,1;
    /// default: in proportion to their memory budgets).
    #[arg(long, value_delimiter = ',')]
    split: Vec<f64>,
    /// Layers requested ahead of the one computing.
    #[arg(long)]
    prefetch: Option<usize>,
    /// Expert-cache slots for a mixture of experts whose layers stream (each holds one
    /// expert; default: as many as the memory left after the plan holds).
    #[arg(long)]
    expert_cache: Option<usize>,
    /// How the expert cache evicts: frequency (the expert routed the fewest tokens so far,
    /// then the least recently used) or lru.
    #[arg(long, default_value = "frequency")]
    expert_eviction: sluice::pipeline::Eviction,
    /// Load an expert profile (the routing counts a run saved with --save-expert-profile):
    /// the expert cache starts with the hottest experts, part of it pinned (the plan's
    /// "resident hot experts"), and frequency eviction counts from the profile's numbers.
    #[arg(long, value_name = "PATH")]
    expert_profile: Option<PathBuf>,
    /// After the run, save the routing counts (with a loaded profile's) as an expert
    /// profile for later runs and `sluiced serve --expert-profile`.
    #[arg(long, value_name = "PATH")]
    save_expert_profile: Option<PathBuf>,
    /// Measure how well a mixture's routing is predicted a layer ahead by the next layer's
    /// router on the hidden state (where that layer is resident), beside the previous
    /// token's choices: `--json`'s `expert_prediction`.
    #[arg(long)]
    measure_expert_prediction: bool,
    /// How a mixture's streamed experts are requested before their layer routes:
    /// lookahead (the next layer's router on this layer's hidden state, where its dense part
    /// is resident or, on the CPU, the next load; the previous token's choices elsewhere),
    /// previous (the previous token's choices) or off.
    #[arg(long, default_value = "lookahead")]
    expert_prediction: sluice::pipeline::Prediction,
    /// Compute threads of the CPU backend (default: all cores).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// auto (CUDA when a usable GPU is there, else the CPU, saying why), cpu or cuda.
    #[arg(long, default_value = "auto")]
    backend: BackendChoice,
    /// CUDA device ordinal.
    #[arg(long, default_value_t = 0)]
    device: usize,
    /// The reference numerics: f32 activations into every matmul and an f32 KV cache
    /// (outputs match transformers as closely as sluice can). Default: 8-bit activations
    /// for decode rows (16-bit into the output head) and an f16 KV cache.
    #[arg(long)]
    exact: bool,
    /// KV cache element type (default f16; f32 under --exact).
    #[arg(long)]
    kv_dtype: Option<sluice::backend::KvDtype>,
    /// Print one JSON object instead of the text.
    #[arg(long)]
    json: bool,
    /// Speculative decoding: `ngram` drafts the next tokens by prompt lookup (the prompt
    /// and the text so far); a store (a directory, or a name in the models directory)
    /// drafts them with that model, kept whole in memory beside this one within the same
    /// budgets: a small model of the same family, or a quantized copy of this one
    /// (`sluiced pack --quantize`), with this model's vocabulary. `self:TYPE` (q8_0,
    /// q4_k, ...) drafts with this model itself: the units it keeps resident as they are,
    /// the units it streams from a resident copy quantized to TYPE (made once, kept in the
    /// cache directory). Each pass verifies the drafts; the output is the model's own,
    /// token for token (default: off).
    #[arg(long, value_name = "ngram|STORE|self:TYPE")]
    draft: Option<String>,
    /// Tokens a sequence drafts for one pass at most.
    #[arg(long, default_value_t = sluice::engine::draft::DRAFT_MAX_DEFAULT)]
    draft_max: usize,
    /// Verify every proposal whole (up to --draft-max) instead of the rows that measured
    /// pass times pay for: for experiments.
    #[arg(long)]
    draft_fixed: bool,
    /// Draft token trees: besides its main chain, up to N other continuations per
    /// sequence (ngram: other earlier occurrences of the text's end; a draft model: its
    /// runner-up tokens where they are close), all verified in the same pass (default 0:
    /// chains).
    #[arg(long, default_value_t = 0, value_name = "N")]
    draft_branches: usize,
    /// With --parallel: the sequences after the first take the prompt's KV from the first
    /// instead of prefilling it too (default on; `off` for comparison).
    #[arg(long, value_name = "on|off", default_value = "on", action = clap::ArgAction::Set, value_parser = crate::util::parse_on_off)]
    prefix_cache: bool,
}

impl RunArgs {
    /// `--parallel` sequences, sharing the prompt's KV unless `--prefix-cache off`.
    fn batch(&self) -> sluice::engine::generate::Batch {
        sluice::engine::generate::Batch {
            n: self.parallel as usize,
            prefix_cache: self.prefix_cache,
        }
    }

    /// Speculative decoding's settings (None: off).
    fn draft(&self) -> Option<sluice::engine::draft::DraftConfig> {
        use sluice::engine::draft::DraftKind;
        self.draft
            .as_deref()
            .map(|d| sluice::engine::draft::DraftConfig {
                kind: DraftKind::of(d),
                max: self.draft_max,
                fixed: self.draft_fixed,
                branches: self.draft_branches,
            })
    }
}

pub fn run(a: RunArgs) -> Result<std::process::ExitCode> {
    let mut store = Store::open(&store_path(&a.dir, None))?;
    let mut tok = Tokenizer::from_manifest(store.manifest())?;
    store.release_tokenizer_spec();
    let store = std::sync::Arc::new(store);
    let m = store.manifest();
    // --chat-template, else the store directory's chat_template.jinja, else the store's.
    let path = store_path(&a.dir, None);
    let template = match &a.chat_template {
        Some(path) => Some(crate::util::read_chat_template(path)?),
        None if a.chat => crate::util::chat_template_sidecar(&path)?,
        None => None,
    };
    if let Some(t) = &template {
        tok.end_turns_of(t);
    }
    let prompt_ids = prompt_ids(&a, m, &tok, template.as_deref())?;
    let max_context = a
        .max_context
        .unwrap_or((m.arch.max_context as usize).min(4096));
    let parallel = a.parallel as usize;
    // Each sequence's drafts, verified a pass.
    let verify_rows = a.draft().map_or(0, |d| d.verify_rows(parallel));
    let opts = sluice::model::ModelOptions {
        max_context,
        kv_slots: parallel,
        // No step carries more than the prompts (the same prompt for each sequence) or a
        // decode step's rows: a larger prefill chunk would be workspace nothing fills,
        // taken from the budget.
        max_batch_tokens: a
            .batch_tokens
            .min((prompt_ids.len().max(1) * parallel).max(parallel + verify_rows))
            .max(1),
        kv_dtype: sluice::engine::kv_dtype_for(a.exact, a.kv_dtype),
        exact: a.exact,
        verify_rows,
    };
    // A profile's hottest experts, those that served half its routed tokens, are planned
    // resident.
    let profile = match &a.expert_profile {
        Some(path) => Some(sluice::pipeline::ExpertProfile::load(path, &m.arch)?),
        None => None,
    };
    let profile_hot = profile
        .as_ref()
        .map(|p| p.hot_set(sluice::pipeline::PROFILE_HOT_SHARE));
    // The draft's store is open before the process's overhead is measured (`host_input`):
    // its manifest and index are the process's, counted by neither plan otherwise.
    let draft_store = match a.draft.as_deref() {
        Some(d) if d != "ngram" => Some(draft_source(d, &store, &tok, &a)?),
        _ => None,
    };
    // Each setting given on the command line, the model's default for the rest.
    let defaults = sluice::engine::sampling_defaults(m);
    let sampling = sluice::server::service::sampling_of(&a.sampling.request(), &defaults);
    let mut input = sluice::plan::PlanInput {
        device_budget: a.device_memory,
        host_cache_budget: a.host_cache,
        opts,
        prefetch: a.prefetch,
        expert_cache: a.expert_cache,
        expert_profile: profile_hot,
        backend_reserved: 0,
        self_draft_reserved: 0,
        // The engine's logits and samplers are the plan's (`plan::host::sampling`).
        host: sluice::engine::host_input(a.host_memory, 0),
    };
    input.host.cpu_layers = a.cpu_layers;
    // Greedy decoding without penalties, biases or JSON takes the argmax of each row in
    // place: the samplers keep no rows of their own.
    input.host.grammars = a.grammar().is_some();
    input.host.sampler_rows = sampling.temperature > 0.0
        || sampling.penalizes()
        || !a.logit_bias.is_empty()
        || a.grammar().is_some();
    let chosen = placement_backend(&a, &mut input)?;
    let io = IoConfig::single_stream();
    let job = Generate {
        store: store.clone(),
        draft_store,
        chosen: &chosen,
        io: io.clone(),
        sampling,
        profile,
        a: &a,
        tok: &tok,
        prompt_ids: &prompt_ids,
        input,
    };
    let run = sluice::pipeline::PipelineOptions {
        expert_eviction: a.expert_eviction,
        expert_prediction: a.expert_prediction,
        measure_lookahead: a.measure_expert_prediction,
        cpu_threads: a.threads,
        ..Default::default()
    };
    on_backend(&chosen, a.threads, &io, run, job)??;
    Ok(std::process::ExitCode::SUCCESS)
}

/// The prompt's token ids: given directly, or the prompt (or file) encoded, rendered with
/// the chat template under --chat (`template`, from --chat-template, else the store's).
fn prompt_ids(
    a: &RunArgs,
    m: &sluice::store::Manifest,
    tok: &Tokenizer,
    template: Option<&str>,
) -> Result<Vec<u32>> {
    if let Some(ids) = a.prompt_ids.clone() {
        if let Some(bad) = ids.iter().find(|&&i| i >= m.arch.vocab) {
            bail!(
                "--prompt-ids: token id {bad} is past the vocabulary ({})",
                m.arch.vocab
            );
        }
        return Ok(ids);
    }
    let text = match (&a.prompt, &a.prompt_file) {
        (Some(p), _) => p.clone(),
        (None, Some(f)) => std::fs::read_to_string(f)
            .with_context(|| format!("read --prompt-file {}", f.display()))?,
        (None, None) => bail!("give --prompt, --prompt-file or --prompt-ids"),
    };
    if !a.chat {
        return Ok(tok.encode(&text, true)?);
    }
    let src = template
        .or(m.chat_template.as_deref())
        .context("--chat: this model has no chat template; give one with --chat-template FILE")?;
    let piece = |id: Option<u32>| id.map(|i| tok.piece(i)).unwrap_or_default();
    let t = ChatTemplate::new(src, piece(m.special.bos), piece(m.special.eos))?;
    let mut msgs = Vec::new();
    if let Some(s) = &a.system {
        msgs.push(ChatMessage::new("system", s.clone()));
    }
    msgs.push(ChatMessage::new("user", text));
    Ok(tok.encode(&t.render(&msgs, true)?, false)?)
}

/// `--draft`'s draft: `self:TYPE` (the model's units quantized, made once by `threads`
/// threads), else a store.
fn draft_source(
    d: &str,
    store: &Store,
    tok: &Tokenizer,
    a: &RunArgs,
) -> Result<sluice::engine::draft_model::DraftSource> {
    use sluice::engine::{draft_model::DraftSource, self_draft};
    if a.placement == "auto" && self_draft::parse(d).is_some() {
        bail!("--placement auto with a self-draft is not supported yet (the self-draft shares the layers auto would move): give --cpu-layers N, or a draft model (--draft STORE)");
    }
    Ok(match self_draft::parse(d) {
        Some(_) if a.cpu_layers > 0 || a.devices.len() > 1 => {
            bail!("--cpu-layers or several --devices with a self-draft is not supported yet (the layers on the host or other devices have no quantized copy to draft with): give a draft model (--draft STORE) or --draft ngram")
        }
        Some(t) => {
            let t = t.map_err(anyhow::Error::msg)?;
            DraftSource::SelfDraft(crate::util::self_draft_store(store, t, a.threads)?)
        }
        None => DraftSource::Model(draft_store(d, tok)?),
    })
}

/// `--draft STORE`'s store, refused unless its vocabulary is the model's (`tok`'s).
fn draft_store(d: &str, tok: &Tokenizer) -> Result<std::sync::Arc<Store>> {
    let path = store_path(std::path::Path::new(d), None);
    let mut s = Store::open(&path).with_context(|| {
        format!("--draft {d}: not `ngram` and no store there (give `ngram`, `self:TYPE`, a store directory or a model name)")
    })?;
    let dtok = Tokenizer::from_manifest(s.manifest())?;
    s.release_tokenizer_spec();
    if let Some(why) = sluice::engine::draft_model::vocab_mismatch(tok, &dtok) {
        bail!("--draft {d}: cannot draft for this model: {why}; a draft needs the model's vocabulary, token for token");
    }
    Ok(std::sync::Arc::new(s))
}

/// `sluiced run`'s work once the backend is known.
struct Generate<'a> {
    store: std::sync::Arc<Store>,
    draft_store: Option<sluice::engine::draft_model::DraftSource>,
    /// The backend and reads the pipelines are built for (plans of a self-draft's rounds).
    chosen: &'a sluice::engine::Chosen,
    io: IoConfig,
    sampling: sluice::text::SamplingParams,
    profile: Option<sluice::pipeline::ExpertProfile>,
    a: &'a RunArgs,
    tok: &'a Tokenizer,
    prompt_ids: &'a [u32],
    input: sluice::plan::PlanInput,
}

impl OnBackend for Generate<'_> {
    type Output = Result<()>;
    fn call<B: Backend + 'static>(
        self,
        make: &sluice::engine::Maker<B>,
    ) -> Result<Result<()>, EngineError> {
        let plan = |m: &sluice::store::Manifest, i: &sluice::plan::PlanInput| {
            sluice::engine::plan_for(self.chosen, m, i, &self.io, self.a.threads)
        };
        let (runner, draft) = if self.a.placement == "auto" {
            let p = sluice::engine::placement::auto_built(
                &**make,
                &self.store,
                self.draft_store.as_ref(),
                (&self.chosen.device_key(), self.a.threads),
                &self.input,
                self.a.parallel.max(1) as usize,
            )?;
            (p.runner, p.draft)
        } else {
            sluice::engine::draft_model::with_draft(
                &**make,
                &plan,
                &self.store,
                self.draft_store.as_ref(),
                &self.input,
            )?
        };
        if let (Some(d), false) = (&draft, self.a.json) {
            eprint!("{}", d.describe());
        }
        Ok(run_generate(
            runner,
            draft,
            self.a,
            self.tok,
            self.prompt_ids,
            self.profile,
            self.sampling,
        ))
    }
}

/// The backend `a` asks for, where its placement flags can be, with its devices beside
/// the first in `input`.
fn placement_backend(
    a: &RunArgs,
    input: &mut sluice::plan::PlanInput,
) -> Result<sluice::engine::Chosen> {
    if a.placement == "auto" && a.cpu_layers > 0 {
        bail!(
            "--placement auto chooses the host layers itself: leave out --cpu-layers {}",
            a.cpu_layers
        );
    }
    let first = match sluice::engine::parse_devices(&a.devices)?.first() {
        Some(&d) => d,
        None => a.device,
    };
    let chosen = sluice::engine::choose_backend(a.backend, first)?;
    if let (sluice::engine::Chosen::Cpu { .. }, "auto") = (&chosen, a.placement.as_str()) {
        bail!("--placement auto places layers between the host CPU and a GPU: the CPU backend computes every layer on the host already (give --backend cuda, or leave it out)");
    }
    let ordinals = sluice::engine::parse_devices(&a.devices)?;
    (input.host.devices, input.host.split) = sluice::engine::other_devices(
        &chosen,
        ordinals.get(1..).unwrap_or_default(),
        &a.split,
        a.device_memory,
    )?;
    Ok(chosen)
}

/// What each of `sluiced run`'s sequences generates under.
fn generate_params(
    a: &RunArgs,
    tok: &Tokenizer,
    sampling: sluice::text::SamplingParams,
) -> Result<sluice::engine::sequence::GenerateParams> {
    let format = match a.grammar() {
        None => OutputFormat::Text,
        // A harmony chat answer is held from its final channel on, as the server holds it.
        Some((flag, g)) => OutputFormat::Constrained(
            tok.grammars()
                .and_then(|gs| match a.chat && tok.harmony().is_some() {
                    true => gs.compile_after(&g?, Trigger::Text(harmony::FINAL)),
                    false => gs.compile(&g?),
                })
                .map(Box::new)
                .map_err(|m| anyhow::anyhow!("{flag}: {m}"))?,
        ),
    };
    Ok(sluice::engine::sequence::GenerateParams {
        max_tokens: a.max_tokens,
        sampling,
        stop: a.stop.clone(),
        ignore_eos: a.ignore_eos,
        logprobs: None,
        logit_bias: a.logit_bias.clone(),
        format,
        draft: a.draft(),
        // A harmony model's chat answer (gpt-oss): read back by its channels.
        markers: a.chat && tok.harmony().is_some(),
    })
}

/// What `sluiced run` prints of the text as it comes (nothing with --json): the text, or
/// of a harmony chat answer (gpt-oss) the reasoning on stderr and the rest on stdout.
struct Printer {
    harmony: Option<sluice::text::harmony::HarmonyParser>,
    quiet: bool,
}

impl Printer {
    fn piece(&mut self, piece: &str) {
        if self.quiet {
            return;
        }
        match &mut self.harmony {
            Some(h) => {
                let events = h.feed(piece);
                print_answer(events);
            }
            None => print_answer(vec![ToolEvent::Text(piece.to_string())]),
        }
    }

    fn end(&mut self) {
        if let (Some(h), false) = (&mut self.harmony, self.quiet) {
            print_answer(h.finish());
        }
    }
}

fn print_answer(events: Vec<ToolEvent>) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    for e in events {
        match e {
            ToolEvent::Reasoning(r) => eprint!("{r}"),
            ToolEvent::Text(t) | ToolEvent::Args { text: t, .. } => {
                let _ = out.write_all(t.as_bytes());
            }
            ToolEvent::Call { .. } => {}
        }
    }
    let _ = out.flush();
}

/// Generates for `sluiced run` on whichever backend was chosen.
fn run_generate<B: Backend>(
    mut runner: Pipeline<B>,
    mut draft_model: Option<sluice::engine::draft_model::DraftModel<B>>,
    a: &RunArgs,
    tok: &Tokenizer,
    prompt_ids: &[u32],
    profile: Option<sluice::pipeline::ExpertProfile>,
    sampling: sluice::text::SamplingParams,
) -> Result<()> {
    use sluice::engine::generate::generate_with;
    let (parallel, draft) = (a.parallel as usize, a.draft());
    if !a.json {
        eprint!("{}", runner.plan.table());
        eprintln!("sampling: {}", sampling.describe());
    }
    let profile = match (&a.expert_profile, profile) {
        (Some(path), Some(p)) => {
            let n = runner.load_expert_profile(p)?;
            if !a.json {
                eprintln!(
                    "expert profile {}: {n} experts loaded, {} pinned",
                    path.display(),
                    n.min(runner.plan.expert_hot_slots)
                );
            }
            Some((path.display().to_string(), n))
        }
        _ => None,
    };
    let context = runner.options().max_context;
    if prompt_ids.len() + a.max_tokens > context && prompt_ids.len() < context {
        eprintln!(
            "note: the prompt ({} tokens) and --max-tokens {} do not fit in the context of {context}: generation stops at the context, after {} tokens (--max-context raises it)",
            prompt_ids.len(),
            a.max_tokens,
            context - prompt_ids.len()
        );
    }
    let params = generate_params(a, tok, sampling)?;
    let mut printer = Printer {
        harmony: params
            .markers
            .then(|| sluice::text::harmony::HarmonyParser::new(false)),
        quiet: a.json,
    };
    let dm = draft_model.as_mut();
    let outs = generate_with(
        &mut runner,
        dm,
        tok,
        prompt_ids,
        &params,
        a.batch(),
        |piece| printer.piece(piece),
    )?;
    printer.end();
    let out = &outs[0];
    // The batch's decode rate: every sequence's decode tokens over the shared wall time.
    let decode_tokens: usize = outs.iter().map(|o| o.decode_tokens()).sum();
    let decode_tokens_per_s = decode_tokens as f64 / out.decode_s.max(1e-9);
    let prefill_tokens_per_s =
        (out.prompt_token_ids.len() * parallel) as f64 / out.prefill_s.max(1e-9);
    let b = &runner.backend;
    let total = runner.total().clone();
    let passes = total.passes.max(1) as f64;
    let plan = &runner.plan;
    let profile_json = profile.as_ref().map(|(path, n)| {
        serde_json::json!({
            "path": path,
            "experts_loaded": n,
            "experts_pinned": (*n).min(plan.expert_hot_slots),
        })
    });
    let (host_peak, host_peak_source) = sluice::hostmem::host_peak();
    if a.json {
        let mut j = serde_json::json!({
            "prompt_token_ids": out.prompt_token_ids,
            "generated_token_ids": out.generated_token_ids,
            "text": out.text,
            "finish_reason": out.finish_reason,
            "prompt_tokens": out.prompt_token_ids.len(),
            "generated_tokens": out.generated_token_ids.len(),
            "prefill_s": out.prefill_s,
            "decode_s": out.decode_s,
            "prefill_tokens_per_s": prefill_tokens_per_s,
            "decode_tokens_per_s": decode_tokens_per_s,
            "parallel": parallel,
            "sequences": outs.iter().map(|o| serde_json::json!({
                "generated_token_ids": o.generated_token_ids,
                "text": o.text,
                "finish_reason": o.finish_reason,
            })).collect::<Vec<_>>(),
            "backend": b.name(),
            "numerics": if runner.options().exact { "exact" } else { "fast" },
            "kv_dtype": runner.options().kv_dtype,
            "threads": b.host_threads(),
            "copy_device_s": total.copy_device_s,
            "copy_gbps": if total.copy_device_s > 0.0 { total.bytes_uploaded as f64 / total.copy_device_s / 1e9 } else { 0.0 },
            "device_bytes_budget": b.budget().limit(),
            "device_bytes_peak": b.budget().peak(),
            "host_bytes_budget": plan.host.budget,
            "host_bytes_planned": plan.host.total_bytes,
            "host_bytes_peak": host_peak,
            "host_bytes_peak_source": host_peak_source,
            "layers_resident": plan.layers_resident(),
            "layers_streamed": plan.layers_streamed(),
            "bytes_streamed": total.bytes_uploaded,
            "bytes_read": total.bytes_read,
            "bytes_decompressed": total.bytes_decompressed,
            "bytes_from_host_cache": total.bytes_from_host_cache,
            "passes": total.passes,
            "pass_time_s": total.pass_time_s / passes,
            "compute_s": total.compute_s,
            "upload_s": total.upload_s,
            "stall_load_s": total.load_stall_s,
            "experts": experts_json(&total),
            "expert_eviction": runner.pipeline_options().expert_eviction,
            "expert_profile": profile_json,
            "expert_prediction_mode": runner.pipeline_options().expert_prediction,
            "expert_prediction": prediction_json(&runner.model.prediction_stats()),
            "plan": plan,
        });
        // Past json!'s recursion limit: added after.
        j["int_dots"] = sluice::engine::int_dots_for(b.name(), runner.options().exact).into();
        j["host_bytes_vmhwm"] = sluice::hostmem::peak_rss_bytes().into();
        speculative_json(&mut j, &outs, draft);
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        println!();
        eprintln!(
            "prefill: {} tokens in {:.3} s ({:.1} tokens/s); decode: {} tokens in {:.3} s ({:.1} tokens/s); finish: {:?}{}",
            out.prompt_token_ids.len() * parallel,
            out.prefill_s,
            prefill_tokens_per_s,
            decode_tokens,
            out.decode_s,
            decode_tokens_per_s,
            out.finish_reason,
            if parallel > 1 {
                format!(" ({parallel} sequences; the text is sequence 0's, --json shows each)")
            } else {
                String::new()
            },
        );
        eprintln!(
            "passes: {}, {:.2} ms each; per pass {} read, {} uploaded; compute {:.3} s, upload {:.3} s, waiting for loads {:.3} s; device memory peak {} of {}; host peak {} ({host_peak_source}) of {} planned",
            total.passes,
            total.pass_time_s / passes * 1e3,
            fmt_bytes((total.bytes_read as f64 / passes) as u64),
            fmt_bytes((total.bytes_uploaded as f64 / passes) as u64),
            total.compute_s,
            total.upload_s,
            total.load_stall_s,
            fmt_bytes(b.budget().peak()),
            fmt_bytes(b.budget().limit()),
            fmt_bytes(host_peak),
            fmt_bytes(plan.host.total_bytes),
        );
        print_experts(&total, runner.pipeline_options().expert_prediction);
        print_drafting(&outs);
    }
    if let Some(path) = &a.save_expert_profile {
        runner.expert_profile().save(path)?;
        if !a.json {
            eprintln!("expert profile saved to {}", path.display());
        }
    }
    Ok(())
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        0.0
    } else {
        a as f64 / b as f64
    }
}

/// Both predictors of a mixture's routing over the run (the lookahead only where measured).
/// The line on streamed experts, when a sparse layer streamed.
fn print_experts(total: &sluice::pipeline::PassStats, mode: sluice::pipeline::Prediction) {
    if total.experts_routed > 0 {
        eprintln!(
            "experts: {} routed in streamed layers, {} from the expert cache, {} loaded ({}); prediction ({mode:?}) precision {:.2}, recall {:.2}",
            total.experts_routed,
            total.expert_cache_hits,
            total.experts_loaded,
            fmt_bytes(total.expert_bytes_loaded),
            ratio(total.experts_predicted_used, total.experts_predicted),
            ratio(total.experts_predicted_used, total.experts_routed),
        );
    }
}

/// The line on speculative decoding, when the sequences drafted.
fn print_drafting(outs: &[sluice::engine::generate::GenerateOutput]) {
    let mut s = sluice::engine::draft::SpecStats::default();
    for o in outs {
        s.add(&o.speculative);
    }
    if s.drafted_tokens > 0 {
        let o = &outs[0];
        eprintln!(
            "drafting: {} of {} drafted tokens accepted ({:.2}); {:.2} tokens a decode step, {} decode passes{}",
            s.accepted_tokens,
            s.drafted_tokens,
            ratio(s.accepted_tokens, s.drafted_tokens),
            s.tokens_per_step_mean(),
            o.decode_passes,
            if o.draft_passes > 0 {
                format!("; the draft model ran {} passes in {:.3} s ({:.0} % of decoding)", o.draft_passes, o.draft_s, 100.0 * o.draft_s / o.decode_s.max(1e-9))
            } else {
                String::new()
            },
        );
    }
}

/// `--json`'s decode steps and passes, speculative decoding's counts and the prompt tokens
/// taken from the prefix cache, over the batch.
fn speculative_json(
    j: &mut serde_json::Value,
    outs: &[sluice::engine::generate::GenerateOutput],
    draft: Option<sluice::engine::draft::DraftConfig>,
) {
    let mut s = sluice::engine::draft::SpecStats::default();
    for o in outs {
        s.add(&o.speculative);
    }
    j["decode_steps"] = outs.iter().map(|o| o.decode_steps).sum::<usize>().into();
    j["decode_passes"] = outs.first().map_or(0, |o| o.decode_passes).into();
    j["draft"] = draft.map(|d| d.kind.to_string()).into();
    // The prefix cache: prompt tokens each sequence took from another's KV.
    j["cached_tokens"] = outs.iter().map(|o| o.cached_tokens).sum::<usize>().into();
    for (i, o) in outs.iter().enumerate() {
        j["sequences"][i]["cached_tokens"] = o.cached_tokens.into();
    }
    j["speculative"] = serde_json::json!({
        "draft_s": outs.first().map_or(0.0, |o| o.draft_s),
        "draft_passes": outs.first().map_or(0, |o| o.draft_passes),
        "drafted_tokens": s.drafted_tokens,
        "accepted_tokens": s.accepted_tokens,
        "acceptance": ratio(s.accepted_tokens, s.drafted_tokens),
        "tokens_per_step": s.tokens_per_step,
        "tokens_per_step_mean": s.tokens_per_step_mean(),
    });
}

fn prediction_json(p: &sluice::model::moe::PredictionStats) -> serde_json::Value {
    let (prev, ahead) = (&p.previous, &p.lookahead);
    serde_json::json!({
        "counts": {
            "routed": prev.routed,
            "previous_predicted": prev.predicted,
            "previous_right": prev.right,
            "lookahead_routed": ahead.routed,
            "lookahead_predicted": ahead.predicted,
            "lookahead_right": ahead.right,
        },
        "previous_token": {
            "precision": ratio(prev.right, prev.predicted),
            "recall": ratio(prev.right, prev.routed),
        },
        "router_lookahead": {
            "precision": ratio(ahead.right, ahead.predicted),
            "recall": ratio(ahead.right, ahead.routed),
        },
    })
}

/// A mixture's streamed experts over the run (all zero for a dense model or one resident).
fn experts_json(t: &sluice::pipeline::PassStats) -> serde_json::Value {
    serde_json::json!({
        "routed": t.experts_routed,
        "cache_hits": t.expert_cache_hits,
        "loaded": t.experts_loaded,
        "bytes_loaded": t.expert_bytes_loaded,
        "predicted": t.experts_predicted,
        "predicted_used": t.experts_predicted_used,
        "prediction_precision": ratio(t.experts_predicted_used, t.experts_predicted),
        "prediction_recall": ratio(t.experts_predicted_used, t.experts_routed),
        "prefetched": t.expert_prefetches,
        "prefetched_unused": t.expert_prefetches_wasted,
    })
}

/// `--logit-bias ID=BIAS`.
fn parse_logit_bias(s: &str) -> Result<(u32, f32), String> {
    let max = sluice::text::sampler::LOGIT_BIAS_MAX;
    let (id, bias) = s
        .split_once('=')
        .ok_or_else(|| format!("{s:?} is not ID=BIAS (e.g. 1234=-100)"))?;
    let id = id
        .trim()
        .parse()
        .map_err(|_| format!("{id:?} in {s:?} is not a token id"))?;
    match bias.trim().parse::<f32>() {
        Ok(b) if b.abs() <= max => Ok((id, b)),
        _ => Err(format!(
            "the bias in {s:?} must be a number in [-{max}, {max}]"
        )),
    }
}

impl RunArgs {
    /// The constraint the flags ask for, with the flag that named it (None: any text);
    /// Err where a file the flag names cannot be read.
    fn grammar(&self) -> Option<(&'static str, std::result::Result<Grammar, String>)> {
        let read = |path: &std::path::Path| {
            std::fs::read_to_string(path)
                .map_err(|e| format!("cannot read {}: {e}", path.display()))
        };
        if let Some(path) = &self.json_schema {
            let g = read(path).and_then(|text| {
                serde_json::from_str(&text)
                    .map(Grammar::JsonSchema)
                    .map_err(|e| format!("{} is not JSON: {e}", path.display()))
            });
            Some(("--json-schema", g))
        } else if let Some(path) = &self.grammar {
            Some(("--grammar", read(path).map(Grammar::Lark)))
        } else if let Some(r) = &self.regex {
            Some(("--regex", Ok(Grammar::Regex(r.clone()))))
        } else if self.json_object {
            Some(("--json-object", Ok(Grammar::JsonObject)))
        } else {
            None
        }
    }
}
