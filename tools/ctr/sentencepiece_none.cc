// The build without libsentencepiece: `--sentencepiece` is refused (see
// sentencepiece.h).

#include "sentencepiece.h"
#include "tool_error.h"


namespace ctr_tool {

struct SentencePiece::Impl {};

SentencePiece::SentencePiece(const std::string &) {
  ctr_tool::fail(CTR_STATUS_UNSUPPORTED,
            "--sentencepiece: this ctr was built without libsentencepiece (Debian: libsentencepiece-dev; "
            "meson finds it when it is installed, -Dsentencepiece=enabled requires it)");
}

SentencePiece::~SentencePiece() = default;
int SentencePiece::vocab_size() const { return 0; }
int SentencePiece::eos_id() const { return -1; }
std::vector<uint32_t> SentencePiece::encode(const std::string &) const { return {}; }

}  // namespace ctr_tool
