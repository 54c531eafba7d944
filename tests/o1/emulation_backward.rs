//! What the CPU emulation keeps for backward, and the operation classes: an emulated GEMM or
//! convolution keeps its 16-bit inputs, as libtorch's native 16-bit kernel does, not fp32
//! copies (counted with tch-amp's counting allocator, in a child process so that no other test
//! allocates meanwhile); emulated attention equals fp32 attention on the rounded inputs, rounded
//! once, forward and backward; double backward, a retained graph and dropout keep the rounding
//! points; each class follows its own setting. No expectation depends on the CPU kind: the
//! emulation is observed through its counter, and native kernels only through bytes.

use crate::common::*;
use tch::{Device, Kind, Tensor};
use tch_amp::cast::{install_policy, CastSettings, PolicyHandle};
use tch_amp::diagnostics::{cpu_memory, emulated_op_count, track_cpu_memory};
use tch_amp::Autocast;
use tch_amp::{CastPolicy, CpuKernels, OpClass};

fn emulation_only(settings: CastSettings) -> PolicyHandle {
    install_policy(CastPolicy::emulation_only(), settings).unwrap()
}

fn emulate_all() -> CastSettings {
    CastSettings::default().cpu_kernels(CpuKernels::Emulate)
}

/// Deterministic values in [-2, 2].
fn det(shape: &[i64], salt: f64) -> Tensor {
    let n: i64 = shape.iter().product();
    (Tensor::arange(n, (Kind::Double, Device::Cpu)) * 0.7548776662466927 + salt).sin().to_kind(Kind::Float).view(shape)
        * 2.0
}

/// A 16-bit activation: not a leaf (a model weight would be), requires grad.
fn activation(shape: &[i64], salt: f64, kind: Kind) -> Tensor {
    det(shape, salt).set_requires_grad(true).to_kind(kind)
}

fn bits_equal(a: &Tensor, b: &Tensor, what: &str) {
    assert_eq!((a.kind(), a.size()), (b.kind(), b.size()), "{what}");
    let int = if a.kind() == Kind::Float { Kind::Int } else { Kind::Int16 };
    let differing = a.view_dtype(int).ne_tensor(&b.view_dtype(int)).sum(Kind::Int64).int64_value(&[]);
    assert_eq!(differing, 0, "{what}: {differing} elements differ");
}

/// `f`'s result and how many ops the engine emulated in `kind` on this thread meanwhile.
fn counting<T>(kind: Kind, f: impl FnOnce() -> T) -> (T, u64) {
    let before = emulated_op_count(kind).unwrap();
    let out = f();
    (out, emulated_op_count(kind).unwrap() - before)
}

type Op = Box<dyn Fn(&[Tensor]) -> Tensor>;

/// Ops of the GEMM and convolution classes with the shapes of small layers.
fn layer_ops() -> Vec<(&'static str, Vec<Vec<i64>>, Op)> {
    vec![
        ("mm", vec![vec![64, 96], vec![96, 80]], Box::new(|t| t[0].mm(&t[1]))),
        ("linear 3d", vec![vec![4, 16, 64], vec![48, 64], vec![48]], Box::new(|t| t[0].linear(&t[1], Some(&t[2])))),
        ("bmm", vec![vec![6, 32, 24], vec![6, 24, 40]], Box::new(|t| t[0].bmm(&t[1]))),
        ("matmul 4d", vec![vec![2, 3, 32, 16], vec![2, 3, 16, 32]], Box::new(|t| t[0].matmul(&t[1]))),
        (
            "conv2d",
            vec![vec![8, 16, 14, 14], vec![16, 16, 3, 3], vec![16]],
            Box::new(|t| t[0].conv2d(&t[1], Some(&t[2]), [1, 1], [1, 1], [1, 1], 1)),
        ),
    ]
}

