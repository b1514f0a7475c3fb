// Runs src/kernels/*.cu as plain C++ on the CPU: each CUDA thread of a block is a fiber
// (ucontext) of one OS thread, __syncthreads a barrier at which a fiber yields until the
// block's others arrive, a warp shuffle an exchange through memory between two warp
// barriers, __shared__ a static shared by the block's threads (blocks run one at a time).
// Checks ce_rows' losses and the gradient it writes over the logits, swiglu's forward and
// gradients, rope, colsum's sums, and the optimizer's AdamW, fresh share and gradient layout,
// against double precision references, for fp32 and bf16, and prints "ok" or what is off (the
// test in fused_loss.rs compiles and runs it).

#include <cmath>
#include <math.h>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <functional>
#include <memory>
#include <random>
#include <ucontext.h>
#include <vector>

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static

struct Dim {
  unsigned x = 0, y = 0, z = 0;
};
Dim threadIdx;  // the running fiber's
Dim blockIdx;
Dim gridDim;

inline float __uint_as_float(unsigned u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline unsigned __float_as_uint(float f) {
  unsigned u;
  std::memcpy(&u, &f, 4);
  return u;
}
inline float __int_as_float(int i) {
  float f;
  std::memcpy(&f, &i, 4);
  return f;
}




constexpr int kThreads = 512;

// A barrier of fibers: the last to arrive releases the others (a new generation) and runs on.
struct Barrier {
  unsigned expected;
  unsigned arrived = 0;
  unsigned long generation = 0;
};

struct Fiber {
  ucontext_t context;
  std::unique_ptr<char[]> stack;
  unsigned tid = 0;
  Barrier* waits_at = nullptr;
  unsigned long generation = 0;  // waits_at's when it arrived
  bool done = false;
};

ucontext_t g_scheduler;
Fiber* g_running = nullptr;
const std::function<void()>* g_body = nullptr;
Barrier* g_barrier = nullptr;
std::vector<Barrier>* g_warps = nullptr;
float g_lanes[kThreads];
int g_or = 0;

void arrive_and_wait(Barrier& b) {
  if (++b.arrived == b.expected) {
    b.arrived = 0;
    ++b.generation;
    return;
  }
  Fiber* f = g_running;
  f->waits_at = &b;
  f->generation = b.generation;
  swapcontext(&f->context, &g_scheduler);
}

inline void __syncthreads() { arrive_and_wait(*g_barrier); }
inline int __syncthreads_or(int p) {
  if (p) g_or = 1;
  __syncthreads();
  const int r = g_or;
  __syncthreads();
  if (threadIdx.x == 0) g_or = 0;
  __syncthreads();
  return r;
}
// The 32 threads of a warp call it together (full mask, as the kernel's shuffles).
inline float __shfl_xor_sync(unsigned, float v, int off) {
  Barrier& warp = (*g_warps)[threadIdx.x / 32];
  g_lanes[threadIdx.x] = v;
  arrive_and_wait(warp);
  const float r = g_lanes[(threadIdx.x & ~31u) | ((threadIdx.x & 31u) ^ unsigned(off))];
  arrive_and_wait(warp);
  return r;
}

struct float4 {
  float x, y, z, w;
};
struct uint4 {
  unsigned x, y, z, w;
};
inline float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }

#include "../src/kernels/common.cuh"
#include "../src/kernels/ce_rows.cu"
#include "../src/kernels/swiglu.cu"
#include "../src/kernels/rope.cu"

#include "../src/kernels/colsum.cu"

using std::min;
#include "../src/kernels/optim.cu"

void fiber_main() {
  (*g_body)();
  g_running->done = true;
}  // returns to g_scheduler (uc_link)

