"""
The audit's report as one self-contained HTML page (``report.html``), for reading in a browser: the headline of each
attack, the figures, the training examples behind each result (clean and attacked side by side), the warnings, the
plan and what ran, and how to run it again. Everything is inline (styles and
figures as ``data:`` URIs; no script, no request leaving the file), so the page reads offline and travels as one file.

The page is rendered from a Jinja2 template (``templates/report.html``, escaped by default) with the same numbers as
``report.json``: each headline cell carries the JSON path of its number (``data-key="results.0.flip_rate"``), the
number itself (``data-value``, with ``data-low`` and ``data-high`` for its interval) and the name of the format that
writes it (``data-format``, one of :data:`FORMATS`), so that a reader, or a test in a browser, can check the page
against the JSON. A noise-aware rate that reads undecided is written as such (``undecided [low, high]``) and marked
``data-undecided="true"``, never as a point.
"""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable, Mapping
from typing import Any

from art_malleability._utils.report_base import (
    format_number_ci,
    format_percent,
    format_percent_ci,
    setting_text,
    value_ci,
)
from art_malleability.audit._reading import noise_aware_text, points_ci, undecided

#: The file the page is written to, beside ``report.json``.
HTML_NAME = "report.html"

#: How each headline cell writes its number, by ``data-format``: ``(value, [low, high], undecided share) -> text``.
FORMATS: dict[str, Callable[[Any, list, Any], str]] = {
    "percent": lambda v, ci, share: format_percent(v),
    "percent_ci": lambda v, ci, share: format_percent_ci(v, ci),
    "number": lambda v, ci, share: "n/a" if v is None else f"{v:.3f}",
    "number_ci": lambda v, ci, share: format_number_ci(v, ci),
    "signed_number_ci": lambda v, ci, share: value_ci(v, ci, 1.0, "+.3f", ""),
    "points_ci": lambda v, ci, share: points_ci(v, ci),
    "noise_aware": lambda v, ci, share: noise_aware_text(v, ci, share),
}

#: The headline's columns: title, the number's key in an attack's result (``control.<name>`` in its control), its
#: interval's key (or ``None``), and its format.
HEADLINE: tuple[tuple[str, str, str | None, str], ...] = (
    ("retention", "signed_retention", "signed_retention_ci", "number_ci"),
    ("control's retention", "control.signed_retention", None, "number"),
    ("excess retention", "excess_retention", "excess_retention_ci", "signed_number_ci"),
    ("flip rate", "flip_rate", "flip_rate_ci", "percent_ci"),
    ("by noise", "flip_rate_null", None, "percent"),
    ("noise-aware", "flip_rate_above_floor", "flip_rate_above_floor_ci", "noise_aware"),
    ("undecided share", "undecided_share", None, "percent"),
    ("control's flip rate", "control.flip_rate", None, "percent"),
    ("excess flip rate", "excess_flip_rate", "excess_flip_rate_ci", "points_ci"),
    ("Spearman", "spearman", "spearman_ci", "number_ci"),
    ("top-k Jaccard", "top_k_jaccard", "top_k_jaccard_ci", "number_ci"),
    ("attack success", "attack_success", None, "percent"),
)


def lookup(data: Mapping[str, Any], key: str) -> Any:
    """
    :param data: The report's JSON.
    :param key: A dotted path in it (``"results.0.control.flip_rate"``).
    :return: The value there, ``None`` where a step is missing or ``null``.
    """
    value: Any = data
    for step in key.split("."):
        if value is None:
            return None
        value = value[int(step)] if isinstance(value, list) else value.get(step)
    return value


#: The controls' table: as :data:`HEADLINE`, keys in an attack's ``control``.
CONTROL_COLUMNS: tuple[tuple[str, str, str | None, str], ...] = (
    ("retention", "control.signed_retention", "control.signed_retention_ci", "number_ci"),
    ("flip rate", "control.flip_rate", "control.flip_rate_ci", "percent_ci"),
    ("by noise", "control.flip_rate_null", None, "percent"),
    ("noise-aware", "control.flip_rate_above_floor", "control.flip_rate_above_floor_ci", "noise_aware"),
    ("Spearman", "control.spearman", "control.spearman_ci", "number_ci"),
    ("top-k Jaccard", "control.top_k_jaccard", "control.top_k_jaccard_ci", "number_ci"),
)


