//! tch_amp::torch_io against PyTorch 2.13 itself: files torch.save wrote (zip and legacy) read
//! exactly, files tch-amp wrote loaded by torch.load (weights_only=True and False), malformed
//! files giving typed errors, and a seeded fuzz of the reader.
//!
//! The Python side is scripts/reference/torch_io_fixtures.py, run with the venv's python
//! ($TCH_AMP_PYTHON, set by `make setup` in .cargo/config.toml) into a temporary folder. It
//! describes every tree it wrote or loaded as a JSON manifest (ints as decimal strings, floats as
//! IEEE bits, tensors as dtype/shape/stride/offset/bytes plus a storage id numbered in first-use
//! order); `manifest` below describes a Rust tree the same way, so comparisons are exact,
//! storage sharing included.
#[path = "common/mod.rs"]
mod common;

use std::collections::HashMap;
use std::io::{Cursor, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value as Json};
use tch::{Device, Kind, Tensor};
use tch_amp::torch_io::{self, BigInt, Dict, Format, Key, Limits, LoadOptions, TorchIoError, Value};

// ---------------------------------------------------------------------------------------------
// helpers

/// Runs the fixture script with a time limit; panics with its stderr on failure.
fn run_script(args: &[&str]) {
    common::python::run_reference_script("torch_io_fixtures.py", args, Duration::from_secs(300));
}

fn fixtures(groups: &str) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    run_script(&["write", dir.path().to_str().unwrap(), groups]);
    dir
}

fn read_json(path: &Path) -> Json {
    serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap()
}

fn dtype_name(k: Kind) -> &'static str {
    match k {
        Kind::Float => "float32",
        Kind::Double => "float64",
        Kind::Half => "float16",
        Kind::BFloat16 => "bfloat16",
        Kind::Int64 => "int64",
        Kind::Int => "int32",
        Kind::Int16 => "int16",
        Kind::Int8 => "int8",
        Kind::Uint8 => "uint8",
        Kind::Bool => "bool",
        Kind::ComplexFloat => "complex64",
        Kind::ComplexDouble => "complex128",
        k => panic!("no name for {k:?}"),
    }
}

fn tensor_bytes(t: &Tensor) -> Vec<u8> {
    let n = t.numel();
    let mut buf = vec![0u8; n * t.kind().elt_size_in_bytes()];
    if n > 0 {
        t.contiguous().copy_data_u8(&mut buf, n);
    }
    buf
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// Where a tensor's storage starts: tensors viewing one storage agree on it.
fn storage_base(t: &Tensor) -> usize {
    (t.data_ptr() as usize).wrapping_sub(t.storage_offset() as usize * t.kind().elt_size_in_bytes())
}

/// The Rust twin of the script's `manifest`.
fn manifest(v: &Value) -> Json {
    fn key(k: &Key) -> Json {
        match k {
            Key::Str(s) => json!({"t": "str", "v": s}),
            Key::Int(i) => json!({"t": "int", "v": i.to_string()}),
        }
    }
    fn node(v: &Value, storages: &mut HashMap<usize, usize>) -> Json {
        match v {
            Value::None => json!({"t": "none"}),
            Value::Bool(b) => json!({"t": "bool", "v": b}),
            Value::Int(i) => json!({"t": "int", "v": i.to_string()}),
            Value::BigInt(b) => json!({"t": "int", "v": b.to_string()}),
            Value::Float(f) => json!({"t": "float", "bits": format!("{:016x}", f.to_bits())}),
            Value::Str(s) => json!({"t": "str", "v": s}),
            Value::Bytes(b) => json!({"t": "bytes", "hex": hex(b)}),
            Value::List(items) => {
                json!({"t": "list", "items": items.iter().map(|x| node(x, storages)).collect::<Vec<_>>()})
            }
            Value::Tuple(items) => {
                json!({"t": "tuple", "items": items.iter().map(|x| node(x, storages)).collect::<Vec<_>>()})
            }
            Value::Dict(d) => {
                let items: Vec<Json> = d.iter().map(|(k, x)| json!([key(k), node(x, storages)])).collect();
                let mut out = json!({"t": if d.is_ordered() { "odict" } else { "dict" }, "items": items});
                let attrs: Vec<Json> = d.attributes().map(|(k, x)| json!([k, node(x, storages)])).collect();
                if !attrs.is_empty() {
                    out["attrs"] = Json::Array(attrs);
                }
                out
            }
            Value::Tensor(t) => {
                let n = storages.len();
                let sid = *storages.entry(storage_base(t)).or_insert(n);
                json!({
                    "t": "tensor",
                    "dtype": dtype_name(t.kind()),
                    "shape": t.size(),
                    "stride": t.stride(),
                    "offset": t.storage_offset(),
                    "requires_grad": t.requires_grad(),
                    "storage": sid,
                    "hex": hex(&tensor_bytes(t)),
                })
            }
            other => panic!("no manifest for {other:?}"),
        }
    }
    node(v, &mut HashMap::new())
}

/// Exact JSON equality, reporting the first difference's path.
fn assert_same_json(a: &Json, b: &Json, what: &str) {
    fn diff(a: &Json, b: &Json, path: &str) -> Option<String> {
        match (a, b) {
            (Json::Object(x), Json::Object(y)) => {
                let (mut kx, mut ky): (Vec<_>, Vec<_>) = (x.keys().collect(), y.keys().collect());
                kx.sort();
                ky.sort();
                if kx != ky {
                    return Some(format!("{path}: keys {kx:?} != {ky:?}"));
                }
                x.iter().find_map(|(k, v)| diff(v, &y[k], &format!("{path}.{k}")))
            }
            (Json::Array(x), Json::Array(y)) => {
                if x.len() != y.len() {
                    return Some(format!("{path}: length {} != {}", x.len(), y.len()));
                }
                x.iter().zip(y).enumerate().find_map(|(i, (p, q))| diff(p, q, &format!("{path}[{i}]")))
            }
            _ => (a != b).then(|| format!("{path}: {:.300} != {:.300}", a.to_string(), b.to_string())),
        }
    }
    if let Some(d) = diff(a, b, "") {
        panic!("{what}: {d}");
    }
}

/// The script's `edge_tree`, built from the same recipe (every value exact in its dtype).
fn edge_tree() -> Value {
    let f = (Kind::Float, Device::Cpu);
    let base = (Tensor::arange(24, f) - 7.0) / 8.0;
    let m = base.reshape([4, 6]);
    let tied = Tensor::arange(10, (Kind::Double, Device::Cpu)) / 4.0;
    let half_vals = (Tensor::arange(12, f) - 6.0) / 4.0;
    let int_range = |k: Kind| Tensor::arange(6, (k, Device::Cpu));
    let s = |x: &str| Value::Str(x.to_string());
    let t = Value::Tensor;
    let big = |v: i128| Value::BigInt(BigInt::from_i128(v));
    let mut meta = Dict::new_ordered().with("w", t(Tensor::arange(3, f)));
    meta.set_attribute(
        "_metadata",
        Value::Dict(
            Dict::new_ordered()
                .with("", Value::Dict(Dict::new().with("version", Value::Int(1))))
                .with("sub", Value::Dict(Dict::new().with("version", Value::Int(2)))),
        ),
    );
    let nested = Dict::new().with(
        "a",
        Value::Dict(Dict::new().with(
            "b",
            Value::Dict(Dict::new().with(
                "c",
                Value::List(vec![
                    Value::Int(1),
                    Value::Int(2),
                    Value::Dict(Dict::new().with("d", Value::Tuple(vec![Value::Int(3), Value::Float(4.5)]))),
                ]),
            )),
        )),
    );
    let d = Dict::new()
        .with("nested", Value::Dict(nested))
        .with(
            "tuple",
            Value::Tuple(vec![
                Value::Int(1),
                s("two"),
                Value::Float(3.0),
                Value::None,
                Value::Bool(true),
                Value::Bool(false),
            ]),
        )
        .with("f16", t(half_vals.to_kind(Kind::Half).reshape([3, 4])))
        .with("bf16", t(half_vals.to_kind(Kind::BFloat16).reshape([4, 3])))
        .with("f64", t(Tensor::arange(5, (Kind::Double, Device::Cpu)) / 16.0))
        .with("i64", t((int_range(Kind::Int64) - 3) * (1i64 << 40)))
        .with("i32", t(int_range(Kind::Int) - 3))
        .with("i16", t((int_range(Kind::Int16) - 3) * 1000))
        .with("i8", t(int_range(Kind::Int8) - 3))
        .with("u8", t(int_range(Kind::Uint8) + 250))
        .with("bool", t(Tensor::from_slice(&[true, false, true])))
        .with("transposed", t(m.tr()))
        .with("sliced", t(m.narrow(0, 1, 2).narrow(1, 2, 3)))
        .with("scalar", t(Tensor::from(2.5f32)))
        .with("scalar_i64", t(Tensor::from(7i64)))
        .with("tied_a", t(tied.shallow_clone()))
        .with("tied_b", t(tied.slice(0, 2, 8, 2)))
        .with("empty_tensor", t(Tensor::zeros([0, 3], f)))
        .with(
            "big_ints",
            Value::List(vec![
                Value::Int(1 << 62),
                Value::Int(i64::MIN),
                Value::Int(i64::MAX),
                big(1i128 << 63),
                big(-(1i128 << 63) - 1),
                big(1i128 << 100),
                big(-(1i128 << 100)),
            ]),
        )
        .with(
            "floats",
            Value::List(
                [f64::INFINITY, f64::NEG_INFINITY, f64::NAN, -0.0, 5e-324, f64::MAX]
                    .into_iter()
                    .map(Value::Float)
                    .collect(),
            ),
        )
        .with(
            "unicode",
            Value::Dict(Dict::new().with("ключ", s("значение")).with("键", s("值")).with("emoji 🎉", s("✓"))),
        )
        .with(
            "empty",
            Value::Dict(
                Dict::new()
                    .with("dict", Value::Dict(Dict::new()))
                    .with("list", Value::List(vec![]))
                    .with("tuple", Value::Tuple(vec![]))
                    .with("odict", Value::Dict(Dict::new_ordered()))
                    .with("str", s("")),
            ),
        )
        .with(
            "int_keys",
            Value::Dict(
                Dict::new().with(0, s("zero")).with(1, s("one")).with(-5, s("minus five")).with(1i64 << 40, s("big")),
            ),
        )
        .with("odict", Value::Dict(Dict::new_ordered().with("z", Value::Int(1)).with("a", Value::Int(2))))
        .with("with_metadata", Value::Dict(meta))
        .with("bytes", Value::Bytes(b"\x00\x01\xff abc".to_vec()))
        .with("param", t(Tensor::ones([2], f).set_requires_grad(true)))
        .with("c64", t(Tensor::complex(&(Tensor::arange(3, f) / 2.0), &(-Tensor::arange(3, f) / 4.0))))
        .with("c128", {
            let d = (Kind::Double, Device::Cpu);
            t(Tensor::complex(&(Tensor::arange(2, d) / 2.0), &Tensor::ones([2], d)))
        });
    Value::Dict(d)
}

fn tensor_at<'a>(v: &'a Value, key: &str) -> &'a Tensor {
    v.get(key).unwrap().as_tensor().unwrap()
}

