"""The optimizer step of TensorFlow 2.4's custom training loop on
``tf_keras``, for ``lossscale.LossScaleOptimizer`` and its peers on the same
gradient list: the items of the ``tf_keras_step`` layer.

``tf_keras`` is the Keras line of ``lossscale`` (and ``tf.keras`` is
``tf_keras``) only when ``TF_USE_LEGACY_KERAS`` is set before TensorFlow is
imported, so these items run in a child ``pytest`` with ``ENV``: one per
case, started by ``test_tf_keras_step.py`` (and one per peer by
``test_alone.py``); the suite's own process stays on Keras 3.

One call, in ``tf.function``: scaled float32 gradients of the workload's
shapes made in the graph (``tfgraph.py``), ``get_unscaled_gradients``, then
``apply_gradients`` -- for the legacy (``tf_keras.optimizers.legacy``) and
the current (``tf_keras.optimizers``) Adam, RMSprop and SGD-momentum, as the
step layer (``test_step.py``) sets them (RMSprop: ``tf_keras``' defaults),
the scale fixed at 2**8 (growth period 10**9, so every call does the same
work).  Peers:

* ``ours``          -- ``lossscale.LossScaleOptimizer(inner)``, whatever step
                       it takes by default (``extra_info["step_path"]``);
* ``ours_unfused``  -- the same with ``fused=False``;
* ``stock``         -- ``tf_keras.mixed_precision.LossScaleOptimizer(inner)``;
* ``torch_fused``, ``torch_foreach`` -- the step layer's torch peers, one
                       rule for both Keras lines (torch has no fused RMSprop:
                       foreach only).

Making the gradients alone (the ``producer``) is timed before every sample
and subtracted by the report.  In a full run that times ``ours`` and
``stock`` side by side, before the first item of a case is timed, fresh
``ours`` and ``stock`` take ``LOCKSTEP_SEEDS`` steps from zero variables on
the same gradients (one step's times infinity, skipped: the scale halves),
every variable and optimizer variable compared bit for bit after every
step: ``extra_info["exactness"]`` of the case's ``ours`` items.  ``--quick``
leaves the layer out: a child pays TensorFlow's and tf_keras' start-up, tens
of seconds the quick run has no room for (``tests/`` proves the exactness).
"""

import gc
import math

import numpy as np
import pytest

import harness
import test_step
from tfgraph import custom_loop_method, timed_method

LAYER = "tf_keras_step"
ENV = {"TF_USE_LEGACY_KERAS": "1"}
LEGACY = "legacy_"
OPTIMIZERS = tuple(f"{line}{rule}" for line in (LEGACY, "")
                   for rule in ("adam", "rmsprop", "sgdm"))
WORKLOADS = ("resnet50", "bert_base")
# Gradient multipliers of the lockstep's steps: the third overflows.
LOCKSTEP_SEEDS = (1.0, 1.0, math.inf, 1.0)


def cases(settings):
    if settings.quick:
        return []
    return harness.wanted([f"{w}/float32/{o}" for w in WORKLOADS for o in OPTIMIZERS], settings)


def peers(case):
    return [p for p in test_step.PEERS if p not in test_step.SPLIT_PEERS
            and not (p == "torch_fused" and case.endswith("rmsprop"))]


def items(settings):
    return [(c, p) for c in cases(settings) for p in peers(c)]


def split_optimizer(optimizer):
    """``"legacy_adam"`` -> ``(True, "adam")``: the Keras line and the rule."""
    return optimizer.startswith(LEGACY), optimizer.removeprefix(LEGACY)


def tf_keras_inner(optimizer):
    import tf_keras

    legacy, rule = split_optimizer(optimizer)
    module = tf_keras.optimizers.legacy if legacy else tf_keras.optimizers
    if rule == "sgdm":
        return module.SGD(test_step.LEARNING_RATE, momentum=test_step.MOMENTUM)
    if rule == "rmsprop":
        return module.RMSprop(test_step.LEARNING_RATE, rho=test_step.RMSPROP_RHO,
                              epsilon=test_step.RMSPROP_EPSILON)
    return module.Adam(test_step.LEARNING_RATE)


