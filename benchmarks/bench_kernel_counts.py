"""
Benchmark: what the traced empirical NTK costs in operator calls, backward passes, ``torch.func`` calls and host
synchronisations, per method of the kernel engine (the counts a GPU pays for in kernel launches and stalls, measured
here on any device).

For each model the script computes the whole ``n × n`` traced kernel (``JacobianGram(...).gram(x)``, the call
behind ``empirical_ntk(model, x)``, float64) with sub-batches of ``--batch-size`` examples and a chunk budget large
enough that nothing is split further, once per method, and prints per 1,000 examples

- **operator calls**: aten operators dispatched (a ``TorchDispatchMode`` counter), less views and metadata-only
  operators (``view``, ``t``, ``expand``, ``as_strided``, ``detach``, ``alias``, ``_unsafe_view``, ``empty``, ...):
  on a GPU each would be at least one kernel launch;
- **host syncs**: ``aten._local_scalar_dense`` (``.item()``, ``bool(tensor)``, ``int(tensor)``), ``aten.nonzero``,
  ``aten.is_nonzero`` and ``aten.equal``, each a device-to-host wait on a GPU;

and per sub-batch (a forward/backward pass of the engine)

- **backward calls**: ``torch.autograd.grad`` / ``torch.autograd.backward`` calls plus outermost ``torch.func``
  calls (each runs one reverse pass, batched over whatever it ``vmap``-s);
- **torch.func calls**: outermost calls of ``torch.func`` transforms (``vmap``, ``jacrev``, ``vjp``, ``grad``, ...;
  a transform called inside another one is not counted again);

and for the whole kernel its floating-point operations per operator call (``torch.utils.flop_counter``, with the
formula of ``convolution_backward`` corrected for grouped convolutions, which ``vmap`` makes of per-example weight
gradients and the stock formula counts ``groups`` times over) and its
rate (those operations over the wall-clock seconds of a second, uncounted call) as a share of the fp64 GEMM rate
(``torch.mm`` of two 2048² float64 matrices, best of three, measured in the same run). The counted call also warms
the timed one up.

The targets of the batched method (printed beside the numbers): one backward call and at most one ``torch.func``
call per sub-batch whatever ``C`` is; at most 30 operator calls per 1,000 examples for the 2L-ReLU and 150 for a
convolutional network with batch norm; no host sync inside ``gram``; at least 1 GFLOP per operator call at
``n ≥ 8,192``; and ``"auto"`` on the CPU no slower than before.

    python benchmarks/bench_kernel_counts.py                  # 2L-ReLU, SmallCNN (n = 2,048), ResNet-20 (n = 128)
    python benchmarks/bench_kernel_counts.py --quick          # smoke run (seconds)
    python benchmarks/bench_kernel_counts.py --models 2l-relu --n 8192 --methods batched
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from math import prod

import torch
import torch.func
from _common import table
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from art_malleability.models import ResNet20, SmallCNN, TwoLayerReLU
from art_malleability.ntk.empirical import JacobianGram

aten = torch.ops.aten

# operators that only make a new view of, or describe, existing memory: no kernel launch on a GPU
_METADATA = {
    aten.view, aten._unsafe_view, aten.t, aten.transpose, aten.permute, aten.expand, aten.as_strided, aten.detach,
    aten.alias, aten.lift_fresh, aten.squeeze, aten.unsqueeze, aten.slice, aten.select, aten.reshape,
    aten.empty, aten.empty_strided, aten.empty_like, aten.new_empty, aten.new_empty_strided, aten.sym_size,
    aten.sym_stride, aten.sym_numel, aten.sym_storage_offset, aten.is_same_size, aten._reshape_alias,
    aten.unbind, aten.split, aten.chunk, aten.diagonal, aten.unfold, aten.narrow, aten.resize_,
}
# operators whose result the host waits for
_SYNCS = {aten._local_scalar_dense, aten.nonzero, aten.is_nonzero, aten.equal}

MODELS: dict[str, tuple[Callable[[int], torch.nn.Module], tuple[int, ...], int, int]] = {
    # name: (builder(C), input shape, default n, default sub-batch)
    "2l-relu": (lambda c: TwoLayerReLU((1, 28, 28), 512, c), (1, 28, 28), 2048, 1024),
    "cnn": (lambda c: SmallCNN((1, 28, 28), c), (1, 28, 28), 2048, 1024),
    "resnet20": (lambda c: ResNet20((3, 32, 32), c), (3, 32, 32), 128, 64),
}
# the targets of operator calls per 1,000 examples
OP_TARGETS = {"2l-relu": 30, "cnn": 150, "resnet20": 150}


class OperatorCounter(TorchDispatchMode):
    """Counts the aten operators dispatched, less views and metadata-only ones, and the host syncs among them."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.syncs = 0
        self.by_name: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        packet = func.overloadpacket
        if packet in _SYNCS:
            self.syncs += 1
        if packet not in _METADATA and not func.is_view:
            self.ops += 1
            self.by_name[str(packet)] = self.by_name.get(str(packet), 0) + 1
        return func(*args, **(kwargs or {}))


