"""
Benchmark: how an audit passes its inputs on. A tiny real audit (``MalleabilityEstimator(...).evaluate(x, y, x_test,
y_test)``, the README's call, on 80 scikit-learn digits and 30 test points, a small network, one attack, two
control draws, few bootstrap resamples, quiet) runs under ``sys.setprofile`` and the calls that hand the training
inputs ``x`` (and their labels ``y``) on are followed.

What is followed:

- **tracked inputs**: an array or tensor whose rows are all rows of the user's ``x`` (compared in float32: the
  inputs, a converted copy or a subset of them) or that shares memory with a tracked array; a tuple, list or dict
  holding one; and an object holding one among its attributes (an ``ExampleSource`` built from the inputs, an
  inputs record), checked when a counted call returns it, or returns with it as its ``self``. Objects of the
  subpackages the flow is not followed into (below) do not count as holders: what they keep is their business;
- **tracked labels**: the user's ``y``, arrays sharing memory with a tracked label array, and one-dimensional integer
  arrays that a counted call returns equal to ``y`` as class indices, or beside tracked inputs of their length with
  those inputs' labels (a batch's labels). Labels indexed in place (``y[rows]``) are not followed;
- **counted calls**: calls of functions defined in the ``art_malleability`` package with a tracked input or label
  among their arguments (``self`` included); a generator counts once, when it starts; a helper that is handed a
  function of the package (the process group's ``run_everywhere``) is transparent: it is not counted, the function
  it runs is. The flow is followed into the audit's own modules and the helpers that hold and check its inputs
  (:data:`FOLLOWED_INSIDE`); a call into any other subpackage (the influence estimators, the metrics, ...) counts,
  and what it calls inside is its own business, but for calls back into the audit's code.

From the sequence of counted calls (in the order they start) the script reports

- the **modules visited**;
- the **returns to a module already left**: a counted call in module ``M`` after the flow had gone from ``M`` to
  another module, counted once per return (the sequence of modules with repeats collapsed, each entry whose module
  came earlier);
- the **steps back up a layer**: a counted call in a higher layer (``LAYERS`` of ``tests/test_layout.py``, the
  layers of docs/concepts.md) than the counted call just before it: the flow going back up to a layer it had gone
  down from;
- the **label reads**: counted calls that check or hand back all the labels (they return a tracked label array as
  long as ``y``, alone or in a plain tuple), counted when no enclosing counted call does as well.

The same measurement runs on another checkout of the package with ``--root`` (its ``art_malleability`` is imported
instead of this one's; the layers are this checkout's)::

    python benchmarks/trace_inputs.py                         # this checkout
    python benchmarks/trace_inputs.py --root ../other         # another checkout of the package
    python benchmarks/trace_inputs.py --n-test 0              # queries drawn from x (x_test=None)
    python benchmarks/trace_inputs.py --sequence              # and the modules in the order the flow visits them
"""

from __future__ import annotations

import argparse
import ast
import os
import sys
import tempfile
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parent.parent
PACKAGE = "art_malleability"
_CO_GENERATOR = 0x20 | 0x200  # CO_GENERATOR | CO_ASYNC_GENERATOR
#: The subpackages whose calls the flow is followed into: the audit and the helpers that hold and check its inputs.
#: A call into any other subpackage (the influence estimators, the metrics, the models, ...) counts, and the calls it
#: makes inside are that subpackage's own business, but for calls back into the audit's own code (a function of the
#: audit run by a helper such as the process group's ``run_everywhere``).
FOLLOWED_INSIDE = ("audit", "data", "_utils")


def _followed(module: str) -> bool:
    """Whether the flow is followed into a package module's calls (see :data:`FOLLOWED_INSIDE`)."""
    parts = module.split(".")
    return len(parts) > 1 and parts[0] == PACKAGE and parts[1] in FOLLOWED_INSIDE


