"""From a PyTorch module to libctr's graph op set: tracing, shapes, and one converter per op.

How it works:
1. torch.fx traces `loss = loss_fn(module(tokens), targets)` (or `module(tokens, targets)`)
   into a graph of calls. torch.nn modules, and any module whose class names a libctr op in a
   `ctr_op` attribute (the reference models' RMSNorm, Rotary, CausalAttention, SwiGLU), are
   leaves: they appear as one call each instead of being traced into.
2. The traced graph runs twice on concrete inputs: the example inputs, and a copy with one more
   row and one position fewer. Every value is thereby known twice; a dim that differs between
   the runs is symbolic, and it is "batch" or "seq" when it moved exactly as those did. This
   gives every tensor its libctr shape (fixed sizes and the symbols "batch" and "seq") without
   re-implementing torch's shape rules, and shows which Python ints are really sequence
   lengths (for `wpe[:t]`) versus constants.
3. Each call is mapped onto libctr ops (lib/graph/ops.cc) by a converter that also checks the
   op's restrictions there (trailing-suffix broadcasting, softmax over the last dim, ...).
   Host-side computations on shapes (x.shape[1], t <= seq, torch._assert) need no op. Anything
   else is an ExportError naming the op and the line of the model's source that called it.
4. Nodes that the loss and the logits do not depend on are dropped, and the rest is written
   with the module's current weights embedded in the file.
"""

import operator
import os
import re
import traceback
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F

from .graphfile import DTYPE, INIT, ROLE, GraphDef, NodeDef, TensorDef


class ExportError(Exception):
    """The module cannot be written as a libctr graph.

    op    the PyTorch op, function or module at fault ("torch.cumsum", "torch.nn.Conv1d")
    file, line, code   where the model's source calls it (None when unknown)
    """

    def __init__(self, message, op=None, file=None, line=None, code=None):
        self.op = op
        self.file = file
        self.line = line
        self.code = code
        super().__init__(message)


# ------------------------------------------------------------------------------------------------
# Tracing


class _Tracer(fx.Tracer):
    """fx.Tracer that keeps stack traces, knows ctr_op leaves and records module scopes."""

    def __init__(self):
        super().__init__()
        self.record_stack_traces = True
        self._scope: List[str] = []

    def trace(self, root, concrete_args=None):
        # torch.arange(t) with a traced t (nanoGPT's position ids) is a factory call that fx
        # cannot see, as it has no tensor argument: route it through a proxy while tracing.
        orig = torch.arange

        def arange(*args, **kwargs):
            for a in list(args) + list(kwargs.values()):
                if isinstance(a, fx.Proxy):
                    return a.tracer.create_proxy("call_function", orig, args, kwargs)
            return orig(*args, **kwargs)
        torch.arange = arange
        try:
            return super().trace(root, concrete_args)
        finally:
            torch.arange = orig

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(getattr(type(m), "ctr_op", None), str):
            return True
        return super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        self._scope.append(self.path_of_module(m))
        try:
            return super().call_module(m, forward, args, kwargs)
        finally:
            self._scope.pop()

    def create_node(self, *args, **kwargs):
        node = super().create_node(*args, **kwargs)
        # The module path the call was made in: gives node names and the block index.
        node.meta["ctr_scope"] = self._scope[-1] if self._scope else ""
        return node


class _Training(nn.Module):
    """What is exported: the model plus its loss, as one module with inputs tokens, targets."""

    def __init__(self, model: nn.Module, loss_fn: Optional[Callable]):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, tokens, targets):
        if self.loss_fn is None:
            return self.model(tokens, targets)
        out = self.model(tokens)
        return out, self.loss_fn(out, targets)


class _TMeta:
    """A tensor as seen in a concrete run: only its shape and dtype are kept."""

    __slots__ = ("shape", "dtype")

    def __init__(self, t: torch.Tensor):
        self.shape = tuple(t.shape)
        self.dtype = t.dtype


def _summarize(v):
    if isinstance(v, torch.Tensor):
        return _TMeta(v)
    if isinstance(v, (tuple, list)):
        return type(v)(_summarize(x) for x in v)
    return v


def _has_tensor(v) -> bool:
    if isinstance(v, (torch.Tensor, _TMeta)):
        return True
    if isinstance(v, (tuple, list)):
        return any(_has_tensor(x) for x in v)
    if isinstance(v, dict):
        return any(_has_tensor(x) for x in v.values())
    return False


class _Recorder(fx.Interpreter):
    """Runs the traced graph and keeps a summary of every node's value."""

    def __init__(self, gm):
        super().__init__(gm)
        self.values: Dict[fx.Node, Any] = {}

    def run_node(self, n):
        r = super().run_node(n)
        self.values[n] = _summarize(r)
        return r


# ------------------------------------------------------------------------------------------------
# Values during conversion


class _T:
    """A libctr tensor: index in the file, libctr dtype, shapes in the two runs."""

    __slots__ = ("idx", "dtype", "s1", "s2")

    def __init__(self, idx, dtype, s1, s2):
        self.idx, self.dtype, self.s1, self.s2 = idx, dtype, tuple(s1), tuple(s2)

    @property
    def rank(self):
        return len(self.s1)

    def dim(self, i):
        return (self.s1[i], self.s2[i])


class _Lazy:
    """A parameter or buffer read with get_attr: becomes a file tensor when an op uses it."""

    __slots__ = ("value", "qualname")

    def __init__(self, value, qualname):
        self.value, self.qualname = value, qualname


class _Positions:
    """torch.arange(t) for a symbolic t: position ids, usable only to index an embedding."""

    __slots__ = ("like", "axis")

    def __init__(self, like, axis):
        self.like, self.axis = like, axis


_F32, _I32 = DTYPE["F32"], DTYPE["I32"]
_INT_TYPES = (torch.int64, torch.int32, torch.int16, torch.uint8, torch.int8)


def _torch_dtype(dt: torch.dtype) -> Optional[int]:
    if dt == torch.float32:
        return _F32
    if dt in _INT_TYPES:
        return _I32  # token ids: libctr keeps them as int32
    return None


# ------------------------------------------------------------------------------------------------
# Naming ops and source lines for messages

_FRAME = re.compile(r'File "([^"]+)", line (\d+), in ([^\n]+)\n(?:    ([^\n]*)\n)?')
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_OWN_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep


def _user_frame(node: fx.Node):
    """(file, line, code) of the innermost frame outside torch and this package."""
    st = node.stack_trace or ""
    for m in _FRAME.finditer(st):
        path = os.path.abspath(m.group(1))
        if path.startswith(_TORCH_DIR) or path.startswith(_OWN_DIR):
            continue
        return path, int(m.group(2)), (m.group(4) or "").strip()
    return None, None, None


def _raising_frame(exc: BaseException):
    """(file, line, code) of the innermost model frame in an exception's traceback."""
    found = (None, None, None)
    for fs in traceback.extract_tb(exc.__traceback__):
        path = os.path.abspath(fs.filename)
        if not (path.startswith(_TORCH_DIR) or path.startswith(_OWN_DIR)):
            found = (path, fs.lineno, (fs.line or "").strip())
    return found


