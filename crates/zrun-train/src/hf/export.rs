//! `zrun export CKPT --hf OUT`: a Hugging Face directory from a checkpoint of any world size,
//! streamed parameter by parameter; and whole models (a checkpoint or a Hugging Face
//! directory) read into memory for `zrun sample`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use tch::Tensor;
use zrun_ckpt::{Checkpoint, Dtype, HfDir, HfWriter, OutDtype, Part, TensorSpec};
use zrun_models::{ArchConfig, Model};

use super::{bad, sources};
use crate::Error;

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

/// The tokenizer file a checkpoint's run used, if it recorded one.
pub fn checkpoint_tokenizer(ckpt: &Checkpoint) -> Option<PathBuf> {
    ckpt.manifest.model["tokenizer"].as_str().map(PathBuf::from)
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

/// Writes the checkpoint `dir` as a Hugging Face model directory `out`: `config.json`, the
/// weights in `dtype` in shards of at most `max_shard_bytes` (with an index when there are
/// several), and the tokenizer files of the run when it recorded a tokenizer. Every rank file
/// is verified first.
pub fn export(
    dir: &Path,
    out: &Path,
    dtype: OutDtype,
    max_shard_bytes: u64,
) -> Result<Exported, Error> {
    let ckpt = Checkpoint::open(dir)?;
    let arch = checkpoint_arch(&ckpt)?;
    let model = arch.build()?;
    let mut reader = ckpt.reader();
    reader.verify()?;
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
    let mut writer = HfWriter::create(out, specs, max_shard_bytes)?;
    let (mut buf, mut params, mut tensors) = (Vec::<f32>::new(), 0u64, 0usize);
    for (i, u) in units.iter().enumerate() {
        for v in &u.views {
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
    zrun_ckpt::write_json(out, "config.json", &config)?;
    let tokenizer = match checkpoint_tokenizer(&ckpt) {
        Some(t) => copy_tokenizer(&t, out)?,
        None => Vec::new(),
    };
    Ok(Exported {
        files,
        tensors,
        params,
        tokenizer,
        step: ckpt.manifest.step,
    })
}

/// Copies the tokenizer file `t` into `out` as `tokenizer.json`, with the tokenizer files
/// beside it (`tokenizer_config.json`, `special_tokens_map.json`).
fn copy_tokenizer(t: &Path, out: &Path) -> Result<Vec<String>, Error> {
    if !t.is_file() {
        return Err(bad(
            t,
            "the run's tokenizer file is gone; export without it by moving it back, or copy a tokenizer.json into the export yourself".into(),
        ));
    }
    let from = t.parent().unwrap_or(Path::new("."));
    let mut copied = zrun_ckpt::copy_tokenizer_files(from, out)?;
    if t.file_name() != Some(std::ffi::OsStr::new("tokenizer.json")) {
        let dst = out.join("tokenizer.json");
        std::fs::copy(t, &dst).map_err(|e| Error::Io {
            path: dst.clone(),
            source: e,
        })?;
        copied.push("tokenizer.json".into());
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
/// checkpoint directory, or a `checkpoint.dir` (its newest complete checkpoint).
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
    let mut reader = ckpt.reader();
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
    reader.verify()?;
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
