// Token files, read and written by the loader's own code (since 0.6): a file
// written here is one the loader accepts, and one inspected here is read as
// the loader reads it.

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

// Tokens is a ctr_tokens: a token file opened read-only. Its calls do not
// change it, so it may be shared between goroutines.
type Tokens struct {
	ptr *C.ctr_tokens
	ref shared
}

// OpenTokens is ctr_tokens_open. Keys: "format" ("auto" (default), "llmc",
// "npy", "u16", "u32" or "bytes") and "dataset": with a manifest, the index of
// the sub-dataset to open, its files read as one sequence (a manifest without
// it is refused).
func OpenTokens(path string, opts *Options) (*Tokens, error) {
	co, err := opts.toC()
	if err != nil {
		return nil, err
	}
	defer C.ctr_options_free(co)
	p, err := cstring("path", path)
	if err != nil {
		return nil, err
	}
	defer free(p)
	var h *C.ctr_tokens
	if err := call(func() C.ctr_status { return C.ctr_tokens_open(p, co, &h) }); err != nil {
		return nil, err
	}
	t := &Tokens{ptr: h}
	t.ref.free = func() { C.ctr_tokens_free(h) }
	runtime.SetFinalizer(t, (*Tokens).Close)
	return t, nil
}

// Close unmaps the file. Calling Close again does nothing.
func (t *Tokens) Close() error {
	t.ref.close()
	runtime.SetFinalizer(t, nil)
	return nil
}

// acquire keeps the C handle from being freed by a concurrent Close until
// t.ref.release().
func (t *Tokens) acquire() error {
	if t == nil || !t.ref.acquire() {
		return newError(StatusInvalidState, "the tokens are closed")
	}
	return nil
}

// Info is ctr_tokens_info: what the file holds as JSON text, {"name", "kind",
// "tokens", "max_id", "files": [{"path", "kind", "tokens", "width",
// "header_bytes"}]}. The first call scans the tokens for max_id.
func (t *Tokens) Info() (string, error) {
	if err := t.acquire(); err != nil {
		return "", err
	}
	defer t.ref.release()
	var text *C.char
	var out string
	err := call(func() C.ctr_status {
		st := C.ctr_tokens_info(t.ptr, &text)
		if st == C.CTR_STATUS_OK {
			// Copied on the calling thread: the text is this thread's until its next call.
			out = C.GoString(text)
		}
		return st
	})
	return out, err
}

// Read is ctr_tokens_read: tokens [start, start+count) (an int32 .npy's ids as
// their bits). A range past the end fails with StatusInvalidArgument.
func (t *Tokens) Read(start, count int64) ([]uint32, error) {
	if err := t.acquire(); err != nil {
		return nil, err
	}
	defer t.ref.release()
	var out []uint32
	var p *C.uint32_t
	if count > 0 {
		out = make([]uint32, count)
		p = (*C.uint32_t)(unsafe.Pointer(&out[0]))
	}
	// A negative count is passed on for the library to refuse.
	if err := call(func() C.ctr_status { return C.ctr_tokens_read(t.ptr, C.int64_t(start), C.int64_t(count), p) }); err != nil {
		return nil, err
	}
	if out == nil {
		out = []uint32{}
	}
	return out, nil
}

// Samples is ctr_tokens_samples: how many samples of seq inputs the loader
// cuts from the file. mode "windows" ("" is the same) or "documents" (split at
// each end-of-text id eot; eot < 0 in windows mode). StatusDataError when not
// one sample fits.
func (t *Tokens) Samples(seq int64, mode string, eot int64) (int64, error) {
	var m *C.char
	if mode != "" {
		var err error
		if m, err = cstring("mode", mode); err != nil {
			return 0, err
		}
		defer free(m)
	}
	if err := t.acquire(); err != nil {
		return 0, err
	}
	defer t.ref.release()
	var n C.int64_t
	err := call(func() C.ctr_status { return C.ctr_tokens_samples(t.ptr, C.int64_t(seq), m, C.int64_t(eot), &n) })
	return int64(n), err
}

