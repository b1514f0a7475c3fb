//! Reading a run directory: `metrics.jsonl` (one object per logged step, rank 0's view plus
//! every rank's breakdown and memory) and `summary.json` (end-of-run figures; absent while a
//! run is still going). Only `step` and `loss` are required of a metrics line, so older runs,
//! written before `tokens` and `ranks` existed, still load.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::launch::BadInput;
pub use zrun_train::report::{Breakdown, MemoryByKind as Memory};

/// One run directory, read.
#[derive(Debug)]
pub struct Run {
    /// The name the charts give the run (the directory's own name).
    pub name: String,
    /// The directory as given.
    pub dir: PathBuf,
    /// The logged steps, in file order.
    pub steps: Vec<Step>,
    /// `summary.json`, when the run has finished.
    pub summary: Option<Summary>,
}

/// One line of `metrics.jsonl`.
#[derive(Debug, Deserialize)]
pub struct Step {
    /// Optimizer step, 1-based.
    pub step: u64,
    /// Mean training loss of the step, nats (NaN where a diverged run wrote `null`).
    #[serde(deserialize_with = "nan_if_null")]
    pub loss: f64,
    /// Evaluation loss, on the steps that evaluated.
    pub eval_loss: Option<f64>,
    /// Tokens of the global batch per second.
    pub tokens_per_s: Option<f64>,
    /// Wall time of the step, seconds.
    pub step_time_s: Option<f64>,
    /// Model FLOPs utilisation, 0..1, where a peak is known.
    pub mfu: Option<f64>,
    /// Global tokens consumed so far (newer runs).
    pub tokens: Option<u64>,
    /// Rank 0's model-state bytes (older runs' only memory figures, with the three below).
    pub model_state_bytes: Option<i64>,
    /// Rank 0's engine bytes.
    pub engine_bytes: Option<i64>,
    /// Rank 0's resident set size.
    pub rss_bytes: Option<i64>,
    /// Rank 0's peak resident set size so far.
    pub peak_rss_bytes: Option<i64>,
    /// Every rank's figures for this step, in rank order (newer runs).
    #[serde(default)]
    pub ranks: Vec<RankStep>,
}

/// One rank's figures in a metrics line.
#[derive(Debug, Deserialize)]
pub struct RankStep {
    /// The rank.
    pub rank: usize,
    /// Where the step's time went.
    #[serde(flatten)]
    pub breakdown: Breakdown,
    /// Bytes by kind.
    pub memory: Memory,
}

/// `summary.json`: only what the charts use.
#[derive(Debug, Default, Deserialize)]
pub struct Summary {
    /// The data's exact loss floor, nats, when known.
    pub loss_floor: Option<f64>,
    /// Per-rank figures (newer runs).
    #[serde(default)]
    pub ranks: Vec<RankSummary>,
    /// Ranks reported as stragglers.
    #[serde(default)]
    pub stragglers: Vec<usize>,
}

/// One rank's end-of-run figures. The breakdown is read nested (`"breakdown": {..}`) or
/// flattened into the rank's object, as metrics lines have it.
#[derive(Debug, Deserialize)]
pub struct RankSummary {
    /// The rank.
    pub rank: usize,
    /// Mean seconds per step by phase, nested.
    #[serde(default)]
    breakdown: Option<Breakdown>,
    /// The same, flattened.
    #[serde(flatten)]
    flat: Option<Breakdown>,
    /// The rank was reported as a straggler.
    #[serde(default)]
    straggler: bool,
}

impl Run {
    /// Global tokens consumed at each logged step: the `tokens` field, or (older runs)
    /// step x the global batch, tokens_per_s x step_time_s. None when neither is there.
    pub fn tokens(&self) -> Option<(Vec<f64>, bool)> {
        if self.steps.iter().all(|s| s.tokens.is_some()) {
            return Some((
                self.steps
                    .iter()
                    .map(|s| s.tokens.unwrap_or(0) as f64)
                    .collect(),
                false,
            ));
        }
        let batch = |s: &Step| Some((s.tokens_per_s? * s.step_time_s?).round());
        let est: Option<Vec<f64>> = self
            .steps
            .iter()
            .map(|s| batch(s).map(|b| s.step as f64 * b))
            .collect();
        est.filter(|v| v.iter().any(|t| *t > 0.0))
            .map(|v| (v, true))
    }

