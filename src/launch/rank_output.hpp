// One rank's stdout or stderr as the console shows it: the same for `forkguard run` (C++) and
// `notebook_launch` (Python, through the native module), so a rank prints alike under both.
//
//   RankOutput out({.rank = 3, .prefix = true});
//   std::string text;
//   out.feed(bytes, Clock::now(), text);   // text: "[rank3]:a line\n", "[rank3]:42%\r", ...
//   auto next = out.show_due(Clock::now(), text);   // an unfinished line due to be shown
//   out.close(text);                                 // at EOF: the unfinished line as a line
//
// Lines go out as they end, prefixed. A progress bar that rewrites its line with '\r' (tqdm) is
// shown live: a '\r'-ended state at once, a line unfinished for kStateInterval then; both end
// with '\r' so the next state overwrites them on a terminal, at most one per kStateInterval (the
// latest). A line written in two quick pieces is shown once, whole. What is kept of an unfinished
// line is bounded (kMaxPartial, then it goes out as a line): memory stays flat whatever the rank
// writes. The last `tail_lines` lines are kept for failure reports.
//
// Thread-safety: none; one owner.
#pragma once

#include <chrono>
#include <cstddef>
#include <deque>
#include <string>
#include <string_view>

namespace forkguard::launch::detail {

class RankOutput {
 public:
  using Clock = std::chrono::steady_clock;
  static constexpr size_t kMaxPartial = 64 * 1024;
  static constexpr std::chrono::milliseconds kStateInterval{30};

  struct Options {
    int rank = 0;
    bool prefix = true;     // "[rankN]:" before every line and state
    size_t tail_lines = 0;  // lines kept for the failure report
  };

  RankOutput() = default;
  explicit RankOutput(Options options) : o_(options) {}

  // Appends to `out` what the console shows for `data` (complete lines; a '\r' state due now).
  void feed(std::string_view data, Clock::time_point now, std::string& out);
  // Appends the pending state if it is due by `now`; returns when the next one is due (the
  // epoch when none is pending).
  Clock::time_point show_due(Clock::time_point now, std::string& out);
  // End of the stream: an unfinished line (or a last '\r' state not shown yet) as a line.
  void close(std::string& out);

  const std::deque<std::string>& tail() const { return tail_; }

 private:
  void line(std::string_view text, std::string& out);
  void state(std::string_view text, std::string& out);

  Options o_;
  std::string partial_;  // the unfinished line
  std::string pending_;  // the state to show when show_at_ comes
  bool pending_unfinished_ = false;
  Clock::time_point show_at_{};  // epoch: nothing to show
  Clock::time_point shown_at_{};
  size_t shown_len_ = 0;  // bytes at the start of partial_ already shown as a state
  std::deque<std::string> tail_;
};

}  // namespace forkguard::launch::detail
