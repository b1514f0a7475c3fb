//! What every chart shares: colours, text sizes, number formats, and a line panel (series
//! against one x axis, with a legend) that the loss and throughput charts are made of.

use plotters::coord::Shift;
use plotters::prelude::*;

/// A drawing's result on backend `DB`.
pub type Drawn<DB> = Result<(), DrawingAreaErrorKind<<DB as DrawingBackend>::ErrorType>>;

/// The canvas of a one-panel chart, pixels.
pub const SIZE: (u32, u32) = (1200, 700);
/// Chart titles.
pub const TITLE: u32 = 26;
/// Axis descriptions.
pub const DESC: u32 = 20;
/// Tick labels and legends.
pub const LABEL: u32 = 16;

/// Tableau 10: one colour per run (or per kind, per phase), distinct and colour-blind safe.
pub const PALETTE: [RGBColor; 10] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
    RGBColor(227, 119, 194),
    RGBColor(127, 127, 127),
    RGBColor(188, 189, 34),
    RGBColor(23, 190, 207),
];

/// The `i`-th colour of the palette (cycling).
pub fn colour(i: usize) -> RGBColor {
    PALETTE[i % PALETTE.len()]
}

/// How a series is drawn.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Stroke {
    /// A solid line.
    Line,
    /// A solid line with a circle at each point (sparse series such as eval loss).
    Markers,
    /// A dashed line (reference levels such as the loss floor).
    Dashed,
}

/// One series of a panel.
#[derive(Clone, Debug)]
pub struct Series {
    /// The legend entry.
    pub label: String,
    /// Its colour.
    pub colour: RGBColor,
    /// How it is drawn.
    pub stroke: Stroke,
    /// Line width, pixels (earlier runs are drawn wider, so identical runs both show).
    pub width: u32,
    /// (x, y) points in x order.
    pub points: Vec<(f64, f64)>,
}

/// Tick-label formats.
#[derive(Clone, Copy, Debug)]
pub enum Fmt {
    /// Integers (steps).
    Int,
    /// With k/M/G/T suffixes (tokens, tokens/s).
    Si,
    /// Up to three significant decimals (loss, MiB, seconds, %).
    Dec,
}

impl Fmt {
    /// `v` as a tick label.
    pub fn show(self, v: f64) -> String {
        match self {
            Fmt::Int => format!("{}", v.round() as i64),
            Fmt::Si => si(v),
            Fmt::Dec => dec(v),
        }
    }
}

/// `v` with a k/M/G/T suffix: 1500 -> "1.5k".
pub fn si(v: f64) -> String {
    let a = v.abs();
    let (d, s) = match a {
        a if a >= 1e12 => (1e12, "T"),
        a if a >= 1e9 => (1e9, "G"),
        a if a >= 1e6 => (1e6, "M"),
        a if a >= 1e3 => (1e3, "k"),
        _ => (1.0, ""),
    };
    let t = format!("{:.2}", v / d);
    let t = t.trim_end_matches('0').trim_end_matches('.');
    format!("{t}{s}")
}

/// `v` with at most three decimals and no trailing zeros.
pub fn dec(v: f64) -> String {
    let places = if v.abs() >= 100.0 {
        0
    } else if v.abs() >= 10.0 {
        1
    } else {
        3
    };
    let t = format!("{v:.places$}");
    if t.contains('.') {
        t.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        t
    }
}

/// The range of `vals` padded by `pad` of its span on both sides (a unit span when flat).
pub fn padded(vals: impl Iterator<Item = f64>, pad: f64) -> (f64, f64) {
    let (lo, hi) = vals
        .filter(|v| v.is_finite())
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(l, h), v| {
            (l.min(v), h.max(v))
        });
    if !lo.is_finite() {
        return (0.0, 1.0);
    }
    if hi <= lo {
        let half = 0.5 * lo.abs().max(1.0);
        return (lo - half, hi + half);
    }
    (lo - pad * (hi - lo), hi + pad * (hi - lo))
}

/// `lo..hi` made safe to draw: both ends and the span `hi - lo` finite, `lo < hi`. Plotters'
/// tick search never ends on an infinite span (losses of -1e308 and 1e308, or a padded 1.7e308):
/// an end past the largest float is clamped to it, and a span past it keeps each side's half of
/// the axis (points beyond are clipped).
pub fn drawable(lo: f64, hi: f64) -> (f64, f64) {
    // `max`/`min` also replace a NaN end.
    let (lo, hi) = (lo.max(-f64::MAX), hi.min(f64::MAX));
    if lo >= hi {
        return (0.0, 1.0);
    }
    if (hi - lo).is_finite() {
        return (lo, hi);
    }
    (lo.max(-f64::MAX / 2.0), hi.min(f64::MAX / 2.0))
}

