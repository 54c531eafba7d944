//! The sharded optimizer (ZeRO stage 1, torch's `ZeroRedundancyOptimizer`) on 2 and 4 processes
//! (Gloo, 127.0.0.1), against its unsharded twin on the same ranks: every rank runs two models
//! side by side, each wrapped in DDP over the same group with the same seeds and batches, one
//! stepped by an unsharded optimizer and one by a sharded one. DDP gives both the same averaged
//! gradients, the shard owners update their parameters as the unsharded optimizer does, the
//! broadcast copies bits, and the gradient norms are reduced from the same per-parameter norms
//! in the same order: so weights, masters, optimizer state, clip norms, loss scales and skip
//! decisions are compared bit for bit, step by step, at O0 and O2 (Apex's path, torch's Adam and
//! Apex's FusedLAMB) and under torch.amp (autocast + GradScaler), with an inf in one rank's batch
//! that every rank skips. The unsharded DDP run itself equals one process within the bounds of
//! tests/distributed/ddp.rs.
//!
//! Also: a consolidated checkpoint (tch-amp's and torch's formats) equals the unsharded one byte
//! for byte, torch's `ZeroRedundancyOptimizer` loads the torch file, and it resumes bit for bit
//! in a sharded run of another world size; a killed rank ends a sharded step with a typed peer
//! failure within the timeout; the memory each rank holds for masters and Adam's state.
use std::time::{Duration, Instant};

