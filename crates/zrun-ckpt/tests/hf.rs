//! Hugging Face model directories end to end: write one in several shards, read every tensor
//! back (straight, transposed, in parts), load it with Python's safetensors and transformers,
//! and turn every kind of bad directory into a one-line error naming the file.

use std::path::{Path, PathBuf};
use std::process::Command;

use zrun_ckpt::{write_json, Dtype, Error, HfDir, HfDtype, HfWriter, TensorSpec};

fn spec(name: &str, dtype: Dtype, shape: &[usize]) -> TensorSpec {
    TensorSpec {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
    }
}

/// Element `i` of the `k`-th tensor written: not exact in bf16 or f16, so rounding shows.
fn value(k: usize, i: usize) -> f32 {
    ((k * 1000 + i) as f32 * 0.37).sin() * 3.0 + 0.001 * i as f32
}

/// What a reader gets back for `x` stored as `dtype`.
fn stored(dtype: Dtype, x: f32) -> f32 {
    match dtype {
        Dtype::Bf16 => half::bf16::from_f32(x).to_f32(),
        Dtype::F16 => half::f16::from_f32(x).to_f32(),
        _ => x,
    }
}

/// Writes `specs` (values from [`value`]) and a small `config.json` into `dir`.
fn write_model(dir: &Path, specs: &[TensorSpec], max_shard_bytes: u64) -> Vec<PathBuf> {
    write_json(
        dir,
        "config.json",
        &serde_json::json!({"model_type": "test"}),
    )
    .unwrap();
    let mut w = HfWriter::create(dir, specs.to_vec(), max_shard_bytes).unwrap();
    for (k, s) in specs.iter().enumerate() {
        let n: usize = s.shape.iter().product();
        let values: Vec<f32> = (0..n).map(|i| value(k, i)).collect();
        w.put(&s.name, &values).unwrap();
    }
    w.finish().unwrap()
}

/// Five tensors of every dtype: 96 + 30 + 10 + 112 + 16 bytes.
fn mixed() -> Vec<TensorSpec> {
    vec![
        spec("embed.weight", Dtype::F32, &[6, 4]),
        spec("blocks.0.proj.weight", Dtype::Bf16, &[3, 5]),
        spec("blocks.0.proj.bias", Dtype::F16, &[5]),
        spec("blocks.0.fc.weight", Dtype::F32, &[4, 7]),
        spec("norm.weight", Dtype::F32, &[4]),
    ]
}

/// The whole of tensor `name`.
fn read_all(hf: &HfDir, name: &str) -> Vec<f32> {
    let n: usize = hf.info(name).unwrap().shape.iter().product();
    let mut out = vec![0.0; n];
    hf.read(name, 0, &mut out).unwrap();
    out
}

/// The (b, a) transpose of the row-major (a, b) matrix `m`.
fn transposed(m: &[f32], a: usize, b: usize) -> Vec<f32> {
    (0..a * b).map(|i| m[(i % a) * b + i / a]).collect()
}

/// The error's message, checked to be one line holding every one of `needles`.
fn one_line(e: Error, needles: &[&str]) -> String {
    let msg = e.to_string();
    assert!(!msg.contains('\n'), "{msg}");
    for n in needles {
        assert!(msg.contains(n), "{msg:?} lacks {n:?}");
    }
    msg
}

