//! The discrete-event simulation of a plan: each queue runs its ops in submission order; an op
//! starts when its queue is free and every op it waits for has finished; how long it then runs
//! comes from its [`Cost`].
//!
//! A cost has two parts that run side by side (a chunked upload rounds one chunk on the host
//! while the link copies the previous one): `fixed_s`, time on the op's own engine (the GPU's
//! compute, one direction of the link), which nothing else on its queue shares; and `host_s`,
//! host work, which every op then running shares. The host is one pool of capacity 1: an op can
//! use at most `host_share` of it (1: a pass over every host thread; `1/threads`: one thread),
//! and the running ops split it max-min fairly (water-filling), except that an op marked
//! `first` takes its share before the others split the rest: a thread that slept and wakes for
//! a short job, which the OS runs at once (the CPU device's copy threads). The first ops'
//! threads run on [`Sharing::queue_share`] of the host (the CPUs the host threads leave the
//! CPU device's queues), and the latest to start takes its share of that first: a copy thread
//! that wakes takes its CPU from a copy already running there, which waits until it is done
//! (in traced runs at link 0 on 2 cores, a gradient download that the next layer's uploads
//! woke beside took its time alone plus theirs). A first op that finds no CPU left starts when
//! it gets one: until then its thread has not run, and its queue is not busy. When the other
//! ops' shares add up to more than what the first ones leave, their threads outnumber the
//! cores and take turns on them, and each gets only [`Sharing::contended`] of its split.
//! `host_s` is the op's time with the host to itself. An op ends when both parts are done.
//! The simulation is exact for this fluid model: between two events (an op starting, or one
//! part of one op ending) every rate is constant.

use horizon_backend::Queue;

/// What one op costs (see the module).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Cost {
    /// Seconds on the op's own engine.
    pub fixed_s: f64,
    /// Seconds of host work with the host to itself.
    pub host_s: f64,
    /// The largest fraction of the host the op can use, in (0, 1].
    pub host_share: f64,
    /// Whether the op takes its share of the host before the others split the rest.
    pub first: bool,
}

impl Cost {
    /// `s` seconds on the op's own engine, no host work.
    pub fn fixed(s: f64) -> Cost {
        Cost { fixed_s: s, host_s: 0.0, host_share: 1.0, first: false }
    }
    /// `s` seconds of host work at up to `share` of the host.
    pub fn host(s: f64, share: f64) -> Cost {
        Cost { fixed_s: 0.0, host_s: s, host_share: share, first: false }
    }
    /// `s` seconds of host work at up to `share` of the host, taken before the other ops'.
    pub fn host_first(s: f64, share: f64) -> Cost {
        Cost { first: true, ..Cost::host(s, share) }
    }
    /// Both parts: `host`'s host work beside this cost's own engine time.
    pub fn with_host(self, host: Cost) -> Cost {
        Cost { host_s: host.host_s, host_share: host.host_share, first: host.first, ..self }
    }
}

/// One op to simulate: its queue, its cost, and the earlier ops (indices into the same list)
/// it waits for.
#[derive(Clone, Debug, PartialEq)]
pub struct SimOp {
    pub queue: Queue,
    pub cost: Cost,
    pub waits: Vec<usize>,
}

/// When each op ran, and why it started when it did.
#[derive(Clone, Debug, PartialEq)]
pub struct Timeline {
    pub start: Vec<f64>,
    pub end: Vec<f64>,
    /// The op whose end let this one start (its queue's previous op or a wait; the latest of
    /// them), `None` for an op that started at time 0.
    pub cause: Vec<Option<usize>>,
}

/// A running op's progress.
struct Running {
    op: usize,
    fixed_left: f64,
    host_left: f64,
    share: f64,
    first: bool,
    /// When it started.
    since: f64,
    /// Whether it has run yet: a first op may wait for a CPU first.
    ran: bool,
}

/// Work left below this (seconds) is none: what float rounding leaves of a finished part.
const EPS: f64 = 1e-9;

/// How the running ops share the host beyond their own caps (see the module).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sharing {
    /// What threads get of their split when they outnumber the cores, in (0, 1]
    /// ([`crate::sim::hardware::Host::contended`]).
    pub contended: f64,
    /// The part of the host the first ops' threads may run on, together, in (0, 1]: the CPUs
    /// the CPU device's queue threads are kept to, over all of them.
    pub queue_share: f64,
}

