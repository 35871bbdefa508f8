// The fake CUDA driver: libcuda.so (with the kernel executor, exec.cpp) for running Horizon's
// CUDA backend unchanged on a CPU-only machine, through cudarc's dynamic loading. It exports the
// driver entry points cudarc calls, with cudarc's signatures, and behaves like CUDA where the
// backend's bugs would show on a GPU:
//   - one primary context per device (refcounted); a thread-local current context, required by
//     every call that touches memory, streams, events, modules or launches;
//   - every stream is an ordered worker thread; the NULL stream is the legacy default stream
//     (it waits for the blocking streams, and they for it; non-blocking streams are independent);
//   - events are markers recorded in stream order; cuStreamWaitEvent waits for the record that
//     was the event's latest at the time of the call;
//   - device memory is one mmap per allocation between PROT_NONE guard pages, filled with 0xFF
//     (a NaN in f32, bf16 and f64); freed memory becomes PROT_NONE and stays reserved for a while;
//   - copies, memsets and launches check their device ranges and pointer arguments against the
//     live allocations; pageable and pinned host memory follow NVIDIA's "API synchronization
//     behavior"; a failing kernel leaves the context with a sticky error.
// Device addresses are host addresses: kernels (exec.h's run_grid) run on the stream workers and
// dereference them. Environment: FAKECUDA_DEVICES, FAKECUDA_MEMORY_BYTES, FAKECUDA_SEED,
// FAKECUDA_JITTER_US (read by cuInit). The extra entry points for cuBLAS are in driver_api.h.
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_set>
#include <vector>

#include "complain.h"
#include "driver_api.h"
#include "driver_types.h"
#include "exec.h"

#define CUAPI extern "C" __attribute__((visibility("default")))

