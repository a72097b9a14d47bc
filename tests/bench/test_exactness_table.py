"""`benchmarks/exactness_table.py`: the exactness tests' recorded differences, read back from
pytest's own JUnit XML, per dtype, failures marked."""

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]


def test_the_table_reads_what_pytest_recorded(tmp_path):
    (tmp_path / "test_fake.py").write_text(
        "import pytest\n"
        "@pytest.mark.parametrize('case', ['a-orca', 'b-patched'])\n"
        "def test_x(case, record_property):\n"
        "    error = {'a-orca': 0.0, 'b-patched': 0.5}[case]\n"
        "    record_property('max_error', error)\n"
        "    assert error <= 0.1\n")
    xml = tmp_path / "float32.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_fake.py"),
                    f"--junitxml={xml}"], cwd=tmp_path, capture_output=True)
    runpy.run_path(str(ROOT / "benchmarks" / "exactness_table.py"), run_name="not-main")["main"](
        str(tmp_path / "out.json"), str(xml), str(tmp_path / "bfloat16.xml"))  # the second never ran
    data = json.loads((tmp_path / "out.json").read_text())
    assert data == {"float32": {"a-orca": {"max_error": 0.0, "passed": True},
                                "b-patched": {"max_error": 0.5, "passed": False}}}
    table = (tmp_path / "out.md").read_text()
    assert "| a-orca | 0.00e+00 |" in table and "| b-patched | 5.00e-01 (failed) |" in table
