#!/usr/bin/env bash
# Batch summarization of 64 short documents with SmolLM2 under a device budget of KV cache +
# workspace + half the weights: documents/minute at --concurrency 1 and at the daemon's max
# batch, and weight bytes streamed per generated token in each case (daemon-wide counters).
#
#   scripts/bench_batch.sh [MAX_BATCH=8] [MAX_TOKENS=48]
set -euo pipefail
cd "$(dirname "$0")/.."
max_batch=${1:-8}
max_tokens=${2:-48}
tmp=$(mktemp -d)
trap 'kill $daemon 2>/dev/null || true; rm -rf "$tmp"' EXIT
gguf=$(scripts/fetch-model.sh)
./target/release/sluiced pack "$gguf" -o "$tmp/smollm2" --codec lz4 >/dev/null
# Budget: what the plan reserves besides weights, plus half the weights.
budget=$(./target/release/sluiced run "$tmp/smollm2" --prompt-ids 1 --max-tokens 1 --max-context 512 --json |
  python3 -c 'import json,sys; p=json.load(sys.stdin)["plan"]; w=sum(u["raw_bytes"] for u in p["units"]); kv=p["kv_cache_bytes"]; print(kv, p["workspace_bytes"], w)')
read -r kv1 ws w <<<"$budget"
device=$(( kv1 * max_batch + ws + w / 2 + 16 * 1048576 ))
python3 - "$tmp/in.jsonl" <<'PY'
import json, sys
topics = ["the printing press", "photosynthesis", "the water cycle", "volcanoes", "jazz music", "the Roman empire",
          "electric cars", "honey bees", "the internet", "glaciers", "the human heart", "coffee"]
with open(sys.argv[1], "w") as f:
    for i in range(64):
        t = topics[i % len(topics)]
        text = (f"This is document {i} about {t}. Scholars have written much about {t}, its history and its effects. "
                f"Some argue that {t} changed daily life more than any other subject of its kind, while others point to "
                f"the slow, uneven spread of {t} and the people who resisted it.")
        f.write(json.dumps({"id": f"doc-{i}", "text": text}) + "\n")
PY
port=50099
./target/release/sluiced serve --model "$tmp/smollm2" --listen 127.0.0.1:$port --http-listen off --config /dev/null --max-batch "$max_batch" \
  --max-context 512 --device-memory "$device" 2>"$tmp/serve.log" &
daemon=$!
export SLUICE_ADDR=http://127.0.0.1:$port
for _ in $(seq 100); do ./target/release/sluice models >/dev/null 2>&1 && break; sleep 0.2; done
status() { ./target/release/sluice status --json; }
echo "device budget $(( device / 1048576 )) MiB for max batch $max_batch"
status | python3 -c 'import json,sys; s=json.load(sys.stdin); print("layers resident %d, streamed %d, %.1f MiB per pass" % (s["layers_resident"], s["layers_streamed"], s["bytes_streamed_per_pass"] / 2**20))'
for conc in 1 "$max_batch"; do
  before=$(status)
  t0=$(date +%s.%N)
  ./target/release/sluice batch "$tmp/in.jsonl" -o "$tmp/out-$conc.jsonl" --concurrency "$conc" --max-tokens "$max_tokens" 2>/dev/null
  t1=$(date +%s.%N)
  after=$(status)
  python3 - "$tmp/out-$conc.jsonl" "$conc" "$t0" "$t1" "$before" "$after" <<'PY'
import json, sys
out, conc, t0, t1, before, after = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4]), json.loads(sys.argv[5]), json.loads(sys.argv[6])
rows = [json.loads(l) for l in open(out)]
tokens = sum(r["generated_tokens"] for r in rows)
streamed = after["bytes_streamed_total"] - before["bytes_streamed_total"]
passes = after["passes"] - before["passes"]
mins = (t1 - t0) / 60
print(f"concurrency {conc:>2}: {len(rows)} docs in {t1 - t0:.1f} s = {len(rows) / mins:.1f} docs/min; {tokens} tokens, "
      f"{passes} passes, {streamed / 2**20:.0f} MiB streamed = {streamed / max(tokens, 1) / 2**20:.2f} MiB per generated token")
PY
done
