// The boxed kernel tch-amp registers for one aten op overload at one Autocast key: it casts
// the op's arguments by the calling thread's policy (categories: low precision, fp32, promote,
// banned), applies Apex's in-place rules, and on CPU may emulate a low-precision GEMM or
// convolution in fp32. A refusal is a c10::Error; the calling thread keeps its code, op and
// message (`take_refusal`) for the Rust side's classify_torch_error (src/cast/error.rs).
#include "cast_policy.h"

#include <ATen/autocast_mode.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/graph_task.h>

#include <string>
#include <utility>

namespace tch_amp::cast {
namespace {

thread_local Refusal tls_refusal;
// Ops this thread ran through the CPU emulation, per 16-bit type: [0] fp16, [1] bf16.
thread_local uint64_t tls_emulated[2] = {0, 0};

// Records the refusal for this thread, then throws it as a c10::Error with `message`.
[[noreturn]] void refuse(RefusalCode code, const std::string& op, at::ScalarType dtype,
                         std::string message) {
  tls_refusal = Refusal{code, op, dtype, message};
  TORCH_CHECK(false, message);
}

// Applies `f` to every tensor among the last `n` stack entries (tensors, optional tensors,
// tensor lists and lists of optional tensors), replacing them with what `f` returns.
// `skip_first` leaves argument 0 alone (the self of an in-place op).
template <class F>
void map_tensor_args(torch::jit::Stack* stack, size_t n, bool skip_first, F&& f) {
  auto first = stack->end() - static_cast<std::ptrdiff_t>(n);
  for (size_t i = skip_first ? 1 : 0; i < n; ++i) {
    c10::IValue& v = first[static_cast<std::ptrdiff_t>(i)];
    if (v.isTensor()) {
      v = f(v.toTensor());
    } else if (v.isTensorList()) {
      auto in = v.toTensorList();
      c10::List<at::Tensor> out;
      out.reserve(in.size());
      for (const at::Tensor& t : in) out.push_back(f(t));
      v = std::move(out);
    } else if (v.isOptionalTensorList()) {
      auto in = v.toOptionalTensorList();
      c10::List<std::optional<at::Tensor>> out;
      out.reserve(in.size());
      for (const std::optional<at::Tensor>& t : in) {
        out.push_back(t.has_value() ? std::optional<at::Tensor>(f(*t)) : std::nullopt);
      }
      v = std::move(out);
    }
  }
}

// Calls `f` on every tensor among the last `n` stack entries without changing them.
template <class F>
void for_each_tensor_arg(const torch::jit::Stack* stack, size_t n, bool skip_first, F&& f) {
  auto first = stack->end() - static_cast<std::ptrdiff_t>(n);
  for (size_t i = skip_first ? 1 : 0; i < n; ++i) {
    const c10::IValue& v = first[static_cast<std::ptrdiff_t>(i)];
    if (v.isTensor()) {
      f(v.toTensor());
    } else if (v.isTensorList()) {
      for (const at::Tensor& t : v.toTensorList()) f(t);
    } else if (v.isOptionalTensorList()) {
      for (const std::optional<at::Tensor>& t : v.toOptionalTensorList()) {
        if (t.has_value()) f(*t);
      }
    }
  }
}

}  // namespace

// "name" or "name.overload", without the "aten::" namespace.
std::string op_display(const c10::OperatorName& name) {
  std::string base = name.name.rfind("aten::", 0) == 0 ? name.name.substr(6) : name.name;
  return name.overload_name.empty() ? base : base + "." + name.overload_name;
}

namespace {

// The boxed kernel registered for one op overload at one Autocast key.
class CastKernel final : public c10::OperatorKernel {
 public:
  CastKernel(size_t id, int dev, bool inplace, std::optional<c10::SafeKernelFunction> native)
      : id_(id), dev_(dev), inplace_(inplace), native_(std::move(native)) {}