use tch::nn::{self, ModuleT, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::distributed::{
    load_checkpoint_on_all, save_checkpoint_on_rank0, DdpOptions, DistError, DistributedDataParallel, InitOptions,
    ProcessGroup,
};
use tch_amp::torch_amp::GradScalerOptions;
use tch_amp::AmpModel;
use tch_amp::{Amp, AmpConfig, AmpOptimizer, Autocast, CpuKernels, FusedLamb, GradScaler, OptLevel, OptimizerConfig};

use crate::support::{assert_same_on_all_ranks, free_port, ranks, torch_net, two_ranks, Side, TIMEOUT};

const B: i64 = 4;
const LR: f64 = 1e-3;

/// torch's `named_parameters()` order of [`net`].
const TORCH_ORDER: [&str; 6] = ["0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"];

/// Rank `rank`'s rows of step `step`'s global batch (`world * B` rows, the same on every rank).
fn batch(step: usize, rank: usize, world: usize) -> (Tensor, Tensor) {
    tch::manual_seed(1000 + step as i64);
    let x = Tensor::randn([world as i64 * B, 8], (Kind::Float, Device::Cpu));
    let y = Tensor::randn([world as i64 * B, 4], (Kind::Float, Device::Cpu));
    (x.narrow(0, rank as i64 * B, B).copy(), y.narrow(0, rank as i64 * B, B).copy())
}

fn adam() -> OptimizerConfig {
    nn::Adam::default().into()
}

/// Apex's options at `level`, the dynamic scale starting at 2^13 (2^16 overflows this model's
/// first fp16 gradients).
fn config(level: OptLevel) -> AmpConfig {
    AmpConfig::new(level).max_loss_scale(8192.0).verbosity(0)
}

/// One training run: a model in DDP, its optimizer and its scaler (an `Amp` for Apex's path, a
/// GradScaler for torch.amp's).
struct Run<M> {
    vs: VarStore,
    ddp: DistributedDataParallel<M>,
    opt: AmpOptimizer,
    amp: Option<Amp>,
    scaler: Option<GradScaler>,
}

/// What one step did.
#[derive(Debug, Clone, Copy)]
struct StepOut {
    stepped: bool,
    norm: f64,
    scale: f64,
}

impl StepOut {
    fn assert_same(&self, other: &StepOut, what: &str) {
        assert_eq!(self.stepped, other.stepped, "{what}: stepped");
        assert_eq!(self.scale.to_bits(), other.scale.to_bits(), "{what}: loss scale");
        let same_norm = self.norm.to_bits() == other.norm.to_bits() || (self.norm.is_nan() && other.norm.is_nan());
        assert!(same_norm, "{what}: clip norm {} vs {}", self.norm, other.norm);
    }
}

/// Apex's path at `level`: `Amp`, cast model, the optimizer (sharded over `pg` when asked), DDP.
fn apex_run(
    pg: &ProcessGroup,
    level: OptLevel,
    cfg: OptimizerConfig,
    sharded: bool,
    seed: i64,
) -> Run<AmpModel<nn::SequentialT>> {
    let vs = VarStore::new(Device::Cpu);
    tch::manual_seed(seed);
    let net = torch_net(&vs);
    let amp = Amp::new(&config(level)).unwrap();
    let model = amp.cast_model(&vs, net).unwrap();
    let mut opt = if sharded {
        amp.sharded_optimizer(pg, &vs, cfg, LR, &[]).unwrap()
    } else {
        amp.optimizer(&vs, cfg, LR).unwrap()
    };
    let ddp = DistributedDataParallel::new(pg, &vs, model, &mut [&mut opt], DdpOptions::default()).unwrap();
    Run { vs, ddp, opt, amp: Some(amp), scaler: None }
}

/// torch.amp's path: fp32 model, the plain optimizer (sharded when asked), DDP, a GradScaler.
fn torch_amp_run(pg: &ProcessGroup, cfg: OptimizerConfig, sharded: bool, seed: i64) -> Run<nn::SequentialT> {
    let vs = VarStore::new(Device::Cpu);
    tch::manual_seed(seed);
    let net = torch_net(&vs);
    let mut opt = if sharded {
        AmpOptimizer::sharded(pg, &vs, cfg, LR, &[]).unwrap()
    } else {
        AmpOptimizer::new(&vs, cfg, LR, &[]).unwrap()
    };
    let ddp = DistributedDataParallel::new(pg, &vs, net, &mut [&mut opt], DdpOptions::default()).unwrap();
    let scaler = GradScaler::with_options(Device::Cpu, GradScalerOptions::default().growth_interval(2)).unwrap();
    Run { vs, ddp, opt, amp: None, scaler: Some(scaler) }
}

impl<M: ModuleT> Run<M> {
    /// zero_grad, forward, the scaled backward, a clip to norm 1, step.
    fn step(&mut self, x: &Tensor, y: &Tensor) -> StepOut {
        self.opt.zero_grad().unwrap();
        let ddp = &self.ddp;
        if let Some(amp) = self.amp.as_mut() {
            let loss = ddp.forward_t(x, true).mse_loss(y, tch::Reduction::Mean);
            amp.scale_loss(&loss, &mut [&mut self.opt], |s| s.backward()).unwrap();
            let norm = self.opt.clip_grad_norm(1.0, 2.0).unwrap();
            let stepped = self.opt.step().unwrap().stepped();
            return StepOut { stepped, norm, scale: amp.loss_scale(0).unwrap() };
        }
        let scaler = self.scaler.as_mut().expect("a scaler");
        let loss = Autocast::new(Device::Cpu)
            .cpu_kernels(CpuKernels::Native)
            .run(|| ddp.forward_t(x, true).mse_loss(y, tch::Reduction::Mean))
            .unwrap();
        scaler.scale(&loss).unwrap().backward();
        scaler.unscale_(&self.opt).unwrap();
        let norm = self.opt.clip_grad_norm(1.0, 2.0).unwrap();
        let stepped = scaler.step(&mut self.opt).unwrap().stepped();
        scaler.update().unwrap();
        StepOut { stepped, norm, scale: scaler.get_scale() }
    }
}

/// The unsharded run `a` and the sharded run `b` hold the same bits: every variable, the masters
/// and optimizer state of `b`'s shard; `b`'s variables are the same on every rank.
fn assert_twins<M, N>(pg: &ProcessGroup, a: &Run<M>, b: &Run<N>, what: &str) {
    let (va, vb) = (a.vs.variables(), b.vs.variables());
    for name in TORCH_ORDER {
        assert!(va[name].equal(&vb[name]), "{what}: {name} differs from the unsharded run");
        assert_same_on_all_ranks(pg, &vb[name], &format!("{what}: {name}"));
    }
    let owned: Vec<bool> = b.opt.param_ranks().iter().map(|&r| r == pg.rank()).collect();
    let a_masters: Vec<Tensor> =
        a.opt.master_params().into_iter().zip(&owned).filter(|(_, o)| **o).map(|(t, _)| t).collect();
    let b_masters = b.opt.master_params();
    assert_eq!(a_masters.len(), b_masters.len(), "{what}: the shard's parameters");
    for (x, y) in a_masters.iter().zip(&b_masters) {
        assert!(x.equal(y), "{what}: a master of the shard differs");
    }
    let (ra, rb) = (a.opt.to_record(), b.opt.to_record());
    for ((pa, pb), own) in ra.params.iter().zip(&rb.params).zip(&owned) {
        if *own {
            assert_eq!(pa.step, pb.step, "{what}: {} step", pa.name);
            assert_eq!(pa.buffers.keys().collect::<Vec<_>>(), pb.buffers.keys().collect::<Vec<_>>());
            for (k, t) in &pa.buffers {
                assert!(t.equal(&pb.buffers[k]), "{what}: {} {k}", pa.name);
            }
        } else {
            assert!(pb.buffers.is_empty() && pb.master.is_none(), "{what}: {} is another rank's", pa.name);
        }
    }
}

/// `steps` steps of both runs on `pg`, compared after each; an inf in rank 1's batch at
/// `inf_step`. Returns the step outcomes.
fn twin_steps<M: ModuleT, N: ModuleT>(
    pg: &ProcessGroup,
    a: &mut Run<M>,
    b: &mut Run<N>,
    steps: std::ops::Range<usize>,
    inf_step: Option<usize>,
) -> Vec<StepOut> {
    let (rank, world) = (pg.rank(), pg.world_size());
    steps
        .map(|step| {
            let (x, y) = batch(step, rank, world);
            if rank == 1 && inf_step == Some(step) {
                let _ = x.get(0).get(0).fill_(f64::INFINITY);
            }
            let out_a = a.step(&x, &y);
            let out_b = b.step(&x, &y);
            let what = format!("rank {rank} of {world}, step {step}");
            out_a.assert_same(&out_b, &what);
            assert_twins(pg, a, b, &what);
            let norm = if out_b.norm.is_nan() { -1.0 } else { out_b.norm };
            let scalars = Tensor::from_slice(&[out_b.scale, norm, f64::from(u8::from(out_b.stepped))]);
            assert_same_on_all_ranks(pg, &scalars, &format!("{what}: scale, norm, stepped"));
            out_b
        })
        .collect()
}

/// Apex's path at `level` with `cfg`: sharded equals unsharded, an inf on rank 1 at step 2
/// skips the step on every rank.
fn apex_twins(side: &mut Side, level: OptLevel, cfg: OptimizerConfig) {
    let pg = side.group();
    let seed = 1 + pg.rank() as i64; // differently seeded ranks: DDP's broadcast makes them equal
    let mut a = apex_run(&pg, level, cfg, false, seed);
    let mut b = apex_run(&pg, level, cfg, true, seed);
    assert_twins(&pg, &a, &b, "after DDP's broadcast");
    // O0's static scale of 1 does not check (as in Apex: an inf would reach the weights).
    let dynamic = level != OptLevel::O0;
    let outs = twin_steps(&pg, &mut a, &mut b, 0..5, dynamic.then_some(2));
    let stepped: Vec<bool> = outs.iter().map(|o| o.stepped).collect();
    if dynamic {
        assert_eq!(stepped, [true, true, false, true, true]);
        assert_eq!(outs[2].scale, outs[1].scale / 2.0, "the skip halves the scale on every rank");
    } else {
        assert_eq!(stepped, [true; 5]);
    }
}

#[test]
fn sharded_adam_equals_unsharded_o2_two_ranks() {
    two_ranks(concat!(module_path!(), "::sharded_adam_equals_unsharded_o2_two_ranks"), |side| {
        apex_twins(side, OptLevel::O2, adam())
    });
}

#[test]
fn sharded_adam_equals_unsharded_o2_four_ranks() {
    ranks(4, concat!(module_path!(), "::sharded_adam_equals_unsharded_o2_four_ranks"), |side| {
        apex_twins(side, OptLevel::O2, adam())
    });
}

#[test]
fn sharded_adam_equals_unsharded_o0_and_o1() {
    two_ranks(concat!(module_path!(), "::sharded_adam_equals_unsharded_o0_and_o1"), |side| {
        apex_twins(side, OptLevel::O0, adam());
        apex_twins(side, OptLevel::O1, adam());
    });
}

/// Apex's DistributedFusedLAMB's place: FusedLAMB's global gradient norm is reduced over the
/// ranks as the clip's is.
#[test]
fn sharded_fused_lamb_equals_unsharded_o2() {
    two_ranks(concat!(module_path!(), "::sharded_fused_lamb_equals_unsharded_o2"), |side| {
        apex_twins(side, OptLevel::O2, FusedLamb::default().into())
    });
}

/// torch.amp's recipe (autocast bf16, GradScaler, unscale_ then clip) over the sharded plain
/// optimizer: each rank checks its shard, the ranks agree, all skip the step with the inf.
#[test]
fn sharded_adam_under_grad_scaler_equals_unsharded() {
    ranks(4, concat!(module_path!(), "::sharded_adam_under_grad_scaler_equals_unsharded"), |side| {
        let pg = side.group();
        let seed = 1 + pg.rank() as i64;
        let mut a = torch_amp_run(&pg, adam(), false, seed);
        let mut b = torch_amp_run(&pg, adam(), true, seed);
        let outs = twin_steps(&pg, &mut a, &mut b, 0..5, Some(2));
        assert_eq!(outs.iter().map(|o| o.stepped).collect::<Vec<_>>(), [true, true, false, true, true]);
    });
}

/// The partition is torch's: largest first, each to the rank with the fewest elements so far.
#[test]
fn partition_is_torchs_greedy_by_size() {
    ranks(4, concat!(module_path!(), "::partition_is_torchs_greedy_by_size"), |side| {
        let pg = side.group();
        let b = apex_run(&pg, OptLevel::O2, adam(), true, 1);
        let names = b.opt.param_names();
        let ranks = b.opt.param_ranks();
        let of = |n: &str| ranks[names.iter().position(|x| *x == n).unwrap()];
        // Sizes 512 (2.w), 256 (0.w), 64 (4.w), 32 (0.b), 16 (2.b), 4 (4.b) over 4 ranks.
        assert_eq!(
            TORCH_ORDER.map(of),
            [1, 3, 0, 3, 2, 3],
            "2.w 512 -> rank 0, 0.w 256 -> 1, 4.w 64 -> 2, 0.b 32 -> 3, then 2.b 16 and 4.b 4 -> 3 (48 < 64)"
        );
        // Only this rank's fp16 parameters got an fp32 master.
        assert_eq!(b.opt.master_params().len(), ranks.iter().filter(|&&r| r == pg.rank()).count());
    });
}

/// Four ranks train sharded, rank 0 writes the consolidated checkpoint (tch-amp's, and after
/// `consolidate_state_dict(0)` torch's): both equal the unsharded run's files byte for byte, and
/// torch's ZeroRedundancyOptimizer loads the torch file. Then ranks 0 and 1 form a group of two,
/// load the checkpoint into a sharded optimizer of that size (another partition) and an unsharded
/// twin, and train on: bit for bit the same.
#[test]
fn consolidated_checkpoint_resumes_in_another_world_size() {
    ranks(4, concat!(module_path!(), "::consolidated_checkpoint_resumes_in_another_world_size"), |side| {
        let pg = side.group();
        let rank = pg.rank();
        let seed = 1 + rank as i64;
        let mut a = apex_run(&pg, OptLevel::O2, adam(), false, seed);
        let mut b = apex_run(&pg, OptLevel::O2, adam(), true, seed);
        twin_steps(&pg, &mut a, &mut b, 0..3, None);
        let dir = side.dir.clone();
        let (plain, zero) = (dir.join("plain.safetensors"), dir.join("zero.safetensors"));
        save_checkpoint_on_rank0(&pg, &plain, &a.vs, &[&a.opt], a.amp.as_ref().unwrap()).unwrap();
        save_checkpoint_on_rank0(&pg, &zero, &b.vs, &[&b.opt], b.amp.as_ref().unwrap()).unwrap();
        // torch's recipe: consolidate on every rank, save on rank 0.
        assert!(b.opt.consolidated_record().is_err(), "not consolidated yet");
        b.opt.consolidate_state_dict(0).unwrap();
        assert_eq!(b.opt.consolidated_record().is_ok(), rank == 0);
        if rank == 0 {
            let options = tch_amp::torch_checkpoint::TorchSaveOptions::new();
            tch_amp::save_torch_checkpoint(dir.join("plain.pt"), &a.vs, &[&a.opt], a.amp.as_ref().unwrap(), &options)
                .unwrap();
            tch_amp::save_torch_checkpoint(dir.join("zero.pt"), &b.vs, &[&b.opt], b.amp.as_ref().unwrap(), &options)
                .unwrap();
            let read = |p: &str| std::fs::read(dir.join(p)).unwrap();
            assert!(read("plain.safetensors") == read("zero.safetensors"), "tch-amp checkpoints differ");
            assert!(read("plain.pt") == read("zero.pt"), "torch checkpoints differ");
            crate::python::run_fixture("dist_zero_load.py", &[dir.join("zero.pt").to_str().unwrap()]);
        }
        // A step invalidates the gathered state.
        twin_steps(&pg, &mut a, &mut b, 3..4, None);
        assert!(b.opt.consolidated_record().is_err(), "stale after a step");
        // Ranks 0 and 1 resume in a group of two.
        let mut port = Tensor::from_slice(&[i64::from(if rank == 0 { free_port() } else { 0 })]);
        pg.broadcast_(&mut port, 0).unwrap();
        if rank < 2 {
            let port = u16::try_from(port.int64_value(&[0])).unwrap();
            let pg2 = ProcessGroup::init(&InitOptions::new(rank, 2, "127.0.0.1", port).timeout(TIMEOUT)).unwrap();
            let mut c = apex_run(&pg2, OptLevel::O2, adam(), false, 50 + rank as i64);
            let mut d = apex_run(&pg2, OptLevel::O2, adam(), true, 50 + rank as i64);
            assert_ne!(d.opt.param_ranks(), b.opt.param_ranks(), "another partition");
            load_checkpoint_on_all(&pg2, &zero, &c.vs, &mut [&mut c.opt], c.amp.as_mut().unwrap()).unwrap();
            load_checkpoint_on_all(&pg2, &zero, &d.vs, &mut [&mut d.opt], d.amp.as_mut().unwrap()).unwrap();
            assert_twins(&pg2, &c, &d, "loaded");
            twin_steps(&pg2, &mut c, &mut d, 3..6, Some(4));
            pg2.barrier().unwrap();
        }
        pg.barrier().unwrap();
    });
}

/// Rank 1 dies (SIGKILL) after a step; rank 0's next sharded step (no DDP: its own gradients)
/// waits for rank 1's shard and fails with a typed peer failure within the timeout.
#[test]
fn killed_peer_during_sharded_step() {
    two_ranks(concat!(module_path!(), "::killed_peer_during_sharded_step"), |side| {
        let pg = side.group();
        pg.set_timeout(Duration::from_secs(5)).unwrap();
        let vs = VarStore::new(Device::Cpu);
        tch::manual_seed(1);
        let model = torch_net(&vs);
        let mut opt = AmpOptimizer::sharded(&pg, &vs, adam(), LR, &[]).unwrap();
        let (x, y) = batch(0, 0, 1);
        let mut step = || -> Result<(), DistError> {
            opt.zero_grad()?;
            model.forward_t(&x, true).mse_loss(&y, tch::Reduction::Mean).backward();
            opt.step()?;
            Ok(())
        };
        step().unwrap();
        pg.barrier().unwrap();
        if side.rank == 1 {
            std::thread::sleep(Duration::from_secs(60)); // until killed
            return;
        }
        side.peers[0].kill();
        let start = Instant::now();
        let err = step().unwrap_err();
        assert!(err.is_peer_failure(), "{err:?}");
        assert!(start.elapsed() < Duration::from_secs(30));
        side.peers.clear();
    });
}

/// Bytes per parameter on each rank at O2 with Adam, between `scale_loss` and `step` of the
/// second step (the state exists, the master gradients are alive), for a model whose
/// parameters the partition splits evenly (four 32x32 linears: each rank of 2 or 4 owns
/// `1 / world` of the elements). Every rank holds the fp16 model (2 B per parameter) and, for
/// its shard only, the fp32 master (4), its gradient (4) and Adam's two moments (8): `2 + 16 /
/// world`, against 18 unsharded. Counted by `AmpOptimizer::memory`, asserted from first
/// principles.
fn memory_per_rank(side: &mut Side) {
    let pg = side.group();
    let world = pg.world_size();
    let vs = VarStore::new(Device::Cpu);
    tch::manual_seed(1);
    let p = vs.root();
    let mut seq = nn::seq_t();
    for i in 0..4 {
        seq = seq.add(nn::linear(&p / i, 32, 32, Default::default())).add_fn(|x| x.tanh());
    }
    let mut amp = Amp::new(&config(OptLevel::O2)).unwrap();
    let model = amp.cast_model(&vs, seq).unwrap();
    let mut opt = amp.sharded_optimizer(&pg, &vs, adam(), LR, &[]).unwrap();
    let ddp = DistributedDataParallel::new(&pg, &vs, model, &mut [&mut opt], DdpOptions::default()).unwrap();
    let total = 4 * (32 * 32 + 32);
    let owned: Vec<usize> = {
        let names = opt.param_names();
        let sizes: std::collections::BTreeMap<String, usize> =
            vs.variables().into_iter().map(|(n, t)| (n, t.numel())).collect();
        let mut per_rank = vec![0; world];
        for (n, r) in names.iter().zip(opt.param_ranks()) {
            per_rank[r] += sizes[*n];
        }
        per_rank
    };
    assert_eq!(owned, vec![total / world; world], "an even partition");
    let mut at_step = 0.0;
    for step in 0..2 {
        let (x, _) = batch(step, pg.rank(), world);
        let x = x.repeat([1, 4]);
        opt.zero_grad().unwrap();
        let loss = ddp.forward_t(&x, true).square().mean(Kind::Float);
        amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
        at_step = opt.memory().bytes_per_param();
        assert!(opt.step().unwrap().stepped());
    }
    let m = opt.memory();
    assert_eq!(m.params, total);
    let expected = 2.0 + 16.0 / world as f64;
    assert_eq!(at_step, expected, "rank {} of {world}: bytes per parameter at the step", pg.rank());
    assert_eq!(m.bytes_per_param(), 2.0 + 12.0 / world as f64, "after the step (gradients released)");
    assert_eq!((m.masters + m.optimizer_state) as f64 / total as f64, 12.0 / world as f64);
    assert_same_on_all_ranks(&pg, &Tensor::from_slice(&[at_step]), "bytes per parameter");
}

#[test]
fn memory_per_rank_two_ranks() {
    two_ranks(concat!(module_path!(), "::memory_per_rank_two_ranks"), memory_per_rank);
}

#[test]
fn memory_per_rank_four_ranks() {
    ranks(4, concat!(module_path!(), "::memory_per_rank_four_ranks"), memory_per_rank);
}
