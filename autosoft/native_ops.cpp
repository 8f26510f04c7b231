// Compiled kernels for torch.ops.autosoft.softmax and log_softmax on CUDA tensors (autosoft/native.py
// builds and loads this file; `autosoft native` builds it).
//
// Why: called from Python, an operator whose kernel is Python pays the dispatcher's hop into Python and
// back, and torch.empty_like and cuLaunchKernel through Python wrappers: about 18 us per call on the H200
// machine against 10 us for torch.softmax. Here the operator's AutogradCUDA kernel is C++: for a call
// whose plan is recorded (operator, dtype, device, shape) it allocates the output, writes the two
// pointers into the kernel's argument words and calls cuLaunchKernel on torch's current stream, with no
// Python in between. Every other call (a first call, gradients, a dim other than -1, a non-contiguous
// input, fake tensors or dispatch modes, an output address the kernel cannot take, a plan with more than
// one launch or a workspace) goes to autosoft.native._miss, which runs the Python Autograd kernel (the
// same path as without this file) and records the plan when it can be launched from here.
//
// The same records serve autosoft.softmax and autosoft.log_softmax themselves (the public functions, no
// dispatcher): `softmax_direct` and `log_softmax_direct` are plain CPython functions (x, dim, out) that launch
// a recorded plan and return the output, return None for every call they do not take (the public function's
// Python path then runs as without this file), and on a plain call whose plan is not recorded yet call
// autosoft.native._direct_miss, which runs the Python path and records the plan, or records that it cannot
// be replayed from here so that later calls go straight to Python.
//
// Nothing here needs the CUDA toolkit: the stream comes from c10's device-generic guard, cuLaunchKernel
// is a function pointer the Python side takes from libcuda (the driver CuPy loaded the kernels with).
#include <ATen/core/Tensor.h>
#include <ATen/core/grad_mode.h>
#include <ATen/ops/empty_strided.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <Python.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <stdexcept>
#include <string>
#include <unordered_map>
#include <vector>

namespace {

namespace py = pybind11;

// CUresult cuLaunchKernel(CUfunction, gridDim x y z, blockDim x y z, sharedMemBytes, CUstream, kernelParams, extra)
using LaunchFn = int (*)(void*, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, void*, void**,
                         void**);

constexpr int kSoftmax = 0;
constexpr int kLogSoftmax = 1;
constexpr int kMaxParams = 16;
constexpr uint64_t kVecAlign = 16;  // the kernels' vector loads: output address = input address mod 16

// One recorded launch: the kernel, its geometry, its parameters (each at most 8 bytes, as the words the
// kernel reads through kernelParams) and which two words take the input's and the output's address. A
// record without a function says that the call's plan cannot be replayed from here (another launch
// shape, a workspace, an empty input): those calls go to Python without asking to record again.
struct Record {
  void* function = nullptr;
  unsigned geometry[7] = {0, 0, 0, 0, 0, 0, 0};  // grid x y z, block x y z, dynamic shared memory bytes
  int count = 0;
  uint64_t words[kMaxParams] = {};
  int x_word = -1;
  int y_word = -1;
};

// (operator, dtype, device index, number of dimensions, sizes...): what decides the Python plan of a call
// along the last dim. Held in place, not in a std::vector: a lookup allocates nothing. A tensor of more
// than kMaxDims dimensions has no key (its calls stay in Python).
constexpr int kMaxDims = 12;

struct Key {
  int64_t values[4 + kMaxDims];
  int count = 0;

  bool operator==(const Key& other) const noexcept {
    return count == other.count && std::memcmp(values, other.values, sizeof(int64_t) * count) == 0;
  }
};

struct KeyHash {
  size_t operator()(const Key& key) const noexcept {
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < key.count; ++i) {
      h = (h ^ static_cast<uint64_t>(key.values[i])) * 1099511628211ull;
    }
    return static_cast<size_t>(h);
  }
};

// The records. Launches hold the lock shared from the lookup to cuLaunchKernel, so clear() (exclusive)
// returns only when no launch still uses a record; the Python side drops the plans (and with them the
// loaded modules the functions live in) after that.
std::shared_mutex table_mutex;
std::unordered_map<Key, Record, KeyHash> table;
LaunchFn launch_kernel = nullptr;
// autosoft.native._miss; never destroyed (a static py::object would be released at exit without the GIL)
py::object* miss_callable = nullptr;
// autosoft.native._direct_miss, for the public functions' calls; never destroyed, as above
py::object* direct_miss_callable = nullptr;
bool direct_on = false;  // set by init(), cleared by disable(); read with the GIL held
std::unique_ptr<torch::Library> registration;
std::atomic<uint64_t> launches{0};  // calls launched here, for tests and benchmarks to tell which path ran

