// One row times a contiguous [K, N] float32 matrix, in the order MKL's single-thread sgemm gives every row of
// an M >= 2 product (found by comparing against it; nemo_rz admits this kernel for a shape only after a probe
// shows it bit-equal to the GEMM route there). MKL cuts K into blocks by a rule that depends on the code path it
// dispatches to; `order` picks one (block_starts):
//   0, AVX-512 (block 384): blocks of `block` rows of the matrix, except that the last two blocks share what
//      remains above 2 * block evenly (the first of them gets the odd one); K <= block is one block.
//   1, AVX2 (block 192): a block size kc = K where K <= block, floor(K / 2) where K <= 2 * block, else block;
//      blocks of kc from k = 0, what remains (fewer than kc rows) the last block.
// Each output column sums its block with FMAs in k order, starting from 0, in its own accumulator.
// The column's result is the first block's sum, then plus each next block's sum (one rounding each).
// The AVX-512 and the scalar std::fmaf paths give the same bits (an FMA is correctly rounded either way).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

std::vector<int64_t> block_starts(int64_t K, int64_t block, int64_t order) {
  std::vector<int64_t> b{0};
  int64_t s = 0;
  if (order == 1) {
    const int64_t kc = K <= block ? K : K <= 2 * block ? K / 2 : block;
    while (K - s > kc) {
      s += kc;
      b.push_back(s);
    }
    b.push_back(K);
    return b;
  }
  while (K - s > 2 * block) {
    s += block;
    b.push_back(s);
  }
  if (K - s > block) {
    s += (K - s + 1) / 2;
    b.push_back(s);
  }
  b.push_back(K);
  return b;
}

// acc[j] = fma(x[k], w[k, j], acc[j]) for k in [s, e), columns [0, n) of rows with stride ld; 4 rows per pass.
// simd=false takes the scalar loop alone (what a CPU without AVX-512 runs), to show both give the same bits.
void block_sum(const float* x, const float* w, int64_t ld, int64_t s, int64_t e, int64_t n, float* acc, bool simd) {
  std::fill(acc, acc + n, 0.f);
  int64_t k = s;
#ifdef __AVX512F__
  for (; simd && k + 4 <= e; k += 4) {
    const float* p = w + k * ld;
    const __m512 x0 = _mm512_set1_ps(x[k]), x1 = _mm512_set1_ps(x[k + 1]);
    const __m512 x2 = _mm512_set1_ps(x[k + 2]), x3 = _mm512_set1_ps(x[k + 3]);
    for (int64_t j = 0; j < n; j += 16) {
      const __mmask16 m = n - j >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - j)) - 1);
      __m512 a = _mm512_maskz_loadu_ps(m, acc + j);
      a = _mm512_fmadd_ps(x0, _mm512_maskz_loadu_ps(m, p + j), a);
      a = _mm512_fmadd_ps(x1, _mm512_maskz_loadu_ps(m, p + ld + j), a);
      a = _mm512_fmadd_ps(x2, _mm512_maskz_loadu_ps(m, p + 2 * ld + j), a);
      a = _mm512_fmadd_ps(x3, _mm512_maskz_loadu_ps(m, p + 3 * ld + j), a);
      _mm512_mask_storeu_ps(acc + j, m, a);
    }
  }
#else
  (void)simd;
#endif
  for (; k < e; ++k) {
    const float* p = w + k * ld;
    const float xk = x[k];
    for (int64_t j = 0; j < n; ++j) acc[j] = std::fmaf(xk, p[j], acc[j]);
  }
}

// y[j0:j1] for the columns j0..j1 of w [K, ld].
void columns(const float* x, const float* w, float* y, int64_t K, int64_t ld, const std::vector<int64_t>& b,
             bool simd, int64_t j0, int64_t j1) {
  const int64_t n = j1 - j0;
  std::vector<float> acc(n);
  for (size_t i = 0; i + 1 < b.size(); ++i) {
    block_sum(x, w + j0, ld, b[i], b[i + 1], n, acc.data(), simd);
    if (i == 0)
      std::copy(acc.begin(), acc.end(), y + j0);
    else
      for (int64_t j = 0; j < n; ++j) y[j0 + j] = y[j0 + j] + acc[j];
  }
}

void check_order(int64_t block, int64_t order, const char* op) {
  TORCH_CHECK(block > 0, "nemo_rz ", op, ": block must be positive, got ", block);
  TORCH_CHECK(order == 0 || order == 1, "nemo_rz ", op, ": order must be 0 (AVX-512 rule) or 1 (AVX2 rule), got ", order);
}

