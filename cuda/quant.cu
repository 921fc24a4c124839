// zpp.quant CUDA kernels: block quantization (int8/int4, symmetric/asymmetric), dequantize,
// the swizzled quantize of the two-hop reduce-scatter, the fused dequantize -> fp32 sum ->
// divide -> requantize-or-write, 1-bit sign packing, and the fused 1-bit error-feedback ops
// (onebit_compress, signs_weighted_sum, unpack_scaled; see their section for the fp64 order).
//
// Bit-exact with zpp/quant/reference.py (layout and arithmetic: zpp/quant/types.py):
//   * x / scale is an IEEE division (__fdiv_rn); codes are rounded half to even
//     (__float2int_rn) and clamped; scale = absmax / qmax or (max - min) / levels (__fdiv_rn);
//   * asymmetric dequantization is code * scale, rounded, then + offset, rounded (__fmul_rn,
//     __fadd_rn: never contracted into a fused multiply-add);
//   * a group holding NaN or +-Inf (or, asymmetric, whose range overflows) gets scale NaN
//     (offset NaN) and codes 0; a zero scale gives codes 0; padded positions get code 0 and
//     stay out of the statistics;
//   * sums run in fp32, slice 0 first, then __fdiv_rn(sum, divisor) when divisor != 1.
//   NaN results are written as the positive quiet NaN torch's CPU kernels produce
//   (0x7fc00000, fp16 0x7e00, bf16 0x7fc0).
//
// No headers: the file compiles under NVRTC (cupy.RawModule, kernels picked by
// name_expressions) and nvcc (.ci/compile_cuda.sh, with -DZPP_NVCC_CHECK to instantiate every
// kernel). fp16 and bf16 travel as 16-bit integers (zq_half, zq_bf16); fp16 converts with PTX
// cvt, bf16 with integer arithmetic (exact round to nearest even, like c10::BFloat16).
//
// Layout of the work:
//   * quantize-like kernels (zq_quantize, zq_swizzle_quantize, zq_requant_sum) run one block
//     per quantization group; each thread handles "chunks" of 8 consecutive elements of the
//     group (vector loads/stores where aligned), keeps up to CACHE chunks in registers between
//     the statistics pass and the encode pass (more are re-read), and the statistics are
//     reduced with warp shuffles and one shared-memory step;
//   * elementwise kernels (zq_dequant_sum, zq_pack_signs, zq_unpack_scaled, zq_signs_weighted_sum)
//     run one thread per chunk of 8 elements (one packed byte of signs);
//   * zq_onebit_sumsq runs one block of threads per ZQ_SUMSQ_BLOCK elements.
// Element indices are 64-bit. group_size must be even (int4 packs element pairs of a group).

#define ZQ_FULL_MASK 0xffffffffu
#define ZQ_MAX_WARPS 32

struct zq_half {
    unsigned short bits;
};
struct zq_bf16 {
    unsigned short bits;
};

// ---------------------------------------------------------------------------------------------
// Scalar helpers
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ int zq_imin(int a, int b) { return a < b ? a : b; }
__device__ __forceinline__ int zq_imax(int a, int b) { return a > b ? a : b; }
__device__ __forceinline__ unsigned zq_umax(unsigned a, unsigned b) { return a > b ? a : b; }

__device__ __forceinline__ bool zq_isnan(float f) {
    return (__float_as_uint(f) & 0x7fffffffu) > 0x7f800000u;
}
__device__ __forceinline__ bool zq_isfinite(float f) {
    return (__float_as_uint(f) & 0x7f800000u) != 0x7f800000u;
}
__device__ __forceinline__ float zq_nan() { return __uint_as_float(0x7fc00000u); }

// Global index of this thread in a 1-D grid (elementwise kernels: the byte of signs, or the
// chunk of 8 elements, it handles).
__device__ __forceinline__ long long zq_thread_index() { return (long long)blockIdx.x * blockDim.x + threadIdx.x; }

// Elements that exist in [e0, e0 + cnt) of a tensor of numel elements: clamp(numel - e0, 0, cnt).
__device__ __forceinline__ int zq_count(long long e0, int cnt, long long numel) {
    const long long left = numel - e0;
    return left <= 0 ? 0 : (left < cnt ? (int)left : cnt);
}

// a / b for a >= 0, b > 0, with a 32-bit division when a fits.
__device__ __forceinline__ long long zq_div(long long a, int b) {
    if ((a >> 32) == 0) return (long long)((unsigned)a / (unsigned)b);
    return a / b;
}

// Order-preserving map of a float's bits onto int: -NaN < -Inf < ... < -0 < +0 < ... < +Inf < +NaN.
__device__ __forceinline__ int zq_key(float f) {
    const unsigned u = __float_as_uint(f);
    return (int)(u ^ ((unsigned)((int)u >> 31) & 0x7fffffffu));
}
__device__ __forceinline__ float zq_unkey(int k) {
    return __int_as_float((int)((unsigned)k ^ ((unsigned)(k >> 31) & 0x7fffffffu)));
}
#define ZQ_KEY_POS_INF ((int)0x7f800000)
#define ZQ_KEY_NEG_INF (-1 - (int)0x7f800000)

