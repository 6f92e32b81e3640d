// The CUDA C dialect lantern's kernels use, for a C++ compiler on the host: included
// before a kernel source when the CUDA emulator (emulator.cpp) "compiles" it. Each thread
// of a block is a fiber with its own stack; __syncthreads and the warp shuffles switch
// between them, so barriers behave as on a GPU (a barrier some threads never reach is
// reported as a deadlock). Blocks run one after another on the launching thread; the
// driver runs one launch at a time, so the state below is plain globals.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/mman.h>
#include <type_traits>
#include <utility>
#include <vector>

#ifdef LT_EMU_PASS1
#define __global__ LT_EMU_KERNEL  // marks kernels for the emulator to find after preprocessing
#else
#define __global__
#endif
#define __device__
#define __host__
#define __forceinline__ inline __attribute__((always_inline))
#define __restrict__ __restrict
#define __align__(n) alignas(n)
#define __launch_bounds__(...)
// Shared memory is the block's: the driver runs one launch at a time and a launch's blocks
// one after another, so plain statics serve (no thread-local lookups in the kernels).
#define __shared__ static
// kernels/prelude.cu's lt_grid_dependency calls lt_emu::grid_dependency here.
#define LT_CUDA_EMULATOR 1

namespace lt_emu {

struct uint3 {
    unsigned x, y, z;
};

enum class State { Ready, WaitBlock, WaitWarp, Done };

struct Fiber {
    void* sp;  // null until the fiber first runs
    uint3 tid;
    unsigned index, warp, lane, stack;
    unsigned turn;  // its place in the order the block's fibers take turns in
    unsigned shuffles;  // warp shuffles this thread made: which of two buffers the next uses
    State state;
    unsigned long wait_gen;
};

// What the driver hands a module's entry point (the same struct in emulator.cpp).
struct Launch {
    unsigned grid[3];
    unsigned block[3];
    unsigned shared_bytes;
    void** params;
    char* error;  // 512 bytes: a message when the launch fails
    // Launched to overlap the kernel before it (programmatic dependent launch): every
    // thread must then call lt_grid_dependency (kernels/prelude.cu).
    unsigned programmatic;
};

constexpr unsigned kMaxThreads = 1024;
constexpr unsigned kWarps = kMaxThreads / 32;
constexpr size_t kStackBytes = 32 << 10;

struct Block {
    uint3 bid, bdim, gdim;
    Fiber fibers[kMaxThreads];
    unsigned n;
    unsigned live;
    unsigned block_arrived;
    unsigned long block_gen;
    unsigned warp_live[kWarps];
    unsigned warp_arrived[kWarps];
    unsigned long warp_gen[kWarps];
    unsigned long long shuffle[2][kWarps][32];
    unsigned char* dynamic_shared;
    // Stacks not held by a started fiber, the last freed on top: a block whose threads
    // never wait runs them all on one stack, warm in the cache.
    unsigned free_stacks[kMaxThreads];
    unsigned free_count;
    // turns[t]: the fiber whose turn is t-th (see run_order).
    unsigned turns[kMaxThreads];
    bool deadlock;
    unsigned grid_waits;  // threads that called lt_grid_dependency
    void (*body)(void*);
    void* body_arg;
};

// The running fiber and block, and the launching thread's stack while fibers run.
inline Fiber* cur = nullptr;
inline Block* blk = nullptr;
inline void* scheduler_sp = nullptr;
inline unsigned char* stacks = nullptr;

extern "C" void lt_emu_switch(void** save_sp, void* load_sp);
extern "C" void lt_emu_fiber_start();

// Saves the callee-saved registers on the current stack, stores the stack pointer in
// *save_sp, and resumes the stack at load_sp. (Kernels leave MXCSR and the x87 control
// word alone, so they are not switched.)
asm(R"(
    .text
    .globl lt_emu_switch
    .hidden lt_emu_switch
    .type lt_emu_switch,@function
lt_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret

    .globl lt_emu_fiber_start
    .hidden lt_emu_fiber_start
    .type lt_emu_fiber_start,@function
lt_emu_fiber_start:
    call lt_emu_fiber_main
    ud2
)");

inline bool runnable(const Block& b, const Fiber& f) {
    switch (f.state) {
        case State::Ready: return true;
        case State::WaitBlock: return b.block_gen != f.wait_gen;
        case State::WaitWarp: return b.warp_gen[f.warp] != f.wait_gen;
        case State::Done: return false;
    }
    return false;
}

inline void prepare_stack(Fiber& f, unsigned char* stack_top);

// The next runnable fiber from turn `from` on (cyclically), started on a free stack
// if it has not run yet; null when none can run.
inline Fiber* next_runnable(Block& b, unsigned from) {
    for (unsigned k = 0; k < b.n; k++) {
        Fiber& f = b.fibers[b.turns[(from + k) % b.n]];
        if (!runnable(b, f)) continue;
        if (!f.sp) {
            f.stack = b.free_stacks[--b.free_count];
            prepare_stack(f, stacks + (size_t(f.stack) + 1) * kStackBytes);
        }
        return &f;
    }
    return nullptr;
}

// The current fiber waits: the thread goes to the next runnable fiber after it (itself
// last), or back to the launching stack, with a deadlock, when none can run.
inline void switch_away() {
    Block& b = *blk;
    Fiber* self = cur;
    Fiber* f = next_runnable(b, self->turn + 1);
    if (f == self) return;
    if (!f) {
        b.deadlock = true;
        lt_emu_switch(&self->sp, scheduler_sp);
        return;
    }
    cur = f;
    lt_emu_switch(&self->sp, f->sp);
}

inline void release_if_complete(Block& b, unsigned warp) {
    if (b.block_arrived > 0 && b.block_arrived == b.live) {
        b.block_arrived = 0;
        b.block_gen++;
    }
    if (b.warp_arrived[warp] > 0 && b.warp_arrived[warp] == b.warp_live[warp]) {
        b.warp_arrived[warp] = 0;
        b.warp_gen[warp]++;
    }
}

// The current fiber arrives at a barrier (`arrived`, released by bumping `gen`): the last
// to arrive goes on, the others wait (as `waiting`) until it does.
inline void arrive(unsigned& arrived, const unsigned long& gen, State waiting) {
    Fiber* f = cur;
    const unsigned long at = gen;
    arrived++;
    release_if_complete(*blk, f->warp);
    if (gen != at) return;
    f->state = waiting;
    f->wait_gen = at;
    switch_away();
    f->state = State::Ready;
}

inline void syncthreads() { arrive(blk->block_arrived, blk->block_gen, State::WaitBlock); }

inline void syncwarp() {
    const unsigned w = cur->warp;
    arrive(blk->warp_arrived[w], blk->warp_gen[w], State::WaitWarp);
}

template <typename T>
T shfl_xor(unsigned mask, T v, int lane_mask) {
    (void)mask;
    static_assert(sizeof(T) <= 8, "a shuffled value is at most 8 bytes");
    Block& b = *blk;
    Fiber* f = cur;
    unsigned long long bits = 0;
    std::memcpy(&bits, &v, sizeof(T));
    // Shuffles alternate between two buffers, so one barrier each suffices: a lane that
    // writes the next-but-one shuffle's value has passed the next one's barrier, which
    // every lane reaches only after reading this one.
    auto& buffer = b.shuffle[f->shuffles++ & 1][f->warp];
    buffer[f->lane] = bits;
    syncwarp();
    bits = buffer[(f->lane ^ (unsigned)lane_mask) & 31u];
    T r;
    std::memcpy(&r, &bits, sizeof(T));
    return r;
}

extern "C" __attribute__((used, visibility("hidden"))) void lt_emu_fiber_main() {
    Block& b = *blk;
    b.body(b.body_arg);
    Fiber* f = cur;
    f->state = State::Done;
    b.live--;
    b.warp_live[f->warp]--;
    release_if_complete(b, f->warp);
    // Back to the launching stack, which frees this fiber's stack and goes on.
    lt_emu_switch(&f->sp, scheduler_sp);
    __builtin_trap();
}

inline void prepare_stack(Fiber& f, unsigned char* stack_top) {
    uintptr_t top = reinterpret_cast<uintptr_t>(stack_top) & ~uintptr_t(15);
    auto slot = [&](int k) { return reinterpret_cast<uint64_t*>(top - 8 * k); };
    *slot(3) = reinterpret_cast<uint64_t>(&lt_emu_fiber_start);  // the return address
    for (int k = 4; k <= 9; k++) *slot(k) = 0;                    // rbp .. r15
    f.sp = slot(9);
}

// The order a block's threads take turns in between barriers, from
// LANTERN_CUDA_EMULATOR_ORDER: `forward` (by thread index, the default), `reverse`, or
// `shuffle` (a different seeded permutation per block). A kernel whose results change
// with the order has threads that race outside its barriers.
enum class Order { Forward, Reverse, Shuffle };
inline Order run_order() {
    static const Order order = [] {
        const char* v = std::getenv("LANTERN_CUDA_EMULATOR_ORDER");
        if (!v || !std::strcmp(v, "forward")) return Order::Forward;
        if (!std::strcmp(v, "reverse")) return Order::Reverse;
        return Order::Shuffle;
    }();
    return order;
}

inline void order_turns(Block& b, unsigned long long block_number) {
    const unsigned n = b.n;
    for (unsigned t = 0; t < n; t++) b.turns[t] = run_order() == Order::Reverse ? n - 1 - t : t;
    if (run_order() == Order::Shuffle) {
        unsigned long long state = 0x9e3779b97f4a7c15ull * (block_number + 1);
        for (unsigned t = n - 1; t > 0; t--) {
            state = state * 6364136223846793005ull + 1442695040888963407ull;
            const unsigned j = unsigned((state >> 33) % (t + 1));
            std::swap(b.turns[t], b.turns[j]);
        }
    }
    for (unsigned t = 0; t < n; t++) b.fibers[b.turns[t]].turn = t;
}

// Runs `body` for every thread of every block; false (and a message) on a deadlock.
inline bool run_grid(const Launch& l, void (*body)(void*), void* arg) {
    const unsigned n = l.block[0] * l.block[1] * l.block[2];
    if (n == 0 || n > kMaxThreads) {
        std::snprintf(l.error, 512, "a block of %u threads (1 to %u)", n, kMaxThreads);
        return false;
    }
    if (!stacks) {
        void* m = mmap(nullptr, kStackBytes * kMaxThreads, PROT_READ | PROT_WRITE,
                       MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) {
            std::snprintf(l.error, 512, "no memory for the fibers' stacks");
            return false;
        }
        stacks = static_cast<unsigned char*>(m);
        for (unsigned i = 0; i < kMaxThreads; i++) mprotect(stacks + i * kStackBytes, 4096, PROT_NONE);
    }
    static Block block;
    Block& b = block;
    std::vector<unsigned char> dynamic(l.shared_bytes + 16, 0xff);
    b.dynamic_shared = dynamic.data();
    b.bdim = {l.block[0], l.block[1], l.block[2]};
    b.gdim = {l.grid[0], l.grid[1], l.grid[2]};
    b.body = body;
    b.body_arg = arg;
    blk = &b;
    for (unsigned bz = 0; bz < l.grid[2]; bz++)
        for (unsigned by = 0; by < l.grid[1]; by++)
            for (unsigned bx = 0; bx < l.grid[0]; bx++) {
                b.bid = {bx, by, bz};
                b.n = n;
                b.live = n;
                b.block_arrived = 0;
                b.block_gen = 0;
                b.deadlock = false;
                b.grid_waits = 0;
                for (unsigned w = 0; w < kWarps; w++) {
                    b.warp_live[w] = 0;
                    b.warp_arrived[w] = 0;
                    b.warp_gen[w] = 0;
                }
                for (unsigned i = 0; i < n; i++) {
                    Fiber& f = b.fibers[i];
                    f.sp = nullptr;
                    f.tid = {i % l.block[0], (i / l.block[0]) % l.block[1], i / (l.block[0] * l.block[1])};
                    f.index = i;
                    f.warp = i / 32;
                    f.lane = i % 32;
                    f.state = State::Ready;
                    f.wait_gen = 0;
                    f.shuffles = 0;
                    b.warp_live[f.warp]++;
                    b.free_stacks[i] = n - 1 - i;
                }
                b.free_count = n;
                order_turns(b, (unsigned long long)(bz * l.grid[1] + by) * l.grid[0] + bx);
                // Fibers hand the thread to each other while they wait; one that finishes
                // comes back here, where its stack is freed and the next one starts.
                Fiber* f = next_runnable(b, 0);
                while (f) {
                    cur = f;
                    lt_emu_switch(&scheduler_sp, f->sp);
                    if (b.deadlock) break;
                    Fiber* done = cur;
                    b.free_stacks[b.free_count++] = done->stack;
                    f = next_runnable(b, done->turn + 1);
                }
                if (b.live > 0) b.deadlock = true;
                if (b.deadlock) {
                    unsigned at_block = 0, at_warp = 0;
                    for (unsigned i = 0; i < n; i++) {
                        at_block += b.fibers[i].state == State::WaitBlock;
                        at_warp += b.fibers[i].state == State::WaitWarp;
                    }
                    std::snprintf(l.error, 512,
                                  "deadlock in block (%u,%u,%u): %u threads wait at __syncthreads, "
                                  "%u at a warp shuffle, %u finished",
                                  bx, by, bz, at_block, at_warp, n - b.live);
                    return false;
                }
                // Work runs when it is queued, so the wait itself has nothing to wait for;
                // a kernel that skips it would race the kernel before it on a GPU.
                if (l.programmatic && b.grid_waits != n) {
                    std::snprintf(l.error, 512,
                                  "launched to overlap the kernel before it, but %u of block (%u,%u,%u)'s %u "
                                  "threads did not wait for it (lt_grid_dependency)",
                                  n - b.grid_waits, bx, by, bz, n);
                    return false;
                }
            }
    return true;
}

template <typename... A, size_t... I>
void call_with(void (*f)(A...), void** params, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<A>*>(params[I])...);
}

