//! One daemon serving a models directory: two real stores (SmolLM2 and Gemma 3, packed
//! with `sluiced pack --name`), each loaded by the first request that names it, each giving
//! what `sluiced run` gives on it; idle models unload after their keep-alive (the daemon's,
//! or a request's over gRPC and HTTP); a model that does not fit beside another in the
//! host budget unloads the idle one.

use serde_json::Value;
use sluice_tests::*;
use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn sluice(addr: &str, args: &[&str]) -> Output {
    Command::new(bin("sluice"))
        .arg("--addr")
        .arg(addr)
        .args(args)
        .env_remove("SLUICE_MODEL")
        .output()
        .expect("spawn sluice")
}

fn json_lines(o: &Output) -> Vec<Value> {
    assert!(o.status.success(), "{}", stderr(o));
    stdout(o)
        .lines()
        .map(|l| serde_json::from_str(l).expect("one JSON object per line"))
        .collect()
}

/// `sluice ps --json`: the loaded models by name.
fn loaded(addr: &str) -> Vec<(String, Value)> {
    json_lines(&sluice(addr, &["ps", "--json"]))
        .into_iter()
        .map(|m| (m["name"].as_str().unwrap_or_default().to_string(), m))
        .collect()
}

fn names(addr: &str) -> Vec<String> {
    loaded(addr).into_iter().map(|(n, _)| n).collect()
}

