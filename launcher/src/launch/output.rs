//! Every line zrun prints, its own and its ranks': in the chosen format (`--log-format`), at
//! the chosen verbosity (`--quiet`), and above rank 0's live progress line while one is drawn.
//!
//! Human format: zrun's messages as `zrun: ...`, a rank's lines with a `[rank R] ` prefix (on
//! jobs of more than one rank). JSON: one object per line; a rank's JSON lines get `"rank": R`,
//! its other lines become `{"rank":R,"level":"INFO","message":...}` (with `"stream":"stderr"`
//! when they came on stderr), and zrun's messages are `{"timestamp","level","message"}`.
//!
//! The workers learn the settings from `ZRUN_LOG_FORMAT=json`, `ZRUN_QUIET=1` and
//! `ZRUN_PROGRESS=launcher` (rank 0 leaves its per-step lines to the progress line).

use std::io::Write;
use std::sync::{Mutex, OnceLock};

use indicatif::ProgressBar;

/// Environment variable: `json` makes a worker log one JSON object per line.
pub const FORMAT_ENV: &str = "ZRUN_LOG_FORMAT";
/// Environment variable: `1` makes a worker log warnings and errors only.
pub const QUIET_ENV: &str = "ZRUN_QUIET";
/// Environment variable: `launcher` when the launcher draws rank 0's progress line.
pub const PROGRESS_ENV: &str = "ZRUN_PROGRESS";

/// The format of every line zrun and its ranks print.
#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Text lines (`[rank R] 12:34:56  INFO ...`), and a live progress line on a terminal.
    #[default]
    Human,
    /// One JSON object per line, with `level` and `message`; a rank's lines carry `rank`.
    Json,
}

/// How this process writes its lines.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Style {
    /// Human or JSON.
    pub format: LogFormat,
    /// Only warnings, errors and the final line.
    pub quiet: bool,
}

impl Style {
    /// The flags where given, else `ZRUN_LOG_FORMAT` and `ZRUN_QUIET` (how a worker learns
    /// them from its launcher); an unknown `ZRUN_LOG_FORMAT` means human.
    pub fn resolve(format: Option<LogFormat>, quiet: bool) -> Style {
        let env = |k| std::env::var(k).unwrap_or_default();
        let format = format.unwrap_or(if env(FORMAT_ENV).eq_ignore_ascii_case("json") {
            LogFormat::Json
        } else {
            LogFormat::Human
        });
        let q = env(QUIET_ENV);
        Style {
            format,
            quiet: quiet || !(q.is_empty() || q == "0"),
        }
    }

    /// The variables that pass this style on to the workers (every worker gets them, so a
    /// value in the launcher's own environment never leaks through unresolved).
    pub fn worker_env(&self) -> Vec<(String, String)> {
        let format = match self.format {
            LogFormat::Human => "human",
            LogFormat::Json => "json",
        };
        vec![
            (FORMAT_ENV.to_string(), format.to_string()),
            (
                QUIET_ENV.to_string(),
                if self.quiet { "1" } else { "0" }.to_string(),
            ),
        ]
    }
}

static STYLE: OnceLock<Style> = OnceLock::new();
/// The live progress line, while one is drawn.
static BAR: Mutex<Option<ProgressBar>> = Mutex::new(None);

/// Sets this process's style once, at start (later calls are ignored).
pub fn set_style(s: Style) {
    let _ = STYLE.set(s);
}

/// This process's style (the default before [`set_style`]).
pub fn style() -> Style {
    STYLE.get().copied().unwrap_or_default()
}

/// Lines printed from now on go above `bar` until [`detach`].
pub fn attach(bar: ProgressBar) {
    *BAR.lock().unwrap_or_else(|p| p.into_inner()) = Some(bar);
}

/// Stops printing above the progress line; returns it.
pub fn detach() -> Option<ProgressBar> {
    BAR.lock().unwrap_or_else(|p| p.into_inner()).take()
}

/// Writes `text` (whole lines, each ending in a newline) to stdout or stderr, above the
/// progress line when one is drawn. Errors writing (a closed pipe) are ignored: they must not
/// stop the job.
fn write(to_stderr: bool, text: &[u8]) {
    let put = || {
        let _ = if to_stderr {
            std::io::stderr().lock().write_all(text)
        } else {
            std::io::stdout().lock().write_all(text)
        };
    };
    let bar = BAR.lock().unwrap_or_else(|p| p.into_inner()).clone();
    match bar {
        Some(b) => b.suspend(put),
        None => put(),
    }
}

/// The severity of one of zrun's own messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// Shown unless `--quiet`.
    Info,
    /// Something the user should act on or know (a stop, a restart).
    Warn,
    /// A failure.
    Error,
}

impl Level {
    fn name(self) -> &'static str {
        match self {
            Level::Info => "INFO",
            Level::Warn => "WARN",
            Level::Error => "ERROR",
        }
    }
}

