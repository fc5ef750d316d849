"""
The report of :func:`art_malleability.ntk.spectral.spectral_analysis`: the spectrum of :math:`G = X X^\\top` and the
quantities derived from it, as text, Markdown, JSON and a figure (see :mod:`art_malleability.ntk.spectral` for the
definitions and rules).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import numpy as np

from art_malleability._utils.report_base import SavedReport, markdown_table

_TOP_EIGENVALUES = 10
SPECTRUM_JSON = "spectrum.json"


def _encode(value: Any) -> Any:
    """JSON-safe value: non-finite floats become the strings ``"inf"``, ``"-inf"``, ``"nan"``."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, str) and value in ("inf", "-inf", "nan"):
        return float(value)
    return value


@dataclass(eq=False)
class SpectralReport(SavedReport):
    """
    Spectrum of :math:`G = X X^\\top` and the quantities derived from it (see the module docstring for the
    definitions and rules). Condition numbers that are infinite (singular :math:`G`) or overflow floats are
    `inf`; the matching ``log10_*`` fields stay finite whenever the ratio is.

    :param name: Label of the data (dataset name, subset), or `None`.
    :param features: What the rows of :math:`X` are (``"unit-normalised inputs"``, ``"attention features"``).
    :param n: Number of examples.
    :param d: Number of features.
    :param rank: Numerical rank of :math:`G`.
    :param rank_rtol: Relative tolerance of the rank rule.
    :param rank_tol: Absolute tolerance, ``rank_rtol * lambda_max``.
    :param eigenvalues: All `n` eigenvalues of :math:`G`, descending.
    :param kappa: :math:`\\kappa(G) = \\lambda_1 / \\lambda_n`, `inf` when :math:`G` is numerically singular.
    :param log10_kappa: Its base-10 logarithm.
    :param kappa_d_min_nd: :math:`\\lambda_1 / \\lambda_r`, :math:`r = \\min(n, d)`; `inf` when
                           :math:`\\lambda_r` is numerically zero.
    :param log10_kappa_d_min_nd: Its base-10 logarithm.
    :param kappa_d_rank: :math:`\\lambda_1 / \\lambda_{\\mathrm{rank}}` over the numerical rank.
    :param log10_kappa_d_rank: Its base-10 logarithm.
    :param kappa_d: Headline :math:`\\kappa_d`: ``kappa_d_min_nd`` when finite, else ``kappa_d_rank``.
    :param log10_kappa_d: Its base-10 logarithm.
    :param kappa_d_rule: ``"min(n, d)"`` or ``"numerical rank"`` (the fallback, flagged).
    :param kappa_g3: :math:`\\kappa(G^3) = \\kappa(G)^3` (`inf` when singular or beyond float range).
    :param log10_kappa_g3: :math:`3 \\log_{10} \\kappa(G)`.
    :param log10_kappa_d_g3: :math:`3 \\log_{10} \\kappa_d`, the amplified truncated condition number.
    :param g3_check: Outcome of the direct eigendecomposition of :math:`G^3`: ``"passed"``, ``"failed"`` or
                     ``"skipped: <reason>"``.
    :param g3_check_kappa_direct: :math:`\\kappa(G^3)` from the direct eigendecomposition, or `None`.
    :param g3_check_rel_error: :math:`|\\kappa_{\\mathrm{direct}} / \\kappa(G)^3 - 1|`, or `None`.
    :param g3_check_tol: Tolerance of the check (``1e-6 + 10 n eps kappa(G)^3``), or `None`.
    :param log10_width_v1: :math:`6 \\log_{10} \\kappa_d` (v1, :math:`m = \\Omega(\\kappa^6)`).
    :param log10_width_v2: :math:`6 \\log_{10} \\kappa_d + \\log_{10}(n \\ln n)` (v2).
    :param flags: Human-readable warnings (rank deficiency, fallback of :math:`\\kappa_d`, zero rows, ...).

    :meth:`save` writes ``spectrum.json``, ``spectrum.md`` and ``spectrum.png``; :meth:`load` reads it back.
    """

    json_name: ClassVar[str] = SPECTRUM_JSON
    markdown_name: ClassVar[str] = "spectrum.md"

    name: str | None
    features: str
    n: int
    d: int
    rank: int
    rank_rtol: float
    rank_tol: float
    eigenvalues: np.ndarray
    kappa: float
    log10_kappa: float
    kappa_d_min_nd: float
    log10_kappa_d_min_nd: float
    kappa_d_rank: float
    log10_kappa_d_rank: float
    kappa_d: float
    log10_kappa_d: float
    kappa_d_rule: str
    kappa_g3: float
    log10_kappa_g3: float
    log10_kappa_d_g3: float
    g3_check: str
    g3_check_kappa_direct: float | None
    g3_check_rel_error: float | None
    g3_check_tol: float | None
    log10_width_v1: float
    log10_width_v2: float
    flags: list[str] = field(default_factory=list)

    # -------------------------------------------------------------- derived views
    @property
    def rank_deficient(self) -> bool:
        """Whether the numerical rank is below :math:`\\min(n, d)`."""
        return self.rank < min(self.n, self.d)

    @property
    def lambda_max(self) -> float:
        """Largest eigenvalue of :math:`G`."""
        return float(self.eigenvalues[0])

    def top_eigenvalues(self, k: int = _TOP_EIGENVALUES) -> np.ndarray:
        """
        :param k: How many.
        :return: The `k` largest eigenvalues (fewer when `n < k`).
        """
        return self.eigenvalues[:k].copy()

    # -------------------------------------------------------------- serialisation
    def to_dict(self) -> dict[str, Any]:
        """
        JSON-ready dictionary (non-finite floats as the strings ``"inf"`` / ``"nan"``); includes the top
        eigenvalues and the full spectrum.

        :return: The dictionary.
        """
        out: dict[str, Any] = {}
        for key in (f.name for f in fields(self)):
            value = getattr(self, key)
            if key == "eigenvalues":
                out["top_eigenvalues"] = [float(v) for v in self.top_eigenvalues()]
                value = [float(v) for v in value]
            elif key == "flags":
                value = list(value)
            out[key] = _encode(value)
        out["rank_deficient"] = self.rank_deficient
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpectralReport:
        """
        Rebuild a report from :meth:`to_dict` output.

        :param data: The dictionary.
        :return: The report.
        :raises ValueError: If a field is missing.
        """
        names = [f.name for f in fields(cls)]
        missing = [k for k in names if k not in data]
        if missing:
            raise ValueError(f"data must hold every field of a SpectralReport, got none for {missing}")
        kwargs = {k: _decode(data[k]) for k in names}
        kwargs["eigenvalues"] = np.asarray(data["eigenvalues"], dtype=np.float64)
        kwargs["flags"] = list(data["flags"])
        return cls(**kwargs)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SpectralReport):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def _rows(self) -> list[tuple[str, str]]:
        def fmt(value: float | None) -> str:
            if value is None:
                return "-"
            return f"{value:.4g}"

        return [
            ("n x d", f"{self.n} x {self.d}"),
            ("numerical rank", f"{self.rank} (tol {self.rank_tol:.3g} = {self.rank_rtol:.3g} * lambda_max)"),
            ("lambda_max", fmt(self.lambda_max)),
            ("kappa(G), all n eigenvalues", f"{fmt(self.kappa)} (log10 {fmt(self.log10_kappa)})"),
            ("kappa_d, r = min(n, d)", f"{fmt(self.kappa_d_min_nd)} (log10 {fmt(self.log10_kappa_d_min_nd)})"),
            ("kappa_d, r = numerical rank", f"{fmt(self.kappa_d_rank)} (log10 {fmt(self.log10_kappa_d_rank)})"),
            ("kappa_d (headline)", f"{fmt(self.kappa_d)} (log10 {fmt(self.log10_kappa_d)}; {self.kappa_d_rule})"),
            ("log10 kappa(G^3) = 3 log10 kappa(G)", fmt(self.log10_kappa_g3)),
            ("log10 kappa_d(G^3) = 3 log10 kappa_d", fmt(self.log10_kappa_d_g3)),
            (
                "direct check of kappa(G^3)",
                self.g3_check
                if self.g3_check_kappa_direct is None
                else f"{self.g3_check}: eig(G^3) gives {fmt(self.g3_check_kappa_direct)}, kappa(G)^3 = "
                f"{fmt(self.kappa_g3)} (rel. error {fmt(self.g3_check_rel_error)})",
            ),
            ("log10 width v1 (kappa_d^6)", fmt(self.log10_width_v1)),
            ("log10 width v2 (kappa_d^6 n ln n)", fmt(self.log10_width_v2)),
        ]

    def summary(self) -> str:
        """
        Plain-text summary.

        :return: The text.
        """
        title = f"Spectrum of G = X X^T ({self.features}{', ' + self.name if self.name else ''})"
        rows = self._rows()
        width = max(len(k) for k, _ in rows)
        lines = [title, "-" * len(title)]
        lines += [f"{k:<{width}}  {v}" for k, v in rows]
        top = ", ".join(f"{v:.4g}" for v in self.top_eigenvalues())
        lines.append(f"{'top eigenvalues':<{width}}  {top}")
        lines += [f"note: {flag}" for flag in self.flags]
        return "\n".join(lines)

    def to_markdown(self) -> str:
        """
        Markdown report with the table of values, the top eigenvalues, the flags and the plot.

        :return: The Markdown text.
        """
        title = f"# Spectrum of G = XXᵀ{': ' + self.name if self.name else ''}"
        lines = [title, "", f"Rows of X: {self.features} (flattened, unit ℓ2 norm, float64).", ""]
        lines.append(markdown_table(["quantity", "value"], self._rows()))
        lines += ["", "Top eigenvalues: " + ", ".join(f"{v:.4g}" for v in self.top_eigenvalues()), ""]
        if self.flags:
            lines += ["## Notes", ""] + [f"- {flag}" for flag in self.flags] + [""]
        lines += [
            "Rules: numerical rank counts eigenvalues above rtol * lambda_max (default rtol = max(n, d) * eps); "
            "kappa_d uses r = min(n, d) and falls back to the numerical rank when lambda_r is numerically zero; "
            "kappa(G^3) = kappa(G)^3 from G's eigenvalues; widths v1 = 6 log10 kappa_d, "
            "v2 = 6 log10 kappa_d + log10(n ln n).",
            "",
            "![eigenvalues](spectrum.png)",
            "",
        ]
        return "\n".join(lines)

    def plot(self, ax: Any = None) -> Any:
        """
        Log-scale plot of the eigenvalues with the rank tolerance and the rank cut marked.

        :param ax: Optional matplotlib axes.
        :return: The matplotlib figure.
        """
        if ax is None:
            from matplotlib.figure import Figure

            figure = Figure(figsize=(6.0, 3.6))
            ax = figure.add_subplot()
        index = np.arange(1, self.n + 1)
        positive = self.eigenvalues > 0
        ax.semilogy(index[positive], self.eigenvalues[positive], lw=1.2, color="tab:blue", label="eigenvalues of G")
        if self.rank_tol > 0:
            ax.axhline(self.rank_tol, color="tab:red", lw=0.8, ls=":", label=f"rank tolerance {self.rank_tol:.2g}")
        ax.axvline(self.rank, color="tab:red", lw=1.0, ls="--", label=f"numerical rank {self.rank}")
        r = min(self.n, self.d)
        if r != self.rank:
            ax.axvline(r, color="tab:gray", lw=1.0, ls="-.", label=f"min(n, d) = {r}")
        ax.set_xlabel("index")
        ax.set_ylabel("eigenvalue")
        ax.set_title(f"{self.name or 'data'}: kappa_d = {self.kappa_d:.3g} ({self.kappa_d_rule})")
        ax.legend(fontsize=8)
        return ax.figure

    def _figures(self) -> dict[str, Any]:
        return {"spectrum.png": self.plot}
