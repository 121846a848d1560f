// Reads what /proc says about a process: mappings, open fds, threads, parent, environment.
#pragma once

#include <sys/types.h>

#include <cstdint>
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

// An executable mapping of a file: [start, end) holds code of `path`.
struct ExecMapping {
  std::uintptr_t start = 0;
  std::uintptr_t end = 0;
  std::string path;
};

// /proc/PID/maps read once: the mapped files' paths (as parse_maps) and the executable mappings.
struct Maps {
  std::vector<std::string> paths;
  std::vector<ExecMapping> exec;
};

struct Thread {
  pid_t tid = 0;
  std::string comm;  // /proc/PID/task/TID/comm
};

// What /proc/PID/task/TID/syscall says: the thread is on a CPU ("running"), or blocked with its
// user-space PC (in a system call, `nr` its number, or -1 when blocked outside one).
struct ThreadSyscall {
  bool running = false;
  long nr = -1;
  std::uintptr_t pc = 0;
};

// Each returns nullopt and fills *error when the file cannot be read.
std::optional<std::vector<std::string>> mapped_paths(pid_t pid, ProcReadError* error);
std::optional<Maps> maps_of(pid_t pid, ProcReadError* error);
std::optional<std::vector<OpenFile>> open_files(pid_t pid, ProcReadError* error);
std::optional<std::vector<std::string>> thread_names(pid_t pid, ProcReadError* error);
// The threads in /proc/PID/task, in the directory's order; one that exits while listed is left out.
std::optional<std::vector<Thread>> threads_of(pid_t pid, ProcReadError* error);
// The TIDs in /proc/PID/task, without reading anything of each thread.
std::optional<std::vector<pid_t>> thread_ids(pid_t pid, ProcReadError* error);
// Needs ptrace attach permission on `pid` (PTRACE_MODE_ATTACH): EACCES or EPERM without it.
std::optional<ThreadSyscall> thread_syscall(pid_t pid, pid_t tid, ProcReadError* error);

// One thread's /proc/PID/task/TID/syscall: `syscall` nullopt (and `error` filled) when unreadable.
struct ThreadState {
  pid_t tid = 0;
  std::optional<ThreadSyscall> syscall;
  ProcReadError error;
};
// Up to kSettleRounds re-reads, kSettlePauseMs apart: GNU OpenMP's idle workers spin a few
// milliseconds after a parallel region (GOMP_SPINCOUNT; measured here: 0.05-2.2 ms on an idle
// machine) before they block in a futex where their PC can be seen. On a loaded machine a
// spinning worker gets a fraction of a core and spins longer in wall time (a 10 ms bound missed
// the pool 2 times in 15 beside two busy loops): up to 50 ms, paid only where libgomp is mapped
// and a thread runs.
inline constexpr int kSettleRounds = 25;
inline constexpr int kSettlePauseMs = 2;
// Each thread's state, in the order of `tids`. With `settle`, the threads found running are read
// again, up to kSettleRounds times, until none runs; *rounds (if given) says how many were taken.
// A thread for which `known` (if given) is true is not waited for: what it is is known already.
std::vector<ThreadState> thread_states(pid_t pid, const std::vector<pid_t>& tids, bool settle,
                                       int* rounds = nullptr, bool (*known)(pid_t) = nullptr);
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
// /proc/PID/maps: the mappings with 'x' permission that have a file path, " (deleted)" stripped.
std::vector<ExecMapping> parse_exec_mappings(std::string_view text);
// /proc/PID/task/TID/syscall: "running", "NR ARG1..ARG6 SP PC" or "-1 SP PC" (hex after NR);
// nullopt when the text is none of these.
std::optional<ThreadSyscall> parse_syscall(std::string_view text);
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
