# Ctr — the Julia binding of libctr, a training runtime driven through one C
# header (include/ctr/ctr.h).
#
# Plain `ccall`s over the header, wrapped in owning types with finalizers:
# Mesh (who and where), Graph (what to train), Step (the compiled training step
# and its state) and Loader (the resumable token order). Failures throw
# CtrError with libctr's status code, its name and the message that says what
# was wrong and where. The module refuses to load a libctr whose
# ctr_abi_version() is not the one it was written for.
#
# Lifetimes: the header requires a step's mesh, graph and attached loader to
# outlive it. Julia's GC does not order finalizers, so a reference from the
# step is not enough; each of those handles is reference-counted instead (its
# owner holds one reference, every step using it one more) and the C handle is
# freed when the count reaches zero, whatever order `close` and the finalizers
# run in.
module Ctr

using Libdl

# Mesh accessors (rank, world_size, data_rank, data_size, axis_size, device) are not exported: `rank`
# would clash with LinearAlgebra's. Call them as Ctr.rank(mesh).
export CtrError, Options, Mesh, Graph, Step, Loader, Metrics, TensorInfo,
       preset_graph, input_names, param_names, tensor_info, param_count, flops_per_token, plan, save_file,
       set_input!, run!, evaluate!, get_param!, param, set_param!, get_output!, set_lr!, moe_metrics, comm_metrics, timeline,
       kernel_profile,
       memory, step_count, save, load!, save_checkpoint, resume!, export_safetensors, import_safetensors!,
       attach_loader!, detach_loader!, next!, next_slice!, next_batch, loader_info

# The ABI version this module was written for.
const ABI_VERSION = 1

# The library is found by name through the dynamic loader's search, after the
# directories added to DL_LOAD_PATH in __init__.
const libctr = "libctr"

function __init__()
    # An explicit library file or directory wins; then a meson build in the
    # source tree this package sits in (bindings/julia -> ../../build/lib);
    # then the system's search path.
    dirs = String[]
    haskey(ENV, "CTR_LIBRARY") && push!(dirs, dirname(ENV["CTR_LIBRARY"]))
    haskey(ENV, "CTR_LIB_DIR") && push!(dirs, ENV["CTR_LIB_DIR"])
    intree = normpath(joinpath(@__DIR__, "..", "..", "..", "build", "lib"))
    isdir(intree) && push!(dirs, intree)
    for d in reverse(dirs)
        d in Libdl.DL_LOAD_PATH || pushfirst!(Libdl.DL_LOAD_PATH, d)
    end
    got = ccall((:ctr_abi_version, libctr), Cint, ())
    if got != ABI_VERSION
        error("Ctr: the loaded libctr $(version()) has ABI version $got; this module was " *
              "written for ABI version $ABI_VERSION")
    end
    return nothing
end

"""`ctr_version()` of the loaded library, "MAJOR.MINOR.PATCH"."""
version() = unsafe_string(ccall((:ctr_version, libctr), Cstring, ()))

"""`ctr_abi_version()` of the loaded library."""
abi_version() = Int(ccall((:ctr_abi_version, libctr), Cint, ()))

# ---------------------------------------------------------------------------
# Status and errors

"""Status codes of the header (new ones are appended; any Int is valid)."""
module Status
const OK = 0
const INVALID_ARGUMENT = 1
const INVALID_OPTION = 2
const INVALID_GRAPH = 3
const IO_ERROR = 4
const NOT_FOUND = 5
const OUT_OF_MEMORY = 6
const UNSUPPORTED = 7
const INVALID_STATE = 8
const DATA_ERROR = 9
const TIMEOUT = 10
const COMM_ERROR = 11
const NUMERIC_ERROR = 12
const INTERNAL = 13
const CHECKPOINT_ERROR = 14
const DEVICE_ERROR = 15
end

"""`ctr_status_string(status)`: the library's static name of a code."""
status_name(status::Integer) =
    unsafe_string(ccall((:ctr_status_string, libctr), Cstring, (Cint,), status))

"""A failed libctr call: `status` code, its `name` and the library's `message`."""
struct CtrError <: Exception
    status::Int
    name::String
    message::String
end

CtrError(status::Integer, message::AbstractString) =
    CtrError(Int(status), status_name(status), String(message))

Base.showerror(io::IO, e::CtrError) = print(io, "CtrError: ", e.name, ": ", e.message)

