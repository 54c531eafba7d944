//! A Rust rank and a Python rank in one process group: this test (rank 0, tch-amp's
//! DistributedDataParallel at O0) and `tests/fixtures/dist_python_rank.py` (rank 1, torch's
//! DistributedDataParallel and SGD, the venv's torch 2.13.0) train the same model on their halves
//! of each batch. The rendezvous keys, the DDP start-up collectives (parameter check, state
//! broadcast) and the Reducer's buckets are torch's on both sides, so they meet; after every step
//! both ranks hold the same averaged gradients and the same weights, bit for bit (tch-amp's SGD is
//! torch.optim.SGD's single-tensor algorithm op for op). torch's DDP divides by the world size before the
//! allreduce, Apex after it: the Rust rank sets `gradient_predivide_factor = 2` to divide where
//! torch does (with Apex's default the ranks' bucket contents would not add up).
//!
//! A third pair trains under torch's ZeroRedundancyOptimizer (`tests/fixtures/dist_zero_rank.py`)
//! and tch-amp's sharded optimizer: both ranks compute torch's partition, each updates its shard
//! (the Rust rank with tch-amp's Adam, the Python rank with torch's) and broadcasts it, and the
//! weights equal an unsharded torch.optim.Adam's on the Python side, bit for bit.
//!
//! The same pair also runs torch.amp's DDP recipe: the forward under CPU autocast (bf16) and a
//! GradScaler on each rank (tch-amp's on the Rust rank, torch's on the Python rank), with an inf
//! in the Python rank's batch at step 2 that the allreduce spreads: both ranks skip that step and
//! back off, and gradients, weights and scales stay bit-identical.

use std::process::Command;

use tch::nn::{self, ModuleT, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::distributed::{DdpOptions, DistributedDataParallel, InitOptions, ProcessGroup};
use tch_amp::torch_amp::GradScalerOptions;
use tch_amp::Autocast;
use tch_amp::{initialize, AmpConfig, CpuKernels, GradScaler, OptLevel};

use crate::support::{free_port, global_rng_lock, torch_net, Peer, PEER_DEADLINE, TIMEOUT};

const B: i64 = 8;
const STEPS: usize = 5;

fn python() -> Option<String> {
    std::env::var("TCH_AMP_PYTHON").ok()
}

/// The venv's Python, or a panic naming the remedy.
fn python_or_panic() -> String {
    python().unwrap_or_else(|| panic!("TCH_AMP_PYTHON is not set: run `make setup` (it writes .cargo/config.toml)"))
}

/// Runs `tests/fixtures/<script> args..` with the venv's Python and asserts it exits 0 within
/// the peer deadline.
pub fn run_fixture(script: &str, args: &[&str]) {
    let path = format!("{}/tests/fixtures/{script}", env!("CARGO_MANIFEST_DIR"));
    let mut run = Peer::spawn(Command::new(python_or_panic()).arg(path).args(args));
    run.expect_success(PEER_DEADLINE);
}

/// tch-amp's sharded Adam (rank 0) and torch's ZeroRedundancyOptimizer over Adam (rank 1, the
/// Python process) in one group: the same partition, the same weights, torch's unsharded Adam's.
#[test]
fn rust_rank_and_python_zero_redundancy_optimizer_train_together() {
    use tch_amp::AmpOptimizer;
    const ZERO_B: i64 = 4;
    let python = python_or_panic();
    let _rng = global_rng_lock();
    tch::set_num_threads(1);
    let port = free_port();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/dist_zero_rank.py");
    let mut peer = Peer::spawn(Command::new(python).arg(script).arg(port.to_string()).arg(STEPS.to_string()));
    let pg = ProcessGroup::init(&InitOptions::new(0, 2, "127.0.0.1", port).timeout(TIMEOUT)).expect("rendezvous");
    let vs = VarStore::new(Device::Cpu);
    tch::manual_seed(1);
    let net = torch_net(&vs);
    // torch.optim.Adam(lr=1e-3)'s defaults.
    let mut opt = AmpOptimizer::sharded(&pg, &vs, nn::Adam::default(), 1e-3, &[]).unwrap();
    let options = DdpOptions::default().bucket_cap_bytes(25 << 20).gradient_predivide_factor(2.0);
    let ddp = DistributedDataParallel::new(&pg, &vs, net, &mut [&mut opt], options).expect("DDP with the Python rank");
    let order = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"];
    let names = opt.param_names();
    let ranks = opt.param_ranks();
    let owners: Vec<i64> = order.iter().map(|n| ranks[names.iter().position(|x| x == n).unwrap()] as i64).collect();
    check(&pg, 0, "partition", std::iter::once(("owners", Tensor::from_slice(&owners))));
    assert_eq!(owners, [1, 1, 0, 1, 1, 1], "2.weight (512) to rank 0, the rest to rank 1");
    for step in 0..STEPS {
        tch::manual_seed(1000 + step as i64);
        let x = Tensor::randn([2 * ZERO_B, 8], (Kind::Float, Device::Cpu)).narrow(0, 0, ZERO_B);
        let y = Tensor::randn([2 * ZERO_B, 4], (Kind::Float, Device::Cpu)).narrow(0, 0, ZERO_B);
        opt.zero_grad().unwrap();
        ddp.forward_t(&x, true).mse_loss(&y, tch::Reduction::Mean).backward();
        let vars = vs.variables();
        check(&pg, step, "gradient", order.iter().map(|n| (*n, vars[*n].grad())));
        opt.step().unwrap();
        check(&pg, step, "weight", order.iter().map(|n| (*n, vars[*n].shallow_clone())));
    }
    pg.barrier().expect("the final barrier with the Python rank");
    peer.expect_success(PEER_DEADLINE);
}

/// Both ranks' copies of each tensor, compared bit for bit, NaNs equal where both hold one (the
/// Python rank checks too).
fn check<'a>(pg: &ProcessGroup, step: usize, what: &str, named: impl Iterator<Item = (&'a str, Tensor)>) {
    for (name, t) in named {
        let both = pg.all_gather(&t).expect("all_gather with the Python rank");
        let nan: Vec<Tensor> = both.iter().map(Tensor::isnan).collect();
        let same = nan[0].equal(&nan[1]) && both[0].masked_fill(&nan[0], 0.0).equal(&both[1].masked_fill(&nan[1], 0.0));
        let d = (&both[0] - &both[1]).abs().max().double_value(&[]);
        assert!(same, "step {step} {what} {name}: Python's differs by {d:e}");
    }
}

