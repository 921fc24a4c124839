/*
 * zpp.quant CPU kernels: block int8/int4 quantization, the fused reduce, 1-bit signs.
 *
 * Plain C on raw pointers (no torch headers); loaded with ctypes by zpp/quant/cpu.py.
 * Layout and arithmetic are those of zpp/quant/types.py and must match
 * zpp/quant/reference.py bit for bit:
 *
 *   - x / scale is a true division (never a reciprocal multiply), rounded with rintf
 *     (round half to even in the default rounding mode), then clamped.
 *   - symmetric scale = absmax / qmax, asymmetric scale = (max - min) / levels, in fp32.
 *   - asymmetric dequantization rounds twice: (code * scale) + offset. Build with
 *     -ffp-contract=off so the compiler never fuses that into an FMA, and never with
 *     -ffast-math (NaN/Inf handling and signed zeros matter here).
 *   - a group holding NaN/+-Inf (asymmetric: or whose range overflows) gets scale NaN
 *     (and offset NaN) and codes 0; a zero scale gives codes 0; padded positions of the
 *     last group are code 0 and do not enter the statistics.
 *   - the reduce adds slices in order in fp32 (acc = s0; acc = acc + s1; ...), then
 *     divides by (float)divisor when divisor != 1.
 *
 * Work is split over groups with OpenMP; the caller passes the thread count. Each group
 * is read once from memory: the statistics pass brings it into L1, the coding pass
 * re-reads it from there. Statistics are computed on the raw bit patterns (an unsigned
 * max of |x| bits for symmetric, an order-preserving integer key for min/max), which is
 * exact, catches NaN/Inf in the same reduction, and vectorizes as integer max/min.
 *
 * Dtype codes: 0 = fp32, 1 = fp16, 2 = bf16.
 */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif
#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#define ZPP_HAVE_F16C 1
#else
#define ZPP_HAVE_F16C 0
#endif

#define ZPP_API __attribute__((visibility("default")))
#if defined(__clang__)
#define ZPP_NOIPA __attribute__((noinline))
#else
#define ZPP_NOIPA __attribute__((noinline, noipa))
#endif
#define ZPP_ABI_VERSION 6

enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2 };

/* Elements handled per inner tile: 2 KiB of fp32, well inside L1 next to a group. */
#define TILE 512
/* Elements per parallel work item. Work is handed out dynamically in items of about this
 * size, so a thread that the OS delays (an oversubscribed machine) does not hold up a
 * fixed half of the work. */
#define BLOCK 16384
/* Inputs above this size get the next group prefetched (see zpp_quantize). */
#define PREFETCH_MIN_BYTES ((int64_t)2 << 20)

typedef uint32_t u32a __attribute__((may_alias));
typedef uint16_t u16a __attribute__((may_alias));
typedef float f32a __attribute__((may_alias));

static inline uint32_t f2u(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline float u2f(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }
static inline int64_t max64(int64_t a, int64_t b) { return a > b ? a : b; }

static inline size_t dt_size(int dt) { return dt == DT_F32 ? 4 : 2; }

/* Groups per dynamically scheduled work item: about BLOCK elements. */
static inline int64_t groups_per_grab(int64_t G) { return G >= BLOCK ? 1 : BLOCK / G; }

/* ------------------------------------------------------------------------------------ */
/* fp16 / bf16 conversions                                                               */
/* ------------------------------------------------------------------------------------ */

/* Exact fp16 -> fp32. */
static inline float h2f_soft(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1F) return u2f(sign | 0x7F800000u | (m << 13));
    if (e != 0) return u2f(sign | ((e + 112u) << 23) | (m << 13));
    if (m == 0) return u2f(sign);
    /* subnormal: m * 2^-24, exact in fp32 */
    return u2f(sign | f2u((float)m * 0x1p-24f));
}

/* fp32 -> fp16, round to nearest even (NaN -> quiet NaN keeping the sign). */
static inline uint16_t f2h_soft(float f) {
    uint32_t u = f2u(f);
    uint16_t sign = (uint16_t)((u >> 16) & 0x8000u);
    uint32_t a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x3FFu));
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u); /* >= 65520 rounds to Inf */
    if (a >= 0x38800000u) {                                  /* normal fp16 range */
        a += 0x0FFFu + ((a >> 13) & 1u);
        a -= 112u << 23;
        return (uint16_t)(sign | (a >> 13));
    }
    /* fp16 subnormal or zero: |f| * 2^24 is exact, then round half to even */
    float v = u2f(a) * 0x1p24f;
    return (uint16_t)(sign | (uint16_t)(int32_t)rintf(v));
}

/* fp32 -> bf16 as torch rounds it: nearest even; NaN -> 0x7FC0. */
static inline uint16_t f2bf(uint32_t u) {
    uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7FFFFFFFu) > 0x7F800000u ? (uint16_t)0x7FC0u : r;
}

/* dst[i] = (float)src[i] for n elements of dtype dt. */
static void load_f32(const void *src, int dt, int64_t n, float *restrict dst) {
    if (dt == DT_F32) {
        memcpy(dst, src, (size_t)n * 4);
    } else if (dt == DT_BF16) {
        const u16a *restrict s = (const u16a *)src;
        u32a *restrict d = (u32a *)dst;
        for (int64_t i = 0; i < n; i++) d[i] = (uint32_t)s[i] << 16;
    } else {
        const u16a *restrict s = (const u16a *)src;
        int64_t i = 0;
#if ZPP_HAVE_F16C
        for (; i + 8 <= n; i += 8)
            _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(s + i))));
#endif
        for (; i < n; i++) dst[i] = h2f_soft(s[i]);
    }
}

