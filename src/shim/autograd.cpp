// A custom autograd function whose backward runs Rust code (bound in src/sys/autograd.rs).
// tch has no `torch.autograd.Function`: the Rust side computes the forward itself, under
// no_grad, and hands the outputs, the tensors its backward needs and a callback here; this
// records one node (libtorch's C++ `torch::autograd::Function`) from the inputs to the outputs.
// The tensors to save go through `save_for_backward`, so libtorch checks that nothing modified
// them in place before the backward, as it does for its own ops.
#include "amp_shim.h"

#include <torch/csrc/autograd/custom_function.h>

#include <string>
#include <utility>
#include <vector>

extern "C" {
// The Rust backward: takes ownership of the handles in `grads` (NULL for an undefined gradient)
// and `saved`; writes one owned handle or NULL per forward input into `out`. Returns NULL or an
// error message that stays valid until the next call or the drop.
typedef const char* (*tch_amp_backward_fn)(void* state, at::Tensor** grads, int n_grads,
                                           at::Tensor** saved, int n_saved, const int* needs,
                                           at::Tensor** out, int n_inputs);
// Frees the Rust state (called once, when the node is destroyed).
typedef void (*tch_amp_drop_fn)(void* state);
}

namespace {

// The Rust state and callbacks; destroying it (with the node) frees the Rust state.
struct RustBackward : torch::CustomClassHolder {
  RustBackward(void* s, tch_amp_backward_fn b, tch_amp_drop_fn d) : state(s), backward(b), drop(d) {}
  ~RustBackward() override { drop(state); }
  void* state;
  tch_amp_backward_fn backward;
  tch_amp_drop_fn drop;
  std::vector<at::Tensor> outputs;
  std::vector<at::Tensor> saved;
};

at::Tensor* owned(const at::Tensor& t) { return t.defined() ? new at::Tensor(t) : nullptr; }

struct RustFunction : public torch::autograd::Function<RustFunction> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                at::TensorList inputs,
                                                c10::intrusive_ptr<RustBackward> rust) {
    ctx->save_for_backward(rust->saved);
    rust->saved.clear();
    ctx->saved_data["n_inputs"] = static_cast<int64_t>(inputs.size());
    auto outputs = std::move(rust->outputs);
    ctx->saved_data["rust"] = c10::IValue::make_capsule(std::move(rust));
    return outputs;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto rust = c10::static_intrusive_pointer_cast<RustBackward>(ctx->saved_data["rust"].toCapsule());
    const auto n_inputs = static_cast<size_t>(ctx->saved_data["n_inputs"].toInt());
    auto saved = ctx->get_saved_variables();
    std::vector<at::Tensor*> g, s;
    for (const auto& t : grads) g.push_back(owned(t));
    for (const auto& t : saved) s.push_back(owned(t));
    std::vector<int> needs(n_inputs);
    for (size_t i = 0; i < n_inputs; ++i) needs[i] = ctx->needs_input_grad(i) ? 1 : 0;
    std::vector<at::Tensor*> out(n_inputs, nullptr);
    const char* err = rust->backward(rust->state, g.data(), static_cast<int>(g.size()), s.data(),
                                     static_cast<int>(s.size()), needs.data(), out.data(),
                                     static_cast<int>(n_inputs));
    torch::autograd::variable_list result;
    for (auto* p : out) {
      if (p == nullptr) {
        result.emplace_back();
      } else {
        result.push_back(std::move(*p));
        delete p;
      }
    }
    if (err != nullptr) {
      std::string message(err);
      TORCH_CHECK(false, message);
    }
    result.emplace_back();  // the Rust state argument
    return result;
  }
};

}  // namespace

extern "C" {

// Records the node: `outputs` (computed by the caller) come back in `out` (n_outputs new
// handles) with a grad_fn that leads to `inputs` when grad mode is on and an input requires
// grad. The node owns `state` from the start: `drop` frees it, also on error.
char* tch_amp_custom_function(at::Tensor** inputs, int n_inputs, at::Tensor** outputs, int n_outputs,
                              at::Tensor** saved, int n_saved, void* state,
                              tch_amp_backward_fn backward, tch_amp_drop_fn drop, at::Tensor** out) {
  auto rust = c10::make_intrusive<RustBackward>(state, backward, drop);
  TCH_AMP_PROTECT({
    std::vector<at::Tensor> in;
    for (int i = 0; i < n_inputs; ++i) in.push_back(*inputs[i]);
    for (int i = 0; i < n_outputs; ++i) rust->outputs.push_back(*outputs[i]);
    for (int i = 0; i < n_saved; ++i) rust->saved.push_back(*saved[i]);
    auto result = RustFunction::apply(at::TensorList(in), std::move(rust));
    TORCH_CHECK(static_cast<int>(result.size()) == n_outputs, "custom function: ", result.size(),
                " outputs, expected ", n_outputs);
    for (int i = 0; i < n_outputs; ++i) out[i] = new at::Tensor(result[i]);
  })
}

}  // extern "C"
