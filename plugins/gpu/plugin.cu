// The plugin table of the GPU backends: probe, device memory and the entry
// point, whose find_kernel is the table generated from the backend's
// manifest (ops.hpp).
#include <algorithm>
#include <cstdio>
#include <iterator>
#include <cstring>

#include "launch_utils.hpp"
#include "ops.hpp"

namespace kd_gpu {
namespace {

// The runtime's answers that mean "this machine has no usable device" rather
// than a failure: no driver, a driver too old for the runtime, no device.
bool means_no_device(cudaError_t err) {
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) return true;
#if !defined(__HIP__)
  if (err == cudaErrorStubLibrary) return true;  // the driver is only a stub library
#endif
  return false;
}

// The arch string the manifests use: "9.0" for CUDA, "gfx90a" for HIP.
void describe_arch(const cudaDeviceProp& prop, char* arch, size_t arch_capacity) {
#if defined(__HIP__)
  // "gfx90a:sramecc+:xnack-" -> "gfx90a", the name manifests use.
  std::snprintf(arch, arch_capacity, "%.*s", static_cast<int>(arch_capacity - 1),
                prop.gcnArchName);
  if (char* colon = std::strchr(arch, ':')) *colon = '\0';
#else
  std::snprintf(arch, arch_capacity, "%d.%d", prop.major, prop.minor);
#endif
}

// Writes each device into the caller's array, whose element size is the
// caller's struct_size (a host of another ABI minor may have a longer or
// shorter kd_device_info); fields beyond it are left alone.
kd_status probe(kd_device_info* devices, size_t capacity, size_t* count, char* error,
                size_t error_capacity) {
  if (count == nullptr || (capacity > 0 && devices == nullptr)) {
    if (error != nullptr) kd_plugin::copy_string(error, error_capacity, "probe: null argument");
    return KD_STATUS_INVALID_ARGUMENT;
  }
  *count = 0;
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();  // do not leave the error for the next call to find
    if (means_no_device(err)) return KD_STATUS_OK;
    if (error != nullptr) {
      std::snprintf(error, error_capacity, KD_GPU_BACKEND ": counting devices: %s",
                    cudaGetErrorString(err));
    }
    return KD_STATUS_DEVICE_ERROR;
  }
  const size_t stride = capacity > 0 ? devices[0].struct_size : 0;
  if (capacity > 0 && stride < KD_STRUCT_SIZE(kd_device_info, device_id)) {
    if (error != nullptr) {
      kd_plugin::copy_string(error, error_capacity, "probe: kd_device_info.struct_size too small");
    }
    return KD_STATUS_INVALID_ARGUMENT;
  }
  for (int i = 0; i < n && static_cast<size_t>(i) < capacity; ++i) {
    auto* d = reinterpret_cast<kd_device_info*>(reinterpret_cast<char*>(devices) + i * stride);
#if defined(__HIP__)
    d->device_type = kDLROCM;
#else
    d->device_type = kDLCUDA;
#endif
    d->device_id = i;
    cudaDeviceProp prop;
    const cudaError_t prop_err = cudaGetDeviceProperties(&prop, i);
    if (prop_err != cudaSuccess) {
      if (error != nullptr) {
        std::snprintf(error, error_capacity, "device %d: %s", i, cudaGetErrorString(prop_err));
      }
      return KD_STATUS_DEVICE_ERROR;
    }
    if (KD_STRUCT_HAS_FIELD(kd_device_info, arch, stride)) {
      describe_arch(prop, d->arch, sizeof d->arch);
    }
    if (KD_STRUCT_HAS_FIELD(kd_device_info, name, stride)) {
      std::snprintf(d->name, sizeof d->name, "%.*s", static_cast<int>(sizeof d->name - 1),
                    prop.name);
    }
    if (KD_STRUCT_HAS_FIELD(kd_device_info, runtime_version, stride)) {
      int driver = 0;
      int runtime = 0;
      if (cudaDriverGetVersion(&driver) != cudaSuccess) (void)cudaGetLastError();
      if (cudaRuntimeGetVersion(&runtime) != cudaSuccess) (void)cudaGetLastError();
      std::snprintf(d->driver_version, sizeof d->driver_version, "%d", driver);
      std::snprintf(d->runtime_version, sizeof d->runtime_version, "%d", runtime);
    }
  }
  *count = static_cast<size_t>(n);
  return KD_STATUS_OK;
}

// --- device memory, for hosts that place tensors without linking the runtime ---

kd_status memory_error(cudaError_t err, const char* what, char* error, size_t error_capacity) {
  (void)cudaGetLastError();
  if (error != nullptr && error_capacity > 0) {
    std::snprintf(error, error_capacity, KD_GPU_BACKEND ": %s: %s", what, cudaGetErrorString(err));
  }
  return KD_STATUS_DEVICE_ERROR;
}