def _package_function(value: Any) -> bool:
    """Whether ``value`` is a function or bound method defined in the package."""
    function = getattr(value, "__func__", value)
    return callable(function) and not isinstance(function, type) and (
        getattr(function, "__module__", None) or "").startswith(PACKAGE)


def layers(root: Path = REPO_ROOT) -> tuple[tuple[str, ...], ...]:
    """:return: The ``LAYERS`` tuple of ``tests/test_layout.py``, top to bottom (read, not imported)."""
    tree = ast.parse((root / "tests" / "test_layout.py").read_text())
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if any(isinstance(t, ast.Name) and t.id == "LAYERS" for t in targets):
                return ast.literal_eval(node.value)
    raise ValueError(f"tests/test_layout.py of {root} must define LAYERS, found none")


def layer_of(module: str, layer_table: Sequence[Sequence[str]]) -> int | None:
    """:return: The depth of a package module's layer (0 the top), ``None`` for a module in no layer."""
    parts = module.split(".")
    part = parts[1] if len(parts) > 1 else parts[0]
    return next((depth for depth, members in enumerate(layer_table) if part in members), None)


# ------------------------------------------------------------------------------------------------ the summary
@dataclass
class Call:
    """One counted call."""

    #: The module that defines the function.
    module: str
    #: The function's qualified name.
    function: str
    #: Index of the innermost enclosing counted call, ``None`` at the top.
    parent: int | None
    #: Whether it returned all the labels.
    reads_labels: bool = False


@dataclass
class FlowSummary:
    """The counts of :func:`summarise` (see the module's docstring)."""

    modules: list[str]
    returns: int
    returns_by_module: dict[str, int]
    steps_up: int
    steps_up_by_pair: dict[str, int]
    label_reads: list[str]
    calls: int
    runs: list[str] = field(repr=False)

    def rows(self) -> list[tuple[str, str]]:
        """:return: The table's rows, ``(what, value)``."""
        def listed(counts: dict[str, int]) -> str:
            return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))

        return [
            ("counted calls", str(self.calls)),
            ("modules visited", f"{len(self.modules)}: {', '.join(short(m) for m in self.modules)}"),
            ("returns to a module already left", f"{self.returns} ({listed(self.returns_by_module)})"),
            ("steps back up a layer", f"{self.steps_up} ({listed(self.steps_up_by_pair)})"),
            ("label reads", f"{len(self.label_reads)} ({', '.join(self.label_reads)})"),
        ]


def short(module: str) -> str:
    """:return: A module's name without the package's."""
    return module[len(PACKAGE) + 1 :] if module.startswith(PACKAGE + ".") else module


def summarise(calls: Sequence[Call], layer_table: Sequence[Sequence[str]]) -> FlowSummary:
    """
    :param calls: The counted calls, in the order they started.
    :param layer_table: The layers, top to bottom.
    :return: The counts of the flow.
    """
    runs = [c.module for i, c in enumerate(calls) if i == 0 or calls[i - 1].module != c.module]
    returns: Counter[str] = Counter(m for i, m in enumerate(runs) if m in runs[:i])
    steps: Counter[str] = Counter()
    for before, after in zip(runs, runs[1:], strict=False):
        low, high = layer_of(before, layer_table), layer_of(after, layer_table)
        if low is not None and high is not None and high < low:
            steps[f"{short(before)} -> {short(after)}"] += 1
    reads = []
    for call in calls:
        parent, outer = call.parent, False
        while parent is not None and not outer:
            outer, parent = calls[parent].reads_labels, calls[parent].parent
        if call.reads_labels and not outer:
            reads.append(f"{short(call.module)}.{call.function}")
    modules = list(dict.fromkeys(c.module for c in calls))
    return FlowSummary(modules, sum(returns.values()), dict(returns), sum(steps.values()), dict(steps), reads,
                       len(calls), runs)


