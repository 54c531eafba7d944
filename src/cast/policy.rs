//! O1's cast lists as data: which aten operators run in low precision, in fp32, in the widest
//! input type, or not at all.
use crate::error::ConfigError;
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::Mutex;

use once_cell::sync::Lazy;
use serde::{Deserialize, Serialize};
use tch::Device;

use crate::error::{AmpError, Result};
use crate::sys::cast::EngineCategory;

/// How an operator's floating-point tensor arguments are cast under O1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Cast {
    /// Cast fp32/fp16/bf16 inputs to the O1 low-precision dtype (fp16 or bf16); Apex's
    /// `FP16_FUNCS`. fp64 inputs are left alone.
    LowPrecision,
    /// Cast fp16/bf16 inputs to fp32; Apex's `FP32_FUNCS`.
    Fp32,
    /// Cast every floating input to the widest floating input type (fp64 wins and is never cast
    /// down); Apex's `CASTS` and `SEQUENCE_CASTS`.
    Promote,
    /// Refuse fp16/bf16 inputs with [`OpRefused::BannedOp`](crate::error::OpRefused::BannedOp) (or
    /// run in fp32 when [`crate::cast::CastSettings::allow_banned`] is set); Apex's `BANNED_FUNCS`.
    Banned,
}

impl Cast {
    /// The engine's number for the category.
    pub(crate) fn engine_category(self) -> EngineCategory {
        match self {
            Cast::LowPrecision => EngineCategory::LowPrecision,
            Cast::Fp32 => EngineCategory::Fp32,
            Cast::Promote => EngineCategory::Promote,
            Cast::Banned => EngineCategory::Banned,
        }
    }
}

/// One set of cast lists (see the [entry syntax](crate::CastPolicy#entries) for the entry syntax).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CastLists {
    /// Ops whose inputs are cast to the low-precision dtype.
    pub low_precision: Vec<String>,
    /// Ops whose inputs are cast to fp32.
    pub fp32: Vec<String>,
    /// Ops whose inputs are cast to the widest input type.
    pub promote: Vec<String>,
    /// Ops refused on low-precision inputs.
    pub banned: Vec<String>,
}

impl CastLists {
    fn lists(&self) -> [(Cast, &Vec<String>); 4] {
        [
            (Cast::LowPrecision, &self.low_precision),
            (Cast::Fp32, &self.fp32),
            (Cast::Promote, &self.promote),
            (Cast::Banned, &self.banned),
        ]
    }
}

/// Casts the user registered (Apex's `register_half_function`, `register_float_function`,
/// `register_promote_function`), also loadable from a TOML file with the same three keys:
///
/// ```toml
/// half = ["my_gemm_like_op"]
/// float = ["erf", "sigmoid"]
/// promote = ["where.self"]
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct UserCasts {
    /// Ops cast to the low-precision dtype (fp16, or bf16 with a bf16 O1).
    pub half: Vec<String>,
    /// Ops cast to fp32.
    pub float: Vec<String>,
    /// Ops cast to the widest input type.
    pub promote: Vec<String>,
}

impl UserCasts {
    fn lists(&self) -> [(Cast, &Vec<String>); 3] {
        [(Cast::LowPrecision, &self.half), (Cast::Fp32, &self.float), (Cast::Promote, &self.promote)]
    }

    fn remove(&mut self, op: &str) {
        for list in [&mut self.half, &mut self.float, &mut self.promote] {
            list.retain(|e| e != op);
        }
    }
}

