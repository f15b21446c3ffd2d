#!/usr/bin/env bash
# Makes the golden stores tests/tests/golden.rs reads: each packed from a committed fixture
# by the sluiced of an earlier commit, the last one that wrote its store format version
# (1: codecs none/lz4/zstd; 5: the float codec; 6: a zstd-compressed manifest; 7: f16
# frames in the float codec's F16Bits layout; 9: shared codes and the F32Top layout).
# Each commit's sluiced is built in a git worktree (one shared target directory), then
#
#   SLUICE_GOLDEN_BLESS=1 cargo test --release -p sluice-tests --test golden
#
# records what each new store decodes to (its frames are checked against the checksums
# the old writer stored as they decode). A golden store that exists is left alone: delete
# its directory to remake it.
#
#   scripts/make-golden-stores.sh
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
work=${GOLDEN_WORK:-${TMPDIR:-/tmp}/sluice-golden}
mkdir -p "$work" tests/fixtures/golden
# name, commit, source fixture, pack arguments
stores=(
  "v1-none 0a5e35827f0942d440dae2f7f2a82d1cd1b7c21b tiny-llama --codec none"
  "v1-lz4 0a5e35827f0942d440dae2f7f2a82d1cd1b7c21b tiny-llama --codec lz4"
  "v1-zstd-q 0a5e35827f0942d440dae2f7f2a82d1cd1b7c21b tiny-llama-q.gguf --codec zstd:3"
  "v5-float 22e244d43b59cf19867bbd13173d421e96135f61 tiny-llama --codec float"
  "v6-zstd-q 1cbacf5838ed1eec9ff468f90a03012e32678688 tiny-llama-q.gguf --codec zstd:3"
  "v7-float-f16 2d92d4d9aeeb5c40c6c22bc7cf6afe021eaa1943 tiny-llama.gguf --codec float"
  "v9-float c2af547c1b45c98a77c1d04479fe365025e454f6 tiny-llama --codec float"
)
built() { echo "$work/sluiced-${1:0:12}"; }
for s in "${stores[@]}"; do
  read -r name commit src args <<<"$s"
  out=tests/fixtures/golden/$name
  [ -d "$out" ] && { echo "$name: exists, left alone"; continue; }
  bin=$(built "$commit")
  if [ ! -x "$bin" ]; then
    tree=$work/tree-${commit:0:12}
    [ -d "$tree" ] || git worktree add --detach "$tree" "$commit" >/dev/null
    (cd "$tree" && CARGO_TARGET_DIR=$work/target cargo build --release -p sluice-daemon --bin sluiced)
    cp "$work/target/release/sluiced" "$bin"
    git worktree remove --force "$tree"
  fi
  # shellcheck disable=SC2086
  "$bin" pack "tests/fixtures/$src" -o "$out" --frame-size 16KiB $args --force >/dev/null
  printf 'sluiced of commit %s\nsluiced pack tests/fixtures/%s -o %s --frame-size 16KiB %s\n' \
    "$commit" "$src" "$out" "$args" > "$out/made-by.txt"
  echo "$name: $(du -sh "$out" | cut -f1)"
done
cd "$root"
