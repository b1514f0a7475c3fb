//! `zrun export CKPT --hf OUT`: a Hugging Face directory from a checkpoint of any world size,
//! streamed parameter by parameter; and whole models (a checkpoint or a Hugging Face
//! directory) read into memory for `zrun sample`.
//!
//! A checkpoint is untrusted input: its manifest is validated when it is opened, every rank
//! file is opened (sizes and headers checked) before a buffer is sized from the manifest, its
//! views must be the parameters of the model its `hf_config` describes, and every rank file's
//! hash is verified after reading and before anything read is used or becomes visible. An
//! export is written into `OUT.tmp-<pid>` beside `OUT` and renamed to `OUT` only when complete
//! and verified; on any error, or when asked to stop ([`export_until`]), the temporary
//! directory is removed and no `OUT` appears. One a killed export left is removed by the next
//! export into `OUT` ([`remove_killed_exports`]).

use std::collections::HashMap;
use std::io::Write;
use std::path::{Component, Path, PathBuf};

use tch::Tensor;
use zrun_ckpt::{Checkpoint, Dtype, HfDir, HfWriter, OutDtype, Part, TensorSpec};
use zrun_models::{ArchConfig, Model};

use super::{bad, sources};
use crate::Error;

/// Largest tokenizer file (and tokenizer_config.json, special_tokens_map.json) an export
/// copies; a 256k-token vocabulary's tokenizer.json is about 35 MB.
const MAX_TOKENIZER_BYTES: u64 = 256 << 20;

/// What an export wrote.
#[derive(Clone, Debug)]
pub struct Exported {
    /// The weights files, in order.
    pub files: Vec<PathBuf>,
    /// Tensors written.
    pub tensors: usize,
    /// Parameters written.
    pub params: u64,
    /// Tokenizer files copied.
    pub tokenizer: Vec<String>,
    /// Why the tokenizer the checkpoint records was not copied, when it was not.
    pub tokenizer_skipped: Option<String>,
    /// The checkpoint's step.
    pub step: u64,
}

/// The architecture a checkpoint was trained with, from its manifest.
pub fn checkpoint_arch(ckpt: &Checkpoint) -> Result<ArchConfig, Error> {
    let manifest = ckpt.dir.join(zrun_ckpt::MANIFEST);
    let Some(hf) = ckpt.manifest.model.get("hf_config") else {
        return Err(bad(
            &manifest,
            "the manifest records no Hugging Face config (a checkpoint from an older zrun); resume it with this version and save again".into(),
        ));
    };
    let mut arch = ArchConfig::from_hf_config(hf).map_err(|e| bad(&manifest, e.to_string()))?;
    if let (ArchConfig::Llama(l), Some(t)) = (&mut arch, ckpt.manifest.model["seq_len"].as_i64()) {
        l.seq_len = t;
    }
    Ok(arch)
}

/// The manifest's view tables must be exactly the parameters of `model` (the model its
/// `hf_config` describes), as a resume checks them ([`zrun_ckpt::Manifest::check_units`]):
/// otherwise the tables were altered, and reshaping or transposing by them would go wrong.
fn check_views(ckpt: &Checkpoint, model: &dyn Model) -> Result<(), Error> {
    let w = ckpt.manifest.world_size as i64;
    let layout = zrun_shard::ShardLayout::new(model.units(), 0, w);
    let units = crate::checkpoint::unit_entries(&layout);
    let fix = "its view tables do not match its own hf_config: the manifest was altered; use \
               another checkpoint";
    Ok(ckpt.manifest.check_units(&ckpt.dir, &units, fix)?)
}

/// A tokenizer file a checkpoint records, read and checked: the bytes to copy and the path.
struct RecordedTokenizer {
    path: PathBuf,
    bytes: Vec<u8>,
}

