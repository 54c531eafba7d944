//! torchao's `Float8LinearConfig` (with its recipes) and Transformer Engine's `DelayedScaling`.
use serde::{Deserialize, Serialize};
use tch::Kind;

use crate::error::{AmpError, ConfigError, Result};

/// A float8 type: torch's `float8_e4m3fn` (forward operands) or `float8_e5m2` (gradients).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Float8Dtype {
    /// `torch.float8_e4m3fn`: 4 exponent bits, 3 mantissa bits, finite only; largest 448.
    #[serde(rename = "e4m3fn")]
    E4m3fn,
    /// `torch.float8_e5m2`: 5 exponent bits, 2 mantissa bits; largest 57344.
    #[serde(rename = "e5m2")]
    E5m2,
}

impl Float8Dtype {
    /// The tch kind.
    pub fn kind(self) -> Kind {
        match self {
            Float8Dtype::E4m3fn => Kind::Float8e4m3fn,
            Float8Dtype::E5m2 => Kind::Float8e5m2,
        }
    }

    /// The largest finite value (`torch.finfo(dtype).max`).
    pub fn max(self) -> f64 {
        match self {
            Float8Dtype::E4m3fn => 448.0,
            Float8Dtype::E5m2 => 57344.0,
        }
    }
}

/// torchao's `ScalingType`: scale dynamically from the tensor's values, or leave the tensor in
/// its own precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScalingType {
    /// One scale computed from the tensor's absolute maximum at each use.
    #[default]
    Dynamic,
    /// No float8 cast: the GEMM runs in high precision (both of its operands must be disabled).
    Disabled,
}

/// torchao's `ScalingGranularity`: one scale for the tensor, or one per row (or column).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScalingGranularity {
    /// One scale for the whole tensor.
    #[default]
    Tensorwise,
    /// One scale per slice along the GEMM's reduction dimension ("rowwise").
    Axiswise,
}

/// torchao's `CastConfig`: how one operand of one GEMM is cast to float8.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CastConfig {
    /// Dynamic or disabled.
    pub scaling_type: ScalingType,
    /// Tensorwise or axiswise (axiswise needs dynamic scaling).
    pub scaling_granularity: ScalingGranularity,
    /// The float8 type; `None`: e4m3fn for input and weight, e5m2 for grad_output.
    pub target_dtype: Option<Float8Dtype>,
}

impl CastConfig {
    /// Axiswise dynamic scaling to `dtype` (the rowwise recipe's operands).
    pub fn axiswise(dtype: Option<Float8Dtype>) -> Self {
        Self { scaling_granularity: ScalingGranularity::Axiswise, target_dtype: dtype, ..Self::default() }
    }

    /// No float8 cast.
    pub fn disabled() -> Self {
        Self { scaling_type: ScalingType::Disabled, ..Self::default() }
    }
}

/// torchao's `Float8GemmConfig`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GemmConfig {
    /// `_scaled_mm`'s `use_fast_accum`.
    pub use_fast_accum: bool,
}

/// Transformer Engine's format choice: e4m3 everywhere, or e4m3 forward and e5m2 backward.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Fp8Format {
    /// e4m3 for input and weight, e5m2 for grad_output (TE's default).
    #[default]
    #[serde(rename = "HYBRID")]
    Hybrid,
    /// e4m3 for every tensor.
    #[serde(rename = "E4M3")]
    E4m3,
}

/// How delayed scaling picks the amax from the history.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum AmaxComputeAlgo {
    /// The largest amax of the history window (TE's default).
    #[default]
    Max,
    /// The amax of the last step.
    MostRecent,
}

/// Transformer Engine's `DelayedScaling` recipe: each tensor is cast with the scale computed
/// from the amaxes of earlier steps (kept in a history), and its own amax joins the history.
/// See `docs/float8.md` for the algorithm; TE's `reduce_amax`, `fp8_dpa`, `fp8_mha` and
/// callable algorithms are not supported (an unknown field when parsed).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DelayedScaling {
    /// The scale is `(fp8_max / amax) / 2^margin`.
    pub margin: i32,
    /// The float8 types.
    pub fp8_format: Fp8Format,
    /// The length of the amax history window (at least 1).
    pub amax_history_len: usize,
    /// `max` or `most_recent`.
    pub amax_compute_algo: AmaxComputeAlgo,
}

