//! Storages: from file bytes to shared tch storages (reading), from tch tensors to storage
//! bytes (writing). Every tensor view is checked against its storage before libtorch sees it.
use std::borrow::Cow;
use std::collections::HashMap;

use tch::{Device, Kind, Tensor};

use super::error::{torch_err, Result, TorchIoError};
use super::pickle_read::{elem_size, needed_elements, StorageDecl, TensorSpec};
use super::value::{format_path, Value};
use super::walk::{Step, Walk};

/// Hands out the raw bytes of a declared storage.
pub(crate) trait StorageSource {
    /// The bytes of `decl`, exactly `numel × element size` of them (checked by the caller too).
    fn bytes(&mut self, decl: &StorageDecl) -> Result<Cow<'_, [u8]>>;
    /// Whether the file's storages are big-endian.
    fn big_endian(&self) -> bool;
}

/// Builds tensors from specs, one base tensor per storage, read once; a tensor of another
/// dtype on the same storage views the base's memory (`view_dtype`), it does not copy it.
pub(crate) struct Materializer<'s> {
    decls: &'s [StorageDecl],
    source: &'s mut dyn StorageSource,
    map_location: Option<Device>,
    bases: HashMap<(usize, i32), Tensor>,
    /// The first base built of each storage.
    first: HashMap<usize, Tensor>,
}

fn kind_id(k: Kind) -> i32 {
    // Kind has no Hash; its position in this list is enough for a cache key.
    const KINDS: [Kind; 12] = [
        Kind::Uint8,
        Kind::Int8,
        Kind::Int16,
        Kind::Int,
        Kind::Int64,
        Kind::Half,
        Kind::Float,
        Kind::Double,
        Kind::ComplexFloat,
        Kind::ComplexDouble,
        Kind::Bool,
        Kind::BFloat16,
    ];
    KINDS.iter().position(|&x| x == k).map_or(-1, |p| p as i32)
}

/// Parses a torch location tag.
pub(crate) fn parse_location(key: &str, location: &str) -> Result<Device> {
    let err = |message: &str| TorchIoError::Location {
        key: key.to_string(),
        location: location.to_string(),
        message: message.to_string(),
    };
    match location {
        "cpu" => Ok(Device::Cpu),
        "cuda" => Ok(Device::Cuda(0)),
        l => match l.strip_prefix("cuda:") {
            Some(n) => n.parse::<usize>().map(Device::Cuda).map_err(|_| err("bad CUDA device index")),
            None => Err(err("not cpu or cuda")),
        },
    }
}

/// Reverses each element's bytes (each component for complex dtypes), in place.
fn swap_bytes(buf: &mut [u8], kind: Kind) {
    let n = match kind {
        Kind::ComplexFloat => 4,
        Kind::ComplexDouble => 8,
        k => elem_size(k) as usize,
    };
    if n > 1 {
        for chunk in buf.chunks_exact_mut(n) {
            chunk.reverse();
        }
    }
}

impl<'s> Materializer<'s> {
    pub(crate) fn new(
        decls: &'s [StorageDecl],
        source: &'s mut dyn StorageSource,
        map_location: Option<Device>,
    ) -> Self {
        Self { decls, source, map_location, bases: HashMap::new(), first: HashMap::new() }
    }

