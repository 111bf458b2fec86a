/* The per-dtype body of _fused.c: included once per element type with T (the element type), CNT (a
 * counter as wide as T) and SUFFIX (f32, f64) defined. Every loop below is written so that the compiler vectorises it without
 * reassociating floating-point arithmetic: accumulators are arrays of LANES independent lanes. */

/* Exact count of NaN and ±inf in p[0..len): only run over a chunk whose sum of squares came out
 * non-finite (which every NaN or infinity makes it; an overflow of finite squares merely makes us look). */
static int64_t CAT(count_nonfinite_, SUFFIX)(const T *p, const T *r, int64_t len) {
    int64_t count = 0;
    for (int64_t i = 0; i < len; i++) {
        const T v = r ? p[i] - r[i] : p[i];
        const T d = v - v; /* 0 where finite; NaN at NaN and at ±inf */
        count += d != d;
    }
    return count;
}

/* The lane sums of the schema (SW_LANE_SUMS: sum, sum of squares, ...), min, max, nonzero and
 * non-finite counts of p[0..len), accumulated into *s. Per element the hot loop does one vector operation
 * per lane sum plus min, max and compare-and-count; the non-finite count costs nothing unless a chunk has
 * a non-finite element. Lanes of the element type are flushed into the float64 totals every CHUNK
 * elements (wide lane sums are float64 throughout). min/max skip NaN here (the caller makes them NaN when
 * there is one, as torch.aminmax does). */
static inline __attribute__((always_inline)) void CAT(stats_, SUFFIX)(const T *restrict p, const T *restrict r,
                                                                      int diff, int64_t len, stats_t *s) {
    /* diff (a compile-time constant at each call site): summarise p - r, element by element */
#define DECLARE(name, L, term) L lane_##name[LANES];
#define ZERO(name, L, term) lane_##name[j] = 0;
#define ADD(name, L, term) lane_##name[j] += term;
#define ADD0(name, L, term) lane_##name[0] += term;
#define FLUSH(name, L, term)                                      \
    double chunk_##name = 0;                                      \
    for (int j = 0; j < LANES; j++) chunk_##name += lane_##name[j]; \
    s->name += chunk_##name;
    for (int64_t start = 0; start < len; start += CHUNK) {
        const T *restrict q = p + start;
        const T *restrict z = diff ? r + start : q;
        const int64_t n = len - start < CHUNK ? len - start : CHUNK;
        SW_LANE_SUMS(DECLARE)
        T mn[LANES], mx[LANES];
        CNT nz[LANES];
        for (int j = 0; j < LANES; j++) {
            SW_LANE_SUMS(ZERO)
            nz[j] = 0;
            mn[j] = (T)s->min; mx[j] = (T)s->max;
        }
        const int64_t body = n - n % LANES;
        for (int64_t i = 0; i < body; i += LANES) {
            for (int j = 0; j < LANES; j++) {
                const T v = diff ? q[i + j] - z[i + j] : q[i + j];
                SW_LANE_SUMS(ADD)
                mn[j] = v < mn[j] ? v : mn[j];
                mx[j] = v > mx[j] ? v : mx[j];
                nz[j] += v != 0;
            }
        }
        for (int64_t i = body; i < n; i++) {
            const T v = diff ? q[i] - z[i] : q[i];
            SW_LANE_SUMS(ADD0)
            mn[0] = v < mn[0] ? v : mn[0];
            mx[0] = v > mx[0] ? v : mx[0];
            nz[0] += v != 0;
        }
        SW_LANE_SUMS(FLUSH)
        int64_t cnz = 0;
        for (int j = 0; j < LANES; j++) {
            cnz += nz[j];
            if (mn[j] < s->min) s->min = mn[j];
            if (mx[j] > s->max) s->max = mx[j];
        }
        s->nonzero += (double)cnz;
        /* every NaN or infinity makes the sum of squares non-finite (an overflow merely makes us look) */
        if (!(chunk_sumsq - chunk_sumsq == 0))
            s->nonfinite += (double)CAT(count_nonfinite_, SUFFIX)(q, diff ? z : 0, n);
    }
#undef DECLARE
#undef ZERO
#undef ADD
#undef ADD0
#undef FLUSH
}

/* Whether p[0..len) holds a NaN: only asked when the fused pass counted a non-finite element, since
 * counting NaN apart from ±inf in the fused loop would cost another accumulator in every pass. */
static int CAT(has_nan_, SUFFIX)(const T *p, const T *r, int64_t len) {
    for (int64_t i = 0; i < len; i++) {
        const T v = r ? p[i] - r[i] : p[i];
        if (v != v) return 1;
    }
    return 0;
}

static void CAT(store_, SUFFIX)(stats_t *s, double *out) {
#define STORE(name, i) out[i] = s->name;
    SW_DEVICE(STORE)
#undef STORE
}

