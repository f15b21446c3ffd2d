//! `sluiced run --host-memory` inside a real memory cgroup of the same limit: at every size
//! from "everything fits" down to the least the plan says runs, the process completes, is
//! never OOM-killed, stays within the limit by the kernel's own count (the cgroup's peak),
//! plans no more than the limit, and generates the same tokens as without a limit. Needs a
//! cgroup this process may create a child of (v1 `memory.limit_in_bytes` or v2
//! `memory.max`); where neither can be made the test says so and returns.

use sluice_tests::{bin, pack_store, sluiced, smollm2_gguf, stderr, stdout};
use std::path::{Path, PathBuf};
use std::process::Command;

/// A child memory cgroup of this process's own, removed on drop.
struct Cgroup {
    dir: PathBuf,
    v2: bool,
}

impl Cgroup {
    fn new(name: &str, limit: u64) -> Result<Cgroup, String> {
        let groups = std::fs::read_to_string("/proc/self/cgroup").map_err(|e| e.to_string())?;
        let mut found = None;
        for line in groups.lines() {
            let mut p = line.splitn(3, ':');
            let (_, ctl, path) = (p.next(), p.next().unwrap_or(""), p.next().unwrap_or(""));
            let path = path.trim_start_matches('/');
            if ctl.split(',').any(|c| c == "memory") {
                found = Some((Path::new("/sys/fs/cgroup/memory").join(path), false));
                break;
            }
            if ctl.is_empty() && Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
                found = Some((Path::new("/sys/fs/cgroup").join(path), true));
            }
        }
        let (parent, v2) = found.ok_or("no memory cgroup controller")?;
        if v2 {
            // Controllers must be enabled for children (may fail: then mkdir's files lack
            // memory.max and the error below says so).
            let _ = std::fs::write(parent.join("cgroup.subtree_control"), "+memory");
        }
        let dir = parent.join(name);
        if dir.exists() {
            let _ = std::fs::remove_dir(&dir);
        }
        std::fs::create_dir(&dir).map_err(|e| format!("mkdir {}: {e}", dir.display()))?;
        let cg = Cgroup { dir, v2 };
        let limit_file = if v2 {
            "memory.max"
        } else {
            "memory.limit_in_bytes"
        };
        std::fs::write(cg.dir.join(limit_file), limit.to_string())
            .map_err(|e| format!("write {limit_file} in {}: {e}", cg.dir.display()))?;
        Ok(cg)
    }

    fn read(&self, file: &str) -> String {
        std::fs::read_to_string(self.dir.join(file)).unwrap_or_default()
    }

    /// The most the cgroup was charged at once (anonymous memory and page cache).
    fn peak(&self) -> u64 {
        let f = if self.v2 {
            "memory.peak"
        } else {
            "memory.max_usage_in_bytes"
        };
        self.read(f).trim().parse().unwrap_or(0)
    }

    /// Processes the kernel's OOM killer killed in this cgroup.
    fn oom_kills(&self) -> u64 {
        let f = if self.v2 {
            "memory.events"
        } else {
            "memory.oom_control"
        };
        self.read(f)
            .lines()
            .find_map(|l| l.strip_prefix("oom_kill "))
            .and_then(|n| n.trim().parse().ok())
            .unwrap_or(0)
    }

    /// Runs `sluiced args` inside the cgroup (the shell moves itself in, then execs).
    fn sluiced(&self, args: &[&str]) -> std::process::Output {
        let procs = self.dir.join("cgroup.procs");
        Command::new("sh")
            .arg("-c")
            .arg(format!(
                "echo $$ > '{}' && exec \"$0\" \"$@\"",
                procs.display()
            ))
            .arg(bin("sluiced"))
            .args(args)
            .env("RUST_LOG", "warn")
            .output()
            .expect("spawn sluiced in the cgroup")
    }
}

