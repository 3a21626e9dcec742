// Package ctr is the Go binding of libctr, a training runtime driven through
// one C header (include/ctr/ctr.h).
//
// A program creates a Mesh (who and where), a Graph (what to train) and a Step
// compiled from the two, then sets inputs and calls Run in a loop:
//
//	graph, err := ctr.NewPresetGraph("gpt", ctr.NewOptions().SetInt("layers", 2))
//	mesh, err := ctr.NewMesh(nil)
//	step, err := ctr.NewStep(mesh, graph, ctr.NewOptions().SetInt("batch", 4))
//	defer step.Close()
//	...
//	metrics, err := step.Run()
//
// Every handle has Close, safe to call twice and from any goroutine, and a
// finalizer as a safety net for one that is dropped unclosed. The C contract
// says a step's mesh, graph and attached loader must outlive it: here a step
// holds references to them, and closing one of them while a step still uses
// it only marks it closed; its C handle is freed when the last step using it
// is closed. Failures are *Error values carrying libctr's status code, its
// name and the message that says what was wrong and where.
//
// The package refuses to work with a libctr whose ctr_abi_version() is not
// ABIVersion: every constructor then returns that mismatch as its error.
package ctr

/*
#include <stdlib.h>
#include <string.h>
#include "ctr/ctr.h"
*/
import "C"

import (
	"fmt"
	"runtime"
	"sync"
	"unsafe"
)

// ABIVersion is the CTR_ABI_VERSION this package was written for.
const ABIVersion = 1

// ABIVersionLoaded is ctr_abi_version() of the linked library.
func ABIVersionLoaded() int { return int(C.ctr_abi_version()) }

// Version is "MAJOR.MINOR.PATCH" of the linked library.
func Version() string { return C.GoString(C.ctr_version()) }

var abiErr error

func init() {
	if got := ABIVersionLoaded(); got != ABIVersion {
		abiErr = &Error{
			Status:  StatusUnsupported,
			Name:    StatusUnsupported.String(),
			Message: fmt.Sprintf("the linked libctr %s has ABI version %d, this package was written for %d", Version(), got, ABIVersion),
		}
	}
}

// CheckABI returns the ABI mismatch found when the package was loaded, or nil.
// Constructors return the same error, so no handle exists on a mismatch.
func CheckABI() error { return abiErr }

// ---------------------------------------------------------------------------
// Status and errors

// Status is a libctr status code. New codes are appended by the library, so a
// value outside the constants below is still a valid Status.
type Status int

const (
	StatusOK              Status = C.CTR_STATUS_OK
	StatusInvalidArgument Status = C.CTR_STATUS_INVALID_ARGUMENT
	StatusInvalidOption   Status = C.CTR_STATUS_INVALID_OPTION
	StatusInvalidGraph    Status = C.CTR_STATUS_INVALID_GRAPH
	StatusIOError         Status = C.CTR_STATUS_IO_ERROR
	StatusNotFound        Status = C.CTR_STATUS_NOT_FOUND
	StatusOutOfMemory     Status = C.CTR_STATUS_OUT_OF_MEMORY
	StatusUnsupported     Status = C.CTR_STATUS_UNSUPPORTED
	StatusInvalidState    Status = C.CTR_STATUS_INVALID_STATE
	StatusDataError       Status = C.CTR_STATUS_DATA_ERROR
	StatusTimeout         Status = C.CTR_STATUS_TIMEOUT
	StatusCommError       Status = C.CTR_STATUS_COMM_ERROR
	StatusNumericError    Status = C.CTR_STATUS_NUMERIC_ERROR
	StatusInternal        Status = C.CTR_STATUS_INTERNAL
	StatusCheckpointError Status = C.CTR_STATUS_CHECKPOINT_ERROR
	StatusDeviceError     Status = C.CTR_STATUS_DEVICE_ERROR
)

// String is the library's name of the status ("invalid graph").
func (s Status) String() string {
	return C.GoString(C.ctr_status_string(C.ctr_status(s)))
}

