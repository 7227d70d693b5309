#!/usr/bin/env python3
"""run-rendered.py - run what the Helm chart renders, pod by pod, as docker containers.

Used by tests/vm/e2e-k8s.sh; each subcommand works on a state directory (--state DIR):

  render --chart DIR --release NAME --namespace NS --values FILE [--values FILE...]
         --subnet CIDR --network NAME
        Renders the chart with the real Helm library (helm_python, Helm v4's Go code, as
        `helm install --dry-run=client` would), writes DIR/manifest.yaml and DIR/state.json: one
        entry per pod the StatefulSets/Deployments would create (<name>-<ordinal>), each with the
        address it gets on the test's docker network.
  network-up --subnet CIDR | network-down
        `docker network create` of the test's own bridge network (fixed subnet; its gateway
        address, .1, is where the host's micro Ceph listens). A network of that name that
        carries the test's label was left by a run killed before its cleanup: its containers
        and it are removed first. One without the label is someone else's: refused.
  start POD | stop POD | kill POD | rm POD | logs POD | ready POD | wait-ready POD [--timeout S]
        start: (re)creates the pod's container from the rendered spec (an old container of the
        pod is removed first, its log saved: what the StatefulSet controller does when it
        recreates a pod); stop: `docker stop -t <terminationGracePeriodSeconds>` after the
        preStop hook, as the kubelet deletes a pod; kill: `docker kill` (SIGKILL, as a node lost);
        ready: one readiness probe; wait-ready: until the readiness probe succeeds.
  pods | ip POD | down
        list pods (name, role, address, running, ready); a pod's address; remove every
        container of this state and the network.

Secrets are what the admin creates with kubectl: DIR/secrets/<name>/<key> files (a missing
directory is a missing Secret). ConfigMaps come from the manifest, or from
DIR/configmaps/<name>/<key> for ones the chart only references.

How a pod becomes a container (what the kubelet does, as docker can express it):
  - image, command, args exactly as rendered; $(VAR) in command/args/env expanded from the
    container's env in kubelet's way ($$ escapes, unknown references stay as written);
  - env: value, fieldRef (metadata.name = the pod name, metadata.namespace, spec.nodeName,
    status.podIP / status.hostIP = the container's address: every pod is its own node),
    secretKeyRef / configMapKeyRef (optional honoured), resourceFieldRef; envFrom;
  - volumes: configMap, secret (items, defaultMode/mode, optional: a missing optional Secret
    is an empty volume), projected (configMap/secret/downwardAPI), downwardAPI, emptyDir
    (medium Memory = tmpfs); each written to a directory of DIR and bind-mounted read-only at
    mountPath, or the one file at subPath (a subPath missing in the volume is created as an
    empty directory, as the kubelet does);
  - securityContext (pod and container): runAsUser/runAsGroup (--user), runAsNonRoot (checked),
    fsGroup/supplementalGroups (--group-add; volume files group-owned and group-readable),
    readOnlyRootFilesystem (--read-only), allowPrivilegeEscalation false
    (no-new-privileges), privileged, capabilities add/drop, sysctls;
  - resources.limits cpu/memory (--cpus, --memory);
  - hostNetwork: true means the pod's address is its node's. Every pod here stands for a pod
    on a node of its own: one container, one address on the network, the rendered ports
    unchanged (several gateways on one docker host could not share 4420 otherwise);
    status.hostIP = status.podIP = that address;
  - DNS: network aliases for <pod>.<serviceName>[.<ns>[.svc[.cluster.local]]] (the
    StatefulSet's governing Service) and for every Service selecting the pod
    (<svc>[.<ns>[.svc[.cluster.local]]]); docker's DNS answers them on this network.
Not emulated: Service VIPs (a Service name resolves to its pods' addresses), service-link
environment variables, liveness/startup restarts, service account tokens.
"""

import argparse
import base64
import ipaddress
import json
import math
import os
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

CONTAINER_PREFIX = "nvk8s-"
LABEL = "io.ceph-nvmeof-rs.e2e-k8s"


