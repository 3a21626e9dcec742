"""The owning handle types: Mesh, Graph, Step and Loader.

Each wraps one opaque libctr handle. close() frees it and may be called any number of times;
__del__ calls close() as a safety net, and every handle is a context manager. The C contract
says a step's mesh and graph, and a loader attached to a step, must outlive the step, so a
Step holds references to them and closing one of them while a step still uses it only marks
it closed: the C object is freed when its last user is.

Arrays go in without a copy when they already are C-contiguous and of the dtype libctr reads
(the C call borrows the buffer for its duration only); anything else is converted once.
numpy is optional: without it arrays come back as flat array.array objects.
"""

import array
import ctypes
import json
import os

from ._lib import CtrError, DType, MoeLayerMetrics, Status, StepMetrics

try:
    import numpy as _np
except ImportError:  # numpy is optional; array.array stands in for it
    _np = None

_L = None  # the loaded library, set by the package on import


def _set_lib(lib):
    global _L
    _L = lib


def _enc(s):
    return os.fsencode(s) if isinstance(s, os.PathLike) else str(s).encode("utf-8")


def _dec(b):
    return b.decode("utf-8", "replace") if b is not None else None


# ------------------------------------------------------------------------------------------------
# Options: built from a dict for one call and freed right after it


class _Options:
    """A ctr_options filled from keyword arguments, alive for one `with` block."""

    def __init__(self, values):
        self.ptr = None
        if not values:
            return
        p = ctypes.c_void_p()
        _L.options_create(ctypes.byref(p))
        self.ptr = p
        try:
            for key, value in values.items():
                k = _enc(key)
                # bool first: it is an int subclass, and libctr reads flags as ints.
                if isinstance(value, bool):
                    _L.options_set_int(p, k, int(value))
                elif isinstance(value, int):
                    _L.options_set_int(p, k, value)
                elif isinstance(value, float):
                    _L.options_set_float(p, k, value)
                elif isinstance(value, (str, os.PathLike)):
                    _L.options_set_string(p, k, _enc(value))
                elif _np is not None and isinstance(value, _np.integer):
                    _L.options_set_int(p, k, int(value))
                elif _np is not None and isinstance(value, _np.floating):
                    _L.options_set_float(p, k, float(value))
                else:
                    raise TypeError(f"option {key!r}: value {value!r} is a "
                                    f"{type(value).__name__}; options are int, float or str")
        except BaseException:
            self.close()
            raise

    def close(self):
        if self.ptr is not None:
            _L.options_free(self.ptr)
            self.ptr = None

    def __enter__(self):
        return self.ptr

    def __exit__(self, *exc):
        self.close()


# ------------------------------------------------------------------------------------------------
# Buffers

_NP_DTYPES = {DType.F32: "float32", DType.F64: "float64", DType.I32: "int32", DType.I64: "int64",
              DType.U16: "uint16", DType.U32: "uint32", DType.U8: "uint8", DType.F16: "float16"}
_ARRAY_CODES = {DType.F32: "f", DType.F64: "d", DType.I32: "i", DType.I64: "q", DType.U16: "H",
                DType.U32: "I", DType.U8: "B"}


