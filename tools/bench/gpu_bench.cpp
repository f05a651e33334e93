// GPU check and benchmark of a kdispatch GPU plugin, driven only through the
// plugin's C ABI (dlopen -> kdispatch_plugin_api -> find_kernel), as the core
// would drive it. Host code only: links the CUDA runtime, launches no kernel
// of its own.
//
//   gpu_bench check PLUGIN.so            every op x dtype against the reference
//                                        plugin beside PLUGIN.so, called through
//                                        tools/harness/reference_ops.hpp
//   gpu_bench bench PLUGIN.so [--csv F]  time large and small shapes; prints
//                                        us, GB/s and % of the device-to-device
//                                        copy bandwidth measured in the same run
//
// Exit status: 0 when every check passed, 1 on a failed check, 2 on a usage or
// setup error.
#include <cuda_runtime.h>
#include <dlfcn.h>
#include <kdispatch/plugin_api.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

#include "dtype_codec.hpp"
#include "harness.hpp"
#include "raw_call.hpp"
#include "reference_ops.hpp"

namespace {

namespace harness = kdispatch::harness;
namespace ref = kdispatch::reference;
using ref::Dtype;
using ref::Tolerance;

[[noreturn]] void die(const std::string& message) {
  std::fflush(stdout);
  std::fprintf(stderr, "gpu_bench: %s\n", message.c_str());
  std::exit(2);
}

void cuda_ok(cudaError_t err, const char* what) {
  if (err != cudaSuccess) die(std::string(what) + ": " + cudaGetErrorString(err));
}

// --- element types ------------------------------------------------------------

const Dtype kAllDtypes[] = {Dtype::kFloat32, Dtype::kFloat16, Dtype::kBFloat16};

DLDataType dl_dtype(Dtype t) { return kdispatch::to_dlpack(harness::from_reference(t)); }

// `values` stored as type t (through float32, as the device converts; the
// fast conversions of the harness, as the benchmark fills gigabytes), and the
// values such bytes hold.
std::vector<uint8_t> to_bytes(Dtype t, const std::vector<double>& values) {
  std::vector<uint8_t> bytes(values.size() * static_cast<size_t>(ref::dtype_size(t)));
  for (size_t i = 0; i < values.size(); ++i) harness::store(bytes.data(), harness::from_reference(t), i, values[i]);
  return bytes;
}

std::vector<double> from_bytes(Dtype t, const std::vector<uint8_t>& bytes) {
  std::vector<double> values(bytes.size() / static_cast<size_t>(ref::dtype_size(t)));
  for (size_t i = 0; i < values.size(); ++i) values[i] = harness::load(bytes.data(), harness::from_reference(t), i);
  return values;
}

// The tolerance the schema of op `group.name` declares for outputs of `t`,
// in relative form (harness::relative_tolerance).
Tolerance tolerance(const std::string& op, Dtype t) {
  return harness::relative_tolerance(harness::builtin_schema(op), t);
}

// --- device tensors -----------------------------------------------------------

struct DeviceBuffer {
  void* ptr = nullptr;
  size_t bytes = 0;
  explicit DeviceBuffer(size_t n) : bytes(n) { cuda_ok(cudaMalloc(&ptr, std::max<size_t>(n, 1)), "cudaMalloc"); }
  ~DeviceBuffer() { cudaFree(ptr); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
};

// A tensor in device memory; `offset` bytes before its data are allocated
// too, to test pointers that are not 16-byte aligned.
struct Tensor {
  std::vector<int64_t> shape;
  DLDataType dtype{};
  size_t offset = 0;
  std::unique_ptr<DeviceBuffer> buffer;

