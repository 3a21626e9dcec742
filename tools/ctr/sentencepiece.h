// A SentencePiece model for `ctr data tokenize --sentencepiece` (Debian's
// libsentencepiece). The library is optional: a build without it has the same
// class, whose constructor refuses with a message that says so
// (sentencepiece_none.cc), so the command line is the same in every build.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace ctr_tool {

class SentencePiece {
 public:
  // Loads the model file (spm_train's MODEL.model). Fails with ctr_tool::Error:
  // CTR_STATUS_IO_ERROR when it cannot be read, CTR_STATUS_UNSUPPORTED in a
  // build without libsentencepiece.
  explicit SentencePiece(const std::string &model_path);
  ~SentencePiece();
  SentencePiece(const SentencePiece &) = delete;
  SentencePiece &operator=(const SentencePiece &) = delete;

  int vocab_size() const;
  // The end-of-sentence piece's id, -1 if the model has none.
  int eos_id() const;
  // The ids of text, after the model's own normalization.
  std::vector<uint32_t> encode(const std::string &text) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ctr_tool
