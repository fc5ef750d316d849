"""
Benchmark: structured empirical NTK against the standard ``torch.func`` Jacobian contraction.

The model is a reference two-layer network in NTK parametrisation (``TwoLayerReLU``, or
``MLPAttn`` with ``--model mlp-attn``) of width ``m`` on random inputs of dimension ``d``, with
``C`` classes. For every width the script times

(a) :func:`art_malleability.ntk.empirical.empirical_ntk` (the structured engine), and
(b) the recipe of PyTorch's "Neural Tangent Kernels" tutorial, written out here: per-example
    Jacobians ``vmap(jacrev(fnet_single), (None, 0))(params, x)`` over ``functional_call``,
    flattened per parameter and contracted with ``einsum('Naf,Maf->NM', ...)`` (the tutorial's
    ``compute='trace'`` variant, the traced kernel that ``empirical_ntk`` returns), summed over
    parameters.

The per-example Jacobians take ``C·P`` numbers per example (``P = m·d``: 122 MiB per example in
float64 at ``m = 2,048``, ``d = 784``), so the recipe is chunked over examples: Jacobians are
computed for blocks of examples that fit ``--func-mb`` MiB, only the upper block triangle is
contracted (the kernel is symmetric) and mirrored, and Jacobian blocks are kept when they all
fit the budget, otherwise recomputed for each block pair. Even unchunked, the recipe computes
``n`` Jacobians (about 0.17 s each at ``m = 2,048`` on 2 CPU cores), so it is run on the first
``--func-n`` examples (default 100; pass ``--func-n`` equal to ``--n`` for the full size, which
takes hours at the default widths on a CPU). The structured kernel is timed both on all ``n``
examples and on the same ``--func-n`` examples, and the ratio compares equal sizes.

The agreement is reported as ``max |K_structured − K_func| / max |K_func|`` on the common
examples. Peak memory is the largest resident set size seen during a call (sampled every
millisecond, minus the size before the call) on the CPU, and ``torch.cuda.max_memory_allocated``
on CUDA.

Usage::

    python benchmarks/bench_ntk.py                      # n = 1000, d = 784, widths 256 1024 2048
    python benchmarks/bench_ntk.py --quick              # smoke run
    python benchmarks/bench_ntk.py --widths 16384 65536 --func-n 0   # structured only
"""

from __future__ import annotations

import argparse
import gc
import time
from collections.abc import Callable

import torch
from _common import PeakMemory
from torch.func import functional_call, jacrev, vmap

from art_malleability.models import MLPAttn, TwoLayerReLU
from art_malleability.ntk.empirical import empirical_ntk

DTYPES = {"float64": torch.float64, "float32": torch.float32}


# --------------------------------------------------------------------------- measurement
def timed(
    fn: Callable[[], torch.Tensor], device: torch.device, repeats: int
) -> tuple[torch.Tensor, float, float | None]:
    """Best wall time of ``repeats`` calls, the result of the last one and the largest peak memory."""
    best, peak, out = float("inf"), None, None
    for _ in range(max(1, repeats)):
        out = None
        with PeakMemory(device) as mem:
            start = time.perf_counter()
            out = fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            best = min(best, time.perf_counter() - start)
        if mem.peak_mib is not None:
            peak = mem.peak_mib if peak is None else max(peak, mem.peak_mib)
    return out, best, peak


