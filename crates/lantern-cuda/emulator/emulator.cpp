// A CUDA emulator for tests on machines without a GPU: the parts of the CUDA driver API,
// NVRTC and cuBLAS that lantern (through cudarc) calls, run on the CPU. Built as one shared
// library that scripts/test-gpu-emulated links under the names cudarc opens (libcuda.so,
// libnvrtc.so, libcublas.so, ...), so lantern's GPU tests run unchanged.
//
// - "Device" memory is host memory: a device pointer is a host address. Fresh allocations
//   are filled with 0xff bytes (NaN as f32), so a kernel reading what nobody wrote shows;
//   a guard after each allocation is checked after every launch (writing past the end is
//   an error naming the kernel), and copies, memsets and GEMM operands must lie inside
//   a live allocation.
// - NVRTC "compiles" a kernel source with the host C++ compiler (g++ or $CXX), device.h
//   first (the CUDA dialect: fibers for threads, __syncthreads, warp shuffles), into a
//   shared library cached by the hash of its text; the "PTX" names that library.
// - Work runs when queued (a stream is always idle). A stream being captured records its
//   work into a graph instead, which a graph launch replays; what CUDA refuses during a
//   capture (waiting for the stream, copies from pageable host memory) is refused here too.
// - cuBLAS's GemmEx for f32 / f16 / bf16 inputs, accumulated in double.
//
// What it cannot tell: speed, races between a block's threads beyond what changing their
// order shows (LANTERN_CUDA_EMULATOR_ORDER, device.h), the GPU's own rounding of exp and
// friends, and anything the real driver checks that is not listed above.
#include <dlfcn.h>
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#define EXPORT extern "C" __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

constexpr CUresult CUDA_SUCCESS = 0;
constexpr CUresult CUDA_ERROR_INVALID_VALUE = 1;
constexpr CUresult CUDA_ERROR_OUT_OF_MEMORY = 2;
constexpr CUresult CUDA_ERROR_INVALID_DEVICE = 101;
constexpr CUresult CUDA_ERROR_INVALID_IMAGE = 200;
constexpr CUresult CUDA_ERROR_INVALID_HANDLE = 400;
constexpr CUresult CUDA_ERROR_NOT_FOUND = 500;
constexpr CUresult CUDA_ERROR_ILLEGAL_ADDRESS = 700;
constexpr CUresult CUDA_ERROR_LAUNCH_FAILED = 719;
constexpr CUresult CUDA_ERROR_NOT_SUPPORTED = 801;
constexpr CUresult CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900;
constexpr CUresult CUDA_ERROR_STREAM_CAPTURE_INVALIDATED = 901;
constexpr CUresult CUDA_ERROR_UNKNOWN = 999;

