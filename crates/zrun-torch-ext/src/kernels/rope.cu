// Rotary position embedding over heads x (B, T, H, hd), contiguous, n elements, with cos and
// the signed sin (T, hd) (csrc/rope.h). Compiled at run time with NVRTC after common.cuh.
// Forward y_i = x_i cos_i + x_r(i) sin_i with r(i) = (i + hd/2) mod hd; backward
// dx_j = g_j cos_j + g_r(j) sin_r(j) (r is its own inverse). fp32 arithmetic, one rounding.

// I: the index type. 32-bit division is several times cheaper than 64-bit (this kernel does
// three per value), so the entry points take unsigned int wherever n fits.
template <typename T, typename I>
__device__ void zr_rope(const T* x, const T* cos, const T* sin, T* y, I n, I t, I heads, I hd,
                        int backward) {
  const I step = (I)gridDim.x * ZR_EW_THREADS;
  const I half = hd / 2;
  for (I idx = (I)blockIdx.x * ZR_EW_THREADS + threadIdx.x; idx < n; idx += step) {
    const I i = idx % hd;
    const I pos = (idx / (hd * heads)) % t;
    const I r = i < half ? i + half : i - half;
    const I pair = idx - i + r;
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

template <typename T>
__device__ void zr_rope_any(const T* x, const T* cos, const T* sin, T* y, long long n,
                            long long t, long long heads, long long hd, int backward) {
  // The grid-stride's last step must not wrap either.
  if (n + (long long)gridDim.x * ZR_EW_THREADS < 4294967295LL) {
    zr_rope<T, unsigned int>(x, cos, sin, y, (unsigned int)n, (unsigned int)t,
                             (unsigned int)heads, (unsigned int)hd, backward);
  } else {
    zr_rope<T, long long>(x, cos, sin, y, n, t, heads, hd, backward);
  }
}

extern "C" __global__ void __launch_bounds__(ZR_EW_THREADS)
    zr_rope_f32(const float* x, const float* cos, const float* sin, float* y, long long n,
                long long t, long long heads, long long hd, int backward) {
  zr_rope_any<float>(x, cos, sin, y, n, t, heads, hd, backward);
}

extern "C" __global__ void __launch_bounds__(ZR_EW_THREADS)
    zr_rope_bf16(const zr_bf16* x, const zr_bf16* cos, const zr_bf16* sin, zr_bf16* y,
                 long long n, long long t, long long heads, long long hd, int backward) {
  zr_rope_any<zr_bf16>(x, cos, sin, y, n, t, heads, hd, backward);
}
