// Column sums of a row-major (rows, cols) gradient dy (csrc/colsum.h): a Linear's bias
// gradient (the sum of dy over rows), and with x, mean and rstd LayerNorm's weight and bias
// gradients (the sums of dy (x - mean) rstd and of dy). With dh (GELU's backward fused with
// the bias gradient of the Linear before it) x is GELU's input h: each row's dy gelu'(h) is
// stored into dh and its sum (of the stored values) taken instead of dy's. Compiled at run time with NVRTC after
// common.cuh. fp32 sums, in a fixed order: the first pass sums each split of rows into fp32
// partials (one block per split and span of columns), the second sums the partials in split
// order and rounds once, so a result depends on the shapes only.
//
// A thread of the first pass owns ZrVec<T>::n consecutive columns, loaded 16 bytes at a time
// (the caller checks cols % ZrVec<T>::n == 0 and 16-byte aligned rows); a warp covers a span
// of 32 ZrVec<T>::n columns of a row and the block's warps take every ZR_CS_WARPS-th row of
// the split.

#define ZR_CS_THREADS 256
#define ZR_CS_WARPS 8

// f as a T holds it (rounded to nearest even for bf16).
__device__ __forceinline__ float zr_round_as(const float*, float f) { return f; }
__device__ __forceinline__ float zr_round_as(const zr_bf16*, float f) {
  zr_bf16 b;
  zr_store(&b, f);
  return zr_load(&b);
}

// dy times the derivative of the tanh GELU at x, in ATen's steps (GeluCUDAKernelImpl's
// backward, in float).
__device__ __forceinline__ float zr_gelu_tanh_grad(float dy, float x) {
  const float kBeta = 0.7978845608028654f;  // sqrt(2 / pi)
  const float kKappa = 0.044715f;
  const float x_sq = x * x;
  const float x_cube = x_sq * x;
  const float inner = kBeta * (x + kKappa * x_cube);
  const float t = tanhf(inner);
  const float left = 0.5f * x;
  const float right = 1.0f + t;
  const float left_derivative = 0.5f * right;
  const float tanh_derivative = 1.0f - t * t;
  const float inner_derivative = kBeta * (1.0f + 3.0f * kKappa * x_sq);
  const float right_derivative = left * tanh_derivative * inner_derivative;
  return dy * (left_derivative + right_derivative);
}

// One row's contribution to a thread's columns.
template <typename T>
__device__ __forceinline__ void zr_cs_row(const T* dy, const T* x, const float* mean,
                                          const float* rstd, T* dh, long long r,
                                          long long cols, long long col, float* sb,
                                          float* sg) {
  const int V = ZrVec<T>::n;
  float d[V];
  zr_load16(dy + r * cols + col, d);
  if (dh != nullptr) {
    float h[V];
    zr_load16(x + r * cols + col, h);
#pragma unroll
    for (int k = 0; k < V; ++k) d[k] = zr_gelu_tanh_grad(d[k], h[k]);
    zr_store16(dh + r * cols + col, d);
#pragma unroll
    for (int k = 0; k < V; ++k) sb[k] += zr_round_as(dh, d[k]);
    return;
  }
#pragma unroll
  for (int k = 0; k < V; ++k) sb[k] += d[k];
  if (x != nullptr) {
    float v[V];
    zr_load16(x + r * cols + col, v);
    const float m = mean[r], s = rstd[r];
#pragma unroll
    for (int k = 0; k < V; ++k) sg[k] += d[k] * ((v[k] - m) * s);
  }
}

