#include <forkguard/probe/cuda_state.hpp>

#include <cstdio>
#include <string>

int main() {
  auto state = forkguard::probe::self();
  std::printf("verdict %s\n", std::string(forkguard::probe::to_string(state.verdict)).c_str());
  return state.fork_safe ? 0 : 3;
}
