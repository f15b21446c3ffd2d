//! `sluice batch`: a JSONL file through the daemon, one output line per input line that
//! finished, resumable, shardable across machines, in two formats:
//!
//! - simple: `{"id", "text"}` in, `{"id", "output", "finish_reason", ...}` out, the text
//!   put into `--template`;
//! - openai: OpenAI's batch input (`{"custom_id", "method": "POST", "url", "body"}`) in,
//!   its output (`{"id", "custom_id", "response": {"status_code", "request_id", "body"},
//!   "error"}`) out, each body answered by the daemon's `Complete` call exactly as its
//!   HTTP API answers it.
//!
//! Only items that finished (an end token, max_tokens, a stop string) are written. A
//! cancelled or failed attempt is retried; what cannot succeed as it is (a bad input line,
//! a prompt the context cannot hold) goes to the errors file with its line and reason;
//! what still failed after the retries is written nowhere, so a rerun does it. The output
//! has a `.params.json` beside it: a rerun with other parameters is refused.
//!
//! Items go longest first, with the daemon's max batch in flight; the summary at the end
//! takes the bytes streamed from the daemon's Status before and after the job.

use crate::{Client, Outcome};
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use sluice_client::pb;
use sluice_proto::sampling::SamplingArgs;
use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// {"id", "text"} lines in; {"id", "output", "finish_reason", ...} lines out.
    Simple,
    /// OpenAI's batch file format (as OpenAI's Batch API and vLLM's run-batch).
    Openai,
}

/// A `sluice batch` job.
pub struct BatchJob {
    pub input: PathBuf,
    pub output: PathBuf,
    /// Where bad lines and items that cannot succeed go (default OUTPUT.errors.jsonl).
    pub errors: Option<PathBuf>,
    pub format: Format,
    pub template: String,
    /// Requests in flight; None: the daemon's max batch.
    pub concurrency: Option<usize>,
    pub shard: Option<String>,
    pub raw: bool,
    pub truncate: bool,
    pub force_params: bool,
    /// Attempts after the first for a cancelled or failed item.
    pub retries: u32,
    /// Seconds to wait for a daemon that is down or restarting before giving items up.
    pub wait_daemon_s: u64,
    pub json: bool,
    /// max_tokens, sampling and stop strings of the simple format's requests.
    pub base: pb::GenerateRequest,
}

/// The items of a job that failed: those in the errors file (they fail again as they
/// are) and those that did not finish (a rerun retries them). The exit status is their
/// sum, at most 100.
#[derive(Debug)]
pub struct ItemsFailed {
    pub errors: u64,
    pub unfinished: u64,
}

impl ItemsFailed {
    pub fn count(&self) -> u64 {
        self.errors + self.unfinished
    }
}

impl std::fmt::Display for ItemsFailed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} items failed: {} in the errors file (they fail again as they are), {} unfinished (a rerun retries them)",
            self.count(),
            self.errors,
            self.unfinished
        )
    }
}

impl std::error::Error for ItemsFailed {}

/// `\n`, `\t` and `\\` in a template as written on a command line become the characters.
pub fn unescape(t: &str) -> String {
    let mut out = String::with_capacity(t.len());
    let mut it = t.chars();
    while let Some(c) = it.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match it.next() {
            Some('n') => out.push('\n'),
            Some('t') => out.push('\t'),
            Some('\\') => out.push('\\'),
            Some(o) => {
                out.push('\\');
                out.push(o);
            }
            None => out.push('\\'),
        }
    }
    out
}

/// FNV-1a: a stable hash for sharding ids across machines.
fn fnv1a(s: &str) -> u64 {
    s.bytes().fold(0xcbf29ce484222325u64, |h, b| {
        (h ^ b as u64).wrapping_mul(0x100000001b3)
    })
}

/// An id as the input gives it: a string, or a number written as text.
fn id_of(v: &Value, key: &str) -> Option<String> {
    match v.get(key)? {
        Value::String(s) => Some(s.clone()),
        Value::Number(n) => Some(n.to_string()),
        _ => None,
    }
}