/// An emulated GEMM or convolution leaves allocated after its forward what libtorch's native
/// 16-bit kernel leaves: its 16-bit output (the inputs were allocated before). Before, the fp32
/// copies of the inputs stayed for backward (3x the inputs' bytes here). Backward then gives the
/// bits of the casts written out.
#[test]
fn emulated_ops_keep_the_bytes_of_native_16_bit_ones_for_backward() {
    isolated("emulation_backward::emulated_ops_keep_the_bytes_of_native_16_bit_ones_for_backward", 300, || {
        track_cpu_memory().unwrap();
        let handle = emulation_only(emulate_all());
        for kind in [Kind::Half, Kind::BFloat16] {
            for (name, shapes, op) in layer_ops() {
                let inputs: Vec<Tensor> =
                    shapes.iter().enumerate().map(|(i, s)| activation(s, 0.3 * i as f64, kind)).collect();
                let kept = |emulated: bool| {
                    let before = cpu_memory().unwrap().current;
                    let (y, ops) = counting(kind, || {
                        if emulated {
                            handle.run(Device::Cpu, || op(&inputs)).unwrap()
                        } else {
                            op(&inputs)
                        }
                    });
                    assert_eq!(ops, u64::from(emulated), "{name} {kind:?}: the emulation ran iff asked");
                    let kept = cpu_memory().unwrap().current - before;
                    (y, kept)
                };
                let (y_native, native) = kept(false);
                let (y, emulated) = kept(true);
                let output = (y.numel() * 2) as i64;
                let inputs_fp32: i64 = inputs.iter().map(|t| (t.numel() * 4) as i64).sum();
                eprintln!(
                    "{name} {kind:?}: kept after forward: native {native} B, emulated {emulated} B \
                     (output {output} B; fp32 input copies would add {inputs_fp32} B)"
                );
                assert_eq!(emulated, native, "{name} {kind:?}: emulated keeps what native keeps");
                assert_eq!(emulated, output, "{name} {kind:?}: only the output");
                drop(y_native);
                // Backward: the rounding points of the casts written out.
                let upstream = det(&y.size(), 1.9).to_kind(kind);
                let grads =
                    |y: &Tensor| Tensor::run_backward(&[(y * &upstream).sum(Kind::Float)], &inputs, false, false);
                let got = grads(&y);
                let up: Vec<Tensor> =
                    inputs.iter().map(|t| t.detach().to_kind(Kind::Float).set_requires_grad(true)).collect();
                let reference = op(&up).to_kind(kind);
                let want = Tensor::run_backward(&[(&reference * &upstream).sum(Kind::Float)], &up, false, false);
                bits_equal(&y, &reference, &format!("{name} {kind:?} output"));
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    bits_equal(g, &w.to_kind(kind), &format!("{name} {kind:?} grad {i}"));
                }
            }
        }
    });
}

