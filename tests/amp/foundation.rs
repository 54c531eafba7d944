//! The chain from Rust through tch and the C++ shim to libtorch 2.13 works on CPU.
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};
use tch_amp::diagnostics::check_aten_op;
use tch_amp::error::ConfigError;
use tch_amp::AmpError;
use tch_amp::Autocast;

#[test]
fn tiny_fp16_op_on_cpu() {
    // 1.5 + 2.25 is exact in fp16.
    let a = Tensor::from_slice(&[1.5f32, -2.0]).to_kind(Kind::Half);
    let b = Tensor::from_slice(&[2.25f32, 0.5]).to_kind(Kind::Half);
    let c = &a + &b;
    assert_eq!(c.kind(), Kind::Half);
    assert_eq!(Vec::<f32>::try_from(c.to_kind(Kind::Float)).unwrap(), vec![3.75, -1.5]);
}

fn linear_and_input() -> (nn::VarStore, nn::Linear, Tensor) {
    let vs = nn::VarStore::new(Device::Cpu);
    let linear = nn::linear(vs.root(), 8, 4, Default::default());
    (vs, linear, Tensor::ones([2, 8], (Kind::Float, Device::Cpu)))
}

#[test]
fn autocast_guard_casts_linear_on_cpu_and_restores() {
    let (_vs, linear, x) = linear_and_input();
    assert!(!Autocast::state(Device::Cpu).unwrap().enabled);
    for dtype in [Kind::Half, Kind::BFloat16] {
        {
            let guard = Autocast::new(Device::Cpu).dtype(dtype).enter().unwrap();
            assert!(!guard.previous().enabled);
            let state = Autocast::state(Device::Cpu).unwrap();
            assert!(state.enabled);
            assert_eq!(state.dtype, dtype);
            assert_eq!(linear.forward(&x).kind(), dtype);
        }
        assert!(!Autocast::state(Device::Cpu).unwrap().enabled);
        assert_eq!(linear.forward(&x).kind(), Kind::Float);
    }
    // The closure form, and the default CPU dtype (bf16) comes back after it.
    let y = Autocast::new(Device::Cpu).dtype(Kind::Half).run(|| linear.forward(&x)).unwrap();
    assert_eq!(y.kind(), Kind::Half);
    assert_eq!(Autocast::state(Device::Cpu).unwrap().dtype, Kind::BFloat16);
}

#[test]
fn nested_guards_restore_in_order() {
    let (_vs, linear, x) = linear_and_input();
    let outer = Autocast::new(Device::Cpu).dtype(Kind::Half).enter().unwrap();
    {
        let _inner = Autocast::new(Device::Cpu).enabled(false).enter().unwrap();
        assert_eq!(linear.forward(&x).kind(), Kind::Float);
    }
    assert_eq!(linear.forward(&x).kind(), Kind::Half);
    drop(outer);
    assert_eq!(linear.forward(&x).kind(), Kind::Float);
}

#[test]
fn guard_restores_state_when_closure_panics() {
    let (_vs, linear, x) = linear_and_input();
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        Autocast::new(Device::Cpu).dtype(Kind::Half).run(|| {
            assert_eq!(linear.forward(&x).kind(), Kind::Half);
            panic!("boom inside autocast");
        })
    }));
    assert!(result.is_err());
    assert!(!Autocast::state(Device::Cpu).unwrap().enabled);
    assert_eq!(linear.forward(&x).kind(), Kind::Float);
}

#[test]
fn autocast_rejects_non_float_dtype() {
    let err = Autocast::new(Device::Cpu).dtype(Kind::Int64).enter().unwrap_err();
    assert!(matches!(err, AmpError::Config(ConfigError::InvalidOption { option: "dtype", .. })), "{err}");
    assert!(!Autocast::state(Device::Cpu).unwrap().enabled);
}

#[test]
fn shim_turns_cpp_exception_into_error() {
    check_aten_op("mm").unwrap();
    check_aten_op("add.Tensor").unwrap();
    let err = check_aten_op("definitely_not_an_op").unwrap_err();
    match &err {
        AmpError::Config(ConfigError::UnknownOp { name, message }) => {
            assert_eq!(name, "definitely_not_an_op");
            assert!(message.contains("aten::definitely_not_an_op"), "{message}");
        }
        other => panic!("expected UnknownOp, got {other:?}"),
    }
    // A wrong overload of a real op is an error too.
    assert!(check_aten_op("mm.no_such_overload").is_err());
}
