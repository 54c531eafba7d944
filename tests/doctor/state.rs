//! A diagnosis leaves the model, the optimizer, the scaler and the random generator as they
//! were, bit for bit.
use tch::nn::{self, VarStore};
use tch::{Device, Kind, Reduction, Tensor};
use tch_amp::doctor::Doctor;
use tch_amp::{initialize, AmpConfig, CpuKernels, OptLevel};

use crate::models::{batch, ThreeLayers};

fn snapshot(vs: &VarStore) -> Vec<(String, Kind, bool, Tensor, Option<Tensor>)> {
    let mut v: Vec<_> = vs
        .variables()
        .into_iter()
        .map(|(n, t)| {
            let g = t.grad();
            (n, t.kind(), t.requires_grad(), t.detach().copy(), g.defined().then(|| g.copy()))
        })
        .collect();
    v.sort_by(|a, b| a.0.cmp(&b.0));
    v
}

fn same(a: &Tensor, b: &Tensor) -> bool {
    a.kind() == b.kind() && a.size() == b.size() && a.equal(b)
}

#[test]
fn model_optimizer_scaler_and_rng_are_unchanged_bitwise() {
    let vs = VarStore::new(Device::Cpu);
    let net = ThreeLayers::new(&vs, 1.0);
    let config = AmpConfig::new(OptLevel::O2).cpu_kernels(CpuKernels::Emulate).verbosity(0);
    let sgd = nn::Sgd { momentum: 0.9, ..Default::default() };
    let (model, mut opt, mut amp) = initialize(&vs, net, sgd, 0.1, &config).unwrap();
    let (x, y) = batch(1.0);
    // One step (momentum, masters), then a backward without a step: gradients are held.
    for step in 0..2 {
        let loss = model.forward(&x).to_kind(Kind::Float).mse_loss(&y, Reduction::Mean);
        amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
        if step == 0 {
            opt.step().unwrap();
        }
    }
    let vars = snapshot(&vs);
    let masters: Vec<Tensor> = opt.master_params().iter().map(|t| t.detach().copy()).collect();
    let buffers = |opt: &tch_amp::AmpOptimizer| -> Vec<(String, Tensor)> {
        let r = opt.to_record();
        let mut out = vec![];
        for p in r.params {
            out.extend(p.buffers.into_iter().map(|(k, t)| (format!("{}.{k}", p.name), t.copy())));
        }
        out
    };
    let record = buffers(&opt);
    assert!(!record.is_empty(), "momentum buffers");
    let scaler = (format!("{:?}", amp.state_dict()), amp.loss_scale(0).unwrap());
    let history = format!("{:?}", amp.scaler(0).unwrap().history());

    tch::manual_seed(7);
    for target in [
        Doctor::apex(config.clone()),
        Doctor::apex(AmpConfig::new(OptLevel::O1).cpu_kernels(CpuKernels::Emulate)),
        Doctor::autocast(tch_amp::Autocast::new(Device::Cpu).dtype(Kind::BFloat16)),
    ] {
        // Dropout draws from the generator in both runs (the same masks).
        let r = target
            .run(&vs, |p| {
                let out = p.forward(model.inner(), &x).dropout(0.5, true);
                out.to_kind(Kind::Float).mse_loss(&y, Reduction::Mean)
            })
            .unwrap();
        assert!(!r.ops.is_empty());
    }
    let after_rng = Tensor::randn([4], (Kind::Float, Device::Cpu));
    tch::manual_seed(7);
    assert!(same(&after_rng, &Tensor::randn([4], (Kind::Float, Device::Cpu))), "the generator moved");

    for ((n, k, rg, v, g), (n2, k2, rg2, v2, g2)) in vars.iter().zip(snapshot(&vs).iter()) {
        assert_eq!((n, k, rg), (n2, k2, rg2));
        assert!(same(v, v2), "{n} changed");
        match (g, g2) {
            (Some(a), Some(b)) => assert!(same(a, b), "{n}'s gradient changed"),
            (None, None) => {}
            _ => panic!("{n}'s gradient appeared or vanished"),
        }
    }
    for (a, b) in masters.iter().zip(opt.master_params().iter()) {
        assert!(same(a, b), "a master changed");
    }
    for ((n, a), (n2, b)) in record.iter().zip(buffers(&opt).iter()) {
        assert!(n == n2 && same(a, b), "{n} changed");
    }
    assert_eq!(scaler, (format!("{:?}", amp.state_dict()), amp.loss_scale(0).unwrap()));
    assert_eq!(history, format!("{:?}", amp.scaler(0).unwrap().history()));
    // Training goes on as if nothing happened.
    opt.step().unwrap();
}
