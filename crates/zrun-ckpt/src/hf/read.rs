//! Reading a Hugging Face model directory: `config.json`, then every weights file memory-mapped
//! with only its header parsed. A read converts the elements it is asked for straight from the
//! mapped pages into the caller's buffer; large reads are split across threads.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::ops::Range;
use std::path::{Component, Path, PathBuf};

use memmap2::Mmap;
use safetensors::tensor::Metadata;

use super::{CONFIG, INDEX, WEIGHTS};
use crate::dir::{open_regular, Opened};
use crate::read::widen;
use crate::write::Dtype;
use crate::{Error, Result};

/// Elements per thread below which a read stays on the calling thread.
const PER_THREAD: usize = 1 << 20;
/// Threads one read uses at most.
const MAX_THREADS: usize = 8;
/// Bytes of one source row a transposed read takes per step (two cache lines).
const BLOCK_BYTES: usize = 128;

/// The element type of a tensor in a Hugging Face weights file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HfDtype {
    /// 32-bit float.
    F32,
    /// bfloat16.
    Bf16,
    /// IEEE half.
    F16,
    /// Any other safetensors type (`I64`, `F64`, `U8`, ...), by its safetensors name: listed,
    /// not read.
    Other(String),
}

impl HfDtype {
    fn from_st(d: safetensors::Dtype) -> HfDtype {
        match d {
            safetensors::Dtype::F32 => HfDtype::F32,
            safetensors::Dtype::BF16 => HfDtype::Bf16,
            safetensors::Dtype::F16 => HfDtype::F16,
            other => HfDtype::Other(other.to_string()),
        }
    }

    /// The type a read converts from, if it reads this one.
    fn readable(&self) -> Option<Dtype> {
        match self {
            HfDtype::F32 => Some(Dtype::F32),
            HfDtype::Bf16 => Some(Dtype::Bf16),
            HfDtype::F16 => Some(Dtype::F16),
            HfDtype::Other(_) => None,
        }
    }
}

impl std::fmt::Display for HfDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            HfDtype::F32 => "F32",
            HfDtype::Bf16 => "BF16",
            HfDtype::F16 => "F16",
            HfDtype::Other(name) => name,
        })
    }
}

/// One tensor of a model directory, as its file's header describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// Element type.
    pub dtype: HfDtype,
    /// Shape, row-major.
    pub shape: Vec<usize>,
    /// The weights file that holds it.
    pub file: PathBuf,
}

/// A weights file, memory-mapped.
#[derive(Debug)]
struct Mapped {
    path: PathBuf,
    map: Mmap,
}

/// Where a tensor lives.
#[derive(Debug)]
struct Entry {
    /// Index into [`HfDir::files`].
    file: usize,
    dtype: HfDtype,
    shape: Vec<usize>,
    /// Its bytes in the mapped file (header included in the offsets).
    bytes: Range<usize>,
}

impl Entry {
    fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A Hugging Face model directory open for reading: its `config.json` parsed, every weights
/// file memory-mapped and its header parsed; no tensor data read until asked for.
#[derive(Debug)]
pub struct HfDir {
    dir: PathBuf,
    config_path: PathBuf,
    config: serde_json::Value,
    /// `model.safetensors` or `model.safetensors.index.json`: what errors about the whole
    /// model name.
    weights: PathBuf,
    files: Vec<Mapped>,
    /// Every tensor name, sorted.
    names: Vec<String>,
    tensors: HashMap<String, Entry>,
}

impl HfDir {
    /// Opens the model directory `dir`: reads `config.json`, then maps `model.safetensors`,
    /// or else every shard that `model.safetensors.index.json` names, parsing their headers.
    pub fn open(dir: &Path) -> Result<HfDir> {
        let config_path = dir.join(CONFIG);
        let text = read_regular(&config_path)?.ok_or_else(|| {
            Error::hf(
                &config_path,
                "is missing; a Hugging Face model directory needs its config.json: point at \
                 the folder that holds config.json and the safetensors files",
            )
        })?;
        let config: serde_json::Value = serde_json::from_slice(&text).map_err(|e| {
            Error::hf(
                &config_path,
                format!("is not JSON ({e}); download or write it again"),
            )
        })?;
        if !config.is_object() {
            return Err(Error::hf(
                &config_path,
                "is JSON but not an object of settings; download or write it again",
            ));
        }
        let mut out = HfDir {
            dir: dir.to_path_buf(),
            config_path,
            config,
            weights: dir.join(WEIGHTS),
            files: Vec::new(),
            names: Vec::new(),
            tensors: HashMap::new(),
        };
        let index = dir.join(INDEX);
        if out.weights.is_file() {
            let path = out.weights.clone();
            out.add_file(&path, |_| true)?;
        } else if index.is_file() {
            out.weights = index.clone();
            out.add_shards(&index)?;
        } else {
            let pickle = dir.join("pytorch_model.bin").is_file();
            return Err(Error::hf(
                dir,
                if pickle {
                    format!(
                        "holds pytorch_model.bin but neither {WEIGHTS} nor {INDEX}; zrun reads \
                         safetensors only (no pickle): download the model's safetensors files \
                         or convert it"
                    )
                } else {
                    format!(
                        "has neither {WEIGHTS} nor {INDEX}; download the model's weights into it"
                    )
                },
            ));
        }
        let mut names: Vec<String> = out.tensors.keys().cloned().collect();
        names.sort_unstable();
        out.names = names;
        Ok(out)
    }

