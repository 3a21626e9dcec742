"""Export ordinary PyTorch model code: tracing at the ATen level with make_fx.

torch.fx symbolic tracing (trace.py) stops at the first line that treats a traced value as a
Python value (`B, T, C = x.size()`, `q, k, v = x.split(C, dim=2)`). make_fx instead runs the
model on real example tensors and records the ATen ops they dispatch, so shape unpacking,
tuple unpacking, Python control flow on sizes, buffers and weight tying by assignment all
simply happen. What it loses is which sizes were the batch and sequence lengths: every size
is baked into the recorded ops. So:

1. The model is traced twice, at the example inputs and at one more row and one position
   fewer. The two ATen graphs must be the same op for op; an int argument that differs
   between them is a size expression in "batch" and "seq" (classified by `_Sym`), written
   into the libctr attribute as such ("batch*seq,768", end "seq").
2. Values computed from constants only (buffers, frozen parameters, arange, tril, polar) are
   not exported as ops: they are constant-folded. A folded value that grows with the
   sequence (a causal mask cut to T, rotary tables of T rows) is stored once at the graph's
   longest sequence (its constant subgraph evaluated again with max_seq for the length) and
   cut to "seq" by a slice.
3. Each ATen op is mapped onto libctr's op set. Views that only flatten or unflatten leading
   dims are kept symbolic until an op needs the tensor, so `linear` runs on [B, T, C]
   directly and `bmm` over [B*H, T, D] becomes a batched matmul over [B, H, T, D]; a
   `log_softmax` read only by `nll_loss` becomes libctr's fused cross_entropy. The compiler's
   fuse pass then recognises the larger patterns (attention, norms, SwiGLU, RoPE).
4. Nodes are named and placed in blocks by the module that issued them (forward hooks), and
   an op that cannot be mapped is an ExportError naming the ATen op and the model's source line.

Why make_fx and not torch.export with dynamic batch and sequence dims: torch.export would
hand over the sizes as symbols, but it compiles the model's Python bytecode (TorchDynamo)
against fake tensors, and turns what ordinary model code does with sizes into guards on
those symbols that the user must satisfy by hand: of the four models of tests/zoo, the
nanoGPT and GPT-2 styles fail there on PyTorch 2.15 ("Constraints violated (seq)", batch and
seq declared as Dims up to the model's length), where make_fx exports and trains all four.
make_fx runs the model eagerly on real tensors, so the constants to fold have real values, a
failure is an ATen op at a source line, and what it records are the ops eager execution
dispatches. What it does not give, the symbolic sizes, the two traces of point 1 recover;
control flow on sizes that differs between them is refused.
"""

import hashlib
import math
import operator
import traceback
from typing import Any, Callable, Dict, List, Optional

import torch
import torch.fx as fx
import torch.nn as nn
from torch.fx.experimental import proxy_tensor

from .graphfile import ROLE, GraphDef
from .trace import (_F32, _I32, _INT_TYPES, _OWN_DIR, _TORCH_DIR, ExportError, _Converter,
                    _output_nodes, _raising_frame, _second_inputs, _T, _TMeta)

aten = torch.ops.aten


# ------------------------------------------------------------------------------------------------
# Tracing


class _Scopes:
    """Forward hooks that keep the path of the module currently running."""

    def __init__(self, model: nn.Module):
        self.stack: List[str] = []
        self.handles = []
        for name, m in model.named_modules():
            path = "model." + name if name else "model"
            self.handles.append(m.register_forward_pre_hook(self._enter(path)))
            self.handles.append(m.register_forward_hook(self._leave))

    def _enter(self, path):
        def hook(module, args):
            self.stack.append(path)
        return hook

    def _leave(self, module, args, out):
        if self.stack:
            self.stack.pop()

    def remove(self):
        for h in self.handles:
            h.remove()


def _user_stack() -> str:
    """The Python stack outside torch and this package, innermost first, formatted the way
    fx formats stack traces (trace._user_frame reads it)."""
    frames = [f for f in traceback.extract_stack()
              if not (f.filename.startswith(_TORCH_DIR) or f.filename.startswith(_OWN_DIR))]
    return "".join(traceback.format_list(list(reversed(frames))[:4]))


def _make_fx(fn, args, scopes: _Scopes) -> fx.GraphModule:
    """make_fx(fn)(*args), with each node given the module scope and user stack it came from."""
    cls = proxy_tensor.PythonKeyTracer
    orig = cls.create_node

    def create_node(self, *a, **k):
        node = orig(self, *a, **k)
        node.meta["ctr_scope"] = scopes.stack[-1] if scopes.stack else ""
        node.stack_trace = _user_stack()
        return node
    cls.create_node = create_node
    try:
        return proxy_tensor.make_fx(fn)(*args)
    finally:
        cls.create_node = orig


def _all_tensors(model: nn.Module, kind: str):
    """(names by tensor, unique tensors in order) of every parameter or buffer, every name a
    tied tensor has included (named_parameters() lists a tied one once)."""
    names: Dict[int, List[str]] = {}
    uniq: List[torch.Tensor] = []
    for mod_name, m in model.named_modules(remove_duplicate=False):
        store = m._parameters if kind == "param" else m._buffers
        for n, t in store.items():
            if t is None:
                continue
            full = f"{mod_name}.{n}" if mod_name else n
            if id(t) not in names:
                names[id(t)] = []
                uniq.append(t)
            if full not in names[id(t)]:
                names[id(t)].append(full)
    return names, uniq


class _Trace:
    """One make_fx trace of the training function and the values of its nodes in that run."""

    def __init__(self, model, loss_fn, params, buffers, pnames, bnames, tokens, targets):
        self.inputs = list(params) + list(buffers) + [tokens, targets]
        from torch.func import functional_call

        def fn(ps, bs, tok, tgt):
            pb = {}
            for t, names in zip(ps, pnames):
                for n in names:
                    pb[n] = t
            for t, names in zip(bs, bnames):
                for n in names:
                    pb[n] = t
            if loss_fn is None:
                return functional_call(model, pb, (tok, tgt))
            out = functional_call(model, pb, (tok,))
            return out, loss_fn(out, tgt)

        scopes = _Scopes(model)
        try:
            with torch.no_grad():
                self.gm = _make_fx(fn, (list(params), list(buffers), tokens, targets), scopes)
        finally:
            scopes.remove()
        self.nodes = list(self.gm.graph.nodes)
        self.values: Dict[fx.Node, Any] = {}

    def record(self, consts):
        """Runs the graph; keeps shapes of every value and the full value of constant nodes."""
        values: Dict[fx.Node, Any] = {}
        gm = self.gm

        class Rec(fx.Interpreter):
            def run_node(self, n):
                r = super().run_node(n)
                values[n] = r if n in consts else _summary(r)
                return r
        with torch.no_grad():
            Rec(gm).run(*self.inputs)
        self.values = values


def _summary(v):
    if isinstance(v, torch.Tensor):
        return _TMeta(v)
    if isinstance(v, (tuple, list)):
        return type(v)(_summary(x) for x in v)
    return v


# ------------------------------------------------------------------------------------------------
# Values during conversion


class _Reshaped:
    """A graph tensor seen through a view: materialised as a reshape only when needed."""

    __slots__ = ("base", "s1", "s2")

    def __init__(self, base: _T, s1, s2):
        self.base, self.s1, self.s2 = base, tuple(s1), tuple(s2)


class _TParam:
    """w.t() of a 2-D tensor w: read by addmm/mm as linear(x, w)."""

    __slots__ = ("w", "node")

    def __init__(self, w, node):
        self.w, self.node = w, node


class _LogSoftmax:
    """log_softmax(x, dim): nll_loss reads it as cross_entropy; anything else materialises it."""

    __slots__ = ("x", "dim", "node")

    def __init__(self, x, dim, node):
        self.x, self.dim, self.node = x, dim, node


class _Padded:
    """x padded at the end of its last dim with `after` copies of a constant (constant_pad_nd
    of integer targets, as Hugging Face's causal-LM loss shifts its labels): cross_entropy
    reads it as x against the logits cut to x's length when the constant is the ignored
    target; anything else refuses it."""

    __slots__ = ("x", "after", "value", "s1", "s2", "node")

    def __init__(self, x, after, value, s1, s2, node):
        self.x, self.after, self.value = x, after, value
        self.s1, self.s2, self.node = tuple(s1), tuple(s2), node


class _Complex:
    """A complex tensor as its real and imaginary parts (graph tensors)."""

    __slots__ = ("re", "im")

    def __init__(self, re, im):
        self.re, self.im = re, im


class _Unavailable:
    """A result make_fx records but libctr has no tensor for: an error only if it is read."""

    __slots__ = ("why",)

    def __init__(self, why):
        self.why = why


class _Tuple:
    """An op's several results; items are converted when getitem reads them."""

    __slots__ = ("items",)

    def __init__(self, items):
        self.items = items


_NOT_MAPPED = {
    "aten.topk": "top-k routing follows the data, which one trace would fix: give the mixture-"
                 "of-experts layer ctr_op = \"moe\" (as tools/export/models/moe.py does) and "
                 "export with tracer=\"fx\", which maps it onto libctr's moe ops",
    "aten.sort": "sorting follows the data, which one trace would fix",
    "aten.cumsum": "a running sum has no libctr op",
    "aten.index.Tensor": "indexing with a tensor computed in the model: index with constants, "
                         "or use an nn.Embedding",
    "aten.scatter": "scatter writes at computed positions, which libctr's ops do not",
    "aten.convolution": "convolutions are not part of libctr's op set",
    "aten.copy_": "in-place updates of buffers (caches) have no place in a training graph",
    "aten._local_scalar_dense": "reading a tensor's value on the host (.item(), if tensor:) "
                                "cannot be part of a graph",
}


