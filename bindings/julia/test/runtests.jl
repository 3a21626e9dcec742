# Tests of the Julia binding against the real libctr, with the same coverage
# as the Rust and Go suites: training lowers the loss, a checkpoint restores
# the exact trajectory, errors carry the library's status and message, and
# handles close in any order.
#
# Run: CTR_LIB_DIR=<build>/lib julia --project=bindings/julia -e 'using Pkg; Pkg.test()'

using Test
using Ctr

const SEQ = 64
const BATCH = 4

small_graph() = preset_graph("gpt"; layers = 2, dim = 64, heads = 4, vocab = 256, seq = SEQ)
# The suite's step options; keyword arguments add keys or replace defaults.
function step_opts(; kw...)
    d = Dict{Symbol,Any}(:batch => BATCH, :seed => 1, :lr => 3e-3, :warmup_steps => 2, :decay_steps => 20)
    for (k, v) in kw
        d[k] = v
    end
    return Options((k => v for (k, v) in d)...)
end
builtin_loader() = Loader(nothing; seq = SEQ, seed = 0)

function feed!(step, loader)
    tokens, targets = next_batch(loader, BATCH)
    set_input!(step, "tokens", tokens)
    set_input!(step, "targets", targets)
end

# Runs f() and returns the CtrError it throws (failing the test otherwise).
function ctr_error(f)
    try
        f()
    catch e
        e isa CtrError && return e
        rethrow()
    end
    error("expected a CtrError")
end

