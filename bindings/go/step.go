// The step: the compiled, runnable training step and its state (parameters,
// optimizer state, schedule position), plus checkpoints and weights.

package ctr

/*
#include <string.h>
#include "ctr/ctr.h"

// Runs one step into a metrics struct that Go allocated. The size field has
// to be the C sizeof, which only C knows for sure, so it is set here.
static ctr_status ctrgo_step_run(ctr_step *step, ctr_step_metrics *m) {
  memset(m, 0, sizeof *m);
  m->size = sizeof *m;
  return ctr_step_run(step, m);
}

// The same for one layer's MoE metrics, whose size field is also the C sizeof.
static ctr_status ctrgo_step_moe_layer(ctr_step *step, size_t i, ctr_moe_layer_metrics *m) {
  memset(m, 0, sizeof *m);
  m->size = sizeof *m;
  return ctr_step_moe_layer(step, i, m);
}
*/
import "C"

import (
	"encoding/json"
	"runtime"
	"strings"
	"sync"
	"unsafe"
)

// Step is a compiled ctr_step. Its methods may be called from any goroutine;
// a mutex serialises them, as the header allows one thread at a time. The
// step holds its mesh, graph and attached loader open until it is closed.
type Step struct {
	mu     sync.Mutex
	ptr    *C.ctr_step
	mesh   *Mesh
	graph  *Graph
	loader *Loader
}

// Metrics is what one Run did (ctr_step_metrics without its size field).
type Metrics struct {
	Step        int64   // optimizer steps taken, including this one
	Loss        float64 // mean loss over the micro-batches
	GradNorm    float64 // global gradient norm before clipping
	LR          float64 // learning rate used by this step
	StepMs      float64
	ForwardMs   float64
	BackwardMs  float64
	OptimizerMs float64
	TokensPerS  float64
	Tokens      int64
	PeakBytes   int64
	SaveWaitMs  float64 // time this step waited to publish a background save
	// Since 0.2:
	ComputeMs     float64 // forward and backward, less ExposedCommMs
	CommMs        float64 // time collectives were in flight on the comm stream
	ExposedCommMs float64 // time compute waited for communication (not hidden)
}

// Resumed is what Resume loaded.
type Resumed struct {
	Path    string   // the checkpoint directory loaded
	Skipped []string // damaged checkpoints passed over, in the order tried: "DIR: reason" each
}

// Memory is the planned memory of a step, in bytes.
type Memory struct {
	ArenaBytes, ParamBytes, OptimizerBytes int64
}

// NewStep is ctr_step_create: compiles graph for mesh. Keys: "batch"
// (required), "seq", "micro_batches", "seed", "lr", "min_lr",
// "warmup_steps", "decay_steps", "schedule", "beta1", "beta2", "eps",
// "weight_decay", "grad_clip", "check_finite", "reshard_after_forward", "keep".
func NewStep(mesh *Mesh, graph *Graph, opts *Options) (*Step, error) {
	if mesh == nil || !mesh.ref.acquire() {
		return nil, newError(StatusInvalidArgument, "NewStep: the mesh is nil or closed")
	}
	if graph == nil || !graph.ref.acquire() {
		mesh.ref.release()
		return nil, newError(StatusInvalidArgument, "NewStep: the graph is nil or closed")
	}
	co, err := opts.toC()
	if err == nil {
		var h *C.ctr_step
		err = call(func() C.ctr_status { return C.ctr_step_create(mesh.ptr, graph.ptr, co, &h) })
		C.ctr_options_free(co)
		if err == nil {
			s := &Step{ptr: h, mesh: mesh, graph: graph}
			runtime.SetFinalizer(s, (*Step).Close)
			return s, nil
		}
	}
	graph.ref.release()
	mesh.ref.release()
	return nil, err
}

// Close frees the step, then lets go of its mesh, graph and loader. Calling
// Close again does nothing.
func (s *Step) Close() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ptr == nil {
		return nil
	}
	C.ctr_step_free(s.ptr)
	s.ptr = nil
	if s.loader != nil {
		s.loader.ref.release()
		s.loader = nil
	}
	s.graph.ref.release()
	s.mesh.ref.release()
	runtime.SetFinalizer(s, nil)
	return nil
}