/// Prints one of zrun's own messages on stderr: `zrun: {msg}`, or a JSON object.
pub fn say(level: Level, msg: &str) {
    say_with(level, msg, &[]);
}

/// [`say`] with a failing rank's last lines: below the message as `    | line` in human
/// format, a `last_lines` array in JSON.
pub fn say_with(level: Level, msg: &str, last_lines: &[String]) {
    let s = style();
    if s.quiet && level == Level::Info {
        return;
    }
    let text = match s.format {
        LogFormat::Human => {
            let mut t = format!("zrun: {msg}\n");
            for l in last_lines {
                t.push_str(&format!("    | {l}\n"));
            }
            t
        }
        LogFormat::Json => {
            let mut t = format!(
                "{{\"timestamp\":{},\"level\":\"{}\",\"message\":{}",
                json_str(&timestamp()),
                level.name(),
                json_str(msg)
            );
            if !last_lines.is_empty() {
                let lines = serde_json::to_string(last_lines).unwrap_or_else(|_| "[]".into());
                t.push_str(&format!(",\"last_lines\":{lines}"));
            }
            t.push_str("}\n");
            t
        }
    };
    write(true, text.as_bytes());
}

/// The error lines (`zrun: error: ...`) ranks printed in this round, in order, each with the
/// ranks that printed it, the one shown first.
static ERRORS: Mutex<Vec<(String, Vec<usize>)>> = Mutex::new(Vec::new());

/// Relays one line of rank `rank` (without its newline) to stdout or stderr, as it came;
/// `prefix`: tag it `[rank R] ` in human format. An error line another rank already printed
/// word for word (every rank meeting the same bad input) is shown once: [`say_repeats`]
/// names the others. The rank's log file and last lines keep it.
pub fn relay(rank: usize, prefix: bool, to_stderr: bool, line: &str) {
    if prefix && style().format == LogFormat::Human && line.starts_with("zrun: error: ") {
        let mut seen = ERRORS.lock().unwrap_or_else(|p| p.into_inner());
        match seen.iter_mut().find(|(l, _)| l == line) {
            Some((_, ranks)) => {
                ranks.push(rank);
                return;
            }
            None => seen.push((line.to_string(), vec![rank])),
        }
    }
    let text = match style().format {
        LogFormat::Human if prefix => format!("[rank {rank}] {line}\n"),
        LogFormat::Human => format!("{line}\n"),
        LogFormat::Json => format!("{}\n", json_worker_line(rank, to_stderr, line)),
    };
    write(to_stderr, text.as_bytes());
}

/// Says which ranks printed an error line that was shown once, and forgets this round's
/// error lines (a second call says nothing).
pub fn say_repeats() {
    let seen = std::mem::take(&mut *ERRORS.lock().unwrap_or_else(|p| p.into_inner()));
    for (_, ranks) in seen {
        if let [first, others @ ..] = ranks.as_slice() {
            if !others.is_empty() {
                say(Level::Error, &repeats(*first, others));
            }
        }
    }
}

/// "rank 2 printed the same error as rank 1 (shown once)", or "ranks 0, 2 and 3 ...".
fn repeats(first: usize, others: &[usize]) -> String {
    let mut sorted = others.to_vec();
    sorted.sort_unstable();
    let names: Vec<String> = sorted.iter().map(usize::to_string).collect();
    let who = match names.as_slice() {
        [one] => format!("rank {one}"),
        [init @ .., last] => format!("ranks {} and {last}", init.join(", ")),
        [] => String::new(),
    };
    format!("{who} printed the same error as rank {first} (shown once)")
}

/// Writes bytes a logger formatted (whole lines) to stderr, above the progress line.
pub fn stderr_bytes(text: &[u8]) {
    write(true, text);
}

/// A rank's line as one JSON object carrying `"rank": R`: its own object with the field
/// added in front (its text otherwise kept), or the line wrapped as an INFO message.
pub fn json_worker_line(rank: usize, to_stderr: bool, line: &str) -> String {
    let trimmed = line.trim();
    if let Ok(serde_json::Value::Object(m)) = serde_json::from_str(trimmed) {
        if m.contains_key("rank") {
            return trimmed.to_string();
        }
        let rest = trimmed[1..].trim_start();
        return if rest.starts_with('}') {
            format!("{{\"rank\":{rank}}}")
        } else {
            format!("{{\"rank\":{rank},{rest}")
        };
    }
    let stream = if to_stderr {
        ",\"stream\":\"stderr\""
    } else {
        ""
    };
    format!(
        "{{\"rank\":{rank},\"level\":\"INFO\",\"message\":{}{stream}}}",
        json_str(line)
    )
}

