"""DynamicLossScale where it needs a process of its own.

* Distribution: ``MirroredStrategy`` over two logical CPU devices, which must
  be configured before TensorFlow initialises, so in a child process.  The
  oracle is TensorFlow's own class under the same strategy, and the rule.
* The forced fallback (``LOSSSCALE_FORCE_FALLBACK=1``): trajectories computed
  with plain TensorFlow ops in a child must equal the native ones computed
  here and TensorFlow's own class.

The child is this file run as a script (``python <this file> MODE DIR``); it
prints one JSON object on its last line.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from helpers import child_env

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
INF = float("inf")


def run_child(mode, directory, extra_env=None):
    env = child_env(drop=("LOSSSCALE_FORCE_FALLBACK",), **(extra_env or {}))
    proc = subprocess.run([sys.executable, os.path.abspath(__file__), mode, str(directory)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-5000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------- distribution

# (the replica whose gradients are non-finite, or None; how update() is called)
DISTRIBUTED_STEPS = [
    (None, "eager"), (None, "eager"), (1, "eager"), (None, "eager"), (0, "eager"),
    (None, "function"), (None, "function"), (None, "function"), (1, "function"),
    (None, "merge_call"), (1, "merge_call"), (None, "merge_call"), (None, "merge_call"),
    (None, "merge_call"), (0, "function"), (None, "eager"),
]


def child_distribute(directory):
    import tensorflow as tf

    from helpers import tf_dynamic, two_cpu_replicas

    strategy = two_cpu_replicas()  # before anything else runs TensorFlow
    import lossscale

    def reference():
        return tf_dynamic(1024.0, 3, 2.0)

    with strategy.scope():
        objects = {"ours": lossscale.DynamicLossScale(1024.0, 3, 2.0), "ref": reference()}

    def per_replica_grads(bad_replica):
        def value_fn(ctx):
            bad = ctx.replica_id_in_sync_group == bad_replica
            return [tf.constant([1.0, INF if bad else 2.0]), None,
                    tf.constant([[0.5, -0.25]], tf.float16),
                    tf.IndexedSlices(tf.constant([[3.0]]), tf.constant([1]), tf.constant([4, 1]))]
        return strategy.experimental_distribute_values_from_function(value_fn)

    def function_step(obj):
        return tf.function(lambda grads: obj.update(grads)[1])

    def merge_call_step(obj):
        # The way an optimizer calls it: from a replica function, through merge_call.
        @tf.function
        def step(bad_replica):
            def replica_fn():
                ctx = tf.distribute.get_replica_context()
                bad = tf.equal(ctx.replica_id_in_sync_group, bad_replica)
                grad = tf.where(bad, INF, 1.0) * tf.ones([3])
                return ctx.merge_call(lambda _, g: obj.update([g])[1], args=(grad,))
            return strategy.experimental_local_results(strategy.run(replica_fn))
        return step

    steppers = {name: {"eager": lambda bad, obj=obj: obj.update(per_replica_grads(bad))[1],
                       "function": lambda bad, f=function_step(obj): f(per_replica_grads(bad)),
                       "merge_call": lambda bad, f=merge_call_step(obj): f(
                           -1 if bad is None else bad)}
                for name, obj in objects.items()}

    def copies(variable):
        return [v.numpy().item() for v in variable.values]

    steps = []
    with strategy.scope():
        for bad_replica, how in DISTRIBUTED_STEPS:
            record = {}
            for name, obj in objects.items():
                apply = steppers[name][how](bad_replica)
                applies = [bool(a) for a in tf.nest.flatten(apply)]
                record[name] = {"apply": applies,
                                "scale": copies(obj._current_loss_scale),
                                "good_steps": copies(obj._num_good_steps)}
            steps.append(record)

    errors = {}
    for name, obj in objects.items():
        try:
            with strategy.scope():
                strategy.run(lambda obj=obj: obj.update([tf.constant([1.0])]))
            errors[name] = None
        except Exception as exc:  # noqa: BLE001 - its type is what is compared
            errors[name] = {"mro": [c.__name__ for c in type(exc).__mro__],
                            "message": str(exc)}

    # The mirrored variables checkpoint as plain ones: restore outside the strategy.
    prefix = tf.train.Checkpoint(loss_scale=objects["ours"]).write(
        os.path.join(directory, "ckpt"))
    plain = reference()
    tf.train.Checkpoint(loss_scale=plain).read(prefix).assert_consumed()

    return {"steps": steps, "errors": errors,
            "restored": [plain().numpy().item(), plain._num_good_steps.numpy().item()],
            "variable_type": type(objects["ours"]._current_loss_scale).__name__,
            "replicas": strategy.num_replicas_in_sync,
            "native": bool(__import__("lossscale.ops").ops.native_available())}


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    return run_child("distribute", tmp_path_factory.mktemp("distribute"))


def test_mirrored_strategy_skips_and_backs_off_exactly_once(distributed):
    assert distributed["replicas"] == 2
    assert distributed["variable_type"] == "MirroredVariable"
    scale, good = 1024.0, 0
    for i, ((bad_replica, how), step) in enumerate(zip(DISTRIBUTED_STEPS, distributed["steps"])):
        where = (i, bad_replica, how, step)
        # TensorFlow's class under the same strategy is the oracle ...
        assert step["ours"] == step["ref"], where
        # ... and so is the rule: one bad replica skips the step everywhere
        # and halves the scale once, not once per replica.
        if bad_replica is None:
            good += 1
            if good >= 3:
                scale, good = scale * 2, 0
        else:
            scale, good = max(scale / 2, 1.0), 0
        assert set(step["ours"]["apply"]) == {bad_replica is None}, where
        assert step["ours"]["scale"] == [scale, scale], where
        assert step["ours"]["good_steps"] == [good, good], where
    assert distributed["restored"] == [scale, good]
    from lossscale import ops

    assert distributed["native"] == bool(ops.native_available())


def test_update_in_replica_context_is_refused_like_reference(distributed):
    ours, ref = distributed["errors"]["ours"], distributed["errors"]["ref"]
    assert ref is not None and ours is not None
    assert ref["mro"][0] in ours["mro"]  # catchable as what TensorFlow raises
    assert "RuntimeError" in ours["mro"]
    assert "cross-replica" in ours["message"]


# --------------------------------------------------------- forced fallback

FALLBACK_CASES = ["period1-50%", "period1-overflows-float32", "period3-mult3-10%",
                  "below-one-inexact-mult1.1", "mult1.5-5%-bursts"]
FALLBACK_EAGER_STEPS = 120


def child_fallback(directory):
    import tensorflow as tf

    import lossscale
    import test_loss_scale as t
    from lossscale import ops

    cases = {c[0]: c for c in t.CASES}
    result = {"native": bool(ops.native_available()),
              "reason": ops.native_available().reason, "loop": {}, "eager": {}, "extensions": []}
    for name in FALLBACK_CASES:
        _, kwargs, rate, steps, bursty = cases[name]
        flags, m32, m16, m64 = t.case_data(name, rate, steps, bursty)
        (s, g, a), = t.loop_trajectories([lossscale.DynamicLossScale(**kwargs)], m32, m16, m64)
        result["loop"][name] = [s.tolist(), g.tolist(), a.tolist()]
        ours = lossscale.DynamicLossScale(**kwargs)
        eager = []
        for i in range(FALLBACK_EAGER_STEPS):
            apply = ours.update(t.gradient_list(m32[i], m16[i], m64[i]))[1]
            eager.append(list(t.state(ours)) + [bool(apply)])
        result["eager"][name] = eager
    flags = t.finite_flags(0.3, 200, True, seed=21)
    for extensions in t.EXTENSION_CASES:
        kwargs = dict(initial_loss_scale=1024.0, increment_period=3, multiplier=3.0)
        kwargs.update(extensions)
        obj = lossscale.DynamicLossScale(**kwargs)
        step = tf.function(lambda x, obj=obj: obj.update([x])[1])
        trace = []
        for finite in flags:
            apply = step(tf.constant([1.0, 2.0]) if finite else tf.constant([1.0, INF]))
            run = obj._overflow_run.numpy().item() if obj._overflow_run is not None else 0
            skipped = obj.skipped_steps.numpy().item() if obj.skipped_steps is not None else None
            trace.append(list(t.state(obj)) + [run, skipped, bool(apply)])
        result["extensions"].append({"kwargs": kwargs, "flags": flags.tolist(), "trace": trace})
    return result


@pytest.fixture(scope="module")
def fallback(tmp_path_factory):
    return run_child("fallback", tmp_path_factory.mktemp("fallback"),
                     {"LOSSSCALE_FORCE_FALLBACK": "1"})


def test_fallback_is_really_in_use(fallback):
    assert fallback["native"] is False
    assert "LOSSSCALE_FORCE_FALLBACK" in fallback["reason"]


@pytest.mark.parametrize("name", FALLBACK_CASES)
def test_fallback_trajectory_in_tf_function_equals_native_and_reference(fallback, name):
    import test_loss_scale as t

    import lossscale

    case = {c[0]: c for c in t.CASES}[name]
    _, kwargs, rate, steps, bursty = case
    flags, m32, m16, m64 = t.case_data(name, rate, steps, bursty)
    with t.reference_graphs_divide_exactly(kwargs.get("multiplier", 2.0)):
        native, ref = t.loop_trajectories(
            [lossscale.DynamicLossScale(**kwargs), t.reference(**kwargs)], m32, m16, m64)
    got = fallback["loop"][name]
    np.testing.assert_array_equal(ref[2], flags)
    for k, what in enumerate(("scale", "good_steps", "should_apply")):
        np.testing.assert_array_equal(np.asarray(got[k]), ref[k], err_msg=f"fallback {what}")
        np.testing.assert_array_equal(native[k], ref[k], err_msg=f"native {what}")


@pytest.mark.parametrize("name", FALLBACK_CASES)
def test_fallback_trajectory_eager_equals_reference(fallback, name):
    import test_loss_scale as t

    _, kwargs, rate, steps, bursty = {c[0]: c for c in t.CASES}[name]
    flags, m32, m16, m64 = t.case_data(name, rate, steps, bursty)
    ref = t.reference(**kwargs)
    for i, got in enumerate(fallback["eager"][name]):
        apply = ref.update(t.gradient_list(m32[i], m16[i], m64[i]))[1]
        assert got == list(t.state(ref)) + [bool(apply)], i


def test_fallback_extensions_follow_their_documented_rule(fallback):
    import test_loss_scale as t

    for case in fallback["extensions"]:
        kwargs = case["kwargs"]
        expected = list(t.extension_model(kwargs, case["flags"]))
        for i, (got, want) in enumerate(zip(case["trace"], expected)):
            scale, good, run, skipped, apply = want
            if not kwargs.get("count_skipped_steps"):
                skipped = None
            assert got == [scale, good, run, skipped, apply], (kwargs, i)


if __name__ == "__main__":
    children = {"distribute": child_distribute, "fallback": child_fallback}
    print(json.dumps(children[sys.argv[1]](sys.argv[2])))
