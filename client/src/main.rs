//! `sluice`: the command-line client of the sluice daemon.

// Input from outside (files, requests, the disk) never meets an unwrap or expect here: an
// `expect` on a true invariant carries an #[allow] saying why it holds.
#![cfg_attr(not(test), deny(clippy::unwrap_used, clippy::expect_used))]

use anyhow::{bail, Result};
use clap::{Parser, Subcommand};
mod batch;
mod chat;
mod status;

use sluice_client::{connect, pb, resolve_addr, Client, Target};
use sluice_proto::sampling::SamplingArgs;
use status::{hot_experts, print_engine_features, status_json};
use std::io::Write;
use std::path::PathBuf;
use tokio_stream::StreamExt;

#[derive(Parser)]
#[command(
    name = "sluice",
    version,
    about = "Client for the sluice daemon (sluice.v1.Inference)"
)]
struct Cli {
    /// Daemon address: http://host:port or unix:/path (default: $SLUICE_ADDR, else http://127.0.0.1:50051).
    #[arg(long, global = true)]
    addr: Option<String>,
    /// API key of a daemon that requires one (sent as `authorization: Bearer KEY`).
    #[arg(long, global = true, env = "SLUICE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The model to use, by name as `sluice models` lists it (default: $SLUICE_MODEL, else
    /// the daemon's default: its --model, or the one model it serves).
    #[arg(long, global = true, env = "SLUICE_MODEL")]
    model: Option<String>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(clap::Args, Clone)]
struct Sampling {
    /// Tokens to generate at most; 0: the daemon's default (`sluiced serve
    /// --max-tokens-default`, 256 unless set), cut to the room the context leaves.
    #[arg(long, default_value_t = 0)]
    max_tokens: u32,
    #[command(flatten)]
    params: SamplingArgs,
    /// Stop when the text contains this string (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// Generate one JSON object and end there (OpenAI's JSON mode): tokens that would make
    /// the text anything else are never sampled. Say in the prompt which fields to write.
    #[arg(long)]
    json_object: bool,
    /// Generate one instance of the JSON schema in FILE and end there (OpenAI's structured
    /// outputs; its properties are written in the schema's order).
    #[arg(long, value_name = "FILE", value_parser = read_json_file, conflicts_with = "json_object")]
    json_schema: Option<String>,
    /// Generate a text the regular expression matches whole, then end (Rust regex syntax;
    /// vLLM's guided_regex).
    #[arg(long, value_name = "REGEX", conflicts_with_all = ["json_object", "json_schema"])]
    regex: Option<String>,
    /// Generate a text of the Lark grammar in FILE, then end (llguidance's Lark syntax;
    /// vLLM's guided_grammar).
    #[arg(long, value_name = "FILE", value_parser = read_text_file, conflicts_with_all = ["json_object", "json_schema", "regex"])]
    grammar: Option<String>,
    /// How long the daemon keeps the model loaded after this request ("30s", "5m"; "0"
    /// unloads it once idle, "-1" keeps it; default: the daemon's --keep-alive).
    #[arg(long, allow_hyphen_values = true)]
    keep_alive: Option<String>,
}

impl Sampling {
    /// The settings as `/set` names them.
    fn describe(&self) -> String {
        let max_tokens = match self.max_tokens {
            0 => "default".to_string(),
            n => n.to_string(),
        };
        format!("{} max_tokens {max_tokens}", self.params.describe())
    }

    /// `/set NAME VALUE`; the daemon checks the ranges when the next request goes.
    fn set(&mut self, name: &str, value: &str) -> Result<()> {
        if name == "max_tokens" {
            self.max_tokens = value.parse().map_err(|_| {
                anyhow::anyhow!("/set max_tokens: {value:?} is not a number of the right kind")
            })?;
            return Ok(());
        }
        self.params
            .set(name, value)
            .map_err(|e| anyhow::anyhow!("/set {e}; /set lists them"))
    }

