"""
Report folders that never touch what is not ours.

Every report the package writes goes through an :class:`OutputFolder`:

- **Lock.** Opening one takes ``.art-malleability.lock`` in the folder (an exclusive ``flock`` where the platform
  has it): a second run into the same folder is refused with :class:`OutputFolderBusy`, naming the run that holds
  it. The lock is the kernel's: it goes with the process whatever ends it. Its file is removed on any exit that
  runs Python code; one left by a run killed outright (SIGKILL, a power cut) is held by nobody and is taken over by
  the next run, which removes that run's staging folder.
- **Staging.** Files are written into a hidden staging folder inside the output folder; nothing visible changes
  while the run works. Only when the run has succeeded are the staged files renamed into place (one atomic rename
  each, while SIGINT and SIGTERM wait); a failed or interrupted run removes its staging folder and leaves the
  previous report exactly as it was.
- **Signals.** While a folder is open in the main thread, SIGTERM (where the process has no handler of its own)
  ends the process like SIGINT does, through the ``finally`` blocks: :class:`SystemExit` with status 143, after the
  staging folder and the lock are removed. Where the signal lands in code whose exceptions Python ignores (a weak
  reference's callback, a ``__del__``), the ignored exit is reported as usual and the signal delivered again.
- **Manifest.** ``.art-malleability-manifest.json`` lists every file a run wrote (path, SHA-256 digest, and the
  writer: a command or a report class) and the folders it created. A file is *ours* when a manifest in its folder
  or above lists it with the digest it still has. A commit replaces only files that are ours (another file of the
  same name is an :class:`OutputFolderConflict`, and the staged files are kept for the user), removes the files the
  same writer wrote before and does not write now only while they are ours (a changed file stays), and removes only
  the empty folders it created. Nothing else in the folder is read, changed or removed.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path, PurePosixPath
from types import TracebackType
from typing import Any

try:  # POSIX; elsewhere the lock is an exclusively created file with the holder's process id
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

logger = logging.getLogger(__name__)

MANIFEST_NAME = ".art-malleability-manifest.json"
LOCK_NAME = ".art-malleability.lock"
STAGING_PREFIX = ".art-malleability-staging-"
_FORMAT = "art-malleability output manifest"


class OutputFolderBusy(RuntimeError):
    """Another run holds the output folder's lock."""


class OutputFolderConflict(FileExistsError):
    """A file the run would replace or a folder it would write into was not written by this package."""


def file_digest(path: Path) -> str:
    """:return: The SHA-256 hex digest of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _relative(relpath: str | os.PathLike) -> str:
    """A staged file's path relative to the output folder, checked to stay inside it (``/`` separated)."""
    path = PurePosixPath(Path(relpath).as_posix())
    if path.is_absolute() or not path.parts or any(p in ("", ".", "..") for p in path.parts):
        raise ValueError(f"relpath must be a relative path inside the output folder, got {str(relpath)!r}")
    if path.parts[0] in (MANIFEST_NAME, LOCK_NAME) or path.parts[0].startswith(STAGING_PREFIX):
        raise ValueError(f"relpath must not be one of the folder's own files, got {str(relpath)!r}")
    return path.as_posix()


def read_manifest(folder: Path) -> dict:
    """
    :param folder: A folder.
    :return: Its manifest, empty when it has none: ``files`` (relpath to ``{"sha256", "writer"}``), ``folders``
        (the folders runs created) and ``incoming`` (the files of a commit under way, the same way).
    :raises OutputFolderConflict: When a file of the manifest's name is not a manifest this package wrote.
    """
    path = folder / MANIFEST_NAME
    if not path.exists():
        return {"files": {}, "folders": [], "incoming": {}}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("format") != _FORMAT:
            raise ValueError("not this package's manifest")
        files, incoming = ({str(k): {"sha256": str(v["sha256"]), "writer": str(v["writer"])} for k, v in part.items()}
                           for part in (data["files"], data.get("incoming", {})))
        return {"files": files, "folders": [str(f) for f in data["folders"]], "incoming": incoming}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise OutputFolderConflict(
            f"output folder {str(folder)!r} must hold a manifest this package can read, got a {MANIFEST_NAME} that it "
            f"cannot read ({type(err).__name__}: {err}); move that file away or choose another output folder"
        ) from err


