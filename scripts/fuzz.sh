#!/usr/bin/env bash
# Fuzzes every parser that reads what sluice did not write, SECONDS each (default 60):
# GGUF, safetensors + config.json, manifest.bin, stored frames of every codec, chat
# templates on arbitrary messages (and arbitrary templates), the tokenizers, OpenAI bodies,
# gRPC GenerateRequest. cargo-fuzz (libFuzzer) on nightly; it is installed if missing.
#
# Each target starts from its committed seeds (fuzz/corpus/TARGET, written by
# fuzz/make_seeds.py) and grows a working corpus in fuzz/work/TARGET (not committed).
# A crash is saved under fuzz/artifacts/TARGET/; once fixed, copy the input to
# fuzz/regressions/TARGET/, where the stable test suite runs it on every build.
set -euo pipefail
cd "$(dirname "$0")/.."
secs="${1:-60}"
command -v cargo-fuzz >/dev/null || cargo +nightly install --locked cargo-fuzz
targets=(gguf safetensors manifest frame template tokenizer openai grpc)
cd fuzz
cargo +nightly fuzz build
failed=()
for t in "${targets[@]}"; do
  mkdir -p "work/$t" "artifacts/$t"
  # -rss_limit_mb: an input that makes a parser allocate past 2 GiB is a finding too.
  if ! cargo +nightly fuzz run "$t" "work/$t" "corpus/$t" -- \
    -max_total_time="$secs" -rss_limit_mb=2048 -timeout=10 -max_len=65536 \
    -artifact_prefix="artifacts/$t/" -print_final_stats=1 >"work/$t.log" 2>&1; then
    failed+=("$t")
  fi
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "work/$t.log")
  cov=$(grep -oE 'cov: [0-9]+' "work/$t.log" | tail -1)
  echo "$t: ${runs:-0} runs in $secs s, $cov, corpus $(ls "work/$t" | wc -l) inputs"
  grep -E "^==[0-9]+== ERROR|^SUMMARY|Test unit written" "work/$t.log" || true
done
found=$(find artifacts -type f | wc -l)
echo "findings: $found (in fuzz/artifacts); targets that stopped on one: ${failed[*]:-none}"
[ "$found" = 0 ] && [ ${#failed[@]} = 0 ]
