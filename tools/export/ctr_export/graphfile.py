"""Writing .ctrg graph files from Python: the schema's generated code and the serializer.

The file format is graphs/ctr_graph.fbs, a size-prefixed FlatBuffer with identifier "CTRG".
Rather than hand-writing FlatBuffers offsets, the serializer uses the Python code flatc
generates from that schema, so the writer cannot drift from the reader libctr is built with.
The generated code is not kept in the tree: it is produced on first use into a cache
directory keyed by a hash of the schema and the flatc version, and reused after that.

The schema's namespace (ctr.fb) is renamed to ctrg_fb in the copy given to flatc, because a
top-level Python package `ctr` would collide with libctr's Python binding of that name, and
the generated modules import each other by their package name.
"""

import hashlib
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple, Union

FORMAT_VERSION = 1
FILE_IDENTIFIER = b"CTRG"
_PACKAGE = "ctrg_fb"

# Values of the schema's enums (graphs/ctr_graph.fbs); fixed, only ever appended to.
DTYPE = {"F32": 0, "F16": 1, "BF16": 2, "I32": 3, "I64": 4, "U16": 5, "U32": 6, "U8": 7,
         "F64": 8}
ROLE = {"Activation": 0, "Input": 1, "Param": 2, "Const": 3}
INIT = {"Zeros": 0, "Ones": 1, "Normal": 2, "Uniform": 3, "Data": 4}
ATTR = {"Int": 0, "Float": 1, "String": 2, "Ints": 3, "Floats": 4}


class SchemaError(RuntimeError):
    """The schema or flatc could not be found, or flatc failed."""


# ------------------------------------------------------------------------------------------------
# The graph being written, in plain Python types


@dataclass
class TensorDef:
    name: str
    dtype: int = DTYPE["F32"]
    # Each dim is a size or a symbol ("batch", "seq"); None: not declared (libctr infers it).
    dims: Optional[List[Union[int, str]]] = None
    role: int = ROLE["Activation"]
    init: int = INIT["Zeros"]
    data: Optional[bytes] = None
    no_decay: bool = False


@dataclass
class NodeDef:
    op: str
    name: str
    inputs: List[int]
    outputs: List[int]
    attrs: Dict[str, Union[int, float, str, List[int], List[float]]] = field(default_factory=dict)
    block: int = -1


@dataclass
class GraphDef:
    name: str
    tensors: List[TensorDef]
    nodes: List[NodeDef]
    loss: int
    metadata: List[Tuple[str, str]] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------
# Finding the schema and flatc, generating the code


def find_schema() -> str:
    """graphs/ctr_graph.fbs: $CTR_GRAPH_SCHEMA, the source tree around this file, or where
    `meson install` puts it (<prefix>/share/ctr)."""
    env = os.environ.get("CTR_GRAPH_SCHEMA")
    if env:
        if not os.path.isfile(env):
            raise SchemaError(f"CTR_GRAPH_SCHEMA={env} is not a file")
        return env
    here = os.path.dirname(os.path.abspath(__file__))
    candidates = [os.path.abspath(os.path.join(here, "..", "..", "..", "graphs",
                                               "ctr_graph.fbs"))]
    for prefix in (sys.prefix, "/usr/local", "/usr"):
        c = os.path.join(prefix, "share", "ctr", "ctr_graph.fbs")
        if c not in candidates:
            candidates.append(c)
    for c in candidates:
        if os.path.isfile(c):
            return os.path.abspath(c)
    raise SchemaError("cannot find the graph schema ctr_graph.fbs; looked at:\n  " +
                      "\n  ".join(candidates) +
                      "\nset CTR_GRAPH_SCHEMA to its path")


def _flatc() -> str:
    exe = os.environ.get("FLATC") or shutil.which("flatc")
    if not exe:
        raise SchemaError("flatc (the FlatBuffers compiler, a build dependency of libctr) is "
                          "not on PATH; install it (Debian: flatbuffers-compiler) or set FLATC")
    return exe


