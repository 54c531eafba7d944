//! From the unpickler's object graph to a [`Value`] tree.
use super::error::{Result, TorchIoError};
use super::pickle_read::{Global, HeapObj, Obj, Pickle};
use super::storage::Materializer;
use super::value::{format_path, BigInt, Dict, Key, PathSeg, Value};
use super::MAX_DEPTH;

struct Converter<'p, 'm, 's> {
    pickle: &'p Pickle,
    tensors: &'m mut Materializer<'s>,
    path: Vec<PathSeg<String>>,
    nodes: u64,
    budget: u64,
}

/// Converts the pickle's root into a tree, building tensors on the way. `budget` bounds the
/// node count (shared references are expanded, so a small pickle could otherwise describe an
/// exponentially large tree).
pub(crate) fn to_value(pickle: &Pickle, tensors: &mut Materializer<'_>, budget: u64) -> Result<Value> {
    let mut c = Converter { pickle, tensors, path: Vec::new(), nodes: 0, budget };
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
    fn convert(&mut self, o: &Obj) -> Result<Value> {
        self.nodes += 1;
        if self.nodes > self.budget {
            return Err(TorchIoError::TooDeep {
                what: "node count",
                path: format_path(&self.path),
                limit: self.budget,
            });
        }
        if self.path.len() > MAX_DEPTH {
            return Err(TorchIoError::TooDeep {
                what: "nesting depth (or a self-referencing structure)",
                path: format_path(&self.path),
                limit: MAX_DEPTH as u64,
            });
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
                    HeapObj::Dict { ordered, items, attrs } => {
                        let mut d = if *ordered { Dict::new_ordered() } else { Dict::new() };
                        for (k, v) in items {
                            let key = match k {
                                Obj::Str(s) => Key::Str(s.to_string()),
                                Obj::Int(i) => Key::Int(*i),
                                other => {
                                    return Err(TorchIoError::UnsupportedKey {
                                        path: format_path(&self.path),
                                        found: obj_type(pickle, other),
                                    })
                                }
                            };
                            self.path.push(match &key {
                                Key::Str(s) => PathSeg::Str(s.clone()),
                                Key::Int(i) => PathSeg::Int(*i),
                            });
                            let v = self.convert(v)?;
                            self.path.pop();
                            d.insert(key, v);
                        }
                        for (k, v) in attrs {
                            let Obj::Str(name) = k else { continue };
                            self.path.push(PathSeg::Str(name.to_string()));
                            let v = self.convert(v)?;
                            self.path.pop();
                            d.set_attribute(name.to_string(), v);
                        }
                        Value::Dict(d)
                    }
                    HeapObj::Tensor(spec) => Value::Tensor(self.tensors.tensor(spec)?),
                    HeapObj::Storage(_) => {
                        return Err(TorchIoError::UnsupportedValue {
                            path: format_path(&self.path),
                            found: "bare storage (save tensors, not storages)".into(),
                        })
                    }
                    HeapObj::Global(g) => {
                        return Err(TorchIoError::UnsupportedValue {
                            path: format_path(&self.path),
                            found: Global::describe(*g),
                        })
                    }
                }
            }
        })
    }

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