# Throws for a failed status. Call it directly on the ccall's result: the
# message is thread-local and valid only until the next libctr call on this
# thread, and a finalizer run by an allocation could make such a call (a
# _free), so finalizers are held off until the message is copied.
@inline function check(status::Cint)
    status == 0 && return nothing
    GC.enable_finalizers(false)
    msg = try
        unsafe_string(ccall((:ctr_last_error, libctr), Cstring, ()))
    finally
        GC.enable_finalizers(true)
    end
    throw(CtrError(status, msg))
end

# A string for a `const char *` parameter. Julia strings are NUL-terminated in
# memory, but one with a NUL inside would be cut short by C: refuse it.
function cstr(what::AbstractString, s::AbstractString)
    s = String(s)
    occursin('\0', s) && throw(CtrError(Status.INVALID_ARGUMENT, "$what $(repr(s)) contains a NUL byte"))
    return s
end

"""Element types of graph tensors, the header's ctr_dtype numbers."""
module DType
const F32 = 0
const F16 = 1
const BF16 = 2
const I32 = 3
const I64 = 4
const U16 = 5
const U32 = 6
const U8 = 7
const F64 = 8
end

"""Bytes per element of a ctr_dtype number; 0 for one the library does not know."""
dtype_size(dtype::Integer) = Int(ccall((:ctr_dtype_size, libctr), Csize_t, (Cint,), dtype))

# ---------------------------------------------------------------------------
# Reference counting shared by the handle types

# Every handle type has fields `ptr::Ptr{Cvoid}`, `refs::Threads.Atomic{Int}`
# (1 for the owner + 1 per step using it) and `closed::Threads.Atomic{Bool}`,
# and a method `cfree(x)` calling the matching ctr_*_free. Atomics, not
# locks: finalizers may run these and must not block.

function acquire!(x)
    x.closed[] && return false
    while true
        n = x.refs[]
        n == 0 && return false
        Threads.atomic_cas!(x.refs, n, n + 1) == n && return true
    end
end

function release!(x)
    if Threads.atomic_sub!(x.refs, 1) == 1
        cfree(x)
        x.ptr = C_NULL
    end
    return nothing
end

# The owner's close: drops the owner's reference once; the C handle goes when
# no step uses it any more. Safe to call twice and from a finalizer.
function close_shared!(x)
    Threads.atomic_cas!(x.closed, false, true) == false && release!(x)
    return nothing
end

function live(x, what)
    x.closed[] && throw(CtrError(Status.INVALID_STATE, "the $what is closed"))
    return x.ptr
end

# ---------------------------------------------------------------------------
# Options

"""
    Options(key => value, ...)   /   Options(; key = value, ...)

Typed key/value options. Integers and Bools become int options, floats float
options, strings and Symbols string options. Built into a C handle only for
the call that consumes them; unknown keys are rejected by that call.
"""
struct Options
    entries::Vector{Pair{String,Any}}
end

Options(pairs::Pair...; kw...) =
    Options(Pair{String,Any}[[string(k) => v for (k, v) in pairs]; [string(k) => v for (k, v) in kw]])

Base.get(o::Options, key::AbstractString, default) =
    (i = findlast(p -> p.first == key, o.entries); i === nothing ? default : o.entries[i].second)

# Calls f with a C ctr_options handle holding o's values, then frees it.
function with_coptions(f, o::Options)
    h = Ref{Ptr{Cvoid}}(C_NULL)
    check(ccall((:ctr_options_create, libctr), Cint, (Ptr{Ptr{Cvoid}},), h))
    try
        for (k, v) in o.entries
            key = cstr("option key", k)
            if v isa Bool || v isa Integer
                check(ccall((:ctr_options_set_int, libctr), Cint, (Ptr{Cvoid}, Cstring, Int64),
                            h[], key, Int64(v)))
            elseif v isa AbstractFloat
                check(ccall((:ctr_options_set_float, libctr), Cint, (Ptr{Cvoid}, Cstring, Cdouble),
                            h[], key, Float64(v)))
            elseif v isa AbstractString || v isa Symbol
                check(ccall((:ctr_options_set_string, libctr), Cint, (Ptr{Cvoid}, Cstring, Cstring),
                            h[], key, cstr("option value", string(v))))
            else
                throw(CtrError(Status.INVALID_OPTION, "option '$k': unsupported value type $(typeof(v))"))
            end
        end
        return f(h[])
    finally
        ccall((:ctr_options_free, libctr), Cvoid, (Ptr{Cvoid},), h[])
    end
