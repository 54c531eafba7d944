//! Float8 training on CUDA against torchao (tensorwise, rowwise) and the Python reference of
//! TE's delayed scaling on the same GPU, bit for bit: fp32 and under CUDA bf16 autocast
//! (scripts/reference/float8_reference_cuda.py; the CPU harness of tests/float8).
#[allow(dead_code)]
#[path = "../float8/models.rs"]
mod models;
#[allow(dead_code)]
#[path = "../float8/reference.rs"]
mod reference;

use tch::Device;

use crate::common::reference::Fixture;

fn cuda() -> Device {
    assert!(tch::Cuda::is_available(), "cuda-tests needs a CUDA device; none is available");
    Device::Cuda(0)
}

#[test]
fn float8_on_cuda_bit_for_bit() {
    let dev = cuda();
    let fx = Fixture::generated("float8_reference_cuda.py");
    reference::run_cases(dev, &fx, |_| true, 6);
}
