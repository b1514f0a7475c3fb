// What zrun's CUDA kernels share: bf16 as its bits, loads that widen to fp32 and stores that
// round to nearest even, one at a time or 16 bytes at a time (16-byte aligned). NVRTC compiles the files as one
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

// Values of T in 16 bytes.
template <typename T>
struct ZrVec;
template <>
struct ZrVec<float> {
  static const int n = 4;
};
template <>
struct ZrVec<zr_bf16> {
  static const int n = 8;
};

// 16 bytes at p as floats.
__device__ __forceinline__ void zr_load16(const float* p, float* out) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  out[0] = v.x;
  out[1] = v.y;
  out[2] = v.z;
  out[3] = v.w;
}
__device__ __forceinline__ void zr_load16(const zr_bf16* p, float* out) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  const unsigned int w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    out[2 * k] = __uint_as_float(w[k] << 16);
    out[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
  }
}

// ZrVec<T>::n floats stored at p as 16 bytes, each rounded once.
__device__ __forceinline__ void zr_store16(float* p, const float* in) {
  *reinterpret_cast<float4*>(p) = make_float4(in[0], in[1], in[2], in[3]);
}
__device__ __forceinline__ void zr_store16(zr_bf16* p, const float* in) {
  zr_bf16 h[8];
#pragma unroll
  for (int k = 0; k < 8; ++k) zr_store(h + k, in[k]);
  unsigned int w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) w[k] = (unsigned int)h[2 * k] | ((unsigned int)h[2 * k + 1] << 16);
  *reinterpret_cast<uint4*>(p) = make_uint4(w[0], w[1], w[2], w[3]);
}
