//! Writing a Hugging Face model directory: weights streamed tensor by tensor into planned
//! shards, each under a temporary name until [`HfWriter::finish`] renames them into place and
//! writes the index last; JSON files and tokenizer files copied atomically.

use std::collections::{BTreeMap, HashSet};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::{INDEX, WEIGHTS};
use crate::dir::sync_dir;
use crate::write::{header, Dtype, TensorSpec};
use crate::{Error, Result};

/// Elements converted per write when the file's type is not the values' own.
const CHUNK: usize = 1 << 16;

/// The suffix of a file being written.
const TMP: &str = ".tmp";

/// Streams the weights of a model into a Hugging Face directory: `model.safetensors`, or
/// shards `model-00001-of-0000N.safetensors` and `model.safetensors.index.json`.
///
/// Tensors are [`put`](HfWriter::put) one at a time in the order given to
/// [`create`](HfWriter::create), so memory stays near the largest tensor. Each shard is
/// written to `<name>.tmp` and fsynced when its last tensor is in; [`finish`](HfWriter::finish)
/// renames them into place, the index last, so an export cut short never leaves a directory
/// that looks loadable with shards missing. A writer dropped before `finish` removes its
/// temporary files.
#[derive(Debug)]
pub struct HfWriter {
    dir: PathBuf,
    specs: Vec<TensorSpec>,
    /// The tensors of each shard, as a range of `specs`.
    shards: Vec<Range<usize>>,
    /// The next tensor to put, as an index into `specs`.
    next: usize,
    /// The shard being written (the one holding `specs[next - 1]`) and its temporary path.
    open: Option<(PathBuf, BufWriter<File>)>,
    /// Temporary files created so far.
    tmps: Vec<PathBuf>,
    scratch: Vec<u8>,
    finished: bool,
}

impl HfWriter {
    /// Plans the weights of `dir` for `tensors` (written in this order) in shards of at most
    /// `max_shard_bytes` of tensor data: consecutive tensors, a new shard whenever the next
    /// tensor would pass the limit (a tensor bigger than the limit gets a shard of its own), as
    /// transformers' `save_pretrained(max_shard_size=...)` does. Creates `dir` if needed. Every
    /// dtype must be F32, BF16 or F16.
    pub fn create(dir: &Path, tensors: Vec<TensorSpec>, max_shard_bytes: u64) -> Result<HfWriter> {
        if tensors.is_empty() {
            return Err(Error::Invalid(format!(
                "{}: no tensors to write into a Hugging Face model",
                dir.display()
            )));
        }
        let mut seen = HashSet::new();
        for t in &tensors {
            if t.dtype == Dtype::U8 {
                return Err(Error::Invalid(format!(
                    "{}: tensor {} is U8; a Hugging Face export writes F32, BF16 or F16",
                    dir.display(),
                    t.name
                )));
            }
            if !seen.insert(t.name.as_str()) {
                return Err(Error::Invalid(format!(
                    "{}: tensor {} is given twice; give every tensor once",
                    dir.display(),
                    t.name
                )));
            }
        }
        std::fs::create_dir_all(dir).map_err(|e| Error::io("create", dir, e))?;
        Ok(HfWriter {
            dir: dir.to_path_buf(),
            shards: plan(&tensors, max_shard_bytes),
            specs: tensors,
            next: 0,
            open: None,
            tmps: Vec::new(),
            scratch: Vec::new(),
            finished: false,
        })
    }

    /// The file names of the shards, in order (`model.safetensors` when there is one).
    pub fn files(&self) -> Vec<String> {
        (0..self.shards.len()).map(|i| self.file_name(i)).collect()
    }

    /// The name of the next tensor to put, if any is left.
    pub fn next_name(&self) -> Option<&str> {
        self.specs.get(self.next).map(|s| s.name.as_str())
    }

    fn file_name(&self, shard: usize) -> String {
        shard_name(shard, self.shards.len())
    }

    /// The shard holding tensor `i`.
    fn shard_of(&self, i: usize) -> usize {
        self.shards.partition_point(|r| r.end <= i)
    }

