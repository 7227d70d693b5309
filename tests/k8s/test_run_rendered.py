"""Unit tests of tests/k8s/run-rendered.py: the pod -> docker run translation must do what the
kubelet does, or e2e-k8s would test something else than what the chart renders.

Run: python -m pytest tests/k8s (the venv of tests/helm/run.sh; tests/vm/e2e-k8s.sh runs them
in its preflight step). No docker needed.
"""

import importlib.util
import os

import pytest

_spec = importlib.util.spec_from_file_location(
    "run_rendered", os.path.join(os.path.dirname(__file__), "run-rendered.py")
)
rr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rr)


def test_expand_follows_kubelet_rules():
    env = {"POD_NAME": "gw-0", "A": "x"}
    assert rr.expand("/etc/nvmeof/$(POD_NAME).toml", env) == "/etc/nvmeof/gw-0.toml"
    assert rr.expand("$$(POD_NAME)", env) == "$(POD_NAME)"  # $$ escapes
    assert rr.expand("$(UNKNOWN)-$(A)", env) == "$(UNKNOWN)-x"  # unknown stays as written
    assert rr.expand("$A $(A", env) == "$A $(A"  # not references


def state(tmp_path, pod_spec, extra_objects=()):
    sts = {
        "kind": "StatefulSet",
        "metadata": {"name": "rel-gateway"},
        "spec": {
            "serviceName": "rel-gateway-hl",
            "replicas": 1,
            "template": {"metadata": {"labels": {"app": "gw"}}, "spec": pod_spec},
        },
    }
    st = {
        "release": "rel",
        "namespace": "ns1",
        "subnet": "172.30.99.0/24",
        "network": "testnet",
        "gateway_ip": "172.30.99.1",
        "objects": [sts, *extra_objects],
        "pods": {
            "rel-gateway-0": {"workload": "rel-gateway", "kind": "StatefulSet", "ordinal": 0,
                              "ip": "172.30.99.21", "node": "node-gateway-0"}
        },
    }
    return st, str(tmp_path)


GATEWAY = {
    "name": "gateway",
    "image": "nvmeof-gateway:0.1.0",
    "command": ["/usr/bin/nvmeof-gateway"],
    "args": ["--config", "/etc/nvmeof/$(POD_NAME).toml"],
    "env": [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "HOST_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.hostIP"}}},
        {"name": "MSG", "value": "on $(HOST_IP)"},
    ],
    "securityContext": {"readOnlyRootFilesystem": True, "allowPrivilegeEscalation": False,
                        "capabilities": {"drop": ["ALL"], "add": ["IPC_LOCK"]}},
    "volumeMounts": [
        {"name": "ceph", "mountPath": "/etc/ceph", "readOnly": True},
        {"name": "tmp", "mountPath": "/tmp"},
    ],
}
POD = {
    "hostNetwork": True,
    "securityContext": {"runAsUser": 65532, "runAsGroup": 65532, "fsGroup": 65532},
    "containers": [GATEWAY],
    "volumes": [
        {"name": "ceph", "projected": {"defaultMode": 0o440, "sources": [
            {"configMap": {"name": "ceph-conf", "items": [{"key": "ceph.conf", "path": "ceph.conf"}]}},
            {"secret": {"name": "keyring", "optional": True, "items": [{"key": "keyring", "path": "keyring"}]}},
        ]}},
        {"name": "tmp", "emptyDir": {"medium": "Memory", "sizeLimit": "16Mi"}},
    ],
}
CEPH_CONF = {"kind": "ConfigMap", "metadata": {"name": "ceph-conf"}, "data": {"ceph.conf": "[global]\n"}}


def run_args(tmp_path, pod=POD, objs=(CEPH_CONF,)):
    st, sdir = state(tmp_path, pod, objs)
    return rr.docker_run_args(st, sdir, "rel-gateway-0", pod["containers"][0]), sdir


def test_command_args_env_as_the_kubelet_builds_them(tmp_path):
    a, _ = run_args(tmp_path)
    i = a.index("--entrypoint")
    assert a[i:] == ["--entrypoint", "/usr/bin/nvmeof-gateway", "nvmeof-gateway:0.1.0",
                     "--config", "/etc/nvmeof/rel-gateway-0.toml"]
    envs = [a[j + 1] for j, x in enumerate(a) if x == "--env"]
    # hostNetwork: the pod's address is its node's
    assert envs == ["POD_NAME=rel-gateway-0", "HOST_IP=172.30.99.21", "MSG=on 172.30.99.21"]
    assert a[a.index("--ip") + 1] == "172.30.99.21"
    assert "rel-gateway-0.rel-gateway-hl.ns1.svc.cluster.local" in a
    assert a[a.index("--hostname") + 1] == "node-gateway-0"


def test_security_context(tmp_path):
    a, _ = run_args(tmp_path)
    assert a[a.index("--user") + 1] == "65532:65532"
    assert a[a.index("--group-add") + 1] == "65532"
    assert "--read-only" in a
    assert a[a.index("--security-opt") + 1] == "no-new-privileges"
    assert a[a.index("--cap-drop") + 1] == "ALL" and a[a.index("--cap-add") + 1] == "IPC_LOCK"


def test_missing_optional_secret_leaves_the_volume_without_it(tmp_path):
    a, sdir = run_args(tmp_path)
    mounts = [a[j + 1] for j, x in enumerate(a) if x == "--mount"]
    vol = os.path.join(sdir, "volumes", "rel-gateway-0", "ceph")
    assert mounts == [f"type=bind,src={vol},dst=/etc/ceph,readonly"]
    assert sorted(os.listdir(vol)) == ["ceph.conf"]
    st = os.stat(os.path.join(vol, "ceph.conf"))
    assert (st.st_mode & 0o777, st.st_gid) == (0o440, 65532)  # defaultMode, fsGroup
    assert a[a.index("--tmpfs") + 1] == f"/tmp:mode=1777,size={16 * 1024 * 1024}"


def test_created_secret_is_mounted(tmp_path):
    st, sdir = state(tmp_path, POD, (CEPH_CONF,))
    os.makedirs(os.path.join(sdir, "secrets", "keyring"))
    with open(os.path.join(sdir, "secrets", "keyring", "keyring"), "w") as f:
        f.write("[client.nvmeof]\n")
    pod = dict(POD, volumes=[dict(POD["volumes"][0]), POD["volumes"][1]])
    pod["volumes"][0]["projected"] = dict(POD["volumes"][0]["projected"], defaultMode=0o400)
    st, sdir = state(tmp_path, pod, (CEPH_CONF,))
    rr.docker_run_args(st, sdir, "rel-gateway-0", GATEWAY)
    vol = os.path.join(sdir, "volumes", "rel-gateway-0", "ceph")
    assert sorted(os.listdir(vol)) == ["ceph.conf", "keyring"]
    # fsGroup: the kubelet makes the files group-readable for the pod's group
    assert os.stat(os.path.join(vol, "keyring")).st_mode & 0o777 == 0o440


def test_missing_required_configmap_refuses_to_start(tmp_path):
    with pytest.raises(rr.StartError, match="ceph-conf not found"):
        run_args(tmp_path, objs=())


def test_missing_subpath_becomes_a_directory(tmp_path):
    pod = dict(POD)
    c = dict(GATEWAY, volumeMounts=[{"name": "ceph", "mountPath": "/etc/ceph/keyring", "subPath": "keyring"}])
    pod["containers"] = [c]
    a, sdir = run_args(tmp_path, pod)
    assert os.path.isdir(os.path.join(sdir, "volumes", "rel-gateway-0", "ceph", "keyring"))
