//! `memory`: each rank's memory over the run, one cell per (run, rank): on top the engine's
//! bytes by kind as stacked areas (parameters, gradients, master, optimizer, host, buffers,
//! activations: disjoint parts), below the process totals as lines (RSS, peak RSS, CUDA
//! peaks), which on a small model dwarf the parts and so get their own axis. All cells of a
//! row kind share one y range, so ranks and runs compare at a glance.

use plotters::coord::Shift;
use plotters::prelude::*;

use super::data::{Memory, Run};
use super::style::{
    dec, drawable, padded, side_legend, Drawn, Fmt, Key, Mark, Panel, Series, Sizes, Stroke,
    PALETTE, TITLE,
};
use super::Figure;

/// A kind of memory: its label, colour and whether it is a part (stacked) or a total (line).
struct Kind {
    label: &'static str,
    colour: RGBColor,
    part: bool,
    dashed: bool,
    get: fn(&Memory) -> Option<i64>,
}

const fn kind(
    label: &'static str,
    colour: RGBColor,
    part: bool,
    dashed: bool,
    get: fn(&Memory) -> Option<i64>,
) -> Kind {
    Kind {
        label,
        colour,
        part,
        dashed,
        get,
    }
}

/// Stacking order bottom to top, then the totals.
const KINDS: [Kind; 12] = [
    kind("params", PALETTE[0], true, false, |m| Some(m.params)),
    kind("grads", PALETTE[1], true, false, |m| Some(m.grads)),
    kind("master", PALETTE[2], true, false, |m| Some(m.master)),
    kind("optimizer", PALETTE[3], true, false, |m| Some(m.optimizer)),
    kind("host (offload)", PALETTE[4], true, false, |m| Some(m.host)),
    kind("buffers", PALETTE[5], true, false, |m| Some(m.buffers)),
    kind("activations", PALETTE[6], true, false, |m| {
        Some(m.activations)
    }),
    kind("RSS", BLACK, false, false, |m| Some(m.rss)),
    kind("peak RSS", PALETTE[7], false, true, |m| Some(m.rss_peak)),
    kind("CUDA allocated peak", PALETTE[9], false, false, |m| {
        m.cuda_allocated_peak
    }),
    kind("CUDA reserved peak", PALETTE[8], false, true, |m| {
        m.cuda_reserved_peak
    }),
    kind("CUDA reserved, unallocated", PALETTE[3], false, true, |m| {
        m.cuda_reserved_unallocated
    }),
];

/// The series of one (run, rank).
struct Cell {
    title: String,
    /// Bottom to top; points are each part's own bytes (stacked when drawn).
    parts: Vec<Series>,
    totals: Vec<Series>,
}