// lock takes the step's mutex and returns the C handle, or an error (with the
// mutex released) once the step is closed.
func (s *Step) lock() (*C.ctr_step, error) {
	s.mu.Lock()
	if s.ptr == nil {
		s.mu.Unlock()
		return nil, newError(StatusInvalidState, "the step is closed")
	}
	return s.ptr, nil
}

// Mesh and Graph return what the step was compiled for.
func (s *Step) Mesh() *Mesh   { return s.mesh }
func (s *Step) Graph() *Graph { return s.graph }

// SetInput copies host data into the named input for the next run. data is
// a slice of int32, int64, uint8, uint16, uint32, float32 or float64; the
// library checks its byte size and, for token inputs, the id range.
func (s *Step) SetInput(name string, data interface{}) error {
	ptr, bytes, err := sliceBytes(data)
	if err != nil {
		return err
	}
	h, err := s.lock()
	if err != nil {
		return err
	}
	defer s.mu.Unlock()
	n, err := cstring("input name", name)
	if err != nil {
		return err
	}
	defer free(n)
	err = call(func() C.ctr_status { return C.ctr_step_set_input(h, n, ptr, C.size_t(bytes)) })
	runtime.KeepAlive(data)
	return err
}

// sliceBytes is the address and byte size of a slice of plain numbers.
func sliceBytes(data interface{}) (unsafe.Pointer, uintptr, error) {
	var p unsafe.Pointer
	var n, size uintptr
	switch d := data.(type) {
	case []int32:
		n, size = uintptr(len(d)), 4
		if n > 0 {
			p = unsafe.Pointer(&d[0])
		}
	case []int64:
		n, size = uintptr(len(d)), 8
		if n > 0 {
			p = unsafe.Pointer(&d[0])
		}
	case []uint8:
		n, size = uintptr(len(d)), 1
		if n > 0 {
			p = unsafe.Pointer(&d[0])
		}
	case []uint16:
		n, size = uintptr(len(d)), 2
		if n > 0 {
			p = unsafe.Pointer(&d[0])
		}
	case []uint32:
		n, size = uintptr(len(d)), 4
		if n > 0 {
			p = unsafe.Pointer(&d[0])
		}
	case []float32:
		n, size = uintptr(len(d)), 4
		if n > 0 {
			p = unsafe.Pointer(&d[0])
		}
	case []float64:
		n, size = uintptr(len(d)), 8
		if n > 0 {
			p = unsafe.Pointer(&d[0])
		}
	default:
		return nil, 0, newError(StatusInvalidArgument, "SetInput: unsupported data type %T", data)
	}
	return p, n * size, nil
}

// Run is forward, backward and the optimizer update on the inputs last set.
func (s *Step) Run() (Metrics, error) {
	h, err := s.lock()
	if err != nil {
		return Metrics{}, err
	}
	defer s.mu.Unlock()
	var m C.ctr_step_metrics
	if err := call(func() C.ctr_status { return C.ctrgo_step_run(h, &m) }); err != nil {
		return Metrics{}, err
	}
	return Metrics{
		Step: int64(m.step), Loss: float64(m.loss), GradNorm: float64(m.grad_norm), LR: float64(m.lr),
		StepMs: float64(m.step_ms), ForwardMs: float64(m.forward_ms), BackwardMs: float64(m.backward_ms),
		OptimizerMs: float64(m.optimizer_ms), TokensPerS: float64(m.tokens_per_s),
		Tokens: int64(m.tokens), PeakBytes: int64(m.peak_bytes), SaveWaitMs: float64(m.save_wait_ms),
		ComputeMs: float64(m.compute_ms), CommMs: float64(m.comm_ms), ExposedCommMs: float64(m.exposed_comm_ms),
	}, nil
}

// Evaluate is forward only, no update: the mean loss on the inputs last set.
func (s *Step) Evaluate() (float64, error) {
	h, err := s.lock()
	if err != nil {
		return 0, err
	}
	defer s.mu.Unlock()
	var loss C.double
	err = call(func() C.ctr_status { return C.ctr_step_evaluate(h, &loss) })
	return float64(loss), err
}

