//! The token loader: a seeded, resumable order over a token file or the
//! built-in synthetic corpus.

use std::path::Path;
use std::ptr::{self, NonNull};

use crate::error::{check, Result};
use crate::{cpath, sys, Error, OptionValue, Options, Status};

/// Hands out `[rows, seq]` windows of tokens and targets. Owned by one thread
/// at a time (`&mut self` to advance); attach it to a [`crate::Step`] so that
/// checkpoints carry its position.
pub struct Loader {
    ptr: NonNull<sys::ctr_loader>,
    // The header has no call returning a loader's window length, yet
    // ctr_loader_next writes rows * seq ids per buffer; the value given at
    // creation is kept so buffers can be checked before the library writes.
    seq: usize,
}

// SAFETY: the loader is plain state behind its handle, used by one thread at a
// time (every call that advances it takes &mut self); nothing ties it to the
// thread that created it. Not Sync: the header does not promise concurrent use.
unsafe impl Send for Loader {}

impl Loader {
    /// `ctr_loader_create`: `path` is an llm.c token file or any file read as
    /// bytes, or None for the built-in corpus. Keys: "seq" (required), "seed",
    /// "corpus_bytes".
    pub fn new(path: Option<&Path>, options: &Options) -> Result<Loader> {
        let raw = options.to_raw()?;
        let p = path.map(cpath).transpose()?;
        let mut out = ptr::null_mut();
        let path_ptr = p.as_ref().map_or(ptr::null(), |p| p.as_ptr());
        // SAFETY: raw and p live for the call; out is a local.
        check(unsafe { sys::ctr_loader_create(path_ptr, raw.as_ptr(), &mut out) })?;
        let ptr = NonNull::new(out).expect("ctr_loader_create returned OK and NULL");
        // The library accepted "seq", so it is present and a positive int.
        let seq = match options.get("seq") {
            Some(OptionValue::Int(s)) if *s > 0 => *s as usize,
            _ => 0,
        };
        Ok(Loader { ptr, seq })
    }

    /// A loader over the built-in synthetic corpus.
    pub fn builtin(options: &Options) -> Result<Loader> {
        Loader::new(None, options)
    }

    /// A loader over a token file.
    pub fn open(path: impl AsRef<Path>, options: &Options) -> Result<Loader> {
        Loader::new(Some(path.as_ref()), options)
    }

    pub(crate) fn as_ptr(&self) -> *mut sys::ctr_loader {
        self.ptr.as_ptr()
    }

    /// Window length given at creation.
    pub fn seq(&self) -> usize {
        self.seq
    }

    /// Fills the next `rows` windows; both slices must hold exactly
    /// `rows * seq` ids.
    pub fn next(&mut self, rows: usize, tokens: &mut [i32], targets: &mut [i32]) -> Result<()> {
        let need = rows.saturating_mul(self.seq);
        if tokens.len() != need || targets.len() != need {
            return Err(Error::new(
                Status::INVALID_ARGUMENT,
                format!(
                    "ctr_loader_next: {rows} rows of seq {} need {need} ids per buffer, got {} \
                     tokens and {} targets",
                    self.seq,
                    tokens.len(),
                    targets.len()
                ),
            ));
        }
        // SAFETY: both buffers hold rows * seq int32 as the call writes.
        check(unsafe {
            sys::ctr_loader_next(
                self.as_ptr(),
                rows as i64,
                tokens.as_mut_ptr(),
                targets.as_mut_ptr(),
            )
        })
    }

    /// One rank's share of the next global batch: advances the loader by
    /// `global_rows` samples, exactly as `next(global_rows, ..)` would, but
    /// reads only the `tokens.len() / seq` rows starting at `first_row`. Every
    /// rank calls it with the same `global_rows`, so the loader's state stays
    /// the same on all ranks whatever the split.
    pub fn next_slice(
        &mut self,
        global_rows: usize,
        first_row: usize,
        tokens: &mut [i32],
        targets: &mut [i32],
    ) -> Result<()> {
        if self.seq == 0 || tokens.len() % self.seq != 0 || targets.len() != tokens.len() {
            return Err(Error::new(
                Status::INVALID_ARGUMENT,
                format!(
                    "ctr_loader_next_slice: buffers must hold whole rows of seq {}, got {} \
                     tokens and {} targets",
                    self.seq,
                    tokens.len(),
                    targets.len()
                ),
            ));
        }
        let rows = tokens.len() / self.seq;
        // The header allows NULL buffers for zero rows.
        let (tp, gp) = if rows == 0 {
            (ptr::null_mut(), ptr::null_mut())
        } else {
            (tokens.as_mut_ptr(), targets.as_mut_ptr())
        };
        // SAFETY: both buffers hold rows * seq int32 as the call writes; the
        // library checks first_row + rows <= global_rows.
        check(unsafe {
            sys::ctr_loader_next_slice(
                self.as_ptr(),
                global_rows as i64,
                first_row as i64,
                rows as i64,
                tp,
                gp,
            )
        })
    }

    /// The next `rows` windows as freshly allocated (tokens, targets).
    pub fn next_batch(&mut self, rows: usize) -> Result<(Vec<i32>, Vec<i32>)> {
        let n = rows * self.seq;
        let (mut tokens, mut targets) = (vec![0i32; n], vec![0i32; n]);
        self.next(rows, &mut tokens, &mut targets)?;
        Ok((tokens, targets))
    }

    /// (tokens in the source, largest token id).
    pub fn info(&self) -> Result<(i64, i64)> {
        let (mut tokens, mut max_token) = (0i64, 0i64);
        // SAFETY: live handle, local out-pointers.
        check(unsafe { sys::ctr_loader_info(self.as_ptr(), &mut tokens, &mut max_token) })?;
        Ok((tokens, max_token))
    }
}

impl Drop for Loader {
    fn drop(&mut self) {
        // SAFETY: created by ctr_loader_create, freed once. A step it was
        // attached to owns it and detaches it before dropping it (Step::drop).
        unsafe { sys::ctr_loader_free(self.ptr.as_ptr()) }
    }
}

impl std::fmt::Debug for Loader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loader").field("seq", &self.seq).finish()
    }
}