at::Tensor matvec(const at::Tensor& x, const at::Tensor& w_t, int64_t block, bool simd, int64_t order) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && w_t.dim() == 2 && x.size(1) == w_t.size(0),
              "nemo_rz matvec: x must be [1, K] and w_t [K, N], got ", x.sizes(), " and ", w_t.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && w_t.scalar_type() == at::kFloat && x.device().is_cpu() && w_t.device().is_cpu(),
              "nemo_rz matvec: float32 CPU tensors only");
  TORCH_CHECK(w_t.is_contiguous(), "nemo_rz matvec: w_t must be contiguous");
  check_order(block, order, "matvec");
  const at::Tensor xc = x.contiguous();
  const int64_t K = w_t.size(0), N = w_t.size(1);
  at::Tensor y = at::empty({1, N}, x.options());
  const float* xp = xc.data_ptr<float>();
  const float* wp = w_t.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (K == 0) {
    y.zero_();
    return y;
  }
  // Columns are independent: threads split them in whole 16-column steps without changing a bit.
  const std::vector<int64_t> starts = block_starts(K, block, order);
  const int64_t steps = (N + 15) / 16;
  at::parallel_for(0, steps, 256, [&](int64_t a, int64_t b) {
    columns(xp, wp, yp, K, N, starts, simd, a * 16, std::min(N, b * 16));
  });
  return y;
}

// rows_mm: x [M, K] (float32) @ w_t [K, N] (float32 or bfloat16, widened exactly to float32) with every row in
// the order above: for each column, the block sums of FMAs in k order from 0, added in order. A row's bits depend
// on its own values, K, the block rule and the weight's values only: never on M, on the other rows, on how the
// columns are split across threads or on the weight's storage dtype (a bfloat16 weight gives the bits of its
// float32 widening). Columns go in chunks of COLS (the chunk's weight slab stays in L2 while up to ROWS rows at a
// time stream it, their running sums in registers over KSTEP weight rows at a time), so the weight is read from
// memory about once per call.
constexpr int64_t COLS = 256;
constexpr int64_t ROWS = 8;

inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }  // exact: the bf16 bits become the high half

#ifdef __AVX512F__
inline __m512 load16(const float* p, __mmask16 m) { return _mm512_maskz_loadu_ps(m, p); }
inline __m512 load16(const at::BFloat16* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

constexpr int64_t KSTEP = 16;  // rows of the weight per pass over a column chunk (their pages stay in the TLB)

// For R rows and columns [0, n), n <= 16 * V: continue the FMA sums acc[r, j] (from 0 where `start`) over k in
// [s, e), in k order, in registers; then either keep them in acc or, where `finish`, store them to y (`first`:
// the first block) or add them to y (one rounding). acc is [R, ldacc].
template <int R, int V, typename W>
void rows_tile(const float* x, int64_t ldx, const W* w, int64_t ldw, int64_t s, int64_t e, int64_t n, float* acc,
               int64_t ldacc, float* y, int64_t ldy, bool start, bool finish, bool first, bool simd) {
#ifdef __AVX512F__
  if (simd) {
    __mmask16 m[V];
#pragma GCC unroll 4
    for (int v = 0; v < V; ++v) {
      const int64_t left = n - 16 * v;
      m[v] = left >= 16 ? (__mmask16)0xFFFF : left <= 0 ? (__mmask16)0 : (__mmask16)((1u << left) - 1);
    }
    __m512 a[R][V];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) a[r][v] = start ? _mm512_setzero_ps() : _mm512_maskz_loadu_ps(m[v], acc + r * ldacc + 16 * v);
    for (int64_t k = s; k < e; ++k) {
      const W* p = w + k * ldw;
      __m512 wv[V];
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) wv[v] = load16(p + 16 * v, m[v]);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 xb = _mm512_set1_ps(x[r * ldx + k]);
#pragma GCC unroll 4
        for (int v = 0; v < V; ++v) a[r][v] = _mm512_fmadd_ps(xb, wv[v], a[r][v]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
      for (int v = 0; v < V; ++v) {
        if (!finish) {
          _mm512_mask_storeu_ps(acc + r * ldacc + 16 * v, m[v], a[r][v]);
          continue;
        }
        float* q = y + r * ldy + 16 * v;
        _mm512_mask_storeu_ps(q, m[v], first ? a[r][v] : _mm512_add_ps(_mm512_maskz_loadu_ps(m[v], q), a[r][v]));
      }
    return;
  }
#endif
  (void)simd;
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < n; ++j) {
      float t = start ? 0.f : acc[r * ldacc + j];
      for (int64_t k = s; k < e; ++k) t = std::fmaf(x[r * ldx + k], widen(w[k * ldw + j]), t);
      if (!finish) {
        acc[r * ldacc + j] = t;
        continue;
      }
      float& q = y[r * ldy + j];
      q = first ? t : q + t;
    }
}

