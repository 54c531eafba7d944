"""Expected values for tests/amp/param_groups.rs: torch.optim (PyTorch 2.13, CPU, the default
single-tensor algorithm) with parameter groups that set their own hyper-parameters (the BERT
`no_decay` groups: weight decay 0 for biases and LayerNorm, other betas/eps/lr), a group added
with `add_param_group` after some steps, and a user-defined optimizer (BertAdam, the
pytorch-pretrained-bert AdamW variant: no bias correction, weight decay added to the update)
written here in torch ops, which the Rust test implements as its own `UpdateRule`.

Run with the venv's python (TCH_AMP_PYTHON in .cargo/config.toml) from the repository root:

    $TCH_AMP_PYTHON scripts/reference/param_group_fixtures.py tests/fixtures/param_groups.safetensors

As scripts/reference/optim_fixtures.py: each case runs for fp32 parameters ("fp32") and for
fp32 masters of fp16 parameters ("o2", gradients through a loss scale of 65536); parameters
"a" [3], "b" [2, 3] (group 0) and "c" [33] (group 1); stored `p0`, `k` [steps, N], `p` [steps, N]
(parameters after each step, concatenated a, b, c; a parameter not yet in the optimizer keeps
its initial value) and `state/<name>` after the last step. The metadata "cases" gives each
group's settings and, for add_param_group, the step before which group 1 is added.
"""
import json
import sys

import torch
from safetensors.torch import save

STEPS = 12
SCALE = 65536.0
SHAPES = {"a": [3], "b": [2, 3], "c": [33]}


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


def flat(ts):
    return torch.cat([t.detach().reshape(-1) for t in ts])


def make(kind, groups, defaults, lr):
    cls = BertAdam if kind == "BertAdam" else getattr(torch.optim, kind)
    if kind != "BertAdam":
        defaults = dict(defaults, foreach=False)
    return cls(groups, lr=lr, **defaults)


def run(case, variant, gen, out):
    name, kind, defaults, lr, g0, g1, add_at = case
    prefix = f"{name}/{variant}/"
    p0 = {n: (torch.randn(s, generator=gen) * 0.5).half().float() for n, s in SHAPES.items()}
    out[prefix + "p0"] = flat(p0.values())
    if variant == "fp32":
        params = {n: t.clone().requires_grad_(True) for n, t in p0.items()}
        model = None
    else:
        model = {n: t.half().requires_grad_(True) for n, t in p0.items()}
        params = {n: t.detach().float().requires_grad_(True) for n, t in model.items()}
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
        ks = {n: (torch.randn(s, generator=gen) * 0.1).clamp(-0.9, 0.9) for n, s in SHAPES.items()}
        for p in params.values():
            p.grad = None
        if variant == "fp32":
            loss = sum((params[n] * ks[n]).sum() for n in SHAPES)
            loss.backward()
        else:
            ks = {n: k.half() for n, k in ks.items()}
            for t in model.values():
                t.grad = None
            loss = sum((model[n].float() * ks[n].float()).sum() for n in SHAPES)
            (loss.float() * SCALE).backward()
            grads = [model[n].grad.float() for n in SHAPES]
            found_inf = torch.zeros(1)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, torch.full((1,), 1.0 / SCALE))
            assert found_inf.item() == 0.0
            for n, g in zip(SHAPES, grads):
                params[n].grad = g
        opt.step()
        if model is not None:
            with torch.no_grad():
                for g in opt.param_groups:
                    for p in g["params"]:
                        n = next(k for k, v in params.items() if v is p)
                        model[n].copy_(p)
        ks_all.append(flat(ks.values()))
        ps_all.append(flat(params.values()))
    out[prefix + "k"] = torch.stack(ks_all)
    out[prefix + "p"] = torch.stack(ps_all)
    for buf in opt.state[params["a"]]:
        if buf != "step":
            out[prefix + f"state/{buf}"] = flat(opt.state[params[n]][buf] for n in SHAPES)


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
    data = save(out, metadata={"cases": json.dumps(meta), "torch": torch.__version__, "scale": repr(SCALE)})
    with open(sys.argv[1], "wb") as f:
        f.write(data)
    print(f"{len(CASES)} cases, {len(out)} tensors, {len(data)} bytes -> {sys.argv[1]}")


if __name__ == "__main__":
    main()
