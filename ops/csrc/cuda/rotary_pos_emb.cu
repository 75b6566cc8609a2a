// rotary_pos_emb on CUDA for t [s, b, h, d] and freqs [s or 1, rot]. A block takes one or more positions (more
// when b*h is small) and a share of their rows; its threads first compute each position's cos/sin once into
// shared memory (in double, then rounded: accurate even under --use_fast_math and for large angles; once per
// pair when its two angles are equal, as megatron's are), then rotate the rows as 16-byte packs, reading cos/sin
// from there. Channels past rot are copied.
#include <torch/library.h>

#include "vectorized.cuh"

namespace {

using namespace mm_adaptor_cuda;

constexpr int kThreads = 256;
constexpr int kRowsPerThread = 4;
constexpr int64_t kTableBytes = 16384;  // shared cos/sin table per block
constexpr int kBlocksPerSm = 4;         // a grid at least this wide before positions are grouped per block

template <typename A>
__device__ __forceinline__ void cos_sin(A angle, A& c, A& s) {
  double sd, cd;
  sincos(static_cast<double>(angle), &sd, &cd);
  c = static_cast<A>(cd);
  s = static_cast<A>(sd);
}

// Forward: y0 = x0 c0 - x1 s0, y1 = x1 c1 + x0 s1; backward (the transpose): y0 = x0 c0 + x1 s1,
// y1 = x1 c1 - x0 s0, for each rotated pair (i0, i1). nvcc fuses one product of each into an FMA (which one
// varies with N); tests/ops/test_rotary_bitwise.py accepts either.
template <bool kBackward, typename A>
__device__ __forceinline__ void rotate(A x0, A x1, A c0, A s0, A c1, A s1, A& y0, A& y1) {
  if constexpr (kBackward) {
    y0 = x0 * c0 + x1 * s1;
    y1 = x1 * c1 - x0 * s0;
  } else {
    y0 = x0 * c0 - x1 * s0;
    y1 = x1 * c1 + x0 * s1;
  }
}

template <typename A>
__device__ __forceinline__ bool same_bits(A a, A b) {
  if constexpr (sizeof(A) == 8) {
    return __double_as_longlong(a) == __double_as_longlong(b);
  } else {
    return __float_as_uint(a) == __float_as_uint(b);
  }
}

// N values from shared memory, as 16-byte loads where N fills them (the table keeps such runs aligned).
template <int N, typename A>
__device__ __forceinline__ void load_table(const A* p, A (&v)[N]) {
  constexpr int kVec = 16 / sizeof(A);
  if constexpr (N % kVec == 0) {
#pragma unroll
    for (int k = 0; k < N; k += kVec) {
      const Pack<A, kVec> q = load<kVec>(p + k);
#pragma unroll
      for (int j = 0; j < kVec; ++j) v[k + j] = q.v[j];
    }
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) v[k] = p[k];
  }
}

