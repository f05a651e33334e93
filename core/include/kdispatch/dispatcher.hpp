// Calling kernels: resolve an op once to a handle, then call it with DLPack
// tensors and named attributes (docs/internals.md, the checked call).
//
//   kdispatch::Context ctx;                       // discovers plugins (no dlopen)
//   kdispatch::Dispatcher dispatch(ctx);
//   auto rmsnorm = dispatch.op("layernorm.rmsnorm");
//   rmsnorm({out, x, weight}, {{"eps", 1e-5}});   // checked call
//
// A checked call validates the tensors against the op schema, takes the
// device from the tensors, finds the kernel in a lock-free per-op resolution
// cache keyed by (device type, device id, dtype), opens the plugin on first
// use and turns a failing status into KernelError (KD-E040/E041). A kernel
// that returns KD_STATUS_UNSUPPORTED passes the call to the next ranked
// backend, and with fallback on (Context::set_fallback) so does one that
// fails with a device or internal error, which is then demoted
// (docs/internals.md, Fallback).
#pragma once

#include <kdispatch/export.h>

#include <kdispatch/plugin_api.h>

#include <atomic>
#include <cstdio>
#include <initializer_list>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "kdispatch/context.hpp"
#include "kdispatch/schema.hpp"

namespace kdispatch KDISPATCH_API {

struct NamedAttr {
  std::string_view name;
  AttrValue value;
};

class Dispatcher;
struct OpState;
struct ResolvedKernel;
struct ConstraintCall;
struct FallbackTrail;
struct RememberedCall;

// A kernel resolved for one device and dtype: calling it checks nothing.
// For callers that validated their arguments already. It runs that kernel
// only: no fallback to another backend.
class KernelHandle {
 public:
  KernelHandle() = default;
  // `attrs` are every schema attribute in schema order (OpHandle::pack_attrs).
  // Throws KernelError when the kernel reports a failure. Inline: this is
  // the whole cost of an unchecked call.
  [[gnu::always_inline]] void operator()(std::span<DLTensor> tensors, std::span<const kd_attr> attrs,
                                         void* stream = nullptr) const {
    char error[512];
    error[0] = '\0';
    const kd_call_args args{sizeof(kd_call_args), tensors.data(), static_cast<int32_t>(tensors.size()),
                            static_cast<int32_t>(attrs.size()), attrs.data(), stream, error, sizeof error,
                            data_};
    const kd_status status = fn_(&args);
    if (status != KD_STATUS_OK) [[unlikely]] raise(status, error);
  }
  kd_kernel_fn function() const { return fn_; }
  const KernelSpec& spec() const { return *spec_; }
  explicit operator bool() const { return fn_ != nullptr; }

 private:
  friend class OpHandle;
  friend class Dispatcher;
  friend struct ResolvedKernel;
  KernelHandle(kd_kernel_fn fn, void* data, const KernelSpec* spec) : fn_(fn), data_(data), spec_(spec) {}
  [[noreturn]] void raise(kd_status status, char* error) const;
  kd_kernel_fn fn_ = nullptr;
  void* data_ = nullptr;  // the spec's function_data: kd_call_args::kernel_data
  const KernelSpec* spec_ = nullptr;
};

// An op resolved by name once (and optionally a backend). Cheap to copy;
// valid while its Dispatcher lives.
class OpHandle {
 public:
  // The checked call.
  void operator()(std::span<DLTensor> tensors, std::span<const NamedAttr> attrs = {}, void* stream = nullptr) const;
  void operator()(std::initializer_list<DLTensor> tensors, std::initializer_list<NamedAttr> attrs = {},
                  void* stream = nullptr) const;
  // Checks `tensors` and returns the kernel a call would run.
  KernelHandle resolve(std::span<const DLTensor> tensors) const;
  // The selection a call with these tensors and attributes would make on
  // `device` number `device_id` (the arch may be named where no such device
  // is present; the tensors' own device is not read), with
  // the rule that decided and the ranking: kernel constraints and tuned
  // choices read the call's sizes, dtype and attributes. Only the tensors'
  // layout is checked (no data is read) and nothing runs; the tensors must
  // not be given flattened. Throws as a call would (KD-E030, KD-E003, ...).
  Selection select(const Device& device, int32_t device_id, std::span<const DLTensor> tensors,
                   std::span<const NamedAttr> attrs = {}) const;
  // What to look at in check(): everything a call needs, or only what
  // tensors without data have (torch's meta and fake tensors): devices,
  // dtypes, shapes and strides, not data pointers or byte offsets.
  enum class CheckScope { call, layout };
  // Checks `tensors` against the op schema as a call does, running
  // nothing: throws CallError KD-E030 with the call's own words.
  void check(std::span<const DLTensor> tensors, CheckScope scope = CheckScope::call) const;
  // The same check of a call that gives `attrs`: where the schema lets an
  // attribute say that tensors come "flattened" (docs/op-schema.md), they
  // are checked as the call would see them. Also refuses bad attributes.
  void check(std::span<const DLTensor> tensors, std::span<const NamedAttr> attrs,
             CheckScope scope = CheckScope::call) const;
  // Every attribute of the schema in order, defaults filled in, with the
  // given ones applied. Throws CallError KD-E030 for unknown or mistyped ones.
  // The result points into `storage` and `attrs` (strings).
  std::span<const kd_attr> pack_attrs(std::span<const NamedAttr> attrs, std::span<kd_attr> storage) const;
  const OpSchema& schema() const;
  std::string_view op() const;
  std::string_view backend() const;

