"""The files a command reads from a user or writes for one, each checked in one place:

- ``check_writable``: an output path can be created and written, checked before the work (a command that fails
  only when it writes loses the work);
- ``read_safetensors``, ``read_json``, ``load_npz`` / ``npz_files``: a user's file read with one line naming it and
  its problem when it cannot be read (truncated, empty, of another format), instead of the library's error;
- ``write_json``: small JSON records of a run (status, accounting, indexes, bundles, results), written whole;
- ``OutputLock``: the one lock on what a command writes (a run directory, a study folder, an output file), taken
  before anything is written and held until the command ends, so that two commands started together on the same
  output cannot both pass the checks and write over each other.
"""

from __future__ import annotations

import atexit
import fcntl
import json
import os
import sys
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Any

WRITE_PROBE = ".write-probe-"  # the prefix of check_writable's probe folder: another rank's check may meet it


def check_writable(path: str | Path, what: str, fix: str, *, directory: bool = False) -> None:
    """ValueError in one line unless ``path`` (a file, or a folder with ``directory``) can be created and written:
    every existing part of its path above it is a directory, the path itself is not a folder when a file is
    wanted, and the deepest existing folder accepts a new entry (probed with an empty folder removed at once:
    permissions alone do not tell, e.g. for root, under /sys or on a read-only mount). ``what`` names the path in
    the message (``--out``, ``run directory``), ``fix`` says what to do (``choose another --out``)."""
    path = Path(path)
    name = f"{what} {str(path)!r}"
    if not directory and path.is_dir():
        raise ValueError(f"{name} is a folder, not a file; {fix}")
    base = path.absolute() if directory or not path.exists() else path.absolute().parent
    while not base.exists() and base != base.parent:
        if base.is_symlink():  # a dangling link in the path
            raise ValueError(f"{name} cannot be created: {str(base)!r} is a broken link; {fix}")
        base = base.parent
    if not base.is_dir():
        raise ValueError(f"{name} cannot be created: {str(base)!r} is a file, not a directory; {fix}")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=WRITE_PROBE, dir=base))
    except OSError as exc:
        raise ValueError(
            f"{name} cannot be written: {str(base)!r} refuses new files ({exc.strerror or type(exc).__name__}); {fix}"
        ) from None


def read_json(path: str | Path, what: str = "") -> Any:
    """The JSON value in ``path``; ValueError naming the file (and ``what`` it is), the line and the column when it
    is not JSON (``json``'s own error names neither the file nor what it was for)."""
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise ValueError(f"{what + ' ' if what else ''}{str(path)!r} is not a JSON text file") from None
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"{what + ' ' if what else ''}{str(path)!r} is not valid JSON (line {exc.lineno}, column {exc.colno}: "
            f"{exc.msg})"
        ) from None


