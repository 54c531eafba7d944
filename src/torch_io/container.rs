//! The containers `torch.save` writes around its pickle: the zip archive (torch >= 1.6) and
//! the legacy pickle stream (torch 0.1.10 - 1.5, `_use_new_zipfile_serialization=False`). The
//! tar archive of torch < 0.1.10 is recognised, and refused with [`TorchIoError::LegacyTar`].
use std::borrow::Cow;
use std::collections::HashMap;
use std::io::{Read, Seek, Write};

use zip::write::FileOptions;
use zip::{CompressionMethod, ZipArchive, ZipWriter};

use super::error::{Result, TorchIoError};
use super::pickle_read::{self, elem_size, Heap, HeapObj, Obj, Persistent, Pickle, StorageDecl, StorageTable};
use super::storage::{self, Materializer, StorageSource};
use super::tree;
use super::value::Value;
use super::{Format, Limits, LoadOptions};

/// torch's legacy magic number 0x1950a86a20f9469cfc6c, as pickle's LONG1 stores it.
const MAGIC: [u8; 10] = [0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19];
const PROTOCOL_VERSION: i64 = 1001;

/// Sniffs the container from the first bytes.
pub(crate) fn detect(head: &[u8]) -> Option<Format> {
    if head.starts_with(b"PK\x03\x04") || head.starts_with(b"PK\x05\x06") {
        Some(Format::Zip)
    } else if head.len() >= 262 && &head[257..262] == b"ustar" {
        Some(Format::Tar)
    } else if head.first() == Some(&0x80) {
        Some(Format::Legacy)
    } else {
        None
    }
}

pub(crate) fn unknown_format(head: &[u8]) -> TorchIoError {
    let shown: Vec<String> = head.iter().take(8).map(|b| format!("{b:02x}")).collect();
    TorchIoError::UnknownFormat {
        reason: if head.is_empty() {
            "the file is empty".into()
        } else {
            format!("it starts with {}", shown.join(" "))
        },
    }
}

fn zip_err(e: zip::result::ZipError) -> TorchIoError {
    match e {
        zip::result::ZipError::Io(io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
            TorchIoError::Zip { message: format!("unexpected end of archive (truncated file?): {io}") }
        }
        e => TorchIoError::Zip { message: e.to_string() },
    }
}

/// A persistent-id handler for pickles that must not have any.
struct NoPersistent;

impl Persistent for NoPersistent {
    fn load(&mut self, _pid: &Obj, _heap: &mut Heap, offset: u64) -> Result<Obj> {
        Err(TorchIoError::Unsupported { offset, message: "persistent id outside the object pickle".into() })
    }
}

// ---------------------------------------------------------------------------------------------
// zip

struct ZipSource<'a, R: Read + Seek> {
    archive: &'a mut ZipArchive<R>,
    prefix: String,
    total_len: u64,
    big_endian: bool,
    limits: Limits,
    /// Reused across storages: one allocation for the largest, not one per storage.
    scratch: Vec<u8>,
}

impl<R: Read + Seek> StorageSource for ZipSource<'_, R> {
    fn bytes(&mut self, decl: &StorageDecl) -> Result<Cow<'_, [u8]>> {
        let name = format!("{}data/{}", self.prefix, decl.key);
        let expected = decl.numel.saturating_mul(elem_size(decl.kind));
        read_entry(
            self.archive,
            &name,
            expected,
            self.total_len,
            "the pickle references a storage the archive lacks",
            &self.limits,
            &mut self.scratch,
        )?;
        Ok(Cow::Borrowed(&self.scratch))
    }

    fn big_endian(&self) -> bool {
        self.big_endian
    }
}

