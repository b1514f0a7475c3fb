//! Writing: one safetensors file per rank, hashed while it is written and fsynced; the
//! manifest last, then the rename that makes the checkpoint visible; pruning old ones.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use safetensors::tensor::{Metadata, TensorInfo};

use crate::dir::{complete, step_dir, sync_dir};
use crate::{Error, FileEntry, Manifest, Result, MANIFEST};

/// Element types a rank file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    /// 32-bit float.
    F32,
    /// bfloat16 (moments kept in bf16).
    Bf16,
    /// IEEE half.
    F16,
    /// Bytes (random-generator states).
    U8,
}

impl Dtype {
    /// Bytes per element.
    pub fn size(self) -> usize {
        match self {
            Dtype::F32 => 4,
            Dtype::Bf16 | Dtype::F16 => 2,
            Dtype::U8 => 1,
        }
    }

    pub(crate) fn to_st(self) -> safetensors::Dtype {
        match self {
            Dtype::F32 => safetensors::Dtype::F32,
            Dtype::Bf16 => safetensors::Dtype::BF16,
            Dtype::F16 => safetensors::Dtype::F16,
            Dtype::U8 => safetensors::Dtype::U8,
        }
    }

    pub(crate) fn from_st(d: safetensors::Dtype) -> Option<Dtype> {
        match d {
            safetensors::Dtype::F32 => Some(Dtype::F32),
            safetensors::Dtype::BF16 => Some(Dtype::Bf16),
            safetensors::Dtype::F16 => Some(Dtype::F16),
            safetensors::Dtype::U8 => Some(Dtype::U8),
            _ => None,
        }
    }
}

/// A tensor a [`RankWriter`] will write: its name, type and shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorSpec {
    /// Name in the file.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
}

impl TensorSpec {
    /// Bytes of its data.
    pub fn bytes(&self) -> usize {
        self.shape.iter().product::<usize>() * self.dtype.size()
    }
}

/// `rank-00003.safetensors`.
pub fn rank_file_name(rank: usize) -> String {
    format!("rank-{rank:05}.safetensors")
}

/// The safetensors header (length prefix, JSON padded to 8 bytes) of `specs` laid out back
/// to back in their order, with `meta` as `__metadata__`.
pub(crate) fn header(
    specs: &[TensorSpec],
    meta: Option<std::collections::HashMap<String, String>>,
) -> Result<Vec<u8>> {
    let mut at = 0;
    let mut infos = Vec::with_capacity(specs.len());
    for s in specs {
        let n = s.bytes();
        infos.push((
            s.name.clone(),
            TensorInfo {
                dtype: s.dtype.to_st(),
                shape: s.shape.clone(),
                data_offsets: (at, at + n),
            },
        ));
        at += n;
    }
    let metadata = Metadata::new(meta, infos)
        .map_err(|e| Error::Invalid(format!("safetensors header: {e}")))?;
    let mut json = serde_json::to_vec(&metadata)
        .map_err(|e| Error::Invalid(format!("safetensors header: {e}")))?;
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut out = Vec::with_capacity(8 + json.len());
    out.extend((json.len() as u64).to_le_bytes());
    out.extend(json);
    Ok(out)
}

/// Writes one rank's file: the header for the tensors announced up front, then each
/// tensor's bytes in that order; hashes everything it writes and fsyncs at the end.
pub struct RankWriter {
    path: PathBuf,
    out: BufWriter<File>,
    hasher: crate::hash::Hasher,
    specs: Vec<TensorSpec>,
    next: usize,
    bytes: u64,
}

impl RankWriter {
    /// Creates `dir/<file>` (replacing any leftover) holding `specs` in that order.
    pub fn create(dir: &Path, file: &str, specs: Vec<TensorSpec>) -> Result<RankWriter> {
        std::fs::create_dir_all(dir).map_err(|e| Error::io("create", dir, e))?;
        let path = dir.join(file);
        let f = File::create(&path).map_err(|e| Error::io("create", &path, e))?;
        let mut w = RankWriter {
            out: BufWriter::with_capacity(8 << 20, f),
            path,
            hasher: crate::hash::Hasher::default(),
            next: 0,
            bytes: 0,
            specs: Vec::new(),
        };
        let mut meta = std::collections::HashMap::new();
        meta.insert("format".to_string(), crate::FORMAT.to_string());
        let head = header(&specs, Some(meta))?;
        w.specs = specs;
        w.put(&head)?;
        Ok(w)
    }

