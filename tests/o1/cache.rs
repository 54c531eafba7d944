//! O1's weight-cast cache: Apex's tests/L0/run_amp/test_cache.py (train, no_grad eval, train
//! again: one grad, of the weight's dtype, equal to the fp32 reference), a weight used twice in
//! one forward, recasting after an in-place change, and when the cache is emptied.

use crate::common::*;
use tch::{Device, Kind, Tensor};
use tch_amp::cast::clear_cast_cache;
use tch_amp::diagnostics::cast_cache_len;
use tch_amp::without_casts;

type Ops = fn(&Tensor, &Tensor) -> Tensor;

/// Apex's WhitelistModule.ops: two fp16-list ops sharing the weight.
fn whitelist(x: &Tensor, w: &Tensor) -> Tensor {
    x.mm(w).mm(w).sum(None::<Kind>)
}
/// Apex's BlacklistModule.ops: fp32-list pow twice, promote add.
fn blacklist(x: &Tensor, w: &Tensor) -> Tensor {
    (x + w.pow_tensor_scalar(2.0) + w.pow_tensor_scalar(2.0)).sum(None::<Kind>)
}
/// Apex's PromoteModule.ops.
fn promote(x: &Tensor, w: &Tensor) -> Tensor {
    ((x * w) * w).sum(None::<Kind>)
}

/// A model parameter: a leaf that requires grad and is not a view (what the cache caches).
fn param(t: &Tensor) -> Tensor {
    t.detach().copy().set_requires_grad(true)
}

/// Apex's get_reference_grad: fresh fp32 copies, plain fp32 autograd, no casts.
fn reference_grad(x: &Tensor, w: &Tensor, ops: Ops) -> Tensor {
    without_casts(|| {
        let x = x.detach().to_kind(Kind::Float);
        let w = w.detach().to_kind(Kind::Float).set_requires_grad(true);
        ops(&x, &w).backward();
        w.grad()
    })
    .unwrap()
}

/// Apex's train_eval_train_test, with one policy active throughout as Apex's handle was.
/// `cast_weight`: the ops cast the weight to fp16 (an fp16-list op on an fp32 weight), so the
/// cache holds exactly that cast during the forward.
fn train_eval_train(rows: i64, ops: Ops, kind: Kind, cast_weight: bool) -> Vec<Vec<f32>> {
    let handle = apex();
    let _active = on_cpu(&handle);
    let x = Tensor::ones([2, 8], (Kind::Float, Device::Cpu));
    let mut w = param(&Tensor::arange(rows * 8, (Kind::Float, Device::Cpu)).view([rows, 8]).to_kind(kind));
    let mut grads = Vec::new();
    let mut training_step = |w: &mut Tensor| {
        w.zero_grad();
        let loss = ops(&x, w);
        if cast_weight {
            assert_eq!(cast_cache_len().unwrap(), 1, "the fp32 weight's fp16 cast is cached");
        }
        // The scale_loss block: loss.float() * 4 backward, grads / 4, cache cleared at exit.
        (loss.to_kind(Kind::Float) * 4.0).backward();
        let grad = w.grad() / 4.0;
        clear_cast_cache().unwrap();
        assert!(grad.defined());
        assert_eq!(grad.kind(), kind, "grad dtype = weight dtype");
        let reference = reference_grad(&x, w, ops);
        assert_eq!(to_vec(&grad), to_vec(&reference), "grad = fp32 reference (exact: small integers)");
        grads.push(to_vec(&grad));
        tch::no_grad(|| {
            let _ = w.f_sub_scalar_(1.0).unwrap();
        });
    };
    training_step(&mut w); // first epoch
    tch::no_grad(|| {
        let _ = ops(&x, &w); // eval
    });
    assert_eq!(cast_cache_len().unwrap(), 0, "no_grad casts are not cached");
    training_step(&mut w); // training resumes after eval
    grads
}

#[test]
fn whitelist_module_fp32_and_fp16_weight() {
    // torch 2.13, fp32 reference (Apex's get_reference_grad):
    //   x = torch.ones(2, 8); w = torch.arange(64.).view(8, 8).requires_grad_()
    //   x.mm(w).mm(w).sum().backward(); w.grad[0]  ->  504, 632, ..., 1400 (step 128)
    //   after w -= 1:                      w.grad[0]  ->  472, 600, ..., 1368
    for kind in [Kind::Float, Kind::Half] {
        let grads = train_eval_train(8, whitelist, kind, kind == Kind::Float);
        assert_eq!(grads[0][..8], [504.0, 632.0, 760.0, 888.0, 1016.0, 1144.0, 1272.0, 1400.0]);
        assert_eq!(grads[1][..8], [472.0, 600.0, 728.0, 856.0, 984.0, 1112.0, 1240.0, 1368.0]);
        assert_eq!(grads[0][56..], [616.0, 744.0, 872.0, 1000.0, 1128.0, 1256.0, 1384.0, 1512.0]);
    }
}

