//! `zrun consolidate`: one safetensors file of full, named parameters from a sharded
//! checkpoint, streamed parameter by parameter (peak memory near the largest parameter).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use crate::write::{header, Dtype, TensorSpec};
use crate::{Checkpoint, Error, Part, Result};

/// Element type of a consolidated file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OutDtype {
    /// The fp32 master weights as they are.
    F32,
    /// Rounded to bfloat16 (nearest, ties to even).
    Bf16,
    /// Rounded to IEEE half (nearest, ties to even).
    F16,
}

impl std::str::FromStr for OutDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "fp32" => Ok(OutDtype::F32),
            "bf16" => Ok(OutDtype::Bf16),
            "fp16" => Ok(OutDtype::F16),
            _ => Err(format!("dtype `{s}` is not one of: fp32, bf16, fp16")),
        }
    }
}

impl OutDtype {
    fn dtype(self) -> Dtype {
        match self {
            OutDtype::F32 => Dtype::F32,
            OutDtype::Bf16 => Dtype::Bf16,
            OutDtype::F16 => Dtype::F16,
        }
    }
}

/// What a consolidation wrote.
#[derive(Clone, Debug, PartialEq)]
pub struct Consolidated {
    /// The file.
    pub path: PathBuf,
    /// Tensors in it.
    pub tensors: usize,
    /// Parameters in it.
    pub params: u64,
    /// Bytes of the file.
    pub bytes: u64,
    /// The step of the checkpoint.
    pub step: u64,
}

/// Writes every parameter of the checkpoint in `dir` as one full tensor named as the model
/// names it, in `dtype`, into the safetensors file `out` (written to `out.tmp`, fsynced, then
/// renamed; an existing `out` is replaced only then). The manifest is validated before any
/// rank file is read, every rank file is opened (size and header checked) before a buffer is
/// sized from the manifest, and every rank file is verified (its hash over all of it) before
/// the file is renamed into place; on any error `out.tmp` is removed and `out` is untouched.
/// An `out` inside the checkpoint directory (which it would overwrite), an existing directory,
/// an existing file that is not a safetensors file, or one whose directory does not exist is
/// refused ([`Error::Output`]) before anything is read; so is an `out.tmp` that is not a file
/// an earlier consolidation left (one that is, is replaced).
pub fn consolidate(dir: &Path, out: &Path, dtype: OutDtype) -> Result<Consolidated> {
    consolidate_until(dir, out, dtype, &|| false)?
        .ok_or_else(|| Error::Invalid("a consolidation stopped unasked".into()))
}

