//! The OpenAI-compatible HTTP API end to end: `sluiced serve` as a real process on
//! loopback, driven by clients nobody here wrote — the official `openai` Python package,
//! curl, `prometheus_client`'s parser — beside the gRPC clients on the same scheduler.

use serde_json::{json, Value};
use sluice_tests::*;
use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

fn python(args: &[&str]) -> Value {
    python_json("openai_client.py", args, "openai prometheus_client")
}

/// POSTs `body` to `path`; returns the status, the headers and the body.
fn post(d: &Daemon, path: &str, body: &str, extra: &[&str]) -> (u16, String, String) {
    let url = format!("{}{path}", d.http);
    let mut args = vec![
        "-s",
        "-D",
        "-",
        "-d",
        body,
        "-H",
        "Content-Type: application/json",
    ];
    args.extend_from_slice(extra);
    args.push(&url);
    split_response(&stdout(&curl(&args)))
}

/// A small completion every test uses to see that the daemon serves.
fn hi(d: &Daemon) -> (u16, String, String) {
    post(
        d,
        "/v1/completions",
        r#"{"prompt":"Hi","max_tokens":3}"#,
        &[],
    )
}

fn get(d: &Daemon, path: &str, extra: &[&str]) -> (u16, String, String) {
    let url = format!("{}{path}", d.http);
    let mut args = vec!["-s", "-D", "-"];
    args.extend_from_slice(extra);
    args.push(&url);
    split_response(&stdout(&curl(&args)))
}

/// `curl -D -` output: status line and headers, a blank line, the body.
fn split_response(raw: &str) -> (u16, String, String) {
    let (mut head, mut body) = raw.split_once("\r\n\r\n").unwrap_or((raw, ""));
    // `HTTP/1.1 100 Continue` before the answer to a large body.
    while head.starts_with("HTTP/1.1 1") {
        (head, body) = body.split_once("\r\n\r\n").unwrap_or((body, ""));
    }
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no HTTP status in {raw:?}"));
    (status, head.to_ascii_lowercase(), body.to_string())
}

/// An OpenAI-shaped error body: `{"error": {"message", "type", "param", "code"}}`.
fn assert_error(status: u16, want: u16, body: &str, needle: &str) -> Value {
    assert_eq!(status, want, "{body}");
    let v: Value = serde_json::from_str(body).unwrap_or_else(|e| panic!("{e}: {body}"));
    let e = &v["error"];
    for k in ["message", "type", "param", "code"] {
        assert!(e.get(k).is_some(), "error without {k}: {body}");
    }
    assert!(
        e["message"].as_str().unwrap().contains(needle),
        "{needle:?} not in {body}"
    );
    v
}

/// Reads server-sent events from `raw`: every non-empty line must be a `data:` line whose
/// payload is JSON, and the last one `[DONE]`. Returns the JSON payloads.
fn sse_chunks(raw: &str) -> Vec<Value> {
    let lines: Vec<&str> = raw.lines().filter(|l| !l.is_empty()).collect();
    assert_eq!(lines.last(), Some(&"data: [DONE]"), "{raw}");
    lines[..lines.len() - 1]
        .iter()
        .map(|l| {
            let payload = l
                .strip_prefix("data: ")
                .unwrap_or_else(|| panic!("not a data line: {l:?}"));
            serde_json::from_str(payload).unwrap_or_else(|e| panic!("{e}: {payload}"))
        })
        .collect()
}

/// `curl -N` streaming a completion in the background.
fn spawn_stream(d: &Daemon, path: &str, body: &Value) -> Child {
    Command::new("curl")
        .args(["-sN", "-d", &body.to_string()])
        .arg(format!("{}{path}", d.http))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("curl")
}

fn sluice(d: &Daemon, args: &[&str]) -> std::process::Output {
    Command::new(bin("sluice"))
        .arg("--addr")
        .arg(&d.addr)
        .args(args)
        .env_remove("SLUICE_API_KEY")
        .output()
        .expect("spawn sluice")
}

fn sluiced_run(d: &Daemon, args: &[&str]) -> Value {
    let store = d.store();
    let mut a = vec![
        "run",
        "--temperature",
        "0",
        store.to_str().unwrap(),
        "--max-context",
        "256",
        "--json",
    ];
    a.extend_from_slice(args);
    serde_json::from_str(&sluiced_ok(&a)).unwrap()
}

#[test]
fn the_openai_client_gets_what_sluiced_run_gives() {
    let d = Daemon::start(&["--max-context", "256", "--max-batch", "4"]);
    let chat = "What is the capital of France?";
    let ids = "1,504,2365,282,5013";
    let got = python(&["basic", &d.http, chat, PROMPTS[0], ids, "24"]);
    let models = got["models"].as_array().unwrap();
    assert_eq!(models.len(), 1);
    assert_eq!(models[0]["id"], "smollm2");
    assert_eq!(models[0]["object"], "model");
    assert_eq!(models[0]["owned_by"], "sluice");
    assert!(models[0]["created"].as_u64().unwrap() > 1_700_000_000);

    let run = sluiced_run(&d, &["--chat", "--prompt", chat, "--max-tokens", "24"]);
    let prompt_n = run["prompt_token_ids"].as_array().unwrap().len();
    let gen_n = run["generated_token_ids"].as_array().unwrap().len();
    let c = &got["chat"];
    assert_eq!(
        c["text"], run["text"],
        "chat over HTTP differs from sluiced run --chat"
    );
    assert_eq!(
        (c["role"].as_str(), c["object"].as_str()),
        (Some("assistant"), Some("chat.completion"))
    );
    assert_eq!(c["finish_reason"], run["finish_reason"]);
    let usage = json!({"prompt_tokens": prompt_n, "completion_tokens": gen_n, "total_tokens": prompt_n + gen_n});
    for (k, v) in usage.as_object().unwrap() {
        assert_eq!(&c["usage"][k], v, "chat usage {k}");
    }
    let s = &got["chat_stream"];
    assert_eq!(s["text"], run["text"], "streamed chat differs");
    assert_eq!(s["role"], "assistant");
    let n = s["chunks"].as_u64().unwrap();
    assert_eq!(
        s["usage_chunks"],
        json!([n - 1]),
        "one usage chunk, the last: {s}"
    );
    assert_eq!(s["last_choices"], 0);
    for (k, v) in usage.as_object().unwrap() {
        assert_eq!(&s["usage"][k], v, "stream usage {k}");
    }
    // The streamed call sent the same messages again: its prompt came from the prefix
    // cache (all but the last token, which always runs), and the openai package reads the
    // count where OpenAI puts it.
    assert_eq!(
        s["usage"]["prompt_tokens_details"]["cached_tokens"],
        json!(prompt_n - 1),
        "{s}"
    );
    let finishes: Vec<&Value> = s["finish_reasons"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|f| !f.is_null())
        .collect();
    assert_eq!(
        finishes,
        [&run["finish_reason"]],
        "one finish reason, at the end"
    );
    assert_eq!(
        s["ids"].as_array().unwrap().len(),
        1,
        "every chunk has the same id"
    );

    let run = sluiced_run(&d, &["--prompt", PROMPTS[0], "--max-tokens", "24"]);
    let c = &got["completion"];
    assert_eq!(
        c["text"], run["text"],
        "completion differs from sluiced run"
    );
    assert_eq!(c["finish_reason"], "length");
    assert_eq!(c["object"], "text_completion");
    assert_eq!(c["usage"]["completion_tokens"], 24);
    assert_eq!(
        c["usage"]["prompt_tokens"].as_u64().unwrap() as usize,
        run["prompt_token_ids"].as_array().unwrap().len()
    );
    assert_eq!(got["completion_stream"]["text"], run["text"]);
    let run = sluiced_run(&d, &["--prompt-ids", ids, "--max-tokens", "24"]);
    assert_eq!(got["completion_ids"]["text"], run["text"]);
    assert_eq!(got["completion_ids"]["usage"]["prompt_tokens"], 5);
}

