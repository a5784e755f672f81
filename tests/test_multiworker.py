"""Beyond one machine: two worker processes under MultiWorkerMirroredStrategy,
and two replicas in one process under MirroredStrategy, where only one
replica's gradients overflow.

The workers are this file run as a script with a ``TF_CONFIG`` of two
loopback ports (picked free, the launch retried on a collision); they train
in lockstep over gRPC collectives on the CPU and each prints one JSON report.
Every step feeds each worker its own batch; at chosen steps only worker 1's
(or only worker 0's) loss is non-finite or overflows float16.  Requirement:
both workers skip, and end every step with identical variables and scale.

Oracles, run in the same processes on identical model copies:

* ``lossscale.LossScaleOptimizer`` (Keras 3 rule) against the stock
  ``keras.optimizers.LossScaleOptimizer`` fed the same data with the
  overflow on *both* workers (a skipped step leaves nothing of its
  gradients, so the two must agree bit for bit).  Stock is never given a
  one-sided overflow: under this strategy it decides on each worker's own
  flag, so one worker would wait in the gradient all-reduce for a peer that
  skipped.
* TensorFlow 2.4's custom loop on ``lossscale.experimental`` and
  ``lossscale.LossScaleOptimizer(loss_scale=DynamicLossScale(...))`` against
  ``tf.compat.v1.mixed_precision.DynamicLossScale`` under the same strategy
  (it combines the replicas' flags itself) driving a plain optimizer.
* The float32 numpy model of the rules (``rule_model``) for every scale,
  and for the whole state (overflow run, skipped-step counter) of a
  ``DynamicLossScale`` with hysteresis, whose copies must agree too.

Under ``MirroredStrategy`` the same custom loops run, and ``Model.fit``
too: ours with a non-finite sample in one replica's half of a global batch,
stock with one in both halves.  The state the custom loops reach there is
checkpointed, restored without a strategy and back under one: it must come
back bit for bit, on every copy.
"""

import json
import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

import helpers
import rule_model

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
STEPS = 14
TIMEOUT = 240  # seconds for a whole run, TensorFlow's start-up included
# step -> the worker (replica) whose loss is spoiled, and how; "both": every one.
SPOILED = {3: (1, np.inf), 5: (0, np.nan), 8: ("both", np.inf), 10: (1, 1e30), 11: (1, -np.inf)}
INITIAL_SCALE, GROWTH = 2.0**10, 2
EXTENSIONS = dict(min_loss_scale=2.0**8, hysteresis=2, count_skipped_steps=True)


def factor(step, replica, both=False):
    """The loss factor of ``replica`` at ``step``; ``both``: a spoiled step
    spoils every replica."""
    if step not in SPOILED:
        return np.float32(1.0)
    who, value = SPOILED[step]
    return np.float32(value if both or who in ("both", replica) else 1.0)


def batch(step, replica):
    rng = np.random.default_rng([7, step, replica])
    x = rng.standard_normal((8, 6)).astype(np.float32)
    return x, np.tanh(x[:, :1] + 0.5 * x[:, 2:3]).astype(np.float32)


# --------------------------------------------------- inside a worker process

def build_all(strategy):
    """The model copies and their optimizers, made under the strategy."""
    import keras

    from helpers import mixed_mlp, tf_dynamic
    from lossscale import experimental
    from lossscale.loss_scale import DynamicLossScale
    from lossscale.optimizer import LossScaleOptimizer

    def sgd():
        return keras.optimizers.SGD(0.05, momentum=0.5)

    with strategy.scope():
        models = {name: mixed_mlp(0, hidden=10)
                  for name in ("ours", "stock", "tf24", "object", "extensions", "reference")}
        optimizers = {
            "ours": LossScaleOptimizer(sgd(), initial_scale=INITIAL_SCALE,
                                       dynamic_growth_steps=GROWTH),
            "stock": keras.optimizers.LossScaleOptimizer(sgd(), initial_scale=INITIAL_SCALE,
                                                         dynamic_growth_steps=GROWTH),
            "tf24": experimental.LossScaleOptimizer(
                sgd(), experimental.DynamicLossScale(INITIAL_SCALE, GROWTH)),
            "object": LossScaleOptimizer(
                sgd(), loss_scale=DynamicLossScale(INITIAL_SCALE, GROWTH)),
            "extensions": LossScaleOptimizer(
                sgd(), loss_scale=DynamicLossScale(INITIAL_SCALE, GROWTH, **EXTENSIONS)),
            "reference": sgd(),
        }
        reference_scale = tf_dynamic(INITIAL_SCALE, GROWTH)
        for name, opt in optimizers.items():
            opt.build(models[name].trainable_variables)
    return models, optimizers, reference_scale


