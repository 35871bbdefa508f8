//! The plan's waits and their proof. [`Scheduler`] derives each op's waits from the resources
//! it declares (on other queues; a queue is ordered in itself); [`check`], written separately,
//! rejects any plan in which two conflicting accesses on different queues are not ordered by a
//! chain of waits (read-after-write, write-after-read, write-after-write), with a vector clock
//! per queue.

use std::collections::HashMap;
use std::fmt;

use horizon_backend::Queue;

use super::types::{Op, Res};

/// Vector clock: for each queue, how many of its operations happen before (inclusive).
type Vc = [u64; 4];

#[derive(Clone, Copy, Debug)]
struct Access {
    op: usize,
    queue: Queue,
    /// 1-based position of the op on its queue.
    seq: u64,
    vc: Vc,
}

impl Access {
    fn happens_before(&self, vc: &Vc) -> bool {
        vc[self.queue.index()] >= self.seq
    }
}

#[derive(Clone, Debug, Default)]
struct ResState {
    write: Option<Access>,
    /// Latest read on each queue since the last write.
    reads: [Option<Access>; 4],
}

/// Tracks, across the steps of a run, who last touched each resource and what is ordered
/// before what. Feeding it operations in submission order gives each one the waits it needs.
#[derive(Clone, Debug, Default)]
pub struct Scheduler {
    queue_vc: [Vc; 4],
    queue_seq: [u64; 4],
    res: HashMap<Res, ResState>,
    /// The global index the next scheduled op gets.
    next_op: usize,
}

fn merge(a: &mut Vc, b: &Vc) {
    for (x, y) in a.iter_mut().zip(b) {
        *x = (*x).max(*y);
    }
}

impl Scheduler {
    pub fn new() -> Self {
        Self::default()
    }

    /// The accesses of `op` that conflict with earlier ones, latest first.
    fn conflicts(&self, op: &Op) -> Vec<Access> {
        let mut out = Vec::new();
        for r in op.reads.iter().chain(&op.writes) {
            if let Some(st) = self.res.get(r) {
                out.extend(st.write);
                if op.writes.contains(r) {
                    out.extend(st.reads.iter().flatten().copied());
                }
            }
        }
        out.sort_by_key(|a| std::cmp::Reverse(a.op));
        out
    }

    fn commit(&mut self, op: &Op, vc: Vc, seq: u64) {
        let q = op.queue.index();
        let me = Access { op: self.next_op, queue: op.queue, seq, vc };
        for r in &op.reads {
            if !op.writes.contains(r) {
                self.res.entry(*r).or_default().reads[q] = Some(me);
            }
        }
        for r in &op.writes {
            let st = self.res.entry(*r).or_default();
            st.write = Some(me);
            st.reads = [None; 4];
        }
        self.queue_vc[q] = vc;
        self.queue_seq[q] = seq;
        self.next_op += 1;
    }

    /// Give `op` the waits that order it after every conflicting earlier access (on other
    /// queues; a queue is ordered in itself), and record its accesses.
    pub fn schedule(&mut self, op: &mut Op) {
        let q = op.queue.index();
        let seq = self.queue_seq[q] + 1;
        let mut vc = self.queue_vc[q];
        vc[q] = seq;
        op.waits.clear();
        for a in self.conflicts(op) {
            if !a.happens_before(&vc) {
                op.waits.push(a.op);
                merge(&mut vc, &a.vc);
            }
        }
        op.waits.sort_unstable();
        self.commit(op, vc, seq);
    }
}

/// A hazard the checker found.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Hazard {
    /// Two accesses to `res` on different queues, at least one a write, that no chain of waits
    /// orders (`what`: read-after-write, write-after-read or write-after-write).
    Unordered { earlier: usize, later: usize, res: Res, what: &'static str },
    /// Op `later` waits for `wait`, which is not an earlier op of the sequence.
    InvalidWait { later: usize, wait: usize },
}

impl fmt::Display for Hazard {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Hazard::Unordered { earlier, later, res, what } => write!(
                f,
                "{what} hazard on {res:?}: op {later} is not ordered after op {earlier} (missing wait)"
            ),
            Hazard::InvalidWait { later, wait } => {
                write!(f, "op {later} waits for op {wait}, which is not an earlier op")
            }
        }
    }
}

/// Check a sequence of operations (global indices `base..base + ops.len()`, in submission
/// order) for hazards: every pair of accesses to one resource, at least one a write, on
/// different queues, must be ordered by a chain of waits. Waits must name earlier ops.
pub fn check(ops: &[Op], base: usize) -> Result<(), Hazard> {
    let mut queue_vc = [[0u64; 4]; 4];
    let mut queue_seq = [0u64; 4];
    let mut vcs: Vec<Vc> = Vec::with_capacity(ops.len());
    let mut seqs: Vec<u64> = Vec::with_capacity(ops.len());
    let mut last_write: HashMap<Res, usize> = HashMap::new();
    let mut reads_since: HashMap<Res, Vec<usize>> = HashMap::new();
    for (j, op) in ops.iter().enumerate() {
        let q = op.queue.index();
        let seq = queue_seq[q] + 1;
        let mut vc = queue_vc[q];
        vc[q] = seq;
        for &w in &op.waits {
            if w < base || w >= base + j {
                return Err(Hazard::InvalidWait { later: base + j, wait: w });
            }
            merge(&mut vc, &vcs[w - base]);
        }
        let ordered = |i: usize, vc: &Vc| vc[ops[i].queue.index()] >= seqs[i];
        for r in op.reads.iter().chain(&op.writes) {
            if let Some(&w) = last_write.get(r)
                && !ordered(w, &vc)
            {
                let what =
                    if op.writes.contains(r) { "write-after-write" } else { "read-after-write" };
                return Err(Hazard::Unordered {
                    earlier: base + w,
                    later: base + j,
                    res: *r,
                    what,
                });
            }
            if op.writes.contains(r) {
                for &rd in reads_since.get(r).map(Vec::as_slice).unwrap_or(&[]) {
                    if !ordered(rd, &vc) {
                        return Err(Hazard::Unordered {
                            earlier: base + rd,
                            later: base + j,
                            res: *r,
                            what: "write-after-read",
                        });
                    }
                }
            }
        }
        for r in &op.reads {
            if !op.writes.contains(r) {
                reads_since.entry(*r).or_default().push(j);
            }
        }
        for r in &op.writes {
            last_write.insert(*r, j);
            reads_since.remove(r);
        }
        queue_vc[q] = vc;
        queue_seq[q] = seq;
        vcs.push(vc);
        seqs.push(seq);
    }
    Ok(())
}
