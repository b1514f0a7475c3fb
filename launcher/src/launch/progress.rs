//! Rank 0's live progress line on a terminal: step/steps, loss, eval loss, tokens/s, MFU,
//! memory, elapsed time and ETA, drawn by node 0's launcher from `<log.dir>/metrics.jsonl`.
//!
//! Rank 0 appends one JSON object per logged step to that file, truncating it (a fresh run)
//! or rewriting it through a rename (a resumed run, which keeps the lines up to its
//! checkpoint) when it starts. A thread polls it a few times a second: a file as it was
//! before the job started is someone else's, so it is ignored until it changes; a file that
//! shrank or was replaced is read again from the start; the newest line is what the line
//! shows, so a resumed run starts at its checkpoint's step.

use std::collections::VecDeque;
use std::io::{Read, Seek, SeekFrom};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

use super::output;

/// How often the file is read and the line redrawn.
const POLL: Duration = Duration::from_millis(200);
/// Logged steps averaged for tokens/s, MFU and the fallback step time.
const WINDOW: usize = 8;

/// Where the progress comes from.
#[derive(Clone, Debug)]
pub struct Source {
    /// Rank 0's `metrics.jsonl`.
    pub metrics: PathBuf,
    /// `train.steps`: the end of the line.
    pub steps: u64,
}

/// The live line and the thread that feeds it; [`Progress::finish`] (or drop) clears it.
pub struct Progress {
    bar: ProgressBar,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl Progress {
    /// Draws the line on stderr and starts following `src`; from now on every line zrun
    /// prints goes above it.
    pub fn start(src: Source) -> std::io::Result<Progress> {
        let bar =
            ProgressBar::with_draw_target(Some(src.steps), ProgressDrawTarget::stderr_with_hz(10));
        // The template is fixed and valid: the fallback is never used.
        let style = ProgressStyle::with_template("step {pos}/{len} [{bar:12}] {wide_msg}")
            .map(|s| s.progress_chars("=> "))
            .unwrap_or_else(|_| ProgressStyle::default_bar());
        bar.set_style(style);
        bar.set_message("starting the ranks");
        output::attach(bar.clone());
        let stop = Arc::new(AtomicBool::new(false));
        let (b, s) = (bar.clone(), stop.clone());
        let thread = std::thread::Builder::new()
            .name("zrun-progress".into())
            .spawn(move || follow(&src, &b, &s));
        let thread = match thread {
            Ok(t) => t,
            Err(e) => {
                output::detach();
                bar.finish_and_clear();
                return Err(e);
            }
        };
        Ok(Progress {
            bar,
            stop,
            thread: Some(thread),
        })
    }

    /// Stops following and clears the line: what the ranks printed last stays last.
    pub fn finish(mut self) {
        self.end();
    }

    fn end(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        output::detach();
        self.bar.finish_and_clear();
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        if self.thread.is_some() {
            self.end();
        }
    }
}

/// The feeding loop: read the new lines, redraw, sleep.
fn follow(src: &Source, bar: &ProgressBar, stop: &AtomicBool) {
    let started = Instant::now();
    let mut tail = Tail::new(&src.metrics);
    let mut view = View::default();
    while !stop.load(Ordering::SeqCst) {
        let now = Instant::now();
        let polled = tail.poll();
        if polled.reset {
            view = View::default();
        }
        for l in &polled.lines {
            view.add(l);
        }
        if !polled.lines.is_empty() {
            view.seen_at(now);
        }
        // The position first: it is stored even when not drawn, and the message draws both.
        if let Some(step) = view.step {
            bar.set_position(step.min(src.steps));
        }
        bar.set_message(view.render(src.steps, started.elapsed(), now));
        std::thread::sleep(POLL);
    }
}

/// What identifies one version of the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Stamp {
    dev: u64,
    ino: u64,
    len: u64,
    mtime_ns: i128,
}

