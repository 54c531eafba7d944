//! DistributedDataParallel on two processes (Gloo, 127.0.0.1) against one process on the
//! concatenated batch, under tch-amp at O0 and O2: same weights step by step, same loss
//! scales, same skip decisions, same (global) gradient norm.
//!
//! Tolerances. Two ranks with batch B average (g0 + g1) / 2 where each g is the gradient of a
//! mean over B rows; one process computes the gradient of the mean over 2B rows in one pass.
//! The sums are grouped differently, so results agree up to rounding, not bit for bit:
//! - O0 (fp32): a few fp32 ulps per step; after 4 SGD steps |Δw| < 1e-6 (measured 6e-8).
//! - O2: each rank's fp16 gradient is rounded to fp16, then the fp16 sum is rounded again, where
//!   one process rounds its 2B-row gradient once: up to ~2 fp16 ulps (2^-10 relative) per
//!   gradient element, carried into the fp32 masters by lr; the fp16 model may then round to a
//!   neighbouring fp16 value: |Δw| < 1e-3, two fp16 ulps of a weight below 1 (measured 2.4e-4,
//!   one ulp in [0.25, 0.5)).
//!
//! Between the two ranks nothing may differ: both apply the same averaged gradient, so their
//! weights, masters and scales are compared bit for bit.

