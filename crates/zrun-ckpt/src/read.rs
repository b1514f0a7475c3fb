//! Reading: the manifest, then only the rank files a reader needs, each memory-mapped and
//! checked (size, BLAKE3 hash, the tensors the manifest promises) before its first use.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::write::Dtype;
use crate::{rng_name, tensor_name, Error, Manifest, Part, Result};

/// A checkpoint directory whose manifest has been read and checked.
#[derive(Clone, Debug)]
pub struct Checkpoint {
    /// The directory.
    pub dir: PathBuf,
    /// Its manifest.
    pub manifest: Manifest,
}

impl Checkpoint {
    /// Reads `dir/manifest.json` (see [`Manifest::load`]).
    pub fn open(dir: &Path) -> Result<Checkpoint> {
        Ok(Checkpoint {
            dir: dir.to_path_buf(),
            manifest: Manifest::load(dir)?,
        })
    }

    /// The dtype of the moments in the rank files.
    pub fn moment_dtype(&self) -> Dtype {
        match self.manifest.optimizer.state_dtype.as_str() {
            "bf16" => Dtype::Bf16,
            _ => Dtype::F32,
        }
    }

    /// A reader that maps rank files as it needs them.
    pub fn reader(&self) -> Reader<'_> {
        Reader {
            ckpt: self,
            files: HashMap::new(),
        }
    }
}

/// One rank file, mapped and verified.
pub struct RankFile {
    map: Mmap,
    /// name -> (dtype, shape, byte range in `map`).
    tensors: HashMap<String, (Dtype, Vec<usize>, std::ops::Range<usize>)>,
}

impl RankFile {
    /// Maps rank `rank`'s file of `ckpt`, checks its size and hash against the manifest and
    /// that it holds every tensor the manifest promises with the right type and shape.
    pub fn open(ckpt: &Checkpoint, rank: usize) -> Result<RankFile> {
        let m = &ckpt.manifest;
        let dir = &ckpt.dir;
        let name = &m.ranks[rank].file;
        let entry = m
            .file(name)
            .ok_or_else(|| Error::damaged(dir, name, "has no entry in the manifest"))?;
        let path = dir.join(name);
        let f = File::open(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::NotFound => Error::damaged(dir, name, "is missing"),
            _ => Error::io("open", &path, e),
        })?;
        let len = f.metadata().map_err(|e| Error::io("stat", &path, e))?.len();
        if len != entry.bytes {
            return Err(Error::damaged(
                dir,
                name,
                format!(
                    "it is {len} bytes but the manifest says {} (truncated or cut short)",
                    entry.bytes
                ),
            ));
        }
        // SAFETY: the map is read-only; a checkpoint file is never written after its save
        // completed. Should another process still change it, the hash check below (or a
        // later read) sees other bytes, never invalid memory: the length was checked.
        let map = unsafe { Mmap::map(&f) }.map_err(|e| Error::io("map", &path, e))?;
        let hash = blake3::hash(&map).to_hex();
        if hash.as_str() != entry.blake3 {
            return Err(Error::damaged(
                dir,
                name,
                format!(
                    "its content hash differs from the manifest (blake3 {}..., expected {}...): it was altered after the save",
                    &hash.as_str()[..16],
                    entry.blake3.get(..16).unwrap_or(&entry.blake3)
                ),
            ));
        }
        let (head, meta) = safetensors::SafeTensors::read_metadata(&map)
            .map_err(|e| Error::damaged(dir, name, format!("unreadable header ({e:?})")))?;
        let base = 8 + head;
        let mut tensors = HashMap::new();
        for (t, info) in meta.tensors() {
            let dtype = Dtype::from_st(info.dtype).ok_or_else(|| {
                Error::damaged(dir, name, format!("tensor {t} has type {:?}", info.dtype))
            })?;
            let (a, b) = info.data_offsets;
            tensors.insert(t, (dtype, info.shape.clone(), base + a..base + b));
        }
        let file = RankFile { map, tensors };
        let moments = ckpt.moment_dtype();
        for u in &m.units {
            let len = u.shards[rank].len as usize;
            if len == 0 {
                continue;
            }
            for part in Part::ALL {
                let want = if part == Part::Master {
                    Dtype::F32
                } else {
                    moments
                };
                let t = tensor_name(&u.name, part);
                match file.tensors.get(&t) {
                    Some((d, shape, _)) if *d == want && shape == &[len] => {}
                    Some((d, shape, _)) => {
                        return Err(Error::damaged(
                            dir,
                            name,
                            format!(
                                "tensor {t} is {d:?} {shape:?}, the manifest says {want:?} [{len}]"
                            ),
                        ))
                    }
                    None => {
                        return Err(Error::damaged(dir, name, format!("tensor {t} is missing")))
                    }
                }
            }
        }
        Ok(file)
    }

    /// The bytes and type of tensor `name`.
    pub fn tensor(&self, name: &str) -> Option<(Dtype, &[u8])> {
        self.tensors
            .get(name)
            .map(|(d, _, r)| (*d, &self.map[r.clone()]))
    }
}

