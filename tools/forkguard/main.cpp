// forkguard: the command-line tool. It parses flags, fills option structs and calls the library.
#include <fmt/format.h>
#include <CLI/CLI.hpp>

#include <cstdio>
#include <string>

#include "forkguard/doctor/report.hpp"
#include "forkguard/probe/cuda_state.hpp"
#include "forkguard/version.hpp"

namespace {

int doctor(int pid, bool json) {
  using namespace forkguard;
  try {
    // Probe first: what the doctor itself loads for the environment section (NVML) must not
    // appear in its own verdict.
    auto state = pid > 0 ? probe::pid(pid) : probe::self();
    auto report = doctor::diagnose(std::move(state));
    std::fputs((json ? doctor::to_json(report) + "\n" : doctor::to_text(report)).c_str(), stdout);
    return doctor::exit_code(report);
  } catch (const probe::ProbeError& e) {
    fmt::print(stderr, "forkguard doctor: {}\n", e.what());
    return doctor::kExitUsage;
  }
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"forkguard: multi-process GPU work that survives fork"};
  app.set_version_flag("--version", std::string(forkguard::kVersion));
  app.require_subcommand(1);

  auto* doc = app.add_subcommand(
      "doctor",
      "Tell whether a process holds CUDA driver state (is fork safe?), with the evidence and the "
      "cure. Exit code: 0 fork-safe, 3 fork-unsafe, 2 usage or permission error.");
  int pid = 0;
  bool json = false;
  doc->add_option("--pid", pid, "Process to inspect (default: this doctor process itself)")
      ->check(CLI::PositiveNumber);
  doc->add_flag("--json", json,
                "Print one JSON object: pid, verdict, fork_safe, evidence, advice, environment");

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    app.exit(e);
    return forkguard::doctor::kExitUsage;
  }

  try {
    if (doc->parsed()) return doctor(pid, json);
  } catch (const forkguard::Error& e) {
    fmt::print(stderr, "forkguard: {}\n", e.what());
    return 1;
  }
  return 0;
}