#[test]
fn sharded_directory_reads_back() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path().join("model");
    let specs = mixed();
    let files = write_model(&dir, &specs, 128);
    let names: Vec<String> = files
        .iter()
        .map(|p| p.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    // 96 + 30 fit in 128; 10 + 112 too, but not + 16: three shards.
    assert_eq!(
        names,
        [
            "model-00001-of-00003.safetensors",
            "model-00002-of-00003.safetensors",
            "model-00003-of-00003.safetensors",
            "model.safetensors.index.json"
        ]
    );
    let mut listed: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    listed.sort();
    assert!(listed.iter().all(|n| !n.ends_with(".tmp")), "{listed:?}");
    let index: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.join("model.safetensors.index.json")).unwrap())
            .unwrap();
    assert_eq!(index["metadata"]["total_size"], 96 + 30 + 10 + 112 + 16);
    assert_eq!(index["metadata"]["total_parameters"], 24 + 15 + 5 + 28 + 4);
    assert_eq!(
        index["weight_map"]["blocks.0.fc.weight"],
        "model-00002-of-00003.safetensors"
    );

    let hf = HfDir::open(&dir).unwrap();
    assert_eq!(hf.config()["model_type"], "test");
    assert_eq!(hf.config_path(), dir.join("config.json"));
    let mut want: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
    want.sort();
    assert_eq!(hf.names(), want);
    let info = hf.info("blocks.0.proj.weight").unwrap();
    assert_eq!(info.dtype, HfDtype::Bf16);
    assert_eq!(info.shape, [3, 5]);
    assert_eq!(info.file, dir.join("model-00001-of-00003.safetensors"));
    assert_eq!(hf.file_of("norm.weight"), Some(files[2].as_path()));
    assert!(hf.info("absent").is_none() && hf.file_of("absent").is_none());
    for (k, s) in specs.iter().enumerate() {
        let got = read_all(&hf, &s.name);
        let want: Vec<f32> = (0..got.len())
            .map(|i| stored(s.dtype, value(k, i)))
            .collect();
        // Bit-exact: F32 as written, BF16 and F16 rounded to nearest even.
        assert_eq!(
            got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "{}",
            s.name
        );
    }
    for (name, a, b) in [("blocks.0.fc.weight", 4, 7), ("blocks.0.proj.weight", 3, 5)] {
        let whole = transposed(&read_all(&hf, name), a, b);
        let mut got = vec![0.0; a * b];
        hf.read_transposed(name, 0, &mut got).unwrap();
        assert_eq!(got, whole, "{name}");
        // Every sub-range, including ones starting and ending inside rows.
        for start in 0..a * b {
            for len in 0..=a * b - start {
                let mut part = vec![f32::NAN; len];
                hf.read_transposed(name, start, &mut part).unwrap();
                assert_eq!(part, whole[start..start + len], "{name} [{start}, +{len})");
                hf.read(name, start, &mut part).unwrap();
                let straight = read_all(&hf, name);
                assert_eq!(
                    part,
                    straight[start..start + len],
                    "{name} [{start}, +{len})"
                );
            }
        }
    }
    let msg = one_line(
        hf.read("embed.weight", 20, &mut [0.0; 5]).unwrap_err(),
        &[
            "model-00001-of-00003.safetensors",
            "embed.weight",
            "24 elements",
            "past its end",
        ],
    );
    assert!(msg.contains("asked for 5 from element 20"), "{msg}");
    one_line(
        hf.read_transposed("norm.weight", 0, &mut [0.0; 4])
            .unwrap_err(),
        &[
            "model-00003-of-00003.safetensors",
            "norm.weight",
            "[4]",
            "2-D",
        ],
    );
    one_line(
        hf.read("absent", 0, &mut [0.0; 1]).unwrap_err(),
        &["model.safetensors.index.json", "no tensor absent"],
    );
}

#[test]
fn large_reads_split_across_threads() {
    let root = tempfile::tempdir().unwrap();
    let (a, b) = (1537, 1400); // 2.15M elements: more than one thread's share
    let specs = [spec("w", Dtype::Bf16, &[a, b])];
    write_model(root.path(), &specs, 1 << 30);
    let hf = HfDir::open(root.path()).unwrap();
    let whole = read_all(&hf, "w");
    assert!(whole
        .iter()
        .enumerate()
        .all(|(i, &x)| x == stored(Dtype::Bf16, value(0, i))));
    let t = transposed(&whole, a, b);
    let mut got = vec![0.0; a * b];
    hf.read_transposed("w", 0, &mut got).unwrap();
    assert!(got == t, "the transpose differs");
    let start = 3 * a + 17;
    let mut part = vec![0.0; a * b - start - 5];
    hf.read_transposed("w", start, &mut part).unwrap();
    assert!(part == t[start..a * b - 5], "a transposed part differs");
}