  Tensor(std::vector<int64_t> s, DLDataType t, size_t off = 0) : shape(std::move(s)), dtype(t), offset(off) {
    buffer = std::make_unique<DeviceBuffer>(offset + bytes());
  }
  int64_t numel() const {
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    return n;
  }
  size_t bytes() const { return static_cast<size_t>(numel()) * dtype.bits / 8; }
  void* data() const { return static_cast<char*>(buffer->ptr) + offset; }
  DLTensor dl() const {
    DLTensor t{};
    t.data = buffer->ptr;
    t.byte_offset = offset;
    t.device = {kDLCUDA, 0};
    t.ndim = static_cast<int32_t>(shape.size());
    t.dtype = dtype;
    t.shape = const_cast<int64_t*>(shape.data());
    t.strides = nullptr;
    return t;
  }
  void upload(const void* src) const { cuda_ok(cudaMemcpy(data(), src, bytes(), cudaMemcpyHostToDevice), "upload"); }
  void download(void* dst) const { cuda_ok(cudaMemcpy(dst, data(), bytes(), cudaMemcpyDeviceToHost), "download"); }
  // All bits set: NaN in every float type, -1 in int32.
  void poison() const { cuda_ok(cudaMemset(data(), 0xff, bytes()), "poison"); }
};

Tensor float_tensor(Dtype t, std::vector<int64_t> shape, const std::vector<double>& values, size_t offset = 0) {
  Tensor out(std::move(shape), dl_dtype(t), offset);
  out.upload(to_bytes(t, values).data());
  return out;
}

std::vector<double> read_floats(Dtype t, const Tensor& tensor) {
  std::vector<uint8_t> bytes(tensor.bytes());
  tensor.download(bytes.data());
  return from_bytes(t, bytes);
}

// --- the plugin -----------------------------------------------------------------

struct Plugin {
  const kd_plugin_api* api = nullptr;
  std::string backend;

  explicit Plugin(const char* path) {
    void* handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) die(std::string("dlopen: ") + dlerror());
    auto entry = reinterpret_cast<kd_plugin_entry_fn>(dlsym(handle, KDISPATCH_PLUGIN_ENTRY_SYMBOL));
    if (entry == nullptr) die("no kdispatch_plugin_api in " + std::string(path));
    api = entry();
    if (api == nullptr || api->abi_major != KDISPATCH_ABI_MAJOR) die("plugin ABI mismatch");
    backend = api->backend;
  }

  kd_kernel_fn kernel(const char* op) const {
    const std::string symbol = "kd_" + backend + "_" + op;
    kd_kernel_fn fn = api->find_kernel(symbol.c_str());
    if (fn == nullptr) die("plugin has no kernel " + symbol);
    return fn;
  }
};

// The activation ops and their float64 references (reference_ops.hpp).
struct ActOp {
  const char* name;
  std::vector<double> (*reference)(std::span<const double> x, int64_t rows, int64_t d);
};
const ActOp kActOps[] = {{"silu_and_mul", ref::silu_and_mul},
                         {"gelu_and_mul", ref::gelu_and_mul},
                         {"gelu_tanh_and_mul", ref::gelu_tanh_and_mul}};

// --- checking ---------------------------------------------------------------------

struct Comparison {
  double max_abs = 0;
  int64_t bad = 0;
  int64_t first_bad = -1;
  double first_got = 0, first_ref = 0;

  void add(int64_t i, double got, double ref, Tolerance tol) {
    const double err = std::fabs(got - ref);
    if (!(err <= tol.atol + tol.rtol * std::fabs(ref))) {  // NaN fails too
      if (bad++ == 0) {
        first_bad = i;
        first_got = got;
        first_ref = ref;
      }
    }
    if (err > max_abs || std::isnan(err)) max_abs = std::isnan(err) ? INFINITY : err;
  }
};

// Every element of `got` against the same one of `want`.
Comparison compare(const std::vector<double>& got, const std::vector<double>& want, Tolerance tol) {
  Comparison c;
  for (size_t i = 0; i < got.size(); ++i) c.add(static_cast<int64_t>(i), got[i], want[i], tol);
  return c;
}

struct Checker {
  int passed = 0;
  int failed = 0;

  void status(const std::string& name, kd_status s, const harness::RawCall& call) {
    ++failed;
    std::printf("FAIL %-58s status %d: %s\n", name.c_str(), static_cast<int>(s), call.error);
  }
  void result(const std::string& name, const Comparison& c) {
    if (c.bad == 0) {
      ++passed;
      std::printf("ok   %-58s max abs err %.3g\n", name.c_str(), c.max_abs);
    } else {
      ++failed;
      std::printf("FAIL %-58s %lld bad values; first at %lld: got %.9g want %.9g\n", name.c_str(),
                  static_cast<long long>(c.bad), static_cast<long long>(c.first_bad), c.first_got,
                  c.first_ref);
    }
  }
  void expect(const std::string& name, bool ok, const std::string& detail) {
    if (ok) {
      ++passed;
      std::printf("ok   %-58s %s\n", name.c_str(), detail.c_str());
    } else {
      ++failed;
      std::printf("FAIL %-58s %s\n", name.c_str(), detail.c_str());
    }
  }
};

std::vector<double> random_values(std::mt19937_64& rng, Dtype t, int64_t n, double mean = 0, double stddev = 1) {
  std::normal_distribution<double> dist(mean, stddev);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) x = ref::round_to(t, dist(rng));
  return v;
}