class _AtenConverter(_Converter):
    def __init__(self, model, traces, sizes, no_decay, consts, pnames, bnames, params, buffers,
                 max_seq_fn):
        t1, t2 = traces
        super().__init__(model, t1.gm, (t1.values, t2.values), sizes, no_decay)
        self.t1, self.t2 = t1, t2
        self.other = {a: b for a, b in zip(t1.nodes, t2.nodes)}
        self.const_nodes = consts
        self.max_seq_fn = max_seq_fn  # () -> the graph's longest sequence, fixed on first use
        self.pnames, self.bnames = pnames, bnames
        self.placeholders: Dict[fx.Node, Any] = {}
        ph = [n for n in t1.nodes if n.op == "placeholder"]
        np_, nb = len(params), len(buffers)
        for i, n in enumerate(ph):
            if i < np_:
                self.placeholders[n] = ("param", params[i], pnames[i][0])
            elif i < np_ + nb:
                self.placeholders[n] = ("buffer", buffers[i - np_], bnames[i - np_][0])
            else:
                self.placeholders[n] = ("input", ("tokens", "targets")[i - np_ - nb], None)
        self.const_cache: Dict[Any, Any] = {}
        self.transposed: Dict[int, Any] = {}  # transpose output -> (its input, perm)

    # --- sizes --------------------------------------------------------------------------------

    def sym(self, d1: int, d2: int, what: str):
        """An int, or a size expression in batch and seq ("seq", "batch*seq*4")."""
        if d1 == d2:
            return int(d1)
        B1, T1, B2, T2 = self.B1, self.T1, self.B2, self.T2
        for total in range(1, 5):
            for a in range(0, total + 1):
                b = total - a
                p1, p2 = B1 ** a * T1 ** b, B2 ** a * T2 ** b
                if p1 == 0 or d1 % p1 or d2 % p2 or d1 // p1 != d2 // p2:
                    continue
                k = d1 // p1
                terms = ["batch"] * a + ["seq"] * b
                if k != 1:
                    terms.append(str(k))
                return "*".join(terms)
        self.fail(f"{what} is {d1} in one trace and {d2} in the other, which is no product of "
                  f"the batch and sequence sizes")

    def dims_attr(self, s1, s2, what="shape"):
        vals = [self.sym(a, b, what) for a, b in zip(s1, s2)]
        if all(isinstance(v, int) for v in vals):
            return {"shape": vals}
        return {"dims": ",".join(str(v) for v in vals)}

    def arg2(self, node, i, default=None):
        """Positional argument i of node in trace 1 and trace 2."""
        n2 = self.other[node]
        a1 = node.args[i] if i < len(node.args) else default
        a2 = n2.args[i] if i < len(n2.args) else default
        return a1, a2

    def same(self, node, i, what, default=None):
        a1, a2 = self.arg2(node, i, default)
        if a1 != a2:
            self.fail(f"{what} depends on the batch or sequence size ({a1} vs {a2})")
        return a1

    # --- values -------------------------------------------------------------------------------

    def shapes(self, node):
        m1, m2 = self.v1[node], self.v2[self.other[node]]
        return tuple(m1.shape), tuple(m2.shape)

    def val(self, a):
        """The converted value of an argument (graph tensor, view, tuple...) or a Python value."""
        if isinstance(a, fx.Node):
            if a in self.const_nodes:
                return ("const", a)
            return self.env[a]
        return a

    def is_const(self, a) -> bool:
        return isinstance(a, fx.Node) and a in self.const_nodes

    def mat(self, v, what="input") -> _T:
        """A graph tensor for a converted value."""
        if isinstance(v, fx.Node):
            v = self.val(v)
        if isinstance(v, _T):
            return v
        if isinstance(v, _Reshaped):
            return self.reshape(v.base, v.s1, v.s2)
        if isinstance(v, tuple) and len(v) == 2 and v[0] == "const":
            return self.const_tensor(v[1])
        if isinstance(v, _TParam):
            w = self.mat(v.w)
            return self.emit("transpose", [w], w.s1[::-1], w.s2[::-1], {"perm": [1, 0]},
                             dtype=w.dtype, node=v.node)
        if isinstance(v, _LogSoftmax):
            x = self.mat(v.x)
            return self.emit("log_softmax", [x], x.s1, x.s2, self.dim_attr(v.dim, x.rank),
                             node=v.node)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return self.scalar(float(v))
        if isinstance(v, _Unavailable):
            self.fail(f"reads {v.why}")
        if isinstance(v, _Padded):
            self.fail("a tensor padded with a constant (constant_pad_nd) is mapped only as "
                      "cross_entropy targets padded with the ignored index at the end of the "
                      "sequence", node=v.node)
        if isinstance(v, _Complex):
            self.fail(f"a complex {what} outside the patterns libctr maps (view_as_complex, "
                      f"multiplication, view_as_real)")
        self.fail(f"{what} is not a tensor this exporter can represent")

    def dim_attr(self, dim, rank):
        d = int(dim) % rank
        return {} if d == rank - 1 else {"dim": d}

    def reshape(self, x: _T, s1, s2) -> _T:
        s1, s2 = tuple(s1), tuple(s2)
        if (s1, s2) == (x.s1, x.s2):
            return x
        key = ("reshape", x.idx, s1, s2)
        if key not in self.const_cache:
            self.const_cache[key] = self.emit("reshape", [x], s1, s2, self.dims_attr(s1, s2),
                                              dtype=x.dtype, suffix=".view")
        return self.const_cache[key]

    def param_value(self, node) -> _T:
        kind, t, name = self.placeholders[node]
        key = id(t)
        if key not in self.params:
            self.names.setdefault(key, name)
            self.params[key] = self.param(t, name)
        return self.params[key]

    # --- constants ----------------------------------------------------------------------------

    def const_value(self, node, run):
        if run == 1:
            return self.t1.values[node]
        if run == 2:
            return self.t2.values[self.other[node]]
        return self.at_max_seq(node)

    def at_max_seq(self, node):
        """A constant node's value at the longest sequence: its constant subgraph evaluated
        again with every size argument that moved with the sequence set to max_seq."""
        memo = self.const_cache.setdefault("max_seq_values", {})
        if node in memo:
            return memo[node]
        if node.op == "placeholder":
            v = self.placeholders[node][1]
        elif node.op == "get_attr":
            v = self.t1.values[node]
        else:
            T = self.max_seq_fn()
            n2 = self.other[node]

            def size(a1, a2):
                if isinstance(a1, fx.Node):
                    return self.at_max_seq(a1)
                if isinstance(a1, (list, tuple)):
                    return type(a1)(size(x, y) for x, y in zip(a1, a2))
                if isinstance(a1, int) and not isinstance(a1, bool) and a1 != a2:
                    e = self.sym(a1, a2, "a size")
                    out = 1
                    for term in str(e).split("*"):
                        out *= {"batch": self.B1, "seq": T}.get(term) or int(term)
                    return out
                return a1
            args = size(tuple(node.args), tuple(n2.args))
            kwargs = {k: size(v, n2.kwargs.get(k)) for k, v in node.kwargs.items()}
            with torch.no_grad():
                v = node.target(*args, **kwargs)
        memo[node] = v
        return v

    def const_tensor(self, node, part=None) -> _T:
        """The constant value of node as a Const tensor (cut to "seq" where it grows with it)."""
        key = ("const", node, part)
        if key in self.const_cache:
            return self.const_cache[key]
        v1, v2 = self.const_value(node, 1), self.const_value(node, 2)
        if not isinstance(v1, torch.Tensor):
            self.fail("a constant that is not a tensor", node=node)

        def prep(v):
            if part == "not":
                return (v == 0).to(torch.float32), _F32
            if v.is_complex():
                if part is None:
                    self.fail("a complex constant used outside view_as_complex / mul / "
                              "view_as_real", node=node)
                v = v.real if part == "re" else v.imag
            if v.dtype == torch.bool or v.is_floating_point():
                return v.to(torch.float32), _F32
            if v.dtype in _INT_TYPES:
                return v.to(torch.int32), _I32
            self.fail(f"a constant of dtype {v.dtype}", node=node)
        v1, dt = prep(v1)
        v2, _ = prep(v2)
        v1, v2, batch_axes = self.batch_broadcast(node, v1, v2)
        if v1.shape == v2.shape:
            if not torch.equal(v1, v2):
                self.fail("a value computed from constants differs between two traces of "
                          "different sizes (it depends on the batch or sequence size)", node=node)
            t = self.add_const(node, v1, dt, part)
        else:
            axes = [i for i, (a, b) in enumerate(zip(v1.shape, v2.shape)) if a != b]
            for i in axes:
                if (v1.shape[i], v2.shape[i]) != (self.T1, self.T2):
                    self.fail(f"a constant whose dim {i} follows the batch size (only the "
                              f"sequence length may change a constant's shape)", node=node)
            v3, _ = prep(self.const_value(node, 3))
            for i in batch_axes:
                v3 = v3.narrow(i, 0, 1)
            for v in (v1, v2):
                cut = v3
                for i in axes:
                    cut = cut.narrow(i, 0, v.shape[i])
                if cut.shape != v.shape or not torch.equal(cut, v):
                    self.fail("a constant computed from the sequence length is not the leading "
                              "part of its value at the longest sequence; libctr stores such "
                              "tables once at max_seq and cuts them to the length",
                              node=node)
            t = self.add_const(node, v3, dt, part)
            cur1, cur2 = list(t.s1), list(t.s2)
            for i in axes:
                cur1[i], cur2[i] = v1.shape[i], v2.shape[i]
                t = self.emit("slice", [t], tuple(cur1), tuple(cur2), {"dim": i, "end": "seq"},
                              dtype=dt, node=node, suffix=".cut")
        self.const_cache[key] = t
        return t

    def batch_broadcast(self, node, v1, v2):
        """A constant with a dim of the batch size in both traces (a mask built for the batch,
        `.expand(batch, 1, -1, -1)`) whose rows along that dim are all equal is stored with
        one row there, which the ops reading it broadcast; (v1, v2, those dims). Rows that
        differ are refused, naming the op that brought the batch dim in."""
        axes = [i for i, (a, b) in enumerate(zip(v1.shape, v2.shape))
                if (a, b) == (self.B1, self.B2) and a != b]
        for i in axes:
            for v in (v1, v2):
                first = v.narrow(i, 0, 1)
                if not torch.equal(v, first.expand_as(v)):
                    origin = self.batch_origin(node, i)
                    self.fail(f"a constant whose dim {i} follows the batch size holds different "
                              f"values per batch row; libctr stores constants once for every "
                              f"batch: build it without the batch dim (size 1 there, broadcast "
                              f"by the ops that read it)", node=origin)
            v1, v2 = v1.narrow(i, 0, 1), v2.narrow(i, 0, 1)
        return v1, v2, axes

    def batch_origin(self, node, axis):
        """The first constant node on the way to node whose output has the batch size where
        none of its inputs has (the expand or arange that introduced it), for messages."""
        seen, todo = set(), [node]
        while todo:
            n = todo.pop()
            if n in seen or n not in self.const_nodes or n.op != "call_function":
                continue
            seen.add(n)
            todo.extend(a for a in n.all_input_nodes)

        def has_batch(n):
            s1 = getattr(self.t1.values.get(n), "shape", None)
            s2 = getattr(self.t2.values.get(self.other[n]), "shape", None)
            return s1 is not None and s2 is not None and any(
                (a, b) == (self.B1, self.B2) for a, b in zip(s1, s2))
        for n in self.t1.nodes:
            if n in seen and has_batch(n) and not any(has_batch(a) for a in n.all_input_nodes if a in seen):
                return n
        return node

    def add_const(self, node, v: torch.Tensor, dt, part):
        """A Const tensor holding v (a buffer keeps its name; computed values get one)."""
        if node.op == "placeholder" and part is None:
            name = self.placeholders[node][2]
        elif node.op == "get_attr":
            name = str(node.target)
        else:
            name = self.out_name(node) + (f".{part}" if part else "")
        np_dtype = "<f4" if dt == _F32 else "<i4"
        data = v.contiguous().numpy().astype(np_dtype).tobytes()
        shape = tuple(v.shape)
        # Equal constants (each layer's copy of a causal mask) are stored once.
        key = ("data", dt, shape, hashlib.sha256(data).hexdigest())
        if key not in self.const_cache:
            self.const_cache[key] = self.add_tensor(name, dt, shape, shape, role=ROLE["Const"],
                                                    data=data)
        return self.const_cache[key]

    # --- the walk -----------------------------------------------------------------------------

    def run(self):
        if len(self.t1.nodes) != len(self.t2.nodes) or any(
                str(a.target) != str(b.target) for a, b in zip(self.t1.nodes, self.t2.nodes)):
            raise ExportError("the model runs different ops at two batch/sequence sizes "
                              "(control flow on sizes beyond what libctr's static graph holds)")
        for node in self.t1.nodes:
            if node.op == "call_function" and str(node.target).startswith(_RANDOM):
                self.current = node
                self.fail("random numbers drawn in the model (dropout with p > 0 in training "
                          "mode): libctr has no dropout; export with p=0 or model.eval()")
        outputs = None
        for node in self.t1.nodes:
            self.current = node
            if node.op == "placeholder":
                kind, t, name = self.placeholders[node]
                if kind == "input":
                    m1, m2 = self.shapes(node)
                    if self.v1[node].dtype not in _INT_TYPES or len(m1) != 2:
                        self.fail(f"input '{t}' must be a [batch, seq] integer tensor", op=t)
                    x = self.add_tensor(t, _I32, m1, m2, role=ROLE["Input"])
                    self.inputs.append(x)
                    self.env[node] = x
                elif node not in self.const_nodes:
                    self.env[node] = self.param_value(node)
            elif node.op == "call_function":
                if node in self.const_nodes:
                    continue
                self.env[node] = self.convert(node)
            elif node.op == "output":
                outputs = node.args[0]
        return outputs

    def convert(self, node: fx.Node):
        if _aten_name(node.target).split(".default")[0] in _IGNORED:
            return None
        fn = ATEN.get(node.target)
        if fn is None:
            fn = ATEN.get(getattr(node.target, "overloadpacket", None))
        if fn is None:
            name = _aten_name(node.target)
            why = next((w for k, w in _NOT_MAPPED.items() if name.startswith(k)), None)
            self.fail(why or "this ATen op has no equivalent in libctr's graph op set",
                      op=name)
        return fn(self, node)

    def fail(self, why: str, node: Optional[fx.Node] = None, op: Optional[str] = None):
        node = node or self.current
        if op is None and node is not None and node.op == "call_function":
            op = _aten_name(node.target)
        super().fail(why, node=node, op=op)

    def finish_outputs(self, outputs):
        """Materialises the outputs' values (views, tuples) as graph tensors for finish()."""
        for n in _output_nodes(outputs):
            v = self.env.get(n)
            if v is not None and not isinstance(v, (_Tuple, _Unavailable)):
                self.env[n] = self.mat(v)
        return outputs