def die(msg):
    print(f"run-rendered: {msg}", file=sys.stderr)
    sys.exit(1)


def docker(*args, check=True, capture=True, timeout=120):
    cmd = [os.environ.get("DOCKER", "docker"), *args]
    r = subprocess.run(cmd, capture_output=capture, text=True, timeout=timeout)
    if check and r.returncode != 0:
        die(f"{' '.join(cmd)}: {(r.stderr or '').strip()}")
    return r


# ------------------------------------------------------------------ state --
def load_state(d):
    with open(os.path.join(d, "state.json")) as f:
        return json.load(f)


def save_state(d, st):
    tmp = os.path.join(d, "state.json.tmp")
    with open(tmp, "w") as f:
        json.dump(st, f, indent=1)
    os.replace(tmp, os.path.join(d, "state.json"))


def objects(st):
    return st["objects"]


def find_obj(st, kind, name):
    for o in objects(st):
        if o.get("kind") == kind and o["metadata"]["name"] == name:
            return o
    return None


# ----------------------------------------------------------------- render --
def render(args):
    import helm_python  # the venv of tests/helm (helm-python-sdk==0.2.2)
    import yaml

    def merge(into, more):  # what `helm install -f a.yaml -f b.yaml` does with the two files
        for k, v in more.items():
            if isinstance(v, dict) and isinstance(into.get(k), dict):
                merge(into[k], v)
            else:
                into[k] = v
        return into

    values = {}
    for path in args.values:
        with open(path) as f:
            merge(values, yaml.safe_load(f) or {})
    with helm_python.Config(storage_driver="memory") as c:
        rel = c.install(args.chart, args.release, values, dry_run="client", namespace=args.namespace)
    manifest = rel["manifest"]
    os.makedirs(args.state, exist_ok=True)
    with open(os.path.join(args.state, "manifest.yaml"), "w") as f:
        f.write(manifest)
    objs = [o for o in yaml.safe_load_all(manifest) if o]
    net = ipaddress.ip_network(args.subnet)
    hosts = list(net.hosts())
    pods = {}
    workloads = sorted(
        (o for o in objs if o["kind"] in ("StatefulSet", "Deployment")), key=lambda o: o["metadata"]["name"]
    )
    for k, w in enumerate(workloads):
        replicas = w["spec"].get("replicas", 1)
        for i in range(replicas):
            name = f"{w['metadata']['name']}-{i}"
            pods[name] = {
                "workload": w["metadata"]["name"],
                "kind": w["kind"],
                "ordinal": i,
                # .11, .12... for the first workload, .21... for the second: fixed, readable
                "ip": str(hosts[10 * (k + 1) + i]),
                "node": f"node-{w['metadata']['name'].rsplit('-', 1)[-1]}-{i}",
            }
    st = {
        "release": args.release,
        "namespace": args.namespace,
        "subnet": args.subnet,
        "network": args.network,
        "gateway_ip": str(hosts[0]),
        "objects": objs,
        "pods": pods,
    }
    save_state(args.state, st)
    for n, p in pods.items():
        print(f"pod {n} ({p['kind']} {p['workload']}): {p['ip']}")


# ----------------------------------------------------------- kubelet bits --
REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(s, env):
    """Kubernetes' $(VAR) expansion (k8s.io/kubernetes/third_party/forked/golang/expansion)."""

    def sub(m):
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env[name] if name in env else m.group(0)

    return REF.sub(sub, s)


