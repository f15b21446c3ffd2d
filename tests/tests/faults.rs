//! The daemon under a misbehaving disk. Faults are injected under its I/O engine (the
//! reader `daemon/src/io/faults.rs` wraps around io_uring, switched on by `SLUICE_FAULTS`
//! and steered through a control file while the daemon runs): reads failing with EIO, reads
//! cut short, reads answered seconds late. And a pack onto a file system that fills up.

use serde_json::Value;
use sluice_tests::*;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

const PROMPT: &str = r#"{"prompt":"The capital of France is","max_tokens":4,"temperature":0}"#;

/// POSTs the completion; returns the status and the body.
fn complete(d: &Daemon) -> (u16, Value) {
    let (code, body) = post_json(&d.http, "/v1/completions", PROMPT);
    let v = serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"));
    (code, v)
}

fn text(v: &Value) -> String {
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_else(|| panic!("no text in {v}"))
        .to_string()
}

fn status(d: &Daemon) -> Value {
    let o = Command::new(bin("sluice"))
        .args(["--addr", &d.addr, "status", "--json"])
        .env_remove("SLUICE_API_KEY")
        .output()
        .expect("spawn sluice");
    assert!(o.status.success(), "{}", stderr(&o));
    serde_json::from_str(&stdout(&o)).expect("status JSON")
}

fn faults(control: &Path, spec: &str) {
    std::fs::write(control, spec).expect("write the fault control file");
    // The reader reads the file again at most every 20 ms.
    std::thread::sleep(Duration::from_millis(100));
}