    /// Writes tensor `name`'s values (row-major, as many as its shape holds), converted to its
    /// dtype (BF16 and F16 rounded to nearest, ties to even). Tensors go in the order given to
    /// [`HfWriter::create`].
    pub fn put(&mut self, name: &str, values: &[f32]) -> Result<()> {
        let Some(spec) = self.specs.get(self.next) else {
            return Err(Error::Invalid(format!(
                "{}: all {} tensors are written already; tensor {name} is not among them",
                self.dir.display(),
                self.specs.len()
            )));
        };
        if spec.name != name {
            let known = self.specs.iter().any(|s| s.name == name);
            return Err(Error::Invalid(format!(
                "{}: tensor {name} {}; {} is next: put tensors in the order given to \
                 HfWriter::create",
                self.dir.display(),
                if known {
                    "is out of order"
                } else {
                    "is not among the planned tensors"
                },
                spec.name
            )));
        }
        let numel: usize = spec.shape.iter().product();
        if values.len() != numel {
            return Err(Error::Invalid(format!(
                "{}: tensor {name} of shape {:?} has {numel} elements, given {}",
                self.dir.display(),
                spec.shape,
                values.len()
            )));
        }
        let dtype = spec.dtype;
        let shard = self.shard_of(self.next);
        if self.shards[shard].start == self.next {
            self.open_shard(shard)?;
        }
        let (path, out) = self.open.as_mut().ok_or_else(|| {
            Error::Invalid(format!(
                "{}: no shard is open for tensor {name}",
                self.dir.display()
            ))
        })?;
        write_values(out, &mut self.scratch, dtype, values)
            .map_err(|e| Error::io("write", path, e))?;
        self.next += 1;
        if self.shards[shard].end == self.next {
            self.close_shard()?;
        }
        Ok(())
    }

    /// Creates shard `shard`'s temporary file and writes its header.
    fn open_shard(&mut self, shard: usize) -> Result<()> {
        let path = self.dir.join(format!("{}{TMP}", self.file_name(shard)));
        let f = File::create(&path).map_err(|e| Error::io("create", &path, e))?;
        self.tmps.push(path.clone());
        let mut out = BufWriter::with_capacity(8 << 20, f);
        let mut meta = std::collections::HashMap::new();
        meta.insert("format".to_string(), "pt".to_string());
        let head = header(&self.specs[self.shards[shard].clone()], Some(meta))?;
        out.write_all(&head)
            .map_err(|e| Error::io("write", &path, e))?;
        self.open = Some((path, out));
        Ok(())
    }

    /// Flushes and fsyncs the open shard.
    fn close_shard(&mut self) -> Result<()> {
        if let Some((path, out)) = self.open.take() {
            let f = out
                .into_inner()
                .map_err(|e| Error::io("write", &path, e.into_error()))?;
            f.sync_all().map_err(|e| Error::io("sync", &path, e))?;
        }
        Ok(())
    }

    /// Renames every shard into place (after removing weights files of an earlier export that
    /// this one does not replace), then writes `model.safetensors.index.json` when there are
    /// several; fsyncs the directory. Returns the files written, the index last.
    pub fn finish(mut self) -> Result<Vec<PathBuf>> {
        if let Some(next) = self.specs.get(self.next) {
            return Err(Error::Invalid(format!(
                "{}: {} of {} tensors written; put the rest (next: {}) before finishing",
                self.dir.display(),
                self.next,
                self.specs.len(),
                next.name
            )));
        }
        let names = self.files();
        remove_stale(&self.dir, &names)?;
        let mut done = Vec::with_capacity(names.len() + 1);
        for name in &names {
            let (tmp, path) = (self.dir.join(format!("{name}{TMP}")), self.dir.join(name));
            std::fs::rename(&tmp, &path).map_err(|e| Error::io("rename into place", &tmp, e))?;
            done.push(path);
        }
        self.finished = true;
        sync_dir(&self.dir)?;
        if names.len() > 1 {
            let mut weight_map = BTreeMap::new();
            for (i, r) in self.shards.iter().enumerate() {
                for s in &self.specs[r.clone()] {
                    weight_map.insert(s.name.as_str(), names[i].as_str());
                }
            }
            let index = Index {
                metadata: IndexMeta {
                    total_parameters: self
                        .specs
                        .iter()
                        .map(|s| s.shape.iter().product::<usize>() as u64)
                        .sum(),
                    total_size: self.specs.iter().map(|s| s.bytes() as u64).sum(),
                },
                weight_map,
            };
            done.push(write_json(&self.dir, INDEX, &index)?);
        }
        Ok(done)
    }
}