#[test]
fn a_new_export_replaces_an_older_one() {
    let root = tempfile::tempdir().unwrap();
    let specs = mixed();
    write_model(root.path(), &specs, 128);
    // Now in one file: the shards and index of before go.
    let files = write_model(root.path(), &specs, 1 << 20);
    assert_eq!(files, [root.path().join("model.safetensors")]);
    let mut listed: Vec<String> = std::fs::read_dir(root.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    listed.sort();
    assert_eq!(listed, ["config.json", "model.safetensors"]);
    let hf = HfDir::open(root.path()).unwrap();
    assert_eq!(hf.names().len(), specs.len());
    assert_eq!(read_all(&hf, "norm.weight")[3], value(4, 3));
}

#[test]
fn json_files_are_written_whole() {
    let root = tempfile::tempdir().unwrap();
    let to = root.path().join("to");
    let path = write_json(&to, "generation_config.json", &serde_json::json!({"a": 1})).unwrap();
    assert_eq!(
        std::fs::read_to_string(&path).unwrap(),
        "{\n  \"a\": 1\n}\n"
    );
    assert_eq!(std::fs::read_dir(&to).unwrap().count(), 1, "no .tmp left");
}

/// A safetensors file by hand: `tensors` as (name, dtype, shape, bytes), back to back.
fn safetensors_bytes(tensors: &[(&str, &str, &[usize], Vec<u8>)]) -> Vec<u8> {
    let (mut head, mut data) = (serde_json::Map::new(), Vec::<u8>::new());
    for (name, dtype, shape, bytes) in tensors {
        let offsets = [data.len(), data.len() + bytes.len()];
        head.insert(
            name.to_string(),
            serde_json::json!({"dtype": dtype, "shape": shape, "data_offsets": offsets}),
        );
        data.extend(bytes);
    }
    let mut json = serde_json::to_vec(&head).unwrap();
    json.resize(json.len().next_multiple_of(8), b' ');
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend(json);
    out.extend(data);
    out
}

#[test]
fn bad_directories_are_one_line_errors() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path();
    one_line(
        HfDir::open(dir).unwrap_err(),
        &["config.json", "is missing", "needs its config.json"],
    );
    std::fs::write(dir.join("config.json"), b"{\"n_embd\": 8,").unwrap();
    one_line(
        HfDir::open(dir).unwrap_err(),
        &["config.json", "is not JSON", "EOF"],
    );
    std::fs::write(dir.join("config.json"), b"{\"n_embd\": 8}").unwrap();
    let msg = one_line(
        HfDir::open(dir).unwrap_err(),
        &["model.safetensors", "model.safetensors.index.json"],
    );
    assert!(msg.contains(&dir.display().to_string()), "{msg}");

    // An index naming a shard that is not there.
    let sharded = dir.join("sharded");
    write_model(&sharded, &mixed(), 128);
    std::fs::remove_file(sharded.join("model-00002-of-00003.safetensors")).unwrap();
    one_line(
        HfDir::open(&sharded).unwrap_err(),
        &[
            "model.safetensors.index.json",
            "model-00002-of-00003.safetensors",
            "holding tensor blocks.0.fc.weight and 1 more",
            "missing",
        ],
    );

    // A type zrun does not read: listed, and a read names the file, tensor and type.
    let odd = dir.join("odd");
    std::fs::create_dir_all(&odd).unwrap();
    std::fs::write(odd.join("config.json"), b"{}").unwrap();
    let ids: Vec<u8> = [3i64, 1, 2].iter().flat_map(|x| x.to_le_bytes()).collect();
    let file = safetensors_bytes(&[
        (
            "w",
            "F32",
            &[2],
            [1.5f32, -2.0]
                .iter()
                .flat_map(|x| x.to_le_bytes())
                .collect(),
        ),
        ("position_ids", "I64", &[1, 3], ids),
    ]);
    std::fs::write(odd.join("model.safetensors"), &file).unwrap();
    let hf = HfDir::open(&odd).unwrap();
    assert_eq!(read_all(&hf, "w"), [1.5, -2.0]);
    assert_eq!(
        hf.info("position_ids").unwrap().dtype,
        HfDtype::Other("I64".into())
    );
    one_line(
        hf.read("position_ids", 0, &mut [0.0; 3]).unwrap_err(),
        &[
            "odd/model.safetensors",
            "position_ids",
            "I64",
            "F32, BF16 and F16",
        ],
    );
    drop(hf);

    // Truncated: cut inside the data, inside the header, inside the length.
    for (cut, needle) in [
        (4, "is 4 bytes"),
        (30, "runs past its end"),
        (file.len() - 3, "truncated"),
    ] {
        std::fs::write(odd.join("model.safetensors"), &file[..cut]).unwrap();
        one_line(
            HfDir::open(&odd).unwrap_err(),
            &["odd/model.safetensors", needle, "download it again"],
        );
    }
    std::fs::write(odd.join("model.safetensors"), [&file[..], b"xx"].concat()).unwrap();
    one_line(
        HfDir::open(&odd).unwrap_err(),
        &["odd/model.safetensors", "follow its last tensor"],
    );
}

