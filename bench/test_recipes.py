"""The recipe battery: sixteen optimizer set-ups as published training recipes
configure them, each wrapped in ``lossscale.LossScaleOptimizer`` (ours) and
``keras.optimizers.LossScaleOptimizer`` (stock) under the mixed_float16
policy.  For every recipe:

* ``step_path``: the path ours takes on the recipe's step (fused or stock,
  and why), as the optimizer reports it;
* **exactness**: before any timing, a lockstep of six steps of ours and of
  stock in ``tf.function`` on the same small variable list (dense variables
  named as a model names them, so that weight-decay exclusions bite, plus
  an embedding table whose gradient is an ``IndexedSlices`` with duplicate
  indices for the recipes that have one), the scale starting at 2**10 and
  growing every two steps, the gradients of step 3 times infinity.  After
  every step every variable and every optimizer variable must be bit for
  bit the same; the ``ours`` item fails when they are not (a drop-in that is
  not exact is a bug), after its timing.  Run where ours and stock are both
  timed (``test_alone.py``'s children time one peer each and leave it out);
* **exactness on real models**: the same comparison on two small KerasHub
  models built from a config (random weights, nothing downloaded), trained
  with ``train_on_batch`` under mixed_float16 for ``REAL_STEPS`` steps from
  a scale of 2**24, whose first steps overflow and are skipped: a
  ``BertTextClassifier`` (its word-, position- and segment-embedding
  gradients are ``IndexedSlices``; its LayerNorm variables are named as
  BERT's recipes exclude them from weight decay) and a ``GPT2CausalLM``
  (its tied token embedding gets a dense gradient).  Skipped, with a line
  saying so, where ``keras_hub`` is not installed;
* **apply time**: ``apply`` in ``tf.function`` on scaled gradients made in
  the graph (``tfgraph.py``; making them alone is timed before every sample
  and subtracted by the report), scale fixed at 2**8: ResNet-50's parameter
  shapes for the dense recipes; for the sparse ones BERT-base's, whose
  30522 x 768 word-embedding table gets an ``IndexedSlices`` gradient of one
  row per token of a 32 x 512 batch (indices repeat, as a batch's tokens do);
* **torch**: PyTorch's nearest equivalent in its own measurement, stepped by
  ``torch.amp.GradScaler`` on the same values copied into ``.grad``: the fused
  ``Adam``/``AdamW``/``SGD``/``Adagrad`` (``grad_scale``/``found_inf`` handed
  to the kernel), ``unscale_`` then ``clip_grad_norm_`` before the step for
  the clipping recipes, ``foreach=True`` for ``RMSprop``, ``NAdam``,
  ``Adamax`` and ``Adafactor``.  torch's embedding gradient is dense (as
  ``nn.Embedding`` makes it by default; its fused optimizers take no sparse
  gradient).  Learning-rate schedules are left out on torch's side (a
  scheduler steps outside the optimizer step); Lion and Lamb have no torch
  equivalent and are not timed against torch.  Accumulating gradients,
  torch's step adds each fresh gradient into ``.grad`` (the add its
  autograd does inside backward), as ours' step adds it into its
  accumulator: making the fresh gradient alone is taken off on both sides.

``--quick`` runs four recipes (two dense, one of them Adafactor's own op,
two sparse), one round (``ROUNDS``), on a cut of each workload: every 8th
tensor of ResNet-50; BERT-base's first 24 after its word embeddings, a
4096-row table and 4 x 128 tokens.
"""

import dataclasses
import functools

import keras
import numpy as np
import pytest

import harness
import workloads
from tfgraph import GraphGradients, Method, keras_apply_method, timed_method

LAYER = "recipes"
POLICY = "mixed_float16"
SCALE = 2.0 ** 8
PERIOD = 10 ** 9
PEERS = ["ours", "stock", "torch"]

# The lockstep.
CHECK_STEPS = 6
CHECK_OVERFLOW_STEP = 2           # 0-based: the third step's gradients times inf
CHECK_SCALE = 2.0 ** 10
CHECK_GROWTH = 2
CHECK_DENSE = {"dense_kernel": (37, 19), "dense_bias": (19,), "LayerNorm_gamma": (19,),
               "LayerNorm_beta": (19,), "conv_kernel": (3, 3, 4, 5)}
