//! Link classes and the collective cost model `t = alpha + bytes x f / busbw`, the hardware
//! a rank runs on, and the cluster file's link tables (`zrun bench comm --save` writes
//! them, `zrun plan --cluster` reads them; docs/cluster.md gives the format).

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};

use crate::config::{toml_error, ConfigError};

/// A collective's cost on one link class: `t = alpha_s + bytes x f / busbw`
/// (nccl-tests' PERFORMANCE.md: busbw is the bandwidth the busiest link sees).
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Link {
    /// Latency of one collective, seconds.
    pub alpha_s: f64,
    /// Bus bandwidth, bytes per second.
    pub busbw: f64,
}

impl Link {
    /// Seconds to move `bytes` (the full tensor) with bus factor `factor`:
    /// `alpha + bytes x factor / busbw`.
    pub fn time(&self, bytes: f64, factor: f64) -> f64 {
        self.alpha_s + bytes * factor / self.busbw
    }

    /// Least squares fit of `t = alpha + x / busbw` to rows `(x, t)`, x = bytes x f:
    /// slope `s = sum (x - mx)(t - mt) / sum (x - mx)^2`, `alpha = mt - s mx`, `busbw = 1/s`.
    /// A negative intercept (noise at small sizes) becomes 0 with the slope refitted through
    /// the origin (`s = sum x t / sum x^2`); with one distinct x, `alpha = 0` and
    /// `busbw = sum x / sum t`. `None` without rows or when the slope is not positive.
    pub fn fit(rows: &[(f64, f64)]) -> Option<Link> {
        let n = rows.len() as f64;
        if rows.is_empty() {
            return None;
        }
        let (mx, mt) = (
            rows.iter().map(|r| r.0).sum::<f64>() / n,
            rows.iter().map(|r| r.1).sum::<f64>() / n,
        );
        let sxx: f64 = rows.iter().map(|r| (r.0 - mx).powi(2)).sum();
        let sxt: f64 = rows.iter().map(|r| (r.0 - mx) * (r.1 - mt)).sum();
        let through_origin = || {
            let s = rows.iter().map(|r| r.0 * r.1).sum::<f64>()
                / rows.iter().map(|r| r.0 * r.0).sum::<f64>();
            (s > 0.0 && s.is_finite()).then(|| Link {
                alpha_s: 0.0,
                busbw: 1.0 / s,
            })
        };
        if sxx <= f64::EPSILON * mx * mx {
            return through_origin();
        }
        let s = sxt / sxx;
        let alpha = mt - s * mx;
        if !(s > 0.0 && s.is_finite()) {
            return None;
        }
        if alpha < 0.0 {
            return through_origin();
        }
        Some(Link {
            alpha_s: alpha,
            busbw: 1.0 / s,
        })
    }
}

/// A collective.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Op {
    /// All-gather.
    AllGather,
    /// Reduce-scatter.
    ReduceScatter,
    /// All-reduce.
    AllReduce,
}

impl Op {
    /// nccl-tests' bus factor over `n` ranks: `(n-1)/n` for all-gather and reduce-scatter,
    /// `2(n-1)/n` for all-reduce.
    pub fn factor(self, n: usize) -> f64 {
        let n = n.max(1) as f64;
        match self {
            Op::AllGather | Op::ReduceScatter => (n - 1.0) / n,
            Op::AllReduce => 2.0 * (n - 1.0) / n,
        }
    }

    /// The name `zrun bench comm` prints and the cluster file's key.
    pub fn name(self) -> &'static str {
        match self {
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::AllReduce => "all_reduce",
        }
    }
}

fn one() -> usize {
    1
}

