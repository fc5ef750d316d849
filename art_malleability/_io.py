"""File output shared by every report: atomic writes and JSON-ready values."""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


#: Mode of written files: what ``open`` would give (0o666 less the umask), not ``mkstemp``'s 0o600.
_FILE_MODE = 0o666 & ~_umask()


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
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            handle.write(text)
        os.chmod(tmp, _FILE_MODE)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


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
            fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name}.", suffix=".tmp")
            staged.append((tmp, folder / name))
            with os.fdopen(fd, "wb") as handle:
                handle.write(content.encode("utf-8") if isinstance(content, str) else content)
        for tmp, target in staged:
            os.chmod(tmp, _FILE_MODE)
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