use tch::nn::{self, ModuleT, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::distributed::{DdpOptions, DistributedDataParallel, ProcessGroup};
use tch_amp::{initialize, AmpConfig, AmpOptimizer, OptLevel, StepOutcome};

use crate::support::{assert_same_on_all_ranks, two_ranks, Side};

const B: i64 = 8;
const STEPS: usize = 4;

fn net(vs: &VarStore) -> impl ModuleT {
    let p = vs.root();
    nn::seq_t()
        .add(nn::linear(&p / "fc1", 8, 32, Default::default()))
        .add_fn(|x| x.relu())
        .add(nn::linear(&p / "fc2", 32, 16, Default::default()))
        .add_fn(|x| x.tanh())
        .add(nn::linear(&p / "fc3", 16, 4, Default::default()))
}

/// The global batch of a step: 2B rows, the same on every rank.
fn global_batch(step: usize) -> (Tensor, Tensor) {
    tch::manual_seed(1000 + step as i64);
    let x = Tensor::randn([2 * B, 8], (Kind::Float, Device::Cpu));
    let y = Tensor::randn([2 * B, 4], (Kind::Float, Device::Cpu));
    (x, y)
}

/// Apex's options at `level`, with the dynamic scale starting at 2^13 (not 2^16, which
/// overflows this model's first fp16 gradients in one process and in two alike).
fn config(level: OptLevel) -> AmpConfig {
    AmpConfig::new(level).max_loss_scale(8192.0)
}

fn sgd() -> nn::Sgd {
    nn::Sgd { momentum: 0.9, dampening: 0.0, wd: 1e-4, nesterov: false }
}

/// Variables of `vs` by sorted name, as f64 copies.
fn snapshot(vs: &VarStore) -> Vec<(String, Tensor)> {
    let vars = vs.variables();
    let mut names: Vec<_> = vars.keys().cloned().collect();
    names.sort();
    names.into_iter().map(|n| (n.clone(), vars[&n].to_kind(Kind::Double))).collect()
}

fn masters(opt: &AmpOptimizer) -> Vec<Tensor> {
    opt.master_params().iter().map(|t| t.to_kind(Kind::Double)).collect()
}

#[derive(Debug)]
struct StepRecord {
    weights: Vec<(String, Tensor)>,
    masters: Vec<Tensor>,
    loss_scale: f64,
    stepped: bool,
    norm: f64,
}

/// One process, the whole 2B batch each step.
fn reference(level: OptLevel, seed: i64) -> Vec<StepRecord> {
    let vs = VarStore::new(Device::Cpu);
    tch::manual_seed(seed);
    let model = net(&vs);
    let (model, mut opt, mut amp) = initialize(&vs, model, sgd(), 0.1, &config(level)).unwrap();
    (0..STEPS)
        .map(|step| {
            let (x, y) = global_batch(step);
            let loss = model.forward_t(&x, true).mse_loss(&y, tch::Reduction::Mean);
            opt.zero_grad().unwrap();
            amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
            let norm = opt.clip_grad_norm(0.5, 2.0).unwrap();
            let stepped = opt.step().unwrap().stepped();
            StepRecord {
                weights: snapshot(&vs),
                masters: masters(&opt),
                loss_scale: amp.loss_scale(0).unwrap(),
                stepped,
                norm,
            }
        })
        .collect()
}

/// Rank `pg.rank()` of two, rows [rank*B, (rank+1)*B) of each global batch, its own init seed;
/// `inject_inf`: (rank, step) whose input gets an inf.
fn ddp_run(
    pg: &ProcessGroup,
    level: OptLevel,
    options: DdpOptions,
    inject_inf: Option<(usize, usize)>,
) -> Vec<StepRecord> {
    let rank = pg.rank();
    let vs = VarStore::new(Device::Cpu);
    tch::manual_seed(1 + rank as i64); // differently seeded ranks: the broadcast makes them equal
    let model = net(&vs);
    let (model, mut opt, mut amp) = initialize(&vs, model, sgd(), 0.1, &config(level)).unwrap();
    let before = vs.variables()["fc1.weight"].to_kind(Kind::Double);
    let ddp = DistributedDataParallel::new(pg, &vs, model, &mut [&mut opt], options).unwrap();
    // Identical after the start broadcast, and rank 1 did change.
    for (name, w) in snapshot(&vs) {
        assert_same_on_all_ranks(pg, &w, &name);
    }
    for (i, m) in masters(&opt).iter().enumerate() {
        assert_same_on_all_ranks(pg, m, &format!("master {i}"));
    }
    let after = vs.variables()["fc1.weight"].to_kind(Kind::Double);
    assert_eq!(before.equal(&after), rank == 0, "rank {rank}: the broadcast must replace rank 1's init");
    (0..STEPS)
        .map(|step| {
            let (x, y) = global_batch(step);
            let x = x.narrow(0, rank as i64 * B, B);
            let y = y.narrow(0, rank as i64 * B, B);
            if inject_inf == Some((rank, step)) {
                let _ = x.get(0).get(0).fill_(f64::INFINITY);
            }
            let loss = ddp.forward_t(&x, true).mse_loss(&y, tch::Reduction::Mean);
            opt.zero_grad().unwrap();
            amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
            let norm = opt.clip_grad_norm(0.5, 2.0).unwrap();
            let stepped = match opt.step().unwrap() {
                StepOutcome::Stepped => true,
                StepOutcome::Skipped { .. } => false,
            };
            let rec = StepRecord {
                weights: snapshot(&vs),
                masters: masters(&opt),
                loss_scale: amp.loss_scale(0).unwrap(),
                stepped,
                norm,
            };
            for (name, w) in &rec.weights {
                assert_same_on_all_ranks(pg, w, &format!("step {step} {name}"));
            }
            for (i, m) in rec.masters.iter().enumerate() {
                assert_same_on_all_ranks(pg, m, &format!("step {step} master {i}"));
            }
            // NaN (a skipped step's norm) never compares equal: compare its bits' stand-in.
            let norm = if rec.norm.is_nan() { -1.0 } else { rec.norm };
            let scalars = Tensor::from_slice(&[rec.loss_scale, norm, f64::from(u8::from(stepped))]);
            assert_same_on_all_ranks(pg, &scalars, &format!("step {step} loss scale, norm, stepped"));
            rec
        })
        .collect()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

fn compare(level: OptLevel, got: &[StepRecord], want: &[StepRecord], tol: f64) -> f64 {
    let mut worst: f64 = 0.0;
    for (step, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.stepped, w.stepped, "{level:?} step {step}");
        assert_eq!(g.loss_scale, w.loss_scale, "{level:?} step {step}");
        assert!(
            (g.norm - w.norm).abs() <= 1e-3 * w.norm.max(1e-6),
            "{level:?} step {step}: norm {} vs {}",
            g.norm,
            w.norm
        );
        for ((name, a), (_, b)) in g.weights.iter().zip(&w.weights) {
            let d = max_diff(a, b);
            worst = worst.max(d);
            assert!(d <= tol, "{level:?} step {step} {name}: |Δ| = {d:e} > {tol:e}");
        }
        for (a, b) in g.masters.iter().zip(&w.masters) {
            let d = max_diff(a, b);
            worst = worst.max(d);
            assert!(d <= tol, "{level:?} step {step} master: |Δ| = {d:e} > {tol:e}");
        }
    }
    worst
}

#[test]
fn two_ranks_equal_one_process_on_the_concatenated_batch_o0() {
    two_ranks(
        concat!(module_path!(), "::two_ranks_equal_one_process_on_the_concatenated_batch_o0"),
        |side: &mut Side| {
            let pg = side.group();
            // Small buckets: several allreduces overlapping with backward after the first step.
            let got = ddp_run(&pg, OptLevel::O0, DdpOptions::default().message_size(200), None);
            let want = reference(OptLevel::O0, 1);
            let worst = compare(OptLevel::O0, &got, &want, 1e-6);
            eprintln!("O0: worst |Δ| vs one process = {worst:e}");
        },
    );
}

#[test]
fn two_ranks_equal_one_process_on_the_concatenated_batch_o2() {
    two_ranks(
        concat!(module_path!(), "::two_ranks_equal_one_process_on_the_concatenated_batch_o2"),
        |side: &mut Side| {
            let pg = side.group();
            let got = ddp_run(&pg, OptLevel::O2, DdpOptions::default(), None);
            let want = reference(OptLevel::O2, 1);
            assert!(got.iter().all(|r| r.stepped));
            let worst = compare(OptLevel::O2, &got, &want, 1e-3);
            eprintln!("O2: worst |Δ| vs one process = {worst:e}");
        },
    );
}

#[test]
fn inf_on_one_rank_skips_the_step_on_both() {
    two_ranks(concat!(module_path!(), "::inf_on_one_rank_skips_the_step_on_both"), |side: &mut Side| {
        let pg = side.group();
        let got = ddp_run(&pg, OptLevel::O2, DdpOptions::default(), Some((1, 1)));
        // Step 1 skipped on both ranks (checked equal across ranks inside ddp_run), scale halved.
        assert_eq!(got.iter().map(|r| r.stepped).collect::<Vec<_>>(), vec![true, false, true, true]);
        assert_eq!(got.iter().map(|r| r.loss_scale).collect::<Vec<_>>(), vec![8192.0, 4096.0, 4096.0, 4096.0]);
        for ((n, a), (_, b)) in got[0].weights.iter().zip(&got[1].weights) {
            assert!(a.equal(b), "{n} changed in a skipped step");
        }
    });
}

/// The model's gradients after one backward of rank `pg.rank()`'s half of batch 0 (O0: the
/// loss goes straight to backward, the averaged gradients stay in `.grad`).
fn ddp_grads(pg: &ProcessGroup, options: DdpOptions, micro_batches: usize) -> Vec<Tensor> {
    let rank = pg.rank() as i64;
    let vs = VarStore::new(Device::Cpu);
    tch::manual_seed(1);
    let model = net(&vs);
    let (model, mut opt, mut amp) = initialize(&vs, model, sgd(), 0.1, &config(OptLevel::O0)).unwrap();
    let ddp = DistributedDataParallel::new(pg, &vs, model, &mut [&mut opt], options).unwrap();
    let (x, y) = global_batch(0);
    opt.zero_grad().unwrap();
    // Micro-batch m of rank r: rows of the global batch interleaved so that one process's
    // micro-batch m is the union over ranks of theirs.
    let mb = B / micro_batches as i64;
    for m in 0..micro_batches as i64 {
        let rows =
            Tensor::arange_start(m * 2 * mb + rank * mb, m * 2 * mb + (rank + 1) * mb, (Kind::Int64, Device::Cpu));
        let last = m + 1 == micro_batches as i64;
        let _guard = (!last).then(|| ddp.no_sync());
        let loss =
            ddp.forward_t(&x.index_select(0, &rows), true).mse_loss(&y.index_select(0, &rows), tch::Reduction::Mean);
        amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
        if !last {
            // Under no_sync the gradients stay local: the ranks' differ.
            let g = opt.master_params()[0].grad();
            let all = pg.all_gather(&g).unwrap();
            assert!(!all[0].equal(&all[1]), "micro-batch {m} under no_sync was reduced");
        }
    }
    opt.master_params().iter().map(|p| p.grad().to_kind(Kind::Double)).collect()
}

/// One process: the same micro-batches, each the union of the ranks' ones.
fn reference_grads(micro_batches: usize) -> Vec<Tensor> {
    let vs = VarStore::new(Device::Cpu);
    tch::manual_seed(1);
    let model = net(&vs);
    let (model, mut opt, mut amp) = initialize(&vs, model, sgd(), 0.1, &config(OptLevel::O0)).unwrap();
    let (x, y) = global_batch(0);
    opt.zero_grad().unwrap();
    let mb = 2 * B / micro_batches as i64;
    for m in 0..micro_batches as i64 {
        let loss =
            model.forward_t(&x.narrow(0, m * mb, mb), true).mse_loss(&y.narrow(0, m * mb, mb), tch::Reduction::Mean);
        amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
    }
    opt.master_params().iter().map(|p| p.grad().to_kind(Kind::Double)).collect()
}

fn assert_grads(got: &[Tensor], want: &[Tensor], factor: f64, what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let d = max_diff(g, &(w * factor));
        assert!(d <= 1e-6, "{what}: gradient {i} differs by {d:e}");
    }
}

