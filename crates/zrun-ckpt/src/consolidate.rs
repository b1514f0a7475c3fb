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
/// or one whose directory does not exist is refused ([`Error::Output`]) before anything is read.
pub fn consolidate(dir: &Path, out: &Path, dtype: OutDtype) -> Result<Consolidated> {
    let ckpt = Checkpoint::open(dir)?;
    check_output(dir, out)?;
    let mut tmp_name = out.as_os_str().to_owned();
    tmp_name.push(".tmp");
    let tmp = PathBuf::from(tmp_name);
    match write(&ckpt, &tmp, dtype) {
        Ok((tensors, params, size)) => {
            std::fs::rename(&tmp, out).map_err(|e| {
                let _ = std::fs::remove_file(&tmp);
                Error::io("rename into place", &tmp, e)
            })?;
            ckpt.warn_if_unsealed();
            Ok(Consolidated {
                path: out.to_path_buf(),
                tensors,
                params,
                bytes: size,
                step: ckpt.manifest.step,
            })
        }
        Err(e) => {
            let _ = std::fs::remove_file(&tmp);
            Err(e)
        }
    }
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
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => bad(format!(
            "{} is not a directory; give a path inside a directory",
            parent.display()
        )),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => bad(format!(
            "its directory {} does not exist; create it (mkdir -p {}) or give another path",
            parent.display(),
            parent.display()
        )),
        Err(e) if e.raw_os_error() == Some(libc::ENOTDIR) => bad(format!(
            "a part of {} is a file, not a directory; give a path inside a directory",
            parent.display()
        )),
        Err(e) => Err(Error::io("stat", parent, e)),
    }
}

/// Writes the consolidated file to `tmp` and verifies every rank file; returns the tensors,
/// parameters and bytes written.
fn write(ckpt: &Checkpoint, tmp: &Path, dtype: OutDtype) -> Result<(usize, u64, u64)> {
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
    reader.verify_all()?;
    let f = w
        .into_inner()
        .map_err(|e| Error::io("write", tmp, e.into_error()))?;
    f.sync_all().map_err(|e| Error::io("sync", tmp, e))?;
    let size = f.metadata().map_err(|e| Error::io("stat", tmp, e))?.len();
    Ok((specs.len(), params, size))
}
