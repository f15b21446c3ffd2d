#!/usr/bin/env bash
# The main job on the default model: fetch SmolLM2-135M-Instruct, build, pack it into a
# store (--codec auto: it measures the disk and prints what it chose), inspect it, verify
# every frame, then generate from it with 18 of its 32 units (41 % of its weights)
# streaming from disk.
#
#   SLUICE_CACHE        where the GGUF is cached (default ~/.cache/sluice)
#   SLUICE_MODELS_DIR   the models directory the store goes to as "smollm2", the one the
#                       README and `sluiced serve` use (default ~/.local/share/sluice/models)
set -euo pipefail
cd "$(dirname "$0")/.."
gguf="$(scripts/fetch-model.sh)"
cargo build --release --workspace
# The binaries are wherever cargo put them (CARGO_TARGET_DIR, build.target-dir, ./target).
bin="$(scripts/target-dir.sh)/release"
"$bin/sluiced" pack "$gguf" --name smollm2 --codec auto --force
"$bin/sluiced" inspect smollm2
"$bin/sluiced" verify smollm2
"$bin/sluiced" run smollm2 --chat --prompt "Explain in two sentences why disks are slower than memory." \
  --max-tokens 96 --max-context 1024 --device-memory 80MiB
