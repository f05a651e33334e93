// The cpu plugin's kernels against the reference plugin's: loads both built
// plugins with dlopen (as the core does), calls each kernel through the C ABI
// with hand-built DLTensors, and compares every op x dtype. Outputs are
// poisoned with NaN before each call, inputs are random (fixed seed, never
// all zero), and sizes include 1, 7 and 4097 columns.

#include <dlfcn.h>
#include <doctest/doctest.h>
#include <kdispatch/plugin_api.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "harness.hpp"
#include "raw_call.hpp"
#include "reference_ops.hpp"

namespace {

namespace ref = kdispatch::reference;
using kdispatch::harness::bool_attr;
using kdispatch::harness::float_attr;
using kdispatch::harness::RawCall;
using ref::Dtype;
using ref::Tolerance;

constexpr Dtype kFloatDtypes[] = {Dtype::kFloat32, Dtype::kFloat16, Dtype::kBFloat16};

// |got - want| <= atol + rtol * |want|: the tolerance the op's schema
// declares for outputs of `dtype`, in relative form.
Tolerance tolerance_for(const char* op, Dtype dtype) {
  return kdispatch::harness::relative_tolerance(kdispatch::harness::builtin_schema(op), dtype);
}

// The expected values come from the reference plugin, opened before any
// test runs (each test may be run alone).
const bool kReferenceOpen = [] {
  ref::open_reference_plugin(KDISPATCH_PLUGIN_DIR);
  return true;
}();

const kd_plugin_api& cpu_plugin() {
  static const kd_plugin_api* api = [] {
    const std::string path = std::string(KDISPATCH_PLUGIN_DIR) + "/libkdispatch-cpu.so";
    void* handle = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (handle == nullptr) FAIL("dlopen " << path << ": " << dlerror());
    auto entry = reinterpret_cast<kd_plugin_entry_fn>(dlsym(handle, KDISPATCH_PLUGIN_ENTRY_SYMBOL));
    if (entry == nullptr) FAIL("no " KDISPATCH_PLUGIN_ENTRY_SYMBOL " in " << path);
    return entry();
  }();
  REQUIRE(api != nullptr);
  return *api;
}

kd_kernel_fn kernel(const char* symbol) {
  kd_kernel_fn fn = cpu_plugin().find_kernel(symbol);
  REQUIRE_MESSAGE((fn != nullptr), symbol);
  return fn;
}

DLDataType dl_dtype(Dtype dtype) {
  switch (dtype) {
    case Dtype::kFloat32: return {kDLFloat, 32, 1};
    case Dtype::kFloat16: return {kDLFloat, 16, 1};
    case Dtype::kBFloat16: return {kDLBfloat, 16, 1};
  }
  return {};
}

// A host tensor owning its storage. `values` holds what the elements decode
// to, for float tensors.
class Tensor {
 public:
  Tensor(DLDataType dtype, std::vector<int64_t> shape) : shape_(std::move(shape)) {
    int64_t n = 1;
    for (int64_t d : shape_) n *= d;
    count_ = n;
    // One spare element in front exercises byte_offset.
    bytes_.assign(static_cast<size_t>((n + 1) * dtype.bits / 8), std::byte{0x5a});
    tensor_.data = bytes_.data();
    tensor_.byte_offset = dtype.bits / 8;
    tensor_.device = {kDLCPU, 0};
    tensor_.ndim = static_cast<int32_t>(shape_.size());
    tensor_.dtype = dtype;
    tensor_.shape = shape_.data();
  }

  int64_t count() const { return count_; }
  const DLTensor& dl() const { return tensor_; }
  std::byte* data() { return bytes_.data() + tensor_.byte_offset; }

  template <class T>
  T* as() {
    return reinterpret_cast<T*>(data());
  }

 private:
  std::vector<int64_t> shape_;
  int64_t count_ = 0;
  std::vector<std::byte> bytes_;
  DLTensor tensor_{};
};

// A float tensor of `dtype` and the float64 values it holds.
struct FloatTensor {
  Dtype dtype;
  Tensor tensor;
  std::vector<double> values;

  FloatTensor(Dtype d, std::vector<int64_t> shape)
      : dtype(d), tensor(dl_dtype(d), std::move(shape)),
        values(static_cast<size_t>(tensor.count())) {}

  void set(int64_t i, double v) {
    values[i] = ref::round_to(dtype, v);
    const uint32_t bits = ref::encode(dtype, v);
    std::memcpy(tensor.data() + i * ref::dtype_size(dtype), &bits, ref::dtype_size(dtype));
  }

  double get(int64_t i) {
    uint32_t bits = 0;
    std::memcpy(&bits, tensor.data() + i * ref::dtype_size(dtype), ref::dtype_size(dtype));
    return ref::decode(dtype, bits);
  }

