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
                       and then steps.

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
from tfgraph import GraphCase, Method, keras_apply_method, timed_method

LAYER = "step"
OPTIMIZERS = ("sgdm", "adam")
LEARNING_RATE = 1e-3
MOMENTUM = 0.9
SCALE = 2.0 ** 8
PERIOD = 10 ** 9
PEERS = ["ours", "ours_unfused", "stock", "torch_fused", "torch_foreach"]
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
        return ["resnet50/float32/adam"]
    return [f"{w}/float32/{o}" for w in workloads.LISTS for o in OPTIMIZERS]


def items(settings):
    return [(c, p) for c in cases(settings) for p in peers()]


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
        return self._keras(peer)

    def _keras(self, peer):
        import keras

        variables = [keras.Variable(np.zeros_like(a), name=f"w{i}")
                     for i, a in enumerate(self.arrays)]
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
        return keras_apply_method(self.graph, opt, variables, peer)

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
        return super().info(peer, rnd, optimizer=self.optimizer,
                            gradients="made in the graph" if not peer.startswith("torch")
                            else "copied into .grad")


def test_step(benchmark, case, peer, rnd):
    timed_method(benchmark, LAYER, case, peer, rnd, lambda: Data(case))


@pytest.fixture(autouse=True, scope="module")
def _drop():
    yield
    harness.drop_all()
