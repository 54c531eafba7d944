//! Models with several inputs ([`AmpModel::forward_many`], [`AmpModel::cast_inputs`]): at O2
//! every floating input is cast to fp16 (Apex casts every floating tensor argument of
//! `forward`), integer inputs are left alone, the output comes back fp32, and the result is
//! exactly the inner model's on hand-cast inputs; a training step through it works.
use tch::nn::{self, Module, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::{Amp, AmpConfig, OptLevel};

/// Token ids (int64) and dense features (floating), embedded and projected, summed, a head.
#[derive(Debug)]
struct TwoInputs {
    emb: nn::Embedding,
    proj: nn::Linear,
    head: nn::Linear,
}

impl TwoInputs {
    fn forward(&self, ids: &Tensor, feats: &Tensor) -> Tensor {
        self.head.forward(&(self.emb.forward(ids) + self.proj.forward(feats)).relu())
    }
}

fn setup() -> (VarStore, TwoInputs, Amp) {
    tch::manual_seed(7);
    let vs = VarStore::new(Device::Cpu);
    let net = TwoInputs {
        emb: nn::embedding(vs.root() / "emb", 10, 4, Default::default()),
        proj: nn::linear(vs.root() / "proj", 3, 4, Default::default()),
        head: nn::linear(vs.root() / "head", 4, 1, Default::default()),
    };
    let amp = Amp::new(&AmpConfig::new(OptLevel::O2).verbosity(0)).unwrap();
    (vs, net, amp)
}

fn inputs() -> (Tensor, Tensor) {
    let ids = Tensor::from_slice(&[1i64, 7, 3, 9]);
    let feats = (Tensor::arange(12, (Kind::Float, Device::Cpu)) * 0.37).sin().reshape([4, 3]);
    (ids, feats)
}

#[test]
fn both_inputs_cast_at_o2_integers_untouched() {
    let (vs, net, amp) = setup();
    let model = amp.cast_model(&vs, net).unwrap();
    let (ids, feats) = inputs();
    let mut seen = None;
    let out = model.forward_many((&ids, &feats), |m, (ids, feats)| {
        seen = Some((ids.kind(), feats.kind()));
        m.forward(&ids, &feats)
    });
    assert_eq!(seen, Some((Kind::Int64, Kind::Half)), "ids stay int64, features become fp16");
    assert_eq!(out.kind(), Kind::Float, "O2 outputs come back fp32");
    // Exactly the inner model on hand-cast inputs, its output cast to fp32.
    let want = model.inner().forward(&ids, &feats.to_kind(Kind::Half)).to_kind(Kind::Float);
    assert!(out.equal(&want));
    // The inputs themselves are not modified.
    assert_eq!((ids.kind(), feats.kind()), (Kind::Int64, Kind::Float));

    // Other arrangements: arrays, Vecs, nested tuples, owned tensors.
    let [a, b] = model.cast_inputs([feats.shallow_clone(), ids.shallow_clone()]);
    assert_eq!((a.kind(), b.kind()), (Kind::Half, Kind::Int64));
    let v = model.cast_inputs(vec![&feats, &feats]);
    assert!(v.iter().all(|t| t.kind() == Kind::Half));
    let (x, (y, z)) = model.cast_inputs((&ids, (feats.to_kind(Kind::Double), vec![&feats])));
    assert_eq!((x.kind(), y.kind(), z[0].kind()), (Kind::Int64, Kind::Half, Kind::Half));
}

#[test]
fn o0_leaves_inputs_alone_and_training_through_forward_many_steps() {
    let (vs, net, _) = setup();
    let amp0 = Amp::new(&AmpConfig::new(OptLevel::O0).verbosity(0)).unwrap();
    let m0 = amp0.cast_model(&vs, net).unwrap();
    let (ids, feats) = inputs();
    let (i, f) = m0.cast_inputs((&ids, &feats));
    assert_eq!((i.kind(), f.kind()), (Kind::Int64, Kind::Float));

    let (vs, net, _) = setup();
    let mut amp = Amp::new(&AmpConfig::new(OptLevel::O2).loss_scale(128.0).verbosity(0)).unwrap();
    let model = amp.cast_model(&vs, net).unwrap();
    let mut opt = amp.optimizer(&vs, nn::Sgd::default(), 0.1).unwrap();
    let before = vs.variables()["proj.weight"].copy();
    let out = model.forward_many((&ids, &feats), |m, (ids, feats)| m.forward(&ids, &feats));
    let loss = out.square().mean(Kind::Float);
    amp.scale_loss(&loss, &mut [&mut opt], |l| l.backward()).unwrap();
    assert!(opt.step().unwrap().stepped());
    let after = &vs.variables()["proj.weight"];
    assert_eq!(after.kind(), Kind::Half);
    assert!(!after.equal(&before), "the fp16 input's projection was trained");
}
