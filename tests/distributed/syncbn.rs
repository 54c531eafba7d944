//! SyncBatchNorm on two processes (Gloo, 127.0.0.1) against libtorch's batch norm on the whole
//! batch in one process: outputs, running statistics, input / weight / bias gradients.
//!
//! Tolerance 1e-5 (fp32): the statistics are combined from per-rank means and variances
//! (Chan's formula) where one process reduces the whole batch at once; only rounding differs.

use tch::nn::{self, BatchNormConfig, ModuleT, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::distributed::{sync_batch_norm, DdpOptions, DistributedDataParallel, ReduceOp};
use tch_amp::{initialize, AmpConfig, OptLevel};

use crate::support::{assert_same_on_all_ranks, two_ranks, Side};

const B: i64 = 4;
const C: i64 = 3;

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_kind(Kind::Double) - b.to_kind(Kind::Double)).abs().max().double_value(&[])
}

fn set_affine(weight: &Tensor, bias: &Tensor) {
    let _g = tch::no_grad_guard();
    weight.shallow_clone().copy_(&Tensor::from_slice(&[0.5f32, 1.5, -1.0]));
    bias.shallow_clone().copy_(&Tensor::from_slice(&[0.1f32, 0.2, 0.3]));
}

/// (input, loss weights) of the whole batch: 2B x C x 5 x 5, channel means far from 0.
fn data() -> (Tensor, Tensor) {
    tch::manual_seed(7);
    let x = Tensor::randn([2 * B, C, 5, 5], (Kind::Float, Device::Cpu)) * 2.0 + 3.0;
    let g = Tensor::randn([2 * B, C, 5, 5], (Kind::Float, Device::Cpu));
    (x, g)
}

struct Outcome {
    y: Tensor,
    dx: Tensor,
    dw: Tensor,
    db: Tensor,
    running_mean: Tensor,
    running_var: Tensor,
    y_eval: Tensor,
}

#[test]
fn sync_batch_norm_equals_batch_norm_on_the_full_batch() {
    two_ranks(concat!(module_path!(), "::sync_batch_norm_equals_batch_norm_on_the_full_batch"), |side: &mut Side| {
        let pg = side.group();
        let cfg = BatchNormConfig::default();
        let (x, g) = data();
        // One process, the whole batch.
        let want = {
            let vs = VarStore::new(Device::Cpu);
            let bn = nn::batch_norm2d(vs.root() / "bn", C, cfg);
            set_affine(bn.ws.as_ref().unwrap(), bn.bs.as_ref().unwrap());
            let x = x.detach().set_requires_grad(true);
            let y = bn.forward_t(&x, true);
            (&y * &g).sum(Kind::Float).backward();
            let y_eval = bn.forward_t(&x, false).detach();
            Outcome {
                y: y.detach(),
                dx: x.grad(),
                dw: bn.ws.as_ref().unwrap().grad(),
                db: bn.bs.as_ref().unwrap().grad(),
                running_mean: bn.running_mean.copy(),
                running_var: bn.running_var.copy(),
                y_eval,
            }
        };
        // This rank's half.
        let vs = VarStore::new(Device::Cpu);
        let bn = sync_batch_norm(vs.root() / "bn", &pg, C, cfg);
        set_affine(bn.ws.as_ref().unwrap(), bn.bs.as_ref().unwrap());
        let r = side.rank as i64;
        let xr = x.narrow(0, r * B, B).detach().set_requires_grad(true);
        let gr = g.narrow(0, r * B, B);
        let y = bn.f_forward_t(&xr, true).unwrap();
        (&y * &gr).sum(Kind::Float).backward();
        let mut dw = bn.ws.as_ref().unwrap().grad();
        let mut db = bn.bs.as_ref().unwrap().grad();
        // Weight and bias gradients are local (DDP averages them): their sum is the whole batch's.
        pg.all_reduce_(&mut dw, ReduceOp::Sum).unwrap();
        pg.all_reduce_(&mut db, ReduceOp::Sum).unwrap();
        let tol = 1e-5;
        let checks = [
            ("output", max_diff(&y, &want.y.narrow(0, r * B, B))),
            ("input gradient", max_diff(&xr.grad(), &want.dx.narrow(0, r * B, B))),
            ("weight gradient", max_diff(&dw, &want.dw)),
            ("bias gradient", max_diff(&db, &want.db)),
            ("running_mean", max_diff(&bn.running_mean, &want.running_mean)),
            ("running_var", max_diff(&bn.running_var, &want.running_var)),
        ];
        for (what, d) in checks {
            assert!(d <= tol, "rank {r}: {what} differs by {d:e}");
        }
        // The statistics moved (the check is not vacuous) and are the same bits on both ranks.
        assert!(max_diff(&bn.running_mean, &Tensor::zeros([C], (Kind::Float, Device::Cpu))) > 0.1);
        assert_same_on_all_ranks(&pg, &bn.running_mean, "running_mean");
        assert_same_on_all_ranks(&pg, &bn.running_var, "running_var");
        // Evaluation uses the running statistics, no communication.
        let y_eval = bn.f_forward_t(&xr, false).unwrap();
        assert!(max_diff(&y_eval, &want.y_eval.narrow(0, r * B, B)) <= tol);
        // fp16 input (as after an fp16 convolution under O2): fp16 output, normalized in fp32.
        let yh = bn.f_forward_t(&xr.detach().to_kind(Kind::Half), true).unwrap();
        assert_eq!(yh.kind(), Kind::Half);
        assert!(max_diff(&yh, &want.y.narrow(0, r * B, B)) <= 2e-2);
    });
}

