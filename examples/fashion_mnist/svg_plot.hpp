#pragma once
// A tiny SVG line-plot writer: stacked panels of line series with axes, ticks and a legend.
// Enough for the demo's loss curves; no dependency, output viewable in any browser.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdio>
#include <iterator>
#include <limits>
#include <string>
#include <string_view>
#include <vector>

namespace fashion_mnist::svg {

/// One line: points (x[i], y[i]); non-finite points (and non-positive ones on a log axis) break
/// the line instead of distorting it.
struct Series {
  std::string name;
  std::vector<double> x;
  std::vector<double> y;
};

/// One plot area with its own axes.
struct Panel {
  std::string title;
  std::string x_label;
  std::string y_label;
  bool log_y = false;
  std::string note;  // a line of small text under the title
  std::vector<Series> series;
};

/// Panels stacked vertically under a title. Series keep their colour by index across panels.
struct Figure {
  std::string title;
  std::vector<Panel> panels;
  double width = 860;
  double panel_height = 300;
};

/// Escapes the five XML special characters.
inline std::string escape(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (const char c : text) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      case '\'':
        out += "&apos;";
        break;
      default:
        out += c;
    }
  }
  return out;
}

/// Round tick positions (1, 2 or 5 times a power of ten apart) covering [lo, hi], about
/// `target` of them. A degenerate or non-finite range gives no ticks.
inline std::vector<double> nice_ticks(double lo, double hi, int target = 5) {
  std::vector<double> ticks;
  if (!std::isfinite(lo) || !std::isfinite(hi) || !(hi > lo) || target < 1) {
    return ticks;
  }
  const double raw = (hi - lo) / target;
  const double magnitude = std::pow(10.0, std::floor(std::log10(raw)));
  double step = magnitude;
  for (const double factor : {1.0, 2.0, 5.0, 10.0}) {
    step = factor * magnitude;
    if (step >= raw) {
      break;
    }
  }
  // Index-based so that accumulated rounding cannot add or drop a tick; tiny values snap to 0.
  const double first = std::ceil(lo / step - 1e-9);
  const double last = std::floor(hi / step + 1e-9);
  for (double i = first; i <= last; i += 1.0) {
    const double tick = i * step;
    ticks.push_back(std::abs(tick) < step * 1e-9 ? 0.0 : tick);
  }
  return ticks;
}

/// A tick label: up to 4 significant digits, no trailing zeros ("0.5", "2000", "1e+05").
inline std::string format_number(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.4g", value);
  return text;
}

/// Exponential moving average with bias correction (TensorBoard's smoothing): weight 0 is the
/// raw series, weight close to 1 a strong smoothing. Non-finite values are passed through
/// and do not enter the average.
inline std::vector<double> smooth_ema(const std::vector<double>& values, double weight) {
  std::vector<double> out;
  out.reserve(values.size());
  double average = 0;
  double correction = 0;
  for (const double value : values) {
    if (!std::isfinite(value)) {
      out.push_back(value);
      continue;
    }
    average = weight * average + (1 - weight) * value;
    correction = weight * correction + (1 - weight);
    out.push_back(average / correction);
  }
  return out;
}

/// At most `max_points` points, evenly spaced in index, always keeping the first and the last.
inline Series downsample(const Series& series, std::size_t max_points) {
  const std::size_t n = std::min(series.x.size(), series.y.size());
  if (n <= max_points || max_points < 2) {
    return series;
  }
  Series out{series.name, {}, {}};
  for (std::size_t k = 0; k < max_points; ++k) {
    const std::size_t i = k * (n - 1) / (max_points - 1);
    out.x.push_back(series.x[i]);
    out.y.push_back(series.y[i]);
  }
  return out;
}