std::string label(const char* op, Dtype t, const std::string& shape, size_t offset) {
  std::string s = std::string(op) + " " + ref::dtype_name(t) + " " + shape;
  if (offset != 0) s += " (unaligned)";
  return s;
}

void check_norm(const Plugin& plugin, Checker& checker, std::mt19937_64& rng, bool fused, Dtype t,
                int64_t rows, int64_t hidden, size_t offset) {
  const char* op = fused ? "fused_add_rmsnorm" : "rmsnorm";
  const double eps = 1e-6;
  const std::vector<double> x = random_values(rng, t, rows * hidden);
  const std::vector<double> r = random_values(rng, t, rows * hidden);
  const std::vector<double> w = random_values(rng, t, hidden, 1.0, 0.25);
  const Tensor tx = float_tensor(t, {rows, hidden}, x, offset);
  const Tensor tr = float_tensor(t, {rows, hidden}, r, offset);
  const Tensor tw = float_tensor(t, {hidden}, w, offset);
  Tensor tout({rows, hidden}, dl_dtype(t), offset);
  tout.poison();
  harness::RawCall call;
  call.fn = plugin.kernel(op);
  call.tensors = fused ? std::vector<DLTensor>{tx.dl(), tr.dl(), tw.dl()}
                       : std::vector<DLTensor>{tout.dl(), tx.dl(), tw.dl()};
  call.attrs = {harness::float_attr("eps", eps)};
  const std::string name = label(op, t, std::to_string(rows) + "x" + std::to_string(hidden), offset);
  if (kd_status s = call.run(nullptr); s != KD_STATUS_OK) return checker.status(name, s, call);
  cuda_ok(cudaDeviceSynchronize(), op);
  const Tolerance tol = tolerance(std::string("layernorm.") + op, t);
  if (!fused) {
    checker.result(name, compare(read_floats(t, tout), ref::rmsnorm(x, w, rows, hidden, eps), tol));
    return;
  }
  const ref::FusedAddRmsnormResult want = ref::fused_add_rmsnorm(x, r, w, rows, hidden, eps, t);
  checker.result(name, compare(read_floats(t, tx), want.x, tol));
  checker.result(name + " residual", compare(read_floats(t, tr), want.residual, {tol.rtol, 0}));  // one rounding
}

void check_act(const Plugin& plugin, Checker& checker, std::mt19937_64& rng, const ActOp& op, Dtype t,
               int64_t rows, int64_t d, size_t offset) {
  const std::vector<double> x = random_values(rng, t, rows * 2 * d, 0, 2);
  const Tensor tx = float_tensor(t, {rows, 2 * d}, x, offset);
  Tensor tout({rows, d}, dl_dtype(t), offset);
  tout.poison();
  harness::RawCall call;
  call.fn = plugin.kernel(op.name);
  call.tensors = {tout.dl(), tx.dl()};
  const std::string name = label(op.name, t, std::to_string(rows) + "x" + std::to_string(d), offset);
  if (kd_status s = call.run(nullptr); s != KD_STATUS_OK) return checker.status(name, s, call);
  cuda_ok(cudaDeviceSynchronize(), op.name);
  checker.result(name, compare(read_floats(t, tout), op.reference(x, rows, d),
                               tolerance(std::string("activation.") + op.name, t)));
}

