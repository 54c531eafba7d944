//! CUDA paths of `tch_amp::distributed` (run with `--features cuda-tests`, which fails without a
//! CUDA device; add `--features nccl` for the NCCL backend): Gloo collectives on CUDA tensors,
//! SyncBatchNorm through libtorch's CUDA batch_norm_* kernels, a one-rank NCCL group.

use tch::nn::{self, BatchNormConfig, ModuleT, VarStore};
use tch::{Device, Kind, Tensor};
use tch_amp::distributed::{sync_batch_norm, ReduceOp};

use crate::support::{two_ranks, Side};

fn cuda() -> Device {
    assert!(tch::Cuda::is_available(), "the cuda-tests feature needs a CUDA device");
    Device::Cuda(0)
}

/// Both ranks on GPU 0 (Gloo stages CUDA tensors through the host).
#[test]
fn gloo_allreduce_of_cuda_tensors() {
    two_ranks(concat!(module_path!(), "::gloo_allreduce_of_cuda_tensors"), |side: &mut Side| {
        let pg = side.group();
        let mut t = Tensor::full([4], side.rank as f64 + 1.0, (Kind::Float, cuda()));
        pg.all_reduce_(&mut t, ReduceOp::Sum).unwrap();
        assert_eq!(Vec::<f32>::try_from(&t.to_device(Device::Cpu)).unwrap(), vec![3.0; 4]);
    });
}

/// SyncBatchNorm on CUDA (libtorch's batch_norm_stats / gather_stats_with_counts / elemt /
/// backward_reduce / backward_elemt) against batch norm on the whole batch.
#[test]
fn sync_batch_norm_cuda_kernels() {
    two_ranks(concat!(module_path!(), "::sync_batch_norm_cuda_kernels"), |side: &mut Side| {
        let pg = side.group();
        let dev = cuda();
        tch::manual_seed(7);
        let x = (Tensor::randn([8, 3, 5, 5], (Kind::Float, Device::Cpu)) * 2.0 + 3.0).to_device(dev);
        let cfg = BatchNormConfig::default();
        let vs = VarStore::new(dev);
        let bn = nn::batch_norm2d(vs.root() / "bn", 3, cfg);
        let xf = x.detach().set_requires_grad(true);
        let y = bn.forward_t(&xf, true);
        y.sum(Kind::Float).backward();
        let vs2 = VarStore::new(dev);
        let sbn = sync_batch_norm(vs2.root() / "bn", &pg, 3, cfg);
        {
            let _g = tch::no_grad_guard();
            sbn.ws.as_ref().unwrap().shallow_clone().copy_(bn.ws.as_ref().unwrap());
        }
        let r = side.rank as i64;
        let xr = x.narrow(0, 4 * r, 4).detach().set_requires_grad(true);
        let yr = sbn.f_forward_t(&xr, true).unwrap();
        yr.sum(Kind::Float).backward();
        let d = (&yr - y.narrow(0, 4 * r, 4)).abs().max().double_value(&[]);
        assert!(d < 1e-5, "output differs by {d:e}");
        let d = (xr.grad() - xf.grad().narrow(0, 4 * r, 4)).abs().max().double_value(&[]);
        assert!(d < 1e-5, "input gradient differs by {d:e}");
        let d = (&sbn.running_var - &bn.running_var).abs().max().double_value(&[]);
        assert!(d < 1e-5, "running_var differs by {d:e}");
    });
}

/// A one-rank NCCL group: allreduce and barrier on GPU 0.
#[cfg(feature = "nccl")]
#[test]
fn nccl_group_of_one() {
    use tch_amp::distributed::{Backend, InitOptions, ProcessGroup};
    let port = crate::support::free_port();
    let opts = InitOptions::new(0, 1, "127.0.0.1", port).backend(Backend::Nccl).timeout(crate::support::TIMEOUT);
    let pg = ProcessGroup::init(&opts).unwrap();
    let mut t = Tensor::full([4], 2.0, (Kind::Float, cuda()));
    pg.all_reduce_(&mut t, ReduceOp::Sum).unwrap();
    assert_eq!(Vec::<f32>::try_from(&t.to_device(Device::Cpu)).unwrap(), vec![2.0; 4]);
    pg.barrier().unwrap();
}
