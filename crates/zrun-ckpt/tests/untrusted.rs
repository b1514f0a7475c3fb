//! A checkpoint is untrusted input: a manifest edited by hand, naming files outside its
//! directory, with shards that do not tile a unit, views that disagree with their shapes, or
//! sizes that would make a reader allocate without bound, is refused as damaged before any
//! rank file is read; consolidation verifies every rank file and leaves nothing on damage.

mod common;

use std::path::{Path, PathBuf};

use common::save;
use serde_json::{json, Value};
use zrun_ckpt::{consolidate, rank_file_name, Checkpoint, Dtype, Error, OutDtype, MANIFEST};

/// The manifest of `dir` as JSON, without its own hash.
fn manifest_json(dir: &Path) -> Value {
    let text = std::fs::read_to_string(dir.join(MANIFEST)).unwrap();
    let mut v: Value = serde_json::from_str(&text).unwrap();
    assert!(v["manifest_hash"].is_string(), "commit seals the manifest");
    v.as_object_mut().unwrap().remove("manifest_hash");
    v
}

/// Writes `v` as `dir`'s manifest sealed as commit seals it (so only the tables are wrong):
/// the pretty JSON, then `manifest_hash` (XXH3-128 of that JSON) as the last member.
fn write_sealed(dir: &Path, v: &Value) {
    let body = serde_json::to_vec_pretty(v).unwrap();
    let digest = xxhash_rust::xxh3::xxh3_128(&body).to_be_bytes();
    let hex: String = digest.iter().map(|b| format!("{b:02x}")).collect();
    let mut text = body[..body.len() - 2].to_vec();
    text.extend(format!(",\n  \"manifest_hash\": \"xxh3-128:{hex}\"\n}}\n").as_bytes());
    std::fs::write(dir.join(MANIFEST), text).unwrap();
}

/// A fresh 2-rank checkpoint whose manifest is `edit`ed and sealed again; the error of
/// opening it, which must be damage.
fn refused(edit: impl FnOnce(&mut Value, &Path)) -> String {
    let root = tempfile::tempdir().unwrap();
    let dir = save(root.path(), 3, 2, Dtype::F32);
    let mut v = manifest_json(&dir);
    edit(&mut v, &dir);
    write_sealed(&dir, &v);
    let e = Checkpoint::open(&dir).expect_err("the edited manifest is refused");
    assert!(e.is_damaged(), "{e}");
    let msg = e.to_string();
    assert_eq!(msg.lines().count(), 1, "{msg}");
    msg
}

#[test]
fn a_resealed_unedited_manifest_still_loads() {
    // The test's sealing is commit's: an unedited manifest sealed again loads.
    let root = tempfile::tempdir().unwrap();
    let dir = save(root.path(), 3, 2, Dtype::F32);
    let v = manifest_json(&dir);
    write_sealed(&dir, &v);
    Checkpoint::open(&dir).unwrap();
}

