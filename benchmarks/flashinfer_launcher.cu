// FlashInfer's sampling kernels as a benchmark baseline (issue 35), for float32 probs.
//
// A C ABI over FlashInfer's own host launchers (include/flashinfer/sampling.cuh,
// air_top_p.cuh, topk.cuh from the released wheel, fetched by
// benchmarks/flashinfer_fetch.sh), so that benchmarks/flashinfer_ref.py can call them
// through ctypes on a machine with nvcc but without flashinfer, tvm-ffi or a network.
// Nothing here reimplements a kernel: each function forwards raw device pointers to
// the template that FlashInfer's own binding (csrc/sampling.cu, csrc/renorm.cu) calls,
// with the same arguments, and returns its cudaError_t as an int (0 = cudaSuccess).
//
// Written against flashinfer-python 0.7.4; the templates' signatures change between
// releases, so a new pin may need these calls adjusted (the compiler says where).
//
// Conventions, as in FlashInfer's binding:
//   - a per-row settings array (top_p_arr, top_k_arr, min_p_arr) may be nullptr, and
//     then the scalar (top_p_val, ...) applies to every row;
//   - ids are int32 (IdType = int), indices (row gather) is always nullptr here;
//   - the Philox seed and offset are scalars (seed_arr = offset_arr = nullptr);
//   - `valid` [B] (bool) is written by the samplers: false where a row had no support.
// The caller sets the current CUDA device to that of the tensors: the launchers read
// the SM count and compute capability of the current device.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include <flashinfer/air_top_p.cuh>
#include <flashinfer/sampling.cuh>
#include <flashinfer/topk.cuh>

namespace fs = flashinfer::sampling;

namespace {

inline cudaStream_t as_stream(void* stream) { return static_cast<cudaStream_t>(stream); }

// AirTopPRenormProb launches with <<<>>> and returns cudaSuccess unconditionally, so a
// failed launch only shows in the runtime's last-error slot.
inline int launch_status(cudaError_t status) {
  return static_cast<int>(status != cudaSuccess ? status : cudaGetLastError());
}

}  // namespace

extern "C" {

// For error messages: the runtime's name for a status these functions returned.
const char* shmask_fi_error_string(int status) {
  return cudaGetErrorString(static_cast<cudaError_t>(status));
}

// Bytes of scratch AirTopPRenormProb carves into counters, two histograms and two
// candidate buffers; computed from the header's own types so that it cannot drift
// from what the launcher indexes (FlashInfer's Python recomputes it by hand).
size_t shmask_fi_top_p_renorm_workspace_bytes(uint32_t batch_size, uint32_t vocab_size) {
  using HisT = fs::air_top_p::HisT<false, float>;
  auto align256 = [](size_t x) { return (x + 255) / 256 * 256; };
  const size_t buf_len = fs::air_top_p::calcBufLen<float>(vocab_size);
  const size_t buckets = fs::air_top_p::NUM_BUCKETS;
  return align256(sizeof(fs::air_top_p::Counter<float>) * batch_size) +
         align256(sizeof(HisT) * buckets * batch_size) +
         align256(sizeof(fs::air_top_p::IdxT) * buckets * batch_size) +
         2 * align256(sizeof(float) * buf_len * batch_size);
}

// top_p_renorm_probs: the dispatch of FlashInfer's renorm.cu (non-deterministic path):
// AIR radix top-p, or the older ternary search below one radix pass of buckets,
// where the radix threshold is not precise enough.
int shmask_fi_top_p_renorm_probs(float* probs, float* renormed_prob, float* top_p_arr,
                                 uint32_t batch_size, float top_p_val, uint32_t vocab_size,
                                 void* workspace, void* stream) {
  if (vocab_size < static_cast<uint32_t>(fs::air_top_p::NUM_BUCKETS)) {
    return launch_status(fs::TopPRenormProb<float>(probs, renormed_prob, top_p_arr, batch_size,
                                                   top_p_val, vocab_size, as_stream(stream)));
  }
  return launch_status(fs::air_top_p::AirTopPRenormProb<false, float>(
      probs, renormed_prob, top_p_arr, batch_size, top_p_val, vocab_size, workspace,
      as_stream(stream)));
}

// Size of one RadixRowState: the multi-CTA top-k renorm uses one per group of CTAs
// (at most one group per SM), in a buffer zeroed once that its last CTA re-zeroes.
size_t shmask_fi_radix_row_state_bytes(void) { return sizeof(fs::RadixRowState); }

int shmask_fi_top_k_renorm_probs(float* probs, float* renormed_prob, int32_t* top_k_arr,
                                 uint32_t batch_size, uint32_t top_k_val, uint32_t vocab_size,
                                 void* row_states, size_t row_states_bytes, void* stream) {
  int device = 0, num_sms = 0;
  cudaError_t status = cudaGetDevice(&device);
  if (status == cudaSuccess) {
    status = cudaDeviceGetAttribute(&num_sms, cudaDevAttrMultiProcessorCount, device);
  }
  if (status != cudaSuccess) return static_cast<int>(status);
  // The launcher trusts the buffer to hold one state per group; check it does.
  if (row_states_bytes < static_cast<size_t>(num_sms) * sizeof(fs::RadixRowState)) {
    return static_cast<int>(cudaErrorInvalidValue);
  }
  return launch_status(fs::RadixTopKRenormProbMultiCTA<float, int>(
      probs, renormed_prob, top_k_arr, batch_size, top_k_val, vocab_size,
      static_cast<fs::RadixRowState*>(row_states), /*deterministic=*/false, as_stream(stream)));
}

int shmask_fi_top_p_sampling_from_probs(float* probs, int32_t* output, bool* valid,
                                        float* top_p_arr, uint32_t batch_size, float top_p_val,
                                        uint32_t vocab_size, bool deterministic, uint64_t seed,
                                        uint64_t offset, void* stream) {
  return launch_status(fs::TopPSamplingFromProb<float, int>(
      probs, output, valid, /*indices=*/nullptr, top_p_arr, batch_size, top_p_val, vocab_size,
      deterministic, /*seed_arr=*/nullptr, seed, /*offset_arr=*/nullptr, offset,
      as_stream(stream)));
}

int shmask_fi_top_k_sampling_from_probs(float* probs, int32_t* output, bool* valid,
                                        int32_t* top_k_arr, uint32_t batch_size,
                                        uint32_t top_k_val, uint32_t vocab_size,
                                        bool deterministic, uint64_t seed, uint64_t offset,
                                        void* stream) {
  // The template declares top_k_arr as T* (float*) yet its kernels read it as IdType*
  // (int32): FlashInfer's binding passes the int32 tensor cast to float* the same way.
  return launch_status(fs::TopKSamplingFromProb<float, int>(
      probs, output, valid, /*indices=*/nullptr, reinterpret_cast<float*>(top_k_arr),
      batch_size, top_k_val, vocab_size, deterministic, /*seed_arr=*/nullptr, seed,
      /*offset_arr=*/nullptr, offset, as_stream(stream)));
}

int shmask_fi_min_p_sampling_from_probs(float* probs, int32_t* output, bool* valid,
                                        float* min_p_arr, uint32_t batch_size, float min_p_val,
                                        uint32_t vocab_size, bool deterministic, uint64_t seed,
                                        uint64_t offset, void* stream) {
  return launch_status(fs::MinPSamplingFromProb<float, int>(
      probs, min_p_arr, output, valid, /*indices=*/nullptr, batch_size, min_p_val, vocab_size,
      deterministic, /*seed_arr=*/nullptr, seed, /*offset_arr=*/nullptr, offset,
      as_stream(stream)));
}

// The joint kernel (FlashInfer's filter_apply_order="joint"): one pass that samples
// under both limits, not top-k renorm followed by top-p sampling.
int shmask_fi_top_k_top_p_sampling_from_probs(float* probs, int32_t* output, bool* valid,
                                              int32_t* top_k_arr, float* top_p_arr,
                                              uint32_t batch_size, int32_t top_k_val,
                                              float top_p_val, uint32_t vocab_size,
                                              bool deterministic, uint64_t seed, uint64_t offset,
                                              void* stream) {
  return launch_status(fs::TopKTopPSamplingFromProb<float, int>(
      probs, top_k_arr, top_p_arr, output, valid, /*indices=*/nullptr, batch_size, top_k_val,
      top_p_val, vocab_size, deterministic, /*seed_arr=*/nullptr, seed, /*offset_arr=*/nullptr,
      offset, as_stream(stream)));
}

}  // extern "C"
