"""
Parameter rules, declared once, in the manner of scikit-learn's ``_parameter_constraints``: every estimator holds a
table ``{parameter: rule}``, and its constructor, ``set_params`` and the command line all check through it. A refused
value raises :class:`InvalidParameterError`, which carries the parameter's name (``.param``) and the rule's words, so
that a caller naming the parameter its own way (the command line's ``--option``) never reads the message.

A *rule* is any callable ``rule(value, name) -> value`` that returns the value (normalised: an int, a float, a tuple)
or raises :class:`InvalidParameterError`; :class:`Rule` builds one from a test and the words of what the value must
do. A table maps a parameter to a rule or to a tuple of rules applied in order (a type first, then a range).

The rules of parameters that several subpackages share (the influential set's share, the NTK influence's mode,
the seed, the process group, the memory limit, the device and the dtype) are declared here, the package's shared base,
with :func:`resolve_device`, which applies the device's rule; an estimator's own rules live beside it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

#: A rule: ``rule(value, name)`` returns the (normalised) value or raises :class:`InvalidParameterError`.
Check = Callable[[Any, str], Any]
#: A table of rules: each parameter's rule, or its rules applied in order.
RuleTable = Mapping[str, Check | tuple[Check, ...]]


class InvalidParameterError(ValueError):
    """
    A parameter whose value its rule refuses. Its message reads ``"<param> must <rule>, got <value><note>"``; it stays
    a ``ValueError`` (:class:`InvalidParameterTypeError` also a ``TypeError``) so that callers catching those keep
    working.

    :param param: The parameter's name, as the library's caller writes it.
    :param must: What the value must do, completing ``"<param> must ..."``.
    :param got: The value as the message shows it.
    :param note: Words after the value (why, or what to do instead), with their own leading separator.
    """

    def __init__(self, param: str, must: str, got: str, note: str = "") -> None:
        self.param, self.must, self.got, self.note = param, must, got, note
        super().__init__(self.message(param))

    def message(self, name: str) -> str:
        """:return: The message with the parameter called ``name`` (an option's spelling, say)."""
        return f"{name} must {self.must}, got {self.got}{self.note}"

    def __reduce__(self) -> tuple:  # picklable across processes, like any exception
        return type(self), (self.param, self.must, self.got, self.note)


class DataContentError(InvalidParameterError):
    """A data file that was read but whose contents cannot be used (its arrays' names, shapes, labels or values): the
    command line's status 2, as an option it cannot use, where a file that cannot be read is a failure (1)."""


class InvalidParameterTypeError(InvalidParameterError, TypeError):
    """An :class:`InvalidParameterError` for a value of the wrong type (also a ``TypeError``, as before)."""


class InvalidParameterPathError(InvalidParameterError, FileNotFoundError):
    """
    An :class:`InvalidParameterError` for a path that does not exist or does not hold what it must (also a
    ``FileNotFoundError``, as before).
    """


def invalid(name: str, must: str, value: object, note: str = "", *, type_error: bool = False) -> InvalidParameterError:
    """:return: The error of parameter ``name``, whose ``value`` (shown by its ``repr``) must do ``must``."""
    kind = InvalidParameterTypeError if type_error else InvalidParameterError
    return kind(name, must, repr(value), note)


def invalid_path(name: str, must: str, path: object, note: str = "") -> InvalidParameterPathError:
    """:return: The error of parameter ``name``, whose ``path`` (shown as its quoted string) must do ``must``."""
    return InvalidParameterPathError(name, must, repr(str(path)), note)


@dataclass(frozen=True)
class Rule:
    """
    A rule from a test: ``Rule("be a positive integer", lambda v: ...)``.

    :param must: What the value must do, completing ``"<name> must ..."``.
    :param test: Whether a value passes (an exception inside it counts as a refusal).
    :param convert: What a passing value becomes (``None``: itself).
    :param type_error: Whether a refusal is an :class:`InvalidParameterTypeError` (the value's type is wrong).
    :param note: Words after the value in the message.
    :param show: How the message shows the value (default ``repr``).
    """

    must: str
    test: Callable[[Any], bool]
    convert: Callable[[Any], Any] | None = None
    type_error: bool = False
    note: str = ""
    show: Callable[[Any], str] = repr

    def __call__(self, value: Any, name: str) -> Any:
        try:
            ok = bool(self.test(value))
        except (TypeError, ValueError, OverflowError):
            ok = False
        if not ok:
            kind = InvalidParameterTypeError if self.type_error else InvalidParameterError
            raise kind(name, self.must, self.show(value), self.note)
        return value if self.convert is None else self.convert(value)

    def shown(self, show: Callable[[Any], str]) -> Rule:
        """:return: The same rule (its words and test) whose message shows the value with ``show``."""
        return dataclasses.replace(self, show=show)


def shown(rules: Check | tuple[Check, ...], show: Callable[[Any], str]) -> Check | tuple[Check, ...]:
    """
    :return: ``rules`` (a rule, a tuple of them or an :func:`optional` rule) whose messages show the value with
        ``show`` (the command line shows it as typed); a rule written as a function keeps its own display.
    """
    if isinstance(rules, tuple):
        return tuple(shown(rule, show) for rule in rules)
    inner = getattr(rules, "optional_of", None)
    if inner is not None:
        return optional(shown(inner, show))
    return rules.shown(show) if isinstance(rules, Rule) else rules


def words(rules: Check | tuple[Check, ...]) -> str:
    """
    :return: What a value of ``rules`` must do, in the words of their messages: a :class:`Rule`'s ``must`` (or that of
        a rule written as a function), those of a tuple joined (each once; a type check's left out where a rule after
        it says more), ``None`` or those of an :func:`optional` rule, otherwise the first line of the rule's
        docstring.
    """
    if isinstance(rules, tuple):
        said = [r for i, r in enumerate(rules) if not (isinstance(r, Rule) and r.type_error and i < len(rules) - 1)]
        return "; ".join(dict.fromkeys(words(rule) for rule in said))
    inner = getattr(rules, "optional_of", None)
    if inner is not None:
        return f"be None, or {words(inner)}"
    must = getattr(rules, "must", None)
    if isinstance(must, str):
        return must
    return (rules.__doc__ or getattr(rules, "__name__", repr(rules))).strip().splitlines()[0]


def check_value(rules: Check | tuple[Check, ...], value: Any, name: str) -> Any:
    """:return: ``value`` through each of ``rules`` in turn (a single rule or a tuple of them)."""
    for rule in rules if isinstance(rules, tuple) else (rules,):
        value = rule(value, name)
    return value


def check_values(table: RuleTable, values: Mapping[str, Any]) -> dict[str, Any]:
    """
    Check the ``values`` that ``table`` has rules for, in the table's order.

    :param table: The rules by parameter.
    :param values: Values by parameter (those without a rule pass unchecked).
    :return: The checked values (normalised by their rules), by parameter.
    :raises InvalidParameterError: For the first value its rule refuses, naming the parameter.
    """
    return {name: check_value(rules, values[name], name) for name, rules in table.items() if name in values}


def is_int(value: object) -> bool:
    """:return: Whether ``value`` is an integer (a Python or numpy int; ``bool`` is not)."""
    return not isinstance(value, bool) and isinstance(value, (int, np.integer))


def is_number(value: object) -> bool:
    """:return: Whether ``value`` is a real number (a Python or numpy int or float; ``bool`` is not)."""
    return not isinstance(value, bool) and isinstance(value, (int, float, np.integer, np.floating))


def optional(rules: Check | tuple[Check, ...]) -> Check:
    """:return: The rule that lets ``None`` pass and checks anything else with ``rules``."""

    def check(value: Any, name: str) -> Any:
        return None if value is None else check_value(rules, value, name)

    check.optional_of = rules  # type: ignore[attr-defined] - what :func:`words` reads
    return check


def one_of(options: tuple, must: str | None = None) -> Rule:
    """:return: The rule of a value among ``options`` (compared with ``==``, as ``in`` does)."""
    return Rule(must or f"be one of {options}", lambda v: v in options)


def each_one_of(options: tuple, must: str | None = None) -> Rule:
    """
    :return: The rule of a sequence whose every value is among ``options`` (its message shows the first that is not;
        a string is no sequence of them).
    """
    return Rule(must or f"be drawn from {options}",
                lambda vs: not isinstance(vs, str) and all(v in options for v in vs),
                show=lambda vs: _first_not_in(vs, options))


def _first_not_in(values: Any, options: tuple) -> str:
    """:return: The ``repr`` of the first of ``values`` not among ``options`` (of ``values`` itself if none is)."""
    if isinstance(values, str):
        return repr(values)
    try:
        return repr(next(v for v in values if v not in options))
    except (TypeError, StopIteration):
        return repr(values)


def number_type(must: str) -> Rule:
    """:return: The type part of a number's rule (an :class:`InvalidParameterTypeError` for a non-number)."""
    return Rule(must, is_number, type_error=True, show=lambda v: f"{type(v).__name__} {v!r}")


# ----------------------------------------------------------------------------------------------------
# Generic rules.
# ----------------------------------------------------------------------------------------------------

POSITIVE_INT = Rule("be a positive integer", lambda v: is_int(v) and v >= 1, int)
#: Fewest bootstrap resamples an audit takes: below it the standard error a normal interval is built from varies by
#: more than a quarter from one seed to the next (``1 / sqrt(2 (B - 1))``: 0.24 at 10), and one resample gives none.
MIN_BOOTSTRAP = 10
BOOTSTRAP_RESAMPLES = Rule(f"be an integer of at least {MIN_BOOTSTRAP} (the resamples an interval is built from)",
                           lambda v: is_int(v) and v >= MIN_BOOTSTRAP, int)
NON_NEGATIVE_INT = Rule("be a non-negative integer", lambda v: is_int(v) and v >= 0, int)
POSITIVE = Rule("be a positive finite number", lambda v: is_number(v) and math.isfinite(v) and v > 0, float)
NON_NEGATIVE = Rule("be a non-negative finite number", lambda v: is_number(v) and math.isfinite(v) and v >= 0, float)
#: A duration: a positive finite number of seconds.
POSITIVE_SECONDS = Rule("be a positive number of seconds", lambda v: is_number(v) and math.isfinite(v) and v > 0,
                        float)
#: A list of counts or widths: positive integers.
POSITIVE_INTS = Rule("hold positive integers", lambda vs: all(is_int(v) and v >= 1 for v in vs))
#: A list whose values are distinct (each one once): widths, seeds, model names.
DISTINCT = Rule("hold distinct values (each one once)", lambda vs: len(set(vs)) == len(vs))
BOOL = Rule("be True or False", lambda v: isinstance(v, bool), type_error=True)
#: The floating-point dtypes a computation may run in.
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: A floating-point torch dtype of the computation.
DTYPE = Rule("be a floating-point torch.dtype (e.g. torch.float64)",
             lambda v: isinstance(v, torch.dtype) and v in FLOAT_DTYPES, type_error=True)
#: The losses known by name.
LOSS_NAMES = ("cross_entropy", "mse")
LOSS = one_of(LOSS_NAMES)

# ----------------------------------------------------------------------------------------------------
# Parameters that several subpackages share.
# ----------------------------------------------------------------------------------------------------

#: Share of the training examples in the influential set (the audit, the metrics, the command line).
TOP_FRACTION = Rule("lie in (0, 1]", lambda v: is_number(v) and 0.0 < float(v) <= 1.0)
#: Rankings of the influential set.
RANK_BY_NAMES = ("abs", "signed")
RANK_BY = one_of(RANK_BY_NAMES)
#: Coverage of an interval.
CONFIDENCE = Rule("lie in (0, 1)", lambda v: is_number(v) and 0.0 < float(v) < 1.0)
#: The seed of every random choice (numpy's seeds are non-negative).
SEED = (
    Rule("be a non-negative integer", is_int, type_error=True),
    Rule("be a non-negative integer (numpy's seeds are)", lambda v: v >= 0),
)
#: Whether to shard over a ``torch.distributed`` process group.
DISTRIBUTED = one_of(("auto", True, False), "be 'auto', True or False")
#: A positive finite number, a float (a ``TypeError`` for a value that is no number).
POSITIVE_NUMBER = (number_type("be a positive number"), POSITIVE)
#: The memory (GiB) the large matrices may take; ``None``: a share of the device's total memory.
MEMORY_LIMIT_GB = optional(POSITIVE_NUMBER)

WORK_DIR = optional(Rule("be a folder path (a str or os.PathLike)",
                         lambda v: isinstance(v, (str, os.PathLike)) and str(v) != "", type_error=True))
#: The size of a subset of the data (``n_train``, ``n_test``): a positive integer; ``None``: the default size.
SIZE = optional((
    Rule("be an int or None", is_int, type_error=True, show=lambda v: type(v).__name__),
    POSITIVE_INT,
))
#: Queries of an audit: every interval resamples them, so two or more; ``None``: the default number.
N_QUERIES = optional((
    POSITIVE_INT,
    Rule("be at least 2", lambda v: v >= 2, note="; every interval resamples the queries and needs two or more"),
))
#: Subset models of the LDS: it correlates over them, so two or more.
N_MODELS = Rule("be an integer >= 2 (the LDS correlates over the subset models)", lambda v: is_int(v) and v >= 2)
#: Share of the training set in each subset of the LDS.
ALPHA = Rule("lie strictly between 0 and 1 (the share of each subset)",
             lambda v: is_number(v) and math.isfinite(float(v)) and 0.0 < float(v) < 1.0)
#: A projection dimension: a positive integer that indexes as a 32-bit int.
PROJECTION_DIM = Rule("be a positive integer below 2**31", lambda v: is_int(v) and 0 < int(v) < 2**31, int)


def _projection_mode(value: Any, name: str) -> Any:
    """The NTK influence's mode other than ``None``: ``"auto"`` or a projection dimension (:data:`PROJECTION_DIM`)."""
    return value if value == "auto" else PROJECTION_DIM(value, name)


_projection_mode.must = f"be 'auto', or {PROJECTION_DIM.must}"  # type: ignore[attr-defined]
#: The NTK influence's mode: ``"auto"``, ``None`` (exact) or a projection dimension.
NTK_MODE = optional(_projection_mode)


def resolve_device(device: str | torch.device = "auto", name: str = "device") -> torch.device:
    """
    Turn a device specification into a :class:`torch.device`: the rule :data:`DEVICE` and what it resolves to.

    :param device: ``"auto"`` (CUDA when available, otherwise CPU), ``"cpu"``, ``"gpu"``/``"cuda"``,
                   ``"cuda:k"`` or a :class:`torch.device`.
    :param name: The parameter's name in the error.
    :return: The device.
    :raises InvalidParameterTypeError: If ``device`` is neither a string nor a :class:`torch.device` (a ``TypeError``).
    :raises InvalidParameterError: If PyTorch does not understand it, or it asks for CUDA where there is none.
    """
    if not isinstance(device, (str, torch.device)):
        raise invalid(name, "be 'auto', a device string or a torch.device", device, type_error=True)
    key = device if isinstance(device, torch.device) else device.strip().lower()
    if key == "auto":
        key = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        resolved = torch.device("cuda" if key == "gpu" else key)
    except RuntimeError:
        resolved = None
    if resolved is None or (resolved.type == "cuda" and not torch.cuda.is_available()):
        cuda = str(device).strip().lower().startswith(("cuda", "gpu")) and not torch.cuda.is_available()
        raise invalid(name, "be 'auto', 'cpu', 'gpu', 'cuda' or 'cuda:k' naming an available device", device,
                      "; CUDA is not available" if cuda else "")
    return resolved


def _device(value: Any, name: str) -> Any:
    """The device rule: ``"auto"``, a device string or a :class:`torch.device` that this machine has."""
    resolve_device(value, name)
    return value


_device.must = "be 'auto', 'cpu', 'gpu', 'cuda', 'cuda:k' or a torch.device that this machine has"  # type: ignore
#: A device: ``"auto"`` (CUDA when available), ``"cpu"``, ``"gpu"``, ``"cuda"``, ``"cuda:k"`` or a torch.device.
DEVICE: Check = _device
