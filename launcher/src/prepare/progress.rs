//! `zrun prepare`'s progress: a live bar on a terminal (share of the input bytes read,
//! documents, tokens, MB/s), otherwise a plain line every [`EVERY`].

use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use zrun_train::data::Progress;

use crate::launch::output::{self, Level, LogFormat};

/// How often a plain progress line is printed when stderr is not a terminal.
const EVERY: Duration = Duration::from_secs(30);

/// The progress shown so far.
pub struct Shown {
    bar: Option<ProgressBar>,
    start: Instant,
    last_line: Instant,
}

impl Shown {
    /// A bar on stderr when it is a terminal and the output is human and not `--quiet`.
    pub fn start() -> Shown {
        let style = output::style();
        let live = style.format == LogFormat::Human
            && !style.quiet
            && std::io::IsTerminal::is_terminal(&std::io::stderr());
        let bar = live.then(|| {
            let bar = ProgressBar::with_draw_target(Some(1), ProgressDrawTarget::stderr_with_hz(5));
            // The template is fixed and valid: the fallback is never used.
            let style = ProgressStyle::with_template("prepare [{bar:12}] {percent:>3}% {wide_msg}")
                .map(|s| s.progress_chars("=> "))
                .unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(style);
            bar.set_message("reading the inputs");
            output::attach(bar.clone());
            bar
        });
        let now = Instant::now();
        Shown {
            bar,
            start: now,
            last_line: now,
        }
    }

    /// Shows `p`.
    pub fn update(&mut self, p: &Progress) {
        let secs = self.start.elapsed().as_secs_f64().max(1e-3);
        let text = format!(
            "{} docs, {} tokens, {:.1} MB/s, {} tok/s",
            short(p.documents as f64),
            short(p.tokens as f64),
            p.bytes_read as f64 / secs / 1e6,
            short(p.tokens as f64 / secs)
        );
        match &self.bar {
            Some(bar) => {
                bar.set_length(p.bytes_total.max(1));
                bar.set_position(p.bytes_read.min(p.bytes_total));
                bar.set_message(text);
            }
            None if self.last_line.elapsed() >= EVERY => {
                self.last_line = Instant::now();
                let share = 100.0 * p.bytes_read as f64 / p.bytes_total.max(1) as f64;
                output::say(Level::Info, &format!("prepare: {share:.0}% read, {text}"));
            }
            None => {}
        }
    }

    /// Clears the bar.
    pub fn finish(self) {
        if let Some(bar) = self.bar {
            output::detach();
            bar.finish_and_clear();
        }
    }
}

/// `n` in 3 significant figures with k, M or G: 7251818 -> "7.25M".
fn short(n: f64) -> String {
    let (v, unit) = match n {
        n if n >= 1e9 => (n / 1e9, "G"),
        n if n >= 1e6 => (n / 1e6, "M"),
        n if n >= 1e3 => (n / 1e3, "k"),
        n => return format!("{n:.0}"),
    };
    let digits = if v >= 100.0 {
        0
    } else if v >= 10.0 {
        1
    } else {
        2
    };
    format!("{v:.digits$}{unit}")
}

#[cfg(test)]
mod tests {
    #[test]
    fn counts_read_short() {
        let s = super::short;
        assert_eq!(
            (s(999.0), s(7_251_818.0), s(12_345.0)),
            ("999".into(), "7.25M".into(), "12.3k".into())
        );
        assert_eq!(s(123_456_789_000.0), "123G");
    }
}
