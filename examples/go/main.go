// train — the smallest complete training loop through libctr's Go binding.
//
// The Go counterpart of examples/c/train.c: builds a tiny GPT in memory,
// trains 60 steps on one CPU rank over the library's built-in synthetic
// corpus and prints the loss every 10. It exits with status 1 if a call fails
// (printing the status name and the library's message) or if the final loss
// is not below the first, so it doubles as a test.
//
// Run (see bindings/go/README.md for linking without pkg-config):
//
//	PKG_CONFIG_PATH=<dir of ctr.pc> LD_LIBRARY_PATH=<build>/lib go run .
package main

import (
	"fmt"
	"os"

	"libctr.org/ctr"
)

const (
	batch = 8
	seq   = 64
	steps = 60
)

func train() (first, last float64, err error) {
	// The model: gpt preset, small enough to train in seconds on a CPU.
	graph, err := ctr.NewPresetGraph("gpt", ctr.NewOptions().
		SetInt("layers", 2).SetInt("dim", 128).SetInt("heads", 4).SetInt("vocab", 256).SetInt("seq", seq))
	if err != nil {
		return 0, 0, err
	}
	defer graph.Close()
	// One CPU rank; nil options take every default.
	mesh, err := ctr.NewMesh(nil)
	if err != nil {
		return 0, 0, err
	}
	defer mesh.Close()
	// The compiled step: autodiff, memory plan, AdamW state.
	step, err := ctr.NewStep(mesh, graph, ctr.NewOptions().
		SetInt("batch", batch).SetInt("seq", seq).SetFloat("lr", 1e-3).SetInt("warmup_steps", 10))
	if err != nil {
		return 0, 0, err
	}
	defer step.Close()
	params, err := graph.ParamCount()
	if err != nil {
		return 0, 0, err
	}
	mem, err := step.Memory()
	if err != nil {
		return 0, 0, err
	}
	fmt.Printf("gpt: %d params, %.1f MiB planned\n", params,
		float64(mem.ArenaBytes+mem.ParamBytes+mem.OptimizerBytes)/(1024*1024))

	// The built-in corpus (no path); attached, so a checkpoint would carry the
	// data position along with the weights.
	loader, err := ctr.NewBuiltinLoader(ctr.NewOptions().SetInt("seq", seq))
	if err != nil {
		return 0, 0, err
	}
	defer loader.Close()
	if err := step.AttachLoader(loader); err != nil {
		return 0, 0, err
	}

	for i := 1; i <= steps; i++ {
		if err := step.FeedFromLoader(batch); err != nil {
			return 0, 0, err
		}
		m, err := step.Run()
		if err != nil {
			return 0, 0, err
		}
		if i == 1 {
			first = m.Loss
		}
		last = m.Loss
		if i == 1 || i%10 == 0 {
			fmt.Printf("step %2d | loss %.4f | lr %.2e | %.0f ms\n", i, m.Loss, m.LR, m.StepMs)
		}
	}
	return first, last, nil
}

func main() {
	first, last, err := train()
	if err != nil {
		fmt.Fprintln(os.Stderr, "train:", err)
		os.Exit(1)
	}
	if !(last < first) {
		fmt.Fprintf(os.Stderr, "train: the loss did not fall: %.4f at step 1, %.4f at step %d\n", first, last, steps)
		os.Exit(1)
	}
	fmt.Printf("loss %.4f -> %.4f\n", first, last)
}
