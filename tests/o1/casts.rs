//! O1 casts under the Apex policy on CPU: the expectations of Apex's tests/L0/run_amp
//! (test_basic_casts.py, test_promotion.py) with tch, plus disable_casts, user casts, bf16 and
//! threads. Apex's sizes: h = 64, b = 16, c = 16, k = 3.

use std::sync::{Arc, Barrier};
use tch_amp::error::{ConfigError, OpRefused};

use crate::common::*;
use tch::nn::{self, Module, ModuleT, OptimizerConfig};
use tch::{Device, Kind, Reduction, Tensor};
use tch_amp::cast::CastSettings;
use tch_amp::cast::{classify_torch_error, install_policy};
use tch_amp::diagnostics::policy_active;
use tch_amp::{disable_casts, without_casts, AmpError, CastPolicy};

const H: i64 = 64;
const B: i64 = 16;
const C: i64 = 16;
const K: i64 = 3;

/// Apex's run_layer_test: for fp32 and fp16 inputs, the output dtype is `expected(input)` and
/// the input's grad has the input's dtype.
fn run_layer_test(f: &dyn Fn(&Tensor) -> Tensor, expected: fn(Kind) -> Kind, shape: &[i64], backward: bool) {
    let handle = apex();
    for kind in [Kind::Float, Kind::Half] {
        let x = leaf(shape, kind);
        let y = {
            let _active = on_cpu(&handle);
            f(&x)
        };
        assert_eq!(y.kind(), expected(kind), "input {kind:?}");
        if backward {
            y.to_kind(Kind::Float).sum(None::<Kind>).backward();
            assert_eq!(x.grad().kind(), kind, "grad of a {kind:?} input");
        }
    }
}

fn always_half(_: Kind) -> Kind {
    Kind::Half
}
fn always_float(_: Kind) -> Kind {
    Kind::Float
}
fn match_input(k: Kind) -> Kind {
    k
}

#[test]
fn linear_is_half() {
    let vs = nn::VarStore::new(Device::Cpu);
    let m = nn::linear(vs.root(), H, H, Default::default());
    run_layer_test(&|x| m.forward(x), always_half, &[B, H], true);
    // The functional form is the same aten op.
    run_layer_test(&|x| x.linear(&m.ws, m.bs.as_ref()), always_half, &[B, H], true);
}

#[test]
fn conv2d_is_half() {
    let vs = nn::VarStore::new(Device::Cpu);
    let m = nn::conv2d(vs.root(), C, C, K, Default::default());
    run_layer_test(&|x| m.forward(x), always_half, &[B, C, H, H], true);
}

#[test]
fn softmax_group_norm_mse_loss_are_float() {
    run_layer_test(&|x| x.softmax(1, None::<Kind>), always_float, &[B, H], true);
    let vs = nn::VarStore::new(Device::Cpu);
    let gn = nn::group_norm(vs.root(), 4, C, Default::default());
    run_layer_test(&|x| gn.forward(x), always_float, &[B, C, H, H], true);
    let target = randn(&[B, H], Kind::Float);
    run_layer_test(&|x| x.mse_loss(&target, Reduction::Mean), always_float, &[B, H], true);
}

#[test]
fn relu_and_batch_norm_match_input() {
    run_layer_test(&|x| x.relu(), match_input, &[B, H], true);
    let vs = nn::VarStore::new(Device::Cpu);
    let bn = nn::batch_norm2d(vs.root(), C, Default::default());
    run_layer_test(&|x| bn.forward_t(x, true), match_input, &[B, C, H, H], true);
    // Inference BN, forward only (as Apex).
    run_layer_test(&|x| bn.forward_t(x, false), match_input, &[B, C, H, H], false);
}

#[test]
fn matmul_both_ways_is_half_pow_and_sum_are_float() {
    let other = randn(&[H, H], Kind::Float);
    run_layer_test(&|x| x.matmul(&other), always_half, &[H, H], true);
    run_layer_test(&|x| other.matmul(x), always_half, &[H, H], true);
    run_layer_test(&|x| x.pow_tensor_scalar(2.0), always_float, &[B, H], true);
    run_layer_test(&|x| x.sum(None::<Kind>), always_float, &[B, H], true);
}

