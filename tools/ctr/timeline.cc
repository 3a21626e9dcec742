// `ctr plot --timeline TRACE -o FILE.svg`: the Chrome trace `ctr run --trace`
// writes, drawn as a Gantt chart (one row per rank, its tasks as bars: forwards,
// backwards, weight-gradient tasks, waits for other pipeline stages, the
// optimizer), and the pipeline bubble measured from it.
//
// The bubble of a step is the share of the step's span (from the first task any
// rank starts to the last one any rank ends) that a rank spends outside its own
// forwards, backwards and weight-gradient tasks, averaged over the ranks; the
// figure printed is over every step but the first (warm-up) when there are
// several.

#include "timeline.h"
#include "tool_error.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <map>
#include <string>
#include <vector>

#include "svg_chart.h"

namespace ctr_tool {

using ctr_tool::fail;
using ctr_tool::format;

namespace {

struct Bar {
  int rank = 0;
  int64_t step = 0;
  std::string name, cat;
  double start = 0, dur = 0;  // microseconds
};

// A stage's own work: what the bubble is measured against.
bool is_task(const std::string &cat) { return cat == "forward" || cat == "backward" || cat == "weight"; }

const char *bar_color(const std::string &cat) {
  if (cat == "forward") return "#4c78a8";
  if (cat == "backward") return "#59a14f";
  if (cat == "weight") return "#b07aa1";
  if (cat == "recv") return "#c9c9c9";
  return "#f28e2b";  // optimizer
}

}  // namespace

TimelineStats read_timeline(const std::string &path, std::vector<TimelineBar> *bars_out) {
  std::ifstream in(path);
  if (!in) fail(CTR_STATUS_IO_ERROR, format("cannot open trace '%s': %s", path.c_str(), std::strerror(errno)));
  nlohmann::json doc;
  try {
    in >> doc;
  } catch (const nlohmann::json::exception &e) {
    fail(CTR_STATUS_INVALID_ARGUMENT, format("%s: not a JSON trace: %s", path.c_str(), e.what()));
  }
  if (!doc.is_object() || !doc.contains("traceEvents") || !doc["traceEvents"].is_array())
    fail(CTR_STATUS_INVALID_ARGUMENT,
         format("%s: not a trace of `ctr run --trace` (no \"traceEvents\" array)", path.c_str()));
  std::vector<TimelineBar> bars;
  for (const auto &e : doc["traceEvents"]) {
    if (!e.is_object() || e.value("ph", "") != "X") continue;
    try {
      TimelineBar b;
      b.rank = e.at("pid").get<int>();
      b.name = e.at("name").get<std::string>();
      b.cat = e.value("cat", "");
      b.start = e.at("ts").get<double>();
      b.dur = e.at("dur").get<double>();
      b.step = e.contains("args") ? e["args"].value("step", int64_t{0}) : 0;
      if (b.rank < 0 || b.rank > (1 << 20) || b.dur < 0) throw std::runtime_error("out of range");
      bars.push_back(std::move(b));
    } catch (const std::exception &x) {
      fail(CTR_STATUS_INVALID_ARGUMENT, format("%s: a malformed trace event (%s): %s", path.c_str(), x.what(),
                                                 e.dump().substr(0, 200).c_str()));
    }
  }
  if (bars.empty()) fail(CTR_STATUS_INVALID_ARGUMENT, format("%s: the trace has no task events", path.c_str()));

  TimelineStats st;
  std::map<int64_t, std::pair<double, double>> span;  // step -> first start, last end of any rank's task
  std::map<std::pair<int64_t, int>, double> busy;      // (step, rank) -> its forwards' and backwards' time
  for (const TimelineBar &b : bars) {
    st.ranks = std::max(st.ranks, b.rank + 1);
    if (!is_task(b.cat)) continue;
    auto it = span.find(b.step);
    if (it == span.end()) it = span.insert({b.step, {b.start, b.start + b.dur}}).first;
    it->second.first = std::min(it->second.first, b.start);
    it->second.second = std::max(it->second.second, b.start + b.dur);
    busy[{b.step, b.rank}] += b.dur;
  }
  st.steps = static_cast<int64_t>(span.size());
  double idle = 0, total = 0;
  bool first = true;
  for (const auto &[step, se] : span) {
    if (first && span.size() > 1) {  // warm-up
      first = false;
      continue;
    }
    first = false;
    const double len = se.second - se.first;
    for (int r = 0; r < st.ranks; ++r) {
      auto it = busy.find({step, r});
      const double b = it == busy.end() ? 0 : it->second;
      idle += std::max(0.0, len - b);
      total += len;
    }
    st.step_us += len;
    ++st.measured_steps;
  }
  st.bubble = total > 0 ? idle / total : 0;
  if (st.measured_steps > 0) st.step_us /= static_cast<double>(st.measured_steps);
  if (bars_out) *bars_out = std::move(bars);
  return st;
}

void write_timeline_svg(const std::string &trace, const std::string &output, const std::string &title, int width) {
  std::vector<TimelineBar> bars;
  const TimelineStats st = read_timeline(trace, &bars);
  // The last step (of every rank) is drawn: steps are alike, and one is readable.
  int64_t last = 0;
  for (const TimelineBar &b : bars) last = std::max(last, b.step);
  double t0 = std::numeric_limits<double>::infinity(), t1 = -t0;
  for (const TimelineBar &b : bars)
    if (b.step == last) {
      t0 = std::min(t0, b.start);
      t1 = std::max(t1, b.start + b.dur);
    }
  const double span = std::max(1.0, t1 - t0);
  const int left = 110, right = 20, top = 56, row = 34, gap = 8;
  const int height = top + st.ranks * row + 60;
  const double plot_w = width - left - right;
  auto x = [&](double us) { return left + (us - t0) / span * plot_w; };
  std::string svg = format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" font-family=\"sans-serif\" "
      "font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
      width, height);
  const std::string heading =
      (title.empty() ? std::string("pipeline timeline") : title) +
      format(" — step %lld, %.2f ms; bubble %.1f%% (mean over %lld step%s)", static_cast<long long>(last),
                span / 1000.0, 100.0 * st.bubble, static_cast<long long>(st.measured_steps),
                st.measured_steps == 1 ? "" : "s");
  svg += format("<text x=\"%d\" y=\"22\" font-size=\"15\">%s</text>\n", left, svg::xml_escape(heading).c_str());
  int lx = left;
  for (const char *cat : {"forward", "backward", "weight", "recv", "optimizer"}) {
    svg += format("<rect x=\"%d\" y=\"32\" width=\"12\" height=\"12\" fill=\"%s\"/><text x=\"%d\" y=\"43\">%s</text>\n",
                     lx, bar_color(cat), lx + 16,
                     std::strcmp(cat, "recv") == 0     ? "waiting for another stage"
                     : std::strcmp(cat, "weight") == 0 ? "weight gradients (zb)"
                                                        : cat);
    lx += std::strcmp(cat, "recv") == 0 ? 190 : std::strcmp(cat, "weight") == 0 ? 170 : 100;
  }
  for (int r = 0; r < st.ranks; ++r)
    svg += format("<text x=\"8\" y=\"%d\">rank %d</text>\n", top + r * row + row / 2 + 4, r);
  for (const TimelineBar &b : bars) {
    if (b.step != last) continue;
    const double bx = x(b.start), bw = std::max(0.5, x(b.start + b.dur) - bx);
    const int y = top + b.rank * row + gap / 2;
    svg += format("<rect x=\"%.2f\" y=\"%d\" width=\"%.2f\" height=\"%d\" fill=\"%s\" stroke=\"white\" "
                     "stroke-width=\"0.5\"><title>%s: %.3f ms</title></rect>\n",
                     bx, y, bw, row - gap, bar_color(b.cat), svg::xml_escape(b.name).c_str(), b.dur / 1000.0);
    if (bw > 22 && is_task(b.cat))
      svg += format("<text x=\"%.2f\" y=\"%d\" fill=\"white\" text-anchor=\"middle\">%s</text>\n", bx + bw / 2,
                       y + (row - gap) / 2 + 4, svg::xml_escape(b.name).c_str());
  }
  const int axis_y = top + st.ranks * row + 10;
  svg += format("<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#333\"/>\n", left, axis_y, width - right,
                   axis_y);
  const svg::Axis ax = svg::linear_axis(0, span / 1000.0, true);
  for (double v : ax.ticks) {
    const double px = left + v * 1000.0 / span * plot_w;
    if (px > width - right + 0.5) continue;
    svg += format("<line x1=\"%.2f\" y1=\"%d\" x2=\"%.2f\" y2=\"%d\" stroke=\"#333\"/><text x=\"%.2f\" y=\"%d\" "
                     "text-anchor=\"middle\">%s</text>\n",
                     px, axis_y, px, axis_y + 4, px, axis_y + 18, svg::tick_label(v, ax.step, svg::Format::Plain).c_str());
  }
  svg += format("<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">ms from the step's first task</text>\n",
                   left + static_cast<int>(plot_w / 2), axis_y + 36);
  svg += "</svg>\n";
  std::ofstream out(output, std::ios::out | std::ios::trunc | std::ios::binary);
  if (!out) fail(CTR_STATUS_IO_ERROR, format("cannot open '%s' for writing: %s", output.c_str(), std::strerror(errno)));
  out << svg;
  out.close();
  if (!out) fail(CTR_STATUS_IO_ERROR, format("cannot write '%s'", output.c_str()));
  std::printf("wrote %s: %d rank(s), %lld step(s); step %.3f ms, bubble %.1f%%\n", output.c_str(), st.ranks,
              static_cast<long long>(st.steps), st.step_us / 1000.0, 100.0 * st.bubble);
}

}  // namespace ctr_tool
