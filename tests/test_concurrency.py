"""The core and the ops under concurrency: many callers at once give what
one caller gives, bit for bit.

Every concurrent result is compared with a serial run of the same calls and
with an independent oracle (numpy / ml_dtypes for the core, TensorFlow's own
ops and the float32 model of ``rule_model`` for the ops).  The core's own
thread pool is on (two threads) while Python threads call it, so calls race
for the pool, fall back to running inline, and split lists across workers,
all at once; the thread count is changed under running calls; and a process
forked while the pool is busy can still use the core.
"""

import os
import subprocess
import sys
import textwrap
import threading

import ml_dtypes
import numpy as np
import pytest
import tensorflow as tf

from helpers import child_env, same_bits
from lossscale import core, ops
from rule_model import F32, keras3_step, tf24_step

BF16 = np.dtype(ml_dtypes.bfloat16)
DTYPES = (np.float16, BF16, np.float32, np.float64)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_threads(target, args_list, timeout=120):
    """Runs target(*args) in one thread each, released together; re-raises the
    first error of any thread."""
    barrier = threading.Barrier(len(args_list))
    errors = []

    def body(*args):
        try:
            barrier.wait()
            target(*args)
        except BaseException as exc:  # reported in the main thread
            errors.append(exc)

    threads = [threading.Thread(target=body, args=args) for args in args_list]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a thread is stuck"
    if errors:
        raise errors[0]


# ------------------------------------------------------------------ core

def numpy_unscale(x, s):
    """The documented result: x * s rounded to x's dtype (numpy, ml_dtypes)."""
    with np.errstate(all="ignore"):
        if x.dtype == BF16:
            return (x.astype(np.float32) * np.float32(ml_dtypes.bfloat16(s))).astype(BF16)
        return x * x.dtype.type(s)


def core_jobs(seed=0, n_threads=16):
    """Per thread: a list of arrays (mixed dtypes and sizes, some with inf/NaN
    or values that overflow once scaled) and a scale."""
    rng = np.random.default_rng(seed)
    jobs = []
    for t in range(n_threads):
        arrays = []
        for k in range(int(rng.integers(1, 6))):
            dtype = DTYPES[(t + k) % 4]
            n = int(rng.choice([7, 1000, 65_537, 140_000, 400_003]))
            a = (rng.standard_normal(n) * 4).astype(dtype)
            if k == 0 and t % 4 == 0:
                a[int(rng.integers(n))] = np.inf
            elif k == 0 and t % 4 == 1:
                a[n - 1] = np.nan
            elif k == 0 and t % 4 == 2:  # overflows when the scale is above 1
                a[int(rng.integers(n))] = ml_dtypes.finfo(dtype).max
            arrays.append(a)
        scale = [0.5, 1.0 / 3.0, 2.0 ** -7, 1000.0, 3.0, 2.0 ** 10][t % 6]
        jobs.append((arrays, scale))
    return jobs


def core_call(arrays, scale):
    """One unscale_ of copies and all_finite before and after."""
    out = [a.copy() for a in arrays]
    finite_in = core.all_finite(arrays)
    finite_out = core.unscale_(out, scale)
    checked = [a.copy() for a in arrays]
    finite_checked = core.unscale_(checked, scale, check_inputs=True)
    return out, finite_in, finite_out, checked, finite_checked, core.all_finite(out)


def assert_same_result(got, want, where):
    out, f_in, f_out, checked, f_checked, f_after = got
    w_out, wf_in, wf_out, w_checked, wf_checked, wf_after = want
    assert (f_in, f_out, f_checked, f_after) == (wf_in, wf_out, wf_checked, wf_after), where
    assert all(same_bits(a, b) for a, b in zip(out, w_out)), where
    assert all(same_bits(a, b) for a, b in zip(checked, w_checked)), where


@pytest.fixture
def two_core_threads():
    core.set_num_threads(2)
    yield
    core.set_num_threads(0)


