"""
What every report shares: one Markdown table formatter, one JSON policy and one ``save`` / ``load`` over a
report's ``to_dict``, ``to_markdown`` and figures.

A report folder holds the files of one report class: its JSON, its Markdown and its figures (and any further
files the class declares). A save renders everything first, then writes it atomically (the JSON last, so a
complete JSON marks a complete set), then removes the files that the same class wrote before and does not write
now, such as the figure of a level or an attack that this run no longer has. Nothing else in the folder is touched.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from art_malleability._io import atomic_write_files, figure_png, read_report_json

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
    :param data: A report's ``to_dict``, already JSON-ready (:func:`~art_malleability._io.json_ready`: non-finite
        numbers as ``null``).
    :return: ``data`` as strict JSON: a non-finite number or a numpy value left in it is an error, not converted.
    """
    return json.dumps(data, indent=indent, allow_nan=False)


class SavedReport:
    """
    Mixin of the report classes: ``save`` and ``load`` implemented once.

    A subclass sets ``json_name`` and ``markdown_name``, optionally ``owned`` (glob patterns of the further files
    it may write, such as ``"scatter_*.png"``) and ``json_indent``, and implements ``to_dict``, ``to_markdown``
    and, where it has figures, ``_figures``.
    """

    json_name: ClassVar[str]
    markdown_name: ClassVar[str]
    owned: ClassVar[tuple[str, ...]] = ()
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

    def save(self, directory: str | os.PathLike) -> Path:
        """
        Write the report's JSON, its Markdown and its figures into a folder. Everything is rendered and staged in
        temporary files first, then renamed into place (the JSON last), so a save interrupted while rendering or
        writing leaves the previous report intact; then the files an earlier save of this class wrote and this
        one does not are removed (nothing else in the folder is touched).

        :param directory: Output folder (created if missing).
        :return: The folder.
        """
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        files: dict[str, str | bytes] = {self.markdown_name: self.to_markdown(), **self._side_files()}
        files[self.json_name] = report_json(self.to_dict(), self.json_indent)  # renamed last
        atomic_write_files(out, files)
        self.clear(out, keep=files)
        logger.info("%s written to %s", type(self).__name__, out)
        return out

    @classmethod
    def clear(cls, directory: str | os.PathLike, keep: Iterable[str] = ()) -> None:
        """
        Remove the files a save of this class writes from a folder (a missing folder is left alone).

        :param directory: A report folder.
        :param keep: Names to keep.
        """
        folder = Path(directory)
        if not folder.is_dir():
            return
        keep = set(keep)
        for pattern in (cls.json_name, cls.markdown_name, *cls.owned):
            for path in folder.glob(pattern):
                if path.name not in keep and path.is_file():
                    path.unlink()

    @classmethod
    def load(cls: type[Report], path: str | os.PathLike) -> Report:
        """
        :param path: The report's JSON file or the folder holding it.
        :return: The report.
        :raises FileNotFoundError: When there is no such file.
        """
        return cls.from_dict(read_report_json(path, cls.json_name))
