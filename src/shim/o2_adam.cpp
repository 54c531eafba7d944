// O2's Adam/AdamW update of one fp32 master from the model's fp16 (or bf16) gradient in a
// single pass over memory (bound in src/sys/optim.rs): per element, the gradient is converted to
// fp32 and unscaled, the master and its state are updated, and the master is rounded into the
// model's 16-bit weight. The alternative, libtorch's `_fused_adam_` between an unscale pass and a
// rounding pass, reads and writes the gradient and the master two more times. The same pass
// serves O1 with CPU emulation: an fp32 weight updated from its fp32 gradient, its values
// rounded to fp16/bf16 written into the copy the next forward reads (weight_copies.h).
//
// The arithmetic is libtorch's CPU fused Adam kernel's (aten/src/ATen/native/cpu/
// FusedAdamKernel.cpp, `adam_math` for float): the same operations in the same order on the
// same fp32 scalars, so the same bits. Two things depend on how that libtorch was compiled and
// are not visible from its headers: whether the compiler fused a multiply into the following
// add (FMA contraction) in `v * beta2 + (1 - beta2) * g * g` and in `g + p * weight_decay`,
// and the vector width that decides which last elements take its scalar path. So the first
// update of each mode (Adam, AdamW) runs every candidate on a probe against libtorch's own
// kernel and keeps the one that matches it bit for bit, elements, state and rounded weight;
// when none does (another libtorch build, a CPU without AVX2/FMA/F16C), the caller is told and
// takes its slice-wise path. The last `numel % width` elements go through libtorch's kernel
// itself, as they do in a whole-tensor update.
#include "amp_shim.h"
#include "weight_copies.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <vector>

namespace {

// How libtorch's compiler evaluated `v * beta2 + c2 * g * g`.
enum SqForm : int { kSqPlain = 0, kSqFmaFirst = 1, kSqFmaSecond = 2 };
// How it evaluated `g + p * weight_decay` (Adam's L2 term).
enum WdForm : int { kWdPlain = 0, kWdFma = 1 };

struct Form {
  int sq = kSqPlain;
  int wd = kWdPlain;
  int width = 8;  // libtorch's Vectorized<float>::size(): 8 (AVX2) or 16 (AVX512)
};

// The fp32 scalars of one update, made from the doubles exactly as libtorch makes them.
struct Scalars {
  float inv, wd, decay, lerp_w, lerp_w_minus_1, b2, c2, bc2_sqrt, eps, neg_step_size;
  bool small_lerp, maximize, amsgrad, adamw, has_wd;
  // The 16-bit model weight is 16-byte aligned: its stores may be streamed (see adam_8).
  bool stream16;
};

Scalars make_scalars(float inv, double step, const tch_amp_adam_scalars& h) {
  const double lr = h.lr, beta1 = h.beta1, beta2 = h.beta2, wd = h.weight_decay;
  const double bc1 = 1 - std::pow(beta1, step);
  const double step_size = lr / bc1;
  const double bc2 = 1 - std::pow(beta2, step);
  Scalars s{};
  s.inv = inv;
  s.wd = static_cast<float>(wd);
  s.decay = static_cast<float>(1 - lr * wd);
  s.lerp_w = static_cast<float>(1 - beta1);
  s.lerp_w_minus_1 = s.lerp_w - 1.0f;
  s.small_lerp = std::abs(s.lerp_w) < 0.5f;
  s.b2 = static_cast<float>(beta2);
  s.c2 = static_cast<float>(1 - beta2);
  s.bc2_sqrt = static_cast<float>(std::sqrt(bc2));
  s.eps = static_cast<float>(h.eps);
  s.neg_step_size = static_cast<float>(-step_size);
  s.maximize = h.maximize != 0;
  s.amsgrad = h.amsgrad != 0;
  s.adamw = h.adamw != 0;
  s.has_wd = wd != 0.0;
  return s;
}

#ifdef TCH_AMP_X86
// libtorch's Vectorized<float>::maximum: the larger, NaN when either is NaN.
__attribute__((target("avx2,fma,f16c"))) inline __m256 maximum(__m256 a, __m256 b) {
  const __m256 mx = _mm256_max_ps(a, b);
  return _mm256_or_ps(mx, _mm256_cmp_ps(a, b, _CMP_UNORD_Q));
}

// What one update reads and writes besides the state: O2's fp16 (bf16) gradient and fp16
// (bf16) model weight, or O1's fp32 gradient and the fp32 copy of the weight rounded to fp16 or
// bf16 (weight_copies.h).
enum Io : int { kIoHalf = 0, kIoRoundHalf = 1, kIoRoundBf16 = 2, kIoBf16 = 3 };

// bf16's round to nearest even of 8 floats, as c10::BFloat16's constructor (NaN: 0x7FC00000).
__attribute__((target("avx2,fma,f16c"))) inline __m256 round_bf16_8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  r = _mm256_and_si256(r, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u)));
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  return _mm256_blendv_ps(_mm256_castsi256_ps(r), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC00000)), nan);
}

