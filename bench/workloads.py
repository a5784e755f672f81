"""The work every benchmark measures, named once so that every layer and
every peer gets the same gradient lists.

A workload is a list of shapes and a dtype: the parameter shapes of
ResNet-50 (161 tensors, 25,557,032 values) and BERT-base (199 tensors,
109,482,240 values) from ``workloads.json``, 2,000 tensors of 64 values, one
1 GiB float32 tensor (32 times a 32 MiB last-level cache, so every pass
streams from memory), and single float32 tensors from 1 KiB to 1 GiB for the
throughput sweep.  Values are standard normal from a fixed seed, so nothing
short-circuits on a non-finite value (the two largest single tensors
repeat one block of them: ``TILED_ABOVE``).
"""

import json
import os

import ml_dtypes
import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))

with open(os.path.join(_HERE, "workloads.json")) as _f:
    SHAPES = {k: [tuple(s) for s in v] for k, v in json.load(_f).items() if k != "about"}

DTYPES = {"float32": np.dtype(np.float32), "float16": np.dtype(np.float16),
          "bfloat16": np.dtype(ml_dtypes.bfloat16), "float64": np.dtype(np.float64)}

GIB = 1 << 30
LISTS = ("resnet50", "bert_base", "tiny_2000x64")
BIG = "tensor_1GiB"

# One float32 tensor per size, 1 KiB to 1 GiB in steps of four.
SWEEP_BYTES = [1 << k for k in range(10, 31, 2)]
QUICK_SWEEP_BYTES = [1 << 12, 1 << 20, 1 << 24]


def sweep_name(nbytes):
    return f"sweep_{nbytes}"


def size_label(nbytes):
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if nbytes >= 1 << shift:
            return f"{nbytes / (1 << shift):g} {unit}"
    return f"{nbytes} B"


def shapes(name):
    """Shapes of a named workload (a gradient list, the big tensor or a sweep point)."""
    if name == BIG:
        return [(GIB // 4,)]
    if name.startswith("sweep_"):
        return [(int(name[len("sweep_"):]) // 4,)]
    return SHAPES[name]


# A single tensor of more than TILED_ABOVE values (the sweep's 256 MiB and
# 1 GiB tensors; no gradient list has one) is one block of TILE_VALUES
# standard normal values repeated: drawing a quarter of a billion normal
# values costs seconds, copying the block a fraction of that, and a pass
# over memory does the same work on either.
TILE_VALUES = 1 << 22
TILED_ABOVE = 1 << 25


def _standard_normal(rng, shape):
    n = int(np.prod(shape))
    if n <= TILED_ABOVE:
        return rng.standard_normal(shape, dtype=np.float32)
    block = rng.standard_normal(TILE_VALUES, dtype=np.float32)
    out = np.empty(n, np.float32)
    whole = n - n % TILE_VALUES
    out[:whole].reshape(-1, TILE_VALUES)[:] = block
    out[whole:] = block[:n - whole]
    return out.reshape(shape)


def arrays(name, dtype="float32", seed=0):
    """Fresh C-contiguous numpy arrays of the workload, standard normal (a
    tensor of more than ``TILED_ABOVE`` values repeats one block)."""
    dtype = DTYPES[dtype] if isinstance(dtype, str) else np.dtype(dtype)
    rng = np.random.default_rng(seed)
    out = []
    for shape in shapes(name):
        a = _standard_normal(rng, shape)
        out.append(a if dtype == np.float32 else a.astype(dtype))
    return out


def values(name):
    return sum(int(np.prod(s)) for s in shapes(name))


def describe(name, dtype="float32"):
    """One line for a report: what the workload is."""
    itemsize = DTYPES[dtype].itemsize
    n, v = len(shapes(name)), values(name)
    return f"{n:,} tensor{'s' if n > 1 else ''}, {v:,} values, {size_label(v * itemsize)}"
