"""Export a PyTorch module as a libctr training graph (.ctrg) with its weights embedded.

    import ctr_export
    ctr_export.export(model, (tokens, targets), None, "model.ctrg")
    # or, for a model that returns logits only:
    ctr_export.export(model, (tokens, targets), lambda logits, y: F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), y.reshape(-1)), "model.ctrg")

The graph has the host inputs "tokens" and "targets" ([batch, seq] integers, both dims
symbolic so one file trains at any batch size and sequence length), every parameter under its
PyTorch name ("layers.0.attn.wq.weight") with its current value, the logits under the name
"logits" and the scalar loss. libctr derives the backward pass, the optimizer and the
sharding itself, so only the forward computation is exported.

The module is traced with torch.fx and mapped op by op onto libctr's graph op set (see
trace.py for how, and for the list of supported ops); an op without an equivalent is an
ExportError naming the op and the source line that called it. The file is written with the
Python code flatc generates from graphs/ctr_graph.fbs (see graphfile.py).
"""

import logging
import os
from typing import Callable, Optional, Sequence, Union

# PyPI's torch is built with CUDA; where triton is not installed (it serves GPU code only, and
# exporting never needs it) torch.utils.flop_counter warns at its import, which tracing
# triggers, that triton kernels' flops cannot be counted. Quiet that one logger unless the
# user configured it.
_flop_log = logging.getLogger("torch.utils.flop_counter")
if _flop_log.level == logging.NOTSET:
    _flop_log.setLevel(logging.ERROR)

from .graphfile import GraphDef, SchemaError, serialize
from .aten import convert_aten
from .trace import ExportError, convert

__all__ = ["export", "export_bytes", "ExportError", "SchemaError", "default_no_decay"]


def default_no_decay(name: str, param) -> bool:
    """Weight decay skips 1-D parameters (norm gains, biases), as libctr's presets do."""
    return param.dim() < 2


def _inputs(example_inputs):
    if isinstance(example_inputs, dict):
        missing = {"tokens", "targets"} - set(example_inputs)
        if missing:
            raise ExportError(f"example_inputs lacks {sorted(missing)} (libctr's inputs are "
                              f"'tokens' and 'targets')")
        return example_inputs["tokens"], example_inputs["targets"]
    if isinstance(example_inputs, Sequence) and len(example_inputs) == 2:
        return example_inputs[0], example_inputs[1]
    raise ExportError("example_inputs must be (tokens, targets) or a dict with those keys")


def _tracer_for(module, tracer: str) -> str:
    if tracer not in ("auto", "aten", "fx"):
        raise ExportError(f"tracer '{tracer}': use 'auto', 'aten' or 'fx'")
    if tracer != "auto":
        return tracer
    # Modules that name a libctr op (the reference models) are mapped whole by the fx tracer.
    has_ctr_op = any(isinstance(getattr(type(m), "ctr_op", None), str) for m in module.modules())
    return "fx" if has_ctr_op else "aten"


def to_graph(module, example_inputs, loss_fn: Optional[Callable] = None, *,
             max_seq: Optional[int] = None, no_decay: Callable = default_no_decay,
             tracer: str = "auto") -> GraphDef:
    """The graph as Python objects (graphfile.GraphDef), before serialization."""
    tokens, targets = _inputs(example_inputs)
    if _tracer_for(module, tracer) == "fx":
        return convert(module, tokens, targets, loss_fn, no_decay, max_seq)
    return convert_aten(module, tokens, targets, loss_fn, no_decay, max_seq)


def export_bytes(module, example_inputs, loss_fn: Optional[Callable] = None, *,
                 max_seq: Optional[int] = None, no_decay: Callable = default_no_decay,
                 tracer: str = "auto") -> bytes:
    """The .ctrg file's bytes (see export)."""
    return serialize(to_graph(module, example_inputs, loss_fn, max_seq=max_seq,
                              no_decay=no_decay, tracer=tracer))


def export(module, example_inputs, loss_fn: Optional[Callable] = None,
           path: Union[str, os.PathLike, None] = None, *, max_seq: Optional[int] = None,
           no_decay: Callable = default_no_decay, tracer: str = "auto") -> bytes:
    """Writes `module` and its loss as a libctr graph file at `path`; returns the bytes.

    module          an nn.Module. With loss_fn None it is called as module(tokens, targets)
                    and returns the scalar loss or (logits, loss); otherwise it is called as
                    module(tokens) and loss_fn(output, targets) gives the loss.
    example_inputs  (tokens, targets) or {"tokens": ..., "targets": ...}: [batch, seq] integer
                    tensors. Any small sizes do; they only drive the trace (seq >= 2 is best).
    max_seq         the longest sequence the graph accepts, recorded as its default "seq";
                    default: the rows of the positional table, else model.cfg.seq, else the
                    example's length.
    no_decay        (name, parameter) -> True to exclude a parameter from weight decay.
    tracer          "aten": make_fx records the ATen ops the model runs (ordinary model code;
                    aten.py); "fx": torch.fx symbolic tracing with modules that name a libctr
                    op in `ctr_op` kept whole (the reference models; trace.py); "auto" (default):
                    "fx" when the model has such modules, else "aten".
    """
    data = export_bytes(module, example_inputs, loss_fn, max_seq=max_seq, no_decay=no_decay,
                        tracer=tracer)
    if path is not None:
        tmp = os.fspath(path) + ".tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)  # never leave a half-written graph under the final name
    return data
