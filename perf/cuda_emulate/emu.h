// Host emulation of the CUDA features cuda/quant.cu uses, for checking its kernels without a
// GPU (perf/cuda_emulate/run.py). A block's threads are real threads when the kernel
// synchronises (barriers for __syncthreads and for each warp's shuffles), else a loop.
// Arithmetic intrinsics map to host IEEE operations; build with -ffp-contract=off.
#pragma once
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <immintrin.h>
#include <memory>
#include <type_traits>
#include <vector>

#define __device__
#define __global__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __launch_bounds__(...)
#define __shared__ static
#define __restrict__ __restrict

struct EmuDim {
    unsigned x;
};
extern thread_local EmuDim threadIdx;
extern thread_local EmuDim blockIdx;
extern EmuDim blockDim;

struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};

template <class To, class From>
inline To emu_bits(From f) {
    static_assert(sizeof(To) == sizeof(From), "size");
    To t;
    memcpy(&t, &f, sizeof t);
    return t;
}
inline unsigned __float_as_uint(float f) { return emu_bits<unsigned>(f); }
inline float __uint_as_float(unsigned u) { return emu_bits<float>(u); }
inline float __int_as_float(int i) { return emu_bits<float>(i); }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline int __float2int_rn(float x) { return (int)nearbyintf(x); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return std::sqrt(a); }
inline float __double2float_rn(double d) { return (float)d; }
// The PTX cvt of fp16 (run.py substitutes these for quant.cu's inline asm).
inline float emu_h2f(unsigned short h) { return _cvtsh_ss(h); }
inline unsigned short emu_f2h(float f) { return (unsigned short)_cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }

// Vector accesses: quant.cu's reinterpret_casts, with the alignment the GPU requires checked.
template <class P, class Q>
inline P emu_cast(Q* q) {
    using T = std::remove_cv_t<std::remove_pointer_t<P>>;
    if (reinterpret_cast<uintptr_t>(q) % alignof(T)) {
        fprintf(stderr, "emu: misaligned %zu-byte vector access at %p\n", alignof(T), (const void*)q);
        abort();
    }
    return reinterpret_cast<P>(q);
}

// Synchronisation (only in kernels launched with real threads).
extern std::barrier<>* emu_block_barrier;
extern std::vector<std::unique_ptr<std::barrier<>>> emu_warp_barriers;
extern uint64_t emu_warp_slots[32][32];

inline void __syncthreads() { emu_block_barrier->arrive_and_wait(); }

template <class T>
inline T emu_shuffle(unsigned mask, T v, int src_of_lane_xor, int down) {
    static_assert(sizeof(T) <= 8, "shuffled value too wide");
    if (mask != 0xffffffffu) {
        fprintf(stderr, "emu: partial shuffle masks are not emulated\n");
        abort();
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    memcpy(&emu_warp_slots[warp][lane], &v, sizeof(T));
    emu_warp_barriers[warp]->arrive_and_wait();
    const int src = down ? lane + src_of_lane_xor : lane ^ src_of_lane_xor;
    T r = v;  // __shfl_down_sync: a source past the warp leaves the value as it is
    if (src < 32) memcpy(&r, &emu_warp_slots[warp][src], sizeof(T));
    emu_warp_barriers[warp]->arrive_and_wait();
    return r;
}
template <class T>
inline T __shfl_xor_sync(unsigned mask, T v, int o) { return emu_shuffle(mask, v, o, 0); }
template <class T>
inline T __shfl_down_sync(unsigned mask, T v, unsigned d) { return emu_shuffle(mask, v, (int)d, 1); }
