"""Finding and loading libctr, checking its ABI, and declaring the C functions for ctypes.

Everything that knows about C types lives here; the handle classes in _api.py only call the
functions declared below. Each fallible function gets an errcheck hook that turns a non-zero
ctr_status into CtrError, because ctr_last_error() is only valid until the next libctr call on
the thread: the hook runs immediately after the failing call, before any other Python code
can make one.

The library is looked up, in order, at $CTR_LIBRARY, on the system's search path (ldconfig's
cache, LD_LIBRARY_PATH, what `meson install` wrote), and in the build tree next to this source
tree (build/lib/libctr.so), so the package works both installed and straight from a checkout.
"""

import ctypes
import ctypes.util
import enum
import os
import sys

from . import _abi

# ------------------------------------------------------------------------------------------------
# Status codes and dtypes (the numbers are fixed by the C header and never change)


class Status(enum.IntEnum):
    OK = 0
    INVALID_ARGUMENT = 1
    INVALID_OPTION = 2
    INVALID_GRAPH = 3
    IO_ERROR = 4
    NOT_FOUND = 5
    OUT_OF_MEMORY = 6
    UNSUPPORTED = 7
    INVALID_STATE = 8
    DATA_ERROR = 9
    TIMEOUT = 10
    COMM_ERROR = 11
    NUMERIC_ERROR = 12
    INTERNAL = 13
    CHECKPOINT_ERROR = 14
    DEVICE_ERROR = 15


class DType(enum.IntEnum):
    F32 = 0
    F16 = 1
    BF16 = 2
    I32 = 3
    I64 = 4
    U16 = 5
    U32 = 6
    U8 = 7
    F64 = 8


class CtrError(Exception):
    """A libctr call failed.

    status       the ctr_status code (a Status when the code is known, else a plain int)
    status_name  ctr_status_string(status), e.g. "invalid option"
    message      ctr_last_error() as read right after the failing call; it names the file,
                 tensor, op, option or rank at fault
    function     the C function that failed
    """

    def __init__(self, status, status_name, message, function=""):
        try:
            status = Status(status)
        except ValueError:  # a code appended by a newer library: keep the number
            pass
        self.status = status
        self.status_name = status_name
        self.message = message
        self.function = function
        where = f"{function}: " if function else ""
        super().__init__(f"{where}{status_name}: {message}" if message else f"{where}{status_name}")


# ------------------------------------------------------------------------------------------------
# Finding the library


def _candidates():
    """(description, path or name) pairs to try, in order."""
    env = os.environ.get("CTR_LIBRARY")
    if env:
        # An explicit choice is the only candidate: silently falling back to another copy would
        # hide the mistake the variable was set to avoid.
        return [("$CTR_LIBRARY", env)]
    out = []
    found = ctypes.util.find_library("ctr")
    if found:
        out.append(("the system search path", found))
    # dlopen's own search (LD_LIBRARY_PATH, rpath, ldconfig cache), which find_library does
    # not fully mirror; the soname first, as installed by `meson install`.
    if sys.platform == "darwin":
        out.append(("the system search path", f"libctr.{_abi.ABI_VERSION}.dylib"))
        out.append(("the system search path", "libctr.dylib"))
    else:
        out.append(("the system search path", f"libctr.so.{_abi.ABI_VERSION}"))
        out.append(("the system search path", "libctr.so"))
    # Running from a source checkout: bindings/python/ctr/_lib.py -> <root>/build/lib/.
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__)))))
    for build in ("build",) + tuple(sorted(d for d in _listdir(root)
                                           if d.startswith("build") and d != "build")):
        lib = os.path.join(root, build, "lib", "libctr.so")
        if os.path.exists(lib):
            out.append(("the build tree", lib))
    return out


def _listdir(path):
    try:
        return os.listdir(path)
    except OSError:
        return []