/* Whether v is active: not NaN, and nonzero (no bounds) or not isclose to a finite bound. The
 * has_lo/has_hi arguments are compile-time constants at every call site, so each variant is its
 * own branch-free loop. */
static inline __attribute__((always_inline)) int CAT(active_, SUFFIX)(T v, int bounded, int has_lo, int has_hi,
                                                                       T lo, T hi, T tol_lo, T tol_hi) {
    if (!bounded) return (v != 0) & (v == v);
    T dl = v - lo, dh = v - hi;
    dl = dl < 0 ? -dl : dl;
    dh = dh < 0 ? -dh : dh;
    return (v == v) & (!has_lo | (dl > tol_lo)) & (!has_hi | (dh > tol_hi));
}

/* Whether any of run[0..len) is active, scanning BLOCK elements at a time (each block a vectorised
 * OR) and stopping at the first block with an active element: a live unit is usually found in the
 * first block of its run, so only dead (or nearly dead) units are read to the end. */
static inline __attribute__((always_inline)) int CAT(any_active_, SUFFIX)(const T *restrict run, int64_t len,
                                                                         int bounded, int has_lo, int has_hi,
                                                                         T lo, T hi, T tol_lo, T tol_hi) {
    int64_t i = 0;
    for (; i + BLOCK <= len; i += BLOCK) {
        int any = 0;
        for (int j = 0; j < BLOCK; j++)
            any |= CAT(active_, SUFFIX)(run[i + j], bounded, has_lo, has_hi, lo, hi, tol_lo, tol_hi);
        if (any) return 1;
    }
    int any = 0;
    for (; i < len; i++) any |= CAT(active_, SUFFIX)(run[i], bounded, has_lo, has_hi, lo, hi, tol_lo, tol_hi);
    return any;
}

/* Per-unit activity of one sample's slab [A, U, B]: counts[u] grows by 1 if unit u is active at any of
 * its A*B positions. flags is U int32 of scratch. */
static inline __attribute__((always_inline)) void CAT(slab_, SUFFIX)(const T *restrict x, int64_t a_, int64_t u_,
                                                                     int64_t b_, int32_t *restrict flags,
                                                                     int32_t *restrict counts, int bounded,
                                                                     int has_lo, int has_hi, const activity_t *act) {
    const T lo = (T)act->lo, hi = (T)act->hi, tol_lo = (T)act->tol_lo, tol_hi = (T)act->tol_hi;
    if (b_ == 1 && a_ == 1) { /* Linear outputs: one position per unit, counted directly */
        for (int64_t u = 0; u < u_; u++)
            counts[u] += CAT(active_, SUFFIX)(x[u], bounded, has_lo, has_hi, lo, hi, tol_lo, tol_hi);
        return;
    }
    if (b_ == 1) { /* units innermost behind A positions (channel-last, sequences): OR rows, then count;
                      every 4 rows, stop if every unit is already active in this sample */
        for (int64_t u = 0; u < u_; u++)
            flags[u] = CAT(active_, SUFFIX)(x[u], bounded, has_lo, has_hi, lo, hi, tol_lo, tol_hi);
        for (int64_t a = 1; a < a_; a++) {
            const T *restrict row = x + a * u_;
            for (int64_t u = 0; u < u_; u++)
                flags[u] |= CAT(active_, SUFFIX)(row[u], bounded, has_lo, has_hi, lo, hi, tol_lo, tol_hi);
            if ((a & 3) == 3) {
                int64_t set = 0;
                for (int64_t u = 0; u < u_; u++) set += flags[u];
                if (set == u_) break;
            }
        }
        for (int64_t u = 0; u < u_; u++) counts[u] += flags[u];
        return;
    }
    /* each unit owns runs of B contiguous positions (NCHW): scan a run only while its unit is not yet
     * known to be active in this sample */
    memset(flags, 0, (size_t)u_ * sizeof(int32_t));
    for (int64_t a = 0; a < a_; a++)
        for (int64_t u = 0; u < u_; u++)
            if (!flags[u])
                flags[u] = CAT(any_active_, SUFFIX)(x + (a * u_ + u) * b_, b_, bounded, has_lo, has_hi, lo, hi,
                                                    tol_lo, tol_hi);
    for (int64_t u = 0; u < u_; u++) counts[u] += flags[u];
}