end

# ---------------------------------------------------------------------------
# Mesh

"""
    Mesh(; device, rank, world, mesh, threads)
    Mesh(opts::Options; from_env = false)

`ctr_mesh_create` (or `ctr_mesh_create_from_env` with `from_env = true`, which
reads rank and world from CTR_RANK/CTR_WORLD_SIZE, torchrun, Slurm or Open MPI
variables). Read-only after creation and shareable between tasks and steps.
"""
mutable struct Mesh
    ptr::Ptr{Cvoid}
    refs::Threads.Atomic{Int}
    closed::Threads.Atomic{Bool}
end

function Mesh(opts::Options; from_env::Bool = false)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    with_coptions(opts) do co
        st = from_env ?
            ccall((:ctr_mesh_create_from_env, libctr), Cint, (Ptr{Cvoid}, Ptr{Ptr{Cvoid}}), co, out) :
            ccall((:ctr_mesh_create, libctr), Cint, (Ptr{Cvoid}, Ptr{Ptr{Cvoid}}), co, out)
        check(st)
    end
    m = Mesh(out[], Threads.Atomic{Int}(1), Threads.Atomic{Bool}(false))
    return finalizer(close_shared!, m)
end
Mesh(; from_env::Bool = false, kw...) = Mesh(Options(; kw...); from_env = from_env)

cfree(m::Mesh) = ccall((:ctr_mesh_free, libctr), Cvoid, (Ptr{Cvoid},), m.ptr)
Base.close(m::Mesh) = close_shared!(m)

rank(m::Mesh) = Int(ccall((:ctr_mesh_rank, libctr), Cint, (Ptr{Cvoid},), live(m, "mesh")))
world_size(m::Mesh) = Int(ccall((:ctr_mesh_world_size, libctr), Cint, (Ptr{Cvoid},), live(m, "mesh")))
data_rank(m::Mesh) = Int(ccall((:ctr_mesh_data_rank, libctr), Cint, (Ptr{Cvoid},), live(m, "mesh")))
data_size(m::Mesh) = Int(ccall((:ctr_mesh_data_size, libctr), Cint, (Ptr{Cvoid},), live(m, "mesh")))
axis_size(m::Mesh, axis::AbstractString) =
    Int(ccall((:ctr_mesh_axis_size, libctr), Cint, (Ptr{Cvoid}, Cstring), live(m, "mesh"), cstr("axis", axis)))
device(m::Mesh) = unsafe_string(ccall((:ctr_mesh_device, libctr), Cstring, (Ptr{Cvoid},), live(m, "mesh")))

# ---------------------------------------------------------------------------
# Graph

"""
    Graph(path)                     ctr_graph_load_file
    Graph(bytes::Vector{UInt8})     ctr_graph_load_buffer (copied)
    preset_graph("gpt"; ...)        ctr_graph_create_preset

Read-only after creation and shareable between tasks and steps.
"""
mutable struct Graph
    ptr::Ptr{Cvoid}
    refs::Threads.Atomic{Int}
    closed::Threads.Atomic{Bool}
end

wrap_graph(p::Ptr{Cvoid}) = finalizer(close_shared!, Graph(p, Threads.Atomic{Int}(1), Threads.Atomic{Bool}(false)))

function Graph(path::AbstractString)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    check(ccall((:ctr_graph_load_file, libctr), Cint, (Cstring, Ptr{Ptr{Cvoid}}), cstr("path", path), out))
    return wrap_graph(out[])
end

function Graph(data::Vector{UInt8})
    out = Ref{Ptr{Cvoid}}(C_NULL)
    check(ccall((:ctr_graph_load_buffer, libctr), Cint, (Ptr{UInt8}, Csize_t, Ptr{Ptr{Cvoid}}),
                data, length(data), out))
    return wrap_graph(out[])
end

"""
    preset_graph("gpt"; layers = 2, dim = 64, heads = 4, vocab = 256, seq = 64)

`ctr_graph_create_preset`: "gpt" or "llama"; keys "layers", "dim", "heads",
"kv_heads", "vocab", "seq", "ffn_dim", "tied", "rope_theta", "norm_eps",
"init_std".
"""
function preset_graph(preset::AbstractString, opts::Options)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    name = cstr("preset", preset)
    with_coptions(opts) do co
        check(ccall((:ctr_graph_create_preset, libctr), Cint, (Cstring, Ptr{Cvoid}, Ptr{Ptr{Cvoid}}),
                    name, co, out))
    end
    return wrap_graph(out[])
