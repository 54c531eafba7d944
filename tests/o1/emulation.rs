//! CPU low-precision emulation's numerical contract: an emulated fp16/bf16 GEMM or convolution
//! equals the fp32 op on the (already rounded) inputs, rounded once to the low dtype, exactly;
//! it is within one ulp of libtorch's native fp16 kernel elementwise (any kernel accumulating in
//! fp32 is); backward has the same rounding points. Small sizes: on CPUs without fp16 units
//! native fp16 GEMMs run generic loops many times slower than fp32.

use crate::common::*;
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use tch_amp::cast::CastSettings;
use tch_amp::cast::{install_policy, PolicyHandle};
use tch_amp::{CastPolicy, CpuKernels};

/// Emulation forced on, whatever this CPU's `Auto` choice.
fn emulated() -> CastSettings {
    CastSettings::default().cpu_kernels(CpuKernels::Emulate)
}

fn emulation_only() -> PolicyHandle {
    install_policy(CastPolicy::emulation_only(), emulated()).unwrap()
}

/// `f` on fp32 copies of the inputs, rounded to `kind`: the contract's right-hand side.
fn reference(kind: Kind, inputs: &[&Tensor], f: &dyn Fn(&[Tensor]) -> Tensor) -> Tensor {
    let up: Vec<Tensor> = inputs.iter().map(|t| t.to_kind(Kind::Float)).collect();
    f(&up).to_kind(kind)
}

fn assert_bitwise_eq(a: &Tensor, b: &Tensor, what: &str) {
    assert_eq!(a.kind(), b.kind(), "{what}");
    assert_eq!(a.size(), b.size(), "{what}");
    let (a, b) = (a.view_dtype(Kind::Int16), b.view_dtype(Kind::Int16));
    let (a, b) = (Vec::<i16>::try_from(a.flatten(0, -1)).unwrap(), Vec::<i16>::try_from(b.flatten(0, -1)).unwrap());
    let differing = a.iter().zip(&b).filter(|(x, y)| x != y).count();
    assert_eq!(differing, 0, "{what}: {differing} of {} elements differ", a.len());
}

/// One unit in the last place of each element of a 16-bit float tensor, in f64.
fn ulp(t: &Tensor) -> Tensor {
    let (min_normal_exp, mantissa_bits) = if t.kind() == Kind::Half { (-14.0, 10.0) } else { (-126.0, 7.0) };
    let exponent = t.to_kind(Kind::Double).abs().log2().floor().clamp_min(min_normal_exp);
    (exponent - mantissa_bits).exp2()
}

/// Elementwise: `a` and `b` (two roundings of fp32 accumulations of the same products, in
/// different orders) differ by at most one ulp of the larger, plus what fp32 summation order
/// can change: 2 K 2^-24 sum|terms| (`abs_terms` is the op on the inputs' absolute values, in
/// f64; K bounds the number of accumulated terms). Where results cancel to almost nothing,
/// fp32 order alone can move them by several of their own (tiny) ulps.
fn assert_within_one_ulp_up_to_fp32_order(a: &Tensor, b: &Tensor, abs_terms: &Tensor, what: &str) {
    const K: f64 = 256.0;
    let diff = (a.to_kind(Kind::Double) - b.to_kind(Kind::Double)).abs();
    let larger = a.abs().maximum(&b.abs());
    let allowed = ulp(&larger) + abs_terms * (2.0 * K * 2f64.powi(-24));
    let excess = f64::try_from((diff - allowed).max()).unwrap();
    assert!(excess <= 0.0, "{what}: beyond one ulp + fp32 order by {excess}");
}

/// Deterministic, well-spread test values (tests share libtorch's global RNG across threads).
fn det(shape: &[i64], salt: f64) -> Tensor {
    let n: i64 = shape.iter().product();
    (Tensor::arange(n, (Kind::Double, Device::Cpu)) * 0.7548776662466927 + salt).sin().to_kind(Kind::Float).view(shape)
        * 2.0
}

type Op = Box<dyn Fn(&[Tensor]) -> Tensor>;

