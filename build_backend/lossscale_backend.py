"""lossscale's PEP 517 build backend: setuptools, plus the TensorFlow the op library is built against.

The TensorFlow op library has no stable ABI: it works with the TensorFlow
minor it was compiled against and no other.  So a wheel must be built
against the TensorFlow it will run with.  Under build isolation (plain
``pip install .``) the build environment is not the target one; like
DeePMD-kit's backend, ``get_requires_for_build_wheel`` looks for TensorFlow
in the target environment and, when there is none, asks for the minor this
release supports as a build requirement.  ``tensorflow_for_build()`` (used
by ``setup.py``) then finds the TensorFlow to compile against: the build
environment's, else the target environment's.  ``LOSSSCALE_BUILD_TF_OPS=0``
builds ``lossscale.core`` only.  Everything else is setuptools' own backend.
"""

import json
import os
import subprocess
import sys
import sysconfig
from importlib.machinery import PathFinder

from setuptools import build_meta as _setuptools
from setuptools.build_meta import *  # noqa: F401,F403  (the hooks not wrapped here)

# The TensorFlow minor this release supports (requirements-dev.in allows the same).
TENSORFLOW_MINOR = "2.21"
BUILD_OPS_ENV = "LOSSSCALE_BUILD_TF_OPS"

# Set by pip's isolated build environment to hide the target environment.
_ISOLATION_ENV = ("PYTHONPATH", "PYTHONNOUSERSITE", "PYTHONHOME")

_PROBE = (
    "import json, tensorflow as tf\n"
    "print(json.dumps([tf.__version__, tf.sysconfig.get_compile_flags(),"
    " tf.sysconfig.get_link_flags()]))\n"
)


def ops_wanted():
    return os.environ.get(BUILD_OPS_ENV, "1") != "0"


def _target_site_dirs():
    """site-packages of the environment being installed into (pip runs the
    build with its interpreter even when isolation hides its packages)."""
    paths = sysconfig.get_paths()
    return list(dict.fromkeys(paths[k] for k in ("purelib", "platlib")))


def tensorflow_installed():
    """Whether the build or the target environment has TensorFlow."""
    if PathFinder.find_spec("tensorflow") is not None:
        return True
    return PathFinder.find_spec("tensorflow", _target_site_dirs()) is not None


def _probe(env):
    env = dict(env, TF_CPP_MIN_LOG_LEVEL="3")
    try:
        out = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True,
                             text=True, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, str(exc)
    if out.returncode != 0:
        lines = out.stderr.strip().splitlines()
        return None, lines[-1] if lines else f"exit status {out.returncode}"
    version, cflags, lflags = json.loads(out.stdout.strip().splitlines()[-1])
    return {"version": version, "compile_flags": cflags, "link_flags": lflags}, None


_found = None


def tensorflow_for_build():
    """``(info, why_not)``: the TensorFlow to compile the op library against
    (``{"version", "compile_flags", "link_flags"}``), or None and the reason.

    TensorFlow is imported in a child process, first as this process sees
    the world (build requirements, or everything without isolation), then
    as the target environment does (pip's isolation variables dropped)."""
    global _found
    if _found is None:
        _found = _find_tensorflow()
    return _found


def _find_tensorflow():
    if not ops_wanted():
        return None, f"{BUILD_OPS_ENV}=0"
    info, why = _probe(os.environ)
    if info is None and any(k in os.environ for k in _ISOLATION_ENV):
        clean = {k: v for k, v in os.environ.items() if k not in _ISOLATION_ENV}
        info, _ = _probe(clean)
    return (info, None) if info is not None else (None, f"TensorFlow not importable: {why}")


def minor_of(version):
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def tensorflow_requirement(version):
    """The requirement a wheel built against TensorFlow ``version`` carries."""
    major, minor = minor_of(version)
    return f"tensorflow>={major}.{minor},<{major}.{minor + 1}"


def _with_tensorflow(requires):
    if ops_wanted() and not tensorflow_installed():
        return list(requires) + [f"tensorflow=={TENSORFLOW_MINOR}.*"]
    return list(requires)


def get_requires_for_build_wheel(config_settings=None):
    return _with_tensorflow(_setuptools.get_requires_for_build_wheel(config_settings))


def get_requires_for_build_editable(config_settings=None):
    return _with_tensorflow(_setuptools.get_requires_for_build_editable(config_settings))