// The first pass: block b takes the span b % spans of columns and the split b / spans of
// `per_split` rows; writes the split's sums of dy to part[split][col] and (with x) those of
// dy (x - mean) rstd to part[splits + split][col]; with dh, stores dy gelu'(x) into dh and
// writes the split's sums of what it stored to part[split][col].
template <typename T>
__device__ void zr_colsum_part(const T* dy, const T* x, const float* mean, const float* rstd,
                               T* dh, float* part, long long rows, long long cols,
                               long long per_split) {
  const int V = ZrVec<T>::n;
  const long long span = 32LL * V;
  const long long spans = (cols + span - 1) / span;
  const long long splits = gridDim.x / spans;
  const long long sp = blockIdx.x % spans, split = blockIdx.x / spans;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long col = sp * span + lane * V;
  const long long r0 = split * per_split;
  const long long r1 = r0 + per_split < rows ? r0 + per_split : rows;
  float sb[V], sg[V];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    sb[k] = 0.0f;
    sg[k] = 0.0f;
  }
  if (col < cols) {
#pragma unroll 4
    for (long long r = r0 + warp; r < r1; r += ZR_CS_WARPS) {
      zr_cs_row(dy, x, mean, rstd, dh, r, cols, col, sb, sg);
    }
  }
  // The warps' sums of each column, added in warp order.
  __shared__ float shb[ZR_CS_WARPS][32 * 8];
  __shared__ float shg[ZR_CS_WARPS][32 * 8];
#pragma unroll
  for (int k = 0; k < V; ++k) {
    shb[warp][lane * V + k] = sb[k];
    shg[warp][lane * V + k] = sg[k];
  }
  __syncthreads();
  for (long long c = threadIdx.x; c < span; c += ZR_CS_THREADS) {
    const long long gc = sp * span + c;
    if (gc < cols) {
      float b = 0.0f, g = 0.0f;
      for (int w = 0; w < ZR_CS_WARPS; ++w) {
        b += shb[w][c];
        g += shg[w][c];
      }
      part[split * cols + gc] = b;
      if (x != nullptr && dh == nullptr) part[(splits + split) * cols + gc] = g;
    }
  }
}

// The second pass: block b takes the 32 columns from 32 b; its warp w adds the partials of
// splits w, w + ZR_CS_WARPS, ... in order, then the warps' sums are added in warp order and
// rounded once into out_b (and with out_g the second half's into out_g). Many loads in
// flight: one thread per column summing every split in turn waited for each load in a row.
template <typename T>
__device__ void zr_colsum_fin(const float* part, T* out_b, T* out_g, long long splits,
                              long long cols) {
  __shared__ float fb[ZR_CS_WARPS][32];
  __shared__ float fg[ZR_CS_WARPS][32];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const long long c = (long long)blockIdx.x * 32 + lane;
  float b = 0.0f, g = 0.0f;
  if (c < cols) {
#pragma unroll 4
    for (long long s = warp; s < splits; s += ZR_CS_WARPS) {
      b += part[s * cols + c];
      if (out_g != nullptr) g += part[(splits + s) * cols + c];
    }
  }
  fb[warp][lane] = b;
  fg[warp][lane] = g;
  __syncthreads();
  if (warp == 0 && c < cols) {
    float tb = 0.0f, tg = 0.0f;
    for (int w = 0; w < ZR_CS_WARPS; ++w) {
      tb += fb[w][lane];
      tg += fg[w][lane];
    }
    zr_store(out_b + c, tb);
    if (out_g != nullptr) zr_store(out_g + c, tg);
  }
}

extern "C" __global__ void __launch_bounds__(ZR_CS_THREADS)
    zr_colsum_part_f32(const float* dy, const float* x, const float* mean, const float* rstd,
                       float* dh, float* part, long long rows, long long cols,
                       long long per_split) {
  zr_colsum_part<float>(dy, x, mean, rstd, dh, part, rows, cols, per_split);
}

extern "C" __global__ void __launch_bounds__(ZR_CS_THREADS)
    zr_colsum_part_bf16(const zr_bf16* dy, const zr_bf16* x, const float* mean,
                        const float* rstd, zr_bf16* dh, float* part, long long rows,
                        long long cols, long long per_split) {
  zr_colsum_part<zr_bf16>(dy, x, mean, rstd, dh, part, rows, cols, per_split);
}

extern "C" __global__ void __launch_bounds__(ZR_CS_THREADS)
    zr_colsum_fin_f32(const float* part, float* out_b, float* out_g, long long splits,
                      long long cols) {
  zr_colsum_fin<float>(part, out_b, out_g, splits, cols);
}

extern "C" __global__ void __launch_bounds__(ZR_CS_THREADS)
    zr_colsum_fin_bf16(const float* part, zr_bf16* out_b, zr_bf16* out_g, long long splits,
                       long long cols) {
  zr_colsum_fin<zr_bf16>(part, out_b, out_g, splits, cols);
}
