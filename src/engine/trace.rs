//! Op traces: when each op of a run ran (`horizon bench --trace FILE`), or when its projection
//! says it would (`horizon plan --hardware P --trace FILE`), written as a Chrome trace (the
//! JSON Trace Event Format that Perfetto and `chrome://tracing` open): one track per queue, one
//! slice per op named by its kind, with its step, its index in the schedule and its full kind
//! as arguments. The two files of one config line up op by op, which is how the projection's
//! per-op costs are checked against a run (`bench/compare_trace.py`).
//!
//! A run is traced by marks: host work queued on the op's queue after its waits and after the
//! op ([`Device::host_on`]), each storing the time it ran. On the CPU device a mark is a
//! closure run by the queue's thread between two tasks, so a slice is the op's run exactly
//! (its waits excluded). On CUDA a mark first synchronizes its stream, so a traced run loses
//! its queues' run-ahead (a few microseconds a launch): a trace shows where time goes, the
//! untraced bench says how fast.
//!
//! [`Device::host_on`]: horizon_backend::Device::host_on

use std::fmt::Write as _;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

use anyhow::{Context, Result};
use horizon_backend::Queue;

use crate::engine::plan::OpKind;

/// The most steps a run traces (its first): 100 steps of a schedule of a thousand ops are
/// 1.6 MB of marks and a file of about 20 MB.
pub const MAX_STEPS: usize = 100;

/// One op's slice of a trace, in seconds from the trace's origin.
#[derive(Clone, Debug, PartialEq)]
pub struct Span {
    /// The step (0: the first the trace saw).
    pub step: usize,
    /// The op's index in its step's schedule.
    pub op: usize,
    pub queue: Queue,
    pub kind: OpKind,
    pub start_s: f64,
    pub end_s: f64,
}

/// The op's name: its kind without fields (`Update`, `UploadWeights`).
pub fn kind_name(k: &OpKind) -> String {
    let s = format!("{k:?}");
    s.split([' ', '{', '(']).next().unwrap_or_default().to_string()
}

/// The queue's track name.
fn queue_name(q: Queue) -> &'static str {
    match q {
        Queue::Compute => "compute",
        Queue::H2D => "h2d",
        Queue::D2H => "d2h",
        Queue::Host => "host",
    }
}

/// `spans` as a Chrome trace of process `process` (what made it: "bench" or "projection").
pub fn chrome_json(process: &str, spans: &[Span]) -> String {
    let mut out = String::from("{\"displayTimeUnit\":\"ms\",\"traceEvents\":[\n");
    let _ = write!(
        out,
        "{{\"ph\":\"M\",\"pid\":1,\"name\":\"process_name\",\"args\":{{\"name\":{}}}}}",
        serde_json::Value::from(process)
    );
    for q in Queue::ALL {
        let _ = write!(
            out,
            ",\n{{\"ph\":\"M\",\"pid\":1,\"tid\":{},\"name\":\"thread_name\",\"args\":{{\"name\":\"{}\"}}}}",
            q.index(),
            queue_name(q)
        );
    }
    // Microseconds to the nanosecond, each end rounded once, so that an op that starts as
    // the one before it ends does not overlap it in the file.
    let us = |t: f64| (t * 1e9).round() / 1e3;
    for s in spans {
        let detail = serde_json::Value::from(format!("{:?}", s.kind));
        let (ts, end) = (us(s.start_s), us(s.end_s));
        let _ = write!(
            out,
            ",\n{{\"ph\":\"X\",\"pid\":1,\"tid\":{},\"name\":\"{}\",\"ts\":{:.3},\"dur\":{:.3},\"args\":{{\"step\":{},\"op\":{},\"kind\":{detail}}}}}",
            s.queue.index(),
            kind_name(&s.kind),
            ts,
            (end - ts).max(0.0),
            s.step,
            s.op
        );
    }
    out.push_str("\n]}\n");
    out
}

