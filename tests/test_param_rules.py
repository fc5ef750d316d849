"""Parameter rules declared once (issue 37): every estimator's ``get_params()`` rebuilds an equal estimator, and every
declared rule refuses a bad value through the library and the command line, naming the parameter or its option."""

import pickle
import re
from pathlib import Path

import pytest
import torch

from art_malleability._utils.params import (
    InvalidParameterError,
    InvalidParameterTypeError,
    check_values,
)
from art_malleability.audit import MalleabilityEstimator
from art_malleability.audit.params import PARAMETER_RULES
from art_malleability.cli import main
from art_malleability.cli.options import AUDIT_OPTIONS
from art_malleability.influence import CaptumInfluence, GradientInfluence, NTKInfluence
from art_malleability.influence._ntk_rules import NTK_RULES
from art_malleability.models import build_reference_model
from art_malleability.models.training import make_classifier
from art_malleability.ntk.empirical import NTK_METHODS


@pytest.fixture(scope="module")
def clf():
    model = build_reference_model("2l-relu", (1, 4, 4), 3, width=8, seed=0)
    return make_classifier(model, (1, 4, 4), 3, device="cpu")


# ------------------------------------------------------------------------------ 1. get_params rebuilds the estimator

#: Every estimator class with parameters other than its defaults (``verbose`` included where it has one).
INFLUENCES = [
    NTKInfluence(ridge=0.5, loss="cross_entropy", device="cpu", dtype=torch.float32, batch_size=7, method="jacobian",
                 projection_dim=64, projection_seed=3, max_exact_n=10, memory_limit_gb=2.0, distributed=False,
                 verbose=True, exact_budget_s=5.0, planned_refits=2, planned_queries=9),
    GradientInfluence(loss="mse", learning_rates=None, device="cpu", dtype=torch.float32, batch_size=5,
                      method="structured"),
    CaptumInfluence(loss="mse", device="cpu", dtype=torch.float32, batch_size=5, sample_wise_grads_per_batch=False),
]


@pytest.mark.parametrize("estimator", INFLUENCES, ids=lambda e: type(e).__name__)
def test_every_influence_estimators_get_params_rebuilds_an_equal_estimator(estimator):
    params = estimator.get_params()
    rebuilt = type(estimator)(**params)
    assert rebuilt.get_params() == params
    defaults = type(estimator)().get_params()
    assert [name for name in params if params[name] != defaults[name]]  # the test sets non-default values
    if "verbose" in params:
        assert params["verbose"] is True and rebuilt.verbose is True


def test_the_audits_get_params_rebuilds_an_equal_estimator_verbose_included(clf):
    audit = MalleabilityEstimator(clf, attacks=["fgsm", "pgd"], eps=0.1, influence="ntk", top_fraction=0.2,
                                  strategy="all", ridge="gcv", n_queries=7, rank_by="signed", n_bootstrap=11,
                                  confidence=0.9, attack_max_iter=3, batch_size=4, seed=2, device="cpu",
                                  verbose=False, projection_dim=None, distributed=False, controls=False,
                                  control_draws=2, memory_limit_gb=1.5, time_budget_s=30.0)
    params = audit.get_params()
    rebuilt = MalleabilityEstimator(clf, **params)
    assert rebuilt.get_params() == params and params["verbose"] is False
    # what it builds from the parameters is the same too
    assert rebuilt._influence.get_params() == audit._influence.get_params()
    assert audit._influence.verbose is False and audit._influence.ridge == "gcv"


def test_a_configured_ntk_influence_sets_the_pass_through_parameters(clf, caplog):
    influence = NTKInfluence(ridge=0.25, projection_dim=32, exact_budget_s=12.0, device="cpu")
    audit = MalleabilityEstimator(clf, influence=influence, device="cpu", verbose=False)
    assert audit._influence is influence
    params = audit.get_params()
    assert (params["ridge"], params["projection_dim"], params["time_budget_s"]) == (0.25, 32, 12.0)
    assert params["influence"] == "ntk"
    rebuilt = MalleabilityEstimator(clf, **params)  # the string form builds the same NTK influence
    assert rebuilt.get_params() == params
    assert (rebuilt._influence.ridge, rebuilt._influence.projection_dim) == (0.25, 32)
    assert rebuilt._influence.exact_budget_s == 12.0
    assert not caplog.records
    MalleabilityEstimator(clf, influence=NTKInfluence(ridge=0.25), ridge=0.5, verbose=False)
    assert "ridge=0.5 is replaced by the given influence's ridge=0.25" in caplog.text
    # the string form with today's keywords is unchanged
    plain = MalleabilityEstimator(clf, ridge=0.5, projection_dim=None, verbose=False)
    assert (plain._influence.ridge, plain._influence.projection_dim, plain.ridge) == (0.5, None, 0.5)


# ------------------------------------------------------------------------------ 2. every rule, through the library

#: A value each of the audit's rules refuses.
BAD_AUDIT = {
    "attacks": ["cw"], "eps": -1.0, "influence": "tracin", "top_fraction": 1.5, "strategy": "some", "ridge": 0.0,
    "rank_by": "first", "n_bootstrap": 0, "attack_max_iter": 0, "batch_size": 0, "control_draws": 0, "n_queries": 1,
    "confidence": 1.0, "seed": -1, "device": "tpu9", "projection_dim": 0, "distributed": "maybe",
    "controls": "yes", "memory_limit_gb": 0.0, "time_budget_s": float("inf"), "work_dir": 3,
}


def test_every_audit_parameter_has_a_rule_and_a_bad_value_here():
    assert set(BAD_AUDIT) == set(PARAMETER_RULES)
    assert set(PARAMETER_RULES) == set(MalleabilityEstimator.estimator_params) - {"verbose"}


@pytest.mark.parametrize("name", sorted(BAD_AUDIT))
def test_each_audit_rule_refuses_its_bad_value_naming_the_parameter(clf, name):
    with pytest.raises(InvalidParameterError) as refused:
        MalleabilityEstimator(clf, **{name: BAD_AUDIT[name]}, verbose=False)
    assert refused.value.param == name and str(refused.value).startswith(f"{name} must ")
    audit = MalleabilityEstimator(clf, device="cpu", verbose=False)
    before = audit.get_params()
    with pytest.raises(InvalidParameterError) as again:
        audit.set_params(**{name: BAD_AUDIT[name]})
    assert again.value.param == name and audit.get_params() == before  # nothing changed


