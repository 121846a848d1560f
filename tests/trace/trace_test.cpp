// forkguard trace as a user runs it: the CLI over C++ helper programs and Debian's python3, with
// the test driver standing in for the GPU. What is checked is what the user reads (the reports
// name the program's own functions and lines), the exit codes, and the JSON events.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>

#include <fstream>
#include <nlohmann/json.hpp>
#include <set>
#include <sstream>
#include <string>
#include <thread>

#include "paths.hpp"

namespace ft = forkguard::testing;
using nlohmann::json;
using namespace std::chrono_literals;

namespace {

const std::string kTraceFork = FORKGUARD_HELPER_DIR "/trace_fork";
const std::string kTraceLinked = FORKGUARD_HELPER_DIR "/trace_linked";
const std::string kHelperSource = FORKGUARD_SOURCE_DIR "/tests/helpers/trace_fork.cpp";
const std::string kPythonFork = FORKGUARD_TRACE_TEST_DIR "/python_fork.py";
const std::string kPython = "/usr/bin/python3";
const std::string kTraceOpenMp = FORKGUARD_HELPER_DIR "/trace_openmp";
const std::string kOpenMpSource = FORKGUARD_SOURCE_DIR "/tests/helpers/trace_openmp.cpp";
const std::string kPythonOpenMp = FORKGUARD_TRACE_TEST_DIR "/python_openmp.py";
const std::string kTorchPython = FORKGUARD_TORCH_PYTHON;

// The line of `source` that carries `marker` (1-based), for checking file:line in the reports.
int line_of(const std::string& source, const std::string& marker) {
  std::ifstream in(source);
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.find(marker) != std::string::npos) return n;
  }
  ADD_FAILURE() << marker << " not found in " << source;
  return -1;
}

bool contains(const std::string& haystack, const std::string& needle) {
  return haystack.find(needle) != std::string::npos;
}

// The events file's events by kind, each checked to carry every field an event has.
std::map<std::string, std::vector<json>> events_by_kind(const json& doc) {
  std::map<std::string, std::vector<json>> by_kind;
  for (const auto& e : doc["events"]) {
    for (const char* key :
         {"event", "pid", "ppid", "time", "what", "site", "native_frames", "python_frames"}) {
      EXPECT_TRUE(e.contains(key)) << key << " in " << e.dump();
    }
    by_kind[e["event"]].push_back(e);
  }
  return by_kind;
}

size_t count(const std::string& haystack, const std::string& needle) {
  size_t n = 0;
  for (size_t at = haystack.find(needle); at != std::string::npos;
       at = haystack.find(needle, at + 1)) {
    ++n;
  }
  return n;
}

class Trace : public ::testing::Test {
 protected:
  void SetUp() override {
    env_ = ft::fake_cuda_env(dir_.path());
    env_["FORKGUARD_TRACE_LIBRARY"] = std::nullopt;
#ifdef FORKGUARD_SANITIZED_BUILD
    // The helpers are instrumented, the preloaded library is not (it is loaded into programs we
    // did not build): ASan must not insist on coming first in the library list.
    const char* asan = std::getenv("ASAN_OPTIONS");
    env_["ASAN_OPTIONS"] =
        std::string(asan != nullptr ? asan : "") + (asan ? ":" : "") + "verify_asan_link_order=0";
#endif
  }
  void TearDown() override {
    // Every process the traced command started has been waited for.
    EXPECT_TRUE(ft::children_of(::getpid()).empty());
  }

  ft::RunResult trace(std::vector<std::string> options, const std::vector<std::string>& command,
                      std::chrono::milliseconds timeout = 60s) {
    std::vector<std::string> argv = {ft::kForkguard, "trace"};
    argv.insert(argv.end(), options.begin(), options.end());
    argv.push_back("--");
    argv.insert(argv.end(), command.begin(), command.end());
    return ft::run(argv, env_, timeout);
  }

  // The Python programs load the uninstrumented copy of the test driver.
  void use_plain_driver() {
    env_["FORKGUARD_CUDA_DRIVER"] = FORKGUARD_TRACE_PLAIN_DRIVER;
  }

