// The NCCL backend of tch-amp's process group (cargo feature `nccl`). Compiled only with that
// feature: ProcessGroupNCCL.hpp needs the CUDA runtime, crt, cccl and NCCL headers (the torch
// wheel's nvidia-* packages plus nvidia-cuda-crt and nvidia-cuda-cccl), which a default build
// does not require. src/shim/distributed.cpp calls this when TCH_AMP_NCCL is defined.
#define USE_C10D_NCCL 1

#include <chrono>

#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>

// As torch.distributed.init_process_group("nccl") builds the default group's backend: NCCL
// options with the group's timeout, a normal-priority stream, group name "0", and the
// sequence number agreed through the store.
c10::intrusive_ptr<c10d::Backend> tch_amp_make_nccl_backend(const c10::intrusive_ptr<c10d::Store>& store,
                                                            int rank, int size,
                                                            std::chrono::milliseconds timeout) {
  auto opts = c10d::ProcessGroupNCCL::Options::create();
  opts->timeout = timeout;
  opts->is_high_priority_stream = false;
  opts->group_name = "0";
  auto pg = c10::make_intrusive<c10d::ProcessGroupNCCL>(store, rank, size, opts);
  pg->setSequenceNumberForGroup();
  return pg;
}