/// An O1 cast policy: the cast lists, as data.
///
///
/// # Entries
/// A list entry names aten operators the way the dispatcher does:
/// - `"name"`: every overload of `aten::name` that has no `out=` argument, plus every such
///   overload of its in-place variant `aten::name_` (`"exp"` covers `exp` and `exp_`,
///   `"add"` covers `add.Tensor`, `add.Scalar`, `add_.Tensor`, `add_.Scalar`);
/// - `"name.overload"`: exactly that overload (`"pow.Tensor_Scalar"`); `"name.default"` is the
///   unnamed overload, as in PyTorch's `torch.ops.aten.name.default`.
///
/// `out=` overloads are never cast: an `out` tensor fixes the result's dtype.
///
/// # Precedence
/// A policy has lists for every device type (`all`), per device type (`cpu`, `cuda`) and the
/// user's own casts (`user`, Apex's `register_*_function`). When one overload is named more
/// than once, user casts beat device lists, device lists beat `all`, and within each an
/// `"name.overload"` entry beats a bare `"name"`. The same overload in two categories at the
/// same level is an error.
///
/// [`CastPolicy::apex`] is Apex's O1 lists (the default), [`CastPolicy::torch_native`] is
/// libtorch's own autocast lists, and [`CastPolicy::emulation_only`] has no lists at all (for
/// O2/O3 models on CPU, where only the low-precision emulation acts). A policy takes effect
/// when installed with [`crate::cast::install_policy`]; changes made afterwards (user casts
/// included) take effect at the next install, as Apex's registrations took effect at the next
/// `amp.initialize`.
///
/// ```
/// # fn main() -> Result<(), tch_amp::AmpError> {
/// use tch_amp::cast::Cast;
/// use tch_amp::CastPolicy;
/// let mut policy = CastPolicy::apex();
/// policy.register_float_function("sigmoid")?;
/// let cpu = policy.resolve(tch::Device::Cpu)?;
/// assert_eq!(cpu["sigmoid"], Cast::Fp32);
/// assert_eq!(cpu["linear"], Cast::LowPrecision);
/// assert_eq!(cpu["softmax.int"], Cast::Fp32);
/// assert!(policy.register_half_function("no_such_op").is_err());
/// # Ok(())
/// # }
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CastPolicy {
    /// A name for messages (`"apex"`, `"torch"`, ...).
    pub name: String,
    /// Lists for every device type.
    pub all: CastLists,
    /// Lists for CPU only (added to `all`).
    pub cpu: CastLists,
    /// Lists for CUDA only (added to `all`).
    pub cuda: CastLists,
    /// The user's casts; they take precedence over every other list.
    pub user: UserCasts,
}

const APEX_TOML: &str = include_str!("../../opt_levels/o1_apex.toml");
const TORCH_TOML: &str = include_str!("../../opt_levels/o1_torch.toml");

impl CastPolicy {
    /// Apex's O1 lists (`apex/amp/lists/*.py` at NVIDIA/apex e13873de) mapped to the aten
    /// operators libtorch's Autocast keys see, from `opt_levels/o1_apex.toml`.
    pub fn apex() -> Self {
        toml::from_str(APEX_TOML).expect("opt_levels/o1_apex.toml is valid (checked by tests)")
    }

    /// libtorch 2.13's own autocast lists for CPU and CUDA, from `opt_levels/o1_torch.toml`.
    ///
    /// Differs from libtorch's autocast in three ways: ops libtorch runs in fp32 by setting
    /// their `dtype` argument (softmax, sum, cumsum, prod, ...) or by appending one (norm) get
    /// their inputs cast to fp32 instead (same output dtype); promote ignores no input type
    /// (libtorch leaves fp64 inputs to the op's own type promotion, with the same result); and
    /// the weight-cast cache is tch-amp's, which also recasts a weight changed in place.
    pub fn torch_native() -> Self {
        toml::from_str(TORCH_TOML).expect("opt_levels/o1_torch.toml is valid (checked by tests)")
    }

    /// A policy with no cast lists: under it only the CPU low-precision emulation acts (see
    /// [`crate::CpuKernels`]). For O2/O3 models on CPU, whose weights already are
    /// fp16/bf16.
    pub fn emulation_only() -> Self {
        Self { name: "emulation-only".to_string(), ..Self::default() }
    }

    /// Parses a policy from TOML (the format of `opt_levels/o1_apex.toml`) and checks every entry
    /// against the dispatcher.
    ///
    /// # Errors
    /// [`ConfigError::Parse`] for malformed TOML, unknown keys or an overload put in two categories
    /// at the same level; [`ConfigError::UnknownOp`] for an entry naming no aten operator.
    pub fn from_toml_str(text: &str) -> Result<Self> {
        let policy: Self = toml::from_str(text).map_err(|e| {
            AmpError::Config(ConfigError::Parse { what: "cast policy TOML".to_string(), message: e.to_string() })
        })?;
        policy.validate()?;
        Ok(policy)
    }

    /// The policy as TOML (loadable with [`CastPolicy::from_toml_str`]).
    ///
    /// # Errors
    /// [`ConfigError::Parse`] if serialization fails (it does not for policies built by this
    /// crate).
    pub fn to_toml_string(&self) -> Result<String> {
        toml::to_string(self).map_err(|e| {
            AmpError::Config(ConfigError::Parse { what: "cast policy".to_string(), message: e.to_string() })
        })
    }

