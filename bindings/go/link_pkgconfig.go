//go:build !ctr_nopkgconfig

// Linking against libctr through pkg-config (the default).
//
// cgo runs `pkg-config --cflags --libs ctr`, so PKG_CONFIG_PATH selects the
// libctr to build against. Build with `-tags ctr_nopkgconfig` to skip
// pkg-config and pass the paths yourself instead (see link_manual.go).

package ctr

// #cgo pkg-config: ctr
import "C"