// Blocks take `positions` consecutive positions; their rows (items = positions x b*h, contiguous in memory) go
// to threadIdx.y and grid y. Rotated units go in chunks of `table_units` (all of them unless rot is huge): per
// chunk, the table holds for each position cos/sin of the units' channels (rotate-half: then of their partners).
template <typename T, int N, bool kInterleaved, bool kBackward>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(const T* __restrict__ t, const acc_t<T>* __restrict__ freqs, T* __restrict__ out, int64_t s,
                int64_t bh, int d, int rot, bool per_position, int positions, int table_units) {
  using A = acc_t<T>;
  extern __shared__ __align__(16) unsigned char table_bytes[];
  const int half = rot / 2;
  const int rot_units = kInterleaved ? rot / N : half / N;
  const int pass_units = (d - rot) / N;
  const int width = (kInterleaved ? 1 : 2) * table_units * N;  // table entries per position
  A* const cos_t = reinterpret_cast<A*>(table_bytes);
  A* const sin_t = cos_t + (per_position ? positions : 1) * width;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x, threads = blockDim.x * blockDim.y;
  const int64_t item_start = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
  const int64_t item_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  const bool grouped = per_position && positions > 1;  // table row = item / bh (then items fit an int)
  for (int64_t p0 = static_cast<int64_t>(blockIdx.x) * positions; p0 < s;
       p0 += static_cast<int64_t>(gridDim.x) * positions) {
    const int here = s - p0 < positions ? static_cast<int>(s - p0) : positions;
    const int64_t items = here * bh;
    const T* ts = t + p0 * bh * d;
    T* os = out + p0 * bh * d;
    for (int u0 = 0; u0 < rot_units; u0 += table_units) {
      const int chunk = min(table_units, rot_units - u0);
      const int pairs = kInterleaved ? chunk * N / 2 : chunk * N;  // rotated pairs per position in the chunk
      __syncthreads();  // the previous chunk's readers are done
      for (int j = tid; j < (per_position ? here : 1) * pairs; j += threads) {
        const int pl = j / pairs, q = j - pl * pairs;
        const A* f = freqs + (per_position ? (p0 + pl) * rot : 0);
        const int c0 = kInterleaved ? u0 * N + 2 * q : u0 * N + q, c1 = kInterleaved ? c0 + 1 : c0 + half;
        const int i0 = pl * width + (kInterleaved ? 2 * q : q), i1 = kInterleaved ? i0 + 1 : i0 + table_units * N;
        const A a0 = f[c0], a1 = f[c1];
        cos_sin(a0, cos_t[i0], sin_t[i0]);
        if (same_bits(a0, a1)) {
          cos_t[i1] = cos_t[i0];
          sin_t[i1] = sin_t[i0];
        } else {
          cos_sin(a1, cos_t[i1], sin_t[i1]);
        }
      }
      __syncthreads();
      for (int u = u0 + threadIdx.x; u < u0 + chunk; u += blockDim.x) {
        const int c = u * N, slot = (u - u0) * N;
        int loaded = -1;  // the table row held in registers
        if constexpr (kInterleaved) {  // channels c .. c+N-1 hold N/2 pairs (c+2i, c+2i+1)
          A cs[N], sn[N];
          for (int64_t i = item_start; i < items; i += item_step) {
            const int row = grouped ? static_cast<int>(i) / static_cast<int>(bh) : 0;
            if (row != loaded) {
              load_table<N>(cos_t + row * width + slot, cs);
              load_table<N>(sin_t + row * width + slot, sn);
              loaded = row;
            }
            const Pack<T, N> v = load<N>(ts + i * d + c);
            Pack<T, N> o;
#pragma unroll
            for (int k = 0; k < N; k += 2) {
              A y0, y1;
              rotate<kBackward>(static_cast<A>(v.v[k]), static_cast<A>(v.v[k + 1]), cs[k], sn[k], cs[k + 1],
                                sn[k + 1], y0, y1);
              o.v[k] = static_cast<T>(y0);
              o.v[k + 1] = static_cast<T>(y1);
            }
            store<N>(os + i * d + c, o);
          }
        } else {  // channels c .. c+N-1 pair with c+half .. c+half+N-1
          A c0[N], s0[N], c1[N], s1[N];
          for (int64_t i = item_start; i < items; i += item_step) {
            const int row = grouped ? static_cast<int>(i) / static_cast<int>(bh) : 0;
            if (row != loaded) {
              load_table<N>(cos_t + row * width + slot, c0);
              load_table<N>(sin_t + row * width + slot, s0);
              load_table<N>(cos_t + row * width + table_units * N + slot, c1);
              load_table<N>(sin_t + row * width + table_units * N + slot, s1);
              loaded = row;
            }
            const Pack<T, N> v0 = load<N>(ts + i * d + c);
            const Pack<T, N> v1 = load<N>(ts + i * d + c + half);
            Pack<T, N> o0, o1;
#pragma unroll
            for (int k = 0; k < N; ++k) {
              A y0, y1;
              rotate<kBackward>(static_cast<A>(v0.v[k]), static_cast<A>(v1.v[k]), c0[k], s0[k], c1[k], s1[k], y0,
                                y1);
              o0.v[k] = static_cast<T>(y0);
              o1.v[k] = static_cast<T>(y1);
            }
            store<N>(os + i * d + c, o0);
            store<N>(os + i * d + c + half, o1);
          }
        }
      }
    }
    for (int u = threadIdx.x; u < pass_units; u += blockDim.x) {
      const int c = rot + u * N;
      for (int64_t i = item_start; i < items; i += item_step) store<N>(os + i * d + c, load<N>(ts + i * d + c));
    }
  }
}