#: A value each influence estimator's rules refuse, by parameter (its base's included).
BAD_INFLUENCE = {
    "loss": "l1", "device": "tpu9", "dtype": torch.int64, "batch_size": 0, "method": "svd", "checkpoints": [],
    "sample_wise_grads_per_batch": 1, "ridge": -1.0, "projection_dim": 2**31, "projection_seed": 1.5,
    "max_exact_n": -1, "memory_limit_gb": float("nan"), "exact_budget_s": -1.0, "planned_refits": -1,
    "planned_queries": True, "distributed": "maybe", "tile_folder": "/no/such/folder",
}


@pytest.mark.parametrize("cls", [GradientInfluence, CaptumInfluence], ids=lambda c: c.__name__)
def test_each_tracin_rule_refuses_its_bad_value_naming_the_parameter(cls):
    rules = cls._parameter_rules
    assert set(rules) <= set(cls.estimator_params) and set(rules) <= set(BAD_INFLUENCE)
    for name in rules:
        with pytest.raises(InvalidParameterError) as refused:
            cls(**{name: BAD_INFLUENCE[name]})
        assert refused.value.param == name, name
    with pytest.raises(InvalidParameterError, match="learning_rates must have one value per checkpoint") as joint:
        cls(learning_rates=[0.1, 0.2])
    assert joint.value.param == "learning_rates"


def test_each_ntk_rule_refuses_its_bad_value_naming_the_parameter():
    assert set(NTK_RULES) == set(NTKInfluence.estimator_params) - {"verbose"}
    defaults = NTKInfluence().get_params()
    check_values(NTK_RULES, defaults)
    for name in NTK_RULES:
        with pytest.raises(InvalidParameterError) as refused:
            check_values(NTK_RULES, {**defaults, name: BAD_INFLUENCE[name]})
        assert refused.value.param == name
        with pytest.raises(ValueError, match=name):  # the estimator refuses it too
            NTKInfluence(**{name: BAD_INFLUENCE[name]})


def test_the_error_is_a_value_error_or_type_error_as_before_and_travels():
    err = InvalidParameterTypeError("seed", "be a non-negative integer", "1.5")
    assert isinstance(err, ValueError) and isinstance(err, TypeError)
    assert str(err) == "seed must be a non-negative integer, got 1.5"
    assert err.message("--seed") == "--seed must be a non-negative integer, got 1.5"
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is InvalidParameterTypeError and back.param == "seed" and str(back) == str(err)


# ------------------------------------------------------------------------------ 3. every rule, through the CLI

#: The text of a bad value of each audit option the command line parses (``--no-controls`` is a flag).
BAD_OPTIONS = {
    "--attacks": "cw", "--eps": "5", "--influence": "tracin", "--top-fraction": "1.5", "--strategy": "some",
    "--ridge": "0", "--rank-by": "first", "--n-bootstrap": "0", "--attack-max-iter": "0", "--batch-size": "0",
    "--control-draws": "0", "--n-queries": "1", "--seed": "-1", "--device": "tpu9", "--projection-dim": "3000000000",
    "--memory-limit-gb": "0", "--time-budget": "inf",
}


def test_every_audit_option_that_sets_a_parameter_has_a_bad_value_here():
    options = set(AUDIT_OPTIONS.values()) - {"--no-controls"}
    assert set(BAD_OPTIONS) == options
    # --work-dir sets work_dir per model (a subfolder each, see test_work_folder.py)
    assert set(AUDIT_OPTIONS) == set(PARAMETER_RULES) - {"confidence", "distributed", "work_dir"}


@pytest.mark.parametrize("option", sorted(BAD_OPTIONS))
def test_each_audit_option_is_refused_by_its_rule_naming_the_option(tmp_path, capsys, monkeypatch, option):
    import art_malleability.cli.audit as cli_audit
    from art_malleability.cli.checks import _SHARED_RULES, OPTION_RULES

    def never(*args, **kwargs):
        raise AssertionError("the data was read before the options were checked")

    monkeypatch.setattr(cli_audit, "load_data", never)
    try:
        code = main(["audit", "--output", str(tmp_path / "out"), option, BAD_OPTIONS[option]])
    except SystemExit as done:  # argparse's own refusal of a choice or a parsed type
        code = done.code
        assert f"argument {option}" in capsys.readouterr().err
    else:
        err = capsys.readouterr().err
        assert err.startswith(f"art-malleability audit: error: {option} "), err
        assert len(err.strip().splitlines()) == 1
        param = next(p for p, o in AUDIT_OPTIONS.items() if o == option)
        if f"{option} ({param})" not in err:  # checked first among the subcommand's options, by the same rule
            assert option in {*_SHARED_RULES, *OPTION_RULES["audit"]}, err
    assert code == 2
    assert not (tmp_path / "out").exists()


def test_the_library_and_the_cli_refuse_with_the_same_rule(tmp_path, capsys, clf):
    with pytest.raises(InvalidParameterError) as refused:
        MalleabilityEstimator(clf, n_bootstrap=0, verbose=False)
    assert main(["audit", "--output", str(tmp_path / "o"), "--n-bootstrap", "0"]) == 2
    err = capsys.readouterr().err
    assert refused.value.message("--n-bootstrap (n_bootstrap)") in err


# ------------------------------------------------------------------------------ 4. the last rules written by hand


def test_get_influence_refuses_through_its_rule_naming_influence():
    from art_malleability.influence import INFLUENCE, INFLUENCE_NAMES, get_influence

    for bad in ("tracin", 3, None, ["ntk"]):
        with pytest.raises(InvalidParameterError) as refused:
            get_influence(bad)
        assert refused.value.param == "influence"
        assert str(refused.value) == ("influence must be one of 'ntk', 'gradient', 'captum' or an InfluenceEstimator "
                                      f"instance, got {bad!r}")
        with pytest.raises(InvalidParameterError):  # the same rule, checked on its own
            INFLUENCE(bad, "influence")
    given = GradientInfluence()
    assert get_influence(given) is given
    assert [type(get_influence(name)).__name__ for name in INFLUENCE_NAMES] == [
        "NTKInfluence", "GradientInfluence", "CaptumInfluence"]


def test_the_audit_refuses_an_influence_through_the_influence_packages_rule(clf):
    """The audit's ``influence`` is the influence package's rule, in its words; a value that is neither a name nor an
    estimator is a ``TypeError`` too (as it was), a wrong name a ``ValueError`` only."""
    from art_malleability.influence import get_influence

    for bad, type_error in (("tracin", False), (3, True), (None, True), (["ntk"], True)):
        with pytest.raises(InvalidParameterError) as refused:
            MalleabilityEstimator(clf, influence=bad, verbose=False)
        with pytest.raises(InvalidParameterError) as library:
            get_influence(bad)
        assert refused.value.param == "influence" and str(refused.value) == str(library.value)
        assert isinstance(refused.value, TypeError) is type_error


