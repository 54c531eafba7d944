// The scalar-weighted tensor ops torch.optim's single-tensor updates are written with, which
// tch's generated API only has without their `alpha` / `value` argument: `add(other, alpha)`,
// `addcmul(t1, t2, value)` and `addcdiv(t1, t2, value)`, in place and out of place. libtorch
// computes `self + alpha * other` (and the addc* forms) in one kernel with one rounding; a
// multiply followed by an add rounds twice and does not give torch's bits.
#include "amp_shim.h"

#include <ATen/ATen.h>

namespace {
// A Python float as torch's argument parser passes it for a Tensor parameter: a 0-dim double
// tensor marked as a wrapped number. `t.mul_(0.9)` in Python runs mul_.Tensor with this, which
// keeps 0.9 in full precision into the kernel's fp32 math; the Scalar overload (tch's
// mul_scalar_) rounds 0.9 to an fp16 tensor's dtype first, so fp16 results differ.
at::Tensor python_float(double v) {
  at::Tensor t = at::scalar_tensor(v, at::TensorOptions().dtype(at::kDouble));
  t.unsafeGetTensorImpl()->set_wrapped_number(true);
  return t;
}
}  // namespace

extern "C" {

// self.mul_(value) with value a Python float.
char* tch_amp_optim_mul_float_(at::Tensor* self, double value) { TCH_AMP_PROTECT(self->mul_(python_float(value))) }

// self.add_(value) with value a Python float.
char* tch_amp_optim_add_float_(at::Tensor* self, double value) { TCH_AMP_PROTECT(self->add_(python_float(value))) }

// *out = self / value with value a Python float, a new tensor the caller owns.
char* tch_amp_optim_div_float(at::Tensor* self, double value, at::Tensor** out) {
  TCH_AMP_PROTECT(*out = new at::Tensor(self->div(python_float(value))))
}

// self.add_(other, alpha=alpha) in place.
char* tch_amp_optim_add_(at::Tensor* self, at::Tensor* other, double alpha) {
  TCH_AMP_PROTECT(self->add_(*other, alpha))
}

// *out = self.add(other, alpha=alpha), a new tensor the caller owns.
char* tch_amp_optim_add(at::Tensor* self, at::Tensor* other, double alpha, at::Tensor** out) {
  TCH_AMP_PROTECT(*out = new at::Tensor(self->add(*other, alpha)))
}

// self.addcmul_(t1, t2, value=value) in place.
char* tch_amp_optim_addcmul_(at::Tensor* self, at::Tensor* t1, at::Tensor* t2, double value) {
  TCH_AMP_PROTECT(self->addcmul_(*t1, *t2, value))
}

// *out = self.addcmul(t1, t2, value=value), a new tensor the caller owns.
char* tch_amp_optim_addcmul(at::Tensor* self, at::Tensor* t1, at::Tensor* t2, double value, at::Tensor** out) {
  TCH_AMP_PROTECT(*out = new at::Tensor(self->addcmul(*t1, *t2, value)))
}

// self.addcdiv_(t1, t2, value=value) in place.
char* tch_amp_optim_addcdiv_(at::Tensor* self, at::Tensor* t1, at::Tensor* t2, double value) {
  TCH_AMP_PROTECT(self->addcdiv_(*t1, *t2, value))
}

}  // extern "C"
