// The test driver is a fixture that claims the real driver's fork semantics; these tests hold it
// to that claim.
#include <dirent.h>
#include <dlfcn.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fstream>
#include <vector>

#include "forkguard/cuda/driver.hpp"
#include "paths.hpp"

namespace cuda = forkguard::cuda;
namespace ft = forkguard::testing;

namespace {

std::vector<std::string> thread_names() {
  std::vector<std::string> out;
  DIR* d = ::opendir("/proc/self/task");
  while (dirent* e = ::readdir(d)) {
    if (e->d_name[0] == '.') continue;
    std::ifstream in(std::string("/proc/self/task/") + e->d_name + "/comm");
    std::string name;
    std::getline(in, name);
    out.push_back(name);
  }
  ::closedir(d);
  return out;
}

std::vector<std::string> open_targets() {
  std::vector<std::string> out;
  for (int fd : ft::open_fds()) {
    char buf[4096];
    ssize_t n = ::readlink(("/proc/self/fd/" + std::to_string(fd)).c_str(), buf, sizeof buf);
    if (n > 0) out.emplace_back(buf, static_cast<size_t>(n));
  }
  return out;
}

class FakeCuda : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    dir_ = new ft::TempDir;
    ::setenv("FAKE_CUDA_DEV_DIR", (dir_->path() + "/dev").c_str(), 1);
    ::setenv("FAKE_CUDA_LOG", (dir_->path() + "/calls.log").c_str(), 1);
    ::setenv("FORKGUARD_CUDA_DRIVER", ft::kFakeCuda.c_str(), 1);
    ::unsetenv("CUDA_VISIBLE_DEVICES");
    ::unsetenv("FAKE_CUDA_DEVICES");
  }
  static void TearDownTestSuite() { delete dir_; }
  const cuda::DriverApi& init() {
    const auto& drv = cuda::Driver::load();
    drv.check(drv.api().cuInit(0), "cuInit");
    return drv.api();
  }
  static ft::TempDir* dir_;
};
ft::TempDir* FakeCuda::dir_ = nullptr;

}  // namespace

TEST(FakeCudaBeforeInit, CallsFailAndChangeNothingAndAreLogged) {
  ft::TempDir dir;
  ft::Interactive h({ft::kCudaStage}, ft::fake_cuda_env(dir.path()));
  EXPECT_EQ(h.ask("load"), "ok");
  EXPECT_EQ(h.ask("count"), "error CUDA_ERROR_NOT_INITIALIZED");
  EXPECT_EQ(h.ask("ctx"), "error CUDA_ERROR_NOT_INITIALIZED");
  EXPECT_EQ(h.ask("count"), "error CUDA_ERROR_NOT_INITIALIZED") << "a failed call changed state";
  auto pid = std::to_string(h.pid());
  std::string log = ft::read_file(dir.path() + "/calls.log");
  EXPECT_NE(log.find(pid + " cuDeviceGetCount 3\n"), std::string::npos) << log;
  EXPECT_NE(log.find(pid + " cuDevicePrimaryCtxRetain 3\n"), std::string::npos) << log;
  EXPECT_EQ(log.find("cuInit"), std::string::npos) << log;
  EXPECT_EQ(h.ask("init"), "ok");
  EXPECT_EQ(h.ask("count"), "count 2");
}

TEST(FakeCudaBeforeInit, DeviceCountFollowsTheEnvironmentAndCudaVisibleDevices) {
  ft::TempDir dir;
  struct Case {
    std::optional<std::string> devices, visible;
    std::string expect;
  } cases[] = {
      {"3", std::nullopt, "count 3"},
      {"4", "2,0", "count 2"},
      {"2", "0,7,1", "count 1"},  // stops at the out-of-range entry, as the driver does
      {"2", "GPU-fa4e0000-0000-4000-8000-000000000001", "count 1"},
      {"2", "", "error CUDA_ERROR_NO_DEVICE"},
      {"0", std::nullopt, "error CUDA_ERROR_NO_DEVICE"},
  };
  for (const auto& c : cases) {
    auto env = ft::fake_cuda_env(dir.path());
    env["FAKE_CUDA_DEVICES"] = c.devices;
    env["CUDA_VISIBLE_DEVICES"] = c.visible;
    ft::Interactive h({ft::kCudaStage}, env);
    auto init = h.ask("init");
    EXPECT_EQ(init == "ok" ? h.ask("count") : init, c.expect)
        << "FAKE_CUDA_DEVICES=" << c.devices.value_or("(unset)")
        << " CUDA_VISIBLE_DEVICES=" << c.visible.value_or("(unset)");
  }
}