#[test]
fn fp64_is_never_cast() {
    let handle = apex();
    let _active = on_cpu(&handle);
    let x = randn(&[4, 4], Kind::Double);
    assert_eq!(x.mm(&x).kind(), Kind::Double); // fp16 list
    assert_eq!(x.exp().kind(), Kind::Double); // fp32 list
                                              // Promote: fp64 wins over fp16.
    assert_eq!((&x * &x.to_kind(Kind::Half)).kind(), Kind::Double);
    // Integer tensors are never cast.
    let i = Tensor::arange(4, (Kind::Int64, Device::Cpu));
    assert_eq!(i.sum(None::<Kind>).kind(), Kind::Int64);
}

#[test]
fn bce_on_half_is_a_typed_error_and_float_with_allow_banned() {
    let target = Tensor::rand([B, H], (Kind::Float, Device::Cpu));
    let x = Tensor::rand([B, H], (Kind::Float, Device::Cpu)).to_kind(Kind::Half);
    {
        let handle = apex();
        let _active = on_cpu(&handle);
        let err = x.f_binary_cross_entropy(&target, None::<Tensor>, Reduction::Mean).unwrap_err();
        let err = classify_torch_error(err);
        assert!(
            matches!(&err, AmpError::OpRefused(OpRefused::BannedOp { op }) if op == "binary_cross_entropy"),
            "{err}"
        );
        assert!(err.to_string().contains("binary_cross_entropy_with_logits"), "{err}");
        // Apex refuses only when an input is fp16: fp32 inputs run.
        let ok = x.to_kind(Kind::Float).binary_cross_entropy(&target, None::<Tensor>, Reduction::Mean);
        assert_eq!(ok.kind(), Kind::Float);
    }
    let handle = apex_with(CastSettings::default().allow_banned(true));
    let _active = on_cpu(&handle);
    let y = x.binary_cross_entropy(&target, None::<Tensor>, Reduction::Mean);
    assert_eq!(y.kind(), Kind::Float);
}

/// Apex's run_binary_promote_test: all four dtype pairs.
fn run_binary_promote_test(f: &dyn Fn(&Tensor, &Tensor) -> Tensor, x_inplace: bool) {
    let handle = apex();
    for (xkind, ykind) in
        [(Kind::Half, Kind::Half), (Kind::Half, Kind::Float), (Kind::Float, Kind::Half), (Kind::Float, Kind::Float)]
    {
        let x_leaf = leaf(&[B], xkind);
        let x = if x_inplace { x_leaf.copy() } else { x_leaf.shallow_clone() };
        let y = randn(&[B], ykind);
        let out = {
            let _active = on_cpu(&handle);
            f(&x, &y)
        };
        let expected = if x_inplace {
            xkind
        } else if xkind == Kind::Float || ykind == Kind::Float {
            Kind::Float
        } else {
            Kind::Half
        };
        assert_eq!(out.kind(), expected, "{xkind:?} with {ykind:?}");
        out.to_kind(Kind::Float).sum(None::<Kind>).backward();
        assert_eq!(x_leaf.grad().kind(), xkind);
    }
}

#[test]
fn atan2_and_mul_match_widest() {
    run_binary_promote_test(&|x, y| x.atan2(y), false);
    run_binary_promote_test(&|x, y| x * y, false);
    run_binary_promote_test(&|x, y| x.g_mul(y), false);
}

#[test]
fn inplace_add_matches_self() {
    run_binary_promote_test(
        &|x, y| {
            let mut x = x.shallow_clone();
            x.f_add_(y).unwrap()
        },
        true,
    );
}

#[test]
fn cat_and_stack_match_widest() {
    let handle = apex();
    let _active = on_cpu(&handle);
    let ys: Vec<Tensor> = (0..5).map(|_| randn(&[B], Kind::Half)).collect();
    let with = |t: Tensor| ys.iter().map(|y| y.shallow_clone()).chain(std::iter::once(t)).collect::<Vec<_>>();
    assert_eq!(Tensor::cat(&with(randn(&[B], Kind::Float)), 0).kind(), Kind::Float);
    assert_eq!(Tensor::cat(&with(randn(&[B], Kind::Half)), 0).kind(), Kind::Half);
    assert_eq!(Tensor::stack(&with(randn(&[B], Kind::Float)), 0).kind(), Kind::Float);
    assert_eq!(Tensor::stack(&with(randn(&[B], Kind::Half)), 0).kind(), Kind::Half);
}

