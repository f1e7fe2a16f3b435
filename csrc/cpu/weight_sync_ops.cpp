// CPU kernels of the weight-sync hot path, registered as torch ops `megarl_native::*`.
//
//   pack(Tensor[] srcs, Tensor(a!) dst)                  many tensors -> one bucket, dtype cast on the way
//   unpack(Tensor src, Tensor(a!)[] dsts)                one bucket -> many tensors, dtype cast on the way
//   split_qkv(Tensor qkv, int groups, q!, k!, v!)        Megatron's interleaved fused QKV -> HF q / k / v
//   split_gate_up(Tensor fc1, int shards, gate!, up!)    cat over TP shards of cat(gate_r, up_r) -> HF gate / up
//
// Every op is a list of (src, dst, n) segments copied in one `at::parallel_for` region, with the
// element conversion done here: fp32 -> bf16 rounds to nearest even with the bit trick torch uses
// (same bits as `Tensor.to`, except NaN payloads), fp32 -> fp16 through c10::Half (IEEE RNE).
// Supported dtypes: float32, bfloat16, float16. The pure-torch reference of each op is in
// megarl/weight_sync/native.py. Light headers only: the JIT build takes seconds, not minutes.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

enum Kind : int { kF32 = 0, kBF16 = 1, kF16 = 2 };

Kind kind_of(const at::Tensor& t, const char* what) {
  switch (t.scalar_type()) {
    case at::kFloat: return kF32;
    case at::kBFloat16: return kBF16;
    case at::kHalf: return kF16;
    default: TORCH_CHECK(false, what, ": dtype ", t.scalar_type(), " is not one of float32, bfloat16, float16");
  }
}

int elem_size(Kind k) { return k == kF32 ? 4 : 2; }

struct Segment {
  const char* src;
  char* dst;
  int64_t n;  // elements
  Kind src_kind;
  Kind dst_kind;
};

__attribute__((target_clones("avx512f", "avx2", "default")))
void f32_to_bf16(const float* __restrict s, uint16_t* __restrict d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, s + i, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    d[i] = static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);
  }
}

__attribute__((target_clones("avx512f", "avx2", "default")))
void bf16_to_f32(const uint16_t* __restrict s, float* __restrict d, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(s[i]) << 16;
    std::memcpy(d + i, &u, 4);
  }
}

float load(const char* p, int64_t i, Kind k) {
  switch (k) {
    case kF32: return reinterpret_cast<const float*>(p)[i];
    case kBF16: return static_cast<float>(reinterpret_cast<const c10::BFloat16*>(p)[i]);
    default: return static_cast<float>(reinterpret_cast<const c10::Half*>(p)[i]);
  }
}

void store(char* p, int64_t i, Kind k, float x) {
  switch (k) {
    case kF32: reinterpret_cast<float*>(p)[i] = x; break;
    case kBF16: reinterpret_cast<c10::BFloat16*>(p)[i] = c10::BFloat16(x); break;
    default: reinterpret_cast<c10::Half*>(p)[i] = c10::Half(x); break;
  }
}

// Elements [lo, hi) of one segment.
void copy_part(const Segment& s, int64_t lo, int64_t hi) {
  const int64_t n = hi - lo;
  if (s.src_kind == s.dst_kind) {
    const int64_t es = elem_size(s.src_kind);
    std::memcpy(s.dst + lo * es, s.src + lo * es, n * es);
  } else if (s.src_kind == kF32 && s.dst_kind == kBF16) {
    f32_to_bf16(reinterpret_cast<const float*>(s.src) + lo, reinterpret_cast<uint16_t*>(s.dst) + lo, n);
  } else if (s.src_kind == kBF16 && s.dst_kind == kF32) {
    bf16_to_f32(reinterpret_cast<const uint16_t*>(s.src) + lo, reinterpret_cast<float*>(s.dst) + lo, n);
  } else {
    for (int64_t i = lo; i < hi; ++i) store(s.dst, i, s.dst_kind, load(s.src, i, s.src_kind));
  }
}

// Copy all segments in one parallel region, split by elements so one huge tensor uses every thread.
void run_segments(const std::vector<Segment>& segs) {
  std::vector<int64_t> start(segs.size() + 1, 0);
  for (size_t i = 0; i < segs.size(); ++i) start[i + 1] = start[i] + segs[i].n;
  const int64_t total = start.back();
  if (total == 0) return;
  at::parallel_for(0, total, 1 << 16, [&](int64_t begin, int64_t end) {
    size_t i = std::upper_bound(start.begin(), start.end(), begin) - start.begin() - 1;
    for (int64_t pos = begin; pos < end; ++i) {
      const int64_t lo = pos - start[i];
      const int64_t hi = std::min(end, start[i + 1]) - start[i];
      if (hi > lo) copy_part(segs[i], lo, hi);
      pos = start[i + 1];
    }
  });
}

void check_contiguous(const at::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu(), what, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), what, " must be contiguous");
}

const char* cptr(const at::Tensor& t) { return static_cast<const char*>(t.const_data_ptr()); }
char* mptr(const at::Tensor& t) { return static_cast<char*>(t.mutable_data_ptr()); }

