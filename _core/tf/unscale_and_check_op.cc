/*
 * LossScaleUnscaleAndCheck and LossScaleAllFinite: the fused finite check
 * and unscale over a whole gradient list, in one op.
 *
 * Results equal TensorFlow's own `g * tf.cast(1 / scale, g.dtype)` bit for
 * bit: the reciprocal is computed in float32 with subnormals flushed, as
 * TensorFlow's CPU kernels compute it, and the core multiplies with
 * LS_FLUSH_DENORMALS.  Each output takes over its input's buffer when
 * TensorFlow allows (forward_input_or_allocate_output), so a gradient list
 * is unscaled without a gradient-sized allocation.
 */
#define EIGEN_USE_THREADS

#include <cmath>
#include <cstdint>
#include <memory>
#include <utility>
#include <vector>

#include "lossscale_tf.h"
#include "tensorflow/core/framework/op.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/shape_inference.h"
#include "tensorflow/core/framework/tensor_shape.h"
#include "unsupported/Eigen/CXX11/Tensor"

namespace lossscale_tf {
namespace {

using tf::shape_inference::InferenceContext;
using tf::shape_inference::ShapeHandle;
using CPUDevice = Eigen::ThreadPoolDevice;

REGISTER_OP("LossScaleUnscaleAndCheck")
    .Input("grads: T")
    .Input("scale: float")
    .Output("unscaled: T")
    .Output("all_finite: bool")
    .Attr("T: list({half, bfloat16, float, double}) >= 1")
    .Attr("check_inputs: bool = false")
    .Attr("divide: bool = false")
    .SetShapeFn([](InferenceContext* c) {
        const int n = c->num_inputs() - 1;
        ShapeHandle unused;
        TF_RETURN_IF_ERROR(c->WithRank(c->input(n), 0, &unused));
        for (int i = 0; i < n; ++i)
            c->set_output(i, c->input(i));
        c->set_output(n, c->Scalar());
        return tf::OkStatus();
    })
    .Doc(R"doc(
Multiplies every gradient by 1/scale (rounded to its dtype) and says whether
every result is finite; with check_inputs, whether every input is.  With
divide, every result is gradient / scale (scale cast to its dtype), as
TensorFlow's RealDiv gives it.
)doc");

REGISTER_OP("LossScaleAllFinite")
    .Input("grads: T")
    .Output("all_finite: bool")
    .Attr("T: list({half, bfloat16, float, double}) >= 1")
    .Attr("split_from_bytes: int = 0")
    .SetShapeFn([](InferenceContext* c) {
        c->set_output(0, c->Scalar());
        return tf::OkStatus();
    })
    .Doc(R"doc(
True when every element of every tensor is finite.

split_from_bytes: a list of at least this many bytes is checked on the
  intra-op pool's threads, a smaller one on the thread that runs the op
  (for ops that run side by side on the inter-op threads, many at a time).
)doc");

// out = in / factor or in * factor, factor cast to T: TensorFlow's own
// RealDiv / Mul expression for a scalar right-hand side.
template <typename T>
void ByScalar(const CPUDevice& d, const tf::Tensor& in, tf::Tensor* out, float factor,
              bool divide) {
    if (divide)
        out->flat<T>().device(d) = in.flat<T>() / static_cast<T>(factor);
    else
        out->flat<T>().device(d) = in.flat<T>() * static_cast<T>(factor);
}

tf::Status DescribeList(const tf::OpInputList& grads, std::vector<ls_buffer>* bufs) {
    bufs->resize(grads.size());
    for (int i = 0; i < grads.size(); ++i) {
        const tf::Tensor& g = grads[i];
        ls_buffer& b = (*bufs)[i];
        if (!ToCoreDtype(g.dtype(), &b.dtype))
            return tf::errors::InvalidArgument("grads[", i, "] has unsupported dtype ",
                                               tf::DataTypeString(g.dtype()));
        b.src = g.tensor_data().data();
        b.dst = nullptr;
        b.length = static_cast<size_t>(g.NumElements());
    }
    return tf::OkStatus();
}

// Outputs that cannot take over their input's buffer and are at most this
// big share one allocation per dtype (each an aligned slice of it): a list
// of thousands of small gradients then costs one allocation, not thousands.
constexpr size_t kPackedOutputMaxBytes = size_t{1} << 18;

// OpKernelContext::forward_input scans every output of the op for a
// conflicting reservation: O(N) per call, O(N^2) for a list.  It is asked
// only for inputs TensorFlow might hand over (sole owner of their buffer)
// and big enough that the scan (~1 ns per output) is small next to a pass
// over the tensor (~1 ns per this many bytes).
constexpr size_t kForwardBytesPerOutput = 16;

// Output i for every input i: the input's own buffer when TensorFlow lets
// the op take it over (forward_input_or_allocate_output's rule), else fresh
// memory — small outputs packed together as above.
tf::Status ForwardOrAllocateOutputs(tf::OpKernelContext* ctx, const tf::OpInputList& grads,
                                    std::vector<tf::Tensor*>* outs) {
    const int n = grads.size();
    const size_t forward_min_bytes = kForwardBytesPerOutput * static_cast<size_t>(n);
    std::vector<int> packed[LS_NUM_DTYPES];
    for (int i = 0; i < n; ++i) {
        const tf::Tensor& g = grads[i];
        std::unique_ptr<tf::Tensor> forwarded;
        if (g.RefCountIsOne() && g.TotalBytes() >= forward_min_bytes)
            forwarded = ctx->forward_input(i, i, g.dtype(), g.shape(), ctx->output_memory_type(i),
                                           ctx->output_alloc_attr(i));
        if (forwarded != nullptr) {
            ctx->set_output(i, std::move(*forwarded));
            (*outs)[i] = ctx->mutable_output(i);
            continue;
        }
        ls_dtype dt;
        if (g.NumElements() > 0 && g.TotalBytes() <= kPackedOutputMaxBytes &&
            ToCoreDtype(g.dtype(), &dt)) {
            packed[dt].push_back(i);
            continue;
        }
        TF_RETURN_IF_ERROR(ctx->allocate_output(i, g.shape(), &(*outs)[i]));
    }
    for (const std::vector<int>& group : packed) {
        if (group.empty())
            continue;
        if (group.size() == 1) {
            TF_RETURN_IF_ERROR(ctx->allocate_output(group[0], grads[group[0]].shape(),
                                                    &(*outs)[group[0]]));
            continue;
        }
        const tf::Tensor& first = grads[group[0]];
        const int64_t align = static_cast<int64_t>(tf::Allocator::kAllocatorAlignment /
                                                   tf::DataTypeSize(first.dtype()));
        std::vector<int64_t> offsets;
        int64_t total = 0;
        for (int i : group) {
            total = (total + align - 1) / align * align;
            offsets.push_back(total);
            total += grads[i].NumElements();
        }
        tf::Tensor block;
        TF_RETURN_IF_ERROR(ctx->allocate_temp(first.dtype(), tf::TensorShape({total}), &block,
                                              ctx->output_alloc_attr(group[0])));
        for (size_t k = 0; k < group.size(); ++k) {
            const int i = group[k];
            tf::Tensor piece;
            if (!piece.CopyFrom(block.Slice(offsets[k], offsets[k] + grads[i].NumElements()),
                                grads[i].shape()))
                return tf::errors::Internal("LossScaleUnscaleAndCheck: cannot shape output ", i);
            ctx->set_output(i, piece);
            (*outs)[i] = ctx->mutable_output(i);
        }
    }
    return tf::OkStatus();
}

class UnscaleAndCheckOp : public tf::OpKernel {
  public:
    explicit UnscaleAndCheckOp(tf::OpKernelConstruction* ctx) : tf::OpKernel(ctx) {
        OP_REQUIRES_OK(ctx, ctx->GetAttr("check_inputs", &check_inputs_));
        OP_REQUIRES_OK(ctx, ctx->GetAttr("divide", &divide_));
    }