    fn request(&self) -> pb::GenerateRequest {
        pb::GenerateRequest {
            max_tokens: self.max_tokens,
            sampling: Some(self.params.request()),
            stop: self.stop.clone(),
            keep_alive: self.keep_alive.clone().unwrap_or_default(),
            response_format: if self.json_schema.is_some() {
                pb::ResponseFormat::JsonSchema
            } else if self.grammar.is_some() {
                pb::ResponseFormat::Grammar
            } else if self.regex.is_some() {
                pb::ResponseFormat::Regex
            } else if self.json_object {
                pb::ResponseFormat::JsonObject
            } else {
                pb::ResponseFormat::Text
            }
            .into(),
            json_schema: self.json_schema.clone().unwrap_or_default(),
            regex: self.regex.clone().unwrap_or_default(),
            grammar: self.grammar.clone().unwrap_or_default(),
            ..Default::default()
        }
    }
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text; it streams to stdout.
    Generate {
        /// The prompt text; `-` reads it from standard input.
        prompt: String,
        /// Send the prompt as a user message through the model's chat template.
        #[arg(long)]
        chat: bool,
        /// A system message before the prompt (with --chat).
        #[arg(long)]
        system: Option<String>,
        #[command(flatten)]
        s: Sampling,
        /// Print one JSON object (token ids, text, stats) instead of streaming.
        #[arg(long)]
        json: bool,
    },
    /// Interactive chat (the model's chat template) with a line editor: Ctrl-C stops the
    /// reply and keeps the conversation, /help lists the commands, Ctrl-D or /exit leaves.
    Chat {
        /// A system message at the start of the conversation (/system changes it).
        #[arg(long)]
        system: Option<String>,
        /// The file of typed lines kept across sessions (default
        /// $XDG_STATE_HOME/sluice/chat_history, else ~/.local/state/sluice/chat_history).
        #[arg(long)]
        history: Option<PathBuf>,
        /// Keep no history file.
        #[arg(long, conflicts_with = "history")]
        no_history: bool,
        /// Functions the model may call: a JSON file of OpenAI tools
        /// (`[{"type": "function", "function": {"name", "description", "parameters"}}]`).
        /// Calls are shown; answer each with /tool RESULT.
        #[arg(long, value_name = "FILE")]
        tools: Option<PathBuf>,
        /// auto, none, required, or a function's name (with --tools).
        #[arg(long, default_value = "auto", requires = "tools")]
        tool_choice: String,
        #[command(flatten)]
        s: Sampling,
    },
    /// Run a JSONL file through the model: {"id", "text"} lines, or OpenAI's batch format
    /// (--format openai). Resumable (items already in OUTPUT are skipped), shardable; only
    /// items that finished are written; bad lines and items that cannot succeed go to the
    /// errors file. The exit status is the number of items that failed (at most 100).
    Batch {
        /// The input JSONL file.
        input: PathBuf,
        /// The output JSONL file: appended to, and read first to skip the ids it holds.
        #[arg(short, long)]
        output: PathBuf,
        /// simple ({"id", "text"}) or openai ({"custom_id", "method", "url", "body"}).
        #[arg(long, value_enum, default_value = "simple")]
        format: batch::Format,
        /// Where bad lines and items that cannot succeed go (default OUTPUT.errors.jsonl;
        /// rewritten each run).
        #[arg(long)]
        errors: Option<PathBuf>,
        /// Prompt template; {text} is replaced by the item's text (simple format); \n and
        /// \t as typed become a newline and a tab.
        #[arg(long, default_value = "Summarize the following text.\n\n{text}")]
        template: String,
        /// Requests in flight (default: the daemon's max batch, so its passes are full).
        #[arg(long)]
        concurrency: Option<usize>,
        /// Only this shard of the ids, K/N with K in 1..=N (split a job across machines).
        #[arg(long)]
        shard: Option<String>,
        /// Send the prompt raw instead of through the chat template (simple format).
        #[arg(long)]
        raw: bool,
        /// Cut the end of documents that do not fit in the context with max_tokens,
        /// instead of failing them.
        #[arg(long)]
        truncate: bool,
        /// Add to an output made with other parameters (template, max tokens, sampling,
        /// model) instead of refusing.
        #[arg(long)]
        force_params: bool,
        /// Attempts after the first for an item that failed (a transport or data error).
        #[arg(long, default_value_t = 3)]
        retries: u32,
        /// Seconds to wait for a daemon that is down, restarting or shutting down (systemd
        /// brings it back) before leaving its items unfinished; 0: do not wait.
        #[arg(long, default_value_t = 600)]
        wait_daemon: u64,
        /// Print a JSON summary (documents/minute, tokens/s, bytes per token) on stdout.
        #[arg(long)]
        json: bool,
        #[command(flatten)]
        s: Sampling,
    },
    /// The daemon's memory plan, streaming statistics and queue.
    Status {
        /// Print one JSON object instead of the table.
        #[arg(long)]
        json: bool,
    },
    /// The models the daemon serves (its --model and every store in its models
    /// directory): size, architecture, quantization, whether loaded.
    Models {
        /// Print one JSON object per model instead of a line.
        #[arg(long)]
        json: bool,
    },
    /// The models loaded now: their memory, requests in flight, time until they unload.
    Ps {
        /// Print one JSON object per model instead of a line.
        #[arg(long)]
        json: bool,
    },
    /// The prefix cache: `sluice cache clear` empties it (the --model's, else every loaded
    /// model's): the KV slots keep for prompts that share their text.
    Cache {
        #[command(subcommand)]
        action: CacheCmd,
    },
    /// Token ids of a text, with each token's text.
    Tokenize {
        /// The text; `-` reads it from standard input.
        text: String,
        /// Add the model's BOS token where the model asks for one, as prompts get.
        #[arg(long)]
        add_special_tokens: bool,
    },
}

