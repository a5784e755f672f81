"""A whole ``fit`` step: the digits CNN of ``train_digits.py`` in
mixed_float16 with the stock Keras loss-scale optimizer and with ours, and in
float32 without loss scaling for reference.

One sample is one epoch of ``fit`` over the 1,347 training images (batch
32, no shuffling; 256 images in the quick run); the report divides by its
steps.  The optimizer is a small
part of such a step (the model has 0.2M parameters), so this shows what a
user of a small model sees: no more than the scatter of the step time.
"""

import harness
import train_digits

LAYER = "fit"
PEERS = ["ours", "stock", "float32"]
KIND = {"ours": "mixed_lossscale", "stock": "mixed_stock", "float32": "float32"}


def items(settings):
    return [("digits_cnn/mixed_float16", p) for p in PEERS]


class Data:
    def __init__(self):
        self.x, _, self.y, _ = train_digits.load_digits()
        if harness.Settings.quick:
            self.x, self.y = self.x[:256], self.y[:256]
        self.steps = -(-len(self.x) // train_digits.BATCH)
        self.methods = {}

    def method(self, peer):
        if peer not in self.methods:
            model = train_digits.compiled(KIND[peer], growth_steps=10 ** 9)
            x, y = self.x, self.y

            def epoch():
                model.fit(x, y, batch_size=train_digits.BATCH, epochs=1, shuffle=False,
                          verbose=0)

            self.methods[peer] = epoch
        return self.methods[peer]


def test_fit_step(benchmark, case, peer, rnd):
    data = harness.live(LAYER, case, Data)
    fn = data.method(peer)
    harness.timed(benchmark, (LAYER, case, peer), fn, dict(
        layer=LAYER, case=case, workload="digits_cnn", dtype="mixed_float16", peer=peer,
        threads=harness.Settings.threads, rnd=rnd, steps_per_call=data.steps))
