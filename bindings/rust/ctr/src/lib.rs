//! Safe Rust bindings to libctr, a training runtime driven through one C header.
//!
//! The types own their C handles (`NonNull` inside, `Drop` calls the matching
//! `_free`) and encode the header's lifetime rules in Rust terms:
//!
//! * [`Mesh`] and [`Graph`] are cheap-to-clone shared handles (`Arc` inside):
//!   the header makes them read-only after creation and shareable across
//!   threads and steps, and a [`Step`] keeps a clone of each, so they always
//!   outlive the steps compiled from them, as the C contract requires.
//! * A [`Step`] is used by one thread at a time: it is `Send`, not `Sync`, and
//!   every mutating call takes `&mut self`.
//! * A [`Loader`] attached to a step is moved into it (see
//!   [`Step::attach_loader`]), which both keeps it alive while the step may read
//!   it and stops anyone else advancing it meanwhile.
//! * [`Tokens`] and [`TokenWriter`] read and write token files as the loader
//!   reads them; a writer dropped unfinished removes its temporary file.
//! * [`Options`] is plain Rust data: typed key/value pairs turned into a C
//!   options handle only for the duration of the call that consumes them.
//!
//! Every entry point first checks that the loaded library speaks the ABI this
//! crate was written for ([`check_abi`]) and refuses to go on otherwise.
//!
//! ```no_run
//! use ctr::{Graph, Loader, Mesh, Options, Step};
//! let graph = Graph::preset("gpt", &Options::new().int("layers", 2).int("vocab", 256))?;
//! let mesh = Mesh::new(&Options::new())?;
//! let mut step = Step::new(&mesh, &graph, &Options::new().int("batch", 4))?;
//! let mut loader = Loader::builtin(&Options::new().int("seq", 256))?;
//! let (tokens, targets) = loader.next_batch(4)?;
//! step.set_input("tokens", &tokens)?;
//! step.set_input("targets", &targets)?;
//! println!("loss {}", step.run()?.loss);
//! # Ok::<(), ctr::Error>(())
//! ```

mod error;
mod graph;
mod loader;
mod mesh;
mod options;
mod step;
mod tokens;

use std::ffi::{CStr, CString};
use std::path::Path;
use std::sync::OnceLock;

pub use ctr_sys as sys;
pub use error::{Error, Result, Status};
pub use graph::{Graph, TensorInfo};
pub use loader::Loader;
pub use mesh::Mesh;
pub use options::{OptionValue, Options};
pub use step::{Element, Memory, Metrics, MoeLayer, Resumed, Step};
pub use tokens::{manifest_info, write_tokens, TokenWriter, Tokens};

/// The ABI version this crate was written against.
pub const ABI_VERSION: i32 = sys::CTR_ABI_VERSION;

/// `ctr_abi_version()` of the loaded library.
pub fn abi_version() -> i32 {
    // SAFETY: no arguments, no preconditions.
    unsafe { sys::ctr_abi_version() }
}

/// "MAJOR.MINOR.PATCH" of the loaded library.
pub fn version() -> &'static str {
    // SAFETY: a static NUL-terminated string owned by the library, which stays
    // loaded for the life of the process.
    unsafe { CStr::from_ptr(sys::ctr_version()) }.to_str().unwrap_or("?")
}

/// Fails with `Status::UNSUPPORTED` when the loaded libctr's ABI version is not
/// the one this crate was written for. Run once, remembered; every handle
/// constructor calls it, so a mismatched library is refused before any handle
/// exists. Calling it directly gives an early, explicit check.
pub fn check_abi() -> Result<()> {
    static ABI: OnceLock<Result<()>> = OnceLock::new();
    ABI.get_or_init(|| {
        let found = abi_version();
        if found == ABI_VERSION {
            Ok(())
        } else {
            Err(Error::new(
                Status::UNSUPPORTED,
                format!(
                    "the loaded libctr has ABI version {found} (libctr {}), this binding was \
                     written for ABI version {ABI_VERSION}",
                    version()
                ),
            ))
        }
    })
    .clone()
}

/// Element type of a graph tensor; the numbers are the header's `ctr_dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DType(pub i32);

impl DType {
    pub const F32: DType = DType(sys::CTR_DTYPE_F32);
    pub const F16: DType = DType(sys::CTR_DTYPE_F16);
    pub const BF16: DType = DType(sys::CTR_DTYPE_BF16);
    pub const I32: DType = DType(sys::CTR_DTYPE_I32);
    pub const I64: DType = DType(sys::CTR_DTYPE_I64);
    pub const U16: DType = DType(sys::CTR_DTYPE_U16);
    pub const U32: DType = DType(sys::CTR_DTYPE_U32);
    pub const U8: DType = DType(sys::CTR_DTYPE_U8);
    pub const F64: DType = DType(sys::CTR_DTYPE_F64);

    /// Bytes per element; 0 for a value the library does not know.
    pub fn size(self) -> usize {
        // SAFETY: accepts any value.
        unsafe { sys::ctr_dtype_size(self.0) }
    }
}

// ---------------------------------------------------------------------------
// Helpers shared by the modules

/// A Rust string as a C string; an interior NUL cannot be passed to C and is
/// reported the way the library reports any bad argument.
pub(crate) fn cstring(what: &str, s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| {
        Error::new(
            Status::INVALID_ARGUMENT,
            format!("{what} '{}' contains a NUL byte", s.escape_debug()),
        )
    })
}

/// A path as a C string: its bytes as the OS holds them, so non-UTF-8 names
/// reach the library unchanged.
pub(crate) fn cpath(path: &Path) -> Result<CString> {
    use std::os::unix::ffi::OsStrExt;
    CString::new(path.as_os_str().as_bytes()).map_err(|_| {
        Error::new(Status::INVALID_ARGUMENT, format!("path {} contains a NUL byte", path.display()))
    })
}

/// Copies a library-owned C string naming a file; its bytes become the path
/// unchanged, so non-UTF-8 names survive. The caller guarantees it is valid now.
pub(crate) unsafe fn owned_path(p: *const std::ffi::c_char) -> std::path::PathBuf {
    use std::os::unix::ffi::OsStrExt;
    if p.is_null() {
        std::path::PathBuf::new()
    } else {
        std::ffi::OsStr::from_bytes(CStr::from_ptr(p).to_bytes()).into()
    }
}

/// Copies a library-owned C string; the caller guarantees it is valid now.
pub(crate) unsafe fn owned_string(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        String::new()
    } else {
        CStr::from_ptr(p).to_string_lossy().into_owned()
    }
}
