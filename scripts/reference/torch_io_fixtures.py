"""Fixtures and checks for tests/torch_io.rs (tch_amp::torch_io), run with the venv's torch 2.13.

    python torch_io_fixtures.py write DIR GROUPS   # GROUPS: comma-separated, of
        # real  (a state dict, SGD and Adam checkpoints), edge (the edge cases),
        # bad   (files tch-amp must refuse), seeds (the small files the fuzz test mutates),
        # legacy_view (a legacy stream with storage views, as torch < 1.0 wrote them, built by
        #        hand and checked by loading it with torch 2.13 itself)
    python torch_io_fixtures.py check OUT.json FILE[:EXPECT] ...
        # torch.load(FILE) with weights_only=True, with weights_only=False and with mmap=True; all must give the
        # same tree; EXPECT ("edge", or a path to a .pt file torch wrote) names what the tree must
        # equal; the manifests of all FILEs go to OUT.json for the Rust side to compare.

A manifest describes a loaded tree exactly: ints as decimal strings, floats as their IEEE bits,
tensors as dtype, shape, stride, storage offset, requires_grad, the bytes of their elements in
row-major order, and a storage id (numbered in first-use order) so that storage sharing is
compared too.
"""
import json
import os
import pickle
import sys
from collections import OrderedDict

import torch

MAGIC = 0x1950A86A20F9469CFC6C


def manifest(obj):
    storages = {}

    def node(x):
        if x is None:
            return {"t": "none"}
        if isinstance(x, bool):
            return {"t": "bool", "v": x}
        if isinstance(x, int):
            return {"t": "int", "v": str(x)}
        if isinstance(x, float):
            import struct

            return {"t": "float", "bits": struct.pack(">d", x).hex()}
        if isinstance(x, str):
            return {"t": "str", "v": x}
        if isinstance(x, (bytes, bytearray)):
            return {"t": "bytes", "hex": bytes(x).hex()}
        if isinstance(x, torch.Tensor):
            ptr = x.untyped_storage().data_ptr()
            sid = storages.setdefault(ptr, len(storages))
            flat = x.detach().reshape(-1).contiguous()
            raw = flat.view(torch.uint8) if flat.numel() else torch.empty(0, dtype=torch.uint8)
            return {
                "t": "tensor",
                "dtype": str(x.dtype).replace("torch.", ""),
                "shape": list(x.shape),
                "stride": list(x.stride()),
                "offset": x.storage_offset(),
                "requires_grad": x.requires_grad,
                "storage": sid,
                "hex": raw.numpy().tobytes().hex(),
            }
        if isinstance(x, list):
            return {"t": "list", "items": [node(v) for v in x]}
        if isinstance(x, tuple):
            return {"t": "tuple", "items": [node(v) for v in x]}
        if isinstance(x, dict):
            out = {
                "t": "odict" if isinstance(x, OrderedDict) else "dict",
                "items": [[node(k), node(v)] for k, v in x.items()],
            }
            attrs = [[k, node(v)] for k, v in vars(x).items()] if hasattr(x, "__dict__") else []
            if attrs:
                out["attrs"] = attrs
            return out
        raise TypeError(f"no manifest for {type(x)}")

    return node(obj)


