// Runs sluice's CUDA kernels (kernels/*.cu, the very sources NVRTC compiles) on the CPU, so
// that machines without a GPU execute them: each CUDA thread of a block is a fiber
// (ucontext), all on one OS thread; __syncthreads is a barrier of the block's fibers and
// __shfl_xor_sync exchanges through a per-warp slot between two warp barriers. Blocks run
// one after another, so `__shared__` variables can be plain statics. Device memory is host
// memory. What it checks is the kernels' arithmetic and indexing (every thread runs the
// kernel's code), not the GPU's timing or memory model; tests/tests/cuda_emulated.rs
// drives it and compares with the CPU backend.
//
// It is built to find what the GPU would not say: every __ldg (the kernels' vector loads
// included) checks its address is aligned to its type; buffers are allocated without slack
// (an overrun is AddressSanitizer's, which the test build enables with UBSan); shared
// memory, static and dynamic, is filled with 0xFF bytes (NaN as a float) before each block,
// so a read before a write shows; and each round of a block's scheduling runs its threads
// in a seeded shuffled order (SLUICE_EMU_SEED, default 1), so a missing barrier shows as
// a changed result rather than hiding behind thread 0 always going first.
//
// Input (stdin), one command a line:
//   load ID PATH            buffer ID = the bytes of PATH (64-byte aligned)
//   zeros ID BYTES          buffer ID = BYTES zero bytes
//   addrs ID ARG...         buffer ID = the host addresses of buffer args (u64 each)
//   launch NAME GX GY GZ BLOCK ARG...   (an ARG smem:BYTES: the dynamic shared memory)
//   save ID PATH            writes buffer ID to PATH
// ARG: bID+OFFSET (a buffer's address plus a byte offset), i:INT, f:FLOAT, u:U64, null.
// Compile: g++ -std=c++20 -O2 -ffp-contract=off -I kernels tests/emulator/cuda_emu.cpp
//          [-fsanitize=address,undefined]

#include <ucontext.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#define SLUICE_EMULATE 1
#define __device__
#define __global__
#define __forceinline__ inline
// Every static shared variable in one section, which the launcher fills before each block
// (the linker names its bounds __start_/__stop_emu_shared).
#define __shared__ static __attribute__((section("emu_shared")))
extern "C" char __start_emu_shared[] __attribute__((weak)), __stop_emu_shared[] __attribute__((weak));
#define __constant__ static
#define __launch_bounds__(...)
#define __expf sluice_emu_expf

struct dim3_ {
    unsigned x = 1, y = 1, z = 1;
};
static dim3_ threadIdx, blockIdx, blockDim, gridDim;

struct alignas(16) float4 {
    float x, y, z, w;
};
struct alignas(8) uint2 {
    unsigned x, y;
};
struct alignas(16) uint4 {
    unsigned x, y, z, w;
};

// Through memcpy: g++ merges a kernel's vector and scalar paths over the same bytes into
// one aligned vector load, which faults where the kernel took the scalar path.
template <typename T>
static inline T __ldg(const T* p) {
    if ((uintptr_t)p % alignof(T) != 0) {
        fprintf(stderr, "emu: __ldg of a %zu-byte type at %p, which is not %zu-byte aligned (block %u, thread %u)\n",
                sizeof(T), (const void*)p, alignof(T), blockIdx.x, threadIdx.x);
        abort();
    }
    T v;
    memcpy(&v, p, sizeof(T));
    return v;
}
static inline float __fmul_rn(float a, float b) { return a * b; }
static inline float __fadd_rn(float a, float b) { return a + b; }
static inline float __fsub_rn(float a, float b) { return a - b; }
static inline float sluice_emu_expf(float x) { return expf(x); }
static inline int min(int a, int b) { return a < b ? a : b; }
static inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
static inline float __int_as_float(int i) {
    float f;
    memcpy(&f, &i, 4);
    return f;
}
static inline float __uint_as_float(unsigned i) {
    float f;
    memcpy(&f, &i, 4);
    return f;
}
static inline unsigned __float_as_uint(float f) {
    unsigned i;
    memcpy(&i, &f, 4);
    return i;
}
static inline float f16_to_f32(unsigned short h) {
    _Float16 f;
    memcpy(&f, &h, 2);
    return (float)f;
}
static inline unsigned short f32_to_f16_bits(float f) {
    _Float16 h = (_Float16)f;
    unsigned short b;
    memcpy(&b, &h, 2);
    return b;
}

