"""Formatting of the reproduction's tables and figures: flip-rate tables beside the paper's values, the ablation."""

from __future__ import annotations

from typing import Any

import numpy as np

from art_malleability._report_base import markdown_table
from art_malleability.metrics import shifted_percentile_interval
from art_malleability.paper.common import ATTACKS, fmt_ci, pooled


def flip_table(title: str, rows: list[dict], models, paper: dict, family: str) -> str:
    seeds = sorted({r["seed"] for r in rows})
    lines = [
        title,
        "",
        f"Mean over {len(seeds)} training seeds [95% two-level bootstrap interval: seeds, then "
        "queries]; "
        "*above floor*: flips between scores distinguishable from zero; *control*: the same examples moved by "
        "random signs at ±ε; *excess*: attack minus control, in percentage points. Paper values from its "
        f"{family} runs.",
        "",
    ]
    table = []
    means: dict[str, dict[str, float]] = {}
    excess: dict[tuple[str, str], tuple[float, np.ndarray | None]] = {}
    for model in models:
        model_rows = [r for r in rows if r["model"] == model]
        for attack in ATTACKS:
            sel = [r for r in model_rows if r["attack"] == attack]
            flip = pooled(sel, "flip_rate")
            means.setdefault(model, {})[attack] = flip[0]
            floor, control, extra = (
                pooled(sel, s) for s in ("flip_rate_above_floor", "control_flip_rate", "excess_flip_rate")
            )
            excess[(model, attack)] = (extra[0], extra[3])
            target = paper.get(model, {}).get(attack)
            table.append(
                [
                    model,
                    attack,
                    accuracy_cell(model_rows),
                    fmt_ci(*flip[:3], 1),
                    fmt_ci(*floor[:3], 1),
                    fmt_ci(*control[:3], 1),
                    fmt_ci(*extra[:3], 1, (-100.0, 100.0)),
                    "—" if target is None else target,
                ]
            )
    lines.append(
        markdown_table(
            ["model", "attack", "clean acc.", "flip rate", "above floor", "control", "excess (pts)", "paper"], table
        )
    )
    if "2l-relu" in means and "mlp-attn" in means:
        ratios, gaps = [], []
        for attack in ATTACKS:
            base, attn = means["2l-relu"][attack], means["mlp-attn"][attack]
            p_base, p_attn = paper["2l-relu"][attack], paper["mlp-attn"][attack]
            measured = "n/a" if not base else f"{attn / base:.2f}"
            ratios.append(f"{attack}: {measured} (paper {p_attn / p_base:.2f})")
            (a_mean, a_draws), (b_mean, b_draws) = excess[("mlp-attn", attack)], excess[("2l-relu", attack)]
            if a_draws is not None and b_draws is not None:
                gap = a_mean - b_mean
                low, high = shifted_percentile_interval(gap, a_draws - b_draws, 0.95, (-200.0, 200.0))
                gaps.append(f"{attack}: {gap:+.1f} pts [{low:+.1f}, {high:+.1f}]")
        lines += ["", "Ratio MLP-Attn / 2L-ReLU of the flip rates: " + "; ".join(ratios)]
        if gaps:
            lines += [
                "",
                "MLP-Attn minus 2L-ReLU, excess flip rates (beyond the control; interval over seeds and "
                "queries of both models): " + "; ".join(gaps),
            ]
    return "\n".join(lines)


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
    values = [
        r[metric]
        for r in report.records
        if r["model"] == model
        and r["width"] == width
        and r["level"] == level
        and r.get("protocol") == protocol
        and r.get(metric) is not None
    ]
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
                )[:3]
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
