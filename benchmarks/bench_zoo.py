"""
Benchmark: the NTK engines on architectures we did not write (torchvision's, with random weights; a recurrent
classifier) and on the package's own models, float64, 32 x 32 RGB inputs, 10 classes.

Parts (``--parts``):

- **kernel**: for each model and each ``n`` of ``--sizes``, the traced ``n × n`` kernel (``JacobianGram(model,
  method=m).gram(x)``, the call behind ``empirical_ntk``) once per method with a fresh engine each time (planning and,
  for ``"auto"``, its counting included; the methods in turn, best of three up to 64 examples, as this machine's speed
  drifts by a third from minute to minute): each method's seconds, the method ``"auto"`` chose, ``"auto"`` over the
  fastest method, the exactness of ``"auto"`` against ``"jacobian"`` (``max |ΔK| / max |K|`` on the first examples,
  as many as the whole per-example Jacobian fits in ``--jacobian-gb``), and the rate of the useful operations (the
  counted operations of the factors and of the contraction, ``MethodChoice.costs``) over the wall time of ``"auto"``,
  as a share of the fp64 GEMM rate measured in the same run. ``"jacobian"`` runs where its Jacobians fit
  ``--jacobian-gb``.
- **factors**: the counted operations of one example's Jacobian factors (the chosen method's) over ``C`` times the
  counted operations of one backward pass of that example with its weight gradients (target: at most 3).
- **audit**: a default audit, ``MalleabilityEstimator(classifier).evaluate(x, y, x_test=..., y_test=...)`` with
  ``--audit-train`` training images and ``--audit-queries`` queries (the CIFAR-10 test images of ``--cifar`` when
  given, else uniform noise; labels from the model's own predictions), its estimate (``estimator.estimate``) against
  its measured seconds (target: within 2x).

Targets of the issue, printed beside the numbers: ``"auto"`` within 1.5x of the fastest method at 16 to 512
examples; the useful rate at least 50 % of the GEMM rate where the contraction dominates (ResNet-18 at a few hundred
examples); the factors within 3x of ``C`` backward passes; the estimate within 2x of the measured audit.

    python benchmarks/bench_zoo.py                                    # the default set, n = 16, 64, 256
    python benchmarks/bench_zoo.py --models resnet18 --sizes 16 512   # ResNet-18 at 512
    python benchmarks/bench_zoo.py --parts audit --cifar ../shared/data/cifar10/cifar10_test_jpeg.npz
    python benchmarks/bench_zoo.py --quick                            # smoke run (a minute)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from typing import Any

import numpy as np
import torch
from _common import gemm_rate, library_state, table, to_json
from _zoo import DEFAULT, SHAPE, ZOO, build
from torch.utils.flop_counter import FlopCounterMode

from art_malleability.ntk.empirical import JacobianGram

METHODS = ("auto", "structured", "batched", "jacobian")


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def _numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def kernel_case(name: str, n: int, jacobian_gb: float, chunk_mb: float, gemm: float, repeats: int) -> dict[str, Any]:
    """Each method's kernel of ``n`` examples of ``name`` (best of ``repeats``, the methods in turn): seconds, the
    choice, exactness and the useful rate."""
    gen = torch.Generator().manual_seed(1)
    x = torch.rand(n, *SHAPE, generator=gen, dtype=torch.float64)
    model = build(name, context=x)
    c = 10
    jac_bytes = 8 * c * _numel(model)
    seconds: dict[str, float] = {}
    kernels: dict[str, torch.Tensor] = {}
    row: dict[str, Any] = {"model": name, "n": n, "parameters": _numel(model)}
    for method in METHODS:  # warm-up: torch's lazy initialisations land on no method's clock
        if method != "jacobian" or 2 * jac_bytes <= jacobian_gb * 2**30:
            JacobianGram(model, method=method, chunk_mb=chunk_mb).gram(x[:2])
    for _ in range(repeats):  # the methods in turn, each's best time (this machine's speed drifts)
        for method in METHODS:
            if method == "jacobian" and n * jac_bytes > jacobian_gb * 2**30:
                continue
            gc.collect()
            engine = JacobianGram(model, method=method, chunk_mb=chunk_mb)
            start = time.perf_counter()
            kernels[method] = engine.gram(x)
            seconds[method] = min(seconds.get(method, float("inf")), time.perf_counter() - start)
            if method == "auto":
                row["chosen"] = engine.path
                row["choice"] = engine.choice.to_dict()
    fastest = min((m for m in seconds if m != "auto"), key=seconds.get)
    row.update(seconds=seconds, fastest=fastest, ratio=seconds["auto"] / seconds[fastest])
    # exactness of the default against torch.func's Jacobians, on as many examples as they fit
    k = min(n, max(1, int(jacobian_gb * 2**30 // jac_bytes)))
    if "jacobian" in kernels:
        row["exactness"] = _rel(kernels["auto"], kernels["jacobian"])
        row["exact_on"] = n
    elif k >= 2:
        ref = JacobianGram(model, method="jacobian").gram(x[:k])
        row["exactness"] = _rel(kernels["auto"][:k, :k], ref)
        row["exact_on"] = k
    choice = row["choice"]["costs"][row["chosen"]]
    pairs = n * (n + 1) / 2
    useful = n * choice["example_flops"] + pairs * choice["pair_flops"]
    row["useful_gflops"] = useful / 1e9
    row["rate_share"] = useful / seconds["auto"] / (gemm * 1e9)
    row["contraction_share"] = pairs * choice["pair_flops"] / useful
    return row


def factors_case(name: str) -> dict[str, Any]:
    """Counted operations of one example's factors against ``C`` backward passes with weight gradients."""
    x = torch.rand(4, *SHAPE, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    model = build(name, context=x)
    engine = JacobianGram(model).prepare(x, 64)
    factors = engine.choice.costs[engine.path].example_flops
    params = [p for p in model.parameters() if p.requires_grad]
    with FlopCounterMode(display=False) as counter:
        out = model(x)
        torch.autograd.grad(out[:, 0].sum(), params, allow_unused=True)
    backward = counter.get_total_flops() / len(x)  # forward and one backward pass, weight gradients included
    return {"model": name, "factor_gflop": factors / 1e9, "backward_gflop": backward / 1e9,
            "ratio": factors / (10 * backward)}


def audit_case(name: str, n_train: int, n_queries: int, cifar: str | None, home: str, influence: str,
               projection_dim: str) -> dict[str, Any]:
    """A default audit of ``name`` (with ``influence`` and ``projection_dim``): its estimate against its measured
    seconds."""
    os.environ["HOME"] = home  # ART writes ~/.art on import
    from art.estimators.classification import PyTorchClassifier

    from art_malleability import MalleabilityEstimator

    rng = np.random.default_rng(3)
    if cifar:
        data = np.load(cifar)
        idx = rng.choice(len(data["x"]), n_train + n_queries, replace=False)
        x = data["x"][idx].transpose(0, 3, 1, 2).astype(np.float32) / 255.0
    else:
        x = rng.random((n_train + n_queries, *SHAPE), dtype=np.float32)
    model = build(name, dtype=torch.float32, context=torch.as_tensor(x[:n_train]))
    with torch.no_grad():
        y = model(torch.as_tensor(x)).argmax(1).numpy()
    y = np.where(rng.random(len(y)) < 0.5, y, rng.integers(0, 10, len(y)))  # labels the model half gets right
    clf = PyTorchClassifier(model, torch.nn.CrossEntropyLoss(), input_shape=SHAPE, nb_classes=10,
                            clip_values=(0.0, 1.0), device_type="cpu")
    options: dict[str, Any] = {} if influence == "ntk" else {"influence": influence}
    if projection_dim != "auto":
        options["projection_dim"] = None if projection_dim == "none" else int(projection_dim)
    est = MalleabilityEstimator(clf, verbose=False, **options)
    xt, yt, xq, yq = x[:n_train], y[:n_train], x[n_train:], y[n_train:]
    start = time.perf_counter()
    plan = est.estimate(xt, x_test=xq)
    planned = time.perf_counter() - start
    start = time.perf_counter()
    report = est.evaluate(xt, yt, x_test=xq, y_test=yq)
    measured = time.perf_counter() - start
    execution = report.execution
    return {"model": name, "influence": influence, "n_train": n_train, "n_queries": n_queries, "mode": plan.mode,
            "estimate": plan.seconds["total"], "estimate_parts": dict(plan.seconds), "measured": measured,
            "planning": planned, "ratio": plan.seconds["total"] / measured,
            "kernel_method": (execution.get("kernel_method") or {}).get("method")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", choices=sorted(ZOO), default=list(DEFAULT))
    parser.add_argument("--sizes", nargs="+", type=int, default=[16, 64, 256])
    parser.add_argument("--parts", nargs="+", choices=("kernel", "factors", "audit"),
                        default=["kernel", "factors", "audit"])
    parser.add_argument("--jacobian-gb", type=float, default=3.0, help="memory the whole Jacobians may take")
    parser.add_argument("--chunk-mb", type=float, default=1024.0, help="the engines' chunk budget (MiB)")
    parser.add_argument("--audit-train", type=int, default=96)
    parser.add_argument("--audit-queries", type=int, default=24)
    parser.add_argument("--cifar", default=None, help="a CIFAR-10 .npz (arrays x, y) for the audits' images")
    parser.add_argument("--audit-influence", choices=("ntk", "gradient", "captum"), default="ntk")
    parser.add_argument("--audit-projection-dim", default="auto", help="'auto', 'none' (exact) or an integer k")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="smoke run: two small models, n = 8")
    args = parser.parse_args()
    if args.quick:
        args.models, args.sizes, args.audit_train, args.audit_queries = ["cnn", "vit"], [8], 24, 8
    torch.set_num_threads(args.threads)
    gemm = gemm_rate(torch.float64, size=1024 if args.quick else 4096)
    print(f"{torch.get_num_threads()} thread(s), torch {torch.__version__}: fp64 GEMM {gemm:.1f} GFLOP/s "
          "(measured in this run)\n", flush=True)
    results: dict[str, Any] = {"gemm_gflops": gemm, "threads": args.threads, "library": library_state()}
    if "kernel" in args.parts:
        rows = []
        for name in args.models:
            for n in args.sizes:
                r = kernel_case(name, n, args.jacobian_gb, args.chunk_mb, gemm, 3 if n <= 64 else 1)
                rows.append(r)
                s = r["seconds"]
                print(f"{name} n={n}: " + ", ".join(f"{m} {v:.2f} s" for m, v in s.items())
                      + f"; auto ran {r['chosen']} ({r['ratio']:.2f}x the fastest, {r['fastest']}); "
                      f"exact to {r.get('exactness', float('nan')):.1e}; useful rate {r['rate_share']:.0%} of GEMM",
                      flush=True)
        results["kernel"] = rows
        print("\n" + table(
            ["model", "n", "auto (s)", "structured (s)", "batched (s)", "jacobian (s)", "auto ran", "auto / fastest",
             "≤ 1.5x", "exact (max rel)", "useful GFLOP", "rate / GEMM", "contraction share"],
            [[r["model"], r["n"], *(r["seconds"].get(m) for m in METHODS), r["chosen"], r["ratio"],
              "yes" if r["ratio"] <= 1.5 else "no", r.get("exactness"), r["useful_gflops"], r["rate_share"],
              r["contraction_share"]] for r in rows]), flush=True)
    if "factors" in args.parts:
        rows = [factors_case(name) for name in args.models]
        results["factors"] = rows
        print("\n" + table(["model", "factors / example (GFLOP)", "one backward (GFLOP)", "factors / (C backward)",
                            "≤ 3"],
                           [[r["model"], r["factor_gflop"], r["backward_gflop"], r["ratio"],
                             "yes" if r["ratio"] <= 3 else "no"] for r in rows]), flush=True)
    if "audit" in args.parts:
        import tempfile

        home = tempfile.mkdtemp(prefix="bench-zoo-home-")
        rows = []
        for name in args.models:
            r = audit_case(name, args.audit_train, args.audit_queries, args.cifar, home, args.audit_influence,
                           args.audit_projection_dim)
            rows.append(r)
            print(f"audit {name}: estimated {r['estimate']:.1f} s, measured {r['measured']:.1f} s "
                  f"({r['ratio']:.2f}x), mode {r['mode']}, kernel {r['kernel_method']}", flush=True)
        results["audit"] = rows
        print("\n" + table(["model", "influence", "mode", "kernel method", "estimate (s)", "measured (s)",
                            "estimate / measured", "within 2x"],
                           [[r["model"], r["influence"], r["mode"], r["kernel_method"], r["estimate"], r["measured"],
                             r["ratio"], "yes" if 0.5 <= r["ratio"] <= 2 else "no"] for r in rows]), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(to_json(results), handle, indent=1)


if __name__ == "__main__":
    main()
