//! Reading: the manifest, then only the rank files a reader needs. Each file is read once,
//! front to back, straight into the caller's buffers, and hashed on the way; [`Reader::verify`]
//! hashes what was not read and compares the whole with the manifest. A reader uses the data
//! only once the files it read are verified (a loader that finds damage loads something else
//! over what it read).

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use safetensors::tensor::Metadata;

use crate::dir::{open_regular, Opened};
use crate::write::Dtype;
use crate::{rng_name, tensor_name, Error, Manifest, Part, Result};

/// Bytes read per call when hashing a stretch nobody asked for.
const CHUNK: usize = 16 << 20;

/// Largest safetensors header of a rank file read (safetensors' own readers refuse more than
/// 100 MB too); a rank file's header lists a few tensors per unit.
pub(crate) const MAX_HEADER_BYTES: u64 = 100_000_000;

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

    /// Warns when the manifest is format version 1, written before manifests carried their
    /// own hash: a damaged or hand-edited one that still passes the table checks cannot be
    /// told from the one the run saved. Silent for a sealed manifest. Called once, when the
    /// checkpoint was used (rank 0 of a resume; consolidate, export and sample once they
    /// succeed, so a refused one prints its error alone).
    pub fn warn_if_unsealed(&self) {
        if self.manifest.format_version < 2 {
            tracing::warn!(
                "checkpoint {}: manifest.json is format version 1, which carries no hash of itself, so an edit to it cannot be detected (its rank files are still verified); checkpoints this zrun saves are version 2",
                self.dir.display()
            );
        }
    }

    /// The dtype of the moments in the rank files.
    pub fn moment_dtype(&self) -> Dtype {
        match self.manifest.optimizer.state_dtype.as_str() {
            "bf16" => Dtype::Bf16,
            _ => Dtype::F32,
        }
    }

    /// A reader that opens rank files as it needs them.
    pub fn reader(&self) -> Reader<'_> {
        Reader {
            ckpt: self,
            files: HashMap::new(),
            scratch: Vec::new(),
        }
    }
}

/// One rank file, open for reading: its header parsed and checked, its bytes hashed in file
/// order as far as they have been read.
pub struct RankFile {
    file: File,
    dir: PathBuf,
    name: String,
    len: u64,
    hash: String,
    /// Every byte before `pos` went into `hasher`, in order.
    pos: u64,
    hasher: crate::hash::Hasher,
    /// name -> (dtype, absolute byte range in the file).
    tensors: HashMap<String, (Dtype, std::ops::Range<u64>)>,
}

