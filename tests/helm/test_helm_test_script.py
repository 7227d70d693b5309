"""The `helm test` pod's script, run with /bin/sh against a stand-in nvmeofctl that prints
what the real one prints (control-plane/src/bin/nvmeofctl/listing.rs: GATEWAY, ANA GROUP,
STATE, LAST BEACON, CNTLID, CLIENTS)."""
import os
import subprocess

import pytest

from conftest import FULLNAME

GATEWAY = f"{FULLNAME}-gateway"
HEADER = "GATEWAY                    ANA GROUP  STATE        LAST BEACON  CNTLID     CLIENTS"


def row(i, state="available"):
    return f"{GATEWAY}-{i}   {i + 1}          {state}    120 ms ago   {i * 2040 + 1}-{(i + 1) * 2040}   0"


def run_test_pod(rendered, tmp_path, listing, exit_code=0):
    pod = rendered["scaled"].hooks[0]  # 4 gateways
    c = pod["spec"]["containers"][0]
    assert c["command"] == ["/bin/sh", "-c"]
    fake = tmp_path / "nvmeofctl"
    (tmp_path / "out").write_text(listing)
    fake.write_text(f"#!/bin/sh\necho \"$@\" > {tmp_path}/argv\ncat {tmp_path}/out\nexit {exit_code}\n")
    fake.chmod(0o755)
    script = c["args"][0].replace("/usr/bin/nvmeofctl", str(fake))
    env = {e["name"]: e["value"] for e in c["env"]}
    proc = subprocess.run(["/bin/sh", "-c", script], env={**env, "PATH": os.environ["PATH"]},
                          capture_output=True, text=True, timeout=30)
    argv = (tmp_path / "argv").read_text().split() if (tmp_path / "argv").exists() else []
    return proc, argv


def test_passes_when_every_gateway_is_listed_and_available(rendered, tmp_path):
    listing = "\n".join([HEADER] + [row(i) for i in range(4)]) + "\n"
    proc, argv = run_test_pod(rendered, tmp_path, listing)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert argv == ["--server", f"{FULLNAME}-control:5500", "gateway", "list"]
    assert "ok: every gateway" in proc.stdout


@pytest.mark.parametrize("listing, reason", [
    ("\n".join([HEADER] + [row(i) for i in range(3)]), f"gateway {GATEWAY}-3 is not listed"),
    ("\n".join([HEADER] + [row(i) for i in (0, 1, 3)] + [row(2, "unavailable")]), f"{GATEWAY}-2: ANA group 3, state unavailable"),
    ("\n".join([HEADER] + [row(i) for i in range(4)]).replace(f"{GATEWAY}-1   2", f"{GATEWAY}-1   7"),
     f"{GATEWAY}-1: ANA group 7"),
    # a name that only starts like an expected one does not count
    ("\n".join([HEADER] + [row(i) for i in (0, 1, 2)] + [row(3).replace(f"{GATEWAY}-3 ", f"{GATEWAY}-30 ")]),
     f"gateway {GATEWAY}-3 is not listed"),
])
def test_fails_when_a_gateway_is_missing_or_not_available(rendered, tmp_path, listing, reason):
    proc, _ = run_test_pod(rendered, tmp_path, listing + "\n")
    assert proc.returncode != 0
    assert reason in proc.stdout, proc.stdout


def test_fails_when_nvmeofctl_fails(rendered, tmp_path):
    proc, _ = run_test_pod(rendered, tmp_path, "", exit_code=3)
    assert proc.returncode != 0
    assert "FAIL: nvmeofctl" in proc.stdout