# ------------------------------------------------------------------------------------------------ the tracer
def _as_numpy(value: Any) -> np.ndarray | None:
    """:return: An array's or a CPU tensor's data as numpy (no copy), else ``None``."""
    if isinstance(value, np.ndarray):
        return value
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor) and value.device.type == "cpu":
        try:
            return value.detach().numpy()
        except (RuntimeError, TypeError):  # a dtype numpy does not know
            return None
    return None


class InputTracer:
    """
    Follows ``x`` and ``y`` through the package's calls (see the module's docstring) while installed as the profile
    function.

    :param x: The inputs given to the audit.
    :param y: Their labels, class indices.
    """

    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = x, np.asarray(y)
        self._rows = {self._row_key(r) for r in np.asarray(x, dtype=np.float32)}
        rows = np.asarray(x, dtype=np.float32)
        self._row_label = {self._row_key(r): int(label) for r, label in zip(rows, self.y, strict=True)}
        self.tracked: dict[int, Any] = {id(x): x}  # id -> object, kept alive so that ids stay unique
        self.labels: dict[int, Any] = {id(y): y}
        self.calls: list[Call] = []
        self._open: dict[int, int | None] = {}  # frame id -> index of its counted call (None: not counted)
        self._stack: list[int] = []
        self._generators: dict[int, Any] = {}  # generator frames that started, kept alive

    @staticmethod
    def _row_key(row: np.ndarray) -> bytes:
        return np.ascontiguousarray(row, dtype=np.float32).tobytes()

    # -------------------------------------------------------------- what is tracked
    def _shares(self, data: np.ndarray, pool: dict[int, Any]) -> bool:
        for other in pool.values():
            other_data = _as_numpy(other)
            if other_data is not None and np.may_share_memory(data, other_data):
                return True
        return False

    def _input_rows(self, data: np.ndarray) -> bool:
        """Whether every row of ``data`` is a row of the user's ``x`` (compared in float32)."""
        if data.ndim != self.x.ndim or data.shape[1:] != self.x.shape[1:] or len(data) == 0:
            return False
        if data.dtype.kind not in "fiu":
            return False
        return all(self._row_key(r) in self._rows for r in np.asarray(data, dtype=np.float32))

    def _is_input_array(self, value: Any) -> bool:
        data = _as_numpy(value)
        return data is not None and (self._shares(data, self.tracked) or self._input_rows(data))

    def is_input(self, value: Any) -> bool:
        """Whether ``value`` is a tracked input object: by identity, an input array, or a container holding one."""
        if id(value) in self.tracked or self._is_input_array(value):
            return True
        if isinstance(value, (tuple, list)):
            return any(id(v) in self.tracked or self._is_input_array(v) for v in value)
        if isinstance(value, dict):
            return any(id(v) in self.tracked or self._is_input_array(v) for v in value.values())
        return False

    def is_label(self, value: Any) -> bool:
        """Whether ``value`` is a tracked label array (by identity or shared memory)."""
        if id(value) in self.labels:
            return True
        data = _as_numpy(value)
        return data is not None and self._shares(data, self.labels)

    def _adopt(self, value: Any) -> None:
        """Track what a counted call returned (see the module's docstring)."""
        items = list(value) if isinstance(value, (tuple, list)) else [value]
        inputs = []
        for item in items:
            if self._is_input_array(item):
                self.tracked[id(item)] = item
                inputs.append(_as_numpy(item))
        for item in items:
            data = _as_numpy(item)
            if data is None or data.ndim != 1 or data.dtype.kind not in "iu":
                continue
            if (self._shares(data, self.labels) or np.array_equal(data, self.y)
                    or any(len(d) == len(data) and self._labels_of(d, data) for d in inputs)):
                self.labels[id(item)] = item
        for item in [*items, value]:
            if _as_numpy(item) is None and self._holds(item):
                self.tracked[id(item)] = item

    def _labels_of(self, inputs: np.ndarray, labels: np.ndarray) -> bool:
        keys = [self._row_key(r) for r in np.asarray(inputs, dtype=np.float32)]
        return all(self._row_label[k] == int(v) for k, v in zip(keys, labels, strict=True))

    def _holds(self, obj: Any) -> bool:
        """
        Whether an object holds a tracked input or label array (an item, or an attribute of an object of a class
        defined outside the package or in a followed subpackage).
        """
        if isinstance(obj, (tuple, list, dict)):
            values = list(obj.values() if isinstance(obj, dict) else obj)
        else:
            module = getattr(type(obj), "__module__", "") or ""
            if isinstance(obj, type) or (module.startswith(PACKAGE) and not _followed(module)):
                return False
            attributes = getattr(obj, "__dict__", None)
            values = list(attributes.values()) if isinstance(attributes, dict) else []
        return any(id(v) in self.tracked or self._is_input_array(v) or self.is_label(v) for v in values)

    def _returns_labels(self, value: Any) -> bool:
        items = list(value) if type(value) in (tuple, list) else [value]  # an array, or a plain tuple holding it
        return any(id(i) in self.labels and len(i) == len(self.y) for i in items if _as_numpy(i) is not None)

    # -------------------------------------------------------------- the profile function
    def _arguments(self, frame: Any) -> list[Any]:
        code = frame.f_code
        n = code.co_argcount + code.co_kwonlyargcount
        names = list(code.co_varnames[:n])
        if code.co_flags & 0x04:  # *args
            names.append(code.co_varnames[n])
            n += 1
        values = [frame.f_locals.get(name) for name in names]
        if code.co_flags & 0x08:  # **kwargs
            values.extend((frame.f_locals.get(code.co_varnames[n]) or {}).values())
        return [v for value in values for v in (value if isinstance(value, tuple) else (value,))]

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            self._on_call(frame)
        elif event == "return":
            self._on_return(frame, arg)

    def _on_call(self, frame: Any) -> None:
        module = frame.f_globals.get("__name__", "")
        if not (module == PACKAGE or module.startswith(PACKAGE + ".")):
            return
        key = id(frame)
        if frame.f_code.co_flags & _CO_GENERATOR and self._generators.get(key) is frame:
            self._stack.append(self._open[key])  # resumed: its yields are followed, it is not counted again
            return
        if self._inside_another() and module.split(".")[1:2] != ["audit"]:
            return
        args = self._arguments(frame)
        if any(_package_function(a) for a in args):  # a helper that runs the package's function is transparent
            return
        if not any(self.is_input(a) or self.is_label(a) for a in args):
            return
        parent = self._stack[-1] if self._stack else None
        self.calls.append(Call(module, frame.f_code.co_qualname, parent))
        self._open[key] = len(self.calls) - 1
        self._stack.append(len(self.calls) - 1)
        if frame.f_code.co_flags & _CO_GENERATOR:
            self._generators[key] = frame

    def _inside_another(self) -> bool:
        """Whether the flow is inside a counted call into a subpackage it is not followed into."""
        return any(not _followed(self.calls[i].module) for i in self._stack)

    def _on_return(self, frame: Any, value: Any) -> None:
        key = id(frame)
        if key not in self._open:
            return
        index = self._open[key]
        if self._stack and self._stack[-1] == index:
            self._stack.pop()
        if key not in self._generators:
            del self._open[key]
        self._adopt(value)
        if index is not None and self._returns_labels(value):
            self.calls[index].reads_labels = True
        obj = frame.f_locals.get("self") if frame.f_code.co_argcount else None
        if obj is not None and id(obj) not in self.tracked and self._holds(obj):
            self.tracked[id(obj)] = obj


