#!/usr/bin/env bash
# The whole test suite: fetches the real test model (cached), then runs every test of the
# workspace in release mode (the same build `cargo build --release` makes, so it is reused).
set -euo pipefail
cd "$(dirname "$0")/.."
export SLUICE_SMOLLM2_GGUF="$(scripts/fetch-model.sh)"
# The end-to-end tests run the real binaries; `cargo test` builds only the test harnesses of
# other packages' binaries, so build them first.
cargo build --release --workspace
cargo test --release --workspace "$@"
