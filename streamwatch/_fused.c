/* streamwatch's fused CPU summary: one pass over a contiguous float32/float64 tensor.
 *
 * In one read of the data it yields every sum over the elements the column schema declares (sum, sum of
 * squares, Σ|x|, Σx³, Σx⁴, ...), min, max, the nonzero count and the exact non-finite count (NaN and ±inf),
 * plus per-unit activity for dead units and activation rates. Plain
 * C without torch headers: setuptools compiles it when the package is built (setup.py) into the
 * streamwatch._fused extension file, which _kernel.py loads from the package directory with ctypes.
 * Nothing is compiled at run time.
 *
 * Contract of streamwatch_summarize_f32/_f64(x, N, A, U, B, act, out, units_out, flags):
 *   x          contiguous data, viewed as [N, A, U, B]: N samples, U units (the unit dimension), A the
 *              dimensions between the batch and the units (channel-last), B those after (NCHW
 *              spatial positions). Without units pass units_out = NULL and any N*A*U*B = numel.
 *   act        what "active" means: nonzero, or away from the module's saturation bounds (isclose with
 *              rtol=1e-5, atol=1e-8, tolerances precomputed by the caller); NaN is never active.
 *   out        SW_NSTATS doubles: the device values of _schema.DEVICE in order (sum, sumsq, min, max,
 *              nonzero, ..., nonfinite; min/max are NaN if any NaN).
 *   units_out  U doubles; the number of samples in which each unit was active is ADDED to them, so a
 *              module called twice in a step accumulates in place.
 *   flags      2*U int32 of scratch.
 *
 * streamwatch_summarize_diff_f32/_f64(a, b, n, out): the same values for a - b (n elements each,
 * contiguous), computed without materialising the difference.
 *
 * streamwatch_histogram_f32/_f64(x, n, bounds, nb, lo, pd, k, counts, zeros): log-spaced histogram
 * counts (see _fused_body.h and metrics/_histogram.py).
 *
 * The column schema (streamwatch/_schema.py) is the one declaration of those values: setup.py generates
 * _schema.h from it (value indices, the lane sums as X-macros, stats_t, activity_t and the prototypes of
 * the entry points, which the definitions here must match), and streamwatch_schema() returns the
 * schema's signature, which _kernel.py compares with its own before using the library.
 *
 * Vectorisation: accumulators are arrays of LANES independent lanes, so the compiler vectorises the
 * loops without reassociating floating-point sums (-ffast-math is never used: it would break the
 * NaN/inf handling). On x86-64 every entry point is compiled twice (AVX2+FMA and baseline) and the
 * loader picks the one the CPU runs.
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include <_schema.h> /* generated from _schema.py by setup.py into the build (only ever that one: <>) */

#define LANES 16
#define CHUNK 1024 /* elements per float64 flush: 64 per lane, so float32 counts stay exact */
#define BLOCK 32   /* elements per early-exit block of a unit's run in the activity scan */
#define HIST_MAX 4096 /* histogram buckets counted in one call */

/* log2|v| to within 0.09 from the bits of a finite nonzero v: exponent + mantissa fraction */
static inline float log2_abs_f32(float v) {
    uint32_t bits;
    memcpy(&bits, &v, sizeof bits);
    return (float)((int32_t)((bits >> 23) & 0xff) - 127) + (float)(bits & 0x7fffff) * (1.0f / 8388608.0f);
}
static inline float log2_abs_f64(double v) {
    uint64_t bits;
    memcpy(&bits, &v, sizeof bits);
    return (float)((int64_t)((bits >> 52) & 0x7ff) - 1023) + (float)(bits >> 29 & 0x7fffff) * (1.0f / 8388608.0f);
}
#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

#if defined(__x86_64__) && defined(__GNUC__)
#define CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

#define LANE_WIDE double /* the lane type of the schema's wide lane sums */

#define T float
#define CNT int32_t
#define SUFFIX f32
#define LOG2_ABS log2_abs_f32
#define FABS __builtin_fabsf /* |v| for a schema term: one AND, where v < 0 ? -v : v is a compare and a blend */
#include "_fused_body.h"
#undef T
#undef CNT
#undef SUFFIX
#undef LOG2_ABS
#undef FABS

#define T double
#define CNT int64_t
#define SUFFIX f64
#define LOG2_ABS log2_abs_f64
#define FABS __builtin_fabs
#include "_fused_body.h"
#undef T
#undef CNT
#undef SUFFIX
#undef LOG2_ABS
#undef FABS

/* The schema this library was built from; _kernel.py refuses a library whose schema differs from its own. */
const char *streamwatch_schema(void) { return SW_SCHEMA; }
