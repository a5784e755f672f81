"""Build of lossscale's native parts.

Two extension modules share one C core (``_core/``):

* ``lossscale._native`` — Cython bindings over numpy;
* ``lossscale/_lossscale_ops.so`` — the TensorFlow custom-op library, built
  only when TensorFlow can be imported at build time (build with
  ``--no-build-isolation`` so the installed TensorFlow is the one used).

The core's per-ISA kernel files are compiled once each with their own
``-m`` flags; nothing else gets ISA flags, so the modules load on any
x86-64 (or aarch64) CPU and pick their kernels at run time.
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
CORE = os.path.join("_core", "src")
INCLUDE = os.path.join("_core", "include")

sys.path.insert(0, os.path.join(HERE, "_core"))
import kernel_sets  # noqa: E402  (the one list of kernel sets and their flags)

COMMON_CFLAGS = kernel_sets.COMMON_CFLAGS


def tensorflow_flags():
    """Compile and link flags of the installed TensorFlow, or None."""
    if os.environ.get("LOSSSCALE_BUILD_TF_OPS", "1") == "0":
        return None
    try:
        import tensorflow as tf  # noqa: F401  (heavy; build-time only)
    except Exception as exc:  # pragma: no cover - depends on the build host
        print(f"lossscale: TensorFlow not importable ({exc}); skipping the op library",
              file=sys.stderr)
        return None
    return tf.sysconfig.get_compile_flags(), tf.sysconfig.get_link_flags(), tf.__version__


class BuildWithCore(build_ext):
    """Compiles the C core (per-file ISA flags) and links it into every extension."""

    def build_extensions(self):
        objects = []
        build_temp = os.path.join(self.build_temp, "core")
        for source, flags in kernel_sets.core_sources():
            objects += self.compiler.compile(
                [source],
                output_dir=build_temp,
                include_dirs=[INCLUDE, CORE],
                extra_postargs=COMMON_CFLAGS + flags,
                depends=[os.path.join(INCLUDE, "lossscale.h"),
                         os.path.join(CORE, "kernels.h"),
                         os.path.join(CORE, "internal.h")],
            )
        for ext in self.extensions:
            ext.extra_objects = list(objects) + list(ext.extra_objects or [])
        # C++ sources of the TF op need C++ flags, not the C core's.
        original = self.compiler._compile

        def compile_one(obj, src, ext, cc_args, extra_postargs, pp_opts):
            if src.endswith(".cc"):
                extra_postargs = [a for a in extra_postargs if a != "-std=c11"]
            return original(obj, src, ext, cc_args, extra_postargs, pp_opts)

        self.compiler._compile = compile_one
        super().build_extensions()

    def get_ext_filename(self, ext_name):
        # The TF op library is loaded with tf.load_op_library, not imported:
        # give it a plain name.
        if ext_name.endswith("_lossscale_ops"):
            return os.path.join(*ext_name.split(".")) + ".so"
        return super().get_ext_filename(ext_name)


# Every extension links the core's objects: a change to any core file must
# relink them.
CORE_DEPENDS = sorted(
    os.path.join(d, f)
    for d in (CORE, INCLUDE)
    for f in os.listdir(os.path.join(HERE, d))
    if f.endswith((".c", ".h"))
)


def extensions():
    import numpy as np
    from Cython.Build import cythonize

    native = Extension(
        "lossscale._native",
        sources=[os.path.join("lossscale", "_native.pyx")],
        include_dirs=[INCLUDE, np.get_include()],
        define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
        extra_compile_args=["-O2"],
        extra_link_args=["-pthread"],
        depends=CORE_DEPENDS,
    )
    exts = cythonize([native], language_level=3,
                     compiler_directives={"boundscheck": False, "wraparound": False})
    tf_dir = os.path.join(HERE, "_core", "tf")
    tf_sources = sorted(os.path.join("_core", "tf", s)
                        for s in (os.listdir(tf_dir) if os.path.isdir(tf_dir) else [])
                        if s.endswith(".cc"))
    tf = tensorflow_flags() if tf_sources else None
    if tf is not None:
        compile_flags, link_flags, version = tf
        with open(os.path.join(HERE, "lossscale", "_build_info.py"), "w") as f:
            f.write('"""Written by setup.py: the TensorFlow the op library was built for."""\n')
            f.write(f"TF_VERSION = {version!r}\n")
        exts.append(Extension(
            "lossscale._lossscale_ops",
            sources=tf_sources,
            include_dirs=[INCLUDE],
            depends=CORE_DEPENDS,
            extra_compile_args=compile_flags + ["-O3", "-fPIC", "-fvisibility=hidden",
                                               "-Wno-deprecated-declarations"],
            extra_link_args=link_flags + ["-pthread"],
            language="c++",
        ))
    return exts


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildWithCore})