/// The tokenizer a checkpoint records (`model.tokenizer`, an absolute path taken when it was
/// saved), if it is safe and usable; otherwise why not.
///
/// The manifest is untrusted, so the path is used only when it is absolute without `..`, a
/// regular file (not a link: the path was recorded with links resolved), named `*.json`, at
/// most [`MAX_TOKENIZER_BYTES`], and parses as a Hugging Face tokenizer. So no other file
/// (`/etc/shadow`, a key) can travel into an export whatever a manifest names.
fn recorded_tokenizer(ckpt: &Checkpoint) -> Result<Option<RecordedTokenizer>, String> {
    let value = &ckpt.manifest.model["tokenizer"];
    if value.is_null() {
        return Ok(None);
    }
    let Some(s) = value.as_str() else {
        return Err(format!("model.tokenizer {value} is not a path"));
    };
    let path = PathBuf::from(s);
    let refuse = |why: &str| Err(format!("the recorded tokenizer {s} {why}"));
    if !path.is_absolute() || path.components().any(|c| c == Component::ParentDir) {
        return refuse("is not an absolute path without `..`");
    }
    if path.extension().and_then(|e| e.to_str()) != Some("json") {
        return refuse("is not a .json file");
    }
    let bytes = match read_regular(&path) {
        Ok(b) => b,
        Err(why) => return refuse(&why),
    };
    if tokenizers::Tokenizer::from_bytes(&bytes).is_err() {
        return refuse("is not a Hugging Face tokenizer.json");
    }
    Ok(Some(RecordedTokenizer { path, bytes }))
}

/// The bytes of `path` when it is a regular file (not a link) of at most
/// [`MAX_TOKENIZER_BYTES`]; otherwise why not.
fn read_regular(path: &Path) -> Result<Vec<u8>, String> {
    use std::io::Read;
    let meta = std::fs::symlink_metadata(path).map_err(|e| match e.kind() {
        std::io::ErrorKind::NotFound => "is gone".to_string(),
        _ => format!("cannot be read ({e})"),
    })?;
    if !meta.file_type().is_file() {
        return Err("is not a regular file".into());
    }
    if meta.len() > MAX_TOKENIZER_BYTES {
        return Err(format!("is larger than {MAX_TOKENIZER_BYTES} bytes"));
    }
    let mut bytes = Vec::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_TOKENIZER_BYTES + 1).read_to_end(&mut bytes))
        .map_err(|e| format!("cannot be read ({e})"))?;
    if bytes.len() as u64 > MAX_TOKENIZER_BYTES {
        return Err(format!("is larger than {MAX_TOKENIZER_BYTES} bytes"));
    }
    Ok(bytes)
}

/// The tokenizer file a checkpoint's run used, if it recorded one that passes the checks of
/// [`recorded_tokenizer`].
pub fn checkpoint_tokenizer(ckpt: &Checkpoint) -> Option<PathBuf> {
    recorded_tokenizer(ckpt).ok().flatten().map(|t| t.path)
}

/// `[rows, cols]` values of a 2-D tensor, transposed to `[cols, rows]`.
fn transposed(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; values.len()];
    for (r, row) in values.chunks_exact(cols).enumerate().take(rows) {
        for (c, &x) in row.iter().enumerate() {
            out[c * rows + r] = x;
        }
    }
    out
}

/// `OUT.tmp-<pid>` beside `out`: where this process writes an export before it is renamed to
/// `out`.
pub fn export_tmp(out: &Path) -> Result<PathBuf, Error> {
    let name = out.file_name().ok_or_else(|| {
        bad(
            out,
            "is not a directory name to export into; give one such as out/model".into(),
        )
    })?;
    let mut tmp = name.to_owned();
    tmp.push(format!(".tmp-{}", std::process::id()));
    Ok(out.with_file_name(tmp))
}

/// Names an export writes, each also with `.tmp` while it is written.
const EXPORT_FILES: [&str; 5] = [
    "config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
];

