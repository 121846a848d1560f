#include "forkguard/error.hpp"

#include <cstring>

namespace forkguard {

SystemError::SystemError(const std::string& what_failed, int err)
    : Error(what_failed + ": " + std::strerror(err)), err_(err) {}

}  // namespace forkguard
