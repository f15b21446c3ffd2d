//! Shared helpers for the end-to-end tests: where the fixtures, the real SmolLM2 model and
//! the built binaries are.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The committed tiny fixture models (tests/fixtures, made by make_tiny.py); from
/// $SLUICE_FIXTURES when set (a test binary run away from its build tree, as
/// scripts/gpu-check.sh does with a prebuilt bundle).
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
        codec: codec.parse().expect("codec"),
        frame_size,
        threads: 2,
        force: true,
    };
    sluice::store::writer::pack(&model, &units, out, &opts, |_| {}).expect("pack");
    std::sync::Arc::new(sluice::store::Store::open(out).expect("open the packed store"))
}
