// The graph: what to train, loaded from a .ctrg file, from bytes, or built
// from a preset.

package ctr

/*
#include "ctr/ctr.h"
*/
import "C"

import (
	"runtime"
	"unsafe"
)

// Graph is a verified ctr_graph: read-only after creation and safe to share
// between goroutines and steps.
type Graph struct {
	ptr *C.ctr_graph
	ref shared
}

func wrapGraph(h *C.ctr_graph) *Graph {
	g := &Graph{ptr: h}
	g.ref.free = func() { C.ctr_graph_free(h) }
	runtime.SetFinalizer(g, (*Graph).Close)
	return g
}

// LoadGraphFile is ctr_graph_load_file; a malformed file fails with
// StatusInvalidGraph.
func LoadGraphFile(path string) (*Graph, error) {
	if abiErr != nil {
		return nil, abiErr
	}
	p, err := cstring("path", path)
	if err != nil {
		return nil, err
	}
	defer free(p)
	var h *C.ctr_graph
	if err := call(func() C.ctr_status { return C.ctr_graph_load_file(p, &h) }); err != nil {
		return nil, err
	}
	return wrapGraph(h), nil
}

// LoadGraphBuffer is ctr_graph_load_buffer; the bytes are copied.
func LoadGraphBuffer(data []byte) (*Graph, error) {
	if abiErr != nil {
		return nil, abiErr
	}
	var ptr unsafe.Pointer
	if len(data) > 0 {
		ptr = unsafe.Pointer(&data[0])
	}
	var h *C.ctr_graph
	if err := call(func() C.ctr_status { return C.ctr_graph_load_buffer(ptr, C.size_t(len(data)), &h) }); err != nil {
		return nil, err
	}
	return wrapGraph(h), nil
}

// NewPresetGraph is ctr_graph_create_preset: "gpt" or "llama", with keys
// "layers", "dim", "heads", "kv_heads", "vocab", "seq", "ffn_dim", "tied",
// "rope_theta", "norm_eps", "init_std".
func NewPresetGraph(preset string, opts *Options) (*Graph, error) {
	co, err := opts.toC()
	if err != nil {
		return nil, err
	}
	defer C.ctr_options_free(co)
	p, err := cstring("preset", preset)
	if err != nil {
		return nil, err
	}
	defer free(p)
	var h *C.ctr_graph
	if err := call(func() C.ctr_status { return C.ctr_graph_create_preset(p, co, &h) }); err != nil {
		return nil, err
	}
	return wrapGraph(h), nil
}

// Close releases the graph. Steps compiled from it keep it alive until they
// are closed themselves. Calling Close again does nothing.
func (g *Graph) Close() error {
	g.ref.close()
	runtime.SetFinalizer(g, nil)
	return nil
}

// acquire returns the C graph and keeps it from being freed by a concurrent
// Close until the matching g.ref.release(); an error once Close was called.
func (g *Graph) acquire() (*C.ctr_graph, error) {
	if g == nil || !g.ref.acquire() {
		return nil, newError(StatusInvalidState, "the graph is closed")
	}
	return g.ptr, nil
}

// SaveFile writes the graph as a .ctrg file.
func (g *Graph) SaveFile(path string) error {
	h, err := g.acquire()
	if err != nil {
		return err
	}
	defer g.ref.release()
	p, err := cstring("path", path)
	if err != nil {
		return err
	}
	defer free(p)
	return call(func() C.ctr_status { return C.ctr_graph_save_file(h, p) })
}

// InputNames are the host inputs ("tokens", "targets") in file order.
func (g *Graph) InputNames() ([]string, error) {
	return g.names(func(h *C.ctr_graph) C.size_t { return C.ctr_graph_num_inputs(h) },
		func(h *C.ctr_graph, i C.size_t, out **C.char) C.ctr_status { return C.ctr_graph_input_name(h, i, out) })
}

// ParamNames are the trained parameters in file order.
func (g *Graph) ParamNames() ([]string, error) {
	return g.names(func(h *C.ctr_graph) C.size_t { return C.ctr_graph_num_params(h) },
		func(h *C.ctr_graph, i C.size_t, out **C.char) C.ctr_status { return C.ctr_graph_param_name(h, i, out) })
}

