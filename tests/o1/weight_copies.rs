//! O1's rounding of weights for emulated ops (src/shim/weight_copies.h): a weight that the
//! previous forward used once gets one rounding node, forward and backward, instead of the
//! cached cast to fp16 and a conversion back per use; when the same forward uses it again, the
//! node is rewired into a cast made then, so the uses' gradients still add up in fp16. Each
//! step below must give the casts' bits written out by hand, whichever path the weight took,
//! and the per-thread counters show which path that was. (The optimizer's copies, and a
//! training run with them on and off, are in tests/amp/cpu_speed.rs.)
use crate::common::*;
use tch::{Device, Kind, Tensor};
use tch_amp::diagnostics::{o1_rounding_vectorized, o1_weight_copies, o1_weight_copy, O1WeightCopies};
use tch_amp::{CastSettings, CpuKernels};

/// Deterministic, well-spread values.
pub(crate) fn det(shape: &[i64], salt: f64) -> Tensor {
    let n: i64 = shape.iter().product();
    (Tensor::arange(n, (Kind::Double, Device::Cpu)) * 0.7548776662466927 + salt).sin().to_kind(Kind::Float).view(shape)
        * 2.0
}

pub(crate) fn same_bits(a: &Tensor, b: &Tensor) -> bool {
    let bits = |t: &Tensor| t.view_dtype(if t.kind() == Kind::Float { Kind::Int } else { Kind::Int16 });
    a.kind() == b.kind() && a.size() == b.size() && bits(a).eq_tensor(&bits(b)).all().int64_value(&[]) == 1
}

/// The counters' change since `before` (this thread's).
fn delta(before: O1WeightCopies) -> (u64, u64, u64) {
    let now = o1_weight_copies().unwrap();
    (now.served - before.served, now.rounded - before.rounded, now.demoted - before.demoted)
}

#[test]
fn rounding_runs_the_vector_code_where_the_cpu_has_f16c() {
    // The portable loop is several times slower; a build that loses the vector path (it once
    // did, through a missing include) must fail here, not only in the benchmark.
    #[cfg(target_arch = "x86_64")]
    {
        let f16c = std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c");
        assert_eq!(o1_rounding_vectorized().unwrap(), f16c);
    }
    #[cfg(not(target_arch = "x86_64"))]
    assert!(!o1_rounding_vectorized().unwrap());
}

/// Steps of one linear layer under O1 with emulated fp16, the weight used `uses[k]` times in
/// step k (the bias with it): forward and gradients against the casts written out, with the
/// weight's gradients of several uses added up in fp16 as one shared cast does.
#[test]
fn weights_used_once_take_one_rounding_node_with_the_casts_bits_and_a_second_use_rewires_it() {
    let low = Kind::Half;
    let handle = apex_with(CastSettings::default().cpu_kernels(CpuKernels::Emulate));
    let mut w = (det(&[24, 16], 1.1) * 0.7).set_requires_grad(true);
    let mut b = (det(&[24], 2.0) * 0.1).set_requires_grad(true);
    let x0 = det(&[9, 16], 0.3);
    let upstream = det(&[9, 24], 0.9) * 3e3;
    // Step k's expected (served, rounded, demoted) on this thread: step 0 has no record of
    // earlier uses (casts); after a single use, the weight and the bias get rounding nodes
    // (no optimizer writes copies here); at a second use in one forward both nodes are
    // rewired (demoted); after a forward with two uses they take the casts again, and
    // rounding nodes once a forward has used them once.
    let uses = [1usize, 1, 2, 2, 1, 1];
    let expected = [(0u64, 0u64, 0u64), (0, 2, 0), (0, 2, 2), (0, 0, 0), (0, 0, 0), (0, 2, 0)];
    let mut discriminating = false;
    for (k, (&n, &want_counts)) in uses.iter().zip(&expected).enumerate() {
        let x = (&x0 * (1.0 + k as f64)).set_requires_grad(true);
        let before = o1_weight_copies().unwrap();
        let outs = handle
            .run(Device::Cpu, || (0..n).map(|i| (&x * (1.0 + i as f64)).linear(&w, Some(&b))).collect::<Vec<_>>())
            .unwrap();
        assert_eq!(delta(before), want_counts, "step {k}: (served, rounded, demoted)");
        let loss = |outs: &[Tensor]| {
            outs.iter().map(|y| (y.to_kind(Kind::Float) * &upstream).sum(Kind::Float)).reduce(|a, b| a + b).unwrap()
        };
        loss(&outs).backward();
        let got = [x.grad().copy(), w.grad().copy(), b.grad().copy()];

        // The casts written out: one cast of each weight per forward (`shared`), or one per use.
        let reference = |shared: bool| -> Vec<Tensor> {
            let (xr, wr, br) = (
                x.detach().copy().set_requires_grad(true),
                w.detach().copy().set_requires_grad(true),
                b.detach().copy().set_requires_grad(true),
            );
            let up = |t: &Tensor| t.to_kind(Kind::Float);
            let (w16, b16) = (wr.to_kind(low), br.to_kind(low));
            let outs: Vec<Tensor> = (0..n)
                .map(|i| {
                    let (wi, bi) = if shared {
                        (w16.shallow_clone(), b16.shallow_clone())
                    } else {
                        (wr.to_kind(low), b16.shallow_clone())
                    };
                    let a = &xr * (1.0 + i as f64);
                    up(&a.to_kind(low)).linear(&up(&wi), Some(&up(&bi))).to_kind(low)
                })
                .collect();
            loss(&outs).backward();
            let mut v = outs;
            v.extend([xr.grad(), wr.grad(), br.grad()]);
            v
        };
        let want = reference(true);
        for (i, y) in outs.iter().enumerate() {
            assert!(same_bits(y, &want[i]), "step {k}: output {i} differs from the casts");
        }
        // (The weights' gradients accumulate onto zeros: + 0.0 makes -0 +0 on both sides.)
        for (j, name) in ["grad x", "grad w", "grad b"].iter().enumerate() {
            assert!(same_bits(&(&got[j] + 0.0), &(&want[n + j] + 0.0)), "step {k}: {name} differs from the casts");
        }
        if n > 1 {
            // Adding the uses' gradients in fp32 instead gives other bits here: the comparison
            // above tells the two apart.
            let per_use = reference(false);
            discriminating |= !same_bits(&per_use[n + 1], &want[n + 1]);
        }
        // No optimizer ran: no copy.
        assert!(o1_weight_copy(&w).unwrap().is_none());
        tch::no_grad(|| {
            let _ = w.shallow_clone().g_sub_(&(w.grad() * 1e-6));
            let _ = b.shallow_clone().g_sub_(&(b.grad() * 1e-6));
        });
        w.zero_grad();
        b.zero_grad();
    }
    assert!(discriminating, "the data never tells fp16 from fp32 accumulation of the weight's gradients");
}

