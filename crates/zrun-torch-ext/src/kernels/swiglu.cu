// SwiGLU's product and its gradients (csrc/swiglu.h), elementwise over n contiguous values.
// Compiled at run time with NVRTC after common.cuh. The arithmetic is fp32, rounded once per
// output: forward silu(a) * b; backward d(b) = g silu(a), d(a) = g b s (1 + a (1 - s)) with
// s = sigmoid(a), ATen's silu_backward of g b.

#define ZR_EW_THREADS 256

__device__ __forceinline__ float zr_sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

template <typename T>
__device__ void zr_swiglu_fwd(const T* a, const T* b, T* out, long long n) {
  const long long step = (long long)gridDim.x * ZR_EW_THREADS;
  for (long long i = (long long)blockIdx.x * ZR_EW_THREADS + threadIdx.x; i < n; i += step) {
    const float x = zr_load(a + i);
    zr_store(out + i, x * zr_sigmoid(x) * zr_load(b + i));
  }
}

template <typename T>
__device__ void zr_swiglu_bwd(const T* a, const T* b, const T* g, T* da, T* db, long long n) {
  const long long step = (long long)gridDim.x * ZR_EW_THREADS;
  for (long long i = (long long)blockIdx.x * ZR_EW_THREADS + threadIdx.x; i < n; i += step) {
    const float x = zr_load(a + i);
    const float y = zr_load(b + i);
    const float d = zr_load(g + i);
    const float s = zr_sigmoid(x);
    zr_store(db + i, d * (x * s));
    zr_store(da + i, d * y * s * (1.0f + x * (1.0f - s)));
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
