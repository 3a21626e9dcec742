//go:build ctr_nopkgconfig

// Linking against libctr without pkg-config: `go build -tags ctr_nopkgconfig`.
//
// cgo directives cannot read an arbitrary variable such as CTR_LIB_DIR, so the
// directories come in through cgo's own variables:
//
//	CGO_CFLAGS="-I$CTR_INCLUDE_DIR" CGO_LDFLAGS="-L$CTR_LIB_DIR" \
//	  go build -tags ctr_nopkgconfig ./...
//
// where CTR_INCLUDE_DIR holds ctr/ctr.h and CTR_LIB_DIR holds libctr.so (for a
// meson build: the source tree's include/ and the build's lib/).

package ctr

// #cgo LDFLAGS: -lctr
import "C"
