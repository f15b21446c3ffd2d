#!/usr/bin/env bash
# Batch summarization across a Slurm array: each task runs its own sluiced on its node and
# takes one shard of the ids (`--shard K/N`). Outputs are per shard and resumable: a task
# that is cancelled, fails or is requeued (`scontrol requeue JOB_K`) skips the ids it
# already wrote when it runs again, and writes only items that finished, so the merged
# shards hold every id exactly once.
#
#   sbatch --array=1-8 deploy/slurm-batch.sh docs.jsonl /shared/out
#   cat /shared/out/shard-*-of-8.jsonl > summaries.jsonl
#
# Environment (sbatch passes the submitting shell's): SLUICE_STORE (the store directory,
# or a store's name in the models directory), and SLUICE_MAX_TOKENS (256),
# SLUICE_MAX_BATCH (16), SLUICE_MAX_CONTEXT (4096), SLUICE_TEMPLATE. On a cluster without GPUs or with smaller nodes, override the
# directives below on the command line (e.g. `sbatch --gres=none --cpus-per-task=2 --mem=4G`).
#
#SBATCH --job-name=sluice-batch
#SBATCH --gres=gpu:1   # for the CUDA backend; without one sluiced runs on the CPU
#SBATCH --cpus-per-task=8
#SBATCH --mem=64G
#SBATCH --time=08:00:00
#SBATCH --requeue
set -euo pipefail
input=${1:?input JSONL}
outdir=${2:?output directory}
model=${SLUICE_STORE:-/var/lib/sluice/models/smollm2}
k=${SLURM_ARRAY_TASK_ID:?run as a Slurm array}
n=${SLURM_ARRAY_TASK_COUNT:?run as a Slurm array}
max_tokens=${SLUICE_MAX_TOKENS:-256}
max_batch=${SLUICE_MAX_BATCH:-16}
max_context=${SLUICE_MAX_CONTEXT:-4096}
template=${SLUICE_TEMPLATE:-"Summarize the following text.\n\n{text}"}
# Array tasks on one node must not share a socket: the job id is the task's own.
sock="${TMPDIR:-/tmp}/sluiced-$SLURM_JOB_ID.sock"
mkdir -p "$outdir"

sluiced serve --model "$model" --config /dev/null --listen 127.0.0.1:0 --http-listen off --unix "$sock" \
  --max-batch "$max_batch" --max-context "$max_context" &
daemon=$!
trap 'kill $daemon 2>/dev/null || true; wait $daemon 2>/dev/null || true' EXIT
for _ in $(seq 600); do
  sluice --addr "unix:$sock" models >/dev/null 2>&1 && break
  kill -0 $daemon 2>/dev/null || { echo "sluiced serve exited before it was ready" >&2; exit 1; }
  sleep 1
done

# Concurrency defaults to the daemon's max batch, so every pass serves a full batch.
sluice --addr "unix:$sock" batch "$input" -o "$outdir/shard-$k-of-$n.jsonl" \
  --shard "$k/$n" --max-tokens "$max_tokens" --template "$template"
