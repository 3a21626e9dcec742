//! Raw declarations of libctr's C ABI, one for one with `include/ctr/ctr.h`.
//!
//! Nothing here is safe to call without reading the header: ownership, lifetimes
//! and threading are as documented there. The `ctr` crate wraps these in owning
//! types. The C enums are plain `c_int` aliases with constants, not Rust enums,
//! because the library may return a value this crate does not know yet (new
//! status codes are appended) and an unknown discriminant in a Rust enum is
//! undefined behaviour.

#![cfg_attr(not(test), no_std)]
#![allow(non_camel_case_types)]

use core::ffi::{c_char, c_double, c_int, c_void};

// ---------------------------------------------------------------------------
// Version

pub const CTR_VERSION_MAJOR: c_int = 0;
pub const CTR_VERSION_MINOR: c_int = 2;
pub const CTR_VERSION_PATCH: c_int = 0;

/// The ABI version these declarations were written for; compare it with
/// `ctr_abi_version()` before calling anything else.
pub const CTR_ABI_VERSION: c_int = 1;

// ---------------------------------------------------------------------------
// Status

pub type ctr_status = c_int;
pub const CTR_STATUS_OK: ctr_status = 0;
pub const CTR_STATUS_INVALID_ARGUMENT: ctr_status = 1;
pub const CTR_STATUS_INVALID_OPTION: ctr_status = 2;
pub const CTR_STATUS_INVALID_GRAPH: ctr_status = 3;
pub const CTR_STATUS_IO_ERROR: ctr_status = 4;
pub const CTR_STATUS_NOT_FOUND: ctr_status = 5;
pub const CTR_STATUS_OUT_OF_MEMORY: ctr_status = 6;
pub const CTR_STATUS_UNSUPPORTED: ctr_status = 7;
pub const CTR_STATUS_INVALID_STATE: ctr_status = 8;
pub const CTR_STATUS_DATA_ERROR: ctr_status = 9;
pub const CTR_STATUS_TIMEOUT: ctr_status = 10;
pub const CTR_STATUS_COMM_ERROR: ctr_status = 11;
pub const CTR_STATUS_NUMERIC_ERROR: ctr_status = 12;
pub const CTR_STATUS_INTERNAL: ctr_status = 13;
pub const CTR_STATUS_CHECKPOINT_ERROR: ctr_status = 14;
pub const CTR_STATUS_DEVICE_ERROR: ctr_status = 15;

// ---------------------------------------------------------------------------
// Data types

pub type ctr_reduce_op = c_int;
pub const CTR_REDUCE_SUM: ctr_reduce_op = 0;
pub const CTR_REDUCE_AVG: ctr_reduce_op = 1;
pub const CTR_REDUCE_MAX: ctr_reduce_op = 2;
pub const CTR_REDUCE_MIN: ctr_reduce_op = 3;

pub type ctr_dtype = c_int;
pub const CTR_DTYPE_F32: ctr_dtype = 0;
pub const CTR_DTYPE_F16: ctr_dtype = 1;
pub const CTR_DTYPE_BF16: ctr_dtype = 2;
pub const CTR_DTYPE_I32: ctr_dtype = 3;
pub const CTR_DTYPE_I64: ctr_dtype = 4;
pub const CTR_DTYPE_U16: ctr_dtype = 5;
pub const CTR_DTYPE_U32: ctr_dtype = 6;
pub const CTR_DTYPE_U8: ctr_dtype = 7;
pub const CTR_DTYPE_F64: ctr_dtype = 8;

// ---------------------------------------------------------------------------
// Opaque handles: zero-sized, unconstructible, and neither Send, Sync nor
// Unpin, so only pointers to them exist and the safe layer decides threading.

macro_rules! opaque {
    ($($name:ident),*) => {$(
        #[repr(C)]
        pub struct $name {
            _data: [u8; 0],
            _marker: core::marker::PhantomData<(*mut u8, core::marker::PhantomPinned)>,
        }
    )*};
}
opaque!(ctr_options, ctr_mesh, ctr_graph, ctr_step, ctr_loader, ctr_tokens, ctr_token_writer);