// ---------------------------------------------------------------------------------------------
// Element types: to/from fp32, scalar and 8-wide vector access
// ---------------------------------------------------------------------------------------------

template <typename T>
struct ZqType;

template <>
struct ZqType<float> {
    static __device__ __forceinline__ float to_f(float x) { return x; }
    static __device__ __forceinline__ float from_f(float f) { return zq_isnan(f) ? zq_nan() : f; }
    // p is 16-byte aligned.
    static __device__ __forceinline__ void load8(const float* __restrict__ p, float v[8]) {
        const float4 a = reinterpret_cast<const float4*>(p)[0];
        const float4 b = reinterpret_cast<const float4*>(p)[1];
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w;
        v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
    }
    static __device__ __forceinline__ void store8(float* __restrict__ p, const float v[8]) {
        float4 a, b;
        a.x = from_f(v[0]); a.y = from_f(v[1]); a.z = from_f(v[2]); a.w = from_f(v[3]);
        b.x = from_f(v[4]); b.y = from_f(v[5]); b.z = from_f(v[6]); b.w = from_f(v[7]);
        reinterpret_cast<float4*>(p)[0] = a;
        reinterpret_cast<float4*>(p)[1] = b;
    }
};

// fp16 and bf16: 16-bit storage, 8 values a uint4; Conv gives bits_to_f and f_to_bits.
template <typename S, typename Conv>
struct ZqType16 {
    static __device__ __forceinline__ float to_f(S x) { return Conv::bits_to_f(x.bits); }
    static __device__ __forceinline__ S from_f(float f) {
        S r;
        r.bits = Conv::f_to_bits(f);
        return r;
    }
    // p is 16-byte aligned.
    static __device__ __forceinline__ void load8(const S* __restrict__ p, float v[8]) {
        const uint4 w = *reinterpret_cast<const uint4*>(p);
        const unsigned u[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            v[2 * i] = Conv::bits_to_f((unsigned short)(u[i] & 0xffffu));
            v[2 * i + 1] = Conv::bits_to_f((unsigned short)(u[i] >> 16));
        }
    }
    static __device__ __forceinline__ void store8(S* __restrict__ p, const float v[8]) {
        unsigned u[4];
#pragma unroll
        for (int i = 0; i < 4; ++i)
            u[i] = (unsigned)Conv::f_to_bits(v[2 * i]) | ((unsigned)Conv::f_to_bits(v[2 * i + 1]) << 16);
        uint4 w;
        w.x = u[0]; w.y = u[1]; w.z = u[2]; w.w = u[3];
        *reinterpret_cast<uint4*>(p) = w;
    }
};

struct ZqHalfConv {
    static __device__ __forceinline__ float bits_to_f(unsigned short h) {
        float f;
        asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
        return f;
    }
    static __device__ __forceinline__ unsigned short f_to_bits(float f) {
        unsigned short h;
        asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
        return zq_isnan(f) ? (unsigned short)0x7e00u : h;
    }
};

