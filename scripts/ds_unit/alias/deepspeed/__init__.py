"""``import deepspeed`` answered by ``zerocore.deepspeed`` (only on sys.path while DeepSpeed's unit
tests run against zerocore: see ``scripts/ds_unit/run.py``; never installed).

This stub replaces itself in ``sys.modules`` with ``zerocore.deepspeed`` and installs a finder that
answers ``deepspeed.a.b`` with the module ``zerocore.deepspeed.a.b`` itself (the same object, so
``deepspeed.runtime.engine.DeepSpeedEngine is zerocore.deepspeed.runtime.engine.DeepSpeedEngine``).

A module the face does not have (``deepspeed.pipe``, ``deepspeed.moe.layer``, DeepSpeed's optimizer
classes...) is a *placeholder*: DeepSpeed's shared test files import such names at the top
(``unit/simple_model.py`` imports ``PipelineModule`` and ``MoE`` for every test), so without it no
test of a file could even be collected. A placeholder's names are classes that raise
``HarnessPlaceholder`` (naming the DeepSpeed name) when called or when an attribute is read, and
that no object is an instance of; so a test that only imports them runs, and one that uses them
fails with that name as its first error line. Names missing from a module the face *does* have
stay ImportErrors.
"""
import importlib
import importlib.abc
import importlib.util
import sys
import types

_PREFIX = "zerocore."


class HarnessPlaceholder(NotImplementedError):
    """A DeepSpeed name zerocore.deepspeed does not have was used by a test."""


class _MissingMeta(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise HarnessPlaceholder(f"{cls.__qualname__}.{name}: not in zerocore.deepspeed (harness placeholder)")

    def __call__(cls, *args, **kwargs):
        raise HarnessPlaceholder(f"{cls.__qualname__}: not in zerocore.deepspeed (harness placeholder)")

    def __instancecheck__(cls, obj):
        return False

    def __subclasscheck__(cls, sub):
        return sub is cls


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        cls = _MissingMeta(name, (), {"__qualname__": f"{self.__name__}.{name}", "__module__": self.__name__})
        setattr(self, name, cls)
        return cls


def _face_spec(fullname: str):
    try:
        return importlib.util.find_spec(_PREFIX + fullname)
    except ImportError:
        return None


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path=None, target=None):
        if fullname != "deepspeed" and not fullname.startswith("deepspeed."):
            return None
        face = _face_spec(fullname)
        spec = importlib.util.spec_from_loader(
            fullname, self, is_package=face is None or face.submodule_search_locations is not None)
        spec.loader_state = "placeholder" if face is None else "face"
        return spec

    def create_module(self, spec):
        if spec.loader_state == "face":
            # the face's module itself (module_from_spec then sets its __spec__ to ours: exec_module puts
            # zerocore's back, so the module keeps its own name and identity)
            module = importlib.import_module(_PREFIX + spec.name)
            spec.loader_state = module.__spec__
            return module
        module = _PlaceholderModule(spec.name, "harness placeholder: not in zerocore.deepspeed")
        module.__path__ = []
        module.__zc_placeholder__ = True
        return module

    def exec_module(self, module):
        # a face module already ran under its zerocore name; a placeholder has no code
        if module.__spec__.loader_state != "placeholder":
            module.__spec__ = module.__spec__.loader_state


if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.insert(0, _Alias())
sys.modules[__name__] = importlib.import_module("zerocore.deepspeed")
