// forkguard._native: the pybind11 layer under the Python package `forkguard`.
//
// It binds the probe (with the doctor's cures), the image loader and its batches as DLPack
// producers, the C++ fork server process workers come from, and (notebook.cpp) notebook_launch's
// supervision by the C++ supervisor. Policy that is easier to read in Python (argument checking,
// defaults, cloudpickle, RankError) lives in python/forkguard/*.py.
//
// The hot path: ImageLoader.next() releases the GIL for the whole wait and takes the loader's own
// mutex (one consumer at a time, as the C++ Loader requires); a batch becomes a DLTensor that
// holds a Batch handle, and each __dlpack__ call exports a new DLManagedTensor over the same
// memory (no copy). The slot returns to the loader when the last handle and tensor are gone.
//
// Thread-safety: every object may be used from several Python threads; the loader serializes
// its consumers.
#include <Python.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "cuda/fork_tripwire.hpp"
#include "forkguard/data/batch.hpp"
#include "forkguard/data/error.hpp"
#include "forkguard/data/image_folder.hpp"
#include "forkguard/data/image_transform.hpp"
#include "forkguard/data/loader.hpp"
#include "forkguard/data/tar_shards.hpp"
#include "forkguard/doctor/report.hpp"
#include "forkguard/error.hpp"
#include "forkguard/launch/gpu_plan.hpp"
#include "forkguard/probe/cuda_state.hpp"
#include "forkguard/version.hpp"
#include "launch/fork_server.hpp"

namespace py = pybind11;

void bind_notebook(py::module_& m);
void bind_dataloader(py::module_& m);
void bind_process(py::module_& m);
namespace fd = forkguard::data;
namespace probe = forkguard::probe;

namespace {

// A path as Python's os functions return it (os.fsdecode: the file system encoding with
// surrogateescape): a name that is not UTF-8 round-trips to open() instead of raising
// UnicodeDecodeError.
py::str fs_str(std::string_view path) {
  PyObject* o = PyUnicode_DecodeFSDefaultAndSize(path.data(), static_cast<Py_ssize_t>(path.size()));
  if (o == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(o);
}

// A message naming such a path: its bytes that are not UTF-8 shown as \xNN (printable, unlike
// lone surrogates).
py::str message_str(std::string_view text) {
  PyObject* o =
      PyUnicode_DecodeUTF8(text.data(), static_cast<Py_ssize_t>(text.size()), "backslashreplace");
  if (o == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(o);
}

// ---- probe --------------------------------------------------------------------------------------

struct ProbeResult {
  probe::CudaState state;
  std::string summary;
  std::vector<std::string> cures;
};

ProbeResult make_probe(std::optional<pid_t> pid) {
  ProbeResult r;
  {
    py::gil_scoped_release release;
    r.state = pid ? probe::pid(*pid) : probe::self();
    auto report = forkguard::doctor::diagnose(r.state, {.environment = false});
    r.summary = report.summary;
    r.cures = report.advice;
  }
  return r;
}

py::list evidence_list(const probe::CudaState& s) {
  py::list out;
  for (const auto& e : s.evidence) {
    out.append(py::make_tuple(std::string(probe::to_string(e.kind)), e.detail, e.source));
  }
  return out;
}

// ---- the C++ fork server (zygote) process workers come from ------------------------------------

using forkguard::launch::detail::ForkServer;

pid_t g_server_owner = 0;  // the PID that started the zygote: only it may talk to it

// Starts the zygote when this process is fork-safe and has none; returns whether this process
// now owns one. A forked child (multiprocessing, a notebook_launch rank) inherits the parent's
// pointer and socket but not the right to use them: it owns none.
bool start_fork_server() {
  if (ForkServer::get() != nullptr) return g_server_owner == ::getpid();
  if (probe::self_if_cuda_unsafe()) return false;  // its children run no OpenMP region
  ForkServer::start();
  g_server_owner = ::getpid();
  return true;
}

bool owns_fork_server() {
  return ForkServer::get() != nullptr && g_server_owner == ::getpid();
}

// ---- batches as DLPack producers ---------------------------------------------------------------

enum class Part { kImages, kLabels };

void capsule_destructor(PyObject* capsule) {
  // Unconsumed: the capsule still owns the tensor. A consumer renames it "used_dltensor".
  // PyCapsule_IsValid sets no error, so an exception in flight is left as it is.
  if (PyCapsule_IsValid(capsule, "dltensor")) {
    auto* t = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "dltensor"));
    if (t != nullptr && t->deleter != nullptr) t->deleter(t);
  }
}

std::string dtype_name(const DLDataType& t) {
  if (t.code == kDLFloat) return t.bits == 16 ? "float16" : (t.bits == 64 ? "float64" : "float32");
  if (t.code == kDLInt) return "int" + std::to_string(t.bits);
  if (t.code == kDLUInt) return "uint" + std::to_string(t.bits);
  return "unknown";
}

std::string typestr(const DLDataType& t) {
  const char kind = t.code == kDLFloat ? 'f' : (t.code == kDLInt ? 'i' : 'u');
  return std::string("<") + kind + std::to_string(t.bits / 8);
}

class DLTensor_ {
 public:
  DLTensor_(fd::Batch batch, Part part) : batch_(std::move(batch)), part_(part) {
    DLManagedTensor* t = export_tensor();
    const DLTensor& d = t->dl_tensor;
    shape_.assign(d.shape, d.shape + d.ndim);
    dtype_ = d.dtype;
    device_ = d.device;
    data_ = reinterpret_cast<uintptr_t>(static_cast<char*>(d.data) + d.byte_offset);
    t->deleter(t);
  }