/// Writing through one view shows in the other: they share memory.
fn assert_shared(a: &Tensor, a_index: &[i64], b: &Tensor, b_index: &[i64]) {
    let _g = tch::no_grad_guard();
    let mut e = b.shallow_clone();
    for &i in b_index {
        e = e.select(0, i);
    }
    let _ = e.fill_(100.0);
    assert_eq!(a.double_value(a_index), 100.0, "the two tensors do not share storage");
}

// ---------------------------------------------------------------------------------------------
// Python writes, Rust reads

#[test]
fn state_dicts_and_apex_checkpoints_from_python_read_exactly() {
    let dir = fixtures("real");
    for name in ["state_dict", "ckpt_sgd", "ckpt_adam"] {
        let expected = read_json(&dir.path().join(format!("{name}.json")));
        for (fmt, format) in [("zip", Format::Zip), ("legacy", Format::Legacy)] {
            let path = dir.path().join(format!("{name}.{fmt}.pt"));
            let bytes = std::fs::read(&path).unwrap();
            assert_eq!(torch_io::detect_format(&bytes), Some(format));
            let v = torch_io::load(&path).unwrap();
            assert_same_json(&manifest(&v), &expected, &format!("{name}.{fmt}.pt"));
            // From memory too, and with map_location.
            let w = torch_io::load_bytes(&bytes, &LoadOptions::new().map_location(Device::Cpu)).unwrap();
            assert_same_json(&manifest(&w), &expected, &format!("{name}.{fmt}.pt from bytes"));
        }
    }

    // The state dict: an OrderedDict carrying _metadata (BatchNorm's version 2).
    let sd = torch_io::load(dir.path().join("state_dict.zip.pt")).unwrap();
    let d = sd.node().as_dict().unwrap();
    assert!(d.is_ordered());
    let keys: Vec<String> = d.keys().map(|k| k.to_string()).collect();
    assert_eq!(
        keys,
        [
            "conv.weight",
            "conv.bias",
            "bn.weight",
            "bn.bias",
            "bn.running_mean",
            "bn.running_var",
            "bn.num_batches_tracked",
            "fc.weight",
            "fc.bias"
        ]
        .map(|k| format!("{k:?}"))
    );
    let meta = sd.node().attribute("_metadata").unwrap().expect("_metadata kept");
    assert_eq!(meta.get("bn").unwrap().get("version").unwrap().as_i64().unwrap(), 2);
    let nbt = sd.get("bn.num_batches_tracked").unwrap().as_tensor().unwrap();
    assert_eq!((nbt.kind(), nbt.dim(), nbt.int64_value(&[])), (Kind::Int64, 0, 3));
    assert_eq!(sd.get("conv.weight").unwrap().as_tensor().unwrap().size(), [4, 2, 3, 3]);

    // The Apex-style checkpoints, navigated as the integration will.
    for fmt in ["zip", "legacy"] {
        let sgd = torch_io::load(dir.path().join(format!("ckpt_sgd.{fmt}.pt"))).unwrap();
        assert_eq!(sgd.get("epoch").unwrap().as_i64().unwrap(), 3);
        assert_eq!(sgd.get("arch").unwrap().as_str().unwrap(), "net");
        assert_eq!(sgd.get("best_prec1").unwrap().as_f64().unwrap(), 0.75);
        let amp = sgd.get("amp").unwrap().get("loss_scaler0").unwrap();
        assert_eq!(amp.get("loss_scale").unwrap().as_f64().unwrap(), 65536.0);
        assert_eq!(amp.get("unskipped").unwrap().as_i64().unwrap(), 17);
        let opt = sgd.get("optimizer").unwrap();
        let state = opt.get("state").unwrap();
        let keys: Vec<Key> = state.as_dict().unwrap().keys().cloned().collect();
        assert_eq!(keys, (0..6).map(Key::Int).collect::<Vec<_>>(), "state keyed by int, one per parameter");
        let buf = state.get(3).unwrap().get("momentum_buffer").unwrap().as_tensor().unwrap();
        assert_eq!((buf.kind(), buf.size()), (Kind::Float, vec![4]));
        let group = opt.get("param_groups").unwrap().get(0).unwrap();
        assert_eq!(group.get("lr").unwrap().as_f64().unwrap(), 0.1);
        assert_eq!(group.get("momentum").unwrap().as_f64().unwrap(), 0.9);
        assert_eq!(group.get("weight_decay").unwrap().as_f64().unwrap(), 1e-4);
        assert!(!group.get("nesterov").unwrap().as_bool().unwrap());
        let params: Vec<i64> =
            group.get("params").unwrap().elements().unwrap().iter().map(|n| n.as_i64().unwrap()).collect();
        assert_eq!(params, (0..6).collect::<Vec<_>>());

        let adam = torch_io::load(dir.path().join(format!("ckpt_adam.{fmt}.pt"))).unwrap();
        let group = adam.get("optimizer").unwrap().get("param_groups").unwrap().get(0).unwrap();
        let betas: Vec<f64> =
            group.get("betas").unwrap().elements().unwrap().iter().map(|n| n.as_f64().unwrap()).collect();
        assert_eq!(betas, [0.9, 0.999]);
        assert_eq!(group.get("eps").unwrap().as_f64().unwrap(), 1e-8);
        assert_eq!(group.get("weight_decay").unwrap().as_f64().unwrap(), 0.0);
        let s5 = adam.get("optimizer").unwrap().get("state").unwrap().get(5).unwrap();
        let step = s5.get("step").unwrap().as_tensor().unwrap();
        assert_eq!((step.kind(), step.dim(), step.double_value(&[])), (Kind::Float, 0, 3.0));
        assert_eq!(s5.get("exp_avg_sq").unwrap().as_tensor().unwrap().size(), [3]);

        // Typed errors name the path.
        let err = adam.get("optimizer").unwrap().get("state").unwrap().get(99).unwrap_err();
        assert!(
            matches!(&err, TorchIoError::MissingKey { path, key } if path == "optimizer.state" && key == "99"),
            "{err}"
        );
        let err = s5.get("exp_avg").unwrap().as_i64().unwrap_err();
        assert_eq!(err.to_string(), "optimizer.state.5.exp_avg is a Tensor, expected int");
        let err = adam.get("model").unwrap().get("fc.weight").unwrap().get(0).unwrap_err();
        assert!(matches!(&err, TorchIoError::TypeMismatch { path, .. } if path == "model[\"fc.weight\"]"), "{err}");
    }
}