/* dst[i] = (dt)src[i] for n fp32 values. */
static void store_f32(const float *restrict src, int64_t n, int dt, void *dst) {
    if (dt == DT_F32) {
        memcpy(dst, src, (size_t)n * 4);
    } else if (dt == DT_BF16) {
        const u32a *restrict s = (const u32a *)src;
        u16a *restrict d = (u16a *)dst;
        for (int64_t i = 0; i < n; i++) {
            uint32_t u = s[i];
            uint32_t r = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
            d[i] = (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? 0x7FC0u : r);
        }
    } else {
        u16a *restrict d = (u16a *)dst;
        int64_t i = 0;
#if ZPP_HAVE_F16C
        for (; i + 8 <= n; i += 8)
            _mm_storeu_si128((__m128i *)(d + i),
                             _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
#endif
        for (; i < n; i++) d[i] = f2h_soft(src[i]);
    }
}

/* ------------------------------------------------------------------------------------ */
/* group statistics on raw bits                                                          */
/* ------------------------------------------------------------------------------------ */

/* Largest |x| bit pattern (sign cleared); >= the dtype's Inf pattern means NaN/Inf. */
static uint32_t absmax_bits32(const u32a *restrict x, int64_t n) {
    uint32_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t a = x[i] & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    return m;
}

static uint16_t absmax_bits16(const u16a *restrict x, int64_t n) {
    uint16_t m = 0;
    for (int64_t i = 0; i < n; i++) {
        uint16_t a = (uint16_t)(x[i] & 0x7FFFu);
        m = a > m ? a : m;
    }
    return m;
}

/* Order-preserving signed key of a float's bits (an involution): negative floats get
 * their magnitude bits flipped. -0.0 sorts just below +0.0; NaNs sort beyond +-Inf. */
static inline int32_t key32(uint32_t u) {
    return (int32_t)(u ^ ((uint32_t)((int32_t)u >> 31) >> 1));
}
static inline int16_t key16(uint16_t h) {
    return (int16_t)(h ^ (uint16_t)((uint16_t)(-(int16_t)(h >> 15)) >> 1));
}

static void minmax_key32(const u32a *restrict x, int64_t n, int32_t *mn, int32_t *mx) {
    int32_t lo = *mn, hi = *mx;
    for (int64_t i = 0; i < n; i++) {
        int32_t k = key32(x[i]);
        lo = k < lo ? k : lo;
        hi = k > hi ? k : hi;
    }
    *mn = lo;
    *mx = hi;
}

static void minmax_key16(const u16a *restrict x, int64_t n, int32_t *mn, int32_t *mx) {
    int16_t lo = INT16_MAX, hi = INT16_MIN;
    for (int64_t i = 0; i < n; i++) {
        int16_t k = key16(x[i]);
        lo = k < lo ? k : lo;
        hi = k > hi ? k : hi;
    }
    if (n) {
        *mn = lo < *mn ? lo : *mn;
        *mx = hi > *mx ? hi : *mx;
    }
}

/* fp32 value of a 16-bit pattern of dtype dt. */
static inline float bits16_to_f32(uint16_t h, int dt) {
    return dt == DT_BF16 ? u2f((uint32_t)h << 16) : h2f_soft(h);
}

/* ------------------------------------------------------------------------------------ */
/* coding                                                                                */
/* ------------------------------------------------------------------------------------ */

/* Codes of n values read by LOAD(x, i) (an fp32 value): symmetric then asymmetric. */
#define DEFINE_CODES(SUFFIX, INTYPE, LOAD)                                                  \
    static void codes_sym_##SUFFIX(const INTYPE *restrict x, int64_t n, float scale,        \
                                   float qmax, int8_t *restrict c) {                        \
        const float lo = -qmax;                                                             \
        for (int64_t i = 0; i < n; i++) {                                                   \
            float q = rintf(LOAD(x, i) / scale);                                            \
            /* the operand order of minps/maxps; no NaN can reach here */                  \
            q = q < qmax ? q : qmax;                                                        \
            q = q > lo ? q : lo;                                                            \
            c[i] = (int8_t)(int32_t)q;                                                      \
        }                                                                                   \
    }                                                                                       \
    static void codes_asym_##SUFFIX(const INTYPE *restrict x, int64_t n, float mn,          \
                                    float scale, float levels, uint8_t *restrict c) {       \
        for (int64_t i = 0; i < n; i++) {                                                   \
            float q = rintf((LOAD(x, i) - mn) / scale);                                     \
            q = q < levels ? q : levels;                                                    \
            q = q > 0.0f ? q : 0.0f;                                                        \
            c[i] = (uint8_t)(int32_t)q;                                                     \
        }                                                                                   \
    }

#define LOAD_F32(x, i) ((x)[i])
#define LOAD_BF16(x, i) u2f((uint32_t)(x)[i] << 16)
DEFINE_CODES(f32, float, LOAD_F32)
DEFINE_CODES(bf16, u16a, LOAD_BF16)

/* Two 4-bit codes per byte: element 2i in the low nibble, 2i+1 in the high nibble. */
static void pack4(const uint8_t *restrict c, int64_t nbytes, uint8_t *restrict out) {
    for (int64_t i = 0; i < nbytes; i++)
        out[i] = (uint8_t)((c[2 * i] & 0x0Fu) | (uint8_t)(c[2 * i + 1] << 4));
}

/* Prefetch bytes [a, b) of p. Out of line (inlined, its loop perturbed the register
 * allocation of the coding loops around it: ~15% slower in cache), and noipa so that gcc
 * does not find it free of side effects and drop the calls. */
ZPP_NOIPA static void prefetch_range(const char *p, int64_t a, int64_t b) {
    for (; a < b; a += 64) __builtin_prefetch(p + a, 0, 3);
}

/*
 * Quantize one group of G positions. Its first nsrc elements come from src (dtype dt),
 * the next nzero elements are +0.0 (real elements: they enter the statistics), the rest
 * up to G are padding. Writes G*bits/8 bytes at out and 1 (sym) or 2 floats at sc.
 * next/next_bytes (or NULL/0): the input of the group that follows, prefetched while this
 * one is coded, so its statistics pass finds it in cache (the hardware prefetcher stops
 * running ahead while the coding pass works from L1; this is worth 15-25% on inputs that
 * come from memory).
 */