def _aten_name(target) -> str:
    s = str(target)
    return s if s.startswith("aten.") else getattr(target, "__name__", s)


# ------------------------------------------------------------------------------------------------
# Converters


def _out(c, node):
    return c.shapes(node)


def _emit_like(c, op, inputs, node, attrs=None, dtype=_F32):
    s1, s2 = _out(c, node)
    return c.emit(op, inputs, s1, s2, attrs, dtype=dtype, node=node)


def _f32(c, v, what="input") -> _T:
    t = c.mat(v, what)
    if t.dtype != _F32:
        c.fail(f"{what} is an integer tensor; this op takes float32")
    return t


def a_alias(c, node):
    return c.val(node.args[0])


def a_to_copy(c, node):
    v = c.val(node.args[0])
    want = node.kwargs.get("dtype")
    if want is None:
        return v
    src = c.v1[node.args[0]].dtype if isinstance(node.args[0], fx.Node) else None
    same_kind = (want == torch.float32 and src in (torch.float32, None)) or \
        (want in _INT_TYPES and src in _INT_TYPES)
    if not same_kind:
        c.fail(f"conversion of {src} to {want}: libctr computes in float32 and keeps token "
               f"ids as int32")
    return v


def a_view(c, node):
    v = c.val(node.args[0])
    s1, s2 = _out(c, node)
    if isinstance(v, _Padded):
        return _Reshaped(v, s1, s2)  # read by cross_entropy, or refused by mat()
    if isinstance(v, _LogSoftmax):
        # log_softmax(x, -1).view(-1, V): the log_softmax of the view of x, as long as the
        # view keeps the classes' dim, so nll_loss still reads it as cross_entropy.
        x = v.x.base if isinstance(v.x, _Reshaped) else c.mat(v.x)
        if v.dim % x.rank == x.rank - 1 and s1[-1:] == x.s1[-1:] and s2[-1:] == x.s2[-1:]:
            return _LogSoftmax(x if (s1, s2) == (x.s1, x.s2) else _Reshaped(x, s1, s2), -1,
                               v.node)
    base = v.base if isinstance(v, _Reshaped) else c.mat(v)
    if (s1, s2) == (base.s1, base.s2):
        return base
    return _Reshaped(base, s1, s2)


def a_expand(c, node):
    v = c.val(node.args[0])
    s1, s2 = _out(c, node)
    x = c.mat(v)
    if (s1, s2) == (x.s1, x.s2):
        return x
    shape = []
    lead = len(s1) - x.rank
    for i, (d1, d2) in enumerate(zip(s1, s2)):
        j = i - lead
        if j >= 0 and (x.s1[j], x.s2[j]) == (d1, d2):
            shape.append(-1)
        elif d1 == d2:
            shape.append(int(d1))
        else:
            c.fail("expand to a size that depends on the batch or sequence length, where the "
                   "input does not have it")
    return c.emit("expand", [x], s1, s2, {"shape": shape}, dtype=x.dtype, node=node)


def a_t(c, node):
    v = c.val(node.args[0])
    m = c.v1[node.args[0]] if isinstance(node.args[0], fx.Node) else None
    if isinstance(node.args[0], fx.Node) and (len(m.shape) == 2 or c.is_const(node.args[0])):
        return _TParam(node.args[0], node)
    x = c.mat(v)
    if x.rank < 2:
        return x
    return _transpose(c, node, x, [1, 0])


def _transpose(c, node, x, perm):
    # A transpose of a transpose is one (or none): undoing the head split around an
    # attention call costs nothing.
    src = c.transposed.get(x.idx)
    if src is not None:
        base, first = src
        perm = [first[p] for p in perm]
        x = base
    if perm == list(range(x.rank)):
        return x
    s1 = tuple(x.s1[p] for p in perm)
    s2 = tuple(x.s2[p] for p in perm)
    out = c.emit("transpose", [x], s1, s2, {"perm": perm}, dtype=x.dtype, node=node)
    c.transposed[out.idx] = (x, perm)
    return out