def _op_name(node: fx.Node, module: Optional[nn.Module] = None) -> str:
    if node.op == "call_module":
        cls = type(module) if module is not None else None
        if cls is None:
            return str(node.target)
        if cls.__module__.startswith("torch.nn") and getattr(nn, cls.__name__, None) is cls:
            return f"torch.nn.{cls.__name__}"
        return f"{cls.__module__}.{cls.__qualname__}"
    if node.op == "call_method":
        return f"Tensor.{node.target}"
    t = node.target
    name = getattr(t, "__name__", str(t))
    for prefix, ns in (("torch", torch), ("torch.nn.functional", F), ("operator", operator)):
        if getattr(ns, name, None) is t:
            return f"{prefix}.{name}"
    mod = getattr(t, "__module__", None)
    return f"{mod}.{name}" if mod else name


# ------------------------------------------------------------------------------------------------
# The converter


class _Converter:
    def __init__(self, model: nn.Module, gm: fx.GraphModule, runs, sizes, no_decay):
        self.model = model
        self.gm = gm
        self.v1, self.v2 = runs
        (self.B1, self.T1), (self.B2, self.T2) = sizes
        self.no_decay = no_decay
        self.tensors: List[TensorDef] = []
        self.nodes: List[NodeDef] = []
        self.env: Dict[fx.Node, Any] = {}
        self.inputs: List[_T] = []
        self.taken = set()
        self.params: Dict[int, _T] = {}
        self.consts: Dict[Any, _T] = {}  # scalars by value, ("ones", n) vectors
        self.names: Dict[int, str] = {}
        for n, p in model.named_parameters():
            self.names.setdefault(id(p), n)
        for n, b in model.named_buffers():
            self.names.setdefault(id(b), n)
        self.positional_rows: List[int] = []
        self.current: Optional[fx.Node] = None

    # --- errors ----------------------------------------------------------------------------

    def fail(self, why: str, node: Optional[fx.Node] = None, op: Optional[str] = None):
        node = node or self.current
        module = None
        if node is not None and node.op == "call_module":
            module = self.gm.get_submodule(node.target)
        op = op or (_op_name(node, module) if node is not None else None)
        file, line, code = _user_frame(node) if node is not None else (None, None, None)
        where = f" at {file}:{line}" if file else ""
        src = f"\n    {code}" if code else ""
        raise ExportError(f"cannot export {op}{where}: {why}{src}", op=op, file=file, line=line,
                          code=code)

    # --- dims ------------------------------------------------------------------------------

    def classify(self, d1: int, d2: int):
        """A size, "batch", "seq", "batch*seq", or "?" (symbolic, some other expression)."""
        if d1 == d2:
            return d1
        if (d1, d2) == (self.B1, self.B2):
            return "batch"
        if (d1, d2) == (self.T1, self.T2):
            return "seq"
        if (d1, d2) == (self.B1 * self.T1, self.B2 * self.T2):
            return "batch*seq"
        return "?"

    def dims_of(self, s1, s2):
        """Declared dims when every dim is a size or a lone symbol, else None (undeclared)."""
        out = []
        for d1, d2 in zip(s1, s2):
            c = self.classify(d1, d2)
            if c not in ("batch", "seq") and not isinstance(c, int):
                return None
            out.append(c)
        return out

    def shape_str(self, s1, s2):
        return "[" + ", ".join(str(self.classify(a, b)) for a, b in zip(s1, s2)) + "]"

    # --- file tensors and nodes -------------------------------------------------------------

    def unique(self, name: str) -> str:
        base, k = name, 1
        while name in self.taken:
            k += 1
            name = f"{base}:{k}"
        self.taken.add(name)
        return name

    def add_tensor(self, name, dtype, s1, s2, role=ROLE["Activation"], data=None,
                   no_decay=False, declare=True) -> _T:
        dims = self.dims_of(s1, s2) if declare else None
        t = TensorDef(name=self.unique(name), dtype=dtype, dims=dims, role=role,
                      init=INIT["Data"] if data is not None else INIT["Zeros"], data=data,
                      no_decay=no_decay)
        self.tensors.append(t)
        return _T(len(self.tensors) - 1, dtype, s1, s2)

    def out_name(self, node: fx.Node) -> str:
        scope = self.scope(node)
        if node.op == "call_module":
            return self.strip(str(node.target))
        return f"{scope}.{node.name}" if scope else node.name

    def scope(self, node: fx.Node) -> str:
        return self.strip(node.meta.get("ctr_scope", ""))

    @staticmethod
    def strip(path: str) -> str:
        # Everything is traced inside _Training, whose submodule is called "model".
        if path == "model":
            return ""
        return path[len("model."):] if path.startswith("model.") else path

    def block(self, node: fx.Node) -> int:
        path = self.scope(node)
        m = re.search(r"(?:^|\.)(\d+)(?:\.|$)", path)
        return int(m.group(1)) if m else -1

    def emit(self, op: str, inputs: List[_T], s1, s2, attrs=None, dtype=_F32,
             node: Optional[fx.Node] = None, suffix: str = "") -> _T:
        node = node or self.current
        out = self.add_tensor(self.out_name(node) + suffix, dtype, s1, s2)
        self.nodes.append(NodeDef(op=op, name=self.tensors[out.idx].name, inputs=[
            t.idx for t in inputs], outputs=[out.idx], attrs=dict(attrs or {}),
            block=self.block(node)))
        return out

    def emit_like(self, op, inputs, node, attrs=None, dtype=_F32, suffix=""):
        """Emits op whose output has the node's own shape in both runs."""
        m1, m2 = self.v1[node], self.v2[node]
        return self.emit(op, inputs, m1.shape, m2.shape, attrs, dtype, node, suffix)

    # --- reading arguments ------------------------------------------------------------------

    def host(self, a, run: int):
        """The concrete value of argument a (nodes replaced by their value in run 1 or 2)."""
        vals = self.v1 if run == 1 else self.v2
        if isinstance(a, fx.Node):
            return vals[a]
        if isinstance(a, (tuple, list)):
            return type(a)(self.host(x, run) for x in a)
        if isinstance(a, slice):
            return slice(self.host(a.start, run), self.host(a.stop, run), self.host(a.step, run))
        if isinstance(a, dict):
            return {k: self.host(v, run) for k, v in a.items()}
        return a

    def const_arg(self, a, what: str):
        """An argument that must be the same constant in both runs (an axis, an eps)."""
        v1, v2 = self.host(a, 1), self.host(a, 2)
        if _has_tensor(v1):
            self.fail(f"{what} must be a constant, not a tensor")
        if v1 != v2:
            self.fail(f"{what} depends on the batch or sequence size ({v1} vs {v2})")
        return v1

    def is_tensor_arg(self, a) -> bool:
        if isinstance(a, _T):
            return True
        if isinstance(a, fx.Node):
            v = self.env.get(a)
            return isinstance(v, (_T, _Lazy, _Positions)) or isinstance(self.v1.get(a), _TMeta)
        return isinstance(a, torch.Tensor)

    def tensor(self, a, what: str = "input") -> _T:
        """The file tensor of an argument: an fx node's value, a parameter, or a constant."""
        if isinstance(a, _T):
            return a
        v = self.env.get(a) if isinstance(a, fx.Node) else None
        if isinstance(v, _T):
            return v
        if isinstance(v, _Lazy):
            return self.param(v.value, v.qualname)
        if isinstance(v, _Positions):
            self.fail("torch.arange(seq) position ids can only index an embedding table")
        if isinstance(a, torch.Tensor):
            return self.param(a, "")
        if isinstance(a, (int, float)):
            return self.scalar(float(a))
        self.fail(f"{what} is not a tensor this exporter can represent")

    def param(self, p: torch.Tensor, qualname: str) -> _T:
        """The file tensor of a parameter or buffer, with its current value embedded."""
        key = id(p)
        if key in self.params:
            return self.params[key]
        name = self.names.get(key) or self.strip(qualname) or f"const.{len(self.params)}"
        if p.dtype != torch.float32:
            self.fail(f"tensor '{name}' is {p.dtype}; libctr parameters and constants are "
                      f"float32 (convert the model with .float())")
        data = p.detach().to("cpu").contiguous().numpy().astype("<f4").tobytes()
        trained = isinstance(p, nn.Parameter) and p.requires_grad
        no_decay = bool(self.no_decay(name, p)) if trained else False
        # A frozen parameter or a buffer is data the step reads but never updates.
        t = self.add_tensor(name, _F32, tuple(p.shape), tuple(p.shape),
                            role=ROLE["Param"] if trained else ROLE["Const"], data=data,
                            no_decay=no_decay)
        self.params[key] = t
        return t

    def scalar(self, value: float) -> _T:
        """A float32 scalar constant (shape []), broadcast by add and mul."""
        if value not in self.consts:
            data = torch.tensor(value, dtype=torch.float32).numpy().astype("<f4").tobytes()
            self.consts[value] = self.add_tensor(f"const.{value!r}", _F32, (), (),
                                                 role=ROLE["Const"], data=data)
        return self.consts[value]

    def ones(self, n: int) -> _T:
        key = ("ones", n)
        if key not in self.consts:
            data = torch.ones(n).numpy().astype("<f4").tobytes()
            self.consts[key] = self.add_tensor(f"const.ones{n}", _F32, (n,), (n,),
                                               role=ROLE["Const"], data=data)
        return self.consts[key]

    def need_f32(self, t: _T, what="input"):
        if t.dtype != _F32:
            self.fail(f"{what} is an integer tensor; this op takes float32")

    def axis(self, d: int, rank: int) -> int:
        d = int(d)
        return d + rank if d < 0 else d

    def find_dim(self, d1, d2):
        """(input tensor, axis) of a host input having a dim that moved as (d1, d2) did."""
        for t in self.inputs:
            for i in range(t.rank):
                if t.dim(i) == (d1, d2):
                    return t, i
        return None

    # --- the walk -----------------------------------------------------------------------------

    def run(self):
        outputs = None
        for node in self.gm.graph.nodes:
            self.current = node
            if node.op == "placeholder":
                m1, m2 = self.v1[node], self.v2[node]
                if not isinstance(m1, _TMeta) or m1.dtype not in _INT_TYPES or len(m1.shape) != 2:
                    self.fail(f"input '{node.target}' must be a [batch, seq] integer tensor",
                              op=str(node.target))
                t = self.add_tensor(str(node.target), _I32, m1.shape, m2.shape,
                                    role=ROLE["Input"])
                if self.tensors[t.idx].dims != ["batch", "seq"]:
                    self.fail(f"input '{node.target}' must be [batch, seq]", op=str(node.target))
                self.inputs.append(t)
                self.env[node] = t
            elif node.op == "get_attr":
                v = self.gm
                for part in str(node.target).split("."):
                    v = getattr(v, part)
                if isinstance(v, torch.Tensor):
                    self.env[node] = _Lazy(v, str(node.target))
            elif node.op in ("call_function", "call_method", "call_module"):
                r = self.v1[node]
                if not _has_tensor(r):
                    # Host arithmetic on shapes and checks: evaluated, nothing to emit — unless
                    # it reads tensor data, which a graph cannot do at trace time.
                    if node.op == "call_method" and node.target in ("item", "tolist", "numpy"):
                        self.fail("reads tensor values on the host")
                    continue
                self.env[node] = self.convert(node)
            elif node.op == "output":
                outputs = node.args[0]
        return outputs

    def convert(self, node: fx.Node):
        if node.op == "call_module":
            m = self.gm.get_submodule(str(node.target))
            op = getattr(type(m), "ctr_op", None)
            if isinstance(op, str):
                fn = LEAF_OPS.get(op)
                if fn is None:
                    self.fail(f"ctr_op '{op}' is not an op this exporter maps "
                              f"(known: {', '.join(sorted(LEAF_OPS))})")
                return fn(self, node, m)
            for cls, fn in MODULES:
                if type(m) is cls:
                    return fn(self, node, m)
            self.fail("this module has no equivalent in libctr's graph op set")
        if node.op == "call_method":
            fn = METHODS.get(str(node.target))
        else:
            fn = FUNCTIONS.get(node.target)
        if fn is None:
            self.fail("this op has no equivalent in libctr's graph op set")
        return fn(self, node)

    # --- finishing ----------------------------------------------------------------------------

    def finish(self, outputs, name: str, metadata) -> GraphDef:
        flat = _output_nodes(outputs)
        tensors = [(n, self.env.get(n)) for n in flat if isinstance(self.env.get(n), _T)]
        losses = [(n, t) for n, t in tensors if t.rank == 0 and t.dtype == _F32]
        if not losses:
            raise ExportError("the module returned no scalar loss: return (logits, loss), or "
                              "pass loss_fn(output, targets)")
        loss_node, loss = losses[-1]
        logits = next((t for n, t in tensors if t is not loss and t.rank >= 2 and
                       t.dtype == _F32), None)
        keep = [loss.idx] + ([logits.idx] if logits is not None else [])
        # Give the two outputs the names libctr's presets use ("keep=logits" works on both).
        for t, want in ((loss, "loss"), (logits, "logits")):
            if t is not None and self.tensors[t.idx].role == ROLE["Activation"]:
                self.taken.discard(self.tensors[t.idx].name)
                for other in self.tensors:
                    if other.name == want:  # free the name for the output
                        other.name = self.unique(want + ".orig")
                self.tensors[t.idx].name = want
                self.taken.add(want)
        return self.prune(name, keep, loss.idx, metadata)

    def prune(self, name, keep, loss_idx, metadata) -> GraphDef:
        """Drops nodes nothing kept depends on, then unused tensors, and renumbers."""
        producer = {}
        for i, n in enumerate(self.nodes):
            for o in n.outputs:
                producer[o] = i
        live_nodes, live_t = set(), set(keep)
        stack = list(keep)
        while stack:
            t = stack.pop()
            i = producer.get(t)
            if i is None or i in live_nodes:
                continue
            live_nodes.add(i)
            for x in self.nodes[i].inputs:
                if x not in live_t:
                    live_t.add(x)
                    stack.append(x)
        live_t.update(t.idx for t in self.inputs)
        # File order: inputs, parameters in the module's order, constants, activations.
        rank = {ROLE["Input"]: 0, ROLE["Param"]: 1, ROLE["Const"]: 2, ROLE["Activation"]: 3}
        param_order = {n: i for i, n in enumerate(self.names.values())}
        order = sorted(live_t, key=lambda i: (rank[self.tensors[i].role],
                                              param_order.get(self.tensors[i].name, 1 << 30)
                                              if self.tensors[i].role == ROLE["Param"] else i))
        remap = {old: new for new, old in enumerate(order)}
        tensors = [self.tensors[i] for i in order]
        nodes = []
        for i in sorted(live_nodes):
            n = self.nodes[i]
            nodes.append(NodeDef(n.op, n.name, [remap[x] for x in n.inputs],
                                 [remap[x] for x in n.outputs], n.attrs, n.block))
        return GraphDef(name=name, tensors=tensors, nodes=nodes, loss=remap[loss_idx],
                        metadata=list(metadata))


