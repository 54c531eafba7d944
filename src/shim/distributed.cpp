// Distributed training on libtorch's c10d: a TCPStore rendezvous, a ProcessGroup with a Gloo
// backend (NCCL through src/shim/nccl/ when built with the `nccl` feature), the collectives
// tch-amp exposes, c10d::Reducer with a communication hook that implements Apex DDP's options,
// SyncBatchNorm as an autograd function, and torch's seeded randperm (DistributedSampler).
//
// Every extern "C" function returns NULL or an owned message (TCH_AMP_PROTECT). c10d's own
// error classes are tagged in the message ("[store] ", "[network] ", "[backend] ", "[dist] ") so
// the Rust side can tell a rendezvous failure from a collective one.
//
// ProcessGroupGloo.hpp needs gloo's headers, which the torch wheel does not ship: the
// declaration-only stand-ins in src/shim/gloo_stub/ (see its README) take their place. The
// Gloo options come from libtorch's own factory (Options::create_default); the one object
// this file allocates from that header, the ProcessGroupGloo, is checked below against the
// size each supported libtorch allocates for it.
#define USE_C10D_GLOO 1

#include "amp_shim.h"

#include <ATen/ATen.h>
#include <ATen/CPUGeneratorImpl.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/grad_mode.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/comm.hpp>
#include <torch/csrc/distributed/c10d/reducer.hpp>
#include <torch/version.h>

#include <chrono>
#include <cstdlib>
#include <limits>
#include <string>
#include <vector>

// sizeof(c10d::ProcessGroupGloo) as each supported libtorch allocates it: the operator new
// argument in c10d::ProcessGroupGloo::split of its libtorch_cpu.so (scripts/gloo-layout.sh
// prints it). This file allocates the class with the size its headers and the gloo stand-ins
// give, so the two must agree; the stand-ins only ever sit behind pointers, so they do for
// every libtorch listed here.
#if TORCH_VERSION_MAJOR == 2 && (TORCH_VERSION_MINOR == 11 || TORCH_VERSION_MINOR == 13)
static_assert(sizeof(c10d::ProcessGroupGloo) == 0x1e8,
              "c10d::ProcessGroupGloo as declared by these headers and src/shim/gloo_stub/ differs in "
              "size from the one libtorch allocates (0x1e8 bytes in torch 2.11 and 2.13, see "
              "scripts/gloo-layout.sh): update the stand-ins or the table in src/shim/distributed.cpp");
#else
#error "tch-amp's distributed shim knows the size of c10d::ProcessGroupGloo for torch 2.11 and 2.13 only: \
run scripts/gloo-layout.sh on this libtorch and add its size to the table in src/shim/distributed.cpp"
#endif

namespace {

using ms = std::chrono::milliseconds;

// Rethrows the exception in flight, c10d's distributed errors with a tag in front of the message.
[[noreturn]] void rethrow_tagged() {
  try {
    throw;
  } catch (const c10::DistStoreError& e) {
    throw std::runtime_error(std::string("[store] ") + e.what_without_backtrace());
  } catch (const c10::DistNetworkError& e) {
    throw std::runtime_error(std::string("[network] ") + e.what_without_backtrace());
  } catch (const c10::DistBackendError& e) {
    throw std::runtime_error(std::string("[backend] ") + e.what_without_backtrace());
  } catch (const c10::DistError& e) {
    throw std::runtime_error(std::string("[dist] ") + e.what_without_backtrace());
  }
}

}  // namespace

#define TCH_AMP_DIST_PROTECT(...) \
  TCH_AMP_PROTECT(try { __VA_ARGS__; } catch (const c10::DistError&) { rethrow_tagged(); })

// A process group as the Rust side holds it.
struct TchAmpPg {
  c10::intrusive_ptr<c10d::Store> store;  // the TCPStore itself (no prefix)
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  c10::intrusive_ptr<c10d::Backend> backend;
  int rank;
  int size;
  ms timeout;
  bool gloo;
};

#ifdef TCH_AMP_NCCL
// Defined in src/shim/nccl/distributed_nccl.cpp, compiled with the cargo feature `nccl`.
c10::intrusive_ptr<c10d::Backend> tch_amp_make_nccl_backend(
    const c10::intrusive_ptr<c10d::Store>& store, int rank, int size, ms timeout);
