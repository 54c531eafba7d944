// The op observer of tch_amp::doctor (bound in src/sys/observer.rs): libtorch's RecordFunction
// callbacks, registered on one thread only while a session is open, report to a Rust sink
//  - every top-level aten op the thread calls outside backward (the ops user code calls; the
//    ops they call inside are not reported), with its floating outputs, the input dtypes and
//    which inputs are the session's weights;
//  - every autograd node that runs in a backward pass of a graph built by such an op and that
//    is the grad_fn of one of its outputs, with the gradients it receives (the gradients of the
//    op's outputs).
// RecordFunction callbacks registered on a thread travel with libtorch's thread-local state
// to the autograd threads that run that thread's backward (CUDA), so nodes are seen there too;
// sessions are found by the RecordFunction id of the thread that ran the forward.
//
// Nothing here runs without a session: the callbacks are added when a thread opens its first
// session and removed when it closes its last.
#include "amp_shim.h"

#include <ATen/ATen.h>
#include <ATen/SequenceNumber.h>
#include <ATen/record_function.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/autograd/function.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

extern "C" {
// One observation handed to the sink (src/sys/observer.rs, Observed). `tensors` are new
// handles owned by the sink from the call on.
struct tch_amp_observed {
  int kind;          // 0: a top-level op finished (outputs); 1: a backward node starts (gradients)
  const char* name;  // "conv2d" (aten op, no namespace) or the node's name
  int64_t op;        // the op's index since the session was opened or reset
  const int64_t* weights;  // indices of the session's weights among the inputs (kind 0)
  int nweights;
  const int* dtypes;  // c10::ScalarType codes of the floating tensor inputs (kind 0)
  int ndtypes;
  at::Tensor** tensors;
  int ntensors;
};
typedef void (*tch_amp_observer_sink)(void* ctx, const tch_amp_observed* ev);
}