def quantity_bytes(q):
    m = re.fullmatch(r"([0-9.]+)([EPTGMK]i?|[mk]?)", str(q))
    if not m:
        die(f"cannot read the quantity {q!r}")
    mult = {"": 1, "k": 1000, "K": 1000, "M": 1000**2, "G": 1000**3, "T": 1000**4, "P": 1000**5, "E": 1000**6,
            "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4, "Pi": 1024**5, "Ei": 1024**6, "m": 0.001}
    return float(m.group(1)) * mult[m.group(2)]


def cpu_cores(q):
    q = str(q)
    return float(q[:-1]) / 1000 if q.endswith("m") else float(q)


def pod_template(st, pod):
    w = find_obj(st, st["pods"][pod]["kind"], st["pods"][pod]["workload"])
    return w, w["spec"]["template"]


def secret_data(sdir, name):
    """The Secret's keys -> bytes, or None when the admin did not create it."""
    d = os.path.join(sdir, "secrets", name)
    if not os.path.isdir(d):
        return None
    return {k: open(os.path.join(d, k), "rb").read() for k in sorted(os.listdir(d))}


def configmap_data(st, sdir, name):
    o = find_obj(st, "ConfigMap", name)
    if o is not None:
        out = {k: v.encode() for k, v in (o.get("data") or {}).items()}
        out.update({k: base64.b64decode(v) for k, v in (o.get("binaryData") or {}).items()})
        return out
    d = os.path.join(sdir, "configmaps", name)
    if os.path.isdir(d):
        return {k: open(os.path.join(d, k), "rb").read() for k in sorted(os.listdir(d))}
    return None


def field_value(st, pod, path):
    p = st["pods"][pod]
    _, tpl = pod_template(st, pod)
    meta = tpl.get("metadata") or {}
    simple = {
        "metadata.name": pod,
        "metadata.namespace": st["namespace"],
        "metadata.uid": f"00000000-0000-4000-8000-{abs(hash(pod)) % 10**12:012d}",
        "spec.nodeName": p["node"],
        "spec.serviceAccountName": tpl["spec"].get("serviceAccountName", "default"),
        "status.podIP": p["ip"],
        "status.podIPs": p["ip"],
        "status.hostIP": p["ip"],
        "status.hostIPs": p["ip"],
    }
    if path in simple:
        return simple[path]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.*)'\]", path)
    if m:
        extra = {"statefulset.kubernetes.io/pod-name": pod, "apps.kubernetes.io/pod-index": str(p["ordinal"])}
        d = dict(meta.get(m.group(1)) or {})
        if m.group(1) == "labels":
            d.update(extra)
        return d.get(m.group(2), "")
    die(f"fieldRef {path} is not emulated")


def resource_value(container, ref):
    res = container.get("resources") or {}
    kind, what = ref["resource"].split(".", 1)
    q = (res.get(kind) or {}).get(what)
    div = ref.get("divisor", "1")
    if q is None:  # no limit: the node's allocatable
        q = os.cpu_count() if what == "cpu" else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if what == "cpu":
        return str(math.ceil(cpu_cores(q) / cpu_cores(div)))
    return str(math.ceil(quantity_bytes(q) / quantity_bytes(div)))


def container_env(st, sdir, pod, c):
    """The env list as the kubelet builds it (ordered; later values may reference earlier)."""
    env = {}
    for ef in c.get("envFrom") or []:
        pre = ef.get("prefix", "")
        if "configMapRef" in ef:
            r = ef["configMapRef"]
            d = configmap_data(st, sdir, r["name"])
        else:
            r = ef["secretRef"]
            d = secret_data(sdir, r["name"])
        if d is None:
            if r.get("optional"):
                continue
            raise StartError(f"CreateContainerConfigError: envFrom {r['name']} not found")
        for k, v in d.items():
            env[pre + k] = v.decode()
    for e in c.get("env") or []:
        if "value" in e:
            env[e["name"]] = expand(e["value"], env)
        elif "valueFrom" in e:
            vf = e["valueFrom"]
            if "fieldRef" in vf:
                env[e["name"]] = field_value(st, pod, vf["fieldRef"]["fieldPath"])
            elif "resourceFieldRef" in vf:
                env[e["name"]] = resource_value(c, vf["resourceFieldRef"])
            else:
                ref = vf.get("secretKeyRef") or vf.get("configMapKeyRef")
                d = secret_data(sdir, ref["name"]) if "secretKeyRef" in vf else configmap_data(st, sdir, ref["name"])
                if d is None or ref["key"] not in d:
                    if ref.get("optional"):
                        continue
                    raise StartError(f"CreateContainerConfigError: {ref['name']}/{ref['key']} not found")
                env[e["name"]] = d[ref["key"]].decode()
        else:
            env[e["name"]] = ""
    return env