// Widest pack that divides the rotated units and the head dim, with 16-byte aligned rows; interleaved
// rotation needs whole pairs in a pack, so its narrowest is 2. 0 when no pack fits.
template <typename T>
int rope_pack_width(const at::Tensor& t, const at::Tensor& out, int64_t d, int64_t rot, bool interleaved) {
  auto fits = [&](int width) {
    const int64_t unit = interleaved ? width : 2 * width;
    return d % width == 0 && rot % unit == 0 && aligned_to(t.data_ptr(), t.element_size() * width) &&
           aligned_to(out.data_ptr(), out.element_size() * width);
  };
  if (fits(pack_width<T>())) return pack_width<T>();
  const int narrowest = interleaved ? 2 : 1;
  return fits(narrowest) ? narrowest : 0;
}

template <typename T, bool kInterleaved, bool kBackward, int N>
void launch(const at::Tensor& t, const at::Tensor& freqs, at::Tensor& out, int64_t s, int64_t bh, int64_t d,
            int64_t rot) {
  using A = acc_t<T>;
  const int64_t rot_units = kInterleaved ? rot / N : rot / 2 / N;
  const int64_t units = std::max<int64_t>(rot_units, (d - rot) / N);
  int bx = 1;
  while (bx < units && bx < 32) bx *= 2;
  const int by = kThreads / bx;
  const bool per_position = freqs.size(0) != 1;
  // cos/sin of one unit's channels (and of their partners for rotate-half)
  const int64_t unit_bytes = 2 * static_cast<int64_t>(sizeof(A)) * N * (kInterleaved ? 1 : 2);
  const int64_t table_units = std::clamp<int64_t>(kTableBytes / unit_bytes, 1, rot_units);
  // Few rows per position: group positions so that each thread row gets about kRowsPerThread of them, within
  // the table and while the grid stays kBlocksPerSm blocks per SM wide.
  const int64_t rows = static_cast<int64_t>(by) * kRowsPerThread;
  int64_t positions = 1;
  if (bh < rows) {
    const int64_t wide = static_cast<int64_t>(sm_count()) * kBlocksPerSm;
    positions = std::min(ceil_div(rows, bh), std::max<int64_t>(1, s / wide));
    if (per_position) positions = std::clamp<int64_t>(kTableBytes / (unit_bytes * table_units), 1, positions);
  }
  const int64_t grid_y = positions > 1 ? 1 : std::clamp<int64_t>(ceil_div(bh, rows), 1, kMaxGridY);
  const dim3 grid(static_cast<unsigned>(std::min(ceil_div(s, positions), kMaxGridX)), static_cast<unsigned>(grid_y));
  const size_t table = static_cast<size_t>(unit_bytes * table_units * (per_position ? positions : 1));
  rope_kernel<T, N, kInterleaved, kBackward><<<grid, dim3(bx, by), table, c10::cuda::getCurrentCUDAStream()>>>(
      t.data_ptr<T>(), freqs.data_ptr<A>(), out.data_ptr<T>(), s, bh, static_cast<int>(d), static_cast<int>(rot),
      per_position, static_cast<int>(positions), static_cast<int>(table_units));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T, bool kInterleaved, bool kBackward>
bool launch_widest(int width, const at::Tensor& t, const at::Tensor& freqs, at::Tensor& out, int64_t s, int64_t bh,
                   int64_t d, int64_t rot) {
  constexpr int widest = pack_width<T>();
  if (width == widest) {
    launch<T, kInterleaved, kBackward, widest>(t, freqs, out, s, bh, d, rot);
  } else if (width == 2 && widest > 2) {
    launch<T, kInterleaved, kBackward, 2>(t, freqs, out, s, bh, d, rot);
  } else if (width == 1 && !kInterleaved) {
    launch<T, false, kBackward, 1>(t, freqs, out, s, bh, d, rot);
  } else {
    return false;
  }
  return true;
}

// Layouts no pack fits (an odd head dim with interleaved pairs): the same formula in ATen ops.
void rope_with_aten(const at::Tensor& t, const at::Tensor& freqs, at::Tensor& out, bool interleaved, bool backward) {
  const int64_t rot = freqs.size(-1), half = rot / 2;
  auto pick = [&](const at::Tensor& a, int which) {
    return interleaved ? a.slice(-1, which, rot, 2) : a.slice(-1, which * half, (which + 1) * half);
  };
  const auto f = freqs.reshape({freqs.size(0), 1, 1, rot});
  const auto cs = f.cos(), sn = f.sin();
  const auto tf = t.to(freqs.scalar_type());
  const auto x0 = pick(tf, 0), x1 = pick(tf, 1);
  const auto c0 = pick(cs, 0), c1 = pick(cs, 1), s0 = pick(sn, 0), s1 = pick(sn, 1);
  auto result = tf.clone();
  pick(result, 0).copy_(backward ? x0 * c0 + x1 * s1 : x0 * c0 - x1 * s0);
  pick(result, 1).copy_(backward ? x1 * c1 - x0 * s0 : x1 * c1 + x0 * s1);
  out.copy_(result);
}

at::Tensor rope_apply(const at::Tensor& t_in, const at::Tensor& freqs_in, bool interleaved, bool backward) {
  TORCH_CHECK(t_in.dim() == 4, "rotary_pos_emb: expected t as [s, b, h, d], got ", t_in.dim(), " dimensions");
  const c10::cuda::CUDAGuard guard(t_in.device());
  auto t = t_in.contiguous();
  const auto acc = t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const int64_t s = t.size(0), bh = t.size(1) * t.size(2), d = t.size(3), rot = freqs_in.size(-1);
  TORCH_CHECK(rot <= d && rot % 2 == 0, "rotary_pos_emb: the rotary dim (", rot, ") must be even and at most the head "
              "dim (", d, ")");
  const int64_t positions = rot ? freqs_in.numel() / rot : 0;
  TORCH_CHECK(rot == 0 || positions == 1 || positions == s, "rotary_pos_emb: freqs hold ", positions,
              " positions for a sequence of ", s);
  auto freqs = freqs_in.to(acc).contiguous().reshape({positions, rot});
  auto out = at::empty_like(t);
  if (t.numel() == 0) return out;
  if (rot == 0) {
    out.copy_(t);
    return out;
  }
  bool launched = false;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "rotary_pos_emb", [&] {
    using T = scalar_t;
    const int width = rope_pack_width<T>(t, out, d, rot, interleaved);
    if (interleaved && backward) launched = launch_widest<T, true, true>(width, t, freqs, out, s, bh, d, rot);
    if (interleaved && !backward) launched = launch_widest<T, true, false>(width, t, freqs, out, s, bh, d, rot);
    if (!interleaved && backward) launched = launch_widest<T, false, true>(width, t, freqs, out, s, bh, d, rot);
    if (!interleaved && !backward) launched = launch_widest<T, false, false>(width, t, freqs, out, s, bh, d, rot);
  });
  if (!launched) rope_with_aten(t, freqs, out, interleaved, backward);
  return out;
}

at::Tensor rope_fwd(const at::Tensor& t, const at::Tensor& freqs, bool interleaved) {
  return rope_apply(t, freqs, interleaved, false);
}

at::Tensor rope_bwd(const at::Tensor& dy, const at::Tensor& freqs, bool interleaved) {
  return rope_apply(dy, freqs, interleaved, true);
}

}  // namespace

TORCH_LIBRARY_IMPL(mm_adaptor, CUDA, m) {
  m.impl("rotary_pos_emb_fwd", &rope_fwd);
  m.impl("rotary_pos_emb_bwd", &rope_bwd);
}
