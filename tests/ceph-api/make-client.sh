#!/usr/bin/env bash
# tests/ceph-api/make-client.sh - the Python client of ceph-nvmeof's management API that
# tests/vm/tenants/csi.sh runs in the QEMU guest: makes (once) a venv with grpcio and
# grpcio-tools, and generates the client from the project's own
# control-plane/proto/ceph_nvmeof_gateway.proto into it (again whenever that file changes).
# Prints the venv's directory. Needs python3 with venv, and PyPI the first time only.
#
# Env: CEPH_API_VENV (default ~/.cache/nvmeof-ceph-api-venv: the guest sees the host's root
#      file system read-only, so a venv made here runs there as it is), PYTHON (default python3).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
VENV=${CEPH_API_VENV:-$HOME/.cache/nvmeof-ceph-api-venv}
PYTHON=${PYTHON:-python3}
PROTO=$ROOT/control-plane/proto/ceph_nvmeof_gateway.proto
REQS=(grpcio==1.85.1 grpcio-tools==1.85.1)
STAMP=$VENV/.nvmeof-ceph-api-reqs

if [ ! -x "$VENV/bin/python" ] || [ "$(cat "$STAMP" 2>/dev/null)" != "${REQS[*]}" ]; then
  echo "+ $PYTHON -m venv $VENV && pip install ${REQS[*]}" >&2
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install --quiet --disable-pip-version-check "${REQS[@]}" >&2
  echo "${REQS[*]}" > "$STAMP"
fi
GEN=$VENV/gen
SUM=$(sha256sum "$PROTO" | cut -d' ' -f1)
if [ "$(cat "$GEN/.proto-sha256" 2>/dev/null)" != "$SUM" ]; then
  rm -rf "$GEN" && mkdir -p "$GEN"
  "$VENV/bin/python" -m grpc_tools.protoc -I "$(dirname "$PROTO")" --python_out="$GEN" \
    --grpc_python_out="$GEN" "$(basename "$PROTO")" >&2
  echo "$SUM" > "$GEN/.proto-sha256"
fi
PYTHONPATH=$GEN "$VENV/bin/python" -c 'import grpc, ceph_nvmeof_gateway_pb2_grpc' \
  || { echo "the venv $VENV is broken: remove it and rerun" >&2; exit 1; }
echo "$VENV"