// Errors are std::runtime_error with messages built by std::string (RuntimeError in Python, from
// pybind11 and from torch's dispatcher alike), not torch's checks: a check whose message holds a
// number formats it through c10::str, which crashed (SIGSEGV) when called from an extension built
// against the H200 machine's torch, while literal messages and std::to_string did not.
[[noreturn]] void fail(const std::string& message) {
  throw std::runtime_error(message);
}

// Whether calls like x have a key (see Key), written into `key`.
bool key_of(int op, const at::Tensor& x, Key& key) {
  const int64_t dims = x.dim();
  if (dims > kMaxDims) {
    return false;
  }
  key.values[0] = op;
  key.values[1] = static_cast<int64_t>(x.scalar_type());
  key.values[2] = x.device().index();
  key.values[3] = dims;
  std::memcpy(key.values + 4, x.sizes().data(), sizeof(int64_t) * dims);
  key.count = static_cast<int>(4 + dims);
  return true;
}

// Whether the dispatcher's next kernel after this one would be the CUDA backend's: no tensor subclass,
// dispatch mode, functionalization or functorch layer in between (as torch_ops._goes_to_real).
bool goes_to_cuda(c10::DispatchKeySet keys) {
  return (keys & c10::after_ADInplaceOrView_keyset).highestPriorityTypeId() == c10::DispatchKey::CUDA;
}

at::Tensor miss(int op, c10::DispatchKeySet keys, const at::Tensor& x, int64_t dim) {
  py::gil_scoped_acquire gil;
  if (miss_callable == nullptr) {
    fail("autosoft native operators: enabled without autosoft.native._miss");
  }
  return (*miss_callable)(op, keys, x, dim).cast<at::Tensor>();
}

// Allocates the output and launches the recorded kernel on torch's current stream, or returns an undefined
// tensor where the fresh output's address cannot go with the input's (the kernels read 16-byte vectors
// from both at the same offsets). The caller holds table_mutex shared.
at::Tensor launch_recorded(int op, const at::Tensor& x, const Record& record) {
  c10::DeviceGuard guard(x.device());
  // at::empty_like's result for a contiguous x (its strides kept, odd ones on dims of size 1 included),
  // with one dispatcher call instead of two
  at::Tensor y = at::empty_strided(x.sizes(), x.strides(), x.options());
  const auto x_address = reinterpret_cast<uint64_t>(x.const_data_ptr());
  const auto y_address = reinterpret_cast<uint64_t>(y.data_ptr());
  if ((y_address - x_address) % kVecAlign != 0) {
    return at::Tensor();
  }
  uint64_t words[kMaxParams];
  void* params[kMaxParams];
  std::memcpy(words, record.words, sizeof(uint64_t) * record.count);
  words[record.x_word] = x_address;
  words[record.y_word] = y_address;
  for (int i = 0; i < record.count; ++i) {
    params[i] = &words[i];
  }
  const c10::impl::VirtualGuardImpl cuda(c10::DeviceType::CUDA);
  void* stream = cuda.getStreamNativeHandle(cuda.getStream(x.device()));
  const unsigned* g = record.geometry;
  const int status = launch_kernel(record.function, g[0], g[1], g[2], g[3], g[4], g[5], g[6], stream, params,
                                   nullptr);
  if (status != 0) {
    fail(std::string("autosoft.") + (op == kSoftmax ? "softmax" : "log_softmax") +
         ": cuLaunchKernel failed with CUresult " + std::to_string(status));
  }
  launches.fetch_add(1, std::memory_order_relaxed);
  return y;
}

// The output of the recorded launch for calls like x, or an undefined tensor where none launches: no
// record, a record that says the plan is not replayable, no key (more dims than a key holds), or an
// output address the kernel cannot take. `known`: whether Python has nothing to learn from this call
// (anything but "no record yet").
at::Tensor launch_if_recorded(int op, const at::Tensor& x, bool& known) {
  Key key;
  if (!key_of(op, x, key)) {
    known = true;
    return at::Tensor();
  }
  std::shared_lock<std::shared_mutex> lock(table_mutex);
  auto found = table.find(key);
  known = found != table.end();
  if (!known || found->second.function == nullptr) {
    return at::Tensor();
  }
  return launch_recorded(op, x, found->second);
}

at::Tensor run(int op, c10::DispatchKeySet keys, const at::Tensor& x, int64_t dim) {
  if (dim != -1 || (at::GradMode::is_enabled() && x.requires_grad()) || !goes_to_cuda(keys) ||
      !x.is_contiguous()) {
    return miss(op, keys, x, dim);
  }
  bool known = false;
  at::Tensor y = launch_if_recorded(op, x, known);
  return y.defined() ? y : miss(op, keys, x, dim);
}