def test_sixteen_python_threads_with_the_pool_on(two_core_threads):
    jobs = core_jobs()
    assert sum(a.size for arrays, _ in jobs for a in arrays) > 8 * (1 << 17)
    # Oracle: numpy; the serial run of the core must match it first.
    serial = []
    for arrays, scale in jobs:
        want = [numpy_unscale(a, scale) for a in arrays]
        result = core_call(arrays, scale)
        assert all(same_bits(a, b) for a, b in zip(result[0], want))
        assert all(same_bits(a, b) for a, b in zip(result[3], want))
        assert result[1] == all(np.isfinite(a.astype(np.float64)).all() for a in arrays)
        assert result[2] == all(np.isfinite(w.astype(np.float64)).all() for w in want)
        assert result[4] == result[1] and result[5] == result[2]
        serial.append(result)
    assert any(r[1] for r in serial) and not all(r[1] for r in serial)
    assert any(r[1] and not r[2] for r in serial), "no job overflows on unscaling"
    originals = [[a.copy() for a in arrays] for arrays, _ in jobs]

    def worker(t, rounds=40):
        arrays, scale = jobs[t]
        frozen = arrays[-1].copy()
        frozen.setflags(write=False)
        for r in range(rounds):
            assert_same_result(core_call(arrays, scale), serial[t], (t, r))
            if r % 4 == t % 4:
                # A rejected call among the others leaves nothing behind.
                copies = [a.copy() for a in arrays] + [frozen]
                with pytest.raises(ValueError, match="read-only"):
                    core.unscale_(copies, scale)
                assert all(same_bits(c, a) for c, a in zip(copies, arrays))

    run_threads(worker, [(t,) for t in range(len(jobs))])
    for (arrays, _), before in zip(jobs, originals):
        assert all(same_bits(a, b) for a, b in zip(arrays, before)), "an input was written"


def test_thread_count_changed_under_running_calls():
    """Calls in flight while another thread keeps changing the thread count:
    the count is read once per call, and every answer stays the same."""
    jobs = core_jobs(seed=1, n_threads=6)
    serial = [core_call(arrays, scale) for arrays, scale in jobs]
    stop = threading.Event()

    def changer():
        counts = [1, 2, 3, 0, 7, 2]
        i = 0
        while not stop.is_set():
            core.set_num_threads(counts[i % len(counts)])
            i += 1

    def worker(t):
        for r in range(16):
            assert_same_result(core_call(*jobs[t]), serial[t], (t, r))

    flipper = threading.Thread(target=changer)
    flipper.start()
    try:
        run_threads(worker, [(t,) for t in range(len(jobs))])
    finally:
        stop.set()
        flipper.join()
        core.set_num_threads(0)


def test_many_threads_unscale_disjoint_parts_of_one_buffer(two_core_threads):
    """Threads write into neighbouring slices of one array at once; the
    whole array ends as one serial unscale of it would leave it."""
    base = (np.random.default_rng(3).standard_normal(1 << 20) * 100).astype(np.float32)
    base[12345] = np.inf
    want = numpy_unscale(base, 1.0 / 3.0)
    work = base.copy()
    edges = np.linspace(0, base.size, 17).astype(int)
    # Odd sizes so slices start and end off any SIMD or grain boundary.
    edges[1:-1] += np.arange(1, 16) * 3
    flags = {}

    def worker(i):
        flags[i] = core.unscale_(work[edges[i]:edges[i + 1]], 1.0 / 3.0)

    run_threads(worker, [(i,) for i in range(16)])
    assert same_bits(work, want)
    holder = int(np.searchsorted(edges, 12345, side="right")) - 1
    assert [i for i in range(16) if not flags[i]] == [holder]