    /// Checks every entry for CPU and CUDA (see [`CastPolicy::resolve`]).
    ///
    /// # Errors
    /// As [`CastPolicy::resolve`].
    pub fn validate(&self) -> Result<()> {
        self.resolve(Device::Cpu)?;
        self.resolve(Device::Cuda(0))?;
        Ok(())
    }

    /// The exact aten overloads this policy casts on `device`'s type and how, keyed like the
    /// dispatcher names them without the `aten::` prefix (`"mm"`, `"softmax.int"`,
    /// `"add_.Tensor"`). Ops absent from the map run in their inputs' dtypes.
    ///
    /// # Errors
    /// [`ConfigError::UnknownOp`] for an entry that names no aten operator (or an `out=` overload);
    /// [`ConfigError::Parse`] when one overload is in two categories at the same level;
    /// [`ConfigError::InvalidOption`] for a device other than CPU or CUDA.
    pub fn resolve(&self, device: Device) -> Result<BTreeMap<String, Cast>> {
        let device_lists = match device {
            Device::Cpu => &self.cpu,
            Device::Cuda(_) => &self.cuda,
            other => {
                return Err(AmpError::Config(ConfigError::InvalidOption {
                    option: "device",
                    value: format!("{other:?}"),
                    expected: "Device::Cpu or Device::Cuda(_)",
                }))
            }
        };
        // (level, cast, entry) per overload; a higher level wins.
        let mut chosen: BTreeMap<String, (u8, Cast, String)> = BTreeMap::new();
        let mut add = |base_level: u8, cast: Cast, entry: &String| -> Result<()> {
            let level = base_level + u8::from(entry.contains('.'));
            for op in aten_overloads(entry)? {
                match chosen.get(&op) {
                    Some((l, c, first)) if *l == level && *c != cast => {
                        return Err(AmpError::Config(ConfigError::Parse {
                            what: format!("cast policy {:?}", self.name),
                            message: format!(
                                "aten::{op} is both {c:?} (from entry {first:?}) and {cast:?} (from entry {entry:?}); \
                                 remove one of the entries"
                            ),
                        }))
                    }
                    Some((l, _, _)) if *l > level => {}
                    _ => {
                        chosen.insert(op, (level, cast, entry.clone()));
                    }
                }
            }
            Ok(())
        };
        for (cast, list) in self.all.lists() {
            list.iter().try_for_each(|e| add(0, cast, e))?;
        }
        for (cast, list) in device_lists.lists() {
            list.iter().try_for_each(|e| add(2, cast, e))?;
        }
        for (cast, list) in self.user.lists() {
            list.iter().try_for_each(|e| add(4, cast, e))?;
        }
        Ok(chosen.into_iter().map(|(op, (_, cast, _))| (op, cast)).collect())
    }

    fn register(&mut self, op: &str, cast: Cast) -> Result<()> {
        aten_overloads(op)?;
        self.user.remove(op);
        let list = match cast {
            Cast::LowPrecision => &mut self.user.half,
            Cast::Fp32 => &mut self.user.float,
            _ => &mut self.user.promote,
        };
        list.push(op.to_string());
        Ok(())
    }

    /// Casts `op` (an entry, see the [entry syntax](crate::CastPolicy#entries)) to the
    /// low-precision dtype, whatever the lists say. Apex's `amp.register_half_function`; takes
    /// effect at the next install.
    ///
    /// # Errors
    /// [`ConfigError::UnknownOp`] when `op` names no aten operator.
    pub fn register_half_function(&mut self, op: &str) -> Result<()> {
        self.register(op, Cast::LowPrecision)
    }

    /// Casts `op` to fp32, whatever the lists say. Apex's `amp.register_float_function`.
    ///
    /// # Errors
    /// [`ConfigError::UnknownOp`] when `op` names no aten operator.
    pub fn register_float_function(&mut self, op: &str) -> Result<()> {
        self.register(op, Cast::Fp32)
    }

    /// Casts `op`'s inputs to the widest input type. Apex's `amp.register_promote_function`.
    ///
    /// # Errors
    /// [`ConfigError::UnknownOp`] when `op` names no aten operator.
    pub fn register_promote_function(&mut self, op: &str) -> Result<()> {
        self.register(op, Cast::Promote)
    }

