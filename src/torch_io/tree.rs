//! From the unpickler's object graph to a [`Value`] tree.
//!
//! The tree owns its values, so an object the pickle references twice (through the memo)
//! becomes two copies. Every node is charged its size (the `Value`, a dict entry, the bytes of
//! a str, bytes or big int, [`TENSOR_COST`] for a tensor view) against a byte budget of
//! [`TREE_BUDGET_PER_BYTE`] bytes per pickle byte plus [`BUDGET_FLOOR`]: a pickle that
//! references a big string or container thousands of times is refused, not expanded.
use std::rc::Rc;

use super::error::{Result, TorchIoError};
use super::pickle_read::{Global, HeapObj, Obj, Pickle, BUDGET_FLOOR};
use super::storage::Materializer;
use super::value::{format_path, BigInt, Dict, Key, PathSeg, Value};
use super::MAX_DEPTH;

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
}

/// Converts the pickle's root into a tree, building tensors on the way. The tree's size is
/// bounded by `pickle_len` (shared references are expanded, so a small pickle could otherwise
/// describe an exponentially large tree).
pub(crate) fn to_value(pickle: &Pickle, tensors: &mut Materializer<'_>, pickle_len: usize) -> Result<Value> {
    let budget = (pickle_len as u64).saturating_mul(TREE_BUDGET_PER_BYTE).saturating_add(BUDGET_FLOOR);
    let mut c = Converter { pickle, tensors, path: Vec::new(), bytes: 0, budget };
    c.convert(&pickle.root)
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

impl Converter<'_, '_, '_> {
    /// Charges `bytes` of tree against the budget.
    #[inline(never)]
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

    /// One node. The recursion (node, container, node, ...) is at most [`MAX_DEPTH`] deep;
    /// each container kind has its own small frame, so that the depth limit, not the thread's
    /// stack, is what a deep file meets.
    fn convert(&mut self, o: &Obj) -> Result<Value> {
        let payload = match o {
            Obj::Str(s) => s.len(),
            Obj::Bytes(b) | Obj::BigInt(b) => b.len(),
            Obj::Ref(i) => match self.pickle.heap.get(*i) {
                HeapObj::Tensor(_) => TENSOR_COST as usize,
                _ => 0,
            },
            _ => 0,
        };
        self.charge(std::mem::size_of::<Value>() as u64 + payload as u64)?;
        if self.path.len() > MAX_DEPTH {
            return Err(self.too_deep());
        }
        Ok(match o {
            Obj::None => Value::None,
            Obj::Bool(b) => Value::Bool(*b),
            Obj::Int(i) => Value::Int(*i),
            Obj::BigInt(b) => Value::BigInt(BigInt::from_le_bytes(b)),
            Obj::Float(f) => Value::Float(*f),
            Obj::Str(s) => Value::Str(s.to_string()),
            Obj::Bytes(b) => Value::Bytes(b.to_vec()),
            Obj::Ref(i) => {
                let pickle = self.pickle;
                match pickle.heap.get(*i) {
                    HeapObj::List(items) => Value::List(self.seq(items)?),
                    HeapObj::Tuple(items) => Value::Tuple(self.seq(items)?),
                    HeapObj::Dict { ordered, items, attrs } => Value::Dict(self.dict(*ordered, items, attrs)?),
                    other => self.leaf(other)?,
                }
            }
        })
    }

    #[cold]
    #[inline(never)]
    fn too_deep(&self) -> TorchIoError {
        TorchIoError::TooDeep {
            what: "nesting depth (or a self-referencing structure)",
            path: format_path(&self.path),
            limit: MAX_DEPTH as u64,
        }
    }

    /// A tensor, or an error for the heap objects the tree has no place for.
    #[inline(never)]
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

    #[inline(never)]
    fn dict(&mut self, ordered: bool, items: &[(Obj, Obj)], attrs: &[(Obj, Obj)]) -> Result<Dict> {
        let mut d = if ordered { Dict::new_ordered() } else { Dict::new() };
        for (k, v) in items {
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
            let v = self.convert(v)?;
            self.path.pop();
            d.insert(key, v);
        }
        for (k, v) in attrs {
            let Obj::Str(name) = k else { continue };
            let entry = std::mem::size_of::<(String, Value)>() + std::mem::size_of::<usize>();
            self.charge((entry + name.len()) as u64)?;
            self.path.push(PathSeg::Str(name.clone()));
            let v = self.convert(v)?;
            self.path.pop();
            d.set_attribute(name.to_string(), v);
        }
        Ok(d)
    }

    #[inline(never)]
    fn seq(&mut self, items: &[Obj]) -> Result<Vec<Value>> {
        let mut out = Vec::with_capacity(items.len());
        for (i, x) in items.iter().enumerate() {
            self.path.push(PathSeg::Int(i as i64));
            out.push(self.convert(x)?);
            self.path.pop();
        }
        Ok(out)
    }
}
