//! The value tree a `torch.save` file is read into and written from.
use std::fmt;

use indexmap::IndexMap;
use tch::Tensor;

use super::error::{Result, TorchIoError};

/// A Python value as `torch.save` stores it.
///
/// Python's containers map one to one: `list` → [`Value::List`], `tuple` → [`Value::Tuple`],
/// `dict` and `collections.OrderedDict` → [`Value::Dict`] (insertion order kept, with
/// [`Dict::is_ordered`] telling which). A `torch.Tensor` or `nn.Parameter` becomes a
/// [`Value::Tensor`] holding a tch tensor with the saved dtype, shape, strides and storage
/// offset; tensors that viewed one storage in Python view one storage in tch too.
///
/// A tree may be of any depth: dropping it, `Debug` and [`Value::shallow_clone`] walk it on
/// the heap, not on the thread's stack. Reading and writing refuse a tree more than 256
/// levels deep ([`TorchIoError::TooDeep`]). Because `Value` implements `Drop`, a payload is
/// taken out of it through a reference (`std::mem::take(d)` on `Value::Dict(d)`), not by
/// moving it out in a pattern.
#[non_exhaustive]
pub enum Value {
    /// `None`.
    None,
    /// `True` / `False`.
    Bool(bool),
    /// An `int` that fits an i64.
    Int(i64),
    /// An `int` beyond i64 (pickle's LONG opcodes), kept exactly.
    BigInt(BigInt),
    /// A `float` (bit for bit, NaN payloads included).
    Float(f64),
    /// A `str`.
    Str(String),
    /// `bytes` or `bytearray`.
    Bytes(Vec<u8>),
    /// A `list`.
    List(Vec<Value>),
    /// A `tuple` (also `torch.Size`).
    Tuple(Vec<Value>),
    /// A `dict` or `collections.OrderedDict`.
    Dict(Dict),
    /// A tensor.
    Tensor(Tensor),
}

/// An integer outside i64, as the two's-complement little-endian bytes pickle stores
/// (`LONG1`/`LONG4`; Python's `int.to_bytes(n, "little", signed=True)`).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct BigInt {
    bytes: Vec<u8>,
}

impl BigInt {
    /// From two's-complement little-endian bytes (an empty slice is 0).
    pub fn from_le_bytes(bytes: &[u8]) -> Self {
        Self { bytes: bytes.to_vec() }
    }

    /// From an i128.
    pub fn from_i128(v: i128) -> Self {
        let mut bytes = v.to_le_bytes().to_vec();
        // Drop redundant sign bytes: keep the shortest two's-complement form.
        while bytes.len() > 1 {
            let last = bytes[bytes.len() - 1];
            let prev = bytes[bytes.len() - 2];
            if (last == 0 && prev & 0x80 == 0) || (last == 0xff && prev & 0x80 != 0) {
                bytes.pop();
            } else {
                break;
            }
        }
        Self { bytes }
    }

    /// The two's-complement little-endian bytes.
    pub fn le_bytes(&self) -> &[u8] {
        &self.bytes
    }

    /// The value as an i128, if it fits.
    pub fn to_i128(&self) -> Option<i128> {
        to_i128(&self.bytes)
    }

    /// The value as an i64, if it fits.
    pub fn to_i64(&self) -> Option<i64> {
        self.to_i128().and_then(|v| i64::try_from(v).ok())
    }
}

impl fmt::Display for BigInt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.to_i128() {
            Some(v) => write!(f, "{v}"),
            None => {
                write!(f, "0x")?;
                for b in self.bytes.iter().rev() {
                    write!(f, "{b:02x}")?;
                }
                write!(f, " (two's complement, {} bytes)", self.bytes.len())
            }
        }
    }
}

