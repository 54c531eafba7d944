// libtorch's fused Adam/AdamW kernels (bound in src/sys/optim.rs).
#include "amp_shim.h"

#include <ATen/ATen.h>

#include <vector>

extern "C" {

// One fused Adam (adamw = 0) or AdamW (adamw = 1) update of n fp32 parameters with
// libtorch's multi-tensor kernel (what torch.optim.Adam(fused=True) runs): params, grads,
// exp_avgs, exp_avg_sqs and (amsgrad) max_exp_avg_sqs are updated in place; steps are 0-dim
// fp32 tensors holding each parameter's step count after this update; maximize as torch's.
char* tch_amp_fused_adam_(at::Tensor** params, at::Tensor** grads, at::Tensor** exp_avgs,
                          at::Tensor** exp_avg_sqs, at::Tensor** max_exp_avg_sqs, at::Tensor** steps,
                          int n, const tch_amp_adam_scalars* h) {
  TCH_AMP_PROTECT({
    auto list = [n](at::Tensor** ts) {
      std::vector<at::Tensor> v;
      if (ts == nullptr) return v;
      v.reserve(n);
      for (int i = 0; i < n; ++i) v.push_back(*ts[i]);
      return v;
    };
    auto p = list(params), g = list(grads), m = list(exp_avgs), v = list(exp_avg_sqs);
    auto mx = h->amsgrad ? list(max_exp_avg_sqs) : std::vector<at::Tensor>();
    auto s = list(steps);
    if (h->adamw) {
      at::_fused_adamw_(p, g, m, v, mx, s, h->lr, h->beta1, h->beta2, h->weight_decay, h->eps, h->amsgrad != 0,
                        h->maximize != 0);
    } else {
      at::_fused_adam_(p, g, m, v, mx, s, h->lr, h->beta1, h->beta2, h->weight_decay, h->eps, h->amsgrad != 0,
                       h->maximize != 0);
    }
  })
}

}  // extern "C"