class StartError(Exception):
    pass


def write_files(dirpath, files, gid):
    """files: relative path -> (bytes, mode). Written like the kubelet's atomic writer (without
    its ..data symlinks): root-owned, the fsGroup's group with group read."""
    os.makedirs(dirpath, exist_ok=True)
    for rel, (data, mode) in files.items():
        p = os.path.join(dirpath, rel)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "wb") as f:
            f.write(data)
        if gid is not None:
            os.chown(p, 0, gid)
            mode |= 0o040
        os.chmod(p, mode)


def keyed_files(data, items, default_mode, what):
    if items:
        out = {}
        for it in items:
            if it["key"] not in data:
                raise StartError(f"CreateContainerConfigError: key {it['key']} not in {what}")
            out[it["path"]] = (data[it["key"]], it.get("mode", default_mode))
        return out
    return {k: (v, default_mode) for k, v in data.items()}


def materialize_volume(st, sdir, pod, vol, voldir, gid):
    """Writes the volume's content into voldir; returns True when it is a tmpfs emptyDir."""
    dm = vol.get(next(k for k in vol if k != "name"), {}) or {}
    default_mode = dm.get("defaultMode", 0o644) if isinstance(dm, dict) else 0o644
    if "configMap" in vol or "secret" in vol:
        is_secret = "secret" in vol
        src = vol["secret"] if is_secret else vol["configMap"]
        name = src["secretName"] if is_secret else src["name"]
        data = secret_data(sdir, name) if is_secret else configmap_data(st, sdir, name)
        if data is None:
            if not src.get("optional"):
                raise StartError(f"ContainerCreating: {'Secret' if is_secret else 'ConfigMap'} {name} not found")
            data, src = {}, {}  # optional and missing: an empty volume
        write_files(voldir, keyed_files(data, src.get("items"), default_mode, name), gid)
    elif "projected" in vol:
        files = {}
        for s in vol["projected"].get("sources") or []:
            if "secret" in s or "configMap" in s:
                is_secret = "secret" in s
                src = s["secret"] if is_secret else s["configMap"]
                data = secret_data(sdir, src["name"]) if is_secret else configmap_data(st, sdir, src["name"])
                if data is None:
                    if not src.get("optional"):
                        raise StartError(f"ContainerCreating: projected {src['name']} not found")
                    continue
                files.update(keyed_files(data, src.get("items"), default_mode, src["name"]))
            elif "downwardAPI" in s:
                for it in s["downwardAPI"].get("items") or []:
                    files[it["path"]] = (field_value(st, pod, it["fieldRef"]["fieldPath"]).encode(), default_mode)
            else:
                print(f"run-rendered: projected source {list(s)} not emulated (skipped)", file=sys.stderr)
        write_files(voldir, files, gid)
    elif "downwardAPI" in vol:
        files = {it["path"]: (field_value(st, pod, it["fieldRef"]["fieldPath"]).encode(), default_mode)
                 for it in vol["downwardAPI"].get("items") or []}
        write_files(voldir, files, gid)
    elif "emptyDir" in vol:
        if (vol["emptyDir"] or {}).get("medium") == "Memory":
            return True
        os.makedirs(voldir, exist_ok=True)
        os.chmod(voldir, 0o777)  # the kubelet's emptyDir is world-writable
    elif "hostPath" in vol:
        return False
    else:
        raise StartError(f"volume {vol['name']}: type {list(vol)} not emulated")
    return False


