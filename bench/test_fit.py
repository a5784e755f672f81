"""A whole training step, two models:

* the digits CNN of ``train_digits.py`` in mixed_float16 with the stock Keras
  loss-scale optimizer and with ours, and in float32 without loss scaling
  for reference.  One sample is one epoch of ``fit`` over the 1,347 training
  images (batch 32, no shuffling; 256 images in the quick run); the report
  divides by its steps.  The optimizer is a small part of such a step (the
  model has 0.2M parameters), so this shows what a user of a small model
  sees: no more than the scatter of the step time;
* a parameter-heavy mixed_float16 MLP (1,024 inputs, three 4,096-wide ReLU
  layers, 10 logits: 37.8M parameters) with Adam, batch 16: one sample is
  ``train_on_batch`` calls, where the optimizer step is a large part of the
  time.  Its dense layers have no bias: Grappler fuses MatMul + BiasAdd +
  Relu into one kernel whose float16 version on a CPU is thousands of times
  slower than the three ops apart, and would hide everything else.  Before
  timing, fresh copies of the model trained with ours and with stock from
  the same weights on the same batches must end with bit-identical weights;
* a KerasHub ``BertTextClassifier`` built from a config (random weights,
  nothing downloaded: 4 layers of width 512, 8 heads, BERT's 30,522-word
  vocabulary, 28.8M parameters), mixed_float16, a batch of 8 sequences of
  128 tokens, ``train_on_batch``: a real model whose word-embedding gradient
  is an ``IndexedSlices``, with ``Adam`` and with the fine-tuning recipe's
  ``AdamW(weight_decay=0.01, global_clipnorm=1.0)``, and with the TensorFlow
  mixed-precision guide's ``RMSprop()`` (its embedding table moved by the
  kernel's scatter, as Keras' update scatters it), and with the fine-tuning
  recipe under gradient accumulation (``PolynomialDecay``, 4 steps an
  update: one sample is 4 ``train_on_batch`` calls, 3 that accumulate and
  1 that updates, and the report divides by them), and with BERT
  pretraining's ``Lamb`` (TF Model Garden: ``PolynomialDecay``, weight
  decay 0.01 but for LayerNorm and biases).  Its ``grads_only``
  peer runs the same forward and backward pass without the optimizer (a
  ``tf.function`` returning the scaled gradients), so that the report can
  say what share of the step the optimizer is.  The weights after a few
  steps of ours and of stock from the same weights must be bit-identical.
  Skipped, with a line saying so, where ``keras_hub`` is not installed.
"""

import numpy as np

import harness
import train_digits

LAYER = "fit"
DIGITS = "digits_cnn/mixed_float16"
MLP = "mlp_4096x3/mixed_float16"
DIGITS_PEERS = ["ours", "stock", "float32"]
KIND = {"ours": "mixed_lossscale", "stock": "mixed_stock", "float32": "float32"}
MLP_INPUTS, MLP_WIDTH, MLP_LAYERS, MLP_BATCH = 1024, 4096, 3, 16
MLP_SCALE = 2.0 ** 8
MLP_CHECKED_STEPS = 3


def mlp_peers():
    import test_step

    return ["ours"] + (["ours_unfused"] if test_step.has_fused_argument() else []) + ["stock"]


BERT_CASES = {"bert_classifier_adam/mixed_float16": "adam",
              "bert_classifier_adamw_clip/mixed_float16": "adamw_clip",
              "bert_classifier_rmsprop/mixed_float16": "rmsprop",
              "bert_classifier_adamw_accumulate/mixed_float16": "adamw_accumulate",
              "bert_classifier_lamb/mixed_float16": "lamb"}
# The accumulating recipe's gradient_accumulation_steps: the steps of one call.
BERT_ACCUMULATION = 4
BERT_CONFIG = dict(vocabulary_size=30522, num_layers=4, num_heads=8, hidden_dim=512,
                   intermediate_dim=2048, max_sequence_length=512, dropout=0.0)
BERT_BATCH, BERT_TOKENS, BERT_SCALE = 8, 128, 2.0 ** 8
BERT_CHECKED_STEPS = 2
BERT_PEERS = ["ours", "stock", "grads_only"]


def items(settings):
    bert = [] if settings.quick else [(c, p) for c in BERT_CASES for p in BERT_PEERS]
    chosen = [(DIGITS, p) for p in DIGITS_PEERS] + [(MLP, p) for p in mlp_peers()] + bert
    kept = harness.wanted(list(dict.fromkeys(c for c, _ in chosen)), settings)
    return [(c, p) for c, p in chosen if c in kept]


class DigitsData:
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