impl Drop for HfWriter {
    /// Removes the temporary files of a writer that did not finish.
    fn drop(&mut self) {
        if !self.finished {
            self.open = None;
            for t in &self.tmps {
                let _ = std::fs::remove_file(t);
            }
        }
    }
}

/// `model.safetensors` for one shard; `model-00002-of-00003.safetensors` for the second of three.
fn shard_name(shard: usize, shards: usize) -> String {
    if shards == 1 {
        WEIGHTS.to_string()
    } else {
        format!("model-{:05}-of-{shards:05}.safetensors", shard + 1)
    }
}

/// Consecutive runs of `specs` of at most `max` bytes each, but never empty.
fn plan(specs: &[TensorSpec], max: u64) -> Vec<Range<usize>> {
    let mut shards = Vec::new();
    let (mut from, mut size) = (0, 0u64);
    for (i, s) in specs.iter().enumerate() {
        let n = s.bytes() as u64;
        if i > from && size + n > max {
            shards.push(from..i);
            (from, size) = (i, 0);
        }
        size += n;
    }
    shards.push(from..specs.len());
    shards
}

/// `values` as little-endian `dtype` elements into `out`, converting through `scratch`.
fn write_values(
    out: &mut impl Write,
    scratch: &mut Vec<u8>,
    dtype: Dtype,
    values: &[f32],
) -> std::io::Result<()> {
    if dtype == Dtype::F32 && cfg!(target_endian = "little") {
        // SAFETY: f32 has no padding bytes; the view covers exactly `values`.
        let bytes =
            unsafe { std::slice::from_raw_parts(values.as_ptr() as *const u8, values.len() * 4) };
        return out.write_all(bytes);
    }
    for part in values.chunks(CHUNK) {
        scratch.clear();
        match dtype {
            Dtype::Bf16 => scratch.extend(
                part.iter()
                    .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()),
            ),
            Dtype::F16 => scratch.extend(
                part.iter()
                    .flat_map(|&x| half::f16::from_f32(x).to_le_bytes()),
            ),
            // U8 is refused by `create`; F32 on a big-endian machine.
            _ => scratch.extend(part.iter().flat_map(|x| x.to_le_bytes())),
        }
        out.write_all(scratch)?;
    }
    Ok(())
}

/// Removes from `dir` the weights files of an earlier export that `keep` does not replace
/// (the index first), so transformers cannot load a mix of old and new weights.
fn remove_stale(dir: &Path, keep: &[String]) -> Result<()> {
    let listed = std::fs::read_dir(dir).map_err(|e| Error::io("list", dir, e))?;
    let mut stale = Vec::new();
    for e in listed {
        let name = e
            .map_err(|err| Error::io("list", dir, err))?
            .file_name()
            .to_string_lossy()
            .into_owned();
        if (name == INDEX || name == WEIGHTS || is_shard_name(&name)) && !keep.contains(&name) {
            stale.push(name);
        }
    }
    // The index goes first: without it, leftover shards are not a model.
    stale.sort_by_key(|n| n != INDEX);
    for name in &stale {
        let path = dir.join(name);
        std::fs::remove_file(&path).map_err(|e| Error::io("remove", &path, e))?;
    }
    if !stale.is_empty() {
        sync_dir(dir)?;
    }
    Ok(())
}