impl RankFile {
    /// Opens rank `rank`'s file of `ckpt`: checks its size against the manifest and that its
    /// header holds every tensor the manifest promises with the right type and shape.
    pub fn open(ckpt: &Checkpoint, rank: usize) -> Result<RankFile> {
        let m = &ckpt.manifest;
        let dir = &ckpt.dir;
        let name = &m
            .ranks
            .get(rank)
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "rank {rank} asked of a checkpoint of {} ranks ({})",
                    m.world_size,
                    dir.display()
                ))
            })?
            .file;
        let entry = m
            .file(name)
            .ok_or_else(|| Error::damaged(dir, name, "has no entry in the manifest"))?;
        let path = dir.join(name);
        let opened = open_regular(&path).map_err(|e| Error::io("open", &path, e))?;
        let (file, len) = match opened {
            Opened::File(file, len) => (file, len),
            Opened::Missing => return Err(Error::damaged(dir, name, "is missing")),
            Opened::NotRegular(what) => {
                return Err(Error::damaged(
                    dir,
                    name,
                    format!("it is {what}, not a regular file"),
                ))
            }
        };
        if len != entry.bytes {
            let why = if len < entry.bytes {
                "truncated or cut short"
            } else {
                "longer than saved: bytes were added, or another file put in its place"
            };
            return Err(Error::damaged(
                dir,
                name,
                format!(
                    "it is {len} bytes but the manifest says {} ({why})",
                    entry.bytes
                ),
            ));
        }
        advise_sequential(&file);
        let mut f = RankFile {
            file,
            dir: dir.clone(),
            name: name.clone(),
            len,
            hash: entry.hash.clone(),
            pos: 0,
            hasher: crate::hash::Hasher::default(),
            tensors: HashMap::new(),
        };
        let mut n = [0u8; 8];
        f.read_at(0, &mut n)?;
        let n = u64::from_le_bytes(n);
        if n > len.saturating_sub(8) {
            return Err(f.damage(format!("its header length {n} runs past its end")));
        }
        if n > MAX_HEADER_BYTES {
            return Err(f.damage(format!(
                "its header length {n} is more than the {MAX_HEADER_BYTES} bytes a header may be"
            )));
        }
        let mut head = vec![0u8; n as usize];
        f.read_at(8, &mut head)?;
        let meta: Metadata = serde_json::from_slice(&head)
            .map_err(|e| f.damage(format!("unreadable header ({e})")))?;
        let base = 8 + n;
        if base + meta.data_len() as u64 != len {
            return Err(f.damage("its header does not describe its length"));
        }
        for (t, info) in meta.tensors() {
            let dtype = Dtype::from_st(info.dtype)
                .ok_or_else(|| f.damage(format!("tensor {t} has type {:?}", info.dtype)))?;
            let (a, b) = info.data_offsets;
            f.tensors
                .insert(t, (dtype, base + a as u64..base + b as u64));
        }
        let moments = ckpt.moment_dtype();
        for u in &m.units {
            let want_len = u.shards[rank].len;
            if want_len == 0 {
                continue;
            }
            let delayed = m.delayed_params.then_some(Part::Delayed);
            for part in Part::ALL.into_iter().chain(delayed) {
                let want = match part {
                    Part::Master | Part::Delayed => Dtype::F32,
                    Part::ExpAvg | Part::ExpAvgSq => moments,
                };
                let t = tensor_name(&u.name, part);
                match f.tensors.get(&t) {
                    Some((d, r)) if *d == want && r.end - r.start == want_len * d.size() as u64 => {
                    }
                    Some((d, r)) => {
                        let got = (r.end - r.start) / d.size() as u64;
                        return Err(f.damage(format!(
                            "tensor {t} is {d:?} [{got}], the manifest says {want:?} [{want_len}]"
                        )));
                    }
                    None => return Err(f.damage(format!("tensor {t} is missing"))),
                }
            }
        }
        Ok(f)
    }

    fn damage(&self, detail: impl Into<String>) -> Error {
        Error::damaged(&self.dir, &self.name, detail)
    }

    /// Reads bytes `[off, off + buf.len())` into `buf`. Bytes at the hashed front go into the
    /// hash (after hashing any gap before them); bytes before it are read again unhashed.
    fn read_at(&mut self, off: u64, buf: &mut [u8]) -> Result<()> {
        let end = off + buf.len() as u64;
        if end > self.len {
            return Err(self.damage("a tensor runs past its end"));
        }
        if off > self.pos {
            self.hash_to(off)?;
        }
        let path = self.dir.join(&self.name);
        if off < self.pos {
            // Read again (or partly again): the hash has seen the bytes before `pos`.
            let again = ((self.pos - off) as usize).min(buf.len());
            self.file
                .read_exact_at(&mut buf[..again], off)
                .map_err(|e| Error::io("read", &path, e))?;
            if again == buf.len() {
                return Ok(());
            }
            let at = self.pos;
            return self.read_at(at, &mut buf[again..]);
        }
        self.file
            .read_exact_at(buf, off)
            .map_err(|e| Error::io("read", &path, e))?;
        self.hasher.update(buf);
        self.pos = end;
        Ok(())
    }

    /// Reads and hashes the bytes from the front to `to`.
    fn hash_to(&mut self, to: u64) -> Result<()> {
        let mut chunk = vec![0u8; CHUNK.min((to - self.pos) as usize)];
        while self.pos < to {
            let n = chunk.len().min((to - self.pos) as usize);
            let at = self.pos;
            self.read_at(at, &mut chunk[..n])?;
        }
        Ok(())
    }

    /// Hashes the rest of the file and compares the whole with the manifest's hash.
    pub fn verify(&mut self) -> Result<()> {
        self.hash_to(self.len)?;
        let Some(want) = crate::hash::parse(&self.hash) else {
            return Err(Error::Format {
                dir: self.dir.clone(),
                detail: format!(
                    "{}'s hash {:?} is not one this zrun reads (xxh3-128): upgrade zrun",
                    self.name, self.hash
                ),
            });
        };
        let got = self.hasher.digest();
        if got != want {
            return Err(self.damage(format!(
                "its content hash differs from the manifest ({} against {}): it was altered after the save",
                crate::hash::to_string(&got),
                self.hash
            )));
        }
        Ok(())
    }
}

