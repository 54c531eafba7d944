// Shared by the shim's translation units: the error channel. Every extern "C" function
// returns NULL on success or a heap-allocated message (freed by tch_amp_free_error) and
// never lets a C++ exception cross into Rust.
#pragma once
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>
#include <c10/util/Exception.h>

namespace tch_amp {
inline char* error_message(const std::string& msg) { return strdup(msg.c_str()); }
}  // namespace tch_amp

extern "C" {
// The scalar arguments of an Adam/AdamW update (optim.cpp; src/sys/optim.rs).
struct tch_amp_adam_scalars {
  double lr, beta1, beta2, weight_decay, eps;
  int amsgrad, adamw, maximize;
};
}

#define TCH_AMP_PROTECT(...)                                                \
  try {                                                                     \
    __VA_ARGS__;                                                            \
    return nullptr;                                                         \
  } catch (const c10::Error& e) {                                           \
    return tch_amp::error_message(e.what_without_backtrace());              \
  } catch (const std::exception& e) {                                       \
    return tch_amp::error_message(e.what());                                \
  } catch (...) {                                                           \
    return tch_amp::error_message("unknown C++ exception in tch-amp shim"); \
  }
