/work/main/bindings/rust/target/debug/deps/ctr-df727f3a6bf9e16c.d: ctr/src/lib.rs ctr/src/error.rs ctr/src/graph.rs ctr/src/loader.rs ctr/src/mesh.rs ctr/src/options.rs ctr/src/step.rs

/work/main/bindings/rust/target/debug/deps/libctr-df727f3a6bf9e16c.rlib: ctr/src/lib.rs ctr/src/error.rs ctr/src/graph.rs ctr/src/loader.rs ctr/src/mesh.rs ctr/src/options.rs ctr/src/step.rs

/work/main/bindings/rust/target/debug/deps/libctr-df727f3a6bf9e16c.rmeta: ctr/src/lib.rs ctr/src/error.rs ctr/src/graph.rs ctr/src/loader.rs ctr/src/mesh.rs ctr/src/options.rs ctr/src/step.rs

ctr/src/lib.rs:
ctr/src/error.rs:
ctr/src/graph.rs:
ctr/src/loader.rs:
ctr/src/mesh.rs:
ctr/src/options.rs:
ctr/src/step.rs:
