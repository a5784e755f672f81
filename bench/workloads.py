"""The gradient-list shapes every benchmark measures (see workloads.json).

ResNet-50 (161 tensors, 25,557,032 values), BERT-base (199 tensors,
109,482,240 values), 2,000 tensors of 64 values, and one 1 GiB float32
tensor.  Values are standard normal from a fixed seed.
"""

import json
import os

import numpy as np

_HERE = os.path.dirname(os.path.abspath(__file__))

with open(os.path.join(_HERE, "workloads.json")) as _f:
    SHAPES = {k: [tuple(s) for s in v] for k, v in json.load(_f).items() if k != "about"}

GIB_FLOAT32 = (1 << 30) // 4


def shapes(name):
    """Shapes of a named workload; "gib" is one 1 GiB float32 tensor."""
    if name == "gib":
        return [(GIB_FLOAT32,)]
    return SHAPES[name]


def arrays(name, dtype=np.float32, seed=0):
    """Fresh C-contiguous numpy arrays of the workload, standard normal."""
    rng = np.random.default_rng(seed)
    out = []
    for shape in shapes(name):
        a = rng.standard_normal(shape, dtype=np.float32)
        out.append(a if np.dtype(dtype) == np.float32 else a.astype(dtype))
    return out


def values(name):
    return sum(int(np.prod(s)) for s in shapes(name))
