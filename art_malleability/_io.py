"""File output shared by every report: atomic writes and JSON-ready values."""

from __future__ import annotations

import json
import math
import os
import secrets
import sys
from pathlib import Path
from typing import Any

import numpy as np


def _staging_file(folder: Path, name: str) -> tuple[int, str]:
    """
    A new temporary file beside ``folder / name``, created with mode 0o666 so that the process's umask applies
    (the mode ``open`` gives a new file; ``mkstemp`` would give 0o600).

    :return: Its descriptor (open for writing) and path.
    """
    while True:
        tmp = os.path.join(folder, f".{name}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), tmp
        except FileExistsError:
            continue


def progress_bar(iterable: Any = None, *, verbose: bool = True, **kwargs: Any) -> Any:
    """
    A ``tqdm`` progress bar, off with ``verbose=False``. When stderr is not a terminal (a log file, CI) it is
    redrawn at most every 30 s instead of on every step, so a redirected run writes a line now and then, not
    one per step.
    """
    from tqdm.auto import tqdm

    interactive = hasattr(sys.stderr, "isatty") and sys.stderr.isatty()
    kwargs.setdefault("mininterval", 0.1 if interactive else 30.0)
    return tqdm(iterable, disable=not verbose, **kwargs)


def figure_png(figure: Any) -> bytes:
    """:return: A matplotlib figure as PNG bytes (120 dpi, tight box); the figure is closed."""
    import io

    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=120, bbox_inches="tight")
    plt.close(figure)
    return buffer.getvalue()


def read_report_json(path: str | os.PathLike, filename: str) -> Any:
    """
    :param path: A report's JSON file or the folder holding it.
    :param filename: The JSON file's name in a report folder.
    :return: The parsed JSON.
    :raises FileNotFoundError: When there is no such file.
    """
    path = Path(path)
    if path.is_dir():
        path = path / filename
    if not path.is_file():
        raise FileNotFoundError(f"path {str(path)!r} holds no {filename}")
    return json.loads(path.read_text(encoding="utf-8"))


def atomic_write(path: Path, text: str) -> None:
    """
    Write text to a file atomically: a temporary file in the same folder, then a rename.

    :param path: Target file.
    :param text: Content (UTF-8).
    """
    atomic_write_files(path.parent, {path.name: text})


def atomic_write_files(folder: Path, files: dict[str, str | bytes]) -> None:
    """
    Write several files into a folder so that an interruption while they are written leaves the
    previous versions intact: every file is first written to a temporary name beside its target,
    and only when all are written are they renamed into place, one atomic rename each, in the
    order given (put the file that marks a complete set, such as ``report.json``, last).

    :param folder: Target folder (must exist).
    :param files: File name to content (text is written as UTF-8).
    """
    staged: list[tuple[str, Path]] = []
    try:
        for name, content in files.items():
            fd, tmp = _staging_file(folder, name)
            staged.append((tmp, folder / name))
            with os.fdopen(fd, "wb") as handle:
                handle.write(content.encode("utf-8") if isinstance(content, str) else content)
        for tmp, target in staged:
            os.replace(tmp, target)
    except BaseException:
        for tmp, _ in staged:
            if os.path.exists(tmp):
                os.unlink(tmp)
        raise


def json_ready(value: Any) -> Any:
    """
    A JSON-ready copy: numpy scalars and arrays to Python, tuples to lists, NaN and infinities to ``None``.

    :param value: Any nesting of dicts, sequences and scalars.
    :return: The converted value.
    """
    if isinstance(value, dict):
        return {str(k): json_ready(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, np.ndarray)):
        return [json_ready(v) for v in value]
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value
