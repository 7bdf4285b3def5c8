// Consistent causal GQA attention, forward only, reading keys and values straight from the cache (contiguous
// [S, Hkv, L, D] or paged [num_blocks, Hkv, block_size, D] through a block table, any strides with unit stride
// along D, float32 or bfloat16). It computes the arithmetic of nemo_rz.ops.attention's tiled path (see its
// docstring) in that path's order, so that each output row has the same bits:
//   q' = q * scale (float32);
//   s[k] = sum over d of q'[d] * K[k][d], FMAs in d order starting from 0 (MKL's single-thread bmm order for
//          the [R, D] @ [D, 32] tile products, found by comparison on AVX-512);
//   m = the row's maximum visible score (and its sink's logit); x = max(s - m, -87) on visible keys;
//   p = exp(x) by the library's own vectorised exp (MKL VML's vmsExp where torch uses it, else at::exp), 0 on
//       hidden keys;
//   for each key block of KV_BLOCK = 32 keys, in increasing order: the partial sum over its keys of p * V[k][d]
//       (FMAs in key order from 0) and of p (adds in key order from 0), added to the row's running sums;
//   out = acc / (sum p (+ exp(max(sink - m, -87)))).
// Hidden keys add exact zeros in the tiled path (p = 0 and finite values), so they are skipped here, as are key
// blocks no row of a tile sees. Rows sharing a (sequence, kv head) are taken 8 at a time, in token order, so
// that each key block is read once per 8 rows; no row's bits depend on which rows share its tile.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/from_blob.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <dlfcn.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#ifdef __AVX512F__
#include <immintrin.h>
#endif

namespace {

constexpr int64_t KV_BLOCK = 32;
constexpr int64_t TILE = 8;  // rows per tile (one pass over a key block serves them all)
constexpr float EXP_FLOOR = -87.f;

inline float widen(float v) { return v; }
inline float widen(at::BFloat16 v) { return static_cast<float>(v); }

#ifdef __AVX512F__
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const at::BFloat16* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
#endif

// The library's exp, in place over n floats: MKL's vmsExp (torch's float32 exp where torch is built with MKL,
// looked up at run time so that a build without MKL still loads), else at::exp itself.
using VmsExp = void (*)(long long, const float*, float*, long long);
constexpr long long VML_MODE = 0x2 | 0x140000 | 0x100;  // VML_HA | VML_FTZDAZ_OFF | VML_ERRMODE_IGNORE (ATen's)

VmsExp vms_exp() {
  static const VmsExp f = reinterpret_cast<VmsExp>(dlsym(RTLD_DEFAULT, "vmsExp"));
  return f;
}

void library_exp(float* x, int64_t n, bool vml) {
  if (n == 0) return;
  if (vml) {
    vms_exp()(n, x, x, VML_MODE);
    return;
  }
  at::Tensor t = at::from_blob(x, {n}, at::TensorOptions().dtype(at::kFloat));
  t.exp_();
}

struct Row {
  int64_t token, head, pos, start;
};

template <typename T>
struct Cache {
  const T* base;
  int64_t s0, s1, s2, len;  // strides (elements) of dims 0..2; len: keys per (sequence, head) (contiguous)
  const int64_t* table;     // block table [S, table_cols] or nullptr (contiguous cache)
  int64_t table_cols, block_size;
  bool ring;  // contiguous cache with fewer slots than positions: position p at slot p % len

  const T* row(int64_t seq, int64_t kv_head, int64_t kp) const {
    if (table == nullptr) {
      const int64_t slot = ring ? kp % len : kp;
      return base + seq * s0 + kv_head * s1 + slot * s2;
    }
    const int64_t phys = table[seq * table_cols + kp / block_size];
    return base + phys * s0 + kv_head * s1 + (kp % block_size) * s2;
  }
};

// Scores of R rows (q [R, D], scaled) against the keys of one block (kt: [D, 32] transposed keys), FMAs in d
// order from 0, into s[r * lds + 0 .. 32).
template <int R>
void block_scores(const float* q, int64_t D, const float* kt, float* s, int64_t lds, bool simd) {
#ifdef __AVX512F__
  if (simd) {
    __m512 a[R][2];
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm512_setzero_ps();
    for (int64_t d = 0; d < D; ++d) {
      const __m512 k0 = _mm512_loadu_ps(kt + d * KV_BLOCK), k1 = _mm512_loadu_ps(kt + d * KV_BLOCK + 16);
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m512 qb = _mm512_set1_ps(q[r * D + d]);
        a[r][0] = _mm512_fmadd_ps(qb, k0, a[r][0]);
        a[r][1] = _mm512_fmadd_ps(qb, k1, a[r][1]);
      }
    }
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      _mm512_storeu_ps(s + r * lds, a[r][0]);
      _mm512_storeu_ps(s + r * lds + 16, a[r][1]);
    }
    return;
  }
