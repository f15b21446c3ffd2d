#!/usr/bin/env bash
# The whole test suite: fetches the real test models (cached), then runs every test of the
# workspace in release mode (the same build `cargo build --release` makes, so it is reused).
set -euo pipefail
cd "$(dirname "$0")/.."
export SLUICE_SMOLLM2_GGUF="$(scripts/fetch-model.sh)"
export SLUICE_GEMMA3_GGUF="$(scripts/fetch-model.sh gemma3-270m)"
# NVRTC for the kernel compile test: the CUDA NVRTC wheel's library, when installed (.ci/run
# installs it); a CUDA toolkit on the library path works too.
nvrtc_lib=$(python3 -c 'import nvidia.cuda_nvrtc as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null || true)
if [ -n "$nvrtc_lib" ] && [ -d "$nvrtc_lib" ]; then
  export LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# Style and lints first: formatting is checked, and every clippy warning is an error (an
# #[allow] carries a comment saying why). Clippy shares the release profile's dependencies.
cargo fmt --all -- --check
cargo clippy --release --workspace --all-targets -- -D warnings
# The end-to-end tests run the real binaries; `cargo test` builds only the test harnesses of
# other packages' binaries, so build them first.
cargo build --release --workspace
cargo test --release --workspace "$@"
# The Slurm test starts a one-machine cluster as root (scripts/slurm-local.sh): opt in with
# SLUICE_SLURM_TEST=1, as .ci/run does after installing Slurm.
if [ "${SLUICE_SLURM_TEST:-0}" = 1 ]; then
  cargo test --release -p sluice-tests --test slurm -- --ignored --nocapture
fi
