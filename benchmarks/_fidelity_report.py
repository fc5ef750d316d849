"""
The reporting of ``fidelity_projection.py``: the Markdown summary (:func:`markdown`) and the figure
(:func:`figure`) of a finished run's results. Imported by that script (``from _fidelity_report import ...``).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after the backend choice)
from _fidelity_modes import TOP_FRACTION  # noqa: E402

from art_malleability.audit.attacks import ATTACK_NAMES  # noqa: E402


# --------------------------------------------------------------------------- reporting
def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown(results: dict[str, Any]) -> str:
    lines = ["# Projected vs exact NTK influence", ""]
    cfg = results["config"]
    lines.append(
        f"n_train {cfg['n_train']}, {cfg['n_queries']} test queries, eps {cfg['eps']}, "
        f"top {int(100 * TOP_FRACTION)} %, "
        f"projection seeds {cfg['seeds']}; values are means over the projection seeds, `s2s` the same statistic "
        "between the two seeds' projected scores. dFR = flip rate (projected, own top set) − flip rate (exact), "
        "percentage points. Ideal = dense Gaussian sketch of the same k (simulation)."
    )
    lines.append("")
    for name, res in results["settings"].items():
        main = res["by_ridge"][f"{res['ridge']:g}"]
        ex = main["exact"]
        tr = res["train"]
        lines.append(f"## {name} (ridge {res['ridge']:g})")
        lines.append("")
        lines.append(
            f"Training: {tr['epochs']} epochs, lr {tr['lr']:g}: train accuracy {100 * tr['train_accuracy']:.1f} %, "
            f"test accuracy {100 * tr['test_accuracy']:.1f} % ({tr['seconds']:.0f} s). "
            f"Exact: fit {ex['fit_seconds']:.1f} s, "
            f"scores {ex['scores_seconds']:.1f} s, refit+scores {np.mean(list(ex['refit_seconds'].values())):.1f} s "
            "per attack; flip rates "
            + ", ".join(f"{a.upper()} {100 * v:.1f} %" for a, v in ex["flip_rate"].items())
            + ". Attack success on the training set: "
            + ", ".join(f"{a.upper()} {100 * v['success_rate']:.0f} %" for a, v in res["attacks"].items())
            + "."
        )
        for note in res.get("notes", []):
            lines.append(f"Note: {note}")
        lines.append("")
        lines.append(
            "| k | Spearman all (s2s) | Pearson all | ideal Spearman all | Spearman agg (s2s) | ideal Spearman agg "
            "| Jaccard top (s2s) | ideal Jaccard | dFR FGSM | dFR PGD | dFR MIM | sign agree (exact top) "
            "| flip agree (exact top, mean) | fit+scores s |"
        )
        lines.append("|" + "---|" * 14)
        for k, entry in main["projected"].items():
            m, s2s = entry["mean"], entry.get("seed_to_seed", {})
            ideal = main["ideal"].get(k, {}).get("mean", {})
            dfr = m.get("flip_rate_diff_pp", {})
            agree = m.get("flip_agreement_exact_top", {})
            lines.append(
                f"| {k} | {_fmt(m['spearman_all'])} ({_fmt(s2s.get('spearman_all'))}) | {_fmt(m['pearson_all'])} "
                f"| {_fmt(ideal.get('spearman_all'))} "
                f"| {_fmt(m['spearman_aggregate'])} ({_fmt(s2s.get('spearman_aggregate'))}) "
                f"| {_fmt(ideal.get('spearman_aggregate'))} "
                f"| {_fmt(m['jaccard_top'])} ({_fmt(s2s.get('jaccard_top'))}) | {_fmt(ideal.get('jaccard_top'))} "
                + "".join(f"| {_fmt(dfr.get(a), '+.1f')} " for a in ATTACK_NAMES)
                + f"| {_fmt(m.get('clean_sign_agreement_exact_top'))} "
                f"| {_fmt(float(np.mean(list(agree.values()))) if agree else None)} "
                f"| {m['fit_seconds'] + m['scores_seconds']:.1f} |"
            )
        extra = [k for k in main["ideal"] if k not in main["projected"]]
        if extra:
            lines.append("")
            lines.append(
                "Ideal sketch beyond the projected k's: "
                + "; ".join(
                    f"k={k}: Spearman all {_fmt(main['ideal'][k]['mean']['spearman_all'])}, "
                    f"aggregate {_fmt(main['ideal'][k]['mean']['spearman_aggregate'])}, "
                    f"Jaccard {_fmt(main['ideal'][k]['mean']['jaccard_top'])}"
                    for k in extra
                )
            )
        lines.append("")
        if len(res["by_ridge"]) > 1:
            lines.append(f"### {name}: ridge sweep (Spearman of all scores, projected / ideal sketch)")
            lines.append("")
            ks = list(next(iter(res["by_ridge"].values()))["ideal"])
            lines.append("| ridge | exact fit+scores s | " + " | ".join(f"k={k}" for k in ks) + " |")
            lines.append("|" + "---|" * (2 + len(ks)))
            for ridge, block in res["by_ridge"].items():
                cells = []
                for k in ks:
                    proj = block["projected"].get(k, {}).get("mean", {}).get("spearman_all")
                    ideal = block["ideal"][k]["mean"]["spearman_all"]
                    cells.append(f"{_fmt(proj)} / {_fmt(ideal)}")
                ex_s = block["exact"]["fit_seconds"] + block["exact"]["scores_seconds"]
                lines.append(f"| {ridge} | {ex_s:.1f} | " + " | ".join(cells) + " |")
            lines.append("")
    lines.append(f"Total runtime: {results['total_seconds'] / 60:.1f} min.")
    return "\n".join(lines) + "\n"


def series(block: dict[str, Any], key: str, stat: str = "mean") -> list[float]:
    """A statistic of a per-k block, in increasing k."""
    return [block[str(k)][stat][key] for k in sorted(int(x) for x in block)]


def figure(results: dict[str, Any], path: Path) -> None:
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    ax_all, ax_agg, ax_fr, ax_ridge = axes.ravel()
    for i, (name, res) in enumerate(results["settings"].items()):
        col = colours[i % len(colours)]
        main = res["by_ridge"][f"{res['ridge']:g}"]
        ks = [int(k) for k in main["projected"]]

        lo, hi, mean = (series(main["projected"], "spearman_all", s) for s in ("min", "max", "mean"))
        ax_all.errorbar(ks, mean, yerr=[np.subtract(mean, lo), np.subtract(hi, mean)], color=col, marker="o",
                        capsize=3, label=f"{name} (Kronecker)")
        iks = sorted(int(k) for k in main["ideal"])
        ax_all.plot(iks, series(main["ideal"], "spearman_all"), color=col, ls="--", marker="x",
                    label=f"{name} (ideal dense sketch)")
        ax_agg.plot(ks, series(main["projected"], "spearman_aggregate"), color=col, marker="o",
                    label=f"{name}: Spearman aggregate")
        ax_agg.plot(ks, series(main["projected"], "jaccard_top"), color=col, marker="s", ls=":",
                    label=f"{name}: Jaccard top 10 %")
        ax_agg.plot(iks, series(main["ideal"], "spearman_aggregate"), color=col, ls="--", alpha=0.5)
        markers = {"fgsm": "o", "pgd": "s", "mim": "^"}
        for a in ATTACK_NAMES:
            vals = [abs(main["projected"][str(k)]["mean"]["flip_rate_diff_pp"][a]) for k in ks]
            ax_fr.plot(ks, vals, color=col, marker=markers[a], label=f"{name} {a.upper()}")
        if len(res["by_ridge"]) > 1:
            styles = ["-", "-.", ":", (0, (5, 1))]
            for j, (ridge, block) in enumerate(res["by_ridge"].items()):
                rcol = colours[(j + 3) % len(colours)]
                pks = sorted(int(k) for k in block["projected"])
                ax_ridge.plot(pks, series(block["projected"], "spearman_all"), color=rcol, marker="o",
                              ls=styles[0], label=f"{name} ridge {ridge} (Kronecker)")
                ax_ridge.plot(sorted(int(k) for k in block["ideal"]), series(block["ideal"], "spearman_all"),
                              color=rcol, marker="x", ls="--", label=f"{name} ridge {ridge} (ideal)")
    for ax, title, ylabel in (
        (ax_all, "Spearman of all (query, train) scores vs exact", "Spearman"),
        (ax_agg, "Aggregate scores: Spearman (solid) and top-10 % Jaccard (dotted); ideal dashed", "value"),
        (ax_fr, "|flip rate (projected, own top set) − flip rate (exact)|", "percentage points"),
        (ax_ridge, "Ridge sweep: Spearman of all scores vs exact", "Spearman"),
    ):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("projection dimension k")
        ax.set_ylabel(ylabel)
        ax.set_title(title, fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    cfg = results["config"]
    fig.suptitle(
        f"Projected vs exact NTK influence (n_train {cfg['n_train']}, {cfg['n_queries']} queries, "
        f"ridge {cfg['main_ridge']:g}, eps {cfg['eps']}; error bars: range over projection seeds)",
        fontsize=11,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=130)
    plt.close(fig)
