//! Depth-first walk over a [`Value`] tree on an explicit stack: every pass over a tree
//! (writing, planning storages, `Debug`, [`Value::shallow_clone`], JSON) is a loop over
//! [`Walk`], so that no tree, however deep, can exhaust the thread's stack. Passes that refuse
//! deep trees check [`Walk::check_depth`] as they enter each node.
use super::error::{Result, TorchIoError};
use super::value::{format_path, Dict, Key, PathSeg, Value};
use super::MAX_DEPTH;

/// How a node hangs from its container.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Edge<'v> {
    /// The element at this index of a list or tuple.
    Index(usize),
    /// The entry at this position of a dict, under this key.
    Key(usize, &'v Key),
    /// The attribute at this position of a dict, under this name (after all entries).
    Attr(usize, &'v str),
}

/// One step of a walk. Every node is entered and left once; a container's children are
/// entered and left between the two.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Step<'v> {
    /// A node, and how it hangs from its container (`None` for the root).
    Enter(&'v Value, Option<Edge<'v>>),
    /// The node entered last among those not yet left.
    Leave(&'v Value),
}

enum Frame<'v> {
    Seq(std::iter::Enumerate<std::slice::Iter<'v, Value>>),
    Dict {
        entries: std::iter::Enumerate<indexmap::map::Iter<'v, Key, Value>>,
        attributes: std::iter::Enumerate<indexmap::map::Iter<'v, String, Value>>,
    },
}

/// A depth-first walk: dict entries, then attributes, sequences in order (the order in which
/// the writer stores them).
pub(crate) struct Walk<'v> {
    root: Option<&'v Value>,
    /// The open containers, innermost last.
    open: Vec<(&'v Value, Frame<'v>)>,
    /// The path of the node entered or left last.
    path: Vec<PathSeg<&'v str>>,
    /// A leaf entered by the last step, to be left by the next.
    leaf: Option<&'v Value>,
    /// The last step left a node that is not the root: its segment is still on `path`.
    pop: bool,
}

impl<'v> Walk<'v> {
    pub(crate) fn new(root: &'v Value) -> Self {
        Walk { root: Some(root), open: Vec::new(), path: Vec::new(), leaf: None, pop: false }
    }

    /// The path of the node the last step entered or left.
    pub(crate) fn path(&self) -> &[PathSeg<&'v str>] {
        &self.path
    }

    /// [`TorchIoError::TooDeep`] when the node the last step entered is more than
    /// [`MAX_DEPTH`] levels below the root.
    pub(crate) fn check_depth(&self) -> Result<()> {
        if self.path.len() > MAX_DEPTH {
            return Err(TorchIoError::TooDeep {
                what: "nesting depth",
                path: format_path(&self.path),
                limit: MAX_DEPTH as u64,
            });
        }
        Ok(())
    }

    fn enter(&mut self, v: &'v Value, edge: Option<Edge<'v>>) -> Step<'v> {
        if let Some(e) = edge {
            self.path.push(match e {
                Edge::Index(i) => PathSeg::Int(i64::try_from(i).unwrap_or(i64::MAX)),
                Edge::Key(_, Key::Str(s)) => PathSeg::Str(s.as_str()),
                Edge::Key(_, Key::Int(i)) => PathSeg::Int(*i),
                Edge::Attr(_, name) => PathSeg::Str(name),
            });
        }
        match v {
            Value::List(items) | Value::Tuple(items) => self.open.push((v, Frame::Seq(items.iter().enumerate()))),
            Value::Dict(d) => self.open.push((
                v,
                Frame::Dict {
                    entries: d.entry_map().iter().enumerate(),
                    attributes: d.attribute_map().iter().enumerate(),
                },
            )),
            _ => self.leaf = Some(v),
        }
        Step::Enter(v, edge)
    }

    fn leave(&mut self, v: &'v Value) -> Step<'v> {
        self.pop = !self.path.is_empty();
        Step::Leave(v)
    }
}

impl<'v> Iterator for Walk<'v> {
    type Item = Step<'v>;

    fn next(&mut self) -> Option<Step<'v>> {
        if std::mem::take(&mut self.pop) {
            self.path.pop();
        }
        if let Some(v) = self.leaf.take() {
            return Some(self.leave(v));
        }
        if let Some(root) = self.root.take() {
            return Some(self.enter(root, None));
        }
        let (container, frame) = self.open.last_mut()?;
        let container = *container;
        let child = match frame {
            Frame::Seq(items) => items.next().map(|(i, x)| (x, Edge::Index(i))),
            Frame::Dict { entries, attributes } => entries
                .next()
                .map(|(i, (k, x))| (x, Edge::Key(i, k)))
                .or_else(|| attributes.next().map(|(i, (k, x))| (x, Edge::Attr(i, k.as_str())))),
        };
        Some(match child {
            Some((x, edge)) => self.enter(x, Some(edge)),
            None => {
                self.open.pop();
                self.leave(container)
            }
        })
    }
}