def _in_buffer(data, dtype):
    """(address, bytes, keepalive) of data as a C-contiguous buffer of dtype.

    keepalive must stay referenced until the C call returns; it is data itself when no
    conversion was needed."""
    if _np is not None and not isinstance(data, array.array):
        want = _np.dtype(_NP_DTYPES[dtype])
        if isinstance(data, (bytes, bytearray, memoryview)):
            # Raw bytes are taken as the tensor's own little-endian encoding.
            data = _np.frombuffer(data, dtype=want.newbyteorder("<"))
        arr = data if isinstance(data, _np.ndarray) else _np.asarray(data)
        if arr.dtype != want or not arr.flags.c_contiguous:
            if arr.dtype.kind == "f" and want.kind in "iu":
                raise TypeError(f"expected integer data ({want}), got {arr.dtype}")
            if arr.dtype.kind in "iu" and want.kind in "iu" and arr.size:
                # Refuse what the conversion would silently wrap (int64 ids into int32).
                lo, hi = _np.iinfo(want).min, _np.iinfo(want).max
                bad = (arr < lo) | (arr > hi)
                if bad.any():
                    i = int(_np.flatnonzero(bad.ravel())[0])
                    raise ValueError(f"value {arr.ravel()[i]} at position {i} does not fit {want}")
            arr = _np.ascontiguousarray(arr, dtype=want)
        return arr.ctypes.data, arr.nbytes, arr
    code = _ARRAY_CODES.get(dtype)
    if code is None:
        raise TypeError(f"dtype {dtype.name} needs numpy")
    if not (isinstance(data, array.array) and data.typecode == code):
        data = array.array(code, data.tolist() if hasattr(data, "tolist") else data)
    addr, n = data.buffer_info()
    return addr, n * data.itemsize, data


def _out_buffer(count, dtype, shape):
    """A new buffer of count elements: (result, address)."""
    if _np is not None:
        arr = _np.empty(shape if shape is not None else (count,), dtype=_NP_DTYPES[dtype])
        return arr, arr.ctypes.data
    code = _ARRAY_CODES[dtype]
    arr = array.array(code, bytes(count * array.array(code).itemsize))
    return arr, arr.buffer_info()[0]


def _numel(shape):
    n = 1
    for d in shape:
        n *= d
    return n


# ------------------------------------------------------------------------------------------------
# Handle base


class _Handle:
    """Owns one C handle. Users (steps) keep it alive past close() until they are closed."""

    _free_fn = None  # name of the _L function that frees this kind of handle
    # Class-level defaults, so that close() from __del__ is harmless on an object whose
    # __init__ failed before the handle existed.
    _ptr = None
    _closed = True
    _users = frozenset()

    def __init__(self, ptr):
        self._ptr = ptr
        self._closed = False
        self._users = set()  # ids of live handles that must be closed before this one is freed

    def close(self):
        """Frees the handle (now, or when the last step using it is closed). Idempotent."""
        self._closed = True
        if not self._users:
            self._release()

    def _release(self):
        if self._ptr is not None and _L is not None:
            ptr, self._ptr = self._ptr, None
            getattr(_L, self._free_fn)(ptr)

    def _add_user(self, user):
        self._users.add(id(user))

    def _drop_user(self, user):
        self._users.discard(id(user))
        if self._closed and not self._users:
            self._release()

    @property
    def closed(self):
        return self._closed

    def _p(self):
        if self._closed or self._ptr is None:
            raise ValueError(f"{type(self).__name__} is closed")
        return self._ptr

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # interpreter shutdown: the library may already be gone
            pass


# ------------------------------------------------------------------------------------------------
# Mesh


