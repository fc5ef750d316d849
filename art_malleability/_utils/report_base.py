"""
What every report shares: one Markdown table formatter, one JSON policy and one ``save`` / ``load`` over a
report's ``to_dict``, ``to_markdown`` and figures.

A report folder holds the files of one report class: its JSON, its Markdown and its figures (and any further
files the class declares). A save goes through an :class:`~art_malleability._utils.output_folder.OutputFolder`: the
folder is locked, everything is rendered and staged first, then put in place; the files that the same class wrote
before and does not write now (the figure of an attack that this run no longer has) are removed, and only while
they are unchanged. Nothing else in the folder is touched.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from art_malleability._utils.io import figure_png, read_report_json
from art_malleability._utils.output_folder import OutputFolder

logger = logging.getLogger(__name__)

Report = TypeVar("Report", bound="SavedReport")


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    """
    :param header: Column titles.
    :param rows: Cells of each row (written with ``str``).
    :return: A Markdown table: ``| a | b |``, a ``|---|---|`` rule, one line per row.
    """
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def text_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    """
    :param header: Column titles.
    :param rows: Cells of each row.
    :return: Lines of a plain-text table: columns padded to their widest cell, a rule of dashes under the header.
    """
    rows = [list(header), *(list(row) for row in rows)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return [lines[0], "  ".join("-" * w for w in widths), *lines[1:]]


def report_json(data: Any, indent: int) -> str:
    """
    :param data: A report's ``to_dict``, already JSON-ready (:func:`~art_malleability._utils.io.json_ready`: non-finite
        numbers as ``null``).
    :return: ``data`` as strict JSON: a non-finite number or a numpy value left in it is an error, not converted.
    """
    return json.dumps(data, indent=indent, allow_nan=False)


class SavedReport:
    """
    Mixin of the report classes: ``save`` and ``load`` implemented once.

    A subclass sets ``json_name`` and ``markdown_name``, optionally ``json_indent``, and implements ``to_dict``,
    ``to_markdown`` and, where it has figures, ``_figures``.
    """

    json_name: ClassVar[str]
    markdown_name: ClassVar[str]
    json_indent: ClassVar[int] = 2

    def to_dict(self) -> dict[str, Any]:  # pragma: no cover - every report implements it
        raise NotImplementedError

    def to_markdown(self) -> str:  # pragma: no cover - every report implements it
        raise NotImplementedError

    @classmethod
    def from_dict(cls: type[Report], data: dict[str, Any]) -> Report:
        """
        :param data: A dict written by :meth:`to_dict`.
        :return: The report.
        """
        return cls(**data)

    def _figures(self) -> dict[str, Callable[[], Any]]:
        """:return: File name of each figure to the function that draws it (a matplotlib figure)."""
        return {}

    def _side_files(self) -> dict[str, str | bytes]:
        """:return: Every file written beside the JSON and the Markdown, by name (the figures as PNG)."""
        return {name: figure_png(draw()) for name, draw in self._figures().items()}

    def rendered_files(self) -> dict[str, str | bytes]:
        """:return: The report's files, rendered: its Markdown, its figures and its JSON, by name."""
        files: dict[str, str | bytes] = {self.markdown_name: self.to_markdown(), **self._side_files()}
        files[self.json_name] = report_json(self.to_dict(), self.json_indent)
        return files

    def stage(self, out: OutputFolder, folder: str = "") -> None:
        """
        Stage the report's files in an open :class:`~art_malleability._utils.output_folder.OutputFolder`
        (they appear when its run succeeds).

        :param out: The open output folder.
        :param folder: Subfolder of the output folder (``""``: the folder itself).
        """
        out.write_all(self.rendered_files(), folder)

    def save(self, directory: str | os.PathLike) -> Path:
        """
        Write the report's JSON, its Markdown and its figures into a folder, safely: the folder is locked while
        the files are rendered and staged, and they replace the previous report only once all are ready (an
        interrupted save leaves it intact). Only files this package wrote are ever replaced or removed: the files
        an earlier save of this class wrote and this one does not are removed, and a file of the same name that
        this package did not write is an error (see :mod:`art_malleability._utils.output_folder`).

        :param directory: Output folder (created if missing).
        :return: The folder.
        :raises NotADirectoryError: When ``directory`` is an existing file.
        :raises FileExistsError: When it holds a file of a report's name that this package did not write (the folder
            is then left exactly as it was).
        :raises RuntimeError: When another run is writing to it.
        """
        with OutputFolder(directory, writer=type(self).__name__, description=f"{type(self).__name__}.save") as out:
            files = self.rendered_files()
            out.claim(files)  # a file of the user's is refused before anything is staged: a refusal leaves nothing
            out.write_all(files)
        logger.info("%s written to %s", type(self).__name__, directory)
        return Path(directory)

    @classmethod
    def load(cls: type[Report], path: str | os.PathLike) -> Report:
        """
        :param path: The report's JSON file or the folder holding it.
        :return: The report.
        :raises FileNotFoundError: When there is no such file.
        :raises ValueError: When the file is not JSON, or not this report's JSON.
        """
        data = read_report_json(path, cls.json_name)
        try:
            return cls.from_dict(data)
        except (TypeError, KeyError, ValueError, AttributeError) as err:
            raise ValueError(
                f"path must hold a {cls.__name__} written by save(), got {str(path)!r}, whose {cls.json_name} does not "
                f"describe one ({type(err).__name__}: {err})"
            ) from err


def format_percent(v: float | None) -> str:
    """:return: A share as ``"12.3%"`` (``"n/a"`` for ``None``)."""
    return value_ci(v, [None, None], 100.0, ".1f", "%")


def format_percent_ci(v: float | None, ci: list[float | None]) -> str:
    """:return: A share with its interval, ``"12.3% [8.0, 17.1]"`` (``"n/a"`` for ``None``)."""
    return value_ci(v, ci, 100.0, ".1f", "%")


def format_number_ci(v: float | None, ci: list[float | None]) -> str:
    """:return: A number with its interval, ``"0.123 [0.080, 0.171]"`` (``"n/a"`` for ``None``)."""
    return value_ci(v, ci, 1.0, ".3f", "")


def value_ci(v: float | None, ci: list[float | None], scale: float, spec: str, unit: str) -> str:
    """``scale · v`` in format ``spec`` with ``unit``, then ``[low, high]`` when both ends are known."""
    if v is None:
        return "n/a"
    text = f"{scale * v:{spec}}{unit}"
    if ci[0] is None or ci[1] is None:
        return text
    return f"{text} [{scale * ci[0]:{spec}}, {scale * ci[1]:{spec}}]"


def nan_if_none(v: float | None) -> float:
    """:return: ``v`` as a float, ``NaN`` for ``None`` (values of a JSON-ready report, for plotting)."""
    return float("nan") if v is None else float(v)


def setting_text(value: Any) -> str:
    """:return: A setting as a report writes it out of its JSON (a page, a tracker's parameter): JSON for containers,
    as written otherwise."""
    return json.dumps(value, default=str) if isinstance(value, (dict, list, tuple)) else str(value)


def slugify(name: str) -> str:
    """:return: ``name`` with every character outside letters, digits, ``-`` and ``_`` replaced by ``_``."""
    return "".join(c if c.isalnum() or c in "-_" else "_" for c in name)