impl Sharing {
    /// No loss, and the first ops may use the whole host.
    pub const FREE: Sharing = Sharing { contended: 1.0, queue_share: 1.0 };
}

/// Simulate `ops` (in submission order) on a host shared as `sharing` says (see the module).
/// Panics if an op waits for a later one or for itself (a bug in the plan:
/// [`crate::engine::plan::check`] rejects such plans).
pub fn simulate(ops: &[SimOp], sharing: Sharing) -> Timeline {
    let Sharing { contended, queue_share } = sharing;
    assert!(contended > 0.0 && contended <= 1.0, "contended {contended}");
    assert!(queue_share > 0.0 && queue_share <= 1.0, "queue_share {queue_share}");
    let n = ops.len();
    let mut per_queue: [Vec<usize>; 4] = Default::default();
    for (j, op) in ops.iter().enumerate() {
        assert!(op.waits.iter().all(|&w| w < j), "op {j} waits for a later op");
        per_queue[op.queue.index()].push(j);
    }
    let mut head = [0usize; 4];
    let mut busy = [false; 4];
    let (mut start, mut end) = (vec![f64::NAN; n], vec![f64::NAN; n]);
    let mut cause = vec![None; n];
    let mut running: Vec<Running> = Vec::new();
    let mut prev_on_queue: [Option<usize>; 4] = [None; 4];
    let mut t = 0.0;
    let mut done = 0;
    while done < n {
        for q in 0..4 {
            let Some(&j) = per_queue[q].get(head[q]) else { continue };
            if busy[q] || ops[j].waits.iter().any(|&w| end[w].is_nan()) {
                continue;
            }
            let latest = ops[j].waits.iter().copied().chain(prev_on_queue[q]);
            cause[j] = latest.max_by(|&a, &b| end[a].total_cmp(&end[b]));
            start[j] = t;
            busy[q] = true;
            head[q] += 1;
            let c = ops[j].cost;
            assert!(c.host_s <= 0.0 || (c.host_share > 0.0 && c.host_share <= 1.0), "{c:?}");
            running.push(Running {
                op: j,
                fixed_left: c.fixed_s.max(0.0),
                host_left: c.host_s.max(0.0),
                share: c.host_share,
                first: c.first,
                since: t,
                ran: !c.first || c.host_s <= 0.0,
            });
        }
        // Ops with nothing left end now (a zero-cost op, or the part that ended last).
        let before = running.len();
        running.retain(|r| {
            let finished = r.fixed_left <= EPS && r.host_left <= EPS;
            if finished {
                let q = ops[r.op].queue.index();
                end[r.op] = t;
                busy[q] = false;
                prev_on_queue[q] = Some(r.op);
            }
            !finished
        });
        if running.len() < before {
            done += before - running.len();
            continue;
        }
        assert!(!running.is_empty(), "the plan deadlocks: no op can start at t = {t}");
        let rates = host_rates(&running, sharing);
        // A first op that waited for a CPU starts when it gets one.
        for (r, &rate) in running.iter_mut().zip(&rates) {
            if !r.ran && rate > 0.0 {
                r.ran = true;
                start[r.op] = t;
            }
        }
        // The next event: one part of one op ends.
        let dt = running
            .iter()
            .zip(&rates)
            .flat_map(|(r, &rate)| {
                let host = if r.host_left > EPS { r.host_left / rate } else { f64::INFINITY };
                let fixed = if r.fixed_left > EPS { r.fixed_left } else { f64::INFINITY };
                [host, fixed]
            })
            .fold(f64::INFINITY, f64::min);
        assert!(dt.is_finite(), "a running op makes no progress at t = {t}");
        t += dt;
        for (r, &rate) in running.iter_mut().zip(&rates) {
            r.fixed_left = (r.fixed_left - dt).max(0.0);
            r.host_left = (r.host_left - dt * rate).max(0.0);
        }
    }
    Timeline { start, end, cause }
}