#[derive(Subcommand)]
enum CacheCmd {
    /// Empty the prefix cache; prints the positions of KV each model gave up.
    Clear,
}

pub(crate) fn finish_name(f: i32) -> &'static str {
    match pb::FinishReason::try_from(f).unwrap_or(pb::FinishReason::Unspecified) {
        pb::FinishReason::Stop => "stop",
        pb::FinishReason::Length => "length",
        pb::FinishReason::StopString => "stop_string",
        pb::FinishReason::Context => "context",
        pb::FinishReason::Cancelled => "cancelled",
        pb::FinishReason::ToolCalls => "tool_calls",
        pb::FinishReason::Unspecified => "unspecified",
    }
}

pub(crate) struct Outcome {
    pub(crate) text: String,
    /// The model's reasoning, apart from the text (gpt-oss's analysis channel).
    pub(crate) reasoning: String,
    pub(crate) done: pb::GenerateDone,
}

/// Runs one Generate call; `on_piece` sees text as it streams.
async fn generate(
    client: &mut Client,
    req: pb::GenerateRequest,
    mut on_piece: impl FnMut(&str),
) -> Result<Outcome, tonic::Status> {
    let mut stream = client.generate(req).await?.into_inner();
    let (mut text, mut reasoning) = (String::new(), String::new());
    while let Some(msg) = stream.next().await {
        match msg?.event {
            Some(pb::generate_response::Event::Piece(p)) => {
                sluice_client::show_reasoning(&p.reasoning);
                reasoning.push_str(&p.reasoning);
                on_piece(&p.text);
                text.push_str(&p.text);
            }
            Some(pb::generate_response::Event::Done(done)) => {
                return Ok(Outcome {
                    text,
                    reasoning,
                    done,
                })
            }
            None => {}
        }
    }
    Err(tonic::Status::unavailable(
        "the stream ended without a final message",
    ))
}

/// How a generation that could be stopped ended.
pub(crate) enum Until {
    Done(Outcome),
    /// Stopped by Ctrl-C, with the text so far.
    Stopped(String),
}