  std::vector<double> read() {
    std::vector<double> out(values.size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = get(static_cast<int64_t>(i));
    return out;
  }

  // Random values, never all zero: one is forced away from 0.
  void randomize(std::mt19937_64& rng, double lo, double hi) {
    std::uniform_real_distribution<double> dist(lo, hi);
    for (int64_t i = 0; i < tensor.count(); ++i) set(i, dist(rng));
    if (tensor.count() > 0 && values[0] == 0.0) set(0, hi * 0.5 + 0.25);
  }

  void poison() {
    for (int64_t i = 0; i < tensor.count(); ++i) set(i, std::numeric_limits<double>::quiet_NaN());
  }
};

// Checks every element; reports the first few mismatches and their count.
void check_close(const std::vector<double>& got, const std::vector<double>& want, Tolerance tol,
                 const std::string& what) {
  REQUIRE(got.size() == want.size());
  size_t bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double limit = tol.atol + tol.rtol * std::fabs(want[i]);
    const bool ok = std::fabs(got[i] - want[i]) <= limit;  // false for NaN
    if (!ok && ++bad <= 3) {
      FAIL_CHECK(what << ": element " << i << " got " << got[i] << " want " << want[i]);
    }
  }
  CHECK_MESSAGE(bad == 0, what << ": " << bad << " of " << got.size() << " elements off");
}

std::string describe(const char* op, Dtype dtype, int64_t rows, int64_t cols) {
  return std::string(op) + " " + ref::dtype_name(dtype) + " [" + std::to_string(rows) + ", " +
         std::to_string(cols) + "]";
}

// rows x cols of the element-wise and normalisation tests: odd sizes, one
// large enough to run on the thread pool.
struct Shape {
  int64_t rows;
  int64_t cols;
};
const std::vector<Shape>& row_shapes() {
  static const std::vector<Shape> shapes = [] {
    std::vector<Shape> s;
    for (int64_t rows : {1, 3, 33}) {
      for (int64_t cols : {1, 7, 4097}) s.push_back({rows, cols});
    }
    s.push_back({515, 2048});
    return s;
  }();
  return shapes;
}

}  // namespace

TEST_CASE("cpu plugin: table, probe and kernel lookup") {
  const kd_plugin_api& api = cpu_plugin();
  CHECK(api.abi_major == KDISPATCH_ABI_MAJOR);
  CHECK(std::string(api.backend) == "cpu");
  CHECK(std::string(api.plugin_name) == "cpu");
  CHECK(std::strstr(api.manifest_json, "kd_cpu_topk_softmax") != nullptr);

  kd_device_info info{};
  info.struct_size = sizeof(info);
  size_t count = 0;
  char error[128] = {};
  REQUIRE(api.probe(&info, 1, &count, error, sizeof(error)) == KD_STATUS_OK);
  CHECK(count == 1);
  CHECK(info.device_type == kDLCPU);
  CHECK(info.device_id == 0);
  CHECK(std::string(info.arch).empty());
  CHECK(std::strlen(info.name) > 0);
  REQUIRE(api.probe(nullptr, 0, &count, error, sizeof(error)) == KD_STATUS_OK);
  CHECK(count == 1);

  for (const char* symbol :
       {"kd_cpu_rmsnorm", "kd_cpu_fused_add_rmsnorm", "kd_cpu_silu_and_mul", "kd_cpu_gelu_and_mul",
        "kd_cpu_gelu_tanh_and_mul", "kd_cpu_rotary_embedding", "kd_cpu_topk_softmax"}) {
    CHECK_MESSAGE((api.find_kernel(symbol) != nullptr), symbol);
  }
  CHECK((api.find_kernel("kd_cpu_no_such_kernel") == nullptr));
  CHECK((api.find_kernel(nullptr) == nullptr));
}

TEST_CASE("cpu layernorm.rmsnorm matches the float64 reference") {
  std::mt19937_64 rng(1);
  const double eps = 1e-6;
  for (Dtype dtype : kFloatDtypes) {
    for (const Shape& s : row_shapes()) {
      const std::string what = describe("rmsnorm", dtype, s.rows, s.cols);
      FloatTensor out(dtype, {s.rows, s.cols});
      FloatTensor x(dtype, {s.rows, s.cols});
      FloatTensor weight(dtype, {s.cols});
      x.randomize(rng, -3.0, 3.0);
      weight.randomize(rng, 0.5, 1.5);
      out.poison();
      RawCall call{
          kernel("kd_cpu_rmsnorm"), {out.tensor.dl(), x.tensor.dl(), weight.tensor.dl()}, {float_attr("eps", eps)}};
      REQUIRE_MESSAGE(call.run() == KD_STATUS_OK, call.error);
      check_close(out.read(), ref::rmsnorm(x.values, weight.values, s.rows, s.cols, eps),
                  tolerance_for("layernorm.rmsnorm", dtype), what);
    }
  }
}

TEST_CASE("cpu layernorm.rmsnorm flattens leading dims") {
  std::mt19937_64 rng(2);
  FloatTensor out(Dtype::kBFloat16, {2, 3, 33});
  FloatTensor x(Dtype::kBFloat16, {2, 3, 33});
  FloatTensor weight(Dtype::kBFloat16, {33});
  x.randomize(rng, -2.0, 2.0);
  weight.randomize(rng, -1.0, 1.0);
  out.poison();
  RawCall call{
      kernel("kd_cpu_rmsnorm"), {out.tensor.dl(), x.tensor.dl(), weight.tensor.dl()}, {float_attr("eps", 1e-5)}};
  REQUIRE(call.run() == KD_STATUS_OK);
  check_close(out.read(), ref::rmsnorm(x.values, weight.values, 6, 33, 1e-5),
              tolerance_for("layernorm.rmsnorm", Dtype::kBFloat16), "rmsnorm [2, 3, 33]");
}

