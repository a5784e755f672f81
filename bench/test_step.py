"""The optimizer step a user times: scaled gradients in, finite check,
unscale and the SGD-momentum or Adam update of every variable, for
``lossscale.LossScaleOptimizer`` and its peers on the same gradient list.

Peers, all with learning rate 1e-3, the scale fixed at 2**8 (growth period
10**9, so every call does the same work) and float32 variables of the
workload's shapes:

* ``ours``          -- ``lossscale.LossScaleOptimizer(inner).apply`` in
                       ``tf.function``, whatever step it takes by default
                       (``extra_info["step_path"]`` says which);
* ``ours_unfused``  -- the same with ``fused=False``, when the constructor
                       takes that argument;
* ``stock``         -- ``keras.optimizers.LossScaleOptimizer(inner).apply``;
* ``torch_fused``   -- ``torch.optim.SGD/Adam(fused=True)`` stepped by
                       ``torch.amp.GradScaler``, which hands the optimizer its
                       ``grad_scale`` and ``found_inf`` tensors after a
                       read-only finite check;
* ``torch_foreach`` -- the same optimizers with ``foreach=True``:
                       GradScaler unscales in place with
                       ``torch._amp_foreach_non_finite_check_and_unscale_``
                       and then steps;
* ``core``          -- the same fused step through ``lossscale.core``
                       (``sgd_step_`` / ``adam_step_``, check, unscale and
                       update) over numpy buffers of the workload's shapes:
                       our kernels with no TensorFlow around them;
* ``core_cached``   -- ``core`` over a cut of the workload that stays in
                       the last-level cache (``CACHED_VALUES`` values in 16
                       tensors: 12 MiB of variables, gradients and slots for
                       SGD-momentum, 16 MiB for Adam), its time scaled up to
                       the whole workload (``workload_share``): the
                       kernels fed from the cache instead of memory (their
                       arithmetic and the cache's bandwidth);
* ``ours_fixed``    -- ``ours`` on as many variables of 4 values each:
                       what a step costs whatever the sizes (calling the
                       function, TensorFlow's executor, the small ops).

``core``, ``core_cached`` and ``ours_fixed`` split ``ours``: the kernels'
own time, what they take with memory out of the way, and what TensorFlow
adds around them (the report's "where the step's time goes").

TensorFlow's gradients are made inside the graph (``tfgraph.py``) and
torch's are copied into ``.grad`` from the same values; making them alone
(the ``producer``) is timed before every sample and subtracted by the
report.  The report adds the roofline: the bytes the fused step must move
(a read-only check of the gradients, 4 B per parameter, then the update:
20 B for SGD-momentum, 28 B for Adam) at the bandwidth of the numpy layer's
in-place multiply over 1 GiB at the step's own thread count, in the same
run.  The first call of every method (tracing for ``tf.function``) is kept:
the 2,000-variable case is the tracing benchmark of the step.
"""

import inspect

import numpy as np
import pytest

import harness
import workloads
from tfgraph import GraphCase, GraphGradients, Method, keras_apply_method, timed_method

LAYER = "step"
OPTIMIZERS = ("sgdm", "adam")
LEARNING_RATE = 1e-3
MOMENTUM = 0.9
SCALE = 2.0 ** 8
PERIOD = 10 ** 9
PEERS = ["ours", "ours_unfused", "stock", "torch_fused", "torch_foreach", "core", "core_cached",
         "ours_fixed"]
# The peers that split ``ours`` (not run on the 2,000-tensor tracing case).
SPLIT_PEERS = ("core", "core_cached", "ours_fixed")
# Values of ``core_cached``'s cut, in CACHED_TENSORS tensors.
CACHED_VALUES = 1 << 20
CACHED_TENSORS = 16
# Values in each variable of ``ours_fixed``.
FIXED_VALUES = 4
# tf_keras' RMSprop defaults, for torch's RMSprop beside it in the tf_keras
# step (tf_keras_step_child.py), which shares these torch peers.
RMSPROP_RHO = 0.9
RMSPROP_EPSILON = 1e-7


def has_fused_argument():
    from lossscale import LossScaleOptimizer

    return "fused" in inspect.signature(LossScaleOptimizer.__init__).parameters


def peers():
    return [p for p in PEERS if p != "ours_unfused" or has_fused_argument()]


def cases(settings):
    if settings.quick:
        # Tracing 2,000 variables takes tens of seconds per Keras peer: full run only.
        return harness.wanted(["resnet50/float32/adam"], settings)
    return harness.wanted([f"{w}/float32/{o}" for w in workloads.LISTS for o in OPTIMIZERS],
                          settings)


def items(settings):
    return [(c, p) for c in cases(settings) for p in peers()
            if not (c.startswith("tiny_") and p in SPLIT_PEERS)]


