// Small text formatting shared by the ctr subcommands.
#pragma once

#include <cstdint>
#include <string>

namespace ctr_tool {

// 12345678 -> "12,345,678".
inline std::string grouped(int64_t v) {
  std::string digits = std::to_string(v < 0 ? -v : v);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return v < 0 ? "-" + out : out;
}

}  // namespace ctr_tool