struct ZqBf16Conv {
    static __device__ __forceinline__ float bits_to_f(unsigned short b) { return __uint_as_float((unsigned)b << 16); }
    // Round to nearest even; NaN -> 0x7fc0 (what c10::BFloat16 gives).
    static __device__ __forceinline__ unsigned short f_to_bits(float f) {
        const unsigned u = __float_as_uint(f);
        if (zq_isnan(f)) return (unsigned short)0x7fc0u;
        return (unsigned short)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
};

template <>
struct ZqType<zq_half> : ZqType16<zq_half, ZqHalfConv> {};
template <>
struct ZqType<zq_bf16> : ZqType16<zq_bf16, ZqBf16Conv> {};

// Writes v[0 .. nv) to out[e0 ..]; one 8-wide store when the chunk is whole and vec (out is
// 16-byte aligned: true of the outputs these kernels allocate; e0 % 8 == 0 by construction).
template <typename T>
__device__ __forceinline__ void zq_store_chunk(T* __restrict__ out, long long e0, int nv, const float v[8],
                                               int vec = 1) {
    if (vec && nv == 8 && (e0 & 7) == 0) {
        ZqType<T>::store8(out + e0, v);
    } else {
#pragma unroll
        for (int m = 0; m < 8; ++m)
            if (m < nv) out[e0 + m] = ZqType<T>::from_f(v[m]);
    }
}

// ---------------------------------------------------------------------------------------------
// Codes
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ int zq_code8(unsigned byte, int sym) {
    return sym ? (int)(signed char)(unsigned char)byte : (int)(byte & 0xffu);
}
__device__ __forceinline__ int zq_code4(unsigned nib, int sym) {
    return sym ? (int)(nib ^ 8u) - 8 : (int)nib;
}
// Code of element e of a payload.
__device__ __forceinline__ int zq_code_at(const unsigned char* __restrict__ data, long long e, int bits, int sym) {
    if (bits == 8) return zq_code8(data[e], sym);
    const unsigned byte = data[e >> 1];
    return zq_code4((e & 1) ? (byte >> 4) : (byte & 0xfu), sym);
}
// code * scale (+ offset), each step rounded on its own.
__device__ __forceinline__ float zq_deq(int code, float scale, float offset, int sym) {
    const float p = __fmul_rn((float)code, scale);
    return sym ? p : __fadd_rn(p, offset);
}

// Per-group quantization parameters (identical in every thread of the block).
struct ZqParams {
    float scale;
    float offset;
    int usable;
    int lo, hi;
    int sym;
};

__device__ __forceinline__ int zq_encode(float x, const ZqParams& q) {
    if (!q.usable) return 0;
    const float t = q.sym ? x : __fsub_rn(x, q.offset);
    const int c = __float2int_rn(__fdiv_rn(t, q.scale));  // round half to even
    return zq_imin(zq_imax(c, q.lo), q.hi);
}

// amax: max of |x|'s bits (symmetric); kmin/kmax: min/max of zq_key(x) (asymmetric).
__device__ __forceinline__ ZqParams zq_params(unsigned amax, int kmin, int kmax, int bits, int sym) {
    ZqParams q;
    q.sym = sym;
    if (sym) {
        const int qmax = (1 << (bits - 1)) - 1;
        q.lo = -qmax;
        q.hi = qmax;
        q.offset = 0.0f;
        if (amax >= 0x7f800000u) {  // a NaN or an Inf in the group
            q.scale = zq_nan();
            q.usable = 0;
        } else {
            q.scale = __fdiv_rn(__uint_as_float(amax), (float)qmax);
            q.usable = q.scale != 0.0f;
        }
    } else {
        const int levels = (1 << bits) - 1;
        q.lo = 0;
        q.hi = levels;
        // Which zero amin/amax return when the extreme is a zero of either sign is unspecified:
        // read it as +0 (x + 0 turns -0 into +0 and leaves every other value as it is).
        const float mn = __fadd_rn(zq_unkey(kmin), 0.0f);
        const float mx = __fadd_rn(zq_unkey(kmax), 0.0f);
        const float scale = __fdiv_rn(__fsub_rn(mx, mn), (float)levels);
        const bool bad = kmin <= ZQ_KEY_NEG_INF || kmax >= ZQ_KEY_POS_INF || !zq_isfinite(scale);
        q.scale = bad ? zq_nan() : scale;
        q.offset = bad ? zq_nan() : mn;
        q.usable = !bad && scale != 0.0f;
    }
    return q;
}

__device__ __forceinline__ void zq_observe(const float v[8], int nv, int sym, unsigned& amax, int& kmin, int& kmax) {
#pragma unroll
    for (int m = 0; m < 8; ++m) {
        if (m < nv) {
            if (sym) {
                amax = zq_umax(amax, __float_as_uint(v[m]) & 0x7fffffffu);
            } else {
                const int k = zq_key(v[m]);
                kmin = zq_imin(kmin, k);
                kmax = zq_imax(kmax, k);
            }
        }
    }
}

// Block-wide reduction of the statistics; every thread gets the result. blockDim.x is a
// multiple of 32, at most 32 warps. Called once per block.
__device__ __forceinline__ void zq_block_reduce(unsigned& amax, int& kmin, int& kmax) {
    __shared__ unsigned s_amax[ZQ_MAX_WARPS];
    __shared__ int s_kmin[ZQ_MAX_WARPS];
    __shared__ int s_kmax[ZQ_MAX_WARPS];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        amax = zq_umax(amax, __shfl_xor_sync(ZQ_FULL_MASK, amax, o));
        kmin = zq_imin(kmin, __shfl_xor_sync(ZQ_FULL_MASK, kmin, o));
        kmax = zq_imax(kmax, __shfl_xor_sync(ZQ_FULL_MASK, kmax, o));
    }
    const int warp = threadIdx.x >> 5;
    if ((threadIdx.x & 31) == 0) {
        s_amax[warp] = amax;
        s_kmin[warp] = kmin;
        s_kmax[warp] = kmax;
    }
    __syncthreads();
    const int nwarps = blockDim.x >> 5;
    amax = s_amax[0];
    kmin = s_kmin[0];
    kmax = s_kmax[0];
    for (int w = 1; w < nwarps; ++w) {
        amax = zq_umax(amax, s_amax[w]);
        kmin = zq_imin(kmin, s_kmin[w]);
        kmax = zq_imax(kmax, s_kmax[w]);
    }
}

