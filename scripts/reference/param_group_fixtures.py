"""Expected values for tests/amp/param_groups.rs: torch.optim (PyTorch 2.13, CPU, the default
single-tensor algorithm) with parameter groups that set their own hyper-parameters (the BERT
`no_decay` groups: weight decay 0 for biases and LayerNorm, other betas/eps/lr), a group added
with `add_param_group` after some steps, and a user-defined optimizer (BertAdam, the
pytorch-pretrained-bert AdamW variant: no bias correction, weight decay added to the update)
written here in torch ops, which the Rust test implements as its own `UpdateRule`.

Run with the venv's python (TCH_AMP_PYTHON in .cargo/config.toml) from the repository root:

    $TCH_AMP_PYTHON scripts/reference/param_group_fixtures.py OUT.safetensors

The Rust tests run it themselves at test time (tests/common/reference.rs, Fixture::generated):
libtorch's element-wise CPU kernels differ in the last bit between vector ISAs (AVX2, AVX512),
so the expected values are made on the CPU that runs the tests.

As scripts/reference/optim_fixtures.py: each case runs for fp32 parameters ("fp32") and for
fp32 masters of fp16 parameters ("o2", gradients through a loss scale of 65536); parameters
"a" [3], "b" [2, 3] (group 0) and "c" [33] (group 1); stored `p0`, `k` [steps, N], `p` [steps, N]
(parameters after each step, concatenated a, b, c; a parameter not yet in the optimizer keeps
its initial value) and `state/<name>` after the last step. The metadata "cases" gives each
group's settings and, for add_param_group, the step before which group 1 is added.
"""

import torch

import optim_harness as harness
from optim_harness import SCALE, SHAPES, flat

STEPS = 12


class BertAdam(torch.optim.Optimizer):
    """The user-defined optimizer: m = b1 m + (1 - b1) g; v = b2 v + g^2 (1 - b2);
    update = m / (sqrt(v) + eps) + weight_decay * p; p -= update * lr (no bias correction)."""

    def __init__(self, params, lr, betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self):
        for g in self.param_groups:
            b1, b2 = g["betas"]
            for p in g["params"]:
                if p.grad is None:
                    continue
                st = self.state[p]
                if not st:
                    st["exp_avg"] = torch.zeros_like(p)
                    st["exp_avg_sq"] = torch.zeros_like(p)
                m, v = st["exp_avg"], st["exp_avg_sq"]
                # Ops a tch user has (no `alpha=` arguments, which ATen computes with fused
                # multiply-adds).
                m.mul_(b1).add_(p.grad * (1 - b1))
                v.mul_(b2).add_(p.grad * p.grad * (1 - b2))
                update = m / (v.sqrt() + g["eps"])
                if g["weight_decay"] != 0.0:
                    update = update + p * g["weight_decay"]
                p.sub_(update * g["lr"])


CASES = [
    # name, optimizer, defaults, lr, group 0 options, group 1 options, step at which group 1 is
    # added (0: from the start)
    ("adamw_no_decay", "AdamW", dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01), 1e-2,
     {}, dict(weight_decay=0.0, betas=(0.8, 0.99), eps=1e-6, lr=3e-3), 0),
    ("adam_per_group_betas", "Adam", dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0), 1e-2,
     dict(weight_decay=0.05), dict(betas=(0.5, 0.9), eps=1e-4), 0),
    ("sgd_per_group", "SGD", dict(momentum=0.9, weight_decay=1e-3), 5e-2,
     dict(nesterov=True), dict(momentum=0.5, dampening=0.1, weight_decay=0.0, lr=2e-2), 0),
    ("adamw_add_param_group", "AdamW", dict(betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01), 1e-2,
     {}, dict(weight_decay=0.0, betas=(0.85, 0.95), lr=3e-3), 4),
    ("bert_adam", "BertAdam", dict(betas=(0.9, 0.999), eps=1e-6, weight_decay=0.01), 1e-2,
     {}, dict(weight_decay=0.0), 0),
]



def make(kind, groups, defaults, lr):
    cls = BertAdam if kind == "BertAdam" else getattr(torch.optim, kind)
    if kind != "BertAdam":
        defaults = dict(defaults, foreach=False)
    return cls(groups, lr=lr, **defaults)


def run(case, variant, gen, out):
    name, kind, defaults, lr, g0, g1, add_at = case
    prefix = f"{name}/{variant}/"
    params, model = harness.start(variant, gen, out, prefix)
    first = [dict(g0, params=[params["a"], params["b"]])]
    second = dict(g1, params=[params["c"]])
    opt = make(kind, first + ([second] if add_at == 0 else []), defaults, lr)
    ks_all, ps_all = [], []
    for step in range(STEPS):
        if add_at and step == add_at:
            if model is not None:  # Apex: a new fp16 parameter gets an fp32 master now
                with torch.no_grad():
                    params["c"].copy_(model["c"].float())
            opt.add_param_group(second)
        ks = harness.gradients(params, model, gen)
        opt.step()
        harness.copy_back(params, model, opt)
        ks_all.append(flat(ks.values()))
        ps_all.append(flat(params.values()))
    harness.finish(out, prefix, params, opt, ks_all, ps_all)


def main():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(2024)
    out = {}
    meta = []
    for case in CASES:
        name, kind, defaults, lr, g0, g1, add_at = case
        for variant in ("fp32", "o2"):
            run(case, variant, gen, out)

        def listify(d):
            return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}

        meta.append({"name": name, "optimizer": kind, "steps": STEPS, "shapes": SHAPES, "lr": lr,
                     "defaults": listify(defaults), "group0": listify(g0), "group1": listify(g1), "add_at": add_at})
    harness.write(out, meta, len(CASES))


if __name__ == "__main__":
    main()