kd_status memory_alloc(int32_t device_id, size_t bytes, void** ptr, char* error, size_t error_capacity) {
  if (ptr == nullptr) return KD_STATUS_INVALID_ARGUMENT;
  *ptr = nullptr;
  cudaError_t err = cudaSetDevice(device_id);
  if (err == cudaSuccess) err = cudaMalloc(ptr, bytes);
  return err == cudaSuccess ? KD_STATUS_OK : memory_error(err, "allocation", error, error_capacity);
}

kd_status memory_free(int32_t device_id, void* ptr, char* error, size_t error_capacity) {
  if (ptr == nullptr) return KD_STATUS_OK;
  cudaError_t err = cudaSetDevice(device_id);
  if (err == cudaSuccess) err = cudaFree(ptr);
  return err == cudaSuccess ? KD_STATUS_OK : memory_error(err, "free", error, error_capacity);
}

kd_status memory_copy(int32_t device_id, void* dst, const void* src, size_t bytes, int32_t kind, char* error,
                      size_t error_capacity) {
  cudaMemcpyKind direction;
  switch (kind) {
    case KD_COPY_HOST_TO_DEVICE: direction = cudaMemcpyHostToDevice; break;
    case KD_COPY_DEVICE_TO_HOST: direction = cudaMemcpyDeviceToHost; break;
    default:
      if (error != nullptr) std::snprintf(error, error_capacity, "copy: unknown kind %d", static_cast<int>(kind));
      return KD_STATUS_INVALID_ARGUMENT;
  }
  cudaError_t err = cudaSetDevice(device_id);
  if (err == cudaSuccess) err = cudaMemcpy(dst, src, bytes, direction);
  return err == cudaSuccess ? KD_STATUS_OK : memory_error(err, "copy", error, error_capacity);
}

kd_status memory_synchronize(int32_t device_id, char* error, size_t error_capacity) {
  cudaError_t err = cudaSetDevice(device_id);
  if (err == cudaSuccess) err = cudaDeviceSynchronize();
  return err == cudaSuccess ? KD_STATUS_OK : memory_error(err, "synchronize", error, error_capacity);
}

// --- timing of calls the host makes, for `kdispatch tune` ---------------------

// Replays of each graph timed after the first; the medians count.
constexpr int kTimedReplays = 5;

// One graph of calls and its instance, destroyed on every path.
struct Graph {
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  Graph() = default;
  Graph(const Graph&) = delete;
  Graph& operator=(const Graph&) = delete;
  ~Graph() { reset(); }
  void reset() {
    if (exec != nullptr) (void)cudaGraphExecDestroy(exec);
    if (graph != nullptr) (void)cudaGraphDestroy(graph);
    exec = nullptr;
    graph = nullptr;
  }
};

// What time_calls makes, destroyed in reverse order on every path. A
// capture still open when it is destroyed (fn failed mid-capture) is ended
// first, so that the stream can be destroyed.
struct Timing {
  cudaStream_t stream = nullptr;
  cudaEvent_t begin = nullptr, end = nullptr;
  Graph graphs[2];  // count calls, 2 * count calls
  bool capturing = false;
  ~Timing() {
    if (capturing) {
      cudaGraph_t partial = nullptr;
      if (cudaStreamEndCapture(stream, &partial) == cudaSuccess && partial != nullptr) {
        (void)cudaGraphDestroy(partial);
      }
    }
    for (Graph& g : graphs) g.reset();
    if (end != nullptr) (void)cudaEventDestroy(end);
    if (begin != nullptr) (void)cudaEventDestroy(begin);
    if (stream != nullptr) {
      (void)cudaStreamSynchronize(stream);
      (void)cudaStreamDestroy(stream);
    }
    (void)cudaGetLastError();
  }
};

// Microseconds between t.begin and t.end, once t.end has been recorded.
cudaError_t elapsed_us(const Timing& t, double* us) {
  cudaError_t err = cudaEventSynchronize(t.end);
  float ms = 0;
  if (err == cudaSuccess) err = cudaEventElapsedTime(&ms, t.begin, t.end);
  *us = static_cast<double>(ms) * 1e3;
  return err;
}

