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


@pytest.fixture(scope="module")
def python_env(ctr):
    """The environment of a Python host process using the binding of this tree against the
    libctr.so beside the tool (CTR_LIBRARY overrides it); a skip without numpy or that library,
    or in a sanitizer build (its libctr loads into Python only with the ASan runtime preloaded,
    which the bindings suite does)."""
    pytest.importorskip("numpy")
    root = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
    lib = os.environ.get("CTR_LIBRARY") or os.path.join(os.path.dirname(os.path.dirname(ctr)), "lib", "libctr.so")
    if not os.path.exists(lib):
        pytest.skip(f"no libctr.so beside the ctr tool ({lib})")
    if os.environ.get("ASAN_OPTIONS") and not os.environ.get("LD_PRELOAD"):
        pytest.skip("a sanitizer build of libctr loads into Python only with the ASan runtime preloaded "
                    "(the bindings suite does); this test runs in the regular suites")
    return dict(os.environ, CTR_LIBRARY=lib, PYTHONPATH=os.path.join(root, "bindings", "python"))
