//! One layer's statistics against PyTorch: scripts/reference/doctor_stats.py computes them with
//! torch hooks on the same weights and batch (written here with tch_amp::torch_io), fp32 and O1
//! fp16 under tch-amp's emulation contract, one thread on both sides.
use std::time::Duration;

use serde_json::Value as Json;
use tch::nn::VarStore;
use tch::{Device, Kind, Reduction};
use tch_amp::doctor::{Doctor, TensorStats};
use tch_amp::torch_io::{self, Dict, Value};
use tch_amp::{AmpConfig, CpuKernels, OptLevel};

use crate::common::python::run_reference_script;
use crate::models::{batch, ThreeLayers};

fn check(ours: &TensorStats, theirs: &Json, what: &str) {
    let num = |v: &Json| v.as_f64();
    assert_eq!(ours.dtype, theirs["dtype"].as_str().unwrap(), "{what} dtype");
    let exact = [
        ("numel", ours.numel as f64),
        ("non_finite", ours.non_finite as f64),
        ("zeros", ours.zeros as f64),
        ("subnormal", ours.subnormal as f64),
        ("max_abs", ours.max_abs),
    ];
    for (k, v) in exact {
        assert_eq!(Some(v), num(&theirs[k]), "{what} {k}");
    }
    assert_eq!(ours.min_nonzero_abs, num(&theirs["min_nonzero_abs"]), "{what} min_nonzero_abs");
    let c = ours.fp32.as_ref().unwrap();
    let t = &theirs["fp32"];
    for (k, v) in [
        ("nonzero", c.nonzero),
        ("non_finite", c.non_finite),
        ("overflow", c.overflow),
        ("underflow", c.underflow),
        ("subnormal", c.subnormal),
        ("flushed", c.flushed),
    ] {
        assert_eq!(Some(v), t[k].as_u64(), "{what} fp32 {k}");
    }
    // fp32 values times the scale (a power of two: exact).
    assert_eq!(Some(c.max_abs), num(&t["max_abs"]), "{what} fp32 max_abs");
    assert_eq!(c.min_nonzero_abs, num(&t["min_nonzero_abs"]), "{what} fp32 min_nonzero_abs");
    // Sums of squares in fp64, in another order.
    let (a, b) = (c.relative_error.unwrap(), num(&t["relative_error"]).unwrap());
    assert!((a - b).abs() <= 1e-9 * b, "{what} relative error {a} vs {b}");
}

#[test]
fn one_layer_matches_torch_hooks() {
    tch::set_num_threads(1);
    let vs = VarStore::new(Device::Cpu);
    // At loss scale 2^-19 the gradients of big's output are fp16 subnormals, some below half
    // the smallest (zero).
    let net = ThreeLayers::new(&vs, 30.0);
    let (x, y) = batch(4.0);
    let scale = 2f64.powi(-19);
    let dir = tempfile::tempdir().unwrap();
    let (input, output) = (dir.path().join("in.pt"), dir.path().join("out.json"));
    let mut dict = Dict::new();
    for (name, t) in vs.variables() {
        dict.insert(name, Value::Tensor(t.detach().copy()));
    }
    dict.insert("x", Value::Tensor(x.copy()));
    dict.insert("y", Value::Tensor(y.copy()));
    torch_io::save(&input, &Value::Dict(dict)).unwrap();
    let scale_arg = format!("{scale:e}");
    let args = [input.to_str().unwrap(), output.to_str().unwrap(), "big", scale_arg.as_str()];
    run_reference_script("doctor_stats.py", &args, Duration::from_secs(120));
    let theirs: Json = serde_json::from_str(&std::fs::read_to_string(&output).unwrap()).unwrap();

    let doctor = Doctor::apex(AmpConfig::new(OptLevel::O1).cpu_kernels(CpuKernels::Emulate)).loss_scale(scale);
    let r = doctor.run(&vs, |p| p.forward(&net, &x).to_kind(Kind::Float).mse_loss(&y, Reduction::Mean)).unwrap();
    let op = r.ops.iter().find(|o| o.op == "linear" && o.module == "big").unwrap();
    let (f, b) = (op.forward.as_ref().unwrap(), op.backward.as_ref().unwrap());
    check(f, &theirs["forward"], "forward");
    check(b, &theirs["backward"], "backward");
    // The case is not trivial.
    let c = b.fp32.as_ref().unwrap();
    assert!(c.underflow > 0 && c.subnormal > 0 && b.subnormal > 0, "{b:?}");
}