TEST_F(FakeCuda, InitOpensDeviceFilesAndStartsTheEventThread) {
  init();
  auto targets = open_targets();
  for (const char* name : {"nvidiactl", "nvidia-uvm", "nvidia0", "nvidia1"}) {
    std::string path = dir_->path() + "/dev/" + name;
    EXPECT_NE(std::find(targets.begin(), targets.end(), path), targets.end()) << path;
  }
  auto threads = thread_names();
  EXPECT_NE(std::find(threads.begin(), threads.end(), "cuda-EvtHandlr"), threads.end());
}

TEST_F(FakeCuda, EveryCallInAForkedChildReturnsNotInitialized) {
  const auto& api = init();
  int pipefd[2];
  ASSERT_EQ(::pipe(pipefd), 0);
  pid_t child = ::fork();
  if (child == 0) {
    int results[5];
    int n = 0;
    cuda::CUcontext ctx = nullptr;
    cuda::CUdeviceptr p = 0;
    results[0] = api.cuInit(0);
    results[1] = api.cuDeviceGetCount(&n);
    results[2] = api.cuDriverGetVersion(&n);
    results[3] = api.cuDevicePrimaryCtxRetain(&ctx, 0);
    results[4] = api.cuMemAlloc_v2(&p, 16);
    ssize_t w = ::write(pipefd[1], results, sizeof results);
    ::_exit(w == sizeof results ? 0 : 1);
  }
  ::close(pipefd[1]);
  int results[5] = {};
  ASSERT_EQ(::read(pipefd[0], results, sizeof results), static_cast<ssize_t>(sizeof results));
  ::close(pipefd[0]);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  for (int r : results) EXPECT_EQ(r, cuda::CUDA_ERROR_NOT_INITIALIZED);
  int n = 0;
  EXPECT_EQ(api.cuDeviceGetCount(&n), cuda::CUDA_SUCCESS) << "the parent is unaffected";
}

TEST_F(FakeCuda, ContextsMapTheirDeviceFile) {
  const auto& api = init();
  cuda::CUcontext ctx = nullptr;
  ASSERT_EQ(api.cuDevicePrimaryCtxRetain(&ctx, 1), cuda::CUDA_SUCCESS);
  std::string maps = ft::read_file("/proc/self/maps");
  EXPECT_NE(maps.find(dir_->path() + "/dev/nvidia1"), std::string::npos);
  unsigned flags = 0;
  int active = 0;
  ASSERT_EQ(api.cuDevicePrimaryCtxGetState(1, &flags, &active), cuda::CUDA_SUCCESS);
  EXPECT_EQ(active, 1);
  ASSERT_EQ(api.cuDevicePrimaryCtxRelease_v2(1), cuda::CUDA_SUCCESS);
  ASSERT_EQ(api.cuDevicePrimaryCtxGetState(1, &flags, &active), cuda::CUDA_SUCCESS);
  EXPECT_EQ(active, 0);
  EXPECT_EQ(ft::read_file("/proc/self/maps").find(dir_->path() + "/dev/nvidia1"),
            std::string::npos);
}