#[test]
fn a_hand_edited_manifest_is_damaged() {
    let root = tempfile::tempdir().unwrap();
    let dir = save(root.path(), 3, 2, Dtype::F32);
    let path = dir.join(MANIFEST);
    let text = std::fs::read_to_string(&path).unwrap();
    // A count changed by hand: the tables stay consistent, the manifest's hash does not.
    let edited = text.replace("\"tokens_seen\": 192", "\"tokens_seen\": 193");
    assert_ne!(edited, text);
    std::fs::write(&path, &edited).unwrap();
    let e = Checkpoint::open(&dir).unwrap_err();
    assert!(
        e.is_damaged() && e.to_string().contains("manifest_hash"),
        "{e}"
    );
    // A shard moved: [0, 10) + [10, 19) becomes [0, 9) + [9, 19).
    let mut v: Value = serde_json::from_str(&text).unwrap();
    v["units"][0]["shards"] = json!([{"start": 0, "len": 9}, {"start": 9, "len": 10}]);
    std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    let e = Checkpoint::open(&dir).unwrap_err();
    assert!(
        e.is_damaged() && e.to_string().contains("manifest_hash"),
        "{e}"
    );
    // Its hash removed: a version-2 manifest must have one.
    v.as_object_mut().unwrap().remove("manifest_hash");
    v["units"][0]["shards"] = json!([{"start": 0, "len": 10}, {"start": 10, "len": 9}]);
    std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    let e = Checkpoint::open(&dir).unwrap_err();
    assert!(e.is_damaged() && e.to_string().contains("has none"), "{e}");
    // The same manifest as format version 1 (before manifests had a hash) loads.
    v["format_version"] = json!(1);
    std::fs::write(&path, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
    Checkpoint::open(&dir).unwrap();
    // A manifest moved into another step's directory.
    std::fs::write(&path, &text).unwrap();
    let moved = root.path().join("step-00000004");
    std::fs::rename(&dir, &moved).unwrap();
    let msg = Checkpoint::open(&moved).unwrap_err().to_string();
    assert!(msg.contains("step is 3") && msg.contains("step 4"), "{msg}");
}

#[test]
fn file_names_stay_inside_the_checkpoint() {
    for name in [
        "../outside.safetensors",
        "/tmp/outside.safetensors",
        "sub/rank-00001.safetensors",
        "rank-00000.safetensors",
    ] {
        // The file moved where the manifest points, with its size and hash intact.
        let root = tempfile::tempdir().unwrap();
        let dir = save(root.path(), 3, 2, Dtype::F32);
        let target: PathBuf = if name.starts_with('/') {
            root.path().join("abs.safetensors")
        } else {
            dir.join(name)
        };
        let shown = if name.starts_with('/') {
            target.display().to_string()
        } else {
            name.to_string()
        };
        if name != "rank-00000.safetensors" {
            std::fs::create_dir_all(target.parent().unwrap()).unwrap();
            std::fs::rename(dir.join(rank_file_name(1)), &target).unwrap();
        }
        let mut v = manifest_json(&dir);
        v["ranks"][1]["file"] = json!(shown);
        v["files"][1]["name"] = json!(shown);
        write_sealed(&dir, &v);
        let out = root.path().join("model.safetensors");
        let e = consolidate(&dir, &out, OutDtype::F32).unwrap_err();
        let msg = e.to_string();
        assert!(
            e.is_damaged() && msg.contains("ranks[1].file") && msg.contains("plain name"),
            "{name}: {msg}"
        );
        assert!(!out.exists());
    }
}

#[test]
fn shards_must_tile_every_unit_exactly() {
    // `embed` has 19 elements: rank 0 wrote [0, 10), rank 1 [10, 19).
    let shards = |a: (u64, u64), b: (u64, u64)| {
        move |v: &mut Value, _: &Path| {
            v["units"][0]["shards"] =
                json!([{"start": a.0, "len": a.1}, {"start": b.0, "len": b.1}]);
        }
    };
    let msg = refused(shards((0, 10), (11, 8)));
    assert!(msg.contains("units[0]") && msg.contains("a gap"), "{msg}");
    let msg = refused(shards((0, 10), (9, 10)));
    assert!(
        msg.contains("shards[1]") && msg.contains("an overlap"),
        "{msg}"
    );
    let msg = refused(shards((0, 10), (10, u64::MAX - 5)));
    assert!(msg.contains("overflows"), "{msg}");
    let msg = refused(shards((0, 10), (10, 8)));
    assert!(msg.contains("a gap at the end"), "{msg}");
    let msg = refused(shards((0, 10), (10, 10)));
    assert!(msg.contains("past numel"), "{msg}");
    // A unit grown to 2^40 elements, tiled: more than its rank files hold.
    let msg = refused(|v, _| {
        v["units"][1]["numel"] = json!(1u64 << 40);
        v["units"][1]["shards"] =
            json!([{"start": 0, "len": 2}, {"start": 2, "len": (1u64 << 40) - 2}]);
    });
    assert!(msg.contains("need at least"), "{msg}");
    let msg = refused(|v, _| {
        v["units"][0]["shards"].as_array_mut().unwrap().pop();
    });
    assert!(msg.contains("1 shards for world_size 2"), "{msg}");
}

#[test]
fn views_must_agree_with_their_shapes_and_lie_apart_inside_their_unit() {
    // `wte.weight` is [5, 3] at 0, `ln.bias` [4] at 15, in a unit of 19.
    let msg = refused(|v, _| v["units"][0]["views"][0]["numel"] = json!(16));
    assert!(
        msg.contains("numel is 16 but shape [5, 3] holds 15"),
        "{msg}"
    );
    let msg = refused(|v, _| {
        v["units"][0]["views"][0]["shape"] = json!([1u64 << 40, 1u64 << 40]);
    });
    assert!(msg.contains("overflows"), "{msg}");
    let msg = refused(|v, _| {
        v["units"][0]["views"][0]["shape"] = json!([1u64 << 40]);
        v["units"][0]["views"][0]["numel"] = json!(1u64 << 40);
    });
    assert!(msg.contains("runs past the unit's numel 19"), "{msg}");
    let msg = refused(|v, _| v["units"][0]["views"][1]["offset"] = json!(14));
    assert!(msg.contains("overlap at element 14"), "{msg}");
    let msg = refused(|v, _| v["units"][1]["views"][0]["name"] = json!("ln.bias"));
    assert!(msg.contains("a second parameter"), "{msg}");
    let msg = refused(|v, _| v["units"][1]["name"] = json!("embed"));
    assert!(msg.contains("a second unit"), "{msg}");
}

#[test]
fn counts_and_settings_are_bounded() {
    let msg = refused(|v, _| v["world_size"] = json!(0));
    assert!(msg.contains("world_size 0"), "{msg}");
    let msg = refused(|v, _| v["world_size"] = json!(1u64 << 40));
    assert!(msg.contains("world_size"), "{msg}");
    let msg = refused(|v, _| {
        v["files"].as_array_mut().unwrap().pop();
    });
    assert!(msg.contains("files has 1 entries for 2"), "{msg}");
    let msg = refused(|v, _| v["files"][1]["name"] = json!("rank-00000.safetensors"));
    assert!(msg.contains("a second time"), "{msg}");
    let msg = refused(|v, _| v["data"]["seq_len"] = json!(0));
    assert!(msg.contains("data.seq_len"), "{msg}");
    let msg = refused(|v, _| v["optimizer"]["state_dtype"] = json!("fp8"));
    assert!(msg.contains("state_dtype"), "{msg}");
    // A manifest larger than any a checkpoint writes is not read at all (a sparse file).
    let root = tempfile::tempdir().unwrap();
    let dir = save(root.path(), 3, 1, Dtype::F32);
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join(MANIFEST))
        .unwrap();
    f.set_len(300 << 20).unwrap();
    let e = Checkpoint::open(&dir).unwrap_err();
    assert!(
        e.is_damaged() && e.to_string().contains("a manifest may be"),
        "{e}"
    );
}

