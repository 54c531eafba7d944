//! The error type of [`crate::torch_io`].
use std::path::PathBuf;

use tch::TchError;

/// Everything that can go wrong reading or writing a `torch.save` file. A failed load returns
/// nothing and changes nothing; a failed save leaves any previous file in place.
///
/// Positions in the file are given as `offset` (bytes from the start of the pickle stream:
/// `data.pkl` inside a zip archive, the whole file for the legacy format). Positions in the
/// loaded tree are given as `path` (`optimizer.state.3.exp_avg`; a key holding a dot is shown
/// quoted: `model["fc1.weight"]`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TorchIoError {
    /// The file could not be opened, read, written, synced or renamed.
    #[error("I/O error while {op} {path}: {source}")]
    Io {
        /// What was being done ("reading", "writing", "renaming to", ...).
        op: &'static str,
        /// The file or folder.
        path: PathBuf,
        /// The operating system's error.
        #[source]
        source: std::io::Error,
    },
    /// The bytes are none of the containers `torch.save` writes (zip, legacy pickle stream).
    #[error(
        "not a torch.save file: {reason} (expected a zip archive holding data.pkl or a legacy pickle \
         stream starting with torch's magic number)"
    )]
    UnknownFormat {
        /// What was found instead.
        reason: String,
    },
    /// A tar archive, the container of torch < 0.1.10, which this reader does not read. torch
    /// itself still reads it under `weights_only=False` (it runs the file's pickles, so only
    /// for a file you trust): `torch.save(torch.load(path, weights_only=False), new_path)`
    /// writes the zip archive this reader reads.
    #[error(
        "a tar archive from torch < 0.1.10, which is not read: re-save it in Python with \
         torch.save(torch.load(path, weights_only=False), new_path) (only for a file you trust)"
    )]
    LegacyTar,
    /// The file ends before the structure it announces is complete.
    #[error("truncated file: {what} needs {needed} bytes at offset {offset}, but only {available} remain")]
    Truncated {
        /// What was being read.
        what: String,
        /// Where it starts.
        offset: u64,
        /// How many bytes it needs.
        needed: u64,
        /// How many bytes are left.
        available: u64,
    },
    /// A legacy file whose first pickle is not torch's magic number.
    #[error("wrong magic number {found}: this is not a legacy torch.save file (or it is corrupt)")]
    BadMagic {
        /// The value found, as text.
        found: String,
    },
    /// A legacy file with a protocol version other than 1001.
    #[error("unsupported legacy protocol version {found} (torch.save wrote 1001)")]
    BadProtocolVersion {
        /// The value found, as text.
        found: String,
    },
    /// The zip container is corrupt (bad central directory, checksum mismatch, ...).
    #[error("corrupt zip archive: {message}")]
    Zip {
        /// The zip reader's message.
        message: String,
    },
    /// A zip archive holding two entries of one name. torch.load reads the first, most zip
    /// tools the last: which one was meant is unknowable, so neither is read.
    #[error(
        "the archive holds two entries named {name:?}: refused (torch.load would read the first, zip tools the last)"
    )]
    DuplicateRecord {
        /// The name.
        name: String,
    },
    /// A zip archive with entries under more than one top folder: torch.save writes every
    /// record under one folder, and torch.load reads one folder's records, ignoring the rest.
    #[error(
        "the archive holds entries under {first:?} and {second:?}: torch.save writes one folder; \
         refused (split it into one archive per folder)"
    )]
    MixedFolders {
        /// The folder holding `data.pkl`.
        first: String,
        /// Another top-level folder (or a file outside any folder).
        second: String,
    },
    /// Reading would take more memory than the file's size justifies: a zip entry inflating
    /// beyond its ratio cap, objects a pickle copies or a tree its shared references expand
    /// past their byte budget. The bounds are stated in [`crate::torch_io`]'s module docs; a
    /// file torch.save wrote stays far below them.
    #[error("{what} exceeds its limit of {limit} bytes: the file is crafted or corrupt")]
    TooLarge {
        /// What grew too large.
        what: String,
        /// The limit, in bytes.
        limit: u64,
    },
    /// A record the container must hold is absent.
    #[error("the archive has no record {name:?}: {hint}")]
    MissingRecord {
        /// The record's name.
        name: String,
        /// What this usually means.
        hint: &'static str,
    },
    /// A record holds a value torch.load would reject (e.g. `byteorder` other than little/big).
    #[error("record {name:?} holds {found:?}: {expected}")]
    BadRecord {
        /// The record's name.
        name: String,
        /// What it holds (possibly cut).
        found: String,
        /// What is accepted.
        expected: &'static str,
    },
    /// A malformed pickle: stack underflow, a missing MARK, a memo index never stored, ...
    #[error("malformed pickle at offset {offset} (opcode {opcode}): {message}")]
    Pickle {
        /// Byte offset of the opcode.
        offset: u64,
        /// The opcode, as pickletools names it.
        opcode: String,
        /// What is wrong.
        message: String,
    },
    /// An opcode this reader does not implement (or a byte that is no opcode at all).
    #[error("unsupported pickle opcode 0x{opcode:02x} at offset {offset}")]
    UnknownOpcode {
        /// Byte offset.
        offset: u64,
        /// The byte.
        opcode: u8,
    },
    /// The pickle names a global outside the allow-list. Nothing is imported or executed: a
    /// torch.save file of tensors, containers and numbers never needs one. Full-model saves
    /// (`torch.save(model)`) name the model's classes; save `model.state_dict()` instead.
    #[error(
        "the pickle names the global {module}.{name} (offset {offset}), which is not allowed: only \
         containers, numbers, strings and tensors are read (save a state_dict, not a module or a \
         custom object)"
    )]
    DisallowedGlobal {
        /// Byte offset of the GLOBAL opcode.
        offset: u64,
        /// The module.
        module: String,
        /// The attribute.
        name: String,
    },
    /// An allowed global used in a way this reader does not support (a call with unexpected
    /// arguments, BUILD on a non-dict, a persistent id that is not a storage, ...).
    #[error("unsupported object at offset {offset}: {message}")]
    Unsupported {
        /// Byte offset of the opcode that built it.
        offset: u64,
        /// What and why.
        message: String,
    },
    /// A storage type or dtype that cannot be read into a tch tensor.
    #[error("unknown or unsupported tensor dtype {name} (offset {offset})")]
    UnknownDtype {
        /// Byte offset.
        offset: u64,
        /// The storage type or dtype name (`torch.QInt8Storage`, `torch.float8_e4m3fn`).
        name: String,
    },
    /// A tensor whose shape, strides and offset reach outside its storage, or are negative, or
    /// overflow. Checked before any view is made.
    #[error(
        "tensor at offset {offset} does not fit its storage {key:?}: size {size:?}, stride {stride:?}, \
         storage offset {storage_offset} need {needed} elements, the storage holds {storage_numel}"
    )]
    StorageOutOfBounds {
        /// Byte offset of the rebuild call.
        offset: u64,
        /// The storage key.
        key: String,
        /// The tensor's shape.
        size: Vec<i64>,
        /// The tensor's strides.
        stride: Vec<i64>,
        /// The tensor's storage offset, in elements.
        storage_offset: i64,
        /// Elements needed (`None`-like 0 when the arithmetic overflowed).
        needed: u64,
        /// Elements the storage holds.
        storage_numel: u64,
    },
    /// A storage's bytes in the file do not match the size its pickle declares.
    #[error("storage {key:?} should hold {expected} bytes, the file has {found}")]
    StorageSize {
        /// The storage key.
        key: String,
        /// Bytes declared by the pickle (numel × element size).
        expected: u64,
        /// Bytes found.
        found: u64,
    },
    /// A storage referenced by the pickle but absent from the file, or present in the file but
    /// declared inconsistently (two dtypes, two sizes).
    #[error("storage {key:?}: {message}")]
    StorageMismatch {
        /// The storage key.
        key: String,
        /// What is wrong.
        message: String,
    },
    /// A bool storage holding a byte other than 0 or 1.
    #[error("bool storage {key:?} holds the byte {byte} at element {index} (only 0 and 1 are valid)")]
    InvalidBool {
        /// The storage key.
        key: String,
        /// The element.
        index: u64,
        /// Its value.
        byte: u8,
    },
    /// A storage location (`cuda:0`, `mps`, ...) that cannot be mapped to a tch device.
    #[error("cannot place storage {key:?} saved on {location:?}: {message}; pass LoadOptions::map_location")]
    Location {
        /// The storage key.
        key: String,
        /// The location string from the file.
        location: String,
        /// Why.
        message: String,
    },
    /// A dict key that is neither a str nor an int.
    #[error("dict at {path} has a key of type {found}; only str and int keys are supported")]
    UnsupportedKey {
        /// The dict's path.
        path: String,
        /// The key's Python type.
        found: &'static str,
    },
    /// A pickle object that has no place in the tree (a storage, a dtype or a class on its own).
    #[error("{path} holds a {found}, which the value tree cannot represent")]
    UnsupportedValue {
        /// Where.
        path: String,
        /// What (`"storage"`, `"torch.float16"`, ...).
        found: String,
    },
    /// Nesting beyond the limit (or a self-referencing structure), in the tree or in nested
    /// rebuild calls.
    #[error("{what} at {path}: the limit is {limit}")]
    TooDeep {
        /// What overflowed ("nesting depth", "node count").
        what: &'static str,
        /// Where.
        path: String,
        /// The limit.
        limit: u64,
    },
    /// A value of another type than asked for.
    #[error("{path} is a {found}, expected {expected}")]
    TypeMismatch {
        /// Where.
        path: String,
        /// What was asked for.
        expected: &'static str,
        /// What is there.
        found: &'static str,
    },
    /// A key absent from a dict.
    #[error("{path} has no key {key}")]
    MissingKey {
        /// The dict's path.
        path: String,
        /// The key, as Python would print it.
        key: String,
    },
    /// An index past the end of a list or tuple.
    #[error("{path} has {len} elements, index {index} is out of range")]
    IndexOutOfRange {
        /// The sequence's path.
        path: String,
        /// The index.
        index: usize,
        /// Its length.
        len: usize,
    },
    /// An int that does not fit the type asked for.
    #[error("{path} holds {value}, which does not fit {target}")]
    IntOutOfRange {
        /// Where.
        path: String,
        /// The value, as text.
        value: String,
        /// The target type.
        target: &'static str,
    },
    /// A value that cannot be written: a sparse or quantized tensor, two dtypes viewing one
    /// storage, attributes on a plain dict, a str longer than 4 GiB, ...
    #[error("cannot save {path}: {message}")]
    CannotSave {
        /// Where in the tree.
        path: String,
        /// Why.
        message: String,
    },
    /// A libtorch call failed (its C++ exception, caught by tch).
    #[error("libtorch error while {context}: {source}")]
    Torch {
        /// What was being done.
        context: String,
        /// tch's error.
        #[source]
        source: TchError,
    },
}

/// `Result` with [`TorchIoError`].
pub type Result<T, E = TorchIoError> = std::result::Result<T, E>;

pub(crate) fn torch_err(context: impl Into<String>) -> impl FnOnce(TchError) -> TorchIoError {
    let context = context.into();
    move |source| TorchIoError::Torch { context, source }
}

pub(crate) fn io_err<'p>(
    op: &'static str,
    path: &'p std::path::Path,
) -> impl FnOnce(std::io::Error) -> TorchIoError + 'p {
    move |source| TorchIoError::Io { op, path: path.to_path_buf(), source }
}
