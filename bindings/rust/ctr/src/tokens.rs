//! Token files, read and written as the loader reads them: [`Tokens`] opens
//! one read-only, [`TokenWriter`] writes one, [`manifest_info`] lists a
//! manifest's sub-datasets.

use std::ffi::c_char;
use std::path::Path;
use std::ptr::{self, NonNull};

use crate::error::{check, Result};
use crate::{check_abi, cpath, cstring, owned_string, sys, Error, Options, Status};

/// A token file opened read-only (mapped until dropped), read by the
/// loader's own code.
pub struct Tokens {
    ptr: NonNull<sys::ctr_tokens>,
}

// SAFETY: the handle is a read-only mapping with no tie to the thread that
// opened it. Not Sync: the header does not promise concurrent use.
unsafe impl Send for Tokens {}

impl Tokens {
    /// `ctr_tokens_open`. Keys: "format" ("auto" when absent: by content and
    /// extension; "llmc", "npy", "u16", "u32", "bytes"), "dataset" (with a
    /// manifest, the index of the sub-dataset to open; a manifest without it
    /// is refused). None passes no options.
    pub fn open(path: impl AsRef<Path>, options: Option<&Options>) -> Result<Tokens> {
        check_abi()?;
        let raw = options.map(Options::to_raw).transpose()?;
        let p = cpath(path.as_ref())?;
        let mut out = ptr::null_mut();
        let raw_ptr = raw.as_ref().map_or(ptr::null(), |r| r.as_ptr());
        // SAFETY: p and raw live for the call; out is a local.
        check(unsafe { sys::ctr_tokens_open(p.as_ptr(), raw_ptr, &mut out) })?;
        drop(raw);
        let ptr = NonNull::new(out).expect("ctr_tokens_open returned OK and NULL");
        Ok(Tokens { ptr })
    }

    /// [`Tokens::open`] with the "format" and, when given, "dataset" keys.
    pub fn open_as(path: impl AsRef<Path>, format: &str, dataset: Option<i64>) -> Result<Tokens> {
        let mut options = Options::new().string("format", format);
        if let Some(d) = dataset {
            options.insert("dataset", d);
        }
        Tokens::open(path, Some(&options))
    }

    fn as_ptr(&self) -> *const sys::ctr_tokens {
        self.ptr.as_ptr()
    }

    /// `ctr_tokens_info`: JSON text {"name", "kind", "tokens", "max_id",
    /// "files": [{"path", "kind", "tokens", "width", "header_bytes"}]}.
    pub fn info(&self) -> Result<String> {
        let mut text: *const c_char = ptr::null();
        // SAFETY: live handle; the text is the thread's, copied before the
        // next call.
        check(unsafe { sys::ctr_tokens_info(self.as_ptr(), &mut text) })?;
        Ok(unsafe { owned_string(text) })
    }

    /// Tokens `[start, start + out.len())` into `out` (an int32 .npy's tokens
    /// as their bits). `INVALID_ARGUMENT` past the end.
    pub fn read_into(&self, start: i64, out: &mut [u32]) -> Result<()> {
        // SAFETY: out holds out.len() uint32, the count passed.
        check(unsafe {
            sys::ctr_tokens_read(self.as_ptr(), start, out.len() as i64, out.as_mut_ptr())
        })
    }

    /// Tokens `[start, start + count)` as a new vector.
    pub fn read(&self, start: i64, count: usize) -> Result<Vec<u32>> {
        let mut out: Vec<u32> = Vec::new();
        // Reserved, not filled: a count past the end is refused by the
        // library before the memory is touched.
        out.try_reserve_exact(count).map_err(|_| {
            Error::new(Status::OUT_OF_MEMORY, format!("ctr_tokens_read: {count} tokens"))
        })?;
        // SAFETY: the buffer has room for count uint32; on success the call
        // has written all count of them, so they are initialised.
        unsafe {
            check(sys::ctr_tokens_read(self.as_ptr(), start, count as i64, out.as_mut_ptr()))?;
            out.set_len(count);
        }
        Ok(out)
    }

