//! The graph: what to train, loaded from a .ctrg file, bytes, or a preset.

use std::path::Path;
use std::ptr::{self, NonNull};
use std::sync::Arc;

use crate::error::{check, Result};
use crate::{check_abi, cpath, cstring, owned_string, sys, DType, Error, Options, Status};

pub(crate) struct GraphHandle(NonNull<sys::ctr_graph>);

// SAFETY: the header makes a ctr_graph read-only after creation and shareable
// between threads and steps; only Drop frees it, when no reference is left.
unsafe impl Send for GraphHandle {}
unsafe impl Sync for GraphHandle {}

impl Drop for GraphHandle {
    fn drop(&mut self) {
        // SAFETY: created by a ctr_graph_* constructor, freed once, after every
        // Step holding a clone of the Arc has been dropped.
        unsafe { sys::ctr_graph_free(self.0.as_ptr()) }
    }
}

/// dtype and shape of a graph tensor; `-1` marks a symbolic dim (batch, seq).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    pub dtype: DType,
    pub dims: Vec<i64>,
}

impl TensorInfo {
    /// Element count, or None while a dim is symbolic.
    pub fn numel(&self) -> Option<usize> {
        self.dims.iter().try_fold(1usize, |n, &d| if d < 0 { None } else { Some(n * d as usize) })
    }
}

/// A verified training graph. Clones share one C handle, freed with the last.
#[derive(Clone)]
pub struct Graph {
    pub(crate) inner: Arc<GraphHandle>,
}

impl Graph {
    fn wrap(out: *mut sys::ctr_graph) -> Graph {
        let handle = NonNull::new(out).expect("libctr returned OK and a NULL graph");
        Graph { inner: Arc::new(GraphHandle(handle)) }
    }

    /// `ctr_graph_load_file`: a malformed file fails with `INVALID_GRAPH`.
    pub fn load_file(path: impl AsRef<Path>) -> Result<Graph> {
        check_abi()?;
        let p = cpath(path.as_ref())?;
        let mut out = ptr::null_mut();
        // SAFETY: NUL-terminated path, local out-pointer.
        check(unsafe { sys::ctr_graph_load_file(p.as_ptr(), &mut out) })?;
        Ok(Graph::wrap(out))
    }

    /// `ctr_graph_load_buffer`: the bytes are copied.
    pub fn load_buffer(data: &[u8]) -> Result<Graph> {
        check_abi()?;
        let mut out = ptr::null_mut();
        // SAFETY: data is borrowed for the call only.
        check(unsafe { sys::ctr_graph_load_buffer(data.as_ptr().cast(), data.len(), &mut out) })?;
        Ok(Graph::wrap(out))
    }

    /// `ctr_graph_create_preset`: "gpt" or "llama", with keys "layers", "dim",
    /// "heads", "kv_heads", "vocab", "seq", "ffn_dim", "tied", "rope_theta",
    /// "norm_eps", "init_std".
    pub fn preset(preset: &str, options: &Options) -> Result<Graph> {
        let raw = options.to_raw()?;
        let name = cstring("preset", preset)?;
        let mut out = ptr::null_mut();
        // SAFETY: raw and name live for the call; out is a local.
        check(unsafe { sys::ctr_graph_create_preset(name.as_ptr(), raw.as_ptr(), &mut out) })?;
        Ok(Graph::wrap(out))
    }

    pub(crate) fn as_ptr(&self) -> *const sys::ctr_graph {
        self.inner.0.as_ptr()
    }

    /// Writes the graph as a .ctrg file.
    pub fn save_file(&self, path: impl AsRef<Path>) -> Result<()> {
        let p = cpath(path.as_ref())?;
        // SAFETY: live handle, NUL-terminated path.
        check(unsafe { sys::ctr_graph_save_file(self.as_ptr(), p.as_ptr()) })
    }

    /// Host inputs ("tokens", "targets"), in file order.
    pub fn input_names(&self) -> Result<Vec<String>> {
        // SAFETY: live handle.
        let n = unsafe { sys::ctr_graph_num_inputs(self.as_ptr()) };
        (0..n).map(|i| self.name_at(i, sys::ctr_graph_input_name)).collect()
    }

    /// Trained parameters, in file order.
    pub fn param_names(&self) -> Result<Vec<String>> {
        // SAFETY: live handle.
        let n = unsafe { sys::ctr_graph_num_params(self.as_ptr()) };
        (0..n).map(|i| self.name_at(i, sys::ctr_graph_param_name)).collect()
    }

    fn name_at(
        &self,
        i: usize,
        f: unsafe extern "C" fn(
            *const sys::ctr_graph,
            usize,
            *mut *const std::ffi::c_char,
        ) -> sys::ctr_status,
    ) -> Result<String> {
        let mut name = ptr::null();
        // SAFETY: live handle, local out-pointer; the string is owned by the
        // graph, which self keeps alive while it is copied.
        check(unsafe { f(self.as_ptr(), i, &mut name) })?;
        Ok(unsafe { owned_string(name) })
    }

    /// dtype and shape of the named tensor.
    pub fn tensor_info(&self, name: &str) -> Result<TensorInfo> {
        let n = cstring("tensor name", name)?;
        // The header has no way to ask for the rank alone, and a too-small
        // buffer fails without saying how large it must be; graph tensors have
        // a handful of dims, so a generous buffer is tried, then a huge one.
        for capacity in [16usize, 4096] {
            let mut dims = vec![0i64; capacity];
            let mut dtype: sys::ctr_dtype = 0;
            let mut ndim = 0usize;
            // SAFETY: dims has `capacity` elements; other out-pointers are locals.
            let status = unsafe {
                sys::ctr_graph_tensor_info(
                    self.as_ptr(),
                    n.as_ptr(),
                    &mut dtype,
                    dims.as_mut_ptr(),
                    capacity,
                    &mut ndim,
                )
            };
            match check(status) {
                Ok(()) => {
                    dims.truncate(ndim);
                    return Ok(TensorInfo { dtype: DType(dtype), dims });
                }
                Err(e) if e.status() == Status::INVALID_ARGUMENT && capacity < 4096 => continue,
                Err(e) => return Err(e),
            }
        }
        Err(Error::new(Status::INVALID_ARGUMENT, format!("tensor '{name}' has too many dims")))
    }

    /// Total number of trained parameter elements.
    pub fn param_count(&self) -> Result<i64> {
        let mut count = 0i64;
        // SAFETY: live handle, local out-pointer.
        check(unsafe { sys::ctr_graph_param_count(self.as_ptr(), &mut count) })?;
        Ok(count)
    }

    /// Training FLOPs per token at sequence length `seq` (0 = the graph's max).
    pub fn flops_per_token(&self, seq: i64) -> Result<f64> {
        let mut flops = 0f64;
        // SAFETY: live handle, local out-pointer.
        check(unsafe { sys::ctr_graph_flops_per_token(self.as_ptr(), seq, &mut flops) })?;
        Ok(flops)
    }

    /// The planner's layouts of this graph's step (ctr_plan) as JSON text; options: world,
    /// global_batch, cluster (a profile's JSON text or file), and optionally seq, recompute, top.
    pub fn plan(&self, options: &Options) -> Result<String> {
        let raw = options.to_raw()?;
        let mut text: *const std::os::raw::c_char = ptr::null();
        // SAFETY: live handle, options live for the call; the string is copied at once.
        check(unsafe { sys::ctr_plan(self.as_ptr(), raw.as_ptr(), &mut text) })?;
        Ok(unsafe { std::ffi::CStr::from_ptr(text) }.to_string_lossy().into_owned())
    }
}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graph").field("params", &self.param_count().ok()).finish()
    }
}