@testset "Ctr" begin
    @testset "ABI and version" begin
        @test Ctr.abi_version() == Ctr.ABI_VERSION
        @test length(split(Ctr.version(), '.')) == 3
        @test Ctr.status_name(Ctr.Status.INVALID_GRAPH) == "invalid graph"
        @test Ctr.dtype_size(Ctr.DType.F32) == 4
    end

    @testset "graph and mesh" begin
        g = small_graph()
        @test input_names(g) == ["tokens", "targets"]
        params = param_names(g)
        @test !isempty(params)
        @test sum(Ctr.numel(tensor_info(g, p)) for p in params) == param_count(g)
        @test tensor_info(g, "tokens").dtype == Ctr.DType.I32
        @test flops_per_token(g) > 0
        prof = """{"name": "t", "devices_per_host": 2, "device": {"name": "core", "memory_bytes": 17179869184, "flops": 1e11, "bytes_per_s": 1e10, "launch_us": 5}, "links": {"host": {"latency_us": 3, "bytes_per_s": 4e9}, "network": {"latency_us": 50, "bytes_per_s": 1e8}}}"""
        p = plan(g; world = 2, global_batch = 4, cluster = prof)
        @test occursin("\"mesh\":\"fsdp=2\"", p) && occursin("\"step_ms\"", p)
        dir = mktempdir()
        path = joinpath(dir, "g.ctrg")
        save_file(g, path)
        @test param_names(Graph(path)) == params
        @test param_count(Graph(read(path))) == param_count(g)
        m = Mesh()
        @test Ctr.rank(m) == 0 && Ctr.world_size(m) == 1
        @test Ctr.device(m) == "cpu" && Ctr.axis_size(m, "dp") == 1
        close(m); close(g)
    end

    @testset "ten steps lower the loss" begin
        step = Step(Mesh(), small_graph(), step_opts())
        mem = memory(step)
        @test mem.arena_bytes > 0 && mem.param_bytes > 0 && mem.optimizer_bytes > 0
        loader = builtin_loader()
        attach_loader!(step, loader)
        losses = Float64[]
        for i in 1:10
            feed!(step, loader)
            m = run!(step)
            @test m.step == i
            @test m.tokens == BATCH * SEQ
            # One rank: no collectives, so compute is the forward and backward time.
            @test 0 < m.compute_ms <= m.step_ms
            @test m.comm_ms >= 0 && m.exposed_comm_ms >= 0
            @test m.save_wait_ms >= 0
            push!(losses, m.loss)
        end
        @test abs(losses[1] - log(256)) < 0.5
        @test losses[10] < losses[1] - 0.1
        @test step_count(step) == 10
        @test isfinite(evaluate!(step)) && step_count(step) == 10
        close(step)
    end

    @testset "checkpoint restores the trajectory" begin
        mesh, g = Mesh(), small_graph()
        dir = mktempdir()
        ckpt = joinpath(dir, "step3")
        p1 = first(param_names(g))
        a = Step(mesh, g, step_opts())
        la = builtin_loader()
        attach_loader!(a, la)
        for _ in 1:3
            feed!(a, la); run!(a)
        end
        save(a, ckpt)
        saved = param(a, p1)
        want = [(feed!(a, la); run!(a).loss) for _ in 1:3]

        b = Step(mesh, g, step_opts(; seed = 99))
        lb = builtin_loader()
        attach_loader!(b, lb)
        @test param(b, p1) != saved
        load!(b, ckpt)
        @test step_count(b) == 3
        @test param(b, p1) == saved
        got = [(feed!(b, lb); run!(b).loss) for _ in 1:3]
        @test got == want

        e = ctr_error(() -> load!(b, joinpath(dir, "missing")))
        @test e.status == Ctr.Status.CHECKPOINT_ERROR
        @test occursin("missing", e.message)
        @test step_count(b) == 6
        detach_loader!(b)
        @test b.loader === nothing
        close(a); close(b)
    end

    @testset "checkpoint directory: keep, latest and exact resume" begin
        mesh, g = Mesh(), small_graph()
        root = joinpath(mktempdir(), "ckpts")
        latest() = strip(read(joinpath(root, "latest"), String))
        a = Step(mesh, g, step_opts())
        la = builtin_loader()
        attach_loader!(a, la)
        for _ in 1:2
            feed!(a, la); run!(a)
        end
        @test save_checkpoint(a, root; keep = 1) == joinpath(root, "step_00000002")
        @test latest() == "step_00000002"
        for _ in 1:2
            feed!(a, la); run!(a)
        end
        path = save_checkpoint(a, root; keep = 1)
        @test path == joinpath(root, "step_00000004")
        @test sort(readdir(root)) == ["latest", "step_00000004"]
        @test latest() == "step_00000004"
        want = [(feed!(a, la); run!(a).loss) for _ in 1:3]
        e = ctr_error(() -> save_checkpoint(a, root; keep_last = 2))
        @test e.status == Ctr.Status.INVALID_OPTION && occursin("keep_last", e.message)

        b = Step(mesh, g, step_opts(; seed = 99))
        lb = builtin_loader()
        attach_loader!(b, lb)
        r = resume!(b, root)
        @test r.path == path && isempty(r.skipped)
        @test step_count(b) == 4
        @test [(feed!(b, lb); run!(b).loss) for _ in 1:3] == want
        @test resume!(b, root, "step_00000004").path == path
        close(a); close(b)
    end

    @testset "checkpoint directory: fallback past a damaged checkpoint" begin
        mesh, g = Mesh(), small_graph()
        dir = mktempdir()
        root = joinpath(dir, "ckpts")
        a = Step(mesh, g, step_opts())
        la = builtin_loader()
        attach_loader!(a, la)
        for _ in 1:2
            feed!(a, la); run!(a)
        end
        older = save_checkpoint(a, root; keep = 2)
        for _ in 1:2
            feed!(a, la); run!(a)
        end
        newest = save_checkpoint(a, root; keep = 2)
        shard = joinpath(newest, "rank00000.bin")
        bytes = read(shard)
        bytes[101] ⊻= 0x01
        write(shard, bytes)

        b = Step(mesh, g, step_opts())
        r = resume!(b, root, "latest")
        @test r.path == older
        @test length(r.skipped) == 1 && startswith(r.skipped[1], newest * ": ")
        @test occursin("checksum mismatch", r.skipped[1])
        @test step_count(b) == 2
        e = ctr_error(() -> resume!(b, root, newest))
        @test e.status == Ctr.Status.CHECKPOINT_ERROR && occursin("rank00000.bin", e.message)

        empty = joinpath(dir, "empty")
        mkdir(empty)
        e = ctr_error(() -> resume!(b, empty))
        @test e.status == Ctr.Status.NOT_FOUND && occursin(empty, e.message)
        @test ctr_error(() -> resume!(b, joinpath(dir, "absent"))).status == Ctr.Status.NOT_FOUND
        @test step_count(b) == 2
        close(a); close(b)
    end

    @testset "loader slices match the global batch" begin
        whole, r0, r1 = builtin_loader(), builtin_loader(), builtin_loader()
        half = 2 * SEQ
        for _ in 1:3
            tokens, targets = next_batch(whole, 4)
            t0, g0, t1, g1 = (zeros(Int32, half) for _ in 1:4)
            next_slice!(r0, 4, 0, t0, g0)
            next_slice!(r1, 4, 2, t1, g1)
            @test vcat(t0, t1) == tokens && vcat(g0, g1) == targets
        end
        next_slice!(r0, 4, 4, Int32[], Int32[])   # reads no rows, still advances
        next_batch(whole, 4)
        @test next_batch(r0, 1) == next_batch(whole, 1)
        e = ctr_error(() -> next_slice!(r1, 4, 3, zeros(Int32, half), zeros(Int32, half)))
        @test e.status == Ctr.Status.INVALID_ARGUMENT
    end

    @testset "safetensors round trip" begin
        mesh, g = Mesh(), small_graph()
        path = joinpath(mktempdir(), "w.safetensors")
        a = Step(mesh, g, step_opts())
        export_safetensors(a, path)
        b = Step(mesh, g, step_opts(; seed = 7))
        import_safetensors!(b, path)
        @test all(param(a, p) == param(b, p) for p in param_names(g))
    end

    @testset "params and outputs" begin
        g = small_graph()
        s = Step(Mesh(), g, step_opts(; keep = "logits"))
        p1 = first(param_names(g))
        w = fill(0.25f0, length(param(s, p1)))
        set_param!(s, p1, w)
        @test all(==(0.25f0), param(s, p1))
        feed!(s, builtin_loader())
        run!(s)
        logits = fill(NaN32, BATCH * SEQ * 256)
        get_output!(s, "logits", logits)
        @test all(isfinite, logits)
        set_lr!(s, 1e-4)
        @test abs(run!(s).lr - 1e-4) < 1e-12
    end

    @testset "errors carry status and message" begin
        e = ctr_error(() -> Graph("/nonexistent/dir/model.ctrg"))
        @test e.status == Ctr.Status.IO_ERROR && e.name == "i/o error"
        @test occursin("/nonexistent/dir/model.ctrg", e.message)
        @test sprint(showerror, e) == "CtrError: i/o error: " * e.message

        junk = joinpath(mktempdir(), "junk.ctrg")
        write(junk, "definitely not a flatbuffer")
        @test ctr_error(() -> Graph(junk)).status == Ctr.Status.INVALID_GRAPH

        mesh, g = Mesh(), small_graph()
        e = ctr_error(() -> Step(mesh, g, step_opts(; bacth = 4)))
        @test e.status == Ctr.Status.INVALID_OPTION && occursin("bacth", e.message)
        @test ctr_error(() -> Step(mesh, g, step_opts(; lr = "fast"))).status == Ctr.Status.INVALID_OPTION
        @test ctr_error(() -> Step(mesh, g)).status == Ctr.Status.INVALID_OPTION
        @test ctr_error(() -> Mesh(Options("ra\0nk" => 0))).status == Ctr.Status.INVALID_ARGUMENT
        @test occursin("resnet", ctr_error(() -> preset_graph("resnet")).message)

        s = Step(mesh, g, step_opts())
        @test ctr_error(() -> run!(s)).status == Ctr.Status.INVALID_STATE
        @test ctr_error(() -> set_input!(s, "tokens", zeros(Int32, 3))).status == Ctr.Status.INVALID_ARGUMENT
        bad = zeros(Int32, BATCH * SEQ)
        bad[6] = 256
        e = ctr_error(() -> set_input!(s, "tokens", bad))
        @test e.status == Ctr.Status.DATA_ERROR && occursin("tokens", e.message)
        @test ctr_error(() -> set_input!(s, "nope", bad)).status == Ctr.Status.NOT_FOUND

        l = builtin_loader()
        @test ctr_error(() -> next!(l, 2, zeros(Int32, 10), zeros(Int32, 10))).status == Ctr.Status.INVALID_ARGUMENT
        @test ctr_error(() -> Loader(nothing)).status == Ctr.Status.INVALID_OPTION

        ckpt = joinpath(mktempdir(), "ckpt")
        save(s, ckpt)
        for f in readdir(ckpt; join = true)
            bytes = read(f)
            bytes[div(length(bytes), 2) + 1] ⊻= 0xff
            write(f, bytes)
        end
        @test ctr_error(() -> load!(s, ckpt)).status == Ctr.Status.CHECKPOINT_ERROR
    end

    @testset "close in any order" begin
        mesh = Mesh()
        g = preset_graph("gpt"; layers = 1, dim = 32, heads = 2, vocab = 256, seq = SEQ)
        s = Step(mesh, g, step_opts())
        l = builtin_loader()
        attach_loader!(s, l)
        p1 = first(param_names(g))
        # Closing what the step depends on only drops the owner's reference.
        close(mesh); close(g); close(l)
        @test ctr_error(() -> Step(mesh, g, step_opts())).status == Ctr.Status.INVALID_ARGUMENT
        @test ctr_error(() -> param_count(g)).status == Ctr.Status.INVALID_STATE
        @test !isempty(param(s, p1))  # through the step's own reference on the graph
        tokens = zeros(Int32, BATCH * SEQ)
        set_input!(s, "tokens", tokens)
        set_input!(s, "targets", tokens)
        @test isfinite(run!(s).loss)
        close(s); close(s)
        @test ctr_error(() -> run!(s)).status == Ctr.Status.INVALID_STATE
        # Unclosed handles are freed by their finalizers.
        for _ in 1:3
            Step(Mesh(), small_graph(), step_opts())
        end
        GC.gc(); GC.gc()
    end
end