fn id_key(format: Format) -> &'static str {
    match format {
        Format::Simple => "id",
        Format::Openai => "custom_id",
    }
}

/// Ids already in OUT. A last line without its newline (a killed run) is cut off, so the
/// item is done again and written whole.
fn done_ids(output: &Path, key: &str) -> Result<HashSet<String>> {
    let mut done = HashSet::new();
    let Ok(bytes) = std::fs::read(output) else {
        return Ok(done);
    };
    let complete = match bytes.iter().rposition(|&b| b == b'\n') {
        Some(i) => i + 1,
        None => 0,
    };
    if complete < bytes.len() {
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(output)
            .with_context(|| format!("open {}", output.display()))?;
        f.set_len(complete as u64)
            .with_context(|| format!("truncate the partial last line of {}", output.display()))?;
        eprintln!(
            "{}: removed a partial last line ({} bytes) left by an interrupted run",
            output.display(),
            bytes.len() - complete
        );
    }
    for line in bytes[..complete]
        .split(|&b| b == b'\n')
        .filter(|l| !l.is_empty())
    {
        if let Some(id) = serde_json::from_slice::<Value>(line)
            .ok()
            .as_ref()
            .and_then(|v| id_of(v, key))
        {
            done.insert(id);
        }
    }
    Ok(done)
}

/// `--shard K/N` as (K - 1, N).
pub fn parse_shard(sh: &str) -> Result<(u64, u64)> {
    let (k, n) = sh.split_once('/').context("--shard takes K/N, e.g. 2/8")?;
    let (k, n): (u64, u64) = (
        k.parse().context("--shard K")?,
        n.parse().context("--shard N")?,
    );
    if n == 0 || k == 0 || k > n {
        bail!("--shard {sh}: K must be in 1..=N");
    }
    Ok((k - 1, n))
}

/// What one item asks of the daemon.
#[derive(Clone)]
enum Work {
    Generate(Box<pb::GenerateRequest>),
    Complete { url: String, body: String },
}

struct Item {
    line: usize,
    id: String,
    work: Work,
    /// Bytes of the prompt: longest first, so the job does not end waiting on one long item.
    size: usize,
}

/// An input line that cannot run, with its line number.
struct BadLine {
    line: usize,
    id: Option<String>,
    message: String,
}