/// A panel of line series against one x axis.
#[derive(Clone, Debug)]
pub struct Panel {
    /// The caption above the plot.
    pub title: String,
    /// The x axis description, with its unit.
    pub x_desc: String,
    /// The y axis description, with its unit.
    pub y_desc: String,
    /// x tick format.
    pub x_fmt: Fmt,
    /// y tick format.
    pub y_fmt: Fmt,
    /// The series, drawn in order, listed in the legend in order.
    pub series: Vec<Series>,
    /// Where the legend goes; None: no legend in the panel (the figure has one beside it).
    pub legend: Option<SeriesLabelPosition>,
    /// Small text for a panel among many (a grid); else a chart of its own.
    pub compact: bool,
    /// The y range; None: the data's, padded.
    pub y_range: Option<(f64, f64)>,
}

impl Panel {
    /// Draws the panel on `area`.
    pub fn draw<DB: DrawingBackend>(&self, area: &DrawingArea<DB, Shift>) -> Drawn<DB> {
        let pts = || self.series.iter().flat_map(|s| s.points.iter());
        // A little room on the right, so a marker on the last step shows whole.
        let (x0, x1) = padded(pts().map(|p| p.0), 0.0);
        let x1 = x1 + 0.01 * (x1 - x0);
        let (y0, y1) = self
            .y_range
            .unwrap_or_else(|| padded(pts().map(|p| p.1), 0.05));
        let ((x0, x1), (y0, y1)) = (drawable(x0, x1), drawable(y0, y1));
        let t = Sizes::of(self.compact);
        let mut chart = ChartBuilder::on(area)
            .caption(&self.title, ("sans-serif", t.title))
            .margin(t.margin)
            .x_label_area_size(t.x_area)
            .y_label_area_size(t.y_area)
            .build_cartesian_2d(x0..x1, y0..y1)?;
        let (xf, yf) = (self.x_fmt, self.y_fmt);
        chart
            .configure_mesh()
            .x_desc(&self.x_desc)
            .y_desc(&self.y_desc)
            .axis_desc_style(("sans-serif", t.desc))
            .label_style(("sans-serif", t.label))
            .x_labels(t.ticks.0)
            .y_labels(t.ticks.1)
            .x_label_formatter(&|v| xf.show(*v))
            .y_label_formatter(&|v| yf.show(*v))
            .light_line_style(WHITE.mix(0.0))
            .bold_line_style(BLACK.mix(0.12))
            .draw()?;
        for s in &self.series {
            let (c, style) = (s.colour, s.colour.stroke_width(s.width));
            // NaN (a diverged step) and infinities cannot be drawn: such points are left out.
            let pts = s
                .points
                .iter()
                .copied()
                .filter(|p| p.0.is_finite() && p.1.is_finite());
            let key = move |(x, y): (i32, i32)| {
                PathElement::new(vec![(x, y), (x + 24, y)], c.stroke_width(3))
            };
            match s.stroke {
                Stroke::Line => chart
                    .draw_series(LineSeries::new(pts, style))?
                    .label(&s.label)
                    .legend(key),
                Stroke::Markers => chart
                    .draw_series(LineSeries::new(pts, style).point_size(s.width + 3))?
                    .label(&s.label)
                    .legend(move |(x, y)| {
                        EmptyElement::at((x, y))
                            + PathElement::new(vec![(0, 0), (24, 0)], c.stroke_width(3))
                            + Circle::new((12, 0), 5, c.filled())
                    }),
                Stroke::Dashed => chart
                    .draw_series(DashedLineSeries::new(pts, 10, 6, style))?
                    .label(&s.label)
                    .legend(move |(x, y)| {
                        EmptyElement::at((x, y))
                            + PathElement::new(vec![(0, 0), (9, 0)], c.stroke_width(3))
                            + PathElement::new(vec![(15, 0), (24, 0)], c.stroke_width(3))
                    }),
            };
        }
        let Some(pos) = self.legend.clone() else {
            return Ok(());
        };
        chart
            .configure_series_labels()
            .position(pos)
            .label_font(("sans-serif", t.label))
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK.mix(0.3))
            .margin(10)
            .draw()
    }
}

