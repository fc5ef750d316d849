"""
An audit at several budgets (``eps`` a list): each attack's results against ε, as a table and a figure.

The audit runs each named attack at each budget after one clean fit (one refit per attack and budget, one control per
budget); its results are labelled ``"<attack> eps=<ε>"`` (:func:`~art_malleability.audit.attacks.attack_labels`).
Here they are read back by attack, in increasing ε.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from art_malleability._utils.report_base import (
    format_number_ci,
    format_percent,
    format_percent_ci,
    markdown_table,
    nan_if_none,
)
from art_malleability.audit._reading import axes, noise_aware_text, points_ci, undecided
from art_malleability.audit.attacks import EPS_SUFFIX

#: The file of the figure :func:`plot_flip_rate_against_eps` draws, beside the report.
FIGURE_NAME = "flip_rate_against_eps.png"


def eps_series(results: list[Any]) -> dict[str, list[tuple[float, Any]]]:
    """
    :param results: A report's :class:`~art_malleability.audit.report.AttackResult` list.
    :return: By attack (its label without the budget), its results at two or more scalar budgets ``(ε, result)`` in
        increasing ε; empty for an audit at one budget.
    """
    found: dict[str, list[tuple[float, Any]]] = {}
    for r in results:
        eps = r.params.get("eps")
        if EPS_SUFFIX in r.attack and isinstance(eps, (int, float)):
            found.setdefault(r.attack.rsplit(EPS_SUFFIX, 1)[0], []).append((float(eps), r))
    return {name: sorted(points, key=lambda p: p[0]) for name, points in found.items() if len(points) > 1}


def eps_table(series: dict[str, list[tuple[float, Any]]], confidence: float) -> str:
    """
    :param series: :func:`eps_series`.
    :param confidence: The intervals' level.
    :return: Markdown: one row per attack and budget; a noise-aware rate the main table reads as undecided reads so
        here too.
    """
    conf = int(round(100 * confidence))
    rows = [
        [name, f"{eps:g}", format_number_ci(r.signed_retention, r.signed_retention_ci),
         format_percent_ci(r.flip_rate, r.flip_rate_ci), format_percent(r.flip_rate_null),
         noise_aware_text(r.flip_rate_above_floor, r.flip_rate_above_floor_ci, r.undecided_share),
         "n/a" if r.control is None else format_percent(r.control["flip_rate"]),
         points_ci(r.excess_flip_rate, r.excess_flip_rate_ci), format_percent(r.attack_success)]
        for name, points in series.items() for eps, r in points
    ]
    return markdown_table(["attack", "eps", f"retention [{conf}% CI]", "flip rate [CI]", "by noise",
                           "noise-aware [CI]", "control", "excess [CI]", "success"], rows)


def plot_flip_rate_against_eps(report: Any, ax: Any = None) -> Any:
    """
    Each attack's flip rates against its budget: the noise-aware rate with its interval (solid; an undecided rate
    has no point, only its interval, dashed), the raw flip rate (dotted), and the random-sign control's flip rate
    at each budget (grey).

    :param report: A :class:`~art_malleability.audit.report.MalleabilityReport` of an audit at several budgets.
    :param ax: Optional matplotlib axes.
    :return: The matplotlib figure.
    """
    series = eps_series(report.results)
    if not series:
        raise ValueError("report must hold an audit at two or more budgets (eps a list), got one budget per attack")
    ax = axes(ax, (5.6, 3.6))
    controls: dict[float, tuple[float, list]] = {}
    for i, (name, points) in enumerate(series.items()):
        color = f"C{i}"
        eps = np.array([e for e, _ in points])
        shift = (i - (len(series) - 1) / 2) * 0.012 * (eps.max() - eps.min())  # intervals side by side, not on top
        rate = np.array([nan_if_none(r.flip_rate_above_floor) for _, r in points]) * 100
        low = np.array([nan_if_none(r.flip_rate_above_floor_ci[0]) for _, r in points]) * 100
        high = np.array([nan_if_none(r.flip_rate_above_floor_ci[1]) for _, r in points]) * 100
        open_ = np.array([undecided(r.flip_rate_above_floor, r.flip_rate_above_floor_ci, r.undecided_share)
                          for _, r in points], dtype=bool)
        shown = np.where(open_, np.nan, rate)
        ax.plot(eps + shift, shown, "-o", color=color, ms=4, label=f"{name}: noise-aware")
        ax.vlines((eps + shift)[~open_], low[~open_], high[~open_], color=color, lw=1.2)
        if open_.any():
            ax.vlines((eps + shift)[open_], low[open_], high[open_], color=color, lw=1.2, linestyles="--",
                      label=f"{name}: undecided (its interval)")
        raw = np.array([nan_if_none(r.flip_rate) for _, r in points]) * 100
        ax.plot(eps, raw, ":", color=color, lw=1.2, label=f"{name}: flip rate")
        for e, r in points:
            if r.control is not None:
                controls.setdefault(e, (r.control["flip_rate"], r.control["flip_rate_ci"]))
    if controls:
        eps = np.array(sorted(controls))
        rate = np.array([nan_if_none(controls[e][0]) for e in eps]) * 100
        low = np.array([nan_if_none(controls[e][1][0]) for e in eps]) * 100
        high = np.array([nan_if_none(controls[e][1][1]) for e in eps]) * 100
        ax.plot(eps, rate, "-s", color="0.55", ms=3, label="random-sign control")
        ax.vlines(eps, low, high, color="0.55", lw=1.0)
    ax.set_xlabel("attack budget eps (l-inf)")
    ax.set_ylabel("influence flip rate (%)")
    ax.set_ylim(bottom=0)
    ax.set_title(f"{report.model}: top {report.top_k} examples")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return ax.figure
