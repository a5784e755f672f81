/*
 * Glue between TensorFlow kernels and the C core: dtype mapping, core
 * status codes as TensorFlow errors, TensorFlow's intra-op thread pool as
 * the core's parallel-for, and the locking and copy-on-write of resource
 * variables the ops update.
 * The arithmetic itself is the core's (lossscale.h); nothing here
 * computes on gradient values.
 */
#ifndef LOSSSCALE_TF_H
#define LOSSSCALE_TF_H

// Before any Eigen header: training_op_helpers.h copies tensors on the
// thread-pool device.
#ifndef EIGEN_USE_THREADS
#define EIGEN_USE_THREADS
#endif

#include <algorithm>
#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "lossscale.h"
#include "lossscale_chunks.h"
#include "tensorflow/core/framework/op_kernel.h"
#include "tensorflow/core/framework/resource_mgr.h"
#include "tensorflow/core/framework/resource_var.h"
#include "tensorflow/core/framework/tensor.h"
#include "tensorflow/core/framework/types.h"
#include "tensorflow/core/kernels/training_op_helpers.h"
#include "tsl/platform/blocking_counter.h"

namespace lossscale_tf {

namespace tf = ::tensorflow;

inline bool ToCoreDtype(tf::DataType dt, ls_dtype* out) {
    switch (dt) {
    case tf::DT_HALF: *out = LS_FLOAT16; return true;
    case tf::DT_BFLOAT16: *out = LS_BFLOAT16; return true;
    case tf::DT_FLOAT: *out = LS_FLOAT32; return true;
    case tf::DT_DOUBLE: *out = LS_FLOAT64; return true;
    default: return false;
    }
}

// Whether inputs [first, first + count) of `ctx` are scalars: an
// InvalidArgument naming the first that is not.  Tensor::scalar aborts the
// process on any other shape, and an op run eagerly has no shape function
// in front of its kernel.
inline tf::Status CheckScalarInputs(tf::OpKernelContext* ctx, int first, int count,
                                   const std::string& op) {
    for (int i = first; i < first + count; ++i) {
        const tf::TensorShape& shape = ctx->input(i).shape();
        if (!tf::TensorShapeUtils::IsScalar(shape))
            return tf::errors::InvalidArgument(op, ": input ", i, " must be a scalar, got shape ",
                                               shape.DebugString());
    }
    return tf::OkStatus();
}

inline tf::Status CoreError(int rc, const char* what) {
    switch (rc) {
    case LS_ERR_DTYPE:
        return tf::errors::InvalidArgument(what, ": unsupported dtype");
    case LS_ERR_MEMORY:
        return tf::errors::ResourceExhausted(what, ": out of memory");
    case LS_ERR_SIMD:
        return tf::errors::InvalidArgument(what, ": ", ls_simd_error());
    default:
        return tf::errors::InvalidArgument(what, ": invalid argument (core status ", rc, ")");
    }
}

// An op's `unscale` attr ('none', 'divide', 'multiply') as ls_unscale_mode.
// Whether `positions` ascend strictly within [0, n): an op's list of the
// variables that take an input of their own (slices, terms, slots).
inline bool AscendingPositions(const std::vector<int>& positions, int n) {
    for (size_t k = 0; k < positions.size(); ++k)
        if (positions[k] < 0 || positions[k] >= n || (k > 0 && positions[k] <= positions[k - 1]))
            return false;
    return true;
}

inline int UnscaleMode(const std::string& name) {
    if (name == "divide")
        return LS_UNSCALE_DIVIDE;
    if (name == "multiply")
        return LS_UNSCALE_MULTIPLY;
    return LS_UNSCALE_NONE;
}

// The core's ls_parallel_fn on the device's intra-op pool (`host` is the
// OpKernelContext): the job cut by the core's own planner
// (lossscale_chunks.h), the calling thread and up to num_threads - 1 of the
// pool's taking chunks in turn.  Returns the ranges' results combined.
inline int ParallelForOnPool(void* host, ls_range_fn range, const void* arg, size_t total) {
    auto* ctx = static_cast<tf::OpKernelContext*>(host);
    const auto* pool = ctx->device()->tensorflow_cpu_worker_threads();
    const ls_chunk_plan plan = ls_plan_chunks(total, pool->num_threads);
    if (plan.threads < 2)
        return range(arg, 0, total);
    size_t next = 0;  // taken with atomic builtins by ls_take_chunks
    std::vector<int> results(static_cast<size_t>(plan.threads), 1);
    tsl::BlockingCounter done(plan.threads - 1);
    for (int t = 1; t < plan.threads; ++t)
        pool->workers->Schedule([&, t] {
            results[t] = ls_take_chunks(&plan, &next, range, arg);
            done.DecrementCount();
        });
    results[0] = ls_take_chunks(&plan, &next, range, arg);
    done.Wait();
    int rc = 1;
    for (int r : results)
        rc = ls_combine_status(rc, r);
    return rc;
}

// The resource variables an op updates, held from lookup to the last
// write.  Locking follows TensorFlow's training ops: every variable's mutex
// taken exclusively, each once, in address order, as
// MaybeLockVariableInputMutexesInOrder takes them, so that an op of ours
// and one of TensorFlow's sharing variables cannot deadlock.  (That helper
// itself looks every variable up again and finds repeats by a linear scan,
// which it may since its ops lock two or three variables: over the
// thousands of an optimizer step's it cost milliseconds a step.)
// Copy-on-write is TensorFlow's own: PrepareToUpdateVariable (a buffer a
// reader still holds, or any buffer of a variable in copy-on-read mode, is
// copied before the update writes).
class UpdatedVariables {
  public:
    // Looks up the variable of every input in `inputs`.  *twice: the
    // position in `inputs` of the first variable that repeats an earlier
    // one, or -1; the op refuses such a list in its own words, since
    // TensorFlow's lock would take the variable once and the update would
    // then apply to it twice.
    tf::Status LookUp(tf::OpKernelContext* ctx, const std::vector<int>& inputs, int* twice) {
        Unlock();
        vars_.clear();
        vars_.resize(inputs.size());
        std::vector<std::pair<tf::mutex*, int>> order(inputs.size());
        for (size_t i = 0; i < inputs.size(); ++i) {
            TF_RETURN_IF_ERROR(tf::LookupResource(ctx, tf::HandleFromInput(ctx, inputs[i]),
                                                  &vars_[i]));
            order[i] = {vars_[i]->mu(), static_cast<int>(i)};
        }
        // Sorted by mutex, then position: a repeat follows its first sight.
        // The distinct mutexes in that order are the ones Lock takes.
        std::sort(order.begin(), order.end());
        *twice = -1;
        mutexes_.clear();
        for (size_t i = 0; i < order.size(); ++i) {
            if (i == 0 || order[i].first != order[i - 1].first)
                mutexes_.push_back(order[i].first);
            else if (*twice < 0 || order[i].second < *twice)
                *twice = order[i].second;
        }
        return tf::OkStatus();
    }

