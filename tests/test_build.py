"""The build's decisions, without building: which TensorFlow the backend asks
for, what a wheel's metadata pins, that running setup.py does no work, and
``python -m lossscale`` on this checkout in both states of the op library.

The builds themselves (a wheel, an isolated ``pip install .``) are in
``test_wheel.py``.
"""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "build_backend"))
import lossscale_backend as backend  # noqa: E402

ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="")


def pinned_minor():
    """The TensorFlow minor requirements-dev.in allows (and its lock, what CI
    installs, pins)."""
    with open(os.path.join(ROOT, "requirements-dev.in")) as f:
        pins = re.findall(r"^tensorflow==(\d+\.\d+)\.\*$", f.read(), re.M)
    with open(os.path.join(ROOT, "requirements-dev.txt")) as f:
        locked = re.findall(r"^tensorflow==(\d+\.\d+)\.\d+$", f.read(), re.M)
    assert locked == pins, (locked, pins)
    assert len(pins) == 1, pins
    return pins[0]


def test_supported_minor_is_the_one_ci_tests():
    assert backend.TENSORFLOW_MINOR == pinned_minor()


def test_requires_tensorflow_only_when_no_environment_has_it(monkeypatch):
    monkeypatch.delenv(backend.BUILD_OPS_ENV, raising=False)
    base = backend._setuptools.get_requires_for_build_wheel()
    # This environment has TensorFlow: build against it, ask for nothing.
    assert backend.get_requires_for_build_wheel() == base
    # Neither the build nor the target environment has it (an isolated
    # build into an environment without TensorFlow): ask for the supported one.
    monkeypatch.setattr(backend, "tensorflow_installed", lambda: False)
    assert backend.get_requires_for_build_wheel() == \
        base + [f"tensorflow=={pinned_minor()}.*"]
    assert backend.get_requires_for_build_editable()[-1] == f"tensorflow=={pinned_minor()}.*"
    monkeypatch.setenv(backend.BUILD_OPS_ENV, "0")
    assert backend.get_requires_for_build_wheel() == base