@dataclass
class CallCounts:
    """Calls of ``torch.autograd`` backward functions and outermost ``torch.func`` transforms."""

    autograd: int = 0
    func: int = 0
    depth: int = 0
    by_name: dict[str, int] = field(default_factory=dict)


_TRANSFORMS = ("vmap", "jacrev", "jacfwd", "vjp", "jvp", "grad", "grad_and_value", "hessian", "linearize")


@contextlib.contextmanager
def counting_calls() -> Iterator[CallCounts]:
    """
    Count ``torch.autograd.grad`` / ``backward`` calls and outermost ``torch.func`` transform calls, wherever the
    package refers to them (``torch.func.<name>`` and names imported from it into the package's modules).
    """
    counts = CallCounts()
    originals = {name: getattr(torch.func, name) for name in _TRANSFORMS}

    def outermost(name: str, run: Callable) -> Callable:
        @functools.wraps(run)
        def call(*args, **kwargs):  # noqa: ANN002, ANN003
            if counts.depth == 0:
                counts.func += 1
                counts.by_name[name] = counts.by_name.get(name, 0) + 1
            counts.depth += 1
            try:
                return run(*args, **kwargs)
            finally:
                counts.depth -= 1

        return call

    def transform(name: str, original: Callable) -> Callable:
        if name in ("vjp", "jvp", "linearize"):  # called with the primals: the call itself is the transform
            return outermost(name, original)

        @functools.wraps(original)
        def make(*args, **kwargs):  # noqa: ANN002, ANN003
            return outermost(name, original(*args, **kwargs))

        return make

    def backward(original: Callable) -> Callable:
        @functools.wraps(original)
        def call(*args, **kwargs):  # noqa: ANN002, ANN003
            if counts.depth == 0:
                counts.autograd += 1
            return original(*args, **kwargs)

        return call

    patched: list[tuple[object, str, object]] = []

    def patch(owner: object, name: str, value: object) -> None:
        patched.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    wrapped = {name: transform(name, original) for name, original in originals.items()}
    by_id = {id(original): name for name, original in originals.items()}
    for name, value in wrapped.items():
        patch(torch.func, name, value)
    for module in [m for n, m in sys.modules.items() if n.startswith("art_malleability") and m is not None]:
        for attr, value in list(vars(module).items()):
            if id(value) in by_id and value is originals[by_id[id(value)]]:
                patch(module, attr, wrapped[by_id[id(value)]])
    patch(torch.autograd, "grad", backward(torch.autograd.grad))
    patch(torch.autograd, "backward", backward(torch.autograd.backward))
    try:
        yield counts
    finally:
        for owner, name, value in reversed(patched):
            setattr(owner, name, value)


def conv_backward_flops(grad_out_shape, x_shape, w_shape, _bias, _stride, _padding, _dilation, transposed,  # noqa: ANN001
                        _output_padding, _groups, output_mask, out_shape=None, **kwargs) -> int:  # noqa: ANN001, ANN003
    """
    Operations of ``aten.convolution_backward``: as many as the forward convolution for each gradient asked for
    (input, weight). The stock formula takes the input's channels as the weight gradient's reduction size, which
    counts a grouped convolution (what ``vmap`` makes of per-example weight gradients) ``groups`` times over.
    """
    spatial = x_shape[2:] if transposed else grad_out_shape[2:]
    forward = 2 * grad_out_shape[0] * prod(w_shape) * prod(spatial)
    return forward * (int(bool(output_mask[0])) + int(bool(output_mask[1])))


def fp64_gemm_rate(size: int = 2048, repeats: int = 3) -> float:
    """Best FLOP/s of ``torch.mm`` on two ``size × size`` float64 matrices."""
    gen = torch.Generator().manual_seed(0)
    a = torch.randn((size, size), generator=gen, dtype=torch.float64)
    b = torch.randn((size, size), generator=gen, dtype=torch.float64)
    out = torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b, out=out)
        best = min(best, time.perf_counter() - start)
    return 2.0 * size**3 / best