 private:
  friend class Dispatcher;
  explicit OpHandle(OpState* state) : state_(state) {}
  // The rest of a call whose tensors passed the check.
  void call_checked(std::span<DLTensor> tensors, std::span<const NamedAttr> attrs, void* stream, DLDevice device,
                    Dtype dtype) const;
  // call_checked() with the attributes packed.
  void call_packed(std::span<DLTensor> tensors, std::span<const kd_attr> packed, void* stream, DLDevice device,
                   Dtype dtype) const;
  // operator() without attributes and with, for an op of N tensors (N = 0:
  // any count). Each op's OpState holds the ones for its count.
  template <size_t N>
  static void call_plain(const OpHandle& op, std::span<DLTensor> tensors, void* stream);
  template <size_t N>
  static void call_with_attrs(const OpHandle& op, std::span<DLTensor> tensors, std::span<const NamedAttr> attrs,
                              void* stream);
  // call_plain() for a call that does not repeat a remembered signature.
  void call_unremembered(std::span<DLTensor> tensors, void* stream) const;
  // call_with_attrs() of an op with "flattened" tensors.
  static void call_flattened(const OpHandle& op, std::span<DLTensor> tensors, std::span<const NamedAttr> attrs,
                             void* stream);
  // A call that repeats a remembered signature with no current kernel
  // attached to it: resolves, attaches and runs.
  void call_remembered(std::span<DLTensor> tensors, std::span<const kd_attr> packed, void* stream, DLDevice device,
                       Dtype dtype, const RememberedCall& found) const;
  // Runs `kernel`; a status other than OK goes to Dispatcher::recover.
  static void run(const OpState& state, const ResolvedKernel& kernel, DLDevice device, std::span<DLTensor> tensors,
                  std::span<const kd_attr> attrs, void* stream, FallbackTrail* trail);
  OpState* state_;
};

class Dispatcher {
 public:
  explicit Dispatcher(Context& context);
  ~Dispatcher();
  Dispatcher(const Dispatcher&) = delete;
  Dispatcher& operator=(const Dispatcher&) = delete;

  // Throws SelectionError KD-E001 for an op with no kernel, KD-E002 for a
  // backend the op has no kernel of, CallError KD-E030 for an op without a
  // schema (it can be listed and selected, not called).
  OpHandle op(std::string_view op, std::string_view backend = {});
  // Lookup by name on every call (the handle is the faster way).
  void call(std::string_view op, std::span<DLTensor> tensors, std::span<const NamedAttr> attrs = {},
            std::string_view backend = {}, void* stream = nullptr);

  Context& context() { return context_; }
  // How many (op, backend) pairs are interned: each op asked for by name,
  // with each backend it has that was named, kept until the dispatcher goes.
  size_t interned() const;

 private:
  friend class OpHandle;
  OpState* intern(std::string_view op, std::string_view backend);
  // The kernel for a checked call: its tensors and packed attributes are
  // read only when a kernel of the op has constraints.
  const ResolvedKernel& resolve(OpState& state, DLDevice device, Dtype dtype, std::span<const DLTensor> tensors,
                                std::span<const kd_attr> attrs);
  // `rejected`: the verdicts of the constrained kernels as of registry
  // generation `seen_generation` (with `call` only); `by_signature`: they
  // read no attribute (ResolvedKernel::by_signature).
  const ResolvedKernel& resolve_slow(OpState& state, DLDevice device, Dtype dtype, const ConstraintCall* call,
                                     uint64_t rejected, uint64_t seen_generation, bool by_signature);
  // OpState::constrained, current with the registry's generation.
  void refresh_constraints(OpState& state, uint64_t generation);
  // A call whose kernel `first` returned `status` (its message in `error`):
  // passes it to the next ranked backends as fallback allows, returning
  // when one of them ran it; otherwise throws the call's KernelError. What
  // happened goes to `trail` when given.
  [[gnu::noinline, gnu::cold]] void recover(const ResolvedKernel& first, DLDevice device, std::span<DLTensor> tensors,
                                            std::span<const kd_attr> attrs, void* stream, kd_status status,
                                            const char* error, FallbackTrail* trail);
  void trace(const OpState& state, const ResolvedKernel& kernel, std::span<const DLTensor> tensors, double us,
             const FallbackTrail* trail);

  Context& context_;
  static constexpr size_t kInternSlots = 512;  // power of two
  std::unique_ptr<std::atomic<OpState*>[]> intern_slots_;
  static std::string overflow_key(std::string_view op, std::string_view backend);
  // OpState::plain and with_attrs for the op's tensor count.
  static void set_calls(OpState& state);

  mutable std::mutex mutex_;  // writers: intern table, resolution caches, trace file
  std::vector<std::unique_ptr<OpState>> states_;
  // The states that did not fit in the table, by op and backend (guarded by mutex_).
  std::unordered_map<std::string, OpState*> overflow_;
  std::FILE* trace_file_ = nullptr;  // KDISPATCH_TRACE
  // (op, backend) pairs whose KD_STATUS_UNSUPPORTED was reported (guarded by mutex_).
  std::set<std::string, std::less<>> reported_unsupported_;
};

}  // namespace kdispatch
