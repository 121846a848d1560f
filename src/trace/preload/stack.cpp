#include "trace/preload/stack.hpp"

#include <backtrace.h>
#include <cxxabi.h>
#include <dlfcn.h>
#include <unwind.h>

#include <cstdlib>
#include <cstring>
#include <string_view>

namespace forkguard::trace::detail {
namespace {

_Unwind_Reason_Code collect(_Unwind_Context* ctx, void* data) {
  auto* raw = static_cast<RawStack*>(data);
  if (raw->size >= RawStack::kMax) return _URC_END_OF_STACK;
  int before = 0;
  uintptr_t ip = _Unwind_GetIPInfo(ctx, &before);
  if (ip == 0) return _URC_END_OF_STACK;
  // Return addresses point after the call: step back into it, for the right line and function.
  raw->pcs[raw->size++] = before ? ip : ip - 1;
  return _URC_NO_REASON;
}

// One libbacktrace state for the process (it reads the objects mapped at its first use; frames in
// objects loaded later are named from the dynamic symbol table by dladdr instead). Its memory
// comes from mmap, never malloc.
backtrace_state* bt_state() {
  static backtrace_state* state = backtrace_create_state(
      nullptr, 1, [](void*, const char*, int) {}, nullptr);
  return state;
}

std::string demangle(const char* name) {
  if (name == nullptr) return {};
  int status = 0;
  char* d = abi::__cxa_demangle(name, nullptr, nullptr, &status);
  if (status != 0 || d == nullptr) return name;
  std::string out(d);
  std::free(d);
  return out;
}

struct PcInfo {
  std::vector<NativeFrame>* out;
  std::string library;
  uintptr_t offset;
};

std::string_view basename_of(std::string_view path) {
  auto slash = path.rfind('/');
  return slash == std::string_view::npos ? path : path.substr(slash + 1);
}

}  // namespace

void capture_pcs(RawStack& out) {
  out.size = 0;
  _Unwind_Backtrace(collect, &out);
}

std::vector<NativeFrame> symbolize(const RawStack& raw) {
  std::vector<NativeFrame> out;
  const std::string& self = self_path();
  for (int i = 0; i < raw.size; ++i) {
    const uintptr_t pc = raw.pcs[i];
    Dl_info info{};
    if (::dladdr(reinterpret_cast<void*>(pc), &info) == 0) {
      out.push_back({"", "", pc, "", 0});
      continue;
    }
    std::string library = info.dli_fname != nullptr ? info.dli_fname : "";
    if (library == self) continue;
    const uintptr_t offset = pc - reinterpret_cast<uintptr_t>(info.dli_fbase);
    const size_t before = out.size();
    PcInfo data{&out, library, offset};
    if (backtrace_state* st = bt_state()) {
      backtrace_pcinfo(
          st, pc,
          [](void* d, uintptr_t, const char* file, int line, const char* function) -> int {
            auto* p = static_cast<PcInfo*>(d);
            if (function == nullptr && file == nullptr) return 0;
            p->out->push_back({demangle(function), p->library, p->offset, file ? file : "", line});
            return 0;
          },
          [](void*, const char*, int) {}, &data);
    }
    if (out.size() > before && out[before].function.empty()) out.resize(before);
    if (out.size() == before) {
      std::string name;
      if (backtrace_state* st = bt_state()) {
        backtrace_syminfo(
            st, pc,
            [](void* d, uintptr_t, const char* sym, uintptr_t, uintptr_t) {
              if (sym != nullptr) *static_cast<std::string*>(d) = sym;
            },
            [](void*, const char*, int) {}, &name);
      }
      if (name.empty() && info.dli_sname != nullptr) name = info.dli_sname;
      out.push_back({demangle(name.empty() ? nullptr : name.c_str()), library, offset, "", 0});
    }
  }
  // The C library's own frames on top (fork's handlers, open's wrapper), and a sanitizer
  // runtime's interceptors, say nothing to the user.
  auto machinery = [](std::string_view library) {
    auto base = basename_of(library);
    return base.substr(0, 7) == "libc.so" || base.substr(0, 9) == "libasan.s" ||
           base.substr(0, 9) == "libtsan.s" || base.substr(0, 10) == "libubsan.s";
  };
  size_t first = 0;
  while (first < out.size() && machinery(out[first].library)) ++first;
  out.erase(out.begin(), out.begin() + static_cast<long>(first));
  // Below main() is the C library's start-up: nothing to act on.
  for (size_t i = 0; i < out.size(); ++i) {
    if (out[i].function == "main") {
      out.resize(i + 1);
      break;
    }
  }
  return out;
}

std::string object_of(const void* address) {
  Dl_info info{};
  if (::dladdr(address, &info) == 0 || info.dli_fname == nullptr) return {};
  return info.dli_fname;
}

const std::string& self_path() {
  // Never destroyed: used by the library's destructor, after the statics' destructors have run.
  static const std::string* path =
      new std::string(object_of(reinterpret_cast<const void*>(&self_path)));
  return *path;
}

// --- Python ------------------------------------------------------------------------------------
namespace {

// The interpreter's C API, found at run time: the process may or may not be Python.
struct PyApi {
  int (*is_initialized)() = nullptr;
  int (*finalizing)() = nullptr;
  int (*gil_check)() = nullptr;
  int (*gil_ensure)() = nullptr;
  void (*gil_release)(int) = nullptr;
  void* (*this_thread_state)() = nullptr;
  void* (*get_frame)() = nullptr;
  void* (*frame_code)(void*) = nullptr;
  int (*frame_line)(void*) = nullptr;
  void* (*frame_back)(void*) = nullptr;
  void* (*get_attr)(void*, const char*) = nullptr;
  const char* (*as_utf8)(void*) = nullptr;
  void (*decref)(void*) = nullptr;
  void (*err_fetch)(void**, void**, void**) = nullptr;
  void (*err_restore)(void*, void*, void*) = nullptr;
  bool ok = false;
};

template <typename F>
void bind(F& f, const char* name) {
  f = reinterpret_cast<F>(::dlsym(RTLD_DEFAULT, name));
}

const PyApi& py() {
  static const PyApi api = [] {
    PyApi a;
    bind(a.is_initialized, "Py_IsInitialized");
    if (a.is_initialized == nullptr) return a;
    bind(a.finalizing, "Py_IsFinalizing");
    if (a.finalizing == nullptr) bind(a.finalizing, "_Py_IsFinalizing");
    bind(a.gil_check, "PyGILState_Check");
    bind(a.gil_ensure, "PyGILState_Ensure");
    bind(a.gil_release, "PyGILState_Release");
    bind(a.this_thread_state, "PyGILState_GetThisThreadState");
    bind(a.get_frame, "PyEval_GetFrame");
    bind(a.frame_code, "PyFrame_GetCode");
    bind(a.frame_line, "PyFrame_GetLineNumber");
    bind(a.frame_back, "PyFrame_GetBack");
    bind(a.get_attr, "PyObject_GetAttrString");
    bind(a.as_utf8, "PyUnicode_AsUTF8");
    bind(a.decref, "Py_DecRef");
    bind(a.err_fetch, "PyErr_Fetch");
    bind(a.err_restore, "PyErr_Restore");
    a.ok = a.gil_check && a.gil_ensure && a.gil_release && a.this_thread_state && a.get_frame &&
           a.frame_code && a.frame_line && a.frame_back && a.get_attr && a.as_utf8 && a.decref &&
           a.err_fetch && a.err_restore;
    return a;
  }();
  return api;
}

std::string attr_string(const PyApi& api, void* object, const char* name) {
  void* value = api.get_attr(object, name);
  if (value == nullptr) return {};
  const char* s = api.as_utf8(value);
  std::string out = s != nullptr ? s : "";
  api.decref(value);
  return out;
}

}  // namespace

bool is_python_process() {
  return py().ok;
}

void python_frames(Stack& stack, GilPolicy policy) {
  const PyApi& api = py();
  if (!api.ok) return;
  if (api.is_initialized() == 0 || (api.finalizing != nullptr && api.finalizing() != 0)) {
    stack.python_note = "Python frames not read: the interpreter is not running";
    return;
  }
  if (api.this_thread_state() == nullptr) {
    stack.python_note = "no Python frames: this thread does not run Python code";
    return;
  }
  const bool held = api.gil_check() != 0;
  if (!held && policy == GilPolicy::kIfHeld) {
    stack.python_note =
        "Python frames not read: this thread did not hold the GIL here, and waiting for it "
        "could deadlock (native frames only)";
    return;
  }
  const int gil = held ? -1 : api.gil_ensure();
  void *type = nullptr, *value = nullptr, *traceback = nullptr;
  api.err_fetch(&type, &value, &traceback);
  void* frame = api.get_frame();  // borrowed
  bool owned = false;
  for (int depth = 0; frame != nullptr && depth < 64; ++depth) {
    PythonFrame pf;
    if (void* code = api.frame_code(frame)) {
      pf.file = attr_string(api, code, "co_filename");
      pf.function = attr_string(api, code, "co_qualname");
      if (pf.function.empty()) pf.function = attr_string(api, code, "co_name");
      api.decref(code);
    }
    pf.line = api.frame_line(frame);
    stack.python.push_back(std::move(pf));
    void* back = api.frame_back(frame);  // new reference
    if (owned) api.decref(frame);
    frame = back;
    owned = true;
  }
  if (owned && frame != nullptr) api.decref(frame);
  api.err_restore(type, value, traceback);
  if (gil >= 0) api.gil_release(gil);
}

}  // namespace forkguard::trace::detail
