// CPU kernels of the gradient path that libtorch has no single op for (bound in
// src/sys/grads.rs):
// - a read-only inf/NaN check of gradients (libtorch's check is fused with a multiply that
//   writes every gradient back; with a loss scale of 1 the multiply changes nothing, so the
//   check alone reads 2 or 4 bytes per element instead of reading and writing them);
// - `dst = fp32(src) * inv_scale` from an fp16/bf16 gradient into an fp32 one in one pass
//   (what `dst.copy_(src)` then `dst.mul_(inv_scale)` compute, bit for bit: the conversion is
//   exact and the product rounds once in fp32).
// Tensors cross as `at::Tensor*` (tch's C_tensor). Anything but contiguous CPU tensors of the
// expected types goes through libtorch's own ops, with the same results.
#include "amp_shim.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/core/GradMode.h>

#include <atomic>
#include <cstdint>
#include <cstring>
#include <optional>
#include <vector>

namespace {

constexpr int64_t kGrain = 1 << 15;

#ifdef TCH_AMP_X86
// AVX2 form of any_exponent_all_ones for 16- or 32-bit values: 64 bytes a round, one test.
template <typename Bits>
__attribute__((target("avx2"))) bool any_all_ones_avx2(const Bits* p, int64_t n, Bits mask) {
  constexpr int64_t lanes = 32 / sizeof(Bits);  // per 256-bit register
  const __m256i m = sizeof(Bits) == 2 ? _mm256_set1_epi16(static_cast<short>(mask))
                                      : _mm256_set1_epi32(static_cast<int>(mask));
  int64_t i = 0;
  for (; i + 4 * lanes <= n; i += 4 * lanes) {
    __m256i acc = _mm256_setzero_si256();
    for (int64_t k = 0; k < 4 * lanes; k += lanes) {
      const __m256i v = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + i + k)), m);
      acc = _mm256_or_si256(acc, sizeof(Bits) == 2 ? _mm256_cmpeq_epi16(v, m) : _mm256_cmpeq_epi32(v, m));
    }
    if (!_mm256_testz_si256(acc, acc)) return true;
  }
  for (; i < n; ++i) {
    if ((p[i] & mask) == mask) return true;
  }
  return false;
}
#endif

// One thread's part of any_exponent_all_ones.
template <typename Bits>
bool range_has_all_ones(const Bits* p, int64_t n, Bits mask) {
#ifdef TCH_AMP_X86
  if constexpr (sizeof(Bits) == 2 || sizeof(Bits) == 4) {
    if (tch_amp::cpu_has_avx2_fma_f16c()) return any_all_ones_avx2<Bits>(p, n, mask);
  }
#endif
  unsigned hits = 0;
  for (int64_t i = 0; i < n; ++i) hits |= static_cast<unsigned>((p[i] & mask) == mask);
  return hits != 0;
}

// Whether some element's exponent bits are all ones (inf or NaN) among `t`'s values, read as
// `Bits`.
template <typename Bits>
bool any_exponent_all_ones(const at::Tensor& t, Bits mask) {
  const auto* p = static_cast<const Bits*>(t.const_data_ptr());
  std::atomic<bool> found{false};
  at::parallel_for(0, t.numel(), kGrain, [&](int64_t begin, int64_t end) {
    if (found.load(std::memory_order_relaxed)) return;
    if (range_has_all_ones<Bits>(p + begin, end - begin, mask)) found.store(true, std::memory_order_relaxed);
  });
  return found.load();
}

// Whether `t` holds an inf or NaN, scanned by its bits: nullopt unless `t` is a contiguous
// CPU tensor of a floating type (libtorch's check takes the others).
std::optional<bool> scanned_non_finite(const at::Tensor& t) {
  if (!(t.is_cpu() && t.layout() == at::kStrided && t.is_contiguous())) return std::nullopt;
  switch (t.scalar_type()) {
    case at::kHalf:
      return any_exponent_all_ones<uint16_t>(t, 0x7C00);
    case at::kBFloat16:
      return any_exponent_all_ones<uint16_t>(t, 0x7F80);
    case at::kFloat:
      return any_exponent_all_ones<uint32_t>(t, 0x7F800000u);
    case at::kDouble:
      return any_exponent_all_ones<uint64_t>(t, 0x7FF0000000000000ull);
    default:
      return std::nullopt;
  }
}

