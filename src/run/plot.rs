//! What a run leaves for a person to look at: `OUT/training.png` (training and eval loss, a DPO
//! run's reward margin and accuracy, throughput) and `OUT/report.md` (a short summary), both
//! made from `OUT/metrics.jsonl`, so a resumed run's plot covers every step.

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Once;

use anyhow::{Context, Result, anyhow};
use plotters::prelude::*;

use crate::engine::memory::gib;
use crate::run::summary::Summary;

/// The font every label is drawn with, embedded so that plots need no system fonts (DejaVu
/// Sans; licence in `assets/fonts/LICENSE-DejaVu.txt`). Proportional: a monospaced font gives
/// the decimal point a whole cell, and tick labels read "5. 0".
static FONT: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");
const FAMILY: &str = "horizon-sans";

/// One step read back from `metrics.jsonl`.
#[derive(Clone, Debug, Default)]
pub struct Point {
    pub step: usize,
    pub loss: f64,
    pub tokens_per_s: f64,
    pub eval_loss: Option<f64>,
    pub skipped: bool,
    pub lr: f64,
    pub grad_norm: f64,
    /// DPO only: the mean over the step's pairs of the chosen reward less the rejected one.
    pub reward_margin: Option<f64>,
    /// DPO only: the fraction (0..1) of the step's pairs whose chosen reward is the higher.
    pub reward_accuracy: Option<f64>,
    /// DPO only, on steps that evaluate the held-out pairs: their reward margin.
    pub eval_reward_margin: Option<f64>,
    /// DPO only, on steps that evaluate the held-out pairs: their reward accuracy.
    pub eval_reward_accuracy: Option<f64>,
}

/// The steps of a `metrics.jsonl` (a later line for the same step, as after a resume,
/// replaces an earlier one).
pub fn read_metrics(path: &Path) -> Result<Vec<Point>> {
    let text =
        fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut points: Vec<Point> = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let v: serde_json::Value = serde_json::from_str(line)
            .with_context(|| format!("{}:{}: not valid JSON", path.display(), i + 1))?;
        let f = |k: &str| v[k].as_f64();
        let Some(step) = v["step"].as_u64() else { continue };
        let p = Point {
            step: step as usize,
            loss: f("loss").unwrap_or(f64::NAN),
            tokens_per_s: f("tokens").unwrap_or(0.0) / f("step_s").unwrap_or(f64::NAN),
            eval_loss: f("eval_loss"),
            skipped: v["skipped"].as_bool().unwrap_or(false),
            lr: f("lr").unwrap_or(f64::NAN),
            grad_norm: f("grad_norm").unwrap_or(f64::NAN),
            reward_margin: f("reward_margin"),
            reward_accuracy: f("reward_accuracy"),
            eval_reward_margin: f("eval_reward_margin"),
            eval_reward_accuracy: f("eval_reward_accuracy"),
        };
        points.retain(|q| q.step < p.step);
        points.push(p);
    }
    Ok(points)
}

/// The plot's eval series: `(step, eval_loss)` of the steps that evaluated.
pub fn eval_series(points: &[Point]) -> Vec<(f64, f64)> {
    series(points, |p| p.eval_loss)
}

/// `(step, y)` of the points where `y` is present and finite.
fn series(points: &[Point], y: impl Fn(&Point) -> Option<f64>) -> Vec<(f64, f64)> {
    points
        .iter()
        .filter_map(|p| y(p).map(|v| (p.step as f64, v)))
        .filter(|p| p.1.is_finite())
        .collect()
}

/// The chart every panel is: `f64` step against `f64` value, drawn into a bitmap.
type StepChart<'a, 'b> = ChartContext<
    'a,
    BitMapBackend<'b>,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;
type Area<'b> = DrawingArea<BitMapBackend<'b>, plotters::coord::Shift>;