#[test]
fn edge_cases_from_python_read_exactly_with_sharing() {
    let dir = fixtures("edge");
    let expected = read_json(&dir.path().join("edge.json"));
    // The Rust recipe builds what Python built.
    assert_same_json(&manifest(&edge_tree()), &expected, "Rust edge_tree vs Python edge_tree");
    for fmt in ["zip", "legacy", "p4"] {
        let v = torch_io::load(dir.path().join(format!("edge.{fmt}.pt"))).unwrap();
        assert_same_json(&manifest(&v), &expected, &format!("edge.{fmt}.pt"));
        // Spot checks of what the manifest encodes.
        let tr = tensor_at(&v, "transposed");
        assert_eq!((tr.size(), tr.stride(), tr.storage_offset()), (vec![6, 4], vec![1, 6], 0));
        let sl = tensor_at(&v, "sliced");
        assert_eq!((sl.size(), sl.stride(), sl.storage_offset()), (vec![2, 3], vec![6, 1], 8));
        assert_eq!(sl.double_value(&[0, 0]), (8.0 - 7.0) / 8.0);
        let big = v.get("big_ints").unwrap();
        assert_eq!(big.get(1).unwrap().as_i64().unwrap(), i64::MIN);
        assert!(matches!(big.get(3).unwrap().value(), Value::BigInt(b) if b.to_i128() == Some(1 << 63)));
        assert!(matches!(big.get(3).unwrap().as_i64(), Err(TorchIoError::IntOutOfRange { .. })));
        assert!(v.get("floats").unwrap().get(2).unwrap().as_f64().unwrap().is_nan());
        assert_eq!(v.get("int_keys").unwrap().get(-5).unwrap().as_str().unwrap(), "minus five");
        assert_eq!(tensor_at(&v, "scalar").dim(), 0);
        // Sharing is real memory sharing in tch too.
        assert_shared(tensor_at(&v, "tied_a"), &[4], tensor_at(&v, "tied_b"), &[1]);
        // sliced[0][0] is element 8 of the storage: m[1][2], transposed[2][1].
        assert_shared(tensor_at(&v, "transposed"), &[2, 1], tensor_at(&v, "sliced"), &[0, 0]);
    }
}

#[test]
fn legacy_storage_views_read_as_torch_reads_them() {
    let dir = fixtures("legacy_view");
    // A legacy stream with storage views (torch < 1.0), checked with torch 2.13.
    let lv = torch_io::load(dir.path().join("legacy_view.pt")).unwrap();
    let mut expected = read_json(&dir.path().join("legacy_view.json"));
    // "all" views the root storage; v1 and v2 the slice from element 2: Python numbers the
    // slice as its own storage object (id 1), tch shares the root's (id 0).
    for i in [1, 2] {
        let item = &mut expected["items"][i];
        let off = item[1]["offset"].as_i64().unwrap();
        item[1]["offset"] = json!(off + 2);
        assert_eq!(item[1]["storage"], 1);
        item[1]["storage"] = json!(0);
    }
    assert_same_json(&manifest(&lv), &expected, "legacy_view.pt");
    assert_shared(tensor_at(&lv, "all"), &[4], tensor_at(&lv, "v2"), &[1]);
}

// ---------------------------------------------------------------------------------------------
// Rust writes, Python reads

#[test]
fn rust_files_load_in_python_with_weights_only_true_and_false() {
    let dir = fixtures("real");
    let out = tempfile::tempdir().unwrap();
    let mut specs = Vec::new();
    let mut trees = Vec::new();
    // The edge cases, built in Rust.
    let edge = out.path().join("edge_rust.pt");
    torch_io::save(&edge, &edge_tree()).unwrap();
    specs.push(format!("{}:edge", edge.display()));
    trees.push((edge.clone(), edge_tree()));
    // Python's own checkpoints, read and written back: torch.load must give the same tree.
    for name in ["state_dict.zip", "state_dict.legacy", "ckpt_sgd.zip", "ckpt_adam.legacy"] {
        let src = dir.path().join(format!("{name}.pt"));
        let v = torch_io::load(&src).unwrap();
        let dst = out.path().join(format!("{name}.resaved.pt"));
        torch_io::save(&dst, &v).unwrap();
        specs.push(format!("{}:{}", dst.display(), src.display()));
        trees.push((dst, v));
    }
    // The same file as a big-endian machine writes it: torch.load and tch-amp both swap back.
    let swapped = out.path().join("edge_big_endian.pt");
    std::fs::write(&swapped, big_endian_copy(&std::fs::read(&edge).unwrap(), &manifest(&edge_tree()))).unwrap();
    specs.push(format!("{}:edge", swapped.display()));
    trees.push((swapped.clone(), edge_tree()));
    let back = torch_io::load(&swapped).unwrap();
    assert_same_json(&manifest(&back), &manifest(&edge_tree()), "edge_big_endian.pt read back");
    let report = out.path().join("report.json");
    let mut args = vec!["check".to_string(), report.display().to_string()];
    args.extend(specs);
    run_script(&args.iter().map(String::as_str).collect::<Vec<_>>());
    let loaded = read_json(&report);
    for (path, tree) in &trees {
        let m = &loaded[path.display().to_string()];
        assert_same_json(m, &manifest(tree), &format!("{} as torch.load read it", path.display()));
    }
    // And Rust reads its own file back identically (storages are written once: the edge tree
    // has 20 tensors on 18 storages).
    let back = torch_io::load(&edge).unwrap();
    assert_same_json(&manifest(&back), &manifest(&edge_tree()), "edge_rust.pt read back");
    let bytes = std::fs::read(&edge).unwrap();
    let archive = zip::ZipArchive::new(Cursor::new(&bytes)).unwrap();
    let storages = archive.file_names().filter(|n| n.starts_with("archive/data/")).count();
    assert_eq!(storages, 18, "one record per shared storage");
}

/// A tch-amp zip file rewritten as a big-endian machine would write it: `byteorder` = "big",
/// every storage's elements (each component of a complex) byte-reversed. Storage keys are
/// numbered in first-use order, as the manifest numbers storages, which gives each its dtype.
fn big_endian_copy(file: &[u8], manifest: &Json) -> Vec<u8> {
    fn dtypes(m: &Json, out: &mut HashMap<u64, String>) {
        match m {
            Json::Object(o) if o.get("t") == Some(&json!("tensor")) => {
                let sid = o["storage"].as_u64().unwrap();
                out.entry(sid).or_insert_with(|| o["dtype"].as_str().unwrap().to_string());
            }
            Json::Object(o) => o.values().for_each(|v| dtypes(v, out)),
            Json::Array(a) => a.iter().for_each(|v| dtypes(v, out)),
            _ => {}
        }
    }
    let mut kinds = HashMap::new();
    dtypes(manifest, &mut kinds);
    let mut zip = zip::ZipWriter::new(Cursor::new(Vec::new()));
    for (name, mut bytes) in records(file) {
        if name == "archive/byteorder" {
            bytes = b"big".to_vec();
        }
        if let Some(key) = name.strip_prefix("archive/data/") {
            let n = match kinds[&key.parse::<u64>().unwrap()].as_str() {
                "float64" | "int64" | "complex128" => 8,
                "float32" | "int32" | "complex64" => 4,
                "float16" | "bfloat16" | "int16" => 2,
                _ => 1,
            };
            bytes.chunks_exact_mut(n).for_each(|c| c.reverse());
        }
        let opts = zip::write::FileOptions::default().compression_method(zip::CompressionMethod::Stored);
        zip.start_file_aligned(name, opts, 64).unwrap();
        zip.write_all(&bytes).unwrap();
    }
    zip.finish().unwrap().into_inner()
}

// ---------------------------------------------------------------------------------------------
// Bad files

