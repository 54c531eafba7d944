//! GPU-only tests: `cargo test --features cuda-tests`. They fail (never skip) when no CUDA
//! device is present, so a run that claims GPU coverage really had one.

use crate::common::*;
use tch::nn::{self, ModuleT, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::{initialize, load_checkpoint, save_checkpoint, AmpConfig, OptLevel};

fn cuda() -> Device {
    assert!(tch::Cuda::is_available(), "cuda-tests needs a CUDA device; none is available");
    Device::Cuda(0)
}

#[test]
fn o2_trains_on_cuda_with_masters_and_resumes_exactly() {
    let dev = cuda();
    tch::manual_seed(0);
    let vs = VarStore::new(dev);
    let net = Mlp::new(&vs.root());
    let (model, mut opt, mut amp) =
        initialize(&vs, net, nn::Adam::default(), 1e-2, &AmpConfig::new(OptLevel::O2)).unwrap();
    assert_eq!(vs.variables()["fc1.weight"].kind(), Kind::Half);
    let x = Tensor::randn([32, 8], (Kind::Float, dev));
    let y = Tensor::randn([32, 4], (Kind::Float, dev));
    let mut first = None;
    let mut last = 0.0;
    for _ in 0..20 {
        let loss = model.forward_t(&x, true).mse_loss(&y, tch::Reduction::Mean);
        last = loss.double_value(&[]);
        first.get_or_insert(last);
        opt.zero_grad().unwrap();
        amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
        assert!(opt.step().unwrap().stepped());
        for (name, m) in opt.param_names().iter().zip(opt.master_params()) {
            let v = &vs.variables()[*name];
            assert!(same(v, &m.to_kind(v.kind())), "{name}");
        }
    }
    assert!(last < first.unwrap());
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cuda.safetensors");
    save_checkpoint(&path, &vs, &[&opt], &amp).unwrap();
    load_checkpoint(&path, &vs, &mut [&mut opt], &mut amp).unwrap();
}

#[test]
fn o2_overflow_on_cuda_skips_the_step() {
    let dev = cuda();
    let vs = VarStore::new(dev);
    let net = Mlp::new(&vs.root());
    let (model, mut opt, mut amp) =
        initialize(&vs, net, nn::Sgd::default(), 0.1, &AmpConfig::new(OptLevel::O2).verbosity(0)).unwrap();
    let x = Tensor::randn([4, 8], (Kind::Float, dev));
    let loss = model.forward_t(&x, true).sum(Kind::Float) * f64::INFINITY;
    let o = amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
    assert!(o.overflow);
    assert!(!opt.step().unwrap().stepped());
    assert_eq!(amp.loss_scale(0).unwrap(), 32768.0);
}
