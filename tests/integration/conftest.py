"""Fixtures of the pytest files here: the `ctr` tool under test, named by CTR (meson sets it);
without it each test that needs the tool reports a skip."""
import os

import pytest


@pytest.fixture(scope="module")
def ctr():
    path = os.environ.get("CTR")
    if not path:
        pytest.skip("no ctr tool given (CTR)")
    return os.path.abspath(path)
