// What zrun's CUDA kernels share (ce_rows.cu, swiglu.cu): bf16 as its bits, loads that
// widen to fp32 and stores that round to nearest even. NVRTC compiles the files as one
// program, this one first; no header is needed.

typedef unsigned short zr_bf16;

#define ZR_INF __int_as_float(0x7f800000)

__device__ __forceinline__ float zr_load(const float* p) { return *p; }
__device__ __forceinline__ float zr_load(const zr_bf16* p) {
  return __uint_as_float(((unsigned int)(*p)) << 16);
}
__device__ __forceinline__ void zr_store(float* p, float f) { *p = f; }
// Round to nearest even, as c10::BFloat16; NaN becomes 0x7fc0.
__device__ __forceinline__ void zr_store(zr_bf16* p, float f) {
  unsigned int u = __float_as_uint(f);
  if (f != f) {
    *p = (zr_bf16)0x7fc0u;
    return;
  }
  u += 0x7fffu + ((u >> 16) & 1u);
  *p = (zr_bf16)(u >> 16);
}
