//! Bytes per parameter under O2 (fp16 model grads and fp32 master grads must not live longer
//! than needed), counted from first principles for a model of linear layers only: fp16 weight
//! 2 B, fp32 master 4 B, fp32 master grad 4 B (`scale_loss` releases the fp16 grad once it made
//! it), Adam state 8 B, SGD with momentum 4 B. Apex holds 20 B with Adam (fp16 and fp32 grads).
//! tests/o2_step.rs measures the peak with a counting allocator.
//!
//! The lean options, each with Adam (README's memory table): bf16 parameters with fp32 masters
//! whose gradients accumulate in fp32 across micro-batches (18 B, as fp16); the moments stored
//! in bf16 (`OptimizerConfig::state_dtype`, 14 B); fp16 without masters and fp32 state
//! (fairseq's memory-efficient path: `master_weights(false)` + `fp32_optimizer_state(true)`,
//! 12 B), the same with bf16 moments (8 B). tests/distributed/zero.rs counts the sharded
//! optimizer's bytes per rank.
use tch::nn::{self, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::{initialize, AmpConfig, OptLevel, OptimizerConfig};

fn run(opt_cfg: OptimizerConfig) -> (f64, f64, f64) {
    run_with(opt_cfg, AmpConfig::new(OptLevel::O2), 1)
}

/// Linear 32-64 ("a") then linear 64-8 ("b").
fn two_linears(vs: &VarStore) -> nn::Sequential {
    nn::seq().add(nn::linear(vs.root() / "a", 32, 64, Default::default())).add(nn::linear(
        vs.root() / "b",
        64,
        8,
        Default::default(),
    ))
}

/// Two steps of `opt_cfg` under `amp_cfg`, `passes` micro-batches (`scale_loss` passes) each:
/// the bytes per parameter at the second step (before `step`) and after it, and the gradient
/// bytes left after it.
fn run_with(opt_cfg: OptimizerConfig, amp_cfg: AmpConfig, passes: usize) -> (f64, f64, f64) {
    tch::manual_seed(0);
    let vs = VarStore::new(Device::Cpu);
    let net = two_linears(&vs);
    let (model, mut opt, mut amp) = initialize(&vs, net, opt_cfg, 1e-3, &amp_cfg.verbosity(0)).unwrap();
    let x = Tensor::randn([16, 32], (Kind::Float, Device::Cpu)) * 0.1;
    let mut step = || {
        opt.zero_grad().unwrap();
        for k in 0..passes {
            let loss = model.forward(&(&x * (1.0 + k as f64))).square().mean(Kind::Float);
            amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
        }
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

fn adam() -> OptimizerConfig {
    nn::Adam::default().into()
}

/// bf16 parameters with fp32 masters (DeepSpeed's BF16_Optimizer's layout): the bf16 gradients
/// of two micro-batches are accumulated in the fp32 master gradients and released, so the
/// bytes are fp16's.
#[test]
fn o2_bf16_with_fp32_masters_holds_18_bytes_with_two_micro_batches() {
    let o2_bf16 = || AmpConfig::new(OptLevel::O2).cast_model_type(Some(Kind::BFloat16));
    assert_eq!(run_with(adam(), o2_bf16(), 2), (18.0, 14.0, 0.0));
}

/// Adam's moments stored in bf16 between steps: 2 (weight) + 4 (master) + 4 (master gradient)
/// + 4 (two bf16 moments).
#[test]
fn o2_adam_with_bf16_state_holds_14_bytes_at_step_and_10_between_steps() {
    let bf16_state = adam().state_dtype(Kind::BFloat16);
    assert_eq!(run_with(bf16_state, AmpConfig::new(OptLevel::O2), 1), (14.0, 10.0, 0.0));
}

/// fairseq's MemoryEfficientFP16Optimizer: fp16 weights and gradients (unscaled in place, kept
/// until `zero_grad` as torch keeps a model's), no masters, fp32 state updated in fp32:
/// 2 + 2 + 8; with bf16 moments 2 + 2 + 4.
#[test]
fn fp16_without_masters_and_fp32_state_holds_12_bytes() {
    let lean = || AmpConfig::new(OptLevel::O2).master_weights(false).fp32_optimizer_state(true);
    let params = (32 * 64 + 64 + 64 * 8 + 8) as f64;
    assert_eq!(run_with(adam(), lean(), 1), (12.0, 12.0, 2.0 * params));
    assert_eq!(run_with(adam().state_dtype(Kind::BFloat16), lean(), 1), (8.0, 8.0, 2.0 * params));
}

/// bf16 O2's micro-batches accumulate in fp32: after the second `scale_loss` pass each master
/// gradient is, bit for bit, the first pass's plus the second pass's alone (each a bf16
/// gradient widened and unscaled), one fp32 addition, and not a bf16 value.
#[test]
fn o2_bf16_micro_batches_accumulate_in_fp32_master_gradients() {
    tch::manual_seed(0);
    let vs = VarStore::new(Device::Cpu);
    let net = two_linears(&vs);
    let cfg = AmpConfig::new(OptLevel::O2).cast_model_type(Some(Kind::BFloat16)).verbosity(0);
    let (model, mut opt, mut amp) = initialize(&vs, net, adam(), 1e-3, &cfg).unwrap();
    let x = Tensor::randn([16, 32], (Kind::Float, Device::Cpu)) * 0.1;
    let mut pass = |opt: &mut tch_amp::AmpOptimizer, k: f64| {
        let loss = model.forward(&(&x * k)).square().mean(Kind::Float);
        amp.scale_loss(&loss, &mut [opt], |s| s.backward()).unwrap();
    };
    let grads =
        |opt: &tch_amp::AmpOptimizer| -> Vec<Tensor> { opt.master_params().iter().map(|m| m.grad().copy()).collect() };
    opt.zero_grad().unwrap();
    pass(&mut opt, 2.0);
    let second_alone = grads(&opt);
    opt.zero_grad().unwrap();
    pass(&mut opt, 1.0);
    let first = grads(&opt);
    pass(&mut opt, 2.0);
    let both = grads(&opt);
    let mut not_bf16 = 0;
    for ((f, s), b) in first.iter().zip(&second_alone).zip(&both) {
        assert_eq!(b.kind(), Kind::Float);
        assert!(b.equal(&(f + s)), "the master gradient is not the fp32 sum of the passes");
        not_bf16 +=
            i64::try_from(b.ne_tensor(&b.to_kind(Kind::BFloat16).to_kind(Kind::Float)).sum(Kind::Int64)).unwrap();
    }
    assert!(not_bf16 > 0, "every accumulated gradient is a bf16 value: no evidence of fp32 accumulation");
    assert!(opt.step().unwrap().stepped());
}

/// The fp32 baseline: 4 (weight) + 4 (gradient, kept until `zero_grad` as torch does) + 8.
#[test]
fn o0_adam_holds_16_bytes() {
    let (at_step, after, grads) = run_with(adam(), AmpConfig::new(OptLevel::O0), 1);
    assert_eq!((at_step, after), (16.0, 16.0));
    assert!(grads > 0.0);
}
