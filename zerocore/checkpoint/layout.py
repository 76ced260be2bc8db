"""Where a checkpoint's pieces live on disk, and the atomic steps that publish them.

    save_dir/
      latest                 the newest complete tag (replaced atomically, last)
      <tag>/manifest.json    everything needed to reshard (see ``manifest.py``)
      <tag>/rank00003.bin    what rank 3 owned: fp32 master, exp_avg, exp_avg_sq of its slices
      .tmp-<tag>/            a save in progress; renamed to <tag> only once complete

A directory whose name starts with "." is never a tag: a save killed at any moment leaves a
``.tmp-`` directory (removed by the next save) and the previous tag untouched.
"""
from __future__ import annotations

import ctypes
import errno
import json
import os
import stat
import warnings

# defined below the checkpoint package, whose modules take it from here: the engine's step()
# raises it too (runtime/checkpoint_marks.py)
from ..runtime.checkpoint_marks import CheckpointError  # noqa: F401

MANIFEST = "manifest.json"
LATEST = "latest"
TMP_PREFIX = ".tmp-"


def rank_file(rank: int) -> str:
    return f"rank{rank:05d}.bin"


def check_tag(tag: str) -> str:
    tag = str(tag)
    if not tag or tag.startswith(".") or "/" in tag or os.sep in tag:
        raise ValueError(f"zerocore checkpoint: tag {tag!r} is not allowed (it must be a plain directory name "
                         "not starting with '.')")
    return tag


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def exchange(a: str, b: str) -> bool:
    """Swaps two existing paths in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``);
    False where the kernel, libc or file system cannot, and nothing happened."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), a)


def write_atomic(path: str, data: bytes, *, executable: bool = False) -> None:
    """``path`` holds either its old content or ``data``, whatever happens. ``executable``: the user's
    execute bit is added before the file appears (where the file system keeps no modes, it is left
    readable)."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        if executable:
            try:
                os.chmod(tmp, os.stat(tmp).st_mode | stat.S_IEXEC)
            except OSError:  # a share without modes
                pass
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    fsync_dir(os.path.dirname(os.path.abspath(path)))


def read_latest(save_dir: str) -> str | None:
    path = os.path.join(save_dir, LATEST)
    try:
        with open(path, encoding="utf-8") as f:
            tag = f.read().strip()
    except FileNotFoundError:
        return None
    return tag or None


def resolve(load_dir: str, tag: str | None) -> str | None:
    """The tag directory to load: ``tag``'s, or the one ``latest`` names; None (with a warning, as
    DeepSpeed does) when ``tag`` is None and there is no checkpoint at all."""
    if tag is None:
        tag = read_latest(load_dir)
        if tag is None:
            warnings.warn(f"zerocore: no checkpoint to load in {load_dir} (no '{LATEST}' file); nothing was loaded",
                          UserWarning, stacklevel=3)
            return None
        where = f"'{os.path.join(load_dir, LATEST)}' names tag {tag!r}, but"
    else:
        where = f"tag {tag!r}:"
    tag = check_tag(tag)
    path = os.path.join(load_dir, tag)
    if not os.path.isfile(os.path.join(path, MANIFEST)):
        raise CheckpointError(f"zerocore checkpoint: {where} {os.path.join(path, MANIFEST)} does not exist")
    return path


def read_manifest(ckpt_path: str) -> dict:
    from .manifest import FORMAT, VERSION

    path = os.path.join(ckpt_path, MANIFEST)
    try:
        with open(path, encoding="utf-8") as f:
            m = json.load(f)
    except json.JSONDecodeError as e:
        raise CheckpointError(f"zerocore checkpoint: {path} is not valid JSON ({e}); the file is corrupt") from None
    if not isinstance(m, dict) or m.get("format") != FORMAT:
        raise CheckpointError(f"zerocore checkpoint: {path} is not a zerocore checkpoint manifest")
    if m.get("version", 0) > VERSION:
        raise CheckpointError(f"zerocore checkpoint: {path} has format version {m.get('version')}; this zerocore "
                              f"reads up to version {VERSION}: upgrade zerocore")
    return m


def locate(ckpt_dir: str, tag: str | None) -> str:
    """For the offline tools: ``ckpt_dir`` may be a save_dir (with ``latest``) or a tag directory."""
    if os.path.isfile(os.path.join(ckpt_dir, MANIFEST)) and tag is None:
        return ckpt_dir
    path = resolve(ckpt_dir, tag)
    if path is None:
        raise CheckpointError(f"zerocore checkpoint: no checkpoint in {ckpt_dir} (no '{LATEST}' file and no "
                              f"{MANIFEST}); pass --tag or the tag directory")
    return path