def docker_run_args(st, sdir, pod, c, init=False):
    """The docker run arguments that stand for container c of pod."""
    p = st["pods"][pod]
    w, tpl = pod_template(st, pod)
    spec = tpl["spec"]
    psc = spec.get("securityContext") or {}
    csc = c.get("securityContext") or {}
    cname = CONTAINER_PREFIX + pod + ("-init-" + c["name"] if init else "")
    a = ["--name", cname, "--label", f"{LABEL}={sdir}", "--label", f"{LABEL}.pod={pod}"]
    a += ["--network", st["network"], "--ip", p["ip"]]
    # DNS names of the pod: its StatefulSet's governing Service, the Services that select it
    ns = st["namespace"]
    aliases = []
    svcname = w["spec"].get("serviceName") if w["kind"] == "StatefulSet" else None
    if svcname:
        base = f"{pod}.{svcname}"
        aliases += [base, f"{base}.{ns}", f"{base}.{ns}.svc", f"{base}.{ns}.svc.cluster.local"]
    labels = (tpl.get("metadata") or {}).get("labels") or {}
    for o in objects(st):
        if o["kind"] != "Service":
            continue
        sel = (o.get("spec") or {}).get("selector") or {}
        if sel and all(labels.get(k) == v for k, v in sel.items()):
            n = o["metadata"]["name"]
            aliases += [n, f"{n}.{ns}", f"{n}.{ns}.svc", f"{n}.{ns}.svc.cluster.local"]
    for al in dict.fromkeys(aliases):
        a += ["--network-alias", al]
    a += ["--hostname", p["node"] if spec.get("hostNetwork") else pod]
    # security context
    uid = csc.get("runAsUser", psc.get("runAsUser"))
    gid = csc.get("runAsGroup", psc.get("runAsGroup"))
    nonroot = csc.get("runAsNonRoot", psc.get("runAsNonRoot"))
    if uid is not None:
        a += ["--user", f"{uid}" + (f":{gid}" if gid is not None else "")]
    elif gid is not None:
        die(f"{pod}: runAsGroup without runAsUser is not emulated")
    if nonroot:
        eff = uid
        if eff is None:
            user = docker("image", "inspect", "-f", "{{.Config.User}}", c["image"]).stdout.strip()
            eff = user.split(":")[0] if user else "0"
            if not eff.isdigit():
                raise StartError("CreateContainerConfigError: runAsNonRoot and the image's USER is not numeric")
        if int(eff) == 0:
            raise StartError("CreateContainerConfigError: container has runAsNonRoot and image will run as root")
    fsgroup = psc.get("fsGroup")
    for g in ([fsgroup] if fsgroup is not None else []) + list(psc.get("supplementalGroups") or []):
        a += ["--group-add", str(g)]
    if csc.get("readOnlyRootFilesystem"):
        a += ["--read-only"]
    if csc.get("allowPrivilegeEscalation") is False:
        a += ["--security-opt", "no-new-privileges"]
    if csc.get("privileged"):
        a += ["--privileged"]
    caps = csc.get("capabilities") or {}
    for cap in caps.get("drop") or []:
        a += ["--cap-drop", cap]
    for cap in caps.get("add") or []:
        a += ["--cap-add", cap]
    for s in psc.get("sysctls") or []:
        a += ["--sysctl", f"{s['name']}={s['value']}"]
    lim = (c.get("resources") or {}).get("limits") or {}
    if "memory" in lim:
        a += ["--memory", str(int(quantity_bytes(lim["memory"])))]
    if "cpu" in lim:
        a += ["--cpus", f"{cpu_cores(lim['cpu']):.3f}"]
    # env and the command line
    env = container_env(st, sdir, pod, c)
    for k, v in env.items():
        a += ["--env", f"{k}={v}"]
    command = [expand(x, env) for x in c.get("command") or []]
    args = [expand(x, env) for x in c.get("args") or []]
    if c.get("workingDir"):
        a += ["--workdir", c["workingDir"]]
    # volumes
    vols = {v["name"]: v for v in spec.get("volumes") or []}
    vroot = os.path.join(sdir, "volumes", pod)
    made = {}
    for m in c.get("volumeMounts") or []:
        v = vols.get(m["name"])
        if v is None:
            raise StartError(f"volumeMount {m['name']} names no volume")
        vd = os.path.join(vroot, v["name"])
        if v["name"] not in made:
            made[v["name"]] = materialize_volume(st, sdir, pod, v, vd, fsgroup)
        if made[v["name"]]:  # emptyDir medium Memory: a tmpfs of its sizeLimit
            limit = (v["emptyDir"] or {}).get("sizeLimit")
            size = f",size={int(quantity_bytes(limit))}" if limit else ""
            a += ["--tmpfs", f"{m['mountPath']}:mode=1777{size}"]
            continue
        src = v["hostPath"]["path"] if "hostPath" in v else vd
        if m.get("subPath") or m.get("subPathExpr"):
            sub = m.get("subPath") or expand(m["subPathExpr"], env)
            src = os.path.join(src, sub)
            if not os.path.exists(src):
                os.makedirs(src)  # the kubelet creates a missing subPath as a directory
        ro = m.get("readOnly") or any(k in v for k in ("configMap", "secret", "projected", "downwardAPI"))
        a += ["--mount", f"type=bind,src={src},dst={m['mountPath']}" + (",readonly" if ro else "")]
    if command:
        a += ["--entrypoint", command[0], c["image"], *command[1:], *args]
    else:
        a += [c["image"], *args]
    return a


