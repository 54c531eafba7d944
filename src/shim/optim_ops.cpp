// The scalar-weighted tensor ops torch.optim's single-tensor updates are written with, which
// tch's generated API only has without their `alpha` / `value` argument: `add(other, alpha)`,
// `addcmul(t1, t2, value)` and `addcdiv(t1, t2, value)`, in place and out of place. libtorch
// computes `self + alpha * other` (and the addc* forms) in one kernel with one rounding; a
// multiply followed by an add rounds twice and does not give torch's bits.
#include "amp_shim.h"

#include <ATen/ATen.h>

extern "C" {

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