def mlp_model(peer, seed=0):
    """The MLP compiled with ``peer``'s loss-scale optimizer around Adam; the
    same seed gives the same initial weights."""
    import keras

    keras.utils.set_random_seed(seed)
    policy = "mixed_float16"
    model = keras.Sequential(
        [keras.Input((MLP_INPUTS,))]
        + [keras.layers.Dense(MLP_WIDTH, activation="relu", use_bias=False, dtype=policy)
           for _ in range(MLP_LAYERS)]
        + [keras.layers.Dense(10, dtype="float32")])
    inner = keras.optimizers.Adam(1e-3)
    if peer == "stock":
        opt = keras.optimizers.LossScaleOptimizer(inner, initial_scale=MLP_SCALE,
                                                  dynamic_growth_steps=10 ** 9)
    else:
        from lossscale import LossScaleOptimizer

        extra = {"fused": False} if peer == "ours_unfused" else {}
        opt = LossScaleOptimizer(inner, initial_scale=MLP_SCALE, dynamic_growth_steps=10 ** 9,
                                 **extra)
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class MlpData:
    def __init__(self):
        tf = harness.tensorflow()
        rng = np.random.default_rng(0)
        self.x = tf.constant(rng.standard_normal((MLP_BATCH, MLP_INPUTS), dtype=np.float32))
        self.y = tf.constant(rng.integers(0, 10, MLP_BATCH, dtype=np.int32))
        self.steps = 1
        self.methods = {}
        self.models = {}
        self.identity = self.same_steps()
        harness.record("fit_mlp", self.identity)

    def same_steps(self):
        """Trains fresh models with every peer's optimizer for the same steps
        from the same weights; says whether they end bit-identical to stock.
        The models are then the ones timed: they are built and traced once
        (a step's time does not depend on the weights it starts from)."""
        weights, applied = {}, {}
        for peer in mlp_peers():
            model = self.models[peer] = mlp_model(peer)
            for _ in range(MLP_CHECKED_STEPS):
                model.train_on_batch(self.x, self.y)
            weights[peer] = [np.asarray(w) for w in model.get_weights()]
            applied[peer] = int(model.optimizer.iterations.numpy())
        stock = weights["stock"]
        return {
            "params": int(sum(w.size for w in stock)), "batch": MLP_BATCH,
            "steps": MLP_CHECKED_STEPS, "applied_steps": applied,
            "identical": {p: all(np.array_equal(a, b) for a, b in zip(ws, stock))
                          for p, ws in weights.items() if p != "stock"},
        }

    def method(self, peer):
        if peer not in self.methods:
            model = self.models[peer] if peer in self.models else mlp_model(peer)
            x, y = self.x, self.y
            self.methods[peer] = lambda: model.train_on_batch(x, y)
        return self.methods[peer]


def keras_hub_or_skip():
    import pytest

    hub, why = harness.optional("keras_hub")
    if hub is None:
        pytest.skip(f"KerasHub model skipped: {why}; pip install -r requirements-bench.txt")
    return hub


