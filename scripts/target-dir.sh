#!/usr/bin/env bash
# Prints cargo's target directory for this workspace (CARGO_TARGET_DIR, a config's
# build.target-dir, or ./target), so scripts and `export PATH` find the binaries wherever
# cargo puts them:   export PATH="$(scripts/target-dir.sh)/release:$PATH"
set -euo pipefail
cd "$(dirname "$0")/.."
cargo metadata --format-version 1 --no-deps |
  python3 -c 'import json, sys; print(json.load(sys.stdin)["target_directory"])'
