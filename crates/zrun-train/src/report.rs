//! Every rank's figures side by side: where a step's time went (data, forward, backward,
//! communication that compute did not hide, optimizer, the rest), the memory it holds by
//! kind and the allocator's view, stragglers, and the memory table printed at the end.

use serde::{Deserialize, Serialize};
use tch::Device;
use zrun_comm::Communicator;
use zrun_shard::Engine;

use crate::metrics::rss_bytes;
use crate::reduce::gather_bytes;
use crate::Error;

/// Where one rank's step time went, seconds per step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Breakdown {
    /// The whole step (micro-steps and optimizer step).
    pub step_time_s: f64,
    /// Reading the micro-batches.
    pub data_s: f64,
    /// Forward, without waits for collectives.
    pub forward_s: f64,
    /// Backward, without waits for collectives.
    pub backward_s: f64,
    /// Waiting for collectives: communication that compute did not hide.
    pub comm_wait_s: f64,
    /// The optimizer step, without waits.
    pub optimizer_s: f64,
    /// The rest: the step time minus the parts above.
    pub other_s: f64,
}

impl Breakdown {
    /// The step's parts as an array, in field order.
    fn to_array(self) -> [f64; 7] {
        [
            self.step_time_s,
            self.data_s,
            self.forward_s,
            self.backward_s,
            self.comm_wait_s,
            self.optimizer_s,
            self.other_s,
        ]
    }

    fn from_array(a: &[f64]) -> Breakdown {
        Breakdown {
            step_time_s: a[0],
            data_s: a[1],
            forward_s: a[2],
            backward_s: a[3],
            comm_wait_s: a[4],
            optimizer_s: a[5],
            other_s: a[6],
        }
    }

    /// The time the rank was busy, not waiting for the others.
    pub fn busy_s(&self) -> f64 {
        self.step_time_s - self.comm_wait_s
    }

    /// The parts of the step in stacking order, with their chart labels.
    pub fn phases(&self) -> [(&'static str, f64); 6] {
        [
            ("data", self.data_s),
            ("forward", self.forward_s),
            ("backward", self.backward_s),
            ("comm wait", self.comm_wait_s),
            ("optimizer", self.optimizer_s),
            ("other", self.other_s),
        ]
    }
}

/// Sums of breakdowns, for means over steps.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct Sum {
    total: [f64; 7],
    steps: u64,
}

impl Sum {
    /// Adds a step.
    pub(crate) fn add(&mut self, b: Breakdown) {
        for (t, x) in self.total.iter_mut().zip(b.to_array()) {
            *t += x;
        }
        self.steps += 1;
    }

    /// The mean per step (zeros when empty).
    pub(crate) fn mean(&self) -> Breakdown {
        let n = self.steps.max(1) as f64;
        Breakdown::from_array(&self.total.map(|t| t / n))
    }
}

/// Bytes a rank holds, by kind, and the allocator's view (figures an older run did not
/// record read as 0 or absent).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct MemoryByKind {
    /// Compute-dtype parameters resident (full or shard).
    pub params: i64,
    /// Gradient buffers.
    pub grads: i64,
    /// fp32 master weights, where separate from the parameters.
    pub master: i64,
    /// AdamW m and v on the compute device.
    pub optimizer: i64,
    /// fp32 master and AdamW state offloaded to host memory.
    pub host: i64,
    /// Buffers at their peak: gathered units, communication and optimizer scratch.
    pub buffers: i64,
    /// Of `buffers`: gathered unit parameters at their peak (stage 3).
    pub gathered: i64,
    /// Activations and temporaries at their peak: the allocator's peak less what the engine
    /// holds (on CPU the peak RSS above the RSS before the model was built).
    pub activations: i64,
    /// Resident set size now.
    pub rss: i64,
    /// Peak resident set size.
    pub rss_peak: i64,
    /// CUDA: peak bytes held by tensors (`max_memory_allocated`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cuda_allocated_peak: Option<i64>,
    /// CUDA: peak bytes reserved by the caching allocator (`max_memory_reserved`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cuda_reserved_peak: Option<i64>,
    /// CUDA: reserved but not allocated now (fragmentation and cache).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cuda_reserved_unallocated: Option<i64>,
    /// CPU ranks with the caching CPU allocator: peak bytes held by tensors.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_allocated_peak: Option<i64>,
    /// CPU ranks with the caching CPU allocator: peak bytes it held from the system.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_reserved_peak: Option<i64>,
}