def measure(name: str, method: str, n: int, batch_size: int, classes: int) -> dict:
    """Counts, FLOPs and wall-clock time of one traced ``n × n`` kernel."""
    builder, shape, _, _ = MODELS[name]
    model = builder(classes).double().eval()
    x = torch.rand((n, *shape), dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    chunk_mb = 1e6  # large enough that only batch_size splits the work

    engine = JacobianGram(model, method=method, batch_size=batch_size, chunk_mb=chunk_mb)
    sub_batches = [0]
    inner = engine._sub_batch_features

    def counted_sub_batch(xb: torch.Tensor, yb: torch.Tensor | None) -> object:
        sub_batches[0] += 1
        return inner(xb, yb)

    engine._sub_batch_features = counted_sub_batch
    flops = FlopCounterMode(display=False, custom_mapping={aten.convolution_backward: conv_backward_flops})
    ops = OperatorCounter()
    with counting_calls() as calls, flops, ops:
        engine.gram(x)
    engine = JacobianGram(model, method=method, batch_size=batch_size, chunk_mb=chunk_mb)
    start = time.perf_counter()
    engine.gram(x)
    seconds = time.perf_counter() - start
    per_k = 1000.0 / n
    total_flops = float(flops.get_total_flops())
    return {
        "ops": ops.ops * per_k,
        "syncs": ops.syncs * per_k,
        "sub_batches": sub_batches[0],
        "backward": (calls.autograd + calls.func) / max(sub_batches[0], 1),
        "func": calls.func / max(sub_batches[0], 1),
        "flops_per_op": total_flops / max(ops.ops, 1),
        "flops": total_flops,
        "seconds": seconds,
        "top_ops": sorted(ops.by_name.items(), key=lambda kv: -kv[1])[:8],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=["2l-relu", "cnn", "resnet20"])
    parser.add_argument("--methods", nargs="+", default=["auto", "batched"])
    parser.add_argument("--n", type=int, default=None, help="examples (default per model: 2,048; ResNet-20 128)")
    parser.add_argument("--batch-size", type=int, default=None, help="sub-batch (default 1,024; ResNet-20 64)")
    parser.add_argument("--classes", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--top", action="store_true", help="also list the most called operators")
    parser.add_argument("--quick", action="store_true", help="smoke run: n = 64, sub-batches of 32, small GEMM")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    gemm = fp64_gemm_rate(512 if args.quick else 2048)
    print(f"{torch.get_num_threads()} thread(s), torch {torch.__version__}: fp64 GEMM {gemm / 1e9:.1f} GFLOP/s "
          "(measured in this run); \"auto\" chooses by counted work (benchmarks/bench_zoo.py)\n")
    rows, tops = [], []
    for name in args.models:
        _, _, n_default, bs_default = MODELS[name]
        n = 64 if args.quick else (args.n or n_default)
        bs = 32 if args.quick else (args.batch_size or bs_default)
        for method in args.methods:
            r = measure(name, method, n, bs, args.classes)
            rate = r["flops"] / r["seconds"]
            rows.append([
                name, method, f"{n:,}", f"{bs:,}", r["sub_batches"], f"{r['backward']:.2f}", f"{r['func']:.2f}",
                f"{r['ops']:,.0f}", f"≤ {OP_TARGETS[name]}", f"{r['syncs']:,.1f}", f"{r['flops_per_op'] / 1e6:,.1f}",
                f"{r['seconds']:.2f}", f"{rate / 1e9:.2f}", f"{rate / gemm:.0%}",
            ])
            tops.append((name, method, r["top_ops"]))
            print(f"  {name} / {method}: done in {r['seconds']:.1f} s", file=sys.stderr, flush=True)
    headers = [
        "model", "method", "n", "sub-batch", "sub-batches", "backward calls / sub-batch (target 1)",
        "torch.func calls / sub-batch (target ≤ 1)", "operator calls / 1k examples", "target",
        "host syncs / 1k examples (target 0)", "MFLOP / operator call (target ≥ 1,000 at n ≥ 8,192)", "seconds",
        "GFLOP/s", "share of fp64 GEMM",
    ]
    print(table(headers, rows))
    if args.top:
        for name, method, top in tops:
            print(f"\n{name} / {method}: " + ", ".join(f"{op} {count:,}" for op, count in top))


if __name__ == "__main__":
    main()