// ---- fibers ----
namespace emu {
struct Fiber {
    ucontext_t ctx;
    std::vector<char> stack;
    bool done = false;
};
#if defined(__SANITIZE_ADDRESS__)
// AddressSanitizer is told of each switch between the scheduler's stack and a fiber's.
extern "C" void __sanitizer_start_switch_fiber(void** fake, const void* bottom, size_t size);
extern "C" void __sanitizer_finish_switch_fiber(void* fake, const void** bottom, size_t* size);
static const size_t STACK = 512 << 10;
#else
static inline void __sanitizer_start_switch_fiber(void**, const void*, size_t) {}
static inline void __sanitizer_finish_switch_fiber(void*, const void**, size_t*) {}
static const size_t STACK = 64 << 10;
#endif
static const void* sched_bottom = nullptr;
static size_t sched_size = 0;
static std::mt19937 order_rng;
static std::vector<Fiber> fibers;
static ucontext_t sched;
static int cur = 0;
static std::function<void()> body;
static int block_arrived = 0, block_gen = 0;
static int warp_arrived[32], warp_gen[32];
static uint64_t warp_slot[32][32];
static std::vector<uint64_t> dyn_smem;
static int alive = 0;

static void yield() {
    __sanitizer_start_switch_fiber(nullptr, sched_bottom, sched_size);
    swapcontext(&fibers[cur].ctx, &sched);
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
    threadIdx.x = (unsigned)cur;
}

static void entry() {
    __sanitizer_finish_switch_fiber(nullptr, &sched_bottom, &sched_size);
    body();
    fibers[cur].done = true;
    alive--;
    // Returning resumes `sched` (uc_link); the fiber's stack is not used again.
    __sanitizer_start_switch_fiber(nullptr, sched_bottom, sched_size);
}

static void barrier(int& arrived, int& gen, int parties) {
    const int g = gen;
    if (++arrived >= parties) {
        arrived = 0;
        gen++;
        return;
    }
    while (gen == g) yield();
}

static void warp_barrier() {
    const int w = (int)threadIdx.x / 32;
    const int lanes = std::min(32, (int)blockDim.x - 32 * w);
    barrier(warp_arrived[w], warp_gen[w], lanes);
}

// Runs `kernel` over the grid, blocks in order, each block's threads as fibers.
static void launch(dim3_ grid, unsigned block, const std::function<void()>& kernel) {
    if (block == 0 || block > 1024) {
        fprintf(stderr, "emu: block of %u threads\n", block);
        exit(2);
    }
    gridDim = grid;
    blockDim = dim3_{block, 1, 1};
    fibers.resize(block);
    for (auto& f : fibers)
        if (f.stack.empty()) f.stack.resize(STACK);
    std::vector<unsigned> order(block);
    for (unsigned t = 0; t < block; t++) order[t] = t;
    body = kernel;
    for (unsigned z = 0; z < grid.z; z++)
        for (unsigned y = 0; y < grid.y; y++)
            for (unsigned x = 0; x < grid.x; x++) {
                blockIdx = dim3_{x, y, z};
                block_arrived = 0;
                memset(warp_arrived, 0, sizeof warp_arrived);
                alive = (int)block;
                // What a block finds in shared memory is not what the last one left.
                if (__start_emu_shared != __stop_emu_shared)
                    memset(__start_emu_shared, 0xFF, (size_t)(__stop_emu_shared - __start_emu_shared));
                if (!dyn_smem.empty()) memset(dyn_smem.data(), 0xFF, dyn_smem.size() * sizeof(uint64_t));
                for (unsigned t = 0; t < block; t++) {
                    Fiber& f = fibers[t];
                    f.done = false;
                    getcontext(&f.ctx);
                    f.ctx.uc_stack.ss_sp = f.stack.data();
                    f.ctx.uc_stack.ss_size = f.stack.size();
                    f.ctx.uc_link = &sched;
                    makecontext(&f.ctx, entry, 0);
                }
                while (alive > 0) {
                    std::shuffle(order.begin(), order.end(), order_rng);
                    for (unsigned t : order) {
                        if (fibers[t].done) continue;
                        cur = (int)t;
                        threadIdx.x = t;
                        void* fake = nullptr;
                        __sanitizer_start_switch_fiber(&fake, fibers[t].stack.data(), fibers[t].stack.size());
                        swapcontext(&sched, &fibers[t].ctx);
                        __sanitizer_finish_switch_fiber(fake, nullptr, nullptr);
                    }
                }
            }
}
}  // namespace emu