/* The exported entry point for one element type; see _fused.c for the contract. */
CLONES int CAT(streamwatch_summarize_, SUFFIX)(const T *x, int64_t n_, int64_t a_, int64_t u_, int64_t b_,
                                                const activity_t *act, double *out, double *units_out,
                                                int32_t *flags) {
    stats_t s = {.min = 1.0 / 0.0, .max = -1.0 / 0.0};
    if (units_out == 0) {
        CAT(stats_, SUFFIX)(x, 0, 0, n_ * a_ * u_ * b_, &s);
    } else {
        const int64_t slab = a_ * u_ * b_;
        int32_t *counts = flags + u_; /* flags holds 2*U int32: per-sample flags, then per-unit counts */
        memset(counts, 0, (size_t)u_ * sizeof(int32_t));
        for (int64_t n = 0; n < n_; n++) {
            const T *sample = x + n * slab;
            CAT(stats_, SUFFIX)(sample, 0, 0, slab, &s); /* the slab stays in cache for its activity loop */
            if (!act->bounded)
                CAT(slab_, SUFFIX)(sample, a_, u_, b_, flags, counts, 0, 0, 0, act);
            else if (act->has_lo && act->has_hi)
                CAT(slab_, SUFFIX)(sample, a_, u_, b_, flags, counts, 1, 1, 1, act);
            else if (act->has_lo)
                CAT(slab_, SUFFIX)(sample, a_, u_, b_, flags, counts, 1, 1, 0, act);
            else if (act->has_hi)
                CAT(slab_, SUFFIX)(sample, a_, u_, b_, flags, counts, 1, 0, 1, act);
            else
                CAT(slab_, SUFFIX)(sample, a_, u_, b_, flags, counts, 1, 0, 0, act);
        }
        for (int64_t u = 0; u < u_; u++) units_out[u] += counts[u];
    }
    if (s.nonfinite > 0 && CAT(has_nan_, SUFFIX)(x, 0, n_ * a_ * u_ * b_)) {
        s.min = 0.0 / 0.0; /* NaN propagates through min and max, as in torch.aminmax */
        s.max = 0.0 / 0.0;
    }
    CAT(store_, SUFFIX)(&s, out);
    return 0;
}

/* The statistics of a - b over n elements without materialising the difference (an update Δ from
 * the weights after and before the optimizer step): two reads instead of a subtraction's two reads
 * and a write, then a third read. */
CLONES int CAT(streamwatch_summarize_diff_, SUFFIX)(const T *a, const T *b, int64_t n, double *out) {
    stats_t s = {.min = 1.0 / 0.0, .max = -1.0 / 0.0};
    CAT(stats_, SUFFIX)(a, b, 1, n, &s);
    if (s.nonfinite > 0 && CAT(has_nan_, SUFFIX)(a, b, n)) {
        s.min = 0.0 / 0.0;
        s.max = 0.0 / 0.0;
    }
    CAT(store_, SUFFIX)(&s, out);
    return 0;
}

/* Histogram counts in one pass: counts[j] += the finite elements v with bounds[j-1] < v <= bounds[j]
 * (j = 0 .. nb; bounds[-1] = -inf, bounds[nb] = +inf), counts[0] += the non-finite ones, *zeros += the
 * exact zeros: torch.bucketize(x, bounds) with non-finite elements sent to bucket 0, then bincount.
 * bounds are log-spaced magnitudes 10**(lo + i/pd), i = 0 .. k, mirrored around 0 (the layout of
 * metrics/_histogram.py): a guess from the exponent bits (log2 to within 0.09) lands within a bucket
 * or two of the answer, and comparisons against the exact bounds settle it, so the result never depends
 * on the guess. Returns -1 (nothing counted) if nb is too large for the local counters. */
/* -funroll-loops makes this branchy loop 2.4x slower (measured): not here */
CLONES __attribute__((optimize("no-unroll-loops"))) int CAT(streamwatch_histogram_, SUFFIX)(const T *x, int64_t n, const T *bounds, int64_t nb, double lo,
                                                double pd, int64_t k, double *counts, double *zeros) {
    int64_t local[HIST_MAX];
    if (nb + 1 > HIST_MAX || nb != 2 * k + 4) return -1;
    memset(local, 0, sizeof(int64_t) * (size_t)(nb + 1));
    int64_t nz = 0;
    /* the guess in float: it only has to land near the answer (and float keeps the loop fast) */
    const float scale = (float)(0.30102999566398120 * pd), shift = (float)(lo * pd), top = (float)k + 1.0f;
    for (int64_t i = 0; i < n; i++) {
        const T v = x[i];
        if (!(v - v == 0)) { local[0]++; continue; }
        if (v == 0) { nz++; local[k + 2]++; continue; }
        float g = LOG2_ABS(v) * scale - shift; /* ~ (log10|v| - lo) * pd */
        g = g < -1.0f ? -1.0f : g > top ? top : g;
        const int64_t idx = (int64_t)floorf(g);
        int64_t j = v > 0 ? k + 4 + idx : 1 + k - idx;
        j = j < 0 ? 0 : j > nb ? nb : j;
        while (j > 0 && bounds[j - 1] >= v) j--;
        while (j < nb && bounds[j] < v) j++;
        local[j]++;
    }
    for (int64_t j = 0; j <= nb; j++) counts[j] += (double)local[j];
    *zeros += (double)nz;
    return 0;
}