/// `generate`, stopped by a SIGINT: the stream is dropped, which cancels the call, and
/// the daemon evicts the sequence before its next step.
pub(crate) async fn generate_until(
    client: &mut Client,
    req: pb::GenerateRequest,
    mut on_piece: impl FnMut(&str),
    sigint: &mut tokio::signal::unix::Signal,
) -> Result<Until, tonic::Status> {
    let call = client.generate(req);
    let mut stream = tokio::select! {
        r = call => r?.into_inner(),
        _ = sigint.recv() => return Ok(Until::Stopped(String::new())),
    };
    let (mut text, mut reasoning) = (String::new(), String::new());
    loop {
        let msg = tokio::select! {
            m = stream.next() => m,
            _ = sigint.recv() => return Ok(Until::Stopped(text)),
        };
        let Some(msg) = msg else { break };
        match msg?.event {
            Some(pb::generate_response::Event::Piece(p)) => {
                sluice_client::show_reasoning(&p.reasoning);
                reasoning.push_str(&p.reasoning);
                on_piece(&p.text);
                text.push_str(&p.text);
            }
            Some(pb::generate_response::Event::Done(done)) => {
                return Ok(Until::Done(Outcome {
                    text,
                    reasoning,
                    done,
                }))
            }
            None => {}
        }
    }
    Err(tonic::Status::unavailable(
        "the stream ended without a final message",
    ))
}

fn chat_request(
    s: &Sampling,
    system: &Option<String>,
    history: &[pb::ChatMessage],
) -> pb::GenerateRequest {
    let mut r = s.request();
    if let Some(sys) = system {
        r.messages.push(pb::ChatMessage {
            role: "system".into(),
            content: sys.clone(),
            ..Default::default()
        });
    }
    r.messages.extend(history.iter().cloned());
    r
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> std::process::ExitCode {
    match run(Cli::parse()).await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            // A batch job says how many of its items failed.
            match e.downcast_ref::<batch::ItemsFailed>() {
                Some(f) => std::process::ExitCode::from(f.count().min(100) as u8),
                None => std::process::ExitCode::FAILURE,
            }
        }
    }
}

async fn run(cli: Cli) -> Result<()> {
    let addr = Target {
        addr: resolve_addr(cli.addr.as_deref()),
        api_key: cli.api_key,
    };
    let model = cli.model.unwrap_or_default();
    match cli.cmd {
        Cmd::Generate {
            prompt,
            chat,
            system,
            s,
            json,
        } => cmd_generate(&addr, &model, prompt, chat, system, s, json).await,
        Cmd::Chat {
            system,
            history,
            no_history,
            tools,
            tool_choice,
            s,
        } => {
            let args = chat::ChatArgs {
                model,
                system,
                sampling: s,
                history,
                no_history,
                tools: match tools {
                    Some(path) => chat::read_tools(&path)?,
                    None => Vec::new(),
                },
                tool_choice,
            };
            chat::run(connect(&addr).await?, args).await
        }
        Cmd::Batch {
            input,
            output,
            format,
            errors,
            template,
            concurrency,
            shard,
            raw,
            truncate,
            force_params,
            retries,
            wait_daemon,
            json,
            s,
        } => {
            let job = batch::BatchJob {
                input,
                output,
                errors,
                format,
                template: batch::unescape(&template),
                concurrency,
                shard,
                raw,
                truncate,
                force_params,
                retries,
                wait_daemon_s: wait_daemon,
                json,
                base: pb::GenerateRequest {
                    model,
                    ..s.request()
                },
            };
            match batch::run(connect(&addr).await?, job).await? {
                None => Ok(()),
                Some(failed) => Err(failed.into()),
            }
        }
        Cmd::Status { json } => cmd_status(&addr, &model, json).await,
        Cmd::Models { json } => cmd_models(&addr, json, false).await,
        Cmd::Ps { json } => cmd_models(&addr, json, true).await,
        Cmd::Tokenize {
            text,
            add_special_tokens,
        } => cmd_tokenize(&addr, &model, text, add_special_tokens).await,
        Cmd::Cache {
            action: CacheCmd::Clear,
        } => cmd_cache_clear(&addr, &model).await,
    }
}