/// Write `spans` to `path` as [`chrome_json`].
pub fn write_chrome(path: &Path, process: &str, spans: &[Span]) -> Result<()> {
    std::fs::write(path, chrome_json(process, spans)).with_context(|| {
        format!("--trace {}: cannot write the trace\nhint: choose a writable path", path.display())
    })
}

/// The marks of a traced run: for each of the first `steps` steps and each op, when its queue
/// began it and when it finished it, in nanoseconds after `origin` plus one (0: not reached).
/// Sized when tracing starts; in the step loop a mark costs one boxed closure, as every queued
/// op does.
pub struct OpMarks {
    origin: Instant,
    ops: usize,
    steps: usize,
    marks: Vec<[AtomicU64; 2]>,
}

impl OpMarks {
    /// Marks for the first `steps` steps of a schedule of `ops` ops a step.
    pub fn new(steps: usize, ops: usize) -> Arc<Self> {
        let marks = (0..steps * ops).map(|_| [AtomicU64::new(0), AtomicU64::new(0)]).collect();
        Arc::new(OpMarks { origin: Instant::now(), ops, steps, marks })
    }

    /// Whether traced step `step` has room.
    pub fn covers(&self, step: usize) -> bool {
        step < self.steps
    }

    /// Mark op `op` of traced step `step` as begun (`end` false) or finished, now.
    pub fn mark(&self, step: usize, op: usize, end: bool) {
        let ns = self.origin.elapsed().as_nanos() as u64 + 1;
        self.marks[step * self.ops + op][usize::from(end)].store(ns, Ordering::Release);
    }

    /// The spans of every op with both marks, given each traced step's ops (`ops_of(step)`).
    pub fn spans<'a>(&self, ops_of: impl Fn(usize) -> &'a [crate::engine::plan::Op]) -> Vec<Span> {
        let mut out = Vec::new();
        for step in 0..self.steps {
            for (op, o) in ops_of(step).iter().enumerate() {
                let [a, b] = &self.marks[step * self.ops + op];
                let (a, b) = (a.load(Ordering::Acquire), b.load(Ordering::Acquire));
                if a > 0 && b > 0 {
                    let s = |ns: u64| (ns - 1) as f64 * 1e-9;
                    out.push(Span {
                        step,
                        op,
                        queue: o.queue,
                        kind: o.kind,
                        start_s: s(a),
                        end_s: s(b),
                    });
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trace_is_json_with_a_track_per_queue_and_a_slice_per_span() {
        let spans = [Span {
            step: 1,
            op: 3,
            queue: Queue::Host,
            kind: OpKind::GradNorm,
            start_s: 0.5,
            end_s: 0.75,
        }];
        let v: serde_json::Value = serde_json::from_str(&chrome_json("bench", &spans)).unwrap();
        let ev = v["traceEvents"].as_array().unwrap();
        assert_eq!(ev.len(), 1 + 4 + 1, "process name, four tracks, one slice");
        let x = &ev[5];
        assert_eq!((x["ph"].as_str(), x["name"].as_str()), (Some("X"), Some("GradNorm")));
        assert_eq!((x["ts"].as_f64(), x["dur"].as_f64()), (Some(500_000.0), Some(250_000.0)));
        assert_eq!((x["args"]["step"].as_u64(), x["args"]["op"].as_u64()), (Some(1), Some(3)));
        assert_eq!(x["tid"].as_u64(), Some(Queue::Host.index() as u64));
    }

    #[test]
    fn marks_become_spans_only_when_both_ends_are_reached() {
        let ops = vec![
            crate::engine::plan::Op {
                kind: OpKind::GradNorm,
                queue: Queue::Host,
                reads: vec![],
                writes: vec![],
                waits: vec![],
            };
            2
        ];
        let m = OpMarks::new(2, 2);
        assert!(m.covers(1) && !m.covers(2));
        m.mark(0, 0, false);
        m.mark(0, 0, true);
        m.mark(1, 1, false);
        let spans = m.spans(|_| &ops[..]);
        assert_eq!(spans.len(), 1, "{spans:?}");
        assert!(spans[0].end_s >= spans[0].start_s && spans[0].start_s >= 0.0);
    }
}