end
preset_graph(preset::AbstractString; kw...) = preset_graph(preset, Options(; kw...))

cfree(g::Graph) = ccall((:ctr_graph_free, libctr), Cvoid, (Ptr{Cvoid},), g.ptr)
Base.close(g::Graph) = close_shared!(g)

save_file(g::Graph, path::AbstractString) =
    check(ccall((:ctr_graph_save_file, libctr), Cint, (Ptr{Cvoid}, Cstring), live(g, "graph"), cstr("path", path)))

function graph_names(g::Graph, count::Symbol, name::Symbol)
    p = live(g, "graph")
    n = count === :inputs ? ccall((:ctr_graph_num_inputs, libctr), Csize_t, (Ptr{Cvoid},), p) :
                            ccall((:ctr_graph_num_params, libctr), Csize_t, (Ptr{Cvoid},), p)
    out = String[]
    s = Ref{Cstring}()
    for i in 0:(Int(n) - 1)
        st = name === :input ?
            ccall((:ctr_graph_input_name, libctr), Cint, (Ptr{Cvoid}, Csize_t, Ref{Cstring}), p, i, s) :
            ccall((:ctr_graph_param_name, libctr), Cint, (Ptr{Cvoid}, Csize_t, Ref{Cstring}), p, i, s)
        check(st)
        push!(out, unsafe_string(s[]))
    end
    return out
end

"""Host inputs ("tokens", "targets") in file order."""
input_names(g::Graph) = graph_names(g, :inputs, :input)
"""Trained parameters in file order."""
param_names(g::Graph) = graph_names(g, :params, :param)

"""dtype (the header's ctr_dtype number) and dims (-1 = symbolic) of a tensor."""
struct TensorInfo
    dtype::Int
    dims::Vector{Int64}
end

numel(t::TensorInfo) = any(<(0), t.dims) ? -1 : prod(t.dims; init = 1)

tensor_info(g::Graph, name::AbstractString) = tensor_info_ptr(live(g, "graph"), name)

# Works on a C graph the caller keeps alive (a step holds a reference on its
# graph even after the owner's close).
function tensor_info_ptr(p::Ptr{Cvoid}, name::AbstractString)
    n = cstr("tensor name", name)
    # The header has no way to ask for the rank alone and a too-small buffer
    # fails without saying how large it must be: try a generous buffer, then
    # a huge one.
    local err
    for capacity in (16, 4096)
        dims = zeros(Int64, capacity)
        dtype, ndim = Ref{Cint}(0), Ref{Csize_t}(0)
        st = ccall((:ctr_graph_tensor_info, libctr), Cint,
                   (Ptr{Cvoid}, Cstring, Ref{Cint}, Ptr{Int64}, Csize_t, Ref{Csize_t}),
                   p, n, dtype, dims, capacity, ndim)
        try
            check(st)
            return TensorInfo(Int(dtype[]), dims[1:Int(ndim[])])
        catch e
            (e isa CtrError && e.status == Status.INVALID_ARGUMENT) || rethrow()
            err = e
        end
    end
    throw(err)
end

function param_count(g::Graph)
    c = Ref{Int64}(0)
    check(ccall((:ctr_graph_param_count, libctr), Cint, (Ptr{Cvoid}, Ref{Int64}), live(g, "graph"), c))
    return c[]
end

function flops_per_token(g::Graph, seq::Integer = 0)
    f = Ref{Cdouble}(0)
    check(ccall((:ctr_graph_flops_per_token, libctr), Cint, (Ptr{Cvoid}, Int64, Ref{Cdouble}),
                live(g, "graph"), seq, f))
    return f[]
end

"""The planner's layouts of this graph's step (ctr_plan) as JSON text. Keys: world,
global_batch, cluster (a profile's JSON text or file), and optionally seq, recompute, top."""
function plan(g::Graph, opts::Options)
    text = Ref{Cstring}(C_NULL)
    with_coptions(opts) do co
        check(ccall((:ctr_plan, libctr), Cint, (Ptr{Cvoid}, Ptr{Cvoid}, Ref{Cstring}),
                    live(g, "graph"), co, text))
    end
    return unsafe_string(text[])