/// Removes the `OUT.tmp-<pid>` directories beside `out` that exports killed before they could
/// clean up left (SIGKILL, a crash): those whose process `pid` no longer runs on this machine
/// and that hold only files an export writes. Returns each directory removed with its pid. A
/// directory that cannot be removed is left as it is: it does not stop this export.
pub fn remove_killed_exports(out: &Path) -> Vec<(PathBuf, i32)> {
    let Some(prefix) = out
        .file_name()
        .and_then(|n| n.to_str())
        .map(|n| format!("{n}.tmp-"))
    else {
        return Vec::new();
    };
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    let Ok(entries) = std::fs::read_dir(parent) else {
        return Vec::new();
    };
    let mut removed = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(pid) = name
            .to_str()
            .and_then(|n| n.strip_prefix(&prefix))
            .filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|d| d.parse::<i32>().ok())
        else {
            continue;
        };
        let path = entry.path();
        let is_dir = entry.file_type().is_ok_and(|t| t.is_dir());
        if pid <= 0 || process_runs(pid) || !is_dir || !only_export_files(&path) {
            continue;
        }
        if std::fs::remove_dir_all(&path).is_ok() {
            removed.push((path, pid));
        }
    }
    removed.sort();
    removed
}

/// True while a process `pid` runs on this machine (one of another user's included; not one
/// that has ended and waits to be reaped, a zombie).
fn process_runs(pid: i32) -> bool {
    // SAFETY: signal 0 only asks whether the process exists; nothing is sent.
    let rc = unsafe { libc::kill(pid, 0) };
    let exists = rc == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
    // /proc/PID/stat: "PID (COMM) STATE ...", COMM possibly holding spaces and parentheses.
    let zombie = || {
        std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|s| {
                s.rsplit_once(')')
                    .map(|(_, rest)| rest.trim_start().starts_with('Z'))
            })
            .unwrap_or(false)
    };
    exists && !zombie()
}

/// True when every entry of `dir` is a regular file named as an export's files are (the
/// weights, `config.json`, the tokenizer files, each maybe with `.tmp`).
fn only_export_files(dir: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries.into_iter().all(|e| {
        let Ok(e) = e else {
            return false;
        };
        let name = e.file_name();
        let Some(name) = name.to_str() else {
            return false;
        };
        let base = name.strip_suffix(".tmp").unwrap_or(name);
        let weights = base.starts_with("model") && base.ends_with(".safetensors");
        e.file_type().is_ok_and(|t| t.is_file()) && (weights || EXPORT_FILES.contains(&base))
    })
}

/// Writes the checkpoint `dir` as a Hugging Face model directory `out`: `config.json`, the
/// weights in `dtype` in shards of at most `max_shard_bytes` (with an index when there are
/// several), and the run's tokenizer files when the checkpoint records a tokenizer that passes
/// [`recorded_tokenizer`]'s checks (otherwise the export goes on without it and says why in
/// [`Exported::tokenizer_skipped`]).
///
/// Everything is written into `OUT.tmp-<pid>` beside `out`; every rank file's hash is verified
/// after the weights are read, and only then is the directory renamed to `out`. On any error
/// the temporary directory is removed and `out` does not appear. An `out` that exists and is
/// not an empty directory is refused before anything is read: an export never writes over or
/// into an earlier one.
pub fn export(
    dir: &Path,
    out: &Path,
    dtype: OutDtype,
    max_shard_bytes: u64,
) -> Result<Exported, Error> {
    export_until(dir, out, dtype, max_shard_bytes, &|| false)?
        .ok_or_else(|| Error::Unsupported("an export stopped unasked".into()))
}

