// rotary_pos_emb on CUDA for t [s, b, h, d] and freqs [s or 1, rot]. A block takes one position; each thread
// computes cos/sin for its channels once (in double, then rounded: accurate even under --use_fast_math and for
// large angles) and reuses them over the batch and heads rows, moving the row as 16-byte packs. Channels
// past rot are copied.
#include <torch/library.h>

#include "vectorized.cuh"

namespace {

using namespace mm_adaptor_cuda;

constexpr int kThreads = 256;
constexpr int kRowsPerThread = 4;

template <typename A>
__device__ __forceinline__ void cos_sin(A angle, A& c, A& s) {
  double sd, cd;
  sincos(static_cast<double>(angle), &sd, &cd);
  c = static_cast<A>(cd);
  s = static_cast<A>(sd);
}

// Forward: y0 = x0 c0 - x1 s0, y1 = x1 c1 + x0 s1; backward (the transpose): y0 = x0 c0 + x1 s1,
// y1 = x1 c1 - x0 s0, for each rotated pair (i0, i1).
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

template <typename T, int N, bool kInterleaved, bool kBackward>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(const T* __restrict__ t, const acc_t<T>* __restrict__ freqs, T* __restrict__ out, int64_t s,
                int64_t bh, int d, int rot, bool per_position) {
  using A = acc_t<T>;
  const int half = rot / 2;
  const int rot_units = kInterleaved ? rot / N : half / N;
  const int pass_units = (d - rot) / N;
  const int64_t row_start = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y;
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  for (int64_t si = blockIdx.x; si < s; si += gridDim.x) {
    const A* f = freqs + (per_position ? si * rot : 0);
    const T* ts = t + si * bh * d;
    T* os = out + si * bh * d;
    for (int u = threadIdx.x; u < rot_units; u += blockDim.x) {
      const int c = u * N;
      if constexpr (kInterleaved) {  // channels c .. c+N-1 hold N/2 pairs (c+2i, c+2i+1)
        A cs[N], sn[N];
#pragma unroll
        for (int k = 0; k < N; ++k) cos_sin(f[c + k], cs[k], sn[k]);
        for (int64_t r = row_start; r < bh; r += row_step) {
          const Pack<T, N> v = load<N>(ts + r * d + c);
          Pack<T, N> o;
#pragma unroll
          for (int k = 0; k < N; k += 2) {
            A y0, y1;
            rotate<kBackward>(static_cast<A>(v.v[k]), static_cast<A>(v.v[k + 1]), cs[k], sn[k], cs[k + 1],
                              sn[k + 1], y0, y1);
            o.v[k] = static_cast<T>(y0);
            o.v[k + 1] = static_cast<T>(y1);
          }
          store<N>(os + r * d + c, o);
        }
      } else {  // channels c .. c+N-1 pair with c+half .. c+half+N-1
        A c0[N], s0[N], c1[N], s1[N];
#pragma unroll
        for (int k = 0; k < N; ++k) {
          cos_sin(f[c + k], c0[k], s0[k]);
          cos_sin(f[c + half + k], c1[k], s1[k]);
        }
        for (int64_t r = row_start; r < bh; r += row_step) {
          const Pack<T, N> v0 = load<N>(ts + r * d + c);
          const Pack<T, N> v1 = load<N>(ts + r * d + c + half);
          Pack<T, N> o0, o1;
#pragma unroll
          for (int k = 0; k < N; ++k) {
            A y0, y1;
            rotate<kBackward>(static_cast<A>(v0.v[k]), static_cast<A>(v1.v[k]), c0[k], s0[k], c1[k], s1[k], y0, y1);
            o0.v[k] = static_cast<T>(y0);
            o1.v[k] = static_cast<T>(y1);
          }
          store<N>(os + r * d + c, o0);
          store<N>(os + r * d + c + half, o1);
        }
      }
    }
    for (int u = threadIdx.x; u < pass_units; u += blockDim.x) {
      const int c = rot + u * N;
      for (int64_t r = row_start; r < bh; r += row_step) store<N>(os + r * d + c, load<N>(ts + r * d + c));
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
  const int64_t units = std::max<int64_t>(kInterleaved ? rot / N : rot / 2 / N, (d - rot) / N);
  int bx = 1;
  while (bx < units && bx < 32) bx *= 2;
  const int by = kThreads / bx;
  const int64_t grid_y = std::clamp<int64_t>(ceil_div(bh, static_cast<int64_t>(by) * kRowsPerThread), 1, kMaxGridY);
  const dim3 grid(static_cast<unsigned>(std::min(s, kMaxGridX)), static_cast<unsigned>(grid_y));
  using A = acc_t<T>;
  rope_kernel<T, N, kInterleaved, kBackward><<<grid, dim3(bx, by), 0, c10::cuda::getCurrentCUDAStream()>>>(
      t.data_ptr<T>(), freqs.data_ptr<A>(), out.data_ptr<T>(), s, bh, static_cast<int>(d), static_cast<int>(rot),
      freqs.size(0) != 1);
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
