// CUDA kernels of the weight-sync hot path: plain CUDA C++, no torch headers, `extern "C"`
// launchers taking raw device pointers and a `void*` stream (cudaStream_t), returning a
// cudaError_t as int (0 = launched). megarl/weight_sync/native.py loads the shared library with ctypes and
// calls them with `Tensor.data_ptr()` and `torch.cuda.current_stream().cuda_stream`.
//
//   megarl_copy_segments   many (src, dst, n, kinds) segments in one launch: pack / unpack of buckets
//   megarl_split_qkv       Megatron's interleaved fused QKV -> HF q / k / v
//   megarl_split_gate_up   cat over TP shards of cat(gate_r, up_r) -> HF gate / up
//
// Dtype kinds: 0 float32, 1 bfloat16, 2 float16; conversions round to nearest even. Equal kinds
// copy the bits. The pure-torch reference of each is in megarl/weight_sync/native.py.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int kF32 = 0, kBF16 = 1, kF16 = 2;
constexpr int kThreads = 256;

// One segment, as the host lays it out in a device int64 tensor of shape [n, 4].
struct Segment {
  int64_t src;    // address
  int64_t dst;    // address
  int64_t n;      // elements
  int64_t kinds;  // src kind | dst kind << 8
};

__device__ __forceinline__ float load(const void* p, int64_t i, int kind) {
  if (kind == kF32) return static_cast<const float*>(p)[i];
  if (kind == kBF16) return __bfloat162float(static_cast<const __nv_bfloat16*>(p)[i]);
  return __half2float(static_cast<const __half*>(p)[i]);
}

__device__ __forceinline__ void store(void* p, int64_t i, int kind, float x) {
  if (kind == kF32) static_cast<float*>(p)[i] = x;
  else if (kind == kBF16) static_cast<__nv_bfloat16*>(p)[i] = __float2bfloat16_rn(x);
  else static_cast<__half*>(p)[i] = __float2half_rn(x);
}

__device__ __forceinline__ void move(const void* src, int64_t si, int sk, void* dst, int64_t di, int dk) {
  if (sk == dk) {
    if (sk == kF32) static_cast<uint32_t*>(dst)[di] = static_cast<const uint32_t*>(src)[si];
    else static_cast<uint16_t*>(dst)[di] = static_cast<const uint16_t*>(src)[si];
  } else {
    store(dst, di, dk, load(src, si, sk));
  }
}

// blockIdx.y picks the segment (plus `first`), blockIdx.x/threadIdx.x stride over its elements.
__global__ void copy_segments_kernel(const Segment* segs, int first) {
  const Segment s = segs[first + blockIdx.y];
  const int sk = static_cast<int>(s.kinds & 0xff), dk = static_cast<int>((s.kinds >> 8) & 0xff);
  const void* src = reinterpret_cast<const void*>(s.src);
  void* dst = reinterpret_cast<void*>(s.dst);
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < s.n; i += stride) {
    move(src, i, sk, dst, i, dk);
  }
}

__global__ void split_qkv_kernel(const void* qkv, int sk, void* q, int qk, void* k, int kk, void* v, int vk,
                                 int64_t total, int64_t q_per_group, int64_t kv_per_group) {
  const int64_t group = q_per_group + 2 * kv_per_group;  // elements of one query group in qkv
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t g = i / group, r = i % group;
    if (r < q_per_group) move(qkv, i, sk, q, g * q_per_group + r, qk);
    else if (r < q_per_group + kv_per_group) move(qkv, i, sk, k, g * kv_per_group + r - q_per_group, kk);
    else move(qkv, i, sk, v, g * kv_per_group + r - q_per_group - kv_per_group, vk);
  }
}

__global__ void split_gate_up_kernel(const void* fc1, int sk, void* gate, int gk, void* up, int uk, int64_t total,
                                     int64_t half) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += stride) {
    const int64_t shard = i / (2 * half), r = i % (2 * half);
    if (r < half) move(fc1, i, sk, gate, shard * half + r, gk);
    else move(fc1, i, sk, up, shard * half + r - half, uk);
  }
}

unsigned int blocks_for(int64_t n) {
  const int64_t b = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned int>(b < 1 ? 1 : (b > 65535 ? 65535 : b));
}

bool bad_kind(int k) { return k < kF32 || k > kF16; }

}  // namespace

extern "C" {

// `segs`: device memory, `nseg` rows of (src, dst, n, kinds); `max_n`: the largest n (sizes the grid).
int megarl_copy_segments(const void* segs, int nseg, int64_t max_n, void* stream) {
  if (nseg <= 0 || max_n <= 0) return 0;
  const unsigned int bx = blocks_for(max_n) > 1024 ? 1024 : blocks_for(max_n);
  for (int first = 0; first < nseg; first += 65535) {
    const unsigned int by = static_cast<unsigned int>(nseg - first < 65535 ? nseg - first : 65535);
    copy_segments_kernel<<<dim3(bx, by), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const Segment*>(segs), first);
  }
  return static_cast<int>(cudaGetLastError());
}

// qkv: `groups` × [q_per_group, kv_per_group, kv_per_group] elements; q / k / v receive them group by group.
int megarl_split_qkv(const void* qkv, int sk, void* q, int qk, void* k, int kk, void* v, int vk, int64_t groups,
                     int64_t q_per_group, int64_t kv_per_group, void* stream) {
  if (bad_kind(sk) || bad_kind(qk) || bad_kind(kk) || bad_kind(vk)) return static_cast<int>(cudaErrorInvalidValue);
  const int64_t total = groups * (q_per_group + 2 * kv_per_group);
  if (total <= 0) return 0;
  split_qkv_kernel<<<blocks_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      qkv, sk, q, qk, k, kk, v, vk, total, q_per_group, kv_per_group);
  return static_cast<int>(cudaGetLastError());
}

// fc1: `shards` × [half gate elements, half up elements]; gate / up receive them shard by shard.
int megarl_split_gate_up(const void* fc1, int sk, void* gate, int gk, void* up, int uk, int64_t shards, int64_t half,
                         void* stream) {
  if (bad_kind(sk) || bad_kind(gk) || bad_kind(uk)) return static_cast<int>(cudaErrorInvalidValue);
  const int64_t total = shards * 2 * half;
  if (total <= 0) return 0;
  split_gate_up_kernel<<<blocks_for(total), kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      fc1, sk, gate, gk, up, uk, total, half);
  return static_cast<int>(cudaGetLastError());
}

}  // extern "C"
