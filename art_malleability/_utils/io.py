"""What every report shares for its files: JSON-ready values, reading a report's JSON, figures as PNG, progress bars."""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np


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
    :raises ValueError: When the file is not JSON (the message names it and where it breaks).
    """
    path = Path(path)
    if path.is_dir():
        path = path / filename
    if not path.is_file():
        raise FileNotFoundError(f"path {str(path)!r} holds no {filename}")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"path must hold a report's JSON, got {str(path)!r}, which is not JSON ({err})") from err


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
