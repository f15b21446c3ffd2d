//! README.md's quick start runs as written: its indented block is run by bash, command by
//! command (`set -e`), against the default model on loopback, with HOME in a temporary
//! directory so `~/models` is the test's own. Only `cargo build --release` is left out:
//! scripts/test.sh built the binaries this test runs. The examples show what they say: the
//! streaming run's plan streams, the daemon answers, the batches write their outputs.

use sluice_tests::*;
use std::path::Path;
use std::process::Command;

/// The quick start's commands: the indented lines after "## Quick start" up to the next
/// heading, unindented.
fn quick_start(readme: &str) -> String {
    let mut out = String::new();
    let mut on = false;
    for l in readme.lines() {
        if l.starts_with("## ") {
            on = l.trim() == "## Quick start";
            continue;
        }
        if on {
            if let Some(cmd) = l.strip_prefix("    ") {
                out.push_str(cmd);
                out.push('\n');
            } else if !l.trim().is_empty() {
                break;
            }
        }
    }
    out
}

#[test]
fn the_quick_start_runs_as_written() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let block = quick_start(&readme);
    assert!(
        block.contains("sluiced serve") && block.contains("sluice batch"),
        "{block}"
    );
    let script = format!(
        "set -euo pipefail\ntrap 'kill $(jobs -p) 2>/dev/null || true' EXIT\n{}",
        block.replace("cargo build --release\n", ": built by scripts/test.sh\n")
    );
    let home = tempfile::tempdir().unwrap();
    // The model cache stays where scripts/test.sh put the model.
    let cache = std::env::var_os("SLUICE_CACHE")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            std::env::var_os("HOME")
                .map(std::path::PathBuf::from)
                .unwrap_or_default()
                .join(".cache/sluice")
        });
    let o = Command::new("bash")
        .args(["-c", &script])
        .current_dir(&root)
        .env("HOME", home.path())
        .env_remove("SLUICE_MODELS_DIR")
        .env_remove("XDG_DATA_HOME")
        .env_remove("XDG_STATE_HOME")
        .env_remove("SLUICE_MODEL")
        .env("SLUICE_CACHE", &cache)
        .env("RUST_LOG", "warn")
        .env_remove("SLUICE_ADDR")
        .env_remove("SLUICE_API_KEY")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let (out, err) = (stdout(&o), stderr(&o));
    assert!(
        o.status.success(),
        "the quick start failed:\n--- stdout\n{out}\n--- stderr\n{err}"
    );
    // Every `sluiced run` shows what it is there to show: it generates text (a prompt the
    // model ends at once prints nothing, and looks broken).
    assert!(
        !err.contains("decode: 0 tokens") && !err.contains("prefill: 0 tokens"),
        "a quick start run generated nothing:\n{err}"
    );
    // The streaming example streams, and its plan says so.
    assert!(
        err.contains("Streamed"),
        "the streaming example streams nothing:\n{err}"
    );
    assert!(out.contains("Paris"), "{out}");
    assert!(
        out.contains("sluice.v1.Inference") && out.contains("SERVING"),
        "{out}"
    );
    assert!(out.contains("data: [DONE]"), "{out}");
    assert!(out.contains("sluice_requests_total"), "{out}");
    let lines =
        |f: &str| std::fs::read_to_string(home.path().join(f)).map_or(0, |t| t.lines().count());
    assert_eq!(lines("summaries.jsonl"), 2);
    assert_eq!(lines("results.jsonl"), 2);
    // One place for the store: the models directory the README and run-default.sh share.
    assert!(home
        .path()
        .join(".local/share/sluice/models/smollm2/manifest.bin")
        .is_file());
}
