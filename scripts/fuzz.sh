#!/usr/bin/env bash
# Fuzzes every parser that reads what sluice did not write, SECONDS each (default 60):
# GGUF, safetensors + config.json, manifest.bin, stored frames of every codec, chat
# templates on arbitrary messages (and arbitrary templates), the tokenizers, OpenAI bodies,
# gRPC GenerateRequest. cargo-fuzz (libFuzzer) on nightly; it is installed if missing. The
# targets run one after another on every core libFuzzer uses: start it when nothing else
# needs the machine (before a release: scripts/fuzz.sh 600).
#
# Each target starts from its committed corpus (fuzz/corpus/TARGET: the seeds
# fuzz/make_seeds.py writes and what earlier runs merged back) and grows a working corpus
# outside the repository, in $SLUICE_FUZZ_WORK/TARGET (default
# ${SLUICE_CACHE:-~/.cache/sluice}/fuzz), kept from run to run. With SLUICE_FUZZ_MERGE=1
# the working corpus is then minimized back into fuzz/corpus/TARGET (libFuzzer -merge=1:
# only inputs that reach coverage the committed ones do not) for whoever makes a release to
# commit, since the stable test suite runs every committed input. Off by default: a first
# run from the seeds adds thousands of inputs (20 s a target added 5,000, 22 MB).
# A crash is saved under fuzz/artifacts/TARGET/; once fixed, copy the input to
# fuzz/regressions/TARGET/, where the stable test suite runs it on every build.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-60}"
work_root="${SLUICE_FUZZ_WORK:-${SLUICE_CACHE:-$HOME/.cache/sluice}/fuzz}"
merge="${SLUICE_FUZZ_MERGE:-0}"
command -v cargo-fuzz >/dev/null || cargo +nightly install --locked cargo-fuzz
# SLUICE_FUZZ_TARGETS="openai grpc" fuzzes only those (the parsers a change touched).
read -r -a targets <<<"${SLUICE_FUZZ_TARGETS:-gguf safetensors manifest frame template tokenizer openai grpc}"
cd fuzz
cargo +nightly fuzz build
mkdir -p "$work_root"
# -rss_limit_mb: an input that makes a parser allocate past 2 GiB is a finding too.
limits=(-rss_limit_mb=2048 -timeout=10 -max_len=65536)
failed=()
printf '%-12s %12s %8s %8s %8s %18s\n' target runs "exec/s" cov ft "corpus (merged)"
for t in "${targets[@]}"; do
  work="$work_root/$t" log="$work_root/$t.log"
  mkdir -p "$work" "artifacts/$t" "corpus/$t"
  if ! cargo +nightly fuzz run "$t" "$work" "corpus/$t" -- -max_total_time="$secs" \
    "${limits[@]}" -artifact_prefix="artifacts/$t/" -print_final_stats=1 >"$log" 2>&1; then
    failed+=("$t")
  fi
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  rate=$(sed -n 's/^stat::average_exec_per_sec: *//p' "$log")
  cov=$(grep -oE 'cov: [0-9]+' "$log" | tail -1 | grep -oE '[0-9]+' || true)
  ft=$(grep -oE 'ft: [0-9]+' "$log" | tail -1 | grep -oE '[0-9]+' || true)
  before=$(find "corpus/$t" -type f | wc -l)
  if [ "$merge" = 1 ]; then
    cargo +nightly fuzz run "$t" "corpus/$t" "$work" -- -merge=1 "${limits[@]}" \
      >>"$log" 2>&1 || echo "$t: merging the working corpus back failed; see $log" >&2
  fi
  after=$(find "corpus/$t" -type f | wc -l)
  printf '%-12s %12s %8s %8s %8s %18s\n' "$t" "${runs:-0}" "${rate:-0}" "${cov:-?}" "${ft:-?}" \
    "$after (+$((after - before)))"
  grep -E "^==[0-9]+== ERROR|^SUMMARY|Test unit written" "$log" || true
done
found=$(find artifacts -type f | wc -l)
echo "working corpora and logs in $work_root"
echo "findings: $found (in fuzz/artifacts); targets that stopped on one: ${failed[*]:-none}"
[ "$found" = 0 ] && [ ${#failed[@]} = 0 ]
