//! The cast lists as data: the Apex and libtorch policies resolve against the dispatcher, each
//! Apex mapping is the aten op the Autocast key really sees for the tch call, and installing /
//! removing the engine leaves plain libtorch autocast exactly as it was.

use crate::common::*;
use tch::nn::{self, Module};
use tch::{Device, Kind, Reduction, Tensor};
use tch_amp::cast::CastSettings;
use tch_amp::cast::{install_policy, Cast, CastLists};
use tch_amp::diagnostics::{aten_overloads, emulated_ops, kernels_registered, libtorch_autocast_ops};
use tch_amp::error::ConfigError;
use tch_amp::{AmpError, CastPolicy};

#[test]
fn shipped_policies_resolve() {
    CastPolicy::apex().validate().unwrap();
    CastPolicy::torch_native().validate().unwrap();
    CastPolicy::emulation_only().validate().unwrap();
    let emulated = emulated_ops().unwrap();
    for op in ["mm", "addmm", "bmm", "linear", "matmul", "conv2d", "conv2d.padding", "conv_transpose2d.input"] {
        assert!(emulated.contains(&op.to_string()), "{op} is emulated");
    }
    assert!(!emulated.contains(&"mm.dtype".to_string()), "explicit output dtype: never emulated");

    let cpu = CastPolicy::apex().resolve(Device::Cpu).unwrap();
    let cuda = CastPolicy::apex().resolve(Device::Cuda(0)).unwrap();
    assert_eq!(cpu, cuda, "Apex's lists are the same for every device type");
    let expect = [
        ("linear", Cast::LowPrecision),
        ("matmul", Cast::LowPrecision),
        ("conv_transpose2d.input", Cast::LowPrecision),
        ("addmm_", Cast::LowPrecision),
        ("lstm.input", Cast::LowPrecision),
        ("lstm_cell", Cast::LowPrecision),
        ("softmax.int", Cast::Fp32),
        ("log_softmax.int", Cast::Fp32),
        ("cross_entropy_loss", Cast::Fp32),
        ("nll_loss_nd", Cast::Fp32),
        ("pow.Tensor_Scalar", Cast::Fp32),
        ("pow_.Scalar", Cast::Fp32),
        ("exp_", Cast::Fp32),
        ("upsample_bilinear2d.vec", Cast::Fp32),
        ("add.Tensor", Cast::Promote),
        ("add_.Tensor", Cast::Promote),
        ("rsub.Tensor", Cast::Promote),
        ("cat", Cast::Promote),
        ("binary_cross_entropy", Cast::Banned),
    ];
    for (op, cast) in expect {
        assert_eq!(cpu.get(op), Some(&cast), "{op}");
    }
    for op in ["einsum", "_softmax", "convolution", "cdist", "linalg_vecdot", "relu", "batch_norm"] {
        assert!(!cpu.contains_key(op), "{op} is in no Apex list");
    }
}

#[test]
fn torch_native_policy_is_exactly_libtorchs_registrations() {
    let native = CastPolicy::torch_native();
    for device in [Device::Cpu, Device::Cuda(0)] {
        let mut ours: Vec<String> = native.resolve(device).unwrap().into_keys().collect();
        let libtorch = libtorch_autocast_ops(device).unwrap();
        assert!(libtorch.len() > 100, "{device:?}: {}", libtorch.len());
        // _cudnn_rnn's autocast kernel is registered by libtorch_cuda.so, which a process
        // without a CUDA device may not load.
        if device != Device::Cpu && !libtorch.iter().any(|op| op == "_cudnn_rnn") {
            ours.retain(|op| op != "_cudnn_rnn");
        }
        assert_eq!(ours, libtorch, "{device:?}");
    }
    let cpu = native.resolve(Device::Cpu).unwrap();
    assert_eq!(cpu["mm"], Cast::LowPrecision);
    assert_eq!(cpu["binary_cross_entropy"], Cast::Fp32, "libtorch's CPU list runs BCE in fp32");
    assert!(!cpu.contains_key("softmax.int"), "softmax is in no CPU list");
    let cuda = native.resolve(Device::Cuda(0)).unwrap();
    assert_eq!(cuda["binary_cross_entropy"], Cast::Banned);
    assert_eq!(cuda["softmax.int"], Cast::Fp32);
}

