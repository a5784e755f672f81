/*
 * LossScaleLambMoments: the elementwise part of Keras' Lamb update_step
 * over a whole variable list, the gradients unscaled on the fly (the
 * core's ls_lamb_moments_with on TensorFlow's intra-op pool): m and v
 * moved in place, each variable's u an output.  The caller runs it only on
 * a step that applies and takes the norms, their ratio and the variables'
 * move by u with TensorFlow's own ops, as Keras takes them.
 *
 * Every m and v is looked up, locked, checked (initialized, float32, the
 * gradient's shape) and made its own before anything is written, so an
 * error leaves them as they were.  An output takes over its gradient's
 * buffer where TensorFlow lets it.
 */
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

// Ascending positions of variables, each below n.
tf::Status Positions(const std::vector<int>& positions, int n, const char* what) {
    if (AscendingPositions(positions, n))
        return tf::OkStatus();
    return tf::errors::InvalidArgument("LossScaleLambMoments: ", what,
                                       " must be ascending positions of variables, below ", n);
}

tf::Status LambShapes(InferenceContext* c) {
    int n = 0, terms = 0, decayed = 0;
    TF_RETURN_IF_ERROR(c->GetAttr("num_variables", &n));
    TF_RETURN_IF_ERROR(c->GetAttr("num_terms", &terms));
    TF_RETURN_IF_ERROR(c->GetAttr("num_decayed", &decayed));
    tf::shape_inference::ShapeHandle unused;
    const int numbers = 3 * n + 3 + terms + decayed;
    for (int i : {3 * n, 3 * n + 1, 3 * n + 2, numbers, numbers + 1})
        TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
    for (int i = 0; i < n; ++i)
        c->set_output(i, c->input(2 * n + i));
    return tf::OkStatus();
}

