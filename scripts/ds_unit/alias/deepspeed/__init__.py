"""``import deepspeed`` answered by ``zerocore.deepspeed`` (only on sys.path while DeepSpeed's unit
tests run against zerocore: see ``scripts/ds_unit/run.py``; never installed).

This stub replaces itself in ``sys.modules`` with ``zerocore.deepspeed`` and installs a finder that
answers ``deepspeed.a.b`` from ``zerocore.deepspeed.a.b`` (the same objects, so
``deepspeed.runtime.engine.DeepSpeedEngine is zerocore.deepspeed.runtime.engine.DeepSpeedEngine``).

A module the face does not have (``deepspeed.pipe``, ``deepspeed.moe.layer``, DeepSpeed's optimizer
classes...) is a *placeholder*, and so is a name a face module lacks (DeepSpeed internals such as
``partition_parameters.MultipleAllGatherHandles``): DeepSpeed's test files import such names at the
top (``unit/simple_model.py`` imports ``PipelineModule`` and ``MoE`` for every test), so without them
no test of a file could even be collected. A placeholder name is a class that raises
``HarnessPlaceholder`` (naming the DeepSpeed name) when called or when an attribute is read, and
that no object is an instance of; so a test that only imports it runs, and one that uses it fails
with that name as its first error line. ``import deepspeed.x`` gives a thin module over the face's
``zerocore.deepspeed.x`` (every attribute read from it; only missing names become placeholders).
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


def _placeholder(module: str, name: str) -> type:
    return _MissingMeta(name, (), {"__qualname__": f"{module}.{name}", "__module__": module})


class _PlaceholderModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        cls = _placeholder(self.__name__, name)
        setattr(self, name, cls)
        return cls


class _FaceModule(types.ModuleType):
    """``deepspeed.x``: reads go to ``zerocore.deepspeed.x`` (the same objects); a name it lacks is a
    placeholder. Submodules imported under it are kept here (the face's own attributes stay its own)."""

    def __init__(self, name: str, face):
        super().__init__(name, face.__doc__)
        self.__dict__["_zc_face"] = face
        if hasattr(face, "__path__"):
            self.__path__ = face.__path__
        self.__file__ = getattr(face, "__file__", None)

    def __getattr__(self, name):
        face = self.__dict__["_zc_face"]
        try:
            return getattr(face, name)
        except AttributeError:
            if name.startswith("__"):
                raise
            return _placeholder(self.__name__, name)


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
        if face is None:
            parent, _, child = fullname.rpartition(".")
            owner = sys.modules.get(_PREFIX + parent)  # the face's module, when the parent is one
            if owner is not None and hasattr(owner, child):
                return None  # an attribute of a face module (deepspeed.utils.logger): not a module to make up
        spec = importlib.util.spec_from_loader(
            fullname, self, is_package=face is None or face.submodule_search_locations is not None)
        spec.loader_state = "placeholder" if face is None else "face"
        return spec

    def create_module(self, spec):
        if spec.loader_state == "face":
            return _FaceModule(spec.name, importlib.import_module(_PREFIX + spec.name))
        module = _PlaceholderModule(spec.name, "harness placeholder: not in zerocore.deepspeed")
        module.__path__ = []
        module.__zc_placeholder__ = True
        return module

    def exec_module(self, module):
        pass  # a face module already ran under its zerocore name; a placeholder has no code


if not any(isinstance(f, _Alias) for f in sys.meta_path):
    sys.meta_path.insert(0, _Alias())
sys.modules[__name__] = importlib.import_module("zerocore.deepspeed")
