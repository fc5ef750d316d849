"""
The ``work`` subcommand: list, or remove, the finished stages an audit kept in its work folder
(:class:`~art_malleability._utils.work_folder.WorkFolder`).
"""

from __future__ import annotations

import argparse
import datetime

from art_malleability._utils.report_base import text_table
from art_malleability._utils.work_folder import WorkFolder
from art_malleability.cli import options
from art_malleability.cli.checks import UsageError
from art_malleability.cli.options import say

#: The stages an audit keeps.
STAGES = ("weights", "attack", "pass", "examples")

_DESCRIPTION = (
    "List the finished stages an audit kept in its work folder (by kind: how many, their size, when the last was "
    "written), or remove them with --remove. FOLDER is a work folder (an audit's --work-dir; by default "
    "<output>.work/<model>) or a folder of them (<output>.work). Only stages whose files still have the digest the "
    "package recorded are removed; the folder itself goes when nothing else is left in it."
)


def add_work(sub: argparse._SubParsersAction, run: options.Runner) -> None:
    """The ``work`` subcommand and its options, run by ``run`` (:func:`run_work`)."""
    work = options.add_command(sub, "work", run, "list or remove the finished stages of an audit's work folder",
                               _DESCRIPTION)
    work.add_argument("folder", help="a work folder, or a folder of them (one per model)")
    group = work.add_argument_group("work folder")
    group.add_argument("--remove", action="store_true", help="remove the stages (all, or those of --stage)")
    group.add_argument("--stage", nargs="+", choices=STAGES, default=None,
                       help="only these kinds of stage (default: all)")


def run_work(args: argparse.Namespace) -> int:
    """List (or remove) the stages of each work folder at ``args.folder``; exit status 0."""
    try:
        folders = WorkFolder.find(args.folder)
    except (ValueError, OSError) as err:
        raise UsageError(str(err).replace("folder must", "FOLDER must", 1)) from err
    kinds = STAGES if args.stage is None else tuple(args.stage)
    rows, removed, left = [], 0, 0
    for folder in folders:
        stages = [r for r in folder.stages() if r["stage"] in kinds]
        for kind in kinds:
            mine = [r for r in stages if r["stage"] == kind]
            if mine:
                last = datetime.datetime.fromtimestamp(max(r["written"] for r in mine)).isoformat(timespec="seconds")
                rows.append([str(folder.path), kind, str(len(mine)), f"{sum(r['bytes'] for r in mine) / 1e6:.3f}",
                             last])
        if args.remove:
            gone, kept = folder.remove(kinds)
            removed, left = removed + len(gone), left + len(kept)
    total = sum(float(r[3]) for r in rows)
    if rows:
        say(args, *text_table(["work folder", "stage", "count", "MB", "last written"], rows))
    say(args, f"{sum(int(r[2]) for r in rows)} stage(s), {total:.3f} MB in {len(folders)} work folder(s)")
    if args.remove:
        say(args, f"removed {removed} stage(s)" + (f"; {left} left: their files are not as the package wrote them"
                                                   if left else ""))
    return 0