#[test]
fn entries_resolve_like_the_dispatcher_names_them() {
    assert_eq!(aten_overloads("exp").unwrap(), vec!["exp", "exp_"]);
    assert_eq!(aten_overloads("softmax").unwrap(), vec!["softmax.int"]);
    assert_eq!(aten_overloads("mm.default").unwrap(), vec!["mm"]);
    assert_eq!(aten_overloads("pow.Scalar").unwrap(), vec!["pow.Scalar"]);
    for bad in ["no_such_op", "mm.no_such_overload", "aten::mm", "mm.out", "", "m m"] {
        assert!(matches!(aten_overloads(bad), Err(AmpError::Config(ConfigError::UnknownOp { .. }))), "{bad:?}");
    }
}

#[test]
fn policy_toml_round_trips_and_rejects_conflicts() {
    let apex = CastPolicy::apex();
    let text = apex.to_toml_string().unwrap();
    assert_eq!(CastPolicy::from_toml_str(&text).unwrap(), apex);

    // A dotted entry beats a bare one; a device section beats `all`.
    let policy = CastPolicy::from_toml_str(
        "name = \"t\"\n[all]\nfp32 = [\"pow\"]\nlow_precision = [\"pow.Scalar\"]\n[cpu]\npromote = [\"pow\"]\n",
    )
    .unwrap();
    let cpu = policy.resolve(Device::Cpu).unwrap();
    let cuda = policy.resolve(Device::Cuda(0)).unwrap();
    assert_eq!(cuda["pow.Tensor_Scalar"], Cast::Fp32);
    assert_eq!(cuda["pow.Scalar"], Cast::LowPrecision);
    assert_eq!(cpu["pow.Tensor_Scalar"], Cast::Promote);

    let conflict = CastPolicy::from_toml_str("[all]\nfp32 = [\"exp\"]\nlow_precision = [\"exp\"]\n");
    assert!(matches!(conflict, Err(AmpError::Config(ConfigError::Parse { .. }))), "{conflict:?}");
    let unknown = CastPolicy::from_toml_str("[all]\nfp32 = [\"exq\"]\n");
    assert!(matches!(unknown, Err(AmpError::Config(ConfigError::UnknownOp { .. }))), "{unknown:?}");
    let typo = CastPolicy::from_toml_str("[all]\nfp16 = [\"exp\"]\n");
    assert!(matches!(typo, Err(AmpError::Config(ConfigError::Parse { .. }))), "{typo:?}");
    let bad = install_policy(
        CastPolicy { all: CastLists { fp32: vec!["exq".into()], ..Default::default() }, ..Default::default() },
        CastSettings::default(),
    );
    assert!(matches!(bad, Err(AmpError::Config(ConfigError::UnknownOp { .. }))));
}

type Call<'a> = Box<dyn Fn() -> Tensor + 'a>;

fn h(shape: &[i64]) -> Tensor {
    randn(shape, Kind::Half)
}