def headline_cell(data: Mapping[str, Any], index: int, column: tuple[str, str, str | None, str]) -> dict[str, Any]:
    """
    One cell of attack ``index``: the JSON paths of its number, of its interval and of the undecided share its format
    reads (empty where none), the number, its interval, the format, the text and whether it reads undecided.
    """
    _, name, interval, style = column
    key = f"results.{index}.{name}"
    interval_key = "" if interval is None else f"results.{index}.{interval}"
    # a control's noise-aware rate is a mean over draws: its undecided share is not known (the width rule alone)
    share_key = f"results.{index}.undecided_share" if not name.startswith("control.") else ""
    value = lookup(data, key)
    ci = (lookup(data, interval_key) if interval_key else None) or [None, None]
    share = lookup(data, share_key) if share_key else None
    return {"key": key, "interval_key": interval_key, "share_key": share_key, "value": _attribute(value),
            "low": _attribute(ci[0]), "high": _attribute(ci[1]), "format": style,
            "text": FORMATS[style](value, ci, share),
            "undecided": style == "noise_aware" and undecided(value, ci, share)}


def render_html(report: Any, figures: Mapping[str, bytes] | None = None) -> str:
    """
    :param report: A :class:`~art_malleability.audit.report.MalleabilityReport`.
    :param figures: Its figures as PNG bytes by file name (drawn here where not given).
    :return: The page.
    """
    import jinja2

    from art_malleability._utils.io import figure_png

    data = report.to_dict()
    if figures is None:
        figures = {name: figure_png(draw()) for name, draw in report._figures().items()}
    env = jinja2.Environment(loader=jinja2.PackageLoader("art_malleability.audit", "templates"),
                             autoescape=jinja2.select_autoescape(["html"]), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True)
    rows = [{"attack": r["attack"], "cells": [headline_cell(data, i, column) for column in HEADLINE]}
            for i, r in enumerate(data["results"])]
    controls = [{"attack": r["attack"], "eps": r["control"].get("eps"), "draws": r["control"].get("draws"),
                 "cells": [headline_cell(data, i, column) for column in CONTROL_COLUMNS]}
                for i, r in enumerate(data["results"]) if r.get("control")]
    noise = report.noise_model or {}
    projection = noise.get("projection_sd")
    images = {name: "data:image/png;base64," + base64.b64encode(png).decode("ascii")
              for name, png in figures.items()}
    measured = sum(report.seconds.values()) + sum(sum(r.seconds.values()) for r in report.results)
    estimate = (report.config.get("estimate") or {}).get("seconds", {}).get("total")
    return env.get_template(HTML_NAME).render(
        title=f"Influence malleability: {report.model}", summary=report._title(), warnings=report.warnings,
        columns=[c[0] for c in HEADLINE], rows=rows,
        confidence=int(round(100 * report.config.get("confidence", 0.95))),
        control_columns=[c[0] for c in CONTROL_COLUMNS], controls=controls,
        per_query=[(r.attack, format_percent(r.per_query_flip_rate)) for r in report.results],
        noise_method=noise.get("method"),
        projection=None if projection is None else (f"sd = {projection['intercept']:.3g} + {projection['slope']:.3g} "
                                                    f"|score| (seeds {noise.get('projection_seeds')})"),
        fidelity=None if report.fidelity is None else report._fidelity_line(),
        figures=[{"name": name, "src": src, "alt": name.removesuffix(".png").replace("_", " ")}
                 for name, src in images.items()],
        config=[(k, setting_text(v)) for k, v in report.config.items() if k != "estimate"],
        execution=[(k, setting_text(v)) for k, v in report.execution.items()],
        seconds=[(k, f"{v:.2f}") for k, v in report.seconds.items()]
        + [(f"{r.attack} {k}", f"{v:.2f}") for r in report.results for k, v in r.seconds.items()],
        measured=f"{measured:.1f}", estimated=None if estimate is None else f"{estimate:.1f}",
        versions=sorted(report.versions.items()), reproduce=_reproduce(report),
        examples=[{"attack": r.attack, "known": r.examples is not None,
                   "kinds": [(kind, [e for e in r.examples or [] if e["kind"] == kind])
                             for kind in ("flipped", "kept")]}
                  for r in report.results],
    )


def _attribute(value: Any) -> str:
    """A number as its ``data-`` attribute holds it: JSON's own text (``null`` for none)."""
    if isinstance(value, float) and not math.isfinite(value):
        return "null"
    return json.dumps(value)



def _reproduce(report: Any) -> str:
    """
    How to run this audit again: the command line that ran it (where the command line did), and the library call
    with the settings as recorded (the classifier and the data are yours).
    """
    skip = {"estimate", "work_dir", "verbose", "model"}
    args = ", ".join(f"{k}={v!r}" for k, v in report.config.items() if k not in skip)
    call = f"MalleabilityEstimator(classifier, {args}).evaluate(x_train, y_train, x_test, y_test)"
    command = report.execution.get("command")
    return call if command is None else f"{command}\n\n# in the library:\n{call}"