#[test]
fn inplace_exp_is_an_error_for_half() {
    let handle = apex();
    let _active = on_cpu(&handle);
    let mut xs = randn(&[B], Kind::Float);
    let _ = xs.f_exp_().unwrap();
    assert_eq!(xs.kind(), Kind::Float);
    let mut xs = randn(&[B], Kind::Half);
    let before = to_vec(&xs);
    let err = classify_torch_error(xs.f_exp_().unwrap_err());
    assert!(
        matches!(&err, AmpError::OpRefused(OpRefused::InPlaceFp32OnHalf { op, dtype: Kind::Half }) if op == "exp_"),
        "{err}"
    );
    assert_eq!(to_vec(&xs), before, "the refused op must not have written");
    // Other fp32-list ops too (log_); in-place ops of other lists are fine.
    let err = classify_torch_error(xs.f_log_().unwrap_err());
    assert!(matches!(&err, AmpError::OpRefused(OpRefused::InPlaceFp32OnHalf { op, .. }) if op == "log_"), "{err}");
    let _ = xs.f_mul_(&randn(&[B], Kind::Float)).unwrap();
    assert_eq!(xs.kind(), Kind::Half);
}

#[test]
fn disable_casts_turns_the_policy_off_and_restores_it() {
    let vs = nn::VarStore::new(Device::Cpu);
    let m = nn::linear(vs.root(), 8, 8, Default::default());
    let x = randn(&[2, 8], Kind::Float);
    let handle = apex();
    let _active = on_cpu(&handle);
    assert_eq!(m.forward(&x).kind(), Kind::Half);
    {
        let _off = disable_casts().unwrap();
        assert!(!policy_active().unwrap());
        assert_eq!(m.forward(&x).kind(), Kind::Float);
        assert_eq!(x.to_kind(Kind::Half).softmax(-1, None::<Kind>).kind(), Kind::Half);
    }
    assert!(policy_active().unwrap());
    assert_eq!(m.forward(&x).kind(), Kind::Half);
    assert_eq!(without_casts(|| m.forward(&x).kind()).unwrap(), Kind::Float);
    // Restored on panic (Apex's disable_casts had no finally).
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        without_casts(|| {
            assert_eq!(m.forward(&x).kind(), Kind::Float);
            panic!("boom inside disable_casts");
        })
    }));
    assert!(caught.is_err());
    assert!(policy_active().unwrap());
    assert_eq!(m.forward(&x).kind(), Kind::Half);
}

#[test]
fn activation_is_restored_on_panic() {
    let handle = apex();
    let x = randn(&[4, 4], Kind::Float);
    let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        handle
            .run(Device::Cpu, || {
                assert_eq!(x.mm(&x).kind(), Kind::Half);
                panic!("boom inside an active policy");
            })
            .unwrap()
    }));
    assert!(caught.is_err());
    assert!(!policy_active().unwrap());
    assert!(!tch_amp::Autocast::state(Device::Cpu).unwrap().enabled);
    assert_eq!(x.mm(&x).kind(), Kind::Float);
}

#[test]
fn user_casts_take_precedence_and_unknown_ops_are_typed_errors() {
    let mut policy = CastPolicy::apex();
    policy.register_float_function("mm").unwrap(); // on Apex's fp16 list
    policy.register_half_function("sigmoid").unwrap(); // in no list
    policy.register_promote_function("where.self").unwrap();
    let err = policy.register_half_function("no_such_op").unwrap_err();
    assert!(matches!(&err, AmpError::Config(ConfigError::UnknownOp { name, .. }) if name == "no_such_op"), "{err}");
    let err = policy.register_float_function("softmax.no_such_overload").unwrap_err();
    assert!(err.to_string().contains("int"), "lists the overloads there are: {err}");
    assert!(policy.register_float_function("mm.out").is_err(), "out= overloads are never cast");

    let handle = install_policy(policy, CastSettings::default()).unwrap();
    let _active = on_cpu(&handle);
    let x = randn(&[4, 4], Kind::Half);
    assert_eq!(x.mm(&x).kind(), Kind::Float);
    assert_eq!(randn(&[4], Kind::Float).sigmoid().kind(), Kind::Half);
    let cond = Tensor::from_slice(&[true, false, true, false]);
    let w = randn(&[4], Kind::Half).where_self(&cond, &randn(&[4], Kind::Float));
    assert_eq!(w.kind(), Kind::Float);
}