#[derive(Debug)]
struct ConvBn {
    conv: nn::Conv2D,
    bn: tch_amp::distributed::SyncBatchNorm,
    fc: nn::Linear,
}

impl ModuleT for ConvBn {
    fn forward_t(&self, xs: &Tensor, train: bool) -> Tensor {
        let y = self.bn.forward_t(&xs.apply(&self.conv), train).relu();
        y.mean_dim(&[2i64, 3][..], false, None).apply(&self.fc)
    }
}

/// Under O2 the SyncBatchNorm stays fp32 (keep_batchnorm_fp32), trains inside DDP with AMP, and
/// both ranks keep identical weights and running statistics.
#[test]
fn sync_batch_norm_under_o2_ddp() {
    two_ranks(concat!(module_path!(), "::sync_batch_norm_under_o2_ddp"), |side: &mut Side| {
        let pg = side.group();
        let vs = VarStore::new(Device::Cpu);
        tch::manual_seed(3 + side.rank as i64);
        let p = vs.root();
        let net = ConvBn {
            conv: nn::conv2d(&p / "conv", 2, 4, 3, Default::default()),
            bn: sync_batch_norm(&p / "bn", &pg, 4, Default::default()),
            fc: nn::linear(&p / "fc", 4, 2, Default::default()),
        };
        let cfg = AmpConfig::new(OptLevel::O2).max_loss_scale(8192.0);
        let (model, mut opt, mut amp) = initialize(&vs, net, nn::Sgd::default(), 0.05, &cfg).unwrap();
        let vars = vs.variables();
        assert_eq!(vars["bn.weight"].kind(), Kind::Float);
        assert_eq!(vars["bn.running_var"].kind(), Kind::Float);
        assert_eq!(vars["conv.weight"].kind(), Kind::Half);
        let ddp = DistributedDataParallel::new(&pg, &vs, model, &mut [&mut opt], DdpOptions::default()).unwrap();
        for step in 0..3 {
            tch::manual_seed(100 + 10 * step + side.rank as i64); // each rank its own data
            let x = Tensor::randn([4, 2, 6, 6], (Kind::Float, Device::Cpu));
            let y = Tensor::randn([4, 2], (Kind::Float, Device::Cpu));
            let loss = ddp.forward_t(&x, true).mse_loss(&y, tch::Reduction::Mean);
            opt.zero_grad().unwrap();
            amp.scale_loss(&loss, &mut [&mut opt], |s| s.backward()).unwrap();
            assert!(opt.step().unwrap().stepped());
        }
        let vars = vs.variables();
        let mut names: Vec<_> = vars.keys().cloned().collect();
        names.sort();
        for n in names {
            assert_same_on_all_ranks(&pg, &vars[&n], &n);
        }
        assert_eq!(vars["bn.weight"].kind(), Kind::Float);
    });
}
