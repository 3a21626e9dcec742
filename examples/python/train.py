#!/usr/bin/python3
"""train.py — the smallest complete training loop through libctr's Python binding.

Builds a tiny GPT in memory (the gpt preset, no graph file), trains it for 60 steps on one
CPU rank on libctr's built-in synthetic corpus and prints the loss every 10 steps: the Python
counterpart of examples/c/train.c, and the template for a Python host program.

    /usr/bin/python3 examples/python/train.py

It doubles as a test: any failing call raises ctr.CtrError (status and libctr's message), and
the script exits 1 if the final loss is not below the first, i.e. if training did not train.
Run from a source checkout it uses bindings/python and the library in build/; installed, the
installed ones.
"""
import os
import sys

# From a source checkout, use the binding next to this file rather than requiring an install.
_here = os.path.dirname(os.path.abspath(__file__))
_src = os.path.join(_here, "..", "..", "bindings", "python")
if os.path.isdir(os.path.join(_src, "ctr")):
    sys.path.insert(0, os.path.abspath(_src))

import ctr  # noqa: E402

BATCH, SEQ, STEPS = 8, 64, 60


def main():
    with ctr.Mesh() as mesh, \
            ctr.Graph.preset("gpt", layers=2, dim=128, heads=4, vocab=256, seq=SEQ) as graph, \
            ctr.Loader(None, seq=SEQ, seed=0) as loader, \
            ctr.Step(mesh, graph, batch=BATCH, seq=SEQ, lr=1e-3, warmup_steps=10) as step:
        mem = step.memory
        print(f"gpt: {graph.param_count} params, "
              f"{sum(mem.values()) / (1024 * 1024):.1f} MiB planned")
        first = loss = None
        for i in range(1, STEPS + 1):
            tokens, targets = loader.next(BATCH)
            step.set_input("tokens", tokens)
            step.set_input("targets", targets)
            m = step.run()
            loss = m["loss"]
            if first is None:
                first = loss
            if i == 1 or i % 10 == 0:
                print(f"step {i:2d} | loss {loss:.4f} | lr {m['lr']:.2e} | {m['step_ms']:.0f} ms")
    if not loss < first:
        print(f"train: the loss did not fall: {first:.4f} at step 1, {loss:.4f} at step {STEPS}",
              file=sys.stderr)
        return 1
    print(f"loss {first:.4f} -> {loss:.4f}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ctr.CtrError as e:
        print(f"train: {e}", file=sys.stderr)
        sys.exit(1)
