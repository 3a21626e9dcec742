#!/usr/bin/python3
"""The fixed cross-language recipe, through the Python binding.

Prints exactly one line per step, `step <i> loss <loss as %.17g>`, for 10 steps, where i is
the step count libctr reports (1..10). The C, Rust and Go programs run the same recipe and
print the same lines, so a byte-for-byte comparison of the outputs shows that every binding
drives the library identically (same options, same data, same call order):

    gpt preset: layers=2 dim=64 heads=4 vocab=256 seq=64
    mesh: defaults
    step: batch=4 seed=1 lr=1e-3 warmup_steps=2 decay_steps=10
    data: Loader(None, seq=64, seed=0); each step tokens, targets = loader.next(4)

%.17g prints a double exactly, so equal lines mean bit-equal losses. Any error goes to stderr
with a nonzero exit.
"""
import os
import sys

_src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bindings", "python")
if os.path.isdir(os.path.join(_src, "ctr")):
    sys.path.insert(0, os.path.abspath(_src))

import ctr  # noqa: E402


def main():
    with ctr.Mesh() as mesh, \
            ctr.Graph.preset("gpt", layers=2, dim=64, heads=4, vocab=256, seq=64) as graph, \
            ctr.Loader(None, seq=64, seed=0) as loader, \
            ctr.Step(mesh, graph, batch=4, seed=1, lr=1e-3, warmup_steps=2,
                     decay_steps=10) as step:
        for _ in range(10):
            tokens, targets = loader.next(4)
            step.set_input("tokens", tokens)
            step.set_input("targets", targets)
            m = step.run()
            print("step %d loss %.17g" % (m["step"], m["loss"]))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except ctr.CtrError as e:
        print(f"xlang_python: {e}", file=sys.stderr)
        sys.exit(1)
