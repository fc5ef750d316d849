"""
Benchmark: influence estimators side by side on MNIST, on the CPU (this package's exact and projected NTK
influence, its gradient and Captum adapters, Captum's ``TracInCP`` by hand, dattri's TRAK and TracIn).

One trained model on one data set (``--compare-n`` MNIST training images, default 1,000, and ``--n-queries``
held-out query images, default 100), for the 2L-ReLU (width 512, Adam, 100 epochs, lr 3e-2, no weight decay)
and the SmallCNN (Adam, ``--cnn-epochs``, lr 1e-3): wall time, peak RSS and agreement of

(a) ``ntk-exact``: exact NTK influence (``NTKInfluence(projection_dim=None)``: the n × n eNTK, dual solve);
(b) ``ntk-proj``: projected NTK influence (``projection_dim=--projection-dim``, default 4096);
(c) ``captum-hand``: Captum's ``TracInCP`` used by hand as a Captum user would: the final weights saved to a
    checkpoint file and loaded by Captum's default loader, ``nn.CrossEntropyLoss(reduction="none")`` (the
    per-example loss its default ``sample_wise_grads_per_batch=False`` needs), ``influence((x_q, y_q))`` in
    its influence-score mode (``k=None``); in float64 (the reference of the gradient-type estimators) and,
    as ``captum-hand-f32``, in float32;
(d) ``captum-adapter`` (this package's ``CaptumInfluence``) and ``gradient`` (``GradientInfluence``, TracIn
    at the final weights with per-layer factorisation), both float64, and ``captum-adapter-f32``, the adapter
    in float32 (to set beside ``captum-hand-f32``);
(e) ``dattri-trak`` and ``dattri-tracin``: dattri 0.3's ``TRAKAttributor`` (``cache`` then ``attribute``) and
    ``TracInAttributor`` (``attribute``) on an ``AttributionTask`` with the final weights, float32 as a
    dattri user would run it, random projection to ``--projection-dim`` dimensions (dattri's CPU projector).
    TRAK's output function is the margin ``z_y − logsumexp_{c≠y} z_c`` (TRAK's ``log p/(1−p)`` written
    stably: the textbook form gives ``log 0`` for examples fitted to probability 1 in float32) and its
    correct-class probability ``p = exp(−CE)``. With ``n_train < k`` the k × k matrix ``ΦᵀΦ`` that TRAK
    inverts is singular, so ``regularization`` is set to ``1e-3 ×`` the mean squared norm of TRAK's scaled
    per-example gradients (a relative ridge like the NTK influence's); dattri's default 0 is singular here.

Conventions: this package and Captum return ``(n_query, n_train)`` with **positive = helpful** (Captum's
proponents); dattri returns ``(n_train, n_test)``, also positive = helpful (TracIn: ``lr · g_i · g_q``; TRAK:
the query's margin rises with the training example's weight), so its scores are transposed; no sign changes.
Agreement is the Spearman correlation of all ``n_query × n_train`` scores (and the mean per-query Spearman)
against the exact NTK scores for the kernel-type estimators (projected NTK, TRAK) and against Captum's
float64 ``TracInCP`` for the gradient-type ones, plus ``max |s − s_ref| / max |s_ref|`` for the latter.
The NTK influence (kernel ridge leave-one-out, squared loss) and TracIn (cross-entropy gradient products)
are different estimators: the cross-family correlations are shown for information only.

Every heavy case runs in its own subprocess; scratch files, timeouts, failures and the MNIST folder are as
``_cases.py`` describes.

Usage (from the repository root)::

    python benchmarks/bench_estimators.py             # about 15 min on 2 CPU cores
    python benchmarks/bench_estimators.py --quick     # tiny sizes: checks the script in about a minute
"""

from __future__ import annotations

import copy
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from _cases import (
    Bench,
    clean,
    common_parser,
    load_mnist,
    load_model,
    quick_common,
    run_parts,
    timed_fit_scores,
    write_result,
)
from _common import fmt, mib, rss_bytes, set_threads, table, verdict

ESTIMATORS = (
    "ntk-exact",
    "ntk-proj",
    "captum-hand",
    "captum-hand-f32",
    "captum-adapter",
    "captum-adapter-f32",
    "gradient",
    "dattri-trak",
    "dattri-tracin",
)
KERNEL_TYPE = ("ntk-exact", "ntk-proj", "dattri-trak")


