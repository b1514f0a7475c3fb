// Softmax cross-entropy per row of the logits, and its gradient written over them
// (csrc/fused_loss.h, ce_rows). Compiled at run time with NVRTC after common.cuh.
//
// One block per row, read 16 bytes per thread and load between the row's first and last
// 16-byte boundaries, one value at a time outside them. Pass 1 reads the row once, each thread keeping a running maximum and
// the sum of exponentials below it (online softmax), merged across the block; the row's
// logsumexp follows. Pass 2 (with grad) reads the row again and writes
// coef x (exp(x - lse) - one-hot(target)), rounded once to the logits' dtype. The target's
// logit is read before any thread writes. NaN anywhere in a row makes its loss NaN (as
// ATen's); a row whose coef is 0 gets loss 0 and a zero gradient; a target outside [0, V)
// gives a NaN loss.

#define ZR_THREADS 512
#define ZR_WARPS (ZR_THREADS / 32)

// (m, s): the largest value seen and the sum of exp(x - m) over the values seen; m = -inf
// with s = 0 for none.
__device__ __forceinline__ void zr_merge(float& m, float& s, float m2, float s2) {
  if (m2 == -ZR_INF) {
    return;
  }
  if (m == -ZR_INF) {
    m = m2;
    s = s2;
    return;
  }
  const float top = fmaxf(m, m2);
  s = s * expf(m - top) + s2 * expf(m2 - top);
  m = top;
}

// One value into a thread's running (m, s); NaN only sets the flag, -inf counts for nothing.
__device__ __forceinline__ void zr_online(float& m, float& s, int& nan, float a) {
  if (a != a) {
    nan = 1;
  } else if (a > m) {
    s = (m == -ZR_INF ? 0.0f : s * expf(m - a)) + 1.0f;
    m = a;
  } else if (a != -ZR_INF) {
    s += expf(a - m);
  }
}

// The gradient of one logit `a`: coef x (softmax - one-hot); 0 in a row of weight 0.
__device__ __forceinline__ float zr_grad(float a, float lse, bool target, float c) {
  return c == 0.0f ? 0.0f : (expf(a - lse) - (target ? 1.0f : 0.0f)) * c;
}

template <typename T>
__device__ void zr_ce_rows(T* logits, const long long* targets, const float* coef, float* loss,
                           long long v, int grad) {
  __shared__ float sh_m[ZR_WARPS];
  __shared__ float sh_s[ZR_WARPS];
  __shared__ float sh_lse;
  __shared__ float sh_target;
  const long long row = blockIdx.x;
  T* x = logits + row * v;
  const long long t = targets[row];
  const float c = coef[row];
  if (threadIdx.x == 0) {
    // A target outside the row (bad data) is never read: the row's loss is NaN, which the
    // trainer stops on, and its gradient has no one-hot.
    sh_target = (t < 0 || t >= v) ? __int_as_float(0x7fc00000) : zr_load(x + t);
  }
  float m = -ZR_INF;
  float s = 0.0f;
  int nan = 0;
  // The values before the row's first 16-byte boundary, the whole 16-byte vectors (two in
  // flight per thread), and the values after them.
  const int V = ZrVec<T>::n;
  const long long mis = (long long)(((unsigned long long)x / sizeof(T)) % V);
  const long long head = mis == 0 ? 0 : (V - mis < v ? V - mis : v);
  const long long nvec = (v - head) / V;
  const long long tail = head + nvec * V;
  T* xv = x + head;
  for (long long j = threadIdx.x; j < head; j += ZR_THREADS) {
    zr_online(m, s, nan, zr_load(x + j));
  }
  long long i = threadIdx.x;
  for (; i + ZR_THREADS < nvec; i += 2 * ZR_THREADS) {
    float a[2 * ZrVec<T>::n];
    zr_load16(xv + i * V, a);
    zr_load16(xv + (i + ZR_THREADS) * V, a + V);
#pragma unroll
    for (int k = 0; k < 2 * V; ++k) {
      zr_online(m, s, nan, a[k]);
    }
  }
  for (; i < nvec; i += ZR_THREADS) {
    float a[ZrVec<T>::n];
    zr_load16(xv + i * V, a);
#pragma unroll
    for (int k = 0; k < V; ++k) {
      zr_online(m, s, nan, a[k]);
    }
  }
  for (long long j = tail + threadIdx.x; j < v; j += ZR_THREADS) {
    zr_online(m, s, nan, zr_load(x + j));
  }
  for (int off = 16; off > 0; off >>= 1) {
    const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
    const float s2 = __shfl_xor_sync(0xffffffffu, s, off);
    zr_merge(m, s, m2, s2);
  }
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (lane == 0) {
    sh_m[warp] = m;
    sh_s[warp] = s;
  }
  nan = __syncthreads_or(nan);
  if (warp == 0) {
    m = lane < ZR_WARPS ? sh_m[lane] : -ZR_INF;
    s = lane < ZR_WARPS ? sh_s[lane] : 0.0f;
    for (int off = 16; off > 0; off >>= 1) {
      const float m2 = __shfl_xor_sync(0xffffffffu, m, off);
      const float s2 = __shfl_xor_sync(0xffffffffu, s, off);
      zr_merge(m, s, m2, s2);
    }
    if (lane == 0) {
      const float lse = nan ? __int_as_float(0x7fc00000) : m + logf(s);
      sh_lse = lse;
      loss[row] = c == 0.0f ? 0.0f : lse - sh_target;
    }
  }
  __syncthreads();
  if (!grad) {
    return;
  }
  const float lse = sh_lse;
  for (long long j = threadIdx.x; j < head; j += ZR_THREADS) {
    zr_store(x + j, zr_grad(zr_load(x + j), lse, j == t, c));
  }
  for (i = threadIdx.x; i < nvec; i += ZR_THREADS) {
    float a[ZrVec<T>::n];
    zr_load16(xv + i * V, a);
    const long long at = head + i * V;
#pragma unroll
    for (int k = 0; k < V; ++k) {
      a[k] = zr_grad(a[k], lse, at + k == t, c);
    }
    zr_store16(xv + i * V, a);
  }
  for (long long j = tail + threadIdx.x; j < v; j += ZR_THREADS) {
    zr_store(x + j, zr_grad(zr_load(x + j), lse, j == t, c));
  }
}

extern "C" __global__ void __launch_bounds__(ZR_THREADS)
    zr_ce_rows_f32(float* logits, const long long* targets, const float* coef, float* loss,
                   long long v, int grad) {
  zr_ce_rows<float>(logits, targets, coef, loss, v, grad);
}

extern "C" __global__ void __launch_bounds__(ZR_THREADS)
    zr_ce_rows_bf16(zr_bf16* logits, const long long* targets, const float* coef, float* loss,
                    long long v, int grad) {
  zr_ce_rows<zr_bf16>(logits, targets, coef, loss, v, grad);
}
