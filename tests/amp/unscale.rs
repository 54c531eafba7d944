//! The fused unscale + overflow check: an inf or NaN in any element of any gradient, of any
//! floating dtype, is found; clean gradients are unscaled exactly (scales are powers of two).
use tch::nn::{self, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::{Amp, AmpConfig, LossScale, OptLevel};

/// A store with one variable per dtype: fp16 (3 elements), bf16 (2), fp32 (4).
fn store() -> VarStore {
    let vs = VarStore::new(Device::Cpu);
    let r = vs.root();
    let _a = r.add("h", Tensor::from_slice(&[1.0f32, 2.0, 3.0]).to_kind(Kind::Half), true);
    let _b = r.add("b", Tensor::from_slice(&[4.0f32, 5.0]).to_kind(Kind::BFloat16), true);
    let _c = r.add("f", Tensor::from_slice(&[6.0f32, 7.0, 8.0, 9.0]), true);
    vs
}

fn loss_of(vs: &VarStore) -> Tensor {
    let v = vs.variables();
    // d loss / d var = [1, 2, ..] scaled: distinct per element.
    ["h", "b", "f"]
        .iter()
        .map(|n| {
            let t = &v[*n];
            let w = Tensor::arange(t.numel() as i64, (Kind::Float, Device::Cpu)) + 1.0;
            (t.to_kind(Kind::Float) * w).sum(Kind::Float) / 64.0
        })
        .reduce(|a, b| a + b)
        .unwrap()
}

#[test]
fn finds_inf_and_nan_anywhere_in_any_dtype() {
    for master_weights in [false, true] {
        for bad in [f64::INFINITY, f64::NEG_INFINITY, f64::NAN] {
            for name in ["h", "b", "f"] {
                let n = store().variables()[name].numel() as i64;
                for pos in 0..n {
                    let vs = store();
                    let cfg = AmpConfig::new(OptLevel::O0)
                        .cast_model_type(None)
                        .master_weights(master_weights)
                        .loss_scale(LossScale::Dynamic)
                        .verbosity(0);
                    let mut amp = Amp::new(&cfg).unwrap();
                    let mut opt = amp.optimizer(&vs, nn::Sgd::default(), 0.1).unwrap();
                    let vars = vs.variables();
                    let o = amp
                        .scale_loss(&loss_of(&vs), &mut [&mut opt], |s| {
                            s.backward();
                            let _ = vars[name].grad().get(pos).fill_(bad);
                        })
                        .unwrap();
                    assert!(o.overflow, "masters={master_weights} {bad} in {name}[{pos}] not found");
                    assert!(!opt.step().unwrap().stepped());
                }
            }
        }
    }
}

#[test]
fn clean_grads_are_unscaled_exactly() {
    for master_weights in [false, true] {
        let vs = store();
        let cfg = AmpConfig::new(OptLevel::O0)
            .cast_model_type(None)
            .master_weights(master_weights)
            .loss_scale(LossScale::Dynamic);
        let mut amp = Amp::new(&cfg).unwrap();
        let mut opt = amp.optimizer(&vs, nn::Sgd::default(), 0.1).unwrap();
        let o = amp.scale_loss(&loss_of(&vs), &mut [&mut opt], |s| s.backward()).unwrap();
        assert!(!o.overflow);
        assert_eq!(o.loss_scale, 65536.0);
        for (name, p) in opt.param_names().iter().zip(opt.master_params()) {
            let g = p.grad();
            let expected_kind = if master_weights { Kind::Float } else { vs.variables()[*name].kind() };
            assert_eq!(g.kind(), expected_kind, "{name}");
            let n = g.numel() as i64;
            let expected = (Tensor::arange(n, (Kind::Float, Device::Cpu)) + 1.0) / 64.0;
            assert!(g.to_kind(Kind::Float).equal(&expected), "masters={master_weights} {name}: {g}");
        }
    }
}
