#include "forkguard/cuda/visible_devices.hpp"

#include <fmt/format.h>

#include <set>

#include "detail/decimal.hpp"

namespace forkguard::cuda {
namespace {

std::string trim(std::string_view s) {
  auto b = s.find_first_not_of(" \t");
  auto e = s.find_last_not_of(" \t");
  return b == std::string_view::npos ? std::string() : std::string(s.substr(b, e - b + 1));
}

DeviceSelector classify(std::string text) {
  DeviceSelector sel;
  sel.text = std::move(text);
  const std::string& t = sel.text;
  if (t.rfind("GPU-", 0) == 0 && t.size() > 4) {
    sel.kind = DeviceSelector::Kind::kUuid;
  } else if (t.rfind("MIG-", 0) == 0 && t.size() > 4) {
    sel.kind = DeviceSelector::Kind::kMig;
  } else if (auto index = forkguard::detail::parse_decimal<int>(t);
             index && *index >= 0 && t.size() < 9 && t[0] != '-') {
    sel.kind = DeviceSelector::Kind::kIndex;
    sel.index = *index;
  }
  return sel;
}

}  // namespace

VisibleDevices parse_visible_devices(std::optional<std::string_view> value) {
  VisibleDevices vis;
  if (!value) return vis;
  vis.set = true;
  vis.value = std::string(*value);
  if (trim(*value).empty()) return vis;  // set but empty: no GPU visible
  std::string_view rest = *value;
  while (true) {
    auto comma = rest.find(',');
    vis.selectors.push_back(classify(trim(rest.substr(0, comma))));
    if (comma == std::string_view::npos) break;
    rest.remove_prefix(comma + 1);
  }
  return vis;
}

VisibleDevices visible_devices_from_env() {
  const char* v = std::getenv("CUDA_VISIBLE_DEVICES");
  return parse_visible_devices(v != nullptr ? std::optional<std::string_view>(v) : std::nullopt);
}

VisibleResolution resolve_visible_devices(const VisibleDevices& vis,
                                          const std::vector<GpuInfo>& gpus) {
  VisibleResolution res;
  if (!vis.set) {
    res.visible = gpus;
    return res;
  }
  if (vis.selectors.empty()) {
    res.problems.push_back(
        fmt::format("CUDA_VISIBLE_DEVICES=\"{}\" is empty: CUDA sees no GPU", vis.value));
    return res;
  }
  std::set<int> used;
  auto hide_rest = [&](size_t i, const std::string& why) {
    std::string hidden;
    for (size_t j = i; j < vis.selectors.size(); ++j) {
      hidden += (hidden.empty() ? "" : ",") + vis.selectors[j].text;
    }
    res.problems.push_back(fmt::format(
        "CUDA_VISIBLE_DEVICES entry {} \"{}\" {}: CUDA ignores it and everything after it ({})", i,
        vis.selectors[i].text, why, hidden));
  };
  for (size_t i = 0; i < vis.selectors.size(); ++i) {
    const auto& sel = vis.selectors[i];
    const GpuInfo* match = nullptr;
    switch (sel.kind) {
      case DeviceSelector::Kind::kInvalid:
        hide_rest(i, "is not an index, GPU- UUID or MIG- identifier");
        return res;
      case DeviceSelector::Kind::kMig:
        // MIG instances are not GPUs NVML lists at top level; counted, not matched.
        res.uses_mig = true;
        ++res.mig_instances;
        continue;
      case DeviceSelector::Kind::kIndex:
        if (sel.index >= static_cast<int>(gpus.size())) {
          hide_rest(i, fmt::format("is out of range ({} GPU{} present)", gpus.size(),
                                   gpus.size() == 1 ? "" : "s"));
          return res;
        }
        match = &gpus[static_cast<size_t>(sel.index)];
        break;
      case DeviceSelector::Kind::kUuid: {
        int found = 0;
        for (const auto& g : gpus) {
          if (!g.uuid.empty() && g.uuid.rfind(sel.text, 0) == 0) {
            match = &g;
            ++found;
          }
        }
        if (found == 0) {
          hide_rest(i, "matches no GPU's UUID");
          return res;
        }
        if (found > 1) {
          hide_rest(i, "is an ambiguous UUID prefix");
          return res;
        }
        break;
      }
    }
    if (!used.insert(match->index).second) {
      hide_rest(i, fmt::format("repeats GPU {}", match->index));
      return res;
    }
    res.visible.push_back(*match);
  }
  return res;
}

}  // namespace forkguard::cuda