TEST_CASE("cpu kernels may be called from several threads at once") {
  // Large enough for the thread pool: one caller gets it, the others run
  // inline, and all must still be right.
  const int64_t rows = 64;
  const int64_t h = 4096;
  struct Job {
    FloatTensor out{Dtype::kFloat16, {rows, h}};
    FloatTensor x{Dtype::kFloat16, {rows, h}};
    FloatTensor weight{Dtype::kFloat16, {h}};
    kd_status status = KD_STATUS_INTERNAL;
  };
  std::vector<Job> jobs(4);
  std::mt19937_64 rng(9);
  for (Job& job : jobs) {
    job.x.randomize(rng, -2.0, 2.0);
    job.weight.randomize(rng, 0.5, 1.5);
    job.out.poison();
  }
  const kd_kernel_fn fn = kernel("kd_cpu_rmsnorm");
  std::vector<std::thread> threads;
  for (Job& job : jobs) {
    threads.emplace_back([&job, fn] {
      RawCall call{fn, {job.out.tensor.dl(), job.x.tensor.dl(), job.weight.tensor.dl()}, {float_attr("eps", 1e-6)}};
      for (int repeat = 0; repeat < 5; ++repeat) {
        job.status = call.run();
        if (job.status != KD_STATUS_OK) break;
      }
    });
  }
  for (std::thread& t : threads) t.join();
  for (Job& job : jobs) {
    REQUIRE(job.status == KD_STATUS_OK);
    check_close(job.out.read(), ref::rmsnorm(job.x.values, job.weight.values, rows, h, 1e-6),
                tolerance_for("layernorm.rmsnorm", Dtype::kFloat16), "concurrent rmsnorm");
  }
}

TEST_CASE("cpu layernorm.fused_add_rmsnorm matches the float64 reference") {
  std::mt19937_64 rng(3);
  const double eps = 1e-5;
  for (Dtype dtype : kFloatDtypes) {
    for (const Shape& s : row_shapes()) {
      const std::string what = describe("fused_add_rmsnorm", dtype, s.rows, s.cols);
      FloatTensor x(dtype, {s.rows, s.cols});
      FloatTensor residual(dtype, {s.rows, s.cols});
      FloatTensor weight(dtype, {s.cols});
      x.randomize(rng, -3.0, 3.0);
      residual.randomize(rng, -3.0, 3.0);
      weight.randomize(rng, 0.5, 1.5);
      const ref::FusedAddRmsnormResult want = ref::fused_add_rmsnorm(
          x.values, residual.values, weight.values, s.rows, s.cols, eps, dtype);
      RawCall call{kernel("kd_cpu_fused_add_rmsnorm"),
                   {x.tensor.dl(), residual.tensor.dl(), weight.tensor.dl()},
                   {float_attr("eps", eps)}};
      REQUIRE_MESSAGE(call.run() == KD_STATUS_OK, call.error);
      // The residual is one correctly rounded addition: exact.
      check_close(residual.read(), want.residual, {0.0, 0.0}, what + " residual");
      check_close(x.read(), want.x, tolerance_for("layernorm.fused_add_rmsnorm", dtype), what + " x");
    }
  }
}

TEST_CASE("cpu layernorm.fused_add_rmsnorm rounds the residual to nearest even") {
  // (x, residual) pairs whose sums are ties, overflow or land in the
  // subnormal range of each 16-bit dtype.
  struct Pair {
    double x;
    double residual;
  };
  const std::vector<Pair> half_pairs = {
      {1.0, 0x1p-11},          {1.0 + 0x1p-10, 0x1p-11}, {-1.0, -0x1p-11},
      {65504.0, 8.0},          {65504.0, 16.0},          {-65504.0, -16.0},
      {0x1p-14, -0x1p-24},     {0x1p-24, 0x1p-24},       {0x1p-14, 0x1p-14},
      {2048.0, 1.0},           {2050.0, 1.0},            {0.1, 0.2}};
  const std::vector<Pair> bfloat16_pairs = {
      {1.0, 0x1p-8},          {1.0 + 0x1p-7, 0x1p-8},  {-1.0, -0x1p-8},
      {0x1.fep127, 0x1p119},  {0x1.fep127, 0x1p118},   {-0x1.fep127, -0x1p119},
      {0x1p-126, -0x1p-133},  {0x1p-133, 0x1p-133},    {256.0, 1.0},
      {258.0, 1.0},           {0.1, 0.2},              {3.0, 1e-3}};
  for (Dtype dtype : {Dtype::kFloat16, Dtype::kBFloat16}) {
    const std::vector<Pair>& pairs = dtype == Dtype::kFloat16 ? half_pairs : bfloat16_pairs;
    const auto h = static_cast<int64_t>(pairs.size());
    FloatTensor x(dtype, {1, h});
    FloatTensor residual(dtype, {1, h});
    FloatTensor weight(dtype, {h});
    for (int64_t i = 0; i < h; ++i) {
      x.set(i, pairs[i].x);
      residual.set(i, pairs[i].residual);
      weight.set(i, 1.0);
    }
    const ref::FusedAddRmsnormResult want =
        ref::fused_add_rmsnorm(x.values, residual.values, weight.values, 1, h, 1e-6, dtype);
    RawCall call{kernel("kd_cpu_fused_add_rmsnorm"),
                 {x.tensor.dl(), residual.tensor.dl(), weight.tensor.dl()},
                 {float_attr("eps", 1e-6)}};
    REQUIRE(call.run() == KD_STATUS_OK);
    const std::vector<double> got = residual.read();
    for (int64_t i = 0; i < h; ++i) {
      INFO(ref::dtype_name(dtype) << " " << pairs[i].x << " + " << pairs[i].residual);
      CHECK(got[i] == want.residual[i]);
    }
  }
}