namespace fakecuda {
namespace {

using Clock = std::chrono::steady_clock;

// ---- configuration and messages ----------------------------------------------------------------

constexpr const char* kDeviceName = "fakecuda (Horizon's CUDA test double, sm_90)";
constexpr int kDriverVersion = 13000;
constexpr size_t kAllocAlign = 256;
constexpr int kDefaultSmemLimit = 49152;     // per block, without opting in
constexpr int kOptinSmemLimit = 232448;      // CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN
constexpr size_t kQuarantineBytes = 1ull << 30;  // address space kept PROT_NONE after frees

struct Config {
    int devices = 1;
    size_t memory = 8ull << 30;
    uint64_t seed = 0;
    unsigned jitter_us = 0;
    size_t page = 4096;
    // FAKECUDA_FAIL_KERNEL=name[:n]: the n-th (default 1st) launch of kernel `name` fails when
    // it runs, as a GPU fault would (CUDA_ERROR_LAUNCH_FAILED, sticky): for tests of how a run
    // reports a failed launch.
    std::string fail_kernel;
    uint64_t fail_nth = 0;
    std::atomic<uint64_t> fail_seen{0};
};

Config& cfg() {
    static Config* c = new Config;  // never destroyed: worker threads may outlive exit()
    return *c;
}

// An unsigned integer from the environment, with an optional K, M or G suffix (powers of 1024).
uint64_t env_u64(const char* name, uint64_t dflt) {
    const char* v = getenv(name);
    if (!v || !*v) return dflt;
    char* end = nullptr;
    unsigned long long x = strtoull(v, &end, 0);
    switch (end && *end ? *end : 0) {
        case 'k': case 'K': x <<= 10; break;
        case 'm': case 'M': x <<= 20; break;
        case 'g': case 'G': x <<= 30; break;
        default: break;
    }
    return x;
}

void read_config() {
    Config& c = cfg();
    c.devices = (int)std::min<uint64_t>(env_u64("FAKECUDA_DEVICES", 1), 16);
    c.memory = env_u64("FAKECUDA_MEMORY_BYTES", 8ull << 30);
    c.seed = env_u64("FAKECUDA_SEED", 0);
    c.jitter_us = (unsigned)std::min<uint64_t>(env_u64("FAKECUDA_JITTER_US", 0), 1000000);
    if (const char* v = getenv("FAKECUDA_FAIL_KERNEL"); v && *v) {
        std::string spec(v);
        size_t colon = spec.find(':');
        c.fail_kernel = spec.substr(0, colon);
        c.fail_nth = colon == std::string::npos ? 1 : strtoull(spec.c_str() + colon + 1, nullptr, 0);
    }
    long page = sysconf(_SC_PAGESIZE);
    c.page = page > 0 ? (size_t)page : 4096;
}

using fakecuda::complain;

const char* error_name(int code) {
#define FAKECUDA_CU_NAME(name, value, text) \
    if (code == value) return #name;
    FAKECUDA_CU_ERRORS(FAKECUDA_CU_NAME)
#undef FAKECUDA_CU_NAME
    return nullptr;
}

const char* error_text(int code) {
#define FAKECUDA_CU_TEXT(name, value, text) \
    if (code == value) return text;
    FAKECUDA_CU_ERRORS(FAKECUDA_CU_TEXT)
#undef FAKECUDA_CU_TEXT
    return nullptr;
}

uint64_t splitmix64(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

// ---- state -------------------------------------------------------------------------------------

// One cuEventRecord: completed when the stream's worker reaches it.
struct Record {
    bool done = false;
    Clock::time_point at;
};
using RecordPtr = std::shared_ptr<Record>;

struct Stream;
using StreamPtr = std::shared_ptr<Stream>;

// One operation of a stream's queue.
struct Op {
    enum Kind { Work, MarkRecord, WaitRecord, WaitStream } kind = Work;
    std::function<void(bool failed)> work;  // Work: called with failed = sticky error (skip)
    RecordPtr rec;                          // MarkRecord, WaitRecord
    StreamPtr other;                        // WaitStream: until other->done >= upto
    uint64_t upto = 0;
};

struct Context;

// A stream: a queue drained in order by its own worker thread. Fields under G().sched.
struct Stream : std::enable_shared_from_this<Stream> {
    Context* ctx = nullptr;
    unsigned flags = CU_STREAM_DEFAULT;
    bool legacy = false;  // the NULL stream
    std::deque<Op> queue;
    uint64_t submitted = 0;  // ops ever enqueued
    uint64_t done = 0;       // ops completed (in order)
    bool stopping = false;   // destroyed: exit once the queue is empty
    uint64_t rng = 0;        // jitter (worker only)
    std::condition_variable work_cv;  // the worker's: work arrived or stopping
};

// A device's primary context. Never freed (handles stay comparable; workers may outlive exit).
struct Context {
    int device = 0;
    int refs = 0;                          // under G().primary
    std::atomic<bool> active{false};       // refs > 0
    std::atomic<int> sticky{0};            // the first kernel failure, returned by every call
    std::atomic<uint64_t> launches{0};     // seeds run_grid
    StreamPtr null_stream;                 // under G().sched
    std::vector<StreamPtr> workers;        // streams whose worker runs (incl. destroyed, draining)
    std::unordered_set<Stream*> live;      // handles from cuStreamCreate, not yet destroyed
    unsigned serial = 0;                   // streams created (jitter seeds)
    size_t used = 0;                       // device bytes charged, under G().mem.mu
};

struct Event {
    Context* ctx = nullptr;
    unsigned flags = 0;
    RecordPtr latest;  // under G().sched; null until recorded
};

struct Function {
    const KernelInfo* info = nullptr;
    Context* ctx = nullptr;
    int max_dyn_smem = kDefaultSmemLimit;
};

struct LoadedModule {
    Context* ctx = nullptr;
    Module* mod = nullptr;
    std::map<std::string, Function*> funcs;
};

// A device allocation: the whole mapping (guard pages included) and the user's range.
struct Alloc {
    uintptr_t map = 0;
    size_t map_len = 0;
    uintptr_t ptr = 0;
    size_t size = 0;
    size_t charged = 0;
    Context* ctx = nullptr;
};

// A cuMemHostAlloc allocation: the bytes asked for (checked), the mapping (page-rounded) and
// the thread that asked (fakecuda_host_alloc_bytes); or a cuMemHostRegister range (mapped ==
// bytes).
struct HostAlloc {
    size_t bytes = 0;
    size_t mapped = 0;
    std::thread::id owner;
    bool registered = false;  // cuMemHostRegister: the caller's memory, not a mapping of ours
};

struct Memory {
    std::mutex mu;
    std::map<uintptr_t, Alloc> live;    // by ptr
    std::map<uintptr_t, Alloc> freed;   // quarantined, by ptr
    std::deque<uintptr_t> fifo;         // quarantine order
    size_t quarantined = 0;             // bytes of address space in quarantine
    std::map<uintptr_t, HostAlloc> host;  // cuMemHostAlloc and cuMemHostRegister, by ptr
    std::atomic<size_t> pageable_copies{0};  // copies to or from pageable host memory so far
};

// Lock order: primary -> reg -> sched; mem.mu is never held with another lock.
struct Globals {
    std::mutex primary;  // retain/release (and a context's activation or reset)
    std::mutex reg;      // the handle registries below
    std::mutex sched;    // streams, queues, records
    std::condition_variable cv;  // progress under `sched`: an op done, a record, a sticky error
    std::vector<Context*> contexts;
    std::unordered_set<Event*> events;
    std::unordered_set<LoadedModule*> modules;
    std::unordered_set<Function*> functions;
    Memory mem;
    std::atomic<bool> initialized{false};
    std::atomic<bool> exiting{false};
};

Globals& G() {
    static Globals* g = new Globals;  // never destroyed (see Context)
    return *g;
}

// The calling thread's context stack (cuCtxPush/Pop); the top is current. Trivially
// destructible on purpose.
constexpr int kStackDepth = 32;
thread_local Context* tls_stack[kStackDepth];
thread_local int tls_depth = 0;

Context* current() { return tls_depth ? tls_stack[tls_depth - 1] : nullptr; }

Context* context_of(CUcontext h) {
    for (Context* c : G().contexts)
        if ((CUcontext)c == h) return c;
    return nullptr;
}

// The current context for a call that needs one: CUDA_ERROR_NOT_INITIALIZED before cuInit,
// CUDA_ERROR_INVALID_CONTEXT without one, its sticky error unless `allow_sticky`.
CUresult enter(Context*& c, bool allow_sticky = false) {
    if (!G().initialized) return CUDA_ERROR_NOT_INITIALIZED;
    c = current();
    if (!c || !c->active) return CUDA_ERROR_INVALID_CONTEXT;
    int sticky = c->sticky.load();
    return sticky && !allow_sticky ? sticky : CUDA_SUCCESS;
}

CUresult sticky_or(Context& c, CUresult otherwise = CUDA_SUCCESS) {
    int sticky = c.sticky.load();
    return sticky ? sticky : otherwise;
}

// Puts the context in the failed state (the first error wins) and wakes every waiter.
void set_sticky(Context& c, int code, const std::string& message) {
    if (!error_name(code) || code == CUDA_SUCCESS) code = CUDA_ERROR_LAUNCH_FAILED;
    int expected = 0;
    if (c.sticky.compare_exchange_strong(expected, code)) {
        complain("%s", message.c_str());
        complain("the context of device %d has the sticky error %s (%d): every later call on it "
                 "returns it", c.device, error_name(code), code);
    }
    std::lock_guard<std::mutex> lk(G().sched);
    G().cv.notify_all();
}

// ---- streams -----------------------------------------------------------------------------------

void jitter(Stream& s) {
    unsigned max_us = cfg().jitter_us;
    if (!max_us) return;
    s.rng = splitmix64(s.rng);
    std::this_thread::sleep_for(std::chrono::microseconds(s.rng % (max_us + 1)));
}

void run_op(Context& c, Op& op) {
    Globals& g = G();
    switch (op.kind) {
        case Op::Work:
            op.work(c.sticky.load() != 0 || g.exiting.load());
            return;
        case Op::MarkRecord: {
            std::lock_guard<std::mutex> lk(g.sched);
            op.rec->at = Clock::now();
            op.rec->done = true;
            g.cv.notify_all();
            return;
        }
        case Op::WaitRecord: {
            std::unique_lock<std::mutex> lk(g.sched);
            g.cv.wait(lk, [&] { return op.rec->done || c.sticky.load() || g.exiting.load(); });
            return;
        }
        case Op::WaitStream: {
            std::unique_lock<std::mutex> lk(g.sched);
            g.cv.wait(lk, [&] {
                return op.other->done >= op.upto || c.sticky.load() || g.exiting.load();
            });
            return;
        }
    }
}

// A stream's worker: runs the queue in order until the stream is destroyed and drained.
void worker_main(StreamPtr s) {
    Globals& g = G();
    Context& c = *s->ctx;
    std::unique_lock<std::mutex> lk(g.sched);
    for (;;) {
        s->work_cv.wait(lk, [&] { return !s->queue.empty() || s->stopping; });
        if (s->queue.empty()) break;
        Op op = std::move(s->queue.front());
        s->queue.pop_front();
        lk.unlock();
        jitter(*s);
        run_op(c, op);
        op = Op();  // release what the op captured before taking the lock
        lk.lock();
        ++s->done;
        g.cv.notify_all();
    }
    c.workers.erase(std::find(c.workers.begin(), c.workers.end(), s));
    g.cv.notify_all();
}

// Starts a stream and its worker.
CUresult start_stream(Context& c, unsigned flags, bool legacy, StreamPtr* out) {
    auto s = std::make_shared<Stream>();
    s->ctx = &c;
    s->flags = flags;
    s->legacy = legacy;
    {
        std::lock_guard<std::mutex> lk(G().sched);
        uint64_t serial = c.serial++;
        s->rng = splitmix64(cfg().seed ^ ((uint64_t)(c.device + 1) << 40) ^ serial);
        c.workers.push_back(s);
    }
    try {
        std::thread(worker_main, s).detach();
    } catch (...) {
        std::lock_guard<std::mutex> lk(G().sched);
        c.workers.erase(std::find(c.workers.begin(), c.workers.end(), s));
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    *out = s;
    return CUDA_SUCCESS;
}

// The stream a handle names in `c` (sched held): the legacy stream for 0 and the two default
// stream handles, null for anything that is not a live stream of `c`.
Stream* resolve_locked(Context& c, CUstream h) {
    if (!h || h == FAKECUDA_CU_STREAM_LEGACY || h == FAKECUDA_CU_STREAM_PER_THREAD)
        return c.null_stream.get();
    Stream* s = reinterpret_cast<Stream*>(h);
    return c.live.count(s) ? s : nullptr;
}

void push_raw_locked(Stream& s, Op op) {
    s.queue.push_back(std::move(op));
    ++s.submitted;
    s.work_cv.notify_one();
}

void stop_locked(Stream& s) {
    s.stopping = true;
    s.work_cv.notify_one();
}

Op wait_stream_op(const StreamPtr& other) {
    Op op;
    op.kind = Op::WaitStream;
    op.other = other;
    op.upto = other->submitted;
    return op;
}

// The legacy default stream's implicit ordering (sched held): work on the NULL stream waits for
// all blocking streams; work on a blocking stream waits for the NULL stream.
void legacy_waits_locked(Stream& s) {
    Context& c = *s.ctx;
    if (s.legacy) {
        for (const StreamPtr& o : c.workers)
            if (!o->legacy && o->flags == CU_STREAM_DEFAULT && o->done < o->submitted)
                push_raw_locked(s, wait_stream_op(o));
    } else if (s.flags == CU_STREAM_DEFAULT && c.null_stream) {
        const StreamPtr& n = c.null_stream;
        if (n->done < n->submitted) push_raw_locked(s, wait_stream_op(n));
    }
}

// Appends `op` to `s` (sched held); returns its position (wait for done >= position).
uint64_t push_locked(Stream& s, Op op) {
    legacy_waits_locked(s);
    push_raw_locked(s, std::move(op));
    return s.submitted;
}

// Where an enqueued op is, to wait for it.
struct Pos {
    StreamPtr stream;
    uint64_t at = 0;
};

CUresult bad_stream(const char* what, CUstream h) {
    complain("%s: stream %p is not a live stream of the current context", what, (void*)h);
    return CUDA_ERROR_INVALID_HANDLE;
}

// Enqueues `op` on stream `h` of `c`.
CUresult enqueue(Context& c, CUstream h, Op op, const char* what, Pos* pos = nullptr) {
    std::lock_guard<std::mutex> lk(G().sched);
    Stream* s = resolve_locked(c, h);
    if (!s) return bad_stream(what, h);
    uint64_t at = push_locked(*s, std::move(op));
    if (pos) *pos = Pos{s->shared_from_this(), at};
    return CUDA_SUCCESS;
}

CUresult enqueue_work(Context& c, CUstream h, std::function<void(bool)> work, const char* what,
                      Pos* pos = nullptr) {
    Op op;
    op.work = std::move(work);
    return enqueue(c, h, std::move(op), what, pos);
}

void wait_for(const Pos& p) {
    std::unique_lock<std::mutex> lk(G().sched);
    G().cv.wait(lk, [&] { return p.stream->done >= p.at; });
}

// Waits for everything enqueued so far on every stream of `c` (destroyed ones included).
void drain(Context& c) {
    std::unique_lock<std::mutex> lk(G().sched);
    std::vector<std::pair<StreamPtr, uint64_t>> targets;
    for (const StreamPtr& s : c.workers) targets.emplace_back(s, s->submitted);
    for (auto& t : targets) G().cv.wait(lk, [&] { return t.first->done >= t.second; });
}

// ---- memory ------------------------------------------------------------------------------------

// The allocation of `m` containing address p (end inclusive when `end_ok`), or null.
const Alloc* containing(const std::map<uintptr_t, Alloc>& m, uintptr_t p, bool end_ok = false) {
    auto it = m.upper_bound(p);
    if (it == m.begin()) return nullptr;
    --it;
    const Alloc& a = it->second;
    return p < a.ptr + a.size || (end_ok && p == a.ptr + a.size) ? &a : nullptr;
}

// The last allocation of `m` that intersects [p, p + n), or null.
const Alloc* overlapping(const std::map<uintptr_t, Alloc>& m, uintptr_t p, size_t n) {
    auto it = m.lower_bound(p + std::max<size_t>(n, 1));
    if (it == m.begin()) return nullptr;
    --it;
    return it->second.ptr + it->second.size > p ? &it->second : nullptr;
}

// Where p is relative to the allocations (mem.mu held), for messages.
std::string describe_near(uintptr_t p) {
    Memory& m = G().mem;
    char buf[256];
    if (const Alloc* f = containing(m.freed, p, true)) {
        snprintf(buf, sizeof buf, "it lies in an allocation freed earlier (0x%llx, %zu bytes)",
                 (unsigned long long)f->ptr, f->size);
        return buf;
    }
    const Alloc* below = nullptr;
    const Alloc* above = nullptr;
    auto it = m.live.upper_bound(p);
    if (it != m.live.end()) above = &it->second;
    if (it != m.live.begin()) below = &std::prev(it)->second;
    uintptr_t d_below = below ? p - below->ptr : UINTPTR_MAX;
    uintptr_t d_above = above ? above->ptr - p : UINTPTR_MAX;
    if (!below && !above) return "there is no live allocation";
    if (below && (d_below <= d_above || !above)) {
        if (p < below->ptr + below->size)
            snprintf(buf, sizeof buf, "it starts %llu bytes into the allocation 0x%llx of %zu bytes",
                     (unsigned long long)d_below, (unsigned long long)below->ptr, below->size);
        else
            snprintf(buf, sizeof buf,
                     "the nearest allocation is 0x%llx of %zu bytes, which ends %llu bytes before",
                     (unsigned long long)below->ptr, below->size,
                     (unsigned long long)(p - below->ptr - below->size));
        return buf;
    }
    snprintf(buf, sizeof buf,
             "the nearest allocation is 0x%llx of %zu bytes, which starts %llu bytes after",
             (unsigned long long)above->ptr, above->size, (unsigned long long)d_above);
    return buf;
}

CUresult check_range_locked(uintptr_t p, size_t n, const char* what) {
    const Alloc* a = containing(G().mem.live, p);
    if (a && p + n >= p && p + n <= a->ptr + a->size) return CUDA_SUCCESS;
    std::string where = describe_near(p);
    if (a) {
        char buf[160];
        snprintf(buf, sizeof buf, "; it runs %llu bytes past that allocation's end",
                 (unsigned long long)(p + n - a->ptr - a->size));
        where += buf;
    }
    complain("%s: device range 0x%llx + %zu bytes is not inside a live allocation: %s", what,
             (unsigned long long)p, n, where.c_str());
    return CUDA_ERROR_INVALID_VALUE;
}

CUresult check_range(uintptr_t p, size_t n, const char* what) {
    std::lock_guard<std::mutex> lk(G().mem.mu);
    return check_range_locked(p, n, what);
}

enum class HostKind { Pageable, Pinned, Bad };

// What kind of host memory [p, p + n) is; Bad (with a message) when it is device memory or runs
// past the end of a cuMemHostAlloc allocation.
HostKind host_kind(const void* ptr, size_t n, const char* what, const char* role) {
    Memory& m = G().mem;
    uintptr_t p = (uintptr_t)ptr;
    std::lock_guard<std::mutex> lk(m.mu);
    const Alloc* d = overlapping(m.live, p, n);
    if (!d) d = overlapping(m.freed, p, n);
    if (d) {
        complain("%s: the host %s 0x%llx + %zu bytes is %s device memory (allocation 0x%llx of "
                 "%zu bytes)", what, role, (unsigned long long)p, n,
                 m.live.count(d->ptr) ? "live" : "freed", (unsigned long long)d->ptr, d->size);
        return HostKind::Bad;
    }
    auto it = m.host.upper_bound(p);
    if (it == m.host.begin()) return HostKind::Pageable;
    --it;
    if (p >= it->first + it->second.mapped) return HostKind::Pageable;
    uintptr_t end = it->first + it->second.bytes;
    if (p + n <= end) return HostKind::Pinned;
    complain("%s: the host %s 0x%llx + %zu bytes runs %llu bytes past the end of the "
             "cuMemHostAlloc allocation 0x%llx of %zu bytes", what, role, (unsigned long long)p, n,
             (unsigned long long)(p + n - end), (unsigned long long)it->first, it->second.bytes);
    return HostKind::Bad;
}

// Maps an allocation: guard page, data pages, guard page; the user range ends as close to the
// upper guard as 256-byte alignment allows; everything readable is 0xFF.
bool map_alloc(size_t size, Alloc& a) {
    size_t page = cfg().page;
    size_t rsz = round_up(size, kAllocAlign);
    size_t data = round_up(rsz, page);
    size_t len = data + 2 * page;
    void* m = mmap(nullptr, len, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (m == MAP_FAILED) return false;
    char* base = (char*)m;
    if (mprotect(base + page, data, PROT_READ | PROT_WRITE) != 0) {
        munmap(m, len);
        return false;
    }
    memset(base + page, 0xFF, data);
    a.map = (uintptr_t)m;
    a.map_len = len;
    a.ptr = (uintptr_t)(base + page + data - rsz);
    a.size = size;
    return true;
}

bool all_ff(uintptr_t from, uintptr_t to) {
    for (const unsigned char* q = (const unsigned char*)from; q < (const unsigned char*)to; ++q)
        if (*q != 0xFF) return false;
    return true;
}

// Whether the slack around the user range (inside the data pages) still holds its 0xFF.
bool slack_intact(const Alloc& a) {
    size_t page = cfg().page;
    uintptr_t data_end = a.map + a.map_len - page;
    return all_ff(a.map + page, a.ptr) && all_ff(a.ptr + a.size, data_end);
}

// Makes a freed allocation inaccessible and keeps its address space reserved (mem.mu held);
// the oldest quarantined ranges are unmapped past kQuarantineBytes.
void retire_locked(const Alloc& a) {
    Memory& m = G().mem;
    mprotect((void*)a.map, a.map_len, PROT_NONE);
    madvise((void*)a.map, a.map_len, MADV_DONTNEED);
    m.freed[a.ptr] = a;
    m.fifo.push_back(a.ptr);
    m.quarantined += a.map_len;
    while (m.quarantined > kQuarantineBytes && m.fifo.size() > 1) {
        auto it = m.freed.find(m.fifo.front());
        m.fifo.pop_front();
        munmap((void*)it->second.map, it->second.map_len);
        m.quarantined -= it->second.map_len;
        m.freed.erase(it);
    }
}

CUresult alloc_device(Context& c, size_t bytes, CUdeviceptr* out) {
    Memory& m = G().mem;
    size_t cap = cfg().memory;
    size_t charged = bytes > cap ? cap + 1 : round_up(bytes, kAllocAlign);
    {
        std::lock_guard<std::mutex> lk(m.mu);
        if (charged > cap - std::min(cap, c.used)) {
            complain("cuMemAlloc_v2: out of memory: %zu bytes requested, %zu of %zu in use "
                     "(FAKECUDA_MEMORY_BYTES)", bytes, c.used, cap);
            return CUDA_ERROR_OUT_OF_MEMORY;
        }
        c.used += charged;
    }
    Alloc a;
    bool ok = map_alloc(bytes, a);
    std::lock_guard<std::mutex> lk(m.mu);
    if (!ok) {
        c.used -= charged;
        complain("cuMemAlloc_v2: mmap of %zu bytes failed", bytes);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    a.charged = charged;
    a.ctx = &c;
    m.live[a.ptr] = a;
    *out = a.ptr;
    return CUDA_SUCCESS;
}

// Takes the live allocation starting at p out of the table; false (with a message) if none.
bool take_alloc(uintptr_t p, Alloc& a, const char* what) {
    Memory& m = G().mem;
    std::lock_guard<std::mutex> lk(m.mu);
    auto it = m.live.find(p);
    if (it == m.live.end()) {
        if (m.freed.count(p))
            complain("%s: 0x%llx was freed already (double free)", what, (unsigned long long)p);
        else
            complain("%s: 0x%llx is not the start of a live allocation: %s", what,
                     (unsigned long long)p, describe_near(p).c_str());
        return false;
    }
    a = it->second;
    m.live.erase(it);
    a.ctx->used -= a.charged;
    return true;
}

// Frees a taken allocation; reports an overwritten slack (a write out of bounds) as a sticky
// illegal address on its context.
void release_alloc(const Alloc& a) {
    bool intact = slack_intact(a);
    {
        std::lock_guard<std::mutex> lk(G().mem.mu);
        retire_locked(a);
    }
    if (!intact) {
        char buf[256];
        snprintf(buf, sizeof buf, "cuMemFree_v2: the bytes around allocation 0x%llx (%zu bytes) "
                 "were overwritten: something wrote out of its bounds",
                 (unsigned long long)a.ptr, a.size);
        set_sticky(*a.ctx, CUDA_ERROR_ILLEGAL_ADDRESS, buf);
    }
}

void release_all_memory(Context& c) {
    std::vector<Alloc> mine;
    {
        std::lock_guard<std::mutex> lk(G().mem.mu);
        for (auto& [p, a] : G().mem.live)
            if (a.ctx == &c) mine.push_back(a);
    }
    for (const Alloc& a : mine) {
        Alloc taken;
        if (take_alloc(a.ptr, taken, "context reset")) release_alloc(taken);
    }
}

// ---- contexts ----------------------------------------------------------------------------------

CUresult activate(Context& c) {
    StreamPtr s;
    CUresult e = start_stream(c, CU_STREAM_DEFAULT, true, &s);
    if (e) return e;
    {
        std::lock_guard<std::mutex> lk(G().sched);
        c.null_stream = s;
    }
    c.sticky = 0;
    c.active = true;
    return CUDA_SUCCESS;
}

void drop_objects_of(Context& c) {
    Globals& g = G();
    std::lock_guard<std::mutex> lk(g.reg);
    for (auto it = g.events.begin(); it != g.events.end();) {
        if ((*it)->ctx == &c) {
            delete *it;
            it = g.events.erase(it);
        } else {
            ++it;
        }
    }
    for (auto it = g.modules.begin(); it != g.modules.end();) {
        LoadedModule* lm = *it;
        if (lm->ctx != &c) {
            ++it;
            continue;
        }
        for (auto& [name, f] : lm->funcs) g.functions.erase(f);  // Functions leak on purpose
        unload_module(lm->mod);
        delete lm;
        it = g.modules.erase(it);
    }
}

// The last release of a primary context destroys it: its work drains, its streams stop, its
// memory, events and modules go, and its sticky error is cleared (as on CUDA).
void deactivate(Context& c) {
    Globals& g = G();
    c.active = false;
    drain(c);
    {
        std::unique_lock<std::mutex> lk(g.sched);
        c.live.clear();
        c.null_stream.reset();
        for (const StreamPtr& s : c.workers) stop_locked(*s);
        g.cv.wait(lk, [&] { return c.workers.empty(); });
    }
    drop_objects_of(c);
    release_all_memory(c);
    c.sticky = 0;
}

// At exit: stop running queued work and give the workers a moment to leave kernels, so that no
// worker runs while libraries' static destructors do.
void at_exit() {
    Globals& g = G();
    g.exiting = true;
    std::unique_lock<std::mutex> lk(g.sched);
    g.cv.notify_all();
    g.cv.wait_for(lk, std::chrono::seconds(1), [&] {
        for (Context* c : g.contexts)
            for (const StreamPtr& s : c->workers)
                if (s->done < s->submitted) return false;
        return true;
    });
}

// ---- events and registries ---------------------------------------------------------------------

// Lookups under g.reg.
template <class T>
T* find_in(const std::unordered_set<T*>& set, const void* h) {
    T* p = (T*)h;
    return set.count(p) ? p : nullptr;
}

CUresult bad_event(const char* what, CUevent e) {
    complain("%s: %p is not a live event", what, (void*)e);
    return CUDA_ERROR_INVALID_HANDLE;
}

// The event's latest record, or null.
RecordPtr latest_record(Event* ev) {
    std::lock_guard<std::mutex> lk(G().sched);
    return ev->latest;
}

CUresult elapsed(float* ms, CUevent start, CUevent end) {
    Context* c;
    CUresult e = enter(c);
    if (e) return e;
    if (!ms) return CUDA_ERROR_INVALID_VALUE;
    std::lock_guard<std::mutex> lk(G().reg);
    Event* a = find_in(G().events, start);
    Event* b = find_in(G().events, end);
    if (!a || !b) return bad_event("cuEventElapsedTime", a ? end : start);
    if ((a->flags | b->flags) & CU_EVENT_DISABLE_TIMING) return CUDA_ERROR_INVALID_HANDLE;
    RecordPtr ra = latest_record(a), rb = latest_record(b);
    if (!ra || !rb) return CUDA_ERROR_INVALID_HANDLE;
    std::lock_guard<std::mutex> lk2(G().sched);
    if (!ra->done || !rb->done) return CUDA_ERROR_NOT_READY;
    *ms = std::chrono::duration<float, std::milli>(rb->at - ra->at).count();
    return CUDA_SUCCESS;
}

// ---- copies and memsets ------------------------------------------------------------------------

bool is_default_stream(CUstream h) {
    return !h || h == FAKECUDA_CU_STREAM_LEGACY || h == FAKECUDA_CU_STREAM_PER_THREAD;
}

// Host -> device. Pageable sources are staged at the call (and may be reused at once); pinned
// ones are read when the stream reaches the copy. `sync`: on the legacy stream, waited for.
CUresult copy_htod(const char* what, CUdeviceptr dst, const void* src, size_t n, CUstream h,
                   bool sync) {
    Context* c;
    CUresult e = enter(c);
    if (e || n == 0) return e;
    if (!src) return CUDA_ERROR_INVALID_VALUE;
    if ((e = check_range(dst, n, what))) return e;
    HostKind kind = host_kind(src, n, what, "source");
    if (kind == HostKind::Bad) return CUDA_ERROR_INVALID_VALUE;
    if (kind == HostKind::Pageable) G().mem.pageable_copies++;
    void* d = (void*)(uintptr_t)dst;
    std::function<void(bool)> work;
    if (kind == HostKind::Pinned) {
        work = [d, src, n](bool failed) { if (!failed) memcpy(d, src, n); };
    } else {
        auto staged = std::make_shared<std::vector<unsigned char>>((const unsigned char*)src,
                                                                   (const unsigned char*)src + n);
        work = [d, staged](bool failed) { if (!failed) memcpy(d, staged->data(), staged->size()); };
    }
    Pos pos;
    if ((e = enqueue_work(*c, sync ? nullptr : h, std::move(work), what, &pos))) return e;
    if (sync) wait_for(pos);
    return sync ? sticky_or(*c) : CUDA_SUCCESS;
}

// Device -> host. Pageable destinations: returns once the copy is done; pinned: the stream
// writes them when it reaches the copy.
CUresult copy_dtoh(const char* what, void* dst, CUdeviceptr src, size_t n, CUstream h, bool sync) {
    Context* c;
    CUresult e = enter(c);
    if (e || n == 0) return e;
    if (!dst) return CUDA_ERROR_INVALID_VALUE;
    if ((e = check_range(src, n, what))) return e;
    HostKind kind = host_kind(dst, n, what, "destination");
    if (kind == HostKind::Bad) return CUDA_ERROR_INVALID_VALUE;
    if (kind == HostKind::Pageable) G().mem.pageable_copies++;
    const void* s = (const void*)(uintptr_t)src;
    Pos pos;
    auto work = [dst, s, n](bool failed) { if (!failed) memcpy(dst, s, n); };
    if ((e = enqueue_work(*c, sync ? nullptr : h, work, what, &pos))) return e;
    if (kind == HostKind::Pinned && !sync) return CUDA_SUCCESS;
    wait_for(pos);
    return sticky_or(*c);
}

CUresult copy_dtod(const char* what, CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream h,
                   bool sync) {
    Context* c;
    CUresult e = enter(c);
    if (e || n == 0) return e;
    if ((e = check_range(dst, n, what)) || (e = check_range(src, n, what))) return e;
    void* d = (void*)(uintptr_t)dst;
    const void* s = (const void*)(uintptr_t)src;
    Pos pos;
    auto work = [d, s, n](bool failed) { if (!failed) memmove(d, s, n); };
    if ((e = enqueue_work(*c, sync ? nullptr : h, work, what, &pos))) return e;
    if (sync) wait_for(pos);
    return sync ? sticky_or(*c) : CUDA_SUCCESS;
}

// `count` elements of `elem` bytes (1 or 4) set to `value`.
CUresult memset_device(const char* what, CUdeviceptr dst, uint32_t value, size_t elem,
                       size_t count, CUstream h, bool sync) {
    Context* c;
    CUresult e = enter(c);
    if (e || count == 0) return e;
    if (dst % elem) {
        complain("%s: 0x%llx is not %zu-byte aligned", what, (unsigned long long)dst, elem);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (count > SIZE_MAX / elem) return CUDA_ERROR_INVALID_VALUE;
    if ((e = check_range(dst, count * elem, what))) return e;
    void* d = (void*)(uintptr_t)dst;
    auto work = [d, value, elem, count](bool failed) {
        if (failed) return;
        if (elem == 1) {
            memset(d, (int)(value & 0xFF), count);
        } else {
            uint32_t* p = (uint32_t*)d;
            std::fill(p, p + count, value);
        }
    };
    Pos pos;
    if ((e = enqueue_work(*c, sync ? nullptr : h, work, what, &pos))) return e;
    if (sync) wait_for(pos);
    return sync ? sticky_or(*c) : CUDA_SUCCESS;
}

// ---- launches ----------------------------------------------------------------------------------

// The argument bytes of one launch, copied at the call.
struct Args {
    std::unique_ptr<unsigned char[]> bytes;
    std::vector<void*> ptrs;
};

std::shared_ptr<Args> copy_args(const KernelInfo& k, void** params) {
    auto args = std::make_shared<Args>();
    std::vector<size_t> offs(k.nparams);
    size_t total = 0, max_align = 16;
    for (int i = 0; i < k.nparams; ++i) {
        size_t al = std::max<size_t>(k.aligns[i], 1);
        max_align = std::max(max_align, al);
        total = round_up(total, al);
        offs[i] = total;
        total += k.sizes[i];
    }
    args->bytes.reset(new unsigned char[total + max_align]);
    uintptr_t base = round_up((uintptr_t)args->bytes.get(), max_align);
    for (int i = 0; i < k.nparams; ++i) {
        void* at = (void*)(base + offs[i]);
        memcpy(at, params[i], k.sizes[i]);
        args->ptrs.push_back(at);
    }
    return args;
}

// Every pointer parameter must point into (or at the end of) a live device allocation.
CUresult check_pointer_args(const KernelInfo& k, const Args& a) {
    std::lock_guard<std::mutex> lk(G().mem.mu);
    for (int i = 0; i < k.nparams; ++i) {
        if (!k.is_ptr[i] || k.sizes[i] != sizeof(uintptr_t)) continue;
        uintptr_t p;
        memcpy(&p, a.ptrs[i], sizeof p);
        if (containing(G().mem.live, p, true)) continue;
        complain("cuLaunchKernel(%s): parameter %d (pointer 0x%llx) is not inside a live device "
                 "allocation: %s", k.name, i, (unsigned long long)p, describe_near(p).c_str());
        return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

bool dims_ok(const char* name, const char* what, Dim3 d, const unsigned max[3]) {
    if (d.x >= 1 && d.y >= 1 && d.z >= 1 && d.x <= max[0] && d.y <= max[1] && d.z <= max[2])
        return true;
    complain("cuLaunchKernel(%s): %s (%u, %u, %u) is outside 1..(%u, %u, %u)", name, what, d.x,
             d.y, d.z, max[0], max[1], max[2]);
    return false;
}

CUresult check_launch(const Function& f, Dim3 grid, Dim3 block, unsigned smem, void** params,
                      void** extra) {
    static const unsigned kGrid[3] = {2147483647u, 65535u, 65535u};
    static const unsigned kBlock[3] = {1024u, 1024u, 64u};
    const char* name = f.info->name;
    if (!dims_ok(name, "grid", grid, kGrid) || !dims_ok(name, "block", block, kBlock))
        return CUDA_ERROR_INVALID_VALUE;
    if ((uint64_t)block.x * block.y * block.z > 1024) {
        complain("cuLaunchKernel(%s): block (%u, %u, %u) has more than 1024 threads", name,
                 block.x, block.y, block.z);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (smem > (unsigned)f.max_dyn_smem) {
        complain("cuLaunchKernel(%s): %u bytes of dynamic shared memory exceed the function's "
                 "limit of %d (raise it with cuFuncSetAttribute(CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_"
                 "SHARED_SIZE_BYTES))", name, smem, f.max_dyn_smem);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (extra) {
        complain("cuLaunchKernel(%s): `extra` is not supported by fakecuda (pass kernelParams)",
                 name);
        return CUDA_ERROR_INVALID_VALUE;
    }
    if (f.info->nparams > 0 && !params) {
        complain("cuLaunchKernel(%s): kernelParams is null for %d parameters", name,
                 f.info->nparams);
        return CUDA_ERROR_INVALID_VALUE;
    }
    return CUDA_SUCCESS;
}

// The work of one launch: run_grid on the worker; a failure makes the context sticky.
std::function<void(bool)> grid_work(Context& c, const KernelInfo* k, Dim3 grid, Dim3 block,
                                    size_t smem, std::shared_ptr<Args> args, uint64_t seed) {
    Context* cp = &c;
    return [cp, k, grid, block, smem, args, seed](bool failed) {
        if (failed) return;
        Config& conf = cfg();
        if (!conf.fail_kernel.empty() && conf.fail_kernel == k->name &&
            conf.fail_seen.fetch_add(1) + 1 == conf.fail_nth) {
            set_sticky(*cp, CUDA_ERROR_LAUNCH_FAILED,
                       std::string(k->name) + ": failed as FAKECUDA_FAIL_KERNEL asked");
            return;
        }
        RunResult r = run_grid(k, grid, block, smem, args->ptrs.data(), seed);
        if (r.code != 0) set_sticky(*cp, r.code, r.message);
    };
}

CUresult bad_function(const char* what, const void* f) {
    complain("%s: %p is not a function of a loaded module", what, f);
    return CUDA_ERROR_INVALID_HANDLE;
}

// Checks the handle and copies what a launch needs (under g.reg).
CUresult function_for_launch(Context& c, CUfunction h, Function& out) {
    std::lock_guard<std::mutex> lk(G().reg);
    Function* f = find_in(G().functions, h);
    if (!f) return bad_function("cuLaunchKernel", h);
    if (f->ctx != &c) {
        complain("cuLaunchKernel(%s): the function belongs to another context", f->info->name);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    out = *f;
    return CUDA_SUCCESS;
}

int function_attribute(const Function& f, int attrib, bool* ok) {
    *ok = true;
    switch (attrib) {
        case CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK: return 1024;
        case CU_FUNC_ATTRIBUTE_NUM_REGS: return 32;
        case CU_FUNC_ATTRIBUTE_PTX_VERSION: return 90;
        case CU_FUNC_ATTRIBUTE_BINARY_VERSION: return 90;
        case CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES: return f.max_dyn_smem;
        case CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT: return -1;
        default: break;
    }
    *ok = attrib >= 0 && attrib < CU_FUNC_ATTRIBUTE_MAX;
    return 0;
}

// ---- devices -----------------------------------------------------------------------------------

int device_attribute(int a) {
    switch (a) {
        case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: return 1024;
        case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_X: return 1024;
        case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Y: return 1024;
        case CU_DEVICE_ATTRIBUTE_MAX_BLOCK_DIM_Z: return 64;
        case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_X: return 2147483647;
        case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Y: return 65535;
        case CU_DEVICE_ATTRIBUTE_MAX_GRID_DIM_Z: return 65535;
        case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: return kDefaultSmemLimit;
        case CU_DEVICE_ATTRIBUTE_TOTAL_CONSTANT_MEMORY: return 65536;
        case CU_DEVICE_ATTRIBUTE_WARP_SIZE: return 32;
        case CU_DEVICE_ATTRIBUTE_MAX_PITCH: return 2147483647;
        case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: return 65536;
        case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: return 1980000;
        case CU_DEVICE_ATTRIBUTE_TEXTURE_ALIGNMENT: return 512;
        case CU_DEVICE_ATTRIBUTE_GPU_OVERLAP: return 1;
        case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: return 132;
        case CU_DEVICE_ATTRIBUTE_CAN_MAP_HOST_MEMORY: return 1;
        case CU_DEVICE_ATTRIBUTE_SURFACE_ALIGNMENT: return 512;
        case CU_DEVICE_ATTRIBUTE_CONCURRENT_KERNELS: return 1;
        case CU_DEVICE_ATTRIBUTE_ECC_ENABLED: return 1;
        case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: return 2619000;
        case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: return 5120;
        case CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE: return 52428800;
        case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR: return 2048;
        case CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT: return 2;
        case CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING: return 1;
        case CU_DEVICE_ATTRIBUTE_TEXTURE_PITCH_ALIGNMENT: return 32;
        case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: return 9;
        case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: return 0;
        case CU_DEVICE_ATTRIBUTE_STREAM_PRIORITIES_SUPPORTED: return 1;
        case CU_DEVICE_ATTRIBUTE_GLOBAL_L1_CACHE_SUPPORTED: return 1;
        case CU_DEVICE_ATTRIBUTE_LOCAL_L1_CACHE_SUPPORTED: return 1;
        case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR: return 233472;
        case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_MULTIPROCESSOR: return 65536;
        case CU_DEVICE_ATTRIBUTE_SINGLE_TO_DOUBLE_PRECISION_PERF_RATIO: return 2;
        case CU_DEVICE_ATTRIBUTE_COMPUTE_PREEMPTION_SUPPORTED: return 1;
        case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: return kOptinSmemLimit;
        case CU_DEVICE_ATTRIBUTE_MAX_BLOCKS_PER_MULTIPROCESSOR: return 32;
        case CU_DEVICE_ATTRIBUTE_RESERVED_SHARED_MEMORY_PER_BLOCK: return 1024;
        default: return 0;  // incl. MEMORY_POOLS_SUPPORTED: cudarc then uses cuMemAlloc
    }
}

CUresult check_device(CUdevice dev) {
    if (!G().initialized) return CUDA_ERROR_NOT_INITIALIZED;
    return dev >= 0 && dev < (int)G().contexts.size() ? CUDA_SUCCESS : CUDA_ERROR_INVALID_DEVICE;
}

}  // namespace
}  // namespace fakecuda

using namespace fakecuda;

// ==== exported: initialization, errors, devices =================================================

CUAPI CUresult cuInit(unsigned flags) {
    if (flags != 0) return CUDA_ERROR_INVALID_VALUE;
    static std::once_flag once;
    std::call_once(once, [] {
        read_config();
        for (int i = 0; i < cfg().devices; ++i) {
            Context* c = new Context;
            c->device = i;
            G().contexts.push_back(c);
        }
        atexit(at_exit);
    });
    if (G().contexts.empty()) return CUDA_ERROR_NO_DEVICE;
    G().initialized = true;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDriverGetVersion(int* version) {
    if (!version) return CUDA_ERROR_INVALID_VALUE;
    *version = kDriverVersion;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuGetErrorName(CUresult error, const char** str) {
    if (!str) return CUDA_ERROR_INVALID_VALUE;
    *str = error_name(error);
    return *str ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUAPI CUresult cuGetErrorString(CUresult error, const char** str) {
    if (!str) return CUDA_ERROR_INVALID_VALUE;
    *str = error_text(error);
    return *str ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUAPI CUresult cuDeviceGetCount(int* count) {
    if (!G().initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!count) return CUDA_ERROR_INVALID_VALUE;
    *count = (int)G().contexts.size();
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDeviceGet(CUdevice* device, int ordinal) {
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    CUresult e = check_device(ordinal);
    if (!e) *device = ordinal;
    return e;
}

CUAPI CUresult cuDeviceGetName(char* name, int len, CUdevice dev) {
    CUresult e = check_device(dev);
    if (e) return e;
    if (!name || len <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, (size_t)len, "%s", kDeviceName);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDeviceGetAttribute(int* value, int attrib, CUdevice dev) {
    CUresult e = check_device(dev);
    if (e) return e;
    if (!value || attrib < 1 || attrib >= CU_DEVICE_ATTRIBUTE_MAX) return CUDA_ERROR_INVALID_VALUE;
    *value = attrib == CU_DEVICE_ATTRIBUTE_PCI_BUS_ID ? dev + 1 : device_attribute(attrib);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice dev) {
    CUresult e = check_device(dev);
    if (e) return e;
    if (!bytes) return CUDA_ERROR_INVALID_VALUE;
    *bytes = cfg().memory;
    return CUDA_SUCCESS;
}

static CUresult device_uuid(CUuuid* uuid, CUdevice dev) {
    CUresult e = check_device(dev);
    if (e) return e;
    if (!uuid) return CUDA_ERROR_INVALID_VALUE;
    memcpy(uuid->bytes, "fakecuda-dev-000", 16);
    uuid->bytes[15] = (char)('0' + dev % 10);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDeviceGetUuid(CUuuid* uuid, CUdevice dev) { return device_uuid(uuid, dev); }
CUAPI CUresult cuDeviceGetUuid_v2(CUuuid* uuid, CUdevice dev) { return device_uuid(uuid, dev); }

// ==== exported: contexts ========================================================================

CUAPI CUresult cuDevicePrimaryCtxRetain(CUcontext* pctx, CUdevice dev) {
    CUresult e = check_device(dev);
    if (e) return e;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    Context& c = *G().contexts[dev];
    std::lock_guard<std::mutex> lk(G().primary);
    if (c.refs == 0 && (e = activate(c))) return e;
    ++c.refs;
    *pctx = (CUcontext)&c;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuDevicePrimaryCtxRelease_v2(CUdevice dev) {
    CUresult e = check_device(dev);
    if (e) return e;
    Context& c = *G().contexts[dev];
    std::lock_guard<std::mutex> lk(G().primary);
    if (c.refs == 0) return CUDA_ERROR_INVALID_CONTEXT;
    if (--c.refs == 0) deactivate(c);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxGetCurrent(CUcontext* pctx) {
    if (!G().initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!pctx) return CUDA_ERROR_INVALID_VALUE;
    *pctx = (CUcontext)current();
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxSetCurrent(CUcontext ctx) {
    if (!G().initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (!ctx) {
        if (tls_depth) --tls_depth;
        return CUDA_SUCCESS;
    }
    Context* c = context_of(ctx);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    if (tls_depth == 0) tls_depth = 1;
    tls_stack[tls_depth - 1] = c;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxPushCurrent_v2(CUcontext ctx) {
    if (!G().initialized) return CUDA_ERROR_NOT_INITIALIZED;
    Context* c = context_of(ctx);
    if (!c) return CUDA_ERROR_INVALID_CONTEXT;
    if (tls_depth == kStackDepth) return CUDA_ERROR_INVALID_VALUE;
    tls_stack[tls_depth++] = c;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxPopCurrent_v2(CUcontext* pctx) {
    if (!G().initialized) return CUDA_ERROR_NOT_INITIALIZED;
    if (tls_depth == 0) return CUDA_ERROR_INVALID_CONTEXT;
    Context* c = tls_stack[--tls_depth];
    if (pctx) *pctx = (CUcontext)c;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxGetDevice(CUdevice* device) {
    Context* c;
    CUresult e = enter(c, true);
    if (e) return e;
    if (!device) return CUDA_ERROR_INVALID_VALUE;
    *device = c->device;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuCtxSynchronize() {
    Context* c;
    CUresult e = enter(c);
    if (e) return e;
    drain(*c);
    return sticky_or(*c);
}

CUAPI CUresult cuCtxGetStreamPriorityRange(int* least, int* greatest) {
    Context* c;
    CUresult e = enter(c, true);
    if (e) return e;
    if (least) *least = 0;
    if (greatest) *greatest = -5;
    return CUDA_SUCCESS;
}

// ==== exported: streams =========================================================================

static CUresult create_stream(CUstream* out, unsigned flags) {
    Context* c;
    CUresult e = enter(c);
    if (e) return e;
    if (!out || flags > CU_STREAM_NON_BLOCKING) return CUDA_ERROR_INVALID_VALUE;
    StreamPtr s;
    if ((e = start_stream(*c, flags, false, &s))) return e;
    std::lock_guard<std::mutex> lk(G().sched);
    c->live.insert(s.get());
    *out = (CUstream)s.get();
    return CUDA_SUCCESS;
}

CUAPI CUresult cuStreamCreate(CUstream* out, unsigned flags) { return create_stream(out, flags); }

CUAPI CUresult cuStreamCreateWithPriority(CUstream* out, unsigned flags, int priority) {
    (void)priority;  // streams run on their own threads: priorities change nothing
    return create_stream(out, flags);
}

// The stream keeps running what it was given; its handle is invalid at once.
CUAPI CUresult cuStreamDestroy_v2(CUstream h) {
    Context* c;
    CUresult e = enter(c, true);
    if (e) return e;
    std::lock_guard<std::mutex> lk(G().sched);
    Stream* s = is_default_stream(h) ? nullptr : resolve_locked(*c, h);
    if (!s) return bad_stream("cuStreamDestroy_v2", h);
    c->live.erase(s);
    stop_locked(*s);
    return sticky_or(*c);
}

CUAPI CUresult cuStreamSynchronize(CUstream h) {
    Context* c;
    CUresult e = enter(c);
    if (e) return e;
    Pos pos;
    {
        std::lock_guard<std::mutex> lk(G().sched);
        Stream* s = resolve_locked(*c, h);
        if (!s) return bad_stream("cuStreamSynchronize", h);
        pos = Pos{s->shared_from_this(), s->submitted};
    }
    wait_for(pos);
    return sticky_or(*c);
}

CUAPI CUresult cuStreamQuery(CUstream h) {
    Context* c;
    CUresult e = enter(c);
    if (e) return e;
    std::lock_guard<std::mutex> lk(G().sched);
    Stream* s = resolve_locked(*c, h);
    if (!s) return bad_stream("cuStreamQuery", h);
    return s->done >= s->submitted ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

// Later work on `h` waits for the record of `ev` that is the latest now; a record made after
// this call does not matter, and an event never recorded makes no wait.
CUAPI CUresult cuStreamWaitEvent(CUstream h, CUevent ev, unsigned flags) {
    Context* c;
    CUresult e = enter(c);
    if (e) return e;
    if (flags > CU_EVENT_WAIT_EXTERNAL) return CUDA_ERROR_INVALID_VALUE;
    std::lock_guard<std::mutex> lk(G().reg);
    Event* event = find_in(G().events, ev);
    if (!event) return bad_event("cuStreamWaitEvent", ev);
    std::lock_guard<std::mutex> lk2(G().sched);
    Stream* s = resolve_locked(*c, h);
    if (!s) return bad_stream("cuStreamWaitEvent", h);
    RecordPtr rec = event->latest;
    if (!rec || rec->done) return CUDA_SUCCESS;
    Op op;
    op.kind = Op::WaitRecord;
    op.rec = rec;
    push_locked(*s, std::move(op));
    return CUDA_SUCCESS;
}

CUAPI CUresult cuLaunchHostFunc(CUstream h, CUhostFn fn, void* user) {
    Context* c;
    CUresult e = enter(c);
    if (e) return e;
    if (!fn) return CUDA_ERROR_INVALID_VALUE;
    return enqueue_work(*c, h, [fn, user](bool failed) { if (!failed) fn(user); },
                        "cuLaunchHostFunc");
}

// ==== exported: events ==========================================================================

CUAPI CUresult cuEventCreate(CUevent* out, unsigned flags) {
    Context* c;
    CUresult e = enter(c);
    if (e) return e;
    const unsigned all = CU_EVENT_BLOCKING_SYNC | CU_EVENT_DISABLE_TIMING | CU_EVENT_INTERPROCESS;
    if (!out || (flags & ~all)) return CUDA_ERROR_INVALID_VALUE;
    if ((flags & CU_EVENT_INTERPROCESS) && !(flags & CU_EVENT_DISABLE_TIMING))
        return CUDA_ERROR_INVALID_VALUE;
    Event* ev = new Event;
    ev->ctx = c;
    ev->flags = flags;
    std::lock_guard<std::mutex> lk(G().reg);
    G().events.insert(ev);
    *out = (CUevent)ev;
    return CUDA_SUCCESS;
}

// A pending record still completes (and its waiters still wait for it).
CUAPI CUresult cuEventDestroy_v2(CUevent h) {
    Context* c;
    CUresult e = enter(c, true);
    if (e) return e;
    std::lock_guard<std::mutex> lk(G().reg);
    Event* ev = find_in(G().events, h);
    if (!ev) return bad_event("cuEventDestroy_v2", h);
    G().events.erase(ev);
    delete ev;
    return sticky_or(*c);
}

CUAPI CUresult cuEventRecord(CUevent h, CUstream s) {
    Context* c;
    CUresult e = enter(c);
    if (e) return e;
    std::lock_guard<std::mutex> lk(G().reg);
    Event* ev = find_in(G().events, h);
    if (!ev) return bad_event("cuEventRecord", h);
    if (ev->ctx != c) {
        complain("cuEventRecord: event %p belongs to another context", (void*)h);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    std::lock_guard<std::mutex> lk2(G().sched);
    Stream* st = resolve_locked(*c, s);
    if (!st) return bad_stream("cuEventRecord", s);
    Op op;
    op.kind = Op::MarkRecord;
    op.rec = std::make_shared<Record>();
    ev->latest = op.rec;
    push_locked(*st, std::move(op));
    return CUDA_SUCCESS;
}

CUAPI CUresult cuEventQuery(CUevent h) {
    Context* c;
    CUresult e = enter(c);
    if (e) return e;
    std::lock_guard<std::mutex> lk(G().reg);
    Event* ev = find_in(G().events, h);
    if (!ev) return bad_event("cuEventQuery", h);
    std::lock_guard<std::mutex> lk2(G().sched);
    return !ev->latest || ev->latest->done ? CUDA_SUCCESS : CUDA_ERROR_NOT_READY;
}

CUAPI CUresult cuEventSynchronize(CUevent h) {
    Context* c;
    CUresult e = enter(c);
    if (e) return e;
    RecordPtr rec;
    {
        std::lock_guard<std::mutex> lk(G().reg);
        Event* ev = find_in(G().events, h);
        if (!ev) return bad_event("cuEventSynchronize", h);
        rec = latest_record(ev);
    }
    if (rec) {
        std::unique_lock<std::mutex> lk(G().sched);
        G().cv.wait(lk, [&] { return rec->done || c->sticky.load(); });
    }
    return sticky_or(*c);
}

CUAPI CUresult cuEventElapsedTime(float* ms, CUevent start, CUevent end) {
    return elapsed(ms, start, end);
}

CUAPI CUresult cuEventElapsedTime_v2(float* ms, CUevent start, CUevent end) {
    return elapsed(ms, start, end);
}

// ==== exported: memory ==========================================================================

CUAPI CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total_bytes) {
    Context* c;
    CUresult e = enter(c);
    if (e) return e;
    if (!free_bytes || !total_bytes) return CUDA_ERROR_INVALID_VALUE;
    std::lock_guard<std::mutex> lk(G().mem.mu);
    *total_bytes = cfg().memory;
    *free_bytes = cfg().memory - std::min(cfg().memory, c->used);
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemAlloc_v2(CUdeviceptr* dptr, size_t bytes) {
    Context* c;
    CUresult e = enter(c);
    if (e) return e;
    if (!dptr || bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    return alloc_device(*c, bytes, dptr);
}

// Waits for every stream of the context (CUDA's free synchronizes), then makes the memory
// inaccessible; a later use faults (kernels) or is refused (copies, launches).
CUAPI CUresult cuMemFree_v2(CUdeviceptr p) {
    Context* c;
    CUresult e = enter(c, true);
    if (e || !p) return e;
    {
        std::lock_guard<std::mutex> lk(G().mem.mu);
        if (!G().mem.live.count(p)) {
            if (G().mem.freed.count(p))
                complain("cuMemFree_v2: 0x%llx was freed already (double free)",
                         (unsigned long long)p);
            else
                complain("cuMemFree_v2: 0x%llx is not the start of a live allocation: %s",
                         (unsigned long long)p, describe_near(p).c_str());
            return CUDA_ERROR_INVALID_VALUE;
        }
    }
    drain(*c);
    Alloc a;
    if (!take_alloc(p, a, "cuMemFree_v2")) return CUDA_ERROR_INVALID_VALUE;
    release_alloc(a);
    return sticky_or(*c);
}

// Whether `p` starts a live host entry of that kind: a cuMemHostRegister range (`registered`)
// or a cuMemHostAlloc allocation.
bool host_entry_is(void* p, bool registered) {
    std::lock_guard<std::mutex> lk(G().mem.mu);
    auto it = G().mem.host.find((uintptr_t)p);
    return it != G().mem.host.end() && it->second.registered == registered;
}

CUAPI CUresult cuMemHostAlloc(void** pp, size_t bytes, unsigned flags) {
    Context* c;
    CUresult e = enter(c);
    if (e) return e;
    if (!pp || bytes == 0 || flags > 0xF) return CUDA_ERROR_INVALID_VALUE;
    size_t len = round_up(bytes, cfg().page);
    void* m = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (m == MAP_FAILED) return CUDA_ERROR_OUT_OF_MEMORY;
    memset(m, 0xFF, len);
    std::lock_guard<std::mutex> lk(G().mem.mu);
    G().mem.host[(uintptr_t)m] = HostAlloc{bytes, len, std::this_thread::get_id()};
    *pp = m;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuMemAllocHost_v2(void** pp, size_t bytes) { return cuMemHostAlloc(pp, bytes, 0); }

// Page-locks the caller's [p, p + bytes): later copies to or from it are pinned ones (truly
// asynchronous). A range that overlaps device memory or another pinned range is refused.
CUAPI CUresult cuMemHostRegister_v2(void* p, size_t bytes, unsigned flags) {
    Context* c;
    CUresult e = enter(c);
    if (e) return e;
    if (!p || bytes == 0 || flags > 0xF) return CUDA_ERROR_INVALID_VALUE;
    uintptr_t a = (uintptr_t)p;
    Memory& m = G().mem;
    std::lock_guard<std::mutex> lk(m.mu);
    if (overlapping(m.live, a, bytes) || overlapping(m.freed, a, bytes)) {
        complain("cuMemHostRegister_v2: %p + %zu bytes is device memory", p, bytes);
        return CUDA_ERROR_INVALID_VALUE;
    }
    auto next = m.host.lower_bound(a);
    bool overlaps = next != m.host.end() && next->first < a + bytes;
    if (next != m.host.begin()) {
        auto prev = std::prev(next);
        overlaps |= prev->first + prev->second.mapped > a;
    }
    if (overlaps) {
        complain("cuMemHostRegister_v2: %p + %zu bytes overlaps pinned host memory", p, bytes);
        return CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED;
    }
    m.host[a] = HostAlloc{bytes, bytes, std::this_thread::get_id(), true};
    return CUDA_SUCCESS;
}

// Waits for the current context's streams first (the range may be in an async copy).
CUAPI CUresult cuMemHostUnregister(void* p) {
    Context* c;
    CUresult e = enter(c, true);
    if (e) return e;
    if (!host_entry_is(p, true)) {
        complain("cuMemHostUnregister: %p is not the start of a registered range", p);
        return CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED;
    }
    drain(*c);
    std::lock_guard<std::mutex> lk(G().mem.mu);
    G().mem.host.erase((uintptr_t)p);
    return sticky_or(*c);
}

// Waits for the current context's streams first (pinned memory may be in an async copy).
CUAPI CUresult cuMemFreeHost(void* p) {
    Context* c;
    CUresult e = enter(c, true);
    if (e) return e;
    if (!host_entry_is(p, false)) {
        complain("cuMemFreeHost: %p is not a pointer from cuMemHostAlloc", p);
        return CUDA_ERROR_INVALID_VALUE;
    }
    drain(*c);
    std::lock_guard<std::mutex> lk(G().mem.mu);
    auto it = G().mem.host.find((uintptr_t)p);
    if (it == G().mem.host.end()) return CUDA_ERROR_INVALID_VALUE;
    munmap(p, it->second.mapped);
    G().mem.host.erase(it);
    return sticky_or(*c);
}

CUAPI CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    return copy_htod("cuMemcpyHtoD_v2", dst, src, n, nullptr, true);
}

CUAPI CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    return copy_dtoh("cuMemcpyDtoH_v2", dst, src, n, nullptr, true);
}

CUAPI CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    return copy_dtod("cuMemcpyDtoD_v2", dst, src, n, nullptr, true);
}

CUAPI CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream s) {
    return copy_htod("cuMemcpyHtoDAsync_v2", dst, src, n, s, false);
}

CUAPI CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream s) {
    return copy_dtoh("cuMemcpyDtoHAsync_v2", dst, src, n, s, false);
}

CUAPI CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    return copy_dtod("cuMemcpyDtoDAsync_v2", dst, src, n, s, false);
}

CUAPI CUresult cuMemsetD8_v2(CUdeviceptr dst, unsigned char v, size_t n) {
    return memset_device("cuMemsetD8_v2", dst, v, 1, n, nullptr, true);
}

CUAPI CUresult cuMemsetD32_v2(CUdeviceptr dst, unsigned v, size_t n) {
    return memset_device("cuMemsetD32_v2", dst, v, 4, n, nullptr, true);
}

CUAPI CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char v, size_t n, CUstream s) {
    return memset_device("cuMemsetD8Async", dst, v, 1, n, s, false);
}

CUAPI CUresult cuMemsetD32Async(CUdeviceptr dst, unsigned v, size_t n, CUstream s) {
    return memset_device("cuMemsetD32Async", dst, v, 4, n, s, false);
}

// ==== exported: modules, functions, launches ====================================================

CUAPI CUresult cuModuleLoadData(CUmodule* out, const void* image) {
    Context* c;
    CUresult e = enter(c);
    if (e) return e;
    if (!out || !image) return CUDA_ERROR_INVALID_VALUE;
    std::string err;
    Module* mod = load_module(image, err);
    if (!mod) {
        complain("cuModuleLoadData: %s", err.empty() ? "the image was refused" : err.c_str());
        return CUDA_ERROR_INVALID_IMAGE;
    }
    LoadedModule* lm = new LoadedModule;
    lm->ctx = c;
    lm->mod = mod;
    std::lock_guard<std::mutex> lk(G().reg);
    G().modules.insert(lm);
    *out = (CUmodule)lm;
    return CUDA_SUCCESS;
}

CUAPI CUresult cuModuleGetFunction(CUfunction* out, CUmodule h, const char* name) {
    Context* c;
    CUresult e = enter(c);
    if (e) return e;
    if (!out || !name) return CUDA_ERROR_INVALID_VALUE;
    std::lock_guard<std::mutex> lk(G().reg);
    LoadedModule* lm = find_in(G().modules, h);
    if (!lm) {
        complain("cuModuleGetFunction(%s): %p is not a loaded module", name, (void*)h);
        return CUDA_ERROR_INVALID_HANDLE;
    }
    auto it = lm->funcs.find(name);
    if (it != lm->funcs.end()) {
        *out = (CUfunction)it->second;
        return CUDA_SUCCESS;
    }
    const KernelInfo* k = find_kernel(lm->mod, name);
    if (!k) {
        complain("cuModuleGetFunction: the module has no kernel named %s", name);
        return CUDA_ERROR_NOT_FOUND;
    }
    Function* f = new Function;
    f->info = k;
    f->ctx = lm->ctx;
    lm->funcs[name] = f;
    G().functions.insert(f);
    *out = (CUfunction)f;
    return CUDA_SUCCESS;
}

// Waits for the context's streams (launches in flight use the module), then unloads it.
CUAPI CUresult cuModuleUnload(CUmodule h) {
    Context* c;
    CUresult e = enter(c, true);
    if (e) return e;
    LoadedModule* lm;
    {
        std::lock_guard<std::mutex> lk(G().reg);
        lm = find_in(G().modules, h);
        if (!lm) {
            complain("cuModuleUnload: %p is not a loaded module", (void*)h);
            return CUDA_ERROR_INVALID_HANDLE;
        }
        G().modules.erase(lm);
        for (auto& [name, f] : lm->funcs) G().functions.erase(f);  // Functions leak on purpose
    }
    drain(*lm->ctx);
    unload_module(lm->mod);
    delete lm;
    return sticky_or(*c);
}

CUAPI CUresult cuFuncGetAttribute(int* value, int attrib, CUfunction h) {
    if (!value) return CUDA_ERROR_INVALID_VALUE;
    std::lock_guard<std::mutex> lk(G().reg);
    Function* f = find_in(G().functions, h);
    if (!f) return bad_function("cuFuncGetAttribute", h);
    bool ok;
    *value = function_attribute(*f, attrib, &ok);
    return ok ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUAPI CUresult cuFuncSetAttribute(CUfunction h, int attrib, int value) {
    std::lock_guard<std::mutex> lk(G().reg);
    Function* f = find_in(G().functions, h);
    if (!f) return bad_function("cuFuncSetAttribute", h);
    if (attrib == CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES) {
        if (value < 0 || value > kOptinSmemLimit) {
            complain("cuFuncSetAttribute(%s): %d bytes of dynamic shared memory: the device allows "
                     "0..%d", f->info->name, value, kOptinSmemLimit);
            return CUDA_ERROR_INVALID_VALUE;
        }
        f->max_dyn_smem = value;
        return CUDA_SUCCESS;
    }
    if (attrib == CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT)
        return value >= -1 && value <= 100 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
    bool settable = attrib >= CU_FUNC_ATTRIBUTE_REQUIRED_CLUSTER_WIDTH &&
                    attrib < CU_FUNC_ATTRIBUTE_MAX;  // accepted and ignored
    return settable ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE;
}

CUAPI CUresult cuLaunchKernel(CUfunction h, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                              unsigned by, unsigned bz, unsigned smem, CUstream s, void** params,
                              void** extra) {
    Context* c;
    CUresult e = enter(c);
    if (e) return e;
    Function f;
    if ((e = function_for_launch(*c, h, f))) return e;
    Dim3 grid{gx, gy, gz}, block{bx, by, bz};
    if ((e = check_launch(f, grid, block, smem, params, extra))) return e;
    std::shared_ptr<Args> args = copy_args(*f.info, params);
    if ((e = check_pointer_args(*f.info, *args))) return e;
    uint64_t n = c->launches.fetch_add(1);
    uint64_t seed = splitmix64(cfg().seed ^ splitmix64(n ^ ((uint64_t)c->device << 56)));
    return enqueue_work(*c, s, grid_work(*c, f.info, grid, block, smem, args, seed),
                        "cuLaunchKernel");
}

// ==== exported: fakecuda's own entry points (driver_api.h) ======================================

CUAPI CUresult fakecuda_enqueue(CUstream s, fakecuda_work_fn fn, void* arg) {
    Context* c;
    CUresult e = enter(c);
    if (e) return e;
    if (!fn) return CUDA_ERROR_INVALID_VALUE;
    return enqueue_work(*c, s, [fn, arg](bool failed) { fn(arg, failed ? 1 : 0); },
                        "fakecuda_enqueue");
}

CUAPI CUresult fakecuda_check_device_range(const void* ptr, size_t bytes, const char* what) {
    return check_range((uintptr_t)ptr, bytes, what ? what : "fakecuda_check_device_range");
}

CUAPI int fakecuda_device_pointer_kind(const void* ptr) {
    std::lock_guard<std::mutex> lk(G().mem.mu);
    if (containing(G().mem.live, (uintptr_t)ptr)) return 1;
    return containing(G().mem.freed, (uintptr_t)ptr) ? 2 : 0;
}

CUAPI size_t fakecuda_host_alloc_bytes(int mine, size_t* count) {
    std::lock_guard<std::mutex> lk(G().mem.mu);
    size_t bytes = 0, n = 0;
    for (const auto& [ptr, h] : G().mem.host) {
        if (mine && h.owner != std::this_thread::get_id()) continue;
        bytes += h.bytes;
        n++;
    }
    if (count) *count = n;
    return bytes;
}

CUAPI size_t fakecuda_pageable_copies(void) { return G().mem.pageable_copies.load(); }

CUAPI CUresult fakecuda_check_stream(CUstream h) {
    Context* c;
    CUresult e = enter(c);
    if (e) return e;
    std::lock_guard<std::mutex> lk(G().sched);
    return resolve_locked(*c, h) ? CUDA_SUCCESS : CUDA_ERROR_INVALID_HANDLE;
}

CUAPI CUresult fakecuda_synchronize_owner(CUstream h) {
    if (!G().initialized) return CUDA_ERROR_NOT_INITIALIZED;
    Context* owner = nullptr;
    if (is_default_stream(h)) {
        owner = current();
    } else {
        std::lock_guard<std::mutex> lk(G().sched);
        for (Context* c : G().contexts)
            if (c->live.count((Stream*)h)) owner = c;
    }
    if (!owner || !owner->active) return CUDA_SUCCESS;
    drain(*owner);
    return sticky_or(*owner);
}