  py::capsule dlpack(py::object stream) const {
    if (batch_.placement() == fd::Placement::kDevice) {
      // DLPack's `stream`: the consumer's stream (None: the legacy default stream, 1; -1: the
      // consumer synchronizes itself). The copy was enqueued on the loader's stream; waiting for
      // it on the host is correct on any consumer stream (and cheap: the loader copies ahead).
      // The consumer's stream is recorded: the device buffer is reused only after the work
      // queued there by the time the batch is released (torch.from_dlpack passes its current
      // stream).
      uintptr_t s = 1;
      bool record = true;
      if (!stream.is_none()) {
        const auto value = stream.cast<py::int_>();
        if (value.equal(py::int_(-1))) {
          record = false;  // the host wait below stays: it costs nothing once the copy is done
        } else if (value.attr("__le__")(0).cast<bool>()) {
          throw py::value_error(
              "__dlpack__: stream must be None, -1, 1 (legacy default), 2 (per-thread default) "
              "or a CUDA stream handle; 0 is ambiguous (DLPack)");
        } else {
          s = value.cast<uintptr_t>();
        }
      }
      py::gil_scoped_release release;
      batch_.synchronize();
      if (record) batch_.record_stream(s);
    }
    DLManagedTensor* t = export_tensor();
    PyObject* cap = PyCapsule_New(t, "dltensor", &capsule_destructor);
    if (cap == nullptr) {
      t->deleter(t);
      throw py::error_already_set();
    }
    return py::reinterpret_steal<py::capsule>(cap);
  }
  py::tuple dlpack_device() const {
    return py::make_tuple(static_cast<int>(device_.device_type), device_.device_id);
  }
  py::tuple shape() const {
    py::tuple t(shape_.size());
    for (size_t i = 0; i < shape_.size(); ++i) t[i] = shape_[i];
    return t;
  }
  std::string dtype() const { return dtype_name(dtype_); }
  uintptr_t data_ptr() const { return data_; }
  size_t nbytes() const {
    size_t n = dtype_.bits / 8;
    for (auto s : shape_) n *= static_cast<size_t>(s);
    return n;
  }
  std::string device() const {
    return device_.device_type == kDLCUDA ? "cuda:" + std::to_string(device_.device_id) : "cpu";
  }
  py::dict array_interface() const {
    if (device_.device_type != kDLCPU) {
      throw py::attribute_error("__array_interface__: a device tensor (use __dlpack__)");
    }
    py::dict d;
    d["shape"] = shape();
    d["typestr"] = typestr(dtype_);
    d["data"] = py::make_tuple(data_, true);
    d["version"] = 3;
    return d;
  }
  py::list skipped() const {
    py::list out;
    for (const auto& s : batch_.skipped()) {
      py::dict d;
      d["position"] = s.position;
      d["index"] = s.index;
      d["key"] = fs_str(s.key);
      d["reason"] = s.reason;
      d["substitute"] = s.substitute;
      out.append(d);
    }
    return out;
  }
  py::list keys() const {
    py::list out;
    for (size_t i = 0; i < batch_.size(); ++i) out.append(fs_str(batch_.key(i)));
    return out;
  }
  size_t epoch() const { return batch_.epoch(); }
  size_t number() const { return batch_.number(); }
  std::vector<size_t> indices() const { return batch_.indices(); }
  std::string repr() const {
    std::string s = "forkguard.DLTensor(shape=(";
    for (size_t i = 0; i < shape_.size(); ++i) s += (i ? ", " : "") + std::to_string(shape_[i]);
    return s + "), dtype=" + dtype() + ", device=" + device() + ")";
  }

