//! A manifest is untrusted input: everything in it is checked before any rank file is opened
//! or any buffer is sized from it. Names never leave the checkpoint directory (a rank's file is
//! exactly `rank-NNNNN.safetensors`), shards tile every unit exactly, arithmetic on its numbers
//! is checked, and every size is bounded (the manifest's own, and each unit's by the bytes of
//! the rank files that hold it, which a reader compares with the files on disk when it opens
//! them).

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::path::Path;

use super::Manifest;
use crate::dir::{open_regular, Opened};
use crate::{rank_file_name, Error, Result, MANIFEST};

/// Largest `manifest.json` read (a manifest of 1000 ranks and 500 units is about 30 MB).
pub(crate) const MAX_MANIFEST_BYTES: u64 = 256 << 20;
/// Most ranks a manifest may name.
const MAX_WORLD: usize = 1 << 20;
/// Most dimensions of a parameter.
const MAX_DIMS: usize = 8;
/// Longest unit or parameter name, in bytes.
const MAX_NAME: usize = 1024;
/// Longest sequence a manifest may record.
const MAX_SEQ_LEN: u64 = 1 << 24;
/// Bytes of a rank file before its tensors: the safetensors header's length.
const LEN_PREFIX: u64 = 8;

/// `dir/manifest.json`'s bytes, refusing one larger than [`MAX_MANIFEST_BYTES`].
pub(crate) fn read_bounded(dir: &Path) -> Result<Vec<u8>> {
    let path = dir.join(MANIFEST);
    let opened = open_regular(&path).map_err(|e| Error::io("read", &path, e))?;
    let (file, len) = match opened {
        Opened::File(file, len) => (file, len),
        Opened::Missing => {
            return Err(Error::Format {
                dir: dir.to_path_buf(),
                detail: format!(
                    "no {MANIFEST} (an incomplete save, or not a checkpoint directory); give a directory such as runs/x/ckpt/step-00000500"
                ),
            })
        }
        Opened::NotRegular(what) => {
            return Err(Error::damaged(
                dir,
                MANIFEST,
                format!("it is {what}, not a regular file"),
            ))
        }
    };
    if len > MAX_MANIFEST_BYTES {
        return Err(Error::damaged(
            dir,
            MANIFEST,
            format!("it is {len} bytes, more than the {MAX_MANIFEST_BYTES} a manifest may be"),
        ));
    }
    let mut text = Vec::with_capacity(len as usize);
    file.take(MAX_MANIFEST_BYTES + 1)
        .read_to_end(&mut text)
        .map_err(|e| Error::io("read", &path, e))?;
    if text.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(Error::damaged(
            dir,
            MANIFEST,
            "it grew past its bound while read",
        ));
    }
    Ok(text)
}

/// Checks the manifest's own hash: required from format version 2 on, checked in a version-1
/// manifest that has one.
pub(crate) fn verify_seal(dir: &Path, version: u32, text: &[u8]) -> Result<()> {
    let Some((body, recorded)) = crate::hash::unseal(text) else {
        if version >= 2 {
            return Err(Error::damaged(
                dir,
                MANIFEST,
                format!(
                    "format version {version} ends with its own manifest_hash but this one has none (cut short or edited by hand)"
                ),
            ));
        }
        return Ok(());
    };
    let Some(want) = crate::hash::parse(&recorded) else {
        return Err(Error::damaged(
            dir,
            MANIFEST,
            format!("manifest_hash {recorded:?} is not an xxh3-128 hash"),
        ));
    };
    let got = crate::hash::of(&body);
    if got != want {
        return Err(Error::damaged(
            dir,
            MANIFEST,
            format!(
                "its bytes hash to {} but manifest_hash records {recorded}: it was edited or altered after the save",
                crate::hash::to_string(&got)
            ),
        ));
    }
    Ok(())
}

