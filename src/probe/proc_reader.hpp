// Reads what /proc says about a process: mappings, open fds, threads, parent, environment.
#pragma once

#include <sys/types.h>

#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace forkguard::probe::detail {

struct OpenFile {
  int fd = -1;
  std::string target;  // readlink of /proc/PID/fd/N, " (deleted)" stripped
};

struct ProcReadError {
  int err = 0;       // errno
  std::string path;  // what failed to open
};

// Each returns nullopt and fills *error when the file cannot be read.
std::optional<std::vector<std::string>> mapped_paths(pid_t pid, ProcReadError* error);
std::optional<std::vector<OpenFile>> open_files(pid_t pid, ProcReadError* error);
std::optional<std::vector<std::string>> thread_names(pid_t pid, ProcReadError* error);
std::optional<pid_t> parent_of(pid_t pid, ProcReadError* error);

// What /proc/PID/stat says of the process itself.
struct ProcStat {
  std::string comm;    // its name, as in /proc/PID/comm
  char state = '?';    // R, S, D, Z (zombie), X (dead), ...
  pid_t parent = 0;    // ppid
  unsigned flags = 0;  // the kernel's PF_* flags
};
constexpr unsigned kPfKthread = 0x00200000;  // PF_KTHREAD: a kernel thread
std::optional<ProcStat> stat_of(pid_t pid, ProcReadError* error);
std::optional<std::vector<std::string>> environment_of(pid_t pid, ProcReadError* error);

// The parsers behind them, on a file's text (tests/fuzz/proc_files_fuzz.cpp feeds them any bytes).
// /proc/PID/maps: the mapped files' paths, consecutive repeats dropped, " (deleted)" stripped.
std::vector<std::string> parse_maps(std::string_view text);
// /proc/PID/stat: name, state, parent and flags (the fields after the last ')'); nullopt when
// the text is not a stat line.
std::optional<ProcStat> parse_stat(std::string_view text);
std::optional<pid_t> parse_stat_parent(std::string_view text);  // parse_stat's parent
// /proc/PID/environ: the NUL-separated "K=V" strings.
std::vector<std::string> parse_environ(std::string_view text);
// An fd link's target without " (deleted)".
std::string strip_deleted(std::string target);

// kcmp(KCMP_FILE): 1 when both fds are the same open file description, 0 when not, -errno on
// failure (ENOSYS, EPERM where kcmp is filtered or ptrace access is refused).
int same_file_description(pid_t a, int fd_a, pid_t b, int fd_b);

}  // namespace forkguard::probe::detail