/// The ops of `opt_levels/emulate_cpu.toml`, with small fp32 inputs.
fn cases() -> Vec<(&'static str, Vec<Tensor>, Op)> {
    let salt = std::cell::Cell::new(0.0);
    let r = |shape: &[i64]| {
        salt.set(salt.get() + 0.37);
        det(shape, salt.get())
    };
    vec![
        ("mm", vec![r(&[24, 32]), r(&[32, 16])], Box::new(|t| t[0].mm(&t[1]))),
        ("addmm", vec![r(&[16]), r(&[24, 32]), r(&[32, 16])], Box::new(|t| t[0].addmm(&t[1], &t[2]))),
        ("bmm", vec![r(&[3, 8, 16]), r(&[3, 16, 8])], Box::new(|t| t[0].bmm(&t[1]))),
        (
            "baddbmm",
            vec![r(&[3, 8, 8]), r(&[3, 8, 16]), r(&[3, 16, 8])],
            Box::new(|t| t[0].baddbmm(&t[1], &t[2], 1.0, 1.0)),
        ),
        ("matmul", vec![r(&[2, 3, 16]), r(&[16, 8])], Box::new(|t| t[0].matmul(&t[1]))),
        ("linear", vec![r(&[5, 16]), r(&[8, 16]), r(&[8])], Box::new(|t| t[0].linear(&t[1], Some(&t[2])))),
        ("mv", vec![r(&[8, 16]), r(&[16])], Box::new(|t| t[0].mv(&t[1]))),
        ("addmv", vec![r(&[8]), r(&[8, 16]), r(&[16])], Box::new(|t| t[0].addmv(&t[1], &t[2]))),
        ("addr", vec![r(&[8, 4]), r(&[8]), r(&[4])], Box::new(|t| t[0].addr(&t[1], &t[2]))),
        ("dot", vec![r(&[64]), r(&[64])], Box::new(|t| t[0].dot(&t[1]))),
        (
            "conv2d",
            vec![r(&[2, 3, 8, 8]), r(&[4, 3, 3, 3]), r(&[4])],
            Box::new(|t| t[0].conv2d(&t[1], Some(&t[2]), [1, 1], [1, 1], [1, 1], 1)),
        ),
        (
            "conv_transpose2d",
            vec![r(&[2, 4, 5, 5]), r(&[4, 3, 3, 3])],
            Box::new(|t| t[0].conv_transpose2d(&t[1], None::<Tensor>, [2, 2], [1, 1], [0, 0], 1, [1, 1])),
        ),
        (
            "conv1d",
            vec![r(&[2, 3, 16]), r(&[4, 3, 5])],
            Box::new(|t| t[0].conv1d(&t[1], None::<Tensor>, [1], [2], [1], 1)),
        ),
    ]
}

#[test]
fn emulated_ops_equal_fp32_compute_of_the_rounded_inputs_rounded() {
    let handle = emulation_only();
    for kind in [Kind::Half, Kind::BFloat16] {
        for (name, inputs, op) in cases() {
            let low: Vec<Tensor> = inputs.iter().map(|t| t.to_kind(kind)).collect();
            let before = tch_amp::diagnostics::emulated_op_count(kind).unwrap();
            let emulated = handle.run(Device::Cpu, || op(&low)).unwrap();
            let count = tch_amp::diagnostics::emulated_op_count(kind).unwrap() - before;
            assert!(count >= 1, "{name} {kind:?}: the emulation did not run");
            let expected = reference(kind, &low.iter().collect::<Vec<_>>(), &*op);
            assert_bitwise_eq(&emulated, &expected, &format!("{name} {kind:?}"));
            let native = op(&low);
            let abs_terms = op(&low.iter().map(|t| t.to_kind(Kind::Double).abs()).collect::<Vec<_>>());
            if matches!(name, "addr" | "conv_transpose2d") {
                // What libtorch's native addr and conv_transpose2d do depends on the CPU: oneDNN's
                // kernels (bf16 units) accumulate in fp32, the generic ones round intermediates
                // (the outer product; the columns before col2im) in low precision, several ulps
                // from the emulation. Either way the emulation is within one ulp (up to fp32
                // order) of native, or at least as accurate.
                let exact = op(&low.iter().map(|t| t.to_kind(Kind::Double)).collect::<Vec<_>>());
                let err = |t: &Tensor| f64::try_from((t.to_kind(Kind::Double) - &exact).abs().max()).unwrap();
                let (emulated_err, native_err) = (err(&emulated), err(&native));
                if emulated_err <= native_err * 1.0001 {
                    eprintln!("{name} {kind:?}: native max error {native_err:e}, emulated {emulated_err:e}");
                } else {
                    eprintln!("{name} {kind:?}: native more accurate here; checking it accumulates in fp32");
                    assert_within_one_ulp_up_to_fp32_order(&emulated, &native, &abs_terms, &format!("{name} {kind:?}"));
                }
            } else {
                // The native kernel accumulates in fp32 too, in another order.
                assert_within_one_ulp_up_to_fp32_order(&emulated, &native, &abs_terms, &format!("{name} {kind:?}"));
            }
        }
    }
}

