//! Shared helpers for the end-to-end tests: where the fixtures, the real SmolLM2 model and
//! the built binaries are.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

pub mod engine;
pub mod ops;
pub mod source;

/// The committed tiny fixture models (tests/fixtures, made by make_tiny.py); from
/// $SLUICE_FIXTURES when set (a test binary run away from its build tree, as
/// scripts/gpu-check.sh does with a prebuilt bundle).
/// Every architecture's tiny model (fixtures): Llama, Qwen2, Qwen3, Gemma 3 and Mistral
/// (sliding windows of 8), the three mixtures (gpt-oss with attention sinks and a window).
pub const TINY_ARCHS: [&str; 8] = [
    "tiny-llama",
    "tiny-qwen2",
    "tiny-qwen3",
    "tiny-gemma3",
    "tiny-mistral",
    "tiny-mixtral",
    "tiny-qwen3moe",
    "tiny-gptoss",
];

pub fn fixture(name: &str) -> PathBuf {
    match std::env::var_os("SLUICE_FIXTURES") {
        Some(dir) => PathBuf::from(dir).join(name),
        None => Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures")
            .join(name),
    }
}

/// A real model's GGUF: the path in `env`, else `file` in the model cache. Tests that need
/// it fail (never skip) when it is missing: scripts/test.sh fetches it first.
fn real_model(env: &str, file: &str, fetch: &str) -> PathBuf {
    let path = std::env::var_os(env).map(PathBuf::from).unwrap_or_else(|| {
        let home = std::env::var_os("HOME")
            .map(PathBuf::from)
            .unwrap_or_default();
        let cache = std::env::var_os("SLUICE_CACHE")
            .map(PathBuf::from)
            .unwrap_or(home.join(".cache/sluice"));
        cache.join("models").join(file)
    });
    assert!(
        path.is_file(),
        "{} is missing: run scripts/fetch-model.sh {fetch} (scripts/test.sh does)",
        path.display()
    );
    path
}

/// The real SmolLM2-135M-Instruct GGUF (Q4_1).
pub fn smollm2_gguf() -> PathBuf {
    real_model(
        "SLUICE_SMOLLM2_GGUF",
        "SmolLM2-135M-Instruct.Q4_1.gguf",
        "smollm2",
    )
}

/// The real Gemma 3 270M GGUF (Q4_K_M: F32, Q8_0, Q5_0, Q4_K, Q6_K).
pub fn gemma3_gguf() -> PathBuf {
    real_model(
        "SLUICE_GEMMA3_GGUF",
        "gemma-3-270m-q4_k_m.gguf",
        "gemma3-270m",
    )
}

/// A plan with no device or host-cache budget (every unit resident on the CPU) and the
/// planner's defaults for the rest, for `opts`.
pub fn plan_input(opts: sluice::model::ModelOptions) -> sluice::plan::PlanInput {
    sluice::plan::PlanInput {
        device_budget: None,
        host_cache_budget: 0,
        opts,
        prefetch: None,
        expert_cache: None,
        expert_profile: None,
        backend_reserved: 0,
        self_draft_reserved: 0,
        host: Default::default(),
    }
}

/// The daemon's Status, asked over gRPC by grpcurl, as proto3 JSON.
pub fn grpc_status(d: &Daemon) -> serde_json::Value {
    let o = std::process::Command::new("grpcurl")
        .args(["-plaintext", "-d", "{}"])
        .arg(d.addr.trim_start_matches("http://"))
        .arg("sluice.v1.Inference/Status")
        .output()
        .expect("grpcurl");
    assert!(o.status.success(), "{}", stderr(&o));
    serde_json::from_str(&stdout(&o)).expect("Status JSON")
}

/// The small I/O engine the tests' pipelines read through: 2 staging slots, 8 reads of 1 MiB.
pub fn small_io() -> sluice::io::IoConfig {
    sluice::io::IoConfig {
        staging_slots: 2,
        queue_depth: 8,
        read_buffers: 8,
        request_bytes: 1 << 20,
        ..sluice::io::IoConfig::default()
    }
}