end
plan(g::Graph; kw...) = plan(g, Options(; kw...))

# ---------------------------------------------------------------------------
# Loader

"""
    Loader(path_or_nothing; seq, seed = 0, corpus_bytes)

`ctr_loader_create` over a token file, or the built-in synthetic corpus for
`nothing`. Used by one task at a time.
"""
mutable struct Loader
    ptr::Ptr{Cvoid}
    refs::Threads.Atomic{Int}
    closed::Threads.Atomic{Bool}
    # The header has no call returning a loader's window length, yet
    # ctr_loader_next writes rows*seq ids per buffer; kept from creation so
    # buffers are checked before C writes into them.
    seq::Int
end

function Loader(path::Union{Nothing,AbstractString}, opts::Options)
    out = Ref{Ptr{Cvoid}}(C_NULL)
    p = path === nothing ? nothing : cstr("path", path)
    with_coptions(opts) do co
        GC.@preserve p begin
            pp = p === nothing ? Ptr{UInt8}(C_NULL) : pointer(p)
            check(ccall((:ctr_loader_create, libctr), Cint, (Ptr{UInt8}, Ptr{Cvoid}, Ptr{Ptr{Cvoid}}),
                        pp, co, out))
        end
    end
    seq = get(opts, "seq", 0)
    l = Loader(out[], Threads.Atomic{Int}(1), Threads.Atomic{Bool}(false), seq isa Integer ? Int(seq) : 0)
    return finalizer(close_shared!, l)
end
Loader(path::Union{Nothing,AbstractString} = nothing; kw...) = Loader(path, Options(; kw...))

cfree(l::Loader) = ccall((:ctr_loader_free, libctr), Cvoid, (Ptr{Cvoid},), l.ptr)
Base.close(l::Loader) = close_shared!(l)

"""Fills the next `rows` windows; both buffers hold exactly rows * seq ids."""
function next!(l::Loader, rows::Integer, tokens::Vector{Int32}, targets::Vector{Int32})
    need = rows * l.seq
    if rows <= 0 || length(tokens) != need || length(targets) != need
        throw(CtrError(Status.INVALID_ARGUMENT,
                       "ctr_loader_next: $rows rows of seq $(l.seq) need $need ids per buffer, " *
                       "got $(length(tokens)) tokens and $(length(targets)) targets"))
    end
    check(ccall((:ctr_loader_next, libctr), Cint, (Ptr{Cvoid}, Int64, Ptr{Int32}, Ptr{Int32}),
                live(l, "loader"), rows, tokens, targets))
    return nothing
end

"""
    next_slice!(loader, global_rows, first_row, tokens, targets)

One rank's share of the next global batch: advances the loader by
`global_rows` samples, exactly as `next!(loader, global_rows, ...)` would, but
reads only the `length(tokens) ÷ seq` rows starting at `first_row` (0-based,
as in the C call). Every rank calls it with the same `global_rows`, so the
loader's state stays the same on all ranks however the batch is split.
"""
function next_slice!(l::Loader, global_rows::Integer, first_row::Integer,
                     tokens::Vector{Int32}, targets::Vector{Int32})
    if l.seq <= 0 || length(tokens) % l.seq != 0 || length(targets) != length(tokens)
        throw(CtrError(Status.INVALID_ARGUMENT,
                       "ctr_loader_next_slice: buffers must hold whole rows of seq $(l.seq), " *
                       "got $(length(tokens)) tokens and $(length(targets)) targets"))
    end
    rows = length(tokens) ÷ l.seq
    # An empty Julia vector still has a valid (unused) data pointer, which the
    # header allows as well as NULL when rows is 0.
    check(ccall((:ctr_loader_next_slice, libctr), Cint,
                (Ptr{Cvoid}, Int64, Int64, Int64, Ptr{Int32}, Ptr{Int32}),
                live(l, "loader"), global_rows, first_row, rows, tokens, targets))
    return nothing
end

"""The next `rows` windows as new `(tokens, targets)` vectors."""
function next_batch(l::Loader, rows::Integer)
    tokens, targets = zeros(Int32, rows * l.seq), zeros(Int32, rows * l.seq)
    next!(l, rows, tokens, targets)
    return tokens, targets
end

"""`(tokens in the source, largest token id)`."""
function loader_info(l::Loader)
    t, m = Ref{Int64}(0), Ref{Int64}(0)
    check(ccall((:ctr_loader_info, libctr), Cint, (Ptr{Cvoid}, Ref{Int64}, Ref{Int64}), live(l, "loader"), t, m))
    return t[], m[]
