#include "launch/start_method.hpp"

#include <fmt/format.h>

#include <csignal>

#include "forkguard/launch/launcher.hpp"
#include "forkguard/probe/cuda_state.hpp"
#include "launch/fork_server.hpp"
#include "launch/init_state.hpp"

namespace forkguard::launch::detail {

ForkServer* server_for(const Job& job) {
  return job.server != nullptr ? job.server : ForkServer::get();
}

StartMethod resolve_method(const Options& o, const Job& job, const NoticeFn& notice) {
  if (job.server != nullptr) return StartMethod::kForkServer;  // its entries live only there
  auto* server = ForkServer::get();
  switch (o.start) {
    case StartMethod::kSpawn: return StartMethod::kSpawn;
    case StartMethod::kForkServer:
      if (server == nullptr) {
        throw Error(
            "start method forkserver needs the fork server: call forkguard::init(argc, argv) as "
            "the first line of main() (and do not set FORKGUARD_NO_FORK_SERVER)");
      }
      return StartMethod::kForkServer;
    case StartMethod::kFork: {
      if (!job.is_entry()) return StartMethod::kFork;  // fork+exec: always safe
      auto dirty = probe::self_if_fork_unsafe();
      if (!dirty) return StartMethod::kFork;
      if (o.dirty_parent == DirtyParent::kRefuse) throw DirtyForkError(std::move(*dirty), o.nproc);
      auto m = server != nullptr ? StartMethod::kForkServer : StartMethod::kSpawn;
      notice(fmt::format("this process is {}: starting ranks by {} instead of fork",
                         probe::to_string(dirty->verdict), to_string(m)));
      return m;
    }
    case StartMethod::kAuto: {
      // A command is always started by fork+exec, safe whatever this process holds, and from
      // here rather than through the zygote (one round trip less per rank: bench/launch).
      if (!job.is_entry()) return StartMethod::kSpawn;
      auto dirty = probe::self_if_fork_unsafe();
      if (!dirty) {
        notice("start method auto: fork (this process holds no CUDA state)");
        return StartMethod::kFork;
      }
      auto m = server != nullptr ? StartMethod::kForkServer : StartMethod::kSpawn;
      notice(fmt::format("start method auto: {} (this process is {}, fork would poison the ranks)",
                         to_string(m), probe::to_string(dirty->verdict)));
      return m;
    }
  }
  return StartMethod::kSpawn;
}

StartedRank start_rank(StartMethod method, const Job& job, const RankContext& ctx,
                       const EnvMap& env, const ChildIo& io) {
  StartedRank r;
  switch (method) {
    case StartMethod::kForkServer: {
      auto* server = server_for(job);
      auto flat = detail::flatten(env);
      const int extra = job.rank_fd ? job.rank_fd(ctx.local_rank, ctx.restart_count) : -1;
      ServerChild started =
          job.is_entry()
              ? server->start_entry(job.entry, ctx, flat, io.stdout_fd, io.stderr_fd, extra)
              : server->start_exec(job.argv, flat, io.stdout_fd, io.stderr_fd);
      r.pid = started.pid();
      r.server_child = std::move(started);
      r.via_server = true;
      break;
    }
    case StartMethod::kFork:
      if (job.is_entry()) {
        auto storage = detail::flatten(env);
        auto envp = detail::c_array(storage);
        r.child =
            detail::start_child({.main = [fn = find_entry(job.entry), &ctx] { return fn(ctx); },
                                 .environ_for_main = envp.data(),
                                 .stdout_fd = io.stdout_fd,
                                 .stderr_fd = io.stderr_fd,
                                 .reap_tree = true,
                                 .stop = {.signal = SIGKILL},
                                 .what = fmt::format("rank {}", ctx.rank)});
        r.pid = r.child.pid();
        break;
      }
      [[fallthrough]];
    case StartMethod::kSpawn:
    case StartMethod::kAuto: {
      std::vector<std::string> argv = job.argv;
      if (job.is_entry()) {
        argv = {detail::init_state().argv0};
        argv.insert(argv.end(), job.args.begin(), job.args.end());
      }
      auto exec = detail::prepare_exec(argv, env);
      if (job.is_entry()) exec.path = "/proc/self/exe";
      // Not waiting for the exec here lets the ranks exec in parallel; the supervisor checks
      // (Child::await_start).
      r.child = detail::start_child({.exec = &exec,
                                     .stdout_fd = io.stdout_fd,
                                     .stderr_fd = io.stderr_fd,
                                     .reap_tree = true,
                                     .await_start = false,
                                     .stop = {.signal = SIGKILL}});
      r.pid = r.child.pid();
      break;
    }
  }
  return r;
}

}  // namespace forkguard::launch::detail
