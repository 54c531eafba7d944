//! Model conversion, as `apex.fp16_utils`' `network_to_half`, `BN_convert_float`,
//! `convert_network` and `FP16Model`: every floating variable of the `VarStore` to fp16 except
//! those of affine batch norms (a module holding `weight`, `running_mean` and `running_var`),
//! which stay (or become) fp32; the returned model casts its floating inputs to fp16.
use crate::error::ConfigError;
use tch::nn::VarStore;
use tch::Kind;

use crate::error::Result;
use crate::model::{batchnorm_modules, cast_var_store, parent_path, set_kind, AmpModel, CastReport};

/// Apex's `network_to_half(network)`: `nn.Sequential(tofp16(), BN_convert_float(network.half()))`.
/// Casts every floating variable of `vs` to fp16 in place, then makes the variables of affine
/// batch norms fp32 again (their running statistics too, as `module.float()` does), and wraps
/// `model` so that its floating inputs are cast to fp16 (outputs are left as the model makes
/// them, fp16 for most networks).
///
/// # Errors
/// [`crate::AmpError::Torch`] if a cast fails (not expected).
pub fn network_to_half<M>(vs: &VarStore, model: M) -> Result<AmpModel<M>> {
    cast_var_store(vs, Kind::Half, true)?;
    Ok(AmpModel::new(model, Some(Kind::Half), None))
}

/// Apex's `FP16Model(network)` (`convert_network(network, torch.half)` and inputs cast to
/// fp16): the same result as [`network_to_half`] (Apex's two differ only in how they walk the
/// modules). Returns what was cast and what was kept.
///
/// # Errors
/// As [`network_to_half`].
pub fn fp16_model<M>(vs: &VarStore, model: M) -> Result<(AmpModel<M>, CastReport)> {
    let report = convert_network(vs, Kind::Half)?;
    Ok((AmpModel::new(model, Some(Kind::Half), None), report))
}

/// Apex's `convert_network(network, dtype)`: every floating variable to `kind` except those of
/// affine batch norms, which are left as they are.
///
/// # Errors
/// [`ConfigError::InvalidOption`] for a `kind` that is not floating; as [`network_to_half`].
pub fn convert_network(vs: &VarStore, kind: Kind) -> Result<CastReport> {
    if !crate::dtype::is_floating(kind) {
        return Err(crate::AmpError::Config(ConfigError::InvalidOption {
            option: "dtype",
            value: format!("{kind:?}"),
            expected: "a floating dtype (Kind::Half, Kind::BFloat16, Kind::Float, Kind::Double)",
        }));
    }
    crate::model::cast_var_store_as(vs, kind, crate::model::BatchNormCast::Keep)
}

/// Apex's `BN_convert_float(module)`: the floating variables of every affine batch norm of
/// `vs` to fp32 (weight, bias and running statistics); everything else is left alone. Returns
/// the names made fp32.
///
/// # Errors
/// As [`network_to_half`].
pub fn bn_convert_float(vs: &VarStore) -> Result<Vec<String>> {
    let vars = vs.variables();
    let bn = batchnorm_modules(vars.keys().map(String::as_str));
    let mut names: Vec<&String> = vars.keys().filter(|n| bn.contains(parent_path(n))).collect();
    names.sort();
    let _no_grad = tch::no_grad_guard();
    let mut done = Vec::new();
    for name in names {
        let var = &vars[name];
        if crate::dtype::is_floating(var.kind()) {
            if var.kind() != Kind::Float {
                set_kind(var, Kind::Float)?;
            }
            done.push(name.clone());
        }
    }
    Ok(done)
}
