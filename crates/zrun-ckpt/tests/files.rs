//! Checkpoint files end to end, without a model: write a sharded checkpoint as W ranks would,
//! read any range back at any other world size, consolidate, and catch every kind of damage.

mod common;

use std::path::Path;

use common::{save, units, value, write_ranks};
use zrun_ckpt::{
    commit, consolidate, consolidate_tmp, consolidate_until, prune, rank_file_name, tmp_dir,
    Checkpoint, Dtype, Error, OutDtype, Part, UnitEntry, FORMAT_VERSION,
};

#[test]
fn any_range_reads_back_at_any_world_size() {
    for moments in [Dtype::F32, Dtype::Bf16] {
        for world in [1, 2, 3, 5] {
            let root = tempfile::tempdir().unwrap();
            let dir = save(root.path(), 10, world, moments);
            assert!(!tmp_dir(root.path(), 10).exists(), "the commit renames");
            let ckpt = Checkpoint::open(&dir).unwrap();
            assert_eq!(ckpt.manifest.world_size, world);
            let mut reader = ckpt.reader();
            for (ui, numel) in [(0usize, 19u64), (1, 4)] {
                // Every range a reader at world size 1..4 would own, and the whole unit.
                for new_world in 1..=4u64 {
                    let s = numel.div_ceil(new_world);
                    for r in 0..new_world {
                        let start = (r * s).min(numel);
                        let len = (start + s).min(numel) - start;
                        for part in Part::ALL {
                            let mut out = vec![f32::NAN; len as usize];
                            reader.read(ui, part, start, &mut out).unwrap();
                            let want: Vec<f32> =
                                (start..start + len).map(|i| value(ui, part, i)).collect();
                            assert_eq!(out, want, "W {world}->{new_world} unit {ui} {part:?}");
                        }
                    }
                }
            }
            for r in 0..world {
                assert_eq!(reader.rng(r, "cpu").unwrap(), Some(vec![r as u8, 7, 9]));
            }
            assert_eq!(reader.rng(world, "cpu").unwrap(), None);
            assert_eq!(reader.rng(0, "cuda").unwrap(), None);
            reader.verify().unwrap();
        }
    }
}

