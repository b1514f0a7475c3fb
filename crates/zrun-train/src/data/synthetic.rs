//! A seeded sparse Markov chain over the vocabulary with a known entropy rate.
//!
//! Each state has `branching` distinct successors with skewed seeded probabilities; one of
//! them follows a seeded random cycle through all states, so the chain is irreducible and
//! its stationary distribution pi is unique. A sample starts in a state drawn from pi, so
//! every position is distributed as pi, and the best possible next-token loss is exactly the
//! entropy rate `H = sum_s pi_s H(P_s)`.

use std::collections::HashSet;

use super::rng::{shuffle, Rng};
use super::{DataError, Split};

/// The largest transition table (`vocab_size * branching` entries) the chain builds.
pub(crate) const MAX_TRANSITIONS: usize = 1 << 26;
/// Power-iteration stopping rule: L1 norm of `pi P - pi`.
const TOLERANCE: f64 = 1e-12;
/// Power-iteration budget before giving up.
const MAX_ITERATIONS: usize = 100_000;
/// Salts that separate the seed's uses.
const SALT_CHAIN: u64 = 0x636861696e; // "chain"
const SALT_TRAIN: u64 = 0x747261696e; // "train"
const SALT_EVAL: u64 = 0x6576616c; // "eval"

/// The chain: per state, `branching` successors and their cumulative probabilities.
#[derive(Debug)]
pub(crate) struct MarkovChain {
    vocab_size: usize,
    branching: usize,
    seed: u64,
    /// (V, b) successor states, row-major.
    succ: Vec<u32>,
    /// (V, b) cumulative probabilities; the last of each row is exactly 1.
    cum: Vec<f64>,
    /// Cumulative stationary distribution; the last entry is exactly 1.
    pi_cum: Vec<f64>,
    entropy_rate: f64,
}

impl MarkovChain {
    /// Builds the chain of `seed`, its stationary distribution and its entropy rate.
    pub(crate) fn build(
        vocab_size: usize,
        branching: usize,
        seed: u64,
    ) -> Result<MarkovChain, DataError> {
        let v = vocab_size;
        let b = branching;
        if b == 0 || b > v || v.saturating_mul(b) > MAX_TRANSITIONS {
            return Err(DataError::Branching {
                branching: b,
                vocab_size: v,
                max_transitions: MAX_TRANSITIONS,
            });
        }
        let mut rng = Rng::from_words(&[seed, SALT_CHAIN]);
        // A random cycle through every state makes the chain irreducible.
        let mut cycle: Vec<u32> = (0..v as u32).collect();
        shuffle(&mut cycle, &mut rng);
        let mut next_on_cycle = vec![0u32; v];
        for i in 0..v {
            next_on_cycle[cycle[i] as usize] = cycle[(i + 1) % v];
        }
        let mut succ = Vec::with_capacity(v * b);
        let mut prob = Vec::with_capacity(v * b);
        let mut cum = Vec::with_capacity(v * b);
        let mut row = Vec::with_capacity(b);
        let mut scratch: Vec<u32> = Vec::new();
        for &first in &next_on_cycle {
            distinct_successors(first, v, b, &mut rng, &mut row, &mut scratch);
            // Squared Exp(1) weights: more skewed than a flat Dirichlet, so the floor sits
            // well below ln(branching).
            let weights: Vec<f64> = (0..b).map(|_| (-rng.next_open01().ln()).powi(2)).collect();
            let total: f64 = weights.iter().sum();
            let mut acc = 0.0;
            for (i, (&s, w)) in row.iter().zip(&weights).enumerate() {
                let p = w / total;
                acc += p;
                succ.push(s);
                prob.push(p);
                cum.push(if i + 1 == b { 1.0 } else { acc });
            }
        }
        let (pi, iterations, residual) = stationary(v, b, &succ, &prob);
        if residual > TOLERANCE {
            return Err(DataError::NotConverged {
                vocab_size: v,
                branching: b,
                iterations,
                residual,
            });
        }
        let entropy_rate = pi
            .iter()
            .zip(prob.chunks_exact(b))
            .map(|(&p_s, row)| {
                p_s * row
                    .iter()
                    .filter(|&&p| p > 0.0)
                    .map(|&p| -p * p.ln())
                    .sum::<f64>()
            })
            .sum();
        let mut acc = 0.0;
        let mut pi_cum: Vec<f64> = pi
            .iter()
            .map(|&p| {
                acc += p;
                acc
            })
            .collect();
        if let Some(last) = pi_cum.last_mut() {
            *last = 1.0;
        }
        Ok(MarkovChain {
            vocab_size: v,
            branching: b,
            seed,
            succ,
            cum,
            pi_cum,
            entropy_rate,
        })
    }