// Runs `rows` blocks of `block` threads, one block after another; each block's fibers run in
// turn, each until it waits at a barrier that has not released or ends.
template <typename F>
void launch(unsigned rows, F body, unsigned block = kThreads) {
  constexpr size_t kStack = 256 << 10;
  const std::function<void()> run = body;
  g_body = &run;
  gridDim.x = rows;
  std::vector<Fiber> fibers(block);  // their stacks serve every block
  for (Fiber& f : fibers) f.stack.reset(new char[kStack]);
  for (unsigned b = 0; b < rows; ++b) {
    Barrier bar{block};
    std::vector<Barrier> warps(block / 32, Barrier{32});
    g_barrier = &bar;
    g_warps = &warps;
    blockIdx.x = b;
    for (unsigned t = 0; t < block; ++t) {
      Fiber& f = fibers[t];
      f.tid = t;
      f.waits_at = nullptr;
      f.done = false;
      getcontext(&f.context);
      f.context.uc_stack.ss_sp = f.stack.get();
      f.context.uc_stack.ss_size = kStack;
      f.context.uc_link = &g_scheduler;
      makecontext(&f.context, fiber_main, 0);
    }
    for (;;) {
      unsigned live = 0, ran = 0;
      for (Fiber& f : fibers) {
        if (f.done) continue;
        ++live;
        if (f.waits_at && f.waits_at->generation == f.generation) continue;
        f.waits_at = nullptr;
        g_running = &f;
        threadIdx.x = f.tid;
        swapcontext(&g_scheduler, &f.context);
        ++ran;
      }
      if (live == 0) break;
      if (ran == 0) {
        std::printf("block %u: every live thread waits at a barrier the others never reach\n", b);
        std::exit(1);
      }
    }
  }
}

float bf16_round(float f) {
  unsigned short h;
  zr_store(&h, f);
  return zr_load(&h);
}

