#!/bin/bash
# e2e-k8s.sh - what the Helm chart renders really runs: the rendered control-plane and gateway
# pods as containers of the project's image, against a micro Ceph, with the real Linux
# initiator (native NVMe multipath) in the QEMU guest. Runs on the HOST (root, dockerd up):
#
#   tests/vm/e2e-k8s.sh [IMAGE]     (default nvmeof-gateway:<workspace version>, built by
#                                    scripts/build-image.sh; the chart must render that image)
#
# How this stands for a cluster:
#   - the chart (helm/nvmeof-gateway, or $E2E_K8S_CHART) is rendered with the real Helm library
#     (tests/k8s/run-rendered.py render: helm-python-sdk, Helm v4's Go code; `helm install
#     --dry-run=client`) with a values file naming the micro Ceph (ceph.monHost), a dedicated
#     cephx user client.nvmeof (mon 'profile rbd', osd 'profile rbd pool=rbd', the docs' caps),
#     2 control-plane replicas and 2 gateways, everything else at its default;
#   - the docker network nvk8s-e2e (bridge nvk8s0, subnet $E2E_K8S_SUBNET, default
#     172.30.77.0/24) is the cluster network; the host, at its gateway address .1, is where
#     the Ceph cluster lives (the micro Ceph binds that address: MICRO_CEPH_IP);
#   - every pod is one container on a node of its own, with a fixed address: control-N at .1N,
#     gateway-N at .2N. The gateways are rendered with hostNetwork: true, so their address
#     is their node's: each gateway container has its own address and the rendered ports
#     unchanged (4420, 10008), status.hostIP = status.podIP = that address;
#   - a container is started with exactly the rendered command, args ($(VAR) expanded as the
#     kubelet does), env (fieldRefs filled in), ports, ConfigMap/Secret volumes (written to
#     files, bind-mounted read-only; the keyring Secret is `optional`), emptyDirs, security
#     context (user/group, no capabilities, read-only root, no-new-privileges) and memory
#     limit (tests/k8s/run-rendered.py lists what is and is not emulated);
#   - DNS: network aliases give every pod its <pod>.<headless service>.<ns>.svc[.cluster.local]
#     name and every Service selecting it; docker's resolver answers them;
#   - `kubectl create secret` = a file in the state directory; a StatefulSet recreating a pod =
#     the container removed and run again from the same rendered spec; a node lost = `docker
#     kill`; a pod deleted (rolling update) = `docker stop -t <terminationGracePeriodSeconds>`
#     (SIGTERM, then SIGKILL at the end of the grace period); readiness = the rendered
#     readinessProbe polled (GET /readyz on the metrics port);
#   - `kubectl exec` = `docker exec`: nvmeofctl in a control-plane container configures the
#     group (subsystem, host, a listener per gateway at its address:4420, two namespaces);
#   - the Linux host in the VM reaches the pod network through the QEMU user network (a route
#     to the subnet via 10.0.2.2: slirp connects from the host, which routes to the bridge).
# Steps (timed, PASS/FAIL):
#   missing-secret  every pod started before the keyring Secret exists: each gateway stays
#                   running and not ready (readinessProbe) with a log line naming the keyring
#   pods.start      the Secret created, the pods recreated: control plane ready, gateways ready
#                   (time from container start to ready printed)
#   configure, group.steady, then the guest (tests/vm/e2e-k8s-guest.sh): connect to both
#   gateways; under fio --verify=crc32c + a write probe: `docker kill` of gateway-0 (pause
#   printed), a rolling upgrade (each gateway stopped with its grace period and started again,
#   ready before the next; the pause of each planned move printed), the leading control-plane
#   replica killed and a failover after it; zero I/O and verify errors throughout.
# The guest asks the host to act through request files (tests/vm/requests.sh):
#   kill-gw N | start-gw N | roll-gw N | kill-cp-leader | start-cp N | check IMAGE ...
# Last line: "N passed, N failed". Whatever happens, the VM, the containers, the network and
# the cluster are removed.
#
# Env: E2E_LOG_DIR (default target/vm-logs; this test's files in $E2E_LOG_DIR/e2e-k8s),
#      E2E_TIMEOUT (VM timeout, default 900 s), E2E_K8S_SUBNET, E2E_K8S_CHART, E2E_K8S_VALUES (a
#      values file merged over the test's, as a second `helm install -f`), VM_* (run-in-vm.sh),
#      HELM_TEST_VENV (the Python venv of tests/helm/run.sh, default ~/.cache/nvmeof-helm-venv).
set -u
export LC_ALL=C
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export PATH="$PATH:/usr/local/sbin:/usr/sbin:/sbin"