/// Every file entry's hash is one this zrun computes.
pub(crate) fn hashes(m: &Manifest, dir: &Path) -> Result<()> {
    for (i, f) in m.files.iter().enumerate() {
        if crate::hash::parse(&f.hash).is_none() {
            return Err(Error::Format {
                dir: dir.to_path_buf(),
                detail: format!(
                    "files[{i}] ({})'s hash {:?} is not one this zrun reads (xxh3-128): upgrade zrun",
                    f.name, f.hash
                ),
            });
        }
    }
    Ok(())
}

/// A directory named `step-NNNNNNNN` holds the manifest of step N.
pub(crate) fn step_dir(m: &Manifest, dir: &Path) -> Result<()> {
    let named = dir
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("step-"))
        .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
        .and_then(|d| d.parse::<u64>().ok());
    match named {
        Some(n) if n != m.step => Err(Error::damaged(
            dir,
            MANIFEST,
            format!(
                "step is {} but the directory is the checkpoint of step {n} (a manifest moved from another checkpoint, or edited)",
                m.step
            ),
        )),
        _ => Ok(()),
    }
}

/// A name a manifest gives a unit or parameter: not empty, bounded.
fn name_ok(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_NAME
}

/// The tables of `m`, checked; the error names the first violation (field and values).
pub(crate) fn tables(m: &Manifest) -> std::result::Result<(), String> {
    let w = m.world_size;
    if w == 0 || w > MAX_WORLD {
        return Err(format!("world_size {w} is not between 1 and {MAX_WORLD}"));
    }
    if m.ranks.len() != w {
        return Err(format!(
            "world_size is {w} but ranks has {} entries",
            m.ranks.len()
        ));
    }
    policies(m)?;
    // Ranks: in order, each naming its own file, a plain name inside the directory.
    for (r, e) in m.ranks.iter().enumerate() {
        if e.rank != r {
            return Err(format!("ranks[{r}].rank is {}, expected {r}", e.rank));
        }
        let want = rank_file_name(r);
        if e.file != want {
            return Err(format!(
                "ranks[{r}].file is {:?}, expected {want:?} (a rank's file is a plain name inside the checkpoint directory)",
                e.file
            ));
        }
    }
    // Files: exactly one entry per rank file, nothing else.
    if m.files.len() != w {
        return Err(format!(
            "files has {} entries for {w} rank files",
            m.files.len()
        ));
    }
    let mut bytes: HashMap<&str, u64> = HashMap::with_capacity(w);
    for (i, f) in m.files.iter().enumerate() {
        if bytes.insert(f.name.as_str(), f.bytes).is_some() {
            return Err(format!("files[{i}] names {:?} a second time", f.name));
        }
        if f.bytes < LEN_PREFIX {
            return Err(format!(
                "files[{i}] ({}) is {} bytes, too small for a safetensors file",
                f.name, f.bytes
            ));
        }
    }
    for e in &m.ranks {
        if !bytes.contains_key(e.file.as_str()) {
            return Err(format!("files has no entry for {}", e.file));
        }
    }
    // Units: shards tile each one exactly; views lie inside it and do not overlap.
    let per_element: u64 = 4 + 2 * moment_bytes(m)?;
    let mut need = vec![LEN_PREFIX; w];
    let mut units = HashSet::with_capacity(m.units.len());
    let mut params = HashSet::new();
    for (i, u) in m.units.iter().enumerate() {
        let at = format!("units[{i}] ({:?})", u.name);
        if !name_ok(&u.name) {
            return Err(format!("{at}: a unit name is 1 to {MAX_NAME} bytes"));
        }
        if !units.insert(u.name.as_str()) {
            return Err(format!("{at}: a second unit of this name"));
        }
        if u.shards.len() != w {
            return Err(format!(
                "{at}: {} shards for world_size {w}",
                u.shards.len()
            ));
        }
        let mut next = 0u64;
        for (r, s) in u.shards.iter().enumerate() {
            if s.start != next {
                let what = if s.start > next {
                    "a gap"
                } else {
                    "an overlap"
                };
                return Err(format!(
                    "{at}: shards[{r}] starts at {} where the shards before it end at {next} ({what}); shards tile [0, numel) in rank order",
                    s.start
                ));
            }
            next = s.start.checked_add(s.len).ok_or_else(|| {
                format!(
                    "{at}: shards[{r}] start {} + len {} overflows",
                    s.start, s.len
                )
            })?;
            if next > u.numel {
                return Err(format!(
                    "{at}: shards[{r}] ends at {next}, past numel {}",
                    u.numel
                ));
            }
            need[r] = s
                .len
                .checked_mul(per_element)
                .and_then(|b| need[r].checked_add(b))
                .ok_or_else(|| format!("{at}: shards[{r}] len {} overflows", s.len))?;
        }
        if next != u.numel {
            return Err(format!(
                "{at}: shards end at {next} but numel is {} (a gap at the end)",
                u.numel
            ));
        }
        let mut spans = Vec::with_capacity(u.views.len());
        for (j, v) in u.views.iter().enumerate() {
            let at = format!("{at} views[{j}] ({:?})", v.name);
            if !name_ok(&v.name) {
                return Err(format!("{at}: a parameter name is 1 to {MAX_NAME} bytes"));
            }
            if !params.insert(v.name.as_str()) {
                return Err(format!("{at}: a second parameter of this name"));
            }
            if v.shape.len() > MAX_DIMS {
                return Err(format!(
                    "{at}: shape has {} dimensions, at most {MAX_DIMS}",
                    v.shape.len()
                ));
            }
            let product = v
                .shape
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .ok_or_else(|| format!("{at}: shape {:?} overflows", v.shape))?;
            if product != v.numel {
                return Err(format!(
                    "{at}: numel is {} but shape {:?} holds {product}",
                    v.numel, v.shape
                ));
            }
            let end = v
                .offset
                .checked_add(v.numel)
                .filter(|&e| e <= u.numel)
                .ok_or_else(|| {
                    format!(
                        "{at}: offset {} + numel {} runs past the unit's numel {}",
                        v.offset, v.numel, u.numel
                    )
                })?;
            if v.numel > 0 {
                spans.push((v.offset, end, j));
            }
        }
        spans.sort_unstable();
        for pair in spans.windows(2) {
            let ((_, end, a), (start, _, b)) = (pair[0], pair[1]);
            if start < end {
                return Err(format!(
                    "{at}: views {:?} and {:?} overlap at element {start}",
                    u.views[a].name, u.views[b].name
                ));
            }
        }
    }
    // Each rank file holds at least its shards' three parts: this bounds every unit by bytes
    // on disk, which a reader compares with the real file before it reads.
    for (r, e) in m.ranks.iter().enumerate() {
        let have = bytes[e.file.as_str()];
        if need[r] > have {
            return Err(format!(
                "files entry {} says {have} bytes, but its shards need at least {}",
                e.file, need[r]
            ));
        }
    }
    Ok(())
}