/// [`export`], asking `stop` between tensors and between rank files, and once more before the
/// rename: when it answers true, the temporary directory ([`export_tmp`]) is removed, no
/// `out` appears and the answer is `None` (a command interrupted by a signal cleans up so).
pub fn export_until(
    dir: &Path,
    out: &Path,
    dtype: OutDtype,
    max_shard_bytes: u64,
    stop: &dyn Fn() -> bool,
) -> Result<Option<Exported>, Error> {
    let ckpt = Checkpoint::open(dir)?;
    let empty = match std::fs::read_dir(out) {
        Ok(mut entries) => entries.next().is_none(),
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
    };
    if !empty {
        return Err(bad(
            out,
            "already exists; an export never writes over one: remove it or give another --hf directory".into(),
        ));
    }
    let tmp = export_tmp(out)?;
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::Io {
            path: tmp.clone(),
            source: e,
        })?;
    }
    let done = write_export(&ckpt, &tmp, dtype, max_shard_bytes, stop).and_then(|e| {
        let Some(e) = e.filter(|_| !stop()) else {
            return Ok(None);
        };
        std::fs::rename(&tmp, out).map_err(|source| Error::Io {
            path: out.to_path_buf(),
            source,
        })?;
        if let Some(parent) = out.parent().filter(|p| !p.as_os_str().is_empty()) {
            let _ = std::fs::File::open(parent).and_then(|f| f.sync_all());
        }
        Ok(Some(e))
    });
    match done {
        Ok(Some(mut e)) => {
            for f in &mut e.files {
                if let Some(name) = f.file_name() {
                    *f = out.join(name);
                }
            }
            Ok(Some(e))
        }
        Ok(None) => {
            let _ = std::fs::remove_dir_all(&tmp);
            Ok(None)
        }
        Err(err) => {
            let _ = std::fs::remove_dir_all(&tmp);
            Err(err)
        }
    }
}

/// For a reader that needs no model (`zrun consolidate`): refuses view tables that are not
/// the parameters of the model the checkpoint's `hf_config` describes, as an export does, so
/// an altered manifest cannot name, shape or leave out tensors. A checkpoint that records no
/// config (an older zrun's) is not checked.
pub fn check_checkpoint_views(ckpt: &Checkpoint) -> Result<(), Error> {
    if ckpt.manifest.model.get("hf_config").is_none() {
        return Ok(());
    }
    let model = checkpoint_arch(ckpt)?.build()?;
    check_views(ckpt, model.as_ref())
}