/// Every op of the emulation list that libtorch can differentiate (not `_addmm_activation`),
/// backward: each input's gradient is the fp32 op's gradient of the fp32-converted upstream
/// gradient, rounded once, bit for bit, with activations (non-leaf inputs) and with a 16-bit
/// leaf weight (the cast cache's shared copy).
#[test]
fn every_emulated_op_differentiates_as_the_casts_written_out() {
    let handle = emulation_only(emulate_all());
    let cases: Vec<(&str, Vec<Vec<i64>>, Op)> = vec![
        ("addmm", vec![vec![16], vec![24, 32], vec![32, 16]], Box::new(|t| t[0].addmm(&t[1], &t[2]))),
        (
            "baddbmm",
            vec![vec![3, 8, 8], vec![3, 8, 16], vec![3, 16, 8]],
            Box::new(|t| t[0].baddbmm(&t[1], &t[2], 0.5, 2.0)),
        ),
        ("addbmm", vec![vec![8, 8], vec![3, 8, 16], vec![3, 16, 8]], Box::new(|t| t[0].addbmm(&t[1], &t[2]))),
        ("matmul broadcast", vec![vec![2, 3, 16], vec![16, 8]], Box::new(|t| t[0].matmul(&t[1]))),
        ("matmul 1d", vec![vec![16], vec![4, 16, 8]], Box::new(|t| t[0].matmul(&t[1]))),
        ("linear", vec![vec![5, 16], vec![8, 16], vec![8]], Box::new(|t| t[0].linear(&t[1], Some(&t[2])))),
        ("linear no bias 3d", vec![vec![2, 5, 16], vec![8, 16]], Box::new(|t| t[0].linear(&t[1], None::<Tensor>))),
        ("mv", vec![vec![8, 16], vec![16]], Box::new(|t| t[0].mv(&t[1]))),
        ("addmv", vec![vec![8], vec![8, 16], vec![16]], Box::new(|t| t[0].addmv(&t[1], &t[2]))),
        ("addr", vec![vec![8, 4], vec![8], vec![4]], Box::new(|t| t[0].addr(&t[1], &t[2]))),
        ("dot", vec![vec![64], vec![64]], Box::new(|t| t[0].dot(&t[1]))),
        ("vdot", vec![vec![64], vec![64]], Box::new(|t| t[0].vdot(&t[1]))),
        (
            "conv1d",
            vec![vec![2, 3, 16], vec![4, 3, 5]],
            Box::new(|t| t[0].conv1d(&t[1], None::<Tensor>, [1], [2], [1], 1)),
        ),
        (
            "conv2d same, groups",
            vec![vec![2, 4, 7, 7], vec![6, 2, 3, 3], vec![6]],
            Box::new(|t| t[0].conv2d_padding(&t[1], Some(&t[2]), [1, 1], "same", [1, 1], 2)),
        ),
        (
            "conv3d",
            vec![vec![1, 2, 5, 5, 5], vec![3, 2, 3, 3, 3]],
            Box::new(|t| t[0].conv3d(&t[1], None::<Tensor>, [1, 1, 1], [1, 1, 1], [1, 1, 1], 1)),
        ),
        (
            "conv_transpose2d",
            vec![vec![2, 4, 5, 5], vec![4, 3, 3, 3], vec![3]],
            Box::new(|t| t[0].conv_transpose2d(&t[1], Some(&t[2]), [2, 2], [1, 1], [0, 0], 1, [1, 1])),
        ),
        ("conv_tbc", vec![vec![9, 2, 4], vec![3, 4, 5], vec![5]], Box::new(|t| t[0].conv_tbc(&t[1], &t[2], 1))),
    ];
    for kind in [Kind::Half, Kind::BFloat16] {
        for (name, shapes, op) in &cases {
            // All activations, then the second input a 16-bit leaf weight.
            for leaf_weight in [false, true] {
                let inputs: Vec<Tensor> = shapes
                    .iter()
                    .enumerate()
                    .map(|(i, s)| {
                        if leaf_weight && i == 1 {
                            det(s, 0.41 * i as f64).to_kind(kind).set_requires_grad(true)
                        } else {
                            activation(s, 0.41 * i as f64, kind)
                        }
                    })
                    .collect();
                let what = format!("{name} {kind:?}{}", if leaf_weight { " (leaf weight)" } else { "" });
                let (y, ops) = counting(kind, || handle.run(Device::Cpu, || op(&inputs)).unwrap());
                assert_eq!(ops, 1, "{what}: emulated");
                let upstream = det(&y.size(), 1.9).to_kind(kind);
                let active = handle.activate(Device::Cpu).unwrap();
                let got = Tensor::run_backward(&[(&y * &upstream).sum(Kind::Float)], &inputs, false, false);
                drop(active);
                let up: Vec<Tensor> =
                    inputs.iter().map(|t| t.detach().to_kind(Kind::Float).set_requires_grad(true)).collect();
                let reference = op(&up).to_kind(kind);
                bits_equal(&y, &reference, &format!("{what} output"));
                let want = Tensor::run_backward(&[(&reference * &upstream).sum(Kind::Float)], &up, false, false);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    bits_equal(g, &w.to_kind(kind), &format!("{what} grad {i}"));
                }
            }
        }
    }
}

