#!/usr/bin/env bash
# The I/O engine's figures in one run: fio on the same file just before and just after
# (the disk drifts; the better of the two is the reference), then `sluiced bench-io` for
# every store given, with io_uring and with the pread fallback.
#
#   scripts/bench-io.sh STORE [STORE ...]
# Needs fio (apt-get install fio) and a release build.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: $0 STORE [STORE ...]" >&2; exit 2; }
command -v fio >/dev/null || { echo "bench-io: fio is missing (apt-get install fio)" >&2; exit 1; }
sluiced="$(scripts/target-dir.sh)/release/sluiced"
first_weights="$1/weights.bin"

fio_gbps() {
  fio --name=seqread --filename="$first_weights" --readonly --direct=1 --ioengine=io_uring --fixedbufs \
      --bs=4M --iodepth=64 --rw=read --output-format=json 2>/dev/null |
    python3 -c 'import json,sys; print("%.3f" % (json.load(sys.stdin)["jobs"][0]["read"]["bw_bytes"]/1e9))'
}

# Raw reads alternated with fio on the same file, three rounds: the disk drifts, so each
# engine read is compared with the better of the fio runs just before and after it.
raw_rounds() {
  local prev cur engine
  prev=$(fio_gbps)
  for round in 1 2 3; do
    for engine in uring pread; do
      raw=$($sluiced bench-io "$1" --engine "$engine" --passes 2 --raw-only | python3 -c 'import json,sys; print("%.3f" % json.load(sys.stdin)["raw_read_gbps"])')
      cur=$(fio_gbps)
      best=$(python3 -c "print(max($prev, $cur))")
      printf '  round %d  %-6s raw %s GB/s   fio before %s after %s   raw/fio %s\n' "$round" "$engine" "$raw" "$prev" "$cur" "$(python3 -c "print('%.3f' % ($raw / $best))")"
      prev=$cur
    done
  done
}
echo "raw read vs fio, interleaved ($first_weights):"
raw_rounds "$1"
echo

before=$(fio_gbps)
results=()
for store in "$@"; do
  for engine in uring pread; do
    results+=("$store $engine $($sluiced bench-io "$store" --engine "$engine" --json | python3 -c '
import json,sys; r=json.load(sys.stdin)
print("%.3f %.3f %.3f %.3f %.3f %.3f %.3f" % (r["raw_read_gbps"], r["read_gbps"], r["decompressed_gbps"], r["ratio"], r["core_decompress_gbps"], r["bound_gbps"], r["bound_ratio"]))')")
  done
done
after=$(fio_gbps)
best=$(python3 -c "print(max($before, $after))")
echo "fio (io_uring, O_DIRECT, 4 MiB x 64) on $first_weights: before $before GB/s, after $after GB/s, reference $best GB/s"
echo
printf '%-40s %-6s %9s %9s %9s %6s %9s %9s %9s %9s\n' store engine raw_read raw/fio read decomp ratio core1 bound dec/bound
for line in "${results[@]}"; do
  read -r store engine raw read dec ratio core bound br <<<"$line"
  printf '%-40s %-6s %9s %9s %9s %9s %6s %9s %9s %9s\n' "$(basename "$store")" "$engine" "$raw" "$(python3 -c "print('%.3f' % ($raw/$best))")" "$read" "$dec" "$ratio" "$core" "$bound" "$br"
done
echo
echo "raw_read: GB/s read by the engine with decoding off; raw/fio: that over the fio reference;"
echo "read/decomp: compressed GB/s read and decompressed GB/s produced with decoding on;"
echo "core1: one core decoding from memory; bound: min(raw_read / ratio, workers x core1)."
