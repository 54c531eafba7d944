// O1's rounded weight copies (weight_copies.cpp): with CPU emulation, each forward needs every
// fp32 weight of an emulated GEMM/convolution as the fp32 tensor of its fp16 (bf16) values. A
// weight the previous forward used exactly once gets that tensor from one autograd node
// (`round_weight`, round_through.cpp) instead of a cast to fp16 and one back; tch-amp's fused
// Adam/AdamW writes it in the same pass as the update (o2_adam.cpp), and this registry keeps it
// until the weight changes. Used by cast_cache.cpp (forward) and o2_adam.cpp (the step).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <optional>
#include <vector>

namespace tch_amp::weight_copies {

// The process-wide switch for the copies (on by default); returns the previous setting. Off, no
// copy is written or kept; weights used once still get one rounding node, made in the forward.
bool set_enabled(bool on);
bool enabled();

// How the weight-cast cache's lifetime that just ended used one fp32 weight: `single` when the
// weight was rounded to `low` for emulated ops exactly once, and for nothing else.
struct Use {
  at::Tensor weight;
  at::ScalarType low;
  bool single;
};
// Records the uses of one cache lifetime (a weight not named keeps what it had) and forgets
// the weights that no longer exist.
void note_uses(const std::vector<Use>& uses);

// Whether the last recorded use of `w` was a single rounding to `low` (the forward may then
// give it one rounding node).
bool single_use(const at::Tensor& w, at::ScalarType low);

// The copy of `w` rounded to `low` written at its current version, else undefined.
at::Tensor lookup(const at::Tensor& w, at::ScalarType low);

// For the optimizer, before it updates `w`: the dtype to round `w` to and the fp32 buffer to
// write the copy into (the previous copy when nothing else holds it), or nullopt when no copy
// is wanted.
std::optional<std::pair<at::ScalarType, at::Tensor>> wanted(const at::Tensor& w);
// Records `copy` as `w`'s rounded copy at `w`'s current version (after its update).
void store(const at::Tensor& w, at::ScalarType low, const at::Tensor& copy);

// `w`'s copy when it is current (a detached alias), else undefined.
at::Tensor current(const at::Tensor& w);

// A weight given one rounding node that a later op of the same forward used again.
void note_demoted();

struct Stats {
  int64_t copies = 0;   // copies kept (a dead weight's until the next note_uses)
  int64_t bytes = 0;    // their bytes
  // On the calling thread, since it started:
  int64_t served = 0;   // forward uses served from a copy
  int64_t rounded = 0;  // forward uses given one rounding node without a copy
  int64_t demoted = 0;  // weights given one that the same forward used again
  int64_t in_place = 0; // gradients rounded in place by a rounding node's backward
};
Stats stats();
void note_rounded();
// A rounding node's backward rounded its gradient in place (round_through.cpp).
void note_rounded_in_place();

}  // namespace tch_amp::weight_copies