/// Draw panels against the step into a PNG at `path`: the loss (training, and eval where
/// measured; on a log scale where it spans more than a decade), the learning rate, the
/// gradient norm (before clipping) and the throughput, in a 2x2 grid of 600x400 panels. A DPO
/// run (any point with a reward margin) adds the reward margin and the reward accuracy beside
/// the loss, training and eval, in a 2x3 grid of panels the same size.
pub fn plot(points: &[Point], path: &Path, title: &str) -> Result<()> {
    static REGISTER: Once = Once::new();
    REGISTER.call_once(|| {
        // The embedded font is valid; a failure would only leave the labels out.
        let _ = plotters::style::register_font(FAMILY, FontStyle::Normal, FONT);
    });
    let err = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", path.display());
    let dpo = points.iter().any(|p| p.reward_margin.is_some());
    let (size, grid) = if dpo { ((1800, 800), (2, 3)) } else { ((1200, 800), (2, 2)) };
    let root = BitMapBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let root = root.titled(title, (FAMILY, 22)).map_err(|e| err(&e))?;
    let panels = root.split_evenly(grid);
    let max_step = points.iter().map(|p| p.step).max().unwrap_or(1).max(2) as f64;
    loss_panel(&panels[0], points, max_step, path)?;
    let rest = if dpo {
        reward_panels(&panels[1..3], points, max_step, path)?;
        &panels[3..]
    } else {
        &panels[1..]
    };
    let lines = [
        ("learning rate", series(points, |p| Some(p.lr)), MAGENTA),
        ("gradient norm (before clipping)", series(points, |p| Some(p.grad_norm)), BLACK),
        ("throughput (tokens/s)", series(points, |p| Some(p.tokens_per_s)), GREEN),
    ];
    for (area, (caption, xy, colour)) in rest.iter().zip(lines) {
        let top = xy.iter().map(|p| p.1).fold(0.0f64, f64::max);
        let top = if top > 0.0 { top * 1.1 } else { 1.0 };
        let mut chart = step_chart(area, caption, max_step, 0f64..top, false, path)?;
        chart.draw_series(LineSeries::new(xy, colour.stroke_width(1))).map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))?;
    Ok(())
}

/// The DPO panels, on `areas[0]` and `areas[1]`: the reward margin (its axis always holding
/// zero, where chosen and rejected tie) and the reward accuracy (axis 0..1), training and eval.
fn reward_panels(areas: &[Area<'_>], points: &[Point], max_step: f64, path: &Path) -> Result<()> {
    let train = series(points, |p| p.reward_margin);
    let evals = series(points, |p| p.eval_reward_margin);
    let all = train.iter().chain(&evals).map(|p| p.1);
    let (lo, hi) = all.fold((0.0f64, 0.0f64), |(a, b), x| (a.min(x), b.max(x)));
    let pad = if hi > lo { 0.05 * (hi - lo) } else { 1.0 };
    let caption = "reward margin (chosen \u{2212} rejected)";
    let mut chart = step_chart(&areas[0], caption, max_step, (lo - pad)..(hi + pad), false, path)?;
    train_and_eval(&mut chart, &train, &evals, path)?;
    let train = series(points, |p| p.reward_accuracy);
    let evals = series(points, |p| p.eval_reward_accuracy);
    // A little room either side, so that points at 0 or 1 are drawn whole.
    let caption = "reward accuracy (chosen > rejected)";
    let mut chart = step_chart(&areas[1], caption, max_step, -0.02..1.02, false, path)?;
    train_and_eval(&mut chart, &train, &evals, path)
}

/// The loss panel: training and eval losses, on a log scale (log10 drawn, labelled with the
/// values) when they span more than a decade.
fn loss_panel(area: &Area<'_>, points: &[Point], max_step: f64, path: &Path) -> Result<()> {
    let good = series(points, |p| Some(p.loss));
    let evals = eval_series(points);
    let all = good.iter().chain(&evals).map(|p| p.1);
    let (lo, hi) = all.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), x| (a.min(x), b.max(x)));
    let log = lo > 0.0 && hi / lo > 10.0;
    let y = |v: f64| if log { v.log10() } else { v };
    let (lo, hi) = if lo.is_finite() { (y(lo).min(y(hi) - 1e-6), y(hi)) } else { (0.0, 1.0) };
    let pad = 0.05 * (hi - lo);
    let caption = if log { "loss (log scale)" } else { "loss" };
    let mut chart = step_chart(area, caption, max_step, (lo - pad)..(hi + pad), log, path)?;
    let scaled = |xy: &[(f64, f64)]| xy.iter().map(|&(x, v)| (x, y(v))).collect::<Vec<_>>();
    train_and_eval(&mut chart, &scaled(&good), &scaled(&evals), path)
}

