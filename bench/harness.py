"""What every benchmark in this suite shares: the run's settings, the machine
facts printed and stored with the results, the optional peers, the cache of
the workload being measured, and the one way a method is timed.

The timing rules, each learnt the hard way on a shared two-core machine:

* a method is warmed up (first call: page faults, thread start, tracing)
  and then timed in samples of ``calls`` back-to-back calls, ``calls``
  chosen once per method so that a sample lasts at least ``min_sample_s``
  (so a 1 KiB call is not timed alone at the timer's resolution);
* before every sample the harness sleeps ``SETTLE_S``: PyTorch's OpenMP
  workers keep spinning for a while after a parallel region and would steal
  the cores of whichever method is timed next.  Every method gets the gap;
* peers are interleaved: the collection hook in ``conftest.py`` orders the
  items workload by workload, round by round, rotating the peers within a
  round, so a change in machine load hits every peer alike;
* the report takes the median over every sample of every round, with the
  minimum and maximum beside it.
"""

import ctypes
import gc
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

SETTLE_S = 0.02


class Settings:
    """The run's knobs; ``conftest.py`` fills them in before collection."""

    quick = False
    threads = 1            # TensorFlow's pools, the core and torch in every layer
    core_threads = (1,)    # the numpy layer is also measured single-threaded
    rounds = 5             # interleaved rounds per workload
    samples = 3            # timed samples per method per round
    min_sample_s = 2e-3
    cases = ()             # parts of case names to keep (--cases); () keeps all
    warmup_s = 0.0         # a method's first warm-up, in seconds (--warmup-s)

    @classmethod
    def configure(cls, quick, threads, rounds=0, cases="", warmup_s=0.0):
        cls.quick = quick
        cls.warmup_s = warmup_s
        cls.cases = tuple(c for c in cases.split(",") if c)
        cls.threads = threads
        cls.core_threads = (threads,) if quick or threads == 1 else (1, threads)
        cls.rounds = rounds or (2 if quick else 5)
        # The quick run still interleaves two rounds; one sample in each.
        cls.samples = 1 if quick else 3
        cls.min_sample_s = 1e-3 if quick else 2e-3


def wanted(cases, settings):
    """The names in ``cases`` that ``settings.cases`` keeps (all without it)."""
    return [c for c in cases if not settings.cases or any(k in c for k in settings.cases)]


def machine_threads():
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# ------------------------------------------------------------ optional peers

_optional = {}


def optional(name):
    """``(module, None)`` or ``(None, why it is missing)``; tried once."""
    if name not in _optional:
        try:
            _optional[name] = (__import__(name), None)
        except Exception as e:  # an optional peer may fail in any way on import
            _optional[name] = (None, f"{name} not importable ({type(e).__name__}: {e})")
    return _optional[name]


def torch_or_skip():
    import pytest

    torch, why = optional("torch")
    if torch is None:
        pytest.skip(f"PyTorch peer skipped: {why}; pip install -r requirements-bench.txt")
    return torch


_tf = None


def tensorflow():
    """TensorFlow with its thread pools pinned to ``Settings.threads``.

    The pools can only be sized before TensorFlow runs its first op, so the
    first call of this function must come before any TensorFlow work.
    """
    global _tf
    if _tf is None:
        import tensorflow as tf

        tf.get_logger().setLevel("ERROR")
        tf.config.threading.set_intra_op_parallelism_threads(Settings.threads)
        tf.config.threading.set_inter_op_parallelism_threads(Settings.threads)
        _tf = tf
    return _tf


def pin_threads(threads):
    """Every native pool in this process to ``threads`` (TensorFlow's are fixed)."""
    from lossscale import core

    core.set_num_threads(threads)
    torch, _ = optional("torch")
    if torch is not None:
        torch.set_num_threads(threads)
        if torch.get_num_interop_threads() != threads:
            try:
                torch.set_num_interop_threads(threads)
            except RuntimeError:
                # Settable once, before torch's first inter-op work; the
                # first call of this function comes before any.
                pass


# ------------------------------------------------------------ machine facts

