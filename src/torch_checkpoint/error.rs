//! The errors of [`crate::torch_checkpoint`]: a `torch.save` checkpoint that does not fit the
//! model, optimizers or `Amp` it is loaded into (or options that do not fit the call). Files
//! that cannot be read at all are [`crate::torch_io::TorchIoError`]s, wrapped in
//! [`TorchCheckpointError::File`]; entries of the wrong type or missing entries too (their
//! messages name the path in the file: `optimizer.param_groups.0.lr`). What tch-amp itself
//! refuses (an amp state the scalers reject, a libtorch failure) is wrapped in
//! [`TorchCheckpointError::Amp`].
use tch::Kind;

/// The result of [`crate::torch_checkpoint`]'s functions.
pub type Result<T, E = TorchCheckpointError> = std::result::Result<T, E>;

/// What does not fit. Every load that fails with one of these changed nothing.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TorchCheckpointError {
    /// Strict loading: the model state dict and the `VarStore` hold different names (torch's
    /// `load_state_dict(strict=True)` refuses this too). `TorchLoadOptions::strict(false)`
    /// loads the names both have and reports the others.
    /// When the two sides differ by a prefix on every key (a wrapper's `module.` or
    /// `_orig_mod.` that [`super::KeyPrefix::Auto`] did not strip, or another), the message
    /// names the [`super::KeyPrefix`] that fixes it.
    #[error(
        "the model state dict does not match the VarStore: missing {missing:?}, unexpected {unexpected:?}; {}",
        mismatch_remedy(.missing, .unexpected)
    )]
    KeysMismatch {
        /// `VarStore` variables the state dict lacks.
        missing: Vec<String>,
        /// State dict entries no variable takes (`num_batches_tracked` is never one of them).
        unexpected: Vec<String>,
    },
    /// A tensor of another shape than the variable or parameter it goes to.
    #[error("{path} has shape {found:?}, but {target} has shape {expected:?}")]
    ShapeMismatch {
        /// Where in the file.
        path: String,
        /// The variable or parameter (VarStore name).
        target: String,
        /// Its shape.
        expected: Vec<i64>,
        /// The file's shape.
        found: Vec<i64>,
    },
    /// A tensor whose dtype cannot go where it should: an integer tensor for a floating
    /// variable or the other way round, or any difference under
    /// [`super::TorchLoadOptions::exact_dtypes`].
    #[error("{path} has dtype {found:?}, which cannot be loaded into {target}: expected {expected}")]
    DtypeMismatch {
        /// Where in the file.
        path: String,
        /// The variable or parameter (VarStore name).
        target: String,
        /// What is accepted, in words.
        expected: String,
        /// The file's dtype.
        found: Kind,
    },
    /// A weight, buffer or optimizer state holding inf or NaN.
    #[error("{path} holds inf or NaN: the run that wrote it had already diverged; resume from an earlier checkpoint")]
    NonFinite {
        /// Where in the file.
        path: String,
    },
    /// An optimizer state dict over another number of parameters than the optimizer holds.
    #[error(
        "{path}: the file's param_groups list {in_file} parameters, optimizer {optimizer} holds {in_optimizer}: the \
         checkpoint was written for another model or another parameter selection"
    )]
    ParamCount {
        /// Which optimizer (position in the slice given).
        optimizer: usize,
        /// The optimizer state dict's path in the file.
        path: String,
        /// Parameters in the file.
        in_file: usize,
        /// Parameters of the optimizer.
        in_optimizer: usize,
    },
    /// A state dict of another optimizer class.
    #[error("{path} holds the state of a {in_file} optimizer, but optimizer {optimizer} is {in_optimizer}")]
    OptimizerKind {
        /// Which optimizer.
        optimizer: usize,
        /// The optimizer state dict's path in the file.
        path: String,
        /// The class the file's hyper-parameters describe.
        in_file: String,
        /// The optimizer's kind.
        in_optimizer: String,
    },
    /// A hyper-parameter of a param group that differs from the optimizer's group's own under
    /// [`super::TorchLoadOptions::strict_hyper_parameters`] (by default the file's values are
    /// taken, as torch's `load_state_dict` takes them), or two values (learning rates,
    /// hyper-parameters) that two of the file's groups give one parameter group of the optimizer.
    #[error("{path}: {name} is {in_file} in the file, {in_optimizer} in optimizer {optimizer}: {remedy}")]
    HyperParameter {
        /// Which optimizer.
        optimizer: usize,
        /// The param group's path in the file.
        path: String,
        /// torch's name of the hyper-parameter.
        name: String,
        /// The file's value.
        in_file: String,
        /// The optimizer's value.
        in_optimizer: String,
        /// What to do.
        remedy: &'static str,
    },
    /// An optimizer whose update rule has no torch.optim or `apex.optimizers` form (a user's
    /// [`crate::UpdateRule`]): a torch checkpoint cannot hold its state. tch-amp's own
    /// checkpoints ([`crate::save_checkpoint`]) hold any rule's.
    #[error(
        "optimizer {optimizer} runs the update rule {kind:?}, which has no torch.optim or apex.optimizers form: save \
         it with tch_amp::save_checkpoint"
    )]
    NoTorchForm {
        /// Which optimizer.
        optimizer: usize,
        /// Its rule's kind ([`crate::UpdateRule::kind`]).
        kind: String,
    },
    /// torch's parameter order (the `params` lists of `param_groups`) cannot be mapped onto
    /// the optimizer's parameters without guessing.
    #[error(
        "optimizer {optimizer}: cannot tell which parameter each index of the file's param_groups is: {reason}; \
         give the order with TorchLoadOptions::param_order"
    )]
    ParamOrder {
        /// Which optimizer.
        optimizer: usize,
        /// Why.
        reason: String,
    },
    /// The checkpoint dict lacks an entry the options say to read (the model's, an
    /// optimizer's, the loss scalers', the master parameters'). The message names the option
    /// that names the entry, or leaves it out.
    #[error("the checkpoint has no {key:?} entry ({holds}): {remedy}")]
    MissingEntry {
        /// The key looked for.
        key: String,
        /// What it would hold.
        holds: &'static str,
        /// The option to use.
        remedy: &'static str,
    },
    /// A value with the right type but an impossible content (a negative `step`, a state for a
    /// parameter index no group lists, a parameter listed twice, ...).
    #[error("{path}: {message}")]
    BadValue {
        /// Where in the file.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// Options that do not fit the call: another number of optimizers than optimizer keys, an
    /// extra entry named like the model, optimizer or amp entry, a `param_order` for an
    /// optimizer that was not given.
    #[error("{message}")]
    Options {
        /// What is wrong and what to do.
        message: String,
    },
    /// The file cannot be read or written as a `torch.save` file (see [`crate::torch_io`]).
    #[error(transparent)]
    File(#[from] crate::torch_io::TorchIoError),
    /// tch-amp refused or failed (an amp state the scalers reject, a libtorch call).
    #[error(transparent)]
    Amp(#[from] crate::AmpError),
}

/// What a strict load's key mismatch suggests: when every unexpected key is a missing name
/// behind one prefix, the [`super::KeyPrefix`] that strips it; when every missing name is an
/// unexpected key behind one prefix, that the file lacks it; else a non-strict load.
fn mismatch_remedy(missing: &[String], unexpected: &[String]) -> String {
    fn common(longer: &[String], shorter: &[String]) -> Option<String> {
        let first = longer.first()?;
        let candidates = shorter.iter().filter_map(|m| {
            first.strip_suffix(m.as_str()).filter(|p| !p.is_empty() && (p.ends_with('.') || m.is_empty()))
        });
        let mut candidates: Vec<&str> = candidates.collect();
        candidates.sort_by_key(|p| p.len());
        candidates
            .into_iter()
            .find(|p| longer.iter().all(|k| k.strip_prefix(p).is_some_and(|rest| shorter.iter().any(|m| m == rest))))
            .map(str::to_string)
    }
    if let Some(p) = common(unexpected, missing) {
        return format!(
            "every unexpected key is a missing name behind the prefix {p:?}: load with \
             TorchLoadOptions::key_prefix(KeyPrefix::Strip({p:?}.into()))"
        );
    }
    if let Some(p) = common(missing, unexpected) {
        return format!(
            "the VarStore's names carry the prefix {p:?}, which the file's keys lack: build the model under a \
             path without it, or save the file with that prefix (TorchSaveOptions::key_prefix)"
        );
    }
    "load with TorchLoadOptions::strict(false)".into()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(v: &[&str]) -> Vec<String> {
        v.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_mismatch_by_one_prefix_names_the_option() {
        let missing = names(&["fc.weight", "fc.bias"]);
        let unexpected = names(&["net.fc.bias", "net.fc.weight"]);
        let r = mismatch_remedy(&missing, &unexpected);
        assert!(r.contains("KeyPrefix::Strip(\"net.\""), "{r}");
        let r = mismatch_remedy(&unexpected, &missing);
        assert!(r.contains("carry the prefix \"net.\""), "{r}");
        let r = mismatch_remedy(&missing, &names(&["net.fc.weight", "other.x"]));
        assert_eq!(r, "load with TorchLoadOptions::strict(false)");
        assert_eq!(mismatch_remedy(&missing, &[]), "load with TorchLoadOptions::strict(false)");
    }
}