/// Tells the kernel the file is read front to back (a larger readahead window).
fn advise_sequential(f: &File) {
    use std::os::fd::AsRawFd;
    // SAFETY: the fd is open for the call; posix_fadvise only changes caching and readahead.
    unsafe {
        libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_SEQUENTIAL);
    }
}

/// Reads element ranges of units across the rank files that hold them.
pub struct Reader<'a> {
    ckpt: &'a Checkpoint,
    files: HashMap<usize, RankFile>,
    scratch: Vec<u8>,
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

    /// Opens rank `rank`'s file (once): size and header checked, content not yet.
    pub fn open(&mut self, rank: usize) -> Result<&mut RankFile> {
        if !self.files.contains_key(&rank) {
            let f = RankFile::open(self.ckpt, rank)?;
            self.files.insert(rank, f);
        }
        Ok(self.files.get_mut(&rank).expect("inserted above"))
    }

    /// Opens every rank file of the checkpoint (sizes and headers checked against the
    /// manifest), so buffers sized from the manifest are known to fit the files on disk.
    pub fn open_all(&mut self) -> Result<()> {
        for r in 0..self.ckpt.manifest.world_size {
            self.open(r)?;
        }
        Ok(())
    }

    /// Hashes every rank file of the checkpoint, opened or not, and compares each with the
    /// manifest: what a command that reads a whole checkpoint (consolidate, export, sample)
    /// runs before its output is used.
    pub fn verify_all(&mut self) -> Result<()> {
        self.open_all()?;
        self.verify()
    }

    /// Hashes the rest of every file opened so far and compares each with the manifest: the
    /// data read from them may be used once this succeeds.
    pub fn verify(&mut self) -> Result<()> {
        let mut ranks: Vec<usize> = self.files.keys().copied().collect();
        ranks.sort_unstable();
        for r in ranks {
            self.files.get_mut(&r).expect("listed above").verify()?;
        }
        Ok(())
    }

    /// Copies elements `[start, start + out.len())` of unit `unit`'s `part` into `out` as
    /// f32 (bf16 moments are widened exactly), from whichever rank files hold them. Not
    /// verified until [`Reader::verify`].
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
        for r in self.ranks_for(unit, start, out.len() as u64) {
            let s = self.ckpt.manifest.units[unit].shards[r];
            let (lo, hi) = (start.max(s.start), end.min(s.start + s.len));
            let dst = &mut out[(lo - start) as usize..(hi - start) as usize];
            let mut scratch = std::mem::take(&mut self.scratch);
            let f = self.open(r)?;
            let (dtype, range) = f
                .tensors
                .get(&name)
                .cloned()
                .ok_or_else(|| f.damage(format!("tensor {name} is missing")))?;
            let at = range.start + (lo - s.start) * dtype.size() as u64;
            if dtype == Dtype::F32 && cfg!(target_endian = "little") {
                // SAFETY: any bytes are a valid f32; the view covers exactly `dst`.
                let bytes = unsafe {
                    std::slice::from_raw_parts_mut(dst.as_mut_ptr() as *mut u8, dst.len() * 4)
                };
                f.read_at(at, bytes)?;
            } else {
                scratch.resize(dst.len() * dtype.size(), 0);
                f.read_at(at, &mut scratch)?;
                widen(dtype, &scratch, dst);
            }
            self.scratch = scratch;
        }
        Ok(())
    }

    /// Rank `rank`'s saved state of the random generator of `device`, if it holds one. Not
    /// verified until [`Reader::verify`].
    pub fn rng(&mut self, rank: usize, device: &str) -> Result<Option<Vec<u8>>> {
        if rank >= self.ckpt.manifest.world_size
            || !self.ckpt.manifest.ranks[rank]
                .rng
                .iter()
                .any(|d| d == device)
        {
            return Ok(None);
        }
        let f = self.open(rank)?;
        let Some((_, range)) = f.tensors.get(&rng_name(device)).cloned() else {
            return Ok(None);
        };
        let mut out = vec![0u8; (range.end - range.start) as usize];
        f.read_at(range.start, &mut out)?;
        Ok(Some(out))
    }
}

/// Little-endian elements of type `dtype` in `src` into `dst` as f32.
pub(crate) fn widen(dtype: Dtype, src: &[u8], dst: &mut [f32]) {
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