/// The items of `input` still to do (in this shard, not in `done`), and the lines that are
/// not valid (bad JSON, a missing field, an id seen before).
fn read_items(
    job: &BatchJob,
    shard: Option<(u64, u64)>,
    done: &HashSet<String>,
) -> Result<(Vec<Item>, Vec<BadLine>)> {
    let text = std::fs::read_to_string(&job.input)
        .with_context(|| format!("read {}", job.input.display()))?;
    let mut items = Vec::new();
    let mut bad = Vec::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    let key = id_key(job.format);
    for (i, line) in text.lines().enumerate() {
        let n = i + 1;
        if line.trim().is_empty() {
            continue;
        }
        let mut fail = |id: Option<String>, message: String| {
            bad.push(BadLine {
                line: n,
                id,
                message,
            })
        };
        let v: Value = match serde_json::from_str(line) {
            Ok(v) => v,
            Err(e) => {
                fail(None, format!("not JSON: {e}"));
                continue;
            }
        };
        let Some(id) = id_of(&v, key) else {
            fail(None, format!("no \"{key}\" (a string or a number)"));
            continue;
        };
        if let Some(first) = seen.insert(id.clone(), n) {
            fail(
                Some(id.clone()),
                format!("{key} {id:?} appears twice (first on line {first})"),
            );
            continue;
        }
        let work = match job.format {
            Format::Simple => match v.get("text").or_else(|| v.get("prompt")) {
                Some(Value::String(t)) => {
                    let prompt = job.template.replace("{text}", t);
                    Work::Generate(Box::new(if job.raw {
                        pb::GenerateRequest {
                            prompt,
                            ..job.base.clone()
                        }
                    } else {
                        pb::GenerateRequest {
                            messages: vec![crate::chat::user(prompt)],
                            ..job.base.clone()
                        }
                    }))
                }
                _ => {
                    fail(Some(id), "no \"text\" (a string)".into());
                    continue;
                }
            },
            Format::Openai => {
                let method = v.get("method").and_then(Value::as_str);
                let url = v.get("url").and_then(Value::as_str);
                match (method, url, v.get("body")) {
                    (
                        Some("POST"),
                        Some(u @ ("/v1/chat/completions" | "/v1/completions")),
                        Some(b),
                    ) if b.is_object() => Work::Complete {
                        url: u.to_string(),
                        body: b.to_string(),
                    },
                    (m, u, b) => {
                        let why = if m != Some("POST") {
                            "\"method\" must be \"POST\"".to_string()
                        } else if !matches!(u, Some("/v1/chat/completions" | "/v1/completions")) {
                            format!("\"url\" {u:?}: /v1/chat/completions or /v1/completions")
                        } else {
                            format!("\"body\" must be an object, not {b:?}")
                        };
                        fail(Some(id), why);
                        continue;
                    }
                }
            }
        };
        if shard.is_some_and(|(k, n)| fnv1a(&id) % n != k) || done.contains(&id) {
            continue;
        }
        let size = match &work {
            Work::Generate(r) => {
                r.prompt.len() + r.messages.iter().map(|m| m.content.len()).sum::<usize>()
            }
            Work::Complete { body, .. } => body.len(),
        };
        items.push(Item {
            line: n,
            id,
            work,
            size,
        });
    }
    Ok((items, bad))
}

/// How one attempt ended.
enum Attempt {
    /// Finished: the output line and its token counts.
    Written { line: Value, generated: u64 },
    /// The queue was full: wait and send again (not an attempt).
    Busy,
    /// The daemon is not there, or went away mid-item (killed, restarting, shutting down):
    /// wait for it (up to --wait-daemon) and send again; not the item's fault.
    Down(String),
    /// Cancelled, a transport or data error: worth another attempt.
    Retry(String),
    /// Will fail again as it is: the errors file gets this line.
    Permanent(Value),
}

fn finish_name(f: i32) -> &'static str {
    crate::finish_name(f)
}

fn simple_attempt(id: &str, r: Result<Outcome, tonic::Status>) -> Attempt {
    match r {
        Ok(o) => {
            let stats = o.done.stats.unwrap_or_default();
            let finish = finish_name(o.done.finish_reason);
            match finish {
                "stop" | "length" | "stop_string" => Attempt::Written {
                    line: json!({
                        "id": id, "output": o.text, "finish_reason": finish,
                        "prompt_tokens": stats.prompt_tokens, "generated_tokens": stats.generated_tokens,
                        "bytes_streamed": stats.bytes_streamed, "truncated": o.done.prompt_truncated,
                    }),
                    generated: u64::from(stats.generated_tokens),
                },
                "context" => Attempt::Permanent(json!({"id": id, "error": "context_full",
                    "message": "the context filled before the item finished; lower --max-tokens or use --truncate"})),
                // The daemon cancels what runs when it shuts down.
                "cancelled" => Attempt::Down("the daemon cancelled it (shutting down?)".into()),
                other => Attempt::Retry(format!("finished with {other}")),
            }
        }
        Err(st) => status_attempt(
            &st,
            || json!({"id": id, "error": format!("{:?}", st.code()), "message": st.message()}),
        ),
    }
}

/// A gRPC error: back-pressure, worth retrying, or permanent.
fn status_attempt(st: &tonic::Status, permanent: impl FnOnce() -> Value) -> Attempt {
    use tonic::Code::*;
    match st.code() {
        ResourceExhausted => Attempt::Busy,
        Unavailable => Attempt::Down(format!("{:?}: {}", st.code(), st.message())),
        Cancelled | DataLoss | Internal | Unknown | DeadlineExceeded | Aborted => {
            Attempt::Retry(format!("{:?}: {}", st.code(), st.message()))
        }
        _ => Attempt::Permanent(permanent()),
    }
}

