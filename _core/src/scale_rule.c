/*
 * The loss-scale state machines, in float32 arithmetic so that every step
 * equals what TensorFlow computes for the same rule (TensorFlow 2.4's
 * DynamicLossScale: `scale * multiplier`, `scale / multiplier`,
 * `maximum(..., 1)`, assign-if-finite; Keras 3: `* 2`, `/ 2`).
 *
 * TensorFlow's CPU kernels run with subnormals flushed to zero (FTZ+DAZ), so
 * the rule does too: after enough back-offs without a floor (Keras 3, or
 * min_loss_scale = 0) the scale goes 2^-126 -> 0, not to a subnormal.
 *
 * Hysteresis counts *consecutive* non-finite steps: any finite step resets
 * the run.  The alternative (a budget refilled only when the scale grows,
 * as in Megatron-LM) lets overflows scattered over a long growth period
 * add up to a back-off that no single burst of overflows justified, and
 * it is not what "tolerate h non-finite steps in a row" says.
 */
#include <math.h>
#include <stddef.h>

#include "internal.h"

void ls_scale_config_default(ls_scale_config *c, int rule)
{
    c->rule = rule;
    c->increment_period = LS_DEFAULT_INCREMENT_PERIOD;
    c->multiplier = 2.0f;
    c->backoff_factor = 0.0f;
    c->min_loss_scale = 1.0f;
    c->max_loss_scale = INFINITY;
    c->hysteresis = 1;
}

int ls_scale_config_check(const ls_scale_config *c, const char **why)
{
    const char *reason = NULL;
    if (c == NULL)
        reason = "config is NULL";
    else if (c->rule != LS_RULE_TF24 && c->rule != LS_RULE_KERAS3)
        reason = "unknown rule";
    else if (c->increment_period < 1)
        reason = "increment_period must be >= 1";
    else if (!(c->multiplier > 0.0f) || !isfinite(c->multiplier))
        reason = "multiplier must be a positive finite number";
    else if (c->backoff_factor != 0.0f && !(c->backoff_factor > 0.0f && c->backoff_factor < 1.0f))
        reason = "backoff_factor must be in (0, 1)";
    else if (!(c->min_loss_scale >= 0.0f) || !isfinite(c->min_loss_scale))
        reason = "min_loss_scale must be a finite number >= 0";
    else if (!(c->max_loss_scale >= c->min_loss_scale))
        reason = "max_loss_scale must be >= min_loss_scale";
    else if (c->hysteresis < 1)
        reason = "hysteresis must be >= 1";
    if (why)
        *why = reason ? reason : "";
    return reason ? LS_ERR_ARG : LS_OK;
}

/* Counters come from a restored state, which may hold anything: they stop
 * at INT64_MAX rather than overflow (undefined in C, and a wrap to a
 * negative count would read as a step far in the past). */
static int64_t count_one(int64_t v) { return v < INT64_MAX ? v + 1 : v; }

static void step_tf24(const ls_scale_config *c, ls_scale_state *s, int finite)
{
    if (finite) {
        s->overflow_run = 0;
        if (s->good_steps >= c->increment_period - 1) { /* good_steps + 1 >= period */
            float grown = ls_f32_mul(s->scale, c->multiplier);
            if (grown > c->max_loss_scale)
                grown = c->max_loss_scale;
            if (isfinite(grown))
                s->scale = grown;
            s->good_steps = 0;
        } else {
            s->good_steps += 1;
        }
        return;
    }
    s->good_steps = 0;
    s->skipped_steps = count_one(s->skipped_steps);
    s->overflow_run = count_one(s->overflow_run);
    if (s->overflow_run < c->hysteresis)
        return;
    s->overflow_run = 0;
    float lowered = c->backoff_factor != 0.0f ? ls_f32_mul(s->scale, c->backoff_factor)
                                              : ls_f32_div(s->scale, c->multiplier);
    /* maximum(x, floor): NaN propagates as in tf.maximum */
    s->scale = (isnan(lowered) || lowered >= c->min_loss_scale) ? lowered : c->min_loss_scale;
}

static void step_keras3(const ls_scale_config *c, ls_scale_state *s, int finite)
{
    if (finite) {
        if (s->good_steps == c->increment_period - 1) {
            s->scale = ls_f32_mul(s->scale, c->multiplier);
            s->good_steps = 0;
        } else {
            s->good_steps = count_one(s->good_steps);
        }
        return;
    }
    s->good_steps = 0;
    s->skipped_steps = count_one(s->skipped_steps);
    s->scale = ls_f32_div(s->scale, c->multiplier);
}

int ls_scale_update(const ls_scale_config *config, ls_scale_state *state, int grads_finite)
{
    if (state == NULL || ls_scale_config_check(config, NULL) != LS_OK)
        return LS_ERR_ARG;
    ls_fpenv env;
    ls_fpenv_enter(&env, 1);
    if (config->rule == LS_RULE_KERAS3)
        step_keras3(config, state, grads_finite != 0);
    else
        step_tf24(config, state, grads_finite != 0);
    ls_fpenv_leave(&env);
    return grads_finite != 0;
}