def test_projection_dim_and_dtype_checks_go_through_the_declared_rules():
    import numpy as np

    from art_malleability._utils.params import DTYPE, PROJECTION_DIM
    from art_malleability._utils.torch_utils import check_dtype
    from art_malleability.ntk._checks import check_projection_dim

    for bad in (0, -3, 2**31, 1.5, True, "64"):
        with pytest.raises(InvalidParameterError) as refused:
            check_projection_dim(bad, "k")
        assert refused.value.param == "k"
        assert str(refused.value) == f"k must be a positive integer below 2**31, got {bad!r}"
        with pytest.raises(InvalidParameterError):
            PROJECTION_DIM(bad, "k")
    assert check_projection_dim(np.int64(64)) == 64 and type(check_projection_dim(np.int64(64))) is int
    for bad in (torch.int64, torch.bool, torch.complex64, torch.float8_e4m3fn, "float32", None):
        with pytest.raises(InvalidParameterTypeError) as refused:  # a TypeError, as before
            check_dtype(bad, "weights_dtype")
        assert refused.value.param == "weights_dtype"
        must = "must be a floating-point torch.dtype (e.g. torch.float64)"
        assert str(refused.value) == f"weights_dtype {must}, got {bad!r}"
        with pytest.raises(TypeError):
            DTYPE(bad, "dtype")
    for good in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        assert check_dtype(good) is good


def test_the_process_group_setting_goes_through_its_rule_naming_distributed():
    import torch.distributed as dist

    from art_malleability.distributed import ONE_PROCESS, current_shard

    assert not (dist.is_available() and dist.is_initialized())
    with pytest.raises(InvalidParameterError) as refused:
        current_shard("maybe")
    assert refused.value.param == "distributed"
    assert str(refused.value) == "distributed must be 'auto', True or False, got 'maybe'"
    with pytest.raises(InvalidParameterError) as refused:  # no process group to shard over
        current_shard(True)
    assert refused.value.param == "distributed" and "without an initialised torch.distributed" in str(refused.value)
    assert current_shard("auto") is ONE_PROCESS and current_shard(False) is ONE_PROCESS


@pytest.mark.parametrize(
    ("settings", "param", "message"),
    [
        ({"n_models": 1}, "n_models", "n_models must be an integer >= 2 (the LDS correlates over the subset models), "
                                      "got 1"),
        ({"n_models": 2.0}, "n_models", "got 2.0"),
        ({"alpha": 1.0}, "alpha", "alpha must lie strictly between 0 and 1 (the share of each subset), got 1.0"),
        ({"alpha": float("nan")}, "alpha", "got nan"),
        ({"alpha": True}, "alpha", "got True"),
    ],
)
def test_validate_checks_n_models_and_alpha_through_the_rules_the_cli_uses(settings, param, message):
    import numpy as np

    from art_malleability.cli.checks import OPTION_RULES
    from art_malleability.validation import validate

    def never(*args):
        raise AssertionError("a model was trained before the settings were checked")

    x, y = np.zeros((8, 1, 2, 2), np.float32), np.arange(8) % 2
    with pytest.raises(InvalidParameterError) as refused:
        validate(never, x, y, x[:2], y[:2], estimators=["gradient"], verbose=False, **settings)
    assert refused.value.param == param and message in str(refused.value)
    cli_rule = OPTION_RULES["validate"][f"--{param.replace('_', '-')}"]
    with pytest.raises(InvalidParameterError) as same:
        check_values({param: cli_rule}, settings)
    assert same.value.must == refused.value.must


# ------------------------------------------------------------------------------ 5. the data's rules and their options

#: The data's refusals: the arguments of ``load_dataset``, the parameter named, the error's other type (besides a
#: ``ValueError``) and the message, as before.
DATA_ERRORS = [
    ({"name_or_path": "imagenet"}, "name_or_path", None,
     "name_or_path must be one of ('digits', 'mnist', 'fashion-mnist', 'cifar10') or the path of an .npz file with "
     "arrays x and y, got 'imagenet'"),
    ({"name_or_path": 3}, "name_or_path", TypeError, "name_or_path must be a dataset name or a path, got int"),
    ({"name_or_path": "missing.npz"}, "name_or_path", FileNotFoundError,
     "name_or_path must be an existing .npz file, got 'TMP/missing.npz', which does not exist"),
    ({"name_or_path": "mnist"}, "root", None,
     "root must be the local data folder of 'mnist' (torchvision layout), got None; pass the folder that holds its "
     "files"),
    ({"name_or_path": "mnist", "root": "nowhere"}, "root", FileNotFoundError,
     "root must be an existing folder, got 'TMP/nowhere', which is no existing folder"),
    ({"name_or_path": "cifar10", "root": "."}, "root", FileNotFoundError,
     "root must hold CIFAR-10's cifar-10-batches-py/ with data_batch_1..5 and/or test_batch and batches.meta, got "
     "'TMP'; pass download=True to let torchvision download them, or load an .npz file with arrays x and y"),
    ({"name_or_path": "digits", "classes": [3]}, "classes", None,
     "classes must list at least two distinct labels, got [3]"),
    ({"name_or_path": "digits", "classes": [3, 12]}, "classes", None, "classes must lie in 0..9 of 'digits', got [12]"),
    ({"name_or_path": "digits", "n_train": 0}, "n_train", None, "n_train must be a positive integer, got 0"),
    ({"name_or_path": "digits", "n_test": 1.5}, "n_test", TypeError, "n_test must be an int or None, got float"),
    ({"name_or_path": "mnist", "root": "two-splits", "n_train": 50}, "n_train", None,
     "n_train must not exceed the 40 examples of the training split, got 50"),
    ({"name_or_path": "mnist", "root": "two-splits", "n_test": 41}, "n_test", None,
     "n_test must not exceed the 40 examples of the test split, got 41"),
    ({"name_or_path": "digits", "n_train": 1500, "n_test": 500}, "n_train and n_test", None,
     "n_train and n_test must each be >= 1 and together at most the 1797 examples of 'digits', got 1500 and 500"),
    ({"name_or_path": "digits", "seed": 1.5}, "seed", TypeError, "seed must be a non-negative integer, got 1.5"),
]