  std::string init_site() const {
    return "initialize_cuda_in_parent at " + kHelperSource + ":" +
           std::to_string(line_of(kHelperSource, "trace-test: init site"));
  }

  ft::TempDir dir_;
  ft::EnvOverrides env_;
};

TEST_F(Trace, InitThenForkReportsTheForkAndTheInitSiteWithTheHelpersFunctions) {
  auto r = trace({}, {kTraceFork, "init", "fork-exit"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "parent cuInit = 0\nchild exited 0\n");
  const std::string fork_site = "fork_worker_that_exits at " + kHelperSource + ":" +
                                std::to_string(line_of(kHelperSource, "trace-test: fork site"));
  EXPECT_TRUE(contains(r.err, "forked child PID")) << r.err;
  EXPECT_TRUE(contains(r.err, "fork() called at " + fork_site + ":")) << r.err;
  EXPECT_TRUE(contains(r.err, "CUDA was initialized in PID")) << r.err;
  EXPECT_TRUE(contains(r.err, " at " + init_site() + " (cuInit(0) = CUDA_SUCCESS)")) << r.err;
  // Both stacks, symbolized down to main().
  EXPECT_TRUE(contains(r.err, "#0 " + fork_site)) << r.err;
  EXPECT_TRUE(contains(r.err, "#0 " + init_site())) << r.err;
  EXPECT_TRUE(contains(r.err, "#1 main at ")) << r.err;
  EXPECT_TRUE(contains(r.err, "driver loaded: libcuda.so.1")) << r.err;
  EXPECT_TRUE(contains(r.err, "at load_cuda_driver at ")) << r.err;
  EXPECT_TRUE(contains(r.err, "device files opened: nvidiactl, nvidia-uvm, nvidia0")) << r.err;
  EXPECT_TRUE(contains(r.err, "verdict initialized")) << r.err;
  EXPECT_TRUE(contains(r.err, "spawn or a fork server")) << r.err;
  EXPECT_TRUE(contains(r.err, "PYTORCH_NVML_BASED_CUDA_CHECK=1")) << r.err;
  EXPECT_TRUE(contains(r.err, "CPU-only")) << r.err;
  // The summary, last.
  EXPECT_TRUE(contains(r.err, "forkguard trace: CUDA was initialized in PID")) << r.err;
}

TEST_F(Trace, ASecondForkFromTheSamePlaceIsOneLine) {
  auto r = trace({}, {kTraceFork, "init", "fork-exit", "fork-exit"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(count(r.err, "fork() called at"), 1u) << r.err;
  EXPECT_EQ(count(r.err, "forked again after CUDA was initialized"), 1u) << r.err;
  EXPECT_TRUE(contains(r.err, "forked 2 times")) << r.err;
}

TEST_F(Trace, LoadingTheDriverOrNvmlThenForkingReportsNothing) {
  for (auto steps : std::vector<std::vector<std::string>>{{"load", "fork-exit"},
                                                          {"load", "nvml", "fork-exit"}}) {
    steps.insert(steps.begin(), kTraceFork);
    auto r = trace({"--quiet"}, steps);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.err, "") << steps[1];
  }
  // Without --quiet: the summary alone, saying so.
  auto r = trace({}, {kTraceFork, "load", "fork-exit"});
  EXPECT_EQ(r.err,
            "forkguard trace: nothing to report: no fork after CUDA initialization (a CUDA "
            "library was loaded in 1 process, CUDA never initialized).\n");
}

TEST_F(Trace, ForkThenExecAndPosixSpawnAfterInitReportNothing) {
  for (const char* step : {"fork-exec", "spawn"}) {
    auto r = trace({"--quiet"}, {kTraceFork, "init", step});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.out, "parent cuInit = 0\nchild exited 0\n");
    EXPECT_EQ(r.err, "") << step;
  }
}

TEST_F(Trace, APoisonedChildsReportNamesTheParentAndItsInitSite) {
  auto r = trace({}, {kTraceFork, "init", "fork-touch"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, "child cuInit = 3\n")) << r.out;  // behaviour unchanged
  const std::string touch_site = "worker_touches_cuda at " + kHelperSource + ":" +
                                 std::to_string(line_of(kHelperSource, "trace-test: touch site"));
  EXPECT_TRUE(contains(r.err, "touched CUDA (cuInit) at " + touch_site +
                                  ", but it was forked "
                                  "from PID "))
      << r.err;
  EXPECT_TRUE(contains(r.err, "CUDA calls in this process fail with CUDA_ERROR_NOT_INITIALIZED"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "in the parent, PID ")) << r.err;
  // The parent's init site appears in the child's report and in the parent's fork report.
  EXPECT_EQ(count(r.err, " at " + init_site() + " (cuInit(0) = CUDA_SUCCESS)"), 2u) << r.err;
  EXPECT_TRUE(contains(r.err, "1 child touched CUDA where it cannot work")) << r.err;
}

TEST_F(Trace, StrictStopsThePoisonedChildAtItsFirstTouchWithExitCode70) {
  auto r = trace({"--strict"}, {kTraceFork, "init", "fork-touch"});
  EXPECT_EQ(r.exit_code, 70) << r.err;  // the helper exits with its child's code
  EXPECT_EQ(r.out, "parent cuInit = 0\nchild exited 70\n");
  EXPECT_TRUE(contains(r.err, "forkguard trace --strict: exiting with code 70 here.")) << r.err;
  EXPECT_TRUE(contains(r.err, "touched CUDA (cuInit) at worker_touches_cuda")) << r.err;
  // Without --strict the same child goes on (and fails with CUDA_ERROR_NOT_INITIALIZED).
  auto plain = trace({"--quiet"}, {kTraceFork, "init", "fork-touch"});
  EXPECT_EQ(plain.exit_code, 0);
}

TEST_F(Trace, JsonHasEveryEventWithPidsTimesAndFrames) {
  const std::string path = dir_.path() + "/events.json";
  auto r = trace({"--json", path}, {kTraceFork, "init", "fork-touch"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::ifstream in(path);
  json doc = json::parse(in);
  EXPECT_EQ(doc["exit_code"], 0);
  EXPECT_EQ(doc["found"], true);
  EXPECT_EQ(doc["command"][0], kTraceFork);
  auto by_kind = events_by_kind(doc);
  ASSERT_EQ(by_kind["driver_loaded"].size(), 1u);
  ASSERT_EQ(by_kind["cuda_init"].size(), 1u);
  ASSERT_EQ(by_kind["dirty_fork"].size(), 1u);
  ASSERT_EQ(by_kind["poisoned_touch"].size(), 1u);
  std::set<std::string> devices;
  for (const auto& e : by_kind["device_opened"]) devices.insert(e["device"]);
  EXPECT_EQ(devices, (std::set<std::string>{"nvidiactl", "nvidia-uvm", "nvidia0", "nvidia1"}));

  const json& init = by_kind["cuda_init"][0];
  const json& fork = by_kind["dirty_fork"][0];
  const json& touch = by_kind["poisoned_touch"][0];
  const int parent = init["pid"];
  EXPECT_EQ(fork["pid"], parent);
  EXPECT_EQ(touch["ppid"], parent);
  EXPECT_EQ(touch["parent_pid"], parent);
  EXPECT_EQ(fork["child_pid"], touch["pid"]);
  EXPECT_EQ(fork["verdict"], "initialized");
  EXPECT_EQ(init["native_frames"][0]["function"], "initialize_cuda_in_parent");
  EXPECT_EQ(init["native_frames"][0]["line"], line_of(kHelperSource, "trace-test: init site"));
  EXPECT_EQ(init["native_frames"][0]["file"], kHelperSource);
  EXPECT_EQ(fork["native_frames"][0]["function"], "fork_worker_that_uses_cuda");
  EXPECT_EQ(touch["native_frames"][0]["function"], "worker_touches_cuda");
  EXPECT_EQ(touch["parent_init_site"], init["site"]);
  EXPECT_LE(init["time"].get<double>(), fork["time"].get<double>());
}

TEST_F(Trace, CuInitReachedThroughCuGetProcAddressIsTheInitSite) {
  auto r = trace({}, {kTraceFork, "init-gpa", "fork-exit"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "parent cuInit = 0\nchild exited 0\n");
  const std::string site = "initialize_cuda_through_get_proc_address at " + kHelperSource + ":" +
                           std::to_string(line_of(kHelperSource, "trace-test: gpa site"));
  EXPECT_TRUE(contains(r.err, " at " + site + " (cuInit(0) = CUDA_SUCCESS)")) << r.err;
}

TEST_F(Trace, AProgramLinkedAgainstTheDriverHasItsInitSiteFromTheUvmOpen) {
  auto r = trace({}, {kTraceLinked, "init-linked", "fork-exit"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "parent cuInit = 0\nchild exited 0\n");
  const std::string site = "initialize_cuda_linked at " + kHelperSource + ":" +
                           std::to_string(line_of(kHelperSource, "trace-test: linked init site"));
  EXPECT_TRUE(contains(r.err, " at " + site + " (CUDA initialized (first open of nvidia-uvm"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "driver loaded: libcuda.so.1")) << r.err;
  EXPECT_TRUE(contains(r.err, "(linked at start-up)")) << r.err;
}

TEST_F(Trace, ADlopenByBareNameStillSearchesTheCallersRunpath) {
  // Found only through trace_linked's own RUNPATH: a dlopen wrapper that became the caller would
  // make it fail.
  const std::string path = dir_.path() + "/events.json";
  auto untraced = ft::run({kTraceLinked, "nvml-by-name"}, env_);
  auto r = trace({"--quiet", "--json", path}, {kTraceLinked, "nvml-by-name"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, untraced.out);  // whatever the program gets, it gets the same under trace
  EXPECT_EQ(r.err, "");
  if (untraced.out != "dlopen(libnvidia-ml.so.1) ok\n") {
    // ASan's and TSan's own dlopen interceptors call dlopen from the sanitizer runtime, which
    // loses the caller's RUNPATH with or without forkguard trace.
    GTEST_SKIP() << "this build's sanitizer runtime drops the caller's RUNPATH: " << untraced.out;
  }
  EXPECT_EQ(r.out, "dlopen(libnvidia-ml.so.1) ok\n");
  std::ifstream in(path);
  json doc = json::parse(in);
  bool seen = false;
  for (const auto& e : doc["events"]) {
    if (e["event"] != "driver_loaded" || !contains(e["what"], "libnvidia-ml.so.1")) continue;
    seen = true;
    ASSERT_FALSE(e["native_frames"].empty()) << e.dump();
    EXPECT_EQ(e["native_frames"][0]["function"], "load_nvml_by_name");
    EXPECT_EQ(e["native_frames"][0]["line"], line_of(kHelperSource, "trace-test: nvml by name"));
    EXPECT_EQ(e["via"], "dlopen(\"libnvidia-ml.so.1\")");
  }
  EXPECT_TRUE(seen) << doc.dump(1);
}

TEST_F(Trace, PassesTheExitCodeThrough) {
  EXPECT_EQ(trace({"--quiet"}, {"/bin/sh", "-c", "exit 7"}).exit_code, 7);
  EXPECT_EQ(trace({"--quiet"}, {"/bin/sh", "-c", "kill -TERM $$"}).exit_code, 128 + SIGTERM);
  auto missing = trace({}, {"/nonexistent/program"});
  EXPECT_EQ(missing.exit_code, 127);
  EXPECT_TRUE(contains(missing.err, "forkguard trace: cannot run /nonexistent/program"))
      << missing.err;
}

TEST_F(Trace, SigtermToTraceReachesTheProgramAndLeavesNoTemporaryFile) {
  // As a supervisor stops it: `kill PID` of forkguard trace. The traced program gets the signal,
  // its exit code comes back, and the events file in TMPDIR is gone.
  const std::string tmp = dir_.path() + "/tmp";
  ASSERT_EQ(::mkdir(tmp.c_str(), 0700), 0);
  auto env = env_;
  env["TMPDIR"] = tmp;
  for (int sig : {SIGTERM, SIGHUP, SIGINT}) {
    ft::Interactive traced({ft::kForkguard, "trace", "--quiet", "--", "/bin/sh", "-c",
                            "trap 'echo got $0; exit 5' TERM HUP INT; echo ready; "
                            "while :; do sleep 0.02; done",
                            "signal"},
                           env);
    ASSERT_EQ(traced.read_line(20s), "ready");
    ::kill(traced.pid(), sig);
    EXPECT_EQ(traced.read_line(10s), "got signal") << "signal " << sig;
    int status = traced.finish();
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 5) << sig << ": " << status;
    EXPECT_TRUE(std::filesystem::is_empty(tmp))
        << "signal " << sig << ": a file is left in " << tmp;
  }
}

TEST_F(Trace, SigtermToTraceLeavesNothingOfTheTracedTreeAlive) {
  // The traced program is a wrapper whose pythons are its children, one in its own session: the
  // SIGTERM reaches the wrapper, and its reaper kills what the wrapper leaves behind.
  const std::string tmp = dir_.path() + "/tmp";
  ASSERT_EQ(::mkdir(tmp.c_str(), 0700), 0);
  auto env = env_;
  env["TMPDIR"] = tmp;
  ft::Interactive traced({ft::kForkguard, "trace", "--quiet", "--", "/bin/sh", "-c",
                          "/usr/bin/python3 -c 'import time; time.sleep(60)' & plain=$!; "
                          "setsid /usr/bin/python3 -c 'import time; time.sleep(60)' & "
                          "echo $$ $plain $!; wait"},
                         env);
  std::istringstream in(traced.read_line(20s));
  std::vector<pid_t> tree;
  for (pid_t p; in >> p;) tree.push_back(p);
  ASSERT_EQ(tree.size(), 3u);
  ::kill(traced.pid(), SIGTERM);
  int status = traced.finish();
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 128 + SIGTERM) << status;
  const auto deadline = std::chrono::steady_clock::now() + 1s;
  while (std::chrono::steady_clock::now() < deadline &&
         std::any_of(tree.begin(), tree.end(), ft::is_alive)) {
    std::this_thread::sleep_for(10ms);
  }
  for (pid_t p : tree) {
    EXPECT_FALSE(ft::is_alive(p)) << p << " outlived forkguard trace";
    if (ft::is_alive(p)) ::kill(p, SIGKILL);
  }
  EXPECT_TRUE(std::filesystem::is_empty(tmp)) << "a file is left in " << tmp;
}

TEST_F(Trace, TheLibraryChangesNothingInAProgramThatNeverTouchesCuda) {
  env_["LD_PRELOAD"] = FORKGUARD_TRACE_LIBRARY;
  auto r = ft::run({"/bin/sh", "-c", "echo hi; /bin/true && echo done"}, env_);
  EXPECT_EQ(r.exit_code, 0);
  EXPECT_EQ(r.out, "hi\ndone\n");
  EXPECT_EQ(r.err, "");
}

// --- GNU OpenMP's thread pool ------------------------------------------------------------------

std::string openmp_site(const std::string& function, const std::string& marker) {
  return function + " at " + kOpenMpSource + ":" + std::to_string(line_of(kOpenMpSource, marker));
}

TEST_F(Trace, ForkWithAnOpenMpPoolNamesTheParallelCallSiteAndGnuOpenMp) {
  auto r = trace({}, {kTraceOpenMp, "parallel", "fork-exit"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "parallel ran on 2 threads\nchild exited 0\n");
  const std::string pool_site = openmp_site("start_openmp_pool", "trace-test: parallel site");
  const std::string fork_site = openmp_site("fork_child_that_exits", "trace-test: fork site");
  EXPECT_TRUE(contains(r.err,
                       " while GNU OpenMP's thread pool was alive in it (verdict "
                       "openmp_pool): the child hangs for ever at its first OpenMP "
                       "parallel region"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "fork() called at " + fork_site + ":\n")) << r.err;
  EXPECT_TRUE(contains(r.err, "GNU OpenMP's thread pool was started in PID ")) << r.err;
  EXPECT_TRUE(contains(r.err, " at " + pool_site + " (pthread_create from libgomp.so.1):\n"))
      << r.err;
  // The pool's stack: libgomp's own frames, then the helper's, down to main().
  EXPECT_TRUE(contains(r.err, "[libgomp.so.1+")) << r.err;
  EXPECT_TRUE(contains(r.err, " " + pool_site + "  [trace_openmp+")) << r.err;
  EXPECT_TRUE(contains(r.err, "evidence (forkguard probe, verdict openmp_pool):\n")) << r.err;
  EXPECT_TRUE(contains(r.err, "    - openmp_pool: ")) << r.err;
  EXPECT_TRUE(contains(r.err, "torch.set_num_threads(1)")) << r.err;
  EXPECT_TRUE(contains(r.err, "OMP_NUM_THREADS=1")) << r.err;
  EXPECT_TRUE(contains(r.err, "spawn or a fork server")) << r.err;
  EXPECT_TRUE(contains(r.err, "forkguard.guard()")) << r.err;
  EXPECT_FALSE(contains(r.err, "CUDA was initialized")) << r.err;
  // The summary, last.
  EXPECT_TRUE(contains(r.err, "forkguard trace: GNU OpenMP's thread pool was started in PID "))
      << r.err;
  EXPECT_TRUE(contains(r.err, " forked 1 time while it was alive (first at " + fork_site + ")"))
      << r.err;
}

TEST_F(Trace, NoOpenMpReportWithoutAPoolOrWhenTheChildExecs) {
  // A fork with no pool (after a thread that is not libgomp's): no event, no summary at all.
  for (auto steps : std::vector<std::vector<std::string>>{{"fork-exit"}, {"thread", "fork-exit"}}) {
    steps.insert(steps.begin(), kTraceOpenMp);
    auto r = trace({}, steps);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.out, "child exited 0\n") << steps[1];
    EXPECT_EQ(r.err, "") << steps[1];
  }
  // A pool, then fork-then-exec: nothing but the summary, saying so.
  auto quiet = trace({"--quiet"}, {kTraceOpenMp, "parallel", "fork-exec"});
  EXPECT_EQ(quiet.exit_code, 0) << quiet.err;
  EXPECT_EQ(quiet.out, "parallel ran on 2 threads\nchild exited 0\n");
  EXPECT_EQ(quiet.err, "");
  auto r = trace({}, {kTraceOpenMp, "parallel", "fork-exec"});
  EXPECT_TRUE(contains(r.err,
                       "forkguard trace: nothing to report: no fork while GNU OpenMP's thread "
                       "pool was alive (started in PID "))
      << r.err;
  EXPECT_TRUE(contains(
      r.err, " at " + openmp_site("start_openmp_pool", "trace-test: parallel site") + ").\n"))
      << r.err;
}

TEST_F(Trace, JsonHasTheOpenMpPoolAndEachForkWhileItWasAlive) {
  const std::string path = dir_.path() + "/events.json";
  auto r = trace({"--json", path}, {kTraceOpenMp, "parallel", "fork-exit", "fork-exit"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(count(r.err, "fork() called at"), 1u) << r.err;
  EXPECT_EQ(count(r.err, "forked again while GNU OpenMP's thread pool was alive"), 1u) << r.err;
  EXPECT_TRUE(contains(r.err, " forked 2 times while it was alive")) << r.err;
  std::ifstream in(path);
  json doc = json::parse(in);
  EXPECT_EQ(doc["found"], true);
  auto by_kind = events_by_kind(doc);
  ASSERT_EQ(by_kind["openmp_pool"].size(), 1u) << doc.dump(1);
  ASSERT_EQ(by_kind["openmp_fork"].size(), 2u) << doc.dump(1);
  EXPECT_EQ(by_kind.count("dirty_fork"), 0u);
  const json& pool = by_kind["openmp_pool"][0];
  EXPECT_EQ(pool["what"], "pthread_create from libgomp.so.1");
  EXPECT_EQ(pool["call"], "pthread_create");
  EXPECT_TRUE(contains(pool["library"], "libgomp.so.1")) << pool.dump();
  EXPECT_EQ(pool["site"], openmp_site("start_openmp_pool", "trace-test: parallel site"));
  json helper_frame;
  for (const auto& f : pool["native_frames"]) {
    if (!contains(f["library"], "libgomp")) {
      helper_frame = f;
      break;
    }
  }
  EXPECT_EQ(helper_frame["function"], "start_openmp_pool") << pool.dump();
  EXPECT_EQ(helper_frame["line"], line_of(kOpenMpSource, "trace-test: parallel site"));
  std::set<int> children;
  for (size_t i = 0; i < 2; ++i) {
    const json& fork = by_kind["openmp_fork"][i];
    EXPECT_EQ(fork["pid"], pool["pid"]);
    EXPECT_EQ(fork["verdict"], "openmp_pool");
    EXPECT_EQ(fork["pool_site"], pool["site"]);
    EXPECT_EQ(fork["repeat"], i == 0 ? 0 : 1);
    EXPECT_EQ(fork["native_frames"][0]["function"], "fork_child_that_exits");
    EXPECT_LE(pool["time"].get<double>(), fork["time"].get<double>());
    children.insert(fork["child_pid"].get<int>());
  }
  EXPECT_EQ(children.size(), 2u);
}

// --- Python ------------------------------------------------------------------------------------

TEST_F(Trace, PythonForkNamesTheInitFunctionsLineAndTheProcessStartLine) {
  use_plain_driver();
  auto r = trace({}, {kPython, kPythonFork, "fork"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "parent cuInit = 0\nchild exited 3\n");
  const int init_line = line_of(kPythonFork, "# marker: init");
  const int start_line = line_of(kPythonFork, "# marker: start");
  const int worker_line = line_of(kPythonFork, "# marker: worker");
  EXPECT_TRUE(contains(
      r.err, "fork() called at " + kPythonFork + ":" + std::to_string(start_line) + " in main():"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "CUDA was initialized in PID")) << r.err;
  EXPECT_TRUE(contains(r.err, " at " + kPythonFork + ":" + std::to_string(init_line) +
                                  " in init_cuda() (cuInit(0) = CUDA_SUCCESS)"))
      << r.err;
  // Python-style frames, the way a traceback prints them.
  EXPECT_TRUE(contains(r.err, "File \"" + kPythonFork + "\", line " + std::to_string(init_line) +
                                  ", in init_cuda\n"))
      << r.err;
  EXPECT_TRUE(contains(
      r.err, "File \"" + kPythonFork + "\", line " + std::to_string(start_line) + ", in main\n"))
      << r.err;
  // The worker's own touch, named in the child's report.
  EXPECT_TRUE(contains(r.err, "touched CUDA (cuInit) at " + kPythonFork + ":" +
                                  std::to_string(worker_line) + " in worker()"))
      << r.err;
}

TEST_F(Trace, PythonSpawnAndForkserverReportNothing) {
  use_plain_driver();
  for (const char* method : {"spawn", "forkserver"}) {
    auto r = trace({"--quiet"}, {kPython, kPythonFork, method});
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_EQ(r.out, "parent cuInit = 0\nchild exited 0\n") << method;
    EXPECT_EQ(r.err, "") << method;
  }
}

TEST_F(Trace, PythonJsonHasPythonFrames) {
  use_plain_driver();
  const std::string path = dir_.path() + "/events.json";
  auto r = trace({"--quiet", "--json", path}, {kPython, kPythonFork, "fork"});
  ASSERT_EQ(r.exit_code, 0) << r.err;
  std::ifstream in(path);
  json doc = json::parse(in);
  bool init_seen = false;
  for (const auto& e : doc["events"]) {
    if (e["event"] != "cuda_init") continue;
    init_seen = true;
    ASSERT_FALSE(e["python_frames"].empty()) << e.dump();
    EXPECT_EQ(e["python_frames"][0]["file"], kPythonFork);
    EXPECT_EQ(e["python_frames"][0]["function"], "init_cuda");
    EXPECT_EQ(e["python_frames"][0]["line"], line_of(kPythonFork, "# marker: init"));
  }
  EXPECT_TRUE(init_seen) << doc.dump(1);
}

// torch 2.14's wheel brings its own libgomp.so.1; its first parallel CPU op starts the pool.
bool have_torch_python() {
  return ::access(kTorchPython.c_str(), X_OK) == 0 &&
         ft::run({kTorchPython, "-c", "import torch"}, {}, 180s).exit_code == 0;
}

TEST_F(Trace, TorchParallelOpThenForkNamesThePythonLineOfTheOp) {
  if (!have_torch_python()) GTEST_SKIP() << "no torch 2.x interpreter at " << kTorchPython;
  env_["OMP_NUM_THREADS"] = "2";  // a pool of its own whatever the machine's core count
  auto r = trace({}, {kTorchPython, kPythonOpenMp}, 180s);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, ": child exited 0\n")) << r.out;
  const std::string op_line = std::to_string(line_of(kPythonOpenMp, "# marker: parallel op"));
  const std::string fork_line = std::to_string(line_of(kPythonOpenMp, "# marker: fork"));
  EXPECT_TRUE(
      contains(r.err, "fork() called at " + kPythonOpenMp + ":" + fork_line + " in main():"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "GNU OpenMP's thread pool was started in PID ")) << r.err;
  EXPECT_TRUE(contains(
      r.err, " at " + kPythonOpenMp + ":" + op_line + " in warm_up() (pthread_create from libgomp"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "File \"" + kPythonOpenMp + "\", line " + op_line + ", in warm_up\n"))
      << r.err;
  EXPECT_TRUE(contains(r.err, "- openmp_pool: ")) << r.err;
  EXPECT_TRUE(contains(r.err, "torch.set_num_threads(1)")) << r.err;
}

TEST_F(Trace, TorchWithOneOpenMpThreadForksWithoutAReport) {
  if (!have_torch_python()) GTEST_SKIP() << "no torch 2.x interpreter at " << kTorchPython;
  env_["OMP_NUM_THREADS"] = "1";  // no pool is started
  const std::string path = dir_.path() + "/events.json";
  auto r = trace({"--json", path}, {kTorchPython, kPythonOpenMp}, 180s);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(contains(r.out, ": child exited 0\n")) << r.out;
  EXPECT_FALSE(contains(r.err, "GNU OpenMP")) << r.err;
  EXPECT_FALSE(contains(r.err, "forked child PID")) << r.err;
  std::ifstream in(path);
  json doc = json::parse(in);
  EXPECT_EQ(doc["found"], false);
  for (const auto& e : doc["events"]) {
    EXPECT_NE(e["event"], "openmp_pool") << e.dump();
    EXPECT_NE(e["event"], "openmp_fork") << e.dump();
  }
}

TEST_F(Trace, ImportTorchPrintsNothingAndExitsZero) {
  if (ft::run({kPython, "-c", "import torch"}).exit_code != 0) {
    GTEST_SKIP() << "Debian's python3-torch is not installed";
  }
  auto r = trace({"--quiet"}, {kPython, "-c", "import torch"});
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(r.out, "");
  EXPECT_EQ(r.err, "");
  // Without --quiet too: Debian's CPU torch never comes near the driver, so there is nothing to
  // sum up (a program that loads or initializes CUDA gets the one-line summary).
  auto plain = trace({}, {kPython, "-c", "import torch"});
  EXPECT_EQ(plain.exit_code, 0) << plain.err;
  EXPECT_EQ(plain.out, "");
  EXPECT_EQ(plain.err, "");
}

}  // namespace