/// One link class (`[intra]`: ranks of one node; `[inter]`: rings spanning nodes), as
/// `zrun bench comm --save` writes it: a [`Link`] per collective and how it was measured.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LinkClass {
    /// All-gather.
    pub all_gather: Link,
    /// Reduce-scatter.
    pub reduce_scatter: Link,
    /// All-reduce.
    pub all_reduce: Link,
    /// `[inter]`: ranks on each node in the measured rings: one rail carries
    /// `busbw / min(this, rails)` ([`Hardware::link`]).
    #[serde(default = "one")]
    pub ranks_per_node: usize,
    /// `[inter]`: independent inter-node links per node that a ring's channels spread over
    /// (1 for one network link per node; 8 on an H100 node with a NIC per GPU).
    #[serde(default = "one")]
    pub rails: usize,
    /// Ranks in the measurement (informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranks: Option<usize>,
    /// Backend of the measurement (informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub backend: Option<String>,
    /// Element type of the measurement (informational).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dtype: Option<String>,
}

impl LinkClass {
    /// The same alpha and busbw for every collective.
    pub fn uniform(alpha_s: f64, busbw: f64) -> LinkClass {
        let l = Link { alpha_s, busbw };
        LinkClass {
            all_gather: l,
            reduce_scatter: l,
            all_reduce: l,
            ranks_per_node: 1,
            rails: 1,
            ranks: None,
            backend: None,
            dtype: None,
        }
    }

    /// The link of `op`.
    pub fn op(&self, op: Op) -> Link {
        match op {
            Op::AllGather => self.all_gather,
            Op::ReduceScatter => self.reduce_scatter,
            Op::AllReduce => self.all_reduce,
        }
    }
}

/// What a rank runs on.
#[derive(Clone, Debug)]
pub struct Hardware {
    /// Ranks per node (L).
    pub ranks_per_node: usize,
    /// FLOP/s a rank achieves in the step's kernels (X).
    pub flops: f64,
    /// Peak FLOP/s of a rank, for MFU.
    pub peak_flops: f64,
    /// Collectives among the ranks of one node.
    pub intra: Option<LinkClass>,
    /// Collectives spanning nodes.
    pub inter: Option<LinkClass>,
    /// Bytes per second the device's AdamW streams.
    pub device_bytes_per_s: f64,
    /// Parameters per second the host AdamW updates for one rank (the node's rate / L).
    pub host_adam_params_per_s: f64,
    /// Bytes per second between a rank's device and the host, each way.
    pub host_link_bytes_per_s: f64,
}

/// A communication group: `n` ranks, `per_node` of them on each node it spans.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Group {
    /// Ranks.
    pub n: usize,
    /// Ranks of the group on each of its nodes.
    pub per_node: usize,
    /// Whether it spans more than one node.
    pub spans: bool,
}

impl Hardware {
    /// The link of `op` in `g`: the intra class within a node; across nodes the inter class
    /// with its busbw scaled to the group: one rail carries `b1 = busbw / min(k_meas, rails)`
    /// (the measurement's rings had k_meas ranks per node), a ring with k = `g.per_node`
    /// ranks per node spreads over k rails, and every rank of a node (L) runs its group's
    /// collective at once, so the node's rails are shared by L/k groups:
    /// `busbw_g = b1 x k x min(1, rails / L)`, capped at the intra busbw (a ring spanning
    /// nodes also crosses the intra links).
    pub fn link(&self, op: Op, g: Group) -> Result<Link, ConfigError> {
        let intra = self.intra.as_ref().map(|c| c.op(op));
        if !g.spans {
            return intra.ok_or_else(|| missing("intra", g));
        }
        let c = self.inter.as_ref().ok_or_else(|| missing("inter", g))?;
        let rails = c.rails.max(1) as f64;
        let local = self.ranks_per_node.max(1) as f64;
        let b1 = 1.0 / c.ranks_per_node.clamp(1, c.rails.max(1)) as f64;
        let scale = b1 * g.per_node.max(1) as f64 * (rails / local).min(1.0);
        let mut l = c.op(op);
        l.busbw *= scale;
        if let Some(i) = intra {
            l.busbw = l.busbw.min(i.busbw);
        }
        Ok(l)
    }

    /// Seconds of `op` over `g` on `bytes` (the full tensor): 0 for one rank, else
    /// `alpha + bytes x f(op, n) / busbw` on [`Hardware::link`].
    pub fn collective(&self, op: Op, g: Group, bytes: f64) -> Result<f64, ConfigError> {
        if g.n <= 1 {
            return Ok(0.0);
        }
        Ok(self.link(op, g)?.time(bytes, op.factor(g.n)))
    }
}