#endif
  for (int r = 0; r < R; ++r)
    for (int64_t k = 0; k < KV_BLOCK; ++k) {
      float t = 0.f;
      for (int64_t d = 0; d < D; ++d) t = std::fmaf(q[r * D + d], kt[d * KV_BLOCK + k], t);
      s[r * lds + k] = t;
    }
}

void scores_rows(int R, const float* q, int64_t D, const float* kt, float* s, int64_t lds, bool simd) {
  switch (R) {
    case 1: block_scores<1>(q, D, kt, s, lds, simd); break;
    case 2: block_scores<2>(q, D, kt, s, lds, simd); break;
    case 3: block_scores<3>(q, D, kt, s, lds, simd); break;
    case 4: block_scores<4>(q, D, kt, s, lds, simd); break;
    case 5: block_scores<5>(q, D, kt, s, lds, simd); break;
    case 6: block_scores<6>(q, D, kt, s, lds, simd); break;
    case 7: block_scores<7>(q, D, kt, s, lds, simd); break;
    default: block_scores<8>(q, D, kt, s, lds, simd); break;
  }
}

// acc[r][0..D) += sum over keys k < nk of p[r * ldp + k] * V[k] (FMAs in key order from 0), R rows.
template <int R, typename T>
void block_values(const float* p, int64_t ldp, T const* const* v, int64_t nk, int64_t D, float* acc, bool simd) {
#ifdef __AVX512F__
  if (simd && D % 16 == 0) {
    for (int64_t d = 0; d < D; d += 64) {
      const int V = static_cast<int>(std::min<int64_t>(4, (D - d) / 16));
      __m512 a[R][4];
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) a[r][u] = _mm512_setzero_ps();
      for (int64_t k = 0; k < nk; ++k) {
        __m512 w[4];
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u) w[u] = u < V ? load16(v[k] + d + 16 * u) : _mm512_setzero_ps();
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const __m512 pb = _mm512_set1_ps(p[r * ldp + k]);
#pragma GCC unroll 4
          for (int u = 0; u < 4; ++u) a[r][u] = _mm512_fmadd_ps(pb, w[u], a[r][u]);
        }
      }
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
        for (int u = 0; u < 4; ++u)
          if (u < V) {
            float* o = acc + r * D + d + 16 * u;
            _mm512_storeu_ps(o, _mm512_add_ps(_mm512_loadu_ps(o), a[r][u]));
          }
    }
    return;
  }
#endif
  for (int r = 0; r < R; ++r)
    for (int64_t d = 0; d < D; ++d) {
      float t = 0.f;
      for (int64_t k = 0; k < nk; ++k) t = std::fmaf(p[r * ldp + k], widen(v[k][d]), t);
      acc[r * D + d] += t;
    }
}

template <typename T>
void values_rows(int R, const float* p, int64_t ldp, T const* const* v, int64_t nk, int64_t D, float* acc, bool simd) {
  switch (R) {
    case 1: block_values<1>(p, ldp, v, nk, D, acc, simd); break;
    case 2: block_values<2>(p, ldp, v, nk, D, acc, simd); break;
    case 3: block_values<3>(p, ldp, v, nk, D, acc, simd); break;
    case 4: block_values<4>(p, ldp, v, nk, D, acc, simd); break;
    case 5: block_values<5>(p, ldp, v, nk, D, acc, simd); break;
    case 6: block_values<6>(p, ldp, v, nk, D, acc, simd); break;
    case 7: block_values<7>(p, ldp, v, nk, D, acc, simd); break;
    default: block_values<8>(p, ldp, v, nk, D, acc, simd); break;
  }
}

#ifdef __AVX512F__
// out[j] = column j of the 16 x 16 matrix whose rows are r[0..16).
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
#pragma GCC unroll 8
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i]), _mm512_castps_pd(t[i + 2])));
    r[i + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
    r[i + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(t[i + 1]), _mm512_castps_pd(t[i + 3])));
  }
  // r[4a + b] now holds, in 128-bit lane l, column 4l + b of rows 4a..4a+3: gather the lanes.
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xDD);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xDD);
  }