def edge_tree():
    """The edge cases; tests/torch_io.rs builds the same tree (fn edge_tree) from the same recipe.
    Every value is exact in its dtype, so both sides build identical bits."""
    base = (torch.arange(24, dtype=torch.float32) - 7) / 8
    m = base.reshape(4, 6)
    tied = torch.arange(10, dtype=torch.float64) / 4
    half_vals = (torch.arange(12, dtype=torch.float32) - 6) / 4
    meta = OrderedDict([("w", torch.arange(3, dtype=torch.float32))])
    meta._metadata = OrderedDict([("", {"version": 1}), ("sub", {"version": 2})])
    return {
        "nested": {"a": {"b": {"c": [1, 2, {"d": (3, 4.5)}]}}},
        "tuple": (1, "two", 3.0, None, True, False),
        "f16": half_vals.to(torch.float16).reshape(3, 4),
        "bf16": half_vals.to(torch.bfloat16).reshape(4, 3),
        "f64": torch.arange(5, dtype=torch.float64) / 16,
        "i64": (torch.arange(6, dtype=torch.int64) - 3) * 2**40,
        "i32": torch.arange(6, dtype=torch.int32) - 3,
        "i16": (torch.arange(6, dtype=torch.int16) - 3) * 1000,
        "i8": torch.arange(6, dtype=torch.int8) - 3,
        "u8": torch.arange(6, dtype=torch.uint8) + 250,
        "bool": torch.tensor([True, False, True]),
        "transposed": m.t(),
        "sliced": m[1:3, 2:5],
        "scalar": torch.tensor(2.5),
        "scalar_i64": torch.tensor(7, dtype=torch.int64),
        "tied_a": tied,
        "tied_b": tied[2:8:2],
        "empty_tensor": torch.zeros(0, 3),
        "big_ints": [2**62, -(2**63), 2**63 - 1, 2**63, -(2**63) - 1, 2**100, -(2**100)],
        "floats": [float("inf"), float("-inf"), float("nan"), -0.0, 5e-324, 1.7976931348623157e308],
        "unicode": {"ключ": "значение", "键": "值", "emoji 🎉": "✓"},
        "empty": {"dict": {}, "list": [], "tuple": (), "odict": OrderedDict(), "str": ""},
        "int_keys": {0: "zero", 1: "one", -5: "minus five", 2**40: "big"},
        "odict": OrderedDict([("z", 1), ("a", 2)]),
        "with_metadata": meta,
        "bytes": b"\x00\x01\xff abc",
        "param": torch.nn.Parameter(torch.ones(2)),
        "c64": torch.complex(torch.arange(3, dtype=torch.float32) / 2, -torch.arange(3, dtype=torch.float32) / 4),
        "c128": torch.complex(torch.arange(2, dtype=torch.float64) / 2, torch.ones(2, dtype=torch.float64)),
    }


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3)
        self.bn = torch.nn.BatchNorm2d(4)
        self.fc = torch.nn.Linear(4 * 4 * 4, 3)

    def forward(self, x):
        return self.fc(torch.relu(self.bn(self.conv(x))).flatten(1))


def trained(opt_name):
    torch.manual_seed(0)
    net = Net()
    if opt_name == "sgd":
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
    else:
        opt = torch.optim.Adam(net.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0)
    for step in range(3):
        x = torch.randn(5, 2, 6, 6)
        y = torch.randint(0, 3, (5,))
        loss = torch.nn.functional.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return net, opt


def save_both(obj, d, name):
    torch.save(obj, os.path.join(d, f"{name}.zip.pt"))
    torch.save(obj, os.path.join(d, f"{name}.legacy.pt"), _use_new_zipfile_serialization=False)
    with open(os.path.join(d, f"{name}.json"), "w") as f:
        json.dump(manifest(obj), f)


class Evil:
    """Pickles as a call of os.system (module "posix" on Linux). Never loaded here."""

    def __init__(self, sentinel):
        self.sentinel = sentinel

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def write(d, groups):
    for g in groups.split(","):
        {"real": write_real, "edge": write_edge, "bad": write_bad, "seeds": seeds,
         "legacy_view": write_legacy_view}[g](d)


def write_real(d):
    net, _ = trained("sgd")
    net.eval()
    save_both(net.state_dict(), d, "state_dict")
    for opt_name in ["sgd", "adam"]:
        net, opt = trained(opt_name)
        ckpt = {
            "epoch": 3,
            "arch": "net",
            "model": net.state_dict(),
            "optimizer": opt.state_dict(),
            "amp": {"loss_scaler0": {"loss_scale": 65536.0, "unskipped": 17}},
            "best_prec1": 0.75,
        }
        save_both(ckpt, d, f"ckpt_{opt_name}")


def write_edge(d):
    save_both(edge_tree(), d, "edge")
    # Pickle protocol 4 (SHORT_BINUNICODE, MEMOIZE, FRAME, ...), which torch.save writes when asked.
    torch.save(edge_tree(), os.path.join(d, "edge.p4.pt"), pickle_protocol=4)


def write_bad(d):
    sentinel = os.path.join(d, "pwned")
    evil = {"model": OrderedDict([("w", torch.ones(2))]), "payload": Evil(sentinel)}
    torch.save(evil, os.path.join(d, "evil.zip.pt"))
    torch.save(evil, os.path.join(d, "evil.legacy.pt"), _use_new_zipfile_serialization=False)
    # A dtype the value tree cannot hold: torch.save writes it with _rebuild_tensor_v3.
    torch.save({"x": torch.arange(4, dtype=torch.int32).to(torch.uint16)}, os.path.join(d, "uint16.pt"))
    # Legacy stream whose first pickle is not the magic number.
    with open(os.path.join(d, "bad_magic.pt"), "wb") as f:
        pickle.dump(12345, f, protocol=2)
        pickle.dump(1001, f, protocol=2)
    seeds(d)