    void Compute(tf::OpKernelContext* ctx) override {
        tf::OpInputList grads;
        OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
        const int n = grads.size();
        const tf::Tensor& scale_t = ctx->input(n);
        OP_REQUIRES(ctx, tf::TensorShapeUtils::IsScalar(scale_t.shape()),
                    tf::errors::InvalidArgument("scale must be a scalar, got shape ",
                                                scale_t.shape().DebugString()));
        const float scale = scale_t.scalar<float>()();
        // As TensorFlow's RealDiv computes `1 / scale` on the CPU.
        const float inv = ls_reciprocal_f32(scale, LS_FLUSH_DENORMALS);

        std::vector<ls_buffer> bufs;
        OP_REQUIRES_OK(ctx, DescribeList(grads, &bufs));
        std::vector<tf::Tensor*> outs(n);
        OP_REQUIRES_OK(ctx, ForwardOrAllocateOutputs(ctx, grads, &outs));
        for (int i = 0; i < n; ++i)
            bufs[i].dst = const_cast<char*>(outs[i]->tensor_data().data());
        tf::Tensor* flag = nullptr;
        OP_REQUIRES_OK(ctx, ctx->allocate_output(n, tf::TensorShape({}), &flag));

        // Dividing is multiplying by 1/scale only for an exact reciprocal,
        // and for 16-bit gradients only where the reciprocal rounds alike
        // in them too: those, and every inexact scale, divide with Eigen.
        bool by_core = std::isfinite(inv);
        if (divide_) {
            by_core = by_core && ls_exact_reciprocal(scale);
            for (int i = 0; by_core && i < n; ++i)
                by_core = grads[i].dtype() == tf::DT_FLOAT || grads[i].dtype() == tf::DT_DOUBLE;
        }
        int rc;
        if (by_core) {
            const unsigned flags = LS_FLUSH_DENORMALS | (check_inputs_ ? LS_CHECK_INPUTS : 0u);
            rc = ls_unscale_with(bufs.data(), bufs.size(), inv, flags, ParallelForOnPool, ctx);
        } else {
            rc = UnscaleWithEigen(ctx, grads, outs, &bufs, divide_ ? scale : inv);
        }
        OP_REQUIRES(ctx, rc >= 0, CoreError(rc, "LossScaleUnscaleAndCheck"));
        flag->scalar<bool>()() = rc == 1;
    }