VERSION=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version *= *"\(.*\)"/\1/p' "$ROOT/Cargo.toml")
IMAGE=${1:-nvmeof-gateway:$VERSION}
TIMEOUT=${E2E_TIMEOUT:-900}
SUBNET=${E2E_K8S_SUBNET:-172.30.77.0/24}
CHART=${E2E_K8S_CHART:-$ROOT/helm/nvmeof-gateway}
VENV=${HELM_TEST_VENV:-$HOME/.cache/nvmeof-helm-venv}
NET=nvk8s-e2e BRIDGE=nvk8s0
RELEASE=e2e NS=storage
FULL=$RELEASE-nvmeof-gateway
NQN=nqn.2016-06.io.ceph-nvmeof-rs:e2e-k8s
HOSTNQN=nqn.2014-08.org.nvmexpress:uuid:e2e24000-0000-4000-8000-000000000001
POOL=rbd
CLIENT=client.nvmeof
NGW=2 NCP=2
IMAGES=(e2e-k8s-1 e2e-k8s-2)
GW=() CP=() GWIP=() SERVERS=""
for i in $(seq 0 $((NGW - 1))); do GW+=("$FULL-gateway-$i"); done
for i in $(seq 0 $((NCP - 1))); do CP+=("$FULL-control-$i"); done
export NO_COLOR=1
exec 3>&1

# shellcheck disable=SC2034  # read by steps.sh
STEP_PREFIX=host:
. "$(dirname "${BASH_SOURCE[0]}")/steps.sh"
. "$(dirname "${BASH_SOURCE[0]}")/requests.sh"
shared_dir e2e-k8s

PY=$VENV/bin/python
ST=""  # run-rendered.py's state directory
rr() { "$PY" "$ROOT/tests/k8s/run-rendered.py" --state "$ST" "$@"; }