#endif

namespace {

c10d::ReduceOp reduce_op(int op) {
  switch (op) {
    case 0:
    case 1:
      return c10d::ReduceOp::SUM;  // 1 (average) is a sum divided afterwards
    case 2:
      return c10d::ReduceOp::MAX;
    case 3:
      return c10d::ReduceOp::MIN;
    case 4:
      return c10d::ReduceOp::PRODUCT;
    default:
      TORCH_CHECK(false, "unknown reduce op code ", op);
  }
}

void wait_all(std::vector<c10::intrusive_ptr<c10d::Work>>& works, ms timeout) {
  // Every work is waited for even after a failure, so that no collective is left running on
  // tensors the caller is about to free; the first error is rethrown.
  std::exception_ptr first;
  for (auto& w : works) {
    try {
      w->wait(timeout);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

// Allreduce of one tensor (average = sum, then division by the group size).
c10::intrusive_ptr<c10d::Work> start_allreduce(TchAmpPg* h, at::Tensor& t, int op) {
  std::vector<at::Tensor> v{t};
  c10d::AllreduceOptions o;
  o.reduceOp = reduce_op(op);
  o.timeout = h->timeout;
  return h->pg->allreduce(v, o);
}

}  // namespace

extern "C" {

// Whether this build has the NCCL backend.
int tch_amp_dist_has_nccl() {
#ifdef TCH_AMP_NCCL
  return 1;
#else
  return 0;
#endif
}

// Rendezvous through a TCPStore at host:port (a server on this process when is_server, a
// client otherwise), then a ProcessGroup with one backend ("gloo" or "nccl") whose store keys
// carry the prefixes torch.distributed.init_process_group gives the default group
// ("default_pg", "0/", "cpu/" or "cuda/"), so a Python rank can join the same group.
char* tch_amp_dist_init(const char* host, int port, int rank, int world_size, int is_server,
                        int64_t timeout_ms, const char* backend, TchAmpPg** out) {
  TCH_AMP_DIST_PROTECT({
    *out = nullptr;
    TORCH_CHECK(world_size >= 1, "world_size must be at least 1, got ", world_size);
    TORCH_CHECK(rank >= 0 && rank < world_size, "rank ", rank, " is outside 0..", world_size);
    TORCH_CHECK(port >= 0 && port < 65536, "port ", port, " is outside 0..65535");
    std::string be(backend);
    TORCH_CHECK(be == "gloo" || be == "nccl", "unknown backend ", be, " (expected gloo or nccl)");
    ms timeout(timeout_ms);
    c10d::TCPStoreOptions so;
    so.port = static_cast<std::uint16_t>(port);
    so.isServer = is_server != 0;
    so.numWorkers = static_cast<std::size_t>(world_size);
    so.waitWorkers = true;
    so.timeout = timeout;
    so.multiTenant = is_server != 0;
    auto tcp = c10::make_intrusive<c10d::TCPStore>(std::string(host), so);
    tcp->setTimeout(timeout);
    c10::intrusive_ptr<c10d::Store> store = tcp;
    auto default_pg = c10::make_intrusive<c10d::PrefixStore>("default_pg", store);
    auto group = c10::make_intrusive<c10d::PrefixStore>("0/", default_pg);
    auto pg = c10::make_intrusive<c10d::ProcessGroup>(group, rank, world_size);
    c10::intrusive_ptr<c10d::Backend> b;
    if (be == "gloo") {
      auto dev_store = c10::make_intrusive<c10d::PrefixStore>("cpu/", group);
      // libtorch allocates and fills the options as torch.distributed does (the devices of
      // GLOO_SOCKET_IFNAME or the host's default one, TORCH_GLOO_LAZY_INIT, two threads per
      // device); only Backend::Options' public fields are set here.
      auto opts = c10d::ProcessGroupGloo::Options::create_default(timeout);
      opts->timeout = timeout;
      opts->group_name = "0";
      auto gloo = c10::make_intrusive<c10d::ProcessGroupGloo>(dev_store, rank, world_size, opts);
      gloo->setSequenceNumberForGroup();
      b = gloo;
      pg->setDefaultBackend(c10d::ProcessGroup::BackendType::GLOO);
      pg->setBackend(c10::DeviceType::CPU, c10d::ProcessGroup::BackendType::GLOO, b);
      pg->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::GLOO, b);
    } else {
#ifdef TCH_AMP_NCCL
      auto dev_store = c10::make_intrusive<c10d::PrefixStore>("cuda/", group);
      b = tch_amp_make_nccl_backend(dev_store, rank, world_size, timeout);
#else
      TORCH_CHECK(false,
                  "[unsupported] tch-amp was built without NCCL: rebuild with `--features nccl` "
                  "(needs the CUDA, cccl and NCCL headers), or use the gloo backend");
#endif
      pg->setDefaultBackend(c10d::ProcessGroup::BackendType::NCCL);
      pg->setBackend(c10::DeviceType::CUDA, c10d::ProcessGroup::BackendType::NCCL, b);
    }
    pg->setGroupName("0");
    pg->setGroupDesc("default_pg");
    *out = new TchAmpPg{store, pg, b, rank, world_size, timeout, be == "gloo"};
  })
}

// Frees a process group. Destructors must not throw into Rust: an error here (a backend that
// fails to shut down cleanly) is dropped, the handle is gone either way.
void tch_amp_dist_free(TchAmpPg* h) {
  try {
    delete h;
  } catch (...) {
  }
}

// Changes the timeout of every later collective (and of the store).
char* tch_amp_dist_set_timeout(TchAmpPg* h, int64_t timeout_ms) {
  TCH_AMP_DIST_PROTECT({
    h->timeout = ms(timeout_ms);
    h->pg->setTimeout(h->timeout);
    h->store->setTimeout(h->timeout);
  })
}

char* tch_amp_dist_barrier(TchAmpPg* h) {
  TCH_AMP_DIST_PROTECT({
    c10d::BarrierOptions o;
    o.timeout = h->timeout;
    auto w = h->pg->barrier(o);
    w->wait(h->timeout);
  })
}

// In place: every tensor of `ts` takes the value it has on `root`. One collective per tensor.
char* tch_amp_dist_broadcast(TchAmpPg* h, at::Tensor** ts, int n, int root) {
  TCH_AMP_DIST_PROTECT({
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (int i = 0; i < n; ++i) {
      std::vector<at::Tensor> v{*ts[i]};
      c10d::BroadcastOptions o;
      o.rootRank = root;
      o.timeout = h->timeout;
      works.push_back(h->pg->broadcast(v, o));
    }
    wait_all(works, h->timeout);
  })
}

// In place, as torch's DDP syncs module states: tensors flattened into buffers of at most
// `buffer_size` bytes (c10d::broadcast_coalesced), broadcast from `root`.
char* tch_amp_dist_broadcast_coalesced(TchAmpPg* h, at::Tensor** ts, int n, int64_t buffer_size,
                                       int root) {
  TCH_AMP_DIST_PROTECT({
    std::vector<at::Tensor> v;
    v.reserve(n);
    for (int i = 0; i < n; ++i) v.push_back(*ts[i]);
    if (!v.empty()) {
      c10d::broadcast_coalesced(h->pg, v, static_cast<size_t>(buffer_size), root);
    }
  })
}

// In place: op 0 sum, 1 average (sum / group size), 2 max, 3 min, 4 product. One collective
// per tensor, all started before the first wait.
char* tch_amp_dist_allreduce(TchAmpPg* h, at::Tensor** ts, int n, int op) {
  TCH_AMP_DIST_PROTECT({
    for (int i = 0; i < n; ++i) {
      TORCH_CHECK(op != 1 || at::isFloatingType(ts[i]->scalar_type()) ||
                      at::isComplexType(ts[i]->scalar_type()),
                  "average needs a floating-point tensor, got ", ts[i]->scalar_type(),
                  ": allreduce with sum and divide yourself");
    }
    std::vector<c10::intrusive_ptr<c10d::Work>> works;
    for (int i = 0; i < n; ++i) works.push_back(start_allreduce(h, *ts[i], op));
    wait_all(works, h->timeout);
    if (op == 1) {
      for (int i = 0; i < n; ++i) ts[i]->div_(static_cast<double>(h->size));
    }
  })
}

// out[r] (new tensors, r in 0..size) = `t` as rank r holds it. Same shape and dtype everywhere.
char* tch_amp_dist_allgather(TchAmpPg* h, at::Tensor* t, at::Tensor** out) {
  TCH_AMP_DIST_PROTECT({
    std::vector<at::Tensor> input{t->contiguous()};
    std::vector<std::vector<at::Tensor>> outputs(1);
    for (int r = 0; r < h->size; ++r) outputs[0].push_back(at::empty_like(input[0]));
    c10d::AllgatherOptions o;
    o.timeout = h->timeout;
    auto w = h->pg->allgather(outputs, input, o);
    w->wait(h->timeout);
    for (int r = 0; r < h->size; ++r) out[r] = new at::Tensor(outputs[0][r]);
  })
}

// Whether autograd records operations on this thread (torch.is_grad_enabled()).
char* tch_amp_grad_mode_enabled(int* enabled) {
  TCH_AMP_PROTECT(*enabled = at::GradMode::is_enabled() ? 1 : 0)
}

// torch.randperm(n, generator=torch.Generator().manual_seed(seed)): a fresh CPU generator with
// this seed, int64 result (DistributedSampler's shuffle).
char* tch_amp_randperm_seeded(int64_t n, uint64_t seed, at::Tensor** out) {
  TCH_AMP_PROTECT({
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
    {
      std::lock_guard<std::mutex> lock(gen.mutex());
      gen.set_current_seed(seed);
    }
    *out = new at::Tensor(at::randperm(n, gen, at::TensorOptions().dtype(at::kLong)));
  })
}

}  // extern "C"

// ---- Data parallel: c10d::Reducer with Apex DDP's options as a communication hook ---------

namespace {

struct ApexHookState {
  c10::intrusive_ptr<c10d::ProcessGroup> pg;
  bool allreduce_always_fp32;
  double predivide;  // gradient_predivide_factor
  double post;       // factor applied after the allreduce
};

// Apex's allreduce of a flat bucket: optionally in fp32, divided by the predivide factor before
// the sum and by world_size / predivide after it (when averaging).
class ApexCommHook : public c10d::CppCommHookInterface<ApexHookState> {
 public:
  explicit ApexCommHook(ApexHookState s) : c10d::CppCommHookInterface<ApexHookState>(std::move(s)) {}

  c10::intrusive_ptr<c10::ivalue::Future> runHook(c10d::GradBucket& bucket) override {
    at::Tensor buffer = bucket.getBufferRef();
    bool upcast = state_.allreduce_always_fp32 && buffer.scalar_type() != at::kFloat;
    at::Tensor comm = upcast ? buffer.to(at::kFloat) : buffer;
    if (state_.predivide != 1.0) comm.mul_(1.0 / state_.predivide);
    std::vector<at::Tensor> v{comm};
    auto fut = state_.pg->allreduce(v)->getFuture();
    double post = state_.post;
    return fut->then(
        [buffer, comm, post, upcast](c10::ivalue::Future& f) -> c10::IValue {
          (void)f.value();  // rethrows the allreduce's error
          if (post != 1.0) comm.mul_(post);
          if (upcast) {
            buffer.copy_(comm);
            return c10::IValue(buffer);
          }
          return c10::IValue(comm);
        },
        c10::TensorType::get());
  }

  at::Tensor parseHookResult(const c10::IValue& result) override {
    if (result.isTensor()) return result.toTensor();
    return result.toTensorVector().at(0);
  }
};

}  // namespace

struct TchAmpDdp {
  // Owned; a raw pointer so that tch_amp_ddp_free can catch what ~Reducer (noexcept(false))
  // throws, which a smart pointer's noexcept reset would turn into std::terminate.
  c10d::Reducer* reducer;
  bool find_unused;
};

extern "C" {

// A Reducer over `params` (the model's trainable variables) as torch's DDP builds it: the
// shapes checked against every rank (verify_params_across_processes), one bucket for the first
// iteration, then buckets of `bucket_bytes` rebuilt in the order gradients became ready;
// gradients allreduced by ApexCommHook (average divides by world_size, after the sum unless
// `predivide` says otherwise).
char* tch_amp_ddp_new(TchAmpPg* h, at::Tensor** params, int n, int64_t bucket_bytes,
                      int64_t first_bucket_bytes, int find_unused, int always_fp32,
                      double predivide, int average, TchAmpDdp** out) {
  TCH_AMP_DIST_PROTECT({
    *out = nullptr;
    TORCH_CHECK(n > 0, "no trainable variable to synchronize");
    TORCH_CHECK(predivide > 0.0, "gradient_predivide_factor must be positive");
    std::vector<at::Tensor> ps;
    ps.reserve(n);
    for (int i = 0; i < n; ++i) ps.push_back(*params[i]);
    c10d::verify_params_across_processes(h->pg, ps, std::nullopt);
    std::vector<bool> sparse(ps.size(), false);
    std::vector<size_t> first_limits{std::numeric_limits<size_t>::max()};
    if (find_unused != 0) {
      first_limits = {static_cast<size_t>(first_bucket_bytes), static_cast<size_t>(bucket_bytes)};
    }
    auto assignment = c10d::compute_bucket_assignment_by_size(ps, first_limits, sparse);
    auto buckets = std::get<0>(assignment);
    std::reverse(buckets.begin(), buckets.end());
    auto reducer = std::make_unique<c10d::Reducer>(
        ps, buckets, h->pg, sparse, bucket_bytes, find_unused != 0,
        /*gradient_as_bucket_view=*/false, std::unordered_map<size_t, std::string>{},
        first_bucket_bytes, /*skip_all_reduce_unused_params=*/false,
        /*use_python_reducer=*/false, std::vector<int64_t>{});
    double post = 1.0;
    if (average != 0 && predivide != static_cast<double>(h->size)) {
      post = predivide / static_cast<double>(h->size);
    }
    reducer->register_comm_hook(std::make_unique<ApexCommHook>(
        ApexHookState{h->pg, always_fp32 != 0, predivide, post}));
    *out = new TchAmpDdp{reducer.release(), find_unused != 0};
  })
}

// Frees a Reducer (its destructor removes the autograd hooks and is noexcept(false): an error
// is dropped, as in tch_amp_dist_free).
void tch_amp_ddp_free(TchAmpDdp* d) {
  try {
    delete d->reducer;
  } catch (...) {
  }
  delete d;
}

// Before a forward with autograd on: prepare_for_forward when gradients are to be synced,
// then the one-time bucket rebuild (a broadcast from rank 0, in the second iteration).
char* tch_amp_ddp_pre_forward(TchAmpDdp* d, int sync) {
  TCH_AMP_DIST_PROTECT({
    if (!at::GradMode::is_enabled()) return nullptr;
    if (sync != 0) d->reducer->prepare_for_forward();
    d->reducer->rebuild_buckets();
  })
}

// After the forward: expect one backward whose gradients are reduced (with find_unused, the
// outputs tell which parameters took part).
char* tch_amp_ddp_post_forward(TchAmpDdp* d, at::Tensor** outputs, int n) {
  TCH_AMP_DIST_PROTECT({
    if (!at::GradMode::is_enabled()) return nullptr;
    std::vector<at::Tensor> outs;
    if (d->find_unused) {
      for (int i = 0; i < n; ++i) outs.push_back(*outputs[i]);
    }
    d->reducer->prepare_for_backward(outs);
  })
}

}  // extern "C"

// ---- SyncBatchNorm ------------------------------------------------------------------------

namespace {

// Dimensions reduced by batch norm: all but the channel dimension 1.
std::vector<int64_t> reduce_dims(const at::Tensor& x) {
  std::vector<int64_t> dims{0};
  for (int64_t d = 2; d < x.dim(); ++d) dims.push_back(d);
  return dims;
}

// [C] -> [1, C, 1, ...] for broadcasting against x.
at::Tensor per_channel(const at::Tensor& v, const at::Tensor& x) {
  std::vector<int64_t> shape(x.dim(), 1);
  shape[1] = v.numel();
  return v.view(shape);
}

c10::intrusive_ptr<c10d::ProcessGroup> pg_of(torch::autograd::AutogradContext* ctx) {
  return c10::static_intrusive_pointer_cast<c10d::ProcessGroup>(ctx->saved_data["pg"].toCapsule());
}

// Batch norm over the batch of every rank (training mode). The statistics: per-rank mean,
// biased variance (CPU) or inverse std (CUDA) and count, all-gathered; the combined mean and
// variance normalize the input and update the running statistics. Backward: the per-channel
// sums of dy and dy*(x-mean) are all-reduced, as torch.nn.SyncBatchNorm does. CUDA uses
// libtorch's batch_norm_* kernels; on CPU (where those kernels do not exist) the same formulas
// in fp32 ATen ops.
struct SyncBnFunction : public torch::autograd::Function<SyncBnFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& input_,
                            const at::Tensor& weight, const at::Tensor& bias,
                            at::Tensor running_mean, at::Tensor running_var, double eps,
                            double momentum, c10::intrusive_ptr<c10d::ProcessGroup> pg,
                            int64_t timeout_ms) {
    TORCH_CHECK(input_.dim() >= 2, "SyncBatchNorm expects an input with a channel dimension, got ",
                input_.sizes());
    at::Tensor input = input_.contiguous();
    const int64_t channels = input.size(1);
    const int64_t world = pg->getSize();
    const bool cuda = input.is_cuda();
    const auto fopts = input.options().dtype(at::kFloat);
    const double count = static_cast<double>(input.numel() / std::max<int64_t>(channels, 1));
    ms timeout(timeout_ms);

    at::Tensor local_mean, local_second;  // second: invstd (CUDA) or biased var (CPU)
    if (cuda) {
      std::tie(local_mean, local_second) = at::batch_norm_stats(input, eps);
    } else {
      auto x = input.to(at::kFloat);
      auto vm = at::var_mean(x, reduce_dims(x), /*correction=*/0, /*keepdim=*/false);
      local_second = std::get<0>(vm);
      local_mean = std::get<1>(vm);
    }
    auto combined = at::cat({local_mean.to(at::kFloat), local_second.to(at::kFloat),
                             at::full({1}, count, fopts)});
    std::vector<at::Tensor> in{combined};
    std::vector<std::vector<at::Tensor>> gathered(1);
    for (int64_t r = 0; r < world; ++r) gathered[0].push_back(at::empty_like(combined));
    c10d::AllgatherOptions go;
    go.timeout = timeout;
    pg->allgather(gathered, in, go)->wait(timeout);
    auto all = at::stack(gathered[0]);  // [world, 2C+1]
    auto means = all.narrow(1, 0, channels);
    auto seconds = all.narrow(1, channels, channels);
    auto counts = all.narrow(1, 2 * channels, 1);

    at::Tensor mean, invstd;
    if (cuda) {
      std::tie(mean, invstd) = at::batch_norm_gather_stats_with_counts(
          input, means, seconds, running_mean, running_var, momentum, eps, counts.view(-1));
    } else {
      auto total = counts.sum();
      mean = (means * counts).sum(0) / total;
      auto var = (counts * (seconds + (means - mean).pow(2))).sum(0) / total;
      invstd = (var + eps).rsqrt();
      at::NoGradGuard no_grad;
      const double n = total.item<double>();
      if (running_mean.defined()) {
        running_mean.mul_(1.0 - momentum).add_(mean.to(running_mean.scalar_type()), momentum);
      }
      if (running_var.defined()) {
        auto unbiased = n > 1.0 ? var * (n / (n - 1.0)) : var;
        running_var.mul_(1.0 - momentum).add_(unbiased.to(running_var.scalar_type()), momentum);
      }
    }
    const double total_count = counts.sum().item<double>();

    at::Tensor out;
    if (cuda) {
      out = at::batch_norm_elemt(input, weight, bias, mean, invstd, eps);
    } else {
      // As libtorch's CPU batch norm: y = x * alpha + beta, alpha = invstd * w, beta = b - mean * alpha.
      auto alpha = weight.defined() ? invstd * weight.to(at::kFloat) : invstd;
      auto beta = bias.defined() ? bias.to(at::kFloat) - mean * alpha : -mean * alpha;
      auto x = input.to(at::kFloat);
      out = (x * per_channel(alpha, x) + per_channel(beta, x)).to(input.scalar_type());
    }
    ctx->save_for_backward({input, weight, mean, invstd});
    ctx->saved_data["pg"] = c10::IValue::make_capsule(pg);
    ctx->saved_data["count"] = total_count;
    ctx->saved_data["counts"] = counts.view(-1);
    ctx->saved_data["timeout_ms"] = timeout_ms;
    return out;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    at::Tensor input = saved[0], weight = saved[1], mean = saved[2], invstd = saved[3];
    auto pg = pg_of(ctx);
    const double n = ctx->saved_data["count"].toDouble();
    ms timeout(ctx->saved_data["timeout_ms"].toInt());
    at::Tensor grad_out = grads[0].contiguous();
    const int64_t channels = input.size(1);
    const bool need_input = ctx->needs_input_grad(0);
    const bool need_weight = weight.defined() && ctx->needs_input_grad(1);
    const bool need_bias = ctx->needs_input_grad(2);

    at::Tensor sum_dy, sum_dy_xmu, grad_weight, grad_bias;
    if (input.is_cuda()) {
      std::tie(sum_dy, sum_dy_xmu, grad_weight, grad_bias) = at::batch_norm_backward_reduce(
          grad_out, input, mean, invstd, weight, need_input, need_weight, need_bias);
    } else {
      auto x = input.to(at::kFloat);
      auto g = grad_out.to(at::kFloat);
      auto dims = reduce_dims(x);
      sum_dy = g.sum(dims);
      sum_dy_xmu = (g * (x - per_channel(mean, x))).sum(dims);
      if (need_weight) grad_weight = (sum_dy_xmu * invstd).to(weight.scalar_type());
      if (need_bias) grad_bias = sum_dy.to(weight.defined() ? weight.scalar_type() : at::kFloat);
    }
    at::Tensor grad_input;
    if (need_input) {
      auto combined = at::cat({sum_dy.to(at::kFloat), sum_dy_xmu.to(at::kFloat)});
      std::vector<at::Tensor> v{combined};
      c10d::AllreduceOptions ao;
      ao.timeout = timeout;
      pg->allreduce(v, ao)->wait(timeout);
      auto all_dy = combined.narrow(0, 0, channels);
      auto all_dy_xmu = combined.narrow(0, channels, channels);
      if (input.is_cuda()) {
        auto counts = ctx->saved_data["counts"].toTensor().to(input.device(), at::kInt);
        grad_input = at::batch_norm_backward_elemt(grad_out, input, mean, invstd, weight, all_dy,
                                                   all_dy_xmu, counts);
      } else {
        auto x = input.to(at::kFloat);
        auto g = grad_out.to(at::kFloat);
        auto mean_dy = all_dy / n;
        auto mean_dy_xmu = all_dy_xmu / n;
        auto scale = weight.defined() ? invstd * weight.to(at::kFloat) : invstd;
        auto xmu = x - per_channel(mean, x);
        auto gi = (g - per_channel(mean_dy, x) - xmu * per_channel(invstd * invstd * mean_dy_xmu, x)) *
                  per_channel(scale, x);
        grad_input = gi.to(input.scalar_type());
      }
    }
    return {grad_input, grad_weight, grad_bias, at::Tensor(), at::Tensor(),
            at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

extern "C" {

// Training-mode SyncBatchNorm forward (autograd-recorded). weight, bias, running_mean and
// running_var may be NULL.
char* tch_amp_sync_batch_norm(TchAmpPg* h, at::Tensor* input, at::Tensor* weight, at::Tensor* bias,
                              at::Tensor* running_mean, at::Tensor* running_var, double eps,
                              double momentum, at::Tensor** out) {
  TCH_AMP_DIST_PROTECT({
    *out = nullptr;
    auto opt = [](at::Tensor* t) { return t == nullptr ? at::Tensor() : *t; };
    auto y = SyncBnFunction::apply(*input, opt(weight), opt(bias), opt(running_mean),
                                   opt(running_var), eps, momentum, h->pg,
                                   static_cast<int64_t>(h->timeout.count()));
    *out = new at::Tensor(y);
  })
}

}  // extern "C"