/// A 16-bit model weight (a leaf, as O2's) gets one fp32 copy per forward from the cast cache,
/// shared by all its uses so that their gradients add up in fp32 before one rounding: the cache
/// holds it until the policy is left. Activations are kept in 16 bits.
#[test]
fn a_16_bit_weight_keeps_one_cached_fp32_copy_per_forward() {
    isolated("emulation_backward::a_16_bit_weight_keeps_one_cached_fp32_copy_per_forward", 300, || {
        track_cpu_memory().unwrap();
        let handle = emulation_only(emulate_all());
        let w = det(&[48, 64], 0.1).to_kind(Kind::Half).set_requires_grad(true);
        let x = activation(&[32, 64], 0.2, Kind::Half);
        let active = handle.activate(Device::Cpu).unwrap();
        let before = cpu_memory().unwrap().current;
        let y1 = x.linear(&w, None::<Tensor>);
        let y2 = x.linear(&w, None::<Tensor>);
        let kept = cpu_memory().unwrap().current - before;
        assert_eq!(kept, ((y1.numel() + y2.numel()) * 2 + w.numel() * 4) as i64, "outputs + one fp32 weight");
        (y1 + y2).to_kind(Kind::Float).sum(Kind::Float).backward();
        drop(active);
        // The two uses' fp32 gradients (equal here) added, then rounded once.
        let (x32, w32) = (x.detach().to_kind(Kind::Float), w.detach().to_kind(Kind::Float).set_requires_grad(true));
        let one_use = Tensor::run_backward(&[x32.linear(&w32, None::<Tensor>).sum(Kind::Float)], &[&w32], false, false);
        let want = (&one_use[0] + &one_use[0]).to_kind(Kind::Half);
        bits_equal(&w.grad(), &want, "grad of the shared weight");
    });
}

/// Emulated attention: the fp32 op on the rounded inputs, rounded once; gradients: the fp32
/// backward of the fp32-converted upstream gradient, each rounded once. With and without a
/// mask, causal or not, and the math path called directly.
#[test]
fn emulated_attention_is_fp32_attention_of_the_rounded_inputs_rounded_once() {
    let handle = emulation_only(emulate_all());
    let (b, h, l, e) = (2, 3, 10, 8);
    let mask = det(&[l, l], 0.7).ge(0.0).logical_or(&Tensor::eye(l, (Kind::Bool, Device::Cpu)));
    type Attn = Box<dyn Fn(&Tensor, &Tensor, &Tensor) -> Tensor>;
    let cases: Vec<(&str, Attn)> = vec![
        (
            "sdpa",
            Box::new(|q, k, v| Tensor::scaled_dot_product_attention(q, k, v, None::<Tensor>, 0.0, false, None, false)),
        ),
        (
            "sdpa causal",
            Box::new(|q, k, v| Tensor::scaled_dot_product_attention(q, k, v, None::<Tensor>, 0.0, true, None, false)),
        ),
        (
            "sdpa bool mask, scale",
            Box::new(move |q, k, v| Tensor::scaled_dot_product_attention(q, k, v, Some(&mask), 0.0, false, 0.3, false)),
        ),
        (
            "math path",
            Box::new(|q, k, v| {
                Tensor::internal_scaled_dot_product_attention_math(
                    q,
                    k,
                    v,
                    None::<Tensor>,
                    0.0,
                    false,
                    None::<Tensor>,
                    None,
                    false,
                )
                .0
            }),
        ),
    ];
    for kind in [Kind::Half, Kind::BFloat16] {
        for (name, attn) in &cases {
            let (q, k, v) = (
                activation(&[b, h, l, e], 0.1, kind),
                activation(&[b, h, l, e], 0.5, kind),
                activation(&[b, h, l, e], 0.9, kind),
            );
            let (y, ops) = counting(kind, || handle.run(Device::Cpu, || attn(&q, &k, &v)).unwrap());
            assert_eq!(ops, 1, "{name} {kind:?}: emulated as one op");
            let upstream = det(&y.size(), 1.3).to_kind(kind);
            let got = Tensor::run_backward(&[(&y * &upstream).sum(Kind::Float)], &[&q, &k, &v], false, false);
            let up: Vec<Tensor> =
                [&q, &k, &v].iter().map(|t| t.detach().to_kind(Kind::Float).set_requires_grad(true)).collect();
            let reference = attn(&up[0], &up[1], &up[2]).to_kind(kind);
            bits_equal(&y, &reference, &format!("{name} {kind:?} output"));
            let want = Tensor::run_backward(&[(&reference * &upstream).sum(Kind::Float)], &up, false, false);
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                bits_equal(g, &w.to_kind(kind), &format!("{name} {kind:?} grad {}", ["q", "k", "v"][i]));
            }
        }
    }
}

