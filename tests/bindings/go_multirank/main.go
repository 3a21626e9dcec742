// One rank of a data-parallel run driven from Go, started by `ctr launch`.
//
// usage: go_multirank MESH GLOBAL_BATCH STEPS [CKPT_DIR]
//
// The mesh comes from the environment that `ctr launch` sets (rank, world,
// rendezvous address) through NewMeshFromEnv, with the axes from MESH (e.g.
// "fsdp=2"). Every rank advances the built-in corpus loader by the same
// global batch and reads and feeds only its own contiguous rows of it
// (ctr_loader_next_slice), so any world size trains on the same data and
// tests/bindings/run_go_multirank.py can compare the losses of two ranks with
// those of one. Rank 0 prints `step <i> loss <%.9g>`; with
// CKPT_DIR every rank takes part in a collective checkpoint save at the end.
package main

import (
	"fmt"
	"os"
	"strconv"

	"libctr.org/ctr"
)

const seq = 32

func run() error {
	if len(os.Args) < 4 {
		return fmt.Errorf("usage: %s MESH GLOBAL_BATCH STEPS [CKPT_DIR]", os.Args[0])
	}
	meshSpec := os.Args[1]
	globalBatch, err1 := strconv.Atoi(os.Args[2])
	steps, err2 := strconv.Atoi(os.Args[3])
	if err1 != nil || err2 != nil {
		return fmt.Errorf("GLOBAL_BATCH and STEPS must be integers")
	}

	mesh, err := ctr.NewMeshFromEnv(ctr.NewOptions().SetString("mesh", meshSpec))
	if err != nil {
		return err
	}
	defer mesh.Close()
	rank, world := mesh.Rank(), mesh.WorldSize()
	if globalBatch%world != 0 {
		return fmt.Errorf("global batch %d does not split over %d ranks", globalBatch, world)
	}
	local := globalBatch / world

	graph, err := ctr.NewPresetGraph("gpt", ctr.NewOptions().
		SetInt("layers", 2).SetInt("dim", 32).SetInt("heads", 4).SetInt("vocab", 256).SetInt("seq", seq))
	if err != nil {
		return err
	}
	defer graph.Close()
	step, err := ctr.NewStep(mesh, graph, ctr.NewOptions().
		SetInt("batch", int64(local)).SetInt("seed", 3).SetFloat("lr", 3e-3).
		SetInt("warmup_steps", 2).SetInt("decay_steps", int64(steps)))
	if err != nil {
		return err
	}
	defer step.Close()
	loader, err := ctr.NewBuiltinLoader(ctr.NewOptions().SetInt("seq", seq).SetInt("seed", 0))
	if err != nil {
		return err
	}
	defer loader.Close()
	if err := step.AttachLoader(loader); err != nil {
		return err
	}

	// Each rank reads only its own rows of the global batch; the loader still
	// advances by the whole batch, so its state is the same on every rank.
	tokens, targets := make([]int32, local*seq), make([]int32, local*seq)
	for i := 1; i <= steps; i++ {
		if err := loader.NextSlice(globalBatch, rank*local, tokens, targets); err != nil {
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
		if rank == 0 {
			fmt.Printf("step %d loss %.9g\n", i, m.Loss)
		}
	}
	if len(os.Args) > 4 {
		if err := step.Save(os.Args[4]); err != nil {
			return err
		}
	}
	fmt.Fprintf(os.Stderr, "go_multirank: rank %d of %d done\n", rank, world)
	return nil
}

func main() {
	if err := run(); err != nil {
		fmt.Fprintln(os.Stderr, "go_multirank:", err)
		os.Exit(1)
	}
}