  private:
    // Multiplying, scale is 0, subnormal, tiny or NaN: 1/scale is inf or
    // NaN, which the core refuses as a multiplier.  TensorFlow still
    // multiplies (every nonzero result inf, zeros NaN).  Dividing, the
    // scale's reciprocal is not exact.  Either way do exactly what
    // TensorFlow does, with its own Eigen expression, so the op never
    // disagrees with the composite.  `factor` is 1/scale, or with divide
    // the scale.
    int UnscaleWithEigen(tf::OpKernelContext* ctx, const tf::OpInputList& grads,
                         const std::vector<tf::Tensor*>& outs, std::vector<ls_buffer>* bufs,
                         float factor) {
        int inputs_finite = 1;
        if (check_inputs_) {
            inputs_finite = ls_all_finite_with(bufs->data(), bufs->size(), 0, ParallelForOnPool,
                                               ctx);
            if (inputs_finite < 0)
                return inputs_finite;
        }
        const CPUDevice& d = ctx->eigen_device<CPUDevice>();
        for (int i = 0; i < grads.size(); ++i) {
            const tf::Tensor& g = grads[i];
            tf::Tensor* out = outs[i];
            switch (g.dtype()) {
            case tf::DT_HALF: ByScalar<Eigen::half>(d, g, out, factor, divide_); break;
            case tf::DT_BFLOAT16: ByScalar<tf::bfloat16>(d, g, out, factor, divide_); break;
            case tf::DT_FLOAT: ByScalar<float>(d, g, out, factor, divide_); break;
            case tf::DT_DOUBLE: ByScalar<double>(d, g, out, factor, divide_); break;
            default: return LS_ERR_DTYPE;
            }
        }
        if (check_inputs_)
            return inputs_finite;
        for (size_t i = 0; i < bufs->size(); ++i)
            (*bufs)[i].src = (*bufs)[i].dst;
        return ls_all_finite_with(bufs->data(), bufs->size(), 0, ParallelForOnPool, ctx);
    }

    bool check_inputs_ = false;
    bool divide_ = false;
};

// A check of fewer bytes than split_from_bytes runs on the thread that
// runs the op.  A step checks its gradients as they come, in many such ops
// (lossscale.ops.all_finite_grouped, which sets it), that TensorFlow's
// inter-op threads run side by side; each also splitting its pass over
// the intra-op pool put more threads on the cores than there are cores,
// and measured on ResNet-50's gradients (105 ops, 2 threads) made the
// step's check 1.3-1.5 times slower than one thread per op.
int OnThisThread(void* host, ls_range_fn range, const void* arg, size_t total) {
    (void)host;
    return range(arg, 0, total);
}

class AllFiniteOp : public tf::OpKernel {
  public:
    explicit AllFiniteOp(tf::OpKernelConstruction* ctx) : tf::OpKernel(ctx) {
        tf::int64 split_from = 0;
        OP_REQUIRES_OK(ctx, ctx->GetAttr("split_from_bytes", &split_from));
        split_from_bytes_ = split_from < 0 ? 0 : static_cast<size_t>(split_from);
    }

    void Compute(tf::OpKernelContext* ctx) override {
        tf::OpInputList grads;
        OP_REQUIRES_OK(ctx, ctx->input_list("grads", &grads));
        std::vector<ls_buffer> bufs;
        OP_REQUIRES_OK(ctx, DescribeList(grads, &bufs));
        size_t bytes = 0;
        for (int i = 0; i < grads.size(); ++i)
            bytes += grads[i].TotalBytes();
        const bool split = bytes >= split_from_bytes_;
        const int rc = ls_all_finite_with(bufs.data(), bufs.size(), 0,
                                          split ? ParallelForOnPool : OnThisThread, ctx);
        OP_REQUIRES(ctx, rc >= 0, CoreError(rc, "LossScaleAllFinite"));
        tf::Tensor* flag = nullptr;
        OP_REQUIRES_OK(ctx, ctx->allocate_output(0, tf::TensorShape({}), &flag));
        flag->scalar<bool>()() = rc == 1;
    }

  private:
    size_t split_from_bytes_ = 0;
};

REGISTER_KERNEL_BUILDER(Name("LossScaleUnscaleAndCheck").Device(tf::DEVICE_CPU),
                        UnscaleAndCheckOp);
REGISTER_KERNEL_BUILDER(Name("LossScaleAllFinite").Device(tf::DEVICE_CPU), AllFiniteOp);

}  // namespace
}  // namespace lossscale_tf