REGISTER_OP("LossScaleLambMoments")
    .Input("m: num_variables * resource")
    .Input("v: num_variables * resource")
    .Input("grads: num_variables * float")
    .Input("scale: float")
    .Input("bias_1: float")
    .Input("bias_2: float")
    .Input("terms: num_terms * float")
    .Input("variables: num_decayed * resource")
    .Input("learning_rate: float")
    .Input("weight_decay: float")
    .Output("u: num_variables * float")
    .Attr("num_variables: int >= 1")
    .Attr("num_terms: int >= 0 = 0")
    .Attr("termed: list(int) = []")
    .Attr("num_decayed: int >= 0 = 0")
    .Attr("decayed: list(int) = []")
    .Attr("decay: list(int) = []")
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
ls_lamb_moments_with).  `termed` (ascending positions of variables, one
`terms` entry each, of the gradient's shape): those gradients are a sparse
gradient as Keras densifies it (its slices summed per row), taken as they
are, and their term is v's in place of g * g (the slices' squares summed
alike).  `decayed` (ascending positions, one `variables` entry and one
`decay` each): those variables are first decayed in the same pass, as
Keras' weight decay moves them before its update, `decay` saying how (1
var - (var * weight_decay) * learning_rate, 2 var - var * (weight_decay *
learning_rate), 3 var - var * weight_decay: `weight_decay` the whole
factor).  Run it only on a step that applies.
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
        OP_REQUIRES_OK(ctx, ctx->GetAttr("termed", &termed_));
        int num_terms = 0;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_terms", &num_terms));
        OP_REQUIRES(ctx, static_cast<size_t>(num_terms) == termed_.size(),
                    tf::errors::InvalidArgument("LossScaleLambMoments: ", num_terms,
                                                " terms for ", termed_.size(),
                                                " termed variables"));
        OP_REQUIRES_OK(ctx, Positions(termed_, n_, "termed"));
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
        for (const int d : decay_)
            OP_REQUIRES(ctx, d > LS_DECAY_NONE && d <= LS_DECAY_FACTOR,
                        tf::errors::InvalidArgument("LossScaleLambMoments: a decay must be 1, "
                                                    "2 or 3, got ",
                                                    d));
    }

    void Compute(tf::OpKernelContext* ctx) override {
        const int n = n_;
        const int grads_first = 2 * n, first_scalar = 3 * n;
        const int vars_first = first_scalar + 3 + static_cast<int>(termed_.size());
        const int decayed = static_cast<int>(decayed_.size());
        OP_REQUIRES_OK(ctx, CheckScalarInputs(ctx, first_scalar, 3, type_string()));
        OP_REQUIRES_OK(ctx, CheckScalarInputs(ctx, vars_first + decayed, 2, type_string()));
        ls_lamb_config config = config_;
        config.scale = ctx->input(first_scalar).scalar<float>()();
        config.bias_1 = ctx->input(first_scalar + 1).scalar<float>()();
        config.bias_2 = ctx->input(first_scalar + 2).scalar<float>()();
        config.learning_rate = ctx->input(vars_first + decayed).scalar<float>()();
        config.weight_decay = ctx->input(vars_first + decayed + 1).scalar<float>()();

        // m, v, then the decayed variables: vars.var(t) in this order.
        std::vector<int> inputs;
        for (int i = 0; i < grads_first; ++i)
            inputs.push_back(i);
        for (int k = 0; k < decayed; ++k)
            inputs.push_back(vars_first + k);
        UpdatedVariables vars;
        int twice = -1;
        OP_REQUIRES_OK(ctx, vars.LookUp(ctx, inputs, &twice));
        OP_REQUIRES(ctx, twice < 0,
                    tf::errors::InvalidArgument(type_string(),
                                                ": a slot or variable is passed twice (",
                                                VariableNameAt(ctx, inputs[twice]), ")"));
        vars.Lock();

        for (int t = 0; t < grads_first + decayed; ++t) {
            const int of = t < grads_first ? t % n : decayed_[t - grads_first];
            const tf::TensorShape& shape = ctx->input(grads_first + of).shape();
            OP_REQUIRES_OK(ctx, CheckFloatVariable(ctx, type_string(), vars.var(t), inputs[t],
                                                   shape, shape));
        }
        for (size_t t = 0; t < vars.size(); ++t)
            OP_REQUIRES_OK(ctx, vars.PrepareToUpdate(ctx, t));

        const size_t forward_min_bytes = kForwardBytesPerOutput * static_cast<size_t>(n);
        std::vector<ls_lamb_param> params(n);
        for (int i = 0; i < n; ++i) {
            const tf::Tensor& g = ctx->input(grads_first + i);
            tf::Tensor* out = nullptr;
            if (g.RefCountIsOne() && g.TotalBytes() >= forward_min_bytes) {
                std::unique_ptr<tf::Tensor> forwarded = ctx->forward_input(
                    grads_first + i, i, g.dtype(), g.shape(), ctx->output_memory_type(i),
                    ctx->output_alloc_attr(i));
                if (forwarded != nullptr) {
                    ctx->set_output(i, std::move(*forwarded));
                    out = ctx->mutable_output(i);
                }
            }
            if (out == nullptr)
                OP_REQUIRES_OK(ctx, ctx->allocate_output(i, g.shape(), &out));
            ls_lamb_param& p = params[i];
            p.grad = g.flat<float>().data();
            p.u = out->flat<float>().data();
            p.m = FloatsOf(vars.var(i));
            p.v = FloatsOf(vars.var(n + i));
            p.length = static_cast<size_t>(g.NumElements());
        }
        for (size_t k = 0; k < termed_.size(); ++k) {
            const int i = termed_[k];
            const tf::Tensor& term = ctx->input(first_scalar + 3 + static_cast<int>(k));
            const tf::Tensor& g = ctx->input(grads_first + i);
            OP_REQUIRES(ctx, term.shape() == g.shape(),
                        tf::errors::InvalidArgument(
                            type_string(), ": the term of gradient ", i, " has shape ",
                            term.shape().DebugString(), ", expected ",
                            g.shape().DebugString()));
            params[i].term = term.flat<float>().data();
        }
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
    int n_ = 0;
    std::vector<int> termed_, decayed_, decay_;
    ls_lamb_config config_ = {};
};

REGISTER_KERNEL_BUILDER(Name("LossScaleLambMoments").Device(tf::DEVICE_CPU), LambMomentsOp);

}  // namespace
}  // namespace lossscale_tf