FORK_SCRIPT = textwrap.dedent("""
    import os, signal, sys, threading
    import numpy as np
    from lossscale import core

    core.set_num_threads(2)
    big = np.random.default_rng(0).standard_normal(1 << 21).astype(np.float32)
    want = big * np.float32(0.25)
    stop = threading.Event()

    def hammer():
        # keeps the pool busy (and its lock held) while the main thread forks
        while not stop.is_set():
            y = big.copy()
            assert core.unscale_(y, 0.25) and np.array_equal(y, want)

    t = threading.Thread(target=hammer)
    t.start()
    failures = 0
    for _ in range(int(sys.argv[1])):
        pid = os.fork()
        if pid == 0:
            signal.alarm(20)  # a deadlocked child dies instead of hanging the test
            ok = True
            for _ in range(3):
                y = big.copy()
                ok &= core.unscale_(y, 0.25) and np.array_equal(y, want)
                ok &= core.all_finite(y)
            os._exit(0 if ok else 3)
        _, status = os.waitpid(pid, 0)
        failures += status != 0
    stop.set()
    t.join()
    print("forks failed:", failures)
    sys.exit(1 if failures else 0)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork()")
def test_fork_while_the_pool_is_busy():
    """The atfork handler gives a child a fresh pool: a child forked while the
    parent's workers run (and the pool's lock is held) unscales correctly
    and does not deadlock."""
    proc = subprocess.run([sys.executable, "-c", FORK_SCRIPT, "20"], cwd=ROOT, env=child_env(),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "forks failed: 0" in proc.stdout


FIRST_USE_SCRIPT = textwrap.dedent("""
    import sys, threading
    import ml_dtypes
    import numpy as np
    from lossscale import core

    core.set_num_threads(2)
    dtypes = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
    rng = np.random.default_rng(0)
    work = [(rng.standard_normal(300_001 + 7 * t) * 50).astype(dtypes[t % 4])
            for t in range(16)]
    barrier = threading.Barrier(len(work) + 1)
    results = {}

    def first_call(t):
        barrier.wait()
        y = work[t].copy()
        results[t] = (core.unscale_(y, 0.125), y, core.all_finite(work[t]))

    threads = [threading.Thread(target=first_call, args=(t,)) for t in range(len(work))]
    for th in threads:
        th.start()
    barrier.wait()  # the kernels are chosen by whichever thread gets there first
    levels = {core.simd_level() for _ in range(3)}
    for th in threads:
        th.join()
    bad = 0
    for t, x in enumerate(work):
        ok, y, finite = results[t]
        if x.dtype == np.dtype(ml_dtypes.bfloat16):
            want = (x.astype(np.float32) * np.float32(0.125)).astype(x.dtype)
        else:
            want = x * x.dtype.type(0.125)
        bad += not (ok and finite and y.tobytes() == want.tobytes())
    print("level", levels.pop(), "bad", bad)
""")

@pytest.mark.parametrize("level", core.simd_levels())
def test_first_use_from_many_threads_at_once(level):
    """In a fresh process, sixteen threads make the very first calls together,
    so the lazy choice of kernels and the pool's start race each other."""
    proc = subprocess.run([sys.executable, "-c", FIRST_USE_SCRIPT], cwd=ROOT,
                          env=child_env(LOSSSCALE_SIMD=level),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.split() == ["level", level, "bad", "0"], proc.stdout + proc.stderr


# ------------------------------------------------------------------ ops

def tf_reference(grads, scale):
    """TensorFlow's own ops: g * cast(1 / scale, g.dtype), and the finite flag."""
    inv = 1.0 / tf.constant(scale, tf.float32)
    outs = [g * tf.cast(inv, g.dtype) for g in grads]
    finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(o)) for o in outs])
    return [o.numpy() for o in outs], bool(finite)


def tf_jobs(seed=5, n=8):
    rng = np.random.default_rng(seed)
    dtypes = (tf.float16, tf.bfloat16, tf.float32, tf.float64)
    jobs = []
    for t in range(n):
        grads = []
        for k in range(1 + t % 4):
            dtype = dtypes[(t + k) % 4]
            shape = [int(s) for s in rng.choice([3, 64, 257, 1024], size=1 + k % 2)]
            values = rng.standard_normal(shape) * 8
            if (t + k) % 3 == 0:
                values.flat[int(rng.integers(values.size))] = np.inf if k % 2 else np.nan
            grads.append(tf.constant(values, dtype))
        scale = float([2.0 ** 10, 3.0, 0.75, 1e-3][t % 4])
        jobs.append((grads, scale))
    return jobs


