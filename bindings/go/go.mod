module libctr.org/ctr

go 1.19