/// Attention with dropout draws its mask once, in the forward: backward differentiates that
/// draw (it replays the forward's graph rather than recomputing). Same seed, same bits as the
/// fp32 op on the rounded inputs.
#[test]
fn emulated_attention_with_dropout_differentiates_the_forwards_draw() {
    isolated("emulation_backward::emulated_attention_with_dropout_differentiates_the_forwards_draw", 300, || {
        let handle = emulation_only(emulate_all());
        let kind = Kind::BFloat16;
        let (q, k, v) = (
            activation(&[2, 2, 12, 8], 0.1, kind),
            activation(&[2, 2, 12, 8], 0.4, kind),
            activation(&[2, 2, 12, 8], 0.8, kind),
        );
        let attn = |q: &Tensor, k: &Tensor, v: &Tensor| {
            Tensor::scaled_dot_product_attention(q, k, v, None::<Tensor>, 0.3, false, None, false)
        };
        tch::manual_seed(11);
        let (y, ops) = counting(kind, || handle.run(Device::Cpu, || attn(&q, &k, &v)).unwrap());
        assert_eq!(ops, 1);
        let got = Tensor::run_backward(&[y.to_kind(Kind::Float).sum(Kind::Float)], &[&q, &k, &v], false, false);
        let up: Vec<Tensor> =
            [&q, &k, &v].iter().map(|t| t.detach().to_kind(Kind::Float).set_requires_grad(true)).collect();
        tch::manual_seed(11);
        let reference = attn(&up[0], &up[1], &up[2]).to_kind(kind);
        bits_equal(&y, &reference, "output");
        let without =
            Tensor::scaled_dot_product_attention(&up[0], &up[1], &up[2], None::<Tensor>, 0.0, false, None, false);
        assert!(!without.to_kind(kind).equal(&y), "dropout dropped something");
        let want = Tensor::run_backward(&[reference.to_kind(Kind::Float).sum(Kind::Float)], &up, false, false);
        for (g, w) in got.iter().zip(&want) {
            bits_equal(g, &w.to_kind(kind), "grad");
        }
    });
}

/// Double backward (a gradient penalty, create_graph) through emulated ops of each backward
/// kind (a replayed GEMM, a recomputed matmul and attention) gives the bits of the casts written
/// out; so does a backward run twice on a retained graph, and a third run without it fails.
#[test]
fn double_backward_and_retained_graphs_keep_the_rounding_points() {
    let handle = emulation_only(emulate_all());
    let kind = Kind::Half;
    type Net = Box<dyn Fn(&Tensor, &Tensor) -> Tensor>;
    let nets: Vec<(&str, Net)> = vec![
        ("mm", Box::new(|x, w| x.mm(w).tanh().mm(&w.tr()))),
        ("matmul", Box::new(|x, w| x.matmul(w).tanh().matmul(&w.tr()))),
        (
            "attention",
            Box::new(|x, w| {
                let q = x.mm(w).view([2, 4, 8]);
                Tensor::scaled_dot_product_attention(&q, &q, &q, None::<Tensor>, 0.0, false, None, false).view([8, 8])
            }),
        ),
    ];
    for (name, net) in &nets {
        let run = |emulated: bool| -> Vec<Tensor> {
            let x0 = det(&[8, 12], 0.2).set_requires_grad(true);
            let w0 = det(&[12, 8], 0.6).set_requires_grad(true);
            let (x, w) = (x0.to_kind(kind), w0.to_kind(kind));
            let forward = |x: &Tensor, w: &Tensor| -> Tensor {
                if emulated {
                    handle.run(Device::Cpu, || net(x, w)).unwrap()
                } else {
                    // The casts written out, op by op, as the emulation contract states them.
                    let up = |t: &Tensor| t.to_kind(Kind::Float);
                    match *name {
                        "mm" => up(&up(x).mm(&up(w)).to_kind(kind).tanh()).mm(&up(&w.tr())).to_kind(kind),
                        "matmul" => up(&up(x).matmul(&up(w)).to_kind(kind).tanh()).matmul(&up(&w.tr())).to_kind(kind),
                        _ => {
                            let q = up(x).mm(&up(w)).to_kind(kind).view([2, 4, 8]);
                            let (q32, k32, v32) = (up(&q), up(&q), up(&q));
                            Tensor::scaled_dot_product_attention(
                                &q32,
                                &k32,
                                &v32,
                                None::<Tensor>,
                                0.0,
                                false,
                                None,
                                false,
                            )
                            .to_kind(kind)
                            .view([8, 8])
                        }
                    }
                }
            };
            let y = forward(&x, &w);
            let loss = y.to_kind(Kind::Float).square().sum(Kind::Float);
            let g = Tensor::run_backward(&[&loss], &[&w0], true, true).pop().unwrap();
            let penalty = g.square().sum(Kind::Float);
            let (g2x, g2w) = {
                let r = Tensor::run_backward(&[&penalty], &[&x0, &w0], true, false);
                (r[0].shallow_clone(), r[1].shallow_clone())
            };
            // Twice on a retained graph: the same gradients again.
            let again = Tensor::run_backward(&[&loss], &[&x0], true, false).pop().unwrap();
            let twice = Tensor::run_backward(&[&loss], &[&x0], false, false).pop().unwrap();
            assert!(Tensor::f_run_backward(&[&loss], &[&x0], false, false).is_err(), "{name}: the graph was freed");
            vec![y, g, g2x, g2w, again, twice]
        };
        let (got, want) = (run(true), run(false));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            bits_equal(
                g,
                w,
                &format!("{name} {}", ["y", "grad w", "d penalty/dx", "d penalty/dw", "grad x", "grad x again"][i]),
            );
        }
    }
}

