"""Expected values for tests/optim_bitwise.rs: torch.optim (PyTorch 2.13, CPU, its default
single-tensor algorithm, or fused=True where a case says so) over 20 steps of every optimizer
option tch-amp supports, with two parameter groups of different learning rates.

Run with the venv's python (scripts/setup-libtorch.sh writes its path into
.cargo/config.toml as TCH_AMP_PYTHON) from the repository root:

    $TCH_AMP_PYTHON scripts/reference/optim_fixtures.py OUT.safetensors

The Rust tests run it themselves at test time (tests/common/reference.rs, Fixture::generated):
libtorch's element-wise CPU kernels differ in the last bit between vector ISAs (AVX2, AVX512),
so the expected values are made on the CPU that runs the tests.

Every case runs twice:
- "fp32": fp32 parameters; the gradient of step s is the stored tensor `k` (the Rust test gets
  it exactly as the gradient of `sum(p * k)`).
- "o2": fp16 model parameters with fp32 masters, the way tch-amp's O2 (and Apex's) produces
  the master gradients: backward of `sum(p16.float() * k16.float()) * 65536` gives fp16 model
  gradients,
  which are copied to fp32 and multiplied by 1/65536 (libtorch's
  _amp_foreach_non_finite_check_and_unscale_); the optimizer steps the masters, which are then
  copied into the fp16 model.

The file holds, per case and variant (`<case>/<variant>/...`), every parameter flattened and
concatenated in the order a, b, c (shapes in the metadata): the initial parameters `p0` [N],
the gradient inputs `k` [steps, N] (fp16 under "o2"), the parameters after every step `p`
[steps, N] (the fp32 masters under "o2") and the optimizer state after the last step
`state/<buffer>` [N]. The header metadata "cases" is a JSON list of the cases: optimizer, every
hyper-parameter (torch's defaults filled in), the two learning rates, the parameters' shapes
and groups.

Only element-wise kernels are involved, so the values do not depend on the thread count.
"""

import torch

import optim_harness as harness
from optim_harness import SCALE, SHAPES, flat

STEPS = 20
# Three parameters: "a" and "b" in group 0, "c" in group 1. 33 elements exercise the
# vectorized kernels (two AVX-512 vectors per iteration) and their scalar tail.
GROUPS = {"a": 0, "b": 0, "c": 1}

SGD = dict(momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False)
ADAM = dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, maximize=False, fused=False)
ADAMW = dict(ADAM, weight_decay=0.01)
RMSPROP = dict(alpha=0.99, eps=1e-8, weight_decay=0.0, momentum=0.0, centered=False, maximize=False)