/// Draw a training series (a blue line) and, where there is one, an eval series (a red line
/// with a dot at each evaluation) on `chart`, with their legend.
fn train_and_eval<'a, 'b: 'a>(
    chart: &mut StepChart<'a, 'b>,
    train: &[(f64, f64)],
    evals: &[(f64, f64)],
    path: &Path,
) -> Result<()> {
    let err = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", path.display());
    chart
        .draw_series(LineSeries::new(train.iter().copied(), &BLUE))
        .map_err(|e| err(&e))?
        .label("train")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], BLUE));
    if !evals.is_empty() {
        chart
            .draw_series(LineSeries::new(evals.iter().copied(), RED.stroke_width(2)))
            .map_err(|e| err(&e))?
            .label("eval")
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], RED));
        chart
            .draw_series(evals.iter().map(|&(x, y)| Circle::new((x, y), 3, RED.filled())))
            .map_err(|e| err(&e))?;
    }
    chart
        .configure_series_labels()
        .label_font((FAMILY, 13))
        .border_style(BLACK)
        .background_style(WHITE.mix(0.8))
        .draw()
        .map_err(|e| err(&e))
}

/// A tick label: up to three significant digits, without trailing zeros; powers of ten as
/// `1e−4` outside [0.01, 10000); minus signs as U+2212 (a hyphen at label size reads as a dot).
pub fn tick(v: f64) -> String {
    tick_ascii(v).replace('-', "\u{2212}")
}

fn tick_ascii(v: f64) -> String {
    if v == 0.0 || !v.is_finite() {
        return format!("{v}");
    }
    let a = v.abs();
    // 0.01 itself reads 0.01 even when the mesh lands a rounding below it.
    if !(0.01 * (1.0 - 1e-9)..10_000.0).contains(&a) {
        let s = format!("{v:.2e}");
        let (m, e) = s.split_once('e').unwrap_or((&s, "0"));
        let m = m.trim_end_matches('0').trim_end_matches('.');
        return format!("{m}e{e}");
    }
    let decimals = (2 - a.log10().floor() as i32).max(0) as usize;
    let s = format!("{v:.decimals$}");
    if s.contains('.') { s.trim_end_matches('0').trim_end_matches('.').to_string() } else { s }
}

/// A chart of `y` against the step (1..`max_step`) on `area`, captioned, with its mesh drawn;
/// `log`: `y` is log10 of the values, labelled with the values.
fn step_chart<'a, 'b>(
    area: &'a Area<'b>,
    caption: &str,
    max_step: f64,
    y: std::ops::Range<f64>,
    log: bool,
    path: &Path,
) -> Result<StepChart<'a, 'b>> {
    let err = |e: &dyn std::fmt::Display| anyhow!("drawing {}: {e}", path.display());
    let span = y.end - y.start;
    let mut chart = ChartBuilder::on(area)
        .margin(12)
        .x_label_area_size(36)
        .y_label_area_size(64)
        .caption(caption, (FAMILY, 18))
        .build_cartesian_2d(1f64..max_step, y)
        .map_err(|e| err(&e))?;
    let y_label = move |v: &f64| if log { tick(10f64.powf(*v)) } else { axis_tick(*v, span) };
    chart
        .configure_mesh()
        .x_desc("step")
        .x_label_formatter(&step_tick)
        .y_label_formatter(&y_label)
        .label_style((FAMILY, 13))
        .draw()
        .map_err(|e| err(&e))?;
    Ok(chart)
}

/// A linear axis's label of `v` on an axis `span` wide: a value within rounding of zero (the
/// mesh's steps land at 3.5e-18 rather than 0) reads 0.
fn axis_tick(v: f64, span: f64) -> String {
    tick(if v.abs() <= span.abs() * 1e-9 { 0.0 } else { v })
}