/// `-` stands for standard input, read whole.
fn text_or_stdin(text: String) -> Result<String> {
    if text != "-" {
        return Ok(text);
    }
    let mut s = String::new();
    std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
        .map_err(|e| anyhow::anyhow!("read the prompt from standard input: {e}"))?;
    Ok(s)
}

/// `sluice generate`: streams the text, or prints one JSON object.
async fn cmd_generate(
    addr: &Target,
    model: &str,
    prompt: String,
    chat: bool,
    system: Option<String>,
    s: Sampling,
    json: bool,
) -> Result<()> {
    let prompt = text_or_stdin(prompt)?;
    let mut client = connect(addr).await?;
    let req = if chat {
        chat_request(
            &s,
            &system,
            &[pb::ChatMessage {
                role: "user".into(),
                content: prompt,
                ..Default::default()
            }],
        )
    } else {
        pb::GenerateRequest {
            prompt,
            ..s.request()
        }
    };
    let req = pb::GenerateRequest {
        model: model.to_string(),
        ..req
    };
    let out = generate(&mut client, req, |t| {
        if !json {
            let mut o = std::io::stdout().lock();
            let _ = o.write_all(t.as_bytes());
            let _ = o.flush();
        }
    })
    .await
    .map_err(|st| anyhow::anyhow!("{:?}: {}", st.code(), st.message()))?;
    let stats = out.done.stats.unwrap_or_default();
    if json {
        let j = serde_json::json!({
            "prompt_token_ids": out.done.prompt_token_ids,
            "generated_token_ids": out.done.generated_token_ids,
            "text": out.text,
            "finish_reason": finish_name(out.done.finish_reason),
            "prompt_tokens": stats.prompt_tokens,
            "generated_tokens": stats.generated_tokens,
            "time_to_first_token_s": stats.time_to_first_token_s,
            "prefill_tokens_per_s": stats.prefill_tokens_per_s,
            "decode_tokens_per_s": stats.decode_tokens_per_s,
            "bytes_streamed": stats.bytes_streamed,
        });
        println!("{j}");
    } else {
        println!();
        eprintln!(
            "[{} | prompt {} tokens, generated {} | first token {:.3} s | decode {:.1} tokens/s]",
            finish_name(out.done.finish_reason),
            stats.prompt_tokens,
            stats.generated_tokens,
            stats.time_to_first_token_s,
            stats.decode_tokens_per_s
        );
    }
    // Only a generation that ended by itself succeeded: one the daemon cut off (its
    // shutdown) or that filled the context is an error for scripts to see.
    match finish_name(out.done.finish_reason) {
        "stop" | "length" | "stop_string" => Ok(()),
        other => bail!(
            "the generation ended with `{other}` after {} tokens, not by itself: {}",
            stats.generated_tokens,
            match other {
                "cancelled" => "the daemon cancelled it (shutting down?); send it again",
                "context" =>
                    "the context is full; lower --max-tokens or serve with a larger --max-context",
                _ => "the daemon did not say why",
            }
        ),
    }
}