impl Stamp {
    fn of(path: &Path) -> Option<Stamp> {
        let m = std::fs::metadata(path).ok()?;
        Some(Stamp {
            dev: m.dev(),
            ino: m.ino(),
            len: m.len(),
            mtime_ns: i128::from(m.mtime()) * 1_000_000_000 + i128::from(m.mtime_nsec()),
        })
    }
}

/// The complete lines that arrived since the last poll.
#[derive(Debug, Default)]
struct Polled {
    /// The file was (re)started: forget what was read before.
    reset: bool,
    /// Parsed lines, oldest first (lines that are not JSON objects are skipped).
    lines: Vec<serde_json::Value>,
}

/// Follows one file that is truncated or replaced when a run starts.
struct Tail {
    path: PathBuf,
    /// The file as it was before the job: not this job's until it changes.
    stale: Option<Stamp>,
    /// (dev, inode) being read, once the file is this job's.
    reading: Option<(u64, u64)>,
    offset: u64,
    partial: Vec<u8>,
}

impl Tail {
    fn new(path: &Path) -> Tail {
        Tail {
            path: path.to_path_buf(),
            stale: Stamp::of(path),
            reading: None,
            offset: 0,
            partial: Vec::new(),
        }
    }

    fn poll(&mut self) -> Polled {
        let mut out = Polled::default();
        let Some(st) = Stamp::of(&self.path) else {
            return out;
        };
        let id = (st.dev, st.ino);
        let restarted = match self.reading {
            None => Some(st) != self.stale,
            Some(r) => r != id || st.len < self.offset,
        };
        if restarted {
            self.stale = None;
            self.reading = Some(id);
            self.offset = 0;
            self.partial.clear();
            out.reset = true;
        }
        if self.reading.is_none() || st.len <= self.offset {
            return out;
        }
        let mut buf = Vec::new();
        let read = std::fs::File::open(&self.path).and_then(|mut f| {
            f.seek(SeekFrom::Start(self.offset))?;
            f.read_to_end(&mut buf)
        });
        if read.is_err() {
            return out;
        }
        self.offset += buf.len() as u64;
        self.partial.extend_from_slice(&buf);
        // Only whole lines: the writer may be midway through one.
        let Some(end) = self.partial.iter().rposition(|b| *b == b'\n') else {
            return out;
        };
        let whole: Vec<u8> = self.partial.drain(..=end).collect();
        out.lines = whole
            .split(|b| *b == b'\n')
            .filter_map(|l| serde_json::from_slice::<serde_json::Value>(l).ok())
            .filter(|v| v.get("step").and_then(|s| s.as_u64()).is_some())
            .collect();
        out
    }
}

/// Figures of one logged step used for the averages.
#[derive(Clone, Copy, Debug)]
struct Rate {
    tokens_per_s: f64,
    step_time_s: f64,
    mfu: Option<f64>,
}

/// What the line shows, from the lines read so far.
#[derive(Debug, Default)]
struct View {
    step: Option<u64>,
    loss: Option<f64>,
    /// The newest evaluation: (step, loss).
    eval: Option<(u64, f64)>,
    rss_bytes: Option<i64>,
    gpu_peak_bytes: Option<i64>,
    /// CPU ranks with the caching allocator: (allocated, reserved) peaks.
    cpu_peaks: Option<(i64, i64)>,
    window: VecDeque<Rate>,
    /// The first (step, time) this job saw arrive, and the newest: the measured pace.
    first_seen: Option<(u64, Instant)>,
    last_seen: Option<(u64, Instant)>,
}

