#!/usr/bin/env bash
# The soak of scripts/soak.py for MINUTES (default 2): 64 clients over gRPC and HTTP
# against the daemon under a streaming budget; prints its report and exits non-zero if a
# check failed.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -c 'import grpc, grpc_tools' 2>/dev/null ||
  python3 -m pip install --quiet --disable-pip-version-check grpcio grpcio-tools
cargo build --release --workspace
exec python3 scripts/soak.py --minutes "${1:-2}" "${@:2}"
