"""Lint with the real Helm v4 library and validate every rendered object against the
Kubernetes OpenAPI schemas (kubernetes-validate, strict: unknown fields are errors)."""
import helm_python
import kubernetes_validate
import pytest

from conftest import BASE, CHART, VALUE_SETS

# The chart's kubeVersion is >=1.25: the oldest and the newest Kubernetes whose schemas
# kubernetes-validate 1.37.0 carries.
KUBE_VERSIONS = ["1.25.0", "1.37.0"]

# Custom resources have no schema in kubernetes-validate: these kinds are skipped (and only
# these: any other kind without a schema fails the test).
CRD_API_GROUPS = {"cert-manager.io", "monitoring.coreos.com"}


def lint_findings(report):
    """Findings that `helm lint --strict` fails on: errors, and warnings (strict)."""
    return [m for m in report["messages"] if m["severity"] >= 2] + [{"error": e} for e in report["errors"]]


@pytest.mark.parametrize("kube_version", ["v" + v for v in KUBE_VERSIONS])
@pytest.mark.parametrize("name", ["defaults", "tls-cert-manager", "rdma", "monitoring", "existing-ceph-configmap"])
def test_lint_strict(name, kube_version):
    report = helm_python.lint(str(CHART), VALUE_SETS[name], strict=True, kube_version=kube_version)
    assert report["total_charts_linted"] == 1
    assert lint_findings(report) == [], report


def test_lint_reports_a_broken_template(tmp_path):
    # The lint above must be able to fail: a chart copy with a template that does not parse.
    with helm_python.Chart.load(str(CHART)) as chart:
        copy_dir = chart.save_dir(tmp_path)
    (tmp_path / "nvmeof-gateway" / "templates" / "broken.yaml").write_text("{{ if }}\n")
    report = helm_python.lint(copy_dir, BASE, strict=True)
    assert lint_findings(report), report


@pytest.mark.parametrize("kube_version", KUBE_VERSIONS)
@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_object_is_valid_kubernetes(rendered, name, kube_version):
    r = rendered[name]
    validated = skipped = 0
    for obj in r.all():
        group = obj["apiVersion"].split("/")[0] if "/" in obj["apiVersion"] else ""
        if group in CRD_API_GROUPS:
            skipped += 1
            continue
        try:
            kubernetes_validate.validate(obj, kube_version, strict=True)
        except kubernetes_validate.ValidationError as e:
            pytest.fail(f"{obj['kind']} {obj['metadata']['name']} is not valid Kubernetes {kube_version}: "
                        f"{'.'.join(str(p) for p in e.path)}: {e.message}")
        validated += 1
    assert validated >= 8, f"only {validated} objects validated"
    if name in ("defaults", "rdma"):
        assert skipped == 0


def test_validation_catches_an_unknown_field():
    # kubernetes-validate in strict mode must refuse what the API server would drop.
    bad = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x", "bogus": 1}, "data": {}}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSIONS[0], strict=True)
