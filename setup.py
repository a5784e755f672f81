"""Build of lossscale's native parts.

Two extension modules share one C core (``_core/``):

* ``lossscale._native`` — Cython bindings over numpy;
* ``lossscale/_lossscale_ops.so`` — the TensorFlow custom-op library, built
  against the TensorFlow that ``build_backend/lossscale_backend.py`` finds
  (the build environment's, else the target environment's), and recorded in
  ``lossscale/_build_info.py`` and in the wheel's ``tensorflow`` extra.

The core's per-ISA kernel files are compiled once each with their own
``-m`` flags; nothing else gets ISA flags, so the modules load on any
x86-64 (or aarch64) CPU and pick their kernels at run time.

Running this file only describes the build: TensorFlow is looked for, and
files are written, by the commands that need them (``build_ext``, and
``egg_info``/``dist_info`` for a wheel's metadata).
"""

import atexit
import os
import shutil
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build import build
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py
from setuptools.command.egg_info import egg_info

HERE = os.path.dirname(os.path.abspath(__file__))
CORE = os.path.join("_core", "src")
INCLUDE = os.path.join("_core", "include")
TF_DIR = os.path.join("_core", "tf")
BUILD_INFO = "_build_info"

sys.path[:0] = [os.path.join(HERE, "_core"), os.path.join(HERE, "build_backend")]
import kernel_sets  # noqa: E402  (reads the one list of kernel sets, _core/src/kernel_sets.def)
import lossscale_backend as backend  # noqa: E402  (which TensorFlow to build against)

COMMON_CFLAGS = kernel_sets.COMMON_CFLAGS

# Needs of the Python TensorFlow layer; the native op adds a pin to one minor.
TENSORFLOW_EXTRA = ["tensorflow>=2.21", "keras>=3.12"]
EXTRAS = {
    "tensorflow": TENSORFLOW_EXTRA,
    "test": ["pytest", "scikit-learn", *TENSORFLOW_EXTRA],
    "bench": ["pytest-benchmark", "torch==2.13.0", "matplotlib"],
}


def notice(message):
    """A line the user sees even when pip captures the build's output
    (shown only with -v): also written to the terminal, when there is one."""
    line = f"lossscale: {message}\n"
    sys.stderr.write(line)
    sys.stderr.flush()
    if sys.stderr.isatty():
        return
    try:
        with open("/dev/tty", "w") as tty:
            tty.write(line)
    except OSError:
        pass


class BuildWithCore(build_ext):
    """Compiles the C core (per-file ISA flags) and links it into every
    extension; adds the TensorFlow op library when a TensorFlow was found."""

    def run(self):
        import numpy as np

        native = next(e for e in self.extensions if e.name == "lossscale._native")
        native.include_dirs.append(np.get_include())
        tf, why_not = backend.tensorflow_for_build()
        tf_ext = next((e for e in self.extensions if e.name == "lossscale._lossscale_ops"), None)
        if tf_ext is not None and tf is not None:
            tf_ext.extra_compile_args = tf["compile_flags"] + tf_ext.extra_compile_args
            tf_ext.extra_link_args = tf["link_flags"] + tf_ext.extra_link_args
        elif tf_ext is not None:
            self.extensions.remove(tf_ext)
            if tf_ext in self.distribution.ext_modules:
                self.distribution.ext_modules.remove(tf_ext)
        super().run()
        package_dir = os.path.dirname(self.get_ext_fullpath("lossscale._native"))
        record = os.path.join(package_dir, BUILD_INFO + ".py")
        if tf_ext is not None and tf is not None:
            with open(record, "w") as f:
                f.write('"""Written by setup.py: the TensorFlow the op library was built for."""\n')
                f.write(f"TF_VERSION = {tf['version']!r}\n")
            return
        # An in-place tree must not keep an op library from an earlier build.
        for stale in (record, os.path.join(package_dir, "_lossscale_ops.so")):
            if os.path.exists(stale):
                os.remove(stale)
        notice(f"the TensorFlow op library is NOT built ({why_not or 'no _core/tf sources'}): "
               "lossscale.ops will use plain TensorFlow ops (same results, slower)")

    def build_extensions(self):
        self.jobs = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
            else (os.cpu_count() or 1)
        self.compile_in_parallel()
        build_temp = os.path.join(self.build_temp, "core")

        def core_object(source_and_flags):
            source, flags = source_and_flags
            return self.compiler.compile(
                [source],
                output_dir=build_temp,
                include_dirs=[INCLUDE, CORE],
                extra_postargs=COMMON_CFLAGS + flags,
                depends=[d for d in CORE_DEPENDS if not d.endswith(".c")],
            )

        # Each kernel file has its own flags: one compile call each, side by side.
        with ThreadPoolExecutor(self.jobs) as pool:
            objects = [obj for part in pool.map(core_object, kernel_sets.core_sources())
                       for obj in part]
        for ext in self.extensions:
            ext.extra_objects = list(objects) + list(ext.extra_objects or [])
        super().build_extensions()

    def compile_in_parallel(self):
        """Every ``compile`` of a list of sources runs one compiler per core:
        the core's kernel files and the op library's C++ files are most of
        the build's time, and each compiles alone."""
        serial = self.compiler.compile
        if self.jobs < 2:
            return

        def compile(sources, *args, **kwargs):
            if len(sources) < 2:
                return serial(sources, *args, **kwargs)
            with ThreadPoolExecutor(min(self.jobs, len(sources))) as pool:
                parts = list(pool.map(lambda source: serial([source], *args, **kwargs), sources))
            return [obj for part in parts for obj in part]

        self.compiler.compile = compile

    def get_ext_filename(self, ext_name):
        # The TF op library is loaded with tf.load_op_library, not imported:
        # give it a plain name.
        if ext_name.endswith("_lossscale_ops"):
            return os.path.join(*ext_name.split(".")) + ".so"
        return super().get_ext_filename(ext_name)