def main_container(st, pod):
    _, tpl = pod_template(st, pod)
    return tpl["spec"]["containers"][0]


def cname(pod):
    return CONTAINER_PREFIX + pod


def save_logs(sdir, pod):
    r = docker("logs", "-t", cname(pod), check=False)
    if r.returncode == 0:
        os.makedirs(os.path.join(sdir, "logs"), exist_ok=True)
        with open(os.path.join(sdir, "logs", pod + ".log"), "a") as f:
            f.write(f"==== container {cname(pod)} (saved {time.strftime('%H:%M:%S')}) ====\n")
            f.write(r.stdout + r.stderr)


def remove(sdir, pod):
    if docker("container", "inspect", cname(pod), check=False).returncode == 0:
        save_logs(sdir, pod)
        docker("rm", "-f", cname(pod))
    shutil.rmtree(os.path.join(sdir, "volumes", pod), ignore_errors=True)


def start(args):
    st = load_state(args.state)
    pod = args.pod
    if pod not in st["pods"]:
        die(f"no pod {pod} rendered")
    remove(args.state, pod)
    _, tpl = pod_template(st, pod)
    try:
        for ic in tpl["spec"].get("initContainers") or []:
            ra = docker_run_args(st, args.state, pod, ic, init=True)
            r = docker("run", "--rm", *ra, check=False, timeout=300)
            if r.returncode != 0:
                raise StartError(f"Init:Error: init container {ic['name']} exited {r.returncode}: {r.stderr.strip()}")
        ra = docker_run_args(st, args.state, pod, main_container(st, pod))
    except StartError as e:
        print(f"pod {pod}: {e}")
        sys.exit(3)
    os.makedirs(os.path.join(args.state, "logs"), exist_ok=True)
    with open(os.path.join(args.state, "logs", pod + ".docker-run"), "a") as f:
        f.write("docker run -d " + " ".join(ra) + "\n")
    docker("run", "-d", *ra)
    st["pods"][pod]["started"] = time.time()
    save_state(args.state, st)
    print(f"pod {pod}: container {cname(pod)} at {st['pods'][pod]['ip']}")


def stop(args):
    st = load_state(args.state)
    _, tpl = pod_template(st, args.pod)
    grace = tpl["spec"].get("terminationGracePeriodSeconds", 30)
    c = main_container(st, args.pod)
    t0 = time.time()
    pre = ((c.get("lifecycle") or {}).get("preStop") or {})
    if "exec" in pre:
        docker("exec", cname(args.pod), *pre["exec"]["command"], check=False, timeout=grace + 5)
    left = max(0, int(round(grace - (time.time() - t0))))
    docker("stop", "-t", str(left), cname(args.pod), timeout=grace + 30)
    rc = docker("inspect", "-f", "{{.State.ExitCode}}", cname(args.pod)).stdout.strip()
    print(f"pod {args.pod}: stopped (SIGTERM, grace {grace}s) in {time.time() - t0:.2f}s, exit status {rc}")
    if rc != "0":
        sys.exit(4)


