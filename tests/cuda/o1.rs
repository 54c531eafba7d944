//! The O1 engine on CUDA: the same kernels, registered at AutocastCUDA. Needs a CUDA device;
//! compiled and run only with `--features cuda-tests`, where it fails (never skips) without
//! one.

use crate::common::*;
use tch::nn::{self, Module, ModuleT};
use tch::{Device, Kind, Reduction, Tensor};
use tch_amp::cast::classify_torch_error;
use tch_amp::cast::CastSettings;
use tch_amp::error::OpRefused;
use tch_amp::AmpError;

fn cuda() -> Device {
    assert!(tch::Cuda::is_available(), "the cuda-tests feature needs a CUDA device");
    Device::Cuda(0)
}

#[test]
fn apex_policy_casts_cuda_ops() {
    let dev = cuda();
    let vs = nn::VarStore::new(dev);
    let linear = nn::linear(vs.root(), 64, 64, Default::default());
    let x = Tensor::randn([16, 64], (Kind::Float, dev)).set_requires_grad(true);
    let handle = apex();
    let (y, s, cpu) = {
        let _active = handle.activate(dev).unwrap();
        let y = linear.forward(&x);
        let s = y.softmax(-1, None::<Kind>);
        // CPU tensors are not cast by a CUDA activation.
        let c = Tensor::randn([4, 4], (Kind::Float, Device::Cpu));
        (y, s, c.mm(&c))
    };
    assert_eq!(y.kind(), Kind::Half);
    assert_eq!(s.kind(), Kind::Float);
    assert_eq!(cpu.kind(), Kind::Float);
    s.sum(None::<Kind>).backward();
    assert_eq!(x.grad().kind(), Kind::Float);
    // CUDA emulation does not exist: fp16 GEMMs run on the device's kernels, bit for bit.
    let a = Tensor::randn([32, 32], (Kind::Half, dev));
    let ours = handle.run(dev, || a.mm(&a)).unwrap();
    let native = a.mm(&a);
    assert!(ours.equal(&native));
}

#[test]
fn banned_and_inplace_rules_on_cuda() {
    let dev = cuda();
    let p = Tensor::full([8], 0.5, (Kind::Half, dev));
    let t = Tensor::full([8], 1.0, (Kind::Float, dev));
    {
        let handle = apex();
        let _active = handle.activate(dev).unwrap();
        let err = classify_torch_error(p.f_binary_cross_entropy(&t, None::<Tensor>, Reduction::Mean).unwrap_err());
        assert!(matches!(err, AmpError::OpRefused(OpRefused::BannedOp { .. })), "{err}");
        let mut q = p.copy();
        assert!(matches!(
            classify_torch_error(q.f_exp_().unwrap_err()),
            AmpError::OpRefused(OpRefused::InPlaceFp32OnHalf { .. })
        ));
    }
    let handle = apex_with(CastSettings::default().allow_banned(true));
    let _active = handle.activate(dev).unwrap();
    assert_eq!(p.binary_cross_entropy(&t, None::<Tensor>, Reduction::Mean).kind(), Kind::Float);
}

#[test]
fn plain_cuda_autocast_on_another_thread_keeps_libtorch_behaviour() {
    let dev = cuda();
    let _handle = apex();
    let kinds = std::thread::spawn(move || {
        let _autocast = tch_amp::Autocast::new(dev).dtype(Kind::Half).enter().unwrap();
        let x = Tensor::randn([8, 8], (Kind::Float, dev));
        // libtorch's CUDA lists: mm fp16, softmax fp32, einsum fp16 (in no Apex list).
        (
            x.mm(&x).kind(),
            x.to_kind(Kind::Half).softmax(-1, None::<Kind>).kind(),
            Tensor::einsum("ij,jk->ik", &[&x, &x], None::<i64>).kind(),
        )
    })
    .join()
    .unwrap();
    assert_eq!(kinds, (Kind::Half, Kind::Float, Kind::Half));
}

