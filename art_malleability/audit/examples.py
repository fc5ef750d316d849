"""
The training examples behind an attack's result, as the report shows them: the most influential members of the
influential set that flipped (their posterior probability of a population sign change at least 1/2, the members the
scatter marks) and the most influential that kept their sign, each with its label, its clean and perturbed aggregate
influence, and its clean and attacked input: a small PNG for image inputs (``(C, H, W)`` or ``(H, W)``, one or three
channels), the values otherwise.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np

#: Examples shown of each kind (flipped, kept), most influential first.
PER_KIND = 6
#: Most input values written for a non-image example (the first ones).
MAX_VALUES = 64


def choose_examples(top: np.ndarray, before: np.ndarray, after: np.ndarray, counted_flips: Any,
                    per_kind: int = PER_KIND) -> tuple[np.ndarray, np.ndarray]:
    """
    :param top: The influential set (training indices).
    :param before: Clean aggregate influence of every training example.
    :param after: Perturbed aggregate influence of every training example.
    :param counted_flips: The members whose posterior probability of a sign change is at least 1/2.
    :param per_kind: How many of each kind.
    :return: ``(flipped, kept)``: training indices, each by decreasing ``|before|``; kept members are those not
        counted as flips whose measured sign did not change.
    """
    top = np.asarray(top, dtype=np.int64)
    order = top[np.argsort(-np.abs(before[top]), kind="stable")]
    counted = np.isin(order, np.asarray(counted_flips, dtype=np.int64))
    same = np.sign(before[order]) * np.sign(after[order]) > 0
    return order[counted][:per_kind], order[~counted & same][:per_kind]


def is_image(shape: tuple[int, ...]) -> bool:
    """Whether inputs of this shape (one example's) are shown as images: ``(H, W)``, or ``(C, H, W)`` with 1 or 3
    channels."""
    return len(shape) == 2 or (len(shape) == 3 and shape[0] in (1, 3))


def thumbnail(x: np.ndarray, clip_values: tuple[float, float] | None) -> str:
    """
    :param x: One image, ``(C, H, W)`` or ``(H, W)``.
    :param clip_values: Its valid range (``None``: its own minimum and maximum).
    :return: A PNG ``data:`` URI of it, at its own size (the page scales it up without smoothing).
    """
    import matplotlib.image

    image = np.asarray(x, dtype=np.float64)
    image = image[0] if image.ndim == 3 and image.shape[0] == 1 else image
    image = np.moveaxis(image, 0, -1) if image.ndim == 3 else image
    low, high = (float(np.min(image)), float(np.max(image))) if clip_values is None else map(float, clip_values)
    image = np.clip((image - low) / max(high - low, 1e-12), 0.0, 1.0)
    buffer = io.BytesIO()
    matplotlib.image.imsave(buffer, image, cmap="gray" if image.ndim == 2 else None, vmin=0.0, vmax=1.0,
                            format="png")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def describe_examples(kind: str, index: np.ndarray, labels: np.ndarray, clean: np.ndarray, attacked: np.ndarray,
                      before: np.ndarray, after: np.ndarray, clip_values: Any) -> list[dict[str, Any]]:
    """
    :param kind: ``"flipped"`` or ``"kept"``.
    :param index: Their training indices.
    :param labels: Their labels.
    :param clean: Their clean inputs, ``(m, *shape)``.
    :param attacked: Their attacked inputs.
    :param before: Clean aggregate influence of every training example.
    :param after: Perturbed aggregate influence of every training example.
    :param clip_values: The inputs' valid range, or ``None``.
    :return: One entry each, as the report keeps them: ``kind``, ``index``, ``label``, ``before``, ``after``,
        ``linf`` (the largest change of an input value), and ``clean_png`` and ``attacked_png`` for an image or
        ``clean_values`` and ``attacked_values`` (the first :data:`MAX_VALUES`) otherwise.
    """
    found = []
    image = is_image(tuple(clean.shape[1:]))
    clip = None if clip_values is None else (float(np.min(clip_values[0])), float(np.max(clip_values[1])))
    for i, x, x_adv, y in zip(index, clean, attacked, labels, strict=True):
        entry: dict[str, Any] = {"kind": kind, "index": int(i), "label": int(y), "before": float(before[i]),
                                 "after": float(after[i]), "linf": float(np.max(np.abs(x_adv - x))) if x.size else 0.0}
        if image:
            entry.update(clean_png=thumbnail(x, clip), attacked_png=thumbnail(x_adv, clip))
        else:
            entry.update(clean_values=[round(float(v), 6) for v in x.ravel()[:MAX_VALUES]],
                         attacked_values=[round(float(v), 6) for v in x_adv.ravel()[:MAX_VALUES]])
        found.append(entry)
    return found