/// Progress rates (alone-seconds of host work per second) of the running ops: the ops marked
/// `first` take their shares of [`Sharing::queue_share`], the latest started first (ties in
/// the order they started); then the rest of the host's capacity is split max-min fairly among
/// the other ops with host work left, each capped at its share; if their shares add up to
/// more than that rest, each gets `contended` of its part.
fn host_rates(running: &[Running], sharing: Sharing) -> Vec<f64> {
    let mut alloc = vec![0.0; running.len()];
    let with_work = |first: bool| -> Vec<usize> {
        let has_work = |i: &usize| running[*i].host_left > EPS && running[*i].first == first;
        (0..running.len()).filter(has_work).collect()
    };
    let mut first = with_work(true);
    // Stable: of first ops that started together, the one started first keeps its place.
    first.sort_by(|&a, &b| running[b].since.total_cmp(&running[a].since));
    let mut left = 1.0f64;
    let mut cpus = sharing.queue_share;
    for i in first {
        alloc[i] = running[i].share.min(cpus).max(0.0);
        cpus -= alloc[i];
        left -= alloc[i];
    }
    let mut open = with_work(false);
    let asked: f64 = open.iter().map(|&i| running[i].share).sum();
    let loss = if asked > left + EPS { sharing.contended } else { 1.0 };
    // Water-filling: the ops whose cap is below an equal split get their cap; repeat.
    open.sort_by(|&a, &b| running[a].share.total_cmp(&running[b].share));
    for (k, &i) in open.iter().enumerate() {
        let fair = left / (open.len() - k) as f64;
        let give = running[i].share.min(fair);
        alloc[i] = give * loss;
        left -= give;
    }
    running.iter().zip(alloc).map(|(r, a)| if r.share > 0.0 { a / r.share } else { 0.0 }).collect()
}

/// Seconds each queue spent running ops whose index is in `range`, clipped to `[from, to]`.
pub fn busy_in(
    ops: &[SimOp],
    tl: &Timeline,
    range: std::ops::Range<usize>,
    (from, to): (f64, f64),
) -> [f64; 4] {
    let mut b = [0.0; 4];
    for j in range {
        let (s, e) = (tl.start[j].max(from), tl.end[j].min(to));
        if e > s {
            b[ops[j].queue.index()] += e - s;
        }
    }
    b
}

/// The critical path ending at op `last`, walked back through each op's cause until an op that
/// ended at or before `from`: (op, seconds of it inside `[from, end of last]`), latest first.
pub fn critical_path(tl: &Timeline, last: usize, from: f64) -> Vec<(usize, f64)> {
    let mut path = Vec::new();
    let mut at = Some(last);
    while let Some(j) = at {
        if tl.end[j] <= from {
            break;
        }
        path.push((j, tl.end[j] - tl.start[j].max(from)));
        at = tl.cause[j];
    }
    path
}

#[cfg(test)]
mod tests {
    use super::*;
    use Queue::*;

    fn op(queue: Queue, cost: Cost, waits: &[usize]) -> SimOp {
        SimOp { queue, cost, waits: waits.to_vec() }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() < 1e-9
    }

    #[test]
    fn a_chain_on_one_queue_runs_back_to_back() {
        let ops: Vec<SimOp> =
            [1.0, 2.0, 0.5].iter().map(|&s| op(Compute, Cost::fixed(s), &[])).collect();
        let tl = simulate(&ops, Sharing::FREE);
        assert_eq!(tl.start, vec![0.0, 1.0, 3.0]);
        assert_eq!(tl.end, vec![1.0, 3.0, 3.5]);
        assert_eq!(tl.cause, vec![None, Some(0), Some(1)]);
        assert_eq!(critical_path(&tl, 2, 0.0), vec![(2, 0.5), (1, 2.0), (0, 1.0)]);
    }