def _cache_root() -> str:
    env = os.environ.get("CTR_EXPORT_CACHE")
    if env:
        return env
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    root = os.path.join(base, "ctr-export")
    try:
        os.makedirs(root, exist_ok=True)
        if os.access(root, os.W_OK):
            return root
    except OSError:
        pass
    return os.path.join(tempfile.gettempdir(), f"ctr-export-{os.getuid()}")


def _generate(schema: str) -> str:
    """Directory holding the generated package, creating it if needed."""
    with open(schema, "r", encoding="utf-8") as f:
        text = f.read()
    if "namespace ctr.fb;" not in text:
        raise SchemaError(f"{schema}: expected 'namespace ctr.fb;' in the graph schema")
    flatc = _flatc()
    try:
        version = subprocess.run([flatc, "--version"], capture_output=True, text=True,
                                 timeout=60).stdout.strip()
    except OSError as e:
        raise SchemaError(f"cannot run {flatc}: {e}") from None
    key = hashlib.sha256((text + "\0" + version).encode()).hexdigest()[:16]
    out = os.path.join(_cache_root(), f"ctrg-py-{key}")
    if os.path.isfile(os.path.join(out, _PACKAGE, "Graph.py")):
        return out
    os.makedirs(os.path.dirname(out), exist_ok=True)
    # Generate into a private directory and rename it into place, so that concurrent first
    # uses never see a half-written package.
    tmp = tempfile.mkdtemp(prefix="ctrg-py-", dir=os.path.dirname(out))
    try:
        renamed = os.path.join(tmp, "ctr_graph.fbs")
        with open(renamed, "w", encoding="utf-8") as f:
            f.write(text.replace("namespace ctr.fb;", f"namespace {_PACKAGE};"))
        r = subprocess.run([flatc, "--python", "-o", tmp, renamed], capture_output=True,
                           text=True, timeout=300)
        if r.returncode != 0:
            raise SchemaError(f"flatc failed on {schema}:\n{r.stderr or r.stdout}")
        os.remove(renamed)
        try:
            os.rename(tmp, out)
        except OSError:
            if not os.path.isfile(os.path.join(out, _PACKAGE, "Graph.py")):
                raise
    finally:
        if os.path.isdir(tmp):
            shutil.rmtree(tmp, ignore_errors=True)
    return out


_fb = None


def generated():
    """The generated package (ctrg_fb), imported once per process."""
    global _fb
    if _fb is not None:
        return _fb
    root = _generate(find_schema())
    pkg_dir = os.path.join(root, _PACKAGE)
    if _PACKAGE not in sys.modules:
        # Registered under its own name without touching sys.path: the generated modules
        # import each other as `ctrg_fb.X`, which resolves through this entry.
        spec = importlib.util.spec_from_file_location(
            _PACKAGE, os.path.join(pkg_dir, "__init__.py"), submodule_search_locations=[pkg_dir])
        mod = importlib.util.module_from_spec(spec)
        sys.modules[_PACKAGE] = mod
        spec.loader.exec_module(mod)
    names = ["Graph", "Tensor", "Dim", "Init", "Node", "Attr", "KeyValue"]
    _fb = type("ctrg_fb", (), {n: importlib.import_module(f"{_PACKAGE}.{n}") for n in names})
    return _fb


# ------------------------------------------------------------------------------------------------
# Serialization


def _offsets_vector(b, start_fn, offsets):
    start_fn(b, len(offsets))
    for o in reversed(offsets):
        b.PrependUOffsetTRelative(o)
    return b.EndVector()


