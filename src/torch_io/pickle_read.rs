//! A restricted unpickler: the subset of Python's pickle machine that `torch.save` files use,
//! with an explicit allow-list of globals. Nothing named in a pickle is ever imported or called:
//! an allowed global maps to a Rust enum variant whose "call" is implemented here, and any other
//! global is a [`TorchIoError::DisallowedGlobal`] at the GLOBAL opcode itself.
//!
//! Objects live in an arena (`Heap`), referenced by index, so that memo references see later
//! mutations (pickle memoizes a list before APPENDS fills it) without reference counting, and
//! a self-referencing pickle cannot leak or loop (conversion bounds depth and bytes).
//!
//! The machine's work is bounded by its input: every opcode pushes at most one object, strings
//! and bytes are shared (`Rc`) however often the memo hands them out, the only recursive call
//! (`_rebuild_from_type_v2` wrapping another rebuild) is unrolled into a loop of at most
//! [`MAX_DEPTH`] steps, and the calls that copy a container (`OrderedDict(d)`, `torch.Size(l)`,
//! `bytearray(b)`, BUILD, a call's argument tuple) are charged against a copy budget of
//! [`COPY_BUDGET_PER_BYTE`] bytes per pickle byte (plus [`BUDGET_FLOOR`]), so a pickle that
//! copies one big container again and again is refused rather than grown quadratically.
use std::collections::HashMap;
use std::rc::Rc;

use tch::Kind;

use super::error::{Result, TorchIoError};
use super::value::to_i128;
use super::MAX_DEPTH;

/// Bytes a pickle may copy (container items, byte strings) per byte of pickle.
pub(crate) const COPY_BUDGET_PER_BYTE: u64 = 16;
/// Added to every byte budget, so that small pickles are never refused for it.
pub(crate) const BUDGET_FLOOR: u64 = 4 << 20;

/// A pickle value on the stack or in the memo. Containers and torch objects are `Ref`s into
/// the heap.
#[derive(Debug, Clone)]
pub(crate) enum Obj {
    None,
    Bool(bool),
    Int(i64),
    BigInt(Rc<[u8]>),
    Float(f64),
    Str(Rc<str>),
    Bytes(Rc<[u8]>),
    Ref(usize),
}

/// A heap object.
#[derive(Debug)]
pub(crate) enum HeapObj {
    List(Vec<Obj>),
    Tuple(Vec<Obj>),
    Dict { ordered: bool, items: Vec<(Obj, Obj)>, attrs: Vec<(Obj, Obj)> },
    Global(Global),
    Storage(StorageView),
    Tensor(TensorSpec),
}

/// The allowed globals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Global {
    OrderedDict,
    RebuildTensor,
    RebuildTensorV2,
    RebuildTensorV3,
    RebuildParameter,
    RebuildParameterWithState,
    RebuildFromTypeV2,
    TorchSize,
    CodecsEncode,
    Bytearray,
    TensorType,
    ParameterType,
    StorageType(Kind),
    Dtype(Kind),
}

impl Global {
    pub(crate) fn describe(self) -> String {
        match self {
            Global::OrderedDict => "collections.OrderedDict".into(),
            Global::RebuildTensor => "torch._utils._rebuild_tensor".into(),
            Global::RebuildTensorV2 => "torch._utils._rebuild_tensor_v2".into(),
            Global::RebuildTensorV3 => "torch._utils._rebuild_tensor_v3".into(),
            Global::RebuildParameter => "torch._utils._rebuild_parameter".into(),
            Global::RebuildParameterWithState => "torch._utils._rebuild_parameter_with_state".into(),
            Global::RebuildFromTypeV2 => "torch._tensor._rebuild_from_type_v2".into(),
            Global::TorchSize => "torch.Size".into(),
            Global::CodecsEncode => "_codecs.encode".into(),
            Global::Bytearray => "builtins.bytearray".into(),
            Global::TensorType => "torch.Tensor".into(),
            Global::ParameterType => "torch.nn.parameter.Parameter".into(),
            Global::StorageType(k) => format!("storage type of {k:?}"),
            Global::Dtype(k) => format!("dtype {k:?}"),
        }
    }
}

/// A storage declared by a persistent id: the storage `decl` of the container's table, seen
/// through a window of `numel` elements starting at element `offset` (legacy storage views;
/// the whole storage otherwise).
#[derive(Debug, Clone)]
pub(crate) struct StorageView {
    pub decl: usize,
    pub key: Rc<str>,
    pub kind: Kind,
    pub offset: u64,
    pub numel: u64,
}

/// A tensor to build once the storages are read: already checked to fit its storage.
#[derive(Debug, Clone)]
pub(crate) struct TensorSpec {
    pub storage: StorageView,
    pub kind: Kind,
    /// In elements, from the start of the (root) storage.
    pub storage_offset: i64,
    pub size: Vec<i64>,
    pub stride: Vec<i64>,
    pub requires_grad: bool,
}

/// A storage as the container declares it (one per key).
#[derive(Debug, Clone)]
pub(crate) struct StorageDecl {
    pub key: String,
    pub kind: Kind,
    pub numel: u64,
    pub location: String,
}

/// How a container resolves persistent ids.
pub(crate) trait Persistent {
    /// Resolves the persistent id `pid` (already on the heap) into an object.
    fn load(&mut self, pid: &Obj, heap: &mut Heap, offset: u64) -> Result<Obj>;
}

/// Storage-table persistent ids, as the zip and legacy containers write them:
/// `('storage', storage_type, key, location, numel)` (zip) and
/// `('storage', storage_type, root_key, location, numel, view_metadata)` (legacy).
#[derive(Debug, Default)]
pub(crate) struct StorageTable {
    pub decls: Vec<StorageDecl>,
    pub by_key: HashMap<String, usize>,
    views: HashMap<String, StorageView>,
}

