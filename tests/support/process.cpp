#include "process.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <stdexcept>

extern char** environ;

namespace forkguard::testing {
namespace {

using Clock = std::chrono::steady_clock;

std::vector<std::string> make_env(const EnvOverrides& overrides) {
  std::vector<std::string> env;
  for (char** e = environ; *e != nullptr; ++e) {
    std::string kv(*e);
    auto name = kv.substr(0, kv.find('='));
    if (overrides.count(name) == 0) env.push_back(kv);
  }
  for (const auto& [name, value] : overrides) {
    if (value) env.push_back(name + "=" + *value);
  }
  return env;
}

std::vector<char*> c_strings(std::vector<std::string>& v) {
  std::vector<char*> out;
  for (auto& s : v) out.push_back(s.data());
  out.push_back(nullptr);
  return out;
}

pid_t spawn(const std::vector<std::string>& argv, const EnvOverrides& overrides, int stdin_fd,
            int stdout_fd, int stderr_fd) {
  auto args = argv;
  auto env = make_env(overrides);
  auto cargs = c_strings(args);
  auto cenv = c_strings(env);
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, stdin_fd, 0);
  posix_spawn_file_actions_adddup2(&fa, stdout_fd, 1);
  posix_spawn_file_actions_adddup2(&fa, stderr_fd, 2);
  pid_t pid = -1;
  int rc = posix_spawn(&pid, args[0].c_str(), &fa, nullptr, cargs.data(), cenv.data());
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) throw std::runtime_error("posix_spawn " + args[0] + ": " + std::strerror(rc));
  return pid;
}

void make_pipe(int fds[2]) {
  if (::pipe2(fds, O_CLOEXEC) != 0) throw std::runtime_error("pipe2 failed");
}

}  // namespace

RunResult run(const std::vector<std::string>& argv, const EnvOverrides& env,
              std::chrono::milliseconds timeout) {
  int in[2], out[2], err[2];
  make_pipe(in);
  make_pipe(out);
  make_pipe(err);
  pid_t pid = spawn(argv, env, in[0], out[1], err[1]);
  ::close(in[0]);
  ::close(in[1]);
  ::close(out[1]);
  ::close(err[1]);
  RunResult r;
  auto deadline = Clock::now() + timeout;
  pollfd fds[2] = {{out[0], POLLIN, 0}, {err[0], POLLIN, 0}};
  int open = 2;
  bool killed = false;
  while (open > 0) {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0 && !killed) {
      ::kill(pid, SIGKILL);
      killed = true;
    }
    int n = ::poll(fds, 2, killed ? 1000 : static_cast<int>(left.count()));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) continue;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || fds[i].revents == 0) continue;
      char buf[8192];
      ssize_t len = ::read(fds[i].fd, buf, sizeof buf);
      if (len <= 0) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open;
      } else {
        (i == 0 ? r.out : r.err).append(buf, static_cast<size_t>(len));
      }
    }
  }
  int status = 0;
  while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
  if (killed) r.err += "\n[test support: killed after timeout]\n";
  return r;
}

Interactive::Interactive(const std::vector<std::string>& argv, const EnvOverrides& env) {
  int in[2], out[2];
  make_pipe(in);
  make_pipe(out);
  pid_ = spawn(argv, env, in[0], out[1], 2);
  ::close(in[0]);
  ::close(out[1]);
  in_ = in[1];
  out_ = out[0];
}

Interactive::~Interactive() {
  if (in_ >= 0) ::close(in_);
  if (out_ >= 0) ::close(out_);
  if (pid_ > 0) {
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
  }
}

void Interactive::send(const std::string& line) {
  std::string s = line + "\n";
  if (::write(in_, s.data(), s.size()) != static_cast<ssize_t>(s.size())) {
    throw std::runtime_error("helper stdin closed");
  }
}

std::string Interactive::read_line(std::chrono::milliseconds timeout) {
  std::string line = read_until("\n", timeout);
  line.pop_back();
  return line;
}