/// `.venv/bin/python` of the workspace, if set up.
fn python() -> Option<PathBuf> {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.venv/bin/python");
    p.is_file().then_some(p)
}

/// Checks run by Python on a sharded GPT-2 directory (`argv[1]`) and a one-file directory of
/// every dtype (`argv[2]`, expectations in `argv[3]`).
const PY_CHECK: &str = r#"
import json, sys, torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

d = sys.argv[1]
index = json.load(open(f"{d}/model.safetensors.index.json"))
weight_map = index["weight_map"]
seen = {}
for f in sorted(set(weight_map.values())):
    with safe_open(f"{d}/{f}", "pt") as h:
        assert h.metadata() == {"format": "pt"}, h.metadata()
    for k, v in load_file(f"{d}/{f}").items():
        assert weight_map[k] == f, (k, f)
        seen[k] = v
assert set(seen) == set(weight_map), set(seen) ^ set(weight_map)
assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in seen.values())
model, info = AutoModelForCausalLM.from_pretrained(d, output_loading_info=True)
problems = {k: v for k, v in info.items() if v}
assert not problems, problems
state = model.state_dict()
for k, v in seen.items():
    assert torch.equal(state[k], v), k
assert state["transformer.wte.weight"].data_ptr() == state["lm_head.weight"].data_ptr()

tensors = load_file(f"{sys.argv[2]}/model.safetensors")
for name, (dtype, shape, first) in json.load(open(sys.argv[3])).items():
    t = tensors[name]
    assert str(t.dtype) == dtype and list(t.shape) == shape, (name, t.dtype, t.shape)
    assert t.flatten()[: len(first)].float().tolist() == first, (name, t.flatten()[:4])
print("python: ok", len(seen), "+", len(tensors))
"#;