// Error is a failed libctr call.
type Error struct {
	Status  Status // the code returned by the call
	Name    string // ctr_status_string of Status
	Message string // ctr_last_error right after the call: what and where
}

func (e *Error) Error() string { return "ctr: " + e.Name + ": " + e.Message }

// Is makes errors.Is(err, &ctr.Error{Status: s}) match any error of status s.
func (e *Error) Is(target error) bool {
	t, ok := target.(*Error)
	return ok && t.Status == e.Status && (t.Message == "" || t.Message == e.Message)
}

// StatusOf returns the Status of an *Error, StatusOK for nil, and
// StatusInternal for any other error.
func StatusOf(err error) Status {
	if err == nil {
		return StatusOK
	}
	if e, ok := err.(*Error); ok {
		return e.Status
	}
	return StatusInternal
}

// newError is a failure found by the binding itself (a closed handle, a
// buffer of the wrong size), with the status the library uses for the same.
func newError(s Status, format string, args ...interface{}) error {
	return &Error{Status: s, Name: s.String(), Message: fmt.Sprintf(format, args...)}
}

// call runs one fallible libctr call and turns its status into an error.
//
// ctr_last_error is thread-local, and the Go scheduler may move a goroutine to
// another OS thread between two cgo calls, so the goroutine is pinned to its
// thread from the call until the message has been copied.
func call(f func() C.ctr_status) error {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	st := f()
	if st == C.CTR_STATUS_OK {
		return nil
	}
	s := Status(st)
	return &Error{Status: s, Name: s.String(), Message: C.GoString(C.ctr_last_error())}
}

// ---------------------------------------------------------------------------
// Data types

// DType is the element type of a graph tensor (the header's ctr_dtype).
type DType int

const (
	DTypeF32  DType = C.CTR_DTYPE_F32
	DTypeF16  DType = C.CTR_DTYPE_F16
	DTypeBF16 DType = C.CTR_DTYPE_BF16
	DTypeI32  DType = C.CTR_DTYPE_I32
	DTypeI64  DType = C.CTR_DTYPE_I64
	DTypeU16  DType = C.CTR_DTYPE_U16
	DTypeU32  DType = C.CTR_DTYPE_U32
	DTypeU8   DType = C.CTR_DTYPE_U8
	DTypeF64  DType = C.CTR_DTYPE_F64
)

// Size is the bytes per element; 0 for a value the library does not know.
func (d DType) Size() int { return int(C.ctr_dtype_size(C.ctr_dtype(d))) }

// ---------------------------------------------------------------------------
// Shared ownership of read-only handles

// shared guards a C handle that steps depend on (a mesh, a graph, an attached
// loader). Close marks it closed; the C handle is freed once it is closed and
// no step uses it any more, so the C rule "must outlive the step" holds
// whatever order the program closes things in.
type shared struct {
	mu     sync.Mutex
	users  int
	closed bool
	free   func() // frees the C handle; nil once freed
}

// acquire registers a user; false if the handle was already closed.
func (s *shared) acquire() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.users++
	return true
}

func (s *shared) release() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.users--
	s.freeIfUnused()
}

func (s *shared) close() {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.closed = true
	s.freeIfUnused()
}

func (s *shared) freeIfUnused() {
	if s.closed && s.users == 0 && s.free != nil {
		s.free()
		s.free = nil
	}
}

func (s *shared) isClosed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.closed
}

// cstring allocates a C copy of s for the caller to free. A NUL byte inside s
// would silently cut the C string short, so it is refused instead.
func cstring(what, s string) (*C.char, error) {
	for i := 0; i < len(s); i++ {
		if s[i] == 0 {
			return nil, newError(StatusInvalidArgument, "%s %q contains a NUL byte", what, s)
		}
	}
	return C.CString(s), nil
}

func free(p *C.char) { C.free(unsafe.Pointer(p)) }