static void quant_group(const void *src, int dt, int64_t nsrc, int64_t nzero, int64_t G,
                        int bits, int sym, uint8_t *restrict out, float *restrict sc,
                        const char *next, int64_t next_bytes) {
    const int64_t nval = nsrc + nzero;
    const int64_t gbytes = G * bits / 8;
    float scale, mn = 0.0f;
    int usable;

    if (sym) {
        const float qmax = bits == 8 ? 127.0f : 7.0f;
        float absmax;
        int bad;
        if (dt == DT_F32) {
            uint32_t m = absmax_bits32((const u32a *)src, nsrc);
            bad = m >= 0x7F800000u;
            absmax = u2f(m);
        } else {
            uint16_t m = absmax_bits16((const u16a *)src, nsrc);
            bad = m >= (dt == DT_BF16 ? 0x7F80u : 0x7C00u);
            absmax = bits16_to_f32(m, dt);
        }
        /* zeros (nzero) cannot raise absmax */
        scale = bad ? NAN : absmax / qmax;
        sc[0] = scale;
        usable = !bad && scale != 0.0f;
    } else {
        const float levels = bits == 8 ? 255.0f : 15.0f;
        int32_t kmin = INT32_MAX, kmax = INT32_MIN;
        float mx;
        if (dt == DT_F32) {
            minmax_key32((const u32a *)src, nsrc, &kmin, &kmax);
            if (nzero) {
                kmin = kmin < 0 ? kmin : 0;
                kmax = kmax > 0 ? kmax : 0;
            }
            mn = u2f((uint32_t)key32((uint32_t)kmin));
            mx = u2f((uint32_t)key32((uint32_t)kmax));
        } else {
            minmax_key16((const u16a *)src, nsrc, &kmin, &kmax);
            if (nzero) {
                kmin = kmin < 0 ? kmin : 0;
                kmax = kmax > 0 ? kmax : 0;
            }
            mn = bits16_to_f32((uint16_t)key16((uint16_t)kmin), dt);
            mx = bits16_to_f32((uint16_t)key16((uint16_t)kmax), dt);
        }
        mn += 0.0f; /* a zero min/max is +0, as in the reference (types.py) */
        mx += 0.0f;
        scale = (mx - mn) / levels;
        int bad = !(isfinite(scale) && isfinite(mn));
        if (bad) {
            scale = NAN;
            mn = NAN;
        }
        sc[0] = scale;
        sc[1] = mn;
        usable = !bad && scale != 0.0f;
    }

    if (!usable) {
        memset(out, 0, (size_t)gbytes);
        return;
    }
    const int64_t pf_step = (next_bytes + nval - 1) / nval; /* next's bytes per element here */

    const float qmax = bits == 8 ? 127.0f : 7.0f;
    const float levels = bits == 8 ? 255.0f : 15.0f;
    float tile[TILE];
    uint8_t ctile[TILE + 2];
    const size_t esz = dt_size(dt);
    for (int64_t j0 = 0; j0 < nval; j0 += TILE) {
        const int64_t t = min64(TILE, nval - j0);
        uint8_t *c = bits == 8 ? out + j0 : ctile;
        if (next) /* pull the next group toward the cache while this one computes */
            prefetch_range(next, j0 * pf_step, min64((j0 + t) * pf_step, next_bytes));
        if (dt == DT_BF16 && j0 + t <= nsrc) {
            /* bf16 -> fp32 is a shift: convert inside the coding loop */
            const u16a *x = (const u16a *)src + j0;
            if (sym)
                codes_sym_bf16(x, t, scale, qmax, (int8_t *)c);
            else
                codes_asym_bf16(x, t, mn, scale, levels, c);
        } else {
            const float *x;
            if (dt == DT_F32 && j0 + t <= nsrc) {
                x = (const float *)src + j0;
            } else {
                const int64_t ns = max64(0, min64(t, nsrc - j0));
                if (ns) load_f32((const char *)src + (size_t)j0 * esz, dt, ns, tile);
                if (ns < t) memset(tile + ns, 0, (size_t)(t - ns) * 4);
                x = tile;
            }
            if (sym)
                codes_sym_f32(x, t, scale, qmax, (int8_t *)c);
            else
                codes_asym_f32(x, t, mn, scale, levels, c);
        }
        if (bits == 4) {
            ctile[t] = 0; /* odd tail: the high nibble of the last byte is padding */
            pack4(ctile, (t + 1) / 2, out + j0 / 2);
        }
    }
    const int64_t used = bits == 8 ? nval : (nval + 1) / 2;
    if (used < gbytes) memset(out + used, 0, (size_t)(gbytes - used));
}

/* ------------------------------------------------------------------------------------ */
/* dequantization of an arbitrary range of flat element indices                         */
/* ------------------------------------------------------------------------------------ */

#define DQ_LOOP(EXPR)                                                      \
    do {                                                                   \
        if (accumulate) {                                                  \
            for (int64_t i = 0; i < m; i++) y[i] = y[i] + (EXPR);          \
        } else {                                                           \
            for (int64_t i = 0; i < m; i++) y[i] = (EXPR);                 \
        }                                                                  \
    } while (0)

#define DQ_LOOP4(LO, HI)                                                   \
    do {                                                                   \
        if (accumulate) {                                                  \
            for (int64_t i = 0; i < np; i++) {                             \
                const uint8_t b = c[i];                                    \
                y[2 * i] = y[2 * i] + (LO);                                \
                y[2 * i + 1] = y[2 * i + 1] + (HI);                        \
            }                                                              \
        } else {                                                           \
            for (int64_t i = 0; i < np; i++) {                             \
                const uint8_t b = c[i];                                    \
                y[2 * i] = (LO);                                           \
                y[2 * i + 1] = (HI);                                       \
            }                                                              \
        }                                                                  \
    } while (0)

static inline float dq_one(int32_t code, float s, float o, int sym) {
    float v = (float)code * s;
    return sym ? v : v + o;
}

static inline int32_t nibble(const uint8_t *data, int64_t e, int sym) {
    uint8_t b = data[e >> 1];
    int32_t c = (e & 1) ? (b >> 4) : (b & 0x0F);
    if (sym && c >= 8) c -= 16;
    return c;
}

/* y[i] = (or +=) the dequantized fp32 value of flat element e0 + i, for i < n. */
static void dequant_range(const uint8_t *restrict data, const float *restrict scales, int bits,
                          int64_t G, int sym, int64_t e0, int64_t n, float *restrict out,
                          int accumulate) {
    const int64_t end = e0 + n;
    int64_t e = e0;
    while (e < end) {
        const int64_t g = e / G;
        const int64_t gend = min64((g + 1) * G, end);
        const float s = sym ? scales[g] : scales[2 * g];
        const float o = sym ? 0.0f : scales[2 * g + 1];
        float *restrict y = out + (e - e0);
        if (bits == 8) {
            const int64_t m = gend - e;
            if (sym) {
                const int8_t *restrict c = (const int8_t *)data + e;
                DQ_LOOP((float)c[i] * s);
            } else {
                const uint8_t *restrict c = data + e;
                DQ_LOOP((float)c[i] * s + o);
            }
        } else {
            int64_t ee = e;
            if (ee & 1) { /* start on a high nibble */
                float v = dq_one(nibble(data, ee, sym), s, o, sym);
                y[0] = accumulate ? y[0] + v : v;
                y++;
                ee++;
            }
            const int64_t np = (gend - ee) / 2;
            const uint8_t *restrict c = data + (ee >> 1);
            if (sym) {
                DQ_LOOP4((float)((int8_t)(uint8_t)(b << 4) >> 4) * s, (float)((int8_t)b >> 4) * s);
            } else {
                DQ_LOOP4((float)(b & 0x0F) * s + o, (float)(b >> 4) * s + o);
            }
            ee += 2 * np;
            y += 2 * np;
            if (ee < gend) { /* end on a low nibble */
                float v = dq_one(nibble(data, ee, sym), s, o, sym);
                y[0] = accumulate ? y[0] + v : v;
            }
        }
        e = gend;
    }
}

/* ------------------------------------------------------------------------------------ */
/* exported kernels                                                                      */
/* ------------------------------------------------------------------------------------ */

ZPP_API int zpp_abi_version(void) { return ZPP_ABI_VERSION; }

/* Swizzled positions [p, p+len) (see zpp_quantize): when they lie in one chunk, their
 * source is one run starting at *src0, of which the returned count are real elements (the
 * rest lie past numel: zeros). Returns -1 when the positions span chunks. */
static inline int64_t swizzle_run(int64_t p, int64_t len, int64_t numel, int64_t nodes,
                                  int64_t rpn, int64_t chunk, int64_t *src0) {
    if (p / chunk != (p + len - 1) / chunk) return -1;
    const int64_t nc = nodes * chunk; /* positions per local rank */
    const int64_t l = p / nc, r = p % nc;
    *src0 = ((r / chunk) * rpn + l) * chunk + r % chunk;
    return max64(0, min64(len, numel - *src0));
}

ZPP_API int zpp_have_f16c(void) { return ZPP_HAVE_F16C; }

/*
 * Quantize, optionally through the two-hop swizzle.
 *
 * swizzle == 0: x holds numel elements, quantized as they are.
 * swizzle != 0: x (numel <= nodes*rpn*chunk) is zero-padded to total = nodes*rpn*chunk,
 * read as chunks [node][local] and quantized in the order [local][node]: output position
 * p = (l*nodes + n)*chunk + c holds x[(n*rpn + l)*chunk + c] (0 past numel).
 * out: groups*G*bits/8 bytes; scales: groups (sym) or 2*groups floats.
 * Returns 0, or -1 if a scratch buffer could not be allocated.
 */
ZPP_API int zpp_quantize(const void *x, int dt, int64_t numel, int swizzle, int64_t nodes,
                         int64_t rpn, int64_t chunk, int bits, int64_t G, int sym,
                         uint8_t *out, float *scales, int nthreads) {
    const int64_t total = swizzle ? nodes * rpn * chunk : numel;
    if (total <= 0) return 0;
    const int64_t groups = (total + G - 1) / G;
    const int64_t gbytes = G * bits / 8;
    const int nsc = sym ? 1 : 2;
    const size_t esz = dt_size(dt);
    const char *xs = (const char *)x;
    const int64_t grab = groups_per_grab(G);
    /* Prefetch the next group for inputs larger than the L2 caches: measured on a 2-core
     * Zen 1, 15-30% faster from 4 MiB up, ~5% slower when the input sits in L2. */
    const int prefetch = numel * (int64_t)esz > PREFETCH_MIN_BYTES;
    int err = 0;
    if (nthreads < 1) nthreads = 1;

#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        float *buf = NULL;
#pragma omp for schedule(dynamic, grab)
        for (int64_t g = 0; g < groups; g++) {
            const int64_t p0 = g * G;
            const int64_t len = min64(G, total - p0);
            const int64_t len1 = min64(G, total - p0 - len); /* the next group's length */
            uint8_t *o = out + g * gbytes;
            float *s = scales + g * nsc;
            if (!swizzle) {
                const int pf = prefetch && len1 > 0;
                quant_group(xs + (size_t)p0 * esz, dt, len, 0, G, bits, sym, o, s,
                            pf ? xs + (size_t)(p0 + len) * esz : NULL, pf ? len1 * (int64_t)esz : 0);
                continue;
            }
            int64_t src0;
            const int64_t ns = swizzle_run(p0, len, numel, nodes, rpn, chunk, &src0);
            if (ns >= 0) {
                /* the group lies in one chunk: its source is one contiguous run */
                int64_t src1 = 0, ns1 = 0;
                if (prefetch && len1 > 0) ns1 = swizzle_run(p0 + len, len1, numel, nodes, rpn, chunk, &src1);
                quant_group(ns ? xs + (size_t)src0 * esz : xs, dt, ns, len - ns, G, bits, sym, o, s,
                            ns1 > 0 ? xs + (size_t)src1 * esz : NULL, ns1 > 0 ? ns1 * (int64_t)esz : 0);
                continue;
            }
            const int64_t nc = nodes * chunk; /* positions per local rank */
            /* the group spans chunks: gather it into fp32 scratch */
            if (!buf) buf = (float *)malloc((size_t)G * sizeof(float));
            if (!buf) {
#pragma omp atomic write
                err = 1;
                continue;
            }
            int64_t p = p0;
            while (p < p0 + len) {
                const int64_t l = p / nc, r = p % nc;
                const int64_t c = r % chunk;
                const int64_t run = min64(chunk - c, p0 + len - p);
                const int64_t from = ((r / chunk) * rpn + l) * chunk + c;
                const int64_t real = max64(0, min64(run, numel - from));
                if (real) load_f32(xs + (size_t)from * esz, dt, real, buf + (p - p0));
                if (real < run) memset(buf + (p - p0) + real, 0, (size_t)(run - real) * 4);
                p += run;
            }
            quant_group(buf, DT_F32, len, 0, G, bits, sym, o, s, NULL, 0);
        }
        free(buf);
    }
    return err ? -1 : 0;
}

/* out[i] = (dtype)dequantized element i, for i < numel. */
ZPP_API int zpp_dequantize(const uint8_t *data, const float *scales, int64_t numel, int bits,
                           int64_t G, int sym, int dt, void *out, int nthreads) {
    if (numel <= 0) return 0;
    const int64_t blocks = (numel + BLOCK - 1) / BLOCK;
    const size_t esz = dt_size(dt);
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t b0 = b * BLOCK, b1 = min64(b0 + BLOCK, numel);
        if (dt == DT_F32) {
            dequant_range(data, scales, bits, G, sym, b0, b1 - b0, (float *)out + b0, 0);
            continue;
        }
        float tile[TILE];
        for (int64_t t0 = b0; t0 < b1; t0 += TILE) {
            const int64_t t = min64(TILE, b1 - t0);
            dequant_range(data, scales, bits, G, sym, t0, t, tile, 0);
            store_f32(tile, t, dt, (char *)out + (size_t)t0 * esz);
        }
    }
    return 0;
}