def step_functions(strategy, models, optimizers, reference_scale):
    import tensorflow as tf

    from helpers import keras3_train_step, mse_loss, tf24_train_step

    def loss_of(model, x, y, f):
        return mse_loss(model, x, y, f) / strategy.num_replicas_in_sync

    def keras_step(model, opt):
        return keras3_train_step(model, opt, loss_of)

    def tf24_step(model, opt):
        return tf24_train_step(model, opt, loss_of)

    def reference_step(model, inner):
        """TensorFlow 2.4's LossScaleOptimizer step with TensorFlow's loss scale and ops."""
        def replica(x, y, f):
            with tf.GradientTape() as tape:
                scaled = loss_of(model, x, y, f) * reference_scale()
            grads = tape.gradient(scaled, model.trainable_variables)
            inv = 1.0 / reference_scale()
            grads = [g * tf.cast(inv, g.dtype) for g in grads]

            def cross_replica(distribution, grads):
                _, should_apply = reference_scale.update(grads)

                def apply():
                    distribution.extended.call_for_each_replica(
                        lambda g: inner.apply(g, model.trainable_variables), args=(grads,))

                def skip():
                    inner.iterations.assign_add(1)

                tf.cond(should_apply, apply, skip)

            tf.distribute.get_replica_context().merge_call(cross_replica, args=(grads,))
        return replica

    makers = {"ours": keras_step, "stock": keras_step, "tf24": tf24_step, "object": keras_step,
              "extensions": keras_step,
              "reference": reference_step}
    functions = {}
    for name, make in makers.items():
        replica = make(models[name], optimizers[name])

        def run(args, replica=replica):
            strategy.run(replica, args=args)  # the per-replica losses are not needed

        functions[name] = tf.function(run)
    return functions


def describe(models, optimizers, reference_scale):
    """Per model: a digest of the weights and the inner optimizer's slots,
    iterations, the loss-scale state, and whether the local copies of every
    one of them agree."""
    import hashlib

    import keras

    def local(v):
        v = v.value if isinstance(v, keras.Variable) else v
        copies = getattr(v, "values", None)
        return [np.asarray(c.numpy()) for c in copies] if copies else [np.asarray(v.numpy())]

    report = {}
    for name, model in models.items():
        opt = optimizers[name]
        inner = getattr(opt, "inner_optimizer", opt)
        digest, agree = hashlib.sha1(), True
        for v in list(model.variables) + [v for v in inner.variables
                                          if v is not inner.iterations]:
            copies = local(v)
            agree &= all(c.tobytes() == copies[0].tobytes() for c in copies)
            digest.update(copies[0].tobytes())
        # pylint: disable=protected-access
        if name == "reference":
            ls = reference_scale
        else:
            ls = getattr(opt, "loss_scale_object", None)
        if ls is not None:
            scale_state = [ls._current_loss_scale, ls._num_good_steps,
                           getattr(ls, "_overflow_run", None), getattr(ls, "_skipped_steps", None)]
        else:
            scale_state = [opt.dynamic_scale, opt.step_counter]
        values = []
        for v in scale_state:
            copies = [None] if v is None else local(v)
            agree &= all(c.tobytes() == copies[0].tobytes() for c in copies[1:])
            values.append(None if v is None else copies[0].item())
        report[name] = {"weights": digest.hexdigest(), "copies_agree": bool(agree),
                        "iterations": int(np.asarray(inner.iterations.numpy())),
                        "scale": float(values[0]), "counter": int(values[1]),
                        "extensions": values[2:]}
    return report


def run_worker():
    """One worker of the two-worker cluster in ``TF_CONFIG``."""
    import tensorflow as tf

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    worker = strategy.cluster_resolver.task_id
    models, optimizers, reference_scale = build_all(strategy)
    functions = step_functions(strategy, models, optimizers, reference_scale)
    trace = []
    for step in range(STEPS):
        x, y = batch(step, worker)
        for name, function in functions.items():
            f = factor(step, worker, both=name == "stock")
            function((tf.constant(x), tf.constant(y), tf.constant(f)))
        trace.append(describe(models, optimizers, reference_scale))
    return {"worker": worker, "replicas": strategy.num_replicas_in_sync, "trace": trace}