// Whether a public call on this tensor may be launched from here: what the public function's own checks
// and the operator's (run, goes_to_cuda) would send to its plain path. The dispatch keys are the ones the
// dispatcher would compute for an operator on x: the tensor's and the thread's. Above autograd nothing
// may intervene (vmap, functorch, a Python dispatcher; autocast changes nothing here), below it nothing but
// the CUDA backend (dispatch modes, functionalization); no torch function mode (it would not see the
// allocation) and no JIT tracer (it would record the allocation and not the launch). Without autograd
// (under inference_mode, or an inference tensor outside it) the first key is ADInplaceOrView, which
// passes an operator that neither views nor writes its input straight through.
bool direct_takes(const at::Tensor& x) {
  if (!x.is_cuda() || !x.is_contiguous() || (x.requires_grad() && at::GradMode::is_enabled())) {
    return false;
  }
  const c10::impl::LocalDispatchKeySet local = c10::impl::tls_local_dispatch_key_set();
  // BackendSelect is in every thread's included set; it serves factory functions only, and the dispatcher
  // passes an operator on tensors straight through it
  const c10::DispatchKeySet keys = (((x.key_set() | local.included_) - local.excluded_) - c10::autocast_dispatch_keyset)
                                       .remove(c10::DispatchKey::BackendSelect);
  const c10::DispatchKey top = keys.highestPriorityTypeId();
  return (top == c10::DispatchKey::AutogradCUDA || top == c10::DispatchKey::ADInplaceOrView ||
          top == c10::DispatchKey::CUDA) &&
         goes_to_cuda(keys) &&
         !at::impl::torch_function_mode_enabled() && !torch::jit::tracer::isTracing();
}

// autosoft.softmax(x, dim, out) and log_softmax's first step: the output of a recorded plan, launched here;
// None for any call this does not take (the public function then runs its Python path as it would
// without this file); on a plain call whose plan is not recorded yet, autosoft.native._direct_miss(op, x)
// (the Python path, then the record). x a torch.Tensor (exactly: subclasses such as fake tensors have their
// own semantics), dim the int -1 or the index of x's last dim, out None.
PyObject* direct(int op, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 3 || !direct_on || args[2] != Py_None || !PyLong_CheckExact(args[1]) ||
      Py_TYPE(args[0]) != reinterpret_cast<PyTypeObject*>(THPVariableClass)) {
    Py_RETURN_NONE;
  }
  int overflow = 0;
  const long dim = PyLong_AsLongAndOverflow(args[1], &overflow);
  const at::Tensor& x = THPVariable_Unpack(args[0]);
  // the last dim, as -1 or by its index (the public function's Python path takes both to one plan)
  if (overflow != 0 || (dim != -1 && (dim < 0 || dim != x.dim() - 1)) || !direct_takes(x)) {
    Py_RETURN_NONE;
  }
  bool known = false;
  at::Tensor y = launch_if_recorded(op, x, known);
  if (y.defined()) {
    return THPVariable_Wrap(std::move(y));
  }
  if (known) {
    Py_RETURN_NONE;  // not replayable from here, or an output the Python path realigns
  }
  return (*direct_miss_callable)(op, py::handle(args[0])).release().ptr();
  END_HANDLE_TH_ERRORS
}

PyObject* softmax_direct(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  return direct(kSoftmax, args, nargs);
}

PyObject* log_softmax_direct(PyObject* /*module*/, PyObject* const* args, Py_ssize_t nargs) {
  return direct(kLogSoftmax, args, nargs);
}

// METH_FASTCALL: no argument parsing, no pybind11 overload resolution between the call and the lookup
PyMethodDef direct_methods[] = {
    {"softmax_direct", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(softmax_direct)), METH_FASTCALL,
     "softmax_direct(x, dim, out): autosoft.softmax's recorded launch, or None where the Python path runs"},
    {"log_softmax_direct", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(log_softmax_direct)),
     METH_FASTCALL, "log_softmax_direct(x, dim, out): autosoft.log_softmax's, as softmax_direct"},
    {nullptr, nullptr, 0, nullptr}};

at::Tensor softmax_kernel(c10::DispatchKeySet keys, const at::Tensor& x, int64_t dim) {
  return run(kSoftmax, keys, x, dim);
}

at::Tensor log_softmax_kernel(c10::DispatchKeySet keys, const at::Tensor& x, int64_t dim) {
  return run(kLogSoftmax, keys, x, dim);
}