/* Sum slice j = 0..k-1 of the dequantized input at slice positions [a, a+n) into acc,
 * in slice order, then divide. */
static void reduce_tile(const uint8_t *data, const float *scales, int64_t k, int64_t slice,
                        int bits, int64_t G, int sym, int divide, float div, int64_t a,
                        int64_t n, float *restrict acc) {
    dequant_range(data, scales, bits, G, sym, a, n, acc, 0);
    for (int64_t j = 1; j < k; j++) dequant_range(data, scales, bits, G, sym, j * slice + a, n, acc, 1);
    if (divide)
        for (int64_t i = 0; i < n; i++) acc[i] = acc[i] / div;
}

/*
 * Fused dequantize -> fp32 sum over k slices of slice_numel elements (slice order) ->
 * divide by (float)divisor when divisor != 1 -> requantize with (rbits, rG) when rbits
 * is 4 or 8 (same symmetry), else write dtype dt to out.
 */
ZPP_API int zpp_reduce_sum(const uint8_t *data, const float *scales, int64_t k, int64_t slice,
                           int bits, int64_t G, int sym, double divisor, int rbits, int64_t rG,
                           int dt, void *out, uint8_t *rdata, float *rscales, int nthreads) {
    if (slice <= 0 || k <= 0) return 0;
    const int divide = divisor != 1.0;
    const float div = (float)divisor;
    int err = 0;
    if (nthreads < 1) nthreads = 1;

    if (rbits == 0) {
        const int64_t blocks = (slice + BLOCK - 1) / BLOCK;
        const size_t esz = dt_size(dt);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)
        for (int64_t b = 0; b < blocks; b++) {
            const int64_t b0 = b * BLOCK, b1 = min64(b0 + BLOCK, slice);
            float tile[TILE];
            for (int64_t t0 = b0; t0 < b1; t0 += TILE) {
                const int64_t t = min64(TILE, b1 - t0);
                float *acc = dt == DT_F32 ? (float *)out + t0 : tile;
                reduce_tile(data, scales, k, slice, bits, G, sym, divide, div, t0, t, acc);
                if (dt != DT_F32) store_f32(tile, t, dt, (char *)out + (size_t)t0 * esz);
            }
        }
        return 0;
    }

    const int64_t groups = (slice + rG - 1) / rG;
    const int64_t gbytes = rG * rbits / 8;
    const int nsc = sym ? 1 : 2;
    const int64_t grab = groups_per_grab(rG);
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        float *buf = (float *)malloc((size_t)rG * sizeof(float));
        if (!buf) {
#pragma omp atomic write
            err = 1;
        }
#pragma omp for schedule(dynamic, grab)
        for (int64_t g = 0; g < groups; g++) {
            if (!buf) continue;
            const int64_t a = g * rG, n = min64(rG, slice - a);
            reduce_tile(data, scales, k, slice, bits, G, sym, divide, div, a, n, buf);
            quant_group(buf, DT_F32, n, 0, rG, rbits, sym, rdata + g * gbytes, rscales + g * nsc, NULL, 0);
        }
        free(buf);
    }
    return err ? -1 : 0;
}

/* ------------------------------------------------------------------------------------ */
/* 1-bit signs                                                                           */
/* ------------------------------------------------------------------------------------ */

/* Byte whose bit j is the low bit of byte j of v (v's bytes are 0 or 1). */
static inline uint8_t gather_bits(const uint8_t *f) {
    uint64_t v;
    memcpy(&v, f, 8);
    return (uint8_t)((v * 0x0102040810204080ull) >> 56);
}

static void sign_flags(const void *x, int dt, int64_t n, uint8_t *restrict f) {
    if (dt == DT_F32) {
        const float *restrict s = (const float *)x;
        for (int64_t i = 0; i < n; i++) f[i] = s[i] >= 0.0f; /* NaN -> 0, -0.0 -> 1 */
    } else {
        const uint16_t inf = dt == DT_BF16 ? 0x7F80u : 0x7C00u;
        const u16a *restrict s = (const u16a *)x;
        for (int64_t i = 0; i < n; i++) {
            const uint16_t h = s[i], a = (uint16_t)(h & 0x7FFFu);
            f[i] = (uint8_t)((a <= inf) & ((h < 0x8000u) | (a == 0)));
        }
    }
}

/* out[i] bit j = (x[8i + j] >= 0); nbytes = ceil(n / 8), trailing bits 0. */
ZPP_API int zpp_pack_signs(const void *x, int dt, int64_t n, uint8_t *out, int nthreads) {
    if (n <= 0) return 0;
    const int64_t nbytes = (n + 7) / 8;
    const int64_t bbytes = BLOCK / 8;
    const int64_t blocks = (nbytes + bbytes - 1) / bbytes;
    const size_t esz = dt_size(dt);
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        uint8_t f[TILE + 8];
        const int64_t e0 = b * BLOCK, e1 = min64(e0 + BLOCK, n);
        for (int64_t t0 = e0; t0 < e1; t0 += TILE) {
            const int64_t t = min64(TILE, e1 - t0);
            sign_flags((const char *)x + (size_t)t0 * esz, dt, t, f);
            memset(f + t, 0, 8);
            uint8_t *o = out + t0 / 8;
            const int64_t tb = (t + 7) / 8;
            for (int64_t i = 0; i < tb; i++) o[i] = gather_bits(f + 8 * i);
        }
    }
    return 0;
}

/* +-1 for each of the 256 byte values, per dtype. */
static float lut_f32[256][8];
static uint16_t lut_f16[256][8];
static uint16_t lut_bf16[256][8];

__attribute__((constructor)) static void zpp_init_luts(void) {
    for (int b = 0; b < 256; b++)
        for (int j = 0; j < 8; j++) {
            const int pos = (b >> j) & 1;
            lut_f32[b][j] = pos ? 1.0f : -1.0f;
            lut_f16[b][j] = pos ? 0x3C00u : 0xBC00u;
            lut_bf16[b][j] = pos ? 0x3F80u : 0xBF80u;
        }
}

