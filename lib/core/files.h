// Opening files that a user or a peer names: only regular files, never a
// blocking open. A FIFO, device or directory where a graph, checkpoint, data
// file or manifest should be would otherwise hang the process in open() or
// read() (or map something that is not a file); it is refused at once, naming
// the path and what kind of file it is.
#pragma once

#include <string>

#include "ctr/ctr.h"

namespace ctr {

// A read-only descriptor of `path`, which must be a regular file. Fails with
// `code` and a message "PATH: cannot open WHAT: ..." or "PATH: WHAT is a FIFO,
// not a regular file". The caller closes the descriptor.
int open_regular_file(const std::string &path, const char *what, ctr_status code);

// The whole content of a regular file of at most max_bytes bytes.
std::string read_regular_file(const std::string &path, const char *what, ctr_status code,
                              size_t max_bytes = size_t{1} << 30);

}  // namespace ctr