/// Apex's run_layer_test on CUDA (its tests/L0/run_amp ran there): for fp32 and fp16 CUDA
/// inputs under the Apex policy, the output dtype is `expected(input)` and the input's grad
/// keeps the input's dtype.
fn cuda_layer_test(
    handle: &tch_amp::cast::PolicyHandle,
    dev: Device,
    what: &str,
    f: &dyn Fn(&Tensor) -> Tensor,
    expected: fn(Kind) -> Kind,
    shape: &[i64],
) {
    for kind in [Kind::Float, Kind::Half] {
        let x = Tensor::randn(shape, (Kind::Float, dev)).to_kind(kind).set_requires_grad(true);
        let y = handle.run(dev, || f(&x)).unwrap();
        assert_eq!(y.kind(), expected(kind), "{what}: {kind:?} input");
        y.to_kind(Kind::Float).sum(None::<Kind>).backward();
        assert_eq!(x.grad().kind(), kind, "{what}: grad of a {kind:?} input");
    }
}

fn half(_: Kind) -> Kind {
    Kind::Half
}
fn float(_: Kind) -> Kind {
    Kind::Float
}
fn same_as_input(k: Kind) -> Kind {
    k
}

/// O1 under AutocastCUDA: every op below gets the dtype of its Apex list (opt_levels/
/// o1_apex.toml: fp16 list, fp32 list, promote, no list), checked against the policy's CUDA
/// resolution so the test follows the data. gelu (fp32 list), einsum and
/// scaled_dot_product_attention (no Apex list) are where libtorch's own CUDA autocast
/// differs from Apex: a policy that fell back to libtorch's lists fails here.
#[test]
fn apex_list_dtypes_under_autocast_cuda() {
    // The lists resolve without a device; checked first so a data change shows here too.
    let cuda_lists = tch_amp::CastPolicy::apex().resolve(Device::Cuda(0)).unwrap();
    for (op, cast) in [
        ("linear", tch_amp::cast::Cast::LowPrecision),
        ("conv2d", tch_amp::cast::Cast::LowPrecision),
        ("matmul", tch_amp::cast::Cast::LowPrecision),
        ("bmm", tch_amp::cast::Cast::LowPrecision),
        ("baddbmm", tch_amp::cast::Cast::LowPrecision),
        ("prelu", tch_amp::cast::Cast::LowPrecision),
        ("lstm.input", tch_amp::cast::Cast::LowPrecision),
        ("softmax.int", tch_amp::cast::Cast::Fp32),
        ("log_softmax.int", tch_amp::cast::Cast::Fp32),
        ("gelu", tch_amp::cast::Cast::Fp32),
        ("layer_norm", tch_amp::cast::Cast::Fp32),
        ("group_norm", tch_amp::cast::Cast::Fp32),
        ("mse_loss", tch_amp::cast::Cast::Fp32),
        ("exp", tch_amp::cast::Cast::Fp32),
        ("pow.Tensor_Scalar", tch_amp::cast::Cast::Fp32),
        ("sum", tch_amp::cast::Cast::Fp32),
        ("atan2", tch_amp::cast::Cast::Promote),
        ("mul.Tensor", tch_amp::cast::Cast::Promote),
        ("cat", tch_amp::cast::Cast::Promote),
    ] {
        assert_eq!(cuda_lists.get(op), Some(&cast), "{op} in the Apex policy's CUDA lists");
    }
    for op in ["relu", "einsum", "scaled_dot_product_attention", "batch_norm"] {
        assert_eq!(cuda_lists.get(op), None, "{op} is in no Apex list");
    }
    let dev = cuda();

    let handle = apex();
    let vs = nn::VarStore::new(dev);
    let root = vs.root();
    let lin = nn::linear(&root / "lin", 64, 64, Default::default());
    let conv = nn::conv2d(&root / "conv", 16, 16, 3, Default::default());
    let ln = nn::layer_norm(&root / "ln", vec![64], Default::default());
    let gn = nn::group_norm(&root / "gn", 4, 16, Default::default());
    let bn = nn::batch_norm2d(&root / "bn", 16, Default::default());
    let lstm = nn::lstm(&root / "lstm", 64, 32, Default::default());
    let prelu_w = root.ones("prelu", &[1]);
    let other = Tensor::randn([64, 64], (Kind::Float, dev));
    let b3 = Tensor::randn([4, 16, 16], (Kind::Float, dev));
    let target = Tensor::randn([16, 64], (Kind::Float, dev));

    cuda_layer_test(&handle, dev, "linear", &|x| lin.forward(x), half, &[16, 64]);
    cuda_layer_test(&handle, dev, "conv2d", &|x| conv.forward(x), half, &[4, 16, 12, 12]);
    cuda_layer_test(&handle, dev, "x.matmul(w)", &|x| x.matmul(&other), half, &[64, 64]);
    cuda_layer_test(&handle, dev, "w.matmul(x)", &|x| other.matmul(x), half, &[64, 64]);
    cuda_layer_test(&handle, dev, "bmm", &|x| x.bmm(&b3), half, &[4, 16, 16]);
    cuda_layer_test(&handle, dev, "baddbmm", &|x| x.baddbmm(&b3, &b3, 1.0, 1.0), half, &[4, 16, 16]);
    cuda_layer_test(&handle, dev, "prelu", &|x| x.prelu(&prelu_w), half, &[16, 64]);
    cuda_layer_test(
        &handle,
        dev,
        "lstm",
        &|x| {
            use tch::nn::RNN;
            lstm.seq(x).0
        },
        half,
        &[4, 8, 64],
    );
    cuda_layer_test(&handle, dev, "softmax", &|x| x.softmax(-1, None::<Kind>), float, &[16, 64]);
    cuda_layer_test(&handle, dev, "log_softmax", &|x| x.log_softmax(-1, None::<Kind>), float, &[16, 64]);
    cuda_layer_test(&handle, dev, "gelu", &|x| x.gelu("none"), float, &[16, 64]);
    cuda_layer_test(&handle, dev, "layer_norm", &|x| ln.forward(x), float, &[16, 64]);
    cuda_layer_test(&handle, dev, "group_norm", &|x| gn.forward(x), float, &[4, 16, 6, 6]);
    cuda_layer_test(&handle, dev, "mse_loss", &|x| x.mse_loss(&target, Reduction::Mean), float, &[16, 64]);
    cuda_layer_test(&handle, dev, "exp", &|x| (x * 0.1).exp(), float, &[16, 64]);
    cuda_layer_test(&handle, dev, "pow", &|x| x.pow_tensor_scalar(2.0), float, &[16, 64]);
    cuda_layer_test(&handle, dev, "sum", &|x| x.sum(None::<Kind>), float, &[16, 64]);
    cuda_layer_test(&handle, dev, "relu", &|x| x.relu(), same_as_input, &[16, 64]);
    cuda_layer_test(&handle, dev, "batch_norm", &|x| bn.forward_t(x, true), same_as_input, &[4, 16, 6, 6]);
    let einsum = |x: &Tensor| Tensor::einsum("ij,jk->ik", &[x, x], None::<i64>);
    cuda_layer_test(&handle, dev, "einsum", &einsum, same_as_input, &[8, 8]);
    cuda_layer_test(
        &handle,
        dev,
        "scaled_dot_product_attention",
        &|x| Tensor::scaled_dot_product_attention(x, x, x, None::<Tensor>, 0.0, false, None, false),
        same_as_input,
        &[2, 4, 8, 16],
    );

    // Promote: the widest floating input wins; fp64 is never cast down; integers never cast.
    let _active = handle.activate(dev).unwrap();
    let h = Tensor::randn([16], (Kind::Float, dev)).to_kind(Kind::Half);
    let f = Tensor::randn([16], (Kind::Float, dev));
    let d = Tensor::randn([16], (Kind::Double, dev));
    assert_eq!(h.atan2(&h).kind(), Kind::Half);
    assert_eq!(h.atan2(&f).kind(), Kind::Float);
    assert_eq!((&h * &f).kind(), Kind::Float);
    assert_eq!((&h * &d).kind(), Kind::Double);
    assert_eq!(Tensor::cat(&[&h, &h, &f], 0).kind(), Kind::Float);
    assert_eq!(Tensor::stack(&[&h, &h], 0).kind(), Kind::Half);
    assert_eq!(d.view([4, 4]).mm(&d.view([4, 4])).kind(), Kind::Double);
    assert_eq!(Tensor::arange(4, (Kind::Int64, dev)).sum(None::<Kind>).kind(), Kind::Int64);
    // In place: add_ keeps self's dtype, exp_ on fp16 is refused without writing.
    let mut hh = h.copy();
    let _ = hh.f_add_(&f).unwrap();
    assert_eq!(hh.kind(), Kind::Half);
    let before = hh.copy();
    assert!(matches!(
        classify_torch_error(hh.f_exp_().unwrap_err()),
        AmpError::OpRefused(OpRefused::InPlaceFp32OnHalf { .. })
    ));
    assert!(hh.equal(&before), "the refused exp_ wrote");
}