fn assert_err<T: std::fmt::Debug>(r: Result<T, TorchIoError>, ok: impl Fn(&TorchIoError) -> bool, what: &str) {
    match r {
        Ok(v) => panic!("{what}: loaded {v:?}"),
        Err(e) => assert!(ok(&e), "{what}: unexpected error {e:?} ({e})"),
    }
}

#[test]
fn bad_files_from_python_give_typed_errors_and_run_nothing() {
    let dir = fixtures("bad");
    let sentinel = dir.path().join("pwned");
    for fmt in ["zip", "legacy"] {
        let path = dir.path().join(format!("evil.{fmt}.pt"));
        assert_err(
            torch_io::load(&path),
            |e| matches!(e, TorchIoError::DisallowedGlobal { module, name, .. } if module == "posix" && name == "system"),
            &format!("evil.{fmt}.pt"),
        );
        assert!(!sentinel.exists(), "the payload ran");
    }
    assert_err(
        torch_io::load(dir.path().join("uint16.pt")),
        |e| matches!(e, TorchIoError::UnknownDtype { name, .. } if name == "torch.uint16"),
        "uint16 tensor",
    );
    assert_err(
        torch_io::load(dir.path().join("bad_magic.pt")),
        |e| matches!(e, TorchIoError::BadMagic { found } if found == "12345"),
        "wrong magic",
    );
    // Truncated legacy stream: every cut is a typed error.
    let legacy = std::fs::read(dir.path().join("seed.legacy.pt")).unwrap();
    let opts = LoadOptions::new();
    for cut in [1, 5, 20, 40, legacy.len() / 3, legacy.len() / 2, legacy.len() - 100, legacy.len() - 1] {
        assert_err(
            torch_io::load_bytes(&legacy[..cut], &opts),
            |e| matches!(e, TorchIoError::Truncated { .. } | TorchIoError::BadMagic { .. }),
            &format!("legacy cut at {cut}"),
        );
    }
    assert!(torch_io::load_bytes(&legacy, &opts).is_ok());
}

/// A zip archive holding `records` under "archive/".
fn zip_of(records: &[(&str, &[u8])]) -> Vec<u8> {
    let named: Vec<(String, &[u8], bool)> = records.iter().map(|(n, b)| (format!("archive/{n}"), *b, false)).collect();
    zip_named(&named)
}

/// A zip archive of (full name, bytes, deflated) records.
fn zip_named(records: &[(String, &[u8], bool)]) -> Vec<u8> {
    let mut zip = zip::ZipWriter::new(Cursor::new(Vec::new()));
    for (name, bytes, deflated) in records {
        let method = if *deflated { zip::CompressionMethod::Deflated } else { zip::CompressionMethod::Stored };
        zip.start_file(name.as_str(), zip::write::FileOptions::default().compression_method(method)).unwrap();
        zip.write_all(bytes).unwrap();
    }
    zip.finish().unwrap().into_inner()
}

/// A protocol-2 pickle of `{"x": _rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())}`
/// with a `numel`-element storage of type `storage_type`.
fn tensor_pickle(storage_type: &str, numel: u32, offset: u32, size: &[u32], stride: &[u32]) -> Vec<u8> {
    let mut p = b"\x80\x02}X\x01\x00\x00\x00xctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage".to_vec();
    p.extend(format!("ctorch\n{storage_type}\n").as_bytes());
    p.extend(b"X\x01\x00\x00\x000X\x03\x00\x00\x00cpu");
    let int = |p: &mut Vec<u8>, v: u32| {
        p.push(b'J');
        p.extend(v.to_le_bytes());
    };
    int(&mut p, numel);
    p.extend(b"tQ");
    int(&mut p, offset);
    for dims in [size, stride] {
        p.push(b'(');
        for &d in dims {
            int(&mut p, d);
        }
        p.push(b't');
    }
    p.extend(b"\x89ccollections\nOrderedDict\n)RtRs.");
    p
}

#[test]
fn malformed_files_give_typed_errors() {
    let opts = LoadOptions::new();
    let load = |b: &[u8]| torch_io::load_bytes(b, &opts);
    let f32s: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0].iter().flat_map(|x| x.to_le_bytes()).collect();

    // The handcrafted pickle is valid when it fits.
    let good = zip_of(&[("data.pkl", &tensor_pickle("FloatStorage", 4, 1, &[3], &[1])), ("data/0", &f32s)]);
    let v = load(&good).unwrap();
    assert_eq!(Vec::<f32>::try_from(tensor_at(&v, "x")).unwrap(), [2.0, 3.0, 4.0]);

    // Views that reach past their storage, checked before libtorch sees them.
    for (offset, size, stride) in [
        (0u32, vec![5u32], vec![1u32]),
        (2, vec![3], vec![1]),
        (0, vec![3], vec![2]),
        (5, vec![0], vec![1]),
        (0, vec![2, 2], vec![3, 1]),
        (0, vec![u32::MAX / 2, u32::MAX / 2, 4], vec![u32::MAX / 2, u32::MAX / 2, 1]),
        (0, vec![3], vec![u32::MAX]),
    ] {
        let bytes =
            zip_of(&[("data.pkl", &tensor_pickle("FloatStorage", 4, offset, &size, &stride)), ("data/0", &f32s)]);
        assert_err(
            load(&bytes),
            |e| matches!(e, TorchIoError::StorageOutOfBounds { storage_numel: 4, .. }),
            &format!("offset {offset} size {size:?} stride {stride:?}"),
        );
    }
    // Negative values (BININT is signed).
    let neg = zip_of(&[("data.pkl", &tensor_pickle("FloatStorage", 4, 0, &[2], &[u32::MAX])), ("data/0", &f32s)]);
    assert_err(load(&neg), |e| matches!(e, TorchIoError::StorageOutOfBounds { .. }), "negative stride");
    let neg = zip_of(&[("data.pkl", &tensor_pickle("FloatStorage", 4, u32::MAX, &[1], &[1])), ("data/0", &f32s)]);
    assert_err(load(&neg), |e| matches!(e, TorchIoError::StorageOutOfBounds { .. }), "negative offset");
    // The record holds fewer (or more) bytes than the pickle declares.
    let short = zip_of(&[("data.pkl", &tensor_pickle("FloatStorage", 4, 0, &[4], &[1])), ("data/0", &f32s[..12])]);
    assert_err(
        load(&short),
        |e| matches!(e, TorchIoError::StorageSize { expected: 16, found: 12, .. }),
        "storage record too small",
    );
    let missing = zip_of(&[("data.pkl", &tensor_pickle("FloatStorage", 4, 0, &[4], &[1]))]);
    assert_err(
        load(&missing),
        |e| matches!(e, TorchIoError::MissingRecord { name, .. } if name == "archive/data/0"),
        "no storage",
    );
    // Unknown storage types.
    let q = zip_of(&[("data.pkl", &tensor_pickle("QInt8Storage", 4, 0, &[4], &[1])), ("data/0", &f32s)]);
    assert_err(
        load(&q),
        |e| matches!(e, TorchIoError::UnknownDtype { name, .. } if name == "torch.QInt8Storage"),
        "qint8",
    );
    // Bool storages hold 0 and 1 only.
    let b = zip_of(&[("data.pkl", &tensor_pickle("BoolStorage", 4, 0, &[4], &[1])), ("data/0", &[0, 1, 2, 1])]);
    assert_err(load(&b), |e| matches!(e, TorchIoError::InvalidBool { index: 2, byte: 2, .. }), "bool 2");

    // Not a torch file at all.
    assert_err(load(b""), |e| matches!(e, TorchIoError::UnknownFormat { .. }), "empty");
    assert_err(load(b"hello world, not a checkpoint"), |e| matches!(e, TorchIoError::UnknownFormat { .. }), "text");
    assert_err(load(b"PK\x03\x04garbage"), |e| matches!(e, TorchIoError::Zip { .. }), "not a zip");
    let no_pkl = zip_of(&[("other.txt", b"x")]);
    assert_err(load(&no_pkl), |e| matches!(e, TorchIoError::MissingRecord { .. }), "zip without data.pkl");
    // Truncated zip: every cut is a typed error.
    let full = torch_io::save_bytes(&edge_tree()).unwrap();
    for cut in [4, 30, 100, full.len() / 2, full.len() - 22, full.len() - 1] {
        assert_err(load(&full[..cut]), |e| matches!(e, TorchIoError::Zip { .. }), &format!("zip cut at {cut}"));
    }
    // A checksum that does not match.
    let mut flipped = good.clone();
    let at = flipped.windows(4).position(|w| w == 2.0f32.to_le_bytes()).unwrap();
    flipped[at] ^= 1;
    assert_err(load(&flipped), |e| matches!(e, TorchIoError::Zip { .. }), "crc");

    // Pickle-level malformations.
    let pkl = |p: &[u8]| load(&zip_of(&[("data.pkl", p)]));
    assert_err(
        pkl(b"\x80\x02cos\nsystem\nX\x02\x00\x00\x00lsR."),
        |e| matches!(e, TorchIoError::DisallowedGlobal { module, name, .. } if module == "os" && name == "system"),
        "os.system",
    );
    assert_err(pkl(b"\x80\x02cbuiltins\neval\n."), |e| matches!(e, TorchIoError::DisallowedGlobal { .. }), "eval");
    assert_err(
        pkl(b"\x80\x02\x8c\x02osS."),
        |e| matches!(e, TorchIoError::UnknownOpcode { opcode: b'S', .. }),
        "STRING",
    );
    assert_err(pkl(b"\x80\x02]h\x05."), |e| matches!(e, TorchIoError::Pickle { .. }), "memo miss");
    assert_err(pkl(b"\x80\x02a."), |e| matches!(e, TorchIoError::Pickle { .. }), "stack underflow");
    assert_err(pkl(b"\x80\x02}K\x01"), |e| matches!(e, TorchIoError::Truncated { .. }), "no STOP");
    assert_err(pkl(b"\x80\x02X\xff\xff\xff\x7fab."), |e| matches!(e, TorchIoError::Truncated { .. }), "long string");
    assert_err(pkl(b"\x80\x02}K\x01K\x02s\x8f."), |e| matches!(e, TorchIoError::Unsupported { .. }), "set");
    // A list holding itself, and deep nesting: bounded, not a stack overflow.
    assert_err(pkl(b"\x80\x02]q\x00h\x00a."), |e| matches!(e, TorchIoError::TooDeep { .. }), "self reference");
    let mut deep = b"\x80\x02".to_vec();
    deep.extend(std::iter::repeat(b']').take(100_000));
    deep.extend(std::iter::repeat(b'a').take(99_999));
    deep.push(b'.');
    assert_err(pkl(&deep), |e| matches!(e, TorchIoError::TooDeep { .. }), "deep nesting");
    // Shared references expanding exponentially: bounded by the node budget.
    let mut bomb = b"\x80\x02]q\x00".to_vec();
    for i in 0..40u8 {
        bomb.extend([b'h', i, b'h', i, 0x86, b'q', i + 1]);
    }
    bomb.push(b'.');
    assert_err(pkl(&bomb), |e| matches!(e, TorchIoError::TooLarge { .. }), "reference bomb");
    // A dict key that is neither str nor int.
    assert_err(
        pkl(b"\x80\x02}G?\xf0\x00\x00\x00\x00\x00\x00K\x01s."),
        |e| matches!(e, TorchIoError::UnsupportedKey { found: "float", .. }),
        "float key",
    );
}