/// Reads one entry, refusing (before allocating) sizes other than `expected` (`u64::MAX`: any
/// size up to the archive's length).
fn read_entry<R: Read + Seek>(
    archive: &mut ZipArchive<R>,
    name: &str,
    expected: u64,
    total_len: u64,
    hint: &'static str,
    limits: &Limits,
    buf: &mut Vec<u8>,
) -> Result<()> {
    let file = match archive.by_name(name) {
        Ok(f) => f,
        Err(zip::result::ZipError::FileNotFound) => {
            return Err(TorchIoError::MissingRecord { name: name.to_string(), hint })
        }
        Err(e) => return Err(zip_err(e)),
    };
    let size = file.size();
    let key = name.rsplit('/').next().unwrap_or(name).to_string();
    if expected != u64::MAX && size != expected {
        return Err(TorchIoError::StorageSize { key, expected, found: size });
    }
    // A stored entry cannot be larger than the archive; a compressed one is inflated only up
    // to its ratio cap, refused before any byte is inflated when its header claims more. The
    // reads stop one byte past the size the header claims, whatever the stream holds.
    let limit = if expected == u64::MAX { limits.pickle_bytes } else { expected };
    if size > limit {
        return Err(TorchIoError::TooLarge { what: format!("entry {name:?}, {size} bytes,"), limit });
    }
    if file.compression() == CompressionMethod::Stored {
        if size > total_len {
            return Err(TorchIoError::Zip {
                message: format!("stored entry {name:?} claims {size} bytes, the archive holds {total_len}"),
            });
        }
    } else {
        // torch.save never compresses: a compressed entry comes from another writer.
        let cap = file.compressed_size().saturating_mul(limits.inflate_ratio);
        if size > cap {
            return Err(TorchIoError::TooLarge {
                what: format!(
                    "entry {name:?}, {} bytes compressed ({:?}) and {size} inflated,",
                    file.compressed_size(),
                    file.compression()
                ),
                limit: cap,
            });
        }
    }
    buf.clear();
    buf.reserve(size.min(total_len) as usize);
    file.take(limit + 1)
        .read_to_end(buf)
        .map_err(|e| TorchIoError::Zip { message: format!("reading {name:?}: {e}") })?;
    if buf.len() as u64 != size {
        return Err(TorchIoError::Zip {
            message: format!("entry {name:?} holds {} bytes, its header says {size}", buf.len()),
        });
    }
    Ok(())
}

pub(crate) fn read_zip<R: Read + Seek>(reader: R, total_len: u64, options: &LoadOptions) -> Result<Value> {
    let mut archive = ZipArchive::new(reader).map_err(zip_err)?;
    // The zip reader's name table keeps one entry per name: fewer names than entries means a
    // name is there twice.
    if archive.file_names().count() != archive.len() {
        return Err(duplicate(&mut archive));
    }
    // torch writes every record under one folder (named after the file; "archive" here).
    // Names in sorted order: the zip reader's table is a hash map, the choice must not depend
    // on its order.
    let mut names: Vec<&str> = archive.file_names().collect();
    names.sort_unstable();
    let mut prefix = None;
    let mut torchscript = false;
    for &name in &names {
        if let Some(p) = name.strip_suffix("data.pkl") {
            if p.ends_with('/') && p[..p.len() - 1].find('/').is_none() && prefix.is_none() {
                prefix = Some(p.to_string());
            }
        }
        torchscript |= name.ends_with("/constants.pkl");
    }
    if let Some(prefix) = &prefix {
        if let Some(other) = names.iter().find(|n| !n.starts_with(prefix.as_str())) {
            let second = match other.find('/') {
                Some(i) => other[..=i].to_string(),
                None => other.to_string(),
            };
            return Err(TorchIoError::MixedFolders { first: prefix.clone(), second });
        }
    }
    let Some(prefix) = prefix else {
        return Err(TorchIoError::MissingRecord {
            name: "<folder>/data.pkl".into(),
            hint: if torchscript {
                "this is a TorchScript archive (torch.jit.save), not a torch.save file"
            } else {
                "a zip archive, but not one torch.save wrote"
            },
        });
    };
    let big_endian = match archive.by_name(&format!("{prefix}byteorder")) {
        Ok(mut f) => {
            let mut s = Vec::new();
            (&mut f).take(16).read_to_end(&mut s).map_err(|e| TorchIoError::Zip { message: e.to_string() })?;
            match s.as_slice() {
                b"little" => false,
                b"big" => true,
                other => {
                    return Err(TorchIoError::BadRecord {
                        name: format!("{prefix}byteorder"),
                        found: String::from_utf8_lossy(other).into_owned(),
                        expected: "\"little\" or \"big\"",
                    })
                }
            }
        }
        Err(zip::result::ZipError::FileNotFound) => false,
        Err(e) => return Err(zip_err(e)),
    };
    let mut data = Vec::new();
    read_entry(&mut archive, &format!("{prefix}data.pkl"), u64::MAX, total_len, "", &options.limits, &mut data)?;
    let mut table = StorageTable::default();
    let pickle = pickle_read::parse(&data, 0, 0, &mut table)?;
    check_storage_total(&table.decls, &options.limits)?;
    let limits = options.limits;
    let mut source = ZipSource { archive: &mut archive, prefix, total_len, big_endian, limits, scratch: Vec::new() };
    let mut mat = Materializer::new(&table.decls, &mut source, options.map_location);
    tree::to_value(&pickle, &mut mat, data.len(), options.limits.depth)
}