impl Default for DelayedScaling {
    /// TE's defaults: margin 0, HYBRID, a history of 1024, `max`.
    fn default() -> Self {
        Self {
            margin: 0,
            fp8_format: Fp8Format::Hybrid,
            amax_history_len: 1024,
            amax_compute_algo: AmaxComputeAlgo::Max,
        }
    }
}

/// torchao's `Float8LinearConfig`: how the three GEMMs of a float8 linear layer cast their
/// operands. `Default` is torchao's default (the "tensorwise" recipe); [`Self::from_recipe_name`]
/// gives torchao's recipes, [`Self::from_toml`] reads one from text (unknown fields are an
/// error). A `*_for_*` field left `None` takes the operand's main cast config, as in torchao.
///
/// torchao's `enable_fsdp_float8_all_gather` and the deprecated
/// `force_recompute_fp8_weight_in_bwd` have no counterpart. `delayed_scaling` replaces dynamic
/// scaling by Transformer Engine's algorithm (tensorwise casts only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Float8LinearConfig {
    /// `input` in the output GEMM.
    pub cast_config_input: CastConfig,
    /// `input` in the grad_weight GEMM.
    pub cast_config_input_for_grad_weight: Option<CastConfig>,
    /// `weight` in the output GEMM.
    pub cast_config_weight: CastConfig,
    /// `weight` in the grad_input GEMM.
    pub cast_config_weight_for_grad_input: Option<CastConfig>,
    /// `grad_output` in the grad_input GEMM.
    pub cast_config_grad_output: CastConfig,
    /// `grad_output` in the grad_weight GEMM.
    pub cast_config_grad_output_for_grad_weight: Option<CastConfig>,
    /// The output GEMM (fast accumulation by default, as torchao).
    pub gemm_config_output: GemmConfig,
    /// The grad_input GEMM.
    pub gemm_config_grad_input: GemmConfig,
    /// The grad_weight GEMM.
    pub gemm_config_grad_weight: GemmConfig,
    /// Pad the GEMMs' inner dimension with zeros to a multiple of 16.
    pub pad_inner_dim: bool,
    /// Dequantize to fp32 and run `mm` instead of `_scaled_mm`.
    pub emulate: bool,
    /// Round every scale down to a power of two (the rowwise recipes).
    pub round_scales_to_power_of_2: bool,
    /// Transformer Engine's delayed scaling instead of dynamic scaling.
    pub delayed_scaling: Option<DelayedScaling>,
}

impl Default for Float8LinearConfig {
    fn default() -> Self {
        Self {
            cast_config_input: CastConfig::default(),
            cast_config_input_for_grad_weight: None,
            cast_config_weight: CastConfig::default(),
            cast_config_weight_for_grad_input: None,
            cast_config_grad_output: CastConfig::default(),
            cast_config_grad_output_for_grad_weight: None,
            gemm_config_output: GemmConfig { use_fast_accum: true },
            gemm_config_grad_input: GemmConfig::default(),
            gemm_config_grad_weight: GemmConfig::default(),
            pad_inner_dim: false,
            emulate: false,
            round_scales_to_power_of_2: false,
            delayed_scaling: None,
        }
    }
}

/// How one operand is cast, resolved (defaults filled in).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Cast {
    /// High precision.
    Disabled,
    /// Dynamic scaling to `dtype`; `axiswise`: one scale per slice.
    Dynamic { dtype: Float8Dtype, axiswise: bool },
}

/// A validated [`Float8LinearConfig`] with every default applied.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Resolved {
    pub input: Cast,
    pub input_for_grad_weight: Cast,
    pub weight: Cast,
    pub weight_for_grad_input: Cast,
    pub grad_output: Cast,
    pub grad_output_for_grad_weight: Cast,
    pub fast_accum_output: bool,
    pub fast_accum_grad_input: bool,
    pub fast_accum_grad_weight: bool,
    pub pad_inner_dim: bool,
    pub emulate: bool,
    pub pow2: bool,
    pub delayed: Option<DelayedScaling>,
}