/// Two's-complement little-endian bytes to i128, if they fit.
pub(crate) fn to_i128(bytes: &[u8]) -> Option<i128> {
    if bytes.is_empty() {
        return Some(0);
    }
    let negative = bytes[bytes.len() - 1] & 0x80 != 0;
    let fill = if negative { 0xff } else { 0 };
    if bytes.len() > 16 {
        // Fits only if every extra byte is sign fill and the sign agrees.
        if bytes[16..].iter().any(|&b| b != fill) || ((bytes[15] & 0x80 != 0) != negative) {
            return None;
        }
    }
    let mut buf = [fill; 16];
    let n = bytes.len().min(16);
    buf[..n].copy_from_slice(&bytes[..n]);
    Some(i128::from_le_bytes(buf))
}

/// A dict key: Python str or int (optimizer state is keyed by int).
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Key {
    /// A `str` key.
    Str(String),
    /// An `int` key (within i64).
    Int(i64),
}

impl fmt::Display for Key {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Key::Str(s) => write!(f, "{s:?}"),
            Key::Int(i) => write!(f, "{i}"),
        }
    }
}

impl From<&str> for Key {
    fn from(s: &str) -> Self {
        Key::Str(s.to_string())
    }
}
impl From<String> for Key {
    fn from(s: String) -> Self {
        Key::Str(s)
    }
}
impl From<i64> for Key {
    fn from(i: i64) -> Self {
        Key::Int(i)
    }
}
impl From<i32> for Key {
    fn from(i: i32) -> Self {
        Key::Int(i.into())
    }
}

/// A Python `dict` or `collections.OrderedDict`, in insertion order.
///
/// An `OrderedDict` may carry attributes set by pickle's BUILD: `nn.Module.state_dict()`
/// attaches `_metadata` (each submodule's `version`, which `load_state_dict` passes to
/// `_load_from_state_dict`, e.g. BatchNorm's). They are kept, readable with
/// [`Dict::attribute`], and written back.
#[derive(Default)]
pub struct Dict {
    ordered: bool,
    entries: IndexMap<Key, Value>,
    attributes: IndexMap<String, Value>,
}

impl Dict {
    /// An empty plain `dict`.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty `collections.OrderedDict` (what `state_dict()` returns).
    pub fn new_ordered() -> Self {
        Self { ordered: true, ..Self::default() }
    }

    /// Whether this is an `OrderedDict` (written back as one).
    pub fn is_ordered(&self) -> bool {
        self.ordered
    }

    /// Makes this an `OrderedDict` (`true`) or a plain `dict` (`false`).
    pub fn set_ordered(&mut self, ordered: bool) {
        self.ordered = ordered;
    }

    /// Inserts or replaces (a replaced key keeps its position, as in Python); returns the old
    /// value.
    pub fn insert(&mut self, key: impl Into<Key>, value: Value) -> Option<Value> {
        self.entries.insert(key.into(), value)
    }

    /// Builder form of [`Dict::insert`].
    pub fn with(mut self, key: impl Into<Key>, value: Value) -> Self {
        self.insert(key, value);
        self
    }

    /// The value under `key`.
    pub fn get(&self, key: &Key) -> Option<&Value> {
        self.entries.get(key)
    }

    /// The value under the str key `key`.
    pub fn get_str(&self, key: &str) -> Option<&Value> {
        self.entries.get(&Key::Str(key.to_string()))
    }

    /// The value under `key`, to change in place.
    pub fn get_mut(&mut self, key: &Key) -> Option<&mut Value> {
        self.entries.get_mut(key)
    }

    /// The value under the str key `key`, to change in place.
    pub fn get_str_mut(&mut self, key: &str) -> Option<&mut Value> {
        self.entries.get_mut(&Key::Str(key.to_string()))
    }

    /// Entries in insertion order, values mutable.
    pub fn iter_mut(&mut self) -> impl Iterator<Item = (&Key, &mut Value)> {
        self.entries.iter_mut()
    }

    /// Removes `key`, keeping the order of the others.
    pub fn remove(&mut self, key: &Key) -> Option<Value> {
        self.entries.shift_remove(key)
    }

    /// Number of entries.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether there are no entries.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Entries in insertion order.
    pub fn iter(&self) -> impl Iterator<Item = (&Key, &Value)> {
        self.entries.iter()
    }

    /// Keys in insertion order.
    pub fn keys(&self) -> impl Iterator<Item = &Key> {
        self.entries.keys()
    }

