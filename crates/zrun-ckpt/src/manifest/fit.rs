//! Whether a checkpoint fits the model that reads it: the model's description (its family
//! and Hugging Face config, which fix what the parameters compute) and the view tables (which
//! fix where each parameter lies in the flat buffers).

use std::collections::BTreeSet;
use std::path::Path;

use serde_json::Value;

use super::{Manifest, UnitEntry};
use crate::{Error, Result};

/// Hugging Face config keys that describe a model without changing what it computes (the
/// initialisation a resumed run does not repeat, the dtype of the export, generation ids).
const DESCRIPTIVE: &[&str] = &[
    "architectures",
    "initializer_range",
    "torch_dtype",
    "use_cache",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
    "transformers_version",
];

impl Manifest {
    /// Checks that `here` (the running model's description, as a manifest records it: `arch`
    /// and `hf_config`) is the model this checkpoint holds: the same family and the same
    /// Hugging Face config, but for keys that only describe it. Equal shapes are not enough:
    /// another head count or rotary base computes something else with the same tensors. The
    /// error names every key that differs with both values, then `fix`. A checkpoint that
    /// records no config is checked by its tables alone ([`Manifest::check_units`]).
    pub fn check_model(&self, dir: &Path, here: &Value, fix: &str) -> Result<()> {
        let diffs = differences(&self.model, here);
        if diffs.is_empty() {
            return Ok(());
        }
        Err(Error::Mismatch {
            dir: dir.to_path_buf(),
            detail: format!("it holds another model ({}): {fix}", diffs.join(", ")),
        })
    }

    /// Checks that `units` (the running model's view tables) lay the flat buffers out as this
    /// checkpoint does; the error names the first parameter or unit that differs, then `fix`.
    pub fn check_units(&self, dir: &Path, units: &[UnitEntry], fix: &str) -> Result<()> {
        let mismatch = |detail: String| Error::Mismatch {
            dir: dir.to_path_buf(),
            detail: format!("{detail}: {fix}"),
        };
        let flat = |units: &[UnitEntry]| -> Vec<(String, String, Vec<u64>, u64)> {
            units
                .iter()
                .flat_map(|u| {
                    u.views
                        .iter()
                        .map(|v| (u.name.clone(), v.name.clone(), v.shape.clone(), v.offset))
                })
                .collect()
        };
        let (here, there) = (flat(units), flat(&self.units));
        // Names and shapes first, parameter by parameter in model order, so the first
        // difference is named whatever it is (a shape, a name, a layer more or less); an
        // offset only differs when the parameters before it are the same but ordered
        // otherwise.
        for i in 0..here.len().max(there.len()) {
            match (here.get(i), there.get(i)) {
                (Some(a), None) => {
                    return Err(mismatch(format!(
                        "parameter `{}` is not in the checkpoint",
                        a.1
                    )))
                }
                (None, Some(b)) => {
                    return Err(mismatch(format!(
                        "the checkpoint's parameter `{}` is not in this model",
                        b.1
                    )))
                }
                (Some(a), Some(b)) if (&a.0, &a.1) != (&b.0, &b.1) => {
                    return Err(mismatch(format!(
                        "parameter `{}` (unit `{}`) here is `{}` (unit `{}`) in the checkpoint",
                        a.1, a.0, b.1, b.0
                    )))
                }
                (Some(a), Some(b)) if a.2 != b.2 => {
                    return Err(mismatch(format!(
                        "parameter `{}` has shape {:?} here but {:?} in the checkpoint",
                        a.1, a.2, b.2
                    )))
                }
                _ => {}
            }
        }
        if let Some((a, b)) = here.iter().zip(&there).find(|(a, b)| a.3 != b.3) {
            return Err(mismatch(format!(
                "parameter `{}` starts at element {} of unit `{}` here but at {} in the checkpoint",
                a.1, a.3, a.0, b.3
            )));
        }
        for (a, b) in units.iter().zip(&self.units) {
            if a.numel != b.numel {
                return Err(mismatch(format!(
                    "unit `{}` has {} elements here, {} in the checkpoint",
                    a.name, a.numel, b.numel
                )));
            }
        }
        Ok(())
    }
}

/// `key A, B here` for the family and every Hugging Face config key (descriptive ones aside)
/// whose values differ; none when the checkpoint records no config.
fn differences(there: &Value, here: &Value) -> Vec<String> {
    let mut out = Vec::new();
    let show = |v: Option<&Value>| {
        let s = v.map_or("(none)".to_string(), Value::to_string);
        if s.chars().count() > 40 {
            format!("{}...", s.chars().take(40).collect::<String>())
        } else {
            s
        }
    };
    let mut compare = |key: &str, a: Option<&Value>, b: Option<&Value>| {
        let (x, y) = (a.unwrap_or(&Value::Null), b.unwrap_or(&Value::Null));
        let same = match (x.as_f64(), y.as_f64()) {
            (Some(p), Some(q)) => p == q,
            _ => x == y,
        };
        if !same {
            out.push(format!("{key} {} there, {} here", show(a), show(b)));
        }
    };
    compare("arch", there.get("arch"), here.get("arch"));
    let (Some(a), Some(b)) = (
        there.get("hf_config").and_then(Value::as_object),
        here.get("hf_config").and_then(Value::as_object),
    ) else {
        return out;
    };
    // A key one side lacks is not compared: a checkpoint of an older zrun records fewer.
    let keys: BTreeSet<&String> = a.keys().filter(|k| b.contains_key(*k)).collect();
    for k in keys {
        if !DESCRIPTIVE.contains(&k.as_str()) {
            compare(k, a.get(k), b.get(k));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn what_the_model_computes_must_match_what_describes_it_need_not() {
        let model = |heads: u64, theta: f64, init: f64| {
            json!({"arch": "llama", "seq_len": 16, "hf_config": {
                "num_attention_heads": heads, "rope_theta": theta, "initializer_range": init,
                "rope_scaling": null}})
        };
        let ckpt = model(4, 10000.0, 0.02);
        assert!(differences(&ckpt, &model(4, 10000.0, 0.05)).is_empty());
        assert_eq!(
            differences(&ckpt, &model(8, 500000.0, 0.02)),
            [
                "num_attention_heads 4 there, 8 here",
                "rope_theta 10000.0 there, 500000.0 here"
            ]
        );
        // An integer written as a float (or the other way) is the same number; a key only
        // one side has (a config key newer than the checkpoint) is not compared.
        let mut other = model(4, 10000.0, 0.02);
        other["hf_config"]["rope_theta"] = json!(10000);
        other["hf_config"]["head_dim"] = json!(16);
        assert!(differences(&ckpt, &other).is_empty());
        other["hf_config"]["rope_scaling"] = json!({"factor": 8.0});
        assert_eq!(
            differences(&ckpt, &other),
            ["rope_scaling null there, {\"factor\":8.0} here"]
        );
        let gpt = json!({"arch": "gpt", "hf_config": {"n_head": 4}});
        assert_eq!(
            differences(&ckpt, &gpt)[0],
            "arch \"llama\" there, \"gpt\" here"
        );
        // A checkpoint that records no config: its tables alone decide.
        assert!(differences(&json!({"arch": "gpt"}), &gpt).is_empty());
    }
}