fn invalid(option: &'static str, value: impl std::fmt::Debug, expected: &'static str) -> AmpError {
    AmpError::Config(ConfigError::InvalidOption { option, value: format!("{value:?}"), expected })
}

impl Float8LinearConfig {
    /// torchao's `Float8LinearConfig.from_recipe_name`: `"tensorwise"` (the default config),
    /// `"rowwise"` (axiswise e4m3 everywhere, scales rounded to powers of two) or
    /// `"rowwise_with_gw_hp"` (rowwise, with the grad_weight GEMM in high precision and the
    /// weight tensorwise for grad_input).
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`] for another name.
    pub fn from_recipe_name(name: &str) -> Result<Self> {
        let e4m3 = Some(Float8Dtype::E4m3fn);
        match name {
            "tensorwise" => Ok(Self::default()),
            "rowwise" => Ok(Self {
                cast_config_input: CastConfig::axiswise(e4m3),
                cast_config_weight: CastConfig::axiswise(e4m3),
                cast_config_grad_output: CastConfig::axiswise(e4m3),
                round_scales_to_power_of_2: true,
                ..Self::default()
            }),
            "rowwise_with_gw_hp" => Ok(Self {
                cast_config_input: CastConfig::axiswise(None),
                cast_config_weight: CastConfig::axiswise(None),
                cast_config_grad_output: CastConfig::axiswise(e4m3),
                cast_config_weight_for_grad_input: Some(CastConfig::default()),
                cast_config_input_for_grad_weight: Some(CastConfig::disabled()),
                cast_config_grad_output_for_grad_weight: Some(CastConfig {
                    target_dtype: e4m3,
                    ..CastConfig::disabled()
                }),
                round_scales_to_power_of_2: true,
                ..Self::default()
            }),
            other => Err(invalid("recipe_name", other, "\"tensorwise\", \"rowwise\" or \"rowwise_with_gw_hp\"")),
        }
    }

    /// This config with Transformer Engine's delayed scaling (the casts must stay tensorwise).
    pub fn delayed_scaling(mut self, recipe: DelayedScaling) -> Self {
        self.delayed_scaling = Some(recipe);
        self
    }

    /// Reads a config from TOML (the field names of this struct, torchao's; `[delayed_scaling]`
    /// for TE's recipe) and validates it.
    ///
    /// ```
    /// use tch_amp::float8::Float8LinearConfig;
    /// let c = Float8LinearConfig::from_toml("[cast_config_input]\nscaling_type = \"disabled\"\n");
    /// assert!(c.is_err()); // the weight is still cast for the same GEMM: torchao refuses this too
    /// let c = Float8LinearConfig::from_toml("[delayed_scaling]\namax_history_len = 16\nmargin = 1\n");
    /// assert_eq!(c.unwrap().delayed_scaling.unwrap().amax_history_len, 16);
    /// ```
    ///
    /// # Errors
    /// [`ConfigError::Parse`] for malformed TOML, an unknown field or value; as
    /// [`Self::validate`].
    pub fn from_toml(text: &str) -> Result<Self> {
        let config: Self = toml::from_str(text).map_err(|e| {
            AmpError::Config(ConfigError::Parse { what: "Float8LinearConfig TOML".to_string(), message: e.to_string() })
        })?;
        config.validate()?;
        Ok(config)
    }

    /// Checks torchao's rules (and delayed scaling's).
    ///
    /// # Errors
    /// [`ConfigError::InvalidOption`]: axiswise granularity with scaling disabled; a GEMM with
    /// one operand disabled and the other not; one operand cast to two float8 types in its two
    /// GEMMs; delayed scaling with axiswise or disabled casts, with power-of-two scales, with a
    /// target dtype its format does not give, a history length of 0 or a margin outside
    /// -100..=100.
    pub fn validate(&self) -> Result<()> {
        self.resolve().map(|_| ())
    }