    /// An attribute set by BUILD (`"_metadata"` on a state dict).
    pub fn attribute(&self, name: &str) -> Option<&Value> {
        self.attributes.get(name)
    }

    /// All attributes, in the order they were set.
    pub fn attributes(&self) -> impl Iterator<Item = (&str, &Value)> {
        self.attributes.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// Sets an attribute (written with BUILD; only an `OrderedDict` can carry attributes, so
    /// saving a plain dict with attributes is refused).
    pub fn set_attribute(&mut self, name: impl Into<String>, value: Value) -> Option<Value> {
        self.attributes.insert(name.into(), value)
    }

    /// Removes an attribute.
    pub fn remove_attribute(&mut self, name: &str) -> Option<Value> {
        self.attributes.shift_remove(name)
    }

    pub(crate) fn entry_map(&self) -> &IndexMap<Key, Value> {
        &self.entries
    }

    pub(crate) fn attribute_map(&self) -> &IndexMap<String, Value> {
        &self.attributes
    }
}

/// The children of a container, moved out of it.
type Children = Box<dyn Iterator<Item = Value>>;

impl Value {
    /// Whether this is a container holding anything.
    fn has_children(&self) -> bool {
        match self {
            Value::List(v) | Value::Tuple(v) => !v.is_empty(),
            Value::Dict(d) => !d.entries.is_empty() || !d.attributes.is_empty(),
            _ => false,
        }
    }

