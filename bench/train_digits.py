"""A real training run: a small CNN on the handwritten digits that ship inside
scikit-learn (1,797 8x8 images, no download), trained three ways from the
same seed and the same initial weights:

* ``float32``        -- no mixed precision, no loss scaling (the reference);
* ``mixed_stock``    -- ``mixed_float16`` layers, stock
                        ``keras.optimizers.LossScaleOptimizer``;
* ``mixed_lossscale``-- the same model with ``lossscale.LossScaleOptimizer``.

The loss scale starts at 2**15 and may grow every ``GROWTH_STEPS`` steps
(Keras' default is 2,000, longer than this whole run; a short period makes
the scale climb until float16 gradients overflow, so the run exercises the
back-off and the skipped steps as well as the growth).  Recorded per run:
test accuracy and loss, the loss scale after every step, the skipped steps
and the step time (median over every step after the first epoch, which
includes tracing).  The two mixed runs must end with the same accuracy, and
in fact with bit-identical weights, since the lossscale optimizer is
bit-exact against the stock one; ``run`` checks both and says so.

    python bench/train_digits.py [--epochs 30] [--json out.json]
"""

import argparse
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np  # noqa: E402

GROWTH_STEPS = 100
BATCH = 32
KINDS = ("float32", "mixed_stock", "mixed_lossscale")


def load_digits():
    """Train/test split of sklearn's digits as float32 images in [0, 1]."""
    from sklearn.datasets import load_digits as sk_load
    from sklearn.model_selection import train_test_split

    d = sk_load()
    x = (d.images / 16.0).astype(np.float32)[..., None]
    return train_test_split(x, d.target.astype(np.int32), test_size=0.25, random_state=0,
                            stratify=d.target)


def build_model(kind, seed=0):
    import keras

    keras.utils.set_random_seed(seed)
    policy = "float32" if kind == "float32" else "mixed_float16"
    return keras.Sequential([
        keras.Input((8, 8, 1)),
        keras.layers.Conv2D(32, 3, padding="same", activation="relu", dtype=policy),
        keras.layers.Conv2D(64, 3, activation="relu", dtype=policy),
        keras.layers.MaxPooling2D(dtype=policy),
        keras.layers.Flatten(dtype=policy),
        keras.layers.Dense(128, activation="relu", dtype=policy),
        keras.layers.Dense(10, dtype="float32"),
    ])


def make_optimizer(kind, growth_steps=GROWTH_STEPS):
    import keras

    inner = keras.optimizers.SGD(0.05, momentum=0.9)
    if kind == "float32":
        return inner
    if kind == "mixed_stock":
        cls = keras.optimizers.LossScaleOptimizer
    else:
        from lossscale import LossScaleOptimizer as cls
    return cls(inner, initial_scale=2.0 ** 15, dynamic_growth_steps=growth_steps)


def compiled(kind, seed=0, growth_steps=GROWTH_STEPS):
    import keras

    model = build_model(kind, seed)
    model.compile(optimizer=make_optimizer(kind, growth_steps),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
                  metrics=["accuracy"])
    return model


def _recorder(model):
    import keras

    class Recorder(keras.callbacks.Callback):
        def __init__(self):
            super().__init__()
            self.scales, self.step_s, self.epoch_of_step = [], [], []
            self.epoch = 0

        def on_epoch_begin(self, epoch, logs=None):
            self.epoch = epoch

        def on_train_batch_begin(self, batch, logs=None):
            self.t0 = time.perf_counter()

        def on_train_batch_end(self, batch, logs=None):
            self.step_s.append(time.perf_counter() - self.t0)
            self.epoch_of_step.append(self.epoch)
            opt = model.optimizer
            if hasattr(opt, "dynamic_scale"):
                self.scales.append(float(np.asarray(opt.dynamic_scale)))

    return Recorder()


def train(kind, epochs, data=None, seed=0):
    import tensorflow as tf

    tf.config.experimental.enable_op_determinism()
    x_train, x_test, y_train, y_test = data if data is not None else load_digits()
    model = compiled(kind, seed)
    rec = _recorder(model)
    t0 = time.perf_counter()
    hist = model.fit(x_train, y_train, batch_size=BATCH, epochs=epochs, shuffle=True,
                     verbose=0, callbacks=[rec])
    wall = time.perf_counter() - t0
    loss, acc = model.evaluate(x_test, y_test, batch_size=256, verbose=0)
    later = [s for s, e in zip(rec.step_s, rec.epoch_of_step) if e > 0] or rec.step_s
    skipped = 0
    if rec.scales:
        # A step that lowered the scale is a skipped (overflow) step.
        prev = [2.0 ** 15] + rec.scales[:-1]
        skipped = sum(1 for a, b in zip(prev, rec.scales) if b < a)
    return {
        "kind": kind,
        "epochs": epochs,
        "steps": len(rec.step_s),
        "test_accuracy": float(acc),
        "test_loss": float(loss),
        "train_loss": [float(v) for v in hist.history["loss"]],
        "loss_scale": rec.scales,
        "skipped_steps": skipped,
        "step_ms_median": statistics.median(later) * 1e3,
        "step_ms_min": min(later) * 1e3,
        "step_ms_max": max(later) * 1e3,
        "wall_s": wall,
        "weights": [w.copy() for w in model.get_weights()],
    }


def run(epochs=30):
    """Train all three; returns the results (weights replaced by a verdict)."""
    data = load_digits()
    runs = {kind: train(kind, epochs, data) for kind in KINDS}
    stock, ours = runs["mixed_stock"], runs["mixed_lossscale"]
    identical = (len(stock["weights"]) == len(ours["weights"]) and all(
        a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=True)
        for a, b in zip(stock["weights"], ours["weights"])))
    for r in runs.values():
        del r["weights"]
    return {
        "dataset": f"sklearn digits: {len(data[0])} train / {len(data[1])} test images, 8x8",
        "batch": BATCH,
        "growth_steps": GROWTH_STEPS,
        "runs": runs,
        "accuracy_equal": stock["test_accuracy"] == ours["test_accuracy"],
        "weights_identical": bool(identical),
        "scales_identical": stock["loss_scale"] == ours["loss_scale"],
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epochs", type=int, default=30)
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    result = run(args.epochs)
    for kind, r in result["runs"].items():
        print(f"{kind:>16}: test accuracy {r['test_accuracy']:.4f}, loss {r['test_loss']:.4f}, "
              f"step {r['step_ms_median']:.2f} ms, skipped {r['skipped_steps']}")
    print(f"accuracy equal: {result['accuracy_equal']}, weights bit-identical: "
          f"{result['weights_identical']}, loss-scale trajectories identical: "
          f"{result['scales_identical']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0 if result["accuracy_equal"] else 1


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    sys.exit(main())
