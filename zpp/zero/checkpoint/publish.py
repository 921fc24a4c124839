"""Where a save is staged, how rank 0 makes it visible, and what a crashed save leaves.

[Note: publishing]
A save writes into a fresh hidden directory ``save_dir/.zpp-staging-<save_id>-<tag>``. Once
every rank's files are complete (see [Note: save protocol] in
:mod:`zpp.zero.checkpoint.save`), rank 0 makes it the tag in one step:

* a new tag: ``rename(staging, save_dir/tag)``;
* an existing tag: ``renameat2(staging, save_dir/tag, RENAME_EXCHANGE)`` swaps the two
  directories atomically (Linux >= 3.15; ext4, xfs, btrfs, tmpfs), so ``save_dir/tag`` is
  at every instant either the whole old version or the whole new one; the old version,
  now under the staging name, is then removed. Where the exchange is not supported
  (another OS, a filesystem that refuses it) the old version is first renamed to
  ``.zpp-old-<save_id>-<tag>`` and the staging directory renamed to the tag: for the
  moment between the two renames the tag is absent (never mixed), and if the process dies
  there, the next save renames the old version back.

``latest`` is replaced (write a temporary file, fsync, rename) only after the tag is in
place. The next save on the same ``save_dir`` removes what a crashed save left: staging
directories, ``.zpp-old-*`` directories whose tag exists, and the temporary files of
``latest`` and of format-1 saves (``.shard_rank00000.pt.tmp<pid>`` and the like inside a tag
directory): only those names, only directly in ``save_dir`` and its tag directories.
"""
from __future__ import annotations

import ctypes
import errno
import os
import re
import shutil
from pathlib import Path

from zpp.zero.checkpoint.files import fsync_dir

STAGING = ".zpp-staging-"
OLD = ".zpp-old-"
LATEST = "latest"
SAVE_ID_CHARS = 16  # hex digits of a save id
_TMP_IN_ROOT = re.compile(r"^\.latest\.tmp\d+$")
#: a rank's file (the shards' and each mode's ``<prefix>_rankNNNNN.pt``) or rank 0's, being written
_TMP_IN_TAG = re.compile(r"^\.([a-z0-9_]+_rank\d{5}\.pt|meta\.pt|meta\.json)\.tmp\d+$")
_AT_FDCWD = -100
_RENAME_EXCHANGE = 2


def staging_dir(root: Path, tag: str, save_id: str) -> Path:
    return root / f"{STAGING}{save_id}-{tag}"


def publish(staging: Path, final: Path, save_id: str, *, durable: bool = True) -> Path | None:
    """Make ``staging`` the directory ``final`` (see [Note: publishing]); returns the path
    that now holds the replaced version (to remove), or None for a new tag."""
    root = final.parent
    if not os.path.lexists(final):
        os.rename(staging, final)
        fsync_dir(root, durable)
        return None
    if not final.is_dir() or final.is_symlink():
        raise FileExistsError(f"save_checkpoint: {final} exists and is not a checkpoint directory")
    if _exchange(staging, final):
        fsync_dir(root, durable)
        return staging
    old = root / f"{OLD}{save_id}-{final.name}"
    os.rename(final, old)
    os.rename(staging, final)
    fsync_dir(root, durable)
    return old


def _exchange(a: Path, b: Path) -> bool:
    """Swap two directories atomically; False where the system cannot."""
    fn = getattr(_libc(), "renameat2", None)
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE): {os.strerror(err)}")


_LIBC: ctypes.CDLL | None = None


def _libc() -> ctypes.CDLL:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


def write_latest(root: Path, tag: str, *, durable: bool = True) -> None:
    """Point ``root/latest`` at ``tag`` (temporary file, fsync, rename, fsync the directory)."""
    tmp = root / f".{LATEST}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(tag)
        f.flush()
        if durable:
            os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    fsync_dir(root, durable)


def remove_stale(root: Path) -> list[str]:
    """Remove (or, for an interrupted fallback publish, restore) what crashed saves left in
    ``root``; see [Note: publishing]. Returns the names handled."""
    if not root.is_dir():
        return []
    done = []
    for entry in os.scandir(root):
        name = entry.name
        if entry.is_dir(follow_symlinks=False):
            if name.startswith(STAGING):
                shutil.rmtree(entry.path, ignore_errors=True)
                done.append(name)
            elif name.startswith(OLD):
                tag = name[len(OLD) + SAVE_ID_CHARS + 1:]
                if tag and not os.path.lexists(root / tag):
                    os.rename(entry.path, root / tag)  # the publish died between its two renames
                else:
                    shutil.rmtree(entry.path, ignore_errors=True)
                done.append(name)
            elif not name.startswith("."):
                for sub in os.scandir(entry.path):
                    if _TMP_IN_TAG.match(sub.name) and sub.is_file(follow_symlinks=False):
                        os.unlink(sub.path)
                        done.append(f"{name}/{sub.name}")
        elif _TMP_IN_ROOT.match(name) and entry.is_file(follow_symlinks=False):
            os.unlink(entry.path)
            done.append(name)
    return done