TEST_F(FakeCuda, MemoryIsHostBackedAndCopiesAreExact) {
  const auto& api = init();
  cuda::CUdeviceptr d = 0;
  EXPECT_EQ(api.cuMemAlloc_v2(&d, 64), cuda::CUDA_ERROR_INVALID_CONTEXT) << "needs a context";
  cuda::CUcontext ctx = nullptr;
  ASSERT_EQ(api.cuDevicePrimaryCtxRetain(&ctx, 0), cuda::CUDA_SUCCESS);
  ASSERT_EQ(api.cuCtxSetCurrent(ctx), cuda::CUDA_SUCCESS);
  std::vector<unsigned char> host(4096), back(4096);
  for (size_t i = 0; i < host.size(); ++i) host[i] = static_cast<unsigned char>(i * 31 + 7);
  ASSERT_EQ(api.cuMemHostRegister_v2(host.data(), host.size(), 0), cuda::CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemHostRegister_v2(host.data() + 8, 8, 0),
            cuda::CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED);
  ASSERT_EQ(api.cuMemAlloc_v2(&d, host.size()), cuda::CUDA_SUCCESS);
  cuda::CUstream stream = nullptr;
  cuda::CUevent done = nullptr;
  ASSERT_EQ(api.cuStreamCreate(&stream, cuda::kCuStreamNonBlocking), cuda::CUDA_SUCCESS);
  ASSERT_EQ(api.cuEventCreate(&done, cuda::kCuEventDisableTiming), cuda::CUDA_SUCCESS);
  ASSERT_EQ(api.cuMemcpyHtoDAsync_v2(d, host.data(), host.size(), stream), cuda::CUDA_SUCCESS);
  ASSERT_EQ(api.cuEventRecord(done, stream), cuda::CUDA_SUCCESS);
  ASSERT_EQ(api.cuEventSynchronize(done), cuda::CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemcpyHtoD_v2(d + 4000, host.data(), 200), cuda::CUDA_ERROR_INVALID_VALUE)
      << "copies past the allocation are refused";
  ASSERT_EQ(api.cuMemcpyDtoH_v2(back.data(), d, back.size()), cuda::CUDA_SUCCESS);
  EXPECT_EQ(host, back);
  EXPECT_EQ(api.cuMemFree_v2(d), cuda::CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemFree_v2(d), cuda::CUDA_ERROR_INVALID_VALUE) << "double free is refused";
  EXPECT_EQ(api.cuMemHostUnregister(host.data()), cuda::CUDA_SUCCESS);
  EXPECT_EQ(api.cuMemHostUnregister(host.data()), cuda::CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED);
  EXPECT_EQ(api.cuEventDestroy_v2(done), cuda::CUDA_SUCCESS);
  EXPECT_EQ(api.cuStreamDestroy_v2(stream), cuda::CUDA_SUCCESS);
  EXPECT_EQ(api.cuDevicePrimaryCtxRelease_v2(0), cuda::CUDA_SUCCESS);
}

TEST(FakeNvml, OpensControlAndGpuFilesAndReportsFakeGpus) {
  ft::TempDir dir;
  ::setenv("FAKE_CUDA_DEV_DIR", (dir.path() + "/dev").c_str(), 1);
  ::setenv("FAKE_CUDA_DEVICES", "3", 1);
  void* h = ::dlopen(ft::kFakeNvml.c_str(), RTLD_NOW | RTLD_LOCAL);
  ASSERT_NE(h, nullptr);
  auto init = reinterpret_cast<cuda::PFN_nvmlInit_v2>(::dlsym(h, "nvmlInit_v2"));
  auto count =
      reinterpret_cast<cuda::PFN_nvmlDeviceGetCount_v2>(::dlsym(h, "nvmlDeviceGetCount_v2"));
  auto shutdown = reinterpret_cast<cuda::PFN_nvmlShutdown>(::dlsym(h, "nvmlShutdown"));
  ASSERT_EQ(init(), cuda::NVML_SUCCESS);
  unsigned n = 0;
  ASSERT_EQ(count(&n), cuda::NVML_SUCCESS);
  EXPECT_EQ(n, 3u);
  auto targets = open_targets();
  EXPECT_NE(std::find(targets.begin(), targets.end(), dir.path() + "/dev/nvidiactl"),
            targets.end());
  EXPECT_EQ(std::find(targets.begin(), targets.end(), dir.path() + "/dev/nvidia-uvm"),
            targets.end())
      << "NVML never opens nvidia-uvm";
  ASSERT_EQ(shutdown(), cuda::NVML_SUCCESS);
  targets = open_targets();
  EXPECT_EQ(std::find(targets.begin(), targets.end(), dir.path() + "/dev/nvidiactl"), targets.end())
      << "nvmlShutdown closes what nvmlInit opened";
  ::unsetenv("FAKE_CUDA_DEVICES");
}
