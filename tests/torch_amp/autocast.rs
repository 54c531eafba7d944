//! tch_amp::autocast is libtorch's own autocast: torch's default dtypes, nesting, the state
//! restored on drop and on panic, and a typed error when the Apex path's cast policy is active
//! on the same thread (either way round). On the CPU its GEMMs and convolutions may be emulated
//! (`CpuKernels`): cast as libtorch casts them, computed in fp32, rounded once.
use tch::{Device, Kind, Tensor};
use tch_amp::error::ConfigError;
use tch_amp::error::UsageError;
use tch_amp::Autocast;
use tch_amp::{diagnostics, AmpConfig, AmpError, CpuKernels, OptLevel};

fn mm_kind() -> Kind {
    let a = Tensor::ones([2, 2], (Kind::Float, Device::Cpu));
    a.mm(&a).kind()
}

#[test]
fn defaults_nesting_and_restoring() {
    assert_eq!(mm_kind(), Kind::Float);
    let before = Autocast::state(Device::Cpu).unwrap();
    tch_amp::autocast(Device::Cpu, || {
        assert_eq!(mm_kind(), Kind::BFloat16, "CPU's default dtype is bf16");
        Autocast::new(Device::Cpu)
            .dtype(Kind::Half)
            .run(|| {
                assert_eq!(mm_kind(), Kind::Half);
                // Without a dtype an inner scope keeps the enclosing one's (torch reads the current).
                Autocast::new(Device::Cpu).run(|| assert_eq!(mm_kind(), Kind::Half)).unwrap();
                Autocast::new(Device::Cpu).enabled(false).run(|| assert_eq!(mm_kind(), Kind::Float)).unwrap();
                assert_eq!(mm_kind(), Kind::Half);
            })
            .unwrap();
        assert_eq!(mm_kind(), Kind::BFloat16);
    })
    .unwrap();
    assert_eq!(Autocast::state(Device::Cpu).unwrap(), before);
    assert_eq!(mm_kind(), Kind::Float);
    // A panic inside restores everything.
    let caught = std::panic::catch_unwind(|| {
        tch_amp::autocast(Device::Cpu, || -> i32 { panic!("inside autocast") }).unwrap();
    });
    assert!(caught.is_err());
    assert_eq!(Autocast::state(Device::Cpu).unwrap(), before);
    assert_eq!(mm_kind(), Kind::Float);
    // A guard, and cache_enabled.
    {
        let _scope = Autocast::new(Device::Cpu).cache_enabled(false).enter().unwrap();
        assert_eq!(mm_kind(), Kind::BFloat16);
    }
    assert_eq!(mm_kind(), Kind::Float);
    // Other threads are untouched.
    let other = tch_amp::autocast(Device::Cpu, || std::thread::spawn(mm_kind).join().unwrap()).unwrap();
    assert_eq!(other, Kind::Float);
}

#[test]
fn bad_dtype_is_refused() {
    let e = Autocast::new(Device::Cpu).dtype(Kind::Double).enter().unwrap_err();
    assert!(matches!(e, AmpError::Config(ConfigError::InvalidOption { option: "dtype", .. })), "{e}");
    assert_eq!(mm_kind(), Kind::Float);
}

#[test]
fn cuda_autocast_without_cuda_is_disabled() {
    if tch::Cuda::is_available() {
        return;
    }
    let _scope = Autocast::new(Device::Cuda(0)).enter().unwrap();
    assert!(!Autocast::state(Device::Cuda(0)).unwrap().enabled);
}

#[test]
fn apex_policy_and_torch_autocast_exclude_each_other_on_a_thread() {
    std::thread::spawn(|| {
        // Apex O1 active: torch autocast refused.
        let amp = tch_amp::Amp::new(&AmpConfig::new(OptLevel::O1).verbosity(0)).unwrap();
        let e = tch_amp::autocast(Device::Cpu, || ()).unwrap_err();
        assert!(
            matches!(e, AmpError::Usage(UsageError::AutocastConflict { entering: "torch.amp autocast", .. })),
            "{e}"
        );
        drop(amp);
        // torch autocast active: the Apex policy refused.
        tch_amp::autocast(Device::Cpu, || {
            let e = tch_amp::Amp::new(&AmpConfig::new(OptLevel::O1).verbosity(0)).unwrap_err();
            assert!(
                matches!(e, AmpError::Usage(UsageError::AutocastConflict { active: "torch.amp autocast", .. })),
                "{e}"
            );
        })
        .unwrap();
        // Afterwards both work again.
        drop(tch_amp::Amp::new(&AmpConfig::new(OptLevel::O1).verbosity(0)).unwrap());
        tch_amp::autocast(Device::Cpu, || assert_eq!(mm_kind(), Kind::BFloat16)).unwrap();
    })
    .join()
    .unwrap();
}