/// `sluice status`: the daemon's plan, per-stage rates and queue.
async fn cmd_status(addr: &Target, model: &str, json: bool) -> Result<()> {
    let mut client = connect(addr).await?;
    let st = client
        .status(pb::StatusRequest {
            model: model.to_string(),
        })
        .await
        .map_err(|e| anyhow::anyhow!("{:?}: {}", e.code(), e.message()))?
        .into_inner();
    if json {
        println!("{}", status_json(&st));
    } else {
        let mib = |b: u64| format!("{:.1} MiB", b as f64 / 1048576.0);
        let dots = if st.int_dots.is_empty() {
            String::new()
        } else {
            format!(" ({} integer dots)", st.int_dots)
        };
        println!(
            "model            {} ({} backend, {} numerics{dots}, {} KV cache)",
            st.model, st.backend, st.numerics, st.kv_dtype
        );
        println!(
            "batch            up to {} sequences of {} positions",
            st.max_batch, st.max_context
        );
        println!(
            "device memory    {} peak of {} budget; KV cache {}; host cache {}",
            mib(st.device_bytes_peak),
            mib(st.device_bytes_budget),
            mib(st.kv_cache_bytes),
            mib(st.host_cache_bytes)
        );
        println!(
            "host memory      {} peak ({}) of {} planned, budget {}",
            mib(st.host_bytes_peak),
            st.host_bytes_peak_source,
            mib(st.host_bytes_planned),
            if st.host_bytes_budget > 0 {
                mib(st.host_bytes_budget)
            } else {
                "not limited".into()
            }
        );
        println!(
            "layers           {} resident, {} streamed ({} per pass)",
            st.layers_resident,
            st.layers_streamed,
            mib(st.bytes_streamed_per_pass)
        );
        println!(
            "last pass        {:.2} ms; decode {:.1} tokens/s",
            st.last_pass_time_s * 1e3,
            st.decode_tokens_per_s
        );
        println!(
            "queue            {} waiting, {} active",
            st.queue_depth, st.active_sequences
        );
        println!(
            "I/O              {}/{} read buffers free, {}/{} staging slots free; {} units failed, {} reads stalled, {} short",
            st.io_read_buffers_free,
            st.io_read_buffers,
            st.io_slots_free,
            st.io_slots,
            st.io_units_failed,
            st.io_reads_stalled,
            st.io_short_reads
        );
        if st.io_slots_pageable > 0 {
            println!(
                "                 {} staging slots pageable (page-locking refused): uploads from them are slower",
                st.io_slots_pageable
            );
        }
        print_engine_features(&st);
        if !st.expert_routing.is_empty() {
            println!("experts          tokens per expert since load, per sparse layer: the most chosen (share of the layer's tokens)");
            for r in &st.expert_routing {
                println!("  layer {:<4} {}", r.layer, hot_experts(&r.tokens, 4));
            }
        }
        if let Some(x) = st.expert_streaming.as_ref().filter(|x| x.routed > 0) {
            let share = |a: u64, b: u64| if b == 0 { 0.0 } else { a as f64 / b as f64 };
            println!(
                "expert cache     {} slots{}: {} of {} routed experts served ({:.2}), {} loaded ({}); prediction precision {:.2} ({} of {} prefetched unused)",
                x.cache_slots,
                if x.hot_slots > 0 {
                    format!(" ({} pinned from the expert profile)", x.hot_slots)
                } else {
                    String::new()
                },
                x.cache_hits,
                x.routed,
                share(x.cache_hits, x.routed),
                x.loaded,
                mib(x.bytes_loaded),
                share(x.predicted_used, x.predicted),
                x.prefetched_unused,
                x.prefetched,
            );
        }
        println!("stages (last pass seconds, rate):");
        for s in &st.stages {
            println!(
                "  {:<11} {:>8.2} ms  {:>9.1} MB/s{}",
                s.stage,
                s.stall_s * 1e3,
                s.bytes_per_s / 1e6,
                if s.stage == st.limiting_stage {
                    "  <- limits the pass"
                } else {
                    ""
                }
            );
        }
    }
    Ok(())
}

