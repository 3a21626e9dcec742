// The Go side of the cross-language bit-identity test.
//
// Runs the recipe of tests/bindings/xlang.c through the Go binding and prints
// `step <i> loss <%.17g>` per step; run_xlang.py compares the output byte for
// byte with the C, Rust and Python programs. Go's %.17g follows C's rules
// (17 significant digits, trailing zeros dropped, e+XX beyond 1e17).
package main

import (
	"fmt"
	"os"

	"libctr.org/ctr"
)

const (
	seq   = 64
	batch = 4
)

func run() error {
	graph, err := ctr.NewPresetGraph("gpt", ctr.NewOptions().
		SetInt("layers", 2).SetInt("dim", 64).SetInt("heads", 4).SetInt("vocab", 256).SetInt("seq", seq))
	if err != nil {
		return err
	}
	defer graph.Close()
	mesh, err := ctr.NewMesh(nil)
	if err != nil {
		return err
	}
	defer mesh.Close()
	step, err := ctr.NewStep(mesh, graph, ctr.NewOptions().
		SetInt("batch", batch).SetInt("seed", 1).SetFloat("lr", 1e-3).
		SetInt("warmup_steps", 2).SetInt("decay_steps", 10))
	if err != nil {
		return err
	}
	defer step.Close()
	loader, err := ctr.NewBuiltinLoader(ctr.NewOptions().SetInt("seq", seq).SetInt("seed", 0))
	if err != nil {
		return err
	}
	defer loader.Close()

	tokens, targets := make([]int32, batch*seq), make([]int32, batch*seq)
	for i := 1; i <= 10; i++ {
		if err := loader.Next(batch, tokens, targets); err != nil {
			return err
		}
		if err := step.SetInput("tokens", tokens); err != nil {
			return err
		}
		if err := step.SetInput("targets", targets); err != nil {
			return err
		}
		m, err := step.Run()
		if err != nil {
			return err
		}
		fmt.Printf("step %d loss %.17g\n", i, m.Loss)
	}
	return nil
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "xlang_go:", err)
		os.Exit(1)
	}
}
