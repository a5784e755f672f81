/*
 * LossScaleLambMoments: the elementwise part of Keras' Lamb update_step
 * over a whole variable list, the gradients unscaled on the fly (the
 * core's ls_lamb_moments_with on TensorFlow's intra-op pool): m and v
 * moved in place, each variable's u an output.  The caller runs it only on
 * a step that applies and takes the norms, their ratio and the variables'
 * move by u with TensorFlow's own ops, as Keras takes them.
 *
 * Every m and v is looked up, locked, checked (initialized, float32, the
 * gradient's shape, or a sparse gradient's slices and indices against
 * m's) and made its own before anything is written, so an error leaves
 * them as they were.  An output takes over its dense gradient's buffer
 * where TensorFlow lets it; a large one that cannot (a sparse gradient's)
 * reuses the buffer this kernel handed out on the last step, once that
 * step is done with it.
 */
#include <algorithm>
#include <string>
#include <vector>

#include "lossscale_tf.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace lossscale_tf {
namespace {

using tf::shape_inference::InferenceContext;

// An output is handed its gradient's buffer only where that buffer is this
// many bytes per variable of the list or more: OpKernelContext's
// forward_input scans every output for a reservation.
constexpr size_t kForwardBytesPerOutput = 16;

// An output this large or larger that takes no gradient's buffer is kept
// by the kernel from step to step (LambMomentsOp::KeptOutput).
constexpr size_t kKeptBytes = size_t{1} << 20;

// Ascending positions of variables, each below n.
tf::Status Positions(const std::vector<int>& positions, int n, const char* what) {
    if (AscendingPositions(positions, n))
        return tf::OkStatus();
    return tf::errors::InvalidArgument("LossScaleLambMoments: ", what,
                                       " must be ascending positions of variables, below ", n);
}

tf::Status LambShapes(InferenceContext* c) {
    int n = 0, decayed = 0, sparse = 0;
    std::vector<int> normed;
    TF_RETURN_IF_ERROR(c->GetAttr("normed", &normed));
    TF_RETURN_IF_ERROR(c->GetAttr("num_variables", &n));
    TF_RETURN_IF_ERROR(c->GetAttr("num_decayed", &decayed));
    TF_RETURN_IF_ERROR(c->GetAttr("num_sparse", &sparse));
    std::vector<int> positions;
    TF_RETURN_IF_ERROR(c->GetAttr("sparse", &positions));
    tf::shape_inference::ShapeHandle unused;
    const int numbers = 3 * n + 3 + decayed;
    for (int i : {3 * n, 3 * n + 1, 3 * n + 2, numbers, numbers + 1})
        TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
    for (int k = 0; k < sparse; ++k)
        TF_RETURN_IF_ERROR(c->WithRank(c->input(numbers + 2 + k), 1, &unused));
    for (int i = 0; i < n; ++i) {
        if (std::find(positions.begin(), positions.end(), i) == positions.end()) {
            c->set_output(i, c->input(2 * n + i));
            continue;
        }
        // A sparse gradient's u is its variable's shape: m's, where the
        // handle says it.
        const auto* m = c->input_handle_shapes_and_types(i);
        c->set_output(i, m != nullptr && !m->empty() ? (*m)[0].shape : c->UnknownShape());
    }
    c->set_output(n, c->Matrix(static_cast<int64_t>(normed.size()), 2));
    return tf::OkStatus();
}

REGISTER_OP("LossScaleLambMoments")
    .Input("m: num_variables * resource")
    .Input("v: num_variables * resource")
    .Input("grads: num_variables * float")
    .Input("scale: float")
    .Input("bias_1: float")
    .Input("bias_2: float")
    .Input("variables: num_decayed * resource")
    .Input("learning_rate: float")
    .Input("weight_decay: float")
    .Input("indices: num_sparse * int64")
    .Input("weights: num_weights * resource")
    .Output("u: num_variables * float")
    .Output("sums: float")
    .Attr("num_variables: int >= 1")
    .Attr("num_decayed: int >= 0 = 0")
    .Attr("decayed: list(int) = []")
    .Attr("decay: list(int) = []")
    .Attr("num_sparse: int >= 0 = 0")
    .Attr("sparse: list(int) = []")
    .Attr("normed: list(int) = []")
    .Attr("num_weights: int >= 0 = 0")
    .Attr("one_minus_beta_1: float")
    .Attr("one_minus_beta_2: float")
    .Attr("epsilon: float")
    .Attr("unscale: {'none', 'divide'} = 'divide'")
    .SetIsStateful()
    .SetShapeFn(LambShapes)
    .Doc(R"doc(
The elementwise part of one step of Keras' Lamb for every variable: its
gradient first divided by `scale` ('divide') or taken as it is, then
m = m + (g - m) * one_minus_beta_1, v = v + (g * g - v) * one_minus_beta_2
in place, and u = (m / bias_1) / (sqrt(v / bias_2) + epsilon) out, where
bias_1 and bias_2 are Keras' 1 - beta ** step (lossscale.h,
ls_lamb_moments_with).  `decayed` (ascending positions, one `variables`
entry and one `decay` each): those variables are first decayed in the
same pass, as Keras' weight decay moves them before its update, `decay`
saying how (1 var - (var * weight_decay) * learning_rate, 2 var - var *
(weight_decay * learning_rate), 3 var - var * weight_decay:
`weight_decay` the whole factor).  `sparse` (ascending positions, one
`indices` entry each): those gradients are sparse (an IndexedSlices):
their `grads` entry holds the slices, row indices[k] of the variable for
slice k, taken as Keras' Lamb densifies them, never made whole: each
slice value unscaled, then a row's slices added in their order onto 0
for g, and their squares alike in place of g * g (0 for a row no slice
names).  `normed` (ascending positions): `sums` row k is
[sum(w * w), sum(u * u)] of variable normed[k], each in the order of
TensorFlow's Sum over the whole tensor on this device's threads, w after
its decay, each leaf of the sum taken in the pass while in cache; the
variable is the decayed one where normed[k] is decayed, else the next of
`weights` (read only).  Run it only on a step that applies.
)doc");