#pragma GCC unroll 4
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xDD);
    r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
    r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xDD);
  }
}
#endif

// kt [D, KV_BLOCK] = the keys rows[0..nk) transposed, widened to float32, zeros for keys nk..KV_BLOCK.
template <typename T>
void transpose_keys(T const* const* rows, int64_t nk, int64_t D, float* kt, bool simd) {
#ifdef __AVX512F__
  if (simd && D % 16 == 0) {
    for (int64_t k0 = 0; k0 < KV_BLOCK; k0 += 16)
      for (int64_t d0 = 0; d0 < D; d0 += 16) {
        __m512 r[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) r[i] = k0 + i < nk ? load16(rows[k0 + i] + d0) : _mm512_setzero_ps();
        transpose16(r);
#pragma GCC unroll 16
        for (int i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (d0 + i) * KV_BLOCK + k0, r[i]);
      }
    return;
  }
#endif
  for (int64_t k = 0; k < KV_BLOCK; ++k)
    for (int64_t d = 0; d < D; ++d) kt[d * KV_BLOCK + k] = k < nk ? widen(rows[k][d]) : 0.f;
}

template <typename T>
struct Scratch {  // one thread's buffers, reused from tile to tile
  std::vector<float> qs, p, kt, acc, total, m;
  std::vector<const T*> rows;
};

// One tile: up to TILE rows of one (sequence, kv head).
template <typename T>
void tile(const Row* rows, int R, int64_t seq, int64_t kv_head, const float* q, int64_t H, int64_t D, float scale,
          const Cache<T>& kc, const Cache<T>& vc, const float* sinks, float* out, bool vml, bool simd,
          Scratch<T>& w) {
  int64_t lo = std::numeric_limits<int64_t>::max(), hi = 0;
  for (int r = 0; r < R; ++r) {
    lo = std::min(lo, rows[r].start);
    hi = std::max(hi, rows[r].pos);
  }
  const int64_t b0 = lo / KV_BLOCK, b1 = hi / KV_BLOCK, nb = b1 - b0 + 1, span = nb * KV_BLOCK;
  // p: [R, span] scores, then weights; extra R * ... floats at the end for the sinks' exp (padded to 32).
  const int64_t ext = sinks ? KV_BLOCK : 0;
  std::vector<float>&qs = w.qs, &pbuf = w.p, &kt = w.kt, &acc = w.acc, &total = w.total, &m = w.m;
  qs.resize(R * D);
  pbuf.resize(R * span + ext);
  kt.resize(D * KV_BLOCK);
  acc.assign(R * D, 0.f);
  total.assign(R, 0.f);
  m.resize(R);
  for (int r = 0; r < R; ++r) {
    const float* src = q + (rows[r].token * H + rows[r].head) * D;
    for (int64_t d = 0; d < D; ++d) qs[r * D + d] = src[d] * scale;
  }
  std::vector<const T*>& vrow = w.rows;
  vrow.resize(KV_BLOCK);
  for (int64_t b = b0; b <= b1; ++b) {
    const int64_t k0 = b * KV_BLOCK, nk = std::min(KV_BLOCK, hi + 1 - k0);
    for (int64_t k = 0; k < nk; ++k) vrow[k] = kc.row(seq, kv_head, k0 + k);
    transpose_keys(vrow.data(), nk, D, kt.data(), simd);
    scores_rows(R, qs.data(), D, kt.data(), pbuf.data() + (b - b0) * KV_BLOCK, span, simd);
  }
  // The shift: each row's maximum visible score (NaN if any is NaN), then its sink.
  for (int r = 0; r < R; ++r) {
    const float* s = pbuf.data() + r * span;
    float mr = -std::numeric_limits<float>::infinity();
    for (int64_t kp = rows[r].start; kp <= rows[r].pos; ++kp) {
      const float x = s[kp - b0 * KV_BLOCK];
      if (std::isnan(x)) mr = x;
      else if (x > mr) mr = x;  // (false once mr is NaN: NaN stays)
    }
    if (sinks) {
      const float sk = sinks[rows[r].head];
      mr = (std::isnan(mr) || std::isnan(sk)) ? std::numeric_limits<float>::quiet_NaN() : std::max(mr, sk);
      pbuf[R * span + r] = std::isnan(sk - mr) ? sk - mr : std::max(sk - mr, EXP_FLOOR);
    }
    m[r] = mr;
    float* x = pbuf.data() + r * span;
    for (int64_t i = 0; i < span; ++i) {
      const int64_t kp = b0 * KV_BLOCK + i;
      if (kp < rows[r].start || kp > rows[r].pos) {
        x[i] = EXP_FLOOR;  // hidden: its weight is set to 0 below
        continue;
      }
      const float y = x[i] - mr;
      x[i] = y < EXP_FLOOR ? EXP_FLOOR : y;  // NaN stays NaN, as in clamp
    }
  }
  for (int64_t i = R * span + R; i < R * span + ext; ++i) pbuf[i] = 0.f;
  library_exp(pbuf.data(), R * span + ext, vml);
  for (int r = 0; r < R; ++r) {
    float* x = pbuf.data() + r * span;
    for (int64_t i = 0; i < span; ++i) {
      const int64_t kp = b0 * KV_BLOCK + i;
      if (kp < rows[r].start || kp > rows[r].pos) x[i] = 0.f;
    }
  }
  for (int64_t b = b0; b <= b1; ++b) {
    const int64_t k0 = b * KV_BLOCK, nk = std::min(KV_BLOCK, hi + 1 - k0);
    for (int64_t k = 0; k < nk; ++k) vrow[k] = vc.row(seq, kv_head, k0 + k);
    const float* p = pbuf.data() + (b - b0) * KV_BLOCK;
    values_rows<T>(R, p, span, vrow.data(), nk, D, acc.data(), simd);
    for (int r = 0; r < R; ++r) {
      float t = 0.f;
      for (int64_t k = 0; k < nk; ++k) t = t + p[r * span + k];
      total[r] = total[r] + t;
    }
  }
  for (int r = 0; r < R; ++r) {
    const float den = sinks ? total[r] + pbuf[R * span + r] : total[r];
    float* o = out + (rows[r].token * H + rows[r].head) * D;
    for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] / den;
  }
}

