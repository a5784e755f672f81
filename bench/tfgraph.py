"""Gradients made inside a ``tf.function``, as a backward pass leaves them,
for the TensorFlow, LossScale and optimizer benchmarks.

Passing a gradient list as a function's arguments measures something else:
the caller still holds the tensors, so no op may write over them, and with
2,000 arguments the cost of calling the function dominates every method.
Inside the graph each gradient is a fresh buffer nobody else reads.

Two traps, both fixed here:

* a plain elementwise producer lets Grappler fold the stock composite's
  multiply by a scalar into the producer, so the composite's unscale costs
  nothing, which no real gradient (the output of a convolution or matmul
  gradient) allows.  Each big gradient therefore ends in an op Grappler
  cannot see through: the stateful pass-through op of the lossscale op
  library, which hands on its input buffer untouched;
* every method must end in the same consumer (a read of one value per
  tensor) so that nothing is pruned and the producer alone (``producer``:
  make the gradients, consume them) costs what it costs inside every
  method.  It is timed just before every sample of a method, and the
  report subtracts the pairs.
"""

import numpy as np

import harness


class Method:
    """A peer's step, the part of it that is not measured (``baseline``),
    which path it ran (``step_path()``, asked after its first call: the
    optimizer decides when it traces) and how many steps it applied."""

    def __init__(self, step, baseline, step_path, applied):
        self.step, self.baseline, self.step_path, self.applied = step, baseline, step_path, applied


def timed_method(benchmark, layer, case, peer, rnd, make, must_apply=True, cycle=1):
    """Time ``peer``'s ``Method`` on the layer's live data for ``case``
    (``make()`` builds it on first use), its producer as the baseline, over
    whole cycles of ``cycle`` calls (``harness.timed``), and record the path
    it took; with ``must_apply``, the first round fails where the peer
    applied none of its steps (they are all finite).  Returns
    ``(data, method)``."""
    data = harness.live(layer, case, make)
    m = data.method(peer)
    harness.timed(benchmark, (layer, case, peer), m.step, data.info(peer, rnd),
                  baseline=m.baseline, cycle=cycle)
    benchmark.extra_info["step_path"] = m.step_path()
    if must_apply and rnd == 0:
        assert m.applied() > 0, f"{peer} skipped its steps on finite gradients"
    return data, m


def keras_apply_method(graph, opt, variables, peer, grads=lambda gs: gs):
    """The ``Method`` of a Keras optimizer's ``apply`` on ``graph``'s
    gradients (``grads`` turns them into what the step hands the optimizer,
    IndexedSlices say), in the graph that makes them."""

    def step(gs):
        opt.apply(grads(gs), variables)
        # Read the variables, not the gradients: a later reader of the
        # gradients would stop a native op from writing over them.
        return [v.value for v in variables], None

    return _optimizer_method(graph, step, opt, peer)


def custom_loop_method(graph, opt, variables, peer):
    """The ``Method`` of TensorFlow 2.4's custom training loop on ``graph``'s
    scaled gradients, in the graph that makes them: ``opt`` (a ``tf_keras``
    loss-scale optimizer) ``get_unscaled_gradients``, then ``apply_gradients``."""

    def step(gs):
        unscaled = opt.get_unscaled_gradients(gs)
        opt.apply_gradients(zip(unscaled, variables))
        return [v.read_value() for v in variables], None

    return _optimizer_method(graph, step, opt, peer)


def _optimizer_method(graph, step, opt, peer):
    """The ``Method`` of ``step`` (gradients -> what it returns) of the
    loss-scale optimizer ``opt`` in ``graph``: the path ``opt`` says it took
    (``"stock"`` for the stock peer), the steps it applied."""

    def path():
        return getattr(opt, "step_path", "unfused") if peer != "stock" else "stock"

    return Method(graph.wrap(step), graph.producer, path, lambda: int(opt.iterations.numpy()))


class GraphGradients:
    """``produce(seed)`` makes the workload's gradients in the graph;
    ``consume(grads)`` is the common ending; ``producer`` the baseline."""

    def __init__(self, arrays):
        tf = harness.tensorflow()
        self.dtype = tf.as_dtype(arrays[0].dtype)
        if len(arrays) > 500:
            # Thousands of small tensors: one split of a flat tensor, so
            # making them is cheap next to what is measured.
            assert all(a.ndim == 1 for a in arrays)
            sizes = [a.size for a in arrays]
            self.seed = tf.constant(np.concatenate(arrays))

            def produce(x):
                return tf.split(x, sizes)
        else:
            from lossscale import _loader

            opaque = _loader.load()[0].loss_scale_debug_buffer_address
            self.seed = tf.constant(1.0, dtype=self.dtype)
            sources = [tf.constant(a) for a in arrays]

            def produce(x):
                return [opaque(tf.reverse(t * x, [0]))[0] for t in sources]

        self.produce = produce

        if len(arrays) > 500:
            # One op rather than thousands: tracing stays short, and the
            # copy of a few hundred KiB is part of the subtracted baseline.
            def consume(gs):
                return tf.reduce_sum(tf.cast(tf.concat(gs, 0)[::64], tf.float32))
        else:
            def consume(gs):
                return tf.add_n([tf.cast(tf.reshape(g, [-1])[0], tf.float32) for g in gs])

        self.consume = consume
        producer = tf.function(lambda x: consume(produce(x)))
        self.producer = lambda: producer(self.seed)

    def wrap(self, step):
        """A ``tf.function`` of no arguments: make the gradients, run
        ``step(grads) -> (outputs or None, flag or None)``, consume."""
        tf = harness.tensorflow()
        produce, consume = self.produce, self.consume

        def run(x):
            gs = produce(x)
            outs, flag = step(gs)
            return consume(gs if outs is None else outs), flag

        fn = tf.function(run)
        seed = self.seed
        return lambda: fn(seed)


class GraphCase(harness.CaseData):
    """A workload case whose methods take gradients made in the graph
    (``self.graph``; its ``producer`` is the baseline to subtract)."""

    def __init__(self, case):
        super().__init__(case)
        self.graph = GraphGradients(self.arrays)
