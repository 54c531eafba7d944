//! The O1 engine on CUDA: the same kernels, registered at AutocastCUDA. Needs a CUDA device;
//! compiled and run only with `--features cuda-tests`, where it fails (never skips) without
//! one.

use crate::common::*;
use tch::nn::{self, Module};
use tch::{Device, Kind, Reduction, Tensor};
use tch_amp::cast::{classify_torch_error, AutocastGuard};
use tch_amp::{AmpError, CastSettings};

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
        assert!(matches!(err, AmpError::BannedOp { .. }), "{err}");
        let mut q = p.copy();
        assert!(matches!(classify_torch_error(q.f_exp_().unwrap_err()), AmpError::InPlaceFp32OnHalf { .. }));
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
        let _autocast = AutocastGuard::new(dev, true, Kind::Half).unwrap();
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