@pytest.fixture
def data_folder(tmp_path, monkeypatch):
    """A folder holding an MNIST of 40 training and 40 test images (``two-splits``); the working folder."""
    import struct

    import numpy as np

    raw = tmp_path / "two-splits" / "MNIST" / "raw"
    raw.mkdir(parents=True)
    for prefix, pixels in (("train", 10), ("t10k", 200)):
        for stem, array in (("images-idx3", np.full((40, 28, 28), pixels)), ("labels-idx1", np.arange(40) % 10)):
            header = struct.pack(">I", 0x0800 + array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
            (raw / f"{prefix}-{stem}-ubyte").write_bytes(header + array.astype(np.uint8).tobytes())
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(("kwargs", "param", "kind", "message"), DATA_ERRORS, ids=[e[1] for e in DATA_ERRORS])
def test_the_data_refuses_through_typed_errors_naming_the_parameter(data_folder, kwargs, param, kind, message):
    from art_malleability.data import load_dataset

    kwargs = {k: str(data_folder / v) if k in ("root", "name_or_path") and v in ("nowhere", ".", "missing.npz") else v
              for k, v in kwargs.items()}
    with pytest.raises(InvalidParameterError) as refused:
        load_dataset(**kwargs)
    assert refused.value.param == param
    assert str(refused.value).replace(str(data_folder), "TMP") == message
    if kind is not None:
        assert isinstance(refused.value, kind)
    assert isinstance(refused.value, FileNotFoundError) == (kind is FileNotFoundError)  # the type it had before


def test_every_error_of_load_dataset_carries_its_parameter():
    """No error of ``load_dataset`` and its sources is raised untyped (the command line would not find its option)."""
    from pathlib import Path

    import art_malleability.data as data

    for name in ("datasets.py", "_loaders.py"):
        assert not _untyped_raises((Path(data.__file__).parent / name).read_text()), name
    assert _untyped_raises('def f(x):\n    raise ValueError(f"root must be a folder, got {x}")\n') == [2]


def _untyped_raises(source: str) -> list[int]:
    """:return: The lines that raise a built-in ``ValueError``, ``TypeError`` or ``FileNotFoundError``."""
    import ast

    builtins = {"ValueError", "TypeError", "FileNotFoundError", "OSError"}
    return [node.lineno for node in ast.walk(ast.parse(source)) if isinstance(node, ast.Raise)
            and isinstance(node.exc, ast.Call) and getattr(node.exc.func, "id", None) in builtins]


def test_every_data_parameter_the_cli_maps_is_an_argument_and_its_option_exists():
    import inspect

    from art_malleability.cli import build_parser
    from art_malleability.cli.options import DATA_OPTIONS
    from art_malleability.data.datasets import BOTH_SIZES, load_dataset

    arguments = set(inspect.signature(load_dataset).parameters)
    assert set(DATA_OPTIONS) - {BOTH_SIZES} <= arguments
    assert DATA_OPTIONS[BOTH_SIZES] == " and ".join(DATA_OPTIONS[name] for name in BOTH_SIZES.split(" and "))
    audit = build_parser()._subparsers._group_actions[0].choices["audit"]
    options = {s for action in audit._actions for s in action.option_strings}
    assert {o for v in DATA_OPTIONS.values() for o in v.split(" and ")} <= options


#: Each data parameter's refusal through the command line: the options, the exit status and the line's start.
CLI_DATA_ERRORS = [
    (["--dataset", "imagenet"], 2, "--dataset must be one of ('digits', 'mnist'"),
    (["--dataset", "mnist"], 2, "--data-root must be the local data folder of 'mnist'"),
    (["--dataset", "cifar10", "--data-root", "."], 2, "--data-root must hold CIFAR-10's cifar-10-batches-py/"),
    (["--classes", "3"], 1, "--classes must list at least two distinct labels, got [3]"),
    (["--dataset", "mnist", "--data-root", "two-splits", "--n-train", "50"], 1,
     "--n-train must not exceed the 40 examples of the training split, got 50"),
    (["--dataset", "mnist", "--data-root", "two-splits", "--n-train", "30", "--n-test", "41"], 1,
     "--n-test must not exceed the 40 examples of the test split, got 41"),
    (["--n-train", "1500", "--n-test", "500"], 1,
     "--n-train and --n-test must each be >= 1 and together at most the 1797 examples of 'digits', got 1500 and 500"),
]


@pytest.mark.parametrize(("args", "code", "message"), CLI_DATA_ERRORS, ids=[a[-2] for a, _, _ in CLI_DATA_ERRORS])
def test_the_cli_names_the_option_of_each_data_parameter(data_folder, capsys, args, code, message):
    assert main(["spectrum" if "--n-test" not in args else "audit", *args, "--output", "out"]) == code
    err = capsys.readouterr().err
    assert f"error: {message}" in err and len(err.strip().splitlines()) == 1, err
    assert "download=True" not in err  # the command line never downloads: it says to place the files


def test_the_cli_neither_parses_messages_nor_walks_tracebacks():
    """Which option was wrong comes from the error's ``.param`` and the option tables, never from its text."""
    from pathlib import Path

    import art_malleability.cli as cli

    for path in Path(cli.__file__).parent.glob("*.py"):
        assert not _message_parsing(path.read_text()), path.name
    planted = ("import re\n\ndef f(err):\n    frame = err.__traceback__.tb_next\n"
               "    return frame.tb_frame, re.match(r'(\\w+) must', str(err))\n")
    assert _message_parsing(planted) == {"import re", "__traceback__", "tb_next", "tb_frame", "re.match"}


def _message_parsing(source: str) -> set[str]:
    """:return: What in ``source`` reads an error's text with a regular expression or walks its traceback frames."""
    import ast

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
            found += [f"import {n}" for n in names if n == "re"]
        elif isinstance(node, ast.Attribute) and node.attr in ("__traceback__", "tb_next", "tb_frame", "f_globals"):
            found.append(node.attr)
        elif isinstance(node, ast.Attribute) and getattr(node.value, "id", None) == "re":
            found.append(f"re.{node.attr}")
    return set(found)


def test_resolve_device_applies_the_device_rule_naming_the_parameter():
    from art_malleability._utils.params import DEVICE
    from art_malleability._utils.torch_utils import resolve_device

    assert resolve_device("cpu") == torch.device("cpu") and DEVICE(" CPU", "device") == " CPU"
    for bad in ("tpu9", 3, None):
        with pytest.raises(InvalidParameterError) as refused:
            resolve_device(bad, "eval_device")
        with pytest.raises(InvalidParameterError) as rule:
            DEVICE(bad, "eval_device")
        assert refused.value.param == "eval_device" and str(refused.value) == str(rule.value)
        assert isinstance(refused.value, TypeError) == (not isinstance(bad, str))


@pytest.mark.parametrize("cuda", [True, False])
def test_resolve_device_resolves_cuda_only_where_there_is_cuda(monkeypatch, cuda):
    from art_malleability._utils.torch_utils import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert resolve_device("auto") == torch.device("cuda" if cuda else "cpu")
    for spec, device in (("gpu", "cuda"), (" CUDA ", "cuda"), ("cuda:1", "cuda:1"), (torch.device("cuda:0"), "cuda:0")):
        if cuda:
            assert resolve_device(spec) == torch.device(device)
        else:
            with pytest.raises(InvalidParameterError, match="; CUDA is not available$") as refused:
                resolve_device(spec)
            assert refused.value.param == "device"


# ------------------------------------------------------------------------------ 6. one home per rule, and its page

#: The modules that declare rules, lowest layer first; a rule's home is the module whose own statement names it.
RULE_MODULES = (
    "art_malleability._utils.params", "art_malleability.models._attention", "art_malleability.models.training",
    "art_malleability.ntk.empirical", "art_malleability.ntk.convergence", "art_malleability.influence.ridge_choice",
    "art_malleability.influence.base", "art_malleability.influence._tracin", "art_malleability.influence._ntk_rules",
    "art_malleability.influence", "art_malleability.data.datasets", "art_malleability.validation.lds",
    "art_malleability.validation.run", "art_malleability.audit.attacks", "art_malleability.audit.params",
    "art_malleability.paper.reproduce", "art_malleability.cli.checks",
)
PAGE = Path(__file__).resolve().parents[1] / "docs" / "parameters.md"
BEGIN, END = "<!-- the rules: generated, checked by tests/test_param_rules.py -->", "<!-- end of the rules -->"


def _module_names(module_name: str) -> set[str]:
    """:return: The names that ``module_name``'s own module-level statements assign (not those it imports)."""
    import ast
    import importlib

    source = Path(importlib.import_module(module_name).__file__).read_text()
    names = set()
    for node in ast.parse(source).body:
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, ast.AnnAssign) else []
        names.update(t.id for t in targets if isinstance(t, ast.Name))
        if isinstance(node, ast.FunctionDef):
            names.add(node.name)
    return names