def _open():
    tried = []
    for where, name in _candidates():
        try:
            return ctypes.CDLL(name), name
        except OSError as e:
            tried.append(f"  {name} ({where}): {e}")
    raise ImportError("cannot load libctr; tried:\n" + "\n".join(tried) +
                      "\nset CTR_LIBRARY to the path of libctr.so, install libctr "
                      "(meson install), or build it in the source tree (ninja -C build)")


# ------------------------------------------------------------------------------------------------
# Declarations

c_void_p = ctypes.c_void_p
c_char_p = ctypes.c_char_p
c_size_t = ctypes.c_size_t
c_int = ctypes.c_int
c_int64 = ctypes.c_int64
c_double = ctypes.c_double
P = ctypes.POINTER


class MoeLayerMetrics(ctypes.Structure):
    _fields_ = [
        ("size", c_size_t),
        ("layer", c_char_p),
        ("experts", c_int64),
        ("tokens_per_expert", ctypes.POINTER(c_int64)),
        ("aux_loss", c_double),
        ("z_loss", c_double),
    ]


class StepMetrics(ctypes.Structure):
    """ctr_step_metrics; size is set to sizeof before each call (the struct only grows)."""

    _fields_ = [
        ("size", c_size_t),
        ("step", c_int64),
        ("loss", c_double),
        ("grad_norm", c_double),
        ("lr", c_double),
        ("step_ms", c_double),
        ("forward_ms", c_double),
        ("backward_ms", c_double),
        ("optimizer_ms", c_double),
        ("tokens_per_s", c_double),
        ("tokens", c_int64),
        ("peak_bytes", c_int64),
        ("save_wait_ms", c_double),
        ("compute_ms", c_double),
        ("comm_ms", c_double),
        ("exposed_comm_ms", c_double),
        ("skipped_steps", c_int64),
    ]


