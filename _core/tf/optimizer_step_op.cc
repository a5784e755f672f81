/*
 * LossScaleApplySgd and LossScaleApplyAdam: one Keras optimizer step over a
 * whole variable list, the gradients unscaled on the fly, in one pass over
 * memory (the core's ls_optim_step_range on TensorFlow's intra-op pool).
 *
 * `apply` is the step's verdict, computed before (the finite check of the
 * gradients and the loss-scale rule): when it is false the op returns at
 * once and no variable or slot is touched.  Otherwise every variable and
 * slot is looked up and locked as TensorFlow's training ops lock
 * (lossscale_tf.h's UpdatedVariables), checked (initialized, float32, the
 * gradient's shape), a buffer another tensor still reads is copied first
 * (TensorFlow's PrepareToUpdateVariable), and only then is anything
 * written, so an error leaves every variable as it was.  The core
 * validates the step once and splits it over the intra-op pool; the
 * arithmetic is the core's, with subnormals flushed as TensorFlow's CPU
 * kernels compute.
 */
#include <cstring>
#include <string>
#include <vector>

#include "lossscale_tf.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace lossscale_tf {
namespace {

using tf::shape_inference::InferenceContext;

// Shape function of both ops: `apply` and the trailing `scalars` inputs are
// scalars.  Before the scalars: `apply`, the variables, `lists` more lists
// of num_variables resources, `optional` (an attr) resources, the gradients.
tf::Status ScalarShapes(InferenceContext* c, int lists, const char* optional, int scalars) {
    int n = 0, k = 0;
    TF_RETURN_IF_ERROR(c->GetAttr("num_variables", &n));
    TF_RETURN_IF_ERROR(c->GetAttr(optional, &k));
    tf::shape_inference::ShapeHandle unused;
    TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 0, &unused));
    const int first = 1 + (1 + lists) * n + k + n;
    for (int i = first; i < first + scalars; ++i)
        TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
    return tf::OkStatus();
}

REGISTER_OP("LossScaleApplySgd")
    .Input("apply: bool")
    .Input("variables: num_variables * resource")
    .Input("momentums: num_momentums * resource")
    .Input("grads: T")
    .Input("scale: float")
    .Input("learning_rate: float")
    .Input("weight_decay: float")
    .Attr("T: list({half, bfloat16, float}) >= 1")
    .Attr("num_variables: int >= 1")
    .Attr("num_momentums: int >= 0")
    .Attr("momentum: float = 0.0")
    .Attr("nesterov: bool = false")
    .Attr("decay: list(int)")
    .Attr("unscale: {'none', 'divide', 'multiply'} = 'divide'")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) { return ScalarShapes(c, 0, "num_momentums", 3); })
    .Doc(R"doc(
When `apply`, one Keras SGD step of every variable (with momentum and
Nesterov as Keras computes them, weight decay as `decay` says: 0 none,
1 var - (var * wd) * lr, 2 var - var * (wd * lr)), its
gradient first unscaled: divided by `scale` ('divide', Keras 3), times
1/scale in the gradient's dtype ('multiply', TensorFlow 2.4), or as it is.
)doc");

REGISTER_OP("LossScaleApplyAdam")
    .Input("apply: bool")
    .Input("variables: num_variables * resource")
    .Input("m: num_variables * resource")
    .Input("v: num_variables * resource")
    .Input("v_hat: num_v_hat * resource")
    .Input("grads: T")
    .Input("scale: float")
    .Input("learning_rate: float")
    .Input("alpha: float")
    .Input("weight_decay: float")
    .Attr("T: list({half, bfloat16, float}) >= 1")
    .Attr("num_variables: int >= 1")
    .Attr("num_v_hat: int >= 0")
    .Attr("one_minus_beta_1: float")
    .Attr("one_minus_beta_2: float")
    .Attr("epsilon: float")
    .Attr("decay: list(int)")
    .Attr("unscale: {'none', 'divide', 'multiply'} = 'divide'")
    .SetIsStateful()
    .SetShapeFn([](InferenceContext* c) { return ScalarShapes(c, 2, "num_v_hat", 4); })
    .Doc(R"doc(
When `apply`, one Keras Adam step (AdamW with weight decay where `decay`
says, amsgrad with `v_hat`) of every variable, its gradient first unscaled
as in LossScaleApplySgd.  `alpha` is lr * sqrt(1 - beta_2^t) / (1 - beta_1^t)
as the caller computed it.
)doc");

