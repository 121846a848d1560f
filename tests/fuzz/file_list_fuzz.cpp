// File lists ("path label" per line): the bytes as a list file, parsed by FileList, then its
// description sent as a process worker gets it (JSON text) and rebuilt by the registered factory,
// which must give the same files and labels.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <nlohmann/json.hpp>

#include "forkguard/data/error.hpp"
#include "forkguard/data/image_folder.hpp"
#include "memfd.hpp"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static forkguard::fuzz::MemFile file;
  const std::string path = file.set(data, size);
  try {
    forkguard::data::FileList list(path);
    const auto d = list.describe();
    const nlohmann::json wire = {{"type", d->type}, {"params", d->params}};
    const auto back = nlohmann::json::parse(wire.dump());
    const auto rebuilt = forkguard::data::make_dataset({back.at("type"), back.at("params")});
    const auto* same = dynamic_cast<const forkguard::data::FileList*>(rebuilt.get());
    if (same == nullptr || same->files().size() != list.files().size()) std::abort();
    for (size_t i = 0; i < list.files().size(); ++i) {
      if (same->files()[i].path != list.files()[i].path ||
          same->files()[i].label != list.files()[i].label) {
        std::abort();
      }
    }
  } catch (const forkguard::Error&) {
  }
  return 0;
}
