"""Every rendered gateway TOML accepted by the gateway itself (`nvmeof-gateway --check`).

Opt-in: set HELM_TEST_GATEWAY_BIN to a built gateway (e.g. target/release/nvmeof-gateway);
skipped otherwise (this stage compiles nothing). The files the TOML names (ceph.conf, keyring,
TLS files: --check opens them) are replaced by placeholders in a temporary directory."""
import os
import subprocess

import pytest

from conftest import VALUE_SETS

BIN = os.environ.get("HELM_TEST_GATEWAY_BIN", "")
pytestmark = pytest.mark.skipif(not BIN, reason="HELM_TEST_GATEWAY_BIN not set (no gateway binary to run --check)")


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_gateway_accepts_every_rendered_toml(rendered, name, tmp_path):
    r = rendered[name]
    cm = r.one("ConfigMap", "nvmeof-gateway-gateway-config")
    for f in ("ceph.conf", "keyring", "ca.crt", "tls.crt", "tls.key"):
        (tmp_path / f).write_text("placeholder\n")
    failures = []
    for key, text in sorted(cm["data"].items()):
        path = tmp_path / key
        path.write_text(text.replace("/etc/ceph/", f"{tmp_path}/").replace("/etc/nvmeof/tls/", f"{tmp_path}/"))
        proc = subprocess.run([BIN, "--check", "--config", str(path)], capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            failures.append(f"{key}: {(proc.stderr or proc.stdout).strip().splitlines()[-1:]}")
    assert not failures, "\n".join(failures)