fn openai_attempt(
    custom_id: &str,
    r: Result<tonic::Response<pb::CompleteResponse>, tonic::Status>,
) -> Attempt {
    let resp = match r {
        Ok(r) => r.into_inner(),
        Err(st) => {
            return status_attempt(&st, || {
                json!({"id": null, "custom_id": custom_id, "response": null,
                       "error": {"code": format!("{:?}", st.code()), "message": st.message()}})
            })
        }
    };
    let body: Value = serde_json::from_str(&resp.body_json).unwrap_or(Value::Null);
    let request_id = body.get("id").cloned().unwrap_or(Value::Null);
    let line = |error: Value| {
        json!({
            "id": match request_id.as_str() {
                Some(r) => format!("batch_req_{r}"),
                None => format!("batch_req_{:016x}", fnv1a(custom_id)),
            },
            "custom_id": custom_id,
            "response": {"status_code": resp.status_code, "request_id": request_id, "body": body},
            "error": error,
        })
    };
    match resp.status_code {
        200 => {
            let generated = body["usage"]["completion_tokens"].as_u64().unwrap_or(0);
            Attempt::Written {
                line: line(Value::Null),
                generated,
            }
        }
        429 => Attempt::Busy,
        503 => Attempt::Down(format!(
            "503: {}",
            body["error"]["message"].as_str().unwrap_or("")
        )),
        500 => Attempt::Retry(format!(
            "{}: {}",
            resp.status_code,
            body["error"]["message"].as_str().unwrap_or("")
        )),
        _ => Attempt::Permanent(line(body["error"].clone())),
    }
}

/// How an item is retried.
#[derive(Clone, Copy)]
struct Patience {
    truncate: bool,
    /// Attempts after the first for a retryable failure.
    retries: u32,
    /// How long to wait for a daemon that is down before giving the item up.
    wait_daemon: Duration,
}

/// One item to its end: sent again after back-pressure (always), while the daemon is down
/// or restarting (for up to `wait_daemon`, waiting 0.5, 1, 2 ... 10 s between tries) and
/// after a retryable failure (`retries` times, waiting 1, 2, 4 ... 30 s).
async fn run_item(mut client: Client, item: &Item, p: Patience) -> Attempt {
    let (truncate, retries) = (p.truncate, p.retries);
    let mut busy_wait = Duration::from_millis(100);
    let mut retry_wait = Duration::from_secs(1);
    let mut down_wait = Duration::from_millis(500);
    let mut down_since: Option<std::time::Instant> = None;
    let mut tries = 0;
    loop {
        let a = match &item.work {
            Work::Generate(req) => {
                let mut req = pb::GenerateRequest::clone(req);
                req.truncate = truncate;
                simple_attempt(&item.id, crate::generate(&mut client, req, |_| {}).await)
            }
            Work::Complete { url, body } => openai_attempt(
                &item.id,
                client
                    .complete(pb::CompleteRequest {
                        url: url.clone(),
                        body_json: body.clone(),
                        truncate,
                    })
                    .await,
            ),
        };
        match a {
            Attempt::Busy => {
                down_since = None;
                tokio::time::sleep(busy_wait).await;
                busy_wait = (busy_wait * 2).min(Duration::from_secs(5));
            }
            Attempt::Down(why) => {
                let since = *down_since.get_or_insert_with(std::time::Instant::now);
                if since.elapsed() >= p.wait_daemon {
                    return Attempt::Retry(format!(
                        "{why}; the daemon was not back within {:?} (--wait-daemon)",
                        p.wait_daemon
                    ));
                }
                if down_wait == Duration::from_millis(500) {
                    eprintln!(
                        "{}: {why}; waiting up to {:?} for the daemon",
                        item.id, p.wait_daemon
                    );
                }
                tokio::time::sleep(down_wait).await;
                down_wait = (down_wait * 2).min(Duration::from_secs(10));
            }
            Attempt::Retry(why) if tries < retries => {
                tries += 1;
                eprintln!(
                    "{}: {why}; attempt {} of {} in {:?}",
                    item.id,
                    tries + 1,
                    retries + 1,
                    retry_wait
                );
                tokio::time::sleep(retry_wait).await;
                retry_wait = (retry_wait * 2).min(Duration::from_secs(30));
            }
            other => return other,
        }
    }
}