/// Deterministic values in [-1, 1].
fn det(shape: &[i64], salt: f64) -> Tensor {
    let n: i64 = shape.iter().product();
    (Tensor::arange(n, (Kind::Float, Device::Cpu)) * 0.7311 + salt).sin().reshape(shape)
}

fn differing(a: &Tensor, b: &Tensor) -> i64 {
    assert_eq!((a.kind(), a.size()), (b.kind(), b.size()));
    a.ne_tensor(b).sum(Kind::Int64).int64_value(&[])
}

/// A transposed convolution on fp32 inputs: on libtorch's CPU low-precision list.
fn conv_t(x: &Tensor, w: &Tensor) -> Tensor {
    x.conv_transpose2d(w, None::<Tensor>, [2, 2], [1, 1], [0, 0], 1, [1, 1])
}

/// `f`'s result and how many ops the cast engine emulated in `dtype` on this thread while it ran.
/// Whether native kernels give other numbers than the emulation depends on the CPU (oneDNN's
/// bf16 kernels on AMX round once, as the emulation does), so the tests observe the engine.
fn counting<T>(dtype: Kind, f: impl FnOnce() -> T) -> (T, u64) {
    let before = diagnostics::emulated_op_count(dtype).unwrap();
    let out = f();
    (out, diagnostics::emulated_op_count(dtype).unwrap() - before)
}

#[test]
fn cpu_emulation_casts_as_libtorch_does_then_rounds_once() {
    let (x, w) = (det(&[2, 16, 7, 7], 0.1), det(&[16, 8, 3, 3], 0.2));
    for dtype in [Kind::BFloat16, Kind::Half] {
        let run = |k: CpuKernels| {
            counting(dtype, || Autocast::new(Device::Cpu).dtype(dtype).cpu_kernels(k).run(|| conv_t(&x, &w)).unwrap())
        };
        let ((emulated, emulated_ops), (native, native_ops)) = (run(CpuKernels::Emulate), run(CpuKernels::Native));
        assert_eq!((emulated_ops, native_ops), (1, 0), "{dtype:?}: the emulation ran once, and only when asked");
        let low = |t: &Tensor| t.to_kind(dtype);
        let f32 = |t: &Tensor| low(t).to_kind(Kind::Float);
        assert_eq!(differing(&emulated, &low(&conv_t(&f32(&x), &f32(&w)))), 0, "{dtype:?}: emulated");
        assert_eq!(differing(&native, &conv_t(&low(&x), &low(&w))), 0, "{dtype:?}: native is torch.autocast's");
    }
}

#[test]
fn cpu_emulation_backward_has_the_forwards_rounding_points() {
    let x = det(&[12, 64], 0.3).set_requires_grad(true);
    let w = det(&[64, 10], 0.4).set_requires_grad(true);
    let up = det(&[12, 10], 0.5);
    let (y, forward_ops) = counting(Kind::BFloat16, || {
        Autocast::new(Device::Cpu).cpu_kernels(CpuKernels::Emulate).run(|| x.mm(&w)).unwrap()
    });
    assert_eq!((y.kind(), forward_ops), (Kind::BFloat16, 1));
    (y.to_kind(Kind::Float) * &up).sum(Kind::Float).backward();
    // Each gradient: the fp32 product of bf16 values, rounded once to bf16, then to fp32 at the
    // weight's cast (as a bf16 GEMM's gradient reaches an fp32 leaf under torch.autocast).
    let r = |t: &Tensor| t.to_kind(Kind::BFloat16).to_kind(Kind::Float);
    let gx = r(&up).mm(&r(&w).tr());
    let gw = r(&x).tr().mm(&r(&up));
    assert_eq!(differing(&x.grad(), &r(&gx)), 0, "grad of x");
    assert_eq!(differing(&w.grad(), &r(&gw)), 0, "grad of w");
}