    /// Mean seconds per step of each rank, with its straggler flag: summary.json's figures,
    /// else the mean over the metrics lines. Empty for runs without per-rank figures.
    pub fn breakdowns(&self) -> Vec<(usize, Breakdown, bool)> {
        if let Some(s) = self.summary.as_ref() {
            let ranks: Option<Vec<_>> = s
                .ranks
                .iter()
                .map(|r| {
                    let straggler = r.straggler || s.stragglers.contains(&r.rank);
                    Some((r.rank, r.breakdown.or(r.flat)?, straggler))
                })
                .collect();
            if let Some(ranks) = ranks.filter(|r| !r.is_empty()) {
                return ranks;
            }
        }
        let lines: Vec<&Step> = self.steps.iter().filter(|s| !s.ranks.is_empty()).collect();
        let world = lines.iter().map(|s| s.ranks.len()).max().unwrap_or(0);
        (0..world)
            .map(|i| {
                let rs: Vec<&RankStep> = lines.iter().filter_map(|s| s.ranks.get(i)).collect();
                let n = rs.len() as f64;
                let mean =
                    |f: fn(&Breakdown) -> f64| rs.iter().map(|r| f(&r.breakdown)).sum::<f64>() / n;
                let b = Breakdown {
                    step_time_s: mean(|b| b.step_time_s),
                    data_s: mean(|b| b.data_s),
                    forward_s: mean(|b| b.forward_s),
                    backward_s: mean(|b| b.backward_s),
                    comm_wait_s: mean(|b| b.comm_wait_s),
                    optimizer_s: mean(|b| b.optimizer_s),
                    other_s: mean(|b| b.other_s),
                };
                (rs[0].rank, b, false)
            })
            .collect()
    }
}

/// Reads `dir`'s metrics.jsonl and, when present, summary.json. Notes (a partial last line,
/// a missing summary) go to `notes`; a missing or malformed file is [`BadInput`] naming it.
pub fn load(dir: &Path, notes: &mut Vec<String>) -> anyhow::Result<Run> {
    let name = run_name(dir);
    if dir.is_file() {
        return Err(BadInput(format!(
            "{}: a file, not a run directory; give a run's log.dir (the directory holding metrics.jsonl)",
            dir.display()
        ))
        .into());
    }
    let path = dir.join("metrics.jsonl");
    let text = read_text(&path).map_err(|e| {
        BadInput(format!(
            "cannot read {}: {e} (is {} a run's log.dir?)",
            path.display(),
            dir.display()
        ))
    })?;
    let steps = parse_metrics(&text, &path, &name, notes)?;
    let spath = dir.join("summary.json");
    let summary = match read_text(&spath) {
        Ok(t) => Some(serde_json::from_str::<Summary>(&t).map_err(|e| {
            BadInput(format!(
                "{}:{}:{}: {}; it is not a summary zrun wrote (edited or cut short): move it \
                 away to plot from metrics.jsonl alone",
                spath.display(),
                e.line(),
                e.column(),
                bare(&e)
            ))
        })?),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            notes.push(format!("{name}: no summary.json (still running?); no loss floor, per-rank means from the metrics lines"));
            None
        }
        Err(e) => return Err(BadInput(format!("cannot read {}: {e}", spath.display())).into()),
    };
    Ok(Run {
        name,
        dir: dir.to_path_buf(),
        steps,
        summary,
    })
}

/// Parses metrics.jsonl text. A last line without its newline that does not parse is a
/// line being written (a running run) and is skipped with a note; any other bad line is
/// an error naming `path:line:column`.
pub fn parse_metrics(
    text: &str,
    path: &Path,
    name: &str,
    notes: &mut Vec<String>,
) -> anyhow::Result<Vec<Step>> {
    let mut steps = Vec::new();
    let n_lines = text.lines().count();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match serde_json::from_str::<Step>(line) {
            Ok(s) => steps.push(s),
            Err(_) if i + 1 == n_lines && !text.ends_with('\n') => {
                notes.push(format!(
                    "{name}: skipped the unfinished last line of {}",
                    path.display()
                ));
            }
            Err(e) => {
                return Err(BadInput(format!(
                    "{}:{}:{}: {}; it is not a metrics line zrun wrote (edited, or another \
                     tool's file): plot a run's log.dir, or mend or delete the line",
                    path.display(),
                    i + 1,
                    e.column(),
                    bare(&e)
                ))
                .into());
            }
        }
    }
    if steps.is_empty() {
        return Err(BadInput(format!("{} has no logged steps yet", path.display())).into());
    }
    Ok(steps)
}