#[test]
fn streams_are_server_sent_events_ending_in_done() {
    let d = Daemon::start(&["--max-context", "256"]);
    for (path, body) in [
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "Tell me about disks."}], "max_tokens": 12, "temperature": 0, "stream": true, "stream_options": {"include_usage": true}}),
        ),
        (
            "/v1/completions",
            json!({"prompt": PROMPTS[1], "max_tokens": 12, "temperature": 0, "stream": true}),
        ),
    ] {
        let o = spawn_stream(&d, path, &body).wait_with_output().unwrap();
        let raw = stdout(&o);
        // Events are separated by blank lines.
        assert!(raw.contains("\n\ndata: "), "{raw}");
        let chunks = sse_chunks(&raw);
        let text: String = chunks
            .iter()
            .filter_map(|c| c["choices"].get(0))
            .map(|ch| {
                ch["delta"]["content"]
                    .as_str()
                    .or(ch["text"].as_str())
                    .unwrap_or("")
            })
            .collect();
        assert!(!text.is_empty(), "{raw}");
        let finish: Vec<&Value> = chunks
            .iter()
            .filter_map(|c| c["choices"].get(0))
            .map(|ch| &ch["finish_reason"])
            .filter(|f| !f.is_null())
            .collect();
        assert_eq!(finish, [&json!("length")], "{raw}");
        if path == "/v1/chat/completions" {
            assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
            assert_eq!(chunks.last().unwrap()["usage"]["completion_tokens"], 12);
            assert!(chunks
                .iter()
                .all(|c| c["object"] == "chat.completion.chunk"));
        } else {
            assert!(chunks.iter().all(|c| c["object"] == "text_completion"));
            assert!(chunks.iter().all(|c| c.get("usage").is_none()), "{raw}");
        }
    }
}

fn status_json(d: &Daemon) -> Value {
    let o = sluice(d, &["status", "--json"]);
    assert!(o.status.success(), "{}", stderr(&o));
    serde_json::from_str(&stdout(&o)).unwrap()
}

fn metric(d: &Daemon, name: &str) -> f64 {
    let got = python(&["metrics", &d.http]);
    got["samples"][name]
        .as_f64()
        .unwrap_or_else(|| panic!("{name} missing from /metrics: {got}"))
}

