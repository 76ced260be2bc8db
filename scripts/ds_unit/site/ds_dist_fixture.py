"""A pytest plugin ``run.py`` loads (``-p ds_dist_fixture``, for both faces): makes DeepSpeed's
``DistributedFixture`` classes fixtures again under this venv's pytest.

DeepSpeed's test copies define a distributed fixture as a class (``class ws4_model_checkpoint(
DistributedFixture)``) that pytest once took for a fixture through its ``_pytestfixturefunction``
attribute; pytest 8.4 and later recognise only ``FixtureFunctionDefinition`` objects, so every test
using one fails with "fixture '...' not found", under DeepSpeed as under zerocore. DeepSpeed's
``tests/conftest.py`` (loaded by pytest from the copy as always) has the other half, a
``pytest_fixture_setup`` hook that runs such a class; here each such class in a test module is
registered (beside it in its module) as a function-scoped fixture of the same name that does what
that hook does: make the class and call it with the fixture's request (which launches its ranks;
its ``run`` arguments are read from the request, as DeepSpeed's launcher always does).
"""
from __future__ import annotations

import pytest


def _as_fixture(cls):
    def dist_fixture(request):
        cls()(request)

    dist_fixture.__name__ = cls.__name__
    dist_fixture.__qualname__ = cls.__name__
    dist_fixture.__module__ = cls.__module__
    return pytest.fixture(name=cls.__name__)(dist_fixture)


@pytest.hookimpl(tryfirst=True)
def pytest_collectstart(collector):
    if not isinstance(collector, pytest.Module):
        return
    try:
        module = collector.obj
    except Exception:  # an import error: pytest reports it when it collects the module
        return
    for name, value in list(vars(module).items()):
        # (vars of the MRO, not getattr: the harness's placeholder classes raise on any other name)
        if (isinstance(value, type) and any(vars(c).get("is_dist_fixture") for c in value.__mro__)
                and value.__name__ == name and value.__module__ == module.__name__
                # its own ``run`` or one of a base it shares (``class baseline_ws2(_baseline)``)
                and any("run" in vars(c) for c in value.__mro__)):
            # beside the class, not over it: its ranks unpickle the class by its module and name
            setattr(module, f"_ds_dist_fixture_{name}", _as_fixture(value))