// ManifestInfo is ctr_manifest_info: a manifest's sub-datasets as JSON text,
// {"path", "mode" (or null), "eot" (or null), "datasets": [{"name", "weight",
// "files", "format"}]}. A malformed manifest fails with StatusDataError naming
// the key at fault.
func ManifestInfo(path string) (string, error) {
	if abiErr != nil {
		return "", abiErr
	}
	p, err := cstring("path", path)
	if err != nil {
		return "", err
	}
	defer free(p)
	var text *C.char
	var out string
	err = call(func() C.ctr_status {
		st := C.ctr_manifest_info(p, &text)
		if st == C.CTR_STATUS_OK {
			// Copied on the calling thread: the text is this thread's until its next call.
			out = C.GoString(text)
		}
		return st
	})
	return out, err
}

// TokenWriter is a ctr_token_writer. Its calls are serialised by a mutex.
type TokenWriter struct {
	mu  sync.Mutex
	ptr *C.ctr_token_writer
}

// CreateTokenWriter is ctr_token_writer_create: count tokens are to be
// written into path, as path.tmp until Finish renames it. format "llmc",
// "npy", "u16" or "u32"; width 2 or 4 bytes per token ("u16" and "u32" have
// their own).
func CreateTokenWriter(path, format string, width int, count int64) (*TokenWriter, error) {
	if abiErr != nil {
		return nil, abiErr
	}
	p, err := cstring("path", path)
	if err != nil {
		return nil, err
	}
	defer free(p)
	f, err := cstring("format", format)
	if err != nil {
		return nil, err
	}
	defer free(f)
	var h *C.ctr_token_writer
	if err := call(func() C.ctr_status {
		return C.ctr_token_writer_create(p, f, C.int(width), C.int64_t(count), &h)
	}); err != nil {
		return nil, err
	}
	w := &TokenWriter{ptr: h}
	runtime.SetFinalizer(w, (*TokenWriter).Close)
	return w, nil
}

// lock takes the writer's mutex and returns the C handle, or an error (with
// the mutex released) once the writer is closed.
func (w *TokenWriter) lock() (*C.ctr_token_writer, error) {
	w.mu.Lock()
	if w.ptr == nil {
		w.mu.Unlock()
		return nil, newError(StatusInvalidState, "the token writer is closed")
	}
	return w.ptr, nil
}

// Write is ctr_token_writer_write: appends tokens. An id that does not fit
// the width, or more tokens than the count given at creation, fails with
// StatusDataError naming the id and its position.
func (w *TokenWriter) Write(tokens []uint32) error {
	h, err := w.lock()
	if err != nil {
		return err
	}
	defer w.mu.Unlock()
	var p *C.uint32_t
	if len(tokens) > 0 {
		p = (*C.uint32_t)(unsafe.Pointer(&tokens[0]))
	}
	err = call(func() C.ctr_status { return C.ctr_token_writer_write(h, p, C.int64_t(len(tokens))) })
	runtime.KeepAlive(tokens)
	return err
}

// Finish is ctr_token_writer_finish: completes the file and renames path.tmp
// to path. Fewer tokens than the count fail with StatusDataError.
func (w *TokenWriter) Finish() error {
	h, err := w.lock()
	if err != nil {
		return err
	}
	defer w.mu.Unlock()
	return call(func() C.ctr_status { return C.ctr_token_writer_finish(h) })
}

// Close is ctr_token_writer_free; a writer not finished removes path.tmp.
// Calling Close again does nothing.
func (w *TokenWriter) Close() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.ptr == nil {
		return nil
	}
	C.ctr_token_writer_free(w.ptr)
	w.ptr = nil
	runtime.SetFinalizer(w, nil)
	return nil
}
