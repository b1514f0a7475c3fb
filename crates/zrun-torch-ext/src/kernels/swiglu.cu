// SwiGLU's product and its gradients (csrc/swiglu.h), elementwise over n contiguous values.
// Compiled at run time with NVRTC after common.cuh. The arithmetic is fp32, rounded once per
// output: forward silu(a) * b; backward d(b) = g silu(a), d(a) = g b s (1 + a (1 - s)) with
// s = sigmoid(a), ATen's silu_backward of g b.

#define ZR_EW_THREADS 256

__device__ __forceinline__ float zr_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

// Each thread takes four values a stride of the grid apart per round (four loads of each
// input in flight), then the rest one at a time.
template <typename T>
__device__ void zr_swiglu_fwd(const T* a, const T* b, T* out, long long n) {
  const long long step = (long long)gridDim.x * ZR_EW_THREADS;
  long long i = (long long)blockIdx.x * ZR_EW_THREADS + threadIdx.x;
  for (; i + 3 * step < n; i += 4 * step) {
    float x[4], y[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      x[k] = zr_load(a + i + k * step);
      y[k] = zr_load(b + i + k * step);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      zr_store(out + i + k * step, x[k] * zr_sigmoid(x[k]) * y[k]);
    }
  }
  for (; i < n; i += step) {
    const float x = zr_load(a + i);
    zr_store(out + i, x * zr_sigmoid(x) * zr_load(b + i));
  }
}

// One value's two gradients.
template <typename T>
__device__ __forceinline__ void zr_swiglu_grad(float x, float y, float d, T* da, T* db) {
  const float s = zr_sigmoid(x);
  zr_store(db, d * (x * s));
  zr_store(da, d * y * s * (1.0f + x * (1.0f - s)));
}

template <typename T>
__device__ void zr_swiglu_bwd(const T* a, const T* b, const T* g, T* da, T* db, long long n) {
  const long long step = (long long)gridDim.x * ZR_EW_THREADS;
  long long i = (long long)blockIdx.x * ZR_EW_THREADS + threadIdx.x;
  for (; i + 3 * step < n; i += 4 * step) {
    float x[4], y[4], d[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      x[k] = zr_load(a + i + k * step);
      y[k] = zr_load(b + i + k * step);
      d[k] = zr_load(g + i + k * step);
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      zr_swiglu_grad(x[k], y[k], d[k], da + i + k * step, db + i + k * step);
    }
  }
  for (; i < n; i += step) {
    zr_swiglu_grad(zr_load(a + i), zr_load(b + i), zr_load(g + i), da + i, db + i);
  }
}

extern "C" __global__ void __launch_bounds__(ZR_EW_THREADS)
    zr_swiglu_fwd_f32(const float* a, const float* b, float* out, long long n) {
  zr_swiglu_fwd<float>(a, b, out, n);
}

extern "C" __global__ void __launch_bounds__(ZR_EW_THREADS)
    zr_swiglu_fwd_bf16(const zr_bf16* a, const zr_bf16* b, zr_bf16* out, long long n) {
  zr_swiglu_fwd<zr_bf16>(a, b, out, n);
}

extern "C" __global__ void __launch_bounds__(ZR_EW_THREADS)
    zr_swiglu_bwd_f32(const float* a, const float* b, const float* g, float* da, float* db,
                      long long n) {
  zr_swiglu_bwd<float>(a, b, g, da, db, n);
}

extern "C" __global__ void __launch_bounds__(ZR_EW_THREADS)
    zr_swiglu_bwd_bf16(const zr_bf16* a, const zr_bf16* b, const zr_bf16* g, zr_bf16* da,
                       zr_bf16* db, long long n) {
  zr_swiglu_bwd<zr_bf16>(a, b, g, da, db, n);
}
