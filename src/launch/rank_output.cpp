#include "launch/rank_output.hpp"

#include <fmt/format.h>

#include <algorithm>

namespace forkguard::launch::detail {

void RankOutput::line(std::string_view text, std::string& out) {
  if (o_.tail_lines > 0) {
    tail_.emplace_back(text);
    while (tail_.size() > o_.tail_lines) tail_.pop_front();
  }
  if (o_.prefix) fmt::format_to(std::back_inserter(out), "[rank{}]:", o_.rank);
  out.append(text);
  out += '\n';
}

void RankOutput::state(std::string_view text, std::string& out) {
  if (o_.prefix) fmt::format_to(std::back_inserter(out), "[rank{}]:", o_.rank);
  out.append(text);
  out += '\r';
}

void RankOutput::feed(std::string_view data, Clock::time_point now, std::string& out) {
  partial_.append(data);
  std::string_view buf(partial_);
  std::string_view latest;  // the last '\r'-ended state not followed by a line
  size_t pos = 0;
  for (;;) {
    size_t end = buf.find_first_of("\r\n", pos);
    if (end == std::string_view::npos) break;
    if (buf[end] == '\n') {
      line(buf.substr(pos, end - pos), out);
      latest = {};
      pos = end + 1;
    } else if (end + 1 == buf.size()) {
      break;  // a '\r' that may be the first half of "\r\n": decided by the next piece
    } else if (buf[end + 1] == '\n') {
      line(buf.substr(pos, end - pos), out);
      latest = {};
      pos = end + 2;
    } else {
      const bool shown = pos == 0 && end == shown_len_;  // the unfinished line shown already
      if (end > pos && !shown) latest = buf.substr(pos, end - pos);
      pos = end + 1;
    }
  }
  std::string_view unfinished = buf.substr(pos);
  if (!unfinished.empty() && unfinished.back() == '\r') unfinished.remove_suffix(1);
  const auto not_before = shown_at_ + kStateInterval;
  if (unfinished.size() > kMaxPartial) {
    line(unfinished, out);
    pos = buf.size();
    show_at_ = {};
  } else if (!unfinished.empty()) {
    pending_.assign(unfinished);
    pending_unfinished_ = true;
    show_at_ = std::max(now + kStateInterval, not_before);
  } else if (!latest.empty()) {
    pending_.assign(latest);
    pending_unfinished_ = false;
    show_at_ = std::max(now, not_before);
  } else if (pos > 0) {
    show_at_ = {};  // a line went out after the last state
  }
  if (pos > 0) shown_len_ = 0;
  partial_.erase(0, pos);
  show_due(now, out);
}

RankOutput::Clock::time_point RankOutput::show_due(Clock::time_point now, std::string& out) {
  if (show_at_ == Clock::time_point{} || show_at_ > now) return show_at_;
  state(pending_, out);
  shown_len_ = pending_unfinished_ ? pending_.size() : 0;
  shown_at_ = now;
  show_at_ = {};
  return show_at_;
}

void RankOutput::close(std::string& out) {
  std::string_view rest(partial_);
  if (!rest.empty() && rest.back() == '\r') rest.remove_suffix(1);
  if (!rest.empty()) {
    line(rest, out);
  } else if (show_at_ != Clock::time_point{} && !pending_.empty()) {
    line(pending_, out);  // the last '\r' state, not shown yet
  }
  show_at_ = {};
  partial_.clear();
  pending_.clear();
}

}  // namespace forkguard::launch::detail
