// O1 with CPU emulation: an fp32 argument of a low-precision-list op is rounded to fp16/bf16
// and the emulation converts it straight back to fp32, two passes and two tensors. `round_through`
// makes the fp32 tensor of the rounded values in one pass, as an autograd function whose
// backward rounds the gradient the same way: the same values, forward and backward, as the
// `to(fp16)` then `to(fp32)` pair (whose backwards are `to(fp16)` then `to(fp32)` on the
// gradient). Used by cast_kernel.cpp for emulated ops' activations; model weights take
// `round_weight` (one node, when their last forward used them once) or their cached fp16 cast
// (cast_cache.cpp).
#include "amp_shim.h"
#include "cast_policy.h"
#include "weight_copies.h"

#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace tch_amp::cast {
namespace {

#ifdef TCH_AMP_X86
__attribute__((target("avx2,f16c"))) void round_half_f16c(const float* in, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
  }
  for (; i < n; ++i) out[i] = static_cast<float>(c10::Half(in[i]));
}
#endif

void round_half(const float* in, float* out, int64_t n) {
#ifdef TCH_AMP_X86
  if (tch_amp::cpu_has_avx2_fma_f16c()) {
    round_half_f16c(in, out, n);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<float>(c10::Half(in[i]));
}

// bf16's round to nearest even, as c10::BFloat16's constructor (NaN to the canonical NaN).
void round_bf16(const float* in, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, in + i, sizeof u);
    uint32_t r;
    if (std::isnan(in[i])) {
      r = 0x7FC00000u;
    } else {
      r = ((u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16) << 16;
    }
    std::memcpy(out + i, &r, sizeof r);
  }
}

bool one_pass(const at::Tensor& x) {
  return x.is_cpu() && x.is_contiguous() && x.scalar_type() == at::kFloat && x.layout() == at::kStrided;
}

// Rounds `n` floats from `in` into `out` (which may be `in`), on libtorch's threads.
void round_into(const float* in, float* out, int64_t n, at::ScalarType low) {
  const bool half = low == at::kHalf;
  at::parallel_for(0, n, 1 << 14, [&](int64_t b, int64_t e) {
    if (half) {
      round_half(in + b, out + b, e - b);
    } else {
      round_bf16(in + b, out + b, e - b);
    }
  });
}

// fp32(low(x)) for an fp32 tensor: one pass for a contiguous CPU tensor, else libtorch's casts.
at::Tensor round_kernel(const at::Tensor& x, at::ScalarType low) {
  if (!one_pass(x)) return x.to(low).to(at::kFloat);
  at::Tensor out = at::empty_like(x, at::MemoryFormat::Contiguous);
  round_into(x.const_data_ptr<float>(), out.data_ptr<float>(), x.numel(), low);
  return out;
}

// Whether nothing but `g` can see its memory: the only reference to its TensorImpl and its
// storage, or a view whose base (held by the view alone) is the storage's only other holder.
// Gradients that reach a weight usually are such views (a transpose, a reshape of a sum).
bool unshared(const at::Tensor& g) {
  if (g.use_count() != 1) return false;
  const auto holders = g.storage().use_count();
  if (!g.is_view()) return holders == 1;
  const at::TensorBase& base = g._base();  // the view's own reference
  return holders == 2 && base.use_count() == 1 && base.storage().is_alias_of(g.storage());
}

// A gradient handed to a backward: rounded in place when nothing else can see it (see
// `unshared`; never inside a differentiable backward), else into a new tensor. In place it is
// read and written once, with no new memory.
at::Tensor round_gradient(const at::Tensor& g, at::ScalarType low) {
  if (one_pass(g) && !c10::GradMode::is_enabled() && !g.requires_grad() && !g.is_inference() && unshared(g)) {
    float* p = g.data_ptr<float>();
    round_into(p, p, g.numel(), low);
    weight_copies::note_rounded_in_place();
    return g;
  }
  return round_kernel(g.scalar_type() == at::kFloat ? g : g.to(at::kFloat), low);
}

struct RoundThrough : public torch::autograd::Function<RoundThrough> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, int64_t low) {
    ctx->saved_data["low"] = low;
    return round_kernel(x, static_cast<at::ScalarType>(low));
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 const torch::autograd::variable_list& grads) {
    const int64_t low = ctx->saved_data["low"].toInt();
    const at::Tensor& g = grads[0];
    if (!g.defined()) return {at::Tensor(), at::Tensor()};
    // The pair's backward: the gradient rounded to `low` and back (an fp32 gradient here),
    // differentiable again under create_graph.
    if (c10::GradMode::is_enabled()) {
      return {RoundThrough::apply(g.scalar_type() == at::kFloat ? g : g.to(at::kFloat), low), at::Tensor()};
    }
    return {round_gradient(g, static_cast<at::ScalarType>(low)), at::Tensor()};
  }
};

// A model weight used once per forward (see weight_copies.h): forward, the fp32 tensor of its
// rounded values (the optimizer's copy when it is current, else made here in one pass);
// backward, the gradient rounded the same way in one pass. For a single use these are the
// values, forward and backward, of the cached cast to `low` and the conversion back: the cast
// pair's backward rounds the gradient to `low` and converts it to fp32. Should the same forward
// use the weight again, cast_cache.cpp rewires this node's edge into a cast made then, so that
// the uses' gradients add up in `low` as with the two casts.
struct RoundWeight : public torch::autograd::Function<RoundWeight> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& w, int64_t low,
                            const at::Tensor* copy) {
    ctx->saved_data["low"] = low;
    if (copy != nullptr && copy->defined()) return copy->detach();
    return round_kernel(w.detach(), static_cast<at::ScalarType>(low));
  }
  // `grads` by reference: the engine's list is then the only owner of an unshared gradient,
  // which round_gradient may then round in place.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 const torch::autograd::variable_list& grads) {
    const auto low = static_cast<at::ScalarType>(ctx->saved_data["low"].toInt());
    if (!grads[0].defined()) return {at::Tensor(), at::Tensor(), at::Tensor()};
    return {round_gradient(grads[0], low), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

at::Tensor round_weight(const at::Tensor& w, at::ScalarType low, const at::Tensor& copy) {
  return RoundWeight::apply(w, static_cast<int64_t>(low), &copy);
}

bool rounds_vectorized(at::ScalarType low) {
#ifdef TCH_AMP_X86
  return low == at::kHalf && tch_amp::cpu_has_avx2_fma_f16c();
#else
  (void)low;
  return false;
#endif
}

at::Tensor round_through(const at::Tensor& x, at::ScalarType low) {
  return RoundThrough::apply(x, static_cast<int64_t>(low));
}

}  // namespace tch_amp::cast