    /// Maps every shard `index` names and adds the tensors it places in each.
    fn add_shards(&mut self, index: &Path) -> Result<()> {
        let text =
            read_regular(index)?.ok_or_else(|| Error::hf(index, "is gone; download it again"))?;
        let parsed: IndexFile = serde_json::from_slice(&text).map_err(|e| {
            Error::hf(
                index,
                format!("is not a safetensors index ({e}); download it again"),
            )
        })?;
        let weight_map = parsed.weight_map;
        // shard -> its tensors, in name order.
        let mut shards: BTreeMap<&str, Vec<&str>> = BTreeMap::new();
        for (tensor, shard) in &weight_map {
            shards.entry(shard).or_default().push(tensor);
        }
        for (shard, listed) in shards {
            let first = listed.first().copied().unwrap_or_default();
            let plain = matches!(
                Path::new(shard).components().collect::<Vec<_>>().as_slice(),
                [Component::Normal(_)]
            );
            if !plain {
                return Err(Error::hf(
                    index,
                    format!(
                        "places tensor {first} in {shard:?}, which is not a file name in the \
                         model directory; download the index again"
                    ),
                ));
            }
            let path = self.dir.join(shard);
            if !path.is_file() {
                return Err(Error::hf(
                    index,
                    format!(
                        "names shard {shard} (holding tensor {first}{}), which is missing from \
                         {}; download it",
                        match listed.len() {
                            1 => String::new(),
                            n => format!(" and {} more", n - 1),
                        },
                        self.dir.display()
                    ),
                ));
            }
            // The index decides where the tensors it lists live; others in the file are
            // taken as they come.
            self.add_file(&path, |name| match weight_map.get(name) {
                Some(s) => s == shard,
                None => true,
            })?;
            let file = self.files.len() - 1;
            for t in listed {
                if self.tensors.get(t).is_none_or(|e| e.file != file) {
                    return Err(Error::hf(
                        &path,
                        format!(
                            "has no tensor {t}, which {INDEX} places in it; download the shard \
                             and the index again"
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Maps `path`, parses its header and adds the tensors `keep` accepts (and no other file
    /// added them before).
    fn add_file(&mut self, path: &Path, keep: impl Fn(&str) -> bool) -> Result<()> {
        let (map, meta, base) = map_safetensors(path)?;
        let file = self.files.len();
        for (name, info) in meta.tensors() {
            if !keep(&name) || self.tensors.contains_key(&name) {
                continue;
            }
            let (a, b) = info.data_offsets;
            let entry = Entry {
                file,
                dtype: HfDtype::from_st(info.dtype),
                shape: info.shape.clone(),
                bytes: base + a..base + b,
            };
            self.tensors.insert(name, entry);
        }
        self.files.push(Mapped {
            path: path.to_path_buf(),
            map,
        });
        Ok(())
    }

    /// The model directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The parsed `config.json`.
    pub fn config(&self) -> &serde_json::Value {
        &self.config
    }

    /// The path of `config.json`, for errors about its settings.
    pub fn config_path(&self) -> &Path {
        &self.config_path
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The type, shape and file of tensor `name`, if the model has it.
    pub fn info(&self, name: &str) -> Option<TensorInfo> {
        self.tensors.get(name).map(|e| TensorInfo {
            dtype: e.dtype.clone(),
            shape: e.shape.clone(),
            file: self.files[e.file].path.clone(),
        })
    }

    /// The weights file that holds tensor `name`, if the model has it.
    pub fn file_of(&self, name: &str) -> Option<&Path> {
        self.tensors
            .get(name)
            .map(|e| self.files[e.file].path.as_path())
    }

    /// Elements `[start, start + out.len())` of tensor `name` in row-major order, converted
    /// to f32 from F32, BF16 or F16 (exactly: every such value is an f32).
    pub fn read(&self, name: &str, start: usize, out: &mut [f32]) -> Result<()> {
        let (e, dtype) = self.checked(name, start, out.len(), false)?;
        let size = dtype.size();
        let src = &self.files[e.file].map[e.bytes.clone()];
        in_parallel(out, |at, part| {
            let from = (start + at) * size;
            convert(dtype, &src[from..from + part.len() * size], part);
        });
        self.finite(name, e, out, |i| start + i)
    }

    /// Elements `[start, start + out.len())` of the transpose of the 2-D tensor `name`: for
    /// a tensor of shape (a, b), element `i` of its (b, a) transpose in row-major order, that
    /// is element `(i % a) * b + i / a` of the tensor, converted to f32 as [`HfDir::read`] does.
    pub fn read_transposed(&self, name: &str, start: usize, out: &mut [f32]) -> Result<()> {
        let (e, dtype) = self.checked(name, start, out.len(), true)?;
        if out.is_empty() {
            return Ok(());
        }
        let (a, b) = (e.shape[0], e.shape[1]);
        let src = &self.files[e.file].map[e.bytes.clone()];
        in_parallel(out, |at, part| {
            transpose(dtype, src, a, b, start + at, part)
        });
        self.finite(name, e, out, |i| ((start + i) % a) * b + (start + i) / a)
    }

    /// Refuses a NaN or infinite weight in what was read of tensor `name`: no model trains or
    /// samples from one (the loss is NaN at the first step, greedy sampling picks token 0),
    /// so the file is damaged. `element` maps an index of `out` to the tensor's element.
    fn finite(
        &self,
        name: &str,
        e: &Entry,
        out: &[f32],
        element: impl Fn(usize) -> usize,
    ) -> Result<()> {
        match out.iter().position(|x| !x.is_finite()) {
            None => Ok(()),
            Some(i) => Err(Error::hf(
                &self.files[e.file].path,
                format!(
                    "tensor {name} holds {} at element {} of shape {:?}: the weights are damaged; download or convert the model again",
                    out[i],
                    element(i),
                    e.shape
                ),
            )),
        }
    }

    /// Tensor `name`'s entry and readable type, once `[start, start + len)` is known to lie
    /// within it (and it is 2-D when `two_d`).
    fn checked(
        &self,
        name: &str,
        start: usize,
        len: usize,
        two_d: bool,
    ) -> Result<(&Entry, Dtype)> {
        let e = self.tensors.get(name).ok_or_else(|| {
            Error::hf(
                &self.weights,
                format!(
                    "has no tensor {name} ({} tensors, e.g. {}); check the name mapping",
                    self.names.len(),
                    self.names.first().map(String::as_str).unwrap_or("none")
                ),
            )
        })?;
        let path = &self.files[e.file].path;
        let dtype = e.dtype.readable().ok_or_else(|| {
            Error::hf(
                path,
                format!(
                    "tensor {name} is {}; zrun reads F32, BF16 and F16: convert the model to \
                     one of them",
                    e.dtype
                ),
            )
        })?;
        if two_d && e.shape.len() != 2 {
            return Err(Error::hf(
                path,
                format!(
                    "tensor {name} has shape {:?}; a transposed read needs a 2-D tensor: read \
                     it with HfDir::read",
                    e.shape
                ),
            ));
        }
        let numel = e.numel();
        match start.checked_add(len) {
            Some(end) if end <= numel => Ok((e, dtype)),
            _ => Err(Error::hf(
                path,
                format!(
                    "tensor {name} of shape {:?} has {numel} elements; asked for {len} from \
                     element {start}, past its end: check the slice computed for it",
                    e.shape
                ),
            )),
        }
    }
}

/// The largest `config.json` or weights index read: they are a few KiB to a few MiB.
const MAX_JSON_BYTES: u64 = 64 << 20;

/// The bytes of `path`, `None` when it is missing; refused when it is not a regular file (a
/// FIFO would block the read forever) or is over [`MAX_JSON_BYTES`] (read whole, it would
/// take that much memory before the parse fails).
fn read_regular(path: &Path) -> Result<Option<Vec<u8>>> {
    use std::io::Read;
    let mut file = match open_regular(path).map_err(|e| Error::io("open", path, e))? {
        Opened::File(_, len) if len > MAX_JSON_BYTES => {
            return Err(Error::hf(
                path,
                format!(
                    "is {len} bytes, more than such a JSON file's {MAX_JSON_BYTES}: it is not \
                     one; download it again"
                ),
            ))
        }
        Opened::File(file, _) => file,
        Opened::Missing => return Ok(None),
        Opened::NotRegular(what) => {
            return Err(Error::hf(
                path,
                format!("is {what}, not a regular file; put the file itself there"),
            ))
        }
    };
    let mut bytes = Vec::new();
    file.read_to_end(&mut bytes)
        .map_err(|e| Error::io("read", path, e))?;
    Ok(Some(bytes))
}

/// `model.safetensors.index.json`; its `metadata` is not needed.
#[derive(serde::Deserialize)]
struct IndexFile {
    weight_map: BTreeMap<String, String>,
}

/// Maps the safetensors file `path` and parses its header; returns the map, the header and
/// where the data starts. The header's offsets are checked to tile the data exactly and the
/// data to end where the file ends, so every tensor's bytes lie inside the map.
fn map_safetensors(path: &Path) -> Result<(Mmap, Metadata, usize)> {
    let again = "download it again";
    let file = File::open(path).map_err(|e| Error::io("open", path, e))?;
    let len = file
        .metadata()
        .map_err(|e| Error::io("stat", path, e))?
        .len();
    if len < 8 {
        return Err(Error::hf(
            path,
            format!("is {len} bytes, shorter than a safetensors header: truncated; {again}"),
        ));
    }
    // SAFETY: the map is read-only and lives as long as the `HfDir`; the model's files are not
    // written while it is loaded (the same assumption safetensors' own loaders make). A file
    // changed under the map changes the values read, which are plain bytes with no invariant.
    let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io("map", path, e))?;
    let mut n = [0u8; 8];
    n.copy_from_slice(&map[..8]);
    let n = u64::from_le_bytes(n);
    if n > len - 8 {
        return Err(Error::hf(
            path,
            format!("its header length {n} runs past its end ({len} bytes): truncated; {again}"),
        ));
    }
    let base = 8 + n as usize;
    let meta: Metadata = serde_json::from_slice(&map[8..base]).map_err(|e| {
        Error::hf(
            path,
            format!("unreadable safetensors header ({e}); {again}"),
        )
    })?;
    let want = (base + meta.data_len()) as u64;
    if want != len {
        let what = if want > len {
            "truncated"
        } else {
            "bytes follow its last tensor"
        };
        return Err(Error::hf(
            path,
            format!("is {len} bytes but its header describes {want}: {what}; {again}"),
        ));
    }
    Ok((map, meta, base))
}

/// Runs `f(at, part)` over consecutive parts of `out` (`at`: where the part starts in `out`),
/// on several threads when `out` is large.
fn in_parallel(out: &mut [f32], f: impl Fn(usize, &mut [f32]) + Sync) {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads = (out.len() / PER_THREAD).clamp(1, cores.min(MAX_THREADS));
    if threads == 1 {
        return f(0, out);
    }
    let chunk = out.len().div_ceil(threads);
    std::thread::scope(|s| {
        for (i, part) in out.chunks_mut(chunk).enumerate() {
            let f = &f;
            s.spawn(move || f(i * chunk, part));
        }
    });
}

/// Little-endian elements of type `dtype` in `src` into `out` (as many as `out` holds).
fn convert(dtype: Dtype, src: &[u8], out: &mut [f32]) {
    if dtype == Dtype::F32 && cfg!(target_endian = "little") {
        // SAFETY: f32 has no invalid bit patterns; the view covers exactly `out`.
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr() as *mut u8, out.len() * 4) };
        bytes.copy_from_slice(src);
    } else {
        widen(dtype, src, out);
    }
}

/// Elements `[start, start + out.len())` of the (b, a) transpose of the row-major (a, b)
/// matrix of `dtype` elements in `src`, as f32.
fn transpose(dtype: Dtype, src: &[u8], a: usize, b: usize, start: usize, out: &mut [f32]) {
    match dtype {
        Dtype::F32 => transpose_as(src, a, b, start, out, f32::from_le_bytes),
        Dtype::Bf16 => transpose_as(src, a, b, start, out, |x| {
            half::bf16::from_le_bytes(x).to_f32()
        }),
        Dtype::F16 => transpose_as(src, a, b, start, out, |x| {
            half::f16::from_le_bytes(x).to_f32()
        }),
        Dtype::U8 => transpose_as(src, a, b, start, out, |x: [u8; 1]| f32::from(x[0])),
    }
}

/// [`transpose`] for `N`-byte elements converted by `conv`. Whole rows of the transpose go in
/// blocks: for each source row, one contiguous run of `BLOCK_BYTES` is spread over the block's
/// rows, so every source cache line is fetched once and every output row is written in order.
fn transpose_as<const N: usize>(
    src: &[u8],
    a: usize,
    b: usize,
    start: usize,
    out: &mut [f32],
    conv: impl Fn([u8; N]) -> f32,
) {
    let (src, _) = src.as_chunks::<N>();
    // Output row `r` of the transpose, columns `cols`, into `dst`: a strided walk.
    let column = |r: usize, cols: Range<usize>, dst: &mut [f32]| {
        for (d, c) in dst.iter_mut().zip(cols) {
            *d = conv(src[c * b + r]);
        }
    };
    let (mut r, c0) = (start / a, start % a);
    let mut out = out;
    if c0 != 0 {
        // The end of a row the range starts inside.
        let n = (a - c0).min(out.len());
        let (head, rest) = out.split_at_mut(n);
        column(r, c0..c0 + n, head);
        out = rest;
        r += 1;
    }
    let block = (BLOCK_BYTES / N).max(1);
    while out.len() >= a {
        let rows = block.min(out.len() / a);
        let (dst, rest) = out.split_at_mut(rows * a);
        for c in 0..a {
            let run = &src[c * b + r..c * b + r + rows];
            for (row, x) in dst.chunks_exact_mut(a).zip(run) {
                row[c] = conv(*x);
            }
        }
        out = rest;
        r += rows;
    }
    // The start of the row the range ends inside.
    let n = out.len();
    column(r, 0..n, out);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_config_too_large_to_be_one_is_not_read() {
        let d = tempfile::tempdir().unwrap();
        let f = std::fs::File::create(d.path().join("config.json")).unwrap();
        f.set_len(MAX_JSON_BYTES + 1).unwrap();
        let e = read_regular(&d.path().join("config.json"))
            .unwrap_err()
            .to_string();
        assert!(e.contains("more than such a JSON file's"), "{e}");
        std::fs::write(d.path().join("small.json"), b"{}").unwrap();
        assert_eq!(
            read_regular(&d.path().join("small.json")).unwrap().unwrap(),
            b"{}"
        );
        assert!(read_regular(&d.path().join("gone.json")).unwrap().is_none());
    }

    /// The naive transpose, element by element.
    fn naive(m: &[f32], a: usize, b: usize) -> Vec<f32> {
        (0..a * b).map(|i| m[(i % a) * b + i / a]).collect()
    }

    #[test]
    fn transposed_ranges_match_the_naive_transpose() {
        // Shapes around the block sizes (32 f32 or 64 bf16 rows per block) and degenerate ones.
        for (a, b) in [
            (1, 1),
            (1, 70),
            (70, 1),
            (3, 33),
            (5, 64),
            (7, 65),
            (2, 130),
        ] {
            let m: Vec<f32> = (0..a * b).map(|i| i as f32).collect();
            let want = naive(&m, a, b);
            let f32s: Vec<u8> = m.iter().flat_map(|x| x.to_le_bytes()).collect();
            let bf16s: Vec<u8> = m
                .iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                .collect();
            let n = a * b;
            for start in (0..n).step_by(n.div_ceil(17)) {
                for len in [0, 1, a.saturating_sub(1), a + 1, 33 * a, n - start] {
                    let len = len.min(n - start);
                    let mut out = vec![f32::NAN; len];
                    transpose(Dtype::F32, &f32s, a, b, start, &mut out);
                    assert_eq!(
                        out,
                        want[start..start + len],
                        "({a}, {b}) [{start}, +{len})"
                    );
                    out.fill(f32::NAN);
                    transpose(Dtype::Bf16, &bf16s, a, b, start, &mut out);
                    // Integers below 256 are exact in bf16.
                    let exact = want[start..start + len].iter().all(|&x| x < 256.0);
                    assert!(!exact || out == want[start..start + len], "bf16 ({a}, {b})");
                }
            }
        }
    }
}