/// The export of `ckpt` into the directory `tmp`, verified; `None` as soon as `stop` answers
/// true (the writer's temporary files removed).
fn write_export(
    ckpt: &Checkpoint,
    tmp: &Path,
    dtype: OutDtype,
    max_shard_bytes: u64,
    stop: &dyn Fn() -> bool,
) -> Result<Option<Exported>, Error> {
    let dir = &ckpt.dir;
    let arch = checkpoint_arch(ckpt)?;
    let model = arch.build()?;
    check_views(ckpt, model.as_ref())?;
    let recorded = recorded_tokenizer(ckpt);
    let mut reader = ckpt.reader();
    // Sizes and headers of every rank file before any buffer is sized from the manifest.
    reader.open_all()?;
    let names: HashMap<String, (String, bool)> = model
        .hf_params()
        .into_iter()
        .map(|p| (p.name, (p.hf_name, p.transpose)))
        .collect();
    let file_dtype = match dtype {
        OutDtype::F32 => Dtype::F32,
        OutDtype::Bf16 => Dtype::Bf16,
        OutDtype::F16 => Dtype::F16,
    };
    let units = &ckpt.manifest.units;
    let mut specs = Vec::new();
    for v in units.iter().flat_map(|u| &u.views) {
        let Some((hf_name, transpose)) = names.get(&v.name) else {
            return Err(Error::Unsupported(format!(
                "{}: parameter {} has no Hugging Face name in this model",
                dir.display(),
                v.name
            )));
        };
        let mut shape: Vec<usize> = v.shape.iter().map(|&s| s as usize).collect();
        if *transpose {
            shape.reverse();
        }
        specs.push(TensorSpec {
            name: hf_name.clone(),
            dtype: file_dtype,
            shape,
        });
    }
    let mut writer = HfWriter::create(tmp, specs, max_shard_bytes)?;
    let (mut buf, mut params, mut tensors) = (Vec::<f32>::new(), 0u64, 0usize);
    for (i, u) in units.iter().enumerate() {
        for v in &u.views {
            if stop() {
                return Ok(None);
            }
            buf.clear();
            buf.resize(v.numel as usize, 0.0);
            reader.read(i, Part::Master, v.offset, &mut buf)?;
            let (hf_name, transpose) = &names[&v.name];
            if *transpose {
                let (rows, cols) = (v.shape[0] as usize, v.shape[1] as usize);
                writer.put(hf_name, &transposed(&buf, rows, cols))?;
            } else {
                writer.put(hf_name, &buf)?;
            }
            params += v.numel;
            tensors += 1;
        }
    }
    // Every rank file against its hash, read or not, before the weights count as written.
    for rank in 0..ckpt.manifest.world_size {
        if stop() {
            return Ok(None);
        }
        reader.open(rank)?.verify()?;
    }
    let files = writer.finish()?;
    let mut config = arch.to_hf_config();
    config["torch_dtype"] = serde_json::json!(match dtype {
        OutDtype::F32 => "float32",
        OutDtype::Bf16 => "bfloat16",
        OutDtype::F16 => "float16",
    });
    if let Some(tokens) = ckpt.manifest.model["special_tokens"].as_object() {
        for (k, v) in tokens {
            config[k] = v.clone();
        }
    }
    zrun_ckpt::write_json(tmp, "config.json", &config)?;
    let (tokenizer, tokenizer_skipped) = match recorded {
        Ok(Some(t)) => (copy_tokenizer(&t, tmp)?, None),
        Ok(None) => (Vec::new(), None),
        Err(why) => (Vec::new(), Some(why)),
    };
    // Said once the export is made: a refused one prints its error alone.
    ckpt.warn_if_unsealed();
    Ok(Some(Exported {
        files,
        tensors,
        params,
        tokenizer,
        tokenizer_skipped,
        step: ckpt.manifest.step,
    }))
}

/// Writes `bytes` to `dir/name`, fsynced.
fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> Result<(), Error> {
    let path = dir.join(name);
    std::fs::File::create(&path)
        .and_then(|mut f| {
            f.write_all(bytes)?;
            f.sync_all()
        })
        .map_err(|source| Error::Io { path, source })
}

/// Writes the checked tokenizer into `out` as `tokenizer.json`, with `tokenizer_config.json`
/// and `special_tokens_map.json` from beside it when each is a regular file of bounded size
/// holding a JSON object. The bytes written are the bytes checked.
fn copy_tokenizer(t: &RecordedTokenizer, out: &Path) -> Result<Vec<String>, Error> {
    write_file(out, "tokenizer.json", &t.bytes)?;
    let mut copied = vec!["tokenizer.json".to_string()];
    let from = t.path.parent().unwrap_or(Path::new("/"));
    for name in ["tokenizer_config.json", "special_tokens_map.json"] {
        let Ok(bytes) = read_regular(&from.join(name)) else {
            continue;
        };
        let is_object =
            serde_json::from_slice::<serde_json::Value>(&bytes).is_ok_and(|v| v.is_object());
        if is_object {
            write_file(out, name, &bytes)?;
            copied.push(name.to_string());
        }
    }
    Ok(copied)
}

/// A whole model in memory: its architecture, every unit's parameters as fp32 CPU tensors,
/// and where its tokenizer is, if known.
pub struct Loaded {
    /// The architecture.
    pub arch: ArchConfig,
    /// The model built from it.
    pub model: std::sync::Arc<dyn Model>,
    /// Each unit's parameters, in `Unit::params()` order.
    pub params: Vec<Vec<Tensor>>,
    /// A tokenizer file that goes with the model.
    pub tokenizer: Option<PathBuf>,
    /// config.json's `eos_token_id`s (none for a checkpoint).
    pub eos: Vec<i64>,
}