def run_mirrored():
    """Two replicas on two logical CPUs of this process."""
    import tensorflow as tf

    strategy = helpers.two_cpu_replicas()
    models, optimizers, reference_scale = build_all(strategy)
    functions = step_functions(strategy, models, optimizers, reference_scale)

    def per_replica(fn):
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(fn(ctx.replica_id_in_sync_group)))

    trace = []
    for step in range(STEPS):
        x = per_replica(lambda r: batch(step, r)[0])
        y = per_replica(lambda r: batch(step, r)[1])
        for name, function in functions.items():
            f = per_replica(lambda r: factor(step, r, both=name == "stock"))
            function((x, y, f))
        trace.append(describe(models, optimizers, reference_scale))
    return {"worker": 0, "replicas": strategy.num_replicas_in_sync, "trace": trace,
            "checkpoint": mirrored_checkpoint(strategy, models, optimizers),
            "fit": mirrored_fit(strategy)}


def mirrored_checkpoint(strategy, models, optimizers):
    """The state reached under the strategy (skips included), checkpointed,
    restored without a strategy and, from there, into fresh copies under the
    strategy again: per model, whether every variable came back bit for bit
    (every copy of it, under the strategy), and the number of variables."""
    import shutil
    import tempfile

    import keras
    import tensorflow as tf

    def copies(v):
        v = v.value if isinstance(v, keras.Variable) else v
        return [np.asarray(c.numpy()).tobytes() for c in getattr(v, "values", [v])]

    def everything(model, opt):
        return list(model.variables) + list(opt.variables)

    directory = tempfile.mkdtemp()
    report = {}
    try:
        for name in ("ours", "tf24", "object", "extensions"):
            saved = [copies(v) for v in everything(models[name], optimizers[name])]
            path = tf.train.Checkpoint(model=models[name], optimizer=optimizers[name]).write(
                os.path.join(directory, name))
            plain_models, plain_optimizers, _ = build_all(tf.distribute.get_strategy())
            plain = (plain_models[name], plain_optimizers[name])
            tf.train.Checkpoint(model=plain[0], optimizer=plain[1]).read(path).assert_consumed()
            path = tf.train.Checkpoint(model=plain[0], optimizer=plain[1]).write(
                os.path.join(directory, name + "-plain"))
            fresh_models, fresh_optimizers, _ = build_all(strategy)
            fresh = (fresh_models[name], fresh_optimizers[name])
            tf.train.Checkpoint(model=fresh[0], optimizer=fresh[1]).read(path).assert_consumed()
            report[name] = {
                "variables": len(saved),
                "saved_copies_agree": all(len(set(c)) == 1 for c in saved),
                "plain": [copies(v) for v in everything(*plain)] == [c[:1] for c in saved],
                "mirrored": [copies(v) for v in everything(*fresh)] == saved,
            }
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return report


FIT_SPOILED = {3: (6, np.inf), 7: (1, np.nan), 8: (5, -np.inf)}  # batch -> (sample, value)


def mirrored_fit(strategy):
    """Model.fit, global batches of 8 split 4 and 4 over the replicas: ours
    with a non-finite sample in one replica's half of some batches, stock with
    one in both halves; the states after every batch must be the same."""
    import hashlib

    import keras
    import tensorflow as tf

    from helpers import batch_recorder, mixed_mlp
    from lossscale.optimizer import LossScaleOptimizer

    x, y = (np.concatenate(parts) for parts in zip(*(batch(100 + i, 0) for i in range(10))))

    def spoiled(both):
        x_ = x.copy()
        for b, (sample, value) in FIT_SPOILED.items():
            x_[8 * b + sample, sample % 6] = value
            if both:
                x_[8 * b + (sample + 4) % 8, sample % 6] = value
        return x_

    def snapshot(model, opt):
        """(digest of every variable, of the weights and slots only, copies agree)."""
        weights = list(model.variables) + [
            v for v in opt.inner_optimizer.variables if v is not opt.iterations]
        everything, trained, agree = hashlib.sha1(), hashlib.sha1(), True
        for v in list(model.variables) + list(opt.variables):
            tf_v = v.value if isinstance(v, keras.Variable) else v
            copies = [c.numpy().tobytes() for c in getattr(tf_v, "values", [tf_v])]
            agree &= len(set(copies)) == 1
            everything.update(copies[0])
            if any(v is w for w in weights):
                trained.update(copies[0])
        return everything.hexdigest(), trained.hexdigest(), bool(agree)

    runs = {}
    for name, cls in (("ours", LossScaleOptimizer), ("stock", keras.optimizers.LossScaleOptimizer)):
        with strategy.scope():
            model = mixed_mlp(0, hidden=10)
            model.compile(loss="mse", optimizer=cls(keras.optimizers.SGD(0.05, momentum=0.5),
                                                    initial_scale=INITIAL_SCALE,
                                                    dynamic_growth_steps=GROWTH))
        snapshots = batch_recorder(keras.callbacks, snapshot)
        model.fit(spoiled(both=name == "stock"), y, batch_size=8, shuffle=False, verbose=0,
                  callbacks=[snapshots])
        runs[name] = {"states": snapshots.states,
                      "iterations": int(model.optimizer.iterations.numpy()),
                      "scale": float(tf.convert_to_tensor(model.optimizer.dynamic_scale))}
    return runs