def _output_nodes(outputs) -> List[fx.Node]:
    """The fx nodes of a graph's output structure (tuples, lists, dicts), in order."""
    flat: List[fx.Node] = []

    def walk(a):
        if isinstance(a, fx.Node):
            flat.append(a)
        elif isinstance(a, (tuple, list)):
            for x in a:
                walk(x)
        elif isinstance(a, dict):
            for x in a.values():
                walk(x)
    walk(outputs)
    return flat


# ------------------------------------------------------------------------------------------------
# Argument binding for calls whose signature is known


def _bind(c: _Converter, node: fx.Node, names: List[str], defaults: Dict[str, Any]):
    """Maps a call's args and kwargs onto names; for call_method, names[0] is self."""
    out = dict(defaults)
    args = list(node.args)
    if len(args) > len(names):
        c.fail(f"unexpected number of arguments ({len(args)})")
    for n, a in zip(names, args):
        out[n] = a
    for k, v in node.kwargs.items():
        if k not in names and k not in defaults:
            c.fail(f"unsupported argument '{k}'")
        out[k] = v
    missing = [n for n in names if n not in out]
    if missing:
        c.fail(f"missing argument '{missing[0]}'")
    return out


def _alias(c: _Converter, a) -> Any:
    v = c.env.get(a) if isinstance(a, fx.Node) else None
    if v is None:
        return c.tensor(a)
    return v