template <typename T>
Cache<T> cache_of(const at::Tensor& c, const at::Tensor& table) {
  Cache<T> out{c.data_ptr<T>(), c.stride(0), c.stride(1), c.stride(2), c.size(2), nullptr, 0, c.size(2), false};
  if (table.defined()) {
    out.table = table.data_ptr<int64_t>();
    out.table_cols = table.size(1);
  } else {
    out.ring = c.size(2) % KV_BLOCK == 0;
  }
  return out;
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& seq_idx,
         const at::Tensor& positions, const at::Tensor& starts, const at::Tensor& table, const at::Tensor& sinks,
         double scale, bool simd, at::Tensor& out) {
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), Hkv = k.size(1), G = H / Hkv;
  const int64_t* si = seq_idx.data_ptr<int64_t>();
  const int64_t* ps = positions.data_ptr<int64_t>();
  const int64_t* st = starts.data_ptr<int64_t>();
  // Tokens grouped by sequence (stable: token order within a sequence); a tile: up to TILE rows of one
  // (sequence, kv head), rows in (token, head) order.
  std::vector<int64_t> order(N);
  for (int64_t i = 0; i < N; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return si[a] < si[b]; });
  std::vector<Row> rows;
  std::vector<int64_t> tile_start, tile_seq, tile_head;
  rows.reserve(N * H);
  for (int64_t i = 0; i < N;) {
    int64_t j = i;
    while (j < N && si[order[j]] == si[order[i]]) ++j;
    for (int64_t g = 0; g < Hkv; ++g) {
      int64_t in_tile = 0;
      for (int64_t t = i; t < j; ++t)
        for (int64_t h = g * G; h < (g + 1) * G; ++h) {
          if (in_tile == 0) {
            tile_start.push_back(static_cast<int64_t>(rows.size()));
            tile_seq.push_back(si[order[i]]);
            tile_head.push_back(g);
          }
          const int64_t tok = order[t];
          rows.push_back({tok, h, ps[tok], st[tok]});
          in_tile = (in_tile + 1) % TILE;
        }
    }
    i = j;
  }
  tile_start.push_back(static_cast<int64_t>(rows.size()));
  const Cache<T> kc = cache_of<T>(k, table), vc = cache_of<T>(v, table);
  const float* qp = q.data_ptr<float>();
  const float* sp = sinks.defined() ? sinks.data_ptr<float>() : nullptr;
  float* op = out.data_ptr<float>();
  const bool vml = vms_exp() != nullptr;
  const float sc = static_cast<float>(scale);
  const int64_t n_tiles = static_cast<int64_t>(tile_seq.size());
  at::parallel_for(0, n_tiles, 1, [&](int64_t a, int64_t b) {
    Scratch<T> w;
    for (int64_t t = a; t < b; ++t)
      tile<T>(rows.data() + tile_start[t], static_cast<int>(tile_start[t + 1] - tile_start[t]), tile_seq[t],
              tile_head[t], qp, H, D, sc, kc, vc, sp, op, vml, simd, w);
  });
}