namespace {

// The same struct as lt_emu::Launch in device.h.
struct Launch {
    unsigned grid[3];
    unsigned block[3];
    unsigned shared_bytes;
    void** params;
    char* error;
    unsigned programmatic;
};

std::recursive_mutex g_mutex;
using Lock = std::lock_guard<std::recursive_mutex>;
// One kernel runs at a time: a module's fibers and shared memory are plain globals.
std::mutex g_launch_mutex;

void report(const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    std::fprintf(stderr, "cuda emulator: ");
    std::vfprintf(stderr, fmt, ap);
    std::fprintf(stderr, "\n");
    va_end(ap);
}

// ---- memory ----

constexpr size_t kGuardBytes = 256;
constexpr uint32_t kGuardWord = 0xffc0deadu;  // a NaN with a payload
constexpr size_t kPoisonUpTo = 64u << 20;     // larger allocations start as zeros (mmap)

struct Allocation {
    size_t size;
    size_t mapped;  // bytes mmapped (0: malloc)
};
std::map<uintptr_t, Allocation> g_device;  // base -> allocation
std::map<uintptr_t, size_t> g_pinned;       // host base -> size
size_t g_used = 0;

size_t total_memory() {
    static size_t total = [] {
        const char* v = std::getenv("LANTERN_CUDA_EMULATOR_MEMORY_MIB");
        size_t mib = v ? std::strtoull(v, nullptr, 10) : 4096;
        return (mib ? mib : 4096) << 20;
    }();
    return total;
}

void fill_guard(unsigned char* end) {
    for (size_t i = 0; i < kGuardBytes; i += 4) std::memcpy(end + i, &kGuardWord, 4);
}

bool guard_intact(uintptr_t base, const Allocation& a) {
    const unsigned char* end = reinterpret_cast<unsigned char*>(base) + a.size;
    for (size_t i = 0; i < kGuardBytes; i += 4) {
        uint32_t w;
        std::memcpy(&w, end + i, 4);
        if (w != kGuardWord) return false;
    }
    return true;
}

CUresult device_alloc(CUdeviceptr* out, size_t bytes) {
    Lock lock(g_mutex);
    if (bytes > total_memory() - std::min(g_used, total_memory())) return CUDA_ERROR_OUT_OF_MEMORY;
    const size_t size = bytes ? bytes : 1;
    unsigned char* p;
    size_t mapped = 0;
    if (size > kPoisonUpTo) {
        mapped = (size + kGuardBytes + 4095) & ~size_t(4095);
        void* m = mmap(nullptr, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
        p = static_cast<unsigned char*>(m);
    } else {
        p = static_cast<unsigned char*>(std::aligned_alloc(256, (size + kGuardBytes + 255) & ~size_t(255)));
        if (!p) return CUDA_ERROR_OUT_OF_MEMORY;
        std::memset(p, 0xff, size);
    }
    fill_guard(p + size);
    g_device[reinterpret_cast<uintptr_t>(p)] = Allocation{size, mapped};
    g_used += size;
    *out = reinterpret_cast<CUdeviceptr>(p);
    return CUDA_SUCCESS;
}

CUresult device_free(CUdeviceptr ptr) {
    Lock lock(g_mutex);
    auto it = g_device.find(ptr);
    if (it == g_device.end()) {
        report("free of %#llx, which is not the start of a live allocation", ptr);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (!guard_intact(it->first, it->second)) report("an allocation of %zu bytes was written past its end", it->second.size);
    void* p = reinterpret_cast<void*>(it->first);
    if (it->second.mapped) munmap(p, it->second.mapped);
    else std::free(p);
    g_used -= it->second.size;
    g_device.erase(it);
    return CUDA_SUCCESS;
}

// Whether [ptr, ptr + bytes) lies in one live device allocation.
bool device_range(CUdeviceptr ptr, size_t bytes) {
    Lock lock(g_mutex);
    auto it = g_device.upper_bound(ptr);
    if (it == g_device.begin()) return false;
    --it;
    return ptr >= it->first && ptr + bytes <= it->first + it->second.size;
}

bool pinned_range(const void* p, size_t bytes) {
    Lock lock(g_mutex);
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    auto it = g_pinned.upper_bound(a);
    if (it == g_pinned.begin()) return false;
    --it;
    return a >= it->first && a + bytes <= it->first + it->second;
}

// After a kernel: every allocation's guard must be intact.
std::string check_guards() {
    Lock lock(g_mutex);
    for (auto& [base, a] : g_device)
        if (!guard_intact(base, a)) {
            fill_guard(reinterpret_cast<unsigned char*>(base) + a.size);
            char buf[160];
            std::snprintf(buf, sizeof buf, "wrote past the end of the allocation at %#lx (%zu bytes)",
                          (unsigned long)base, a.size);
            return buf;
        }
    return {};
}

// ---- streams, graphs, events ----

struct Graph {
    std::vector<std::function<CUresult()>> ops;
};

struct Stream {
    bool capturing = false;
    bool invalidated = false;
    Graph* graph = nullptr;
};
Stream g_default_stream;

Stream* stream_of(void* s) { return s ? static_cast<Stream*>(s) : &g_default_stream; }

// Runs `op` now, or records it when the stream is being captured.
CUresult enqueue(void* s, std::function<CUresult()> op) {
    Stream* st = stream_of(s);
    {
        Lock lock(g_mutex);
        if (st->capturing) {
            st->graph->ops.push_back(std::move(op));
            return CUDA_SUCCESS;
        }
    }
    return op();
}

// A capture refuses what would wait for the stream; the capture is then invalid.
CUresult refuse_in_capture(void* s, const char* what) {
    Stream* st = stream_of(s);
    Lock lock(g_mutex);
    if (!st->capturing) return CUDA_SUCCESS;
    st->invalidated = true;
    report("%s on a stream being captured (CUDA refuses this)", what);
    return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
}

struct Event {
    std::chrono::steady_clock::time_point at = std::chrono::steady_clock::now();
};

// ---- modules ----

struct Function {
    std::string name;
    bool (*launch)(const Launch*);
    size_t (*param_sizes)(size_t*, size_t);
    int max_dynamic_shared = 48 << 10;
};

struct Module {
    void* handle;
    std::vector<std::unique_ptr<Function>> functions;
};

// ---- NVRTC ----

struct Program {
    std::string source, name, log, image;
};

std::string self_dir() {
    Dl_info info;
    if (!dladdr(reinterpret_cast<void*>(&self_dir), &info) || !info.dli_fname) return ".";
    std::string path = info.dli_fname;
    char resolved[4096];
    if (realpath(path.c_str(), resolved)) path = resolved;
    auto slash = path.rfind('/');
    return slash == std::string::npos ? "." : path.substr(0, slash);
}

std::string read_file(const std::string& path) {
    std::ifstream f(path, std::ios::binary);
    std::stringstream ss;
    ss << f.rdbuf();
    return ss.str();
}

uint64_t fnv1a(const std::string& s, uint64_t h = 1469598103934665603ull) {
    for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
    return h;
}

// Runs a shell command; its output (stdout and stderr) in `out`.
int run_command(const std::string& cmd, std::string& out) {
    FILE* p = popen((cmd + " 2>&1").c_str(), "r");
    if (!p) return -1;
    char buf[4096];
    size_t n;
    while ((n = fread(buf, 1, sizeof buf, p)) > 0) out.append(buf, n);
    return pclose(p);
}

// `extern __shared__ T name[];` becomes a pointer to the block's dynamic shared memory.
std::string rewrite_dynamic_shared(const std::string& src) {
    static const std::regex re(
        R"(extern\s+__shared__\s+(?:__align__\s*\(\s*\d+\s*\)\s*)?([A-Za-z_][\w ]*?)\s+(\w+)\s*\[\s*\]\s*;)");
    return std::regex_replace(src, re, "$1* $2 = reinterpret_cast<$1*>(lt_emu::dynamic_shared());");
}

bool compile_program(Program& prog) {
    const std::string dir = self_dir();
    const std::string header = dir + "/device.h";
    const std::string header_text = read_file(header);
    if (header_text.empty()) {
        prog.log = "the emulator's device.h was not found beside it in " + dir;
        return false;
    }
    const char* cache_env = std::getenv("LANTERN_CUDA_EMULATOR_CACHE");
    const std::string cache = cache_env ? cache_env : dir + "/cache";
    std::error_code ignored;
    std::filesystem::create_directories(cache, ignored);
    const char* cxx_env = std::getenv("CXX");
    const std::string cxx = cxx_env ? cxx_env : "g++";
    char hash[32];
    std::snprintf(hash, sizeof hash, "%016llx", (unsigned long long)fnv1a(prog.source, fnv1a(header_text)));
    const std::string base = cache + "/" + hash;
    const std::string library = base + ".so";
    std::string names_text = read_file(base + ".names");
    if (access(library.c_str(), R_OK) != 0 || names_text.empty()) {
        const std::string tmp = base + "." + std::to_string(getpid()) + "." +
                                std::to_string(std::hash<std::thread::id>{}(std::this_thread::get_id()));
        const std::string body = rewrite_dynamic_shared(prog.source);
        { std::ofstream(tmp + ".cu") << body; }
        std::string pre;
        if (run_command(cxx + " -std=c++17 -E -P -DLT_EMU_PASS1 -x c++ -include '" + header + "' '" + tmp + ".cu'",
                        pre) != 0) {
            prog.log = pre;
            std::remove((tmp + ".cu").c_str());
            return false;
        }
        static const std::regex kernel(R"(extern\s+"C"\s+LT_EMU_KERNEL\s+void\s+(\w+)\s*\()");
        std::string entries;
        names_text.clear();
        for (auto it = std::sregex_iterator(pre.begin(), pre.end(), kernel); it != std::sregex_iterator(); ++it) {
            const std::string name = (*it)[1];
            names_text += name + "\n";
            entries += "extern \"C\" bool lt_emu_launch_" + name +
                       "(const lt_emu::Launch* l) { return lt_emu::launch(" + name + ", *l); }\n";
            entries += "extern \"C\" size_t lt_emu_params_" + name +
                       "(size_t* out, size_t cap) { return lt_emu::param_sizes(" + name + ", out, cap); }\n";
        }
        { std::ofstream(tmp + ".cu") << body << "\n" << entries; }
        std::string log;
        const int rc = run_command(cxx + " -std=c++17 -O2 -g -fPIC -shared -x c++ -include '" + header + "' '" + tmp +
                                       ".cu' -o '" + tmp + ".so'",
                                   log);
        std::remove((tmp + ".cu").c_str());
        if (rc != 0) {
            prog.log = log;
            std::remove((tmp + ".so").c_str());
            return false;
        }
        { std::ofstream(tmp + ".names") << names_text; }
        std::rename((tmp + ".names").c_str(), (base + ".names").c_str());
        std::rename((tmp + ".so").c_str(), library.c_str());
    }
    prog.image = "// lantern CUDA emulator module\n.emulated " + library + "\n";
    std::istringstream names(names_text);
    for (std::string name; std::getline(names, name);)
        if (!name.empty()) prog.image += ".entry " + name + "(\n";
    return true;
}

// ---- cuBLAS ----

struct Blas {
    void* stream = nullptr;
};

enum : int { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14 };

float load_value(const void* base, int type, size_t i) {
    switch (type) {
        case CUDA_R_32F: return static_cast<const float*>(base)[i];
        case CUDA_R_16BF: {
            uint32_t bits = uint32_t(static_cast<const uint16_t*>(base)[i]) << 16;
            float f;
            std::memcpy(&f, &bits, 4);
            return f;
        }
        default: {
            _Float16 h;
            std::memcpy(&h, static_cast<const uint16_t*>(base) + i, 2);
            return float(h);
        }
    }
}

void store_value(void* base, int type, size_t i, float v) {
    switch (type) {
        case CUDA_R_32F: static_cast<float*>(base)[i] = v; break;
        case CUDA_R_16BF: {
            uint32_t u;
            std::memcpy(&u, &v, 4);
            if ((u & 0x7fffffffu) > 0x7f800000u) u = (u >> 16) | 0x40u;
            else u = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
            static_cast<uint16_t*>(base)[i] = uint16_t(u);
            break;
        }
        default: {
            _Float16 h = (_Float16)v;
            std::memcpy(static_cast<uint16_t*>(base) + i, &h, 2);
        }
    }
}

size_t type_bytes(int type) { return type == CUDA_R_32F ? 4 : 2; }

// C = alpha op(A) op(B) + beta C, column-major, as cublasGemmEx.
void gemm(int ta, int tb, int m, int n, int k, float alpha, const void* A, int at, int lda, const void* B,
          int bt, int ldb, float beta, void* C, int ct, int ldc) {
    std::vector<float> a(size_t(m) * k), b(size_t(k) * n);  // op(A) by rows, op(B) by columns
    for (int i = 0; i < m; i++)
        for (int l = 0; l < k; l++)
            a[size_t(i) * k + l] = load_value(A, at, ta ? size_t(l) + size_t(i) * lda : size_t(i) + size_t(l) * lda);
    for (int j = 0; j < n; j++)
        for (int l = 0; l < k; l++)
            b[size_t(j) * k + l] = load_value(B, bt, tb ? size_t(j) + size_t(l) * ldb : size_t(l) + size_t(j) * ldb);
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            const float* ar = &a[size_t(i) * k];
            const float* bc = &b[size_t(j) * k];
            double acc = 0;
            for (int l = 0; l < k; l++) acc += double(ar[l]) * double(bc[l]);
            const size_t at_c = size_t(i) + size_t(j) * ldc;
            double v = double(alpha) * acc;
            if (beta != 0.0f) v += double(beta) * load_value(C, ct, at_c);
            store_value(C, ct, at_c, float(v));
        }
}

}  // namespace

// ===================== the driver API =====================

EXPORT CUresult cuInit(unsigned) { return CUDA_SUCCESS; }
EXPORT CUresult cuDriverGetVersion(int* v) { *v = 13000; return CUDA_SUCCESS; }
EXPORT CUresult cuDeviceGetCount(int* n) { *n = 1; return CUDA_SUCCESS; }
EXPORT CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
    *d = 0;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetName(char* name, int len, CUdevice) {
    std::snprintf(name, len, "lantern CUDA emulator");
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceGetAttribute(int* v, int attribute, CUdevice) {
    switch (attribute) {
        case 1: *v = 1024; break;         // max threads per block
        case 8: *v = 48 << 10; break;     // shared memory per block
        case 10: *v = 32; break;          // warp size
        case 16: *v = 4; break;           // multiprocessors
        case 75: *v = 9; break;           // compute capability
        case 76: *v = 0; break;
        case 81: *v = 228 << 10; break;   // shared memory per multiprocessor
        case 97: *v = 227 << 10; break;   // shared memory per block, opt-in
        case 115: *v = 1; break;          // memory pools
        default: *v = 0;
    }
    return CUDA_SUCCESS;
}
EXPORT CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice) { *bytes = total_memory(); return CUDA_SUCCESS; }
EXPORT CUresult cuDeviceGetUuid(unsigned char* uuid, CUdevice) { std::memset(uuid, 0x4c, 16); return CUDA_SUCCESS; }
EXPORT CUresult cuDeviceGetUuid_v2(unsigned char* uuid, CUdevice) { std::memset(uuid, 0x4c, 16); return CUDA_SUCCESS; }

static int g_context_token;
static thread_local void* t_current = nullptr;
EXPORT CUresult cuDevicePrimaryCtxRetain(void** ctx, CUdevice) { *ctx = &g_context_token; return CUDA_SUCCESS; }
EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice) { return CUDA_SUCCESS; }
EXPORT CUresult cuCtxSetCurrent(void* ctx) { t_current = ctx; return CUDA_SUCCESS; }
EXPORT CUresult cuCtxGetCurrent(void** ctx) { *ctx = t_current; return CUDA_SUCCESS; }
EXPORT CUresult cuCtxSynchronize() { return CUDA_SUCCESS; }
EXPORT CUresult cuCtxSetFlags(unsigned) { return CUDA_SUCCESS; }
EXPORT CUresult cuCtxGetLimit(size_t* v, int) { *v = 0; return CUDA_SUCCESS; }
EXPORT CUresult cuCtxSetLimit(int, size_t) { return CUDA_SUCCESS; }
EXPORT CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) { *least = 0; *greatest = -5; return CUDA_SUCCESS; }

