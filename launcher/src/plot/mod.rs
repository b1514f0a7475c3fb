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
//! ready to draw, notes), and the figure draws itself on either backend (`Figure::draw`),
//! in memory (`png` encodes the bitmap). `save` then writes the files all or none: an
//! output name holds the previous complete chart or the new one, never a truncated file.

mod breakdown;
mod data;
mod font;
mod lines;
mod memory;
mod save;
mod style;

use std::path::{Path, PathBuf};

use anyhow::Context;
use plotters::backend::RGBPixel;
use plotters::coord::Shift;
use plotters::prelude::*;

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
    save::create_dir(&out)?;

    let all = &mut notes;
    let mut files = Vec::new();
    draw(lines::loss(&runs, all), all, &out, &mut files)?;
    draw(lines::loss_tokens(&runs, all), all, &out, &mut files)?;
    draw(lines::throughput(&runs, all), all, &out, &mut files)?;
    draw(memory::memory(&runs, all), all, &out, &mut files)?;
    draw(breakdown::breakdown(&runs, all), all, &out, &mut files)?;
    save::all(&files)?;
    for (p, _) in &files {
        println!("wrote {}", p.display());
    }
    Ok(0)
}

/// Prints the notes so far, then draws `fig` (when there is one) as `out/NAME.png` and
/// `out/NAME.svg`, in memory: their paths and bytes go to `files`.
fn draw<F: Figure>(
    fig: Option<F>,
    notes: &mut Vec<String>,
    out: &Path,
    files: &mut Vec<(PathBuf, Vec<u8>)>,
) -> anyhow::Result<()> {
    for n in notes.drain(..) {
        eprintln!("zrun plot: note: {n}");
    }
    let Some(fig) = fig else {
        return Ok(());
    };
    let fail = |ext: &str| format!("cannot draw {}.{ext}", fig.name());
    files.push((
        out.join(format!("{}.png", fig.name())),
        png_bytes(&fig).with_context(|| fail("png"))?,
    ));
    files.push((
        out.join(format!("{}.svg", fig.name())),
        svg_bytes(&fig).with_context(|| fail("svg"))?,
    ));
    Ok(())
}

/// `fig` drawn on an RGB bitmap, as a PNG file's bytes.
fn png_bytes<F: Figure>(fig: &F) -> anyhow::Result<Vec<u8>> {
    let (w, h) = fig.size();
    let mut rgb = vec![0u8; 3 * w as usize * h as usize];
    {
        let root = BitMapBackend::<RGBPixel>::with_buffer_and_format(&mut rgb, (w, h))
            .map_err(|e| anyhow::anyhow!("{e}"))?
            .into_drawing_area();
        paint(fig, &root)
            .and_then(|()| root.present())
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    let mut bytes = Vec::new();
    let mut encoder = png::Encoder::new(&mut bytes, w, h);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header()?;
    writer.write_image_data(&rgb)?;
    writer.finish()?;
    Ok(bytes)
}

/// `fig` as an SVG file's bytes.
fn svg_bytes<F: Figure>(fig: &F) -> anyhow::Result<Vec<u8>> {
    let mut text = String::new();
    {
        let root = SVGBackend::with_string(&mut text, fig.size()).into_drawing_area();
        paint(fig, &root)
            .and_then(|()| root.present())
            .map_err(|e| anyhow::anyhow!("{e}"))?;
    }
    Ok(text.into_bytes())
}

/// Clears the canvas to white and draws `fig` on it.
fn paint<F: Figure, DB: DrawingBackend>(fig: &F, root: &DrawingArea<DB, Shift>) -> Drawn<DB> {
    root.fill(&WHITE)?;
    fig.draw(root)
}