end

# ---------------------------------------------------------------------------
# Step

# ctr_step_metrics, field for field (all 8 bytes wide, so no padding).
struct CMetrics
    size::Csize_t
    step::Int64
    loss::Cdouble
    grad_norm::Cdouble
    lr::Cdouble
    step_ms::Cdouble
    forward_ms::Cdouble
    backward_ms::Cdouble
    optimizer_ms::Cdouble
    tokens_per_s::Cdouble
    tokens::Int64
    peak_bytes::Int64
    save_wait_ms::Cdouble
    # Since 0.2:
    compute_ms::Cdouble
    comm_ms::Cdouble
    exposed_comm_ms::Cdouble
end

"""What one `run!` did (ctr_step_metrics without its size field)."""
struct Metrics
    step::Int64
    loss::Float64
    grad_norm::Float64
    lr::Float64
    step_ms::Float64
    forward_ms::Float64
    backward_ms::Float64
    optimizer_ms::Float64
    tokens_per_s::Float64
    tokens::Int64
    peak_bytes::Int64
    save_wait_ms::Float64     # time this step waited to publish a background save
    compute_ms::Float64       # forward and backward, less exposed_comm_ms
    comm_ms::Float64          # time collectives were in flight on the comm stream
    exposed_comm_ms::Float64  # time compute waited for communication (not hidden)
end

"""
    Step(mesh, graph; batch, seq, micro_batches, seed, lr, ...)

`ctr_step_create`. Used by one task at a time. Holds references on its mesh,
graph and attached loader so they outlive it, as the header requires.
"""
mutable struct Step
    ptr::Ptr{Cvoid}
    mesh::Mesh
    graph::Graph
    loader::Union{Nothing,Loader}
end

function Step(mesh::Mesh, graph::Graph, opts::Options)
    acquire!(mesh) || throw(CtrError(Status.INVALID_ARGUMENT, "Step: the mesh is closed"))
    if !acquire!(graph)
        release!(mesh)
        throw(CtrError(Status.INVALID_ARGUMENT, "Step: the graph is closed"))
    end
    out = Ref{Ptr{Cvoid}}(C_NULL)
    try
        with_coptions(opts) do co
            check(ccall((:ctr_step_create, libctr), Cint, (Ptr{Cvoid}, Ptr{Cvoid}, Ptr{Cvoid}, Ptr{Ptr{Cvoid}}),
                        mesh.ptr, graph.ptr, co, out))
        end
    catch
        release!(graph)
        release!(mesh)
        rethrow()
    end
    return finalizer(close, Step(out[], mesh, graph, nothing))
end
Step(mesh::Mesh, graph::Graph; kw...) = Step(mesh, graph, Options(; kw...))

"""Frees the step, then lets go of its mesh, graph and loader. Idempotent."""
function Base.close(s::Step)
    s.ptr == C_NULL && return nothing
    ccall((:ctr_step_free, libctr), Cvoid, (Ptr{Cvoid},), s.ptr)
    s.ptr = C_NULL
    s.loader === nothing || release!(s.loader)
    s.loader = nothing
    release!(s.graph)
    release!(s.mesh)
    return nothing
end

function sptr(s::Step)
    s.ptr == C_NULL && throw(CtrError(Status.INVALID_STATE, "the step is closed"))
    return s.ptr
end

"""Copies host data (a dense array of plain numbers) into the named input."""
function set_input!(s::Step, name::AbstractString, data::Array{T}) where {T<:Union{Int32,Int64,UInt8,UInt16,UInt32,Float32,Float64}}
    check(ccall((:ctr_step_set_input, libctr), Cint, (Ptr{Cvoid}, Cstring, Ptr{Cvoid}, Csize_t),
                sptr(s), cstr("input name", name), data, sizeof(data)))
    return nothing
end

"""Forward, backward and the optimizer update on the inputs last set."""
function run!(s::Step)
    m = Ref(CMetrics(sizeof(CMetrics), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0))
    check(ccall((:ctr_step_run, libctr), Cint, (Ptr{Cvoid}, Ref{CMetrics}), sptr(s), m))
    c = m[]
    return Metrics(c.step, c.loss, c.grad_norm, c.lr, c.step_ms, c.forward_ms, c.backward_ms,
                   c.optimizer_ms, c.tokens_per_s, c.tokens, c.peak_bytes, c.save_wait_ms,
                   c.compute_ms, c.comm_ms, c.exposed_comm_ms)
