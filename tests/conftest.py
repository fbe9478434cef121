"""Suite-wide settings."""

import pytest

from amprewrite import codegen


@pytest.fixture(autouse=True, scope="session")
def _codegen_checked_against_fx():
    """Every graph amprewrite recompiles in the suite is written both by amprewrite.codegen and
    by torch.fx, and a difference fails the test that made it."""
    codegen.check(True)
    yield
    codegen.check(False)
