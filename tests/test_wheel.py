"""The wheel holds the compiled modules and works from a fresh virtual environment.

Builds a wheel from this checkout, installs it into a new venv (outside the
source tree) and runs the core there, comparing with numpy.
"""

import os
import subprocess
import sys
import zipfile

import pytest

from lossscale import core

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-build-isolation", "--no-deps",
         "-w", str(out), ROOT],
        check=True, cwd=str(out))
    wheels = list(out.glob("lossscale-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def test_wheel_contains_compiled_modules(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("lossscale/_native") and n.endswith(".so") for n in names), names
    tf_built = os.path.exists(os.path.join(ROOT, "lossscale", "_build_info.py"))
    if tf_built:
        assert "lossscale/_lossscale_ops.so" in names, names
        assert "lossscale/_build_info.py" in names, names


def test_wheel_installs_and_runs_in_fresh_venv(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = str(venv / "bin" / "python")
    subprocess.run([py, "-m", "pip", "install", "--quiet", str(wheel)], check=True)
    script = (
        "import os, numpy as np, ml_dtypes, lossscale, lossscale.core as c\n"
        "assert os.path.realpath(lossscale.__file__).startswith(os.path.realpath(%r)), "
        "lossscale.__file__\n"
        "x = np.array([1.5, -3.0, 6e-8, 65504.0], np.float16)\n"
        "ref = x * np.float16(0.5)\n"
        "assert c.unscale_(x, 0.5) is True\n"
        "assert (x.view(np.uint16) == ref.view(np.uint16)).all()\n"
        "b = np.array([1.0, np.inf], ml_dtypes.bfloat16)\n"
        "assert c.all_finite(b) is False\n"
        "print(c.simd_level())\n" % str(venv))
    out = subprocess.run([py, "-c", script], check=True, capture_output=True, text=True,
                         cwd=str(tmp_path))
    assert out.stdout.strip() in core.simd_levels(runnable=False)