def load_npz(path: str | Path, what: str = "", keys: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The arrays of the ``.npz`` file ``path`` (only ``keys`` when given, each required), read whole, without
    pickles; ValueError naming the file when it is truncated, of another format, or lacks a key. numpy's own errors
    name neither the file nor the cause, and one advises ``allow_pickle``, which runs code from the file."""
    return _open_npz(path, what, lambda z: {k: z[k] for k in (keys or z.files)}, keys)


def npz_files(path: str | Path, what: str = "") -> list[str]:
    """The array names of the ``.npz`` file ``path``, no array read (``load_npz``'s checks and errors)."""
    return _open_npz(path, what, lambda z: list(z.files))


def _open_npz(path: str | Path, what: str, read: Any, keys: tuple[str, ...] | None = None) -> Any:
    """``read(npz)`` of the archive ``path`` opened without pickles (``load_npz``)."""
    import numpy as np  # here, not at the top: this module stays light

    path = Path(path)
    name = f"{what + ' ' if what else ''}{str(path)!r}"
    if not path.is_file():
        raise FileNotFoundError(f"{name} does not exist" if not path.exists() else f"{name} is not a file")
    try:
        z = np.load(path, allow_pickle=False)
        if not isinstance(z, np.lib.npyio.NpzFile):
            raise ValueError(f"{name} is a single .npy array, not an .npz archive")
        with z:
            missing = [k for k in keys or () if k not in z.files]
            if missing:
                raise ValueError(f"{name} has no {' or '.join(map(repr, missing))} array (it holds {z.files})")
            return read(z)
    except ValueError as exc:
        if str(exc).startswith(name):
            raise
        raise ValueError(f"{name} is not a readable .npz file of numeric arrays ({_why(exc)})") from None
    except (OSError, EOFError, zipfile.BadZipFile) as exc:
        raise ValueError(
            f"{name} is not a readable .npz file: it may be truncated or of another format ({_why(exc)})"
        ) from None


def _why(exc: BaseException) -> str:
    """A library error in a few words. numpy's advice for pickled data (``allow_pickle=True``) is left out: it runs
    code from the file."""
    text = str(exc)
    if "pickle" in text:
        return "not a numpy archive, or one holding pickled objects, which are not read"
    return f"{type(exc).__name__}: {text.split('. ')[0]}" if text else type(exc).__name__


def read_safetensors(path: str | Path, device: str = "cpu") -> dict[str, Any]:
    """The tensors of the safetensors file ``path``; ValueError naming it when it is truncated, empty or of another
    format (safetensors' own error names neither the file nor the likely cause)."""
    from safetensors.torch import load_file  # here, not at the top: importing this module stays free of torch

    try:
        return load_file(str(path), device=device)
    except FileNotFoundError:
        raise
    except Exception as exc:  # safetensors raises its own error type, or OSError / ValueError on a short read
        raise ValueError(
            f"{str(path)!r} is not a readable safetensors file ({type(exc).__name__}: {exc}); it may be truncated or "
            "of another format"
        ) from None


def write_json(data: Any, path: str | Path, *, indent: int = 2) -> Path:
    """Write ``data`` as JSON to ``path`` atomically: serialised first, written to ``<name>.tmp`` in the same
    directory (parents created) and renamed over ``path``, so a failure or a kill leaves the previous file whole."""
    path = Path(path)
    text = json.dumps(data, indent=indent)  # a value JSON cannot hold fails here, before anything is written
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


LOCK_NAME = ".diffcurr-fast.lock"  # the lock file inside a locked folder (``OutputLock``); never a run's artifact
_HELD: dict[str, int] = {}  # the lock files this process holds -> their descriptors


class OutputLock:
    """An exclusive lock on an output of a command: a folder (``directory``: the file ``LOCK_NAME`` inside it) or a
    file (``.<name>.lock`` beside it). ``acquire`` takes it at once or raises ValueError in one line naming the
    process that holds it (``what`` names the output, ``fix`` says what to do instead); ``release`` gives it back.

    It is ``fcntl.flock`` on the lock file, held while the command runs: the system releases it when the process
    ends, however it ends, so a lock file left by a killed process is taken over (with a warning naming it), never
    waited on. The lock file holds the holder's process id and command line, for the message. Within one process a
    second lock on the same output (the trainer inside the ``train`` command) holds nothing: the first one releases
    it. Folders it had to create (the output folder, its missing parents) are removed again on release when nothing
    was written into them, so a refused start leaves nothing behind. ``create=False``: a folder that does not exist
    is not created and not locked (a ``--resume`` of it is refused by its own check)."""

    def __init__(self, path: str | Path, what: str, fix: str, *, directory: bool = False, create: bool = True):
        path = Path(os.path.abspath(path))
        self.path, self.what, self.fix, self.directory, self.create = path, what, fix, directory, create
        self.file = path / LOCK_NAME if directory else path.parent / f".{path.name}.lock"
        self.held = False  # this object took the lock and releases it
        self._made: list[Path] = []  # the folders this lock created, deepest first

    def __enter__(self) -> OutputLock:
        return self.acquire()

    def __exit__(self, *exc: Any) -> None:
        self.release()

    def acquire(self) -> OutputLock:
        """Take the lock (class doc); returns ``self``."""
        if self.held or str(self.file) in _HELD or (not self.create and not self.file.parent.is_dir()):
            return self
        check_writable(self.path, self.what, self.fix, directory=self.directory)
        self._made = [p for p in (self.file.parent, *self.file.parent.parents) if not p.exists()]
        self.file.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd, previous = self._take()
        except BaseException:
            self._remove_made()
            raise
        if previous:  # its holder ended without releasing it (killed): the lock was free, the file stayed
            warnings.warn(
                f"{self.what} {str(self.path)!r}: taking over the lock left by a process that is gone ({previous}); "
                "what it was writing may be incomplete",
                UserWarning,
                stacklevel=2,
            )
        os.ftruncate(fd, 0)
        command = " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]) if sys.argv else "python"
        os.pwrite(fd, f"process {os.getpid()}: {command}".encode()[:4000], 0)
        _HELD[str(self.file)] = fd
        self.held = True
        return self

    def _take(self) -> tuple[int, str]:
        """(the descriptor of the locked file, what a holder that is gone had written in it)."""
        while True:
            fd = os.open(self.file, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 4000).decode(errors="replace").strip() or "a process starting up"
                holder = holder if len(holder) <= 160 else holder[:160] + " ..."
                os.close(fd)
                raise ValueError(
                    f"{self.what} {str(self.path)!r} is in use by another command ({holder}); wait for it to end, "
                    f"or {self.fix}"
                ) from None
            try:  # its holder may have removed the file between our open and our lock: take the new one
                same = os.path.samestat(os.fstat(fd), os.stat(self.file))
            except FileNotFoundError:
                same = False
            if same:
                return fd, os.read(fd, 4000).decode(errors="replace").strip()
            os.close(fd)

    def release(self) -> None:
        """Give the lock back: remove the lock file (while still holding it: a process that opened it meanwhile
        takes a new one), then the folders the lock created that are still empty."""
        if not self.held:
            return
        self.held = False
        fd = _HELD.pop(str(self.file))
        try:
            self.file.unlink(missing_ok=True)
        finally:
            os.close(fd)
        self._remove_made()

    def _remove_made(self) -> None:
        for d in self._made:
            try:
                d.rmdir()
            except OSError:  # not empty: the command wrote into it
                break
        self._made = []


@atexit.register
def _release_all() -> None:
    """Remove the lock files this process still holds when it exits (the system releases the locks themselves)."""
    for key, fd in list(_HELD.items()):
        Path(key).unlink(missing_ok=True)
        os.close(fd)
    _HELD.clear()
