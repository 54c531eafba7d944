use tch::nn::{Module, VarStore};
use tch::{Device, Kind};
use tch_amp::doctor::Doctor;
use tch_amp::{AmpConfig, CpuKernels, OptLevel};

use crate::models::{batch, ThreeLayers};

#[test]
fn explore() {
    let vs = VarStore::new(Device::Cpu);
    let net = ThreeLayers::new(&vs, 1000.0);
    for scale in [1.0, 100.0] {
        let (x, y) = batch(scale);
        let r = Doctor::apex(AmpConfig::new(OptLevel::O1).cpu_kernels(CpuKernels::Emulate))
            .run(&vs, |p| p.forward(&net, &x).to_kind(Kind::Float).mse_loss(&y, tch::Reduction::Mean))
            .unwrap();
        println!("{}", r.to_json());
        println!("{}", r.summary());
    }
}