def atomic_write(path: Path, write: Callable[[Any], None], binary: bool = False) -> None:
    """Write a file atomically: ``write(handle)`` into a new file beside it, flushed to disk, then one rename (a reader
    sees the old file or the whole new one, never a part)."""
    tmp = path.with_name(f"{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        with open(tmp, "wb") if binary else open(tmp, "w", encoding="utf-8") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _write_json(path: Path, data: dict) -> None:
    """Write JSON atomically (:func:`atomic_write`)."""
    atomic_write(path, lambda handle: json.dump(data, handle, indent=1, sort_keys=True))


def is_ours(path: Path) -> bool:
    """
    Whether a file was written by this package and is unchanged since: a manifest in its folder or in a folder
    above lists it with the SHA-256 digest it has now.

    :param path: A file.
    """
    if not path.is_file() or path.is_symlink():
        return False
    digest = None
    path = path.absolute()
    for folder in path.parents:
        manifest = folder / MANIFEST_NAME
        if manifest.is_file():
            try:
                entries = read_manifest(folder)
            except OutputFolderConflict:
                entries = {"files": {}, "incoming": {}}
            rel = path.relative_to(folder).as_posix()
            known = {entries[part].get(rel, {}).get("sha256") for part in ("files", "incoming")} - {None}
            if known:
                digest = digest or file_digest(path)
                if digest in known:
                    return True
    return False


def _terminated(signum: int, frame: object) -> None:
    """SIGTERM's handler while a folder is open: exit through the ``finally`` blocks, status 128 + 15."""
    logger.warning("terminated (signal %d): the run stops; its staged files are removed", signum)
    raise SystemExit(128 + signum)


def _redeliver_ignored_exit(previous: Callable[[object], None], unraisable: object) -> None:
    """
    ``sys.unraisablehook`` while SIGTERM is handled (after ``previous``, the hook it replaced): a :class:`SystemExit`
    from :func:`_terminated` raised where Python ignores exceptions (a weak reference's callback, a ``__del__``)
    would leave the run going; the signal is sent again to the main thread, to take effect at its next check.
    """
    previous(unraisable)
    error = getattr(unraisable, "exc_value", None)
    if (isinstance(error, SystemExit) and error.code == 128 + signal.SIGTERM
            and signal.getsignal(signal.SIGTERM) is _terminated):
        # from another thread, once this hook has returned: raised in the hook, the exit would be ignored again
        threading.Thread(target=_send_to_main, args=(signal.SIGTERM, 0.1), daemon=True).start()


def _send_to_main(signum: int, delay: float) -> None:
    time.sleep(delay)
    signal.pthread_kill(threading.main_thread().ident, signum)


@contextlib.contextmanager
def _signals_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM wait until the block is done (main thread only; elsewhere a no-op), then take effect."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    names = [s for s in ("SIGINT", "SIGTERM") if hasattr(signal, s)]
    previous = {}
    for name in names:
        number = getattr(signal, name)
        previous[number] = signal.signal(number, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        for number in dict.fromkeys(caught):
            signal.raise_signal(number)


class OutputFolder:
    """
    A report folder for one run: locked while the run works, written through a staging folder, committed only on
    success. Use it as a context manager::

        with OutputFolder("audit", writer="audit") as out:
            out.write("summary.md", text)        # staged; visible only after the block succeeds

    :param path: The output folder (created, with its parents, if missing).
    :param writer: Who writes (a command or a report class): a commit removes the files the same writer wrote
        before and does not write now; files of other writers stay.
    :param description: What the run is, recorded in the lock for a refused second run's message.
    :param option: How the caller names the folder in errors (``"--output"``, ``"directory"``).
    """

    def __init__(self, path: str | os.PathLike, writer: str, description: str = "", option: str = "directory") -> None:
        self.root = Path(path)
        self.writer = writer
        self.description = description or writer
        self.option = option
        self.staged: dict[str, str] = {}
        self.staging: Path | None = None
        self._lock_fd: int | None = None
        self._handles_sigterm = False
        self._hooks: tuple[Callable[[object], None], Callable[[object], None]] | None = None  # replaced, installed
        self._created_root = False
        self._manifest: dict = {"files": {}, "folders": [], "incoming": {}}

    # ------------------------------------------------------------------ open and close
    def __enter__(self) -> OutputFolder:
        self.open()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close(success=kind is None)

    def open(self) -> None:
        """Create the folder if missing, take its lock, read its manifest and create the staging folder."""
        root = self.root
        if root.exists() and not root.is_dir():
            raise NotADirectoryError(f"{self.option} must be a folder, got {str(root)!r}, which is an existing file")
        try:
            if not root.exists():
                missing = [p for p in (root, *root.parents) if not p.exists()]
                root.mkdir(parents=True)
                self._created_root = bool(missing)
            self._lock()
        except OutputFolderBusy:
            self._remove_created_root()
            raise
        except OSError as err:
            self._remove_created_root()
            raise PermissionError(
                f"{self.option} must be a folder this process can write, got {str(root)!r} "
                f"({type(err).__name__}: {err.strerror or err})"
            ) from err
        try:
            self._handle_sigterm()
            self._manifest = read_manifest(root)
            self.staging = root / f"{STAGING_PREFIX}{secrets.token_hex(6)}"
            self.staging.mkdir()
            self._record_lock(staging=self.staging.name)
        except BaseException:
            self.close(success=False)
            raise

    def close(self, success: bool) -> None:
        """
        Commit the staged files when ``success`` (see :meth:`commit`), else discard them; release the lock. A
        conflict at commit keeps the staged files (the error names their folder).
        """
        if self._lock_fd is None:
            return
        keep_staging = False
        try:
            if success:
                try:
                    self.commit()
                except OutputFolderConflict:
                    keep_staging = True
                    raise
        finally:
            try:
                with _signals_deferred():  # the clean-up, whole
                    if not keep_staging and self.staging is not None and self.staging.exists():
                        shutil.rmtree(self.staging)  # created by this run, under a name of its own
                    self.staging = None
                    self._release()
            finally:
                self._restore_sigterm()

    def _handle_sigterm(self) -> None:
        """SIGTERM exits through the ``finally`` blocks while the folder is open (main thread, default handler)."""
        main = threading.current_thread() is threading.main_thread()
        if main and hasattr(signal, "SIGTERM") and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            signal.signal(signal.SIGTERM, _terminated)
            if hasattr(signal, "pthread_kill"):
                hook = functools.partial(_redeliver_ignored_exit, sys.unraisablehook)
                self._hooks = (sys.unraisablehook, hook)
                sys.unraisablehook = hook
            self._handles_sigterm = True

    def _restore_sigterm(self) -> None:
        if self._handles_sigterm:
            self._handles_sigterm = False
            if signal.getsignal(signal.SIGTERM) is _terminated:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
            if self._hooks is not None and sys.unraisablehook is self._hooks[1]:
                sys.unraisablehook = self._hooks[0]
            self._hooks = None

    def _remove_created_root(self) -> None:
        if self._created_root:
            with contextlib.suppress(OSError):
                self.root.rmdir()  # only when empty
            self._created_root = False

    # ------------------------------------------------------------------ lock
    def _lock(self) -> None:
        path = self.root / LOCK_NAME
        while True:
            if fcntl is None:  # pragma: no cover - Windows
                self._lock_fd = self._lock_exclusive_file(path)
                return
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read_holder(fd)
                os.close(fd)
                raise OutputFolderBusy(self._busy_message(holder)) from None
            except OSError as err:  # a file system without locks: run, but say that nothing guards the folder
                logger.warning("%s: cannot lock the folder (%s); a concurrent run would not be detected", path, err)
            try:
                same = os.fstat(fd).st_ino == os.stat(path).st_ino
            except FileNotFoundError:
                same = False
            if not same:  # the holder removed the file as we opened it: lock the new one
                os.close(fd)
                continue
            stale = _read_holder(fd)
            self._lock_fd = fd
            if stale:
                self._take_over(stale)
            return

    def _lock_exclusive_file(self, path: Path) -> int:  # pragma: no cover - Windows
        for _ in range(2):
            try:
                return os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
            except FileExistsError:
                fd = os.open(path, os.O_RDONLY)
                holder = _read_holder(fd)
                os.close(fd)
                if holder.get("host") == socket.gethostname() and not _alive(holder.get("pid")):
                    self._take_over(holder)
                    path.unlink()
                    continue
                raise OutputFolderBusy(self._busy_message(holder)) from None
        raise OutputFolderBusy(self._busy_message({}))

    def _take_over(self, stale: dict) -> None:
        """A lock left by a run that ended without releasing it: remove the staging folder it names."""
        name = str(stale.get("staging", ""))
        logger.warning(
            "%s: took over the stale lock of an earlier run (pid %s, %s) that ended without releasing it",
            self.root, stale.get("pid"), stale.get("description"),
        )
        if name.startswith(STAGING_PREFIX) and "/" not in name and (self.root / name).is_dir():
            shutil.rmtree(self.root / name)

    def _record_lock(self, **extra: str) -> None:
        holder = {
            "pid": os.getpid(), "host": socket.gethostname(), "description": self.description,
            "started": time.strftime("%Y-%m-%d %H:%M:%S"), **extra,
        }
        data = json.dumps(holder).encode()
        os.lseek(self._lock_fd, 0, os.SEEK_SET)
        os.ftruncate(self._lock_fd, 0)
        os.write(self._lock_fd, data)

    def _busy_message(self, holder: dict) -> str:
        who = (f"{holder.get('description', 'a run')} (process {holder.get('pid')} on {holder.get('host')}, "
               f"started {holder.get('started')})") if holder else "another run"
        return (f"{self.option} must not be a folder another run is writing to, got {str(self.root)!r}, which "
                f"{who} is writing to; wait for it to finish or choose another folder")

    def _release(self) -> None:
        if self._lock_fd is None:
            return
        with contextlib.suppress(FileNotFoundError):
            (self.root / LOCK_NAME).unlink()  # before the unlock: a waiter then sees a new file
        os.close(self._lock_fd)
        self._lock_fd = None
        if self._created_root:
            with contextlib.suppress(OSError):
                self.root.rmdir()  # a folder this run created and left empty

    # ------------------------------------------------------------------ staging
    def claim(self, relpaths: Iterable[str]) -> None:
        """
        Check before any work that the run may write these paths: each is missing or ours (a file this package
        wrote and nobody changed since, or a folder a run of this package created).

        :raises OutputFolderConflict: Naming the first path that is not ours.
        """
        for rel in map(_relative, relpaths):
            target = self.root / rel
            if not target.exists() and not target.is_symlink():
                continue
            if target.is_dir() and not target.is_symlink():
                if rel in self._manifest["folders"] or all(is_ours(p) for p in _files_below(target)):
                    continue
            elif is_ours(target):
                continue
            raise OutputFolderConflict(self._conflict_message(target))

    def _conflict_message(self, target: Path) -> str:
        return (
            f"{self.option} must not hold files of the same name that this package did not write, got "
            f"{str(self.root)!r}, where {str(target)!r} was not written by art-malleability or was changed since "
            "(it is left alone); move it away or choose another folder"
        )

    def path(self, relpath: str | os.PathLike) -> Path:
        """:return: Where a file of the run is staged (its folder created), for writers that need a path."""
        if self.staging is None:
            raise RuntimeError("the output folder is not open; use it as a context manager")
        target = self.staging / _relative(relpath)
        target.parent.mkdir(parents=True, exist_ok=True)
        return target

    def write(self, relpath: str | os.PathLike, content: str | bytes) -> None:
        """
        Stage one file (text as UTF-8); a later :meth:`write` of the same path replaces it.

        :param relpath: Its path inside the output folder (``/`` separated, no ``..``).
        :param content: Its bytes or text.
        """
        data = content.encode("utf-8") if isinstance(content, str) else bytes(content)
        target = self.path(relpath)
        with open(target, "wb") as handle:
            handle.write(data)
        self.staged[_relative(relpath)] = hashlib.sha256(data).hexdigest()

    def write_all(self, files: dict[str, str | bytes], folder: str = "") -> None:
        """Stage several files, each under ``folder`` (``""``: the output folder itself)."""
        for name, content in files.items():
            self.write(f"{folder}/{name}" if folder else name, content)

    # ------------------------------------------------------------------ commit
    def commit(self) -> None:
        """
        Put the staged files in place: refuse (:class:`OutputFolderConflict`) when a target exists and is not ours;
        journal the new digests in the manifest; rename each staged file onto its target; remove the files this
        writer wrote before and does not write now (only while unchanged), and the folders a run created that are
        left empty; write the final manifest.
        """
        old = self._manifest
        targets = {rel: self.root / rel for rel in self.staged}
        for rel, target in targets.items():
            parents = [self.root / p for p in PurePosixPath(rel).parents[:-1]]
            blocked = next((p for p in parents if p.is_symlink() or (p.exists() and not p.is_dir())), None)
            if blocked is not None or (
                (target.exists() or target.is_symlink()) and not (target.is_file() and is_ours(target))
            ):
                raise OutputFolderConflict(
                    self._conflict_message(blocked or target) + f"; this run's files are kept in {str(self.staging)!r}"
                )
        with _signals_deferred():
            manifest_path = self.root / MANIFEST_NAME
            mine = {rel: {"sha256": digest, "writer": self.writer} for rel, digest in self.staged.items()}
            _write_json(manifest_path, {**old, "format": _FORMAT, "incoming": mine})
            folders = set(old["folders"])
            for rel, target in targets.items():
                for parent in reversed(PurePosixPath(rel).parents[:-1]):
                    if not (self.root / parent).exists():
                        (self.root / parent).mkdir()
                        folders.add(parent.as_posix())
                os.replace(self.staging / rel, target)
            files = dict(mine)
            for rel, entries in _previous(old).items():
                if rel in files:
                    continue
                target = self.root / rel
                digest = file_digest(target) if target.is_file() and not target.is_symlink() else None
                entry = next((e for e in entries if e["sha256"] == digest), None)
                if entry is None:
                    if target.exists():
                        logger.warning("%s was written by an earlier run but changed since; left in place", target)
                elif entry["writer"] != self.writer:
                    files[rel] = entry  # another writer's file, untouched
                else:
                    target.unlink()
            for rel in sorted(folders, key=lambda f: -f.count("/")):
                with contextlib.suppress(OSError):
                    (self.root / rel).rmdir()  # only when empty
            folders = {f for f in folders if (self.root / f).is_dir()}
            _write_json(manifest_path, {"format": _FORMAT, "files": files, "folders": sorted(folders)})
        self._manifest = read_manifest(self.root)
        logger.info("%d file(s) written to %s", len(self.staged), self.root)


def _previous(manifest: dict) -> dict[str, list[dict]]:
    """Every file a manifest lists, with its recorded versions (a commit under way adds its incoming one)."""
    versions: dict[str, list[dict]] = {rel: [entry] for rel, entry in manifest["files"].items()}
    for rel, entry in manifest.get("incoming", {}).items():
        versions.setdefault(rel, []).append(entry)
    return versions


def _files_below(folder: Path) -> Iterator[Path]:
    for dirpath, _, filenames in os.walk(folder):
        for name in filenames:
            yield Path(dirpath) / name


def _read_holder(fd: int) -> dict:
    """The JSON a lock's holder wrote into it (``{}`` when empty or unreadable)."""
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        data = os.read(fd, 65536)
        return json.loads(data) if data else {}
    except (OSError, ValueError):
        return {}


def _alive(pid: object) -> bool:  # pragma: no cover - Windows
    try:
        os.kill(int(pid), 0)
    except (OSError, ValueError, TypeError):
        return False
    return True


@contextlib.contextmanager
def staged_output(output: str | os.PathLike | OutputFolder, writer: str) -> Iterator[OutputFolder]:
    """
    The open output folder of a function that writes files: ``output`` itself when the caller already opened one
    (its run commits), else a new :class:`OutputFolder` on the path, committed when the block succeeds.

    :param output: A folder path or an open :class:`OutputFolder`.
    :param writer: The writer of a new folder's files.
    """
    if isinstance(output, OutputFolder):
        yield output
        return
    with OutputFolder(output, writer=writer) as out:
        yield out