    /// `ctr_tokens_samples`: how many samples of `seq` inputs the loader cuts
    /// from it. `mode` "windows" (`eot` < 0) or "documents" (split at each
    /// `eot` id). `DATA_ERROR` when not one sample fits.
    pub fn samples(&self, seq: i64, mode: &str, eot: i64) -> Result<i64> {
        let m = cstring("mode", mode)?;
        let mut n = 0i64;
        // SAFETY: live handle, NUL-terminated mode, local out-pointer.
        check(unsafe { sys::ctr_tokens_samples(self.as_ptr(), seq, m.as_ptr(), eot, &mut n) })?;
        Ok(n)
    }
}

impl Drop for Tokens {
    fn drop(&mut self) {
        // SAFETY: created by ctr_tokens_open, freed once.
        unsafe { sys::ctr_tokens_free(self.ptr.as_ptr()) }
    }
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokens").finish_non_exhaustive()
    }
}

/// `ctr_manifest_info`: a manifest's sub-datasets as JSON text {"path",
/// "mode" (or null), "eot" (or null), "datasets": [{"name", "weight",
/// "files", "format"}]}. `DATA_ERROR` naming the key at fault.
pub fn manifest_info(path: impl AsRef<Path>) -> Result<String> {
    check_abi()?;
    let p = cpath(path.as_ref())?;
    let mut text: *const c_char = ptr::null();
    // SAFETY: NUL-terminated path; the text is the thread's, copied before the
    // next call.
    check(unsafe { sys::ctr_manifest_info(p.as_ptr(), &mut text) })?;
    Ok(unsafe { owned_string(text) })
}

/// Writes a token file the loader reads: created as `path.tmp` and renamed by
/// [`TokenWriter::finish`], so a reader never sees half a file. Dropped
/// unfinished (or after a failure), it removes `path.tmp`.
pub struct TokenWriter {
    ptr: NonNull<sys::ctr_token_writer>,
}

// SAFETY: the writer is plain state behind its handle, used by one thread at a
// time (&mut self to write, self to finish). Not Sync.
unsafe impl Send for TokenWriter {}

impl TokenWriter {
    /// `ctr_token_writer_create`: `count` tokens into `path` as `format`
    /// ("llmc", "npy", "u16", "u32"), `width` 2 or 4 bytes per token ("u16",
    /// "u32": their own).
    pub fn create(
        path: impl AsRef<Path>,
        format: &str,
        width: i32,
        count: i64,
    ) -> Result<TokenWriter> {
        check_abi()?;
        let p = cpath(path.as_ref())?;
        let f = cstring("format", format)?;
        let mut out = ptr::null_mut();
        // SAFETY: NUL-terminated path and format, local out-pointer.
        check(unsafe {
            sys::ctr_token_writer_create(p.as_ptr(), f.as_ptr(), width, count, &mut out)
        })?;
        let ptr = NonNull::new(out).expect("ctr_token_writer_create returned OK and NULL");
        Ok(TokenWriter { ptr })
    }

    /// Appends `tokens`. An id that does not fit the width, or more tokens
    /// than the count given, fails with `DATA_ERROR` naming the id and its
    /// position.
    pub fn write(&mut self, tokens: &[u32]) -> Result<()> {
        // SAFETY: live handle; tokens is borrowed for the call.
        check(unsafe {
            sys::ctr_token_writer_write(self.ptr.as_ptr(), tokens.as_ptr(), tokens.len() as i64)
        })
    }

    /// Completes the file and renames it into place; fewer tokens than the
    /// count given fail with `DATA_ERROR`, and the file is not written.
    pub fn finish(self) -> Result<()> {
        // SAFETY: live handle; Drop frees it afterwards (finished or not).
        check(unsafe { sys::ctr_token_writer_finish(self.ptr.as_ptr()) })
    }
}

impl Drop for TokenWriter {
    fn drop(&mut self) {
        // SAFETY: created by ctr_token_writer_create, freed once; an
        // unfinished file's path.tmp is removed.
        unsafe { sys::ctr_token_writer_free(self.ptr.as_ptr()) }
    }
}

impl std::fmt::Debug for TokenWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenWriter").finish_non_exhaustive()
    }
}

/// Writes `tokens` as a whole token file (a [`TokenWriter`] of their count).
pub fn write_tokens(
    path: impl AsRef<Path>,
    tokens: &[u32],
    format: &str,
    width: i32,
) -> Result<()> {
    let mut w = TokenWriter::create(path, format, width, tokens.len() as i64)?;
    w.write(tokens)?;
    w.finish()
}
