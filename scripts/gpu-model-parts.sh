#!/usr/bin/env bash
# Cuts SmolLM2's GGUF (98 MB, from scripts/fetch-model.sh) into two parts in .gpu-model/
# (ignored by git) for a GPU machine that reaches no package index and takes at most
# 64 MiB a call (the working tree, about 13 MB, included), and prints the calls that
# carry them there one at a time and put the file where scripts/fetch-model.sh looks
# (its checksum is checked there). Make the calls back to back: each lands on the same
# machine only while it is still warm from the last.
set -euo pipefail
cd "$(dirname "$0")/.."
gguf=$(scripts/fetch-model.sh smollm2)
name=$(basename "$gguf")
sha=$(sha256sum "$gguf" | cut -d' ' -f1)
rm -rf .gpu-model
mkdir -p .gpu-model
size=$(stat -c %s "$gguf")
split -b $(( (size + 1) / 2 )) -d -a 1 "$gguf" .gpu-model/part
ls -l .gpu-model
dst="\$HOME/.cache/sluice/models/$name"
cat <<MSG
On the GPU machine, in order (device run; each names one carry):
  1. carry [".gpu-model/part0"]: mkdir -p \$HOME/.cache/sluice/models && cp .gpu-model/part0 $dst.partial
  2. carry [".gpu-model/part1"]: cat .gpu-model/part1 >> $dst.partial && echo "$sha  $dst.partial" | sha256sum -c && mv $dst.partial $dst
  3. carry [".gpu-bundle"]: PIP_NO_INDEX=1 SLUICE_PREBUILT=1 scripts/gpu-check.sh
MSG
