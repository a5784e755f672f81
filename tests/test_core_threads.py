"""``lossscale.core`` under threads: the library's own and Python's.

Answers are checked against numpy (never against another run of the core):
many Python threads calling at once, every thread count, a list split
across the pool or not, and the GIL released during a call.
"""

import os
import sys
import threading

import ml_dtypes
import numpy as np
import pytest

from helpers import same_bits
from lossscale import core

BF16 = np.dtype(ml_dtypes.bfloat16)


def oracle(x, s):
    with np.errstate(all="ignore"):
        if x.dtype == BF16:
            return (x.astype(np.float32) * np.float32(ml_dtypes.bfloat16(s))).astype(BF16)
        return x * x.dtype.type(s)


def make(dtype, n, seed, bad_at=None):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(n).astype(dtype)
    if bad_at is not None:
        a[bad_at] = np.inf
    return a


@pytest.fixture(autouse=True)
def restore_threads():
    yield
    core.set_num_threads(0)


def test_default_thread_count_is_positive():
    core.set_num_threads(0)
    default = core.get_num_threads()
    assert default >= 1
    core.set_num_threads(3)
    assert core.get_num_threads() == 3
    core.set_num_threads(-5)
    assert core.get_num_threads() == default


@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32, np.float64],
                         ids=["float16", "bfloat16", "float32", "float64"])
def test_every_thread_count_same_answer(dtype):
    n = 3_000_017  # large enough to be split; not a multiple of any grain
    x = make(dtype, n, 1)
    want = oracle(x, 1.0 / 3.0)
    for threads in (1, 2, 3, 4, 7, 16):
        core.set_num_threads(threads)
        got = x.copy()
        assert core.unscale_(got, 1.0 / 3.0) is True
        assert same_bits(got, want), threads
        # a non-finite value in the last part, in the first, in the middle
        for pos in (n - 1, 0, n // 2 + 1):
            y = x.copy()
            y[pos] = np.nan
            assert core.all_finite(y) is False, (threads, pos)
            assert core.unscale_(y, 0.5) is False, (threads, pos)
            assert same_bits(y, oracle(np.where(np.arange(n) == pos, np.nan, x).astype(dtype), 0.5))


def test_list_split_across_threads_or_not():
    """One list, split into ranges over the pool or run on one thread, or
    one array at a time: the same results and flag."""
    rng = np.random.default_rng(2)
    dtypes = [np.float16, BF16, np.float32, np.float64]
    arrays = [make(dtypes[i % 4], int(n), 100 + i)
              for i, n in enumerate(rng.integers(1, 40_000, 120))]
    assert sum(a.size for a in arrays) > 1 << 20
    want = [oracle(a, 0.125) for a in arrays]
    for threads in (1, 2, 5):
        core.set_num_threads(threads)
        got = [a.copy() for a in arrays]
        assert core.unscale_(got, 0.125) is True
        assert all(same_bits(g, w) for g, w in zip(got, want)), threads
        one_by_one = [a.copy() for a in arrays]
        assert all(core.unscale_(a, 0.125) for a in one_by_one)
        assert all(same_bits(g, w) for g, w in zip(one_by_one, want))
        # a single overflow in one array anywhere in the list
        for k in (0, 59, 119):
            got = [a.copy() for a in arrays]
            got[k][-1] = ml_dtypes.finfo(got[k].dtype).max
            assert core.all_finite(got) is True
            assert core.unscale_(got, 8.0) is False, (threads, k)
            assert core.all_finite(got) is False


def test_many_python_threads_at_once():
    """Eight Python threads, each with its own large arrays, over and over:
    every answer equals numpy's, and the flags are per call."""
    core.set_num_threads(0)
    dtypes = [np.float16, BF16, np.float32, np.float64]
    jobs = []
    for t in range(8):
        dtype = dtypes[t % 4]
        bad = 777 if t % 3 == 0 else None
        x = make(dtype, 600_000 + 1000 * t, 10 + t, bad_at=bad)
        s = [0.5, 1.0 / 3.0, 2.0 ** -7, 1000.0][t % 4]
        jobs.append((x, s, oracle(x, s), bad is None))
    barrier = threading.Barrier(len(jobs))
    errors = []

    def work(x, s, want, want_flag):
        try:
            barrier.wait()
            for _ in range(5):
                y = x.copy()
                flag = core.unscale_(y, s)
                if flag is not want_flag or not same_bits(y, want):
                    errors.append(("unscale_", x.dtype, s, flag))
                if core.all_finite(x) is not want_flag:
                    errors.append(("all_finite", x.dtype))
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=work, args=job) for job in jobs]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:5]


def test_gil_released_during_a_call():
    """While one thread is inside unscale_, another runs Python code.

    The interpreter's switch interval is made huge so the GIL is never
    handed over on a timer: the main thread can only advance the counter
    while the worker is inside the call if the call released the GIL."""
    big = np.ones(40_000_000, dtype=np.float32)
    counter = [0]
    seen = {}
    started = threading.Event()
    done = threading.Event()

    def worker():
        started.set()
        before = counter[0]
        # Several calls: on a loaded machine one may end before the main
        # thread is scheduled at all.
        for _ in range(5):
            core.unscale_(big, 1.0)
        seen["during"] = counter[0] - before
        done.set()

    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        th = threading.Thread(target=worker)
        th.start()
        started.wait()
        while not done.is_set():
            counter[0] += 1
            done.wait(0.0005)  # blocks briefly: lets the worker back in after its call
        th.join()
    finally:
        sys.setswitchinterval(old)
    assert seen["during"] > 0
    assert (big == 1.0).all()


def test_two_calls_overlap():
    """Two threads each inside a call at the same time: each sees the other
    enter before it leaves (with the GIL held, one would finish first)."""
    a = np.ones(30_000_000, dtype=np.float32)
    b = np.ones(30_000_000, dtype=np.float32)
    inside = [0, 0]
    overlap = [False, False]
    state = threading.Lock()
    entered = threading.Barrier(2)

    def worker(i, arr):
        entered.wait()
        with state:
            inside[i] = 1
        for _ in range(6):
            core.unscale_(arr, 1.0)
            with state:
                if inside[1 - i] == 1:
                    overlap[i] = True
        with state:
            inside[i] = 2

    old = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        ts = [threading.Thread(target=worker, args=(i, arr)) for i, arr in enumerate((a, b))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
    finally:
        sys.setswitchinterval(old)
    assert overlap[0] or overlap[1]
    assert (a == 1.0).all() and (b == 1.0).all()


def _workers():
    """The Linux task ids of the core's own worker threads."""
    tasks = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() == "lossscale":
                    tasks.append(int(tid))
        except FileNotFoundError:
            pass
    return tasks


@pytest.mark.skipif(not sys.platform.startswith("linux") or len(os.sched_getaffinity(0)) < 2,
                    reason="worker placement: Linux with two CPUs or more")
def test_workers_are_kept_off_the_callers_cpu():
    # Woken on the caller's CPU, a worker would wait there behind it: every
    # worker may run on the caller's CPUs but the one the caller is on.
    x = make(np.float32, 3_000_017, 5)
    want = oracle(x, 2.0)
    saved = os.sched_getaffinity(0)
    core.set_num_threads(2)
    try:
        for callers in (saved, set(sorted(saved)[:2])):
            os.sched_setaffinity(0, callers)
            got = x.copy()
            assert core.unscale_([got], 2.0) is True
            assert same_bits(got, want)
            workers = _workers()
            assert workers, "no worker thread named lossscale"
            for tid in workers:
                allowed = os.sched_getaffinity(tid)
                assert allowed < callers and len(allowed) == len(callers) - 1, (callers, allowed)
        # A caller with one CPU leaves the workers where they were.
        before = {tid: os.sched_getaffinity(tid) for tid in _workers()}
        os.sched_setaffinity(0, {min(saved)})
        got = x.copy()
        assert core.unscale_([got], 2.0) is True
        assert same_bits(got, want)
        assert {tid: os.sched_getaffinity(tid) for tid in _workers()} == before
    finally:
        os.sched_setaffinity(0, saved)
