// The mesh: which rank this process is, how many there are, and their axes.

package ctr

/*
#include "ctr/ctr.h"
*/
import "C"

import "runtime"

// Mesh is a ctr_mesh: read-only after creation and safe to share between
// goroutines and steps.
type Mesh struct {
	ptr *C.ctr_mesh
	ref shared
}

// NewMesh is ctr_mesh_create. Keys: "device", "rank", "world", "mesh",
// "threads". nil options take every default (one CPU rank).
func NewMesh(opts *Options) (*Mesh, error) { return newMesh(opts, false) }

// NewMeshFromEnv is ctr_mesh_create_from_env: rank and world come from
// CTR_RANK/CTR_WORLD_SIZE (set by `ctr launch`), torchrun, Slurm or Open MPI
// variables, and opts override them. With more than one rank it joins the
// rendezvous and blocks until every rank has.
func NewMeshFromEnv(opts *Options) (*Mesh, error) { return newMesh(opts, true) }

func newMesh(opts *Options, fromEnv bool) (*Mesh, error) {
	co, err := opts.toC()
	if err != nil {
		return nil, err
	}
	defer C.ctr_options_free(co)
	var h *C.ctr_mesh
	err = call(func() C.ctr_status {
		if fromEnv {
			return C.ctr_mesh_create_from_env(co, &h)
		}
		return C.ctr_mesh_create(co, &h)
	})
	if err != nil {
		return nil, err
	}
	m := &Mesh{ptr: h}
	m.ref.free = func() { C.ctr_mesh_free(h) }
	runtime.SetFinalizer(m, (*Mesh).Close)
	return m, nil
}

// Close releases the mesh. Steps compiled on it keep it alive until they are
// closed themselves. Calling Close again does nothing.
func (m *Mesh) Close() error {
	m.ref.close()
	runtime.SetFinalizer(m, nil)
	return nil
}

// acquire returns the C mesh and keeps it from being freed by a concurrent
// Close until the matching m.ref.release(); nil once Close was called (the
// C accessors then return their documented values for NULL).
func (m *Mesh) acquire() *C.ctr_mesh {
	if m == nil || !m.ref.acquire() {
		return nil
	}
	return m.ptr
}

func (m *Mesh) done(h *C.ctr_mesh) {
	if h != nil {
		m.ref.release()
	}
}

// Rank of this process; 0 after Close.
func (m *Mesh) Rank() int {
	h := m.acquire()
	defer m.done(h)
	return int(C.ctr_mesh_rank(h))
}

// WorldSize is the number of ranks; 0 after Close.
func (m *Mesh) WorldSize() int {
	h := m.acquire()
	defer m.done(h)
	return int(C.ctr_mesh_world_size(h))
}

// DataRank is this rank's share of the global batch (the ranks of one
// tensor-parallel group compute on the same rows); 0 after Close.
func (m *Mesh) DataRank() int {
	h := m.acquire()
	defer m.done(h)
	return int(C.ctr_mesh_data_rank(h))
}

// DataSize is how many shares the global batch is split into; 0 after Close.
func (m *Mesh) DataSize() int {
	h := m.acquire()
	defer m.done(h)
	return int(C.ctr_mesh_data_size(h))
}

// AxisSize is the size of the named axis ("dp", "fsdp", "ep"), 1 for an axis
// the mesh lacks, 0 after Close.
func (m *Mesh) AxisSize(axis string) int {
	a, err := cstring("axis", axis)
	if err != nil {
		return 0
	}
	defer free(a)
	h := m.acquire()
	defer m.done(h)
	return int(C.ctr_mesh_axis_size(h, a))
}

// Device is "cpu" or "cuda"; "" after Close.
func (m *Mesh) Device() string {
	h := m.acquire()
	defer m.done(h)
	return C.GoString(C.ctr_mesh_device(h))
}