impl Persistent for StorageTable {
    fn load(&mut self, pid: &Obj, heap: &mut Heap, offset: u64) -> Result<Obj> {
        let unsupported = |message: String| TorchIoError::Unsupported { offset, message };
        let items = match pid {
            Obj::Ref(i) => match heap.get(*i) {
                HeapObj::Tuple(items) => items,
                _ => return Err(unsupported("persistent id is not a tuple".into())),
            },
            _ => return Err(unsupported("persistent id is not a tuple".into())),
        };
        let typename = items.first().and_then(ascii).unwrap_or_default();
        if typename != "storage" {
            return Err(unsupported(format!(
                "persistent id of type {typename:?}; only storages are read (a 'module' id means \
                 torch.save(model): save model.state_dict() instead)"
            )));
        }
        if items.len() != 5 && items.len() != 6 {
            return Err(unsupported(format!("storage persistent id with {} fields", items.len())));
        }
        // At most 6 items: cloned so the heap can be pushed to below.
        let items = items.clone();
        let kind = match &items[1] {
            Obj::Ref(i) => match heap.get(*i) {
                HeapObj::Global(Global::StorageType(k)) => *k,
                _ => return Err(unsupported("storage persistent id without a storage type".into())),
            },
            _ => return Err(unsupported("storage persistent id without a storage type".into())),
        };
        let key = ascii(&items[2]).ok_or_else(|| unsupported("storage key is not a string".into()))?;
        let location = ascii(&items[3]).ok_or_else(|| unsupported("storage location is not a string".into()))?;
        let numel = match items[4] {
            Obj::Int(n) if n >= 0 => n as u64,
            _ => return Err(unsupported("storage size is not a non-negative int".into())),
        };
        let decl = match self.by_key.get(&key) {
            Some(&d) => {
                let old = &self.decls[d];
                if old.kind != kind || old.numel != numel {
                    return Err(TorchIoError::StorageMismatch {
                        key,
                        message: format!(
                            "declared as {:?} × {} and again as {:?} × {}",
                            old.kind, old.numel, kind, numel
                        ),
                    });
                }
                d
            }
            None => {
                let d = self.decls.len();
                self.decls.push(StorageDecl { key: key.clone(), kind, numel, location });
                self.by_key.insert(key.clone(), d);
                d
            }
        };
        let key_rc: Rc<str> = Rc::from(key.as_str());
        let mut view = StorageView { decl, key: key_rc.clone(), kind, offset: 0, numel };
        if let Some(meta) = items.get(5) {
            if !matches!(meta, Obj::None) {
                // (view_key, offset, view_size): a window into the root storage.
                let fields = match meta {
                    Obj::Ref(i) => match heap.get(*i) {
                        HeapObj::Tuple(f) if f.len() == 3 => f.clone(),
                        _ => return Err(unsupported("storage view metadata is not a 3-tuple".into())),
                    },
                    _ => return Err(unsupported("storage view metadata is not a 3-tuple".into())),
                };
                let view_key =
                    ascii(&fields[0]).ok_or_else(|| unsupported("storage view key is not a string".into()))?;
                let (Obj::Int(off), Obj::Int(len)) = (&fields[1], &fields[2]) else {
                    return Err(unsupported("storage view offset/size are not ints".into()));
                };
                let (off, len) = (*off, *len);
                let fits = off >= 0 && len >= 0 && (off as u64).checked_add(len as u64).is_some_and(|end| end <= numel);
                if !fits {
                    return Err(TorchIoError::StorageMismatch {
                        key: view_key,
                        message: format!("view [{off}, {off}+{len}) outside root storage {key:?} of {numel} elements"),
                    });
                }
                view = self
                    .views
                    .entry(view_key)
                    .or_insert(StorageView { decl, key: key_rc, kind, offset: off as u64, numel: len as u64 })
                    .clone();
            }
        }
        Ok(Obj::Ref(heap.push(HeapObj::Storage(view))))
    }
}

/// A str, or ASCII bytes (Python 2 pickles), as a String; `None` for anything else and for
/// text longer than a line (keys and locations are short, and a long one shared through the
/// memo would be copied on every use).
fn ascii(o: &Obj) -> Option<String> {
    match o {
        Obj::Str(s) if s.len() > MAX_LINE => None,
        Obj::Bytes(b) if b.len() > MAX_LINE => None,
        Obj::Str(s) => Some(s.to_string()),
        Obj::Bytes(b) if b.is_ascii() => Some(String::from_utf8_lossy(b).into_owned()),
        _ => None,
    }
}

/// The object arena.
#[derive(Debug, Default)]
pub(crate) struct Heap {
    objs: Vec<HeapObj>,
}

impl Heap {
    pub(crate) fn push(&mut self, o: HeapObj) -> usize {
        self.objs.push(o);
        self.objs.len() - 1
    }
    pub(crate) fn get(&self, i: usize) -> &HeapObj {
        &self.objs[i]
    }
    pub(crate) fn len(&self) -> usize {
        self.objs.len()
    }
    fn get_mut(&mut self, i: usize) -> &mut HeapObj {
        &mut self.objs[i]
    }
}

/// A parsed pickle: its root object, the heap it refers into, and the offset after STOP.
#[derive(Debug)]
pub(crate) struct Pickle {
    pub heap: Heap,
    pub root: Obj,
    pub end: usize,
}

const MAX_LINE: usize = 4096;
/// Dimensions per tensor (libtorch has no hard limit; real tensors have a handful).
const MAX_RANK: usize = 64;

