/*
 * LossScaleSquaredNorms: each gradient's reduce_sum(square(u)) as Keras'
 * clipnorm and global_clipnorm take it with TensorFlow's ops (u the
 * gradient unscaled; a sparse one's squares densified first), the same
 * float32 bits, in one read of the gradients: the core's
 * ls_squared_norms_with adds the squares in the order of TensorFlow's own
 * Sum kernel on this device (its Eigen thread count), on the intra-op
 * pool, without the float32 temporaries the ops write (u, its square, a
 * sparse gradient's dense form).
 */
#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "lossscale_tf.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"

namespace lossscale_tf {
namespace {

using tf::shape_inference::InferenceContext;

tf::Status NormShapes(InferenceContext* c) {
    int n = 0;
    TF_RETURN_IF_ERROR(c->GetAttr("N", &n));
    for (int i = 0; i < n; ++i)
        c->set_output(i, c->Scalar());
    return tf::OkStatus();
}

REGISTER_OP("LossScaleSquaredNorms")
    .Input("values: N * float")
    .Input("indices: num_sparse * int64")
    .Input("scale: float")
    .Output("sums: N * float")
    .Attr("N: int >= 1")
    .Attr("num_sparse: int >= 0 = 0")
    .Attr("sparse: list(int) = []")
    .Attr("rows: list(int) = []")
    .Attr("names: list(string) = []")
    .Attr("unscale: {'none', 'divide', 'multiply'} = 'divide'")
    .SetShapeFn(NormShapes)
    .Doc(R"doc(
Each gradient's sum of squares, reduce_sum(square(u)), bit for bit as
TensorFlow's Square and Sum kernels on this CPU device compute it: u the
float32 gradient divided by `scale` ('divide'), times 1/scale ('multiply') or
as it is ('none'), subnormals flushed.  `sparse` (ascending positions, one
`indices` and one `rows` entry each): those gradients are an IndexedSlices'
values (slice k of row indices[k] of a variable of `rows` rows), summed as
their densified squares (Keras' ops.sum(ops.square(slices))): each row's
squares added in their order onto 0, untouched rows 0.  `names`, when given,
names each gradient's variable in errors.
)doc");

class SquaredNormsOp : public tf::OpKernel {
  public:
    explicit SquaredNormsOp(tf::OpKernelConstruction* ctx) : tf::OpKernel(ctx) {
        std::string unscale;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("N", &n_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("sparse", &sparse_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("rows", &rows_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("names", &names_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("unscale", &unscale));
        int num_sparse = 0;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("num_sparse", &num_sparse));
        OP_REQUIRES(ctx, static_cast<int>(sparse_.size()) == num_sparse &&
                             rows_.size() == sparse_.size(),
                    tf::errors::InvalidArgument(
                        "LossScaleSquaredNorms: sparse names ", sparse_.size(), " gradients for ",
                        num_sparse, " indices and ", rows_.size(), " row counts"));
        OP_REQUIRES(ctx,
                    AscendingPositions(sparse_, n_) &&
                        std::all_of(rows_.begin(), rows_.end(), [](int r) { return r >= 0; }),
                    tf::errors::InvalidArgument(
                        "LossScaleSquaredNorms: sparse must name gradients in ascending "
                        "order, each once, with a row count >= 0"));
        OP_REQUIRES(ctx, names_.empty() || static_cast<int>(names_.size()) == n_,
                    tf::errors::InvalidArgument("LossScaleSquaredNorms: ", names_.size(),
                                                " names for ", n_, " gradients"));
        unscale_ = UnscaleMode(unscale);
    }

    void Compute(tf::OpKernelContext* ctx) override {
        const tf::Tensor& scale = ctx->input(n_ + static_cast<int>(sparse_.size()));
        OP_REQUIRES(ctx, tf::TensorShapeUtils::IsScalar(scale.shape()),
                    tf::errors::InvalidArgument("LossScaleSquaredNorms: scale must be a scalar"));
        const float s = scale.scalar<float>()();
        OP_REQUIRES(ctx, unscale_ != LS_UNSCALE_MULTIPLY || (s > 0 && std::isfinite(s)),
                    tf::errors::InvalidArgument(
                        "LossScaleSquaredNorms: the scale must be finite and > 0, got ", s));
        std::vector<ls_norm_param> params(static_cast<size_t>(n_));
        size_t next_sparse = 0;
        for (int i = 0; i < n_; ++i) {
            const tf::Tensor& v = ctx->input(i);
            ls_norm_param& p = params[static_cast<size_t>(i)];
            p = ls_norm_param{};
            p.values = v.flat<float>().data();
            p.length = static_cast<size_t>(v.NumElements());
            if (next_sparse == sparse_.size() || sparse_[next_sparse] != i)
                continue;
            const tf::Tensor& index = ctx->input(n_ + static_cast<int>(next_sparse));
            OP_REQUIRES(ctx, tf::TensorShapeUtils::IsVector(index.shape()) && v.dims() >= 1 &&
                                 v.dim_size(0) == index.dim_size(0),
                        tf::errors::InvalidArgument(
                            "LossScaleSquaredNorms: ", Name(i), ": ", index.shape().DebugString(),
                            " indices for slices of shape ", v.shape().DebugString()));
            p.indices = index.flat<tf::int64>().data();
            p.slices = static_cast<size_t>(index.dim_size(0));
            p.row_length = p.slices > 0 ? p.length / p.slices : 1;
            if (p.slices == 0) {
                // No slices: the row length comes from the shape alone.
                p.row_length = 1;
                for (int d = 1; d < v.dims(); ++d)
                    p.row_length *= static_cast<size_t>(v.dim_size(d));
            }
            p.rows = static_cast<size_t>(rows_[next_sparse]);
            const long long bad = ls_norm_bad_index(&p);
            OP_REQUIRES(ctx, bad < 0,
                        tf::errors::InvalidArgument(
                            "LossScaleSquaredNorms: ", Name(i), ": index ",
                            bad < 0 ? 0 : p.indices[bad], " (slice ", bad, ") is outside [0, ",
                            p.rows, ")"));
            ++next_sparse;
        }
        std::vector<tf::Tensor*> outs(static_cast<size_t>(n_));
        for (int i = 0; i < n_; ++i)
            OP_REQUIRES_OK(ctx, ctx->allocate_output(i, tf::TensorShape({}), &outs[i]));
        std::vector<float> sums(static_cast<size_t>(n_));
        const int threads = ctx->eigen_cpu_device().numThreads();
        const int rc = ls_squared_norms_with(params.data(), params.size(), unscale_, s,
                                             threads < 1 ? 1 : threads, LS_FLUSH_DENORMALS,
                                             sums.data(), ParallelForOnPool, ctx);
        OP_REQUIRES(ctx, rc >= 0, CoreError(rc, "LossScaleSquaredNorms"));
        for (int i = 0; i < n_; ++i)
            outs[i]->scalar<float>()() = sums[static_cast<size_t>(i)];
    }

  private:
    std::string Name(int i) const {
        return names_.empty() ? "gradient " + std::to_string(i)
                              : "the gradient of " + names_[static_cast<size_t>(i)];
    }

    int n_ = 0;
    int unscale_ = LS_UNSCALE_DIVIDE;
    std::vector<int> sparse_;
    std::vector<int> rows_;
    std::vector<std::string> names_;
};

REGISTER_KERNEL_BUILDER(Name("LossScaleSquaredNorms").Device(tf::DEVICE_CPU), SquaredNormsOp);

}  // namespace
}  // namespace lossscale_tf