/// Each Apex entry is the aten op the Autocast key sees for the tch call: a policy with only
/// that entry on the fp32 list turns the all-fp16 call's output into fp32.
#[test]
fn each_apex_mapping_is_the_op_the_autocast_key_sees() {
    let x = h(&[4, 8]);
    let y = h(&[4, 8]);
    let w = h(&[8, 8]);
    let x4 = h(&[2, 4, 6, 6]);
    let cw = h(&[4, 4, 3, 3]);
    let target = Tensor::from_slice(&[1i64, 0, 3, 7]);
    let cases: Vec<(&str, Call)> = vec![
        ("linear", Box::new(|| x.linear(&w, Some(&w.get(0))))),
        ("matmul", Box::new(|| x.matmul(&w))),
        ("mm", Box::new(|| x.mm(&w))),
        ("conv2d", Box::new(|| x4.conv2d(&cw, None::<Tensor>, [1, 1], [0, 0], [1, 1], 1))),
        ("conv_transpose2d", Box::new(|| x4.conv_transpose2d(&cw, None::<Tensor>, [1, 1], [0, 0], [0, 0], 1, [1, 1]))),
        ("prelu", Box::new(|| x.prelu(&h(&[1])))),
        ("softmax", Box::new(|| x.softmax(-1, None::<Kind>))),
        ("log_softmax", Box::new(|| x.log_softmax(-1, None::<Kind>))),
        ("gelu", Box::new(|| x.gelu("none"))),
        ("softplus", Box::new(|| x.softplus())),
        ("layer_norm", Box::new(|| x.layer_norm([8], None::<Tensor>, None::<Tensor>, 1e-5, false))),
        ("group_norm", Box::new(|| x4.group_norm(2, None::<Tensor>, None::<Tensor>, 1e-5, false))),
        ("cosine_similarity", Box::new(|| Tensor::cosine_similarity(&x, &y, 1, 1e-8))),
        ("cross_entropy_loss", Box::new(|| x.cross_entropy_loss(&target, None::<Tensor>, Reduction::Mean, -100, 0.0))),
        ("nll_loss", Box::new(|| x.nll_loss(&target))),
        ("mse_loss", Box::new(|| x.mse_loss(&y, Reduction::Mean))),
        ("l1_loss", Box::new(|| x.l1_loss(&y, Reduction::Mean))),
        ("smooth_l1_loss", Box::new(|| x.smooth_l1_loss(&y, Reduction::Mean, 1.0))),
        ("kl_div", Box::new(|| x.kl_div(&y, Reduction::Mean, false))),
        ("upsample_nearest2d", Box::new(|| x4.upsample_nearest2d([12, 12], None, None))),
        ("grid_sampler", Box::new(|| x4.grid_sampler(&h(&[2, 3, 3, 2]), 0, 0, false))),
        ("exp", Box::new(|| x.exp())),
        ("log", Box::new(|| x.abs().log())),
        ("pow", Box::new(|| x.pow_tensor_scalar(2.0))),
        ("sum", Box::new(|| x.sum(None::<Kind>))),
        ("cumsum", Box::new(|| x.cumsum(1, None::<Kind>))),
        ("norm", Box::new(|| x.norm())),
        ("prod", Box::new(|| x.prod(None::<Kind>))),
        ("std", Box::new(|| x.std(true))),
        ("var", Box::new(|| x.var(true))),
        ("add", Box::new(|| &x + &y)),
        ("sub", Box::new(|| &x - &y)),
        ("rsub", Box::new(|| x.rsub(&y))),
        ("mul", Box::new(|| &x * &y)),
        ("div", Box::new(|| &x / &y)),
        ("atan2", Box::new(|| x.atan2(&y))),
        ("cat", Box::new(|| Tensor::cat(&[&x, &y], 0))),
        ("stack", Box::new(|| Tensor::stack(&[&x, &y], 0))),
        (
            "lstm_cell",
            Box::new(|| {
                x.lstm_cell(&[&h(&[4, 8]), &h(&[4, 8])], &h(&[32, 8]), &h(&[32, 8]), None::<&Tensor>, None::<&Tensor>).0
            }),
        ),
        ("gru_cell", Box::new(|| x.gru_cell(&h(&[4, 8]), &h(&[24, 8]), &h(&[24, 8]), None::<Tensor>, None::<Tensor>))),
    ];
    for (entry, call) in &cases {
        assert_eq!(call().kind(), Kind::Half, "{entry}: fp16 without a policy");
        let policy = CastPolicy {
            name: format!("only {entry}"),
            all: CastLists { fp32: vec![entry.to_string()], ..Default::default() },
            ..Default::default()
        };
        let handle = install_policy(policy, CastSettings::default().emulate_low_precision_on_cpu(false)).unwrap();
        let _active = on_cpu(&handle);
        assert_eq!(call().kind(), Kind::Float, "{entry}: the Autocast key sees aten::{entry}");
    }
    // tch's nn::lstm is aten::lstm (Apex's RNN_NAMES).
    let mut vs = nn::VarStore::new(Device::Cpu);
    let lstm = nn::lstm(vs.root(), 8, 8, Default::default());
    vs.half();
    let seq = h(&[2, 3, 8]);
    let run = || nn::RNN::seq(&lstm, &seq).0.kind();
    assert_eq!(run(), Kind::Half);
    let policy =
        CastPolicy { all: CastLists { fp32: vec!["lstm".into()], ..Default::default() }, ..Default::default() };
    let handle = install_policy(policy, CastSettings::default()).unwrap();
    let _active = on_cpu(&handle);
    assert_eq!(run(), Kind::Float);
}

