module libctr.org/ctr/examples/train

go 1.19

require libctr.org/ctr v0.0.0

replace libctr.org/ctr => ../../bindings/go