def _dattri_functions(model: Any) -> tuple[Callable, Callable, Callable]:
    """Per-example loss, TRAK margin and correct-class probability in dattri's ``f(params, (x, y))`` form."""
    import torch
    import torch.nn.functional as F
    from torch.func import functional_call

    def logits(params: dict, image: Any) -> Any:
        return functional_call(model, params, (image.unsqueeze(0),))[0]

    def loss(params: dict, data: tuple) -> Any:
        image, label = data
        return F.cross_entropy(logits(params, image).unsqueeze(0), label.unsqueeze(0))

    def margin(params: dict, data: tuple) -> Any:
        image, label = data
        z = logits(params, image)
        mask = torch.arange(z.shape[0]) == label
        correct = (z * mask).sum()
        return correct - torch.logsumexp(z.masked_fill(mask, float("-inf")), dim=0)

    def probability(params: dict, data: tuple) -> Any:
        return torch.exp(-loss(params, data))

    return loss, margin, probability


def run_estimator(
    name: str, model: Any, x: np.ndarray, y: np.ndarray, xq: np.ndarray, yq: np.ndarray, spec: dict[str, Any]
) -> tuple[np.ndarray, float, float, dict[str, Any]]:
    """
    Run one estimator; return ``(scores (n_query, n_train), positive = helpful; fit seconds; scores seconds;
    details)``.
    """
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from art_malleability.influence import CaptumInfluence, GradientInfluence, NTKInfluence

    details: dict[str, Any] = {}
    k = int(spec["projection_dim"])
    if name in ("ntk-exact", "ntk-proj", "captum-adapter", "captum-adapter-f32", "gradient"):
        if name == "ntk-exact":
            est = NTKInfluence(projection_dim=None, device="cpu")
        elif name == "ntk-proj":
            est = NTKInfluence(projection_dim=k, device="cpu")
        elif name.startswith("captum-adapter"):
            import captum.influence  # noqa: F401  (imported before the clock starts, as in the by-hand cases)

            dtype = torch.float32 if name.endswith("f32") else torch.float64
            est = CaptumInfluence(device="cpu", dtype=dtype)
        else:
            est = GradientInfluence(device="cpu")
        scores, fit_s, scores_s = timed_fit_scores(est, model, x, y, xq, yq)
        if isinstance(est, NTKInfluence):
            details = {"mode": est.mode_, "k": est.projection_dim_, "solver": type(est.solver_).__name__,
                       "seconds_": dict(est.seconds_),
                       "groups": est.projector_.describe() if est.projector_ is not None else None}
        return scores, fit_s, scores_s, details
    if name in ("captum-hand", "captum-hand-f32"):
        from captum.influence import TracInCP

        dtype = torch.float64 if name == "captum-hand" else torch.float32
        start = time.perf_counter()
        net = copy.deepcopy(model).to(dtype).eval()
        checkpoint = Path(spec["scratch"]) / f"{spec['name']}.ckpt.pt"
        torch.save(net.state_dict(), checkpoint)  # a Captum user's checkpoint file of the final weights
        train = TensorDataset(torch.as_tensor(x, dtype=dtype), torch.as_tensor(y))
        tracin = TracInCP(net, train, checkpoints=[str(checkpoint)],
                          loss_fn=nn.CrossEntropyLoss(reduction="none"), batch_size=64)
        fit_s = time.perf_counter() - start
        start = time.perf_counter()
        out = tracin.influence((torch.as_tensor(xq, dtype=dtype), torch.as_tensor(yq)))  # (n_query, n_train)
        scores_s = time.perf_counter() - start
        return out.detach().to(torch.float64).numpy(), fit_s, scores_s, {"dtype": str(dtype)}
    if name in ("dattri-trak", "dattri-tracin"):
        from dattri.algorithm import TracInAttributor, TRAKAttributor
        from dattri.task import AttributionTask
        from torch.func import grad, vmap

        net = copy.deepcopy(model).float().eval()
        loss, margin, probability = _dattri_functions(net)
        train = DataLoader(TensorDataset(torch.as_tensor(x), torch.as_tensor(y)), batch_size=spec["dattri_batch"])
        test = DataLoader(TensorDataset(torch.as_tensor(xq), torch.as_tensor(yq)), batch_size=spec["dattri_batch"])
        projector = {"proj_dim": k, "proj_max_batch_size": 32, "proj_seed": 0, "device": "cpu"}
        start = time.perf_counter()
        if name == "dattri-trak":
            params = {n: p.detach() for n, p in net.named_parameters()}
            n_params = sum(p.numel() for p in params.values())
            probe = (torch.as_tensor(x[:64]), torch.as_tensor(y[:64]))
            g = vmap(grad(margin), in_dims=(None, 0))(params, probe)
            sq = sum(v.flatten(1).pow(2).sum(1) for v in g.values())
            reg = float(spec["trak_relative_ridge"] * sq.mean() / n_params)
            task = AttributionTask(loss_func=margin, model=net, checkpoints=net.state_dict())
            attributor = TRAKAttributor(task=task, correct_probability_func=probability, device="cpu",
                                        projector_kwargs=projector, regularization=reg)
            attributor.cache(train)
            fit_s = time.perf_counter() - start
            start = time.perf_counter()
            out = attributor.attribute(test)  # (n_train, n_test)
            details = {"regularization": reg}
        else:
            task = AttributionTask(loss_func=loss, model=net, checkpoints=net.state_dict())
            attributor = TracInAttributor(task=task, weight_list=torch.ones(1), normalized_grad=False,
                                          projector_kwargs=projector, device="cpu")
            fit_s = time.perf_counter() - start
            start = time.perf_counter()
            out = attributor.attribute(train, test)  # (n_train, n_test)
        scores_s = time.perf_counter() - start
        details["batch_size"] = spec["dattri_batch"]
        return out.detach().to(torch.float64).numpy().T, fit_s, scores_s, details
    raise ValueError(f"unknown estimator {name!r}")