namespace {

// The activation kernels and their float64 references.
struct ActivationOp {
  const char* op;
  const char* symbol;
  std::vector<double> (*reference)(std::span<const double>, int64_t, int64_t);
};
const ActivationOp kActivationOps[] = {
    {"activation.silu_and_mul", "kd_cpu_silu_and_mul", ref::silu_and_mul},
    {"activation.gelu_and_mul", "kd_cpu_gelu_and_mul", ref::gelu_and_mul},
    {"activation.gelu_tanh_and_mul", "kd_cpu_gelu_tanh_and_mul", ref::gelu_tanh_and_mul}};

}  // namespace

TEST_CASE("cpu activation.*_and_mul match the float64 reference") {
  std::mt19937_64 rng(4);
  for (const ActivationOp& op : kActivationOps) {
    for (Dtype dtype : kFloatDtypes) {
      for (const Shape& s : row_shapes()) {
        const std::string what = describe(op.symbol, dtype, s.rows, s.cols);
        FloatTensor out(dtype, {s.rows, s.cols});
        FloatTensor x(dtype, {s.rows, 2 * s.cols});
        // Wide enough to reach both saturated tails of the activations.
        x.randomize(rng, -8.0, 8.0);
        out.poison();
        RawCall call{kernel(op.symbol), {out.tensor.dl(), x.tensor.dl()}, {}};
        REQUIRE_MESSAGE(call.run() == KD_STATUS_OK, call.error);
        check_close(out.read(), op.reference(x.values, s.rows, s.cols), tolerance_for(op.op, dtype),
                    what);
      }
    }
  }
}

TEST_CASE("cpu activation.*_and_mul at the edges: infinities, NaN, zeros, far tails") {
  // act(a) * 1 for each a, in every dtype. The formulas evaluated in IEEE
  // arithmetic give NaN at -Inf (-Inf times a probability of 0), as the GPU
  // kernels do; far out in the tails the results are within the dtype's
  // tolerance of the float64 reference (tiny, or a itself), up to the
  // largest floats (float16 rounds those to infinity).
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const std::vector<double> edges = {0.0,   -0.0,  kInf,   -kInf, std::nan(""), 1e-30, -1e-30,
                                     20.0,  -20.0, 60.0,   -60.0, 88.0,         -88.0, 200.0,
                                     -200.0, 3e4,  -3e4,   1.5,   -1.5,         1e36,  -1e36,
                                     3e38,  -3e38};
  const int64_t d = static_cast<int64_t>(edges.size());
  for (const ActivationOp& op : kActivationOps) {
    for (Dtype dtype : kFloatDtypes) {
      const std::string what = describe(op.symbol, dtype, 1, d);
      FloatTensor out(dtype, {1, d});
      FloatTensor x(dtype, {1, 2 * d});
      for (int64_t j = 0; j < d; ++j) {
        x.set(j, edges[static_cast<size_t>(j)]);
        x.set(d + j, 1.0);
      }
      out.poison();
      RawCall call{kernel(op.symbol), {out.tensor.dl(), x.tensor.dl()}, {}};
      REQUIRE_MESSAGE(call.run() == KD_STATUS_OK, call.error);
      const std::vector<double> got = out.read();
      const std::vector<double> want = op.reference(x.values, 1, d);
      const Tolerance tol = tolerance_for(op.op, dtype);
      for (int64_t j = 0; j < d; ++j) {
        const double a = x.values[static_cast<size_t>(j)];
        const double g = got[static_cast<size_t>(j)];
        INFO(what << " at a = " << a << ": got " << g);
        if (std::isnan(a) || a == -kInf) {
          CHECK(std::isnan(g));
        } else if (a == kInf) {
          CHECK(g == kInf);
        } else if (a == 0.0) {
          CHECK(g == 0.0);
        } else {
          const double w = want[static_cast<size_t>(j)];
          CHECK(std::fabs(g - w) <= tol.atol + tol.rtol * std::fabs(w));
        }
      }
    }
  }
}