# name: (restype, argtypes). A restype of None marks a status-returning call (errcheck'd).
_STATUS = None
_FUNCTIONS = {
    "ctr_version": (c_char_p, []),
    "ctr_abi_version": (c_int, []),
    # ctr_status_string and ctr_last_error are bound by Lib itself (they serve errcheck).
    "ctr_dtype_size": (c_size_t, [c_int]),
    "ctr_options_create": (_STATUS, [P(c_void_p)]),
    "ctr_options_free": ("void", [c_void_p]),
    "ctr_options_set_int": (_STATUS, [c_void_p, c_char_p, c_int64]),
    "ctr_options_set_float": (_STATUS, [c_void_p, c_char_p, c_double]),
    "ctr_options_set_string": (_STATUS, [c_void_p, c_char_p, c_char_p]),
    "ctr_mesh_create": (_STATUS, [c_void_p, P(c_void_p)]),
    "ctr_mesh_create_from_env": (_STATUS, [c_void_p, P(c_void_p)]),
    "ctr_mesh_free": ("void", [c_void_p]),
    "ctr_mesh_rank": (c_int, [c_void_p]),
    "ctr_mesh_world_size": (c_int, [c_void_p]),
    "ctr_mesh_axis_size": (c_int, [c_void_p, c_char_p]),
    "ctr_mesh_data_rank": (c_int, [c_void_p]),
    "ctr_mesh_data_size": (c_int, [c_void_p]),
    "ctr_mesh_device": (c_char_p, [c_void_p]),
    # A status that is a result, not a failure: no errcheck.
    "ctr_mesh_async_error": (c_int, [c_void_p, P(c_char_p)]),
    "ctr_mesh_group": (_STATUS, [c_void_p, c_char_p, P(c_int), P(c_int)]),
    "ctr_mesh_group_member": (_STATUS, [c_void_p, c_char_p, c_int, P(c_int)]),
    "ctr_mesh_all_reduce": (_STATUS, [c_void_p, c_char_p, c_void_p, c_void_p, c_size_t, c_int, c_int]),
    "ctr_mesh_all_gather": (_STATUS, [c_void_p, c_char_p, c_void_p, c_void_p, c_size_t]),
    "ctr_mesh_reduce_scatter": (_STATUS, [c_void_p, c_char_p, c_void_p, c_void_p, c_size_t, c_int, c_int]),
    "ctr_mesh_broadcast": (_STATUS, [c_void_p, c_char_p, c_void_p, c_size_t, c_int]),
    "ctr_mesh_barrier": (_STATUS, [c_void_p, c_char_p]),
    "ctr_mesh_describe": (_STATUS, [c_void_p, P(c_char_p)]),
    "ctr_pass_name": (_STATUS, [c_size_t, P(c_char_p)]),
    "ctr_graph_inspect": (_STATUS, [c_void_p, c_void_p, c_char_p, P(c_char_p)]),
    "ctr_data_describe": (_STATUS, [c_char_p, P(c_char_p), P(c_char_p)]),
    "ctr_tokens_open": (_STATUS, [c_char_p, c_void_p, P(c_void_p)]),
    "ctr_tokens_free": ("void", [c_void_p]),
    "ctr_tokens_info": (_STATUS, [c_void_p, P(c_char_p)]),
    "ctr_tokens_read": (_STATUS, [c_void_p, c_int64, c_int64, c_void_p]),
    "ctr_tokens_samples": (_STATUS, [c_void_p, c_int64, c_char_p, c_int64, P(c_int64)]),
    "ctr_manifest_info": (_STATUS, [c_char_p, P(c_char_p)]),
    "ctr_token_writer_create": (_STATUS, [c_char_p, c_char_p, c_int, c_int64, P(c_void_p)]),
    "ctr_token_writer_write": (_STATUS, [c_void_p, c_void_p, c_int64]),
    "ctr_token_writer_finish": (_STATUS, [c_void_p]),
    "ctr_token_writer_free": ("void", [c_void_p]),
    "ctr_graph_load_file": (_STATUS, [c_char_p, P(c_void_p)]),
    "ctr_graph_load_buffer": (_STATUS, [c_void_p, c_size_t, P(c_void_p)]),
    "ctr_graph_create_preset": (_STATUS, [c_char_p, c_void_p, P(c_void_p)]),
    "ctr_graph_save_file": (_STATUS, [c_void_p, c_char_p]),
    "ctr_graph_free": ("void", [c_void_p]),
    "ctr_graph_num_inputs": (c_size_t, [c_void_p]),
    "ctr_graph_num_params": (c_size_t, [c_void_p]),
    "ctr_graph_input_name": (_STATUS, [c_void_p, c_size_t, P(c_char_p)]),
    "ctr_graph_param_name": (_STATUS, [c_void_p, c_size_t, P(c_char_p)]),
    "ctr_graph_tensor_info": (_STATUS, [c_void_p, c_char_p, P(c_int), P(c_int64), c_size_t,
                                        P(c_size_t)]),
    "ctr_graph_param_count": (_STATUS, [c_void_p, P(c_int64)]),
    "ctr_graph_flops_per_token": (_STATUS, [c_void_p, c_int64, P(c_double)]),
    "ctr_graph_metadata": (_STATUS, [c_void_p, c_char_p, P(c_char_p)]),
    "ctr_plan": (_STATUS, [c_void_p, c_void_p, P(c_char_p)]),
    "ctr_step_kernel_profile": (_STATUS, [c_void_p, P(c_char_p)]),
    "ctr_step_create": (_STATUS, [c_void_p, c_void_p, c_void_p, P(c_void_p)]),
    "ctr_step_free": ("void", [c_void_p]),
    "ctr_step_set_input": (_STATUS, [c_void_p, c_char_p, c_void_p, c_size_t]),
    "ctr_step_run": (_STATUS, [c_void_p, P(StepMetrics)]),
    "ctr_step_evaluate": (_STATUS, [c_void_p, P(c_double)]),
    "ctr_step_get_param": (_STATUS, [c_void_p, c_char_p, c_void_p, c_size_t]),
    "ctr_step_set_param": (_STATUS, [c_void_p, c_char_p, c_void_p, c_size_t]),
    "ctr_step_get_output": (_STATUS, [c_void_p, c_char_p, c_void_p, c_size_t]),
    "ctr_step_moe_metrics": (_STATUS, [c_void_p, P(c_char_p)]),
    "ctr_step_moe_layers": (c_size_t, [c_void_p]),
    "ctr_step_moe_layer": (_STATUS, [c_void_p, c_size_t, P(MoeLayerMetrics)]),
    "ctr_step_comm_metrics": (_STATUS, [c_void_p, P(c_char_p)]),
    "ctr_step_timeline": (_STATUS, [c_void_p, P(c_char_p)]),
    "ctr_step_set_lr": (_STATUS, [c_void_p, c_double]),
    "ctr_step_memory": (_STATUS, [c_void_p, P(c_int64), P(c_int64), P(c_int64)]),
    "ctr_step_count": (c_int64, [c_void_p]),
    "ctr_step_save": (_STATUS, [c_void_p, c_char_p]),
    "ctr_step_load": (_STATUS, [c_void_p, c_char_p]),
    "ctr_step_save_checkpoint": (_STATUS, [c_void_p, c_char_p, c_void_p, P(c_char_p)]),
    "ctr_step_resume": (_STATUS, [c_void_p, c_char_p, c_char_p, P(c_char_p), P(c_char_p)]),
    "ctr_step_export_safetensors": (_STATUS, [c_void_p, c_char_p]),
    "ctr_step_import_safetensors": (_STATUS, [c_void_p, c_char_p, c_void_p]),
    "ctr_loader_create": (_STATUS, [c_char_p, c_void_p, P(c_void_p)]),
    "ctr_loader_free": ("void", [c_void_p]),
    "ctr_loader_next": (_STATUS, [c_void_p, c_int64, c_void_p, c_void_p]),
    "ctr_loader_info": (_STATUS, [c_void_p, P(c_int64), P(c_int64)]),
    "ctr_step_attach_loader": (_STATUS, [c_void_p, c_void_p]),
}


