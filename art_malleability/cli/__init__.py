"""
Command line: ``art-malleability audit``, ``validate``, ``ntk-check``, ``spectrum``, ``reproduce`` and ``work``.

``art-malleability audit`` with no arguments trains the two reference models (2L-ReLU and MLP-Attn)
on scikit-learn's bundled digits, audits both with FGSM, PGD and MIM, prints the tables and writes
one report folder per model plus a side-by-side ``summary.md``.

Each subcommand's options and run are in its own module of this package (``audit``, ``validate``, ``studies``),
the options they share in ``options`` and the checks before any work in ``checks``.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator, Sequence

from art_malleability._utils.output_folder import OutputFolder
from art_malleability.cli.audit import add_audit, run_audit
from art_malleability.cli.checks import UsageError, message_of, output_claims, preflight
from art_malleability.cli.options import add_output_options
from art_malleability.cli.studies import (
    add_ntk_check,
    add_reproduce,
    add_spectrum,
    run_ntk_check,
    run_reproduce,
    run_spectrum,
)
from art_malleability.cli.validate import add_validate, run_validate
from art_malleability.cli.work import add_work, run_work
from art_malleability.distributed import launched_by_torchrun, peer_failure

__all__ = [
    "UsageError", "build_parser", "console_main", "main", "run_audit", "run_ntk_check", "run_reproduce", "run_spectrum",
    "run_validate", "run_work",
]

logger = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    """:return: The argument parser of the ``art-malleability`` command."""
    from art_malleability import __version__

    parser = argparse.ArgumentParser(
        prog="art-malleability",
        description="Influence-malleability audits of PyTorch classifiers with ART attacks.",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    # the runners are this module's names, looked up when the parser is built
    add_audit(sub, run_audit)
    add_ntk_check(sub, run_ntk_check)
    add_spectrum(sub, run_spectrum)
    add_reproduce(sub, run_reproduce)
    add_validate(sub, run_validate)
    add_work(sub, run_work)
    for command in sub.choices.values():
        add_output_options(command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """
    Run one ``art-malleability`` command.

    :param argv: Arguments (default: ``sys.argv[1:]``).
    :return: Exit status: 0 on success, 2 for an option the command cannot use (as argparse; also an ``--output``
        folder that another run is writing to or that holds files of the report's names this package did not
        write), 1 for a failure while running (data, weights, training, another process), 130 when interrupted.
    """
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # the command line, as a report states it
    level = logging.ERROR if args.quiet else (logging.WARNING, logging.INFO, logging.DEBUG)[min(args.verbose, 2)]
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")  # a handler, if the process has none
    package = logging.getLogger("art_malleability")
    previous = package.level
    package.setLevel(level)  # the package's own messages only; restored when the command returns
    try:
        return _run(args)
    finally:
        package.setLevel(previous)


def console_main() -> None:
    """
    Entry point of the ``art-malleability`` console script (and of ``python -m art_malleability.cli``): run
    :func:`main` and exit with its status. An interrupt after the command has finished, while the interpreter shuts
    down, ends the process with status 130 and one line, instead of a traceback and status 0.
    """
    try:
        status = main()
    except KeyboardInterrupt:  # between the command's end and here
        status = _interrupted_while_exiting(None)
    signal.signal(signal.SIGINT, lambda signum, frame: _interrupted_while_exiting(status))
    sys.exit(status)


def _interrupted_while_exiting(status: int | None) -> int:
    """One line on stderr, then exit 130 at once (the interpreter's own shutdown is what was interrupted)."""
    done = "" if status is None else f" after the command had ended with status {status}"
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.write(f"art-malleability: interrupted while exiting{done}\n")
        sys.stderr.flush()
    os._exit(130)


def _run(args: argparse.Namespace) -> int:
    """Run the parsed command; errors become one line on stderr and an exit status."""
    # under torchrun, name the process in every error (the launcher shows each worker's output)
    where = f" (rank {os.environ['RANK']})" if launched_by_torchrun() else ""
    prefix = f"art-malleability {args.command}{where}: error:"
    try:
        preflight(args)
        with _output_folder(args) as args.out:
            return args.func(args)
    except KeyboardInterrupt:
        print(f"art-malleability {args.command}{where}: interrupted", file=sys.stderr)
        return 130
    except UsageError as err:
        _explain(prefix, err, args.verbose)
        return 2
    except Exception as err:  # noqa: BLE001 - one line for the user, the traceback with --verbose
        cause = peer_failure(err)
        if cause is not None:
            timeout = getattr(args, "dist_timeout", None)
            within = "" if timeout is None else f" within --dist-timeout ({timeout:g} s)"
            _explain(prefix, f"another process failed or stopped answering{within} ({type(err).__name__}: {cause})",
                     args.verbose, err)
        else:
            _explain(prefix, err, args.verbose)
        return 1


@contextlib.contextmanager
def _output_folder(args: argparse.Namespace) -> Iterator[OutputFolder | None]:
    """
    The ``--output`` folder of the command, open for the run (on the lead process of a ``torchrun`` launch; the
    others write nothing and get ``None``): locked, checked for files of the report's names that this package did
    not write, and committed only when the command succeeds. A folder that cannot be used is a :class:`UsageError`.
    """
    lead = not launched_by_torchrun() or os.environ.get("RANK") == "0"
    if getattr(args, "output", None) is None or not lead:
        yield None
        return
    out = OutputFolder(args.output, writer=args.command, description=f"art-malleability {args.command}",
                       option="--output")
    try:
        out.open()
        out.claim(output_claims(args))
    except (RuntimeError, OSError) as err:
        out.close(success=False)
        raise UsageError(message_of(err)) from err
    try:
        yield out
    except BaseException:
        out.close(success=False)
        raise
    out.close(success=True)


def _explain(prefix: str, err: BaseException | str, verbose: int, cause: BaseException | None = None) -> None:
    """One line on stderr; the traceback too with ``--verbose``."""
    import traceback

    if verbose and isinstance(cause or err, BaseException):
        traceback.print_exception(cause or err, file=sys.stderr)
    message = err if isinstance(err, str) else message_of(err)
    if isinstance(err, (TypeError, OSError)):
        message += f" ({type(err).__name__})"
    print(f"{prefix} {message}", file=sys.stderr)