end

"""Forward only, no update: the mean loss on the inputs last set."""
function evaluate!(s::Step)
    l = Ref{Cdouble}(0)
    check(ccall((:ctr_step_evaluate, libctr), Cint, (Ptr{Cvoid}, Ref{Cdouble}), sptr(s), l))
    return l[]
end

function get_param!(s::Step, name::AbstractString, out::Vector{Float32})
    check(ccall((:ctr_step_get_param, libctr), Cint, (Ptr{Cvoid}, Cstring, Ptr{Float32}, Csize_t),
                sptr(s), cstr("parameter name", name), out, length(out)))
    return out
end

"""The named parameter as a new vector, sized from the graph."""
function param(s::Step, name::AbstractString)
    n = numel(tensor_info_ptr(s.graph.ptr, name))
    n < 0 && throw(CtrError(Status.INVALID_ARGUMENT, "parameter '$name' has a symbolic dim"))
    return get_param!(s, name, zeros(Float32, n))
end

function set_param!(s::Step, name::AbstractString, data::Vector{Float32})
    check(ccall((:ctr_step_set_param, libctr), Cint, (Ptr{Cvoid}, Cstring, Ptr{Float32}, Csize_t),
                sptr(s), cstr("parameter name", name), data, length(data)))
    return nothing
end

"""Copies an activation named in the step option "keep" (one micro-batch)."""
function get_output!(s::Step, name::AbstractString, out::Vector{Float32})
    check(ccall((:ctr_step_get_output, libctr), Cint, (Ptr{Cvoid}, Cstring, Ptr{Float32}, Csize_t),
                sptr(s), cstr("output name", name), out, length(out)))
    return out
end

set_lr!(s::Step, lr::Real) =
    check(ccall((:ctr_step_set_lr, libctr), Cint, (Ptr{Cvoid}, Cdouble), sptr(s), lr))

"""The mixture-of-experts layers of the last run as JSON text (one object per layer:
"layer", "tokens_per_expert", "aux_loss", "z_loss"); "[]" for a graph without experts."""
function moe_metrics(s::Step)
    text = Ref{Cstring}(C_NULL)
    check(ccall((:ctr_step_moe_metrics, libctr), Cint, (Ptr{Cvoid}, Ref{Cstring}), sptr(s), text))
    return unsafe_string(text[])
end

"""Milliseconds the last run's collectives were in flight, per mesh axis, as JSON text
(`{"tp": ms, "fsdp": ms}`; "{}" without collectives)."""
function comm_metrics(s::Step)
    text = Ref{Cstring}(C_NULL)
    check(ccall((:ctr_step_comm_metrics, libctr), Cint, (Ptr{Cvoid}, Ref{Cstring}), sptr(s), text))
    return unsafe_string(text[])
end

"""The tasks of the last run on this rank, as JSON text: an array of `{"name", "cat",
"stage", "micro_batch", "start_us", "dur_us"}` in the order they ran."""
function timeline(s::Step)
    text = Ref{Cstring}(C_NULL)
    check(ccall((:ctr_step_timeline, libctr), Cint, (Ptr{Cvoid}, Ref{Cstring}), sptr(s), text))
    return unsafe_string(text[])
end

"""With step option profile_kernels = 1: each kernel of this rank's program as JSON text."""
function kernel_profile(s::Step)
    text = Ref{Cstring}(C_NULL)
    check(ccall((:ctr_step_kernel_profile, libctr), Cint, (Ptr{Cvoid}, Ref{Cstring}), sptr(s), text))
    return unsafe_string(text[])
end

"""Planned bytes: `(arena_bytes = , param_bytes = , optimizer_bytes = )`."""
function memory(s::Step)
    a, p, o = Ref{Int64}(0), Ref{Int64}(0), Ref{Int64}(0)
    check(ccall((:ctr_step_memory, libctr), Cint, (Ptr{Cvoid}, Ref{Int64}, Ref{Int64}, Ref{Int64}),
                sptr(s), a, p, o))
    return (arena_bytes = a[], param_bytes = p[], optimizer_bytes = o[])
end

step_count(s::Step) = ccall((:ctr_step_count, libctr), Int64, (Ptr{Cvoid},), sptr(s))