# ------------------------------------------------------------------------------------------------
# Converters: functions and methods


def _linear(c, x, w, b, node):
    x, w = c.tensor(x, "input"), c.tensor(w, "weight")
    c.need_f32(x)
    if w.rank != 2 or w.s1[1] != x.s1[-1]:
        c.fail(f"weight {c.shape_str(w.s1, w.s2)} does not match the input's last dim "
               f"{x.s1[-1]}")
    inputs = [x, w]
    if b is not None:
        bias = c.tensor(b, "bias")
        if bias.s1 != (w.s1[0],):
            c.fail(f"bias {c.shape_str(bias.s1, bias.s2)} does not match weight rows {w.s1[0]}")
        inputs.append(bias)
    s1, s2 = x.s1[:-1] + (w.s1[0],), x.s2[:-1] + (w.s1[0],)
    return c.emit("linear", inputs, s1, s2, node=node)


def f_linear(c, node):
    a = _bind(c, node, ["input", "weight"], {"bias": None})
    return _linear(c, a["input"], a["weight"], a["bias"], node)


def _transposed_2d(c, n) -> Optional[fx.Node]:
    """If fx node n is w.t() / w.T / w.transpose(0, 1) of a 2-D tensor, the node of w."""
    if not isinstance(n, fx.Node):
        return None
    base = None
    if n.op == "call_method" and n.target == "t" and len(n.args) == 1:
        base = n.args[0]
    elif n.op == "call_function" and n.target is torch.t:
        base = n.args[0]
    elif n.op == "call_function" and n.target is getattr and n.args[1] in ("T", "mT"):
        base = n.args[0]
    elif (n.op == "call_method" and n.target == "transpose") or \
            (n.op == "call_function" and n.target is torch.transpose):
        if len(n.args) == 3 and not isinstance(n.args[1], fx.Node) and \
                sorted(int(d) % 2 for d in n.args[1:3]) == [0, 1]:
            base = n.args[0]
    elif n.op == "call_method" and n.target == "permute":
        dims = n.args[1:] if len(n.args) > 2 else n.args[1]
        if tuple(dims) in ((1, 0), (-1, -2), (1, -2), (-1, 0)):
            base = n.args[0]
    if base is None or not isinstance(base, fx.Node):
        return None
    m = c.v1.get(base)
    return base if isinstance(m, _TMeta) and len(m.shape) == 2 else None


def f_matmul(c, node):
    a_node, b_node = node.args[0], node.args[1]
    w = _transposed_2d(c, b_node)
    if w is not None:
        # x @ W.t() is libctr's linear(x, W): no transposed copy, and W's gradient comes out
        # in W's own layout.
        return _linear(c, a_node, w, None, node)
    a, b = c.tensor(a_node), c.tensor(b_node)
    c.need_f32(a)
    c.need_f32(b)
    if a.rank < 2 or b.rank < 2:
        c.fail("matmul needs matrices (rank >= 2) on both sides")
    if b.rank != 2 and (b.rank != a.rank or a.s1[:-2] != b.s1[:-2] or a.s2[:-2] != b.s2[:-2]):
        c.fail(f"matmul of {c.shape_str(a.s1, a.s2)} and {c.shape_str(b.s1, b.s2)}: libctr's "
               f"matmul takes a 2-D right side or equal batch dims, not broadcasting")
    return c.emit_like("matmul", [a, b], node)


def _binary(c, node, op, a, b):
    """add / mul with libctr's broadcast rule: b's shape is a trailing part of a's."""
    ta, tb = c.is_tensor_arg(a), c.is_tensor_arg(b)
    if not ta and not tb:
        c.fail("neither side is a tensor")
    if not tb:
        x = c.tensor(a)
        c.need_f32(x)
        return c.emit_like(op, [x, c.scalar(float(c.const_arg(b, "scalar")))], node)
    if not ta:
        x = c.tensor(b)
        c.need_f32(x)
        return c.emit_like(op, [x, c.scalar(float(c.const_arg(a, "scalar")))], node)
    x, y = c.tensor(a), c.tensor(b)
    c.need_f32(x)
    c.need_f32(y)

    def suffix(p, q):
        return len(q.s1) <= len(p.s1) and p.s1[len(p.s1) - len(q.s1):] == q.s1 and \
            p.s2[len(p.s2) - len(q.s2):] == q.s2
    if not suffix(x, y):
        if suffix(y, x):
            x, y = y, x  # both ops commute
        else:
            c.fail(f"broadcasting {c.shape_str(x.s1, x.s2)} with {c.shape_str(y.s1, y.s2)}: "
                   f"libctr's {op} broadcasts only a trailing part of the shape")
    return c.emit_like(op, [x, y], node)