/// Apex's options change what reaches `.grad`: gradient_average=false sums, a predivide factor
/// still averages (divided before and after the sum), fp32 allreduce of fp32 grads changes
/// nothing, delay_allreduce reduces after backward; no_sync accumulates locally and the last
/// micro-batch reduces the accumulated gradient.
#[test]
fn apex_options_and_no_sync() {
    two_ranks(concat!(module_path!(), "::apex_options_and_no_sync"), |side: &mut Side| {
        let pg = side.group();
        let want = reference_grads(1);
        assert_grads(&ddp_grads(&pg, DdpOptions::default(), 1), &want, 1.0, "average");
        assert_grads(&ddp_grads(&pg, DdpOptions::default().gradient_average(false), 1), &want, 2.0, "sum");
        let o = DdpOptions::default().gradient_predivide_factor(4.0).allreduce_always_fp32(true);
        assert_grads(&ddp_grads(&pg, o, 1), &want, 1.0, "predivide 4, fp32");
        assert_grads(&ddp_grads(&pg, DdpOptions::default().delay_allreduce(true), 1), &want, 1.0, "delay_allreduce");
        let want2 = reference_grads(2);
        assert_grads(&ddp_grads(&pg, DdpOptions::default().message_size(100), 2), &want2, 1.0, "no_sync accumulation");
    });
}