fn opname(op: u8) -> &'static str {
    match op {
        b'(' => "MARK",
        b'.' => "STOP",
        b'0' => "POP",
        b'1' => "POP_MARK",
        b'2' => "DUP",
        b'F' => "FLOAT",
        b'I' => "INT",
        b'J' => "BININT",
        b'K' => "BININT1",
        b'L' => "LONG",
        b'M' => "BININT2",
        b'N' => "NONE",
        b'P' => "PERSID",
        b'Q' => "BINPERSID",
        b'R' => "REDUCE",
        b'T' => "BINSTRING",
        b'U' => "SHORT_BINSTRING",
        b'X' => "BINUNICODE",
        b'a' => "APPEND",
        b'b' => "BUILD",
        b'c' => "GLOBAL",
        b'd' => "DICT",
        b'}' => "EMPTY_DICT",
        b'e' => "APPENDS",
        b'g' => "GET",
        b'h' => "BINGET",
        b'j' => "LONG_BINGET",
        b'l' => "LIST",
        b']' => "EMPTY_LIST",
        b'p' => "PUT",
        b'q' => "BINPUT",
        b'r' => "LONG_BINPUT",
        b's' => "SETITEM",
        b't' => "TUPLE",
        b')' => "EMPTY_TUPLE",
        b'u' => "SETITEMS",
        b'G' => "BINFLOAT",
        b'B' => "BINBYTES",
        b'C' => "SHORT_BINBYTES",
        0x80 => "PROTO",
        0x81 => "NEWOBJ",
        0x85 => "TUPLE1",
        0x86 => "TUPLE2",
        0x87 => "TUPLE3",
        0x88 => "NEWTRUE",
        0x89 => "NEWFALSE",
        0x8a => "LONG1",
        0x8b => "LONG4",
        0x8c => "SHORT_BINUNICODE",
        0x8d => "BINUNICODE8",
        0x8e => "BINBYTES8",
        0x93 => "STACK_GLOBAL",
        0x94 => "MEMOIZE",
        0x95 => "FRAME",
        0x96 => "BYTEARRAY8",
        _ => "?",
    }
}

/// Resolves a global by name against the allow-list.
fn resolve_global(module: &str, name: &str, offset: u64) -> Result<Global> {
    // Python 2 names, as protocol 2 pickles from Python 3 still write them (fix_imports), and
    // torch's own module rename (torch.tensor -> torch._tensor).
    let module = match module {
        "__builtin__" => "builtins",
        "torch.tensor" => "torch._tensor",
        m => m,
    };
    let g = match (module, name) {
        ("collections", "OrderedDict") => Global::OrderedDict,
        ("torch._utils", "_rebuild_tensor") => Global::RebuildTensor,
        ("torch._utils", "_rebuild_tensor_v2") => Global::RebuildTensorV2,
        ("torch._utils", "_rebuild_tensor_v3") => Global::RebuildTensorV3,
        ("torch._utils", "_rebuild_parameter") => Global::RebuildParameter,
        ("torch._utils", "_rebuild_parameter_with_state") => Global::RebuildParameterWithState,
        ("torch._tensor", "_rebuild_from_type_v2") => Global::RebuildFromTypeV2,
        ("torch", "Size") => Global::TorchSize,
        ("torch", "Tensor") | ("torch._tensor", "Tensor") => Global::TensorType,
        ("torch.nn.parameter", "Parameter") => Global::ParameterType,
        ("_codecs", "encode") => Global::CodecsEncode,
        ("builtins", "bytearray") => Global::Bytearray,
        (m, n) if (m == "torch" || m.starts_with("torch.")) && n.contains("Storage") => {
            // torch.load maps any "...Storage" name to its dtype (torch.cuda.HalfStorage too).
            let kind = match n {
                "DoubleStorage" => Kind::Double,
                "FloatStorage" => Kind::Float,
                "HalfStorage" => Kind::Half,
                "BFloat16Storage" => Kind::BFloat16,
                "LongStorage" => Kind::Int64,
                "IntStorage" => Kind::Int,
                "ShortStorage" => Kind::Int16,
                "CharStorage" => Kind::Int8,
                "ByteStorage" | "UntypedStorage" => Kind::Uint8,
                "BoolStorage" => Kind::Bool,
                "ComplexFloatStorage" => Kind::ComplexFloat,
                "ComplexDoubleStorage" => Kind::ComplexDouble,
                _ => return Err(TorchIoError::UnknownDtype { offset, name: format!("{module}.{name}") }),
            };
            Global::StorageType(kind)
        }
        ("torch", n) => {
            let kind = match n {
                "float64" | "double" => Kind::Double,
                "float32" | "float" => Kind::Float,
                "float16" | "half" => Kind::Half,
                "bfloat16" => Kind::BFloat16,
                "int64" | "long" => Kind::Int64,
                "int32" | "int" => Kind::Int,
                "int16" | "short" => Kind::Int16,
                "int8" => Kind::Int8,
                "uint8" => Kind::Uint8,
                "bool" => Kind::Bool,
                "complex64" | "cfloat" => Kind::ComplexFloat,
                "complex128" | "cdouble" => Kind::ComplexDouble,
                n if n.starts_with("float8")
                    || n.starts_with("uint")
                    || n.starts_with("int")
                    || n.starts_with("complex")
                    || n.starts_with("q")
                    || n == "chalf"
                    || n == "bits8" =>
                {
                    return Err(TorchIoError::UnknownDtype { offset, name: format!("torch.{n}") })
                }
                _ => {
                    return Err(TorchIoError::DisallowedGlobal {
                        offset,
                        module: module.to_string(),
                        name: name.to_string(),
                    })
                }
            };
            Global::Dtype(kind)
        }
        _ => return Err(TorchIoError::DisallowedGlobal { offset, module: module.to_string(), name: name.to_string() }),
    };
    Ok(g)
}

/// Size of one element of `kind` in bytes (only the kinds the reader produces).
pub(crate) fn elem_size(kind: Kind) -> u64 {
    match kind {
        Kind::Double | Kind::Int64 | Kind::ComplexFloat => 8,
        Kind::Float | Kind::Int => 4,
        Kind::Half | Kind::BFloat16 | Kind::Int16 => 2,
        Kind::ComplexDouble => 16,
        _ => 1,
    }
}

/// Elements a strided view needs: `offset + Σ (size_i - 1) · stride_i + 1`, or `offset` for an
/// empty view; `None` on overflow or a negative size/stride/offset.
pub(crate) fn needed_elements(size: &[i64], stride: &[i64], offset: i64) -> Option<u64> {
    if offset < 0 || size.len() != stride.len() || size.iter().chain(stride).any(|&x| x < 0) {
        return None;
    }
    // The element count must fit an i64 (libtorch's numel), even when strides are 0.
    size.iter().try_fold(1i64, |acc, &s| acc.checked_mul(s))?;
    if size.contains(&0) {
        return Some(offset as u64);
    }
    let mut last = offset as i128;
    for (&s, &st) in size.iter().zip(stride) {
        last = last.checked_add(((s - 1) as i128).checked_mul(st as i128)?)?;
    }
    u64::try_from(last.checked_add(1)?).ok()
}

