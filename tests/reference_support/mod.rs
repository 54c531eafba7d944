//! Shared by the bit-for-bit reference tests (optim_bitwise.rs, apex_reference.rs): reading
//! the safetensors files the reference scripts write, and exact tensor comparison.
#![allow(dead_code)]
use std::collections::HashMap;

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

    pub fn read(path: &std::path::Path) -> Fixture {
        let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()));
        Fixture::parse(&bytes)
    }

    pub fn get(&self, name: &str) -> &Tensor {
        self.tensors
            .get(name)
            .unwrap_or_else(|| panic!("fixture has no tensor {name}"))
    }

    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn meta_json(&self, key: &str) -> serde_json::Value {
        let s = self
            .metadata
            .get(key)
            .unwrap_or_else(|| panic!("fixture metadata has no {key}"));
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
        return format!(
            "shape/dtype {:?} {:?} vs {:?} {:?}",
            got.size(),
            got.kind(),
            want.size(),
            want.kind()
        );
    }
    let g = got.to_kind(Kind::Double);
    let w = want.to_kind(Kind::Double);
    let differ = i64::try_from(g.ne_tensor(&w).sum(Kind::Int64)).unwrap();
    let max = f64::try_from((&g - &w).abs().nan_to_num(0.0, None, None).max()).unwrap();
    let rel = f64::try_from(
        ((&g - &w).abs() / w.abs().clamp_min(1e-30))
            .nan_to_num(0.0, None, None)
            .max(),
    )
    .unwrap();
    format!(
        "{differ}/{} elements differ, max |diff| {max:e}, max rel {rel:e}",
        got.numel()
    )
}