static inline void __syncthreads() { emu::barrier(emu::block_arrived, emu::block_gen, emu::alive); }
static inline void __syncwarp() { emu::warp_barrier(); }
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
static inline int __ffsll(long long x) { return __builtin_ffsll(x); }
template <typename T>
static inline T __shfl_xor_sync(unsigned, T v, int o) {
    static_assert(sizeof(T) <= sizeof(uint64_t), "a shuffled value fits a slot");
    const int t = (int)threadIdx.x, w = t / 32, l = t % 32;
    memcpy(&emu::warp_slot[w][l], &v, sizeof(T));
    emu::warp_barrier();
    T r;
    memcpy(&r, &emu::warp_slot[w][l ^ o], sizeof(T));
    emu::warp_barrier();
    return r;
}
// A kernel's dynamic shared memory: the launch's `smem:BYTES` argument.
#define DYNAMIC_SHARED(type, name) type* name = (type*)emu::dyn_smem.data()

#include "matmul_q.cu"
#include "matmul_k.cu"
#include "attention.cu"
#include "embedding.cu"
#include "rms_norm.cu"
#include "rope.cu"
#include "kv_store.cu"
#include "silu_mul.cu"
#include "add.cu"
#include "moe.cu"
#include "convert.cu"

// ---- the command interpreter ----
struct Buf {
    void* p = nullptr;
    size_t len = 0;
};
static std::map<int, Buf> bufs;

static Buf alloc(size_t len) {
    Buf b;
    b.len = len;
    // No slack past `len`: an overrun is outside the allocation (AddressSanitizer's to
    // catch in the test build).
    if (posix_memalign(&b.p, 64, len ? len : 1) != 0) {
        fprintf(stderr, "emu: out of memory for %zu bytes\n", len);
        exit(2);
    }
    memset(b.p, 0, len);
    return b;
}

// Buffer `id` is now `b` (what it was is freed).
static void put(int id, Buf b) {
    auto it = bufs.find(id);
    if (it != bufs.end()) free(it->second.p);
    bufs[id] = b;
}

struct Arg {
    uint64_t v = 0;
};

static Arg parse_arg(const std::string& s) {
    Arg a;
    if (s == "null") return a;
    if (s[0] == 'b') {
        const size_t plus = s.find('+');
        const int id = std::stoi(s.substr(1, plus - 1));
        const uint64_t off = plus == std::string::npos ? 0 : std::stoull(s.substr(plus + 1));
        auto it = bufs.find(id);
        if (it == bufs.end()) {
            fprintf(stderr, "emu: no buffer %d\n", id);
            exit(2);
        }
        a.v = (uint64_t)(uintptr_t)it->second.p + off;
    } else if (s.rfind("i:", 0) == 0) {
        a.v = (uint64_t)(int64_t)std::stoll(s.substr(2));
    } else if (s.rfind("u:", 0) == 0) {
        a.v = std::stoull(s.substr(2));
    } else if (s.rfind("f:", 0) == 0) {
        const float f = std::stof(s.substr(2));
        unsigned u;
        memcpy(&u, &f, 4);
        a.v = u;
    } else {
        fprintf(stderr, "emu: bad argument %s\n", s.c_str());
        exit(2);
    }
    return a;
}