def case_estimator(spec: dict[str, Any]) -> None:
    set_threads(spec["threads"])
    data = load_mnist(spec["root"], spec["n"], spec["n_queries"], spec["seed"], spec["pool_limit"], spec["cache"])
    if data.x_query is None or data.y_query is None:
        raise RuntimeError("compare needs held-out queries: lower --compare-n")
    model = load_model(spec)
    base = rss_bytes()
    scores, fit_s, scores_s, details = run_estimator(spec["estimator"], model, data.x, data.y, data.x_query,
                                                     data.y_query, spec)
    np.save(spec["scores_path"], scores)
    write_result(spec, {"fit_s": fit_s, "scores_s": scores_s, "total_s": fit_s + scores_s, "base_rss": base,
                        "shape": list(scores.shape), "finite": bool(np.isfinite(scores).all()), **details})


def agreement(scores: np.ndarray, reference: np.ndarray) -> dict[str, float]:
    """Spearman of all pairs, mean per-query Spearman, largest difference relative to the reference's scale."""
    from scipy.stats import spearmanr

    ok = np.isfinite(scores) & np.isfinite(reference)
    rho = float(spearmanr(scores[ok], reference[ok]).statistic) if ok.sum() > 2 else float("nan")
    per_query = [float(spearmanr(a, b).statistic) for a, b in zip(scores, reference, strict=True)
                 if np.ptp(a) > 0 and np.ptp(b) > 0]
    scale = float(np.max(np.abs(reference[ok]))) if ok.any() else float("nan")
    diff = float(np.max(np.abs(scores[ok] - reference[ok]))) / scale if scale > 0 else float("nan")
    return {"spearman": rho, "spearman_per_query": float(np.mean(per_query)) if per_query else float("nan"),
            "max_rel_diff": diff}


