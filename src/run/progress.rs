//! What a person watching a run sees: on a terminal, a progress bar (loss, tokens/s, peak
//! memory, ETA) with a step line every few percent; otherwise (a log file, a pipe) one line per
//! step.

use std::io::Write;

use crate::engine::memory::{gib, peak_rss_bytes};
use crate::run::summary::StepMetrics;

/// What a person watching a run sees: on a terminal, a progress bar (loss, tokens/s, peak
/// memory, ETA) with a step line every few percent; otherwise (a log file, a pipe) one line per
/// step.
pub struct Progress {
    bar: Option<indicatif::ProgressBar>,
    /// On a terminal, print a step line every this many steps.
    every: usize,
}

impl Progress {
    pub fn new(start: usize, steps: usize) -> Self {
        use std::io::IsTerminal;
        if !std::io::stderr().is_terminal() {
            return Progress { bar: None, every: 1 };
        }
        let bar = indicatif::ProgressBar::new(steps as u64);
        let style = indicatif::ProgressStyle::with_template(
            "{elapsed_precise} [{bar:30.cyan/blue}] {pos}/{len} {msg} eta {eta}",
        )
        .expect("the template is valid")
        .progress_chars("=> ");
        bar.set_style(style);
        bar.set_position(start as u64);
        Progress { bar: Some(bar), every: steps.div_ceil(25).max(1) }
    }

    /// Step `m` of `steps` shown, with the time left to the end of the run and (`epoch_eta_s`,
    /// when the run takes more than one epoch) of the epoch.
    pub fn step(
        &mut self,
        m: &StepMetrics,
        steps: usize,
        (eta_s, epoch_eta_s): (f64, Option<f64>),
    ) {
        let tps = m.tokens as f64 / m.step_s.max(1e-9);
        let rss = peak_rss_bytes().map_or(String::new(), |b| format!("  peak RSS {}", gib(b)));
        let mut eval = m.eval_loss.map_or(String::new(), |e| format!("  eval_loss {e:.6}"));
        // A DPO step: its reward accuracy and margin (held-out ones too, when it evaluated).
        let rewards = |d: &crate::model::dpo::DpoMetrics, p: &str| {
            format!("  {p}acc {:.2}  {p}margin {:.4}", d.reward_accuracy, d.reward_margin)
        };
        eval += &m.eval_dpo.map_or(String::new(), |e| rewards(&e.0, "eval_"));
        let dpo = m.dpo.as_ref().map_or(String::new(), |d| rewards(d, ""));
        let ends = epoch_eta_s.map_or(String::new(), |s| format!(" (epoch {})", hms(s)));
        let line = format!(
            "step {:>5}/{steps}  epoch {:.2}  loss {:.6}{dpo}  grad_norm {:.4}  lr {:.3e}  {:.0} tok/s{eval}  eta {}{ends}{rss}",
            m.step,
            m.epoch,
            m.loss,
            m.grad_norm,
            m.lr,
            tps,
            hms(eta_s)
        );
        match &self.bar {
            Some(bar) => {
                let epoch = format!("epoch {}", m.epoch.ceil().max(1.0));
                bar.set_message(format!("{epoch}  loss {:.4}  {tps:.0} tok/s{rss}", m.loss));
                bar.inc(1);
                if m.step.is_multiple_of(self.every) || m.step == steps || m.eval_loss.is_some() {
                    bar.println(line);
                }
            }
            None => {
                println!("{line}");
                let _ = std::io::stdout().flush();
            }
        }
    }

    pub fn println(&self, line: &str) {
        match &self.bar {
            Some(bar) => bar.println(line),
            None => {
                println!("{line}");
                let _ = std::io::stdout().flush();
            }
        }
    }

    pub fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
    }
}

/// `1h02m03s`, `4m05s`, `6s`.
fn hms(s: f64) -> String {
    let s = s.max(0.0).round() as u64;
    match (s / 3600, s / 60 % 60, s % 60) {
        (0, 0, sec) => format!("{sec}s"),
        (0, m, sec) => format!("{m}m{sec:02}s"),
        (h, m, sec) => format!("{h}h{m:02}m{sec:02}s"),
    }
}
