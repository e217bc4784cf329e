"""Write several files all or nothing: stage every file next to its target, then swap them in.

A failure while staging changes nothing. A failure while swapping (or a read-back that does not
match) puts back every file already swapped, so the tree is as it was before the call.
"""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

# Seams for fault-injection tests: the swap and the read-back are where a real failure would
# land half-way through a set of files.
_replace = os.replace


def _read_back(path: Path) -> str:
    return read_text(path)


def read_text(path: Path) -> str:
    """The file's text exactly as stored (no newline translation)."""
    return path.read_bytes().decode("utf-8")


class WriteError(Exception):
    pass


def unwritable_reason(path: Path) -> str | None:
    """Why `path` must not be rewritten, or None. Root ignores permission bits, so read them."""
    try:
        mode = path.stat().st_mode
    except OSError as exc:
        return f"cannot stat {path}: {exc.strerror}"
    if not mode & (stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH):
        return f"{path} is read-only (mode {stat.filemode(mode)})"
    if not os.access(path, os.W_OK) or not os.access(path.parent, os.W_OK | os.X_OK):
        return f"{path} or its directory is not writable by this user"
    return None


def write_all(new_texts: dict[Path, str]) -> None:
    """Replace each file's text with the new one; on any failure leave every file unchanged."""
    old_texts = {p: (read_text(p) if p.exists() else None) for p in new_texts}
    staged: dict[Path, str] = {}
    try:
        for path, text in new_texts.items():
            staged[path] = _stage(path, text)
    except OSError as exc:
        _discard(staged.values())
        raise WriteError(f"staging {path}: {exc}") from exc
    swapped: list[Path] = []
    try:
        for path, text in new_texts.items():
            _replace(staged[path], path)
            del staged[path]
            swapped.append(path)
            if _read_back(path) != text:
                raise WriteError(f"{path} reads back different from what was written")
    except (OSError, WriteError) as exc:
        _discard(staged.values())
        failed = _restore(swapped, old_texts)
        if failed:
            raise WriteError(f"writing {path}: {exc}; COULD NOT PUT BACK "
                             + ", ".join(map(str, failed))) from exc
        raise WriteError(f"writing {path}: {exc}; every file put back as it was") from exc


def _stage(path: Path, text: str) -> str:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".beam-hpu-tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        if path.exists():
            os.chmod(tmp, stat.S_IMODE(path.stat().st_mode))
        else:
            os.chmod(tmp, 0o644)
    except OSError:
        os.unlink(tmp)
        raise
    return tmp


def _restore(swapped: list[Path], old_texts: dict[Path, str | None]) -> list[Path]:
    failed = []
    for path in reversed(swapped):
        old = old_texts[path]
        try:
            if old is None:
                path.unlink()
            else:
                os.replace(_stage(path, old), path)
        except OSError:
            failed.append(path)
    return failed


def _discard(tmps) -> None:
    for tmp in tmps:
        try:
            os.unlink(tmp)
        except OSError:
            pass
