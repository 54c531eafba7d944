//! How a `torch.save` checkpoint that does not fit is reported: as [`AmpError`]s of the
//! [`StateError`](crate::error::StateError) group (the place in the file in the message), files
//! that cannot be read at all as [`AmpError::File`].
use crate::error::{AmpError, StateError};

/// [`StateError::StateMismatch`] for a value of the right type with an impossible content at
/// `path` (a negative `step`, a state for a parameter index no group lists, ...).
pub(crate) fn bad_value(path: impl std::fmt::Display, message: impl std::fmt::Display) -> AmpError {
    AmpError::State(StateError::StateMismatch { message: format!("{path}: {message}") })
}

/// What a strict load's key mismatch suggests: when every unexpected key is a missing name
/// behind one prefix, the [`super::KeyPrefix`] that strips it; when every missing name is an
/// unexpected key behind one prefix, that the file lacks it; else a non-strict load.
pub(crate) fn mismatch_remedy(missing: &[String], unexpected: &[String]) -> String {
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