def _is_rule(value: object) -> bool:
    from art_malleability._utils.params import Rule

    if isinstance(value, tuple):
        return bool(value) and all(_is_rule(v) for v in value)
    return isinstance(value, Rule) or hasattr(value, "optional_of") or isinstance(getattr(value, "must", None), str)


def _named_rules() -> dict[int, tuple[str, object]]:
    """
    :return: ``id -> (home, rule)`` for every rule a module of :data:`RULE_MODULES` names as its own, its home
        ``"module.NAME"`` without the package's prefix (a copy shown otherwise, the command line's, keeps its rule's).
    """
    import importlib

    named: dict[int, tuple[str, object]] = {}
    for module_name in RULE_MODULES:
        module, short = importlib.import_module(module_name), module_name.removeprefix("art_malleability.")
        for name in sorted(_module_names(module_name)):
            value = getattr(module, name, None)
            if not name.lstrip("_").isupper() or not _is_rule(value) or id(value) in named:
                continue
            if any(_same(value, other) for _, other in named.values()):  # a copy shown otherwise: its home is kept
                continue
            named[id(value)] = (f"{short}.{name}", value)
    return named


def _same(a: object, b: object) -> bool:
    """Whether two rules are one: the same object, or copies shown otherwise (:func:`shown`) of the same rules."""
    from art_malleability._utils.params import Rule

    if a is b:
        return True
    if isinstance(a, Rule) and isinstance(b, Rule):
        return (a.test, a.must, a.type_error, a.note) == (b.test, b.must, b.type_error, b.note)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    inner_a, inner_b = getattr(a, "optional_of", None), getattr(b, "optional_of", None)
    return inner_a is not None and inner_b is not None and _same(inner_a, inner_b)


def _home(rules: object, named: dict[int, tuple[str, object]]) -> str:
    """:return: Where ``rules`` are declared: their names, or ``inline`` for a rule written in the table itself."""
    home = next((home for home, value in named.values() if _same(rules, value)), None)
    if home is not None:
        return f"`{home}`"
    if isinstance(rules, tuple):
        return " + ".join(_home(rule, named) for rule in rules)
    if hasattr(rules, "optional_of"):
        return f"optional({_home(rules.optional_of, named)})"
    if hasattr(rules, "each_of"):
        return f"each({_home(rules.each_of, named)})"
    return "inline"


def _words(rules: object) -> str:
    """What a value must do (:func:`~art_malleability._utils.params.words`), as Markdown."""
    from art_malleability._utils.params import words

    return re.sub(r":\w+:`", "`", words(rules)).replace("``", "`").replace("|", "\\|")


def _tables() -> list[tuple[str, dict, dict]]:
    """:return: Every rule table of the library: its name, its rules and its base's (whose entries it repeats)."""
    from art_malleability.data.datasets import DATA_RULES
    from art_malleability.influence import InfluenceEstimator
    from art_malleability.influence._tracin import TracInInfluence
    from art_malleability.models.training import TRAINING_RULES
    from art_malleability.ntk.convergence import CHECKER_RULES
    from art_malleability.paper.reproduce import REPRODUCTION_RULES
    from art_malleability.validation.run import VALIDATE_RULES

    base, tracin = InfluenceEstimator._parameter_rules, TracInInfluence._parameter_rules
    return [
        ("`influence.base.InfluenceEstimator._parameter_rules`", base, {}),
        ("`influence._tracin.TracInInfluence._parameter_rules`", tracin, base),
        ("`influence.gradient.GradientInfluence._parameter_rules`", GradientInfluence._parameter_rules, tracin),
        ("`influence.captum_tracin.CaptumInfluence._parameter_rules`", CaptumInfluence._parameter_rules, tracin),
        ("`influence._ntk_rules.NTK_RULES` (`NTKInfluence._parameter_rules`)", NTK_RULES, base),
        ("`models.training.TRAINING_RULES` (`train_model`)", TRAINING_RULES, {}),
        ("`data.datasets.DATA_RULES` (`load_dataset`)", DATA_RULES, {}),
        ("`ntk.convergence.CHECKER_RULES` (`NTKConvergenceChecker`)", CHECKER_RULES, {}),
        ("`validation.run.VALIDATE_RULES` (`validate`)", VALIDATE_RULES, {}),
        ("`audit.params.PARAMETER_RULES` (`MalleabilityEstimator`)", PARAMETER_RULES, {}),
        ("`paper.reproduce.REPRODUCTION_RULES` (`ReproductionConfig`)", REPRODUCTION_RULES, {}),
    ]