namespace {

struct Session {
  tch_amp_observer_sink sink = nullptr;
  void* ctx = nullptr;
  uint64_t thread = 0;
  // TensorImpl of each weight -> its index; immutable once the session is open.
  std::unordered_map<const c10::TensorImpl*, int64_t> weights;
  // Guards what backward threads touch.
  std::mutex mu;
  int64_t next_op = 0;
  std::unordered_map<uint64_t, int64_t> nodes;  // grad_fn sequence number -> op
  Session* below = nullptr;                     // the session this one hides on its thread
};

// The open sessions by RecordFunction thread id (the top one of each thread).
std::mutex g_mu;
std::unordered_map<uint64_t, Session*>& sessions() {
  static auto* m = new std::unordered_map<uint64_t, Session*>();
  return *m;
}

Session* session_of(uint64_t thread) {
  std::lock_guard<std::mutex> lock(g_mu);
  auto& m = sessions();
  auto it = m.find(thread);
  return it == m.end() ? nullptr : it->second;
}

thread_local int tls_depth = 0;        // RecordFunction nesting on this thread
thread_local bool tls_paused = false;  // top-level ops of this thread are not reported
thread_local at::CallbackHandle tls_handle = 0;

bool is_floating(const at::Tensor& t) {
  if (!t.defined()) return false;
  const auto s = t.scalar_type();
  return s == at::kHalf || s == at::kBFloat16 || s == at::kFloat || s == at::kDouble;
}

template <class F>
void for_each_tensor(const c10::IValue& v, F&& f) {
  if (v.isTensor()) {
    f(v.toTensor());
  } else if (v.isTensorList()) {
    for (const at::Tensor& t : v.toTensorList()) f(t);
  } else if (v.isOptionalTensorList()) {
    for (const std::optional<at::Tensor>& t : v.toOptionalTensorList()) {
      if (t.has_value()) f(*t);
    }
  } else if (v.isTuple()) {
    for (const auto& e : v.toTupleRef().elements()) for_each_tensor(e, f);
  } else if (v.isList()) {
    for (const c10::IValue& e : v.toListRef()) for_each_tensor(e, f);
  }
}

struct OpContext final : at::ObserverContext {
  std::vector<int64_t> weights;
  std::vector<int> dtypes;
  uint64_t seq_start = 0;
};

// Calls the sink with RecordFunction, grad mode and autocast off, so that what it computes is
// neither observed, recorded nor cast.
void deliver(Session* s, int kind, const std::string& name, int64_t op, const std::vector<int64_t>& weights,
             const std::vector<int>& dtypes, const std::vector<at::Tensor>& tensors) {
  at::DisableRecordFunctionGuard no_observer;
  at::NoGradGuard no_grad;
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  std::vector<at::Tensor*> handles;
  handles.reserve(tensors.size());
  for (const auto& t : tensors) handles.push_back(new at::Tensor(t));
  tch_amp_observed ev{kind,
                      name.c_str(),
                      op,
                      weights.data(),
                      static_cast<int>(weights.size()),
                      dtypes.data(),
                      static_cast<int>(dtypes.size()),
                      handles.data(),
                      static_cast<int>(handles.size())};
  s->sink(s->ctx, &ev);
}

std::string op_name(const at::RecordFunction& fn) {
  std::string name = fn.name();
  return name.rfind("aten::", 0) == 0 ? name.substr(6) : name;
}

void on_backward_node(const at::RecordFunction& fn) {
  Session* s = session_of(fn.forwardThreadId());
  if (s == nullptr) return;
  int64_t op = -1;
  {
    std::lock_guard<std::mutex> lock(s->mu);
    auto it = s->nodes.find(static_cast<uint64_t>(fn.seqNr()));
    if (it == s->nodes.end()) return;
    op = it->second;
  }
  std::vector<at::Tensor> grads;
  for (const auto& v : fn.inputs()) {
    for_each_tensor(v, [&](const at::Tensor& t) {
      if (is_floating(t)) grads.push_back(t);
    });
  }
  if (grads.empty()) return;
  deliver(s, 1, fn.name(), op, {}, {}, grads);
}

std::unique_ptr<at::ObserverContext> on_start(const at::RecordFunction& fn) {
  const int depth = tls_depth++;
  try {
    // A node runs inside the engine's own record of it ("autograd::engine::evaluate_function:
    // ..."), so nodes are looked at whatever the depth; the ops they call are not.
    if (fn.scope() == at::RecordScope::BACKWARD_FUNCTION) {
      on_backward_node(fn);
      return nullptr;
    }
    if (depth != 0) return nullptr;
    // Ops the autograd engine runs between nodes (gradient accumulation) are not the user's.
    if (tls_paused || torch::autograd::get_current_graph_task_id() != -1) return nullptr;
    Session* s = session_of(at::RecordFunction::currentThreadId());
    if (s == nullptr) return nullptr;
    auto ctx = std::make_unique<OpContext>();
    ctx->seq_start = at::sequence_number::peek();
    for (const auto& v : fn.inputs()) {
      for_each_tensor(v, [&](const at::Tensor& t) {
        if (!t.defined()) return;
        auto it = s->weights.find(t.unsafeGetTensorImpl());
        if (it != s->weights.end()) ctx->weights.push_back(it->second);
        if (is_floating(t)) ctx->dtypes.push_back(static_cast<int>(t.scalar_type()));
      });
    }
    return ctx;
  } catch (...) {
    return nullptr;  // an observation is never worth failing the user's op
  }
}

void on_end(const at::RecordFunction& fn, at::ObserverContext* raw) {
  --tls_depth;
  if (raw == nullptr) return;
  try {
    auto* ctx = static_cast<OpContext*>(raw);
    Session* s = session_of(at::RecordFunction::currentThreadId());
    if (s == nullptr) return;
    std::vector<at::Tensor> outputs;
    for (const auto& v : fn.outputs()) {
      for_each_tensor(v, [&](const at::Tensor& t) {
        if (is_floating(t)) outputs.push_back(t);
      });
    }
    const uint64_t seq_end = at::sequence_number::peek();
    int64_t op = 0;
    {
      std::lock_guard<std::mutex> lock(s->mu);
      op = s->next_op++;
      for (const auto& t : outputs) {
        const auto& node = t.grad_fn();
        if (!node) continue;
        const uint64_t seq = node->sequence_nr();
        // Only nodes this op created: an op that returns an earlier tensor is not its source.
        if (seq >= ctx->seq_start && seq < seq_end) s->nodes.emplace(seq, op);
      }
    }
    deliver(s, 0, op_name(fn), op, ctx->weights, ctx->dtypes, outputs);
  } catch (...) {
  }
}

}  // namespace