    UpdatedVariables() = default;
    UpdatedVariables(const UpdatedVariables&) = delete;
    UpdatedVariables& operator=(const UpdatedVariables&) = delete;
    ~UpdatedVariables() { Unlock(); }

    // Takes every variable's lock, exclusively, until this object goes.
    void Lock() {
        Unlock();
        for (tf::mutex* mu : mutexes_)
            mu->lock();
        locked_ = true;
    }

    tf::Var* var(size_t i) const { return vars_[i].get(); }
    size_t size() const { return vars_.size(); }

    // Makes variable i's buffer its own before an update writes it (the
    // lock held).  Its value is unchanged: a failure here, before any
    // write, leaves every variable as it was.
    tf::Status PrepareToUpdate(tf::OpKernelContext* ctx, size_t i) const {
        tf::Var* v = vars_[i].get();
        const bool copy_on_read = v->copy_on_read_mode.load();
        switch (v->tensor()->dtype()) {
        case tf::DT_FLOAT:
            return tf::PrepareToUpdateVariable<Eigen::ThreadPoolDevice, float>(
                ctx, v->tensor(), copy_on_read);
        case tf::DT_INT32:
            return tf::PrepareToUpdateVariable<Eigen::ThreadPoolDevice, tf::int32>(
                ctx, v->tensor(), copy_on_read);
        case tf::DT_INT64:
            return tf::PrepareToUpdateVariable<Eigen::ThreadPoolDevice, tf::int64>(
                ctx, v->tensor(), copy_on_read);
        default:
            return tf::errors::Internal("no copy-on-write for a variable of dtype ",
                                        tf::DataTypeString(v->tensor()->dtype()));
        }
    }