def _cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "Model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _last_level_cache():
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        levels = sorted(os.listdir(base))
    except OSError:
        return None
    best = None
    for idx in levels:
        try:
            with open(os.path.join(base, idx, "level")) as f:
                level = int(f.read())
            with open(os.path.join(base, idx, "size")) as f:
                size = f.read().strip()
        except (OSError, ValueError):
            continue
        if best is None or level >= best[0]:
            best = (level, size)
    return f"L{best[0]} {best[1]}" if best else None


def _memory_total():
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return f"{int(line.split()[1]) / (1 << 20):.1f} GiB"
    except OSError:
        pass
    return None


def load_average():
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def machine_facts():
    """Everything a reader needs to judge the numbers, as one flat dict."""
    from lossscale import core

    tf = tensorflow()
    import keras

    torch, torch_why = optional("torch")
    mpl, mpl_why = optional("matplotlib")
    from lossscale import ops

    status = ops.native_available()
    return {
        "cpu": _cpu_model(),
        "arch": platform.machine(),
        "cores_available": machine_threads(),
        "cpu_count": os.cpu_count(),
        "last_level_cache": _last_level_cache(),
        "memory": _memory_total(),
        "simd_level": core.simd_level(),
        "simd_best": core.simd_best(),
        "threads": Settings.threads,
        "core_threads": list(Settings.core_threads),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "tensorflow": tf.__version__,
        "keras": keras.__version__,
        "torch": torch.__version__ if torch is not None else None,
        "torch_threads": ([torch.get_num_threads(), torch.get_num_interop_threads()]
                          if torch is not None else None),
        "torch_missing": torch_why,
        "matplotlib": mpl.__version__ if mpl is not None else None,
        "matplotlib_missing": mpl_why,
        "native_op": "loaded" if status else f"unavailable ({status.reason})",
        "quick": Settings.quick,
        "rounds": Settings.rounds,
        "samples_per_round": Settings.samples,
        "min_sample_s": Settings.min_sample_s,
        "settle_s": SETTLE_S,
        # The roofline's multiply runs on the item's threads (test_core.py);
        # runs without this fact timed it on one.
        "roofline_threads": "item",
        "transparent_huge_pages": _transparent_huge_pages(),
        "loadavg_start": load_average(),
    }


