"""What the ``zerocore`` command (``cli.py``) and the subcommands it registers from the packages
(``planner/cli.py``) share, below both of them: writing an output file."""
from __future__ import annotations

import os


def write_atomically(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file in the same directory: a failure
    leaves the old file (or none), never half of one."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
