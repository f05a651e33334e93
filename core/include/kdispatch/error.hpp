// Errors of the C++ API. Every error carries a stable code ("KD-E002") that
// `kdispatch explain` documents; see error_catalogue.hpp.
#pragma once

#include <kdispatch/export.h>

#include <stdexcept>
#include <string>
#include <string_view>
#include <vector>

namespace kdispatch KDISPATCH_API {

enum class ErrorCode : int {
  // selection
  unknown_op = 1,                 // KD-E001
  backend_not_registered = 2,     // KD-E002
  no_usable_backend = 3,          // KD-E003
  ambiguous_backend = 4,          // KD-E004
  conflicting_registration = 5,   // KD-E005
  backend_not_usable = 6,         // KD-E006
  // manifests
  manifest_bad_json = 10,         // KD-E010
  manifest_bad_field = 11,        // KD-E011
  manifest_bad_library_path = 12, // KD-E012
  manifest_bad_version = 13,      // KD-E013
  op_unchecked = 14,              // KD-E014 (a warning: files that together leave an op unchecked)
  // plugin binaries
  plugin_open_failed = 20,        // KD-E020
  plugin_no_entry = 21,           // KD-E021
  plugin_abi_mismatch = 22,       // KD-E022
  plugin_manifest_mismatch = 23,  // KD-E023
  plugin_probe_failed = 24,       // KD-E024
  plugin_insecure = 25,           // KD-E025
  plugin_checksum_mismatch = 26,  // KD-E026
  plugin_scan_failed = 27,        // KD-E027
  plugin_orphan_library = 28,     // KD-E028 (a warning: a library no manifest names)
  // calls
  bad_arguments = 30,             // KD-E030
  dtype_not_supported = 31,       // KD-E031
  kernel_failed = 40,             // KD-E040
  device_error = 41,              // KD-E041
  // files kdispatch writes
  file_not_writable = 50,         // KD-E050
};

// "KD-E002" for ErrorCode::backend_not_registered.
std::string code_string(ErrorCode code);
// Parses "KD-E002" (also "E002", "kd-e2", "2"); false when not a known code.
bool parse_code(std::string_view text, ErrorCode* out);

// Base of every exception the C++ API throws.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, std::string message, std::vector<std::string> hints = {});
  ErrorCode code() const noexcept { return code_; }
  std::string code_string() const { return kdispatch::code_string(code_); }
  // The message without the code; what() is the same text.
  const std::string& message() const noexcept { return message_; }
  // Extra lines: did-you-mean, why a plugin did not load, how to fix.
  const std::vector<std::string>& hints() const noexcept { return hints_; }

 private:
  ErrorCode code_;
  std::string message_;
  std::vector<std::string> hints_;
};

// KD-E001..E006: no kernel could be chosen for a call.
class SelectionError : public Error {
 public:
  using Error::Error;
};
// KD-E005: a conflicting registration (also thrown by the registry).
class RegistrationError : public Error {
 public:
  using Error::Error;
};
// KD-E010..E013: a manifest or op schema is invalid.
class ManifestError : public Error {
 public:
  using Error::Error;
};
// KD-E020..E026: a plugin binary could not be used.
class PluginError : public Error {
 public:
  using Error::Error;
};
// KD-E030..E031: the arguments of a call do not fit the op.
class CallError : public Error {
 public:
  using Error::Error;
};
// KD-E040..E041: the kernel or the device runtime failed.
class KernelError : public Error {
 public:
  using Error::Error;
};

// One problem found while discovering, parsing or loading: kept, reported
// (doctor, KD-E001/E002/E003 messages), never fatal for the other plugins.
struct Problem {
  ErrorCode code;
  std::string file;     // manifest or library path; may be empty
  std::string message;  // names the field or cause
  bool warning = false;  // reported, but stops nothing (an unknown key, a newer minor format)
};

}  // namespace kdispatch