    /// Moves the children out when one of them has children of its own (dropping it in place
    /// would recurse); `None` leaves the children to drop glue, which then does not recurse.
    fn take_nested(&mut self) -> Option<Children> {
        match self {
            Value::List(v) | Value::Tuple(v) if v.iter().any(Value::has_children) => {
                Some(Box::new(std::mem::take(v).into_iter()))
            }
            Value::Dict(d) if d.entries.values().chain(d.attributes.values()).any(Value::has_children) => {
                let entries = std::mem::take(&mut d.entries).into_values();
                Some(Box::new(entries.chain(std::mem::take(&mut d.attributes).into_values())))
            }
            _ => None,
        }
    }
}

/// Drops a tree of any depth on a heap stack of child iterators: each node is emptied of its
/// children before it is dropped, so drop glue never nests.
impl Drop for Value {
    fn drop(&mut self) {
        let Some(children) = self.take_nested() else { return };
        let mut stack = vec![children];
        while let Some(top) = stack.last_mut() {
            let Some(mut child) = top.next() else {
                stack.pop();
                continue;
            };
            if top.size_hint().1 == Some(0) {
                // Exhausted: off the stack before the child's children go on it (a chain
                // keeps one iterator, not one per level).
                stack.pop();
            }
            if let Some(grandchildren) = child.take_nested() {
                stack.push(grandchildren);
            }
        }
    }
}

impl FromIterator<(Key, Value)> for Dict {
    fn from_iter<I: IntoIterator<Item = (Key, Value)>>(iter: I) -> Self {
        Self { entries: iter.into_iter().collect(), ..Self::default() }
    }
}

impl Value {
    /// The Python type name (`"int"`, `"dict"`, `"Tensor"`, ...), for messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::None => "None",
            Value::Bool(_) => "bool",
            Value::Int(_) | Value::BigInt(_) => "int",
            Value::Float(_) => "float",
            Value::Str(_) => "str",
            Value::Bytes(_) => "bytes",
            Value::List(_) => "list",
            Value::Tuple(_) => "tuple",
            Value::Dict(d) if d.is_ordered() => "OrderedDict",
            Value::Dict(_) => "dict",
            Value::Tensor(_) => "Tensor",
        }
    }

    /// A cursor at the root of this tree, for typed navigation with error paths.
    pub fn node(&self) -> Node<'_> {
        Node { value: self, path: Vec::new() }
    }

    /// Navigates from the root (shorthand for `self.node().get(key)`).
    pub fn get<'k>(&self, key: impl Into<Seg<'k>>) -> Result<Node<'_>> {
        self.node().get(key)
    }

    /// The entry under a dict key, or the element at a list/tuple index (negative indices count
    /// from the end), to change in place. One step; [`Value::path_mut`] goes down several and
    /// names the whole path in its errors.
    ///
    /// # Errors
    /// As [`Value::path_mut`].
    pub fn get_mut<'k>(&mut self, seg: impl Into<Seg<'k>>) -> Result<&mut Value> {
        self.path_mut(&[seg.into()])
    }

    /// The entry at `path` (dict keys and list/tuple indices, from this value), to change in
    /// place without rebuilding the tree:
    ///
    /// ```
    /// # use tch_amp::torch_io::{Dict, Seg, Value};
    /// let group = Dict::new().with("lr", Value::Float(0.1)).with("weight_decay", Value::Float(0.01));
    /// let opt = Dict::new().with("param_groups", Value::List(vec![Value::Dict(group)]));
    /// let mut ckpt = Value::Dict(Dict::new().with("optimizer", Value::Dict(opt)));
    /// let path = [Seg::from("optimizer"), Seg::from("param_groups"), Seg::from(0), Seg::from("weight_decay")];
    /// *ckpt.path_mut(&path)? = Value::Float(0.0);
    /// assert_eq!(ckpt.get("optimizer")?.get("param_groups")?.get(0)?.get("weight_decay")?.as_f64()?, 0.0);
    /// let err = ckpt.path_mut(&[Seg::from("optimizer"), Seg::from("state")]).unwrap_err();
    /// assert_eq!(err.to_string(), "optimizer has no key \"state\"");
    /// # Ok::<(), tch_amp::torch_io::TorchIoError>(())
    /// ```
    ///
    /// # Errors
    /// [`TorchIoError::MissingKey`], [`TorchIoError::IndexOutOfRange`], or
    /// [`TorchIoError::TypeMismatch`] for a step into something that is no container (or a str
    /// key into a list); each names the path walked so far.
    pub fn path_mut(&mut self, path: &[Seg<'_>]) -> Result<&mut Value> {
        let mut cur = self;
        for (i, seg) in path.iter().enumerate() {
            cur = cur.step_mut(seg, &path[..i])?;
        }
        Ok(cur)
    }

    /// One step of [`Value::path_mut`]; `before`: the segments walked to get here.
    fn step_mut(&mut self, seg: &Seg<'_>, before: &[Seg<'_>]) -> Result<&mut Value> {
        let here = || seg_path(before);
        let found = self.type_name();
        match (self, seg) {
            (Value::Dict(d), Seg::Str(s)) => d
                .entries
                .get_mut(&Key::Str((*s).to_string()))
                .ok_or_else(|| TorchIoError::MissingKey { path: here(), key: format!("{s:?}") }),
            (Value::Dict(d), Seg::Int(i)) => d
                .entries
                .get_mut(&Key::Int(*i))
                .ok_or_else(|| TorchIoError::MissingKey { path: here(), key: i.to_string() }),
            (Value::List(v) | Value::Tuple(v), Seg::Int(i)) => {
                let len = v.len();
                let idx = if *i < 0 { *i + len as i64 } else { *i };
                match usize::try_from(idx).ok().filter(|&x| x < len) {
                    Some(x) => Ok(&mut v[x]),
                    None => Err(TorchIoError::IndexOutOfRange {
                        path: here(),
                        index: usize::try_from(*i).unwrap_or(usize::MAX),
                        len,
                    }),
                }
            }
            (Value::List(_) | Value::Tuple(_), Seg::Str(_)) => {
                Err(TorchIoError::TypeMismatch { path: here(), expected: "dict", found })
            }
            _ => Err(TorchIoError::TypeMismatch { path: here(), expected: "dict, list or tuple", found }),
        }
    }

    /// Inserts or replaces an entry of this dict (a replaced key keeps its position); returns
    /// the old value.
    ///
    /// # Errors
    /// [`TorchIoError::TypeMismatch`] when this is no dict.
    pub fn insert(&mut self, key: impl Into<Key>, value: Value) -> Result<Option<Value>> {
        let found = self.type_name();
        match self {
            Value::Dict(d) => Ok(d.insert(key, value)),
            _ => Err(TorchIoError::TypeMismatch { path: "<root>".into(), expected: "dict", found }),
        }
    }

    /// Removes the entry under a dict key (the others keep their order), or the element at a
    /// list index (negative indices count from the end); `None` when there is none.
    ///
    /// # Errors
    /// [`TorchIoError::TypeMismatch`] when this is neither a dict nor a list (a tuple cannot
    /// shrink), or for a str key into a list.
    pub fn remove<'k>(&mut self, seg: impl Into<Seg<'k>>) -> Result<Option<Value>> {
        let found = self.type_name();
        let seg = seg.into();
        match (self, &seg) {
            (Value::Dict(d), _) => Ok(d.remove(&match seg {
                Seg::Str(s) => Key::Str(s.to_string()),
                Seg::Int(i) => Key::Int(i),
            })),
            (Value::List(v), Seg::Int(i)) => {
                let len = v.len() as i64;
                let idx = if *i < 0 { *i + len } else { *i };
                Ok((0..len).contains(&idx).then(|| v.remove(idx as usize)))
            }
            (Value::List(_), Seg::Str(_)) => {
                Err(TorchIoError::TypeMismatch { path: "<root>".into(), expected: "dict", found })
            }
            _ => Err(TorchIoError::TypeMismatch { path: "<root>".into(), expected: "dict or list", found }),
        }
    }
}

