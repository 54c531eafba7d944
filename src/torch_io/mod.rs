//! Reading and writing PyTorch `torch.save` files (`.pt`, `.pth`), without Python.
//!
//! [`load`] reads the containers `torch.save` has written since torch 0.1.10 into a [`Value`]
//! tree: the zip archive (torch >= 1.6) and the legacy pickle stream (torch 0.1.10 to 1.5, or
//! `_use_new_zipfile_serialization=False`; Apex-era checkpoints), with tensors as tch [`Tensor`](tch::Tensor)s that
//! keep their dtype, shape, strides and storage offset, and share storage where the saved
//! tensors did (tied weights stay tied). [`save`] writes a tree back as the zip archive, in a
//! form that `torch.load(path)` reads under both `weights_only=True` (the default since torch
//! 2.6) and `weights_only=False`.
//!
//! ```
//! use tch::{Device, Kind, Tensor};
//! use tch_amp::torch_io::{self, Dict, Value};
//! # fn main() -> Result<(), tch_amp::torch_io::TorchIoError> {
//! let w = Tensor::arange(6, (Kind::Float, Device::Cpu)).reshape([2, 3]);
//! let model = Dict::new_ordered().with("fc.weight", Value::Tensor(w.shallow_clone()));
//! let ckpt = Value::Dict(Dict::new().with("epoch", Value::Int(3)).with("model", Value::Dict(model)));
//! let dir = std::env::temp_dir().join(format!("tch-amp-torch-io-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).unwrap();
//! let path = dir.join("ckpt.pt");
//! torch_io::save(&path, &ckpt)?; // torch.load(path) reads it in Python
//! let back = torch_io::load(&path)?;
//! assert_eq!(back.get("epoch")?.as_i64()?, 3);
//! assert!(back.get("model")?.get("fc.weight")?.as_tensor()?.equal(&w));
//! // Errors name the path: "model has no key \"fc.bias\"".
//! assert!(back.get("model")?.get("fc.bias").is_err());
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok(())
//! # }
//! ```
//!
//! ## Safety against hostile files
//! Unpickling is restricted to an allow-list, much like `torch.load(weights_only=True)`:
//! `collections.OrderedDict`, torch's tensor rebuild functions (`_rebuild_tensor`,
//! `_rebuild_tensor_v2`, `_rebuild_tensor_v3`, `_rebuild_parameter`,
//! `_rebuild_parameter_with_state`, `_rebuild_from_type_v2` for plain tensors), the storage
//! types (`torch.FloatStorage`, ..., `torch.cuda.HalfStorage`, ...), the dtypes, `torch.Size`,
//! and `_codecs.encode` / `bytearray` for bytes. Any other global is a
//! [`TorchIoError::DisallowedGlobal`] at the moment the pickle names it; nothing is ever
//! imported or executed. Every tensor's shape, strides and offset are checked against its
//! storage before libtorch sees them (in checked arithmetic), storage sizes against the bytes
//! in the file. A malformed file gives a typed error, never a panic or an out-of-bounds read.
//!
//! The reader's work is bounded by its input, whatever the file holds:
//! - **Stack**: independent of the file. The unpickler is a loop over an explicit stack; the
//!   one call that nests (`_rebuild_from_type_v2` wrapping another rebuild) is unrolled, at
//!   most 256 deep; the tree conversion recurses at most 256 containers deep (under 1.5 MiB
//!   of stack in a debug build, the tests run it on 2 MiB threads; far less optimized). Deeper
//!   is [`TorchIoError::TooDeep`].
//! - **Memory**: at most a small constant times the file's size, plus the tensor bytes the
//!   file holds. Strings and bytes are shared (`Rc`) inside the unpickler however often the
//!   pickle references them; containers are built once, and the calls that copy one
//!   (`OrderedDict(d)`, `torch.Size(l)`, `bytearray(b)`, BUILD) may copy at most 16 bytes per
//!   pickle byte; the [`Value`] tree owns its nodes, so shared references are expanded, at
//!   most 64 bytes of tree per pickle byte (a tensor node counts 512 bytes, its storage is
//!   shared). Each budget has a floor of 4 MiB. Past a budget: [`TorchIoError::TooLarge`].
//!   Each storage is read once into one tensor; dtype views of it (`_rebuild_tensor_v3`) share
//!   its memory. The zip reader holds one storage's bytes at a time besides the tensors.
//! - **Zip**: `data.pkl` is at most [`Limits::pickle_bytes`]; a stored entry at most the
//!   archive's size; a compressed entry (torch.save never compresses) is inflated to at most
//!   [`Limits::inflate_ratio`] times its compressed size, refused before inflating when its header claims more
//!   ([`TorchIoError::TooLarge`]), and never read past the size its header claims. An archive
//!   holding a name twice ([`TorchIoError::DuplicateRecord`]) or entries under two top
//!   folders ([`TorchIoError::MixedFolders`]) is refused: torch.load and zip tools would
//!   disagree on what it holds.
//! - **Time**: linear in the bytes above (the file, the budgets, the tensor bytes).
//!
//! ## Differences from `torch.load` / `torch.save`
//! - Only data is read: containers, numbers, strings, bytes and dense tensors. A pickled
//!   module (`torch.save(model)`), a numpy array or scalar, a set, a `torch.device`, sparse or
//!   quantized tensors are refused with a typed error naming what was found. Save
//!   `model.state_dict()`.
//! - Python ints beyond i64 are kept exactly as [`Value::BigInt`].
//! - `OrderedDict` attributes (a state dict's `_metadata`) are kept and written back; a
//!   tensor subclass's attributes (`_rebuild_from_type_v2` state) and backward hooks are
//!   dropped. `requires_grad` is restored.
//! - A Python 2 `str` (legacy files) becomes [`Value::Str`] when it is UTF-8, [`Value::Bytes`]
//!   otherwise.
//! - Bool storages must hold only 0 and 1.
//! - Storage views of old files (a legacy storage that is a slice of another): tch has
//!   no storage slices, so such tensors view the root storage, their `storage_offset()` counted
//!   from the root's start (Python counts from the slice's); memory and sharing are the same.
//! - Writing: a storage is written once, however many tensors view it, but only up to the
//!   last element any of them reaches (torch.save writes the whole storage), so a saved
//!   slice does not drag its whole parent along. Storage keys are "0", "1", ... in tree order.
//!   The whole file is built in a temporary file beside the target, synced and renamed over
//!   it: a failed save leaves the previous file as it was.
//!
//! - The tar archive of torch < 0.1.10 is not read: [`TorchIoError::LegacyTar`] says how to
//!   re-save it with torch.
//!
//! Legacy files are read into memory whole; zip archives are read record by record.
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

