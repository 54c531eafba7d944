//! Bytes per parameter under O2 (fp16 model grads and fp32 master grads must not live longer
//! than needed), counted from first principles for a model of linear layers only: fp16 weight
//! 2 B, fp32 master 4 B, fp32 master grad 4 B (`scale_loss` releases the fp16 grad once it made
//! it), Adam state 8 B, SGD with momentum 4 B. Apex holds 20 B with Adam (fp16 and fp32 grads).
//! tests/o2_step.rs measures the peak with a counting allocator.
use tch::nn::{self, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::{initialize, AmpConfig, OptLevel, OptimizerConfig};

fn run(opt_cfg: OptimizerConfig) -> (f64, f64, f64) {
    tch::manual_seed(0);
    let vs = VarStore::new(Device::Cpu);
    let net = nn::seq().add(nn::linear(vs.root() / "a", 32, 64, Default::default())).add(nn::linear(
        vs.root() / "b",
        64,
        8,
        Default::default(),
    ));
    let (model, mut opt, mut amp) = initialize(&vs, net, opt_cfg, 1e-3, &AmpConfig::new(OptLevel::O2)).unwrap();
    let x = Tensor::randn([16, 32], (Kind::Float, Device::Cpu)) * 0.1;
    let mut step = || {
        opt.zero_grad().unwrap();
        let loss = model.forward(&x).square().mean(Kind::Float);
        amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
        let at_step = opt.memory().bytes_per_param();
        assert!(opt.step().unwrap().stepped(), "no overflow expected at this scale");
        (at_step, opt.memory().bytes_per_param())
    };
    let (first_at_step, _) = step();
    let (at_step, after) = step();
    let _ = first_at_step;
    let params = opt.memory().params;
    assert_eq!(params, 32 * 64 + 64 + 64 * 8 + 8);
    (at_step, after, opt.memory().grads as f64)
}

#[test]
fn o2_adam_holds_18_bytes_per_param_at_step_and_14_between_steps() {
    let (at_step, after, grads) = run(nn::Adam::default().into());
    assert_eq!(at_step, 18.0);
    assert_eq!(after, 14.0);
    assert_eq!(grads, 0.0, "all grads released after the step");
}

#[test]
fn o2_sgd_momentum_holds_14_bytes_at_step_and_plain_sgd_10() {
    let (at_step, after, _) = run(nn::Sgd { momentum: 0.9, ..Default::default() }.into());
    assert_eq!((at_step, after), (14.0, 10.0));
    let (at_step, after, _) = run(nn::Sgd::default().into());
    assert_eq!((at_step, after), (10.0, 6.0));
}