def bert_model(recipe, peer):
    """The classifier, compiled with ``peer``'s loss-scale optimizer around
    ``recipe``'s; the same weights for every peer."""
    import keras

    hub = keras_hub_or_skip()
    keras.utils.set_random_seed(0)
    backbone = hub.models.BertBackbone(**BERT_CONFIG, dtype="mixed_float16")
    model = hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=None,
                                          dropout=0.0, dtype="mixed_float16")
    if recipe == "adam":
        inner = keras.optimizers.Adam(2e-5)
    elif recipe == "rmsprop":
        # The TensorFlow mixed-precision guide's RMSprop(): the kernel
        # scatters the word embeddings' slices as its update does.
        inner = keras.optimizers.RMSprop()
    elif recipe == "lamb":
        # TF Model Garden's BERT pretraining optimizer.
        inner = keras.optimizers.Lamb(
            keras.optimizers.schedules.PolynomialDecay(1e-4, 1_000_000, end_learning_rate=0.0),
            epsilon=1e-6, weight_decay=0.01)
        inner.exclude_from_weight_decay(var_names=["LayerNorm", "layer_norm", "bias"])
    elif recipe == "adamw_clip":
        inner = keras.optimizers.AdamW(2e-5, weight_decay=0.01, epsilon=1e-6,
                                       global_clipnorm=1.0)
        inner.exclude_from_weight_decay(var_names=["LayerNorm", "layer_norm", "bias"])
    else:
        # The fine-tuning recipe as run with accumulation: its linear decay
        # of the learning rate, weight decay and global_clipnorm.
        inner = keras.optimizers.AdamW(
            keras.optimizers.schedules.PolynomialDecay(2e-5, 10_000, end_learning_rate=0.0),
            weight_decay=0.01, epsilon=1e-6, global_clipnorm=1.0,
            gradient_accumulation_steps=BERT_ACCUMULATION)
        inner.exclude_from_weight_decay(var_names=["LayerNorm", "layer_norm", "bias"])
    if peer == "ours":
        from lossscale import LossScaleOptimizer

        opt = LossScaleOptimizer(inner, initial_scale=BERT_SCALE, dynamic_growth_steps=10 ** 9)
    else:
        opt = keras.optimizers.LossScaleOptimizer(inner, initial_scale=BERT_SCALE,
                                                  dynamic_growth_steps=10 ** 9)
    model.compile(optimizer=opt,
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    return model


class BertData:
    def __init__(self, case):
        keras_hub_or_skip()
        self.recipe = BERT_CASES[case]
        rng = np.random.default_rng(0)
        shape = (BERT_BATCH, BERT_TOKENS)
        self.x = {"token_ids": rng.integers(0, BERT_CONFIG["vocabulary_size"], shape,
                                            dtype=np.int32),
                  "segment_ids": np.zeros(shape, np.int32),
                  "padding_mask": np.ones(shape, bool)}
        self.y = rng.integers(0, 2, BERT_BATCH, dtype=np.int32)
        # Under accumulation one call is a cycle: the steps that accumulate
        # and the one that updates.
        self.steps = BERT_ACCUMULATION if self.recipe == "adamw_accumulate" else 1
        self.methods = {}
        self.models = {}
        self.identity = self.same_steps()
        harness.record(f"fit_{case.split('/')[0]}", self.identity)

    def same_steps(self):
        """As ``MlpData.same_steps``: ours and stock from the same weights on
        the same batch, bit-identical weights after the steps or not.

        RMSprop's own sparse update ends in ``scatter_sub``, and TensorFlow's
        CPU scatter adds the slices of a row named twice in no fixed order
        from 1,024 slices on (``batch x tokens`` of them): stock's own
        weights then differ from run to run.  Its check takes the first
        sequences of the batch, fewer than 1,024 tokens, where the scatter
        is serial and stock repeatable."""
        check = BERT_BATCH
        if self.recipe == "rmsprop":
            check = min(BERT_BATCH, (1024 - 1) // BERT_TOKENS)
        x = {k: v[:check] for k, v in self.x.items()}
        y = self.y[:check]
        weights, applied, paths = {}, {}, {}
        for peer in ("stock", "ours"):
            model = self.models[peer] = bert_model(self.recipe, peer)
            # ``iterations`` counts the update steps under accumulation.
            for _ in range(BERT_CHECKED_STEPS * self.steps):
                model.train_on_batch(x, y)
            weights[peer] = [np.asarray(w) for w in model.get_weights()]
            applied[peer] = int(model.optimizer.iterations.numpy())
            paths[peer] = getattr(model.optimizer, "step_path", "stock")
        stock = weights["stock"]
        return {
            "params": int(sum(w.size for w in stock)), "batch": BERT_BATCH,
            "checked_batch": check,
            "tokens": BERT_TOKENS, "steps": BERT_CHECKED_STEPS * self.steps,
            "applied_steps": applied,
            "step_path": paths["ours"],
            "identical": {"ours": all(np.array_equal(a, b)
                                      for a, b in zip(weights["ours"], stock))},
        }

    def method(self, peer):
        if peer not in self.methods:
            if peer == "grads_only":
                one = self._grads_only()
            else:
                model = self.models[peer]
                x, y = self.x, self.y
                one = lambda: model.train_on_batch(x, y)  # noqa: E731
            steps = self.steps
            self.methods[peer] = one if steps == 1 else (lambda: [one() for _ in range(steps)])
        return self.methods[peer]

    def _grads_only(self):
        """The stock model's forward and backward pass, scaled loss and all,
        without the optimizer step."""
        tf = harness.tensorflow()
        model = self.models["stock"]
        x = {k: tf.constant(v) for k, v in self.x.items()}
        y = tf.constant(self.y)

        @tf.function
        def grads():
            with tf.GradientTape() as tape:
                logits = model(x, training=True)
                loss = model.compute_loss(x, y, logits)
                scaled = model.optimizer.scale_loss(loss)
            return tape.gradient(scaled, model.trainable_variables)

        return grads


def test_fit_step(benchmark, case, peer, rnd):
    if case in BERT_CASES:
        data = harness.live(LAYER, case, lambda: BertData(case))
    else:
        data = harness.live(LAYER, case, DigitsData if case == DIGITS else MlpData)
    fn = data.method(peer)
    name, dtype = case.split("/")
    harness.timed(benchmark, (LAYER, case, peer), fn, dict(
        layer=LAYER, case=case, workload=name, dtype=dtype, peer=peer,
        threads=harness.Settings.threads, rnd=rnd, steps_per_call=data.steps))
    if case == MLP and rnd == 0 and peer != "stock":
        ident = data.identity
        assert ident["applied_steps"][peer] == MLP_CHECKED_STEPS, ident
        assert ident["identical"][peer], (
            f"{peer}: weights after {MLP_CHECKED_STEPS} steps differ from stock Keras'")
    if case in BERT_CASES:
        benchmark.extra_info["step_path"] = data.identity["step_path"]
        if rnd == 0 and peer == "ours":
            ident = data.identity
            assert ident["applied_steps"]["ours"] == BERT_CHECKED_STEPS, ident
            assert ident["identical"]["ours"], (
                f"{case}: weights after {BERT_CHECKED_STEPS} steps differ from stock Keras'")
