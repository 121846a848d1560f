#include "launch/supervisor.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <poll.h>
#include <signal.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <optional>

#include "detail/signal_capture.hpp"
#include "forkguard/cuda/nvml.hpp"
#include "forkguard/cuda/visible_devices.hpp"
#include "forkguard/launch/environment.hpp"
#include "forkguard/launch/gpu_plan.hpp"
#include "launch/child.hpp"
#include "launch/fork_server.hpp"
#include "launch/init_state.hpp"
#include "launch/rank_output.hpp"

namespace forkguard::launch::detail {
namespace {

using Clock = std::chrono::steady_clock;
using forkguard::detail::UniqueFd;

struct Stream {
  UniqueFd fd;
  UniqueFd log;
  detail::RankOutput output;  // what the console shows of it
};

struct Rank {
  int local_rank = 0;
  int rank = 0;
  pid_t pid = -1;
  Child child;               // unless via_server: the zygote's child
  ServerChild server_child;  // via_server: its handle (its pidfd, sent by the server)
  bool running = false;
  bool via_server = false;
  bool console = true;
  Clock::time_point started;
  ExitStatus status;
  double seconds = 0;
  bool stopped_by_launcher = false;
  std::string lost;  // RankResult::lost
  Stream out, err;
};

using forkguard::detail::SignalCapture;

// A fork-server rank is the server's child, not ours: no Child, and its exit comes as the server's
// report. Its group gets the signal by id, as in finish() (the id is not reused while any member
// of the group lives); the rank itself, when that group is not there yet, through its pidfd, which
// names it even once its PID is reused.
void signal_group(Rank& r, int sig) {
  if (r.child) return r.child.signal(sig);
  r.server_child.signal_group(sig);
}

class Attempt {
 public:
  Attempt(const Options& o, const Job& job, const EnvMap& base_env, const Placement& place,
          const GpuPlan& gpus, StartMethod method, int restart, SignalCapture* signals,
          const std::function<int()>& interrupted, OutputSink& sink)
      : o_(o),
        job_(job),
        base_env_(base_env),
        place_(place),
        gpus_(gpus),
        method_(method),
        restart_(restart),
        signals_(signals),
        interrupted_(interrupted),
        sink_(sink) {}

  ~Attempt() {
    // Never leave a rank behind, whatever threw: killed here, reaped by their Child handles
    // (stop policy: SIGKILL), each with what its reaper finds left of its tree.
    for (auto& r : ranks_) {
      if (r.running) signal_group(r, SIGKILL);
    }
  }

  Result run() {
    start_all();
    loop();
    finish();
    Result res;
    res.method = method_;
    res.root_cause = root_cause_;
    res.timed_out = timed_out_;
    res.interrupted_by = interrupted_by_;
    for (auto& r : ranks_) {
      res.ranks.push_back({r.rank,
                           r.local_rank,
                           r.pid,
                           r.status,
                           r.seconds,
                           r.stopped_by_launcher,
                           {r.err.output.tail().begin(), r.err.output.tail().end()},
                           r.lost});
    }
    return res;
  }

 private:
  EnvMap environment_for(int local_rank) {
    EnvMap env =
        rank_process_environment(base_env_, place_, local_rank, restart_, o_,
                                 gpus_.rank_visible_devices[static_cast<size_t>(local_rank)]);
    if (job_.is_entry() && method_ == StartMethod::kSpawn) env[detail::kEntryVariable] = job_.entry;
    return env;
  }

  void notice(const std::string& text) {
    if (!o_.quiet) sink_.notice(text);
  }

  UniqueFd open_log(int local_rank, const char* name) {
    if (o_.log.log_dir.empty()) return {};
    auto dir = std::filesystem::path(o_.log.log_dir) / fmt::format("attempt_{}", restart_) /
               fmt::format("rank{}", place_.rank_of(local_rank));
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    if (ec)
      throw Error(fmt::format("cannot create log directory {}: {}", dir.string(), ec.message()));
    auto path = dir / name;
    UniqueFd fd(::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644));
    if (!fd) throw SystemError("cannot open log file " + path.string(), errno);
    return fd;
  }

