module libctr.org/ctr/xlang

go 1.19

require libctr.org/ctr v0.0.0

replace libctr.org/ctr => ../../../bindings/go