# ------------------------------------------------------------- the test side

# gRPC would send the loopback connections through a proxy.
PROXIES = ("http_proxy", "https_proxy", "grpc_proxy", "all_proxy")


def worker_env(tf_config=None, values=None):
    env = helpers.child_env(
        drop=("LOSSSCALE_FORCE_FALLBACK", "LOSSSCALE_SIMD", "TF_CONFIG")
        + PROXIES + tuple(name.upper() for name in PROXIES),
        TF_CPP_MIN_LOG_LEVEL="2", CUDA_VISIBLE_DEVICES="", **(values or {}))
    if tf_config is not None:
        env["TF_CONFIG"] = json.dumps(tf_config)
    return env


def free_ports(n):
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class Child:
    """A child process with its stdout and stderr in files: ``script`` (this
    file by default) run with the arguments ``mode`` and ``args``, and the
    variables in ``env`` set in its environment."""

    def __init__(self, mode, directory, name, tf_config=None, script=__file__, args=(),
                 env=None):
        self.out, self.log = directory / f"{name}.out", directory / f"{name}.log"
        with open(self.out, "wb") as stdout, open(self.log, "wb") as stderr:
            self.proc = subprocess.Popen([sys.executable, os.path.abspath(script), mode,
                                          *map(str, args)],
                                         cwd=ROOT, env=worker_env(tf_config, env), stdout=stdout,
                                         stderr=stderr)

    def tail(self):
        with open(self.log, "rb") as f:
            return f.read()[-4000:].decode(errors="replace")

    def report(self):
        with open(self.out, "rb") as f:
            return json.loads(f.read().decode().strip().splitlines()[-1])

    def kill(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=30)


class ChildFailed(AssertionError):
    def __init__(self, child):
        super().__init__(f"{child.out.stem} exited with {child.proc.returncode}; stderr:\n"
                         f"{child.tail()}")
        self.stderr = child.tail()


def collect(children, timeout):
    """Each child's JSON report.  Fails as soon as one child fails (a worker
    left alone would wait for its peer forever) or at the timeout, killing
    them all."""
    deadline = time.monotonic() + timeout
    try:
        while any(c.proc.poll() is None for c in children):
            for child in children:
                if child.proc.poll() not in (None, 0):
                    raise ChildFailed(child)
            if time.monotonic() > deadline:
                raise AssertionError(f"not finished in {timeout} s; stderr of each:\n" +
                                     "\n".join(c.tail() for c in children))
            time.sleep(0.1)
        for child in children:
            if child.proc.returncode != 0:
                raise ChildFailed(child)
    finally:
        for child in children:
            child.kill()
    return [child.report() for child in children]


def port_collision(stderr):
    return any(s in stderr.lower() for s in ("address already in use", "failed to add port",
                                              "could not start grpc server"))


def two_workers(directory, name="worker", script=__file__, mode="worker", args=(), env=None,
                timeout=TIMEOUT):
    """The reports of ``script`` run as the two workers of a cluster on two
    free loopback ports (its children ``Child``'s), the launch retried
    when a port was taken in the meantime."""
    for attempt in range(3):
        ports = free_ports(2)
        cluster = {"worker": [f"127.0.0.1:{p}" for p in ports]}
        workers = [Child(mode, directory, f"{name}{i}-{attempt}",
                         {"cluster": cluster, "task": {"type": "worker", "index": i}},
                         script=script, args=args, env=env)
                   for i in range(2)]
        try:
            return collect(workers, timeout)
        except ChildFailed as failure:
            if attempt == 2 or not port_collision(failure.stderr):
                raise
    raise AssertionError("unreachable")


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """The two workers' reports and the MirroredStrategy one, run side by side."""
    tmp = tmp_path_factory.mktemp("multiworker")
    children = [Child("mirrored", tmp, "mirrored")]
    try:
        workers = two_workers(tmp)
        (mirrored,) = collect(children, TIMEOUT)
    finally:
        for child in children:
            child.kill()
    return {"workers": workers, "mirrored": mirrored}