func (g *Graph) names(count func(*C.ctr_graph) C.size_t,
	name func(*C.ctr_graph, C.size_t, **C.char) C.ctr_status) ([]string, error) {
	h, err := g.acquire()
	if err != nil {
		return nil, err
	}
	defer g.ref.release()
	n := count(h)
	out := make([]string, 0, int(n))
	for i := C.size_t(0); i < n; i++ {
		var s *C.char
		if err := call(func() C.ctr_status { return name(h, i, &s) }); err != nil {
			return nil, err
		}
		out = append(out, C.GoString(s))
	}
	return out, nil
}

// TensorInfo is the dtype and shape of a graph tensor; -1 marks a symbolic
// dim (batch, seq).
type TensorInfo struct {
	DType DType
	Dims  []int64
}

// NumElements is the element count, or -1 while a dim is symbolic.
func (t TensorInfo) NumElements() int64 {
	n := int64(1)
	for _, d := range t.Dims {
		if d < 0 {
			return -1
		}
		n *= d
	}
	return n
}

// TensorInfo describes the named tensor.
func (g *Graph) TensorInfo(name string) (TensorInfo, error) {
	h, err := g.acquire()
	if err != nil {
		return TensorInfo{}, err
	}
	defer g.ref.release()
	return tensorInfo(h, name)
}

// tensorInfo works on a C graph the caller keeps alive (a step holds a
// reference on its graph even after the owner's Close).
func tensorInfo(h *C.ctr_graph, name string) (TensorInfo, error) {
	n, err := cstring("tensor name", name)
	if err != nil {
		return TensorInfo{}, err
	}
	defer free(n)
	// The header offers no way to ask for the rank alone and a too-small
	// buffer fails without saying how large it must be; graph tensors have a
	// handful of dims, so a generous buffer is tried, then a huge one.
	for _, capacity := range []int{16, 4096} {
		dims := make([]int64, capacity)
		var dtype C.ctr_dtype
		var ndim C.size_t
		err = call(func() C.ctr_status {
			return C.ctr_graph_tensor_info(h, n, &dtype, (*C.int64_t)(unsafe.Pointer(&dims[0])), C.size_t(capacity), &ndim)
		})
		if err == nil {
			return TensorInfo{DType: DType(dtype), Dims: dims[:int(ndim)]}, nil
		}
		if StatusOf(err) != StatusInvalidArgument {
			break
		}
	}
	return TensorInfo{}, err
}

// ParamCount is the total number of trained parameter elements.
func (g *Graph) ParamCount() (int64, error) {
	h, err := g.acquire()
	if err != nil {
		return 0, err
	}
	defer g.ref.release()
	var n C.int64_t
	err = call(func() C.ctr_status { return C.ctr_graph_param_count(h, &n) })
	return int64(n), err
}

// Plan is ctr_plan: the planner's layouts of this graph's step as JSON text.
// Keys: "world", "global_batch", "cluster" (a profile's JSON text or file),
// and optionally "seq", "recompute", "top".
func (g *Graph) Plan(opts *Options) (string, error) {
	h, err := g.acquire()
	if err != nil {
		return "", err
	}
	defer g.ref.release()
	co, err := opts.toC()
	if err != nil {
		return "", err
	}
	defer C.ctr_options_free(co)
	var out string
	err = call(func() C.ctr_status {
		var text *C.char
		st := C.ctr_plan(h, co, &text)
		if st == C.CTR_STATUS_OK {
			out = C.GoString(text) // (the library's copy belongs to this OS thread)
		}
		return st
	})
	return out, err
}

// FlopsPerToken is the training FLOPs per token at sequence length seq
// (0 = the graph's maximum).
func (g *Graph) FlopsPerToken(seq int64) (float64, error) {
	h, err := g.acquire()
	if err != nil {
		return 0, err
	}
	defer g.ref.release()
	var f C.double
	err = call(func() C.ctr_status { return C.ctr_graph_flops_per_token(h, C.int64_t(seq), &f) })
	return float64(f), err
}