void check_rotary(const Plugin& plugin, Checker& checker, std::mt19937_64& rng, Dtype t, int64_t tokens,
                  int64_t q_heads, int64_t k_heads, int64_t dim, bool neox, size_t offset) {
  const int64_t rot = dim / 2;
  const int64_t max_pos = 100;
  std::uniform_int_distribution<int64_t> pick(0, max_pos - 1);
  std::vector<int64_t> pos(static_cast<size_t>(tokens));
  for (int64_t& p : pos) p = pick(rng);
  if (tokens > 2) {
    pos[1] = -1;       // out of range: the token must stay unchanged
    pos[2] = max_pos;
  }
  const std::vector<double> q = random_values(rng, t, tokens * q_heads * dim);
  const std::vector<double> k = random_values(rng, t, tokens * k_heads * dim);
  std::vector<double> cache(static_cast<size_t>(max_pos * dim));
  for (int64_t p = 0; p < max_pos; ++p) {
    for (int64_t i = 0; i < rot; ++i) {
      const double angle = static_cast<double>(p) * std::pow(10000.0, -2.0 * static_cast<double>(i) / static_cast<double>(dim));
      cache[p * dim + i] = ref::round_to(t, std::cos(angle));
      cache[p * dim + rot + i] = ref::round_to(t, std::sin(angle));
    }
  }
  Tensor tpos({tokens}, {kDLInt, 64, 1}, offset ? 8 : 0);
  tpos.upload(pos.data());
  const Tensor tq = float_tensor(t, {tokens, q_heads, dim}, q, offset);
  const Tensor tk = float_tensor(t, {tokens, k_heads, dim}, k, offset);
  const Tensor tc = float_tensor(t, {max_pos, dim}, cache, offset);
  harness::RawCall call;
  call.fn = plugin.kernel("rotary_embedding");
  call.tensors = {tpos.dl(), tq.dl(), tk.dl(), tc.dl()};
  call.attrs = {harness::bool_attr("is_neox", neox)};
  const std::string name = label("rotary_embedding", t,
                                 std::string(neox ? "neox " : "gptj ") + std::to_string(tokens) + "x" +
                                     std::to_string(q_heads) + "x" + std::to_string(k_heads) + "x" +
                                     std::to_string(dim),
                                 offset);
  if (kd_status s = call.run(nullptr); s != KD_STATUS_OK) return checker.status(name, s, call);
  cuda_ok(cudaDeviceSynchronize(), "rotary_embedding");
  // A token whose position is outside the cache must stay unchanged: exactly
  // its input. The reference refuses such positions; it rotates the others.
  const auto outside = [&](int64_t tok) { return pos[tok] < 0 || pos[tok] >= max_pos; };
  std::vector<int64_t> in_cache = pos;
  for (int64_t tok = 0; tok < tokens; ++tok) {
    if (outside(tok)) in_cache[tok] = 0;
  }
  const ref::RotaryResult want = ref::rotary_embedding(in_cache, q, k, cache, tokens, q_heads, k_heads, rot, neox);
  Comparison c;
  auto verify = [&](const std::vector<double>& in, const std::vector<double>& rotated, const Tensor& tensor,
                    int64_t heads) {
    const std::vector<double> got = read_floats(t, tensor);
    for (int64_t tok = 0; tok < tokens; ++tok) {
      for (int64_t i = tok * heads * dim; i < (tok + 1) * heads * dim; ++i) {
        if (outside(tok)) {
          c.add(i, got[i], in[i], {0, 0});
        } else {
          c.add(i, got[i], rotated[i], tolerance("embeddings.rotary_embedding", t));
        }
      }
    }
  };
  verify(q, want.query, tq, q_heads);
  verify(k, want.key, tk, k_heads);
  checker.result(name, c);
}

