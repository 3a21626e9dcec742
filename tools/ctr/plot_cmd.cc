// `ctr plot`: the curves of one or more training runs, from the JSON lines that
// `ctr run --metrics FILE` writes, as one SVG file.
//
//   ctr plot m.jsonl -o run.svg
//   ctr plot base.jsonl prefetch2.jsonl -o cmp.svg --log-loss --comm --title "prefetch"
//
// Panels share the step axis: loss (and eval_loss as dots), throughput, MFU when
// the lines carry an "mfu" key, and with --comm the communication time per step.
// Each file is one run in its own colour, named in the legend by its file name.
//
// The reader is strict where a file is damaged and lenient where a run is still
// being written: a line that is not a JSON object is an error naming the file
// and line, but an incomplete last line (no newline, not parseable) is skipped
// with a warning. NaN and infinite values (written as null by `ctr run`, as NaN
// or Infinity by Python's json) are gaps in the lines, counted in a note.

#include "plot_cmd.h"
#include "tool_error.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "svg_chart.h"
#include "timeline.h"

namespace ctr_tool {

using ctr_tool::fail;
using ctr_tool::format;

namespace {

// The keys drawn, each a number per line (absent or null: no point there).
constexpr const char *kLoss = "loss";
constexpr const char *kEvalLoss = "eval_loss";
constexpr const char *kTokensPerS = "tokens_per_s";
constexpr const char *kMfu = "mfu";
constexpr const char *kExposedComm = "exposed_comm_ms";
constexpr const char *kComm = "comm_ms";
constexpr const char *kKeys[] = {kLoss, kEvalLoss, kTokensPerS, kMfu, kExposedComm, kComm};

struct Run {
  std::string path, name;
  std::vector<double> steps;
  std::map<std::string, std::vector<double>> values;  // per key, NaN where absent
  std::map<std::string, bool> present;                // a key holds a number on some line
  std::vector<double> nonfinite_loss_steps;
  bool incomplete_tail = false;