def f_add(c, node):
    a = _bind(c, node, ["input", "other"], {"alpha": 1})
    if a["alpha"] != 1:
        c.fail("add with alpha != 1")
    return _binary(c, node, "add", a["input"], a["other"])


def f_mul(c, node):
    a = _bind(c, node, ["input", "other"], {})
    return _binary(c, node, "mul", a["input"], a["other"])


def f_sub(c, node):
    a = _bind(c, node, ["input", "other"], {"alpha": 1})
    if a["alpha"] != 1:
        c.fail("sub with alpha != 1")
    x, y = a["input"], a["other"]
    if not c.is_tensor_arg(y):
        return _binary(c, node, "add", x, -float(c.const_arg(y, "scalar")))
    # x - y = x + (-1 * y): libctr has no sub op, and multiplying by -1 is exact.
    ty = c.tensor(y)
    c.need_f32(ty)
    neg = c.emit("mul", [ty, c.scalar(-1.0)], ty.s1, ty.s2, node=node, suffix=".neg")
    return _binary(c, node, "add", x, neg)


def f_div(c, node):
    a = _bind(c, node, ["input", "other"], {"rounding_mode": None})
    if a["rounding_mode"] is not None or c.is_tensor_arg(a["other"]):
        c.fail("division by a tensor (libctr divides only by constants, as a multiply)")
    return _binary(c, node, "mul", a["input"], 1.0 / float(c.const_arg(a["other"], "divisor")))


def f_neg(c, node):
    return _binary(c, node, "mul", node.args[0], -1.0)


def f_gelu(c, node):
    a = _bind(c, node, ["input"], {"approximate": "none"})
    approx = c.const_arg(a["approximate"], "approximate")
    if approx != "tanh":
        c.fail(f"gelu with approximate='{approx}': libctr's gelu is the tanh approximation "
               f"(use approximate='tanh')")
    x = c.tensor(a["input"])
    c.need_f32(x)
    return c.emit_like("gelu", [x], node)


def f_silu(c, node):
    a = _bind(c, node, ["input"], {"inplace": False})
    x = c.tensor(a["input"])
    c.need_f32(x)
    return c.emit_like("silu", [x], node)


def _softmax(c, node, x_arg, dim, dtype):
    x = c.tensor(x_arg)
    c.need_f32(x)
    if dtype is not None:
        c.fail("softmax with a dtype argument")
    if dim is None or c.axis(c.const_arg(dim, "dim"), x.rank) != x.rank - 1:
        c.fail(f"softmax over dim {dim}: libctr's softmax runs over the last dim")
    return c.emit_like("softmax", [x], node)


def f_softmax(c, node):
    a = _bind(c, node, ["input", "dim"], {"_stacklevel": 3, "dtype": None})
    return _softmax(c, node, a["input"], a["dim"], a["dtype"])


def f_cross_entropy(c, node):
    a = _bind(c, node, ["input", "target"], {"weight": None, "size_average": None,
                                             "ignore_index": -100, "reduce": None,
                                             "reduction": "mean", "label_smoothing": 0.0})
    for k, want in (("weight", None), ("size_average", None), ("reduce", None),
                    ("reduction", "mean"), ("label_smoothing", 0.0)):
        if c.const_arg(a[k], k) != want:
            c.fail(f"cross_entropy with {k}={c.host(a[k], 1)!r}: libctr's loss is the mean "
                   f"over targets with no weights or smoothing")
    if int(c.const_arg(a["ignore_index"], "ignore_index")) >= 0:
        c.fail("cross_entropy with ignore_index >= 0: libctr ignores negative targets only")
    logits, targets = c.tensor(a["input"]), c.tensor(a["target"])
    c.need_f32(logits)
    if targets.dtype != _I32:
        c.fail("cross_entropy targets must be class indices (integers)")
    if logits.s1[:-1] != targets.s1 or logits.s2[:-1] != targets.s2:
        c.fail(f"cross_entropy of logits {c.shape_str(logits.s1, logits.s2)} and targets "
               f"{c.shape_str(targets.s1, targets.s2)}: targets must be the logits' leading dims")
    return c.emit("cross_entropy", [logits, targets], (), (), node=node)


def f_embedding(c, node):
    a = _bind(c, node, ["input", "weight"], {"padding_idx": None, "max_norm": None,
                                             "norm_type": 2.0, "scale_grad_by_freq": False,
                                             "sparse": False})
    if c.const_arg(a["max_norm"], "max_norm") is not None:
        c.fail("embedding with max_norm: not supported by libctr's embedding")
    if c.const_arg(a["scale_grad_by_freq"], "scale_grad_by_freq"):
        c.fail("embedding with scale_grad_by_freq=True: libctr's embedding gradient is not "
               "scaled by the frequency of the ids")
    return _embedding(c, node, a["input"], a["weight"], c.const_arg(a["padding_idx"], "padding_idx"))


def _embedding(c, node, ids_arg, table_arg, padding_idx=None):
    """padding_idx: PyTorch's (None: none; negative: counted from the end): the row whose
    lookups pass no gradient back to the table."""
    table = c.tensor(table_arg, "embedding table")
    if table.rank != 2:
        c.fail("the embedding table must be 2-D [rows, dim]")
    attrs = None
    if padding_idx is not None:
        rows = table.s1[0]
        if not isinstance(rows, int) or not -rows <= int(padding_idx) < rows:
            c.fail(f"embedding padding_idx {padding_idx} is no row of the table")
        attrs = {"padding_idx": int(padding_idx) % rows}
    pos = c.env.get(ids_arg) if isinstance(ids_arg, fx.Node) else None
    if isinstance(pos, _Positions) and attrs is None:
        # table(arange(t)) is the first t rows: libctr's take_rows.
        c.positional_rows.append(table.s1[0])
        s1 = (pos.like.s1[pos.axis],) + table.s1[1:]
        s2 = (pos.like.s2[pos.axis],) + table.s2[1:]
        return c.emit("take_rows", [table, pos.like], s1, s2, {"axis": pos.axis}, node=node)
    ids = c.tensor(ids_arg, "ids")
    if ids.dtype != _I32:
        c.fail("embedding ids must be integer token ids")
    return c.emit("embedding", [table, ids], ids.s1 + table.s1[1:], ids.s2 + table.s2[1:],
                  attrs, node=node)


def f_layer_norm(c, node):
    a = _bind(c, node, ["input", "normalized_shape"], {"weight": None, "bias": None,
                                                       "eps": 1e-5})
    return _layer_norm(c, node, a["input"], c.const_arg(a["normalized_shape"], "shape"),
                       a["weight"], a["bias"], float(c.const_arg(a["eps"], "eps")))


def _layer_norm(c, node, x_arg, shape, w, b, eps):
    x = c.tensor(x_arg)
    c.need_f32(x)
    shape = tuple(shape)
    if len(shape) != 1 or shape[0] != x.s1[-1]:
        c.fail(f"layer_norm over {list(shape)}: libctr normalises over the last dim only")
    weight = c.tensor(w, "weight") if w is not None else c.ones(shape[0])
    inputs = [x, weight] + ([c.tensor(b, "bias")] if b is not None else [])
    return c.emit_like("layernorm", inputs, node, {"eps": eps})