/// Polls until `sluice ps` lists exactly `want`, or panics after `within`.
fn wait_loaded(addr: &str, want: &[&str], within: Duration) {
    let t0 = Instant::now();
    loop {
        let now = names(addr);
        if now == want {
            return;
        }
        assert!(
            t0.elapsed() < within,
            "loaded models are {now:?}, not {want:?}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn pack(gguf: &Path, name: &str, dir: &Path) {
    sluiced_ok(&[
        "pack",
        gguf.to_str().unwrap(),
        "--name",
        name,
        "--models-dir",
        dir.to_str().unwrap(),
        "--codec",
        "lz4",
    ]);
}

const PROMPT: &str = "The three primary colors are";

/// Greedy token ids from the daemon for `model`.
fn served_ids(addr: &str, model: &str, extra: &[&str]) -> Value {
    let mut args = vec![
        "--model",
        model,
        "generate",
        "--temperature",
        "0",
        PROMPT,
        "--max-tokens",
        "12",
        "--json",
    ];
    args.extend_from_slice(extra);
    let o = sluice(addr, &args);
    assert!(o.status.success(), "{model}: {}", stderr(&o));
    let j: Value = serde_json::from_str(&stdout(&o)).unwrap();
    j["generated_token_ids"].clone()
}

/// Greedy token ids from `sluiced run` on the store.
fn run_ids(store: &Path) -> Value {
    let j: Value = serde_json::from_str(&sluiced_ok(&[
        "run",
        "--temperature",
        "0",
        store.to_str().unwrap(),
        "--prompt",
        PROMPT,
        "--max-tokens",
        "12",
        "--max-context",
        "512",
        "--json",
    ]))
    .unwrap();
    j["generated_token_ids"].clone()
}

fn two_stores() -> (tempfile::TempDir, std::path::PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("models");
    pack(&smollm2_gguf(), "smollm2", &dir);
    pack(&gemma3_gguf(), "gemma3", &dir);
    (tmp, dir)
}

#[test]
fn two_stores_in_a_models_directory_serve_their_own_outputs_and_unload_when_idle() {
    let (tmp, dir) = two_stores();
    let want_smol = run_ids(&dir.join("smollm2"));
    let want_gemma = run_ids(&dir.join("gemma3"));
    assert_ne!(want_smol, want_gemma);
    let d = Daemon::serve(
        tmp,
        &["--models-dir", dir.to_str().unwrap()],
        &["--keep-alive", "-1", "--max-context", "512"],
    );
    // Listed from their manifests, none loaded yet.
    let listed = json_lines(&sluice(&d.addr, &["models", "--json"]));
    let summary: Vec<_> = listed
        .iter()
        .map(|m| {
            (
                m["name"].as_str().unwrap(),
                m["architecture"].as_str().unwrap(),
                m["quantization"].as_str().unwrap(),
                m["loaded"].as_bool().unwrap(),
            )
        })
        .collect();
    // The file type each GGUF declares (general.file_type, as gguf-py reads it): Gemma 3
    // 270M's file is a Q4_K_M mix, though most of its matrices are Q5_0 (its 640-wide rows
    // do not split into K-quant blocks of 256).
    assert_eq!(
        summary,
        [
            ("gemma3", "gemma3", "Q4_K_M", false),
            ("smollm2", "llama", "Q4_1", false)
        ]
    );
    assert!(listed
        .iter()
        .all(|m| m["stored_bytes"].as_u64() > Some(1 << 20)));
    assert!(names(&d.addr).is_empty());

    // Each request gets its own model, loaded on demand, as `sluiced run` gives it.
    assert_eq!(served_ids(&d.addr, "smollm2", &[]), want_smol);
    assert_eq!(names(&d.addr), ["smollm2"]);
    assert_eq!(served_ids(&d.addr, "gemma3", &[]), want_gemma);
    assert_eq!(served_ids(&d.addr, "smollm2", &[]), want_smol);
    let ps = loaded(&d.addr);
    assert_eq!(ps.len(), 2);
    for (name, m) in &ps {
        assert_eq!(m["unload_in_s"].as_f64(), Some(-1.0), "{name} is kept");
        assert!(m["device_bytes"].as_u64() > Some(50 << 20), "{m}");
        assert!(m["host_bytes"].as_u64() > m["device_bytes"].as_u64(), "{m}");
    }
    let table = stdout(&sluice(&d.addr, &["ps"]));
    assert!(table.contains("stays loaded"), "{table}");

    // Two models and none named: the daemon asks which, and an unknown one is named back.
    let o = sluice(&d.addr, &["generate", "--temperature", "0", PROMPT]);
    assert!(!o.status.success());
    assert!(
        stderr(&o).contains("name a model") && stderr(&o).contains("\"gemma3\", \"smollm2\""),
        "{}",
        stderr(&o)
    );
    let o = sluice(
        &d.addr,
        &[
            "--model",
            "llama-70b",
            "generate",
            "--temperature",
            "0",
            PROMPT,
        ],
    );
    assert!(
        stderr(&o).contains("NotFound") && stderr(&o).contains("sluiced pack SRC --name llama-70b"),
        "{}",
        stderr(&o)
    );

    // A request's keep_alive over HTTP: SmolLM2 unloads a second after it, Gemma stays.
    let body = r#"{"model":"smollm2","prompt":"Hello","max_tokens":2,"keep_alive":"1s"}"#;
    let url = format!("{}/v1/completions", d.http);
    let o = curl(&[
        "-s",
        "-H",
        "Content-Type: application/json",
        "-d",
        body,
        &url,
    ]);
    let r: Value = serde_json::from_str(&stdout(&o)).unwrap();
    assert_eq!(r["model"], "smollm2", "{r}");
    wait_loaded(&d.addr, &["gemma3"], Duration::from_secs(10));
    // And over gRPC: "0" unloads Gemma as soon as its request is done.
    assert_eq!(
        served_ids(&d.addr, "gemma3", &["--keep-alive", "0"]),
        want_gemma
    );
    wait_loaded(&d.addr, &[], Duration::from_secs(5));
    let bad = r#"{"model":"smollm2","prompt":"Hello","keep_alive":"soon"}"#;
    let o = curl(&[
        "-s",
        "-H",
        "Content-Type: application/json",
        "-d",
        bad,
        &url,
    ]);
    assert!(stdout(&o).contains("keep_alive"), "{}", stdout(&o));

    // A store packed while the daemon runs is served without a restart.
    pack(&smollm2_gguf(), "smollm2-copy", &dir);
    assert_eq!(served_ids(&d.addr, "smollm2-copy", &[]), want_smol);
    let v: Value =
        serde_json::from_str(&stdout(&curl(&["-s", &format!("{}/v1/models", d.http)]))).unwrap();
    let ids: Vec<_> = v["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| (m["id"].as_str().unwrap(), m["loaded"].as_bool().unwrap()))
        .collect();
    assert_eq!(
        ids,
        [
            ("gemma3", false),
            ("smollm2", false),
            ("smollm2-copy", true)
        ]
    );
}

#[test]
fn a_model_that_does_not_fit_beside_an_idle_one_unloads_it() {
    let (_models, dir) = two_stores();
    // A long context: each arena is mostly KV cache, which the plan counts whole and which
    // stays untouched (not resident) until used.
    let limits = [
        "--keep-alive",
        "-1",
        "--max-context",
        "2048",
        "--max-batch",
        "8",
    ];
    let d = Daemon::serve(
        tempfile::tempdir().unwrap(),
        &["--models-dir", dir.to_str().unwrap()],
        &limits,
    );
    let gemma_ids = served_ids(&d.addr, "gemma3", &[]);
    let smol_ids = served_ids(&d.addr, "smollm2", &[]);
    let arena: std::collections::HashMap<String, u64> = loaded(&d.addr)
        .into_iter()
        .map(|(n, m)| (n, m["device_bytes"].as_u64().unwrap()))
        .collect();
    drop(d);

    // A host budget that holds either model with its read buffers and the process (160
    // MiB over the larger arena), but not the second arena beside the first model's
    // resident weights.
    let (g, s) = (arena["gemma3"], arena["smollm2"]);
    let budget = (g.max(s) + (160 << 20)).to_string();
    let mut args = limits.to_vec();
    args.extend(["--host-memory", &budget]);
    let d = Daemon::serve(
        tempfile::tempdir().unwrap(),
        &["--models-dir", dir.to_str().unwrap()],
        &args,
    );
    assert_eq!(served_ids(&d.addr, "gemma3", &[]), gemma_ids);
    assert_eq!(names(&d.addr), ["gemma3"]);
    assert_eq!(served_ids(&d.addr, "smollm2", &[]), smol_ids);
    assert_eq!(names(&d.addr), ["smollm2"], "Gemma was idle: it made room");
    let st: Value = serde_json::from_str(&stdout(&sluice(
        &d.addr,
        &["--model", "smollm2", "status", "--json"],
    )))
    .unwrap();
    assert_eq!(
        st["layers_streamed"], 0,
        "SmolLM2 has the budget to itself: {st}"
    );
    // Back to Gemma: whether SmolLM2's smaller resident set leaves it room or not, its
    // output is its own.
    assert_eq!(served_ids(&d.addr, "gemma3", &[]), gemma_ids);
    assert!(names(&d.addr).contains(&"gemma3".to_string()));
}

#[test]
fn a_store_directorys_draft_file_chooses_its_models_drafting() {
    let (tmp, dir) = two_stores();
    let want_smol = run_ids(&dir.join("smollm2"));
    std::fs::write(dir.join("smollm2").join("draft"), "ngram\n").unwrap();
    // A file that names nothing.
    std::fs::write(dir.join("gemma3").join("draft"), "ngram\nq8_0\n").unwrap();
    let d = Daemon::serve(
        tmp,
        &["--models-dir", dir.to_str().unwrap()],
        &[
            "--keep-alive",
            "-1",
            "--max-context",
            "512",
            "--draft-fixed",
        ],
    );
    // SmolLM2 drafts by prompt lookup (no --draft given), its output its own.
    assert_eq!(served_ids(&d.addr, "smollm2", &[]), want_smol);
    let st: Value = serde_json::from_str(&stdout(&sluice(
        &d.addr,
        &["--model", "smollm2", "status", "--json"],
    )))
    .unwrap();
    assert_eq!(st["speculative"]["drafter"], "ngram", "{st}");
    // Gemma's file is refused when it loads, naming the file and what it wants.
    let o = sluice(
        &d.addr,
        &["--model", "gemma3", "generate", PROMPT, "--max-tokens", "2"],
    );
    assert!(!o.status.success());
    let err = stderr(&o);
    assert!(
        err.contains("gemma3/draft") && err.contains("one line"),
        "{err}"
    );
}
