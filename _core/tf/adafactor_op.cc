/*
 * LossScaleApplyAdafactor: one step of Keras' Adafactor over a whole
 * variable list, the gradients unscaled on the fly (the core's
 * ls_adafactor_update_with on TensorFlow's intra-op pool).
 *
 * As LossScaleApplyOptimizer: `apply` is the step's verdict, computed
 * before; when it is false nothing is touched.  Otherwise every variable
 * and slot is looked up, locked, checked (initialized, float32, its shape
 * against the gradient's) and made its own before anything is written.
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

constexpr int kScalars = 4; // scale, rho, beta, rest

tf::Status AdafactorShapes(InferenceContext* c) {
    int n = 0, f = 0;
    TF_RETURN_IF_ERROR(c->GetAttr("num_variables", &n));
    TF_RETURN_IF_ERROR(c->GetAttr("num_factored", &f));
    tf::shape_inference::ShapeHandle unused;
    TF_RETURN_IF_ERROR(c->WithRank(c->input(0), 0, &unused));
    const int first = 1 + n + 2 * f + n + n;
    for (int i = first; i < first + kScalars; ++i)
        TF_RETURN_IF_ERROR(c->WithRank(c->input(i), 0, &unused));
    return tf::OkStatus();
}

REGISTER_OP("LossScaleApplyAdafactor")
    .Input("apply: bool")
    .Input("variables: num_variables * resource")
    .Input("r: num_factored * resource")
    .Input("c: num_factored * resource")
    .Input("v: num_variables * resource")
    .Input("grads: num_variables * float")
    .Input("scale: float")
    .Input("rho: float")
    .Input("beta: float")
    .Input("rest: float")
    .Attr("num_variables: int >= 1")
    .Attr("num_factored: int >= 0")
    .Attr("factored: list(int) = []")
    .Attr("epsilon_1: float")
    .Attr("epsilon_2: float")
    .Attr("clip_threshold: float")
    .Attr("rsqrt: bool = false")
    .Attr("unscale: {'none', 'divide'} = 'divide'")
    .SetIsStateful()
    .SetShapeFn(AdafactorShapes)
    .Doc(R"doc(
When `apply`, one step of Keras' Adafactor of every variable, its gradient
first divided by `scale` ('divide') or taken as it is.  The variables at the
ascending positions `factored` (rank 2 or more) keep `r` (the variable's
shape without its last axis) and `c` (without its second last), one each in
that order; every variable keeps `v`, its own shape.  `rho` is Keras'
min(lr, 1 / sqrt(step)), `beta` its 1 - step ** beta_2_decay and `rest`
1 - beta, made as Keras makes them; `rsqrt`: u = g * rsqrt(v) with
TensorFlow's Rsqrt, as a tf.function computes Keras' g / sqrt(v).
Means and root-mean-squares are TensorFlow's, in its order of additions
on this device's threads (lossscale.h, ls_adafactor_update_with).
)doc");

class AdafactorOp : public tf::OpKernel {
  public:
    explicit AdafactorOp(tf::OpKernelConstruction* ctx) : tf::OpKernel(ctx) {
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_variables", &n_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_factored", &f_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("factored", &factored_));
        std::string unscale;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("unscale", &unscale));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("epsilon_1", &config_.epsilon_1));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("epsilon_2", &config_.epsilon_2));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("clip_threshold", &config_.clip_threshold));
        bool rsqrt = false;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("rsqrt", &rsqrt));
        config_.rsqrt = rsqrt ? 1 : 0;
        config_.unscale = UnscaleMode(unscale);
        OP_REQUIRES(ctx, static_cast<int>(factored_.size()) == f_,
                    tf::errors::InvalidArgument("LossScaleApplyAdafactor: factored has ",
                                                factored_.size(), " positions for ", f_,
                                                " factored variables"));
        OP_REQUIRES(ctx, AscendingPositions(factored_, n_),
                    tf::errors::InvalidArgument(
                        "LossScaleApplyAdafactor: factored positions must ascend within [0, ",
                        n_, ")"));
    }

    void Compute(tf::OpKernelContext* ctx) override {
        const tf::Tensor& apply = ctx->input(0);
        if (!(tf::TensorShapeUtils::IsScalar(apply.shape()) && apply.scalar<bool>()()))
            return;
        const int n = n_, f = f_;
        const int grads_first = 1 + n + 2 * f + n, first_scalar = grads_first + n;
        OP_REQUIRES_OK(ctx, CheckScalarInputs(ctx, first_scalar, kScalars, type_string()));
        ls_adafactor_config config = config_;
        config.scale = ctx->input(first_scalar).scalar<float>()();
        config.rho = ctx->input(first_scalar + 1).scalar<float>()();
        config.beta = ctx->input(first_scalar + 2).scalar<float>()();
        config.rest = ctx->input(first_scalar + 3).scalar<float>()();
        const int threads = ctx->eigen_cpu_device().numThreads();
        config.eigen_threads = threads < 1 ? 1 : threads;

        // Variables, r, c, v, in input order.
        std::vector<int> inputs;
        for (int i = 1; i < grads_first; ++i)
            inputs.push_back(i);
        UpdatedVariables vars;
        int twice = -1;
        OP_REQUIRES_OK(ctx, vars.LookUp(ctx, inputs, &twice));
        OP_REQUIRES(ctx, twice < 0,
                    tf::errors::InvalidArgument(type_string(),
                                                ": a variable or slot is passed twice (",
                                                VariableNameAt(ctx, inputs[twice]), ")"));
        vars.Lock();

        std::vector<ls_adafactor_param> params(n);
        std::vector<int> r_of(n, -1);
        for (int k = 0; k < f; ++k)
            r_of[factored_[k]] = k;
        for (int i = 0; i < n; ++i) {
            const tf::Tensor& g = ctx->input(grads_first + i);
            const tf::TensorShape& shape = g.shape();
            const int k = r_of[i];
            OP_REQUIRES(ctx, (k >= 0) == (shape.dims() >= 2),
                        tf::errors::InvalidArgument(
                            type_string(), ": ", VariableNameAt(ctx, 1 + i), " has rank ",
                            shape.dims(), ", factored is ", k >= 0 ? "true" : "false",
                            " (Adafactor factors rank 2 and more)"));
            tf::TensorShape r_shape = shape, c_shape = shape;
            if (k >= 0) {
                r_shape.RemoveLastDims(1);
                c_shape.RemoveDim(shape.dims() - 2);
            }
            // (index in `vars`, shape it must have)
            std::vector<std::pair<int, tf::TensorShape>> mine = {{i, shape},
                                                                  {n + 2 * f + i, shape}};
            if (k >= 0) {
                mine.push_back({n + k, r_shape});
                mine.push_back({n + f + k, c_shape});
            }
            for (const auto& want : mine)
                OP_REQUIRES_OK(ctx, CheckFloatVariable(ctx, type_string(), vars.var(want.first),
                                                       inputs[want.first], want.second, shape));
            ls_adafactor_param& p = params[i];
            p.grad = g.flat<float>().data();
            p.length = static_cast<size_t>(shape.num_elements());
            if (k >= 0) {
                p.cols = static_cast<size_t>(shape.dim_size(shape.dims() - 1));
                p.rows = static_cast<size_t>(shape.dim_size(shape.dims() - 2));
                p.outer = p.rows * p.cols > 0 ? p.length / (p.rows * p.cols) : 0;
            }
        }
        // Checked with the buffers as they are, then pointed at the ones
        // the update may write.
        PointAt(vars, r_of, &params);
        const char* why = ls_adafactor_problem(params.data(), params.size(), &config);
        OP_REQUIRES(ctx, why == nullptr,
                    tf::errors::InvalidArgument(type_string(), ": ", why));
        for (size_t t = 0; t < vars.size(); ++t)
            OP_REQUIRES_OK(ctx, vars.PrepareToUpdate(ctx, t));
        PointAt(vars, r_of, &params);
        const int rc = ls_adafactor_update_with(params.data(), params.size(), &config,
                                                LS_FLUSH_DENORMALS, ParallelForOnPool, ctx);
        OP_REQUIRES(ctx, rc >= 0, CoreError(rc, type_string().c_str()));
    }

  private:
    int n_ = 0;
    int f_ = 0;
    std::vector<int> factored_;
    ls_adafactor_config config_ = {};

    void PointAt(const UpdatedVariables& vars, const std::vector<int>& r_of,
                 std::vector<ls_adafactor_param>* params) const {
        const int n = n_, f = f_;
        for (int i = 0; i < n; ++i) {
            ls_adafactor_param& p = (*params)[i];
            p.var = FloatsOf(vars.var(i));
            p.v = FloatsOf(vars.var(n + 2 * f + i));
            if (r_of[i] >= 0) {
                p.r = FloatsOf(vars.var(n + r_of[i]));
                p.c = FloatsOf(vars.var(n + f + r_of[i]));
            }
        }
    }
};

REGISTER_KERNEL_BUILDER(Name("LossScaleApplyAdafactor").Device(tf::DEVICE_CPU), AdafactorOp);

}  // namespace
}  // namespace lossscale_tf