CASES = [
    # name, optimizer, options over torch's defaults, lr of group 0, lr of group 1
    ("sgd_plain", "SGD", {}, 0.05, 0.02),
    ("sgd_weight_decay", "SGD", dict(weight_decay=0.1), 0.05, 0.02),
    ("sgd_momentum", "SGD", dict(momentum=0.9), 0.05, 0.02),
    ("sgd_dampening", "SGD", dict(momentum=0.9, dampening=0.3), 0.05, 0.02),
    ("sgd_nesterov", "SGD", dict(momentum=0.9, nesterov=True), 0.05, 0.02),
    ("sgd_momentum_weight_decay", "SGD", dict(momentum=0.5, weight_decay=0.01), 0.05, 0.02),
    ("sgd_maximize", "SGD", dict(momentum=0.9, maximize=True), 0.05, 0.02),
    ("sgd_all", "SGD", dict(momentum=0.8, nesterov=True, weight_decay=0.05, maximize=True), 0.05, 0.02),
    ("sgd_dampening_all", "SGD", dict(momentum=0.7, dampening=0.2, weight_decay=0.05, maximize=True), 0.05, 0.02),
    ("adam_plain", "Adam", {}, 1e-2, 3e-3),
    ("adam_amsgrad", "Adam", dict(betas=(0.9, 0.9), amsgrad=True), 1e-2, 3e-3),
    ("adam_weight_decay", "Adam", dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1), 1e-2, 3e-3),
    ("adam_maximize", "Adam", dict(maximize=True), 1e-2, 3e-3),
    ("adam_all", "Adam", dict(betas=(0.85, 0.95), amsgrad=True, weight_decay=0.05, maximize=True), 1e-2, 3e-3),
    ("adamw_plain", "AdamW", {}, 1e-2, 3e-3),
    ("adamw_amsgrad", "AdamW", dict(betas=(0.9, 0.9), amsgrad=True), 1e-2, 3e-3),
    ("adamw_weight_decay", "AdamW", dict(betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1), 1e-2, 3e-3),
    ("adamw_maximize", "AdamW", dict(maximize=True), 1e-2, 3e-3),
    ("adamw_all", "AdamW", dict(betas=(0.85, 0.95), amsgrad=True, weight_decay=0.05, maximize=True), 1e-2, 3e-3),
    ("adam_fused", "Adam", dict(fused=True), 1e-2, 3e-3),
    ("adam_fused_all", "Adam", dict(fused=True, amsgrad=True, weight_decay=0.05, maximize=True), 1e-2, 3e-3),
    ("adamw_fused", "AdamW", dict(fused=True), 1e-2, 3e-3),
    ("adamw_fused_all", "AdamW", dict(fused=True, amsgrad=True, weight_decay=0.05, maximize=True), 1e-2, 3e-3),
    ("rmsprop_plain", "RMSprop", {}, 1e-2, 5e-3),
    ("rmsprop_alpha", "RMSprop", dict(alpha=0.9), 1e-2, 5e-3),
    ("rmsprop_weight_decay", "RMSprop", dict(weight_decay=0.1), 1e-2, 5e-3),
    ("rmsprop_momentum", "RMSprop", dict(momentum=0.9), 1e-2, 5e-3),
    ("rmsprop_centered", "RMSprop", dict(centered=True), 1e-2, 5e-3),
    ("rmsprop_centered_momentum", "RMSprop", dict(alpha=0.9, centered=True, momentum=0.5, weight_decay=0.1), 1e-2, 5e-3),
    ("rmsprop_maximize", "RMSprop", dict(momentum=0.9, maximize=True), 1e-2, 5e-3),
]

DEFAULTS = {"SGD": SGD, "Adam": ADAM, "AdamW": ADAMW, "RMSprop": RMSPROP}


def make_optimizer(kind, options, params, lr0, lr1):
    groups = [
        {"params": [params[n] for n in SHAPES if GROUPS[n] == 0]},
        {"params": [params[n] for n in SHAPES if GROUPS[n] == 1], "lr": lr1},
    ]
    return getattr(torch.optim, kind)(groups, lr=lr0, **options)


def run(name, kind, options, lr0, lr1, variant, gen, out):
    prefix = f"{name}/{variant}/"
    params, model = harness.start(variant, gen, out, prefix)
    opt = make_optimizer(kind, options, params, lr0, lr1)
    ks_all, ps_all = [], []
    for _ in range(STEPS):
        ks = harness.gradients(params, model, gen)
        opt.step()
        harness.copy_back(params, model, opt)
        ks_all.append(flat(ks.values()))
        ps_all.append(flat(params.values()))
    harness.finish(out, prefix, params, opt, ks_all, ps_all)


def main():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1234)
    out = {}
    meta = []
    for name, kind, options, lr0, lr1 in CASES:
        full = dict(DEFAULTS[kind], **options)
        for variant in ("fp32", "o2"):
            run(name, kind, full, lr0, lr1, variant, gen, out)
        entry = {"name": name, "optimizer": kind, "lr": [lr0, lr1], "shapes": SHAPES, "groups": GROUPS,
                 "steps": STEPS}
        entry.update({k: list(v) if isinstance(v, tuple) else v for k, v in full.items()})
        meta.append(entry)
    harness.write(out, meta, len(CASES))


if __name__ == "__main__":
    main()
