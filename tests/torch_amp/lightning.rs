//! Lightning's precision flags, 2.x names and 1.x `precision` / `amp_backend` / `amp_level`.
use tch::Kind;
use tch_amp::error::ConfigError;
use tch_amp::torch_amp::Precision;
use tch_amp::AmpError;
use tch_amp::OptLevel;

#[test]
fn lightning_2_flags() {
    let mixed = |dtype, grad_scaler| Precision::Mixed { dtype, grad_scaler };
    for (flag, want) in [
        ("32-true", Precision::Fp32),
        ("16-mixed", mixed(Kind::Half, true)),
        ("bf16-mixed", mixed(Kind::BFloat16, false)),
        ("16-true", Precision::Pure { dtype: Kind::Half }),
        ("bf16-true", Precision::Pure { dtype: Kind::BFloat16 }),
        ("64-true", Precision::Pure { dtype: Kind::Double }),
        ("16", mixed(Kind::Half, true)),
        ("bf16", mixed(Kind::BFloat16, false)),
        ("32", Precision::Fp32),
    ] {
        assert_eq!(Precision::parse(flag).unwrap(), want, "{flag}");
    }
    assert!(Precision::parse("16-mixed").unwrap().uses_grad_scaler());
    assert!(!Precision::parse("bf16-mixed").unwrap().uses_grad_scaler());
    assert_eq!(Precision::parse("bf16-mixed").unwrap().autocast_dtype(), Some(Kind::BFloat16));
    assert_eq!(Precision::parse("16-true").unwrap().autocast_dtype(), None);
    for bad in ["fp16", "16-MIXED", "", "8-true", "transformer-engine", "32-mixed"] {
        assert!(matches!(Precision::parse(bad), Err(AmpError::Config(ConfigError::InvalidOption { .. }))), "{bad}");
    }
}

#[test]
fn lightning_1_flags() {
    assert_eq!(
        Precision::parse_v1("16", "native", None).unwrap(),
        Precision::Mixed { dtype: Kind::Half, grad_scaler: true }
    );
    assert_eq!(Precision::parse_v1("16", "apex", None).unwrap(), Precision::Apex { opt_level: OptLevel::O2 });
    assert_eq!(Precision::parse_v1("16", "apex", Some("O1")).unwrap(), Precision::Apex { opt_level: OptLevel::O1 });
    assert_eq!(Precision::parse_v1("32", "apex", Some("O1")).unwrap(), Precision::Fp32);
    assert_eq!(
        Precision::parse_v1("bf16", "native", None).unwrap(),
        Precision::Mixed { dtype: Kind::BFloat16, grad_scaler: false }
    );
    for (p, backend, level) in [
        ("16", "native", Some("O2")), // amp_level only with apex
        ("bf16", "apex", None),       // bf16 not with apex
        ("16", "deepspeed", None),    // unknown backend
        ("16", "apex", Some("o1")),   // not an opt level
        ("16", "apex", Some("00")),   // zero, not the letter O
        ("8", "native", None),        // unknown precision
    ] {
        let e = Precision::parse_v1(p, backend, level).unwrap_err();
        assert!(matches!(e, AmpError::Config(ConfigError::InvalidOption { .. })), "{p} {backend} {level:?}: {e}");
    }
}
