"""
ART evasion attacks by name, and the perturbation of training sets.

Named attacks are ℓ∞ and untargeted, built on the classifier's ``clip_values``:

* ``"fgsm"``: :class:`art.attacks.evasion.FastGradientMethod`, one step of size ``eps``.
* ``"pgd"``: :class:`art.attacks.evasion.ProjectedGradientDescent`, ``max_iter`` steps (default 20) of
  size ``eps_step = 2.5 * eps / max_iter`` (the step rule of Madry et al.), no random start
  (``num_random_init=0``), so the attack is deterministic.
* ``"mim"``: :class:`art.attacks.evasion.MomentumIterativeMethod`, same steps, momentum decay 1.0.

The **random-perturbation control** of an ℓ∞ attack (:func:`random_sign_perturbation`) moves the same
training examples by random signs at ``±eps``, clipped to the valid range: the non-adversarial counterpart
of FGSM, with the same budget. Influence recomputed on it gives the flip rate that any perturbation of that
size causes; an attack's *excess* flip rate is its flip rate minus the control's.

Attacks are crafted against the true labels (one-hot), not the model's predictions. A
transductive model (one with ``set_context``) is attacked as the fixed function it is while the
attack runs: its context stays the clean training set, and gradients flow through the attacked
input alone.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

import numpy as np
import torch
from art.attacks import EvasionAttack
from art.attacks.evasion import FastGradientMethod, MomentumIterativeMethod, ProjectedGradientDescent
from art.estimators.classification import PyTorchClassifier

from art_malleability._utils.params import one_of
from art_malleability._utils.torch_utils import model_device_dtype

logger = logging.getLogger(__name__)

ATTACK_NAMES = ("fgsm", "pgd", "mim")
#: The rule of an attack's name (:func:`make_attack`'s ``name``, each name among the audit's ``attacks``).
ATTACK = one_of(ATTACK_NAMES, f"name one of {ATTACK_NAMES}")
STRATEGIES = ("top", "all")


def make_attack(
    name: str,
    classifier: PyTorchClassifier,
    eps: float = 0.3,
    max_iter: int = 20,
    batch_size: int = 128,
) -> EvasionAttack:
    """
    Build a named ℓ∞ ART attack with this package's documented defaults.

    :param name: One of ``"fgsm"``, ``"pgd"``, ``"mim"``.
    :param classifier: The ART classifier to attack; must have ``clip_values``.
    :param eps: ℓ∞ budget in input units (pixels in [0, 1]: 0.3 as in the paper).
    :param max_iter: Steps of the iterative attacks.
    :param batch_size: ART's batch size.
    :return: A ready :class:`art.attacks.EvasionAttack`.
    :raises InvalidParameterError: If ``name`` is not an attack's name (:data:`ATTACK`; a ``ValueError``).
    """
    ATTACK(name, "name")
    if classifier.clip_values is None:
        raise ValueError(
            f"classifier.clip_values must be set for attack {name!r} (the valid input range, e.g. (0.0, 1.0)), "
            "got None"
        )
    eps = float(eps)  # ART rejects numpy scalars
    classifier = attack_classifier(classifier)
    if name == "fgsm":
        return FastGradientMethod(classifier, norm=np.inf, eps=eps, batch_size=batch_size)
    eps_step = 2.5 * eps / max_iter
    if name == "pgd":
        return ProjectedGradientDescent(
            classifier,
            norm=np.inf,
            eps=eps,
            eps_step=eps_step,
            max_iter=max_iter,
            num_random_init=0,
            batch_size=batch_size,
            verbose=False,
        )
    return MomentumIterativeMethod(
        classifier, norm=np.inf, eps=eps, eps_step=eps_step, decay=1.0, max_iter=max_iter,
        batch_size=batch_size, verbose=False,
    )


class _FloatInputs(torch.nn.Module):
    """A model of another floating-point dtype between float32 inputs and float32 logits (what ART's attacks pass and
    expect): its weights and its forward pass as they are, in its own dtype."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        super().__init__()
        self.model, self.dtype = model, dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.to(self.dtype)).to(x.dtype)


def attack_classifier(classifier: PyTorchClassifier) -> PyTorchClassifier:
    """
    The classifier the named attacks run on. ART's attacks cast their inputs to float32 (``ART_NUMPY_DTYPE``), which a
    float64 model refuses; for a model of any dtype but float32 this is a classifier around the same model (not a
    copy; nothing of it changes) that casts the inputs to the model's dtype and the logits back, with the user's
    classifier's loss, clip values and pre- and post-processing. A float32 model's classifier is returned as it is.

    :param classifier: The user's classifier.
    :return: The classifier to attack.
    """
    _, dtype = model_device_dtype(classifier.model)
    if dtype == torch.float32:
        return classifier
    return PyTorchClassifier(
        _FloatInputs(classifier.model, dtype), loss=classifier._loss, input_shape=classifier.input_shape,
        nb_classes=classifier.nb_classes, channels_first=classifier.channels_first, clip_values=classifier.clip_values,
        preprocessing_defences=classifier.preprocessing_defences,
        postprocessing_defences=classifier.postprocessing_defences, preprocessing=classifier.preprocessing,
        device_type="gpu" if classifier.device.type == "cuda" else "cpu",
    )


