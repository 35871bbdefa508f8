//! Worker pools whose threads are pinned, each to one CPU of the process's allowed set.
//!
//! Why: on the 2-vCPU virtual machine this project is built on, a burst of `bench/overlap.yaml`'s
//! products on an unpinned two-thread pool takes about 13.5 ms back to back but 8.5 ms after the
//! pool's threads have run for 100 ms, and up to 16.5 ms after 200 ms asleep: a thread that
//! wakes is placed beside its sibling on one CPU, and the scheduler spreads them again only
//! after tens of milliseconds of running. The same pool with each thread pinned to its own CPU
//! takes 8.4 ms back to back and 8.0-10.4 ms in every other case (`examples/idle_probe`, with
//! and without `PIN=1`, interleaved). HPC runtimes pin for the same reason (OpenMP's
//! `OMP_PROC_BIND`). Pinning stays inside the set the process was started with, so `taskset`
//! or `numactl --cpunodebind` still choose the cores.
//!
//! `libc` is used directly: the `sched_{get,set}affinity` calls are all this needs, and no
//! crate adds anything over them that this module would use.

/// Where a pool's threads run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Placement {
    /// Wherever the scheduler puts them.
    Free,
    /// Thread `i` on allowed CPU `(first + i) % allowed`, counted in the order of the CPUs'
    /// numbers.
    Pinned { first: usize },
}

impl Placement {
    /// `threads` threads pinned to the last CPUs of the allowed set (all of them, from the
    /// first, when there are fewer CPUs than threads), or free when `pin` is false: the host
    /// threads, which leave the first CPUs to the queues' threads.
    pub fn last(threads: usize, pin: bool) -> Self {
        match pin {
            false => Placement::Free,
            true => Placement::Pinned { first: allowed_cpus().len().saturating_sub(threads) },
        }
    }

    /// Pinned from the first allowed CPU, or free when `pin` is false.
    pub fn first(pin: bool) -> Self {
        match pin {
            false => Placement::Free,
            true => Placement::Pinned { first: 0 },
        }
    }
}

/// The CPU each of `threads` threads placed as `placement` says is pinned to, in thread order
/// (repeats where there are fewer CPUs than threads); empty when they run free or the allowed
/// set cannot be read.
pub fn cpus_of(threads: usize, placement: Placement) -> Vec<usize> {
    match placement {
        Placement::Free => Vec::new(),
        Placement::Pinned { first } => {
            let cpus = allowed_cpus();
            match cpus.is_empty() {
                true => Vec::new(),
                false => (0..threads).map(|i| cpus[(first + i) % cpus.len()]).collect(),
            }
        }
    }
}

/// A rayon pool of `threads` threads named `name-i`, placed as `placement` says. A thread that
/// cannot be pinned (not Linux, or the call refused) runs free: pinning is a speed matter only.
pub fn pool(
    name: &'static str,
    threads: usize,
    placement: Placement,
) -> Result<rayon::ThreadPool, rayon::ThreadPoolBuildError> {
    builder(name, threads, placement).build()
}

/// The builder of [`pool`], for a caller that builds rayon's global pool with it.
pub fn builder(
    name: &'static str,
    threads: usize,
    placement: Placement,
) -> rayon::ThreadPoolBuilder {
    let cpus = cpus_of(threads, placement);
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(move |i| format!("{name}-{i}"))
        .start_handler(move |i| {
            if let Some(&cpu) = cpus.get(i) {
                pin_current_thread(cpu);
            }
        })
}

/// The CPUs this process's threads may run on (the calling thread's affinity mask), in
/// increasing order; empty where that cannot be read.
pub fn allowed_cpus() -> Vec<usize> {
    imp::allowed_cpus()
}

/// Pins the calling thread to `cpu`; false where it could not.
pub fn pin_current_thread(cpu: usize) -> bool {
    restrict_current_thread(&[cpu])
}

/// Lets the calling thread run on `cpus` only (any of them); false where it could not, or
/// when `cpus` is empty.
pub fn restrict_current_thread(cpus: &[usize]) -> bool {
    !cpus.is_empty() && imp::restrict_current_thread(cpus)
}

/// Asks the scheduler for a short time slice (`slice_us` microseconds) for the calling thread,
/// keeping its policy (`SCHED_OTHER`) and nice value: under Linux's EEVDF scheduler (6.12 and
/// later) a thread with a shorter slice than the one running gets the CPU when it wakes,
/// instead of waiting for the running thread's slice to end. For threads that sleep most of
/// the time and wake for short work (a queue's copy or hand-off) beside busy compute threads.
/// False where the kernel refuses it (older kernels take the call and ignore the slice).
pub fn short_slice_current_thread(slice_us: u64) -> bool {
    imp::short_slice_current_thread(slice_us)
}

/// The allowed CPUs none of `taken` is, in increasing order: where threads that must not
/// share a CPU with pinned ones can go. Empty when `taken` is (nothing is pinned) or leaves
/// no CPU.
pub fn cpus_besides(taken: &[usize]) -> Vec<usize> {
    if taken.is_empty() {
        return Vec::new();
    }
    allowed_cpus().into_iter().filter(|c| !taken.contains(c)).collect()
}

/// Where the queues' own threads run beside host threads pinned to `host_cpus` (empty: they
/// run free, and so do these). The engine places its queues so, and the `this-cpu`
/// calibration times their work on threads placed the same way.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct QueueCpus {
    /// The host queue's thread, which hands each host op to the host pool and is blocked while
    /// the pool works: on the pool's first thread's CPU, so that the hand-off and its reply
    /// wake no other CPU.
    pub host: Option<usize>,
    /// Every other queue's thread: on the CPUs the host threads leave (empty: anywhere).
    pub others: Vec<usize>,
}