/// The memory figure.
pub struct MemoryFig {
    cells: Vec<Cell>,
    cols: usize,
    unit: (f64, &'static str),
    keys: Vec<Key>,
}

/// Builds the figure; runs without per-rank memory (older runs) show rank 0's model-state,
/// engine and RSS figures from the top-level fields instead.
pub fn memory(runs: &[Run], notes: &mut Vec<String>) -> Option<MemoryFig> {
    let mut cells = Vec::new();
    let mut max_ranks = 1;
    for r in runs {
        let lines: Vec<_> = r.steps.iter().filter(|s| !s.ranks.is_empty()).collect();
        if lines.is_empty() {
            notes.push(format!(
                "{}: no per-rank memory in metrics.jsonl (older run); memory shows rank 0's model-state, engine and RSS bytes",
                r.name
            ));
            cells.push(old_cell(r));
            continue;
        }
        let world = lines.iter().map(|s| s.ranks.len()).max().unwrap_or(0);
        max_ranks = max_ranks.max(world);
        for i in 0..world {
            let pts: Vec<(f64, &Memory)> = lines
                .iter()
                .filter_map(|s| Some((s.step as f64, &s.ranks.get(i)?.memory)))
                .collect();
            let rank = lines
                .iter()
                .find_map(|s| s.ranks.get(i))
                .map_or(i, |x| x.rank);
            let series = |k: &Kind| Series {
                label: k.label.into(),
                colour: k.colour,
                stroke: if k.dashed {
                    Stroke::Dashed
                } else {
                    Stroke::Line
                },
                width: 2,
                points: pts
                    .iter()
                    .filter_map(|(x, m)| Some((*x, (k.get)(m)? as f64)))
                    .collect(),
            };
            // Kinds that are absent or zero throughout (master at fp32, host without offload).
            let shown = |s: &Series| s.points.iter().any(|p| p.1 != 0.0);
            cells.push(Cell {
                title: format!("{} rank {rank}", r.name),
                parts: KINDS
                    .iter()
                    .filter(|k| k.part)
                    .map(series)
                    .filter(shown)
                    .collect(),
                totals: KINDS
                    .iter()
                    .filter(|k| !k.part)
                    .map(series)
                    .filter(shown)
                    .collect(),
            });
        }
    }
    let top = cells
        .iter()
        .flat_map(|c| c.parts.iter().chain(&c.totals))
        .flat_map(|s| s.points.iter().map(|p| p.1))
        .fold(0.0, f64::max);
    let unit = if top >= 10.0 * (1u64 << 30) as f64 {
        ((1u64 << 30) as f64, "GiB")
    } else {
        ((1u64 << 20) as f64, "MiB")
    };
    let mut keys: Vec<Key> = Vec::new();
    for c in &cells {
        for (s, fill) in c
            .parts
            .iter()
            .map(|s| (s, true))
            .chain(c.totals.iter().map(|s| (s, false)))
        {
            let mark = if fill {
                Mark::Fill
            } else {
                Mark::Stroke(s.stroke)
            };
            let key = Key {
                label: s.label.clone(),
                colour: s.colour,
                mark,
            };
            if !keys.contains(&key) {
                keys.push(key);
            }
        }
    }
    // Stacked parts read top to bottom in the legend, as in the chart.
    keys.sort_by_key(|k| {
        (
            k.mark != Mark::Fill,
            std::cmp::Reverse(KINDS.iter().position(|x| x.label == k.label)),
        )
    });
    let cols = max_ranks.min(4);
    Some(MemoryFig {
        cells,
        cols,
        unit,
        keys,
    })
}

/// Rank 0's figures of an older run: model states and the engine's other bytes, and RSS.
fn old_cell(r: &Run) -> Cell {
    let pts = |f: &dyn Fn(&super::data::Step) -> Option<i64>| -> Vec<(f64, f64)> {
        r.steps
            .iter()
            .filter_map(|s| Some((s.step as f64, f(s)? as f64)))
            .collect()
    };
    let s = |label: &str, colour, stroke, points| Series {
        label: label.into(),
        colour,
        stroke,
        width: 2,
        points,
    };
    Cell {
        title: format!("{} rank 0", r.name),
        parts: vec![
            s(
                "model states",
                PALETTE[0],
                Stroke::Line,
                pts(&|x| x.model_state_bytes),
            ),
            s(
                "buffers",
                PALETTE[5],
                Stroke::Line,
                pts(&|x| Some(x.engine_bytes? - x.model_state_bytes?)),
            ),
        ],
        totals: vec![
            s("RSS", BLACK, Stroke::Line, pts(&|x| x.rss_bytes)),
            s(
                "peak RSS",
                PALETTE[7],
                Stroke::Dashed,
                pts(&|x| x.peak_rss_bytes),
            ),
        ],
    }
}

impl Figure for MemoryFig {
    fn name(&self) -> &str {
        "memory"
    }

    fn size(&self) -> (u32, u32) {
        let rows = self.cells.len().div_ceil(self.cols) as u32;
        (1200 + LEGEND_W, 60 + 560 * rows)
    }