namespace detail {

inline constexpr const char* kPalette[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd",
                                           "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f"};

struct Range {
  double lo = std::numeric_limits<double>::infinity();
  double hi = -std::numeric_limits<double>::infinity();
  void add(double v) {
    lo = std::min(lo, v);
    hi = std::max(hi, v);
  }
  [[nodiscard]] bool empty() const { return !(hi >= lo); }
};

inline bool usable(double value, bool log) { return std::isfinite(value) && (!log || value > 0); }

inline std::string fixed(double value) {
  char text[32];
  std::snprintf(text, sizeof text, "%.1f", value);
  return text;
}

inline void render_panel(std::string& out, const Panel& panel, double top, double width,
                         double height) {
  constexpr double kLeft = 72;
  constexpr double kRight = 24;
  constexpr double kTop = 48;
  constexpr double kBottom = 46;
  const double x0 = kLeft;
  const double x1 = width - kRight;
  const double y0 = top + height - kBottom;  // screen y of the bottom axis
  const double y1 = top + kTop;

  Range xr;
  Range yr;
  for (const auto& s : panel.series) {
    const std::size_t n = std::min(s.x.size(), s.y.size());
    for (std::size_t i = 0; i < n; ++i) {
      if (std::isfinite(s.x[i]) && usable(s.y[i], panel.log_y)) {
        xr.add(s.x[i]);
        yr.add(panel.log_y ? std::log10(s.y[i]) : s.y[i]);
      }
    }
  }
  if (xr.empty()) {
    xr = {0, 1};
  }
  if (xr.hi == xr.lo) {
    xr = {xr.lo - 1, xr.hi + 1};
  }
  std::vector<double> y_ticks;
  if (yr.empty()) {
    yr = {0, 1};
  }
  if (panel.log_y) {
    yr = {std::floor(yr.lo), std::ceil(yr.hi)};
    if (yr.hi == yr.lo) {
      yr = {yr.lo - 1, yr.hi + 1};
    }
    const double span = yr.hi - yr.lo;
    const double every = std::max(1.0, std::ceil(span / 8));
    for (double e = yr.lo; e <= yr.hi + 1e-9; e += every) {
      y_ticks.push_back(e);
    }
  } else {
    const double pad =
        yr.hi > yr.lo ? 0.05 * (yr.hi - yr.lo) : std::max(1.0, std::abs(yr.lo) * 0.1);
    yr = {yr.lo - pad, yr.hi + pad};
    y_ticks = nice_ticks(yr.lo, yr.hi, 5);
  }
  const auto sx = [&](double x) { return x0 + (x - xr.lo) / (xr.hi - xr.lo) * (x1 - x0); };
  const auto sy = [&](double y) { return y0 - (y - yr.lo) / (yr.hi - yr.lo) * (y0 - y1); };

  out += "<g>\n";
  out += "<text x=\"" + fixed(x0) + "\" y=\"" + fixed(top + 22) +
         "\" font-size=\"15\" font-weight=\"bold\">" + escape(panel.title) + "</text>\n";
  if (!panel.note.empty()) {
    out += "<text x=\"" + fixed(x0) + "\" y=\"" + fixed(top + 38) +
           "\" font-size=\"11\" fill=\"#555\">" + escape(panel.note) + "</text>\n";
  }
  out += "<rect x=\"" + fixed(x0) + "\" y=\"" + fixed(y1) + "\" width=\"" + fixed(x1 - x0) +
         "\" height=\"" + fixed(y0 - y1) + "\" fill=\"none\" stroke=\"#333\"/>\n";
  for (const double t : y_ticks) {
    const double y = sy(t);
    const std::string label = panel.log_y ? format_number(std::pow(10.0, t)) : format_number(t);
    out += "<line x1=\"" + fixed(x0) + "\" y1=\"" + fixed(y) + "\" x2=\"" + fixed(x1) + "\" y2=\"" +
           fixed(y) + "\" stroke=\"#ddd\"/>\n";
    out += "<text x=\"" + fixed(x0 - 6) + "\" y=\"" + fixed(y + 4) +
           "\" font-size=\"11\" text-anchor=\"end\">" + label + "</text>\n";
  }
  for (const double t : nice_ticks(xr.lo, xr.hi, 8)) {
    const double x = sx(t);
    out += "<line x1=\"" + fixed(x) + "\" y1=\"" + fixed(y0) + "\" x2=\"" + fixed(x) + "\" y2=\"" +
           fixed(y0 + 5) + "\" stroke=\"#333\"/>\n";
    out += "<text x=\"" + fixed(x) + "\" y=\"" + fixed(y0 + 18) +
           "\" font-size=\"11\" text-anchor=\"middle\">" + format_number(t) + "</text>\n";
  }
  out += "<text x=\"" + fixed((x0 + x1) / 2) + "\" y=\"" + fixed(y0 + 36) +
         "\" font-size=\"12\" text-anchor=\"middle\">" + escape(panel.x_label) + "</text>\n";
  out += "<text transform=\"translate(" + fixed(18) + "," + fixed((y0 + y1) / 2) +
         ") rotate(-90)\" font-size=\"12\" text-anchor=\"middle\">" + escape(panel.y_label) +
         "</text>\n";

  for (std::size_t k = 0; k < panel.series.size(); ++k) {
    const Series& s = panel.series[k];
    const std::string colour = kPalette[k % std::size(kPalette)];
    const std::size_t n = std::min(s.x.size(), s.y.size());
    std::string points;
    const auto flush = [&] {
      if (!points.empty()) {
        out += "<polyline fill=\"none\" stroke=\"" + colour +
               "\" stroke-width=\"1.6\" stroke-linejoin=\"round\" points=\"" + points + "\"/>\n";
        points.clear();
      }
    };
    for (std::size_t i = 0; i < n; ++i) {
      if (!std::isfinite(s.x[i]) || !usable(s.y[i], panel.log_y)) {
        flush();
        continue;
      }
      const double y = panel.log_y ? std::log10(s.y[i]) : s.y[i];
      if (!points.empty()) {
        points += ' ';
      }
      points += fixed(sx(s.x[i]));
      points += ',';
      points += fixed(sy(y));
    }
    flush();
  }
  // Legend, top right inside the plot area, on a backing that keeps it readable over lines.
  if (!panel.series.empty()) {
    out += "<rect x=\"" + fixed(x1 - 198) + "\" y=\"" + fixed(y1 + 4) +
           "\" width=\"192\" height=\"" + fixed(16 * static_cast<double>(panel.series.size()) + 6) +
           "\" fill=\"white\" fill-opacity=\"0.85\" stroke=\"#ccc\"/>\n";
  }
  for (std::size_t k = 0; k < panel.series.size(); ++k) {
    const std::string colour = kPalette[k % std::size(kPalette)];
    const double ly = y1 + 20 + 16 * static_cast<double>(k);
    out += "<line x1=\"" + fixed(x1 - 190) + "\" y1=\"" + fixed(ly - 4) + "\" x2=\"" +
           fixed(x1 - 168) + "\" y2=\"" + fixed(ly - 4) + "\" stroke=\"" + colour +
           "\" stroke-width=\"2.5\"/>\n";
    out += "<text x=\"" + fixed(x1 - 162) + "\" y=\"" + fixed(ly) + "\" font-size=\"12\">" +
           escape(panel.series[k].name) + "</text>\n";
  }
  out += "</g>\n";
}

}  // namespace detail

/// The SVG document of a figure.
inline std::string render(const Figure& figure) {
  constexpr double kTitle = 34;
  const double height = kTitle + figure.panel_height * static_cast<double>(figure.panels.size());
  std::string out = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n";
  out += "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" + detail::fixed(figure.width) +
         "\" height=\"" + detail::fixed(height) + "\" viewBox=\"0 0 " +
         detail::fixed(figure.width) + " " + detail::fixed(height) +
         "\" font-family=\"sans-serif\">\n";
  out += "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  out += "<text x=\"" + detail::fixed(figure.width / 2) +
         "\" y=\"24\" font-size=\"17\" font-weight=\"bold\" text-anchor=\"middle\">" +
         escape(figure.title) + "</text>\n";
  for (std::size_t p = 0; p < figure.panels.size(); ++p) {
    detail::render_panel(out, figure.panels[p],
                         kTitle + figure.panel_height * static_cast<double>(p), figure.width,
                         figure.panel_height);
  }
  out += "</svg>\n";
  return out;
}

}  // namespace fashion_mnist::svg
