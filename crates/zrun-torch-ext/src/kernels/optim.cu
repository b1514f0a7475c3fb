// The optimizer's side of a step (kernels/optim.rs): AdamW over pieces of a shard that also
// writes the new parameters in bf16, the fresh share of a split delayed update, and the
// layout of bf16 gradients into an fp32 buffer (copied over it or added to it). Compiled at run time with NVRTC after common.cuh.
//
// A launch takes a table of up to ZR_PIECES pieces by value. Each block works on ZR_CHUNK
// values of one piece, found by a binary search of the table's first blocks; a piece whose
// pointers are all 16-byte aligned (8 bytes for bf16) is read and written four values at a
// time, any other one value at a time. Every value's arithmetic is the same on both paths,
// so a result does not depend on how a shard is cut into pieces.

#define ZR_OPT_THREADS 256
#define ZR_CHUNK 4096
#define ZR_PIECES 48

// Four bf16 values as 8 bytes.
struct ZrBf16x4 {
  unsigned int lo, hi;
};

// Four values at p (16 bytes of fp32, 8 of bf16) as floats, and four floats stored so.
__device__ __forceinline__ void zr_load4(const float* p, float* out) { zr_load16(p, out); }
__device__ __forceinline__ void zr_load4(const zr_bf16* p, float* out) {
  const ZrBf16x4 v = *reinterpret_cast<const ZrBf16x4*>(p);
  out[0] = __uint_as_float(v.lo << 16);
  out[1] = __uint_as_float(v.lo & 0xffff0000u);
  out[2] = __uint_as_float(v.hi << 16);
  out[3] = __uint_as_float(v.hi & 0xffff0000u);
}
__device__ __forceinline__ void zr_store4(float* p, const float* in) { zr_store16(p, in); }
__device__ __forceinline__ void zr_store4(zr_bf16* p, const float* in) {
  zr_bf16 h[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) zr_store(h + k, in[k]);
  ZrBf16x4 v;
  v.lo = (unsigned int)h[0] | ((unsigned int)h[1] << 16);
  v.hi = (unsigned int)h[2] | ((unsigned int)h[3] << 16);
  *reinterpret_cast<ZrBf16x4*>(p) = v;
}

__device__ __forceinline__ bool zr_aligned(const void* p, unsigned long long to) {
  return ((unsigned long long)p & (to - 1)) == 0;
}