template <typename T>
static T P(const Arg& a) {
    return (T)(uintptr_t)a.v;
}
static int I(const Arg& a) { return (int)(int64_t)a.v; }
static float F(const Arg& a) {
    float f;
    const unsigned u = (unsigned)a.v;
    memcpy(&f, &u, 4);
    return f;
}

using Launcher = std::function<void(const std::vector<Arg>&)>;
static std::map<std::string, std::pair<size_t, Launcher>> kernels() {
    std::map<std::string, std::pair<size_t, Launcher>> k;
#define GEMV(name)                                                                                      \
    k[#name] = {6, [](const std::vector<Arg>& a) {                                                      \
                    name(P<const u8*>(a[0]), P<const float*>(a[1]), P<float*>(a[2]), I(a[3]), I(a[4]),  \
                         I(a[5]));                                                                      \
                }};
#define GROUPED(name)                                                                                     \
    k[#name] = {7, [](const std::vector<Arg>& a) {                                                        \
                    name(P<const unsigned long long*>(a[0]), P<const u32*>(a[1]), P<const float*>(a[2]), \
                         P<float*>(a[3]), I(a[4]), I(a[5]), I(a[6]));                                     \
                }};
#define GEMV1(name)                                                                                     \
    k[#name] = {5, [](const std::vector<Arg>& a) {                                                      \
                    name(P<const u8*>(a[0]), P<const float*>(a[1]), P<float*>(a[2]), I(a[3]), I(a[4])); \
                }};
#define FORMAT(n) GEMV(gemv_##n) GEMV1(gemv1_##n) GROUPED(gemv_grouped_##n) GROUPED(gemv1_grouped_##n)
    FORMAT(f32) FORMAT(f16) FORMAT(bf16) FORMAT(q8_0) FORMAT(q4_0) FORMAT(q4_1) FORMAT(q5_0) FORMAT(q5_1)
    FORMAT(q2_k) FORMAT(q3_k) FORMAT(q4_k) FORMAT(q5_k) FORMAT(q6_k) FORMAT(iq4_nl) FORMAT(iq4_xs)
    FORMAT(mxfp4)
#define DEQUANT(n)                                                                                    \
    k["dequant_" #n] = {3, [](const std::vector<Arg>& a) {                                            \
                            dequant_##n(P<const u8*>(a[0]), P<float*>(a[1]), (unsigned long long)a[2].v); \
                        }};
#define EMBED(n)                                                                                          \
    k["embedding_" #n] = {4, [](const std::vector<Arg>& a) {                                              \
                              embedding_##n(P<const u8*>(a[0]), P<const u32*>(a[1]), P<float*>(a[2]), I(a[3])); \
                          }};
    DEQUANT(f16) DEQUANT(bf16) DEQUANT(q8_0) DEQUANT(q4_0) DEQUANT(q4_1) DEQUANT(q5_0) DEQUANT(q5_1)
    DEQUANT(q2_k) DEQUANT(q3_k) DEQUANT(q4_k) DEQUANT(q5_k) DEQUANT(q6_k) DEQUANT(iq4_nl) DEQUANT(iq4_xs)
    DEQUANT(mxfp4)
    EMBED(f32) EMBED(f16) EMBED(bf16) EMBED(q8_0) EMBED(q4_0) EMBED(q4_1) EMBED(q5_0) EMBED(q5_1) EMBED(q2_k)
    EMBED(q3_k) EMBED(q4_k) EMBED(q5_k) EMBED(q6_k) EMBED(iq4_nl) EMBED(iq4_xs) EMBED(mxfp4)