# --------------------------------------------------------------------------- torch.func recipe
def ntk_torch_func(model: torch.nn.Module, x: torch.Tensor, block_mb: float) -> torch.Tensor:
    """
    Traced empirical NTK ``K(x, x)`` by the ``torch.func`` recipe of PyTorch's NTK tutorial
    (per-example Jacobians by ``vmap(jacrev(...))``, ``einsum('Naf,Maf->NM')`` per parameter),
    chunked over examples so that one block of Jacobians fits ``block_mb`` MiB.
    """
    params = {k: v.detach() for k, v in model.named_parameters()}

    def fnet_single(p: dict[str, torch.Tensor], xi: torch.Tensor) -> torch.Tensor:
        return functional_call(model, p, (xi.unsqueeze(0),)).squeeze(0)

    def jacobian(xb: torch.Tensor) -> list[torch.Tensor]:
        jac = vmap(jacrev(fnet_single), (None, 0))(params, xb)
        return [j.flatten(2) for j in jac.values()]  # per parameter: (b, C, P_k)

    def contract(j1: list[torch.Tensor], j2: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([torch.einsum("Naf,Maf->NM", a, b) for a, b in zip(j1, j2, strict=True)]).sum(0)

    n = x.shape[0]
    with torch.no_grad():
        n_out = model(x[:1]).shape[1]
    itemsize = x.element_size()
    per_example = n_out * sum(p.numel() for p in params.values()) * itemsize
    block = max(1, min(n, int(block_mb * 2**20) // per_example))
    keep = n * per_example <= block_mb * 2**20  # all Jacobians fit: compute each block once
    starts = list(range(0, n, block))
    cache: dict[int, list[torch.Tensor]] = {}

    def jac_block(i: int) -> list[torch.Tensor]:
        if i in cache:
            return cache[i]
        j = jacobian(x[i : i + block])
        if keep:
            cache[i] = j
        return j

    kernel = torch.empty((n, n), dtype=x.dtype, device=x.device)
    for i in starts:
        j1 = jac_block(i)
        for j in starts:
            if j < i:
                continue
            j2 = j1 if j == i else jac_block(j)
            kb = contract(j1, j2)
            kernel[i : i + block, j : j + block] = kb
            kernel[j : j + block, i : i + block] = kb.T
            del j2, kb
        del j1
    return kernel


# --------------------------------------------------------------------------- main
def build_model(name: str, d: int, width: int, classes: int, x: torch.Tensor, seed: int) -> torch.nn.Module:
    if name == "2l-relu":
        model = TwoLayerReLU(input_shape=d, width=width, nb_classes=classes, seed=seed)
    else:
        model = MLPAttn(input_shape=d, width=width, nb_classes=classes, seed=seed)
        model.set_context(x.cpu())
    return model.to(device=x.device, dtype=x.dtype).eval()


def fmt(v: float | None, spec: str) -> str:
    return "n/a" if v is None else format(v, spec)


def run_width(
    args: argparse.Namespace, x: torch.Tensor, width: int, func_n: int, device: torch.device
) -> tuple[float, float | None, float | None, float | None, float | None, float | None]:
    """Time both methods at one width: structured (all, subset), torch.func (subset), peaks, error."""
    model = build_model(args.model, args.d, width, args.classes, x, args.seed)
    k_full, t_full, m_full = timed(lambda: empirical_ntk(model, x, chunk_mb=args.chunk_mb), device, args.repeats)
    t_sub = t_func = m_func = err = None
    if func_n > 0:
        xs = x[:func_n]
        _, t_sub, _ = timed(lambda: empirical_ntk(model, xs, chunk_mb=args.chunk_mb), device, args.repeats)
        k_func, t_func, m_func = timed(lambda: ntk_torch_func(model, xs, args.func_mb), device, args.func_repeats)
        err = float((k_full[:func_n, :func_n] - k_func).abs().max() / k_func.abs().max())
    return t_full, m_full, t_sub, t_func, m_func, err


def format_row(
    width: int,
    t_full: float,
    m_full: float | None,
    t_sub: float | None,
    t_func: float | None,
    m_func: float | None,
    err: float | None,
) -> str:
    ratio = None if t_func is None or t_sub is None else t_func / t_sub
    ratio_s = "n/a" if ratio is None else f"{ratio:.0f}x"
    return (
        f"{width:>7} | {t_full:>18.3f} {fmt(m_full, '9.0f')} | {fmt(t_sub, '17.3f')} {fmt(t_func, '15.2f')} "
        f"{fmt(m_func, '9.0f')} | {ratio_s:>8} | {fmt(err, '11.1e')}"
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1000, help="examples (default 1000)")
    parser.add_argument("--d", type=int, default=784, help="input dimension (default 784)")
    parser.add_argument("--classes", type=int, default=10, help="outputs C (default 10)")
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 1024, 2048], help="hidden widths")
    parser.add_argument("--model", choices=["2l-relu", "mlp-attn"], default="2l-relu")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:k (default cpu)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float64")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many runs of the structured kernel")
    parser.add_argument("--func-repeats", type=int, default=1, help="best of this many runs of the torch.func recipe")
    parser.add_argument(
        "--func-n", type=int, default=100, help="examples for the torch.func recipe (default 100; 0 skips it)"
    )
    parser.add_argument("--func-mb", type=float, default=2048.0, help="MiB per block of torch.func Jacobians")
    parser.add_argument("--chunk-mb", type=float, default=256.0, help="chunk_mb of the structured kernel")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: n=200, widths 256 512, func-n 50, 1 repeat")
    args = parser.parse_args(argv)
    if args.quick:
        args.n, args.widths, args.func_n, args.repeats = 200, [256, 512], 50, 1

    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    func_n = max(0, min(args.func_n, args.n))
    gen = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.n, args.d, generator=gen, dtype=dtype).to(device)

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, device {device}, dtype {args.dtype}")
    print(
        f"model {args.model}, n = {args.n}, d = {args.d}, C = {args.classes}, chunk_mb = {args.chunk_mb:g}; "
        f"torch.func recipe on the first {func_n} examples (blocks of at most {args.func_mb:g} MiB)"
    )
    header = (
        f"{'width':>7} | {'struct n=' + str(args.n) + ' [s]':>18} {'peak MiB':>9} | "
        f"{'struct n=' + str(func_n) + ' [s]':>17} {'torch.func [s]':>15} {'peak MiB':>9} | "
        f"{'ratio':>8} | {'max rel err':>11}"
    )
    print(header)
    print("-" * len(header))
    for width in args.widths:
        print(format_row(width, *run_width(args, x, width, func_n, device)), flush=True)
        gc.collect()


if __name__ == "__main__":
    main()
