#!/usr/bin/env bash
# Batch summarization of short documents with SmolLM2 under a device budget of KV cache +
# workspace + half the weights: documents/minute, generated tokens/s and weight bytes
# streamed per generated token at --concurrency 1, 8 and the daemon's max batch, from
# `sluice batch --json`'s own summary (bytes from the daemon's counters before and after).
#
#   scripts/bench_batch.sh [MAX_BATCH=32] [MAX_TOKENS=32] [DOCS=512]
set -euo pipefail
cd "$(dirname "$0")/.."
max_batch=${1:-32}
max_tokens=${2:-32}
docs=${3:-512}
tmp=$(mktemp -d)
trap 'kill $daemon 2>/dev/null || true; rm -rf "$tmp"' EXIT
gguf=$(scripts/fetch-model.sh)
bin="$(scripts/target-dir.sh)/release"
"$bin"/sluiced pack "$gguf" -o "$tmp/smollm2" --codec lz4 >/dev/null
# Budget: what the plan reserves besides weights, plus half the weights.
budget=$("$bin"/sluiced run "$tmp/smollm2" --prompt-ids 1 --max-tokens 1 --max-context 512 --json |
  python3 -c 'import json,sys; p=json.load(sys.stdin)["plan"]; w=sum(u["raw_bytes"] for u in p["units"]); kv=p["kv_cache_bytes"]; print(kv, p["workspace_bytes"], w)')
read -r kv1 ws w <<<"$budget"
device=$(( kv1 * max_batch + ws + w / 2 + 16 * 1048576 ))
python3 - "$tmp/in.jsonl" "$docs" <<'PY'
import json, sys
topics = ["the printing press", "photosynthesis", "the water cycle", "volcanoes", "jazz music", "the Roman empire",
          "electric cars", "honey bees", "the internet", "glaciers", "the human heart", "coffee"]
with open(sys.argv[1], "w") as f:
    for i in range(int(sys.argv[2])):
        t = topics[i % len(topics)]
        text = (f"This is document {i} about {t}. Scholars have written much about {t}, its history and its effects. "
                f"Some argue that {t} changed daily life more than any other subject of its kind, while others point to "
                f"the slow, uneven spread of {t} and the people who resisted it.")
        f.write(json.dumps({"id": f"doc-{i}", "text": text}) + "\n")
PY
port=50099
"$bin"/sluiced serve --model "$tmp/smollm2" --listen 127.0.0.1:$port --http-listen off --config /dev/null --max-batch "$max_batch" \
  --max-context 512 --device-memory "$device" 2>"$tmp/serve.log" &
daemon=$!
export SLUICE_ADDR=http://127.0.0.1:$port
for _ in $(seq 100); do "$bin"/sluice models >/dev/null 2>&1 && break; sleep 0.2; done
status() { "$bin"/sluice status --json; }
echo "device budget $(( device / 1048576 )) MiB for max batch $max_batch"
status | python3 -c 'import json,sys; s=json.load(sys.stdin); print("layers resident %d, streamed %d, %.1f MiB per pass" % (s["layers_resident"], s["layers_streamed"], s["bytes_streamed_per_pass"] / 2**20))'
echo "$docs documents, max_tokens $max_tokens"
for conc in 1 8 "$max_batch"; do
  "$bin"/sluice batch "$tmp/in.jsonl" -o "$tmp/out-$conc.jsonl" --concurrency "$conc" \
    --max-tokens "$max_tokens" --json 2>/dev/null |
    python3 -c 'import json,sys; s=json.load(sys.stdin); print("concurrency %3d: %d docs in %.1f s = %.1f docs/min, %.1f generated tokens/s, %.2f MiB streamed per generated token" % (s["concurrency"], s["written"], s["wall_s"], s["documents_per_minute"], s["generated_tokens_per_s"], s["bytes_streamed_per_generated_token"] / 2**20))'
done
