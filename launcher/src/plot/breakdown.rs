//! `breakdown`: where a step's time goes, one stacked bar per rank (data, forward,
//! backward, comm wait, optimizer, other; mean seconds per step), grouped by run, the run's
//! name above its group and the step time above each bar. Stragglers are starred.

use plotters::coord::ranged1d::SegmentValue;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::data::{Breakdown, Run};
use super::style::{
    dec, drawable, side_legend, Drawn, Key, Mark, DESC, LABEL, PALETTE, SIZE, TITLE,
};
use super::Figure;

/// Phase colours, in [`Breakdown::phases`] order.
const PHASE_COLOURS: [RGBColor; 6] = [
    PALETTE[7], PALETTE[0], PALETTE[1], PALETTE[3], PALETTE[2], PALETTE[8],
];

/// One bar.
struct Bar {
    rank: usize,
    straggler: bool,
    breakdown: Breakdown,
}

/// The breakdown figure: runs with their bars.
pub struct BreakdownFig {
    groups: Vec<(String, Vec<Bar>)>,
}

/// Builds the figure from each run's per-rank means; runs without them are left out.
pub fn breakdown(runs: &[Run], notes: &mut Vec<String>) -> Option<BreakdownFig> {
    let mut groups = Vec::new();
    for r in runs {
        let bars: Vec<Bar> = r
            .breakdowns()
            .into_iter()
            .map(|(rank, breakdown, straggler)| Bar {
                rank,
                straggler,
                breakdown,
            })
            .collect();
        if bars.is_empty() {
            notes.push(format!(
                "{}: no per-rank step-time breakdown (older run); left out of breakdown",
                r.name
            ));
        } else {
            groups.push((r.name.clone(), bars));
        }
    }
    if groups.is_empty() {
        notes.push("breakdown: skipped, no run has per-rank figures".into());
        return None;
    }
    Some(BreakdownFig { groups })
}

impl BreakdownFig {
    /// Slot of every bar (groups separated by one empty slot) and the number of slots.
    fn slots(&self) -> (Vec<Vec<u32>>, u32) {
        let mut next = 0;
        let mut slots = Vec::new();
        for (_, bars) in &self.groups {
            slots.push((next..next + bars.len() as u32).collect());
            next += bars.len() as u32 + 1;
        }
        (slots, next - 1)
    }
}

/// The legend strip's width, pixels.
const LEGEND_W: u32 = 200;

impl Figure for BreakdownFig {
    fn name(&self) -> &str {
        "breakdown"
    }

    fn size(&self) -> (u32, u32) {
        (SIZE.0 + LEGEND_W, SIZE.1)
    }

    fn draw<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> Drawn<DB> {
        let (plot, legend) = area.split_horizontally(area.dim_in_pixel().0 - LEGEND_W);
        let mut keys: Vec<Key> = Breakdown::default()
            .phases()
            .iter()
            .zip(PHASE_COLOURS)
            .map(|((label, _), colour)| Key {
                label: (*label).into(),
                colour,
                mark: Mark::Fill,
            })
            .rev()
            .collect();
        let stragglers = self.groups.iter().flat_map(|g| &g.1).any(|b| b.straggler);
        if stragglers {
            keys.push(Key {
                label: "* straggler".into(),
                colour: WHITE,
                mark: Mark::Fill,
            });
        }
        side_legend(&legend, "phase", &keys)?;

        let (slots, n) = self.slots();
        let bars: Vec<(u32, &Bar)> = slots
            .iter()
            .zip(&self.groups)
            .flat_map(|(s, g)| s.iter().copied().zip(&g.1))
            .collect();
        let top = bars
            .iter()
            .map(|(_, b)| {
                b.breakdown
                    .step_time_s
                    .max(b.breakdown.phases().iter().map(|p| p.1).sum())
            })
            .fold(0.0, f64::max);
        let y1 = if top > 0.0 { top * 1.25 } else { 1.0 };
        let short = n > 10;
        let label = |i: u32| -> String {
            bars.iter()
                .find(|(s, _)| *s == i)
                .map_or(String::new(), |(_, b)| {
                    let star = if b.straggler { "*" } else { "" };
                    if short {
                        format!("{}{star}", b.rank)
                    } else {
                        format!("rank {}{star}", b.rank)
                    }
                })
        };
        let mut chart = ChartBuilder::on(&plot)
            .caption(
                "Step time by phase per rank (mean per step)",
                ("sans-serif", TITLE),
            )
            .margin(16)
            .x_label_area_size(50)
            .y_label_area_size(80)
            .build_cartesian_2d((0u32..n - 1).into_segmented(), 0.0..drawable(0.0, y1).1)?;
        chart
            .configure_mesh()
            .x_desc("rank")
            .y_desc("s per step")
            .axis_desc_style(("sans-serif", DESC))
            .label_style(("sans-serif", LABEL))
            .x_labels(n as usize + 1)
            .x_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) => label(*i),
                _ => String::new(),
            })
            .y_label_formatter(&|v| dec(*v))
            .disable_x_mesh()
            .light_line_style(WHITE.mix(0.0))
            .bold_line_style(BLACK.mix(0.12))
            .draw()?;
        let margin = if short { 4 } else { 14 };
        for (slot, bar) in &bars {
            let mut y = 0.0;
            for ((_, secs), colour) in bar.breakdown.phases().iter().zip(PHASE_COLOURS) {
                let mut r = Rectangle::new(
                    [
                        (SegmentValue::Exact(*slot), y),
                        (SegmentValue::Exact(slot + 1), y + secs),
                    ],
                    colour.filled(),
                );
                r.set_margin(0, 0, margin, margin);
                chart.plotting_area().draw(&r)?;
                y += secs;
            }
            let total = bar.breakdown.step_time_s.max(y);
            let text = Text::new(
                format!("{} s", dec(bar.breakdown.step_time_s)),
                (0, -4),
                ("sans-serif", LABEL)
                    .into_font()
                    .into_text_style(&plot)
                    .pos(Pos::new(HPos::Center, VPos::Bottom)),
            );
            chart
                .plotting_area()
                .draw(&(EmptyElement::at((SegmentValue::CenterOf(*slot), total)) + text))?;
        }
        // The run's name above its group.
        for (s, (name, _)) in slots.iter().zip(&self.groups) {
            let (first, len) = (s[0], s.len() as u32);
            let mid = if len % 2 == 0 {
                SegmentValue::Exact(first + len / 2)
            } else {
                SegmentValue::CenterOf(first + len / 2)
            };
            let style = ("sans-serif", DESC)
                .into_font()
                .into_text_style(&plot)
                .pos(Pos::new(HPos::Center, VPos::Top));
            chart
                .plotting_area()
                .draw(&(EmptyElement::at((mid, y1)) + Text::new(name.clone(), (0, 8), style)))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_are_separated_by_an_empty_slot() {
        let bar = |rank| Bar {
            rank,
            straggler: false,
            breakdown: Breakdown::default(),
        };
        let fig = BreakdownFig {
            groups: vec![
                ("a".into(), vec![bar(0), bar(1)]),
                ("b".into(), vec![bar(0), bar(1), bar(2)]),
            ],
        };
        assert_eq!(fig.slots(), (vec![vec![0, 1], vec![3, 4, 5]], 6));
    }
}
