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

    /// `ctr_mesh_describe`: the mesh as JSON text (rank, world, axes, device,
    /// transport, timeout_s).
    pub fn describe(&self) -> Result<String> {
        let mut text = ptr::null();
        // SAFETY: live handle; the text is copied before the next call.
        check(unsafe { sys::ctr_mesh_describe(self.as_ptr(), &mut text) })?;
        Ok(unsafe { owned_string(text) })
    }

    /// `ctr_mesh_group`: this rank's index in its group over `axis` ("world"
    /// or a mesh axis), the group's size and its members' world ranks.
    pub fn group(&self, axis: &str) -> Result<(i32, i32, Vec<i32>)> {
        let a = cstring("axis", axis)?;
        let (mut me, mut size) = (0, 0);
        // SAFETY: live handle, NUL-terminated name, locals as outputs.
        check(unsafe { sys::ctr_mesh_group(self.as_ptr(), a.as_ptr(), &mut me, &mut size) })?;
        let mut members = Vec::with_capacity(size as usize);
        for i in 0..size {
            let mut r = 0;
            check(unsafe { sys::ctr_mesh_group_member(self.as_ptr(), a.as_ptr(), i, &mut r) })?;
            members.push(r);
        }
        Ok((me, size, members))
    }

    /// Host collectives (`ctr_mesh_all_reduce`, ...): blocking, with the
    /// mesh's deadline; every member of the group calls the same ones in the
    /// same order, and none while a step of this mesh runs on another thread.
    /// `op`: "sum", "avg", "max" or "min".
    pub fn all_reduce<T: Reducible>(&self, axis: &str, data: &mut [T], op: &str) -> Result<()> {
        let a = cstring("axis", axis)?;
        let op = reduce_op(op)?;
        let p = data.as_mut_ptr() as *mut std::ffi::c_void;
        // SAFETY: live handle; send == recv is allowed; len elements of T's dtype.
        check(unsafe {
            sys::ctr_mesh_all_reduce(self.as_ptr() as *mut _, a.as_ptr(), p, p, data.len(), T::DTYPE, op)
        })
    }

    /// Every member's `data`, concatenated in member order.
    pub fn all_gather<T: Reducible>(&self, axis: &str, data: &[T]) -> Result<Vec<T>> {
        let (_, size, _) = self.group(axis)?;
        let a = cstring("axis", axis)?;
        let mut out: Vec<T> = vec![T::default(); data.len() * size as usize];
        // SAFETY: live handle; out holds size blocks of data's bytes.
        check(unsafe {
            sys::ctr_mesh_all_gather(
                self.as_ptr() as *mut _,
                a.as_ptr(),
                data.as_ptr() as *const std::ffi::c_void,
                out.as_mut_ptr() as *mut std::ffi::c_void,
                std::mem::size_of_val(data),
            )
        })?;
        Ok(out)
    }

    /// Member `root`'s `data` into every member's.
    pub fn broadcast<T: Reducible>(&self, axis: &str, data: &mut [T], root: i32) -> Result<()> {
        let a = cstring("axis", axis)?;
        // SAFETY: live handle; data is len elements.
        check(unsafe {
            sys::ctr_mesh_broadcast(
                self.as_ptr() as *mut _,
                a.as_ptr(),
                data.as_mut_ptr() as *mut std::ffi::c_void,
                std::mem::size_of_val(data),
                root,
            )
        })
    }

    pub fn barrier(&self, axis: &str) -> Result<()> {
        let a = cstring("axis", axis)?;
        // SAFETY: live handle.
        check(unsafe { sys::ctr_mesh_barrier(self.as_ptr() as *mut _, a.as_ptr()) })
    }
}

/// Element types the host collectives reduce.
pub trait Reducible: Copy + Default {
    const DTYPE: sys::ctr_dtype;
}
impl Reducible for f32 {
    const DTYPE: sys::ctr_dtype = sys::CTR_DTYPE_F32;
}
impl Reducible for f64 {
    const DTYPE: sys::ctr_dtype = sys::CTR_DTYPE_F64;
}
impl Reducible for i32 {
    const DTYPE: sys::ctr_dtype = sys::CTR_DTYPE_I32;
}
impl Reducible for i64 {
    const DTYPE: sys::ctr_dtype = sys::CTR_DTYPE_I64;
}

fn reduce_op(op: &str) -> Result<sys::ctr_reduce_op> {
    match op {
        "sum" => Ok(sys::CTR_REDUCE_SUM),
        "avg" => Ok(sys::CTR_REDUCE_AVG),
        "max" => Ok(sys::CTR_REDUCE_MAX),
        "min" => Ok(sys::CTR_REDUCE_MIN),
        _ => Err(crate::Error::new(
            crate::Status::INVALID_ARGUMENT,
            format!("reduction '{}' (sum, avg, max or min)", op.escape_debug()),
        )),
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
