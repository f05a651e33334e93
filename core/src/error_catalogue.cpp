// The error catalogue: one entry per ErrorCode, printed by
// `kdispatch explain KD-Ennn`. Every entry must let a user fix the problem
// from the entry alone, so causes and fixes name the real commands and
// environment variables. Lines of `causes` and `fix` start with "- " and are
// separated by '\n' (no trailing newline), so tools can print or split them.
#include "kdispatch/error_catalogue.hpp"

#include <algorithm>
#include <iterator>
#include <string_view>

namespace kdispatch {
namespace {

using namespace std::string_view_literals;

constexpr CatalogueEntry kCatalogue[] = {
    // ---------------------------------------------------------------- selection
    {ErrorCode::unknown_op,
     "Unknown op: no kernels registered for it"sv,
     "No loaded plugin and no op schema declares the requested op id. When a plugin "
     "declares the op but failed to load or has an invalid manifest, the message says "
     "so and gives the first problem; the hints list the closest known op ids and "
     "every other plugin that failed to load."sv,
     "- A typo in the op id (ids are \"<group>.<name>\", lower case, e.g. layernorm.rmsnorm)\n"
     "- The plugin that declares the op failed to load or was not found on the search path\n"
     "- The plugin's manifest is invalid (a misspelt dtype or key value): none of its kernels is registered\n"
     "- The plugin is filtered out by KDISPATCH_PLUGINS_DISABLE or KDISPATCH_PLUGINS_SELECT\n"
     "- A third-party op whose schema (\"ops\" in its manifest) was not shipped"sv,
     "- Check the spelling against the \"did you mean\" hint and `kdispatch list`\n"
     "- Run `kdispatch doctor` to see which plugins were found, which failed and why\n"
     "- Rerun with KDISPATCH_LOG=debug to see every directory searched and every manifest skipped\n"
     "- Put the plugin's directory on the path: --add-plugin-path DIR or KDISPATCH_ADD_PLUGIN_PATH=DIR\n"
     "- Unset KDISPATCH_PLUGINS_DISABLE / KDISPATCH_PLUGINS_SELECT if they exclude the plugin"sv},

    {ErrorCode::backend_not_registered,
     "Backend not registered for the op"sv,
     "A backend was named (backend=..., --backend or KDISPATCH_FORCE_BACKEND) but no "
     "registered kernel of that backend implements the op. The message lists the "
     "backends that are registered and, when a plugin declaring the backend did not "
     "load or its manifest is invalid, why (for an invalid manifest: its path and first "
     "problem)."sv,
     "- The plugin providing the backend is not installed or not on the search path\n"
     "- The plugin was found but failed to load (the message gives the KD-E01x/E02x reason)\n"
     "- The plugin's manifest is invalid, e.g. one misspelt dtype name: the whole manifest is skipped\n"
     "- The plugin is disabled via KDISPATCH_PLUGINS_DISABLE or not matched by KDISPATCH_PLUGINS_SELECT\n"
     "- The backend exists but simply does not implement this op\n"
     "- A typo in the backend name"sv,
     "- Run `kdispatch list` to see which backends implement the op\n"
     "- Run `kdispatch doctor` and fix the problem it reports for the backend's plugin\n"
     "- For an invalid manifest, `kdispatch validate FILE` lists every problem with its JSON pointer\n"
     "- Add the plugin's directory: --add-plugin-path DIR or KDISPATCH_ADD_PLUGIN_PATH=DIR\n"
     "- Check KDISPATCH_PLUGINS_DISABLE / KDISPATCH_PLUGINS_SELECT (disable applies first)\n"
     "- Pick a registered backend: `kdispatch select OP --backend B`, or drop backend=... to let selection choose"sv},

    {ErrorCode::no_usable_backend,
     "No backend usable on the device"sv,
     "Backends are registered for the op, but none can run on the device of the call: "
     "each was rejected by device type, arch window, CPU features, dtype or one of its "
     "kernel's constraints on the call's sizes and attributes. The "
     "message gives the reason for each backend, and names any plugin that declares "
     "the op but failed to load or has an invalid manifest, with its first problem."sv,
     "- Only a GPU backend is registered and the call runs on the CPU (e.g. only the cuda plugin on a CPU box)\n"
     "- The device's arch is outside the kernel's min_arch/max_arch window (cuda) or archs list (hip)\n"
     "- The CPU lacks a required feature (e.g. avx2)\n"
     "- No backend supports the dtype of the call\n"
     "- A kernel's constraint is false for the call's sizes, dtype or attributes "
     "(\"cpu: constraint 'H % 8 == 0' is false (H = 12)\")\n"
     "- KDISPATCH_DEVICE or --device names a different device than intended\n"
     "- The cpu reference plugin is missing or disabled\n"
     "- The plugin for this device declares the op but its manifest is invalid or it failed to load"sv,
     "- Run `kdispatch list --device D` to see each backend's eligibility and the reason it was rejected\n"
     "- Check the detected device: `kdispatch doctor`; override with --device D or KDISPATCH_DEVICE\n"
     "- Install or enable a plugin for this device (e.g. the cpu plugin); check KDISPATCH_PLUGINS_DISABLE\n"
     "- Fix a plugin the message names as failed: `kdispatch doctor` says why, `kdispatch validate FILE` lists "
     "every problem of an invalid manifest\n"
     "- Call with a dtype the backends list in their manifest \"dtypes\"\n"
     "- For a false constraint: call with sizes or attributes it allows, or install a backend "
     "without it (docs/manifest.md, Constraints)\n"
     "- Move the tensors to a device a backend supports"sv},

    {ErrorCode::ambiguous_backend,
     "Several backends usable, none chosen"sv,
     "More than one backend can run the op on this device and dtype, and nothing says "
     "which one to use. The selector takes the backend named for the call, else "
     "KDISPATCH_FORCE_BACKEND when it is usable, else ranks the usable backends by the op's "
     "preference, the tuning file's choice for the call (KDISPATCH_TUNING_FILE), KDISPATCH_BACKEND_ORDER "
     "and the kernels' manifest priority, and reports this "
     "error when none of them tells the first ones apart (the message names those tied). A "
     "reference kernel never counts here: it runs only when named or forced."sv,
     "- Two plugins implement the op for the same device, e.g. the shipped cpu backend and a third-party one "
     "(the example plugin's example_cpu for activation.silu_and_mul)\n"
     "- No backend was named for the call, no preference, tuned choice or KDISPATCH_BACKEND_ORDER names one of "
     "the tied "
     "backends, and their manifests declare equal priorities (the message lists them)"sv,
     "- Name a backend for the call: --backend B on the command line, backend=\"B\" in Python, "
     "dispatcher.op(op, \"B\") in C++\n"
     "- Or rank backends for the op: kdispatch.set_preference(op, [\"a\", \"b\"]) in Python, "
     "Context::set_preference in C++, or a KDISPATCH_PREFERENCE_FILE (docs/environment.md)\n"
     "- Or rank backends for every op: KDISPATCH_BACKEND_ORDER=a,b (the first usable one wins; in C++ "
     "ContextOptions::selector's backend_order)\n"
     "- Or force one for every op it can run: KDISPATCH_FORCE_BACKEND=B (any other op is selected as usual, "
     "with a warning)\n"
     "- Or leave out the plugin you do not want: KDISPATCH_PLUGINS_DISABLE=name\n"
     "- See the candidates: `kdispatch select OP --device D` or `kdispatch list --device D`"sv},

    {ErrorCode::conflicting_registration,
     "Conflicting registration"sv,
     "The same (op, backend) pair, or the same op schema, was registered twice with "
     "different contents. The first registration stays; the second is ignored and "
     "loading goes on."sv,
     "- Two manifests declare the same op and backend with a different plugin or symbol\n"
     "- Two copies of a plugin under different plugin names on the search path\n"
     "- An op schema is defined twice differently (a plugin's \"ops\" redefines a built-in or another plugin's op)"sv,
     "- Run `kdispatch doctor` to see both files named in the conflict\n"
     "- Remove or disable one of the plugins: KDISPATCH_PLUGINS_DISABLE=name, or narrow the path with KDISPATCH_PLUGIN_PATH\n"
     "- Give a third-party backend its own backend name instead of reusing an existing one\n"
     "- Do not redefine built-in ops; give a new op its own id, and check it with `kdispatch validate FILE`"sv},

    {ErrorCode::backend_not_usable,
     "Named backend not usable on the device"sv,
     "The backend that was asked for is registered for the op, but it cannot run on "
     "the call's device (device type, arch window, CPU features or dtype)."sv,
     "- backend=cuda (or --backend cuda) on a call whose tensors are on the CPU, or the reverse\n"
     "- The GPU's arch is outside the kernel's min_arch/max_arch window or archs list\n"
     "- The backend does not support the dtype of the call\n"
     "- --device or KDISPATCH_DEVICE names a different device than intended"sv,
     "- See why: `kdispatch select OP --backend B --device D` and `kdispatch list --device D`\n"
     "- Move the tensors to a device the backend supports, or name another backend\n"
     "- Drop backend=... to let selection choose among usable backends\n"
     "- Check the detected device with `kdispatch doctor`"sv},

    // ---------------------------------------------------------------- manifests
    {ErrorCode::manifest_bad_json,
     "Manifest is not valid JSON"sv,
     "A manifest or op schema file could not be parsed as JSON (or read at all). The message gives "
     "file:line:col of the first error; the plugin is skipped. The same code reports a "
     "KDISPATCH_PREFERENCE_FILE that is not JSON or cannot be read; it is then ignored whole. It also "
     "reports, as a warning, a conformance verdict file (beside the registry cache) that cannot be read, "
     "does not parse or is larger than 4 MiB: its verdicts are ignored and the file is rewritten at the "
     "next verdict."sv,
     "- A trailing comma, missing comma or unbalanced bracket\n"
     "- Comments (JSON has none) or single-quoted strings\n"
     "- A truncated or empty file, or a non-manifest *.json in a plugin directory"sv,
     "- Open the file at the reported line:col and fix the syntax\n"
     "- Check it: `kdispatch validate FILE` (or `python3 -m json.tool FILE`)\n"
     "- Move unrelated *.json files out of plugin directories"sv},

    {ErrorCode::manifest_bad_field,
     "Manifest field is missing or invalid"sv,
     "A manifest, op schema or KDISPATCH_PREFERENCE_FILE is valid JSON but a field is missing, has "
     "the wrong type or an invalid value. The message gives the JSON pointer, what was "
     "expected and what was found. A preference file with such a field is ignored whole."sv,
     "- A required key is missing: kdispatch_manifest, plugin, backend, library, abi, kernels\n"
     "- A name breaks the rules: plugin/backend must match [a-z0-9_]+, op ids \"<group>.<name>\"\n"
     "- An unknown dtype (valid: float32, float16, bfloat16, float64, int32, int64, uint8, bool, "
     "float8_e4m3fn, float8_e5m2)\n"
     "- A bad target: device not cpu/cuda/hip, arch not \"major.minor\", min_arch > max_arch\n"
     "- sha256 not 64 hex digits, or a bad shape token in an op schema\n"
     "- A kernel's constraint does not parse, or names what is not a shape symbol, dtype variable or "
     "int/bool attribute of the op's schema\n"
     "- A kernel's priority is not an integer in [-1000, 1000]\n"
     "- A preference file's op id or backend name breaks the rules, or a preference is not a non-empty "
     "list of backend names"sv,
     "- Go to the JSON pointer in the message (e.g. /kernels/2/dtypes/0) and fix the value\n"
     "- Run `kdispatch validate FILE` until it reports no problem\n"
     "- Compare with the shipped manifests (manifests/*.json)"sv},

    {ErrorCode::manifest_bad_library_path,
     "Library path unsafe or missing"sv,
     "The manifest's \"library\" must be a plain file name of a file next to the "
     "manifest. The value escapes the manifest's directory or the file does not "
     "exist, so the plugin is not loaded."sv,
     "- \"library\" contains '/' or '..', or is an absolute path\n"
     "- The library is a symlink that points outside the manifest's directory\n"
     "- The .so was not built, not installed, or installed to another directory than the manifest\n"
     "- The file name in the manifest does not match the built file (e.g. a version suffix)"sv,
     "- Set \"library\" to the bare file name, e.g. \"libkdispatch-cuda.so\"\n"
     "- Put the .so in the same directory as the manifest (replace escaping symlinks with the file)\n"
     "- Check with `ls -l DIR` and `kdispatch validate FILE`\n"
     "- Rebuild / reinstall the plugin so both files land in the same plugin directory"sv},

    {ErrorCode::manifest_bad_version,
     "Unsupported manifest format version"sv,
     "The manifest's \"kdispatch_manifest\" version has a major this kdispatch does "
     "not know, so it is refused. (A newer minor of a known major loads with a "
     "warning.)"sv,
     "- The plugin was built for a newer kdispatch than the one installed\n"
     "- The version is malformed (it must be \"major.minor\", e.g. \"1.0\")"sv,
     "- Upgrade kdispatch to a version that reads this manifest format\n"
     "- Or install a plugin release built for your kdispatch version\n"
     "- Fix a malformed value and check with `kdispatch validate FILE`"sv},

    {ErrorCode::op_unchecked,
     "Manifests and op schemas leave an op unchecked"sv,
     "A warning of `kdispatch validate` and `kdispatch doctor`: each file is valid, but "
     "together they leave part of an op that no check can reach, so `kdispatch run` and "
     "the conformance suite would pass it without comparing anything. The message names "
     "the file, the JSON pointer of the field and the op."sv,
     "- A kernel's op id has a typo: no op schema has that id (the message suggests the closest one)\n"
     "- A kernel lists a dtype the op's schema does not take: no call ever selects the kernel in it\n"
     "- A dtype of the op's schema is left out of every backend kernel's \"dtypes\": it is never run\n"
     "- An op schema marks no tensor \"written\" or \"inplace\": there is no output to compare\n"
     "- A reference kernel's op id has a typo, or no other plugin implements its op: it checks nothing\n"
     "- The reference plugin's manifest lacks \"role\": \"reference\": the op has no reference and every "
     "result is unchecked"sv,
     "- Go to the JSON pointer in the message and fix the op id, \"dtypes\" or \"written\"\n"
     "- Give the op a reference: a plugin whose manifest says \"role\": \"reference\" (docs/plugins.md)\n"
     "- Run `kdispatch validate FILE...` with the plugin's and its reference's manifests until it warns no more\n"
     "- Then `kdispatch run OP --add-plugin-path DIR`: it exits 0 only when every result was checked"sv},

    // ---------------------------------------------------------- plugin binaries
    {ErrorCode::plugin_open_failed,
     "Plugin library could not be opened"sv,
     "dlopen of the plugin library failed. The message classifies the failure (not "
     "found, wrong architecture, missing dependency, undefined symbol) and includes "
     "the loader's text."sv,
     "- Not found: the file disappeared or is not readable\n"
     "- Wrong architecture: built for another CPU architecture (wrong ELF class/machine)\n"
     "- Missing dependency: a vendor runtime such as libcudart.so.13 or libamdhip64.so is not installed or not on the loader path\n"
     "- Undefined symbol: built against a different version of a dependency"sv,
     "- List missing dependencies: `ldd FILE.so` (look for \"not found\") and `readelf -d FILE.so` (NEEDED)\n"
     "- Install the runtime it needs (CUDA/ROCm toolkit or runtime), or add its directory to LD_LIBRARY_PATH / ldconfig\n"
     "- Check the architecture: `file FILE.so` or `readelf -h FILE.so`; rebuild for this machine\n"
     "- Check the plugin without loading it: `kdispatch inspect FILE.so`\n"
     "- If you do not need this backend, disable it: KDISPATCH_PLUGINS_DISABLE=name"sv},

    {ErrorCode::plugin_no_entry,
     "Plugin entry symbol missing"sv,
     "The library opened but does not export kdispatch_plugin_api, or the function "
     "returned NULL, so it is not a usable kdispatch plugin."sv,
     "- The library is not a kdispatch plugin (wrong file named in \"library\")\n"
     "- The entry function was not exported: hidden visibility without the export macro, or C++ name mangling (missing extern \"C\")\n"
     "- The symbols were stripped or a linker version script dropped the symbol\n"
     "- The plugin's entry function failed its own initialisation and returned NULL"sv,
     "- Check the export: `nm -D --defined-only FILE.so | grep kdispatch_plugin_api`\n"
     "- Build the plugin with the kdispatch_add_plugin() CMake helper, which exports the entry symbol\n"
     "- Inspect it: `kdispatch inspect FILE.so`; rerun with KDISPATCH_LOG=debug"sv},

    {ErrorCode::plugin_abi_mismatch,
     "Plugin ABI mismatch"sv,
     "The plugin's ABI major differs from the host's, or its struct_size is too "
     "small to hold the fields the host reads. The plugin is refused; any minor of "
     "the same major is otherwise accepted."sv,
     "- The plugin was built against an older or newer major of plugin_api.h\n"
     "- The plugin set struct_size by hand or to a wrong value\n"
     "- Stale plugin binaries left from a previous install"sv,
     "- Rebuild the plugin against this kdispatch's plugin_api.h\n"
     "- Compare versions: `kdispatch inspect FILE.so` and `kdispatch doctor`\n"
     "- Set struct_size = sizeof(kd_plugin_api) in the plugin's table\n"
     "- Remove stale plugins from the search path (check KDISPATCH_PLUGIN_PATH / KDISPATCH_ADD_PLUGIN_PATH)"sv},

    {ErrorCode::plugin_manifest_mismatch,
     "Manifest and plugin binary disagree"sv,
     "The manifest compiled into the library differs from the manifest file beside "
     "it (plugin, backend or kernels), or a kernel symbol the manifest declares is "
     "not found in the library."sv,
     "- The manifest file was edited after the plugin was built\n"
     "- The .so and the .json come from different builds or versions\n"
     "- A kernel was renamed or removed in the source but not in the manifest\n"
     "- find_kernel(symbol) does not handle a declared symbol"sv,
     "- See the difference: `kdispatch inspect FILE.so` (file vs embedded manifest)\n"
     "- Rebuild the plugin so the embedded manifest matches, and install .so and .json together\n"
     "- Make every \"symbol\" in \"kernels\" resolvable by find_kernel\n"
     "- Check the file: `kdispatch validate FILE`"sv},

    {ErrorCode::plugin_probe_failed,
     "Plugin device probe failed"sv,
     "The plugin's probe function returned an error instead of a device list. (Zero "
     "devices, e.g. no driver, is not an error.)"sv,
     "- The device runtime failed to initialise (driver/runtime version mismatch, broken install)\n"
     "- Device access denied (permissions on /dev/nvidia* or /dev/kfd, container without GPUs)\n"
     "- A bug in the plugin's probe (wrong struct_size handling, too small capacity)"sv,
     "- Run `kdispatch doctor` and rerun with KDISPATCH_LOG=debug for the probe's message\n"
     "- Check the driver: `nvidia-smi` (CUDA) or `rocminfo` / `rocm-smi` (HIP)\n"
     "- Check device permissions (user in the video/render group; GPUs passed to the container)\n"
     "- If the backend is not needed here, disable it: KDISPATCH_PLUGINS_DISABLE=name"sv},

    {ErrorCode::plugin_insecure,
     "Plugin in an insecure location"sv,
     "Loading a library runs its code, so the loader refuses a plugin library, "
     "manifest or KDISPATCH_SCANNER program that is group- or world-writable or "
     "owned by another non-root user, and one under a directory (any from its own "
     "up to /) that is group- or world-writable (unless sticky and owned by root, "
     "as /tmp) or owned by another non-root user. It also reports, as a warning, a conformance verdict "
     "file (beside the registry cache) owned by another user or writable by its group or others: its "
     "verdicts are ignored."sv,
     "- The plugin directory or .so is world- or group-writable (e.g. chmod 777 or 775, a umask of 002)\n"
     "- A directory above the plugin is writable by others (a shared folder)\n"
     "- The files belong to another (non-root) user\n"
     "- A plugin directory on a shared or permissive mount"sv,
     "- Remove write permission for group and others: `chmod go-w DIR DIR/FILE.so`\n"
     "- Fix ownership: `chown $USER DIR DIR/FILE.so` (or root)\n"
     "- Or move the plugin into a directory you own and point at it with --plugin-path DIR / KDISPATCH_ADD_PLUGIN_PATH\n"
     "- Check with `ls -ld DIR DIR/FILE.so`"sv},

    {ErrorCode::plugin_checksum_mismatch,
     "Plugin checksum mismatch"sv,
     "The manifest gives a sha256 and the library file's hash differs, so the "
     "plugin is not loaded."sv,
     "- The library was rebuilt or replaced without updating the manifest's sha256\n"
     "- The file was corrupted or tampered with\n"
     "- The .so and the .json come from different releases"sv,
     "- Compute the hash: `sha256sum FILE.so` and compare with \"sha256\" in the manifest\n"
     "- If you built it yourself, update \"sha256\" (or remove the field) and run `kdispatch validate FILE`\n"
     "- Otherwise reinstall the plugin from a trusted source; do not just edit the hash"sv},

    // -------------------------------------------------------------------- calls
    {ErrorCode::plugin_scan_failed,
     "Plugin crashed, hung, exited or printed when the scanner opened it"sv,
     "Before a plugin library is opened in a process for the first time, a helper process "
     "(kdispatch-plugin-scanner) opens it, calls its entry and probe and reports back. This "
     "plugin's code killed or stalled the helper, ended it, or printed to stdout, so it is not "
     "opened in-process: it would have done the same to your program. The outcome is kept in "
     "the registry cache under $XDG_CACHE_HOME/kdispatch/ until the library or manifest changes."sv,
     "- A constructor or the entry function of the plugin dereferences a bad pointer or aborts\n"
     "- The plugin calls exit() or loops while it is loaded (waiting for a device, a lock, input)\n"
     "- The plugin prints to stdout when loaded\n"
     "- The library file is damaged"sv,
     "- Run `kdispatch scan` to see every plugin's outcome; KDISPATCH_LOG=debug shows each scan\n"
     "- Fix or remove the plugin; rebuilding it changes the file and it is scanned again\n"
     "- A slow but healthy probe: raise KDISPATCH_SCAN_TIMEOUT (seconds, default 10)\n"
     "- KDISPATCH_SCAN=always rescans every time; KDISPATCH_SCAN=off opens plugins in-process without a scan"sv},

    {ErrorCode::plugin_orphan_library,
     "Plugin library with no manifest"sv,
     "A warning of `kdispatch doctor`: a shared library (NAME.so) lies in a directory of "
     "the plugin search path, but no manifest there names it in \"library\". kdispatch "
     "reads manifests, never guesses: the library is never loaded and its kernels are "
     "never registered."sv,
     "- The plugin's manifest was not installed or copied beside the library\n"
     "- The manifest names another file (a typo, or a version suffix)\n"
     "- A leftover library of an old build or a renamed plugin"sv,
     "- Put the plugin's manifest (NAME.json) beside the library, or fix its \"library\"\n"
     "- Remove a leftover library from the plugin directory\n"
     "- Check with `kdispatch doctor` and `kdispatch inspect FILE.so`"sv},

    {ErrorCode::bad_arguments,
     "Call arguments do not match the op schema"sv,
     "The tensors or attributes of a call do not fit the op's schema. The message "
     "names the argument, what was expected and what was given; the kernel was not "
     "called."sv,
     "- Wrong number of tensors, or not in schema order\n"
     "- Dtypes that differ where the schema binds one dtype variable (e.g. x float16, weight float32)\n"
     "- A dtype the schema does not list for the argument (e.g. a float8_e4m3fn tensor where only float32, "
     "float16 and bfloat16 are allowed), or one kdispatch does not handle (e.g. a DLPack 1.1 float8 other "
     "than e4m3fn and e5m2)\n"
     "- A shape that breaks the pattern (e.g. weight [H] must match the last dim of x; out of [*, 2*D] input must be [*, D])\n"
     "- A tensor given flattened whose last dim the attribute it is split by does not divide (rotary's query "
     "[T, H*D] with a head_size that does not divide H*D), a negative head_size, or a [*, H, D] tensor whose D "
     "is not the head_size given\n"
     "- Tensors on different devices, or a null data pointer\n"
     "- A non-contiguous tensor where the schema does not allow strides\n"
     "- A written tensor sharing memory with another argument (an output over an input, query passed as key)\n"
     "- From Python: a torch output with its negative bit set, or a tensor that requires grad (no op has a backward)\n"
     "- A missing or mistyped attribute, or the op has no schema yet"sv,
     "- Compare the call with the op's schema (manifests/ops/<group>.json; `kdispatch list` shows ops)\n"
     "- Cast to one dtype, make tensors contiguous, and put all tensors on one device\n"
     "- Give each written tensor memory of its own\n"
     "- Try the op with generated inputs: `kdispatch run OP --device D`\n"
     "- For a third-party op, ship its schema in the manifest's \"ops\" and check it with `kdispatch validate FILE`"sv},

    {ErrorCode::dtype_not_supported,
     "Dtype not supported by the backend"sv,
     "The named backend implements the op but not for the dtype of the call."sv,
     "- The backend's manifest lists fewer dtypes than the op's schema allows (e.g. no bfloat16)\n"
     "- The device's arch lacks the type (e.g. bfloat16 on older GPUs)"sv,
     "- See supported dtypes: `kdispatch list --device D` or `kdispatch inspect FILE.so`\n"
     "- Cast the inputs to a supported dtype\n"
     "- Or use another backend: drop backend=..., or `kdispatch select OP --backend B --device D` to check one"sv},

    {ErrorCode::kernel_failed,
     "Kernel reported a failure"sv,
     "The selected kernel ran and returned an error status. The message is the "
     "plugin's own text. A kernel's 'unsupported' passes the call to the next ranked "
     "backend first; this error then lists every backend tried."sv,
     "- No eligible backend handles this shape, size or attribute value (unsupported case)\n"
     "- An internal error in the plugin (e.g. a caught exception)\n"
     "- A plugin bug"sv,
     "- Read the plugin's message; rerun with KDISPATCH_LOG=debug to see which plugin and symbol ran\n"
     "- Compare with the reference: KDISPATCH_FORCE_BACKEND=cpu, or `kdispatch run OP --backend cpu`\n"
     "- Check what was selected: `kdispatch select OP --backend B --device D`\n"
     "- Report it to the plugin's authors with `kdispatch run OP --save DIR` output\n"
     "- KDISPATCH_FALLBACK=1 demotes a backend whose kernel fails with an internal error and passes the call on"sv},

    {ErrorCode::device_error,
     "Device runtime error"sv,
     "The CUDA or HIP runtime reported an error during the call. The message gives "
     "the runtime's error name and text."sv,
     "- No driver, or a driver older than the plugin's runtime needs\n"
     "- Out of device memory\n"
     "- Illegal memory access: a data pointer that is not device memory, or an earlier kernel corrupted state\n"
     "- A kernel image not built for this GPU's arch"sv,
     "- Check the driver and GPU: `nvidia-smi` / `rocm-smi`; `kdispatch doctor`\n"
     "- Free device memory or use smaller inputs\n"
     "- Make sure tensors really live on the device passed in; rerun with CUDA_LAUNCH_BLOCKING=1 (or compute-sanitizer) to find the failing launch\n"
     "- Compare with the reference: KDISPATCH_FORCE_BACKEND=cpu\n"
     "- KDISPATCH_FALLBACK=1 demotes the failing backend for the op on that device and passes the call on"sv},

    // ---------------------------------------------------------------- output files
    {ErrorCode::file_not_writable,
     "A file kdispatch writes cannot be written"sv,
     "A file named for output (KDISPATCH_TRACE, the files of `run --save DIR`) is not a "
     "regular file, or creating, writing or renaming it failed. The message names the "
     "file and the cause. kdispatch never opens a FIFO or a device for writing: it "
     "would block or write somewhere unexpected."sv,
     "- The path names a FIFO, a device, a socket or a directory\n"
     "- The directory does not exist, is not writable, or is on a read-only file system\n"
     "- The disk is full or a quota is exceeded"sv,
     "- Point KDISPATCH_TRACE or --save at a regular file or directory you can write\n"
     "- Check free space: `df -h DIR`\n"
     "- Remove what is in the way (a directory or FIFO under the file's name)"sv},
};

constexpr bool sorted_and_unique() {
  for (std::size_t i = 1; i < std::size(kCatalogue); ++i) {
    if (static_cast<int>(kCatalogue[i - 1].code) >= static_cast<int>(kCatalogue[i].code)) return false;
  }
  return true;
}
static_assert(sorted_and_unique(), "catalogue entries must be in strictly increasing code order");

}  // namespace

std::span<const CatalogueEntry> error_catalogue() { return kCatalogue; }

const CatalogueEntry* find_catalogue_entry(ErrorCode code) {
  const auto* it = std::lower_bound(
      std::begin(kCatalogue), std::end(kCatalogue), code,
      [](const CatalogueEntry& e, ErrorCode c) { return static_cast<int>(e.code) < static_cast<int>(c); });
  if (it == std::end(kCatalogue) || it->code != code) return nullptr;
  return it;
}

}  // namespace kdispatch