    fn draw<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> Drawn<DB> {
        let body = area.titled(
            &format!("Memory by kind per rank ({})", self.unit.1),
            ("sans-serif", TITLE),
        )?;
        let (grid, legend) = body.split_horizontally(body.dim_in_pixel().0 - LEGEND_W);
        side_legend(&legend, "memory kind", &self.keys)?;
        let rows = self.cells.len().div_ceil(self.cols);
        let scale = |ss: &[Series]| -> Vec<Series> {
            ss.iter()
                .map(|s| Series {
                    points: s.points.iter().map(|p| (p.0, p.1 / self.unit.0)).collect(),
                    ..s.clone()
                })
                .collect()
        };
        let parts: Vec<Vec<Series>> = self.cells.iter().map(|c| scale(&c.parts)).collect();
        // Each part's bytes at the last step, written over the stack: on a small model the
        // model states are slivers under the activations, and this is where they read.
        let chars = (grid.dim_in_pixel().0 / self.cols as u32).saturating_sub(110) as usize / 8;
        let notes: Vec<Vec<String>> = parts
            .iter()
            .map(|p| last_values(p, self.unit.1, chars))
            .collect();
        let lines = notes.iter().map(Vec::len).max().unwrap_or(0);
        let parts: Vec<Vec<Series>> = parts.iter().map(|p| stack(p)).collect();
        let totals: Vec<Vec<Series>> = self.cells.iter().map(|c| scale(&c.totals)).collect();
        let top = |v: &[Vec<Series>]| {
            v.iter()
                .flatten()
                .flat_map(|s| s.points.iter().map(|p| p.1))
                .fold(0.0, f64::max)
        };
        let headroom = 1.1 + 0.15 * lines as f64;
        let (parts_top, totals_top) = (
            top(&parts).max(1e-3) * headroom,
            top(&totals).max(1e-3) * 1.1,
        );
        let (x0, x1) = padded(
            self.cells
                .iter()
                .flat_map(|c| c.parts.iter().chain(&c.totals))
                .flat_map(|s| s.points.iter().map(|p| p.0)),
            0.0,
        );
        // As `Panel` pads it, so the two panels of a cell line up.
        let x1 = x1 + 0.01 * (x1 - x0);
        let panes = grid.split_evenly((rows * 2, self.cols));
        for (i, cell) in self.cells.iter().enumerate() {
            let (row, col) = (i / self.cols, i % self.cols);
            draw_parts(
                &panes[2 * row * self.cols + col],
                &cell.title,
                &parts[i],
                &notes[i],
                (x0, x1),
                parts_top,
                self.unit.1,
            )?;
            Panel {
                title: format!("{}: process", cell.title),
                x_desc: "step".into(),
                y_desc: self.unit.1.into(),
                x_fmt: Fmt::Int,
                y_fmt: Fmt::Dec,
                series: totals[i].clone(),
                legend: None,
                y_range: Some((0.0, totals_top)),
                compact: true,
            }
            .draw(&panes[(2 * row + 1) * self.cols + col])?;
        }
        Ok(())
    }
}

/// The legend strip's width, pixels.
const LEGEND_W: u32 = 240;

/// Running sums of the parts, bottom to top: series i is the top edge of part i.
fn stack(parts: &[Series]) -> Vec<Series> {
    let mut acc: Vec<Series> = Vec::new();
    for s in parts {
        let points = match acc.last() {
            // Same steps in every part: they come from the same lines.
            Some(below) => s
                .points
                .iter()
                .zip(&below.points)
                .map(|(p, b)| (p.0, p.1 + b.1))
                .collect(),
            None => s.points.clone(),
        };
        acc.push(Series {
            points,
            ..s.clone()
        });
    }
    acc
}

/// Stacked areas of `stacked` (top edges, bottom part first).
fn draw_parts<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    stacked: &[Series],
    notes: &[String],
    (x0, x1): (f64, f64),
    top: f64,
    unit: &str,
) -> Drawn<DB> {
    let t = Sizes::of(true);
    let ((x0, x1), (_, top)) = (drawable(x0, x1), drawable(0.0, top));
    let mut chart = ChartBuilder::on(area)
        .caption(
            format!("{title}: engine memory by kind"),
            ("sans-serif", t.title),
        )
        .margin(t.margin)
        .x_label_area_size(t.x_area)
        .y_label_area_size(t.y_area)
        .build_cartesian_2d(x0..x1, 0.0..top)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(unit)
        .axis_desc_style(("sans-serif", t.desc))
        .label_style(("sans-serif", t.label))
        .x_labels(t.ticks.0)
        .y_labels(t.ticks.1)
        .x_label_formatter(&|v| Fmt::Int.show(*v))
        .y_label_formatter(&|v| Fmt::Dec.show(*v))
        .light_line_style(WHITE.mix(0.0))
        .bold_line_style(BLACK.mix(0.12))
        .draw()?;
    // Top part first, each filled down to zero; the parts below paint over their share.
    for s in stacked.iter().rev() {
        chart.draw_series(
            AreaSeries::new(s.points.iter().copied(), 0.0, s.colour.mix(0.8))
                .border_style(s.colour.stroke_width(1)),
        )?;
    }
    let font = ("sans-serif", t.label).into_font();
    for (k, line) in notes.iter().enumerate() {
        let at = EmptyElement::at((x0, top))
            + Text::new(line.clone(), (8, 6 + 18 * k as i32), font.clone());
        chart.plotting_area().draw(&at)?;
    }
    Ok(())
}

/// "last (MiB): params 0.5, grads 0.5, ..." of the parts, in `unit`, wrapped at `chars`.
fn last_values(parts: &[Series], unit: &str, chars: usize) -> Vec<String> {
    let head = format!("last ({unit}):");
    let items = parts
        .iter()
        .filter_map(|s| Some(format!("{} {}", s.label, dec(s.points.last()?.1))));
    let mut lines = vec![head.clone()];
    for item in items {
        let line = lines.last_mut().expect("one line at least");
        if line.len() + item.len() + 2 > chars.max(20) && *line != head {
            lines.push(item);
        } else {
            let sep = if *line == head { " " } else { ", " };
            line.push_str(sep);
            line.push_str(&item);
        }
    }
    if lines == [head] {
        return Vec::new();
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    fn series(label: &str, points: &[(f64, f64)]) -> Series {
        Series {
            label: label.into(),
            colour: BLACK,
            stroke: Stroke::Line,
            width: 2,
            points: points.to_vec(),
        }
    }

    #[test]
    fn parts_stack_bottom_up() {
        let s = stack(&[
            series("a", &[(1.0, 1.0), (2.0, 2.0)]),
            series("b", &[(1.0, 10.0), (2.0, 20.0)]),
        ]);
        assert_eq!(s[0].points, vec![(1.0, 1.0), (2.0, 2.0)]);
        assert_eq!(s[1].points, vec![(1.0, 11.0), (2.0, 22.0)]);
        assert_eq!(s[1].label, "b");
    }

    #[test]
    fn last_values_wrap() {
        let parts = [
            series("params", &[(1.0, 0.25), (2.0, 0.5)]),
            series("activations", &[(2.0, 37.7)]),
        ];
        let one = last_values(&parts, "MiB", 80);
        assert_eq!(one, vec!["last (MiB): params 0.5, activations 37.7"]);
        let two = last_values(&parts, "MiB", 25);
        assert_eq!(two, vec!["last (MiB): params 0.5", "activations 37.7"]);
        assert!(last_values(&[], "MiB", 80).is_empty());
    }
}
