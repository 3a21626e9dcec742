// The ctr_options handle and the typed, checked reading of it.
//
// An option set is a bag of typed values; meaning comes from the call that reads
// it. Each consumer walks the bag with an OptionReader, which checks types and
// ranges as it reads and, at finish(), fails on any key nobody asked for — a typo
// in a key is an error that lists the keys that call knows, never a silent default.
#pragma once

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "ctr/ctr.h"

struct ctr_options {
  struct Value {
    enum Kind { Int, Float, String } kind = Int;
    int64_t i = 0;
    double f = 0;
    std::string s;
  };
  std::map<std::string, Value> values;
};

namespace ctr {

class OptionReader {
 public:
  // context names the consumer in messages, e.g. "ctr_step_create".
  OptionReader(const ctr_options *options, std::string context);

  bool has(const char *key) const;
  int64_t get_int(const char *key, int64_t def, int64_t min = INT64_MIN, int64_t max = INT64_MAX);
  double get_float(const char *key, double def, double min = -1e300, double max = 1e300);
  std::string get_string(const char *key, const std::string &def,
                         const std::vector<std::string> &allowed = {});
  // Fails with CTR_STATUS_INVALID_OPTION on keys that were never asked for.
  void finish() const;

 private:
  const ctr_options::Value *find(const char *key);
  const ctr_options *opts_;
  std::string context_;
  std::set<std::string> known_;
};

}  // namespace ctr
