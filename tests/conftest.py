"""Shared fixtures: every kernel test runs on each ISA path this CPU supports."""
import pytest

from zerocore import ops

SIZES = [1, 7, 15, 16, 17, 63, 1000, 2**20 + 3]


def pytest_generate_tests(metafunc):
    if "isa" in metafunc.fixturenames:
        metafunc.parametrize("isa", ops.supported_isas())


@pytest.fixture
def forced_isa(isa):
    with ops.force_isa(isa):
        yield isa
