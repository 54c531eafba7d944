// Gradient plumbing used by scale_loss and clipping (bound in src/sys/grads.rs). Tensors cross
// as `at::Tensor*` (tch's C_tensor).
#include "amp_shim.h"

#include <ATen/ATen.h>

#include <vector>

namespace {

// libtorch's CUDA kernels of _amp_foreach_non_finite_check_and_unscale_ take fp32, fp16 and
// fp64 only: bf16 CUDA gradients go through an fp32 copy (exact), unscaled there and rounded
// back once, the bits libtorch's CPU kernel gives (it computes in fp32 and rounds once).
void non_finite_check_and_unscale(const std::vector<at::Tensor>& grads, at::Tensor& found_inf,
                                  const at::Tensor& inv_scale) {
  std::vector<at::Tensor> direct, bf16, widened;
  for (const auto& g : grads) {
    if (g.is_cuda() && g.scalar_type() == at::kBFloat16) {
      bf16.push_back(g);
      widened.push_back(g.to(at::kFloat));
    } else {
      direct.push_back(g);
    }
  }
  if (!direct.empty()) at::_amp_foreach_non_finite_check_and_unscale_(direct, found_inf, inv_scale);
  if (!widened.empty()) {
    at::_amp_foreach_non_finite_check_and_unscale_(widened, found_inf, inv_scale);
    for (size_t i = 0; i < bf16.size(); ++i) bf16[i].copy_(widened[i]);
  }
}

}  // namespace

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

// `tensor.backward(retain_graph=keep_graph)`: accumulates into the leaves' `.grad` as torch's
// `Tensor.backward` does; with keep_graph the graph survives for another backward (tch's
// `Tensor::backward` always frees it).
char* tch_amp_backward(at::Tensor* tensor, int keep_graph) {
  TCH_AMP_PROTECT(tensor->backward({}, keep_graph != 0, false))
}

// In place: every tensor in `grads` is multiplied by `inv_scale` (a 1-element fp32 tensor)
// and `found_inf` (a 1-element fp32 tensor) becomes 1 when any element of any grad is inf or
// NaN. One fused pass per dtype group (libtorch's _amp_foreach_non_finite_check_and_unscale_;
// bf16 on CUDA through an fp32 copy); no host sync.
char* tch_amp_unscale_(at::Tensor** grads, int n, at::Tensor* found_inf, at::Tensor* inv_scale) {
  TCH_AMP_PROTECT({
    std::vector<at::Tensor> list;
    list.reserve(n);
    for (int i = 0; i < n; ++i) list.push_back(*grads[i]);
    if (!list.empty()) non_finite_check_and_unscale(list, *found_inf, *inv_scale);
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

// *out = torch.linalg.vector_norm(tensor, ord, dtype=torch.float32): one tensor's norm in fp32 as
// a new 0-dim tensor (Apex's LAMB and NovoGrad take per-tensor norms).
char* tch_amp_vector_norm(at::Tensor* tensor, double ord, at::Tensor** out) {
  TCH_AMP_PROTECT(*out = new at::Tensor(at::linalg_vector_norm(*tensor, ord, {}, false, at::kFloat)))
}

}  // extern "C"