// ---------------------------------------------------------------------------------------------
// Hostile files: crafted here, at test time, to each bound the module docs state

/// LONG_BINPUT / LONG_BINGET.
fn put(p: &mut Vec<u8>, i: u32) {
    p.push(b'r');
    p.extend(i.to_le_bytes());
}

fn get(p: &mut Vec<u8>, i: u32) {
    p.push(b'j');
    p.extend(i.to_le_bytes());
}

/// A pickle calling the global `module.name` (memo 0) on one argument (memo 1) `calls` times,
/// after `setup` pushed and memoized the argument (and popped it).
fn repeated_calls(module: &str, name: &str, setup: &[u8], calls: usize) -> Vec<u8> {
    let mut p = b"\x80\x02".to_vec();
    p.extend(format!("c{module}\n{name}\n").bytes());
    put(&mut p, 0);
    p.push(b'0');
    p.extend(setup);
    p.extend(b"](");
    for _ in 0..calls {
        get(&mut p, 0);
        get(&mut p, 1);
        p.extend(b"\x85R");
    }
    p.extend(b"e.");
    p
}

/// Sets the uncompressed size of every header (local and central) of the entry `name`.
fn patch_size(zip: &mut [u8], name: &str, size: u32) {
    let mut patched = 0;
    for at in 0..zip.len().saturating_sub(46) {
        let (name_len_at, name_at, size_at) = match &zip[at..at + 4] {
            b"PK\x03\x04" => (at + 26, at + 30, at + 22),
            b"PK\x01\x02" => (at + 28, at + 46, at + 24),
            _ => continue,
        };
        let n = u16::from_le_bytes([zip[name_len_at], zip[name_len_at + 1]]) as usize;
        if zip.get(name_at..name_at + n) == Some(name.as_bytes()) {
            zip[size_at..size_at + 4].copy_from_slice(&size.to_le_bytes());
            patched += 1;
        }
    }
    assert_eq!(patched, 2, "{name}: local and central header");
}

/// Renames `from` to `to` (same length) wherever it occurs: two entries can then share a name.
fn rename(zip: &mut [u8], from: &str, to: &str) {
    assert_eq!(from.len(), to.len());
    for at in 0..zip.len() - from.len() {
        if &zip[at..at + from.len()] == from.as_bytes() {
            zip[at..at + to.len()].copy_from_slice(to.as_bytes());
        }
    }
}

/// Loads `bytes` with the time it took, which must be a few seconds at most.
fn timed_load(bytes: &[u8], what: &str) -> Result<Value, TorchIoError> {
    let start = Instant::now();
    let r = torch_io::load_bytes(bytes, &LoadOptions::new());
    let took = start.elapsed();
    eprintln!(
        "{what}: {} bytes, {:.3} s, {}",
        bytes.len(),
        took.as_secs_f64(),
        match &r {
            Ok(_) => "loaded".to_string(),
            Err(e) => format!("{e}"),
        }
    );
    assert!(took < Duration::from_secs(10), "{what} took {took:?}");
    r
}

