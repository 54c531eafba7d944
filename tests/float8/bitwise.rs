//! Float8 training against torchao 0.18 (tensorwise, rowwise, rowwise_with_gw_hp) and against
//! the Python reference of Transformer Engine's delayed scaling, bit for bit on CPU, on an MLP
//! and a transformer block, in fp32, under CPU bf16 autocast (libtorch's native kernels), with
//! bf16 weights and under O2's fp32 masters; an inf in the input as torchao and TE handle it. Expected values:
//! scripts/reference/float8_reference.py, run on this machine (both sides use this CPU's
//! kernels, so the comparison holds whatever the CPU kind).
use tch::Device;

use super::models::fixture;
use super::reference::run_cases;

#[test]
fn torchao_tensorwise_bit_for_bit() {
    run_cases(Device::Cpu, &fixture(), |c| c["recipe"] == "tensorwise" && c["mode"] != "o2", 7);
}

#[test]
fn torchao_rowwise_bit_for_bit() {
    run_cases(Device::Cpu, &fixture(), |c| c["recipe"] == "rowwise" && c["mode"] != "o2", 6);
}

#[test]
fn torchao_rowwise_with_gw_hp_bit_for_bit() {
    run_cases(Device::Cpu, &fixture(), |c| c["recipe"] == "rowwise_with_gw_hp", 4);
}

#[test]
fn te_delayed_scaling_bit_for_bit() {
    run_cases(Device::Cpu, &fixture(), |c| c["kind"] == "delayed" && c["mode"] != "o2", 8);
}

/// Apex's O2 (an fp16 model with fp32 masters, a static loss scale) with float8 layers: the
/// master gradients, the masters and the fp16 model after each step, against torchao (and TE's
/// delayed scaling) on an fp16 model with the same master-weight loop in Python.
#[test]
fn float8_under_o2_masters_bit_for_bit() {
    run_cases(Device::Cpu, &fixture(), |c| c["mode"] == "o2", 4);
}
