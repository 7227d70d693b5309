#!/usr/bin/env bash
# tests/ceph-api/cli-calls-local.sh - the calls of ceph-nvmeof's CLI and dashboard from the
# project's generated Python client (cli_calls.py), on this machine: a control plane with
# its state in memory (no Ceph, no VM) and two pretend gateways beaconing to it (gw1 owning
# load-balancing group 1, gw2 group 2). Exits 0 when every check of cli_calls.py passes.
#
#   tests/ceph-api/cli-calls-local.sh [BIN_DIR]   (default target/debug: nvmeof-control there)
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
BIN=${1:-$ROOT/target/debug}
[ -x "$BIN/nvmeof-control" ] || { echo "cli-calls-local.sh: no $BIN/nvmeof-control (cargo build -p control-plane --bins)" >&2; exit 1; }
VENV=$("$ROOT/tests/ceph-api/make-client.sh")
PORT=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
WORK=$(mktemp -d)
"$BIN/nvmeof-control" --store memory --listen "127.0.0.1:$PORT" --id cli-calls >"$WORK/control.log" 2>&1 &
CP=$!
# The gateways' side of the control API, generated into WORK, beaconing every 0.5 s.
"$VENV/bin/python" -m grpc_tools.protoc -I "$ROOT/control-plane/proto" --python_out="$WORK" \
  --grpc_python_out="$WORK" nvmeof_control.proto
PYTHONPATH=$WORK "$VENV/bin/python" - "127.0.0.1:$PORT" <<'PY' &
import sys, time, grpc
import nvmeof_control_pb2 as pb, nvmeof_control_pb2_grpc as g
stub = g.GatewayControlStub(grpc.insecure_channel(sys.argv[1]))
while True:
    for name, group in (("gw1", 1), ("gw2", 2)):
        try:
            stub.SendBeacon(pb.Beacon(gateway=name, ana_group=group, incarnation=1,
                                      client_addrs=[f"127.0.0.1:0/{group}"]), timeout=2)
        except grpc.RpcError:
            pass
    time.sleep(0.5)
PY
BEACONS=$!
trap 'kill "$CP" "$BEACONS" 2>/dev/null; wait "$CP" "$BEACONS" 2>/dev/null; rm -rf "$WORK"' EXIT
# Both gateways known and the ANA groups held before the checks start.
for _ in $(seq 50); do
  grep -q "gw2" "$WORK/control.log" 2>/dev/null && break
  sleep 0.2
done
sleep 1
PYTHONPATH=$VENV/gen "$VENV/bin/python" "$ROOT/tests/ceph-api/cli_calls.py" \
  --server "127.0.0.1:$PORT" --nqn nqn.2016-06.io.test:cli-calls --listener-gateway gw1 \
  --lb-groups 1,2
echo "cli-calls-local.sh: passed"