#[test]
fn rust_rank_and_python_rank_train_together() {
    train_with_python_rank(false);
}

#[test]
fn rust_rank_and_python_rank_train_together_under_autocast_and_grad_scaler() {
    train_with_python_rank(true);
}

/// The Rust rank of the pair; `amp_recipe`: torch.amp's recipe (autocast bf16 + GradScaler) on both.
fn train_with_python_rank(amp_recipe: bool) {
    let Some(python) = python() else {
        panic!("TCH_AMP_PYTHON is not set: run `make setup` (it writes .cargo/config.toml)");
    };
    let _rng = global_rng_lock();
    tch::set_num_threads(1);
    let port = free_port();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/dist_python_rank.py");
    let mode = if amp_recipe { "autocast" } else { "fp32" };
    let mut peer = Peer::spawn(Command::new(python).arg(script).arg(port.to_string()).arg(STEPS.to_string()).arg(mode));
    let pg = ProcessGroup::init(&InitOptions::new(0, 2, "127.0.0.1", port).timeout(TIMEOUT)).expect("rendezvous");
    let vs = VarStore::new(Device::Cpu);
    tch::manual_seed(1);
    let net = torch_net(&vs);
    let sgd = nn::Sgd { momentum: 0.9, dampening: 0.0, wd: 1e-4, nesterov: false };
    let (model, mut opt, mut amp) = initialize(&vs, net, sgd, 0.1, &AmpConfig::new(OptLevel::O0)).unwrap();
    // torch's DDP divides by the world size before the sum (Apex after it): the two ranks must
    // divide at the same place for their buckets to add up.
    let options = DdpOptions::default().bucket_cap_bytes(25 << 20).gradient_predivide_factor(2.0);
    let ddp =
        DistributedDataParallel::new(&pg, &vs, model, &mut [&mut opt], options).expect("DDP with the Python rank");
    // torch's named_parameters() order, which the Python rank gathers in.
    let order = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"];
    let mut scaler = GradScaler::with_options(Device::Cpu, GradScalerOptions::default().growth_interval(2)).unwrap();
    for step in 0..STEPS {
        tch::manual_seed(1000 + step as i64);
        let x = Tensor::randn([2 * B, 8], (Kind::Float, Device::Cpu)).narrow(0, 0, B);
        let y = Tensor::randn([2 * B, 4], (Kind::Float, Device::Cpu)).narrow(0, 0, B);
        opt.zero_grad().unwrap();
        let vars = vs.variables();
        if amp_recipe {
            let loss = Autocast::new(Device::Cpu)
                .cpu_kernels(CpuKernels::Native)
                .run(|| ddp.forward_t(&x, true).mse_loss(&y, tch::Reduction::Mean))
                .unwrap();
            scaler.scale(&loss).unwrap().backward();
            check(&pg, step, "gradient", order.iter().map(|n| (*n, vars[*n].grad())));
            // The Python rank's batch holds an inf at step 2; the allreduce brings it here.
            assert_eq!(scaler.step(&mut opt).unwrap().stepped(), step != 2, "step {step}");
            scaler.update().unwrap();
        } else {
            let loss = ddp.forward_t(&x, true).mse_loss(&y, tch::Reduction::Mean);
            amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
            check(&pg, step, "gradient", order.iter().map(|n| (*n, vars[*n].grad())));
            assert!(opt.step().unwrap().stepped());
        }
        check(&pg, step, "weight", order.iter().map(|n| (*n, vars[*n].shallow_clone())));
        if amp_recipe {
            let scale = scaler.get_scale() * Tensor::ones([1], (Kind::Float, Device::Cpu));
            check(&pg, step, "scale", std::iter::once(("scale", scale)));
        }
    }
    // The Python rank's barrier before it destroys its group.
    pg.barrier().expect("the final barrier with the Python rank");
    peer.expect_success(PEER_DEADLINE);
}