class Mesh(_Handle):
    """Who and where: ranks, mesh axes, device. Mesh() is one CPU rank.

    Options (see ctr_mesh_create): device, rank, world, mesh ("dp=2,fsdp=4"), threads."""

    _free_fn = "mesh_free"

    def __init__(self, _from_env=False, **options):
        p = ctypes.c_void_p()
        with _Options(options) as o:
            if _from_env:
                _L.mesh_create_from_env(o, ctypes.byref(p))
            else:
                _L.mesh_create(o, ctypes.byref(p))
        super().__init__(p)

    @classmethod
    def from_env(cls, **options):
        """Rank and world from CTR_RANK/CTR_WORLD_SIZE, torchrun, Slurm or Open MPI variables;
        keyword options override the environment."""
        return cls(_from_env=True, **options)

    @property
    def rank(self):
        return _L.mesh_rank(self._p())

    @property
    def world_size(self):
        return _L.mesh_world_size(self._p())

    def axis_size(self, axis):
        return _L.mesh_axis_size(self._p(), _enc(axis))

    @property
    def data_rank(self):
        """This rank's share of the global batch (ranks of one tp group share one)."""
        return _L.mesh_data_rank(self._p())

    @property
    def data_size(self):
        """How many shares the global batch is split into."""
        return _L.mesh_data_size(self._p())

    @property
    def device(self):
        return _dec(_L.mesh_device(self._p()))

    def async_error(self):
        """The job's failure as this rank knows it (learnt in the background, e.g. a rank
        that stopped sending heartbeats), or None. Safe to call from any thread."""
        msg = ctypes.c_char_p()
        status = _L.mesh_async_error(self._p(), ctypes.byref(msg))
        return None if status == 0 else _dec(msg.value)

    def describe(self):
        """The mesh as a dict: rank, world, axes ([{"name", "size"}] in mesh order), device,
        transport, timeout_s."""
        text = ctypes.c_char_p()
        _L.mesh_describe(self._p(), ctypes.byref(text))
        return json.loads(_dec(text.value))

    def group(self, axis="world"):
        """(this rank's index, size, world ranks of the members) of its group over `axis`
        ("world" or a mesh axis)."""
        r, n = ctypes.c_int(), ctypes.c_int()
        _L.mesh_group(self._p(), _enc(axis), ctypes.byref(r), ctypes.byref(n))
        members = []
        for i in range(n.value):
            w = ctypes.c_int()
            _L.mesh_group_member(self._p(), _enc(axis), i, ctypes.byref(w))
            members.append(w.value)
        return r.value, n.value, members

    # Host collectives: numpy arrays of float32, float64, int32 or int64; blocking, with the
    # mesh's deadline; every member of the group calls the same ones in the same order.
    _REDUCE = {"sum": 0, "avg": 1, "max": 2, "min": 3}

    @staticmethod
    def _host_array(data):
        arr = _np.ascontiguousarray(data)
        for dt, name in _NP_DTYPES.items():
            if arr.dtype == _np.dtype(name):
                return arr, dt
        raise TypeError(f"host collectives take float32, float64, int32 or int64 arrays, not {arr.dtype}")

    def all_reduce(self, data, op="sum", axis="world"):
        """The reduction (sum, avg, max or min) of every member's array, as a new array."""
        arr, dt = self._host_array(data)
        out = _np.empty_like(arr)
        _L.mesh_all_reduce(self._p(), _enc(axis), arr.ctypes.data, out.ctypes.data, arr.size, int(dt),
                           self._REDUCE[op])
        return out

    def all_gather(self, data, axis="world"):
        """Every member's array stacked in member order: shape (size, *data.shape)."""
        arr, _ = self._host_array(data)
        _, n, _ = self.group(axis)
        out = _np.empty((n,) + arr.shape, dtype=arr.dtype)
        _L.mesh_all_gather(self._p(), _enc(axis), arr.ctypes.data, out.ctypes.data, arr.nbytes)
        return out

    def reduce_scatter(self, data, op="sum", axis="world"):
        """This member's block (of size equal blocks of the flattened array) of the reduction."""
        arr, dt = self._host_array(data)
        _, n, _ = self.group(axis)
        if arr.size % n:
            raise ValueError(f"{arr.size} elements do not split into {n} equal blocks")
        out = _np.empty(arr.size // n, dtype=arr.dtype)
        _L.mesh_reduce_scatter(self._p(), _enc(axis), arr.ctypes.data, out.ctypes.data, out.size, int(dt),
                               self._REDUCE[op])
        return out

    def broadcast(self, data, root=0, axis="world"):
        """Member root's array, on every member (data gives the shape and dtype)."""
        out, _ = self._host_array(_np.array(data, copy=True))
        _L.mesh_broadcast(self._p(), _enc(axis), out.ctypes.data, out.nbytes, root)
        return out

    def barrier(self, axis="world"):
        _L.mesh_barrier(self._p(), _enc(axis))

    def __repr__(self):
        if self._closed:
            return "<ctr.Mesh closed>"
        return f"<ctr.Mesh rank {self.rank}/{self.world_size} on {self.device}>"


# ------------------------------------------------------------------------------------------------
# Graph


class TensorInfo(tuple):
    """(dtype, shape) of a graph tensor; -1 in shape marks a symbolic dim (batch, seq)."""

    __slots__ = ()

    def __new__(cls, dtype, shape):
        return super().__new__(cls, (dtype, shape))

    dtype = property(lambda self: self[0])
    shape = property(lambda self: self[1])

    def __repr__(self):
        return f"TensorInfo(dtype={self[0].name}, shape={self[1]})"


class Graph(_Handle):
    """What to train: a verified forward graph. Build with Graph.load, Graph.from_bytes or
    Graph.preset; read-only afterwards, so one graph may serve several steps."""

    _free_fn = "graph_free"

    @classmethod
    def load(cls, path):
        p = ctypes.c_void_p()
        _L.graph_load_file(_enc(path), ctypes.byref(p))
        return cls(p)

    @classmethod
    def from_bytes(cls, data):
        data = bytes(data)
        p = ctypes.c_void_p()
        _L.graph_load_buffer(data, len(data), ctypes.byref(p))  # libctr copies the bytes
        return cls(p)

    @classmethod
    def preset(cls, name, **options):
        """The "gpt" or "llama" preset. Options: layers, dim, heads, kv_heads, vocab, seq,
        ffn_dim, tied, rope_theta, norm_eps, init_std."""
        p = ctypes.c_void_p()
        with _Options(options) as o:
            _L.graph_create_preset(_enc(name), o, ctypes.byref(p))
        return cls(p)

    def save(self, path):
        _L.graph_save_file(self._p(), _enc(path))

    def _names(self, count_fn, name_fn):
        p = self._p()
        out = []
        for i in range(count_fn(p)):
            s = ctypes.c_char_p()
            name_fn(p, i, ctypes.byref(s))
            out.append(_dec(s.value))
        return out

    @property
    def inputs(self):
        """Names of the host inputs, in file order."""
        return self._names(_L.graph_num_inputs, _L.graph_input_name)

    @property
    def params(self):
        """Names of the trained parameters, in file order."""
        return self._names(_L.graph_num_params, _L.graph_param_name)

    def tensor_info(self, name):
        """TensorInfo(dtype, shape) of the named tensor; -1 marks a symbolic dim."""
        return self._tensor_info(self._p(), name)

    @staticmethod
    def _tensor_info(p, name):
        dtype = ctypes.c_int()
        ndim = ctypes.c_size_t()
        _L.graph_tensor_info(p, _enc(name), ctypes.byref(dtype), None, 0, ctypes.byref(ndim))
        dims = (ctypes.c_int64 * max(ndim.value, 1))()
        _L.graph_tensor_info(p, _enc(name), ctypes.byref(dtype), dims, ndim.value,
                             ctypes.byref(ndim))
        try:
            dt = DType(dtype.value)
        except ValueError:
            dt = dtype.value
        return TensorInfo(dt, tuple(dims[i] for i in range(ndim.value)))

    @property
    def param_count(self):
        n = ctypes.c_int64()
        _L.graph_param_count(self._p(), ctypes.byref(n))
        return n.value

    def flops_per_token(self, seq=0):
        """Training FLOPs per token at sequence length seq (0: the graph's maximum)."""
        f = ctypes.c_double()
        _L.graph_flops_per_token(self._p(), seq, ctypes.byref(f))
        return f.value

    def plan(self, world, global_batch, cluster, **options):
        """The planner's layouts of this graph's step on `world` devices of a cluster
        (`cluster`: a profile's JSON text or file path, or a dict), ranked by predicted step
        time: the dict ctr_plan returns ({"plans": [{"mesh", "schedule", "micro_batches",
        "batch", "recompute", "cp_mode", "feasible", "step_ms", "memory_bytes", ...}], ...}).
        world None: the world of the job this process was launched in. Options: seq,
        recompute ("none,all"), top, prune (1: refuse without compiling what memory bounds
        rule out, the default; 0: compile every candidate)."""
        if isinstance(cluster, dict):
            cluster = json.dumps(cluster)
        text = ctypes.c_char_p()
        opts = dict(options, global_batch=global_batch, cluster=str(cluster))
        if world is not None:
            opts["world"] = world
        with _Options(opts) as o:
            _L.plan(self._p(), o, ctypes.byref(text))
        return json.loads(_dec(text.value))

    def inspect(self, after, **options):
        """What step creation makes of this graph up to pass `after` (one of ctr.pass_names()),
        as text: options are the step's compile options plus the mesh of the rank shown (pp, dp,
        ep, fsdp, cp, tp, rank)."""
        text = ctypes.c_char_p()
        with _Options(options) as o:
            _L.graph_inspect(self._p(), o, _enc(after), ctypes.byref(text))
        return _dec(text.value)

    def metadata(self, key):
        """The graph file's metadata entry `key` ("max_seq", "vocab", ...) as a string, or None
        when the graph has none."""
        v = ctypes.c_char_p()
        try:
            _L.graph_metadata(self._p(), _enc(key), ctypes.byref(v))
        except CtrError as e:
            if e.status == Status.NOT_FOUND:
                return None
            raise
        return v.value.decode("utf-8", "replace")

    def __repr__(self):
        if self._closed:
            return "<ctr.Graph closed>"
        return f"<ctr.Graph {len(self.params)} params, {self.param_count:,} elements>"


# ------------------------------------------------------------------------------------------------
# Loader


class Tokens(_Handle):
    """A token file opened as the loader reads it (read-only). format: auto, llmc, npy, u16,
    u32 or bytes; dataset: with a manifest, the index of its sub-dataset to open."""

    _free_fn = "tokens_free"

    def __init__(self, path, format="auto", dataset=None):
        p = ctypes.c_void_p()
        opts = {"format": format}
        if dataset is not None:
            opts["dataset"] = dataset
        with _Options(opts) as o:
            _L.tokens_open(_enc(path), o, ctypes.byref(p))
        super().__init__(p)

    @property
    def info(self):
        """{"name", "kind", "tokens", "max_id", "files": [{"path", "kind", "tokens", "width",
        "header_bytes"}]}"""
        text = ctypes.c_char_p()
        _L.tokens_info(self._p(), ctypes.byref(text))
        return json.loads(_dec(text.value))

    def read(self, start, count):
        """Tokens [start, start + count) as uint32."""
        out, addr = _out_buffer(count, DType.U32, None)
        _L.tokens_read(self._p(), start, count, addr)
        return out

    def samples(self, seq, mode="windows", eot=-1):
        """How many samples of seq inputs the loader cuts from it."""
        n = ctypes.c_int64()
        _L.tokens_samples(self._p(), seq, _enc(mode), eot, ctypes.byref(n))
        return n.value


def manifest_info(path):
    """A manifest's sub-datasets: {"path", "mode", "eot", "datasets": [{"name", "weight",
    "files", "format"}]}."""
    text = ctypes.c_char_p()
    _L.manifest_info(_enc(path), ctypes.byref(text))
    return json.loads(_dec(text.value))


def write_tokens(path, tokens, format="llmc", width=2):
    """Writes tokens (integers) as a token file the loader reads; written as path.tmp and
    renamed when whole."""
    addr, nbytes, keep = _in_buffer(tokens, DType.U32)
    n = nbytes // 4
    w = ctypes.c_void_p()
    _L.token_writer_create(_enc(path), _enc(format), width, n, ctypes.byref(w))
    try:
        _L.token_writer_write(w, addr, n)
        _L.token_writer_finish(w)
    finally:
        _L.token_writer_free(w)
    del keep


class Loader(_Handle):
    """A token source and a seeded loader over it.

    path: an llm.c token file, any other file (read as bytes), or None for the built-in
    synthetic corpus. Options: seq (required), seed, corpus_bytes."""

    _free_fn = "loader_free"

    def __init__(self, path=None, **options):
        if "seq" not in options:
            raise TypeError("Loader() needs seq=")
        self.seq = int(options["seq"])
        p = ctypes.c_void_p()
        with _Options(options) as o:
            _L.loader_create(None if path is None else _enc(path), o, ctypes.byref(p))
        super().__init__(p)

    def next(self, rows):
        """The next `rows` windows: (tokens, targets), each int32 [rows, seq]."""
        shape = (rows, self.seq)
        tokens, tp = _out_buffer(rows * self.seq, DType.I32, shape)
        targets, gp = _out_buffer(rows * self.seq, DType.I32, shape)
        _L.loader_next(self._p(), rows, tp, gp)
        return tokens, targets

    @property
    def info(self):
        """(tokens in the source, largest token id)."""
        n, m = ctypes.c_int64(), ctypes.c_int64()
        _L.loader_info(self._p(), ctypes.byref(n), ctypes.byref(m))
        return n.value, m.value


# ------------------------------------------------------------------------------------------------
# Step

_METRIC_FIELDS = [name for name, _ in StepMetrics._fields_ if name != "size"]


class Resumed(tuple):
    """What Step.resume() loaded: path (the checkpoint directory) and skipped (the damaged
    checkpoints passed over, "DIR: reason" each)."""

    __slots__ = ()

    def __new__(cls, path, skipped):
        return super().__new__(cls, (path, skipped))

    path = property(lambda self: self[0])
    skipped = property(lambda self: self[1])

    def __repr__(self):
        return f"Resumed(path={self.path!r}, skipped={self.skipped!r})"


class Step(_Handle):
    """The compiled training step of `graph` on `mesh`, with its parameters and optimizer state.

    Options (see ctr_step_create): batch (required), seq, micro_batches, seed, lr, min_lr,
    warmup_steps, decay_steps, schedule, beta1, beta2, eps, weight_decay, grad_clip,
    check_finite, reshard_after_forward, keep."""

    _free_fn = "step_free"

    def __init__(self, mesh, graph, **options):
        if not isinstance(mesh, Mesh) or not isinstance(graph, Graph):
            raise TypeError("Step(mesh, graph, **options) takes a ctr.Mesh and a ctr.Graph")
        p = ctypes.c_void_p()
        with _Options(options) as o:
            _L.step_create(mesh._p(), graph._p(), o, ctypes.byref(p))
        super().__init__(p)
        # The C step borrows both: keep them alive, and their C objects, until this closes.
        self.mesh = mesh
        self.graph = graph
        self._loader = None
        mesh._add_user(self)
        graph._add_user(self)
        self._batch = int(options["batch"])
        self._micro = int(options.get("micro_batches", 1))
        self._seq = int(options["seq"]) if options.get("seq") else None

    def _info(self, name):
        # Through the graph's pointer, not its public API: the user may have closed the Graph
        # object, whose C graph lives on for as long as this step does.
        self._p()
        return Graph._tensor_info(self.graph._ptr, name)

    def _release(self):
        super()._release()
        # Only now may what the C step borrowed go.
        for owner in (self.__dict__.get("mesh"), self.__dict__.get("graph"),
                      self.__dict__.get("_loader")):
            if owner is not None:
                owner._drop_user(self)
        self._loader = None

    def set_input(self, name, data):
        """Copies host data into the named input for the next run (micro_batches times the
        input's element count; int32 token ids for token inputs)."""
        info = self._info(name)
        addr, nbytes, keep = _in_buffer(data, info.dtype)
        _L.step_set_input(self._p(), _enc(name), addr, nbytes)
        del keep  # referenced until here: the call borrows the buffer
        if name == "tokens" and self._seq is None and info.dtype == DType.I32:
            self._seq = nbytes // (4 * self._batch * self._micro) or None

    def run(self):
        """Forward, backward and the optimizer update: the step's metrics as a dict."""
        m = StepMetrics()
        m.size = ctypes.sizeof(StepMetrics)
        _L.step_run(self._p(), ctypes.byref(m))
        return {name: getattr(m, name) for name in _METRIC_FIELDS}

    def evaluate(self):
        """Forward only on the inputs last set: the mean loss."""
        loss = ctypes.c_double()
        _L.step_evaluate(self._p(), ctypes.byref(loss))
        return loss.value

    def _param_shape(self, name):
        return self._info(name).shape

    def get_param(self, name):
        """A copy of the named parameter, shaped as in the graph (fp32)."""
        shape = self._param_shape(name)
        out, addr = _out_buffer(_numel(shape), DType.F32, shape)
        _L.step_get_param(self._p(), _enc(name), addr, _numel(shape))
        return out

    def set_param(self, name, data):
        """Sets the named parameter from fp32 data with its element count."""
        addr, nbytes, keep = _in_buffer(data, DType.F32)
        _L.step_set_param(self._p(), _enc(name), addr, nbytes // 4)
        del keep

    def moe_metrics(self):
        """The mixture-of-experts layers of the last run: a list with one dict per layer,
        {"layer", "tokens_per_expert" (summed over micro-batches and ranks), "aux_loss",
        "z_loss"}; empty for a graph without experts."""
        text = ctypes.c_char_p()
        _L.step_moe_metrics(self._p(), ctypes.byref(text))
        return json.loads(_dec(text.value))

    def moe_layers(self):
        """moe_metrics through the struct call (ctr_step_moe_layer): the same dicts, a loss
        the layer lacks left out."""
        out = []
        for i in range(_L.step_moe_layers(self._p())):
            m = MoeLayerMetrics()
            m.size = ctypes.sizeof(MoeLayerMetrics)
            _L.step_moe_layer(self._p(), i, ctypes.byref(m))
            d = {"layer": _dec(m.layer), "tokens_per_expert": [m.tokens_per_expert[e] for e in range(m.experts)]}
            for k in ("aux_loss", "z_loss"):
                v = getattr(m, k)
                if v == v:
                    d[k] = v
            out.append(d)
        return out

    def comm_metrics(self):
        """Milliseconds the last run's collectives were in flight, per mesh axis
        ({"tp": ms, "fsdp": ms, ...}; empty without collectives)."""
        text = ctypes.c_char_p()
        _L.step_comm_metrics(self._p(), ctypes.byref(text))
        return json.loads(_dec(text.value))

    def timeline(self):
        """The tasks of the last run on this rank, in the order they ran: a list of
        {"name", "cat" (forward, backward, weight, recv, optimizer), "stage", "micro_batch",
        "start_us", "dur_us"} (microseconds of the system clock)."""
        text = ctypes.c_char_p()
        _L.step_timeline(self._p(), ctypes.byref(text))
        return json.loads(_dec(text.value))

    def kernel_profile(self):
        """With step option profile_kernels=1: each kernel of this rank's program, as a list of
        {"node", "op", "phase", "flops", "bytes", "runs", "us" (mean per run)} over every run
        but each phase's first."""
        text = ctypes.c_char_p()
        _L.step_kernel_profile(self._p(), ctypes.byref(text))
        return json.loads(_dec(text.value))

    def get_output(self, name, shape=None):
        """A forward activation kept with the step option keep= (e.g. "logits"), as of the
        last run or evaluate (its last micro-batch).

        shape defaults to the graph's declared shape of the tensor with "batch" and "seq"
        bound (seq from the option, else from the tokens last set); pass it explicitly for a
        tensor the graph file declares without a shape."""
        if shape is None:
            info = self._info(name)
            if not info.shape:
                raise ValueError(f"the graph declares no shape for {name!r}: "
                                 f"pass get_output({name!r}, shape=...)")
            symbols = iter((self._batch, self._seq))
            shape = []
            for d in info.shape:
                if d >= 0:
                    shape.append(d)
                    continue
                v = next(symbols, None)  # symbolic dims are batch, then seq
                if v is None:
                    raise ValueError(f"cannot bind the symbolic dims of {name!r}: pass shape=")
                shape.append(v)
        shape = tuple(int(d) for d in shape)
        out, addr = _out_buffer(_numel(shape), DType.F32, shape)
        _L.step_get_output(self._p(), _enc(name), addr, _numel(shape))
        return out

    def set_lr(self, lr):
        """A constant learning rate from the next run on, replacing the schedule."""
        _L.step_set_lr(self._p(), float(lr))

    @property
    def memory(self):
        """Planned bytes: {"arena_bytes", "param_bytes", "optimizer_bytes"}."""
        a, p, o = ctypes.c_int64(), ctypes.c_int64(), ctypes.c_int64()
        _L.step_memory(self._p(), ctypes.byref(a), ctypes.byref(p), ctypes.byref(o))
        return {"arena_bytes": a.value, "param_bytes": p.value, "optimizer_bytes": o.value}

    @property
    def count(self):
        """Optimizer steps taken so far."""
        return _L.step_count(self._p())

    def save(self, path):
        """Saves the whole state (parameters, optimizer, schedule, attached loader) to a
        checkpoint directory."""
        _L.step_save(self._p(), _enc(path))

    def load(self, path):
        """Restores a checkpoint written by save() for the same graph."""
        _L.step_load(self._p(), _enc(path))

    def save_checkpoint(self, root, **options):
        """Saves into root/step_NNNNNNNN (NNNNNNNN = count) and returns that directory.

        Once the save is published (at once, unless the step option async_save is set), root/latest
        names it and all but the `keep` newest step_* directories are removed. Options: keep
        (int, default 3; 0 keeps all). Collective over the mesh."""
        path = ctypes.c_char_p()
        with _Options(options) as o:
            _L.step_save_checkpoint(self._p(), _enc(root), o, ctypes.byref(path))
        return _dec(path.value)

    def resume(self, root, which=None):
        """Restores a checkpoint from a directory of save_checkpoint(): Resumed(path, skipped).

        which None or "latest": the checkpoint root/latest names (else the newest step_*), falling
        back to older ones while a checkpoint is damaged; skipped lists those passed over, one
        "DIR: reason" string each. Otherwise which is a checkpoint name under root or a path.
        Raises CtrError NOT_FOUND when root holds no checkpoint, CHECKPOINT_ERROR when none is
        usable; the step is unchanged then. Collective over the mesh."""
        path, skipped = ctypes.c_char_p(), ctypes.c_char_p()
        _L.step_resume(self._p(), _enc(root), None if which is None else _enc(which),
                       ctypes.byref(path), ctypes.byref(skipped))
        lines = _dec(skipped.value)
        return Resumed(_dec(path.value), lines.split("\n") if lines else [])

    def export_safetensors(self, path):
        _L.step_export_safetensors(self._p(), _enc(path))

    def import_safetensors(self, path, allow_extra=False):
        opts = {"allow_extra": 1} if allow_extra else {}
        with _Options(opts) as o:
            _L.step_import_safetensors(self._p(), _enc(path), o)

    def attach_loader(self, loader):
        """Includes the loader's position in save()/load(); None detaches. The step keeps the
        loader alive while it is attached."""
        if loader is not None and not isinstance(loader, Loader):
            raise TypeError("attach_loader takes a ctr.Loader or None")
        _L.step_attach_loader(self._p(), None if loader is None else loader._p())
        if self._loader is not None:
            self._loader._drop_user(self)
        self._loader = loader
        if loader is not None:
            loader._add_user(self)

    def __repr__(self):
        if self._closed:
            return "<ctr.Step closed>"
        return f"<ctr.Step batch {self._batch}, {self.count} steps taken>"


__all__ = ["CtrError", "DType", "Status", "Mesh", "Graph", "Step", "Loader", "Resumed",
           "TensorInfo"]


def pass_names():
    """The compiler's passes, in the order step creation runs them."""
    out, i = [], 0
    while True:
        name = ctypes.c_char_p()
        try:
            _L.pass_name(i, ctypes.byref(name))
        except CtrError:
            return out
        out.append(_dec(name.value))
        i += 1


def describe_data(path):
    """(name, kind) of a token file or manifest, as the loader would read it."""
    name, kind = ctypes.c_char_p(), ctypes.c_char_p()
    _L.data_describe(_enc(path), ctypes.byref(name), ctypes.byref(kind))
    return _dec(name.value), _dec(kind.value)
