// Line charts as SVG text (see svg_chart.h).
//
// The document is written by hand: a title, a legend that wraps, then one panel
// per metric stacked over the shared x axis, each with round-valued ticks,
// light grid lines and its series clipped to the plot area, and notes at the
// foot. A line is one <path>; a gap (a non-finite value) starts a new subpath,
// a point alone between gaps is a zero-length subpath with a dot drawn over it,
// and the spot of each gap is marked at the top of the panel. A
// series with more points than the panel has pixel columns keeps, per column,
// its first, lowest, highest and last point: the drawing is the same, the file
// stays small for runs of any length.

#include "svg_chart.h"
#include "tool_error.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <string>
#include <vector>


namespace ctr_tool::svg {

using ctr_tool::format;

namespace {

// matplotlib's tab10: distinguishable, and readable on white.
const char *const kPalette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
                                "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"};
constexpr int kPaletteSize = sizeof kPalette / sizeof kPalette[0];

const char *color(int i) { return kPalette[((i % kPaletteSize) + kPaletteSize) % kPaletteSize]; }

// Layout, in pixels.
constexpr int kLeft = 76, kRight = 24;
constexpr int kTitleHeight = 34, kLegendRow = 20, kHeading = 22, kPlotHeight = 170;
constexpr int kPanelGap = 16, kXLabels = 18, kXTitle = 22, kNoteRow = 17, kBottom = 10;
// Rough width of a character at font-size 12, for wrapping the legend.
constexpr double kCharWidth = 6.8;

// A tiny relative slack for comparisons of computed tick positions.
constexpr double kSlack = 1e-9;

double nice_step(double raw) {
  if (!(raw > 0) || !std::isfinite(raw)) return 1;
  const double p = std::pow(10.0, std::floor(std::log10(raw)));
  const double m = raw / p;
  return (m < 1.5 ? 1 : m < 3.5 ? 2 : m < 7.5 ? 5 : 10) * p;
}

// Decimals that tell apart ticks `step` apart.
int decimals_for(double step) {
  if (!(step > 0)) return -1;
  return std::max(0, static_cast<int>(-std::floor(std::log10(step) + kSlack)));
}

std::string fixed(double v, int decimals) {
  std::string s = format("%.*f", decimals, v);
  if (s == "-0" || s.find_first_not_of("-0.") == std::string::npos) s = "0";
  return s;
}

std::string coord(double v) { return format("%.1f", v); }

bool visible(double y, bool log) { return std::isfinite(y) && (!log || y > 0); }

}  // namespace

std::string xml_escape(const std::string &s) {
  std::string out;
  out.reserve(s.size());
  for (const char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default:
        // Control characters are not allowed in XML 1.0 text.
        if (static_cast<unsigned char>(c) < 0x20 && c != '\t' && c != '\n') {
          out += '?';
        } else {
          out += c;
        }
    }
  }
  return out;
}

// ------------------------------------------------------------------------------------------
// Axes

Axis linear_axis(double lo, double hi, bool snap, int target) {
  if (!(hi > lo)) {  // one value: a range around it
    const double d = lo == 0 ? 1 : std::fabs(lo) * 0.1;
    lo -= d;
    hi += d;
  }
  Axis a;
  a.step = nice_step((hi - lo) / std::max(1, target));
  if (snap) {
    lo = std::floor(lo / a.step + kSlack) * a.step;
    hi = std::ceil(hi / a.step - kSlack) * a.step;
  }
  a.lo = lo;
  a.hi = hi;
  const auto first = static_cast<int64_t>(std::ceil(lo / a.step - kSlack));
  const auto last = static_cast<int64_t>(std::floor(hi / a.step + kSlack));
  for (int64_t k = first; k <= last; ++k) a.ticks.push_back(static_cast<double>(k) * a.step);
  return a;
}

Axis log_axis(double lo, double hi) {
  if (!(hi > lo)) {
    lo /= 1.5;
    hi *= 1.5;
  }
  const double pad = (std::log10(hi) - std::log10(lo)) * 0.04;
  Axis a;
  a.log = true;
  a.lo = std::pow(10.0, std::log10(lo) - pad);
  a.hi = std::pow(10.0, std::log10(hi) + pad);
  const double decades = std::log10(a.hi) - std::log10(a.lo);
  if (decades >= 1) {
    a.step = 0;  // labels by value
    const auto k0 = static_cast<int>(std::floor(std::log10(a.lo)));
    const auto k1 = static_cast<int>(std::ceil(std::log10(a.hi)));
    std::vector<double> all, decade_only;
    for (int k = k0; k <= k1; ++k)
      for (const double m : {1.0, 2.0, 5.0}) {
        const double v = m * std::pow(10.0, k);
        if (v < a.lo * (1 - kSlack) || v > a.hi * (1 + kSlack)) continue;
        all.push_back(v);
        if (m == 1.0) decade_only.push_back(v);
      }
    a.ticks = all.size() <= 9 || decade_only.size() < 2 ? all : decade_only;
  } else {
    const Axis lin = linear_axis(a.lo, a.hi, false, 6);
    a.step = lin.step;
    for (const double t : lin.ticks)
      if (t > 0) a.ticks.push_back(t);
  }
  return a;
}

