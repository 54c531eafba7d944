// O1's cast policy as libtorch dispatcher kernels: what the three translation units share.
//
// - cast_cache.cpp:  the per-thread weight-cast cache and `cast_tensor`.
// - cast_kernel.cpp: the boxed kernel registered per op overload at AutocastCPU/AutocastCUDA.
// - cast_engine.cpp: the process-wide registration (once per op, never undone) and the
//                    extern "C" entry points.
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
// Bits of the emulated-dtype mask the Rust side sends (src/sys/cast.rs).
constexpr uint8_t kEmulateHalf = 1;
constexpr uint8_t kEmulateBFloat16 = 2;

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
  std::vector<uint8_t> emulate;  // CPU only
  // Which 16-bit types the CPU emulation handles (kEmulateHalf | kEmulateBFloat16); ops whose
  // inputs are of another type run libtorch's native kernel.
  uint8_t emulate_dtypes = 0;
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
  bool emulates_dtype(at::ScalarType t) const {
    return (t == at::kHalf && (emulate_dtypes & kEmulateHalf) != 0) ||
           (t == at::kBFloat16 && (emulate_dtypes & kEmulateBFloat16) != 0);
  }
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
void cache_clear();
size_t cache_len();

// ---- cast_kernel.cpp --------------------------------------------------------------------------
// The boxed kernel for op `id` at `dev`'s Autocast key; `native` is libtorch's own kernel there.
torch::CppFunction make_cast_kernel(size_t id, int dev, bool inplace, std::optional<c10::SafeKernelFunction> native);
// "name" or "name.overload", without the "aten::" namespace.
std::string op_display(const c10::OperatorName& name);

}  // namespace tch_amp::cast

// ---- The C boundary (cast_engine.cpp) -----------------------------------------------------------
extern "C" {
// One op of a policy, as the Rust side sends it (src/sys/cast.rs, CastEntry): a device index
// (kCpu/kCuda), a category (Category, or kEmulate), and the aten op's name and overload ("" for
// the default overload).
struct tch_amp_cast_entry {
  int device;
  int category;
  const char* name;
  const char* overload;
};
// Receives one string of a list (the Rust side collects them).
typedef void (*tch_amp_string_sink)(void* ctx, const char* s);
}