// Elements [0, n) with n a multiple of 8.
template <int SQ, int WD, int IO>
__attribute__((target("avx2,fma,f16c"))) void adam_8(const void* gp, float* p, float* m, float* v, float* mx,
                                                     void* wp, int64_t n, const Scalars& s) {
  const auto* g16 = static_cast<const uint16_t*>(gp);
  const auto* g32 = static_cast<const float*>(gp);
  auto* w16 = static_cast<uint16_t*>(wp);
  auto* w32 = static_cast<float*>(wp);
  const __m256 inv = _mm256_set1_ps(s.inv), wd = _mm256_set1_ps(s.wd), decay = _mm256_set1_ps(s.decay);
  const __m256 coeff = _mm256_set1_ps(s.small_lerp ? s.lerp_w : s.lerp_w_minus_1);
  const __m256 b2 = _mm256_set1_ps(s.b2), c2 = _mm256_set1_ps(s.c2), bc2 = _mm256_set1_ps(s.bc2_sqrt);
  const __m256 eps = _mm256_set1_ps(s.eps), nss = _mm256_set1_ps(s.neg_step_size), neg1 = _mm256_set1_ps(-1.0f);
  for (int64_t i = 0; i < n; i += 8) {
    __m256 g;
    if (IO == kIoHalf) {
      g = _mm256_mul_ps(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g16 + i))), inv);
    } else if (IO == kIoBf16) {
      // bf16 to fp32 is exact: the 16 bits above 16 zeros.
      const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(g16 + i)));
      g = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(wide, 16)), inv);
    } else {
      g = _mm256_loadu_ps(g32 + i);
    }
    __m256 pv = _mm256_loadu_ps(p + i);
    if (s.maximize) g = _mm256_mul_ps(g, neg1);
    if (s.has_wd) {
      if (s.adamw) {
        pv = _mm256_mul_ps(pv, decay);
      } else if (WD == kWdFma) {
        g = _mm256_fmadd_ps(pv, wd, g);
      } else {
        g = _mm256_add_ps(g, _mm256_mul_ps(pv, wd));
      }
    }
    __m256 mv = _mm256_loadu_ps(m + i);
    // exp_avg.lerp_(grad, 1 - beta1), as libtorch's kernel writes it.
    mv = _mm256_fmadd_ps(coeff, _mm256_sub_ps(g, mv), s.small_lerp ? mv : g);
    __m256 vv = _mm256_loadu_ps(v + i);
    if (SQ == kSqPlain) {
      vv = _mm256_add_ps(_mm256_mul_ps(vv, b2), _mm256_mul_ps(_mm256_mul_ps(c2, g), g));
    } else if (SQ == kSqFmaFirst) {
      vv = _mm256_fmadd_ps(vv, b2, _mm256_mul_ps(_mm256_mul_ps(c2, g), g));
    } else {
      vv = _mm256_fmadd_ps(_mm256_mul_ps(c2, g), g, _mm256_mul_ps(vv, b2));
    }
    _mm256_storeu_ps(m + i, mv);
    _mm256_storeu_ps(v + i, vv);
    __m256 src = vv;
    if (s.amsgrad) {
      src = maximum(_mm256_loadu_ps(mx + i), vv);
      _mm256_storeu_ps(mx + i, src);
    }
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(src), bc2), eps);
    pv = _mm256_add_ps(pv, _mm256_div_ps(_mm256_mul_ps(nss, mv), denom));
    _mm256_storeu_ps(p + i, pv);
    if (IO == kIoHalf || IO == kIoBf16) {
      __m128i h;
      if (IO == kIoHalf) {
        h = _mm256_cvtps_ph(pv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      } else {
        // The rounded values' upper 16 bits, packed in order (each fits: no saturation).
        const __m256i r = _mm256_srli_epi32(_mm256_castps_si256(round_bf16_8(pv)), 16);
        h = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
      }
      // Streamed: nothing reads the model weight before the next forward, by when it has left
      // the caches anyway, and a normal store would first read its line from memory (measured:
      // the MLP's O2 step 0.1 ms faster).
      if (s.stream16) {
        _mm_stream_si128(reinterpret_cast<__m128i*>(w16 + i), h);
      } else {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(w16 + i), h);
      }
    } else if (IO == kIoRoundHalf) {
      // The copy is read by the next forward, not here: streamed past the caches (64-byte
      // aligned: libtorch's CPU allocator aligns to 64 and blocks start at multiples of 64).
      const __m128i h = _mm256_cvtps_ph(pv, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
      _mm256_stream_ps(w32 + i, _mm256_cvtph_ps(h));
    } else {
      _mm256_stream_ps(w32 + i, round_bf16_8(pv));
    }
  }
}