/* out[i] = +1 where bit i of packed is set, else -1, for i < n. */
ZPP_API int zpp_unpack_signs(const uint8_t *packed, int64_t n, int dt, void *out, int nthreads) {
    if (n <= 0) return 0;
    const int64_t full = n / 8; /* whole bytes */
    const int64_t bbytes = BLOCK / 8;
    const int64_t blocks = (full + bbytes - 1) / bbytes;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t i0 = b * bbytes, i1 = min64(i0 + bbytes, full);
        if (dt == DT_F32) {
            float *o = (float *)out;
            for (int64_t i = i0; i < i1; i++) memcpy(o + 8 * i, lut_f32[packed[i]], 32);
        } else {
            uint16_t(*lut)[8] = dt == DT_BF16 ? lut_bf16 : lut_f16;
            uint16_t *o = (uint16_t *)out;
            for (int64_t i = i0; i < i1; i++) memcpy(o + 8 * i, lut[packed[i]], 16);
        }
    }
    const int64_t rest = n - 8 * full;
    if (rest) {
        const uint8_t b = packed[full];
        if (dt == DT_F32)
            memcpy((float *)out + 8 * full, lut_f32[b], (size_t)rest * 4);
        else
            memcpy((uint16_t *)out + 8 * full, (dt == DT_BF16 ? lut_bf16 : lut_f16)[b], (size_t)rest * 2);
    }
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* 1-bit error-feedback compression (see [Note: 1-bit kernels] in reference.py)          */
/* ------------------------------------------------------------------------------------ */
/*
 * Memory traffic is what these kernels cost on large inputs, so each is one or two
 * streaming passes with the arithmetic in AVX registers:
 *   onebit_compress: pass 1 reads x and e and writes b = x + e into e (12 bytes per fp32
 *     element), summing b^2 from L1 right behind; pass 2 reads and rewrites e and writes the
 *     signs (8.125 bytes per element): the update needs the scale, which needs all of b.
 *     The lazy form leaves that update to the next call, which applies it as it reads e in
 *     its own pass 1 and packs the signs from L1 there: one pass, 12.125 bytes per element.
 *   signs_weighted_sum: reads k sign streams (k/8 bytes per output) and writes 4 bytes.
 *   unpack_scaled: reads 1/8 byte and writes one element (4 bytes fp32) per output; the
 *     caller may pass its final destination (OneBitAllReduce decodes into x).
 * Every product is a scale times +-1 (exact) and every sum runs in the documented order,
 * so the results equal the reference's bit for bit, the scale included.
 */
#if defined(__AVX__)
#include <immintrin.h>
#define ZPP_HAVE_AVX 1
#else
#define ZPP_HAVE_AVX 0
#endif

/* The sum of squares is a halving tree over each block of SUMSQ_BLOCK elements, then a
 * halving tree over the block sums (reference.py's _SUMSQ_BLOCK is the same number). */
#define SUMSQ_BLOCK 2048

/* t[0..w) (w a power of two) summed by t[j] = t[j] + t[j + w/2] until one value is left. */
static double halving_sum(double *restrict t, int64_t w) {
    for (; w > 1; w /= 2) {
        const int64_t h = w / 2;
        for (int64_t j = 0; j < h; j++) t[j] = t[j] + t[j + h];
    }
    return t[0];
}

/* fp64 sum of b[j]^2, j < len <= SUMSQ_BLOCK, zero-padded to SUMSQ_BLOCK, by halving tree.
 * t is scratch of SUMSQ_BLOCK / 2 doubles. */
static double block_sumsq(const float *restrict b, int64_t len, double *restrict t) {
    const int64_t h = SUMSQ_BLOCK / 2;
    if (len == SUMSQ_BLOCK) {
        for (int64_t j = 0; j < h; j++) {
            const double u = b[j], v = b[j + h];
            t[j] = u * u + v * v; /* exact fp64 products of fp32 values, one rounded add */
        }
    } else {
        for (int64_t j = 0; j < h; j++) {
            const double u = j < len ? (double)b[j] : 0.0;
            const double v = j + h < len ? (double)b[j + h] : 0.0;
            t[j] = u * u + v * v;
        }
    }
    return halving_sum(t, h);
}

/* err[i] = b_i - (b_i >= 0 ? scale : -scale) for i in [i0, i1), and the sign bytes of
 * those positions; i0 and i1 are multiples of 8 and i1 <= numel. */
static void onebit_update(float *restrict err, int64_t i0, int64_t i1, float scale,
                          uint8_t *restrict packed) {
    const float neg = -scale;
    int64_t i = i0;
#if ZPP_HAVE_AVX
    const __m256 zero = _mm256_setzero_ps(), ps = _mm256_set1_ps(scale), ns = _mm256_set1_ps(neg);
    for (; i < i1; i += 8) {
        const __m256 v = _mm256_loadu_ps(err + i);
        const __m256 m = _mm256_cmp_ps(v, zero, _CMP_GE_OQ); /* NaN -> 0, -0.0 -> 1 */
        _mm256_storeu_ps(err + i, _mm256_sub_ps(v, _mm256_blendv_ps(ns, ps, m)));
        packed[i / 8] = (uint8_t)_mm256_movemask_ps(m);
    }
#endif
    for (; i < i1; i += 8) {
        unsigned byte = 0;
        for (int j = 0; j < 8; j++) {
            const float v = err[i + j];
            const int pos = v >= 0.0f;
            byte |= (unsigned)pos << j;
            err[i + j] = v - (pos ? scale : neg);
        }
        packed[i / 8] = (uint8_t)byte;
    }
}

/* Sign bytes of err[i0..i1) (i0, i1 multiples of 8): bit j = (err[i0 + 8k + j] >= 0). */
static void sign_bytes(const float *restrict err, int64_t i0, int64_t i1, uint8_t *restrict packed) {
    int64_t i = i0;
#if ZPP_HAVE_AVX
    const __m256 zero = _mm256_setzero_ps();
    for (; i < i1; i += 8)
        packed[i / 8] = (uint8_t)_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(err + i), zero, _CMP_GE_OQ));
#endif
    for (; i < i1; i += 8) {
        unsigned byte = 0;
        for (int j = 0; j < 8; j++) byte |= (unsigned)(err[i + j] >= 0.0f) << j;
        packed[i / 8] = (uint8_t)byte;
    }
}

/* b = x + e (fp32) for i < numel, where e = err, or with lazy set e = err - (err >= 0 ? pending
 * : -pending) (err then holds the previous call's b and pending its scale: the update that
 * call left undone); scale = sqrt(sumsq / numel) with sumsq the fp64 sum of b^2 in the
 * halving-tree order above (fixed, so neither the thread count nor the implementation can
 * change it); packed bit i = (b_i >= 0) for i < nerr (positions >= numel hold b = 0: bit 1,
 * and their err is not touched). On return err_i = b_i - (b_i >= 0 ? scale : -scale), or
 * with lazy err_i = b_i: one pass over memory instead of two. nerr is a multiple of 8. */
