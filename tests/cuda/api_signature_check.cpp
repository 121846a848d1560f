// Compile-time check: every driver function forkguard declares matches the toolkit's cuda.h in
// arity and in the size and category of each parameter and return type, and the CUresult values
// we name equal the toolkit's. Built only where cuda.h is installed; if it compiles, it passes.
#include <cuda.h>

#include <cstdio>
#include <type_traits>

#include "forkguard/cuda/api.hpp"

namespace {

template <typename A, typename B>
constexpr bool compatible() {
  if constexpr (std::is_pointer_v<A> && std::is_pointer_v<B>) {
    using PA = std::remove_cv_t<std::remove_pointer_t<A>>;
    using PB = std::remove_cv_t<std::remove_pointer_t<B>>;
    if constexpr (std::is_class_v<PA> || std::is_class_v<PB>) {
      return std::is_same_v<PA, PB>;  // opaque handles: the very same struct
    } else if constexpr (std::is_void_v<PA> || std::is_void_v<PB>) {
      return std::is_void_v<PA> && std::is_void_v<PB>;
    } else {
      return std::is_const_v<std::remove_pointer_t<A>> ==
                 std::is_const_v<std::remove_pointer_t<B>> &&
             compatible<PA, PB>();
    }
  } else if constexpr ((std::is_integral_v<A> || std::is_enum_v<A>)&&(std::is_integral_v<B> ||
                                                                      std::is_enum_v<B>)) {
    return sizeof(A) == sizeof(B);
  } else {
    return std::is_same_v<A, B>;
  }
}

template <typename F, typename G>
struct same_abi : std::false_type {};
template <typename R1, typename... A, typename R2, typename... B>
struct same_abi<R1 (*)(A...), R2 (*)(B...)> {
  static constexpr bool value =
      sizeof...(A) == sizeof...(B) && compatible<R1, R2>() && (compatible<A, B>() && ...);
};
template <typename R1, typename R2>
struct same_abi<R1 (*)(), R2 (*)()> {
  static constexpr bool value = compatible<R1, R2>();
};

}  // namespace

#define FORKGUARD_CHECK(name, ret, params)                                       \
  static_assert(same_abi<forkguard::cuda::PFN_##name, decltype(&::name)>::value, \
                #name " differs from cuda.h");
FORKGUARD_CUDA_DRIVER_FUNCTIONS(FORKGUARD_CHECK)

#define FORKGUARD_CHECK_VALUE(v) \
  static_assert(static_cast<int>(forkguard::cuda::v) == static_cast<int>(::v), #v);
FORKGUARD_CHECK_VALUE(CUDA_SUCCESS)
FORKGUARD_CHECK_VALUE(CUDA_ERROR_INVALID_VALUE)
FORKGUARD_CHECK_VALUE(CUDA_ERROR_OUT_OF_MEMORY)
FORKGUARD_CHECK_VALUE(CUDA_ERROR_NOT_INITIALIZED)
FORKGUARD_CHECK_VALUE(CUDA_ERROR_DEINITIALIZED)
FORKGUARD_CHECK_VALUE(CUDA_ERROR_STUB_LIBRARY)
FORKGUARD_CHECK_VALUE(CUDA_ERROR_NO_DEVICE)
FORKGUARD_CHECK_VALUE(CUDA_ERROR_INVALID_DEVICE)
FORKGUARD_CHECK_VALUE(CUDA_ERROR_INVALID_CONTEXT)
FORKGUARD_CHECK_VALUE(CUDA_ERROR_CONTEXT_ALREADY_CURRENT)
FORKGUARD_CHECK_VALUE(CUDA_ERROR_INVALID_HANDLE)
FORKGUARD_CHECK_VALUE(CUDA_ERROR_NOT_FOUND)
FORKGUARD_CHECK_VALUE(CUDA_ERROR_NOT_READY)
FORKGUARD_CHECK_VALUE(CUDA_ERROR_ILLEGAL_ADDRESS)
FORKGUARD_CHECK_VALUE(CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED)
FORKGUARD_CHECK_VALUE(CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED)
FORKGUARD_CHECK_VALUE(CUDA_ERROR_NOT_PERMITTED)
FORKGUARD_CHECK_VALUE(CUDA_ERROR_NOT_SUPPORTED)
FORKGUARD_CHECK_VALUE(CUDA_ERROR_UNKNOWN)
FORKGUARD_CHECK_VALUE(CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)
FORKGUARD_CHECK_VALUE(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
FORKGUARD_CHECK_VALUE(CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
static_assert(forkguard::cuda::kCuEventDisableTiming == CU_EVENT_DISABLE_TIMING);
static_assert(forkguard::cuda::kCuStreamNonBlocking == CU_STREAM_NON_BLOCKING);

int main() {
  std::printf("driver declarations match cuda.h (CUDA_VERSION %d)\n", CUDA_VERSION);
  return 0;
}