/// The backward of O1's rounding nodes (a weight's, an activation's) rounds the gradient in
/// place when nothing else can see its memory, and into a new tensor otherwise, here under
/// create_graph (a differentiable backward, which must not write into its inputs): the same
/// bits either way, and the per-thread counter tells which path ran.
#[test]
fn rounding_nodes_round_unshared_gradients_in_place_with_the_bits_of_a_new_tensor() {
    let handle = apex_with(CastSettings::default().cpu_kernels(CpuKernels::Emulate));
    let w = (det(&[24, 16], 1.1) * 0.7).set_requires_grad(true);
    let b = (det(&[24], 2.0) * 0.1).set_requires_grad(true);
    let x0 = det(&[9, 16], 0.3);
    let upstream = det(&[9, 24], 0.9) * 3e3;
    // One forward and backward; the gradients of x, w and b and how many were rounded in place.
    let step = |create_graph: bool| -> (Vec<Tensor>, u64) {
        let before = o1_weight_copies().unwrap().gradients_in_place;
        let x = x0.copy().set_requires_grad(true);
        // `a` is an activation (not a leaf): its rounding node is round_through's.
        let y = handle.run(Device::Cpu, || (&x * 1.5).linear(&w, Some(&b))).unwrap();
        let loss = (y.to_kind(Kind::Float) * &upstream).sum(Kind::Float);
        let grads = Tensor::run_backward(&[loss], &[&x, &w, &b], false, create_graph);
        (grads, o1_weight_copies().unwrap().gradients_in_place - before)
    };
    // The first forward records that w and b are used once (they take casts now); the
    // activation's rounding node already rounds its gradient in place.
    let (_, first) = step(false);
    assert_eq!(first, 1, "the activation's gradient rounded in place");
    let (in_place, n) = step(false);
    assert_eq!(n, 3, "the activation's, w's and b's gradients rounded in place");
    let (fresh, n) = step(true);
    assert_eq!(n, 0, "a differentiable backward rounds into new tensors");
    for (i, (a, b)) in in_place.iter().zip(&fresh).enumerate() {
        assert!(same_bits(a, &b.detach()), "gradient {i}: in place and into a new tensor differ");
    }
    // The rounding did happen: the weight's gradient holds fp16 values, which its fp32 product
    // (the output's fp16 gradient times the fp16 activation) does not.
    let r = |t: &Tensor| t.to_kind(Kind::Half).to_kind(Kind::Float);
    let unrounded = r(&upstream).tr().matmul(&r(&(&x0 * 1.5)));
    assert!(same_bits(&in_place[1], &r(&in_place[1])));
    assert!(!same_bits(&unrounded, &r(&unrounded)), "the data must have gradients that fp16 rounds");
    assert!(same_bits(&in_place[1], &r(&unrounded)));
}
