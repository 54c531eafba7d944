//! The two models of scripts/reference/float8_reference.py, built through
//! `Float8Training::linear`, and the fixture's cases.
use tch::nn::{self, Module};
use tch::{Kind, Tensor};
use tch_amp::float8::{
    AmaxComputeAlgo, DelayedScaling, Float8Linear, Float8LinearConfig, Float8Training, Fp8Format, LayerFilter,
};

use crate::common::reference::Fixture;

pub const HEADS: i64 = 2;

/// The fixture, made once per test process on this machine by the venv's python with torchao.
pub fn fixture() -> Fixture {
    Fixture::generated("float8_reference.py")
}

/// "mlp" (fc1, fc2, fc3) or "block" (ln1, q, k, v, o, ln2, fc1, fc2, head).
#[derive(Debug)]
pub enum Model {
    Mlp { fc1: Float8Linear, fc2: Float8Linear, fc3: Float8Linear },
    Block { ln1: nn::LayerNorm, ln2: nn::LayerNorm, lin: Vec<Float8Linear> },
}

impl Model {
    pub fn new(name: &str, p: &nn::Path, fp8: &Float8Training) -> Model {
        let lin = |n: &str, i: i64, o: i64| fp8.linear(p / n, i, o, Default::default()).unwrap();
        match name {
            "mlp" => Model::Mlp { fc1: lin("fc1", 32, 64), fc2: lin("fc2", 64, 48), fc3: lin("fc3", 48, 10) },
            "block" => Model::Block {
                ln1: nn::layer_norm(p / "ln1", vec![32], Default::default()),
                ln2: nn::layer_norm(p / "ln2", vec![32], Default::default()),
                lin: vec![
                    lin("q", 32, 32),
                    lin("k", 32, 32),
                    lin("v", 32, 32),
                    lin("o", 32, 32),
                    lin("fc1", 32, 64),
                    lin("fc2", 64, 32),
                    lin("head", 32, 10),
                ],
            },
            other => panic!("unknown model {other}"),
        }
    }

    /// The converted layers' names, and the skipped ones.
    pub fn layers(&self) -> (Vec<&'static str>, Vec<&'static str>) {
        match self {
            Model::Mlp { .. } => (vec!["fc1", "fc2"], vec!["fc3"]),
            Model::Block { .. } => (vec!["q", "k", "v", "o", "fc1", "fc2"], vec!["head"]),
        }
    }
}

impl Module for Model {
    fn forward(&self, x: &Tensor) -> Tensor {
        match self {
            Model::Mlp { fc1, fc2, fc3 } => x.apply(fc1).relu().apply(fc2).relu().apply(fc3),
            Model::Block { ln1, ln2, lin } => {
                let (b, t, d) = x.size3().unwrap();
                let [q, k, v, o, fc1, fc2, head] = lin.as_slice() else { unreachable!() };
                let h = x.apply(ln1);
                let heads = |y: Tensor| y.view([b, t, HEADS, d / HEADS]).transpose(1, 2);
                let (q, k, v) = (heads(h.apply(q)), heads(h.apply(k)), heads(h.apply(v)));
                let att = (q.matmul(&k.transpose(-2, -1)) / ((d / HEADS) as f64).sqrt()).softmax(-1, None::<Kind>);
                let a = att.matmul(&v).transpose(1, 2).reshape([b, t, d]);
                let x = x + a.apply(o);
                let x = &x + x.apply(ln2).apply(fc1).gelu("none").apply(fc2);
                x.apply(head)
            }
        }
    }
}

/// The config of a fixture case (torchao recipe or TE's delayed scaling).
pub fn config(case: &serde_json::Value) -> Float8LinearConfig {
    if case["kind"] == "torchao" {
        return Float8LinearConfig::from_recipe_name(case["recipe"].as_str().unwrap()).unwrap();
    }
    let recipe = DelayedScaling {
        margin: case["margin"].as_i64().unwrap() as i32,
        fp8_format: if case["fp8_format"] == "HYBRID" { Fp8Format::Hybrid } else { Fp8Format::E4m3 },
        amax_history_len: case["amax_history_len"].as_u64().unwrap() as usize,
        amax_compute_algo: if case["amax_compute_algo"] == "max" {
            AmaxComputeAlgo::Max
        } else {
            AmaxComputeAlgo::MostRecent
        },
    };
    Float8LinearConfig::default().delayed_scaling(recipe)
}

/// Float8 training of every linear layer with the case's config.
pub fn training(case: &serde_json::Value) -> Float8Training {
    Float8Training::new(config(case), LayerFilter::all()).unwrap()
}