impl From<bool> for Value {
    fn from(v: bool) -> Self {
        Value::Bool(v)
    }
}
impl From<i64> for Value {
    fn from(v: i64) -> Self {
        Value::Int(v)
    }
}
impl From<f64> for Value {
    fn from(v: f64) -> Self {
        Value::Float(v)
    }
}
impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Value::Str(v.to_string())
    }
}
impl From<String> for Value {
    fn from(v: String) -> Self {
        Value::Str(v)
    }
}
impl From<Tensor> for Value {
    fn from(v: Tensor) -> Self {
        Value::Tensor(v)
    }
}
impl From<Dict> for Value {
    fn from(v: Dict) -> Self {
        Value::Dict(v)
    }
}

/// One step of a path: a dict key or a list/tuple index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Seg<'a> {
    /// A str key.
    Str(&'a str),
    /// An int key, or an index into a list or tuple.
    Int(i64),
}

impl<'a> From<&'a str> for Seg<'a> {
    fn from(s: &'a str) -> Self {
        Seg::Str(s)
    }
}
impl<'a> From<&'a String> for Seg<'a> {
    fn from(s: &'a String) -> Self {
        Seg::Str(s)
    }
}
impl From<i64> for Seg<'_> {
    fn from(i: i64) -> Self {
        Seg::Int(i)
    }
}
impl From<i32> for Seg<'_> {
    fn from(i: i32) -> Self {
        Seg::Int(i.into())
    }
}
impl From<usize> for Seg<'_> {
    fn from(i: usize) -> Self {
        Seg::Int(i64::try_from(i).unwrap_or(i64::MAX))
    }
}
impl<'a> From<&'a Key> for Seg<'a> {
    fn from(k: &'a Key) -> Self {
        match k {
            Key::Str(s) => Seg::Str(s),
            Key::Int(i) => Seg::Int(*i),
        }
    }
}

/// Formats path segments as `optimizer.state.3.exp_avg`; a str segment that is empty, holds a
/// dot or a quote, or looks like an int, is quoted: `model["fc1.weight"]`.
pub(crate) fn format_path<S: AsRef<str>>(segs: &[PathSeg<S>]) -> String {
    if segs.is_empty() {
        return "<root>".to_string();
    }
    let mut out = String::new();
    for seg in segs {
        match seg {
            PathSeg::Int(i) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(&i.to_string());
            }
            PathSeg::Str(s) => {
                let s = s.as_ref();
                let plain = !s.is_empty()
                    && s.parse::<i64>().is_err()
                    && !s.chars().any(|c| matches!(c, '.' | '"' | '[' | ']') || c.is_whitespace());
                if plain {
                    if !out.is_empty() {
                        out.push('.');
                    }
                    out.push_str(s);
                } else {
                    out.push_str(&format!("[{s:?}]"));
                }
            }
        }
    }
    out
}

