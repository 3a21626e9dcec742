//! The step: the compiled, runnable training step and its state (parameters,
//! optimizer state, schedule position), plus checkpoints and weights.

use std::ffi::c_char;
use std::path::{Path, PathBuf};
use std::ptr::{self, NonNull};

use crate::error::{check, Result};
use crate::{
    cpath, cstring, owned_path, owned_string, sys, Error, Graph, Loader, Mesh, Options, Status,
};

mod sealed {
    pub trait Sealed {}
}

/// Plain element types a host buffer may hold for `Step::set_input`; the
/// library checks the byte count against the input's dtype and shape.
pub trait Element: sealed::Sealed + Copy {}
macro_rules! element {
    ($($t:ty),*) => {$( impl sealed::Sealed for $t {} impl Element for $t {} )*};
}
element!(i32, i64, u8, u16, u32, f32, f64);

/// What one `run` did (`ctr_step_metrics` without its size field).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Metrics {
    pub step: i64,
    pub loss: f64,
    pub grad_norm: f64,
    pub lr: f64,
    pub step_ms: f64,
    pub forward_ms: f64,
    pub backward_ms: f64,
    pub optimizer_ms: f64,
    pub tokens_per_s: f64,
    pub tokens: i64,
    pub peak_bytes: i64,
    /// Time this step waited to publish a background save.
    pub save_wait_ms: f64,
    /// Forward and backward, less `exposed_comm_ms`.
    pub compute_ms: f64,
    /// Time collectives were in flight on the comm stream.
    pub comm_ms: f64,
    /// Time compute waited for communication (not hidden).
    pub exposed_comm_ms: f64,
}

/// One mixture-of-experts layer of the last `run` (`ctr_moe_layer_metrics`,
/// copied out of the step).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct MoeLayer {
    /// "layers.0.moe".
    pub layer: String,
    pub experts: i64,
    /// Tokens routed to each expert (a token counts once per expert it chose),
    /// summed over the micro-batches and the ranks; `experts` entries.
    pub tokens_per_expert: Vec<i64>,
    /// Load-balancing term, averaged like the loss; None when the layer has
    /// none.
    pub aux_loss: Option<f64>,
    /// Router z-loss term; None when the layer has none.
    pub z_loss: Option<f64>,
}

/// Planned memory of a step, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Memory {
    pub arena_bytes: i64,
    pub param_bytes: i64,
    pub optimizer_bytes: i64,
}

/// What [`Step::resume`] loaded.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Resumed {
    /// The checkpoint directory that was loaded.
    pub path: PathBuf,
    /// The damaged checkpoints passed over on the way, in the order tried,
    /// one "DIR: reason" line each; empty when none was.
    pub skipped: Vec<String>,
}

/// A compiled training step. It holds clones of its [`Mesh`] and [`Graph`]
/// and owns its attached [`Loader`], so all three outlive the C step as the
/// header requires; they are released after the step itself is freed.
pub struct Step {
    ptr: NonNull<sys::ctr_step>,
    mesh: Mesh,
    graph: Graph,
    loader: Option<Loader>,
}

// SAFETY: the header allows a ctr_step on any thread, one thread at a time;
// every call that uses it mutably takes &mut self, and the calls through
// &self (count, memory) are the header's const reads. The mesh and graph it
// holds are Send + Sync and the loader is Send. Not Sync: two threads must not
// call a step at once.
unsafe impl Send for Step {}

impl Step {
    /// `ctr_step_create`: compiles `graph` for `mesh`. Keys: "batch"
    /// (required), "seq", "micro_batches", "seed", "lr", "min_lr",
    /// "warmup_steps", "decay_steps", "schedule", "beta1", "beta2", "eps",
    /// "weight_decay", "grad_clip", "check_finite", "reshard_after_forward",
    /// "keep".
    pub fn new(mesh: &Mesh, graph: &Graph, options: &Options) -> Result<Step> {
        let raw = options.to_raw()?;
        let mut out = ptr::null_mut();
        // SAFETY: mesh, graph and raw are live for the call; out is a local.
        check(unsafe {
            sys::ctr_step_create(mesh.as_ptr(), graph.as_ptr(), raw.as_ptr(), &mut out)
        })?;
        let ptr = NonNull::new(out).expect("ctr_step_create returned OK and NULL");
        Ok(Step { ptr, mesh: mesh.clone(), graph: graph.clone(), loader: None })
    }

