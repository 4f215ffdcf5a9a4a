"""A content-addressed build cache: one directory per entry, named by a hash of its inputs.

An entry is built in ``<name>.partial-<pid>`` beside its final place, gets a
``MANIFEST.json`` (every regular file's size and SHA-256, every symlink's
target) once the build function has returned, and is renamed into place: a
directory named ``<name>`` is therefore complete, and it is still checked
against its manifest before it is used. An entry that fails the check, or a
partial one left by a builder that was killed, is never used; the next builder
removes it and builds again. Builders serialise on an ``flock`` of ``.lock``, so
a second one waits for the first and then finds its entry; readers of a good
entry take no lock (entries never change once renamed in).

``build.py`` keeps its two image levels here; nothing in this file knows what
an image is.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

MANIFEST = "MANIFEST.json"
LOCK = ".lock"
# Files up to this size have their SHA-256 checked at every lookup; larger ones (the root file
# system image) their size, and their hash only when asked (``verify(full=True)``).
HASH_CHECK_MAX_BYTES = 64 << 20


def input_key(parts: Iterable[tuple[str, bytes]]) -> str:
    """SHA-256 (hex) of named inputs; names and contents are length-prefixed so that no two
    different input sets hash alike by concatenation."""
    digest = hashlib.sha256()
    for name, content in parts:
        for field in (name.encode(), content):
            digest.update(len(field).to_bytes(8, "little"))
            digest.update(field)
    return digest.hexdigest()


def tree_inputs(root: Path, prefix: str) -> list[tuple[str, bytes]]:
    """Every file under ``root`` as ``(prefix/relative path, bytes)``, sorted by path."""
    return [
        (f"{prefix}/{path.relative_to(root).as_posix()}", path.read_bytes())
        for path in sorted(root.rglob("*"))
        if path.is_file()
    ]


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _walk(root: Path) -> Iterator[tuple[str, Path]]:
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        base = Path(dirpath)
        for name in sorted(filenames + [d for d in dirnames if (base / d).is_symlink()]):
            path = base / name
            rel = path.relative_to(root).as_posix()
            if rel != MANIFEST:
                yield rel, path


def manifest_of(root: Path) -> dict[str, dict[str, object]]:
    """Size and SHA-256 of every regular file under ``root``, target of every symlink."""
    files: dict[str, dict[str, object]] = {}
    for rel, path in _walk(root):
        if path.is_symlink():
            files[rel] = {"link": os.readlink(path)}
        elif path.is_file():
            files[rel] = {"size": path.stat().st_size, "sha256": _file_sha256(path)}
    return files


def verify(entry: Path, full: bool = False) -> str | None:
    """None if ``entry`` matches its manifest, else what is wrong (one line)."""
    try:
        recorded = json.loads((entry / MANIFEST).read_text())["files"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        return f"no readable {MANIFEST} ({err.__class__.__name__})"
    for rel, want in recorded.items():
        path = entry / rel
        if "link" in want:
            if not path.is_symlink() or os.readlink(path) != want["link"]:
                return f"{rel}: symlink changed"
            continue
        try:
            st = path.lstat()
        except OSError:
            return f"{rel}: missing"
        if st.st_size != want["size"]:
            return f"{rel}: {st.st_size} bytes, {want['size']} recorded"
        if (full or st.st_size <= HASH_CHECK_MAX_BYTES) and _file_sha256(path) != want["sha256"]:
            return f"{rel}: content changed"
    return None


class BuildCache:
    """Entries under ``root``; ``ensure(name, build)`` returns a verified entry, building it
    (with the lock held) when it is missing or bad."""

    def __init__(self, root: Path, log: Callable[[str], None] | None = None) -> None:
        self.root = Path(root).resolve()
        self._log = log or (lambda _msg: None)
        self._lock_fd: int | None = None
        self._depth = 0

    def lookup(self, name: str) -> Path | None:
        entry = self.root / name
        if entry.is_dir() and verify(entry) is None:
            return entry
        return None

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """The builders' lock; re-entrant within this object (a build function may ensure the
        entries it builds on)."""
        if self._depth == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.root / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
            self._lock_fd = fd
            # Partial entries can only be left by a builder that died: we hold the lock.
            for stale in self.root.glob("*.partial-*"):
                shutil.rmtree(stale, ignore_errors=True)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if self._depth == 0 and self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = None

    def ensure(self, name: str, build: Callable[[Path], None]) -> Path:
        found = self.lookup(name)
        if found is not None:
            return found
        with self.locked():
            found = self.lookup(name)  # another builder may have made it while we waited
            if found is not None:
                return found
            return self._build(name, build)

    def _build(self, name: str, build: Callable[[Path], None]) -> Path:
        entry = self.root / name
        if entry.exists() or entry.is_symlink():
            self._log(f"cache entry {name} is bad ({verify(entry)}): building it again")
            trash = self.root / f"{name}.partial-bad-{os.getpid()}"
            entry.rename(trash)
            shutil.rmtree(trash)
        partial = self.root / f"{name}.partial-{os.getpid()}"
        partial.mkdir()
        try:
            build(partial)
            manifest = {
                "name": name,
                "built": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "files": manifest_of(partial),
            }
            (partial / MANIFEST).write_text(json.dumps(manifest, indent=0, sort_keys=True))
            os.sync()  # the contents reach the disk before the name does
            partial.rename(entry)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        dir_fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return entry
