//! Training checkpoints that resume bit-exactly: model variables (fp32, taken from the
//! masters where there are masters, so nothing is rebuilt from fp16 as in Apex), each
//! optimizer's [`crate::optim::OptimizerRecord`] (moments, step counts, learning rates) and the loss
//! scalers, in one safetensors file written atomically. Loading checks everything first and
//! changes nothing on a mismatch.
//!
//! Layout: tensors `model/<name>`, `optimizer<i>/<name>/<buffer>` and
//! `optimizer<i>/<name>/step` (I64), and one metadata entry `tch_amp` holding the metadata as
//! JSON (one key, so the file's bytes do not depend on a hash map's order).
//!
//! [`crate::save_checkpoint`] and [`crate::load_checkpoint`] save and resume everything; the
//! partial loads [`load_model_weights`] and [`load_optimizer_state`] take one part (torch's
//! `model.load_state_dict` / `optimizer.load_state_dict`) and report what they left out
//! ([`LoadReport`]). [`save_checkpoint_with`] adds the rest of a training state (epoch,
//! arguments, an EMA's weights: [`TrainingState`]) to the same atomic write;
//! [`read_training_state`] reads it back.
pub(crate) mod file;

pub use file::{
    load_model_weights, load_optimizer_state, read_training_state, save_checkpoint_with, LoadReport, TrainingState,
};