/// The parameters an output was made with, kept beside it as OUTPUT.params.json.
fn params_of(job: &BatchJob, model: &pb::ModelInfo) -> Value {
    let s = job.base.sampling.clone().unwrap_or_default();
    let mut p = json!({
        "format": format!("{:?}", job.format).to_lowercase(),
        "model": {"name": model.name, "architecture": model.architecture, "raw_bytes": model.raw_bytes, "stored_bytes": model.stored_bytes},
        "truncate": job.truncate,
    });
    if job.format == Format::Simple {
        p["template"] = json!(job.template);
        p["raw"] = json!(job.raw);
        p["max_tokens"] = json!(job.base.max_tokens);
        p["sampling"] = json!(SamplingArgs::of_request(&s));
        p["stop"] = json!(job.base.stop);
        // Only where it is on, so outputs made before JSON mode existed still resume.
        match job.base.response_format() {
            pb::ResponseFormat::Text => {}
            pb::ResponseFormat::JsonObject => p["response_format"] = json!("json_object"),
            pb::ResponseFormat::JsonSchema => {
                let schema: Value =
                    serde_json::from_str(&job.base.json_schema).unwrap_or(Value::Null);
                p["response_format"] = json!({"json_schema": schema});
            }
            pb::ResponseFormat::Regex => p["response_format"] = json!({"regex": job.base.regex}),
            pb::ResponseFormat::Grammar => {
                p["response_format"] = json!({"grammar": job.base.grammar});
            }
            pb::ResponseFormat::Choice => p["response_format"] = json!({"choice": job.base.choice}),
        }
    }
    p
}

fn params_path(output: &Path) -> PathBuf {
    let mut p = output.as_os_str().to_owned();
    p.push(".params.json");
    PathBuf::from(p)
}

fn errors_path(job: &BatchJob) -> PathBuf {
    job.errors.clone().unwrap_or_else(|| {
        let mut p = job.output.as_os_str().to_owned();
        p.push(".errors.jsonl");
        PathBuf::from(p)
    })
}

/// Refuses to add to an output made with other parameters, unless forced.
fn check_params(job: &BatchJob, want: &Value, done: usize) -> Result<()> {
    let path = params_path(&job.output);
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            let had: Value = serde_json::from_str(&text)
                .with_context(|| format!("{} is not JSON", path.display()))?;
            if &had != want && done > 0 && !job.force_params {
                // Keys of either (one may be only in the old file: a mode now off).
                let keys: std::collections::BTreeSet<&String> = [want, &had]
                    .into_iter()
                    .filter_map(Value::as_object)
                    .flat_map(|m| m.keys())
                    .collect();
                let diff: Vec<String> = keys
                    .into_iter()
                    .filter(|k| had.get(k.as_str()) != want.get(k.as_str()))
                    .map(|k| {
                        let of = |v: &Value| v.get(k.as_str()).cloned().unwrap_or(Value::Null);
                        format!("{k}: {} -> {}", of(&had), of(want))
                    })
                    .collect();
                bail!(
                    "{} holds {done} items made with other parameters ({}); use a new output file, or --force-params to add to it anyway",
                    job.output.display(),
                    diff.join("; ")
                );
            }
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(e).with_context(|| format!("read {}", path.display())),
    }
    let tmp = path.with_extension("json.tmp");
    std::fs::write(&tmp, format!("{want:#}\n"))
        .with_context(|| format!("write {}", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("write {}", path.display()))?;
    Ok(())
}

