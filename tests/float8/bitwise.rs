//! Float8 training against torchao 0.18 (tensorwise, rowwise, rowwise_with_gw_hp) and against
//! the Python reference of Transformer Engine's delayed scaling, bit for bit on CPU, on an MLP
//! and a transformer block, in fp32, under CPU bf16 autocast (libtorch's native kernels) and
//! with bf16 weights; an inf in the input as torchao and TE handle it. Expected values:
//! scripts/reference/float8_reference.py, run on this machine (both sides use this CPU's
//! kernels, so the comparison holds whatever the CPU kind).
use tch::Device;

use super::models::fixture;
use super::reference::run_cases;

#[test]
fn torchao_tensorwise_bit_for_bit() {
    run_cases(Device::Cpu, &fixture(), |c| c["recipe"] == "tensorwise", 7);
}

#[test]
fn torchao_rowwise_bit_for_bit() {
    run_cases(Device::Cpu, &fixture(), |c| c["recipe"] == "rowwise", 6);
}

#[test]
fn torchao_rowwise_with_gw_hp_bit_for_bit() {
    run_cases(Device::Cpu, &fixture(), |c| c["recipe"] == "rowwise_with_gw_hp", 4);
}

#[test]
fn te_delayed_scaling_bit_for_bit() {
    run_cases(Device::Cpu, &fixture(), |c| c["kind"] == "delayed", 8);
}