EXPORT CUresult cuGetErrorName(CUresult e, const char** s) {
    static char buf[64];
    std::snprintf(buf, sizeof buf, "CUDA_ERROR_%d", e);
    *s = e == CUDA_SUCCESS ? "CUDA_SUCCESS" : buf;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGetErrorString(CUresult e, const char** s) { return cuGetErrorName(e, s); }

EXPORT CUresult cuStreamCreate(void** s, unsigned) { *s = new Stream(); return CUDA_SUCCESS; }
EXPORT CUresult cuStreamCreateWithPriority(void** s, unsigned, int) { *s = new Stream(); return CUDA_SUCCESS; }
EXPORT CUresult cuStreamDestroy_v2(void* s) {
    if (s) delete static_cast<Stream*>(s);
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamSynchronize(void* s) { return refuse_in_capture(s, "cuStreamSynchronize"); }
EXPORT CUresult cuStreamWaitEvent(void*, void*, unsigned) { return CUDA_SUCCESS; }
EXPORT CUresult cuStreamBeginCapture_v2(void* s, int) {
    Lock lock(g_mutex);
    Stream* st = stream_of(s);
    if (st->capturing) return CUDA_ERROR_INVALID_VALUE;
    st->capturing = true;
    st->invalidated = false;
    st->graph = new Graph();
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamEndCapture(void* s, void** graph) {
    Lock lock(g_mutex);
    Stream* st = stream_of(s);
    if (!st->capturing) return CUDA_ERROR_INVALID_VALUE;
    st->capturing = false;
    if (st->invalidated) {
        delete st->graph;
        st->graph = nullptr;
        *graph = nullptr;
        return CUDA_ERROR_STREAM_CAPTURE_INVALIDATED;
    }
    *graph = st->graph;
    st->graph = nullptr;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuStreamIsCapturing(void* s, int* status) {
    Lock lock(g_mutex);
    Stream* st = stream_of(s);
    *status = st->capturing ? (st->invalidated ? 2 : 1) : 0;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuLaunchHostFunc(void* s, void (*fn)(void*), void* data) {
    return enqueue(s, [=] { fn(data); return CUDA_SUCCESS; });
}

EXPORT CUresult cuGraphInstantiateWithFlags(void** exec, void* graph, unsigned long long) {
    if (!graph) return CUDA_ERROR_INVALID_VALUE;
    *exec = new Graph(*static_cast<Graph*>(graph));
    return CUDA_SUCCESS;
}
EXPORT CUresult cuGraphLaunch(void* exec, void* s) {
    if (!exec) return CUDA_ERROR_INVALID_HANDLE;
    Graph* g = static_cast<Graph*>(exec);
    return enqueue(s, [g] {
        for (auto& op : g->ops) {
            CUresult r = op();
            if (r != CUDA_SUCCESS) return r;
        }
        return CUDA_SUCCESS;
    });
}
EXPORT CUresult cuGraphUpload(void*, void*) { return CUDA_SUCCESS; }
EXPORT CUresult cuGraphDestroy(void* g) { delete static_cast<Graph*>(g); return CUDA_SUCCESS; }
EXPORT CUresult cuGraphExecDestroy(void* g) { delete static_cast<Graph*>(g); return CUDA_SUCCESS; }

EXPORT CUresult cuEventCreate(void** e, unsigned) { *e = new Event(); return CUDA_SUCCESS; }
EXPORT CUresult cuEventDestroy_v2(void* e) { delete static_cast<Event*>(e); return CUDA_SUCCESS; }
EXPORT CUresult cuEventRecord(void* e, void* s) {
    return enqueue(s, [e] { static_cast<Event*>(e)->at = std::chrono::steady_clock::now(); return CUDA_SUCCESS; });
}
EXPORT CUresult cuEventSynchronize(void*) { return CUDA_SUCCESS; }
EXPORT CUresult cuEventQuery(void*) { return CUDA_SUCCESS; }
EXPORT CUresult cuEventElapsedTime(float* ms, void* a, void* b) {
    *ms = std::chrono::duration<float, std::milli>(static_cast<Event*>(b)->at - static_cast<Event*>(a)->at).count();
    return CUDA_SUCCESS;
}
EXPORT CUresult cuEventElapsedTime_v2(float* ms, void* a, void* b) { return cuEventElapsedTime(ms, a, b); }

// ---- memory ----

EXPORT CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    Lock lock(g_mutex);
    *total = total_memory();
    *free_bytes = total_memory() - std::min(g_used, total_memory());
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) { return device_alloc(p, bytes); }
EXPORT CUresult cuMemAllocAsync(CUdeviceptr* p, size_t bytes, void* s) {
    Stream* st = stream_of(s);
    {
        Lock lock(g_mutex);
        if (st->capturing) report("an allocation of %zu bytes inside a captured graph", bytes);
    }
    return device_alloc(p, bytes);
}
EXPORT CUresult cuMemFree_v2(CUdeviceptr p) { return device_free(p); }
EXPORT CUresult cuMemFreeAsync(CUdeviceptr p, void* s) {
    Stream* st = stream_of(s);
    {
        Lock lock(g_mutex);
        // A free inside a capture would happen at each replay; the buffer is kept instead.
        if (st->capturing) {
            report("a free inside a captured graph (the buffer is kept)");
            return CUDA_SUCCESS;
        }
    }
    return device_free(p);
}
EXPORT CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned) {
    *p = std::aligned_alloc(4096, (bytes + 4095) & ~size_t(4095));
    if (!*p) return CUDA_ERROR_OUT_OF_MEMORY;
    Lock lock(g_mutex);
    g_pinned[reinterpret_cast<uintptr_t>(*p)] = bytes;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuMemAllocHost_v2(void** p, size_t bytes) { return cuMemHostAlloc(p, bytes, 0); }
EXPORT CUresult cuMemFreeHost(void* p) {
    Lock lock(g_mutex);
    g_pinned.erase(reinterpret_cast<uintptr_t>(p));
    std::free(p);
    return CUDA_SUCCESS;
}

static void* as_host(CUdeviceptr p) { return reinterpret_cast<void*>(p); }

// A copy of `bytes` from src to dst; `*_device` says which side is device memory (a
// device pointer is a host address here).
static CUresult copy_checked(const char* what, void* s, void* dst, bool dst_device, const void* src,
                             bool src_device, size_t bytes) {
    if (bytes == 0) return CUDA_SUCCESS;
    auto outside = [&](bool device, const void* p) {
        return device && !device_range(reinterpret_cast<CUdeviceptr>(p), bytes);
    };
    if (outside(dst_device, dst) || outside(src_device, src)) {
        report("%s: %zu bytes from %p to %p, outside any allocation", what, bytes, src, dst);
        return CUDA_ERROR_INVALID_VALUE;
    }
    Stream* st = stream_of(s);
    {
        Lock lock(g_mutex);
        const void* host = dst_device ? src : dst;
        if (st->capturing && !(dst_device && src_device) && !pinned_range(host, bytes)) {
            st->invalidated = true;
            report("%s of pageable host memory on a stream being captured (CUDA refuses this)", what);
            return CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED;
        }
    }
    return enqueue(s, [=] {
        std::memmove(dst, src, bytes);
        return CUDA_SUCCESS;
    });
}

EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, void* s) {
    return copy_checked("cuMemcpyHtoDAsync", s, as_host(dst), true, src, false, n);
}
EXPORT CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, void* s) {
    return copy_checked("cuMemcpyDtoHAsync", s, dst, false, as_host(src), true, n);
}
EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void* s) {
    return copy_checked("cuMemcpyDtoDAsync", s, as_host(dst), true, as_host(src), true, n);
}
EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    return cuMemcpyHtoDAsync_v2(dst, src, n, nullptr);
}
EXPORT CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    return cuMemcpyDtoHAsync_v2(dst, src, n, nullptr);
}
EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    return cuMemcpyDtoDAsync_v2(dst, src, n, nullptr);
}
EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, void* s) {
    if (n && !device_range(dst, n)) {
        report("cuMemsetD8Async: %zu bytes at %#llx, outside any allocation", n, dst);
        return CUDA_ERROR_INVALID_VALUE;
    }
    return enqueue(s, [=] {
        std::memset(reinterpret_cast<void*>(dst), v, n);
        return CUDA_SUCCESS;
    });
}
EXPORT CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) { return cuMemsetD8Async(dst, v, n, nullptr); }
EXPORT CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned v, size_t n, void* s) {
    if (n && !device_range(dst, n * 4)) return CUDA_ERROR_INVALID_VALUE;
    return enqueue(s, [=] {
        for (size_t i = 0; i < n; i++) std::memcpy(reinterpret_cast<char*>(dst) + 4 * i, &v, 4);
        return CUDA_SUCCESS;
    });
}

