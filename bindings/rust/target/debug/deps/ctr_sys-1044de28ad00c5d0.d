/work/main/bindings/rust/target/debug/deps/ctr_sys-1044de28ad00c5d0.d: ctr-sys/src/lib.rs

/work/main/bindings/rust/target/debug/deps/libctr_sys-1044de28ad00c5d0.rlib: ctr-sys/src/lib.rs

/work/main/bindings/rust/target/debug/deps/libctr_sys-1044de28ad00c5d0.rmeta: ctr-sys/src/lib.rs

ctr-sys/src/lib.rs:
