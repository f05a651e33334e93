/*
 * kdispatch plugin ABI: the only header a plugin needs.
 *
 * A plugin is a shared library that exports one C symbol,
 * `kdispatch_plugin_api` (type kd_plugin_entry_fn), returning a pointer to a
 * static kd_plugin_api table. Everything that crosses the boundary is plain C:
 * fixed-width integers, enums pinned to 32 bits, DLPack tensors, and
 * caller-owned buffers for messages. No C++ exception, std::string or STL type
 * ever crosses it; a plugin catches everything inside its entry points and
 * reports a kd_status plus a message.
 *
 * Versioning (after PJRT):
 *   KDISPATCH_ABI_MAJOR  bump when a field is removed, reordered or changes
 *                        meaning, or a function changes signature. The host
 *                        refuses a plugin of another major (KD-E022).
 *   KDISPATCH_ABI_MINOR  bump when a field is appended to the end of a struct
 *                        or a new enum value is added. The host accepts any
 *                        plugin of its major whose struct_size covers the
 *                        fields of 1.0 (the frozen *_STRUCT_SIZE_1_0 sizes),
 *                        so a plugin built for an older or a newer minor
 *                        loads; it reads a field added after 1.0 only when
 *                        the struct_size reported by the other side covers
 *                        it (KD_STRUCT_HAS_FIELD).
 *   Neither is bumped when an enum value that no host of the major passes is
 *   withdrawn: binaries of either side keep working together. Its number
 *   stays reserved (a comment in the enum), is never given to another value,
 *   and the changelog says so.
 * Every struct starts with `size_t struct_size` and only ever grows at its
 * end. Its *_STRUCT_SIZE macro names the last field; the static asserts below
 * fail to compile when a field is appended without updating that macro.
 *
 * Changelog
 *   1.0  first version: kd_plugin_api, kd_device_info, kd_attr, kd_call_args,
 *        kd_memory_api.
 *        kd_copy_kind 3 (device to device) withdrawn, no bump (see above): no
 *        host passed it; 3 is reserved.
 *   1.1  absent optional tensors: an op schema may mark a tensor "optional";
 *        a call that omits it passes, in its position of
 *        kd_call_args.tensors, a DLTensor with data NULL, ndim 0, shape and
 *        strides NULL (KD_TENSOR_IS_ABSENT). No struct changes. A host never
 *        registers a kernel of a 1.0 plugin for an op that has an optional
 *        tensor (KD-E022), so 1.0 plugins never see one.
 *        Tensors whose schema says "layout": "rows" may come with strides:
 *        the last dim contiguous, every other dim any stride >= 1
 *        (<kdispatch/plugin_rows.hpp> addresses them). A 1.0 schema could
 *        only ask for contiguous tensors or any strides, so nothing a 1.0
 *        plugin declared changes.
 *        A manifest kernel entry may name a "supports" symbol: a
 *        kd_kernel_fn that find_kernel returns like a kernel, called with
 *        the call's arguments before the kernel. KD_STATUS_OK runs the
 *        kernel; KD_STATUS_UNSUPPORTED (its message saying why) passes the
 *        call to the next ranked backend, as the kernel's own would; any
 *        other status is the call's error. It reads what a constraint
 *        cannot (alignment, values, strides) and writes no tensor.
 *        kd_device_info.driver_version and .runtime_version appended (a
 *        tuning file's key, docs/tuning.md); a plugin that does not write
 *        them leaves them "" (the host zeroes the struct).
 *        kd_call_args.kernel_data appended: the data given with a kernel
 *        registered at run time (a function in the process, not in a
 *        plugin); NULL for a plugin's kernels, which never need to read it.
 *        kd_memory_api.time_calls appended: the backend times calls the
 *        host makes on a stream it gives them, under graph replay and
 *        launched back to back (`kdispatch tune --device cuda`); a host
 *        reads it only when the plugin's kd_memory_api.struct_size covers
 *        it, so a 1.0 plugin's backend is reported as unable to time calls.
 */
#ifndef KDISPATCH_PLUGIN_API_H_
#define KDISPATCH_PLUGIN_API_H_

#include <stddef.h>
#include <stdint.h>

#include <dlpack/dlpack.h>

#ifdef __cplusplus
extern "C" {
#endif

#define KDISPATCH_ABI_MAJOR 1
#define KDISPATCH_ABI_MINOR 1

/* Name of the one symbol a plugin exports. */
#define KDISPATCH_PLUGIN_ENTRY_SYMBOL "kdispatch_plugin_api"

/* ELF section holding the plugin's manifest text, so tools can read it
 * without loading the library. */
#define KDISPATCH_MANIFEST_SECTION ".kdispatch_manifest"

/* DLDataType codes of the 8-bit floats, as DLPack 1.1 numbers them
 * (DLDataTypeCode kDLFloat8_e4m3fn and kDLFloat8_e5m2; bits 8, lanes 1).
 * Older dlpack.h headers (Debian 12 ships 0.6) lack them. These are the codes
 * torch's __dlpack__ gives torch.float8_e4m3fn and torch.float8_e5m2. Codes
 * 7 to 17 are DLPack 1.1's other 8-, 6- and 4-bit floats, which kdispatch
 * does not handle. Not part of the ABI version: values fixed by DLPack. */
#define KD_DLPACK_FLOAT8_E4M3FN 10
#define KD_DLPACK_FLOAT8_E5M2 12
#define KD_DLPACK_FIRST_NARROW_FLOAT 7
#define KD_DLPACK_LAST_NARROW_FLOAT 17

/* Size of a struct up to and including `field`. */
#define KD_STRUCT_SIZE(type, field) \
  (offsetof(type, field) + sizeof(((type*)0)->field))

/* True when a struct whose struct_size is `size` carries `field`. */
#define KD_STRUCT_HAS_FIELD(type, field, size) \
  ((size) >= KD_STRUCT_SIZE(type, field))

#if defined(__cplusplus)
#define KD_STATIC_ASSERT(cond, msg) static_assert(cond, msg)
#elif defined(__STDC_VERSION__) && __STDC_VERSION__ >= 201112L
#define KD_STATIC_ASSERT(cond, msg) _Static_assert(cond, msg)
#else
#define KD_STATIC_ASSERT_CAT2(a, b) a##b
#define KD_STATIC_ASSERT_CAT(a, b) KD_STATIC_ASSERT_CAT2(a, b)
#define KD_STATIC_ASSERT(cond, msg) \
  typedef char KD_STATIC_ASSERT_CAT(kd_static_assert_, __LINE__)[(cond) ? 1 : -1]
#endif

/* Status returned by every function of the ABI. */
typedef enum kd_status {
  KD_STATUS_OK = 0,
  KD_STATUS_INVALID_ARGUMENT = 1, /* the kernel refused its arguments */
  KD_STATUS_UNSUPPORTED = 2,      /* dtype, shape or attribute not handled */
  KD_STATUS_DEVICE_ERROR = 3,     /* the device runtime reported an error */
  KD_STATUS_INTERNAL = 4,         /* anything else, e.g. a caught exception */
  KD_STATUS_FORCE_32BIT = 0x7fffffff
} kd_status;

/* One device a backend can run on, written by kd_plugin_api.probe. */
typedef struct kd_device_info {
  size_t struct_size;   /* set by the caller to sizeof(kd_device_info) */
  int32_t device_type;  /* out: a DLDeviceType: kDLCPU, kDLCUDA, kDLROCM */
  int32_t device_id;    /* out: ordinal within its type */
  char arch[32];        /* out: "9.0" (cuda), "gfx90a" (hip), "" (cpu);
                           NUL-terminated */
  char name[96];        /* out: human-readable device name, NUL-terminated */
  /* 1.1: the versions of the device's driver and runtime, NUL-terminated
     ("12040" from cudaDriverGetVersion, say); "" when unknown. A plugin
     writes them only when the caller's struct_size covers them. */
  char driver_version[32];
  char runtime_version[32];
} kd_device_info;
#define KD_DEVICE_INFO_STRUCT_SIZE KD_STRUCT_SIZE(kd_device_info, runtime_version)
KD_STATIC_ASSERT(sizeof(kd_device_info) == KD_DEVICE_INFO_STRUCT_SIZE,
                 "kd_device_info grew: update KD_DEVICE_INFO_STRUCT_SIZE");

typedef enum kd_attr_type {
  KD_ATTR_TYPE_FLOAT = 1,  /* value.f */
  KD_ATTR_TYPE_INT = 2,    /* value.i */
  KD_ATTR_TYPE_BOOL = 3,   /* value.b (0 or 1) */
  KD_ATTR_TYPE_STRING = 4, /* value.s */
  KD_ATTR_TYPE_FORCE_32BIT = 0x7fffffff
} kd_attr_type;

/* One scalar attribute of a call. The host passes every attribute of the op
 * schema, in schema order, defaults filled in, so a kernel may read them by
 * index. */
typedef struct kd_attr {
  const char* name;  /* owned by the host, valid for the call */
  int32_t type;      /* a kd_attr_type */
  int32_t reserved;  /* zero */
  union {
    double f;
    int64_t i;
    int32_t b;
    const char* s; /* owned by the host, valid for the call */
  } value;
} kd_attr;

/* Arguments of one kernel call. All pointers are owned by the host and valid
 * only for the duration of the call. */
typedef struct kd_call_args {
  size_t struct_size;        /* sizeof(kd_call_args) of the host */
  DLTensor* tensors;         /* in schema order; tensors marked "written" in
                                the schema are outputs (their data is written) */
  int32_t num_tensors;
  int32_t num_attrs;
  const kd_attr* attrs;      /* in schema order, defaults filled in */
  void* stream;              /* cudaStream_t / hipStream_t; NULL = default
                                stream; unused on cpu */
  char* error;               /* out: NUL-terminated message when the kernel
                                does not return KD_STATUS_OK */
  size_t error_capacity;     /* bytes available at `error` */
  void* kernel_data;         /* ABI 1.1: the data registered with a kernel
                                registered at run time
                                (Context::register_kernel); NULL for a
                                plugin's kernels */
} kd_call_args;
#define KD_CALL_ARGS_STRUCT_SIZE KD_STRUCT_SIZE(kd_call_args, kernel_data)
KD_STATIC_ASSERT(sizeof(kd_call_args) == KD_CALL_ARGS_STRUCT_SIZE,
                 "kd_call_args grew: update KD_CALL_ARGS_STRUCT_SIZE");

/* True for an absent optional tensor (ABI 1.1; see the changelog). */
#define KD_TENSOR_IS_ABSENT(t) ((t).data == NULL && (t).ndim == 0)

/* A kernel. Must not throw, must not keep any pointer from `args` after it
 * returns, and must be callable concurrently from several threads. */
typedef kd_status (*kd_kernel_fn)(const kd_call_args* args);

typedef enum kd_copy_kind {
  KD_COPY_HOST_TO_DEVICE = 1,
  KD_COPY_DEVICE_TO_HOST = 2,
  /* 3 is reserved (a withdrawn kind, see the changelog): never reuse it. */
  KD_COPY_KIND_FORCE_32BIT = 0x7fffffff
} kd_copy_kind;

/* One call of a timed batch (kd_memory_api.time_calls): the host makes the
 * call whose number is `index` (0 <= index < the batch's count), with
 * `stream` in its kd_call_args.stream, and returns its status. `user` is the
 * host's, passed through. Called on the thread that called time_calls. */
typedef kd_status (*kd_timed_fn)(void* user, int32_t index, void* stream);

/* Device memory of a backend, so that hosts (the kdispatch tool, tests,
 * benchmarks) can place tensors on the backend's devices without linking its
 * runtime. Every function is synchronous with respect to the host unless
 * noted, and writes a NUL-terminated message to `error` on failure. Static
 * storage, owned by the plugin. */
typedef struct kd_memory_api {
  size_t struct_size; /* sizeof(kd_memory_api) of the plugin */
  /* Allocates `bytes` on device `device_id`; *ptr is NULL on failure. */
  kd_status (*alloc)(int32_t device_id, size_t bytes, void** ptr, char* error, size_t error_capacity);
  /* Frees memory from alloc; NULL is a no-op. */
  kd_status (*free)(int32_t device_id, void* ptr, char* error, size_t error_capacity);
  /* Copies `bytes`; `kind` is a kd_copy_kind. */
  kd_status (*copy)(int32_t device_id, void* dst, const void* src, size_t bytes, int32_t kind, char* error,
                    size_t error_capacity);
  /* Waits until all work queued on device `device_id` has finished. */
  kd_status (*synchronize)(int32_t device_id, char* error, size_t error_capacity);
  /* 1.1: times `count` calls (count >= 1) of `fn` on device `device_id`, on
   * a stream the plugin creates there: fn(user, i, stream) for i = 0 and 1
   * (of the count) to warm up; then the calls i = 0..count-1 captured into
   * one graph (CUDA graph / HIP graph) and twice over into another, each
   * replayed once and then timed over several replays with events:
   * *graph_us (out) is the difference of their median replays divided by
   * count, the time one more call adds to a graph (what a replay costs once
   * whatever its length does not count). Then the same `count` calls launched
   * back to back between two events: *eager_us (out), per call. Everything
   * it made is destroyed before it returns. A status other than OK from
   * `fn` is returned as it is (fn wrote its own message); a device error is
   * KD_STATUS_DEVICE_ERROR with the runtime's message in `error`. NULL where
   * the backend cannot time calls. */
  kd_status (*time_calls)(int32_t device_id, kd_timed_fn fn, void* user, int32_t count, double* graph_us,
                          double* eager_us, char* error, size_t error_capacity);
} kd_memory_api;
#define KD_MEMORY_API_STRUCT_SIZE KD_STRUCT_SIZE(kd_memory_api, time_calls)
KD_STATIC_ASSERT(sizeof(kd_memory_api) == KD_MEMORY_API_STRUCT_SIZE,
                 "kd_memory_api grew: update KD_MEMORY_API_STRUCT_SIZE");

/* The table a plugin returns from its entry symbol. Static storage, owned by
 * the plugin, valid until process exit (plugins are never unloaded). */
typedef struct kd_plugin_api {
  size_t struct_size;          /* sizeof(kd_plugin_api) of the plugin */
  uint32_t abi_major;          /* KDISPATCH_ABI_MAJOR the plugin was built with */
  uint32_t abi_minor;          /* KDISPATCH_ABI_MINOR the plugin was built with */
  const char* plugin_name;     /* matches the manifest's "plugin" */
  const char* plugin_version;  /* free-form, e.g. "0.1.0" */
  const char* backend;         /* matches the manifest's "backend" */
  const char* manifest_json;   /* the manifest compiled into the library,
                                  NUL-terminated */

  /* Reports the devices this backend can use. Writes up to `capacity`
   * entries to `devices` (each with struct_size set by the caller) and the
   * number of devices present to *count (which may exceed capacity). Zero
   * devices (e.g. no driver) is KD_STATUS_OK with *count = 0, not an error.
   * On failure writes a NUL-terminated message to `error`. */
  kd_status (*probe)(kd_device_info* devices, size_t capacity, size_t* count,
                     char* error, size_t error_capacity);

  /* The kernel exported under `symbol` (a name from the manifest), or NULL. */
  kd_kernel_fn (*find_kernel)(const char* symbol);

  /* Device memory functions, or NULL when tensors of this backend live in
   * ordinary host memory (the cpu backend). */
  const kd_memory_api* memory;
} kd_plugin_api;
#define KD_PLUGIN_API_STRUCT_SIZE KD_STRUCT_SIZE(kd_plugin_api, memory)
KD_STATIC_ASSERT(sizeof(kd_plugin_api) == KD_PLUGIN_API_STRUCT_SIZE,
                 "kd_plugin_api grew: update KD_PLUGIN_API_STRUCT_SIZE");

/* The sizes of the ABI 1.0 structs, frozen: the least struct_size a host of
 * major 1 accepts. Each names the last field of 1.0, which stays where it is
 * whatever is appended later. */
#define KD_PLUGIN_API_STRUCT_SIZE_1_0 KD_STRUCT_SIZE(kd_plugin_api, memory)
#define KD_MEMORY_API_STRUCT_SIZE_1_0 KD_STRUCT_SIZE(kd_memory_api, synchronize)
#define KD_DEVICE_INFO_STRUCT_SIZE_1_0 KD_STRUCT_SIZE(kd_device_info, name)
#define KD_CALL_ARGS_STRUCT_SIZE_1_0 KD_STRUCT_SIZE(kd_call_args, error_capacity)

/* Type of the exported entry symbol. Returns NULL only on a fatal error. */
typedef const kd_plugin_api* (*kd_plugin_entry_fn)(void);

#ifdef __cplusplus
} /* extern "C" */
#endif

#endif /* KDISPATCH_PLUGIN_API_H_ */
