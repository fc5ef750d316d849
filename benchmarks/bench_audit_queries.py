"""
Benchmark: what more queries decide, and what they cost, on MNIST.

The whole audit (``MalleabilityEstimator``: FGSM, PGD and MIM at ε = 0.3, strategy "top", five-draw random-sign
controls, the exact NTK influence at the paper's ridge) of one trained model on ``--n-train`` MNIST images, with
``--query-counts`` held-out query images (the first ones of the same seeded order, so every count's queries hold the
smaller counts'). Only the number of queries changes between the rows of a model. Reported per count and attack: the
share of the influential set whose perturbed aggregate is undecided (within one standard error of zero), the
noise-aware flip rate with its interval and the interval's width, the raw flip rate and its expectation by query noise
alone, the signed retention with its interval, its control and the excess; and per count the audit's wall time
(training aside), the metrics' share of it, and the peak resident memory of the audit's process.

With the MNIST test split alone (the default folder) ``--n-train`` plus the largest count must stay within 10,000
images (the default: 2,000 training images and up to 8,000 queries); a ``--mnist-root`` with all four IDX files gives
70,000 (both splits pooled in one seeded order). ``--models`` also takes ``mlp-attn`` (the reference MLP-Attn, centred
context, trained with ``--attn-epochs`` and ``--attn-lr``). ``--device cuda`` runs the audits (influence,
attacks and metrics) on a CUDA device, the models still trained on the CPU; the cases then also report the device's
peak allocated memory, and the metrics' share of the time is the one a GPU audit spends outside the kernel.

    python benchmarks/bench_audit_queries.py                                  # both models, about 1 h on 2 cores
    python benchmarks/bench_audit_queries.py --models 2l-relu --query-counts 100 4000
    python benchmarks/bench_audit_queries.py --models 2l-relu mlp-attn --query-counts 100 1000 4000 8000
    python benchmarks/bench_audit_queries.py --quick                           # checks the script in a few minutes
    python benchmarks/bench_audit_queries.py --models cnn --query-counts 100 4000 --device cuda
"""

from __future__ import annotations

import time
from typing import Any

from _cases import (
    ATTENTION_MODEL,
    INPUT_SHAPE,
    MODELS,
    NB_CLASSES,
    Bench,
    attack_findings,
    common_parser,
    load_mnist,
    load_model,
    quick_common,
    run_parts,
)
from _cases import write_result as _write
from _common import mib, number_ci, percent_ci, rss_bytes, set_threads, table

ATTACKS = ("fgsm", "pgd", "mim")


def case_audit(spec: dict[str, Any]) -> None:
    import torch

    from art_malleability import MalleabilityEstimator
    from art_malleability.influence import NTKInfluence
    from art_malleability.models import make_classifier

    set_threads(spec["threads"])
    device = spec.get("device", "cpu")
    data = load_mnist(spec["root"], spec["n"], spec["n_queries"], spec["seed"], spec["pool_limit"], spec["cache"])
    if data.x_query is None:
        raise ValueError(f"n_train + n_queries must stay within the {data.available} images, got "
                         f"{spec['n']} + {spec['n_queries']}")
    classifier = make_classifier(load_model(spec), INPUT_SHAPE, NB_CLASSES, device=device)
    ntk = NTKInfluence(ridge=1e-3, device=device, projection_dim=None, projection_seed=spec["seed"])
    audit = MalleabilityEstimator(classifier, attacks=ATTACKS, eps=0.3, influence=ntk, strategy="top",
                                  n_queries=spec["n_queries"], verbose=False, device=device, seed=spec["seed"])
    base = rss_bytes()
    start = time.perf_counter()
    report = audit.evaluate(data.x, data.y, data.x_query, data.y_query)
    total = time.perf_counter() - start
    device_peak = torch.cuda.max_memory_allocated(device) if torch.device(device).type == "cuda" else None
    metrics_s = sum(r.seconds.get("metrics", 0.0) for r in report.results)
    _write(spec, {
        "total_s": total, "metrics_s": metrics_s, "base_rss": base, "n_queries": report.n_queries,
        "device": device, "peak_device_bytes": device_peak,
        "clean_accuracy": report.clean_accuracy, "seconds": dict(report.seconds),
        "attacks": [{
            **attack_findings(r), "control_flip_rate": None if r.control is None else r.control["flip_rate"],
            "excess_flip_rate": r.excess_flip_rate, "excess_flip_rate_ci": r.excess_flip_rate_ci,
        } for r in report.results],
    })