/// Every crafted file that once crashed the process (stack overflow, memory, a debug-build
/// panic) or was read differently than torch.load reads it gives its typed error in bounded
/// time and memory. The files are built here; none is stored in the repository.
#[test]
fn hostile_files_are_refused_within_bounds() {
    // Stack: _rebuild_from_type_v2 nested in its own third argument 100,000 times.
    let mut p = b"\x80\x02ctorch._tensor\n_rebuild_from_type_v2\n".to_vec();
    put(&mut p, 0);
    p.extend(b"0ctorch\nTensor\n");
    put(&mut p, 1);
    p.extend(b"0)");
    put(&mut p, 2);
    p.push(b'0');
    for _ in 0..100_000 {
        p.push(b'(');
        for i in 0..3 {
            get(&mut p, i);
        }
        p.extend(b"Nt");
        put(&mut p, 2);
        p.push(b'0');
    }
    get(&mut p, 0);
    get(&mut p, 2);
    p.extend(b"R.");
    assert_err(
        timed_load(&zip_of(&[("data.pkl", &p)]), "nested rebuild"),
        |e| matches!(e, TorchIoError::TooDeep { what: "nested _rebuild_from_type_v2 calls", limit: 256, .. }),
        "nested rebuild",
    );

    // Memory: one 1 MiB string referenced 20,000 times (20 GiB as a tree).
    let mut p = b"\x80\x02X".to_vec();
    p.extend((1u32 << 20).to_le_bytes());
    p.extend(std::iter::repeat(b'a').take(1 << 20));
    p.extend(b"q\x010](");
    for _ in 0..20_000 {
        p.extend(b"h\x01");
    }
    p.extend(b"e.");
    assert_err(
        timed_load(&zip_of(&[("data.pkl", &p)]), "shared string"),
        |e| matches!(e, TorchIoError::TooLarge { .. }),
        "shared string",
    );

    // Memory and time: calls that copy a whole container, again and again (quadratic).
    let mut dict = b"}".to_vec();
    put(&mut dict, 1);
    dict.push(b'(');
    dict.extend(std::iter::repeat(b"K\x01N".as_slice()).take(50_000).flatten());
    dict.extend(b"u0");
    let mut list = b"]".to_vec();
    put(&mut list, 1);
    list.push(b'(');
    list.extend(std::iter::repeat(b"K\x01".as_slice()).take(50_000).flatten());
    list.extend(b"e0");
    let mut bytes = b"B".to_vec();
    bytes.extend((1u32 << 20).to_le_bytes());
    bytes.extend(vec![0u8; 1 << 20]);
    put(&mut bytes, 1);
    bytes.push(b'0');
    let mut build = b"\x80\x02ccollections\nOrderedDict\n)R".to_vec();
    put(&mut build, 0);
    build.push(b'}');
    put(&mut build, 1);
    build.extend(b"(X\x01\x00\x00\x00a");
    put(&mut build, 2);
    build.push(b'N');
    for _ in 1..50_000 {
        get(&mut build, 2);
        build.push(b'N');
    }
    build.extend(b"u0");
    get(&mut build, 0);
    for _ in 0..50_000 {
        get(&mut build, 1);
        build.push(b'b');
    }
    build.push(b'.');
    for (what, p) in [
        ("OrderedDict(d)", repeated_calls("collections", "OrderedDict", &dict, 50_000)),
        ("torch.Size(l)", repeated_calls("torch", "Size", &list, 50_000)),
        ("bytearray(b)", repeated_calls("builtins", "bytearray", &bytes, 20_000)),
        ("BUILD", build),
    ] {
        assert_err(
            timed_load(&zip_of(&[("data.pkl", &p)]), what),
            |e| matches!(e, TorchIoError::TooLarge { .. }),
            what,
        );
    }

    // Zip: a data.pkl deflated 1000:1 is refused before it is inflated; one deflated as
    // ordinary data is read.
    let mut p = b"\x80\x02B".to_vec();
    p.extend((4u32 << 20).to_le_bytes());
    p.extend(vec![0u8; 4 << 20]);
    p.push(b'.');
    let bomb = zip_named(&[("archive/data.pkl".into(), &p, true)]);
    assert!(bomb.len() < 64 << 10, "{}", bomb.len());
    assert_err(timed_load(&bomb, "deflated data.pkl"), |e| matches!(e, TorchIoError::TooLarge { .. }), "zip bomb");
    let f32s: Vec<u8> = [1.0f32, 2.0, 3.0, 4.0].iter().flat_map(|x| x.to_le_bytes()).collect();
    let good_pkl = tensor_pickle("FloatStorage", 4, 1, &[3], &[1]);
    let deflated = zip_named(&[("archive/data.pkl".into(), &good_pkl, true), ("archive/data/0".into(), &f32s, false)]);
    let v = timed_load(&deflated, "deflated data.pkl of an ordinary file").unwrap();
    assert_eq!(Vec::<f32>::try_from(tensor_at(&v, "x")).unwrap(), [2.0, 3.0, 4.0]);
    // A storage of 2 GiB declared, 64 KiB of deflated bytes in the archive (a 4 GiB storage
    // deflates into 4 MiB): refused from the headers.
    let n = 0x7fff_0000u32;
    let zeros = vec![0u8; 64 << 10];
    let mut big = zip_named(&[
        ("archive/data.pkl".into(), &tensor_pickle("ByteStorage", n, 0, &[1], &[1]), false),
        ("archive/data/0".into(), &zeros, true),
    ]);
    patch_size(&mut big, "archive/data/0", n);
    assert_err(
        timed_load(&big, "deflated 2 GiB storage"),
        |e| matches!(e, TorchIoError::TooLarge { what, .. } if what.contains("archive/data/0")),
        "storage bomb",
    );

    // Duplicate entries: torch.load reads the first, zip tools the last; refused.
    let other = tensor_pickle("FloatStorage", 4, 0, &[2], &[1]);
    let mut dup = zip_of(&[("data.pkl", &good_pkl), ("data.pkX", &other), ("data/0", &f32s)]);
    rename(&mut dup, "archive/data.pkX", "archive/data.pkl");
    assert_err(
        timed_load(&dup, "two data.pkl"),
        |e| matches!(e, TorchIoError::DuplicateRecord { name } if name == "archive/data.pkl"),
        "two data.pkl",
    );
    let mut dup = zip_of(&[("data.pkl", &good_pkl), ("data/0", &f32s), ("data/X", &[0u8; 16])]);
    rename(&mut dup, "archive/data/X", "archive/data/0");
    assert_err(
        timed_load(&dup, "two data/0"),
        |e| matches!(e, TorchIoError::DuplicateRecord { name } if name == "archive/data/0"),
        "two data/0",
    );
    // Two top folders: torch.load reads one of them; refused.
    let two = zip_named(&[
        ("archive/data.pkl".into(), &good_pkl, false),
        ("archive/data/0".into(), &f32s, false),
        ("other/data.pkl".into(), &other, false),
    ]);
    assert_err(
        timed_load(&two, "two folders"),
        |e| matches!(e, TorchIoError::MixedFolders { first, second } if first == "archive/" && second == "other/"),
        "two folders",
    );

    // Overflow: a float32 tensor on a storage declared with 2^62 doubles (2^65 bytes).
    let mut p = b"\x80\x02ctorch._utils\n_rebuild_tensor_v3\n((\x8c\x07storagectorch\nDoubleStorage\n\x8c\x010\x8c\x03cpu\x8a\x08".to_vec();
    p.extend((1u64 << 62).to_le_bytes());
    p.extend(b"tQK\x00(K\x01t(K\x01t\x89ccollections\nOrderedDict\n)Rctorch\nfloat32\ntR.");
    assert_err(
        timed_load(&zip_of(&[("data.pkl", &p)]), "2^62 doubles"),
        |e| matches!(e, TorchIoError::StorageMismatch { key, message } if key == "0" && message.contains("overflow")),
        "size overflow",
    );

    // The tar container of torch < 0.1.10 is not read: the error says how to re-save it.
    let mut tar = vec![0u8; 1024];
    tar[..8].copy_from_slice(b"sys_info");
    tar[257..262].copy_from_slice(b"ustar");
    assert_eq!(torch_io::detect_format(&tar), Some(Format::Tar));
    assert_err(timed_load(&tar, "tar"), |e| matches!(e, TorchIoError::LegacyTar), "tar");
    assert!(TorchIoError::LegacyTar.to_string().contains("torch.save(torch.load(path, weights_only=False)"));
}

// ---------------------------------------------------------------------------------------------
// Saving

#[test]
fn save_is_atomic_and_refuses_what_it_cannot_write() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt.pt");
    let first = Value::Dict(Dict::new().with("epoch", Value::Int(1)));
    torch_io::save(&path, &first).unwrap();
    let before = std::fs::read(&path).unwrap();
    let listing = || {
        let mut v: Vec<String> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        v.sort();
        v
    };

    // Values the format cannot hold fail before the file is touched, and leave no temp file.
    let mut attrs = Dict::new();
    attrs.set_attribute("_metadata", Value::None);
    let sparse = Tensor::eye(3, (Kind::Float, Device::Cpu)).to_sparse_sparse_dim(2);
    let f = Tensor::arange(4, (Kind::Float, Device::Cpu));
    let two_dtypes = f.view_dtype(Kind::Int);
    let mut deep = Value::None;
    for _ in 0..300 {
        deep = Value::List(vec![deep]);
    }
    let bad = [
        (Value::Dict(Dict::new().with("epoch", Value::Int(2)).with("x", Value::Dict(attrs))), "attributes on a dict"),
        (Value::List(vec![Value::Tensor(sparse)]), "sparse tensor"),
        (Value::List(vec![Value::Tensor(f.shallow_clone()), Value::Tensor(two_dtypes)]), "two dtypes on a storage"),
        (
            Value::List(vec![Value::Tensor(Tensor::arange(2, (Kind::Float, Device::Cpu)).quantize_per_tensor(
                0.1,
                0,
                Kind::QInt8,
            ))]),
            "quantized",
        ),
    ];
    for (v, what) in &bad {
        let e = torch_io::save(&path, v).unwrap_err();
        assert!(matches!(e, TorchIoError::CannotSave { .. }), "{what}: {e:?}");
        assert_eq!(std::fs::read(&path).unwrap(), before, "{what}: previous file changed");
        assert_eq!(listing(), ["ckpt.pt"], "{what}: temp file left behind");
    }
    let e = torch_io::save(&path, &deep).unwrap_err();
    assert!(matches!(e, TorchIoError::TooDeep { .. }), "{e:?}");
    assert_eq!(listing(), ["ckpt.pt"]);
    // An unwritable target.
    let e = torch_io::save(dir.path().join("missing/dir/ckpt.pt"), &first).unwrap_err();
    assert!(matches!(e, TorchIoError::Io { .. }), "{e:?}");

    // A successful save replaces the file.
    let second = Value::Dict(Dict::new().with("epoch", Value::Int(2)));
    torch_io::save(&path, &second).unwrap();
    assert_eq!(torch_io::load(&path).unwrap().get("epoch").unwrap().as_i64().unwrap(), 2);
    assert_eq!(listing(), ["ckpt.pt"]);
    // The bytes are deterministic (fixed timestamps, keys in tree order).
    assert_eq!(torch_io::save_bytes(&edge_tree()).unwrap(), torch_io::save_bytes(&edge_tree()).unwrap());
    // A slice is saved without its parent's unused elements.
    let parent = Tensor::arange(1000, (Kind::Float, Device::Cpu));
    let small = torch_io::save_bytes(&Value::Tensor(parent.narrow(0, 0, 3))).unwrap();
    let big = torch_io::save_bytes(&Value::Tensor(parent)).unwrap();
    assert!(small.len() + 3900 < big.len(), "{} vs {}", small.len(), big.len());
}

