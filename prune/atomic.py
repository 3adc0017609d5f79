"""Files and folders written all or nothing: a reader never sees half of one, a killed writer leaves nothing.

Every output of layercut (checkpoints, reports, caches) goes through here: a folder is written in a staging
sibling and renamed into place; a file is written beside its target and renamed onto it.

One writer per folder: a run holds the lock file ``.<name>.lock`` beside its ``--out`` (:func:`output_lock`,
holding its pid), and a second run on the same folder is refused in one line while the first is alive.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from prune.errors import LayercutError

logger = logging.getLogger(__name__)


def check_output_dir(out: str | Path, overwrite: bool) -> Path:
    """Fail early (before any heavy work) if ``out`` is a non-empty folder and overwrite is off.

    What an export killed with ``kill -9`` left beside ``out`` is mended first, so the check sees the output
    that is really there (:func:`recover_killed_export`).
    """
    if not Path(out).expanduser().name:  # "", "." or "/": a folder written whole and then renamed needs a name
        raise LayercutError(f"--out {str(out)!r} names no folder: pass a folder path such as slim/")
    path = Path(out).expanduser()
    _check_unlocked(path.resolve(), out)  # before mending: a live writer's staging folder is its own
    recover_killed_export(path.resolve())
    if path.exists() and not path.is_dir():
        raise LayercutError(f"--out {out} is a file: pass a folder path")
    if path.is_dir() and any(path.iterdir()) and not overwrite:
        raise LayercutError(f"--out {out} exists and is not empty: pass --overwrite or choose another folder")
    _check_writable(path)
    return path


def nearest_existing(path: str | Path) -> Path:
    """The nearest path at or above ``path`` that exists: the disk a run making ``path`` writes on.

    A file there is returned as it is: writing under it fails, and the callers' probes say so.
    """
    path = Path(path).expanduser().resolve()
    while not path.exists():
        path = path.parent
    return path


def _check_writable(path: Path) -> None:
    """Fail now, not after hours of work, when nothing can be written where ``path`` would go."""
    ancestor = nearest_existing(path.parent)
    try:
        probe = tempfile.mkdtemp(prefix=".layercut-probe-", dir=ancestor)
    except OSError as err:
        raise LayercutError(
            f"--out {path}: cannot write in {ancestor} ({err.strerror}); choose another folder"
        ) from None
    os.rmdir(probe)


def _disk_full(err: OSError, where: Path, untouched: str) -> LayercutError | None:
    """The one-line error for a write that failed for want of space (or quota); None for any other error."""
    if err.errno not in (errno.ENOSPC, errno.EDQUOT):
        return None
    return LayercutError(f"no space left to write {where} ({err.strerror}): nothing was written, {untouched}; "
                         "free some space or choose another folder")


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _public_modes(folder: Path) -> None:
    """Give ``folder`` and what it holds the modes a plain ``mkdir`` / ``open`` would (mkdtemp's are private)."""
    mask = _umask()
    for path in (folder, *folder.rglob("*")):
        if not path.is_symlink():
            path.chmod((0o777 if path.is_dir() else 0o666) & ~mask)


# lock files this process holds (resolved paths) -> how many nested holders share each
_HELD: dict[Path, int] = {}
# a lock file with no pid yet is a writer between creating and filling it for this long, then left over
_EMPTY_LOCK_GRACE_S = 10.0


def lock_path(out: str | Path) -> Path:
    """The lock file of output folder ``out``: ``.<name>.lock`` beside it."""
    target = Path(out).expanduser().resolve()
    return target.with_name(f".{target.name}.lock")


def _lock_owner(lock: Path) -> int | None:
    """The pid a lock file holds; None when there is no lock, or it is stale (its process is gone)."""
    try:
        text = lock.read_text(encoding="ascii").strip()
        age = time.time() - lock.stat().st_mtime
    except (OSError, UnicodeDecodeError):
        return None
    if not text.isdigit():  # being written now, or left half-written by a killed writer
        return os.getpid() if age < _EMPTY_LOCK_GRACE_S else None
    return int(text) if _alive(int(text)) else None


def _busy(out: str | Path, lock: Path, pid: int) -> LayercutError:
    return LayercutError(f"--out {out} is being written by another run (process {pid}; lock {lock}): wait for it to "
                         "finish or choose another folder (delete the lock only if that process is not layercut)")


def _check_unlocked(target: Path, out: str | Path) -> None:
    """Refuse ``out`` while another run holds its lock."""
    lock = lock_path(target)
    pid = None if lock in _HELD else _lock_owner(lock)
    if pid is not None:
        raise _busy(out, lock, pid)


def _take_lock(lock: Path, out: str | Path) -> None:
    """Create ``lock`` holding this process's pid (O_EXCL: one creator wins); a stale one is replaced."""
    for _ in range(3):
        try:
            handle = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            pid = _lock_owner(lock)
            if pid is not None:
                raise _busy(out, lock, pid) from None
            logger.warning("removed %s, left by a run that is gone", lock)
            lock.unlink(missing_ok=True)
            continue
        except OSError as err:
            raise LayercutError(f"--out {out}: cannot write in {lock.parent} ({err.strerror}); choose another "
                                "folder") from None
        with os.fdopen(handle, "w", encoding="ascii") as file:
            file.write(f"{os.getpid()}\n")
        return
    raise _busy(out, lock, _lock_owner(lock) or 0)


def _make_parents(folder: Path, out: str | Path) -> list[Path]:
    """Create ``folder`` and its missing parents; the ones made, deepest first."""
    made = []
    while not folder.exists():
        made.append(folder)
        folder = folder.parent
    try:
        for path in reversed(made):
            path.mkdir(exist_ok=True)
    except OSError as err:
        raise LayercutError(f"--out {out}: cannot make {path} ({err.strerror}); choose another folder") from None
    return made


@contextmanager
def output_lock(out: str | Path | None) -> Iterator[None]:
    """Hold the lock of output folder ``out`` (:func:`lock_path`) for the block: one writer per folder.

    Nested holders in this process share the lock; the outermost releases it. A lock whose process is gone (a
    run killed with ``kill -9``) is replaced. ``out`` None holds nothing.

    Raises:
        LayercutError: another live process holds the lock, or nothing can be written beside ``out``.
    """
    if out is None:
        yield
        return
    lock = lock_path(out)
    if lock in _HELD:
        _HELD[lock] += 1
        try:
            yield
        finally:
            _HELD[lock] -= 1
        return
    made = _make_parents(lock.parent, out)
    try:
        _take_lock(lock, out)
    except LayercutError:
        _remove_empty(made)
        raise
    _HELD[lock] = 1
    try:
        yield
    finally:
        del _HELD[lock]
        if _lock_owner(lock) == os.getpid():
            lock.unlink(missing_ok=True)
        _remove_empty(made)


def _remove_empty(folders: list[Path]) -> None:
    """Remove the folders a lock made that stayed empty (the run wrote nothing), deepest first."""
    for folder in folders:
        try:
            folder.rmdir()
        except OSError:
            return


@contextmanager
def atomic_directory(out: str | Path, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temporary folder next to ``out``; on success it replaces ``out``, on error it is removed.

    The lock of ``out`` (:func:`output_lock`) is held while it is written.

    Raises:
        LayercutError: the disk (or quota) is full; the previous ``out``, if any, is untouched. Another run
            is writing ``out``.
    """
    with output_lock(out):
        with _atomic_directory(out, overwrite) as staging:
            yield staging


@contextmanager
def _atomic_directory(out: str | Path, overwrite: bool) -> Iterator[Path]:
    target = check_output_dir(out, overwrite)
    target.parent.mkdir(parents=True, exist_ok=True)
    # the pid in the name tells a later run whether the process that made it is still writing
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.{os.getpid()}.", suffix=".tmp", dir=target.parent))
    try:
        try:
            yield staging
            _public_modes(staging)
        except OSError as err:
            untouched = f"the folder already at {target} is untouched" if target.exists() else "no folder was made"
            full = _disk_full(err, target, untouched)
            if full is None:
                raise
            raise full from None
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            target.rename(old)
            staging.rename(target)
            shutil.rmtree(old)
        else:
            staging.rename(target)
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


def recover_killed_export(target: Path) -> None:
    """Mend what an export killed with ``kill -9`` left beside ``target`` (a signal we can catch cleans up itself).

    Killed between its two renames, an export leaves ``target`` missing and the earlier output under
    ``.<name>.old-<pid>``: it comes back. Killed while writing, it leaves its staging folder
    ``.<name>.<pid>.<random>.tmp``: a model's size of disk, removed. Folders of a process still running
    are left alone.
    """
    if not target.parent.is_dir():
        return
    name = re.escape(target.name)
    for path in target.parent.iterdir():
        old = re.fullmatch(rf"\.{name}\.old-(\d+)", path.name)
        staging = re.fullmatch(rf"\.{name}\.(\d+)\.[a-z0-9_]+\.tmp", path.name)
        match = old or staging
        if match is None or _alive(int(match.group(1))):
            continue
        if old and not target.exists():
            path.rename(target)
            logger.warning("restored %s: an export into it was killed before it finished", target)
        else:
            shutil.rmtree(path, ignore_errors=True)
            logger.warning("removed %s, left by an export that was killed", path)


def write_file_atomic(path: Path, write) -> None:
    """Call ``write(staging)`` on a sibling path, then rename it onto ``path``: a reader never sees half a file."""
    staging = path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix}")
    try:
        write(staging)
        os.replace(staging, path)
    except OSError as err:
        full = _disk_full(err, path, "the file already there is untouched" if path.exists() else "no file was made")
        if full is None:
            raise
        raise full from None
    finally:
        staging.unlink(missing_ok=True)


def write_json(path: Path, data: dict) -> None:
    """Pretty JSON with a trailing newline."""
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
