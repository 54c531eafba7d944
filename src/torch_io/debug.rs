//! `Debug` for [`Value`] and [`Dict`], on a [`Walk`] rather than by recursion, so that a tree
//! of any depth can be printed. The output is what `#[derive(Debug)]` would print, `{:#?}`
//! included (the nesting indented four spaces a level, as std's builders do).
use std::fmt::{self, Write};

use super::value::{Dict, Value};
use super::walk::{Edge, Step, Walk};

/// Writes to the formatter, indenting every line `level` times when pretty (std's
/// `PadAdapter`, flattened: one level per open builder).
struct Printer<'a, 'b> {
    f: &'a mut fmt::Formatter<'b>,
    pretty: bool,
    level: usize,
    on_newline: bool,
}

impl Write for Printer<'_, '_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        for line in s.split_inclusive('\n') {
            if self.on_newline {
                for _ in 0..self.level {
                    self.f.write_str("    ")?;
                }
            }
            self.on_newline = line.ends_with('\n');
            self.f.write_str(line)?;
        }
        Ok(())
    }
}

impl Printer<'_, '_> {
    fn new<'a, 'b>(f: &'a mut fmt::Formatter<'b>) -> Printer<'a, 'b> {
        let pretty = f.alternate();
        Printer { f, pretty, level: 0, on_newline: false }
    }

    /// A value that is no tree: through the formatter itself (its flags apply, as derive's
    /// do) or, when pretty, indented.
    fn leaf(&mut self, x: &dyn fmt::Debug) -> fmt::Result {
        if self.pretty {
            write!(self, "{x:#?}")
        } else {
            x.fmt(self.f)
        }
    }

    /// `Name(` of a one-field tuple variant.
    fn open_variant(&mut self, name: &str) -> fmt::Result {
        self.write_str(name)?;
        if self.pretty {
            self.write_str("(\n")?;
            self.level += 1;
            Ok(())
        } else {
            self.write_str("(")
        }
    }

    fn close_variant(&mut self) -> fmt::Result {
        if self.pretty {
            self.write_str(",\n")?;
            self.level -= 1;
        }
        self.write_str(")")
    }

    /// Before the element or map key at `position` of an open list or map.
    fn open_item(&mut self, position: usize) -> fmt::Result {
        if self.pretty {
            if position == 0 {
                self.write_str("\n")?;
                self.level += 1;
            }
            Ok(())
        } else if position > 0 {
            self.write_str(", ")
        } else {
            Ok(())
        }
    }

    /// After an element or map value.
    fn close_item(&mut self) -> fmt::Result {
        if self.pretty {
            self.write_str(",\n")?;
        }
        Ok(())
    }

    /// `]` or `}` of a list or map of `len` items.
    fn close_items(&mut self, len: usize, bracket: &str) -> fmt::Result {
        if self.pretty && len > 0 {
            self.level -= 1;
        }
        self.write_str(bracket)
    }

    /// `Dict { ordered: .., entries: {`.
    fn open_dict(&mut self, d: &Dict) -> fmt::Result {
        if self.pretty {
            self.write_str("Dict {\n")?;
            self.level += 1;
            self.write_str("ordered: ")?;
            self.leaf(&d.is_ordered())?;
            self.write_str(",\nentries: {")
        } else {
            self.write_str("Dict { ordered: ")?;
            self.leaf(&d.is_ordered())?;
            self.write_str(", entries: {")
        }
    }

    /// Closes the entries and opens the attributes: `}, attributes: {`.
    fn dict_attributes(&mut self, d: &Dict) -> fmt::Result {
        self.close_items(d.len(), "}")?;
        self.write_str(if self.pretty { ",\nattributes: {" } else { ", attributes: {" })
    }

    /// Closes the attributes (opening them first when there are none) and the struct.
    fn close_dict(&mut self, d: &Dict) -> fmt::Result {
        let attributes = d.attributes().count();
        if attributes == 0 {
            self.dict_attributes(d)?;
        }
        self.close_items(attributes, "}")?;
        if self.pretty {
            self.write_str(",\n")?;
            self.level -= 1;
            self.write_str("}")
        } else {
            self.write_str(" }")
        }
    }