    fn as_ptr(&self) -> *mut sys::ctr_step {
        self.ptr.as_ptr()
    }

    pub fn mesh(&self) -> &Mesh {
        &self.mesh
    }

    pub fn graph(&self) -> &Graph {
        &self.graph
    }

    /// Copies host data into the named input for the next run; the library
    /// checks the size and, for token inputs, the id range.
    pub fn set_input<T: Element>(&mut self, name: &str, data: &[T]) -> Result<()> {
        let n = cstring("input name", name)?;
        // SAFETY: data is borrowed for the call; Element types have no padding.
        check(unsafe {
            sys::ctr_step_set_input(
                self.as_ptr(),
                n.as_ptr(),
                data.as_ptr().cast(),
                std::mem::size_of_val(data),
            )
        })
    }

    /// Forward, backward and the optimizer update on the inputs last set.
    pub fn run(&mut self) -> Result<Metrics> {
        let mut m = sys::ctr_step_metrics {
            size: std::mem::size_of::<sys::ctr_step_metrics>(),
            ..Default::default()
        };
        // SAFETY: m is a local whose size field says how much may be written.
        check(unsafe { sys::ctr_step_run(self.as_ptr(), &mut m) })?;
        Ok(Metrics {
            step: m.step,
            loss: m.loss,
            grad_norm: m.grad_norm,
            lr: m.lr,
            step_ms: m.step_ms,
            forward_ms: m.forward_ms,
            backward_ms: m.backward_ms,
            optimizer_ms: m.optimizer_ms,
            tokens_per_s: m.tokens_per_s,
            tokens: m.tokens,
            peak_bytes: m.peak_bytes,
            save_wait_ms: m.save_wait_ms,
            compute_ms: m.compute_ms,
            comm_ms: m.comm_ms,
            exposed_comm_ms: m.exposed_comm_ms,
        })
    }

    /// Forward only, no update: the mean loss on the inputs last set.
    pub fn evaluate(&mut self) -> Result<f64> {
        let mut loss = 0f64;
        // SAFETY: local out-pointer.
        check(unsafe { sys::ctr_step_evaluate(self.as_ptr(), &mut loss) })?;
        Ok(loss)
    }

    /// Copies the named parameter into `out`, which must have its element count.
    pub fn get_param(&mut self, name: &str, out: &mut [f32]) -> Result<()> {
        let n = cstring("parameter name", name)?;
        // SAFETY: out holds out.len() floats, the count passed.
        check(unsafe {
            sys::ctr_step_get_param(self.as_ptr(), n.as_ptr(), out.as_mut_ptr(), out.len())
        })
    }

    /// The named parameter as a new vector, sized from the graph.
    pub fn param(&mut self, name: &str) -> Result<Vec<f32>> {
        let info = self.graph.tensor_info(name)?;
        let count = info.numel().ok_or_else(|| {
            Error::new(Status::INVALID_ARGUMENT, format!("parameter '{name}' has a symbolic dim"))
        })?;
        let mut out = vec![0f32; count];
        self.get_param(name, &mut out)?;
        Ok(out)
    }

    /// Sets the named parameter from `data`, which must have its element count.
    pub fn set_param(&mut self, name: &str, data: &[f32]) -> Result<()> {
        let n = cstring("parameter name", name)?;
        // SAFETY: data is borrowed for the call; its length is the count.
        check(unsafe {
            sys::ctr_step_set_param(self.as_ptr(), n.as_ptr(), data.as_ptr(), data.len())
        })
    }

