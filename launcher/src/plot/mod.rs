//! `zrun plot RUN_DIR [RUN_DIR...] [-o DIR]`: PNG and SVG charts of runs from their
//! `metrics.jsonl` and `summary.json` (finished or still running). Several runs on one chart
//! compare them, one colour per run, named by directory in the legend.
//!
//! Charts: `loss` and `loss_tokens` (train and eval loss against steps and tokens seen, the
//! loss floor dashed), `throughput` (tokens/s, MFU), `memory` (bytes by kind per rank over the
//! run) and `breakdown` (the step-time breakdown per rank). A part whose data a run lacks is
//! left out with a note on stderr; one line per file written goes to stdout.
//!
//! Drawing: `data` reads the files, a builder per chart turns runs into a figure (series
//! ready to draw, notes), and the figure draws itself on either backend (`Figure::draw`).

mod breakdown;
mod data;
mod font;
mod lines;
mod memory;
mod style;

use std::path::{Path, PathBuf};

use anyhow::Context;
use plotters::coord::Shift;
use plotters::prelude::*;

use crate::launch::BadInput;
use style::Drawn;

/// `zrun plot`'s arguments.
#[derive(clap::Args, Debug)]
pub struct PlotArgs {
    /// Run directories (a run's log.dir, holding metrics.jsonl and summary.json).
    #[arg(required = true, value_name = "RUN_DIR")]
    pub runs: Vec<PathBuf>,
    /// Where to write the charts [default: RUN_DIR/plots for one run, ./plots for several].
    #[arg(short = 'o', long = "out", value_name = "DIR")]
    pub out: Option<PathBuf>,
}

/// A chart ready to draw on any plotters backend.
trait Figure {
    /// The file name, without extension.
    fn name(&self) -> &str;
    /// The canvas, pixels.
    fn size(&self) -> (u32, u32);
    /// Draws the chart on `area` (white already).
    fn draw<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> Drawn<DB>;
}

/// Draws every chart the runs have data for; 0 on success.
pub fn run(args: &PlotArgs) -> anyhow::Result<u8> {
    let mut notes = Vec::new();
    let mut runs = args
        .runs
        .iter()
        .map(|d| data::load(d, &mut notes))
        .collect::<anyhow::Result<Vec<_>>>()?;
    data::disambiguate(&mut runs);
    let out = match (&args.out, args.runs.as_slice()) {
        (Some(o), _) => o.clone(),
        (None, [one]) => one.join("plots"),
        (None, _) => PathBuf::from("plots"),
    };
    font::register()?;
    std::fs::create_dir_all(&out).map_err(|e| {
        BadInput(format!(
            "cannot create the output directory {}: {e}",
            out.display()
        ))
    })?;

    let all = &mut notes;
    emit(lines::loss(&runs, all), all, &out)?;
    emit(lines::loss_tokens(&runs, all), all, &out)?;
    emit(lines::throughput(&runs, all), all, &out)?;
    emit(memory::memory(&runs, all), all, &out)?;
    emit(breakdown::breakdown(&runs, all), all, &out)?;
    Ok(0)
}

/// Prints the notes so far, then writes `fig` (when there is one), a line per file.
fn emit<F: Figure>(fig: Option<F>, notes: &mut Vec<String>, out: &Path) -> anyhow::Result<()> {
    for n in notes.drain(..) {
        eprintln!("zrun plot: note: {n}");
    }
    if let Some(f) = fig {
        for p in write(&f, out)? {
            println!("wrote {}", p.display());
        }
    }
    Ok(())
}

/// Writes `fig` as `out/NAME.png` and `out/NAME.svg`.
fn write<F: Figure>(fig: &F, out: &Path) -> anyhow::Result<[PathBuf; 2]> {
    let png = out.join(format!("{}.png", fig.name()));
    let svg = out.join(format!("{}.svg", fig.name()));
    let fail = |p: &Path| format!("cannot write {}", p.display());
    {
        let root = BitMapBackend::new(&png, fig.size()).into_drawing_area();
        paint(fig, &root)
            .and_then(|()| root.present())
            .map_err(|e| anyhow::anyhow!("{e}"))
            .with_context(|| fail(&png))?;
    }
    {
        let root = SVGBackend::new(&svg, fig.size()).into_drawing_area();
        paint(fig, &root)
            .and_then(|()| root.present())
            .map_err(|e| anyhow::anyhow!("{e}"))
            .with_context(|| fail(&svg))?;
    }
    Ok([png, svg])
}

/// Clears the canvas to white and draws `fig` on it.
fn paint<F: Figure, DB: DrawingBackend>(fig: &F, root: &DrawingArea<DB, Shift>) -> Drawn<DB> {
    root.fill(&WHITE)?;
    fig.draw(root)
}