// ---------------------------------------------------------------------------------------------
// Fuzz

use common::SeededRng as Rng;

/// 1 to 4 mutations: bit flips, interesting bytes, truncation, splices from `donor`, deletion,
/// duplication.
fn mutate(rng: &mut Rng, seed: &[u8], donor: &[u8]) -> Vec<u8> {
    let mut b = seed.to_vec();
    for _ in 0..1 + rng.below(4) {
        if b.is_empty() {
            break;
        }
        let at = rng.below(b.len());
        match rng.below(7) {
            0 => b[at] ^= 1 << rng.below(8),
            1 => b[at] = [0, 1, 0x7f, 0x80, 0xff, b'(', b'.', b'h', b'q'][rng.below(9)],
            2 => b[at] = rng.next() as u8,
            3 => b.truncate(at),
            4 => {
                let len = 1 + rng.below(32.min(donor.len()));
                let from = rng.below(donor.len() - len + 1);
                let end = (at + len).min(b.len());
                b.splice(at..end, donor[from..from + len].iter().copied());
            }
            5 => {
                let end = (at + 1 + rng.below(16)).min(b.len());
                b.drain(at..end);
            }
            _ => {
                let end = (at + 1 + rng.below(16)).min(b.len());
                let chunk = b[at..end].to_vec();
                b.splice(at..at, chunk);
            }
        }
    }
    b
}

/// The records of a zip archive, to rebuild it around a mutated data.pkl (valid checksums, so
/// the mutation reaches the unpickler).
fn records(bytes: &[u8]) -> Vec<(String, Vec<u8>)> {
    let mut a = zip::ZipArchive::new(Cursor::new(bytes)).unwrap();
    (0..a.len())
        .map(|i| {
            let mut f = a.by_index(i).unwrap();
            let mut v = Vec::new();
            std::io::Read::read_to_end(&mut f, &mut v).unwrap();
            (f.name().to_string(), v)
        })
        .collect()
}

fn rezip(records: &[(String, Vec<u8>)], pkl: &[u8]) -> Vec<u8> {
    let mut zip = zip::ZipWriter::new(Cursor::new(Vec::new()));
    for (name, bytes) in records {
        zip.start_file(name, zip::write::FileOptions::default().compression_method(zip::CompressionMethod::Stored))
            .unwrap();
        zip.write_all(if name.ends_with("/data.pkl") { pkl } else { bytes }).unwrap();
    }
    zip.finish().unwrap().into_inner()
}

/// Reads every tensor of a successfully loaded tree (small ones), so a view outside its
/// storage would be touched.
fn touch(v: &Value) -> usize {
    match v {
        Value::Tensor(t) if t.numel() <= 1 << 20 => {
            let _ = tensor_bytes(t);
            1
        }
        Value::List(x) | Value::Tuple(x) => x.iter().map(touch).sum(),
        Value::Dict(d) => {
            d.iter().map(|(_, x)| touch(x)).sum::<usize>() + d.attributes().map(|(_, x)| touch(x)).sum::<usize>()
        }
        _ => 0,
    }
}

/// At least 10^4 mutated files (12,000: 4,000 raw zip, 4,000 zip with a mutated data.pkl,
/// 4,000 legacy), seeded; none may panic or abort. About 3 s in a debug build on the 2-core CI
/// machine.
#[test]
fn fuzz_reader_never_panics() {
    let dir = fixtures("seeds");
    let zip_seed = std::fs::read(dir.path().join("seed.zip.pt")).unwrap();
    let legacy_seed = std::fs::read(dir.path().join("seed.legacy.pt")).unwrap();
    let rust_seed = torch_io::save_bytes(&edge_tree()).unwrap();
    let recs = records(&zip_seed);
    let pkl = recs.iter().find(|(n, _)| n.ends_with("/data.pkl")).unwrap().1.clone();
    let opts = LoadOptions::new();
    let mut rng = Rng::new(0x7c3a_91e2_5d4b_f018);
    let mut counts: HashMap<String, usize> = HashMap::new();
    let mut tensors_touched = 0;
    let start = Instant::now();
    const PER_FAMILY: usize = 4000;
    const FAMILIES: usize = 3;
    for case in 0..FAMILIES * PER_FAMILY {
        let input = match case / PER_FAMILY {
            0 => {
                let (seed, donor) = if case % 2 == 0 { (&zip_seed, &rust_seed) } else { (&rust_seed, &zip_seed) };
                mutate(&mut rng, seed, donor)
            }
            1 => rezip(&recs, &mutate(&mut rng, &pkl, &legacy_seed)),
            _ => mutate(&mut rng, &legacy_seed, &pkl),
        };
        let result = std::panic::catch_unwind(|| torch_io::load_bytes(&input, &opts));
        let outcome = match result {
            Err(_) => panic!("case {case} panicked; input (hex): {}", hex(&input)),
            Ok(Ok(v)) => {
                tensors_touched += touch(&v);
                "ok".to_string()
            }
            Ok(Err(e)) => format!("{e:?}").split([' ', '{', '(']).next().unwrap().to_string(),
        };
        *counts.entry(outcome).or_default() += 1;
    }
    let mut counts: Vec<_> = counts.into_iter().collect();
    counts.sort_by_key(|c| std::cmp::Reverse(c.1));
    eprintln!(
        "fuzz: {} cases in {:.2} s, {tensors_touched} tensors read from loaded trees; outcomes {counts:?}",
        FAMILIES * PER_FAMILY,
        start.elapsed().as_secs_f64()
    );
    // The mutations reach past the container: some mutated files still load, and the unpickler
    // and the storage checks both reject some.
    let n = |k: &str| counts.iter().find(|(o, _)| o == k).map_or(0, |(_, c)| *c);
    assert!(n("ok") > 100, "{counts:?}");
    assert!(n("Pickle") + n("UnknownOpcode") + n("Truncated") > 100, "{counts:?}");
}

// ---------------------------------------------------------------------------------------------
// Fuzz: generated pickles (proptest)

/// A piece of pickle: one opcode with a plausible argument, or a snippet (a storage persistent
/// id, an allowed or forbidden global) that reaches the reader's deeper paths.
fn pickle_piece() -> impl proptest::strategy::Strategy<Value = Vec<u8>> {
    use proptest::prelude::*;
    let fixed: Vec<&'static [u8]> = vec![
        b"(",
        b")",
        b"]",
        b"}",
        b"t",
        b"l",
        b"d",
        b"a",
        b"e",
        b"s",
        b"u",
        b"0",
        b"1",
        b"2",
        b"N",
        b"\x88",
        b"\x89",
        b"\x85",
        b"\x86",
        b"\x87",
        b"R",
        b"b",
        b"\x81",
        b"Q",
        b"\x94",
        b"\x93",
        b"ccollections\nOrderedDict\n",
        b"ctorch._utils\n_rebuild_tensor_v2\n",
        b"ctorch._utils\n_rebuild_tensor_v3\n",
        b"ctorch._tensor\n_rebuild_from_type_v2\n",
        b"ctorch._utils\n_rebuild_parameter\n",
        b"ctorch\nSize\n",
        b"ctorch\nTensor\n",
        b"ctorch\nfloat16\n",
        b"cbuiltins\nbytearray\n",
        b"c_codecs\nencode\n",
        b"cos\nsystem\n",
        b"(X\x07\x00\x00\x00storagectorch\nFloatStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x04tQ",
        b"(X\x07\x00\x00\x00storagectorch\nByteStorage\nX\x01\x00\x00\x000X\x03\x00\x00\x00cpuK\x10tQ",
        b"\x8c\x06latin1",
        b"\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x40",
        b"G\x7f\xf0\x00\x00\x00\x00\x00\x00",
    ];
    prop_oneof![
        4 => proptest::sample::select(fixed).prop_map(|b| b.to_vec()),
        2 => (0u8..8).prop_map(|i| vec![b'h', i]),
        1 => (0u8..8).prop_map(|i| vec![b'q', i]),
        2 => any::<u8>().prop_map(|k| vec![b'K', k]),
        1 => any::<i32>().prop_map(|v| { let mut b = vec![b'J']; b.extend(v.to_le_bytes()); b }),
        1 => "[a-z0-9._]{0,8}".prop_map(|s| { let mut b = vec![0x8c, s.len() as u8]; b.extend(s.bytes()); b }),
        1 => proptest::collection::vec(any::<u8>(), 0..8).prop_map(|v| { let mut b = vec![b'C', v.len() as u8]; b.extend(v); b }),
        1 => any::<u8>().prop_map(|b| vec![b]),
    ]
}

