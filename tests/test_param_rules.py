"""Parameter rules declared once (issue 37): every estimator's ``get_params()`` rebuilds an equal estimator, and every
declared rule refuses a bad value through the library and the command line, naming the parameter or its option."""

import pickle

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
                                  strategy="all", ridge="gcv", n_queries=7, rank_by="signed", n_bootstrap=9,
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
    "controls": "yes", "memory_limit_gb": 0.0, "time_budget_s": float("inf"),
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
    assert set(AUDIT_OPTIONS) == set(PARAMETER_RULES) - {"confidence", "distributed"}


@pytest.mark.parametrize("option", sorted(BAD_OPTIONS))
def test_each_audit_option_is_refused_by_its_rule_naming_the_option(tmp_path, capsys, monkeypatch, option):
    import art_malleability.cli.audit as cli_audit

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
        if f"{option} ({param})" not in err:  # the options several subcommands share: checked by the same rule
            assert option in ("--eps", "--n-queries", "--seed", "--device", "--batch-size"), err
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
    ({"name_or_path": "digits", "n_train": 0}, "n_train", None, "n_train must be >= 1 (or None), got 0"),
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