/// Reads element ranges of units across the rank files that hold them.
pub struct Reader<'a> {
    ckpt: &'a Checkpoint,
    files: HashMap<usize, RankFile>,
}

impl Reader<'_> {
    /// The ranks whose files hold some of `[start, start + len)` of unit `unit`.
    pub fn ranks_for(&self, unit: usize, start: u64, len: u64) -> Vec<usize> {
        let end = start + len;
        self.ckpt.manifest.units[unit]
            .shards
            .iter()
            .enumerate()
            .filter(|(_, s)| s.len > 0 && s.start < end && start < s.start + s.len)
            .map(|(r, _)| r)
            .collect()
    }

    /// Maps and verifies rank `rank`'s file (once).
    pub fn open(&mut self, rank: usize) -> Result<&RankFile> {
        if !self.files.contains_key(&rank) {
            let f = RankFile::open(self.ckpt, rank)?;
            self.files.insert(rank, f);
        }
        Ok(&self.files[&rank])
    }

    /// Copies elements `[start, start + out.len())` of unit `unit`'s `part` into `out` as
    /// f32 (bf16 moments are widened exactly), from whichever rank files hold them.
    pub fn read(&mut self, unit: usize, part: Part, start: u64, out: &mut [f32]) -> Result<()> {
        let end = start + out.len() as u64;
        let u = &self.ckpt.manifest.units[unit];
        if end > u.numel {
            return Err(Error::Invalid(format!(
                "unit {} has {} elements; asked for [{start}, {end})",
                u.name, u.numel
            )));
        }
        let name = tensor_name(&u.name, part);
        let dir = &self.ckpt.dir;
        for r in self.ranks_for(unit, start, out.len() as u64) {
            let s = self.ckpt.manifest.units[unit].shards[r];
            let file = &self.ckpt.manifest.ranks[r].file;
            let (lo, hi) = (start.max(s.start), end.min(s.start + s.len));
            let (dtype, bytes) = self
                .open(r)?
                .tensor(&name)
                .ok_or_else(|| Error::damaged(dir, file, format!("tensor {name} is missing")))?;
            let from = (lo - s.start) as usize;
            let dst = &mut out[(lo - start) as usize..(hi - start) as usize];
            copy_f32(dtype, bytes, from, dst);
        }
        Ok(())
    }

    /// Rank `rank`'s saved state of the random generator of `device`, if it holds one.
    pub fn rng(&mut self, rank: usize, device: &str) -> Result<Option<Vec<u8>>> {
        if rank >= self.ckpt.manifest.world_size
            || !self.ckpt.manifest.ranks[rank]
                .rng
                .iter()
                .any(|d| d == device)
        {
            return Ok(None);
        }
        Ok(self
            .open(rank)?
            .tensor(&rng_name(device))
            .map(|(_, b)| b.to_vec()))
    }
}

/// Elements `[from, from + dst.len())` of the little-endian `bytes` of type `dtype` into `dst`.
pub(crate) fn copy_f32(dtype: Dtype, bytes: &[u8], from: usize, dst: &mut [f32]) {
    let size = dtype.size();
    let src = &bytes[from * size..(from + dst.len()) * size];
    match dtype {
        Dtype::F32 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Dtype::Bf16 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::bf16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        Dtype::F16 => {
            for (d, c) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *d = half::f16::from_le_bytes([c[0], c[1]]).to_f32();
            }
        }
        Dtype::U8 => {
            for (d, b) in dst.iter_mut().zip(src) {
                *d = f32::from(*b);
            }
        }
    }
}