    pub(crate) fn resolve(&self) -> Result<Resolved> {
        let configs = [
            ("cast_config_input", self.cast_config_input),
            ("cast_config_weight", self.cast_config_weight),
            ("cast_config_grad_output", self.cast_config_grad_output),
            ("cast_config_input_for_grad_weight", self.input_for_grad_weight()),
            ("cast_config_weight_for_grad_input", self.weight_for_grad_input()),
            ("cast_config_grad_output_for_grad_weight", self.grad_output_for_grad_weight()),
        ];
        for (name, c) in configs {
            if c.scaling_granularity == ScalingGranularity::Axiswise && c.scaling_type == ScalingType::Disabled {
                return Err(invalid(name, c, "axiswise granularity with dynamic scaling"));
            }
        }
        let disabled = |c: CastConfig| c.scaling_type == ScalingType::Disabled;
        for (a, b, gemm) in [
            (self.cast_config_input, self.cast_config_weight, "the output GEMM"),
            (self.cast_config_grad_output, self.weight_for_grad_input(), "the grad_input GEMM"),
            (self.input_for_grad_weight(), self.grad_output_for_grad_weight(), "the grad_weight GEMM"),
        ] {
            if disabled(a) != disabled(b) {
                return Err(invalid(
                    "scaling_type",
                    gemm,
                    "both operands of a GEMM in float8, or both disabled (incompatible operand precision)",
                ));
            }
        }
        let delayed = self.delayed_scaling;
        let (fwd, bwd) = match delayed.map(|d| d.fp8_format) {
            Some(Fp8Format::E4m3) => (Float8Dtype::E4m3fn, Float8Dtype::E4m3fn),
            _ => (Float8Dtype::E4m3fn, Float8Dtype::E5m2),
        };
        let mut dtypes = [fwd; 3];
        for (i, (name, a, b, default)) in [
            ("input", self.cast_config_input, self.input_for_grad_weight(), fwd),
            ("weight", self.cast_config_weight, self.weight_for_grad_input(), fwd),
            ("grad_output", self.cast_config_grad_output, self.grad_output_for_grad_weight(), bwd),
        ]
        .into_iter()
        .enumerate()
        {
            let (da, db) = (a.target_dtype.unwrap_or(default), b.target_dtype.unwrap_or(default));
            if da != db {
                return Err(invalid(name, (da, db), "one float8 type for an operand in both GEMMs it is used in"));
            }
            if delayed.is_some() && da != default {
                return Err(invalid(name, da, "the float8 type delayed_scaling.fp8_format gives"));
            }
            dtypes[i] = da;
        }
        if let Some(d) = delayed {
            for (name, c) in configs {
                if c.scaling_type != ScalingType::Dynamic || c.scaling_granularity != ScalingGranularity::Tensorwise {
                    return Err(invalid(name, c, "dynamic tensorwise casts with delayed_scaling"));
                }
            }
            if self.round_scales_to_power_of_2 {
                return Err(invalid("round_scales_to_power_of_2", true, "false with delayed_scaling"));
            }
            if d.amax_history_len == 0 {
                return Err(invalid("delayed_scaling.amax_history_len", 0, "at least 1"));
            }
            if !(-100..=100).contains(&d.margin) {
                return Err(invalid("delayed_scaling.margin", d.margin, "an integer in -100..=100"));
            }
        }
        let cast = |c: CastConfig, dtype: Float8Dtype| match c.scaling_type {
            ScalingType::Disabled => Cast::Disabled,
            ScalingType::Dynamic => {
                Cast::Dynamic { dtype, axiswise: c.scaling_granularity == ScalingGranularity::Axiswise }
            }
        };
        let [d_in, d_w, d_go] = dtypes;
        Ok(Resolved {
            input: cast(self.cast_config_input, d_in),
            input_for_grad_weight: cast(self.input_for_grad_weight(), d_in),
            weight: cast(self.cast_config_weight, d_w),
            weight_for_grad_input: cast(self.weight_for_grad_input(), d_w),
            grad_output: cast(self.cast_config_grad_output, d_go),
            grad_output_for_grad_weight: cast(self.grad_output_for_grad_weight(), d_go),
            fast_accum_output: self.gemm_config_output.use_fast_accum,
            fast_accum_grad_input: self.gemm_config_grad_input.use_fast_accum,
            fast_accum_grad_weight: self.gemm_config_grad_weight.use_fast_accum,
            pad_inner_dim: self.pad_inner_dim,
            emulate: self.emulate,
            pow2: self.round_scales_to_power_of_2,
            delayed,
        })
    }

