//! Finds libctr for the linker without any helper crate.
//!
//! Order: `CTR_LIB_DIR` (a directory holding libctr.so, e.g. a meson build's
//! `lib/`), then `pkg-config --libs ctr` run by hand (honouring
//! `PKG_CONFIG_PATH`), then the linker's default search path. The directory
//! found is passed on to dependents as `DEP_CTR_LIB_DIR`.

use std::env;
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-env-changed=CTR_LIB_DIR");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG_PATH");
    println!("cargo:rerun-if-env-changed=PKG_CONFIG");
    println!("cargo:rerun-if-changed=build.rs");

    if let Some(dir) = env::var_os("CTR_LIB_DIR").filter(|d| !d.is_empty()) {
        let dir = dir.to_string_lossy().into_owned();
        println!("cargo:rustc-link-search=native={dir}");
        println!("cargo:rustc-link-lib=dylib=ctr");
        println!("cargo:lib_dir={dir}");
        return;
    }

    let pkg_config = env::var("PKG_CONFIG").unwrap_or_else(|_| "pkg-config".to_string());
    match Command::new(&pkg_config).args(["--libs", "ctr"]).output() {
        Ok(out) if out.status.success() => {
            let flags = String::from_utf8_lossy(&out.stdout).into_owned();
            let mut linked = false;
            // Only -L and -l matter for a shared library; Libs.private (openblas,
            // pthread) belongs to static linking and is not asked for.
            for flag in flags.split_whitespace() {
                if let Some(dir) = flag.strip_prefix("-L") {
                    println!("cargo:rustc-link-search=native={dir}");
                    println!("cargo:lib_dir={dir}");
                } else if let Some(lib) = flag.strip_prefix("-l") {
                    println!("cargo:rustc-link-lib=dylib={lib}");
                    linked |= lib == "ctr";
                }
            }
            if !linked {
                println!("cargo:rustc-link-lib=dylib=ctr");
            }
        }
        _ => {
            // No pkg-config or no ctr.pc: an installed libctr in a default
            // directory still links; anything else fails at link time, and this
            // says what to set.
            println!(
                "cargo:warning=libctr not found through CTR_LIB_DIR or pkg-config; \
                 relying on the linker's default search path"
            );
            println!("cargo:rustc-link-lib=dylib=ctr");
        }
    }
}
