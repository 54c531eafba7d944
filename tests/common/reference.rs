//! Shared by the bit-for-bit reference tests (optim_bitwise.rs, apex_optimizers.rs,
//! param_groups.rs, fp16_utils.rs, apex_reference.rs): the reference scripts' safetensors
//! files, made on the machine that runs the tests, the optimizer fixtures' case layout, and
//! exact tensor comparison.
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use safetensors::{Dtype, SafeTensors};
use tch::{Kind, Tensor};

/// Every tensor of a safetensors buffer, by name, plus the header's metadata.
pub struct Fixture {
    pub tensors: HashMap<String, Tensor>,
    pub metadata: HashMap<String, String>,
}

impl Fixture {
    pub fn parse(bytes: &[u8]) -> Fixture {
        let st = SafeTensors::deserialize(bytes).expect("a safetensors buffer");
        let (_, meta) = SafeTensors::read_metadata(bytes).expect("safetensors metadata");
        let metadata = meta.metadata().clone().unwrap_or_default();
        let mut tensors = HashMap::new();
        for (name, view) in st.tensors() {
            let kind = match view.dtype() {
                Dtype::F32 => Kind::Float,
                Dtype::F16 => Kind::Half,
                Dtype::BF16 => Kind::BFloat16,
                Dtype::F64 => Kind::Double,
                Dtype::I64 => Kind::Int64,
                Dtype::I32 => Kind::Int,
                Dtype::U8 => Kind::Uint8,
                Dtype::BOOL => Kind::Bool,
                other => panic!("{name}: unexpected dtype {other:?}"),
            };
            let shape: Vec<i64> = view.shape().iter().map(|&d| d as i64).collect();
            tensors.insert(name, Tensor::from_data_size(view.data(), &shape, kind));
        }
        Fixture { tensors, metadata }
    }

    /// What `scripts/reference/<script> <file>` writes, run once per test process under the
    /// venv's python (torch 2.13.0) on this machine. Made here rather than committed: libtorch's
    /// element-wise CPU kernels are built once per vector ISA (AVX2, AVX512, ...) and those
    /// builds differ in the last bit of some results (where the compiler fused a multiply and
    /// an add), so values made on one CPU do not hold bit for bit on another. Expected values
    /// then come from PyTorch on the same CPU as the Rust side.
    pub fn generated(script: &str) -> Fixture {
        static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
        static MADE: Mutex<Vec<String>> = Mutex::new(Vec::new());
        let dir = DIR.get_or_init(|| tempfile::tempdir().expect("a temporary directory"));
        let path = dir.path().join(format!("{script}.safetensors"));
        {
            let mut made = MADE.lock().unwrap_or_else(|e| e.into_inner());
            if !made.iter().any(|s| s == script) {
                let out = path.to_str().expect("a UTF-8 temporary path");
                super::python::run_reference_script(script, &[out], Duration::from_secs(300));
                made.push(script.to_string());
            }
        }
        Fixture::read(&path)
    }

    pub fn read(path: &std::path::Path) -> Fixture {
        let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        Fixture::parse(&bytes)
    }

    pub fn get(&self, name: &str) -> &Tensor {
        self.tensors.get(name).unwrap_or_else(|| panic!("fixture has no tensor {name}"))
    }

    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn meta_json(&self, key: &str) -> serde_json::Value {
        let s = self.metadata.get(key).unwrap_or_else(|| panic!("fixture metadata has no {key}"));
        serde_json::from_str(s).unwrap_or_else(|e| panic!("fixture metadata {key}: {e}"))
    }
}

/// Same shape, same dtype and the same bits everywhere (NaN matches NaN, +0 does not match -0).
pub fn bits_equal(a: &Tensor, b: &Tensor) -> bool {
    if a.size() != b.size() || a.kind() != b.kind() {
        return false;
    }
    let int_kind = match a.kind() {
        Kind::Half | Kind::BFloat16 => Kind::Int16,
        Kind::Float => Kind::Int,
        Kind::Double => Kind::Int64,
        _ => return a.equal(b),
    };
    let both_nan = a.isnan().logical_and(&b.isnan());
    let same_bits = a.view_dtype(int_kind).eq_tensor(&b.view_dtype(int_kind));
    bool::try_from(same_bits.logical_or(&both_nan).all()).unwrap()
}

/// A short description of how `got` differs from `want` (count of differing elements, max |diff|).
pub fn describe_diff(got: &Tensor, want: &Tensor) -> String {
    if got.size() != want.size() || got.kind() != want.kind() {
        return format!("shape/dtype {:?} {:?} vs {:?} {:?}", got.size(), got.kind(), want.size(), want.kind());
    }
    let g = got.to_kind(Kind::Double);
    let w = want.to_kind(Kind::Double);
    let differ = i64::try_from(g.ne_tensor(&w).sum(Kind::Int64)).unwrap();
    let max = f64::try_from((&g - &w).abs().nan_to_num(0.0, None, None).max()).unwrap();
    let rel = f64::try_from(((&g - &w).abs() / w.abs().clamp_min(1e-30)).nan_to_num(0.0, None, None).max()).unwrap();
    format!("{differ}/{} elements differ, max |diff| {max:e}, max rel {rel:e}", got.numel())
}

/// A fixture case's parameter names (sorted: tch-amp's optimizer order) and shapes, from its
/// `"shapes"` entry.
pub fn case_shapes(case: &serde_json::Value) -> Vec<(String, Vec<i64>)> {
    let mut v: Vec<(String, Vec<i64>)> = case["shapes"]
        .as_object()
        .expect("a case with shapes")
        .iter()
        .map(|(n, s)| (n.clone(), s.as_array().unwrap().iter().map(|d| d.as_i64().unwrap()).collect()))
        .collect();
    v.sort();
    v
}

/// Splits a flat [N] tensor (or one row of [steps, N]) into `shapes`, in order.
pub fn split_flat(flat: &Tensor, shapes: &[(String, Vec<i64>)]) -> Vec<Tensor> {
    let mut at = 0;
    shapes
        .iter()
        .map(|(_, s)| {
            let n: i64 = s.iter().product();
            let t = flat.narrow(0, at, n).reshape(s.as_slice());
            at += n;
            t
        })
        .collect()
}

/// torch.optim option names and values as tch-amp's hyper-parameters: `betas` becomes
/// `beta1` and `beta2`, booleans 0/1; `lr` kept.
pub fn torch_hyper(map: &serde_json::Value) -> Vec<(String, f64)> {
    let mut out = Vec::new();
    for (k, v) in map.as_object().expect("an options dict") {
        match (k.as_str(), v) {
            ("betas", serde_json::Value::Array(b)) => {
                out.push(("beta1".to_string(), b[0].as_f64().unwrap()));
                out.push(("beta2".to_string(), b[1].as_f64().unwrap()));
            }
            (_, serde_json::Value::Bool(on)) => out.push((k.clone(), if *on { 1.0 } else { 0.0 })),
            (_, v) => out.push((k.clone(), v.as_f64().unwrap_or_else(|| panic!("{k}: {v}")))),
        }
    }
    out
}