using AdamFn = void (*)(const void*, float*, float*, float*, float*, void*, int64_t, const Scalars&);
template <int IO>
AdamFn pick_io(const Form& f) {
  static const AdamFn table[3][2] = {{adam_8<kSqPlain, kWdPlain, IO>, adam_8<kSqPlain, kWdFma, IO>},
                                     {adam_8<kSqFmaFirst, kWdPlain, IO>, adam_8<kSqFmaFirst, kWdFma, IO>},
                                     {adam_8<kSqFmaSecond, kWdPlain, IO>, adam_8<kSqFmaSecond, kWdFma, IO>}};
  return table[f.sq][f.wd];
}
AdamFn pick(const Form& f, int io) {
  switch (io) {
    case kIoHalf:
      return pick_io<kIoHalf>(f);
    case kIoBf16:
      return pick_io<kIoBf16>(f);
    case kIoRoundHalf:
      return pick_io<kIoRoundHalf>(f);
    default:
      return pick_io<kIoRoundBf16>(f);
  }
}
#endif

// The tensors of one update, flat, detached.
struct Update {
  at::Tensor w, g, p, m, v, mx, step;
  // What `w` holds with an fp32 `w`: the values of `p` rounded to this type.
  at::ScalarType low = at::kHalf;
};

// libtorch's own kernel on elements [from, n): unscale into fp32, `_fused_adam(w)_`, round back.
void libtorch_update(const Update& u, int64_t from, float inv, const tch_amp_adam_scalars& h) {
  const bool amsgrad = h.amsgrad != 0, maximize = h.maximize != 0;
  const int64_t n = u.p.numel();
  if (from >= n) return;
  const int64_t len = n - from;
  // An fp32 gradient (O1's, already unscaled) is read as it is, never written.
  const at::Tensor g_part = u.g.narrow(0, from, len);
  const at::Tensor g32 = g_part.scalar_type() == at::kFloat ? g_part : g_part.to(at::kFloat).mul_(inv);
  std::vector<at::Tensor> ps{u.p.narrow(0, from, len)}, gs{g32}, ms{u.m.narrow(0, from, len)},
      vs{u.v.narrow(0, from, len)}, steps{u.step}, mxs;
  if (amsgrad) mxs.push_back(u.mx.narrow(0, from, len));
  if (h.adamw != 0) {
    at::_fused_adamw_(ps, gs, ms, vs, mxs, steps, h.lr, h.beta1, h.beta2, h.weight_decay, h.eps, amsgrad, maximize);
  } else {
    at::_fused_adam_(ps, gs, ms, vs, mxs, steps, h.lr, h.beta1, h.beta2, h.weight_decay, h.eps, amsgrad, maximize);
  }
  // The weight: O2's fp16 model (copy_ rounds), or O1's fp32 copy of the rounded values.
  if (u.w.scalar_type() == at::kFloat) {
    u.w.narrow(0, from, len).copy_(ps[0].to(u.low).to(at::kFloat));
  } else {
    u.w.narrow(0, from, len).copy_(ps[0]);
  }
}

