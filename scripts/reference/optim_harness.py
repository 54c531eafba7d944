"""The training harness shared by the optimizer fixture scripts (optim_fixtures.py,
apex_optim_fixtures.py, param_group_fixtures.py): three parameters, a loss linear in each
(so a step's gradient is a drawn tensor k), fp32 parameters or, for "o2", fp16 model
parameters with fp32 masters as Apex's O2 keeps them (scaled backward, unscale with
torch._amp_foreach_non_finite_check_and_unscale_, masters copied back into the model), and
the fixture file's layout (p0, k and p per step, final state). The Rust tests replay the same
gradients and compare bit for bit.
"""
import json
import sys

import torch
from safetensors.torch import save

SCALE = 65536.0
SHAPES = {"a": [3], "b": [2, 3], "c": [33]}


def flat(ts):
    return torch.cat([t.detach().reshape(-1) for t in ts])


def start(variant, gen, out, prefix):
    """Initial values (fp16-representable) recorded as `p0`; returns (params, model): the
    tensors the optimizer steps, and for "o2" the fp16 model (else None)."""
    p0 = {n: (torch.randn(s, generator=gen) * 0.5).half().float() for n, s in SHAPES.items()}
    out[prefix + "p0"] = flat(p0.values())
    if variant == "fp32":
        return {n: t.clone().requires_grad_(True) for n, t in p0.items()}, None
    model = {n: t.half().requires_grad_(True) for n, t in p0.items()}
    params = {n: t.detach().float().requires_grad_(True) for n, t in model.items()}
    return params, model


def gradients(params, model, gen):
    """Draws this step's k, clears the gradients and sets new ones: k directly for fp32; for
    "o2" the fp16 model's scaled gradient (the fp32 product SCALE * k rounded once to fp16,
    exactly), copied to fp32 and unscaled into the masters' .grad. Returns k."""
    ks = {n: (torch.randn(s, generator=gen) * 0.1).clamp(-0.9, 0.9) for n, s in SHAPES.items()}
    for p in params.values():
        p.grad = None
    if model is None:
        loss = sum((params[n] * ks[n]).sum() for n in SHAPES)
        loss.backward()
        return ks
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
    return ks


def copy_back(params, model, opt=None):
    """O2: the masters rounded back into their fp16 model parameters: those in `opt`'s
    param_groups (a torch.optim optimizer), or all of them without `opt`."""
    if model is None:
        return
    held = list(params.values()) if opt is None else [p for g in opt.param_groups for p in g["params"]]
    with torch.no_grad():
        for p in held:
            n = next(k for k, v in params.items() if v is p)
            model[n].copy_(p)


def finish(out, prefix, params, opt, ks_all, ps_all):
    """Records k and p per step and the final optimizer state (all but "step")."""
    out[prefix + "k"] = torch.stack(ks_all)
    out[prefix + "p"] = torch.stack(ps_all)
    for buf in opt.state.get(params["a"], {}):
        if buf != "step":
            out[prefix + f"state/{buf}"] = flat(opt.state[params[n]][buf] for n in SHAPES)


def write(out, meta, cases):
    """The fixture file (path: the script's first argument) with the cases as JSON metadata."""
    data = save(out, metadata={"cases": json.dumps(meta), "torch": torch.__version__, "scale": repr(SCALE)})
    with open(sys.argv[1], "wb") as f:
        f.write(data)
    print(f"{cases} cases, {len(out)} tensors, {len(data)} bytes -> {sys.argv[1]}")