  void operator()(const c10::OperatorHandle& op, c10::DispatchKeySet ks, torch::jit::Stack* stack) {
    const c10::DispatchKeySet below = ks - c10::autocast_dispatch_keyset;
    const Policy* policy = tls_policy.get();
    if (policy != nullptr && policy->torch_autocast && dev_ == kCpu && !inplace_ && policy->emulated(id_)) {
      run_torch_emulated(op, ks, below, stack, *policy);
      return;
    }
    if (policy == nullptr || policy->torch_autocast) {
      // No cast policy on this thread (none, or torch.amp's autocast and an op it does not
      // emulate): behave exactly as libtorch would.
      if (native_.has_value()) {
        native_->callBoxed(op, ks, stack);
      } else {
        op.redispatchBoxed(below, stack);  // what libtorch's fallthrough does
      }
      return;
    }
    if (torch::autograd::get_current_graph_task_id() != -1) {
      // A backward pass running on this thread (CPU backward runs on the caller's thread):
      // Apex's casts never touched backward, so its ops run uncast, in the dtypes autograd
      // hands them (the forward's casts already fixed those).
      c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
      op.redispatchBoxed(below, stack);
      return;
    }
    const Category cat = policy->category_of(id_, dev_);
    const bool emulate = dev_ == kCpu && !inplace_ && policy->emulated(id_);
    if (cat == Category::Passthrough && !emulate) {
      if (native_.has_value()) {
        // In libtorch's lists but not in this policy: run in the inputs' dtypes, as a
        // libtorch autocast kernel runs its op.
        run_below(op, below, stack, *policy);
      } else {
        op.redispatchBoxed(below, stack);  // registered for another policy: fall through
      }
      return;
    }
    const size_t nargs = op.schema().arguments().size();
    {
      c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
      if (inplace_) {
        apply_inplace_rule(op, cat, stack, nargs);
      } else {
        apply_category(op, cat, *policy, stack, nargs);
      }
      if (emulate) {
        run_emulated(op, below, stack, nargs, *policy);
        return;
      }
    }
    run_below(op, below, stack, *policy);
  }

 private:
  // Runs the op (its arguments already cast) below the Autocast keys. Without CPU emulation the
  // autocast keys are excluded inside it, as libtorch's autocast kernels do, so its internals
  // are not cast again. With CPU emulation on, a composite op (an LSTM cell, bilinear, einsum,
  // scaled_dot_product_attention, ...) runs instead under the policy's emulation-only twin:
  // its internals still get no casts, but their GEMMs and convolutions are emulated.
  void run_below(const c10::OperatorHandle& op, c10::DispatchKeySet below, torch::jit::Stack* stack,
                 const Policy& policy) const {
    if (dev_ == kCpu && policy.emulation_only) {
      op.redispatchBoxed(below, stack);  // the thread's policy already is emulation-only
    } else if (dev_ == kCpu && policy.inner) {
      std::shared_ptr<const Policy> outer = tls_policy;
      struct Restore {
        std::shared_ptr<const Policy>& slot;
        std::shared_ptr<const Policy> saved;
        ~Restore() { slot = std::move(saved); }
      } restore{tls_policy, std::move(outer)};
      tls_policy = policy.inner;
      op.redispatchBoxed(below, stack);
    } else {
      c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
      op.redispatchBoxed(below, stack);
    }
  }

  // An emulated op under torch.amp's autocast. An op of libtorch's CPU lists has its arguments
  // cast as libtorch's autocast kernel casts them (at::autocast::cached_cast, so libtorch's
  // weight cache and its cache_enabled flag apply), then is emulated. An op of no list is
  // emulated when its inputs already are one emulated 16-bit type, and otherwise gets exactly
  // what libtorch would do.
  void run_torch_emulated(const c10::OperatorHandle& op, c10::DispatchKeySet ks, c10::DispatchKeySet below,
                          torch::jit::Stack* stack, const Policy& policy) const {
    const size_t nargs = op.schema().arguments().size();
    const Category cat = policy.category_of(id_, kCpu);
    if (cat == Category::LowPrecision || cat == Category::Fp32) {
      c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
      const at::ScalarType to =
          cat == Category::Fp32 ? at::kFloat : at::autocast::get_autocast_dtype(c10::DeviceType::CPU);
      map_tensor_args(stack, nargs, false, [&](const at::Tensor& t) {
        return t.defined() ? at::autocast::cached_cast(to, t, c10::DeviceType::CPU) : t;
      });
      run_emulated(op, below, stack, nargs, policy);
      return;
    }
    const std::optional<at::ScalarType> low = uniform_low(stack, nargs);
    if (low.has_value() && policy.emulates(id_, *low)) {
      c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
      run_emulated(op, below, stack, nargs, policy);
    } else if (native_.has_value()) {
      native_->callBoxed(op, ks, stack);
    } else {
      op.redispatchBoxed(below, stack);
    }
  }

  // The 16-bit type every eligible floating input has, if they all have the same one.
  static std::optional<at::ScalarType> uniform_low(const torch::jit::Stack* stack, size_t nargs) {
    std::optional<at::ScalarType> low;
    bool uniform = true;
    for_each_tensor_arg(stack, nargs, false, [&](const at::Tensor& t) {
      if (!eligible(t, kCpu)) return;
      const auto s = t.scalar_type();
      if (!is_low(s) || (low.has_value() && *low != s)) uniform = false;
      low = s;
    });
    return uniform ? low : std::nullopt;
  }