#[test]
fn http_and_grpc_streams_share_the_batch_and_each_gets_what_it_gets_alone() {
    let d = Daemon::start(&[
        "--max-context",
        "128",
        "--max-batch",
        "32",
        "--batch-tokens",
        "512",
    ]);
    let alone: Vec<Value> = PROMPTS
        .iter()
        .map(|p| {
            let o = sluice(
                &d,
                &[
                    "generate",
                    "--temperature",
                    "0",
                    p,
                    "--max-tokens",
                    "16",
                    "--json",
                ],
            );
            assert!(o.status.success(), "{}", stderr(&o));
            let j: Value = serde_json::from_str(&stdout(&o)).unwrap();
            j["text"].clone()
        })
        .collect();
    let passes0 = metric(&d, "sluice_passes_total{}");
    let http: Vec<Child> = PROMPTS
        .iter()
        .map(|p| {
            spawn_stream(
                &d,
                "/v1/completions",
                &json!({"prompt": p, "max_tokens": 16, "temperature": 0, "stream": true}),
            )
        })
        .collect();
    let grpc: Vec<Child> = PROMPTS
        .iter()
        .map(|p| {
            Command::new(bin("sluice"))
                .args([
                    "--addr",
                    &d.addr,
                    "generate",
                    "--temperature",
                    "0",
                    p,
                    "--max-tokens",
                    "16",
                    "--json",
                ])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for (i, c) in http.into_iter().enumerate() {
        let o = c.wait_with_output().unwrap();
        let text: String = sse_chunks(&stdout(&o))
            .iter()
            .filter_map(|c| c["choices"][0]["text"].as_str().map(str::to_string))
            .collect();
        assert_eq!(json!(text), alone[i], "HTTP client {i} ({})", PROMPTS[i]);
    }
    for (i, c) in grpc.into_iter().enumerate() {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "gRPC client {i}: {}", stderr(&o));
        let j: Value = serde_json::from_str(&stdout(&o)).unwrap();
        assert_eq!(j["text"], alone[i], "gRPC client {i} ({})", PROMPTS[i]);
    }
    // 32 requests of 16 tokens alone would take 32 x 16 passes; sharing them takes far fewer.
    let passes = metric(&d, "sluice_passes_total{}") - passes0;
    assert!(
        passes < 32.0 * 16.0 / 4.0,
        "{passes} passes: the requests did not share them"
    );
}

/// Polls `cond` every 20 ms until it holds; panics after `limit`. Returns the time taken.
fn wait_for(limit: Duration, what: &str, mut cond: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < limit, "waited {limit:?} for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
    t0.elapsed()
}

fn wait_active(d: &Daemon, want: u64, limit: Duration) -> Duration {
    wait_for(limit, &format!("{want} active sequences"), || {
        status_json(d)["active_sequences"] == want
    })
}

#[test]
fn a_client_that_disconnects_mid_stream_frees_its_slot_within_a_second() {
    let d = Daemon::start(&["--max-context", "2100", "--max-batch", "1"]);
    for stream in [true, false] {
        // 2000 tokens take well over 10 s here: the slot is free sooner only if the
        // disconnect cancelled the sequence.
        let mut c = spawn_stream(
            &d,
            "/v1/completions",
            &json!({"prompt": "Once upon a time", "max_tokens": 2000, "stream": stream, "temperature": 0}),
        );
        if stream {
            let mut first = [0u8; 16];
            c.stdout.as_mut().unwrap().read_exact(&mut first).unwrap();
            assert_eq!(&first[..6], b"data: ");
        }
        wait_active(&d, 1, Duration::from_secs(20));
        c.kill().unwrap();
        c.wait().unwrap();
        let t = wait_active(&d, 0, Duration::from_secs(5));
        assert!(
            t < Duration::from_secs(1),
            "stream={stream}: the slot was freed {t:?} after the client went away"
        );
    }
    let got = metric(&d, "sluice_requests_total{api=http,outcome=disconnected}");
    assert_eq!(got, 2.0);
    let (status, _, body) = hi(&d);
    assert_eq!(status, 200, "{body}");
}

#[test]
fn each_error_has_its_status_and_openai_shape_and_the_daemon_keeps_serving() {
    let d = Daemon::start(&[
        "--max-context",
        "256",
        "--max-batch",
        "1",
        "--queue-max",
        "1",
        "--shutdown-grace-s",
        "20",
    ]);
    let chat = "/v1/chat/completions";
    let user = r#"[{"role":"user","content":"Hi"}]"#;
    let cases: Vec<(String, u16, &str)> = vec![
        ("{not json".into(), 400, "not valid"),
        (r#"{"messages":"hi"}"#.into(), 400, "invalid type"),
        (
            format!(r#"{{"messages":{user},"n":129}}"#),
            400,
            "n must be 1 to 128",
        ),
        (
            format!(r#"{{"messages":{user},"temperature":-1}}"#),
            400,
            "temperature",
        ),
        (
            format!(r#"{{"messages":{user},"max_tokens":1000}}"#),
            400,
            "at most",
        ),
        (
            format!(
                r#"{{"messages":[{{"role":"user","content":"{}"}}]}}"#,
                "word ".repeat(300)
            ),
            400,
            "the context holds 256",
        ),
        (
            format!(r#"{{"messages":{user},"model":"gpt-4"}}"#),
            404,
            "not served here",
        ),
        (
            r#"{"messages":[{"role":"wizard","content":"x"}]}"#.into(),
            400,
            "unknown role",
        ),
    ];
    for (body, want, needle) in &cases {
        let (status, _, b) = post(&d, chat, body, &[]);
        let v = assert_error(status, *want, &b, needle);
        if *want == 404 {
            assert_eq!(v["error"]["code"], "model_not_found");
            assert_eq!(v["error"]["param"], "model");
        }
    }
    // A prompt longer than any 256 tokens can be (4 x the longest token's bytes each) is
    // refused by its length, before it is tokenized.
    let longest = sluice::text::Tokenizer::from_manifest(
        sluice::store::Store::open(&d.store()).unwrap().manifest(),
    )
    .unwrap()
    .longest_token_bytes();
    let huge = json!({"prompt": "word ".repeat(256 * longest * 4 / 5 + 10)});
    let (status, _, b) = post(&d, "/v1/completions", &huge.to_string(), &[]);
    let v = assert_error(status, 400, &b, "the context holds 256");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("bytes, at least"),
        "{v}"
    );
    let big = format!(r#"{{"prompt":"{}"}}"#, "a".repeat(9 << 20));
    let f = d.tmp.path().join("big.json");
    std::fs::write(&f, big).unwrap();
    let (status, _, b) = post(&d, "/v1/completions", &format!("@{}", f.display()), &[]);
    assert_error(status, 400, &b, "max_request_bytes");
    let (status, _, b) = get(&d, "/v1/engines", &[]);
    assert_error(status, 404, &b, "no route");

    // One request holds the only slot, one waits in the one-place queue, a third is 429.
    let long = json!({"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0});
    let running = spawn_stream(&d, "/v1/completions", &long);
    wait_active(&d, 1, Duration::from_secs(20));
    let queued = spawn_stream(&d, "/v1/completions", &long);
    wait_for(
        Duration::from_secs(20),
        "the second request to queue",
        || status_json(&d)["queue_depth"] == 1,
    );
    let (status, head, b) = hi(&d);
    assert_error(status, 429, &b, "queue is full");
    assert!(head.contains("retry-after: 1"), "{head}");
    // While the queue is full, a request that could never run is still its 400 or 404,
    // not a 429 to retry (a client would retry it until the queue drained): every case
    // above again, a call of several prompts with a bad one, and gRPC's own.
    for (body, want, needle) in &cases {
        let (status, _, b) = post(&d, chat, body, &[]);
        assert_error(status, *want, &b, needle);
    }
    let (status, _, b) = post(&d, "/v1/completions", &huge.to_string(), &[]);
    assert_error(status, 400, &b, "the context holds 256");
    let mixed = json!({"prompt": ["Hi", "word ".repeat(300)], "max_tokens": 2});
    let (status, _, b) = post(&d, "/v1/completions", &mixed.to_string(), &[]);
    assert_error(status, 400, &b, "the context holds 256");
    for (body, code, needle) in [
        (
            json!({"prompt": "Hi", "sampling": {"top_p": 2.0}}),
            "InvalidArgument",
            "top_p",
        ),
        (
            json!({"prompt": "word ".repeat(300)}),
            "InvalidArgument",
            "the context holds 256",
        ),
        (
            json!({"prompt": "Hi", "max_tokens": 1000}),
            "InvalidArgument",
            "at most",
        ),
        (
            json!({"prompt": "Hi", "model": "gpt-4"}),
            "NotFound",
            "gpt-4",
        ),
    ] {
        let o = grpcurl_generate(&d, &body);
        let err = stderr(&o);
        assert!(
            !o.status.success() && err.contains(code) && err.contains(needle),
            "gRPC {body} with the queue full: want {code} naming {needle:?}, got: {err}"
        );
    }
    // The queue was full throughout: a valid request is still refused as busy.
    let (status, _, b) = hi(&d);
    assert_error(status, 429, &b, "queue is full");
    assert_eq!(status_json(&d)["queue_depth"], 1);
    let o = grpcurl_generate(&d, &json!({"prompt": "Hi", "max_tokens": 2}));
    assert!(
        stderr(&o).contains("ResourceExhausted"),
        "a valid gRPC request with the queue full: {}",
        stderr(&o)
    );
    // A call of more prompts than the queue holds can never be admitted: a 400 that says
    // so, not a 429 to retry; and it queues none of them.
    let two = json!({"prompt": ["a", "b"], "max_tokens": 2});
    let (status, _, b) = post(&d, "/v1/completions", &two.to_string(), &[]);
    assert_error(status, 400, &b, "--queue-max");
    assert_eq!(status_json(&d)["queue_depth"], 1);

    // SIGTERM: in-flight requests finish; new ones, and /health, are 503.
    // SAFETY: plain kill(2) on our child's pid.
    unsafe { libc::kill(d.child.id() as i32, libc::SIGTERM) };
    wait_for(Duration::from_secs(10), "/health to say 503", || {
        get(&d, "/health", &[]).0 == 503
    });
    let (_, _, b) = get(&d, "/health", &[]);
    assert!(b.contains("shutting_down"), "{b}");
    let (status, _, b) = hi(&d);
    assert_error(status, 503, &b, "shutting down");
    for c in [running, queued] {
        let o = c.wait_with_output().unwrap();
        let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
        assert_eq!(v["usage"]["completion_tokens"], 200, "{v}");
    }
}

/// A daemon whose every layer streams (so each request reads the file again), and the
/// store's streamed units.
fn all_streaming() -> (Daemon, Vec<sluice::store::LayerUnit>) {
    let d = Daemon::start(&ALL_STREAMING);
    let store = sluice::store::Store::open(&d.store()).unwrap();
    let st = status_json(&d);
    let streamed: Vec<String> = st["layers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["placement"] == "streamed")
        .map(|l| l["layer"].as_str().unwrap().to_string())
        .collect();
    let units = store
        .units()
        .iter()
        .filter(|u| streamed.contains(&u.kind.to_string()))
        .cloned()
        .collect();
    (d, units)
}

#[test]
fn a_damaged_layer_is_a_500_naming_it_and_serving_resumes_once_repaired() {
    let (d, units) = all_streaming();
    let unit = units[0].clone();
    let w = d.store().join("weights.bin");
    let at = unit.file_offset + 64;
    let good = std::fs::read(&w).unwrap()[at as usize];
    let flip = |b: u8| {
        let f = std::fs::OpenOptions::new().write(true).open(&w).unwrap();
        std::os::unix::fs::FileExt::write_all_at(&f, &[b], at).unwrap();
        f.sync_all().unwrap();
    };
    flip(good ^ 0x5a);
    let (status, _, b) = hi(&d);
    let v = assert_error(status, 500, &b, &unit.kind.to_string());
    assert_eq!(v["error"]["code"], "data_loss");
    flip(good);
    let (status, _, b) = hi(&d);
    assert_eq!(status, 200, "{b}");
}

/// A hundred bit flips in the frames of a live store, each repaired before the next: every
/// request that reads a flipped frame is a DATA_LOSS (500 naming the unit), none returns text
/// other than the clean store's, and the daemon serves on.
#[test]
fn a_hundred_bit_flips_in_a_live_store_are_each_caught_and_never_change_an_output() {
    let (d, units) = all_streaming();
    assert!(units.len() > 20, "{} streamed units", units.len());
    let one = r#"{"prompt":"The capital of France is","max_tokens":1,"temperature":0}"#;
    let clean = |d: &Daemon| {
        let (status, _, b) = post(d, "/v1/completions", one, &[]);
        assert_eq!(status, 200, "{b}");
        let v: Value = serde_json::from_str(&b).unwrap();
        v["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let want = clean(&d);
    let w = d.store().join("weights.bin");
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&w)
        .unwrap();
    let (mut caught, mut clean_reads) = (0, 0);
    let mut previous = String::new();
    let fr_index = |u: &sluice::store::LayerUnit, fr: &sluice::store::format::Frame| {
        u.frames
            .iter()
            .position(|x| x.file_offset == fr.file_offset)
            .unwrap_or(usize::MAX)
    };
    let mut gen = sluice::util::rng::Rng::new(0x9e37_79b9_7f4a_7c15);
    for i in 0..100 {
        let rng = gen.next_u64();
        let u = &units[i % units.len()];
        let fr = &u.frames[(rng as usize >> 8) % u.frames.len()];
        let at = fr.file_offset + (rng >> 24) % fr.stored_len();
        let mut b = [0u8];
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut b, at).unwrap();
        let bit = 1u8 << ((rng >> 56) % 8);
        std::os::unix::fs::FileExt::write_all_at(&f, &[b[0] ^ bit], at).unwrap();
        f.sync_all().unwrap();
        // Requests until one reads this flip. A pass prefetches the next pass's first units,
        // so a request may first meet the previous flip (read before its repair), or a copy
        // of this unit read before this flip.
        let here = format!("{}, frame ", u.kind);
        let mut seen = false;
        for _ in 0..3 {
            let (status, _, body) = post(&d, "/v1/completions", one, &[]);
            match status {
                500 => {
                    let v = assert_error(status, 500, &body, "weights.bin");
                    assert_eq!(v["error"]["code"], "data_loss", "flip {i}: {body}");
                    let msg = v["error"]["message"].as_str().unwrap();
                    if msg.contains(&here)
                        && msg.contains(&format!("at offset {} ", fr.file_offset))
                    {
                        seen = true;
                        break;
                    }
                    assert!(i > 0 && msg.contains(&previous), "flip {i}: {msg}");
                }
                // A unit prefetched before the flip was read clean: the right text, and the
                // next pass reads the flip.
                200 => {
                    let v: Value = serde_json::from_str(&body).unwrap();
                    assert_eq!(
                        v["choices"][0]["text"], want,
                        "flip {i} at {at} changed the output"
                    );
                    clean_reads += 1;
                }
                other => panic!("flip {i}: status {other}: {body}"),
            }
        }
        assert!(seen, "flip {i} at {at} ({here}) was never reported");
        caught += 1;
        previous = format!("{here}{}", fr_index(u, fr));
        std::os::unix::fs::FileExt::write_all_at(&f, &b, at).unwrap();
        f.sync_all().unwrap();
    }
    assert_eq!(caught, 100);
    println!("100 flips caught; {clean_reads} requests read a copy prefetched before the flip");
    // The last flip may still be in a prefetched unit; the request after it is clean.
    let (status, _, body) = post(&d, "/v1/completions", one, &[]);
    assert!(status == 200 || body.contains(&previous), "{body}");
    assert_eq!(clean(&d), want, "the repaired store serves as before");
}

#[test]
fn api_keys_guard_both_wires_and_an_open_port_needs_one() {
    let key = "test-key-0123456789abcdef";
    let sock = tempfile::tempdir().unwrap();
    let unix = sock.path().join("s.sock");
    let d = Daemon::start(&[
        "--max-context",
        "128",
        "--api-key",
        key,
        "--unix",
        unix.to_str().unwrap(),
    ]);
    let body = r#"{"prompt":"Hi","max_tokens":2}"#;
    let bearer = format!("Authorization: Bearer {key}");
    for extra in [
        &[][..],
        &["-H", "Authorization: Bearer wrong-key-0123456789"],
    ] {
        let (status, _, b) = post(&d, "/v1/completions", body, extra);
        let v = assert_error(status, 401, &b, "");
        assert_eq!(v["error"]["code"], "invalid_api_key");
        let (status, _, _) = get(&d, "/v1/models", extra);
        assert_eq!(status, 401);
    }
    let (status, _, b) = post(&d, "/v1/completions", body, &["-H", &bearer]);
    assert_eq!(status, 200, "{b}");
    // /health and /metrics stay open by default.
    assert_eq!(get(&d, "/health", &[]).0, 200);
    assert_eq!(get(&d, "/metrics", &[]).0, 200);
    // gRPC: the same key in `authorization` metadata.
    let o = sluice(&d, &["models"]);
    assert!(
        !o.status.success() && stderr(&o).contains("Unauthenticated"),
        "{}",
        stderr(&o)
    );
    let o = sluice(&d, &["--api-key", "wrong-key-0123456789", "models"]);
    assert!(
        !o.status.success() && stderr(&o).contains("not valid"),
        "{}",
        stderr(&o)
    );
    let o = sluice(
        &d,
        &[
            "--api-key",
            key,
            "generate",
            "--temperature",
            "0",
            "Hi",
            "--max-tokens",
            "2",
        ],
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let host = d.addr.trim_start_matches("http://");
    let o = Command::new("grpcurl")
        .args(["-plaintext", host, "list"])
        .output()
        .unwrap();
    assert!(!o.status.success(), "reflection answered without a key");
    let o = Command::new("grpcurl")
        .args([
            "-plaintext",
            "-H",
            &format!("authorization: Bearer {key}"),
            host,
            "list",
        ])
        .output()
        .unwrap();
    assert!(
        o.status.success() && stdout(&o).contains("sluice.v1.Inference"),
        "{}",
        stderr(&o)
    );
    // The socket is for the owner and the group only.
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&unix).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o660);
    let o = Command::new(bin("sluice"))
        .args([
            "--addr",
            &format!("unix:{}", unix.display()),
            "--api-key",
            key,
            "models",
        ])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let got = metric(
        &d,
        "sluice_requests_total{api=http,outcome=unauthenticated}",
    );
    assert_eq!(got, 2.0);

    // Beyond loopback without a key: refused at start, before the model loads.
    let store = d.store();
    let serve = |listen: &str, http: &str| {
        sluiced_err(&[
            "serve",
            "--model",
            store.to_str().unwrap(),
            "--config",
            "/dev/null",
            "--listen",
            listen,
            "--http-listen",
            http,
        ])
    };
    let t0 = Instant::now();
    let e = serve("0.0.0.0:0", "off");
    assert!(
        e.contains("0.0.0.0:0") && e.contains("--api-key") && e.contains("--insecure-no-auth"),
        "{e}"
    );
    assert!(t0.elapsed() < Duration::from_secs(5));
    let e = serve(&format!("127.0.0.1:{}", free_port()), "0.0.0.0:0");
    assert!(e.contains("no API key is set"), "{e}");
    // /metrics can require the key too.
    drop(d);
    let d = Daemon::start(&[
        "--max-context",
        "128",
        "--api-key",
        key,
        "--public-paths",
        "/health",
    ]);
    assert_eq!(get(&d, "/metrics", &[]).0, 401);
    assert_eq!(get(&d, "/metrics", &["-H", &bearer]).0, 200);
}

#[test]
fn metrics_parse_as_prometheus_text_and_move_as_requests_run() {
    let d = Daemon::start(&["--max-context", "128"]);
    let before = python(&["metrics", &d.http]);
    assert!(
        before["content_type"]
            .as_str()
            .unwrap()
            .starts_with("text/plain; version=0.0.4"),
        "{before}"
    );
    let s0 = &before["samples"];
    for name in [
        "sluice_queue_depth{}",
        "sluice_active_sequences{}",
        "sluice_passes_total{}",
        "sluice_disk_read_bytes_total{}",
        "sluice_decompressed_bytes_total{}",
        "sluice_uploaded_bytes_total{}",
        "sluice_stage_busy_seconds_total{stage=compute}",
        "sluice_stage_stall_seconds_total{stage=compute_waiting_for_load}",
        "sluice_time_to_first_token_seconds_count{}",
    ] {
        assert!(s0.get(name).is_some(), "{name} missing: {before}");
    }
    let (status, _, b) = post(
        &d,
        "/v1/completions",
        r#"{"prompt":"Hi there","max_tokens":5,"temperature":0}"#,
        &[],
    );
    assert_eq!(status, 200, "{b}");
    let o = sluice(
        &d,
        &[
            "generate",
            "--temperature",
            "0",
            "Hello",
            "--max-tokens",
            "4",
        ],
    );
    assert!(o.status.success());
    let (status, _, _) = post(&d, "/v1/completions", r#"{"prompt":"Hi","n":0}"#, &[]);
    assert_eq!(status, 400);
    let after = python(&["metrics", &d.http]);
    let s1 = &after["samples"];
    let delta = |k: &str| s1[k].as_f64().unwrap_or(0.0) - s0[k].as_f64().unwrap_or(0.0);
    assert_eq!(
        delta("sluice_requests_total{api=http,outcome=length}"),
        1.0,
        "{after}"
    );
    assert_eq!(
        delta("sluice_requests_total{api=grpc,outcome=length}"),
        1.0,
        "{after}"
    );
    assert_eq!(
        delta("sluice_requests_total{api=http,outcome=invalid}"),
        1.0,
        "{after}"
    );
    assert_eq!(delta("sluice_generation_tokens_total{}"), 9.0);
    assert_eq!(delta("sluice_time_to_first_token_seconds_count{}"), 2.0);
    assert!(delta("sluice_passes_total{}") >= 9.0);
    assert!(delta("sluice_stage_busy_seconds_total{stage=compute}") > 0.0);
    assert!(delta("sluice_time_per_output_token_seconds_count{}") >= 7.0);
}

#[test]
fn logprobs_differ_as_transformers_logits_do_and_their_bytes_spell_the_text() {
    // The reference numerics, whose logits match transformers' to 1e-3 of the largest.
    let d = Daemon::start(&["--max-context", "128", "--exact"]);
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/fixtures/reference/smollm2.json"
    );
    let r: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let c = &r["cases"][0];
    let store = sluice::store::Store::open(&d.store()).unwrap();
    let tok = sluice::text::Tokenizer::from_manifest(store.manifest()).unwrap();
    let body =
        json!({"prompt": c["prompt_token_ids"], "max_tokens": 1, "temperature": 0, "logprobs": 5});
    let (status, _, b) = post(&d, "/v1/completions", &body.to_string(), &[]);
    assert_eq!(status, 200, "{b}");
    let v: Value = serde_json::from_str(&b).unwrap();
    let lp = &v["choices"][0]["logprobs"];
    let top = lp["top_logprobs"][0].as_object().unwrap();
    assert_eq!(top.len(), 5, "{lp}");
    let want = c["top_logits"].as_array().unwrap();
    let scale = want[0][1].as_f64().unwrap().abs();
    let (id0, l0) = (
        want[0][0].as_u64().unwrap() as u32,
        want[0][1].as_f64().unwrap(),
    );
    let name = |id: u32| String::from_utf8_lossy(&tok.token_bytes(id)).into_owned();
    let chosen = lp["token_logprobs"][0].as_f64().unwrap();
    assert_eq!(
        lp["tokens"][0],
        json!(name(id0)),
        "greedy picks transformers' top token"
    );
    assert!(chosen < 0.0 && chosen > -20.0, "{chosen}");
    // log p(a) - log p(b) = logit(a) - logit(b): the normalizer cancels.
    for w in &want[..5] {
        let (id, l) = (w[0].as_u64().unwrap() as u32, w[1].as_f64().unwrap());
        let got = top[&name(id)]
            .as_f64()
            .unwrap_or_else(|| panic!("{} not in {lp}", name(id)));
        let (dg, dw) = (got - chosen, l - l0);
        assert!(
            (dg - dw).abs() <= 2e-3 * scale,
            "token {id}: {dg} vs transformers' {dw}"
        );
    }
    // Chat: every token's bytes, joined, are the text.
    let body = json!({"messages": [{"role": "user", "content": "Say café in three languages."}], "max_tokens": 24, "temperature": 0, "logprobs": true, "top_logprobs": 2});
    let (status, _, b) = post(&d, "/v1/chat/completions", &body.to_string(), &[]);
    assert_eq!(status, 200, "{b}");
    let v: Value = serde_json::from_str(&b).unwrap();
    let ch = &v["choices"][0];
    let content = ch["logprobs"]["content"].as_array().unwrap();
    let bytes: Vec<u8> = content
        .iter()
        .flat_map(|e| {
            e["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8)
        })
        .collect();
    assert_eq!(
        String::from_utf8(bytes).unwrap(),
        ch["message"]["content"].as_str().unwrap()
    );
    assert!(content
        .iter()
        .all(|e| e["top_logprobs"].as_array().unwrap().len() == 2
            && e["top_logprobs"][0]["logprob"].as_f64() >= e["logprob"].as_f64()));
}

#[test]
fn penalties_over_http_and_grpc_give_what_sluiced_run_gives() {
    let d = Daemon::start(&["--max-context", "256"]);
    let penalties = [
        "--max-tokens",
        "32",
        "--repetition-penalty",
        "1.3",
        "--presence-penalty",
        "0.5",
        "--frequency-penalty",
        "0.25",
    ];
    let args: Vec<&str> = ["--prompt", PROMPTS[2]]
        .into_iter()
        .chain(penalties)
        .collect();
    let run = sluiced_run(&d, &args);
    let plain = sluiced_run(&d, &["--prompt", PROMPTS[2], "--max-tokens", "32"]);
    assert_ne!(
        run["text"], plain["text"],
        "the penalties should change the text"
    );
    let body = json!({"prompt": PROMPTS[2], "max_tokens": 32, "temperature": 0, "repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.25});
    let (status, _, b) = post(&d, "/v1/completions", &body.to_string(), &[]);
    assert_eq!(status, 200, "{b}");
    let v: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(
        v["choices"][0]["text"], run["text"],
        "HTTP differs from sluiced run"
    );
    let gen: Vec<&str> = ["generate", "--temperature", "0", PROMPTS[2], "--json"]
        .into_iter()
        .chain(penalties)
        .collect();
    let o = sluice(&d, &gen);
    assert!(o.status.success(), "{}", stderr(&o));
    let g: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(g["text"], run["text"], "gRPC differs from sluiced run");
    let (status, _, b) = post(
        &d,
        "/v1/completions",
        r#"{"prompt":"Hi","presence_penalty":3}"#,
        &[],
    );
    let v = assert_error(status, 400, &b, "[-2, 2]");
    assert_eq!(v["error"]["param"], "presence_penalty");
}

/// Gemma's turn format (as its instruction-tuned models' template writes it), given to a
/// base model that ships no template.
const GEMMA_TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}{% if m.role == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = m.role %}{% endif %}<start_of_turn>{{ role }}\n{{ m.content | trim }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}";

/// The real Gemma 3 270M GGUF is a base model with no chat template: chat calls are
/// refused, until `--chat-template FILE` gives one. Then a chat call is the completion of
/// the text the template renders (the same prompt tokens, the same greedy tokens), and
/// generation also ends at the template's end-of-turn token, which the store's end
/// tokens lack.
#[test]
fn a_chat_template_given_at_start_serves_chat_on_a_base_model() {
    let models = tempfile::tempdir().unwrap();
    let store = models.path().join("gemma3");
    let store = store.to_str().unwrap();
    sluiced_ok(&[
        "pack",
        "--link",
        gemma3_gguf().to_str().unwrap(),
        "-o",
        store,
    ]);
    let file = models.path().join("gemma.jinja");
    std::fs::write(&file, GEMMA_TEMPLATE).unwrap();

    let mut tok = sluice::text::Tokenizer::from_manifest(
        sluice::store::Store::open(std::path::Path::new(store))
            .unwrap()
            .manifest(),
    )
    .unwrap();
    let eot = tok.token_id("<end_of_turn>").expect("Gemma's vocabulary");
    assert!(!tok.is_end(eot), "the base model's store ends at eos only");
    assert_eq!(tok.end_turns_of(GEMMA_TEMPLATE), vec![eot]);
    assert!(tok.is_end(eot));

    let chat = json!({"messages": [{"role": "user", "content": "Name a colour."}],
                      "max_tokens": 8, "temperature": 0});
    let flags = ["--max-context", "256", "--max-batch", "1"];
    let d = Daemon::serve(tempfile::tempdir().unwrap(), &["--model", store], &flags);
    let (status, _, b) = post(&d, "/v1/chat/completions", &chat.to_string(), &[]);
    assert_error(status, 400, &b, "no chat template");
    drop(d);

    let file = file.to_str().unwrap();
    let mut with = vec!["--chat-template", file];
    with.extend_from_slice(&flags);
    let d = Daemon::serve(tempfile::tempdir().unwrap(), &["--model", store], &with);
    let (status, _, b) = post(&d, "/v1/chat/completions", &chat.to_string(), &[]);
    assert_eq!(status, 200, "{b}");
    let c: Value = serde_json::from_str(&b).unwrap();
    // The template renders BOS itself; a completion prompt gets it from the tokenizer.
    let rendered = "<start_of_turn>user\nName a colour.<end_of_turn>\n<start_of_turn>model\n";
    let comp = json!({"prompt": rendered, "max_tokens": 8, "temperature": 0});
    let (status, _, b) = post(&d, "/v1/completions", &comp.to_string(), &[]);
    assert_eq!(status, 200, "{b}");
    let p: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(c["usage"]["prompt_tokens"], p["usage"]["prompt_tokens"]);
    assert_eq!(
        c["choices"][0]["message"]["content"],
        p["choices"][0]["text"]
    );
    assert_eq!(
        c["choices"][0]["finish_reason"],
        p["choices"][0]["finish_reason"]
    );
    assert!(c["usage"]["completion_tokens"].as_u64().unwrap() > 0, "{c}");
    // `sluiced run --chat --chat-template` renders the same prompt and generates the same.
    let run: Value = serde_json::from_str(&sluiced_ok(&[
        "run",
        "--temperature",
        "0",
        store,
        "--chat",
        "--chat-template",
        file,
        "--prompt",
        "Name a colour.",
        "--max-tokens",
        "8",
        "--max-context",
        "256",
        "--json",
    ]))
    .unwrap();
    assert_eq!(run["text"], c["choices"][0]["message"]["content"]);
    assert_eq!(
        run["prompt_token_ids"].as_array().unwrap().len() as u64,
        c["usage"]["prompt_tokens"].as_u64().unwrap()
    );
}

/// `n` choices a prompt: choice i of a seeded call is what the call alone with the seed
/// plus i gives (batch invariance), choices come prompt by prompt, and a prompt's tokens
/// count once in the usage, streamed or not.
#[test]
fn n_choices_are_the_seeded_calls_alone_and_count_each_prompt_once() {
    let d = Daemon::start(&["--max-context", "256", "--max-batch", "4"]);
    let ask = |path: &str, body: Value| -> Value {
        let (status, _, b) = post(&d, path, &body.to_string(), &[]);
        assert_eq!(status, 200, "{b}");
        serde_json::from_str(&b).unwrap()
    };
    let prompts = [PROMPTS[1], PROMPTS[2]];
    let alone = |p: &str, seed: u64| {
        ask(
            "/v1/completions",
            json!({"prompt": p, "max_tokens": 6, "temperature": 1, "seed": seed}),
        )
    };
    let all = ask(
        "/v1/completions",
        json!({"prompt": prompts, "n": 2, "max_tokens": 6, "temperature": 1, "seed": 11}),
    );
    let choices = all["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 4);
    let (mut prompt_tokens, mut completion_tokens) = (0, 0);
    for (k, p) in prompts.iter().enumerate() {
        for i in 0..2 {
            let one = alone(p, 11 + i as u64);
            let c = &choices[2 * k + i];
            assert_eq!(c["index"], 2 * k + i);
            assert_eq!(
                c["text"], one["choices"][0]["text"],
                "prompt {k} choice {i}"
            );
            completion_tokens += one["usage"]["completion_tokens"].as_u64().unwrap();
            if i == 0 {
                prompt_tokens += one["usage"]["prompt_tokens"].as_u64().unwrap();
            }
        }
    }
    assert_eq!(all["usage"]["prompt_tokens"], prompt_tokens);
    assert_eq!(all["usage"]["completion_tokens"], completion_tokens);
    assert_ne!(choices[0]["text"], choices[1]["text"], "two samples alike");

    // Streamed chat: every choice's deltas, the prompt counted once.
    let msgs = json!([{"role": "user", "content": PROMPTS[3]}]);
    let single = ask(
        "/v1/chat/completions",
        json!({"messages": msgs, "max_tokens": 4, "temperature": 0}),
    );
    let body = json!({"messages": msgs, "max_tokens": 4, "temperature": 0, "n": 3,
                      "stream": true, "stream_options": {"include_usage": true}});
    let (status, _, b) = post(&d, "/v1/chat/completions", &body.to_string(), &[]);
    assert_eq!(status, 200, "{b}");
    let chunks: Vec<Value> = b
        .lines()
        .filter_map(|l| l.strip_prefix("data: "))
        .filter(|l| *l != "[DONE]")
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut texts = vec![String::new(); 3];
    for c in &chunks {
        for ch in c["choices"].as_array().unwrap() {
            let i = ch["index"].as_u64().unwrap() as usize;
            texts[i].push_str(ch["delta"]["content"].as_str().unwrap_or(""));
        }
    }
    let greedy = single["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        texts.iter().all(|t| t == greedy),
        "{texts:?} against {greedy:?}"
    );
    let usage = &chunks.last().unwrap()["usage"];
    assert_eq!(usage["prompt_tokens"], single["usage"]["prompt_tokens"]);
    assert_eq!(
        usage["completion_tokens"].as_u64().unwrap(),
        3 * single["usage"]["completion_tokens"].as_u64().unwrap()
    );
}

/// The text of a `Generate` stream as grpcurl prints it (one JSON object a message).
fn generated_text(o: &std::process::Output) -> String {
    let out = stdout(o);
    serde_json::Deserializer::from_str(&out)
        .into_iter::<Value>()
        .map_while(Result::ok)
        .filter_map(|m| m["piece"]["text"].as_str().map(str::to_string))
        .collect()
}

/// JSON mode (`response_format: {"type": "json_object"}`) through the real `openai` client,
/// each text judged by Python's `json` module; `sluiced run --json-object` and grpcurl give
/// the same greedy object. logit_bias moves exactly the token it names: -100 on the greedy
/// token gives the model's second choice (from its own logprobs), on HTTP and in `run`.
#[test]
fn json_mode_makes_objects_and_logit_bias_moves_the_token_it_names() {
    let d = Daemon::start(&["--max-context", "512", "--max-batch", "4"]);
    let chat = "Give a JSON object with the name, age and favourite food of a cat.";
    let got = python(&[
        "json",
        &d.http,
        chat,
        "A JSON object describing Mars:",
        "200",
    ]);
    // Asked plainly, the model wraps its answer in a code fence and talks after it.
    assert_eq!(got["plain"]["is_object"], false, "{}", got["plain"]);
    let g = &got["greedy"];
    assert_eq!(
        (&g["finish_reason"], &g["is_object"]),
        (&json!("stop"), &json!(true)),
        "{g}"
    );
    for s in got["sampled"].as_array().unwrap() {
        // A sampled text ends as an object, or is cut by max_tokens (then it is none).
        let whole = s["finish_reason"] == "stop";
        assert_eq!(s["is_object"], whole, "{s}");
    }
    let whole = got["sampled"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["is_object"] == true)
        .count();
    assert!(whole >= 2, "{}", got["sampled"]);
    let texts: std::collections::HashSet<&str> = got["sampled"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["text"].as_str().unwrap())
        .collect();
    assert!(texts.len() > 1, "four samples alike");
    let c = &got["completion"];
    assert_eq!(c["is_object"], c["finish_reason"] == "stop", "{c}");
    assert!(
        c["text"].as_str().unwrap().trim_start().starts_with('{'),
        "{c}"
    );

    let run = sluiced_run(
        &d,
        &[
            "--chat",
            "--json-object",
            "--prompt",
            chat,
            "--max-tokens",
            "200",
        ],
    );
    assert_eq!(run["text"], g["text"], "sluiced run --json-object differs");
    let body = json!({"messages": [{"role": "user", "content": chat}], "max_tokens": 200,
                      "sampling": {"temperature": 0},
                      "response_format": "RESPONSE_FORMAT_JSON_OBJECT"});
    let o = grpcurl_generate(&d, &body);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(
        generated_text(&o),
        g["text"].as_str().unwrap(),
        "grpcurl differs"
    );

    // logit_bias: the greedy first token, banned, gives way to the second most likely.
    let prompt = PROMPTS[4];
    let first = sluiced_run(&d, &["--prompt", prompt, "--max-tokens", "1"]);
    let top = first["generated_token_ids"][0].as_u64().unwrap();
    let ask = |body: Value| -> Value {
        let (status, _, b) = post(&d, "/v1/completions", &body.to_string(), &[]);
        assert_eq!(status, 200, "{b}");
        serde_json::from_str(&b).unwrap()
    };
    let plain = ask(json!({"prompt": prompt, "max_tokens": 1, "temperature": 0, "logprobs": 2}));
    let alts = plain["choices"][0]["logprobs"]["top_logprobs"][0]
        .as_object()
        .unwrap()
        .clone();
    let mut alts: Vec<(String, f64)> = alts
        .into_iter()
        .map(|(k, v)| (k, v.as_f64().unwrap()))
        .collect();
    alts.sort_by(|a, b| b.1.total_cmp(&a.1));
    assert_eq!(plain["choices"][0]["text"], alts[0].0.as_str());
    let biased = ask(json!({"prompt": prompt, "max_tokens": 1, "temperature": 0,
                            "logit_bias": {top.to_string(): -100}}));
    assert_eq!(biased["choices"][0]["text"], alts[1].0.as_str(), "{biased}");
    let run = sluiced_run(
        &d,
        &[
            "--prompt",
            prompt,
            "--max-tokens",
            "1",
            "--logit-bias",
            &format!("{top}=-100"),
        ],
    );
    assert_eq!(run["text"], alts[1].0.as_str());
    // +100 on a token makes it every token.
    let forced = ask(json!({"prompt": prompt, "max_tokens": 3, "temperature": 0,
                            "logit_bias": {top.to_string(): 100}}));
    assert_eq!(
        forced["choices"][0]["text"],
        alts[0].0.repeat(3),
        "{forced}"
    );
    // Refusals name the field.
    for (body, what) in [
        (
            json!({"prompt": prompt, "logit_bias": {"4000000": 1}}),
            "vocabulary",
        ),
        (
            json!({"prompt": prompt, "logit_bias": {"5": 200}}),
            "[-100, 100]",
        ),
        (
            json!({"prompt": prompt, "response_format": {"type": "json_schema"}}),
            "json_schema.schema",
        ),
    ] {
        let (status, _, b) = post(&d, "/v1/completions", &body.to_string(), &[]);
        let e: Value = serde_json::from_str(&b).unwrap();
        assert_eq!(status, 400, "{b}");
        assert!(
            e["error"]["message"].as_str().unwrap().contains(what),
            "{b}"
        );
    }
    assert_eq!(hi(&d).0, 200);
}

/// Structured outputs (`response_format: {"type": "json_schema"}`): greedy and sampled
/// texts through the real `openai` client are instances of the schema by the `jsonschema`
/// package's validation, properties in the schema's order, with the keywords llguidance
/// brought (pattern, maxLength, minimum/maximum, an exclusive bound, object anyOf);
/// `sluiced run --json-schema` and grpcurl give the greedy text; a schema with a keyword
/// sluice does not enforce is refused, naming it and where it is.
#[test]
fn structured_outputs_are_instances_of_the_schema() {
    let d = Daemon::start(&["--max-context", "512", "--max-batch", "4"]);
    let schema = json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "pattern": "^[A-Z][a-z]+$", "maxLength": 12},
            "age": {"type": "integer", "minimum": 1, "maximum": 25},
            "colour": {"enum": ["black", "white", "ginger", "grey"]},
            "indoor": {"type": "boolean"},
            "toys": {"type": "array", "items": {"type": "string", "maxLength": 20}, "minItems": 1, "maxItems": 3},
            "owner": {"anyOf": [{"$ref": "#/$defs/person"}, {"$ref": "#/$defs/shelter"}]},
            "nickname": {"type": "string"}
        },
        "required": ["name", "age", "colour", "indoor", "toys", "owner"],
        "additionalProperties": false,
        "$defs": {"person": {"type": "object", "title": "Person",
            "properties": {"first": {"type": "string", "minLength": 1}, "score": {"type": "number", "minimum": 0, "exclusiveMaximum": 10}},
            "required": ["first", "score"], "additionalProperties": false},
            "shelter": {"type": "object", "properties": {"shelter": {"type": "string"}, "city": {"type": "string"}},
            "required": ["shelter", "city"], "additionalProperties": false}}
    });
    let file = d.tmp.path().join("cat.schema.json");
    std::fs::write(&file, schema.to_string()).unwrap();
    let chat = "Describe a cat.";
    let got = python(&["schema", &d.http, chat, file.to_str().unwrap(), "200"]);
    let g = &got["greedy"];
    assert_eq!(
        (&g["finish_reason"], &g["valid"]),
        (&json!("stop"), &json!(true)),
        "{g}"
    );
    // Properties come in the schema's order.
    let text = g["text"].as_str().unwrap();
    let at: Vec<usize> = [
        "\"name\"",
        "\"age\"",
        "\"colour\"",
        "\"indoor\"",
        "\"toys\"",
        "\"owner\"",
    ]
    .iter()
    .map(|k| text.find(k).unwrap_or_else(|| panic!("{k} in {text}")))
    .collect();
    assert!(at.windows(2).all(|w| w[0] < w[1]), "{text}");
    let mut valid = 0;
    for s in got["sampled"].as_array().unwrap() {
        // Sampled: an instance when it ended by itself; cut by max_tokens, none.
        assert_eq!(s["valid"], s["finish_reason"] == "stop", "{s}");
        valid += usize::from(s["valid"] == true);
    }
    assert!(valid >= 2, "{}", got["sampled"]);

    let run = sluiced_run(
        &d,
        &[
            "--chat",
            "--json-schema",
            file.to_str().unwrap(),
            "--prompt",
            chat,
            "--max-tokens",
            "200",
        ],
    );
    assert_eq!(run["text"], g["text"], "sluiced run --json-schema differs");
    let grpc = |schema: &Value| {
        let body = json!({"messages": [{"role": "user", "content": chat}], "max_tokens": 200,
                          "sampling": {"temperature": 0},
                          "response_format": "RESPONSE_FORMAT_JSON_SCHEMA",
                          "json_schema": schema.to_string()});
        grpcurl_generate(&d, &body)
    };
    let o = grpc(&schema);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(generated_text(&o), text, "grpcurl differs");

    // A keyword that constrains values and is not enforced: refused, named with its place.
    let mut unique = schema.clone();
    unique["properties"]["toys"]["uniqueItems"] = json!(true);
    let body = json!({"messages": [{"role": "user", "content": chat}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": unique}}});
    let (status, _, b) = post(&d, "/v1/chat/completions", &body.to_string(), &[]);
    assert_eq!(status, 400, "{b}");
    let e: Value = serde_json::from_str(&b).unwrap();
    assert_eq!(e["error"]["param"], "response_format", "{b}");
    assert!(
        b.contains("uniqueItems") && b.contains("/properties/toys"),
        "{b}"
    );
    let o = grpc(&unique);
    assert!(
        !o.status.success()
            && stderr(&o).contains("InvalidArgument")
            && stderr(&o).contains("uniqueItems"),
        "{}",
        stderr(&o)
    );
    assert_eq!(hi(&d).0, 200);
}

/// Regular expressions, Lark grammars and choices (vLLM's `guided_regex`,
/// `structured_outputs.grammar`, `guided_choice`) through the real `openai` client's
/// extra_body, each text judged by Python's `re.fullmatch`; `sluiced run --regex` /
/// `--grammar` and grpcurl (RESPONSE_FORMAT_REGEX, _GRAMMAR) give the greedy texts; a
/// regex or grammar llguidance refuses is a 400 naming the field on HTTP and
/// InvalidArgument on gRPC.
#[test]
fn regex_grammar_and_choice_constraints_hold_on_every_wire() {
    let d = Daemon::start(&["--max-context", "512", "--max-batch", "4"]);
    let chat = "Give me a phone number and a date.";
    let regex = r"Call \(\d{3}\) \d{3}-\d{4} on 20\d\d-(0[1-9]|1[0-2])-[0-3]\d\.";
    let grammar = "start: \"Answer: \" word (\", \" word)* \".\"\nword: /[a-z]+/\n";
    let grammar_regex = r"Answer: [a-z]+(, [a-z]+)*\.";
    let file = d.tmp.path().join("answer.lark");
    std::fs::write(&file, grammar).unwrap();
    let got = python(&[
        "guided",
        &d.http,
        chat,
        regex,
        file.to_str().unwrap(),
        grammar_regex,
        "80",
    ]);
    for k in ["regex", "choice"] {
        let g = &got[k];
        assert_eq!(
            (&g["finish_reason"], &g["matches"]),
            (&json!("stop"), &json!(true)),
            "{k}: {g}"
        );
    }
    // The grammar's greedy text may run to max_tokens (a list of words has no end of its
    // own); whole or cut, it is one the grammar allows.
    let g = &got["grammar"];
    assert!(
        g["matches"] == true || g["finish_reason"] == "length",
        "{g}"
    );
    assert!(g["text"].as_str().unwrap().starts_with("Answer: "), "{g}");
    for s in got["regex_sampled"].as_array().unwrap() {
        assert_eq!(s["matches"], s["finish_reason"] == "stop", "{s}");
    }
    let run = sluiced_run(
        &d,
        &[
            "--chat",
            "--regex",
            regex,
            "--prompt",
            chat,
            "--max-tokens",
            "80",
        ],
    );
    assert_eq!(
        run["text"], got["regex"]["text"],
        "sluiced run --regex differs"
    );
    let run = sluiced_run(
        &d,
        &[
            "--chat",
            "--grammar",
            file.to_str().unwrap(),
            "--prompt",
            chat,
            "--max-tokens",
            "80",
        ],
    );
    assert_eq!(
        run["text"], got["grammar"]["text"],
        "sluiced run --grammar differs"
    );
    for (format, field, value, want) in [
        (
            "RESPONSE_FORMAT_REGEX",
            "regex",
            regex,
            &got["regex"]["text"],
        ),
        (
            "RESPONSE_FORMAT_GRAMMAR",
            "grammar",
            grammar,
            &got["grammar"]["text"],
        ),
    ] {
        let body = json!({"messages": [{"role": "user", "content": chat}], "max_tokens": 80,
                          "sampling": {"temperature": 0}, "response_format": format, field: value});
        let o = grpcurl_generate(&d, &body);
        assert!(o.status.success(), "{}", stderr(&o));
        assert_eq!(
            generated_text(&o),
            want.as_str().unwrap(),
            "grpcurl {format} differs"
        );
    }
    // Refused: named by field, nothing generated.
    for (extra, param) in [
        (json!({"guided_regex": "a("}), "guided_regex"),
        (
            json!({"structured_outputs": {"grammar": "start: undefined_rule"}}),
            "structured_outputs",
        ),
        (
            json!({"grammar": "start: \"a\"", "guided_regex": "b"}),
            "guided_regex",
        ),
    ] {
        let mut body = json!({"messages": [{"role": "user", "content": chat}], "max_tokens": 8});
        for (k, v) in extra.as_object().unwrap() {
            body[k] = v.clone();
        }
        let (status, _, b) = post(&d, "/v1/chat/completions", &body.to_string(), &[]);
        assert_eq!(status, 400, "{b}");
        let e: Value = serde_json::from_str(&b).unwrap();
        assert!(
            e["error"]["param"] == param || b.contains(param),
            "{param}: {b}"
        );
    }
    let body = json!({"prompt": chat, "response_format": "RESPONSE_FORMAT_REGEX", "regex": "a("});
    let o = grpcurl_generate(&d, &body);
    assert!(
        !o.status.success()
            && stderr(&o).contains("InvalidArgument")
            && stderr(&o).contains("regex"),
        "{}",
        stderr(&o)
    );
    assert_eq!(hi(&d).0, 200);
}
