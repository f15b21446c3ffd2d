//! The soak of `scripts/soak.py`, CI-sized: one minute and 20 clients against a daemon
//! whose queue (8 running, 4 waiting) is full most of the time, with every check of the
//! full soak: the daemon stays up; every valid request is answered whole or refused as busy
//! (429 / RESOURCE_EXHAUSTED) and every invalid one gets its 400 / 404 / INVALID_ARGUMENT
//! even while the queue is full; batch, queue and I/O pools end empty; the resident set
//! stays flat; the heap does not grow; greedy outputs are unchanged; and disk faults (short
//! and late reads) in the middle third fail no request. The full soak is
//! `scripts/soak.sh 60`, run before a release.

use serde_json::Value;
use sluice_tests::{bin, pack_store, smollm2_gguf, stderr, stdout};
use std::path::Path;
use std::process::Command;

#[test]
fn a_one_minute_soak_with_a_full_queue_holds_every_check_of_the_full_one() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("smollm2");
    pack_store(&smollm2_gguf(), &store, "lz4", 1 << 20);
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let bin_dir = bin("sluiced").parent().expect("bin dir").to_path_buf();
    let o = Command::new("python3")
        .arg(root.join("scripts/soak.py"))
        .args(["--minutes", "1", "--clients", "20", "--queue-max", "4"])
        .args(["--warmup-s", "15", "--sample-s", "5"])
        // Forty seconds of samples cannot resolve the full soak's 2 MiB an hour: the
        // resident set moves by a few MiB with the requests in flight (a minute measured
        // 172 MiB/h of such noise). 600 MiB/h still catches a leak of ~11 KiB a request at
        // this rate; the heap check catches smaller ones; the hour-long soak the rest.
        .args(["--rss-slope", "600"])
        .arg("--store")
        .arg(&store)
        .env("SLUICE_BIN", &bin_dir)
        .output()
        .expect("run python3 scripts/soak.py");
    let out = stdout(&o);
    eprintln!("{out}\n{}", stderr(&o));
    let line = out
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .unwrap_or_else(|| panic!("no JSON line from the soak: {out} {}", stderr(&o)));
    let j: Value = serde_json::from_str(line).expect("the soak's JSON line");
    for (check, ok) in j["checks"].as_object().expect("checks") {
        assert_eq!(ok, &Value::Bool(true), "soak check {check} failed: {out}");
    }
    assert!(o.status.success(), "{out}");
    let n = |k: &str| j["outcomes"][k].as_u64().unwrap_or(0);
    // The run met what it is there to meet: a full queue, bad requests on both wires,
    // over-long prompts, cancelled streams, and reads cut short by the faults.
    for k in [
        "http_refused_busy",
        "http_invalid",
        "grpc_invalid",
        "http_too_long",
        "http_complete",
        "grpc_complete",
    ] {
        assert!(n(k) > 0, "no {k} in a minute of soak: {line}");
    }
    assert!(
        n("http_cancelled") + n("grpc_cancelled") > 0,
        "no stream was cancelled: {line}"
    );
    assert!(j["io_short_reads"].as_u64().unwrap_or(0) > 0, "{line}");
}
