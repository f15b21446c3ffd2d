#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh needs into .gpu-bundle/ (ignored by git), for a GPU
# machine without Rust or network: `sluiced` and the GPU test binary, debug info stripped
# (about 20 MB together). On that machine, run `scripts/gpu-check.sh` from the repository
# root with .gpu-bundle/ beside it; it uses the bundle when cargo is missing or
# SLUICE_PREBUILT=1.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --workspace
test_bin=$(cargo test --release --workspace --test cuda --no-run --message-format=json 2>/dev/null |
  python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("target", {}).get("name") == "cuda" and m.get("executable"):
        print(m["executable"])')
rm -rf .gpu-bundle
mkdir -p .gpu-bundle/deps
# The test binary finds sluiced one directory above its own (as in target/release/deps).
objcopy --strip-debug "$(scripts/target-dir.sh)/release/sluiced" .gpu-bundle/sluiced
objcopy --strip-debug "$test_bin" .gpu-bundle/deps/cuda
du -sh .gpu-bundle