 private:
  DLManagedTensor* export_tensor() const {
    return part_ == Part::kImages ? batch_.images_dlpack() : batch_.labels_dlpack();
  }
  fd::Batch batch_;
  Part part_;
  std::vector<int64_t> shape_;
  DLDataType dtype_{};
  DLDevice device_{};
  uintptr_t data_ = 0;
};

// ---- the image loader --------------------------------------------------------------------------

struct ImageLoaderArgs {
  std::string root;
  std::string format = "imagefolder";
  size_t batch_size = 64;
  size_t workers = 2;
  std::string worker_kind = "thread";
  bool train = true;
  int size = 224;
  int resize = 256;
  std::string dtype = "float32";
  std::string layout = "nchw";
  int device = -1;  // -1: host batches
  uint64_t seed = 0;
  bool shuffle = true;
  bool drop_last = false;
  bool distributed = false;
  std::string bad_sample = "error";
  bool allow_empty = false;  // ImageFolder: accept class directories without images
  size_t prefetch = 2;
  double timeout = 0;
  double scale_min = 0.08, scale_max = 1.0, ratio_min = 3.0 / 4.0, ratio_max = 4.0 / 3.0;
  double flip = 0.5;
  std::vector<float> mean{0.485f, 0.456f, 0.406f}, std{0.229f, 0.224f, 0.225f};
};

std::shared_ptr<const fd::Dataset> open_dataset(const ImageLoaderArgs& a) {
  if (a.format == "imagefolder") {
    return std::make_shared<fd::ImageFolder>(a.root,
                                             fd::ImageFolderOptions{.allow_empty = a.allow_empty});
  }
  if (a.format == "filelist") return std::make_shared<fd::FileList>(a.root);
  if (a.format == "wds") return std::make_shared<fd::TarShards>(a.root);
  throw py::value_error("format: 'imagefolder', 'filelist' or 'wds', not '" + a.format + "'");
}

fd::DType parse_dtype(const std::string& s) {
  if (s == "float32") return fd::DType::kFloat32;
  if (s == "float16") return fd::DType::kFloat16;
  if (s == "uint8") return fd::DType::kUInt8;
  throw py::value_error("dtype: 'float32', 'float16' or 'uint8', not '" + s + "'");
}

class ImageLoader {
 public:
  explicit ImageLoader(const ImageLoaderArgs& a) {
    fd::ImageOptions io{.train = a.train, .size = a.size};
    io.scale_min = a.scale_min;
    io.scale_max = a.scale_max;
    io.ratio_min = a.ratio_min;
    io.ratio_max = a.ratio_max;
    io.flip = a.flip;
    io.resize = a.resize;
    if (a.mean.size() != 3 || a.std.size() != 3) throw py::value_error("mean and std: 3 values");
    for (int c = 0; c < 3; ++c) {
      io.mean[c] = a.mean[c];
      io.std[c] = a.std[c];
    }
    io.dtype = parse_dtype(a.dtype);
    if (a.layout == "nhwc") {
      io.layout = fd::Layout::kNHWC;
    } else if (a.layout != "nchw") {
      throw py::value_error("layout: 'nchw' or 'nhwc', not '" + a.layout + "'");
    }
    fd::LoaderOptions lo;
    lo.batch_size = a.batch_size;
    lo.workers = a.workers;
    if (a.worker_kind == "process") {
      lo.worker_kind = fd::WorkerKind::kProcess;
      // The zygote when this process owns one (started at import while clean), else a guarded
      // fork, which refuses with the probe's evidence once CUDA is initialized here.
      if (!owns_fork_server()) start_fork_server();
      lo.process_start =
          owns_fork_server() ? fd::ProcessStart::kForkServer : fd::ProcessStart::kFork;
    } else if (a.worker_kind != "thread") {
      throw py::value_error("worker_kind: 'thread' or 'process', not '" + a.worker_kind + "'");
    }
    if (a.bad_sample == "skip") {
      lo.bad_sample = fd::BadSample::kSkip;
    } else if (a.bad_sample != "error") {
      throw py::value_error("bad_sample: 'error' or 'skip', not '" + a.bad_sample + "'");
    }
    lo.prefetch = a.prefetch;
    lo.timeout = std::chrono::milliseconds(static_cast<int64_t>(a.timeout * 1000));
    lo.seed = a.seed;
    lo.shuffle = a.shuffle;
    lo.distributed = a.distributed;
    lo.drop_last = a.drop_last;
    if (a.device >= 0) lo.device = {.enabled = true, .ordinal = a.device};
    py::gil_scoped_release release;
    auto ds = open_dataset(a);
    auto tf = std::make_shared<fd::ImageTransform>(io);
    loader_ = std::make_unique<fd::Loader>(std::move(ds), std::move(tf), std::move(lo));
  }