class AuditQueriesBench(Bench):
    module = "bench_audit_queries"

    def queries(self) -> None:
        a = self.args
        out: dict[str, Any] = {"n_train": a.n_train, "counts": a.query_counts, "models": {}}
        print(f"\n## queries: the whole audit of {a.n_train:,} MNIST images against its number of queries "
              f"({', '.join(ATTACKS)}, eps 0.3, exact NTK influence, 5-draw controls)\n", flush=True)
        for model in a.models:
            info = self.prep(model, a.n_train, max(a.query_counts))
            cost_rows, stat_rows, cases = [], [], {}
            for n_query in a.query_counts:
                spec = {**self.common(model), "kind": "audit", "name": f"queries-{model}-q{n_query}", "n": a.n_train,
                        "n_queries": n_query, "model_path": info["model_path"], "device": a.device}
                print(f"  audit {model} with {n_query:,} queries on {a.device} ...", flush=True)
                res = self.run(spec, a.audit_timeout, a.threads)[0]
                cases[n_query] = res
                if not res["ok"]:
                    cost_rows.append([n_query, f"FAILED: {res['error']}", None, None, None])
                    continue
                on_device = ("" if res.get("peak_device_bytes") is None
                             else f", peak device memory {mib(res['peak_device_bytes']):.0f} MiB")
                print(f"    {res['total_s']:.1f} s (metrics {res['metrics_s']:.1f} s), peak RSS "
                      f"{mib(res['peak_rss']):.0f} MiB{on_device}", flush=True)
                cost_rows.append([n_query, res["total_s"], res["metrics_s"], res["seconds"].get("influence_clean"),
                                  mib(res["peak_rss"])])
                for r in res["attacks"]:
                    ci = r["noise_aware_ci"]
                    width = None if None in ci else ci[1] - ci[0]
                    stat_rows.append([
                        n_query, r["attack"], percent_ci(r["undecided_share"]), percent_ci(r["noise_aware"], ci),
                        percent_ci(width),
                        percent_ci(r["flip_rate"], r["flip_rate_ci"]), percent_ci(r["flip_rate_null"]),
                        number_ci(r["retention"], r["retention_ci"]), number_ci(r["control_retention"]),
                        number_ci(r["excess_retention"], r["excess_retention_ci"], "+.3f"),
                    ])
            print(f"\n### {model} ({a.n_train:,} training images; held-out accuracy "
                  f"{info.get('query_accuracy', float('nan')):.3f})\n")
            print(table(["queries", "audit s", "metrics s (3 attacks)", "clean influence s", "peak RSS MiB"],
                        cost_rows))
            print()
            print(table(["queries", "attack", "undecided %", "noise-aware % [CI]", "its width (pts)",
                         "raw flip rate % [CI]", "by noise %", "retention [CI]", "control", "excess [CI]"], stat_rows),
                  flush=True)
            out["models"][model] = {"training": info, "cases": cases}
        self.results["queries"] = out


def main(argv: list[str] | None = None) -> None:
    p = common_parser(__doc__, ["queries"], models=(*MODELS, ATTENTION_MODEL))
    p.add_argument("--n-train", type=int, default=2000)
    p.add_argument("--query-counts", type=int, nargs="+", default=[100, 300, 1000, 4000, 8000])
    p.add_argument("--audit-timeout", type=float, default=3600.0, help="seconds per audit subprocess")
    p.add_argument("--device", default="cpu", help="where the audits run: cpu, cuda or cuda:k (default cpu)")
    args = p.parse_args(argv)
    if args.quick:
        quick_common(args)
        args.n_train, args.query_counts, args.pool_limit = 200, [20, 60], None
        args.audit_timeout = min(args.audit_timeout, 600.0)
    run_parts(AuditQueriesBench(args), ["queries"], "the audit against its number of queries")


if __name__ == "__main__":
    main()
