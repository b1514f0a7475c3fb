//! `zero.shard_group`: how many ranks one copy of the model states is sharded over (hybrid
//! sharding, as FSDP2's HSDP and MiCS: shard within a group, replicate across groups).

use super::ConfigError;
use serde::de::{self, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};
use std::fmt;

/// `zero.shard_group`: `"all"` (the default: one group of every rank), `"node"` (the ranks
/// of one node) or a number of ranks that divides the world size.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ShardGroup {
    /// Every rank: one group, no replicas (ZeRO as without the key).
    #[default]
    All,
    /// The ranks of one node (`LOCAL_WORLD_SIZE`).
    Node,
    /// This many consecutive ranks.
    Ranks(usize),
}

impl ShardGroup {
    /// The group size for a job of `world` ranks with `local` ranks on each node, or one line
    /// naming both numbers: a group must divide the world size, and must not split a node
    /// unevenly (it holds whole nodes or divides a node's ranks).
    pub fn resolve(self, world: usize, local: usize) -> Result<usize, ConfigError> {
        let g = match self {
            ShardGroup::All => return Ok(world),
            ShardGroup::Node => local,
            ShardGroup::Ranks(g) => g,
        };
        let shown = self.to_string();
        if g == 0 || !world.is_multiple_of(g) {
            return Err(ConfigError(format!(
                "zero.shard_group = {shown} does not divide the world size {world}: use a divisor of {world} ({}), \"node\" or \"all\"",
                divisors(world)
            )));
        }
        if local > 0
            && world.is_multiple_of(local)
            && !g.is_multiple_of(local)
            && !local.is_multiple_of(g)
        {
            return Err(ConfigError(format!(
                "zero.shard_group = {shown} splits the nodes of {local} ranks unevenly: a group must hold whole nodes (a multiple of {local}) or divide a node's {local} ranks"
            )));
        }
        Ok(g)
    }
}

/// "1, 2, 4" for 4.
fn divisors(n: usize) -> String {
    (1..=n)
        .filter(|d| n.is_multiple_of(*d))
        .map(|d| d.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

impl fmt::Display for ShardGroup {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShardGroup::All => write!(f, "\"all\""),
            ShardGroup::Node => write!(f, "\"node\""),
            ShardGroup::Ranks(g) => write!(f, "{g}"),
        }
    }
}

impl Serialize for ShardGroup {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            ShardGroup::All => s.serialize_str("all"),
            ShardGroup::Node => s.serialize_str("node"),
            ShardGroup::Ranks(g) => s.serialize_u64(*g as u64),
        }
    }
}

impl<'de> Deserialize<'de> for ShardGroup {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = ShardGroup;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "a number of ranks (at least 1), \"node\" or \"all\"")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<ShardGroup, E> {
                match usize::try_from(v) {
                    Ok(g) if g >= 1 => Ok(ShardGroup::Ranks(g)),
                    _ => Err(E::custom(
                        "must be a number of ranks (at least 1), \"node\" or \"all\"",
                    )),
                }
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<ShardGroup, E> {
                self.visit_i64(i64::try_from(v).unwrap_or(-1))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<ShardGroup, E> {
                match v {
                    "all" => Ok(ShardGroup::All),
                    "node" => Ok(ShardGroup::Node),
                    _ => Err(E::custom(format!(
                        "{v:?} is not a shard group: use a number of ranks, \"node\" or \"all\""
                    ))),
                }
            }
        }
        d.deserialize_any(V)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_resolve_or_name_both_numbers() {
        assert_eq!(ShardGroup::All.resolve(8, 4).unwrap(), 8);
        assert_eq!(ShardGroup::Node.resolve(8, 4).unwrap(), 4);
        assert_eq!(ShardGroup::Ranks(2).resolve(8, 4).unwrap(), 2);
        assert_eq!(ShardGroup::Ranks(8).resolve(16, 4).unwrap(), 8);
        let e = ShardGroup::Ranks(3).resolve(8, 4).unwrap_err().0;
        assert!(e.contains("= 3") && e.contains("world size 8"), "{e}");
        let e = ShardGroup::Ranks(6).resolve(12, 4).unwrap_err().0;
        assert!(e.contains("= 6") && e.contains("nodes of 4 ranks"), "{e}");
    }

    #[test]
    fn toml_values_parse() {
        #[derive(Deserialize)]
        struct T {
            g: ShardGroup,
        }
        let p = |s: &str| toml::from_str::<T>(s).map(|t| t.g);
        assert_eq!(p("g = 4").unwrap(), ShardGroup::Ranks(4));
        assert_eq!(p("g = \"node\"").unwrap(), ShardGroup::Node);
        assert_eq!(p("g = \"all\"").unwrap(), ShardGroup::All);
        assert!(p("g = 0").is_err());
        assert!(p("g = \"nodes\"")
            .unwrap_err()
            .to_string()
            .contains("\"nodes\""));
    }
}
