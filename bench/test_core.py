"""The numpy layer: ``lossscale.core.unscale_`` against its peers on one
gradient list, in place.

Peers, all on the same arrays (torch's tensors share their memory):

* ``ours``     -- ``core.unscale_(arrays, s)``: one call for the whole list;
* ``torch``    -- ``torch._amp_foreach_non_finite_check_and_unscale_`` on CPU;
* ``numpy``    -- ``np.isfinite(a).all()`` then ``np.multiply(a, s, out=a)``
                  per array, what a numpy user writes;
* ``roofline`` -- ``np.multiply(b, s, out=b)`` over the same bytes, read and
                  written, no check, at the item's thread count: the list
                  cut into that many contiguous shares, each multiplied on
                  its own thread (numpy's ufuncs release the GIL).  numpy
                  has no vectorized float16 or bfloat16 multiply (it is 30
                  times slower than float32), so for 16-bit lists the
                  roofline runs over float32 buffers of the same byte sizes
                  instead.  Its 1 GiB case is the bandwidth behind the
                  optimizer step's roofline (``test_step.py``), so it runs at
                  the step's thread count too.

The ``numpy`` peer is single-threaded whatever the pinned thread count, as
a numpy user's code is; ``ours``, ``torch`` and the roofline run at every
count in ``Settings.core_threads``.
"""

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import harness
import workloads

LAYER = "core"
PEERS = ["ours", "torch", "numpy", "roofline"]
SCALES = (0.5, 2.0)


def THREADS(settings):
    return settings.core_threads


def cases(settings):
    if settings.quick:
        return (["resnet50/float32", "tiny_2000x64/float16"]
                + [f"{workloads.sweep_name(b)}/float32" for b in workloads.QUICK_SWEEP_BYTES])
    lists = [f"{w}/{d}" for w in workloads.LISTS for d in ("float32", "float16", "bfloat16")]
    sweep = [f"{workloads.sweep_name(b)}/float32" for b in workloads.SWEEP_BYTES
             if b < workloads.GIB]
    return lists + [f"{workloads.BIG}/float32"] + sweep


def items(settings):
    pairs = [(c, p) for c in cases(settings) for p in PEERS]
    if settings.quick:
        # The bandwidth behind the optimizer step's roofline (test_step.py).
        pairs.append((f"{workloads.BIG}/float32", "roofline"))
    return pairs


def shares(arrays, n):
    """``arrays`` (1-D views) cut into ``n`` lists of contiguous slices with
    equal element counts, to within one element, in order."""
    flat = [a.reshape(-1) for a in arrays]
    total = sum(a.size for a in flat)
    bounds = [total * k // n for k in range(n + 1)]
    out = [[] for _ in range(n)]
    offset = 0
    for a in flat:
        for k in range(n):
            lo, hi = max(bounds[k], offset), min(bounds[k + 1], offset + a.size)
            if lo < hi:
                out[k].append(a[lo - offset:hi - offset])
        offset += a.size
    return out


_POOLS = {}


def parallel_multiply(arrays, threads):
    """``run(s)``: every array multiplied in place by ``s``, the list cut into
    ``threads`` shares, the caller's thread taking the first."""
    parts = shares(arrays, threads)

    def work(part, s):
        for b in part:
            np.multiply(b, s, out=b)

    if threads == 1:
        return lambda s: work(parts[0], s)
    pool = _POOLS.get(threads)
    if pool is None:
        pool = _POOLS[threads] = ThreadPoolExecutor(threads - 1)

    def run(s):
        pending = [pool.submit(work, part, s) for part in parts[1:]]
        work(parts[0], s)
        for f in pending:
            f.result()
    return run


class Data(harness.CaseData):
    layer = LAYER

    def __init__(self, case):
        super().__init__(case)
        dtype = self.dtype
        self.flip = harness.Flip()
        self.typed = [self.arrays[0].dtype.type(s) for s in SCALES]
        if dtype == "float32":
            self.roof, self.roof_flip = self.arrays, self.flip
        else:
            self.roof = [np.ones(-(-a.nbytes // 4), np.float32) for a in self.arrays]
            self.roof_flip = harness.Flip()
        self.roof_typed = [np.float32(s) for s in SCALES]
        self._torch = None

    def torch_args(self, torch):
        if self._torch is None:
            if self.dtype == "bfloat16":
                ts = [torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) for a in self.arrays]
            else:
                ts = [torch.from_numpy(a) for a in self.arrays]
            self._torch = (ts, torch.zeros(1),
                           [torch.full((1,), s, dtype=torch.float32) for s in SCALES])
        return self._torch


def method(data, peer, threads=1):
    from lossscale import core

    arrays, flip = data.arrays, data.flip
    if peer == "ours":
        return lambda: core.unscale_(arrays, SCALES[flip()])
    if peer == "numpy":
        typed = data.typed

        def run():
            s = typed[flip()]
            finite = True
            for a in arrays:
                finite &= bool(np.isfinite(a).all())
                np.multiply(a, s, out=a)
            return finite
        return run
    if peer == "roofline":
        multiply = parallel_multiply(data.roof, threads)
        rflip, typed = data.roof_flip, data.roof_typed
        return lambda: multiply(typed[rflip()])
    if peer == "torch":
        torch = harness.torch_or_skip()
        tensors, found_inf, invs = data.torch_args(torch)
        fn = torch._amp_foreach_non_finite_check_and_unscale_
        return lambda: fn(tensors, found_inf, invs[flip()])
    raise ValueError(peer)


def test_core(benchmark, case, peer, threads, rnd):
    from lossscale import core

    data = harness.live(LAYER, case, lambda: Data(case))
    harness.pin_threads(threads)
    fn = method(data, peer, threads)
    harness.timed(benchmark, (LAYER, case, threads, peer), fn,
                  data.info(peer, rnd, threads))
    assert core.all_finite(data.arrays), "values left the finite range"
    if peer == "torch":
        assert data.torch_args(None)[1].item() == 0.0


@pytest.fixture(autouse=True, scope="module")
def _restore_threads():
    yield
    harness.pin_threads(harness.Settings.threads)