/// Each class follows its own setting, through the Apex path's policy and through torch.amp's
/// autocast: emulating one class leaves the others to libtorch's kernels.
#[test]
fn each_class_follows_its_own_setting() {
    let kind = Kind::BFloat16;
    let x = activation(&[2, 4, 6, 6], 0.1, kind);
    let w = activation(&[4, 4, 3, 3], 0.2, kind);
    let (a, bm) = (activation(&[8, 12], 0.3, kind), activation(&[12, 8], 0.4, kind));
    let q = activation(&[1, 2, 6, 8], 0.5, kind);
    let conv = || x.conv2d(&w, None::<Tensor>, [1, 1], [1, 1], [1, 1], 1);
    let gemm = || a.mm(&bm);
    let attn = || Tensor::scaled_dot_product_attention(&q, &q, &q, None::<Tensor>, 0.0, false, None, false);
    for class in OpClass::ALL {
        let settings =
            CastSettings::default().cpu_kernels(CpuKernels::Native).cpu_kernels_class(class, CpuKernels::Emulate);
        let handle = emulation_only(settings);
        let counts: Vec<u64> = [&conv as &dyn Fn() -> Tensor, &gemm, &attn]
            .iter()
            .map(|f| counting(kind, || handle.run(Device::Cpu, f).unwrap()).1)
            .collect();
        let want: Vec<u64> =
            [OpClass::Convolution, OpClass::Gemm, OpClass::Attention].iter().map(|c| u64::from(*c == class)).collect();
        assert_eq!(counts, want, "Apex path, only {class} emulated");
        let autocast = Autocast::new(Device::Cpu)
            .dtype(kind)
            .cpu_kernels(CpuKernels::Native)
            .cpu_kernels_class(class, CpuKernels::Emulate);
        let fp32 = |t: &Tensor| t.detach().to_kind(Kind::Float);
        let (x32, w32, a32, b32, q32) = (fp32(&x), fp32(&w), fp32(&a), fp32(&bm), fp32(&q));
        let counts: Vec<u64> = [
            Box::new(|| x32.conv2d(&w32, None::<Tensor>, [1, 1], [1, 1], [1, 1], 1)) as Box<dyn Fn() -> Tensor>,
            Box::new(|| a32.mm(&b32)),
            Box::new(|| {
                Tensor::scaled_dot_product_attention(&q32, &q32, &q32, None::<Tensor>, 0.0, false, None, false)
            }),
        ]
        .iter()
        .map(|f| counting(kind, || autocast.run(f).unwrap()).1)
        .collect();
        assert_eq!(counts, want, "torch.amp path, only {class} emulated");
    }
}