class EstimatorBench(Bench):
    module = "bench_estimators"

    def compare(self) -> None:
        a = self.args
        n, q, k = a.compare_n, a.n_queries, a.projection_dim
        out: dict[str, Any] = {"n_train": n, "n_queries": q, "projection_dim": k, "models": {}}
        print(f"\n## compare: n_train = {n:,}, {q} held-out queries, projection dimension {k}\n", flush=True)
        for model in a.models:
            info = self.prep(model, n, q)
            cases: dict[str, dict[str, Any]] = {}
            for est in a.estimators:
                name = f"compare-{model}-{est}"
                spec = {**self.common(model), "kind": "estimator", "name": name, "estimator": est, "n": n,
                        "n_queries": q, "projection_dim": k, "model_path": info["model_path"],
                        "scores_path": str(self.workdir / f"{name}.npy"), "scratch": str(self.workdir),
                        "dattri_batch": a.dattri_batch, "trak_relative_ridge": 1e-3}
                print(f"  {model} / {est} ...", flush=True)
                res = self.run(spec, a.timeout, a.threads)[0]
                if res["ok"]:
                    res["scores"] = np.load(spec["scores_path"])
                    print(f"    {res['total_s']:.2f} s, peak RSS {mib(res['peak_rss']):.0f} MiB", flush=True)
                cases[est] = res
            ref_ntk = cases.get("ntk-exact", {}).get("scores")
            ref_captum = cases.get("captum-hand", {}).get("scores")
            t_ntk = cases.get("ntk-exact", {}).get("total_s")
            t_captum = cases.get("captum-hand", {}).get("total_s")
            t_captum32 = cases.get("captum-hand-f32", {}).get("total_s")
            rows, matches = [], []
            for est, res in cases.items():
                if not res["ok"]:
                    rows.append([est, f"FAILED: {res['error']}"] + [None] * 14)
                    continue
                s = res.pop("scores")
                vs_ntk = agreement(s, ref_ntk) if ref_ntk is not None else {}
                vs_captum = agreement(s, ref_captum) if ref_captum is not None else {}
                res["vs_exact_ntk"], res["vs_captum"] = vs_ntk, vs_captum
                designated = vs_ntk if est in KERNEL_TYPE else vs_captum
                res["reference"] = "exact NTK" if est in KERNEL_TYPE else "Captum TracInCP (float64)"
                note = res.get("mode", "") + (f", k={res['k']}" if res.get("k") else "")
                if est == "dattri-trak":
                    note = f"float32, ridge {res['regularization']:.2e}"
                elif est in ("dattri-tracin", "captum-adapter-f32"):
                    note = "float32"
                elif est.startswith("captum-hand"):
                    note = res["dtype"].replace("torch.", "")
                elif not note:
                    note = "float64"
                if est in ("captum-adapter", "gradient") and vs_captum:
                    matches.append((est, vs_captum["max_rel_diff"]))
                rows.append([
                    est, note, res["fit_s"], res["scores_s"], res["total_s"],
                    res["total_s"] / t_captum if t_captum else None,
                    res["total_s"] / t_captum32 if t_captum32 else None, res["total_s"] / t_ntk if t_ntk else None,
                    mib(res["peak_rss"]), mib(res["peak_rss"] - res["base_rss"]),
                    designated.get("spearman"), designated.get("spearman_per_query"),
                    vs_ntk.get("spearman"), vs_captum.get("spearman"),
                    None if est in KERNEL_TYPE else vs_captum.get("max_rel_diff"), res["background_cores"],
                ])
            print(f"\n### {model} (trained {info['epochs']} epochs in {info['train_s']:.1f} s; held-out accuracy "
                  f"{fmt(info['query_accuracy'], 3)})\n")
            print(table(["estimator", "notes", "fit s", "scores s", "total s", "× Captum f64", "× Captum f32",
                         "× exact NTK", "peak RSS MiB", "Δ RSS MiB", "ρ vs ref", "ρ per query vs ref",
                         "ρ vs exact NTK", "ρ vs Captum f64", "max rel diff vs Captum f64", "other load (cores)"],
                        rows))
            print("\nref = exact NTK for ntk-*/dattri-trak, Captum TracInCP float64 for the gradient-type estimators; "
                  "× = time ratio (total s) measured in this run; Δ RSS = peak minus RSS after loading data and "
                  "model; max rel diff = max |s − s_ref| / max |s_ref|.")
            for est, diff in matches:
                print(f"{est} matches Captum TracInCP (float64) to {diff:.1e} of its scale: "
                      f"{verdict(diff <= 1e-10)} (≤ 1e-10)")
            sys.stdout.flush()
            out["models"][model] = {"training": clean(info), "cases": cases}
        self.results["compare"] = out


def main(argv: list[str] | None = None) -> None:
    p = common_parser(__doc__, ["compare"])
    p.add_argument("--compare-n", type=int, default=1000, help="MNIST training images")
    p.add_argument("--projection-dim", type=int, default=4096, help="k of ntk-proj and dattri")
    p.add_argument("--estimators", nargs="+", choices=ESTIMATORS, default=list(ESTIMATORS))
    p.add_argument("--dattri-batch", type=int, default=128, help="batch size of dattri's data loaders")
    args = p.parse_args(argv)
    if args.quick:
        quick_common(args)
        args.compare_n, args.projection_dim, args.dattri_batch = 60, 128, 32
    run_parts(EstimatorBench(args), ["compare"], "influence estimators")


if __name__ == "__main__":
    main()
