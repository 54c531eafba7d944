// O1's cast policy as libtorch dispatcher kernels: what the four translation units share.
//
// - cast_cache.cpp:     the per-thread weight-cast cache and `cast_tensor`.
// - cast_kernel.cpp:    the boxed kernel registered per op overload at AutocastCPU/AutocastCUDA.
// - cast_emulation.cpp: the CPU emulation of one fp16/bf16 op and its autograd node.
// - cast_engine.cpp:    the process-wide registration (once per op, never undone) and the
//                       extern "C" entry points.
//
// What a kernel does is decided per call from the calling thread's active policy (a
// thread-local pointer set by the Rust side). A thread with no tch-amp policy gets exactly
// what it would get without tch-amp: libtorch's own autocast kernel for that op (captured
// before ours replaced it), or the fallthrough for ops libtorch does not list.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace tch_amp::cast {

// The categories a policy assigns; the numbers are the ones the Rust side sends
// (src/sys/cast.rs, EngineCategory).
enum class Category : uint8_t { Passthrough = 0, LowPrecision = 1, Fp32 = 2, Promote = 3, Banned = 4 };
constexpr int kEmulate = 5;  // an entry category only: CPU emulation of the op
// Bits of an emulated op's entry in a policy: the 16-bit types it is emulated for (the mask the
// Rust side sends, src/sys/cast.rs) and how its backward runs (cast_emulation.cpp).
constexpr uint8_t kEmulateHalf = 1;
constexpr uint8_t kEmulateBFloat16 = 2;
constexpr uint8_t kEmulateRecompute = 4;

// Index of a device type in per-device tables (0 = CPU, 1 = CUDA), as the Rust side sends it.
constexpr int kCpu = 0;
constexpr int kCuda = 1;
constexpr int kDevices = 2;

inline c10::DeviceType device_type_of(int dev) { return dev == kCpu ? c10::DeviceType::CPU : c10::DeviceType::CUDA; }
inline c10::DispatchKey autocast_key_of(int dev) {
  return dev == kCpu ? c10::DispatchKey::AutocastCPU : c10::DispatchKey::AutocastCUDA;
}

// A resolved policy: a category per registered op id and device, and the CPU emulation set.
// Immutable once built, shared between threads through shared_ptr.
struct Policy {
  std::vector<uint8_t> category[kDevices];
  // CPU only, per op: kEmulateHalf | kEmulateBFloat16 (the 16-bit types emulated; ops whose
  // inputs are of another type run libtorch's native kernel) | kEmulateRecompute.
  std::vector<uint8_t> emulate;
  bool allow_banned = false;
  // CPU emulation on and no cast lists: the policy O2/O3 use for half models.
  bool emulation_only = false;
  // torch.amp's autocast with CPU emulation: every op gets libtorch's own autocast kernel
  // except the emulated ones on CPU, which are cast as libtorch casts them (its weight cache
  // included) and then emulated. `category` holds libtorch's CPU lists.
  bool torch_autocast = false;
  // CPU emulation on and some cast lists: the same emulation set with no cast lists, under
  // which a cast op's internals run.
  std::shared_ptr<const Policy> inner;

  Category category_of(size_t id, int dev) const {
    const auto& v = category[dev];
    return id < v.size() ? static_cast<Category>(v[id]) : Category::Passthrough;
  }
  bool emulated(size_t id) const { return id < emulate.size() && emulate[id] != 0; }
  bool emulates(size_t id, at::ScalarType t) const {
    if (!emulated(id)) return false;
    return (t == at::kHalf && (emulate[id] & kEmulateHalf) != 0) ||
           (t == at::kBFloat16 && (emulate[id] & kEmulateBFloat16) != 0);
  }
  bool recomputes(size_t id) const { return emulated(id) && (emulate[id] & kEmulateRecompute) != 0; }
};

// The calling thread's active policy (null: none). Defined in cast_engine.cpp.
extern thread_local std::shared_ptr<const Policy> tls_policy;

// ---- cast_kernel.cpp --------------------------------------------------------------------------
// Why the kernel refused an op (`tch_amp_refusal_*` in src/sys/cast.rs).
enum class RefusalCode : int { None = 0, BannedOp = 1, InPlaceFp32 = 2 };
// The calling thread's last refusal, kept until taken: the code, the op, the tensor's dtype
// and the exact message of the c10::Error thrown with it (so that the Rust side can tell that
// an error it holds is this refusal).
struct Refusal {
  RefusalCode code = RefusalCode::None;
  std::string op;
  at::ScalarType dtype = at::kFloat;
  std::string message;
};
// Returns the calling thread's last refusal and clears it.
Refusal take_refusal();
// How many ops the calling thread has run through the CPU emulation with inputs of `t` (fp16 or
// bf16) since it started.
uint64_t emulated_count(at::ScalarType t);

// ---- cast_cache.cpp ---------------------------------------------------------------------------
inline bool is_low(at::ScalarType t) { return t == at::kHalf || t == at::kBFloat16; }
// A tensor the kernel for `dev` may cast or count: defined, fp16/bf16/fp32/fp64, on that device
// type, and not a wrapped Python/Rust number (those follow type promotion, not casts).
bool eligible(const at::Tensor& t, int dev);
// Casts an eligible tensor to `to` (fp64 is never cast); model weights go through the cache.
at::Tensor cast_tensor(const at::Tensor& t, at::ScalarType to, int dev);
// A model weight, as the cache sees it: a leaf that requires grad (not a view, not inference).
bool cacheable_weight(const at::Tensor& t);
void cache_clear();
size_t cache_len();

// ---- cast_kernel.cpp --------------------------------------------------------------------------
// The boxed kernel for op `id` at `dev`'s Autocast key; `native` is libtorch's own kernel there.
torch::CppFunction make_cast_kernel(size_t id, int dev, bool inplace, std::optional<c10::SafeKernelFunction> native);
// "name" or "name.overload", without the "aten::" namespace.
std::string op_display(const c10::OperatorName& name);

// ---- cast_emulation.cpp -----------------------------------------------------------------------
// Runs `op` on the top `nargs` stack entries (every eligible floating one of type `low`) in fp32
// and rounds its floating outputs to `low`; under autograd, one node keeps the 16-bit inputs for
// backward (`recompute`: backward reruns the fp32 op instead of replaying its recorded graph).
void run_emulated_op(const c10::OperatorHandle& op, c10::DispatchKeySet below, torch::jit::Stack* stack, size_t nargs,
                     at::ScalarType low, bool recompute);

}  // namespace tch_amp::cast

// ---- The C boundary (cast_engine.cpp) -----------------------------------------------------------
extern "C" {
// One op of a policy, as the Rust side sends it (src/sys/cast.rs, CastEntry): a device index
// (kCpu/kCuda), a category (Category, or kEmulate), the aten op's name and overload ("" for
// the default overload), and for kEmulate the bits kEmulateHalf | kEmulateBFloat16 |
// kEmulateRecompute (0 otherwise).
struct tch_amp_cast_entry {
  int device;
  int category;
  const char* name;
  const char* overload;
  int emulate;
};
// Receives one string of a list (the Rust side collects them).
typedef void (*tch_amp_string_sink)(void* ctx, const char* s);
}
