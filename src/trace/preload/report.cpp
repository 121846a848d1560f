#include "trace/preload/report.hpp"

#include <cstdio>

namespace forkguard::trace::detail {
namespace {

std::string_view basename_of(std::string_view path) {
  auto slash = path.rfind('/');
  return slash == std::string_view::npos ? path : path.substr(slash + 1);
}

bool starts_with(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

// Frames of the interpreter's standard library or of <frozen ...> modules: not the user's code.
bool is_library_python(const PythonFrame& f) {
  if (f.file.empty() || f.file[0] == '<') return true;
  return f.file.find("/lib/python3") != std::string::npos &&
         f.file.find("-packages/") == std::string::npos;
}

// Objects whose frames are the machinery between the user's code and the event.
bool is_system_object(std::string_view library) {
  auto base = basename_of(library);
  for (std::string_view p :
       {"libc.so", "libcuda.so", "libcudart.so", "libnvidia-ml.so", "libffi.so", "libforkguard.so",
        "ld-linux", "libstdc++.so", "libasan.so", "libtsan.so", "libubsan.so", "libgomp"}) {
    if (starts_with(base, p)) return true;
  }
  return false;
}

std::string hex(uintptr_t v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "0x%lx", static_cast<unsigned long>(v));
  return buf;
}

std::string describe(const NativeFrame& f) {
  std::string out = f.function.empty() ? "??" : f.function;
  if (!f.file.empty()) out += " at " + f.file + ":" + std::to_string(f.line);
  out += "  [" + std::string(basename_of(f.library)) + "+" + hex(f.offset) + "]";
  return out;
}

void json_string(std::string& out, std::string_view s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      case '\r': out += "\\r"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

}  // namespace

std::string_view to_string(EventKind kind) {
  switch (kind) {
    case EventKind::kDriverLoaded: return "driver_loaded";
    case EventKind::kDeviceOpened: return "device_opened";
    case EventKind::kCudaInit: return "cuda_init";
    case EventKind::kDirtyFork: return "dirty_fork";
    case EventKind::kPoisonedTouch: return "poisoned_touch";
    case EventKind::kOpenMpPool: return "openmp_pool";
    case EventKind::kOpenMpFork: return "openmp_fork";
  }
  return "unknown";
}

void ensure_symbolized(Event& event) {
  if (event.symbolized) return;
  event.stack.native = symbolize(event.raw);
  event.symbolized = true;
}

std::string headline(const Stack& stack) {
  for (const auto& f : stack.python) {
    if (!is_library_python(f)) {
      return f.file + ":" + std::to_string(f.line) + " in " + f.function + "()";
    }
  }
  for (const auto& f : stack.native) {
    if (is_system_object(f.library) || f.function.empty()) continue;
    std::string out = f.function;
    if (!f.file.empty()) out += " at " + f.file + ":" + std::to_string(f.line);
    return out;
  }
  if (!stack.python.empty()) {
    const auto& f = stack.python.front();
    return f.file + ":" + std::to_string(f.line) + " in " + f.function + "()";
  }
  if (!stack.native.empty()) return describe(stack.native.front());
  return "(no stack recorded)";
}

std::string format_stack(const Stack& stack, std::string_view indent) {
  std::string out;
  const std::string in(indent);
  if (!stack.python.empty()) {
    out += in + "Python (most recent call last):\n";
    const size_t shown = std::min<size_t>(stack.python.size(), 30);
    for (size_t i = shown; i-- > 0;) {
      const auto& f = stack.python[i];
      out += in + "  File \"" + f.file + "\", line " + std::to_string(f.line) + ", in " +
             f.function + "\n";
    }
  } else if (!stack.python_note.empty()) {
    out += in + "(" + stack.python_note + ")\n";
  }
  if (!stack.native.empty()) {
    const size_t limit = stack.python.empty() ? 20 : 6;
    out += in + "native (innermost first):\n";
    for (size_t i = 0; i < stack.native.size() && i < limit; ++i) {
      out += in + "  #" + std::to_string(i) + " " + describe(stack.native[i]) + "\n";
    }
    if (stack.native.size() > limit) {
      out += in + "  ... " + std::to_string(stack.native.size() - limit) + " more\n";
    }
  }
  if (stack.python.empty() && stack.native.empty()) out += in + "(no stack recorded)\n";
  return out;
}

std::string cure_text(std::string_view indent) {
  const std::string in(indent);
  return in +
         "- start the child with spawn or a fork server instead of fork: "
         "multiprocessing.set_start_method(\"spawn\") or (\"forkserver\"), "
         "DataLoader(multiprocessing_context=\"spawn\"), forkguard run --start-method "
         "forkserver\n" +
         in + "- or move the CUDA call after the fork, into the process that uses the GPU\n" + in +
         "- PyTorch: PYTORCH_NVML_BASED_CUDA_CHECK=1 makes torch.cuda.is_available() and "
         "device_count() ask NVML instead of initializing CUDA\n" +
         in +
         "- keep data-loader workers CPU-only (no CUDA in Dataset.__getitem__, collate_fn or "
         "worker_init_fn)\n";
}

std::string openmp_cure_text(std::string_view indent) {
  const std::string in(indent);
  return in +
         "- PyTorch: torch.set_num_threads(1) before the first parallel op, or OMP_NUM_THREADS=1 "
         "in the program's environment: no pool is started (the parent computes on one "
         "thread)\n" +
         in +
         "- start the child with spawn or a fork server instead of fork: "
         "multiprocessing.set_start_method(\"spawn\") or (\"forkserver\"), "
         "DataLoader(multiprocessing_context=\"spawn\"), forkguard run --start-method "
         "forkserver\n" +
         in +
         "- Python: forkguard.guard() before starting processes reroutes multiprocessing's fork "
         "start to forkguard's fork server while this process is not fork-safe\n" +
         in + "- or fork before the first parallel region, and start OpenMP in the children\n";
}

std::string to_json_line(const Event& e) {
  std::string out = "{\"event\":";
  json_string(out, to_string(e.kind));
  out += ",\"pid\":" + std::to_string(e.pid) + ",\"ppid\":" + std::to_string(e.ppid);
  char t[64];
  std::snprintf(t, sizeof t, "%.6f", e.time);
  out += ",\"time\":";
  out += t;
  out += ",\"what\":";
  json_string(out, e.what);
  for (const auto& [k, v] : e.fields) {
    out += ',';
    json_string(out, k);
    out += ':';
    json_string(out, v);
  }
  for (const auto& [k, v] : e.numbers) {
    out += ',';
    json_string(out, k);
    out += ':' + std::to_string(v);
  }
  out += ",\"site\":";
  json_string(out, headline(e.stack));
  out += ",\"native_frames\":[";
  for (size_t i = 0; i < e.stack.native.size(); ++i) {
    const auto& f = e.stack.native[i];
    out += i ? ",{" : "{";
    out += "\"function\":";
    json_string(out, f.function);
    out += ",\"library\":";
    json_string(out, f.library);
    out += ",\"offset\":";
    json_string(out, hex(f.offset));
    out += ",\"file\":";
    json_string(out, f.file);
    out += ",\"line\":" + std::to_string(f.line) + "}";
  }
  out += "],\"python_frames\":[";
  for (size_t i = 0; i < e.stack.python.size(); ++i) {
    const auto& f = e.stack.python[i];
    out += i ? ",{" : "{";
    out += "\"file\":";
    json_string(out, f.file);
    out += ",\"line\":" + std::to_string(f.line) + ",\"function\":";
    json_string(out, f.function);
    out += "}";
  }
  out += "]";
  if (!e.stack.python_note.empty()) {
    out += ",\"python_note\":";
    json_string(out, e.stack.python_note);
  }
  out += "}\n";
  return out;
}

}  // namespace forkguard::trace::detail
