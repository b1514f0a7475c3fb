//! `metrics.jsonl` (one JSON object per logged step) and `summary.json` in `log.dir`.

use crate::report::RankFigures;
use serde::Serialize;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// One logged step.
#[derive(Clone, Debug, Serialize)]
pub struct StepMetrics {
    /// Optimizer step, 1-based.
    pub step: u64,
    /// Mean training loss over the step's micro-batches.
    pub loss: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Global gradient norm before clipping.
    pub grad_norm: f64,
    /// Tokens of the global batch per second of this step.
    pub tokens_per_s: f64,
    /// Wall time of the step.
    pub step_time_s: f64,
    /// Model FLOPs utilisation, where a peak is known (`log.peak_tflops`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mfu: Option<f64>,
    /// fp16: the loss scale of this step.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub loss_scale: Option<f64>,
    /// fp16: the step was skipped because its gradients overflowed.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub skipped: bool,
    /// Model-state bytes the engine holds on this rank (parameters, gradients, master, optimizer).
    pub model_state_bytes: i64,
    /// Every byte the engine allocated on this rank, buffers included.
    pub engine_bytes: i64,
    /// Resident set size of this process now.
    pub rss_bytes: i64,
    /// Peak resident set size of this process so far.
    pub peak_rss_bytes: i64,
    /// Peak bytes allocated on this rank's CUDA device so far (on GPU only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cuda_peak_bytes: Option<i64>,
    /// CPU ranks with the caching CPU allocator: peak bytes its tensors held so far.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_allocated_peak_bytes: Option<i64>,
    /// CPU ranks with the caching CPU allocator: peak bytes it held from the system so far
    /// (tensors and its cache).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_reserved_peak_bytes: Option<i64>,
    /// Evaluation loss, on the steps that evaluated.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub eval_loss: Option<f64>,
    /// Training tokens consumed so far, over all ranks.
    pub tokens: u64,
    /// Sequences per rank per micro-step of this step (after any shrink).
    pub micro_batch: usize,
    /// Every rank's time breakdown (means over the steps since the previous line) and memory.
    pub ranks: Vec<RankFigures>,
}

/// A step that ran out of memory and was retried at a smaller micro-batch (`train.on_oom =
/// "shrink"`).
#[derive(Clone, Debug, Serialize)]
pub struct Shrink {
    /// The step (1-based).
    pub step: u64,
    /// The ranks whose allocation failed.
    pub ranks: Vec<usize>,
    /// Where each of them failed, e.g. "backward of unit h.3".
    pub phases: Vec<String>,
    /// Micro-batch and grad_accum before.
    pub from: (usize, usize),
    /// Micro-batch and grad_accum after.
    pub to: (usize, usize),
}

/// End-of-run figures.
#[derive(Clone, Debug, Serialize)]
pub struct Summary {
    /// Steps trained.
    pub steps: u64,
    /// Mean training loss of the last step.
    pub final_loss: f64,
    /// Final evaluation loss.
    pub eval_loss: f64,
    /// The data's exact loss floor, when known.
    pub loss_floor: Option<f64>,
    /// Median tokens per second over the steps after the first.
    pub tokens_per_s: f64,
    /// Peak resident set size of each rank, bytes.
    pub peak_rss_bytes: Vec<i64>,
    /// Resident set size of each rank before the model was built, bytes.
    pub base_rss_bytes: Vec<i64>,
    /// Each rank's peak as the estimator predicted it before the run (`zrun estimate`'s
    /// `peak_bytes`: on CPU to compare with peak_rss_bytes - base_rss_bytes).
    pub estimated_peak_bytes: Vec<i64>,
    /// The phase of rank 0's predicted peak.
    pub estimated_peak_phase: String,
    /// Peak bytes allocated on each rank's CUDA device (on GPU only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cuda_peak_bytes: Option<Vec<i64>>,
    /// Peak bytes the caching CPU allocator handed out on each rank since its start
    /// (`ZRUN_CPU_ALLOCATOR=caching` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_allocated_peak_bytes: Option<Vec<i64>>,
    /// Peak bytes the caching CPU allocator held from the system on each rank (blocks in use
    /// and cached; `ZRUN_CPU_ALLOCATOR=caching` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_reserved_peak_bytes: Option<Vec<i64>>,
    /// fp16 steps skipped for overflowed gradients.
    pub skipped_steps: u64,
    /// Model-state bytes of each rank as the engine counted them.
    pub model_state_bytes: Vec<i64>,
    /// Model parameters.
    pub params: i64,
    /// World size.
    pub world_size: usize,
    /// Wall time of the run, seconds.
    pub wall_time_s: f64,
    /// Every rank's time breakdown (means per step over the run, the first step excluded)
    /// and memory at the end.
    pub ranks: Vec<RankFigures>,
    /// Ranks whose busy time per step exceeds the median rank's by more than 20%.
    pub stragglers: Vec<usize>,
    /// Steps retried at a smaller micro-batch after an out-of-memory.
    pub shrinks: Vec<Shrink>,
}

/// Appends step metrics to `metrics.jsonl`, flushed line by line so a crash loses nothing.
pub struct MetricsWriter {
    out: BufWriter<File>,
    dir: PathBuf,
}

