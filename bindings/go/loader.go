// The token loader: a seeded, resumable order over a token file or the
// built-in synthetic corpus.

package ctr

/*
#include "ctr/ctr.h"
*/
import "C"

import (
	"runtime"
	"sync"
	"unsafe"
)

// Loader is a ctr_loader. Its calls are serialised by a mutex, which a step
// it is attached to also takes while a checkpoint reads or restores the
// loader's position.
type Loader struct {
	mu  sync.Mutex
	ptr *C.ctr_loader
	// The header has no call returning a loader's window length, yet
	// ctr_loader_next writes rows*seq ids per buffer; the value given at
	// creation is kept so Go slices can be checked before C writes into them.
	seq int64
	ref shared
}

// NewLoader is ctr_loader_create over a token file (an llm.c token file, or
// any other file read as bytes). Keys: "seq" (required), "seed", "corpus_bytes".
func NewLoader(path string, opts *Options) (*Loader, error) { return newLoader(&path, opts) }

// NewBuiltinLoader is ctr_loader_create with path NULL: the built-in
// synthetic corpus.
func NewBuiltinLoader(opts *Options) (*Loader, error) { return newLoader(nil, opts) }

func newLoader(path *string, opts *Options) (*Loader, error) {
	co, err := opts.toC()
	if err != nil {
		return nil, err
	}
	defer C.ctr_options_free(co)
	var p *C.char
	if path != nil {
		if p, err = cstring("path", *path); err != nil {
			return nil, err
		}
		defer free(p)
	}
	var h *C.ctr_loader
	if err := call(func() C.ctr_status { return C.ctr_loader_create(p, co, &h) }); err != nil {
		return nil, err
	}
	seq, _ := opts.lookupInt("seq") // accepted by the library, so present
	l := &Loader{ptr: h, seq: seq}
	l.ref.free = func() { C.ctr_loader_free(h) }
	runtime.SetFinalizer(l, (*Loader).Close)
	return l, nil
}

// Close releases the loader; a step it is attached to keeps it alive until
// the step is closed or the loader detached. Calling Close again does nothing.
func (l *Loader) Close() error {
	l.ref.close()
	runtime.SetFinalizer(l, nil)
	return nil
}

// Seq is the window length given at creation.
func (l *Loader) Seq() int { return int(l.seq) }

// Next fills the next rows windows of the global order into tokens and
// targets, each exactly rows*Seq() long.
func (l *Loader) Next(rows int, tokens, targets []int32) error {
	if l == nil || !l.ref.acquire() {
		return newError(StatusInvalidState, "the loader is closed")
	}
	defer l.ref.release()
	need := int64(rows) * l.seq
	if rows <= 0 || int64(len(tokens)) != need || int64(len(targets)) != need {
		return newError(StatusInvalidArgument,
			"ctr_loader_next: %d rows of seq %d need %d ids per buffer, got %d tokens and %d targets",
			rows, l.seq, need, len(tokens), len(targets))
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return call(func() C.ctr_status {
		return C.ctr_loader_next(l.ptr, C.int64_t(rows),
			(*C.int32_t)(unsafe.Pointer(&tokens[0])), (*C.int32_t)(unsafe.Pointer(&targets[0])))
	})
}

// NextSlice is one rank's share of the next global batch: it advances the
// loader by globalRows samples, exactly as Next(globalRows, ...) would, but
// reads only the len(tokens)/Seq() rows starting at firstRow. Every rank calls
// it with the same globalRows, so the loader's state stays the same on all
// ranks however the batch is split.
func (l *Loader) NextSlice(globalRows, firstRow int, tokens, targets []int32) error {
	if l == nil || !l.ref.acquire() {
		return newError(StatusInvalidState, "the loader is closed")
	}
	defer l.ref.release()
	if l.seq <= 0 || int64(len(tokens))%l.seq != 0 || len(targets) != len(tokens) {
		return newError(StatusInvalidArgument,
			"ctr_loader_next_slice: buffers must hold whole rows of seq %d, got %d tokens and %d targets",
			l.seq, len(tokens), len(targets))
	}
	rows := int64(len(tokens)) / l.seq
	// The header allows NULL buffers for zero rows.
	var tp, gp *C.int32_t
	if rows > 0 {
		tp, gp = (*C.int32_t)(unsafe.Pointer(&tokens[0])), (*C.int32_t)(unsafe.Pointer(&targets[0]))
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	return call(func() C.ctr_status {
		return C.ctr_loader_next_slice(l.ptr, C.int64_t(globalRows), C.int64_t(firstRow), C.int64_t(rows), tp, gp)
	})
}

// NextBatch returns the next rows windows as new slices.
func (l *Loader) NextBatch(rows int) (tokens, targets []int32, err error) {
	n := int64(rows) * l.seq
	if n < 0 {
		n = 0
	}
	tokens, targets = make([]int32, n), make([]int32, n)
	if err := l.Next(rows, tokens, targets); err != nil {
		return nil, nil, err
	}
	return tokens, targets, nil
}

// Info returns the number of tokens in the source and the largest token id.
func (l *Loader) Info() (tokens, maxToken int64, err error) {
	if l == nil || !l.ref.acquire() {
		return 0, 0, newError(StatusInvalidState, "the loader is closed")
	}
	defer l.ref.release()
	l.mu.Lock()
	defer l.mu.Unlock()
	var t, m C.int64_t
	err = call(func() C.ctr_status { return C.ctr_loader_info(l.ptr, &t, &m) })
	return int64(t), int64(m), err
}