// floats copies f32 data between the step and a Go slice through one of
// ctr_step_get_param, ctr_step_set_param or ctr_step_get_output.
func (s *Step) floats(name string, buf []float32, f func(*C.ctr_step, *C.char, *C.float, C.size_t) C.ctr_status) error {
	h, err := s.lock()
	if err != nil {
		return err
	}
	defer s.mu.Unlock()
	n, err := cstring("tensor name", name)
	if err != nil {
		return err
	}
	defer free(n)
	var p *C.float
	if len(buf) > 0 {
		p = (*C.float)(unsafe.Pointer(&buf[0]))
	}
	err = call(func() C.ctr_status { return f(h, n, p, C.size_t(len(buf))) })
	runtime.KeepAlive(buf)
	return err
}

// GetParam copies the named parameter into out, which has its element count.
func (s *Step) GetParam(name string, out []float32) error {
	return s.floats(name, out, func(h *C.ctr_step, n *C.char, p *C.float, c C.size_t) C.ctr_status {
		return C.ctr_step_get_param(h, n, p, c)
	})
}

// Param returns the named parameter in a new slice sized from the graph.
func (s *Step) Param(name string) ([]float32, error) {
	// The step's own reference keeps the graph's C handle valid even if the
	// owner has closed it.
	info, err := tensorInfo(s.graph.ptr, name)
	if err != nil {
		return nil, err
	}
	n := info.NumElements()
	if n < 0 {
		return nil, newError(StatusInvalidArgument, "parameter %q has a symbolic dim", name)
	}
	out := make([]float32, n)
	if err := s.GetParam(name, out); err != nil {
		return nil, err
	}
	return out, nil
}

// SetParam sets the named parameter from data, which has its element count.
func (s *Step) SetParam(name string, data []float32) error {
	return s.floats(name, data, func(h *C.ctr_step, n *C.char, p *C.float, c C.size_t) C.ctr_status {
		return C.ctr_step_set_param(h, n, p, c)
	})
}

// GetOutput copies a forward activation named in the step option "keep"
// into out (its element count for one micro-batch).
func (s *Step) GetOutput(name string, out []float32) error {
	return s.floats(name, out, func(h *C.ctr_step, n *C.char, p *C.float, c C.size_t) C.ctr_status {
		return C.ctr_step_get_output(h, n, p, c)
	})
}

// MoELayer is one mixture-of-experts layer's figures of the last run.
type MoELayer struct {
	Layer           string  `json:"layer"`
	Experts         int64   `json:"-"` // len(TokensPerExpert)
	TokensPerExpert []int64 `json:"tokens_per_expert"`
	AuxLoss         float64 `json:"aux_loss"`
	ZLoss           float64 `json:"z_loss"`
}

// MoEMetrics returns the mixture-of-experts layers of the last run: the tokens
// each expert received (summed over micro-batches and ranks) and the layer's
// auxiliary losses; empty for a graph without experts.
func (s *Step) MoEMetrics() ([]MoELayer, error) {
	h, err := s.lock()
	if err != nil {
		return nil, err
	}
	defer s.mu.Unlock()
	var text *C.char
	if err := call(func() C.ctr_status { return C.ctr_step_moe_metrics(h, &text) }); err != nil {
		return nil, err
	}
	var layers []MoELayer
	if err := json.Unmarshal([]byte(C.GoString(text)), &layers); err != nil {
		return nil, err
	}
	for i := range layers {
		layers[i].Experts = int64(len(layers[i].TokensPerExpert))
	}
	return layers, nil
}

// MoELayers is MoEMetrics through the struct call (ctr_step_moe_layer, since
// 0.6), without JSON: the same layers, copied, except that a loss the layer
// lacks is NaN (MoEMetrics leaves it 0).
func (s *Step) MoELayers() ([]MoELayer, error) {
	h, err := s.lock()
	if err != nil {
		return nil, err
	}
	defer s.mu.Unlock()
	layers := make([]MoELayer, int(C.ctr_step_moe_layers(h)))
	for i := range layers {
		var m C.ctr_moe_layer_metrics
		if err := call(func() C.ctr_status { return C.ctrgo_step_moe_layer(h, C.size_t(i), &m) }); err != nil {
			return nil, err
		}
		// Copied under the step's lock: the name and counts live until its next call.
		counts := make([]int64, int(m.experts))
		if len(counts) > 0 {
			copy(counts, unsafe.Slice((*int64)(unsafe.Pointer(m.tokens_per_expert)), len(counts)))
		}
		layers[i] = MoELayer{Layer: C.GoString(m.layer), Experts: int64(m.experts), TokensPerExpert: counts,
			AuxLoss: float64(m.aux_loss), ZLoss: float64(m.z_loss)}
	}
	return layers, nil
}

