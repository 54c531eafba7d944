"""Expected values for tests/amp/apex_optimizers.rs: Apex's optimizers (apex.optimizers
FusedSGD, FusedAdam, FusedLAMB, FusedNovoGrad, FusedAdagrad) over 12 steps of each option,
computed by a reference written here in plain torch ops (PyTorch 2.13, CPU).

Apex runs these optimizers as multi-tensor CUDA kernels (csrc/multi_tensor_{sgd,adam,lamb,
novograd,adagrad}*.cu), which cannot run without a GPU. This script computes the algorithm the
kernels compute, from Apex's documentation, the Python side of apex/optimizers/*.py (which
values the kernels get: per-group step counts, bias corrections computed on the host in float,
the global gradient norm of LAMB, NovoGrad's per-tensor norms) and the reference
implementations of Apex's tests/L0/run_optimizers (RefLAMB, the NovoGrad and Adagrad
references): every operand loaded into fp32, each arithmetic operation of the kernel one fp32
torch op (one rounding of libtorch's CPU kernel; its vectorized sqrt is not correctly rounded
for every input), host constants rounded to float as the C++ host code does, results stored
rounded to each tensor's dtype. LAMB's global norm is the norm of the per-tensor norms.
FusedSGD is torch.optim.SGD's single-tensor ops (Apex documents it as the drop-in
equivalent). tch-amp's src/optim/apex.rs computes the same operations in the same order, so
the test compares bit for bit.

Where Apex on a GPU differs from this reference (and so from tch-amp): Apex builds its kernels
with --use_fast_math (approximate division and sqrt, denormals flushed to zero), nvcc contracts
`a * b + c` into fused multiply-adds, Apex's l2-norm kernel sums the squares in blocks in
another order, and LAMB's global norm is one sum of squares over every tensor, so Apex's own
results differ in the last bits of some elements (its own tests compare against RefLAMB with
max_abs_diff 1e-3).

Run with the venv's python (TCH_AMP_PYTHON in .cargo/config.toml) from the repository root:

    $TCH_AMP_PYTHON scripts/reference/apex_optim_fixtures.py OUT.safetensors

The Rust tests run it themselves at test time (tests/common/reference.rs, Fixture::generated):
libtorch's element-wise CPU kernels differ in the last bit between vector ISAs (AVX2, AVX512),
so the expected values are made on the CPU that runs the tests.

Each case runs twice, as optim_fixtures.py does (see
scripts/reference/optim_fixtures.py):
- "fp32": fp32 parameters; the gradient of step s is the stored `k` (the Rust test gets it as
  the gradient of sum(p * k)).
- "o2": fp16 parameters with fp32 masters; the master gradient is the fp16 gradient of
  `sum(p16.float() * k16.float()) * 65536` copied to fp32 and multiplied by 1/65536.

Parameters "a" [3] and "b" [2, 3] are group 0, "c" [33] group 1; each group has its own
learning rate and, per case, its own hyper-parameters (the BERT `no_decay` pattern: weight
decay 0 in group 1). Stored per case and variant: `p0` [N], `k` [steps, N], `p` [steps, N]
(fp32 masters under o2) and `state/<name>` [M] (each parameter's state flattened and
concatenated in the order a, b, c; NovoGrad's `exp_avg_sq` is one number per parameter). The
metadata "cases" lists the cases: optimizer, optimizer-wide options, each group's lr and
hyper-parameters.

Every tensor is small (under 32768 elements), so the reductions (norms) run single-threaded and
do not depend on the thread count.
"""
import math
import struct

import torch

import optim_harness as harness
from optim_harness import SCALE, SHAPES, flat

STEPS = 12
GROUPS = {"a": 0, "b": 0, "c": 1}
F32 = torch.float32


def f32(x):
    """`x` rounded to a C float."""
    return struct.unpack("f", struct.pack("f", x))[0]


def one_minus(beta):
    """The kernels' `1 - beta` with `beta` a float."""
    return f32(1.0 - f32(beta))


def bias_correction(beta, step):
    """The host code's `1 - std::pow(beta, step)` (beta a float, the power in double), stored
    as a float."""
    return f32(1.0 - f32(beta) ** step)


class Reference:
    """A minimal optimizer: param groups (every hyper-parameter filled in, `step` counted per
    group as Apex's optimizers count it: +1 at every step of a group with parameters), a state
    dict per parameter, and `rule(self)` doing one update."""

    def __init__(self, groups, rule, options):
        self.groups = groups
        self.rule = rule
        self.options = options
        self.state = {}
        for g in self.groups:
            g["step"] = 0

    def step(self):
        for g in self.groups:
            if g["params"]:
                g["step"] += 1
        with torch.no_grad():
            self.rule(self)

    def params_with_grad(self, g):
        return [p for p in g["params"] if p.grad is not None]


