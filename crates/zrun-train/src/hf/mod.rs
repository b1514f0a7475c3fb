//! `model.init_from`: a Hugging Face model directory's weights into the engine, each rank
//! reading only the slices it keeps from the memory-mapped files.

use std::collections::HashMap;
use std::path::Path;

use zrun_ckpt::HfDir;
use zrun_models::{ArchConfig, HfParam, Model};
use zrun_shard::{Counters, Engine, StatePart};

use crate::Error;

mod export;

pub use export::{
    check_checkpoint_views, checkpoint_arch, export, export_tmp, export_until, load_full,
    remove_killed_exports, Exported, Loaded,
};

/// Where one parameter comes from: the file's tensor name and whether it is stored
/// transposed (GPT-2's Conv1D).
pub(crate) struct Source {
    tensor: String,
    transpose: bool,
}

/// A bad model directory: exit code 2, naming the file and the tensor.
pub(crate) fn bad(path: &Path, detail: String) -> Error {
    Error::Ckpt(zrun_ckpt::Error::Hf {
        path: path.to_path_buf(),
        detail,
    })
}

/// Finds every parameter of `model` (built from `arch`, the same directory's config.json) in
/// `hf`, checking its shape. Names are matched as Hugging Face writes them, also without the
/// `transformer.` / `model.` prefix that base-model checkpoints leave out; a tensor of the
/// file that the model neither uses nor knows to skip (mask buffers, a tied head's copy) is an
/// error, as the file then describes another model than config.json.
pub(crate) fn sources(
    hf: &HfDir,
    arch: &ArchConfig,
    model: &dyn Model,
) -> Result<HashMap<String, Source>, Error> {
    let shapes: HashMap<&str, &[i64]> = model
        .units()
        .iter()
        .flat_map(|u| u.params())
        .map(|p| (p.name.as_str(), p.shape.as_slice()))
        .collect();
    // The file's tensors by the name hf_params uses.
    let in_file: HashMap<String, &String> = hf
        .names()
        .iter()
        .map(|n| (arch.hf_alias(n).unwrap_or_else(|| n.clone()), n))
        .collect();
    let mut out = HashMap::new();
    for HfParam {
        name,
        hf_name,
        transpose,
    } in model.hf_params()
    {
        let Some((tensor, info)) = in_file
            .get(&hf_name)
            .and_then(|n| hf.info(n).map(|i| ((*n).clone(), i)))
        else {
            return Err(bad(
                hf.dir(),
                format!(
                    "tensor `{hf_name}` is missing from the weights, but {} describes a model that has it; pass a complete model directory",
                    hf.config_path().display()
                ),
            ));
        };
        let want: Vec<usize> = shapes
            .get(name.as_str())
            .map(|s| s.iter().map(|&d| d as usize).collect())
            .unwrap_or_default();
        let stored: Vec<usize> = if transpose {
            want.iter().rev().copied().collect()
        } else {
            want.clone()
        };
        if info.shape != stored {
            return Err(bad(
                &info.file,
                format!(
                    "tensor `{tensor}` has shape {:?}, but {} implies {stored:?}; the weights and config.json disagree",
                    info.shape,
                    hf.config_path().display()
                ),
            ));
        }
        out.insert(name, Source { tensor, transpose });
    }
    let used: std::collections::HashSet<&str> = out.values().map(|s| s.tensor.as_str()).collect();
    if let Some(extra) = hf
        .names()
        .iter()
        .find(|n| !used.contains(n.as_str()) && !arch.hf_ignored(n))
    {
        let file = hf.file_of(extra).unwrap_or(hf.dir());
        return Err(bad(
            file,
            format!(
                "tensor `{extra}` is not part of the {} model {} describes; the weights and config.json disagree",
                arch.arch(),
                hf.config_path().display()
            ),
        ));
    }
    Ok(out)
}

/// Loads the weights of the Hugging Face directory `dir` into `engine` as the starting point
/// of a run (optimizer state zero, step 0). Every rank calls it and reads only the element
/// ranges it keeps, so at stage 3 no rank holds the whole model.
pub fn load_into(
    engine: &mut Engine,
    arch: &ArchConfig,
    model: &dyn Model,
    dir: &Path,
) -> Result<(), Error> {
    let hf = HfDir::open(dir)?;
    let src = sources(&hf, arch, model)?;
    let layout = engine.layout().clone();
    for (u, l) in layout.units.iter().enumerate() {
        let (start, len) = engine.loaded_range(u);
        engine.load_unit_with(u, |part, buf| -> Result<(), Error> {
            if part != StatePart::Master {
                buf.fill(0.0);
                return Ok(());
            }
            buf.fill(0.0); // padding
            for v in &l.views {
                let lo = v.offset.max(start);
                let hi = (v.offset + v.numel).min(start + len);
                if lo >= hi {
                    continue;
                }
                let s = &src[&v.name];
                let out = &mut buf[(lo - start) as usize..(hi - start) as usize];
                let at = (lo - v.offset) as usize;
                if s.transpose {
                    hf.read_transposed(&s.tensor, at, out)?;
                } else {
                    hf.read(&s.tensor, at, out)?;
                }
            }
            Ok(())
        })?;
    }
    let scale = engine.loss_scale();
    engine.finish_load(Counters {
        optimizer_steps: 0,
        loss_scale: scale,
        clean_steps: 0,
        params_behind: false,
    })?;
    Ok(())
}