#[test]
fn cpu_kernels_nest_per_scope_and_thread() {
    let (x, w) = (det(&[2, 16, 7, 7], 0.1), det(&[16, 8, 3, 3], 0.2));
    let low = |t: &Tensor| t.to_kind(Kind::BFloat16);
    let native = conv_t(&low(&x), &low(&w));
    let emulate = Autocast::new(Device::Cpu).cpu_kernels(CpuKernels::Emulate);
    let bf16 = Kind::BFloat16;
    emulate
        .run(|| {
            let (emulated, ops) = counting(bf16, || conv_t(&x, &w));
            assert_eq!(ops, 1, "the outer scope emulates");
            // The emulation is not an Apex cast policy (which torch autocast refuses).
            assert!(!diagnostics::policy_active().unwrap());
            let (inner, ops) = counting(bf16, || {
                Autocast::new(Device::Cpu).cpu_kernels(CpuKernels::Native).run(|| conv_t(&x, &w)).unwrap()
            });
            assert_eq!((differing(&inner, &native), ops), (0, 0), "inner native scope");
            // A disabled scope runs fp32; the emulation comes back after it.
            let (kind, ops) =
                counting(bf16, || Autocast::new(Device::Cpu).enabled(false).run(|| conv_t(&x, &w).kind()).unwrap());
            assert_eq!((kind, ops), (Kind::Float, 0));
            let (again, ops) = counting(bf16, || conv_t(&x, &w));
            assert_eq!((differing(&again, &emulated), ops), (0, 1), "outer scope again");
            // Autocast and its kernels are per thread.
            let (x2, w2) = (x.copy(), w.copy());
            let other = std::thread::spawn(move || counting(bf16, || conv_t(&x2, &w2).kind())).join().unwrap();
            assert_eq!(other, (Kind::Float, 0));
        })
        .unwrap();
    // Afterwards: plain libtorch, and a native scope is torch.autocast's.
    assert_eq!(counting(bf16, || conv_t(&x, &w).kind()), (Kind::Float, 0));
    let (again, ops) =
        counting(bf16, || Autocast::new(Device::Cpu).cpu_kernels(CpuKernels::Native).run(|| conv_t(&x, &w)).unwrap());
    assert_eq!((differing(&again, &native), ops), (0, 0));
}

/// torch's `custom_fwd(cast_inputs=torch.float32)`: inside autocast the region runs in fp32 on
/// fp32 copies of its floating inputs, integer inputs untouched; outside it runs as it is.
#[test]
fn fp32_region_is_torchs_custom_fwd_to_fp32() {
    let x = det(&[3, 4], 0.1);
    let idx = Tensor::from_slice(&[2i64, 0]);
    let inside = tch_amp::autocast(Device::Cpu, || {
        let h = x.mm(&x.tr());
        assert_eq!(h.kind(), Kind::BFloat16);
        let r = tch_amp::fp32_region(Device::Cpu, &[&h, &idx], |t| {
            assert!(!Autocast::state(Device::Cpu).unwrap().enabled);
            (t[0].kind(), t[1].kind(), t[0].mm(&t[0]).kind(), t[0].index_select(0, &t[1]))
        })
        .unwrap();
        assert!(Autocast::state(Device::Cpu).unwrap().enabled, "autocast comes back after the region");
        (h, r)
    })
    .unwrap();
    let (h, (k0, k1, mm, picked)) = inside;
    assert_eq!((k0, k1, mm), (Kind::Float, Kind::Int64, Kind::Float));
    assert_eq!(differing(&picked, &h.to_kind(Kind::Float).index_select(0, &idx)), 0);
    // Outside autocast the inputs are passed as they are.
    let half = x.to_kind(Kind::Half);
    let kind = tch_amp::fp32_region(Device::Cpu, &[&half], |t| t[0].kind()).unwrap();
    assert_eq!(kind, Kind::Half);
}