#define NORM(n)                                                                                      \
    k["rms_norm_" #n] = {5, [](const std::vector<Arg>& a) {                                          \
                             rms_norm_##n(P<const float*>(a[0]), P<const u8*>(a[1]), P<float*>(a[2]), I(a[3]), \
                                          F(a[4]));                                                  \
                         }};
    NORM(f32) NORM(f16) NORM(bf16)
    k["rope_f32"] = {5, [](const std::vector<Arg>& a) {
                         rope_f32(P<float*>(a[0]), P<const float*>(a[1]), P<const u32*>(a[2]), I(a[3]), I(a[4]));
                     }};
    k["kv_store_f32"] = {6, [](const std::vector<Arg>& a) {
                             kv_store_f32(P<const float*>(a[0]), P<const float*>(a[1]), P<float*>(a[2]),
                                          P<float*>(a[3]), P<const unsigned long long*>(a[4]), I(a[5]));
                         }};
    k["kv_store_f16"] = {6, [](const std::vector<Arg>& a) {
                             kv_store_f16(P<const float*>(a[0]), P<const float*>(a[1]), P<u16*>(a[2]), P<u16*>(a[3]),
                                          P<const unsigned long long*>(a[4]), I(a[5]));
                         }};
#define ELEMENTWISE(n) \
    k[#n] = {3, [](const std::vector<Arg>& a) { n(P<float*>(a[0]), P<const float*>(a[1]), I(a[2])); }};
    ELEMENTWISE(silu_mul_f32) ELEMENTWISE(gelu_mul_f32) ELEMENTWISE(add_f32)
    k["swiglu_clamp_mul_f32"] = {5, [](const std::vector<Arg>& a) {
                                     swiglu_clamp_mul_f32(P<float*>(a[0]), P<const float*>(a[1]), I(a[2]), F(a[3]),
                                                          F(a[4]));
                                 }};
    k["scale_f32"] = {3, [](const std::vector<Arg>& a) { scale_f32(P<float*>(a[0]), F(a[1]), I(a[2])); }};
    k["add_bias_f32"] = {4, [](const std::vector<Arg>& a) {
                             add_bias_f32(P<float*>(a[0]), P<const float*>(a[1]), I(a[2]), I(a[3]));
                         }};
    k["f32_to_bf16"] = {3, [](const std::vector<Arg>& a) {
                            f32_to_bf16(P<const float*>(a[0]), P<u16*>(a[1]), (unsigned long long)a[2].v);
                        }};
    k["gather_rows_f32"] = {4, [](const std::vector<Arg>& a) {
                                gather_rows_f32(P<const float*>(a[0]), P<const u32*>(a[1]), P<float*>(a[2]), I(a[3]));
                            }};
    k["scatter_add_rows_f32"] = {5, [](const std::vector<Arg>& a) {
                                     scatter_add_rows_f32(P<const float*>(a[0]), P<const u32*>(a[1]),
                                                          P<const float*>(a[2]), P<float*>(a[3]), I(a[4]));
                                 }};
    k["add_bias_grouped_f32"] = {4, [](const std::vector<Arg>& a) {
                                     add_bias_grouped_f32(P<float*>(a[0]), P<const unsigned long long*>(a[1]), I(a[2]),
                                                          I(a[3]));
                                 }};
    k["combine_rows_f32"] = {7, [](const std::vector<Arg>& a) {
                                 combine_rows_f32(P<const float*>(a[0]), P<const u32*>(a[1]), P<const u32*>(a[2]),
                                                  P<const u32*>(a[3]), P<const float*>(a[4]), P<float*>(a[5]), I(a[6]));
                             }};
    k["router_topk_f32"] = {7, [](const std::vector<Arg>& a) {
                                router_topk_f32(P<const float*>(a[0]), P<u32*>(a[1]), P<float*>(a[2]), I(a[3]), I(a[4]),
                                                I(a[5]), I(a[6]));
                            }};
#define ATTENTION_PART_K(n)                                                                              \
    k[#n] = {15, [](const std::vector<Arg>& a) {                                                           \
                 n(P<const float*>(a[0]), P<const void*>(a[1]), P<const void*>(a[2]), P<float*>(a[3]),     \
                   P<const u32*>(a[4]), P<const unsigned long long*>(a[5]),                                 \
                   P<const unsigned long long*>(a[6]), I(a[7]), I(a[8]), I(a[9]), F(a[10]), I(a[11]),       \
                   I(a[12]), I(a[13]), I(a[14]));                                                           \
             }};
    ATTENTION_PART_K(attention_part_f32) ATTENTION_PART_K(attention_part_f16)
    k["attention_combine_f32"] = {9, [](const std::vector<Arg>& a) {
                                      attention_combine_f32(P<const float*>(a[0]), P<float*>(a[1]),
                                                            P<const u32*>(a[2]), I(a[3]), I(a[4]), I(a[5]), I(a[6]),
                                                            I(a[7]), P<const float*>(a[8]));
                                  }};
    return k;
}

