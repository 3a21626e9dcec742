"""Command line of the exporter: write a reference model, or any model a factory builds, as a
libctr graph file.

    /usr/bin/python3 -m ctr_export gpt --layers 4 --dim 256 --heads 4 -o gpt.ctrg
    /usr/bin/python3 -m ctr_export llama --layers 2 --dim 128 --heads 4 --kv-heads 2 -o l.ctrg
    /usr/bin/python3 -m ctr_export --factory mypkg.models:make -o mine.ctrg
    /usr/bin/python3 -m ctr_export gpt --tracer aten -o gpt.ctrg  # trace the ATen ops instead
    ctr-export ...                                   # the same, once pip-installed

(with tools/export on PYTHONPATH when run from the source tree). A factory is a callable
returning (module, example_inputs) or (module, example_inputs, loss_fn), as export() takes
them. --state-dict loads weights saved with torch.save(model.state_dict()) before exporting,
so a model trained in PyTorch continues training in libctr from where it was.
"""

import argparse
import importlib
import sys


def _models():
    try:
        from . import models  # installed: the reference models ship as ctr_export.models
    except ImportError:
        import models  # source tree: tools/export/models next to this package
    return models


def _reference(args):
    import torch

    m = _models()
    if args.model == "gpt":
        if args.kv_heads not in (None, args.heads):
            raise SystemExit("ctr-export: the gpt preset has no grouped-query attention")
        cfg = m.GPTConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, dim=args.dim,
                          heads=args.heads, tie_embeddings=not args.untied, eps=args.norm_eps)
        model = m.GPT(cfg, seed=args.seed)
    else:
        cfg = m.LlamaConfig(vocab=args.vocab, seq=args.seq, layers=args.layers, dim=args.dim,
                            heads=args.heads,
                            kv_heads=args.kv_heads if args.kv_heads else args.heads,
                            ffn_dim=args.ffn_dim or None, rope_theta=args.rope_theta,
                            tie_embeddings=args.tied, eps=args.norm_eps)
        model = m.Llama(cfg, seed=args.seed)
    t = min(args.seq, 16)
    example = (torch.zeros(2, t, dtype=torch.long), torch.zeros(2, t, dtype=torch.long))
    return model, example, None


def _factory(spec):
    mod_name, _, attr = spec.partition(":")
    if not attr:
        raise SystemExit(f"ctr-export: --factory takes MODULE:CALLABLE, got {spec!r}")
    sys.path.insert(0, "")  # a factory next to the caller, as `python -m` users expect
    fn = getattr(importlib.import_module(mod_name), attr)
    made = fn()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise SystemExit("ctr-export: the factory must return (module, example_inputs) or "
                         "(module, example_inputs, loss_fn)")
    return made if len(made) == 3 else (made[0], made[1], None)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="ctr-export",
                                 description="Export a PyTorch model as a libctr graph (.ctrg).")
    ap.add_argument("model", nargs="?", choices=("gpt", "llama"),
                    help="a reference model (tools/export/models)")
    ap.add_argument("--factory", metavar="MODULE:CALLABLE",
                    help="build the model with this callable instead")
    ap.add_argument("-o", "--output", required=True, help="the .ctrg file to write")
    ap.add_argument("--state-dict", help="load these weights (torch.save of a state_dict)")
    ap.add_argument("--max-seq", type=int, help="longest sequence the graph accepts")
    ap.add_argument("--tracer", choices=("auto", "aten", "fx"), default="auto",
                    help="aten: record the ATen ops the model runs (make_fx; ordinary model "
                         "code); fx: torch.fx with ctr_op modules kept whole (the reference "
                         "models); auto (default): fx when the model has ctr_op modules")
    g = ap.add_argument_group("reference model sizes")
    g.add_argument("--layers", type=int, default=4)
    g.add_argument("--dim", type=int, default=256)
    g.add_argument("--heads", type=int, default=4)
    g.add_argument("--kv-heads", type=int, default=None)
    g.add_argument("--vocab", type=int, default=256)
    g.add_argument("--seq", type=int, default=256)
    g.add_argument("--ffn-dim", type=int, default=0, help="llama only; 0: the preset default")
    g.add_argument("--rope-theta", type=float, default=10000.0)
    g.add_argument("--norm-eps", type=float, default=1e-5)
    g.add_argument("--untied", action="store_true", help="gpt: a separate lm_head")
    g.add_argument("--tied", action="store_true", help="llama: output tied to the embedding")
    g.add_argument("--seed", type=int, default=0, help="initialisation seed")
    args = ap.parse_args(argv)
    if (args.model is None) == (args.factory is None):
        ap.error("give either a reference model (gpt, llama) or --factory")

    import torch

    from . import ExportError, SchemaError, export

    model, example, loss_fn = _factory(args.factory) if args.factory else _reference(args)
    if args.state_dict:
        model.load_state_dict(torch.load(args.state_dict, map_location="cpu"))
    try:
        data = export(model, example, loss_fn, args.output, max_seq=args.max_seq,
                      tracer=args.tracer)
    except (ExportError, SchemaError) as e:
        print(f"ctr-export: error: {e}", file=sys.stderr)
        return 1
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.output}: {type(model).__name__}, {n:,} parameters, {len(data):,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