  void start_all() {
    ranks_.resize(static_cast<size_t>(o_.nproc));
    for (int i = 0; i < o_.nproc; ++i) {
      Rank& r = ranks_[static_cast<size_t>(i)];
      r.local_rank = i;
      r.rank = place_.rank_of(i);
      r.console = o_.log.console_ranks.empty() ||
                  std::find(o_.log.console_ranks.begin(), o_.log.console_ranks.end(),
                            r.local_rank) != o_.log.console_ranks.end();
      int out[2], err[2];
      if (::pipe2(out, O_CLOEXEC) != 0 || ::pipe2(err, O_CLOEXEC) != 0) {
        throw SystemError(fmt::format("error preparing rank {}: pipe2", r.rank), errno);
      }
      r.out.fd.reset(out[0]);
      r.err.fd.reset(err[0]);
      UniqueFd out_w(out[1]), err_w(err[1]);
      r.out.log = open_log(i, "stdout.log");
      r.err.log = open_log(i, "stderr.log");
      r.out.output = detail::RankOutput({.rank = r.rank, .prefix = o_.log.prefix});
      r.err.output = detail::RankOutput(
          {.rank = r.rank, .prefix = o_.log.prefix, .tail_lines = o_.log.stderr_tail_lines});
      detail::ChildIo io{out_w.get(), err_w.get()};
      EnvMap env = environment_for(i);
      RankContext ctx{r.rank,   i,        place_.world_size(), place_.nproc, place_.node_rank,
                      restart_, job_.args};
      r.started = Clock::now();
      auto child = detail::start_rank(method_, job_, ctx, env, io);
      r.pid = child.pid;
      r.child = std::move(child.child);
      r.server_child = std::move(child.server_child);
      r.via_server = child.via_server;
      r.running = true;
    }
    for (auto& r : ranks_) {
      r.running = false;  // await_start reaps it when the exec failed
      if (r.child) r.child.await_start();
      r.running = true;
    }
  }

  void on_exit(Rank& r, ExitStatus status) {
    r.running = false;
    r.status = status;
    r.seconds = std::chrono::duration<double>(Clock::now() - r.started).count();
    if (!status.success() && !stopping_) {
      root_cause_ = r.local_rank;
      begin_stop(o_.stop.signal);
    }
  }

  // The group stop: `sig` to every running rank now, SIGKILL to those left after the grace
  // (loop()). Not Child::stop(): it blocks for the grace on one child at a time, while this loop
  // must keep draining the ranks' output pipes (a rank blocked on a full pipe never exits) and
  // watching the others; and fork-server ranks have no Child. One deadline for the group
  // (kill_at_) serves both kinds. The ranks' Child handles carry {.signal = SIGKILL}: what their
  // destructors do when an attempt unwinds (~Attempt).
  void begin_stop(int sig) {
    if (stopping_) return;
    stopping_ = true;
    kill_at_ = Clock::now() + o_.stop.grace;
    for (auto& r : ranks_) {
      if (!r.running) continue;
      r.stopped_by_launcher = true;
      signal_group(r, sig);
    }
  }

  // What the console shows of a rank's output: detail::RankOutput (shared with notebook_launch).
  void emit(Rank& r, Stream& s, bool is_err, const char* data, size_t len) {
    if (s.log) forkguard::detail::write_all(s.log.get(), data, len);
    std::string text;
    s.output.feed(std::string_view(data, len), Clock::now(), text);
    show(r, is_err, text);
  }

  void show(const Rank& r, bool is_err, const std::string& text) {
    if (r.console && !text.empty()) sink_.rank_output(r.local_rank, is_err, text);
  }

  // Shows the '\r' states that are due by `now`; `next` is the earliest of those not yet due.
  void show_due(Clock::time_point now, Clock::time_point& next) {
    for (auto& r : ranks_) {
      for (auto [s, is_err] : {std::pair{&r.out, false}, std::pair{&r.err, true}}) {
        std::string text;
        auto due = s->output.show_due(now, text);
        show(r, is_err, text);
        if (due != Clock::time_point{} && (next == Clock::time_point{} || due < next)) next = due;
      }
    }
  }

  // Reads what is there: true when data came, false at EOF (stream closed) or when a
  // non-blocking read found nothing.
  bool read_stream(Rank& r, Stream& s, bool is_err) {
    char buf[65536];
    ssize_t n = ::read(s.fd.get(), buf, sizeof buf);
    if (n > 0) {
      emit(r, s, is_err, buf, static_cast<size_t>(n));
      return true;
    }
    if (n < 0 && (errno == EINTR || errno == EAGAIN)) return false;
    close_stream(r, s, is_err);
    return false;
  }

  // The unterminated last line counts as a line; then the pipe is closed.
  void close_stream(Rank& r, Stream& s, bool is_err) {
    std::string text;
    s.output.close(text);
    show(r, is_err, text);
    s.fd.reset();
  }

  bool any_running() const {
    return std::any_of(ranks_.begin(), ranks_.end(), [](const Rank& r) { return r.running; });
  }

