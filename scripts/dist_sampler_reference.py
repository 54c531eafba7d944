"""Prints the expected index sequences of tests/distributed.rs (sampler_matches_torch_distributed_sampler)
from torch's own DistributedSampler (torch 2.13.0): shuffle=True, num_replicas=3.

    $(grep TCH_AMP_PYTHON .cargo/config.toml | cut -d'"' -f2) scripts/dist_sampler_reference.py
"""
from torch.utils.data import DistributedSampler

CASES = [  # (len, rank, seed, drop_last, epoch)
    (10, 0, 0, False, 0),
    (10, 1, 0, False, 0),
    (10, 2, 0, False, 0),
    (10, 0, 0, False, 1),
    (10, 2, 7, True, 3),
    (100, 1, 42, False, 5),
    (2, 2, 1, False, 0),
]

for n, rank, seed, drop_last, epoch in CASES:
    s = DistributedSampler(range(n), num_replicas=3, rank=rank, shuffle=True, seed=seed, drop_last=drop_last)
    s.set_epoch(epoch)
    idx = ", ".join(str(i) for i in s)
    print(f"    ({n}, {rank}, {seed}, {str(drop_last).lower()}, {epoch}, &[{idx}]),")
for n, rank, drop_last in [(10, 0, False), (10, 1, False), (10, 2, False), (10, 2, True), (2, 2, False)]:
    s = DistributedSampler(range(n), num_replicas=3, rank=rank, shuffle=False, drop_last=drop_last)
    print("# shuffle=False", n, rank, drop_last, list(s))
