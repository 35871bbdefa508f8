// The kernel executor of the fake driver (part of libcuda.so; interface in exec.h): loads the
// modules the fake NVRTC builds and runs grids of their kernels on the calling OS thread.
//
// A grid runs block after block, in an order shuffled by the launch's seed. Within a block
// every CUDA thread is a fiber (exec_fiber.h) with its own stack; a fiber runs until it reaches
// a barrier or a warp collective (shuffle, vote, __syncwarp), or returns, and then hands over
// directly to a ready fiber picked at random (seeded). The executor checks what a GPU would
// leave undefined: threads at different barriers, a barrier some thread left by returning, a
// shuffle naming a lane that exited or reading a lane outside its mask, writes past dynamic
// shared memory, deadlocks, and faults (SIGSEGV/SIGBUS -> CUDA_ERROR_ILLEGAL_ADDRESS). Modules
// whose source has no barrier or collective at all run their threads as plain calls, without
// fibers (a thread that cannot wait needs no stack of its own).
//
// Everything per launch lives in a per-OS-thread Runner, so stream workers may call run_grid
// concurrently. A launch that fails leaves its fibers mid-kernel; their stacks are simply
// reinitialised before the next launch.
#include <dlfcn.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <numeric>
#include <string>
#include <vector>

#include "exec.h"
#include "exec_abi.h"
#include "exec_fiber.h"

namespace fakecuda {

namespace exec_impl {
struct Kernel;
}

// A loaded image: the dlopened module and its kernels.
struct Module {
    void* handle = nullptr;
    int fd = -1;        // the memfd the object was loaded from (its name must stay unique)
    std::string path;   // what dlopen was given
    const fakecuda_abi::ThreadState** (*tls)() = nullptr;
    bool no_sync = false;  // no barrier or collective anywhere: threads run without fibers
    std::vector<exec_impl::Kernel> kernels;
};

namespace exec_impl {

using fakecuda_abi::ThreadState;
using fakecuda_abi::U3;

// What find_kernel hands out: KernelInfo first, so the driver's pointer is ours.
struct Kernel {
    KernelInfo info;
    void (*thunk)(void* const*);
    Module* module;
};

namespace {  // everything below stays out of libcuda.so's symbol table

constexpr unsigned kMaxThreads = 1024;
#ifdef FAKECUDA_ASAN
constexpr size_t kStackSize = 256 << 10;  // ASan's redzones make frames larger
#else
constexpr size_t kStackSize = 64 << 10;
#endif
constexpr size_t kAltStackSize = 64 << 10;
constexpr size_t kSmemAlign = 128;
constexpr size_t kCanary = 64;  // checked bytes on each side of dynamic shared memory
constexpr unsigned char kCanaryByte = 0xA5;

// CUresult codes.
constexpr int kInvalidValue = 1, kOutOfMemory = 2, kIllegalAddress = 700, kIllegalInstruction = 715,
              kLaunchFailed = 719;

// ---- Module loading --------------------------------------------------------------------------

// Puts the object's bytes in a memfd (or, failing that, an unlinked temp file); sets m->path.
bool write_object(Module* m, const char* bytes, size_t size, std::string& err) {
    int fd = memfd_create("fakecuda-module", MFD_CLOEXEC);
    std::string tmp_path;
    if (fd < 0) {
        const char* t = getenv("TMPDIR");
        std::string tmpl = std::string(t && *t ? t : "/tmp") + "/fakecuda-module-XXXXXX";
        std::vector<char> name(tmpl.begin(), tmpl.end());
        name.push_back('\0');
        fd = mkstemp(name.data());
        if (fd < 0) {
            err = std::string("cannot create a file for the module: ") + strerror(errno);
            return false;
        }
        tmp_path = name.data();
    }
    for (size_t off = 0; off < size;) {
        ssize_t w = write(fd, bytes + off, size - off);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            err = std::string("cannot write the module: ") + strerror(errno);
            close(fd);
            if (!tmp_path.empty()) unlink(tmp_path.c_str());
            return false;
        }
        off += (size_t)w;
    }
    m->fd = fd;
    m->path = tmp_path.empty() ? "/proc/self/fd/" + std::to_string(fd) : tmp_path;
    return true;
}

template <class F>
bool find_symbol(Module* m, const char* name, F* out, std::string& err) {
    *out = reinterpret_cast<F>(dlsym(m->handle, name));
    if (!*out) err = std::string("not a fakecuda module: it does not export ") + name;
    return *out != nullptr;
}

int on_barrier(const ThreadState*, int, int, int, int);
uint64_t on_warp(const ThreadState*, int, int, int, unsigned, uint64_t, int, int);
[[noreturn]] void on_trap(const ThreadState*, int, const char*, int);
// The executor's entry points, handed to every module (defined with the scheduler below).
const fakecuda_abi::Runtime kRuntime = {fakecuda_abi::kAbiVersion, on_barrier, on_warp, on_trap};

// Checks the module's exports, binds it to the runtime and lists its kernels.
bool bind_module(Module* m, std::string& err) {
    unsigned (*abi)() = nullptr;
    unsigned (*flags)() = nullptr;
    void (*bind)(const fakecuda_abi::Runtime*) = nullptr;
    const fakecuda_abi::KernelDesc* (*kernels)(unsigned*) = nullptr;
    if (!find_symbol(m, "fakecuda_module_abi", &abi, err) ||
        !find_symbol(m, "fakecuda_module_flags", &flags, err) ||
        !find_symbol(m, "fakecuda_module_bind", &bind, err) ||
        !find_symbol(m, "fakecuda_module_tls", &m->tls, err) ||
        !find_symbol(m, "fakecuda_module_kernels", &kernels, err))
        return false;
    if (abi() != fakecuda_abi::kAbiVersion) {
        err = "module ABI version " + std::to_string(abi()) + ", expected " +
              std::to_string(fakecuda_abi::kAbiVersion);
        return false;
    }
    m->no_sync = flags() & fakecuda_abi::kModuleNoSync;
    bind(&kRuntime);
    unsigned n = 0;
    const fakecuda_abi::KernelDesc* d = kernels(&n);
    m->kernels.reserve(n);
    for (unsigned i = 0; i < n; i++) {
        KernelInfo info{d[i].name, (int)d[i].nparams, d[i].sizes, d[i].aligns, d[i].is_ptr};
        m->kernels.push_back(Kernel{info, d[i].thunk, m});
    }
    return true;
}

// Closes the module's file, unless the module could not really be unloaded: then a new memfd
// could get the same /proc/self/fd/N name and dlopen would hand back the stale module.
void release_file(Module* m) {
    if (m->fd < 0) return;
    if (m->path.compare(0, 14, "/proc/self/fd/") == 0) {
        if (void* still = dlopen(m->path.c_str(), RTLD_NOW | RTLD_NOLOAD)) {
            dlclose(still);
            return;  // keep the fd (and so the name) for the life of the process
        }
    }
    close(m->fd);
}

// ---- Per-thread state ------------------------------------------------------------------------

enum class State : uint8_t { kReady, kBarrier, kWarp, kDone };

struct Runner;

// One CUDA thread of the running block.
struct Fiber {
    ThreadState ts;  // what the kernel reads (ts.exec points back here)
    fiber::Ctx ctx;
    fiber::Stack stack;
    Runner* runner = nullptr;
    unsigned tid = 0;  // linear thread index in the block
    State state = State::kDone;
    // Where it waits (barrier or warp collective) and what it brings.
    int line = 0, site = 0, op = 0, arg = 0, width = 32;
    unsigned mask = 0;
    uint64_t value = 0, result = 0;
};

// Everything one OS thread needs to run grids; made on its first launch.
struct Runner {
    Fiber fibers[kMaxThreads];
    unsigned nstacks = 0;  // fibers[0, nstacks) have a stack
    bool dirty = false;    // a failed launch left fibers mid-kernel: restart them
    fiber::Ctx home;       // the OS thread's own stack, where blocks are scheduled
    char* altstack = nullptr;

