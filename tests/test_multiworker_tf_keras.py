"""tf_keras' optimizers on the fused step under ``MultiWorkerMirroredStrategy``:
two worker processes, each with one replica on its CPU, over TensorFlow's
collectives on loopback ports (``test_multiworker``'s launch).

The workers are this file run as a script with ``TF_USE_LEGACY_KERAS=1`` in
their environment (``tf.keras`` is then ``tf_keras``).  ``tf_keras``'
loss-scale optimizer unscales each worker's gradients, sums them with the
strategy's collective all-reduce and checks the sums; the fused step does
the same, then checks and applies in one pass.  Per optimizer kind, three
models train side by side from the same weights, each worker on its own
batch, in TensorFlow 2.4's custom loop (a ``tf.function`` of
``strategy.run``) and in ``fit`` of a ``tf.data.Dataset`` (sharded by data:
of each global batch of 8, the first 4 rows are worker 0's):

* ``stock``: ``tf_keras``' own ``LossScaleOptimizer``, every spoiled step
  spoiled on *both* workers;
* ``ours``: ``lossscale.LossScaleOptimizer`` fed the same;
* ``one``: ours with some spoiled steps spoiled on *one* worker only (the
  sums are non-finite on both: both skip).

Requirements, after every step: the three hold the same bits (every
variable, slot, ``iterations``, the loss scale and its counter), on both
workers alike; a spoiled step leaves ``one``'s weights and slots as they
were; ours' ``step_path`` says fused.
"""

import hashlib
import importlib.util
import json
import os
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("tf_keras") is None,
                                reason="tf_keras is not installed")

STEPS = 8
GROWTH = 2
INITIAL_SCALE = 2.0**10
WORKERS = 2
PER_WORKER = 4
# step -> (which worker, the value its loss (custom loop) or one input
# (fit) is multiplied by / set to); with a growth period of 2 the scale
# halves, grows, halves, grows and halves again.
SPOILED = {1: ("both", np.inf), 4: (1, np.nan), 7: (0, -np.inf)}
# kind -> (the inner optimizer, from the tf_keras module; its family).
KINDS = {
    "legacy_adam": (lambda k: k.optimizers.legacy.Adam(1e-2), "Adam"),
    "legacy_sgd_momentum": (lambda k: k.optimizers.legacy.SGD(1e-2, momentum=0.9), "SGD"),
    "adam": (lambda k: k.optimizers.Adam(1e-2), "Adam"),
    "rmsprop": (lambda k: k.optimizers.RMSprop(1e-3, momentum=0.5, centered=True), "RMSprop"),
    # The legacy optimizers clip the sums, as under MirroredStrategy.
    "legacy_adam_global_clipnorm": (lambda k: k.optimizers.legacy.Adam(
        1e-2, global_clipnorm=2.0), "Adam"),
    "legacy_sgd_clipnorm": (lambda k: k.optimizers.legacy.SGD(
        1e-2, momentum=0.9, clipnorm=1.0), "SGD"),
}
MODES = ("loop", "fit")
RUNS = ("stock", "ours", "one")


def factor(step, worker, one_sided):
    """What worker ``worker``'s loss is multiplied by at ``step``."""
    who, value = SPOILED.get(step, (None, 1.0))
    hit = who == "both" or who == worker or not one_sided
    return np.float32(value if hit else 1.0)


def batch(step, worker):
    rng = np.random.default_rng([23, step, worker])
    x = rng.standard_normal((PER_WORKER, 4)).astype(np.float32)
    return x, (np.tanh(x[:, :1] - 0.5 * x[:, 3:4]) * 4).astype(np.float32)


# --------------------------------------------------- inside a worker process