#ifdef TCH_AMP_X86
__attribute__((target("avx2,f16c"))) void half_to_float_scaled_f16c(const uint16_t* src, float* dst, int64_t n,
                                                                     float inv) {
  const __m256 s = _mm256_set1_ps(inv);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtph_ps(h), s));
  }
  for (; i < n; ++i) dst[i] = _cvtsh_ss(src[i]) * inv;
}
#endif

void half_to_float_scaled(const at::Half* src, float* dst, int64_t n, float inv) {
#ifdef TCH_AMP_X86
  if (tch_amp::cpu_has_avx2_fma_f16c()) {
    half_to_float_scaled_f16c(reinterpret_cast<const uint16_t*>(src), dst, n, inv);
    return;
  }
#endif
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]) * inv;
}

void bf16_to_float_scaled(const uint16_t* src, float* dst, int64_t n, float inv) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t bits = static_cast<uint32_t>(src[i]) << 16;
    float f;
    std::memcpy(&f, &bits, sizeof f);
    dst[i] = f * inv;
  }
}

}  // namespace

extern "C" {

// found_inf (a 1-element fp32 tensor) becomes 1 when any element of any of `grads` is inf or
// NaN; the gradients are only read. Contiguous CPU tensors are scanned by their bits (one read,
// no allocation, no host sync beyond the CPU itself); any other goes through libtorch's
// `_amp_foreach_non_finite_check_and_unscale_` with a scale of exactly 1 (bf16 on CUDA through
// an fp32 copy).
char* tch_amp_non_finite_check_(at::Tensor** grads, int n, at::Tensor* found_inf) {
  TCH_AMP_PROTECT({
    std::vector<at::Tensor> other;
    bool found = false;
    for (int i = 0; i < n && !found; ++i) {
      const at::Tensor& g = *grads[i];
      if (!g.defined()) continue;
      const std::optional<bool> scanned = found_inf->is_cpu() ? scanned_non_finite(g) : std::nullopt;
      if (scanned.has_value()) {
        found = *scanned;
      } else {
        other.push_back(g);
      }
    }
    if (found) {
      found_inf->fill_(1.0);  // nothing else can change the flag
    } else if (!other.empty()) {
      at::Tensor one = at::ones({1}, found_inf->options());
      tch_amp::non_finite_check_and_unscale(other, *found_inf, one, true);
    }
  })
}

// dst = fp32(src) * inv_scale: src an fp16/bf16 tensor, dst an fp32 tensor of as many elements,
// inv_scale a 1-element fp32 tensor. One pass for contiguous CPU tensors; otherwise
// dst.copy_(src) then dst.mul_(inv_scale), the same values.
char* tch_amp_unscale_into_(at::Tensor* dst, at::Tensor* src, at::Tensor* inv_scale) {
  TCH_AMP_PROTECT({
    TORCH_CHECK(dst->numel() == src->numel(), "unscale_into: ", dst->numel(), " destination elements for ",
                src->numel(), " source elements");
    const bool fast = dst->is_cpu() && src->is_cpu() && inv_scale->is_cpu() && dst->is_contiguous() &&
                      src->is_contiguous() && dst->scalar_type() == at::kFloat &&
                      inv_scale->scalar_type() == at::kFloat && inv_scale->numel() == 1 &&
                      (src->scalar_type() == at::kHalf || src->scalar_type() == at::kBFloat16);
    if (!fast) {
      dst->copy_(src->reshape(dst->sizes()));
      dst->mul_(*inv_scale);
      return nullptr;
    }
    const float inv = inv_scale->item<float>();
    float* out = dst->data_ptr<float>();
    const bool half = src->scalar_type() == at::kHalf;
    const void* in = src->const_data_ptr();
    at::parallel_for(0, dst->numel(), kGrain, [&](int64_t begin, int64_t end) {
      if (half) {
        half_to_float_scaled(static_cast<const at::Half*>(in) + begin, out + begin, end - begin, inv);
      } else {
        bf16_to_float_scaled(static_cast<const uint16_t*>(in) + begin, out + begin, end - begin, inv);
      }
    });
  })
}

}  // extern "C"