/// The storages the pickle declares, in bytes, within [`Limits::storage_bytes`].
fn check_storage_total(decls: &[StorageDecl], limits: &Limits) -> Result<()> {
    let total = decls.iter().fold(0u64, |t, d| t.saturating_add(d.numel.saturating_mul(elem_size(d.kind))));
    if total > limits.storage_bytes {
        return Err(TorchIoError::TooLarge {
            what: format!("the tensors' storages, {total} bytes,"),
            limit: limits.storage_bytes,
        });
    }
    Ok(())
}

/// The error for an archive holding a name twice, naming it.
fn duplicate<R: Read + Seek>(archive: &mut ZipArchive<R>) -> TorchIoError {
    let mut seen = std::collections::HashSet::new();
    for i in 0..archive.len() {
        match archive.by_index_raw(i) {
            Ok(f) => {
                if !seen.insert(f.name().to_string()) {
                    return TorchIoError::DuplicateRecord { name: f.name().to_string() };
                }
            }
            Err(e) => return zip_err(e),
        }
    }
    TorchIoError::DuplicateRecord { name: "(unknown)".into() }
}

// ---------------------------------------------------------------------------------------------
// legacy pickle stream

fn int_value(p: &Pickle) -> Option<Result<i64, Vec<u8>>> {
    match &p.root {
        Obj::Int(i) => Some(Ok(*i)),
        Obj::BigInt(b) => Some(Err(b.to_vec())),
        _ => None,
    }
}

pub(crate) fn read_legacy(data: &[u8], options: &LoadOptions) -> Result<Value> {
    let magic = pickle_read::parse(data, 0, 0, &mut NoPersistent).map_err(|e| match e {
        TorchIoError::Truncated { .. } | TorchIoError::Pickle { .. } | TorchIoError::UnknownOpcode { .. } => {
            TorchIoError::BadMagic { found: format!("(unreadable: {e})") }
        }
        e => e,
    })?;
    match int_value(&magic) {
        Some(Err(b)) if b == MAGIC => {}
        Some(Ok(i)) => return Err(TorchIoError::BadMagic { found: i.to_string() }),
        Some(Err(b)) => {
            return Err(TorchIoError::BadMagic { found: super::value::BigInt::from_le_bytes(&b).to_string() })
        }
        None => return Err(TorchIoError::BadMagic { found: "a pickle that is not an int".into() }),
    }
    let version = pickle_read::parse(data, magic.end, 0, &mut NoPersistent)?;
    match int_value(&version) {
        Some(Ok(PROTOCOL_VERSION)) => {}
        Some(Ok(i)) => return Err(TorchIoError::BadProtocolVersion { found: i.to_string() }),
        _ => return Err(TorchIoError::BadProtocolVersion { found: "a non-int".into() }),
    }
    let sys_info = pickle_read::parse(data, version.end, 0, &mut NoPersistent)?;
    let big_endian = sys_info_big_endian(&sys_info);
    let mut table = StorageTable::default();
    let object = pickle_read::parse(data, sys_info.end, 0, &mut table)?;
    let keys_pickle = pickle_read::parse(data, object.end, 0, &mut NoPersistent)?;
    let keys = string_list(&keys_pickle).ok_or_else(|| TorchIoError::Pickle {
        offset: object.end as u64,
        opcode: "-".into(),
        message: "the storage key list is not a list of strings".into(),
    })?;
    let mut pos = keys_pickle.end;
    let mut ranges = HashMap::new();
    for key in keys {
        let Some(&d) = table.by_key.get(&key) else {
            return Err(TorchIoError::StorageMismatch {
                key,
                message: "in the file's storage list but never referenced by the pickle".into(),
            });
        };
        let decl = &table.decls[d];
        let truncated = |needed: u64, pos: usize| TorchIoError::Truncated {
            what: format!("storage {:?}", decl.key),
            offset: pos as u64,
            needed,
            available: (data.len() - pos) as u64,
        };
        if data.len() - pos < 8 {
            return Err(truncated(8, pos));
        }
        let mut n = [0u8; 8];
        n.copy_from_slice(&data[pos..pos + 8]);
        let numel = if big_endian { i64::from_be_bytes(n) } else { i64::from_le_bytes(n) };
        if numel < 0 || numel as u64 != decl.numel {
            return Err(TorchIoError::StorageSize {
                key: decl.key.clone(),
                expected: decl.numel.saturating_mul(elem_size(decl.kind)),
                found: (numel as u64).saturating_mul(elem_size(decl.kind)),
            });
        }
        pos += 8;
        let nbytes = decl.numel.checked_mul(elem_size(decl.kind)).filter(|&b| b <= (data.len() - pos) as u64);
        let Some(nbytes) = nbytes else {
            return Err(truncated(decl.numel.saturating_mul(elem_size(decl.kind)), pos));
        };
        if ranges.insert(decl.key.clone(), (pos, nbytes as usize)).is_some() {
            return Err(TorchIoError::StorageMismatch { key: decl.key.clone(), message: "listed twice".into() });
        }
        pos += nbytes as usize;
    }
    let mut source = RangeSource { data, ranges, big_endian };
    let mut mat = Materializer::new(&table.decls, &mut source, options.map_location);
    tree::to_value(&object, &mut mat, object.end - sys_info.end, options.limits.depth)
}

