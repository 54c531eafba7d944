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
#include <c10/core/InferenceMode.h>
#include <torch/csrc/autograd/custom_function.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

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

// split_half's portable form (and the vector form's tail).
void split_half_scalar(float* io, uint16_t* h, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const c10::Half x(io[i]);
    h[i] = x.x;
    io[i] = static_cast<float>(x);
  }
}

#ifdef TCH_AMP_X86
__attribute__((target("avx2,f16c"))) void split_half_f16c(float* io, uint16_t* h, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i v = _mm256_cvtps_ph(_mm256_loadu_ps(io + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(h + i), v);
    _mm256_storeu_ps(io + i, _mm256_cvtph_ps(v));
  }
  split_half_scalar(io + i, h + i, n - i);
}
#endif

// Rounds `n` floats at `io` to fp16 in place, writing the fp16 bits to `h` in the same pass.
void split_half(float* io, uint16_t* h, int64_t n) {
#ifdef TCH_AMP_X86
  if (tch_amp::cpu_has_avx2_fma_f16c()) {
    split_half_f16c(io, h, n);
    return;
  }
#endif
  split_half_scalar(io, h, n);
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

// Whether `t` may be rewritten in place by one pass: a dense fp32 CPU tensor (its memory is its
// elements in order) that nothing else can see (`unshared`), outside inference mode.
bool splittable(const at::Tensor& t) {
  return one_pass(t) && !t.is_inference() && !c10::InferenceMode::is_enabled() && unshared(t);
}

// Whether a backward may overwrite gradient `g`: splittable, and not inside a differentiable
// backward (create_graph).
bool overwritable_gradient(const at::Tensor& g) {
  return !c10::GradMode::is_enabled() && !g.requires_grad() && splittable(g);
}

// A gradient handed to a backward: rounded in place when nothing else can see it (see
// `unshared`; never inside a differentiable backward), else into a new tensor. In place it is
// read and written once, with no new memory.
at::Tensor round_gradient(const at::Tensor& g, at::ScalarType low) {
  if (overwritable_gradient(g)) {
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

// ---- The output handoff ----------------------------------------------------------------------
// An emulated op's fp32 output `t` becomes an fp16 tensor `h` (the user's, Apex's dtype), and the
// next op often converts `h` straight back to fp32 (an fp32-list op, a promoting add, another
// emulated op). When nothing else holds `t`, one pass writes `h` and rounds `t` in place, still
// in cache, and the conversion of `h` takes `t`'s memory instead of a fresh tensor: the same
// values, one pass and one allocation fewer. Backward mirrors it: the conversion's backward
// rounds its fp32 gradient in place while writing the fp16 one, and the output's backward
// takes that fp32 gradient when the fp16 one reaching it is the very tensor written (not a sum
// with another use's gradient). Each stash is the calling thread's, a few entries, checked by
// identity and version; a miss is the plain conversion.
std::atomic<bool> handoff_on{true};
thread_local int64_t handed_forward = 0;
thread_local int64_t handed_backward = 0;

struct Handoff {
  c10::weak_intrusive_ptr<c10::TensorImpl> low;  // the fp16 tensor given out
  int64_t version;                               // its version then
  at::Tensor fp32;                               // its values in fp32, held by the stash alone
};
constexpr size_t kStashLen = 2;  // the next op usually converts: keep little memory waiting
thread_local std::vector<Handoff> forward_stash;
thread_local std::vector<Handoff> backward_stash;

void stash(std::vector<Handoff>& s, const at::Tensor& low, at::Tensor fp32) {
  s.erase(std::remove_if(s.begin(), s.end(), [](const Handoff& e) { return e.low.expired(); }), s.end());
  if (s.size() >= kStashLen) s.erase(s.begin());
  s.push_back(Handoff{c10::weak_intrusive_ptr<c10::TensorImpl>(low.getIntrusivePtr()), low._version(), std::move(fp32)});
}

// The fp32 values stashed for `low` itself, unchanged since, taken out of the stash (undefined
// when there are none).
at::Tensor take(std::vector<Handoff>& s, const at::Tensor& low) {
  at::Tensor out;
  for (auto it = s.begin(); it != s.end();) {
    const auto held = it->low.lock();
    if (!held) {
      it = s.erase(it);
    } else if (held.get() == low.unsafeGetTensorImpl()) {
      if (it->version == low._version()) out = std::move(it->fp32);
      it = s.erase(it);
    } else {
      ++it;
    }
  }
  return out;
}

// An fp16 tensor with `t`'s layout whose values are `t`'s rounded, `t` rounded in place.
at::Tensor split(const at::Tensor& t) {
  at::Tensor h = at::empty_like(t, t.options().dtype(at::kHalf));
  float* io = t.mutable_data_ptr<float>();
  auto* out = reinterpret_cast<uint16_t*>(h.mutable_data_ptr<at::Half>());
  at::parallel_for(0, t.numel(), 1 << 14, [&](int64_t b, int64_t e) { split_half(io + b, out + b, e - b); });
  return h;
}

// The emulated op's output: forward, `t` (which nothing else holds) to fp16, `t` left holding
// those values in fp32; backward, the fp16 gradient converted to fp32, or the fp32 gradient
// the conversion's backward kept for it.
struct RoundOut : public torch::autograd::Function<RoundOut> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& t) { return split(t); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 const torch::autograd::variable_list& grads) {
    const at::Tensor& g = grads[0];
    if (!g.defined()) return {at::Tensor()};
    if (!c10::GradMode::is_enabled() && !backward_stash.empty()) {
      at::Tensor kept = take(backward_stash, g);
      if (kept.defined()) {
        ++handed_backward;
        return {kept};
      }
    }
    return {g.to(at::kFloat)};
  }
};

// fp16 `h` to fp32 from values kept for it: forward, those values; backward, the gradient to
// fp16 (rounded in place and kept for RoundOut when nothing else holds it).
struct Widen : public torch::autograd::Function<Widen> {
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor&, at::Tensor* values) {
    return std::move(*values);
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*,
                                                 const torch::autograd::variable_list& grads) {
    forward_stash.clear();  // a backward on this thread: what the forward kept is stale
    const at::Tensor& g = grads[0];
    if (!g.defined()) return {at::Tensor(), at::Tensor()};
    if (handoff_on.load(std::memory_order_relaxed) && overwritable_gradient(g)) {
      at::Tensor gh = split(g);
      stash(backward_stash, gh, g);
      return {gh, at::Tensor()};
    }
    return {g.to(at::kHalf), at::Tensor()};
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

at::Tensor round_output(const at::Tensor& t, at::ScalarType low) {
  if (low != at::kHalf || !handoff_on.load(std::memory_order_relaxed) || !splittable(t)) return t.to(low);
  at::Tensor h = RoundOut::apply(t);
  stash(forward_stash, h, t.detach());
  return h;
}

at::Tensor widen(const at::Tensor& h) {
  if (h.scalar_type() == at::kHalf && !forward_stash.empty()) {
    at::Tensor values = take(forward_stash, h);
    if (values.defined()) {
      ++handed_forward;
      return Widen::apply(h, &values);
    }
  }
  return h.to(at::kFloat);
}

void handoff_clear() {
  forward_stash.clear();
  backward_stash.clear();
}

}  // namespace tch_amp::cast

extern "C" {

// The output handoff (round_through.cpp): `enabled` 0 or 1 sets it (process-wide), -1 leaves it;
// *previous receives the old setting, out[0] and out[1] the calling thread's forward and
// backward handoffs since it started.
char* tch_amp_o1_output_handoff(int enabled, int* previous, int64_t* out) {
  TCH_AMP_PROTECT({
    using namespace tch_amp::cast;
    *previous = handoff_on.load() ? 1 : 0;
    if (enabled >= 0) handoff_on.store(enabled != 0);
    if (enabled == 0) handoff_clear();
    out[0] = handed_forward;
    out[1] = handed_backward;
  })
}

}  // extern "C"