def test_target_environment_seen_through_isolation(tmp_path):
    """Under pip's isolation the interpreter's own site-packages are off
    sys.path; the backend still finds the target's TensorFlow there."""
    # setuptools comes from site-packages too: import the backend, then
    # hide site-packages as pip's isolation does.
    code = ("import sys, sysconfig\n"
            f"sys.path.insert(0, {os.path.join(ROOT, 'build_backend')!r})\n"
            "import lossscale_backend as b\n"
            "sys.path[:] = [p for p in sys.path if 'site-packages' not in p]\n"
            "import importlib.util\n"
            "assert importlib.util.find_spec('tensorflow') is None\n"
            "print(b.tensorflow_installed())\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=str(tmp_path), timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True"


@pytest.mark.parametrize("version,requirement", [
    ("2.21.0", "tensorflow>=2.21,<2.22"),
    ("2.9.3", "tensorflow>=2.9,<2.10"),
    ("2.22.0rc1", "tensorflow>=2.22,<2.23"),
])
def test_wheel_requirement_is_one_minor(version, requirement):
    assert backend.tensorflow_requirement(version) == requirement


def test_running_setup_py_does_no_work(tmp_path):
    """Describing the project (what pip's get_requires/sdist steps do) imports
    no TensorFlow, generates no C and writes no build record (setuptools
    itself imports Cython when it is installed)."""
    watched = [os.path.join(ROOT, "lossscale", n) for n in ("_build_info.py", "_native.c")]
    before = {p: os.stat(p).st_mtime_ns for p in watched if os.path.exists(p)}
    code = ("import runpy, sys\n"
            "sys.argv = ['setup.py', '--name', '--version']\n"
            "runpy.run_path('setup.py', run_name='__main__')\n"
            "print(sorted(m for m in ('tensorflow', 'keras', 'numpy') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, env=ENV, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["lossscale", "0.1.0", "[]"]
    assert {p: os.stat(p).st_mtime_ns for p in watched if os.path.exists(p)} == before


def tensorflow_version():
    from importlib.metadata import version

    return version("tensorflow")


def run_main(**env):
    done = subprocess.run([sys.executable, "-m", "lossscale"], capture_output=True, text=True,
                          cwd=ROOT, env=dict(ENV, **env), timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.splitlines()


@pytest.mark.skipif(not os.path.exists(os.path.join(ROOT, "lossscale", "_build_info.py")),
                    reason="the op library is not built in place")
def test_python_m_lossscale_with_the_op_library():
    from importlib.metadata import version

    from lossscale import core

    lines = run_main(LOSSSCALE_SIMD="scalar")
    assert lines[0].startswith("lossscale 0.1.0 ")
    assert lines[2] == f"kernel set: scalar (best on this CPU: {core.simd_best()})", lines
    assert lines[3] == f"threads: {os.cpu_count()}"
    assert lines[4] == f"TensorFlow: {tensorflow_version()} (op library built for: " \
                       f"{tensorflow_version()})"
    assert lines[5] == f"Keras: {version('keras')}"
    assert lines[6] == "TensorFlow op library: loaded (" + \
        os.path.join(ROOT, "lossscale", "_lossscale_ops.so") + ")"
    assert len(lines) == 7


def test_python_m_lossscale_without_the_op_library():
    lines = run_main(LOSSSCALE_FORCE_FALLBACK="1")
    assert lines[-2] == ("TensorFlow op library: NOT loaded (forced by LOSSSCALE_FORCE_FALLBACK); "
                         "lossscale.ops uses plain TensorFlow ops")
    assert lines[-1] == "to fix: unset LOSSSCALE_FORCE_FALLBACK"


def test_fix_command_for_a_checkout(monkeypatch):
    """Imported from this checkout, the fix is to rebuild it in place."""
    import shlex

    from lossscale import _loader

    for reason in ("library not found", "built for TensorFlow 2.3.0, running 2.21.0"):
        assert _loader.fix_command(reason) == (
            f"cd {shlex.quote(ROOT)} && {shlex.quote(sys.executable)} "
            "setup.py --quiet build_ext --inplace")


WHEEL = "/dist/lossscale-0.1.0-cp311-cp311-manylinux_2_35_x86_64.whl"


@pytest.mark.parametrize("source,reason,fix", [
    # A wheel for another TensorFlow: install the TensorFlow it was built for.
    (WHEEL, "built for TensorFlow 2.21.0, running 2.20.0", "-m pip install 'tensorflow>=2.21,<2.22'"),
    (None, "built for TensorFlow 2.21.0, running 2.22.1", "-m pip install 'tensorflow>=2.21,<2.22'"),
    (WHEEL, "TensorFlow cannot be imported (x)", "-m pip install 'tensorflow>=2.21,<2.22'"),
    # Built from a directory or an sdist: rebuild from it, not from pip's cache.
    ("/src/lossscale", "built for TensorFlow 2.21.0, running 2.20.0",
     "-m pip install --force-reinstall --no-deps --no-cache-dir /src/lossscale"),
    ("/dl/lossscale 0.1.0.tar.gz", "load error: x",
     "-m pip install --force-reinstall --no-deps --no-cache-dir '/dl/lossscale 0.1.0.tar.gz'"),
    # A wheel whose library cannot be used at all: build from source.
    (WHEEL, "load error: x",
     "-m pip install --force-reinstall --no-deps --no-cache-dir --no-binary lossscale lossscale"),
])
def test_fix_command_for_an_installed_package(monkeypatch, source, reason, fix):
    import shlex

    from lossscale import _loader

    monkeypatch.setattr(_loader, "_checkout", lambda: None)
    monkeypatch.setattr(_loader, "_installed_from", lambda: source)
    monkeypatch.setattr(_loader, "_recorded_tf_version", lambda: "2.21.0")
    assert _loader.fix_command(reason) == f"{shlex.quote(sys.executable)} {fix}"


# ------------------------------------------------ one list, one default


def load_kernel_sets():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "kernel_sets", os.path.join(ROOT, "_core", "kernel_sets.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_kernel_set_list_reads_every_entry():
    """_core/kernel_sets.py reads each entry of _core/src/kernel_sets.def,
    the list the C table expands: as many entries as the file has, each
    with a known arch, scalar last and built everywhere."""
    module = load_kernel_sets()
    with open(module.LIST) as f:
        text = f.read()
    body = text[text.index("*/") + 2:]  # the entries, after the file's comment
    entries = module.read_list()
    assert len(entries) == body.count("LS_KERNEL_SET(")
    assert entries[-1]["name"] == "scalar" and entries[-1]["arch"] == "ANY"
    assert all(e["flags"] == [] or e["arch"] != "ANY" for e in entries)
    assert [name for name, _ in module.sets_for("aarch64")] == ["neon", "scalar"]


def test_kernel_set_list_refuses_an_entry_it_cannot_read(tmp_path):
    module = load_kernel_sets()
    bad = tmp_path / "kernel_sets.def"
    bad.write_text('LS_KERNEL_SET(scalar, ANY, 0, scalar, scalar, "")\n'
                   'LS_KERNEL_SET(sve, ARM64, CPU_SVE, sve, sve, SVE_FLAGS)\n')
    with pytest.raises(ValueError, match="not of the form"):
        module.read_list(str(bad))
    bad.write_text('LS_KERNEL_SET(sve, RISCV, CPU_V, sve, sve, "")\n')
    with pytest.raises(ValueError, match="unknown arch"):
        module.read_list(str(bad))


def test_python_defaults_are_the_cores():
    """The initial loss scale and growth period: written in lossscale.h,
    copied by the Python layer."""
    from lossscale import _config, _native

    assert _native.DEFAULT_LOSS_SCALE == _config.DEFAULT_INITIAL_SCALE == 2.0**15
    assert _native.DEFAULT_INCREMENT_PERIOD == _config.DEFAULT_GROWTH_STEPS