def f_dropout(c, node):
    a = _bind(c, node, ["input"], {"p": 0.5, "training": True, "inplace": False})
    p, training = c.const_arg(a["p"], "p"), c.const_arg(a["training"], "training")
    if training and p > 0:
        c.fail(f"dropout with p={p}: libctr has no dropout; export with p=0 or model.eval()")
    return _alias(c, a["input"])


def _reshape_to(c, node, x: _T, m1, m2):
    """x reshaped to the node's shape. libctr's reshape keeps input dim i where the target
    says 0 and infers one -1, so each symbolic target dim must either sit where the same
    input dim sits or be the single inferred one."""
    s1, s2 = tuple(m1.shape), tuple(m2.shape)
    if s1 == x.s1 and s2 == x.s2:
        return x
    target, inferred = [], 0
    for i, (d1, d2) in enumerate(zip(s1, s2)):
        if d1 == d2:
            target.append(d1)
        elif i < x.rank and x.dim(i) == (d1, d2):
            target.append(0)
        else:
            target.append(-1)
            inferred += 1
    if inferred > 1:
        c.fail(f"reshape of {c.shape_str(x.s1, x.s2)} to {c.shape_str(s1, s2)}: libctr's "
               f"reshape can infer only one size that depends on batch or seq")
    return c.emit("reshape", [x], s1, s2, {"shape": target}, dtype=x.dtype, node=node)


def f_reshape(c, node):
    x = c.tensor(node.args[0])
    return _reshape_to(c, node, x, c.v1[node], c.v2[node])


def _transpose_perm(c, node, x: _T, perm):
    perm = [c.axis(p, x.rank) for p in perm]
    if sorted(perm) != list(range(x.rank)):
        c.fail(f"permutation {perm} of a rank-{x.rank} tensor")
    if perm == list(range(x.rank)):
        return x
    c.need_f32(x, "transposed tensor")
    if x.rank > 6:
        c.fail("transpose of more than 6 dims")
    s1 = tuple(x.s1[p] for p in perm)
    s2 = tuple(x.s2[p] for p in perm)
    return c.emit("transpose", [x], s1, s2, {"perm": perm}, node=node)


def f_transpose(c, node):
    x = c.tensor(node.args[0])
    d0, d1 = (c.const_arg(a, "dim") for a in node.args[1:3])
    perm = list(range(x.rank))
    i, j = c.axis(d0, x.rank), c.axis(d1, x.rank)
    perm[i], perm[j] = perm[j], perm[i]
    return _transpose_perm(c, node, x, perm)


def f_permute(c, node):
    x = c.tensor(node.args[0])
    dims = node.args[1:] if len(node.args) > 2 else node.args[1]
    if "dims" in node.kwargs:
        dims = node.kwargs["dims"]
    return _transpose_perm(c, node, x, [c.const_arg(d, "dim") for d in dims])


def f_t(c, node):
    x = c.tensor(node.args[0])
    if x.rank < 2:
        return x
    if x.rank != 2:
        c.fail("t() of a tensor with more than 2 dims")
    return _transpose_perm(c, node, x, [1, 0])


def f_getattr(c, node):
    attr = node.args[1]
    if attr in ("T", "mT"):
        x = c.tensor(node.args[0])
        perm = list(range(x.rank))
        if attr == "T":
            perm.reverse()
        else:
            perm[-1], perm[-2] = perm[-2], perm[-1]
        return _transpose_perm(c, node, x, perm)
    if attr == "data":
        return _alias(c, node.args[0])
    c.fail(f"tensor attribute '{attr}'")


def f_getitem(c, node):
    base, index = node.args
    held = c.env.get(base) if isinstance(base, fx.Node) else None
    if isinstance(held, tuple):  # a module that returns several tensors (the MoE layer)
        return held[c.const_arg(index, "index")]
    if not c.is_tensor_arg(base):
        c.fail("indexing a value that holds tensors")  # a tuple of tensors from an op
    t = c.tensor(base)
    i1, i2 = c.host(index, 1), c.host(index, 2)
    if not isinstance(i1, tuple):
        i1, i2 = (i1,), (i2,)
    rest = [x for x in i1[1:] if not (x == slice(None) or x is Ellipsis)]
    ok = len(i1) >= 1 and isinstance(i1[0], slice) and not rest and \
        i1[0].start in (None, 0) and i1[0].step in (None, 1) and isinstance(i2[0], slice)
    if not ok:
        c.fail("indexing other than table[:n] (the leading rows of a positional table)")
    n1 = t.s1[0] if i1[0].stop is None else min(int(i1[0].stop), t.s1[0])
    n2 = t.s2[0] if i2[0].stop is None else min(int(i2[0].stop), t.s2[0])
    if (n1, n2) == (t.s1[0], t.s2[0]):
        return t
    found = c.find_dim(n1, n2)
    if found is None:
        c.fail(f"slicing the first {n1} rows: libctr slices a table only to the length of an "
               f"input dim (take_rows), e.g. wpe[:tokens.shape[1]]")
    like, axis = found
    c.positional_rows.append(t.s1[0])
    return c.emit("take_rows", [t, like], (n1,) + t.s1[1:], (n2,) + t.s2[1:], {"axis": axis},
                  node=node)


def f_arange(c, node):
    args = [c.host(a, 1) for a in node.args]
    args2 = [c.host(a, 2) for a in node.args]
    if len(args) == 2 and args[0] == 0 and args2[0] == 0:
        args, args2 = args[1:], args2[1:]
    for k in node.kwargs:
        if k not in ("dtype", "device"):
            c.fail(f"torch.arange with '{k}'")
    if len(args) != 1 or node.kwargs.get("dtype") not in (None, torch.long, torch.int32,
                                                           torch.int64):
        c.fail("torch.arange other than arange(n) of integer position ids")
    found = c.find_dim(int(args[0]), int(args2[0]))
    if found is None:
        c.fail("torch.arange(n) where n is not the batch or sequence size of an input")
    return _Positions(*found)


def f_cast(c, node):
    """long() / int() / float() / to(dtype or device) / type(dtype): libctr keeps token ids as
    int32 and everything else as float32, so a cast within the same kind is no op."""
    x = c.env.get(node.args[0]) if isinstance(node.args[0], fx.Node) else None
    if isinstance(x, _Positions):
        return x
    t = c.tensor(node.args[0])
    m = c.v1[node]
    want = _torch_dtype(m.dtype)
    if want is None or want != t.dtype:
        c.fail(f"conversion of a {'float' if t.dtype == _F32 else 'integer'} tensor to "
               f"{m.dtype}: libctr computes in float32 and keeps token ids as int32")
    return t


def f_contiguous(c, node):
    return _alias(c, node.args[0])


def f_assert(c, node):  # produces no tensor; listed so the op is known
    return None


