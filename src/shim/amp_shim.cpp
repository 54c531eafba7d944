// The foundation of the shim: the error channel, autocast state per device type, and
// dispatcher schema look-ups. Tensors cross as `at::Tensor*` (tch's C_tensor).
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

}  // extern "C"

// ---- Gradients and the fused unscale (used by scale_loss) --------------------------------

extern "C" {

// Sets `tensor.grad` to `grad` (a tensor pointer) or, when grad is NULL, to undefined (None).
char* tch_amp_set_grad(at::Tensor* tensor, at::Tensor* grad) {
  TCH_AMP_PROTECT({
    if (grad == nullptr) {
      tensor->mutable_grad() = at::Tensor();
    } else {
      tensor->mutable_grad() = *grad;
    }
  })
}

// In place: every tensor in `grads` is multiplied by `inv_scale` (a 1-element fp32 tensor)
// and `found_inf` (a 1-element fp32 tensor) becomes 1 when any element of any grad is inf or
// NaN. One fused pass per dtype group (libtorch's _amp_foreach_non_finite_check_and_unscale_);
// no host sync.
char* tch_amp_unscale_(at::Tensor** grads, int n, at::Tensor* found_inf, at::Tensor* inv_scale) {
  TCH_AMP_PROTECT({
    std::vector<at::Tensor> list;
    list.reserve(n);
    for (int i = 0; i < n; ++i) list.push_back(*grads[i]);
    if (!list.empty()) {
      at::_amp_foreach_non_finite_check_and_unscale_(list, *found_inf, *inv_scale);
    }
  })
}

// Total p-norm of `tensors` computed in fp32 (fp16/bf16 grads are upcast per tensor, never
// summed in half), written to *out as a new 0-dim fp32 tensor. norm_type = inf gives max |x|.
char* tch_amp_total_norm(at::Tensor** tensors, int n, double norm_type, at::Tensor** out) {
  TCH_AMP_PROTECT({
    std::vector<at::Tensor> norms;
    norms.reserve(n);
    for (int i = 0; i < n; ++i) {
      norms.push_back(at::linalg_vector_norm(*tensors[i], norm_type, {}, false, at::kFloat));
    }
    at::Tensor total;
    if (norms.empty()) {
      total = at::zeros({}, at::TensorOptions().dtype(at::kFloat));
    } else {
      total = at::linalg_vector_norm(at::stack(norms), norm_type, {}, false, at::kFloat);
    }
    *out = new at::Tensor(total);
  })
}

}  // extern "C"

// ---- Fused optimizer step ------------------------------------------------------------------

extern "C" {

// One fused Adam (adamw = 0) or AdamW (adamw = 1) update of n fp32 parameters with
// libtorch's multi-tensor kernel (what torch.optim.Adam(fused=True) runs): params, grads,
// exp_avgs, exp_avg_sqs and (amsgrad) max_exp_avg_sqs are updated in place; steps are 0-dim
// fp32 tensors holding each parameter's step count after this update; maximize as torch's.
char* tch_amp_fused_adam_(at::Tensor** params, at::Tensor** grads, at::Tensor** exp_avgs,
                          at::Tensor** exp_avg_sqs, at::Tensor** max_exp_avg_sqs, at::Tensor** steps,
                          int n, double lr, double beta1, double beta2, double weight_decay, double eps,
                          int amsgrad, int adamw, int maximize) {
  TCH_AMP_PROTECT({
    auto list = [n](at::Tensor** ts) {
      std::vector<at::Tensor> v;
      if (ts == nullptr) return v;
      v.reserve(n);
      for (int i = 0; i < n; ++i) v.push_back(*ts[i]);
      return v;
    };
    auto p = list(params), g = list(grads), m = list(exp_avgs), v = list(exp_avg_sqs);
    auto mx = amsgrad ? list(max_exp_avg_sqs) : std::vector<at::Tensor>();
    auto s = list(steps);
    if (adamw) {
      at::_fused_adamw_(p, g, m, v, mx, s, lr, beta1, beta2, weight_decay, eps, amsgrad != 0, maximize != 0);
    } else {
      at::_fused_adam_(p, g, m, v, mx, s, lr, beta1, beta2, weight_decay, eps, amsgrad != 0, maximize != 0);
    }
  })
}

}  // extern "C"
