//! The line charts: `loss` (train and eval loss against steps, with the loss floor),
//! `loss_tokens` (the same against tokens seen) and `throughput` (tokens/s, and MFU in a
//! second panel when a run has it). Each run is one colour, named in the legend.

use plotters::coord::Shift;
use plotters::prelude::*;

use super::data::{Run, Step};
use super::style::{colour, padded, Drawn, Fmt, Panel, Series, Stroke, SIZE};
use super::Figure;

/// Panels stacked top to bottom, one file.
pub struct Lines {
    name: &'static str,
    panels: Vec<Panel>,
}

impl Figure for Lines {
    fn name(&self) -> &str {
        self.name
    }

    fn size(&self) -> (u32, u32) {
        (SIZE.0, if self.panels.len() > 1 { 900 } else { SIZE.1 })
    }

    fn draw<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> Drawn<DB> {
        for (panel, a) in self
            .panels
            .iter()
            .zip(area.split_evenly((self.panels.len(), 1)))
        {
            panel.draw(&a)?;
        }
        Ok(())
    }
}

/// Which x axis a loss chart uses.
#[derive(Clone, Copy, PartialEq)]
enum X {
    Steps,
    Tokens,
}

/// `loss` against steps.
pub fn loss(runs: &[Run], notes: &mut Vec<String>) -> Option<Lines> {
    for r in runs {
        if r.steps.iter().all(|s| s.eval_loss.is_none()) {
            notes.push(format!(
                "{}: no eval_loss in metrics.jsonl; loss charts show train loss only",
                r.name
            ));
        }
        if r.summary.as_ref().is_some_and(|s| s.loss_floor.is_none()) {
            notes.push(format!(
                "{}: no loss_floor in summary.json; no floor line",
                r.name
            ));
        }
    }
    let xs: Vec<Vec<f64>> = runs
        .iter()
        .map(|r| r.steps.iter().map(|s| s.step as f64).collect())
        .collect();
    Some(loss_chart(
        "loss",
        X::Steps,
        runs,
        &xs.iter().map(Some).collect::<Vec<_>>(),
    ))
}

/// `loss_tokens`: loss against global tokens seen; runs without token counts are left out.
pub fn loss_tokens(runs: &[Run], notes: &mut Vec<String>) -> Option<Lines> {
    let tokens: Vec<Option<Vec<f64>>> = runs
        .iter()
        .map(|r| match r.tokens() {
            Some((t, estimated)) => {
                if estimated {
                    notes.push(format!(
                        "{}: no `tokens` in metrics.jsonl; tokens estimated as step x tokens_per_s x step_time_s",
                        r.name
                    ));
                }
                Some(t)
            }
            None => {
                notes.push(format!("{}: no token counts (tokens, or tokens_per_s and step_time_s); left out of loss_tokens", r.name));
                None
            }
        })
        .collect();
    if tokens.iter().all(Option::is_none) {
        notes.push("loss_tokens: skipped, no run has token counts".into());
        return None;
    }
    Some(loss_chart(
        "loss_tokens",
        X::Tokens,
        runs,
        &tokens.iter().map(Option::as_ref).collect::<Vec<_>>(),
    ))
}