  // (images, labels) or None at the end of the epoch.
  py::object next() {
    std::optional<fd::Batch> b;
    {
      py::gil_scoped_release release;
      std::lock_guard lock(mutex_);
      b = get().next();
    }
    if (!b) return py::none();
    return py::make_tuple(DLTensor_(*b, Part::kImages), DLTensor_(*b, Part::kLabels));
  }
  void set_epoch(uint64_t e) {
    py::gil_scoped_release release;
    std::lock_guard lock(mutex_);
    get().set_epoch(e);
  }
  uint64_t epoch() { return get().epoch(); }
  bool in_epoch() { return get().in_epoch(); }
  size_t size() { return get().size(); }
  size_t dataset_size() { return get().dataset_size(); }
  std::vector<pid_t> worker_pids() { return get().worker_pids(); }
  py::dict stats() {
    auto s = get().stats();
    py::dict d;
    d["read_seconds"] = s.read_seconds;
    d["transform_seconds"] = s.transform_seconds;
    d["slot_wait_seconds"] = s.slot_wait_seconds;
    d["consumer_wait_seconds"] = s.consumer_wait_seconds;
    d["copy_seconds"] = s.copy_seconds;
    d["batches"] = s.batches;
    d["samples"] = s.samples;
    d["skipped"] = s.skipped;
    d["worker_starts"] = s.worker_starts;
    d["worker_restarts"] = s.worker_restarts;
    d["slots"] = s.slots;
    d["slot_bytes"] = s.slot_bytes;
    return d;
  }
  void close() {
    py::gil_scoped_release release;
    std::lock_guard lock(mutex_);
    loader_.reset();
  }
  fd::Loader& get() {
    // As a closed file's "I/O operation on closed file": a ValueError, not a bad sample.
    if (!loader_) throw py::value_error("the ImageLoader is closed (close() or the with block)");
    return *loader_;
  }

 private:
  std::mutex mutex_;
  std::unique_ptr<fd::Loader> loader_;
};

// The Python types of the loader's exceptions, set once at import: the translator below raises
// them with the C++ exception's fields as attributes (a function pointer: no captures).
py::handle g_error, g_data_error, g_worker_error, g_timeout_error, g_probe_error;

[[noreturn]] void raise_with(py::handle type, const char* what,
                             std::initializer_list<std::pair<const char*, py::object>> attrs = {}) {
  py::object e = type(message_str(what));
  for (const auto& [name, value] : attrs) e.attr(name) = value;
  PyErr_SetObject(type.ptr(), e.ptr());
  throw py::error_already_set();
}

void translate_errors(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const fd::DataError& e) {
    raise_with(g_data_error, e.what(),
               {{"index", e.index() == fd::DataError::npos ? py::object(py::none())
                                                           : py::object(py::int_(e.index()))},
                {"key", e.key().empty() ? py::object(py::none()) : py::object(fs_str(e.key()))}});
  } catch (const fd::WorkerError& e) {
    raise_with(
        g_worker_error, e.what(),
        {{"worker", e.worker() < 0 ? py::object(py::none()) : py::object(py::int_(e.worker()))},
         {"pid", e.pid() <= 0 ? py::object(py::none()) : py::object(py::int_(e.pid()))},
         {"indices", py::cast(e.indices())}});
  } catch (const fd::TimeoutError& e) {
    raise_with(g_timeout_error, e.what());
  } catch (const probe::ProbeError& e) {
    raise_with(g_probe_error, e.what());
  } catch (const forkguard::Error& e) {
    raise_with(g_error, e.what());
  }
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "forkguard's native layer (pybind11 over the C++ library); use the `forkguard` package";
  m.attr("__version__") = std::string(forkguard::kVersion);