/// What one step did. Set `size` to `size_of::<ctr_step_metrics>()` before
/// passing it: the library fills only as much as the caller says it knows.
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
pub struct ctr_step_metrics {
    pub size: usize,
    pub step: i64,
    pub loss: c_double,
    pub grad_norm: c_double,
    pub lr: c_double,
    pub step_ms: c_double,
    pub forward_ms: c_double,
    pub backward_ms: c_double,
    pub optimizer_ms: c_double,
    pub tokens_per_s: c_double,
    pub tokens: i64,
    pub peak_bytes: i64,
    pub save_wait_ms: c_double,
    // Since 0.2:
    pub compute_ms: c_double,
    pub comm_ms: c_double,
    pub exposed_comm_ms: c_double,
}

/// One mixture-of-experts layer of the last run (since 0.6). Set `size` to
/// `size_of::<ctr_moe_layer_metrics>()` before passing it. `layer` and
/// `tokens_per_expert` (`experts` entries) belong to the step and stay valid
/// until its next mutating call; a loss the layer lacks is NaN.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ctr_moe_layer_metrics {
    pub size: usize,
    pub layer: *const c_char,
    pub experts: i64,
    pub tokens_per_expert: *const i64,
    pub aux_loss: c_double,
    pub z_loss: c_double,
}

impl Default for ctr_moe_layer_metrics {
    fn default() -> Self {
        ctr_moe_layer_metrics {
            size: 0,
            layer: core::ptr::null(),
            experts: 0,
            tokens_per_expert: core::ptr::null(),
            aux_loss: 0.0,
            z_loss: 0.0,
        }
    }
}