    /// Copies a forward activation named in the step option "keep" into `out`
    /// (its element count for one micro-batch).
    pub fn get_output(&mut self, name: &str, out: &mut [f32]) -> Result<()> {
        let n = cstring("output name", name)?;
        // SAFETY: out holds out.len() floats, the count passed.
        check(unsafe {
            sys::ctr_step_get_output(self.as_ptr(), n.as_ptr(), out.as_mut_ptr(), out.len())
        })
    }

    /// The mixture-of-experts layers of the last run as JSON text: an array with one object
    /// per layer, {"layer", "tokens_per_expert", "aux_loss", "z_loss"}; "[]" without experts.
    pub fn moe_metrics(&mut self) -> Result<String> {
        let mut text: *const std::os::raw::c_char = std::ptr::null();
        // SAFETY: live handle; the library points text at a string the step owns, copied here
        // before any other call on the step.
        check(unsafe { sys::ctr_step_moe_metrics(self.as_ptr(), &mut text) })?;
        Ok(unsafe { std::ffi::CStr::from_ptr(text) }.to_string_lossy().into_owned())
    }

    /// [`Step::moe_metrics`] through the struct call (`ctr_step_moe_layer`):
    /// one entry per layer in graph order; empty without experts or before the
    /// first run.
    pub fn moe_layers(&mut self) -> Result<Vec<MoeLayer>> {
        // SAFETY: live handle.
        let n = unsafe { sys::ctr_step_moe_layers(self.as_ptr()) };
        let mut layers = Vec::with_capacity(n);
        for i in 0..n {
            let mut m = sys::ctr_moe_layer_metrics {
                size: std::mem::size_of::<sys::ctr_moe_layer_metrics>(),
                ..Default::default()
            };
            // SAFETY: m is a local whose size field says how much may be written.
            check(unsafe { sys::ctr_step_moe_layer(self.as_ptr(), i, &mut m) })?;
            let experts = usize::try_from(m.experts).unwrap_or(0);
            // SAFETY: on success layer and tokens_per_expert ([experts]) are the
            // step's, valid until its next mutating call; copied before any.
            let tokens_per_expert = if experts == 0 || m.tokens_per_expert.is_null() {
                Vec::new()
            } else {
                unsafe { std::slice::from_raw_parts(m.tokens_per_expert, experts) }.to_vec()
            };
            let loss = |x: f64| if x.is_nan() { None } else { Some(x) };
            layers.push(MoeLayer {
                layer: unsafe { owned_string(m.layer) },
                experts: m.experts,
                tokens_per_expert,
                aux_loss: loss(m.aux_loss),
                z_loss: loss(m.z_loss),
            });
        }
        Ok(layers)
    }

    /// Milliseconds the last run's collectives were in flight, per mesh axis, as JSON text
    /// ({"tp": ms, "fsdp": ms, ...}; "{}" without collectives).
    pub fn comm_metrics(&mut self) -> Result<String> {
        let mut text: *const std::os::raw::c_char = std::ptr::null();
        // SAFETY: live handle; the string is owned by the step and copied at once.
        check(unsafe { sys::ctr_step_comm_metrics(self.as_ptr(), &mut text) })?;
        Ok(unsafe { std::ffi::CStr::from_ptr(text) }.to_string_lossy().into_owned())
    }

    /// The tasks of the last run on this rank, as JSON text: an array of {"name", "cat",
    /// "stage", "micro_batch", "start_us", "dur_us"} in the order they ran.
    pub fn timeline(&mut self) -> Result<String> {
        let mut text: *const std::os::raw::c_char = std::ptr::null();
        // SAFETY: live handle; the string is owned by the step and copied at once.
        check(unsafe { sys::ctr_step_timeline(self.as_ptr(), &mut text) })?;
        Ok(unsafe { std::ffi::CStr::from_ptr(text) }.to_string_lossy().into_owned())
    }

