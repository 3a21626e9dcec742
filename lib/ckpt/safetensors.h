// Parameters in and out as safetensors files (safetensors.cc).
#pragma once

#include <string>

namespace ctr {

class Step;

// Gathers every parameter (collective) and rank 0 writes PATH.
void export_safetensors(Step &step, const std::string &path);
// Reads PATH on every rank and sets each parameter (collective); a file with
// tensors the graph lacks is refused unless allow_extra.
void import_safetensors(Step &step, const std::string &path, bool allow_extra);

}  // namespace ctr
