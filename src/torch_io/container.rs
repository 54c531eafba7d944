//! The containers `torch.save` writes around its pickle: the zip archive (torch >= 1.6), the
//! legacy pickle stream (torch 0.1.10 - 1.5, `_use_new_zipfile_serialization=False`), and the
//! tar archive (torch < 0.1.10).
use std::borrow::Cow;
use std::collections::HashMap;
use std::io::{Read, Seek, Write};

use tch::Device;
use zip::write::FileOptions;
use zip::{CompressionMethod, ZipArchive, ZipWriter};

use super::error::{Result, TorchIoError};
use super::pickle_read::{
    self, checked_spec, elem_size, Global, Heap, HeapObj, Obj, Persistent, Pickle, StorageDecl, StorageTable,
    StorageView, TensorSpec,
};
use super::storage::{self, Materializer, StorageSource};
use super::tree;
use super::value::Value;
use super::Format;

/// torch's legacy magic number 0x1950a86a20f9469cfc6c, as pickle's LONG1 stores it.
const MAGIC: [u8; 10] = [0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19];
const PROTOCOL_VERSION: i64 = 1001;
/// Largest `data.pkl` read from a zip archive.
const MAX_PICKLE: u64 = 1 << 30;

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

/// Node budget for converting a pickle of `len` bytes: every real node costs at least one
/// opcode byte, so only shared references can exceed it.
fn budget(len: usize) -> u64 {
    2 * len as u64 + 65_536
}

// ---------------------------------------------------------------------------------------------
// zip