class BuildPyWithoutRecord(build_py):
    """Never copies the in-place build's record into a build: build_ext
    writes the record of what it built."""

    def find_package_modules(self, package, package_dir):
        return [m for m in super().find_package_modules(package, package_dir)
                if m[1] != BUILD_INFO]


class FreshBuild(build):
    """A wheel is built in a new build directory, so that nothing an earlier
    build left in ``build/`` (an op library built then) can reach it."""

    def finalize_options(self):
        if self.build_base == "build" and "bdist_wheel" in self.distribution.commands:
            self.build_base = tempfile.mkdtemp(prefix="lossscale-build-")
            atexit.register(shutil.rmtree, self.build_base, True)
        super().finalize_options()


class EggInfoWithTensorFlow(egg_info):
    """A wheel's metadata pins the TensorFlow minor its op library was built
    for (under the ``tensorflow`` extra); an sdist's leaves it open."""

    def run(self):
        if "sdist" not in self.distribution.commands:
            tf, _ = backend.tensorflow_for_build()
            if tf is not None:
                extras = dict(self.distribution.extras_require)
                extras["tensorflow"] = [backend.tensorflow_requirement(tf["version"]),
                                        *TENSORFLOW_EXTRA[1:]]
                self.distribution.extras_require = extras
                self.distribution.metadata.extras_require = extras
        super().run()


# Every extension links the core's objects: a change to any core file must
# relink them.
CORE_DEPENDS = sorted(
    os.path.join(d, f)
    for d in (CORE, INCLUDE)
    for f in os.listdir(os.path.join(HERE, d))
    if f.endswith((".c", ".h", ".def"))
)


def extensions():
    exts = [Extension(
        "lossscale._native",
        sources=[os.path.join("lossscale", "_native.pyx")],
        include_dirs=[INCLUDE],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=["-O2"],
        extra_link_args=["-pthread"],
        depends=CORE_DEPENDS,
    )]
    exts[0].cython_directives = {"language_level": 3, "boundscheck": False,
                                 "wraparound": False}
    tf_sources = sorted(os.path.join(TF_DIR, s)
                        for s in (os.listdir(os.path.join(HERE, TF_DIR))
                                  if os.path.isdir(os.path.join(HERE, TF_DIR)) else [])
                        if s.endswith(".cc"))
    if tf_sources:
        # Compile and link flags of the TensorFlow found are added by build_ext.
        tf_headers = sorted(os.path.join(TF_DIR, h) for h in os.listdir(os.path.join(HERE, TF_DIR))
                            if h.endswith(".h"))
        exts.append(Extension(
            "lossscale._lossscale_ops",
            sources=tf_sources,
            include_dirs=[INCLUDE],
            depends=CORE_DEPENDS + tf_headers,
            extra_compile_args=["-O3", "-fPIC", "-fvisibility=hidden",
                                "-Wno-deprecated-declarations"],
            extra_link_args=["-pthread"],
            language="c++",
        ))
    return exts


setup(
    ext_modules=extensions(),
    extras_require=EXTRAS,
    cmdclass={"build": FreshBuild, "build_ext": BuildWithCore, "build_py": BuildPyWithoutRecord,
              "egg_info": EggInfoWithTensorFlow},
)
