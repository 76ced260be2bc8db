"""A failing disk for the NVMe tests: every write a swap store issues raises ``OSError(code)``.

No small file system can be mounted here and root ignores chmod, so a full disk (ENOSPC) or a
read-only one (EROFS) is injected where the real error would come from: the store's AsyncIO
writers. The store's own error path then runs as it would for a real failure."""
import os


class _FailingWriter:
    def __init__(self, writer, code: int):
        self._writer, self._code = writer, code

    def async_pwrite(self, *args, **kwargs):
        raise OSError(self._code, os.strerror(self._code))

    def __getattr__(self, name):  # waits, closes and the rest go to the real handle
        return getattr(self._writer, name)


def fail_writes(store, code: int) -> None:
    """From now on every write of ``store`` fails with errno ``code``."""
    store.writers = [_FailingWriter(w, code) for w in store.writers]


def heal_writes(store) -> None:
    """The disk has room again: the real writers back."""
    store.writers = [getattr(w, "_writer", w) for w in store.writers]