TEST_CASE("cpu activation.*_and_mul in 16 bits: every gate value") {
  // The 16-bit kernels look the activation up in a table of all 65536 gate
  // values: each one, times a random up value, against the float64 reference
  // (rows of 4099, so that the table is read across row and block bounds).
  constexpr int64_t kValues = int64_t{1} << 16;
  constexpr int64_t d = 4099;
  constexpr int64_t rows = (kValues + d - 1) / d;
  std::mt19937_64 rng(16);
  std::uniform_real_distribution<double> up(-2.0, 2.0);
  for (const ActivationOp& op : kActivationOps) {
    for (Dtype dtype : {Dtype::kFloat16, Dtype::kBFloat16}) {
      const std::string what = describe(op.symbol, dtype, rows, d);
      FloatTensor out(dtype, {rows, d});
      FloatTensor x(dtype, {rows, 2 * d});
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < d; ++j) {
          const int64_t gate = (r * d + j) % kValues;
          x.set(r * 2 * d + j, ref::decode(dtype, static_cast<uint32_t>(gate)));
          x.set(r * 2 * d + d + j, up(rng));
        }
      }
      out.poison();
      RawCall call{kernel(op.symbol), {out.tensor.dl(), x.tensor.dl()}, {}};
      REQUIRE_MESSAGE(call.run() == KD_STATUS_OK, call.error);
      const std::vector<double> got = out.read();
      const std::vector<double> want = op.reference(x.values, rows, d);
      const Tolerance tol = tolerance_for(op.op, dtype);
      int64_t bad = 0;
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t j = 0; j < d; ++j) {
          const auto i = static_cast<size_t>(r * d + j);
          const double a = x.values[static_cast<size_t>(r * 2 * d + j)];
          // Infinite gates and products that overflow the dtype are the
          // edge test's.
          if (std::isinf(a) || std::isinf(ref::round_to(dtype, want[i]))) continue;
          const bool ok = std::isnan(a) ? std::isnan(got[i])
                                        : std::fabs(got[i] - want[i]) <= tol.atol + tol.rtol * std::fabs(want[i]);
          if (!ok && ++bad <= 3) FAIL_CHECK(what << ": gate " << a << " got " << got[i] << " want " << want[i]);
        }
      }
      CHECK_MESSAGE(bad == 0, what << ": " << bad << " values off");
    }
  }
}

namespace {

// A cos/sin cache as the models build it: angle p * base^(-i / R).
void fill_cos_sin_cache(FloatTensor& cache, int64_t positions, int64_t half) {
  for (int64_t p = 0; p < positions; ++p) {
    for (int64_t i = 0; i < half; ++i) {
      const double angle =
          static_cast<double>(p) * std::pow(10000.0, -static_cast<double>(i) / static_cast<double>(half));
      cache.set(p * 2 * half + i, std::cos(angle));
      cache.set(p * 2 * half + half + i, std::sin(angle));
    }
  }
}

struct RotaryCase {
  std::vector<int64_t> leading;  // the "*" dims
  int64_t heads_q;
  int64_t heads_k;
  int64_t half;
};

}  // namespace

TEST_CASE("cpu embeddings.rotary_embedding matches the float64 reference, both styles") {
  const RotaryCase cases[] = {{{1}, 1, 1, 1},    {{3}, 4, 2, 7},     {{33}, 8, 1, 64},
                              {{2, 3}, 2, 2, 16}, {{1024}, 8, 2, 64}, {{5}, 1, 1, 300}};
  const int64_t cache_positions = 97;
  std::mt19937_64 rng(5);
  for (Dtype dtype : kFloatDtypes) {
    for (const RotaryCase& c : cases) {
      for (bool neox : {true, false}) {
        int64_t tokens = 1;
        for (int64_t d : c.leading) tokens *= d;
        std::vector<int64_t> q_shape = c.leading;
        q_shape.insert(q_shape.end(), {c.heads_q, 2 * c.half});
        std::vector<int64_t> k_shape = c.leading;
        k_shape.insert(k_shape.end(), {c.heads_k, 2 * c.half});
        const std::string what = std::string("rotary ") + ref::dtype_name(dtype) +
                                 (neox ? " neox" : " gptj") + " tokens " +
                                 std::to_string(tokens) + " heads " + std::to_string(c.heads_q) +
                                 "/" + std::to_string(c.heads_k) + " R " + std::to_string(c.half);
        Tensor positions(DLDataType{kDLInt, 64, 1}, c.leading);
        std::vector<int64_t> pos(static_cast<size_t>(tokens));
        std::uniform_int_distribution<int64_t> pick(0, cache_positions - 1);
        for (int64_t t = 0; t < tokens; ++t) positions.as<int64_t>()[t] = pos[t] = pick(rng);
        FloatTensor query(dtype, q_shape);
        FloatTensor key(dtype, k_shape);
        FloatTensor cache(dtype, {cache_positions, 2 * c.half});
        query.randomize(rng, -2.0, 2.0);
        key.randomize(rng, -2.0, 2.0);
        fill_cos_sin_cache(cache, cache_positions, c.half);
        const ref::RotaryResult want =
            ref::rotary_embedding(pos, query.values, key.values, cache.values, tokens, c.heads_q,
                                  c.heads_k, c.half, neox);
        RawCall call{kernel("kd_cpu_rotary_embedding"),
                     {positions.dl(), query.tensor.dl(), key.tensor.dl(), cache.tensor.dl()},
                     {bool_attr("is_neox", neox)}};
        REQUIRE_MESSAGE(call.run() == KD_STATUS_OK, call.error);
        check_close(query.read(), want.query, tolerance_for("embeddings.rotary_embedding", dtype), what + " query");
        check_close(key.read(), want.key, tolerance_for("embeddings.rotary_embedding", dtype), what + " key");
      }
    }
  }
}