FUNCTIONS: Dict[Any, Callable] = {
    F.linear: f_linear,
    torch.matmul: f_matmul, operator.matmul: f_matmul,
    torch.add: f_add, operator.add: f_add, operator.iadd: f_add,
    torch.mul: f_mul, operator.mul: f_mul, operator.imul: f_mul,
    torch.sub: f_sub, operator.sub: f_sub, operator.isub: f_sub,
    torch.div: f_div, operator.truediv: f_div, operator.itruediv: f_div,
    torch.neg: f_neg, operator.neg: f_neg,
    F.gelu: f_gelu, F.silu: f_silu,
    F.softmax: f_softmax, torch.softmax: f_softmax,
    F.cross_entropy: f_cross_entropy,
    F.embedding: f_embedding,
    F.layer_norm: f_layer_norm,
    F.dropout: f_dropout,
    torch.reshape: f_reshape, torch.flatten: f_reshape, torch.squeeze: f_reshape,
    torch.unsqueeze: f_reshape,
    torch.transpose: f_transpose, torch.permute: f_permute, torch.t: f_t,
    getattr: f_getattr, operator.getitem: f_getitem,
    torch.arange: f_arange,
    torch._assert: f_assert,
}

METHODS: Dict[str, Callable] = {
    "matmul": f_matmul, "add": f_add, "add_": f_add, "mul": f_mul, "sub": f_sub,
    "div": f_div, "neg": f_neg, "softmax": f_softmax,
    "reshape": f_reshape, "view": f_reshape, "flatten": f_reshape, "unflatten": f_reshape,
    "squeeze": f_reshape, "unsqueeze": f_reshape, "view_as": f_reshape,
    "reshape_as": f_reshape,
    "transpose": f_transpose, "permute": f_permute, "t": f_t,
    "contiguous": f_contiguous,
    "long": f_cast, "int": f_cast, "float": f_cast, "to": f_cast, "type": f_cast,
}


def _method_softmax(c, node):
    a = _bind(c, node, ["input", "dim"], {"dtype": None})
    return _softmax(c, node, a["input"], a["dim"], a["dtype"])


METHODS["softmax"] = _method_softmax


# ------------------------------------------------------------------------------------------------
# Converters: torch.nn modules


def m_linear(c, node, m):
    return _linear(c, node.args[0], m.weight, m.bias, node)


def m_embedding(c, node, m):
    if m.max_norm is not None:
        c.fail("nn.Embedding with max_norm: not supported by libctr's embedding")
    if m.scale_grad_by_freq:
        c.fail("nn.Embedding with scale_grad_by_freq=True: libctr's embedding gradient is not "
               "scaled by the frequency of the ids")
    return _embedding(c, node, node.args[0], m.weight, m.padding_idx)


def m_layernorm(c, node, m):
    return _layer_norm(c, node, node.args[0], m.normalized_shape,
                       m.weight if m.elementwise_affine else None,
                       m.bias if m.elementwise_affine else None, float(m.eps))


def m_gelu(c, node, m):
    if m.approximate != "tanh":
        c.fail(f"nn.GELU(approximate='{m.approximate}'): libctr's gelu is the tanh "
               f"approximation (use approximate='tanh')")
    x = c.tensor(node.args[0])
    return c.emit_like("gelu", [x], node)


def m_silu(c, node, m):
    return c.emit_like("silu", [c.tensor(node.args[0])], node)


def m_softmax(c, node, m):
    return _softmax(c, node, node.args[0], m.dim, None)


def m_dropout(c, node, m):
    if m.training and m.p > 0:
        c.fail(f"nn.Dropout(p={m.p}) in training mode: libctr has no dropout; use p=0")
    return _alias(c, node.args[0])


def m_identity(c, node, m):
    return _alias(c, node.args[0])


MODULES: List[Tuple[type, Callable]] = [
    (nn.Linear, m_linear), (nn.Embedding, m_embedding), (nn.LayerNorm, m_layernorm),
    (nn.GELU, m_gelu), (nn.SiLU, m_silu), (nn.Softmax, m_softmax), (nn.Dropout, m_dropout),
    (nn.Identity, m_identity),
]


# ------------------------------------------------------------------------------------------------
# Converters: modules that declare a libctr op (ctr_op)


def _call_args(c, node, names):
    out = list(node.args) + [node.kwargs[n] for n in names[len(node.args):] if n in node.kwargs]
    if len(out) != len(names):
        c.fail(f"expected arguments ({', '.join(names)})")
    return out


def l_rmsnorm(c, node, m):
    (x_arg,) = _call_args(c, node, ["x"])
    x = c.tensor(x_arg)
    c.need_f32(x)
    w = c.tensor(m.weight, "weight")
    if w.s1 != (x.s1[-1],):
        c.fail(f"RMSNorm weight {list(w.s1)} does not match the last dim {x.s1[-1]}")
    return c.emit_like("rmsnorm", [x, w], node, {"eps": float(m.eps)})