    /// Entropy rate in nats/token: the exact loss floor of next-token prediction.
    pub(crate) fn entropy_rate(&self) -> f64 {
        self.entropy_rate
    }

    /// Successors per state.
    pub(crate) fn branching(&self) -> usize {
        self.branching
    }

    /// Appends sample `k` of `split` to `out`: a start state drawn from pi, then `seq_len`
    /// steps of the chain (T + 1 tokens).
    pub(crate) fn walk(&self, split: Split, k: u64, seq_len: usize, out: &mut Vec<i64>) {
        let salt = match split {
            Split::Train => SALT_TRAIN,
            Split::Eval => SALT_EVAL,
        };
        let mut rng = Rng::from_words(&[self.seed, salt, k]);
        let u = rng.next_open01();
        let mut s = self
            .pi_cum
            .partition_point(|&c| c <= u)
            .min(self.vocab_size - 1);
        out.push(s as i64);
        let b = self.branching;
        for _ in 0..seq_len {
            let u = rng.next_open01();
            let row = &self.cum[s * b..(s + 1) * b];
            let j = row.partition_point(|&c| c <= u).min(b - 1);
            s = self.succ[s * b + j] as usize;
            out.push(s as i64);
        }
    }
}

/// Fills `row` with `first` followed by `b - 1` other distinct states drawn uniformly.
fn distinct_successors(
    first: u32,
    v: usize,
    b: usize,
    rng: &mut Rng,
    row: &mut Vec<u32>,
    scratch: &mut Vec<u32>,
) {
    row.clear();
    row.push(first);
    if 2 * b <= v {
        // Sparse: rejection sampling needs fewer than two draws per successor.
        let mut seen: HashSet<u32> = HashSet::with_capacity(2 * b);
        seen.insert(first);
        while row.len() < b {
            let s = rng.below(v as u64) as u32;
            if seen.insert(s) {
                row.push(s);
            }
        }
    } else {
        // Dense: partial Fisher-Yates over the other states.
        scratch.clear();
        scratch.extend((0..v as u32).filter(|&s| s != first));
        for i in 0..b - 1 {
            let j = i + rng.below((scratch.len() - i) as u64) as usize;
            scratch.swap(i, j);
            row.push(scratch[i]);
        }
    }
}

/// `pi P` for a row-major sparse transition table.
fn step(pi: &[f64], b: usize, succ: &[u32], prob: &[f64], out: &mut [f64]) {
    out.iter_mut().for_each(|x| *x = 0.0);
    for (s, &p_s) in pi.iter().enumerate() {
        for j in s * b..(s + 1) * b {
            out[succ[j] as usize] += p_s * prob[j];
        }
    }
}