class LambMomentsOp : public tf::OpKernel {
  public:
    explicit LambMomentsOp(tf::OpKernelConstruction* ctx) : tf::OpKernel(ctx) {
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_variables", &n_));
        std::string unscale;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("unscale", &unscale));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("one_minus_beta_1", &config_.one_minus_beta_1));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("one_minus_beta_2", &config_.one_minus_beta_2));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("epsilon", &config_.epsilon));
        config_.unscale = UnscaleMode(unscale);
        OP_REQUIRES_OK(ctx, ctx->GetAttr("decayed", &decayed_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("decay", &decay_));
        int num_decayed = 0;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_decayed", &num_decayed));
        OP_REQUIRES(ctx,
                    static_cast<size_t>(num_decayed) == decayed_.size() &&
                        decay_.size() == decayed_.size(),
                    tf::errors::InvalidArgument("LossScaleLambMoments: ", num_decayed,
                                                " variables and ", decay_.size(),
                                                " decays for ", decayed_.size(),
                                                " decayed variables"));
        OP_REQUIRES_OK(ctx, Positions(decayed_, n_, "decayed"));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("sparse", &sparse_));
        int num_sparse = 0;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_sparse", &num_sparse));
        OP_REQUIRES(ctx, static_cast<size_t>(num_sparse) == sparse_.size(),
                    tf::errors::InvalidArgument("LossScaleLambMoments: ", num_sparse,
                                                " indices for ", sparse_.size(),
                                                " sparse variables"));
        OP_REQUIRES_OK(ctx, Positions(sparse_, n_, "sparse"));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("normed", &normed_));
        OP_REQUIRES_OK(ctx, Positions(normed_, n_, "normed"));
        int num_weights = 0;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_weights", &num_weights));
        size_t undecayed = 0;
        for (const int i : normed_)
            undecayed += std::find(decayed_.begin(), decayed_.end(), i) == decayed_.end();
        OP_REQUIRES(ctx, static_cast<size_t>(num_weights) == undecayed,
                    tf::errors::InvalidArgument("LossScaleLambMoments: ", num_weights,
                                                " weights for ", undecayed,
                                                " normed variables not decayed"));
        for (const int d : decay_)
            OP_REQUIRES(ctx, d > LS_DECAY_NONE && d <= LS_DECAY_FACTOR,
                        tf::errors::InvalidArgument("LossScaleLambMoments: a decay must be 1, "
                                                    "2 or 3, got ",
                                                    d));
    }

    void Compute(tf::OpKernelContext* ctx) override {
        const int n = n_;
        const int grads_first = 2 * n, first_scalar = 3 * n;
        const int vars_first = first_scalar + 3;
        const int decayed = static_cast<int>(decayed_.size());
        OP_REQUIRES_OK(ctx, CheckScalarInputs(ctx, first_scalar, 3, type_string()));
        OP_REQUIRES_OK(ctx, CheckScalarInputs(ctx, vars_first + decayed, 2, type_string()));
        ls_lamb_config config = config_;
        config.scale = ctx->input(first_scalar).scalar<float>()();
        config.bias_1 = ctx->input(first_scalar + 1).scalar<float>()();
        config.bias_2 = ctx->input(first_scalar + 2).scalar<float>()();
        config.learning_rate = ctx->input(vars_first + decayed).scalar<float>()();
        config.weight_decay = ctx->input(vars_first + decayed + 1).scalar<float>()();

        // m, v, the decayed variables, then the weights (read only):
        // vars.var(t) in this order.
        const int weights_first = vars_first + decayed + 2 + static_cast<int>(sparse_.size());
        std::vector<int> inputs;
        for (int i = 0; i < grads_first; ++i)
            inputs.push_back(i);
        for (int k = 0; k < decayed; ++k)
            inputs.push_back(vars_first + k);
        std::vector<int> weighted; // the variable of each weights input
        for (const int i : normed_)
            if (std::find(decayed_.begin(), decayed_.end(), i) == decayed_.end()) {
                inputs.push_back(weights_first + static_cast<int>(weighted.size()));
                weighted.push_back(i);
            }
        UpdatedVariables vars;
        int twice = -1;
        OP_REQUIRES_OK(ctx, vars.LookUp(ctx, inputs, &twice));
        OP_REQUIRES(ctx, twice < 0,
                    tf::errors::InvalidArgument(type_string(),
                                                ": a slot or variable is passed twice (",
                                                VariableNameAt(ctx, inputs[twice]), ")"));
        vars.Lock();

        // A sparse gradient's slices against its m's shape, which its v's
        // and its variable's must then match; the others' shapes are their
        // gradients'.
        const int indices_first = vars_first + decayed + 2;
        std::vector<ls_lamb_param> params(n);
        std::vector<tf::TensorShape> shapes(n);
        for (int i = 0, k = 0; i < n; ++i) {
            const tf::Tensor& g = ctx->input(grads_first + i);
            shapes[i] = g.shape();
            if (k >= static_cast<int>(sparse_.size()) || sparse_[k] != i)
                continue;
            const tf::Tensor* m = vars.var(i)->tensor();
            OP_REQUIRES_OK(ctx, CheckFloatVariable(ctx, type_string(), vars.var(i), inputs[i],
                                                   m->shape(), m->shape()));
            shapes[i] = m->shape();
            SparseSlices rows;
            OP_REQUIRES_OK(ctx, CheckSparseSlices(
                                    type_string(), "sparse gradient " + std::to_string(i) +
                                                       " (its m: " +
                                                       VariableNameAt(ctx, inputs[i]) + ")",
                                    g, ctx->input(indices_first + k), shapes[i], &rows));
            params[i].indices = rows.indices;
            params[i].slices = rows.slices;
            params[i].row_length = rows.row_length;
            ++k;
        }
        for (size_t t = 0; t < vars.size(); ++t) {
            const int at = static_cast<int>(t);
            const int of = at < grads_first           ? at % n
                           : at < grads_first + decayed ? decayed_[at - grads_first]
                                                        : weighted[at - grads_first - decayed];
            OP_REQUIRES_OK(ctx, CheckFloatVariable(ctx, type_string(), vars.var(t), inputs[t],
                                                   shapes[of], shapes[of]));
        }
        for (int t = 0; t < grads_first + decayed; ++t)
            OP_REQUIRES_OK(ctx, vars.PrepareToUpdate(ctx, t));
        tf::Tensor* sums = nullptr;
        OP_REQUIRES_OK(ctx, ctx->allocate_output(
                                n, tf::TensorShape({static_cast<int64_t>(normed_.size()), 2}),
                                &sums));

        const size_t forward_min_bytes = kForwardBytesPerOutput * static_cast<size_t>(n);
        for (int i = 0; i < n; ++i) {
            const tf::Tensor& g = ctx->input(grads_first + i);
            tf::Tensor* out = nullptr;
            if (params[i].indices == nullptr && g.RefCountIsOne() &&
                g.TotalBytes() >= forward_min_bytes) {
                std::unique_ptr<tf::Tensor> forwarded = ctx->forward_input(
                    grads_first + i, i, g.dtype(), g.shape(), ctx->output_memory_type(i),
                    ctx->output_alloc_attr(i));
                if (forwarded != nullptr) {
                    ctx->set_output(i, std::move(*forwarded));
                    out = ctx->mutable_output(i);
                }
            }
            if (out == nullptr)
                OP_REQUIRES_OK(ctx, KeptOutput(ctx, i, shapes[i], &out));
            ls_lamb_param& p = params[i];
            p.grad = g.flat<float>().data();
            p.u = out->flat<float>().data();
            p.m = FloatsOf(vars.var(i));
            p.v = FloatsOf(vars.var(n + i));
            p.length = static_cast<size_t>(shapes[i].num_elements());
        }
        for (size_t k = 0; k < weighted.size(); ++k)
            params[weighted[k]].weights = FloatsOf(vars.var(grads_first + decayed + k));
        for (size_t k = 0; k < normed_.size(); ++k)
            params[normed_[k]].sums = sums->flat<float>().data() + 2 * k;
        const int threads = ctx->eigen_cpu_device().numThreads();
        config.eigen_threads = threads < 1 ? 1 : threads;
        for (int k = 0; k < decayed; ++k) {
            params[decayed_[k]].var = FloatsOf(vars.var(grads_first + k));
            params[decayed_[k]].decay = decay_[k];
        }
        const char* why = ls_lamb_problem(params.data(), params.size(), &config);
        OP_REQUIRES(ctx, why == nullptr, tf::errors::InvalidArgument(type_string(), ": ", why));
        const int rc = ls_lamb_moments_with(params.data(), params.size(), &config,
                                            LS_FLUSH_DENORMALS, ParallelForOnPool, ctx);
        OP_REQUIRES(ctx, rc >= 0, CoreError(rc, type_string().c_str()));
    }

  private:
    // Output i of `shape` where no gradient's buffer is handed over (a
    // sparse gradient's u, or a gradient TensorFlow does not let go): a
    // buffer this kernel keeps and hands out again once nothing else holds
    // it (the last step's consumers are done), where it is kKeptBytes or
    // more.  Fresh, a buffer that large is fresh pages from the system, a
    // page fault each on every step.
    tf::Status KeptOutput(tf::OpKernelContext* ctx, int i, const tf::TensorShape& shape,
                          tf::Tensor** out) {
        if (static_cast<size_t>(shape.num_elements()) * sizeof(float) < kKeptBytes)
            return ctx->allocate_output(i, shape, out);
        tf::mutex_lock lock(mu_);
        if (kept_.size() < static_cast<size_t>(n_))
            kept_.resize(n_);
        tf::Tensor& kept = kept_[i];
        if (kept.IsInitialized() && kept.shape() == shape && kept.RefCountIsOne()) {
            ctx->set_output(i, kept);
            *out = ctx->mutable_output(i);
            return tf::OkStatus();
        }
        TF_RETURN_IF_ERROR(ctx->allocate_output(i, shape, out));
        kept = **out;
        return tf::OkStatus();
    }

    int n_ = 0;
    std::vector<int> decayed_, decay_, sparse_, normed_;
    ls_lamb_config config_ = {};
    tf::mutex mu_;
    std::vector<tf::Tensor> kept_ TF_GUARDED_BY(mu_);
};

REGISTER_KERNEL_BUILDER(Name("LossScaleLambMoments").Device(tf::DEVICE_CPU), LambMomentsOp);

}  // namespace
}  // namespace lossscale_tf