std::string Interactive::read_until(std::string_view needle, std::chrono::milliseconds timeout) {
  auto deadline = Clock::now() + timeout;
  while (true) {
    auto at = buffer_.find(needle);
    if (at != std::string::npos) {
      std::string out = buffer_.substr(0, at + needle.size());
      buffer_.erase(0, at + needle.size());
      return out;
    }
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now());
    if (left.count() <= 0) throw std::runtime_error("helper did not answer in time");
    pollfd p{out_, POLLIN, 0};
    int n = ::poll(&p, 1, static_cast<int>(left.count()));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) continue;
    char buf[4096];
    ssize_t len = ::read(out_, buf, sizeof buf);
    if (len <= 0) throw std::runtime_error("helper closed its output (exited?)");
    buffer_.append(buf, static_cast<size_t>(len));
  }
}

std::string Interactive::ask(const std::string& line, std::chrono::milliseconds timeout) {
  send(line);
  return read_line(timeout);
}

int Interactive::finish() {
  ::close(in_);
  in_ = -1;
  int status = 0;
  ::waitpid(pid_, &status, 0);
  pid_ = -1;
  return status;
}

TempDir::TempDir() {
  const char* tmp = std::getenv("TMPDIR");
  std::string tmpl = std::string(tmp != nullptr && *tmp ? tmp : "/tmp") + "/forkguard-test-XXXXXX";
  if (::mkdtemp(tmpl.data()) == nullptr) throw std::runtime_error("mkdtemp failed");
  path_ = tmpl;
}

TempDir::~TempDir() {
  std::error_code ec;
  std::filesystem::remove_all(path_, ec);
}

std::vector<int> open_fds() {
  std::vector<int> fds;
  DIR* d = ::opendir("/proc/self/fd");
  int own = ::dirfd(d);
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    int fd = std::atoi(e->d_name);
    if (fd != own) fds.push_back(fd);
  }
  ::closedir(d);
  std::sort(fds.begin(), fds.end());
  return fds;
}

// Processes come and go while /proc is read: one that vanishes is skipped, never an error.
std::vector<pid_t> children_of(pid_t parent) {
  std::vector<pid_t> out;
  DIR* d = ::opendir("/proc");
  if (d == nullptr) return out;
  while (dirent* e = ::readdir(d)) {
    std::string name = e->d_name;
    if (name.empty() || name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string stat = read_file("/proc/" + name + "/stat");
    auto close = stat.rfind(')');
    if (close == std::string::npos || close + 4 >= stat.size()) continue;
    if (std::atoi(stat.c_str() + close + 4) == parent) out.push_back(std::atoi(name.c_str()));
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

bool is_alive(pid_t pid) {
  std::string stat = read_file("/proc/" + std::to_string(pid) + "/stat");
  auto close = stat.rfind(')');
  if (close == std::string::npos || close + 2 >= stat.size()) return false;
  return stat[close + 2] != 'Z' && stat[close + 2] != 'X';
}

// The whole file, or what could be read of it ("" when it does not exist or vanished).
std::string read_file(const std::string& path) {
  std::string out;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return out;
  char buf[8192];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof buf)) > 0 || (n < 0 && errno == EINTR)) {
    if (n > 0) out.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return out;
}

size_t mapped_bytes(pid_t pid, const std::string& match) {
  std::ifstream in("/proc/" + std::to_string(pid) + "/smaps");
  std::string line;
  bool inside = false;
  size_t total = 0;
  while (std::getline(in, line)) {
    if (!line.empty() && std::isxdigit(static_cast<unsigned char>(line[0])) &&
        line.find(' ') < line.find(':')) {  // a mapping's header, not a "Key: value" line
      inside = line.find(match) != std::string::npos;
    } else if (inside && line.rfind("Rss:", 0) == 0) {
      total += std::stoull(line.substr(4)) * 1024;
    }
  }
  return total;
}

}  // namespace forkguard::testing