// CommMetrics returns the milliseconds the last run's collectives were in
// flight, per mesh axis; empty without collectives.
func (s *Step) CommMetrics() (map[string]float64, error) {
	h, err := s.lock()
	if err != nil {
		return nil, err
	}
	defer s.mu.Unlock()
	var text *C.char
	if err := call(func() C.ctr_status { return C.ctr_step_comm_metrics(h, &text) }); err != nil {
		return nil, err
	}
	axes := map[string]float64{}
	if err := json.Unmarshal([]byte(C.GoString(text)), &axes); err != nil {
		return nil, err
	}
	return axes, nil
}

// Timeline returns the tasks of the last run on this rank as JSON text: an
// array of {"name", "cat", "stage", "micro_batch", "start_us", "dur_us"} in the
// order they ran.
func (s *Step) Timeline() (string, error) {
	h, err := s.lock()
	if err != nil {
		return "", err
	}
	defer s.mu.Unlock()
	var text *C.char
	if err := call(func() C.ctr_status { return C.ctr_step_timeline(h, &text) }); err != nil {
		return "", err
	}
	return C.GoString(text), nil
}

// KernelProfile returns, with step option "profile_kernels" 1, each kernel of
// this rank's program as JSON text: an array of {"node", "op", "phase",
// "flops", "bytes", "runs", "us"}.
func (s *Step) KernelProfile() (string, error) {
	h, err := s.lock()
	if err != nil {
		return "", err
	}
	defer s.mu.Unlock()
	var text *C.char
	if err := call(func() C.ctr_status { return C.ctr_step_kernel_profile(h, &text) }); err != nil {
		return "", err
	}
	return C.GoString(text), nil
}

// SetLR replaces the schedule by a constant learning rate from the next run.
func (s *Step) SetLR(lr float64) error {
	h, err := s.lock()
	if err != nil {
		return err
	}
	defer s.mu.Unlock()
	return call(func() C.ctr_status { return C.ctr_step_set_lr(h, C.double(lr)) })
}

// Memory is the planned memory, known before the first run.
func (s *Step) Memory() (Memory, error) {
	h, err := s.lock()
	if err != nil {
		return Memory{}, err
	}
	defer s.mu.Unlock()
	var a, p, o C.int64_t
	err = call(func() C.ctr_status { return C.ctr_step_memory(h, &a, &p, &o) })
	return Memory{int64(a), int64(p), int64(o)}, err
}

// Count is the number of optimizer steps taken; -1 once closed.
func (s *Step) Count() int64 {
	h, err := s.lock()
	if err != nil {
		return -1
	}
	defer s.mu.Unlock()
	return int64(C.ctr_step_count(h))
}

// pathCall runs a checkpoint or weights call on a path. The attached loader
// is locked too, because save reads and load rewrites its position. f runs
// with both locks held.
func (s *Step) pathCall(path string, f func(*C.ctr_step, *C.char) C.ctr_status) error {
	h, err := s.lock()
	if err != nil {
		return err
	}
	defer s.mu.Unlock()
	if s.loader != nil {
		s.loader.mu.Lock()
		defer s.loader.mu.Unlock()
	}
	p, err := cstring("path", path)
	if err != nil {
		return err
	}
	defer free(p)
	return call(func() C.ctr_status { return f(h, p) })
}

// Save writes the whole state (and the attached loader's position) to dir,
// atomically. Collective: every rank calls it with the same dir.
func (s *Step) Save(dir string) error {
	return s.pathCall(dir, func(h *C.ctr_step, p *C.char) C.ctr_status { return C.ctr_step_save(h, p) })
}

// Load restores a checkpoint written by Save; a bad one fails with
// StatusCheckpointError and leaves the step unchanged. Collective.
func (s *Step) Load(dir string) error {
	return s.pathCall(dir, func(h *C.ctr_step, p *C.char) C.ctr_status { return C.ctr_step_load(h, p) })
}

