// Launcher of the emulated kernels (see emu.h): emu_launch(name, grid, block, args, types, nargs)
// runs kernel `name` (a name expression of zpp/quant/cuda.py) with the arguments' addresses in
// args and their numpy type codes in types; it checks the count and the types of the arguments
// against the kernel's C++ signature and the block size against its launch bounds.
#include "emu.h"

#include <functional>
#include <map>
#include <string>
#include <thread>
#include <utility>

thread_local EmuDim threadIdx, blockIdx;
EmuDim blockDim;
std::barrier<>* emu_block_barrier;
std::vector<std::unique_ptr<std::barrier<>>> emu_warp_barriers;
uint64_t emu_warp_slots[32][32];

#include "quant_host.cu"  // cuda/quant.cu, rewritten by run.py

namespace {

// numpy type code of each kernel parameter type: pointers are passed as uint64.
template <class A>
constexpr char code_of() {
    if constexpr (std::is_pointer_v<A>) return 'P';
    else if constexpr (std::is_same_v<A, long long>) return 'q';
    else if constexpr (std::is_same_v<A, int>) return 'i';
    else if constexpr (std::is_same_v<A, unsigned>) return 'I';
    else if constexpr (std::is_same_v<A, float>) return 'f';
    else return '?';
}

template <class A>
A arg_at(void* p) {
    if constexpr (std::is_pointer_v<A>) return reinterpret_cast<A>(static_cast<uintptr_t>(*static_cast<uint64_t*>(p)));
    else return *static_cast<A*>(p);
}

struct Entry {
    std::string types;
    bool threads;        // the kernel synchronises: run a block's threads concurrently
    unsigned max_block;  // its __launch_bounds__
    std::function<void(void**)> call;
};

template <class... A, size_t... I>
void call_with(void (*fn)(A...), void** args, std::index_sequence<I...>) {
    fn(arg_at<A>(args[I])...);
}

template <class... A>
Entry entry(void (*fn)(A...), bool threads, unsigned max_block) {
    return Entry{std::string{code_of<A>()...}, threads, max_block,
                 [fn](void** args) { call_with(fn, args, std::index_sequence_for<A...>{}); }};
}

std::map<std::string, Entry> table() {
    std::map<std::string, Entry> t;
#define EMU_TYPED(T, TN)                                                                                  \
    t[std::string("zq_quantize<") + TN + ", 1>"] = entry(zq_quantize<T, 1>, true, 512);                  \
    t[std::string("zq_quantize<") + TN + ", 4>"] = entry(zq_quantize<T, 4>, true, 512);                  \
    t[std::string("zq_swizzle_quantize<") + TN + ", 1>"] = entry(zq_swizzle_quantize<T, 1>, true, 512);  \
    t[std::string("zq_swizzle_quantize<") + TN + ", 4>"] = entry(zq_swizzle_quantize<T, 4>, true, 512);  \
    t[std::string("zq_dequant_sum<") + TN + ">"] = entry(zq_dequant_sum<T>, false, 256);                 \
    t[std::string("zq_pack_signs<") + TN + ">"] = entry(zq_pack_signs<T>, false, 256);                   \
    t[std::string("zq_unpack_scaled<") + TN + ">"] = entry(zq_unpack_scaled<T>, false, 256);             \
    t[std::string("zq_onebit_sumsq<") + TN + ">"] = entry(zq_onebit_sumsq<T>, true, ZQ_SUMSQ_THREADS);
    EMU_TYPED(float, "float")
    EMU_TYPED(zq_half, "zq_half")
    EMU_TYPED(zq_bf16, "zq_bf16")
#undef EMU_TYPED
    t["zq_requant_sum<1>"] = entry(zq_requant_sum<1>, true, 512);
    t["zq_requant_sum<4>"] = entry(zq_requant_sum<4>, true, 512);
    t["zq_signs_weighted_sum"] = entry(zq_signs_weighted_sum, false, 256);
    t["zq_onebit_scale"] = entry(zq_onebit_scale, true, ZQ_SUMSQ_THREADS);
    return t;
}

const std::map<std::string, Entry>& kernels() {
    static const std::map<std::string, Entry> t = table();
    return t;
}

void run_block(const Entry& k, unsigned b, unsigned block, void** args) {
    if (!k.threads) {
        for (unsigned t = 0; t < block; ++t) {
            blockIdx.x = b;
            threadIdx.x = t;
            k.call(args);
        }
        return;
    }
    std::barrier<> bar(block);
    emu_block_barrier = &bar;
    emu_warp_barriers.clear();
    for (unsigned w = 0; w < block / 32; ++w) emu_warp_barriers.emplace_back(new std::barrier<>(32));
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < block; ++t)
        threads.emplace_back([&, t] {
            blockIdx.x = b;
            threadIdx.x = t;
            k.call(args);
        });
    for (auto& th : threads) th.join();
}

}  // namespace

extern "C" int emu_has(const char* name) { return kernels().count(name) ? 1 : 0; }

extern "C" int emu_launch(const char* name, unsigned grid, unsigned block, void** args, const char* types) {
    const auto it = kernels().find(name);
    if (it == kernels().end()) {
        fprintf(stderr, "emu: no kernel %s\n", name);
        return 1;
    }
    const Entry& k = it->second;
    if (k.types != types) {
        fprintf(stderr, "emu: %s takes arguments of types %s, launched with %s\n", name, k.types.c_str(), types);
        return 2;
    }
    if (block == 0 || block > k.max_block || (k.threads && block % 32)) {
        fprintf(stderr, "emu: %s launched with %u threads a block (at most %u)\n", name, block, k.max_block);
        return 3;
    }
    blockDim.x = block;
    for (unsigned b = 0; b < grid; ++b) run_block(k, b, block, args);
    return 0;
}
