"""Start-up checks of an ``nvme_path``, at ``zerocore.initialize``: every problem a swap file would
hit later is said now, naming the config key and the path."""
from __future__ import annotations

import errno
import os
import shutil
import tempfile

from ...config.options import ConfigError


def check_nvme_path(key: str, path: str) -> None:
    """``key`` (e.g. 'zero_optimization.offload_optimizer.nvme_path') names ``path`` in errors."""
    if not os.path.exists(path):
        raise ConfigError(f"{key}: '{path}' does not exist; create the directory (on the NVMe drive) first")
    if not os.path.isdir(path):
        raise ConfigError(f"{key}: '{path}' is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: '{path}' is not writable by this process (uid {os.getuid()})")
    try:
        fd, probe = tempfile.mkstemp(prefix=".zerocore_probe_", dir=path)
    except OSError as e:
        raise ConfigError(f"{key}: cannot create a file in '{path}': {e.strerror}") from None
    os.close(fd)
    try:
        open_direct(probe)
    except OSError as e:
        if e.errno == errno.EINVAL:
            raise ConfigError(f"{key}: the file system of '{path}' does not support O_DIRECT (direct I/O), which "
                              "the swap files need (tmpfs and some network file systems refuse it); use a "
                              "directory on a local NVMe/SSD file system (ext4, xfs)") from None
        raise ConfigError(f"{key}: cannot open a file in '{path}' for direct I/O: {e.strerror}") from None
    finally:
        os.unlink(probe)


def open_direct(path: str) -> None:
    """Opens ``path`` with O_DIRECT (EINVAL where the file system refuses direct I/O)."""
    os.close(os.open(path, os.O_WRONLY | getattr(os, "O_DIRECT", 0)))


def free_bytes(path: str) -> int:
    return shutil.disk_usage(path).free


def check_free_space(key: str, path: str, needed: int, free: int, what: str) -> None:
    if needed > free:
        raise ConfigError(f"{key}: '{path}' has {free} bytes free; the swap files need {needed} bytes ({what})")