#ifdef TCH_AMP_X86
// The single-pass update with form `f`: vector part here (in parallel), the tail by libtorch.
void fused_update(const Update& u, const Form& f, float inv, const tch_amp_adam_scalars& h) {
  const int64_t n = u.p.numel();
  const int64_t nvec = n - n % f.width;
  const bool amsgrad = h.amsgrad != 0;
  Scalars s = make_scalars(inv, static_cast<double>(u.step.item<float>()), h);
  const at::ScalarType wt = u.w.scalar_type();
  const int io = wt == at::kHalf       ? kIoHalf
                 : wt == at::kBFloat16 ? kIoBf16
                 : u.low == at::kHalf  ? kIoRoundHalf
                                       : kIoRoundBf16;
  const AdamFn fn = pick(f, io);
  const size_t gsize = u.g.element_size(), wsize = u.w.element_size();
  const auto* g = static_cast<const char*>(u.g.const_data_ptr());
  auto* w = static_cast<char*>(u.w.data_ptr());
  float *p = u.p.data_ptr<float>(), *m = u.m.data_ptr<float>(), *v = u.v.data_ptr<float>();
  float* mx = amsgrad ? u.mx.data_ptr<float>() : nullptr;
  // Tasks start at multiples of 64 elements: an aligned weight stays aligned in every task.
  s.stream16 = (io == kIoHalf || io == kIoBf16) && reinterpret_cast<uintptr_t>(w) % 16 == 0;
  // Units of 64 elements (cache lines of every array), 16 Ki elements per task at least.
  const int64_t units = (nvec + 63) / 64;
  at::parallel_for(0, units, 256, [&](int64_t ub, int64_t ue) {
    const int64_t b = ub * 64, e = std::min(nvec, ue * 64);
    if (e > b) fn(g + b * gsize, p + b, m + b, v + b, amsgrad ? mx + b : nullptr, w + b * wsize, e - b, s);
    _mm_sfence();  // the streamed stores are visible before the task ends
  });
  libtorch_update(u, nvec, inv, h);
}

bool same_bits(const at::Tensor& a, const at::Tensor& b) {
  return a.numel() == b.numel() && std::memcmp(a.const_data_ptr(), b.const_data_ptr(), a.nbytes()) == 0;
}

// Finds the form that reproduces libtorch's kernel for this mode on a probe with a `low` (fp16
// or bf16) model and gradient (nullopt: none).
std::optional<Form> calibrate(bool adamw, at::ScalarType low) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(20261124);
  const int64_t n = (1 << 14) + 13;  // a tail of 13: 13 scalar elements at width 16, 5 at width 8
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  const float inv = 1.0f / 65536.0f;
  const at::Tensor p0 = at::randn({n}, gen, f32), m0 = at::randn({n}, gen, f32).mul_(0.01),
                   v0 = at::rand({n}, gen, f32).mul_(1e-4),
                   g16 = at::randn({n}, gen, f32).mul_(655.36).to(low),
                   step = at::scalar_tensor(7.0, f32);
  const tch_amp_adam_scalars h{1e-3, 0.9, 0.999, 0.01, 1e-8, /*amsgrad=*/0, adamw ? 1 : 0, /*maximize=*/0};
  Update ref{p0.to(low), g16, p0.clone(), m0.clone(), v0.clone(), at::Tensor(), step};
  libtorch_update(ref, 0, inv, h);
  for (int width : {8, 16}) {
    for (int sq : {kSqFmaFirst, kSqPlain, kSqFmaSecond}) {
      for (int wdf : {kWdFma, kWdPlain}) {
        if (adamw && wdf == kWdPlain) continue;  // AdamW has no L2 term
        const Form f{sq, wdf, width};
        Update u{p0.to(low), g16, p0.clone(), m0.clone(), v0.clone(), at::Tensor(), step};
        fused_update(u, f, inv, h);
        if (same_bits(u.p, ref.p) && same_bits(u.m, ref.m) && same_bits(u.v, ref.v) && same_bits(u.w, ref.w)) {
          return f;
        }
      }
    }
  }
  return std::nullopt;
}

