#!/bin/sh
# run_rust.sh — builds and tests the Rust binding from a clean state.
#
# usage: run_rust.sh BUILD_DIR
#
# Runs `cargo test` over the bindings/rust workspace (ctr-sys and ctr) and
# then the Rust example, against the libctr of BUILD_DIR (a configured and
# built meson build directory). Everything cargo writes goes under
# BUILD_DIR/bindings-out/rust-target, which is emptied first, so the result
# never depends on an earlier build. Offline: the binding uses no crates.
# Exits 77 (meson's "skipped") when no Rust toolchain is installed.
set -eu

if [ $# -lt 1 ]; then
  echo "usage: $0 BUILD_DIR" >&2
  exit 2
fi
BUILD=$(cd "$1" && pwd)
SRC=$(cd "$(dirname "$0")/../.." && pwd)

# cargo from $CARGO, PATH, or rustup's default home (meson's test environment
# often lacks ~/.cargo/bin on PATH).
CARGO_BIN=${CARGO:-}
if [ -z "$CARGO_BIN" ]; then
  for c in "$(command -v cargo 2>/dev/null || true)" "${HOME:-/root}/.cargo/bin/cargo" /root/.cargo/bin/cargo; do
    if [ -n "$c" ] && [ -x "$c" ]; then CARGO_BIN=$c; break; fi
  done
fi
if [ -z "$CARGO_BIN" ] || ! "$CARGO_BIN" --version >/dev/null 2>&1; then
  echo "run_rust: SKIP: no Rust toolchain (cargo) found; install rustup/cargo to test the Rust binding"
  exit 77
fi
# rustc next to cargo (rustup's proxies live in the same directory).
PATH=$(dirname "$CARGO_BIN"):$PATH

if [ ! -e "$BUILD/lib/libctr.so" ]; then
  echo "run_rust: $BUILD/lib/libctr.so is missing; build libctr first (ninja -C $BUILD)" >&2
  exit 1
fi

OUT=$BUILD/bindings-out
export CARGO_TARGET_DIR="$OUT/rust-target"
rm -rf "$CARGO_TARGET_DIR"
mkdir -p "$CARGO_TARGET_DIR"

export PATH
export CARGO_NET_OFFLINE=true
export CTR_LIB_DIR="$BUILD/lib"
export LD_LIBRARY_PATH="$BUILD/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PKG_CONFIG_PATH="$BUILD/meson-uninstalled:$BUILD/meson-private${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
export CTR_NUM_THREADS="${CTR_NUM_THREADS:-2}"
export RUST_BACKTRACE=1

# A preloaded sanitizer runtime (tools/sanitize.sh) is for the programs that load
# libctr, and rustc does not start under it: cargo runs without it and hands it
# to the test binaries and the example through a runner.
PRELOADED=${LD_PRELOAD:-}
if [ -n "$PRELOADED" ]; then
  export CARGO_TARGET_X86_64_UNKNOWN_LINUX_GNU_RUNNER="env LD_PRELOAD=$PRELOADED"
  unset LD_PRELOAD
fi

echo "run_rust: $("$CARGO_BIN" --version), libctr from $CTR_LIB_DIR"
"$CARGO_BIN" test --offline --workspace --manifest-path "$SRC/bindings/rust/Cargo.toml"

# Leaks at the boundary: the integration tests again, under LeakSanitizer. Not
# when a sanitizer runtime is preloaded already (tools/sanitize.sh): one process
# takes one runtime, and that one checks more than leaks.
LSAN=/usr/lib/x86_64-linux-gnu/liblsan.so.0
if [ -e "$LSAN" ] && [ -z "$PRELOADED" ]; then
  for t in "$CARGO_TARGET_DIR"/debug/deps/train-*; do
    [ -f "$t" ] && [ -x "$t" ] || continue
    echo "run_rust: $(basename "$t") under LeakSanitizer"
    LD_PRELOAD=$LSAN LSAN_OPTIONS=exitcode=23 "$t" --test-threads=1 -q
  done
fi

echo "run_rust: examples/rust"
"$CARGO_BIN" run --offline --release --manifest-path "$SRC/examples/rust/Cargo.toml"
echo "run_rust: all Rust binding tests and the example passed"
