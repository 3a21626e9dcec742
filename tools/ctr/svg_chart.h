// Line charts as SVG text: stacked panels over one shared x axis (see svg_chart.cc).
//
// Used by `ctr plot`; it knows nothing of metrics files. Every drawn series is one
// <path> carrying class="series" and data-run / data-series / data-points
// attributes, so a test (or a script) can find what was drawn without rendering.
#pragma once

#include <string>
#include <vector>

namespace ctr_tool::svg {

struct Series {
  std::string run;   // the legend entry it belongs to (data-run)
  std::string name;  // what it shows (data-series)
  int color = 0;     // index into the palette; cycles past its end
  bool dashed = false;
  bool markers = false;  // a dot per point instead of a line
  // Points in x order; a non-finite y is a gap in the line (and, on a log
  // axis, so is a y <= 0).
  std::vector<double> x, y;
};

enum class Format { Plain, Human, Percent };  // 0.25; 12.5k; 25% (of a fraction)

struct Panel {
  std::string heading;  // above the panel, with its unit
  bool log_y = false;
  bool from_zero = false;  // the y axis starts at 0 (rates, fractions)
  Format format = Format::Plain;
  std::vector<Series> series;
  std::string empty_note;  // shown in the panel when no series has a finite point
};

struct Chart {
  std::string title, x_label;
  std::vector<std::string> legend;  // entry i is drawn in palette colour i
  std::vector<std::string> notes;   // lines under the chart
  std::vector<Panel> panels;
  int width = 960;
};

// The chart as a standalone SVG document.
std::string render(const Chart &chart);

// Ticks at round values (1, 2 or 5 times a power of ten) covering [lo, hi];
// about `target` of them. With snap, the returned bounds are widened to the
// outer ticks; otherwise the ticks lie within [lo, hi].
struct Axis {
  double lo = 0, hi = 1;
  bool log = false;
  double step = 1;  // between linear ticks (for label precision)
  std::vector<double> ticks;
};
Axis linear_axis(double lo, double hi, bool snap, int target = 5);
// A log10 axis over [lo, hi] (both > 0): decades and, when few, 2 and 5 between
// them; under one decade, round linear values placed logarithmically.
Axis log_axis(double lo, double hi);

// A tick label for value v on an axis whose ticks are `step` apart.
std::string tick_label(double v, double step, Format format);

// Text made safe for SVG character data and attribute values.
std::string xml_escape(const std::string &s);

}  // namespace ctr_tool::svg
