//! `sluice batch` against a real daemon on loopback: items cut off by a shutdown are never
//! written and a rerun completes them; OpenAI batch files run unchanged; bad lines and
//! items that cannot succeed go to the errors file with their line numbers; an output made
//! with other parameters is not added to; documents longer than the context fail, or are
//! cut with --truncate. And the Kubernetes example validates against the API's schema.

use serde_json::{json, Value};
use sluice_tests::*;
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn lines(path: &Path) -> Vec<Value> {
    std::fs::read_to_string(path)
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect()
}

fn batch(d: &Daemon, args: &[&str]) -> Output {
    Command::new(bin("sluice"))
        .args(["--addr", &d.addr, "batch", "--temperature", "0"])
        .args(args)
        .output()
        .expect("spawn sluice batch")
}

/// `sluice batch ARGS` started against `d`, once it has written 4 items to `out`.
fn batch_started(d: &Daemon, args: &[&str], out: &Path) -> std::process::Child {
    let c = Command::new(bin("sluice"))
        .args(["--addr", &d.addr, "batch", "--temperature", "0"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while lines(out).len() < 4 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "nothing was written"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    c
}

fn write_docs(path: &Path, n: usize, extra: &[&str]) {
    let mut text: String = (0..n)
        .map(|i| {
            json!({"id": format!("doc-{i}"), "text": format!("{} Document number {i}.", PROMPTS[i % 16])})
                .to_string()
                + "\n"
        })
        .collect();
    for l in extra {
        text.push_str(l);
        text.push('\n');
    }
    std::fs::write(path, text).unwrap();
}

#[test]
fn items_cut_off_by_a_shutdown_are_not_written_and_a_rerun_completes_them() {
    let mut d = Daemon::start(&[
        "--max-context",
        "256",
        "--max-batch",
        "4",
        "--shutdown-grace-s",
        "1",
    ]);
    let tmp = tempfile::tempdir().unwrap();
    let (input, out) = (tmp.path().join("in.jsonl"), tmp.path().join("out.jsonl"));
    write_docs(&input, 24, &[]);
    let args = [
        input.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--max-tokens",
        "48",
        "--retries",
        "1",
        // Without waiting for the daemon to come back (the next test waits).
        "--wait-daemon",
        "0",
    ];
    let c = batch_started(&d, &args, &out);
    // The daemon stops with requests in flight; its grace period (1 s) is too short for them.
    // SAFETY: plain kill(2) on our child's pid.
    unsafe { libc::kill(d.child.id() as i32, libc::SIGTERM) };
    let o = c.wait_with_output().unwrap();
    assert!(
        !o.status.success(),
        "the job cannot have finished: {}",
        stderr(&o)
    );
    let got = lines(&out);
    assert!(
        got.len() < 24,
        "the shutdown came too late to cut anything off"
    );
    for l in &got {
        let f = l["finish_reason"].as_str().unwrap();
        assert!(
            f == "stop" || f == "length",
            "a cut-off item was written: {l}"
        );
        assert!(l["generated_tokens"].as_u64().unwrap() > 0);
    }
    assert!(
        stderr(&o).contains("unfinished (a rerun retries them)"),
        "{}",
        stderr(&o)
    );
    assert_eq!(
        o.status.code(),
        Some((24 - got.len()) as i32),
        "the exit status is the number of items that failed: {}",
        stderr(&o)
    );
    d.child.wait().unwrap();
    // A new daemon on the same model: the rerun does the rest, each id once.
    let d2 = Daemon::start(&["--max-context", "256", "--max-batch", "4"]);
    let o = batch(&d2, &args);
    assert!(o.status.success(), "{}", stderr(&o));
    let got = lines(&out);
    let mut ids: Vec<&str> = got.iter().map(|l| l["id"].as_str().unwrap()).collect();
    ids.sort();
    let mut want: Vec<String> = (0..24).map(|i| format!("doc-{i}")).collect();
    want.sort();
    assert_eq!(ids, want, "every id exactly once");
    assert!(got.iter().all(|l| l["finish_reason"] != "cancelled"));
}

/// A daemon that is SIGKILLed mid-job and comes back (as systemd's Restart=on-failure
/// brings it back): the client waits for it, and the job completes with every id once.
#[test]
fn a_daemon_killed_mid_job_and_restarted_finishes_the_job_with_every_id_once() {
    let limits = ["--max-context", "256", "--max-batch", "4"];
    let mut d = Daemon::start(&limits);
    let tmp = tempfile::tempdir().unwrap();
    let (input, out) = (tmp.path().join("in.jsonl"), tmp.path().join("out.jsonl"));
    write_docs(&input, 24, &[]);
    let args = [
        input.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--max-tokens",
        "48",
    ];
    let c = batch_started(&d, &args, &out);
    d.child.kill().unwrap(); // SIGKILL: no drain, requests in flight just end
    d.child.wait().unwrap();
    let written_before = lines(&out).len();
    assert!(
        written_before < 24,
        "the kill came too late to cut anything off"
    );
    std::thread::sleep(Duration::from_secs(2)); // systemd's RestartSec
    let strip = |a: &str| a.trim_start_matches("http://").to_string();
    let store = d.store();
    let mut again = Command::new(bin("sluiced"))
        .args([
            "serve",
            "--model",
            store.to_str().unwrap(),
            "--config",
            "/dev/null",
        ])
        .args([
            "--listen",
            &strip(&d.addr),
            "--http-listen",
            &strip(&d.http),
        ])
        .args(limits)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let o = c.wait_with_output().unwrap();
    let _ = again.kill();
    let _ = again.wait();
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stderr(&o).contains("waiting up to"), "{}", stderr(&o));
    let got = lines(&out);
    let mut ids: Vec<&str> = got.iter().map(|l| l["id"].as_str().unwrap()).collect();
    ids.sort_unstable();
    let want: Vec<String> = {
        let mut w: Vec<String> = (0..24).map(|i| format!("doc-{i}")).collect();
        w.sort_unstable();
        w
    };
    assert_eq!(
        ids,
        want.iter().map(String::as_str).collect::<Vec<_>>(),
        "each id once"
    );
}

#[test]
fn openai_batch_files_run_unchanged_with_bad_lines_reported_by_number() {
    let d = Daemon::start(&["--max-context", "256", "--max-batch", "4"]);
    let tmp = tempfile::tempdir().unwrap();
    let chat = |i: usize| json!({"model": "smollm2", "messages": [{"role": "user", "content": PROMPTS[i]}], "max_tokens": 10, "temperature": 0});
    let mut input: Vec<String> = (0..5)
        .map(|i| json!({"custom_id": format!("req-{i}"), "method": "POST", "url": "/v1/chat/completions", "body": chat(i)}).to_string())
        .collect();
    input.push(json!({"custom_id": "cmpl", "method": "POST", "url": "/v1/completions", "body": {"prompt": PROMPTS[7], "max_tokens": 6, "temperature": 0}}).to_string());
    input.push("{not json".into()); // line 7
    input.push(json!({"method": "POST", "url": "/v1/completions", "body": {}}).to_string()); // 8
    input.push(json!({"custom_id": "req-1", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}).to_string()); // 9
    input.push(
        json!({"custom_id": "get", "method": "GET", "url": "/v1/models", "body": {}}).to_string(),
    ); // 10
    input.push(json!({"custom_id": "n0", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": [{"role": "user", "content": "x"}], "n": 0}}).to_string()); // 11
    let path = tmp.path().join("in.jsonl");
    std::fs::write(&path, input.join("\n") + "\n").unwrap();
    let out = tmp.path().join("out.jsonl");
    let run = || {
        let (p, o) = (path.to_str().unwrap(), out.to_str().unwrap());
        batch(&d, &["--format", "openai", p, "-o", o])
    };
    let o = run();
    assert_eq!(
        o.status.code(),
        Some(5),
        "five items failed: {}",
        stderr(&o)
    );
    let got = lines(&out);
    assert_eq!(got.len(), 6);
    for l in &got {
        assert!(l["id"].as_str().unwrap().starts_with("batch_req_"), "{l}");
        assert_eq!(l["error"], Value::Null);
        assert_eq!(l["response"]["status_code"], 200);
        assert_eq!(l["response"]["request_id"], l["response"]["body"]["id"]);
    }
    // Each body is what the HTTP API answers for the same request.
    let url = format!("{}/v1/chat/completions", d.http);
    for i in 0..5 {
        let l = got
            .iter()
            .find(|l| l["custom_id"] == format!("req-{i}"))
            .unwrap();
        let o = curl(&["-s", "-d", &chat(i).to_string(), &url]);
        let http: Value = serde_json::from_str(&stdout(&o)).unwrap();
        let body = &l["response"]["body"];
        assert_eq!(body["object"], "chat.completion");
        assert_eq!(
            body["choices"][0]["message"], http["choices"][0]["message"],
            "req-{i}"
        );
        // The counts, not `prompt_tokens_details.cached_tokens`: the HTTP request comes
        // second and may find the batch's KV for its prompt in the prefix cache.
        for k in ["prompt_tokens", "completion_tokens", "total_tokens"] {
            assert_eq!(body["usage"][k], http["usage"][k], "req-{i}: {k}");
        }
    }
    let c = got.iter().find(|l| l["custom_id"] == "cmpl").unwrap();
    assert_eq!(c["response"]["body"]["usage"]["completion_tokens"], 6);
    let errors = lines(&tmp.path().join("out.jsonl.errors.jsonl"));
    let by_line: Vec<(Value, &str)> = errors
        .iter()
        .map(|e| {
            (
                e["error"]["line"].clone(),
                e["error"]["message"].as_str().unwrap(),
            )
        })
        .collect();
    for (line, needle) in [
        (7, "not JSON"),
        (8, "no \"custom_id\""),
        (9, "appears twice (first on line 2)"),
        (10, "must be \"POST\""),
    ] {
        assert!(
            by_line
                .iter()
                .any(|(l, m)| *l == json!(line) && m.contains(needle)),
            "line {line} ({needle}) not reported: {errors:?}"
        );
    }
    let n0 = errors
        .iter()
        .find(|e| e["custom_id"] == "n0")
        .expect("the 400 is in the errors file");
    assert_eq!(n0["response"]["status_code"], 400);
    assert_eq!(n0["error"]["param"], "n");
    // A rerun does nothing twice: the failed item is tried again, the written ones are not.
    let o = run();
    assert_eq!(o.status.code(), Some(5), "{}", stderr(&o));
    assert_eq!(lines(&out).len(), 6);
    assert!(
        stderr(&o).contains("1 items to do (6 already in"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn other_parameters_are_refused_and_over_long_documents_fail_or_are_cut() {
    let d = Daemon::start(&["--max-context", "128", "--max-batch", "4"]);
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in.jsonl");
    // 50 KB: past what any 128 tokens of SmolLM2 can hold (its longest token is 81 bytes),
    // so it is refused by its length, and cut to that before truncation tokenizes it.
    let long = json!({"id": "long", "text": "The river ran on and on. ".repeat(2000)}).to_string();
    write_docs(&input, 6, &[&long]);
    let out = tmp.path().join("out.jsonl");
    let run = |extra: &[&str]| {
        let mut a = vec![
            input.to_str().unwrap(),
            "-o",
            out.to_str().unwrap(),
            "--max-tokens",
            "8",
        ];
        a.extend_from_slice(extra);
        batch(&d, &a)
    };
    let o = run(&["--json"]);
    assert_eq!(o.status.code(), Some(1), "{}", stderr(&o));
    let summary: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(
        (summary["written"].as_u64(), summary["errors"].as_u64()),
        (Some(6), Some(1))
    );
    assert!(summary["documents_per_minute"].as_f64().unwrap() > 0.0);
    assert!(summary["generated_tokens_per_s"].as_f64().unwrap() > 0.0);
    assert_eq!(summary["concurrency"], 4, "the daemon's max batch");
    let errors = lines(&tmp.path().join("out.jsonl.errors.jsonl"));
    assert_eq!(errors.len(), 1);
    assert_eq!(errors[0]["id"], "long");
    assert!(
        errors[0]["message"]
            .as_str()
            .unwrap()
            .contains("the context holds 128"),
        "{errors:?}"
    );
    let params: Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("out.jsonl.params.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(params["max_tokens"], 8);
    assert_eq!(params["model"]["name"], "smollm2");
    // Other parameters: refused, nothing written.
    let mut a = vec![
        input.to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
        "--max-tokens",
        "9",
    ];
    let o = batch(&d, &a);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("max_tokens: 8 -> 9") && stderr(&o).contains("--force-params"),
        "{}",
        stderr(&o)
    );
    assert_eq!(lines(&out).len(), 6);
    // --truncate cuts the long document to fit, and says so.
    a.extend(["--truncate", "--force-params"]);
    let o = batch(&d, &a);
    assert!(o.status.success(), "{}", stderr(&o));
    let got = lines(&out);
    assert_eq!(got.len(), 7);
    let l = got.iter().find(|l| l["id"] == "long").unwrap();
    assert_eq!(l["truncated"], true);
    let prompt = l["prompt_tokens"].as_u64().unwrap();
    assert!(
        prompt + 9 <= 128 && prompt > 100,
        "cut to fit, not further: {l}"
    );
    assert!(got
        .iter()
        .filter(|l| l["id"] != "long")
        .all(|l| l["truncated"] == false));
}

/// `--json-object`: every item that finished on its own is one JSON object (serde_json's
/// reading), the parameters record it, and a rerun without it is refused as other
/// parameters.
#[test]
fn json_object_jobs_write_objects_and_record_the_mode() {
    let d = Daemon::start(&["--max-context", "256", "--max-batch", "4"]);
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in.jsonl");
    write_docs(&input, 6, &[]);
    let out = tmp.path().join("out.jsonl");
    let args = |json_mode: bool| {
        let mut a = vec![
            input.to_str().unwrap().to_string(),
            "-o".into(),
            out.to_str().unwrap().into(),
            "--template".into(),
            "Give a JSON object with a title and a one-line summary of this text: {text}".into(),
            "--max-tokens".into(),
            "96".into(),
        ];
        if json_mode {
            a.push("--json-object".into());
        }
        a
    };
    let a = args(true);
    let o = batch(&d, &a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(o.status.success(), "{}", stderr(&o));
    let got = lines(&out);
    assert_eq!(got.len(), 6);
    let mut whole = 0;
    for l in &got {
        let text = l["output"].as_str().unwrap();
        let object = serde_json::from_str::<serde_json::Map<String, Value>>(text).is_ok();
        assert_eq!(object, l["finish_reason"] == "stop", "{l}");
        whole += usize::from(object);
    }
    assert!(whole >= 3, "{got:?}");
    let params: Value = serde_json::from_str(
        &std::fs::read_to_string(tmp.path().join("out.jsonl.params.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(params["response_format"], "json_object");
    let a = args(false);
    let o = batch(&d, &a.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(
        !o.status.success() && stderr(&o).contains("response_format"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn the_kubernetes_example_validates_and_wires_each_index_to_its_shard() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../deploy/kubernetes-indexed-job.yaml"
    );
    let o = Command::new("kubernetes-validate")
        .args(["--strict", path])
        .output()
        .expect("kubernetes-validate is missing: pip install kubernetes-validate (.ci/run does)");
    assert!(o.status.success(), "{}{}", stdout(&o), stderr(&o));
    // completions N, shard k/N with k = index + 1, one output file per shard.
    let check = r#"
import re, sys, yaml
job = yaml.safe_load(open(sys.argv[1]))
n = job["spec"]["completions"]
assert job["spec"]["completionMode"] == "Indexed"
script = job["spec"]["template"]["spec"]["containers"][0]["args"][0]
assert "k=$((JOB_COMPLETION_INDEX + 1))" in script, script
assert f"--shard $k/{n}" in script, script
assert f"shard-$k-of-{n}.jsonl" in script, script
print(n)
"#;
    let o = Command::new("python3")
        .args(["-c", check, path])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", stderr(&o));
}