/// Text sizes and spacing of a panel: a chart of its own, or one of a grid.
pub struct Sizes {
    /// Caption.
    pub title: u32,
    /// Axis descriptions.
    pub desc: u32,
    /// Tick labels and legend.
    pub label: u32,
    /// Margin around the panel.
    pub margin: u32,
    /// Height of the x label area.
    pub x_area: u32,
    /// Width of the y label area.
    pub y_area: u32,
    /// Tick counts (x, y).
    pub ticks: (usize, usize),
}

impl Sizes {
    /// The sizes for a grid panel (`compact`) or a whole chart.
    pub fn of(compact: bool) -> Sizes {
        if compact {
            Sizes {
                title: DESC,
                desc: LABEL,
                label: LABEL - 2,
                margin: 12,
                x_area: 40,
                y_area: 70,
                ticks: (6, 6),
            }
        } else {
            Sizes {
                title: TITLE,
                desc: DESC,
                label: LABEL,
                margin: 16,
                x_area: 50,
                y_area: 80,
                ticks: (10, 8),
            }
        }
    }
}

/// How a legend key is marked.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Mark {
    /// A filled box (areas, bars).
    Fill,
    /// A line of this stroke.
    Stroke(Stroke),
}

/// One entry of a legend drawn beside the panels.
#[derive(Clone, Debug, PartialEq)]
pub struct Key {
    /// The text.
    pub label: String,
    /// The colour.
    pub colour: RGBColor,
    /// The mark.
    pub mark: Mark,
}

/// Draws `keys` top to bottom in `area` (a strip beside the panels), under `title`.
pub fn side_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    keys: &[Key],
) -> Drawn<DB> {
    let font = ("sans-serif", LABEL).into_font();
    area.draw(&Text::new(
        title.to_string(),
        (8, 40),
        ("sans-serif", DESC).into_font(),
    ))?;
    for (i, k) in keys.iter().enumerate() {
        let y = 80 + 28 * i as i32;
        match k.mark {
            Mark::Fill => area.draw(&Rectangle::new(
                [(8, y - 8), (30, y + 8)],
                k.colour.filled(),
            ))?,
            Mark::Stroke(Stroke::Dashed) => {
                for x in [8, 20] {
                    area.draw(&PathElement::new(
                        vec![(x, y), (x + 8, y)],
                        k.colour.stroke_width(3),
                    ))?;
                }
            }
            Mark::Stroke(_) => area.draw(&PathElement::new(
                vec![(8, y), (30, y)],
                k.colour.stroke_width(3),
            ))?,
        }
        area.draw(&Text::new(k.label.clone(), (38, y - 9), font.clone()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_read_well() {
        assert_eq!(si(1500.0), "1.5k");
        assert_eq!(si(2_000_000.0), "2M");
        assert_eq!(si(12.0), "12");
        assert_eq!(dec(1.3863), "1.386");
        assert_eq!(dec(250.0), "250");
        assert_eq!(dec(12.34), "12.3");
        assert_eq!(dec(0.0), "0");
        assert_eq!(Fmt::Int.show(199.6), "200");
    }

    #[test]
    fn ranges_are_padded_and_never_empty() {
        assert_eq!(padded([1.0, 3.0].into_iter(), 0.5), (0.0, 4.0));
        assert_eq!(padded([2.0].into_iter(), 0.0), (1.0, 3.0));
        assert_eq!(padded(std::iter::empty(), 0.1), (0.0, 1.0));
    }

    #[test]
    fn ranges_too_wide_for_a_float_are_narrowed_to_a_finite_span() {
        let m = f64::MAX;
        let cases = [
            ((-1e308, 1e308), (-m / 2.0, m / 2.0)),
            ((1.0, f64::INFINITY), (1.0, m)),
            ((f64::NEG_INFINITY, f64::INFINITY), (-m / 2.0, m / 2.0)),
            ((f64::NAN, 1.0), (-m, 1.0)),
            ((2.0, 2.0), (0.0, 1.0)),
            ((-1.0, 3.0), (-1.0, 3.0)),
        ];
        for ((lo, hi), want) in cases {
            let got = drawable(lo, hi);
            assert_eq!(got, want, "{lo}..{hi}");
            assert!((got.1 - got.0).is_finite());
        }
    }
}