std::string tick_label(double v, double step, Format format) {
  switch (format) {
    case Format::Percent: {
      const int d = decimals_for(step * 100);
      return (d < 0 ? ctr_tool::format("%g", v * 100) : fixed(v * 100, d)) + "%";
    }
    case Format::Human: {
      static const char *const kSuffix[] = {"", "k", "M", "G", "T"};
      double unit = 1;
      int i = 0;
      while (i < 4 && std::fabs(v) >= unit * 1000 * (1 - kSlack)) {
        unit *= 1000;
        ++i;
      }
      if (v == 0) return "0";
      const int d = step > 0 ? decimals_for(step / unit) : 1;
      return fixed(v / unit, std::min(d, 3)) + kSuffix[i];
    }
    case Format::Plain:
      break;
  }
  const int d = decimals_for(step);
  return d < 0 ? ctr_tool::format("%g", v) : fixed(v, d);
}

// ------------------------------------------------------------------------------------------
// Drawing

namespace {

struct Frame {
  double left, top, width, height;
  Axis x, y;

  double px(double v) const { return left + (v - x.lo) / (x.hi - x.lo) * width; }
  double py(double v) const {
    const auto f = [this](double t) { return y.log ? std::log10(t) : t; };
    return top + height - (f(v) - f(y.lo)) / (f(y.hi) - f(y.lo)) * height;
  }
};

// The subpaths of one series in pixels: runs of visible points between gaps.
// Long runs keep per pixel column the first, lowest, highest and last point.
std::vector<std::vector<std::pair<double, double>>> trace(const Series &s, const Frame &f,
                                                          bool thin) {
  std::vector<std::vector<std::pair<double, double>>> runs(1);
  for (size_t i = 0; i < s.x.size(); ++i) {
    if (!visible(s.y[i], f.y.log) || !std::isfinite(s.x[i])) {
      if (!runs.back().empty()) runs.emplace_back();
      continue;
    }
    runs.back().emplace_back(f.px(s.x[i]), f.py(s.y[i]));
  }
  if (runs.back().empty()) runs.pop_back();
  if (!thin) return runs;
  for (auto &run : runs) {
    std::vector<std::pair<double, double>> out;
    size_t i = 0;
    while (i < run.size()) {
      const double column = std::floor(run[i].first);
      size_t j = i, lo = i, hi = i;
      for (; j < run.size() && std::floor(run[j].first) == column; ++j) {
        if (run[j].second > run[lo].second) lo = j;  // pixel y grows downwards
        if (run[j].second < run[hi].second) hi = j;
      }
      size_t keep[] = {i, std::min(lo, hi), std::max(lo, hi), j - 1};
      for (size_t k = 0; k < 4; ++k)
        if (k == 0 || keep[k] != keep[k - 1]) out.push_back(run[keep[k]]);
      i = j;
    }
    run.swap(out);
  }
  return runs;
}

void draw_series(std::string &svg, const Series &s, const Frame &f, int clip_id) {
  size_t finite = 0, gaps = 0;
  for (const double y : s.y) visible(y, f.y.log) ? ++finite : ++gaps;
  const bool thin = finite > static_cast<size_t>(f.width);
  std::string d, dots;
  for (const auto &run : trace(s, f, thin)) {
    if (run.size() == 1 || s.markers) {
      for (const auto &[x, y] : run) d += "M" + coord(x) + "," + coord(y) + "h0";
      // A point alone between gaps: a line's round cap is too small to see.
      if (!s.markers)
        dots += format("<circle cx=\"%s\" cy=\"%s\" r=\"2.5\" fill=\"%s\" "
                          "clip-path=\"url(#clip%d)\"/>\n",
                          coord(run[0].first).c_str(), coord(run[0].second).c_str(),
                          color(s.color), clip_id);
      continue;
    }
    for (size_t i = 0; i < run.size(); ++i)
      d += (i == 0 ? "M" : "L") + coord(run[i].first) + "," + coord(run[i].second);
  }
  svg += format(
      "<path class=\"series\" data-run=\"%s\" data-series=\"%s\" data-points=\"%zu\" "
      "clip-path=\"url(#clip%d)\" fill=\"none\" stroke=\"%s\" stroke-width=\"%s\" "
      "stroke-linecap=\"round\" stroke-linejoin=\"round\"%s d=\"%s\"/>\n",
      xml_escape(s.run).c_str(), xml_escape(s.name).c_str(), finite, clip_id, color(s.color),
      s.markers ? "5" : "1.6", s.dashed ? " stroke-dasharray=\"6 4\"" : "", d.c_str());
  svg += dots;
  if (gaps == 0 || s.markers) return;
  // Where the value was missing: a short tick down from the top of the panel.
  std::string marks;
  for (size_t i = 0; i < s.x.size(); ++i)
    if (!visible(s.y[i], f.y.log) && std::isfinite(s.x[i]))
      marks += "M" + coord(f.px(s.x[i])) + "," + coord(f.top) + "v7";
  svg += format(
      "<path class=\"gaps\" data-run=\"%s\" data-series=\"%s\" data-points=\"%zu\" "
      "stroke=\"%s\" stroke-width=\"1.5\" d=\"%s\"/>\n",
      xml_escape(s.run).c_str(), xml_escape(s.name).c_str(), gaps, color(s.color), marks.c_str());
}

// The y axis of a panel from its finite values.
Axis y_axis(const Panel &p) {
  double lo = std::numeric_limits<double>::infinity(), hi = -lo;
  for (const auto &s : p.series)
    for (const double y : s.y)
      if (visible(y, p.log_y)) {
        lo = std::min(lo, y);
        hi = std::max(hi, y);
      }
  if (!std::isfinite(lo)) return p.log_y ? log_axis(1, 10) : linear_axis(0, 1, true);
  if (p.log_y) return log_axis(lo, hi);
  if (p.from_zero) {
    lo = std::min(lo, 0.0);
    if (hi <= 0) hi = 1;
  }
  return linear_axis(lo, hi, true);
}

size_t visible_points(const Panel &p) {
  size_t n = 0;
  for (const auto &s : p.series)
    for (const double y : s.y) n += visible(y, p.log_y);
  return n;
}

}  // namespace