TEST_CASE("cpu embeddings.rotary_embedding refuses a position outside the cache") {
  for (int64_t bad : {int64_t{16}, int64_t{-1}, int64_t{1} << 40}) {
    Tensor positions(DLDataType{kDLInt, 64, 1}, {4});
    const int64_t pos[] = {0, 3, bad, 1};
    std::memcpy(positions.as<int64_t>(), pos, sizeof(pos));
    std::mt19937_64 rng(6);
    FloatTensor query(Dtype::kFloat32, {4, 2, 8});
    FloatTensor key(Dtype::kFloat32, {4, 1, 8});
    FloatTensor cache(Dtype::kFloat32, {16, 8});
    query.randomize(rng, -1.0, 1.0);
    key.randomize(rng, -1.0, 1.0);
    fill_cos_sin_cache(cache, 16, 4);
    RawCall call{kernel("kd_cpu_rotary_embedding"),
                 {positions.dl(), query.tensor.dl(), key.tensor.dl(), cache.tensor.dl()},
                 {bool_attr("is_neox", true)}};
    CHECK(call.run() == KD_STATUS_INVALID_ARGUMENT);
    const std::string message = call.error;
    CHECK_MESSAGE(message.find("token 2") != std::string::npos, message);
    CHECK_MESSAGE(message.find(std::to_string(bad)) != std::string::npos, message);
    // Nothing was written.
    CHECK(query.read() == query.values);
    CHECK(key.read() == key.values);
  }
}

namespace {

// Checks ids and weights of topk_softmax against the reference. Near-ties
// may order differently in float32 than in float64, so a differing id is
// accepted when its probability equals the expected one within tolerance.
void check_topk(const std::vector<int32_t>& ids, const std::vector<float>& weights,
                const ref::TopkSoftmaxResult& want, int64_t rows, int64_t e, int64_t k,
                const std::string& what) {
  size_t bad = 0;
  const Tolerance weight_tolerance = tolerance_for("moe.topk_softmax", Dtype::kFloat32);  // float32 weights
  for (int64_t r = 0; r < rows; ++r) {
    std::vector<bool> seen(static_cast<size_t>(e), false);
    for (int64_t i = 0; i < k; ++i) {
      const int32_t got = ids[r * k + i];
      const int32_t expected = want.ids[r * k + i];
      bool ok = got >= 0 && got < e && !seen[got];
      if (ok) {
        seen[got] = true;
        const double p_got = want.probabilities[r * e + got];
        const double p_want = want.probabilities[r * e + expected];
        ok = got == expected ||
             std::fabs(p_got - p_want) <= weight_tolerance.atol +
                                              weight_tolerance.rtol * p_want;
      }
      const double w_want = want.weights[r * k + i];
      ok = ok && std::fabs(weights[r * k + i] - w_want) <=
                     weight_tolerance.atol + weight_tolerance.rtol * std::fabs(w_want);
      if (!ok && ++bad <= 3) {
        FAIL_CHECK(what << ": row " << r << " slot " << i << " got id " << got << " weight "
                        << weights[r * k + i] << ", want id " << expected << " weight "
                        << w_want);
      }
    }
  }
  CHECK_MESSAGE(bad == 0, what << ": " << bad << " slots off");
}

kd_status run_topk(FloatTensor& gating, int64_t rows, int64_t k, bool renormalize,
                   std::vector<int32_t>& ids, std::vector<float>& weights, std::string& error) {
  Tensor w(DLDataType{kDLFloat, 32, 1}, {rows, k});
  Tensor id(DLDataType{kDLInt, 32, 1}, {rows, k});
  for (int64_t i = 0; i < rows * k; ++i) {
    w.as<float>()[i] = std::numeric_limits<float>::quiet_NaN();
    id.as<int32_t>()[i] = -7;
  }
  RawCall call{kernel("kd_cpu_topk_softmax"),
               {w.dl(), id.dl(), gating.tensor.dl()},
               {bool_attr("renormalize", renormalize)}};
  const kd_status status = call.run();
  error = call.error;
  ids.assign(id.as<int32_t>(), id.as<int32_t>() + rows * k);
  weights.assign(w.as<float>(), w.as<float>() + rows * k);
  return status;
}

}  // namespace

