//! The torch.amp path on CUDA: libtorch's own CUDA autocast lists under [`tch_amp::autocast`]
//! (fp16 by default there), and the GradScaler's skip, back-off and growth with the scale and
//! the growth tracker kept on the GPU.
use tch::nn::{self, Module, OptimizerConfig, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::torch_amp::GradScalerOptions;
use tch_amp::Autocast;
use tch_amp::{autocast, GradScaler};

fn cuda() -> Device {
    assert!(tch::Cuda::is_available(), "cuda-tests needs a CUDA device; none is available");
    Device::Cuda(0)
}

#[test]
fn autocast_on_cuda_uses_libtorchs_lists() {
    let dev = cuda();
    let a = Tensor::ones([4, 4], (Kind::Float, dev));
    let (mm, exp, mse, sum) = autocast(dev, || {
        let mm = a.mm(&a);
        // exp and mse_loss are on CUDA autocast's fp32 list, sum on its fp32-unless-a-dtype-is-given
        // list (AT_FORALL_FP32_SET_OPT_DTYPE in ATen/autocast_mode.h).
        let exp = mm.exp();
        let mse = mm.mse_loss(&a, tch::Reduction::Mean);
        let sum = mm.sum(None);
        (mm, exp, mse, sum)
    })
    .unwrap();
    assert_eq!((mm.kind(), exp.kind(), mse.kind(), sum.kind()), (Kind::Half, Kind::Float, Kind::Float, Kind::Float));
    let bf = Autocast::new(dev).dtype(Kind::BFloat16).run(|| a.mm(&a)).unwrap();
    assert_eq!(bf.kind(), Kind::BFloat16);
    // Outside the scope, nothing is cast.
    assert_eq!(a.mm(&a).kind(), Kind::Float);
}

#[test]
fn grad_scaler_on_cuda_skips_backs_off_and_grows() {
    let dev = cuda();
    tch::manual_seed(0);
    let vs = VarStore::new(dev);
    let lin = nn::linear(vs.root() / "fc", 8, 4, Default::default());
    let mut opt = nn::Sgd::default().build(&vs, 0.1).unwrap();
    let mut scaler = GradScaler::with_options(dev, GradScalerOptions::default().growth_interval(2)).unwrap();
    let weight = || lin.ws.detach().copy();
    let mut scales = Vec::new();
    for step in 0..5 {
        let x = Tensor::randn([16, 8], (Kind::Float, dev));
        if step == 2 {
            let _ = x.get(0).get(0).fill_(f64::INFINITY);
        }
        opt.zero_grad();
        let loss = autocast(dev, || {
            lin.forward(&x).mse_loss(&Tensor::zeros([16, 4], (Kind::Float, dev)), tch::Reduction::Mean)
        })
        .unwrap();
        scaler.scale(&loss).unwrap().backward();
        let before = weight();
        let stepped = scaler.step(&mut opt).unwrap().stepped();
        scaler.update().unwrap();
        assert_eq!(stepped, step != 2, "step {step}");
        assert_eq!(weight().equal(&before), step == 2, "step {step}: weights changed iff stepped");
        assert_eq!(scaler.scale_tensor().unwrap().device(), dev, "the scale stays on the GPU");
        scales.push(scaler.get_scale());
    }
    // 2^16; grows after two clean steps; halves at the inf; grows again after two more.
    assert_eq!(scales, [65536.0, 131072.0, 65536.0, 65536.0, 131072.0]);
}