/// A number, or NaN for `null` (serde_json writes a NaN as `null`).
fn nan_if_null<'de, D: serde::Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
    Ok(Option::<f64>::deserialize(d)?.unwrap_or(f64::NAN))
}

/// serde_json's message without its " at line L column C" (the caller names the position).
fn bare(e: &serde_json::Error) -> String {
    let msg = e.to_string();
    match msg.rfind(" at line ") {
        Some(i) => msg[..i].to_string(),
        None => msg,
    }
}

/// The directory's own name (of its absolute path, so `.` has one too).
fn run_name(dir: &Path) -> String {
    let abs = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    abs.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| dir.display().to_string())
}

/// Gives runs with the same directory name distinct names: their paths as given.
pub fn disambiguate(runs: &mut [Run]) {
    let names: Vec<String> = runs.iter().map(|r| r.name.clone()).collect();
    for r in runs.iter_mut() {
        if names.iter().filter(|n| **n == r.name).count() > 1 {
            r.name = r.dir.display().to_string();
        }
    }
}

/// A run's text file, refused when it is not a regular file (a FIFO would block the plot).
fn read_text(path: &Path) -> std::io::Result<String> {
    String::from_utf8(zrun_train::data::read_regular(path)?)
        .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    const NEW: &str = r#"{"step":10,"loss":2.5,"lr":0.001,"grad_norm":1.0,"tokens_per_s":1000.0,"step_time_s":0.5,"model_state_bytes":100,"engine_bytes":120,"rss_bytes":1000,"peak_rss_bytes":1100,"tokens":5120,"ranks":[{"rank":0,"step_time_s":0.5,"data_s":0.01,"forward_s":0.1,"backward_s":0.2,"comm_wait_s":0.05,"optimizer_s":0.1,"other_s":0.04,"memory":{"params":10,"grads":10,"master":0,"optimizer":20,"host":0,"buffers":5,"activations":7,"rss":1000,"rss_peak":1100}},{"rank":1,"step_time_s":0.5,"data_s":0.03,"forward_s":0.1,"backward_s":0.2,"comm_wait_s":0.07,"optimizer_s":0.1,"other_s":0.0,"memory":{"params":10,"grads":10,"master":0,"optimizer":20,"host":0,"buffers":5,"activations":7,"rss":900,"rss_peak":950,"cuda_allocated_peak":64}}]}"#;
    const OLD: &str = r#"{"step":20,"loss":2.0,"lr":0.001,"grad_norm":1.0,"tokens_per_s":2048.0,"step_time_s":0.5,"eval_loss":2.1,"model_state_bytes":100,"engine_bytes":120,"rss_bytes":1000,"peak_rss_bytes":1100}"#;

    fn parse(text: &str) -> (anyhow::Result<Vec<Step>>, Vec<String>) {
        let mut notes = Vec::new();
        (
            parse_metrics(text, Path::new("r/metrics.jsonl"), "r", &mut notes),
            notes,
        )
    }

    fn run(text: &str, summary: Option<Summary>) -> Run {
        Run {
            name: "r".into(),
            dir: "r".into(),
            steps: parse(text).0.unwrap(),
            summary,
        }
    }

    #[test]
    fn new_lines_carry_ranks_breakdown_and_memory() {
        let (steps, notes) = parse(&format!("{NEW}\n"));
        let steps = steps.unwrap();
        assert!(notes.is_empty());
        assert_eq!(steps[0].tokens, Some(5120));
        assert_eq!(steps[0].ranks.len(), 2);
        let r1 = &steps[0].ranks[1];
        assert_eq!(
            (r1.rank, r1.breakdown.comm_wait_s, r1.memory.activations),
            (1, 0.07, 7)
        );
        assert_eq!(r1.memory.cuda_allocated_peak, Some(64));
        assert_eq!(steps[0].ranks[0].memory.cuda_allocated_peak, None);
        assert_eq!(steps[0].eval_loss, None);
    }

    #[test]
    fn old_lines_load_and_tokens_are_estimated() {
        let r = run(&format!("{OLD}\n"), None);
        assert!(r.steps[0].ranks.is_empty());
        assert_eq!(r.tokens(), Some((vec![20.0 * 1024.0], true)));
        assert!(r.breakdowns().is_empty());
        let r = run(&format!("{NEW}\n"), None);
        assert_eq!(r.tokens(), Some((vec![5120.0], false)));
    }

    #[test]
    fn a_bad_line_names_file_line_and_column() {
        let (res, _) = parse(&format!("{OLD}\n{{\"step\": 3, \"loss\": }}\n{OLD}\n"));
        let msg = res.unwrap_err().to_string();
        assert!(msg.starts_with("r/metrics.jsonl:2:"), "{msg}");
        assert!(!msg.contains("at line"), "{msg}");
        let (res, _) = parse(&format!("{OLD}\n{{\"step\": 3}}\n"));
        let e = res.unwrap_err();
        assert!(e.to_string().contains("missing field `loss`"), "{e}");
        assert!(e.to_string().contains("mend or delete the line"), "{e}");
        assert!(e.downcast_ref::<BadInput>().is_some());
    }

    #[test]
    fn a_null_loss_is_nan_not_an_error() {
        let (steps, _) = parse(&format!(
            "{}\n",
            OLD.replace("\"loss\":2.0", "\"loss\":null")
        ));
        assert!(steps.unwrap()[0].loss.is_nan());
    }

    #[test]
    fn an_unfinished_last_line_is_skipped_with_a_note() {
        let (steps, notes) = parse(&format!("{OLD}\n{}", &NEW[..40]));
        assert_eq!(steps.unwrap().len(), 1);
        assert_eq!(notes.len(), 1, "{notes:?}");
        let (steps, _) = parse("");
        assert!(steps.unwrap_err().to_string().contains("no logged steps"));
    }

    #[test]
    fn breakdown_prefers_the_summary_then_averages_the_lines() {
        let second = NEW.replace("\"data_s\":0.01", "\"data_s\":0.03");
        let r = run(&format!("{NEW}\n{second}\n"), None);
        let b = r.breakdowns();
        assert_eq!(b.len(), 2);
        assert!((b[0].1.data_s - 0.02).abs() < 1e-12, "{:?}", b[0]);
        // Nested, as first specified, and flattened with a stragglers list, as written now.
        let nested = r#"{"steps":20,"loss_floor":1.38,"ranks":[{"rank":0,"breakdown":{"step_time_s":1,"data_s":0.5,"forward_s":0,"backward_s":0,"comm_wait_s":0,"optimizer_s":0,"other_s":0.5},"memory":{},"straggler":true}],"stragglers":[0]}"#;
        let flat = r#"{"steps":20,"ranks":[{"rank":0,"step_time_s":1,"data_s":0.5,"forward_s":0,"backward_s":0,"comm_wait_s":0,"optimizer_s":0,"other_s":0.5,"memory":{"gathered":3}}],"stragglers":[0]}"#;
        let want = Breakdown {
            step_time_s: 1.0,
            data_s: 0.5,
            other_s: 0.5,
            ..Default::default()
        };
        for text in [nested, flat] {
            let r = run(
                &format!("{NEW}\n"),
                Some(serde_json::from_str(text).unwrap()),
            );
            assert_eq!(r.breakdowns(), vec![(0, want, true)], "{text}");
        }
        // A summary without breakdowns (older runs): the lines' means.
        let r = run(
            &format!("{NEW}\n"),
            Some(serde_json::from_str(r#"{"steps":1}"#).unwrap()),
        );
        assert_eq!(r.breakdowns().len(), 2);
    }

    #[test]
    fn same_named_runs_get_their_paths() {
        let mk = |d: &str| Run {
            name: "log".into(),
            dir: d.into(),
            steps: Vec::new(),
            summary: None,
        };
        let mut runs = vec![mk("a/log"), mk("b/log")];
        disambiguate(&mut runs);
        assert_eq!(
            (runs[0].name.as_str(), runs[1].name.as_str()),
            ("a/log", "b/log")
        );
    }
}