// ---- modules and launches ----

EXPORT CUresult cuModuleLoadData(void** module, const void* image) {
    const char* text = static_cast<const char*>(image);
    const char* tag = std::strstr(text, ".emulated ");
    if (!tag) {
        report("a module that the emulator's NVRTC did not make");
        return CUDA_ERROR_INVALID_IMAGE;
    }
    std::string path(tag + 10, std::strcspn(tag + 10, "\n"));
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
        report("cannot open %s: %s", path.c_str(), dlerror());
        return CUDA_ERROR_INVALID_IMAGE;
    }
    auto* m = new Module{handle, {}};
    *module = m;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuModuleUnload(void* module) {
    auto* m = static_cast<Module*>(module);
    dlclose(m->handle);
    delete m;
    return CUDA_SUCCESS;
}
EXPORT CUresult cuModuleGetFunction(void** f, void* module, const char* name) {
    auto* m = static_cast<Module*>(module);
    auto launch = reinterpret_cast<bool (*)(const Launch*)>(dlsym(m->handle, (std::string("lt_emu_launch_") + name).c_str()));
    auto sizes = reinterpret_cast<size_t (*)(size_t*, size_t)>(dlsym(m->handle, (std::string("lt_emu_params_") + name).c_str()));
    if (!launch || !sizes) return CUDA_ERROR_NOT_FOUND;
    m->functions.push_back(std::make_unique<Function>(Function{name, launch, sizes}));
    *f = m->functions.back().get();
    return CUDA_SUCCESS;
}
EXPORT CUresult cuFuncGetAttribute(int* v, int attribute, void* f) {
    switch (attribute) {
        case 0: *v = 1024; break;  // max threads per block
        case 8: *v = static_cast<Function*>(f)->max_dynamic_shared; break;
        default: *v = 0;
    }
    return CUDA_SUCCESS;
}
EXPORT CUresult cuFuncSetAttribute(void* f, int attribute, int v) {
    if (attribute == 8) {  // max dynamic shared memory
        if (v > (227 << 10)) return CUDA_ERROR_INVALID_VALUE;
        static_cast<Function*>(f)->max_dynamic_shared = v;
    }
    return CUDA_SUCCESS;
}
EXPORT CUresult cuFuncSetCacheConfig(void*, int) { return CUDA_SUCCESS; }