def run_worker():
    """Every kind, mode and run on this worker: per run, its state before
    the first step and after every step (a digest per variable), and its
    ``step_path``."""
    import tensorflow as tf
    import tf_keras

    import lossscale

    strategy = tf.distribute.MultiWorkerMirroredStrategy()
    worker = strategy.cluster_resolver.task_id
    tf_keras.mixed_precision.set_global_policy("mixed_float16")

    def make(kind, name):
        with strategy.scope():
            tf_keras.utils.set_random_seed(5)
            model = tf_keras.Sequential([
                tf_keras.layers.Dense(37, activation="relu"),
                tf_keras.layers.Dense(1, dtype="float32")])
            model.build((None, 4))
            cls = (tf_keras.mixed_precision.LossScaleOptimizer if name == "stock"
                   else lossscale.LossScaleOptimizer)
            opt = cls(KINDS[kind][0](tf_keras), initial_scale=INITIAL_SCALE,
                      dynamic_growth_steps=GROWTH)
        return model, opt

    def state(model, opt):
        """A digest of this worker's copy of every weight and slot, then of
        ``iterations``, the loss scale and its counter; and the scale."""
        variables = opt.inner_optimizer.variables
        variables = variables() if callable(variables) else variables
        loss_scale = opt._loss_scale  # pylint: disable=protected-access
        everything = (model.weights + [v for v in variables if v is not opt.iterations]
                      + [opt.iterations, loss_scale.current_loss_scale, loss_scale.counter])
        digests = []
        for v in everything:
            (copy,) = getattr(v, "values", [v])  # one replica per worker
            digests.append(hashlib.sha1(np.asarray(copy.numpy()).tobytes()).hexdigest())
        return {"digests": digests, "scale": float(loss_scale.current_loss_scale.numpy())}

    def loop(model, opt, name):
        def replica(x, y, f):
            with tf.GradientTape() as tape:
                pred = tf.cast(model(x), tf.float32)
                loss = opt.get_scaled_loss(tf.reduce_mean(tf.square(pred - y)) * f / WORKERS)
            grads = opt.get_unscaled_gradients(tape.gradient(loss, model.trainable_variables))
            opt.apply_gradients(zip(grads, model.trainable_variables))

        step = tf.function(lambda x, y, f: strategy.run(replica, args=(x, y, f)))
        states = []
        for s in range(STEPS):
            x, y = batch(s, worker)
            step(tf.constant(x), tf.constant(y), tf.constant(factor(s, worker, name == "one")))
            states.append(state(model, opt))
        return states

    def fit(model, opt, name):
        # Every worker makes the whole data; the strategy gives each its rows.
        x, y = (np.concatenate(p) for p in zip(*[batch(s, w) for s in range(STEPS)
                                                 for w in range(WORKERS)]))
        for s in range(STEPS):
            for w in range(WORKERS):
                value = factor(s, w, name == "one")
                if value != 1:
                    x[(s * WORKERS + w) * PER_WORKER + 1, 2] = value
        options = tf.data.Options()
        options.experimental_distribute.auto_shard_policy = (
            tf.data.experimental.AutoShardPolicy.DATA)
        data = tf.data.Dataset.from_tensor_slices((x, y)).batch(
            WORKERS * PER_WORKER).with_options(options)
        from helpers import batch_recorder

        with strategy.scope():
            model.compile(opt, "mse")
        recorder = batch_recorder(tf_keras.callbacks, state)
        model.fit(data, verbose=0, callbacks=[recorder])
        return recorder.states

    runs = {}
    for kind in KINDS:
        for mode, train in (("loop", loop), ("fit", fit)):
            for name in RUNS:
                model, opt = make(kind, name)
                before = state(model, opt)
                states = train(model, opt, name)
                runs[f"{kind} {mode} {name}"] = {
                    "before": before, "states": states,
                    "path": getattr(opt, "step_path", None)}
    return {"worker": worker, "replicas": strategy.num_replicas_in_sync,
            "legacy": tf.keras.optimizers.Adam is tf_keras.optimizers.Adam, "runs": runs}


# ------------------------------------------------------------- the test side

TIMEOUT = 420  # seconds for both workers, TensorFlow's start-up included


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """The two workers' reports."""
    from test_multiworker import two_workers

    return two_workers(tmp_path_factory.mktemp("multiworker_tf_keras"), script=__file__,
                       env={"TF_USE_LEGACY_KERAS": "1"}, timeout=TIMEOUT)


def test_two_tf_keras_workers(reports):
    assert sorted(r["worker"] for r in reports) == [0, 1]
    assert all(r["replicas"] == WORKERS and r["legacy"] for r in reports)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_fused_on_two_workers_bit_identical_to_tf_keras(reports, kind, mode):
    first, second = ({name: r["runs"][f"{kind} {mode} {name}"] for name in RUNS}
                     for r in reports)
    # The workers end every step with the same bits, every run.
    assert first == second
    runs = first
    assert runs["stock"]["path"] is None
    for name in ("ours", "one"):
        assert runs[name]["path"] == f"fused ({KINDS[kind][1]})", runs[name]["path"]
    assert runs["ours"]["before"] == runs["stock"]["before"] == runs["one"]["before"]
    assert [len(r["states"]) for r in runs.values()] == [STEPS] * 3
    states = {name: [s["digests"] for s in r["states"]] for name, r in runs.items()}
    before = [runs["one"]["before"]["digests"]] + states["one"][:-1]
    for step in range(STEPS):
        for name in ("ours", "one"):
            got, want = states[name][step], states["stock"][step]
            assert len(got) == len(want)
            bad = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
            assert not bad, f"{name}, step {step}: states {bad} differ from stock's"
        after = states["one"][step]
        if step in SPOILED:
            # Weights and slots as they were; iterations, scale and counter move.
            assert after[:-3] == before[step][:-3], f"step {step}: the skipped step moved"
        else:
            assert after[:4] != before[step][:4], f"step {step}: the weights did not move"
    # iterations: every step counts, skipped or not, as in tf_keras.
    assert len({s[-3] for s in states["stock"]}) == STEPS
    # The scale backed off at each spoiled step and grew in between.
    scales = [runs["stock"]["before"]["scale"]] + [s["scale"] for s in runs["stock"]["states"]]
    assert scales == [1024, 1024, 512, 512, 1024, 512, 512, 1024, 512]
    assert [s["scale"] for s in runs["one"]["states"]] == scales[1:]


if __name__ == "__main__":
    assert os.environ.get("TF_USE_LEGACY_KERAS") == "1"
    print(json.dumps({"worker": run_worker}[sys.argv[1]]()), flush=True)