impl MetricsWriter {
    /// Creates `dir` and a fresh `dir/metrics.jsonl`.
    pub fn create(dir: &Path) -> std::io::Result<MetricsWriter> {
        std::fs::create_dir_all(dir)?;
        let out = BufWriter::new(File::create(dir.join("metrics.jsonl"))?);
        Ok(MetricsWriter {
            out,
            dir: dir.to_path_buf(),
        })
    }

    /// Opens `dir/metrics.jsonl` of a run resumed at `step`: keeps the lines of steps up to
    /// `step` (dropping those a stopped run logged after its checkpoint) and appends.
    pub fn resume(dir: &Path, step: u64) -> std::io::Result<MetricsWriter> {
        std::fs::create_dir_all(dir)?;
        let path = dir.join("metrics.jsonl");
        let old = match std::fs::read_to_string(&path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(e),
        };
        let kept: String = old
            .lines()
            .filter(|l| {
                serde_json::from_str::<serde_json::Value>(l)
                    .ok()
                    .and_then(|v| v["step"].as_u64())
                    .is_some_and(|s| s <= step)
            })
            .flat_map(|l| [l, "\n"])
            .collect();
        let tmp = dir.join("metrics.jsonl.tmp");
        std::fs::write(&tmp, kept)?;
        std::fs::rename(&tmp, &path)?;
        let f = std::fs::OpenOptions::new().append(true).open(&path)?;
        Ok(MetricsWriter {
            out: BufWriter::new(f),
            dir: dir.to_path_buf(),
        })
    }

    /// Writes one line.
    pub fn write(&mut self, m: &StepMetrics) -> std::io::Result<()> {
        serde_json::to_writer(&mut self.out, m)?;
        self.out.write_all(b"\n")?;
        self.out.flush()
    }

    /// Writes `summary.json` (to a temporary name, then renamed).
    pub fn summary(&self, s: &Summary) -> std::io::Result<PathBuf> {
        let path = self.dir.join("summary.json");
        let tmp = self.dir.join("summary.json.tmp");
        let written = std::fs::write(&tmp, serde_json::to_vec_pretty(s)?)
            .and_then(|()| std::fs::rename(&tmp, &path));
        if written.is_err() {
            let _ = std::fs::remove_file(&tmp);
        }
        written.map(|()| path)
    }
}

/// (current, peak) resident set size of this process in bytes, from /proc/self/status;
/// (0, 0) where that file does not exist.
pub fn rss_bytes() -> (i64, i64) {
    let Ok(text) = std::fs::read_to_string("/proc/self/status") else {
        return (0, 0);
    };
    let field = |name| kib_field(&text, name).unwrap_or(0);
    (field("VmRSS:"), field("VmHWM:"))
}

/// The `name` line of a `/proc` file whose figures are in kB (`/proc/self/status`,
/// `/proc/meminfo`), in bytes.
pub(crate) fn proc_bytes(file: &str, name: &str) -> Option<i64> {
    kib_field(&std::fs::read_to_string(file).ok()?, name)
}

/// The `name` line of `text` (`/proc` syntax: `VmRSS:   1234 kB`), in bytes.
fn kib_field(text: &str, name: &str) -> Option<i64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|r| r.trim().trim_end_matches("kB").trim().parse::<i64>().ok())
        .map(|kb| kb * 1024)
}

/// Peak bytes the CUDA caching allocator handed out on `device` (None on CPU).
pub fn cuda_peak_bytes(device: tch::Device) -> Option<i64> {
    match device {
        tch::Device::Cuda(i) => zrun_torch_ext::cuda_memory(i).map(|m| m.peak_allocated as i64),
        _ => None,
    }
}

/// Median of a non-empty slice (0 when empty).
pub fn median(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert_eq!(median(&[]), 0.0);
    }

    #[test]
    fn rss_is_read_and_peak_is_at_least_current() {
        let (now, peak) = rss_bytes();
        assert!(now > 0 && peak >= now, "{now} {peak}");
    }

    #[test]
    fn metrics_lines_and_summary_are_json() {
        let dir = std::env::temp_dir().join(format!("zrun-metrics-{}", std::process::id()));
        let mut w = MetricsWriter::create(&dir).unwrap();
        let m = StepMetrics {
            step: 1,
            loss: 2.5,
            lr: 1e-3,
            grad_norm: 0.5,
            tokens_per_s: 100.0,
            step_time_s: 0.1,
            mfu: None,
            loss_scale: None,
            skipped: false,
            model_state_bytes: 16,
            engine_bytes: 20,
            rss_bytes: 1,
            peak_rss_bytes: 2,
            cuda_peak_bytes: None,
            cpu_allocated_peak_bytes: None,
            cpu_reserved_peak_bytes: None,
            eval_loss: None,
            tokens: 64,
            micro_batch: 8,
            ranks: Vec::new(),
        };
        w.write(&m).unwrap();
        w.write(&StepMetrics {
            step: 2,
            eval_loss: Some(2.0),
            ..m.clone()
        })
        .unwrap();
        let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
        let lines: Vec<serde_json::Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0]["step"], 1);
        assert!(lines[0].get("eval_loss").is_none());
        assert_eq!(lines[1]["eval_loss"], 2.0);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