/// Stationary distribution by lazy power iteration (`pi <- (pi + pi P) / 2`, which has the
/// same fixed point and also converges for periodic chains), stopping when
/// `|pi P - pi|_1 <= TOLERANCE`. Returns (pi, iterations, final residual).
fn stationary(v: usize, b: usize, succ: &[u32], prob: &[f64]) -> (Vec<f64>, usize, f64) {
    let mut pi = vec![1.0 / v as f64; v];
    let mut next = vec![0.0; v];
    let mut residual = f64::INFINITY;
    for it in 0..MAX_ITERATIONS {
        step(&pi, b, succ, prob, &mut next);
        residual = pi.iter().zip(&next).map(|(a, c)| (a - c).abs()).sum();
        if residual <= TOLERANCE {
            return (pi, it, residual);
        }
        let mut total = 0.0;
        for (a, c) in pi.iter_mut().zip(&next) {
            *a = 0.5 * (*a + c);
            total += *a;
        }
        pi.iter_mut().for_each(|a| *a /= total);
    }
    (pi, MAX_ITERATIONS, residual)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Differences of a cumulative row (the stored form) back to probabilities.
    fn diffs(cum: &[f64]) -> Vec<f64> {
        let mut prev = 0.0;
        cum.iter()
            .map(|&c| {
                let d = c - prev;
                prev = c;
                d
            })
            .collect()
    }

    #[test]
    fn pi_is_a_stationary_distribution() {
        let chain = MarkovChain::build(300, 8, 11).unwrap();
        let pi = diffs(&chain.pi_cum);
        let prob: Vec<f64> = chain.cum.chunks_exact(8).flat_map(diffs).collect();
        let sum: f64 = pi.iter().sum();
        assert!((sum - 1.0).abs() < 1e-12, "sum {sum}");
        assert!(
            pi.iter().all(|&p| p > 0.0),
            "irreducible chain: every state recurrent"
        );
        // pi P computed independently, transition by transition.
        let mut pi_p = vec![0.0; 300];
        for s in 0..300 {
            let row_sum: f64 = prob[s * 8..(s + 1) * 8].iter().sum();
            assert!((row_sum - 1.0).abs() < 1e-12);
            let mut succs = chain.succ[s * 8..(s + 1) * 8].to_vec();
            succs.sort_unstable();
            succs.dedup();
            assert_eq!(succs.len(), 8, "successors of {s} are distinct");
            for j in 0..8 {
                pi_p[chain.succ[s * 8 + j] as usize] += pi[s] * prob[s * 8 + j];
            }
        }
        let l1: f64 = pi_p.iter().zip(&pi).map(|(a, b)| (a - b).abs()).sum();
        assert!(l1 < 1e-11, "|pi P - pi|_1 = {l1}");
    }

    #[test]
    fn floor_matches_the_plug_in_entropy_of_a_long_sample() {
        let (v, b, t) = (64usize, 4usize, 255usize);
        let chain = MarkovChain::build(v, b, 5).unwrap();
        let floor = chain.entropy_rate();
        assert!(
            floor > 0.1 && floor < 0.8 * (b as f64).ln(),
            "floor {floor}"
        );
        // 8000 samples of 255 transitions each: about 2M transitions.
        let mut counts = vec![0u64; v * v];
        let mut walk = Vec::new();
        for k in 0..8000 {
            walk.clear();
            chain.walk(Split::Train, k, t, &mut walk);
            assert_eq!(walk.len(), t + 1);
            for w in walk.windows(2) {
                counts[w[0] as usize * v + w[1] as usize] += 1;
            }
        }
        let n: u64 = counts.iter().sum();
        let mut h = 0.0;
        for s in 0..v {
            let row = &counts[s * v..(s + 1) * v];
            let n_s: u64 = row.iter().sum();
            for &c in row.iter().filter(|&&c| c > 0) {
                h -= c as f64 / n as f64 * (c as f64 / n_s as f64).ln();
            }
        }
        let rel = (h - floor).abs() / floor;
        assert!(rel < 0.01, "plug-in {h} vs floor {floor} (rel {rel})");
    }

    #[test]
    fn branching_one_is_a_deterministic_cycle_with_zero_floor() {
        let chain = MarkovChain::build(10, 1, 2).unwrap();
        assert_eq!(chain.entropy_rate(), 0.0);
        for p in diffs(&chain.pi_cum) {
            assert!((p - 0.1).abs() < 1e-12);
        }
        let mut walk = Vec::new();
        chain.walk(Split::Train, 0, 10, &mut walk);
        let mut visited = walk[..10].to_vec();
        visited.sort_unstable();
        assert_eq!(
            visited,
            (0..10).collect::<Vec<i64>>(),
            "the cycle visits every state once"
        );
        assert_eq!(walk[10], walk[0]);
    }

    #[test]
    fn dense_branching_uses_every_state() {
        let chain = MarkovChain::build(6, 6, 1).unwrap();
        for s in 0..6 {
            let mut row = chain.succ[s * 6..(s + 1) * 6].to_vec();
            row.sort_unstable();
            assert_eq!(row, vec![0, 1, 2, 3, 4, 5]);
        }
        let floor = chain.entropy_rate();
        assert!(floor > 0.0 && floor < 6f64.ln());
    }
}