int main() {
    const char* seed = getenv("SLUICE_EMU_SEED");
    emu::order_rng.seed(seed ? (unsigned)strtoul(seed, nullptr, 10) : 1u);
    const auto table = kernels();
    std::string line;
    int n = 0;
    while (std::getline(std::cin, line)) {
        n++;
        std::istringstream in(line);
        std::string cmd;
        if (!(in >> cmd)) continue;
        if (cmd == "load") {
            int id;
            std::string path;
            in >> id >> path;
            std::ifstream f(path, std::ios::binary);
            std::vector<char> data((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
            if (!f.good() && !f.eof()) {
                fprintf(stderr, "emu: line %d: cannot read %s\n", n, path.c_str());
                return 2;
            }
            Buf b = alloc(data.size());
            memcpy(b.p, data.data(), data.size());
            put(id, b);
        } else if (cmd == "zeros") {
            int id;
            size_t bytes;
            in >> id >> bytes;
            put(id, alloc(bytes));
        } else if (cmd == "addrs") {
            int id;
            in >> id;
            std::vector<uint64_t> v;
            std::string a;
            while (in >> a) v.push_back(parse_arg(a).v);
            Buf b = alloc(v.size() * 8);
            memcpy(b.p, v.data(), v.size() * 8);
            put(id, b);
        } else if (cmd == "launch") {
            std::string name;
            dim3_ g;
            unsigned block;
            in >> name >> g.x >> g.y >> g.z >> block;
            std::vector<Arg> args;
            std::string a;
            size_t smem = 0;
            while (in >> a) {
                if (a.rfind("smem:", 0) == 0)
                    smem = std::stoull(a.substr(5));
                else
                    args.push_back(parse_arg(a));
            }
            emu::dyn_smem.assign((smem + 7) / 8, 0);
            auto it = table.find(name);
            if (it == table.end()) {
                fprintf(stderr, "emu: line %d: unknown kernel %s\n", n, name.c_str());
                return 2;
            }
            if (args.size() != it->second.first) {
                fprintf(stderr, "emu: line %d: %s takes %zu arguments, got %zu\n", n, name.c_str(),
                        it->second.first, args.size());
                return 2;
            }
            const Launcher& l = it->second.second;
            emu::launch(g, block, [&]() { l(args); });
        } else if (cmd == "save") {
            int id;
            std::string path;
            in >> id >> path;
            const Buf& b = bufs.at(id);
            std::ofstream f(path, std::ios::binary);
            f.write((const char*)b.p, (std::streamsize)b.len);
            if (!f) {
                fprintf(stderr, "emu: line %d: cannot write %s\n", n, path.c_str());
                return 2;
            }
        } else {
            fprintf(stderr, "emu: line %d: unknown command %s\n", n, cmd.c_str());
            return 2;
        }
    }
    for (auto& [id, b] : bufs) free(b.p);
    return 0;
}
