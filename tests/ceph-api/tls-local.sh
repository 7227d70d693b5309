#!/usr/bin/env bash
# tests/ceph-api/tls-local.sh - ceph-nvmeof's API TLS fields from the Python client
# (csi_client.py tls), on this machine: a control plane with its state in memory (no Ceph,
# no gateway, no VM), a PSK made here as `nvme gen-tls-key` makes one. Exits 0 when every
# check of `csi_client.py tls` passes.
#
#   tests/ceph-api/tls-local.sh [BIN_DIR]     (default target/debug: nvmeof-control there)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BIN=${1:-$ROOT/target/debug}
[ -x "$BIN/nvmeof-control" ] || { echo "tls-local.sh: no $BIN/nvmeof-control (cargo build -p control-plane --bins)" >&2; exit 1; }
VENV=$("$ROOT/tests/ceph-api/make-client.sh")
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
LOG=$(mktemp)
"$BIN/nvmeof-control" --store memory --listen "127.0.0.1:$PORT" --id tls-local >"$LOG" 2>&1 &
CP=$!
trap 'kill "$CP" 2>/dev/null; wait "$CP" 2>/dev/null; rm -f "$LOG"' EXIT
# A configured PSK: 32 random bytes and their CRC-32 (little endian), hash indicator 01.
PSK=$(python3 -c '
import base64, os, zlib
k = os.urandom(32)
print("NVMeTLSkey-1:01:" + base64.b64encode(k + zlib.crc32(k).to_bytes(4, "little")).decode() + ":")')
PYTHONPATH=$VENV/gen "$VENV/bin/python" "$ROOT/tests/ceph-api/csi_client.py" \
  --server "127.0.0.1:$PORT" tls --nqn nqn.2016-06.io.test:tls-local \
  --listener gw1,127.0.0.1,4420 --host nqn.2014-08.org.nvmexpress:tls-local --psk "$PSK"
if grep -qF "${PSK:16:40}" "$LOG"; then
  echo "tls-local.sh: the control plane's log shows the PSK" >&2
  exit 1
fi
echo "tls-local.sh: passed"
