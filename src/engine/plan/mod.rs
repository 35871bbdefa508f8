//! The step as data: the list of operations of one optimizer step (uploads, forward, checkpoint
//! saves, recompute, backward, gradient downloads and accumulation, optimizer updates), each
//! on a queue, with the resources it reads and writes and the earlier operations it waits for.
//!
//! Waits are derived from the resource accesses ([`Scheduler`]), and checked independently by
//! [`check`], which rejects any plan in which two conflicting accesses on different queues are
//! not ordered by a chain of waits (read-after-write, write-after-read, write-after-write).
//!
//! The rooms: [`types`] (the vocabulary), [`build`] (a step's ops, and an evaluation's),
//! [`hazards`] (the scheduler and the checker), and here the [`Schedule`] a run executes: the
//! first step, the steady state, and the evaluation plan.

mod build;
mod hazards;
mod types;

pub use build::{eval_ops, step_ops};
pub use hazards::{Hazard, Scheduler, check};
pub use types::{
    ActSource, GradTarget, LayerSet, Op, OpKind, ParamBuf, PlanShape, Res, SlotContent,
    keeps_internals,
};

/// The plans a run executes: the first step's (from an idle device), then the steady state
/// every later step repeats. Waits in `steady` that point before its own first op name ops
/// of the previous step (`index - ops.len()` in the previous step's numbering).
#[derive(Clone, Debug)]
pub struct Schedule {
    pub shape: PlanShape,
    pub first: Vec<Op>,
    pub steady: Vec<Op>,
}

/// A wait of an op of step k: on an op of the same step, or of step k-1.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wait {
    This(usize),
    Prev(usize),
}

impl Schedule {
    /// Build and schedule three consecutive steps; the third must repeat the second.
    pub fn new(shape: PlanShape) -> Self {
        let ops = step_ops(shape);
        let n = ops.len();
        let mut sched = Scheduler::new();
        let mut steps: Vec<Vec<Op>> = Vec::new();
        for _ in 0..3 {
            let mut step = ops.clone();
            for op in &mut step {
                sched.schedule(op);
            }
            steps.push(step);
        }
        let rebase = |step: &[Op], base: usize| -> Vec<Op> {
            step.iter()
                .map(|op| Op {
                    waits: op.waits.iter().map(|w| w + n - base).collect(),
                    ..op.clone()
                })
                .collect()
        };
        let steady = rebase(&steps[1], n);
        assert_eq!(steady, rebase(&steps[2], 2 * n), "the schedule must reach a steady state");
        Schedule { shape, first: steps.swap_remove(0), steady }
    }

    /// Ops per step.
    pub fn len(&self) -> usize {
        self.first.len()
    }

    pub fn is_empty(&self) -> bool {
        self.first.is_empty()
    }

    /// The ops of step `k` (0-based).
    pub fn ops(&self, k: u64) -> &[Op] {
        if k == 0 { &self.first } else { &self.steady }
    }

    /// Waits of op `j` of step `k`, split into this step's and the previous step's.
    pub fn waits(&self, k: u64, j: usize) -> impl Iterator<Item = Wait> + '_ {
        // The first step's waits are its own op indices; the steady state's are shifted by
        // one step (see `new`).
        let (n, first) = (self.len(), k == 0);
        self.ops(k)[j].waits.iter().map(move |&w| {
            if first {
                Wait::This(w)
            } else if w >= n {
                Wait::This(w - n)
            } else {
                Wait::Prev(w)
            }
        })
    }

    /// The ops of `steps` consecutive steps with global wait indices, for the checker.
    pub fn unrolled(&self, steps: usize) -> Vec<Op> {
        let n = self.len();
        let mut out = self.first.clone();
        for s in 1..steps {
            out.extend(self.steady.iter().map(|op| Op {
                waits: op.waits.iter().map(|w| w + (s - 1) * n).collect(),
                ..op.clone()
            }));
        }
        out
    }

    /// Weight uploads per layer per step (steady state).
    pub fn uploads_per_layer(&self) -> Vec<usize> {
        let mut c = vec![0; self.shape.layers];
        for op in &self.steady {
            if let OpKind::UploadWeights { what: SlotContent::Layer(i), .. } = op.kind {
                c[i] += 1;
            }
        }
        c
    }

    /// A text timeline of one steady step: each op with its queue and waits.
    pub fn timeline(&self) -> String {
        let n = self.len();
        let mut s = String::new();
        for (j, op) in self.steady.iter().enumerate() {
            let waits: Vec<String> = op
                .waits
                .iter()
                .map(|&w| if w >= n { format!("{}", w - n) } else { format!("prev.{w}") })
                .collect();
            let q = format!("{:?}", op.queue);
            s.push_str(&format!("{j:>4} {q:<8} {:?}", op.kind));
            if !waits.is_empty() {
                s.push_str(&format!("  waits [{}]", waits.join(", ")));
            }
            s.push('\n');
        }
        s
    }
}

/// The evaluation plan of `shape`'s engine ([`eval_ops`]) with its waits, scheduled from an idle
/// device (the executor synchronises before and after each evaluation): waits name ops of the
/// same plan.
pub fn eval_plan(shape: PlanShape) -> Vec<Op> {
    let mut ops = eval_ops(shape);
    let mut sched = Scheduler::new();
    for op in &mut ops {
        sched.schedule(op);
    }
    ops
}

#[cfg(test)]
mod tests;

#[cfg(test)]
mod doc_tests {
    use super::*;

    /// docs/schedule.md shows the steady-state timeline of one step for 4 layers, K = 2, one
    /// micro-batch, in exact and in streamed (`lean`/`compact`) mode; this keeps both true.
    #[test]
    fn schedule_md_shows_the_current_timeline() {
        for streamed in [false, true] {
            schedule_md_shows(streamed);
        }
    }

    fn schedule_md_shows(streamed: bool) {
        let s = Schedule::new(PlanShape {
            layers: 4,
            micro_batches: 1,
            checkpoint_every: 2,
            grad_slabs: 2,
            tied: false,
            head_tiles: 1,
            kept_layers: 0,
            streamed,
            staged: false,
            chunked: LayerSet::default(),
            expert_chunks: 1,
            chunks_trained: false,
        });
        let doc = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/docs/schedule.md"))
            .unwrap();
        let timeline = s.timeline();
        if std::env::var_os("HORIZON_PRINT_TIMELINE").is_some() {
            println!("streamed {streamed}:\n{timeline}");
        }
        assert!(
            doc.contains(&timeline),
            "docs/schedule.md's timeline is stale; regenerate it with\n\
             HORIZON_PRINT_TIMELINE=1 cargo test --lib schedule_md -- --nocapture\n{timeline}"
        );
    }
}
