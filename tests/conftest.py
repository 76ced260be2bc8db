"""Shared fixtures: every kernel test runs on each ISA path this CPU supports.

The tests live in folders named after the package's parts (tests/sharding/, tests/offload/, ...).
The helpers they share (dist_helpers.py, checkpoint_helpers.py, ...) stay here in tests/, and some
test modules reuse another's checks (``from test_stages import check_against_reference``), so
tests/ and each of its test folders go on sys.path: any test imports any helper or test module by
its name, whichever folder it runs from. Rank processes (forked_ranks.py: forked from a server that
starts with this sys.path, after collection) import their test module by that name too, which is why
test file names are unique across the folders (none of them is a package; tests/deepspeed_face/ is,
and is imported as one)."""
import os
import sys

import pytest

from zerocore import ops

_TESTS = os.path.dirname(os.path.abspath(__file__))


def _test_dirs() -> list[str]:
    dirs = [_TESTS]
    for name in sorted(os.listdir(_TESTS)):
        d = os.path.join(_TESTS, name)
        if (os.path.isdir(d) and not name.startswith((".", "_"))
                and not os.path.exists(os.path.join(d, "__init__.py"))):
            dirs.append(d)
    return dirs


for _d in _test_dirs():
    if _d not in sys.path:
        sys.path.append(_d)

SIZES = [1, 7, 15, 16, 17, 63, 1000, 2**20 + 3]


def pytest_generate_tests(metafunc):
    if "isa" in metafunc.fixturenames:
        metafunc.parametrize("isa", ops.supported_isas())


@pytest.fixture
def forced_isa(isa):
    with ops.force_isa(isa):
        yield isa