def _transparent_huge_pages():
    """The kernel's transparent huge page mode (``always``, ``madvise``,
    ``never``), or None where it does not say."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
    except OSError:
        return None
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else None


def facts_lines(facts):
    return [
        f"cpu: {facts['cpu']} ({facts['arch']}), {facts['cores_available']} cores available, "
        f"last-level cache {facts['last_level_cache']}, memory {facts['memory']}",
        f"lossscale kernel set: {facts['simd_level']} (best this CPU has: {facts['simd_best']}); "
        f"TensorFlow op: {facts['native_op']}",
        f"threads pinned: {facts['threads']} for TensorFlow's pools, lossscale.core and torch "
        f"(numpy layer also at {', '.join(map(str, facts['core_threads']))})",
        f"versions: python {facts['python']}, numpy {facts['numpy']}, TensorFlow "
        f"{facts['tensorflow']}, Keras {facts['keras']}, torch {facts['torch'] or 'absent'}, "
        f"matplotlib {facts['matplotlib'] or 'absent'}",
        f"method: {'QUICK subset, ' if facts['quick'] else ''}{facts['rounds']} interleaved "
        f"rounds x {facts['samples_per_round']} samples per method, warm-up first, "
        f"{facts['settle_s'] * 1e3:g} ms settle gap before each sample; "
        f"load average at start {facts['loadavg_start']}",
    ]


# The order in which layers run: in one ``pytest bench`` (``conftest.py``
# sorts the items by it) and one process a layer (``run.py``).
LAYER_ORDER = ("core", "tf_op", "loss_scale", "check", "optimizer", "step", "tf_keras_step",
               "fit", "recipes", "alone", "memory", "training", "distributed")


def layer_rank(layer):
    return LAYER_ORDER.index(layer) if layer in LAYER_ORDER else len(LAYER_ORDER)


# ------------------------------------------------------------ shared state

RECORDS = {}
# Benchmarks timed in child processes (test_alone.py), added to the raw JSON
# as they are.
CHILD_BENCHMARKS = []


CHILD_TIMEOUT_S = 1800


def child_benchmarks(what, nodes, settings, rounds, env=None, warmup_s=0.0):
    """The benchmarks (pytest-benchmark's JSON entries) of a child ``pytest``
    that runs the items ``nodes`` (node ids) of this suite at this run's
    thread count and quick setting, ``rounds`` rounds, each method warmed
    up ``warmup_s`` seconds first, with ``env`` added to its environment;
    each entry's ``child_wall_s`` is the child's wall time, and the child's
    lines on skipped peers join this run's.  A child that
    fails is an error naming ``what`` it ran, with the end of its output.
    The child builds its own workload (BERT-base's: gigabytes), so this
    process lets go of every layer's first."""
    drop_all()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "child.json")
        cmd = [sys.executable, "-m", "pytest", *nodes, "-q",
               "-p", "no:cacheprovider", f"--threads={settings.threads}",
               f"--rounds={rounds}", f"--warmup-s={warmup_s}",
               *(["--quick"] if settings.quick else []),
               *([f"--cases={','.join(settings.cases)}"] if settings.cases else []),
               "--benchmark-disable-gc", f"--benchmark-json={out}"]
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                              timeout=CHILD_TIMEOUT_S, env=dict(os.environ, **(env or {})))
        wall = time.perf_counter() - t0
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr)[-3000:]
            raise AssertionError(f"the child for {what} failed "
                                 f"(exit {proc.returncode}):\n{tail}")
        with open(out) as f:
            raw = json.load(f)
    benchmarks = raw["benchmarks"]
    for line in raw["lossscale"]["records"].get("skipped", []):
        if line not in RECORDS.setdefault("skipped", []):
            RECORDS["skipped"].append(line)
    for b in benchmarks:
        b["extra_info"]["child_wall_s"] = round(wall, 1)
    return benchmarks


def bits(x):
    """The raw bytes of ``x`` with its dtype and shape, what the locksteps
    compare: NaN equals the same NaN, -0.0 differs from 0.0."""
    a = np.ascontiguousarray(np.asarray(x))
    return a.dtype.str, a.shape, a.reshape(-1).view(np.uint8).tobytes()


def record(name, data):
    """Keep a result that is not a timing (memory, the training run); it is
    stored in the raw JSON under ``lossscale.records``."""
    RECORDS[name] = data


