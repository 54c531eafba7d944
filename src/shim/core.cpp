// The foundation of the shim: the error channel, autocast state per device type, dispatcher
// schema look-ups and a tensor's storage offset (bound in src/sys/mod.rs and
// src/sys/autocast.rs).
#include "amp_shim.h"

#include <ATen/ATen.h>
#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>

extern "C" {

void tch_amp_free_error(char* err) { free(err); }

// Reads autocast's enabled flag and low-precision dtype for a device type (c10::DeviceType).
char* tch_amp_autocast_get(int device_type, int* enabled, int* dtype) {
  TCH_AMP_PROTECT({
    auto dev = static_cast<c10::DeviceType>(device_type);
    *enabled = at::autocast::is_autocast_enabled(dev) ? 1 : 0;
    *dtype = static_cast<int>(at::autocast::get_autocast_dtype(dev));
  })
}

// Sets both; the previous values come back through prev_enabled / prev_dtype.
char* tch_amp_autocast_set(int device_type, int enabled, int dtype, int* prev_enabled,
                           int* prev_dtype) {
  TCH_AMP_PROTECT({
    auto dev = static_cast<c10::DeviceType>(device_type);
    TORCH_CHECK(at::autocast::is_autocast_available(dev), "autocast is not available for device type ",
                c10::DeviceTypeName(dev));
    auto st = static_cast<c10::ScalarType>(dtype);
    TORCH_CHECK(st == at::kHalf || st == at::kBFloat16 || st == at::kFloat,
                "autocast dtype must be Half, BFloat16 or Float, got ", st);
    *prev_enabled = at::autocast::is_autocast_enabled(dev) ? 1 : 0;
    *prev_dtype = static_cast<int>(at::autocast::get_autocast_dtype(dev));
    at::autocast::set_autocast_dtype(dev, st);
    at::autocast::set_autocast_enabled(dev, enabled != 0);
  })
}

// Reads autocast's weight-cast-cache flag (thread-local) into *prev and, when `set`, sets it to
// `value` (torch.set_autocast_cache_enabled).
char* tch_amp_autocast_cache_enabled(int set, int value, int* prev) {
  TCH_AMP_PROTECT({
    *prev = at::autocast::is_autocast_cache_enabled() ? 1 : 0;
    if (set) at::autocast::set_autocast_cache_enabled(value != 0);
  })
}

// Autocast's nesting counter (thread-local): +1 when delta > 0, else -1; the new count in *out
// (torch.autocast_increment_nesting / autocast_decrement_nesting).
char* tch_amp_autocast_nesting(int delta, int* out) {
  TCH_AMP_PROTECT({ *out = delta > 0 ? at::autocast::increment_nesting() : at::autocast::decrement_nesting(); })
}

// libtorch's TF32 switches for CUDA matmuls and cuDNN convolutions.
char* tch_amp_set_allow_tf32(int on) {
  TCH_AMP_PROTECT({
    at::globalContext().setAllowTF32CuBLAS(on != 0);
    at::globalContext().setAllowTF32CuDNN(on != 0);
  })
}

// Empties libtorch's autocast weight-cast cache (thread-local).
char* tch_amp_autocast_clear_cache() { TCH_AMP_PROTECT(at::autocast::clear_cache()) }

// Checks that `aten::<name>` (with an overload, "" for the default) exists in the dispatcher;
// the C++ error for an unknown op is handed back as the message.
char* tch_amp_find_schema(const char* name, const char* overload) {
  TCH_AMP_PROTECT({
    std::string full = std::string("aten::") + name;
    c10::Dispatcher::singleton().findSchemaOrThrow(full.c_str(), overload);
  })
}

// The offset of a tensor's first element in its storage, in elements (tch 0.24, the tch of
// libtorch 2.11 that scripts/gpu-bundle.sh builds with, has no binding for it).
char* tch_amp_storage_offset(const at::Tensor* t, int64_t* out) {
  TCH_AMP_PROTECT(*out = t->storage_offset())
}

}  // extern "C"