#[test]
fn transformers_loads_the_export() {
    let Some(py) = python() else {
        eprintln!("skipped: no .venv/bin/python (run make setup)");
        return;
    };
    let root = tempfile::tempdir().unwrap();
    // A one-layer GPT-2 as transformers names it: 8 wide, 2 heads, 16 positions, 32 tokens.
    let gpt2 = root.path().join("gpt2");
    let (e, v, p) = (8, 32, 16);
    let mut specs = vec![
        spec("transformer.wte.weight", Dtype::F32, &[v, e]),
        spec("transformer.wpe.weight", Dtype::F32, &[p, e]),
    ];
    let h = "transformer.h.0";
    for (name, shape) in [
        ("ln_1.weight", vec![e]),
        ("ln_1.bias", vec![e]),
        ("attn.c_attn.weight", vec![e, 3 * e]),
        ("attn.c_attn.bias", vec![3 * e]),
        ("attn.c_proj.weight", vec![e, e]),
        ("attn.c_proj.bias", vec![e]),
        ("ln_2.weight", vec![e]),
        ("ln_2.bias", vec![e]),
        ("mlp.c_fc.weight", vec![e, 4 * e]),
        ("mlp.c_fc.bias", vec![4 * e]),
        ("mlp.c_proj.weight", vec![4 * e, e]),
        ("mlp.c_proj.bias", vec![e]),
    ] {
        specs.push(spec(&format!("{h}.{name}"), Dtype::F32, &shape));
    }
    specs.push(spec("transformer.ln_f.weight", Dtype::F32, &[e]));
    specs.push(spec("transformer.ln_f.bias", Dtype::F32, &[e]));
    let files = write_model(&gpt2, &specs, 1024);
    assert!(files.len() > 3, "{files:?}");
    let config = serde_json::json!({
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": v,
        "n_positions": p, "n_embd": e, "n_layer": 1, "n_head": 2, "tie_word_embeddings": true,
    });
    write_json(&gpt2, "config.json", &config).unwrap();

    let mixed_dir = root.path().join("mixed");
    let specs = mixed();
    write_model(&mixed_dir, &specs, 1 << 20);
    let mut expect = serde_json::Map::new();
    for (k, s) in specs.iter().enumerate() {
        let torch = match s.dtype {
            Dtype::Bf16 => "torch.bfloat16",
            Dtype::F16 => "torch.float16",
            _ => "torch.float32",
        };
        let first: Vec<f64> = (0..4)
            .map(|i| stored(s.dtype, value(k, i)) as f64)
            .collect();
        expect.insert(s.name.clone(), serde_json::json!([torch, s.shape, first]));
    }
    let expect_path = root.path().join("expect.json");
    std::fs::write(&expect_path, serde_json::to_vec(&expect).unwrap()).unwrap();

    let out = Command::new(py)
        .arg("-c")
        .arg(PY_CHECK)
        .args([&gpt2, &mixed_dir, &expect_path])
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_OFFLINE", "1")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "python failed:\n{stderr}");
    assert!(String::from_utf8_lossy(&out.stdout).contains("python: ok"));
}

/// A NaN or infinite weight is a damaged model: a read of a range holding it names the file,
/// the tensor and the element (straight and transposed); ranges without it read.
#[test]
fn non_finite_weights_are_damage_naming_the_tensor_and_element() {
    let root = tempfile::tempdir().unwrap();
    let dir = root.path();
    std::fs::write(dir.join("config.json"), b"{}").unwrap();
    let mut w: Vec<f32> = (0..12).map(|i| i as f32).collect();
    w[7] = f32::NAN;
    let bf16_inf = half::bf16::from_f32(f32::INFINITY).to_le_bytes().to_vec();
    let weight: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
    std::fs::write(
        dir.join("model.safetensors"),
        safetensors_bytes(&[("w", "F32", &[3, 4], weight), ("b", "BF16", &[1], bf16_inf)]),
    )
    .unwrap();
    let hf = HfDir::open(dir).unwrap();
    let mut out = vec![0f32; 12];
    let msg = one_line(
        hf.read("w", 0, &mut out).unwrap_err(),
        &[
            "model.safetensors",
            "tensor w holds NaN at element 7 of shape [3, 4]",
            "damaged",
        ],
    );
    assert!(!msg.contains('\n'));
    // Element 7 = (1, 3) is element 3 * 3 + 1 = 10 of the (4, 3) transpose.
    one_line(
        hf.read_transposed("w", 0, &mut out).unwrap_err(),
        &["tensor w holds NaN at element 7"],
    );
    hf.read("w", 0, &mut out[..7]).unwrap();
    hf.read_transposed("w", 0, &mut out[..10]).unwrap();
    one_line(
        hf.read("b", 0, &mut out[..1]).unwrap_err(),
        &["tensor b holds inf at element 0"],
    );
}
