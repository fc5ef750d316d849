"""Formatting of the reproduction's tables and figures: flip-rate tables beside the paper's values, the ablation."""

from __future__ import annotations

from typing import Any

import numpy as np

from art_malleability._utils.report_base import markdown_table
from art_malleability.paper.common import ATTACKS, WHOLE_RANGE, fmt_ci, paired_gap, pooled, whole_range


def flip_table(title: str, rows: list[dict], models, paper: dict, family: str) -> str:
    seeds = sorted({r["seed"] for r in rows})
    lines = [
        title,
        "",
        f"Mean over {len(seeds)} training seeds [95% Student-t interval over the seeds; one seed: its interval "
        "over queries]; *by noise*: the raw flip rate expected from query noise alone; *noise-aware*: the share "
        "whose population aggregate changes sign (deconvolution, docs/metrics.md); *control*: the same examples "
        "moved by random signs at ±ε; *excess*: attack minus control, in percentage points. Paper values from its "
        f"{family} runs.",
        "",
    ]
    table = []
    means: dict[str, dict[str, float]] = {}
    for model in models:
        model_rows = [r for r in rows if r["model"] == model]
        for attack in ATTACKS:
            mean, cells = rate_cells([r for r in model_rows if r["attack"] == attack])
            means.setdefault(model, {})[attack] = mean
            target = paper.get(model, {}).get(attack)
            table.append([model, attack, accuracy_cell(model_rows), *cells, "—" if target is None else target])
    lines.append(
        markdown_table(
            ["model", "attack", "clean acc.", *RATE_COLUMNS, "paper"], table
        )
    )
    if "2l-relu" in means and "mlp-attn" in means:
        ratios, gaps = [], []
        for attack in ATTACKS:
            base, attn = means["2l-relu"][attack], means["mlp-attn"][attack]
            p_base, p_attn = paper["2l-relu"][attack], paper["mlp-attn"][attack]
            measured = "n/a" if not base else f"{attn / base:.2f}"
            ratios.append(f"{attack}: {measured} (paper {p_attn / p_base:.2f})")
            pick = [[r for r in rows if r["model"] == m and r["attack"] == attack] for m in ("mlp-attn", "2l-relu")]
            gap, low, high = paired_gap(*pick, "excess_flip_rate")
            if np.isfinite(gap):
                interval = f" [{WHOLE_RANGE}]" if whole_range(low, high, (-200.0, 200.0)) else (
                    f" [{low:+.1f}, {high:+.1f}]" if np.isfinite(low) else "")
                gaps.append(f"{attack}: {gap:+.1f} pts{interval}")
        lines += ["", "Ratio MLP-Attn / 2L-ReLU of the flip rates: " + "; ".join(ratios)]
        if gaps:
            lines += [
                "",
                "MLP-Attn minus 2L-ReLU, excess flip rates (beyond the control; Student-t interval over the seeds' "
                "paired differences): " + "; ".join(gaps),
            ]
    return "\n".join(lines)


#: Columns of :func:`rate_cells`, after the model, the setting and the clean accuracy.
RATE_COLUMNS = ("flip rate", "by noise", "noise-aware", "control", "excess (pts)")


def rate_cells(rows: list[dict]) -> tuple[float, list[str]]:
    """
    :param rows: One setting's rows, a row per seed.
    :return: The mean flip rate (%) and the cells of :data:`RATE_COLUMNS`: the flip rate, its expectation by query
        noise, the noise-aware rate, the control and the excess, each pooled over the seeds (:func:`pooled`).
    """
    flip, null, aware, control, excess = (
        pooled(rows, s)
        for s in ("flip_rate", "flip_rate_null", "flip_rate_above_floor", "control_flip_rate", "excess_flip_rate")
    )
    return flip[0], [fmt_ci(*flip, 1), fmt_ci(null[0], float("nan"), float("nan"), 1), fmt_ci(*aware, 1),
                     fmt_ci(*control, 1), fmt_ci(*excess, 1, (-100.0, 100.0))]


def accuracy_cell(rows: list[dict]) -> str:
    seen = {}
    for r in rows:
        seen[r["seed"]] = (r["clean_accuracy"], r["near_chance"])
    if not seen:
        return "n/a"
    mean = 100 * float(np.mean([a for a, _ in seen.values()]))
    flagged = any(f for _, f in seen.values())
    return f"{mean:.1f}%" + (" ⚠ near chance" if flagged else "")


def mean_of(report, model: str, width: int, level: str, metric: str, protocol: str | None = None) -> float:
    """:return: Mean of ``metric`` over the seeds of (model, width, level, protocol), diverged runs left out."""
    values = [r[metric] for r in report.kept(model=model, width=width, level=level, protocol=protocol)
              if r.get(metric) is not None]
    return float(np.mean(values)) if values else float("nan")


def direction(values) -> str:
    if values is None or len(values) < 2 or not all(np.isfinite(values)):
        return "n/a"
    return "rises" if values[-1] > values[0] else "falls"


def ablation_figure(rows: list[dict], models, eps_grid) -> Any:
    """:return: The ablation figure: flip rate against ε per attack, one line per model with its interval."""
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(ATTACKS), figsize=(10, 3), sharey=True)
    for ax, attack in zip(axes, ATTACKS, strict=True):
        for model in models:
            stats_ = [
                pooled(
                    [r for r in rows if r["model"] == model and r["attack"] == attack and r["eps"] == e], "flip_rate"
                )
                for e in eps_grid
            ]
            means = [s[0] for s in stats_]
            lows = np.clip([s[1] if np.isfinite(s[1]) else s[0] for s in stats_], 0.0, 100.0)
            highs = np.clip([s[2] if np.isfinite(s[2]) else s[0] for s in stats_], 0.0, 100.0)
            line = ax.plot(eps_grid, means, marker="o", label=model)[0]
            ax.fill_between(eps_grid, lows, highs, color=line.get_color(), alpha=0.15)
        ax.set_title(attack)
        ax.set_xlabel("ε (ℓ∞)")
    axes[0].set_ylabel("influence flip rate (%)")
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    return figure


__all__ = ["ablation_figure", "accuracy_cell", "direction", "flip_table", "mean_of"]
