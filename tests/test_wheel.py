"""Installing lossscale as its users do, into fresh virtual environments outside the source tree.

* ``make wheel``'s artefacts (``tools/wheel.sh``): the sdist holds every
  source and no build product; the wheel is manylinux-tagged, holds both
  modules, grafts none of TensorFlow's libraries and pins the TensorFlow
  minor it was built against.  Installed with no compiler on ``PATH`` it
  loads the native op, and optimizer steps equal stock Keras' bit for bit.
* An isolated ``pip install .`` into an environment with TensorFlow builds
  the op library against that TensorFlow and loads it.
* A core-only build (``LOSSSCALE_BUILD_TF_OPS=0``) of this tree, which
  ``make`` has built in place, ships no op library and no pin, and says so
  on the terminal without ``-v``.
* The wheel refuses to install beside another TensorFlow minor; forced in,
  it falls back, and the warning and ``python -m lossscale`` give the fix.

The environment with TensorFlow gets requirements-dev.txt's TensorFlow; the
one with another minor gets stand-in ``tensorflow``/``keras`` distributions,
so nothing large is downloaded twice.  Minutes: built and installed once per
module, several checks on each.
"""

import base64
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import zipfile
from importlib.metadata import version

import pytest

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3", CUDA_VISIBLE_DEVICES="",
           PIP_DISABLE_PIP_VERSION_CHECK="1")
ENV.pop("PYTHONPATH", None)
# The stub TensorFlow of another minor is outside make test's lock on purpose.
UNLOCKED = {k: v for k, v in ENV.items() if k != "PIP_CONSTRAINT"}
BUILT_TF = version("tensorflow")   # what tools/wheel.sh builds against: this environment's
MAJOR, MINOR = (int(p) for p in BUILT_TF.split(".")[:2])
PIN = f"tensorflow<{MAJOR}.{MINOR + 1},>={MAJOR}.{MINOR}"


def sh(args, timeout=900, check=True, **kw):
    kw.setdefault("env", ENV)
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, **kw)
    if check:
        assert done.returncode == 0, (args, done.stdout[-3000:], done.stderr[-3000:])
    return done


def new_venv(path):
    sh([sys.executable, "-m", "venv", str(path)])
    return str(path / "bin" / "python")


def requirement(name):
    """``name``'s pin in the lock (which writes names normalised: ml-dtypes)."""
    normalised = re.sub(r"[-_.]+", "-", name).lower()
    with open(os.path.join(ROOT, "requirements-dev.txt")) as f:
        return next(line.strip() for line in f if re.match(rf"{normalised}==", line))


class Release:
    """tools/wheel.sh, started at once so that it builds while a venv installs."""

    def __init__(self, out):
        self.out = out
        self.log = open(out / "build.log", "w+")
        self.proc = subprocess.Popen(
            ["sh", os.path.join(ROOT, "tools", "wheel.sh"), str(out / "dist")],
            env=dict(ENV, PY=sys.executable), stdout=self.log, stderr=subprocess.STDOUT)

    def artefacts(self):
        rc = self.proc.wait(timeout=1800)
        self.log.seek(0)
        assert rc == 0, self.log.read()[-5000:]
        dist = self.out / "dist"
        (wheel,) = dist.glob("lossscale-*.whl")
        (sdist,) = dist.glob("lossscale-*.tar.gz")
        return wheel, sdist


@pytest.fixture(scope="module")
def release_build(tmp_path_factory):
    build = Release(tmp_path_factory.mktemp("release"))
    yield build
    if build.proc.poll() is None:   # no test needed the artefacts after all
        build.proc.kill()
        build.proc.wait()
    build.log.close()


@pytest.fixture(scope="module")
def release(release_build, tf_venv):
    # tf_venv first: it installs while the release builds.
    return release_build.artefacts()


@pytest.fixture(scope="module")
def tf_venv(tmp_path_factory, release_build):
    """A fresh venv with the supported TensorFlow and Keras, nothing else."""
    py = new_venv(tmp_path_factory.mktemp("tf") / "venv")
    sh([py, "-m", "pip", "install", "--quiet", requirement("tensorflow"), requirement("keras")],
       timeout=1800)
    return py