impl Value {
    /// A copy of the tree; tensors are shallow copies (they share storage with the original).
    pub fn shallow_clone(&self) -> Value {
        // Copies of the open containers, innermost last, each with how it hangs from its own.
        let mut open: Vec<(Value, Option<Edge<'_>>)> = Vec::new();
        for step in Walk::new(self) {
            let (copy, edge) = match step {
                Step::Enter(v, edge) => {
                    let copy = match v {
                        Value::None => Value::None,
                        Value::Bool(b) => Value::Bool(*b),
                        Value::Int(i) => Value::Int(*i),
                        Value::BigInt(b) => Value::BigInt(b.clone()),
                        Value::Float(f) => Value::Float(*f),
                        Value::Str(s) => Value::Str(s.clone()),
                        Value::Bytes(b) => Value::Bytes(b.clone()),
                        Value::Tensor(t) => Value::Tensor(t.shallow_clone()),
                        Value::List(v) => Value::List(Vec::with_capacity(v.len())),
                        Value::Tuple(v) => Value::Tuple(Vec::with_capacity(v.len())),
                        Value::Dict(d) if d.is_ordered() => Value::Dict(Dict::new_ordered()),
                        Value::Dict(_) => Value::Dict(Dict::new()),
                    };
                    if matches!(v, Value::List(_) | Value::Tuple(_) | Value::Dict(_)) {
                        open.push((copy, edge));
                        continue;
                    }
                    (copy, edge)
                }
                Step::Leave(Value::List(_) | Value::Tuple(_) | Value::Dict(_)) => {
                    open.pop().expect("a container left was entered")
                }
                Step::Leave(_) => continue,
            };
            match (open.last_mut(), edge) {
                (None, _) => return copy,
                (Some((Value::List(items) | Value::Tuple(items), _)), _) => items.push(copy),
                (Some((Value::Dict(d), _)), Some(Edge::Key(_, k))) => {
                    d.insert(k.clone(), copy);
                }
                (Some((Value::Dict(d), _)), Some(Edge::Attr(_, name))) => {
                    d.set_attribute(name.to_string(), copy);
                }
                _ => unreachable!("a container's children hang from it by index, key or attribute"),
            }
        }
        unreachable!("a walk ends by leaving the root")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::torch_io::Dict;

    /// The steps as text: `>` enter (with the path), `<` leave.
    fn trace(v: &Value) -> Vec<String> {
        let mut w = Walk::new(v);
        let mut out = Vec::new();
        while let Some(step) = w.next() {
            out.push(match step {
                Step::Enter(v, _) => format!(">{} {}", v.type_name(), format_path(w.path())),
                Step::Leave(v) => format!("<{} {}", v.type_name(), format_path(w.path())),
            });
        }
        out
    }

    #[test]
    fn entries_then_attributes_in_order_with_paths() {
        let mut d = Dict::new_ordered().with("a", Value::List(vec![Value::Int(1), Value::Tuple(vec![])]));
        d.insert(7, Value::None);
        d.set_attribute("_metadata", Value::Dict(Dict::new()));
        assert_eq!(
            trace(&Value::Dict(d)),
            [
                ">OrderedDict <root>",
                ">list a",
                ">int a.0",
                "<int a.0",
                ">tuple a.1",
                "<tuple a.1",
                "<list a",
                ">None 7",
                "<None 7",
                ">dict _metadata",
                "<dict _metadata",
                "<OrderedDict <root>",
            ]
        );
        assert_eq!(trace(&Value::Int(3)), [">int <root>", "<int <root>"]);
    }

    #[test]
    fn depth_is_checked_where_asked_and_walks_any_depth() {
        let mut v = Value::None;
        for _ in 0..MAX_DEPTH {
            v = Value::List(vec![v]);
        }
        let mut w = Walk::new(&v);
        while let Some(step) = w.next() {
            if let Step::Enter(..) = step {
                w.check_depth().unwrap();
            }
        }
        let deeper = Value::Tuple(vec![v]);
        let mut w = Walk::new(&deeper);
        let mut deepest = 0;
        while let Some(step) = w.next() {
            if let Step::Enter(..) = step {
                deepest = deepest.max(w.path().len());
                if let Err(e) = w.check_depth() {
                    assert!(
                        matches!(&e, TorchIoError::TooDeep { what: "nesting depth", limit, .. } if *limit == MAX_DEPTH as u64),
                        "{e:?}"
                    );
                    assert_eq!(w.path().len(), MAX_DEPTH + 1);
                    return;
                }
            }
        }
        panic!("no TooDeep at depth {deepest}");
    }
}
