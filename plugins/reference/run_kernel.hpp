// The exception wall every reference kernel runs its body in: nothing C++
// crosses the ABI, and bad input comes back as a status with its message.
#pragma once

#include <kdispatch/plugin_api.h>

#include <exception>
#include <new>
#include <stdexcept>

#include "kd_plugin.hpp"

namespace kdispatch::reference {

// Runs `body`; std::invalid_argument becomes KD_STATUS_INVALID_ARGUMENT, any
// other exception KD_STATUS_INTERNAL, each with its message.
template <class Body>
kd_status run_kernel(const kd_call_args* args, Body&& body) noexcept {
  if (args == nullptr) return KD_STATUS_INVALID_ARGUMENT;
  try {
    body();
    return KD_STATUS_OK;
  } catch (const std::invalid_argument& e) {
    return kd_plugin::fail(args, KD_STATUS_INVALID_ARGUMENT, "%s", e.what());
  } catch (const std::bad_alloc&) {
    return kd_plugin::fail(args, KD_STATUS_INTERNAL, "out of host memory");
  } catch (const std::exception& e) {
    return kd_plugin::fail(args, KD_STATUS_INTERNAL, "%s", e.what());
  } catch (...) {
    return kd_plugin::fail(args, KD_STATUS_INTERNAL, "unknown exception");
  }
}

}  // namespace kdispatch::reference
