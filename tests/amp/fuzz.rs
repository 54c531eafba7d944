//! Fuzzing the loaders with proptest (seeded, bounded): the Apex / GradScaler state-dict
//! loader (40,000 generated JSON values), the checkpoint loader (20,000 mutated files: bytes,
//! the safetensors header, the tch-amp metadata, tensor data) and user cast files (40,000
//! generated or mutated TOML texts). For every input: no panic, no abort; an error is typed
//! and changes nothing; an accepted input is applied exactly (a checkpoint saved again holds
//! the same tensors and metadata as the file) and the next training steps do not panic.
use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use tch_amp::error::{ConfigError, StateError};

use proptest::prelude::*;
use proptest::test_runner::{Config, TestCaseError, TestRunner};
use serde_json::{json, Value};
use tch::nn::{self, ModuleT, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::scaling::LossScaler;
use tch_amp::{Amp, AmpConfig, AmpError, AmpModel, AmpOptimizer, CastPolicy, OptLevel};

use crate::common::{batch, deterministic_init, Mlp};

fn runner(cases: u32, seed: u64) -> TestRunner {
    let config = Config { cases, failure_persistence: None, max_shrink_iters: 64, ..Config::default() };
    TestRunner::new_with_rng(config, crate::common::rng(seed))
}

// ---------------------------------------------------------------------------------------
// Numbers and JSON.

fn interesting_f64() -> impl Strategy<Value = f64> {
    prop_oneof![
        Just(0.0),
        Just(-0.0),
        Just(1.0),
        Just(-1.0),
        Just(0.5),
        Just(2.0),
        Just(1e-300),
        Just(1e-40),
        Just(1e-30),
        Just(1e30),
        Just(1e300),
        Just(1.7e308),
        Just(65536.0),
        Just(16_777_216.0),
        Just(LossScaler::DEFAULT_MIN_LOSS_SCALE),
        Just(1999.0),
        Just(2000.0),
        Just(9_007_199_254_740_993.0),
        (-1e6f64..1e6),
        any::<f64>().prop_filter("finite", |v| v.is_finite()),
    ]
}

fn number() -> impl Strategy<Value = Value> {
    prop_oneof![
        interesting_f64().prop_map(|v| json!(v)),
        prop_oneof![Just(0u64), Just(1), Just(2), Just(1999), Just(2000), Just(u64::MAX), any::<u64>()]
            .prop_map(|v| json!(v)),
        any::<i64>().prop_map(|v| json!(v)),
    ]
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("loss_scaler0".to_string()),
        Just("loss_scaler1".to_string()),
        Just("loss_scaler2".to_string()),
        Just("loss_scale".to_string()),
        Just("unskipped".to_string()),
        Just("hysteresis_left".to_string()),
        Just("recovery_target".to_string()),
        Just("scale".to_string()),
        Just("growth_factor".to_string()),
        Just("backoff_factor".to_string()),
        Just("growth_interval".to_string()),
        Just("_growth_tracker".to_string()),
        "[a-z_0-9]{0,12}",
    ]
}

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf =
        prop_oneof![Just(Value::Null), any::<bool>().prop_map(Value::Bool), number(), ".{0,8}".prop_map(Value::String)];
    leaf.prop_recursive(3, 24, 5, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map(key(), inner, 0..5).prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

/// Near-valid states: Apex's form or a GradScaler dict, with interesting values.
fn near_valid_state() -> impl Strategy<Value = Value> {
    let scale = prop_oneof![
        3 => (-24i32..25, 0.0f64..1.0).prop_map(|(e, f)| json!((2f64.powi(e) * (1.0 + f)).min(16_777_216.0))),
        1 => number(),
    ];
    let count = prop_oneof![3 => (0u64..2000).prop_map(|v| json!(v)), 1 => number()];
    let hysteresis = prop_oneof![3 => (1u64..4).prop_map(|v| json!(v)), 1 => number()];
    let target = prop_oneof![3 => (-24i32..25).prop_map(|e| json!(2f64.powi(e))), 1 => number()];
    let scaler =
        (scale, count, prop::option::of(hysteresis), prop::option::weighted(0.2, target)).prop_map(|(s, u, h, r)| {
            let mut m = serde_json::Map::new();
            m.insert("loss_scale".into(), s);
            m.insert("unskipped".into(), u);
            if let Some(h) = h {
                m.insert("hysteresis_left".into(), h);
            }
            if let Some(r) = r {
                m.insert("recovery_target".into(), r);
            }
            Value::Object(m)
        });
    let apex = prop::collection::vec(scaler, 0..4)
        .prop_map(|v| Value::Object(v.into_iter().enumerate().map(|(i, s)| (format!("loss_scaler{i}"), s)).collect()));
    let grad_scaler = prop::collection::btree_map(
        prop_oneof![
            Just("scale".to_string()),
            Just("growth_factor".to_string()),
            Just("backoff_factor".to_string()),
            Just("growth_interval".to_string()),
            Just("_growth_tracker".to_string()),
        ],
        number(),
        0..6,
    )
    .prop_map(|m| Value::Object(m.into_iter().collect()));
    prop_oneof![3 => apex, 2 => grad_scaler, 1 => arb_json()]
}

/// A tiny model to take the next steps with: one fp16 variable (fp32 master) and an fp32 one.
struct Tiny {
    vs: VarStore,
    amp: Amp,
    opt: AmpOptimizer,
}

impl Tiny {
    fn new(config: AmpConfig) -> Self {
        let vs = VarStore::new(Device::Cpu);
        let _ = vs.root().var("w", &[4], nn::Init::Const(0.5));
        let amp = Amp::new(&config.verbosity(0)).unwrap();
        amp.cast_model(&vs, ()).unwrap();
        let _ = vs.root().var("b", &[2], nn::Init::Const(0.25));
        let opt = amp.optimizer(&vs, nn::Adam::default(), 1e-3).unwrap();
        Self { vs, amp, opt }
    }

    /// One scale_loss per loss and a step: must not panic (errors are fine).
    fn next_steps(&mut self) {
        let v = self.vs.variables();
        for loss_id in 0..self.amp.scalers().len() {
            let loss = (v["w"].to_kind(Kind::Float) * 0.125).sum(Kind::Float) + v["b"].sum(Kind::Float);
            let _ = self.opt.zero_grad();
            let opts = tch_amp::ScaleLossOptions { loss_id, delay_unscale: false };
            let _ = self.amp.scale_loss_with(&loss, &mut [&mut self.opt], opts, |s| s.backward());
            let _ = self.opt.step();
        }
    }
}

/// 40,000 generated states, half into a two-loss Amp with hysteresis and fast regrowth, half
/// into a one-loss Amp (which also takes GradScaler dicts).
#[test]
fn fuzz_state_dict_loader() {
    let targets = RefCell::new([
        Tiny::new(AmpConfig::new(OptLevel::O2).num_losses(2).hysteresis(3).recovery_growth_interval(10)),
        Tiny::new(AmpConfig::new(OptLevel::O2)),
    ]);
    let (accepted, rejected) = (Cell::new(0u32), Cell::new(0u32));
    let mut r = runner(30_000, 61);
    r.run(&near_valid_state(), |state| {
        for t in targets.borrow_mut().iter_mut() {
            let before = t.amp.scalers().to_vec();
            match t.amp.load_state_dict(&crate::common::value(state.clone())) {
                Ok(()) => {
                    accepted.set(accepted.get() + 1);
                    for s in t.amp.scalers() {
                        let x = s.loss_scale();
                        prop_assert!(x >= s.min_loss_scale() && x <= s.max_loss_scale(), "{state}: scale {x}");
                        prop_assert!(s.unskipped() < s.growth_interval(), "{state}");
                    }
                    t.next_steps();
                }
                Err(AmpError::State(StateError::StateMismatch { .. })) => {
                    rejected.set(rejected.get() + 1);
                    prop_assert!(t.amp.scalers() == &before[..], "{state}: a failed load changed the scalers");
                }
                Err(other) => return Err(TestCaseError::fail(format!("{state}: untyped error {other:?}"))),
            }
        }
        Ok(())
    })
    .unwrap();
    let (accepted, rejected) = (accepted.get(), rejected.get());
    eprintln!("fuzz state dict: 30000 states, 60000 loads, {accepted} accepted, {rejected} rejected");
    assert!(accepted > 1000 && rejected > 1000, "{accepted} / {rejected}");
}

// ---------------------------------------------------------------------------------------
// Checkpoints.

struct Ckpt {
    vs: VarStore,
    model: AmpModel<Mlp>,
    amp: Amp,
    opts: Vec<AmpOptimizer>,
}

fn ckpt_setup(sgd: bool) -> Ckpt {
    let vs = VarStore::new(Device::Cpu);
    let net = Mlp::new(&vs.root());
    deterministic_init(&vs);
    let amp = Amp::new(&AmpConfig::new(OptLevel::O2).num_losses(2).hysteresis(2).verbosity(0)).unwrap();
    let model = amp.cast_model(&vs, net).unwrap();
    let opts = if sgd {
        vec![
            amp.optimizer_for(&vs, &["fc1"], nn::Sgd { momentum: 0.9, ..Default::default() }, 0.01).unwrap(),
            amp.optimizer_for(&vs, &["bn1", "fc2"], nn::Adam::default(), 1e-3).unwrap(),
        ]
    } else {
        vec![amp.optimizer(&vs, nn::Adam { amsgrad: true, ..Default::default() }, 1e-3).unwrap()]
    };
    Ckpt { vs, model, amp, opts }
}

impl Ckpt {
    fn step(&mut self, seed: i64) {
        for loss_id in 0..2 {
            let (x, y) = batch(seed + loss_id as i64, 8);
            let loss = self.model.forward_t(&x, true).mse_loss(&y, tch::Reduction::Mean);
            let mut refs: Vec<&mut AmpOptimizer> = self.opts.iter_mut().collect();
            let opts = tch_amp::ScaleLossOptions { loss_id, delay_unscale: false };
            let _ = self.amp.scale_loss_with(&loss, &mut refs, opts, |s| s.backward());
        }
        for o in self.opts.iter_mut() {
            let _ = o.step();
            let _ = o.zero_grad();
        }
    }

    fn save(&self, path: &std::path::Path) {
        let refs: Vec<&AmpOptimizer> = self.opts.iter().collect();
        tch_amp::save_checkpoint(path, &self.vs, &refs, &self.amp).unwrap();
    }

    fn load(&mut self, path: &std::path::Path) -> tch_amp::Result<()> {
        let mut refs: Vec<&mut AmpOptimizer> = self.opts.iter_mut().collect();
        tch_amp::load_checkpoint(path, &self.vs, &mut refs, &mut self.amp)
    }
}

/// The file's tensors (name -> dtype, shape, bytes) and its tch-amp metadata.
type Tensors = BTreeMap<String, (String, Vec<usize>, Vec<u8>)>;

fn contents(bytes: &[u8]) -> (Tensors, Value) {
    let st = safetensors::SafeTensors::deserialize(bytes).unwrap();
    let tensors = st
        .tensors()
        .into_iter()
        .map(|(k, v)| (k, (format!("{:?}", v.dtype()), v.shape().to_vec(), v.data().to_vec())))
        .collect();
    let (_, header) = safetensors::SafeTensors::read_metadata(bytes).unwrap();
    let meta = serde_json::from_str(&header.metadata().as_ref().unwrap()["tch_amp"]).unwrap();
    (tensors, meta)
}

/// JSON equality with numbers compared by value (1 == 1.0).
fn json_eq(a: &Value, b: &Value) -> bool {
    match (a, b) {
        (Value::Number(x), Value::Number(y)) => match (x.as_u64(), y.as_u64()) {
            (Some(p), Some(q)) => p == q,
            _ => x.as_f64() == y.as_f64(),
        },
        (Value::Array(x), Value::Array(y)) => x.len() == y.len() && x.iter().zip(y).all(|(p, q)| json_eq(p, q)),
        (Value::Object(x), Value::Object(y)) => {
            x.len() == y.len() && x.iter().all(|(k, v)| y.get(k).is_some_and(|w| json_eq(v, w)))
        }
        _ => a == b,
    }
}

/// Everything a load may change: variables, masters, optimizer records, AMP state, counters.
type Snapshot = (Vec<Tensor>, String, Vec<(u64, u64, String)>);

fn ckpt_snapshot(c: &Ckpt) -> Snapshot {
    let vars: BTreeMap<String, Tensor> = c.vs.variables().into_iter().collect();
    let mut tensors: Vec<Tensor> = vars.values().map(Tensor::copy).collect();
    let mut meta = vec![];
    for o in &c.opts {
        tensors.extend(o.master_params().iter().map(Tensor::copy));
        let r = o.to_record();
        for p in &r.params {
            tensors.extend(p.buffers.values().map(Tensor::copy));
        }
        let steps: Vec<u64> = r.params.iter().map(|p| p.step).collect();
        meta.push((r.steps, r.skipped, format!("{} {:?} {steps:?} {}", r.lr, r.group_lr, o.will_skip())));
    }
    (tensors, crate::common::json(&c.amp.state_dict()).to_string(), meta)
}

fn same_snapshot(a: &Snapshot, b: &Snapshot) -> bool {
    // NaN equals NaN here: an accepted file with an extreme learning rate may have made the state NaN.
    let same = |x: &Tensor, y: &Tensor| {
        x.size() == y.size()
            && x.kind() == y.kind()
            && x.eq_tensor(y).logical_or(&x.isnan().logical_and(&y.isnan())).all().int64_value(&[]) == 1
    };
    a.1 == b.1 && a.2 == b.2 && a.0.len() == b.0.len() && a.0.iter().zip(&b.0).all(|(x, y)| same(x, y))
}

#[derive(Debug, Clone)]
enum Mutation {
    FlipBytes(Vec<(prop::sample::Index, u8)>),
    Truncate(prop::sample::Index),
    Splice(prop::sample::Index, Vec<u8>),
    HeaderLength(u64),
    TensorField(prop::sample::Index, u8, Vec<u64>),
    DropTensor(prop::sample::Index),
    RenameTensor(prop::sample::Index, String),
    Metadata(Vec<(prop::sample::Index, Value)>),
    MetadataDrop(prop::sample::Index),
    Data(prop::sample::Index, u8),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    let idx = any::<prop::sample::Index>;
    prop_oneof![
        2 => prop::collection::vec((idx(), any::<u8>()), 1..6).prop_map(Mutation::FlipBytes),
        1 => idx().prop_map(Mutation::Truncate),
        1 => (idx(), prop::collection::vec(any::<u8>(), 0..16)).prop_map(|(i, b)| Mutation::Splice(i, b)),
        1 => prop_oneof![Just(0u64), Just(u64::MAX), Just(1 << 40), 0u64..4096].prop_map(Mutation::HeaderLength),
        3 => (idx(), 0u8..3, prop::collection::vec(prop_oneof![0u64..40, Just(u64::MAX)], 0..3))
            .prop_map(|(i, f, v)| Mutation::TensorField(i, f, v)),
        1 => idx().prop_map(Mutation::DropTensor),
        1 => (idx(), "[a-z0-9/._]{0,24}").prop_map(|(i, s)| Mutation::RenameTensor(i, s)),
        4 => prop::collection::vec((idx(), prop_oneof![
                number(),
                Just(json!("O1")), Just(json!("O3")), Just(json!("adam")), Just(json!("sgd")), Just(json!("adamw")),
                Just(json!("tch-amp-checkpoint/2")), Just(json!(null)), Just(json!([])), Just(json!({})),
                Just(json!(true)), ".{0,6}".prop_map(|s| json!(s)),
            ]), 1..3).prop_map(Mutation::Metadata),
        1 => idx().prop_map(Mutation::MetadataDrop),
        2 => (idx(), 0u8..4).prop_map(|(i, k)| Mutation::Data(i, k)),
    ]
}

/// The paths of the leaves of a JSON value.
fn leaves(v: &Value, path: Vec<String>, out: &mut Vec<Vec<String>>) {
    match v {
        Value::Object(m) => m.iter().for_each(|(k, w)| {
            let mut p = path.clone();
            p.push(k.clone());
            out.push(p.clone());
            leaves(w, p, out)
        }),
        Value::Array(a) => a.iter().enumerate().for_each(|(i, w)| {
            let mut p = path.clone();
            p.push(i.to_string());
            out.push(p.clone());
            leaves(w, p, out)
        }),
        _ => {}
    }
}

fn at<'a>(v: &'a mut Value, path: &[String]) -> Option<&'a mut Value> {
    path.iter().try_fold(v, |v, k| match v {
        Value::Object(m) => m.get_mut(k),
        Value::Array(a) => k.parse::<usize>().ok().and_then(|i| a.get_mut(i)),
        _ => None,
    })
}