use tch::Device;

mod container;
mod debug;
mod error;
mod pickle_read;
mod pickle_write;
mod storage;
mod tree;
mod value;
mod walk;

pub use error::{Result, TorchIoError};
pub use value::{BigInt, Dict, Key, Node, Seg, Value};

use error::io_err;

/// Deepest nesting read or written (Python's own pickler stops near 1000 frames).
pub(crate) const MAX_DEPTH: usize = 256;

/// The container of a `torch.save` file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Format {
    /// Zip archive (`<name>/data.pkl`, `<name>/data/<key>`): torch >= 1.6.
    Zip,
    /// Legacy pickle stream: torch 0.1.10 to 1.5, or `_use_new_zipfile_serialization=False`.
    Legacy,
    /// Tar archive: torch < 0.1.10. Recognised, not read ([`TorchIoError::LegacyTar`]).
    Tar,
}

/// Options for [`load_with`] / [`load_bytes`].
#[derive(Debug, Clone, Default)]
pub struct LoadOptions {
    map_location: Option<Device>,
    limits: Limits,
}

/// Bounds on what reading one file may take, beyond the ones its own size sets. The defaults
/// read every file `torch.save` writes; a server reading untrusted files can tighten them
/// ([`LoadOptions::limits`]). A file over a limit is a [`TorchIoError::TooLarge`] or
/// [`TorchIoError::TooDeep`], raised before the memory it would take is allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// The largest pickle stream (the tree without the tensors' data), in bytes. Default 1 GiB.
    pub pickle_bytes: u64,
    /// The largest total of the tensors' storages, in bytes. Default: no bound beyond the
    /// file's own size (the data is in the file).
    pub storage_bytes: u64,
    /// How many times its compressed size a compressed zip entry may inflate to. Default 32.
    pub inflate_ratio: u64,
    /// The deepest nesting of containers. Default and largest: 256.
    pub depth: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self { pickle_bytes: 1 << 30, storage_bytes: u64::MAX, inflate_ratio: 32, depth: MAX_DEPTH }
    }
}

impl LoadOptions {
    /// Defaults: every storage goes to the device it was saved from, as `torch.load` without
    /// `map_location` does (a CUDA checkpoint needs CUDA).
    pub fn new() -> Self {
        Self::default()
    }

    /// Puts every tensor on `device` (`torch.load(..., map_location=device)`).
    pub fn map_location(mut self, device: Device) -> Self {
        self.map_location = Some(device);
        self
    }

    /// Reads under `limits` instead of [`Limits::default`] (a depth above the default is the
    /// default).
    pub fn limits(mut self, limits: Limits) -> Self {
        self.limits = Limits { depth: limits.depth.min(MAX_DEPTH), ..limits };
        self
    }
}