/// A binary of the workspace, from the same target directory as the test executable.
/// `cargo test` does not rebuild another package's binaries: scripts/test.sh runs
/// `cargo build --release --workspace` first.
pub fn bin(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps");
    let path = dir.join(name);
    assert!(
        path.is_file(),
        "{} is missing: run scripts/test.sh (it builds the binaries, then tests)",
        path.display()
    );
    path
}

/// Runs `sluiced` with `args` and returns its output.
pub fn sluiced(args: &[&str]) -> Output {
    Command::new(bin("sluiced"))
        .args(args)
        .env("RUST_LOG", "warn")
        .output()
        .expect("spawn sluiced")
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// Runs `sluiced` and panics with its stderr unless it succeeds.
pub fn sluiced_ok(args: &[&str]) -> String {
    let o = sluiced(args);
    assert!(
        o.status.success(),
        "sluiced {args:?} failed: {}",
        stderr(&o)
    );
    stdout(&o)
}

/// Runs `sluiced`, expects it to fail, and returns its stderr.
pub fn sluiced_err(args: &[&str]) -> String {
    let o = sluiced(args);
    assert!(
        !o.status.success(),
        "sluiced {args:?} succeeded but should have failed: {}",
        stdout(&o)
    );
    let e = stderr(&o);
    assert!(!e.contains("panicked"), "sluiced {args:?} panicked: {e}");
    e
}

/// Copies a directory tree (fixture models) so a test can damage its copy.
pub fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create dir");
    for e in std::fs::read_dir(from).expect("read dir") {
        let e = e.expect("dir entry");
        let dst = to.join(e.file_name());
        if e.file_type().expect("file type").is_dir() {
            copy_dir(&e.path(), &dst);
        } else {
            std::fs::copy(e.path(), dst).expect("copy");
        }
    }
}

/// Imports `src` (a fixture or the real model), packs it into a store at `out` with
/// `codec` and `frame_size`, and opens it: the setup most tests share.
pub fn pack_store(
    src: &Path,
    out: &Path,
    codec: &str,
    frame_size: u32,
) -> std::sync::Arc<sluice::store::Store> {
    let model = sluice::import::open(src).expect("import the source model");
    let units = model.units().expect("units of the source model");
    let opts = sluice::store::writer::PackOptions {
        auto: None,
        codec: codec.parse().expect("codec"),
        frame_size,
        threads: 2,
        force: true,
        link: false,
    };
    sluice::store::writer::pack(&model, &units, out, &opts, |_| {}).expect("pack");
    std::sync::Arc::new(sluice::store::Store::open(out).expect("open the packed store"))
}

/// Prompts for the daemon tests, one per client.
pub const PROMPTS: [&str; 16] = [
    "The history of the printing press begins",
    "Photosynthesis is the process by which",
    "The three laws of motion state that",
    "A good way to learn a new language is",
    "The tallest mountain in the world",
    "In computer science, a hash table",
    "The French Revolution started because",
    "To bake bread at home, you need",
    "The ocean covers most of the planet and",
    "Volcanoes form when",
    "The first airplane flight took place",
    "A healthy breakfast usually includes",
    "The human heart has four chambers that",
    "Jazz music originated in",
    "The speed of light is",
    "Electric cars are becoming popular because",
];

/// `serve` flags under which SmolLM2 streams all but its embedding, head and two layers
/// (so every request reads the disk again), one short sequence at a time.
pub const ALL_STREAMING: [&str; 6] = [
    "--max-context",
    "64",
    "--max-batch",
    "1",
    "--device-memory",
    "48MiB",
];

/// A free TCP port on loopback (bound, then released for the daemon to take).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port on loopback")
        .port()
}

/// `sluiced serve` on SmolLM2 (packed with lz4 into a temporary store) as a real process
/// on loopback: gRPC at `addr`, the HTTP API at `http`. Killed when dropped.
pub struct Daemon {
    pub child: std::process::Child,
    /// gRPC, `http://127.0.0.1:PORT`.
    pub addr: String,
    /// The HTTP API, `http://127.0.0.1:PORT`.
    pub http: String,
    pub tmp: tempfile::TempDir,
}