  auto base = py::register_exception<forkguard::Error>(m, "Error", PyExc_RuntimeError);
  auto& data_error = py::register_exception<fd::DataError>(m, "DataError", base.ptr());
  auto& worker_error = py::register_exception<fd::WorkerError>(m, "WorkerError", base.ptr());
  auto& timeout_error =
      py::register_exception<fd::TimeoutError>(m, "LoaderTimeoutError", base.ptr());
  auto& probe_error = py::register_exception<probe::ProbeError>(m, "ProbeError", base.ptr());
  g_error = base;
  g_data_error = data_error;
  g_worker_error = worker_error;
  g_timeout_error = timeout_error;
  g_probe_error = probe_error;
  py::register_exception_translator(&translate_errors);  // tried before the plain ones

  bind_notebook(m);    // notebook_launch's supervision (notebook.cpp)
  bind_dataloader(m);  // forkguard.DataLoader's worker queue (dataloader.cpp)
  bind_process(m);     // start_process: the interpreter fork server (process.cpp)

  py::class_<ProbeResult>(m, "_ProbeResult")
      .def_property_readonly("pid", [](const ProbeResult& r) { return r.state.pid; })
      .def_property_readonly("parent_pid", [](const ProbeResult& r) { return r.state.parent_pid; })
      .def_property_readonly(
          "verdict", [](const ProbeResult& r) { return std::string(to_string(r.state.verdict)); })
      .def_property_readonly("fork_safe", [](const ProbeResult& r) { return r.state.fork_safe; })
      .def_property_readonly("evidence",
                             [](const ProbeResult& r) { return evidence_list(r.state); })
      .def_property_readonly("notes", [](const ProbeResult& r) { return r.state.notes; })
      .def_readonly("summary", &ProbeResult::summary)
      .def_readonly("cures", &ProbeResult::cures);
  m.def("probe", &make_probe, py::arg("pid") = py::none(),
        "The CUDA state of this process (or of pid); never initializes CUDA.");
  // forkguard.guard()'s check at every Process.start(): microseconds when no driver is mapped.
  m.def(
      "probe_if_fork_unsafe",
      []() -> py::object {
        std::optional<ProbeResult> r;
        {
          py::gil_scoped_release release;
          if (auto state = probe::self_if_fork_unsafe()) {
            auto report = forkguard::doctor::diagnose(*state, {.environment = false});
            r = ProbeResult{std::move(*state), report.summary, report.advice};
          }
        }
        if (!r) return py::none();
        return py::cast(std::move(*r));
      },
      "None when this process is fork-safe, else its probe (as probe() gives it).");

  // forkguard.DataLoader's forked workers in a parent that initialized the driver
  // (src/cuda/fork_tripwire.hpp): a worker's swallowed cuInit is still seen.
  m.def("cuda_tripwire_unavailable", &forkguard::cuda::fork_tripwire_unavailable,
        "'' where the CUDA fork tripwire can be armed in a fork of this process, else why not.");
  m.def("arm_cuda_tripwire", &forkguard::cuda::arm_fork_tripwire,
        "Arms the CUDA fork tripwire in this process (a fork child); raises Error where it "
        "cannot.");
  m.def("cuda_tripwire_trips", &forkguard::cuda::fork_tripwire_trips,
        "The cuInit calls the tripwire caught in this process.");

  m.def(
      "visible_gpu_count",
      []() {
        return forkguard::launch::count_visible_gpus(forkguard::cuda::discover_gpus(),
                                                     forkguard::cuda::visible_devices_from_env());
      },
      "The GPUs CUDA would show this process (NVML or /proc, CUDA_VISIBLE_DEVICES applied; "
      "never initializes CUDA): what `forkguard run --nproc-per-node gpu` starts.");