    fn put(&mut self, bytes: &[u8]) -> Result<()> {
        self.out
            .write_all(bytes)
            .map_err(|e| Error::io("write", &self.path, e))?;
        self.hasher.update(bytes);
        self.bytes += bytes.len() as u64;
        Ok(())
    }

    /// The name of the next tensor to write, if any is left.
    pub fn next_name(&self) -> Option<&str> {
        self.specs.get(self.next).map(|s| s.name.as_str())
    }

    /// Writes the next tensor's data; `bytes` must be exactly its size.
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        let spec = self.specs.get(self.next).ok_or_else(|| {
            Error::Invalid(format!(
                "{}: all {} tensors are written already",
                self.path.display(),
                self.specs.len()
            ))
        })?;
        if bytes.len() != spec.bytes() {
            return Err(Error::Invalid(format!(
                "{}: tensor {} has {} bytes, its header says {}",
                self.path.display(),
                spec.name,
                bytes.len(),
                spec.bytes()
            )));
        }
        self.next += 1;
        self.put(bytes)
    }

    /// Flushes and fsyncs the file; returns its manifest entry.
    pub fn finish(self) -> Result<FileEntry> {
        if self.next != self.specs.len() {
            return Err(Error::Invalid(format!(
                "{}: {} of {} tensors written",
                self.path.display(),
                self.next,
                self.specs.len()
            )));
        }
        let RankWriter {
            path,
            out,
            hasher,
            bytes,
            ..
        } = self;
        let f = out
            .into_inner()
            .map_err(|e| Error::io("write", &path, e.into_error()))?;
        f.sync_all().map_err(|e| Error::io("sync", &path, e))?;
        Ok(FileEntry {
            name: path
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            bytes,
            hash: crate::hash::to_string(&hasher.digest()),
        })
    }
}

/// Makes the checkpoint in `tmp` (every rank file written and fsynced) complete: checks
/// `manifest`'s tables as a reader will, writes it into `tmp` sealed with its own hash
/// (`"manifest_hash"`, the last member: XXH3-128 of the pretty-printed JSON without it) and
/// fsynced, renames `tmp` to `parent/step-NNNNNNNN` and fsyncs the parent. Returns the final
/// directory.
pub fn commit(tmp: &Path, manifest: &Manifest) -> Result<PathBuf> {
    let parent = tmp
        .parent()
        .ok_or_else(|| Error::Invalid(format!("{} has no parent", tmp.display())))?;
    crate::manifest::check_tables(manifest).map_err(|d| {
        Error::Invalid(format!(
            "the manifest for {} is inconsistent: {d}",
            tmp.display()
        ))
    })?;
    let path = tmp.join(MANIFEST);
    let body = serde_json::to_vec_pretty(manifest)
        .map_err(|e| Error::Invalid(format!("manifest: {e}")))?;
    let json = crate::hash::seal(&body)
        .ok_or_else(|| Error::Invalid("manifest: not a JSON object".into()))?;
    let write = || -> std::io::Result<()> {
        let mut f = File::create(&path)?;
        f.write_all(&json)?;
        f.sync_all()
    };
    write().map_err(|e| Error::io("write", &path, e))?;
    sync_dir(tmp)?;
    let target = step_dir(parent, manifest.step);
    if target.exists() {
        return Err(Error::Invalid(format!(
            "{} already exists; a checkpoint of step {} was saved before: remove it or use another checkpoint.dir",
            target.display(),
            manifest.step
        )));
    }
    std::fs::rename(tmp, &target).map_err(|e| Error::io("rename into place", tmp, e))?;
    sync_dir(parent)?;
    Ok(target)
}

/// Deletes the oldest complete checkpoints in `dir` until `keep` remain (`keep = 0`: none is
/// deleted). The manifest goes first, so a deletion cut short leaves an incomplete directory,
/// never a damaged complete one. Returns what it deleted.
pub fn prune(dir: &Path, keep: usize) -> Result<Vec<PathBuf>> {
    let all = complete(dir)?;
    if keep == 0 || all.len() <= keep {
        return Ok(Vec::new());
    }
    let mut gone = Vec::new();
    for (_, path) in &all[..all.len() - keep] {
        let m = path.join(MANIFEST);
        std::fs::remove_file(&m).map_err(|e| Error::io("remove", &m, e))?;
        sync_dir(path)?;
        std::fs::remove_dir_all(path).map_err(|e| Error::io("remove", path, e))?;
        gone.push(path.clone());
    }
    sync_dir(dir)?;
    Ok(gone)
}