def test_tf_functions_from_many_threads_match_serial_and_tensorflow():
    """Distinct tf.functions (traced concurrently on first use, one signature
    per thread) calling unscale_and_check and all_finite at once."""
    unscale = tf.function(lambda g, s: ops.unscale_and_check(g, s))
    unscale_inputs = tf.function(lambda g, s: ops.unscale_and_check(g, s, check_inputs=True))
    finite = tf.function(lambda g: ops.all_finite(g))
    jobs = tf_jobs()
    want = [tf_reference(grads, scale) for grads, scale in jobs]
    want_inputs = [all(bool(tf.reduce_all(tf.math.is_finite(g))) for g in grads)
                   for grads, _ in jobs]
    assert any(w[1] for w in want) and not all(w[1] for w in want)
    results = {}

    def calls(t):
        grads, scale = jobs[t]
        s = tf.constant(scale, tf.float32)
        out, f = unscale(grads, s)
        out2, f2 = unscale_inputs(grads, s)
        eager_out, eager_f = ops.unscale_and_check(grads, scale)
        return ([o.numpy() for o in out], bool(f), [o.numpy() for o in out2], bool(f2),
                [o.numpy() for o in eager_out], bool(eager_f), bool(finite(grads)))

    serial = [calls(t) for t in range(len(jobs))]
    for t, got in enumerate(serial):
        ref_out, ref_f = want[t]
        for outs in (got[0], got[2], got[4]):
            assert all(same_bits(a, b) for a, b in zip(outs, ref_out)), t
        assert (got[1], got[3], got[5], got[6]) == (ref_f, want_inputs[t], ref_f,
                                                    want_inputs[t]), t

    # Fresh functions, so that the threads also trace them at the same time.
    unscale = tf.function(lambda g, s: ops.unscale_and_check(g, s))
    unscale_inputs = tf.function(lambda g, s: ops.unscale_and_check(g, s, check_inputs=True))
    finite = tf.function(lambda g: ops.all_finite(g))

    def worker(t):
        for r in range(20):
            got = calls(t)
            results[t, r] = got
            assert got[1::2] == serial[t][1::2], (t, r)
            for i in (0, 2, 4):
                assert all(same_bits(a, b) for a, b in zip(got[i], serial[t][i])), (t, r, i)

    run_threads(worker, [(t,) for t in range(len(jobs))])
    assert len(results) == 20 * len(jobs)


def flags_for(t, steps):
    rng = np.random.default_rng(100 + t)
    return [bool(f) for f in rng.random(steps) > [0.1, 0.3, 0.5][t % 3]]


RULES = [
    dict(rule="tf24", increment_period=3, multiplier=2.0),
    dict(rule="tf24", increment_period=2, multiplier=3.0, hysteresis=2, min_loss_scale=0.5),
    dict(rule="tf24", increment_period=4, backoff_factor=0.75, max_loss_scale=2.0 ** 20),
    dict(rule="keras3", increment_period=2, multiplier=2.0),
]


def model_trajectory(config, flags, scale0):
    state = (F32(scale0), 0, 0, 0)
    kwargs = dict(period=config["increment_period"], multiplier=config.get("multiplier", 2.0))
    for f in flags:
        if config["rule"] == "keras3":
            state = keras3_step(state, f, **kwargs)
        else:
            state = tf24_step(state, f, backoff_factor=config.get("backoff_factor"),
                              min_loss_scale=config.get("min_loss_scale", 1.0),
                              max_loss_scale=config.get("max_loss_scale"),
                              hysteresis=config.get("hysteresis", 1), **kwargs)
    return state