std::string render(const Chart &chart) {
  const double plot_width = chart.width - kLeft - kRight;

  // The x axis: every series' x range, ticks at whole numbers when x counts.
  double xlo = std::numeric_limits<double>::infinity(), xhi = -xlo;
  for (const auto &p : chart.panels)
    for (const auto &s : p.series)
      for (const double x : s.x)
        if (std::isfinite(x)) {
          xlo = std::min(xlo, x);
          xhi = std::max(xhi, x);
        }
  if (!std::isfinite(xlo)) xlo = 0, xhi = 1;
  if (xhi - xlo < 1) xlo -= 0.5, xhi += 0.5;
  Axis xaxis = linear_axis(xlo, xhi, false, std::max(2, static_cast<int>(plot_width / 110)));
  if (xaxis.step < 1) {  // steps are integers: no tick between two of them
    xaxis.step = 1;
    xaxis.ticks.clear();
    for (double t = std::ceil(xlo); t <= xhi; t += 1) xaxis.ticks.push_back(t);
  }

  // Legend rows: entries flow left to right and wrap.
  struct Entry {
    double x;
    int row;
  };
  std::vector<Entry> entries;
  double at = kLeft;
  int row = 0;
  for (const auto &name : chart.legend) {
    const double w = 30 + kCharWidth * static_cast<double>(name.size()) + 18;
    if (at > kLeft && at + w > chart.width - kRight) {
      at = kLeft;
      ++row;
    }
    entries.push_back({at, row});
    at += w;
  }
  const int legend_rows = chart.legend.empty() ? 0 : row + 1;

  const int top = (chart.title.empty() ? 12 : kTitleHeight) + legend_rows * kLegendRow + 6;
  const int panels = static_cast<int>(chart.panels.size());
  const int panels_height = panels * (kHeading + kPlotHeight) + std::max(0, panels - 1) * kPanelGap;
  const int height = top + panels_height + kXLabels + kXTitle +
                     static_cast<int>(chart.notes.size()) * kNoteRow + kBottom;

  std::string svg;
  svg += format(
      "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
      "viewBox=\"0 0 %d %d\" font-family=\"DejaVu Sans, Helvetica, Arial, sans-serif\" "
      "font-size=\"12\">\n"
      "<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
      chart.width, height, chart.width, height);
  if (!chart.title.empty())
    svg += format("<text class=\"title\" x=\"%d\" y=\"22\" font-size=\"16\" "
                     "font-weight=\"bold\">%s</text>\n",
                     kLeft, xml_escape(chart.title).c_str());

  const int legend_top = chart.title.empty() ? 12 : kTitleHeight;
  for (size_t i = 0; i < chart.legend.size(); ++i) {
    const double y = legend_top + entries[i].row * kLegendRow + 8;
    svg += format(
        "<g class=\"legend\" data-run=\"%s\"><line x1=\"%s\" y1=\"%s\" x2=\"%s\" y2=\"%s\" "
        "stroke=\"%s\" stroke-width=\"3\"/><text x=\"%s\" y=\"%s\">%s</text></g>\n",
        xml_escape(chart.legend[i]).c_str(), coord(entries[i].x).c_str(), coord(y).c_str(),
        coord(entries[i].x + 22).c_str(), coord(y).c_str(), color(static_cast<int>(i)),
        coord(entries[i].x + 28).c_str(), coord(y + 4).c_str(),
        xml_escape(chart.legend[i]).c_str());
  }

  double y0 = top;
  for (int pi = 0; pi < panels; ++pi) {
    const Panel &p = chart.panels[static_cast<size_t>(pi)];
    Frame f{kLeft, y0 + kHeading, plot_width, kPlotHeight, xaxis, y_axis(p)};
    svg += format("<g class=\"panel\" data-heading=\"%s\">\n", xml_escape(p.heading).c_str());
    svg += format("<text x=\"%d\" y=\"%s\" font-weight=\"bold\">%s</text>\n", kLeft,
                     coord(y0 + kHeading - 7).c_str(), xml_escape(p.heading).c_str());
    svg += format("<clipPath id=\"clip%d\"><rect x=\"%s\" y=\"%s\" width=\"%s\" "
                     "height=\"%s\"/></clipPath>\n",
                     pi, coord(f.left - 3).c_str(), coord(f.top - 3).c_str(),
                     coord(f.width + 6).c_str(), coord(f.height + 6).c_str());

    // Grid and tick labels.
    std::string grid;
    for (const double t : f.y.ticks) {
      const double y = f.py(t);
      grid += "M" + coord(f.left) + "," + coord(y) + "H" + coord(f.left + f.width);
      svg += format("<text x=\"%s\" y=\"%s\" text-anchor=\"end\" fill=\"#333\">%s</text>\n",
                       coord(f.left - 6).c_str(), coord(y + 4).c_str(),
                       tick_label(t, f.y.step, p.format).c_str());
    }
    for (const double t : f.x.ticks) {
      const double x = f.px(t);
      grid += "M" + coord(x) + "," + coord(f.top) + "V" + coord(f.top + f.height);
      if (pi == panels - 1)
        svg += format(
            "<text x=\"%s\" y=\"%s\" text-anchor=\"middle\" fill=\"#333\">%s</text>\n",
            coord(x).c_str(), coord(f.top + f.height + 15).c_str(),
            tick_label(t, f.x.step, Format::Plain).c_str());
    }
    svg += "<path class=\"grid\" stroke=\"#e6e6e6\" stroke-width=\"1\" d=\"" + grid + "\"/>\n";
    svg += format("<rect class=\"frame\" x=\"%s\" y=\"%s\" width=\"%s\" height=\"%s\" "
                     "fill=\"none\" stroke=\"#999\"/>\n",
                     coord(f.left).c_str(), coord(f.top).c_str(), coord(f.width).c_str(),
                     coord(f.height).c_str());

    if (visible_points(p) == 0 && !p.empty_note.empty())
      svg += format("<text class=\"empty\" x=\"%s\" y=\"%s\" text-anchor=\"middle\" "
                       "fill=\"#777\">%s</text>\n",
                       coord(f.left + f.width / 2).c_str(), coord(f.top + f.height / 2).c_str(),
                       xml_escape(p.empty_note).c_str());
    for (const auto &s : p.series) draw_series(svg, s, f, pi);
    svg += "</g>\n";
    y0 += kHeading + kPlotHeight + kPanelGap;
  }

  const double bottom = top + panels_height + kXLabels;
  svg += format("<text class=\"x-label\" x=\"%s\" y=\"%s\" text-anchor=\"middle\">%s</text>\n",
                   coord(kLeft + plot_width / 2).c_str(), coord(bottom + 16).c_str(),
                   xml_escape(chart.x_label).c_str());
  for (size_t i = 0; i < chart.notes.size(); ++i)
    svg += format("<text class=\"note\" x=\"%d\" y=\"%s\" fill=\"#555\">%s</text>\n", kLeft,
                     coord(bottom + kXTitle + 12 + static_cast<double>(i) * kNoteRow).c_str(),
                     xml_escape(chart.notes[i]).c_str());
  svg += "</svg>\n";
  return svg;
}

}  // namespace ctr_tool::svg