// y[r, j0:j0+n] for R rows, every block of K: each block in passes of KSTEP weight rows over all the chunk's
// column tiles (16 * V wide), the running sums kept in acc between passes.
template <int R, typename W>
void rows_columns(const float* x, int64_t ldx, const W* w, int64_t ldw, float* y, int64_t ldy,
                  const std::vector<int64_t>& b, int64_t j0, int64_t n, float* acc, bool simd) {
  constexpr int V = R > 6 ? 3 : 4;  // R * V accumulators and V weight vectors within the 32 registers
  for (size_t i = 0; i + 1 < b.size(); ++i)
    for (int64_t k = b[i]; k < b[i + 1]; k += KSTEP) {
      const int64_t e = std::min(b[i + 1], k + KSTEP);
      for (int64_t j = 0; j < n; j += 16 * V)
        rows_tile<R, V>(x, ldx, w + j0 + j, ldw, k, e, std::min<int64_t>(16 * V, n - j), acc + j, COLS,
                        y + j0 + j, ldy, k == b[i], e == b[i + 1], i == 0, simd);
    }
}

template <typename W>
void rows_group(const float* x, int64_t ldx, int64_t R, const W* w, int64_t ldw, float* y, int64_t ldy,
                const std::vector<int64_t>& b, int64_t j0, int64_t n, float* acc, bool simd) {
  switch (R) {
    case 1: rows_columns<1>(x, ldx, w, ldw, y, ldy, b, j0, n, acc, simd); break;
    case 2: rows_columns<2>(x, ldx, w, ldw, y, ldy, b, j0, n, acc, simd); break;
    case 3: rows_columns<3>(x, ldx, w, ldw, y, ldy, b, j0, n, acc, simd); break;
    case 4: rows_columns<4>(x, ldx, w, ldw, y, ldy, b, j0, n, acc, simd); break;
    case 5: rows_columns<5>(x, ldx, w, ldw, y, ldy, b, j0, n, acc, simd); break;
    case 6: rows_columns<6>(x, ldx, w, ldw, y, ldy, b, j0, n, acc, simd); break;
    case 7: rows_columns<7>(x, ldx, w, ldw, y, ldy, b, j0, n, acc, simd); break;
    default: rows_columns<ROWS>(x, ldx, w, ldw, y, ldy, b, j0, n, acc, simd); break;
  }
}

template <typename W>
void rows_mm_impl(const float* x, const W* w, float* y, int64_t M, int64_t K, int64_t N, int64_t block, bool simd,
                  int64_t order) {
  const std::vector<int64_t> b = block_starts(K, block, order);
  const int64_t chunks = (N + COLS - 1) / COLS;
  at::parallel_for(0, chunks, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> acc(ROWS * COLS);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t j0 = c * COLS, n = std::min(N, j0 + COLS) - j0;
      for (int64_t r = 0; r < M; r += ROWS)
        rows_group(x + r * K, K, std::min(ROWS, M - r), w, N, y + r * N, N, b, j0, n, acc.data(), simd);
    }
  });
}

at::Tensor rows_mm(const at::Tensor& x, const at::Tensor& w_t, int64_t block, bool simd, int64_t order) {
  TORCH_CHECK(x.dim() == 2 && w_t.dim() == 2 && x.size(1) == w_t.size(0),
              "nemo_rz rows_mm: x must be [M, K] and w_t [K, N], got ", x.sizes(), " and ", w_t.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && (w_t.scalar_type() == at::kFloat || w_t.scalar_type() == at::kBFloat16)
              && x.device().is_cpu() && w_t.device().is_cpu(),
              "nemo_rz rows_mm: x must be float32 and w_t float32 or bfloat16, on CPU");
  TORCH_CHECK(w_t.is_contiguous(), "nemo_rz rows_mm: w_t must be contiguous");
  check_order(block, order, "rows_mm");
  const at::Tensor xc = x.contiguous();
  const int64_t M = xc.size(0), K = w_t.size(0), N = w_t.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  if (K == 0) return y.zero_();
  if (w_t.scalar_type() == at::kFloat)
    rows_mm_impl(xc.data_ptr<float>(), w_t.data_ptr<float>(), y.data_ptr<float>(), M, K, N, block, simd, order);
  else
    rows_mm_impl(xc.data_ptr<float>(), w_t.data_ptr<at::BFloat16>(), y.data_ptr<float>(), M, K, N, block, simd, order);
  return y;
}

}  // namespace

TORCH_LIBRARY(nemo_rz_cpu, m) {
  m.def("matvec(Tensor x, Tensor w_t, int block, bool simd, int order) -> Tensor", &matvec);
  m.def("rows_mm(Tensor x, Tensor w_t, int block, bool simd, int order) -> Tensor", &rows_mm);
}
