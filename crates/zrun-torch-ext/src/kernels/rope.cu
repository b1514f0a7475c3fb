// Rotary position embedding over heads x (B, T, H, hd), contiguous, n elements, with cos and
// the signed sin (T, hd) (csrc/rope.h). Compiled at run time with NVRTC after common.cuh.
// Forward y_i = x_i cos_i + x_r(i) sin_i with r(i) = (i + hd/2) mod hd; backward
// dx_j = g_j cos_j + g_r(j) sin_r(j) (r is its own inverse). fp32 arithmetic, one rounding.

template <typename T>
__device__ void zr_rope(const T* x, const T* cos, const T* sin, T* y, long long n, long long t,
                        long long heads, long long hd, int backward) {
  const long long step = (long long)gridDim.x * ZR_EW_THREADS;
  const long long half = hd / 2;
  for (long long idx = (long long)blockIdx.x * ZR_EW_THREADS + threadIdx.x; idx < n;
       idx += step) {
    const long long i = idx % hd;
    const long long pos = (idx / (hd * heads)) % t;
    const long long r = i < half ? i + half : i - half;
    const long long pair = idx - i + r;
    const T* at = cos + pos * hd;
    const T* st = sin + pos * hd;
    float v;
    if (backward) {
      v = zr_load(x + idx) * zr_load(at + i) + zr_load(x + pair) * zr_load(st + r);
    } else {
      v = zr_load(x + idx) * zr_load(at + i) + zr_load(x + pair) * zr_load(st + i);
    }
    zr_store(y + idx, v);
  }
}

extern "C" __global__ void __launch_bounds__(ZR_EW_THREADS)
    zr_rope_f32(const float* x, const float* cos, const float* sin, float* y, long long n,
                long long t, long long heads, long long hd, int backward) {
  zr_rope<float>(x, cos, sin, y, n, t, heads, hd, backward);
}

extern "C" __global__ void __launch_bounds__(ZR_EW_THREADS)
    zr_rope_bf16(const zr_bf16* x, const zr_bf16* cos, const zr_bf16* sin, zr_bf16* y,
                 long long n, long long t, long long heads, long long hd, int backward) {
  zr_rope<zr_bf16>(x, cos, sin, y, n, t, heads, hd, backward);
}