// Encodes elements [e0, e0 + cnt) of a group (cnt even, <= 8; the first nv are real, the rest
// padding -> code 0) and writes them to the payload. out is 16-byte aligned.
__device__ __forceinline__ void zq_store_codes(unsigned char* __restrict__ out, long long e0, int cnt, int nv,
                                               const float v[8], const ZqParams& q, int bits) {
    int c[8];
#pragma unroll
    for (int m = 0; m < 8; ++m) c[m] = (m < nv) ? zq_encode(v[m], q) : 0;
    if (bits == 8) {
        if (cnt == 8 && (e0 & 7) == 0) {
            uint2 w;
            w.x = (unsigned)(c[0] & 0xff) | ((unsigned)(c[1] & 0xff) << 8) | ((unsigned)(c[2] & 0xff) << 16) |
                  ((unsigned)(c[3] & 0xff) << 24);
            w.y = (unsigned)(c[4] & 0xff) | ((unsigned)(c[5] & 0xff) << 8) | ((unsigned)(c[6] & 0xff) << 16) |
                  ((unsigned)(c[7] & 0xff) << 24);
            *reinterpret_cast<uint2*>(out + e0) = w;
        } else {
#pragma unroll
            for (int m = 0; m < 8; ++m)
                if (m < cnt) out[e0 + m] = (unsigned char)(c[m] & 0xff);
        }
    } else {
        // Element 2i in the low nibble of byte i, 2i + 1 in the high nibble; e0 is even.
        if (cnt == 8 && (e0 & 7) == 0) {
            unsigned w = 0;
#pragma unroll
            for (int m = 0; m < 8; ++m) w |= (unsigned)(c[m] & 0xf) << (4 * m);
            *reinterpret_cast<unsigned*>(out + (e0 >> 1)) = w;
        } else {
#pragma unroll
            for (int m = 0; m < 8; m += 2)
                if (m < cnt)
                    out[(e0 >> 1) + (m >> 1)] = (unsigned char)((c[m] & 0xf) | ((c[m + 1] & 0xf) << 4));
        }
    }
}

// Quantizes group blockIdx.x of a logical fp32 tensor of numel elements whose values come from
// the loader: ld.load(e0, nv, v) fills v[0 .. nv) with elements e0 .. e0 + nv - 1 (nv <= 8) and
// zeros the rest.
template <int CACHE, typename L>
__device__ __forceinline__ void zq_quantize_group(const L& ld, long long numel, int group_size, int bits, int sym,
                                                  unsigned char* __restrict__ out, float* __restrict__ scales) {
    const long long g = blockIdx.x;
    const long long gs = g * (long long)group_size;
    const int nchunks = (group_size + 7) >> 3;
    const int nthreads = blockDim.x;

    float v[CACHE][8];
    unsigned amax = 0u;
    int kmin = 0x7fffffff;
    int kmax = -0x7fffffff - 1;

#pragma unroll
    for (int i = 0; i < CACHE; ++i) {
        const int c = threadIdx.x + i * nthreads;
        if (c < nchunks) {
            const long long e0 = gs + 8LL * c;
            const int nv = zq_count(e0, zq_imin(8, group_size - 8 * c), numel);
            ld.load(e0, nv, v[i]);
            zq_observe(v[i], nv, sym, amax, kmin, kmax);
        }
    }
    for (int c = threadIdx.x + CACHE * nthreads; c < nchunks; c += nthreads) {
        const long long e0 = gs + 8LL * c;
        const int nv = zq_count(e0, zq_imin(8, group_size - 8 * c), numel);
        float t[8];
        ld.load(e0, nv, t);
        zq_observe(t, nv, sym, amax, kmin, kmax);
    }

    zq_block_reduce(amax, kmin, kmax);
    const ZqParams q = zq_params(amax, kmin, kmax, bits, sym);
    if (threadIdx.x == 0) {
        if (sym) {
            scales[g] = q.scale;
        } else {
            scales[2 * g] = q.scale;
            scales[2 * g + 1] = q.offset;
        }
    }

#pragma unroll
    for (int i = 0; i < CACHE; ++i) {
        const int c = threadIdx.x + i * nthreads;
        if (c < nchunks) {
            const long long e0 = gs + 8LL * c;
            const int cnt = zq_imin(8, group_size - 8 * c);
            zq_store_codes(out, e0, cnt, zq_count(e0, cnt, numel), v[i], q, bits);
        }
    }
    for (int c = threadIdx.x + CACHE * nthreads; c < nchunks; c += nthreads) {
        const long long e0 = gs + 8LL * c;
        const int cnt = zq_imin(8, group_size - 8 * c);
        const int nv = zq_count(e0, cnt, numel);
        float t[8];
        ld.load(e0, nv, t);
        zq_store_codes(out, e0, cnt, nv, t, q, bits);
    }
}

// ---------------------------------------------------------------------------------------------
// Loaders
// ---------------------------------------------------------------------------------------------

// A flat tensor. vec: x is 16-byte aligned.
template <typename T>
struct ZqFlatLoader {
    const T* __restrict__ x;
    int vec;
    __device__ __forceinline__ void load(long long e0, int nv, float v[8]) const {
        if (vec && nv == 8 && (e0 & 7) == 0) {
            ZqType<T>::load8(x + e0, v);
        } else {
#pragma unroll
            for (int m = 0; m < 8; ++m) v[m] = (m < nv) ? ZqType<T>::to_f(x[e0 + m]) : 0.0f;
        }
    }
};

