#pragma once
// A one-line progress bar with ETA for a terminal; where the stream is not a terminal (a log, CI)
// it stays silent and only the caller's per-epoch lines appear, so logs do not fill with '\r'.

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <ostream>
#include <string>
#include <string_view>
#include <utility>

namespace fashion_mnist {

/// "m:ss" under an hour, "h:mm:ss" above; "--:--" for an unknown (negative or non-finite) time.
inline std::string format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) {
    return "--:--";
  }
  const auto total = static_cast<long long>(std::llround(seconds));
  const long long hours = total / 3600;
  const long long minutes = (total / 60) % 60;
  const long long secs = total % 60;
  char text[32];
  if (hours > 0) {
    std::snprintf(text, sizeof text, "%lld:%02lld:%02lld", hours, minutes, secs);
  } else {
    std::snprintf(text, sizeof text, "%lld:%02lld", minutes, secs);
  }
  return text;
}

/// Seconds left at the average rate so far; -1 (unknown) before the first unit is done.
inline double eta_seconds(double elapsed, std::int64_t done, std::int64_t total) {
  if (done <= 0 || total <= 0) {
    return -1.0;
  }
  if (done >= total) {
    return 0.0;
  }
  return elapsed * static_cast<double>(total - done) / static_cast<double>(done);
}

/// "[#####-----]": `width` cells, filled in proportion to done/total (clamped to [0, 1]).
inline std::string render_bar(std::int64_t done, std::int64_t total, int width) {
  const double fraction =
      total > 0 ? std::clamp(static_cast<double>(done) / static_cast<double>(total), 0.0, 1.0)
                : 0.0;
  const auto filled = static_cast<std::size_t>(fraction * width);
  const auto cells = static_cast<std::size_t>(std::max(width, 0));
  std::string bar = "[";
  bar.append(std::min(filled, cells), '#');
  bar.append(cells - std::min(filled, cells), '-');
  bar += ']';
  return bar;
}

/// The text of one progress line: label, bar, percentage, counts, status, elapsed and ETA.
inline std::string progress_line(std::string_view label, std::int64_t done, std::int64_t total,
                                 double elapsed, std::string_view status, int bar_width = 24) {
  const int percent =
      total > 0 ? static_cast<int>(100 * std::clamp(done, std::int64_t{0}, total) / total) : 0;
  std::string line(label);
  line += ' ';
  line += render_bar(done, total, bar_width);
  line += ' ';
  char numbers[64];
  std::snprintf(numbers, sizeof numbers, "%3d%% %lld/%lld", percent, static_cast<long long>(done),
                static_cast<long long>(total));
  line += numbers;
  if (!status.empty()) {
    line += " ";
    line += status;
  }
  line += ' ';
  line += format_duration(elapsed);
  line += " ETA ";
  line += format_duration(eta_seconds(elapsed, done, total));
  return line;
}

/// True when stderr is a terminal: the bar is drawn only there.
inline bool stderr_is_terminal() { return ::isatty(STDERR_FILENO) == 1; }

/// Draws a progress line on `out` (redrawn at most every 100 ms) when `interactive`; message()
/// prints a full line in both modes, clearing the bar first.
class ProgressBar {
 public:
  using Clock = std::chrono::steady_clock;

  ProgressBar(std::ostream& out, std::string label, std::int64_t total, bool interactive)
      : out_(out),
        label_(std::move(label)),
        total_(total),
        interactive_(interactive),
        start_(Clock::now()),
        last_draw_(start_ - std::chrono::seconds(1)) {}

  ProgressBar(const ProgressBar&) = delete;
  ProgressBar& operator=(const ProgressBar&) = delete;
  ~ProgressBar() { clear(); }

  /// `done` units of `total` are finished; `status` is shown after the counts (e.g. the loss).
  void update(std::int64_t done, std::string_view status) {
    if (!interactive_) {
      return;
    }
    const auto now = Clock::now();
    if (done < total_ && now - last_draw_ < std::chrono::milliseconds(100)) {
      return;
    }
    last_draw_ = now;
    // "\x1b[K" erases the rest of the previous, possibly longer, line.
    out_ << '\r' << progress_line(label_, done, total_, elapsed(), status) << "\x1b[K"
         << std::flush;
    drawn_ = true;
  }

  /// Prints `line` on a line of its own; the bar is redrawn by the next update().
  void message(std::string_view line) {
    clear();
    out_ << line << '\n' << std::flush;
  }

  /// Seconds since construction.
  [[nodiscard]] double elapsed() const {
    return std::chrono::duration<double>(Clock::now() - start_).count();
  }

 private:
  void clear() {
    if (drawn_) {
      out_ << "\r\x1b[K" << std::flush;
      drawn_ = false;
    }
  }

  std::ostream& out_;
  std::string label_;
  std::int64_t total_;
  bool interactive_;
  Clock::time_point start_;
  Clock::time_point last_draw_;
  bool drawn_ = false;
};

}  // namespace fashion_mnist
