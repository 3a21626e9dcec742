//! The mesh: which rank this process is, how many there are, and their axes.

use std::ptr::{self, NonNull};
use std::sync::Arc;

use crate::error::{check, Result};
use crate::{cstring, owned_string, sys, Options};

pub(crate) struct MeshHandle(NonNull<sys::ctr_mesh>);

// SAFETY: the header makes a ctr_mesh read-only after creation and shareable
// between threads and steps; the handle is only freed by Drop, when no other
// reference exists.
unsafe impl Send for MeshHandle {}
unsafe impl Sync for MeshHandle {}

impl Drop for MeshHandle {
    fn drop(&mut self) {
        // SAFETY: created by ctr_mesh_create*, freed once, after every Step
        // holding a clone of the Arc has been dropped.
        unsafe { sys::ctr_mesh_free(self.0.as_ptr()) }
    }
}

/// Who and where: rank, world size, axes ("dp", "fsdp", "ep") and device.
/// Clones share one C handle, freed with the last clone.
#[derive(Clone)]
pub struct Mesh {
    pub(crate) inner: Arc<MeshHandle>,
}

impl Mesh {
    /// `ctr_mesh_create`: keys "device", "rank", "world", "mesh", "threads".
    /// Empty options take every default (one CPU rank).
    pub fn new(options: &Options) -> Result<Mesh> {
        Mesh::create(options, false)
    }

    /// `ctr_mesh_create_from_env`: rank and world from CTR_RANK/CTR_WORLD_SIZE,
    /// torchrun, Slurm or Open MPI variables; `options` override them. With
    /// more than one rank this joins the rendezvous and blocks until all ranks
    /// have.
    pub fn from_env(options: &Options) -> Result<Mesh> {
        Mesh::create(options, true)
    }

    fn create(options: &Options, from_env: bool) -> Result<Mesh> {
        let raw = options.to_raw()?;
        let mut out = ptr::null_mut();
        // SAFETY: raw is live for the call; out is a local.
        let status = unsafe {
            if from_env {
                sys::ctr_mesh_create_from_env(raw.as_ptr(), &mut out)
            } else {
                sys::ctr_mesh_create(raw.as_ptr(), &mut out)
            }
        };
        check(status)?;
        drop(raw);
        let handle = NonNull::new(out).expect("ctr_mesh_create returned OK and NULL");
        Ok(Mesh { inner: Arc::new(MeshHandle(handle)) })
    }

    pub(crate) fn as_ptr(&self) -> *const sys::ctr_mesh {
        self.inner.0.as_ptr()
    }

    pub fn rank(&self) -> i32 {
        // SAFETY: live handle.
        unsafe { sys::ctr_mesh_rank(self.as_ptr()) }
    }

    pub fn world_size(&self) -> i32 {
        // SAFETY: live handle.
        unsafe { sys::ctr_mesh_world_size(self.as_ptr()) }
    }

    /// This rank's share of the global batch: the ranks of one tensor-parallel
    /// group compute on the same rows.
    pub fn data_rank(&self) -> i32 {
        // SAFETY: live handle.
        unsafe { sys::ctr_mesh_data_rank(self.as_ptr()) }
    }

    /// How many shares the global batch is split into.
    pub fn data_size(&self) -> i32 {
        // SAFETY: live handle.
        unsafe { sys::ctr_mesh_data_size(self.as_ptr()) }
    }

    /// Size of the named axis; 1 for an axis the mesh lacks. A name with a NUL
    /// byte cannot name an axis and gives 0, as the C call does for NULL.
    pub fn axis_size(&self, axis: &str) -> i32 {
        match cstring("axis", axis) {
            // SAFETY: live handle, NUL-terminated name.
            Ok(a) => unsafe { sys::ctr_mesh_axis_size(self.as_ptr(), a.as_ptr()) },
            Err(_) => 0,
        }
    }

    /// "cpu" or "cuda".
    pub fn device(&self) -> String {
        // SAFETY: the string is owned by the live mesh and copied at once.
        unsafe { owned_string(sys::ctr_mesh_device(self.as_ptr())) }
    }
}

impl std::fmt::Debug for Mesh {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mesh")
            .field("rank", &self.rank())
            .field("world_size", &self.world_size())
            .field("device", &self.device())
            .finish()
    }
}