#[test]
fn emulated_mm_is_within_one_ulp_of_the_native_fp16_kernel_at_a_larger_size() {
    let handle = emulation_only();
    let a = det(&[96, 128], 0.1).to_kind(Kind::Half);
    let b = det(&[128, 80], 0.2).to_kind(Kind::Half);
    let emulated = handle.run(Device::Cpu, || a.mm(&b)).unwrap();
    let native = a.mm(&b);
    let abs_terms = a.to_kind(Kind::Double).abs().mm(&b.to_kind(Kind::Double).abs());
    assert_within_one_ulp_up_to_fp32_order(&emulated, &native, &abs_terms, "mm 96x128x80");
    // Away from cancellation (results above 1/8 of their terms' magnitude) that is one ulp.
    let differs = (emulated.to_kind(Kind::Double) - native.to_kind(Kind::Double)).abs();
    let clear = emulated.to_kind(Kind::Double).abs().gt_tensor(&(&abs_terms * 0.125));
    let beyond = differs.gt_tensor(&ulp(&emulated.abs().maximum(&native.abs()))).logical_and(&clear);
    assert_eq!(i64::try_from(beyond.sum(Kind::Int64)).unwrap(), 0);
    assert_bitwise_eq(&emulated, &a.to_kind(Kind::Float).mm(&b.to_kind(Kind::Float)).to_kind(Kind::Half), "mm");
}

#[test]
fn backward_has_the_same_rounding_points() {
    let handle = emulation_only();
    for backward_inside in [false, true] {
        let a = leaf(&[12, 16], Kind::Half);
        let b = leaf(&[16, 8], Kind::Half);
        let upstream = randn(&[12, 8], Kind::Half);
        let active = handle.activate(Device::Cpu).unwrap();
        let y = a.mm(&b);
        assert_eq!(y.kind(), Kind::Half);
        let loss = (y.to_kind(Kind::Float) * upstream.to_kind(Kind::Float)).sum(None::<Kind>);
        if !backward_inside {
            drop(active);
            loss.backward();
        } else {
            loss.backward();
            drop(active);
        }
        // fp16 grads, each the fp32 product of fp16 values rounded once: as a Tensor-Core GEMM.
        let (g, a32, b32) = (upstream.to_kind(Kind::Float), a.to_kind(Kind::Float), b.to_kind(Kind::Float));
        assert_bitwise_eq(&a.grad(), &g.mm(&b32.tr()).to_kind(Kind::Half), "grad of a");
        assert_bitwise_eq(&b.grad(), &a32.tr().mm(&g).to_kind(Kind::Half), "grad of b");
    }
}