int UnscaleMode(const std::string& name) {
    if (name == "divide")
        return LS_UNSCALE_DIVIDE;
    if (name == "multiply")
        return LS_UNSCALE_MULTIPLY;
    return LS_UNSCALE_NONE;
}

float ScalarInput(tf::OpKernelContext* ctx, int index) {
    return ctx->input(index).scalar<float>()();
}

class FusedStepOp : public tf::OpKernel {
  public:
    FusedStepOp(tf::OpKernelConstruction* ctx, int optimizer) : tf::OpKernel(ctx) {
        std::string unscale;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_variables", &num_variables_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("decay", &decay_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("unscale", &unscale));
        OP_REQUIRES(ctx, static_cast<int>(decay_.size()) == num_variables_,
                    tf::errors::InvalidArgument("decay has ", decay_.size(),
                                                " entries for ", num_variables_, " variables"));
        std::memset(&config_, 0, sizeof config_);
        config_.optimizer = optimizer;
        config_.unscale = UnscaleMode(unscale);
    }

  protected:
    int num_variables_ = 0;
    std::vector<int> decay_;  // ls_decay per variable
    ls_optim_config config_;

    // Whether the step applies: `apply`, a scalar.
    static bool Applies(tf::OpKernelContext* ctx) {
        const tf::Tensor& apply = ctx->input(0);
        return tf::TensorShapeUtils::IsScalar(apply.shape()) && apply.scalar<bool>()();
    }

    void Run(tf::OpKernelContext* ctx, int first_scalar, ls_optim_config config) {
        const int n = num_variables_;
        const int grads_first = 1 + n + TotalSlots();
        config.scale = ScalarInput(ctx, first_scalar);
        config.learning_rate = ScalarInput(ctx, first_scalar + 1);

        // Every resource: the variables, then each slot list in order.
        std::vector<int> inputs;
        for (int i = 1; i < grads_first; ++i)
            inputs.push_back(i);
        UpdatedVariables vars;
        int twice = -1;
        OP_REQUIRES_OK(ctx, vars.LookUp(ctx, inputs, &twice));
        OP_REQUIRES(ctx, twice < 0,
                    tf::errors::InvalidArgument(type_string(),
                                                ": a variable or slot is passed twice (",
                                                NameOf(ctx, inputs[twice]), ")"));
        vars.Lock(ctx);

        // Check everything before any write.
        std::vector<ls_param> params(n);
        for (int i = 0; i < n; ++i) {
            const tf::Tensor& g = ctx->input(grads_first + i);
            ls_dtype dt;
            OP_REQUIRES(ctx, ToCoreDtype(g.dtype(), &dt) && dt != LS_FLOAT64,
                        tf::errors::InvalidArgument("gradient of ", NameOf(ctx, 1 + i),
                                                    " has unsupported dtype ",
                                                    tf::DataTypeString(g.dtype())));
            for (int s = 0; s * n + i < grads_first - 1; ++s) {
                tf::Var* var = vars.var(s * n + i);
                const tf::Tensor* value = var->tensor();
                const std::string what = NameOf(ctx, inputs[s * n + i]);
                OP_REQUIRES(ctx, var->is_initialized,
                            tf::errors::FailedPrecondition(type_string(), ": ", what,
                                                           " is not initialized"));
                OP_REQUIRES(ctx, value->dtype() == tf::DT_FLOAT,
                            tf::errors::InvalidArgument(type_string(), ": ", what,
                                                        " must be float32, got ",
                                                        tf::DataTypeString(value->dtype())));
                OP_REQUIRES(ctx, value->shape() == g.shape(),
                            tf::errors::InvalidArgument(
                                type_string(), ": ", what, " has shape ",
                                value->shape().DebugString(), ", its gradient has shape ",
                                g.shape().DebugString()));
            }
            params[i].grad = g.tensor_data().data();
            params[i].grad_dtype = dt;
            params[i].length = static_cast<size_t>(g.NumElements());
            params[i].decay = decay_[i];
        }
        const char* why = nullptr;
        OP_REQUIRES(ctx, ls_optim_config_check(&config, &why) == LS_OK,
                    tf::errors::InvalidArgument(type_string(), ": ", why, " (learning rate ",
                                                config.learning_rate, ", loss scale ",
                                                config.scale, ")"));

        // Copy-on-write where a reader still holds a buffer; then point the
        // core at the buffers it may write.
        for (size_t t = 0; t < vars.size(); ++t)
            OP_REQUIRES_OK(ctx, vars.PrepareToUpdate(ctx, t));
        for (int i = 0; i < n; ++i) {
            params[i].var = Floats(vars.var(i));
            for (int s = 1; s * n + i < grads_first - 1; ++s)
                params[i].slot[s - 1] = Floats(vars.var(s * n + i));
        }
        // Validated once (buffers included), then split over the pool.
        const int rc = ls_optim_update_with(params.data(), params.size(), &config,
                                            LS_FLUSH_DENORMALS, ParallelForOnPool, ctx);
        OP_REQUIRES(ctx, rc >= 0, CoreError(rc, type_string().c_str()));
    }