impl View {
    fn add(&mut self, v: &serde_json::Value) {
        let f = |k: &str| v.get(k).and_then(|x| x.as_f64()).filter(|x| x.is_finite());
        let Some(step) = v.get("step").and_then(|s| s.as_u64()) else {
            return;
        };
        self.step = Some(step);
        self.loss = f("loss").or(self.loss);
        if let Some(e) = f("eval_loss") {
            self.eval = Some((step, e));
        }
        self.rss_bytes = v
            .get("rss_bytes")
            .and_then(|x| x.as_i64())
            .or(self.rss_bytes);
        self.gpu_peak_bytes = v
            .get("cuda_peak_bytes")
            .and_then(|x| x.as_i64())
            .or(self.gpu_peak_bytes);
        let i = |k: &str| v.get(k).and_then(|x| x.as_i64());
        if let (Some(a), Some(r)) = (i("cpu_allocated_peak_bytes"), i("cpu_reserved_peak_bytes")) {
            self.cpu_peaks = Some((a, r));
        }
        if let (Some(tokens_per_s), Some(step_time_s)) = (f("tokens_per_s"), f("step_time_s")) {
            if self.window.len() == WINDOW {
                self.window.pop_front();
            }
            self.window.push_back(Rate {
                tokens_per_s,
                step_time_s,
                mfu: f("mfu"),
            });
        }
    }

    /// The lines added so far arrived at `now` (a batch read at once counts as one arrival:
    /// a resumed run's old lines do not make a pace).
    fn seen_at(&mut self, now: Instant) {
        if let Some(step) = self.step {
            self.first_seen.get_or_insert((step, now));
            self.last_seen = Some((step, now));
        }
    }

    /// Tokens per second and MFU over the window, weighted by step time.
    fn rates(&self) -> (Option<f64>, Option<f64>) {
        let time: f64 = self.window.iter().map(|r| r.step_time_s).sum();
        if time <= 0.0 {
            return (None, None);
        }
        let tokens: f64 = self
            .window
            .iter()
            .map(|r| r.tokens_per_s * r.step_time_s)
            .sum();
        let mfu = self
            .window
            .iter()
            .map(|r| r.mfu.map(|m| m * r.step_time_s))
            .sum::<Option<f64>>()
            .map(|m| m / time);
        (Some(tokens / time), mfu)
    }

    /// Seconds per step: measured between arrivals (evaluation, logging and saving
    /// included), else the logged step times.
    fn seconds_per_step(&self) -> Option<f64> {
        match (self.first_seen, self.last_seen) {
            (Some((s0, t0)), Some((s1, t1))) if s1 > s0 => {
                Some(t1.duration_since(t0).as_secs_f64() / (s1 - s0) as f64)
            }
            _ if !self.window.is_empty() => {
                let n = self.window.len() as f64;
                Some(self.window.iter().map(|r| r.step_time_s).sum::<f64>() / n)
            }
            _ => None,
        }
    }

    /// Time left to `steps`, counting down from the newest arrival; `None` when unknown or
    /// too long for a `Duration` (an absurd logged step time).
    fn eta(&self, steps: u64, now: Instant) -> Option<Duration> {
        let (step, at) = self.last_seen?;
        let left = steps.saturating_sub(step) as f64 * self.seconds_per_step()?;
        let since = now.saturating_duration_since(at).as_secs_f64();
        Duration::try_from_secs_f64((left - since).max(0.0)).ok()
    }

    /// The text after `step N/M [bar]`, the most wanted first (a narrow terminal cuts the end).
    fn render(&self, steps: u64, elapsed: Duration, now: Instant) -> String {
        let eta = self.eta(steps, now).map_or_else(|| "--".to_string(), clock);
        let mut parts = vec![format!("{} ETA {eta}", clock(elapsed))];
        match self.loss {
            Some(l) => {
                let eval = self
                    .eval
                    .map(|(_, e)| format!(" eval {e:.4}"))
                    .unwrap_or_default();
                parts.push(format!("loss {l:.4}{eval}"));
            }
            None => parts.push("waiting for the first logged step".to_string()),
        }
        let (tps, mfu) = self.rates();
        if let Some(t) = tps {
            parts.push(format!("{} tok/s", si(t)));
        }
        if let Some(m) = mfu {
            parts.push(format!("MFU {:.1}%", 100.0 * m));
        }
        let mut mem = Vec::new();
        if let Some(b) = self.rss_bytes {
            mem.push(format!("rss {}", bytes(b)));
        }
        if let Some(b) = self.gpu_peak_bytes {
            mem.push(format!("gpu peak {}", bytes(b)));
        }
        if let Some((a, r)) = self.cpu_peaks {
            mem.push(format!("peak {} ({} reserved)", bytes(a), bytes(r)));
        }
        if !mem.is_empty() {
            parts.push(mem.join(" "));
        }
        parts.join(" | ")
    }
}

