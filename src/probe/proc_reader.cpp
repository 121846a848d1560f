#include "probe/proc_reader.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <linux/kcmp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>
#include <vector>

#include "detail/decimal.hpp"
#include "detail/fd.hpp"

namespace forkguard::probe::detail {
namespace {

std::string proc_path(pid_t pid, const char* leaf) {
  return "/proc/" + std::to_string(pid) + "/" + leaf;
}

// Whole-file read (procfs files report size 0, so read until EOF).
std::optional<std::string> read_file(const std::string& path, ProcReadError* error) {
  forkguard::detail::UniqueFd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (!fd) {
    *error = {errno, path};
    return std::nullopt;
  }
  std::string out;
  char buf[16384];
  while (true) {
    ssize_t n = ::read(fd.get(), buf, sizeof buf);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      *error = {errno, path};
      return std::nullopt;
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

std::optional<std::vector<std::string>> list_dir(const std::string& path, ProcReadError* error) {
  DIR* dir = ::opendir(path.c_str());
  if (dir == nullptr) {
    *error = {errno, path};
    return std::nullopt;
  }
  std::vector<std::string> names;
  while (dirent* e = ::readdir(dir)) {
    if (e->d_name[0] != '.') names.emplace_back(e->d_name);
  }
  ::closedir(dir);
  return names;
}

}  // namespace

std::string strip_deleted(std::string s) {
  constexpr std::string_view kDeleted = " (deleted)";
  if (s.size() > kDeleted.size() &&
      s.compare(s.size() - kDeleted.size(), kDeleted.size(), kDeleted.data()) == 0) {
    s.resize(s.size() - kDeleted.size());
  }
  return s;
}

namespace {

// One line of /proc/PID/maps, "start-end perms offset dev inode [path]", split where it matters.
struct MapsLine {
  std::string_view range;
  std::string_view perms;
  std::string_view path;  // empty unless it starts with '/'
};

MapsLine split_maps_line(std::string_view line) {
  MapsLine m;
  // The path starts at the first '/' after 5 fields.
  size_t field = 0, i = 0;
  while (i < line.size() && field < 5) {
    const size_t start = i;
    while (i < line.size() && line[i] != ' ') ++i;
    if (field == 0) m.range = line.substr(start, i - start);
    if (field == 1) m.perms = line.substr(start, i - start);
    while (i < line.size() && line[i] == ' ') ++i;
    ++field;
  }
  if (i < line.size() && line[i] == '/') m.path = line.substr(i);
  return m;
}

template <typename F>
void for_each_line(std::string_view text, F&& f) {
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\n', pos);
    if (end == std::string_view::npos) end = text.size();
    f(text.substr(pos, end - pos));
    pos = end + 1;
  }
}

// Hex digits, whole, in range (an optional "0x" first); nullopt otherwise.
std::optional<std::uintptr_t> parse_hex(std::string_view s) {
  if (s.size() > 2 && s[0] == '0' && (s[1] == 'x' || s[1] == 'X')) s.remove_prefix(2);
  std::uintptr_t v = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v, 16);
  if (s.empty() || ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return v;
}

}  // namespace

std::vector<std::string> parse_maps(std::string_view text) {
  std::vector<std::string> paths;
  for_each_line(text, [&](std::string_view line) {
    auto m = split_maps_line(line);
    if (m.path.empty()) return;
    std::string p = strip_deleted(std::string(m.path));
    if (paths.empty() || paths.back() != p) paths.push_back(std::move(p));
  });
  return paths;
}

std::vector<ExecMapping> parse_exec_mappings(std::string_view text) {
  std::vector<ExecMapping> out;
  for_each_line(text, [&](std::string_view line) {
    auto m = split_maps_line(line);
    if (m.path.empty() || m.perms.size() < 3 || m.perms[2] != 'x') return;
    const size_t dash = m.range.find('-');
    if (dash == std::string_view::npos) return;
    auto start = parse_hex(m.range.substr(0, dash));
    auto end = parse_hex(m.range.substr(dash + 1));
    if (!start || !end || *end <= *start) return;
    out.push_back({*start, *end, strip_deleted(std::string(m.path))});
  });
  return out;
}

std::optional<ThreadSyscall> parse_syscall(std::string_view text) {
  while (!text.empty() && (text.back() == '\n' || text.back() == ' ')) text.remove_suffix(1);
  if (text == "running") return ThreadSyscall{.running = true, .nr = -1, .pc = 0};
  std::vector<std::string_view> fields;
  for (size_t pos = 0; pos < text.size() && fields.size() <= 9;) {
    size_t end = std::min(text.find(' ', pos), text.size());
    if (end == pos) return std::nullopt;  // the kernel writes single spaces
    fields.push_back(text.substr(pos, end - pos));
    pos = end + 1;
  }
  // "NR SP PC" when blocked outside a system call (NR -1), "NR ARG1..ARG6 SP PC" inside one.
  if (fields.size() != 3 && fields.size() != 9) return std::nullopt;
  auto nr = forkguard::detail::parse_decimal<long>(fields[0]);
  if (!nr || (fields.size() == 3) != (*nr < 0)) return std::nullopt;
  std::optional<std::uintptr_t> pc;
  for (size_t i = 1; i < fields.size(); ++i) {
    if (fields[i].substr(0, 2) != "0x") return std::nullopt;
    pc = parse_hex(fields[i]);
    if (!pc) return std::nullopt;
  }
  return ThreadSyscall{.running = false, .nr = *nr, .pc = *pc};
}

std::optional<ProcStat> parse_stat(std::string_view text) {
  // "pid (comm) state ppid pgrp session tty_nr tpgid flags ...": comm may hold spaces and
  // parentheses; the fields are read after the last ')', each whole and in range.
  const size_t open = text.find('(');
  const size_t close = text.rfind(')');
  if (open == std::string_view::npos || close == std::string_view::npos || close < open) {
    return std::nullopt;
  }
  std::vector<std::string_view> fields;
  for (size_t pos = close + 1; pos < text.size() && fields.size() < 7;) {
    while (pos < text.size() && text[pos] == ' ') ++pos;
    size_t end = std::min(text.find(' ', pos), text.size());
    if (end > pos) fields.push_back(text.substr(pos, end - pos));
    pos = end;
  }
  // state ppid pgrp session tty_nr tpgid flags; a line cut after the parent still names it
  if (fields.size() < 2 || fields[0].size() != 1) return std::nullopt;
  auto parent = forkguard::detail::parse_decimal<pid_t>(fields[1]);
  auto flags = fields.size() == 7 ? forkguard::detail::parse_decimal<unsigned>(fields[6])
                                  : std::optional<unsigned>(0);
  if (!parent || !flags) return std::nullopt;
  ProcStat s;
  s.comm = std::string(text.substr(open + 1, close - open - 1));
  s.state = fields[0][0];
  s.parent = *parent;
  s.flags = *flags;
  return s;
}

std::optional<pid_t> parse_stat_parent(std::string_view text) {
  auto s = parse_stat(text);
  if (!s) return std::nullopt;
  return s->parent;
}

std::vector<std::string> parse_environ(std::string_view text) {
  std::vector<std::string> vars;
  size_t pos = 0;
  while (pos < text.size()) {
    size_t end = text.find('\0', pos);
    if (end == std::string_view::npos) end = text.size();
    if (end > pos) vars.emplace_back(text.substr(pos, end - pos));
    pos = end + 1;
  }
  return vars;
}

std::optional<std::vector<std::string>> mapped_paths(pid_t pid, ProcReadError* error) {
  auto text = read_file(proc_path(pid, "maps"), error);
  if (!text) return std::nullopt;
  return parse_maps(*text);
}

std::optional<Maps> maps_of(pid_t pid, ProcReadError* error) {
  auto text = read_file(proc_path(pid, "maps"), error);
  if (!text) return std::nullopt;
  return Maps{parse_maps(*text), parse_exec_mappings(*text)};
}

std::optional<std::vector<OpenFile>> open_files(pid_t pid, ProcReadError* error) {
  const std::string dir = proc_path(pid, "fd");
  auto names = list_dir(dir, error);
  if (!names) return std::nullopt;
  std::vector<OpenFile> files;
  for (const auto& n : *names) {
    char buf[4096];
    std::string link = dir + "/" + n;
    ssize_t len = ::readlink(link.c_str(), buf, sizeof buf - 1);
    if (len < 0) continue;  // closed while we looked
    const auto fd = forkguard::detail::parse_decimal<int>(n);
    if (!fd) continue;  // not an fd
    files.push_back({*fd, strip_deleted(std::string(buf, static_cast<size_t>(len)))});
  }
  return files;
}

std::optional<std::vector<std::string>> thread_names(pid_t pid, ProcReadError* error) {
  const std::string dir = proc_path(pid, "task");
  auto tids = list_dir(dir, error);
  if (!tids) return std::nullopt;
  std::vector<std::string> names;
  for (const auto& tid : *tids) {
    ProcReadError ignored;
    auto comm = read_file(dir + "/" + tid + "/comm", &ignored);
    if (!comm) continue;  // the thread exited while we looked
    while (!comm->empty() && comm->back() == '\n') comm->pop_back();
    names.push_back(std::move(*comm));
  }
  return names;
}

std::optional<std::vector<Thread>> threads_of(pid_t pid, ProcReadError* error) {
  const std::string dir = proc_path(pid, "task");
  auto tids = list_dir(dir, error);
  if (!tids) return std::nullopt;
  std::vector<Thread> threads;
  for (const auto& name : *tids) {
    auto tid = forkguard::detail::parse_decimal<pid_t>(name);
    if (!tid) continue;
    ProcReadError ignored;
    auto comm = read_file(dir + "/" + name + "/comm", &ignored);
    if (!comm) continue;  // the thread exited while we looked
    while (!comm->empty() && comm->back() == '\n') comm->pop_back();
    threads.push_back({*tid, std::move(*comm)});
  }
  return threads;
}

std::optional<std::vector<pid_t>> thread_ids(pid_t pid, ProcReadError* error) {
  auto names = list_dir(proc_path(pid, "task"), error);
  if (!names) return std::nullopt;
  std::vector<pid_t> tids;
  for (const auto& name : *names) {
    if (auto tid = forkguard::detail::parse_decimal<pid_t>(name)) tids.push_back(*tid);
  }
  return tids;
}

std::vector<ThreadState> thread_states(pid_t pid, const std::vector<pid_t>& tids, bool settle,
                                       int* rounds, bool (*known)(pid_t)) {
  std::vector<ThreadState> states;
  states.reserve(tids.size());
  auto is_running = [known](const ThreadState& t) {
    return t.syscall && t.syscall->running && !(known != nullptr && known(t.tid));
  };
  for (pid_t tid : tids) {
    ThreadState t;
    t.tid = tid;
    t.syscall = thread_syscall(pid, tid, &t.error);
    states.push_back(std::move(t));
  }
  int taken = 0;
  while (settle && taken < kSettleRounds && std::any_of(states.begin(), states.end(), is_running)) {
    std::this_thread::sleep_for(std::chrono::milliseconds(kSettlePauseMs));
    ++taken;
    for (auto& t : states) {
      if (!is_running(t)) continue;
      ProcReadError err;
      auto again = thread_syscall(pid, t.tid, &err);
      if (again) t.syscall = again;  // a thread that exited meanwhile keeps what was seen
    }
  }
  if (rounds != nullptr) *rounds = taken;
  return states;
}

std::optional<ThreadSyscall> thread_syscall(pid_t pid, pid_t tid, ProcReadError* error) {
  const std::string path =
      "/proc/" + std::to_string(pid) + "/task/" + std::to_string(tid) + "/syscall";
  auto text = read_file(path, error);
  if (!text) return std::nullopt;
  auto s = parse_syscall(*text);
  if (!s) *error = {EINVAL, path};
  return s;
}

std::optional<ProcStat> stat_of(pid_t pid, ProcReadError* error) {
  auto stat = read_file(proc_path(pid, "stat"), error);
  if (!stat) return std::nullopt;
  auto s = parse_stat(*stat);
  if (!s) *error = {EINVAL, proc_path(pid, "stat")};
  return s;
}

std::optional<pid_t> parent_of(pid_t pid, ProcReadError* error) {
  auto s = stat_of(pid, error);
  if (!s) return std::nullopt;
  return s->parent;
}

std::optional<std::vector<std::string>> environment_of(pid_t pid, ProcReadError* error) {
  auto text = read_file(proc_path(pid, "environ"), error);
  if (!text) return std::nullopt;
  return parse_environ(*text);
}

int same_file_description(pid_t a, int fd_a, pid_t b, int fd_b) {
  long r = ::syscall(SYS_kcmp, a, b, KCMP_FILE, fd_a, fd_b);
  if (r < 0) return -errno;
  return r == 0 ? 1 : 0;
}

}  // namespace forkguard::probe::detail