"""Saves the whole state (and the attached loader's position). Collective."""
save(s::Step, dir::AbstractString) =
    check(ccall((:ctr_step_save, libctr), Cint, (Ptr{Cvoid}, Cstring), sptr(s), cstr("path", dir)))

"""Restores a checkpoint; a bad one throws CHECKPOINT_ERROR, step unchanged."""
load!(s::Step, dir::AbstractString) =
    check(ccall((:ctr_step_load, libctr), Cint, (Ptr{Cvoid}, Cstring), sptr(s), cstr("path", dir)))

"""
    save_checkpoint(step, root; keep = 3) -> String

`ctr_step_save_checkpoint` (since 0.2): saves into `root/step_NNNNNNNN`
(NNNNNNNN = `step_count(step)`) and returns that directory. Once the save is
published (at once unless the step option `async_save` is set), `root/latest`
names it and all but the `keep` newest `step_*` directories are removed
(`keep = 0` keeps all). Collective.
"""
function save_checkpoint(s::Step, root::AbstractString; kw...)
    r = cstr("path", root)
    path = Ref{Ptr{UInt8}}(C_NULL)
    with_coptions(Options(; kw...)) do co
        check(ccall((:ctr_step_save_checkpoint, libctr), Cint,
                    (Ptr{Cvoid}, Cstring, Ptr{Cvoid}, Ref{Ptr{UInt8}}), sptr(s), r, co, path))
    end
    # The step's string, valid until its next call (freeing the options is none).
    return unsafe_string(path[])
end

"""
    resume!(step, root, which = nothing) -> (path = ..., skipped = [...])

`ctr_step_resume` (since 0.2): restores a checkpoint from a directory of
`save_checkpoint`. `which` `nothing` (or "latest"): the one `root/latest`
names (else the newest `step_*`), falling back to older ones while a
checkpoint is damaged (CHECKPOINT_ERROR); `skipped` lists those passed over,
one "DIR: reason" string each. Otherwise `which` is a checkpoint name under
`root` or a path. No checkpoint at all throws NOT_FOUND; on any failure the
step is unchanged. Collective.
"""
function resume!(s::Step, root::AbstractString, which::Union{Nothing,AbstractString} = nothing)
    r = cstr("path", root)
    w = which === nothing ? nothing : cstr("checkpoint", which)
    path, skipped = Ref{Ptr{UInt8}}(C_NULL), Ref{Ptr{UInt8}}(C_NULL)
    GC.@preserve w begin
        wp = w === nothing ? Ptr{UInt8}(C_NULL) : pointer(w)
        check(ccall((:ctr_step_resume, libctr), Cint,
                    (Ptr{Cvoid}, Cstring, Ptr{UInt8}, Ref{Ptr{UInt8}}, Ref{Ptr{UInt8}}),
                    sptr(s), r, wp, path, skipped))
    end
    lines = skipped[] == C_NULL ? String[] : String.(split(unsafe_string(skipped[]), '\n'))
    return (path = unsafe_string(path[]), skipped = lines)
end

export_safetensors(s::Step, path::AbstractString) =
    check(ccall((:ctr_step_export_safetensors, libctr), Cint, (Ptr{Cvoid}, Cstring), sptr(s), cstr("path", path)))

function import_safetensors!(s::Step, path::AbstractString; kw...)
    p = cstr("path", path)
    with_coptions(Options(; kw...)) do co
        check(ccall((:ctr_step_import_safetensors, libctr), Cint, (Ptr{Cvoid}, Cstring, Ptr{Cvoid}),
                    sptr(s), p, co))
    end
end

"""Attaches `l` so checkpoints carry its position; `nothing` detaches."""
function attach_loader!(s::Step, l::Union{Nothing,Loader})
    p = sptr(s)
    if l !== nothing && !acquire!(l)
        throw(CtrError(Status.INVALID_ARGUMENT, "attach_loader!: the loader is closed"))
    end
    try
        check(ccall((:ctr_step_attach_loader, libctr), Cint, (Ptr{Cvoid}, Ptr{Cvoid}), p,
                    l === nothing ? C_NULL : l.ptr))
    catch
        l === nothing || release!(l)
        rethrow()
    end
    s.loader === nothing || release!(s.loader)
    s.loader = l
    return nothing
end

detach_loader!(s::Step) = attach_loader!(s, nothing)

end # module
