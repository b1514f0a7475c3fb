//! The content hash of checkpoint files: XXH3-128, written as `xxh3-128:<32 hex digits>`.
//!
//! The hash guards against damage (a flipped bit, a torn or truncated write, a file from
//! another save), not against a forger. XXH3 hashes at memory speed (about 12 GB/s on one
//! core here, against 3 GB/s for BLAKE3), so hashing a checkpoint as it is written and read
//! costs next to nothing beside the disk, even where every core is busy with a rank. The
//! algorithm's name is part of the value, so a later format can change it.

use xxhash_rust::xxh3::Xxh3;

const PREFIX: &str = "xxh3-128:";

/// A running hash of a file's bytes, in file order.
#[derive(Clone, Default)]
pub(crate) struct Hasher(Xxh3);

impl Hasher {
    /// Adds `bytes`.
    pub(crate) fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// The hash of everything added.
    pub(crate) fn digest(&self) -> [u8; 16] {
        self.0.digest128().to_be_bytes()
    }
}

/// `xxh3-128:<hex>` of a digest.
pub(crate) fn to_string(d: &[u8; 16]) -> String {
    let hex: String = d.iter().map(|b| format!("{b:02x}")).collect();
    format!("{PREFIX}{hex}")
}

/// The digest of an `xxh3-128:<hex>` string; `None` for another algorithm or a malformed one.
pub(crate) fn parse(s: &str) -> Option<[u8; 16]> {
    let hex = s.strip_prefix(PREFIX)?;
    if hex.len() != 32 {
        return None;
    }
    let mut out = [0u8; 16];
    for (i, o) in out.iter_mut().enumerate() {
        *o = u8::from_str_radix(hex.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_round_trip_through_their_text_and_differ_for_other_bytes() {
        let mut h = Hasher::default();
        h.update(b"zrun");
        let d = h.digest();
        let s = to_string(&d);
        assert!(s.starts_with("xxh3-128:") && s.len() == 9 + 32, "{s}");
        assert_eq!(parse(&s), Some(d));
        assert_eq!(parse("blake3:00"), None);
        assert_eq!(parse("xxh3-128:zz"), None);
        let mut other = Hasher::default();
        other.update(b"zruN");
        assert_ne!(other.digest(), d);
        // Split updates hash as one.
        let mut split = Hasher::default();
        split.update(b"zr");
        split.update(b"un");
        assert_eq!(split.digest(), d);
    }
}