/// The step axis's label of `x`: whole steps only (a short run's mesh also lands between them).
fn step_tick(x: &f64) -> String {
    if (x - x.round()).abs() < 1e-6 { format!("{x:.0}") } else { String::new() }
}

#[cfg(test)]
mod tick_tests {
    /// Tick labels read as numbers: no trailing zeros, no "5. 0", powers of ten compact.
    #[test]
    fn ticks_are_clean() {
        let t = super::tick;
        assert_eq!(
            [t(5.0), t(5.25), t(0.5), t(12.0), t(1234.6)],
            ["5", "5.25", "0.5", "12", "1235"]
        );
        assert_eq!([t(1e-4), t(2.5e-5), t(0.0), t(12345.0)], ["1e−4", "2.5e−5", "0", "1.23e4"]);
        assert_eq!([super::axis_tick(3.47e-18, 0.06), super::axis_tick(1e-4, 1e-3)], ["0", "1e−4"]);
        assert_eq!([super::step_tick(&2.0), super::step_tick(&2.5)], ["2", ""]);
        assert_eq!(t(-0.009_999_999_999_999_9), "−0.01");
    }
}

/// `OUT/report.md`: the run in a few lines, with the plot.
pub fn write_report(
    out_dir: &Path,
    origin: &str,
    s: &Summary,
    plot: Option<&Path>,
) -> Result<PathBuf> {
    let mut r = format!("# Training report\n\nconfig: `{origin}`\n\n");
    // An interrupted run's last figures are not final ones.
    let last = match s.interrupted_at_step {
        Some(step) => {
            r += &format!(
                "**The run was interrupted at step {step}** (its checkpoint was written; no \
                 `final/`): resume it with `--resume latest`.\n\n"
            );
            "last"
        }
        None => "final",
    };
    r += "| | |\n|---|---|\n";
    r += &format!(
        "| steps | {} ({} skipped: non-finite loss or gradient; {} held updates back) |\n",
        s.total_steps, s.skipped_steps, s.held_steps
    );
    r += &format!("| {last} training loss | {:.4} |\n", s.final_loss);
    if let Some(e) = s.eval_loss {
        r += &format!("| {last} eval loss | {e:.4} ({} held-out rows) |\n", s.eval_rows);
    }
    let rewards = [("training", &s.final_rewards), ("eval", &s.eval_rewards)];
    for (what, d) in rewards.iter().filter_map(|(w, d)| d.as_ref().map(|d| (w, d))) {
        r += &format!(
            "| {last} {what} reward accuracy, margin | {:.3}, {:.4} |\n",
            d.reward_accuracy, d.reward_margin
        );
    }
    r += &format!(
        "| throughput | {:.0} tokens/s over {} timed steps, {:.1} s |\n",
        s.tokens_per_s, s.steps, s.wall_s
    );
    r += &format!(
        "| host memory | peak RSS {}, planned {} |\n",
        gib(s.peak_rss_bytes),
        gib(s.planned_host_bytes)
    );
    r += &format!(
        "| device memory | peak {}, planned {} |\n",
        gib(s.peak_device_bytes),
        gib(s.planned_device_bytes)
    );
    r += &format!("| data records skipped | {} |\n", s.skipped_records);
    if let Some(p) = plot {
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        r += &format!("\n![training]({name})\n");
    }
    let path = out_dir.join("report.md");
    fs::write(&path, r).with_context(|| format!("cannot write {}", path.display()))?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plots_a_resumed_run_from_its_metrics() {
        let dir = tempfile::tempdir().unwrap();
        let m = dir.path().join("metrics.jsonl");
        let mut text = String::new();
        for step in 1..=30 {
            let loss = 5.0 / step as f64;
            text += &format!(
                "{{\"step\":{step},\"loss\":{loss},\"tokens\":100,\"step_s\":0.5,\"skipped\":false}}\n"
            );
        }
        // A resume repeats steps 21..: the later lines win.
        text += "{\"step\":21,\"loss\":0.1,\"tokens\":100,\"step_s\":0.25,\"skipped\":false,\"eval_loss\":0.3}\n";
        std::fs::write(&m, text).unwrap();
        let pts = read_metrics(&m).unwrap();
        assert_eq!(pts.len(), 21);
        assert_eq!(pts[20].eval_loss, Some(0.3));
        assert_eq!(pts[20].tokens_per_s, 400.0);
        // An SFT run has no reward fields, and its plot keeps its four panels' size.
        let dpo_fields = |p: &Point| {
            [p.reward_margin, p.reward_accuracy, p.eval_reward_margin, p.eval_reward_accuracy]
        };
        assert!(pts.iter().all(|p| dpo_fields(p) == [None; 4]));
        let png = dir.path().join("training.png");
        plot(&pts, &png, "test").unwrap();
        assert_eq!(png_size(&png), (1200, 800));
    }

    #[test]
    fn plots_a_dpo_run_with_its_rewards() {
        let dir = tempfile::tempdir().unwrap();
        let m = dir.path().join("metrics.jsonl");
        let mut text = String::new();
        for step in 1..=4 {
            let (margin, acc) = (0.1 * step as f64 - 0.15, 0.25 * step as f64);
            text += &format!(
                "{{\"step\":{step},\"loss\":0.69,\"grad_norm\":1.5,\"lr\":1e-6,\"tokens\":100,\
                 \"step_s\":0.5,\"skipped\":false,\"rewards_chosen\":0.02,\
                 \"rewards_rejected\":-0.01,\"reward_accuracy\":{acc},\"reward_margin\":{margin},\
                 \"logps_chosen\":-40.5,\"logps_rejected\":-42.25}}\n"
            );
        }
        // Step 4 also evaluates the held-out pairs.
        text.insert_str(
            text.len() - 2,
            ",\"eval_loss\":0.68,\"eval_reward_accuracy\":0.5,\"eval_reward_margin\":0.03,\
             \"eval_rewards_chosen\":0.01,\"eval_rewards_rejected\":-0.02,\
             \"eval_logps_chosen\":-41.0,\"eval_logps_rejected\":-43.0",
        );
        std::fs::write(&m, text).unwrap();
        let pts = read_metrics(&m).unwrap();
        assert_eq!(pts.len(), 4);
        assert_eq!(pts[0].reward_margin, Some(0.1 - 0.15));
        assert_eq!(pts[3].reward_accuracy, Some(1.0));
        assert_eq!(pts[2].eval_reward_margin, None);
        assert_eq!(pts[3].eval_reward_margin, Some(0.03));
        assert_eq!(pts[3].eval_reward_accuracy, Some(0.5));
        assert_eq!(pts[3].eval_loss, Some(0.68));
        let png = dir.path().join("training.png");
        plot(&pts, &png, "dpo").unwrap();
        // Two more panels beside the loss: a 2x3 grid of panels the SFT plot's size.
        assert_eq!(png_size(&png), (1800, 800));
    }

    /// A PNG's (width, height), from its header (signature, then the IHDR chunk).
    fn png_size(path: &Path) -> (u32, u32) {
        let bytes = std::fs::read(path).unwrap();
        assert_eq!(&bytes[1..4], b"PNG", "{} is not a PNG", path.display());
        let be = |i: usize| u32::from_be_bytes(bytes[i..i + 4].try_into().unwrap());
        (be(16), be(20))
    }
}

#[cfg(test)]
mod look {
    /// Draws `HORIZON_PLOT_METRICS` into `HORIZON_PLOT_OUT` (a person's look at the plot; a
    /// no-op without them).
    #[test]
    fn draw_a_metrics_file_when_asked() {
        let (Ok(m), Ok(out)) =
            (std::env::var("HORIZON_PLOT_METRICS"), std::env::var("HORIZON_PLOT_OUT"))
        else {
            return;
        };
        let pts = super::read_metrics(m.as_ref()).unwrap();
        super::plot(&pts, out.as_ref(), "look").unwrap();
    }
}