def serialize(g: GraphDef) -> bytes:
    """The bytes of a .ctrg file holding g."""
    import flatbuffers
    import numpy as np

    fb = generated()
    T, D, I, N, A, K, G = fb.Tensor, fb.Dim, fb.Init, fb.Node, fb.Attr, fb.KeyValue, fb.Graph
    data_bytes = sum(len(t.data or b"") for t in g.tensors)
    b = flatbuffers.Builder(data_bytes + 65536)

    tensors = []
    for t in g.tensors:
        name = b.CreateString(t.name)
        shape = None
        if t.dims is not None:
            dims = []
            for d in t.dims:
                sym = b.CreateString(d) if isinstance(d, str) else None
                D.DimStart(b)
                if sym is None:
                    D.DimAddSize(b, int(d))
                else:
                    D.DimAddSymbol(b, sym)
                dims.append(D.DimEnd(b))
            shape = _offsets_vector(b, T.TensorStartShapeVector, dims)
        data = b.CreateByteVector(t.data) if t.data is not None else None
        I.InitStart(b)
        I.InitAddKind(b, t.init)
        init = I.InitEnd(b)
        T.TensorStart(b)
        T.TensorAddName(b, name)
        T.TensorAddDtype(b, t.dtype)
        if shape is not None:
            T.TensorAddShape(b, shape)
        T.TensorAddRole(b, t.role)
        T.TensorAddInit(b, init)
        if data is not None:
            T.TensorAddData(b, data)
        T.TensorAddNoDecay(b, bool(t.no_decay))
        tensors.append(T.TensorEnd(b))

    nodes = []
    for n in g.nodes:
        attrs = []
        for key in sorted(n.attrs):
            v = n.attrs[key]
            an = b.CreateString(key)
            s = ints = floats = None
            if isinstance(v, bool) or isinstance(v, int):
                kind = ATTR["Int"]
            elif isinstance(v, float):
                kind = ATTR["Float"]
            elif isinstance(v, str):
                kind = ATTR["String"]
                s = b.CreateString(v)
            elif all(isinstance(x, int) for x in v):
                kind = ATTR["Ints"]
                ints = b.CreateNumpyVector(np.asarray(v, dtype="<i8"))
            else:
                kind = ATTR["Floats"]
                floats = b.CreateNumpyVector(np.asarray(v, dtype="<f8"))
            A.AttrStart(b)
            A.AttrAddName(b, an)
            A.AttrAddType(b, kind)
            if kind == ATTR["Int"]:
                A.AttrAddI(b, int(v))
            elif kind == ATTR["Float"]:
                A.AttrAddF(b, float(v))
            elif s is not None:
                A.AttrAddS(b, s)
            elif ints is not None:
                A.AttrAddInts(b, ints)
            elif floats is not None:
                A.AttrAddFloats(b, floats)
            attrs.append(A.AttrEnd(b))
        op = b.CreateString(n.op)
        name = b.CreateString(n.name)
        vin = b.CreateNumpyVector(np.asarray(n.inputs, dtype="<u4"))
        vout = b.CreateNumpyVector(np.asarray(n.outputs, dtype="<u4"))
        vattrs = _offsets_vector(b, N.NodeStartAttrsVector, attrs)
        N.NodeStart(b)
        N.NodeAddOp(b, op)
        N.NodeAddName(b, name)
        N.NodeAddInputs(b, vin)
        N.NodeAddOutputs(b, vout)
        N.NodeAddAttrs(b, vattrs)
        N.NodeAddBlock(b, n.block)
        nodes.append(N.NodeEnd(b))

    meta = []
    for k, v in g.metadata:
        ko, vo = b.CreateString(k), b.CreateString(v)
        K.KeyValueStart(b)
        K.KeyValueAddKey(b, ko)
        K.KeyValueAddValue(b, vo)
        meta.append(K.KeyValueEnd(b))

    name = b.CreateString(g.name)
    vt = _offsets_vector(b, G.GraphStartTensorsVector, tensors)
    vn = _offsets_vector(b, G.GraphStartNodesVector, nodes)
    vm = _offsets_vector(b, G.GraphStartMetadataVector, meta)
    G.GraphStart(b)
    G.GraphAddFormatVersion(b, FORMAT_VERSION)
    G.GraphAddName(b, name)
    G.GraphAddTensors(b, vt)
    G.GraphAddNodes(b, vn)
    G.GraphAddLoss(b, g.loss)
    G.GraphAddMetadata(b, vm)
    root = G.GraphEnd(b)
    b.FinishSizePrefixed(root, FILE_IDENTIFIER)
    return bytes(b.Output())