fn json_str(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

/// Now as RFC 3339 UTC with microseconds, as the ranks' JSON lines have it.
fn timestamp() -> String {
    use tracing_subscriber::fmt::time::FormatTime;
    let mut s = String::new();
    let _ = tracing_subscriber::fmt::time::SystemTime
        .format_time(&mut tracing_subscriber::fmt::format::Writer::new(&mut s));
    s
}

/// A `tracing` writer whose every event goes through [`stderr_bytes`], so a logger's lines
/// land above the progress line too.
pub struct LogWriter;

/// One event's bytes, written out whole when dropped.
pub struct EventBuf(Vec<u8>);

impl Write for EventBuf {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.extend_from_slice(b);
        Ok(b.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Drop for EventBuf {
    fn drop(&mut self) {
        if !self.0.is_empty() {
            stderr_bytes(&self.0);
        }
    }
}

impl<'a> tracing_subscriber::fmt::MakeWriter<'a> for LogWriter {
    type Writer = EventBuf;

    fn make_writer(&'a self) -> EventBuf {
        EventBuf(Vec::new())
    }
}

/// Time of day, `HH:MM:SS` local time, for human log lines.
pub struct Clock;

impl tracing_subscriber::fmt::time::FormatTime for Clock {
    fn format_time(&self, w: &mut tracing_subscriber::fmt::format::Writer<'_>) -> std::fmt::Result {
        let secs = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let now = libc::time_t::try_from(secs).unwrap_or(0);
        // SAFETY: `tm` is a plain C struct for which all-zero bytes are a valid value (its
        // one pointer field, where present, becomes null).
        let mut tm: libc::tm = unsafe { std::mem::zeroed() };
        // SAFETY: localtime_r reads `now` and writes only into `tm`, both live locals; it is
        // the reentrant variant (no shared static buffer), and zrun never changes TZ.
        let local = unsafe { !libc::localtime_r(&now, &mut tm).is_null() };
        let (h, m, s) = if local {
            (tm.tm_hour, tm.tm_min, tm.tm_sec)
        } else {
            let d = (secs % 86_400) as i32;
            (d / 3600, d / 60 % 60, d % 60)
        };
        write!(w, "{h:02}:{m:02}:{s:02}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn repeated_errors_are_named_in_one_line() {
        assert_eq!(
            repeats(1, &[3, 0, 2]),
            "ranks 0, 2 and 3 printed the same error as rank 1 (shown once)"
        );
        assert_eq!(
            repeats(0, &[1]),
            "rank 1 printed the same error as rank 0 (shown once)"
        );
    }

    #[test]
    fn a_ranks_json_line_gets_its_rank_in_front() {
        let l = json_worker_line(3, true, r#"{"timestamp":"t","level":"WARN","message":"m"}"#);
        assert_eq!(
            l,
            r#"{"rank":3,"timestamp":"t","level":"WARN","message":"m"}"#
        );
        assert_eq!(json_worker_line(1, false, "{ }"), r#"{"rank":1}"#);
        // a line that has a rank already is left alone
        let own = r#"{"rank":5,"message":"x"}"#;
        assert_eq!(json_worker_line(1, false, own), own);
    }

    #[test]
    fn other_lines_are_wrapped_as_info_messages() {
        let l = json_worker_line(0, false, "final: eval_loss 2.3 \"q\"");
        let v: serde_json::Value = serde_json::from_str(&l).unwrap();
        assert_eq!(v["rank"], 0);
        assert_eq!(v["level"], "INFO");
        assert_eq!(v["message"], "final: eval_loss 2.3 \"q\"");
        assert!(v.get("stream").is_none());
        let e = json_worker_line(2, true, "[1, 2] not an object");
        let v: serde_json::Value = serde_json::from_str(&e).unwrap();
        assert_eq!(
            (v["rank"].as_u64(), v["stream"].as_str()),
            (Some(2), Some("stderr"))
        );
    }

    #[test]
    fn style_passes_on_to_workers() {
        let s = Style {
            format: LogFormat::Json,
            quiet: true,
        };
        let env = s.worker_env();
        assert!(env.contains(&(FORMAT_ENV.into(), "json".into())));
        assert!(env.contains(&(QUIET_ENV.into(), "1".into())));
        // flags win over the environment
        assert_eq!(
            Style::resolve(Some(LogFormat::Human), false).format,
            LogFormat::Human
        );
    }

    #[test]
    fn timestamps_are_rfc3339_and_clock_is_seconds() {
        let t = timestamp();
        assert!(
            t.len() >= 20 && t.as_bytes()[4] == b'-' && t.contains('T'),
            "{t}"
        );
        let mut s = String::new();
        tracing_subscriber::fmt::time::FormatTime::format_time(
            &Clock,
            &mut tracing_subscriber::fmt::format::Writer::new(&mut s),
        )
        .unwrap();
        let b = s.as_bytes();
        assert_eq!((b.len(), b[2], b[5]), (8, b':', b':'), "{s}");
    }
}