/// The error of opening and verifying rank 0 of the checkpoint in `dir`.
fn open_error(dir: &Path) -> Error {
    let ckpt = Checkpoint::open(dir).unwrap();
    let mut reader = ckpt.reader();
    match reader.open(0).and_then(|f| f.verify()) {
        Ok(()) => panic!("rank 0's file passed"),
        Err(e) => e,
    }
}

#[test]
fn a_huge_header_length_is_refused_before_it_is_allocated() {
    let root = tempfile::tempdir().unwrap();
    let dir = save(root.path(), 3, 1, Dtype::F32);
    let f0 = dir.join(rank_file_name(0));
    // Past the end of the file.
    let good = std::fs::read(&f0).unwrap();
    let mut bad = good.clone();
    bad[..8].copy_from_slice(&(1u64 << 62).to_le_bytes());
    std::fs::write(&f0, &bad).unwrap();
    let msg = open_error(&dir).to_string();
    assert!(msg.contains("runs past its end"), "{msg}");
    // Inside a (sparse) 200 MB file whose size the manifest records, but above the bound.
    let size = 200u64 << 20;
    bad[..8].copy_from_slice(&(150u64 << 20).to_le_bytes());
    std::fs::write(&f0, &bad).unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&f0)
        .unwrap()
        .set_len(size)
        .unwrap();
    let mut v = manifest_json(&dir);
    v["files"][0]["bytes"] = json!(size);
    write_sealed(&dir, &v);
    let e = open_error(&dir);
    assert!(
        e.is_damaged() && e.to_string().contains("more than the 100000000 bytes"),
        "{e}"
    );
}

#[test]
fn consolidation_verifies_every_rank_file_and_leaves_nothing_on_damage() {
    // 20 ranks: rank 19 holds no element of either unit, only its generator state, so a
    // reader of the weights never opens it; consolidation still verifies it.
    let root = tempfile::tempdir().unwrap();
    let dir = save(root.path(), 3, 20, Dtype::F32);
    let ckpt = Checkpoint::open(&dir).unwrap();
    assert!(ckpt.manifest.units.iter().all(|u| u.shards[19].len == 0));
    let f = dir.join(rank_file_name(19));
    let mut bytes = std::fs::read(&f).unwrap();
    let at = bytes.len() - 2;
    bytes[at] ^= 0x01;
    std::fs::write(&f, &bytes).unwrap();
    let out = root.path().join("model.safetensors");
    let e = consolidate(&dir, &out, OutDtype::F32).unwrap_err();
    assert!(
        e.is_damaged() && e.to_string().contains("rank-00019.safetensors"),
        "{e}"
    );
    assert!(!out.exists());
    assert!(!root.path().join("model.safetensors.tmp").exists());
    // A rank file cut short fails at open: no temporary file is left either.
    bytes[at] ^= 0x01;
    std::fs::write(&f, &bytes[..bytes.len() - 1]).unwrap();
    assert!(consolidate(&dir, &out, OutDtype::F32).is_err());
    assert!(!out.exists() && !root.path().join("model.safetensors.tmp").exists());
}