def zeros_state(opt, p, name, dtype):
    st = opt.state.setdefault(p, {})
    if name not in st:
        st[name] = torch.zeros_like(p, dtype=dtype)
    return st[name]


def fused_sgd(opt):
    """FusedSGD: torch.optim.SGD's update (Apex documents FusedSGD as its drop-in), the weight
    decay added to the gradient before the momentum, or to the update after it with
    `wd_after_momentum`; the first step's momentum is the gradient itself."""
    after = opt.options["wd_after_momentum"]
    for g in opt.groups:
        lr, mom, damp, wd, nesterov = g["lr"], g["momentum"], g["dampening"], g["weight_decay"], g["nesterov"]
        for p in opt.params_with_grad(g):
            d = p.grad
            if wd != 0 and not after:
                d = d.add(p, alpha=wd)
            if mom != 0:
                st = opt.state.setdefault(p, {})
                if "momentum_buffer" not in st:
                    buf = torch.clone(d).detach()
                    st["momentum_buffer"] = buf
                else:
                    buf = st["momentum_buffer"]
                    buf.mul_(mom).add_(d, alpha=1 - damp)
                d = d.add(buf, alpha=mom) if nesterov else buf
            if wd != 0 and after:
                d = d.add(p, alpha=wd)
            p.add_(d, alpha=-lr)


def fused_adam(opt):
    """FusedAdam (AdamFunctor): L2 mode adds decay * p to the gradient; AdamW mode adds it to
    the update m_hat / (sqrt(v_hat) + eps). fp32 moments."""
    w_mode = opt.options["adam_w_mode"]
    for g in opt.groups:
        lr, step, (b1, b2), eps, wd = g["lr"], g["step"], g["betas"], g["eps"], g["weight_decay"]
        bc1, bc2 = (bias_correction(b1, step), bias_correction(b2, step)) if g["bias_correction"] else (1.0, 1.0)
        omb1, omb2 = one_minus(b1), one_minus(b2)
        for p in opt.params_with_grad(g):
            p32, g32 = p.float(), p.grad.float()
            m = zeros_state(opt, p, "exp_avg", F32)
            v = zeros_state(opt, p, "exp_avg_sq", F32)
            if not w_mode:
                g32 = g32 + p32 * wd
            m_next = m * b1 + g32 * omb1
            v_next = v * b2 + (g32 * omb2) * g32
            denom = (v_next / bc2).sqrt() + eps
            update = (m_next / bc1) / denom
            if w_mode:
                update = update + p32 * wd
            p_next = p32 - update * lr
            m.copy_(m_next)
            v.copy_(v_next)
            p.copy_(p_next)


def fused_lamb(opt):
    """FusedLAMB: the global l2 norm of every gradient (norm of the per-tensor norms), the
    gradients divided by norm / max_grad_norm when it exceeds max_grad_norm; stage 1 Adam's
    update (grad_averaging: (1 - beta1) weights the gradient in m), the weight decay in it
    (AdamW mode) or in the gradient (L2 mode); stage 2 the trust ratio ||p|| / ||update|| when
    both norms are non-zero, for parameters with weight decay or for all under use_nvlamb,
    times lr (else lr alone)."""
    o = opt.options
    grads = [p.grad for g in opt.groups for p in opt.params_with_grad(g)]
    if not grads:
        return
    norms = [torch.linalg.vector_norm(x, 2, dtype=F32) for x in grads]
    gnorm = torch.linalg.vector_norm(torch.stack(norms), 2, dtype=F32)
    clip = torch.where(gnorm > o["max_grad_norm"], gnorm / o["max_grad_norm"], torch.ones_like(gnorm))
    for g in opt.groups:
        lr, step, (b1, b2), eps, decay = g["lr"], g["step"], g["betas"], g["eps"], g["weight_decay"]
        bc1, bc2 = (bias_correction(b1, step), bias_correction(b2, step)) if g["bias_correction"] else (1.0, 1.0)
        beta3 = one_minus(b1) if g["grad_averaging"] else 1.0
        omb2 = one_minus(b2)
        for p in opt.params_with_grad(g):
            p_norm = torch.linalg.vector_norm(p, 2, dtype=F32)
            p32 = p.float()
            m = zeros_state(opt, p, "exp_avg", p.dtype)
            v = zeros_state(opt, p, "exp_avg_sq", p.dtype)
            scaled = p.grad.float() / clip
            if not o["adam_w_mode"]:
                scaled = scaled + p32 * decay
            m_next = m.float() * b1 + scaled * beta3
            v_next = v.float() * b2 + (scaled * omb2) * scaled
            denom = (v_next / bc2).sqrt() + eps
            update = (m_next / bc1) / denom
            if o["adam_w_mode"]:
                update = update + p32 * decay
            if p.grad.dtype != F32:  # the kernel keeps the update in the gradient's buffer
                update = update.to(p.grad.dtype).float()
            m.copy_(m_next)
            v.copy_(v_next)
            u_norm = torch.linalg.vector_norm(update, 2, dtype=F32)
            if o["use_nvlamb"] or decay != 0:
                both = (u_norm != 0) & (p_norm != 0)
                ratio = torch.where(both, (p_norm / u_norm) * lr, torch.full_like(p_norm, lr))
            else:
                ratio = torch.full_like(p_norm, lr)
            p.copy_(p32 - update * ratio)