def test_update_ops_on_their_own_variables_from_many_threads():
    """Each thread steps its own loss-scale variables through its own flag
    sequence with one of several tf.functions; every trajectory equals the
    float32 model's, as it does when run alone."""
    n_threads, steps = 8, 80

    def make(t):
        config = RULES[t % len(RULES)]
        counter_dtype = tf.int32 if config["rule"] == "keras3" else tf.int64
        variables = dict(scale=tf.Variable(2.0 ** (8 + t)),
                         counter=tf.Variable(0, dtype=counter_dtype),
                         overflow_run=tf.Variable(0, dtype=tf.int64),
                         skipped=tf.Variable(0, dtype=tf.int64))
        if config["rule"] == "keras3":
            variables["overflow_run"] = None
        kwargs = {k: v for k, v in config.items()}

        @tf.function
        def step(finite):
            return ops.update_loss_scale(finite, variables["scale"], variables["counter"],
                                         overflow_run=variables["overflow_run"],
                                         skipped=variables["skipped"], **kwargs)

        return variables, step

    def state(variables):
        run = variables["overflow_run"]
        return (variables["scale"].numpy().tobytes(), int(variables["counter"].numpy()),
                0 if run is None else int(run.numpy()), int(variables["skipped"].numpy()))

    def drive(t, variables, step, trace):
        for f in flags_for(t, steps):
            applied = bool(step(tf.constant(f)))
            assert applied == f
            trace.append(state(variables))

    serial, traces = [], {}
    for t in range(n_threads):
        variables, step = make(t)
        trace = []
        drive(t, variables, step, trace)
        serial.append(trace)
        config = RULES[t % len(RULES)]
        scale, good, run, skipped = model_trajectory(config, flags_for(t, steps), 2.0 ** (8 + t))
        want = (F32(scale).tobytes(), good,
                run if config["rule"] != "keras3" else 0, skipped)
        assert trace[-1] == want, (t, trace[-1], want)

    made = [make(t) for t in range(n_threads)]

    def worker(t):
        traces[t] = []
        drive(t, *made[t], traces[t])

    run_threads(worker, [(t,) for t in range(n_threads)])
    for t in range(n_threads):
        assert traces[t] == serial[t], t


def test_concurrent_updates_of_shared_variables_are_atomic():
    """Finite steps from many threads on the same variables: with every
    update atomic, the end state depends only on how many there were."""
    scale = tf.Variable(8.0)
    counter = tf.Variable(0, dtype=tf.int64)
    step = tf.function(lambda f: ops.update_loss_scale(f, scale, counter, increment_period=7))
    n_threads, per_thread = 8, 100

    def worker():
        for _ in range(per_thread):
            step(tf.constant(True))

    run_threads(worker, [()] * n_threads)
    state = (F32(8.0), 0, 0, 0)
    for _ in range(n_threads * per_thread):
        state = tf24_step(state, True, period=7)
    assert scale.numpy().tobytes() == F32(state[0]).tobytes()
    assert int(counter.numpy()) == state[1]