/// Bytes per element of the moments (`optimizer.state_dtype`).
fn moment_bytes(m: &Manifest) -> std::result::Result<u64, String> {
    match m.optimizer.state_dtype.as_str() {
        "fp32" => Ok(4),
        "bf16" => Ok(2),
        other => Err(format!(
            "optimizer.state_dtype {other:?} is not fp32 or bf16"
        )),
    }
}

/// The run's settings: known values, sane sizes.
fn policies(m: &Manifest) -> std::result::Result<(), String> {
    if m.stage > 3 {
        return Err(format!("stage {} is not 0 to 3", m.stage));
    }
    if !["fp32", "bf16", "fp16"].contains(&m.precision.as_str()) {
        return Err(format!(
            "precision {:?} is not fp32, bf16 or fp16",
            m.precision
        ));
    }
    if !["none", "cpu"].contains(&m.offload.as_str()) {
        return Err(format!("offload {:?} is not none or cpu", m.offload));
    }
    if m.step > i64::MAX as u64 {
        return Err(format!("step {} is out of range", m.step));
    }
    if m.data.seq_len == 0 || m.data.seq_len > MAX_SEQ_LEN {
        return Err(format!(
            "data.seq_len {} is not between 1 and {MAX_SEQ_LEN}",
            m.data.seq_len
        ));
    }
    if m.data.global_batch == 0 {
        return Err("data.global_batch is 0".into());
    }
    Ok(())
}
