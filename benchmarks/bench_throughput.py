"""
Benchmark: throughput of the projected NTK influence on MNIST, on the CPU: its share of the machine's GEMM rate
(``gemm``) and its speed-up over two processes (``shard``).

``gemm``
    Share of this machine's fp32 GEMM rate (``torch.mm`` on 4096 × 4096 float32 matrices with ``--threads``
    threads, best of three, measured in the same process) reached by the projected NTK influence's feature and
    solve phases on the 2L-ReLU (width 512, n = ``--gemm-n`` = 16k MNIST-shaped examples, k = 4096). The
    floating-point operations of each phase are counted analytically (matrix products only, elementwise work
    ignored; one multiply-add = 2 flops):

    - features, per example (d = 784 inputs, m = 512 hidden units, C = 10 classes, k = k_out · k_in):
      forward ``2dm + 2mC``; C backward passes to the hidden layer's output, ``C · 2Cm``; projection of the
      output-side factor ``C · 2m · k_out`` (class block by class block); of the input-side factor ``2d · k_in``;
      their outer product ``2 k_out k_in``;
    - solve (primal, n > k): ``ΦᵀΦ`` ``2nk²`` (a full GEMM, as computed), ``ΦᵀY`` ``2nkC``, Cholesky ``k³/3``,
      triangular inverse ``k³/3``, weights ``4k²C``, hat diagonal ``2nk² + 2nk`` (``‖L⁻¹φ_i‖²``), residuals
      ``2nkC``.

    GFLOP/s = flops / the phase's ``seconds_``; the target is ≥ 30 % of the fp32 GEMM rate. The float64 GEMM rate
    is reported as well: the features are computed in float64 (the estimator's default dtype) and the solve is
    always float64. The fit is repeated with ``dtype=torch.float32`` (float32 features, float64 solve) for the
    feature phase's rate in float32.

``shard``
    Sharding efficiency of the projected NTK influence (2L-ReLU width 512, n = ``--shard-n`` = 16k, k = 4096,
    fit then scores of ``--n-queries`` queries): one process with one thread (``OMP_NUM_THREADS=1``,
    ``torch.set_num_threads(1)``) against two gloo processes with one thread each, launched with
    ``python -m torch.distributed.run --standalone --nproc-per-node 2``; each calls
    ``art_malleability.distributed.init_from_env("gloo")`` and fits the same ``NTKInfluence`` on the same
    arrays (the library shards the rows itself). Reported per rank: ``seconds_`` phases and wall time; the
    speed-up of the feature phase (target ≥ 1.6×) and the share of the run spent in all-reduce and gathers
    (``seconds_["communication"]`` over the rank's wall time of fit + scores; target < 10 %).

Every heavy case runs in its own subprocess; scratch files, timeouts, failures and the MNIST folder are as
``_cases.py`` describes.

Usage (from the repository root)::

    python benchmarks/bench_throughput.py gemm shard          # a few minutes
    python benchmarks/bench_throughput.py all --quick         # tiny sizes: checks the script in about a minute
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from _cases import (
    INPUT_SHAPE,
    NB_CLASSES,
    Bench,
    common_parser,
    load_mnist,
    load_model,
    quick_common,
    run_parts,
    timed_fit_scores,
    write_result,
)
from _common import gemm_rate, mib, rss_bytes, set_threads, table, verdict

PARTS = ("gemm", "shard")
TARGET_GEMM_SHARE = 0.30
TARGET_SHARD_SPEEDUP = 1.6
TARGET_COMM_SHARE = 0.10


def feature_flops_2l(n: int, d: int, m: int, c: int, k_out: int, k_in: int) -> dict[str, float]:
    """Matrix-product flops of the projected features of the 2L-ReLU (see the module docstring)."""
    parts = {
        "forward": 2.0 * d * m + 2.0 * m * c,
        "backward (C passes)": c * 2.0 * c * m,
        "output-side projection": c * 2.0 * m * k_out,
        "input-side projection": 2.0 * d * k_in,
        "outer product": 2.0 * k_out * k_in,
    }
    return {key: n * value for key, value in parts.items()}


def solve_flops_primal(n: int, k: int, c: int) -> dict[str, float]:
    """Flops of the primal solve (see the module docstring)."""
    return {
        "PhiT Phi": 2.0 * n * k * k,
        "PhiT Y": 2.0 * n * k * c,
        "Cholesky": k**3 / 3.0,
        "triangular inverse": k**3 / 3.0,
        "weights": 4.0 * k * k * c,
        "hat diagonal": 2.0 * n * k * k + 2.0 * n * k,
        "residuals": 2.0 * n * k * c,
    }


def case_gemm(spec: dict[str, Any]) -> None:
    import torch

    from art_malleability.influence import NTKInfluence

    set_threads(spec["threads"])
    rates = {"float32": gemm_rate(torch.float32), "float64": gemm_rate(torch.float64)}
    data = load_mnist(spec["root"], spec["n"], 0, spec["seed"], spec["pool_limit"], spec["cache"])
    x, y = data.x, data.y
    model = load_model(spec)
    base = rss_bytes()
    est = NTKInfluence(projection_dim=spec["k"], device="cpu")
    start = time.perf_counter()
    est.fit(model, x, y)
    fit_s = time.perf_counter() - start
    if type(est.solver_).__name__ != "PrimalRidge":
        raise RuntimeError(f"expected the primal solve (n > k), got {type(est.solver_).__name__}")
    groups = est.projector_.describe()
    if len(groups) != 1 or groups[0]["kind"] != "linear":
        raise RuntimeError(f"expected one factorised linear layer, got {groups}")
    d, m = int(np.prod(INPUT_SHAPE)), spec["width"]
    feat = feature_flops_2l(len(x), d, m, NB_CLASSES, groups[0]["dim_out"], groups[0]["dim_in"])
    solve = solve_flops_primal(len(x), est.projection_dim_, NB_CLASSES)
    # the same fit with float32 features (the solve stays float64): the feature phase's rate in fp32
    est32 = NTKInfluence(projection_dim=spec["k"], device="cpu", dtype=torch.float32).fit(model, x, y)
    write_result(spec, {"gemm_gflops": rates, "fit_s": fit_s, "seconds_": dict(est.seconds_), "base_rss": base,
                        "k": est.projection_dim_, "groups": groups, "n": len(x),
                        "feature_flops": feat, "solve_flops": solve,
                        "seconds_float32_features": dict(est32.seconds_)})


def case_shard(spec: dict[str, Any]) -> None:
    import torch.distributed as dist

    from art_malleability.distributed import ONE_PROCESS, init_from_env
    from art_malleability.influence import NTKInfluence

    shard = init_from_env("gloo", timeout_s=spec["collective_timeout"]) if spec["distributed"] else ONE_PROCESS
    set_threads(1)
    data = load_mnist(spec["root"], spec["n"], spec["n_queries"], spec["seed"], spec["pool_limit"], spec["cache"])
    x, y = data.x, data.y
    xq, yq = data.x_query, data.y_query
    if xq is None or yq is None:  # no held-out images left: queries from the pool
        xq, yq = x[: spec["n_queries"]], y[: spec["n_queries"]]
    model = load_model(spec)
    if shard.world_size > 1:
        dist.barrier()
    base = rss_bytes()
    est = NTKInfluence(projection_dim=spec["k"], device="cpu")
    scores, fit_s, scores_s = timed_fit_scores(est, model, x, y, xq, yq)
    rank = shard.rank
    write_result(spec, {"rank": rank, "world_size": shard.world_size, "bounds": list(shard.bounds(len(x))),
                        "fit_s": fit_s, "scores_s": scores_s, "seconds_": dict(est.seconds_), "base_rss": base,
                        "k": est.projection_dim_, "solver": type(est.solver_).__name__,
                        "scores_shape": list(scores.shape), "scores_sum": float(np.nansum(scores))}, rank=rank)
    if shard.world_size > 1:
        dist.barrier()
        dist.destroy_process_group()


class ThroughputBench(Bench):
    module = "bench_throughput"

    def gemm(self) -> None:
        a = self.args
        n, k = a.gemm_n, a.gemm_k
        info = self.prep("2l-relu", n, 0)
        spec = {**self.common("2l-relu"), "kind": "gemm", "name": f"gemm-n{n}-k{k}", "n": n, "k": k,
                "model_path": info["model_path"]}
        print(f"\n## gemm: projected NTK influence, 2L-ReLU width {a.width}, n = {n:,}, k = {k}, {a.threads} "
              f"threads\n", flush=True)
        res = self.run(spec, a.timeout, a.threads)[0]
        self.results["gemm"] = res
        if not res["ok"]:
            print(f"FAILED: {res['error']}")
            return
        f32, f64 = res["gemm_gflops"]["float32"], res["gemm_gflops"]["float64"]
        rows = []
        for phase, label, flops, seconds in (
            ("features", "features (float64, the default)", res["feature_flops"], res["seconds_"]),
            ("features_float32", "features (dtype=torch.float32)", res["feature_flops"],
             {"features_float32": res["seconds_float32_features"]["features"]}),
            ("solve", "solve (float64)", res["solve_flops"], res["seconds_"]),
        ):
            total = sum(flops.values())
            secs = seconds[phase]
            rate = total / secs / 1e9
            ok = rate / f32 >= TARGET_GEMM_SHARE
            res[f"{phase}_gflops"] = rate
            res[f"{phase}_share_f32"] = rate / f32
            rows.append([label, total / 1e9, secs, rate, 100 * rate / f32, 100 * rate / f64,
                         f"{verdict(ok)} (≥ {100 * TARGET_GEMM_SHARE:.0f} % of fp32)"])
        print(f"torch.mm 4096²: float32 {f32:.1f} GFLOP/s, float64 {f64:.1f} GFLOP/s "
              f"(groups: {res['groups']}; other processes' load {res['background_cores']:.2f} cores)\n")
        print(table(["phase", "GFLOP (analytic)", "seconds_", "GFLOP/s", "% of fp32 GEMM", "% of fp64 GEMM",
                     "target"], rows))
        print("\nflops per term (GFLOP): " + "; ".join(
            f"{key} {value / 1e9:.2f}" for flops in (res["feature_flops"], res["solve_flops"])
            for key, value in flops.items()), flush=True)

    # ---------------------------------------------------------------- shard
    def shard(self) -> None:
        a = self.args
        n, k = a.shard_n, a.shard_k
        info = self.prep("2l-relu", n, a.n_queries)
        base = {**self.common("2l-relu"), "kind": "shard", "n": n, "k": k, "n_queries": a.n_queries,
                "model_path": info["model_path"], "collective_timeout": a.timeout}
        print(f"\n## shard: projected NTK influence, 2L-ReLU width {a.width}, n = {n:,}, k = {k}: 1 process × 1 "
              "thread vs 2 gloo processes × 1 thread\n", flush=True)
        single = self.run({**base, "name": f"shard-single-n{n}", "distributed": False}, a.timeout, 1)[0]
        ranks = self.run({**base, "name": f"shard-gloo2-n{n}", "distributed": True}, a.timeout, 1, torchrun_nproc=2)
        out: dict[str, Any] = {"single": single, "ranks": ranks}
        self.results["shard"] = out
        if not single["ok"] or not all(r["ok"] for r in ranks):
            print("FAILED: " + "; ".join(r["error"] for r in [single, *ranks] if not r["ok"]))
            return
        rows = []
        for label, r in [("1 process", single)] + [(f"rank {r['rank']} of 2", r) for r in ranks]:
            wall = r["fit_s"] + r["scores_s"]
            s = r["seconds_"]
            rows.append([label, f"{r['bounds'][0]:,}–{r['bounds'][1]:,}", s["features"], s["solve"],
                         s["communication"], s["scores"], r["fit_s"], r["scores_s"],
                         100 * s["communication"] / wall, mib(r["peak_rss"]), r["background_cores"]])
        feat_speedup = single["seconds_"]["features"] / max(r["seconds_"]["features"] for r in ranks)
        fit_speedup = single["fit_s"] / max(r["fit_s"] for r in ranks)
        run_speedup = (single["fit_s"] + single["scores_s"]) / max(r["fit_s"] + r["scores_s"] for r in ranks)
        comm_share = max(r["seconds_"]["communication"] / (r["fit_s"] + r["scores_s"]) for r in ranks)
        out.update({"feature_speedup": feat_speedup, "fit_speedup": fit_speedup, "run_speedup": run_speedup,
                    "communication_share": comm_share,
                    "feature_speedup_ok": feat_speedup >= TARGET_SHARD_SPEEDUP,
                    "communication_ok": comm_share < TARGET_COMM_SHARE})
        print(table(["process", "rows", "features s", "solve s", "communication s", "scores s", "fit wall s",
                     "scores wall s", "communication % of run", "peak RSS MiB", "other load (cores)"], rows))
        print()
        print(table(["metric", "value", "target"], [
            ["feature-phase speed-up", f"{feat_speedup:.2f}×",
             f"{verdict(feat_speedup >= TARGET_SHARD_SPEEDUP)} (≥ {TARGET_SHARD_SPEEDUP}×)"],
            ["fit speed-up (features + solve + communication)", f"{fit_speedup:.2f}×", "–"],
            ["fit + scores speed-up", f"{run_speedup:.2f}×", "–"],
            ["all-reduce + gather share of the run (worst rank)", f"{100 * comm_share:.1f} %",
             f"{verdict(comm_share < TARGET_COMM_SHARE)} (< {100 * TARGET_COMM_SHARE:.0f} %)"],
        ]), flush=True)


def main(argv: list[str] | None = None) -> None:
    p = common_parser(__doc__, PARTS)
    p.add_argument("--gemm-n", type=int, default=16000)
    p.add_argument("--gemm-k", type=int, default=4096)
    p.add_argument("--shard-n", type=int, default=16000)
    p.add_argument("--shard-k", type=int, default=4096)
    args = p.parse_args(argv)
    if args.quick:
        quick_common(args)
        args.gemm_n, args.gemm_k, args.shard_n, args.shard_k = 600, 128, 600, 128
    parts = list(PARTS) if "all" in args.parts else list(dict.fromkeys(args.parts))
    run_parts(ThroughputBench(args), parts, "projected NTK influence throughput")


if __name__ == "__main__":
    main()