def _cli_rows(named: dict[int, str]) -> list[str]:
    """The command line's own rules: one row per option and rule, with the subcommands that check it."""
    from art_malleability.cli.checks import _SHARED_RULES, OPTION_RULES

    rows: dict[tuple[str, int], list] = {}
    for option, rules in _SHARED_RULES.items():
        rows.setdefault((option, id(rules)), [rules, ["every subcommand that has it"]])
    for command, table in OPTION_RULES.items():
        for option, rules in table.items():
            rules = rules[0] if len(rules) == 1 else rules
            rows.setdefault((option, id(rules)), [rules, []])[1].append(command)
    return [f"| `{option}` | {', '.join(commands)} | {_home(rules, named)} | {_words(rules)} |"
            for (option, _), (rules, commands) in sorted(rows.items(), key=lambda item: item[0][0])]


def render_rules() -> str:
    """:return: The generated part of docs/parameters.md: every rule, every table's entries and where each lives."""
    from art_malleability.cli.options import (
        AUDIT_OPTIONS,
        DATA_OPTIONS,
        NTK_CHECK_OPTIONS,
        REPRODUCE_OPTIONS,
        VALIDATE_OPTIONS,
    )

    named = _named_rules()
    lines = ["## Named rules", "", "| Rule | The value must |", "| --- | --- |"]
    lines += [f"| `{home}` | {_words(rules)} |" for home, rules in named.values()]
    for title, table, base in _tables():
        own = {name: rules for name, rules in table.items() if base.get(name) is not rules}
        lines += ["", f"## {title}", ""]
        if len(own) < len(table):
            lines += ["Its base's entries, and:", ""]
        lines += ["| Parameter | Rule | The value must |", "| --- | --- | --- |"]
        lines += [f"| `{name}` | {_home(rules, named)} | {_words(rules)} |" for name, rules in own.items()]
    lines += ["", "## The command line's options", "", "| Option | Subcommands | Rule | The value must |",
              "| --- | --- | --- | --- |", *_cli_rows(named)]
    lines += ["", "## Which option sets which parameter", "", "| Option | Parameter | Of |", "| --- | --- | --- |"]
    for of, table in (("`MalleabilityEstimator`", AUDIT_OPTIONS), ("`validate`", VALIDATE_OPTIONS),
                      ("`NTKConvergenceChecker`", NTK_CHECK_OPTIONS), ("`ReproductionConfig`", REPRODUCE_OPTIONS),
                      ("`load_dataset`", DATA_OPTIONS)):
        lines += [f"| `{option}` | `{param}` | {of} |" for param, option in table.items()]
    return "\n".join(lines)


def test_the_parameters_page_lists_every_rule_where_it_lives():
    text = PAGE.read_text()
    assert text.count(BEGIN) == 1 and text.count(END) == 1, "docs/parameters.md lost its markers"
    generated = text.split(BEGIN, 1)[1].split(END, 1)[0].strip()
    expected = render_rules()
    assert generated == expected, f"docs/parameters.md is out of date; its generated part must read:\n{expected}"


def _declared_twice(everything: list) -> dict[tuple[str, bool], int]:
    """
    :return: The words (and whether of a type check) that rules with different tests share: a rule written twice, its
        words copied beside a second test. A type check and a range check may share words (one rule in two steps).
    """
    from art_malleability._utils.params import Rule

    def flatten(rules):
        if isinstance(rules, tuple):
            for rule in rules:
                yield from flatten(rule)
        elif hasattr(rules, "optional_of"):
            yield from flatten(rules.optional_of)
        elif isinstance(rules, Rule):
            yield rules

    tests: dict[tuple[str, bool], set] = {}
    for rule in (r for rules in everything for r in flatten(rules)):
        tests.setdefault((rule.must, rule.type_error), set()).add(rule.test)
    return {words: len(found) for words, found in tests.items() if len(found) > 1}


#: Rules still declared twice: none (``method``'s rule lives once, beside ``NTK_METHODS``: ``ntk.empirical.METHOD``).
KNOWN_TWICE: dict = {}


def test_no_rule_is_declared_twice():
    from art_malleability._utils.params import POSITIVE_INT, SIZE, Rule
    from art_malleability.cli.checks import _SHARED_RULES, OPTION_RULES

    everything = [r for _, table, _ in _tables() for r in table.values()]
    everything += [*_SHARED_RULES.values(), *(r for table in OPTION_RULES.values() for r in table.values())]
    everything += [rules for _, rules in _named_rules().values()]
    assert len(everything) > 100
    assert _declared_twice(everything) == KNOWN_TWICE
    # a second declaration of a rule's words is caught, however deep it sits
    copied = Rule("be a positive integer", lambda v: v >= 1)
    assert _declared_twice([POSITIVE_INT, SIZE, {"n": (copied,)}["n"]]) == {("be a positive integer", False): 2}


# ------------------------------------------------------------------------------ 7. the rules of the studies and helpers


def test_method_is_one_rule_beside_the_kernel_methods():
    from art_malleability.ntk.empirical import METHOD, JacobianGram

    assert GradientInfluence._parameter_rules["method"] is METHOD and NTK_RULES["method"] is METHOD
    model = build_reference_model("2l-relu", (1, 4, 4), 3, width=8, seed=0)
    for make in (lambda: JacobianGram(model, method="svd"), lambda: GradientInfluence(method="svd"),
                 lambda: NTKInfluence(method="svd")):
        with pytest.raises(InvalidParameterError) as refused:
            make()
        assert refused.value.param == "method"
        assert str(refused.value) == f"method must be one of {NTK_METHODS}, got 'svd'"  # the words of before


def test_the_attention_context_is_one_rule_for_the_model_and_the_studies():
    from art_malleability.models import LinearizedAttention
    from art_malleability.models.reference import CONTEXT
    from art_malleability.ntk.convergence import CHECKER_RULES, NTKConvergenceChecker
    from art_malleability.paper.reproduce import REPRODUCTION_RULES, ReproductionConfig

    assert CHECKER_RULES["attention_context"] is CONTEXT
    assert REPRODUCTION_RULES["attention_context"] is CONTEXT
    for make, param in ((lambda: LinearizedAttention(context="trace"), "context"),
                        (lambda: NTKConvergenceChecker(attention_context="trace"), "attention_context"),
                        (lambda: ReproductionConfig(attention_context="trace"), "attention_context")):
        with pytest.raises(InvalidParameterError) as refused:
            make()
        assert refused.value.param == param
        assert str(refused.value) == f"{param} must be one of ('centred', 'gram'), got 'trace'"  # as before