def overflowed(step):
    return step in SPOILED


def expected_states(rule, **kwargs):
    """(scale, counter, overflow run, skipped steps) after every step."""
    state = (np.float32(INITIAL_SCALE), 0, 0, 0)
    states = []
    for step in range(STEPS):
        state = rule(state, not overflowed(step), period=GROWTH, **kwargs)
        states.append((float(state[0]),) + tuple(int(v) for v in state[1:]))
    return states


def check_trace(trace):
    """The requirements on one process's trace of every step."""
    keras_scales = [state[0] for state in expected_states(rule_model.keras3_step)]
    tf24_states = expected_states(rule_model.tf24_step)
    extension_states = expected_states(rule_model.tf24_step, **{
        k: v for k, v in EXTENSIONS.items() if k != "count_skipped_steps"})
    applied = 0
    for step, now in enumerate(trace):
        before = trace[step - 1] if step else None
        where = f"step {step}"
        for name, state in now.items():
            assert state["copies_agree"], f"{where}: copies of {name}'s variables differ"
        # Ours equals stock fed the overflow on every replica.
        assert now["ours"] == now["stock"], where
        # The TensorFlow 2.4 paths equal TensorFlow's own loss scale.
        for name in ("tf24", "object"):
            for key in ("weights", "scale", "counter"):
                assert now[name][key] == now["reference"][key], f"{where}: {name} {key}"
        assert now["ours"]["scale"] == keras_scales[step], where
        assert now["reference"]["scale"] == tf24_states[step][0], where
        assert [now["extensions"][k] for k in ("scale", "counter")] + \
            now["extensions"]["extensions"] == list(extension_states[step]), where
        applied += not overflowed(step)
        assert (now["ours"]["iterations"] == now["object"]["iterations"]
                == now["extensions"]["iterations"] == applied), where
        # TensorFlow 2.4 counted skipped steps in `iterations`.
        assert now["tf24"]["iterations"] == now["reference"]["iterations"] == step + 1, where
        if before is not None:
            for name in now:
                changed = now[name]["weights"] != before[name]["weights"]
                assert changed != overflowed(step), \
                    f"{where}: {name} {'changed' if changed else 'kept'} its weights"


def test_two_workers_each_skip_when_one_overflows(reports):
    workers = reports["workers"]
    assert sorted(w["worker"] for w in workers) == [0, 1]
    assert all(w["replicas"] == 2 for w in workers)
    for w in workers:
        check_trace(w["trace"])


def test_two_workers_end_every_step_identical(reports):
    first, second = reports["workers"]
    for step, (a, b) in enumerate(zip(first["trace"], second["trace"])):
        assert a == b, f"step {step}: the workers differ"
    assert len(first["trace"]) == STEPS


def test_mirrored_replicas_skip_together(reports):
    mirrored = reports["mirrored"]
    assert mirrored["replicas"] == 2
    check_trace(mirrored["trace"])


def test_mirrored_state_checkpoints_to_one_device_and_back(reports):
    checkpoint = reports["mirrored"]["checkpoint"]
    assert sorted(checkpoint) == ["extensions", "object", "ours", "tf24"]
    for name, result in checkpoint.items():
        assert result == {"variables": result["variables"], "saved_copies_agree": True,
                          "plain": True, "mirrored": True}, name
        assert result["variables"] >= 8, name


def test_mirrored_fit_skips_together_as_stock_does_when_both_overflow(reports):
    ours, stock = reports["mirrored"]["fit"]["ours"], reports["mirrored"]["fit"]["stock"]
    assert len(ours["states"]) == 10
    assert ours == stock
    assert all(agree for _, _, agree in ours["states"])
    assert ours["iterations"] == 10 - len(FIT_SPOILED)
    weights = [trained for _, trained, _ in ours["states"]]
    for b in range(1, 10):
        assert (weights[b] == weights[b - 1]) == (b in FIT_SPOILED), f"batch {b}"


if __name__ == "__main__":
    result = {"worker": run_worker, "mirrored": run_mirrored}[sys.argv[1]]()
    print(json.dumps(result), flush=True)
