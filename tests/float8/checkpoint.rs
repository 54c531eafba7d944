//! Delayed scaling's state in a tch-amp checkpoint: two steps, save, a fresh model, training
//! and optimizer, load, three more steps: every value equals the uninterrupted run of the
//! Python reference (scripts/reference/float8_reference.py, case delayed0-block-fp32).
use tch::nn::VarStore;
use tch::{Device, Kind, Tensor};
use tch_amp::checkpoint::{read_training_state, save_checkpoint_with, TrainingState};
use tch_amp::error::StateError;
use tch_amp::torch_io::{Dict, Value};
use tch_amp::{Amp, AmpConfig, AmpError, OptLevel};

use super::models::{fixture, training, Model};
use super::reference::{load_init, run_steps, state_tensor, Run};

fn case(name: &str) -> serde_json::Value {
    let cases = fixture().meta_json("cases");
    cases.as_array().unwrap().iter().find(|c| c["name"] == name).unwrap().clone()
}

#[test]
fn delayed_scaling_resumes_bit_exactly() {
    tch::set_num_threads(1);
    let fx = fixture();
    let case = case("delayed0-block-fp32");
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ckpt.safetensors");
    let sgd = tch::nn::Sgd { momentum: 0.9, ..Default::default() };
    {
        let vs = VarStore::new(Device::Cpu);
        let fp8 = training(&case);
        let model = Model::new("block", &vs.root(), &fp8);
        load_init(&fx, "delayed0-block-fp32", &vs);
        let mut amp = Amp::new(&AmpConfig::new(OptLevel::O0).verbosity(0)).unwrap();
        let _m = amp.cast_model(&vs, ()).unwrap();
        let mut opt = amp.optimizer(&vs, sgd, 0.05).unwrap();
        let f = run_steps(
            &fx,
            &case,
            Run { device: Device::Cpu, vs: &vs, model: &model, fp8: &fp8, io: None },
            Some((&mut amp, &mut opt)),
            0..2,
        );
        assert!(f.is_empty(), "before the checkpoint:\n{}", f.join("\n"));
        let mut state = TrainingState::default();
        state.insert_tree("float8", &fp8.state_dict()).unwrap();
        save_checkpoint_with(&path, &vs, &[&opt], &amp, &state).unwrap();
    }
    let vs = VarStore::new(Device::Cpu);
    let fp8 = training(&case);
    let model = Model::new("block", &vs.root(), &fp8);
    let mut amp = Amp::new(&AmpConfig::new(OptLevel::O0).verbosity(0)).unwrap();
    let _m = amp.cast_model(&vs, ()).unwrap();
    let mut opt = amp.optimizer(&vs, sgd, 0.05).unwrap();
    tch_amp::load_checkpoint(&path, &vs, &mut [&mut opt], &mut amp).unwrap();
    let back = read_training_state(&path).unwrap();
    fp8.load_state_dict(&back.tree("float8")).unwrap();
    let hist = state_tensor(&fp8, "q", "input", "amax_history");
    assert!(bool::try_from(hist.ne(0.0).any()).unwrap(), "the loaded history is empty");
    let f = run_steps(
        &fx,
        &case,
        Run { device: Device::Cpu, vs: &vs, model: &model, fp8: &fp8, io: None },
        Some((&mut amp, &mut opt)),
        2..5,
    );
    assert!(f.is_empty(), "after resuming:\n{}", f.join("\n"));
}

fn is_mismatch(r: tch_amp::Result<()>) -> bool {
    matches!(r, Err(AmpError::State(StateError::StateMismatch { .. })))
}

/// A damaged or foreign state is refused whole and the layers keep their state.
#[test]
fn bad_delayed_state_is_refused_and_changes_nothing() {
    let case = case("delayed0-mlp-fp32");
    let vs = VarStore::new(Device::Cpu);
    let fp8 = training(&case);
    let model = Model::new("mlp", &vs.root(), &fp8);
    let x = Tensor::ones([4, 32], (Kind::Float, Device::Cpu));
    tch::nn::Module::forward(&model, &x).sum(Kind::Float).backward();
    let before = state_tensor(&fp8, "fc1", "input", "scale");
    let good = fp8.state_dict();
    let edit = |layer: &str, role: &str, key: &str, value: Tensor| -> Value {
        let mut d = Dict::new();
        for l in ["fc1", "fc2"] {
            let mut roles = Dict::new();
            for r in ["input", "weight", "grad_output"] {
                let mut entry = Dict::new();
                for k in ["amax_history", "scale"] {
                    let t = if (l, r, k) == (layer, role, key) {
                        value.shallow_clone()
                    } else {
                        state_tensor(&fp8, l, r, k)
                    };
                    entry.insert(k, Value::Tensor(t));
                }
                roles.insert(r, Value::Dict(entry));
            }
            d.insert(l, Value::Dict(roles));
        }
        Value::Dict(d)
    };
    let f = |v: f32| Tensor::from(v);
    assert!(is_mismatch(fp8.load_state_dict(&edit(
        "fc2",
        "weight",
        "amax_history",
        Tensor::zeros([3], (Kind::Float, Device::Cpu))
    ))));
    assert!(is_mismatch(fp8.load_state_dict(&edit(
        "fc2",
        "weight",
        "amax_history",
        Tensor::from_slice(&[0f32, f32::NAN, 0.0, 1.0])
    ))));
    assert!(is_mismatch(fp8.load_state_dict(&edit("fc2", "grad_output", "scale", f(0.0)))));
    assert!(is_mismatch(fp8.load_state_dict(&edit("fc2", "grad_output", "scale", f(f32::INFINITY)))));
    assert!(is_mismatch(fp8.load_state_dict(&edit("fc2", "input", "scale", Tensor::from(2.0f64)))));
    let mut extra = edit("", "", "", f(1.0));
    extra.insert("fc9", Value::Dict(Dict::new())).unwrap();
    assert!(is_mismatch(fp8.load_state_dict(&extra)));
    let mut missing = edit("", "", "", f(1.0));
    missing.remove("fc2").unwrap().unwrap();
    assert!(is_mismatch(fp8.load_state_dict(&missing)));
    assert!(is_mismatch(fp8.load_state_dict(&Value::Int(3))));
    assert!(state_tensor(&fp8, "fc1", "input", "scale").equal(&before), "a refused load changed the state");
    fp8.load_state_dict(&good).unwrap();
}
