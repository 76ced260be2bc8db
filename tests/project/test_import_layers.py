"""The package's floors: no lower package imports a higher one, and no two modules that work
together import each other, counting imports inside functions too (a lazy import that goes up is
still a circle, only one that fails later).

Floors, low to high: ``ops``, ``comm``, ``sharding``, ``runtime``; above them the packages that
read and build engines (``checkpoint``, ``planner``) and the command line (``cli``). What the
runtime runs in the higher floors (an engine's checkpoint methods, its predicted memory) is handed
in from above (``zerocore/_wiring.py`` -> ``runtime/provided.py``); what both sides of a former
circle need sits below both (``runtime/checkpoint_marks.py``, ``checkpoint/agreement.py``,
``cli_common.py``). The imports are read from the source with ``ast``, not by importing it."""
from __future__ import annotations

import ast
import os

import zerocore

PACKAGE = os.path.dirname(os.path.abspath(zerocore.__file__))
LOW = ("zerocore.runtime", "zerocore.sharding", "zerocore.comm", "zerocore.ops")
HIGH = ("zerocore.planner", "zerocore.checkpoint", "zerocore.cli")
# Upward imports left in place, each with the reason it stays (none at present: add one only
# with a reason, and prefer moving the shared piece down or handing it in from above).
ALLOWED: dict[tuple[str, str], str] = {}


def _module_name(path: str) -> str:
    rel = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].replace(os.sep, ".")
    return rel[: -len(".__init__")] if rel.endswith(".__init__") else rel


def _is_module(name: str) -> bool:
    base = os.path.join(os.path.dirname(PACKAGE), *name.split("."))
    return os.path.isfile(base + ".py") or os.path.isfile(os.path.join(base, "__init__.py"))


def _imports_of(path: str) -> set[str]:
    """Every zerocore module ``path`` imports, at any depth of its code: ``from .x import y``
    counts as ``x`` and, where ``y`` is a module, ``x.y`` too."""
    name = _module_name(path)
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read(), path)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            else:
                base = node.module
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}"))
    return {m for m in found if m == "zerocore" or m.startswith("zerocore.")}


def _all_imports() -> dict[str, set[str]]:
    out = {}
    for root, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(root, f)
                out[_module_name(path)] = _imports_of(path)
    return out


IMPORTS = _all_imports()


def _under(module: str, packages) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_reader_sees_imports_at_every_depth():
    """The checks below would pass on a reader that finds nothing: it finds these."""
    assert "zerocore.planner.cli" in IMPORTS["zerocore.cli"]  # inside main()
    assert "zerocore.checkpoint.save" in IMPORTS["zerocore._wiring"]  # inside a function
    assert "zerocore.runtime.checkpoint_marks" in IMPORTS["zerocore.checkpoint.load"]  # relative, module level
    assert len(IMPORTS) > 100


def test_low_floors_do_not_import_checkpoint_planner_or_cli():
    upward = {(m, t) for m, targets in IMPORTS.items() if _under(m, LOW) for t in targets if _under(t, HIGH)}
    assert upward - set(ALLOWED) == set(), "lower floors importing higher ones (move the piece down or hand it in)"
    assert set(ALLOWED) - upward == set(), "allowed upward imports that no longer exist: drop them from ALLOWED"


def test_checkpoint_load_and_save_do_not_import_each_other():
    assert "zerocore.checkpoint.save" not in IMPORTS["zerocore.checkpoint.load"]
    assert "zerocore.checkpoint.load" not in IMPORTS["zerocore.checkpoint.save"]


def test_the_command_and_the_planner_command_do_not_import_each_other():
    """``zerocore/cli.py`` registers ``zerocore estimate`` from ``planner/cli.py`` (the dispatcher
    above its subcommands); the planner's command must not reach back up to it."""
    assert not any(_under(t, ("zerocore.cli",)) for t in IMPORTS["zerocore.planner.cli"])
    assert not any(_under(t, ("zerocore.cli",)) for t in IMPORTS["zerocore.checkpoint.cli"])


def test_the_higher_floors_are_handed_in():
    """What the runtime runs above it is provided once ``import zerocore`` has run."""
    from zerocore.runtime import provided

    assert set(provided._PROVIDED) == set(provided.NAMES)


def test_import_zerocore_does_not_import_torch_dynamo():
    """``torch._dynamo`` costs seconds to import and, imported on the caller's stack, leaves a frame
    cycle (runtime/off_stack.py): ``import zerocore`` must not pull it in (the first engine imports it
    on a thread of its own; ``engine.compile()`` needs it anyway). A decorator marking a hook for
    Dynamo at module level once did (sharding/access.py)."""
    import subprocess
    import sys

    code = "import sys, zerocore, zerocore.deepspeed, zerocore.debug; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "False"