// Scalar path of ZqSwizzleLoader (out of line: keeps the kernels small). Outputs o0 .. o0 + nv - 1
// walk the (local, node, offset) coordinates one step at a time.
template <typename T>
__device__ __noinline__ void zq_swizzle_scalar(const T* __restrict__ x, long long numel, long long chunk,
                                               long long node_span, int rpn, long long o0, int nv, float* v) {
    const long long nodes = node_span / chunk;
    long long l = o0 / node_span;
    const long long r = o0 - l * node_span;
    long long nd = r / chunk;
    long long c = r - nd * chunk;
#pragma unroll 1
    for (int m = 0; m < 8; ++m) {
        float val = 0.0f;
        if (m < nv) {
            const long long s = (nd * rpn + l) * chunk + c;
            if (s < numel) val = ZqType<T>::to_f(x[s]);
            if (++c == chunk) {
                c = 0;
                if (++nd == nodes) {
                    nd = 0;
                    ++l;
                }
            }
        }
        v[m] = val;
    }
}

// x (numel elements), zero-padded to nodes * rpn * chunk, read as chunks [node][local] and
// presented as [local][node]. vec: x is 16-byte aligned and chunk % 8 == 0.
template <typename T>
struct ZqSwizzleLoader {
    const T* __restrict__ x;
    long long numel;
    long long chunk;
    long long node_span;  // nodes * chunk
    int rpn;
    int vec;
    __device__ __forceinline__ void load(long long o0, int nv, float v[8]) const {
        if (vec && nv == 8 && (o0 & 7) == 0) {
            // The 8 outputs lie in one chunk: their sources are contiguous and 8-aligned.
            const long long l = o0 / node_span;
            const long long r = o0 - l * node_span;
            const long long n = r / chunk;
            const long long s = (n * rpn + l) * chunk + (r - n * chunk);
            if (s + 8 <= numel) {
                ZqType<T>::load8(x + s, v);
            } else {
#pragma unroll
                for (int m = 0; m < 8; ++m) v[m] = (s + m < numel) ? ZqType<T>::to_f(x[s + m]) : 0.0f;
            }
        } else {
            zq_swizzle_scalar<T>(x, numel, chunk, node_span, rpn, o0, nv, v);
        }
    }
};

// Scalar path of ZqSumLoader (out of line: keeps the kernels small).
__device__ __noinline__ void zq_sum_scalar(const unsigned char* __restrict__ data, const float* __restrict__ scales,
                                           long long n, int k, int group_size, int bits, int sym, long long i0,
                                           int nv, float* v) {
#pragma unroll 1
    for (int m = 0; m < 8; ++m) {
        float acc = 0.0f;
        if (m < nv) {
            for (int j = 0; j < k; ++j) {
                const long long e = (long long)j * n + i0 + m;
                const long long g = zq_div(e, group_size);
                const int code = zq_code_at(data, e, bits, sym);
                const float d = sym ? zq_deq(code, scales[g], 0.0f, 1)
                                    : zq_deq(code, scales[2 * g], scales[2 * g + 1], 0);
                acc = (j == 0) ? d : __fadd_rn(acc, d);
            }
        }
        v[m] = acc;
    }
}

// Element i of the fp32 sum over k slices of n elements of a quantized payload (groups of
// group_size over the flat k * n elements), divided by div when has_div. vec: group_size % 8
// == 0, (k == 1 or n % 8 == 0), and data is 8-byte (int8) / 4-byte (int4) aligned.
struct ZqSumLoader {
    const unsigned char* __restrict__ data;
    const float* __restrict__ scales;
    long long n;
    int k;
    int group_size;
    int bits;
    int sym;
    int vec;
    int has_div;
    float div;
    __device__ __forceinline__ void load(long long i0, int nv, float v[8]) const {
        if (vec && nv == 8 && (i0 & 7) == 0) {
            for (int j = 0; j < k; ++j) {
                const long long e = (long long)j * n + i0;  // 8-aligned: one group
                const long long g = zq_div(e, group_size);
                float s, o = 0.0f;
                if (sym) {
                    s = scales[g];
                } else {
                    s = scales[2 * g];
                    o = scales[2 * g + 1];
                }
                int c[8];
                if (bits == 8) {
                    const uint2 w = *reinterpret_cast<const uint2*>(data + e);
#pragma unroll
                    for (int m = 0; m < 4; ++m) {
                        c[m] = zq_code8(w.x >> (8 * m), sym);
                        c[m + 4] = zq_code8(w.y >> (8 * m), sym);
                    }
                } else {
                    const unsigned w = *reinterpret_cast<const unsigned*>(data + (e >> 1));
#pragma unroll
                    for (int m = 0; m < 8; ++m) c[m] = zq_code4((w >> (4 * m)) & 0xfu, sym);
                }
#pragma unroll
                for (int m = 0; m < 8; ++m) {
                    const float d = zq_deq(c[m], s, o, sym);
                    v[m] = (j == 0) ? d : __fadd_rn(v[m], d);
                }
            }
        } else {
            zq_sum_scalar(data, scales, n, k, group_size, bits, sym, i0, nv, v);
        }
        if (has_div) {
#pragma unroll
            for (int m = 0; m < 8; ++m) v[m] = __fdiv_rn(v[m], div);
        }
    }
};