// Captures `calls` calls (call i makes the host's call i % count) into g,
// instantiates it and replays it once (its first replay uploads it).
kd_status capture(Timing& t, Graph& g, kd_timed_fn fn, void* user, int32_t count, int32_t calls, char* error,
                  size_t error_capacity) {
  // Thread-local capture mode: other threads of the process may use the
  // runtime meanwhile.
  cudaError_t err = cudaStreamBeginCapture(t.stream, cudaStreamCaptureModeThreadLocal);
  if (err != cudaSuccess) return memory_error(err, "time_calls: capture", error, error_capacity);
  t.capturing = true;
  for (int32_t i = 0; i < calls; ++i) {
    const kd_status s = fn(user, i % count, t.stream);
    if (s != KD_STATUS_OK) return s;
  }
  t.capturing = false;
  err = cudaStreamEndCapture(t.stream, &g.graph);
  if (err == cudaSuccess) err = cudaGraphInstantiateWithFlags(&g.exec, g.graph, 0);
  if (err == cudaSuccess) err = cudaGraphLaunch(g.exec, t.stream);
  if (err == cudaSuccess) err = cudaStreamSynchronize(t.stream);
  return err == cudaSuccess ? KD_STATUS_OK : memory_error(err, "time_calls: graph", error, error_capacity);
}

// graph_us: what one more call adds to a graph of calls, from graphs of
// count and 2 * count calls replayed in turn, so that what a replay costs
// once whatever its length (its launch) does not count; eager_us: count
// calls launched back to back, per call.
kd_status time_calls(int32_t device_id, kd_timed_fn fn, void* user, int32_t count, double* graph_us,
                     double* eager_us, char* error, size_t error_capacity) {
  if (fn == nullptr || count < 1 || count > INT32_MAX / 2 || graph_us == nullptr || eager_us == nullptr) {
    if (error != nullptr && error_capacity > 0) {
      std::snprintf(error, error_capacity,
                    KD_GPU_BACKEND ": time_calls: expected a function, a count from 1 to 1073741823 and two outputs");
    }
    return KD_STATUS_INVALID_ARGUMENT;
  }
  Timing t;
  cudaError_t err = cudaSetDevice(device_id);
  if (err == cudaSuccess) err = cudaStreamCreateWithFlags(&t.stream, cudaStreamNonBlocking);
  if (err == cudaSuccess) err = cudaEventCreate(&t.begin);
  if (err == cudaSuccess) err = cudaEventCreate(&t.end);
  if (err != cudaSuccess) return memory_error(err, "time_calls: setup", error, error_capacity);
  // Warm-up: the first launches of a kernel load its module.
  for (int32_t i = 0; i < 2 && i < count; ++i) {
    const kd_status s = fn(user, i, t.stream);
    if (s != KD_STATUS_OK) return s;
  }
  err = cudaStreamSynchronize(t.stream);
  if (err != cudaSuccess) return memory_error(err, "time_calls: warm-up", error, error_capacity);
  for (int k = 0; k < 2; ++k) {
    const kd_status s = capture(t, t.graphs[k], fn, user, count, count * (k + 1), error, error_capacity);
    if (s != KD_STATUS_OK) return s;
  }
  double replays[2][kTimedReplays];
  for (int r = 0; r < kTimedReplays; ++r) {
    for (int k = 0; k < 2; ++k) {
      err = cudaEventRecord(t.begin, t.stream);
      if (err == cudaSuccess) err = cudaGraphLaunch(t.graphs[k].exec, t.stream);
      if (err == cudaSuccess) err = cudaEventRecord(t.end, t.stream);
      if (err == cudaSuccess) err = elapsed_us(t, &replays[k][r]);
      if (err != cudaSuccess) return memory_error(err, "time_calls: graph replay", error, error_capacity);
    }
  }
  for (auto& times : replays) std::sort(std::begin(times), std::end(times));
  const double shorter = replays[0][kTimedReplays / 2], longer = replays[1][kTimedReplays / 2];
  // Where noise leaves no positive difference (calls that cost next to
  // nothing), the longer replay per call stands in.
  *graph_us = longer > shorter ? (longer - shorter) / count : longer / (2.0 * count);
  // Back to back: the same calls launched one after the other.
  err = cudaEventRecord(t.begin, t.stream);
  if (err != cudaSuccess) return memory_error(err, "time_calls: event", error, error_capacity);
  for (int32_t i = 0; i < count; ++i) {
    const kd_status s = fn(user, i, t.stream);
    if (s != KD_STATUS_OK) return s;
  }
  err = cudaEventRecord(t.end, t.stream);
  double total = 0;
  if (err == cudaSuccess) err = elapsed_us(t, &total);
  if (err != cudaSuccess) return memory_error(err, "time_calls: launches", error, error_capacity);
  *eager_us = total / count;
  return KD_STATUS_OK;
}

// Internal linkage: only the host-side entry point refers to it (a global
// with external linkage would be emitted in HIP's device pass too).
constexpr kd_memory_api kMemory = {KD_MEMORY_API_STRUCT_SIZE, memory_alloc, memory_free, memory_copy,
                                   memory_synchronize, time_calls};

}  // namespace
}  // namespace kd_gpu

KD_DEFINE_PLUGIN(KD_GPU_BACKEND, "0.1.0", KD_GPU_BACKEND, kd_gpu::probe, kd_plugin::find_kernel, &kd_gpu::kMemory)
