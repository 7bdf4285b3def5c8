// One row times a contiguous [K, N] float32 matrix, in the order MKL's single-thread sgemm gives every row of
// an M >= 2 product on AVX-512 (found by comparing against it; nemo_rz admits this kernel for a shape only after
// a probe shows it bit-equal to the GEMM route there):
//   K is cut into blocks of `block` (384) rows of the matrix, except that the last two blocks share what remains
//   above 2 * block evenly (the first of them gets the odd one); K <= block is one block.
//   Each output column sums its block with FMAs in k order, starting from 0, in its own accumulator.
//   The column's result is the first block's sum, then plus each next block's sum (one rounding each).
// The AVX-512 and the scalar std::fmaf paths give the same bits (an FMA is correctly rounded either way).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

std::vector<int64_t> block_starts(int64_t K, int64_t block) {
  std::vector<int64_t> b{0};
  int64_t s = 0;
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
void columns(const float* x, const float* w, float* y, int64_t K, int64_t ld, int64_t block, bool simd, int64_t j0,
             int64_t j1) {
  const std::vector<int64_t> b = block_starts(K, block);
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

at::Tensor matvec(const at::Tensor& x, const at::Tensor& w_t, int64_t block, bool simd) {
  TORCH_CHECK(x.dim() == 2 && x.size(0) == 1 && w_t.dim() == 2 && x.size(1) == w_t.size(0),
              "nemo_rz matvec: x must be [1, K] and w_t [K, N], got ", x.sizes(), " and ", w_t.sizes());
  TORCH_CHECK(x.scalar_type() == at::kFloat && w_t.scalar_type() == at::kFloat && x.device().is_cpu() && w_t.device().is_cpu(),
              "nemo_rz matvec: float32 CPU tensors only");
  TORCH_CHECK(w_t.is_contiguous(), "nemo_rz matvec: w_t must be contiguous");
  TORCH_CHECK(block > 0, "nemo_rz matvec: block must be positive");
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
  const int64_t steps = (N + 15) / 16;
  at::parallel_for(0, steps, 256, [&](int64_t a, int64_t b) {
    columns(xp, wp, yp, K, N, block, simd, a * 16, std::min(N, b * 16));
  });
  return y;
}

}  // namespace

TORCH_LIBRARY(nemo_rz_cpu, m) {
  m.def("matvec(Tensor x, Tensor w_t, int block, bool simd) -> Tensor", &matvec);
}
