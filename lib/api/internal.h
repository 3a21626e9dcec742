// What public entry points are made of, for the unit tests that call it
// directly (linked from the static library; not exported from libctr.so).
#pragma once

#include <string>
#include <vector>

#include "ctr/ctr.h"

namespace ctr {

// Runs the step-creation pipeline on graph up to and including pass `after` and
// returns a readable dump of the IR at that point. options are ctr_step_create's
// (batch, seq, micro_batches, ...). Throws ctr::Error on any failure.
std::string inspect_graph(const ctr_graph *graph, const ctr_options *options,
                          const std::string &after);

}  // namespace ctr