// ---------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------

// One block per group; grid = number of groups.
template <typename T, int CACHE>
__global__ void __launch_bounds__(512) zq_quantize(const T* __restrict__ x, long long numel, int group_size,
                                                   int bits, int sym, int vec, unsigned char* __restrict__ out,
                                                   float* __restrict__ scales) {
    zq_quantize_group<CACHE>(ZqFlatLoader<T>{x, vec}, numel, group_size, bits, sym, out, scales);
}

// One block per group of the swizzled (total = nodes * rpn * chunk elements) tensor.
template <typename T, int CACHE>
__global__ void __launch_bounds__(512) zq_swizzle_quantize(const T* __restrict__ x, long long numel, long long total,
                                                           long long chunk, long long node_span, int rpn,
                                                           int group_size, int bits, int sym, int vec,
                                                           unsigned char* __restrict__ out,
                                                           float* __restrict__ scales) {
    const ZqSwizzleLoader<T> ld{x, numel, chunk, node_span, rpn, vec};
    zq_quantize_group<CACHE>(ld, total, group_size, bits, sym, out, scales);
}

// Fused dequantize -> sum over k slices -> divide -> requantize (rbits, rgroup), same symmetry.
// One block per output group.
template <int CACHE>
__global__ void __launch_bounds__(512) zq_requant_sum(const unsigned char* __restrict__ data,
                                                      const float* __restrict__ scales, long long n, int k,
                                                      int group_size, int bits, int sym, int vec, int has_div,
                                                      float div, int rgroup, int rbits,
                                                      unsigned char* __restrict__ out,
                                                      float* __restrict__ out_scales) {
    const ZqSumLoader ld{data, scales, n, k, group_size, bits, sym, vec, has_div, div};
    zq_quantize_group<CACHE>(ld, n, rgroup, rbits, sym, out, out_scales);
}

// Fused dequantize -> sum over k slices -> divide -> write as T (k = 1, has_div = 0: plain
// dequantize). One thread per 8 output elements.
template <typename T>
__global__ void __launch_bounds__(256) zq_dequant_sum(const unsigned char* __restrict__ data,
                                                      const float* __restrict__ scales, long long n, int k,
                                                      int group_size, int bits, int sym, int vec, int has_div,
                                                      float div, T* __restrict__ out) {
    const long long i0 = zq_thread_index() * 8;
    if (i0 >= n) return;
    const int nv = zq_count(i0, 8, n);
    const ZqSumLoader ld{data, scales, n, k, group_size, bits, sym, vec, has_div, div};
    float v[8];
    ld.load(i0, nv, v);
    zq_store_chunk(out, i0, nv, v);
}

// ---------------------------------------------------------------------------------------------
// Signs and the 1-bit error-feedback kernels ([Note: 1-bit kernels] in zpp/quant/reference.py)
// ---------------------------------------------------------------------------------------------

// Packed byte of v[0 .. 8): bit m set where v[m] >= 0 (-0.0 -> 1, NaN -> 0); positions m >= nv
// get pad (pack_signs pads with 0, onebit_compress with 1: its padding holds b = 0).
__device__ __forceinline__ unsigned zq_sign_byte(const float v[8], int nv, unsigned pad) {
    unsigned byte = 0;
#pragma unroll
    for (int m = 0; m < 8; ++m)
        if (m < nv ? v[m] >= 0.0f : pad != 0u) byte |= 1u << m;
    return byte;
}

// The error a lazy 1-bit error buffer value stands for (the value itself when !has_pending).
__device__ __forceinline__ float zq_settled(float buf, int has_pending, float pending) {
    return has_pending ? __fsub_rn(buf, buf >= 0.0f ? pending : -pending) : buf;
}

// v[m] = +s where bit m of byte is set, else -s: the reference's sign * s, which is exact.
__device__ __forceinline__ void zq_signed8(unsigned byte, float s, float v[8]) {
#pragma unroll
    for (int m = 0; m < 8; ++m) v[m] = ((byte >> m) & 1u) ? s : -s;
}