def wheel_names(wheel):
    return zipfile.ZipFile(wheel).namelist()


def wheel_text(wheel, name):
    return zipfile.ZipFile(wheel).read(name).decode()


# ------------------------------------------------------------ make wheel

def test_sdist_holds_the_sources_and_no_build_product(release):
    _, sdist = release
    names = {n.split("/", 1)[1] for n in tarfile.open(sdist).getnames() if "/" in n}
    for needed in ("setup.py", "pyproject.toml", "README.md", "MANIFEST.in",
                   "build_backend/lossscale_backend.py", "_core/kernel_sets.py",
                   "_core/include/lossscale.h", "lossscale/_native.pyx",
                   "lossscale/__main__.py"):
        assert needed in names, needed
    assert any(n.startswith("_core/tf/") and n.endswith(".cc") for n in names)
    assert any(n.startswith("_core/src/kernels_") for n in names)
    built = [n for n in names if n.endswith((".so", ".o")) or
             n in ("lossscale/_build_info.py", "lossscale/_native.c")]
    assert built == []


def test_wheel_is_manylinux_and_pins_its_tensorflow(release):
    wheel, _ = release
    assert re.fullmatch(rf"lossscale-0\.1\.0-cp3\d+-cp3\d+-manylinux_2_\d+_{platform.machine()}"
                        r"\.whl", wheel.name), wheel.name
    names = wheel_names(wheel)
    assert "lossscale/_lossscale_ops.so" in names
    assert any(re.fullmatch(r"lossscale/_native\..*\.so", n) for n in names), names
    assert "lossscale/__main__.py" in names
    # Nothing grafted: TensorFlow's libraries come from the TensorFlow the
    # op library is loaded into.
    assert not [n for n in names if ".libs/" in n], names
    assert wheel_text(wheel, "lossscale/_build_info.py").splitlines()[-1] == \
        f"TF_VERSION = {BUILT_TF!r}"
    metadata = wheel_text(wheel, "lossscale-0.1.0.dist-info/METADATA")
    tf_reqs = re.findall(r"^Requires-Dist: (tensorflow\S*); extra == \"tensorflow\"$",
                         metadata, re.M)
    assert tf_reqs == [PIN], tf_reqs
    assert not re.search(r"^Requires-Dist: tensorflow\S*$", metadata, re.M)


SMOKE = r'''
import os, sys
import numpy as np
import keras
import tensorflow as tf
import lossscale
from lossscale import core, ops

assert os.path.realpath(lossscale.__file__).startswith(os.path.realpath(sys.prefix)), \
    lossscale.__file__
status = ops.native_available()
assert status, status.reason

x = np.array([1.5, -3.0, 6e-8, 65504.0], np.float16)
ref = x * np.float16(0.5)
assert core.unscale_(x, 0.5) is True and (x.view(np.uint16) == ref.view(np.uint16)).all()


def train(make):
    w = keras.Variable(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4))
    b = keras.Variable(np.full(4, 0.25, np.float32))
    opt = make(keras.optimizers.SGD(0.1))
    rng = np.random.default_rng(0)
    for step in range(4):
        gw = (rng.standard_normal((3, 4)) * 3000).astype(np.float32)
        gb = (rng.standard_normal(4) * 3000).astype(np.float32)
        if step == 2:
            gw[1, 1] = np.inf
        opt.apply([tf.constant(gw), tf.constant(gb)], [w, b])
    return [w.numpy(), b.numpy(), np.float32(opt.dynamic_scale.numpy())]


ours = train(lossscale.LossScaleOptimizer)
stock = train(keras.optimizers.LossScaleOptimizer)
for a, b in zip(ours, stock):
    assert a.tobytes() == b.tobytes(), (a, b)
print("smoke ok")
'''