/// True for `model-00001-of-00003.safetensors`.
fn is_shard_name(name: &str) -> bool {
    let Some(rest) = name
        .strip_prefix("model-")
        .and_then(|r| r.strip_suffix(".safetensors"))
    else {
        return false;
    };
    let digits = |s: &str| s.len() == 5 && s.bytes().all(|b| b.is_ascii_digit());
    matches!(rest.split_once("-of-"), Some((a, b)) if digits(a) && digits(b))
}

/// `model.safetensors.index.json`, as transformers writes it (keys sorted).
#[derive(serde::Serialize)]
struct Index<'a> {
    metadata: IndexMeta,
    weight_map: BTreeMap<&'a str, &'a str>,
}

/// The index's `metadata`.
#[derive(serde::Serialize)]
struct IndexMeta {
    total_parameters: u64,
    total_size: u64,
}

/// Writes `value` as indented JSON to `dir/name` atomically (a temporary file, fsynced, then
/// renamed into place; the directory fsynced): for `config.json` and
/// `generation_config.json`. Creates `dir` if needed. Returns the file's path.
pub fn write_json<T: serde::Serialize + ?Sized>(
    dir: &Path,
    name: &str,
    value: &T,
) -> Result<PathBuf> {
    let path = dir.join(name);
    let mut text = serde_json::to_vec_pretty(value)
        .map_err(|e| Error::Invalid(format!("{}: {e}", path.display())))?;
    text.push(b'\n');
    std::fs::create_dir_all(dir).map_err(|e| Error::io("create", dir, e))?;
    let tmp = dir.join(format!("{name}{TMP}"));
    let write = || -> std::io::Result<()> {
        let mut f = File::create(&tmp)?;
        f.write_all(&text)?;
        f.sync_all()
    };
    write().map_err(|e| Error::io("write", &tmp, e))?;
    std::fs::rename(&tmp, &path).map_err(|e| Error::io("rename into place", &tmp, e))?;
    sync_dir(dir)?;
    Ok(path)
}