/// libtorch CPU autocast's visible behaviour: a few ops' output dtypes and an exact linear.
fn plain_cpu_autocast(x: &Tensor, linear: &nn::Linear) -> (Vec<Kind>, Vec<f32>) {
    let _autocast = tch_amp::Autocast::new(Device::Cpu)
        .dtype(Kind::BFloat16)
        .cpu_kernels(tch_amp::CpuKernels::Native)
        .enter()
        .unwrap();
    let xb = x.to_kind(Kind::BFloat16);
    let y = linear.forward(x);
    let kinds = vec![
        y.kind(),
        xb.softmax(-1, None::<Kind>).kind(),
        x.mm(&x.tr()).kind(),
        xb.mse_loss(&xb, Reduction::Mean).kind(),
        Tensor::cat(&[&xb, x], 0).kind(),
        x.to_kind(Kind::Half).softmax(-1, None::<Kind>).kind(),
    ];
    (kinds, to_vec(&y))
}

/// tch-amp's kernels are registered once per process and stay: releasing every policy leaves
/// them in place, and a thread with no policy active gets exactly libtorch's autocast results
/// (kinds and values), whatever policies exist or existed.
#[test]
fn without_an_active_policy_libtorch_autocast_is_unchanged() {
    let vs = nn::VarStore::new(Device::Cpu);
    let linear = nn::linear(vs.root(), 8, 8, Default::default());
    let x = randn(&[4, 8], Kind::Float);
    let before = plain_cpu_autocast(&x, &linear);
    assert_eq!(before.0, vec![Kind::BFloat16, Kind::BFloat16, Kind::BFloat16, Kind::Float, Kind::Float, Kind::Half]);
    let registrations = libtorch_autocast_ops(Device::Cpu).unwrap();
    {
        let handle = apex();
        assert!(kernels_registered());
        {
            let _active = on_cpu(&handle);
            assert_eq!(x.to_kind(Kind::Half).softmax(-1, None::<Kind>).kind(), Kind::Float);
        }
        // Installed but not active on this thread: libtorch's own kernels answer.
        assert_eq!(plain_cpu_autocast(&x, &linear), before);
        assert_eq!(libtorch_autocast_ops(Device::Cpu).unwrap(), registrations);
        // Clones and active guards keep the policy alive.
        let clone = handle.clone();
        drop(handle);
        let active = clone.activate(Device::Cpu).unwrap();
        drop(clone);
        assert_eq!(linear.forward(&x).kind(), Kind::Half);
        drop(active);
    }
    // Every policy released: the kernels stay registered, libtorch's behaviour is unchanged.
    assert!(kernels_registered());
    assert_eq!(plain_cpu_autocast(&x, &linear), before);
    assert_eq!(libtorch_autocast_ops(Device::Cpu).unwrap(), registrations);
    let handle = apex();
    assert_eq!(handle.run(Device::Cpu, || linear.forward(&x).kind()).unwrap(), Kind::Half);
    drop(handle);
    assert_eq!(plain_cpu_autocast(&x, &linear), before);
}