// The calibrated form per mode (Adam, AdamW) and 16-bit type (fp16, bf16: the same arithmetic,
// each checked with its own conversions), found once per process. O1's copies (fp32 gradients)
// take the fp16 one.
std::optional<Form> form_for(bool adamw, at::ScalarType low = at::kHalf) {
  static std::mutex mu;
  static bool done[2][2] = {{false, false}, {false, false}};
  static std::optional<Form> found[2][2];
  std::lock_guard<std::mutex> lock(mu);
  const int k = adamw ? 1 : 0, d = low == at::kBFloat16 ? 1 : 0;
  if (!done[k][d]) {
    c10::AutoGradMode no_grad(false);
    found[k][d] = tch_amp::cpu_has_avx2_fma_f16c() ? calibrate(adamw, d == 1 ? at::kBFloat16 : at::kHalf) : std::nullopt;
    done[k][d] = true;
  }
  return found[k][d];
}
#endif

#ifdef TCH_AMP_X86
// Whether `t` is a contiguous strided CPU tensor of type `type` and `n` elements.
bool fits(const at::Tensor* t, at::ScalarType type, int64_t n) {
  return t != nullptr && t->defined() && t->is_cpu() && t->layout() == at::kStrided && t->is_contiguous() &&
         t->scalar_type() == type && t->numel() == n;
}

// The tensors one single-pass update reads and writes besides the weight it rounds into.
struct Tensors {
  at::Tensor *grad, *master, *exp_avg, *exp_avg_sq, *max_exp_avg_sq, *step;

  // The gradient of `grad_type`, the fp32 master and its state, all contiguous CPU tensors of
  // as many elements (max_exp_avg_sq with amsgrad only), a CPU step.
  bool fit(const tch_amp_adam_scalars& h, at::ScalarType grad_type) const {
    const int64_t n = master->numel();
    return fits(grad, grad_type, n) && fits(master, at::kFloat, n) && fits(exp_avg, at::kFloat, n) &&
           fits(exp_avg_sq, at::kFloat, n) && (h.amsgrad == 0 || fits(max_exp_avg_sq, at::kFloat, n)) &&
           step->is_cpu();
  }

  // The single pass with form `f`, rounding the master into `w` (`low`: what an fp32 `w`
  // holds the values rounded to); then the version counters of everything written through
  // data pointers move, as an in-place op's do.
  void update(const at::Tensor& w, at::ScalarType low, const Form& f, float inv, const tch_amp_adam_scalars& h) const {
    const bool amsgrad = h.amsgrad != 0;
    c10::AutoGradMode no_grad(false);
    Update u{w.detach().view(-1),
             grad->detach().view(-1),
             master->detach().view(-1),
             exp_avg->detach().view(-1),
             exp_avg_sq->detach().view(-1),
             amsgrad ? max_exp_avg_sq->detach().view(-1) : at::Tensor(),
             step->detach()};
    u.low = low;
    fused_update(u, f, inv, h);
    for (const at::Tensor& t : {w, *master, *exp_avg, *exp_avg_sq}) t.unsafeGetTensorImpl()->bump_version();
    if (amsgrad) max_exp_avg_sq->unsafeGetTensorImpl()->bump_version();
  }
};
#endif

}  // namespace

