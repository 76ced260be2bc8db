"""Every zerocore module imports with only what ``setup.py`` requires (torch, tqdm) beside the
standard library: a user who installs zerocore *instead of* DeepSpeed has none of what DeepSpeed
brings along (psutil, packaging), and CI's environment, which installs DeepSpeed and the trainers
to compare against, would never notice a module that needs them. ``import zerocore.deepspeed``
failed that way on a clean Python 3.13 environment (``psutil``, then ``packaging``).

The walk runs in a subprocess whose import system refuses the optional packages (as if they were
not installed, whether or not they are here). The integrations for Transformers, Lightning and
Accelerate need their library by design and must say so in an ImportError naming it."""
from __future__ import annotations

import json
import subprocess
import sys

# Installed by CI or by a user's other tools, none of them a requirement of zerocore (setup.py)
OPTIONAL = ("psutil", "packaging", "safetensors", "crc32c", "deepspeed", "transformers", "accelerate", "lightning",
            "pytorch_lightning", "trl", "peft", "matplotlib", "colossalai", "triton", "hjson")
# module -> the package its ImportError must name
NEEDS_THEIR_LIBRARY = {"zerocore.integrations.transformers": "transformers",
                       "zerocore.integrations.lightning": "lightning",
                       "zerocore.integrations.accelerate": "accelerate"}

_WALK = r"""
import importlib, importlib.abc, json, pkgutil, sys

blocked = set(sys.argv[1].split(","))

class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Refuse())
import zerocore
out = {}
for m in pkgutil.walk_packages(zerocore.__path__, "zerocore.", onerror=lambda name: None):
    if m.name.endswith("__main__"):
        continue
    try:
        importlib.import_module(m.name)
        out[m.name] = None
    except BaseException as e:  # noqa: BLE001 - reported, whatever it is
        out[m.name] = f"{type(e).__name__}: {e}"
print(json.dumps(out))
"""


def test_every_module_imports_with_the_declared_requirements_only():
    proc = subprocess.run([sys.executable, "-c", _WALK, ",".join(OPTIONAL)], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) > 100, f"the walk found only {len(results)} modules"
    assert "zerocore.deepspeed.runtime.utils" in results and "zerocore.deepspeed.utils.torch" in results
    failed = {m: err for m, err in results.items() if err is not None and m not in NEEDS_THEIR_LIBRARY}
    assert not failed, "modules that need a package zerocore does not require:\n" + "\n".join(
        f"  {m}: {err}" for m, err in sorted(failed.items()))
    for module, library in NEEDS_THEIR_LIBRARY.items():
        err = results.get(module)
        # (ModuleNotFoundError here where the library is installed but refused: the integration's own check
        # reads its installed version first; on a machine without it that check's ImportError names it)
        assert err is not None and err.split(":")[0] in ("ImportError", "ModuleNotFoundError") and library in err, (
            module, err)


def test_deepspeed_face_reports_memory_without_psutil(capsys):
    """``see_memory_usage`` reads /proc/meminfo where psutil is absent, and says what psutil would."""
    from zerocore.deepspeed.runtime import utils

    total, available = utils.host_memory()
    assert 0 < available <= total
    try:
        import psutil
    except ImportError:
        return
    vm = psutil.virtual_memory()
    assert total == vm.total
    real = sys.modules.pop("psutil")
    sys.modules["psutil"] = None  # import psutil now raises ImportError
    try:
        total2, available2 = utils.host_memory()
    finally:
        sys.modules["psutil"] = real
    assert total2 == vm.total and abs(available2 - vm.available) < 0.05 * vm.total
