//! The pickle writer: protocol 2, untagged (no TorchScript type tags), using only opcodes and
//! globals that `torch.load(weights_only=True)` accepts. One pass over a [`Walk`] of the tree.
use std::collections::HashMap;

use super::error::{Result, TorchIoError};
use super::storage::{storage_type_name, StorageOut, TensorOut};
use super::value::{format_path, Key, PathSeg, Value};
use super::walk::{Edge, Step, Walk};

/// Items per SETITEMS / APPENDS batch (Python's pickler uses 1000 too).
const BATCH: usize = 1000;

pub(crate) struct Writer<'a> {
    out: Vec<u8>,
    memo: HashMap<(&'static str, &'static str), u32>,
    next_memo: u32,
    tensors: std::slice::Iter<'a, TensorOut>,
    storages: &'a [StorageOut],
}

/// Pickles `value`; its tensors must be `tensors` in tree order (from `storage::plan`).
pub(crate) fn write(value: &Value, tensors: &[TensorOut], storages: &[StorageOut]) -> Result<Vec<u8>> {
    let mut w = Writer { out: vec![0x80, 2], memo: HashMap::new(), next_memo: 0, tensors: tensors.iter(), storages };
    // The open containers, innermost last.
    let mut open: Vec<&Value> = Vec::new();
    let mut walk = Walk::new(value);
    while let Some(step) = walk.next() {
        match step {
            Step::Enter(v, edge) => {
                if let (Some(edge), Some(&parent)) = (edge, open.last()) {
                    w.before_child(parent, edge, walk.path())?;
                }
                walk.check_depth()?;
                w.enter(v, walk.path())?;
                if matches!(v, Value::List(_) | Value::Tuple(_) | Value::Dict(_)) {
                    open.push(v);
                }
            }
            Step::Leave(v) => {
                if matches!(v, Value::List(_) | Value::Tuple(_) | Value::Dict(_)) {
                    w.leave(v);
                    open.pop();
                }
            }
        }
    }
    w.out.push(b'.');
    Ok(w.out)
}