    /// With step option profile_kernels = 1: each kernel of this rank's program as JSON
    /// text, an array of {"node", "op", "phase", "flops", "bytes", "runs", "us"}.
    pub fn kernel_profile(&mut self) -> Result<String> {
        let mut text: *const std::os::raw::c_char = std::ptr::null();
        // SAFETY: live handle; the string is owned by the step and copied at once.
        check(unsafe { sys::ctr_step_kernel_profile(self.as_ptr(), &mut text) })?;
        Ok(unsafe { std::ffi::CStr::from_ptr(text) }.to_string_lossy().into_owned())
    }

    /// Replaces the schedule by a constant learning rate from the next run on.
    pub fn set_lr(&mut self, lr: f64) -> Result<()> {
        // SAFETY: live handle.
        check(unsafe { sys::ctr_step_set_lr(self.as_ptr(), lr) })
    }

    /// Planned bytes: activation arena, parameters (+ gradients), optimizer.
    pub fn memory(&self) -> Result<Memory> {
        let mut m = Memory::default();
        // SAFETY: live handle, out-pointers into a local.
        check(unsafe {
            sys::ctr_step_memory(
                self.as_ptr(),
                &mut m.arena_bytes,
                &mut m.param_bytes,
                &mut m.optimizer_bytes,
            )
        })?;
        Ok(m)
    }

    /// Optimizer steps taken so far.
    pub fn count(&self) -> i64 {
        // SAFETY: live handle.
        unsafe { sys::ctr_step_count(self.as_ptr()) }
    }

    /// Saves the whole state (and the attached loader's position) to `dir`,
    /// atomically. Collective over the mesh.
    pub fn save(&mut self, dir: impl AsRef<Path>) -> Result<()> {
        let d = cpath(dir.as_ref())?;
        // SAFETY: live handle, NUL-terminated path.
        check(unsafe { sys::ctr_step_save(self.as_ptr(), d.as_ptr()) })
    }

    /// Restores a checkpoint written by `save`; a bad one fails with
    /// `CHECKPOINT_ERROR` and leaves the step unchanged. Collective.
    pub fn load(&mut self, dir: impl AsRef<Path>) -> Result<()> {
        let d = cpath(dir.as_ref())?;
        // SAFETY: live handle, NUL-terminated path.
        check(unsafe { sys::ctr_step_load(self.as_ptr(), d.as_ptr()) })
    }

    /// `ctr_step_save_checkpoint` (since 0.2): saves into
    /// `root/step_NNNNNNNN` (NNNNNNNN = [`Step::count`]) and returns that
    /// directory. Once the save is published (at once unless the step option
    /// "async_save" is set), `root/latest` names it and all but the "keep"
    /// newest `step_*` directories are removed. Key: "keep" (3; 0 keeps all).
    /// Collective over the mesh.
    pub fn save_checkpoint(
        &mut self,
        root: impl AsRef<Path>,
        options: &Options,
    ) -> Result<PathBuf> {
        let raw = options.to_raw()?;
        let r = cpath(root.as_ref())?;
        let mut path: *const c_char = ptr::null();
        // SAFETY: live handle; root and options live for the call; path is a
        // local out-pointer.
        check(unsafe {
            sys::ctr_step_save_checkpoint(self.as_ptr(), r.as_ptr(), raw.as_ptr(), &mut path)
        })?;
        // SAFETY: on success path is the step's string, valid until its next
        // call; copied before any other.
        Ok(unsafe { owned_path(path) })
    }

