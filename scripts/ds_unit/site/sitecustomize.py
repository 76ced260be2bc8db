"""Loaded at start-up by every Python process of a ``scripts/ds_unit/run.py`` run (this folder is on
PYTHONPATH; the venv has no sitecustomize of its own), so also by the ranks DeepSpeed's launcher
starts through a forkserver, which import DeepSpeed's ``unit/common.py`` afresh.

One change to that launcher, for both faces: a rank's test that fails through pytest's own outcome
exceptions (``pytest.raises`` that saw no exception, ``pytest.fail``) raises a BaseException, which
kills the multiprocessing.Pool worker instead of returning the error; the parent then waits for the
result until its timeout and hangs tearing the pool down, ending the whole file's run. Here such an
exception reaches the parent as an AssertionError carrying its message (pytest.skip keeps its meaning:
DeepSpeed's own code turns it into a skip first).
"""
import importlib.abc
import importlib.machinery
import sys


def _patch(common) -> None:
    run = common.DistributedExec._dist_run

    def _dist_run(self, *args, **kwargs):
        try:
            return run(self, *args, **kwargs)
        except Exception:
            raise
        except BaseException as e:  # pytest's Failed/Exit (Skipped never gets here)
            raise AssertionError(f"{type(e).__name__}: {e}") from None

    common.DistributedExec._dist_run = _dist_run


class _PatchCommon(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "unit.common":
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        execute = spec.loader.exec_module

        def exec_module(module):
            execute(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchCommon())