def a_transpose(c, node):
    x = c.mat(c.val(node.args[0]))
    i, j = (int(d) % x.rank for d in node.args[1:3])
    perm = list(range(x.rank))
    perm[i], perm[j] = perm[j], perm[i]
    return _transpose(c, node, x, perm)


def a_permute(c, node):
    x = c.mat(c.val(node.args[0]))
    return _transpose(c, node, x, [int(d) % x.rank for d in node.args[1]])


def _linear_input(c, v, k):
    """(x, flattened): x with last dim k, reading through a view that flattened leading dims
    ([B, T, C] seen as [B*T, C], or [B, T, H, D] seen as [B*T, H*D]: then [B, T, H*D])."""
    if isinstance(v, _Reshaped) and len(v.s1) == 2 and v.s1[1] == k:
        b = v.base
        for i in range(1, b.rank):
            if math.prod(b.s1[:i]) == v.s1[0] and math.prod(b.s2[:i]) == v.s2[0]:
                return c.reshape(b, b.s1[:i] + (k,), b.s2[:i] + (k,)), True
    return c.mat(v), False


def _mm(c, node, bias_arg, a_arg, b_arg):
    bv = c.val(b_arg)
    if isinstance(bv, _TParam):
        w_node = bv.w
        w = c.mat(c.val(w_node)) if not c.is_const(w_node) else c.const_tensor(w_node)
        x, flat = _linear_input(c, c.val(a_arg), w.s1[1])
        if x.dtype != _F32:
            c.fail("linear of an integer tensor")
        inputs = [x, w]
        if bias_arg is not None:
            b = c.mat(c.val(bias_arg), "bias")
            if b.s1 != (w.s1[0],):
                inputs = None
            else:
                inputs.append(b)
        if inputs is not None:
            s1, s2 = x.s1[:-1] + (w.s1[0],), x.s2[:-1] + (w.s2[0],)
            out = c.emit("linear", inputs, s1, s2, node=node)
            if flat:
                o1, o2 = _out(c, node)
                return _Reshaped(out, o1, o2)
            return out
    b = _f32(c, bv)
    a, flat = _linear_input(c, c.val(a_arg), b.s1[0]) if b.rank == 2 else \
        (_f32(c, c.val(a_arg)), False)
    s1, s2 = a.s1[:-1] + (b.s1[-1],), a.s2[:-1] + (b.s2[-1],)
    out = c.emit("matmul", [a, b], s1, s2, node=node)
    if bias_arg is not None:
        out = c.emit("add", [out, _f32(c, c.val(bias_arg), "bias")], out.s1, out.s2, node=node,
                     suffix=".bias")
    if flat:
        o1, o2 = _out(c, node)
        return _Reshaped(out, o1, o2)
    return out


def _scale_add(c, node, product, bias_arg, beta, alpha):
    """beta * bias + alpha * product (addmm's and baddbmm's arithmetic); beta = 0 ignores
    the bias, as PyTorch does (even a NaN in it)."""
    out = c.mat(product)
    if alpha != 1:
        out = c.emit("mul", [out, c.scalar(float(alpha))], out.s1, out.s2, node=node,
                     suffix=".alpha")
    if beta != 0:
        bias = _operand(c, bias_arg)
        if beta != 1:
            bias = c.emit("mul", [bias, c.scalar(float(beta))], bias.s1, bias.s2, node=node,
                          suffix=".beta")
        o1, o2 = _out(c, node)
        out = c.emit("add", [out, bias], o1, o2, node=node, suffix=".bias")
    return out


def a_addmm(c, node):
    beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
    if beta == 1 and alpha == 1:
        return _mm(c, node, node.args[0], node.args[1], node.args[2])
    return _scale_add(c, node, _mm(c, node, None, node.args[1], node.args[2]), node.args[0],
                      beta, alpha)


def a_baddbmm(c, node):
    beta, alpha = node.kwargs.get("beta", 1), node.kwargs.get("alpha", 1)
    return _scale_add(c, node, _bmm(c, node, node.args[1], node.args[2]), node.args[0], beta,
                      alpha)


def a_mm(c, node):
    return _mm(c, node, None, node.args[0], node.args[1])


def a_bmm(c, node):
    return _bmm(c, node, node.args[0], node.args[1])


def _bmm(c, node, a_arg, b_arg):
    av, bv = c.val(a_arg), c.val(b_arg)
    if isinstance(av, _Reshaped) and isinstance(bv, _Reshaped):
        a, b = av.base, bv.base
        if a.rank == b.rank and a.rank >= 3 and a.s1[:-2] == b.s1[:-2] and \
                a.s2[:-2] == b.s2[:-2] and a.s1[-2:] == av.s1[-2:] and b.s1[-2:] == bv.s1[-2:] \
                and a.s2[-2:] == av.s2[-2:] and b.s2[-2:] == bv.s2[-2:]:
            s1, s2 = a.s1[:-1] + (b.s1[-1],), a.s2[:-1] + (b.s2[-1],)
            out = c.emit("matmul", [_f32(c, a), _f32(c, b)], s1, s2, node=node)
            o1, o2 = _out(c, node)
            return _Reshaped(out, o1, o2)
    return _emit_like(c, "matmul", [_f32(c, av), _f32(c, bv)], node)


def _operand(c, a):
    """A binary op's operand: a graph tensor, a constant node, or a Python number."""
    if isinstance(a, (int, float)) and not isinstance(a, bool):
        return c.scalar(float(a))
    if c.is_const(a):
        return c.const_tensor(a)
    return _f32(c, c.val(a))


def _complex_parts(c, a):
    v = c.val(a) if isinstance(a, fx.Node) else a
    if isinstance(v, _Complex):
        return v.re, v.im
    if c.is_const(a) and c.const_value(a, 1).is_complex():
        return c.const_tensor(a, "re"), c.const_tensor(a, "im")
    return None


def _binary(op):
    def convert(c, node):
        a, b = node.args[0], node.args[1]
        alpha = node.kwargs.get("alpha", 1)
        if op == "mul":
            pa, pb = _complex_parts(c, a), _complex_parts(c, b)
            if pa is not None and pb is not None:
                return _complex_mul(c, node, pa, pb)
        if alpha != 1:
            if isinstance(b, (int, float)):
                b = b * alpha
            else:
                c.fail(f"{op} with alpha={alpha}")
        x, y = _operand(c, a), _operand(c, b)
        return _emit_like(c, op, [x, y], node)
    return convert


def a_rsub(c, node):
    x, y = _operand(c, node.args[0]), _operand(c, node.args[1])
    return _emit_like(c, "sub", [y, x], node)


def _complex_mul(c, node, pa, pb):
    (ar, ai), (br, bi) = pa, pb
    s1, s2 = _out(c, node)

    def bmul(x, y, sfx):
        return c.emit("mul", [x, y], s1, s2, node=node, suffix=sfx)
    re = c.emit("sub", [bmul(ar, br, ".rr"), bmul(ai, bi, ".ii")], s1, s2, node=node,
                suffix=".re")
    im = c.emit("add", [bmul(ar, bi, ".ri"), bmul(ai, br, ".ir")], s1, s2, node=node,
                suffix=".im")
    return _Complex(re, im)


def a_view_as_complex(c, node):
    x = _f32(c, c.val(node.args[0]))
    if x.s1[-1] != 2:
        c.fail("view_as_complex of a tensor whose last dim is not 2")
    s1, s2 = x.s1[:-1], x.s2[:-1]
    parts = []
    for i, sfx in ((0, ".re"), (1, ".im")):
        p = c.emit("slice", [x], x.s1[:-1] + (1,), x.s2[:-1] + (1,),
                   {"dim": x.rank - 1, "start": i, "end": i + 1}, node=node, suffix=sfx)
        parts.append(c.reshape(p, s1, s2))
    return _Complex(*parts)


def a_view_as_real(c, node):
    v = c.val(node.args[0])
    if not isinstance(v, _Complex):
        c.fail("view_as_real of a tensor not built by view_as_complex and multiplication")
    s1, s2 = _out(c, node)
    re = c.reshape(v.re, s1[:-1] + (1,), s2[:-1] + (1,))
    im = c.reshape(v.im, s1[:-1] + (1,), s2[:-1] + (1,))
    return c.emit("cat", [re, im], s1, s2, {"dim": len(s1) - 1}, node=node)


def _unary(op, attrs=None):
    def convert(c, node):
        return _emit_like(c, op, [_f32(c, c.val(node.args[0]))], node, dict(attrs or {}))
    return convert


def a_pow(c, node):
    e = node.args[1]
    if not isinstance(e, (int, float)):
        c.fail("pow with a tensor exponent (libctr raises to constant powers)")
    x = _f32(c, c.val(node.args[0]))
    if e == 1:
        return x
    if e == 0.5:
        return _emit_like(c, "sqrt", [x], node)
    if e == -0.5:
        return _emit_like(c, "rsqrt", [x], node)
    if e == -1:
        return _emit_like(c, "reciprocal", [x], node)
    return _emit_like(c, "pow", [x], node, {"exponent": float(e)})


def a_relu(c, node):
    return _emit_like(c, "relu", [_f32(c, c.val(node.args[0]))], node)


