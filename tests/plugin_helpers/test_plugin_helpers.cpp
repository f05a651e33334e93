// <kdispatch/plugin_helpers.hpp>, compiled as C++17 (what a plugin built
// with nvcc or hipcc sees): the 16-bit conversions against the float64
// rounding of from_double (two independent descriptions of round to
// nearest even), the tensor view, attributes by name, the exception wall,
// parallel_for and the entry point.
#define DOCTEST_CONFIG_IMPLEMENT_WITH_MAIN
#include <doctest/doctest.h>
#include <kdispatch/plugin_helpers.hpp>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

float float_of_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// Every float whose bit pattern is a multiple of `step`, and the patterns
// around every 16-bit boundary that rounding can cross.
template <class Fn>
void for_many_floats(Fn&& fn) {
  for (uint64_t bits = 0; bits <= 0xffffffffu; bits += 4099) fn(float_of_bits(static_cast<uint32_t>(bits)));
  for (uint32_t high = 0; high <= 0xffffu; ++high) {
    for (uint32_t low : {0x0000u, 0x0001u, 0x0fffu, 0x1000u, 0x1001u, 0x7fffu, 0x8000u, 0x8001u, 0xffffu}) {
      fn(float_of_bits(high << 16 | low));
    }
  }
}

}  // namespace

TEST_CASE("float16: every value widens exactly and narrows back to itself") {
  for (uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const kd_plugin::Float16 h{static_cast<uint16_t>(bits)};
    const float f = kd_plugin::to_float(h);
    const bool nan = (bits & 0x7c00u) == 0x7c00u && (bits & 0x03ffu) != 0;
    INFO("bits 0x" << std::hex << bits);
    CHECK(std::isnan(f) == nan);
    if (nan) {
      CHECK((kd_plugin::from_float<kd_plugin::Float16>(f).bits & 0x7e00u) == 0x7e00u);  // quiet NaN
    } else {
      CHECK(kd_plugin::from_float<kd_plugin::Float16>(f).bits == bits);
    }
  }
}

TEST_CASE("bfloat16: every value widens exactly and narrows back to itself") {
  for (uint32_t bits = 0; bits <= 0xffffu; ++bits) {
    const kd_plugin::BFloat16 b{static_cast<uint16_t>(bits)};
    const float f = kd_plugin::to_float(b);
    const bool nan = (bits & 0x7f80u) == 0x7f80u && (bits & 0x007fu) != 0;
    INFO("bits 0x" << std::hex << bits);
    CHECK(std::isnan(f) == nan);
    if (nan) {
      CHECK((kd_plugin::from_float<kd_plugin::BFloat16>(f).bits & 0x7fc0u) == 0x7fc0u);
    } else {
      CHECK(kd_plugin::from_float<kd_plugin::BFloat16>(f).bits == bits);
    }
  }
}

TEST_CASE("float -> 16 bits rounds to nearest even, as from_double does") {
  int64_t mismatches = 0;
  for_many_floats([&](float f) {
    if (std::isnan(f)) return;
    const uint16_t h = kd_plugin::from_float<kd_plugin::Float16>(f).bits;
    const uint16_t b = kd_plugin::from_float<kd_plugin::BFloat16>(f).bits;
    if (h != kd_plugin::from_double<kd_plugin::Float16>(f).bits ||
        b != kd_plugin::from_double<kd_plugin::BFloat16>(f).bits) {
      if (++mismatches <= 5) FAIL_CHECK("float " << f << ": half 0x" << std::hex << h << ", bfloat16 0x" << b);
    }
  });
  CHECK(mismatches == 0);
}