TEST_CASE("cpu moe.topk_softmax matches the float64 reference") {
  struct TopkShape {
    int64_t rows;
    int64_t e;
    int64_t k;
  };
  const TopkShape shapes[] = {{1, 1, 1},  {3, 7, 2},   {33, 8, 8},
                              {33, 64, 6}, {7, 4097, 5}, {2048, 256, 8}};
  std::mt19937_64 rng(7);
  for (Dtype dtype : kFloatDtypes) {
    for (const TopkShape& s : shapes) {
      for (bool renormalize : {false, true}) {
        const std::string what = describe("topk_softmax", dtype, s.rows, s.e) + " k " +
                                 std::to_string(s.k) + (renormalize ? " renormalized" : "");
        FloatTensor gating(dtype, {s.rows, s.e});
        gating.randomize(rng, -4.0, 4.0);
        std::vector<int32_t> ids;
        std::vector<float> weights;
        std::string error;
        REQUIRE_MESSAGE(run_topk(gating, s.rows, s.k, renormalize, ids, weights, error) ==
                            KD_STATUS_OK,
                        error);
        check_topk(ids, weights,
                   ref::topk_softmax(gating.values, s.rows, s.e, s.k, renormalize), s.rows, s.e,
                   s.k, what);
      }
    }
  }
}

TEST_CASE("cpu moe.topk_softmax breaks ties toward the lower index") {
  for (Dtype dtype : kFloatDtypes) {
    // Experts 1, 3 and 6 tie for the top, 0 and 5 for the next place.
    const double row[] = {0.5, 2.0, -1.0, 2.0, 0.0, 0.5, 2.0, -3.0};
    FloatTensor gating(dtype, {1, 8});
    for (int64_t i = 0; i < 8; ++i) gating.set(i, row[i]);
    std::vector<int32_t> ids;
    std::vector<float> weights;
    std::string error;
    REQUIRE(run_topk(gating, 1, 5, true, ids, weights, error) == KD_STATUS_OK);
    CHECK(ids == std::vector<int32_t>{1, 3, 6, 0, 5});
    CHECK(weights[0] == weights[1]);
    CHECK(weights[1] == weights[2]);
    CHECK(weights[3] == weights[4]);
    CHECK(std::fabs(weights[0] + weights[1] + weights[2] + weights[3] + weights[4] - 1.0) < 1e-6);
  }
}

TEST_CASE("cpu moe.topk_softmax: a NaN or infinite logit makes the row's weights NaN, renormalized or not") {
  // The softmax of such a row is NaN (its sum, or Inf - Inf at the max). A
  // renormalized row skips the full sum when it can; it must still give NaN
  // where the full computation does, and finite weights elsewhere.
  constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const int64_t e = 37;  // two full blocks of 16 and a partial one
  struct Row {
    const char* what;
    int64_t at;  // where the special value goes; -1: none
    double value;
    bool nan_weights;
  };
  const Row rows[] = {{"finite", -1, 0.0, false},
                      {"NaN in a full block", 5, kNan, true},
                      {"NaN in the partial block", 35, kNan, true},
                      {"+Inf", 20, kInf, true},
                      {"-Inf", 20, -kInf, false}};
  std::mt19937_64 rng(9);
  for (Dtype dtype : kFloatDtypes) {
    for (const Row& row : rows) {
      for (bool renormalize : {false, true}) {
        INFO(ref::dtype_name(dtype) << " " << row.what << (renormalize ? " renormalized" : ""));
        FloatTensor gating(dtype, {1, e});
        gating.randomize(rng, -4.0, 4.0);
        if (row.at >= 0) gating.set(row.at, row.value);
        std::vector<int32_t> ids;
        std::vector<float> weights;
        std::string error;
        REQUIRE_MESSAGE(run_topk(gating, 1, 4, renormalize, ids, weights, error) == KD_STATUS_OK,
                        error);
        for (float w : weights) CHECK(std::isnan(w) == row.nan_weights);
        if (!row.nan_weights) {
          const auto want = ref::topk_softmax(gating.values, 1, e, 4, renormalize);
          check_topk(ids, weights, want, 1, e, 4, row.what);
        }
      }
    }
  }
}

