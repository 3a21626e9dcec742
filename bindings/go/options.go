// Typed key/value options for meshes, graph presets, steps and loaders.
//
// Options is plain Go data; it becomes a C ctr_options handle only for the
// duration of the call that consumes it. Keys are not checked here: the
// library rejects an unknown key at the consuming call, naming it.

package ctr

/*
#include <stdlib.h>
#include "ctr/ctr.h"
*/
import "C"

import "fmt"

type optionKind int

const (
	optionInt optionKind = iota
	optionFloat
	optionString
)

type option struct {
	key  string
	kind optionKind
	i    int64
	f    float64
	s    string
}

// Options holds keys with typed values. A nil *Options is an empty set. The
// setters return the receiver so calls chain; setting a key again replaces it.
type Options struct {
	entries []option
}

// NewOptions returns an empty option set.
func NewOptions() *Options { return &Options{} }

func (o *Options) put(e option) *Options {
	for i := range o.entries {
		if o.entries[i].key == e.key {
			o.entries[i] = e
			return o
		}
	}
	o.entries = append(o.entries, e)
	return o
}

// SetInt sets an integer key (flags such as "tied" are ints 0/1).
func (o *Options) SetInt(key string, v int64) *Options {
	return o.put(option{key: key, kind: optionInt, i: v})
}

// SetFloat sets a floating-point key.
func (o *Options) SetFloat(key string, v float64) *Options {
	return o.put(option{key: key, kind: optionFloat, f: v})
}

// SetString sets a string key.
func (o *Options) SetString(key, v string) *Options {
	return o.put(option{key: key, kind: optionString, s: v})
}

// Set picks the setter from v's type: any integer or bool is an int, float32
// and float64 a float, a string a string. Any other type panics, since it is
// a programming error rather than a run-time condition.
func (o *Options) Set(key string, v interface{}) *Options {
	switch x := v.(type) {
	case int:
		return o.SetInt(key, int64(x))
	case int32:
		return o.SetInt(key, int64(x))
	case int64:
		return o.SetInt(key, x)
	case uint32:
		return o.SetInt(key, int64(x))
	case bool:
		if x {
			return o.SetInt(key, 1)
		}
		return o.SetInt(key, 0)
	case float32:
		return o.SetFloat(key, float64(x))
	case float64:
		return o.SetFloat(key, x)
	case string:
		return o.SetString(key, x)
	}
	panic(fmt.Sprintf("ctr: option %q: unsupported value type %T", key, v))
}

// lookupInt returns an int key's value.
func (o *Options) lookupInt(key string) (int64, bool) {
	if o == nil {
		return 0, false
	}
	for _, e := range o.entries {
		if e.key == key && e.kind == optionInt {
			return e.i, true
		}
	}
	return 0, false
}

// toC builds a C options handle; the caller frees it with C.ctr_options_free
// after the consuming call has returned and its error has been read.
func (o *Options) toC() (*C.ctr_options, error) {
	if abiErr != nil {
		return nil, abiErr
	}
	var h *C.ctr_options
	if err := call(func() C.ctr_status { return C.ctr_options_create(&h) }); err != nil {
		return nil, err
	}
	if o == nil {
		return h, nil
	}
	for _, e := range o.entries {
		if err := setC(h, e); err != nil {
			C.ctr_options_free(h)
			return nil, err
		}
	}
	return h, nil
}

func setC(h *C.ctr_options, e option) error {
	k, err := cstring("option key", e.key)
	if err != nil {
		return err
	}
	defer free(k)
	switch e.kind {
	case optionInt:
		return call(func() C.ctr_status { return C.ctr_options_set_int(h, k, C.int64_t(e.i)) })
	case optionFloat:
		return call(func() C.ctr_status { return C.ctr_options_set_float(h, k, C.double(e.f)) })
	default:
		v, err := cstring("option value", e.s)
		if err != nil {
			return err
		}
		defer free(v)
		return call(func() C.ctr_status { return C.ctr_options_set_string(h, k, v) })
	}
}