// q [N, H, D] float32; k, v caches [S or num_blocks, Hkv, L or block_size, D] (float32 or bfloat16, unit stride
// along D); seq_idx, positions, starts (first visible key of each token) [N] int64; block_table [S, max_blocks]
// int64 (paged) or undefined; sinks [H] float32 or undefined. -> [N, H, D] float32.
at::Tensor attention_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& seq_idx,
                         const at::Tensor& positions, const at::Tensor& starts, const std::optional<at::Tensor>& block_table,
                         const std::optional<at::Tensor>& sinks, double scale, bool simd) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.sizes() == k.sizes() && q.size(2) == k.size(3),
              "nemo_rz attention_fwd: q must be [N, H, D] and the caches [*, Hkv, *, D] alike, got ", q.sizes(), ", ",
              k.sizes(), ", ", v.sizes());
  TORCH_CHECK(q.scalar_type() == at::kFloat && q.is_contiguous(), "nemo_rz attention_fwd: q must be contiguous float32");
  TORCH_CHECK(k.scalar_type() == v.scalar_type() && (k.scalar_type() == at::kFloat || k.scalar_type() == at::kBFloat16),
              "nemo_rz attention_fwd: the caches must both be float32 or both bfloat16");
  TORCH_CHECK(k.stride(3) == 1 && v.stride(3) == 1, "nemo_rz attention_fwd: the caches need unit stride along D");
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0, "nemo_rz attention_fwd: heads must be a multiple of kv heads");
  const int64_t N = q.size(0);
  for (const at::Tensor* t : {&seq_idx, &positions, &starts})
    TORCH_CHECK(t->scalar_type() == at::kLong && t->dim() == 1 && t->size(0) == N && t->is_contiguous(),
                "nemo_rz attention_fwd: seq_idx, positions and starts must be contiguous int64 [N]");
  at::Tensor table, sink;
  if (block_table.has_value()) {
    table = *block_table;
    TORCH_CHECK(table.scalar_type() == at::kLong && table.dim() == 2 && table.is_contiguous(),
                "nemo_rz attention_fwd: block_table must be contiguous int64 [S, max_blocks]");
  }
  if (sinks.has_value()) {
    sink = *sinks;
    TORCH_CHECK(sink.scalar_type() == at::kFloat && sink.dim() == 1 && sink.size(0) == q.size(1) && sink.is_contiguous(),
                "nemo_rz attention_fwd: sinks must be contiguous float32 [H]");
  }
  const int64_t* ps = positions.data_ptr<int64_t>();
  const int64_t* si = seq_idx.data_ptr<int64_t>();
  const int64_t* st = starts.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i) {
    TORCH_CHECK(ps[i] >= 0 && st[i] >= 0 && st[i] <= ps[i], "nemo_rz attention_fwd: token ", i,
                " has position ", ps[i], " and first visible key ", st[i]);
    if (table.defined()) {
      TORCH_CHECK(si[i] >= 0 && si[i] < table.size(0) && ps[i] / k.size(2) < table.size(1),
                  "nemo_rz attention_fwd: token ", i, " (sequence ", si[i], ", position ", ps[i], ") is outside the block table");
    } else {
      TORCH_CHECK(si[i] >= 0 && si[i] < k.size(0) && (k.size(2) % KV_BLOCK == 0 || ps[i] < k.size(2)),
                  "nemo_rz attention_fwd: token ", i, " (sequence ", si[i], ", position ", ps[i], ") is outside the cache");
    }
  }
  at::Tensor out = at::empty(q.sizes(), q.options());
  if (N == 0) return out;
  if (k.scalar_type() == at::kFloat)
    run<float>(q, k, v, seq_idx, positions, starts, table, sink, scale, simd, out);
  else
    run<at::BFloat16>(q, k, v, seq_idx, positions, starts, table, sink, scale, simd, out);
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(nemo_rz_cpu, m) {
  m.def("attention_fwd(Tensor q, Tensor k, Tensor v, Tensor seq_idx, Tensor positions, Tensor starts, "
        "Tensor? block_table, Tensor? sinks, float scale, bool simd) -> Tensor",
        &attention_fwd);
}
