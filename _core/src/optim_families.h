/*
 * The fused optimizer families, each one header (family_<name>.h: its
 * numbers, slots, one-element reference and vector loop) and one entry in
 * LS_OPTIM_FAMILIES, in the order of their ids.  Everything else (the
 * kernel tables of every set, the checks, the lookup by name that the
 * TensorFlow op and the numpy binding use, the fuzz target) is generated
 * from this list.  Included by optim.h (the references) and again by
 * optim_body.h (the vector loops, once a set's vocabulary is defined).
 */
#include "family_sgd.h"
#include "family_adam.h"
#include "family_rmsprop.h"
#include "family_adagrad.h"
#include "family_adamax.h"
#include "family_nadam.h"
#include "family_lion.h"
#include "family_legacy_sgd.h"
#include "family_legacy_adam.h"
#include "family_legacy_rmsprop.h"
#include "family_legacy_adagrad.h"
#include "family_accumulate.h"
#include "family_tf_keras_adam.h"
#include "family_tf_keras_sgd.h"
#include "family_tf_keras_rmsprop.h"

#define LS_OPTIM_FAMILIES(X) X(sgd) X(adam) X(rmsprop) X(adagrad) X(adamax) X(nadam) X(lion) \
    X(legacy_sgd) X(legacy_adam) X(legacy_rmsprop) X(legacy_adagrad) X(accumulate) \
    X(tf_keras_adam) X(tf_keras_sgd) X(tf_keras_rmsprop)

/* The families whose reference, given ls_param.grad_term, reads it in
 * place of one function of the gradient (a sparse gradient's slices mapped,
 * then summed per row, as Keras densifies them; each family_<name>.h says
 * which function). */
#define LS_OPTIM_TERM_FAMILIES(X) X(adam) X(adamax) X(lion)

/* The families a sparse gradient (ls_param.indices) may feed: their update
 * of an element reads that element alone, so the core hands them the row
 * sums a block at a time (optim.c's slice_term_of says how each term
 * family's term is made of one slice value). */
#define LS_OPTIM_SPARSE_FAMILIES(X) X(sgd) X(adam) X(adamax) X(lion)

/* The families whose Keras update applies a sparse gradient row by row
 * (scatters it) and that take one so (optim.c's run_rows): Adagrad, and
 * RMSprop without momentum, not centered. */
#define LS_OPTIM_ROW_FAMILIES(X) X(adagrad) X(rmsprop)

/* The legacy families and tf_keras' current Adam, SGD and RMSprop, which
 * tf_keras hands a sparse gradient with its duplicate slices summed (the
 * legacy _deduplicate_indexed_slices, the current _deduplicate_sparse_grad:
 * UnsortedSegmentSum, a row's slices added in their order onto 0): the
 * core sums them so, then runs each element through the family's sparse
 * reference, ls_<family>_sparse1 (optim.c's run_summed_rows), which says
 * what a row no slice names does. */
#define LS_OPTIM_SUMMED_FAMILIES(X) X(legacy_sgd) X(legacy_adam) X(legacy_rmsprop) \
    X(legacy_adagrad) X(tf_keras_adam) X(tf_keras_sgd) X(tf_keras_rmsprop)