    #[test]
    fn two_queues_with_a_wait() {
        // Upload 0 (2 s) -> compute 0 (3 s); upload 1 (2 s) runs under compute 0; compute 1
        // (1 s) waits for upload 1 and for its queue.
        let ops = vec![
            op(H2D, Cost::fixed(2.0), &[]),
            op(Compute, Cost::fixed(3.0), &[0]),
            op(H2D, Cost::fixed(2.0), &[]),
            op(Compute, Cost::fixed(1.0), &[2]),
            // A long upload: compute 2 waits for it, not for its queue.
            op(H2D, Cost::fixed(5.0), &[]),
            op(Compute, Cost::fixed(1.0), &[4]),
        ];
        let tl = simulate(&ops, Sharing::FREE);
        assert_eq!(tl.start, vec![0.0, 2.0, 2.0, 5.0, 4.0, 9.0]);
        assert_eq!(tl.end, vec![2.0, 5.0, 4.0, 6.0, 9.0, 10.0]);
        assert_eq!(tl.cause[3], Some(1), "compute 1 waited for its queue");
        assert_eq!(tl.cause[5], Some(4), "compute 2 waited for its upload");
        let b = busy_in(&ops, &tl, 0..6, (0.0, 10.0));
        assert_eq!((b[Compute.index()], b[H2D.index()]), (5.0, 9.0));
        let path: Vec<usize> = critical_path(&tl, 5, 0.0).iter().map(|p| p.0).collect();
        assert_eq!(path, vec![5, 4, 2, 0]);
    }

    #[test]
    fn a_wait_across_steps() {
        // Two steps of (compute 1 s; host update 2 s waiting for the compute); the next step's
        // compute waits for the previous step's update: period 3 s.
        let mut ops = vec![
            op(Compute, Cost::fixed(1.0), &[]),
            op(Host, Cost::host(2.0, 1.0), &[0]),
            op(Compute, Cost::fixed(1.0), &[1]),
            op(Host, Cost::host(2.0, 1.0), &[2]),
        ];
        ops[2].waits = vec![1];
        let tl = simulate(&ops, Sharing::FREE);
        assert_eq!(tl.end, vec![1.0, 3.0, 4.0, 6.0]);
        assert_eq!(tl.cause[2], Some(1));
    }

    #[test]
    fn host_work_is_shared_fairly_and_capped() {
        // Two full-host passes of 1 s each, side by side: both end at 2 s.
        let ops = vec![op(Host, Cost::host(1.0, 1.0), &[]), op(H2D, Cost::host(1.0, 1.0), &[])];
        let tl = simulate(&ops, Sharing::FREE);
        assert!(close(tl.end[0], 2.0) && close(tl.end[1], 2.0), "{:?}", tl.end);
        // A one-thread copy (share 1/4, 1 s alone) beside a full pass (1 s alone): the copy
        // keeps its quarter, the pass gets 3/4 until the copy ends at 1 s, then all.
        let ops = vec![op(H2D, Cost::host(1.0, 0.25), &[]), op(Host, Cost::host(1.0, 1.0), &[])];
        let tl = simulate(&ops, Sharing::FREE);
        assert!(close(tl.end[0], 1.0), "{:?}", tl.end);
        assert!(close(tl.end[1], 1.25), "{:?}", tl.end);
        // An upload's link time and its rounding overlap: it ends with the longer part.
        let up = Cost::fixed(2.0).with_host(Cost::host(1.0, 1.0));
        let ops = vec![op(H2D, up, &[]), op(Host, Cost::host(1.0, 1.0), &[])];
        let tl = simulate(&ops, Sharing::FREE);
        // Both host parts share the host until they end together at 2 s, the link at 2 s.
        assert!(close(tl.end[0], 2.0) && close(tl.end[1], 2.0), "{:?}", tl.end);
    }

    #[test]
    fn a_first_op_takes_its_share_before_the_others_split_the_rest() {
        // A one-thread copy taken first (a quarter, 1 s alone) beside two full passes: the copy
        // runs at its speed alone; the passes split the other 3/4 until it ends at 1 s (3/8
        // each), then half each: 1 - 3/8 = 5/8 left at rate 1/2, ending at 2.25 s.
        let ops = vec![
            op(Host, Cost::host(1.0, 1.0), &[]),
            op(H2D, Cost::host_first(1.0, 0.25), &[]),
            op(Compute, Cost::host(1.0, 1.0), &[]),
        ];
        let tl = simulate(&ops, Sharing::FREE);
        assert!(close(tl.end[1], 1.0), "{:?}", tl.end);
        assert!(close(tl.end[0], 2.25) && close(tl.end[2], 2.25), "{:?}", tl.end);
        // Two first ops started together over the whole host: the earlier in the list takes
        // its share, the later the rest.
        let ops = vec![
            op(H2D, Cost::host_first(1.0, 0.75), &[]),
            op(D2H, Cost::host_first(1.0, 0.5), &[]),
        ];
        let tl = simulate(&ops, Sharing::FREE);
        // The second runs at 0.25 / 0.5 until the first ends at 1 s (0.5 s of its work done),
        // then at its full share: 1.5 s.
        assert!(close(tl.end[0], 1.0) && close(tl.end[1], 1.5), "{:?}", tl.end);
    }