TEST_CASE("special values and boundaries") {
  using kd_plugin::BFloat16;
  using kd_plugin::Float16;
  using kd_plugin::from_float;
  const float inf = std::numeric_limits<float>::infinity();
  CHECK(from_float<Float16>(65504.0f).bits == 0x7bff);
  CHECK(from_float<Float16>(65519.99f).bits == 0x7bff);
  CHECK(from_float<Float16>(65520.0f).bits == 0x7c00);  // the tie rounds to even: infinity
  CHECK(from_float<Float16>(-inf).bits == 0xfc00);
  CHECK(from_float<Float16>(0x1p-24f).bits == 0x0001);
  CHECK(from_float<Float16>(0x1p-25f).bits == 0x0000);  // tie between 0 and 2^-24: even
  CHECK(from_float<Float16>(0x1.8p-25f).bits == 0x0001);
  CHECK(from_float<Float16>(-0.0f).bits == 0x8000);
  CHECK(from_float<BFloat16>(inf).bits == 0x7f80);
  CHECK(from_float<BFloat16>(std::numeric_limits<float>::max()).bits == 0x7f80);  // rounds up past the largest
  CHECK(from_float<BFloat16>(1.0f + 0x1p-8f).bits == 0x3f80);                    // tie: even
  CHECK(from_float<BFloat16>(1.0f + 0x1.8p-8f).bits == 0x3f81);
  CHECK(std::isnan(kd_plugin::to_float(from_float<BFloat16>(std::nanf("")))));
}

namespace {

// The value of 8-bit pattern `bits` of a format with `mantissa` stored bits
// and exponent bias `bias`, from the definition (NaN/infinity aside).
double fp8_value(uint32_t bits, int mantissa, int bias) {
  const uint32_t magnitude = bits & 0x7fu;
  const int exponent = static_cast<int>(magnitude >> mantissa);
  const double fraction = static_cast<double>(magnitude & ((1u << mantissa) - 1));
  const double v = exponent == 0 ? std::ldexp(fraction, 1 - bias - mantissa)
                                 : std::ldexp(1.0 + std::ldexp(fraction, -mantissa), exponent - bias);
  return (bits & 0x80u) != 0 ? -v : v;
}

// `v` rounded to nearest even among the finite values of the format,
// saturating at +-max_finite: the peers' float -> fp8 convert.
double fp8_round(double v, int mantissa, int bias, double max_finite) {
  if (v == 0.0) return v;
  const int exponent = std::max(std::ilogb(v), 1 - bias);
  const double quantum = std::ldexp(1.0, exponent - mantissa);
  const double r = std::nearbyint(v / quantum) * quantum;
  return std::fabs(r) > max_finite ? std::copysign(max_finite, v) : r;
}

template <class T>
void check_fp8(int mantissa, int bias, double max_finite, uint32_t nan_bits) {
  // Every pattern decodes to its defined value, and encodes back to itself.
  for (uint32_t bits = 0; bits < 256; ++bits) {
    const float f = kd_plugin::to_float(T{static_cast<uint8_t>(bits)});
    const bool nan = mantissa == 3 ? (bits & 0x7fu) == 0x7fu : (bits & 0x7fu) > 0x7cu;
    const bool inf = mantissa == 2 && (bits & 0x7fu) == 0x7cu;
    INFO("bits 0x" << std::hex << bits);
    CHECK(std::isnan(f) == nan);
    if (nan) {
      CHECK((kd_plugin::from_float<T>(f).bits & 0x7fu) == nan_bits);
    } else if (inf) {
      CHECK(std::isinf(f));
      CHECK((kd_plugin::from_float<T>(f).bits & 0x7fu) == (nan_bits == 0x7eu ? 0x7bu : 0x7eu));  // saturates
    } else {
      CHECK(f == fp8_value(bits, mantissa, bias));
      CHECK(kd_plugin::from_float<T>(f).bits == bits);
    }
  }
  // Every float of a wide sweep rounds to nearest even and saturates.
  int64_t mismatches = 0;
  for_many_floats([&](float f) {
    if (std::isnan(f)) return;
    const double want = std::isinf(f) ? std::copysign(max_finite, f) : fp8_round(f, mantissa, bias, max_finite);
    const double got = kd_plugin::to_float(kd_plugin::from_float<T>(f));
    if (got != want || std::signbit(got) != std::signbit(want)) {
      if (++mismatches <= 5) FAIL_CHECK("float " << f << ": got " << got << ", want " << want);
    }
  });
  CHECK(mismatches == 0);
}

}  // namespace