def fused_novograd(opt):
    """FusedNovoGrad: per tensor, the running average of the gradient's norm (l2: sqrt of a
    blend of squares; max norm: a blend), started at the first gradient's norm unless
    init_zero; bias corrections 1 - beta1^t and sqrt(1 - beta2^t); reg_inside_moment
    normalizes and decays the gradient before m, else the decay joins the update."""
    inside = opt.options["reg_inside_moment"]
    for g in opt.groups:
        lr, step, (b1, b2), eps, wd = g["lr"], g["step"], g["betas"], g["eps"], g["weight_decay"]
        if g["bias_correction"]:
            bc1, bc2 = bias_correction(b1, step), f32(math.sqrt(1.0 - f32(b2) ** step))
        else:
            bc1, bc2 = 1.0, 1.0
        beta3 = one_minus(b1) if g["grad_averaging"] else 1.0
        omb2 = one_minus(b2)
        l2 = g["norm_type"] == 2
        for p in opt.params_with_grad(g):
            p32, g32 = p.float(), p.grad.float()
            m = zeros_state(opt, p, "exp_avg", p.dtype)
            st = opt.state[p]
            n = g32.pow(2).sum(dtype=F32) if l2 else g32.abs().max()
            if "exp_avg_sq" not in st:
                st["exp_avg_sq"] = torch.zeros_like(n) if g["init_zero"] else (n.sqrt() if l2 else n.clone())
            v = st["exp_avg_sq"]
            v_next = ((v * b2) * v + n * omb2).sqrt() if l2 else v * b2 + n * omb2
            denom = v_next / bc2 + eps
            if inside:
                m_next = m.float() * b1 + (g32 / denom + p32 * wd) * beta3
                p_next = p32 - (m_next / bc1) * lr
            else:
                m_next = m.float() * b1 + g32 * beta3
                p_next = p32 - ((m_next / bc1) / denom + p32 * wd) * lr
            v.copy_(v_next)
            m.copy_(m_next)
            p.copy_(p_next)


def fused_adagrad(opt):
    """FusedAdagrad: sum += g^2; p -= lr * g / (sqrt(sum) + eps), the weight decay in the
    gradient, or in the update with adagrad_w_mode."""
    w_mode = opt.options["adagrad_w_mode"]
    for g in opt.groups:
        lr, eps, wd = g["lr"], g["eps"], g["weight_decay"]
        for p in opt.params_with_grad(g):
            p32, g32 = p.float(), p.grad.float()
            h = zeros_state(opt, p, "sum", p.dtype)
            if not w_mode:
                g32 = g32 + p32 * wd
            h_next = h.float() + g32 * g32
            update = g32 / (h_next.sqrt() + eps)
            if w_mode:
                update = update + p32 * wd
            p_next = p32 - update * lr
            h.copy_(h_next)
            p.copy_(p_next)


# Apex's constructor defaults: per-group hyper-parameters, and the options Apex reads from the
# optimizer (not from groups).
KINDS = {
    "FusedSGD": (fused_sgd, dict(momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False),
                 dict(wd_after_momentum=False)),
    "FusedAdam": (fused_adam, dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, bias_correction=True),
                  dict(adam_w_mode=True)),
    "FusedLAMB": (fused_lamb, dict(betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01, bias_correction=True,
                                   grad_averaging=True),
                  dict(adam_w_mode=True, max_grad_norm=1.0, use_nvlamb=False)),
    "FusedNovoGrad": (fused_novograd, dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, bias_correction=True,
                                           grad_averaging=True, norm_type=2, init_zero=False),
                      dict(reg_inside_moment=False)),
    "FusedAdagrad": (fused_adagrad, dict(eps=1e-10, weight_decay=0.0), dict(adagrad_w_mode=False)),
}

