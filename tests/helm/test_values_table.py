"""README.md's values table (from values.yaml's comments) and values.schema.json (from
helm/gen-values-schema.py) are generated and must be current."""
import shutil
import subprocess
import sys

from conftest import CHART, ROOT

GEN = ROOT / "helm" / "gen-values-table.py"


def gen(*args):
    return subprocess.run([sys.executable, str(GEN), *args], capture_output=True, text=True, timeout=60)


def test_readme_values_table_is_current():
    proc = gen("--check", str(CHART))
    assert proc.returncode == 0, proc.stderr + "\n(run helm/gen-values-table.py and commit README.md)"


def test_check_detects_a_stale_table(tmp_path):
    copy = tmp_path / "chart"
    shutil.copytree(CHART, copy)
    values = (copy / "values.yaml").read_text()
    (copy / "values.yaml").write_text(values.replace("# -- Number of gateways", "# -- How many gateways", 1))
    proc = gen("--check", str(copy))
    assert proc.returncode == 1 and "stale" in proc.stderr
    assert gen(str(copy)).returncode == 0  # regenerating fixes it
    assert gen("--check", str(copy)).returncode == 0
    assert "How many gateways" in (copy / "README.md").read_text()


def test_every_value_must_be_documented(tmp_path):
    copy = tmp_path / "chart"
    shutil.copytree(CHART, copy)
    values = (copy / "values.yaml").read_text()
    (copy / "values.yaml").write_text(values.replace("  # -- Host networking", "  # Host networking", 1))
    proc = gen("--check", str(copy))
    assert proc.returncode == 1 and "gateway.hostNetwork has no '# --' description" in proc.stderr


def test_every_table_row_is_a_schema_key():
    table = (CHART / "README.md").read_text().split("<!-- values-table:start -->")[1]
    rows = [line for line in table.splitlines() if line.startswith("| `")]
    assert len(rows) > 100
    assert any(r.startswith("| `gateway.rdma.resourceName` | string |") for r in rows)


def test_values_schema_is_generated_from_its_source():
    proc = subprocess.run([sys.executable, str(ROOT / "helm" / "gen-values-schema.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr + "\n(edit helm/gen-values-schema.py, run it, commit both)"
