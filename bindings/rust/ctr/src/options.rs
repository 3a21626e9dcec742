//! Typed key/value options.
//!
//! `Options` is ordinary Rust data, built with chained setters and cloned or
//! reused freely. It becomes a C `ctr_options` handle only inside the call that
//! consumes it (`RawOptions`), which frees the handle when the call returns.
//! Unknown keys are not checked here: the header makes them an error at the
//! consuming call, which names the key and lists the known ones.

use std::ptr::{self, NonNull};

use crate::error::{check, Result};
use crate::{check_abi, cstring, sys};

/// One option value, typed as the header types its keys.
#[derive(Clone, Debug, PartialEq)]
pub enum OptionValue {
    Int(i64),
    Float(f64),
    Str(String),
}

macro_rules! int_from {
    ($($t:ty),*) => {$(
        impl From<$t> for OptionValue {
            fn from(v: $t) -> Self { OptionValue::Int(v as i64) }
        }
    )*};
}
int_from!(i8, i16, i32, i64, u8, u16, u32);

impl From<bool> for OptionValue {
    /// Flags such as "tied" or "check_finite" are ints 0/1 in the header.
    fn from(v: bool) -> Self {
        OptionValue::Int(v as i64)
    }
}
impl From<f32> for OptionValue {
    fn from(v: f32) -> Self {
        OptionValue::Float(v as f64)
    }
}
impl From<f64> for OptionValue {
    fn from(v: f64) -> Self {
        OptionValue::Float(v)
    }
}
impl From<&str> for OptionValue {
    fn from(v: &str) -> Self {
        OptionValue::Str(v.to_string())
    }
}
impl From<String> for OptionValue {
    fn from(v: String) -> Self {
        OptionValue::Str(v)
    }
}

/// Keys and typed values for a mesh, graph preset, step or loader. Setting a
/// key again replaces its value, as `ctr_options_set_*` does.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Options {
    entries: Vec<(String, OptionValue)>,
}

impl Options {
    pub fn new() -> Options {
        Options::default()
    }

    /// Sets `key`; the value's Rust type picks the C setter (integers and bool
    /// → int, floats → float, strings → string).
    pub fn set(mut self, key: &str, value: impl Into<OptionValue>) -> Options {
        self.insert(key, value);
        self
    }

    pub fn int(self, key: &str, value: i64) -> Options {
        self.set(key, OptionValue::Int(value))
    }

    pub fn float(self, key: &str, value: f64) -> Options {
        self.set(key, OptionValue::Float(value))
    }

    pub fn string(self, key: &str, value: &str) -> Options {
        self.set(key, OptionValue::Str(value.to_string()))
    }

    /// In-place form of [`Options::set`].
    pub fn insert(&mut self, key: &str, value: impl Into<OptionValue>) -> &mut Options {
        let value = value.into();
        match self.entries.iter_mut().find(|(k, _)| k == key) {
            Some(entry) => entry.1 = value,
            None => self.entries.push((key.to_string(), value)),
        }
        self
    }

    pub fn get(&self, key: &str) -> Option<&OptionValue> {
        self.entries.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &OptionValue)> {
        self.entries.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// A C handle holding these values, freed when the result is dropped.
    pub(crate) fn to_raw(&self) -> Result<RawOptions> {
        check_abi()?;
        let mut raw = ptr::null_mut();
        // SAFETY: out-pointer to a local.
        check(unsafe { sys::ctr_options_create(&mut raw) })?;
        let raw = RawOptions(NonNull::new(raw).expect("ctr_options_create returned OK and NULL"));
        for (key, value) in &self.entries {
            let k = cstring("option key", key)?;
            // SAFETY: raw is a live handle; key and value are NUL-terminated
            // and only borrowed for the call (the library copies them).
            let status = unsafe {
                match value {
                    OptionValue::Int(v) => sys::ctr_options_set_int(raw.0.as_ptr(), k.as_ptr(), *v),
                    OptionValue::Float(v) => {
                        sys::ctr_options_set_float(raw.0.as_ptr(), k.as_ptr(), *v)
                    }
                    OptionValue::Str(v) => {
                        let v = cstring("option value", v)?;
                        sys::ctr_options_set_string(raw.0.as_ptr(), k.as_ptr(), v.as_ptr())
                    }
                }
            };
            check(status)?;
        }
        Ok(raw)
    }
}

/// An owned `ctr_options` handle, alive for one consuming call.
pub(crate) struct RawOptions(NonNull<sys::ctr_options>);

impl RawOptions {
    pub(crate) fn as_ptr(&self) -> *const sys::ctr_options {
        self.0.as_ptr()
    }
}

impl Drop for RawOptions {
    fn drop(&mut self) {
        // SAFETY: created by ctr_options_create and freed only here.
        unsafe { sys::ctr_options_free(self.0.as_ptr()) }
    }
}
