// y = x W^T for a weight W kept in GGUF's 32-weight blocks, read as it is stored: each block's weights dequantize
// to w = d * q + m (d, m float32 per block of one output row; q 4-bit unsigned, or 8-bit signed with m = 0).
//
//   bits 4 (Q4_0, Q4_1): q [N, K / 2] uint8, byte j of a block holding weight j (low nibble) and j + 16 (high),
//                        GGUF's order; Q4_0's w = d (q - 8) is d q + m with m = -8 d (exactly: both are products of
//                        d and small integers).
//   bits 8 (Q8_0):       q [N, K] int8, m absent.
//
// A decode step is a matrix-vector product that streams every weight once, so bytes read bound it: 4.5 bits a
// weight where a float32 copy reads 32. Each block is decoded to floats once per tile of up to kTile tokens and
// multiplied in float32 (a sum in another order than a dense product of the dequantized weights: differences in
// the last bits). Many tokens (a prefill): blocks of rows are dequantized and multiplied by the dense GEMM.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;
constexpr int64_t kTile = 8;       // tokens sharing each decoded block
constexpr int64_t kDenseFrom = 24;  // tokens from which dequantized rows go through the dense GEMM

// The 32 weights of one block as floats, without d and m: q (4-bit: 0..15; 8-bit: -128..127).
inline void decode_block(const uint8_t* q, int64_t bits, float* out) {
  if (bits == 4) {
    for (int64_t j = 0; j < 16; ++j) {
      out[j] = static_cast<float>(q[j] & 0x0F);
      out[j + 16] = static_cast<float>(q[j] >> 4);
    }
  } else {
    const int8_t* s = reinterpret_cast<const int8_t*>(q);
    for (int64_t j = 0; j < kBlock; ++j) out[j] = static_cast<float>(s[j]);
  }
}

#if defined(__AVX512F__)
// The block's q as two vectors of 16 floats.
inline void decode_block_avx512(const uint8_t* q, int64_t bits, __m512& low, __m512& high) {
  if (bits == 4) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i nibble = _mm_set1_epi8(0x0F);
    low = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(bytes, nibble)));
    high = _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_and_si128(_mm_srli_epi16(bytes, 4), nibble)));
  } else {
    low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
    high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
  }
}
#elif defined(__AVX2__)
// The block's q as four vectors of 8 floats.
inline void decode_block_avx2(const uint8_t* q, int64_t bits, __m256* parts) {
  if (bits == 4) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
    const __m128i nibble = _mm_set1_epi8(0x0F);
    const __m128i low = _mm_and_si128(bytes, nibble), high = _mm_and_si128(_mm_srli_epi16(bytes, 4), nibble);
    parts[0] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(low));
    parts[1] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(low, 8)));
    parts[2] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(high));
    parts[3] = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(high, 8)));
  } else {
    for (int64_t i = 0; i < 4; ++i)
      parts[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i))));
  }
}

inline float sum_avx2(__m256 v) {
  const __m128 folded = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(folded, _mm_movehl_ps(folded, folded));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}
#endif

// out[t, n] for tokens [t0, t0 + count) and rows [n0, n1): sum over blocks b of d[n, b] (q[n, b] . x[t, b]) plus
// m[n, b] * (sum of x[t, b]) (``sums`` [M, K / 32]).
void rows_times_tokens(const float* x, const float* sums, const uint8_t* q, const float* d, const float* m,
                       int64_t bits, int64_t k, int64_t n0, int64_t n1, int64_t t0, int64_t count, float* out,
                       int64_t n_total) {
  const int64_t blocks = k / kBlock;
  const int64_t row_bytes = k * bits / 8;
  const int64_t block_bytes = kBlock * bits / 8;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = q + n * row_bytes;
    const float* row_d = d + n * blocks;
    const float* row_m = m ? m + n * blocks : nullptr;
    float totals[kTile];  // each token's sum of d (q . x) over the row's blocks
#if defined(__AVX512F__)
    __m512 acc[kTile];
    for (int64_t t = 0; t < count; ++t) acc[t] = _mm512_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m512 low, high;
      decode_block_avx512(row + b * block_bytes, bits, low, high);
      const __m512 scale = _mm512_set1_ps(row_d[b]);  // d q once for the tile's tokens
      low = _mm512_mul_ps(low, scale);
      high = _mm512_mul_ps(high, scale);
      for (int64_t t = 0; t < count; ++t) {
        const float* xb = x + (t0 + t) * k + b * kBlock;
        acc[t] = _mm512_fmadd_ps(high, _mm512_loadu_ps(xb + 16), _mm512_fmadd_ps(low, _mm512_loadu_ps(xb), acc[t]));
      }
    }
    for (int64_t t = 0; t < count; ++t) totals[t] = _mm512_reduce_add_ps(acc[t]);
#elif defined(__AVX2__)
    __m256 acc[kTile];
    for (int64_t t = 0; t < count; ++t) acc[t] = _mm256_setzero_ps();
    for (int64_t b = 0; b < blocks; ++b) {
      __m256 parts[4];
      decode_block_avx2(row + b * block_bytes, bits, parts);
      const __m256 scale = _mm256_set1_ps(row_d[b]);  // d q once for the tile's tokens
      for (auto& part : parts) part = _mm256_mul_ps(part, scale);
      for (int64_t t = 0; t < count; ++t) {
        const float* xb = x + (t0 + t) * k + b * kBlock;
        __m256 sum = acc[t];
        for (int64_t i = 0; i < 4; ++i) sum = _mm256_fmadd_ps(parts[i], _mm256_loadu_ps(xb + 8 * i), sum);
        acc[t] = sum;
      }
    }
    for (int64_t t = 0; t < count; ++t) totals[t] = sum_avx2(acc[t]);
