//! Bad input to float8 training: typed errors, nothing changed, no panic.
use tch::nn::{self, Module, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::error::ConfigError;
use tch_amp::float8::{
    DelayedScaling, Float8LinearConfig, Float8Training, LayerFilter, ScalingGranularity, SkipReason,
};
use tch_amp::AmpError;

fn cpu() -> (Kind, Device) {
    (Kind::Float, Device::Cpu)
}

#[test]
fn unknown_recipe_fields_and_names_are_typed_errors() {
    for text in [
        "[delayed_scaling]\nhistory_len = 4\n",
        "[delayed_scaling]\namax_compute_algo = \"mean\"\n",
        "enable_fsdp_float8_all_gather = true\n",
        "[cast_config_weight]\nscaling_granularity = \"blockwise\"\n",
        "pad_inner_dim = \"yes\"\n",
    ] {
        let err = Float8LinearConfig::from_toml(text).unwrap_err();
        assert!(matches!(err, AmpError::Config(ConfigError::Parse { .. })), "{text:?}: {err}");
    }
    let err = Float8LinearConfig::from_recipe_name("blockwise").unwrap_err();
    assert!(matches!(err, AmpError::Config(ConfigError::InvalidOption { option: "recipe_name", .. })), "{err}");
    // TE's delayed scaling is tensorwise: with the rowwise recipe it is refused at conversion.
    let rowwise = Float8LinearConfig::from_recipe_name("rowwise").unwrap().delayed_scaling(DelayedScaling::default());
    let err = Float8Training::new(rowwise, LayerFilter::all()).unwrap_err();
    assert!(matches!(err, AmpError::Config(ConfigError::InvalidOption { .. })), "{err}");
    let text = "round_scales_to_power_of_2 = true\n[cast_config_input]\nscaling_granularity = \"axiswise\"\n";
    let c = Float8LinearConfig::from_toml(text).unwrap();
    assert_eq!(c.cast_config_input.scaling_granularity, ScalingGranularity::Axiswise);
}

#[test]
fn layers_that_cannot_run_in_float8_are_skipped_or_refused() {
    let vs = VarStore::new(Device::Cpu);
    let root = vs.root();
    // Selected by a prefix: skipped and reported.
    let fp8 =
        Float8Training::new(Float8LinearConfig::default(), LayerFilter::only(&["enc"]).except(&["enc.out"])).unwrap();
    let a = fp8.linear(&root / "enc" / "a", 32, 48, Default::default()).unwrap();
    let b = fp8.linear(&root / "enc" / "b", 48, 10, Default::default()).unwrap();
    let c = fp8.linear(&root / "enc" / "out", 48, 16, Default::default()).unwrap();
    let d = fp8.linear(&root / "encoder", 48, 16, Default::default()).unwrap();
    assert!(a.is_float8() && !b.is_float8() && !c.is_float8() && !d.is_float8());
    let report = fp8.report();
    assert_eq!(report.converted, ["enc.a"]);
    assert_eq!(
        report.skipped,
        [
            ("enc.b".to_string(), SkipReason::Dimensions { in_features: 48, out_features: 10 }),
            ("enc.out".to_string(), SkipReason::Filtered),
            ("encoder".to_string(), SkipReason::Filtered),
        ]
    );
    // Named explicitly: refused, and no variable was created.
    let fp8 = Float8Training::new(Float8LinearConfig::default(), LayerFilter::only(&["head", "f64"])).unwrap();
    let before = vs.variables().len();
    let err = fp8.linear(&root / "head", 48, 10, Default::default()).unwrap_err();
    assert!(
        matches!(&err, AmpError::Config(ConfigError::Float8LayerRefused { layer, .. }) if layer == "head"),
        "{err}"
    );
    assert_eq!(vs.variables().len(), before, "a refused layer left variables behind");
    let f64_layer = nn::Linear { ws: Tensor::zeros([16, 16], (Kind::Double, Device::Cpu)), bs: None };
    let err = fp8.convert("f64", f64_layer).unwrap_err();
    assert!(matches!(err, AmpError::Config(ConfigError::Float8LayerRefused { .. })), "{err}");
    assert!(fp8.report().converted.is_empty() && fp8.report().skipped.is_empty());
    // The same layer twice.
    let fp8 = Float8Training::new(Float8LinearConfig::default(), LayerFilter::all()).unwrap();
    let l = fp8.linear(&root / "twice", 16, 16, Default::default()).unwrap();
    let again = nn::Linear { ws: l.ws.shallow_clone(), bs: None };
    let err = fp8.convert("twice", again).unwrap_err();
    assert!(matches!(err, AmpError::Config(ConfigError::InvalidOption { .. })), "{err}");
    // Not a linear layer's weight.
    let conv = nn::Linear { ws: Tensor::zeros([16, 16, 3], cpu()), bs: None };
    assert!(fp8.convert("conv", conv).is_err());
}

#[test]
fn bad_inputs_to_a_float8_layer_are_errors() {
    let vs = VarStore::new(Device::Cpu);
    for recipe in ["tensorwise", "rowwise"] {
        let fp8 =
            Float8Training::new(Float8LinearConfig::from_recipe_name(recipe).unwrap(), LayerFilter::all()).unwrap();
        let l = fp8.linear(vs.root() / recipe, 16, 32, Default::default()).unwrap();
        assert!(l.f_forward(&Tensor::ones([4, 8], cpu())).is_err(), "{recipe}: wrong in_features");
        assert!(l.f_forward(&Tensor::from(1.0f32)).is_err(), "{recipe}: a 0-dim input");
        // fp64: `_scaled_mm` has no fp64 output for tensorwise scales (torchao fails the same
        // way); its rowwise path takes it.
        let f64_out = l.f_forward(&Tensor::ones([4, 16], (Kind::Double, Device::Cpu)));
        assert_eq!(f64_out.is_err(), recipe == "tensorwise", "{recipe}: fp64 input");
        let y = l.f_forward(&Tensor::ones([2, 3, 16], cpu())).unwrap();
        assert_eq!(y.size(), [2, 3, 32]);
        // An empty batch: the tensorwise amax of nothing is libtorch's error (torchao's too);
        // rowwise gives an empty output, as torchao.
        let empty = l.f_forward(&Tensor::ones([0, 16], cpu()));
        match recipe {
            "tensorwise" => assert!(empty.is_err(), "tensorwise: an empty batch"),
            _ => assert_eq!(empty.unwrap().size(), [0, 32], "rowwise: an empty batch"),
        }
        assert!(
            std::panic::catch_unwind(|| l.forward(&Tensor::ones([4, 8], cpu()))).is_err(),
            "Module::forward panics"
        );
    }
}

/// torchao's rowwise_with_gw_hp fails under CPU autocast with fp32 weights (its grad_weight
/// GEMM gets a bf16 and an fp32 operand); tch-amp fails the same way, as an error.
#[test]
fn rowwise_with_gw_hp_under_autocast_fails_as_torchao_without_panicking() {
    let vs = VarStore::new(Device::Cpu);
    let config = Float8LinearConfig::from_recipe_name("rowwise_with_gw_hp").unwrap();
    let fp8 = Float8Training::new(config, LayerFilter::all()).unwrap();
    let l = fp8.linear(vs.root() / "l", 16, 16, Default::default()).unwrap();
    let x = Tensor::ones([4, 16], cpu()).set_requires_grad(true);
    let y = tch_amp::Autocast::new(Device::Cpu).dtype(Kind::BFloat16).run(|| l.forward(&x)).unwrap();
    assert_eq!(y.kind(), Kind::BFloat16);
    let err = y.to_kind(Kind::Float).sum(Kind::Float).f_backward().unwrap_err();
    assert!(err.to_string().contains("same dtype"), "{err}");
}

/// The tensors a float8 backward needs are saved as libtorch saves its own: a weight changed in
/// place between forward and backward is an error of `backward`, not silently wrong gradients.
#[test]
fn a_weight_changed_in_place_before_backward_is_caught() {
    let vs = VarStore::new(Device::Cpu);
    let fp8 = Float8Training::new(Float8LinearConfig::default(), LayerFilter::all()).unwrap();
    let l = fp8.linear(vs.root() / "l", 16, 16, Default::default()).unwrap();
    let y = l.forward(&Tensor::ones([4, 16], cpu()));
    tch::no_grad(|| {
        let _ = l.ws.shallow_clone().g_mul_scalar_(2.0);
    });
    let err = y.sum(Kind::Float).f_backward().unwrap_err();
    assert!(err.to_string().contains("modified by an inplace operation"), "{err}");
}