// SaveCheckpoint is ctr_step_save_checkpoint (since 0.2): it saves into
// root/step_NNNNNNNN (NNNNNNNN = Count) and returns that directory. Once the
// save is published (at once unless the step option "async_save" is set),
// root/latest names it and all but the "keep" newest step_* directories are
// removed. Key: "keep" (3; 0 keeps all). Collective.
func (s *Step) SaveCheckpoint(root string, opts *Options) (string, error) {
	co, err := opts.toC()
	if err != nil {
		return "", err
	}
	defer C.ctr_options_free(co)
	var out string
	err = s.pathCall(root, func(h *C.ctr_step, r *C.char) C.ctr_status {
		var path *C.char
		st := C.ctr_step_save_checkpoint(h, r, co, &path)
		if st == C.CTR_STATUS_OK {
			// Copied under the step's lock: the string lives until its next call.
			out = C.GoString(path)
		}
		return st
	})
	return out, err
}

// Resume is ctr_step_resume (since 0.2): it restores a checkpoint from a
// directory of SaveCheckpoint. which "" or "latest": the one root/latest
// names (else the newest step_*), falling back to older ones while a
// checkpoint is damaged (StatusCheckpointError); Skipped lists those passed
// over. Otherwise which is a checkpoint name under root or a path. No
// checkpoint at all fails with StatusNotFound; on any failure the step is
// unchanged. Collective.
func (s *Step) Resume(root, which string) (Resumed, error) {
	var w *C.char
	if which != "" {
		var err error
		if w, err = cstring("checkpoint", which); err != nil {
			return Resumed{}, err
		}
		defer free(w)
	}
	var out Resumed
	err := s.pathCall(root, func(h *C.ctr_step, r *C.char) C.ctr_status {
		var path, skipped *C.char
		st := C.ctr_step_resume(h, r, w, &path, &skipped)
		if st == C.CTR_STATUS_OK {
			// Copied under the step's lock: the strings live until its next call.
			out.Path = C.GoString(path)
			if skipped != nil {
				out.Skipped = strings.Split(C.GoString(skipped), "\n")
			}
		}
		return st
	})
	return out, err
}

// ExportSafetensors writes the parameters as a safetensors file (rank 0
// writes it). Collective.
func (s *Step) ExportSafetensors(path string) error {
	return s.pathCall(path, func(h *C.ctr_step, p *C.char) C.ctr_status {
		return C.ctr_step_export_safetensors(h, p)
	})
}

// ImportSafetensors sets the parameters from a safetensors file. Key:
// "allow_extra". Collective.
func (s *Step) ImportSafetensors(path string, opts *Options) error {
	co, err := opts.toC()
	if err != nil {
		return err
	}
	defer C.ctr_options_free(co)
	return s.pathCall(path, func(h *C.ctr_step, p *C.char) C.ctr_status {
		return C.ctr_step_import_safetensors(h, p, co)
	})
}

// AttachLoader makes Save and Load include l's position; nil detaches. The
// step keeps l open until it is detached, replaced or the step is closed.
func (s *Step) AttachLoader(l *Loader) error {
	h, err := s.lock()
	if err != nil {
		return err
	}
	defer s.mu.Unlock()
	var lp *C.ctr_loader
	if l != nil {
		if !l.ref.acquire() {
			return newError(StatusInvalidArgument, "AttachLoader: the loader is closed")
		}
		lp = l.ptr
	}
	if err := call(func() C.ctr_status { return C.ctr_step_attach_loader(h, lp) }); err != nil {
		if l != nil {
			l.ref.release()
		}
		return err
	}
	if s.loader != nil {
		s.loader.ref.release()
	}
	s.loader = l
	return nil
}

// Loader is the attached loader, or nil.
func (s *Step) Loader() *Loader {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.loader
}

// FeedFromLoader draws rows windows from the attached loader and sets them as
// the "tokens" and "targets" inputs: the usual body of a training loop.
func (s *Step) FeedFromLoader(rows int) error {
	l := s.Loader()
	if l == nil {
		return newError(StatusInvalidState, "FeedFromLoader: no loader is attached to the step")
	}
	tokens, targets, err := l.NextBatch(rows)
	if err != nil {
		return err
	}
	if err := s.SetInput("tokens", tokens); err != nil {
		return err
	}
	return s.SetInput("targets", targets)
}
