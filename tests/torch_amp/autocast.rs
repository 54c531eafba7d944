//! tch_amp::autocast is libtorch's own autocast: torch's default dtypes, nesting, the state
//! restored on drop and on panic, and a typed error when the Apex path's cast policy is active
//! on the same thread (either way round).
use tch::{Device, Kind, Tensor};
use tch_amp::cast::autocast_state;
use tch_amp::error::UsageError;
use tch_amp::torch_amp::{Autocast, TorchAmpError};
use tch_amp::{AmpConfig, AmpError, OptLevel};

fn mm_kind() -> Kind {
    let a = Tensor::ones([2, 2], (Kind::Float, Device::Cpu));
    a.mm(&a).kind()
}

#[test]
fn defaults_nesting_and_restoring() {
    assert_eq!(mm_kind(), Kind::Float);
    let before = autocast_state(Device::Cpu).unwrap();
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
    assert_eq!(autocast_state(Device::Cpu).unwrap(), before);
    assert_eq!(mm_kind(), Kind::Float);
    // A panic inside restores everything.
    let caught = std::panic::catch_unwind(|| {
        tch_amp::autocast(Device::Cpu, || -> i32 { panic!("inside autocast") }).unwrap();
    });
    assert!(caught.is_err());
    assert_eq!(autocast_state(Device::Cpu).unwrap(), before);
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
    assert!(matches!(e, TorchAmpError::InvalidOption { option: "dtype", .. }), "{e}");
    assert_eq!(mm_kind(), Kind::Float);
}

#[test]
fn cuda_autocast_without_cuda_is_disabled() {
    if tch::Cuda::is_available() {
        return;
    }
    let _scope = Autocast::new(Device::Cuda(0)).enter().unwrap();
    assert!(!autocast_state(Device::Cuda(0)).unwrap().enabled);
}

#[test]
fn apex_policy_and_torch_autocast_exclude_each_other_on_a_thread() {
    std::thread::spawn(|| {
        // Apex O1 active: torch autocast refused.
        let amp = tch_amp::Amp::new(&AmpConfig::new(OptLevel::O1).verbosity(0)).unwrap();
        let e = tch_amp::autocast(Device::Cpu, || ()).unwrap_err();
        assert!(matches!(e, TorchAmpError::AutocastConflict { .. }), "{e}");
        drop(amp);
        // torch autocast active: the Apex policy refused.
        tch_amp::autocast(Device::Cpu, || {
            let e = tch_amp::Amp::new(&AmpConfig::new(OptLevel::O1).verbosity(0)).unwrap_err();
            assert!(matches!(e, AmpError::Usage(UsageError::TorchAutocastActive)), "{e}");
        })
        .unwrap();
        // Afterwards both work again.
        drop(tch_amp::Amp::new(&AmpConfig::new(OptLevel::O1).verbosity(0)).unwrap());
        tch_amp::autocast(Device::Cpu, || assert_eq!(mm_kind(), Kind::BFloat16)).unwrap();
    })
    .join()
    .unwrap();
}
