#include "forkguard/cuda/driver.hpp"

#include <gtest/gtest.h>
#include <stdlib.h>

#include "paths.hpp"

namespace fg = forkguard;
namespace cuda = forkguard::cuda;

TEST(CudaResult, NamesAndTextsFollowTheDriver) {
  EXPECT_EQ(cuda::result_name(cuda::CUDA_ERROR_NOT_INITIALIZED), "CUDA_ERROR_NOT_INITIALIZED");
  EXPECT_EQ(cuda::result_string(cuda::CUDA_ERROR_NOT_INITIALIZED), "initialization error");
  EXPECT_EQ(cuda::result_name(cuda::CUDA_ERROR_NO_DEVICE), "CUDA_ERROR_NO_DEVICE");
  EXPECT_EQ(cuda::result_name(static_cast<cuda::CUresult>(4242)), "CUresult(4242)");
}

TEST(CudaResult, DriverErrorNamesCallResultAndText) {
  cuda::DriverError e("cuInit", cuda::CUDA_ERROR_NOT_INITIALIZED);
  EXPECT_STREQ(e.what(), "cuInit failed: CUDA_ERROR_NOT_INITIALIZED (3): initialization error");
  EXPECT_EQ(e.call(), "cuInit");
  EXPECT_EQ(e.result(), cuda::CUDA_ERROR_NOT_INITIALIZED);
  const fg::Error& base = e;  // part of the public hierarchy
  EXPECT_NE(std::string(base.what()).find("cuInit"), std::string::npos);
}

// The test process itself never maps the driver until this test loads it, so order matters:
// the "not mapped" expectations come first (gtest runs tests in definition order).
TEST(CudaDriver, IfMappedNeverLoads) {
  ASSERT_EQ(cuda::Driver::if_mapped(), nullptr);
  ::setenv("FORKGUARD_CUDA_DRIVER", forkguard::testing::kFakeCuda.c_str(), 1);
  EXPECT_EQ(cuda::Driver::if_mapped(), nullptr) << "if_mapped() must not dlopen the driver";
}

TEST(CudaDriver, MissingLibraryIsALoadErrorNamingIt) {
  ::setenv("FORKGUARD_CUDA_DRIVER", "/nonexistent/libcuda.so.1", 1);
  try {
    cuda::Driver::load();
    FAIL() << "load() of a missing library must throw";
  } catch (const cuda::LoadError& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/libcuda.so.1"), std::string::npos)
        << e.what();
    EXPECT_NE(std::string(e.what()).find("FORKGUARD_CUDA_DRIVER"), std::string::npos) << e.what();
  }
}

TEST(CudaDriver, LibraryWithoutTheDriverSymbolsIsRefused) {
  // libnvidia-ml is a real shared object, but not a CUDA driver.
  ::setenv("FORKGUARD_CUDA_DRIVER", forkguard::testing::kFakeNvml.c_str(), 1);
  try {
    cuda::Driver::load();
    FAIL() << "a library lacking cuInit must be refused";
  } catch (const cuda::LoadError& e) {
    EXPECT_NE(std::string(e.what()).find("lacks required symbols: cuInit"), std::string::npos)
        << e.what();
  }
}

TEST(CudaDriver, LoadsThePathFromTheEnvironmentAndChecksResults) {
  forkguard::testing::TempDir dir;
  ::setenv("FAKE_CUDA_DEV_DIR", (dir.path() + "/dev").c_str(), 1);
  ::setenv("FORKGUARD_CUDA_DRIVER", forkguard::testing::kFakeCuda.c_str(), 1);
  const auto& drv = cuda::Driver::load();
  EXPECT_EQ(drv.path(), forkguard::testing::kFakeCuda);
  EXPECT_EQ(&drv, cuda::Driver::if_mapped());
  EXPECT_EQ(&drv, &cuda::Driver::load()) << "one driver per process";
  int count = 0;
  try {
    drv.check(drv.api().cuDeviceGetCount(&count), "cuDeviceGetCount");
    FAIL() << "cuDeviceGetCount before cuInit must fail";
  } catch (const cuda::DriverError& e) {
    EXPECT_EQ(e.result(), cuda::CUDA_ERROR_NOT_INITIALIZED);
    EXPECT_NE(std::string(e.what()).find("cuDeviceGetCount failed"), std::string::npos);
  }
  drv.check(drv.api().cuInit(0), "cuInit");
  drv.check(drv.api().cuDeviceGetCount(&count), "cuDeviceGetCount");
  EXPECT_EQ(count, 2);
}
