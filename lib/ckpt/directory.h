// Checkpoint directories: numbered checkpoints under one root, a `latest` file,
// pruning and resumption with fallback (directory.cc), built on the step's own
// checkpoint calls. The entry points are ctr_step_save_checkpoint and
// ctr_step_resume.
#pragma once

#include <cstdint>
#include <string>

namespace ctr {

class Step;

// Saves step into ROOT/step_NNNNNNNN (its step count), in the background when
// the step's async_save option is set. When the save is published (at once for
// a synchronous save), rank 0 points ROOT/latest at it and removes all but the
// `keep` newest step_* directories (keep 0: none removed). Collective. Returns
// the checkpoint's directory.
std::string save_checkpoint(Step &step, const std::string &root, int64_t keep);

struct Resumed {
  std::string path;     // the directory loaded
  std::string skipped;  // "DIR: reason" per damaged checkpoint passed over, '\n'-separated
};

// Loads a checkpoint into step. which empty or "latest": the one ROOT/latest
// names, else the newest step_*, then older ones in turn while a load fails with
// CTR_STATUS_CHECKPOINT_ERROR. Otherwise which is a name under root or a path.
// Collective; every rank must see the same root.
Resumed resume_checkpoint(Step &step, const std::string &root, const std::string &which);

}  // namespace ctr