CHECK_TABLE = (50, 8)
CHECK_INDICES = [3, 7, 3, 0, 49, 7, 7, 12]

# The lockstep on real models.
REAL_STEPS = 10
REAL_SCALE = 2.0 ** 24
REAL_CONFIG = dict(vocabulary_size=3000, num_layers=2, num_heads=2, hidden_dim=64,
                   intermediate_dim=128, max_sequence_length=64, dropout=0.0)
REAL_BATCH = (8, 32)

# The timed workloads: the word-embedding table of BERT-base and a batch of tokens.
TOKENS = (32, 512)
QUICK_TOKENS = (4, 128)
QUICK_STRIDE = 8          # ResNet-50: every 8th tensor, its mix of sizes (3.5M values)
QUICK_BERT_TENSORS = 24   # BERT-base: the first 24 after the word embeddings (8.7M values)
QUICK_TABLE_ROWS = 4096


# ------------------------------------------------------------ the recipes


class TransformerSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """The learning rate of "Attention is all you need" (the TensorFlow
    Transformer tutorial): d_model**-0.5 * min(step**-0.5, step * warmup**-1.5)."""

    def __init__(self, d_model=512, warmup_steps=4000):
        self.d_model, self.warmup_steps = d_model, warmup_steps

    def __call__(self, step):
        tf = harness.tensorflow()
        step = tf.cast(step, tf.float32)
        return (tf.math.rsqrt(tf.cast(self.d_model, tf.float32))
                * tf.minimum(tf.math.rsqrt(step), step * self.warmup_steps ** -1.5))

    def get_config(self):
        return {"d_model": self.d_model, "warmup_steps": self.warmup_steps}


def _bert():
    lr = keras.optimizers.schedules.PolynomialDecay(2e-5, 10_000, end_learning_rate=0.0)
    opt = keras.optimizers.AdamW(lr, weight_decay=0.01, epsilon=1e-6, global_clipnorm=1.0)
    opt.exclude_from_weight_decay(var_names=["LayerNorm", "layer_norm", "bias"])
    return opt


def _bert_pretrain():
    # TF Model Garden's BERT pretraining: LAMB, polynomial decay, weight
    # decay 0.01 but for LayerNorm and biases.
    lr = keras.optimizers.schedules.PolynomialDecay(1e-4, 1_000_000, end_learning_rate=0.0)
    opt = keras.optimizers.Lamb(lr, epsilon=1e-6, weight_decay=0.01)
    opt.exclude_from_weight_decay(var_names=["LayerNorm", "layer_norm", "bias"])
    return opt


def _keras(name, *args, **kwargs):
    def make():
        return getattr(keras.optimizers, name)(*args, **kwargs)
    return make


def _scheduled(name, schedule, schedule_args, **kwargs):
    def make():
        lr = getattr(keras.optimizers.schedules, schedule)(*schedule_args)
        return getattr(keras.optimizers, name)(lr, **kwargs)
    return make


def _transformer():
    return keras.optimizers.Adam(TransformerSchedule(), beta_2=0.98, epsilon=1e-9)


@dataclasses.dataclass(frozen=True)
class Torch:
    """torch's nearest equivalent: the class, its arguments, the kernel kind
    (``fused``/``foreach``), a global clip (``clip``), a per-tensor clip
    (``clip_each``), an EMA of the weights (``ema``), steps accumulated
    before each update (``accumulate``), LayerNorm/bias out of weight decay
    (``exclude_decay``)."""

    cls: str
    kwargs: dict
    kind: str
    clip: float = None
    clip_each: float = None
    ema: float = None
    accumulate: int = 1
    exclude_decay: bool = False

    def describe(self):
        args = ", ".join(f"{k}={v:g}" if isinstance(v, float) else f"{k}={v}"
                         for k, v in self.kwargs.items())
        parts = [f"{self.cls}({args}{', ' if args else ''}{self.kind}=True)"]
        if self.clip:
            parts.append(f"clip_grad_norm_({self.clip:g})")
        if self.clip_each:
            parts.append(f"per-tensor norm clip {self.clip_each:g}")
        if self.ema:
            parts.append(f"EMA {self.ema:g} (_foreach_lerp_)")
        if self.accumulate > 1:
            parts.append(f"steps every {self.accumulate} accumulated gradients")
        if self.exclude_decay:
            parts.append("1-D params without decay")
        return " + ".join(parts)


