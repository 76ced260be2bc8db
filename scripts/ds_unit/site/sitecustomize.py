"""Loaded at start-up by every Python process of a ``scripts/ds_unit/run.py`` run (this folder is on
PYTHONPATH; the venv has no sitecustomize of its own), so also by the ranks DeepSpeed's launcher
starts through a forkserver, which import DeepSpeed's ``unit/common.py`` afresh.

One change to that launcher, for both faces: a rank's test that fails through pytest's own outcome
exceptions (``pytest.raises`` that saw no exception, ``pytest.fail``) raises a BaseException, which
kills the multiprocessing.Pool worker instead of returning the error; the parent then waits for the
result until its timeout and hangs tearing the pool down, ending the whole file's run. Here such an
exception reaches the parent as an AssertionError carrying its message (pytest.skip keeps its meaning:
DeepSpeed's own code turns it into a skip first).

And one to the reference those tests compare with, for both faces: they wrap their torch model in
``DistributedDataParallel(model, device_ids=[rank], output_device=rank)``, which torch refuses for a
module on the CPU (DeepSpeed's CPU accelerator); there the two arguments are dropped, as torch asks of
CPU modules, so the comparison runs instead of failing before either face is reached. Likewise
``unit.common.reduce_boolean_flags`` (behind ``allclose_on_all_ranks``) makes its flag tensor on
``get_accelerator().current_device()``, which DeepSpeed's CPU accelerator answers with the rank as a
string ('1', not a device): there it is made on ``current_device_name()``.
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
    _cpu_ddp()
    reduce_flags = common.reduce_boolean_flags

    def reduce_boolean_flags(flag: bool, op=all) -> bool:
        if not common.dist.is_initialized() or common.get_accelerator().current_device_name() != "cpu":
            return reduce_flags(flag, op)
        import torch

        mine = torch.tensor([1 if flag else 0], dtype=torch.int)  # (gloo gathers 1-d tensors only)
        flags = torch.zeros(common.dist.get_world_size(), dtype=torch.int)
        common.dist.all_gather_into_tensor(flags, mine)
        return op(bool(f) for f in flags.tolist())

    common.reduce_boolean_flags = reduce_boolean_flags


def _cpu_ddp() -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    if getattr(DDP.__init__, "_ds_unit_cpu", False):
        return
    init = DDP.__init__

    def __init__(self, module, device_ids=None, output_device=None, *args, **kwargs):
        if all(p.device.type == "cpu" for p in module.parameters()):
            device_ids = output_device = None
        init(self, module, device_ids, output_device, *args, **kwargs)

    __init__._ds_unit_cpu = True
    DDP.__init__ = __init__


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
