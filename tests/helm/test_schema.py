"""values.schema.json: bad values fail `helm install` with a message naming the key."""
import helm_python
import pytest

from conftest import BASE, CHART, NAMESPACE, RELEASE, merged


def install_error(values):
    with helm_python.Config(storage_driver="memory") as config:
        with pytest.raises(helm_python.HelmError) as caught:
            config.install(str(CHART), RELEASE, values, dry_run="client", namespace=NAMESPACE)
    return str(caught.value)


@pytest.mark.parametrize("values, names", [
    # an unknown key at the top, and a typo deep down
    (merged({"gatway": {"replicas": 2}}), ["additional properties 'gatway' not allowed"]),
    (merged({"gateway": {"rdma": {"enabeld": True}}}), ["/gateway/rdma", "'enabeld'"]),
    (merged({"controlPlane": {"podDisruptionBudget": {"minAvailable": 1}}}),
     ["/controlPlane/podDisruptionBudget", "'minAvailable'"]),
    # wrong types
    (merged({"gateway": {"replicas": "2"}}), ["/gateway/replicas"]),
    (merged({"gateway": {"hostNetwork": "yes"}}), ["/gateway/hostNetwork"]),
    (merged({"tls": {"enabled": 1}}), ["/tls/enabled"]),
    (merged({"gateway": {"listeners": {"transport": "tcp"}}}), ["/gateway/listeners"]),
    # ranges
    (merged({"controlPlane": {"replicas": 0}}), ["/controlPlane/replicas", "minimum"]),
    (merged({"gateway": {"replicas": 0}}), ["/gateway/replicas", "minimum"]),
    (merged({"gateway": {"replicas": 33}}), ["/gateway/replicas", "maximum"]),
    (merged({"gateway": {"beaconIntervalMs": 1001}}), ["/gateway/beaconIntervalMs"]),
    (merged({"gateway": {"leaveTimeoutMs": 0}}), ["/gateway/leaveTimeoutMs", "minimum"]),
    (merged({"gateway": {"stallWindowMs": 399}}), ["/gateway/stallWindowMs"]),
    (merged({"gateway": {"ports": {"nvme": 70000}}}), ["/gateway/ports/nvme"]),
    # enums and patterns
    (merged({"image": {"pullPolicy": "Sometimes"}}), ["/image/pullPolicy"]),
    (merged({"gateway": {"listeners": [{"transport": "fc", "address": "0.0.0.0", "port": 4420}]}}),
     ["/gateway/listeners/0/transport"]),
    (merged({"tls": {"certManager": {"issuerRef": {"kind": "Vault"}}}}), ["/tls/certManager/issuerRef/kind"]),
    (merged({"ceph": {"clientName": "nvmeof"}}), ["/ceph/clientName"]),
    (merged({"gateway": {"tcpDataBudget": "lots"}}), ["/gateway/tcpDataBudget"]),
])
def test_schema_refuses(values, names):
    message = install_error(values)
    assert "schema" in message, message
    for n in names:
        assert n in message, f"{n!r} not in: {message}"


@pytest.mark.parametrize("values, words", [
    ({}, ["ceph.monHost is required"]),
    (merged({"tls": {"certManager": {"enabled": True}}}), ["tls.certManager.enabled needs tls.enabled"]),
    (merged({"monitoring": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}}),
     ["choose one"]),
    (merged({"gateway": {"leaveTimeoutMs": 30000, "terminationGracePeriodSeconds": 30}}),
     ["gateway.terminationGracePeriodSeconds (30) must be at least", "(40)"]),
])
def test_preflight_refuses(values, words):
    message = install_error(values)
    for w in words:
        assert w in message, message


def test_defaults_and_every_documented_value_pass_the_schema():
    with helm_python.Chart.load(str(CHART)) as chart:
        chart.validate_schema(BASE)
        chart.validate_schema(chart.values)  # values.yaml itself (nulls included)