def a_clamp(c, node):
    """clamp(x, min, max), clamp_min(x, min), clamp_max(x, max) with constant bounds."""
    name = _aten_name(node.target)
    if "clamp_min" in name:
        lo, hi = c.same(node, 1, "clamp's min"), None
    elif "clamp_max" in name:
        lo, hi = None, c.same(node, 1, "clamp's max")
    else:
        lo = c.same(node, 1, "clamp's min", node.kwargs.get("min"))
        hi = c.same(node, 2, "clamp's max", node.kwargs.get("max"))
    for b in (lo, hi):
        if b is not None and not isinstance(b, (int, float)):
            c.fail("clamp with tensor bounds (libctr clamps to constants)")
    if lo is None and hi is None:
        return c.val(node.args[0])
    attrs = {}
    if lo is not None:
        attrs["min"] = float(lo)
    if hi is not None:
        attrs["max"] = float(hi)
    if lo is not None and hi is not None and lo > hi:
        # PyTorch then gives max everywhere (and no gradient).
        c.fail(f"clamp with min {lo} above max {hi}")
    return _emit_like(c, "clamp", [_f32(c, c.val(node.args[0]))], node, attrs)


def a_gelu(c, node):
    approx = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
    attrs = {} if approx == "tanh" else {"approximate": "none"}
    return _emit_like(c, "gelu", [_f32(c, c.val(node.args[0]))], node, attrs)


def a_layer_norm(c, node):
    x = _f32(c, c.val(node.args[0]))
    shape = list(node.args[1])
    w, b = (node.args[i] if len(node.args) > i else None for i in (2, 3))
    eps = float(node.args[4]) if len(node.args) > 4 else 1e-5
    if len(shape) != 1 or shape[0] != x.s1[-1]:
        c.fail(f"layer_norm over {shape}: libctr normalises over the last dim only")
    weight = _operand(c, w) if w is not None else c.ones(shape[0])
    inputs = [x, weight] + ([_operand(c, b)] if b is not None else [])
    out = c.emit("layernorm", inputs, x.s1, x.s2, {"eps": eps}, node=node)
    return _Tuple([out, None, None])


def a_getitem(c, node):
    v = c.val(node.args[0])
    i = node.args[1]
    if isinstance(v, _Tuple):
        item = v.items[i]
        if callable(item):
            item = item()
            v.items[i] = item
        if item is None:
            return _Unavailable("an op's secondary result (layer_norm's mean and rstd, "
                                "dropout's mask) that libctr does not expose")
        return item
    c.fail("indexing a value that is not a tuple of tensors")


def _reduce(op):
    def convert(c, node):
        x = _f32(c, c.val(node.args[0]))
        if node.target in (aten.sum.default, aten.mean.default):
            dims, keep = list(range(x.rank)), False
        else:
            dims = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            if dims is None:
                dims = list(range(x.rank))
            if isinstance(dims, int):
                dims = [dims]
            keep = bool(node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False))
        if node.kwargs.get("dtype") not in (None, torch.float32):
            c.fail("a reduction with a dtype")
        attrs = {"dims": [int(d) % x.rank for d in dims], "keepdim": int(keep)}
        if op == "var":
            corr = node.kwargs.get("correction", 1)
            if node.target == aten.var.dim:  # var(x, dims, unbiased, keepdim)
                corr = 1 if (node.args[2] if len(node.args) > 2 else True) else 0
                keep = bool(node.args[3] if len(node.args) > 3 else False)
                attrs["keepdim"] = int(keep)
            attrs["correction"] = int(corr if corr is not None else 1)
        return _emit_like(c, op, [x], node, attrs)
    return convert


def a_softmax(c, node):
    x = _f32(c, c.val(node.args[0]))
    return _emit_like(c, "softmax", [x], node, c.dim_attr(node.args[1], x.rank))


def a_log_softmax(c, node):
    v = c.val(node.args[0])
    return _LogSoftmax(v, int(node.args[1]), node)


def a_nll_loss(c, node):
    args = list(node.args) + [None] * (5 - len(node.args))
    logp, target, weight, reduction, ignore = args[:5]
    if weight is not None:
        c.fail("cross_entropy / nll_loss with class weights")
    if reduction != 1:
        c.fail("cross_entropy / nll_loss with a reduction other than 'mean'")
    if ignore is not None and int(ignore) >= 0:
        c.fail("ignore_index >= 0: libctr ignores negative targets only (use ignore_index=-1)")
    lv = c.val(logp)
    if not isinstance(lv, _LogSoftmax):
        c.fail("nll_loss of something other than log_softmax (libctr's loss is cross_entropy)")
    xv, tv = lv.x, c.val(target)
    rank = len(xv.s1) if isinstance(xv, _Reshaped) else c.mat(xv).rank
    if lv.dim % rank != rank - 1:
        c.fail("log_softmax over a dim other than the classes (the last)")
    if isinstance(tv, _Reshaped) and isinstance(tv.base, _Padded):
        return _nll_padded(c, node, xv, tv.base, ignore)
    # Read through views that flatten [B, T, V] to [B*T, V]: the loss is the same.
    if isinstance(xv, _Reshaped) and isinstance(tv, _Reshaped) and \
            xv.base.s1[:-1] == tv.base.s1 and xv.base.s2[:-1] == tv.base.s2 and \
            xv.base.s1[-1] == xv.s1[-1]:
        x, t = xv.base, tv.base
    else:
        x, t = c.mat(xv), c.mat(tv)
    if t.dtype != _I32:
        c.fail("cross_entropy targets must be class indices (integers)")
    if x.s1[:-1] != t.s1 or x.s2[:-1] != t.s2:
        c.fail("cross_entropy targets must have the logits' leading dims")
    attrs = {} if ignore is None or int(ignore) == -1 else {"ignore_index": int(ignore)}
    loss = c.emit("cross_entropy", [x, t], (), (), attrs, node=node)
    return _Tuple([loss, None])


def _nll_padded(c, node, xv, p: _Padded, ignore):
    """cross_entropy(logits.view(-1, V), pad(t, (0, k), ignore).view(-1)): the padded
    positions are ignored, so the loss (a mean over the targets not ignored) is the one of
    the logits without their last k positions against t."""
    ignore = -100 if ignore is None else int(ignore)
    if not isinstance(xv, _Reshaped) or xv.base.s1[:-1] != p.s1 or xv.base.s2[:-1] != p.s2:
        c.fail("cross_entropy of padded targets against logits other than [.., seq, classes] "
               "flattened to [-1, classes]")
    if p.value != ignore:
        c.fail(f"targets padded with {p.value}, which is not the ignored index {ignore}: "
               f"the padded positions would count in the loss")
    x, t = xv.base, p.x
    d = x.rank - 2
    s1 = x.s1[:d] + (x.s1[d] - p.after,) + x.s1[d + 1:]
    s2 = x.s2[:d] + (x.s2[d] - p.after,) + x.s2[d + 1:]
    if (s1[:-1], s2[:-1]) != (t.s1, t.s2):
        c.fail("padded targets whose length differs from the logits' once the padding is cut")
    cut = c.emit("slice", [x], s1, s2, {"dim": d, "end": -p.after}, node=node, suffix=".cut")
    attrs = {} if ignore == -1 else {"ignore_index": ignore}
    loss = c.emit("cross_entropy", [cut, t], (), (), attrs, node=node)
    return _Tuple([loss, None])


def a_embedding(c, node):
    # aten.embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False, sparse=False);
    # nn.Embedding and F.embedding pass a negative padding_idx counted from the end already.
    table_arg, ids_arg = node.args[0], node.args[1]
    pad = int(c.same(node, 2, "the embedding's padding_idx", -1))
    if c.same(node, 3, "the embedding's scale_grad_by_freq", False):
        c.fail("embedding with scale_grad_by_freq=True: libctr's embedding gradient is not "
               "scaled by the frequency of the ids")
    table = _operand(c, table_arg)
    attrs = {"padding_idx": pad} if pad >= 0 else None
    if c.is_const(ids_arg) and attrs is None:
        v1, v2 = c.const_value(ids_arg, 1), c.const_value(ids_arg, 2)
        f1, f2 = v1.flatten(), v2.flatten()
        if all(d == 1 for d in v1.shape[:-1]) and v1.shape[:-1] == v2.shape[:-1] and \
                torch.equal(f1, torch.arange(len(f1))) and torch.equal(f2, torch.arange(len(f2))) \
                and len(f1) != len(f2):
            found = c.find_dim(len(f1), len(f2))
            if found is not None:
                # table[arange(T)] is the first T rows: libctr's take_rows, no gather.
                like, axis = found
                c.positional_rows.append(table.s1[0])
                s1, s2 = (len(f1),) + table.s1[1:], (len(f2),) + table.s2[1:]
                rows = c.emit("take_rows", [table, like], s1, s2, {"axis": axis}, node=node)
                o1, o2 = _out(c, node)
                return c.reshape(rows, o1, o2)
    ids = c.mat(c.val(ids_arg))
    if ids.dtype != _I32:
        c.fail("embedding ids must be integer token ids")
    return _emit_like(c, "embedding", [table, ids], node, attrs)


def a_constant_pad_nd(c, node):
    x = c.mat(c.val(node.args[0]))
    pad = [int(p) for p in c.same(node, 1, "the padding")]
    value = c.same(node, 2, "the padding value", 0)
    if x.dtype != _I32 or len(pad) != 2 or pad[0] != 0 or pad[1] <= 0:
        c.fail("constant padding other than of integer targets at the end of their last dim "
               "(F.pad(labels, (0, k), value=ignore_index))")
    s1, s2 = _out(c, node)
    return _Padded(x, pad[1], value, s1, s2, node)