    fn input_for_grad_weight(&self) -> CastConfig {
        self.cast_config_input_for_grad_weight.unwrap_or(self.cast_config_input)
    }

    fn weight_for_grad_input(&self) -> CastConfig {
        self.cast_config_weight_for_grad_input.unwrap_or(self.cast_config_weight)
    }

    fn grad_output_for_grad_weight(&self) -> CastConfig {
        self.cast_config_grad_output_for_grad_weight.unwrap_or(self.cast_config_grad_output)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_err(text: &str) -> String {
        match Float8LinearConfig::from_toml(text) {
            Err(AmpError::Config(ConfigError::Parse { message, .. })) => message,
            other => panic!("expected a parse error, got {other:?}"),
        }
    }

    #[test]
    fn recipes_resolve_as_torchao() {
        let t = Float8LinearConfig::from_recipe_name("tensorwise").unwrap().resolve().unwrap();
        assert_eq!(t.input, Cast::Dynamic { dtype: Float8Dtype::E4m3fn, axiswise: false });
        assert_eq!(t.grad_output_for_grad_weight, Cast::Dynamic { dtype: Float8Dtype::E5m2, axiswise: false });
        assert!(t.fast_accum_output && !t.fast_accum_grad_input && !t.pow2);
        let r = Float8LinearConfig::from_recipe_name("rowwise").unwrap().resolve().unwrap();
        assert_eq!(r.grad_output, Cast::Dynamic { dtype: Float8Dtype::E4m3fn, axiswise: true });
        assert!(r.pow2);
        let h = Float8LinearConfig::from_recipe_name("rowwise_with_gw_hp").unwrap().resolve().unwrap();
        assert_eq!(h.input_for_grad_weight, Cast::Disabled);
        assert_eq!(h.weight_for_grad_input, Cast::Dynamic { dtype: Float8Dtype::E4m3fn, axiswise: false });
        assert!(Float8LinearConfig::from_recipe_name("blockwise").is_err());
    }

    #[test]
    fn toml_rejects_unknown_fields_and_values() {
        assert!(parse_err("enable_fsdp_float8_all_gather = true").contains("unknown field"));
        assert!(parse_err("[delayed_scaling]\nreduce_amax = true").contains("unknown field"));
        assert!(parse_err("[delayed_scaling]\namax_compute_algo = \"mean\"").contains("unknown variant"));
        assert!(parse_err("[cast_config_input]\ntarget_dtype = \"e4m3\"").contains("unknown variant"));
        assert!(parse_err("emulate = 1").contains("invalid type"));
    }

    #[test]
    fn torchao_rules_are_checked() {
        let bad =
            |c: Float8LinearConfig| matches!(c.validate(), Err(AmpError::Config(ConfigError::InvalidOption { .. })));
        let d = Float8LinearConfig::default();
        assert!(bad(Float8LinearConfig { cast_config_input: CastConfig::disabled(), ..d }));
        assert!(bad(Float8LinearConfig {
            cast_config_weight: CastConfig {
                scaling_granularity: ScalingGranularity::Axiswise,
                ..CastConfig::disabled()
            },
            ..d
        }));
        assert!(bad(Float8LinearConfig {
            cast_config_input_for_grad_weight: Some(CastConfig {
                target_dtype: Some(Float8Dtype::E5m2),
                ..CastConfig::default()
            }),
            ..d
        }));
        let delayed = d.delayed_scaling(DelayedScaling::default());
        assert!(delayed.validate().is_ok());
        assert!(bad(Float8LinearConfig::from_recipe_name("rowwise")
            .unwrap()
            .delayed_scaling(DelayedScaling::default())));
        assert!(bad(d.delayed_scaling(DelayedScaling { amax_history_len: 0, ..DelayedScaling::default() })));
        assert!(bad(d.delayed_scaling(DelayedScaling { margin: 1000, ..DelayedScaling::default() })));
        let e4m3 = d.delayed_scaling(DelayedScaling { fp8_format: Fp8Format::E4m3, ..DelayedScaling::default() });
        assert_eq!(e4m3.resolve().unwrap().grad_output, Cast::Dynamic { dtype: Float8Dtype::E4m3fn, axiswise: false });
    }
}