  m.def("start_fork_server", &start_fork_server,
        "Starts the C++ fork server process workers come from, if this process is fork-safe.");
  m.def(
      "stop_fork_server",
      []() {
        if (owns_fork_server()) ForkServer::stop();
      },
      "Stops this process's fork server and reaps it (what exit does; for a process leaving by "
      "_exit).");
  m.def("owns_fork_server", &owns_fork_server);
  m.def("fork_server_pid", []() -> py::object {
    if (!owns_fork_server()) return py::none();
    return py::int_(ForkServer::get()->pid());
  });

  py::class_<DLTensor_>(m, "DLTensor")
      .def("__dlpack__", &DLTensor_::dlpack, py::arg("stream") = py::none())
      .def("__dlpack_device__", &DLTensor_::dlpack_device)
      .def_property_readonly("shape", &DLTensor_::shape)
      .def_property_readonly("dtype", &DLTensor_::dtype)
      .def_property_readonly("device", &DLTensor_::device)
      .def_property_readonly("data_ptr", &DLTensor_::data_ptr)
      .def_property_readonly("nbytes", &DLTensor_::nbytes)
      .def_property_readonly("__array_interface__", &DLTensor_::array_interface)
      .def_property_readonly("skipped", &DLTensor_::skipped)
      .def_property_readonly("keys", &DLTensor_::keys)
      .def_property_readonly("epoch", &DLTensor_::epoch)
      .def_property_readonly("batch_number", &DLTensor_::number)
      .def_property_readonly("indices", &DLTensor_::indices)
      .def("__len__",
           [](const DLTensor_& t) { return py::len(t.shape()) ? t.shape()[0] : py::int_(0); })
      .def("__repr__", &DLTensor_::repr);

  py::class_<ImageLoaderArgs>(m, "_ImageLoaderArgs")
      .def(py::init<>())
      .def_readwrite("root", &ImageLoaderArgs::root)
      .def_readwrite("format", &ImageLoaderArgs::format)
      .def_readwrite("batch_size", &ImageLoaderArgs::batch_size)
      .def_readwrite("workers", &ImageLoaderArgs::workers)
      .def_readwrite("worker_kind", &ImageLoaderArgs::worker_kind)
      .def_readwrite("train", &ImageLoaderArgs::train)
      .def_readwrite("size", &ImageLoaderArgs::size)
      .def_readwrite("resize", &ImageLoaderArgs::resize)
      .def_readwrite("dtype", &ImageLoaderArgs::dtype)
      .def_readwrite("layout", &ImageLoaderArgs::layout)
      .def_readwrite("device", &ImageLoaderArgs::device)
      .def_readwrite("seed", &ImageLoaderArgs::seed)
      .def_readwrite("shuffle", &ImageLoaderArgs::shuffle)
      .def_readwrite("drop_last", &ImageLoaderArgs::drop_last)
      .def_readwrite("distributed", &ImageLoaderArgs::distributed)
      .def_readwrite("bad_sample", &ImageLoaderArgs::bad_sample)
      .def_readwrite("allow_empty", &ImageLoaderArgs::allow_empty)
      .def_readwrite("prefetch", &ImageLoaderArgs::prefetch)
      .def_readwrite("timeout", &ImageLoaderArgs::timeout)
      .def_readwrite("scale_min", &ImageLoaderArgs::scale_min)
      .def_readwrite("scale_max", &ImageLoaderArgs::scale_max)
      .def_readwrite("ratio_min", &ImageLoaderArgs::ratio_min)
      .def_readwrite("ratio_max", &ImageLoaderArgs::ratio_max)
      .def_readwrite("flip", &ImageLoaderArgs::flip)
      .def_readwrite("mean", &ImageLoaderArgs::mean)
      .def_readwrite("std", &ImageLoaderArgs::std);

  py::class_<ImageLoader>(m, "_ImageLoader")
      .def(py::init<const ImageLoaderArgs&>())
      .def("next", &ImageLoader::next)
      .def("set_epoch", &ImageLoader::set_epoch)
      .def("epoch", &ImageLoader::epoch)
      .def("in_epoch", &ImageLoader::in_epoch)
      .def("size", &ImageLoader::size)
      .def("dataset_size", &ImageLoader::dataset_size)
      .def("worker_pids", &ImageLoader::worker_pids)
      .def("stats", &ImageLoader::stats)
      .def("close", &ImageLoader::close);
}