def run_smoke(py, cwd):
    script = cwd / "smoke.py"
    script.write_text(SMOKE)
    done = sh([py, str(script)], cwd=str(cwd), timeout=600)
    assert done.stdout.strip().splitlines()[-1] == "smoke ok"


def python_m_lossscale(py, cwd, **env):
    return sh([py, "-m", "lossscale"], cwd=str(cwd), env=dict(ENV, **env),
              timeout=600).stdout.splitlines()


def test_wheel_installs_without_compiler_and_equals_stock(release, tf_venv, tmp_path):
    wheel, _ = release
    bindir = os.path.dirname(tf_venv)
    no_compiler = dict(ENV, PATH=bindir, CC="/nonexistent/cc", CXX="/nonexistent/c++")
    for compiler in ("cc", "gcc", "c++", "g++", "clang"):
        assert shutil.which(compiler, path=bindir) is None
    sh([tf_venv, "-m", "pip", "uninstall", "--quiet", "--yes", "lossscale"])
    # --no-index: numpy and ml_dtypes came with TensorFlow; nothing is fetched or built.
    sh([tf_venv, "-m", "pip", "install", "--quiet", "--no-index", str(wheel)],
       env=no_compiler, cwd=str(tmp_path))
    run_smoke(tf_venv, tmp_path)

    venv_tf = sh([tf_venv, "-c", "import importlib.metadata as m; print(m.version('tensorflow'))"]
                 ).stdout.strip()
    lines = python_m_lossscale(tf_venv, tmp_path)
    assert lines[0].startswith("lossscale 0.1.0 ")
    assert f"TensorFlow: {venv_tf} (op library built for: {BUILT_TF})" in lines
    assert [n for n in lines if n.startswith("TensorFlow op library: loaded (")], lines
    assert not [n for n in lines if n.startswith("to fix")], lines


def test_isolated_pip_install_of_the_checkout_builds_the_op(tf_venv, tmp_path):
    """Plain `pip install .`: build isolation hides the target's TensorFlow
    from the build; the backend finds it and builds against it."""
    sh([tf_venv, "-m", "pip", "install", "--quiet", "--force-reinstall", "--no-deps", ROOT],
       cwd=str(tmp_path), timeout=1800)
    run_smoke(tf_venv, tmp_path)
    code = ("import importlib.metadata as m, lossscale._build_info as b, lossscale._loader as l\n"
            "print(b.TF_VERSION == m.version('tensorflow'))\n"
            "print(l.fix_command('library not found'))\n")
    out = sh([tf_venv, "-c", code], cwd=str(tmp_path)).stdout.splitlines()
    assert out[0] == "True"
    # Were it to go wrong later, the fix rebuilds from where it came from.
    assert out[1] == (f"{shlex.quote(tf_venv)} -m pip install --force-reinstall --no-deps "
                      f"--no-cache-dir {shlex.quote(ROOT)}")


# ------------------------------------------------------------ core-only build

@pytest.mark.skipif(shutil.which("script") is None, reason="needs script(1) for a terminal")
def test_core_only_build_says_so_and_ships_nothing_stale(tmp_path):
    """pip hides a build's output without -v; the line that the op library
    is not built reaches the terminal anyway.  The in-place op library and
    build record in this tree must not reach the wheel."""
    out = tmp_path / "out"
    command = " ".join(shlex.quote(a) for a in [
        "env", "LOSSSCALE_BUILD_TF_OPS=0", sys.executable, "-m", "pip", "wheel", "--quiet",
        "--no-build-isolation", "--no-deps", "-w", str(out), ROOT])
    done = sh(["script", "-qec", command, "/dev/null"], cwd=str(tmp_path), timeout=1800)
    assert ("lossscale: the TensorFlow op library is NOT built (LOSSSCALE_BUILD_TF_OPS=0)"
            in done.stdout), done.stdout[-3000:]
    (wheel,) = out.glob("lossscale-*.whl")
    names = wheel_names(wheel)
    assert any(re.fullmatch(r"lossscale/_native\..*\.so", n) for n in names), names
    assert "lossscale/_lossscale_ops.so" not in names
    assert "lossscale/_build_info.py" not in names
    metadata = wheel_text(wheel, "lossscale-0.1.0.dist-info/METADATA")
    tf_reqs = re.findall(r"^Requires-Dist: (tensorflow\S*)", metadata, re.M)
    assert tf_reqs and all("<" not in r for r in tf_reqs), tf_reqs


