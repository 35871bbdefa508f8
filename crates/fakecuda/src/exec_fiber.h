// Fibers for the executor (exec.cpp): stacks with a guard page, and the context switch.
//
// On x86-64 a switch is a few instructions of assembly (push the callee-saved registers, swap
// stack pointers, pop, return) and a new fiber gets a hand-built first frame; elsewhere (or
// with -DFAKECUDA_UCONTEXT) it is makecontext/swapcontext, which costs a sigprocmask syscall per
// switch. Under FAKECUDA_ASAN every switch is announced to AddressSanitizer.
// Used only by exec.cpp; header-only so it stays one translation unit.
#pragma once
#include <sys/mman.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>

#if !defined(__x86_64__) && !defined(FAKECUDA_UCONTEXT)
#define FAKECUDA_UCONTEXT 1
#endif
#ifdef FAKECUDA_UCONTEXT
#include <ucontext.h>
#endif
#ifdef FAKECUDA_ASAN
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

namespace fakecuda {
namespace fiber {

// A saved execution context and the stack it runs on.
struct Ctx {
#ifdef FAKECUDA_UCONTEXT
    ucontext_t uc;
#else
    void* sp = nullptr;  // the stack pointer saved by the last switch away from it
#endif
    char* stack_lo = nullptr;  // usable stack [stack_lo, stack_lo + stack_size)
    size_t stack_size = 0;
    void* asan_fake = nullptr;  // ASan's fake stack while switched away
};

// A stack mapping: one PROT_NONE guard page below the usable stack.
struct Stack {
    char* map = nullptr;
    size_t map_size = 0, guard = 0;
    char* lo() const { return map + guard; }
    size_t size() const { return map_size - guard; }
    bool in_guard(const void* p) const { return (const char*)p >= map && (const char*)p < map + guard; }
};

inline bool alloc_stack(Stack* s, size_t size) {
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size = (size + page - 1) / page * page;
    void* m = mmap(nullptr, size + page, PROT_READ | PROT_WRITE,
                   MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
    if (m == MAP_FAILED) return false;
    if (mprotect(m, page, PROT_NONE) != 0) {
        munmap(m, size + page);
        return false;
    }
    s->map = (char*)m;
    s->map_size = size + page;
    s->guard = page;
    return true;
}

inline void free_stack(Stack* s) {
    if (s->map) munmap(s->map, s->map_size);
    *s = Stack();
}

typedef void (*Entry)(void* arg);

#ifndef FAKECUDA_UCONTEXT
// fakecuda_fiber_switch(save, to): saves the callee-saved registers on the current stack and
// its stack pointer in *save, then continues the context whose stack pointer is `to`.
// fakecuda_fiber_boot: a new fiber's first "return address"; calls entry(arg) from r13/r12.
extern "C" __attribute__((visibility("hidden"))) void fakecuda_fiber_switch(void** save, void* to);
extern "C" __attribute__((visibility("hidden"))) void fakecuda_fiber_boot();
asm(R"(
    .text
    .globl fakecuda_fiber_switch
    .hidden fakecuda_fiber_switch
    .type fakecuda_fiber_switch, @function
fakecuda_fiber_switch:
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
    .size fakecuda_fiber_switch, .-fakecuda_fiber_switch

    .globl fakecuda_fiber_boot
    .hidden fakecuda_fiber_boot
    .type fakecuda_fiber_boot, @function
fakecuda_fiber_boot:
    movq %r12, %rdi
    andq $-16, %rsp
    callq *%r13
    ud2
    .size fakecuda_fiber_boot, .-fakecuda_fiber_boot
)");

// Makes `c` start entry(arg) on its stack when first switched to.
inline void init_ctx(Ctx* c, Entry entry, void* arg) {
    uintptr_t top = ((uintptr_t)(c->stack_lo + c->stack_size)) & ~(uintptr_t)15;
    void** f = (void**)(top - 8 * sizeof(void*));
    f[0] = nullptr;                 // r15
    f[1] = nullptr;                 // r14
    f[2] = (void*)entry;            // r13
    f[3] = arg;                     // r12
    f[4] = nullptr;                 // rbx
    f[5] = nullptr;                 // rbp
    f[6] = (void*)&fakecuda_fiber_boot;  // return address of the first switch
    f[7] = nullptr;
    c->sp = f;
}

inline void raw_switch(Ctx* from, Ctx* to) { fakecuda_fiber_switch(&from->sp, to->sp); }
#else
inline void boot_uc(unsigned hi_e, unsigned lo_e, unsigned hi_a, unsigned lo_a) {
    Entry e = (Entry)(((uintptr_t)hi_e << 32) | lo_e);
    e((void*)(((uintptr_t)hi_a << 32) | lo_a));
    __builtin_trap();
}

inline void init_ctx(Ctx* c, Entry entry, void* arg) {
    getcontext(&c->uc);
    c->uc.uc_stack.ss_sp = c->stack_lo;
    c->uc.uc_stack.ss_size = c->stack_size;
    c->uc.uc_link = nullptr;
    uintptr_t e = (uintptr_t)entry, a = (uintptr_t)arg;
    makecontext(&c->uc, (void (*)())boot_uc, 4, (unsigned)(e >> 32), (unsigned)e, (unsigned)(a >> 32),
                (unsigned)a);
}

inline void raw_switch(Ctx* from, Ctx* to) { swapcontext(&from->uc, &to->uc); }
#endif

// Continues `to`; returns when something switches back to `from`.
inline void switch_to(Ctx* from, Ctx* to) {
#ifdef FAKECUDA_ASAN
    __sanitizer_start_switch_fiber(&from->asan_fake, to->stack_lo, to->stack_size);
    raw_switch(from, to);
    __sanitizer_finish_switch_fiber(from->asan_fake, nullptr, nullptr);
#else
    raw_switch(from, to);
#endif
}

// First thing a new fiber does (completes the switch that started it).
inline void on_fiber_start() {
#ifdef FAKECUDA_ASAN
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
}

// Around a longjmp from a fiber back to `home` (the thread's own stack): the fiber is abandoned.
inline void before_abandon(const Ctx* home) {
#ifdef FAKECUDA_ASAN
    __sanitizer_start_switch_fiber(nullptr, home->stack_lo, home->stack_size);
#else
    (void)home;
#endif
}
inline void after_abandon() {
#ifdef FAKECUDA_ASAN
    __sanitizer_finish_switch_fiber(nullptr, nullptr, nullptr);
#endif
}

// An abandoned stack may carry ASan poison from frames that never returned.
inline void scrub_stack(const Ctx* c) {
#ifdef FAKECUDA_ASAN
    ASAN_UNPOISON_MEMORY_REGION(c->stack_lo, c->stack_size);
#else
    (void)c;
#endif
}

}  // namespace fiber
}  // namespace fakecuda