impl Writer<'_> {
    fn global(&mut self, module: &'static str, name: &'static str) {
        if let Some(&i) = self.memo.get(&(module, name)) {
            if i < 256 {
                self.out.extend([b'h', i as u8]);
            } else {
                self.out.push(b'j');
                self.out.extend(i.to_le_bytes());
            }
            return;
        }
        self.out.push(b'c');
        self.out.extend(module.as_bytes());
        self.out.push(b'\n');
        self.out.extend(name.as_bytes());
        self.out.push(b'\n');
        let i = self.next_memo;
        self.next_memo += 1;
        if i < 256 {
            self.out.extend([b'q', i as u8]);
        } else {
            self.out.push(b'r');
            self.out.extend(i.to_le_bytes());
        }
        self.memo.insert((module, name), i);
    }

    fn int(&mut self, v: i64) {
        if (0..256).contains(&v) {
            self.out.extend([b'K', v as u8]);
        } else if (0..65536).contains(&v) {
            self.out.push(b'M');
            self.out.extend((v as u16).to_le_bytes());
        } else if i32::try_from(v).is_ok() {
            self.out.push(b'J');
            self.out.extend((v as i32).to_le_bytes());
        } else {
            self.long(super::value::BigInt::from_i128(v.into()).le_bytes());
        }
    }

    fn long(&mut self, bytes: &[u8]) {
        if bytes.len() < 256 {
            self.out.extend([0x8a, bytes.len() as u8]);
        } else {
            self.out.push(0x8b);
            self.out.extend((bytes.len() as u32).to_le_bytes());
        }
        self.out.extend(bytes);
    }

    fn str(&mut self, s: &str) {
        self.out.push(b'X');
        self.out.extend((s.len() as u32).to_le_bytes());
        self.out.extend(s.as_bytes());
    }

    fn check_len(&self, n: usize, what: &str, path: &[PathSeg<&str>]) -> Result<()> {
        if u32::try_from(n).is_err() {
            return Err(TorchIoError::CannotSave {
                path: format_path(path),
                message: format!("{what} of {n} bytes is longer than protocol 2 can store"),
            });
        }
        Ok(())
    }

    fn key(&mut self, k: &Key) {
        match k {
            Key::Str(s) => self.str(s),
            Key::Int(i) => self.int(*i),
        }
    }

    /// What goes between a container's children: batch marks (SETITEMS and APPENDS take at
    /// most [`BATCH`] items), a dict entry's key, the BUILD that carries an OrderedDict's
    /// attributes. `path` is the child's.
    fn before_child(&mut self, parent: &Value, edge: Edge<'_>, path: &[PathSeg<&str>]) -> Result<()> {
        match (parent, edge) {
            (Value::List(_), Edge::Index(i)) if i > 0 && i % BATCH == 0 => self.out.extend([b'e', b'(']),
            (Value::Dict(_), Edge::Key(i, k)) => {
                if i > 0 && i % BATCH == 0 {
                    self.out.extend([b'u', b'(']);
                }
                self.key(k);
            }
            (Value::Dict(d), Edge::Attr(i, name)) => {
                if i == 0 {
                    if !d.is_empty() {
                        self.out.push(b'u');
                    }
                    if !d.is_ordered() {
                        return Err(TorchIoError::CannotSave {
                            path: format_path(&path[..path.len() - 1]),
                            message: "a plain dict cannot carry attributes (make it ordered)".into(),
                        });
                    }
                    self.out.extend([b'}', b'(']);
                }
                self.str(name);
            }
            _ => {}
        }
        Ok(())
    }

    /// A leaf whole, or the opening of a container; `path` is the node's.
    fn enter(&mut self, v: &Value, path: &[PathSeg<&str>]) -> Result<()> {
        match v {
            Value::None => self.out.push(b'N'),
            Value::Bool(b) => self.out.push(if *b { 0x88 } else { 0x89 }),
            Value::Int(i) => self.int(*i),
            Value::BigInt(b) => {
                let bytes = b.le_bytes();
                if bytes.is_empty() {
                    self.int(0);
                } else {
                    self.check_len(bytes.len(), "an int", path)?;
                    self.long(bytes);
                }
            }
            Value::Float(f) => {
                self.out.push(b'G');
                self.out.extend(f.to_bits().to_be_bytes());
            }
            Value::Str(s) => {
                self.check_len(s.len(), "a str", path)?;
                self.str(s);
            }
            Value::Bytes(b) => {
                // Protocol 2 has no bytes opcode Python 3 reads back as bytes:
                // _codecs.encode(<latin-1 str>, "latin1"), as Python's own pickler writes.
                self.global("_codecs", "encode");
                let s: String = b.iter().map(|&c| char::from(c)).collect();
                self.check_len(s.len(), "a bytes", path)?;
                self.str(&s);
                self.str("latin1");
                self.out.extend([0x86, b'R']);
            }
            Value::List(items) => {
                self.out.push(b']');
                if !items.is_empty() {
                    self.out.push(b'(');
                }
            }
            Value::Tuple(items) => match items.len() {
                0 => self.out.push(b')'),
                1..=3 => {}
                _ => self.out.push(b'('),
            },
            Value::Dict(d) => {
                if d.is_ordered() {
                    self.global("collections", "OrderedDict");
                    self.out.extend([b')', b'R']);
                } else {
                    self.out.push(b'}');
                }
                if !d.is_empty() {
                    self.out.push(b'(');
                }
            }
            Value::Tensor(_) => {
                let t = self.tensors.next().expect("plan walked the same tensors in the same order");
                let s = &self.storages[t.storage];
                let type_name = storage_type_name(s.kind).expect("plan checked the dtype");
                self.global("torch._utils", "_rebuild_tensor_v2");
                self.out.push(b'(');
                // Persistent id: ('storage', torch.<X>Storage, key, location, numel).
                self.out.push(b'(');
                self.str("storage");
                self.global("torch", type_name);
                self.str(&s.key);
                self.str(&s.location);
                self.int(s.numel as i64);
                self.out.extend([b't', b'Q']);
                self.int(t.storage_offset);
                self.int_tuple(&t.size);
                self.int_tuple(&t.stride);
                self.out.push(if t.requires_grad { 0x88 } else { 0x89 });
                self.global("collections", "OrderedDict");
                self.out.extend([b')', b'R']);
                self.out.extend([b't', b'R']);
            }
        }
        Ok(())
    }

    /// The closing of a container, its children written.
    fn leave(&mut self, v: &Value) {
        match v {
            Value::List(items) if !items.is_empty() => self.out.push(b'e'),
            Value::Tuple(items) if !items.is_empty() => self.out.push(match items.len() {
                1 => 0x85,
                2 => 0x86,
                3 => 0x87,
                _ => b't',
            }),
            Value::Dict(d) => {
                if d.attributes().next().is_some() {
                    self.out.extend([b'u', b'b']);
                } else if !d.is_empty() {
                    self.out.push(b'u');
                }
            }
            _ => {}
        }
    }

    fn int_tuple(&mut self, v: &[i64]) {
        self.out.push(b'(');
        for &x in v {
            self.int(x);
        }
        self.out.push(b't');
    }
}
