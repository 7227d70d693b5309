"""Shared helpers of the chart tests: render the chart offline with the real Helm v4 library
(helm-python-sdk), parse what it renders, and the value sets every test runs over."""
import copy
import re
from pathlib import Path

import helm_python
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "nvmeof-gateway"
RELEASE = "nvmeof-gateway"  # contains the chart name: fullname = the release name
NAMESPACE = "storage"
FULLNAME = "nvmeof-gateway"

# The smallest values an install needs: the chart cannot guess the monitors.
BASE = {"ceph": {"monHost": "[v2:192.0.2.1:3300,v1:192.0.2.1:6789]"}}


def merged(*overrides):
    out = copy.deepcopy(BASE)
    for o in overrides:
        _merge(out, copy.deepcopy(o))
    return out


def _merge(dst, src):
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        else:
            dst[k] = v


# The value sets rendered, validated and checked by the tests (name -> values).
VALUE_SETS = {
    "defaults": merged(),
    "tls-cert-manager": merged({"tls": {"enabled": True, "certManager": {"enabled": True}}}),
    "tls-existing-secrets": merged({"tls": {"enabled": True, "controlSecret": "my-control-tls",
                                            "gatewaySecret": "my-gateway-tls", "cliSecret": "my-cli-tls"}}),
    "tls-cert-manager-issuer": merged({"tls": {"enabled": True, "certManager": {
        "enabled": True, "issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"}}}}),
    "rdma": merged({"gateway": {"rdma": {"enabled": True, "resourceName": "rdma/hca_shared_devices_a"}}}),
    "privileged": merged({"gateway": {"privileged": True}}),
    "monitoring": merged({"monitoring": {"serviceMonitor": {"enabled": True},
                                         "prometheusRule": {"enabled": True}},
                          "networkPolicy": {"enabled": True}}),
    "podmonitor-no-hostnetwork": merged({"monitoring": {"podMonitor": {"enabled": True}},
                                        "gateway": {"hostNetwork": False},
                                        "networkPolicy": {"enabled": True,
                                                          "nvmeFrom": [{"ipBlock": {"cidr": "198.51.100.0/24"}}]}}),
    "existing-ceph-configmap": {"ceph": {"existingConfigMap": "rook-ceph-config", "existingConfigMapKey": "config",
                                         "keyringSecret": {"name": "rook-nvmeof-keyring"}}},
    "rook-mon-host-secret": {"ceph": {"monHostSecret": {"name": "rook-ceph-config"}}},
    "inline-keyring": merged({"ceph": {"keyringSecret": {"cephxKey": "AQBvaBFZAAAAABAA9VHgwCgQxwc4Wf8ddGsOeA=="}}}),
    "scaled": merged({"controlPlane": {"replicas": 3, "graceMs": 1500},
                      "gateway": {"replicas": 4, "beaconIntervalMs": 250, "stallWindowMs": 3000, "workerThreads": 4,
                                  "tcpDataBudget": "512MiB", "cephConnections": 2,
                                  "cephOptions": {"rados_osd_op_timeout": 30, "ms_crc_data": False},
                                  "listeners": [{"transport": "tcp", "address": "0.0.0.0", "port": 4430}],
                                  "topologySpreadConstraints": [{"maxSkew": 1, "topologyKey": "topology.kubernetes.io/zone",
                                                                 "whenUnsatisfiable": "ScheduleAnyway"}],
                                  "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                                      "nodeSelectorTerms": [{"matchExpressions": [
                                          {"key": "storage", "operator": "In", "values": ["nvmeof"]}]}]}}},
                                  "priorityClassName": "system-node-critical"},
                      "extraObjects": [{"apiVersion": "v1", "kind": "ConfigMap",
                                        "metadata": {"name": "{{ .Release.Name }}-extra"}, "data": {"a": "b"}}]}),
}


class Rendered:
    """The objects of one render: the release manifest (install --dry-run=client) and the
    `helm test` hooks (which Helm keeps out of the manifest)."""

    def __init__(self, values, release=RELEASE, namespace=NAMESPACE):
        self.values = values
        with helm_python.Config(storage_driver="memory") as config:
            result = config.install(str(CHART), release, values, dry_run="client", namespace=namespace)
        self.manifest = result["manifest"]
        self.notes = result["notes"]
        self.objects = [o for o in yaml.safe_load_all(self.manifest) if o]
        # Hooks: Chart.render (offline, same engine) returns every template, hooks included.
        with helm_python.Chart.load(str(CHART)) as chart:
            templates = chart.render(values, name=release, namespace=namespace, is_install=True)
        self.hooks = [o for path, text in sorted(templates.items()) if "/templates/tests/" in path
                      for o in yaml.safe_load_all(text) if o]

    def all(self):
        return self.objects + self.hooks

    def of_kind(self, kind):
        return [o for o in self.all() if o["kind"] == kind]

    def one(self, kind, name):
        found = [o for o in self.all() if o["kind"] == kind and o["metadata"]["name"] == name]
        assert len(found) == 1, f"{kind} {name}: {len(found)} rendered"
        return found[0]


@pytest.fixture(scope="session")
def rendered():
    """name -> Rendered, for every value set (rendered once per session)."""
    return {name: Rendered(values) for name, values in VALUE_SETS.items()}


def pod_specs(r):
    """(owner name, pod spec) of every pod the render makes."""
    out = []
    for o in r.all():
        if o["kind"] in ("StatefulSet", "Deployment", "DaemonSet", "Job"):
            out.append((o["metadata"]["name"], o["spec"]["template"]["spec"]))
        elif o["kind"] == "Pod":
            out.append((o["metadata"]["name"], o["spec"]))
    return out


def rust_struct_fields(source, struct):
    """Field names serde reads for `struct` in Rust `source` (honouring rename = "...")."""
    m = re.search(r"pub struct " + struct + r" \{(.*?)\n\}", source, re.S)
    assert m, f"struct {struct} not found"
    fields = set()
    pending_rename = None
    for line in m.group(1).splitlines():
        r = re.search(r'rename = "([^"]+)"', line)
        if r:
            pending_rename = r.group(1)
        f = re.match(r"\s*pub (\w+):", line)
        if f:
            fields.add(pending_rename or f.group(1))
            pending_rename = None
    return fields
