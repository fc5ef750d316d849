"""
How an audit passes its inputs on (``benchmarks/trace_inputs.py``): a tiny audit followed under ``sys.setprofile``
must not hand ``x`` back and forth between modules more than it does now.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "trace_inputs.py"
_spec = importlib.util.spec_from_file_location("trace_inputs", _PATH)
trace = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("trace_inputs", trace)
_spec.loader.exec_module(trace)

#: What the restructured audit reaches (the commit before it: 19 returns, 11 steps up, 3 label reads with a test
#: set; 30, 16 and 4 with the queries drawn from x), by number of test points. The report's training examples added
#: one module and one return: the chosen examples' rows (a dozen per attack) go to ``audit.examples`` for their
#: thumbnails, once per attack, and control comes back.
BOUNDS = {
    30: {"returns": 10, "steps_up": 4, "label_reads": 1, "modules": 9},
    0: {"returns": 22, "steps_up": 9, "label_reads": 2, "modules": 9},
}


@pytest.mark.parametrize("n_test", sorted(BOUNDS))
def test_the_audit_passes_its_inputs_on_without_going_back(n_test):
    before = sys.getprofile()
    summary, report = trace.trace_audit(n_test=n_test)
    assert sys.getprofile() is before
    assert report.results and report.n_train == 80
    found = {"returns": summary.returns, "steps_up": summary.steps_up, "label_reads": len(summary.label_reads),
             "modules": len(summary.modules)}
    assert all(found[key] <= bound for key, bound in BOUNDS[n_test].items()), (found, summary.runs)
    assert summary.modules[0] == "art_malleability.audit.estimator"


def test_the_summary_counts_returns_steps_up_and_outermost_label_reads():
    calls = [
        trace.Call("art_malleability.audit.estimator", "evaluate", None),
        trace.Call("art_malleability.data.streaming", "ExampleSource.__init__", 0),
        trace.Call("art_malleability._utils.checks", "check_labels", 1, reads_labels=True),
        trace.Call("art_malleability.data.streaming", "ExampleSource.labels", 0, reads_labels=True),
        trace.Call("art_malleability.audit.estimator", "_audit", 0),
        trace.Call("art_malleability.audit._run", "AuditRun.__init__", 4),
        trace.Call("art_malleability.audit._run", "AuditRun.score_clean", 4),  # the same module again
        trace.Call("art_malleability.data.streaming", "ExampleSource.take", 6, reads_labels=True),
        trace.Call("art_malleability._utils.checks", "check_labels", 7, reads_labels=True),
    ]
    summary = trace.summarise(calls, trace.layers())
    estimator, streaming, checks, run = (f"art_malleability.{m}" for m in (
        "audit.estimator", "data.streaming", "_utils.checks", "audit._run"))
    assert summary.runs == [estimator, streaming, checks, streaming, estimator, run, streaming, checks]
    assert summary.returns == 4  # streaming twice, checks, estimator
    assert summary.returns_by_module == {streaming: 2, checks: 1, estimator: 1}
    assert summary.steps_up == 2  # checks -> streaming, streaming -> estimator
    assert summary.steps_up_by_pair == {"_utils.checks -> data.streaming": 1, "data.streaming -> audit.estimator": 1}
    assert summary.label_reads == ["_utils.checks.check_labels", "data.streaming.ExampleSource.labels",
                                   "data.streaming.ExampleSource.take"]  # not the check inside the take
    assert len(summary.modules) == 4


def test_the_tracer_follows_copies_subsets_and_holders():
    np = pytest.importorskip("numpy")
    x = np.arange(12, dtype=np.float64).reshape(6, 2)
    y = np.array([0, 1, 0, 1, 1, 0])
    tracer = trace.InputTracer(x, y)
    assert tracer.is_input(x[2:4]) and tracer.is_input(x[[5, 0]].astype(np.float32))
    assert not tracer.is_input(x[:2] + 0.5)
    rows, labels = x[[1, 3]].copy(), y[[1, 3]].copy()
    tracer._adopt((rows, labels))
    assert tracer.is_label(labels) and not tracer.is_label(labels.copy())

    class Holder:
        def __init__(self, data):
            self.data = data

    assert tracer._holds(Holder(rows)) and not tracer._holds(Holder(x + 100))
