"""Unit tests over the rendered objects: the Kubernetes contract (docs/kubernetes.md,
issue 24) as the chart renders it for every value set."""
import re
import tomllib

import pytest

from conftest import FULLNAME, NAMESPACE, ROOT, VALUE_SETS, pod_specs, rust_struct_fields

CONTROL = f"{FULLNAME}-control"
GATEWAY = f"{FULLNAME}-gateway"
ALL = sorted(VALUE_SETS)
# NVMe Base: controller IDs 0xFFF0..0xFFFF are reserved; the gateway accepts 1..=0xFFEF
# (gateway/src/spec.rs cntlid::MIN/MAX).
CNTLID_MIN, CNTLID_MAX = 1, 0xFFEF


def container(spec, name):
    found = [c for c in spec["containers"] if c["name"] == name]
    assert len(found) == 1, f"container {name}: {len(found)}"
    return found[0]


def sts(r, name):
    return r.one("StatefulSet", name)


def gateway_tomls(r):
    cm = r.one("ConfigMap", f"{GATEWAY}-config")
    return {k: tomllib.loads(v) for k, v in cm["data"].items()}


def mounted_secrets(spec, container_name):
    """Secret names whose files the container sees (secret and projected volumes)."""
    c = container(spec, container_name)
    mounted = {m["name"] for m in c.get("volumeMounts", [])}
    out = set()
    for v in spec.get("volumes", []):
        if v["name"] not in mounted:
            continue
        if "secret" in v:
            out.add(v["secret"]["secretName"])
        for src in v.get("projected", {}).get("sources", []):
            if "secret" in src:
                out.add(src["secret"]["name"])
    return out


def port_number(c, name):
    return next(p["containerPort"] for p in c["ports"] if p["name"] == name)


# ------------------------------------------------------------------ probes --
@pytest.mark.parametrize("name", ALL)
def test_probes_are_http_on_the_metrics_port(rendered, name):
    r = rendered[name]
    control = container(sts(r, CONTROL)["spec"]["template"]["spec"], "control")
    gateway = container(sts(r, GATEWAY)["spec"]["template"]["spec"], "gateway")
    for c, probes in ((control, {"readinessProbe": "/readyz", "livenessProbe": "/healthz"}),
                      (gateway, {"readinessProbe": "/readyz", "livenessProbe": "/healthz",
                                 "startupProbe": "/healthz"})):
        for probe, path in probes.items():
            get = c[probe]["httpGet"]
            assert get["path"] == path, (c["name"], probe)
            assert get["port"] == "metrics", (c["name"], probe)
        port_number(c, "metrics")
    # the gateway's metrics port is the one its TOML listens on
    for toml in gateway_tomls(r).values():
        assert toml["gateway"]["metrics_listen"] == f"0.0.0.0:{port_number(gateway, 'metrics')}"


