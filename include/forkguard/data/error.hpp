// The data loader's errors. Every one names what failed: the sample (index and key), the worker
// (id and PID), the batch and epoch.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "forkguard/error.hpp"

namespace forkguard::data {

// A sample could not be read or transformed (bad_sample = error), or the loader was misused.
class DataError : public Error {
 public:
  DataError(std::string message, size_t index = npos, std::string key = {})
      : Error(std::move(message)), index_(index), key_(std::move(key)) {}
  static constexpr size_t npos = static_cast<size_t>(-1);
  size_t index() const noexcept { return index_; }  // npos when no single sample is at fault
  const std::string& key() const noexcept { return key_; }

 private:
  size_t index_;
  std::string key_;
};

// A worker died (crash, kill, exit) or stopped itself (CUDA found in a process worker). The
// message names the worker, its PID, the signal or exit code and the samples it held.
class WorkerError : public Error {
 public:
  WorkerError(std::string message, int worker, pid_t pid, std::vector<size_t> indices)
      : Error(std::move(message)), worker_(worker), pid_(pid), indices_(std::move(indices)) {}
  int worker() const noexcept { return worker_; }
  pid_t pid() const noexcept { return pid_; }
  const std::vector<size_t>& indices() const noexcept { return indices_; }

 private:
  int worker_;
  pid_t pid_;
  std::vector<size_t> indices_;
};

// A batch was not ready within LoaderOptions::timeout; names the batch and the worker.
class TimeoutError : public Error {
 public:
  using Error::Error;
};

}  // namespace forkguard::data
