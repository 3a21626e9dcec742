// libFuzzer target: arbitrary option strings for the calls that read options.
//
// The first byte picks the consumer: ctr_mesh_create, ctr_graph_create_preset
// or ctr_step_create (on the small model's graph). The rest is read as lines
// "key=value" (split at the first '='; a line without one is a key with an
// empty value). A value that is a whole decimal integer is set with
// ctr_options_set_int, a whole number with ctr_options_set_float, anything else
// with ctr_options_set_string; a leading '"' forces a string. Every call must
// answer with a status; an unknown key, a wrong type or a value out of range is
// CTR_STATUS_INVALID_OPTION, never a crash.
//
// What the harness fixes, and why:
// - the mesh has one rank ("world" is set to 1 last): more ranks would wait for
//   a rendezvous nobody joins;
// - "threads" above 4 is lowered to 4: the pool is process-wide, and thousands
//   of threads per input would only make the run slow;
// - the step gets "batch" 1 unless the input sets it, and "memory_limit" 64 MiB
//   unless the input sets a smaller integer, so that a large batch or sequence
//   is refused by the plan (CTR_STATUS_OUT_OF_MEMORY) instead of allocated;
// - a step is run once only when batch * micro_batches is at most 64.
// A preset graph is saved and loaded back: a graph the library built must load.
//
//   FUZZ_TARGETS=options FUZZ_SECONDS=600 tools/sanitize.sh fuzz  (README: Hardening)

#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "ctr/ctr.h"
#include "fuzz_common.h"

namespace {

constexpr int64_t kMemoryLimit = int64_t{64} << 20;
constexpr int64_t kMaxThreads = 4;
constexpr double kMaxRunRows = 64;

struct Entry {
  std::string key;
  enum Kind { Int, Float, String } kind = String;
  int64_t i = 0;
  double f = 0;
  std::string s;
  // The value as a number, when it is one (for the harness's own limits).
  bool numeric() const { return kind != String; }
  double number() const { return kind == Int ? static_cast<double>(i) : f; }
};

Entry parse_line(const std::string &line) {
  Entry e;
  size_t eq = line.find('=');
  e.key = line.substr(0, eq);
  std::string v = eq == std::string::npos ? std::string() : line.substr(eq + 1);
  e.s = v;
  if (!v.empty() && v[0] == '"') {
    e.s = v.substr(1);
    return e;
  }
  if (v.empty() || v.find('\0') != std::string::npos) return e;
  char *end = nullptr;
  errno = 0;
  long long i = std::strtoll(v.c_str(), &end, 10);
  if (errno == 0 && *end == '\0') {
    e.kind = Entry::Int;
    e.i = i;
    return e;
  }
  errno = 0;
  double f = std::strtod(v.c_str(), &end);
  if (*end == '\0') {
    e.kind = Entry::Float;
    e.f = f;
  }
  return e;
}

std::vector<Entry> parse(const uint8_t *data, size_t size) {
  std::vector<Entry> out;
  std::string text(reinterpret_cast<const char *>(data), size);
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t nl = text.find('\n', pos);
    std::string line = text.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
    if (!line.empty()) out.push_back(parse_line(line));
    if (nl == std::string::npos) break;
    pos = nl + 1;
  }
  return out;
}

void set(ctr_options *o, const Entry &e) {
  switch (e.kind) {
    case Entry::Int:
      fuzz::check_status(ctr_options_set_int(o, e.key.c_str(), e.i), "ctr_options_set_int");
      break;
    case Entry::Float:
      fuzz::check_status(ctr_options_set_float(o, e.key.c_str(), e.f), "ctr_options_set_float");
      break;
    case Entry::String:
      fuzz::check_status(ctr_options_set_string(o, e.key.c_str(), e.s.c_str()),
                         "ctr_options_set_string");
      break;
  }
}

// The last entry of key, or nullptr. Keys compare as the library sees them:
// up to the first NUL.
const Entry *find(const std::vector<Entry> &es, const char *key) {
  const Entry *found = nullptr;
  for (const Entry &e : es)
    if (std::string(e.key.c_str()) == key) found = &e;
  return found;
}