/// 950, 33.5k, 1.23M tokens.
fn si(x: f64) -> String {
    if x >= 1e6 {
        format!("{:.2}M", x / 1e6)
    } else if x >= 1e3 {
        format!("{:.1}k", x / 1e3)
    } else {
        format!("{x:.0}")
    }
}

/// 151 MiB, 3.2 GiB.
fn bytes(b: i64) -> String {
    let mib = b as f64 / (1u64 << 20) as f64;
    if mib >= 1024.0 {
        format!("{:.1} GiB", mib / 1024.0)
    } else {
        format!("{mib:.0} MiB")
    }
}

/// 0:07, 12:34, 1:02:03.
fn clock(d: Duration) -> String {
    let s = d.as_secs();
    if s >= 3600 {
        format!("{}:{:02}:{:02}", s / 3600, s / 60 % 60, s % 60)
    } else {
        format!("{}:{:02}", s / 60, s % 60)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn line(step: u64, loss: f64) -> String {
        format!(
            "{{\"step\":{step},\"loss\":{loss},\"tokens_per_s\":1000.0,\"step_time_s\":0.5,\"rss_bytes\":{}}}\n",
            150u64 << 20
        )
    }

    fn append(path: &Path, text: &str) {
        let mut f = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(path)
            .unwrap();
        f.write_all(text.as_bytes()).unwrap();
    }

    fn steps(p: &Polled) -> Vec<u64> {
        p.lines
            .iter()
            .map(|v| v["step"].as_u64().unwrap())
            .collect()
    }

    #[test]
    fn an_old_file_is_ignored_until_the_run_truncates_it() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("metrics.jsonl");
        std::fs::write(&path, line(5, 3.0) + &line(10, 2.0)).unwrap();
        let mut t = Tail::new(&path);
        assert!(t.poll().lines.is_empty(), "the previous run's lines");
        // A fresh run truncates (same inode) and appends.
        std::thread::sleep(Duration::from_millis(20));
        std::fs::File::create(&path).unwrap();
        append(&path, &line(5, 4.0));
        let p = t.poll();
        assert!(p.reset);
        assert_eq!(steps(&p), [5]);
        // half a line waits for its end
        append(&path, "{\"step\":10,\"lo");
        assert!(t.poll().lines.is_empty());
        append(&path, "ss\":3.5}\n");
        let p = t.poll();
        assert!(!p.reset);
        assert_eq!(steps(&p), [10]);
    }

    #[test]
    fn a_replaced_or_shrunk_file_is_read_again_from_the_start() {
        let d = tempfile::tempdir().unwrap();
        let path = d.path().join("metrics.jsonl");
        let mut t = Tail::new(&path);
        append(&path, &(line(5, 3.0) + &line(10, 2.5) + &line(15, 2.0)));
        assert_eq!(steps(&t.poll()), [5, 10, 15]);
        // A resumed run rewrites the file through a rename, keeping steps up to 10.
        let tmp = d.path().join("metrics.jsonl.tmp");
        std::fs::write(&tmp, line(5, 3.0) + &line(10, 2.5)).unwrap();
        std::fs::rename(&tmp, &path).unwrap();
        let p = t.poll();
        assert!(p.reset);
        assert_eq!(steps(&p), [5, 10]);
        // and a truncation to less than was read is a restart too
        std::fs::write(&path, line(5, 9.0)).unwrap();
        let p = t.poll();
        assert!(p.reset && steps(&p) == [5], "{p:?}");
    }

    #[test]
    fn a_resumed_run_starts_at_its_newest_line_and_paces_from_there() {
        let mut v = View::default();
        let t0 = Instant::now();
        // the old lines arrive in one read
        for s in [5, 10, 15, 20] {
            v.add(&serde_json::from_str(&line(s, 2.0)).unwrap());
        }
        v.seen_at(t0);
        assert_eq!(v.step, Some(20));
        // before a second arrival: the logged step time, 0.5 s, for 20 steps left
        assert_eq!(v.eta(40, t0), Some(Duration::from_secs(10)));
        // then the measured pace: 5 steps in 1 s
        v.add(&serde_json::from_str(&line(25, 1.9)).unwrap());
        v.seen_at(t0 + Duration::from_secs(1));
        let eta = v.eta(40, t0 + Duration::from_secs(1)).unwrap();
        assert_eq!(eta, Duration::from_secs(3));
        // and it counts down between arrivals
        let later = v.eta(40, t0 + Duration::from_secs(2)).unwrap();
        assert_eq!(later, Duration::from_secs(2));
    }

    #[test]
    fn an_absurd_step_time_leaves_the_eta_out_rather_than_panicking() {
        let mut v = View::default();
        let huge = line(5, 2.0).replace("\"step_time_s\":0.5", "\"step_time_s\":1e300");
        v.add(&serde_json::from_str(&huge).unwrap());
        v.seen_at(Instant::now());
        assert_eq!(v.eta(u64::MAX, Instant::now()), None);
    }

    #[test]
    fn the_line_shows_every_figure_it_has() {
        let mut v = View::default();
        let now = Instant::now();
        let text = v.render(40, Duration::from_secs(3), now);
        assert_eq!(text, "0:03 ETA -- | waiting for the first logged step");
        v.add(&serde_json::json!({
            "step": 20, "loss": 2.34567, "eval_loss": 2.5, "tokens_per_s": 33500.0,
            "step_time_s": 0.06, "mfu": 0.412, "rss_bytes": 151i64 << 20
        }));

        v.add(&serde_json::json!({
            "step": 25, "loss": 2.2, "tokens_per_s": 33500.0, "step_time_s": 0.06,
            "mfu": 0.412, "rss_bytes": 3i64 << 30, "cuda_peak_bytes": 5i64 << 30
        }));
        v.seen_at(now);
        let text = v.render(40, Duration::from_secs(3725), now);
        assert_eq!(
            text,
            "1:02:05 ETA 0:00 | loss 2.2000 eval 2.5000 | 33.5k tok/s | MFU 41.2% | rss 3.0 GiB gpu peak 5.0 GiB"
        );
    }

    #[test]
    fn cpu_ranks_show_the_caching_allocators_peaks() {
        let mut v = View::default();
        let now = Instant::now();
        v.add(&serde_json::json!({
            "step": 2, "loss": 2.3, "tokens_per_s": 900.0, "step_time_s": 0.5,
            "rss_bytes": 151i64 << 20
        }));
        let line = v.render(40, Duration::from_secs(3), now);
        assert!(line.ends_with("| rss 151 MiB"), "{line}");
        v.add(&serde_json::json!({
            "step": 3, "loss": 2.3, "tokens_per_s": 900.0, "step_time_s": 0.5,
            "rss_bytes": 151i64 << 20, "cpu_allocated_peak_bytes": 96i64 << 20,
            "cpu_reserved_peak_bytes": 100i64 << 20
        }));
        let line = v.render(40, Duration::from_secs(3), now);
        assert!(
            line.ends_with("| rss 151 MiB peak 96 MiB (100 MiB reserved)"),
            "{line}"
        );
    }

    #[test]
    fn numbers_are_short() {
        assert_eq!(
            (si(950.0), si(33_456.0), si(1_234_567.0)),
            ("950".into(), "33.5k".into(), "1.23M".into())
        );
        assert_eq!(bytes(151 << 20), "151 MiB");
        assert_eq!(clock(Duration::from_secs(7)), "0:07");
        assert_eq!(clock(Duration::from_secs(754)), "12:34");
    }
}