void pack(at::TensorList srcs, const at::Tensor& dst) {
  check_contiguous(dst, "pack: dst");
  const Kind dk = kind_of(dst, "pack: dst");
  std::vector<Segment> segs;
  int64_t offset = 0;
  for (const auto& s : srcs) {
    check_contiguous(s, "pack: every source");
    segs.push_back({cptr(s), mptr(dst) + offset * elem_size(dk), s.numel(), kind_of(s, "pack: source"), dk});
    offset += s.numel();
  }
  TORCH_CHECK(offset <= dst.numel(), "pack: the sources hold ", offset, " elements, the bucket only ", dst.numel());
  run_segments(segs);
}

void unpack(const at::Tensor& src, at::TensorList dsts) {
  check_contiguous(src, "unpack: src");
  const Kind sk = kind_of(src, "unpack: src");
  std::vector<Segment> segs;
  int64_t offset = 0;
  for (const auto& d : dsts) {
    check_contiguous(d, "unpack: every destination");
    segs.push_back({cptr(src) + offset * elem_size(sk), mptr(d), d.numel(), sk, kind_of(d, "unpack: destination")});
    offset += d.numel();
  }
  TORCH_CHECK(offset <= src.numel(), "unpack: the destinations need ", offset, " elements, the bucket has ",
              src.numel());
  run_segments(segs);
}

int64_t row_elems(const at::Tensor& t) { return t.dim() == 0 || t.size(0) == 0 ? 0 : t.numel() / t.size(0); }

// qkv rows: for each of `groups` query groups, [q rows of the group, k rows, v rows] (group-major).
void split_qkv(const at::Tensor& qkv, int64_t groups, const at::Tensor& q, const at::Tensor& k,
               const at::Tensor& v) {
  for (const auto* t : {&qkv, &q, &k, &v}) check_contiguous(*t, "split_qkv: every tensor");
  TORCH_CHECK(groups > 0 && q.size(0) % groups == 0 && k.size(0) % groups == 0 && v.size(0) == k.size(0),
              "split_qkv: q/k/v rows must divide into ", groups, " groups (q ", q.size(0), ", k ", k.size(0),
              ", v ", v.size(0), ")");
  TORCH_CHECK(qkv.size(0) == q.size(0) + k.size(0) + v.size(0) && q.numel() + k.numel() + v.numel() == qkv.numel(),
              "split_qkv: qkv has ", qkv.size(0), " rows, q+k+v ", q.size(0) + k.size(0) + v.size(0));
  const int64_t row = row_elems(qkv), qr = q.size(0) / groups * row, kr = k.size(0) / groups * row;
  const Kind sk = kind_of(qkv, "split_qkv: qkv");
  const int ss = elem_size(sk);
  std::vector<Segment> segs;
  for (int64_t g = 0; g < groups; ++g) {
    const char* base = cptr(qkv) + g * (qr + 2 * kr) * ss;
    const Kind qk = kind_of(q, "split_qkv: q"), kk = kind_of(k, "split_qkv: k"), vk = kind_of(v, "split_qkv: v");
    segs.push_back({base, mptr(q) + g * qr * elem_size(qk), qr, sk, qk});
    segs.push_back({base + qr * ss, mptr(k) + g * kr * elem_size(kk), kr, sk, kk});
    segs.push_back({base + (qr + kr) * ss, mptr(v) + g * kr * elem_size(vk), kr, sk, vk});
  }
  run_segments(segs);
}

// fc1 rows: for each of `shards` TP ranks, [gate rows of the rank, up rows of the rank].
void split_gate_up(const at::Tensor& fc1, int64_t shards, const at::Tensor& gate, const at::Tensor& up) {
  for (const auto* t : {&fc1, &gate, &up}) check_contiguous(*t, "split_gate_up: every tensor");
  TORCH_CHECK(shards > 0 && gate.size(0) == up.size(0) && gate.size(0) % shards == 0 &&
                  fc1.size(0) == 2 * gate.size(0) && fc1.numel() == gate.numel() + up.numel(),
              "split_gate_up: fc1 ", fc1.sizes(), " is not ", shards, " shards of [gate; up] with gate ",
              gate.sizes(), ", up ", up.sizes());
  const int64_t half = gate.size(0) / shards * row_elems(fc1);
  const Kind sk = kind_of(fc1, "split_gate_up: fc1"), gk = kind_of(gate, "split_gate_up: gate"),
             uk = kind_of(up, "split_gate_up: up");
  const int ss = elem_size(sk);
  std::vector<Segment> segs;
  for (int64_t r = 0; r < shards; ++r) {
    const char* base = cptr(fc1) + 2 * r * half * ss;
    segs.push_back({base, mptr(gate) + r * half * elem_size(gk), half, sk, gk});
    segs.push_back({base + half * ss, mptr(up) + r * half * elem_size(uk), half, sk, uk});
  }
  run_segments(segs);
}

int64_t num_threads() { return at::get_num_threads(); }

}  // namespace

TORCH_LIBRARY(megarl_native, m) {
  m.def("pack(Tensor[] srcs, Tensor(a!) dst) -> ()", &pack);
  m.def("unpack(Tensor src, Tensor(a!)[] dsts) -> ()", &unpack);
  m.def("split_qkv(Tensor qkv, int groups, Tensor(a!) q, Tensor(b!) k, Tensor(c!) v) -> ()", &split_qkv);
  m.def("split_gate_up(Tensor fc1, int shards, Tensor(a!) gate, Tensor(b!) up) -> ()", &split_gate_up);
  m.def("num_threads() -> int", &num_threads);
}
