//! Status codes and the error type every fallible call returns.
//!
//! libctr reports a failure as a status code plus a thread-local message
//! (`ctr_last_error`) that is replaced by the next libctr call on the thread,
//! so `check` copies the message out immediately after the failing call, before
//! anything else (even freeing a temporary options handle) touches the library.

use std::ffi::CStr;
use std::fmt;

use ctr_sys as sys;

/// A libctr status code. A newtype rather than an enum because the library
/// appends new codes over time and a code this crate does not know yet must
/// still be representable; match on the associated constants.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Status(pub i32);

impl Status {
    pub const OK: Status = Status(sys::CTR_STATUS_OK);
    pub const INVALID_ARGUMENT: Status = Status(sys::CTR_STATUS_INVALID_ARGUMENT);
    pub const INVALID_OPTION: Status = Status(sys::CTR_STATUS_INVALID_OPTION);
    pub const INVALID_GRAPH: Status = Status(sys::CTR_STATUS_INVALID_GRAPH);
    pub const IO_ERROR: Status = Status(sys::CTR_STATUS_IO_ERROR);
    pub const NOT_FOUND: Status = Status(sys::CTR_STATUS_NOT_FOUND);
    pub const OUT_OF_MEMORY: Status = Status(sys::CTR_STATUS_OUT_OF_MEMORY);
    pub const UNSUPPORTED: Status = Status(sys::CTR_STATUS_UNSUPPORTED);
    pub const INVALID_STATE: Status = Status(sys::CTR_STATUS_INVALID_STATE);
    pub const DATA_ERROR: Status = Status(sys::CTR_STATUS_DATA_ERROR);
    pub const TIMEOUT: Status = Status(sys::CTR_STATUS_TIMEOUT);
    pub const COMM_ERROR: Status = Status(sys::CTR_STATUS_COMM_ERROR);
    pub const NUMERIC_ERROR: Status = Status(sys::CTR_STATUS_NUMERIC_ERROR);
    pub const INTERNAL: Status = Status(sys::CTR_STATUS_INTERNAL);
    pub const CHECKPOINT_ERROR: Status = Status(sys::CTR_STATUS_CHECKPOINT_ERROR);
    pub const DEVICE_ERROR: Status = Status(sys::CTR_STATUS_DEVICE_ERROR);

    /// The library's name for the code ("invalid graph"); static, never fails.
    pub fn name(self) -> &'static str {
        // SAFETY: ctr_status_string accepts any value and returns a static,
        // NUL-terminated string that lives as long as the loaded library,
        // which stays loaded for the life of the process.
        unsafe { CStr::from_ptr(sys::ctr_status_string(self.0)) }
            .to_str()
            .unwrap_or("unknown status")
    }
}

impl fmt::Debug for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Status({} \"{}\")", self.0, self.name())
    }
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A failed libctr call: the status code, its name and the message that says
/// what was wrong and where (file, tensor, option, rank).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Error {
    status: Status,
    name: &'static str,
    message: String,
}

impl Error {
    /// An error raised by the binding itself before reaching the library (a
    /// string with an interior NUL, a buffer of the wrong size), carrying the
    /// status the library would have used for the same fault.
    pub(crate) fn new(status: Status, message: impl Into<String>) -> Error {
        Error { status, name: status.name(), message: message.into() }
    }

    pub fn status(&self) -> Status {
        self.status
    }

    /// `ctr_status_string` of the status.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// `ctr_last_error` as it was right after the failing call.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.name, self.message)
    }
}

impl std::error::Error for Error {}

pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Turns a status into a Result, reading the thread's last-error message at
/// once when the call failed. Call it directly on the C function's return.
pub(crate) fn check(status: sys::ctr_status) -> Result<()> {
    if status == sys::CTR_STATUS_OK {
        return Ok(());
    }
    // SAFETY: ctr_last_error never returns NULL and its string is valid until
    // the next libctr call on this thread; it is copied before any such call.
    let message = unsafe { CStr::from_ptr(sys::ctr_last_error()) }.to_string_lossy().into_owned();
    Err(Error::new(Status(status), message))
}
