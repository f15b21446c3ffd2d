#!/usr/bin/env bash
# The CUDA backend on a machine with an NVIDIA GPU, in one go (well under 8 minutes on a
# 16-core workstation with a warm cargo cache):
#   1. build (skipped with SLUICE_PREBUILT=1 when target/release is already built here),
#   2. the GPU tests: every op against the CPU backend on random inputs, whole-model
#      logits of the tiny models and SmolLM2 against the CPU backend, streamed vs all
#      resident on the GPU bit for bit (tests/tests/cuda.rs, --include-ignored),
#   3. the streaming benchmark on a synthetic multi-GiB model with the device budget at
#      50 % of its weights, and on SmolLM2 (decode tokens/s all resident and streamed),
#   4. a short table of the figures, last.
#
#   SLUICE_CACHE       cache directory (default ~/.cache/sluice): model, kernels
#   SLUICE_SYNTH_SIZE  size of the synthetic model (default 4GiB)
#   SLUICE_GPU_TMP     where the synthetic store goes (default $SLUICE_CACHE/stores; needs
#                      a file system that allows O_DIRECT, i.e. not tmpfs, for disk figures)
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
cache="${SLUICE_CACHE:-$HOME/.cache/sluice}"
work="${SLUICE_GPU_TMP:-$cache/stores}"
mkdir -p "$work"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT

if ! command -v nvidia-smi >/dev/null || ! nvidia-smi -L >/dev/null 2>&1; then
  echo "gpu-check: no NVIDIA GPU visible (nvidia-smi -L fails); nothing to check" >&2
  exit 1
fi
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader

# NVRTC and cuBLAS: a CUDA toolkit on the library path, or the pip wheels
# (nvidia-cuda-nvrtc-cu12, nvidia-cublas-cu12) when installed.
for mod in nvidia.cuda_nvrtc nvidia.cublas; do
  d=$(python3 -c "import $mod as m, os; print(os.path.join(list(m.__path__)[0], 'lib'))" 2>/dev/null || true)
  if [ -n "$d" ] && [ -d "$d" ]; then
    export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  fi
done

if [ "${SLUICE_PREBUILT:-0}" != 1 ]; then
  cargo build --release --workspace
  cargo test --release -p sluice-tests --test cuda --no-run
fi
sluiced=./target/release/sluiced
export SLUICE_SMOLLM2_GGUF="${SLUICE_SMOLLM2_GGUF:-$(scripts/fetch-model.sh)}"

echo "== GPU tests"
if [ "${SLUICE_PREBUILT:-0}" = 1 ]; then
  t=$(ls -t target/release/deps/cuda-* | grep -v '\.d$' | head -1)
  "$t" --include-ignored --test-threads=1 2>&1 | tee "$out/tests.txt"
else
  cargo test --release -p sluice-tests --test cuda -- --include-ignored --test-threads=1 2>&1 | tee "$out/tests.txt"
fi
tests=$(grep -E '^test result' "$out/tests.txt" | tail -1)

echo "== streaming benchmark: synthetic model"
synth="$work/gpu-check-synth"
if [ ! -f "$synth/manifest.bin" ]; then
  "$sluiced" synth -o "$synth" --size "${SLUICE_SYNTH_SIZE:-4GiB}" --hidden 4096 --dtype bf16 --codec none
fi
"$sluiced" bench-stream "$synth" --backend cuda --weights-budget 50% --batch 1,8,32 \
  --steps 8 --prompt-tokens 16 --json > "$out/synth.json"

echo "== streaming benchmark: SmolLM2"
smol="$work/gpu-check-smollm2"
if [ ! -f "$smol/manifest.bin" ]; then
  "$sluiced" pack "$SLUICE_SMOLLM2_GGUF" -o "$smol" --codec zstd:1 --force
fi
"$sluiced" bench-stream "$smol" --backend cuda --weights-budget 50% --batch 1,8 \
  --steps 32 --prompt-tokens 16 --json > "$out/smol.json"

echo
echo "== gpu-check summary ($(( $(date +%s) - start )) s)"
python3 - "$out/synth.json" "$out/smol.json" "$tests" <<'EOF'
import json, sys
s, m, tests = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), sys.argv[3]
gib = 1 << 30
print(f"GPU tests: {tests}")
print(f"{'figure':<58} {'value':>10} {'target':>8}")
def row(k, v, t=""):
    print(f"{k:<58} {v:>10} {t:>8}")
print(f"synthetic model {s['model_raw_bytes']/gib:.2f} GiB bf16, budget {s['device_budget']/gib:.2f} GiB "
      f"({s['layers_resident']} units resident, {s['layers_streamed']} streamed)")
row("copy stream H2D while streaming, GB/s", f"{s['copy_gbps']:.2f}")
row("plain pinned cuMemcpyHtoD of a slot's size, GB/s", f"{s['plain_h2d_gbps']:.2f}")
row("  ratio", f"{s['copy_vs_plain']:.3f}", ">= 0.9")
row("pass ms: compute-only / streaming-only / streamed", f"{s['compute_only_pass_s']*1e3:.1f}/{s['streaming_only_pass_s']*1e3:.1f}/{s['streamed_pass_s']*1e3:.1f}")
row("  streamed / max(compute-only, streaming-only)", f"{s['overlap_ratio']:.3f}", "<= 1.1")
for b in s["batches"]:
    row(f"  synthetic decode batch {b['batch']}: tokens/s (vs linear)", f"{b['tokens_per_s']:.1f} ({b['vs_linear']:.2f})")
row("SmolLM2 decode tokens/s, all resident (batch 1)", f"{m['resident_tokens_per_s']:.1f}")
row(f"SmolLM2 decode tokens/s, streamed {m['layers_streamed']} of {m['layers_streamed']+m['layers_resident']} units (batch 1)", f"{m['streamed_tokens_per_s']:.1f}")
for b in m["batches"]:
    row(f"  SmolLM2 streamed batch {b['batch']}: tokens/s", f"{b['tokens_per_s']:.1f}")
EOF