def kill(args):
    docker("kill", cname(args.pod))
    print(f"pod {args.pod}: killed (SIGKILL)")


def probe_once(st, pod, which="readinessProbe"):
    """(ok, detail) for the rendered probe of pod's main container."""
    c = main_container(st, pod)
    pr = c.get(which)
    if not pr:
        running = docker("inspect", "-f", "{{.State.Running}}", cname(pod), check=False).stdout.strip()
        return running == "true", "no probe: running"
    timeout = pr.get("timeoutSeconds", 1)
    ip = st["pods"][pod]["ip"]
    ports = {p.get("name"): p["containerPort"] for p in c.get("ports") or []}
    if "httpGet" in pr:
        h = pr["httpGet"]
        port = h["port"] if isinstance(h["port"], int) else ports.get(h["port"])
        if port is None:
            return False, f"port {h['port']} is not a container port"
        url = f"{h.get('scheme', 'HTTP').lower()}://{h.get('host', ip)}:{port}{h.get('path', '/')}"
        try:
            with urllib.request.urlopen(url, timeout=timeout) as r:
                body = r.read(200).decode(errors="replace").strip()
                return 200 <= r.status < 400, f"{url}: {r.status} {body}"
        except urllib.error.HTTPError as e:
            body = e.read(200).decode(errors="replace").strip()
            if e.code == 404 and h.get("path") != "/metrics":
                # a binary without the health endpoints yet: the metrics server answering
                # stands for them (printed, so that it cannot pass unnoticed)
                try:
                    with urllib.request.urlopen(url.rsplit(h.get("path", "/"), 1)[0] + "/metrics", timeout=timeout) as r:
                        return r.status == 200, f"{url}: 404; FALLBACK /metrics answers {r.status}"
                except OSError as e2:
                    return False, f"{url}: 404; /metrics: {e2}"
            return False, f"{url}: {e.code} {body}"
        except OSError as e:
            return False, f"{url}: {e}"
    if "tcpSocket" in pr:
        t = pr["tcpSocket"]
        port = t["port"] if isinstance(t["port"], int) else ports.get(t["port"])
        try:
            socket.create_connection((ip, port), timeout=timeout).close()
            return True, f"tcp {ip}:{port} open"
        except OSError as e:
            return False, f"tcp {ip}:{port}: {e}"
    if "exec" in pr:
        r = docker("exec", cname(pod), *pr["exec"]["command"], check=False, timeout=timeout + 5)
        return r.returncode == 0, f"exec rc {r.returncode}"
    return False, f"probe {list(pr)} not emulated"


def ready(args):
    st = load_state(args.state)
    ok, detail = probe_once(st, args.pod)
    print(f"pod {args.pod}: {'ready' if ok else 'not ready'} ({detail})")
    sys.exit(0 if ok else 1)


def wait_ready(args):
    st = load_state(args.state)
    t0 = time.time()
    started = st["pods"][args.pod].get("started", t0)
    detail = ""
    while time.time() - t0 < args.timeout:
        running = docker("inspect", "-f", "{{.State.Running}}", cname(args.pod), check=False).stdout.strip()
        if running != "true":
            print(f"pod {args.pod}: container not running ({detail})")
            sys.exit(1)
        ok, detail = probe_once(st, args.pod)
        if ok:
            print(f"pod {args.pod}: ready {time.time() - started:.2f}s after its start ({detail})")
            return
        time.sleep(0.1)
    print(f"pod {args.pod}: not ready after {args.timeout}s ({detail})")
    sys.exit(1)


def logs(args):
    r = docker("logs", cname(args.pod), check=False)
    sys.stdout.write(r.stdout + r.stderr)


def pods(args):
    st = load_state(args.state)
    for n, p in st["pods"].items():
        running = docker("inspect", "-f", "{{.State.Running}}", cname(n), check=False).stdout.strip() or "absent"
        ok, _ = probe_once(st, n) if running == "true" else (False, "")
        print(f"{n} {p['workload']} {p['ip']} running={running} ready={ok}")