extern "C" {

// Opens a session on the calling thread: `weights` (n tensors) are matched against op inputs
// by identity; `sink(ctx, ...)` receives the observations. A session opened on a thread that
// has one hides it until closed. *out receives the session, closed by tch_amp_observer_stop on
// the same thread.
char* tch_amp_observer_start(at::Tensor** weights, int n, void* ctx, tch_amp_observer_sink sink, void** out) {
  TCH_AMP_PROTECT({
    *out = nullptr;
    TORCH_CHECK(n >= 0 && (n == 0 || weights != nullptr) && sink != nullptr, "invalid observer arguments");
    auto s = std::make_unique<Session>();
    s->sink = sink;
    s->ctx = ctx;
    s->thread = at::RecordFunction::currentThreadId();
    for (int i = 0; i < n; ++i) {
      if (weights[i]->defined()) s->weights.emplace(weights[i]->unsafeGetTensorImpl(), i);
    }
    if (tls_handle == 0) {
      tls_handle = at::addThreadLocalCallback(
          at::RecordFunctionCallback(on_start, on_end)
              .needsInputs(true)
              .needsOutputs(true)
              .scopes({at::RecordScope::FUNCTION, at::RecordScope::BACKWARD_FUNCTION}));
      tls_depth = 0;
    }
    {
      std::lock_guard<std::mutex> lock(g_mu);
      auto& m = sessions();
      auto it = m.find(s->thread);
      s->below = it == m.end() ? nullptr : it->second;
      m[s->thread] = s.get();
    }
    *out = s.release();
  })
}

// Closes a session (the top one of the calling thread): the one it hid is seen again; the last
// one removes the callbacks.
char* tch_amp_observer_stop(void* session) {
  TCH_AMP_PROTECT({
    auto* s = static_cast<Session*>(session);
    TORCH_CHECK(s != nullptr, "no observer session");
    TORCH_CHECK(s->thread == at::RecordFunction::currentThreadId(), "an observer session is closed on its own thread");
    bool last = false;
    {
      std::lock_guard<std::mutex> lock(g_mu);
      auto& m = sessions();
      auto it = m.find(s->thread);
      TORCH_CHECK(it != m.end() && it->second == s, "observer sessions are closed in reverse order of opening");
      if (s->below != nullptr) {
        it->second = s->below;
      } else {
        m.erase(it);
        last = true;
      }
    }
    if (last && tls_handle != 0) {
      at::removeCallback(tls_handle);
      tls_handle = 0;
    }
    delete s;
  })
}

// Starts the op count of a session again from 0 and forgets its graph nodes.
char* tch_amp_observer_reset(void* session) {
  TCH_AMP_PROTECT({
    auto* s = static_cast<Session*>(session);
    std::lock_guard<std::mutex> lock(s->mu);
    s->next_op = 0;
    s->nodes.clear();
  })
}

// While `paused`, the calling thread's top-level ops are not reported (backward nodes still
// are). *previous receives the former setting.
char* tch_amp_observer_pause(int paused, int* previous) {
  TCH_AMP_PROTECT({
    *previous = tls_paused ? 1 : 0;
    tls_paused = paused != 0;
  })
}

// The state of the default random generator of a device (`device_type` 0 CPU, 1 CUDA), as
// torch.get_rng_state / torch.cuda.get_rng_state give it.
char* tch_amp_rng_state(int device_type, int index, at::Tensor** out) {
  TCH_AMP_PROTECT({
    *out = nullptr;
    const c10::Device device = device_type == 0 ? c10::Device(c10::kCPU)
                                                : c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
    auto gen = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    *out = new at::Tensor(gen.get_state());
  })
}

// Restores a state read by tch_amp_rng_state.
char* tch_amp_set_rng_state(int device_type, int index, at::Tensor* state) {
  TCH_AMP_PROTECT({
    const c10::Device device = device_type == 0 ? c10::Device(c10::kCPU)
                                                : c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(index));
    auto gen = at::globalContext().defaultGenerator(device);
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(*state);
  })
}

}  // extern "C"