/// Rank 0 writes the checkpoint, every rank loads it into a differently seeded model: all ranks
/// then hold the saved weights, masters and scale, and the next step is the same on both. A
/// write that fails on rank 0 fails on every rank.
#[test]
fn checkpoint_written_by_rank0_loaded_by_all() {
    two_ranks(concat!(module_path!(), "::checkpoint_written_by_rank0_loaded_by_all"), |side: &mut Side| {
        use tch_amp::distributed::{load_checkpoint_on_all, save_checkpoint_on_rank0, DistError};
        let pg = side.group();
        let path = side.dir.join("ckpt.safetensors");
        let build = |seed: i64| {
            let vs = VarStore::new(Device::Cpu);
            tch::manual_seed(seed);
            let model = net(&vs);
            let (model, opt, amp) = initialize(&vs, model, sgd(), 0.1, &config(OptLevel::O2)).unwrap();
            (vs, model, opt, amp)
        };
        let (vs, model, mut opt, mut amp) = build(1 + pg.rank() as i64);
        let ddp = DistributedDataParallel::new(&pg, &vs, model, &mut [&mut opt], DdpOptions::default()).unwrap();
        let (x, y) = global_batch(0);
        let loss = ddp.forward_t(&x.narrow(0, 0, B), true).mse_loss(&y.narrow(0, 0, B), tch::Reduction::Mean);
        opt.zero_grad().unwrap();
        amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
        opt.step().unwrap();
        save_checkpoint_on_rank0(&pg, &path, &vs, &[&opt], &amp).unwrap();
        assert!(path.exists());
        let saved = snapshot(&vs);
        let saved_masters = masters(&opt);
        // A fresh, differently seeded model on each rank.
        let (vs2, _model2, mut opt2, mut amp2) = build(50 + pg.rank() as i64);
        load_checkpoint_on_all(&pg, &path, &vs2, &mut [&mut opt2], &mut amp2).unwrap();
        for ((n, a), (_, b)) in snapshot(&vs2).iter().zip(&saved) {
            assert!(a.equal(b), "{n} not restored");
            assert_same_on_all_ranks(&pg, a, n);
        }
        for (a, b) in masters(&opt2).iter().zip(&saved_masters) {
            assert!(a.equal(b), "master not restored");
        }
        assert_eq!(amp2.loss_scale(0).unwrap(), amp.loss_scale(0).unwrap());
        // Rank 0 cannot write (a folder that does not exist): both ranks get an error.
        let bad = side.dir.join("missing").join("ckpt.safetensors");
        let err = save_checkpoint_on_rank0(&pg, &bad, &vs, &[&opt], &amp).unwrap_err();
        match pg.rank() {
            0 => assert!(matches!(err, DistError::Amp { .. }), "{err}"),
            _ => assert!(matches!(err, DistError::RemoteFailure { rank: 0, .. }), "{err}"),
        }
    });
}