# ------------------------------------------------------------ another TensorFlow minor

def stub_wheel(directory, name, dist_version, source):
    """A wheel of a one-module distribution ``name`` (a stand-in for a big one)."""
    info = f"{name}-{dist_version}.dist-info"
    files = {
        f"{name}/__init__.py": source,
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {dist_version}\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: stub\nRoot-Is-Purelib: true\n"
                         "Tag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        data = text.encode()
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    files[f"{info}/RECORD"] = "\n".join(record + [f"{info}/RECORD,,"]) + "\n"
    path = directory / f"{name}-{dist_version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name_in, text in files.items():
            z.writestr(name_in, text)
    return path


@pytest.fixture(scope="module")
def other_minor_venv(tmp_path_factory):
    """A venv whose TensorFlow is the minor before the one the wheel is built for."""
    base = tmp_path_factory.mktemp("other")
    stubs = base / "stubs"
    stubs.mkdir()
    other = f"{MAJOR}.{MINOR - 1}.0"
    stub_wheel(stubs, "tensorflow", other, f"__version__ = {other!r}\n")
    stub_wheel(stubs, "keras", "3.15.0", "__version__ = '3.15.0'\n")
    py = new_venv(base / "venv")
    sh([py, "-m", "pip", "install", "--quiet", requirement("numpy"), requirement("ml_dtypes")],
       timeout=1800)
    sh([py, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(stubs),
        "tensorflow", "keras"], env=UNLOCKED)
    return py, stubs, other


def test_wheel_refuses_another_tensorflow_minor(release, other_minor_venv, tmp_path):
    wheel, _ = release
    py, stubs, other = other_minor_venv
    done = sh([py, "-m", "pip", "install", "--no-index", "--find-links", str(stubs),
               f"lossscale[tensorflow] @ {wheel.as_uri()}"], cwd=str(tmp_path), check=False,
              env=UNLOCKED)
    assert done.returncode != 0
    assert PIN in done.stdout + done.stderr, done.stdout + done.stderr
    installed = sh([py, "-m", "pip", "list", "--format=freeze"]).stdout
    assert f"tensorflow=={other}" in installed and "lossscale" not in installed


def test_wheel_forced_beside_another_minor_falls_back_with_the_fix(release, other_minor_venv,
                                                                    tmp_path):
    wheel, _ = release
    py, _, other = other_minor_venv
    sh([py, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--force-reinstall",
        str(wheel)], cwd=str(tmp_path), env=UNLOCKED)
    fix = f"{shlex.quote(py)} -m pip install 'tensorflow>={MAJOR}.{MINOR},<{MAJOR}.{MINOR + 1}'"
    reason = f"built for TensorFlow {BUILT_TF}, running {other}"
    code = ("import warnings\n"
            "from lossscale import _loader\n"
            "with warnings.catch_warnings(record=True) as caught:\n"
            "    warnings.simplefilter('always')\n"
            "    module, reason = _loader.load()\n"
            "print(module, reason, sep='\\n')\n"
            "print(*[str(w.message) for w in caught], sep='\\n')\n")
    out = sh([py, "-c", code], cwd=str(tmp_path)).stdout.splitlines()
    assert out[:2] == ["None", reason]
    assert len(out) == 3 and out[2].endswith(f"To use the native ops: {fix}"), out
    assert reason in out[2]

    lines = python_m_lossscale(py, tmp_path)
    assert f"TensorFlow: {other} (op library built for: {BUILT_TF})" in lines
    assert "Keras: 3.15.0" in lines
    assert f"TensorFlow op library: NOT loaded ({reason}); " \
           "lossscale.ops uses plain TensorFlow ops" in lines
    assert lines[-1] == f"to fix: {fix}"
