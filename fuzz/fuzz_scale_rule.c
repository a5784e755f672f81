/*
 * Fuzz target for the loss-scale state machine: any configuration, any
 * starting state (a restored checkpoint can hold anything) and a run of
 * finite / non-finite steps.  Under UBSan this finds arithmetic that is
 * undefined for some state (a counter at its maximum, say); the checks
 * below hold for every input: a configuration that ls_scale_config_check
 * refuses is refused by ls_scale_update with the state untouched; an
 * accepted one returns the step's verdict, counts every skipped step,
 * keeps the counters from wrapping negative, keeps the scale within
 * [min_loss_scale, max_loss_scale] once a step has put it there (TF 2.4
 * rule, multiplier >= 1), and
 * leaves the caller's floating-point control state as it was.
 *
 * Input layout (little-endian, short inputs read as zero-padded):
 *   0       rule (byte % 3: 2 is not a rule)
 *   1..8    increment_period (i64)     9..12  multiplier (f32)
 *   13..16  backoff_factor (f32)       17..20 min_loss_scale (f32)
 *   21..24  max_loss_scale (f32)       25..32 hysteresis (i64)
 *   33..36  scale (f32)   37..44 good_steps   45..52 overflow_run
 *   53..60  skipped_steps (i64 each)
 *   then one step per byte: finite when bit 0 is set
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "lossscale.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CONTROL_STATE() (_mm_getcsr() & ~0x3fu) /* less the sticky exception flags */
#else
#define CONTROL_STATE() 0u
#endif

#define REQUIRE(cond, what)                                  \
    do {                                                     \
        if (!(cond)) {                                       \
            fprintf(stderr, "fuzz_scale_rule: %s\n", (what)); \
            abort();                                         \
        }                                                    \
    } while (0)

static float flushed(float x) { return fabsf(x) < FLT_MIN ? 0.0f : x; }

static void take(const uint8_t *data, size_t size, size_t *at, void *out, size_t n)
{
    uint8_t *o = (uint8_t *)out;
    for (size_t i = 0; i < n; i++, (*at)++)
        o[i] = *at < size ? data[*at] : 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    size_t at = 0;
    uint8_t rule;
    ls_scale_config c;
    ls_scale_state s;
    take(data, size, &at, &rule, 1);
    c.rule = rule % 3;
    take(data, size, &at, &c.increment_period, 8);
    take(data, size, &at, &c.multiplier, 4);
    take(data, size, &at, &c.backoff_factor, 4);
    take(data, size, &at, &c.min_loss_scale, 4);
    take(data, size, &at, &c.max_loss_scale, 4);
    take(data, size, &at, &c.hysteresis, 8);
    take(data, size, &at, &s.scale, 4);
    take(data, size, &at, &s.good_steps, 8);
    take(data, size, &at, &s.overflow_run, 8);
    take(data, size, &at, &s.skipped_steps, 8);

    const char *why = NULL;
    const int valid = ls_scale_config_check(&c, &why) == LS_OK;
    REQUIRE(why != NULL, "no reason given");
    REQUIRE(ls_scale_update(&c, NULL, 1) == LS_ERR_ARG, "NULL state accepted");
    REQUIRE(ls_scale_update(NULL, &s, 1) == LS_ERR_ARG, "NULL config accepted");

    int in_range = 0; /* the scale has been put within [min, max] */
    for (; at < size; at++) {
        const int finite = data[at] & 1;
        const ls_scale_state before = s;
        const unsigned control = CONTROL_STATE();
        const int rc = ls_scale_update(&c, &s, finite);
        REQUIRE(CONTROL_STATE() == control, "caller's floating-point control state changed");
        if (!valid) {
            REQUIRE(rc == LS_ERR_ARG, "refused configuration accepted");
            REQUIRE(memcmp(&before, &s, sizeof s) == 0, "refused call changed the state");
            return 0;
        }
        REQUIRE(rc == finite, "verdict is not the step's finiteness");
        REQUIRE(s.good_steps >= 0 || s.good_steps >= before.good_steps,
                "good_steps wrapped negative");
        REQUIRE(s.overflow_run >= 0 || s.overflow_run >= before.overflow_run,
                "overflow_run wrapped negative");
        if (finite) {
            REQUIRE(s.skipped_steps == before.skipped_steps, "finite step counted as skipped");
        } else {
            REQUIRE(s.skipped_steps == before.skipped_steps + (before.skipped_steps < INT64_MAX),
                    "skipped step not counted (or counter wrapped)");
            REQUIRE(s.good_steps == 0, "non-finite step kept good_steps");
        }
        /* a multiplier below 1 (accepted by the check, though the header
         * asks for > 1) turns growth into shrinking: no range to keep.
         * The rule computes as TensorFlow does, subnormals flushed, so a
         * subnormal bound or scale counts as zero. */
        if (c.rule == LS_RULE_TF24 && c.multiplier >= 1.0f) {
            const float lo = flushed(c.min_loss_scale), hi = flushed(c.max_loss_scale);
            const float now = flushed(s.scale);
            if (in_range && !isnan(now))
                REQUIRE(now >= lo && now <= hi, "scale left [min_loss_scale, max_loss_scale]");
            if (s.scale != before.scale && !isnan(now))
                in_range = now >= lo && now <= hi;
        }
    }
    return 0;
}