def _slice_padded(c, node, p: _Padded):
    """p[..., start:] along its padded last dim: the padding stays, x loses its first
    `start` entries."""
    dim = int(c.same(node, 1, "slice dim", 0)) % len(p.s1)
    (b1, b2), (e1, e2) = c.arg2(node, 2, 0), c.arg2(node, 3, None)
    step = int(c.same(node, 4, "slice step", 1))
    full = (e1 is None or int(e1) >= p.s1[dim]) and (e2 is None or int(e2) >= p.s2[dim])
    start = int(b1 or 0)
    if dim != len(p.s1) - 1 or step != 1 or not full or (b1 or 0) != (b2 or 0) or \
            start < 0 or start > p.x.s1[dim]:
        c.fail("a slice of padded targets other than [..., start:] within the unpadded part")
    x = p.x
    if start:
        s1 = x.s1[:-1] + (x.s1[-1] - start,)
        s2 = x.s2[:-1] + (x.s2[-1] - start,)
        x = c.emit("slice", [x], s1, s2, {"dim": dim, "start": start}, dtype=x.dtype, node=node)
    o1, o2 = _out(c, node)
    return _Padded(x, p.after, p.value, o1, o2, p.node)


def a_slice(c, node):
    v = c.val(node.args[0])
    if isinstance(v, _Padded):
        return _slice_padded(c, node, v)
    x = c.mat(v)
    dim = int(c.same(node, 1, "slice dim", 0)) % x.rank
    s1o, s2o = _out(c, node)
    if (s1o, s2o) == (x.s1, x.s2):
        return x
    (b1, b2) = c.arg2(node, 2, 0)
    (e1, e2) = c.arg2(node, 3, None)
    step = int(c.same(node, 4, "slice step", 1))
    if (b1 or 0) != (b2 or 0):
        c.fail("a slice start that depends on the batch or sequence size")
    n1, n2 = x.s1[dim], x.s2[dim]
    e1 = n1 if e1 is None else min(int(e1), n1)
    e2 = n2 if e2 is None else min(int(e2), n2)
    end = c.sym(e1, e2, "slice end") if (e1, e2) != (n1, n2) else None
    attrs = {"dim": dim}
    if b1:
        attrs["start"] = int(b1)
    if end is not None:
        attrs["end"] = end
    if step != 1:
        attrs["step"] = step
    return c.emit("slice", [x], s1o, s2o, attrs, dtype=x.dtype, node=node)


def a_select(c, node):
    x = c.mat(c.val(node.args[0]))
    dim = int(node.args[1]) % x.rank
    idx = int(c.same(node, 2, "select index"))
    if idx < 0:
        idx += x.s1[dim]
        if x.s1[dim] != x.s2[dim]:
            c.fail("select from the end of a dim that depends on the batch or sequence size")
    s1 = x.s1[:dim] + (1,) + x.s1[dim + 1:]
    s2 = x.s2[:dim] + (1,) + x.s2[dim + 1:]
    p = c.emit("slice", [x], s1, s2, {"dim": dim, "start": idx, "end": idx + 1}, dtype=x.dtype,
               node=node, suffix=".sel")
    o1, o2 = _out(c, node)
    return c.reshape(p, o1, o2)


def a_split(c, node):
    x = c.mat(c.val(node.args[0]))
    dim = int(node.args[2] if len(node.args) > 2 else node.kwargs.get("dim", 0)) % x.rank
    sizes1 = node.args[1]
    sizes2 = c.other[node].args[1]
    n1, n2 = x.s1[dim], x.s2[dim]
    if isinstance(sizes1, int):
        if sizes1 != sizes2:
            c.fail("split sizes that depend on the batch or sequence size")
        sizes1 = sizes2 = [min(sizes1, n1 - i) for i in range(0, n1, sizes1)]
        if n1 != n2:
            c.fail("splitting a dim that depends on the batch or sequence size")
    items = []
    start = 0
    for k, (a, b) in enumerate(zip(sizes1, sizes2)):
        if a != b:
            c.fail("split sizes that depend on the batch or sequence size")

        def make(start=start, a=a, k=k):
            s1 = x.s1[:dim] + (a,) + x.s1[dim + 1:]
            s2 = x.s2[:dim] + (a,) + x.s2[dim + 1:]
            if (s1, s2) == (x.s1, x.s2):
                return x
            return c.emit("slice", [x], s1, s2, {"dim": dim, "start": start, "end": start + a},
                          dtype=x.dtype, node=node, suffix=f".{k}")
        items.append(make)
        start += a
    return _Tuple(items)


def a_cat(c, node):
    parts = [c.mat(c.val(a)) if not c.is_const(a) else c.const_tensor(a) for a in node.args[0]]
    o1, _ = _out(c, node)
    dim = int(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % len(o1)
    parts = [p for p in parts if p.s1 != (0,)]
    if len(parts) == 1:
        return parts[0]
    return _emit_like(c, "cat", parts, node, {"dim": dim}, dtype=parts[0].dtype)


def a_stack(c, node):
    o1, o2 = _out(c, node)
    dim = int(node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)) % len(o1)
    parts = []
    for a in node.args[0]:
        t = c.mat(c.val(a)) if not c.is_const(a) else c.const_tensor(a)
        parts.append(c.reshape(t, t.s1[:dim] + (1,) + t.s1[dim:], t.s2[:dim] + (1,) + t.s2[dim:]))
    return _emit_like(c, "cat", parts, node, {"dim": dim}, dtype=parts[0].dtype)


def _const_bool(c, a):
    if not c.is_const(a):
        c.fail("a mask computed from the model's activations: libctr masks with constants "
               "(registered buffers such as a causal tril, or masks built from arange)")
    return c.const_tensor(a)


def a_masked_fill(c, node):
    x = _f32(c, c.val(node.args[0]))
    mask = _const_bool(c, node.args[1])
    value = node.args[2]
    if isinstance(value, fx.Node):
        if not c.is_const(value) or c.const_value(value, 1).numel() != 1:
            c.fail("masked_fill with a tensor value (use a number)")
        value = c.const_value(value, 1).item()
    return _emit_like(c, "masked_fill", [x, mask], node, {"value": float(value)})


def a_where(c, node):
    cond, a, b = node.args[:3]
    mask = _const_bool(c, cond)

    def number(v):
        if isinstance(v, (int, float)):
            return float(v)
        if c.is_const(v):
            t = c.const_value(v, 1)
            if t.numel() >= 1 and torch.all(t == t.flatten()[0]):
                return float(t.flatten()[0])
        return None
    nb, na = number(b), number(a)
    if nb is not None and not c.is_const(a):
        # where(cond, x, v) = masked_fill(x, not cond, v)
        inv = c.const_tensor(cond, "not")
        return _emit_like(c, "masked_fill", [_f32(c, c.val(a)), inv], node, {"value": nb})
    if na is not None and not c.is_const(b):
        return _emit_like(c, "masked_fill", [_f32(c, c.val(b)), mask], node, {"value": na})
    c.fail("torch.where between two computed tensors (libctr's masked_fill fills a constant)")