/// 3,000 pickles of 1 to 60 pieces, with a 16-byte storage beside them: no panic, no abort,
/// each read in well under a second (a typed error or a tree whose tensors can be read).
/// Seeded; about 2 s in a debug build.
#[test]
fn fuzz_generated_pickles_stay_bounded() {
    use proptest::prelude::*;
    use proptest::test_runner::{Config, TestCaseError, TestRunner};
    let config = Config { cases: 3000, failure_persistence: None, max_shrink_iters: 256, ..Config::default() };
    let mut runner = TestRunner::new_with_rng(config, common::rng(0x5eed_0028));
    let storage = [0u8, 0, 128, 63, 0, 0, 0, 64, 0, 0, 64, 64, 0, 0, 128, 64];
    let start = Instant::now();
    runner
        .run(&proptest::collection::vec(pickle_piece(), 1..60), |pieces| {
            let mut p = b"\x80\x02".to_vec();
            p.extend(pieces.concat());
            p.push(b'.');
            let zip = zip_of(&[("data.pkl", &p), ("data/0", &storage)]);
            let t = Instant::now();
            let r = std::panic::catch_unwind(|| torch_io::load_bytes(&zip, &LoadOptions::new()));
            let took = t.elapsed();
            match r {
                Err(_) => return Err(TestCaseError::fail(format!("panicked on pickle {}", hex(&p)))),
                Ok(Ok(v)) => {
                    touch(&v);
                }
                Ok(Err(_)) => {}
            }
            prop_assert!(took < Duration::from_secs(1), "{took:?} on pickle {}", hex(&p));
            Ok(())
        })
        .unwrap();
    eprintln!("fuzz (generated pickles): 3000 cases in {:.2} s", start.elapsed().as_secs_f64());
}

/// A torch.save zip whose data.pkl is `pickle` (protocol 2).
fn pickle_file(pickle: &[u8]) -> Vec<u8> {
    zip_of(&[("data.pkl", pickle)])
}

/// A pickle of `depth` nested containers: `open` makes one, `item` (if any) goes before the
/// inner container, `close` puts it in its parent once per level.
fn nested(depth: usize, open: &[u8], item: &[u8], innermost: &[u8], close: &[u8]) -> Vec<u8> {
    let mut p = b"\x80\x02".to_vec();
    for _ in 0..depth {
        p.extend_from_slice(open);
        p.extend_from_slice(item);
    }
    p.extend_from_slice(innermost);
    for _ in 0..depth {
        p.extend_from_slice(close);
    }
    p.push(b'.');
    p
}

/// The hostile files that overflowed the stack: a dict that contains itself (`EMPTY_DICT,
/// BINPUT 0, 'me', BINGET 0, SETITEM`), 10^5 nested empty dicts, and 10^6-deep lists, tuples and
/// dicts. Each is a typed error in the test thread's small stack, and nothing aborts.
#[test]
fn self_containing_and_very_deep_files_are_typed_errors() {
    let opts = LoadOptions::new();
    let too_deep = |e: &TorchIoError| matches!(e, TorchIoError::TooDeep { limit: 256, .. });
    let me = b"X\x02\x00\x00\x00me";
    let cycle = [b"\x80\x02}q\x00".as_slice(), me, b"h\x00s."].concat();
    assert_err(torch_io::load_bytes(&pickle_file(&cycle), &opts), too_deep, "a dict that contains itself");
    let k = b"X\x01\x00\x00\x00k";
    let cases = [
        (nested(100_000, b"}", k, b"}", b"s"), "10^5 nested empty dicts"),
        (nested(1_000_000, b"}", k, b"}", b"s"), "a 10^6-deep dict"),
        (nested(1_000_000, b"]", b"", b"]", b"a"), "a 10^6-deep list"),
        (nested(1_000_000, b"(", b"", b")", b"t"), "a 10^6-deep tuple"),
    ];
    for (pickle, what) in &cases {
        assert_err(torch_io::load_bytes(&pickle_file(pickle), &opts), too_deep, what);
    }
    // Just under the limit reads, and the tree can be compared, printed, cloned, written and
    // dropped without recursion limits of its own.
    let ok = nested(255, b"}", k, b"}", b"s");
    let v = torch_io::load_bytes(&pickle_file(&ok), &opts).expect("255 levels read");
    let copy = v.shallow_clone();
    // Each level prints its key once.
    assert_eq!(format!("{v:?}").matches("\"k\"").count(), 255);
    assert_eq!(format!("{copy:?}"), format!("{v:?}"));
    let bytes = torch_io::save_bytes(&copy).expect("255 levels write");
    let back = torch_io::load_bytes(&bytes, &opts).unwrap();
    assert_eq!(format!("{back:?}"), format!("{v:?}"));
    // A tree far deeper than the limit, built in Rust, drops without recursion.
    let mut deep = Value::None;
    for _ in 0..1_000_000 {
        deep = Value::List(vec![deep]);
    }
    drop(deep);
}

/// Tightened limits refuse, with the limit named, what the defaults read: the tree's depth,
/// the storages' total and the pickle's size, through `torch_io` and `load_torch_checkpoint`.
#[test]
fn tightened_limits_refuse_what_the_defaults_read() {
    // {'a': {'b': {'c': tensor of 1000 f32}}}: depth 3 below the root, 4000 storage bytes.
    let t = Tensor::arange(1000, (Kind::Float, Device::Cpu));
    let inner = Dict::new().with("c", Value::Tensor(t.shallow_clone()));
    let mid = Dict::new().with("b", Value::Dict(inner));
    let root = Value::Dict(Dict::new().with("a", Value::Dict(mid)));
    let bytes = torch_io::save_bytes(&root).unwrap();
    let load = |limits: Limits| torch_io::load_bytes(&bytes, &LoadOptions::new().limits(limits));
    let read = load(Limits::default()).unwrap();
    assert!(read.get("a").unwrap().get("b").unwrap().get("c").unwrap().as_tensor().unwrap().equal(&t));
    // Depth: the tensor sits 3 levels below the root.
    load(Limits { depth: 3, ..Limits::default() }).unwrap();
    assert!(matches!(load(Limits { depth: 2, ..Limits::default() }), Err(TorchIoError::TooDeep { limit: 2, .. })));
    // A depth above the largest is the largest.
    load(Limits { depth: usize::MAX, ..Limits::default() }).unwrap();
    // Storages: exactly 4000 bytes.
    load(Limits { storage_bytes: 4000, ..Limits::default() }).unwrap();
    assert!(matches!(
        load(Limits { storage_bytes: 3999, ..Limits::default() }),
        Err(TorchIoError::TooLarge { limit: 3999, .. })
    ));
    // The pickle: refused by its header's size before it is read.
    assert!(matches!(
        load(Limits { pickle_bytes: 16, ..Limits::default() }),
        Err(TorchIoError::TooLarge { limit: 16, ref what }) if what.contains("data.pkl")
    ));
    // The same bound through load_torch_checkpoint's options.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("deep.pt");
    torch_io::save(&path, &root).unwrap();
    let vs = tch::nn::VarStore::new(Device::Cpu);
    let options =
        tch_amp::torch_checkpoint::TorchLoadOptions::new().limits(Limits { storage_bytes: 100, ..Limits::default() });
    let err = tch_amp::load_torch_checkpoint(&path, &vs, &mut [], &mut (), &options).unwrap_err();
    assert!(matches!(err, tch_amp::AmpError::File(TorchIoError::TooLarge { limit: 100, .. })), "{err}");
}