/// Polls the status until `ok`, for at most 20 s.
fn wait_status(d: &Daemon, what: &str, ok: impl Fn(&Value) -> bool) -> Value {
    let t0 = Instant::now();
    loop {
        let s = status(d);
        if ok(&s) {
            return s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "after {what}, buffers or slots were not given back: {s}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// After faults stop: every read buffer comes back, a request gets the clean output, and
/// then the pools stand exactly as at idle before the faults (a pass leaves the next
/// pass's first layers prefetched in staging slots; a failed one does not).
fn recovered(d: &Daemon, want: &str, idle: &Value, what: &str) -> Value {
    wait_status(d, what, |s| {
        s["io_read_buffers_free"] == s["io_read_buffers"] && s["active_sequences"] == 0
    });
    let (code, v) = complete(d);
    assert_eq!(
        (code, text(&v)),
        (200, want.to_string()),
        "after {what}: {v}"
    );
    wait_status(d, what, |s| {
        s["io_read_buffers_free"] == idle["io_read_buffers_free"]
            && s["io_slots_free"] == idle["io_slots_free"]
            && s["active_sequences"] == 0
    })
}

#[test]
fn eio_short_reads_and_stalls_under_a_serving_daemon_fail_only_the_requests_they_touch() {
    let ctl_dir = tempfile::tempdir().unwrap();
    let control = ctl_dir.path().join("faults");
    std::fs::write(&control, "").unwrap();
    // Every layer streams, so every request reads the disk; one sequence at a time keeps
    // each request's reads its own.
    let mut flags = ALL_STREAMING.to_vec();
    flags.extend(["--read-timeout", "1s"]);
    let d = Daemon::start_env(&flags, &[("SLUICE_FAULTS", control.to_str().unwrap())]);
    let (code, v) = complete(&d);
    assert_eq!(code, 200, "{v}");
    let want = text(&v);
    // The pass leaves the next pass's first layers prefetching: idle once they landed.
    let idle = wait_status(&d, "the first request", |s| {
        s["io_read_buffers_free"] == s["io_read_buffers"] && s["active_sequences"] == 0
    });
    assert!(idle["layers_streamed"].as_u64().unwrap() > 20, "{idle}");
    let mut matrix = Vec::new();

    // EIO on 0.5% of reads: a request reads about 130 times, so about half meet one.
    faults(&control, "eio=0.005 seed=11");
    let (mut served, mut failed) = (0, 0);
    for _ in 0..16 {
        let (code, v) = complete(&d);
        match code {
            200 => {
                assert_eq!(text(&v), want, "a request served under EIO changed");
                served += 1;
            }
            500 => {
                assert_eq!(v["error"]["code"], "data_loss", "{v}");
                let m = v["error"]["message"].as_str().unwrap();
                assert!(
                    m.contains("weights.bin")
                        && m.contains("Input/output error")
                        && m.contains("at offset"),
                    "the error names the file, the offset and the errno: {m}"
                );
                failed += 1;
            }
            other => panic!("status {other} under EIO: {v}"),
        }
    }
    assert!(served > 0 && failed > 0, "{served} served, {failed} failed");
    matrix.push(format!(
        "EIO on 0.5% of reads: {served} served unchanged, {failed} DATA_LOSS naming the read"
    ));
    faults(&control, "");
    recovered(&d, &want, &idle, "EIO");

    // Every read cut to half: each is resubmitted for its rest, nothing fails.
    let before = status(&d)["io_short_reads"].as_u64().unwrap();
    faults(&control, "short=1");
    for _ in 0..4 {
        let (code, v) = complete(&d);
        assert_eq!(code, 200, "short reads failed a request: {v}");
        assert_eq!(text(&v), want, "short reads changed an output");
    }
    faults(&control, "");
    let s = recovered(&d, &want, &idle, "short reads");
    let short = s["io_short_reads"].as_u64().unwrap() - before;
    assert!(short > 20, "{short} short reads counted");
    matrix.push(format!(
        "every read short: 4 of 4 served unchanged, {short} reads resubmitted"
    ));

    // Stalls below the limit only slow requests down.
    faults(&control, "stall=0.1 stall_ms=300 seed=5");
    for _ in 0..4 {
        let (code, v) = complete(&d);
        assert_eq!(code, 200, "a stall below the limit failed a request: {v}");
        assert_eq!(text(&v), want);
    }
    faults(&control, "");
    recovered(&d, &want, &idle, "short stalls");
    matrix.push("10% of reads 0.3 s late (limit 1 s): 4 of 4 served unchanged".into());

    // A disk that answers 4 s late, past the 1 s limit: the waiting request is failed
    // within about the limit, with UNAVAILABLE, on both wires; the daemon keeps serving.
    let stalled_before = status(&d)["io_reads_stalled"].as_u64().unwrap();
    faults(&control, "stall=1 stall_ms=4000");
    let t0 = Instant::now();
    let (code, v) = complete(&d);
    let took = t0.elapsed();
    assert_eq!(code, 503, "{v}");
    assert_eq!(v["error"]["type"], "server_error", "{v}");
    let m = v["error"]["message"].as_str().unwrap();
    assert!(
        m.contains("weights.bin")
            && m.contains("has not completed after")
            && m.contains("read_timeout 1 s"),
        "{m}"
    );
    assert!(took < Duration::from_secs(4), "failed after {took:?}");
    let o = Command::new(bin("sluice"))
        .args([
            "--addr",
            &d.addr,
            "generate",
            "--temperature",
            "0",
            "The capital of France is",
            "--max-tokens",
            "4",
        ])
        .output()
        .unwrap();
    assert!(!o.status.success(), "a stalled generate succeeded");
    assert!(stderr(&o).contains("Unavailable"), "{}", stderr(&o));
    faults(&control, "");
    // The stalled reads land 4 s after they were sent: then every buffer and slot is back.
    let s = recovered(&d, &want, &idle, "stalls past the limit");
    // The first request's read timed out; the second fails on a read of its own or, when
    // every staging slot is still held by the first one's unanswered reads (the loads
    // ahead hold all of them), on the wait for a slot: UNAVAILABLE either way (above).
    let stalled = s["io_reads_stalled"].as_u64().unwrap() - stalled_before;
    assert!(stalled >= 1, "{s}");
    matrix.push(format!(
        "every read 4 s late (limit 1 s): HTTP 503 after {:.1} s, gRPC UNAVAILABLE; {stalled} reads timed out, all buffers back once they landed",
        took.as_secs_f64()
    ));

    let mut child = d;
    assert!(
        child.child.try_wait().unwrap().is_none(),
        "the daemon died under faults"
    );
    for row in &matrix {
        println!("{row}");
    }
}

/// Runs `sh -c script` in a private mount namespace with a 16 MiB tmpfs at `mnt` (real
/// ENOSPC from the kernel); None where such a namespace cannot be made here.
fn on_small_tmpfs(mnt: &Path, script: &str) -> Option<std::process::Output> {
    let full = format!(
        "mount -t tmpfs -o size=16m sluice-test {} && {script}",
        mnt.display()
    );
    let probe = Command::new("unshare")
        .args([
            "-rm",
            "sh",
            "-c",
            &format!("mount -t tmpfs none {}", mnt.display()),
        ])
        .output()
        .ok()?;
    if !probe.status.success() {
        return None;
    }
    Command::new("unshare")
        .args(["-rm", "sh", "-c", &full])
        .output()
        .ok()
}

#[test]
#[ignore = "needs a private mount namespace with a tmpfs (unshare -rm): scripts/test.sh runs it where one can be made, SLUICE_PRIVILEGED_TESTS=1 insists"]
fn a_pack_onto_a_full_disk_says_so_and_leaves_no_partial_store() {
    let gguf = smollm2_gguf();
    let tmp = tempfile::tempdir().unwrap();
    let mnt = tmp.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let sluiced = bin("sluiced");
    // A store that fits (a tiny fixture), then SmolLM2 (92 MiB) packed over it with --force,
    // then SmolLM2 to a new name: both no longer fit in 16 MiB.
    let tiny = fixture("tiny-llama");
    let script = format!(
        "{s} pack {tiny} -o {m}/store >/dev/null 2>&1 || exit 90
         {s} pack {g} -o {m}/store --force --codec lz4 2>{m}/err1; echo \"rc1=$?\"
         {s} pack {g} -o {m}/other --codec lz4 2>{m}/err2; echo \"rc2=$?\"
         echo ERR1; cat {m}/err1; echo ERR2; cat {m}/err2; rm {m}/err1 {m}/err2
         echo LS; ls -A {m}
         {s} verify {m}/store >/dev/null 2>&1; echo \"verify=$?\"",
        s = sluiced.display(),
        tiny = tiny.display(),
        g = gguf.display(),
        m = mnt.display(),
    );
    let o = on_small_tmpfs(&mnt, &script).unwrap_or_else(|| {
        panic!("no private mount namespace with a tmpfs can be made here (unshare -rm): run where user namespaces are allowed, or leave this test out (SLUICE_PRIVILEGED_TESTS=0)")
    });
    let out = stdout(&o);
    assert!(o.status.success(), "{out}\n{}", stderr(&o));
    let (head, ls) = out.split_once("LS\n").expect("the listing");
    assert!(head.contains("rc1=1") && head.contains("rc2=1"), "{out}");
    for err in head.split("ERR").skip(1) {
        assert!(
            err.contains("No space left on device")
                && err.contains("weights.bin")
                && err.contains("free space on that file system or pack to another directory")
                && err.contains("The partial store was removed"),
            "{err}"
        );
    }
    assert!(
        head.contains("the store already at") && head.contains("is unchanged"),
        "{out}"
    );
    assert!(head.contains("no store was made"), "{out}");
    // Only the first store is left, whole: no partial directory, no second store.
    let (listing, verify) = ls.split_once("verify=").expect("verify ran");
    assert_eq!(
        listing.split_whitespace().collect::<Vec<_>>(),
        ["store"],
        "{out}"
    );
    assert_eq!(
        verify.trim(),
        "0",
        "the store packed over is not intact: {out}"
    );
}