    #[test]
    fn the_latest_first_op_takes_the_queue_cpus_and_a_waiting_one_starts_when_it_runs() {
        // A 4-core host whose queue threads have one core (a quarter); one-core copies.
        let one_core = Sharing { queue_share: 0.25, ..Sharing::FREE };
        let copy = |s: f64| Cost::host_first(s, 0.25);
        // A download (2 s alone) running when an upload (1 s) starts at 1 s, after the
        // compute op it waits for: the upload takes the core and ends at 2 s; the download
        // waits meanwhile and ends at 3 s. A full pass (3 s alone) beside them gets the other
        // 3/4 until then, 2.25 s of its work, and the whole host after: 3.75 s.
        let ops = vec![
            op(D2H, copy(2.0), &[]),
            op(Compute, Cost::fixed(1.0), &[]),
            op(H2D, copy(1.0), &[1]),
            op(Host, Cost::host(3.0, 1.0), &[]),
        ];
        let tl = simulate(&ops, one_core);
        assert!(close(tl.start[2], 1.0) && close(tl.end[2], 2.0), "{:?}", tl);
        assert!(close(tl.start[0], 0.0) && close(tl.end[0], 3.0), "{:?}", tl);
        assert!(close(tl.end[3], 3.75), "{:?}", tl.end);
        // Two copies woken together: the first in the list runs, the other starts when it
        // ends (its queue busy from then), each at its speed alone.
        let ops = vec![op(H2D, copy(1.0), &[]), op(D2H, copy(1.0), &[])];
        let tl = simulate(&ops, one_core);
        assert_eq!((tl.start.clone(), tl.end.clone()), (vec![0.0, 1.0], vec![1.0, 2.0]));
        let b = busy_in(&ops, &tl, 0..2, (0.0, 2.0));
        assert_eq!((b[H2D.index()], b[D2H.index()]), (1.0, 1.0));
    }

    /// A host whose oversubscribed threads keep 0.8 of their split.
    const AT_08: Sharing = Sharing { contended: 0.8, queue_share: 1.0 };

    #[test]
    fn oversubscribed_threads_get_the_contended_part_of_their_split() {
        // A kernel over the whole host (1 s alone) beside a pool op on half of it (1 s alone),
        // at 0.8: each gets 0.8 of its half, the pool op ends at 1.25 s; the kernel has done
        // 0.5 s of its work by then and runs the rest alone: 1.75 s.
        let ops = vec![op(Compute, Cost::host(1.0, 1.0), &[]), op(Host, Cost::host(1.0, 0.5), &[])];
        let tl = simulate(&ops, AT_08);
        assert!(close(tl.end[1], 1.25) && close(tl.end[0], 1.75), "{:?}", tl.end);
        // A copy taken first keeps its share; the kernel gets 0.8 of the half it leaves: the
        // copy ends at 1 s, the kernel (0.4 s of work done) at 1.6 s.
        let ops =
            vec![op(Compute, Cost::host(1.0, 1.0), &[]), op(H2D, Cost::host_first(1.0, 0.5), &[])];
        let tl = simulate(&ops, AT_08);
        assert!(close(tl.end[1], 1.0) && close(tl.end[0], 1.6), "{:?}", tl.end);
        // Shares that fit the host lose nothing: a quarter and a half, 1 s each.
        let ops = vec![op(Host, Cost::host(1.0, 0.5), &[]), op(H2D, Cost::host(1.0, 0.25), &[])];
        let tl = simulate(&ops, AT_08);
        assert!(close(tl.end[0], 1.0) && close(tl.end[1], 1.0), "{:?}", tl.end);
    }

    #[test]
    fn zero_cost_ops_take_no_time() {
        let ops = vec![
            op(Compute, Cost::default(), &[]),
            op(H2D, Cost::fixed(1.0), &[0]),
            op(Compute, Cost::default(), &[1]),
        ];
        let tl = simulate(&ops, Sharing::FREE);
        assert_eq!(tl.end, vec![0.0, 1.0, 1.0]);
    }
}