struct Machine<'a, 'p> {
    data: &'a [u8],
    pos: usize,
    /// Added to positions in errors.
    base: u64,
    stack: Vec<Obj>,
    marks: Vec<usize>,
    memo: HashMap<u64, Obj>,
    heap: Heap,
    persistent: &'p mut dyn Persistent,
    op_offset: u64,
    op: u8,
    /// Bytes copied so far by calls and BUILD, and the most allowed.
    copied: u64,
    copy_limit: u64,
}

/// Runs the pickle starting at `data[start]` until its STOP.
pub(crate) fn parse(data: &[u8], start: usize, base: u64, persistent: &mut dyn Persistent) -> Result<Pickle> {
    let mut m = Machine {
        data,
        pos: start,
        base,
        stack: Vec::new(),
        marks: Vec::new(),
        memo: HashMap::new(),
        heap: Heap::default(),
        persistent,
        op_offset: 0,
        op: 0,
        copied: 0,
        copy_limit: (data.len().saturating_sub(start) as u64)
            .saturating_mul(COPY_BUDGET_PER_BYTE)
            .saturating_add(BUDGET_FLOOR),
    };
    let root = m.run()?;
    Ok(Pickle { heap: m.heap, root, end: m.pos })
}

impl<'a> Machine<'a, '_> {
    fn err(&self, message: impl Into<String>) -> TorchIoError {
        TorchIoError::Pickle { offset: self.op_offset, opcode: opname(self.op).to_string(), message: message.into() }
    }

    fn unsupported(&self, message: impl Into<String>) -> TorchIoError {
        TorchIoError::Unsupported { offset: self.op_offset, message: message.into() }
    }

    /// Charges `bytes` copied against the copy budget.
    fn charge(&mut self, bytes: u64) -> Result<()> {
        self.copied = self.copied.saturating_add(bytes);
        if self.copied > self.copy_limit {
            return Err(TorchIoError::TooLarge {
                what: format!(
                    "objects copied by the pickle's calls (offset {}, opcode {})",
                    self.op_offset,
                    opname(self.op)
                ),
                limit: self.copy_limit,
            });
        }
        Ok(())
    }

    /// Charges copying `n` objects.
    fn charge_objs(&mut self, n: usize) -> Result<()> {
        self.charge((n as u64).saturating_mul(std::mem::size_of::<Obj>() as u64))
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8]> {
        let available = self.data.len() - self.pos;
        if n > available {
            return Err(TorchIoError::Truncated {
                what: format!("{what} of opcode {}", opname(self.op)),
                offset: self.base + self.pos as u64,
                needed: n as u64,
                available: available as u64,
            });
        }
        let data: &'a [u8] = self.data;
        let s = &data[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1, "argument")?[0])
    }

    fn u16(&mut self) -> Result<u16> {
        let b = self.take(2, "argument")?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32> {
        let b = self.take(4, "argument")?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64> {
        let b = self.take(8, "argument")?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    fn len_arg(&mut self, n: u64) -> Result<usize> {
        usize::try_from(n).map_err(|_| self.err("length does not fit memory"))
    }

    fn line(&mut self) -> Result<String> {
        let rest = &self.data[self.pos..];
        let end = rest.iter().take(MAX_LINE).position(|&b| b == b'\n').ok_or_else(|| {
            if rest.len() < MAX_LINE {
                TorchIoError::Truncated {
                    what: format!("text argument of opcode {}", opname(self.op)),
                    offset: self.base + self.pos as u64,
                    needed: rest.len() as u64 + 1,
                    available: rest.len() as u64,
                }
            } else {
                self.err("text argument longer than 4096 bytes")
            }
        })?;
        let s = std::str::from_utf8(&rest[..end]).map_err(|_| self.err("text argument is not UTF-8"))?.to_string();
        self.pos += end + 1;
        Ok(s)
    }

    fn pop(&mut self) -> Result<Obj> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(self.err("stack underflow"));
        }
        Ok(self.stack.pop().expect("checked non-empty"))
    }

    fn top(&self) -> Result<&Obj> {
        let floor = self.marks.last().copied().unwrap_or(0);
        if self.stack.len() <= floor {
            return Err(self.err("stack underflow"));
        }
        Ok(self.stack.last().expect("checked non-empty"))
    }

    fn pop_mark(&mut self) -> Result<Vec<Obj>> {
        let m = self.marks.pop().ok_or_else(|| self.err("no MARK on the stack"))?;
        Ok(self.stack.split_off(m))
    }

    fn push_heap(&mut self, o: HeapObj) {
        let i = self.heap.push(o);
        self.stack.push(Obj::Ref(i));
    }

    fn str_obj(&self, bytes: &[u8]) -> Result<Obj> {
        let s = std::str::from_utf8(bytes).map_err(|_| self.err("string is not valid UTF-8"))?;
        Ok(Obj::Str(Rc::from(s)))
    }

    fn int_from_le(&self, bytes: &[u8]) -> Obj {
        match to_i128(bytes).and_then(|v| i64::try_from(v).ok()) {
            Some(v) => Obj::Int(v),
            None => Obj::BigInt(Rc::from(bytes)),
        }
    }

    fn memo_get(&self, idx: u64) -> Result<Obj> {
        self.memo.get(&idx).cloned().ok_or_else(|| self.err(format!("memo index {idx} was never stored")))
    }

    fn memo_put(&mut self, idx: u64) -> Result<()> {
        let v = self.top()?.clone();
        self.memo.insert(idx, v);
        Ok(())
    }

    fn run(&mut self) -> Result<Obj> {
        loop {
            self.op_offset = self.base + self.pos as u64;
            let Some(&op) = self.data.get(self.pos) else {
                return Err(TorchIoError::Truncated {
                    what: "pickle opcode (no STOP)".into(),
                    offset: self.op_offset,
                    needed: 1,
                    available: 0,
                });
            };
            self.op = op;
            self.pos += 1;
            match op {
                0x80 => {
                    let proto = self.u8()?;
                    if proto > 5 {
                        return Err(self.err(format!("pickle protocol {proto} is newer than 5")));
                    }
                }
                0x95 => {
                    // FRAME: a length hint only.
                    self.u64()?;
                }
                b'.' => {
                    let v = self.pop()?;
                    return Ok(v);
                }
                b'(' => self.marks.push(self.stack.len()),
                b'0' => {
                    if self.marks.last() == Some(&self.stack.len()) {
                        self.marks.pop();
                    } else {
                        self.pop()?;
                    }
                }
                b'1' => {
                    self.pop_mark()?;
                }
                b'2' => {
                    let v = self.top()?.clone();
                    self.stack.push(v);
                }
                b'N' => self.stack.push(Obj::None),
                0x88 => self.stack.push(Obj::Bool(true)),
                0x89 => self.stack.push(Obj::Bool(false)),
                b'J' => {
                    let v = self.u32()? as i32;
                    self.stack.push(Obj::Int(v.into()));
                }
                b'K' => {
                    let v = self.u8()?;
                    self.stack.push(Obj::Int(v.into()));
                }
                b'M' => {
                    let v = self.u16()?;
                    self.stack.push(Obj::Int(v.into()));
                }
                0x8a | 0x8b => {
                    let n = if op == 0x8a { u64::from(self.u8()?) } else { u64::from(self.u32()? as i32 as u32) };
                    if op == 0x8b && (self.data[self.pos - 1] & 0x80) != 0 {
                        return Err(self.err("negative LONG4 length"));
                    }
                    let n = self.len_arg(n)?;
                    let bytes = self.take(n, "integer bytes")?.to_vec();
                    let v = self.int_from_le(&bytes);
                    self.stack.push(v);
                }
                b'I' | b'L' => {
                    let line = self.line()?;
                    let t = line.trim_end_matches('L');
                    let v = match t {
                        "00" if op == b'I' => Obj::Bool(false),
                        "01" if op == b'I' => Obj::Bool(true),
                        _ => {
                            let v: i128 = t.parse().map_err(|_| self.err(format!("bad integer {line:?}")))?;
                            match i64::try_from(v) {
                                Ok(v) => Obj::Int(v),
                                Err(_) => Obj::BigInt(Rc::from(super::value::BigInt::from_i128(v).le_bytes())),
                            }
                        }
                    };
                    self.stack.push(v);
                }
                b'G' => {
                    let b = self.take(8, "float")?;
                    let mut a = [0u8; 8];
                    a.copy_from_slice(b);
                    self.stack.push(Obj::Float(f64::from_be_bytes(a)));
                }
                b'F' => {
                    let line = self.line()?;
                    let v: f64 = line.trim().parse().map_err(|_| self.err(format!("bad float {line:?}")))?;
                    self.stack.push(Obj::Float(v));
                }
                b'X' | 0x8c | 0x8d => {
                    let n = match op {
                        b'X' => u64::from(self.u32()?),
                        0x8c => u64::from(self.u8()?),
                        _ => self.u64()?,
                    };
                    let n = self.len_arg(n)?;
                    let bytes = self.take(n, "string")?;
                    let v = self.str_obj(bytes)?;
                    self.stack.push(v);
                }
                b'U' | b'T' => {
                    // Python 2 str: decoded as UTF-8 (torch.load's default encoding); bytes
                    // that are not UTF-8 stay bytes.
                    let n = if op == b'U' { u64::from(self.u8()?) } else { u64::from(self.u32()?) };
                    if op == b'T' && (self.data[self.pos - 1] & 0x80) != 0 {
                        return Err(self.err("negative BINSTRING length"));
                    }
                    let n = self.len_arg(n)?;
                    let bytes = self.take(n, "string")?;
                    let v = match std::str::from_utf8(bytes) {
                        Ok(s) => Obj::Str(Rc::from(s)),
                        Err(_) => Obj::Bytes(Rc::from(bytes)),
                    };
                    self.stack.push(v);
                }
                b'B' | b'C' | 0x8e | 0x96 => {
                    let n = match op {
                        b'B' => u64::from(self.u32()?),
                        b'C' => u64::from(self.u8()?),
                        _ => self.u64()?,
                    };
                    let n = self.len_arg(n)?;
                    let bytes = self.take(n, "bytes")?;
                    self.stack.push(Obj::Bytes(Rc::from(bytes)));
                }
                b')' => self.push_heap(HeapObj::Tuple(Vec::new())),
                0x85..=0x87 => {
                    let n = (op - 0x84) as usize;
                    let mut items = Vec::with_capacity(n);
                    for _ in 0..n {
                        items.push(self.pop()?);
                    }
                    items.reverse();
                    self.push_heap(HeapObj::Tuple(items));
                }
                b't' => {
                    let items = self.pop_mark()?;
                    self.push_heap(HeapObj::Tuple(items));
                }
                b']' => self.push_heap(HeapObj::List(Vec::new())),
                b'l' => {
                    let items = self.pop_mark()?;
                    self.push_heap(HeapObj::List(items));
                }
                b'}' => self.push_heap(HeapObj::Dict { ordered: false, items: Vec::new(), attrs: Vec::new() }),
                b'd' => {
                    let items = self.pop_mark()?;
                    if items.len() % 2 != 0 {
                        return Err(self.err("odd number of items for DICT"));
                    }
                    let items = pairs(items);
                    self.push_heap(HeapObj::Dict { ordered: false, items, attrs: Vec::new() });
                }
                b'a' => {
                    let v = self.pop()?;
                    self.extend_list(vec![v])?;
                }
                b'e' => {
                    let items = self.pop_mark()?;
                    self.extend_list(items)?;
                }
                b's' => {
                    let v = self.pop()?;
                    let k = self.pop()?;
                    self.set_items(vec![(k, v)])?;
                }
                b'u' => {
                    let items = self.pop_mark()?;
                    if items.len() % 2 != 0 {
                        return Err(self.err("odd number of items for SETITEMS"));
                    }
                    self.set_items(pairs(items))?;
                }
                b'h' => {
                    let i = u64::from(self.u8()?);
                    let v = self.memo_get(i)?;
                    self.stack.push(v);
                }
                b'j' => {
                    let i = u64::from(self.u32()?);
                    let v = self.memo_get(i)?;
                    self.stack.push(v);
                }
                b'g' => {
                    let line = self.line()?;
                    let i: u64 = line.trim().parse().map_err(|_| self.err(format!("bad memo index {line:?}")))?;
                    let v = self.memo_get(i)?;
                    self.stack.push(v);
                }
                b'q' => {
                    let i = u64::from(self.u8()?);
                    self.memo_put(i)?;
                }
                b'r' => {
                    let i = u64::from(self.u32()?);
                    self.memo_put(i)?;
                }
                b'p' => {
                    let line = self.line()?;
                    let i: u64 = line.trim().parse().map_err(|_| self.err(format!("bad memo index {line:?}")))?;
                    self.memo_put(i)?;
                }
                0x94 => {
                    let i = self.memo.len() as u64;
                    self.memo_put(i)?;
                }
                b'c' => {
                    let module = self.line()?;
                    let name = self.line()?;
                    let g = resolve_global(&module, &name, self.op_offset)?;
                    self.push_heap(HeapObj::Global(g));
                }
                0x93 => {
                    let name = self.pop()?;
                    let module = self.pop()?;
                    let (Obj::Str(module), Obj::Str(name)) = (module, name) else {
                        return Err(self.err("STACK_GLOBAL needs two strings"));
                    };
                    let g = resolve_global(&module, &name, self.op_offset)?;
                    self.push_heap(HeapObj::Global(g));
                }
                b'R' => {
                    let args = self.pop()?;
                    let func = self.pop()?;
                    let v = self.call(&func, &args)?;
                    self.stack.push(v);
                }
                0x81 => {
                    // NEWOBJ: cls.__new__(cls, *args); only an empty OrderedDict qualifies.
                    let args = self.pop()?;
                    let cls = self.pop()?;
                    let g = self.global_of(&cls);
                    let empty =
                        matches!(&args, Obj::Ref(i) if matches!(self.heap.get(*i), HeapObj::Tuple(a) if a.is_empty()));
                    if g == Some(Global::OrderedDict) && empty {
                        self.push_heap(HeapObj::Dict { ordered: true, items: Vec::new(), attrs: Vec::new() });
                    } else {
                        let what = g.map(Global::describe).unwrap_or_else(|| "a non-class".into());
                        return Err(self.unsupported(format!("NEWOBJ of {what}")));
                    }
                }
                b'b' => {
                    let state = self.pop()?;
                    let inst = self.top()?.clone();
                    self.build(&inst, state)?;
                }
                b'Q' => {
                    let pid = self.pop()?;
                    let v = self.persistent.load(&pid, &mut self.heap, self.op_offset)?;
                    self.stack.push(v);
                }
                b'P' => {
                    let line = self.line()?;
                    let pid = Obj::Str(Rc::from(line.as_str()));
                    let v = self.persistent.load(&pid, &mut self.heap, self.op_offset)?;
                    self.stack.push(v);
                }
                0x8f..=0x91 => return Err(self.unsupported("a set or frozenset (the value tree has no set type)")),
                _ => return Err(TorchIoError::UnknownOpcode { offset: self.op_offset, opcode: op }),
            }
        }
    }

    fn global_of(&self, o: &Obj) -> Option<Global> {
        match o {
            Obj::Ref(i) => match self.heap.get(*i) {
                HeapObj::Global(g) => Some(*g),
                _ => None,
            },
            _ => None,
        }
    }

    /// The items of a tuple, copied (and charged).
    fn tuple_items(&mut self, o: &Obj) -> Result<Option<Vec<Obj>>> {
        let n = match o {
            Obj::Ref(i) => match self.heap.get(*i) {
                HeapObj::Tuple(t) => t.len(),
                _ => return Ok(None),
            },
            _ => return Ok(None),
        };
        self.charge_objs(n)?;
        Ok(match o {
            Obj::Ref(i) => match self.heap.get(*i) {
                HeapObj::Tuple(t) => Some(t.clone()),
                _ => None,
            },
            _ => None,
        })
    }

    fn extend_list(&mut self, items: Vec<Obj>) -> Result<()> {
        let target = self.top()?.clone();
        match target {
            Obj::Ref(i) => match self.heap.get_mut(i) {
                HeapObj::List(l) => {
                    l.extend(items);
                    Ok(())
                }
                _ => Err(self.err("APPEND to something that is not a list")),
            },
            _ => Err(self.err("APPEND to something that is not a list")),
        }
    }

    fn set_items(&mut self, new: Vec<(Obj, Obj)>) -> Result<()> {
        let target = self.top()?.clone();
        match target {
            Obj::Ref(i) => match self.heap.get_mut(i) {
                HeapObj::Dict { items, .. } => {
                    items.extend(new);
                    Ok(())
                }
                _ => Err(self.err("SETITEM on something that is not a dict")),
            },
            _ => Err(self.err("SETITEM on something that is not a dict")),
        }
    }

    fn build(&mut self, inst: &Obj, state: Obj) -> Result<()> {
        let Obj::Ref(i) = inst else {
            return Err(self.unsupported("BUILD on a plain value"));
        };
        if !matches!(self.heap.get(*i), HeapObj::Dict { ordered: true, .. }) {
            return Err(self.unsupported("BUILD on something other than an OrderedDict"));
        }
        // state: None, a dict of attributes, or (dict, slot dict).
        let mut new_attrs = Vec::new();
        let mut parts = vec![state];
        if let Some(t) = self.tuple_items(&parts[0])? {
            if t.len() == 2 {
                parts = t;
            }
        }
        for p in parts {
            match p {
                Obj::None => {}
                Obj::Ref(j) => match self.heap.get(j) {
                    HeapObj::Dict { items, .. } => {
                        let n = items.len();
                        self.charge_objs(2 * n)?;
                        let HeapObj::Dict { items, .. } = self.heap.get(j) else {
                            return Err(self.unsupported("BUILD state that is not a dict"));
                        };
                        for (k, v) in items {
                            if !matches!(k, Obj::Str(_)) {
                                return Err(self.unsupported("BUILD state with a non-str attribute name"));
                            }
                            new_attrs.push((k.clone(), v.clone()));
                        }
                    }
                    _ => return Err(self.unsupported("BUILD state that is not a dict")),
                },
                _ => return Err(self.unsupported("BUILD state that is not a dict")),
            }
        }
        if let HeapObj::Dict { attrs, .. } = self.heap.get_mut(*i) {
            attrs.extend(new_attrs);
        }
        Ok(())
    }

    fn int_tuple(&self, o: &Obj, what: &str) -> Result<Vec<i64>> {
        let items = match o {
            Obj::Ref(i) => match self.heap.get(*i) {
                HeapObj::Tuple(t) | HeapObj::List(t) => t,
                _ => return Err(self.unsupported(format!("tensor {what} is not a tuple"))),
            },
            _ => return Err(self.unsupported(format!("tensor {what} is not a tuple"))),
        };
        if items.len() > MAX_RANK {
            return Err(self.unsupported(format!("tensor {what} has {} dimensions (limit {MAX_RANK})", items.len())));
        }
        items
            .iter()
            .map(|x| match x {
                Obj::Int(v) => Ok(*v),
                _ => Err(self.unsupported(format!("tensor {what} holds a non-int"))),
            })
            .collect()
    }

    /// Calls an allowed global. `_rebuild_from_type_v2(func, type, args, state)` calls `func`
    /// on `args`, which may be that function again: unrolled here, at most [`MAX_DEPTH`] deep.
    fn call(&mut self, func: &Obj, args: &Obj) -> Result<Obj> {
        let (mut func, mut args) = (func.clone(), args.clone());
        let mut depth = 0;
        loop {
            let Some(g) = self.global_of(&func) else {
                return Err(self.unsupported("REDUCE on something that is not an allowed global"));
            };
            if g != Global::RebuildFromTypeV2 {
                return self.call_once(g, &args);
            }
            if depth >= MAX_DEPTH {
                return Err(TorchIoError::TooDeep {
                    what: "nested _rebuild_from_type_v2 calls",
                    path: format!("offset {}", self.op_offset),
                    limit: MAX_DEPTH as u64,
                });
            }
            // (func, new_type, args, state): a plain Tensor or Parameter rebuilt by func; the
            // state (attributes of a tensor subclass) is dropped.
            let bad = || format!("{} called with unexpected arguments", g.describe());
            let (inner_func, new_type, inner_args) = match &args {
                Obj::Ref(i) => match self.heap.get(*i) {
                    HeapObj::Tuple(t) if t.len() == 4 => (t[0].clone(), t[1].clone(), t[2].clone()),
                    HeapObj::Tuple(_) => return Err(self.unsupported(bad())),
                    _ => {
                        return Err(
                            self.unsupported(format!("REDUCE of {} with arguments that are not a tuple", g.describe()))
                        )
                    }
                },
                _ => {
                    return Err(
                        self.unsupported(format!("REDUCE of {} with arguments that are not a tuple", g.describe()))
                    )
                }
            };
            match self.global_of(&new_type) {
                Some(Global::TensorType | Global::ParameterType) => {}
                _ => return Err(self.unsupported("tensor subclass (only torch.Tensor and Parameter are read)")),
            }
            func = inner_func;
            args = inner_args;
            depth += 1;
        }
    }

    fn call_once(&mut self, g: Global, args: &Obj) -> Result<Obj> {
        let Some(args) = self.tuple_items(args)? else {
            return Err(self.unsupported(format!("REDUCE of {} with arguments that are not a tuple", g.describe())));
        };
        let bad_args = |m: &Self| m.unsupported(format!("{} called with unexpected arguments", g.describe()));
        match g {
            Global::OrderedDict => {
                let items = match args.as_slice() {
                    [] => Vec::new(),
                    [Obj::Ref(i)] => {
                        let n = match self.heap.get(*i) {
                            HeapObj::Dict { items, .. } => 2 * items.len(),
                            HeapObj::List(l) | HeapObj::Tuple(l) => 2 * l.len(),
                            _ => 0,
                        };
                        self.charge_objs(n)?;
                        match self.heap.get(*i) {
                            HeapObj::Dict { items, .. } => items.clone(),
                            // Python 2's OrderedDict.__reduce__: a list of [key, value] pairs.
                            HeapObj::List(l) | HeapObj::Tuple(l) => {
                                let mut out = Vec::with_capacity(l.len());
                                for p in l {
                                    let kv = match p {
                                        Obj::Ref(j) => match self.heap.get(*j) {
                                            HeapObj::Tuple(kv) | HeapObj::List(kv) if kv.len() == 2 => kv,
                                            _ => return Err(bad_args(self)),
                                        },
                                        _ => return Err(bad_args(self)),
                                    };
                                    out.push((kv[0].clone(), kv[1].clone()));
                                }
                                out
                            }
                            _ => return Err(bad_args(self)),
                        }
                    }
                    _ => return Err(bad_args(self)),
                };
                Ok(self.new_heap(HeapObj::Dict { ordered: true, items, attrs: Vec::new() }))
            }
            Global::TorchSize => match args.as_slice() {
                [] => Ok(self.new_heap(HeapObj::Tuple(Vec::new()))),
                [o] => match self.tuple_or_list(o)? {
                    Some(t) => Ok(self.new_heap(HeapObj::Tuple(t))),
                    None => Err(bad_args(self)),
                },
                _ => Err(bad_args(self)),
            },
            Global::CodecsEncode | Global::Bytearray => {
                match args.as_slice() {
                    [Obj::Bytes(b)] => self.charge(b.len() as u64)?,
                    [Obj::Str(s), _] => self.charge(s.len() as u64)?,
                    _ => {}
                }
                let bytes = match args.as_slice() {
                    [] if g == Global::Bytearray => Vec::new(),
                    [Obj::Bytes(b)] if g == Global::Bytearray => b.to_vec(),
                    [Obj::Str(s), Obj::Str(enc)] => match enc.to_ascii_lowercase().replace('_', "-").as_str() {
                        "latin1" | "latin-1" | "iso-8859-1" => {
                            let mut out = Vec::with_capacity(s.len());
                            for c in s.chars() {
                                let c = u32::from(c);
                                if c > 0xff {
                                    return Err(self.unsupported("latin1 encode of a character above U+00FF"));
                                }
                                out.push(c as u8);
                            }
                            out
                        }
                        "utf-8" | "utf8" => s.as_bytes().to_vec(),
                        "ascii" if s.is_ascii() => s.as_bytes().to_vec(),
                        _ => return Err(self.unsupported(format!("encode with encoding {enc:?}"))),
                    },
                    _ => return Err(bad_args(self)),
                };
                Ok(Obj::Bytes(Rc::from(bytes)))
            }
            Global::RebuildTensor | Global::RebuildTensorV2 | Global::RebuildTensorV3 => {
                let min = match g {
                    Global::RebuildTensor => 4,
                    Global::RebuildTensorV2 => 6,
                    _ => 7,
                };
                if args.len() < min || args.len() > min + 1 {
                    return Err(bad_args(self));
                }
                let storage = match &args[0] {
                    Obj::Ref(i) => match self.heap.get(*i) {
                        HeapObj::Storage(s) => s.clone(),
                        _ => return Err(self.unsupported("tensor rebuilt from something that is not a storage")),
                    },
                    _ => return Err(self.unsupported("tensor rebuilt from something that is not a storage")),
                };
                let Obj::Int(offset) = args[1] else {
                    return Err(bad_args(self));
                };
                let size = self.int_tuple(&args[2], "size")?;
                let stride = self.int_tuple(&args[3], "stride")?;
                let requires_grad = match args.get(4) {
                    None => false,
                    Some(Obj::Bool(b)) => *b,
                    Some(_) => return Err(bad_args(self)),
                };
                let decl_kind = storage.kind;
                let kind = if g == Global::RebuildTensorV3 {
                    match self.global_of(&args[6]) {
                        Some(Global::Dtype(k)) => k,
                        _ => return Err(bad_args(self)),
                    }
                } else {
                    decl_kind
                };
                self.make_tensor(storage, decl_kind, kind, offset, size, stride, requires_grad)
            }
            Global::RebuildParameter | Global::RebuildParameterWithState => {
                let n = if g == Global::RebuildParameter { 3 } else { 4 };
                if args.len() != n {
                    return Err(bad_args(self));
                }
                let (Obj::Ref(i), Obj::Bool(rg)) = (&args[0], &args[1]) else {
                    return Err(bad_args(self));
                };
                let HeapObj::Tensor(t) = self.heap.get(*i) else {
                    return Err(bad_args(self));
                };
                let mut t = t.clone();
                t.requires_grad = *rg;
                Ok(self.new_heap(HeapObj::Tensor(t)))
            }
            Global::TensorType
            | Global::ParameterType
            | Global::StorageType(_)
            | Global::RebuildFromTypeV2
            | Global::Dtype(_) => Err(self.unsupported(format!("call of {}", g.describe()))),
        }
    }

    /// The items of a tuple or list, copied (and charged).
    fn tuple_or_list(&mut self, o: &Obj) -> Result<Option<Vec<Obj>>> {
        let n = match o {
            Obj::Ref(i) => match self.heap.get(*i) {
                HeapObj::Tuple(t) | HeapObj::List(t) => t.len(),
                _ => return Ok(None),
            },
            _ => return Ok(None),
        };
        self.charge_objs(n)?;
        Ok(match o {
            Obj::Ref(i) => match self.heap.get(*i) {
                HeapObj::Tuple(t) | HeapObj::List(t) => Some(t.clone()),
                _ => None,
            },
            _ => None,
        })
    }

    fn new_heap(&mut self, o: HeapObj) -> Obj {
        Obj::Ref(self.heap.push(o))
    }

    #[allow(clippy::too_many_arguments)]
    fn make_tensor(
        &mut self,
        storage: StorageView,
        storage_kind: Kind,
        kind: Kind,
        offset: i64,
        size: Vec<i64>,
        stride: Vec<i64>,
        requires_grad: bool,
    ) -> Result<Obj> {
        if size.len() != stride.len() {
            return Err(self.unsupported(format!("tensor size {size:?} and stride {stride:?} differ in rank")));
        }
        // A dtype other than the storage's (rebuild_tensor_v3 on an untyped storage): the
        // whole storage is reinterpreted, so it must hold whole elements of the tensor's dtype.
        let window_numel = if kind == storage_kind {
            storage.numel
        } else {
            let Some(bytes) = storage.numel.checked_mul(elem_size(storage_kind)) else {
                return Err(TorchIoError::StorageMismatch {
                    key: storage.key.to_string(),
                    message: format!("{} elements of {storage_kind:?} overflow a byte count", storage.numel),
                });
            };
            if storage.offset != 0 || bytes % elem_size(kind) != 0 {
                return Err(self.unsupported(format!("a {kind:?} tensor on a storage of {bytes} bytes")));
            }
            bytes / elem_size(kind)
        };
        let needed = needed_elements(&size, &stride, offset);
        if needed.map_or(true, |n| n > window_numel) {
            return Err(TorchIoError::StorageOutOfBounds {
                offset: self.op_offset,
                key: storage.key.to_string(),
                size,
                stride,
                storage_offset: offset,
                needed: needed.unwrap_or(0),
                storage_numel: window_numel,
            });
        }
        let storage_offset = root_offset(offset, &storage, self.op_offset)?;
        let spec = TensorSpec { storage, kind, storage_offset, size, stride, requires_grad };
        Ok(self.new_heap(HeapObj::Tensor(spec)))
    }
}

/// A view's offset counted from its root storage's start.
fn root_offset(offset: i64, storage: &StorageView, at: u64) -> Result<i64> {
    i64::try_from(storage.offset).ok().and_then(|o| o.checked_add(offset)).ok_or_else(|| TorchIoError::Unsupported {
        offset: at,
        message: format!("storage offset {offset} + {} overflows", storage.offset),
    })
}

fn pairs(items: Vec<Obj>) -> Vec<(Obj, Obj)> {
    let mut out = Vec::with_capacity(items.len() / 2);
    let mut it = items.into_iter();
    while let (Some(k), Some(v)) = (it.next(), it.next()) {
        out.push((k, v));
    }
    out
}