def test_fused_steps_and_tensorflows_training_ops_share_variables():
    """The fused step and TensorFlow's own training ops on the same
    variables from many threads: every op takes its variables' locks in
    TensorFlow's order (no deadlock, though each fused step locks all six
    and TensorFlow's ResourceApplyMomentum two at a time) and holds them for
    its whole update (no update lost).  Every value stays a small integer,
    so the end state depends only on how many updates ran."""
    import keras
    from lossscale import LossScaleOptimizer

    rounds, fusing, descending = 25, 3, 2
    # Pairs of one shape, for ResourceApplyMomentum's var and accum; the
    # list the fused step takes in the reverse order of their creation.
    variables = [keras.Variable(np.zeros(5000 + 37 * (i // 2), np.float32), name=f"shared_{i}")
                 for i in range(6)][::-1]
    opt = LossScaleOptimizer(keras.optimizers.SGD(1.0), initial_scale=4.0,
                             dynamic_growth_steps=10 ** 9)
    opt.build(variables)
    # Scaled by 4, unscaled to ones: each fused step takes 1 from every value.
    grads = [tf.constant(np.full(v.shape, 4.0, np.float32)) for v in variables]
    fused = tf.function(lambda: opt.apply(grads, variables))
    fused()
    assert opt.step_path == "fused (SGD)"
    handles = [v.value.handle for v in variables]

    def descend(i):
        # TensorFlow's own update: takes 1 from every value of variable i.
        tf.raw_ops.ResourceApplyGradientDescent(var=handles[i], alpha=1.0,
                                                delta=tf.ones(variables[i].shape),
                                                use_locking=True)

    def lock_pair(i, j):
        # Locks variables i and j (var, accum) and writes both unchanged:
        # accum * 1 + 0, then var - 0 * accum.
        tf.raw_ops.ResourceApplyMomentum(var=handles[i], accum=handles[j], lr=0.0,
                                         grad=tf.zeros(variables[j].shape), momentum=1.0,
                                         use_locking=True)

    def worker(kind):
        for _ in range(rounds):
            if kind == "fused":
                fused()
            elif kind == "descend":
                for i in range(len(variables)):
                    descend(i)
            else:
                for i in range(0, len(variables), 2):
                    lock_pair(i, i + 1)
                    lock_pair(i + 1, i)

    run_threads(worker, [("fused",)] * fusing + [("descend",)] * descending + [("pairs",)] * 2)
    want = -(1 + (fusing + descending) * rounds)
    for v in variables:
        np.testing.assert_array_equal(v.numpy(), np.full(v.shape, want, np.float32))


def test_core_and_ops_at_the_same_time(two_core_threads):
    """numpy-core callers and TensorFlow-op callers side by side (the op runs
    on TensorFlow's pool, the core on its own): neither disturbs the other."""
    core_work = core_jobs(seed=9, n_threads=4)
    core_serial = [core_call(arrays, scale) for arrays, scale in core_work]
    tf_work = tf_jobs(seed=11, n=4)
    tf_want = [tf_reference(grads, scale) for grads, scale in tf_work]
    fn = tf.function(lambda g, s: ops.unscale_and_check(g, s))

    def worker(kind, t):
        for r in range(12):
            if kind == "core":
                assert_same_result(core_call(*core_work[t]), core_serial[t], (t, r))
            else:
                grads, scale = tf_work[t]
                out, f = fn(grads, tf.constant(scale))
                assert bool(f) == tf_want[t][1], (t, r)
                assert all(same_bits(o.numpy(), w) for o, w in zip(out, tf_want[t][0])), (t, r)

    run_threads(worker, [("core", t) for t in range(4)] + [("tf", t) for t in range(4)])


def test_core_inside_tf_functions_on_tensorflows_threads(two_core_threads):
    """The core called from TensorFlow's own inter-op threads: independent
    ``tf.numpy_function`` branches of one graph, several graphs run from
    several Python threads at once."""
    jobs = core_jobs(seed=13, n_threads=6)
    flat = [(a, scale) for arrays, scale in jobs for a in arrays[:2]]
    want = [(numpy_unscale(a, s), bool(np.isfinite(numpy_unscale(a, s).astype(np.float64)).all()))
            for a, s in flat]

    def unscale_copy(x, s):
        y = x.copy()
        return y, np.bool_(core.unscale_(y, float(s)))

    def branches(inputs):
        results = []
        for x, (a, s) in zip(inputs, flat):
            out, ok = tf.numpy_function(unscale_copy, [x, tf.constant(s, tf.float64)],
                                        [x.dtype, tf.bool], stateful=False)
            results.append((out, ok))
        return results

    graphs = [tf.function(branches) for _ in range(3)]
    inputs = [tf.constant(a) if a.dtype != BF16 else tf.constant(a, tf.bfloat16)
              for a, _ in flat]

    def worker(g):
        for r in range(5):
            for i, (out, ok) in enumerate(graphs[g](inputs)):
                assert bool(ok) == want[i][1], (g, r, i)
                assert same_bits(out.numpy(), want[i][0]), (g, r, i)

    run_threads(worker, [(g,) for g in range(len(graphs))])