@dataclasses.dataclass(frozen=True)
class Recipe:
    name: str
    source: str
    inner: object          # () -> the Keras optimizer, configured as the recipe does
    sparse: bool
    torch: Torch = None    # None: torch has no equivalent


RECIPES = [
    Recipe("tf_guide", "TF mixed-precision guide: RMSprop()", _keras("RMSprop"), False,
           Torch("RMSprop", dict(lr=1e-3, alpha=0.9, eps=1e-7), "foreach")),
    Recipe("bert_finetune",
           "BERT fine-tune: AdamW(PolynomialDecay, weight_decay=0.01, epsilon=1e-6, "
           "global_clipnorm=1.0), LayerNorm/bias excluded from decay, embedding gradient "
           "IndexedSlices", _bert, True,
           Torch("AdamW", dict(lr=2e-5, weight_decay=0.01, eps=1e-6), "fused", clip=1.0,
                 exclude_decay=True)),
    Recipe("transformer_nmt",
           "Transformer NMT: Adam(warm-up schedule, beta_2=0.98, epsilon=1e-9), token "
           "embeddings IndexedSlices", _transformer, True,
           Torch("Adam", dict(lr=7e-4, betas=(0.9, 0.98), eps=1e-9), "fused")),
    Recipe("resnet", "ResNet: SGD(CosineDecay, momentum=0.9)",
           _scheduled("SGD", "CosineDecay", (0.1, 100_000), momentum=0.9), False,
           Torch("SGD", dict(lr=0.1, momentum=0.9), "fused")),
    Recipe("efficientnet",
           "EfficientNet: RMSprop(rho=0.9, momentum=0.9, epsilon=0.001, use_ema=True)",
           _keras("RMSprop", rho=0.9, momentum=0.9, epsilon=0.001, use_ema=True), False,
           Torch("RMSprop", dict(lr=1e-3, alpha=0.9, momentum=0.9, eps=1e-3), "foreach",
                 ema=0.99)),
    Recipe("vit", "ViT: AdamW(weight_decay=0.05, global_clipnorm=1.0)",
           _keras("AdamW", weight_decay=0.05, global_clipnorm=1.0), False,
           Torch("AdamW", dict(lr=1e-3, weight_decay=0.05, eps=1e-7), "fused", clip=1.0)),
    Recipe("gpt2_finetune",
           "GPT-2 fine-tune: Adam(PolynomialDecay), token embeddings IndexedSlices",
           _scheduled("Adam", "PolynomialDecay", (6.25e-5, 10_000)), True,
           Torch("Adam", dict(lr=6.25e-5, eps=1e-7), "fused")),
    Recipe("lstm", "LSTM: Adam(clipnorm=1.0)", _keras("Adam", clipnorm=1.0), False,
           Torch("Adam", dict(lr=1e-3, eps=1e-7), "fused", clip_each=1.0)),
    Recipe("detection", "Detection: SGD(momentum=0.9, global_clipnorm=10.0)",
           _keras("SGD", 0.01, momentum=0.9, global_clipnorm=10.0), False,
           Torch("SGD", dict(lr=0.01, momentum=0.9), "fused", clip=10.0)),
    Recipe("t5", "T5: Adafactor()", _keras("Adafactor"), False,
           Torch("Adafactor", dict(lr=1e-3), "foreach")),
    Recipe("lion", "Lion(1e-4, weight_decay=0.01)",
           _keras("Lion", 1e-4, weight_decay=0.01), False, None),
    Recipe("grad_accumulation", "AdamW(gradient_accumulation_steps=4)",
           _keras("AdamW", gradient_accumulation_steps=4), False,
           Torch("AdamW", dict(lr=1e-3, weight_decay=0.004, eps=1e-7), "fused", accumulate=4)),
    Recipe("recommender", "Recommender: Adagrad(0.05), embedding table IndexedSlices",
           _keras("Adagrad", 0.05), True,
           Torch("Adagrad", dict(lr=0.05, initial_accumulator_value=0.1, eps=1e-7), "fused")),
    Recipe("tabular", "Tabular: Nadam()", _keras("Nadam"), False,
           Torch("NAdam", dict(lr=1e-3, eps=1e-7), "foreach")),
    Recipe("adamax", "Adamax()", _keras("Adamax"), False,
           Torch("Adamax", dict(lr=1e-3, eps=1e-7), "foreach")),
    Recipe("bert_pretrain",
           "BERT pretraining (Model Garden): Lamb(PolynomialDecay, weight_decay=0.01, "
           "epsilon=1e-6), LayerNorm/bias excluded from decay, embedding gradient "
           "IndexedSlices", _bert_pretrain, True, None),
]
BY_NAME = {r.name: r for r in RECIPES}
# Two dense recipes (the one-pass op and Adafactor's own), two sparse ones.
QUICK = ("resnet", "t5", "bert_finetune", "recommender")