#[test]
fn blacklist_module_fp32_and_fp16_weight() {
    // w = torch.arange(16.).view(2, 8): grad = 4 w = [0, 4, ..., 60]; after w -= 1: 4 (w - 1).
    for kind in [Kind::Float, Kind::Half] {
        let grads = train_eval_train(2, blacklist, kind, false);
        assert_eq!(grads[0], (0..16).map(|i| 4.0 * i as f32).collect::<Vec<_>>());
        assert_eq!(grads[1], (0..16).map(|i| 4.0 * (i as f32 - 1.0)).collect::<Vec<_>>());
    }
}

#[test]
fn promote_module_fp32_and_fp16_weight() {
    // ((x * w) * w).sum() with x = ones(2, 8), w = torch.arange(16.).view(2, 8):
    // grad = 2 x w = [0, 2, ..., 30]; after w -= 1: 2 (w - 1).
    for kind in [Kind::Float, Kind::Half] {
        let grads = train_eval_train(2, promote, kind, false);
        assert_eq!(grads[0], (0..16).map(|i| 2.0 * i as f32).collect::<Vec<_>>());
        assert_eq!(grads[1], (0..16).map(|i| 2.0 * (i as f32 - 1.0)).collect::<Vec<_>>());
    }
}

#[test]
fn a_weight_used_twice_in_one_forward_shares_one_cast() {
    let handle = apex();
    let _active = on_cpu(&handle);
    clear_cast_cache().unwrap();
    let x = Tensor::ones([2, 8], (Kind::Float, Device::Cpu));
    let w = param(&Tensor::arange(64, (Kind::Float, Device::Cpu)).view([8, 8]));
    let y = x.mm(&w).mm(&w); // Apex 0.1 + PyTorch 2.x: IndexError here
    assert_eq!(y.kind(), Kind::Half);
    assert_eq!(cast_cache_len().unwrap(), 1, "one cast of w, reused");
    y.to_kind(Kind::Float).sum(None::<Kind>).backward();
    assert_eq!(to_vec(&w.grad()), to_vec(&reference_grad(&x, &w, whitelist)));
}

#[test]
fn an_in_place_change_of_the_weight_forces_a_recast() {
    let handle = apex();
    let _active = on_cpu(&handle);
    let x = Tensor::ones([2, 4], (Kind::Float, Device::Cpu));
    let mut w = Tensor::ones([4, 4], (Kind::Float, Device::Cpu)).set_requires_grad(true);
    let before = x.mm(&w);
    assert_eq!(to_vec(&before), vec![4.0; 8]);
    // An optimizer-style in-place update bumps the version counter; no cache clear needed.
    tch::no_grad(|| {
        let _ = w.f_add_scalar_(1.0).unwrap();
    });
    let after = x.mm(&w);
    assert_eq!(to_vec(&after), vec![8.0; 8]);
    after.to_kind(Kind::Float).sum(None::<Kind>).backward();
    assert_eq!(to_vec(&w.grad()), vec![2.0; 16]);
}

#[test]
fn casts_made_under_no_grad_are_not_cached() {
    let handle = apex();
    let _active = on_cpu(&handle);
    clear_cast_cache().unwrap();
    let x = randn(&[2, 8], Kind::Float);
    let w = leaf(&[8, 8], Kind::Float);
    let eval = tch::no_grad(|| x.mm(&w));
    assert!(!eval.requires_grad());
    assert_eq!(cast_cache_len().unwrap(), 0);
    let train = x.mm(&w);
    assert!(train.requires_grad());
    assert_eq!(cast_cache_len().unwrap(), 1);
    // An entry made in grad mode is reused under no_grad (it is valid there too).
    let eval = tch::no_grad(|| x.mm(&w));
    assert_eq!(to_vec(&eval), to_vec(&train));
    train.to_kind(Kind::Float).sum(None::<Kind>).backward();
    assert!(w.grad().defined());
}

#[test]
fn the_cache_is_emptied_when_the_outermost_activation_ends() {
    let handle = apex();
    let x = randn(&[2, 8], Kind::Float);
    let w = leaf(&[8, 8], Kind::Float);
    {
        let _outer = on_cpu(&handle);
        let _ = x.mm(&w);
        {
            let _inner = on_cpu(&handle);
            let _ = x.mm(&w);
        }
        assert_eq!(cast_cache_len().unwrap(), 1, "an inner guard keeps the cache");
    }
    assert_eq!(cast_cache_len().unwrap(), 0);
    // bf16 and fp16 casts of one weight are distinct entries.
    let bf16 = apex_with(tch_amp::cast::CastSettings::default().low_precision_dtype(Kind::BFloat16));
    let _a = on_cpu(&handle);
    let _ = x.mm(&w);
    let _b = on_cpu(&bf16);
    let y = x.mm(&w);
    assert_eq!(y.kind(), Kind::BFloat16);
    assert_eq!(cast_cache_len().unwrap(), 2);
}