// The piece of `first` (count + 1 first blocks, ascending) that block b falls in.
__device__ __forceinline__ int zr_piece_of(const int* first, int count, int b) {
  int lo = 0, hi = count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (first[mid] <= b) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// One piece of an AdamW step: fp32 master p, gradient g (fp32 or bf16, as the entry point
// says), fp32 moments m and v, the bf16 parameters h to write (null: none), n values;
// `decay` says whether the decoupled weight decay applies.
struct ZrAdamPiece {
  float* p;
  const void* g;
  float* m;
  float* v;
  zr_bf16* h;
  long long n;
  int decay;
  int pad;
};

struct ZrAdamTable {
  ZrAdamPiece piece[ZR_PIECES];
  int first[ZR_PIECES + 1];
  int count;
};

// The step's coefficients (optim.rs computes them in f64 and rounds each once):
// grad_factor multiplies the gradient (unscaling and clipping), keep = 1 - lr wd,
// step_size = lr / (1 - b1^t), bc2_sqrt = sqrt(1 - b2^t).
struct ZrAdamHp {
  float grad_factor;
  float keep;
  float b1;
  float omb1;
  float b2;
  float omb2;
  float step_size;
  float bc2_sqrt;
  float eps;
};

// One value's update, torch.optim.AdamW's arithmetic in fp32.
__device__ __forceinline__ void zr_adam_one(float& p, float g, float& m, float& v,
                                            const ZrAdamHp& hp, int decay) {
  g = g * hp.grad_factor;
  if (decay) p = p * hp.keep;
  m = fmaf(hp.b1, m, hp.omb1 * g);
  v = fmaf(hp.b2, v, (hp.omb2 * g) * g);
  const float denom = sqrtf(v) / hp.bc2_sqrt + hp.eps;
  p = p - (hp.step_size * m) / denom;
}

template <typename G>
__device__ void zr_adamw(const ZrAdamTable& t, const ZrAdamHp& hp) {
  const int b = blockIdx.x;
  const int k = zr_piece_of(t.first, t.count, b);
  const ZrAdamPiece& pc = t.piece[k];
  float* p = pc.p;
  const G* g = static_cast<const G*>(pc.g);
  float* m = pc.m;
  float* v = pc.v;
  zr_bf16* h = pc.h;
  const long long start = (long long)(b - t.first[k]) * ZR_CHUNK;
  const long long len = min((long long)ZR_CHUNK, pc.n - start);
  long long i = start + threadIdx.x;
  const bool vec = zr_aligned(p, 16) && zr_aligned(g, 4 * sizeof(G)) && zr_aligned(m, 16) &&
                   zr_aligned(v, 16) && (h == nullptr || zr_aligned(h, 8));
  if (vec) {
    const long long end4 = start + len / 4 * 4;
    for (long long j = start + 4 * (long long)threadIdx.x; j < end4; j += 4 * ZR_OPT_THREADS) {
      float pp[4], gg[4], mm[4], vv[4];
      zr_load4(p + j, pp);
      zr_load4(g + j, gg);
      zr_load4(m + j, mm);
      zr_load4(v + j, vv);
#pragma unroll
      for (int q = 0; q < 4; ++q) zr_adam_one(pp[q], gg[q], mm[q], vv[q], hp, pc.decay);
      zr_store4(p + j, pp);
      zr_store4(m + j, mm);
      zr_store4(v + j, vv);
      if (h != nullptr) zr_store4(h + j, pp);
    }
    i = end4 + threadIdx.x;
  }
  for (; i < start + len; i += ZR_OPT_THREADS) {
    float pp = p[i], mm = m[i], vv = v[i];
    zr_adam_one(pp, zr_load(g + i), mm, vv, hp, pc.decay);
    p[i] = pp;
    m[i] = mm;
    v[i] = vv;
    if (h != nullptr) zr_store(h + i, pp);
  }
}

extern "C" __global__ void __launch_bounds__(ZR_OPT_THREADS)
    zr_adamw_f32(const ZrAdamTable t, const ZrAdamHp hp) {
  zr_adamw<float>(t, hp);
}

extern "C" __global__ void __launch_bounds__(ZR_OPT_THREADS)
    zr_adamw_bf16(const ZrAdamTable t, const ZrAdamHp hp) {
  zr_adamw<zr_bf16>(t, hp);
}

// One piece of a split delayed update's fresh share (zrun-shard's fresh.rs): the compute
// parameters p (float or bf16, as the entry point says) lose the newest gradient's share of
// an AdamW update, from g (float or bf16) and v, the second moment before it (bf16); n values.
struct ZrSharePiece {
  void* p;
  const void* g;
  const zr_bf16* v;
  long long n;
};

struct ZrShareTable {
  ZrSharePiece piece[ZR_PIECES];
  int first[ZR_PIECES + 1];
  int count;
};

// The share's coefficients (optim.rs rounds each once from f64): grad_factor multiplies the
// gradient, step_size = lr (1 - b1) / (1 - b1^t), bc2_sqrt = sqrt(1 - b2^t).
struct ZrShareHp {
  float grad_factor;
  float b2;
  float omb2;
  float step_size;
  float bc2_sqrt;
  float eps;
};

// One value: p - step_size g / (sqrt(b2 v + (1 - b2) g^2) / bc2_sqrt + eps), with g
// multiplied by grad_factor first; zr_adam_one's v and denominator.
__device__ __forceinline__ float zr_share_one(float p, float g, float v, const ZrShareHp& hp) {
  g = g * hp.grad_factor;
  const float vt = fmaf(hp.b2, v, (hp.omb2 * g) * g);
  const float denom = sqrtf(vt) / hp.bc2_sqrt + hp.eps;
  return p - (hp.step_size * g) / denom;
}

template <typename P, typename G>
__device__ void zr_fresh_share(const ZrShareTable& t, const ZrShareHp& hp) {
  const int b = blockIdx.x;
  const int k = zr_piece_of(t.first, t.count, b);
  const ZrSharePiece& pc = t.piece[k];
  P* p = static_cast<P*>(pc.p);
  const G* g = static_cast<const G*>(pc.g);
  const zr_bf16* v = pc.v;
  const long long start = (long long)(b - t.first[k]) * ZR_CHUNK;
  const long long len = min((long long)ZR_CHUNK, pc.n - start);
  long long i = start + threadIdx.x;
  if (zr_aligned(p, 4 * sizeof(P)) && zr_aligned(g, 4 * sizeof(G)) && zr_aligned(v, 8)) {
    const long long end4 = start + len / 4 * 4;
    for (long long j = start + 4 * (long long)threadIdx.x; j < end4; j += 4 * ZR_OPT_THREADS) {
      float pp[4], gg[4], vv[4];
      zr_load4(p + j, pp);
      zr_load4(g + j, gg);
      zr_load4(v + j, vv);
#pragma unroll
      for (int q = 0; q < 4; ++q) pp[q] = zr_share_one(pp[q], gg[q], vv[q], hp);
      zr_store4(p + j, pp);
    }
    i = end4 + threadIdx.x;
  }
  for (; i < start + len; i += ZR_OPT_THREADS) {
    zr_store(p + i, zr_share_one(zr_load(p + i), zr_load(g + i), zr_load(v + i), hp));
  }
}

// The entry points, by the parameters' dtype, then the gradients'.
#define ZR_FRESH_SHARE(name, P, G)                                                           \
  extern "C" __global__ void __launch_bounds__(ZR_OPT_THREADS)                               \
      name(const ZrShareTable t, const ZrShareHp hp) {                                       \
    zr_fresh_share<P, G>(t, hp);                                                             \
  }
ZR_FRESH_SHARE(zr_fresh_share_f32_f32, float, float)
ZR_FRESH_SHARE(zr_fresh_share_f32_bf16, float, zr_bf16)
ZR_FRESH_SHARE(zr_fresh_share_bf16_f32, zr_bf16, float)
ZR_FRESH_SHARE(zr_fresh_share_bf16_bf16, zr_bf16, zr_bf16)

// One piece of a gradient layout: n bf16 values of src copied over the fp32 dst (add = 0) or
// added to it (add = 1).
struct ZrCastPiece {
  float* dst;
  const zr_bf16* src;
  long long n;
  int add;
  int pad;
};

struct ZrCastTable {
  ZrCastPiece piece[ZR_PIECES];
  int first[ZR_PIECES + 1];
  int count;
};

extern "C" __global__ void __launch_bounds__(ZR_OPT_THREADS) zr_cast_into(const ZrCastTable t) {
  const int b = blockIdx.x;
  const int k = zr_piece_of(t.first, t.count, b);
  const ZrCastPiece& pc = t.piece[k];
  float* dst = pc.dst;
  const zr_bf16* src = pc.src;
  const long long start = (long long)(b - t.first[k]) * ZR_CHUNK;
  const long long len = min((long long)ZR_CHUNK, pc.n - start);
  long long i = start + threadIdx.x;
  if (zr_aligned(dst, 16) && zr_aligned(src, 8)) {
    const long long end4 = start + len / 4 * 4;
    for (long long j = start + 4 * (long long)threadIdx.x; j < end4; j += 4 * ZR_OPT_THREADS) {
      float s[4];
      zr_load4(src + j, s);
      if (pc.add) {
        float d[4];
        zr_load4(dst + j, d);
#pragma unroll
        for (int q = 0; q < 4; ++q) s[q] = d[q] + s[q];
      }
      zr_store4(dst + j, s);
    }
    i = end4 + threadIdx.x;
  }
  for (; i < start + len; i += ZR_OPT_THREADS) {
    const float s = zr_load(src + i);
    dst[i] = pc.add ? dst[i] + s : s;
  }
}