    // The launch.
    const Kernel* kernel = nullptr;
    void* const* params = nullptr;
    const ThreadState** slot = nullptr;  // the module's `cur` for this OS thread
    Dim3 grid{}, block{};
    unsigned nthreads = 0, nwarps = 0;
    uint64_t nblocks = 0;
    bool direct = false;  // threads are plain calls (module without barriers)
    uint64_t rng = 0;
    U3 coords[kMaxThreads];  // threadIdx of each linear index
    uint32_t warp_exists[kMaxThreads / 32];
    std::vector<uint32_t> block_order;
    bool affine = false;  // huge grids: block i runs as (a*i + c) mod nblocks
    uint64_t affine_a = 1, affine_c = 0;
    char* smem_buf = nullptr;  // [canary | smem_bytes | canary], smem 128-aligned
    size_t smem_cap = 0, smem_bytes = 0;
    char* smem = nullptr;

    // The running block.
    U3 block_idx{};
    uint16_t ready[kMaxThreads];
    unsigned nready = 0, nlive = 0, nexited = 0;
    int first_exited = -1;
    unsigned nbarrier = 0, bar_acc = 0;
    int bar_site = 0, bar_line = 0;
    bool bar_mismatch = false;
    uint32_t warp_waiting[kMaxThreads / 32], warp_exited[kMaxThreads / 32];
    Fiber* current = nullptr;  // the fiber running now (null on the home stack)
    ThreadState direct_ts;     // the thread running now, in direct mode
    uint16_t order[kMaxThreads];

    // The outcome, and the way back to run_grid from a fiber or a signal handler.
    RunResult result;
    sigjmp_buf jb;
    int fault_sig = 0;
    void* fault_addr = nullptr;
    bool abandoned_fiber = false;