  void loop() {
    const bool has_deadline = o_.timeout.has_value();
    const auto deadline = Clock::now() + o_.timeout.value_or(std::chrono::milliseconds(0));
    auto* server = detail::server_for(job_);
    struct Source {
      Rank* rank;
      int what;  // 0 exit, 1 stdout, 2 stderr, 3 signal, 4 server
    };
    auto server_exits = [&] {
      auto mine = [&](pid_t pid) {
        return std::any_of(ranks_.begin(), ranks_.end(),
                           [&](const Rank& rk) { return rk.via_server && rk.pid == pid; });
      };
      for (auto [pid, status] : server->take_exits(mine)) {
        for (auto& rk : ranks_) {
          if (rk.running && rk.via_server && rk.pid == pid) {
            on_exit(rk, ExitStatus::from_wait_status(status));
          }
        }
      }
      if (!server->closed()) return;
      // It ended: no report will come, and its ranks died with it (their parent-death signal).
      const std::string ended = server->ended();
      for (auto& rk : ranks_) {
        if (!rk.running || !rk.via_server) continue;
        rk.lost = ended;
        on_exit(rk, ExitStatus::signaled(SIGKILL));
      }
    };
    while (true) {
      // Exit reports may have arrived while the ranks were being started.
      if (method_ == StartMethod::kForkServer) server_exits();
      if (!any_running()) break;
      std::vector<pollfd> fds;
      std::vector<Source> src;
      if (signals_ != nullptr) {
        fds.push_back({signals_->fd(), POLLIN, 0});
        src.push_back({nullptr, 3});
      }
      if (method_ == StartMethod::kForkServer) {
        fds.push_back({server->fd(), POLLIN, 0});
        src.push_back({nullptr, 4});
      }
      for (auto& r : ranks_) {
        if (r.running && r.child) {
          fds.push_back({r.child.pidfd(), POLLIN, 0});
          src.push_back({&r, 0});
        }
        if (r.out.fd) {
          fds.push_back({r.out.fd.get(), POLLIN, 0});
          src.push_back({&r, 1});
        }
        if (r.err.fd) {
          fds.push_back({r.err.fd.get(), POLLIN, 0});
          src.push_back({&r, 2});
        }
      }
      int timeout_ms = -1;
      auto now = Clock::now();
      auto until = [&](Clock::time_point t) {
        auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(t - now).count() + 1;
        int v = static_cast<int>(std::max<long long>(0, ms));
        timeout_ms = timeout_ms < 0 ? v : std::min(timeout_ms, v);
      };
      if (stopping_ && !killed_) until(kill_at_);
      if (has_deadline && !timed_out_) until(deadline);
      Clock::time_point show_next{};
      show_due(now, show_next);
      if (show_next != Clock::time_point{}) until(show_next);
      if (interrupted_) until(now + kInterruptPoll);
      int n = ::poll(fds.data(), fds.size(), timeout_ms);
      if (n < 0 && errno != EINTR) throw SystemError("poll", errno);
      now = Clock::now();
      if (interrupted_) {
        if (int sig = interrupted_(); sig != 0) interrupt(sig);
      }
      for (size_t i = 0; n > 0 && i < fds.size(); ++i) {
        if (fds[i].revents == 0) continue;
        Rank* r = src[i].rank;
        switch (src[i].what) {
          case 0:
            if (auto status = r->child.try_wait()) on_exit(*r, *status);
            break;
          case 1: read_stream(*r, r->out, false); break;
          case 2: read_stream(*r, r->err, true); break;
          case 3: {
            int sig = 0;  // the last one: each is forwarded the same way
            signals_->each([&](const signalfd_siginfo& i) { sig = static_cast<int>(i.ssi_signo); });
            if (sig != 0) interrupt(sig);
            break;
          }
          case 4: server_exits(); break;
        }
      }
      if (has_deadline && !timed_out_ && now >= deadline && any_running()) {
        timed_out_ = true;
        notice(fmt::format("timeout after {} ms: stopping every rank", o_.timeout->count()));
        begin_stop(o_.stop.signal);
      }
      if (stopping_ && !killed_ && now >= kill_at_) {
        killed_ = true;
        for (auto& r : ranks_) {
          if (r.running) signal_group(r, SIGKILL);
        }
      }
    }
  }

  void interrupt(int sig) {
    interrupted_by_ = sig;
    if (!stopping_) {
      notice(fmt::format(
          "received {}, forwarding it to every rank",
          ::sigabbrev_np(sig) ? std::string("SIG") + ::sigabbrev_np(sig) : std::to_string(sig)));
    }
    begin_stop(sig);
  }

  void finish() {
    // Leftover descendants in the ranks' groups go too, then what they wrote is drained.
    // By group id only: the rank itself is reaped, so its PID may already belong to another
    // process, but a group id is not reused while any member of the group lives.
    for (auto& r : ranks_) {
      if (r.pid > 0) ::kill(-r.pid, SIGKILL);
    }
    for (auto& r : ranks_) {
      for (int is_err = 0; is_err < 2; ++is_err) {
        Stream& s = is_err ? r.err : r.out;
        if (!s.fd) continue;
        ::fcntl(s.fd.get(), F_SETFL, O_NONBLOCK);
        while (read_stream(r, s, is_err)) {
        }
        // EOF, or nothing more now: a writer outside the ranks' groups is not waited for.
        if (s.fd) close_stream(r, s, is_err);
      }
    }
  }

