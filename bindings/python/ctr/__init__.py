"""Python binding of libctr, the training runtime: ctypes over the C ABI (ctr/ctr.h).

    import ctr
    with ctr.Mesh() as mesh, ctr.Graph.preset("gpt", layers=2, dim=64, heads=4) as graph, \\
         ctr.Step(mesh, graph, batch=4, lr=1e-3) as step:
        step.set_input("tokens", tokens)      # int32 [batch, seq]
        step.set_input("targets", targets)
        print(step.run()["loss"])

Pure Python, no compile step: the package loads libctr.so at import ($CTR_LIBRARY, the
system search path, or the build tree of this source checkout) and refuses, with ImportError,
a library whose ABI version is not the one this binding was written for. Every failing call
raises CtrError with the status and libctr's message naming what was wrong and where.
"""

from . import _abi
from . import _api
from ._lib import CtrError, DType, Status, load as _load

_LIB = _load()
_api._set_lib(_LIB)

from ._api import (Graph, Loader, Mesh, Resumed, Step, TensorInfo, Tokens, describe_data,  # noqa: E402
                   manifest_info, pass_names, write_tokens)

ABI_VERSION = _abi.ABI_VERSION
#: Path or name of the loaded libctr.
library_path = _LIB.path


def version():
    """"MAJOR.MINOR.PATCH" of the loaded library."""
    return _LIB.version().decode()


def abi_version():
    """ABI version of the loaded library (equal to ABI_VERSION, or the import would have
    failed)."""
    return _LIB.abi_version()


def status_string(status):
    """libctr's name of a status code, e.g. "invalid option"."""
    return _LIB.status_string(status)


def dtype_size(dtype):
    """Bytes per element of a DType; 0 for an unknown value."""
    return _LIB.dtype_size(int(dtype))


__all__ = ["ABI_VERSION", "CtrError", "DType", "Graph", "Loader", "Mesh", "Resumed", "Status",
           "Step", "TensorInfo", "Tokens", "abi_version", "describe_data", "dtype_size", "library_path",
           "manifest_info", "pass_names", "status_string", "version", "write_tokens"]