/// Appends whole lines and flushes each: a kill leaves whole lines, or one partial last
/// line that the next run removes.
struct Lines {
    file: std::fs::File,
    path: PathBuf,
}

impl Lines {
    fn open(path: &Path, truncate: bool) -> Result<Lines> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(!truncate)
            .write(true)
            .truncate(truncate)
            .open(path)
            .with_context(|| format!("open {}", path.display()))?;
        Ok(Lines {
            file,
            path: path.to_path_buf(),
        })
    }

    fn put(&mut self, v: &Value) -> Result<()> {
        self.file
            .write_all(format!("{v}\n").as_bytes())
            .and_then(|()| self.file.flush())
            .with_context(|| format!("write {}", self.path.display()))
    }
}

fn bad_line(format: Format, b: &BadLine) -> Value {
    match format {
        Format::Simple => {
            json!({"id": b.id, "line": b.line, "error": "invalid_line", "message": b.message})
        }
        Format::Openai => json!({"id": null, "custom_id": b.id, "response": null,
            "error": {"code": "invalid_line", "line": b.line, "message": b.message}}),
    }
}

/// Runs the job; what failed, if anything (nothing: every item of this shard is in the
/// output).
pub async fn run(client: Client, job: BatchJob) -> Result<Option<ItemsFailed>> {
    let mut client = client;
    let shard = job.shard.as_deref().map(parse_shard).transpose()?;
    let key = id_key(job.format);
    let done = done_ids(&job.output, key)?;
    let models = client
        .list_models(pb::ListModelsRequest::default())
        .await
        .map_err(|e| anyhow::anyhow!("{:?}: {}", e.code(), e.message()))?
        .into_inner()
        .models;
    // The model the items name (--model), else the daemon's default: the one loaded.
    let want = &job.base.model;
    let model = match models.iter().find(|m| &m.name == want) {
        Some(m) => m.clone(),
        None if want.is_empty() => models
            .iter()
            .find(|m| m.loaded)
            .or(models.first())
            .cloned()
            .unwrap_or_default(),
        None => bail!(
            "the daemon has no model {want:?}; it serves {}",
            models
                .iter()
                .map(|m| m.name.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    // Every request names the model, so a daemon serving several is not left to guess.
    let mut job = job;
    if job.base.model.is_empty() {
        job.base.model = model.name.clone();
    }
    check_params(&job, &params_of(&job, &model), done.len())?;
    let (mut items, bad) = read_items(&job, shard, &done)?;
    let status = client
        .status(pb::StatusRequest {
            model: model.name.clone(),
        })
        .await
        .map_err(|e| anyhow::anyhow!("{:?}: {}", e.code(), e.message()))?
        .into_inner();
    let concurrency = job
        .concurrency
        .unwrap_or(if status.max_batch > 0 {
            status.max_batch as usize
        } else {
            8
        })
        .max(1);
    items.sort_by(|a, b| b.size.cmp(&a.size).then(a.line.cmp(&b.line)));
    let errors_path = errors_path(&job);
    let mut errors = Lines::open(&errors_path, true)?;
    for b in &bad {
        eprintln!("{}:{}: {}", job.input.display(), b.line, b.message);
        errors.put(&bad_line(job.format, b))?;
    }
    eprintln!(
        "{} items to do ({} already in {}, {} bad lines), {concurrency} in flight",
        items.len(),
        done.len(),
        job.output.display(),
        bad.len()
    );
    let pb = indicatif::ProgressBar::new(items.len() as u64);
    pb.set_style(
        indicatif::ProgressStyle::with_template(
            "[{elapsed_precise}] {bar:40} {pos}/{len} {per_sec} eta {eta}",
        )
        .unwrap_or_else(|_| indicatif::ProgressStyle::default_bar()),
    );
    let mut out = Lines::open(&job.output, false)?;
    let total = items.len();
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(usize, Attempt)>(concurrency);
    let sem = std::sync::Arc::new(tokio::sync::Semaphore::new(concurrency));
    let items = std::sync::Arc::new(items);
    let t0 = Instant::now();
    {
        let (items, client) = (items.clone(), client.clone());
        let patience = Patience {
            truncate: job.truncate,
            retries: job.retries,
            wait_daemon: Duration::from_secs(job.wait_daemon_s),
        };
        tokio::spawn(async move {
            for k in 0..items.len() {
                let Ok(permit) = sem.clone().acquire_owned().await else {
                    return;
                };
                let (client, tx, items) = (client.clone(), tx.clone(), items.clone());
                tokio::spawn(async move {
                    let a = run_item(client, &items[k], patience).await;
                    let _ = tx.send((k, a)).await;
                    drop(permit);
                });
            }
        });
    }
    let (mut written, mut permanent, mut unfinished, mut generated) =
        (0u64, bad.len() as u64, 0u64, 0u64);
    for _ in 0..total {
        let Some((k, a)) = rx.recv().await else {
            break;
        };
        let item = &items[k];
        match a {
            Attempt::Written { line, generated: g } => {
                out.put(&line)?;
                written += 1;
                generated += g;
            }
            Attempt::Permanent(line) => {
                permanent += 1;
                let why = line["error"]["message"]
                    .as_str()
                    .or(line["message"].as_str())
                    .unwrap_or("failed");
                pb.suspend(|| {
                    eprintln!("{}:{}: {}: {why}", job.input.display(), item.line, item.id)
                });
                errors.put(&line)?;
            }
            Attempt::Retry(why) => {
                unfinished += 1;
                pb.suspend(|| {
                    eprintln!(
                        "{}: {why} after {} attempts; not written (rerun to retry)",
                        item.id,
                        job.retries + 1
                    )
                });
            }
            Attempt::Busy | Attempt::Down(_) => unfinished += 1,
        }
        pb.inc(1);
    }
    pb.finish_and_clear();
    let wall = t0.elapsed().as_secs_f64();
    let after = client
        .status(pb::StatusRequest {
            model: status.model.clone(),
        })
        .await
        .map(|r| r.into_inner())
        .unwrap_or_default();
    let streamed = after
        .bytes_streamed_total
        .saturating_sub(status.bytes_streamed_total);
    let summary = json!({
        "items": total, "written": written, "errors": permanent, "unfinished": unfinished,
        "already_done": done.len(), "concurrency": concurrency, "wall_s": wall,
        "documents_per_minute": written as f64 * 60.0 / wall.max(1e-9),
        "generated_tokens": generated, "generated_tokens_per_s": generated as f64 / wall.max(1e-9),
        "bytes_streamed": streamed,
        "bytes_streamed_per_generated_token": if generated > 0 { streamed as f64 / generated as f64 } else { 0.0 },
        "output": job.output, "errors_file": errors_path,
    });
    eprintln!(
        "{written} written to {} in {wall:.1} s: {:.1} documents/minute, {:.1} generated tokens/s, {:.0} bytes streamed per generated token (the daemon's total, other clients included)",
        job.output.display(),
        summary["documents_per_minute"].as_f64().unwrap_or(0.0),
        summary["generated_tokens_per_s"].as_f64().unwrap_or(0.0),
        summary["bytes_streamed_per_generated_token"].as_f64().unwrap_or(0.0),
    );
    if permanent > 0 {
        eprintln!(
            "{permanent} failed as they are (bad lines, prompts that do not fit): see {}",
            errors_path.display()
        );
    }
    if unfinished > 0 {
        eprintln!(
            "{unfinished} did not finish after their retries: not written; rerun to retry them"
        );
    }
    if job.json {
        println!("{summary}");
    }
    Ok((permanent + unfinished > 0).then_some(ItemsFailed {
        errors: permanent,
        unfinished,
    }))
}