impl Daemon {
    /// Packs SmolLM2 and starts the daemon with `extra` flags; returns once `/health`
    /// answers 200 (sent with the `--api-key` of `extra` when there is one).
    pub fn start(extra: &[&str]) -> Daemon {
        Daemon::start_env(extra, &[])
    }

    /// `start` with environment variables for the daemon.
    pub fn start_env(extra: &[&str], env: &[(&str, &str)]) -> Daemon {
        let tmp = tempfile::tempdir().expect("temp dir");
        let store = tmp.path().join("smollm2");
        pack_lz4(&smollm2_gguf(), &store);
        let store = store.to_str().expect("utf-8 path").to_string();
        Daemon::serve_env(tmp, &["--model", &store], extra, env)
    }

    /// Starts `sluiced serve` with `models` (such as `--models-dir DIR`) then `extra`;
    /// `tmp` lives as long as the daemon.
    pub fn serve(tmp: tempfile::TempDir, models: &[&str], extra: &[&str]) -> Daemon {
        Daemon::serve_env(tmp, models, extra, &[])
    }

    /// `serve` with environment variables for the daemon.
    pub fn serve_env(
        tmp: tempfile::TempDir,
        models: &[&str],
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Daemon {
        let listen = format!("127.0.0.1:{}", free_port());
        let http_listen = format!("127.0.0.1:{}", free_port());
        let mut args = vec!["serve"];
        args.extend_from_slice(models);
        args.extend_from_slice(&[
            "--listen",
            &listen,
            "--http-listen",
            &http_listen,
            "--config",
            "/dev/null",
        ]);
        args.extend_from_slice(extra);
        let child = Command::new(bin("sluiced"))
            .args(&args)
            .env("RUST_LOG", "warn")
            .env_remove("SLUICE_API_KEY")
            .envs(env.iter().copied())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("spawn sluiced serve");
        let key = extra
            .iter()
            .position(|a| *a == "--api-key")
            .map(|i| extra[i + 1].to_string());
        let mut d = Daemon {
            child,
            addr: format!("http://{listen}"),
            http: format!("http://{http_listen}"),
            tmp,
        };
        let t0 = std::time::Instant::now();
        loop {
            let mut c = vec!["-s", "-o", "/dev/null", "-w", "%{http_code}"];
            let auth = key.as_ref().map(|k| format!("Authorization: Bearer {k}"));
            if let Some(a) = &auth {
                c.extend(["-H", a.as_str()]);
            }
            let url = format!("{}/health", d.http);
            c.push(&url);
            if stdout(&curl(&c)) == "200" {
                return d;
            }
            if let Some(status) = d.child.try_wait().expect("wait on sluiced") {
                let mut err = String::new();
                if let Some(mut e) = d.child.stderr.take() {
                    let _ = std::io::Read::read_to_string(&mut e, &mut err);
                }
                panic!("sluiced serve exited with {status}: {err}");
            }
            assert!(
                t0.elapsed() < std::time::Duration::from_secs(60),
                "the daemon did not come up"
            );
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
    }

    pub fn store(&self) -> PathBuf {
        self.tmp.path().join("smollm2")
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Packs `gguf` into the store `store` with lz4 (`sluiced pack`).
pub fn pack_lz4(gguf: &Path, store: &Path) {
    sluiced_ok(&[
        "pack",
        gguf.to_str().expect("utf-8 path"),
        "-o",
        store.to_str().expect("utf-8 path"),
        "--codec",
        "lz4",
    ]);
}

/// POSTs a JSON `body` to `base` + `path` with curl; returns the status and the body.
pub fn post_json(base: &str, path: &str, body: &str) -> (u16, String) {
    let url = format!("{base}{path}");
    let o = curl(&[
        "-s",
        "-w",
        "\n%{http_code}",
        "-d",
        body,
        "-H",
        "Content-Type: application/json",
        &url,
    ]);
    let out = stdout(&o);
    let (body, code) = out.rsplit_once('\n').expect("curl printed the status");
    (code.parse().expect("an HTTP status"), body.to_string())
}

/// Runs curl (an HTTP client nobody here wrote) with `args`.
pub fn curl(args: &[&str]) -> Output {
    Command::new("curl")
        .args(args)
        .output()
        .expect("curl is missing: apt-get install curl (.ci/run does)")
}

/// Runs `tests/SCRIPT` (a Python client nobody here wrote drives the daemon) with `args`;
/// its stdout is one JSON object. `deps` says what to install when it fails.
pub fn python_json(script: &str, args: &[&str], deps: &str) -> serde_json::Value {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join(script);
    let o = Command::new("python3")
        .arg(&path)
        .args(args)
        .output()
        .expect("python3");
    assert!(
        o.status.success(),
        "{script} {args:?} failed (pip install {deps}; .ci/run does): {}",
        stderr(&o)
    );
    serde_json::from_str(&stdout(&o)).unwrap_or_else(|e| panic!("{script} prints JSON: {e}"))
}

/// `Generate` called by grpcurl with `body` (JSON).
pub fn grpcurl_generate(d: &Daemon, body: &serde_json::Value) -> Output {
    Command::new("grpcurl")
        .args(["-plaintext", "-d", &body.to_string()])
        .arg(d.addr.trim_start_matches("http://"))
        .arg("sluice.v1.Inference/Generate")
        .output()
        .expect("grpcurl")
}

/// Logits of a two-sequence prefill step and a decode step, and a greedy continuation.
pub fn outputs(
    r: &mut sluice::pipeline::Pipeline<sluice::backend::cpu::CpuBackend>,
    vocab: u32,
) -> (Vec<u32>, Vec<u32>) {
    let a: Vec<u32> = (0..20).map(|i| (i * 37 + 5) % vocab).collect();
    let b: Vec<u32> = (0..7).map(|i| (i * 11 + 3) % vocab).collect();
    let mut logits = Vec::new();
    r.step(
        &[
            sluice::model::SeqStep {
                slot: 0,
                pos: 0,
                tokens: a.clone(),
                verify: false,
                ..Default::default()
            },
            sluice::model::SeqStep {
                slot: 1,
                pos: 0,
                tokens: b.clone(),
                verify: false,
                ..Default::default()
            },
        ],
        &mut logits,
    )
    .unwrap();
    let mut bits: Vec<u32> = logits.iter().map(|f| f.to_bits()).collect();
    r.step(
        &[
            sluice::model::SeqStep {
                slot: 1,
                pos: 7,
                tokens: vec![9],
                verify: false,
                ..Default::default()
            },
            sluice::model::SeqStep {
                slot: 0,
                pos: 20,
                tokens: vec![4],
                verify: false,
                ..Default::default()
            },
        ],
        &mut logits,
    )
    .unwrap();
    bits.extend(logits.iter().map(|f| f.to_bits()));
    let mut ids = Vec::new();
    let mut next = sluice::text::sampler::argmax(&logits[..vocab as usize]);
    for pos in 21..33 {
        ids.push(next);
        r.step(
            &[sluice::model::SeqStep {
                slot: 0,
                pos,
                tokens: vec![next],
                verify: false,
                ..Default::default()
            }],
            &mut logits,
        )
        .unwrap();
        next = sluice::text::sampler::argmax(&logits);
    }
    (bits, ids)
}

/// Every unit's raw bytes, decoded by the store's plain reader (no I/O engine).
pub fn decoded_units(store: &sluice::store::Store) -> Vec<Vec<u8>> {
    let file = store.open_weights().unwrap();
    let mut dec = store
        .frame_decoder(store.manifest().frame_raw_len_max() as usize)
        .unwrap();
    let mut stored = Vec::new();
    (0..store.units().len())
        .map(|i| {
            let mut raw = vec![0u8; store.units()[i].raw_len as usize];
            store
                .read_unit(&file, i, &mut stored, &mut raw, &mut dec)
                .unwrap();
            raw
        })
        .collect()
}
