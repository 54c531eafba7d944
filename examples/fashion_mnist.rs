//! Placeholder smoke demo until the Fashion-MNIST comparison lands: one fp16 op and one
//! autocast linear on CPU.
use tch::nn::{self, Module};
use tch::{Device, Kind, Tensor};

fn main() -> Result<(), tch_amp::AmpError> {
    let vs = nn::VarStore::new(Device::Cpu);
    let linear = nn::linear(vs.root(), 16, 4, Default::default());
    let x = Tensor::randn([8, 16], (Kind::Float, Device::Cpu));
    let y = tch_amp::autocast(Device::Cpu, Kind::Half, || linear.forward(&x))?;
    println!("autocast linear output dtype: {:?}", y.kind());
    Ok(())
}