// Byte b of packed: bit m set where v = x[8b + m] (+ e[8b + m] when err is given) >= 0
// (-0.0 -> 1, NaN -> 0) for positions below numel, pad for those in [numel, nbits). With err
// (onebit_compress's last pass), e = zq_settled(err), and below numel err becomes
// v - (v >= 0 ? scale[0] : -scale[0]), or v itself when has_pending (lazy).
// vec: x and err are 16-byte aligned. One thread per byte of nbits / 8.
template <typename T>
__global__ void __launch_bounds__(256) zq_pack_signs(const T* __restrict__ x, float* __restrict__ err,
                                                     const float* __restrict__ scale, int has_pending,
                                                     float pending, long long numel, long long nbits,
                                                     unsigned pad, int vec, unsigned char* __restrict__ packed) {
    const long long b = zq_thread_index();
    const long long e0 = b * 8;
    if (e0 >= nbits) return;
    const int nv = zq_count(e0, 8, numel);
    float v[8];
    if (nv > 0) {
        ZqFlatLoader<T>{x, vec}.load(e0, nv, v);
        if (err) {
            float ev[8];
            ZqFlatLoader<float>{err, vec}.load(e0, nv, ev);
            const float s = has_pending ? 0.0f : scale[0];
#pragma unroll
            for (int m = 0; m < 8; ++m) {
                v[m] = __fadd_rn(v[m], zq_settled(ev[m], has_pending, pending));
                ev[m] = has_pending ? v[m] : __fsub_rn(v[m], v[m] >= 0.0f ? s : -s);
            }
            zq_store_chunk(err, e0, nv, ev, vec);
        }
    }
    packed[b] = (unsigned char)zq_sign_byte(v, nv, pad);
}

// out[e] = scales[e / chunk] * sign(bit e of packed), e < numel (chunk % 8 == 0, so a byte lies in
// one chunk). scales == nullptr: +-1 (unpack_signs). vec: out is 16-byte aligned. One thread per
// byte.
template <typename T>
__global__ void __launch_bounds__(256) zq_unpack_scaled(const unsigned char* __restrict__ packed,
                                                        const float* __restrict__ scales, long long chunk,
                                                        long long numel, int vec, T* __restrict__ out) {
    const long long b = zq_thread_index();
    const long long e0 = b * 8;
    if (e0 >= numel) return;
    float v[8];
    zq_signed8(packed[b], scales ? scales[e0 / chunk] : 1.0f, v);
    zq_store_chunk(out, e0, zq_count(e0, 8, numel), v, vec);
}

// out[t] = (sum_r scales[r] * sign_r[t], r = 0 first, each step rounded to fp32) / div when
// has_div, for t < chunk (chunk % 8 == 0); sign vector r is bytes [r * chunk / 8, (r + 1) * chunk / 8)
// of packed. vec: out is 16-byte aligned. One thread per byte of a sign vector (8 outputs).
__global__ void __launch_bounds__(256) zq_signs_weighted_sum(const unsigned char* __restrict__ packed,
                                                             const float* __restrict__ scales, int k,
                                                             long long chunk, int has_div, float div,
                                                             int vec, float* __restrict__ out) {
    const long long b = zq_thread_index();
    const long long nbytes = chunk >> 3;
    if (b >= nbytes) return;
    float v[8], t[8];
    zq_signed8(packed[b], scales[0], v);
    for (int r = 1; r < k; ++r) {
        zq_signed8(packed[(long long)r * nbytes + b], scales[r], t);
#pragma unroll
        for (int m = 0; m < 8; ++m) v[m] = __fadd_rn(v[m], t[m]);
    }
    if (has_div) {
#pragma unroll
        for (int m = 0; m < 8; ++m) v[m] = __fdiv_rn(v[m], div);
    }
    zq_store_chunk(out, 8 * b, 8, v, vec);
}

// onebit_compress runs three kernels on one stream:
//   1. zq_onebit_sumsq: per block of ZQ_SUMSQ_BLOCK elements, the fp64 sum of b^2, b = x + e,
//      by a halving tree -> partials[block];
//   2. zq_onebit_scale: the block sums by a halving tree -> scale = sqrt(sum / numel) as fp32;
//   3. zq_pack_signs with err: b again (recomputing it reads x and e once more, which costs no
//      more than writing b in pass 1 and reading it back, and less for 16-bit x), the sign bits,
//      and e = b - (b >= 0 ? scale : -scale) below numel (or e = b when lazy, below).
// Lazy (has_pending, [Note: 1-bit kernels]): the buffer holds the previous b, whose scale was
// pending: e = buf - (buf >= 0 ? pending : -pending) first (zq_settled), and pass 3 stores b.
//
// Order of the sum of squares: the oracle's (_sum_squares in zpp/quant/reference.py). b^2 is
// exact in fp64. Each block of ZQ_SUMSQ_BLOCK elements (zero-padded) is summed by halving:
// q[i] += q[i + h] for h = BLOCK / 2, ..., 1. Thread t holds the ZQ_SUMSQ_PER elements t + m *
// ZQ_SUMSQ_THREADS; the levels h >= ZQ_SUMSQ_THREADS pair elements of the same thread (a
// halving over m in registers), the rest pair threads (shared memory, then warp shuffles). The
// block sums, zero-padded to a power of two, are summed by halving the same way. Adding a
// padding zero changes nothing (no partial sum is -0.0), so padding is skipped. Every add and
// multiply is an explicit round-to-nearest intrinsic: never contracted into an FMA.
#define ZQ_SUMSQ_THREADS 256
#define ZQ_SUMSQ_PER 8
#define ZQ_SUMSQ_BLOCK (ZQ_SUMSQ_THREADS * ZQ_SUMSQ_PER)