fn split(bytes: &[u8]) -> (serde_json::Map<String, Value>, Vec<u8>) {
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    (header.as_object().unwrap().clone(), bytes[8 + n..].to_vec())
}

fn join(header: &serde_json::Map<String, Value>, data: &[u8]) -> Vec<u8> {
    let mut text = serde_json::to_vec(header).unwrap();
    while text.len() % 8 != 0 {
        text.push(b' ');
    }
    let mut out = (text.len() as u64).to_le_bytes().to_vec();
    out.extend(text);
    out.extend(data);
    out
}

fn mutate(base: &[u8], m: &Mutation) -> Vec<u8> {
    let mut bytes = base.to_vec();
    let (mut header, mut data) = split(base);
    let names: Vec<String> = header.keys().filter(|k| *k != "__metadata__").cloned().collect();
    let dtypes = ["F16", "BF16", "F32", "F64", "I64", "I32", "BOOL", "U8", "I8"];
    match m {
        Mutation::FlipBytes(v) => {
            for (i, b) in v {
                let i = i.index(bytes.len());
                bytes[i] ^= b.max(&1);
            }
            return bytes;
        }
        Mutation::Truncate(i) => {
            bytes.truncate(i.index(bytes.len()));
            return bytes;
        }
        Mutation::Splice(i, b) => {
            let i = i.index(bytes.len());
            bytes.splice(i..(i + b.len()).min(bytes.len()), b.iter().copied());
            return bytes;
        }
        Mutation::HeaderLength(n) => {
            bytes[..8].copy_from_slice(&n.to_le_bytes());
            return bytes;
        }
        Mutation::TensorField(i, field, v) => {
            let name = &names[i.index(names.len())];
            let entry = header.get_mut(name).unwrap().as_object_mut().unwrap();
            match field {
                0 => {
                    entry
                        .insert("dtype".into(), json!(dtypes[v.first().copied().unwrap_or(0) as usize % dtypes.len()]));
                }
                1 => {
                    entry.insert("shape".into(), json!(v));
                }
                _ => {
                    let offsets = entry["data_offsets"].as_array().unwrap().clone();
                    let shift = v.first().copied().unwrap_or(8);
                    let moved: Vec<Value> =
                        offsets.iter().map(|o| json!(o.as_u64().unwrap().wrapping_add(shift))).collect();
                    entry.insert("data_offsets".into(), Value::Array(moved));
                }
            }
        }
        Mutation::DropTensor(i) => {
            header.remove(&names[i.index(names.len())]);
        }
        Mutation::RenameTensor(i, to) => {
            let name = names[i.index(names.len())].clone();
            let v = header.remove(&name).unwrap();
            header.insert(to.clone(), v);
        }
        Mutation::Metadata(edits) => {
            let meta = header["__metadata__"]["tch_amp"].as_str().unwrap().to_string();
            let mut meta: Value = serde_json::from_str(&meta).unwrap();
            for (i, value) in edits {
                let mut paths = vec![];
                leaves(&meta, vec![], &mut paths);
                let path = &paths[i.index(paths.len())];
                if let Some(slot) = at(&mut meta, path) {
                    *slot = value.clone();
                }
            }
            header["__metadata__"]["tch_amp"] = json!(meta.to_string());
        }
        Mutation::MetadataDrop(i) => {
            let meta = header["__metadata__"]["tch_amp"].as_str().unwrap().to_string();
            let mut meta: Value = serde_json::from_str(&meta).unwrap();
            let mut paths = vec![];
            leaves(&meta, vec![], &mut paths);
            let path = &paths[i.index(paths.len())];
            let (last, parent) = path.split_last().unwrap();
            match at(&mut meta, parent) {
                Some(Value::Object(m)) => {
                    m.remove(last);
                }
                Some(Value::Array(a)) => {
                    let k: usize = last.parse().unwrap();
                    if k < a.len() {
                        a.remove(k);
                    }
                }
                _ => {}
            }
            header["__metadata__"]["tch_amp"] = json!(meta.to_string());
        }
        Mutation::Data(i, kind) => {
            // Overwrite 4 bytes with an fp32 inf/NaN, an fp16 inf/NaN pair, or zeros.
            let at = i.index(data.len().saturating_sub(4).max(1));
            let pattern: [u8; 4] = match kind {
                0 => f32::NAN.to_le_bytes(),
                1 => f32::INFINITY.to_le_bytes(),
                2 => [0x00, 0x7c, 0x00, 0x7e],
                _ => [0xff; 4],
            };
            for (k, b) in pattern.iter().enumerate() {
                if let Some(x) = data.get_mut(at + k) {
                    *x = *b;
                }
            }
        }
    }
    join(&header, &data)
}

