// Option reading with type and range checks (see options.h).

#include "core/options.h"

#include <cmath>

#include "core/status.h"

namespace ctr {

OptionReader::OptionReader(const ctr_options *options, std::string context)
    : opts_(options), context_(std::move(context)) {}

bool OptionReader::has(const char *key) const {
  return opts_ && opts_->values.count(key) != 0;
}

const ctr_options::Value *OptionReader::find(const char *key) {
  known_.insert(key);
  if (!opts_) return nullptr;
  auto it = opts_->values.find(key);
  return it == opts_->values.end() ? nullptr : &it->second;
}

int64_t OptionReader::get_int(const char *key, int64_t def, int64_t min, int64_t max) {
  const auto *v = find(key);
  if (!v) return def;
  int64_t x;
  if (v->kind == ctr_options::Value::Int) {
    x = v->i;
  } else if (v->kind == ctr_options::Value::Float && std::isfinite(v->f) &&
             v->f == std::floor(v->f) && std::fabs(v->f) < 9e15) {
    x = static_cast<int64_t>(v->f);
  } else {
    fail(CTR_STATUS_INVALID_OPTION,
         strformat("%s: option '%s' must be an integer", context_.c_str(), key));
  }
  if (x < min || x > max)
    fail(CTR_STATUS_INVALID_OPTION,
         strformat("%s: option '%s' = %lld is out of range [%lld, %lld]", context_.c_str(), key,
                   static_cast<long long>(x), static_cast<long long>(min),
                   static_cast<long long>(max)));
  return x;
}

double OptionReader::get_float(const char *key, double def, double min, double max) {
  const auto *v = find(key);
  if (!v) return def;
  double x;
  if (v->kind == ctr_options::Value::Float)
    x = v->f;
  else if (v->kind == ctr_options::Value::Int)
    x = static_cast<double>(v->i);
  else
    fail(CTR_STATUS_INVALID_OPTION,
         strformat("%s: option '%s' must be a number", context_.c_str(), key));
  if (!std::isfinite(x) || x < min || x > max)
    fail(CTR_STATUS_INVALID_OPTION, strformat("%s: option '%s' = %g is out of range [%g, %g]",
                                              context_.c_str(), key, x, min, max));
  return x;
}

std::string OptionReader::get_string(const char *key, const std::string &def,
                                     const std::vector<std::string> &allowed) {
  const auto *v = find(key);
  if (!v) return def;
  if (v->kind != ctr_options::Value::String)
    fail(CTR_STATUS_INVALID_OPTION,
         strformat("%s: option '%s' must be a string", context_.c_str(), key));
  if (!allowed.empty()) {
    bool ok = false;
    std::string list;
    for (const auto &a : allowed) {
      ok |= (a == v->s);
      list += (list.empty() ? "" : ", ") + a;
    }
    if (!ok)
      fail(CTR_STATUS_INVALID_OPTION,
           strformat("%s: option '%s' = '%s' is not one of: %s", context_.c_str(), key,
                     v->s.c_str(), list.c_str()));
  }
  return v->s;
}

void OptionReader::finish() const {
  if (!opts_) return;
  for (const auto &kv : opts_->values) {
    if (known_.count(kv.first)) continue;
    std::string list;
    for (const auto &k : known_) list += (list.empty() ? "" : ", ") + k;
    fail(CTR_STATUS_INVALID_OPTION,
         strformat("%s: unknown option '%s' (known: %s)", context_.c_str(), kv.first.c_str(),
                   list.c_str()));
  }
}

}  // namespace ctr