/// The path of `segs`, as [`format_path`] shows it.
fn seg_path(segs: &[Seg<'_>]) -> String {
    let segs: Vec<PathSeg<&str>> = segs
        .iter()
        .map(|s| match s {
            Seg::Str(s) => PathSeg::Str(*s),
            Seg::Int(i) => PathSeg::Int(*i),
        })
        .collect();
    format_path(&segs)
}

/// A path segment with owned or borrowed strings.
#[derive(Debug, Clone)]
pub(crate) enum PathSeg<S> {
    Str(S),
    Int(i64),
}

/// A position in a [`Value`] tree, for typed navigation whose errors name the path.
///
/// ```
/// # use tch_amp::torch_io::{Dict, Value};
/// let tree = Value::Dict(Dict::new().with("epoch", Value::Int(3)));
/// assert_eq!(tree.get("epoch")?.as_i64()?, 3);
/// let err = tree.get("optimizer").unwrap_err();
/// assert_eq!(err.to_string(), "<root> has no key \"optimizer\"");
/// # Ok::<(), tch_amp::torch_io::TorchIoError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Node<'a> {
    value: &'a Value,
    path: Vec<PathSeg<String>>,
}

impl<'a> Node<'a> {
    /// The value here.
    pub fn value(&self) -> &'a Value {
        self.value
    }

    /// The path from the root, as shown in errors.
    pub fn path(&self) -> String {
        format_path(&self.path)
    }

    fn child(&self, seg: Seg<'_>, value: &'a Value) -> Node<'a> {
        let mut path = self.path.clone();
        path.push(match seg {
            Seg::Str(s) => PathSeg::Str(s.to_string()),
            Seg::Int(i) => PathSeg::Int(i),
        });
        Node { value, path }
    }

    fn mismatch(&self, expected: &'static str) -> TorchIoError {
        TorchIoError::TypeMismatch { path: self.path(), expected, found: self.value.type_name() }
    }

    /// The entry under a dict key, or the element at a list/tuple index (negative indices count
    /// from the end, as in Python).
    ///
    /// # Errors
    /// [`TorchIoError::MissingKey`], [`TorchIoError::IndexOutOfRange`], or
    /// [`TorchIoError::TypeMismatch`] when this is no container.
    pub fn get<'k>(&self, seg: impl Into<Seg<'k>>) -> Result<Node<'a>> {
        let seg = seg.into();
        match self.get_opt(seg.clone())? {
            Some(n) => Ok(n),
            None => match (self.value, &seg) {
                (Value::List(v) | Value::Tuple(v), Seg::Int(i)) => Err(TorchIoError::IndexOutOfRange {
                    path: self.path(),
                    index: usize::try_from(*i).unwrap_or(usize::MAX),
                    len: v.len(),
                }),
                (_, Seg::Str(s)) => Err(TorchIoError::MissingKey { path: self.path(), key: format!("{s:?}") }),
                (_, Seg::Int(i)) => Err(TorchIoError::MissingKey { path: self.path(), key: i.to_string() }),
            },
        }
    }

    /// Like [`Node::get`], but a missing key or index is `Ok(None)`.
    ///
    /// # Errors
    /// [`TorchIoError::TypeMismatch`] when this is no container (or a str index into a list).
    pub fn get_opt<'k>(&self, seg: impl Into<Seg<'k>>) -> Result<Option<Node<'a>>> {
        let seg = seg.into();
        match (self.value, &seg) {
            (Value::Dict(d), Seg::Str(s)) => {
                Ok(d.entries.get(&Key::Str((*s).to_string())).map(|v| self.child(seg.clone(), v)))
            }
            (Value::Dict(d), Seg::Int(i)) => Ok(d.entries.get(&Key::Int(*i)).map(|v| self.child(seg.clone(), v))),
            (Value::List(v) | Value::Tuple(v), Seg::Int(i)) => {
                let len = v.len() as i64;
                let idx = if *i < 0 { i + len } else { *i };
                Ok((0..len).contains(&idx).then(|| self.child(seg.clone(), &v[idx as usize])))
            }
            (Value::List(_) | Value::Tuple(_), Seg::Str(_)) => Err(self.mismatch("dict")),
            _ => Err(self.mismatch("dict, list or tuple")),
        }
    }

    /// Whether this is `None`.
    pub fn is_none(&self) -> bool {
        matches!(self.value, Value::None)
    }

    /// A bool.
    ///
    /// # Errors
    /// [`TorchIoError::TypeMismatch`].
    pub fn as_bool(&self) -> Result<bool> {
        match self.value {
            Value::Bool(b) => Ok(*b),
            _ => Err(self.mismatch("bool")),
        }
    }

    /// An int within i64 (a bool is refused, unlike Python).
    ///
    /// # Errors
    /// [`TorchIoError::TypeMismatch`], [`TorchIoError::IntOutOfRange`] for a [`BigInt`].
    pub fn as_i64(&self) -> Result<i64> {
        match self.value {
            Value::Int(i) => Ok(*i),
            Value::BigInt(b) => {
                Err(TorchIoError::IntOutOfRange { path: self.path(), value: b.to_string(), target: "i64" })
            }
            _ => Err(self.mismatch("int")),
        }
    }

    /// A non-negative int as usize.
    ///
    /// # Errors
    /// As [`Node::as_i64`], and [`TorchIoError::IntOutOfRange`] for a negative value.
    pub fn as_usize(&self) -> Result<usize> {
        let i = self.as_i64()?;
        usize::try_from(i).map_err(|_| TorchIoError::IntOutOfRange {
            path: self.path(),
            value: i.to_string(),
            target: "usize",
        })
    }

    /// A float; an int is accepted too and converted as Python's `float(i)` does (torch.optim
    /// hyper-parameters such as `momentum=0` are often ints).
    ///
    /// # Errors
    /// [`TorchIoError::TypeMismatch`].
    pub fn as_f64(&self) -> Result<f64> {
        match self.value {
            Value::Float(f) => Ok(*f),
            Value::Int(i) => Ok(*i as f64),
            _ => Err(self.mismatch("float")),
        }
    }

    /// A str.
    ///
    /// # Errors
    /// [`TorchIoError::TypeMismatch`].
    pub fn as_str(&self) -> Result<&'a str> {
        match self.value {
            Value::Str(s) => Ok(s),
            _ => Err(self.mismatch("str")),
        }
    }

    /// Bytes.
    ///
    /// # Errors
    /// [`TorchIoError::TypeMismatch`].
    pub fn as_bytes(&self) -> Result<&'a [u8]> {
        match self.value {
            Value::Bytes(b) => Ok(b),
            _ => Err(self.mismatch("bytes")),
        }
    }

    /// A tensor.
    ///
    /// # Errors
    /// [`TorchIoError::TypeMismatch`].
    pub fn as_tensor(&self) -> Result<&'a Tensor> {
        match self.value {
            Value::Tensor(t) => Ok(t),
            _ => Err(self.mismatch("Tensor")),
        }
    }

    /// A dict or OrderedDict.
    ///
    /// # Errors
    /// [`TorchIoError::TypeMismatch`].
    pub fn as_dict(&self) -> Result<&'a Dict> {
        match self.value {
            Value::Dict(d) => Ok(d),
            _ => Err(self.mismatch("dict")),
        }
    }

    /// The entries of a dict, each as a node, in order.
    ///
    /// # Errors
    /// [`TorchIoError::TypeMismatch`].
    pub fn entries(&self) -> Result<Vec<(&'a Key, Node<'a>)>> {
        let d = self.as_dict()?;
        Ok(d.entries.iter().map(|(k, v)| (k, self.child(Seg::from(k), v))).collect())
    }

    /// The elements of a list or tuple, each as a node.
    ///
    /// # Errors
    /// [`TorchIoError::TypeMismatch`].
    pub fn elements(&self) -> Result<Vec<Node<'a>>> {
        match self.value {
            Value::List(v) | Value::Tuple(v) => {
                Ok(v.iter().enumerate().map(|(i, x)| self.child(Seg::from(i), x)).collect())
            }
            _ => Err(self.mismatch("list or tuple")),
        }
    }

    /// An attribute of an OrderedDict (`"_metadata"`), as a node.
    ///
    /// # Errors
    /// [`TorchIoError::TypeMismatch`] when this is no dict.
    pub fn attribute(&self, name: &str) -> Result<Option<Node<'a>>> {
        let d = self.as_dict()?;
        Ok(d.attributes.get(name).map(|v| self.child(Seg::Str(name), v)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_are_readable() {
        let segs = [PathSeg::Str("optimizer"), PathSeg::Str("state"), PathSeg::Int(3), PathSeg::Str("exp_avg")];
        assert_eq!(format_path(&segs), "optimizer.state.3.exp_avg");
        let segs = [PathSeg::Str("model"), PathSeg::Str("fc1.weight")];
        assert_eq!(format_path(&segs), "model[\"fc1.weight\"]");
        let segs = [PathSeg::Str("3")];
        assert_eq!(format_path(&segs), "[\"3\"]");
    }

    #[test]
    fn nested_entries_change_in_place() {
        let groups = Value::List(vec![
            Value::Dict(Dict::new().with("lr", Value::Float(0.1))),
            Value::Dict(Dict::new().with("lr", Value::Float(0.2))),
        ]);
        let mut v = Value::Dict(Dict::new().with("param_groups", groups).with("epoch", Value::Int(1)));
        *v.path_mut(&[Seg::from("param_groups"), Seg::from(-1), Seg::from("lr")]).unwrap() = Value::Float(0.5);
        assert_eq!(v.get("param_groups").unwrap().get(1).unwrap().get("lr").unwrap().as_f64().unwrap(), 0.5);
        v.get_mut("param_groups").unwrap().get_mut(0).unwrap().insert("weight_decay", Value::Float(0.0)).unwrap();
        assert!(v.get("param_groups").unwrap().get(0).unwrap().get("weight_decay").is_ok());
        assert!(matches!(v.get_mut("param_groups").unwrap().remove(0), Ok(Some(Value::Dict(_)))));
        assert!(matches!(v.remove("epoch"), Ok(Some(Value::Int(1)))));
        assert!(matches!(v.remove("epoch"), Ok(None)));
        let err = v.path_mut(&[Seg::from("param_groups"), Seg::from(3)]).unwrap_err();
        assert_eq!(err.to_string(), "param_groups has 1 elements, index 3 is out of range");
        let err = v.path_mut(&[Seg::from("param_groups"), Seg::from(0), Seg::from("lr"), Seg::from("x")]).unwrap_err();
        assert!(
            matches!(err, TorchIoError::TypeMismatch { ref path, found: "float", .. } if path == "param_groups.0.lr")
        );
        assert!(matches!(Value::Int(1).insert("k", Value::None), Err(TorchIoError::TypeMismatch { .. })));
    }

    #[test]
    fn big_int_bytes() {
        for v in [0i128, 1, -1, 127, 128, -128, -129, i64::MAX as i128 + 1, i64::MIN as i128 - 1, i128::MIN, i128::MAX]
        {
            let b = BigInt::from_i128(v);
            assert_eq!(b.to_i128(), Some(v), "{v}");
        }
        assert_eq!(BigInt::from_i128(128).le_bytes(), &[0x80, 0]);
        assert_eq!(BigInt::from_i128(-129).le_bytes(), &[0x7f, 0xff]);
        let mut big = vec![0u8; 17];
        big[16] = 1;
        assert_eq!(BigInt::from_le_bytes(&big).to_i128(), None);
        let mut neg = vec![0xffu8; 20];
        neg[0] = 0xfe;
        assert_eq!(BigInt::from_le_bytes(&neg).to_i128(), Some(-2));
    }
}