// Halving sum over the ZQ_SUMSQ_THREADS threads of the block (levels h = THREADS / 2, ..., 1);
// thread 0 gets the result.
__device__ __forceinline__ double zq_halving_threads(double acc) {
    __shared__ double s_acc[ZQ_SUMSQ_THREADS];
    const int t = threadIdx.x;
    for (int h = ZQ_SUMSQ_THREADS >> 1; h >= 32; h >>= 1) {  // across warps
        s_acc[t] = acc;
        __syncthreads();
        if (t < h) acc = __dadd_rn(acc, s_acc[t + h]);
        __syncthreads();
    }
    for (int h = 16; h >= 1; h >>= 1) {  // in a warp: lane t reads t + h
        const double o = __shfl_down_sync(ZQ_FULL_MASK, acc, h);
        if (t < h) acc = __dadd_rn(acc, o);
    }
    return acc;
}

// partials[blockIdx.x] = halving sum of b^2 over the block's ZQ_SUMSQ_BLOCK elements.
// blockDim.x == ZQ_SUMSQ_THREADS.
template <typename T>
__global__ void __launch_bounds__(ZQ_SUMSQ_THREADS) zq_onebit_sumsq(const T* __restrict__ x,
                                                                    const float* __restrict__ err,
                                                                    long long numel, int has_pending,
                                                                    float pending,
                                                                    double* __restrict__ partials) {
    const long long first = (long long)blockIdx.x * ZQ_SUMSQ_BLOCK + threadIdx.x;
    double q[ZQ_SUMSQ_PER];
#pragma unroll
    for (int m = 0; m < ZQ_SUMSQ_PER; ++m) {
        const long long e = first + (long long)m * ZQ_SUMSQ_THREADS;
        float b = 0.0f;
        if (e < numel) b = __fadd_rn(ZqType<T>::to_f(x[e]), zq_settled(err[e], has_pending, pending));
        q[m] = __dmul_rn((double)b, (double)b);
    }
#pragma unroll
    for (int h = ZQ_SUMSQ_PER >> 1; h >= 1; h >>= 1)
#pragma unroll
        for (int m = 0; m < h; ++m) q[m] = __dadd_rn(q[m], q[m + h]);
    const double sum = zq_halving_threads(q[0]);
    if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

// One block of ZQ_SUMSQ_THREADS: partials[0] = halving sum of partials[0 .. nparts) (in place),
// scale[0] = sqrt(partials[0] / numel) as fp32 (0 when numel is 0; the canonical NaN for NaN).
// Levels h >= ZQ_SUMSQ_THREADS pair i and i + h of one thread (i = t mod THREADS); the rest
// pair threads, with a barrier between levels.
__global__ void __launch_bounds__(ZQ_SUMSQ_THREADS) zq_onebit_scale(double* __restrict__ partials, long long nparts,
                                                                    long long numel, float* __restrict__ scale) {
    const int t = threadIdx.x;
    long long p2 = 1;
    while (p2 < nparts) p2 <<= 1;
    long long h = p2 >> 1;
    for (; h >= ZQ_SUMSQ_THREADS; h >>= 1)
        for (long long i = t; i < h && i + h < nparts; i += ZQ_SUMSQ_THREADS)
            partials[i] = __dadd_rn(partials[i], partials[i + h]);
    __syncthreads();
    for (; h >= 1; h >>= 1) {
        if (t < h && t + h < nparts) partials[t] = __dadd_rn(partials[t], partials[t + h]);
        __syncthreads();
    }
    if (t == 0) {
        const double sum = nparts > 0 ? partials[0] : 0.0;
        const float s = numel > 0 ? __double2float_rn(__dsqrt_rn(__ddiv_rn(sum, (double)numel))) : 0.0f;
        scale[0] = ZqType<float>::from_f(s);
    }
}

#ifdef ZPP_NVCC_CHECK
// nvcc only (.ci/compile_cuda.sh): instantiate every kernel that zpp/quant/cuda.py names, so
// that the check compiles device code for each of them.
#define ZQ_INSTANCES_FOR(T)                                                                   \
    (const void*)&zq_quantize<T, 1>, (const void*)&zq_quantize<T, 4>,                         \
        (const void*)&zq_swizzle_quantize<T, 1>, (const void*)&zq_swizzle_quantize<T, 4>,     \
        (const void*)&zq_dequant_sum<T>, (const void*)&zq_pack_signs<T>,                      \
        (const void*)&zq_unpack_scaled<T>, (const void*)&zq_onebit_sumsq<T>
extern const void* const zq_nvcc_instances[];
const void* const zq_nvcc_instances[] = {
    ZQ_INSTANCES_FOR(float), ZQ_INSTANCES_FOR(zq_half), ZQ_INSTANCES_FOR(zq_bf16),
    (const void*)&zq_requant_sum<1>, (const void*)&zq_requant_sum<4>,
    (const void*)&zq_signs_weighted_sum, (const void*)&zq_onebit_scale,
};
#endif
