//! From the unpickler's object graph to a [`Value`] tree.
//!
//! The tree owns its values, so an object the pickle references twice (through the memo)
//! becomes two copies. Every node is charged its size (the `Value`, a dict entry, the bytes of
//! a str, bytes or big int, [`TENSOR_COST`] for a tensor view) against a byte budget of
//! [`TREE_BUDGET_PER_BYTE`] bytes per pickle byte plus [`BUDGET_FLOOR`]: a pickle that
//! references a big string or container thousands of times is refused, not expanded.
//!
//! The conversion is a loop over an explicit stack of the containers being built, so the
//! thread's stack does not grow with the depth. A node more than [`super::Limits::depth`] levels below
//! the root, or a container met again inside itself (a reference cycle: the memo hands out a
//! container before it is complete), is [`TorchIoError::TooDeep`], raised when the node is
//! reached, before anything is built under it.
use std::rc::Rc;

use super::error::{Result, TorchIoError};
use super::pickle_read::{Global, HeapObj, Obj, Pickle, BUDGET_FLOOR};
use super::storage::Materializer;
use super::value::{format_path, BigInt, Dict, Key, PathSeg, Value};

/// Bytes of tree per byte of pickle.
pub(crate) const TREE_BUDGET_PER_BYTE: u64 = 64;
/// What a tensor node is charged: the `Value` and libtorch's tensor object (its storage is
/// shared, and counted once, by the storage reader).
pub(crate) const TENSOR_COST: u64 = 512;

struct Converter<'p, 'm, 's> {
    pickle: &'p Pickle,
    tensors: &'m mut Materializer<'s>,
    path: Vec<PathSeg<Rc<str>>>,
    bytes: u64,
    budget: u64,
    /// The deepest nesting accepted ([`super::Limits::depth`]).
    depth: usize,
}

/// Converts the pickle's root into a tree, building tensors on the way. The tree's size is
/// bounded by `pickle_len` (shared references are expanded, so a small pickle could otherwise
/// describe an exponentially large tree).
pub(crate) fn to_value(
    pickle: &Pickle,
    tensors: &mut Materializer<'_>,
    pickle_len: usize,
    depth: usize,
) -> Result<Value> {
    let budget = (pickle_len as u64).saturating_mul(TREE_BUDGET_PER_BYTE).saturating_add(BUDGET_FLOOR);
    let mut c = Converter { pickle, tensors, path: Vec::new(), bytes: 0, budget, depth };
    c.run()
}

fn obj_type(pickle: &Pickle, o: &Obj) -> &'static str {
    match o {
        Obj::None => "None",
        Obj::Bool(_) => "bool",
        Obj::Int(_) | Obj::BigInt(_) => "int",
        Obj::Float(_) => "float",
        Obj::Str(_) => "str",
        Obj::Bytes(_) => "bytes",
        Obj::Ref(i) => match pickle.heap.get(*i) {
            HeapObj::List(_) => "list",
            HeapObj::Tuple(_) => "tuple",
            HeapObj::Dict { .. } => "dict",
            HeapObj::Global(_) => "class or function",
            HeapObj::Storage(_) => "storage",
            HeapObj::Tensor(_) => "Tensor",
        },
    }
}

/// A container being built: its heap index, its children not yet converted, and the copy so
/// far.
struct Open<'p> {
    heap: usize,
    kind: OpenKind<'p>,
}

enum OpenKind<'p> {
    Seq {
        tuple: bool,
        items: std::iter::Enumerate<std::slice::Iter<'p, Obj>>,
        out: Vec<Value>,
    },
    Dict {
        items: std::slice::Iter<'p, (Obj, Obj)>,
        attrs: std::slice::Iter<'p, (Obj, Obj)>,
        out: Dict,
        /// Where the child being converted goes.
        slot: Option<Slot>,
    },
}

enum Slot {
    Entry(Key),
    Attribute(String),
}

/// A node started: a finished value, or a container whose children come next.
enum Started<'p> {
    Done(Value),
    Open(Open<'p>),
}

impl<'p> Converter<'p, '_, '_> {
    /// Charges `bytes` of tree against the budget.
    fn charge(&mut self, bytes: u64) -> Result<()> {
        self.bytes = self.bytes.saturating_add(bytes);
        if self.bytes > self.budget {
            return Err(TorchIoError::TooLarge {
                what: format!("the tree read so far (at {}), shared references expanded,", format_path(&self.path)),
                limit: self.budget,
            });
        }
        Ok(())
    }

    /// The root, depth first. `building[i]`: heap object `i` is an open container, so a
    /// reference to it from inside itself is a cycle.
    fn run(&mut self) -> Result<Value> {
        let pickle = self.pickle;
        let mut building = vec![false; pickle.heap.len()];
        let mut open: Vec<Open<'p>> = Vec::new();
        let mut next = self.start(&pickle.root, &building)?;
        loop {
            let done = match next {
                Started::Open(o) => {
                    building[o.heap] = true;
                    open.push(o);
                    None
                }
                Started::Done(v) => Some(v),
            };
            // Hand finished values to their containers, closing those that are complete,
            // until one has a child left to convert.
            let mut done = done;
            loop {
                let Some(top) = open.last_mut() else {
                    return Ok(done.expect("the root is finished when no container is open"));
                };
                if let Some(v) = done.take() {
                    self.path.pop();
                    top.accept(v);
                }
                match self.next_child(top)? {
                    Some(child) => {
                        next = self.start(child, &building)?;
                        break;
                    }
                    None => {
                        let o = open.pop().expect("checked above");
                        building[o.heap] = false;
                        done = Some(o.finish());
                    }
                }
            }
        }
    }