TEST_CASE("float8: every pattern decodes exactly, and float -> 8 bits rounds to nearest even and saturates") {
  SUBCASE("float8_e4m3fn") { check_fp8<kd_plugin::Float8E4M3FN>(3, 7, 448.0, 0x7fu); }
  SUBCASE("float8_e5m2") { check_fp8<kd_plugin::Float8E5M2>(2, 15, 57344.0, 0x7eu); }
  using kd_plugin::Float8E4M3FN;
  using kd_plugin::from_float;
  CHECK(from_float<Float8E4M3FN>(464.0f).bits == 0x7e);          // past the max: saturates, no NaN
  CHECK(from_float<Float8E4M3FN>(0x1p-10f).bits == 0x00);         // tie between 0 and 2^-9: even
  CHECK(from_float<Float8E4M3FN>(0x1.8p-9f * 3.0f).bits == 0x04);  // 4.5 units of 2^-9: even, 4
  CHECK(from_float<Float8E4M3FN>(-0.0f).bits == 0x80);
  CHECK(kd_plugin::fp8_max<Float8E4M3FN> == 448.0f);
}

TEST_CASE("from_double rounds once: no double rounding through float") {
  // 1 + 2^-11 + 2^-30: above the tie between 1 and 1 + 2^-10. Through float
  // it becomes the tie itself, which rounds to even (1).
  const double v = 1.0 + 0x1p-11 + 0x1p-30;
  CHECK(kd_plugin::from_double<kd_plugin::Float16>(v).bits == 0x3c01);
  CHECK(kd_plugin::from_float<kd_plugin::Float16>(static_cast<float>(v)).bits == 0x3c00);
  CHECK(kd_plugin::from_double<kd_plugin::BFloat16>(1.0 + 0x1p-8 + 0x1p-40).bits == 0x3f81);
  CHECK(kd_plugin::from_double<kd_plugin::Float16>(1e6).bits == 0x7c00);
  CHECK(kd_plugin::from_double<kd_plugin::BFloat16>(-1e300).bits == 0xff80);
  CHECK(kd_plugin::from_double<float>(0.1) == 0.1f);
  CHECK(kd_plugin::to_double(kd_plugin::Float16{0x3555}) == static_cast<double>(kd_plugin::to_float(kd_plugin::Float16{0x3555})));
}

namespace {

// A call of (out [2, 3] float32, x [2, 3] float16) with attributes eps
// (float), k (int), on (bool), mode (string).
struct Call {
  float out[6] = {};
  uint16_t x[6] = {};
  int64_t shape[2] = {2, 3};
  DLTensor tensors[2];
  kd_attr attrs[4];
  char error[128] = "";
  kd_call_args args{};

  Call() {
    tensors[0] = DLTensor{out, {kDLCPU, 0}, 2, {kDLFloat, 32, 1}, shape, nullptr, 0};
    tensors[1] = DLTensor{x, {kDLCPU, 0}, 2, {kDLFloat, 16, 1}, shape, nullptr, 0};
    attrs[0] = kd_attr{"eps", KD_ATTR_TYPE_FLOAT, 0, {}};
    attrs[0].value.f = 1e-5;
    attrs[1] = kd_attr{"k", KD_ATTR_TYPE_INT, 0, {}};
    attrs[1].value.i = 8;
    attrs[2] = kd_attr{"on", KD_ATTR_TYPE_BOOL, 0, {}};
    attrs[2].value.b = 1;
    attrs[3] = kd_attr{"mode", KD_ATTR_TYPE_STRING, 0, {}};
    attrs[3].value.s = "neox";
    args.struct_size = sizeof(kd_call_args);
    args.tensors = tensors;
    args.num_tensors = 2;
    args.attrs = attrs;
    args.num_attrs = 4;
    args.error = error;
    args.error_capacity = sizeof error;
    args.kernel_data = nullptr;
  }
};

}  // namespace