  const Options& o_;
  const Job& job_;
  const EnvMap& base_env_;  // this process's environment, read once
  const Placement& place_;
  const GpuPlan& gpus_;
  StartMethod method_;
  int restart_;
  SignalCapture* signals_;  // nullptr: interrupted_ instead
  const std::function<int()>& interrupted_;
  OutputSink& sink_;
  std::vector<Rank> ranks_;
  int root_cause_ = -1;
  bool stopping_ = false;
  bool killed_ = false;
  bool timed_out_ = false;
  int interrupted_by_ = 0;
  Clock::time_point kill_at_;
};

}  // namespace

void ConsoleSink::rank_output(int, bool is_err, std::string_view text) {
  forkguard::detail::write_all(is_err ? 2 : 1, text.data(), text.size());
}

void ConsoleSink::notice(std::string_view text) {
  fmt::print(stderr, "forkguard: {}\n", text);
}

Result supervise(const Options& options, const Job& job, const Supervision& how) {
  ConsoleSink console;
  OutputSink& sink = how.sink != nullptr ? *how.sink : console;
  auto notice = [&](const std::string& text) {
    if (!options.quiet) sink.notice(text);
  };
  Options o = options;
  if (o.nproc_per_gpu) {
    auto inventory = cuda::discover_gpus();
    o.nproc = count_visible_gpus(inventory, cuda::visible_devices_from_env());
    if (o.nproc == 0) {
      throw GpuPlanError(fmt::format("nproc_per_gpu, but no GPU is visible ({} GPUs from {})",
                                     inventory.gpus.size(), inventory.source));
    }
  }
  if (o.nproc < 1) throw Error(fmt::format("nproc must be at least 1, not {}", o.nproc));
  for (int r : o.log.console_ranks) {
    if (r < 0 || r >= o.nproc) {
      throw PlacementError(
          fmt::format("log.console_ranks: {} is not a local rank (0 to {})", r, o.nproc - 1));
    }
  }
  const EnvMap base_env = current_environment();
  if (job.is_entry() && job.server != nullptr) {
    // An attached server's entries are registered there, not here.
  } else if (job.is_entry()) {
    if (find_entry(job.entry) == nullptr) throw Error(detail::unknown_entry(job.entry));
  } else if (job.argv.empty()) {
    throw Error("no command to run");
  } else {
    EnvMap env = base_env;
    for (const auto& [k, v] : o.env) env[k] = v;
    detail::check_executable(job.argv[0], env);
  }
  auto place = resolve_placement(o.nodes, o.nproc, base_env);
  check_master_addr(place);
  GpuPlan gpus;
  if (o.gpus.bind) {
    gpus = plan_gpus(o.gpus, o.nproc, cuda::discover_gpus(), cuda::visible_devices_from_env());
  } else {
    gpus.rank_visible_devices.resize(static_cast<size_t>(o.nproc));
  }
  StartMethod method = resolve_method(o, job, notice);
  if (job.is_entry() && method == StartMethod::kSpawn && !detail::init_state().called) {
    throw Error(
        "starting an entry function by spawn re-executes this program: call "
        "forkguard::init(argc, argv) as the first line of main()");
  }
  if (o.nproc > 1 && std::getenv("OMP_NUM_THREADS") == nullptr &&
      o.env.count("OMP_NUM_THREADS") == 0) {
    notice(
        "setting OMP_NUM_THREADS=1 for every rank (nproc > 1) so they do not overload the "
        "machine; set it yourself to tune");
  }
  std::fflush(nullptr);  // what the caller printed comes before what the ranks print
  std::optional<SignalCapture> signals;
  if (!how.interrupted) signals.emplace(std::initializer_list<int>{SIGINT, SIGTERM, SIGHUP});
  Result result;
  for (int restart = 0;; ++restart) {
    Attempt attempt(o, job, base_env, place, gpus, method, restart, signals ? &*signals : nullptr,
                    how.interrupted, sink);
    result = attempt.run();
    result.restarts = restart;
    result.gpu_plan = gpus.description;
    if (result.success() || result.interrupted_by != 0 || restart >= o.max_restarts) break;
    notice(fmt::format("rank {} {}: restarting the group ({} of {})",
                       result.ranks[static_cast<size_t>(std::max(result.root_cause, 0))].rank,
                       result.root_cause >= 0
                           ? result.ranks[static_cast<size_t>(result.root_cause)].status.to_string()
                           : std::string("timed out"),
                       restart + 1, o.max_restarts));
  }
  if (!result.success()) throw RankFailedError(std::move(result));
  return result;
}

}  // namespace forkguard::launch::detail
