//! How fast a run will go on a given machine, before it runs: the same [`Schedule`] the
//! executor runs, simulated op by op ([`des`]) with each op's duration from a cost model
//! ([`cost`]) of a hardware profile ([`hardware`], [`calibrate`]). `horizon plan --hardware`
//! prints it ([`crate::run::projection`]): the model of the machine lives here, its printer in
//! the run layer.

pub mod calibrate;
pub mod cost;
pub mod des;
pub mod hardware;

use horizon_backend::Queue;

use crate::engine::phases::step_flops;
use crate::engine::plan::{OpKind, Schedule};
use crate::engine::trace::{Span, kind_name};
use crate::sim::cost::CostModel;
use crate::sim::des::{SimOp, Timeline, busy_in, critical_path, simulate};

/// Steps simulated: the first (from an idle device) and enough steady ones that the last is
/// a steady step between steady steps.
const STEPS: usize = 4;

/// A window of the steady step, what bounded it, and the queues' work in it.
#[derive(Clone, Debug, PartialEq)]
pub struct PhaseBound {
    pub name: &'static str,
    pub seconds: f64,
    /// The queue with the most time on the critical path in this window, and that time.
    pub bound: Queue,
    pub bound_s: f64,
    /// The op kind with the most critical-path time in the window.
    pub top_op: String,
    /// Busy seconds of each queue in the window.
    pub busy: [f64; 4],
}

/// The projection of one steady step.
#[derive(Clone, Debug, PartialEq)]
pub struct Projection {
    pub first_step_s: f64,
    pub step_s: f64,
    pub tokens: usize,
    /// Model FLOPs of a step ([`crate::engine::phases::StepFlops::model`]: 6 x matrix
    /// parameters x tokens + attention; an adapter run's frozen base counts 4x, no weight
    /// gradient).
    pub model_flops: f64,
    /// Busy seconds of each queue in the steady step ([`Queue::index`]).
    pub busy: [f64; 4],
    pub phases: Vec<PhaseBound>,
    /// Every simulated op of the [`STEPS`] steps, from an idle machine at 0
    /// (`horizon plan --trace`).
    pub spans: Vec<Span>,
}

impl Projection {
    pub fn tokens_per_s(&self) -> f64 {
        self.tokens as f64 / self.step_s
    }
    /// Model FLOPs utilisation at `peak_flops`.
    pub fn mfu(&self, peak_flops: f64) -> f64 {
        self.model_flops / self.step_s / peak_flops
    }
}

/// Simulate `STEPS` steps of `schedule` under `model`.
pub fn project(schedule: &Schedule, model: &CostModel<'_>, tokens: usize) -> Projection {
    let n = schedule.len();
    let ops = schedule.unrolled(STEPS);
    let sim: Vec<SimOp> = ops
        .iter()
        .map(|op| SimOp {
            queue: op.queue,
            cost: model.op(&op.kind, &op.reads),
            waits: op.waits.clone(),
        })
        .collect();
    let tl = simulate(&sim, model.sharing());
    let step_end = |k: usize| tl.end[k * n..(k + 1) * n].iter().copied().fold(0.0, f64::max);
    // The steady step `s`: from its first layer forward to the next step's, whose critical
    // path is walked back into it.
    let s = STEPS - 2;
    let first_forward = |k: usize| {
        (k * n..(k + 1) * n)
            .find(|&j| matches!(ops[j].kind, OpKind::Forward { .. }))
            .expect("a step has forwards")
    };
    let (next, from) = (first_forward(s + 1), tl.start[first_forward(s)]);
    let to = tl.start[next];
    let range = s * n..(s + 1) * n;
    let busy = busy_in(&sim, &tl, 0..sim.len(), (from, to));
    let path = critical_path(&tl, next, from);
    if std::env::var_os("HORIZON_SIM_TRACE").is_some() {
        for &(j, secs) in path.iter().rev() {
            let (op, t0) = (&ops[j], tl.start[j] - from);
            eprintln!("{t0:>10.6} {secs:>9.6} {:?} {:?}", op.queue, op.kind);
        }
    }
    let phases = phase_bounds(&ops, &sim, &tl, range, (from, to), &path);
    let cfg = model.cfg;
    let flops = step_flops(schedule, model.layout, cfg.micro_batch_size, cfg.seq_len);
    Projection {
        first_step_s: step_end(0),
        step_s: to - from,
        tokens,
        model_flops: flops.model,
        busy,
        phases,
        spans: ops
            .iter()
            .enumerate()
            .map(|(j, op)| Span {
                step: j / n,
                op: j % n,
                queue: op.queue,
                kind: op.kind,
                start_s: tl.start[j],
                end_s: tl.end[j],
            })
            .collect(),
    }
}

/// The steady step's windows (forward, head, backward, the step boundary), each with what its
/// critical path ran on.
fn phase_bounds(
    ops: &[crate::engine::plan::Op],
    sim: &[SimOp],
    tl: &Timeline,
    range: std::ops::Range<usize>,
    (from, to): (f64, f64),
    path: &[(usize, f64)],
) -> Vec<PhaseBound> {
    let is_head = |k: &OpKind| {
        matches!(
            k,
            OpKind::Head { .. }
                | OpKind::HeadStats { .. }
                | OpKind::HeadGrad { .. }
                | OpKind::HeadFinish { .. }
        )
    };
    let head_start =
        range.clone().filter(|&j| is_head(&ops[j].kind)).map(|j| tl.start[j]).fold(to, f64::min);
    let head_end = range
        .clone()
        .filter(|&j| is_head(&ops[j].kind))
        .map(|j| tl.end[j])
        .fold(head_start, f64::max);
    let bwd_end = range
        .clone()
        .filter(|&j| matches!(ops[j].kind, OpKind::Backward { .. }))
        .map(|j| tl.end[j])
        .fold(head_end, f64::max);
    let windows = [
        ("forward", from, head_start.max(from)),
        ("head", head_start.max(from), head_end.max(from)),
        ("backward", head_end.max(from), bwd_end.max(from)),
        ("step boundary", bwd_end.max(from), to),
    ];
    windows
        .into_iter()
        .map(|(name, a, b)| {
            let mut on = [0.0f64; 4];
            let mut by_kind: Vec<(String, f64)> = Vec::new();
            for &(j, _) in path {
                let s = (tl.end[j].min(b) - tl.start[j].max(a)).max(0.0);
                if s > 0.0 {
                    on[ops[j].queue.index()] += s;
                    let k = kind_name(&ops[j].kind);
                    match by_kind.iter_mut().find(|(n, _)| *n == k) {
                        Some(e) => e.1 += s,
                        None => by_kind.push((k, s)),
                    }
                }
            }
            let q = (0..4).max_by(|&x, &y| on[x].total_cmp(&on[y])).unwrap_or(0);
            let top = by_kind.into_iter().max_by(|x, y| x.1.total_cmp(&y.1)).map(|x| x.0);
            PhaseBound {
                name,
                seconds: b - a,
                bound: Queue::ALL[q],
                bound_s: on[q],
                top_op: top.unwrap_or_default(),
                busy: busy_in(sim, tl, 0..sim.len(), (a, b)),
            }
        })
        .collect()
}