#[test]
fn user_casts_load_from_a_toml_file() {
    let mut file = tempfile::NamedTempFile::new().unwrap();
    std::io::Write::write_all(&mut file, b"half = [\"sigmoid\"]\nfloat = [\"tanh\", \"mm.default\"]\n").unwrap();
    let mut policy = CastPolicy::apex();
    policy.load_user_casts(file.path()).unwrap();
    assert_eq!(policy.user.half, vec!["sigmoid".to_string()]);
    let cpu = policy.resolve(Device::Cpu).unwrap();
    assert_eq!(cpu["tanh"], tch_amp::cast::Cast::Fp32);
    assert_eq!(cpu["tanh_"], tch_amp::cast::Cast::Fp32);
    assert_eq!(cpu["mm"], tch_amp::cast::Cast::Fp32);
    assert_eq!(cpu["mm.dtype"], tch_amp::cast::Cast::LowPrecision, "only the named overload moved");

    // A bad file changes nothing.
    let mut bad = tempfile::NamedTempFile::new().unwrap();
    std::io::Write::write_all(&mut bad, b"half = [\"exp\", \"nope_not_an_op\"]\n").unwrap();
    let before = policy.clone();
    assert!(matches!(policy.load_user_casts(bad.path()), Err(AmpError::Config(ConfigError::UnknownOp { .. }))));
    assert_eq!(policy, before);
    let mut typo = tempfile::NamedTempFile::new().unwrap();
    std::io::Write::write_all(&mut typo, b"halve = [\"exp\"]\n").unwrap();
    assert!(matches!(policy.load_user_casts(typo.path()), Err(AmpError::Config(ConfigError::Parse { .. }))));
    assert!(matches!(policy.load_user_casts("/no/such/file.toml"), Err(AmpError::Io { .. })));
}

#[test]
fn bf16_policy_casts_to_bf16() {
    let handle = apex_with(CastSettings::default().low_precision_dtype(Kind::BFloat16));
    let _active = on_cpu(&handle);
    let vs = nn::VarStore::new(Device::Cpu);
    let m = nn::linear(vs.root(), 8, 8, Default::default());
    let y = m.forward(&randn(&[2, 8], Kind::Float));
    assert_eq!(y.kind(), Kind::BFloat16);
    assert_eq!(y.softmax(-1, None::<Kind>).kind(), Kind::Float);
    // An fp16 input of an fp16-list op is cast to the policy's low dtype.
    let x = randn(&[4, 4], Kind::Half);
    assert_eq!(x.mm(&x).kind(), Kind::BFloat16);
    assert!(install_policy(CastPolicy::apex(), CastSettings::default().low_precision_dtype(Kind::Float)).is_err());
}

#[test]
fn bf16_o1_trains_a_small_model() {
    tch::manual_seed(7);
    let vs = nn::VarStore::new(Device::Cpu);
    let model = nn::seq()
        .add(nn::linear(vs.root() / "l1", 4, 16, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "l2", 16, 1, Default::default()));
    let mut opt = nn::Sgd::default().build(&vs, 0.05).unwrap();
    let x = Tensor::randn([64, 4], (Kind::Float, Device::Cpu));
    let y = x.sum_dim_intlist(-1, true, None::<Kind>);
    let handle = apex_with(CastSettings::default().low_precision_dtype(Kind::BFloat16));
    let mut losses = Vec::new();
    for _ in 0..60 {
        let loss = {
            let _active = on_cpu(&handle);
            let out = model.forward(&x);
            assert_eq!(out.kind(), Kind::BFloat16);
            out.mse_loss(&y, Reduction::Mean)
        };
        assert_eq!(loss.kind(), Kind::Float);
        opt.zero_grad();
        loss.backward();
        for v in vs.trainable_variables() {
            assert_eq!(v.grad().kind(), Kind::Float);
        }
        without_casts(|| opt.step()).unwrap();
        tch_amp::cast::clear_cast_cache().unwrap();
        losses.push(loss.double_value(&[]));
    }
    let (first, last) = (losses[0], *losses.last().unwrap());
    assert!(last < 0.2 * first, "bf16 O1 loss went from {first} to {last}");
}

