"""One process of the distributed benchmark (``test_distributed.py``): a
mixed_float16 ReLU MLP (``layers`` Dense layers of ``width``, no bias, 10
logits) trained with Adam under a strategy, the stock Keras loss-scale
optimizer against ours; prints one JSON line.

    distributed_child.py mirrored WIDTH LAYERS BATCH SAMPLES CALLS   # MirroredStrategy, 2 CPUs
    distributed_child.py worker WIDTH LAYERS BATCH SAMPLES CALLS     # one worker of TF_CONFIG

Timed per peer, each a ``tf.function`` over ``strategy.run``, in samples of
``CALLS`` back-to-back calls (the same number on every worker, whose
collectives must pair up; median of ``SAMPLES``): ``step``, the whole
custom-loop step (forward, backward, ``apply``); ``gradients``, the forward
and backward pass alone; and ``all_reduce``, the strategy's all-reduce of a
list of tensors shaped as the gradients, alone.  ``update`` is what the
step adds to the other two: the finite check, the unscale, the scale
update and the optimizer's own.  Before timing, fresh models trained a few
steps with ours and with stock from the same weights on the same batches
must end bit-identical.
"""

import json
import sys
import time

import numpy as np

CHECKED_STEPS = 3
SCALE = 2.0**8
INPUTS = 256


def main(mode, width, layers, batch, samples, calls):
    import tensorflow as tf

    if mode == "mirrored":
        cpu = tf.config.list_physical_devices("CPU")[0]
        tf.config.set_logical_device_configuration(
            cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
        strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    else:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
    import keras

    import lossscale

    replicas = strategy.num_replicas_in_sync
    task = 0 if mode == "mirrored" else strategy.cluster_resolver.task_id
    rng = np.random.default_rng([5, task])
    per_replica = max(1, batch // replicas)

    def local(fn):
        return strategy.experimental_distribute_values_from_function(
            lambda ctx: tf.constant(fn(ctx.replica_id_in_sync_group)))

    if mode == "mirrored":
        x = local(lambda r: rng.standard_normal((per_replica, INPUTS)).astype(np.float32))
        y = local(lambda r: rng.integers(0, 10, per_replica).astype(np.int32))
    else:
        x = tf.constant(rng.standard_normal((per_replica, INPUTS)).astype(np.float32))
        y = tf.constant(rng.integers(0, 10, per_replica).astype(np.int32))

    def model_and_optimizer(peer):
        with strategy.scope():
            keras.utils.set_random_seed(0)
            model = keras.Sequential(
                [keras.Input((INPUTS,))]
                + [keras.layers.Dense(width, activation="relu", use_bias=False,
                                      dtype="mixed_float16") for _ in range(layers)]
                + [keras.layers.Dense(10, dtype="float32")])
            cls = (keras.optimizers.LossScaleOptimizer if peer == "stock"
                   else lossscale.LossScaleOptimizer)
            opt = cls(keras.optimizers.Adam(1e-3), initial_scale=SCALE,
                      dynamic_growth_steps=10**9)
            opt.build(model.trainable_variables)
        return model, opt

    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True, reduction="none")

    def gradients(model, opt, x, y):
        with tf.GradientTape() as tape:
            loss = tf.reduce_sum(loss_fn(y, model(x, training=True))) / batch
            loss = opt.scale_loss(loss)
        return tape.gradient(loss, model.trainable_variables)

    def functions(model, opt):
        variables = model.trainable_variables

        @tf.function
        def step(x, y):
            def replica(x, y):
                opt.apply(gradients(model, opt, x, y), variables)
            strategy.run(replica, args=(x, y))

        @tf.function
        def grads_only(x, y):
            def replica(x, y):
                return tf.add_n([tf.reduce_sum(g) for g in gradients(model, opt, x, y)])
            return strategy.run(replica, args=(x, y))

        @tf.function
        def all_reduce_only():
            def replica():
                # Fresh values each call, as a step's gradients are.
                ones = [tf.ones(v.shape, tf.float32) * tf.cast(opt.iterations + 1, tf.float32)
                        for v in variables]
                sums = tf.distribute.get_replica_context().all_reduce(
                    tf.distribute.ReduceOp.SUM, ones)
                return tf.add_n([s[(0,) * len(s.shape)] for s in sums])
            return strategy.run(replica)

        return {"step": lambda: step(x, y), "gradients": lambda: grads_only(x, y),
                "all_reduce": all_reduce_only}

    def state(model, opt):
        out = []
        for v in list(model.variables) + list(opt.variables):
            v = v.value if isinstance(v, keras.Variable) else v
            out.append([c.numpy().tobytes() for c in getattr(v, "values", [v])])
        return out

    peers = ("ours", "stock")
    fresh = {p: model_and_optimizer(p) for p in peers}
    for p in peers:
        run = functions(*fresh[p])["step"]
        for _ in range(CHECKED_STEPS):
            run()
    identical = state(*fresh["ours"]) == state(*fresh["stock"])

    def timed(fn):
        fn()
        fn()
        per_call = []
        for _ in range(samples):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            per_call.append((time.perf_counter() - t0) / calls)
        return float(np.median(per_call))

    times = {}
    for p in peers:
        fns = functions(*fresh[p])
        times[p] = {name: timed(fn) for name, fn in fns.items()}
        times[p]["update"] = times[p]["step"] - times[p]["gradients"] - times[p]["all_reduce"]
    return {"mode": mode, "task": task, "replicas": replicas, "width": width, "layers": layers,
            "batch": batch, "params": int(sum(np.prod(v.shape)
                                              for v in fresh["ours"][0].trainable_variables)),
            "identical": identical, "path": fresh["ours"][1].step_path, "seconds": times}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], *map(int, sys.argv[2:7]))), flush=True)
