/work/main/bindings/rust/target/debug/libctr_sys.rlib: /work/main/bindings/rust/ctr-sys/build.rs /work/main/bindings/rust/ctr-sys/src/lib.rs