def release():
    """Collects what the dropped workload held and hands glibc's free pages
    back to the system (a full run builds workloads of gigabytes one after
    another; what a dropped one freed is then the next one's to use, not
    kept by the allocator)."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc: nothing to trim


class LiveCase:
    """Holds the data of one workload at a time.

    Items arrive workload by workload, so when a new key is asked for the
    previous workload (up to gigabytes of arrays and graphs) is dropped.
    """

    def __init__(self):
        self.key = None
        self.value = None

    def get(self, key, build):
        if key != self.key:
            self.key = self.value = None
            release()
            self.value = build()
            self.key = key
        return self.value


_cases = {}


def live(layer, key, build):
    """``layer``'s data for ``key``, made by ``build`` when it is not the one
    held.  Layers run one after the other: the data other layers still hold
    (their last workload: up to gigabytes of arrays, tensors and graphs) is
    dropped first, or a full run holds the last workload of every layer at
    once and runs out of memory by its last layers."""
    if any(other != layer and case.value is not None for other, case in _cases.items()):
        for other, case in _cases.items():
            if other != layer:
                case.key = case.value = None
        release()
    return _cases.setdefault(layer, LiveCase()).get(key, build)


def timed_here(config, layer, case):
    """The peers of ``layer``'s ``case`` that this process times
    (``conftest.py`` keeps the run's items)."""
    return {i.callspec.params["peer"] for i in config._lossscale_items
            if getattr(i, "callspec", None) and i.callspec.params.get("case") == case
            and getattr(i.module, "LAYER", None) == layer}


def drop_all():
    for c in _cases.values():
        c.key = c.value = None
    release()


class CaseData:
    """The arrays of one workload case (``"name/dtype"``) and every peer's
    method on them, each made on first use by the subclass's ``_make``."""

    layer = None

    def __init__(self, case):
        import workloads

        self.case = case
        self.name, self.dtype = case.split("/")
        self.arrays = workloads.arrays(self.name, self.dtype)
        self.methods = {}

    def method(self, peer):
        if peer not in self.methods:
            self.methods[peer] = self._make(peer)
        return self.methods[peer]

    def _make(self, peer):
        raise NotImplementedError

    def info(self, peer, rnd, threads=None, **extra):
        """What the raw JSON keeps beside each sample (``extra_info``)."""
        return dict(layer=self.layer, case=self.case, workload=self.name, dtype=self.dtype,
                    peer=peer, threads=Settings.threads if threads is None else threads,
                    rnd=rnd, tensors=len(self.arrays),
                    values=int(sum(a.size for a in self.arrays)),
                    bytes=int(sum(a.nbytes for a in self.arrays)), **extra)


class Flip:
    """Alternates between two exact factors (1/2 and 2) so that repeated
    in-place unscaling keeps the values where they started."""

    def __init__(self):
        self.i = 0

    def __call__(self):
        self.i ^= 1
        return self.i


# ------------------------------------------------------------ timing

_calls = {}


def timed(benchmark, key, method, info, baseline=None, cycle=1):
    """Time ``method`` (a zero-argument callable) for this item.

    ``key`` names the method on its workload and thread count; the number
    of calls per sample is fixed the first time a key is seen and reused in
    every round.  Seconds per sample go to pytest-benchmark; ``info`` and
    ``calls_per_sample`` go to its ``extra_info``.

    ``baseline``, when given, is the part of ``method`` that is not measured
    (making the gradients it works on): it is timed for the same number of
    calls just before every sample, untimed by pytest-benchmark, and its
    seconds per call go to ``extra_info["baseline_s"]``, so that the report
    subtracts pairs that ran back to back under the same machine load.

    ``cycle``: ``method`` does its whole work once every ``cycle`` calls
    (an optimizer accumulating gradients updates on every ``cycle``-th):
    a sample is then whole cycles, each one update and the calls between,
    wherever in the cycle it starts.  With ``Settings.warmup_s`` (a fresh
    process per round), the method and its baseline run that long first.
    """
    seen = key in _calls
    if not seen:
        t0 = time.perf_counter()
        method()
        # The first call pays tracing, kernel creation and page faults:
        # a cost a user sees once per function, reported apart.
        benchmark.extra_info["first_call_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        method()
        once = max(time.perf_counter() - t0, 1e-9)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < Settings.warmup_s:
            method()
            if baseline is not None:
                baseline()
        if baseline is not None:
            baseline()
        calls = max(1, min(100_000, math.ceil(Settings.min_sample_s / once)))
        _calls[key] = (-(-calls // cycle) * cycle, once)
    calls, once = _calls[key]
    # Later rounds warm up again (the other peers have since evicted this
    # one's data from the caches) unless one call streams far more than any
    # cache holds anyway.
    warmup = 1 if seen and once < 0.02 else 0
    base = []

    def sample():
        for _ in range(calls):
            method()

    def settle():
        if baseline is not None:
            time.sleep(SETTLE_S)
            t0 = time.perf_counter()
            for _ in range(calls):
                baseline()
            base.append((time.perf_counter() - t0) / calls)
        time.sleep(SETTLE_S)

    benchmark.extra_info.update(info)
    benchmark.extra_info["calls_per_sample"] = calls
    if Settings.warmup_s:
        benchmark.extra_info["warmup_s"] = Settings.warmup_s
    benchmark.pedantic(sample, setup=settle, rounds=Settings.samples,
                       warmup_rounds=warmup, iterations=1)
    if baseline is not None:
        benchmark.extra_info["baseline_s"] = base[-Settings.samples:]
