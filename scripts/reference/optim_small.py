"""Expected values for tests/amp/optim.rs: torch.optim (PyTorch 2.13, CPU, default single-tensor
algorithms) on the two-parameter problem that test describes, three steps per case.

    $TCH_AMP_PYTHON scripts/reference/optim_small.py OUT.json

Writes {case: {"b": [...], "w": [...]}} with the fp32 results as Python floats (exact). The
Rust test runs it at test time: libtorch's element-wise CPU kernels differ in the last bit
between vector ISAs (AVX2, AVX512), so the values are made on the CPU that runs the test.
"""
import json
import sys

import torch

x = torch.tensor([1.0, 2.0, -0.5, 3.0])
y = torch.tensor([0.3, -1.5, 1.0, 0.5])


def run(make):
    w = torch.tensor([0.5, -1.0, 2.0, 0.25], requires_grad=True)
    b = torch.tensor([0.1, -0.2], requires_grad=True)
    opt = make([b, w])
    for _ in range(3):
        opt.zero_grad()
        loss = ((w * x + b.sum() - y) ** 2).sum()
        loss.backward()
        opt.step()
    return {"b": b.tolist(), "w": w.tolist()}


def sgd(momentum, dampening, wd, nesterov):
    return lambda p: torch.optim.SGD(
        p, lr=0.01, momentum=momentum, dampening=dampening, weight_decay=wd, nesterov=nesterov
    )


def adam(cls, betas, eps, wd, amsgrad):
    return lambda p: cls(p, lr=0.1, betas=betas, eps=eps, weight_decay=wd, amsgrad=amsgrad)


def rmsprop(alpha, eps, wd, momentum, centered):
    return lambda p: torch.optim.RMSprop(
        p, lr=0.01, alpha=alpha, eps=eps, weight_decay=wd, momentum=momentum, centered=centered
    )


CASES = {
    "sgd_plain": sgd(0.0, 0.0, 0.0, False),
    "sgd_momentum_dampening": sgd(0.9, 0.1, 0.0, False),
    "sgd_nesterov": sgd(0.9, 0.0, 0.0, True),
    "sgd_weight_decay": sgd(0.5, 0.0, 0.1, False),
    "adam_default": adam(torch.optim.Adam, (0.9, 0.999), 1e-8, 0.0, False),
    "adam_weight_decay": adam(torch.optim.Adam, (0.8, 0.99), 1e-6, 0.1, False),
    "adam_amsgrad": adam(torch.optim.Adam, (0.9, 0.5), 1e-8, 0.0, True),
    "adam_amsgrad_off": adam(torch.optim.Adam, (0.9, 0.5), 1e-8, 0.0, False),
    "adamw_default": adam(torch.optim.AdamW, (0.9, 0.999), 1e-8, 0.01, False),
    "adamw_amsgrad": adam(torch.optim.AdamW, (0.9, 0.5), 1e-8, 0.01, True),
    "rmsprop_plain": rmsprop(0.99, 1e-8, 0.0, 0.0, False),
    "rmsprop_momentum": rmsprop(0.9, 1e-8, 0.0, 0.9, False),
    "rmsprop_centered": rmsprop(0.99, 1e-8, 0.0, 0.0, True),
    "rmsprop_weight_decay": rmsprop(0.99, 1e-8, 0.1, 0.5, True),
}


def main():
    out = {name: run(make) for name, make in CASES.items()}
    with open(sys.argv[1], "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main()