impl MemoryByKind {
    /// This rank's figures now; `base_rss` is the RSS before the model was built.
    pub fn of(engine: &Engine, base_rss: i64) -> MemoryByKind {
        let m = engine.memory();
        let (rss, rss_peak) = rss_bytes();
        let cuda = match engine.config().device {
            Device::Cuda(i) => zrun_torch_ext::cuda_memory(i),
            _ => None,
        };
        let cpu =
            zrun_torch_ext::cpu_memory_stats().filter(|_| engine.config().device == Device::Cpu);
        let held = m.total();
        let activations = match cuda {
            Some(c) => c.peak_allocated as i64 - held,
            None => rss_peak - base_rss - held,
        };
        MemoryByKind {
            params: m.params,
            grads: m.grads,
            master: m.master,
            optimizer: m.optimizer,
            host: m.host,
            buffers: m.buffers,
            gathered: engine.gathered_peak(),
            activations: activations.max(0),
            rss,
            rss_peak,
            cuda_allocated_peak: cuda.map(|c| c.peak_allocated as i64),
            cuda_reserved_peak: cuda.map(|c| c.peak_reserved as i64),
            cuda_reserved_unallocated: cuda.map(|c| c.reserved as i64 - c.allocated as i64),
            cpu_allocated_peak: cpu.map(|c| c.peak_allocated as i64),
            cpu_reserved_peak: cpu.map(|c| c.peak_reserved as i64),
        }
    }

    /// The figures as numbers (absent CUDA and CPU-allocator figures as -1), in field order.
    fn to_array(self) -> [i64; 15] {
        let o = |x: Option<i64>| x.unwrap_or(-1);
        [
            self.params,
            self.grads,
            self.master,
            self.optimizer,
            self.host,
            self.buffers,
            self.gathered,
            self.activations,
            self.rss,
            self.rss_peak,
            o(self.cuda_allocated_peak),
            o(self.cuda_reserved_peak),
            o(self.cuda_reserved_unallocated),
            o(self.cpu_allocated_peak),
            o(self.cpu_reserved_peak),
        ]
    }

    fn from_array(a: &[i64]) -> MemoryByKind {
        let o = |x: i64| (x >= 0).then_some(x);
        MemoryByKind {
            params: a[0],
            grads: a[1],
            master: a[2],
            optimizer: a[3],
            host: a[4],
            buffers: a[5],
            gathered: a[6],
            activations: a[7],
            rss: a[8],
            rss_peak: a[9],
            cuda_allocated_peak: o(a[10]),
            cuda_reserved_peak: o(a[11]),
            cuda_reserved_unallocated: o(a[12]),
            cpu_allocated_peak: o(a[13]),
            cpu_reserved_peak: o(a[14]),
        }
    }
}

/// One rank's figures.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct RankFigures {
    /// The rank.
    pub rank: usize,
    /// Where its step time went.
    #[serde(flatten)]
    pub time: Breakdown,
    /// What it holds.
    pub memory: MemoryByKind,
}

/// Every rank's `mine`, in rank order (every rank calls; exact: bytes are gathered).
pub(crate) fn gather(
    comm: &dyn Communicator,
    device: Device,
    mine: &RankFigures,
) -> Result<Vec<RankFigures>, Error> {
    let mut bytes = Vec::with_capacity(22 * 8);
    for x in mine.time.to_array() {
        bytes.extend(x.to_le_bytes());
    }
    for x in mine.memory.to_array() {
        bytes.extend(x.to_le_bytes());
    }
    let all = gather_bytes(comm, device, &bytes)?;
    Ok(all
        .iter()
        .enumerate()
        .map(|(rank, b)| {
            let word = |i: usize| <[u8; 8]>::try_from(&b[8 * i..8 * i + 8]).unwrap_or_default();
            let t: Vec<f64> = (0..7).map(|i| f64::from_le_bytes(word(i))).collect();
            let m: Vec<i64> = (7..22).map(|i| i64::from_le_bytes(word(i))).collect();
            RankFigures {
                rank,
                time: Breakdown::from_array(&t),
                memory: MemoryByKind::from_array(&m),
            }
        })
        .collect())
}

/// The ranks whose busy time per step (the step less its waits for the others) exceeds the
/// median rank's by more than 20%: in synchronous training every rank's step takes as long
/// as the slowest's, so the straggler shows in what it does, not in its step time.
pub fn stragglers(ranks: &[RankFigures]) -> Vec<usize> {
    let busy: Vec<f64> = ranks.iter().map(|r| r.time.busy_s()).collect();
    let median = crate::metrics::median(&busy);
    ranks
        .iter()
        .filter(|r| ranks.len() > 1 && r.time.busy_s() > 1.2 * median)
        .map(|r| r.rank)
        .collect()
}