  private:
    void Unlock() {
        if (locked_)
            for (auto it = mutexes_.rbegin(); it != mutexes_.rend(); ++it)
                (*it)->unlock();
        locked_ = false;
    }

    std::vector<tf::core::RefCountPtr<tf::Var>> vars_;
    std::vector<tf::mutex*> mutexes_; // distinct, in address order: the order taken
    bool locked_ = false;
};

// A resource variable's float32 buffer, to write (after PrepareToUpdate).
inline float* FloatsOf(tf::Var* var) {
    return reinterpret_cast<float*>(const_cast<char*>(var->tensor()->tensor_data().data()));
}

// "variable '<name>'" of the resource handle at an op's input, for messages.
inline std::string VariableNameAt(tf::OpKernelContext* ctx, size_t input) {
    return "variable '" + tf::HandleFromInput(ctx, static_cast<int>(input)).name() + "'";
}

// Whether `var`, looked up from input `input` of `op`, is initialized,
// float32 and of shape `want` (what it keeps for a gradient of shape
// `grad`): an error naming it otherwise.  The name is built only for the
// message: building it costs more than the checks.
inline tf::Status CheckFloatVariable(tf::OpKernelContext* ctx, const std::string& op,
                                     tf::Var* var, int input, const tf::TensorShape& want,
                                     const tf::TensorShape& grad) {
    const tf::Tensor* value = var->tensor();
    if (!var->is_initialized)
        return tf::errors::FailedPrecondition(op, ": ", VariableNameAt(ctx, input),
                                              " is not initialized");
    if (value->dtype() != tf::DT_FLOAT)
        return tf::errors::InvalidArgument(op, ": ", VariableNameAt(ctx, input),
                                           " must be float32, got ",
                                           tf::DataTypeString(value->dtype()));
    if (value->shape() != want)
        return tf::errors::InvalidArgument(op, ": ", VariableNameAt(ctx, input), " has shape ",
                                           value->shape().DebugString(), ", expected ",
                                           want.DebugString(), " for the gradient of shape ",
                                           grad.DebugString());
    return tf::OkStatus();
}

// A sparse gradient as the core takes it: its slices' rows, how many, and
// the values in a row.
struct SparseSlices {
    const int64_t* indices = nullptr;
    size_t slices = 0;
    size_t row_length = 0;
};

// A sparse gradient's slices `g` and `indices` against its variable's
// `shape` (`where` names them for `op`'s messages): one index per slice,
// each a row, each slice a row's shape.  The rows into *out.
inline tf::Status CheckSparseSlices(const std::string& op, const std::string& where,
                                    const tf::Tensor& g, const tf::Tensor& indices,
                                    const tf::TensorShape& shape, SparseSlices* out) {
    if (shape.dims() < 1 || g.dims() != shape.dims())
        return tf::errors::InvalidArgument(op, ": ", where, " has slices of shape ",
                                           g.shape().DebugString(), " for a variable of shape ",
                                           shape.DebugString());
    for (int d = 1; d < shape.dims(); ++d)
        if (g.dim_size(d) != shape.dim_size(d))
            return tf::errors::InvalidArgument(op, ": ", where, " has slices of shape ",
                                               g.shape().DebugString(),
                                               " for rows of the variable of shape ",
                                               shape.DebugString());
    if (indices.dims() != 1)
        return tf::errors::InvalidArgument(op, ": ", where, " has indices of shape ",
                                           indices.shape().DebugString(), ", not a vector");
    if (indices.NumElements() != g.dim_size(0))
        return tf::errors::InvalidArgument(op, ": ", where, " has ", indices.NumElements(),
                                           " indices for ", g.dim_size(0), " slices");
    const int64_t rows = shape.dim_size(0);
    const auto index = indices.flat<int64_t>();
    for (int64_t k = 0; k < index.size(); ++k)
        if (index(k) < 0 || index(k) >= rows)
            return tf::errors::InvalidArgument(op, ": ", where, " has index ", index(k),
                                               ", outside [0, ", rows, ")");
    static const int64_t no_slices = 0; // a valid address for zero slices
    out->indices = index.size() > 0 ? index.data() : &no_slices;
    out->slices = static_cast<size_t>(index.size());
    out->row_length = rows > 0 ? static_cast<size_t>(shape.num_elements() / rows) : 1;
    return tf::OkStatus();
}

}  // namespace lossscale_tf

#endif  // LOSSSCALE_TF_H