/// A model parameter on CUDA: a leaf that requires grad and is not a view.
fn cuda_param(t: &Tensor) -> Tensor {
    t.detach().copy().set_requires_grad(true)
}

/// Apex's tests/L0/run_amp/test_cache.py WhitelistModule on CUDA: x.mm(w).mm(w) reuses one
/// cached fp16 cast of the fp32 weight (Apex 0.1 with PyTorch 2.x raised IndexError here),
/// gradients have the weight's dtype and equal the fp32 reference exactly (small integers;
/// torch 2.13 fp32: x = ones(2, 8), w = arange(64.).view(8, 8), grad row 0 = 504, 632, ...,
/// 1400, after w -= 1: 472, 600, ..., 1368, as in tests/o1_cache.rs); a no_grad eval caches
/// nothing; an in-place update forces a recast.
#[test]
fn cast_cache_with_reused_weights_on_cuda() {
    let dev = cuda();
    let handle = apex();
    for kind in [Kind::Float, Kind::Half] {
        let _active = handle.activate(dev).unwrap();
        tch_amp::cast::clear_cast_cache().unwrap();
        let x = Tensor::ones([2, 8], (Kind::Float, dev));
        let mut w = cuda_param(&Tensor::arange(64, (Kind::Float, dev)).view([8, 8]).to_kind(kind));
        let mut grads = Vec::new();
        for epoch in 0..2 {
            w.zero_grad();
            let y = x.mm(&w).mm(&w);
            assert_eq!(y.kind(), Kind::Half, "{kind:?}");
            let cached = tch_amp::diagnostics::cast_cache_len().unwrap();
            assert_eq!(cached, usize::from(kind == Kind::Float), "{kind:?}: one cast of w, reused");
            (y.to_kind(Kind::Float).sum(None::<Kind>) * 4.0).backward();
            let g = w.grad() / 4.0;
            assert_eq!(g.kind(), kind, "grad dtype = weight dtype");
            assert_eq!(g.device(), dev);
            tch_amp::cast::clear_cast_cache().unwrap();
            grads.push(to_vec(&g.to_device(Device::Cpu)));
            tch::no_grad(|| {
                let _ = x.mm(&w).mm(&w); // eval
            });
            assert_eq!(tch_amp::diagnostics::cast_cache_len().unwrap(), 0, "no_grad casts are not cached");
            if epoch == 0 {
                tch::no_grad(|| {
                    let _ = w.shallow_clone().f_sub_scalar_(1.0).unwrap();
                });
            }
        }
        assert_eq!(grads[0][..8], [504.0, 632.0, 760.0, 888.0, 1016.0, 1144.0, 1272.0, 1400.0], "{kind:?}");
        assert_eq!(grads[0][56..], [616.0, 744.0, 872.0, 1000.0, 1128.0, 1256.0, 1384.0, 1512.0], "{kind:?}");
        assert_eq!(grads[1][..8], [472.0, 600.0, 728.0, 856.0, 984.0, 1112.0, 1240.0, 1368.0], "{kind:?}");
    }
    // An in-place change of a cached weight: the next forward sees the new values.
    let _active = handle.activate(dev).unwrap();
    let x = Tensor::ones([2, 4], (Kind::Float, dev));
    let w = Tensor::ones([4, 4], (Kind::Float, dev)).set_requires_grad(true);
    assert_eq!(to_vec(&x.mm(&w).to_device(Device::Cpu)), vec![4.0; 8]);
    tch::no_grad(|| {
        let _ = w.shallow_clone().f_add_scalar_(1.0).unwrap();
    });
    let after = x.mm(&w);
    assert_eq!(to_vec(&after.to_device(Device::Cpu)), vec![8.0; 8]);
    after.to_kind(Kind::Float).sum(None::<Kind>).backward();
    assert_eq!(to_vec(&w.grad().to_device(Device::Cpu)), vec![2.0; 16]);
}