    /// Charges a node and checks its depth; a leaf is converted whole, a container opened.
    fn start(&mut self, o: &'p Obj, building: &[bool]) -> Result<Started<'p>> {
        let pickle = self.pickle;
        let payload = match o {
            Obj::Str(s) => s.len(),
            Obj::Bytes(b) | Obj::BigInt(b) => b.len(),
            Obj::Ref(i) => match pickle.heap.get(*i) {
                HeapObj::Tensor(_) => TENSOR_COST as usize,
                _ => 0,
            },
            _ => 0,
        };
        self.charge(std::mem::size_of::<Value>() as u64 + payload as u64)?;
        if self.path.len() > self.depth {
            return Err(self.too_deep("nesting depth"));
        }
        Ok(Started::Done(match o {
            Obj::None => Value::None,
            Obj::Bool(b) => Value::Bool(*b),
            Obj::Int(i) => Value::Int(*i),
            Obj::BigInt(b) => Value::BigInt(BigInt::from_le_bytes(b)),
            Obj::Float(f) => Value::Float(*f),
            Obj::Str(s) => Value::Str(s.to_string()),
            Obj::Bytes(b) => Value::Bytes(b.to_vec()),
            Obj::Ref(i) => {
                let obj = pickle.heap.get(*i);
                if building[*i] && matches!(obj, HeapObj::List(_) | HeapObj::Tuple(_) | HeapObj::Dict { .. }) {
                    return Err(self.too_deep("nesting depth (a container that contains itself)"));
                }
                let kind = match obj {
                    HeapObj::List(items) | HeapObj::Tuple(items) => OpenKind::Seq {
                        tuple: matches!(obj, HeapObj::Tuple(_)),
                        items: items.iter().enumerate(),
                        out: Vec::with_capacity(items.len()),
                    },
                    HeapObj::Dict { ordered, items, attrs } => OpenKind::Dict {
                        items: items.iter(),
                        attrs: attrs.iter(),
                        out: if *ordered { Dict::new_ordered() } else { Dict::new() },
                        slot: None,
                    },
                    other => return Ok(Started::Done(self.leaf(other)?)),
                };
                return Ok(Started::Open(Open { heap: *i, kind }));
            }
        }))
    }

    /// The next child of `o` to convert, its path segment pushed; `None` when all are done.
    fn next_child(&mut self, o: &mut Open<'p>) -> Result<Option<&'p Obj>> {
        match &mut o.kind {
            OpenKind::Seq { items, .. } => Ok(items.next().map(|(i, x)| {
                self.path.push(PathSeg::Int(i as i64));
                x
            })),
            OpenKind::Dict { items, attrs, slot, .. } => {
                if let Some((k, v)) = items.next() {
                    let entry = std::mem::size_of::<(Key, Value)>() + std::mem::size_of::<usize>();
                    let key_len = if let Obj::Str(s) = k { s.len() } else { 0 };
                    self.charge((entry + key_len) as u64)?;
                    let (key, seg) = match k {
                        Obj::Str(s) => (Key::Str(s.to_string()), PathSeg::Str(s.clone())),
                        Obj::Int(i) => (Key::Int(*i), PathSeg::Int(*i)),
                        other => {
                            return Err(TorchIoError::UnsupportedKey {
                                path: format_path(&self.path),
                                found: obj_type(self.pickle, other),
                            })
                        }
                    };
                    self.path.push(seg);
                    *slot = Some(Slot::Entry(key));
                    return Ok(Some(v));
                }
                for (k, v) in attrs.by_ref() {
                    let Obj::Str(name) = k else { continue };
                    let entry = std::mem::size_of::<(String, Value)>() + std::mem::size_of::<usize>();
                    self.charge((entry + name.len()) as u64)?;
                    self.path.push(PathSeg::Str(name.clone()));
                    *slot = Some(Slot::Attribute(name.to_string()));
                    return Ok(Some(v));
                }
                Ok(None)
            }
        }
    }

    #[cold]
    fn too_deep(&self, what: &'static str) -> TorchIoError {
        TorchIoError::TooDeep { what, path: format_path(&self.path), limit: self.depth as u64 }
    }

    /// A tensor, or an error for the heap objects the tree has no place for.
    fn leaf(&mut self, o: &HeapObj) -> Result<Value> {
        match o {
            HeapObj::Tensor(spec) => Ok(Value::Tensor(self.tensors.tensor(spec)?)),
            HeapObj::Storage(_) => Err(TorchIoError::UnsupportedValue {
                path: format_path(&self.path),
                found: "bare storage (save tensors, not storages)".into(),
            }),
            HeapObj::Global(g) => {
                Err(TorchIoError::UnsupportedValue { path: format_path(&self.path), found: Global::describe(*g) })
            }
            HeapObj::List(_) | HeapObj::Tuple(_) | HeapObj::Dict { .. } => {
                Err(TorchIoError::UnsupportedValue { path: format_path(&self.path), found: "container".into() })
            }
        }
    }
}

impl Open<'_> {
    /// Stores the child converted last.
    fn accept(&mut self, v: Value) {
        match &mut self.kind {
            OpenKind::Seq { out, .. } => out.push(v),
            OpenKind::Dict { out, slot, .. } => match slot.take() {
                Some(Slot::Entry(k)) => {
                    out.insert(k, v);
                }
                Some(Slot::Attribute(name)) => {
                    out.set_attribute(name, v);
                }
                None => unreachable!("a dict's child is converted after its slot is set"),
            },
        }
    }

    fn finish(self) -> Value {
        match self.kind {
            OpenKind::Seq { tuple: false, out, .. } => Value::List(out),
            OpenKind::Seq { tuple: true, out, .. } => Value::Tuple(out),
            OpenKind::Dict { out, .. } => Value::Dict(out),
        }
    }
}