#[test]
fn a_policy_and_plain_autocast_on_two_threads_are_independent() {
    let handle = apex();
    let barrier = Arc::new(Barrier::new(2));
    let (h, b) = (handle.clone(), Arc::clone(&barrier));
    let policy_thread = std::thread::spawn(move || {
        let _active = h.activate(Device::Cpu).unwrap();
        b.wait();
        let mut kinds = Vec::new();
        for _ in 0..50 {
            let x = randn(&[8, 8], Kind::BFloat16);
            kinds.push((x.softmax(-1, None::<Kind>).kind(), x.to_kind(Kind::Float).mm(&x.to_kind(Kind::Float)).kind()));
        }
        b.wait();
        kinds
    });
    let plain_thread = std::thread::spawn(move || {
        let _autocast = tch_amp::Autocast::new(Device::Cpu)
            .dtype(Kind::BFloat16)
            .cpu_kernels(tch_amp::CpuKernels::Native)
            .enter()
            .unwrap();
        barrier.wait();
        let mut kinds = Vec::new();
        for _ in 0..50 {
            let x = randn(&[8, 8], Kind::BFloat16);
            kinds.push((x.softmax(-1, None::<Kind>).kind(), x.to_kind(Kind::Float).mm(&x.to_kind(Kind::Float)).kind()));
        }
        barrier.wait();
        kinds
    });
    // Apex policy: softmax fp32, mm fp16. Plain CPU autocast: softmax in no CPU list (stays
    // bf16), mm bf16.
    for k in policy_thread.join().unwrap() {
        assert_eq!(k, (Kind::Float, Kind::Half));
    }
    for k in plain_thread.join().unwrap() {
        assert_eq!(k, (Kind::BFloat16, Kind::BFloat16));
    }
}

#[test]
fn torch_native_policy_behaves_like_libtorch_cpu_autocast() {
    let handle =
        install_policy(CastPolicy::torch_native(), CastSettings::default().low_precision_dtype(Kind::BFloat16))
            .unwrap();
    let vs = nn::VarStore::new(Device::Cpu);
    let m = nn::linear(vs.root(), 8, 8, Default::default());
    let x = randn(&[4, 8], Kind::Float);
    let target = randn(&[4, 8], Kind::Float);
    let run = |x: &Tensor| {
        let y = m.forward(x);
        (y.kind(), y.softmax(-1, None::<Kind>).kind(), y.mse_loss(&target, Reduction::Mean).kind(), y.exp().kind())
    };
    let ours = handle.run(Device::Cpu, || run(&x)).unwrap();
    let plain = {
        let _autocast = tch_amp::Autocast::new(Device::Cpu)
            .dtype(Kind::BFloat16)
            .cpu_kernels(tch_amp::CpuKernels::Native)
            .enter()
            .unwrap();
        run(&x)
    };
    assert_eq!(ours, plain);
    assert_eq!(ours, (Kind::BFloat16, Kind::BFloat16, Kind::Float, Kind::BFloat16));
}

#[test]
fn ops_in_libtorch_lists_but_not_apex_run_in_input_dtype() {
    let handle = apex();
    let _active = on_cpu(&handle);
    // trace is fp32 in libtorch's CPU list, in no Apex list: stays fp16 under Apex.
    assert_eq!(randn(&[4, 4], Kind::Half).trace().kind(), Kind::Half);
    // linalg_vecdot is low precision in libtorch's CPU list: stays fp32 under Apex.
    let v = randn(&[3, 4], Kind::Float);
    assert_eq!(Tensor::linalg_vecdot(&v, &v, -1).kind(), Kind::Float);
}
