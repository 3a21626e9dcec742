// The mesh: which rank this process is, how many there are, and their axes.

package ctr

/*
#include <stdlib.h>
#include "ctr/ctr.h"
*/
import "C"

import (
	"runtime"
	"unsafe"
)

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

// Describe is ctr_mesh_describe: the mesh as JSON text (rank, world, axes,
// device, transport, timeout_s).
func (m *Mesh) Describe() (string, error) {
	h := m.acquire()
	defer m.done(h)
	var text *C.char
	if err := call(func() C.ctr_status { return C.ctr_mesh_describe(h, &text) }); err != nil {
		return "", err
	}
	return C.GoString(text), nil
}

// onAxis runs f with the C mesh and the axis name as a C string, as a call.
func (m *Mesh) onAxis(axis string, f func(h *C.ctr_mesh, a *C.char) C.ctr_status) error {
	a, err := cstring("axis", axis)
	if err != nil {
		return err
	}
	defer free(a)
	h := m.acquire()
	defer m.done(h)
	return call(func() C.ctr_status { return f(h, a) })
}

// Group is ctr_mesh_group and ctr_mesh_group_member: this rank's index in its
// group over axis ("world" or a mesh axis), and the members' world ranks.
func (m *Mesh) Group(axis string) (int, []int, error) {
	var me, size C.int
	if err := m.onAxis(axis, func(h *C.ctr_mesh, a *C.char) C.ctr_status {
		return C.ctr_mesh_group(h, a, &me, &size)
	}); err != nil {
		return 0, nil, err
	}
	members := make([]int, int(size))
	for i := range members {
		var r C.int
		if err := m.onAxis(axis, func(h *C.ctr_mesh, a *C.char) C.ctr_status {
			return C.ctr_mesh_group_member(h, a, C.int(i), &r)
		}); err != nil {
			return 0, nil, err
		}
		members[i] = int(r)
	}
	return int(me), members, nil
}

var reduceOps = map[string]C.ctr_reduce_op{"sum": C.CTR_REDUCE_SUM, "avg": C.CTR_REDUCE_AVG,
	"max": C.CTR_REDUCE_MAX, "min": C.CTR_REDUCE_MIN}

// AllReduceFloat64 is ctr_mesh_all_reduce over float64 data, in place: op
// "sum", "avg", "max" or "min". Host collectives block with the mesh's
// deadline; every member of the group calls the same ones in the same order,
// and none while a step of this mesh runs on another goroutine.
func (m *Mesh) AllReduceFloat64(axis string, data []float64, op string) error {
	r, ok := reduceOps[op]
	if !ok {
		return newError(StatusInvalidArgument, "reduction %q (sum, avg, max or min)", op)
	}
	var p unsafe.Pointer
	if len(data) > 0 {
		p = unsafe.Pointer(&data[0])
	}
	return m.onAxis(axis, func(h *C.ctr_mesh, a *C.char) C.ctr_status {
		return C.ctr_mesh_all_reduce(h, a, p, p, C.size_t(len(data)), C.CTR_DTYPE_F64, r)
	})
}

// AllGatherBytes is ctr_mesh_all_gather: every member's data (of one length),
// concatenated in member order.
func (m *Mesh) AllGatherBytes(axis string, data []byte) ([]byte, error) {
	_, members, err := m.Group(axis)
	if err != nil {
		return nil, err
	}
	out := make([]byte, len(data)*len(members))
	if len(data) == 0 {
		return out, nil
	}
	err = m.onAxis(axis, func(h *C.ctr_mesh, a *C.char) C.ctr_status {
		return C.ctr_mesh_all_gather(h, a, unsafe.Pointer(&data[0]), unsafe.Pointer(&out[0]), C.size_t(len(data)))
	})
	return out, err
}

// Barrier is ctr_mesh_barrier.
func (m *Mesh) Barrier(axis string) error {
	return m.onAxis(axis, func(h *C.ctr_mesh, a *C.char) C.ctr_status { return C.ctr_mesh_barrier(h, a) })
}