def seeds(d):
    tree = {
        "model": OrderedDict([("w", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.ones(2))]),
        "view": None,
        "opt": {"state": {0: {"step": torch.tensor(3.0), "buf": torch.zeros(3, dtype=torch.float16)}},
                "param_groups": [{"lr": 0.1, "params": [0, 1], "betas": (0.9, 0.999)}]},
        "n": 2**70,
        "s": "text",
    }
    tree["view"] = tree["model"]["w"].t()
    tree["model"]._metadata = OrderedDict([("", {"version": 1})])
    torch.save(tree, os.path.join(d, "seed.zip.pt"))
    torch.save(tree, os.path.join(d, "seed.legacy.pt"), _use_new_zipfile_serialization=False)


def write_legacy_view(d):
    """A legacy stream whose storage persistent ids carry view metadata (view_key, offset, size),
    as torch before 1.0 wrote for storage slices; torch 2.13 no longer writes them, still reads them."""
    import struct

    root = torch.arange(10, dtype=torch.float64) / 8

    class FakeStorage:
        def __init__(self, view):
            self.view = view

    class FakeTensor:
        def __init__(self, storage, offset, size, stride):
            self.args = (storage, offset, size, stride)

        def __reduce__(self):
            s, o, size, stride = self.args
            return (torch._utils._rebuild_tensor_v2, (s, o, size, stride, False, OrderedDict()))

    class P(pickle.Pickler):
        def persistent_id(self, o):
            if isinstance(o, FakeStorage):
                return ("storage", torch.DoubleStorage, "13", "cpu", 10, o.view)
            return None

    whole, view = FakeStorage(None), FakeStorage(("14", 2, 5))
    obj = {"all": FakeTensor(whole, 0, (10,), (1,)), "v1": FakeTensor(view, 1, (3,), (1,)),
           "v2": FakeTensor(view, 0, (2,), (2,))}
    path = os.path.join(d, "legacy_view.pt")
    with open(path, "wb") as f:
        pickle.dump(MAGIC, f, protocol=2)
        pickle.dump(1001, f, protocol=2)
        pickle.dump({"protocol_version": 1001, "little_endian": True,
                     "type_sizes": {"short": 2, "int": 4, "long": 8}}, f, protocol=2)
        P(f, protocol=2).dump(obj)
        pickle.dump(["13"], f, protocol=2)
        f.write(struct.pack("<q", 10) + root.numpy().tobytes())
    loaded = torch.load(path, weights_only=True)
    if loaded["v1"][0].item() != 3 / 8 or loaded["v2"][1].item() != 4 / 8:
        sys.exit("torch.load read the hand-built legacy view file differently than intended")
    with open(os.path.join(d, "legacy_view.json"), "w") as f:
        json.dump(manifest(loaded), f)


def same(a, b, path="<root>"):
    """Exact equality of two manifests, with the first difference's path."""
    if type(a) is not type(b):
        return f"{path}: {a!r:.200} != {b!r:.200}"
    if isinstance(a, dict):
        if set(a) != set(b):
            return f"{path}: keys {sorted(a)} != {sorted(b)}"
        for k in a:
            r = same(a[k], b[k], f"{path}.{k}")
            if r:
                return r
        return None
    if isinstance(a, list):
        if len(a) != len(b):
            return f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            r = same(x, y, f"{path}[{i}]")
            if r:
                return r
        return None
    return None if a == b else f"{path}: {a!r:.200} != {b!r:.200}"


def check(out, specs):
    result = {}
    for spec in specs:
        path, _, expect = spec.partition(":")
        strict = torch.load(path, weights_only=True)
        loose = torch.load(path, weights_only=False)
        m = manifest(strict)
        diff = same(m, manifest(loose))
        if diff:
            sys.exit(f"{path}: weights_only=True and False differ at {diff}")
        # mmap=True maps the storage records in place (they must be 64-byte aligned).
        diff = same(m, manifest(torch.load(path, weights_only=True, mmap=True)))
        if diff:
            sys.exit(f"{path}: mmap=True differs at {diff}")
        if expect == "edge":
            diff = same(m, manifest(edge_tree()))
        elif expect:
            diff = same(m, manifest(torch.load(expect, weights_only=True)))
        if diff:
            sys.exit(f"{path}: differs from {expect} at {diff}")
        # Sharing in the loaded tensors themselves (not only in the manifest): writing through
        # one view must show in the other.
        if expect == "edge":
            strict["tied_b"][0] = 100.0
            if strict["tied_a"][2].item() != 100.0:
                sys.exit(f"{path}: tied_a and tied_b do not share storage after torch.load")
        result[path] = m
    with open(out, "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    cmd = sys.argv[1]
    if cmd == "write":
        write(sys.argv[2], sys.argv[3])
    elif cmd == "check":
        check(sys.argv[2], sys.argv[3:])
    else:
        sys.exit(f"unknown command {cmd}")