def test_an_attack_name_is_one_rule_for_make_attack_and_the_audit(clf):
    from art_malleability.audit.attacks import ATTACK, make_attack
    from art_malleability.audit.params import _check_attacks

    with pytest.raises(InvalidParameterError) as refused:
        make_attack("cw", clf)
    # make_attack names its own parameter now (it was "attacks must name one of ... or be ART EvasionAttack
    # instances"): the rule's words, the audit's
    assert refused.value.param == "name"
    assert str(refused.value) == "name must name one of ('fgsm', 'pgd', 'mim'), got 'cw'"
    with pytest.raises(InvalidParameterError) as audit:
        _check_attacks(["fgsm", "cw"], "attacks")
    assert str(audit.value) == "attacks must name one of ('fgsm', 'pgd', 'mim'), got 'cw'"  # as before
    assert audit.value.must == refused.value.must == ATTACK.must


#: Each library refusal of the rules declared here: the call, the parameter and the message. The words of
#: ``train_model``'s ``epochs``, ``batch_size``, ``lr`` and ``weight_decay``, ``loss_profile``'s ``seed``, the
#: checker's ``widths``, ``seeds``, ``ridge``, ``gd_lr_scale`` and ``models`` are the shared rules' now (they were
#: "must be an int >= 1", "must be > 0", "must be >= 0", "must be an int >= 0", "must hold at least two distinct
#: positive integers", "must hold at least two distinct integers (for intervals)", "must lie in (0, 2) for stable
#: linearised dynamics", "must name reference models ... or map names to factories"), those the command line used.
LIBRARY_REFUSALS = [
    ("train_model", {"epochs": 0}, "epochs", "epochs must be a positive integer, got 0"),
    ("train_model", {"batch_size": 2.0}, "batch_size", "batch_size must be a positive integer, got 2.0"),
    ("train_model", {"lr": 0.0}, "lr", "lr must be a positive finite number, got 0.0"),
    ("train_model", {"weight_decay": -1.0}, "weight_decay",
     "weight_decay must be a non-negative finite number, got -1.0"),
    ("init_from_env", {"timeout_s": 0}, "timeout_s", "timeout_s must be a positive number of seconds, got 0"),
    ("init_from_env", {"timeout_s": float("inf")}, "timeout_s",
     "timeout_s must be a positive number of seconds, got inf"),
    ("loss_profile", {"seed": -1}, "seed", "seed must be a non-negative integer (numpy's seeds are), got -1"),
    ("loss_profile", {"seed": 1.5}, "seed", "seed must be a non-negative integer, got 1.5"),
    ("checker", {"widths": [16]}, "widths",
     "widths must hold at least two distinct widths (the width exponent is fitted over them), got [16]"),
    ("checker", {"widths": [16, 64, 16]}, "widths",
     "widths must hold distinct values (each one once), got [16, 64, 16]"),
    ("checker", {"widths": [0, 16]}, "widths", "widths must hold positive integers, got [0, 16]"),
    ("checker", {"seeds": [0, 0]}, "seeds",
     "seeds must hold at least two distinct seeds (the intervals are over them), got [0, 0]"),
    ("checker", {"ridge": 0.0}, "ridge", "ridge must be a positive finite number, got 0.0"),
    ("checker", {"gd_lr_scale": 2.5}, "gd_lr_scale",
     "gd_lr_scale must lie in (0, 2), where the linearised gradient descent is stable, got 2.5"),
    ("checker", {"gd_steps": 0}, "gd_steps", "gd_steps must be a positive integer, got 0"),
    ("checker", {"protocols": ["gd", "sgd"]}, "protocols", "protocols must be drawn from ('gd', 'adam'), got 'sgd'"),
    ("checker", {"models": ["2l-relu", "mlp-attn-qkv"]}, "models",
     "models must name models of ('2l-relu', 'mlp-attn') (MLP-Attn-QKV's trained attention has no infinite-width "
     "kernel here), got 'mlp-attn-qkv'"),
    ("checker", {"dtype": torch.float16}, "dtype", "dtype must be torch.float32 or torch.float64, got torch.float16"),
    ("checker", {"confidence": 1.0}, "confidence", "confidence must lie in (0, 1), got 1.0"),
    ("config", {"models": ("2l-relu", "foo")}, "models",
     "models must name reference models ('2l-relu', 'mlp-attn', 'mlp-attn-qkv'), got 'foo'"),
    ("config", {"models": ()}, "models",
     "models must name at least one of the reference models ('2l-relu', 'mlp-attn', 'mlp-attn-qkv'), got none"),
    ("config", {"models": ("mlp-attn", "mlp-attn")}, "models",
     "models must hold distinct values (each one once), got ('mlp-attn', 'mlp-attn')"),
    ("config", {"seeds": ()}, "seeds", "seeds must hold at least one seed, got ()"),
    ("config", {"tables": ("table9",)}, "tables",
     "tables must be drawn from ('table1', 'table2', 'table3', 'table4', 'ablation', 'landscape', 'spectral', "
     "'open_choices'), got 'table9'"),
    ("config", {"lds_models": 1}, "lds_models",
     "lds_models must be 0 (no LDS) or at least 2 (the LDS correlates over the retrained models), got 1"),
    ("config", {"widths": (16, 16)}, "widths", "widths must hold distinct values (each one once), got (16, 16)"),
    ("config", {"lr": -1.0}, "lr", "lr must be a positive finite number, got -1.0"),
    ("config", {"n_queries": 1}, "n_queries", "n_queries must be at least 2, got 1; every interval resamples the "
                                              "queries and needs two or more"),
]


def _call(target: str, kwargs: dict) -> None:
    import numpy as np

    from art_malleability.distributed import init_from_env
    from art_malleability.models import loss_profile, train_model
    from art_malleability.ntk.convergence import NTKConvergenceChecker
    from art_malleability.paper.reproduce import ReproductionConfig

    model = build_reference_model("2l-relu", (1, 4, 4), 3, width=8, seed=0)
    x, y = np.zeros((6, 1, 4, 4), np.float32), np.arange(6) % 3
    calls = {
        "train_model": lambda: train_model(model, x, y, verbose=False, **kwargs),
        "init_from_env": lambda: init_from_env(**kwargs),
        "loss_profile": lambda: loss_profile(model, x, y, verbose=False, **kwargs),
        "checker": lambda: NTKConvergenceChecker(verbose=False, **kwargs),
        "config": lambda: ReproductionConfig(**kwargs),
    }
    calls[target]()