# ------------------------------------------------------------------------------------------------ the audit
#: The tiny audit: one attack, few bootstrap resamples and control draws, quiet.
TINY_AUDIT = {"attacks": ("fgsm",), "eps": 0.1, "n_queries": 12, "n_bootstrap": 10, "control_draws": 2,
              "batch_size": 16, "seed": 0, "device": "cpu", "verbose": False}


def tiny_audit_inputs(n_train: int = 80, n_test: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray | None,
                                                                    np.ndarray | None, Any]:
    """
    :return: ``n_train`` and ``n_test`` distinct scikit-learn digits (8 × 8, flattened, in [0, 1], float32) with
        their labels (the test set ``None`` for ``n_test=0``) and an ART classifier of a small network (16 hidden
        units, seeded, a few full-batch steps of training).
    """
    import torch
    from art.estimators.classification import PyTorchClassifier
    from sklearn.datasets import load_digits

    digits = load_digits()
    _, first = np.unique(digits.data, axis=0, return_index=True)
    rows = np.sort(first)[: n_train + n_test]
    x = (digits.data[rows] / 16.0).astype(np.float32)
    y = digits.target[rows].astype(np.int64)
    x, y, x_test, y_test = x[:n_train], y[:n_train], x[n_train:], y[n_train:]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 16), torch.nn.ReLU(), torch.nn.Linear(16, 10))
    optimiser = torch.optim.Adam(model.parameters(), lr=0.05)
    for _ in range(20):
        optimiser.zero_grad()
        torch.nn.functional.cross_entropy(model(torch.as_tensor(x)), torch.as_tensor(y)).backward()
        optimiser.step()
    classifier = PyTorchClassifier(model, torch.nn.CrossEntropyLoss(), (64,), 10, clip_values=(0.0, 1.0),
                                   device_type="cpu")
    return x, y, (x_test if n_test else None), (y_test if n_test else None), classifier