extern "C" {
    // Version
    pub fn ctr_version() -> *const c_char;
    pub fn ctr_abi_version() -> c_int;

    // Status and errors
    pub fn ctr_status_string(status: ctr_status) -> *const c_char;
    pub fn ctr_last_error() -> *const c_char;

    // Data types
    pub fn ctr_dtype_size(dtype: ctr_dtype) -> usize;

    // Options
    pub fn ctr_options_create(out: *mut *mut ctr_options) -> ctr_status;
    pub fn ctr_options_free(options: *mut ctr_options);
    pub fn ctr_options_set_int(
        options: *mut ctr_options,
        key: *const c_char,
        value: i64,
    ) -> ctr_status;
    pub fn ctr_options_set_float(
        options: *mut ctr_options,
        key: *const c_char,
        value: c_double,
    ) -> ctr_status;
    pub fn ctr_options_set_string(
        options: *mut ctr_options,
        key: *const c_char,
        value: *const c_char,
    ) -> ctr_status;

    // Mesh
    pub fn ctr_mesh_create(options: *const ctr_options, out: *mut *mut ctr_mesh) -> ctr_status;
    pub fn ctr_mesh_create_from_env(
        options: *const ctr_options,
        out: *mut *mut ctr_mesh,
    ) -> ctr_status;
    pub fn ctr_mesh_free(mesh: *mut ctr_mesh);
    pub fn ctr_mesh_rank(mesh: *const ctr_mesh) -> c_int;
    pub fn ctr_mesh_world_size(mesh: *const ctr_mesh) -> c_int;
    pub fn ctr_mesh_data_rank(mesh: *const ctr_mesh) -> c_int;
    pub fn ctr_mesh_data_size(mesh: *const ctr_mesh) -> c_int;
    pub fn ctr_mesh_axis_size(mesh: *const ctr_mesh, axis: *const c_char) -> c_int;
    pub fn ctr_mesh_device(mesh: *const ctr_mesh) -> *const c_char;
    pub fn ctr_mesh_group(
        mesh: *const ctr_mesh,
        axis: *const c_char,
        rank: *mut c_int,
        size: *mut c_int,
    ) -> ctr_status;
    pub fn ctr_mesh_group_member(
        mesh: *const ctr_mesh,
        axis: *const c_char,
        i: c_int,
        world_rank: *mut c_int,
    ) -> ctr_status;
    pub fn ctr_mesh_all_reduce(
        mesh: *mut ctr_mesh,
        axis: *const c_char,
        send: *const c_void,
        recv: *mut c_void,
        count: usize,
        dtype: ctr_dtype,
        op: ctr_reduce_op,
    ) -> ctr_status;
    pub fn ctr_mesh_all_gather(
        mesh: *mut ctr_mesh,
        axis: *const c_char,
        send: *const c_void,
        recv: *mut c_void,
        bytes: usize,
    ) -> ctr_status;
    pub fn ctr_mesh_broadcast(
        mesh: *mut ctr_mesh,
        axis: *const c_char,
        buf: *mut c_void,
        bytes: usize,
        root: c_int,
    ) -> ctr_status;
    pub fn ctr_mesh_barrier(mesh: *mut ctr_mesh, axis: *const c_char) -> ctr_status;
    pub fn ctr_mesh_describe(mesh: *const ctr_mesh, json: *mut *const c_char) -> ctr_status;

    // Graph
    pub fn ctr_graph_load_file(path: *const c_char, out: *mut *mut ctr_graph) -> ctr_status;
    pub fn ctr_graph_load_buffer(
        data: *const c_void,
        size: usize,
        out: *mut *mut ctr_graph,
    ) -> ctr_status;
    pub fn ctr_graph_create_preset(
        preset: *const c_char,
        options: *const ctr_options,
        out: *mut *mut ctr_graph,
    ) -> ctr_status;
    pub fn ctr_graph_save_file(graph: *const ctr_graph, path: *const c_char) -> ctr_status;
    pub fn ctr_graph_free(graph: *mut ctr_graph);
    pub fn ctr_graph_num_inputs(graph: *const ctr_graph) -> usize;
    pub fn ctr_graph_num_params(graph: *const ctr_graph) -> usize;
    pub fn ctr_graph_input_name(
        graph: *const ctr_graph,
        i: usize,
        name: *mut *const c_char,
    ) -> ctr_status;
    pub fn ctr_graph_param_name(
        graph: *const ctr_graph,
        i: usize,
        name: *mut *const c_char,
    ) -> ctr_status;
    pub fn ctr_graph_tensor_info(
        graph: *const ctr_graph,
        name: *const c_char,
        dtype: *mut ctr_dtype,
        dims: *mut i64,
        max_dims: usize,
        ndim: *mut usize,
    ) -> ctr_status;
    pub fn ctr_graph_param_count(graph: *const ctr_graph, count: *mut i64) -> ctr_status;
    pub fn ctr_graph_flops_per_token(
        graph: *const ctr_graph,
        seq: i64,
        flops: *mut c_double,
    ) -> ctr_status;

    // Step
    pub fn ctr_step_create(
        mesh: *const ctr_mesh,
        graph: *const ctr_graph,
        options: *const ctr_options,
        out: *mut *mut ctr_step,
    ) -> ctr_status;
    pub fn ctr_step_free(step: *mut ctr_step);
    pub fn ctr_step_set_input(
        step: *mut ctr_step,
        name: *const c_char,
        data: *const c_void,
        bytes: usize,
    ) -> ctr_status;
    pub fn ctr_step_run(step: *mut ctr_step, metrics: *mut ctr_step_metrics) -> ctr_status;
    pub fn ctr_step_evaluate(step: *mut ctr_step, loss: *mut c_double) -> ctr_status;
    pub fn ctr_step_get_param(
        step: *mut ctr_step,
        name: *const c_char,
        out: *mut f32,
        count: usize,
    ) -> ctr_status;
    pub fn ctr_step_set_param(
        step: *mut ctr_step,
        name: *const c_char,
        data: *const f32,
        count: usize,
    ) -> ctr_status;
    pub fn ctr_step_get_output(
        step: *mut ctr_step,
        name: *const c_char,
        out: *mut f32,
        count: usize,
    ) -> ctr_status;
    pub fn ctr_step_set_lr(step: *mut ctr_step, lr: c_double) -> ctr_status;
    /// Since 0.4.
    pub fn ctr_step_moe_metrics(step: *mut ctr_step, json: *mut *const c_char) -> ctr_status;
    /// Since 0.6.
    pub fn ctr_step_moe_layers(step: *const ctr_step) -> usize;
    /// Since 0.6.
    pub fn ctr_step_moe_layer(
        step: *mut ctr_step,
        i: usize,
        out: *mut ctr_moe_layer_metrics,
    ) -> ctr_status;
    pub fn ctr_step_comm_metrics(step: *mut ctr_step, json: *mut *const c_char) -> ctr_status;
    pub fn ctr_step_timeline(step: *mut ctr_step, json: *mut *const c_char) -> ctr_status;
    pub fn ctr_step_kernel_profile(step: *mut ctr_step, json: *mut *const c_char) -> ctr_status;
    pub fn ctr_plan(
        graph: *const ctr_graph,
        options: *const ctr_options,
        json: *mut *const c_char,
    ) -> ctr_status;
    pub fn ctr_step_memory(
        step: *const ctr_step,
        arena_bytes: *mut i64,
        param_bytes: *mut i64,
        optimizer_bytes: *mut i64,
    ) -> ctr_status;
    pub fn ctr_step_count(step: *const ctr_step) -> i64;

    // Checkpoints and weights
    pub fn ctr_step_save(step: *mut ctr_step, dir: *const c_char) -> ctr_status;
    pub fn ctr_step_load(step: *mut ctr_step, dir: *const c_char) -> ctr_status;
    /// Since 0.2.
    pub fn ctr_step_save_checkpoint(
        step: *mut ctr_step,
        root: *const c_char,
        options: *const ctr_options,
        path: *mut *const c_char,
    ) -> ctr_status;
    /// Since 0.2.
    pub fn ctr_step_resume(
        step: *mut ctr_step,
        root: *const c_char,
        which: *const c_char,
        path: *mut *const c_char,
        skipped: *mut *const c_char,
    ) -> ctr_status;
    pub fn ctr_step_export_safetensors(step: *mut ctr_step, path: *const c_char) -> ctr_status;
    pub fn ctr_step_import_safetensors(
        step: *mut ctr_step,
        path: *const c_char,
        options: *const ctr_options,
    ) -> ctr_status;

    // Data
    pub fn ctr_loader_create(
        path: *const c_char,
        options: *const ctr_options,
        out: *mut *mut ctr_loader,
    ) -> ctr_status;
    pub fn ctr_loader_free(loader: *mut ctr_loader);
    pub fn ctr_loader_next(
        loader: *mut ctr_loader,
        rows: i64,
        tokens: *mut i32,
        targets: *mut i32,
    ) -> ctr_status;
    pub fn ctr_loader_info(
        loader: *const ctr_loader,
        tokens: *mut i64,
        max_token: *mut i64,
    ) -> ctr_status;
    pub fn ctr_step_attach_loader(step: *mut ctr_step, loader: *mut ctr_loader) -> ctr_status;
    pub fn ctr_loader_next_slice(
        loader: *mut ctr_loader,
        global_rows: i64,
        first_row: i64,
        rows: i64,
        tokens: *mut i32,
        targets: *mut i32,
    ) -> ctr_status;

    // Token files (since 0.6)
    pub fn ctr_tokens_open(
        path: *const c_char,
        options: *const ctr_options,
        out: *mut *mut ctr_tokens,
    ) -> ctr_status;
    pub fn ctr_tokens_free(tokens: *mut ctr_tokens);
    pub fn ctr_tokens_info(tokens: *const ctr_tokens, json: *mut *const c_char) -> ctr_status;
    pub fn ctr_tokens_read(
        tokens: *const ctr_tokens,
        start: i64,
        count: i64,
        out: *mut u32,
    ) -> ctr_status;
    pub fn ctr_tokens_samples(
        tokens: *const ctr_tokens,
        seq: i64,
        mode: *const c_char,
        eot: i64,
        samples: *mut i64,
    ) -> ctr_status;
    pub fn ctr_manifest_info(path: *const c_char, json: *mut *const c_char) -> ctr_status;
    pub fn ctr_token_writer_create(
        path: *const c_char,
        format: *const c_char,
        width: c_int,
        count: i64,
        out: *mut *mut ctr_token_writer,
    ) -> ctr_status;
    pub fn ctr_token_writer_write(
        writer: *mut ctr_token_writer,
        tokens: *const u32,
        count: i64,
    ) -> ctr_status;
    pub fn ctr_token_writer_finish(writer: *mut ctr_token_writer) -> ctr_status;
    pub fn ctr_token_writer_free(writer: *mut ctr_token_writer);
}

#[cfg(test)]
mod tests {
    // The metrics struct is the one layout shared with C; on LP64 it is sixteen
    // 8-byte fields.
    #[test]
    fn metrics_layout() {
        assert_eq!(core::mem::size_of::<super::ctr_step_metrics>(), 16 * 8);
        assert_eq!(core::mem::align_of::<super::ctr_step_metrics>(), 8);
    }

    // size, layer, experts, tokens_per_expert, aux_loss, z_loss: six 8-byte
    // fields on LP64.
    #[test]
    fn moe_layer_layout() {
        let m = super::ctr_moe_layer_metrics::default();
        let at = |f: *const u8| f as usize - &m as *const _ as usize;
        assert_eq!(core::mem::size_of::<super::ctr_moe_layer_metrics>(), 6 * 8);
        assert_eq!(at(&m.tokens_per_expert as *const _ as *const u8), 24);
        assert_eq!(at(&m.z_loss as *const _ as *const u8), 40);
    }
}