# ------------------------------------------------------------- cleanup --
WORK="" CEPHDIR="" VMPID="" NET_UP=0
cleanup() {
  stop_vm e2e-k8s
  if [ -n "$ST" ] && [ -f "$ST/state.json" ]; then
    rr down >/dev/null 2>&1 || echo "e2e-k8s: removing the containers failed"
    mkdir -p "$SH/pod-logs"; cp "$ST"/logs/* "$SH/pod-logs/" 2>/dev/null
  fi
  [ $NET_UP = 1 ] && { docker network rm "$NET" >/dev/null 2>&1 || echo "e2e-k8s: docker network rm $NET failed"; }
  NET_UP=0
  if [ -n "$CEPHDIR" ]; then
    "$ROOT/scripts/micro-ceph.sh" stop "$CEPHDIR" >/dev/null 2>&1 || echo "e2e-k8s: micro-ceph.sh stop $CEPHDIR failed"
  fi
  [ -n "$WORK" ] && rm -rf "$WORK"
  rm -f "$SH"/*.bin 2>/dev/null
  VMPID="" CEPHDIR="" WORK="" ST=""
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

fresh_shared_dir e2e-k8s
ST=$WORK/state
mkdir -p "$ST"

# ---------------------------------------------------------------- steps --
preflight() {
  docker info >/dev/null 2>&1 || { say "no docker daemon (scripts/build-image.sh starts one)"; return 1; }
  docker image inspect "$IMAGE" >/dev/null 2>&1 || { say "image $IMAGE missing: scripts/build-image.sh"; return 1; }
  say "image $IMAGE: $(( $(docker image inspect -f '{{.Size}}' "$IMAGE") / 1000000 )) MB, revision $(docker image inspect -f '{{index .Config.Labels "org.opencontainers.image.revision"}}' "$IMAGE")"
  # every library of every binary resolves inside the image (the Dockerfile checks it too)
  docker run --rm --entrypoint /bin/sh "$IMAGE" -c 'rc=0; for b in /usr/bin/nvmeof-gateway /usr/bin/nvmeof-control /usr/bin/nvmeofctl; do
      l=$(ldd "$b") || rc=1; n=$(echo "$l" | grep -c "not found"); [ "$n" = 0 ] || rc=1
      echo "$b: $(echo "$l" | wc -l) libraries, $n not found; $("$b" --version)"; echo "$l" | grep "not found"; done; exit $rc' |
    sed 's/^/    ldd in the image: /'
  [ "${PIPESTATUS[0]}" = 0 ] || { say "a library does not resolve in $IMAGE"; return 1; }
  say "runs as $(docker image inspect -f '{{.Config.User}}' "$IMAGE") by default"
  [ -f "$CHART/Chart.yaml" ] || { say "no chart at $CHART"; return 1; }
  if ! "$PY" -c 'import helm_python, yaml' 2>/dev/null; then
    say "making the venv $VENV (helm-python-sdk==0.2.2 PyYAML==6.0.2; tests/helm/run.sh uses it too)"
    { [ -x "$PY" ] || python3 -m venv "$VENV"; } && "$VENV/bin/pip" install --quiet --disable-pip-version-check \
      helm-python-sdk==0.2.2 PyYAML==6.0.2 || return 1
  fi
  # the pod -> container translation itself (tests/k8s/test_run_rendered.py)
  if "$PY" -c 'import pytest' 2>/dev/null; then
    "$PY" -m pytest -q -p no:cacheprovider "$ROOT/tests/k8s" 2>&1 | tail -n 3 | sed 's/^/    /'
    [ "${PIPESTATUS[0]}" = 0 ] || { say "tests/k8s failed"; return 1; }
    rm -rf "$ROOT/tests/k8s/__pycache__"
  else say "pytest not in $VENV: tests/k8s not run (tests/helm/run.sh installs it)"; fi
}

cluster() {
  rr network-up --subnet "$SUBNET" --network "$NET" --bridge "$BRIDGE" || return 1
  NET_UP=1
  CEPH_IP=$(docker network inspect -f '{{(index .IPAM.Config 0).Gateway}}' "$NET")
  export MICRO_CEPH_IP=$CEPH_IP
  start_cluster || return 1
  unset MICRO_CEPH_IP
  MON_HOST=$(sed -n 's/^mon_host = //p' "$CEPH_CONF")
  timeout 60 ceph auth get-or-create "$CLIENT" mon 'profile rbd' osd "profile rbd pool=$POOL" \
    -o "$WORK/client.keyring" || return 1
  local i
  for i in "${IMAGES[@]}"; do timeout -k 5 60 rbd create --size 256M "$POOL/$i" || return 1; done
  say "micro Ceph on $CEPH_IP (mon_host $MON_HOST); $CLIENT: $(ceph auth get "$CLIENT" 2>/dev/null | grep caps | tr -s ' \t' ' ' | tr '\n' ';'); images ${IMAGES[*]}"
}

render() {
  cat > "$WORK/values.yaml" <<EOF
# the admin's values for this test: the cluster's monitors, the group; the rest default
ceph:
  monHost: "$MON_HOST"
  clientName: $CLIENT
group:
  name: e2e-k8s-$$
  statePool: $POOL
controlPlane:
  replicas: $NCP
gateway:
  replicas: $NGW
image:
  repository: ${IMAGE%:*}
  tag: "${IMAGE##*:}"
EOF
  cp "$WORK/values.yaml" "$SH/values.yaml"
  local extra=()
  [ -n "${E2E_K8S_VALUES:-}" ] && { extra=(--values "$E2E_K8S_VALUES"); say "extra values from $E2E_K8S_VALUES: $(tr '\n' ' ' < "$E2E_K8S_VALUES")"; }
  rr render --chart "$CHART" --release "$RELEASE" --namespace "$NS" --values "$WORK/values.yaml" "${extra[@]}" \
    --subnet "$SUBNET" --network "$NET" || return 1
  cp "$ST/manifest.yaml" "$SH/manifest.yaml"
  local n; n=$(grep -c '^kind:' "$ST/manifest.yaml")
  say "rendered $n objects (manifest in $SH/manifest.yaml): $(grep '^kind:' "$ST/manifest.yaml" | sort | uniq -c | awk '{printf "%s %s, ", $1, $3}')"
  local pod i
  for pod in "${CP[@]}" "${GW[@]}"; do rr ip "$pod" >/dev/null || { say "the chart renders no pod $pod"; return 1; }; done
  SERVERS=""; for pod in "${CP[@]}"; do SERVERS+=${SERVERS:+,}$(rr ip "$pod"):5500; done
  GWIP=(); for i in $(seq 0 $((NGW - 1))); do GWIP+=("$(rr ip "${GW[$i]}")"); done
  # the grace period of the gateways, for the rolling upgrade
  GRACE=$("$PY" -c 'import json,sys; s=json.load(open(sys.argv[1]))
print(next(o for o in s["objects"] if o["kind"]=="StatefulSet" and o["metadata"]["name"]==sys.argv[2])["spec"]["template"]["spec"].get("terminationGracePeriodSeconds",30))' "$ST/state.json" "$FULL-gateway")
  say "gateway terminationGracePeriodSeconds: $GRACE"
}

SECRET_NAME=""
secret_create() { # what `kubectl create secret generic NAME --from-file=keyring=...` leaves
  SECRET_NAME=$("$PY" -c 'import json,sys; s=json.load(open(sys.argv[1]))
for o in s["objects"]:
    if o["kind"]=="StatefulSet":
        for v in o["spec"]["template"]["spec"].get("volumes",[]):
            for src in v.get("projected",{}).get("sources",[]) + ([{"secret":v["secret"]}] if "secret" in v else []):
                sec = src.get("secret")
                if sec and any(i.get("path") == "keyring" or i.get("key") == "keyring" for i in sec.get("items",[])): print(sec.get("name") or sec.get("secretName")); sys.exit()' "$ST/state.json")
  [ -n "$SECRET_NAME" ] || { say "no keyring Secret in the rendered volumes"; return 1; }
  mkdir -p "$ST/secrets/$SECRET_NAME" && cp "$WORK/client.keyring" "$ST/secrets/$SECRET_NAME/keyring"
}

start_pods() { # PODS...: start every one, then wait for each to be ready
  local p ok=0
  for p in "$@"; do rr start "$p" | sed 's/^/    /' || ok=1; done
  [ $ok = 0 ] || return 1
  for p in "$@"; do rr wait-ready "$p" --timeout 60 | sed 's/^/    /'; [ "${PIPESTATUS[0]}" = 0 ] || { rr logs "$p" 2>&1 | tail -n 8 | sed 's/^/    | /'; ok=1; }; done
  return $ok
}

missing_secret() {
  # the admin forgot the keyring Secret: the pods must run, stay not ready and say why
  local p ok=0 i line
  for p in "${CP[@]}" "${GW[@]}"; do rr start "$p" | sed 's/^/    /' || ok=1; done
  sleep 8
  for p in "${GW[@]}" "${CP[0]}"; do
    if ! running "$p"; then
      say "$p: container exited (status $(docker inspect -f '{{.State.ExitCode}}' "nvk8s-$p" 2>/dev/null); CrashLoopBackOff in a cluster): a missing optional Secret must leave it running, not ready"
      ok=1
    else
      for i in 1 2 3; do
        if rr ready "$p" > "$WORK/ready.out"; then say "$p is READY without its keyring: $(cat "$WORK/ready.out")"; ok=1; break; fi
        sleep 1
      done
      say "$(cat "$WORK/ready.out")"
      grep -q FALLBACK "$WORK/ready.out" && { say "$p: no /readyz in this image (health endpoints missing)"; ok=1; }
    fi
    line=$(rr logs "$p" 2>&1 | grep -i 'keyring' | tail -n 1)
    if [ -n "$line" ]; then say "$p log: $line"; else say "$p: no log line names the keyring: $(rr logs "$p" 2>&1 | tail -n 3 | tr '\n' ' ')"; ok=1; fi
  done
  for p in "${CP[@]}" "${GW[@]}"; do rr rm "$p"; done
  return $ok
}

pods_start() {
  secret_create || return 1
  say "Secret $SECRET_NAME created (key keyring: the $CLIENT keyring)"
  start_pods "${CP[@]}" || return 1
  start_pods "${GW[@]}"
}

ctl() { # nvmeofctl in a running control-plane container (kubectl exec), told every replica
  local p
  for p in "${CP[@]}"; do
    [ "$(docker inspect -f '{{.State.Running}}' "nvk8s-$p" 2>/dev/null)" = true ] || continue
    timeout -k 5 30 docker exec "nvk8s-$p" /usr/bin/nvmeofctl --server "$SERVERS" "$@"
    return
  done
  echo "no control-plane container runs" >&2; return 1
}
gw_ip() { echo "${GWIP[$1]}"; }

configure() {
  local i
  ctl subsystem add --nqn "$NQN" || return 1
  ctl host add -n "$NQN" --host "$HOSTNQN" || return 1
  for i in $(seq 0 $((NGW - 1))); do
    ctl listener add -n "$NQN" -g "${GW[$i]}" -a "$(gw_ip "$i")" -p 4420 || return 1
  done
  for _ in $(seq 100); do [ "$(ctl -o json gateway list 2>/dev/null | grep -c '"name"')" -ge $NGW ] && break; sleep 0.1; done
  for i in $(seq 0 $((NGW - 1))); do
    ctl namespace add -n "$NQN" --image "${IMAGES[$i]}" --nsid $((i + 1)) --ana-group $((i + 1)) || return 1
  done
  ctl gateway list | sed 's/^/    | /'
}

group_steady() {
  local t0; t0=$(now)
  for _ in $(seq 300); do
    ctl -o json ana show 2>/dev/null | python3 -c '
import json, sys
d = json.load(sys.stdin); gws = sys.argv[1:]
ok = len(d["groups"]) == len(gws) and all(g["holder"] == g["owner"] == gws[g["ana_group"] - 1] and g["phase"] == "active" for g in d["groups"])
opt = sorted((s["gateway"], s["ana_group"]) for s in d["states"] if s["state"] == 1)
sys.exit(0 if ok and opt == [(g, i + 1) for i, g in enumerate(gws)] else 1)' "${GW[@]}" &&
      { say "steady after $(since "$t0")s:"; ctl ana show | sed 's/^/    | /'; return 0; }
    sleep 0.1
  done
  say "not steady after 30 s:"; ctl ana show | sed 's/^/    | /'; return 1
}

# ------------------------------------------------- requests from the guest --
gw_ok() { [[ ${1:-} =~ ^[0-9]+$ ]] && [ "$1" -lt $NGW ]; }
cp_ok() { [[ ${1:-} =~ ^[0-9]+$ ]] && [ "$1" -lt $NCP ]; }
image_ok() { [[ " ${IMAGES[*]} " == *" $1 "* ]]; }
running() { [ "$(docker inspect -f '{{.State.Running}}' "nvk8s-$1" 2>/dev/null)" = true ]; }
act_kill_gw() {
  local p=${GW[$1]}
  running "$p" || { echo fail; echo "$p is not running"; return; }
  echo "    host: docker kill $p at $(date -u +%T.%N | cut -c1-12)" >&3
  if rr kill "$p" > "$WORK/kill.out" 2>&1; then echo ok; else echo fail; fi
  cat "$WORK/kill.out"
}
act_start_gw() { # the StatefulSet recreates the pod: same spec, ready before the answer
  local p=${GW[$1]} t0; t0=$(now)
  if rr start "$p" > "$WORK/start.out" 2>&1 && rr wait-ready "$p" --timeout 60 >> "$WORK/start.out" 2>&1; then
    echo ok; cat "$WORK/start.out"; echo "(recreated and ready after $(since "$t0")s)"
  else echo fail; cat "$WORK/start.out"; rr logs "$p" 2>&1 | tail -n 5; fi
}
act_roll_gw() { # one step of a rolling update: pod deleted (SIGTERM, grace period), recreated, ready
  local p=${GW[$1]} t0; t0=$(now)
  running "$p" || { echo fail; echo "$p is not running"; return; }
  echo "    host: rolling update: docker stop -t $GRACE $p at $(date -u +%T.%N | cut -c1-12)" >&3
  if ! rr stop "$p" > "$WORK/stop.out" 2>&1; then
    echo fail; cat "$WORK/stop.out"; rr logs "$p" 2>&1 | tail -n 5; return
  fi
  local ts; ts=$(since "$t0")
  local leave; leave=$(rr logs "$p" 2>&1 | grep -E 'groups moved away|no group to move away|planned|stopped' | tail -n 2 | sed 's/.*INFO //' | tr '\n' ';')
  act_start_gw "$1" > "$WORK/roll.out"
  head -n 1 "$WORK/roll.out"
  cat "$WORK/stop.out"; echo "(stopped after ${ts}s; its log: $leave)"
  tail -n +2 "$WORK/roll.out"
}
leader() {
  local p l
  for p in "${CP[@]}"; do
    running "$p" || continue
    l=$(timeout -k 5 10 docker exec "nvk8s-$p" /usr/bin/nvmeofctl --server 127.0.0.1:5500 -o json gateway list 2>/dev/null |
      sed -n 's/^ *"leader": "\(.*\)".*/\1/p')
    [ -n "$l" ] && { echo "$l"; return 0; }
  done
}
KILLED_CP=""
act_kill_cp_leader() {
  local l t0 l2
  l=$(leader)
  [[ " ${CP[*]} " == *" $l "* ]] || { echo fail; echo "no leader known ('$l')"; return; }
  t0=$(now)
  echo "    host: docker kill $l (the leading replica) at $(date -u +%T.%N | cut -c1-12)" >&3
  rr kill "$l" >/dev/null || { echo fail; return; }
  KILLED_CP=$l
  for _ in $(seq 300); do l2=$(leader); [ -n "$l2" ] && [ "$l2" != "$l" ] && break; sleep 0.1; done
  if [ -z "$l2" ] || [ "$l2" = "$l" ]; then echo fail; echo "no other replica leads 30 s after the kill (leader '$l2')"; return; fi
  echo ok; echo "$l killed; $l2 leads after $(since "$t0")s"
}
act_start_cp() {
  [ -n "$KILLED_CP" ] || { echo fail; echo "no replica was killed"; return; }
  if rr start "$KILLED_CP" > "$WORK/start.out" 2>&1 && rr wait-ready "$KILLED_CP" --timeout 60 >> "$WORK/start.out" 2>&1; then
    echo ok; cat "$WORK/start.out"; echo "leader now $(leader)"; KILLED_CP=""
  else echo fail; cat "$WORK/start.out"; fi
}
handle() {
  local line; read -r line || true
  # shellcheck disable=SC2086  # the request is a list of words
  set -- $line
  local a=${1:-}; [ $# -gt 0 ] && shift
  case $a in
    kill-gw) gw_ok "${1:-}" && act_kill_gw "$1" || { echo fail; echo "bad request '$line'"; } ;;
    start-gw) gw_ok "${1:-}" && act_start_gw "$1" || { echo fail; echo "bad request '$line'"; } ;;
    roll-gw) gw_ok "${1:-}" && act_roll_gw "$1" || { echo fail; echo "bad request '$line'"; } ;;
    kill-cp-leader) act_kill_cp_leader ;;
    start-cp) act_start_cp ;;
    check) check_image "$@" ;;
    *) echo fail; echo "unknown request '$line'" ;;
  esac
}
run_vm() {
  local ips="" i
  for i in $(seq 0 $((NGW - 1))); do ips+=${ips:+,}$(gw_ip "$i"); done
  say "tests/vm/run-in-vm.sh -t $TIMEOUT -w $SH tests/vm/e2e-k8s-guest.sh $SH $SUBNET $ips"
  run_guest -t "$TIMEOUT" -w "$SH" "$ROOT/tests/vm/e2e-k8s-guest.sh" "$SH" "$SUBNET" "$ips"
}
stop_gateways() { # the release uninstalled: each gateway pod deleted exits 0 within its grace
  local p ok=0
  for p in "${GW[@]}"; do
    running "$p" || { say "$p not running"; ok=1; continue; }
    rr stop "$p" | sed 's/^/    /'; [ "${PIPESTATUS[0]}" = 0 ] || ok=1
  done
  return $ok
}

