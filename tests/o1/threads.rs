//! The engine across threads: tch-amp's kernels are registered once per process and never
//! unregistered, so creating and dropping `Amp`s on some threads cannot disturb ops running on
//! others (libtorch does not synchronise dispatch-table changes with running ops; before
//! register-once, this stress crashed 2 runs in 10 with a null kernel in a plain thread).
use std::sync::{Arc, Barrier};
use std::thread;

use tch::nn::{self, Module, ModuleT};
use tch::{Device, Kind, Tensor};
use tch_amp::{Amp, AmpConfig, OptLevel};
use tch_amp::{Autocast, CpuKernels};

use crate::common::{batch, deterministic_init, same, Mlp};

/// One O1 forward/backward of the test MLP from a fixed start: (loss, fc1.weight's grad).
fn o1_step() -> (Tensor, Tensor) {
    let vs = nn::VarStore::new(Device::Cpu);
    let net = Mlp::new(&vs.root());
    deterministic_init(&vs);
    let amp = Amp::new(&AmpConfig::new(OptLevel::O1).verbosity(0)).unwrap();
    let (x, y) = batch(3, 8);
    let out = net.forward_t(&x, true);
    assert_eq!(out.kind(), Kind::Half, "O1 casts linear to fp16");
    let loss = out.mse_loss(&y, tch::Reduction::Mean);
    tch_amp::without_casts(|| loss.backward()).unwrap();
    drop(amp);
    (loss.detach(), vs.variables()["fc1.weight"].grad())
}

/// What a thread without tch-amp computes: libtorch's own CPU autocast (bf16) and plain ops.
fn plain_ops(linear: &nn::Linear, x: &Tensor) -> Vec<Tensor> {
    let autocast = {
        let _on = Autocast::new(Device::Cpu).dtype(Kind::BFloat16).cpu_kernels(CpuKernels::Native).enter().unwrap();
        let y = linear.forward(x);
        vec![y.shallow_clone(), y.softmax(-1, None::<Kind>), x.mm(&x.tr())]
    };
    let plain =
        vec![linear.forward(x), x.to_kind(Kind::Half).softmax(-1, None::<Kind>), (x * 3.0).exp().sum(Kind::Float)];
    autocast.into_iter().chain(plain).collect()
}

fn plain_fixture() -> (nn::VarStore, nn::Linear, Tensor) {
    let vs = nn::VarStore::new(Device::Cpu);
    let linear = nn::linear(vs.root(), 16, 8, Default::default());
    deterministic_init(&vs);
    let x = (Tensor::arange(64, (Kind::Float, Device::Cpu)) * 0.37).sin().reshape([4, 16]);
    (vs, linear, x)
}

fn assert_same(found: &[Tensor], expected: &[Tensor], what: &str) {
    assert_eq!(found.len(), expected.len());
    for (i, (f, e)) in found.iter().zip(expected).enumerate() {
        assert!(same(f, e), "{what}: result {i} differs ({:?} vs {:?})", f.kind(), e.kind());
    }
}

/// 8 threads each create an O1 `Amp` 200 times, run a forward/backward and drop it, while 2
/// threads run libtorch autocast and plain ops without tch-amp: no crash, and every result
/// equals its single-threaded reference, bit for bit.
#[test]
fn amps_created_and_dropped_on_many_threads_beside_plain_autocast() {
    let (ref_loss, ref_grad) = o1_step();
    let (_vs, linear, x) = plain_fixture();
    let ref_plain = plain_ops(&linear, &x);
    let (amp_threads, rounds, plain_threads, plain_rounds) = (8, 200, 2, 400);
    let mut handles = Vec::new();
    for _ in 0..amp_threads {
        let (ref_loss, ref_grad) = (ref_loss.copy(), ref_grad.copy());
        handles.push(thread::spawn(move || {
            for _ in 0..rounds {
                let (loss, grad) = o1_step();
                assert!(same(&loss, &ref_loss) && same(&grad, &ref_grad), "an O1 step differs from its reference");
            }
        }));
    }
    for _ in 0..plain_threads {
        let (vs, _, x) = plain_fixture();
        let linear_ws: Vec<Tensor> = ["weight", "bias"].iter().map(|n| vs.variables()[*n].copy()).collect();
        let expected: Vec<Tensor> = ref_plain.iter().map(Tensor::copy).collect();
        handles.push(thread::spawn(move || {
            // A store of its own on this thread, with the same values.
            let vs = nn::VarStore::new(Device::Cpu);
            let linear = nn::linear(vs.root(), 16, 8, Default::default());
            let _g = tch::no_grad_guard();
            linear.ws.shallow_clone().copy_(&linear_ws[0]);
            linear.bs.as_ref().unwrap().shallow_clone().copy_(&linear_ws[1]);
            drop(_g);
            for _ in 0..plain_rounds {
                assert_same(&plain_ops(&linear, &x), &expected, "a thread without tch-amp");
            }
        }));
    }
    for h in handles {
        h.join().expect("a thread panicked");
    }
}

/// While one thread has O1 active, another thread's ops (plain and under libtorch's own
/// autocast) are bit for bit what they are with no policy anywhere.
#[test]
fn an_active_policy_on_one_thread_leaves_other_threads_alone() {
    let (_vs, linear, x) = plain_fixture();
    let reference = plain_ops(&linear, &x);
    let started = Arc::new(Barrier::new(2));
    let done = Arc::new(Barrier::new(2));
    let (s, d) = (Arc::clone(&started), Arc::clone(&done));
    let o1 = thread::spawn(move || {
        let amp = Amp::new(&AmpConfig::new(OptLevel::O1).verbosity(0)).unwrap();
        assert!(amp.casts_active());
        s.wait();
        let (_vs, linear, x) = plain_fixture();
        // Here the same ops follow Apex's lists: linear fp16, softmax fp32.
        let y = linear.forward(&x);
        assert_eq!((y.kind(), y.softmax(-1, None::<Kind>).kind()), (Kind::Half, Kind::Float));
        d.wait();
        drop(amp);
    });
    started.wait();
    let during = plain_ops(&linear, &x);
    done.wait();
    o1.join().unwrap();
    assert_same(&during, &reference, "beside an active O1 policy");
    assert_eq!(during[0].kind(), Kind::BFloat16, "libtorch's CPU autocast casts linear to bf16");
}
