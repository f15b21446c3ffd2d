//! `deploy/slurm-batch.sh`, the script users copy, on a real Slurm cluster: munged,
//! slurmctld and slurmd started on this machine by `scripts/slurm-local.sh` with a
//! generated config. A job array of 3 tasks, each with its own daemon on a Unix socket,
//! covers every id exactly once; so does one with a task cancelled mid-run (`scancel`)
//! and requeued (`scontrol requeue`). Prints the wall time of 3 tasks against 1.
//!
//! Needs root and Debian's munge, slurmctld, slurmd and slurm-client: opt in with
//! SLUICE_SLURM_TEST=1 (`.ci/run` installs Slurm and sets it; scripts/test.sh then runs
//! this test).

use sluice_tests::*;
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The cluster, stopped when dropped.
struct Cluster {
    dir: PathBuf,
    conf: PathBuf,
}

impl Cluster {
    fn start(dir: &Path) -> Cluster {
        let o = Command::new(root().join("scripts/slurm-local.sh"))
            .args(["start", dir.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(o.status.success(), "slurm-local.sh start: {}", stderr(&o));
        Cluster {
            dir: dir.to_path_buf(),
            conf: dir.join("slurm.conf"),
        }
    }

    fn cmd(&self, prog: &str, args: &[&str]) -> String {
        let o = Command::new(prog)
            .args(args)
            .env("SLURM_CONF", &self.conf)
            .output()
            .unwrap_or_else(|e| panic!("{prog}: {e}"));
        assert!(o.status.success(), "{prog} {args:?}: {}", stderr(&o));
        stdout(&o)
    }

    /// `JobState` of each task of array job `job`, by task id.
    fn states(&self, job: &str) -> HashMap<String, String> {
        let text = self.cmd("scontrol", &["show", "job", job, "--oneliner"]);
        text.lines()
            .filter_map(|l| {
                let field = |k: &str| {
                    l.split_whitespace()
                        .find_map(|f| f.strip_prefix(k))
                        .map(str::to_string)
                };
                Some((field("ArrayTaskId=")?, field("JobState=")?))
            })
            .collect()
    }

    fn wait_done(&self, job: &str, limit: Duration) {
        let t0 = Instant::now();
        loop {
            let s = self.states(job);
            if !s.is_empty()
                && s.values().all(|v| {
                    v != "PENDING" && v != "RUNNING" && v != "CONFIGURING" && v != "COMPLETING"
                })
            {
                for (task, state) in &s {
                    assert_eq!(
                        state,
                        "COMPLETED",
                        "task {task} of job {job}: {s:?}; logs in {}",
                        self.dir.display()
                    );
                }
                return;
            }
            assert!(
                t0.elapsed() < limit,
                "job {job} did not finish within {limit:?}: {s:?}"
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = Command::new(root().join("scripts/slurm-local.sh"))
            .args(["stop", self.dir.to_str().unwrap()])
            .output();
    }
}

fn ids_in(dir: &Path) -> Vec<String> {
    let mut ids = Vec::new();
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "jsonl") && !p.to_string_lossy().contains(".errors") {
            for l in std::fs::read_to_string(&p).unwrap().lines() {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                assert_ne!(v["finish_reason"], "cancelled", "{}: {l}", p.display());
                ids.push(v["id"].as_str().unwrap().to_string());
            }
        }
    }
    ids.sort();
    ids
}

fn lines_of(p: &Path) -> usize {
    std::fs::read_to_string(p).map_or(0, |t| t.lines().count())
}

#[test]
#[ignore = "needs root and Slurm: SLUICE_SLURM_TEST=1 scripts/test.sh (.ci/run installs Slurm and sets it)"]
fn a_slurm_array_writes_every_id_once_even_with_a_task_cancelled_and_requeued() {
    let tmp = tempfile::tempdir().unwrap();
    let cluster = Cluster::start(&tmp.path().join("slurm"));
    let store = tmp.path().join("smollm2");
    pack_lz4(&smollm2_gguf(), &store);
    let n_docs = 36;
    let input = tmp.path().join("docs.jsonl");
    let docs: String = (0..n_docs)
        .map(|i| serde_json::json!({"id": format!("doc-{i}"), "text": format!("{} Document number {i}.", PROMPTS[i % 16])}).to_string() + "\n")
        .collect();
    std::fs::write(&input, docs).unwrap();
    let mut want: Vec<String> = (0..n_docs).map(|i| format!("doc-{i}")).collect();
    want.sort();
    let bins = bin("sluiced").parent().unwrap().to_path_buf();
    let path = format!(
        "{}:{}",
        bins.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let script = root().join("deploy/slurm-batch.sh");
    // The script's directives ask for a GPU node; this one has 2 CPUs and no GPU.
    let submit = |tasks: &str, out: &Path, max_tokens: &str, max_batch: &str| -> String {
        let o = Command::new("sbatch")
            .args([
                "--parsable",
                "--array",
                tasks,
                "--gres=none",
                "--cpus-per-task=1",
                "--mem=2G",
            ])
            .arg(format!(
                "--output={}/slurm-%A_%a.out",
                cluster.dir.display()
            ))
            .arg(&script)
            .arg(&input)
            .arg(out)
            .env("SLURM_CONF", &cluster.conf)
            .env("PATH", &path)
            .env("SLUICE_STORE", &store)
            .env("SLUICE_MAX_TOKENS", max_tokens)
            .env("SLUICE_MAX_BATCH", max_batch)
            .env("SLUICE_MAX_CONTEXT", "256")
            .env("RUST_LOG", "warn")
            .output()
            .unwrap();
        assert!(o.status.success(), "sbatch: {}", stderr(&o));
        stdout(&o).trim().to_string()
    };

    // 3 tasks, then the same documents as 1 task: every id once, and the wall times.
    let out3 = tmp.path().join("out3");
    let t0 = Instant::now();
    let job = submit("1-3", &out3, "8", "8");
    cluster.wait_done(&job, Duration::from_secs(300));
    let wall3 = t0.elapsed();
    assert_eq!(ids_in(&out3), want, "3 tasks: every id exactly once");
    let out1 = tmp.path().join("out1");
    let t0 = Instant::now();
    let job = submit("1-1", &out1, "8", "8");
    cluster.wait_done(&job, Duration::from_secs(300));
    let wall1 = t0.elapsed();
    assert_eq!(ids_in(&out1), want, "1 task: every id exactly once");
    eprintln!(
        "slurm: {n_docs} documents, 3 tasks {:.1} s, 1 task {:.1} s (ratio {:.2})",
        wall3.as_secs_f64(),
        wall1.as_secs_f64(),
        wall3.as_secs_f64() / wall1.as_secs_f64()
    );

    // Task 2 cancelled once it has written part of its shard, then requeued.
    let out = tmp.path().join("out-requeue");
    let job = submit("1-3", &out, "24", "2");
    let shard2 = out.join("shard-2-of-3.jsonl");
    let t0 = Instant::now();
    while lines_of(&shard2) == 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(300),
            "task 2 never wrote a line"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let task2 = format!("{job}_2");
    cluster.cmd("scancel", &[&task2]);
    let t0 = Instant::now();
    while cluster.states(&job).get("2").map(String::as_str) != Some("CANCELLED") {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "task 2 was not cancelled: {:?}",
            cluster.states(&job)
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    let partial = lines_of(&shard2);
    cluster.cmd("scontrol", &["requeue", &task2]);
    // A requeued job waits before it is eligible again; now is soon enough here.
    cluster.cmd(
        "scontrol",
        &["update", &format!("jobid={task2}"), "StartTime=now"],
    );
    cluster.wait_done(&job, Duration::from_secs(300));
    let full = lines_of(&shard2);
    assert!(
        partial > 0 && partial < full,
        "the cancel should cut task 2 mid-run: {partial} of {full} lines written before it"
    );
    assert_eq!(
        ids_in(&out),
        want,
        "cancelled and requeued: every id exactly once"
    );
}