ZPP_API int zpp_onebit_compress(const void *x, int dt, int64_t numel, float *err, int64_t nerr,
                                uint8_t *packed, float *scale_out, int nthreads, int lazy,
                                double pending) {
    const int64_t sblocks = (numel + SUMSQ_BLOCK - 1) / SUMSQ_BLOCK;
    const int64_t per_item = BLOCK / SUMSQ_BLOCK; /* sum blocks per work item */
    const int64_t items = (sblocks + per_item - 1) / per_item;
    const int64_t whole = numel / 8 * 8; /* bytes with eight real positions end here */
    const float pp = (float)pending, pn = -pp;
    int64_t p2 = 1;
    while (p2 < sblocks) p2 *= 2;
    const size_t esz = dt_size(dt);
    if (nthreads < 1) nthreads = 1;
    double *partial = (double *)calloc((size_t)p2, sizeof(double)); /* zero padding included */
    if (!partial) return 1;
    int fail = 0;
#pragma omp parallel num_threads(nthreads) if (nthreads > 1)
    {
        double *t = (double *)malloc(SUMSQ_BLOCK / 2 * sizeof(double));
        float *tile = dt == DT_F32 ? NULL : (float *)malloc(SUMSQ_BLOCK * sizeof(float));
        if (!t || (dt != DT_F32 && !tile)) {
#pragma omp atomic write
            fail = 1;
        }
#pragma omp for schedule(dynamic, 1)
        for (int64_t it = 0; it < items; it++) {
            if (!t || (dt != DT_F32 && !tile)) continue;
            const int64_t sb1 = min64((it + 1) * per_item, sblocks);
            for (int64_t sb = it * per_item; sb < sb1; sb++) {
                const int64_t s0 = sb * SUMSQ_BLOCK, len = min64(SUMSQ_BLOCK, numel - s0);
                float *restrict e = err + s0;
                const float *restrict xs;
                if (dt == DT_F32) {
                    xs = (const float *)x + s0;
                } else {
                    load_f32((const char *)x + (size_t)s0 * esz, dt, len, tile);
                    xs = tile;
                }
                if (lazy) {
                    for (int64_t i = 0; i < len; i++) {
                        const float v = e[i];
                        e[i] = xs[i] + (v - (v >= 0.0f ? pp : pn));
                    }
                    sign_bytes(err, s0, s0 + min64(len, whole - s0), packed);
                } else {
                    for (int64_t i = 0; i < len; i++) e[i] = xs[i] + e[i]; /* b, until pass 2 */
                }
                partial[sb] = block_sumsq(e, len, t);
            }
        }
        free(t);
        free(tile);
    }
    if (fail) {
        free(partial);
        return 1;
    }
    const double sumsq = sblocks > 0 ? halving_sum(partial, p2) : 0.0;
    free(partial);
    const float scale = numel > 0 ? (float)sqrt(sumsq / (double)numel) : 0.0f;
    *scale_out = scale;
    if (!lazy) {
        const int64_t pblocks = (whole + BLOCK - 1) / BLOCK;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)
        for (int64_t b = 0; b < pblocks; b++)
            onebit_update(err, b * BLOCK, min64(b * BLOCK + BLOCK, whole), scale, packed);
    }
    if (whole < nerr) { /* the byte holding numel, if partial, then all-ones padding bytes */
        unsigned byte = 0xFFu;
        for (int64_t i = whole; i < numel; i++) {
            const float v = err[i];
            const int pos = v >= 0.0f;
            if (!pos) byte &= ~(1u << (i - whole));
            if (!lazy) err[i] = v - (pos ? scale : -scale);
        }
        packed[whole / 8] = (uint8_t)byte;
        memset(packed + whole / 8 + 1, 0xFF, (size_t)((nerr - whole) / 8 - 1));
    }
    return 0;
}

/* out[t] = (sum_i scales[i] * sign_i[t], i = 0 first) / divisor, t < chunk (chunk % 8 == 0). */
ZPP_API int zpp_signs_weighted_sum(const uint8_t *packed, const float *scales, int64_t k,
                                   int64_t chunk, double divisor, float *out, int nthreads) {
    const int64_t nbytes = chunk / 8, bbytes = BLOCK / 8;
    const int64_t blocks = (nbytes + bbytes - 1) / bbytes;
    const float div = (float)divisor;
    const int divide = div != 1.0f;
    if (nthreads < 1) nthreads = 1;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t i0 = b * bbytes, i1 = min64(i0 + bbytes, nbytes);
#if ZPP_HAVE_AVX
        const __m256 vdiv = _mm256_set1_ps(div);
        for (int64_t i = i0; i < i1; i++) {
            __m256 acc = _mm256_mul_ps(_mm256_loadu_ps(lut_f32[packed[i]]), _mm256_set1_ps(scales[0]));
            for (int64_t r = 1; r < k; r++)
                acc = _mm256_add_ps(acc, _mm256_mul_ps(_mm256_loadu_ps(lut_f32[packed[r * nbytes + i]]),
                                                       _mm256_set1_ps(scales[r])));
            if (divide) acc = _mm256_div_ps(acc, vdiv);
            _mm256_storeu_ps(out + 8 * i, acc);
        }
#else
        for (int64_t i = i0; i < i1; i++) {
            float acc[8];
            const float *l = lut_f32[packed[i]];
            for (int j = 0; j < 8; j++) acc[j] = l[j] * scales[0];
            for (int64_t r = 1; r < k; r++) {
                const float *lr = lut_f32[packed[r * nbytes + i]];
                const float s = scales[r];
                for (int j = 0; j < 8; j++) acc[j] = acc[j] + lr[j] * s;
            }
            if (divide)
                for (int j = 0; j < 8; j++) acc[j] = acc[j] / div;
            memcpy(out + 8 * i, acc, sizeof acc);
        }
#endif
    }
    return 0;
}