def recipes(settings):
    chosen = [BY_NAME[n] for n in QUICK] if settings.quick else RECIPES
    names = harness.wanted([r.name for r in chosen], settings)
    return [r for r in chosen if r.name in names]


def items(settings):
    return [(f"{r.name}/{POLICY}", p) for r in recipes(settings) for p in PEERS
            if p != "torch" or r.torch is not None]


def ROUNDS(settings):
    return 1 if settings.quick else settings.rounds


def wrap(peer, inner, **kwargs):
    if peer == "stock":
        return keras.optimizers.LossScaleOptimizer(inner, **kwargs)
    from lossscale import LossScaleOptimizer

    return LossScaleOptimizer(inner, **kwargs)


# ------------------------------------------------------------ exactness


def _check_step(opt, variables, indices, dense, values):
    gs = list(dense)
    if indices is not None:
        tf = harness.tensorflow()
        gs.append(tf.IndexedSlices(values, indices, tf.constant(CHECK_TABLE)))
    opt.apply(gs, variables)


def lockstep(recipe):
    """Ours and stock side by side for ``CHECK_STEPS`` steps; a dict saying
    whether every variable and optimizer variable stayed bit-identical."""
    tf = harness.tensorflow()
    rng = np.random.default_rng(7)
    shapes = dict(CHECK_DENSE, **({"embeddings": CHECK_TABLE} if recipe.sparse else {}))
    init = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    dense = [n for n in shapes if n != "embeddings"]
    steps = []
    for i in range(CHECK_STEPS):
        factor = np.float32(np.inf if i == CHECK_OVERFLOW_STEP else CHECK_SCALE)
        gd = [(rng.standard_normal(shapes[n]) * factor).astype(np.float32) for n in dense]
        values = (rng.standard_normal((len(CHECK_INDICES), CHECK_TABLE[1]))
                  * factor).astype(np.float32)
        steps.append((gd, values))
    indices = tf.constant(CHECK_INDICES, tf.int32)

    states, paths, iterations, error = {}, {}, {}, None
    for peer in ("stock", "ours"):
        variables = [keras.Variable(init[n], name=n) for n in shapes]
        opt = wrap(peer, recipe.inner(), initial_scale=CHECK_SCALE,
                   dynamic_growth_steps=CHECK_GROWTH)
        opt.build(variables)

        step = tf.function(functools.partial(_check_step, opt, variables,
                                             indices if recipe.sparse else None))
        states[peer] = []
        try:
            for gd, values in steps:
                step([tf.constant(g) for g in gd], tf.constant(values))
                states[peer].append([harness.bits(v) for v in variables + list(opt.variables)])
        except Exception as e:  # noqa: BLE001 -- ours failing where stock steps is the finding
            if peer == "stock":
                raise
            error = f"step {len(states[peer])} raised {type(e).__name__}: {str(e)[:300]}"
        paths[peer] = getattr(opt, "step_path", "stock")
        iterations[peer] = int(opt.iterations.numpy())
    mismatch = [i for i, (a, b) in enumerate(zip(states["stock"], states["ours"])) if a != b]
    mismatch += list(range(len(states["ours"]), CHECK_STEPS))
    return {"exact": not mismatch, "steps": CHECK_STEPS, "overflow_step": CHECK_OVERFLOW_STEP,
            "mismatched_steps": mismatch, "error": error, "step_path": paths["ours"],
            "iterations": iterations,
            "optimizer_variables": {p: len(s[0]) if s else None for p, s in states.items()}}