# -------------------------------------------------------- placement, PDBs --
@pytest.mark.parametrize("name", ALL)
def test_gateways_anti_affinity_is_required_on_hostname(rendered, name):
    r = rendered[name]
    spec = sts(r, GATEWAY)["spec"]
    pod_labels = spec["template"]["metadata"]["labels"]
    terms = spec["template"]["spec"]["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    hostname = [t for t in terms if t["topologyKey"] == "kubernetes.io/hostname"]
    assert hostname, terms
    selector = hostname[0]["labelSelector"]["matchLabels"]
    assert selector.items() <= pod_labels.items(), "the term must select the gateway pods themselves"
    assert selector == spec["selector"]["matchLabels"]


def test_user_affinity_adds_to_the_required_anti_affinity(rendered):
    affinity = sts(rendered["scaled"], GATEWAY)["spec"]["template"]["spec"]["affinity"]
    assert "nodeAffinity" in affinity
    assert affinity["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]


def test_topology_spread_gets_the_component_selector(rendered):
    spec = sts(rendered["scaled"], GATEWAY)["spec"]
    (c,) = spec["template"]["spec"]["topologySpreadConstraints"]
    assert c["labelSelector"]["matchLabels"] == spec["selector"]["matchLabels"]


@pytest.mark.parametrize("name", ALL)
def test_pod_disruption_budgets_allow_one_pod_at_a_time(rendered, name):
    r = rendered[name]
    for component, owner in (("control", CONTROL), ("gateway", GATEWAY)):
        pdb = r.one("PodDisruptionBudget", f"{FULLNAME}-{component}")
        assert pdb["apiVersion"] == "policy/v1"
        assert pdb["spec"]["maxUnavailable"] == 1
        assert "minAvailable" not in pdb["spec"]
        labels = sts(r, owner)["spec"]["template"]["metadata"]["labels"]
        assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()


@pytest.mark.parametrize("name", ALL)
def test_statefulsets_follow_the_contract(rendered, name):
    r = rendered[name]
    values = r.values
    gw = sts(r, GATEWAY)["spec"]
    assert gw["podManagementPolicy"] == "Parallel"
    assert gw["updateStrategy"]["type"] == "RollingUpdate"
    assert gw["replicas"] == values.get("gateway", {}).get("replicas", 2)
    pod = gw["template"]["spec"]
    host_network = values.get("gateway", {}).get("hostNetwork", True)
    assert pod["hostNetwork"] is host_network
    if host_network:
        assert pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    c = container(pod, "gateway")
    assert c["command"] == ["/usr/bin/nvmeof-gateway"]
    assert c["args"] == ["--config", "/etc/nvmeof/$(POD_NAME).toml"]
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in c["env"] if "fieldRef" in e.get("valueFrom", {})}
    assert env == {"POD_NAME": "metadata.name", "HOST_IP": "status.hostIP", "POD_IP": "status.podIP"}

    cp = sts(r, CONTROL)["spec"]
    assert cp["serviceName"] == f"{CONTROL}-hl"
    assert cp["replicas"] == values.get("controlPlane", {}).get("replicas", 2)
    c = container(cp["template"]["spec"], "control")
    assert c["command"] == ["/usr/bin/nvmeof-control"]
    args = c["args"]
    pairs = dict(zip(args[::2], args[1::2]))
    assert pairs["--listen"] == "0.0.0.0:5500"
    assert pairs["--id"] == "$(POD_NAME)"
    assert pairs["--pool"] == "rbd" and pairs["--group"] == "default"
    assert pairs["--ceph-conf"] == "/etc/ceph/ceph.conf" and pairs["--keyring"] == "/etc/ceph/keyring"
    assert pairs["--client-name"] == "client.nvmeof"
    assert pairs["--metrics-listen"] == "0.0.0.0:10010"
    tls = values.get("tls", {}).get("enabled", False)
    assert ("--tls-cert" in args) is tls
    if tls:
        assert (pairs["--tls-cert"], pairs["--tls-key"], pairs["--tls-ca"]) == (
            "/etc/nvmeof/tls/tls.crt", "/etc/nvmeof/tls/tls.key", "/etc/nvmeof/tls/ca.crt")


@pytest.mark.parametrize("name", ALL)
def test_control_plane_services(rendered, name):
    r = rendered[name]
    hl = r.one("Service", f"{CONTROL}-hl")["spec"]
    assert hl["clusterIP"] == "None" and hl["publishNotReadyAddresses"] is True
    svc = r.one("Service", CONTROL)["spec"]
    assert svc["type"] == "ClusterIP"
    assert [(p["name"], p["port"]) for p in svc["ports"]] == [("grpc", 5500)]
    labels = sts(r, CONTROL)["spec"]["template"]["metadata"]["labels"]
    for s in (hl, svc):
        assert s["selector"].items() <= labels.items()


# -------------------------------------------------------------- security --
@pytest.mark.parametrize("name", ALL)
def test_no_privileged_container_unless_asked(rendered, name):
    asked = name == "privileged"
    for owner, spec in pod_specs(rendered[name]):
        for c in spec["containers"] + spec.get("initContainers", []):
            privileged = c.get("securityContext", {}).get("privileged", False)
            assert privileged is (asked and c["name"] == "gateway"), (owner, c["name"])


@pytest.mark.parametrize("name", ALL)
def test_capabilities_all_dropped_ipc_lock_only_with_rdma(rendered, name):
    r = rendered[name]
    rdma = r.values.get("gateway", {}).get("rdma", {}).get("enabled", False)
    for owner, spec in pod_specs(r):
        for c in spec["containers"]:
            sc = c["securityContext"]
            assert sc["capabilities"]["drop"] == ["ALL"], (owner, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (owner, c["name"])
            added = sc["capabilities"].get("add", [])
            assert added == (["IPC_LOCK"] if rdma and c["name"] == "gateway" else []), (owner, c["name"])


@pytest.mark.parametrize("name", ALL)
def test_non_root_where_possible(rendered, name):
    r = rendered[name]
    gw_values = r.values.get("gateway", {})
    gateway_root = gw_values.get("rdma", {}).get("enabled", False) or gw_values.get("privileged", False)
    for owner, spec in pod_specs(r):
        psc = spec["securityContext"]
        if owner == GATEWAY and gateway_root:
            # a capability added for a non-root UID never becomes effective (no ambient caps)
            assert psc["runAsUser"] == 0 and psc["runAsNonRoot"] is False
        else:
            assert psc["runAsNonRoot"] is True and psc["runAsUser"] != 0, owner
        assert psc["seccompProfile"]["type"] == "RuntimeDefault", owner
        assert spec["automountServiceAccountToken"] is False, owner


def test_rdma_requests_the_device_plugin_resource(rendered):
    for name in ALL:
        spec = sts(rendered[name], GATEWAY)["spec"]["template"]["spec"]
        res = container(spec, "gateway")["resources"]
        has = "rdma/hca_shared_devices_a" in res.get("limits", {})
        assert has is (name == "rdma"), name
        if has:
            assert res["requests"]["rdma/hca_shared_devices_a"] == res["limits"]["rdma/hca_shared_devices_a"] == 1


@pytest.mark.parametrize("name", ALL)
def test_secrets_are_mounted_only_where_needed(rendered, name):
    r = rendered[name]
    tls = r.values.get("tls", {})
    keyring = r.values["ceph"].get("keyringSecret", {}).get("name") or f"{FULLNAME}-ceph-keyring"
    control_tls = tls.get("controlSecret") or f"{FULLNAME}-control-tls"
    gateway_tls = tls.get("gatewaySecret") or f"{FULLNAME}-gateway-tls"
    cli_tls = tls.get("cliSecret") or f"{FULLNAME}-cli-tls"
    on = tls.get("enabled", False)
    want = {
        CONTROL: {keyring} | ({control_tls} if on else set()),
        GATEWAY: {keyring} | ({gateway_tls} if on else set()),
        f"{FULLNAME}-test-gateways": {cli_tls} if on else set(),
    }
    for owner, spec in pod_specs(r):
        c = spec["containers"][0]["name"]
        assert mounted_secrets(spec, c) == want[owner], owner


@pytest.mark.parametrize("name", ALL)
def test_keyring_and_ceph_conf_paths(rendered, name):
    r = rendered[name]
    ceph = r.values["ceph"]
    cm_name = ceph.get("existingConfigMap") or f"{FULLNAME}-ceph-conf"
    cm_key = ceph.get("existingConfigMapKey", "ceph.conf") if ceph.get("existingConfigMap") else "ceph.conf"
    for owner in (CONTROL, GATEWAY):
        spec = sts(r, owner)["spec"]["template"]["spec"]
        c = spec["containers"][0]
        mount = next(m for m in c["volumeMounts"] if m["mountPath"] == "/etc/ceph")
        vol = next(v for v in spec["volumes"] if v["name"] == mount["name"])
        sources = vol["projected"]["sources"]
        (conf,) = [s["configMap"] for s in sources if "configMap" in s]
        (secret,) = [s["secret"] for s in sources if "secret" in s]
        assert conf["name"] == cm_name and conf["items"] == [{"key": cm_key, "path": "ceph.conf"}]
        # a missing Secret leaves the pod running and not ready (no ContainerCreating)
        assert secret["optional"] is True
        assert secret["items"] == [{"key": "keyring", "path": "keyring"}]
    cms = [o["metadata"]["name"] for o in r.of_kind("ConfigMap")]
    assert (f"{FULLNAME}-ceph-conf" in cms) is (not ceph.get("existingConfigMap"))


def test_ceph_conf_carries_the_monitors(rendered):
    conf = rendered["defaults"].one("ConfigMap", f"{FULLNAME}-ceph-conf")["data"]["ceph.conf"]
    assert "[global]" in conf
    assert "mon_host = [v2:192.0.2.1:3300,v1:192.0.2.1:6789]" in conf


@pytest.mark.parametrize("name", ALL)
def test_monitors_from_a_secret_reach_both_containers(rendered, name):
    r = rendered[name]
    secret = r.values["ceph"].get("monHostSecret", {}).get("name")
    for owner in (CONTROL, GATEWAY):
        env = sts(r, owner)["spec"]["template"]["spec"]["containers"][0]["env"]
        by_name = {e["name"]: e for e in env}
        if secret:
            assert by_name["CEPH_MON_HOST"]["valueFrom"]["secretKeyRef"] == {"name": secret, "key": "mon_host"}
            assert by_name["CEPH_ARGS"]["value"] == "-m $(CEPH_MON_HOST)"
            # the variable is defined before the one that refers to it
            assert list(by_name).index("CEPH_MON_HOST") < list(by_name).index("CEPH_ARGS")
        else:
            assert "CEPH_ARGS" not in by_name and "CEPH_MON_HOST" not in by_name
    conf = r.one("ConfigMap", f"{FULLNAME}-ceph-conf")["data"]["ceph.conf"] if not r.values["ceph"].get(
        "existingConfigMap") else ""
    assert ("mon_host = " in conf) is bool(r.values["ceph"].get("monHost"))


def test_keyring_secret_only_from_an_inline_key(rendered):
    for name in ALL:
        secrets = rendered[name].of_kind("Secret")
        if name == "inline-keyring":
            (s,) = secrets
            assert s["metadata"]["name"] == f"{FULLNAME}-ceph-keyring"
            assert s["stringData"]["keyring"].splitlines() == [
                "[client.nvmeof]", "    key = AQBvaBFZAAAAABAA9VHgwCgQxwc4Wf8ddGsOeA=="]
        else:
            assert secrets == [], name


# ------------------------------------------------------- gateway config --
GATEWAY_SOURCE = (ROOT / "gateway/src/config/mod.rs").read_text()
KNOWN = {
    "gateway": rust_struct_fields(GATEWAY_SOURCE, "GatewaySection"),
    "group": rust_struct_fields(GATEWAY_SOURCE, "GroupSection"),
    "ceph": rust_struct_fields(GATEWAY_SOURCE, "CephSection"),
    "listener": rust_struct_fields(GATEWAY_SOURCE, "ListenerConfig"),
}
TOP = rust_struct_fields(GATEWAY_SOURCE, "Config")


def test_known_fields_are_read_from_the_gateway_source():
    assert {"name", "cntlid_min", "cntlid_max", "metrics_listen"} <= KNOWN["gateway"]
    assert {"control_plane", "ana_group", "tls_ca"} <= KNOWN["group"]
    assert TOP == {"gateway", "listener", "subsystem", "ceph", "group"}


@pytest.mark.parametrize("name", ALL)
def test_one_toml_per_ordinal_with_only_known_fields(rendered, name):
    r = rendered[name]
    gateways = r.values.get("gateway", {}).get("replicas", 2)
    tomls = gateway_tomls(r)
    assert sorted(tomls) == sorted(f"{GATEWAY}-{i}.toml" for i in range(gateways))
    for key, t in tomls.items():
        assert set(t) <= TOP, key
        for section in ("gateway", "group", "ceph"):
            assert set(t[section]) <= KNOWN[section], (key, section, set(t[section]) - KNOWN[section])
        for listener in t.get("listener", []):
            assert set(listener) <= KNOWN["listener"]
            assert listener["transport"] in ("tcp", "rdma")
        # a group gateway must not offer reservations (the gateway refuses the file)
        assert t["gateway"].get("reservations") is not True


@pytest.mark.parametrize("name", ALL)
def test_each_ordinal_has_its_name_ana_group_and_a_distinct_cntlid_range(rendered, name):
    tomls = gateway_tomls(rendered[name])
    ranges = []
    for i in range(len(tomls)):
        t = tomls[f"{GATEWAY}-{i}.toml"]
        assert t["gateway"]["name"] == f"{GATEWAY}-{i}"  # the pod name: POD_NAME picks the file
        assert t["group"]["ana_group"] == i + 1
        lo, hi = t["gateway"]["cntlid_min"], t["gateway"]["cntlid_max"]
        assert (lo, hi) == (i * 2040 + 1, (i + 1) * 2040)
        assert CNTLID_MIN <= lo <= hi <= CNTLID_MAX
        ranges.append((lo, hi))
    ranges.sort()
    for (_, hi), (lo, _) in zip(ranges, ranges[1:]):
        assert hi < lo, "cntlid ranges overlap"
    assert len({t["group"]["ana_group"] for t in tomls.values()}) == len(tomls)


def test_the_largest_group_still_fits_the_cntlid_space(rendered):
    from conftest import Rendered, merged
    r = Rendered(merged({"gateway": {"replicas": 32}}))
    last = gateway_tomls(r)[f"{GATEWAY}-31.toml"]["gateway"]
    assert last["cntlid_max"] <= CNTLID_MAX


@pytest.mark.parametrize("name", ALL)
def test_control_plane_lists_every_replica(rendered, name):
    r = rendered[name]
    replicas = r.values.get("controlPlane", {}).get("replicas", 2)
    want = [f"{CONTROL}-{i}.{CONTROL}-hl.{NAMESPACE}.svc:5500" for i in range(replicas)]
    for key, t in gateway_tomls(r).items():
        assert t["group"]["control_plane"] == want, key
        tls = r.values.get("tls", {}).get("enabled", False)
        files = {k: t["group"].get(k) for k in ("tls_ca", "tls_cert", "tls_key")}
        if tls:
            assert files == {"tls_ca": "/etc/nvmeof/tls/ca.crt", "tls_cert": "/etc/nvmeof/tls/tls.crt",
                             "tls_key": "/etc/nvmeof/tls/tls.key"}
        else:
            assert files == {"tls_ca": None, "tls_cert": None, "tls_key": None}
        assert t["ceph"] == {**{"conf": "/etc/ceph/ceph.conf", "keyring": "/etc/ceph/keyring",
                                "client_name": "client.nvmeof"},
                             **{k: v for k, v in t["ceph"].items() if k in ("connections", "options")}}


def test_optional_gateway_fields_are_rendered(rendered):
    t = gateway_tomls(rendered["scaled"])[f"{GATEWAY}-3.toml"]
    assert t["gateway"]["worker_threads"] == 4
    assert t["gateway"]["tcp_data_budget"] == "512MiB"
    assert t["group"]["beacon_interval_ms"] == 250
    assert t["group"]["stall_window_ms"] == 3000
    assert t["ceph"]["connections"] == 2
    assert t["ceph"]["options"] == {"rados_osd_op_timeout": 30, "ms_crc_data": False}
    assert t["listener"] == [{"transport": "tcp", "address": "0.0.0.0", "port": 4430}]
    d = gateway_tomls(rendered["defaults"])[f"{GATEWAY}-0.toml"]
    assert "worker_threads" not in d["gateway"] and "listener" not in d
    assert "stall_window_ms" not in d["group"]


@pytest.mark.parametrize("name", ALL)
def test_tls_files_reach_the_gateway_where_its_toml_says(rendered, name):
    r = rendered[name]
    spec = sts(r, GATEWAY)["spec"]["template"]["spec"]
    mount = next(m for m in container(spec, "gateway")["volumeMounts"] if m["mountPath"] == "/etc/nvmeof")
    vol = next(v for v in spec["volumes"] if v["name"] == mount["name"])
    paths = set()
    for src in vol["projected"]["sources"]:
        if "configMap" in src:
            assert src["configMap"]["name"] == f"{GATEWAY}-config"
            paths |= set(gateway_tomls(r))
        if "secret" in src:
            paths |= {i["path"] for i in src["secret"]["items"]}
    for key, t in gateway_tomls(r).items():
        for f in ("tls_ca", "tls_cert", "tls_key"):
            if f in t["group"]:
                assert t["group"][f].removeprefix("/etc/nvmeof/") in paths
        assert key in paths


def leave_timeout_seconds():
    """The planned leave's timeout as the gateway's code has it: `[group] leave_timeout_ms`'s
    default where that field exists, else the constant passed to the leave in main.rs."""
    config = (ROOT / "gateway/src/config/mod.rs").read_text()
    m = re.search(r"DEFAULT_LEAVE_TIMEOUT_MS: u64 = ([0-9_]+);", config)
    if m:
        return int(m.group(1).replace("_", "")) / 1000
    main = (ROOT / "gateway/src/main.rs").read_text()
    m = re.search(r"\.leave\(&\w+, Duration::from_secs\((\d+)\)\)", main)
    assert m, "the planned leave's timeout was found neither in gateway/src/config/mod.rs nor in main.rs"
    return int(m.group(1))


@pytest.mark.parametrize("name", ALL)
def test_grace_period_covers_the_planned_leave(rendered, name):
    grace = sts(rendered[name], GATEWAY)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    for key, toml in gateway_tomls(rendered[name]).items():
        # the leave the file asks for, then closing connections and the images: 10 s more
        assert grace >= toml["group"]["leave_timeout_ms"] / 1000 + 10, key


def test_the_default_leave_timeout_is_the_gateways(rendered):
    for toml in gateway_tomls(rendered["defaults"]).values():
        assert toml["group"]["leave_timeout_ms"] / 1000 == leave_timeout_seconds()


# ------------------------------------------------------------- mTLS --
def test_cert_manager_certificates_cover_every_name_dialled(rendered):
    r = rendered["tls-cert-manager"]
    certs = {c["metadata"]["name"]: c["spec"] for c in r.of_kind("Certificate")}
    control = certs[f"{FULLNAME}-control"]
    dialled = {a.rsplit(":", 1)[0] for t in gateway_tomls(r).values() for a in t["group"]["control_plane"]}
    test_pod = r.one("Pod", f"{FULLNAME}-test-gateways")
    server = next(e["value"] for e in test_pod["spec"]["containers"][0]["env"] if e["name"] == "SERVER")
    dialled.add(server.rsplit(":", 1)[0])
    assert dialled <= set(control["dnsNames"])
    assert "server auth" in control["usages"]
    for who in ("gateway", "cli"):
        assert "client auth" in certs[f"{FULLNAME}-{who}"]["usages"]
    assert {c["secretName"] for c in certs.values()} >= {
        f"{FULLNAME}-control-tls", f"{FULLNAME}-gateway-tls", f"{FULLNAME}-cli-tls"}
    ca = certs[f"{FULLNAME}-ca"]
    assert ca["isCA"] is True
    issuers = {i["metadata"]["name"]: i["spec"] for i in r.of_kind("Issuer")}
    assert issuers[f"{FULLNAME}-ca"]["ca"]["secretName"] == ca["secretName"]
    for name, spec in certs.items():
        want = f"{FULLNAME}-selfsigned" if name == f"{FULLNAME}-ca" else f"{FULLNAME}-ca"
        assert spec["issuerRef"]["name"] == want


def test_an_existing_issuer_signs_and_no_ca_is_made(rendered):
    r = rendered["tls-cert-manager-issuer"]
    assert r.of_kind("Issuer") == []
    certs = r.of_kind("Certificate")
    assert len(certs) == 3
    for c in certs:
        assert c["spec"]["issuerRef"] == {"name": "corp-ca", "kind": "ClusterIssuer", "group": "cert-manager.io"}


def test_existing_secrets_make_no_certificates(rendered):
    assert rendered["tls-existing-secrets"].of_kind("Certificate") == []


# --------------------------------------------------------- monitoring --
def exported_metric_names():
    names = set()
    # The gateway's families are written in gateway/src/metrics and beside what they count
    # (the group agent's in group.rs).
    sources = list((ROOT / "gateway/src").rglob("*.rs")) + [ROOT / "control-plane/src/metrics.rs"]
    for path in sources:
        names |= set(re.findall(r'"(nvmeof_[a-z0-9_]+)"', path.read_text()))
    return names


def test_alerts_use_only_exported_metrics(rendered):
    (rule,) = rendered["monitoring"].of_kind("PrometheusRule")
    exported = exported_metric_names()
    alerts = {}
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            used = set(re.findall(r"\b(nvmeof_[a-z0-9_]+)", r["expr"]))
            assert used, r["alert"]
            for m in used:
                base = re.sub(r"_(bucket|sum|count)$", "", m) if m.endswith(("_bucket", "_sum", "_count")) else m
                assert base in exported, f"{r['alert']}: {m} is not exported by the code"
            assert f'namespace="{NAMESPACE}"' in r["expr"], r["alert"]
            alerts[r["alert"]] = r
    assert {"NvmeofGatewayDown", "NvmeofAnaGroupWithoutOptimizedPath", "NvmeofGatewayBeaconLate",
            "NvmeofReadLatencyHigh", "NvmeofWriteLatencyHigh", "NvmeofGatewayOsdsUnanswered"} <= set(alerts)


def test_monitors_select_the_metrics_ports(rendered):
    r = rendered["monitoring"]
    for sm in r.of_kind("ServiceMonitor"):
        component = sm["metadata"]["labels"]["app.kubernetes.io/component"]
        services = [s for s in r.of_kind("Service")
                    if sm["spec"]["selector"]["matchLabels"].items() <= s["metadata"]["labels"].items()]
        assert services, sm["metadata"]["name"]
        for s in services:
            assert "metrics" in [p["name"] for p in s["spec"]["ports"]], (component, s["metadata"]["name"])
    assert len(r.of_kind("ServiceMonitor")) == 2
    p = rendered["podmonitor-no-hostnetwork"]
    assert len(p.of_kind("PodMonitor")) == 2 and p.of_kind("ServiceMonitor") == []
    assert rendered["defaults"].of_kind("PrometheusRule") == []


def test_network_policies(rendered):
    r = rendered["monitoring"]  # hostNetwork gateways
    (cp,) = r.of_kind("NetworkPolicy")
    grpc = next(i for i in cp["spec"]["ingress"] if i["ports"][0]["port"] == "grpc")
    assert "from" not in grpc, "hostNetwork gateways come from node addresses: no podSelector matches them"
    p = rendered["podmonitor-no-hostnetwork"]
    policies = {n["metadata"]["name"]: n["spec"] for n in p.of_kind("NetworkPolicy")}
    grpc = next(i for i in policies[CONTROL]["ingress"] if i["ports"][0]["port"] == "grpc")
    gw_selector = sts(p, GATEWAY)["spec"]["selector"]["matchLabels"]
    assert {"podSelector": {"matchLabels": gw_selector}} in grpc["from"]
    nvme = next(i for i in policies[GATEWAY]["ingress"] if i["ports"][0]["port"] == "nvme-tcp")
    assert nvme["from"] == [{"ipBlock": {"cidr": "198.51.100.0/24"}}]
    assert rendered["defaults"].of_kind("NetworkPolicy") == []


# ----------------------------------------------------- helm test, NOTES --
@pytest.mark.parametrize("name", ALL)
def test_helm_test_pod_lists_every_gateway(rendered, name):
    r = rendered[name]
    (pod,) = r.hooks
    assert pod["kind"] == "Pod" and pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    c = pod["spec"]["containers"][0]
    assert "/usr/bin/nvmeofctl --server \"$SERVER\" gateway list" in c["args"][0]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["SERVER"] == f"{CONTROL}:5500"
    gateways = r.values.get("gateway", {}).get("replicas", 2)
    assert env["GATEWAYS"].split() == [f"{GATEWAY}-{i}:{i + 1}" for i in range(gateways)]
    assert pod["spec"]["restartPolicy"] == "Never"


def test_notes_print_listeners_and_nvme_lines(rendered):
    for name in ("defaults", "scaled"):
        r = rendered[name]
        gateways = r.values.get("gateway", {}).get("replicas", 2)
        for i in range(gateways):
            assert f"listener add -n nqn.2016-06.io.example:disks -g {GATEWAY}-{i} -a $NODE_IP -p 4420" in r.notes
            assert f"get pod {GATEWAY}-{i} -o jsonpath='{{.status.hostIP}}'" in r.notes
            assert f"nvme discover -t tcp -a <NODE_IP of {GATEWAY}-{i}> -s 4420" in r.notes
            assert f"nvme connect  -t tcp -a <NODE_IP of {GATEWAY}-{i}> -s 4420 -n" in r.notes