def attack_label(attack: EvasionAttack) -> str:
    """
    Short name of an attack for reports: the package's name for a named attack's class, else the class name.

    :param attack: An ART evasion attack.
    :return: A label such as ``"pgd"``.
    """
    known = {FastGradientMethod: "fgsm", ProjectedGradientDescent: "pgd", MomentumIterativeMethod: "mim"}
    return known.get(type(attack), type(attack).__name__)


#: What follows an attack's label when the audit runs it at several budgets (an ε list): ``"fgsm eps=0.1"``.
EPS_SUFFIX = " eps="


def attack_labels(attacks: Sequence[EvasionAttack]) -> list[str]:
    """
    The labels of an audit's attacks, one each: :func:`attack_label`, followed by :data:`EPS_SUFFIX` and the scalar
    budget where the same label is given more than once (an ε list: ``"pgd eps=0.1"``, ``"pgd eps=0.3"``).

    :param attacks: ART evasion attacks.
    :return: Their labels, in order (not necessarily distinct: two attacks of one kind and budget share theirs).
    """
    base = [attack_label(a) for a in attacks]
    repeated = Counter(base)
    labels = []
    for attack, label in zip(attacks, base, strict=True):
        eps = getattr(attack, "eps", None)
        if repeated[label] > 1 and eps is not None and np.ndim(eps) == 0:
            label = f"{label}{EPS_SUFFIX}{float(eps):g}"
        labels.append(label)
    return labels


def attack_config(attack: EvasionAttack) -> dict:
    """
    The attack's ``attack_params`` as plain JSON-ready values (estimator and callables left out), as they
    run: a parameter that ART keeps only on the framework-specific attack it delegates to (MIM's ``decay``
    lives on the inner PGD attack) is read from there.

    :param attack: An ART evasion attack.
    :return: Dict of parameter names to values.
    """
    config = {}
    inner = getattr(attack, "_attack", None)
    for key in getattr(attack, "attack_params", []):
        value = getattr(attack, key, None)
        if value is None and inner is not None:
            value = getattr(inner, key, None)
        if isinstance(value, np.generic):
            value = value.item()
        if isinstance(value, float) and value == np.inf:
            value = "inf"
        if value is None or isinstance(value, (bool, int, float, str)):
            config[key] = value
    return config


def perturb_training_set(
    attack: EvasionAttack, x: np.ndarray, y_onehot: np.ndarray, indices: np.ndarray, seed: int = 0
) -> np.ndarray:
    """
    Perturb the chosen rows of a training set with an attack; the other rows stay clean.

    numpy's global generator (which ART's random starts use) is seeded with ``seed`` for the call;
    the caller restores the global state (see :func:`art_malleability._utils.state.preserved`).

    :param attack: A ready ART evasion attack.
    :param x: Training inputs (n, ...), float32; not modified.
    :param y_onehot: One-hot true labels (n, nb_classes).
    :param indices: Rows to perturb.
    :param seed: Seed of the attack's random choices.
    :return: A new float32 array, equal to ``x`` outside ``indices``.
    """
    x_adv = np.array(x, dtype=np.float32, copy=True)
    if len(indices) == 0:
        return x_adv
    np.random.seed(seed)
    x_adv[indices] = attack.generate(x=x_adv[indices], y=y_onehot[indices]).astype(np.float32)
    return x_adv


#: Label of the random-perturbation control in reports.
CONTROL_LABEL = "random-sign"


def control_eps(attack: EvasionAttack) -> float | None:
    """
    The ℓ∞ budget of an attack's random-perturbation control: the attack's ``eps`` when it is an ℓ∞
    attack with one scalar budget (every named attack), else ``None`` (no matching control exists).

    :param attack: An ART evasion attack.
    :return: The budget, or ``None``.
    """
    norm = getattr(attack, "norm", None)
    eps = getattr(attack, "eps", None)
    if norm not in (np.inf, "inf") or eps is None or np.ndim(eps) != 0:
        return None
    eps = float(eps)
    return eps if np.isfinite(eps) and eps > 0 else None


def random_sign_perturbation(
    x: np.ndarray,
    rows: np.ndarray,
    eps: float,
    clip_values: tuple[float, float] | None,
    seed: int = 0,
) -> np.ndarray:
    """
    The non-adversarial counterpart of FGSM: every input value moved by ``+eps`` or ``-eps`` with equal
    probability, then clipped to the valid range. The signs of training row ``r`` come from a generator
    seeded with ``(seed, r)``, so they do not depend on how the rows are batched or sharded.

    :param x: Inputs ``(len(rows), ...)``; not modified.
    :param rows: Their training indices.
    :param eps: ℓ∞ budget (> 0).
    :param clip_values: Valid input range, or ``None`` for no clipping.
    :param seed: Seed of the signs.
    :return: A new float32 array of the shape of ``x``.
    """
    x = np.asarray(x, dtype=np.float32)
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if len(rows) != len(x):
        raise ValueError(f"rows must hold one training index per input, got {len(rows)} for {len(x)} inputs")
    width = int(np.prod(x.shape[1:], dtype=np.int64))
    signs = np.empty((len(x), width), dtype=np.float32)
    for i, row in enumerate(rows):
        signs[i] = np.random.default_rng([int(seed), int(row)]).integers(0, 2, width) * 2.0 - 1.0
    perturbed = x + np.float32(eps) * signs.reshape(x.shape)
    if clip_values is not None:
        perturbed = np.clip(perturbed, clip_values[0], clip_values[1])
    return perturbed.astype(np.float32)