impl Drop for Cgroup {
    fn drop(&mut self) {
        for _ in 0..100 {
            if std::fs::remove_dir(&self.dir).is_ok() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

fn run_args<'a>(store: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut a = vec![
        "run",
        "--temperature",
        "0",
        store,
        "--prompt",
        "The history of the printing press begins",
        "--max-tokens",
        "17",
        "--ignore-eos",
        "--max-context",
        "256",
        "--threads",
        "2",
        "--json",
    ];
    a.extend_from_slice(extra);
    a
}

fn json(o: &std::process::Output) -> serde_json::Value {
    serde_json::from_str(&stdout(o)).unwrap_or_else(|e| panic!("{e}: {}", stdout(o)))
}

#[test]
fn sluiced_run_completes_within_its_host_memory_inside_a_cgroup_of_that_limit() {
    let probe = match Cgroup::new("sluice-memlimit-probe", 64 << 20) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("SKIPPED: cannot make a memory cgroup here ({e})");
            return;
        }
    };
    drop(probe);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("smollm2");
    pack_store(&smollm2_gguf(), &dir, "lz4", 1 << 20);
    let store = dir.to_str().unwrap();

    let free = sluiced(&run_args(store, &[]));
    assert!(free.status.success(), "{}", stderr(&free));
    let free = json(&free);
    let want = free["generated_token_ids"].clone();
    assert_eq!(want.as_array().map(Vec::len), Some(17));
    assert_eq!(free["layers_streamed"], 0);
    let full = free["host_bytes_planned"].as_u64().unwrap();
    // The least host budget the plan runs with, from its own error.
    let e = sluiced(&run_args(store, &["--host-memory", "1MiB"]));
    assert!(!e.status.success());
    let msg = stderr(&e);
    assert!(
        msg.contains("host budget") && msg.contains("raise --host-memory"),
        "{msg}"
    );
    let least: u64 = msg
        .split(" bytes) at least")
        .next()
        .and_then(|s| s.rsplit('(').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no least budget in: {msg}"));
    assert!(
        least < full,
        "the least plan ({least}) is below all-resident ({full})"
    );

    // Overhead is measured at each start: a few MiB of slack above the least.
    let slack = 4 << 20;
    for (label, limit) in [
        ("everything fits", full),
        ("half way", (full + least) / 2),
        ("the least", least + slack),
    ] {
        let cg = Cgroup::new("sluice-memlimit", limit).expect("cgroup");
        let l = limit.to_string();
        let o = cg.sluiced(&run_args(store, &["--host-memory", &l]));
        assert_eq!(cg.oom_kills(), 0, "{label}: OOM-killed at {limit} bytes");
        assert!(
            o.status.success(),
            "{label} ({limit} bytes): {} {}",
            o.status,
            stderr(&o)
        );
        let j = json(&o);
        assert_eq!(
            j["generated_token_ids"], want,
            "{label}: other tokens than without a limit"
        );
        assert_eq!(j["host_bytes_budget"].as_u64(), Some(limit));
        let planned = j["host_bytes_planned"].as_u64().unwrap();
        let peak = j["host_bytes_peak"].as_u64().unwrap();
        assert!(planned <= limit, "{label}: planned {planned} > {limit}");
        // The kernel's own count: anonymous memory and the page cache charged to the
        // cgroup. (VmHWM also counts the executable's file pages, which the plan leaves to
        // the page cache and which may be charged to another cgroup: printed, not held.)
        assert!(cg.peak() <= limit, "{label}: cgroup peak {}", cg.peak());
        if label != "everything fits" {
            assert!(
                j["layers_streamed"].as_u64().unwrap() > 0,
                "{label}: nothing streams"
            );
            assert!(j["bytes_read"].as_u64().unwrap() > 0, "{label}");
        }
        eprintln!(
            "{label}: limit {} MiB, planned {} MiB, VmHWM {} MiB, cgroup peak {} MiB, {} layers streamed",
            limit >> 20,
            planned >> 20,
            peak >> 20,
            cg.peak() >> 20,
            j["layers_streamed"]
        );
    }
}