TEST_CASE("Tensor: a view of argument i") {
  Call call;
  const kd_plugin::Tensor out(&call.args, 0), x(&call.args, 1);
  CHECK(out.ndim() == 2);
  CHECK(out.numel() == 6);
  CHECK(out.rows() == 2);
  CHECK(out.cols() == 3);
  CHECK(out.dim(-1) == 3);
  CHECK(out.stride(0) == 3);
  CHECK(out.is_contiguous());
  CHECK(out.present());
  CHECK(out.is<float>());
  CHECK(x.is<kd_plugin::Float16>());
  CHECK(std::string(x.dtype_name()) == "float16");
  CHECK(out.data<float>() == call.out);
  CHECK(x.data<const kd_plugin::Float16>() == reinterpret_cast<const kd_plugin::Float16*>(call.x));
  CHECK_THROWS_AS(x.data<float>(), std::invalid_argument);
  CHECK_THROWS_AS(out.dim(2), std::invalid_argument);
  CHECK_THROWS_AS(kd_plugin::Tensor(&call.args, 2), std::invalid_argument);
}

TEST_CASE("dtype_name: the 8-bit floats by their DLPack 1.1 codes") {
  DLTensor t{};
  t.dtype = DLDataType{KD_DLPACK_FLOAT8_E4M3FN, 8, 1};
  CHECK(std::string(kd_plugin::dtype_name(t)) == "float8_e4m3fn");
  t.dtype = DLDataType{KD_DLPACK_FLOAT8_E5M2, 8, 1};
  CHECK(std::string(kd_plugin::dtype_name(t)) == "float8_e5m2");
  t.dtype = DLDataType{11, 8, 1};  // float8_e4m3fnuz
  CHECK(std::string(kd_plugin::dtype_name(t)) == "other");
  t.dtype = DLDataType{KD_DLPACK_FLOAT8_E4M3FN, 16, 1};
  CHECK(std::string(kd_plugin::dtype_name(t)) == "other");
}

TEST_CASE("attributes by name") {
  Call call;
  CHECK(kd_plugin::float_attr(&call.args, "eps") == 1e-5);
  CHECK(kd_plugin::int_attr(&call.args, "k") == 8);
  CHECK(kd_plugin::bool_attr(&call.args, "on"));
  CHECK(std::string(kd_plugin::string_attr(&call.args, "mode")) == "neox");
  CHECK(kd_plugin::find_attr(&call.args, "eps", KD_ATTR_TYPE_INT) == nullptr);
  CHECK(kd_plugin::find_attr(&call.args, "missing") == nullptr);
  CHECK_THROWS_WITH_AS(kd_plugin::float_attr(&call.args, "k"), "attribute 'k' is not a float", std::invalid_argument);
  CHECK_THROWS_WITH_AS(kd_plugin::float_attr(&call.args, "alpha"), "attribute 'alpha' missing", std::invalid_argument);
}

TEST_CASE("guarded: every exception becomes a status and a message") {
  Call call;
  CHECK(kd_plugin::guarded(&call.args, [] {}) == KD_STATUS_OK);
  CHECK(kd_plugin::guarded(&call.args, [] { return KD_STATUS_UNSUPPORTED; }) == KD_STATUS_UNSUPPORTED);
  CHECK(kd_plugin::guarded(&call.args, [&] { kd_plugin::float_attr(&call.args, "alpha"); }) ==
        KD_STATUS_INVALID_ARGUMENT);
  CHECK(std::string(call.error) == "attribute 'alpha' missing");
  CHECK(kd_plugin::guarded(&call.args, [] { throw kd_plugin::Unsupported("odd sizes"); }) == KD_STATUS_UNSUPPORTED);
  CHECK(std::string(call.error) == "odd sizes");
  CHECK(kd_plugin::guarded(&call.args, [] { throw std::runtime_error("boom"); }) == KD_STATUS_INTERNAL);
  CHECK(std::string(call.error) == "boom");
  CHECK(kd_plugin::guarded(&call.args, [] { throw 42; }) == KD_STATUS_INTERNAL);
  CHECK(std::string(call.error) == "unknown exception");
  CHECK(kd_plugin::guarded(nullptr, [] {}) == KD_STATUS_INVALID_ARGUMENT);
  CHECK(kd_plugin::fail(&call.args, KD_STATUS_INTERNAL, "%s %d", "code", 7) == KD_STATUS_INTERNAL);
  CHECK(std::string(call.error) == "code 7");
}

