#!/bin/sh
# run_go.sh — builds and tests the Go binding from a clean state.
#
# usage: run_go.sh BUILD_DIR
#
# Runs `go vet` and `go test` on bindings/go and then the Go example, against
# the libctr of BUILD_DIR (a configured and built meson build directory). The
# package links through `#cgo pkg-config: ctr`; meson's uninstalled ctr.pc
# (BUILD_DIR/meson-uninstalled) gives the library path, but not the public
# header's directory, so CGO_CFLAGS adds the source tree's include/. The
# no-pkg-config route (-tags ctr_nopkgconfig) is built as well. GOPATH and
# GOCACHE live under BUILD_DIR/bindings-out/go, emptied first; GOPROXY=off
# keeps the go command off the network (the binding has no dependencies).
# Exits 77 (meson's "skipped") when no Go toolchain is installed.
set -eu

if [ $# -lt 1 ]; then
  echo "usage: $0 BUILD_DIR" >&2
  exit 2
fi
BUILD=$(cd "$1" && pwd)
SRC=$(cd "$(dirname "$0")/../.." && pwd)

GO_BIN=${GO:-}
if [ -z "$GO_BIN" ]; then
  for g in "$(command -v go 2>/dev/null || true)" /usr/lib/go/bin/go /usr/local/go/bin/go; do
    if [ -n "$g" ] && [ -x "$g" ]; then GO_BIN=$g; break; fi
  done
fi
if [ -z "$GO_BIN" ] || ! "$GO_BIN" version >/dev/null 2>&1; then
  echo "run_go: SKIP: no Go toolchain found; install Go >= 1.19 (Debian: apt-get install golang-go)"
  exit 77
fi
if ! command -v pkg-config >/dev/null 2>&1; then
  echo "run_go: SKIP: pkg-config is not installed (cgo needs it for '#cgo pkg-config: ctr')"
  exit 77
fi

if [ ! -e "$BUILD/lib/libctr.so" ]; then
  echo "run_go: $BUILD/lib/libctr.so is missing; build libctr first (ninja -C $BUILD)" >&2
  exit 1
fi

OUT=$BUILD/bindings-out/go
# The module cache is read-only on disk; make it removable before removing.
if [ -d "$OUT" ]; then chmod -R u+w "$OUT" 2>/dev/null || true; rm -rf "$OUT"; fi
mkdir -p "$OUT"

export GOPATH="$OUT/path" GOCACHE="$OUT/cache" GOTMPDIR="" GOENV=off
export GOPROXY=off GOSUMDB=off GOFLAGS=-mod=mod GO111MODULE=on GOTOOLCHAIN=local
export CGO_ENABLED=1
export CGO_CFLAGS="-I$SRC/include"
export PKG_CONFIG_PATH="$BUILD/meson-uninstalled:$BUILD/meson-private${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
export LD_LIBRARY_PATH="$BUILD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export CTR_LIB_DIR="$BUILD/lib"
export CTR_NUM_THREADS="${CTR_NUM_THREADS:-2}"

# A preloaded sanitizer runtime (tools/sanitize.sh) is for the programs that load
# libctr: the go tool and the C compiler it calls run without it (they only
# slow down under it), and the test binaries and the example get it back.
PRELOADED=${LD_PRELOAD:-}
unset LD_PRELOAD

echo "run_go: $("$GO_BIN" version), libctr via pkg-config: $(pkg-config --libs ctr)"
cd "$SRC/bindings/go"
"$GO_BIN" vet ./...
if [ -n "$PRELOADED" ]; then
  "$GO_BIN" test -count=1 -v -exec "env LD_PRELOAD=$PRELOADED" ./...
else
  "$GO_BIN" test -count=1 -v ./...
fi

echo "run_go: the ctr_nopkgconfig build (CGO_LDFLAGS=-L\$CTR_LIB_DIR)"
CGO_LDFLAGS="-L$CTR_LIB_DIR" "$GO_BIN" build -tags ctr_nopkgconfig ./...

echo "run_go: examples/go"
cd "$SRC/examples/go"
"$GO_BIN" build -o "$OUT/train" .
env ${PRELOADED:+LD_PRELOAD=$PRELOADED} "$OUT/train"
echo "run_go: all Go binding tests and the example passed"
