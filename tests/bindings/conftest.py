"""Shared setup of the pytest files of tests/bindings: the source tree's Python binding, the
exporter and the parity helpers (test_parity.py) on the import path, and no __pycache__ left
in the tree. The binding finds libctr through CTR_LIBRARY, which tests/meson.build sets."""
import os
import sys

sys.dont_write_bytecode = True
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
for sub in ("bindings/python", "tools/export", "tests", "tests/bindings"):
    path = os.path.join(ROOT, sub)
    if path not in sys.path:
        sys.path.insert(0, path)