/// [`consolidate`], asking `stop` between tensors and between rank files, and once more
/// before the rename: when it answers true, `out.tmp` is removed, `out` is left as it was and
/// the answer is `None` (a command interrupted by a signal cleans up this way).
pub fn consolidate_until(
    dir: &Path,
    out: &Path,
    dtype: OutDtype,
    stop: &dyn Fn() -> bool,
) -> Result<Option<Consolidated>> {
    let ckpt = Checkpoint::open(dir)?;
    check_output(dir, out)?;
    let tmp = consolidate_tmp(out);
    match write(&ckpt, &tmp, dtype, stop) {
        Ok(Some((tensors, params, size))) => {
            std::fs::rename(&tmp, out).map_err(|e| {
                let _ = std::fs::remove_file(&tmp);
                Error::io("rename into place", &tmp, e)
            })?;
            ckpt.warn_if_unsealed();
            Ok(Some(Consolidated {
                path: out.to_path_buf(),
                tensors,
                params,
                bytes: size,
                step: ckpt.manifest.step,
            }))
        }
        Ok(None) => {
            let _ = std::fs::remove_file(&tmp);
            Ok(None)
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
}

/// `out.tmp`: where a consolidation is written before it is renamed to `out`.
pub fn consolidate_tmp(out: &Path) -> PathBuf {
    let mut name = out.as_os_str().to_owned();
    name.push(".tmp");
    PathBuf::from(name)
}

/// Refuses an output file `out` that cannot be written as one (see [`consolidate`]), saying
/// what to give instead.
fn check_output(dir: &Path, out: &Path) -> Result<()> {
    crate::refuse_inside(dir, out)?;
    let bad = |detail: String| {
        Err(Error::Output {
            path: out.to_path_buf(),
            detail,
        })
    };
    if out.is_dir() {
        return bad(format!(
            "is a directory; give a file path, such as {}",
            out.join("model.safetensors").display()
        ));
    }
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    match std::fs::metadata(parent) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => {
            return bad(format!(
                "{} is not a directory; give a path inside a directory",
                parent.display()
            ))
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return bad(format!(
                "its directory {} does not exist; create it (mkdir -p {}) or give another path",
                parent.display(),
                parent.display()
            ))
        }
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => {
            return bad(format!(
                "a part of {} is a file, not a directory; give a path inside a directory",
                parent.display()
            ))
        }
        Err(e) => return Err(Error::io("stat", parent, e)),
    }
    // An existing file is replaced (docs/config.md), but only one this command could have
    // written: a config, a JSON or any other file is not overwritten by mistake.
    if let Some(what) = not_safetensors(out, false)? {
        return bad(format!(
            "exists and is {what}, not a safetensors file; consolidate replaces only a \
             safetensors file: remove it or give another path"
        ));
    }
    let tmp = consolidate_tmp(out);
    if let Some(what) = not_safetensors(&tmp, true)? {
        return bad(format!(
            "{} exists and is {what}, not the partial file of an earlier consolidation; \
             remove it or give another path",
            tmp.display()
        ));
    }
    Ok(())
}

/// Largest safetensors header taken as one when an existing file is looked at.
const MAX_HEADER: u64 = 100 << 20;

/// What the existing `path` is when it is not a safetensors file (`a FIFO`, `a file of 12
/// bytes`); `None` when nothing is there or it starts with a safetensors header (8 bytes of
/// length, then a JSON object), or, with `empty_ok`, when it is an empty file (a consolidation
/// killed before its first write leaves one).
fn not_safetensors(path: &Path, empty_ok: bool) -> Result<Option<String>> {
    use std::io::Read;
    let (mut f, len) = match crate::open_regular(path).map_err(|e| Error::io("open", path, e))? {
        crate::Opened::Missing => return Ok(None),
        crate::Opened::NotRegular(kind) => return Ok(Some(kind.to_string())),
        crate::Opened::File(f, len) => (f, len),
    };
    if len == 0 && empty_ok {
        return Ok(None);
    }
    let other = Ok(Some(format!("a file of {len} bytes")));
    let mut word = [0u8; 8];
    if len < 8 || f.read_exact(&mut word).is_err() {
        return other;
    }
    let n = u64::from_le_bytes(word);
    if !(2..=MAX_HEADER).contains(&n) || n > len - 8 {
        return other;
    }
    let mut head = vec![0u8; n as usize];
    if f.read_exact(&mut head).is_err() {
        return other;
    }
    match serde_json::from_slice::<serde_json::Map<String, serde_json::Value>>(&head) {
        Ok(_) => Ok(None),
        Err(_) => other,
    }
}

/// Writes the consolidated file to `tmp` and verifies every rank file; returns the tensors,
/// parameters and bytes written, or `None` as soon as `stop` answers true.
fn write(
    ckpt: &Checkpoint,
    tmp: &Path,
    dtype: OutDtype,
    stop: &dyn Fn() -> bool,
) -> Result<Option<(usize, u64, u64)>> {
    let m = &ckpt.manifest;
    let mut reader = ckpt.reader();
    reader.open_all()?;
    let d = dtype.dtype();
    let specs: Vec<TensorSpec> = m
        .units
        .iter()
        .flat_map(|u| &u.views)
        .map(|v| TensorSpec {
            name: v.name.clone(),
            dtype: d,
            shape: v.shape.iter().map(|&s| s as usize).collect(),
        })
        .collect();
    let mut meta = std::collections::HashMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    let head = header(&specs, Some(meta))?;
    let f = File::create(tmp).map_err(|e| Error::io("create", tmp, e))?;
    let mut w = BufWriter::with_capacity(8 << 20, f);
    let put =
        |w: &mut BufWriter<File>, b: &[u8]| w.write_all(b).map_err(|e| Error::io("write", tmp, e));
    put(&mut w, &head)?;
    let (mut buf, mut bytes) = (Vec::<f32>::new(), Vec::<u8>::new());
    let mut params = 0u64;
    for (i, u) in m.units.iter().enumerate() {
        for v in &u.views {
            if stop() {
                return Ok(None);
            }
            buf.clear();
            buf.resize(v.numel as usize, 0.0);
            reader.read(i, Part::Master, v.offset, &mut buf)?;
            bytes.clear();
            let data: &[u8] = match dtype {
                // The values as they are: no second buffer.
                OutDtype::F32 if cfg!(target_endian = "little") => {
                    // SAFETY: f32 has no padding bytes; the view covers exactly `buf`.
                    unsafe { std::slice::from_raw_parts(buf.as_ptr() as *const u8, buf.len() * 4) }
                }
                OutDtype::F32 => {
                    bytes.extend(buf.iter().flat_map(|x| x.to_le_bytes()));
                    &bytes
                }
                OutDtype::Bf16 => {
                    bytes.extend(
                        buf.iter()
                            .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()),
                    );
                    &bytes
                }
                OutDtype::F16 => {
                    bytes.extend(
                        buf.iter()
                            .flat_map(|&x| half::f16::from_f32(x).to_le_bytes()),
                    );
                    &bytes
                }
            };
            put(&mut w, data)?;
            params += v.numel;
        }
    }
    // Only verified data leaves: every rank file, read or not, against its hash.
    for rank in 0..m.world_size {
        if stop() {
            return Ok(None);
        }
        reader.open(rank)?.verify()?;
    }
    let f = w
        .into_inner()
        .map_err(|e| Error::io("write", tmp, e.into_error()))?;
    f.sync_all().map_err(|e| Error::io("sync", tmp, e))?;
    let size = f.metadata().map_err(|e| Error::io("stat", tmp, e))?.len();
    if stop() {
        return Ok(None);
    }
    Ok(Some((specs.len(), params, size)))
}