def loss_scale_optimizer(peer, optimizer):
    """The peer's loss-scale optimizer around a fresh inner ``optimizer``."""
    import tf_keras

    args = dict(initial_scale=test_step.SCALE, dynamic_growth_steps=test_step.PERIOD)
    inner = tf_keras_inner(optimizer)
    if peer == "stock":
        return tf_keras.mixed_precision.LossScaleOptimizer(inner, **args)
    import lossscale

    return lossscale.LossScaleOptimizer(inner, fused=peer != "ours_unfused", **args)


def optimizer_state(opt):
    """Every variable of a ``tf_keras`` loss-scale optimizer: the inner
    optimizer's (iterations and slots), the scale and its counter."""
    inner = opt.inner_optimizer
    own = inner.variables() if callable(inner.variables) else inner.variables
    return list(own) + [opt.loss_scale, opt.dynamic_counter]


class Data(test_step.Data):
    layer = LAYER

    def __init__(self, case):
        from lossscale import _which_keras

        if not _which_keras.tf_keras_in_use():
            raise RuntimeError(f"{LAYER}: tf_keras is not lossscale's Keras line in this "
                               "process; run these items with TF_USE_LEGACY_KERAS=1 "
                               "(bench/test_tf_keras_step.py does)")
        super().__init__(case)
        # self.optimizer is the rule: test_step.Data's torch peers read it.
        self.keras_optimizer = self.optimizer
        self.legacy, self.optimizer = split_optimizer(self.keras_optimizer)
        self.exactness = None

    def _variables(self):
        tf = harness.tensorflow()
        return [tf.Variable(np.zeros_like(a), name=f"w{i}") for i, a in enumerate(self.arrays)]

    def _keras(self, peer):
        return custom_loop_method(self.graph, loss_scale_optimizer(peer, self.keras_optimizer),
                                  self._variables(), peer)

    def lockstep(self):
        """Fresh ``ours`` and ``stock`` stepped together on the same gradients
        times ``LOCKSTEP_SEEDS``: whether every variable and optimizer
        variable has the same bits after every step, and the paths taken."""
        tf = harness.tensorflow()
        graph = self.graph
        runs = {}
        for peer in ("ours", "stock"):
            variables = self._variables()
            opt = loss_scale_optimizer(peer, self.keras_optimizer)

            def step(x, opt=opt, variables=variables):
                grads = graph.produce(x)
                opt.apply_gradients(zip(opt.get_unscaled_gradients(grads), variables))

            runs[peer] = (tf.function(step), opt, variables)
        mismatched = []
        for i, seed in enumerate(LOCKSTEP_SEEDS):
            x = tf.constant(seed, graph.dtype)
            for fn, _opt, _variables in runs.values():
                fn(x)
            (_f, ours, ours_vars), (_g, stock, stock_vars) = runs["ours"], runs["stock"]
            pairs = zip(ours_vars + optimizer_state(ours), stock_vars + optimizer_state(stock))
            if not all(harness.bits(a.numpy()) == harness.bits(b.numpy()) for a, b in pairs):
                mismatched.append(i)
        ours = runs["ours"][1]
        return {"steps": len(LOCKSTEP_SEEDS), "overflow_step": LOCKSTEP_SEEDS.index(math.inf),
                "exact": not mismatched, "mismatched_steps": mismatched,
                "final_scale": {p: float(o.loss_scale.numpy()) for p, (_f, o, _v) in runs.items()},
                "step_path": ours.step_path}

    def info(self, peer, rnd):
        return dict(super().info(peer, rnd), optimizer=self.keras_optimizer,
                    rule=self.optimizer, keras_line="legacy" if self.legacy else "current")


def test_tf_keras_step(request, benchmark, case, peer, rnd):
    data = harness.live(LAYER, case, lambda: Data(case))
    if (data.exactness is None and not harness.Settings.quick
            and {"ours", "stock"} <= harness.timed_here(request.config, LAYER, case)):
        # Where both are timed side by side (not in test_alone's children),
        # before any peer of the case holds its variables: the lockstep's
        # are gone when it returns.
        data.exactness = data.lockstep()
        gc.collect()
    timed_method(benchmark, LAYER, case, peer, rnd, lambda: data)
    if peer == "ours" and data.exactness is not None:
        benchmark.extra_info["exactness"] = data.exactness


@pytest.fixture(autouse=True, scope="module")
def _drop():
    yield
    harness.drop_all()