/// Reads a whole model from `path`: a Hugging Face directory (an export included), a
/// checkpoint directory, or a `checkpoint.dir` (its newest complete checkpoint). A
/// checkpoint is validated and every rank file verified against its hash before the model is
/// returned; its tokenizer is the one it records when that passes [`recorded_tokenizer`]'s
/// checks.
pub fn load_full(path: &Path) -> Result<Loaded, Error> {
    if path.join("config.json").is_file() {
        return load_hf(path);
    }
    let mut dir = path.to_path_buf();
    if !dir.join(zrun_ckpt::MANIFEST).exists() {
        if let Some((_, newest)) = zrun_ckpt::complete(&dir)?.pop() {
            dir = newest;
        } else {
            return Err(bad(
                path,
                "neither a Hugging Face model directory (config.json) nor a zrun checkpoint (manifest.json); pass one of those".into(),
            ));
        }
    }
    let ckpt = Checkpoint::open(&dir)?;
    let arch = checkpoint_arch(&ckpt)?;
    let model = arch.build()?;
    check_views(&ckpt, model.as_ref())?;
    let mut reader = ckpt.reader();
    // Sizes and headers of every rank file before any buffer is sized from the manifest.
    reader.open_all()?;
    let mut params = Vec::new();
    for (i, u) in ckpt.manifest.units.iter().enumerate() {
        let mut unit = Vec::new();
        for v in &u.views {
            let mut buf = vec![0f32; v.numel as usize];
            reader.read(i, Part::Master, v.offset, &mut buf)?;
            unit.push(tensor(&buf, &v.shape)?);
        }
        params.push(unit);
    }
    // Nothing read is used before every rank file matches its hash.
    reader.verify_all()?;
    ckpt.warn_if_unsealed();
    Ok(Loaded {
        arch,
        model,
        params,
        tokenizer: checkpoint_tokenizer(&ckpt),
        eos: Vec::new(),
    })
}

fn tensor(values: &[f32], shape: &[u64]) -> Result<Tensor, Error> {
    let shape: Vec<i64> = shape.iter().map(|&s| s as i64).collect();
    Tensor::f_from_slice(values)
        .and_then(|t| t.f_reshape(&shape))
        .map_err(|e| Error::Unsupported(format!("cannot build a tensor of shape {shape:?}: {e}")))
}

/// A Hugging Face directory, whole.
fn load_hf(dir: &Path) -> Result<Loaded, Error> {
    let hf = HfDir::open(dir)?;
    let arch = ArchConfig::from_hf_config(hf.config())
        .map_err(|e| bad(hf.config_path(), e.to_string()))?;
    let model = arch.build()?;
    let src = sources(&hf, &arch, model.as_ref())?;
    let mut params = Vec::new();
    for u in model.units() {
        let mut unit = Vec::new();
        for p in u.params() {
            let s = &src[&p.name];
            let mut buf = vec![0f32; p.numel() as usize];
            if s.transpose {
                hf.read_transposed(&s.tensor, 0, &mut buf)?;
            } else {
                hf.read(&s.tensor, 0, &mut buf)?;
            }
            let shape: Vec<u64> = p.shape.iter().map(|&d| d as u64).collect();
            unit.push(tensor(&buf, &shape)?);
        }
        params.push(unit);
    }
    let eos = match &hf.config()["eos_token_id"] {
        serde_json::Value::Number(n) => n.as_i64().into_iter().collect(),
        serde_json::Value::Array(a) => a.iter().filter_map(|v| v.as_i64()).collect(),
        _ => Vec::new(),
    };
    let tok = dir.join("tokenizer.json");
    Ok(Loaded {
        arch,
        model,
        params,
        tokenizer: tok.is_file().then_some(tok),
        eos,
    })
}