/// Which container `bytes` (the start of a file is enough: 512 bytes) hold, if any.
pub fn detect_format(bytes: &[u8]) -> Option<Format> {
    container::detect(bytes)
}

/// Reads a `torch.save` file, tensors on the devices they were saved from.
///
/// # Errors
/// See [`load_with`].
pub fn load(path: impl AsRef<Path>) -> Result<Value> {
    load_with(path, &LoadOptions::default())
}

/// Reads a `torch.save` file.
///
/// # Errors
/// [`TorchIoError::Io`] when the file cannot be read; [`TorchIoError::UnknownFormat`],
/// [`TorchIoError::LegacyTar`], [`TorchIoError::Zip`], [`TorchIoError::DuplicateRecord`],
/// [`TorchIoError::MixedFolders`], [`TorchIoError::TooLarge`], [`TorchIoError::TooDeep`],
/// [`TorchIoError::BadMagic`], [`TorchIoError::Truncated`],
/// [`TorchIoError::Pickle`], [`TorchIoError::DisallowedGlobal`],
/// [`TorchIoError::StorageOutOfBounds`], [`TorchIoError::UnknownDtype`] and the other
/// variants for malformed or unsupported content.
pub fn load_with(path: impl AsRef<Path>, options: &LoadOptions) -> Result<Value> {
    let path = path.as_ref();
    let mut file = std::fs::File::open(path).map_err(io_err("opening", path))?;
    let len = file.metadata().map_err(io_err("reading the size of", path))?.len();
    let mut head = Vec::with_capacity(512);
    (&mut file).take(512).read_to_end(&mut head).map_err(io_err("reading", path))?;
    match container::detect(&head) {
        Some(Format::Zip) => {
            file.seek(SeekFrom::Start(0)).map_err(io_err("reading", path))?;
            container::read_zip(std::io::BufReader::new(file), len, options)
        }
        Some(Format::Legacy) => {
            let mut data = head;
            data.reserve(len.saturating_sub(data.len() as u64) as usize);
            file.read_to_end(&mut data).map_err(io_err("reading", path))?;
            container::read_legacy(&data, options)
        }
        Some(Format::Tar) => Err(TorchIoError::LegacyTar),
        None => Err(container::unknown_format(&head)),
    }
}

/// Reads a `torch.save` file held in memory.
///
/// # Errors
/// As [`load_with`], less the I/O errors.
pub fn load_bytes(bytes: &[u8], options: &LoadOptions) -> Result<Value> {
    match container::detect(bytes) {
        Some(Format::Zip) => container::read_zip(std::io::Cursor::new(bytes), bytes.len() as u64, options),
        Some(Format::Legacy) => container::read_legacy(bytes, options),
        Some(Format::Tar) => Err(TorchIoError::LegacyTar),
        None => Err(container::unknown_format(bytes)),
    }
}

/// Writes `value` to `path` as `torch.save` does (zip container, pickle protocol 2), readable
/// by `torch.load` with `weights_only=True` or `False`.
///
/// The file is written to a temporary file in the same folder, synced, renamed over `path`,
/// and the folder synced: `path` holds either the previous file or the complete new one, and
/// no temporary file is left behind on error. A temp file left by a writer that was killed
/// (of this function or of [`crate::save_checkpoint`]) is removed by the next save into the
/// same folder.
///
/// # Errors
/// [`TorchIoError::CannotSave`] for values the format cannot hold (sparse or quantized
/// tensors, tensors on other devices than CPU/CUDA, two dtypes viewing one storage,
/// attributes on a plain dict), [`TorchIoError::TooDeep`], [`TorchIoError::Torch`] when
/// reading a tensor fails, [`TorchIoError::Io`] when the file cannot be written.
pub fn save(path: impl AsRef<Path>, value: &Value) -> Result<()> {
    let path = path.as_ref();
    // A value the format cannot hold fails inside the writer: kept here, the write aborted.
    let mut refused: Option<TorchIoError> = None;
    let written = crate::atomic_file::write_with(path, |w| match container::write_zip(w, value) {
        Ok(_) => Ok(()),
        Err(e) => {
            refused = Some(e);
            Err(std::io::Error::other("the value cannot be saved"))
        }
    });
    match (refused, written) {
        (Some(e), _) => Err(e),
        (None, Err(e)) => Err(TorchIoError::Io { op: "writing", path: path.to_path_buf(), source: e }),
        (None, Ok(())) => Ok(()),
    }
}

/// The bytes [`save`] would write.
///
/// # Errors
/// As [`save`], less the I/O errors.
pub fn save_bytes(value: &Value) -> Result<Vec<u8>> {
    Ok(container::write_zip(std::io::Cursor::new(Vec::new()), value)?.into_inner())
}