fn missing(class: &str, g: Group) -> ConfigError {
    ConfigError(format!(
        "the cluster has no [{class}] link class, needed by a collective over {} ranks: measure it with `zrun bench comm --save FILE` ({}) or declare it (docs/cluster.md)",
        g.n,
        if class == "inter" { "on two nodes" } else { "on one node" }
    ))
}

/// `text`, a TOML document, as a `T`; `what` names it in the error (the launcher reads
/// cluster files through this).
pub fn from_toml<T: DeserializeOwned>(text: &str, what: &str) -> Result<T, ConfigError> {
    toml::from_str(text).map_err(|e| ConfigError(format!("{what}: {}", toml_error(text, &e))))
}

/// The cluster file `text` (empty for a new one) with table `class` (`intra` or `inter`)
/// holding `links`: the measured keys replaced, a `rails` already there and every other
/// table and key kept. Comments are not kept.
pub fn merge_link_class(text: &str, class: &str, links: &LinkClass) -> Result<String, ConfigError> {
    let what = |e: &dyn std::fmt::Display| ConfigError(format!("[{class}]: {e}"));
    let mut doc: toml::Table =
        toml::from_str(text).map_err(|e| ConfigError(toml_error(text, &e)))?;
    let new = toml::Table::try_from(links).map_err(|e| what(&e))?;
    let entry = doc
        .entry(class.to_string())
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    let toml::Value::Table(t) = entry else {
        return Err(ConfigError(format!(
            "`{class}` in the cluster file is not a table: remove it or make it [{class}]"
        )));
    };
    for (k, v) in new {
        if !(k == "rails" && t.contains_key("rails")) {
            t.insert(k, v);
        }
    }
    toml::to_string(&doc).map_err(|e| what(&e))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bus_factors_are_nccl_tests_and_one_rank_costs_nothing() {
        assert_eq!(Op::AllGather.factor(4), 0.75);
        assert_eq!(Op::ReduceScatter.factor(8), 0.875);
        assert_eq!(Op::AllReduce.factor(4), 1.5);
        assert_eq!(Op::AllReduce.factor(1), 0.0);
        let l = Link {
            alpha_s: 1e-5,
            busbw: 1e9,
        };
        // 1 GB over 4 ranks: 10 us + 1e9 x 1.5 / 1e9 s
        assert!((l.time(1e9, Op::AllReduce.factor(4)) - 1.50001).abs() < 1e-12);
        let hw = Hardware {
            ranks_per_node: 8,
            flops: 1.0,
            peak_flops: 1.0,
            intra: None,
            inter: None,
            device_bytes_per_s: 1.0,
            host_adam_params_per_s: 1.0,
            host_link_bytes_per_s: 1.0,
        };
        let solo = Group {
            n: 1,
            per_node: 1,
            spans: false,
        };
        assert_eq!(hw.collective(Op::AllReduce, solo, 1e9).unwrap(), 0.0);
        let pair = Group { n: 2, ..solo };
        let e = hw.collective(Op::AllReduce, pair, 1.0).unwrap_err().0;
        assert!(
            e.contains("[intra]") && e.contains("bench comm --save"),
            "{e}"
        );
    }

    #[test]
    fn least_squares_recovers_alpha_and_busbw() {
        // t = 50 us + x / 2 GB/s
        let rows: Vec<(f64, f64)> = [1e6, 16e6, 64e6]
            .iter()
            .map(|&x| (x, 5e-5 + x / 2e9))
            .collect();
        let l = Link::fit(&rows).unwrap();
        assert!((l.alpha_s - 5e-5).abs() < 1e-12, "{l:?}");
        assert!((l.busbw / 2e9 - 1.0).abs() < 1e-9, "{l:?}");
        // A negative intercept is clamped and the slope refitted through the origin.
        let l = Link::fit(&[(1e6, 0.4e-3), (2e6, 1.0e-3)]).unwrap();
        assert_eq!(l.alpha_s, 0.0);
        let s = (1e6 * 0.4e-3 + 2e6 * 1.0e-3) / (1e12 + 4e12);
        assert!((l.busbw - 1.0 / s).abs() / l.busbw < 1e-12, "{l:?}");
        // One size: through the origin.
        let l = Link::fit(&[(1e6, 1e-3), (1e6, 1e-3)]).unwrap();
        assert!((l.busbw - 1e9).abs() < 1e-3 && l.alpha_s == 0.0, "{l:?}");
        assert!(Link::fit(&[]).is_none());
        assert!(
            Link::fit(&[(1e6, 2e-3), (2e6, 1e-3)]).is_none(),
            "falling time"
        );
    }

    /// Measured with 8 ranks per node over 8 rails (one NIC per GPU): a ring with one rank
    /// per node gets an eighth of the busbw, one with 8 gets it all, capped at the intra
    /// busbw.
    #[test]
    fn inter_busbw_scales_with_the_rails_a_ring_uses() {
        let mut inter = LinkClass::uniform(4e-5, 400e9);
        (inter.ranks_per_node, inter.rails) = (8, 8);
        let mut hw = Hardware {
            ranks_per_node: 8,
            flops: 1.0,
            peak_flops: 1.0,
            intra: Some(LinkClass::uniform(1.5e-5, 360e9)),
            inter: Some(inter),
            device_bytes_per_s: 1.0,
            host_adam_params_per_s: 1.0,
            host_link_bytes_per_s: 1.0,
        };
        let g = |per_node| Group {
            n: 16,
            per_node,
            spans: true,
        };
        assert_eq!(hw.link(Op::AllReduce, g(1)).unwrap().busbw, 50e9);
        assert_eq!(hw.link(Op::AllReduce, g(4)).unwrap().busbw, 200e9);
        assert_eq!(hw.link(Op::AllReduce, g(8)).unwrap().busbw, 360e9);
        assert_eq!(hw.link(Op::AllGather, g(8)).unwrap().alpha_s, 4e-5);
        let local = Group {
            n: 8,
            per_node: 8,
            spans: false,
        };
        assert_eq!(hw.link(Op::AllGather, local).unwrap().alpha_s, 1.5e-5);
        // One rail (a node's single link) carries every ring of the node: the 8 replica
        // rings of one rank per node share it; a ring with all 8 ranks has it alone.
        hw.inter.as_mut().unwrap().rails = 1;
        assert_eq!(hw.link(Op::AllReduce, g(1)).unwrap().busbw, 50e9);
        assert_eq!(hw.link(Op::AllReduce, g(8)).unwrap().busbw, 360e9);
        hw.intra = None;
        assert_eq!(hw.link(Op::AllReduce, g(8)).unwrap().busbw, 400e9);
    }

    #[test]
    fn merging_a_class_keeps_the_rest_of_the_file() {
        let file = "[cluster]\nflops = 1e12\n\n[inter]\nrails = 8\n";
        let mut m = LinkClass::uniform(1e-4, 1e9);
        (m.ranks_per_node, m.ranks, m.backend) = (2, Some(4), Some("tcp".into()));
        let text = merge_link_class(file, "inter", &m).unwrap();
        let text = merge_link_class(&text, "intra", &LinkClass::uniform(2e-5, 5e9)).unwrap();
        #[derive(Deserialize)]
        struct F {
            cluster: toml::Table,
            intra: LinkClass,
            inter: LinkClass,
        }
        let f: F = from_toml(&text, "merged").unwrap();
        assert_eq!(f.cluster["flops"].as_float(), Some(1e12));
        assert_eq!(f.inter.rails, 8, "an existing rails stays");
        assert_eq!((f.inter.ranks_per_node, f.inter.ranks), (2, Some(4)));
        assert_eq!(f.inter.all_gather, m.all_gather);
        assert_eq!(f.intra.reduce_scatter.busbw, 5e9);
        let e = merge_link_class("inter = 3\n", "inter", &m).unwrap_err().0;
        assert!(e.contains("not a table"), "{e}");
    }
}
