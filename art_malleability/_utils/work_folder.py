"""
A work folder of finished stages: what a long audit has finished, kept on disk so that a rerun of the same work after
an interruption (SIGTERM, SIGINT, ``kill -9``, an exception) redoes only what was not finished.

Each stage is a set of named arrays (``<stage>-<key>.npz``) beside its record (``<stage>-<key>.json``): the stage's
name, the digest of its *key* (everything its result depends on: the model's weights and architecture, its input
rows, every parameter, the package's version, the dtype) and the SHA-256 digest of the array file. A stage is used
only when its record names the key asked for and the array file still has the recorded digest; anything else (a key
that differs, a truncated or altered file, a record or array file this package did not write) is not trusted: the
stage is computed again, said once per stage and reason (in the log and in :attr:`WorkFolder.distrusted`, which the
audit's report lists among its warnings), and written anew. Both files are written atomically (a new
file beside the old one, flushed, then one rename; the array file first), so that a stage whose writing was
interrupted is never read. There is no index shared between writers: the processes of a sharded run write their own
stages into one folder.

The folder holds only what the package wrote: it is created with a marker file (``.art-malleability-work``); an
existing folder without the marker is used only while it is empty, and nothing else in it is read, changed or removed.
Arrays are loaded with ``allow_pickle=False``: a stage holds numbers, never code.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from art_malleability._utils.output_folder import _write_json, atomic_write, file_digest
from art_malleability._utils.provenance import weights_digest

logger = logging.getLogger(__name__)

#: The marker file of a work folder this package created.
MARKER_NAME = ".art-malleability-work"
_FORMAT = "art-malleability work folder"
_RECORD_FORMAT = "art-malleability stage"
_STAGE_NAME = re.compile(r"^[a-z0-9][a-z0-9_.=-]{0,80}$")


def value_digest(value: Any) -> str:
    """
    The SHA-256 digest of a key's value: arrays and tensors by dtype, shape and bytes; mappings, sequences and
    scalars through their canonical JSON.

    :param value: Numbers, strings, ``None``, arrays, tensors, and dicts, lists and tuples of them.
    :return: Hex digest.
    """
    digest = hashlib.sha256()
    _update(digest, value)
    return digest.hexdigest()


def _update(digest: Any, value: Any) -> None:
    import torch

    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().contiguous().numpy()
    if isinstance(value, np.ndarray):
        array = np.ascontiguousarray(value)
        digest.update(f"array {array.dtype.str} {array.shape}|".encode())
        digest.update(memoryview(array).cast("B"))
    elif isinstance(value, dict):
        digest.update(b"dict|")
        for name in sorted(value, key=str):
            digest.update(json.dumps(str(name)).encode() + b":")
            _update(digest, value[name])
    elif isinstance(value, (list, tuple)):
        digest.update(f"list {len(value)}|".encode())
        for item in value:
            _update(digest, item)
    elif isinstance(value, (np.integer, np.floating, np.bool_)):
        _update(digest, value.item())
    elif value is None or isinstance(value, (bool, int, float, str)):
        digest.update(json.dumps(value).encode() + b"|")
    else:
        raise TypeError(f"value must be numbers, strings, arrays or containers of them, got {type(value).__name__}")


def module_digest(model: Any) -> str:
    """
    :param model: A ``torch.nn.Module``.
    :return: The digest of its architecture (its printed form) and its weights
        (:func:`~art_malleability._utils.provenance.weights_digest`: every parameter and buffer by name).
    """
    return value_digest({"architecture": repr(model), "weights": weights_digest(model)})


class WorkFolder:
    """
    A folder of finished stages (see the module's docstring).

    :param path: The folder; created (with its parents) where missing.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        #: What was not trusted, once per stage and reason (the report's warnings).
        self.distrusted: list[str] = []
        marker = self.path / MARKER_NAME
        if self.path.exists() and not self.path.is_dir():
            raise ValueError(f"work_dir must be a folder, got the file {str(self.path)!r}")
        if marker.exists():
            try:
                ok = json.loads(marker.read_text(encoding="utf-8")).get("format") == _FORMAT
            except (OSError, ValueError, AttributeError):
                ok = False
            if not ok:
                raise ValueError(f"work_dir must be a work folder this package created, got {str(self.path)!r} whose "
                                 f"{MARKER_NAME} it did not write; choose another folder")
        elif self.path.exists() and any(not p.name.startswith(MARKER_NAME) for p in self.path.iterdir()):
            # (the marker's own temporary file is another process of the run creating the folder at the same time)
            raise ValueError(f"work_dir must be a new or empty folder or one this package created, got "
                             f"{str(self.path)!r}, which holds other files; choose another folder")
        else:
            self.path.mkdir(parents=True, exist_ok=True)
            _write_json(marker, {"format": _FORMAT})

    def _files(self, stage: str, key: dict) -> tuple[Path, Path, str]:
        if not _STAGE_NAME.match(stage):
            raise ValueError(f"stage must be a short lower-case name of letters, digits and _.=-, got {stage!r}")
        key_digest = value_digest(key)
        base = f"{stage}-{key_digest[:20]}"
        return self.path / f"{base}.npz", self.path / f"{base}.json", key_digest

    def load(self, stage: str, key: dict) -> dict[str, np.ndarray] | None:
        """
        :param stage: The stage's name.
        :param key: Everything its result depends on (see :func:`value_digest` for the values allowed).
        :return: Its arrays, or ``None`` where the stage was not finished with this key or its files are not the
            ones recorded (said once per stage and reason).
        """
        arrays_path, record_path, key_digest = self._files(stage, key)
        if not record_path.exists():
            return None
        try:
            record = json.loads(record_path.read_text(encoding="utf-8"))
            if record.get("format") != _RECORD_FORMAT or record.get("stage") != stage:
                return self._distrust(stage, "its record was not written by this package")
            if record.get("key") != key_digest:
                return self._distrust(stage, "it was computed for other inputs or parameters")
            if not arrays_path.exists() or file_digest(arrays_path) != record.get("sha256"):
                return self._distrust(stage, "its array file is missing, truncated or altered")
            with np.load(arrays_path, allow_pickle=False) as data:
                return {name: data[name] for name in data.files}
        except (OSError, ValueError, KeyError, AttributeError, EOFError) as err:
            return self._distrust(stage, f"it cannot be read ({type(err).__name__})")

    def has(self, stage: str, key: dict) -> bool:
        """
        :return: Whether a finished stage of this key is recorded (its array file is checked only when it is
            loaded: :meth:`load`).
        """
        _, record_path, key_digest = self._files(stage, key)
        try:
            record = json.loads(record_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return False
        return isinstance(record, dict) and record.get("format") == _RECORD_FORMAT and record.get("key") == key_digest

    def _distrust(self, stage: str, why: str) -> None:
        message = f"work folder {self.path}: a kept {stage!r} stage was not used and was computed again: {why}"
        if message not in self.distrusted:
            self.distrusted.append(message)
            logger.warning("%s", message)
        return None

    def save(self, stage: str, key: dict, arrays: dict[str, np.ndarray]) -> None:
        """
        Keep a finished stage: its arrays, then its record, each written atomically.

        :param stage: The stage's name.
        :param key: Everything its result depends on.
        :param arrays: Its result, by name (numeric arrays).
        """
        arrays_path, record_path, key_digest = self._files(stage, key)
        atomic_write(arrays_path, lambda handle: np.savez(handle, **{n: np.asarray(a) for n, a in arrays.items()}),
                     binary=True)
        _write_json(record_path, {"format": _RECORD_FORMAT, "stage": stage, "key": key_digest,
                                  "sha256": file_digest(arrays_path), "bytes": arrays_path.stat().st_size,
                                  "written": time.time()})

    def stages(self) -> list[dict]:
        """:return: The finished stages' records, oldest first: name, key digest, bytes, the time written and the
            array file's name."""
        out = []
        for record_path in self.path.glob("*.json"):
            with contextlib.suppress(OSError, ValueError, AttributeError, KeyError):
                record = json.loads(record_path.read_text(encoding="utf-8"))
                if record.get("format") == _RECORD_FORMAT:
                    out.append({"stage": record["stage"], "key": record["key"], "bytes": int(record["bytes"]),
                                "written": float(record.get("written", record_path.stat().st_mtime)),
                                "file": record_path.with_suffix(".npz").name, "sha256": record["sha256"]})
        return sorted(out, key=lambda r: (r["written"], r["file"]))

    def prune(self, max_bytes: float) -> list[str]:
        """
        Remove the oldest stages until the stages' array files take at most ``max_bytes``. A stage is removed only
        where its array file still has the digest its record gives (what the package cannot prove it wrote is
        left, and counted).

        :return: The array files removed.
        """
        stages = self.stages()
        total = sum(r["bytes"] for r in stages)
        removed = []
        for record in stages:
            if total <= max_bytes:
                break
            if self._remove(record):
                removed.append(record["file"])
                total -= record["bytes"]
        if removed:
            logger.info("work folder %s: %d oldest stage(s) removed to stay within %.3g GB", self.path, len(removed),
                        max_bytes / 1e9)
        return removed

    def remove(self, stages: Iterable[str] | None = None) -> tuple[list[str], list[str]]:
        """
        Remove the finished stages (those named ``stages``, or all), each only where its array file still has the
        digest its record gives; then, when nothing but the marker is left, the marker and the folder.

        :param stages: Stage names (``"weights"``, ``"attack"``, ``"pass"``), or ``None`` for every stage.
        :return: The array files removed, and those left because the package cannot prove it wrote them as they are.
        """
        names = None if stages is None else set(stages)
        removed, left = [], []
        for record in self.stages():
            if names is None or record["stage"] in names:
                (removed if self._remove(record) else left).append(record["file"])
        entries = list(self.path.iterdir())
        if [p.name for p in entries] == [MARKER_NAME]:
            (self.path / MARKER_NAME).unlink()
            with contextlib.suppress(OSError):  # another process wrote into it meanwhile: it stays
                self.path.rmdir()
        return removed, left

    def _remove(self, record: dict) -> bool:
        """Remove one stage's array file and record where the array file still has its recorded digest."""
        arrays = self.path / record["file"]
        try:
            if arrays.exists() and file_digest(arrays) != record["sha256"]:
                return False
            arrays.unlink(missing_ok=True)
            arrays.with_suffix(".json").unlink()
        except OSError:
            return False
        return True

    @classmethod
    def find(cls, path: str | os.PathLike) -> list[WorkFolder]:
        """
        The work folders at ``path``: itself where it is one, else its subfolders that are (the command line keeps one
        per model). Nothing is created.

        :raises ValueError: Where there is none.
        """
        path = Path(path)
        if (path / MARKER_NAME).is_file():
            return [cls(path)]
        found = sorted(p for p in path.iterdir() if (p / MARKER_NAME).is_file()) if path.is_dir() else []
        if not found:
            raise ValueError(f"folder must be a work folder this package created (holding {MARKER_NAME}) or a folder "
                             f"of them, got {str(path)!r}")
        return [cls(p) for p in found]

    def cached(self, stage: str, key: dict, compute: Any, names: Iterable[str]) -> tuple[tuple, bool]:
        """
        The stage's arrays from the folder, or computed (``compute()`` returning them in the order of ``names``) and
        kept.

        :return: The arrays in the order of ``names``, and whether they were reused.
        """
        names = tuple(names)
        found = self.load(stage, key)
        if found is not None and set(found) == set(names):
            return tuple(found[n] for n in names), True
        values = compute()
        self.save(stage, key, dict(zip(names, values, strict=True)))
        return tuple(values), False


def kept_training(folder: str | os.PathLike, module: Any, settings: dict, train: Any) -> bool:
    """
    Train ``module`` in place (``train()``), or load the weights a work folder kept of the same training: the stage
    ``weights``, keyed by the versions, the untrained module (its architecture and initial weights) and ``settings``
    (the data, the training settings, the seed, the device: everything the trained weights depend on besides).

    :param folder: The work folder.
    :param module: The untrained ``torch.nn.Module``; trained, or given the kept weights, in place.
    :param settings: What else the training depends on (see :func:`value_digest` for the values allowed).
    :param train: Trains ``module`` in place.
    :return: Whether the kept weights were used.
    """
    import torch

    from art_malleability._utils.provenance import library_versions

    store = WorkFolder(folder)
    key = {"versions": library_versions(), "model": module_digest(module), **settings}
    kept = store.load("weights", key)
    if kept is not None:
        module.load_state_dict({name: torch.from_numpy(value) for name, value in kept.items()})
        return True
    train()
    store.save("weights", key, {name: value.detach().cpu().numpy() for name, value in module.state_dict().items()})
    return False