def _real_model(arch):
    hub, _ = harness.optional("keras_hub")
    keras.utils.set_random_seed(0)
    if arch == "bert":
        backbone = hub.models.BertBackbone(**REAL_CONFIG)
        return hub.models.BertTextClassifier(backbone, num_classes=2, preprocessor=None,
                                             dropout=0.0)
    backbone = hub.models.GPT2Backbone(**REAL_CONFIG)
    return hub.models.GPT2CausalLM(backbone, preprocessor=None)


def _real_batch(arch):
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, REAL_CONFIG["vocabulary_size"], REAL_BATCH).astype(np.int32)
    x = {"token_ids": tokens, "padding_mask": np.ones(REAL_BATCH, bool)}
    if arch == "bert":
        x["segment_ids"] = np.zeros(REAL_BATCH, np.int32)
        return x, rng.integers(0, 2, REAL_BATCH[0]).astype(np.int32)
    return x, rng.integers(0, REAL_CONFIG["vocabulary_size"], REAL_BATCH).astype(np.int32)


def real_lockstep(recipe):
    """Ours and stock ``train_on_batch`` side by side on each KerasHub model:
    ``{arch: {exact, mismatched_steps, step_path, applied, steps}}``, or
    ``{"skipped": why}`` without KerasHub."""
    hub, why = harness.optional("keras_hub")
    if hub is None:
        return {"skipped": why}
    out = {}
    for arch in ("bert", "gpt2"):
        x, y = _real_batch(arch)
        models, states = {}, {}
        for peer in ("stock", "ours"):
            model = models[peer] = _real_model(arch)
            model.compile(optimizer=wrap(peer, recipe.inner(), initial_scale=REAL_SCALE,
                                         dynamic_growth_steps=CHECK_GROWTH),
                          loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
            states[peer] = []
            for _ in range(REAL_STEPS):
                model.train_on_batch(x, y)
                states[peer].append([harness.bits(v) for v in
                                     list(model.variables) + list(model.optimizer.variables)])
        ours = models["ours"].optimizer
        out[arch] = {
            "exact": states["stock"] == states["ours"],
            "mismatched_steps": [i for i, (a, b) in enumerate(zip(states["stock"],
                                                                  states["ours"])) if a != b],
            "step_path": ours.step_path, "steps": REAL_STEPS,
            "applied": int(ours.inner_optimizer._iterations.numpy())}
    return out


# ------------------------------------------------------------ the timed step


def workload(recipe, quick):
    """``(name, dense shapes, table shape or None, token rows)``."""
    if not recipe.sparse:
        shapes = workloads.shapes("resnet50")
        return ("resnet50", shapes[::QUICK_STRIDE] if quick else shapes, None, 0)
    shapes = workloads.shapes("bert_base")
    table, rest = shapes[0], shapes[1:]
    tokens = QUICK_TOKENS if quick else TOKENS
    if quick:
        table, rest = (QUICK_TABLE_ROWS, table[1]), rest[:QUICK_BERT_TENSORS]
    return ("bert_base", rest, table, tokens[0] * tokens[1])


def variable_name(i, shape):
    # As a model names them: the exclusions of weight decay see 1-D
    # variables (biases, LayerNorm) by their names.
    return f"bias_{i}" if len(shape) == 1 else f"kernel_{i}"


class Data:
    def __init__(self, case):
        self.case = case
        self.recipe = BY_NAME[case.split("/")[0]]
        self.exactness = None
        inner = self.recipe.inner()
        # Calls per update, on every peer (torch's steps every as many).
        self.cycle = inner.gradient_accumulation_steps or 1
        self.family = type(inner).__name__
        name, dense, table, rows = workload(self.recipe, harness.Settings.quick)
        self.workload = name if not harness.Settings.quick else f"{name} (quick cut)"
        rng = np.random.default_rng(0)
        self.dense = [rng.standard_normal(s, dtype=np.float32) for s in dense]
        self.table = table
        self.rows = rows
        if table is not None:
            self.indices = np.sort(rng.integers(0, table[0], rows)).astype(np.int32)
            self.values = rng.standard_normal((rows, table[1]), dtype=np.float32)
        self.methods = {}
        self._graph = None

    def check_exactness(self):
        """The lockstep on the small variable list and on the KerasHub
        models: ``self.exactness``."""
        self.exactness = lockstep(self.recipe)
        real = real_lockstep(self.recipe)
        self.exactness["real_models"] = real
        self.exactness["exact"] = self.exactness["exact"] and all(
            r["exact"] for k, r in real.items() if k != "skipped")

    @property
    def graph(self):
        if self._graph is None:
            arrays = self.dense + ([self.values] if self.table is not None else [])
            self._graph = GraphGradients(arrays)
        return self._graph

    def method(self, peer):
        if peer not in self.methods:
            self.methods[peer] = self._torch() if peer == "torch" else self._keras(peer)
        return self.methods[peer]

    def _keras(self, peer):
        tf = harness.tensorflow()
        variables = [keras.Variable(np.zeros_like(a), name=variable_name(i, a.shape))
                     for i, a in enumerate(self.dense)]
        if self.table is not None:
            variables.append(keras.Variable(np.zeros(self.table, np.float32),
                                            name="word_embeddings"))
        opt = wrap(peer, self.recipe.inner(), initial_scale=SCALE, dynamic_growth_steps=PERIOD)
        opt.build(variables)
        # The optimizer's per-element state (slots, EMA copies, accumulators)
        # for the roofline: every value of it is read and written once a step.
        self.params = sum(int(np.prod(v.shape)) for v in variables)
        self.slot_values = sum(int(np.prod(v.shape)) for v in opt.inner_optimizer.variables
                               if len(v.shape) > 0)
        sparse = self.table is not None
        if sparse:
            indices = tf.constant(self.indices)
            dense_shape = tf.constant(self.table, tf.int64)

        def grads(gs):
            if not sparse:
                return gs
            return list(gs[:-1]) + [tf.IndexedSlices(gs[-1], indices, dense_shape)]

        return keras_apply_method(self.graph, opt, variables, peer, grads)

    def _torch(self):
        torch = harness.torch_or_skip()
        spec = self.recipe.torch
        cls = getattr(torch.optim, spec.cls, None)
        if cls is None:
            pytest.skip(f"PyTorch peer skipped: torch {torch.__version__} has no "
                        f"torch.optim.{spec.cls}")
        if self.table is not None:
            # The gradient of the same rows, dense as nn.Embedding makes it.
            table_grad = np.zeros(self.table, np.float32)
            np.add.at(table_grad, self.indices, self.values)
        arrays = self.dense + ([table_grad] if self.table is not None else [])
        sources = [torch.from_numpy(a) for a in arrays]
        params = [torch.zeros(a.shape, requires_grad=True) for a in arrays]
        grads = [torch.zeros_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        if spec.exclude_decay:
            groups = [{"params": [p for p in params if p.ndim > 1]},
                      {"params": [p for p in params if p.ndim == 1], "weight_decay": 0.0}]
        else:
            groups = params
        opt = cls(groups, **spec.kwargs, **{spec.kind: True})
        scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=PERIOD)
        scaler.scale(torch.ones(()))
        copy, add = torch._foreach_copy_, torch._foreach_add_
        ema = [p.detach().clone() for p in params] if spec.ema else None
        calls = [0]
        # Accumulating, backward's fresh gradients land in buffers of their
        # own, and the step adds them into .grad: the add torch's autograd
        # does inside backward is the work ours' step does on every call
        # (its accumulator's add), so it is timed on both sides, not taken
        # off with the producer.
        fresh = [torch.zeros_like(p) for p in params] if spec.accumulate > 1 else grads

        def produce():
            copy(fresh, sources)

        def update():
            if spec.clip or spec.clip_each:
                scaler.unscale_(opt)
                if spec.clip:
                    torch.nn.utils.clip_grad_norm_(params, spec.clip, foreach=True)
                else:
                    norms = torch._foreach_norm(grads)
                    factors = [torch.clamp(spec.clip_each / (n + 1e-6), max=1.0) for n in norms]
                    torch._foreach_mul_(grads, factors)
            scaler.step(opt)
            scaler.update()
            if ema is not None:
                with torch.no_grad():
                    torch._foreach_lerp_(ema, [p.detach() for p in params], 1 - spec.ema)

        def step():
            produce()
            if spec.accumulate > 1:
                add(grads, fresh)
            calls[0] += 1
            if calls[0] % spec.accumulate == 0:
                update()
                if spec.accumulate > 1:
                    torch._foreach_zero_(grads)

        def applied():
            st = opt.state.get(params[0], {})
            return int(st["step"]) if "step" in st else int(bool(st))

        return Method(step, produce, lambda: "torch", applied)

    def moved_bytes(self):
        """What an updating step must move at least, in bytes: every
        gradient value read twice (the finite check or the norm, then the
        update; the embedding's gradient counted dense), every variable and
        every value of the optimizer's state read and written once; None
        before a Keras peer has built its optimizer."""
        if not hasattr(self, "slot_values"):
            return None
        return 4 * (2 * self.params + 2 * self.params + 2 * self.slot_values)

    def info(self, peer, rnd):
        arrays = self.dense + ([self.values] if self.table is not None else [])
        r = self.recipe
        return dict(moved_bytes=self.moved_bytes(), family=self.family,
                    layer=LAYER, case=self.case, workload=self.workload, dtype=POLICY,
                    peer=peer, threads=harness.Settings.threads, rnd=rnd,
                    tensors=len(arrays), values=int(sum(a.size for a in arrays)),
                    bytes=int(sum(a.nbytes for a in arrays)),
                    recipe=r.name, source=r.source, sparse=r.sparse,
                    embedding_rows=self.rows, table=list(self.table) if self.table else None,
                    torch_peer=r.torch.describe() if r.torch else None,
                    gradients=("copied into .grad (embedding gradient dense)" if peer == "torch"
                               and r.sparse else "copied into .grad" if peer == "torch"
                               else "made in the graph"))


def test_recipe(request, benchmark, case, peer, rnd):
    data = harness.live(LAYER, case, lambda: Data(case))
    if data.exactness is None and {"ours", "stock"} <= harness.timed_here(request.config,
                                                                           LAYER, case):
        # Where both are timed side by side (not in test_alone's children,
        # which time one peer each), before any peer of the case holds its
        # variables.
        data.check_exactness()
    # An accumulating optimizer updates once every few calls: each sample
    # holds whole cycles of them, and a short run may not reach one.
    data, m = timed_method(benchmark, LAYER, case, peer, rnd, lambda: data, must_apply=False,
                           cycle=data.cycle)
    if peer == "ours" and data.exactness is not None:
        benchmark.extra_info["exactness"] = data.exactness
        benchmark.extra_info["exact"] = data.exactness["exact"]
    if peer == "ours" and rnd == 0 and data.exactness is not None:
        e = data.exactness
        assert e["exact"], (
            f"{data.recipe.name}: ours differs from stock Keras bit for bit at steps "
            f"{e['mismatched_steps']} of {e['steps']} (0-based; step path "
            f"{e['step_path']}){'; ' + e['error'] if e['error'] else ''}; real models: "
            f"{e['real_models']}")
    if rnd == 0 and data.cycle == 1:
        assert m.applied() > 0, f"{peer} skipped its steps on finite gradients"


@pytest.fixture(autouse=True, scope="module")
def _policy_then_drop():
    # Every recipe item runs under the mixed_float16 global policy (building,
    # tracing and stepping alike); the one before is restored after.
    before = keras.mixed_precision.global_policy()
    keras.mixed_precision.set_global_policy(POLICY)
    yield
    keras.mixed_precision.set_global_policy(before)
    harness.drop_all()