TEST_CASE("cpu moe.topk_softmax: a row's result does not depend on its neighbours") {
  // Rows may be computed in groups; a NaN row among finite ones, an odd row
  // count and a partial last block must not change any row's result: every
  // row of the batch equals the same row computed alone, bit for bit.
  constexpr double kNan = std::numeric_limits<double>::quiet_NaN();
  constexpr double kInf = std::numeric_limits<double>::infinity();
  const int64_t rows = 9;
  const int64_t k = 6;
  std::mt19937_64 rng(10);
  for (Dtype dtype : kFloatDtypes) {
    for (int64_t e : {16, 37, 256}) {
      for (bool renormalize : {false, true}) {
        INFO(ref::dtype_name(dtype) << " E " << e << (renormalize ? " renormalized" : ""));
        FloatTensor batch(dtype, {rows, e});
        batch.randomize(rng, -4.0, 4.0);
        batch.set(1 * e + 3, kNan);      // a NaN row paired with a finite one
        batch.set(4 * e + e - 1, kNan);  // NaN in the last block
        batch.set(5 * e + 7, kInf);      // +Inf: NaN weights, no NaN logit
        batch.set(6 * e + 2, -kInf);     // -Inf: finite weights
        std::vector<int32_t> ids;
        std::vector<float> weights;
        std::string error;
        REQUIRE_MESSAGE(run_topk(batch, rows, k, renormalize, ids, weights, error) ==
                            KD_STATUS_OK,
                        error);
        const auto want = ref::topk_softmax(batch.values, rows, e, k, renormalize);
        for (int64_t r = 0; r < rows; ++r) {
          FloatTensor alone(dtype, {1, e});
          for (int64_t j = 0; j < e; ++j) alone.set(j, batch.values[r * e + j]);
          std::vector<int32_t> alone_ids;
          std::vector<float> alone_weights;
          REQUIRE(run_topk(alone, 1, k, renormalize, alone_ids, alone_weights, error) ==
                  KD_STATUS_OK);
          const bool nan_row = r == 1 || r == 4 || r == 5;
          for (int64_t i = 0; i < k; ++i) {
            const float w = weights[r * k + i];
            CHECK_MESSAGE(std::isnan(w) == nan_row, "row " << r << " slot " << i);
            CHECK_MESSAGE(ids[r * k + i] == alone_ids[i], "row " << r << " slot " << i);
            if (!nan_row) {
              CHECK_MESSAGE(std::memcmp(&w, &alone_weights[i], sizeof w) == 0,
                            "row " << r << " slot " << i << ": " << w << " alone "
                                   << alone_weights[i]);
            }
          }
          if (!nan_row) {
            ref::TopkSoftmaxResult one;
            one.ids.assign(want.ids.begin() + r * k, want.ids.begin() + (r + 1) * k);
            one.weights.assign(want.weights.begin() + r * k, want.weights.begin() + (r + 1) * k);
            one.probabilities.assign(want.probabilities.begin() + r * e,
                                     want.probabilities.begin() + (r + 1) * e);
            check_topk(std::vector<int32_t>(ids.begin() + r * k, ids.begin() + (r + 1) * k),
                       std::vector<float>(weights.begin() + r * k, weights.begin() + (r + 1) * k),
                       one, 1, e, k, "row " + std::to_string(r));
          }
        }
      }
    }
  }
}

TEST_CASE("cpu moe.topk_softmax: logits far below the max, and rows at the bound of the clamp-free sum") {
  // An exp whose argument falls more than 126 below 0 in base 2 (a logit
  // more than 87 below its row's max) is clamped to 2^-126. The 16-bit rows
  // leave the clamp out of the sum when every logit lies within [-43, 43];
  // rows just past that bound, far wider ones, and pairs of the two kinds
  // must still match float64.
  const int64_t rows = 8;
  const int64_t e = 256;
  const int64_t k = 8;
  std::mt19937_64 rng(11);
  for (Dtype dtype : kFloatDtypes) {
    for (bool renormalize : {false, true}) {
      const std::string what = describe("topk_softmax", dtype, rows, e) +
                               (renormalize ? " renormalized" : "");
      FloatTensor batch(dtype, {rows, e});
      batch.randomize(rng, -4.0, 4.0);
      batch.set(0 * e + 5, 43.0);  // at the bound: 86 apart
      batch.set(0 * e + 200, -43.0);
      batch.set(1 * e + 17, 43.5);  // just past it, paired with row 0
      batch.set(1 * e + 90, -44.0);
      batch.set(2 * e + 3, 60.0);  // the rest of the row 56-64 below the max
      batch.set(3 * e + 250, -120.0);  // one logit 116-124 below the max
      std::uniform_real_distribution<double> wide(-100.0, 100.0);
      for (int64_t j = 0; j < e; ++j) batch.set(4 * e + j, wide(rng));  // paired with row 5
      batch.set(6 * e + 0, 100.0);  // everything else far below
      batch.set(7 * e + 255, -100.0);
      std::vector<int32_t> ids;
      std::vector<float> weights;
      std::string error;
      REQUIRE_MESSAGE(run_topk(batch, rows, k, renormalize, ids, weights, error) == KD_STATUS_OK,
                      error);
      check_topk(ids, weights, ref::topk_softmax(batch.values, rows, e, k, renormalize), rows, e,
                 k, what);
    }
  }
}

TEST_CASE("cpu moe.topk_softmax refuses K > E") {
  FloatTensor gating(Dtype::kFloat32, {2, 4});
  std::mt19937_64 rng(8);
  gating.randomize(rng, -1.0, 1.0);
  std::vector<int32_t> ids;
  std::vector<float> weights;
  std::string error;
  CHECK(run_topk(gating, 2, 5, false, ids, weights, error) ==
        KD_STATUS_INVALID_ARGUMENT);
  CHECK_MESSAGE(error.find("K = 5") != std::string::npos, error);
  CHECK_MESSAGE(error.find("E = 4") != std::string::npos, error);
}

TEST_CASE("cpu kernels refuse unsupported dtypes and bad argument counts") {
  Tensor out(DLDataType{kDLFloat, 64, 1}, {2, 3});
  Tensor x(DLDataType{kDLFloat, 64, 1}, {2, 6});
  RawCall call{kernel("kd_cpu_silu_and_mul"), {out.dl(), x.dl()}, {}};
  CHECK(call.run() == KD_STATUS_UNSUPPORTED);
  CHECK_MESSAGE(std::string(call.error).find("dtype") != std::string::npos, call.error);

  call.tensors.pop_back();
  CHECK(call.run() == KD_STATUS_INVALID_ARGUMENT);
  CHECK(std::strlen(call.error) > 0);
}
