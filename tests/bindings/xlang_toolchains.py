"""Finding the Rust and Go toolchains and building the small cross-language
programs with them, for run_xlang.py and run_go_multirank.py.

The environment matches run_rust.sh and run_go.sh: libctr from BUILD/lib,
nothing that reaches the network (the bindings have no dependencies), and
everything cargo and go write under a work directory of the calling driver
(BUILD/bindings-out/<driver>), so drivers that meson runs in parallel never
share, or delete, each other's build state.
"""
import os
import shutil
import subprocess

SRC = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))
BUILD_TIME_LIMIT = 600  # seconds for one cargo or go build; a hang fails instead of blocking


def find_tool(env_var, name, fallbacks):
    """The tool's path from $env_var, PATH, or a known install location; None if absent.
    An explicit $env_var is the only candidate, as in run_rust.sh and run_go.sh."""
    if os.environ.get(env_var):
        cand = os.environ[env_var]
        return cand if os.path.isfile(cand) and os.access(cand, os.X_OK) else None
    for cand in [shutil.which(name)] + list(fallbacks):
        if cand and os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    return None


def find_cargo():
    home = os.environ.get("HOME", "/root")
    return find_tool("CARGO", "cargo", [os.path.join(home, ".cargo/bin/cargo"), "/root/.cargo/bin/cargo"])


def find_go():
    return find_tool("GO", "go", ["/usr/lib/go/bin/go", "/usr/local/go/bin/go"])


def base_env(build):
    """The environment every program of the test runs with."""
    env = dict(os.environ)
    lib = os.path.join(build, "lib")
    env["CTR_LIB_DIR"] = lib
    env["CTR_LIBRARY"] = os.path.join(lib, "libctr.so")  # pins the Python binding to this build
    env["LD_LIBRARY_PATH"] = lib + (":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    pc = [os.path.join(build, "meson-uninstalled"), os.path.join(build, "meson-private")]
    if env.get("PKG_CONFIG_PATH"):
        pc.append(env["PKG_CONFIG_PATH"])
    env["PKG_CONFIG_PATH"] = ":".join(pc)
    return env


def compiler_env(build):
    """base_env without a preloaded sanitizer runtime, which tools/sanitize.sh
    gives the programs that load libctr: rustc does not start under it, and go
    and cc only slow down."""
    env = base_env(build)
    env.pop("LD_PRELOAD", None)
    return env


def rust_env(build, work, cargo):
    env = compiler_env(build)
    env["PATH"] = os.path.dirname(cargo) + ":" + env.get("PATH", "")
    env["CARGO_TARGET_DIR"] = os.path.join(work, "rust-target")
    env["CARGO_NET_OFFLINE"] = "true"
    return env


def go_env(build, work):
    env = compiler_env(build)
    out = os.path.join(work, "go")
    env.update({
        "GOPATH": os.path.join(out, "path"), "GOCACHE": os.path.join(out, "cache"),
        "GOENV": "off", "GOPROXY": "off", "GOSUMDB": "off", "GOFLAGS": "-mod=mod",
        "GO111MODULE": "on", "GOTOOLCHAIN": "local", "CGO_ENABLED": "1",
        # meson's uninstalled ctr.pc lacks the public header's directory.
        "CGO_CFLAGS": "-I" + os.path.join(SRC, "include"),
    })
    return env


def run_build(cmd, env, cwd=None):
    """Runs a build command; returns None or a description of the failure."""
    try:
        p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True,
                           timeout=BUILD_TIME_LIMIT)
    except subprocess.TimeoutExpired:
        return f"timed out after {BUILD_TIME_LIMIT} s: {' '.join(cmd)}"
    if p.returncode != 0:
        return f"exit {p.returncode}: {' '.join(cmd)}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return None


def build_rust_bin(build, work, cargo, manifest_dir, bin_name):
    """Builds a cargo package; returns (path of the binary, error)."""
    env = rust_env(build, work, cargo)
    err = run_build([cargo, "build", "--offline", "--release", "--manifest-path",
                     os.path.join(manifest_dir, "Cargo.toml")], env)
    return os.path.join(env["CARGO_TARGET_DIR"], "release", bin_name), err


def build_go_bin(build, work, go, package_dir, out_name):
    """Builds a Go main package; returns (path of the binary, error)."""
    env = go_env(build, work)
    out = os.path.join(work, out_name)
    os.makedirs(work, exist_ok=True)
    return out, run_build([go, "build", "-o", out, "."], env, cwd=package_dir)