    virtual int TotalSlots() const = 0;

  private:
    static float* Floats(tf::Var* var) {
        return reinterpret_cast<float*>(const_cast<char*>(var->tensor()->tensor_data().data()));
    }

    static std::string NameOf(tf::OpKernelContext* ctx, size_t input) {
        return "variable '" + tf::HandleFromInput(ctx, static_cast<int>(input)).name() + "'";
    }
};

class ApplySgdOp : public FusedStepOp {
  public:
    explicit ApplySgdOp(tf::OpKernelConstruction* ctx) : FusedStepOp(ctx, LS_OPTIM_SGD) {
        bool nesterov = false;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_momentums", &num_momentums_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("momentum", &config_.momentum));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("nesterov", &nesterov));
        config_.nesterov = nesterov ? 1 : 0;
        OP_REQUIRES(ctx, num_momentums_ == (config_.momentum != 0.0f ? num_variables_ : 0),
                    tf::errors::InvalidArgument(
                        "LossScaleApplySgd: momentum ", config_.momentum, " needs ",
                        config_.momentum != 0.0f ? num_variables_ : 0,
                        " momentum variables, got ", num_momentums_));
    }

    void Compute(tf::OpKernelContext* ctx) override {
        if (!Applies(ctx))
            return;
        ls_optim_config config = config_;
        const int first_scalar = 1 + 2 * num_variables_ + num_momentums_;
        config.weight_decay = ScalarInput(ctx, first_scalar + 2);
        Run(ctx, first_scalar, config);
    }

    int TotalSlots() const override { return num_momentums_; }

  private:
    int num_momentums_ = 0;
};

class ApplyAdamOp : public FusedStepOp {
  public:
    explicit ApplyAdamOp(tf::OpKernelConstruction* ctx) : FusedStepOp(ctx, LS_OPTIM_ADAM) {
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_v_hat", &num_v_hat_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("one_minus_beta_1", &config_.one_minus_beta_1));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("one_minus_beta_2", &config_.one_minus_beta_2));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("epsilon", &config_.epsilon));
        OP_REQUIRES(ctx, num_v_hat_ == 0 || num_v_hat_ == num_variables_,
                    tf::errors::InvalidArgument("LossScaleApplyAdam: v_hat must be empty or "
                                                "one per variable, got ", num_v_hat_));
        config_.amsgrad = num_v_hat_ > 0 ? 1 : 0;
    }

    void Compute(tf::OpKernelContext* ctx) override {
        if (!Applies(ctx))
            return;
        ls_optim_config config = config_;
        const int first_scalar = 1 + 4 * num_variables_ + num_v_hat_;
        config.alpha = ScalarInput(ctx, first_scalar + 2);
        config.weight_decay = ScalarInput(ctx, first_scalar + 3);
        Run(ctx, first_scalar, config);
    }

    int TotalSlots() const override { return 2 * num_variables_ + num_v_hat_; }

  private:
    int num_v_hat_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("LossScaleApplySgd").Device(tf::DEVICE_CPU), ApplySgdOp);
REGISTER_KERNEL_BUILDER(Name("LossScaleApplyAdam").Device(tf::DEVICE_CPU), ApplyAdamOp);

}  // namespace
}  // namespace lossscale_tf