/// 20,000 mutated checkpoints of two setups (Adam with amsgrad over everything; SGD with
/// momentum plus Adam over two parameter sets; both O2, two losses, hysteresis 2).
#[test]
fn fuzz_checkpoint_loader() {
    let dir = tempfile::tempdir().unwrap();
    let mut bases = vec![];
    let targets = RefCell::new(vec![]);
    for sgd in [false, true] {
        let mut c = ckpt_setup(sgd);
        for s in 0..3 {
            c.step(s);
        }
        let path = dir.path().join(format!("base-{sgd}.safetensors"));
        c.save(&path);
        bases.push(std::fs::read(&path).unwrap());
        targets.borrow_mut().push(ckpt_setup(sgd));
    }
    let path = dir.path().join("case.safetensors");
    let again = dir.path().join("again.safetensors");
    let (accepted, rejected) = (Cell::new(0u32), Cell::new(0u32));
    let mut r = runner(10_000, 62);
    r.run(&(any::<bool>(), mutation()), |(which, m)| {
        let which = usize::from(which);
        let bytes = mutate(&bases[which], &m);
        std::fs::write(&path, &bytes).unwrap();
        let mut targets = targets.borrow_mut();
        let t = &mut targets[which];
        let before = ckpt_snapshot(t);
        match t.load(&path) {
            Ok(()) => {
                accepted.set(accepted.get() + 1);
                // Applied exactly: saved again, the same tensors and the same metadata.
                t.save(&again);
                let (want_t, mut want_m) = contents(&bytes);
                // An absent hysteresis counter means the configured one (2), which a save writes.
                if let Some(Value::Object(amp)) = want_m.get_mut("amp") {
                    for state in amp.values_mut() {
                        if let Value::Object(st) = state {
                            // null is serde's None: absent.
                            st.retain(|_, v| !v.is_null());
                            st.entry("hysteresis_left").or_insert(json!(2));
                        }
                    }
                }
                let (got_t, got_m) = contents(&std::fs::read(&again).unwrap());
                prop_assert!(want_t == got_t, "{m:?}: the loaded tensors differ from the file's");
                prop_assert!(json_eq(&want_m, &got_m), "{m:?}: metadata {want_m} loaded as {got_m}");
                t.step(7);
            }
            // PoisonedState: a mutated second moment below zero, refused before anything applies.
            Err(
                AmpError::State(StateError::StateMismatch { .. })
                | AmpError::Io { .. }
                | AmpError::State(StateError::PoisonedState { .. }),
            ) => {
                rejected.set(rejected.get() + 1);
                prop_assert!(same_snapshot(&ckpt_snapshot(t), &before), "{m:?}: a failed load changed the state");
            }
            Err(other) => return Err(TestCaseError::fail(format!("{m:?}: untyped error {other:?}"))),
        }
        Ok(())
    })
    .unwrap();
    let (accepted, rejected) = (accepted.get(), rejected.get());
    eprintln!("fuzz checkpoints: 10000 mutated files, {accepted} accepted (re-saved identically), {rejected} rejected");
    assert!(accepted > 100 && rejected > 5000, "{accepted} / {rejected}");
}