int main() {
  std::mt19937 rng(5);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  int bad = 0;
  for (long long v : {37LL, 1000LL, 5003LL}) {
    const long long n = 5;
    std::vector<float> base(n * v);
    for (auto& x : base) x = normal(rng);
    base[1 * v + 3] = -INFINITY;  // a -inf logit counts for nothing
    std::vector<long long> targets = {0, v - 1, v / 2, 1, 2};
    std::vector<float> coef = {0.25f, 0.5f, 0.0f, 1.0f, 0.125f};
    for (int bf = 0; bf < 2; ++bf) {
      std::vector<float> want_loss(n), want_grad(n * v);
      std::vector<float> f32 = base;
      std::vector<unsigned short> b16(n * v);
      for (long long i = 0; i < n * v; ++i) {
        zr_store(&b16[i], base[i]);
        if (bf) f32[i] = zr_load(&b16[i]);
      }
      for (long long r = 0; r < n; ++r) {
        double m = -INFINITY, s = 0;
        for (long long j = 0; j < v; ++j) m = std::fmax(m, f32[r * v + j]);
        for (long long j = 0; j < v; ++j) s += std::exp(double(f32[r * v + j]) - m);
        const double lse = m + std::log(s);
        want_loss[r] = coef[r] == 0 ? 0 : float(lse - f32[r * v + targets[r]]);
        for (long long j = 0; j < v; ++j) {
          double d = (std::exp(double(f32[r * v + j]) - lse) - (j == targets[r])) * coef[r];
          want_grad[r * v + j] = bf ? bf16_round(float(d)) : float(d);
        }
      }
      std::vector<float> loss(n, -1.0f);
      if (bf) {
        launch(n, [&] { zr_ce_rows_bf16(b16.data(), targets.data(), coef.data(), loss.data(), v, 1); });
      } else {
        launch(n, [&] { zr_ce_rows_f32(f32.data(), targets.data(), coef.data(), loss.data(), v, 1); });
      }
      double loss_err = 0, grad_err = 0, grad_top = 0;
      for (long long r = 0; r < n; ++r) {
        loss_err = std::fmax(loss_err, std::fabs(loss[r] - want_loss[r]) / std::fmax(1.0, std::fabs(want_loss[r])));
      }
      for (long long i = 0; i < n * v; ++i) {
        const float got = bf ? zr_load(&b16[i]) : f32[i];
        grad_err = std::fmax(grad_err, std::fabs(got - want_grad[i]));
        grad_top = std::fmax(grad_top, std::fabs(want_grad[i]));
      }
      // fp32: the sums' order; bf16: one rounding apart at most (2^-8 of the largest).
      const double tol = bf ? grad_top / 128.0 : grad_top * 1e-5;
      if (!(loss_err <= 1e-5) || !(grad_err <= tol)) {
        std::printf("v %lld %s: loss off by %g (relative), gradient by %g of %g\n", v,
                    bf ? "bf16" : "fp32", loss_err, grad_err, grad_top);
        bad = 1;
      }
    }
  }
  // NaN in a row: its loss is NaN.
  {
    const long long v = 700;
    std::vector<float> x(v, 0.5f);
    x[600] = NAN;
    std::vector<long long> t = {4};
    std::vector<float> c = {1.0f}, loss = {0.0f};
    launch(1, [&] { zr_ce_rows_f32(x.data(), t.data(), c.data(), loss.data(), v, 0); });
    if (!std::isnan(loss[0])) {
      std::printf("a NaN logit gave loss %g, not NaN\n", loss[0]);
      bad = 1;
    }
    if (x[0] != 0.5f) {
      std::printf("grad 0 wrote the logits\n");
      bad = 1;
    }
  }
  // swiglu over 2 blocks of 256 with n beyond them: a round of four strides, then the rest.
  for (int bf = 0; bf < 2; ++bf) {
    const long long n = 2600;
    std::vector<float> a(n), b(n), g(n);
    for (long long i = 0; i < n; ++i) {
      a[i] = normal(rng) * 2.0f;
      b[i] = normal(rng);
      g[i] = normal(rng);
      if (bf) {
        a[i] = bf16_round(a[i]);
        b[i] = bf16_round(b[i]);
        g[i] = bf16_round(g[i]);
      }
    }
    std::vector<float> out(n, NAN), da(n, NAN), db(n, NAN);
    std::vector<unsigned short> a16(n), b16(n), g16(n), out16(n), da16(n), db16(n);
    for (long long i = 0; i < n; ++i) {
      zr_store(&a16[i], a[i]);
      zr_store(&b16[i], b[i]);
      zr_store(&g16[i], g[i]);
    }
    if (bf) {
      launch(2, [&] { zr_swiglu_fwd_bf16(a16.data(), b16.data(), out16.data(), n); }, 256);
      launch(2, [&] { zr_swiglu_bwd_bf16(a16.data(), b16.data(), g16.data(), da16.data(), db16.data(), n); }, 256);
      for (long long i = 0; i < n; ++i) {
        out[i] = zr_load(&out16[i]);
        da[i] = zr_load(&da16[i]);
        db[i] = zr_load(&db16[i]);
      }
    } else {
      launch(2, [&] { zr_swiglu_fwd_f32(a.data(), b.data(), out.data(), n); }, 256);
      launch(2, [&] { zr_swiglu_bwd_f32(a.data(), b.data(), g.data(), da.data(), db.data(), n); }, 256);
    }
    double err = 0;
    double top[3] = {0, 0, 0};
    for (int pass = 0; pass < 2; ++pass) {
      for (long long i = 0; i < n; ++i) {
        const double x = a[i], y = b[i], d = g[i];
        const double s = 1.0 / (1.0 + std::exp(-x));
        const double want[3] = {x * s * y, d * y * s * (1 + x * (1 - s)), d * x * s};
        const float got[3] = {out[i], da[i], db[i]};
        for (int k = 0; k < 3; ++k) {
          top[k] = std::fmax(top[k], std::fabs(want[k]));
          if (pass == 1) {
            // fp32: a few ulps of the value (1 - sigmoid cancels in fp32 as in ATen's, so
            // also 1e-6 of the largest); bf16: one rounding (2^-8 relative).
            const double rel = bf ? 1.0 / 256 : 1e-6;
            const double tol = rel * (std::fabs(want[k]) + top[k]) + 1e-30;
            err = std::fmax(err, std::fabs(got[k] - want[k]) / tol);
          }
        }
      }
    }
    if (!(err <= 1.0)) {
      std::printf("swiglu %s: off by %g of its bound\n", bf ? "bf16" : "fp32", err);
      bad = 1;
    }
  }
  // A target outside the row: a NaN loss, nothing read or written outside the row.
  {
    const long long v = 40;
    std::vector<float> x(3 * v, 0.25f);
    std::vector<long long> t = {0, v, -1};
    std::vector<float> c = {1.0f, 1.0f, 1.0f}, loss(3, 0.0f);
    launch(1, [&] { zr_ce_rows_f32(x.data() + v, t.data() + 1, c.data(), loss.data(), v, 1); });
    if (!std::isnan(loss[0]) || x[0] != 0.25f || x[2 * v] != 0.25f) {
      std::printf("target V: loss %g, neighbours %g %g\n", loss[0], x[0], x[2 * v]);
      bad = 1;
    }
    launch(1, [&] { zr_ce_rows_f32(x.data() + v, t.data() + 2, c.data(), loss.data(), v, 0); });
    if (!std::isnan(loss[0])) {
      std::printf("target -1: loss %g\n", loss[0]);
      bad = 1;
    }
  }
  // rope over (B, T, H, hd) = (2, 3, 5, 8) on 2 blocks of 256 (a grid-stride), forward and
  // backward, against the formulas in double.
  for (int bf = 0; bf < 2; ++bf) {
    const long long B = 2, T = 3, H = 5, hd = 8, n = B * T * H * hd;
    std::vector<float> x(n), c(T * hd), s(T * hd);
    for (auto& v : x) v = bf ? bf16_round(normal(rng)) : normal(rng);
    for (auto& v : c) v = bf ? bf16_round(normal(rng) * 0.3f) : normal(rng) * 0.3f;
    for (auto& v : s) v = bf ? bf16_round(normal(rng) * 0.3f) : normal(rng) * 0.3f;
    for (int backward = 0; backward < 2; ++backward) {
      std::vector<float> y(n, NAN);
      if (bf) {
        std::vector<unsigned short> x16(n), c16(T * hd), s16(T * hd), y16(n);
        for (long long i = 0; i < n; ++i) zr_store(&x16[i], x[i]);
        for (long long i = 0; i < T * hd; ++i) {
          zr_store(&c16[i], c[i]);
          zr_store(&s16[i], s[i]);
        }
        launch(2, [&] { zr_rope_bf16(x16.data(), c16.data(), s16.data(), y16.data(), n, T, H, hd, backward); }, 256);
        for (long long i = 0; i < n; ++i) y[i] = zr_load(&y16[i]);
      } else {
        launch(2, [&] { zr_rope_f32(x.data(), c.data(), s.data(), y.data(), n, T, H, hd, backward); }, 256);
      }
      double err = 0, top = 0;
      for (long long idx = 0; idx < n; ++idx) {
        const long long i = idx % hd, t = (idx / (hd * H)) % T, r = (i + hd / 2) % hd;
        const long long pair = idx - i + r;
        const double want = backward
            ? double(x[idx]) * c[t * hd + i] + double(x[pair]) * s[t * hd + r]
            : double(x[idx]) * c[t * hd + i] + double(x[pair]) * s[t * hd + i];
        err = std::fmax(err, std::fabs(y[idx] - want));
        top = std::fmax(top, std::fabs(want));
      }
      if (!(err <= (bf ? 1.0 / 128 : 1e-6) * top)) {
        std::printf("rope %s backward %d: off by %g of %g\n", bf ? "bf16" : "fp32", backward, err, top);
        bad = 1;
      }
    }
  }
  // colsum: 37 rows of 264 columns (a span and a block of the second pass cut short), in 3
  // splits of 13 rows (fewer than the second pass's warps) or 10 of 4 (more), without and
  // with LayerNorm's x, mean and rstd, and with GELU's backward first (x as GELU's input h),
  // against sums in double; GELU's gradient against its derivative in double, and its sums
  // against the double sums of what the kernel stored.
  for (int cfg = 0; cfg < 4; ++cfg) {
    const int bf = cfg % 2;
    const long long rows = 37, cols = 264;
    const long long per_split = cfg < 2 ? 13 : 4, splits = (rows + per_split - 1) / per_split;
    const long long span = bf ? 256 : 128, spans = (cols + span - 1) / span;
    std::vector<float> dy(rows * cols), x(rows * cols), mean(rows), rstd(rows);
    for (auto& v : dy) v = bf ? bf16_round(normal(rng)) : normal(rng);
    for (auto& v : x) v = bf ? bf16_round(2 * normal(rng)) : 2 * normal(rng);
    for (long long r = 0; r < rows; ++r) {
      mean[r] = normal(rng) * 0.1f;
      rstd[r] = 0.5f + 0.01f * float(r);
    }
    std::vector<unsigned short> dy16(rows * cols), x16(rows * cols);
    for (long long i = 0; i < rows * cols; ++i) {
      zr_store(&dy16[i], dy[i]);
      zr_store(&x16[i], x[i]);
    }
    for (int mode = 0; mode < 3; ++mode) {
      const bool ln = mode == 1, gelu = mode == 2;
      std::vector<float> part(2 * splits * cols, NAN), ob(cols, NAN), og(cols, NAN);
      std::vector<float> dh(rows * cols, NAN);
      std::vector<unsigned short> ob16(cols), og16(cols), dh16(rows * cols);
      const unsigned grid = unsigned(spans * splits), fin = unsigned((cols + 31) / 32);
      if (bf) {
        unsigned short* g16 = gelu ? dh16.data() : nullptr;
        launch(grid, [&] { zr_colsum_part_bf16(dy16.data(), mode ? x16.data() : nullptr, mean.data(), rstd.data(), g16, part.data(), rows, cols, per_split); }, 256);
        launch(fin, [&] { zr_colsum_fin_bf16(part.data(), ob16.data(), ln ? og16.data() : nullptr, splits, cols); }, 256);
        for (long long c = 0; c < cols; ++c) {
          ob[c] = zr_load(&ob16[c]);
          og[c] = zr_load(&og16[c]);
        }
        for (long long i = 0; i < rows * cols; ++i) dh[i] = zr_load(&dh16[i]);
      } else {
        float* g32 = gelu ? dh.data() : nullptr;
        launch(grid, [&] { zr_colsum_part_f32(dy.data(), mode ? x.data() : nullptr, mean.data(), rstd.data(), g32, part.data(), rows, cols, per_split); }, 256);
        launch(fin, [&] { zr_colsum_fin_f32(part.data(), ob.data(), ln ? og.data() : nullptr, splits, cols); }, 256);
      }
      double err = 0;
      const double rel = bf ? 1.0 / 256 : 1e-6;
      for (long long c = 0; c < cols; ++c) {
        double b = 0, g = 0, mag = 0;
        for (long long r = 0; r < rows; ++r) {
          const long long i = r * cols + c;
          double d = dy[i];
          if (gelu) {
            // dy gelu'(h) in double; the kernel's, once rounded to its dtype.
            const double h = x[i], k = std::sqrt(2.0 / M_PI);
            const double t = std::tanh(k * (h + 0.044715 * h * h * h));
            const double left = 0.5 * (1 + t), right = 0.5 * h * (1 - t * t) * k * (1 + 3 * 0.044715 * h * h);
            const double want = d * (left + right);
            // Float's steps: tanh's rounding (about 1e-7) enters 1 + t and 1 - t^2, which
            // cancel where h is far below 0, scaled by the derivative's size there.
            const double scale = 1 + 0.5 * std::fabs(h) * k * (1 + 3 * 0.044715 * h * h);
            const double bound = (bf ? 1.0 / 128 : 1e-5) * std::fabs(want) + 2e-7 * std::fabs(d) * scale;
            err = std::fmax(err, std::fabs(dh[i] - want) / bound);
            d = dh[i];
          }
          b += d;
          g += d * (double(x[i]) - mean[r]) * rstd[r];
          mag += std::fabs(d) * (1 + std::fabs(x[i]));
        }
        err = std::fmax(err, std::fabs(ob[c] - b) / (rel * std::fabs(b) + 1e-6 * mag));
        if (ln) err = std::fmax(err, std::fabs(og[c] - g) / (rel * std::fabs(g) + 1e-6 * mag));
      }
      if (!(err <= 1.0)) {
        std::printf("colsum %s mode %d, %lld splits: off by %g of its bound\n", bf ? "bf16" : "fp32", mode, splits, err);
        bad = 1;
      }
    }
  }

  // adamw: a table of three pieces (5000 values aligned, with weight decay and the bf16
  // parameters; 37 values one float off alignment, without either; 4100 aligned values past
  // a chunk), fp32 and bf16 gradients; each value against the update in double, and the
  // vector and one-at-a-time paths bitwise the same (the same values run again shifted off
  // alignment, and as one piece each).
  for (int bf = 0; bf < 2; ++bf) {
    const long long sizes[3] = {5000, 37, 4100};
    const long long total = sizes[0] + sizes[1] + sizes[2];
    std::vector<float> p0(total), g0(total), m0(total), v0(total);
    for (long long i = 0; i < total; ++i) {
      p0[i] = normal(rng);
      g0[i] = bf ? bf16_round(normal(rng) * 0.1f) : normal(rng) * 0.1f;
      m0[i] = normal(rng) * 0.01f;
      v0[i] = std::fabs(normal(rng)) * 1e-3f;
    }
    ZrAdamHp hp;
    const double lr = 1e-3, wd = 0.1, b1 = 0.9, b2 = 0.95, eps = 1e-8, factor = 0.5;
    const int t = 3;
    hp.grad_factor = float(factor);
    hp.keep = float(1.0 - lr * wd);
    hp.b1 = float(b1);
    hp.omb1 = float(1.0 - b1);
    hp.b2 = float(b2);
    hp.omb2 = float(1.0 - b2);
    hp.step_size = float(lr / (1.0 - std::pow(b1, t)));
    hp.bc2_sqrt = float(std::sqrt(1.0 - std::pow(b2, t)));
    hp.eps = float(eps);
    // Runs the values at offset `shift` (in values) of their buffers, cut into `pieces`.
    auto run = [&](long long shift, int pieces, std::vector<float>& p, std::vector<float>& m,
                   std::vector<float>& v, std::vector<unsigned short>& h) {
      std::vector<float> pb(total + 8), gb(total + 8), mb(total + 8), vb(total + 8);
      std::vector<unsigned short> gh(total + 8), hb(total + 8, 0);
      for (long long i = 0; i < total; ++i) {
        pb[shift + i] = p0[i];
        gb[shift + i] = g0[i];
        zr_store(&gh[shift + i], g0[i]);
        mb[shift + i] = m0[i];
        vb[shift + i] = v0[i];
      }
      ZrAdamTable table;
      table.count = 0;
      int blocks = 0;
      long long at = 0;
      for (int k = 0; k < 3; ++k) {
        const long long n = sizes[k];
        const int cuts = pieces == 1 ? 1 : 2;
        for (int c = 0; c < cuts; ++c) {
          const long long lo = at + n * c / cuts, hi = at + n * (c + 1) / cuts;
          ZrAdamPiece& pc = table.piece[table.count];
          pc.p = pb.data() + shift + lo;
          pc.g = bf ? static_cast<const void*>(gh.data() + shift + lo)
                    : static_cast<const void*>(gb.data() + shift + lo);
          pc.m = mb.data() + shift + lo;
          pc.v = vb.data() + shift + lo;
          pc.h = k == 1 ? nullptr : hb.data() + shift + lo;
          pc.n = hi - lo;
          pc.decay = k != 1;
          table.first[table.count++] = blocks;
          blocks += int((hi - lo + ZR_CHUNK - 1) / ZR_CHUNK);
        }
        at += n;
      }
      table.first[table.count] = blocks;
      if (bf) {
        launch(unsigned(blocks), [&] { zr_adamw_bf16(table, hp); }, ZR_OPT_THREADS);
      } else {
        launch(unsigned(blocks), [&] { zr_adamw_f32(table, hp); }, ZR_OPT_THREADS);
      }
      p.assign(pb.begin() + shift, pb.begin() + shift + total);
      m.assign(mb.begin() + shift, mb.begin() + shift + total);
      v.assign(vb.begin() + shift, vb.begin() + shift + total);
      h.assign(hb.begin() + shift, hb.begin() + shift + total);
    };
    std::vector<float> p, m, v, p2, m2, v2;
    std::vector<unsigned short> h, h2;
    run(0, 1, p, m, v, h);
    double err = 0;
    for (long long i = 0; i < total; ++i) {
      const bool decay = i < sizes[0] || i >= sizes[0] + sizes[1];
      const double g = double(g0[i]) * factor;
      double pw = decay ? double(p0[i]) * (1.0 - lr * wd) : double(p0[i]);
      const double mw = b1 * m0[i] + (1 - b1) * g, vw = b2 * v0[i] + (1 - b2) * g * g;
      const double upd = lr / (1 - std::pow(b1, t)) * mw / (std::sqrt(vw) / std::sqrt(1 - std::pow(b2, t)) + eps);
      // A few fp32 roundings of each term (m can cancel, so of its terms' magnitudes).
      const double m_mag = b1 * std::fabs(m0[i]) + (1 - b1) * std::fabs(g);
      err = std::fmax(err, std::fabs(p[i] - (pw - upd)) / (1e-6 * (std::fabs(pw) + std::fabs(upd) * (1 + m_mag / (std::fabs(mw) + 1e-30))) + 1e-12));
      pw -= upd;
      err = std::fmax(err, std::fabs(m[i] - mw) / (1e-6 * m_mag + 1e-12));
      err = std::fmax(err, std::fabs(v[i] - vw) / (1e-6 * std::fabs(vw) + 1e-15));
      const bool has_h = i < sizes[0] || i >= sizes[0] + sizes[1];
      unsigned short want_h = 0;
      if (has_h) zr_store(&want_h, p[i]);
      if (h[i] != want_h) {
        std::printf("adamw %s: bf16 parameter %lld is %04x, not %04x\n", bf ? "bf16" : "fp32", i, h[i], want_h);
        bad = 1;
        break;
      }
    }
    if (!(err <= 4.0)) {
      std::printf("adamw %s: off by %g of its bound\n", bf ? "bf16" : "fp32", err);
      bad = 1;
    }
    for (long long shift : {1LL, 2LL}) {
      run(shift, 2, p2, m2, v2, h2);
      if (std::memcmp(p.data(), p2.data(), total * 4) != 0 ||
          std::memcmp(m.data(), m2.data(), total * 4) != 0 ||
          std::memcmp(v.data(), v2.data(), total * 4) != 0 || h != h2) {
        std::printf("adamw %s: shifted by %lld and cut in two, not bitwise the same\n", bf ? "bf16" : "fp32", shift);
        bad = 1;
      }
    }
  }
  // fresh_share: a table of three pieces back to back (5000 values from an aligned start, 37,
  // then 4100 from a start off alignment, past a chunk) for each dtype of the parameters and
  // of the gradients; each value against the share in double, and the vector and
  // one-at-a-time paths bitwise the same (the values shifted off alignment and cut in two).
  for (int pb = 0; pb < 2; ++pb) {
    for (int gb = 0; gb < 2; ++gb) {
      const long long sizes[3] = {5000, 37, 4100};
      const long long total = sizes[0] + sizes[1] + sizes[2];
      std::vector<float> p0(total), g0(total), v0(total);
      for (long long i = 0; i < total; ++i) {
        p0[i] = pb ? bf16_round(normal(rng)) : normal(rng);
        g0[i] = gb ? bf16_round(normal(rng) * 0.1f) : normal(rng) * 0.1f;
        v0[i] = bf16_round(std::fabs(normal(rng)) * 1e-3f);
      }
      const double lr = 0.3, b1 = 0.9, b2 = 0.95, eps = 1e-8, factor = 0.5;
      const int t = 2;
      const double step_size = lr * (1 - b1) / (1 - std::pow(b1, t));
      const double bc2 = 1 - std::pow(b2, t);
      ZrShareHp hp;
      hp.grad_factor = float(factor);
      hp.b2 = float(b2);
      hp.omb2 = float(1 - b2);
      hp.step_size = float(step_size);
      hp.bc2_sqrt = float(std::sqrt(bc2));
      hp.eps = float(eps);
      auto run = [&](long long shift, int cuts, std::vector<float>& out) {
        std::vector<float> pf(total + 8), gf(total + 8);
        std::vector<unsigned short> ph(total + 8), gh(total + 8), vh(total + 8);
        for (long long i = 0; i < total; ++i) {
          pf[shift + i] = p0[i];
          zr_store(&ph[shift + i], p0[i]);
          gf[shift + i] = g0[i];
          zr_store(&gh[shift + i], g0[i]);
          zr_store(&vh[shift + i], v0[i]);
        }
        ZrShareTable table;
        table.count = 0;
        int blocks = 0;
        long long at = 0;
        for (int k = 0; k < 3; ++k) {
          for (int c = 0; c < cuts; ++c) {
            const long long lo = at + sizes[k] * c / cuts, hi = at + sizes[k] * (c + 1) / cuts;
            ZrSharePiece& pc = table.piece[table.count];
            pc.p = pb ? static_cast<void*>(ph.data() + shift + lo)
                      : static_cast<void*>(pf.data() + shift + lo);
            pc.g = gb ? static_cast<const void*>(gh.data() + shift + lo)
                      : static_cast<const void*>(gf.data() + shift + lo);
            pc.v = vh.data() + shift + lo;
            pc.n = hi - lo;
            table.first[table.count++] = blocks;
            blocks += int((hi - lo + ZR_CHUNK - 1) / ZR_CHUNK);
          }
          at += sizes[k];
        }
        table.first[table.count] = blocks;
        launch(unsigned(blocks), [&] {
          if (pb && gb) zr_fresh_share_bf16_bf16(table, hp);
          if (pb && !gb) zr_fresh_share_bf16_f32(table, hp);
          if (!pb && gb) zr_fresh_share_f32_bf16(table, hp);
          if (!pb && !gb) zr_fresh_share_f32_f32(table, hp);
        }, ZR_OPT_THREADS);
        out.resize(total);
        for (long long i = 0; i < total; ++i) {
          out[i] = pb ? zr_load(&ph[shift + i]) : pf[shift + i];
        }
      };
      std::vector<float> out, out2;
      run(0, 1, out);
      double err = 0;
      for (long long i = 0; i < total; ++i) {
        const double g = double(g0[i]) * factor;
        const double vt = b2 * v0[i] + (1 - b2) * g * g;
        const double share = step_size * g / (std::sqrt(vt) / std::sqrt(bc2) + eps);
        const double want = double(p0[i]) - share;
        // fp32: a few roundings of the value and the share; bf16: one rounding of the value
        // (and the share's fp32 roundings, where the two cancel).
        const double bound = pb ? std::fabs(want) / 128 + 1e-6 * std::fabs(share) + 1e-30
                                : 1e-6 * (std::fabs(p0[i]) + std::fabs(share)) + 1e-12;
        err = std::fmax(err, std::fabs(out[i] - want) / bound);
      }
      if (!(err <= (pb ? 1.0 : 4.0))) {
        std::printf("fresh_share p %s g %s: off by %g of its bound\n", pb ? "bf16" : "fp32", gb ? "bf16" : "fp32", err);
        bad = 1;
      }
      for (long long shift : {1LL, 2LL}) {
        run(shift, 2, out2);
        if (std::memcmp(out.data(), out2.data(), total * 4) != 0) {
          std::printf("fresh_share p %s g %s: shifted by %lld and cut in two, not bitwise the same\n", pb ? "bf16" : "fp32", gb ? "bf16" : "fp32", shift);
          bad = 1;
        }
      }
    }
  }
  // cast_into: bf16 gradients over an fp32 buffer and added to it, aligned (past a chunk) and
  // one float off alignment; exact (a bf16 value is an fp32 one, and one fp32 add).
  for (long long shift : {0LL, 1LL}) {
    const long long n1 = 4100, n2 = 37, total = n1 + n2;
    std::vector<float> src(total), base(total);
    std::vector<unsigned short> s16(total);
    for (long long i = 0; i < total; ++i) {
      src[i] = bf16_round(normal(rng));
      zr_store(&s16[i], src[i]);
      base[i] = normal(rng);
    }
    std::vector<float> dst(total + 4);
    for (long long i = 0; i < total; ++i) dst[shift + i] = base[i];
    ZrCastTable table;
    table.count = 2;
    table.piece[0] = {dst.data() + shift, s16.data(), n1, 0, 0};
    table.piece[1] = {dst.data() + shift + n1, s16.data() + n1, n2, 1, 0};
    table.first[0] = 0;
    table.first[1] = int((n1 + ZR_CHUNK - 1) / ZR_CHUNK);
    table.first[2] = table.first[1] + 1;
    launch(unsigned(table.first[2]), [&] { zr_cast_into(table); }, ZR_OPT_THREADS);
    for (long long i = 0; i < total; ++i) {
      const float want = i < n1 ? src[i] : base[i] + src[i];
      if (dst[shift + i] != want) {
        std::printf("cast_into shift %lld: value %lld is %g, not %g\n", shift, i, dst[shift + i], want);
        bad = 1;
        break;
      }
    }
  }
  if (!bad) std::printf("ok\n");
  return bad;
}