/// `sluice models` and `sluice ps` (only the loaded ones).
async fn cmd_models(addr: &Target, json: bool, loaded_only: bool) -> Result<()> {
    let mut client = connect(addr).await?;
    let r = client
        .list_models(pb::ListModelsRequest { loaded_only })
        .await
        .map_err(|e| anyhow::anyhow!("{:?}: {}", e.code(), e.message()))?
        .into_inner();
    let mib = |b: u64| format!("{:.1} MiB", b as f64 / 1048576.0);
    let until = |m: &pb::ModelInfo| {
        if m.unload_in_s < 0.0 {
            if m.active_requests > 0 {
                format!("busy ({} requests)", m.active_requests)
            } else {
                "stays loaded".to_string()
            }
        } else {
            format!("unloads in {:.0} s", m.unload_in_s)
        }
    };
    if !json && loaded_only {
        println!(
            "{:<24} {:>12} {:>12} {:>12} {:>12} {:>12} {:>9}  UNTIL",
            "NAME", "DEVICE", "HOST", "PREFIX KV", "KV HOST", "KV DISK", "REQUESTS"
        );
    }
    for m in r.models {
        if json {
            println!(
                "{}",
                serde_json::json!({
                    "name": m.name, "architecture": m.architecture, "layers": m.layers,
                    "hidden_size": m.hidden_size, "vocab_size": m.vocab_size,
                    "context_length": m.context_length, "stored_bytes": m.stored_bytes,
                    "raw_bytes": m.raw_bytes, "quantization": m.quantization,
                    "loaded": m.loaded, "device_bytes": m.device_bytes, "host_bytes": m.host_bytes,
                    "unload_in_s": m.unload_in_s, "active_requests": m.active_requests,
                    "path": m.path, "prefix_cache_bytes": m.prefix_cache_bytes,
                    "kv_host_bytes": m.kv_host_bytes, "kv_disk_bytes": m.kv_disk_bytes,
                })
            );
        } else if loaded_only {
            println!(
                "{:<24} {:>12} {:>12} {:>12} {:>12} {:>12} {:>9}  {}",
                m.name,
                mib(m.device_bytes),
                mib(m.host_bytes),
                mib(m.prefix_cache_bytes),
                mib(m.kv_host_bytes),
                mib(m.kv_disk_bytes),
                m.active_requests,
                until(&m)
            );
        } else {
            println!(
                "{}  {} {} layers {} hidden {} vocab {} context {} stored {} raw {}{}",
                m.name,
                m.architecture,
                m.quantization,
                m.layers,
                m.hidden_size,
                m.vocab_size,
                m.context_length,
                mib(m.stored_bytes),
                mib(m.raw_bytes),
                if m.loaded {
                    format!("  loaded, {}", until(&m))
                } else {
                    String::new()
                }
            );
        }
    }
    Ok(())
}

/// `sluice tokenize`.
async fn cmd_cache_clear(addr: &Target, model: &str) -> Result<()> {
    let mut client = connect(addr).await?;
    let r = client
        .clear_cache(pb::ClearCacheRequest {
            model: model.to_string(),
        })
        .await
        .map_err(|e| anyhow::anyhow!("{:?}: {}", e.code(), e.message()))?
        .into_inner();
    if r.models.is_empty() {
        println!("no model is loaded: nothing to clear");
    }
    for m in r.models {
        println!(
            "{}: prefix cache emptied, {} positions of KV given up",
            m.model, m.positions
        );
    }
    Ok(())
}

async fn cmd_tokenize(
    addr: &Target,
    model: &str,
    text: String,
    add_special_tokens: bool,
) -> Result<()> {
    let text = text_or_stdin(text)?;
    let mut client = connect(addr).await?;
    let r = client
        .tokenize(pb::TokenizeRequest {
            model: model.to_string(),
            text,
            add_special_tokens,
            ..Default::default()
        })
        .await
        .map_err(|e| anyhow::anyhow!("{:?}: {}", e.code(), e.message()))?
        .into_inner();
    println!(
        "{}",
        serde_json::json!({"token_ids": r.token_ids, "texts": r.texts, "pieces": r.pieces})
    );
    Ok(())
}

/// A file that holds JSON (`--json-schema`): its text.
fn read_text_file(path: &str) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("read {path}: {e}"))
}

fn read_json_file(path: &str) -> Result<String, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("read {path}: {e}"))?;
    serde_json::from_str::<serde_json::Value>(&text)
        .map_err(|e| format!("{path} is not JSON: {e}"))?;
    Ok(text)
}