    /// Registers the user casts in `text` (TOML with `half`, `float` and `promote` arrays, see
    /// [`UserCasts`]). Nothing is registered unless every entry is valid.
    ///
    /// # Errors
    /// [`ConfigError::Parse`] for malformed TOML or unknown keys; [`ConfigError::UnknownOp`] for an
    /// entry naming no aten operator.
    pub fn add_user_casts_toml(&mut self, text: &str) -> Result<()> {
        let casts: UserCasts = toml::from_str(text).map_err(|e| {
            AmpError::Config(ConfigError::Parse { what: "user casts TOML".to_string(), message: e.to_string() })
        })?;
        let mut next = self.clone();
        for (cast, list) in casts.lists() {
            for op in list {
                next.register(op, cast)?;
            }
        }
        *self = next;
        Ok(())
    }

    /// Reads user casts from a TOML file (see [`CastPolicy::add_user_casts_toml`]).
    ///
    /// # Errors
    /// [`AmpError::Io`] when the file cannot be read, otherwise as
    /// [`CastPolicy::add_user_casts_toml`].
    pub fn load_user_casts(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| AmpError::read(path, source))?;
        self.add_user_casts_toml(&text)
    }
}

/// Dispatcher look-ups are memoized: aten's operator set does not change while running.
static OVERLOADS: Lazy<Mutex<HashMap<String, Vec<String>>>> = Lazy::new(|| Mutex::new(HashMap::new()));

/// The overload names of `aten::<name>` without `out=` arguments (`""` for the unnamed one).
fn overloads_of(name: &str) -> Result<Vec<String>> {
    if let Some(found) = OVERLOADS.lock().unwrap_or_else(|e| e.into_inner()).get(name) {
        return Ok(found.clone());
    }
    let found = crate::sys::cast::aten_overloads(name)?;
    OVERLOADS.lock().unwrap_or_else(|e| e.into_inner()).insert(name.to_string(), found.clone());
    Ok(found)
}

fn display(name: &str, overload: &str) -> String {
    if overload.is_empty() {
        name.to_string()
    } else {
        format!("{name}.{overload}")
    }
}

/// The exact aten overloads a list entry names (see the [entry syntax](crate::CastPolicy#entries)):
/// `"exp"` gives `["exp", "exp_"]`, `"softmax"` gives `["softmax.int"]`, `"pow.Scalar"` gives
/// `["pow.Scalar"]`, `"mm.default"` gives `["mm"]`.
///
/// # Errors
/// [`ConfigError::UnknownOp`] when the entry names no operator, or names an overload that does not
/// exist or has an `out=` argument (the message lists the overloads there are).
pub fn aten_overloads(entry: &str) -> Result<Vec<String>> {
    let unknown = |message: String| AmpError::Config(ConfigError::UnknownOp { name: entry.to_string(), message });
    if entry.is_empty() || entry.contains(char::is_whitespace) || entry.contains("::") {
        return Err(unknown(
            "expected an aten operator name such as \"mm\" or \"pow.Tensor_Scalar\", \
             without the \"aten::\" prefix"
                .to_string(),
        ));
    }
    if let Some((name, overload)) = entry.split_once('.') {
        let wanted = if overload == "default" { "" } else { overload };
        let available = overloads_of(name)?;
        if available.iter().any(|o| o == wanted) {
            return Ok(vec![display(name, wanted)]);
        }
        let listed: Vec<String> =
            available.iter().map(|o| if o.is_empty() { "default".to_string() } else { o.clone() }).collect();
        return Err(unknown(if listed.is_empty() {
            format!("the dispatcher has no operator aten::{name}")
        } else {
            format!("aten::{name} has no overload {overload:?} without an out= argument; it has {}", listed.join(", "))
        }));
    }
    let mut found: Vec<String> = overloads_of(entry)?.iter().map(|o| display(entry, o)).collect();
    let inplace = format!("{entry}_");
    found.extend(overloads_of(&inplace)?.iter().map(|o| display(&inplace, o)));
    if found.is_empty() {
        return Err(unknown(format!(
            "the dispatcher has no operator aten::{entry} or aten::{entry}_ (without an out= argument)"
        )));
    }
    Ok(found)
}