    /// `ctr_step_resume` (since 0.2): restores a checkpoint from a directory
    /// of [`Step::save_checkpoint`]. `which` `None` (or "latest"): the one
    /// `root/latest` names (else the newest `step_*`), falling back to older
    /// ones while a checkpoint is damaged. Otherwise a checkpoint name under
    /// `root` or a path. An empty root fails with `NOT_FOUND`, no usable
    /// checkpoint with `CHECKPOINT_ERROR`; the step is unchanged then.
    /// Collective over the mesh.
    pub fn resume(&mut self, root: impl AsRef<Path>, which: Option<&Path>) -> Result<Resumed> {
        let r = cpath(root.as_ref())?;
        let w = which.map(cpath).transpose()?;
        let (mut path, mut skipped): (*const c_char, *const c_char) = (ptr::null(), ptr::null());
        // SAFETY: live handle; root and which live for the call; path and
        // skipped are local out-pointers.
        check(unsafe {
            sys::ctr_step_resume(
                self.as_ptr(),
                r.as_ptr(),
                w.as_ref().map_or(ptr::null(), |w| w.as_ptr()),
                &mut path,
                &mut skipped,
            )
        })?;
        // SAFETY: on success both are the step's strings (skipped may be
        // NULL), valid until its next call; copied before any other.
        let (path, skipped) = unsafe { (owned_path(path), owned_string(skipped)) };
        Ok(Resumed { path, skipped: skipped.lines().map(String::from).collect() })
    }

    /// Writes the parameters as a safetensors file (rank 0 writes). Collective.
    pub fn export_safetensors(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let p = cpath(path.as_ref())?;
        // SAFETY: live handle, NUL-terminated path.
        check(unsafe { sys::ctr_step_export_safetensors(self.as_ptr(), p.as_ptr()) })
    }

    /// Sets the parameters from a safetensors file. Key: "allow_extra".
    pub fn import_safetensors(&mut self, path: impl AsRef<Path>, options: &Options) -> Result<()> {
        let raw = options.to_raw()?;
        let p = cpath(path.as_ref())?;
        // SAFETY: live handle; path and options live for the call.
        check(unsafe { sys::ctr_step_import_safetensors(self.as_ptr(), p.as_ptr(), raw.as_ptr()) })
    }

    /// Attaches `loader` so checkpoints save and restore its position. The
    /// step takes ownership (the C step reads the loader until detached, so it
    /// must not be freed or advanced elsewhere); reach it with
    /// [`Step::loader_mut`]. A loader attached before is replaced and dropped.
    /// On failure the loader is dropped and the previous one stays attached.
    pub fn attach_loader(&mut self, loader: Loader) -> Result<()> {
        // SAFETY: both handles are live; the step keeps the loader (below)
        // for as long as the C step may use it.
        check(unsafe { sys::ctr_step_attach_loader(self.as_ptr(), loader.as_ptr()) })?;
        self.loader = Some(loader);
        Ok(())
    }

    /// Detaches the loader and hands it back.
    pub fn detach_loader(&mut self) -> Result<Option<Loader>> {
        if self.loader.is_none() {
            return Ok(None);
        }
        // SAFETY: NULL detaches, as the header documents.
        check(unsafe { sys::ctr_step_attach_loader(self.as_ptr(), ptr::null_mut()) })?;
        Ok(self.loader.take())
    }

    /// The attached loader, to draw the next batch from.
    pub fn loader_mut(&mut self) -> Option<&mut Loader> {
        self.loader.as_mut()
    }

    /// Draws `rows` windows from the attached loader and sets them as the
    /// "tokens" and "targets" inputs: the usual body of a training loop.
    pub fn feed_from_loader(&mut self, rows: usize) -> Result<()> {
        let loader = self.loader.as_mut().ok_or_else(|| {
            Error::new(Status::INVALID_STATE, "feed_from_loader: no loader is attached to the step")
        })?;
        let (tokens, targets) = loader.next_batch(rows)?;
        self.set_input("tokens", &tokens)?;
        self.set_input("targets", &targets)
    }
}

impl Drop for Step {
    fn drop(&mut self) {
        // SAFETY: created by ctr_step_create, freed once. The mesh, graph and
        // loader fields are dropped after this body, so they outlive the step.
        unsafe { sys::ctr_step_free(self.ptr.as_ptr()) }
    }
}

impl std::fmt::Debug for Step {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Step").field("count", &self.count()).field("mesh", &self.mesh).finish()
    }
}