#[test]
fn consolidation_names_every_parameter_with_its_full_values() {
    let root = tempfile::tempdir().unwrap();
    let dir = save(root.path(), 4, 3, Dtype::F32);
    let out = root.path().join("model.safetensors");
    let c = consolidate(&dir, &out, OutDtype::F32).unwrap();
    assert_eq!((c.tensors, c.params, c.step), (3, 23, 4));
    let bytes = std::fs::read(&out).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    // Each parameter's values, and the values the checkpoint holds at its offsets.
    let f32s = |name: &str, unit: usize, offset: u64, shape: &[usize]| {
        let t = st.tensor(name).unwrap();
        assert_eq!(t.shape(), shape, "{name}");
        let got: Vec<f32> = t
            .data()
            .chunks(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        let n = shape.iter().product::<usize>() as u64;
        let want: Vec<f32> = (offset..offset + n)
            .map(|i| value(unit, Part::Master, i))
            .collect();
        assert_eq!(got, want, "{name}");
    };
    f32s("wte.weight", 0, 0, &[5, 3]);
    f32s("ln.bias", 0, 15, &[4]);
    f32s("head.weight", 1, 0, &[2, 2]);
    // bf16 output rounds each value; these are bf16-exact.
    let out16 = root.path().join("model16.safetensors");
    consolidate(&dir, &out16, OutDtype::Bf16).unwrap();
    let bytes = std::fs::read(&out16).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let h = st.tensor("head.weight").unwrap();
    assert_eq!(h.dtype(), safetensors::Dtype::BF16);
    let first = half::bf16::from_le_bytes([h.data()[2], h.data()[3]]).to_f32();
    assert_eq!(first, value(1, Part::Master, 1));
}

#[test]
fn a_consolidation_asked_to_stop_or_given_another_file_leaves_it_as_it_was() {
    let root = tempfile::tempdir().unwrap();
    let dir = save(root.path(), 4, 3, Dtype::F32);
    let out = root.path().join("model.safetensors");
    let tmp = consolidate_tmp(&out);
    assert_eq!(tmp, root.path().join("model.safetensors.tmp"));
    // Asked at each point in turn (3 tensors, 3 rank files, before the rename): stopped there,
    // nothing written; never asked to stop, it writes the file.
    for at in 1..=8 {
        let asked = std::cell::Cell::new(0);
        let stop = || {
            asked.set(asked.get() + 1);
            asked.get() == at
        };
        let done = consolidate_until(&dir, &out, OutDtype::F32, &stop).unwrap();
        assert_eq!(done.is_none(), at <= 7, "asked {at}");
        assert_eq!(out.exists(), at > 7, "asked {at}");
        assert!(!tmp.exists(), "asked {at}");
    }
    // An earlier consolidation is replaced; any other file, or a FILE.tmp that is not an
    // earlier consolidation's partial file, is refused and left as it was.
    let first = std::fs::read(&out).unwrap();
    consolidate(&dir, &out, OutDtype::Bf16).unwrap();
    assert_ne!(std::fs::read(&out).unwrap(), first);
    let notes = root.path().join("notes.txt");
    std::fs::write(&notes, b"keep me").unwrap();
    let e = consolidate(&dir, &notes, OutDtype::F32).unwrap_err();
    assert!(e.is_bad_input(), "{e}");
    assert!(
        e.to_string()
            .contains("is a file of 7 bytes, not a safetensors file"),
        "{e}"
    );
    assert_eq!(std::fs::read(&notes).unwrap(), b"keep me");
    std::fs::write(&tmp, b"mine").unwrap();
    let e = consolidate(&dir, &out, OutDtype::F32).unwrap_err();
    assert!(
        e.to_string().contains("model.safetensors.tmp exists"),
        "{e}"
    );
    assert_eq!(std::fs::read(&tmp).unwrap(), b"mine");
}

/// The error of opening rank `rank`'s file of the checkpoint in `dir`.
fn open_error(dir: &Path, rank: usize) -> Error {
    let ckpt = Checkpoint::open(dir).unwrap();
    let mut reader = ckpt.reader();
    match reader.open(rank).and_then(|f| f.verify()) {
        Ok(()) => panic!("rank {rank}'s file passed"),
        Err(e) => e,
    }
}

#[test]
fn damage_is_caught_and_named() {
    let root = tempfile::tempdir().unwrap();
    let dir = save(root.path(), 3, 2, Dtype::F32);
    let f1 = dir.join(rank_file_name(1));
    let good = std::fs::read(&f1).unwrap();
    // A flipped byte in the data.
    let mut bad = good.clone();
    let at = bad.len() - 5;
    bad[at] ^= 0x10;
    std::fs::write(&f1, &bad).unwrap();
    let e = open_error(&dir, 1);
    assert!(e.is_damaged(), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("rank-00001.safetensors") && msg.contains("hash"),
        "{msg}"
    );
    // Truncated.
    std::fs::write(&f1, &good[..good.len() - 9]).unwrap();
    let msg = open_error(&dir, 1).to_string();
    assert!(msg.contains("truncated"), "{msg}");
    // Missing.
    std::fs::remove_file(&f1).unwrap();
    let msg = open_error(&dir, 1).to_string();
    assert!(
        msg.contains("rank-00001.safetensors is damaged: is missing"),
        "{msg}"
    );
    // Rank 0 is untouched and still reads.
    let ckpt = Checkpoint::open(&dir).unwrap();
    ckpt.reader().open(0).unwrap().verify().unwrap();
}

#[test]
fn manifests_of_other_versions_formats_and_models_are_refused() {
    let root = tempfile::tempdir().unwrap();
    let dir = save(root.path(), 3, 2, Dtype::F32);
    let path = dir.join(zrun_ckpt::MANIFEST);
    let text = std::fs::read_to_string(&path).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["format_version"] = serde_json::json!(FORMAT_VERSION + 1);
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
    let msg = Checkpoint::open(&dir).unwrap_err().to_string();
    assert!(
        msg.contains("newer zrun")
            && msg.contains(&format!("format version {}", FORMAT_VERSION + 1)),
        "{msg}"
    );
    // No version, or 0: no zrun wrote that; the manifest was altered, not written later.
    for version in [serde_json::Value::Null, serde_json::json!(0)] {
        let mut w = v.clone();
        w["format_version"] = version;
        std::fs::write(&path, serde_json::to_vec(&w).unwrap()).unwrap();
        let e = Checkpoint::open(&dir).unwrap_err();
        assert!(e.is_damaged() && !e.to_string().contains("newer"), "{e}");
    }
    v["format_version"] = serde_json::json!(1);
    v["format"] = serde_json::json!("something-else");
    std::fs::write(&path, serde_json::to_vec(&v).unwrap()).unwrap();
    let msg = Checkpoint::open(&dir).unwrap_err().to_string();
    assert!(msg.contains("not a zrun checkpoint"), "{msg}");
    std::fs::write(&path, &text[..text.len() / 2]).unwrap();
    assert!(Checkpoint::open(&dir).unwrap_err().is_damaged());
    std::fs::write(&path, &text).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    // The running model's tables: same, then one parameter of another shape.
    let mut mine = units();
    for u in &mut mine {
        u.shards = UnitEntry::even_shards(u.numel, 1);
    }
    ckpt.manifest.check_units(&dir, &mine, "fix").unwrap();
    mine[0].views[1].shape = vec![2, 2];
    let msg = ckpt
        .manifest
        .check_units(&dir, &mine, "fix")
        .unwrap_err()
        .to_string();
    assert!(
        msg.contains("parameter `ln.bias` has shape [2, 2] here but [4]"),
        "{msg}"
    );
    // No manifest at all: incomplete, not damaged.
    std::fs::remove_file(&path).unwrap();
    let e = Checkpoint::open(&dir).unwrap_err();
    assert!(
        !e.is_damaged() && e.to_string().contains("incomplete"),
        "{e}"
    );
}

#[test]
fn pruning_keeps_the_newest_complete_checkpoints() {
    let root = tempfile::tempdir().unwrap();
    for step in [5, 10, 15, 20] {
        save(root.path(), step, 2, Dtype::F32);
    }
    std::fs::create_dir_all(tmp_dir(root.path(), 25)).unwrap();
    assert!(prune(root.path(), 0).unwrap().is_empty());
    let gone = prune(root.path(), 2).unwrap();
    assert_eq!(gone.len(), 2);
    let left: Vec<u64> = zrun_ckpt::complete(root.path())
        .unwrap()
        .into_iter()
        .map(|(s, _)| s)
        .collect();
    assert_eq!(left, vec![15, 20]);
    assert!(
        tmp_dir(root.path(), 25).exists(),
        "a save in flight is not touched"
    );
    // Saving a step that exists is refused with a hint, not merged.
    let (tmp, manifest) = write_ranks(root.path(), 20, 2, Dtype::F32);
    let msg = commit(&tmp, &manifest).unwrap_err().to_string();
    assert!(msg.contains("step-00000020 already exists"), "{msg}");
}