impl QueueCpus {
    pub fn beside(host_cpus: &[usize]) -> Self {
        QueueCpus { host: host_cpus.first().copied(), others: cpus_besides(host_cpus) }
    }

    /// Beside `threads` host threads placed as [`Placement::last`] places them (`pin`:
    /// `engine.pin_threads`).
    pub fn beside_host_threads(threads: usize, pin: bool) -> Self {
        Self::beside(&cpus_of(threads, Placement::last(threads, pin)))
    }
}

#[cfg(target_os = "linux")]
mod imp {
    pub fn allowed_cpus() -> Vec<usize> {
        // SAFETY: `cpu_set_t` is plain bits, valid all-zero; `sched_getaffinity` writes at
        // most `size_of::<cpu_set_t>()` bytes into it, and `CPU_ISSET` reads it in bounds
        // (`CPU_SETSIZE` bits).
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
                return Vec::new();
            }
            (0..libc::CPU_SETSIZE as usize).filter(|&c| libc::CPU_ISSET(c, &set)).collect()
        }
    }

    pub fn restrict_current_thread(cpus: &[usize]) -> bool {
        if cpus.iter().any(|&c| c >= libc::CPU_SETSIZE as usize) {
            return false;
        }
        // SAFETY: as above; `CPU_SET` writes bit `c`, checked in bounds; pid 0 is the calling
        // thread, and the set is only read by the call.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            for &c in cpus {
                libc::CPU_SET(c, &mut set);
            }
            libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
        }
    }

    /// `struct sched_attr` of `sched_setattr(2)` (its first version, 48 bytes); libc has the
    /// syscall number but not the struct.
    #[repr(C)]
    struct SchedAttr {
        size: u32,
        policy: u32,
        flags: u64,
        nice: i32,
        priority: u32,
        runtime: u64,
        deadline: u64,
        period: u64,
    }

    pub fn short_slice_current_thread(slice_us: u64) -> bool {
        // SAFETY: getpriority only reads the calling thread's nice value (errno is not
        // consulted: a nice of -1 is as good a value to keep as any).
        let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
        let attr = SchedAttr {
            size: std::mem::size_of::<SchedAttr>() as u32,
            policy: libc::SCHED_OTHER as u32,
            flags: 0,
            nice,
            priority: 0,
            runtime: slice_us * 1000,
            deadline: 0,
            period: 0,
        };
        // SAFETY: `attr` is a valid, fully initialised `struct sched_attr` of the size it
        // declares, read by the kernel only during the call; pid 0 is the calling thread.
        unsafe { libc::syscall(libc::SYS_sched_setattr, 0, &attr as *const SchedAttr, 0) == 0 }
    }
}

#[cfg(not(target_os = "linux"))]
mod imp {
    pub fn allowed_cpus() -> Vec<usize> {
        Vec::new()
    }

    pub fn restrict_current_thread(_cpus: &[usize]) -> bool {
        false
    }

    pub fn short_slice_current_thread(_slice_us: u64) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_os = "linux")]
    fn pinned_threads_stay_inside_the_allowed_set_each_on_its_own_cpu() {
        let cpus = allowed_cpus();
        assert!(!cpus.is_empty(), "this process may run somewhere");
        let n = cpus.len().min(4);
        let p = pool("pin-test", n, Placement::Pinned { first: 0 }).unwrap();
        let seen = p.broadcast(|_| allowed_cpus());
        for (i, mask) in seen.iter().enumerate() {
            assert_eq!(mask, &vec![cpus[i % cpus.len()]], "thread {i}'s mask");
        }
    }

    #[test]
    #[cfg(target_os = "linux")]
    fn a_thread_restricted_to_the_cpus_besides_pinned_ones_runs_only_there() {
        let cpus = allowed_cpus();
        assert!(cpus_besides(&[]).is_empty(), "nothing pinned: no restriction");
        let rest = cpus_besides(&[*cpus.last().unwrap()]);
        assert_eq!(rest, cpus[..cpus.len() - 1]);
        if !rest.is_empty() {
            let want = rest.clone();
            let mask = std::thread::spawn(move || {
                assert!(restrict_current_thread(&rest));
                allowed_cpus()
            });
            assert_eq!(mask.join().unwrap(), want);
        }
        assert!(!restrict_current_thread(&[]), "an empty set restricts nothing");
    }

    #[test]
    fn free_threads_keep_the_whole_set_and_last_counts_from_the_end() {
        let cpus = allowed_cpus();
        let p = pool("free-test", 2, Placement::Free).unwrap();
        assert!(p.broadcast(|_| allowed_cpus()).iter().all(|m| *m == cpus));
        assert_eq!(Placement::last(1, false), Placement::Free);
        let last = Placement::last(1, true);
        assert_eq!(last, Placement::Pinned { first: cpus.len().saturating_sub(1) });
        assert_eq!(Placement::last(cpus.len() + 3, true), Placement::Pinned { first: 0 });
        assert!(cpus_of(3, Placement::Free).is_empty());
        if !cpus.is_empty() {
            let last = cpus_of(1, Placement::last(1, true));
            assert_eq!(last, vec![*cpus.last().unwrap()]);
            let wrapped = cpus_of(cpus.len() + 1, Placement::first(true));
            assert_eq!((wrapped[0], wrapped[cpus.len()]), (cpus[0], cpus[0]));
        }
    }
}