/// The memory table printed at the end of a run: one row per kind, one column per rank.
pub fn memory_table(ranks: &[RankFigures]) -> String {
    let mib = |b: i64| format!("{:.1}", b as f64 / (1 << 20) as f64);
    type Get = fn(&MemoryByKind) -> Option<i64>;
    let rows: [(&str, Get); 14] = [
        ("parameters", |m| Some(m.params)),
        ("gradients", |m| Some(m.grads)),
        ("fp32 master", |m| Some(m.master)),
        ("AdamW state", |m| Some(m.optimizer)),
        ("host (offloaded)", |m| Some(m.host)),
        ("buffers (peak)", |m| Some(m.buffers)),
        ("  gathered units", |m| Some(m.gathered)),
        ("activations (peak)", |m| Some(m.activations)),
        ("RSS peak", |m| Some(m.rss_peak)),
        ("CUDA allocated peak", |m| m.cuda_allocated_peak),
        ("CUDA reserved peak", |m| m.cuda_reserved_peak),
        ("CUDA reserved, unused", |m| m.cuda_reserved_unallocated),
        ("CPU allocated peak", |m| m.cpu_allocated_peak),
        ("CPU reserved peak", |m| m.cpu_reserved_peak),
    ];
    let mut out = format!("{:<22}", "memory (MiB)");
    for r in ranks {
        out.push_str(&format!(" {:>10}", format!("rank {}", r.rank)));
    }
    for (name, get) in &rows {
        if ranks.iter().all(|r| get(&r.memory).is_none()) {
            continue;
        }
        out.push('\n');
        out.push_str(&format!("{name:<22}"));
        for r in ranks {
            out.push_str(&format!(" {:>10}", get(&r.memory).map_or("-".into(), mib)));
        }
    }
    out
}

/// The step-time table printed at the end of a run: one row per rank, ms per step.
pub fn time_table(ranks: &[RankFigures]) -> String {
    let mut out = format!(
        "{:<8} {:>9} {:>8} {:>9} {:>9} {:>10} {:>10} {:>8}",
        "ms/step", "step", "data", "forward", "backward", "comm wait", "optimizer", "other"
    );
    for r in ranks {
        let t = r.time;
        let ms = |s: f64| format!("{:.1}", 1e3 * s);
        out.push_str(&format!(
            "\n{:<8} {:>9} {:>8} {:>9} {:>9} {:>10} {:>10} {:>8}",
            format!("rank {}", r.rank),
            ms(t.step_time_s),
            ms(t.data_s),
            ms(t.forward_s),
            ms(t.backward_s),
            ms(t.comm_wait_s),
            ms(t.optimizer_s),
            ms(t.other_s)
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn figures(rank: usize, step: f64, wait: f64) -> RankFigures {
        RankFigures {
            rank,
            time: Breakdown {
                step_time_s: step,
                comm_wait_s: wait,
                ..Breakdown::default()
            },
            memory: MemoryByKind {
                params: 3 << 20,
                cuda_allocated_peak: (rank == 1).then_some(5 << 20),
                cpu_reserved_peak: (rank == 0).then_some(7 << 20),
                ..MemoryByKind::default()
            },
        }
    }

    #[test]
    fn the_rank_busy_far_longer_than_the_median_is_the_straggler() {
        // Every step takes 1 s; rank 2 computes for 0.9 s, the others wait 0.5 s of it.
        let ranks = [
            figures(0, 1.0, 0.5),
            figures(1, 1.0, 0.45),
            figures(2, 1.0, 0.1),
        ];
        assert_eq!(stragglers(&ranks), vec![2]);
        let even = [figures(0, 1.0, 0.2), figures(1, 1.0, 0.25)];
        assert!(stragglers(&even).is_empty());
        assert!(stragglers(&ranks[..1]).is_empty());
    }

    #[test]
    fn figures_survive_the_byte_encoding_and_the_table_shows_every_rank() {
        let r = figures(1, 0.25, 0.125);
        assert_eq!(Breakdown::from_array(&r.time.to_array()), r.time);
        assert_eq!(MemoryByKind::from_array(&r.memory.to_array()), r.memory);
        let t = memory_table(&[figures(0, 1.0, 0.0), r]);
        assert!(t.contains("rank 0") && t.contains("rank 1"), "{t}");
        assert!(t.contains("parameters") && t.contains("3.0"), "{t}");
        // A CUDA row appears when any rank has the figure, with "-" for the others.
        assert!(t.contains("CUDA allocated peak") && t.contains('-'), "{t}");
        assert!(!t.contains("CUDA reserved peak"), "{t}");
        assert!(t.contains("CPU reserved peak") && t.contains("7.0"), "{t}");
        assert!(!t.contains("CPU allocated peak"), "{t}");
        let t = time_table(&[figures(0, 0.5, 0.25)]);
        assert!(
            t.contains("rank 0") && t.contains("500.0") && t.contains("250.0"),
            "{t}"
        );
        let mut s = Sum::default();
        s.add(Breakdown {
            step_time_s: 1.0,
            ..Default::default()
        });
        s.add(Breakdown {
            step_time_s: 3.0,
            ..Default::default()
        });
        assert_eq!(s.mean().step_time_s, 2.0);
    }
}