void check_topk(const Plugin& plugin, Checker& checker, std::mt19937_64& rng, Dtype t, int64_t rows,
                int64_t experts, int64_t k, bool renormalize, size_t offset) {
  const std::vector<double> g = random_values(rng, t, rows * experts, 0, 2);
  const Tensor tg = float_tensor(t, {rows, experts}, g, offset);
  Tensor tw({rows, k}, {kDLFloat, 32, 1});
  Tensor tid({rows, k}, {kDLInt, 32, 1});
  tw.poison();
  tid.poison();
  harness::RawCall call;
  call.fn = plugin.kernel("topk_softmax");
  call.tensors = {tw.dl(), tid.dl(), tg.dl()};
  call.attrs = {harness::bool_attr("renormalize", renormalize)};
  const std::string name = label("topk_softmax", t,
                                 std::to_string(rows) + "x" + std::to_string(experts) + " k" + std::to_string(k) +
                                     (renormalize ? " renorm" : ""),
                                 offset);
  if (kd_status s = call.run(nullptr); s != KD_STATUS_OK) return checker.status(name, s, call);
  cuda_ok(cudaDeviceSynchronize(), "topk_softmax");
  std::vector<float> w(static_cast<size_t>(rows * k));
  std::vector<int32_t> ids(static_cast<size_t>(rows * k));
  tw.download(w.data());
  tid.download(ids.data());
  Comparison c;
  int64_t bad_ids = 0;
  const Tolerance tol = tolerance("moe.topk_softmax", Dtype::kFloat32);  // float32 weights
  const ref::TopkSoftmaxResult want = ref::topk_softmax(g, rows, experts, k, renormalize);
  for (int64_t row = 0; row < rows; ++row) {
    const double* p = want.probabilities.data() + row * experts;
    std::vector<bool> seen(static_cast<size_t>(experts), false);
    for (int64_t r = 0; r < k; ++r) {
      const int32_t id = ids[row * k + r];
      const double p_r = p[want.ids[row * k + r]];  // the r-th largest probability
      // An id is right when it is unused, in range and its probability is the
      // r-th largest (equal up to rounding: near-ties may swap).
      if (id < 0 || id >= experts || seen[id] || std::fabs(p[id] - p_r) > 1e-5 * p_r + 1e-9) {
        ++bad_ids;
        continue;
      }
      seen[id] = true;
      c.add(row * k + r, w[row * k + r], want.weights[row * k + r], tol);
    }
  }
  checker.result(name, c);
  if (bad_ids != 0) checker.expect(name + " ids", false, std::to_string(bad_ids) + " wrong expert ids");
  // K > E is refused before any launch.
  Tensor tw_big({rows, experts + 1}, {kDLFloat, 32, 1});
  Tensor tid_big({rows, experts + 1}, {kDLInt, 32, 1});
  harness::RawCall bad;
  bad.fn = call.fn;
  bad.tensors = {tw_big.dl(), tid_big.dl(), tg.dl()};
  bad.attrs = call.attrs;
  if (offset == 0 && k == 1) {
    const kd_status s = bad.run(nullptr);
    checker.expect(label("topk_softmax", t, "k > E", 0), s == KD_STATUS_INVALID_ARGUMENT,
                   std::string("status ") + std::to_string(static_cast<int>(s)) + ": " + bad.error);
  }
}

int run_check(const Plugin& plugin) {
  Checker checker;
  std::mt19937_64 rng(20261129);
  for (Dtype t : kAllDtypes) {
    const size_t unaligned = ref::dtype_size(t);
    for (bool fused : {false, true}) {
      for (int64_t hidden : {1, 7, 64, 1024, 4096, 4097, 8192, 16384, 20000}) {
        for (int64_t rows : {1, 37}) check_norm(plugin, checker, rng, fused, t, rows, hidden, 0);
      }
      check_norm(plugin, checker, rng, fused, t, 5, 4096, unaligned);
    }
    for (const ActOp& op : kActOps) {
      for (int64_t d : {1, 7, 8, 128, 4097, 8192}) {
        for (int64_t rows : {1, 37}) check_act(plugin, checker, rng, op, t, rows, d, 0);
      }
      check_act(plugin, checker, rng, op, t, 5, 4096, unaligned);
    }
    for (bool neox : {true, false}) {
      for (int64_t dim : {2, 6, 36, 64, 80, 128, 256}) {
        check_rotary(plugin, checker, rng, t, 1, 4, 2, dim, neox, 0);
        check_rotary(plugin, checker, rng, t, 37, 3, 1, dim, neox, 0);
      }
      check_rotary(plugin, checker, rng, t, 7, 4, 2, 128, neox, unaligned);
    }
    for (int64_t experts : {1, 7, 8, 64, 256, 257, 512, 1000, 4097}) {
      for (int64_t k : {1, 2, 8, 40}) {
        if (k > experts) continue;
        for (bool renorm : {false, true}) check_topk(plugin, checker, rng, t, 37, experts, k, renorm, 0);
      }
    }
    check_topk(plugin, checker, rng, t, 5, 256, 8, true, unaligned);
  }
  std::printf("\ncheck: %d passed, %d failed\n", checker.passed, checker.failed);
  return checker.failed == 0 ? 0 : 1;
}

// --- benchmark ---------------------------------------------------------------------

constexpr double kL2Bytes = 60e6;  // H200