# ------------------------------------------------------------------ main --
echo "e2e-k8s: image $IMAGE, chart $CHART, network $NET $SUBNET, shared dir $SH, $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)"
if step preflight "docker up, image $IMAGE present (ldd of each binary inside), chart, Helm venv, tests/k8s" preflight &&
   step cluster "docker network $NET ($SUBNET); micro Ceph on its gateway address; cephx user $CLIENT; images" cluster &&
   step render "helm install --dry-run=client (Helm library): release $RELEASE in namespace $NS" render &&
   { step missing-secret "pods started without the keyring Secret: running, not ready, a log line names the keyring" missing_secret
     true; } &&
   step pods.start "Secret created; control-plane pods ready, then gateway pods ready" pods_start &&
   step configure "nvmeofctl (docker exec): subsystem, host, a listener per gateway pod at its address:4420, namespaces" configure &&
   step group.steady "nvmeofctl ana show: group N+1 optimized on gateway-N only" group_steady; then
  step vm "the guest's steps (tests/vm/e2e-k8s-guest.sh)" run_vm
  step gateways.stop "every gateway pod deleted: SIGTERM, exit 0 within the grace period" stop_gateways
else
  skip vm "the pods did not start"
fi
cleanup; trap - EXIT

pauses() { grep -E '^PAUSE ' "$VMOUT" 2>/dev/null; return 0; }
host_summary "e2e-k8s summary" pauses