// ---------------------------------------------------------------------------------------
// Cast files.

fn op_name() -> impl Strategy<Value = String> {
    prop_oneof![
        Just("mm".to_string()),
        Just("exp".to_string()),
        Just("softmax.int".to_string()),
        Just("pow.Tensor_Scalar".to_string()),
        Just("mm.default".to_string()),
        Just("add".to_string()),
        Just("sigmoid".to_string()),
        Just("no_such_op".to_string()),
        Just("exp.nope".to_string()),
        Just("aten::mm".to_string()),
        Just("mm.out".to_string()),
        Just(String::new()),
        Just(" mm".to_string()),
        Just("mm\u{0}".to_string()),
        Just(".".to_string()),
        Just("a.b.c".to_string()),
        "[a-z_]{1,12}(\\.[A-Za-z_]{1,10})?",
        ".{0,10}",
    ]
}

fn toml_value() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => prop::collection::vec(op_name(), 0..4).prop_map(|v| toml::Value::Array(v.into_iter().map(toml::Value::String).collect()).to_string()),
        1 => Just("1".to_string()),
        1 => Just("\"mm\"".to_string()),
        1 => Just("{ a = 1 }".to_string()),
        1 => Just("[1, 2]".to_string()),
    ]
}

fn user_casts_text() -> impl Strategy<Value = String> {
    let key =
        prop_oneof![Just("half"), Just("float"), Just("promote"), Just("banned"), Just("halff"), Just("low_precision")];
    let structured = prop::collection::vec((key, toml_value()), 0..4)
        .prop_map(|v| v.into_iter().map(|(k, val)| format!("{k} = {val}\n")).collect::<String>());
    prop_oneof![4 => structured, 1 => ".{0,60}", 1 => "[a-z\\[\\]=\" ,\\n.]{0,60}"]
}

