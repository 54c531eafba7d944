//! Apex's opt-level table (apex/amp/frontend.py at e13873de, classes O0-O3), the overrides,
//! and every rejection of `amp.initialize`'s options as a typed error.
use tch::Kind;
use tch_amp::error::ConfigError;
use tch_amp::scaling::LossScaler;
use tch_amp::{AmpConfig, AmpError, LossScale, OptLevel, Properties};

/// One row of Apex's table: cast_model_type, patch_torch_functions, keep_batchnorm_fp32,
/// master_weights, loss_scale (`None` = unset).
type Row = (Option<Kind>, bool, Option<bool>, Option<bool>, LossScale);

const TABLE: [(OptLevel, Row); 4] = [
    (OptLevel::O0, (Some(Kind::Float), false, None, Some(false), LossScale::Static(1.0))),
    (OptLevel::O1, (None, true, None, None, LossScale::Dynamic)),
    (OptLevel::O2, (Some(Kind::Half), false, Some(true), Some(true), LossScale::Dynamic)),
    (OptLevel::O3, (Some(Kind::Half), false, Some(false), Some(false), LossScale::Static(1.0))),
];

fn build(c: AmpConfig) -> Properties {
    c.build().unwrap_or_else(|e| panic!("{c:?}: {e}"))
}

fn incompatible(c: AmpConfig, level: OptLevel, option: &str) {
    match c.build() {
        Err(AmpError::Config(ConfigError::IncompatibleOption { level: l, option: o, .. }))
            if l == level && o == option => {}
        other => panic!("{c:?}: expected IncompatibleOption {{ {level}, {option} }}, got {other:?}"),
    }
}

fn invalid<T: std::fmt::Debug>(r: Result<T, AmpError>, option: &str) {
    match r {
        Err(AmpError::Config(ConfigError::InvalidOption { option: o, .. })) if o == option => {}
        other => panic!("expected InvalidOption {{ {option} }}, got {other:?}"),
    }
}

#[test]
fn level_defaults_are_apexs_table() {
    for (level, (cast, patch, keep_bn, masters, scale)) in TABLE {
        let d = level.defaults();
        assert_eq!(d.opt_level, level);
        assert_eq!(d.cast_model_type, cast, "{level} cast_model_type");
        assert_eq!(d.patch_torch_functions, patch, "{level} patch_torch_functions");
        assert_eq!(d.keep_batchnorm_fp32, keep_bn, "{level} keep_batchnorm_fp32");
        assert_eq!(d.master_weights, masters, "{level} master_weights");
        assert_eq!(d.loss_scale, scale, "{level} loss_scale");
        assert!(!d.brief.is_empty());
    }
    // Apex's own one-line descriptions.
    assert_eq!(OptLevel::O0.defaults().brief, "Pure FP32 training.");
    assert_eq!(OptLevel::O2.defaults().brief, "FP16 training with FP32 batchnorm and FP32 master weights.");
    assert_eq!(OptLevel::O3.defaults().brief, "Pure FP16 training.");
    assert_eq!(OptLevel::ALL, [OptLevel::O0, OptLevel::O1, OptLevel::O2, OptLevel::O3]);
}

/// `AmpConfig::new(level).build()`: the row, with "unset" resolved as Apex's initialize does
/// (false), and initialize's defaults for the other options.
#[test]
fn build_without_overrides() {
    for (level, (cast, patch, keep_bn, masters, scale)) in TABLE {
        let p = build(AmpConfig::new(level));
        assert_eq!(p.opt_level(), level);
        assert!(p.enabled());
        assert_eq!(p.cast_model_type(), cast, "{level}");
        assert_eq!(p.patch_torch_functions(), patch, "{level}");
        assert_eq!(p.keep_batchnorm_fp32(), keep_bn.unwrap_or(false), "{level}");
        assert_eq!(p.master_weights(), masters.unwrap_or(false), "{level}");
        assert_eq!(p.loss_scale(), scale, "{level}");
        assert_eq!(p.cast_model_outputs(), None);
        assert_eq!(p.num_losses(), 1);
        assert_eq!(p.min_loss_scale(), None);
        assert_eq!(p.max_loss_scale(), 16_777_216.0);
        assert_eq!(p.max_loss_scale(), LossScaler::DEFAULT_MAX_LOSS_SCALE);
        assert_eq!(p.verbosity(), 1);
        assert_eq!(p.cast_settings().low_precision_dtype, Kind::Half);
        assert!(!p.cast_settings().allow_banned);
    }
    // Apex's default opt_level is O1.
    assert_eq!(build(AmpConfig::default()), build(AmpConfig::new(OptLevel::O1)));
}