extern "C" {

// One O2 Adam (adamw = 0) or AdamW (adamw = 1) update in a single pass (see the top of this
// file). `model`, `grad`: contiguous CPU fp16, or both bf16; `master`, `exp_avg`, `exp_avg_sq` (and
// `max_exp_avg_sq` with amsgrad, else NULL): contiguous CPU fp32 of as many elements; `step`: the
// 0-dim fp32 step count of this update; `inv_scale`: a 1-element CPU fp32 tensor. *applied = 1
// when the update was made; 0 (nothing changed) when this build of libtorch or this CPU has no
// form that reproduces libtorch's kernel bit for bit, or the tensors are not of those kinds.
char* tch_amp_o2_fused_adam_(at::Tensor* model, at::Tensor* grad, at::Tensor* master, at::Tensor* exp_avg,
                             at::Tensor* exp_avg_sq, at::Tensor* max_exp_avg_sq, at::Tensor* step,
                             at::Tensor* inv_scale, const tch_amp_adam_scalars* h, int* applied) {
  TCH_AMP_PROTECT({
    *applied = 0;
#ifdef TCH_AMP_X86
    const Tensors t{grad, master, exp_avg, exp_avg_sq, max_exp_avg_sq, step};
    const at::ScalarType low = model != nullptr && model->defined() ? model->scalar_type() : at::kHalf;
    if ((low != at::kHalf && low != at::kBFloat16) || !t.fit(*h, low) || !fits(model, low, master->numel()) ||
        !inv_scale->is_cpu() || inv_scale->numel() != 1 || inv_scale->scalar_type() != at::kFloat) {
      return nullptr;
    }
    const std::optional<Form> form = form_for(h->adamw != 0, low);
    if (!form.has_value()) return nullptr;
    t.update(*model, low, *form, inv_scale->item<float>(), *h);
    *applied = 1;
#endif
  })
}

// O1's Adam (adamw = 0) or AdamW (adamw = 1) update of one fp32 weight `param` from its fp32
// gradient (unscaled already) in a single pass that also writes the weight's copy rounded to
// fp16/bf16 for the next forward (weight_copies.h), when the registry wants one for `param`.
// The other arguments as for tch_amp_o2_fused_adam_. *applied = 1 when the update was made;
// 0 (nothing changed) when no copy is wanted, the tensors are not contiguous CPU fp32 ones of
// as many elements, or no form reproduces libtorch's kernel here: the caller then runs
// libtorch's kernel.
char* tch_amp_o1_fused_adam_(at::Tensor* param, at::Tensor* grad, at::Tensor* exp_avg, at::Tensor* exp_avg_sq,
                             at::Tensor* max_exp_avg_sq, at::Tensor* step, const tch_amp_adam_scalars* h,
                             int* applied) {
  TCH_AMP_PROTECT({
    *applied = 0;
#ifdef TCH_AMP_X86
    // Copies off: one atomic load per parameter, nothing else.
    if (!tch_amp::weight_copies::enabled()) return nullptr;
    const Tensors t{grad, param, exp_avg, exp_avg_sq, max_exp_avg_sq, step};
    if (!t.fit(*h, at::kFloat)) return nullptr;
    const std::optional<Form> form = form_for(h->adamw != 0);
    if (!form.has_value()) return nullptr;
    auto want = tch_amp::weight_copies::wanted(*param);
    if (!want.has_value()) return nullptr;
    const auto [low, copy] = *want;
    // The copy's vector stores are aligned ones (libtorch's CPU allocator aligns to 64 bytes).
    if (reinterpret_cast<uintptr_t>(copy.data_ptr()) % 32 != 0) return nullptr;
    t.update(copy, low, *form, 1.0f, *h);
    tch_amp::weight_copies::store(*param, low, copy);
    *applied = 1;
#endif
  })
}

// The form of the single-pass update that reproduces libtorch's kernel for Adam (adamw = 0) or
// AdamW (adamw = 1), found on a probe at the first call: *found = 1 and the form's FMA choices
// (*sq: 0 plain, 1 `fma(v, beta2, c2*g*g)`, 2 `fma(c2*g, g, v*beta2)`; *wd: 0 plain, 1
// `fma(p, wd, g)`) and libtorch's vector width; *found = 0 when there is none.
char* tch_amp_o2_adam_form(int adamw, int* found, int* sq, int* wd, int* width) {
  TCH_AMP_PROTECT({
    *found = 0;
#ifdef TCH_AMP_X86
    const std::optional<Form> f = form_for(adamw != 0);
    if (f.has_value()) {
      *found = 1;
      *sq = f->sq;
      *wd = f->wd;
      *width = f->width;
    }
#endif
  })
}

}  // extern "C"