    ~Runner();
};

// The runner of the OS thread while it is inside run_grid (read by the fault handler, hence
// initial-exec: no allocation on access).
static thread_local Runner* tl_active __attribute__((tls_model("initial-exec")));
static thread_local std::unique_ptr<Runner> tl_runner;

Runner::~Runner() {
    for (unsigned i = 0; i < nstacks; i++) fiber::free_stack(&fibers[i].stack);
    free(smem_buf);
    if (altstack) {
        stack_t cur;
        if (sigaltstack(nullptr, &cur) == 0 && cur.ss_sp == altstack) {
            stack_t off{};
            off.ss_flags = SS_DISABLE;
            sigaltstack(&off, nullptr);
        }
        munmap(altstack, kAltStackSize);
    }
}

// ---- Random numbers --------------------------------------------------------------------------

inline uint64_t splitmix(uint64_t& s) {
    uint64_t z = (s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// Uniform in [0, n).
inline uint64_t below(Runner& r, uint64_t n) {
    return (uint64_t)(((unsigned __int128)splitmix(r.rng) * n) >> 64);
}

// ---- Messages --------------------------------------------------------------------------------

std::string fmt(U3 d) {
    return "(" + std::to_string(d.x) + "," + std::to_string(d.y) + "," + std::to_string(d.z) + ")";
}

std::string hex(uint64_t v) {
    char buf[32];
    snprintf(buf, sizeof buf, "0x%llx", (unsigned long long)v);
    return buf;
}

std::string thread_name(const Runner& r, unsigned tid) {
    return "thread " + fmt(r.coords[tid]) + " of block " + fmt(r.block_idx);
}

// "0-15, 32, 40-47" for a sorted list of indices.
std::string ranges(const std::vector<unsigned>& v) {
    std::string s;
    for (size_t i = 0; i < v.size();) {
        size_t j = i;
        while (j + 1 < v.size() && v[j + 1] == v[j] + 1) j++;
        if (!s.empty()) s += ", ";
        s += std::to_string(v[i]);
        if (j > i) s += "-" + std::to_string(v[j]);
        i = j + 1;
    }
    return s;
}

const char* warp_op_name(int op) {
    static const char* names[] = {"__shfl_sync", "__shfl_up_sync", "__shfl_down_sync", "__shfl_xor_sync",
                                  "__ballot_sync", "__any_sync", "__all_sync", "__syncwarp"};
    return op >= 0 && op < 8 ? names[op] : "warp operation";
}

bool is_shuffle(int op) { return op <= fakecuda_abi::kShflXor; }

// Groups the fibers waiting in `state` by call site: "line A (threads ...), line B (...)".
std::string waiting_sites(const Runner& r, State state, unsigned from, unsigned to, const char* who) {
    std::map<std::pair<int, int>, std::vector<unsigned>> by_site;  // (line, site) -> threads
    for (unsigned t = from; t < to; t++)
        if (r.fibers[t].state == state) by_site[{r.fibers[t].line, r.fibers[t].site}].push_back(t - from);
    std::string s;
    for (const auto& e : by_site) {
        if (!s.empty()) s += ", ";
        s += "line " + std::to_string(e.first.first) + " (" + who + " " + ranges(e.second) + ")";
    }
    return s;
}

// ---- Failures inside a launch ----------------------------------------------------------------

// Records why the launch fails: "kernel NAME: what".
void set_failure(Runner& r, int code, const std::string& what) {
    r.result.code = code;
    r.result.message = std::string("kernel ") + r.kernel->info.name + ": " + what;
}

// Ends the launch from inside it (a fiber, or a kernel running directly): back to run_grid.
// The longjmp skips destructors, so no std::string may be alive in the frames it leaves: each
// abort below finishes building its message (in set_failure's full-expression) first.
[[noreturn, gnu::cold]] void jump_out(Runner& r) {
    if (!r.direct) r.dirty = true;
    if (r.current) {
        r.abandoned_fiber = true;
        fiber::before_abandon(&r.home);
    }
    siglongjmp(r.jb, 1);
}

[[noreturn, gnu::cold]] void abort_exited_at_barrier(Runner& r, int line, unsigned exited) {
    set_failure(r, kLaunchFailed, "barrier at line " + std::to_string(line) + " not reached by " +
                                      thread_name(r, exited) + ", which exited");
    jump_out(r);
}

[[noreturn, gnu::cold]] void abort_barrier_mismatch(Runner& r) {
    set_failure(r, kLaunchFailed, "block " + fmt(r.block_idx) + ": threads wait at different barriers: " +
                                      waiting_sites(r, State::kBarrier, 0, r.nthreads, "threads"));
    jump_out(r);
}

[[noreturn, gnu::cold]] void abort_lane_exited(Runner& r, const Fiber& f, unsigned lane) {
    set_failure(r, kLaunchFailed, (is_shuffle(f.op) ? "shuffle" : warp_op_name(f.op)) + std::string(" at line ") +
                                      std::to_string(f.line) + " names lane " + std::to_string(lane) +
                                      ", which exited (" + thread_name(r, (f.tid & ~31u) + lane) + ")");
    jump_out(r);
}

[[noreturn, gnu::cold]] void abort_warp_mismatch(Runner& r, unsigned w) {
    unsigned from = w * 32, to = std::min(from + 32, r.nthreads);
    set_failure(r, kLaunchFailed, "block " + fmt(r.block_idx) + ", warp " + std::to_string(w) +
                                      ": lanes meet at different warp operations (or masks): " +
                                      waiting_sites(r, State::kWarp, from, to, "lanes"));
    jump_out(r);
}

[[noreturn, gnu::cold]] void abort_bad_source(Runner& r, const Fiber& g, unsigned src) {
    bool exists = r.warp_exists[g.tid >> 5] >> src & 1;
    set_failure(r, kLaunchFailed, "shuffle at line " + std::to_string(g.line) + ": lane " + std::to_string(g.tid & 31) +
                                      " (" + thread_name(r, g.tid) + ") reads lane " + std::to_string(src) + ", " +
                                      (exists ? "which is not in the mask " + hex(g.mask)
                                              : "which is beyond the block (" + std::to_string(r.nthreads) + " threads)"));
    jump_out(r);
}

[[noreturn, gnu::cold]] void abort_bad_mask(Runner& r, const Fiber& f, int op, int line, unsigned mask) {
    set_failure(r, kLaunchFailed, std::string(warp_op_name(op)) + " at line " + std::to_string(line) + ": the mask " +
                                      hex(mask) + " of lane " + std::to_string(f.tid & 31) + " (" +
                                      thread_name(r, f.tid) + ") does not name the lane itself");
    jump_out(r);
}

[[noreturn, gnu::cold]] void abort_bad_width(Runner& r, int op, int line, int width) {
    set_failure(r, kLaunchFailed, std::string(warp_op_name(op)) + " at line " + std::to_string(line) + ": width " +
                                      std::to_string(width) + " is not a power of 2 <= 32");
    jump_out(r);
}

[[noreturn, gnu::cold]] void sync_in_direct_mode(const char* what, int line) {
    Runner& r = *tl_active;
    set_failure(r, kLaunchFailed, std::string("internal error: ") + what + " at line " + std::to_string(line) +
                                      " in a module the fake NVRTC compiled as having no barriers");
    jump_out(r);
}

// ---- Scheduling ------------------------------------------------------------------------------

inline Fiber* take_ready(Runner& r) {
    unsigned i = (unsigned)below(r, r.nready);
    unsigned t = r.ready[i];
    r.ready[i] = r.ready[--r.nready];
    return &r.fibers[t];
}

inline void make_ready(Runner& r, Fiber* f) {
    f->state = State::kReady;
    r.ready[r.nready++] = (uint16_t)f->tid;
}

// `f` stops (it waits or exited): continue a random ready fiber, or the home stack when none
// is ready. Returns when `f` is continued.
void yield(Runner& r, Fiber* f) {
    if (r.nready == 0) {
        r.current = nullptr;
        fiber::switch_to(&f->ctx, &r.home);
        return;
    }
    Fiber* g = take_ready(r);
    if (g == f) return;
    r.current = g;
    *r.slot = &g->ts;
    fiber::switch_to(&f->ctx, &g->ctx);
}

void thread_exit(Runner& r, Fiber* f) {
    f->state = State::kDone;
    r.nlive--;
    if (r.nexited++ == 0) r.first_exited = (int)f->tid;
    unsigned w = f->tid >> 5, lane = f->tid & 31;
    r.warp_exited[w] |= 1u << lane;
    if (r.nbarrier > 0) abort_exited_at_barrier(r, r.bar_line, f->tid);
    for (uint32_t m = r.warp_waiting[w]; m; m &= m - 1) {
        const Fiber& g = r.fibers[(w << 5) + __builtin_ctz(m)];
        if (g.mask >> lane & 1) abort_lane_exited(r, g, lane);
    }
    yield(r, f);
}

// A fiber's whole life: run the kernel as its thread, exit, and when continued again (a later
// block or launch), run the kernel again.
void fiber_main(void* arg) {
    fiber::on_fiber_start();
    Fiber* f = static_cast<Fiber*>(arg);
    Runner& r = *f->runner;
    for (;;) {
        r.kernel->thunk(r.params);
        thread_exit(r, f);
    }
}

void release_barrier(Runner& r) {
    if (r.bar_mismatch) abort_barrier_mismatch(r);
    int op = r.fibers[0].op;
    uint64_t res = op == fakecuda_abi::kBarCount ? r.bar_acc
                 : op == fakecuda_abi::kBarAnd   ? r.bar_acc == r.nthreads
                 : op == fakecuda_abi::kBarOr    ? r.bar_acc > 0
                                                 : 0;
    for (unsigned t = 0; t < r.nthreads; t++) {
        r.fibers[t].result = res;
        make_ready(r, &r.fibers[t]);
    }
    r.nbarrier = 0;
}

int on_barrier(const ThreadState* ts, int line, int site, int op, int pred) {
    Fiber* f = static_cast<Fiber*>(ts->exec);
    if (!f) sync_in_direct_mode("__syncthreads", line);
    Runner& r = *f->runner;
    if (r.nexited > 0) abort_exited_at_barrier(r, line, (unsigned)r.first_exited);
    f->state = State::kBarrier;
    f->line = line;
    f->site = site;
    f->op = op;
    if (r.nbarrier++ == 0) {
        r.bar_site = site;
        r.bar_line = line;
        r.bar_acc = 0;
        r.bar_mismatch = false;
    } else if (site != r.bar_site) {
        r.bar_mismatch = true;
    }
    r.bar_acc += pred != 0;
    if (r.nbarrier == r.nlive) release_barrier(r);
    yield(r, f);
    return (int)f->result;
}

// The lane whose value `lane` receives from a shuffle (itself when out of its segment).
unsigned source_lane(int op, unsigned lane, int arg, int width) {
    unsigned w = (unsigned)width, seg = lane & ~(w - 1), d = (unsigned)arg;
    switch (op) {
        case fakecuda_abi::kShflIdx: return seg + (d & (w - 1));
        case fakecuda_abi::kShflUp: return lane - seg >= d ? lane - d : lane;
        case fakecuda_abi::kShflDown: return (uint64_t)(lane - seg) + d < w ? lane + d : lane;
        default: {
            uint64_t s = lane ^ d;
            return s < seg + w ? (unsigned)s : lane;
        }
    }
}

// Every lane of `need` (warp w) has arrived: check they are at the same operation, then hand
// out the results and make them ready.
void complete_warp(Runner& r, unsigned w, uint32_t need, const Fiber* f) {
    Fiber* lanes = &r.fibers[w * 32];
    uint32_t ballot = 0;
    for (uint32_t m = need; m; m &= m - 1) {
        const Fiber& g = lanes[__builtin_ctz(m)];
        if (g.site != f->site || g.mask != f->mask) abort_warp_mismatch(r, w);
        if (g.value) ballot |= 1u << __builtin_ctz(m);
    }
    for (uint32_t m = need; m; m &= m - 1) {
        unsigned l = __builtin_ctz(m);
        Fiber& g = lanes[l];
        if (is_shuffle(g.op)) {
            unsigned s = source_lane(g.op, l, g.arg, g.width);
            if (s != l && !(need >> s & 1)) abort_bad_source(r, g, s);
            g.result = lanes[s].value;
        } else {
            g.result = g.op == fakecuda_abi::kBallot ? ballot
                     : g.op == fakecuda_abi::kAny    ? ballot != 0
                     : g.op == fakecuda_abi::kAll    ? ballot == need
                                                     : 0;
        }
    }
    for (uint32_t m = need; m; m &= m - 1) make_ready(r, &lanes[__builtin_ctz(m)]);
    r.warp_waiting[w] &= ~need;
}

uint64_t on_warp(const ThreadState* ts, int line, int site, int op, unsigned mask, uint64_t value,
                 int arg, int width) {
    Fiber* f = static_cast<Fiber*>(ts->exec);
    if (!f) sync_in_direct_mode(warp_op_name(op), line);
    Runner& r = *f->runner;
    unsigned lane = f->tid & 31, w = f->tid >> 5;
    if (!(mask >> lane & 1)) abort_bad_mask(r, *f, op, line, mask);
    if (is_shuffle(op) && (width < 1 || width > 32 || (width & (width - 1)))) abort_bad_width(r, op, line, width);
    f->state = State::kWarp;
    f->line = line;
    f->site = site;
    f->op = op;
    f->mask = mask;
    f->value = value;
    f->arg = arg;
    f->width = width;
    uint32_t need = mask & r.warp_exists[w];
    if (uint32_t gone = need & r.warp_exited[w]) abort_lane_exited(r, *f, __builtin_ctz(gone));
    r.warp_waiting[w] |= 1u << lane;
    if ((r.warp_waiting[w] & need) == need) complete_warp(r, w, need, f);
    yield(r, f);
    return f->result;
}

[[noreturn]] void on_trap(const ThreadState* ts, int code, const char* what, int line) {
    Runner& r = ts->exec ? *static_cast<Fiber*>(ts->exec)->runner : *tl_active;
    set_failure(r, code, std::string(what) + " at line " + std::to_string(line) + " in " +
                             (r.current ? thread_name(r, r.current->tid)
                                        : "thread " + fmt(ts->thread_idx) + " of block " + fmt(r.block_idx)));
    jump_out(r);
}

// Called on the home stack when no fiber is ready but some have not exited.
[[gnu::cold]] void report_deadlock(Runner& r) {
    std::string s;
    std::string bars = waiting_sites(r, State::kBarrier, 0, r.nthreads, "threads");
    if (!bars.empty()) s += "at barriers: " + bars;
    std::string warps = waiting_sites(r, State::kWarp, 0, r.nthreads, "threads");
    if (!warps.empty()) s += std::string(s.empty() ? "" : "; ") + "at warp operations (shuffles, votes): " + warps;
    r.result.code = kLaunchFailed;
    r.result.message = std::string("kernel ") + r.kernel->info.name + ": block " + fmt(r.block_idx) +
                       ": deadlock, no thread can go on; threads wait " + s;
    r.dirty = true;
}

// ---- Faults ----------------------------------------------------------------------------------

const int kFaultSignals[] = {SIGSEGV, SIGBUS, SIGFPE, SIGILL};
struct sigaction g_prev[NSIG];  // the handlers ours replaced
std::once_flag g_signals_once;

// Hands a fault that is not a kernel's to whoever handled it before us.
void forward_fault(int sig, siginfo_t* si, void* uc) {
    const struct sigaction& p = g_prev[sig];
    if ((p.sa_flags & SA_SIGINFO) && p.sa_sigaction) {
        p.sa_sigaction(sig, si, uc);
        return;
    }
    if (!(p.sa_flags & SA_SIGINFO) && p.sa_handler != SIG_DFL && p.sa_handler != SIG_IGN) {
        p.sa_handler(sig);
        return;
    }
    // Default action: restore it; a real fault happens again on return, a sent one is re-raised.
    signal(sig, SIG_DFL);
    if (si->si_code <= 0) raise(sig);
}

void on_fault(int sig, siginfo_t* si, void* uc) {
    Runner* r = tl_active;
    if (!r) return forward_fault(sig, si, uc);
    r->fault_sig = sig;
    r->fault_addr = si->si_addr;
    if (!r->direct) r->dirty = true;
    if (r->current) {
        r->abandoned_fiber = true;
        fiber::before_abandon(&r->home);
    }
    siglongjmp(r->jb, 2);
}

void install_signal_handlers() {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_fault;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&sa.sa_mask);
    for (int sig : kFaultSignals) sigaction(sig, &sa, &g_prev[sig]);
}

// The fault handler must run on a stack of its own (a fiber may have overflowed its stack);
// threads without an alternate signal stack get one (Rust's threads have one already).
void ensure_altstack(Runner& r) {
    stack_t cur;
    if (sigaltstack(nullptr, &cur) == 0 && !(cur.ss_flags & SS_DISABLE)) return;
    void* m = mmap(nullptr, kAltStackSize, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return;
    stack_t ss{};
    ss.ss_sp = m;
    ss.ss_size = kAltStackSize;
    if (sigaltstack(&ss, nullptr) != 0) {
        munmap(m, kAltStackSize);
        return;
    }
    r.altstack = (char*)m;
}

// The bounds of the OS thread's own stack (ASan must be told when a switch returns to it).
void find_home_stack(Runner& r) {
    pthread_attr_t a;
    if (pthread_getattr_np(pthread_self(), &a) != 0) return;
    void* lo = nullptr;
    size_t size = 0;
    if (pthread_attr_getstack(&a, &lo, &size) == 0) {
        r.home.stack_lo = (char*)lo;
        r.home.stack_size = size;
    }
    pthread_attr_destroy(&a);
}

Runner* this_runner() {
    if (!tl_runner) {
        std::call_once(g_signals_once, install_signal_handlers);
        tl_runner.reset(new (std::nothrow) Runner);
        if (!tl_runner) return nullptr;
        ensure_altstack(*tl_runner);
        find_home_stack(*tl_runner);
    }
    return tl_runner.get();
}

std::string fault_message(const Runner& r) {
    std::string who;
    if (r.direct) who = "thread " + fmt(r.direct_ts.thread_idx) + " of block " + fmt(r.block_idx);
    else if (r.current) who = thread_name(r, r.current->tid);
    else who = "block " + fmt(r.block_idx) + " (outside the kernel's code)";
    uint64_t addr = (uint64_t)(uintptr_t)r.fault_addr;
    if (r.fault_sig == SIGSEGV && r.current && r.current->stack.in_guard(r.fault_addr))
        return "stack overflow (fiber stacks are " + std::to_string(kStackSize >> 10) + " KiB) in " + who;
    switch (r.fault_sig) {
        case SIGSEGV: return "illegal address " + hex(addr) + " (SIGSEGV) in " + who;
        case SIGBUS: return "illegal address " + hex(addr) + " (SIGBUS) in " + who;
        case SIGFPE: return "arithmetic exception (SIGFPE, e.g. integer division by zero) at " + hex(addr) + " in " + who;
        default: return "illegal instruction (SIGILL) at " + hex(addr) + " in " + who;
    }
}

// ---- Launch ----------------------------------------------------------------------------------

bool setup_smem(Runner& r, size_t bytes, std::string& err) {
    r.smem_bytes = bytes;
#ifdef FAKECUDA_ASAN
    // Exactly `bytes`, so ASan itself reports any access past the end.
    r.smem = (char*)malloc(bytes ? bytes : 1);
    if (!r.smem) err = "cannot allocate " + std::to_string(bytes) + " bytes of dynamic shared memory";
    return r.smem != nullptr;
#else
    size_t need = kSmemAlign + bytes + kCanary;
    if (need > r.smem_cap) {
        free(r.smem_buf);
        r.smem_buf = nullptr;
        r.smem_cap = 0;
        void* p = nullptr;
        if (posix_memalign(&p, kSmemAlign, need) != 0) {
            err = "cannot allocate " + std::to_string(bytes) + " bytes of dynamic shared memory";
            return false;
        }
        r.smem_buf = (char*)p;
        r.smem_cap = need;
    }
    r.smem = r.smem_buf + kSmemAlign;
    memset(r.smem - kCanary, kCanaryByte, kCanary);
    memset(r.smem + bytes, kCanaryByte, kCanary);
    return true;
#endif
}

// After a block: were the canaries around dynamic shared memory overwritten?
bool check_smem(Runner& r) {
#ifndef FAKECUDA_ASAN
    for (size_t i = 0; i < kCanary; i++) {
        if ((unsigned char)r.smem[r.smem_bytes + i] != kCanaryByte) {
            r.result.code = kLaunchFailed;
            r.result.message = std::string("kernel ") + r.kernel->info.name + ": block " + fmt(r.block_idx) +
                               ": wrote past the " + std::to_string(r.smem_bytes) +
                               " bytes of dynamic shared memory (byte " + std::to_string(r.smem_bytes + i) +
                               " changed)";
            return false;
        }
        if ((unsigned char)r.smem[-(ptrdiff_t)kCanary + (ptrdiff_t)i] != kCanaryByte) {
            r.result.code = kLaunchFailed;
            r.result.message = std::string("kernel ") + r.kernel->info.name + ": block " + fmt(r.block_idx) +
                               ": wrote before the start of dynamic shared memory (byte -" +
                               std::to_string(kCanary - i) + " changed)";
            return false;
        }
    }
#else
    (void)r;
#endif
    return true;
}

// Gives every fiber the launch needs a stack, restarting all of them after a failed launch.
bool setup_fibers(Runner& r, std::string& err) {
    if (r.dirty) {
        for (unsigned i = 0; i < r.nstacks; i++) {
            fiber::scrub_stack(&r.fibers[i].ctx);
            fiber::init_ctx(&r.fibers[i].ctx, fiber_main, &r.fibers[i]);
        }
        r.dirty = false;
    }
    for (; r.nstacks < r.nthreads; r.nstacks++) {
        Fiber& f = r.fibers[r.nstacks];
        if (!fiber::alloc_stack(&f.stack, kStackSize)) {
            err = "cannot allocate fiber stacks for " + std::to_string(r.nthreads) + " threads";
            return false;
        }
        f.ctx.stack_lo = f.stack.lo();
        f.ctx.stack_size = f.stack.size();
        f.runner = &r;
        f.tid = r.nstacks;
        fiber::init_ctx(&f.ctx, fiber_main, &f);
    }
    for (unsigned t = 0; t < r.nthreads; t++) {
        ThreadState& ts = r.fibers[t].ts;
        ts.thread_idx = r.coords[t];
        ts.block_dim = U3{r.block.x, r.block.y, r.block.z};
        ts.grid_dim = U3{r.grid.x, r.grid.y, r.grid.z};
        ts.dyn_smem = r.smem;
        ts.exec = &r.fibers[t];
    }
    return true;
}

// Direct mode: one ThreadState, threads called in one shuffled order for the whole launch.
void setup_direct(Runner& r) {
    for (unsigned i = 0; i < r.nthreads; i++) r.order[i] = (uint16_t)i;
    for (unsigned i = r.nthreads; i > 1; i--) std::swap(r.order[i - 1], r.order[below(r, i)]);
    ThreadState& ts = r.direct_ts;
    ts.block_dim = U3{r.block.x, r.block.y, r.block.z};
    ts.grid_dim = U3{r.grid.x, r.grid.y, r.grid.z};
    ts.dyn_smem = r.smem;
    ts.exec = nullptr;
}

void setup_block_order(Runner& r) {
    r.affine = r.nblocks > (1u << 22);
    if (r.affine) {  // a random bijection without a table: i -> (a*i + c) mod n, gcd(a, n) = 1
        do r.affine_a = 1 + below(r, r.nblocks - 1);
        while (std::gcd(r.affine_a, r.nblocks) != 1);
        r.affine_c = below(r, r.nblocks);
        return;
    }
    r.block_order.resize(r.nblocks);
    for (uint32_t i = 0; i < r.nblocks; i++) r.block_order[i] = i;
    for (uint64_t i = r.nblocks; i > 1; i--) std::swap(r.block_order[i - 1], r.block_order[below(r, i)]);
}

bool prepare_launch(Runner& r, const Kernel* k, Dim3 grid, Dim3 block, size_t dyn, void* const* params,
                    uint64_t seed, std::string& err) {
    r.kernel = k;
    r.params = params;
    r.grid = grid;
    r.block = block;
    r.nthreads = block.x * block.y * block.z;
    r.nwarps = (r.nthreads + 31) / 32;
    r.nblocks = (uint64_t)grid.x * grid.y * grid.z;
    r.direct = k->module->no_sync;
    r.rng = seed ^ 0x6a09e667f3bcc908ull;
    r.result = RunResult();
    r.fault_sig = 0;
    r.abandoned_fiber = false;
    r.current = nullptr;
    r.slot = k->module->tls();
    for (unsigned t = 0; t < r.nthreads; t++)
        r.coords[t] = U3{t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
    for (unsigned w = 0; w < r.nwarps; w++) {
        unsigned lanes = std::min(32u, r.nthreads - 32 * w);
        r.warp_exists[w] = lanes == 32 ? ~0u : (1u << lanes) - 1;
    }
    if (!setup_smem(r, dyn, err)) return false;
    if (r.direct) setup_direct(r);
    else if (!setup_fibers(r, err)) return false;
    setup_block_order(r);
    return true;
}

void begin_block(Runner& r) {
    for (unsigned t = 0; t < r.nthreads; t++) {
        r.fibers[t].ts.block_idx = r.block_idx;
        r.fibers[t].state = State::kReady;
        r.ready[t] = (uint16_t)t;
    }
    r.nready = r.nlive = r.nthreads;
    r.nexited = 0;
    r.first_exited = -1;
    r.nbarrier = 0;
    r.bar_mismatch = false;
    memset(r.warp_waiting, 0, r.nwarps * sizeof(uint32_t));
    memset(r.warp_exited, 0, r.nwarps * sizeof(uint32_t));
}

void run_block_fibers(Runner& r) {
    begin_block(r);
    Fiber* g = take_ready(r);
    r.current = g;
    *r.slot = &g->ts;
    fiber::switch_to(&r.home, &g->ctx);  // returns when no fiber is ready
    r.current = nullptr;
    if (r.nlive > 0) report_deadlock(r);
}

void run_block_direct(Runner& r) {
    ThreadState& ts = r.direct_ts;
    ts.block_idx = r.block_idx;
    *r.slot = &ts;
    void (*thunk)(void* const*) = r.kernel->thunk;
    void* const* params = r.params;
    for (unsigned i = 0; i < r.nthreads; i++) {
        ts.thread_idx = r.coords[r.order[i]];
        thunk(params);
    }
}

void run_blocks(Runner& r) {
    const uint64_t gx = r.grid.x, gxy = (uint64_t)r.grid.x * r.grid.y;
    for (uint64_t i = 0; i < r.nblocks; i++) {
        uint64_t b = r.affine ? (uint64_t)(((unsigned __int128)r.affine_a * i + r.affine_c) % r.nblocks)
                              : r.block_order[i];
        r.block_idx = U3{(unsigned)(b % gx), (unsigned)((b % gxy) / gx), (unsigned)(b / gxy)};
        memset(r.smem, 0xFF, r.smem_bytes);  // "uninitialised" shared memory reads as NaN
        if (r.direct) run_block_direct(r);
        else run_block_fibers(r);
        if (r.result.code != 0 || !check_smem(r)) return;
    }
}

void end_launch(Runner& r) {
    if (r.slot) *r.slot = nullptr;
#ifdef FAKECUDA_ASAN
    free(r.smem);
    r.smem = nullptr;
#endif
}

RunResult invalid(const KernelInfo* k, const std::string& what) {
    RunResult res;
    res.code = kInvalidValue;
    res.message = std::string("kernel ") + (k && k->name ? k->name : "?") + ": " + what;
    return res;
}

}  // namespace
}  // namespace exec_impl

// ---- exec.h ----------------------------------------------------------------------------------

Module* load_module(const void* image, std::string& err) {
    using namespace exec_impl;
    if (!image) {
        err = "null module image";
        return nullptr;
    }
    ImageHeader h;
    memcpy(&h, image, sizeof h);
    if (memcmp(h.magic, kImageMagic, sizeof h.magic) != 0) {
        err = "not a fakecuda module image (no FAKECUDA magic): only the fake NVRTC's images load here";
        return nullptr;
    }
    if (h.abi != fakecuda_abi::kAbiVersion) {
        err = "module image of ABI version " + std::to_string(h.abi) + ", this libcuda.so runs version " +
              std::to_string(fakecuda_abi::kAbiVersion) + " (rebuild the fake libraries)";
        return nullptr;
    }
    if (h.so_size < 64 || h.so_size > (1ull << 32)) {
        err = "module image with an implausible size (" + std::to_string(h.so_size) + " bytes)";
        return nullptr;
    }
    std::unique_ptr<Module> m(new Module);
    if (!write_object(m.get(), static_cast<const char*>(image) + sizeof h, h.so_size, err)) return nullptr;
    m->handle = dlopen(m->path.c_str(), RTLD_NOW | RTLD_LOCAL);
    bool is_memfd = m->path.compare(0, 14, "/proc/self/fd/") == 0;
    if (!is_memfd) unlink(m->path.c_str());  // the mapping stays
    if (!m->handle) {
        const char* e = dlerror();
        err = std::string("cannot load the module: ") + (e ? e : "dlopen failed");
        close(m->fd);
        return nullptr;
    }
    if (!bind_module(m.get(), err)) {
        dlclose(m->handle);
        release_file(m.get());
        return nullptr;
    }
    if (!is_memfd) {
        close(m->fd);
        m->fd = -1;
    }
    return m.release();
}

void unload_module(Module* m) {
    if (!m) return;
    dlclose(m->handle);
    exec_impl::release_file(m);
    delete m;
}

const KernelInfo* find_kernel(Module* m, const char* name) {
    if (!m || !name) return nullptr;
    for (const exec_impl::Kernel& k : m->kernels)
        if (strcmp(k.info.name, name) == 0) return &k.info;
    return nullptr;
}

RunResult run_grid(const KernelInfo* info, Dim3 grid, Dim3 block, size_t dyn_smem_bytes, void* const* params,
                   uint64_t seed) {
    using namespace exec_impl;
    if (!info) return invalid(info, "no kernel");
    uint64_t nthreads = (uint64_t)block.x * block.y * block.z;
    if (nthreads == 0 || (uint64_t)grid.x * grid.y * grid.z == 0)
        return invalid(info, "empty launch: grid " + fmt(U3{grid.x, grid.y, grid.z}) + ", block " +
                                 fmt(U3{block.x, block.y, block.z}));
    if (nthreads > kMaxThreads)
        return invalid(info, "a block of " + std::to_string(nthreads) + " threads (at most 1024)");
    if (tl_active) return invalid(info, "run_grid called while this thread runs a grid");
    Runner* r = this_runner();
    if (!r) return RunResult{kOutOfMemory, "cannot allocate the executor's state"};
    std::string err;
    const Kernel* k = reinterpret_cast<const Kernel*>(info);
    if (!prepare_launch(*r, k, grid, block, dyn_smem_bytes, params, seed, err)) {
        end_launch(*r);
        return RunResult{kOutOfMemory, std::string("kernel ") + info->name + ": " + err};
    }
    tl_active = r;
    if (sigsetjmp(r->jb, 1) == 0) {
        run_blocks(*r);
    } else {  // back from jump_out or the fault handler
        if (r->abandoned_fiber) fiber::after_abandon();
        if (r->fault_sig) {
            r->result.code = r->fault_sig == SIGILL ? kIllegalInstruction
                           : r->fault_sig == SIGFPE ? kLaunchFailed
                                                    : kIllegalAddress;
            r->result.message = std::string("kernel ") + info->name + ": " + fault_message(*r);
        }
        r->current = nullptr;
    }
    tl_active = nullptr;
    end_launch(*r);
    return std::move(r->result);
}

}  // namespace fakecuda
