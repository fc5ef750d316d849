"""What every report shares for its files: JSON-ready values, reading a report's JSON, figures as PNG, progress bars,
durations in messages."""

from __future__ import annotations

import functools
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

#: Seconds between two lines of a progress bar written to a file or a pipe (a log, CI).
LOG_INTERVAL = 30.0


def duration_text(seconds: float) -> str:
    """``seconds`` as a short duration for a message: seconds below 90 (at least 1), minutes below 90, else hours."""
    if seconds < 90:
        return f"{max(seconds, 1):.0f} s"
    if seconds < 5400:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def progress_bar(iterable: Any = None, *, verbose: bool = True, **kwargs: Any) -> Any:
    """
    A ``tqdm`` progress bar, off with ``verbose=False``. On a terminal (or in a notebook) it is redrawn as tqdm
    does. When its stream (``file``, by default stderr) is not a terminal (a log file, a pipe, CI) it writes its
    first line, then at most one line every ``LOG_INTERVAL`` seconds, also where the caller asks for a redraw
    (``set_postfix``, ``set_description``), and its last line when it closes: a redirected run writes a line now and
    then, not one per step.
    """
    from tqdm.auto import tqdm

    stream = kwargs.get("file") or sys.stderr
    notebook = any(cls.__module__ == "tqdm.notebook" for cls in tqdm.__mro__)
    if notebook or (hasattr(stream, "isatty") and stream.isatty()):
        return tqdm(iterable, disable=not verbose, **kwargs)
    kwargs.setdefault("mininterval", LOG_INTERVAL)
    return _log_bar(tqdm)(iterable, disable=not verbose, **kwargs)


@functools.cache
def _log_bar(tqdm: type) -> type:
    """``tqdm`` whose redraws, asked for or not, come at most every ``mininterval`` seconds (the first is shown)."""

    class LogBar(tqdm):
        _shown = False

        def refresh(self, *args: Any, **kwargs: Any) -> Any:
            if self.disable:  # verbose=False: tqdm's own no-op
                return super().refresh(*args, **kwargs)
            now = self._time()
            if self._shown and now - self.last_print_t < self.mininterval:
                return None
            self._shown, self.last_print_t = True, now
            return super().refresh(*args, **kwargs)

    return LogBar


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