TEST_CASE("dispatch_float_dtype picks the storage type or refuses") {
  Call call;
  int seen = 0;
  CHECK(kd_plugin::dispatch_float_dtype(&call.args, "op", call.tensors[1], [&](auto tag) {
          seen = std::is_same_v<typename decltype(tag)::type, kd_plugin::Float16> ? 1 : 2;
          return KD_STATUS_OK;
        }) == KD_STATUS_OK);
  CHECK(seen == 1);
  DLTensor ints = call.tensors[0];
  ints.dtype = DLDataType{kDLInt, 32, 1};
  CHECK(kd_plugin::dispatch_float_dtype(&call.args, "op", ints, [](auto) { return KD_STATUS_OK; }) ==
        KD_STATUS_UNSUPPORTED);
  CHECK(std::string(call.error).find("op: unsupported dtype") == 0);
}

TEST_CASE("parallel_for covers the range once, small or large") {
  for (int64_t count : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{4097}, int64_t{1} << 20}) {
    std::vector<std::atomic<int>> hits(static_cast<size_t>(count));
    kd_plugin::parallel_for(count, 1, [&](int64_t begin, int64_t end) noexcept {
      for (int64_t i = begin; i < end; ++i) hits[static_cast<size_t>(i)].fetch_add(1);
    });
    int64_t wrong = 0;
    for (const auto& h : hits) wrong += h.load() != 1;
    CHECK_MESSAGE(wrong == 0, count << " items");
  }
  CHECK(kd_plugin::parallel_threads() >= 1);
  CHECK(kd_plugin::cpu_thread_count() >= 1);
}

extern "C" const char kd_plugin_embedded_manifest[] = "{}";

namespace {

kd_status probe(kd_device_info* devices, size_t capacity, size_t* count, char* error, size_t error_capacity) {
  return kd_plugin::probe_host_cpu(devices, capacity, count, error, error_capacity, "test cpu");
}

kd_kernel_fn find_kernel(const char*) { return nullptr; }

}  // namespace

KD_DEFINE_PLUGIN("helpers_test", "1.2.3", "helpers_backend", probe, find_kernel, nullptr)

TEST_CASE("KD_DEFINE_PLUGIN and probe_host_cpu") {
  const kd_plugin_api* api = kdispatch_plugin_api();
  REQUIRE(api != nullptr);
  CHECK(api->struct_size == KD_PLUGIN_API_STRUCT_SIZE);
  CHECK(api->abi_major == KDISPATCH_ABI_MAJOR);
  CHECK(std::string(api->plugin_name) == "helpers_test");
  CHECK(std::string(api->backend) == "helpers_backend");
  CHECK(api->manifest_json == kd_plugin_embedded_manifest);
  kd_device_info device{};
  device.struct_size = sizeof device;
  size_t count = 0;
  char error[64] = "";
  CHECK(api->probe(&device, 1, &count, error, sizeof error) == KD_STATUS_OK);
  CHECK(count == 1);
  CHECK(device.device_type == kDLCPU);
  CHECK(std::string(device.name) == "test cpu");
  CHECK(api->probe(nullptr, 0, &count, error, sizeof error) == KD_STATUS_OK);
  CHECK(api->probe(nullptr, 1, &count, error, sizeof error) == KD_STATUS_INVALID_ARGUMENT);
}