def l_rope(c, node, m):
    (x_arg,) = _call_args(c, node, ["x"])
    x = c.tensor(x_arg)
    c.need_f32(x)
    d = int(m.head_dim)
    if x.rank != 3 or x.s1[2] % d != 0 or d % 2 != 0:
        c.fail(f"rotary on {c.shape_str(x.s1, x.s2)} with head size {d}: libctr's rope takes "
               f"[batch, seq, heads * head_dim] with an even head_dim")
    return c.emit_like("rope", [x], node, {"heads": x.s1[2] // d, "theta": float(m.theta)})


def l_attention(c, node, m):
    q, k, v = (c.tensor(a) for a in _call_args(c, node, ["q", "k", "v"]))
    for t in (q, k, v):
        c.need_f32(t)
    heads, kv = int(m.heads), int(getattr(m, "kv_heads", m.heads))
    if q.rank != 3 or q.s1[2] % heads != 0:
        c.fail(f"attention query {c.shape_str(q.s1, q.s2)} is not [batch, seq, heads*dim]")
    width = q.s1[2] // heads * kv
    for t, n in ((k, "key"), (v, "value")):
        if t.s1 != q.s1[:2] + (width,) or t.s2 != q.s2[:2] + (width,):
            c.fail(f"attention {n} {c.shape_str(t.s1, t.s2)} should be [batch, seq, {width}]")
    if not getattr(m, "causal", True):
        c.fail("non-causal attention")
    attrs = {"heads": heads, "kv_heads": kv, "causal": 1}
    if getattr(m, "scale", None) is not None:
        attrs["scale"] = float(m.scale)
    return c.emit_like("attention", [q, k, v], node, attrs)


def l_swiglu(c, node, m):
    gate, up = (c.tensor(a) for a in _call_args(c, node, ["gate", "up"]))
    if gate.s1 != up.s1 or gate.s2 != up.s2:
        c.fail("swiglu of differently shaped gate and up")
    return c.emit_like("swiglu", [gate, up], node)


def l_moe(c, node, m):
    """A mixture-of-experts feed-forward (the reference model's MoEFeedForward, ctr_op "moe"):
    forward(h [B, T, C]) -> (y [B, T, C], its auxiliary loss terms as a scalar). Reads from the
    module: cfg (experts, top_k, router_score, renorm(), aux_loss, z_loss), router (a Linear
    without bias), experts.w1/w3 [E, F, C] and w2 [E, C, F], and shared (None, or a SwiGLU
    feed-forward with w1, w2, w3 Linears)."""
    (h_arg,) = _call_args(c, node, ["h"])
    h = c.tensor(h_arg)
    c.need_f32(h)
    cfg = m.cfg
    E, k = int(cfg.experts), int(cfg.top_k)
    if h.rank != 3:
        c.fail(f"the MoE layer takes [batch, seq, dim], not {c.shape_str(h.s1, h.s2)}")
    if getattr(m.router, "bias", None) is not None:
        c.fail("a router with a bias (libctr's router is a linear without one)")
    C = h.s1[2]
    rows = lambda s, n: (s[0] * s[1] * k, n)  # noqa: E731 (the permuted rows, N * k)
    lead = lambda s, n: (s[0], s[1], n)  # noqa: E731

    def multi(op, inputs, outs, attrs=None):
        """A node with several outputs: outs = [(suffix, dtype, s1, s2), ...]."""
        ts = [c.add_tensor(c.out_name(node) + suffix, dt, s1, s2) for suffix, dt, s1, s2 in outs]
        c.nodes.append(NodeDef(op=op, name=c.tensors[ts[0].idx].name, inputs=[t.idx for t in inputs],
                               outputs=[t.idx for t in ts], attrs=dict(attrs or {}),
                               block=c.block(node)))
        return ts

    def linear(x, w, suffix, n):
        return c.emit("linear", [x, c.tensor(w)], lead(x.s1, n), lead(x.s2, n), node=node, suffix=suffix)

    logits = linear(h, m.router.weight, ".router.logits", E)
    weights, experts = multi("moe_router", [logits], [
        (".router.weights", _F32, lead(h.s1, k), lead(h.s2, k)),
        (".router.experts", _I32, lead(h.s1, k), lead(h.s2, k))],
        {"top_k": k, "score": str(cfg.router_score), "renorm": int(bool(cfg.renorm()))})
    xp, counts, slots = multi("moe_permute", [h, experts], [
        (".permuted", _F32, rows(h.s1, C), rows(h.s2, C)), (".counts", _I32, (E,), (E,)),
        (".slots", _I32, lead(h.s1, k), lead(h.s2, k))], {"experts": E})
    w1, w3, w2 = (c.tensor(getattr(m.experts, n)) for n in ("w1", "w3", "w2"))
    F_ = w1.s1[1]

    def grouped(x, w, suffix, n):
        return c.emit("moe_grouped_linear", [x, w, counts], rows(h.s1, n), rows(h.s2, n), node=node,
                      suffix=suffix)
    gate = grouped(xp, w1, ".experts.gate", F_)
    up = grouped(xp, w3, ".experts.up", F_)
    act = c.emit("swiglu", [gate, up], gate.s1, gate.s2, node=node, suffix=".experts.swiglu")
    down = grouped(act, w2, ".experts.down", C)
    y = c.emit("moe_unpermute", [down, weights, slots], h.s1, h.s2, node=node, suffix=".combined")
    if m.shared is not None:
        s = m.shared
        fs = s.w1.weight.shape[0]
        sg, su = linear(h, s.w1.weight, ".shared.gate", fs), linear(h, s.w3.weight, ".shared.up", fs)
        ss = c.emit("swiglu", [sg, su], sg.s1, sg.s2, node=node, suffix=".shared.swiglu")
        y = c.emit("add", [y, linear(ss, s.w2.weight, ".shared.down", C)], h.s1, h.s2, node=node,
                   suffix=".out")
    terms = []
    if cfg.aux_loss > 0:
        terms.append(c.emit("moe_aux_loss", [logits, experts], (), (), {"coef": float(cfg.aux_loss)},
                            node=node, suffix=".aux_loss"))
    if cfg.z_loss > 0:
        terms.append(c.emit("moe_z_loss", [logits], (), (), {"coef": float(cfg.z_loss)}, node=node,
                            suffix=".z_loss"))
    aux = terms[0] if terms else c.scalar(0.0)
    if len(terms) == 2:
        aux = c.emit("add", terms, (), (), node=node, suffix=".aux")
    return (y, aux)


def l_simple(op):
    def convert(c, node, m):
        (x_arg,) = _call_args(c, node, ["x"])
        x = c.tensor(x_arg)
        c.need_f32(x)
        return c.emit_like(op, [x], node)
    return convert


LEAF_OPS: Dict[str, Callable] = {
    "rmsnorm": l_rmsnorm, "rope": l_rope, "attention": l_attention, "swiglu": l_swiglu,
    "moe": l_moe,
    "gelu": l_simple("gelu"), "silu": l_simple("silu"), "softmax": l_simple("softmax"),
}


# ------------------------------------------------------------------------------------------------
# Entry point


def _second_inputs(tokens: torch.Tensor, targets: torch.Tensor):
    """The example inputs with one more row and one position fewer (or more, at length 1)."""
    def resize(x):
        x = torch.cat([x, x[:1]], dim=0)
        if x.shape[1] > 1:
            return x[:, :-1].contiguous()
        return torch.cat([x, x], dim=1)
    return resize(tokens), resize(targets)


def convert(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor,
            loss_fn: Optional[Callable], no_decay: Callable, max_seq: Optional[int]) -> GraphDef:
    if not isinstance(model, nn.Module):
        raise TypeError("export() takes an nn.Module")
    for name, x in (("tokens", tokens), ("targets", targets)):
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.dtype not in _INT_TYPES:
            raise ExportError(f"example input '{name}' must be a [batch, seq] integer tensor")
    if tokens.shape != targets.shape:
        raise ExportError("example tokens and targets must have the same shape")
    wrapper = _Training(model, loss_fn)
    tracer = _Tracer()
    try:
        graph = tracer.trace(wrapper)
    except ExportError:
        raise
    except Exception as e:  # fx's own message says which construct it could not trace
        file, line, code = _raising_frame(e)
        where = f" at {file}:{line}" if file else ""
        src = f"\n    {code}" if code else ""
        raise ExportError(f"cannot trace the module with torch.fx{where}: "
                          f"{type(e).__name__}: {e}{src}", op="torch.fx", file=file,
                          line=line, code=code) from e
    gm = fx.GraphModule(tracer.root, graph)

    inputs2 = _second_inputs(tokens, targets)
    runs = []
    with torch.no_grad():
        for ins in ((tokens, targets), inputs2):
            rec = _Recorder(gm)
            try:
                rec.run(*ins)
            except Exception as e:
                raise ExportError(f"running the traced module on example inputs of shape "
                                  f"{list(ins[0].shape)} failed: {type(e).__name__}: {e}") from e
            runs.append(rec.values)
    sizes = (tuple(tokens.shape), tuple(inputs2[0].shape))

    c = _Converter(model, gm, runs, sizes, no_decay)
    outputs = c.run()
    if max_seq is None:
        if c.positional_rows:
            max_seq = min(c.positional_rows)
        elif hasattr(getattr(model, "cfg", None), "seq"):
            max_seq = int(model.cfg.seq)
        else:
            max_seq = int(tokens.shape[1])
    meta = [("exporter", "ctr_export"), ("model", type(model).__name__),
            ("max_seq", str(int(max_seq)))]
    return c.finish(outputs, type(model).__name__.lower(), meta)