  // Apex's in-place rules: an fp32-list op in place on a low-precision self is an error (the
  // result could not be kept in fp32); any other listed in-place op casts its other operands
  // to self's dtype.
  void apply_inplace_rule(const c10::OperatorHandle& op, Category cat, torch::jit::Stack* stack,
                          size_t nargs) const {
    if (cat == Category::Passthrough || nargs == 0) return;
    const c10::IValue& self = *(stack->end() - static_cast<std::ptrdiff_t>(nargs));
    if (!self.isTensor() || !eligible(self.toTensor(), dev_)) return;
    const at::ScalarType self_type = self.toTensor().scalar_type();
    if ((cat == Category::Fp32 || cat == Category::Banned) && is_low(self_type)) {
      const std::string name = op_display(op.operator_name());
      std::string base = name.substr(0, name.find('.'));
      if (!base.empty() && base.back() == '_') base.pop_back();
      refuse(RefusalCode::InPlaceFp32, name, self_type,
             c10::str(name, " runs in fp32 under O1 and cannot write in place into a ",
                      c10::toString(self_type), " tensor: call ", base, " out of place"));
    }
    const int dev = dev_;
    map_tensor_args(stack, nargs, /*skip_first=*/true, [&](const at::Tensor& t) {
      return cast_tensor(t, self_type, dev);
    });
  }

  void apply_category(const c10::OperatorHandle& op, Category cat, const Policy& policy,
                      torch::jit::Stack* stack, size_t nargs) const {
    const int dev = dev_;
    switch (cat) {
      case Category::Passthrough:
        return;
      case Category::LowPrecision: {
        const at::ScalarType low = at::autocast::get_autocast_dtype(device_type_of(dev));
        map_tensor_args(stack, nargs, false, [&](const at::Tensor& t) { return cast_tensor(t, low, dev); });
        return;
      }
      case Category::Banned: {
        bool any_low = false;
        for_each_tensor_arg(stack, nargs, false, [&](const at::Tensor& t) {
          if (eligible(t, dev) && is_low(t.scalar_type())) any_low = true;
        });
        if (any_low && !policy.allow_banned) {
          const std::string name = op_display(op.operator_name());
          refuse(RefusalCode::BannedOp, name, at::kHalf,
                 c10::str(name, " is banned under O1 on fp16/bf16 inputs: use "
                          "binary_cross_entropy_with_logits on the logits (or allow_banned)"));
        }
        map_tensor_args(stack, nargs, false, [&](const at::Tensor& t) { return cast_tensor(t, at::kFloat, dev); });
        return;
      }
      case Category::Fp32:
        map_tensor_args(stack, nargs, false, [&](const at::Tensor& t) { return cast_tensor(t, at::kFloat, dev); });
        return;
      case Category::Promote: {
        std::optional<at::ScalarType> widest;
        bool mixed = false;
        for_each_tensor_arg(stack, nargs, false, [&](const at::Tensor& t) {
          if (!eligible(t, dev)) return;
          const auto s = t.scalar_type();
          if (!widest.has_value()) {
            widest = s;
          } else if (*widest != s) {
            mixed = true;
            widest = c10::promoteTypes(*widest, s);
          }
        });
        if (!mixed) return;
        const at::ScalarType to = *widest;
        map_tensor_args(stack, nargs, false, [&](const at::Tensor& t) {
          if (!eligible(t, dev) || t.scalar_type() == to) return t;
          // fp64 only ever widens here (it is the widest when present)
          return t.to(to);
        });
        return;
      }
    }
  }

  // CPU low-precision emulation: when every floating input is the same 16-bit type D, compute
  // the op in fp32 from the (already rounded) inputs and round the floating outputs to D —
  // what a Tensor-Core GEMM does (fp16 in, fp32 accumulate, fp16 out). Backward has the same
  // rounding points and keeps the 16-bit inputs (cast_emulation.cpp).
  void run_emulated(const c10::OperatorHandle& op, c10::DispatchKeySet below, torch::jit::Stack* stack,
                    size_t nargs, const Policy& policy) const {
    const std::optional<at::ScalarType> low = uniform_low(stack, nargs);
    if (!low.has_value() || !policy.emulates(id_, *low)) {
      // Mixed or full-precision inputs, or a type this policy runs natively: the native
      // kernel decides.
      op.redispatchBoxed(below, stack);
      return;
    }
    run_emulated_op(op, below, stack, nargs, *low, policy.recomputes(id_));
    ++tls_emulated[*low == at::kHalf ? 0 : 1];
  }

  size_t id_;
  int dev_;
  bool inplace_;
  std::optional<c10::SafeKernelFunction> native_;
};

}  // namespace

torch::CppFunction make_cast_kernel(size_t id, int dev, bool inplace, std::optional<c10::SafeKernelFunction> native) {
  return torch::CppFunction::makeFromBoxedFunctor(std::make_unique<CastKernel>(id, dev, inplace, std::move(native)));
}

Refusal take_refusal() { return std::exchange(tls_refusal, Refusal{}); }

uint64_t emulated_count(at::ScalarType t) { return tls_emulated[t == at::kHalf ? 0 : 1]; }

}  // namespace tch_amp::cast