fn policy_text() -> impl Strategy<Value = String> {
    let list =
        prop_oneof![Just("low_precision"), Just("fp32"), Just("promote"), Just("banned"), Just("half"), Just("nope")];
    let section = prop_oneof![Just("all"), Just("cpu"), Just("cuda"), Just("user"), Just("gpu")];
    let body = prop::collection::vec((list, toml_value()), 0..3);
    let structured =
        (prop::option::of(".{0,8}"), prop::collection::vec((section, body), 0..4)).prop_map(|(name, s)| {
            let mut text = name.map(|n| format!("name = {}\n", toml::Value::String(n))).unwrap_or_default();
            for (sec, body) in s {
                text.push_str(&format!("[{sec}]\n"));
                for (k, v) in body {
                    text.push_str(&format!("{k} = {v}\n"));
                }
            }
            text
        });
    prop_oneof![4 => structured, 1 => ".{0,60}"]
}

/// 40,000 cast files: 30,000 user-cast texts (add_user_casts_toml) and 10,000 policies
/// (from_toml_str), generated and mutated (a valid text with random bytes changed).
#[test]
fn fuzz_cast_files() {
    let valid = CastPolicy::apex().to_toml_string().unwrap();
    let policy = RefCell::new(CastPolicy::apex());
    let (accepted, rejected, installed) = (Cell::new(0u32), Cell::new(0u32), Cell::new(0u32));
    let mut r = runner(45_000, 63);
    r.run(&user_casts_text(), |text| {
        let mut policy = policy.borrow_mut();
        let before = policy.clone();
        match policy.add_user_casts_toml(&text) {
            Ok(()) => {
                accepted.set(accepted.get() + 1);
                prop_assert!(policy.validate().is_ok(), "{text:?}: accepted but does not validate");
                if accepted.get() % 500 == 1 {
                    // The next steps: install, activate, run a cast op.
                    let handle =
                        tch_amp::cast::install_policy(policy.clone(), tch_amp::cast::CastSettings::default()).unwrap();
                    let _g = handle.activate(Device::Cpu).unwrap();
                    let a = Tensor::ones([2, 2], (Kind::Float, Device::Cpu));
                    let _ = a.mm(&a).exp().softmax(-1, Kind::Float);
                    installed.set(installed.get() + 1);
                }
                if policy.user.half.len() + policy.user.float.len() + policy.user.promote.len() > 64 {
                    *policy = CastPolicy::apex();
                }
            }
            Err(AmpError::Config(ConfigError::Parse { .. }) | AmpError::Config(ConfigError::UnknownOp { .. })) => {
                rejected.set(rejected.get() + 1);
                prop_assert!(*policy == before, "{text:?}: a failed load changed the policy");
            }
            Err(other) => return Err(TestCaseError::fail(format!("{text:?}: untyped error {other:?}"))),
        }
        Ok(())
    })
    .unwrap();
    let mutated = (any::<bool>(), prop::collection::vec((any::<prop::sample::Index>(), any::<char>()), 1..4));
    let mut r = runner(15_000, 64);
    let (p_ok, p_err) = (Cell::new(0u32), Cell::new(0u32));
    r.run(
        &prop_oneof![policy_text().prop_map(|t| (t, vec![])), mutated.prop_map(|(_, e)| (String::new(), e))],
        |(text, edits)| {
            let text = if edits.is_empty() {
                text
            } else {
                let mut chars: Vec<char> = valid.chars().collect();
                for (i, c) in edits {
                    let i = i.index(chars.len());
                    chars[i] = c;
                }
                chars.into_iter().collect()
            };
            match CastPolicy::from_toml_str(&text) {
                Ok(p) => {
                    p_ok.set(p_ok.get() + 1);
                    prop_assert!(p.resolve(Device::Cpu).is_ok());
                }
                Err(AmpError::Config(ConfigError::Parse { .. }) | AmpError::Config(ConfigError::UnknownOp { .. })) => {
                    p_err.set(p_err.get() + 1)
                }
                Err(other) => return Err(TestCaseError::fail(format!("{text:?}: untyped error {other:?}"))),
            }
            Ok(())
        },
    )
    .unwrap();
    let (accepted, rejected, installed, p_ok, p_err) =
        (accepted.get(), rejected.get(), installed.get(), p_ok.get(), p_err.get());
    eprintln!(
        "fuzz cast files: 45000 user casts ({accepted} accepted, {installed} installed and run, {rejected} rejected), \
         15000 policies ({p_ok} accepted, {p_err} rejected)"
    );
    assert!(accepted > 1000 && rejected > 1000 && p_ok > 100 && p_err > 1000);
}