/// Parses a shard size as transformers' `max_shard_size` does: an integer with an optional
/// unit, `KB`, `MB`, `GB` (powers of 10: `5GB` is 5 * 10^9 bytes) or `KiB`, `MiB`, `GiB`
/// (powers of 2), the unit in any case, or plain bytes (`1000000`). Like transformers, a
/// power-of-10 unit ending in a lowercase `b` counts bits (`5Gb` and `5gb` are 625 * 10^6
/// bytes).
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    const UNITS: [(&str, u64); 6] = [
        ("GIB", 1 << 30),
        ("MIB", 1 << 20),
        ("KIB", 1 << 10),
        ("GB", 1_000_000_000),
        ("MB", 1_000_000),
        ("KB", 1_000),
    ];
    let bad = || {
        format!(
            "size `{s}` is not an integer number of bytes with an optional unit (KB, MB, GB in \
             powers of 10; KiB, MiB, GiB in powers of 2), e.g. 5GB or 500MB"
        )
    };
    let t = s.trim();
    let upper = t.to_ascii_uppercase();
    let (digits, scale, bits) = match UNITS.iter().find(|(u, _)| upper.ends_with(u)) {
        Some((u, scale)) => {
            // Units are ASCII, so the cut is a character boundary.
            let digits = t.get(..t.len() - u.len()).ok_or_else(bad)?;
            (digits.trim_end(), *scale, u.len() == 2 && t.ends_with('b'))
        }
        None => (t, 1, false),
    };
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad());
    }
    let n: u64 = digits.parse().map_err(|_| bad())?;
    let bytes = n
        .checked_mul(scale)
        .ok_or_else(|| format!("size `{s}` is too large"))?;
    let bytes = if bits { bytes / 8 } else { bytes };
    if bytes == 0 {
        return Err(format!(
            "size `{s}` is 0 bytes; give a positive size, e.g. 5GB"
        ));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, dtype: Dtype, numel: usize) -> TensorSpec {
        TensorSpec {
            name: name.into(),
            dtype,
            shape: vec![numel],
        }
    }

    #[test]
    fn sizes_parse_as_transformers_parses_them() {
        assert_eq!(parse_size("5GB"), Ok(5_000_000_000));
        assert_eq!(parse_size("500MB"), Ok(500_000_000));
        assert_eq!(parse_size("10KB"), Ok(10_000));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("3mib"), Ok(3 << 20));
        assert_eq!(parse_size("1KiB"), Ok(1024));
        assert_eq!(parse_size("123456"), Ok(123_456));
        assert_eq!(parse_size(" 7 MB "), Ok(7_000_000));
        // transformers: a lowercase `b` after a power-of-10 unit is bits.
        assert_eq!(parse_size("8Gb"), Ok(1_000_000_000));
        assert_eq!(parse_size("8mb"), Ok(1_000_000));
        for bad in ["", "GB", "5 TB", "1.5GB", "-1", "five", "5GiBs", "0", "0MB"] {
            let e = parse_size(bad).unwrap_err();
            assert!(e.contains(&format!("`{bad}`")), "{e}");
        }
        assert!(parse_size("99999999999999GB")
            .unwrap_err()
            .contains("too large"));
    }

    #[test]
    fn shards_are_planned_by_consecutive_tensors() {
        let specs = vec![
            spec("a", Dtype::F32, 10),  // 40 bytes
            spec("b", Dtype::F32, 10),  // 40
            spec("c", Dtype::Bf16, 10), // 20
            spec("d", Dtype::F32, 50),  // 200: bigger than the limit
            spec("e", Dtype::F16, 5),   // 10
        ];
        assert_eq!(plan(&specs, 100), vec![0..3, 3..4, 4..5]);
        assert_eq!(plan(&specs, 80), vec![0..2, 2..3, 3..4, 4..5]);
        assert_eq!(plan(&specs, 1 << 20), vec![0..5]);
        assert_eq!(plan(&specs, 0), vec![0..1, 1..2, 2..3, 3..4, 4..5]);
        assert_eq!(shard_name(0, 1), "model.safetensors");
        assert_eq!(shard_name(1, 3), "model-00002-of-00003.safetensors");
        assert!(is_shard_name("model-00002-of-00003.safetensors"));
        for name in [
            "model.safetensors",
            "model-2-of-3.safetensors",
            "model-00002-of-00003.bin",
        ] {
            assert!(!is_shard_name(name), "{name}");
        }
    }

    #[test]
    fn a_dropped_writer_leaves_nothing_and_order_is_enforced() {
        let root = tempfile::tempdir().unwrap();
        let specs = vec![spec("a", Dtype::F32, 4), spec("b", Dtype::Bf16, 4)];
        let mut w = HfWriter::create(root.path(), specs.clone(), 16).unwrap();
        assert_eq!(w.files().len(), 2);
        let e = w.put("b", &[0.0; 4]).unwrap_err().to_string();
        assert!(e.contains("tensor b is out of order; a is next"), "{e}");
        let e = w.put("z", &[0.0; 4]).unwrap_err().to_string();
        assert!(e.contains("not among the planned tensors"), "{e}");
        let e = w.put("a", &[0.0; 3]).unwrap_err().to_string();
        assert!(e.contains("has 4 elements, given 3"), "{e}");
        w.put("a", &[1.0; 4]).unwrap();
        assert_eq!(w.next_name(), Some("b"));
        drop(w);
        assert_eq!(std::fs::read_dir(root.path()).unwrap().count(), 0);

        let w = HfWriter::create(root.path(), specs.clone(), 16).unwrap();
        let e = w.finish().unwrap_err().to_string();
        assert!(
            e.contains("0 of 2 tensors written") && e.contains("next: a"),
            "{e}"
        );
        let mut twice = specs.clone();
        twice.push(specs[0].clone());
        let e = HfWriter::create(root.path(), twice, 16).unwrap_err();
        assert!(e.to_string().contains("tensor a is given twice"), "{e}");
        let e = HfWriter::create(root.path(), vec![spec("r", Dtype::U8, 4)], 16).unwrap_err();
        assert!(e.to_string().contains("tensor r is U8"), "{e}");
        assert!(HfWriter::create(root.path(), vec![], 16).is_err());
    }
}
