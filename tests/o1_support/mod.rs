//! Shared helpers of the O1 test binaries (tests/o1_*.rs).
#![allow(dead_code)]
use std::sync::{Mutex, RwLock, RwLockReadGuard, RwLockWriteGuard};

use tch::{Device, Kind, Tensor};
use tch_amp::{install_policy, ActivePolicyGuard, CastPolicy, O1Settings, PolicyHandle};

/// Tests in one binary run on parallel threads. Installing and activating a policy is per
/// handle and per thread, so ordinary tests only share this lock; tests that assert the
/// process-wide install state (nothing installed, kernels gone) take it exclusively.
static ENGINE: RwLock<()> = RwLock::new(());

/// While ordinary tests run, one Apex install is kept alive, so that tch-amp's kernels are not
/// unregistered and registered again under other tests' running ops (libtorch does not
/// synchronize its dispatch tables with running ops).
static BASE: Mutex<Option<PolicyHandle>> = Mutex::new(None);

pub fn shared() -> RwLockReadGuard<'static, ()> {
    let guard = ENGINE.read().unwrap_or_else(|e| e.into_inner());
    let mut base = BASE.lock().unwrap_or_else(|e| e.into_inner());
    if base.is_none() {
        *base = Some(apex());
    }
    guard
}

pub fn exclusive() -> RwLockWriteGuard<'static, ()> {
    let guard = ENGINE.write().unwrap_or_else(|e| e.into_inner());
    BASE.lock().unwrap_or_else(|e| e.into_inner()).take();
    guard
}

pub fn apex() -> PolicyHandle {
    install_policy(CastPolicy::apex(), O1Settings::default()).unwrap()
}

pub fn apex_with(settings: O1Settings) -> PolicyHandle {
    install_policy(CastPolicy::apex(), settings).unwrap()
}

pub fn on_cpu(handle: &PolicyHandle) -> ActivePolicyGuard {
    handle.activate(Device::Cpu).unwrap()
}

pub fn randn(shape: &[i64], kind: Kind) -> Tensor {
    Tensor::randn(shape, (Kind::Float, Device::Cpu)).to_kind(kind)
}

pub fn leaf(shape: &[i64], kind: Kind) -> Tensor {
    randn(shape, kind).set_requires_grad(true)
}

pub fn to_vec(t: &Tensor) -> Vec<f32> {
    Vec::<f32>::try_from(t.to_kind(Kind::Float).flatten(0, -1)).unwrap()
}
