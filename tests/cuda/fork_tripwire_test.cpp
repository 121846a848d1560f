// The CUDA fork tripwire (src/cuda/fork_tripwire.hpp) on the test driver, whose cuInit returns
// CUDA_ERROR_NOT_INITIALIZED in a child forked after its parent's cuInit, as the real one does.
#include "cuda/fork_tripwire.hpp"

#include <dlfcn.h>
#include <gtest/gtest.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <unistd.h>

#include "forkguard/cuda/driver.hpp"
#include "paths.hpp"

namespace cuda = forkguard::cuda;
namespace ft = forkguard::testing;

// gtest runs the tests in definition order: this one before any loads the driver.
TEST(CudaForkTripwire, WithoutADriverMappedItSaysWhy) {
  EXPECT_EQ(cuda::fork_tripwire_unavailable(), "no CUDA driver is mapped in this process");
  try {
    cuda::arm_fork_tripwire();
    FAIL() << "arming without a driver must throw";
  } catch (const forkguard::Error& e) {
    EXPECT_STREQ(e.what(),
                 "cannot arm the CUDA fork tripwire: no CUDA driver is mapped in this process");
  }
  EXPECT_EQ(cuda::fork_tripwire_trips(), 0u);
}

// In a fork child of an initialized parent: every cuInit, through the Driver's table or through
// a pointer another library resolved itself, returns the driver's own error and is counted; the
// parent's driver is untouched. The child's findings come back as its exit code.
TEST(CudaForkTripwire, ASwallowedCuInitInAPoisonedForkIsCounted) {
  ft::TempDir dir;
  ::setenv("FAKE_CUDA_DEV_DIR", (dir.path() + "/dev").c_str(), 1);
  ::setenv("FORKGUARD_CUDA_DRIVER", ft::kFakeCuda.c_str(), 1);
  const auto& drv = cuda::Driver::load();
  ASSERT_EQ(drv.api().cuInit(0), cuda::CUDA_SUCCESS);
  ASSERT_EQ(cuda::fork_tripwire_unavailable(), "");
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    int code = 0;
    if (drv.api().cuInit(0) != cuda::CUDA_ERROR_NOT_INITIALIZED) code |= 1;  // the driver's
    if (cuda::fork_tripwire_trips() != 0) code |= 2;                         // not yet armed
    try {
      cuda::arm_fork_tripwire();
      cuda::arm_fork_tripwire();  // idempotent
    } catch (...) {
      ::_exit(100);
    }
    if (drv.api().cuInit(0) != cuda::CUDA_ERROR_NOT_INITIALIZED) code |= 4;
    void* own = ::dlopen(ft::kFakeCuda.c_str(), RTLD_NOW | RTLD_NOLOAD);
    auto* other = own != nullptr
                      ? reinterpret_cast<cuda::CUresult (*)(unsigned)>(::dlsym(own, "cuInit"))
                      : nullptr;
    if (other == nullptr || other(0) != cuda::CUDA_ERROR_NOT_INITIALIZED) code |= 8;
    if (cuda::fork_tripwire_trips() != 2) code |= 16;
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0) << "bits: 1 driver's error, 2 counted unarmed, 4 armed "
                                       "error, 8 dlsym's pointer, 16 count, 100 arm threw";
  EXPECT_EQ(drv.api().cuInit(0), cuda::CUDA_SUCCESS) << "the parent's cuInit is its own";
  EXPECT_EQ(cuda::fork_tripwire_trips(), 0u);
}