/// Train and eval loss of each run at `xs[i]` (None: run i is left out), and the floors.
fn loss_chart(name: &'static str, x: X, runs: &[Run], xs: &[Option<&Vec<f64>>]) -> Lines {
    let mut series = Vec::new();
    for (i, (r, xs)) in runs.iter().zip(xs).enumerate() {
        let Some(xs) = xs else { continue };
        let pts = |f: fn(&Step) -> Option<f64>| -> Vec<(f64, f64)> {
            r.steps
                .iter()
                .zip(xs.iter())
                .filter_map(|(s, x)| Some((*x, f(s)?)))
                .collect()
        };
        series.push(Series {
            label: format!("{} train", r.name),
            colour: colour(i),
            stroke: Stroke::Line,
            width: width(i, runs.len()),
            points: pts(|s| Some(s.loss)),
        });
        let eval = pts(|s| s.eval_loss);
        if !eval.is_empty() {
            series.push(Series {
                label: format!("{} eval", r.name),
                colour: colour(i),
                stroke: Stroke::Markers,
                width: width(i, runs.len()),
                points: eval,
            });
        }
    }
    let (x0, x1) = padded(
        series.iter().flat_map(|s| s.points.iter().map(|p| p.0)),
        0.0,
    );
    let floors: Vec<(usize, &Run, f64)> = runs
        .iter()
        .enumerate()
        .filter_map(|(i, r)| Some((i, r, r.summary.as_ref()?.loss_floor?)))
        .collect();
    let same = floors.windows(2).all(|w| (w[0].2 - w[1].2).abs() < 1e-9);
    for (k, (i, r, f)) in floors.iter().enumerate() {
        if same && k > 0 {
            break;
        }
        let (label, c) = if same {
            (format!("loss floor {}", super::style::dec(*f)), BLACK)
        } else {
            (
                format!("{} loss floor {}", r.name, super::style::dec(*f)),
                colour(*i),
            )
        };
        series.push(Series {
            label,
            colour: c,
            stroke: Stroke::Dashed,
            width: 2,
            points: vec![(x0, *f), (x1, *f)],
        });
    }
    let (x_desc, x_fmt, title) = match x {
        X::Steps => ("step", Fmt::Int, "Loss by step"),
        X::Tokens => ("tokens", Fmt::Si, "Loss by tokens seen"),
    };
    Lines {
        name,
        panels: vec![Panel {
            title: title.into(),
            x_desc: x_desc.into(),
            y_desc: "loss (nats)".into(),
            x_fmt,
            y_fmt: Fmt::Dec,
            series,
            legend: Some(SeriesLabelPosition::UpperRight),
            y_range: None,
            compact: false,
        }],
    }
}

/// `throughput`: tokens/s against steps; MFU (%) in a second panel when any run has it.
pub fn throughput(runs: &[Run], notes: &mut Vec<String>) -> Option<Lines> {
    let col = |i: usize, r: &Run, f: fn(&Step) -> Option<f64>| Series {
        label: r.name.clone(),
        colour: colour(i),
        stroke: Stroke::Line,
        width: width(i, runs.len()),
        points: r
            .steps
            .iter()
            .filter_map(|s| Some((s.step as f64, f(s)?)))
            .collect(),
    };
    let tps: Vec<Series> = runs
        .iter()
        .enumerate()
        .map(|(i, r)| col(i, r, |s| s.tokens_per_s))
        .filter(|s| !s.points.is_empty())
        .collect();
    let mfu: Vec<Series> = runs
        .iter()
        .enumerate()
        .map(|(i, r)| col(i, r, |s| Some(s.mfu? * 100.0)))
        .filter(|s| !s.points.is_empty())
        .collect();
    for r in runs {
        if r.steps.iter().all(|s| s.tokens_per_s.is_none()) {
            notes.push(format!(
                "{}: no tokens_per_s; left out of throughput",
                r.name
            ));
        }
        if !mfu.is_empty() && r.steps.iter().all(|s| s.mfu.is_none()) {
            notes.push(format!(
                "{}: no mfu in metrics.jsonl; left out of the MFU panel",
                r.name
            ));
        }
    }
    if mfu.is_empty() {
        notes.push("throughput: no mfu in any run (set log.peak_tflops); tokens/s only".into());
    }
    if tps.is_empty() && mfu.is_empty() {
        return None;
    }
    let panel = |title: &str, y_desc: &str, y_fmt, series: Vec<Series>| {
        let top = series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .fold(0.0, f64::max);
        Panel {
            title: title.into(),
            x_desc: "step".into(),
            y_desc: y_desc.into(),
            x_fmt: Fmt::Int,
            y_fmt,
            series,
            legend: Some(SeriesLabelPosition::LowerRight),
            compact: false,
            y_range: Some((0.0, if top > 0.0 { top * 1.15 } else { 1.0 })),
        }
    };
    let mut panels = Vec::new();
    if !tps.is_empty() {
        panels.push(panel("Throughput", "tokens/s", Fmt::Si, tps));
    }
    if !mfu.is_empty() {
        panels.push(panel("Model FLOPs utilisation", "MFU (%)", Fmt::Dec, mfu));
    }
    Some(Lines {
        name: "throughput",
        panels,
    })
}

/// Line width of run `i` of `n`: earlier runs wider (..., 5, 4, 2 px), so that runs with
/// identical curves (ZeRO stages of one model) all show.
fn width(i: usize, n: usize) -> u32 {
    [2, 4, 5, 6][(n - 1 - i).min(3)]
}