def a_index_select(c, node):
    x = c.mat(c.val(node.args[0]))
    dim = int(node.args[1]) % x.rank
    if not c.is_const(node.args[2]):
        c.fail("index_select with computed indices")
    i1, i2 = c.const_value(node.args[2], 1), c.const_value(node.args[2], 2)
    if not torch.equal(i1, i2):
        c.fail("index_select indices that depend on the batch or sequence size")
    n = x.s1[dim]
    if x.s1[dim] != x.s2[dim]:
        c.fail("index_select over a dim that depends on the batch or sequence size")
    idx = i1.tolist()
    if len(idx) % n == 0 and idx == [i for i in range(n) for _ in range(len(idx) // n)]:
        # repeat_interleave(x, r, dim): x[..., n, 1, ...] expanded to [..., n, r, ...].
        r = len(idx) // n
        s1 = x.s1[:dim + 1] + (1,) + x.s1[dim + 1:]
        s2 = x.s2[:dim + 1] + (1,) + x.s2[dim + 1:]
        u = c.reshape(x, s1, s2)
        shape = [-1] * len(s1)
        shape[dim + 1] = r
        e1 = s1[:dim + 1] + (r,) + s1[dim + 2:]
        e2 = s2[:dim + 1] + (r,) + s2[dim + 2:]
        e = c.emit("expand", [u], e1, e2, {"shape": shape}, dtype=x.dtype, node=node,
                   suffix=".rep")
        o1, o2 = _out(c, node)
        return c.reshape(e, o1, o2)
    if idx == list(range(idx[0], idx[0] + len(idx))):
        return _emit_like(c, "slice", [x], node, {"dim": dim, "start": idx[0],
                                                  "end": idx[0] + len(idx)}, dtype=x.dtype)
    c.fail("index_select with indices other than a range or a repeat_interleave pattern")


def a_repeat(c, node):
    x = c.mat(c.val(node.args[0]))
    reps = [int(r) for r in node.args[1]]
    if reps != list(c.other[node].args[1]):
        c.fail("repeat counts that depend on the batch or sequence size")
    lead = len(reps) - x.rank
    if lead > 0:
        x = c.reshape(x, (1,) * lead + x.s1, (1,) * lead + x.s2)
    for d, r in enumerate(reps):
        if r == 1:
            continue
        # Tiling dim d r times: [.., 1, n, ..] expanded to [.., r, n, ..], then merged.
        u1, u2 = x.s1[:d] + (1,) + x.s1[d:], x.s2[:d] + (1,) + x.s2[d:]
        u = c.reshape(x, u1, u2)
        shape = [-1] * len(u1)
        shape[d] = r
        e = c.emit("expand", [u], u1[:d] + (r,) + u1[d + 1:], u2[:d] + (r,) + u2[d + 1:],
                   {"shape": shape}, dtype=x.dtype, node=node, suffix=f".tile{d}")
        x = c.reshape(e, x.s1[:d] + (r * x.s1[d],) + x.s1[d + 1:],
                      x.s2[:d] + (r * x.s2[d],) + x.s2[d + 1:])
    return x


def a_compare(c, node):
    c.fail("a mask computed from the model's activations: libctr masks with constants "
           "(registered buffers such as a causal tril, or masks built from arange)")


def _sdpa(c, node, q_arg, k_arg, v_arg, mask, dropout, causal, scale):
    """Fused causal attention on [B, H, T, D] tensors -> libctr's attention on [B, T, H*D]."""
    if dropout:
        c.fail(f"scaled_dot_product_attention with dropout_p={dropout} (libctr has no dropout)")
    if mask is not None:
        return _sdpa_masked(c, node, q_arg, k_arg, v_arg, mask, causal, scale)
    if not causal:
        c.fail("scaled_dot_product_attention without is_causal=True (libctr's attention is "
               "causal)")
    q, k, v = (_f32(c, c.val(a)) for a in (q_arg, k_arg, v_arg))
    if q.rank != 4 or k.rank != 4 or v.rank != 4:
        c.fail("scaled_dot_product_attention on tensors other than [batch, heads, seq, dim]")
    H, Hkv, D = q.s1[1], k.s1[1], q.s1[3]
    if v.s1[1] != Hkv or k.s1[3] != D or v.s1[3] != D or H % Hkv or q.s1[2] != k.s1[2]:
        c.fail(f"scaled_dot_product_attention of q {c.shape_str(q.s1, q.s2)}, k "
               f"{c.shape_str(k.s1, k.s2)}, v {c.shape_str(v.s1, v.s2)}")

    def flat(x):  # [B, h, T, D] -> [B, T, h*D]
        t = _transpose(c, node, x, [0, 2, 1, 3])
        return c.reshape(t, t.s1[:2] + (t.s1[2] * t.s1[3],), t.s2[:2] + (t.s2[2] * t.s2[3],))
    qf, kf, vf = flat(q), flat(k), flat(v)
    attrs = {"heads": int(H), "kv_heads": int(Hkv), "causal": 1,
             "scale": float(scale) if scale is not None else 1.0 / math.sqrt(D)}
    out = c.emit("attention", [qf, kf, vf], qf.s1, qf.s2, attrs, node=node)
    o4 = c.reshape(out, q.s1[:1] + (q.s1[2], H, D), q.s2[:1] + (q.s2[2], H, D))
    return _transpose(c, node, o4, [0, 2, 1, 3])


def _sdpa_masked(c, node, q_arg, k_arg, v_arg, mask, causal, scale):
    """scaled_dot_product_attention with a constant attn_mask (the masks Hugging Face's code
    builds for sliding windows, or any mask passed to nn.MultiheadAttention), written out as
    the primitives it computes: softmax(q·kᵀ·scale + mask)·v on [B, H, T, D], a boolean mask
    as masked_fill with -inf where it is False. The fuse pass folds this back into libctr's
    attention where the mask is one the fused op honours, and says why where it is not."""
    if causal:
        c.fail("scaled_dot_product_attention with both attn_mask and is_causal=True")
    if not c.is_const(mask):
        c.fail("scaled_dot_product_attention with an attn_mask computed from the model's "
               "activations: libctr masks with constants (a causal or windowed mask built from "
               "arange, or a registered buffer)")
    q, k, v = (_f32(c, c.val(a)) for a in (q_arg, k_arg, v_arg))
    if q.rank != 4 or k.rank != 4 or v.rank != 4 or k.s1[1] != q.s1[1] or v.s1[1] != q.s1[1] \
            or k.s1[3] != q.s1[3] or k.s1[2] != v.s1[2]:
        c.fail(f"scaled_dot_product_attention with attn_mask of q {c.shape_str(q.s1, q.s2)}, "
               f"k {c.shape_str(k.s1, k.s2)}, v {c.shape_str(v.s1, v.s2)} (libctr writes it "
               f"out for [batch, heads, seq, dim] with as many key as query heads)")
    D = q.s1[3]
    kt = _transpose(c, node, k, [0, 1, 3, 2])
    s1, s2 = q.s1[:3] + (k.s1[2],), q.s2[:3] + (k.s2[2],)
    scores = c.emit("matmul", [q, kt], s1, s2, node=node, suffix=".scores")
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(D)
    scores = c.emit("mul", [scores, c.scalar(scale)], s1, s2, node=node, suffix=".scaled")
    if c.const_value(mask, 1).dtype == torch.bool:
        scores = c.emit("masked_fill", [scores, c.const_tensor(mask, "not")], s1, s2,
                        {"value": float("-inf")}, node=node, suffix=".masked")
    else:
        scores = c.emit("add", [scores, c.const_tensor(mask)], s1, s2, node=node,
                        suffix=".masked")
    probs = c.emit("softmax", [scores], s1, s2, node=node, suffix=".probs")
    o1, o2 = q.s1[:3] + (v.s1[3],), q.s2[:3] + (v.s2[3],)
    return c.emit("matmul", [probs, v], o1, o2, node=node)


def a_sdpa(c, node):
    # PyTorch 2: scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal,
    # *, scale) and its CPU flash kernel (q, k, v, dropout_p, is_causal, *, attn_mask, scale),
    # which returns (output, logsumexp).
    a = list(node.args)
    kw = node.kwargs
    if "flash" in str(node.target):
        q, k, v = a[:3]
        dropout = a[3] if len(a) > 3 else kw.get("dropout_p", 0.0)
        causal = a[4] if len(a) > 4 else kw.get("is_causal", False)
        out = _sdpa(c, node, q, k, v, kw.get("attn_mask"), dropout, causal, kw.get("scale"))
        return _Tuple([out, None])
    q, k, v = a[:3]
    mask = a[3] if len(a) > 3 else kw.get("attn_mask")
    dropout = a[4] if len(a) > 4 else kw.get("dropout_p", 0.0)
    causal = a[5] if len(a) > 5 else kw.get("is_causal", False)
    return _sdpa(c, node, q, k, v, mask, dropout, causal, kw.get("scale"))


def a_dropout(c, node):
    p = float(node.args[1])
    train = node.args[2] if len(node.args) > 2 else True
    if train and p > 0:
        c.fail(f"dropout with p={p} in training mode: libctr has no dropout; export with p=0 or "
               f"model.eval()")
    return _Tuple([c.val(node.args[0]), None])


ATEN: Dict[Any, Callable] = {}


# Ops whose result shares the memory of their first argument: views, and in-place updates
# (which return the tensor they updated).
_VIEW_OPS = {"aten.view", "aten._unsafe_view", "aten.slice", "aten.select", "aten.transpose",
             "aten.t", "aten.permute", "aten.expand", "aten.unsqueeze", "aten.squeeze",
             "aten.alias", "aten.split", "aten.split_with_sizes", "aten.unbind",
             "aten.view_as_complex", "aten.view_as_real", "aten.as_strided", "aten.diagonal"}


def _aliases_first_arg(n: fx.Node) -> bool:
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:  # an item of split's results
        return isinstance(n.args[0], fx.Node) and _aliases_first_arg(n.args[0])
    name = _aten_name(n.target).rsplit(".", 1)[0]
    return name in _VIEW_OPS or name.endswith("_")


def _inplace(functional):
    """x.op_(...) as x.op(...): make_fx records the in-place op, and every later read of x
    as a read of its result, so the functional op's result takes its place. Refused where
    that is not the same: an update of a parameter, buffer or input, or of a tensor that
    is read afterwards through another alias (a view taken before the update, or the base
    of an updated view), which would still see the old values."""
    def convert(c, node):
        target = node.args[0]
        if not isinstance(target, fx.Node) or target.op == "placeholder" or \
                c.is_const(target):
            c.fail("an in-place update of a parameter, buffer, input or constant: libctr's "
                   "graph computes new tensors only; use the op that returns its result")
        order = c.const_cache.setdefault("node_order", {n: i for i, n in enumerate(c.t1.nodes)})
        root = target
        while _aliases_first_arg(root) and isinstance(root.args[0], fx.Node):
            root = root.args[0]
        aliases, todo = set(), [root]
        while todo:
            m = todo.pop()
            if m in aliases or m is node:
                continue
            aliases.add(m)
            todo.extend(u for u in m.users if _aliases_first_arg(u) and u.args[0] is m)
        for m in aliases:
            for u in m.users:
                if u is not node and order[u] > order[node] and u not in aliases:
                    reader = _aten_name(u.target) if u.op == "call_function" else u.name
                    c.fail(f"an in-place update of a tensor that is read afterwards through "
                           f"another view of it (by {reader}), which would see the old values "
                           f"in libctr's graph: update a copy, or use the op that returns "
                           f"its result")
        return functional(c, node)
    return convert


def _register():
    A = ATEN
    for op in (aten.alias.default, aten.clone.default, aten.detach.default,
               aten.lift_fresh_copy.default, aten.contiguous.default):
        A[op] = a_alias
    A[aten._to_copy.default] = a_to_copy
    for op in (aten.view.default, aten._unsafe_view.default, aten._reshape_alias.default,
               aten.reshape.default, aten.unsqueeze.default, aten.squeeze.dim,
               aten.squeeze.default, aten.flatten.using_ints):
        A[op] = a_view
    A[aten.expand.default] = a_expand
    A[aten.t.default] = a_t
    A[aten.transpose.int] = a_transpose
    A[aten.permute.default] = a_permute
    A[aten.addmm.default] = a_addmm
    A[aten.mm.default] = a_mm
    A[aten.bmm.default] = a_bmm
    for name, op in (("add", "add"), ("sub", "sub"), ("mul", "mul"), ("div", "div")):
        packet = getattr(aten, name)
        A[packet.Tensor] = _binary(op)
        A[packet.Scalar] = _binary(op)
    A[aten.rsub.Scalar] = a_rsub
    A[aten.rsub.Tensor] = a_rsub
    for name in ("neg", "exp", "log", "tanh", "erf", "rsqrt", "sqrt", "sigmoid", "reciprocal",
                 "silu"):
        A[getattr(aten, name).default] = _unary(name)
    A[aten.pow.Tensor_Scalar] = a_pow
    A[aten.gelu.default] = a_gelu
    A[aten.native_layer_norm.default] = a_layer_norm
    A[operator.getitem] = a_getitem
    A[aten.sum.dim_IntList] = _reduce("sum")
    A[aten.sum.default] = _reduce("sum")
    A[aten.mean.dim] = _reduce("mean")
    A[aten.mean.default] = _reduce("mean")
    A[aten.amax.default] = _reduce("amax")
    A[aten.var.correction] = _reduce("var")
    A[aten.var.dim] = _reduce("var")
    A[aten._softmax.default] = a_softmax
    A[aten._log_softmax.default] = a_log_softmax
    A[aten.nll_loss_forward.default] = a_nll_loss
    A[aten.embedding.default] = a_embedding
    A[aten.slice.Tensor] = a_slice
    A[aten.select.int] = a_select
    A[aten.split.Tensor] = a_split
    A[aten.split_with_sizes.default] = a_split
    A[aten.cat.default] = a_cat
    A[aten.stack.default] = a_stack
    A[aten.masked_fill.Scalar] = a_masked_fill
    A[aten.masked_fill.Tensor] = a_masked_fill
    A[aten.where.self] = a_where
    A[aten.index_select.default] = a_index_select
    A[aten.view_as_complex.default] = a_view_as_complex
    A[aten.view_as_real.default] = a_view_as_real
    A[aten.native_dropout.default] = a_dropout
    A[aten.scaled_dot_product_attention.default] = a_sdpa
    A[aten._scaled_dot_product_flash_attention_for_cpu.default] = a_sdpa
    A[aten.repeat.default] = a_repeat
    A[aten.baddbmm.default] = a_baddbmm
    A[aten.constant_pad_nd.default] = a_constant_pad_nd
    A[aten.relu.default] = a_relu
    A[aten.clamp.default] = a_clamp
    A[aten.clamp_min.default] = a_clamp
    A[aten.clamp_max.default] = a_clamp
    A[aten.relu_.default] = _inplace(a_relu)
    A[aten.clamp_.default] = _inplace(a_clamp)
    A[aten.clamp_min_.default] = _inplace(a_clamp)
    A[aten.clamp_max_.default] = _inplace(a_clamp)
    # In-place forms of mapped ops.
    for name, op in (("add_", "add"), ("sub_", "sub"), ("mul_", "mul"), ("div_", "div")):
        packet = getattr(aten, name)
        A[packet.Tensor] = _inplace(_binary(op))
        A[packet.Scalar] = _inplace(_binary(op))
    for name in ("neg", "exp", "log", "tanh", "erf", "rsqrt", "sqrt", "sigmoid", "reciprocal",
                 "silu"):
        A[getattr(aten, name + "_").default] = _inplace(_unary(name))
    A[aten.pow_.Scalar] = _inplace(a_pow)
    A[aten.gelu_.default] = _inplace(a_gelu)
    A[aten.masked_fill_.Scalar] = _inplace(a_masked_fill)
    A[aten.masked_fill_.Tensor] = _inplace(a_masked_fill)
    for name in ("gt", "lt", "ge", "le", "eq", "ne"):
        for overload in ("Scalar", "Tensor"):
            A[getattr(getattr(aten, name), overload)] = a_compare
    for name in ("logical_not", "logical_and", "logical_or", "bitwise_not"):
        A[getattr(aten, name).default] = a_compare


_register()

# Ops with no effect on values that make_fx may record (assertions, profiling marks).
_IGNORED = {"aten._assert_async", "aten.sym_constrain_range"}


# ------------------------------------------------------------------------------------------------
# Constant analysis


_RANDOM = ("aten.rand", "aten.randn", "aten.randint", "aten.bernoulli", "aten.normal",
           "aten.uniform", "aten.native_dropout", "aten.randperm", "aten.multinomial")


def _constant_nodes(gm: fx.GraphModule, n_params: int, n_buffers: int, frozen: set) -> set:
    """Nodes whose value depends on constants only (buffers, frozen parameters, factories).
    Placeholders come in the order parameters, buffers, tokens, targets."""
    consts = set()
    ph = 0
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            if n_params <= ph < n_params + n_buffers or ph in frozen:
                consts.add(n)
            ph += 1
            continue
        if n.op == "get_attr":  # a plain tensor attribute the model reads (not a buffer)
            consts.add(n)
            continue
        if n.op != "call_function" or str(n.target).startswith(_RANDOM):
            continue
        deps = []
        fx.node.map_arg((n.args, n.kwargs), lambda a: deps.append(a))
        if all(d in consts for d in deps):
            consts.add(n)
    return consts


# ------------------------------------------------------------------------------------------------
# Entry point


_SEQ_ATTRS = (("cfg", "seq"), ("config", "block_size"), ("config", "max_seq_len"),
              ("config", "n_positions"), ("config", "max_position_embeddings"),
              ("params", "max_seq_len"), ("args", "max_seq_len"), (None, "block_size"),
              (None, "max_seq_len"), (None, "max_seq"))


def _model_max_seq(model) -> Optional[int]:
    for holder, attr in _SEQ_ATTRS:
        obj = model if holder is None else getattr(model, holder, None)
        v = getattr(obj, attr, None) if obj is not None else None
        if isinstance(v, int) and v > 0:
            return v
    return None


def convert_aten(model: nn.Module, tokens: torch.Tensor, targets: torch.Tensor,
                 loss_fn: Optional[Callable], no_decay: Callable,
                 max_seq: Optional[int]) -> GraphDef:
    pnames_by_id, params = _all_tensors(model, "param")
    bnames_by_id, buffers = _all_tensors(model, "buffer")
    pnames = [pnames_by_id[id(p)] for p in params]
    bnames = [bnames_by_id[id(b)] for b in buffers]
    example_seq = int(tokens.shape[1])
    if tokens.shape[1] > 2:
        # Trace below the example's length: at a model's longest sequence PyTorch skips
        # no-op slices (mask[:T] with T = its rows), which would make the traces differ.
        tokens, targets = tokens[:, :-1].contiguous(), targets[:, :-1].contiguous()
    tokens2, targets2 = _second_inputs(tokens, targets)
    frozen = {i for i, p in enumerate(params) if not p.requires_grad}

    def trace(tok, tgt):
        try:
            return _Trace(model, loss_fn, params, buffers, pnames, bnames, tok, tgt)
        except ExportError:
            raise
        except Exception as e:
            file, line, code = _raising_frame(e)
            where = f" at {file}:{line}" if file else ""
            src = f"\n    {code}" if code else ""
            if "get value out of a tracing tensor" in str(e):
                raise ExportError(f"cannot export Tensor.item{where}: reads a tensor's value on "
                                  f"the host (.item(), float(t), bool(t) or `if t:` on a "
                                  f"computed tensor), which cannot be part of a graph; compute "
                                  f"it with tensor ops{src}",
                                  op="Tensor.item", file=file, line=line, code=code) from e
            raise ExportError(f"running the model on example inputs of shape "
                              f"{list(tok.shape)} failed{where}: {type(e).__name__}: {e}{src}",
                              op="make_fx", file=file, line=line, code=code) from e

    t1 = trace(tokens, targets)
    consts1 = _constant_nodes(t1.gm, len(params), len(buffers), frozen)
    t1.record(consts1)
    t2 = trace(tokens2, targets2)
    if len(t2.nodes) == len(t1.nodes):
        t2.record({t2.nodes[t1.nodes.index(n)] for n in consts1})

    state = {"max_seq": max_seq or _model_max_seq(model)}
    conv: List[_AtenConverter] = []

    def max_seq_fn():
        if state["max_seq"] is None:
            rows = conv[0].positional_rows
            state["max_seq"] = min(rows) if rows else example_seq
        return state["max_seq"]

    sizes = (tuple(tokens.shape), tuple(tokens2.shape))
    c = _AtenConverter(model, (t1, t2), sizes, no_decay, consts1, pnames, bnames, params,
                       buffers, max_seq_fn)
    conv.append(c)
    outputs = c.run()
    c.finish_outputs(outputs)
    ms = state["max_seq"]
    if ms is None:
        ms = min(c.positional_rows) if c.positional_rows else example_seq
    elif c.positional_rows and min(c.positional_rows) < ms:
        ms = min(c.positional_rows)
    meta = [("exporter", "ctr_export"), ("model", type(model).__name__),
            ("max_seq", str(int(ms)))]
    return c.finish(outputs, type(model).__name__.lower(), meta)