void record(int op, const at::Tensor& x, uint64_t function, const std::vector<int64_t>& geometry,
            const std::vector<uint64_t>& words, int x_word, int y_word) {
  if (op != kSoftmax && op != kLogSoftmax) {
    fail("autosoft native: no operator " + std::to_string(op));
  }
  if (!x.is_cuda()) {
    fail("autosoft native: records are for CUDA tensors");
  }
  if (function == 0 || geometry.size() != 7) {
    fail("autosoft native: a launch needs a function and 7 numbers");
  }
  const int count = static_cast<int>(words.size());
  if (count > kMaxParams || x_word < 0 || x_word >= count || y_word < 0 || y_word >= count || x_word == y_word) {
    fail("autosoft native: " + std::to_string(count) + " parameter words with the pointers at " +
         std::to_string(x_word) + " and " + std::to_string(y_word));
  }
  Record r;
  r.function = reinterpret_cast<void*>(function);
  for (int i = 0; i < 7; ++i) {
    if (geometry[i] < 0) {
      fail("autosoft native: negative launch geometry");
    }
    r.geometry[i] = static_cast<unsigned>(geometry[i]);
  }
  r.count = count;
  std::copy(words.begin(), words.end(), r.words);
  r.x_word = x_word;
  r.y_word = y_word;
  Key key;
  if (!key_of(op, x, key)) {
    return;  // too many dimensions: such calls stay in Python
  }
  py::gil_scoped_release nogil;  // a launch in flight may hold the lock; it never waits for the GIL
  std::unique_lock<std::shared_mutex> lock(table_mutex);
  table[key] = r;
}

// Marks the plan of calls like x as not replayable from here (see Record).
void record_unreplayable(int op, const at::Tensor& x) {
  if (op != kSoftmax && op != kLogSoftmax) {
    fail("autosoft native: no operator " + std::to_string(op));
  }
  Key key;
  if (!key_of(op, x, key)) {
    return;
  }
  py::gil_scoped_release nogil;
  std::unique_lock<std::shared_mutex> lock(table_mutex);
  table[key] = Record();
}

void clear() {
  py::gil_scoped_release nogil;
  std::unique_lock<std::shared_mutex> lock(table_mutex);
  table.clear();
}

// How many records launch (not the ones that only say a plan cannot be replayed).
size_t size() {
  std::shared_lock<std::shared_mutex> lock(table_mutex);
  size_t count = 0;
  for (const auto& entry : table) {
    count += entry.second.function != nullptr;
  }
  return count;
}

// cuLaunchKernel's address, and the Python function a path that cannot launch calls into `slot`
// (allocated once, never destroyed: see miss_callable).
void take(uint64_t cu_launch_kernel, py::object*& slot, py::object function) {
  if (cu_launch_kernel == 0) {
    fail("autosoft native: no cuLaunchKernel");
  }
  launch_kernel = reinterpret_cast<LaunchFn>(cu_launch_kernel);
  if (slot == nullptr) {
    slot = new py::object(std::move(function));
  } else {
    *slot = std::move(function);
  }
}

// Turns the public functions' entries on: cuLaunchKernel's address and autosoft.native._direct_miss.
void init(uint64_t cu_launch_kernel, py::object direct_miss) {
  take(cu_launch_kernel, direct_miss_callable, std::move(direct_miss));
  direct_on = true;
}

void enable(uint64_t cu_launch_kernel, py::object miss_function) {
  take(cu_launch_kernel, miss_callable, std::move(miss_function));
  if (!registration) {
    // AutogradCUDA: before the Python Autograd kernel (the alias key) for CUDA tensors, and only those
    registration = std::make_unique<torch::Library>(torch::Library::IMPL, "autosoft", c10::DispatchKey::AutogradCUDA,
                                                    __FILE__, __LINE__);
    registration->impl("softmax", TORCH_FN(softmax_kernel));
    registration->impl("log_softmax", TORCH_FN(log_softmax_kernel));
  }
}

void disable() {
  registration.reset();  // the Python Autograd kernel serves CUDA tensors again
  direct_on = false;     // and the public functions' Python path serves every call
  clear();
}

bool enabled() {
  return registration != nullptr;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "autosoft's compiled AutogradCUDA kernels for torch.ops.autosoft.softmax and log_softmax";
  m.def("init", &init, "turn the public functions' entries on: init(address of cuLaunchKernel, direct_miss(op, x))");
  m.def("direct_on", [] { return direct_on; }, "whether softmax_direct and log_softmax_direct launch");
  m.def("record_unreplayable", &record_unreplayable, "record_unreplayable(op, x): calls like x go to Python");
  if (PyModule_AddFunctions(m.ptr(), direct_methods) != 0) {
    throw py::error_already_set();
  }
  m.def("enable", &enable, "register the kernels: enable(address of cuLaunchKernel, miss(op, keyset, x, dim))");
  m.def("disable", &disable, "deregister the kernels and drop the records");
  m.def("enabled", &enabled);
  m.def("record", &record, "record(op, x, function, geometry[7], words, x_word, y_word): launch calls like x");
  m.def("clear", &clear, "drop every record (returns once no launch uses one)");
  m.def("size", &size, "how many launches are recorded");
  m.def("launches", [] { return launches.load(); }, "how many calls were launched from here");
}
