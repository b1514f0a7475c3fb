//! `train.loss_chunk = "auto"` (the default) made a number, against the memory estimate.

use crate::config::Config;
use crate::memory::{estimate_ranks, human};
use crate::Error;

/// The largest chunk "auto" takes on a GPU where the full logits do not fit: 2^30 logits (4
/// GiB in fp32). Past a few thousand rows a chunk's head matmul is as efficient as the whole,
/// and the backward's passes over the input gradient (one per chunk of the vocabulary) are
/// few; more would only hold memory.
pub const LARGEST_AUTO_CHUNK: u64 = 1 << 30;

/// `train.loss_chunk = "auto"` made a number. On a GPU (`cuda`): the full logits (0) where
/// every rank's predicted peak with them fits `limit`, since there the chunked loss's extra
/// passes over the logits cost time (12% of gpt2-medium's step on an H100); else the largest
/// power-of-two chunk from [`LARGEST_AUTO_CHUNK`] (or the one that holds a micro-batch's logits)
/// down that fits, since small chunks make
/// small matmuls and many passes (`llama3.2-1b`'s 128,256-word vocabulary at 8 x 2048 tokens
/// in chunks of 2^24 is 128 head matmuls of 128 rows, and 126 fp32 passes over the input
/// gradient); chunks of [`zrun_models::LOSS_CHUNK`] when none does. On CPU, where memory comes
/// first, always chunks of [`zrun_models::LOSS_CHUNK`]. Returns the config and, on a GPU,
/// what was chosen and why (one line for the log).
pub fn resolve_loss_chunk(
    cfg: &Config,
    cuda: bool,
    world: usize,
    fixed: i64,
    limit: Option<i64>,
) -> Result<(Config, Option<String>), Error> {
    if !cfg.auto.loss_chunk {
        return Ok((cfg.clone(), None));
    }
    let with = |chunk: u64| {
        let mut c = cfg.clone();
        c.auto.loss_chunk = false;
        c.train.loss_chunk = chunk;
        c
    };
    let smallest = zrun_models::LOSS_CHUNK as u64;
    if !cuda {
        return Ok((with(smallest), None));
    }
    let say = |what: String| Some(format!("train.loss_chunk = \"auto\": {what}"));
    let Some(limit) = limit else {
        return Ok((
            with(smallest),
            say(format!(
                "chunks of {smallest} logits (no GPU memory to check larger ones against: give dist.memory_limit or --device-mem)"
            )),
        ));
    };
    // Every rank's predicted peak, and whether all fit.
    let peak = |c: &Config| -> Result<(i64, bool), Error> {
        let ranks = estimate_ranks(c, world, fixed, Some(limit))?;
        let peak = fixed + ranks.iter().map(|r| r.peak_bytes).max().unwrap_or(0);
        Ok((peak, ranks.iter().all(|r| r.fits)))
    };
    // The full logits first, then halving chunks from the largest worth trying: no larger
    // than the power of two that holds a micro-batch's logits in one chunk.
    let arch = cfg.arch()?;
    let logits = cfg.train.micro_batch as i64 * arch.seq_len() * arch.vocab_size();
    let largest = LARGEST_AUTO_CHUNK.min((logits.max(1) as u64).next_power_of_two());
    let chunks =
        std::iter::successors(Some(largest), |c| Some(c / 2)).take_while(|&c| c > smallest);
    let mut over = String::new();
    for chunk in std::iter::once(0).chain(chunks) {
        let c = with(chunk);
        let (p, fits) = peak(&c)?;
        let within = format!("predicted peak {} within {}", human(p), human(limit));
        if chunk == 0 && fits {
            return Ok((c, say(format!("the full logits ({within})"))));
        }
        if chunk == 0 {
            over = format!(
                "the full logits' predicted peak {} with a {:.0}% margin is over {}",
                human(p),
                100.0 * crate::memory::MARGIN,
                human(limit)
            );
        } else if fits {
            let what =
                format!("chunks of {chunk} logits, the largest that fits ({within}; {over})");
            return Ok((c, say(what)));
        }
    }
    Ok((
        with(smallest),
        say(format!("chunks of {smallest} logits ({over})")),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_auto_loss_chunk_takes_the_full_logits_or_the_largest_chunk_that_fits_on_a_gpu() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("t.toml");
        std::fs::write(
            &path,
            "[model]\npreset = \"tiny\"\nvocab_size = 50304\n[train]\nmicro_batch = 16\n",
        )
        .unwrap();
        let load = |sets: &[&str]| {
            let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
            Config::load(&path, &sets).unwrap()
        };
        let cfg = load(&[]);
        assert!(cfg.auto.loss_chunk, "absent: auto");
        assert!(load(&["train.loss_chunk=\"auto\""]).auto.loss_chunk);
        let peak = |c: &Config| estimate_ranks(c, 1, 0, None).unwrap()[0].peak_bytes;
        let mut full = cfg.clone();
        full.train.loss_chunk = 0;
        let (chunked_peak, full_peak) = (peak(&cfg), peak(&full));
        assert!(
            full_peak > chunked_peak + (64 << 20),
            "{full_peak} vs {chunked_peak}"
        );
        let chunk = zrun_models::LOSS_CHUNK as u64;
        let with = |c: u64| {
            let mut out = cfg.clone();
            out.train.loss_chunk = c;
            peak(&out)
        };
        // 16 x 64 x 50304 logits (about 2^25.6): 2^25 holds fewer than all, 2^26 all.
        let (p24, p25, p26) = (with(chunk), with(2 * chunk), with(4 * chunk));
        assert!(
            p24 < p25 && p25 < p26 && p26 <= full_peak,
            "{p24} {p25} {p26} {full_peak}"
        );
        // The limit a peak fits with the margin `fits` keeps.
        let room = |p: i64| (p as f64 * (1.0 + crate::memory::MARGIN)).ceil() as i64;
        for (cuda, limit, want) in [
            (true, Some(2 * full_peak), 0),
            // The largest chunk whose peak fits, halving from LARGEST_AUTO_CHUNK.
            (true, Some(room(p26)), 4 * chunk),
            (true, Some(room((p25 + p26) / 2)), 2 * chunk),
            (true, Some(room(p24)), chunk),
            // Nothing fits: the smallest.
            (true, Some(p24 / 2), chunk),
            (true, None, chunk),
            (false, Some(2 * full_peak), chunk),
        ] {
            let (got, why) = resolve_loss_chunk(&cfg, cuda, 1, 0, limit).unwrap();
            assert_eq!(
                got.train.loss_chunk, want,
                "cuda {cuda}, limit {limit:?}: {why:?}"
            );
            assert!(!got.auto.loss_chunk);
            assert_eq!(why.is_some(), cuda);
        }
        // A number is the user's: kept, on a GPU too.
        let set = load(&["train.loss_chunk=1048576"]);
        assert!(!set.auto.loss_chunk);
        let (got, why) = resolve_loss_chunk(&set, true, 1, 0, Some(2 * full_peak)).unwrap();
        assert_eq!((got.train.loss_chunk, why), (1 << 20, None));
    }
}