def trace_audit(n_train: int = 80, n_test: int = 30, **params: Any) -> tuple[FlowSummary, Any]:
    """
    Run the tiny audit under the tracer.

    :param n_train: Training examples.
    :param n_test: Test points, the queries (``0``: the queries are drawn from the training examples).
    :param params: :class:`~art_malleability.MalleabilityEstimator` parameters instead of the tiny audit's.
    :return: The flow's summary and the audit's report.
    """
    from art_malleability import MalleabilityEstimator

    x, y, x_test, y_test, classifier = tiny_audit_inputs(n_train, n_test)
    params = {**TINY_AUDIT, **params}
    estimator = MalleabilityEstimator(classifier, **params)
    tracer = InputTracer(x, y)
    previous = sys.getprofile()
    sys.setprofile(tracer)
    try:
        report = estimator.evaluate(x, y, x_test, y_test)
    finally:
        sys.setprofile(previous)
    return summarise(tracer.calls, layers()), report


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=None, help="checkout whose art_malleability is measured")
    parser.add_argument("--n-train", type=int, default=80)
    parser.add_argument("--n-test", type=int, default=30, help="queries from a test set of this size (0: from x)")
    parser.add_argument("--control-draws", type=int, default=TINY_AUDIT["control_draws"])
    parser.add_argument("--no-controls", action="store_true", help="the audit without its random-sign controls")
    parser.add_argument("--sequence", action="store_true", help="print the modules in the order visited")
    args = parser.parse_args(argv)
    os.environ["HOME"] = tempfile.mkdtemp(prefix="trace-inputs-home-")  # ``import art`` writes there
    for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ.setdefault(name, "1")
    if args.root is not None:
        sys.path.insert(0, str(args.root.resolve()))
    import art_malleability

    summary, _ = trace_audit(args.n_train, args.n_test, controls=not args.no_controls, control_draws=args.control_draws)
    where = Path(art_malleability.__file__).resolve().parent.parent
    queries = f"{args.n_test} test points" if args.n_test else "queries drawn from x"
    print(f"x followed from MalleabilityEstimator.evaluate ({where}; {args.n_train} training examples, {queries})\n")
    width = max(len(what) for what, _ in summary.rows())
    print(f"| {'what':<{width}} | value |\n|{'-' * (width + 2)}|-------|")
    for what, value in summary.rows():
        print(f"| {what:<{width}} | {value} |")
    if args.sequence:
        print("\n" + " -> ".join(short(m) for m in summary.runs))


if __name__ == "__main__":
    main()