#else
    float decoded[kBlock];
    for (int64_t t = 0; t < count; ++t) totals[t] = 0;
    for (int64_t b = 0; b < blocks; ++b) {
      decode_block(row + b * block_bytes, bits, decoded);
      for (int64_t t = 0; t < count; ++t) {
        const float* xb = x + (t0 + t) * k + b * kBlock;
        float dot = 0;
        for (int64_t j = 0; j < kBlock; ++j) dot += decoded[j] * xb[j];
        totals[t] += row_d[b] * dot;
      }
    }
#endif
    for (int64_t t = 0; t < count; ++t) {  // the m term, then the output
      if (row_m) {
        const float* token_sums = sums + (t0 + t) * blocks;
        for (int64_t b = 0; b < blocks; ++b) totals[t] += row_m[b] * token_sums[b];
      }
      out[(t0 + t) * n_total + n] = totals[t];
    }
  }
}

// The weight's tensors; returns K, its weights a row.
int64_t check_weight(const at::Tensor& q, const at::Tensor& d, const std::optional<at::Tensor>& m, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "block_linear: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(q.dim() == 2 && (q.scalar_type() == at::kByte || q.scalar_type() == at::kChar),
              "block_linear: q [N, K * bits / 8] uint8 or int8");
  const int64_t k = q.size(1) * 8 / bits;
  TORCH_CHECK(k % kBlock == 0, "block_linear: rows of ", k, " weights are not whole blocks of 32");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.dim() == 2 && d.size(0) == q.size(0) && d.size(1) == k / kBlock,
              "block_linear: d [N, K / 32] float32");
  if (m) TORCH_CHECK(m->scalar_type() == at::kFloat && m->sizes() == d.sizes(), "block_linear: m like d");
  return k;
}

}  // namespace

// Rows of W dequantized to float32, [N, K] (the reference, and the dense path's tiles).
at::Tensor block_dequantize(at::Tensor q, at::Tensor d, std::optional<at::Tensor> m, int64_t bits) {
  const int64_t k = check_weight(q, d, m, bits);
  auto qs = q.contiguous();
  auto ds = d.contiguous();
  at::Tensor ms = m ? m->contiguous() : at::Tensor();
  const int64_t n = qs.size(0), blocks = k / kBlock, block_bytes = kBlock * bits / 8;
  auto out = at::empty({n, k}, ds.options());
  const uint8_t* q_data = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const float* d_data = ds.data_ptr<float>();
  const float* m_data = m ? ms.data_ptr<float>() : nullptr;
  float* out_data = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      for (int64_t b = 0; b < blocks; ++b) {
        float* w = out_data + row * k + b * kBlock;
        decode_block(q_data + (row * blocks + b) * block_bytes, bits, w);
        const float scale = d_data[row * blocks + b], low = m_data ? m_data[row * blocks + b] : 0.0f;
        for (int64_t j = 0; j < kBlock; ++j) w[j] = m_data ? w[j] * scale + low : w[j] * scale;
      }
    }
  });
  return out;
}

at::Tensor block_linear(at::Tensor x, at::Tensor q, at::Tensor d, std::optional<at::Tensor> m, int64_t bits) {
  const int64_t k = check_weight(q, d, m, bits), n = q.size(0);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) == k, "block_linear: x float32 [..., ", k,
              "]: q holds ", k, " weights a row, x has ", x.size(-1));
  auto flat = x.reshape({-1, k}).contiguous();
  const int64_t tokens = flat.size(0);
  auto shape = x.sizes().vec();
  shape.back() = n;
  if (tokens >= kDenseFrom) {  // a prefill: dense GEMM over rows dequantized a tile at a time
    constexpr int64_t kRows = 256;
    auto out = at::empty({tokens, n}, flat.options());
    for (int64_t n0 = 0; n0 < n; n0 += kRows) {
      const int64_t n1 = std::min(n, n0 + kRows);
      auto weights = block_dequantize(q.slice(0, n0, n1), d.slice(0, n0, n1),
                                      m ? std::optional<at::Tensor>(m->slice(0, n0, n1)) : std::nullopt, bits);
      out.slice(1, n0, n1).copy_(at::mm(flat, weights.t()));
    }
    return out.view(shape);
  }
  auto qs = q.contiguous();
  auto ds = d.contiguous();
  at::Tensor ms = m ? m->contiguous() : at::Tensor();
  const int64_t blocks = k / kBlock;
  at::Tensor sums;  // each token's sum over each block: the m term
  if (m) sums = flat.view({tokens, blocks, kBlock}).sum(-1).contiguous();
  auto out = at::empty({tokens, n}, flat.options());
  const float* x_data = flat.data_ptr<float>();
  const float* sums_data = m ? sums.data_ptr<float>() : nullptr;
  const uint8_t* q_data = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const float* d_data = ds.data_ptr<float>();
  const float* m_data = m ? ms.data_ptr<float>() : nullptr;
  float* out_data = out.data_ptr<float>();
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t0 = 0; t0 < tokens; t0 += kTile) {
      rows_times_tokens(x_data, sums_data, q_data, d_data, m_data, bits, k, begin, end, t0,
                        std::min(kTile, tokens - t0), out_data, n);
    }
  });
  return out.view(shape);
}

TORCH_LIBRARY_FRAGMENT(specbatch, m) {
  m.def("block_linear(Tensor x, Tensor q, Tensor d, Tensor? m, int bits) -> Tensor");
  m.def("block_dequantize(Tensor q, Tensor d, Tensor? m, int bits) -> Tensor");
}

TORCH_LIBRARY_IMPL(specbatch, CPU, m) {
  m.impl("block_linear", &block_linear);
  m.impl("block_dequantize", &block_dequantize);
}