@pytest.mark.parametrize(("target", "kwargs", "param", "message"), LIBRARY_REFUSALS,
                         ids=[f"{t}-{p}" for t, _, p, _ in LIBRARY_REFUSALS])
def test_each_rule_of_the_studies_and_helpers_refuses_naming_the_parameter(target, kwargs, param, message):
    with pytest.raises(InvalidParameterError) as refused:
        _call(target, kwargs)
    assert refused.value.param == param and str(refused.value) == message


def test_the_studies_tables_cover_their_settings_and_the_cli_maps_existing_options():
    import dataclasses
    import inspect

    from art_malleability.cli import build_parser
    from art_malleability.cli.options import NTK_CHECK_OPTIONS, REPRODUCE_OPTIONS
    from art_malleability.ntk.convergence import CHECKER_RULES, NTKConvergenceChecker
    from art_malleability.paper.reproduce import REPRODUCTION_RULES, ReproductionConfig

    checker = set(inspect.signature(NTKConvergenceChecker).parameters)
    assert set(CHECKER_RULES) == checker - {"analytic", "verbose"}
    config = {f.name for f in dataclasses.fields(ReproductionConfig)}
    assert set(REPRODUCTION_RULES) == config - {"dataset", "data_root", "eps_grid", "verbose"}
    assert set(NTK_CHECK_OPTIONS) <= set(CHECKER_RULES) and set(REPRODUCE_OPTIONS) <= set(REPRODUCTION_RULES)
    commands = build_parser()._subparsers._group_actions[0].choices
    for command, options in (("ntk-check", NTK_CHECK_OPTIONS), ("reproduce", REPRODUCE_OPTIONS)):
        known = {s for action in commands[command]._actions for s in action.option_strings}
        assert set(options.values()) <= known, command
    NTKConvergenceChecker(verbose=False)  # the defaults pass
    ReproductionConfig()


#: A bad value of each ``ntk-check`` and ``reproduce`` option that sets a setting of the library, and the line that
#: refuses it: the option named (not the setting), the value as typed.
CLI_STUDY_REFUSALS = [
    ("ntk-check", "--gd-lr-scale", ["2"], "--gd-lr-scale must lie in (0, 2), where the linearised gradient descent is "
                                          "stable, got 2"),
    ("ntk-check", "--widths", ["16", "64", "16"], "--widths must hold distinct values (each one once), got 16 64 16"),
    ("ntk-check", "--widths", ["16"], "--widths must hold at least two distinct widths (the width exponent is fitted "
                                      "over them), got 16"),
    ("ntk-check", "--seeds", ["1", "2", "1"], "--seeds must hold distinct values (each one once), got 1 2 1"),
    ("ntk-check", "--models", ["mlp-attn-qkv"],
     "--models must name models of ('2l-relu', 'mlp-attn') (MLP-Attn-QKV's trained attention has no infinite-width "
     "kernel here), got mlp-attn-qkv"),
    ("ntk-check", "--ridge", ["0"], "--ridge must be a positive finite number, got 0"),
    ("ntk-check", "--gd-steps", ["0"], "--gd-steps must be a positive integer, got 0"),
    ("ntk-check", "--adam-epochs", ["0"], "--adam-epochs must be a positive integer, got 0"),
    ("reproduce", "--models", ["2l-relu", "foo"],
     "--models must name reference models ('2l-relu', 'mlp-attn', 'mlp-attn-qkv'), got 2l-relu foo"),
    ("reproduce", "--lds-models", ["1"], "--lds-models must be 0 (no LDS) or at least 2 (the LDS correlates over the "
                                         "retrained models), got 1"),
    ("reproduce", "--widths", ["16", "0"], "--widths must hold positive integers, got 16 0"),
    ("reproduce", "--seeds", ["1", "1"], "--seeds must hold distinct values (each one once), got 1 1"),
    ("reproduce", "--width", ["0"], "--width must be a positive integer, got 0"),
    ("reproduce", "--epochs", ["0"], "--epochs must be a positive integer, got 0"),
    ("reproduce", "--lr", ["0"], "--lr must be a positive finite number, got 0"),
    ("reproduce", "--weight-decay", ["-1"], "--weight-decay must be a non-negative finite number, got -1"),
    ("reproduce", "--adv-epochs", ["0"], "--adv-epochs must be a positive integer, got 0"),
    ("reproduce", "--ntk-n-train", ["0"], "--ntk-n-train must be a positive integer, got 0"),
    ("reproduce", "--ntk-adam-epochs", ["0"], "--ntk-adam-epochs must be a positive integer, got 0"),
]


@pytest.mark.parametrize(("command", "option", "values", "message"), CLI_STUDY_REFUSALS,
                         ids=[f"{c}{o}-{'_'.join(v)}" for c, o, v, _ in CLI_STUDY_REFUSALS])
def test_each_study_option_is_refused_through_the_librarys_rule_naming_the_option(tmp_path, capsys, monkeypatch,
                                                                                 command, option, values, message):
    import art_malleability.cli.studies as studies
    from art_malleability.cli.options import NTK_CHECK_OPTIONS, REPRODUCE_OPTIONS
    from art_malleability.ntk.convergence import CHECKER_RULES
    from art_malleability.paper.reproduce import REPRODUCTION_RULES

    def never(*args, **kwargs):
        raise AssertionError("the data was read before the options were checked")

    monkeypatch.setattr(studies, "load_data", never)
    args = ["--tables", "table2"] if command == "reproduce" else []  # Table 1's own clash aside
    assert main([command, *args, "--output", str(tmp_path / "out"), option, *values]) == 2
    err = capsys.readouterr().err
    assert err == f"art-malleability {command}: error: {message}\n", err
    options, table = (NTK_CHECK_OPTIONS, CHECKER_RULES) if command == "ntk-check" else (REPRODUCE_OPTIONS,
                                                                                          REPRODUCTION_RULES)
    param = next(p for p, o in options.items() if o == option)
    with pytest.raises(InvalidParameterError) as library:  # the library's rule says the same, naming the setting
        check_values({param: table[param]}, {param: _parsed(values, option in ("--models", "--widths", "--seeds"))})
    assert library.value.param == param and library.value.must in message
    assert not (tmp_path / "out").exists()


def _parsed(values: list[str], several: bool):
    """The option's values as argparse gives them (a number, or a list for the options that take ``several``)."""
    numbers = []
    for v in values:
        try:
            numbers.append(int(v))
        except ValueError:
            try:
                numbers.append(float(v))
            except ValueError:
                numbers.append(v)
    return numbers if several else numbers[0]