// Fills a device buffer with random values of type t: a random block made on
// the host, repeated (benchmarks never time zeros).
void fill_random(void* dst, size_t count, Dtype t, std::mt19937_64& rng, double mean = 0, double stddev = 1) {
  const size_t block = std::min<size_t>(count, size_t{1} << 22);
  std::normal_distribution<double> dist(mean, stddev);
  std::vector<double> values(block);
  for (double& v : values) v = dist(rng);
  const std::vector<uint8_t> bytes = to_bytes(t, values);
  const size_t esize = ref::dtype_size(t);
  for (size_t at = 0; at < count; at += block) {
    const size_t n = std::min(block, count - at);
    cuda_ok(cudaMemcpy(static_cast<char*>(dst) + at * esize, bytes.data(), n * esize, cudaMemcpyHostToDevice), "fill");
  }
}

struct BenchCase {
  std::string op;
  Dtype dtype;
  std::string shape;
  double bytes = 0;                            // read + written per call
  std::function<std::vector<Tensor>(std::mt19937_64&)> make;  // one input set
  std::vector<kd_attr> attrs;
};

double median(std::vector<float> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// Median time of one call in microseconds, rotating among input sets.
double time_calls(std::vector<harness::RawCall>& calls, cudaStream_t stream, int iterations) {
  cudaEvent_t start, stop;
  cuda_ok(cudaEventCreate(&start), "event");
  cuda_ok(cudaEventCreate(&stop), "event");
  for (int i = 0; i < 5; ++i) {
    harness::RawCall& c = calls[i % calls.size()];
    if (kd_status s = c.run(stream); s != KD_STATUS_OK) die(std::string("kernel failed: ") + c.error);
  }
  cuda_ok(cudaStreamSynchronize(stream), "warm-up");
  std::vector<float> times;
  for (int i = 0; i < iterations; ++i) {
    harness::RawCall& c = calls[i % calls.size()];
    cuda_ok(cudaEventRecord(start, stream), "record");
    c.run(stream);
    cuda_ok(cudaEventRecord(stop, stream), "record");
    cuda_ok(cudaEventSynchronize(stop), "sync");
    float ms = 0;
    cuda_ok(cudaEventElapsedTime(&ms, start, stop), "elapsed");
    times.push_back(ms * 1000.f);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return median(times);
}

// Device-to-device copy bandwidth, counting bytes read plus bytes written.
double copy_bandwidth(cudaStream_t stream) {
  const size_t bytes = size_t{1} << 30;
  DeviceBuffer a(bytes), b(bytes);
  cuda_ok(cudaMemset(a.ptr, 1, bytes), "memset");
  cudaEvent_t start, stop;
  cuda_ok(cudaEventCreate(&start), "event");
  cuda_ok(cudaEventCreate(&stop), "event");
  std::vector<float> times;
  for (int i = 0; i < 23; ++i) {
    cuda_ok(cudaEventRecord(start, stream), "record");
    cuda_ok(cudaMemcpyAsync(b.ptr, a.ptr, bytes, cudaMemcpyDeviceToDevice, stream), "copy");
    cuda_ok(cudaEventRecord(stop, stream), "record");
    cuda_ok(cudaEventSynchronize(stop), "sync");
    float ms = 0;
    cuda_ok(cudaEventElapsedTime(&ms, start, stop), "elapsed");
    if (i >= 3) times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return 2.0 * static_cast<double>(bytes) / (median(times) * 1e-3) / 1e9;
}

std::vector<BenchCase> bench_cases() {
  std::vector<BenchCase> cases;
  auto norm = [&](bool fused, Dtype t, int64_t rows, int64_t hidden) {
    BenchCase c;
    c.op = fused ? "fused_add_rmsnorm" : "rmsnorm";
    c.dtype = t;
    c.shape = std::to_string(rows) + "x" + std::to_string(hidden);
    c.bytes = static_cast<double>(ref::dtype_size(t)) *
              (static_cast<double>(rows * hidden) * (fused ? 4 : 2) + static_cast<double>(hidden));
    c.attrs = {harness::float_attr("eps", 1e-6)};
    c.make = [=](std::mt19937_64& rng) {
      std::vector<Tensor> ts;
      ts.emplace_back(std::vector<int64_t>{rows, hidden}, dl_dtype(t));  // out | x
      ts.emplace_back(std::vector<int64_t>{rows, hidden}, dl_dtype(t));  // x | residual
      ts.emplace_back(std::vector<int64_t>{hidden}, dl_dtype(t));
      fill_random(ts[0].data(), rows * hidden, t, rng);
      fill_random(ts[1].data(), rows * hidden, t, rng);
      fill_random(ts[2].data(), hidden, t, rng, 1.0, 0.25);
      return ts;
    };
    cases.push_back(c);
  };
  auto act = [&](const char* op, Dtype t, int64_t rows, int64_t d) {
    BenchCase c;
    c.op = op;
    c.dtype = t;
    c.shape = std::to_string(rows) + "x" + std::to_string(d);
    c.bytes = static_cast<double>(ref::dtype_size(t)) * static_cast<double>(rows * d) * 3;
    c.make = [=](std::mt19937_64& rng) {
      std::vector<Tensor> ts;
      ts.emplace_back(std::vector<int64_t>{rows, d}, dl_dtype(t));
      ts.emplace_back(std::vector<int64_t>{rows, 2 * d}, dl_dtype(t));
      fill_random(ts[0].data(), rows * d, t, rng);
      fill_random(ts[1].data(), rows * 2 * d, t, rng);
      return ts;
    };
    cases.push_back(c);
  };
  auto rotary = [&](Dtype t, bool neox, int64_t tokens, int64_t hq, int64_t hk, int64_t dim) {
    const int64_t max_pos = 8192;
    BenchCase c;
    c.op = "rotary_embedding";
    c.dtype = t;
    c.shape = std::string(neox ? "neox " : "gptj ") + std::to_string(tokens) + "x" + std::to_string(hq) + "x" +
              std::to_string(hk) + "x" + std::to_string(dim);
    c.bytes =
        static_cast<double>(ref::dtype_size(t)) * static_cast<double>(tokens * (hq + hk) * dim * 2 + tokens * dim) +
        8.0 * static_cast<double>(tokens);
    c.attrs = {harness::bool_attr("is_neox", neox)};
    c.make = [=](std::mt19937_64& rng) {
      std::vector<Tensor> ts;
      ts.emplace_back(std::vector<int64_t>{tokens}, DLDataType{kDLInt, 64, 1});
      ts.emplace_back(std::vector<int64_t>{tokens, hq, dim}, dl_dtype(t));
      ts.emplace_back(std::vector<int64_t>{tokens, hk, dim}, dl_dtype(t));
      ts.emplace_back(std::vector<int64_t>{max_pos, dim}, dl_dtype(t));
      std::uniform_int_distribution<int64_t> pick(0, max_pos - 1);
      std::vector<int64_t> pos(static_cast<size_t>(tokens));
      for (int64_t& p : pos) p = pick(rng);
      ts[0].upload(pos.data());
      fill_random(ts[1].data(), tokens * hq * dim, t, rng);
      fill_random(ts[2].data(), tokens * hk * dim, t, rng);
      fill_random(ts[3].data(), max_pos * dim, t, rng, 0, 0.7);
      return ts;
    };
    cases.push_back(c);
  };
  auto topk = [&](Dtype t, int64_t rows, int64_t experts, int64_t k) {
    BenchCase c;
    c.op = "topk_softmax";
    c.dtype = t;
    c.shape = std::to_string(rows) + "x" + std::to_string(experts) + " k" + std::to_string(k);
    c.bytes = static_cast<double>(ref::dtype_size(t) * rows * experts + rows * k * 8);
    c.attrs = {harness::bool_attr("renormalize", true)};
    c.make = [=](std::mt19937_64& rng) {
      std::vector<Tensor> ts;
      ts.emplace_back(std::vector<int64_t>{rows, k}, DLDataType{kDLFloat, 32, 1});
      ts.emplace_back(std::vector<int64_t>{rows, k}, DLDataType{kDLInt, 32, 1});
      ts.emplace_back(std::vector<int64_t>{rows, experts}, dl_dtype(t));
      fill_random(ts[2].data(), rows * experts, t, rng, 0, 2);
      return ts;
    };
    cases.push_back(c);
  };
  for (Dtype t : kAllDtypes) norm(false, t, 32768, 8192);
  norm(false, Dtype::kBFloat16, 1, 4096);
  norm(true, Dtype::kBFloat16, 32768, 8192);
  norm(true, Dtype::kBFloat16, 1, 4096);
  for (const ActOp& op : kActOps) {
    act(op.name, Dtype::kBFloat16, 32768, 8192);
    act(op.name, Dtype::kBFloat16, 1, 4096);
  }
  rotary(Dtype::kBFloat16, true, 32768, 32, 8, 128);
  rotary(Dtype::kBFloat16, false, 32768, 32, 8, 128);
  rotary(Dtype::kBFloat16, true, 1, 32, 8, 128);
  topk(Dtype::kBFloat16, 32768, 256, 8);
  topk(Dtype::kFloat32, 32768, 256, 8);
  topk(Dtype::kBFloat16, 1, 256, 8);
  return cases;
}

int run_bench(const Plugin& plugin, const char* csv_path) {
  cudaStream_t stream;
  cuda_ok(cudaStreamCreate(&stream), "stream");
  cudaDeviceProp prop;
  cuda_ok(cudaGetDeviceProperties(&prop, 0), "properties");
  const double copy_gbps = copy_bandwidth(stream);
  std::printf("device: %s (%d SMs), device-to-device copy: %.0f GB/s (read + write)\n\n", prop.name,
              prop.multiProcessorCount, copy_gbps);
  FILE* csv = csv_path ? std::fopen(csv_path, "w") : nullptr;
  if (csv_path && !csv) die(std::string("cannot write ") + csv_path);
  if (csv) std::fprintf(csv, "op,dtype,shape,us,gbps,copy_gbps\n");
  std::printf("%-20s %-9s %-26s %10s %9s %7s\n", "op", "dtype", "shape", "us", "GB/s", "%copy");
  std::mt19937_64 rng(7);
  for (const BenchCase& bc : bench_cases()) {
    // Enough input sets that the working set exceeds 3x L2, so that timed
    // calls read from HBM as they would in a model.
    const int sets = static_cast<int>(std::clamp(std::ceil(3 * kL2Bytes / bc.bytes), 1.0, 64.0));
    std::vector<std::vector<Tensor>> inputs;
    std::vector<harness::RawCall> calls;
    for (int s = 0; s < sets; ++s) inputs.push_back(bc.make(rng));
    for (const std::vector<Tensor>& ts : inputs) {
      harness::RawCall c;
      c.fn = plugin.kernel(bc.op.c_str());
      for (const Tensor& t : ts) c.tensors.push_back(t.dl());
      c.attrs = bc.attrs;
      calls.push_back(std::move(c));
    }
    const int iterations = bc.bytes > 1e8 ? 50 : 400;
    const double us = time_calls(calls, stream, iterations);
    const double gbps = bc.bytes / (us * 1e-6) / 1e9;
    std::printf("%-20s %-9s %-26s %10.2f %9.0f %6.1f%%\n", bc.op.c_str(), ref::dtype_name(bc.dtype), bc.shape.c_str(),
                us, gbps, 100 * gbps / copy_gbps);
    if (csv) {
      std::fprintf(csv, "%s,%s,%s,%.3f,%.1f,%.1f\n", bc.op.c_str(), ref::dtype_name(bc.dtype), bc.shape.c_str(), us,
                   gbps, copy_gbps);
    }
    inputs.clear();
  }
  if (csv) std::fclose(csv);
  cudaStreamDestroy(stream);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s check|bench PLUGIN.so [--csv FILE]\n", argv[0]);
    return 2;
  }
  const std::string mode = argv[1];
  const char* csv = nullptr;
  for (int i = 3; i + 1 < argc; ++i) {
    if (std::strcmp(argv[i], "--csv") == 0) csv = argv[i + 1];
  }
  const Plugin plugin(argv[2]);
  try {
    ref::open_reference_plugin(std::filesystem::path(argv[2]).parent_path().string());
  } catch (const std::exception& e) {
    die(e.what());
  }
  kd_device_info devices[8];
  for (kd_device_info& d : devices) {
    std::memset(&d, 0, sizeof d);
    d.struct_size = sizeof d;
  }
  size_t count = 0;
  char error[256] = "";
  const kd_status s = plugin.api->probe(devices, 8, &count, error, sizeof error);
  std::printf("plugin %s %s: probe status %d, %zu device(s)", plugin.api->plugin_name, plugin.api->plugin_version,
              static_cast<int>(s), count);
  for (size_t i = 0; i < count && i < 8; ++i) std::printf("; %s (arch %s)", devices[i].name, devices[i].arch);
  std::printf("\n");
  if (s != KD_STATUS_OK || count == 0) die("no device to run on");
  if (mode == "check") return run_check(plugin);
  if (mode == "bench") return run_bench(plugin, csv);
  die("unknown mode " + mode);
}
