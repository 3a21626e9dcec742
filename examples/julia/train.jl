# train.jl — the smallest complete training loop through libctr's Julia binding.
#
# The Julia counterpart of examples/c/train.c: builds a tiny GPT in memory,
# trains 60 steps on one CPU rank over the library's built-in synthetic corpus
# and prints the loss every 10. Exits with status 1 if a call fails (printing
# the status name and the library's message) or if the final loss is not below
# the first. Not run where it was written (no Julia there); see
# bindings/julia/README.md.
#
# Run: CTR_LIB_DIR=<build>/lib julia --project=bindings/julia examples/julia/train.jl

using Printf
using Ctr

const BATCH, SEQ, STEPS = 8, 64, 60

function main()
    # The model: gpt preset, small enough to train in seconds on a CPU.
    graph = preset_graph("gpt"; layers = 2, dim = 128, heads = 4, vocab = 256, seq = SEQ)
    # One CPU rank, every default.
    mesh = Mesh()
    # The compiled step: autodiff, memory plan, AdamW state.
    step = Step(mesh, graph; batch = BATCH, seq = SEQ, lr = 1e-3, warmup_steps = 10)
    mem = memory(step)
    @printf("gpt: %d params, %.1f MiB planned\n", param_count(graph),
            (mem.arena_bytes + mem.param_bytes + mem.optimizer_bytes) / 2^20)

    # The built-in corpus (path nothing); attached so a checkpoint would carry
    # the data position along with the weights.
    loader = Loader(nothing; seq = SEQ)
    attach_loader!(step, loader)

    first_loss = last_loss = 0.0
    for i in 1:STEPS
        tokens, targets = next_batch(loader, BATCH)
        set_input!(step, "tokens", tokens)
        set_input!(step, "targets", targets)
        m = run!(step)
        i == 1 && (first_loss = m.loss)
        last_loss = m.loss
        if i == 1 || i % 10 == 0
            @printf("step %2d | loss %.4f | lr %.2e | %.0f ms\n", i, m.loss, m.lr, m.step_ms)
        end
    end
    close(step); close(loader); close(mesh); close(graph)

    if !(last_loss < first_loss)
        @printf(stderr, "train: the loss did not fall: %.4f at step 1, %.4f at step %d\n",
                first_loss, last_loss, STEPS)
        return 1
    end
    @printf("loss %.4f -> %.4f\n", first_loss, last_loss)
    return 0
end

try
    exit(main())
catch e
    e isa CtrError || rethrow()
    println(stderr, "train: ", sprint(showerror, e))
    exit(1)
end
