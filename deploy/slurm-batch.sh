#!/usr/bin/env bash
# Batch summarization across a Slurm array: each task runs its own sluiced on its node and
# takes one shard of the ids (`--shard K/N`). Outputs are per shard and resumable: requeue
# a failed task and it skips the ids it already wrote.
#
#   sbatch --array=1-8 deploy/slurm-batch.sh docs.jsonl /shared/out
#
#SBATCH --job-name=sluice-batch
#SBATCH --gres=gpu:1   # for the CUDA backend (not built yet: sluiced runs on the CPU today)
#SBATCH --cpus-per-task=8
#SBATCH --mem=64G
#SBATCH --time=08:00:00
#SBATCH --requeue
set -euo pipefail
input=${1:?input JSONL}
outdir=${2:?output directory}
model=${SLUICE_MODEL:-/var/lib/sluice/models/smollm2}
k=${SLURM_ARRAY_TASK_ID:?run as a Slurm array}
n=${SLURM_ARRAY_TASK_COUNT:?run as a Slurm array}
sock="/tmp/sluiced-$SLURM_JOB_ID-$k.sock"
mkdir -p "$outdir"

sluiced serve --model "$model" --config /dev/null --listen 127.0.0.1:0 --http-listen off --unix "$sock" \
  --max-batch 16 --max-context 4096 &
daemon=$!
trap 'kill $daemon 2>/dev/null || true; wait $daemon 2>/dev/null || true' EXIT
for _ in $(seq 600); do sluice --addr "unix:$sock" models >/dev/null 2>&1 && break; sleep 1; done

sluice --addr "unix:$sock" batch "$input" -o "$outdir/shard-$k-of-$n.jsonl" \
  --shard "$k/$n" --concurrency 16 --max-tokens 256 --template "Summarize the following text.\n\n{text}"