#[test]
fn o1_linear_is_emulated_after_the_policys_cast() {
    let vs = nn::VarStore::new(Device::Cpu);
    let m = nn::linear(vs.root(), 32, 16, Default::default());
    let x = randn(&[8, 32], Kind::Float);
    let y = apex_with(emulated()).run(Device::Cpu, || m.forward(&x)).unwrap();
    let h = |t: &Tensor| t.to_kind(Kind::Half);
    let expected =
        reference(Kind::Half, &[&h(&x), &h(&m.ws), &h(m.bs.as_ref().unwrap())], &|t| t[0].linear(&t[1], Some(&t[2])));
    assert_bitwise_eq(&y, &expected, "O1 linear");
    // Emulation off: libtorch's native fp16 kernel, bit for bit.
    let native =
        apex_with(CastSettings::default().cpu_kernels(CpuKernels::Native)).run(Device::Cpu, || m.forward(&x)).unwrap();
    let direct = h(&x).linear(&h(&m.ws), Some(&h(m.bs.as_ref().unwrap())));
    assert_bitwise_eq(&native, &direct, "native O1 linear");
}

#[test]
fn emulation_only_leaves_everything_else_alone() {
    let handle = emulation_only();
    let _active = on_cpu(&handle);
    let xh = randn(&[4, 8], Kind::Half);
    let xf = randn(&[4, 8], Kind::Float);
    assert_eq!(xh.softmax(-1, None::<Kind>).kind(), Kind::Half);
    assert_eq!(xh.exp().kind(), Kind::Half);
    assert_eq!(xh.mse_loss(&xh, tch::Reduction::Mean).kind(), Kind::Half, "no libtorch fp32 cast either");
    assert_eq!(Tensor::cat(&[&xh, &xf], 0).kind(), Kind::Float, "type promotion, no cast");
    // fp32 GEMMs are untouched.
    assert_eq!(xf.mm(&xf.tr()).kind(), Kind::Float);
    let plain = tch_amp::without_casts(|| xf.mm(&xf.tr())).unwrap();
    assert_eq!(to_vec(&xf.mm(&xf.tr())), to_vec(&plain));
    // Mixed fp16/fp32 inputs reach the native kernel and its error.
    assert!(xh.f_mm(&xf.tr()).is_err());
}

#[test]
fn an_o2_style_half_model_runs_emulated() {
    let mut vs = nn::VarStore::new(Device::Cpu);
    let model = nn::seq()
        .add(nn::linear(vs.root() / "l1", 16, 32, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(vs.root() / "l2", 32, 4, Default::default()));
    vs.half();
    let x = randn(&[8, 16], Kind::Half);
    let handle = emulation_only();
    let y = handle.run(Device::Cpu, || model.forward(&x)).unwrap();
    assert_eq!(y.kind(), Kind::Half);
    let native = model.forward(&x);
    let close = f64::try_from((y.to_kind(Kind::Double) - native.to_kind(Kind::Double)).abs().max()).unwrap();
    assert!(close < 0.01, "two fp16 layers, emulated vs native: {close}");
    y.to_kind(Kind::Float).sum(None::<Kind>).backward();
    for v in vs.trainable_variables() {
        assert_eq!(v.grad().kind(), Kind::Half);
    }
    // An RNN cell in fp16 (a composite): its GEMMs are emulated, its output stays fp16.
    let w = randn(&[64, 16], Kind::Half);
    let h0 = randn(&[8, 16], Kind::Half);
    let (h1, _) =
        handle.run(Device::Cpu, || x.lstm_cell(&[&h0, &h0], &w, &w, None::<&Tensor>, None::<&Tensor>)).unwrap();
    assert_eq!(h1.kind(), Kind::Half);
}

/// The numerical contract holds whichever kernels run: on the CPU the tests run on, libtorch's
/// native fp16 and bf16 GEMMs and convolutions (oneDNN with AMX/AVX512_BF16/AVX512_FP16 where
/// the CPU has them, libtorch's generic loops elsewhere) and the emulation give, forward and
/// backward, results within one ulp of each other up to fp32 summation order, so `Auto` may
/// pick either without changing what training computes beyond the last bit.
#[test]
fn native_and_emulated_kernels_agree_forward_and_backward_on_this_cpu() {
    let emulate = emulation_only();
    type Fwd = Box<dyn Fn(&Tensor, &Tensor) -> Tensor>;
    let cases: Vec<(&str, [i64; 2], [i64; 2], Fwd)> = vec![
        ("mm 64x96x48", [64, 96], [96, 48], Box::new(|a, b| a.mm(b))),
        ("linear 32x80->40", [32, 80], [40, 80], Box::new(|a, b| a.linear(b, None::<Tensor>))),
    ];
    for kind in [Kind::Half, Kind::BFloat16] {
        let run =
            |native: bool, f: &dyn Fn() -> Tensor| if native { f() } else { emulate.run(Device::Cpu, f).unwrap() };
        for (name, sa, sb, op) in &cases {
            let mut results = Vec::new();
            for native in [true, false] {
                let a = det(sa, 0.3).to_kind(kind).set_requires_grad(true);
                let b = det(sb, 0.9).to_kind(kind).set_requires_grad(true);
                let y = run(native, &|| op(&a, &b));
                assert_eq!(y.kind(), kind);
                let upstream = det(&y.size(), 1.7).to_kind(kind);
                (y.to_kind(Kind::Float) * upstream.to_kind(Kind::Float)).sum(None::<Kind>).backward();
                results.push((y.detach(), a.grad(), b.grad(), a.detach(), b.detach(), upstream));
            }
            let (native, emulated) = (&results[0], &results[1]);
            let d = |t: &Tensor| t.to_kind(Kind::Double).abs();
            let (a, b, g) = (d(&native.3), d(&native.4), d(&native.5));
            let (fwd_terms, ga_terms, gb_terms) = if name.starts_with("mm") {
                (a.mm(&b), g.mm(&b.tr()), a.tr().mm(&g))
            } else {
                (a.mm(&b.tr()), g.mm(&b), g.tr().mm(&a))
            };
            let what = |part: &str| format!("{name} {kind:?} {part}");
            assert_within_one_ulp_up_to_fp32_order(&emulated.0, &native.0, &fwd_terms, &what("output"));
            assert_within_one_ulp_up_to_fp32_order(&emulated.1, &native.1, &ga_terms, &what("grad of a"));
            assert_within_one_ulp_up_to_fp32_order(&emulated.2, &native.2, &gb_terms, &what("grad of b"));
        }
        // A convolution with its weight gradient (the main job's CNN is convolution-bound).
        let mut results = Vec::new();
        for native in [true, false] {
            let x = det(&[4, 8, 12, 12], 0.2).to_kind(kind).set_requires_grad(true);
            let w = (det(&[16, 8, 3, 3], 0.5) * 0.3).to_kind(kind).set_requires_grad(true);
            let y = run(native, &|| x.conv2d(&w, None::<Tensor>, [1, 1], [1, 1], [1, 1], 1));
            assert_eq!(y.kind(), kind);
            y.to_kind(Kind::Float).sum(None::<Kind>).backward();
            results.push((y.detach(), w.grad(), x.detach(), w.detach()));
        }
        let (native, emulated) = (&results[0], &results[1]);
        let (x, w) = (native.2.to_kind(Kind::Double).abs(), native.3.to_kind(Kind::Double).abs());
        let terms = x.conv2d(&w, None::<Tensor>, [1, 1], [1, 1], [1, 1], 1);
        assert_within_one_ulp_up_to_fp32_order(&emulated.0, &native.0, &terms, &format!("conv2d {kind:?} output"));
        // dL/dw[o, c, i, j] sums x[n, c, ...] over the batch and the positions of a window
        // (the upstream gradient is 1): bounded by the sum of |x| over channel c.
        let per_channel = x.sum_dim_intlist(&[0i64, 2, 3][..], false, None::<Kind>).view([1, -1, 1, 1]);
        let gw_terms = per_channel.expand(native.1.size(), false);
        assert_within_one_ulp_up_to_fp32_order(&emulated.1, &native.1, &gw_terms, &format!("conv2d {kind:?} dW"));
    }
}

/// O1 with emulation turns each fp32 activation of a low-precision-list op into the fp32 tensor
/// of its rounded values in one pass; weights keep one cached `low` copy per forward, which
/// every use converts to fp32, so that their gradients add up in `low` (as under Apex). Forward
/// and every gradient must equal those casts written out (`to(low)`, then `to(fp32)`) bit for
/// bit, for fp16 and bf16, with values beyond fp16's range (inf after rounding), subnormals,
/// weights and an activation each used twice, and gradients that overflow fp16.
#[test]
fn o1_fp32_arguments_round_once_forward_and_backward_as_the_cast_pair() {
    for low in [Kind::Half, Kind::BFloat16] {
        let settings = emulated().low_precision_dtype(low);
        // Values: ordinary, near fp16's max, fp16 subnormals, exact ties; a bias above fp16's
        // max (inf once rounded).
        let special = Tensor::from_slice(&[1.0f32, 6e4, -5e4, 3e-6, -4e-7, 1.0 + 2f32.powi(-11), 2049.0, 0.1]);
        let x0 = Tensor::cat(&[det(&[3, 8], 0.3).view([-1]), special.shallow_clone() * 0.03], 0).view([4, 8]);
        let w0 = Tensor::cat(&[det(&[5, 8], 1.1).view([-1]), special.shallow_clone()], 0).view([6, 8]);
        let b0 = det(&[6], 2.0) + Tensor::from_slice(&[0.0f32, 0.0, 7e4, 0.0, 0.0, 0.0]);
        let upstream = det(&[4, 6], 0.9) * 3e3;
        let run = |through_policy: bool| -> Vec<Tensor> {
            let (x, w, b) = (
                x0.copy().set_requires_grad(true),
                w0.copy().set_requires_grad(true),
                b0.copy().set_requires_grad(true),
            );
            let out = if through_policy {
                let handle = apex_with(settings);
                handle
                    .run(Device::Cpu, || {
                        // `a` is an activation (not a leaf); `w` is used twice: the second time
                        // from the cast cache.
                        let a = &x * 1.5;
                        let y = a.linear(&w, Some(&b));
                        let z = a.linear(&w, None::<&Tensor>);
                        (y, z)
                    })
                    .unwrap()
            } else {
                let up = |t: &Tensor| t.to_kind(Kind::Float);
                // One `low` copy of each weight for the whole forward; activations per use.
                let (w16, b16) = (w.to_kind(low), b.to_kind(low));
                let a = &x * 1.5;
                let y = up(&a.to_kind(low)).linear(&up(&w16), Some(&up(&b16))).to_kind(low);
                let z = up(&a.to_kind(low)).linear(&up(&w16), None::<&Tensor>).to_kind(low);
                (y, z)
            };
            let (y, z) = out;
            assert_eq!(y.kind(), low);
            let loss = ((y.to_kind(Kind::Float) + z.to_kind(Kind::Float)) * &upstream).sum(Kind::Float);
            loss.backward();
            vec![y, z, x.grad(), w.grad(), b.grad()]
        };
        let (got, want) = (run(true), run(false));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let what = format!("{low:?} {}", ["y", "z", "grad x", "grad w", "grad b"][i]);
            assert_eq!(g.kind(), w.kind(), "{what}");
            // Same bits, NaN for NaN (a NaN's payload is not part of the contract).
            let bits = |t: &Tensor| t.view_dtype(if t.kind() == Kind::Float { Kind::Int } else { Kind::Int16 });
            let both_nan = g.isnan().logical_and(&w.isnan());
            let same = bits(g).eq_tensor(&bits(w)).logical_or(&both_nan);
            assert!(same.all().int64_value(&[]) == 1, "{what} differs from the cast pair");
        }
        // Some gradient overflowed fp16 (inf), as the pair's does.
        if low == Kind::Half {
            assert!(got[3].isinf().any().int64_value(&[]) == 1 || got[2].isinf().any().int64_value(&[]) == 1);
        }
    }
}
