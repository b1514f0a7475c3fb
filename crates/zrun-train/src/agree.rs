//! Every rank must train the same config: ranks started by hand, by mpirun, srun or torchrun,
//! or on nodes whose copies of train.toml drifted apart would otherwise train a model none of
//! them describes (one rank's learning rate, another's seed) and exit 0. Before anything is
//! computed the ranks compare a hash of each setting and of the layout they see; a difference
//! is one line on every rank naming the keys and this rank's values.

use tch::Device;
use zrun_comm::Communicator;

use crate::config::{Config, ConfigError};
use crate::reduce::gather_bytes;
use crate::Error;

/// Keys that may differ between ranks: paths (a node may hold the same files elsewhere), the
/// rank's own memory bound and timeouts. What the files hold is checked where they are read.
const MAY_DIFFER: &[&str] = &[
    "data.path",
    "data.tokenizer",
    "model.init_from",
    "log.dir",
    "checkpoint.dir",
    "checkpoint.resume",
    "dist.",
];

/// Every compared setting of `cfg` as `(dotted key, value)`, and the layout this rank sees
/// (`LOCAL_WORLD_SIZE`, the shard group), in a fixed order.
pub fn settings(
    cfg: &Config,
    local_world_size: usize,
    shard_group: usize,
) -> Vec<(String, String)> {
    let mut out = Vec::new();
    if let Ok(v) = serde_json::to_value(cfg) {
        flatten("", &v, &mut out);
    }
    out.retain(|(k, _)| {
        !MAY_DIFFER
            .iter()
            .any(|m| k == m || (m.ends_with('.') && k.starts_with(m)))
    });
    out.push(("LOCAL_WORLD_SIZE".into(), local_world_size.to_string()));
    out.push((
        "zero.shard_group (resolved)".into(),
        shard_group.to_string(),
    ));
    out
}

fn flatten(prefix: &str, v: &serde_json::Value, out: &mut Vec<(String, String)>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, v) in m {
                let key = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                flatten(&key, v, out);
            }
        }
        other => out.push((prefix.to_string(), other.to_string())),
    }
}

fn hash(bytes: &[u8]) -> [u8; 8] {
    xxhash_rust::xxh3::xxh3_64(bytes).to_le_bytes()
}

/// Refuses to go on unless every rank has the same `settings` (see [`settings`]): a collective
/// every rank calls once, before any other.
pub fn check(
    comm: &dyn Communicator,
    device: Device,
    settings: &[(String, String)],
) -> Result<(), Error> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    // First the schema (the keys): ranks of different zrun builds cannot compare values.
    let names: Vec<&str> = settings.iter().map(|(k, _)| k.as_str()).collect();
    let schema = hash(names.join("\n").as_bytes());
    let all = gather_bytes(comm, device, &schema)?;
    if let Some(r) = all.iter().position(|s| s != &schema) {
        return Err(differ(format!(
            "rank {r} runs a zrun whose settings are not this one's (rank {}): start every rank with the same zrun build",
            comm.rank()
        )));
    }
    let mine: Vec<u8> = settings
        .iter()
        .flat_map(|(k, v)| hash(format!("{k}={v}").as_bytes()))
        .collect();
    let all = gather_bytes(comm, device, &mine)?;
    let mut keys = Vec::new();
    for (i, (k, v)) in settings.iter().enumerate() {
        let at = |r: &Vec<u8>| r[8 * i..8 * i + 8].to_vec();
        let others: Vec<usize> = (0..all.len())
            .filter(|&r| at(&all[r]) != at(&mine))
            .collect();
        if !others.is_empty() {
            keys.push(format!(
                "{k} = {v} here, another value on rank(s) {}",
                list(&others)
            ));
        }
    }
    if keys.is_empty() {
        return Ok(());
    }
    let more = if keys.len() > 3 {
        format!(" and {} more", keys.len() - 3)
    } else {
        String::new()
    };
    keys.truncate(3);
    Err(differ(format!(
        "the ranks were given different configs (this is rank {}): {}{more}; give every rank the same config file and --set flags",
        comm.rank(),
        keys.join("; ")
    )))
}

fn differ(msg: String) -> Error {
    Error::Config(ConfigError(msg))
}

/// `0, 2, 5` for at most eight ranks, else the first eight and how many more.
fn list(ranks: &[usize]) -> String {
    let shown: Vec<String> = ranks.iter().take(8).map(|r| r.to_string()).collect();
    match ranks.len() {
        n if n > 8 => format!("{} and {} more", shown.join(", "), n - 8),
        _ => shown.join(", "),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_and_dist_settings_are_left_out_and_the_layout_is_in() {
        let mut cfg = Config::default();
        cfg.train.lr = 0.25;
        let s = settings(&cfg, 2, 4);
        let keys: Vec<&str> = s.iter().map(|(k, _)| k.as_str()).collect();
        assert!(keys.contains(&"train.lr") && keys.contains(&"zero.stage"));
        assert!(s.contains(&("train.lr".into(), "0.25".into())));
        for k in ["data.path", "log.dir", "checkpoint.dir", "dist.timeout_s"] {
            assert!(!keys.contains(&k), "{k}");
        }
        assert!(s.contains(&("LOCAL_WORLD_SIZE".into(), "2".into())));
        assert!(s.contains(&("zero.shard_group (resolved)".into(), "4".into())));
        assert_eq!(list(&[1, 3]), "1, 3");
        assert_eq!(
            list(&(0..10).collect::<Vec<_>>()),
            "0, 1, 2, 3, 4, 5, 6, 7 and 2 more"
        );
    }
}
