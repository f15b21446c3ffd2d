#!/usr/bin/env bash
# The main job on the default model: fetch SmolLM2-135M-Instruct, build, pack it into a
# store, inspect it, verify every frame, then generate from it with about half of its
# weights streaming from disk.
#
#   SLUICE_CACHE   cache directory (default ~/.cache/sluice); the store goes to $SLUICE_CACHE/stores/smollm2
set -euo pipefail
cd "$(dirname "$0")/.."
cache="${SLUICE_CACHE:-$HOME/.cache/sluice}"
gguf="$(scripts/fetch-model.sh)"
cargo build --release --workspace
store="$cache/stores/smollm2"
./target/release/sluiced pack "$gguf" -o "$store" --codec zstd:3 --force
./target/release/sluiced inspect "$store"
./target/release/sluiced verify "$store"
./target/release/sluiced run "$store" --chat --prompt "Explain in two sentences why disks are slower than memory." \
  --max-tokens 96 --max-context 1024 --device-memory 100MiB
