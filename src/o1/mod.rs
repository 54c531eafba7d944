//! TEMPORARY STUB (core branch only): replaced by the real O1 engine on merge.
#![allow(missing_docs)]
pub fn without_casts<T>(f: impl FnOnce() -> T) -> crate::Result<T> {
    Ok(f())
}
pub fn clear_cast_cache() -> crate::Result<()> {
    Ok(())
}