class Lib:
    """The loaded library: one attribute per C function, named without the ctr_ prefix."""

    def __init__(self, cdll, path):
        self.cdll = cdll
        self.path = path
        self._last_error = cdll.ctr_last_error
        self._last_error.restype = c_char_p
        self._last_error.argtypes = []
        self._status_string = cdll.ctr_status_string
        self._status_string.restype = c_char_p
        self._status_string.argtypes = [c_int]
        for name, (restype, argtypes) in _FUNCTIONS.items():
            try:
                fn = getattr(cdll, name)
            except AttributeError:
                # A library of the right ABI lacks this call only while it is being written;
                # everything else keeps working and this one says what is missing when used.
                setattr(self, name[4:], self._missing(name))
                continue
            fn.argtypes = argtypes
            if restype is _STATUS:
                fn.restype = c_int
                fn.errcheck = self._errcheck
            elif restype == "void":
                fn.restype = None
            else:
                fn.restype = restype
            setattr(self, name[4:], fn)

    def _missing(self, name):
        path = self.path

        def call(*_args):
            raise NotImplementedError(f"{name} is not in {path}: this build of libctr does not "
                                      f"have it yet")
        call.__name__ = name
        return call

    def _errcheck(self, status, fn, _args):
        if status != 0:
            # Read the message first: any other libctr call would replace it.
            msg = self._last_error()
            name = self._status_string(status)
            raise CtrError(status, name.decode("utf-8", "replace") if name else str(status),
                           msg.decode("utf-8", "replace") if msg else "", fn.__name__)
        return status

    def status_string(self, status):
        return self._status_string(int(status)).decode("utf-8", "replace")


def load():
    cdll, path = _open()
    try:
        fn = cdll.ctr_abi_version
    except AttributeError:
        raise ImportError(f"{path} is not libctr: it has no ctr_abi_version") from None
    fn.restype = c_int
    fn.argtypes = []
    have = fn()
    want = _abi.ABI_VERSION
    if have != want:
        raise ImportError(f"{path} has libctr ABI version {have}, but this ctr package was "
                          f"written for ABI version {want}; install the matching libctr or "
                          f"ctr package (or point CTR_LIBRARY at a matching libctr.so)")
    return Lib(cdll, path)
