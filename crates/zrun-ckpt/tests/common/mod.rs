//! Helpers of the checkpoint-file tests: a two-unit checkpoint written by hand as W ranks
//! would write it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use zrun_ckpt::{
    commit, rank_file_name, tmp_dir, DataPosition, Dtype, Manifest, OptimizerState, Part,
    RankEntry, RankWriter, ScalerState, ScheduleState, TensorSpec, UnitEntry, ViewEntry, FORMAT,
    FORMAT_VERSION,
};

/// Two units: `embed` (a 5x3 table and a 4-vector: 19 elements) and `head` (a 2x2 matrix).
pub fn units() -> Vec<UnitEntry> {
    let view = |name: &str, shape: Vec<u64>, offset: u64| ViewEntry {
        name: name.into(),
        numel: shape.iter().product(),
        shape,
        offset,
        decay: true,
    };
    vec![
        UnitEntry {
            name: "embed".into(),
            numel: 19,
            views: vec![
                view("wte.weight", vec![5, 3], 0),
                view("ln.bias", vec![4], 15),
            ],
            shards: vec![],
        },
        UnitEntry {
            name: "head".into(),
            numel: 4,
            views: vec![view("head.weight", vec![2, 2], 0)],
            shards: vec![],
        },
    ]
}

/// The value every test expects at element `i` of unit `u`'s `part`.
pub fn value(u: usize, part: Part, i: u64) -> f32 {
    let scale = match part {
        Part::Master => 1.0,
        Part::ExpAvg => 1024.0,
        Part::ExpAvgSq => 1.0 / 1024.0,
        Part::Delayed => 2.0,
    };
    // Distinct small integers times a power of two: exact in bf16, so bf16 moments
    // round-trip exactly.
    scale * (1 + i + 32 * u as u64) as f32
}

/// Writes the checkpoint of step `step` as `world` ranks would; returns its directory.
pub fn save(root: &Path, step: u64, world: usize, moments: Dtype) -> PathBuf {
    let (tmp, manifest) = write_ranks(root, step, world, moments);
    commit(&tmp, &manifest).unwrap()
}

/// Writes the rank files of a checkpoint into its temporary directory; returns that directory
/// and the manifest to commit.
pub fn write_ranks(root: &Path, step: u64, world: usize, moments: Dtype) -> (PathBuf, Manifest) {
    let mut units = units();
    for u in &mut units {
        u.shards = UnitEntry::even_shards(u.numel, world);
    }
    let tmp = tmp_dir(root, step);
    let mut files = Vec::new();
    for r in 0..world {
        let mut specs = Vec::new();
        for u in &units {
            let len = u.shards[r].len as usize;
            if len == 0 {
                continue;
            }
            for part in Part::ALL {
                let dtype = if part == Part::Master {
                    Dtype::F32
                } else {
                    moments
                };
                specs.push(TensorSpec {
                    name: zrun_ckpt::tensor_name(&u.name, part),
                    dtype,
                    shape: vec![len],
                });
            }
        }
        specs.push(TensorSpec {
            name: zrun_ckpt::rng_name("cpu"),
            dtype: Dtype::U8,
            shape: vec![3],
        });
        let mut w = RankWriter::create(&tmp, &rank_file_name(r), specs).unwrap();
        for (ui, u) in units.iter().enumerate() {
            let s = u.shards[r];
            if s.len == 0 {
                continue;
            }
            for part in Part::ALL {
                let vals = (s.start..s.start + s.len).map(|i| value(ui, part, i));
                let bytes: Vec<u8> = match (part, moments) {
                    (Part::Master, _) | (_, Dtype::F32) => {
                        vals.flat_map(f32::to_le_bytes).collect()
                    }
                    _ => vals
                        .flat_map(|v| half::bf16::from_f32(v).to_le_bytes())
                        .collect(),
                };
                w.write(&bytes).unwrap();
            }
        }
        w.write(&[r as u8, 7, 9]).unwrap();
        files.push(w.finish().unwrap());
    }
    let manifest = Manifest {
        format: FORMAT.into(),
        format_version: FORMAT_VERSION,
        zrun_version: "test".into(),
        step,
        tokens_seen: step * 64,
        data: DataPosition {
            next_sample: step * 4,
            global_batch: 4,
            seq_len: 16,
        },
        model: serde_json::json!({"arch": "test"}),
        world_size: world,
        stage: 3,
        precision: "fp32".into(),
        offload: "none".into(),
        optimizer: OptimizerState {
            name: "adamw".into(),
            steps: step,
            state_dtype: if moments == Dtype::Bf16 {
                "bf16"
            } else {
                "fp32"
            }
            .into(),
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
        },
        schedule: ScheduleState {
            step,
            lr: 1e-3,
            peak: 1e-3,
            min: 1e-4,
            warmup_steps: 0,
            total_steps: 100,
        },
        loss_scaler: ScalerState {
            enabled: false,
            scale: 1.0,
            clean_steps: 0,
        },
        units,
        ranks: (0..world)
            .map(|r| RankEntry {
                rank: r,
                file: rank_file_name(r),
                rng: vec!["cpu".into()],
            })
            .collect(),
        files,
        run: None,
        data_order: None,
        delayed_params: false,
    };
    (tmp, manifest)
}