    fn base(&mut self, decl_idx: usize, kind: Kind) -> Result<Tensor> {
        if let Some(t) = self.bases.get(&(decl_idx, kind_id(kind))) {
            return Ok(t.shallow_clone());
        }
        let decl = &self.decls[decl_idx];
        if let Some(first) = self.first.get(&decl_idx) {
            // The storage is already read: view its bytes as `kind` (the spec's checks made
            // sure they hold whole elements).
            let ctx = || format!("viewing storage {:?} as {kind:?}", decl.key);
            let bytes = first.f_view_dtype(Kind::Uint8).map_err(torch_err(ctx()))?;
            if kind == Kind::Bool {
                let bad = bytes.f_gt(1).and_then(|b| b.f_nonzero()).map_err(torch_err(ctx()))?;
                if bad.size().first().is_some_and(|&n| n > 0) {
                    let index = bad.f_int64_value(&[0, 0]).map_err(torch_err(ctx()))?;
                    let byte = bytes.f_int64_value(&[index]).map_err(torch_err(ctx()))?;
                    return Err(TorchIoError::InvalidBool {
                        key: decl.key.clone(),
                        index: index as u64,
                        byte: byte as u8,
                    });
                }
            }
            let t = if kind == Kind::Uint8 { bytes } else { bytes.f_view_dtype(kind).map_err(torch_err(ctx()))? };
            self.bases.insert((decl_idx, kind_id(kind)), t.shallow_clone());
            return Ok(t);
        }
        let device = match self.map_location {
            Some(d) => d,
            None => parse_location(&decl.key, &decl.location)?,
        };
        let expected = decl.numel.checked_mul(elem_size(decl.kind)).ok_or_else(|| TorchIoError::StorageMismatch {
            key: decl.key.clone(),
            message: format!("{} elements overflow a byte count", decl.numel),
        })?;
        let big_endian = self.source.big_endian();
        let mut bytes = self.source.bytes(decl)?;
        if bytes.len() as u64 != expected {
            return Err(TorchIoError::StorageSize { key: decl.key.clone(), expected, found: bytes.len() as u64 });
        }
        if big_endian {
            swap_bytes(bytes.to_mut(), decl.kind);
        }
        if kind == Kind::Bool {
            if let Some(i) = bytes.iter().position(|&b| b > 1) {
                return Err(TorchIoError::InvalidBool { key: decl.key.clone(), index: i as u64, byte: bytes[i] });
            }
        }
        let numel = bytes.len() as u64 / elem_size(kind);
        let numel = i64::try_from(numel).map_err(|_| TorchIoError::StorageMismatch {
            key: decl.key.clone(),
            message: "storage too large".into(),
        })?;
        let cpu = Tensor::f_from_data_size(&bytes, &[numel], kind)
            .map_err(torch_err(format!("creating storage {:?}", decl.key)))?;
        drop(bytes);
        let t = if device == Device::Cpu {
            cpu
        } else {
            cpu.f_to_device(device).map_err(torch_err(format!("moving storage {:?} to {device:?}", decl.key)))?
        };
        self.bases.insert((decl_idx, kind_id(kind)), t.shallow_clone());
        self.first.insert(decl_idx, t.shallow_clone());
        Ok(t)
    }

    /// The tensor a spec describes, viewing the shared storage.
    pub(crate) fn tensor(&mut self, spec: &TensorSpec) -> Result<Tensor> {
        let base = self.base(spec.storage.decl, spec.kind)?;
        // Checked once more against the base actually built (the spec was checked against the
        // declared size, which the bytes were checked against).
        let needed = needed_elements(&spec.size, &spec.stride, spec.storage_offset);
        let have = base.numel() as u64;
        if needed.map_or(true, |n| n > have) {
            return Err(TorchIoError::StorageOutOfBounds {
                offset: 0,
                key: spec.storage.key.to_string(),
                size: spec.size.clone(),
                stride: spec.stride.clone(),
                storage_offset: spec.storage_offset,
                needed: needed.unwrap_or(0),
                storage_numel: have,
            });
        }
        let ctx = || format!("viewing storage {:?}", spec.storage.key);
        let mut t = Tensor::f_empty([0], (spec.kind, base.device())).map_err(torch_err(ctx()))?;
        let _ = t
            .f_set_source_tensor_storage_offset_(
                &base,
                spec.storage_offset,
                spec.size.as_slice(),
                spec.stride.as_slice(),
            )
            .map_err(torch_err(ctx()))?;
        if spec.requires_grad {
            let _ = t.f_requires_grad_(true).map_err(torch_err(ctx()))?;
        }
        Ok(t)
    }
}

/// One storage to write: its bytes are copied out of `tensor` (a view of it) when written.
pub(crate) struct StorageOut {
    pub key: String,
    pub kind: Kind,
    pub numel: u64,
    pub location: String,
    tensor: Tensor,
    path: String,
}

impl StorageOut {
    /// Fills `buf` with the storage's first `numel` elements (a buffer reused across storages
    /// keeps a large save from holding every storage twice).
    pub(crate) fn read_into(&self, buf: &mut Vec<u8>) -> Result<()> {
        let _guard = tch::no_grad_guard();
        let es = elem_size(self.kind);
        let ctx = || format!("copying the storage of {}", self.path);
        let numel = i64::try_from(self.numel)
            .map_err(|_| TorchIoError::CannotSave { path: self.path.clone(), message: "storage too large".into() })?;
        buf.clear();
        buf.resize((self.numel * es) as usize, 0);
        if numel > 0 {
            let flat = self
                .tensor
                .f_detach()
                .and_then(|d| d.f_as_strided([numel], [1], Some(0)))
                .and_then(|f| f.f_to_device(Device::Cpu))
                .and_then(|f| f.f_contiguous())
                .map_err(torch_err(ctx()))?;
            flat.f_copy_data_u8(buf, numel as usize).map_err(torch_err(ctx()))?;
        }
        if cfg!(target_endian = "big") {
            swap_bytes(buf, self.kind);
        }
        Ok(())
    }
}