fn sys_info_big_endian(p: &Pickle) -> bool {
    if let Obj::Ref(i) = &p.root {
        if let HeapObj::Dict { items, .. } = p.heap.get(*i) {
            for (k, v) in items {
                if matches!(k, Obj::Str(s) if &**s == "little_endian") {
                    return matches!(v, Obj::Bool(false));
                }
            }
        }
    }
    false
}

fn string_list(p: &Pickle) -> Option<Vec<String>> {
    let Obj::Ref(i) = &p.root else { return None };
    let (HeapObj::List(items) | HeapObj::Tuple(items)) = p.heap.get(*i) else {
        return None;
    };
    items
        .iter()
        .map(|o| match o {
            Obj::Str(s) => Some(s.to_string()),
            Obj::Bytes(b) if b.is_ascii() => Some(String::from_utf8_lossy(b).into_owned()),
            _ => None,
        })
        .collect()
}

/// Storage bytes of a legacy file held in memory, located by key.
struct RangeSource<'a> {
    data: &'a [u8],
    ranges: HashMap<String, (usize, usize)>,
    big_endian: bool,
}

impl StorageSource for RangeSource<'_> {
    fn bytes(&mut self, decl: &StorageDecl) -> Result<Cow<'_, [u8]>> {
        match self.ranges.get(&decl.key) {
            Some(&(start, len)) => Ok(Cow::Borrowed(&self.data[start..start + len])),
            None => {
                Err(TorchIoError::StorageMismatch { key: decl.key.clone(), message: "no bytes in the file".into() })
            }
        }
    }

    fn big_endian(&self) -> bool {
        self.big_endian
    }
}

// ---------------------------------------------------------------------------------------------
// writing

/// Writes `value` as torch.save's zip container (what torch >= 1.6 writes by default).
pub(crate) fn write_zip<W: Write + Seek>(w: W, value: &Value) -> Result<W> {
    let (tensors, storages) = storage::plan(value)?;
    let pkl = super::pickle_write::write(value, &tensors, &storages)?;
    let zerr = |e: zip::result::ZipError| TorchIoError::Zip { message: format!("writing: {e}") };
    let ioerr = |e: std::io::Error| TorchIoError::Zip { message: format!("writing: {e}") };
    let mut zip = ZipWriter::new(w);
    let opts = |len: usize| {
        FileOptions::default()
            .compression_method(CompressionMethod::Stored)
            .last_modified_time(zip::DateTime::default())
            .large_file(len as u64 >= u32::MAX as u64)
    };
    let record = |zip: &mut ZipWriter<W>, name: &str, bytes: &[u8], align: u16| -> Result<()> {
        if align > 1 {
            zip.start_file_aligned(format!("archive/{name}"), opts(bytes.len()), align).map_err(zerr)?;
        } else {
            zip.start_file(format!("archive/{name}"), opts(bytes.len())).map_err(zerr)?;
        }
        zip.write_all(bytes).map_err(ioerr)
    };
    record(&mut zip, "data.pkl", &pkl, 1)?;
    record(&mut zip, "byteorder", b"little", 1)?;
    let mut buf = Vec::new();
    for s in &storages {
        s.read_into(&mut buf)?;
        // 64-byte aligned, as torch.save aligns them (torch.load(mmap=True) maps them in place).
        record(&mut zip, &format!("data/{}", s.key), &buf, 64)?;
    }
    record(&mut zip, "version", b"3\n", 1)?;
    zip.finish().map_err(zerr)
}