  const std::vector<double> &of(const char *key) const { return values.at(key); }
  bool has(const char *key) const { return present.at(key); }
};

const char *json_kind(const nlohmann::json &j) {
  switch (j.type()) {
    case nlohmann::json::value_t::object: return "an object";
    case nlohmann::json::value_t::array: return "an array";
    case nlohmann::json::value_t::string: return "a string";
    case nlohmann::json::value_t::boolean: return "a boolean";
    case nlohmann::json::value_t::null: return "null";
    default: return "a number";
  }
}

// JSON has no NaN or infinity; Python's json writes them as bare NaN, Infinity
// and -Infinity. Outside strings those become null, which this reader (like
// `ctr run`, whose NaN is written as null) takes as a non-finite value.
std::string nonfinite_to_null(const std::string &line) {
  std::string out;
  out.reserve(line.size());
  bool in_string = false;
  for (size_t i = 0; i < line.size();) {
    const char c = line[i];
    if (in_string) {
      out += c;
      if (c == '\\' && i + 1 < line.size()) {
        out += line[i + 1];
        i += 2;
        continue;
      }
      if (c == '"') in_string = false;
      ++i;
      continue;
    }
    if (c == '"') in_string = true;
    bool replaced = false;
    for (const char *lit : {"-Infinity", "Infinity", "NaN"}) {
      const size_t n = std::strlen(lit);
      if (line.compare(i, n, lit) == 0) {
        out += "null";
        i += n;
        replaced = true;
        break;
      }
    }
    if (!replaced) out += line[i++];
  }
  return out;
}

// nlohmann's message without its exception tag, and with the column only (the
// parser sees one line at a time).
std::string parse_message(const nlohmann::json::parse_error &e) {
  std::string m = e.what();
  if (const size_t tag = m.find("] "); tag != std::string::npos) m = m.substr(tag + 2);
  if (const size_t col = m.find("column "); col != std::string::npos) m = m.substr(col);
  return m;
}

Run read_run(const std::string &path) {
  Run run;
  run.path = path;
  for (const char *k : kKeys) {
    run.values[k];
    run.present[k] = false;
  }
  const std::string text = ctr_tool::read_regular_file(path, "metrics file", CTR_STATUS_IO_ERROR);

  size_t line_no = 0;
  for (size_t at = 0; at < text.size();) {
    size_t end = text.find('\n', at);
    const bool last_unterminated = end == std::string::npos;
    if (last_unterminated) end = text.size();
    const std::string line = text.substr(at, end - at);
    at = end + 1;
    ++line_no;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;

    nlohmann::json j;
    try {
      j = nlohmann::json::parse(nonfinite_to_null(line));
    } catch (const nlohmann::json::parse_error &e) {
      if (last_unterminated) {
        // A run still being written: its last line may be cut short.
        std::fprintf(stderr,
                     "ctr: warning: %s:%zu: incomplete last line skipped (is the run still "
                     "writing it?)\n",
                     path.c_str(), line_no);
        run.incomplete_tail = true;
        break;
      }
      fail(CTR_STATUS_DATA_ERROR,
           format("%s:%zu: not valid JSON: %s", path.c_str(), line_no,
                     parse_message(e).c_str()));
    }
    if (!j.is_object())
      fail(CTR_STATUS_DATA_ERROR, format("%s:%zu: expected a JSON object of metrics, got %s",
                                            path.c_str(), line_no, json_kind(j)));
    const auto step = j.find("step");
    if (step == j.end())
      fail(CTR_STATUS_DATA_ERROR,
           format("%s:%zu: no \"step\" key in the line", path.c_str(), line_no));
    if (!step->is_number())
      fail(CTR_STATUS_DATA_ERROR, format("%s:%zu: \"step\" is %s, expected a number",
                                            path.c_str(), line_no, json_kind(*step)));
    const double s = step->get<double>();
    run.steps.push_back(s);

    for (const char *key : kKeys) {
      const bool is_loss = std::string_view(key) == kLoss;
      double v = NAN;
      const auto it = j.find(key);
      if (it != j.end()) {
        if (it->is_number()) {
          v = it->get<double>();
          run.present[key] = true;
        } else if (!it->is_null()) {
          fail(CTR_STATUS_DATA_ERROR, format("%s:%zu: \"%s\" is %s, expected a number",
                                                path.c_str(), line_no, key, json_kind(*it)));
        } else if (is_loss) {
          run.present[key] = true;
        }
        if (is_loss && !std::isfinite(v)) run.nonfinite_loss_steps.push_back(s);
      }
      run.values[key].push_back(v);
    }
  }
  if (run.steps.empty())
    fail(CTR_STATUS_DATA_ERROR,
         format("%s: no metrics lines (%s)", path.c_str(),
                   text.empty() ? "the file is empty" : "no complete JSON line"));
  return run;
}

// File names for the legend; a name two files share is replaced by their paths.
void name_runs(std::vector<Run> &runs) {
  std::map<std::string, int> count;
  for (auto &r : runs) {
    const size_t slash = r.path.find_last_of('/');
    r.name = slash == std::string::npos ? r.path : r.path.substr(slash + 1);
    ++count[r.name];
  }
  for (auto &r : runs)
    if (count[r.name] > 1) r.name = r.path;
}

std::string step_list(const std::vector<double> &steps) {
  constexpr size_t kShown = 5;
  std::string s;
  for (size_t i = 0; i < steps.size() && i < kShown; ++i)
    s += (i ? ", " : "") + format("%g", steps[i]);
  if (steps.size() > kShown) s += format(" and %zu more", steps.size() - kShown);
  return s;
}

}  // namespace

// ------------------------------------------------------------------------------------------
// The command

struct PlotCommand::Args {
  CLI::App *cmd = nullptr;
  std::vector<std::string> files;
  std::string output, title;
  bool log_loss = false, comm = false, timeline = false;
  int width = 960;
};

PlotCommand::PlotCommand(CLI::App &app) : args_(std::make_unique<Args>()) {
  Args &a = *args_;
  a.cmd = app.add_subcommand(
      "plot", "Draw loss, throughput and MFU of `ctr run --metrics` files as an SVG");
  a.cmd->add_option("files", a.files, "Metrics files (JSON lines), one run each; with --timeline, one trace")
      ->required();
  a.cmd->add_option("-o,--output", a.output, "SVG file to write")->required();
  a.cmd->add_option("--title", a.title, "Title above the chart (default: the runs' names)");
  a.cmd->add_flag("--log-loss", a.log_loss, "Draw the loss on a log scale");
  a.cmd->add_flag("--comm", a.comm,
                  "Add a panel of the communication time per step (exposed and total)");
  a.cmd->add_flag("--timeline", a.timeline,
                  "Draw a trace of `ctr run --trace` instead: a Gantt chart of each rank's tasks in the last "
                  "step, and the pipeline bubble measured over its steps");
  a.cmd->add_option("--width", a.width, "Width of the chart in pixels")
      ->capture_default_str()
      ->check(CLI::Range(480, 8000));
}

PlotCommand::~PlotCommand() = default;

bool PlotCommand::parsed() const { return args_->cmd->parsed(); }

int PlotCommand::run() const {
  const Args &a = *args_;
  if (a.timeline) {
    if (a.files.size() != 1) fail(CTR_STATUS_INVALID_ARGUMENT, "ctr plot --timeline: give one trace file");
    write_timeline_svg(a.files[0], a.output, a.title, a.width);
    return 0;
  }
  std::vector<Run> runs;
  for (const auto &f : a.files) runs.push_back(read_run(f));
  name_runs(runs);

  svg::Chart chart;
  chart.width = a.width;
  chart.x_label = "step";
  for (const auto &r : runs) chart.legend.push_back(r.name);
  if (!a.title.empty()) {
    chart.title = a.title;
  } else if (runs.size() <= 3) {
    for (size_t i = 0; i < runs.size(); ++i) chart.title += (i ? " vs " : "") + runs[i].name;
  } else {
    chart.title = format("%zu runs", runs.size());
  }

  const auto series = [&](size_t i, const char *key) {
    svg::Series s;
    s.run = runs[i].name;
    s.name = key;
    s.color = static_cast<int>(i);
    s.x = runs[i].steps;
    s.y = runs[i].of(key);
    return s;
  };
  const auto any = [&](const char *key) {
    for (const auto &r : runs)
      if (r.has(key)) return true;
    return false;
  };

  svg::Panel loss;
  loss.heading = a.log_loss ? "loss (log scale)" : "loss";
  if (any(kEvalLoss)) loss.heading += "; dots: eval_loss";
  loss.log_y = a.log_loss;
  loss.empty_note = "no finite loss in these runs";
  for (size_t i = 0; i < runs.size(); ++i) {
    if (runs[i].has(kLoss)) loss.series.push_back(series(i, kLoss));
    if (runs[i].has(kEvalLoss)) {
      loss.series.push_back(series(i, kEvalLoss));
      loss.series.back().markers = true;
    }
  }
  chart.panels.push_back(loss);

  svg::Panel tput;
  tput.heading = "throughput (tokens/s)";
  tput.from_zero = true;
  tput.format = svg::Format::Human;
  tput.empty_note = "no tokens_per_s in these runs";
  for (size_t i = 0; i < runs.size(); ++i)
    if (runs[i].has(kTokensPerS)) tput.series.push_back(series(i, kTokensPerS));
  chart.panels.push_back(tput);

  if (any(kMfu)) {
    svg::Panel mfu;
    mfu.heading = "MFU (model FLOPs utilisation)";
    mfu.from_zero = true;
    mfu.format = svg::Format::Percent;
    for (size_t i = 0; i < runs.size(); ++i)
      if (runs[i].has(kMfu)) mfu.series.push_back(series(i, kMfu));
    chart.panels.push_back(mfu);
  } else {
    chart.notes.push_back("no MFU in these runs (no \"mfu\" key): the MFU panel is left out");
  }

  if (a.comm) {
    svg::Panel comm;
    comm.heading = "communication per step (ms): solid exposed, dashed total";
    comm.from_zero = true;
    comm.empty_note = "no communication times in these runs";
    for (size_t i = 0; i < runs.size(); ++i) {
      if (runs[i].has(kExposedComm)) comm.series.push_back(series(i, kExposedComm));
      if (runs[i].has(kComm)) {
        comm.series.push_back(series(i, kComm));
        comm.series.back().dashed = true;
      }
    }
    chart.panels.push_back(comm);
  }

  for (const auto &r : runs) {
    if (!r.nonfinite_loss_steps.empty())
      chart.notes.push_back(format("%s: %zu non-finite loss%s drawn as gaps (step%s %s)",
                                      r.name.c_str(), r.nonfinite_loss_steps.size(),
                                      r.nonfinite_loss_steps.size() == 1 ? "" : "es",
                                      r.nonfinite_loss_steps.size() == 1 ? "" : "s",
                                      step_list(r.nonfinite_loss_steps).c_str()));
    if (a.log_loss) {
      size_t nonpositive = 0;
      for (const double v : r.of(kLoss)) nonpositive += std::isfinite(v) && v <= 0;
      if (nonpositive > 0)
        chart.notes.push_back(format("%s: %zu loss%s <= 0 left out of the log scale",
                                        r.name.c_str(), nonpositive, nonpositive == 1 ? "" : "es"));
    }
    if (r.incomplete_tail)
      chart.notes.push_back(r.name + ": incomplete last line skipped (run still writing?)");
  }

  const std::string svg_text = svg::render(chart);
  std::ofstream out(a.output, std::ios::out | std::ios::trunc | std::ios::binary);
  if (!out)
    fail(CTR_STATUS_IO_ERROR,
         format("cannot open '%s' for writing: %s", a.output.c_str(), std::strerror(errno)));
  out << svg_text;
  out.close();
  if (!out)
    fail(CTR_STATUS_IO_ERROR, format("cannot write '%s'", a.output.c_str()));

  std::string what;
  for (const auto &r : runs)
    what += (what.empty() ? "" : ", ") + format("%s %zu steps", r.name.c_str(), r.steps.size());
  std::string panels;
  for (const auto &p : chart.panels) {
    const std::string head = p.heading.substr(0, p.heading.find_first_of(" ;"));
    panels += (panels.empty() ? "" : ", ") + head;
  }
  std::printf("wrote %s: %zu run%s (%s); panels: %s\n", a.output.c_str(), runs.size(),
              runs.size() == 1 ? "" : "s", what.c_str(), panels.c_str());
  return 0;
}

}  // namespace ctr_tool
