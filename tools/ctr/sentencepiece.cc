// SentencePiece models through libsentencepiece (see sentencepiece.h).

#include "sentencepiece.h"
#include "tool_error.h"

#include <sentencepiece_processor.h>


namespace ctr_tool {

struct SentencePiece::Impl {
  sentencepiece::SentencePieceProcessor processor;
};

SentencePiece::SentencePiece(const std::string &model_path) : impl_(std::make_unique<Impl>()) {
  const auto status = impl_->processor.Load(model_path);
  if (!status.ok())
    ctr_tool::fail(CTR_STATUS_IO_ERROR, ctr_tool::format("cannot load the SentencePiece model '%s': %s",
                                                  model_path.c_str(), status.ToString().c_str()));
}

SentencePiece::~SentencePiece() = default;

int SentencePiece::vocab_size() const { return impl_->processor.GetPieceSize(); }

int SentencePiece::eos_id() const { return impl_->processor.eos_id(); }

std::vector<uint32_t> SentencePiece::encode(const std::string &text) const {
  std::vector<int> ids;
  const auto status = impl_->processor.Encode(text, &ids);
  if (!status.ok())
    ctr_tool::fail(CTR_STATUS_INTERNAL, ctr_tool::format("SentencePiece could not encode: %s", status.ToString().c_str()));
  return std::vector<uint32_t>(ids.begin(), ids.end());
}

}  // namespace ctr_tool