def keras_inner(optimizer):
    import keras

    if optimizer == "sgdm":
        return keras.optimizers.SGD(LEARNING_RATE, momentum=MOMENTUM)
    return keras.optimizers.Adam(LEARNING_RATE)


def torch_optimizer(torch, optimizer, params, **kind):
    if optimizer == "sgdm":
        return torch.optim.SGD(params, lr=LEARNING_RATE, momentum=MOMENTUM, **kind)
    if optimizer == "rmsprop":
        return torch.optim.RMSprop(params, lr=LEARNING_RATE, alpha=RMSPROP_RHO,
                                   eps=RMSPROP_EPSILON, **kind)
    return torch.optim.Adam(params, lr=LEARNING_RATE, **kind)


class Data(GraphCase):
    layer = LAYER

    def __init__(self, case):
        workload, dtype, self.optimizer = case.split("/")
        super().__init__(f"{workload}/{dtype}")
        self.case = case

    def _make(self, peer):
        if peer.startswith("torch"):
            return self._torch(peer)
        if peer in ("core", "core_cached"):
            return self._core(cached=peer == "core_cached")
        return self._keras(peer)

    def _keras(self, peer):
        import keras

        arrays, graph = self.arrays, self.graph
        if peer == "ours_fixed":
            arrays = [np.ones(FIXED_VALUES, np.float32) for _ in self.arrays]
            graph = GraphGradients(arrays)
        variables = [keras.Variable(np.zeros_like(a), name=f"w{i}")
                     for i, a in enumerate(arrays)]
        inner = keras_inner(self.optimizer)
        if peer == "stock":
            opt = keras.optimizers.LossScaleOptimizer(inner, initial_scale=SCALE,
                                                      dynamic_growth_steps=PERIOD)
        else:
            from lossscale import LossScaleOptimizer

            extra = {"fused": False} if peer == "ours_unfused" else {}
            opt = LossScaleOptimizer(inner, initial_scale=SCALE, dynamic_growth_steps=PERIOD,
                                     **extra)
        opt.build(variables)
        return keras_apply_method(graph, opt, variables, peer)

    def _core(self, cached):
        from lossscale import core

        if cached:
            flat = np.concatenate([a.ravel() for a in self.arrays])[:CACHED_VALUES]
            grads = np.split(flat.copy(), CACHED_TENSORS)
        else:
            grads = [a.copy() for a in self.arrays]
        variables = [np.zeros_like(a) for a in grads]
        slots = [[np.zeros_like(a) for a in grads]
                 for _ in range(1 if self.optimizer == "sgdm" else 2)]
        steps = [0]
        # A step's scalars as the fused op gets them; their values do not
        # change the work (nothing short-circuits on a value).
        common = dict(learning_rate=LEARNING_RATE, scale=SCALE, flush_denormals=True)
        if self.optimizer == "sgdm":
            def run():
                return core.sgd_step_(variables, grads, slots[0], momentum=MOMENTUM, **common)
        else:
            def run():
                return core.adam_step_(variables, grads, slots[0], slots[1],
                                       alpha=LEARNING_RATE, **common)

        def step():
            steps[0] += run()

        return Method(step, None, lambda: "lossscale.core", lambda: steps[0])

    def _torch(self, peer):
        torch = harness.torch_or_skip()
        sources = [torch.from_numpy(a) for a in self.arrays]
        params = [torch.zeros(a.shape, requires_grad=True) for a in self.arrays]
        grads = [torch.empty_like(p) for p in params]
        for p, g in zip(params, grads):
            p.grad = g
        kind = {"fused": True} if peer == "torch_fused" else {"foreach": True}
        opt = torch_optimizer(torch, self.optimizer, params, **kind)
        scaler = torch.amp.GradScaler("cpu", init_scale=SCALE, growth_interval=PERIOD)
        # The scale is made lazily by the first `scale`, as a training loop does.
        scaler.scale(torch.ones(()))
        copy = torch._foreach_copy_

        def produce():
            copy(grads, sources)

        def step():
            copy(grads, sources)
            scaler.step(opt)
            scaler.update()

        def applied():
            state = opt.state[params[0]]
            return int(state["step"]) if "step" in state else int("momentum_buffer" in state)

        return Method(step, produce, lambda: peer, applied)

    def info(self, peer, rnd):
        extra = {}
        if peer == "core_cached":
            # One call covers this share of the workload; the report scales.
            extra["workload_share"] = CACHED_VALUES / sum(a.size for a in self.arrays)
        return super().info(peer, rnd, optimizer=self.optimizer, **extra,
                            gradients=("copied into .grad" if peer.startswith("torch")
                                       else "numpy buffers" if peer.startswith("core")
                                       else "made in the graph"))


def test_step(benchmark, case, peer, rnd):
    timed_method(benchmark, LAYER, case, peer, rnd, lambda: Data(case))


@pytest.fixture(autouse=True, scope="module")
def _drop():
    yield
    harness.drop_all()
