#!/usr/bin/env bash
# The whole test suite: installs what it needs (scripts/test-deps.sh: as root it installs
# what is missing; otherwise it names it and stops before building), fetches the real test
# models (cached), then runs every test of the workspace in release mode (the same build
# `cargo build --release` makes, so it is reused). Every test binary runs even when an
# earlier one fails; the summary at the end names each one that failed.
#
#   SLUICE_SLURM_TEST=0   leave out the Slurm cluster test (it needs root and Slurm)
#   SLUICE_PRIVILEGED_TESTS=1|0   the tests that need a memory cgroup of their own
#                         (memlimit.rs) or a private mount namespace (faults.rs's full
#                         disk): 1 runs them (failing where they cannot run), 0 leaves them
#                         out; unset, each runs where this machine allows it
#   extra arguments go to `cargo test` (a test name filter, `-- --nocapture`, ...)
set -euo pipefail
cd "$(dirname "$0")/.."
export SLUICE_SLURM_TEST=${SLUICE_SLURM_TEST:-1}
# A fresh build gains nothing from incremental caches, and they take ~1.5 GB of target/
# (CI's disk is small); a developer's own `CARGO_INCREMENTAL=1` keeps them.
export CARGO_INCREMENTAL=${CARGO_INCREMENTAL:-0}
scripts/test-deps.sh
export SLUICE_SMOLLM2_GGUF="$(scripts/fetch-model.sh)"
export SLUICE_GEMMA3_GGUF="$(scripts/fetch-model.sh gemma3-270m)"
# NVRTC for the kernel compile test: the CUDA NVRTC wheel's library (test-deps.sh installs
# it); a CUDA toolkit on the library path works too.
nvrtc_lib=$(python3 -c 'import nvidia.cuda_nvrtc as m, os; print(os.path.join(list(m.__path__)[0], "lib"))' 2>/dev/null || true)
if [ -n "$nvrtc_lib" ] && [ -d "$nvrtc_lib" ]; then
  export LD_LIBRARY_PATH="$nvrtc_lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
# Style and lints first: formatting is checked, and every clippy warning is an error (an
# #[allow] carries a comment saying why). Clippy shares the release profile's dependencies.
cargo fmt --all -- --check
cargo clippy --release --workspace --all-targets -- -D warnings
# The end-to-end tests run the real binaries; `cargo test` builds only the test harnesses of
# other packages' binaries, so build them first.
cargo build --release --workspace

log=$(mktemp)
trap 'rm -f "$log"' EXIT
failed=()
# --no-fail-fast: a failing binary does not hide the ones after it. Cargo's own closing
# lines name the failed targets; they are collected for the summary below.
if ! cargo test --release --workspace --no-fail-fast "$@" 2>&1 | tee "$log"; then
  mapfile -t targets < <(sed -n 's/^    `\(.*\)`$/\1/p' "$log")
  [ ${#targets[@]} -gt 0 ] || targets=("cargo test (see its output above)")
  failed+=("${targets[@]}")
fi
# Tests that need what not every machine grants, each run where it can (see the top).
# A child memory cgroup of this process's own can be made (v1 memory controller, or v2).
can_cgroup() {
  local rel dir
  rel=$(awk -F: '$2 ~ /(^|,)memory(,|$)/ {print $3; exit}' /proc/self/cgroup)
  if [ -n "$rel" ] && [ -d "/sys/fs/cgroup/memory$rel" ]; then
    dir="/sys/fs/cgroup/memory$rel"
  elif [ -f /sys/fs/cgroup/cgroup.controllers ]; then
    dir="/sys/fs/cgroup$(awk -F: '$1 == "0" {print $3; exit}' /proc/self/cgroup)"
  else
    return 1
  fi
  mkdir "$dir/sluice-probe-$$" 2>/dev/null && rmdir "$dir/sluice-probe-$$"
}
# A private mount namespace with a tmpfs can be made.
can_unshare() {
  local m rc
  m=$(mktemp -d)
  unshare -rm sh -c "mount -t tmpfs none $m" >/dev/null 2>&1 && rc=0 || rc=1
  rmdir "$m"
  return $rc
}
privileged() { # name, probe, cargo test arguments...
  local name=$1 probe=$2
  shift 2
  case "${SLUICE_PRIVILEGED_TESTS:-}" in
    0) echo "test: $name was left out (SLUICE_PRIVILEGED_TESTS=0)" >&2; return ;;
    1) ;;
    *) if ! $probe; then
         echo "test: $name was left out: this machine does not allow it (SLUICE_PRIVILEGED_TESTS=1 runs it anyway)" >&2
         return
       fi ;;
  esac
  # --workspace: the features the main run resolved, so nothing is built a second time.
  cargo test --release --workspace "$@" -- --ignored || failed+=("--workspace $* -- --ignored ($name)")
}
privileged "the memory cgroup test" can_cgroup --test memlimit
privileged "the full-disk test" can_unshare --test faults

# The Slurm test starts a one-machine cluster as root (scripts/slurm-local.sh).
if [ "$SLUICE_SLURM_TEST" = 1 ]; then
  cargo test --release --workspace --test slurm -- --ignored --nocapture ||
    failed+=("--workspace --test slurm (the Slurm cluster test)")
else
  echo "test: the Slurm cluster test was left out (SLUICE_SLURM_TEST=$SLUICE_SLURM_TEST)" >&2
fi

if [ ${#failed[@]} -gt 0 ]; then
  echo >&2
  echo "test: ${#failed[@]} test binaries failed:" >&2
  for f in "${failed[@]}"; do echo "  cargo test --release $f" >&2; done
  exit 1
fi
echo "test: every test binary passed" >&2