NO_DECAY = dict(weight_decay=0.0)
CASES = [
    # name, optimizer, optimizer-wide options, group 0 (over defaults), group 1, lr0, lr1
    ("sgd_momentum_wd", "FusedSGD", {}, dict(momentum=0.9, weight_decay=0.01), dict(momentum=0.9), 0.05, 0.02),
    ("sgd_wd_after_momentum", "FusedSGD", dict(wd_after_momentum=True),
     dict(momentum=0.9, dampening=0.1, weight_decay=0.05), dict(momentum=0.5, dampening=0.1, weight_decay=0.05),
     0.05, 0.02),
    ("sgd_nesterov", "FusedSGD", {}, dict(momentum=0.9, nesterov=True, weight_decay=0.01),
     dict(momentum=0.9, nesterov=True), 0.05, 0.02),
    ("adam_w_mode", "FusedAdam", {}, dict(weight_decay=0.01), NO_DECAY, 1e-2, 3e-3),
    ("adam_l2", "FusedAdam", dict(adam_w_mode=False), dict(weight_decay=0.05, betas=(0.8, 0.99)),
     dict(weight_decay=0.0, eps=1e-6), 1e-2, 3e-3),
    ("adam_no_bias_correction", "FusedAdam", {}, dict(weight_decay=0.01, bias_correction=False),
     dict(weight_decay=0.01, bias_correction=False), 1e-2, 3e-3),
    ("lamb_default", "FusedLAMB", {}, {}, NO_DECAY, 1e-2, 5e-3),
    ("lamb_clipped", "FusedLAMB", dict(max_grad_norm=0.2), {}, NO_DECAY, 1e-2, 5e-3),
    ("lamb_l2_no_grad_averaging", "FusedLAMB", dict(adam_w_mode=False), dict(grad_averaging=False),
     dict(grad_averaging=False, weight_decay=0.0), 1e-2, 5e-3),
    ("lamb_nvlamb", "FusedLAMB", dict(use_nvlamb=True), dict(betas=(0.85, 0.98)), NO_DECAY, 1e-2, 5e-3),
    ("lamb_no_bias_correction", "FusedLAMB", {}, dict(bias_correction=False, eps=1e-8), NO_DECAY, 1e-2, 5e-3),
    ("novograd_default", "FusedNovoGrad", {}, dict(weight_decay=0.01), NO_DECAY, 1e-2, 5e-3),
    ("novograd_reg_inside_moment", "FusedNovoGrad", dict(reg_inside_moment=True), dict(weight_decay=0.01),
     NO_DECAY, 1e-2, 5e-3),
    ("novograd_max_norm_init_zero", "FusedNovoGrad", {},
     dict(norm_type=0, init_zero=True, grad_averaging=False, weight_decay=0.01),
     dict(norm_type=0, init_zero=True, grad_averaging=False), 1e-2, 5e-3),
    ("novograd_no_bias_correction", "FusedNovoGrad", {}, dict(bias_correction=False), dict(bias_correction=False),
     1e-2, 5e-3),
    ("adagrad_l2", "FusedAdagrad", {}, dict(weight_decay=0.01), NO_DECAY, 5e-2, 2e-2),
    ("adagrad_w_mode", "FusedAdagrad", dict(adagrad_w_mode=True), dict(weight_decay=0.01, eps=1e-8), NO_DECAY,
     5e-2, 2e-2),
]


def run(case, variant, gen, out):
    name, kind, options, g0, g1, lr0, lr1 = case
    rule, defaults, wide = KINDS[kind]
    prefix = f"{name}/{variant}/"
    params, model = harness.start(variant, gen, out, prefix)
    groups = []
    for gi, (over, lr) in enumerate(((g0, lr0), (g1, lr1))):
        group = dict(defaults, **over)
        group.update(lr=lr, params=[params[n] for n in SHAPES if GROUPS[n] == gi])
        groups.append(group)
    opt = Reference(groups, rule, dict(wide, **options))
    ks_all, ps_all = [], []
    for _ in range(STEPS):
        ks = harness.gradients(params, model, gen)
        opt.step()
        harness.copy_back(params, model)
        ks_all.append(flat(ks.values()))
        ps_all.append(flat(params.values()))
    harness.finish(out, prefix, params, opt, ks_all, ps_all)


def main():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(4321)
    out = {}
    meta = []
    for case in CASES:
        name, kind, options, g0, g1, lr0, lr1 = case
        for variant in ("fp32", "o2"):
            run(case, variant, gen, out)
        _, defaults, wide = KINDS[kind]

        def listify(d):
            return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

        meta.append({
            "name": name, "optimizer": kind, "steps": STEPS, "shapes": SHAPES, "groups": GROUPS,
            "options": listify(dict(wide, **options)),
            "param_groups": [dict(listify(dict(defaults, **g0)), lr=lr0), dict(listify(dict(defaults, **g1)), lr=lr1)],
        })
    harness.write(out, meta, len(CASES))


if __name__ == "__main__":
    main()