/// Rank 1 dies (SIGKILL) between two training steps: rank 0's next backward fails within the
/// timeout, and the error is a typed peer failure.
#[test]
fn killed_peer_during_ddp_training() {
    two_ranks(concat!(module_path!(), "::killed_peer_during_ddp_training"), |side: &mut Side| {
        use std::time::{Duration, Instant};
        use tch_amp::ScaleLossOptions;
        let pg = side.group();
        pg.set_timeout(Duration::from_secs(5)).unwrap();
        let vs = VarStore::new(Device::Cpu);
        tch::manual_seed(1);
        let model = net(&vs);
        let (model, mut opt, mut amp) = initialize(&vs, model, sgd(), 0.1, &config(OptLevel::O2)).unwrap();
        let ddp = DistributedDataParallel::new(&pg, &vs, model, &mut [&mut opt], DdpOptions::default()).unwrap();
        let (x, y) = global_batch(0);
        let mut step = || {
            let loss = ddp.f_forward_t(&x.narrow(0, 0, B), true)?.mse_loss(&y.narrow(0, 0, B), tch::Reduction::Mean);
            opt.zero_grad()?;
            amp.f_scale_loss_with(&loss, &mut [&mut opt], ScaleLossOptions::default(), |s| s.f_backward())
                .map_err(|e| pg.backward_error(e))?;
            opt.step()?;
            Ok::<(), tch_amp::distributed::DistError>(())
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