#[test]
fn overrides_apply() {
    let p = build(
        AmpConfig::new(OptLevel::O2)
            .keep_batchnorm_fp32(false)
            .master_weights(false)
            .loss_scale(128.0)
            .cast_model_outputs(Kind::Half)
            .num_losses(3)
            .min_loss_scale(1.0)
            .max_loss_scale(4096.0)
            .verbosity(0),
    );
    assert!(!p.keep_batchnorm_fp32() && !p.master_weights());
    assert_eq!(p.loss_scale(), LossScale::Static(128.0));
    assert_eq!(p.cast_model_outputs(), Some(Kind::Half));
    assert_eq!((p.num_losses(), p.min_loss_scale(), p.max_loss_scale(), p.verbosity()), (3, Some(1.0), 4096.0, 0));
    // Untouched options keep the level's values.
    assert_eq!(p.cast_model_type(), Some(Kind::Half));
    assert!(!p.patch_torch_functions());

    let p = build(
        AmpConfig::new(OptLevel::O3).keep_batchnorm_fp32(true).master_weights(true).loss_scale(LossScale::Dynamic),
    );
    assert!(p.keep_batchnorm_fp32() && p.master_weights());
    assert_eq!(p.loss_scale(), LossScale::Dynamic);

    let p = build(AmpConfig::new(OptLevel::O0).loss_scale(LossScale::Dynamic).cast_model_type(Some(Kind::Half)));
    assert_eq!(p.loss_scale(), LossScale::Dynamic);
    assert_eq!(p.cast_model_type(), Some(Kind::Half));

    // O1 may turn its patching off, and take cast_model_type float32 (Apex allows both).
    let p = build(AmpConfig::new(OptLevel::O1).patch_torch_functions(false).cast_model_type(Some(Kind::Float)));
    assert!(!p.patch_torch_functions());
    assert_eq!(p.cast_model_type(), Some(Kind::Float));
    // patch_torch_functions=False is fine anywhere.
    assert!(!build(AmpConfig::new(OptLevel::O2).patch_torch_functions(false)).patch_torch_functions());

    assert!(!build(AmpConfig::new(OptLevel::O2).enabled(false)).enabled());
}

/// Apex's `cast_model_type=False` turns model casting off and is allowed at every level,
/// O1 included.
#[test]
fn cast_model_type_none_allowed_everywhere() {
    for level in OptLevel::ALL {
        assert_eq!(build(AmpConfig::new(level).cast_model_type(None)).cast_model_type(), None, "{level}");
        let c = AmpConfig::from_apex(&level.to_string(), &[("cast_model_type", "False")]).unwrap();
        assert_eq!(build(c).cast_model_type(), None, "{level}");
    }
}

#[test]
fn o1_rejections() {
    let o1 = || AmpConfig::new(OptLevel::O1);
    for kind in [Kind::Half, Kind::BFloat16] {
        incompatible(o1().cast_model_type(Some(kind)), OptLevel::O1, "cast_model_type");
    }
    for v in [true, false] {
        incompatible(o1().keep_batchnorm_fp32(v), OptLevel::O1, "keep_batchnorm_fp32");
        incompatible(o1().master_weights(v), OptLevel::O1, "master_weights");
    }
    // Through Apex's strings: "None" leaves them unset, which is fine.
    build(AmpConfig::from_apex("O1", &[("keep_batchnorm_fp32", "None"), ("master_weights", "None")]).unwrap());
    incompatible(AmpConfig::from_apex("O1", &[("master_weights", "False")]).unwrap(), OptLevel::O1, "master_weights");
    incompatible(
        AmpConfig::from_apex("O1", &[("cast_model_type", "torch.float16")]).unwrap(),
        OptLevel::O1,
        "cast_model_type",
    );
}