struct ZipSource<'a, R: Read + Seek> {
    archive: &'a mut ZipArchive<R>,
    prefix: String,
    total_len: u64,
    big_endian: bool,
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
    // A stored entry cannot be larger than the archive; a compressed one may be, so it is
    // read as it comes, never preallocated beyond the archive's size.
    let limit = if expected == u64::MAX { MAX_PICKLE } else { expected };
    if size > limit {
        return Err(TorchIoError::Zip { message: format!("entry {name:?} claims {size} bytes (limit {limit})") });
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

pub(crate) fn read_zip<R: Read + Seek>(reader: R, total_len: u64, map_location: Option<Device>) -> Result<Value> {
    let mut archive = ZipArchive::new(reader).map_err(zip_err)?;
    // torch writes every record under one folder (named after the file; "archive" here).
    let mut prefix = None;
    let mut torchscript = false;
    for name in archive.file_names() {
        if let Some(p) = name.strip_suffix("data.pkl") {
            if p.ends_with('/') && p[..p.len() - 1].find('/').is_none() && prefix.is_none() {
                prefix = Some(p.to_string());
            }
        }
        torchscript |= name.ends_with("/constants.pkl");
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
    read_entry(&mut archive, &format!("{prefix}data.pkl"), u64::MAX, total_len, "", &mut data)?;
    let mut table = StorageTable::default();
    let pickle = pickle_read::parse(&data, 0, 0, &mut table)?;
    let mut source = ZipSource { archive: &mut archive, prefix, total_len, big_endian, scratch: Vec::new() };
    let mut mat = Materializer::new(&table.decls, &mut source, map_location);
    tree::to_value(&pickle, &mut mat, budget(data.len()))
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

pub(crate) fn read_legacy(data: &[u8], map_location: Option<Device>) -> Result<Value> {
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
    let mut mat = Materializer::new(&table.decls, &mut source, map_location);
    tree::to_value(&object, &mut mat, budget(object.end - sys_info.end))
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

// ---------------------------------------------------------------------------------------------
// tar (torch < 0.1.10)

/// The regular files of a ustar/pax archive: name -> byte range.
fn tar_entries(data: &[u8]) -> Result<HashMap<String, (usize, usize)>> {
    let mut out = HashMap::new();
    let mut pos = 0usize;
    let mut pax_path: Option<String> = None;
    let mut pax_size: Option<u64> = None;
    let bad = |offset: usize, message: &str| TorchIoError::UnknownFormat {
        reason: format!("corrupt tar header at offset {offset}: {message}"),
    };
    while data.len() - pos >= 512 {
        let h = &data[pos..pos + 512];
        if h.iter().all(|&b| b == 0) {
            break;
        }
        let field = |r: std::ops::Range<usize>| {
            let f = &h[r];
            let end = f.iter().position(|&b| b == 0).unwrap_or(f.len());
            String::from_utf8_lossy(&f[..end]).into_owned()
        };
        let octal = |r: std::ops::Range<usize>| -> Option<u64> {
            let t = field(r);
            let t = t.trim_matches(|c: char| c == ' ' || c == '\0');
            if t.is_empty() {
                return Some(0);
            }
            u64::from_str_radix(t, 8).ok()
        };
        let stored_sum = octal(148..156).ok_or_else(|| bad(pos, "checksum is not octal"))?;
        let sum: u64 =
            h.iter().enumerate().map(|(i, &b)| if (148..156).contains(&i) { 32 } else { u64::from(b) }).sum();
        if sum != stored_sum {
            return Err(bad(pos, "checksum mismatch"));
        }
        let size = if h[124] & 0x80 != 0 {
            // base-256 (GNU) size
            h[125..136].iter().try_fold(0u64, |acc, &b| acc.checked_mul(256).map(|a| a | u64::from(b)))
        } else {
            octal(124..136)
        }
        .ok_or_else(|| bad(pos, "bad size"))?;
        let size = pax_size.take().unwrap_or(size);
        let mut name = field(0..100);
        if &h[257..262] == b"ustar" {
            let prefix = field(345..500);
            if !prefix.is_empty() {
                name = format!("{prefix}/{name}");
            }
        }
        let start = pos + 512;
        let available = data.len() - start;
        if size > available as u64 {
            return Err(TorchIoError::Truncated {
                what: format!("tar member {name:?}"),
                offset: start as u64,
                needed: size,
                available: available as u64,
            });
        }
        let size = size as usize;
        match h[156] {
            b'x' => {
                // pax extended header: "<len> key=value\n" records for the next member.
                for rec in String::from_utf8_lossy(&data[start..start + size]).split('\n') {
                    if let Some((_, kv)) = rec.split_once(' ') {
                        if let Some(p) = kv.strip_prefix("path=") {
                            pax_path = Some(p.to_string());
                        } else if let Some(n) = kv.strip_prefix("size=") {
                            pax_size = Some(n.parse().map_err(|_| bad(pos, "bad pax size"))?);
                        }
                    }
                }
            }
            b'0' | 0 => {
                let name = pax_path.take().unwrap_or(name);
                out.insert(name, (start, size));
            }
            _ => {
                pax_path = None;
            }
        }
        pos = start.saturating_add(size.div_ceil(512) * 512).min(data.len());
    }
    Ok(out)
}

/// A key of the tar format's tables: an int (an object id) or its decimal string.
fn tar_key(o: &Obj) -> Option<String> {
    match o {
        Obj::Int(i) => Some(i.to_string()),
        Obj::Str(s) => Some(s.to_string()),
        Obj::Bytes(b) if b.is_ascii() => Some(String::from_utf8_lossy(b).into_owned()),
        _ => None,
    }
}

fn tuple_of(p: &Pickle, n: usize) -> Option<Vec<Obj>> {
    match &p.root {
        Obj::Ref(i) => match p.heap.get(*i) {
            HeapObj::Tuple(t) | HeapObj::List(t) if t.len() == n => Some(t.clone()),
            _ => None,
        },
        _ => None,
    }
}

fn global_of(p: &Pickle, o: &Obj) -> Option<Global> {
    match o {
        Obj::Ref(i) => match p.heap.get(*i) {
            HeapObj::Global(g) => Some(*g),
            _ => None,
        },
        _ => None,
    }
}

/// Resolves the object pickle's persistent ids (tensor or storage keys) of the tar format.
struct TarPersistent {
    tensors: HashMap<String, TensorSpec>,
    storages: HashMap<String, StorageView>,
}

impl Persistent for TarPersistent {
    fn load(&mut self, pid: &Obj, heap: &mut Heap, offset: u64) -> Result<Obj> {
        let Some(key) = tar_key(pid) else {
            return Err(TorchIoError::Unsupported {
                offset,
                message: "a persistent id that is not a tensor or storage key (a pickled module?)".into(),
            });
        };
        if let Some(t) = self.tensors.get(&key) {
            return Ok(Obj::Ref(heap.push(HeapObj::Tensor(t.clone()))));
        }
        if let Some(s) = self.storages.get(&key) {
            return Ok(Obj::Ref(heap.push(HeapObj::Storage(s.clone()))));
        }
        Err(TorchIoError::StorageMismatch { key, message: "referenced by the pickle but not in the archive".into() })
    }
}

/// Storage bytes of a file held in memory (legacy, tar), located by key.
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

fn read_i64(data: &[u8], pos: usize, big_endian: bool, what: &str) -> Result<i64> {
    if data.len().saturating_sub(pos) < 8 {
        return Err(TorchIoError::Truncated {
            what: what.to_string(),
            offset: pos as u64,
            needed: 8,
            available: data.len().saturating_sub(pos) as u64,
        });
    }
    let mut n = [0u8; 8];
    n.copy_from_slice(&data[pos..pos + 8]);
    Ok(if big_endian { i64::from_be_bytes(n) } else { i64::from_le_bytes(n) })
}

fn count_of(p: &Pickle, what: &str, at: usize) -> Result<u64> {
    match p.root {
        Obj::Int(n) if n >= 0 => Ok(n as u64),
        _ => Err(TorchIoError::Pickle {
            offset: at as u64,
            opcode: "-".into(),
            message: format!("the {what} count is not a non-negative int"),
        }),
    }
}

/// Reads the tar container: members `sys_info`, `storages` (storage records and raw bytes,
/// then storage views), `tensors` (tensor records with binary size/stride/offset) and
/// `pickle` (the object, referencing tensors by key), as torch.load's `legacy_load` reads
/// them. Positions in errors are offsets in the whole file.
pub(crate) fn read_tar(data: &[u8], map_location: Option<Device>) -> Result<Value> {
    let entries = tar_entries(data)?;
    let member = |name: &str| {
        entries.get(name).copied().ok_or_else(|| TorchIoError::MissingRecord {
            name: name.to_string(),
            hint: "a tar archive, but not one torch.save wrote",
        })
    };
    let big_endian = match entries.get("sys_info") {
        Some(&(start, len)) => {
            let p = pickle_read::parse(&data[..start + len], start, 0, &mut NoPersistent)?;
            sys_info_big_endian(&p)
        }
        None => false,
    };
    let bad_record = |at: usize, what: &str| TorchIoError::Pickle {
        offset: at as u64,
        opcode: "-".into(),
        message: format!("malformed {what} record"),
    };

    // storages
    let (s0, slen) = member("storages")?;
    let sdata = &data[..s0 + slen];
    let count = pickle_read::parse(sdata, s0, 0, &mut NoPersistent)?;
    let mut pos = count.end;
    let mut table = StorageTable::default();
    let mut ranges = HashMap::new();
    let mut views: HashMap<String, StorageView> = HashMap::new();
    for _ in 0..count_of(&count, "storage", s0)? {
        let rec = pickle_read::parse(sdata, pos, 0, &mut NoPersistent)?;
        let fields = tuple_of(&rec, 3).ok_or_else(|| bad_record(pos, "storage"))?;
        let key = tar_key(&fields[0]).ok_or_else(|| bad_record(pos, "storage"))?;
        let location = tar_key(&fields[1]).ok_or_else(|| bad_record(pos, "storage"))?;
        let Some(Global::StorageType(kind)) = global_of(&rec, &fields[2]) else {
            return Err(bad_record(pos, "storage"));
        };
        pos = rec.end;
        let numel = read_i64(sdata, pos, big_endian, &format!("storage {key:?} size"))?;
        pos += 8;
        let nbytes = u64::try_from(numel).ok().and_then(|n| n.checked_mul(elem_size(kind)));
        let Some(nbytes) = nbytes.filter(|&b| b <= (sdata.len() - pos) as u64) else {
            return Err(TorchIoError::Truncated {
                what: format!("storage {key:?}"),
                offset: pos as u64,
                needed: nbytes.unwrap_or(u64::MAX),
                available: (sdata.len() - pos) as u64,
            });
        };
        if table.by_key.contains_key(&key) {
            return Err(TorchIoError::StorageMismatch { key, message: "listed twice".into() });
        }
        let decl = table.decls.len();
        table.decls.push(StorageDecl { key: key.clone(), kind, numel: numel as u64, location });
        table.by_key.insert(key.clone(), decl);
        ranges.insert(key.clone(), (pos, nbytes as usize));
        views.insert(
            key.clone(),
            StorageView { decl, key: std::rc::Rc::from(key.as_str()), kind, offset: 0, numel: numel as u64 },
        );
        pos += nbytes as usize;
    }
    let view_list = pickle_read::parse(sdata, pos, 0, &mut NoPersistent)?;
    let items = match &view_list.root {
        Obj::Ref(i) => match view_list.heap.get(*i) {
            HeapObj::List(t) | HeapObj::Tuple(t) => t.clone(),
            _ => return Err(bad_record(pos, "storage view list")),
        },
        _ => return Err(bad_record(pos, "storage view list")),
    };
    for item in items {
        let fields = match &item {
            Obj::Ref(i) => match view_list.heap.get(*i) {
                HeapObj::Tuple(t) | HeapObj::List(t) if t.len() == 4 => t.clone(),
                _ => return Err(bad_record(pos, "storage view")),
            },
            _ => return Err(bad_record(pos, "storage view")),
        };
        let (Some(target), Some(root), Obj::Int(off), Obj::Int(n)) =
            (tar_key(&fields[0]), tar_key(&fields[1]), &fields[2], &fields[3])
        else {
            return Err(bad_record(pos, "storage view"));
        };
        let Some(root_view) = views.get(&root).cloned() else {
            return Err(TorchIoError::StorageMismatch {
                key: root,
                message: "a view of a storage not in the archive".into(),
            });
        };
        let fits = *off >= 0 && *n >= 0 && (*off as u64).checked_add(*n as u64).is_some_and(|e| e <= root_view.numel);
        if !fits {
            return Err(TorchIoError::StorageMismatch {
                key: target,
                message: format!("view [{off}, {off}+{n}) outside storage {root:?} of {} elements", root_view.numel),
            });
        }
        views.insert(target, StorageView { offset: root_view.offset + *off as u64, numel: *n as u64, ..root_view });
    }

    // tensors
    let (t0, tlen) = member("tensors")?;
    let tdata = &data[..t0 + tlen];
    let count = pickle_read::parse(tdata, t0, 0, &mut NoPersistent)?;
    let mut pos = count.end;
    let mut tensors = HashMap::new();
    for _ in 0..count_of(&count, "tensor", t0)? {
        let rec = pickle_read::parse(tdata, pos, 0, &mut NoPersistent)?;
        let fields = tuple_of(&rec, 3).ok_or_else(|| bad_record(pos, "tensor"))?;
        let (Some(key), Some(storage_key)) = (tar_key(&fields[0]), tar_key(&fields[1])) else {
            return Err(bad_record(pos, "tensor"));
        };
        let at = pos;
        pos = rec.end;
        if tdata.len() - pos < 8 {
            return Err(TorchIoError::Truncated {
                what: format!("tensor {key:?} rank"),
                offset: pos as u64,
                needed: 8,
                available: (tdata.len() - pos) as u64,
            });
        }
        let mut nd = [0u8; 4];
        nd.copy_from_slice(&tdata[pos..pos + 4]);
        let ndim = if big_endian { i32::from_be_bytes(nd) } else { i32::from_le_bytes(nd) };
        if !(0..=64).contains(&ndim) {
            return Err(bad_record(at, "tensor (rank)"));
        }
        pos += 8;
        let mut dims = Vec::with_capacity(2 * ndim as usize + 1);
        for _ in 0..2 * ndim + 1 {
            dims.push(read_i64(tdata, pos, big_endian, &format!("tensor {key:?} geometry"))?);
            pos += 8;
        }
        let offset = dims.pop().unwrap_or(0);
        let stride = dims.split_off(ndim as usize);
        let Some(view) = views.get(&storage_key).cloned() else {
            return Err(TorchIoError::StorageMismatch {
                key: storage_key,
                message: format!("tensor {key:?} views a storage not in the archive"),
            });
        };
        tensors.insert(key, checked_spec(view, offset, dims, stride, at as u64)?);
    }

    // the object
    let (p0, plen) = member("pickle")?;
    let mut persistent = TarPersistent { tensors, storages: views };
    let object = pickle_read::parse(&data[..p0 + plen], p0, 0, &mut persistent)?;
    let mut source = RangeSource { data, ranges, big_endian };
    let mut mat = Materializer::new(&table.decls, &mut source, map_location);
    tree::to_value(&object, &mut mat, budget(plen))
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