    /// A map key at `position`, and `: `.
    fn key(&mut self, position: usize, key: &dyn fmt::Debug) -> fmt::Result {
        self.open_item(position)?;
        self.leaf(key)?;
        self.write_str(": ")
    }

    /// A whole tree, as derive would print it.
    fn value(&mut self, root: &Value) -> fmt::Result {
        // The open dicts, to close their entries when their attributes begin.
        let mut dicts: Vec<&Dict> = Vec::new();
        let mut walk = Walk::new(root);
        while let Some(step) = walk.next() {
            match step {
                Step::Enter(v, edge) => {
                    match edge {
                        None => {}
                        Some(Edge::Index(i)) => self.open_item(i)?,
                        Some(Edge::Key(i, k)) => self.key(i, k)?,
                        Some(Edge::Attr(i, name)) => {
                            let d = *dicts.last().expect("an attribute is inside a dict");
                            if i == 0 {
                                self.dict_attributes(d)?;
                            }
                            self.key(i, &name)?;
                        }
                    }
                    match v {
                        Value::None => self.write_str("None")?,
                        Value::Bool(x) => self.variant("Bool", x)?,
                        Value::Int(x) => self.variant("Int", x)?,
                        Value::BigInt(x) => self.variant("BigInt", x)?,
                        Value::Float(x) => self.variant("Float", x)?,
                        Value::Str(x) => self.variant("Str", x)?,
                        Value::Bytes(x) => self.variant("Bytes", x)?,
                        Value::Tensor(x) => self.variant("Tensor", x)?,
                        Value::List(_) => {
                            self.open_variant("List")?;
                            self.write_str("[")?;
                        }
                        Value::Tuple(_) => {
                            self.open_variant("Tuple")?;
                            self.write_str("[")?;
                        }
                        Value::Dict(d) => {
                            self.open_variant("Dict")?;
                            self.open_dict(d)?;
                            dicts.push(d);
                        }
                    }
                    let leaf = !matches!(v, Value::List(_) | Value::Tuple(_) | Value::Dict(_));
                    if leaf && edge.is_some() {
                        self.close_item()?;
                    }
                }
                Step::Leave(v) => {
                    match v {
                        Value::List(items) | Value::Tuple(items) => {
                            self.close_items(items.len(), "]")?;
                            self.close_variant()?;
                        }
                        Value::Dict(d) => {
                            self.close_dict(d)?;
                            self.close_variant()?;
                            dicts.pop();
                        }
                        _ => continue,
                    }
                    if !walk.path().is_empty() {
                        self.close_item()?;
                    }
                }
            }
        }
        Ok(())
    }

    fn variant(&mut self, name: &str, x: &dyn fmt::Debug) -> fmt::Result {
        self.open_variant(name)?;
        self.leaf(x)?;
        self.close_variant()
    }
}

fn value(v: &Value, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    Printer::new(f).value(v)
}

fn dict(d: &Dict, f: &mut fmt::Formatter<'_>) -> fmt::Result {
    let mut p = Printer::new(f);
    p.open_dict(d)?;
    for (i, (k, v)) in d.iter().enumerate() {
        p.key(i, k)?;
        p.value(v)?;
        p.close_item()?;
    }
    for (i, (name, v)) in d.attributes().enumerate() {
        if i == 0 {
            p.dict_attributes(d)?;
        }
        p.key(i, &name)?;
        p.value(v)?;
        p.close_item()?;
    }
    p.close_dict(d)
}

impl fmt::Debug for Value {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        value(self, f)
    }
}

impl fmt::Debug for Dict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        dict(self, f)
    }
}

#[cfg(test)]
mod tests {
    use tch::{Device, Kind, Tensor};

    use super::super::value::{BigInt, Key};
    use super::*;

    /// The shape of `Value` and `Dict` with derived `Debug`: what the hand-written one must
    /// print.
    #[derive(Debug)]
    #[allow(dead_code)]
    enum Mirror {
        None,
        Bool(bool),
        Int(i64),
        BigInt(BigInt),
        Float(f64),
        Str(String),
        Bytes(Vec<u8>),
        List(Vec<Mirror>),
        Tuple(Vec<Mirror>),
        Dict(MirrorDict),
        Tensor(Tensor),
    }