namespace {
CUresult launch_kernel(void* fp, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                       unsigned shared, void* s, void** params, void** extra, bool programmatic) {
    auto* f = static_cast<Function*>(fp);
    if (extra) return CUDA_ERROR_NOT_SUPPORTED;
    if (gx == 0 || gy == 0 || gz == 0 || gy > 65535 || gz > 65535) {
        report("kernel %s: grid (%u,%u,%u) out of range", f->name.c_str(), gx, gy, gz);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (bx * by * bz == 0 || bx * by * bz > 1024 || bz > 64) {
        report("kernel %s: block (%u,%u,%u) out of range", f->name.c_str(), bx, by, bz);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if ((int)shared > f->max_dynamic_shared) {
        report("kernel %s: %u bytes of dynamic shared memory, above the %d allowed (cuFuncSetAttribute raises it)",
               f->name.c_str(), shared, f->max_dynamic_shared);
        return CUDA_ERROR_INVALID_VALUE;
    }
    // The argument values are copied now, as CUDA does: later changes to them do not matter.
    size_t sizes[64];
    const size_t count = f->param_sizes(sizes, 64);
    auto values = std::make_shared<std::vector<std::vector<unsigned char>>>();
    for (size_t i = 0; i < count; i++) {
        const auto* p = static_cast<const unsigned char*>(params[i]);
        values->emplace_back(p, p + sizes[i]);
    }
    return enqueue(s, [=] {
        std::vector<void*> ptrs;
        for (auto& v : *values) ptrs.push_back(v.data());
        std::lock_guard<std::mutex> running(g_launch_mutex);
        char error[512] = {0};
        Launch l{{gx, gy, gz}, {bx, by, bz}, shared, ptrs.data(), error, programmatic};
        if (!f->launch(&l)) {
            report("kernel %s: %s", f->name.c_str(), error);
            return CUDA_ERROR_LAUNCH_FAILED;
        }
        std::string past = check_guards();
        if (!past.empty()) {
            report("kernel %s %s", f->name.c_str(), past.c_str());
            return CUDA_ERROR_ILLEGAL_ADDRESS;
        }
        return CUDA_SUCCESS;
    });
}
}  // namespace

EXPORT CUresult cuLaunchKernel(void* fp, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                               unsigned bz, unsigned shared, void* s, void** params, void** extra) {
    return launch_kernel(fp, gx, gy, gz, bx, by, bz, shared, s, params, extra, false);
}

// CUlaunchConfig and CUlaunchAttribute as cuda.h lays them out (a 64-byte value union).
struct LaunchAttribute {
    int id;
    char pad[4];
    union {
        char bytes[64];
        int programmatic_stream_serialization_allowed;
    } value;
};
struct LaunchConfig {
    unsigned grid[3], block[3], shared;
    void* stream;
    LaunchAttribute* attrs;
    unsigned num_attrs;
};
static_assert(sizeof(LaunchAttribute) == 72, "CUlaunchAttribute is 72 bytes");

// LANTERN_CUDA_EMULATOR_PDL=refuse answers a programmatic launch as a driver without it
// would (CUDA_ERROR_NOT_SUPPORTED), for testing the fallback to plain launches.
EXPORT CUresult cuLaunchKernelEx(const LaunchConfig* c, void* fp, void** params, void** extra) {
    constexpr int kProgrammaticStreamSerialization = 6;
    bool programmatic = false;
    for (unsigned i = 0; i < c->num_attrs; i++) {
        const LaunchAttribute& a = c->attrs[i];
        if (a.id == 0) continue;  // ignored
        if (a.id != kProgrammaticStreamSerialization) {
            report("cuLaunchKernelEx: launch attribute %d is not emulated", a.id);
            return CUDA_ERROR_NOT_SUPPORTED;
        }
        programmatic = a.value.programmatic_stream_serialization_allowed != 0;
    }
    const char* pdl = std::getenv("LANTERN_CUDA_EMULATOR_PDL");
    if (programmatic && pdl && std::string(pdl) == "refuse") return CUDA_ERROR_NOT_SUPPORTED;
    return launch_kernel(fp, c->grid[0], c->grid[1], c->grid[2], c->block[0], c->block[1], c->block[2], c->shared,
                         c->stream, params, extra, programmatic);
}

// ===================== NVRTC =====================

EXPORT int nvrtcVersion(int* major, int* minor) { *major = 13; *minor = 0; return 0; }
EXPORT const char* nvrtcGetErrorString(int r) { return r == 0 ? "NVRTC_SUCCESS" : "NVRTC_ERROR (emulator)"; }
EXPORT int nvrtcGetNumSupportedArchs(int* n) { *n = 1; return 0; }
EXPORT int nvrtcGetSupportedArchs(int* archs) { archs[0] = 90; return 0; }
EXPORT int nvrtcCreateProgram(void** prog, const char* src, const char* name, int, const char* const*,
                              const char* const*) {
    *prog = new Program{src, name ? name : "", "", ""};
    return 0;
}
EXPORT int nvrtcDestroyProgram(void** prog) {
    delete static_cast<Program*>(*prog);
    *prog = nullptr;
    return 0;
}
EXPORT int nvrtcCompileProgram(void* prog, int, const char* const*) {
    return compile_program(*static_cast<Program*>(prog)) ? 0 : 6;  // NVRTC_ERROR_COMPILATION
}
EXPORT int nvrtcGetPTXSize(void* prog, size_t* n) { *n = static_cast<Program*>(prog)->image.size() + 1; return 0; }
EXPORT int nvrtcGetPTX(void* prog, char* out) {
    auto& s = static_cast<Program*>(prog)->image;
    std::memcpy(out, s.c_str(), s.size() + 1);
    return 0;
}
EXPORT int nvrtcGetCUBINSize(void* prog, size_t* n) { return nvrtcGetPTXSize(prog, n); }
EXPORT int nvrtcGetCUBIN(void* prog, char* out) { return nvrtcGetPTX(prog, out); }
EXPORT int nvrtcGetProgramLogSize(void* prog, size_t* n) { *n = static_cast<Program*>(prog)->log.size() + 1; return 0; }
EXPORT int nvrtcGetProgramLog(void* prog, char* out) {
    auto& s = static_cast<Program*>(prog)->log;
    std::memcpy(out, s.c_str(), s.size() + 1);
    return 0;
}

// ===================== cuBLAS =====================

EXPORT int cublasCreate_v2(void** h) { *h = new Blas(); return 0; }
EXPORT int cublasDestroy_v2(void* h) { delete static_cast<Blas*>(h); return 0; }
EXPORT int cublasSetStream_v2(void* h, void* s) { static_cast<Blas*>(h)->stream = s; return 0; }
EXPORT int cublasGetStream_v2(void* h, void** s) { *s = static_cast<Blas*>(h)->stream; return 0; }
EXPORT int cublasSetMathMode(void*, int) { return 0; }
EXPORT int cublasSetWorkspace_v2(void*, void*, size_t) { return 0; }
EXPORT int cublasGetVersion_v2(void*, int* v) { *v = 130000; return 0; }
EXPORT int cublasGemmEx(void* h, int ta, int tb, int m, int n, int k, const void* alpha, const void* A, int at, int lda,
                        const void* B, int bt, int ldb, const void* beta, void* C, int ct, int ldc, int compute, int) {
    (void)compute;
    for (int t : {at, bt, ct})
        if (t != CUDA_R_32F && t != CUDA_R_16F && t != CUDA_R_16BF) return 15;  // CUBLAS_STATUS_NOT_SUPPORTED
    if (m < 0 || n < 0 || k < 0 || lda < std::max(1, ta ? k : m) || ldb < std::max(1, tb ? n : k) || ldc < std::max(1, m))
        return 7;  // CUBLAS_STATUS_INVALID_VALUE
    const size_t a_len = ta ? size_t(lda) * (m ? m - 1 : 0) + k : size_t(lda) * (k ? k - 1 : 0) + m;
    const size_t b_len = tb ? size_t(ldb) * (k ? k - 1 : 0) + n : size_t(ldb) * (n ? n - 1 : 0) + k;
    const size_t c_len = size_t(ldc) * (n ? n - 1 : 0) + m;
    if (m && n && k) {
        if (!device_range(reinterpret_cast<CUdeviceptr>(A), a_len * type_bytes(at)) ||
            !device_range(reinterpret_cast<CUdeviceptr>(B), b_len * type_bytes(bt)) ||
            !device_range(reinterpret_cast<CUdeviceptr>(C), c_len * type_bytes(ct))) {
            report("cublasGemmEx (m %d, n %d, k %d): an operand outside its allocation", m, n, k);
            return 14;  // CUBLAS_STATUS_INTERNAL_ERROR
        }
    }
    const float a = *static_cast<const float*>(alpha), b = *static_cast<const float*>(beta);
    CUresult r = enqueue(static_cast<Blas*>(h)->stream, [=] {
        if (m && n) gemm(ta, tb, m, n, k, a, A, at, lda, B, bt, ldb, b, C, ct, ldc);
        return CUDA_SUCCESS;
    });
    return r == CUDA_SUCCESS ? 0 : 13;  // CUBLAS_STATUS_EXECUTION_FAILED
}
