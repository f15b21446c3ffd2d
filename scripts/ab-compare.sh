#!/usr/bin/env bash
# Two sluiced binaries side by side (a refactor's before and after): the same stores and
# prompts through `sluiced run --json` (greedy and seeded sampling, every unit resident and
# at the least budget that runs, on SmolLM2 and the fixture models of every architecture,
# mixtures included) must give the same token ids; then `bench-stream` on SmolLM2, alternating the binaries, ROUNDS rounds each.
#
#   scripts/ab-compare.sh OLD_SLUICED NEW_SLUICED [ROUNDS]
#
# Build the old one from a worktree, e.g.:
#   git worktree add /tmp/old REV && (cd /tmp/old && cargo build --release -p sluice-daemon)
set -uo pipefail
cd "$(dirname "$0")/.."
OLD=${1:?old sluiced binary}; NEW=${2:?new sluiced binary}; ROUNDS=${3:-3}
W=$(mktemp -d); trap 'rm -rf "$W"' EXIT
smollm2=$(scripts/fetch-model.sh)
declare -A SRC=([smollm2]=$smollm2 [tiny-llama]=tests/fixtures/tiny-llama
  [tiny-llama-gguf]=tests/fixtures/tiny-llama.gguf [tiny-llama-q]=tests/fixtures/tiny-llama-q.gguf
  [tiny-qwen2]=tests/fixtures/tiny-qwen2 [tiny-qwen2-gguf]=tests/fixtures/tiny-qwen2.gguf
  [tiny-qwen3]=tests/fixtures/tiny-qwen3 [tiny-gemma3]=tests/fixtures/tiny-gemma3
  [tiny-qwen3moe]=tests/fixtures/tiny-qwen3moe [tiny-mixtral]=tests/fixtures/tiny-mixtral
  [tiny-gptoss]=tests/fixtures/tiny-gptoss)
ids_of() { python3 -c 'import json,sys; print(json.load(sys.stdin)["generated_token_ids"])' 2>/dev/null; }
same=0; differ=0
for m in "${!SRC[@]}"; do
  "$NEW" pack "${SRC[$m]}" -o "$W/$m" --codec zstd:1 --frame-size 64KiB --force >/dev/null 2>&1 || { echo "pack $m failed"; differ=$((differ+1)); continue; }
  # The least budget that runs (most units stream), as the planner's error states it for
  # the longest run below (its workspace grows with the prompt).
  least=$("$NEW" run "$W/$m" --prompt-ids 10,200,30,40,5,60,7 --max-tokens 24 --max-context 128 --device-memory 4096 --backend cpu 2>&1 | sed -n 's/.*(\([0-9]*\) bytes) at least.*/\1/p')
  for budget in all-resident "$least"; do
    extra=(); [ "$budget" != all-resident ] && extra=(--device-memory "$budget")
    for samp in "--temperature 0" "--temperature 0.8 --top-p 0.95 --seed 7"; do
      for ids in 1,2,3,4,5 10,200,30,40,5,60,7; do
        # shellcheck disable=SC2086
        a=$("$OLD" run "$W/$m" --prompt-ids $ids --max-tokens 24 --ignore-eos $samp --max-context 128 "${extra[@]}" --backend cpu --json 2>/dev/null | ids_of)
        # shellcheck disable=SC2086
        b=$("$NEW" run "$W/$m" --prompt-ids $ids --max-tokens 24 --ignore-eos $samp --max-context 128 "${extra[@]}" --backend cpu --json 2>/dev/null | ids_of)
        if [ -n "$a" ] && [ "$a" = "$b" ]; then same=$((same+1)); else differ=$((differ+1)); echo "DIFFERENT $m budget=$budget '$samp' ids=$ids: old=$a new=$b"; fi
      done
    done
  done
done
echo "outputs: $same identical, $differ different"
S="$W/smollm2-zstd3"
"$NEW" pack "$smollm2" -o "$S" --codec zstd:3 >/dev/null
FLAGS=(--weights-budget 50% --batch 1,8 --steps 8 --prompt-tokens 4 --backend cpu --json)
for round in $(seq 1 "$ROUNDS"); do
  for which in old new; do
    bin=$OLD; [ $which = new ] && bin=$NEW
    "$bin" bench-stream "$S" "${FLAGS[@]}" 2>/dev/null | python3 -c "
import json,sys
r=json.load(sys.stdin); b={x['batch']:x for x in r['batches']}
print(f\"$which round $round: streamed pass {r['streamed_pass_s']*1e3:.2f} ms, compute-only {r['compute_only_pass_s']*1e3:.2f} ms, streaming-only {r['streaming_only_pass_s']*1e3:.2f} ms, batch 8 pass {b[8]['pass_s']*1e3:.2f} ms, batch 1 {b[1]['tokens_per_s']:.1f} tok/s, batch 8 {b[8]['tokens_per_s']:.1f} tok/s\")"
  done
done
[ "$differ" -eq 0 ]