/// One tensor to write, in tree order.
pub(crate) struct TensorOut {
    pub storage: usize,
    pub storage_offset: i64,
    pub size: Vec<i64>,
    pub stride: Vec<i64>,
    pub requires_grad: bool,
}

/// The storage class name torch.save writes for a dtype.
pub(crate) fn storage_type_name(kind: Kind) -> Option<&'static str> {
    Some(match kind {
        Kind::Double => "DoubleStorage",
        Kind::Float => "FloatStorage",
        Kind::Half => "HalfStorage",
        Kind::BFloat16 => "BFloat16Storage",
        Kind::Int64 => "LongStorage",
        Kind::Int => "IntStorage",
        Kind::Int16 => "ShortStorage",
        Kind::Int8 => "CharStorage",
        Kind::Uint8 => "ByteStorage",
        Kind::Bool => "BoolStorage",
        Kind::ComplexFloat => "ComplexFloatStorage",
        Kind::ComplexDouble => "ComplexDoubleStorage",
        _ => return None,
    })
}

/// Groups the tree's tensors by the storage they view (same device, same storage start) and
/// copies out each storage's used prefix. Keys are "0", "1", ... in first-use order, as
/// torch.save numbers them.
pub(crate) fn plan(value: &Value) -> Result<(Vec<TensorOut>, Vec<StorageOut>)> {
    struct Group<'v> {
        first: &'v Tensor,
        first_path: String,
        kind: Kind,
        extent: u64,
        location: String,
    }
    let mut groups: Vec<Group> = Vec::new();
    let mut by_base: HashMap<(String, usize), usize> = HashMap::new();
    let mut tensors = Vec::new();
    // In the writer's order (dict entries, then attributes; sequences in order).
    let mut walk = Walk::new(value);
    while let Some(step) = walk.next() {
        let Step::Enter(v, _) = step else { continue };
        walk.check_depth()?;
        let Value::Tensor(t) = v else { continue };
        let path = walk.path();
        let unsupported = |message: String| TorchIoError::CannotSave { path: format_path(path), message };
        if !t.defined() {
            return Err(unsupported("undefined tensor".into()));
        }
        if t.is_sparse() || t.is_mkldnn() {
            return Err(unsupported("sparse and mkldnn tensors are not supported; convert to dense".into()));
        }
        let kind = t.f_kind().map_err(torch_err(format!("reading the dtype of {}", format_path(path))))?;
        if storage_type_name(kind).is_none() {
            return Err(unsupported(format!("dtype {kind:?} is not supported")));
        }
        let location = match t.device() {
            Device::Cpu => "cpu".to_string(),
            Device::Cuda(i) => format!("cuda:{i}"),
            d => return Err(unsupported(format!("device {d:?} is not supported; move it to cpu or cuda"))),
        };
        let size = t.size();
        let stride = t.stride();
        let storage_offset = crate::sys::storage_offset(t)
            .map_err(torch_err(format!("reading the storage offset of {}", format_path(path))))?;
        let extent = needed_elements(&size, &stride, storage_offset)
            .ok_or_else(|| unsupported(format!("size {size:?} / stride {stride:?} overflow")))?;
        let es = elem_size(kind) as usize;
        let ptr = t.data_ptr() as usize;
        let base = ptr.wrapping_sub((storage_offset as usize).wrapping_mul(es));
        let group = if ptr == 0 { None } else { by_base.get(&(location.clone(), base)).copied() };
        let g = match group {
            Some(g) => {
                let grp = &mut groups[g];
                if grp.kind != kind {
                    return Err(unsupported(format!(
                        "it views the storage of {} as {kind:?}, which was {:?} there; torch.save refuses \
                         two dtypes on one storage too (clone one of them)",
                        grp.first_path, grp.kind
                    )));
                }
                grp.extent = grp.extent.max(extent);
                g
            }
            None => {
                groups.push(Group {
                    first: t,
                    first_path: format_path(path),
                    kind,
                    extent,
                    location: location.clone(),
                });
                if ptr != 0 {
                    by_base.insert((location, base), groups.len() - 1);
                }
                groups.len() - 1
            }
        };
        tensors.push(TensorOut { storage: g, storage_offset, size, stride, requires_grad: t.requires_grad() });
    }
    let storages = groups
        .into_iter()
        .enumerate()
        .map(|(i, g)| StorageOut {
            key: i.to_string(),
            kind: g.kind,
            numel: g.extent,
            location: g.location,
            tensor: g.first.shallow_clone(),
            path: g.first_path,
        })
        .collect();
    Ok((tensors, storages))
}