    #[derive(Debug)]
    #[allow(dead_code)]
    struct Dict {
        ordered: bool,
        entries: indexmap::IndexMap<Key, Mirror>,
        attributes: indexmap::IndexMap<String, Mirror>,
    }
    type MirrorDict = Dict;

    fn mirror(v: &Value) -> Mirror {
        match v {
            Value::None => Mirror::None,
            Value::Bool(x) => Mirror::Bool(*x),
            Value::Int(x) => Mirror::Int(*x),
            Value::BigInt(x) => Mirror::BigInt(x.clone()),
            Value::Float(x) => Mirror::Float(*x),
            Value::Str(x) => Mirror::Str(x.clone()),
            Value::Bytes(x) => Mirror::Bytes(x.clone()),
            Value::List(x) => Mirror::List(x.iter().map(mirror).collect()),
            Value::Tuple(x) => Mirror::Tuple(x.iter().map(mirror).collect()),
            Value::Dict(d) => Mirror::Dict(mirror_dict(d)),
            Value::Tensor(t) => Mirror::Tensor(t.shallow_clone()),
        }
    }

    fn mirror_dict(d: &super::Dict) -> MirrorDict {
        Dict {
            ordered: d.is_ordered(),
            entries: d.iter().map(|(k, v)| (k.clone(), mirror(v))).collect(),
            attributes: d.attributes().map(|(k, v)| (k.to_string(), mirror(v))).collect(),
        }
    }

    fn sample() -> Value {
        use super::super::value::Dict;
        let mut meta = Dict::new_ordered().with("", Value::Dict(Dict::new().with("version", Value::Int(1))));
        meta.insert(-3, Value::Tuple(vec![]));
        let mut model = Dict::new_ordered()
            .with("fc.weight", Value::Tensor(Tensor::arange(6, (Kind::Float, Device::Cpu)).reshape([2, 3])))
            .with("empty", Value::Dict(Dict::new()));
        model.set_attribute("_metadata", Value::Dict(meta));
        let mut attrs_only = Dict::new_ordered();
        attrs_only.set_attribute("a", Value::List(vec![]));
        Value::Dict(Dict::new().with("model", Value::Dict(model)).with("attrs_only", Value::Dict(attrs_only)).with(
            "misc",
            Value::List(vec![
                Value::None,
                Value::Bool(true),
                Value::Int(-7),
                Value::BigInt(BigInt::from_i128(i128::MAX)),
                Value::Float(f64::NAN),
                Value::Float(1e-7),
                Value::Str("a\nb \"q\"".into()),
                Value::Bytes(vec![0, 255]),
                Value::Bytes(vec![]),
                Value::Tuple(vec![Value::Tuple(vec![Value::List(vec![])])]),
            ]),
        ))
    }

    #[test]
    fn prints_what_derive_prints() {
        let v = sample();
        let m = mirror(&v);
        assert_eq!(format!("{v:?}"), format!("{m:?}"));
        assert_eq!(format!("{v:#?}"), format!("{m:#?}"));
        let Value::Dict(d) = &v else { unreachable!() };
        let md = mirror_dict(d);
        assert_eq!(format!("{d:?}"), format!("{md:?}"));
        assert_eq!(format!("{d:#?}"), format!("{md:#?}"));
        for leaf in [Value::None, Value::Int(3), Value::List(vec![]), Value::Dict(super::super::value::Dict::new())] {
            let m = mirror(&leaf);
            assert_eq!(format!("{leaf:?}"), format!("{m:?}"));
            assert_eq!(format!("{leaf:#?}"), format!("{m:#?}"));
        }
        // Flags reach the leaves, as derive passes them on.
        let v = Value::List(vec![Value::Float(0.5), Value::Int(3)]);
        let m = mirror(&v);
        assert_eq!(format!("{v:5.2?}"), format!("{m:5.2?}"));
    }
}