#[test]
fn patch_torch_functions_only_under_o1() {
    for level in [OptLevel::O0, OptLevel::O2, OptLevel::O3] {
        incompatible(AmpConfig::new(level).patch_torch_functions(true), level, "patch_torch_functions");
    }
    assert!(build(AmpConfig::new(OptLevel::O1).patch_torch_functions(true)).patch_torch_functions());
}

#[test]
fn unknown_opt_level_says_letter_o() {
    for name in ["00", "o2", "O4", "0", "", "O 1", "02", "o1"] {
        let e = AmpError::from(name.parse::<OptLevel>().unwrap_err());
        match &e {
            AmpError::Config(ConfigError::UnknownOptLevel { name: n }) => assert_eq!(n, name),
            other => panic!("{name:?}: {other:?}"),
        }
        let msg = e.to_string();
        assert!(msg.contains("letter O") && msg.contains("zero"), "{msg}");
        assert!(matches!(AmpConfig::from_apex(name, &[]), Err(AmpError::Config(ConfigError::UnknownOptLevel { .. }))));
    }
    for level in OptLevel::ALL {
        assert_eq!(level.to_string().parse::<OptLevel>().unwrap(), level);
    }
}

#[test]
fn invalid_option_values() {
    let apex = |name: &str, value: &str| AmpConfig::from_apex("O2", &[(name, value)]);
    invalid(apex("keep_batchnorm_fp32", "maybe"), "keep_batchnorm_fp32");
    invalid(apex("master_weights", "yes"), "master_weights");
    for bad in ["abc", "0", "-1", "nan", "inf", "-inf", "", "Dynamic"] {
        invalid(apex("loss_scale", bad), "loss_scale");
        invalid(bad.parse::<LossScale>(), "loss_scale");
    }
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        invalid(AmpConfig::new(OptLevel::O2).loss_scale(bad).build(), "loss_scale");
    }
    invalid(AmpConfig::new(OptLevel::O2).num_losses(0).build(), "num_losses");
    invalid(apex("num_losses", "0").unwrap().build(), "num_losses");
    invalid(apex("num_losses", "two"), "num_losses");
    invalid(AmpConfig::new(OptLevel::O2).min_loss_scale(8.0).max_loss_scale(4.0).build(), "min_loss_scale");
    // Equal is fine.
    build(AmpConfig::new(OptLevel::O2).min_loss_scale(4.0).max_loss_scale(4.0));
    for bad in [0.0, -2.0, f64::NAN, f64::INFINITY] {
        invalid(AmpConfig::new(OptLevel::O2).min_loss_scale(bad).build(), "min_loss_scale");
        invalid(AmpConfig::new(OptLevel::O2).max_loss_scale(bad).build(), "max_loss_scale");
    }
    invalid(apex("cast_model_type", "torch.int8"), "cast_model_type");
    invalid(AmpConfig::new(OptLevel::O2).cast_model_type(Some(Kind::Int64)).build(), "cast_model_type");
    invalid(AmpConfig::new(OptLevel::O1).low_precision_dtype(Kind::Float).build(), "low_precision_dtype");
    invalid(apex("no_such_option", "1"), "option name");
}