/* out[e] = s * sign bit e of packed, for e in [e0, e1) (e0 a multiple of 8), in dtype dt. */
static void unpack_scaled_run(const uint8_t *restrict packed, float s, int64_t e0, int64_t e1,
                              int dt, void *out) {
    const int64_t whole = e0 + (e1 - e0) / 8 * 8;
    if (dt == DT_F32) {
        float *restrict o = (float *)out;
        int64_t e = e0;
#if ZPP_HAVE_AVX
        const __m256 vs = _mm256_set1_ps(s);
        for (; e < whole; e += 8)
            _mm256_storeu_ps(o + e, _mm256_mul_ps(_mm256_loadu_ps(lut_f32[packed[e / 8]]), vs));
#endif
        for (; e < whole; e += 8) {
            const float *l = lut_f32[packed[e / 8]];
            for (int j = 0; j < 8; j++) o[e + j] = l[j] * s;
        }
        for (; e < e1; e++) o[e] = lut_f32[packed[e / 8]][e % 8] * s;
        return;
    }
    float tile[TILE];
    for (int64_t t0 = e0; t0 < e1; t0 += TILE) { /* TILE is a multiple of 8 */
        const int64_t t = min64(TILE, e1 - t0);
        for (int64_t i = 0; i < t; i++) tile[i] = lut_f32[packed[(t0 + i) / 8]][(t0 + i) % 8] * s;
        store_f32(tile, t, dt, (char *)out + (size_t)t0 * 2);
    }
}

/* out[j*chunk + t] = scales[j] * sign_j[t] in dtype dt, for the first numel positions. */
ZPP_API int zpp_unpack_scaled(const uint8_t *packed, const float *scales, int64_t k, int64_t chunk,
                              int64_t numel, int dt, void *out, int nthreads) {
    const int64_t blocks = (numel + BLOCK - 1) / BLOCK;
    if (nthreads < 1) nthreads = 1;
    (void)k;
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads) if (nthreads > 1)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t e1 = min64(b * BLOCK + BLOCK, numel);
        for (int64_t e = b * BLOCK; e < e1;) { /* one run per chunk: chunk % 8 == 0 */
            const int64_t j = e / chunk, end = min64(e1, (j + 1) * chunk);
            unpack_scaled_run(packed, scales[j], e, end, dt, out);
            e = end;
        }
    }
    return 0;
}

/* ------------------------------------------------------------------------------------ */
/* packed-argument entry points                                                          */
/* ------------------------------------------------------------------------------------ */
/*
 * ctypes converts typed arguments slowly (microseconds per call for a dozen int64s); these
 * take one buffer of little-endian 8-byte slots instead (Python's struct.pack("<...q")), in
 * the order of the typed functions' parameters. Pointers are slots holding the address,
 * the divisor a slot holding an IEEE double.
 */
static inline int64_t arg_i(const unsigned char *b, int i) {
    int64_t v;
    memcpy(&v, b + 8 * i, 8);
    return v;
}
static inline void *arg_p(const unsigned char *b, int i) { return (void *)(uintptr_t)arg_i(b, i); }
static inline double arg_d(const unsigned char *b, int i) {
    double v;
    memcpy(&v, b + 8 * i, 8);
    return v;
}

ZPP_API int zpp_quantize_p(const unsigned char *b) {
    return zpp_quantize(arg_p(b, 0), (int)arg_i(b, 1), arg_i(b, 2), (int)arg_i(b, 3), arg_i(b, 4),
                        arg_i(b, 5), arg_i(b, 6), (int)arg_i(b, 7), arg_i(b, 8), (int)arg_i(b, 9),
                        (uint8_t *)arg_p(b, 10), (float *)arg_p(b, 11), (int)arg_i(b, 12));
}

ZPP_API int zpp_dequantize_p(const unsigned char *b) {
    return zpp_dequantize((const uint8_t *)arg_p(b, 0), (const float *)arg_p(b, 1), arg_i(b, 2),
                          (int)arg_i(b, 3), arg_i(b, 4), (int)arg_i(b, 5), (int)arg_i(b, 6),
                          arg_p(b, 7), (int)arg_i(b, 8));
}

ZPP_API int zpp_reduce_sum_p(const unsigned char *b) {
    return zpp_reduce_sum((const uint8_t *)arg_p(b, 0), (const float *)arg_p(b, 1), arg_i(b, 2),
                          arg_i(b, 3), (int)arg_i(b, 4), arg_i(b, 5), (int)arg_i(b, 6), arg_d(b, 7),
                          (int)arg_i(b, 8), arg_i(b, 9), (int)arg_i(b, 10), arg_p(b, 11),
                          (uint8_t *)arg_p(b, 12), (float *)arg_p(b, 13), (int)arg_i(b, 14));
}

ZPP_API int zpp_pack_signs_p(const unsigned char *b) {
    return zpp_pack_signs(arg_p(b, 0), (int)arg_i(b, 1), arg_i(b, 2), (uint8_t *)arg_p(b, 3),
                          (int)arg_i(b, 4));
}

ZPP_API int zpp_unpack_signs_p(const unsigned char *b) {
    return zpp_unpack_signs((const uint8_t *)arg_p(b, 0), arg_i(b, 1), (int)arg_i(b, 2),
                            arg_p(b, 3), (int)arg_i(b, 4));
}

ZPP_API int zpp_onebit_compress_p(const unsigned char *b) {
    return zpp_onebit_compress(arg_p(b, 0), (int)arg_i(b, 1), arg_i(b, 2), (float *)arg_p(b, 3),
                               arg_i(b, 4), (uint8_t *)arg_p(b, 5), (float *)arg_p(b, 6),
                               (int)arg_i(b, 7), (int)arg_i(b, 8), arg_d(b, 9));
}

ZPP_API int zpp_signs_weighted_sum_p(const unsigned char *b) {
    return zpp_signs_weighted_sum((const uint8_t *)arg_p(b, 0), (const float *)arg_p(b, 1),
                                  arg_i(b, 2), arg_i(b, 3), arg_d(b, 4), (float *)arg_p(b, 5),
                                  (int)arg_i(b, 6));
}

ZPP_API int zpp_unpack_scaled_p(const unsigned char *b) {
    return zpp_unpack_scaled((const uint8_t *)arg_p(b, 0), (const float *)arg_p(b, 1), arg_i(b, 2),
                             arg_i(b, 3), arg_i(b, 4), (int)arg_i(b, 5), arg_p(b, 6),
                             (int)arg_i(b, 7));
}

/* Test hooks: the portable fp16 conversions (the F16C path is used when available). */
ZPP_API void zpp_f16_to_f32_soft(const uint16_t *src, int64_t n, float *dst) {
    for (int64_t i = 0; i < n; i++) dst[i] = h2f_soft(src[i]);
}

ZPP_API void zpp_f32_to_f16_soft(const float *src, int64_t n, uint16_t *dst) {
    for (int64_t i = 0; i < n; i++) dst[i] = f2h_soft(src[i]);
}

ZPP_API void zpp_f32_to_bf16(const float *src, int64_t n, uint16_t *dst) {
    for (int64_t i = 0; i < n; i++) dst[i] = f2bf(f2u(src[i]));
}