template <typename... A>
struct Call {
    void (*f)(A...);
    void** params;
    static void run(void* self) {
        auto* c = static_cast<Call*>(self);
        call_with(c->f, c->params, std::index_sequence_for<A...>{});
    }
};

template <typename... A>
bool launch(void (*f)(A...), const Launch& l) {
    Call<A...> c{f, l.params};
    return run_grid(l, &Call<A...>::run, &c);
}

template <typename... A>
size_t param_sizes(void (*)(A...), size_t* out, size_t cap) {
    const size_t sizes[] = {sizeof(A)..., 0};
    for (size_t i = 0; i < sizeof...(A) && i < cap; i++) out[i] = sizes[i];
    return sizeof...(A);
}

inline unsigned char* dynamic_shared() { return blk->dynamic_shared; }

// griddepcontrol.wait and .launch_dependents: counted, so that a launch can check them.
inline void grid_dependency() { blk->grid_waits++; }

}  // namespace lt_emu

// CUDA's vector types, with their alignment.
struct alignas(16) uint4 { unsigned x, y, z, w; };
struct alignas(16) int4 { int x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
struct alignas(8) uint2 { unsigned x, y; };
struct alignas(8) int2 { int x, y; };
struct alignas(8) float2 { float x, y; };
using uint3 = lt_emu::uint3;
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline float2 make_float2(float x, float y) { return {x, y}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

#define threadIdx (lt_emu::cur->tid)
#define blockIdx (lt_emu::blk->bid)
#define blockDim (lt_emu::blk->bdim)
#define gridDim (lt_emu::blk->gdim)
#define warpSize 32

inline void __syncthreads() { lt_emu::syncthreads(); }
inline void __syncwarp(unsigned = 0xffffffffu) { lt_emu::syncwarp(); }
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask, int = 32) {
    return lt_emu::shfl_xor(mask, v, lane_mask);
}

inline float __int_as_float(int v) { float f; std::memcpy(&f, &v, 4); return f; }
inline float __uint_as_float(unsigned v) { float f; std::memcpy(&f, &v, 4); return f; }
inline unsigned __float_as_uint(float v) { unsigned u; std::memcpy(&u, &v, 4); return u; }
inline int __float_as_int(float v) { int u; std::memcpy(&u, &v, 4); return u; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
using std::isfinite;
using std::isinf;
using std::isnan;

// CUDA's min/max: one overload set for integers of either signedness and for floats.
template <typename A, typename B>
inline std::common_type_t<A, B> min(A a, B b) {
    using T = std::common_type_t<A, B>;
    if constexpr (std::is_floating_point_v<T>) return std::fmin((T)a, (T)b);
    else return (T)a < (T)b ? (T)a : (T)b;
}
template <typename A, typename B>
inline std::common_type_t<A, B> max(A a, B b) {
    using T = std::common_type_t<A, B>;
    if constexpr (std::is_floating_point_v<T>) return std::fmax((T)a, (T)b);
    else return (T)a < (T)b ? (T)b : (T)a;
}

// Atomics: real ones, though a block's threads never run at the same time.
template <typename T> inline T atomicAdd(T* p, T v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
inline float atomicAdd(float* p, float v) {
    float old = *p, desired;
    do { desired = old + v; } while (!__atomic_compare_exchange(p, &old, &desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST));
    return old;
}
template <typename T> inline T atomicOr(T* p, T v) { return __atomic_fetch_or(p, v, __ATOMIC_SEQ_CST); }
template <typename T> inline T atomicAnd(T* p, T v) { return __atomic_fetch_and(p, v, __ATOMIC_SEQ_CST); }
template <typename T> inline T atomicExch(T* p, T v) { return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST); }
template <typename T> inline T atomicMin(T* p, T v) {
    T old = *p;
    while (v < old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    return old;
}
template <typename T> inline T atomicMax(T* p, T v) {
    T old = *p;
    while (v > old && !__atomic_compare_exchange_n(p, &old, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    return old;
}
template <typename T> inline T atomicCAS(T* p, T expected, T desired) {
    __atomic_compare_exchange_n(p, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}