/// Apex's strings: "True"/"False"/"None", "dynamic", numbers, "torch.float16".
#[test]
fn from_apex_parses_apex_strings() {
    let c = AmpConfig::from_apex(
        "O2",
        &[
            ("keep_batchnorm_fp32", "True"),
            ("master_weights", "False"),
            ("loss_scale", "128.0"),
            ("cast_model_type", "torch.float16"),
            ("cast_model_outputs", "torch.float32"),
            ("num_losses", "2"),
            ("min_loss_scale", "None"),
            ("max_loss_scale", "65536.0"),
            ("verbosity", "0"),
        ],
    )
    .unwrap();
    let want = AmpConfig::new(OptLevel::O2)
        .keep_batchnorm_fp32(true)
        .master_weights(false)
        .loss_scale(128.0)
        .cast_model_type(Some(Kind::Half))
        .cast_model_outputs(Kind::Float)
        .num_losses(2)
        .max_loss_scale(65536.0)
        .verbosity(0);
    assert_eq!(build(c), build(want));

    let p = build(AmpConfig::from_apex("O3", &[("loss_scale", "dynamic"), ("keep_batchnorm_fp32", "False")]).unwrap());
    assert_eq!(p.loss_scale(), LossScale::Dynamic);
    assert!(!p.keep_batchnorm_fp32());
    // "None" means "the level's value".
    let p = build(
        AmpConfig::from_apex(
            "O2",
            &[("master_weights", "None"), ("loss_scale", "None"), ("keep_batchnorm_fp32", "None")],
        )
        .unwrap(),
    );
    assert_eq!(p, build(AmpConfig::new(OptLevel::O2)));
    // Integers and exponents are numbers.
    assert_eq!(
        build(AmpConfig::from_apex("O2", &[("loss_scale", "512")]).unwrap()).loss_scale(),
        LossScale::Static(512.0)
    );
    assert_eq!(
        build(AmpConfig::from_apex("O2", &[("loss_scale", "1e3")]).unwrap()).loss_scale(),
        LossScale::Static(1000.0)
    );
    assert_eq!("dynamic".parse::<LossScale>().unwrap(), LossScale::Dynamic);
    let p = build(
        AmpConfig::from_apex("O2", &[("cast_model_type", "torch.bfloat16"), ("min_loss_scale", "0.25")]).unwrap(),
    );
    assert_eq!(p.cast_model_type(), Some(Kind::BFloat16));
    assert_eq!(p.min_loss_scale(), Some(0.25));
}

/// bf16 has fp32's exponent range: with no explicit loss_scale, the scale is static 1.0
/// (O1 with a bf16 policy, or a model cast to bf16); an explicit scale is kept.
#[test]
fn bf16_defaults_to_static_scale_one() {
    let o1 = || AmpConfig::new(OptLevel::O1).low_precision_dtype(Kind::BFloat16);
    assert_eq!(build(o1()).loss_scale(), LossScale::Static(1.0));
    assert_eq!(build(o1()).cast_settings().low_precision_dtype, Kind::BFloat16);
    assert_eq!(build(o1().loss_scale(LossScale::Dynamic)).loss_scale(), LossScale::Dynamic);
    assert_eq!(build(o1().loss_scale(64.0)).loss_scale(), LossScale::Static(64.0));
    assert_eq!(build(AmpConfig::new(OptLevel::O1).low_precision_dtype(Kind::Half)).loss_scale(), LossScale::Dynamic);

    let o2 = || AmpConfig::new(OptLevel::O2).cast_model_type(Some(Kind::BFloat16));
    let p = build(o2());
    assert_eq!(p.loss_scale(), LossScale::Static(1.0));
    assert!(p.master_weights() && p.keep_batchnorm_fp32());
    assert_eq!(p.cast_model_type(), Some(Kind::BFloat16));
    assert_eq!(build(o2().loss_scale(LossScale::Dynamic)).loss_scale(), LossScale::Dynamic);
    assert_eq!(build(o2().loss_scale(256.0)).loss_scale(), LossScale::Static(256.0));
    // An fp16 O2 stays dynamic.
    assert_eq!(build(AmpConfig::new(OptLevel::O2).cast_model_type(Some(Kind::Half))).loss_scale(), LossScale::Dynamic);
}