def ip(args):
    print(load_state(args.state)["pods"][args.pod]["ip"])


def reclaim_leftover_network(network):
    """Removes a network of this name that an earlier run made and never removed.

    A run killed with SIGKILL (a CI job's time limit, a session's end) skips its cleanup, and
    dockerd keeps its network and containers across runs; the next run would find the name
    (and the bridge, and the subnet) taken. Only a network with the test's label is removed, and
    the test's containers with it (any state directory: two runs cannot share the names anyway).
    """
    r = docker("network", "inspect", "-f", "{{json .Labels}}", network)
    labels = json.loads(r.stdout.strip() or "null") or {}
    if LABEL not in labels:
        die(f"docker network {network} exists and is not this test's (no label {LABEL}): remove it or rename it")
    stale = docker("ps", "-aq", "--filter", f"label={LABEL}").stdout.split()
    for cid in stale:
        docker("rm", "-f", cid)
    docker("network", "rm", network)
    print(f"network {network}: left by an earlier run that did not clean up; removed it and its {len(stale)} container(s)")


def network_up(args):
    net = ipaddress.ip_network(args.subnet)
    gw = next(net.hosts())
    if docker("network", "inspect", args.network, check=False).returncode == 0:
        reclaim_leftover_network(args.network)
    for line in subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True).stdout.splitlines():
        dst = line.split()[0]
        if dst == "default":
            continue
        try:
            if ipaddress.ip_network(dst, strict=False).overlaps(net):
                die(f"subnet {net} overlaps the route '{line}': choose another (E2E_K8S_SUBNET)")
        except ValueError:
            continue
    docker("network", "create", "--driver", "bridge", "--subnet", str(net), "--gateway", str(gw),
           "--label", LABEL, "-o", f"com.docker.network.bridge.name={args.bridge}", args.network)
    print(f"network {args.network}: {net}, bridge {args.bridge} with {gw} on the host")


def network_down(args):
    docker("network", "rm", args.network, check=False)


def down(args):
    st = load_state(args.state)
    for n in st["pods"]:
        remove(args.state, n)
    r = docker("ps", "-aq", "--filter", f"label={LABEL}={args.state}", check=False)
    for cid in r.stdout.split():
        docker("rm", "-f", cid, check=False)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--state", required=True)
    sp = ap.add_subparsers(dest="cmd", required=True)
    r = sp.add_parser("render")
    r.add_argument("--chart", required=True)
    r.add_argument("--release", required=True)
    r.add_argument("--namespace", required=True)
    r.add_argument("--values", action="append", required=True, help="values file (repeatable, later ones win)")
    r.add_argument("--subnet", required=True)
    r.add_argument("--network", required=True)
    r.set_defaults(fn=render)
    n = sp.add_parser("network-up")
    n.add_argument("--subnet", required=True)
    n.add_argument("--network", required=True)
    n.add_argument("--bridge", required=True)
    n.set_defaults(fn=network_up)
    n = sp.add_parser("network-down")
    n.add_argument("--network", required=True)
    n.set_defaults(fn=network_down)
    for name, fn in (("start", start), ("stop", stop), ("kill", kill), ("ready", ready), ("logs", logs), ("ip", ip)):
        s = sp.add_parser(name)
        s.add_argument("pod")
        s.set_defaults(fn=fn)
    s = sp.add_parser("rm")
    s.add_argument("pod")
    s.set_defaults(fn=lambda a: remove(a.state, a.pod))
    s = sp.add_parser("wait-ready")
    s.add_argument("pod")
    s.add_argument("--timeout", type=float, default=60)
    s.set_defaults(fn=wait_ready)
    sp.add_parser("pods").set_defaults(fn=pods)
    sp.add_parser("down").set_defaults(fn=down)
    a = ap.parse_args()
    a.state = os.path.abspath(a.state)
    a.fn(a)


if __name__ == "__main__":
    main()