void fuzz_mesh(const std::vector<Entry> &es) {
  ctr_options *o = nullptr;
  ctr_options_create(&o);
  for (const Entry &e : es) set(o, e);
  ctr_options_set_int(o, "world", 1);
  if (const Entry *t = find(es, "threads"); t && t->numeric() && t->number() > kMaxThreads)
    ctr_options_set_int(o, "threads", kMaxThreads);
  ctr_mesh *mesh = nullptr;
  ctr_status st = ctr_mesh_create(o, &mesh);
  fuzz::check_status(st, "ctr_mesh_create");
  if (st == CTR_STATUS_OK) {
    ctr_mesh_rank(mesh);
    ctr_mesh_world_size(mesh);
    ctr_mesh_axis_size(mesh, "fsdp");
    ctr_mesh_device(mesh);
    ctr_mesh_free(mesh);
  }
  ctr_options_free(o);
}

void fuzz_preset(const std::vector<Entry> &es) {
  ctr_options *o = nullptr;
  ctr_options_create(&o);
  std::string preset = "gpt";
  for (const Entry &e : es) {
    if (std::string(e.key.c_str()) == "preset")
      preset = e.s;
    else
      set(o, e);
  }
  ctr_graph *g = nullptr;
  ctr_status st = ctr_graph_create_preset(preset.c_str(), o, &g);
  fuzz::check_status(st, "ctr_graph_create_preset");
  if (st == CTR_STATUS_OK) {
    int64_t count = 0;
    double flops = 0;
    fuzz::check_status(ctr_graph_param_count(g, &count), "ctr_graph_param_count");
    fuzz::check_status(ctr_graph_flops_per_token(g, 0, &flops), "ctr_graph_flops_per_token");
    const std::string path = fuzz::scratch_dir() + "/preset.ctrg";
    st = ctr_graph_save_file(g, path.c_str());
    fuzz::check_status(st, "ctr_graph_save_file");
    if (st == CTR_STATUS_OK) {
      ctr_graph *back = nullptr;
      if (ctr_graph_load_file(path.c_str(), &back) != CTR_STATUS_OK)
        fuzz::fail(std::string("a preset graph does not load back: ") + ctr_last_error());
      ctr_graph_free(back);
    }
    ctr_graph_free(g);
  }
  ctr_options_free(o);
}

void fuzz_step(const std::vector<Entry> &es) {
  const fuzz::SmallModel &m = fuzz::small_model();
  ctr_options *o = nullptr;
  ctr_options_create(&o);
  for (const Entry &e : es) set(o, e);
  const Entry *batch = find(es, "batch");
  if (!batch) ctr_options_set_int(o, "batch", 1);
  const Entry *limit = find(es, "memory_limit");
  if (!limit || limit->kind != Entry::Int || limit->i > kMemoryLimit)
    ctr_options_set_int(o, "memory_limit", kMemoryLimit);
  ctr_step *s = nullptr;
  ctr_status st = ctr_step_create(m.mesh, m.graph, o, &s);
  fuzz::check_status(st, "ctr_step_create");
  if (st == CTR_STATUS_OK) {
    int64_t arena = 0, params = 0, opt = 0;
    fuzz::check_status(ctr_step_memory(s, &arena, &params, &opt), "ctr_step_memory");
    // The step accepted these values, so they are whole numbers in range.
    const Entry *mb = find(es, "micro_batches");
    const Entry *seq = find(es, "seq");
    const double rows = (batch ? batch->number() : 1) * (mb ? mb->number() : 1);
    const double len = seq && seq->number() > 0 ? seq->number() : fuzz::SmallModel::kSeq;
    if (rows <= kMaxRunRows) {
      std::vector<int32_t> zeros(static_cast<size_t>(rows * len), 0);
      const size_t bytes = zeros.size() * sizeof(int32_t);
      if (ctr_step_set_input(s, "tokens", zeros.data(), bytes) == CTR_STATUS_OK &&
          ctr_step_set_input(s, "targets", zeros.data(), bytes) == CTR_STATUS_OK)
        fuzz::check_status(ctr_step_run(s, nullptr), "ctr_step_run");
    }
    ctr_step_free(s);
  }
  ctr_options_free(o);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < 1) return 0;
  const int which = data[0] % 3;
  const std::vector<Entry> es = parse(data + 1, size - 1);
  if (which == 0)
    fuzz_mesh(es);
  else if (which == 1)
    fuzz_preset(es);
  else
    fuzz_step(es);
  return 0;
}
