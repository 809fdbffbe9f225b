// y = x W^T for a weight W kept in GGUF's 32-weight blocks, read as it is stored: each block's weights dequantize
// to w = d * q + m (d, m float32 per block of one output row, or per half-block of 16 weights; q 4-bit unsigned,
// or 8-bit signed).
//
//   bits 4 (Q4_0, Q4_1): q [N, K / 2] uint8, byte j of a block holding weight j (low nibble) and j + 16 (high),
//                        GGUF's order; Q4_0's w = d (q - 8) is d q + m with m = -8 d (exactly: both are products of
//                        d and small integers).
//   bits 8 (Q8_0, Q6_K, packed checkpoints): q [N, K] int8; m absent (Q8_0, Q6_K) or given (zero points); Q6_K's
//                        6-bit q - 32 as int8, d per half-block (its scale times the super-block's).
//
// Each call decodes the weights a few output rows at a time, into registers or an L1 buffer, and multiplies them in
// one of two register-blocked forms, a GEMM whose packing of W is its dequantization:
//   - fewer than kBroadcastFrom tokens: rows x tokens vector accumulators along K, summed across lanes at the end,
//     each block's q times x scaled by its d and the m terms added last, d (q . x) + m sum(x) (a decode step streams
//     every weight once: 4.5 bits a weight where a float32 copy reads 32, and one multiply-add a block for d);
//   - from kBroadcastFrom tokens: tokens along the lanes (x transposed, padded to whole vectors), each weight
//     broadcast into rows x token-vector accumulators: no sums across lanes, bound by the multiply-adds as a float
//     GEMM is;
// a prefill of kDenseFrom tokens or more dequantizes row tiles for the dense GEMM instead.
// Sums run in another order than a dense product of the dequantized weights: differences in the last bits.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

constexpr int64_t kBlock = 32;

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
#endif

// The lanes form: tiles of kRows rows x up to kTokens tokens, or one row x up to kWide tokens for more tokens (vector
// accumulators along K, summed across lanes at the end), each row's blocks decoded into registers inside the tile.
#if defined(__AVX512F__)
typedef float Lanes __attribute__((vector_size(64)));  // one AVX-512 register
#else
typedef float Lanes __attribute__((vector_size(32)));  // one AVX2 register
#endif
constexpr int64_t kLanes = sizeof(Lanes) / sizeof(float);
// From this many tokens (a prefill) dequantizing every weight to float32 for oneDNN's GEMM, with its cache blocking,
// costs less than the broadcast form (SmolLM2-135M's projections weighted by their sizes, 2 threads, AVX-512 EPYC,
// against the float32 weights prepacked for oneDNN: broadcast and dense 1.17x at 512 tokens, 1.18x against 1.07x at
// 768, the broadcast form ahead below 512); rows go through it kDenseRows at a time, so the float copy stays small.
constexpr int64_t kDenseFrom = 512;
constexpr int64_t kDenseRows = 4096;
// From this many tokens the broadcast form costs less, until gguf_blocks.choose_block_forms times both on the machine
// (SmolLM2-135M's projections, 2 threads, AVX-512 EPYC, against the float32 weights prepacked for oneDNN: at 8 tokens
// lanes 1.32x the float32 time, broadcast 1.61x; at 12 lanes 1.43x, broadcast 1.25x; at 16 broadcast 0.92-0.98x; at 64
// lanes 1.29x, broadcast 1.01x).
constexpr int64_t kBroadcastFrom = 12;
#if defined(__AVX512F__)
constexpr int64_t kRows = 4;
constexpr int64_t kTokens = 6;  // 24 accumulators, 2 weight vectors, a block's sum and its d: 28 of 32 registers
#else
// 2 rows a tile: 0.95x the time of 4 at 1 token, 0.94x at 2 (0.84x for Q8_0 at 1), 1.02x for 1 row.
constexpr int64_t kRows = 2;
constexpr int64_t kTokens = 3;
#endif
constexpr int64_t kWide = 8;  // one row's tile beyond kTokens tokens: 8 accumulators, a block's vectors, sum and d
// The broadcast form: panels of kPanelRows rows (a thread's unit of work), in tiles of rows x token vectors (at most
// kChunkVectors vectors of tokens), each tile decoding its rows as it goes.
constexpr int64_t kPanelRows = 24;
#if defined(__AVX512F__)
constexpr int64_t kChunkVectors = 4;
#else
constexpr int64_t kChunkVectors = 2;
#endif

inline Lanes load_lanes(const float* p) {
  Lanes v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void store_lanes(float* p, Lanes v) { std::memcpy(p, &v, sizeof(v)); }

// The lanes' sum, pairwise (each half added to the other until one lane is left): one order for every tile, and
// three or four dependent additions where lane by lane took seven or fifteen.
inline float lane_sum(Lanes v) {
#if defined(__AVX512F__) || defined(__AVX2__)
#if defined(__AVX512F__)
  const __m512 all = (__m512)v;
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(all),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(all), 1)));
#else
  const __m256 half = (__m256)v;
#endif
  __m128 sum = _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1));
  sum = _mm_add_ps(sum, _mm_movehl_ps(sum, sum));
  return _mm_cvtss_f32(_mm_add_ss(sum, _mm_movehdup_ps(sum)));
#else
  for (int64_t width = kLanes / 2; width >= 1; width /= 2)
    for (int64_t i = 0; i < width; ++i) v[i] += v[i + width];
  return v[0];
#endif
}

inline Lanes splat(float value) {
#if defined(__AVX512F__)
  return (Lanes)_mm512_set1_ps(value);
#elif defined(__AVX2__)
  return (Lanes)_mm256_set1_ps(value);
#else
  Lanes out;
  for (int64_t i = 0; i < kLanes; ++i) out[i] = value;
  return out;
#endif
}

// a * b + c rounded once, whatever the compiler would contract: every form of the tile sums alike.
inline Lanes fma_lanes(Lanes a, Lanes b, Lanes c) {
#if defined(__AVX512F__)
  return (Lanes)_mm512_fmadd_ps((__m512)a, (__m512)b, (__m512)c);
#elif defined(__AVX2__)
  return (Lanes)_mm256_fmadd_ps((__m256)a, (__m256)b, (__m256)c);
#else
  Lanes out;
  for (int64_t i = 0; i < kLanes; ++i) out[i] = std::fma(a[i], b[i], c[i]);
  return out;
#endif
}

constexpr int64_t kVectors = kBlock / kLanes;  // a block's vectors

// One block's q as floats, kVectors vectors in the block's order, without d and m.
__attribute__((always_inline)) inline void decode_raw(const uint8_t* block, int64_t bits, Lanes* w) {
#if defined(__AVX512F__)
  __m512 low, high;
  decode_block_avx512(block, bits, low, high);
  w[0] = (Lanes)low;
  w[1] = (Lanes)high;
#elif defined(__AVX2__)
  if (bits == 4) {  // bytes 0-7 and 8-15 widened to 32 bits as they load; low nibbles are weights 0-15, high 16-31
    const __m256i nibble = _mm256_set1_epi32(0x0F);
    const __m256i first = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block)));
    const __m256i second = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 8)));
    w[0] = (Lanes)_mm256_cvtepi32_ps(_mm256_and_si256(first, nibble));
    w[1] = (Lanes)_mm256_cvtepi32_ps(_mm256_and_si256(second, nibble));
    w[2] = (Lanes)_mm256_cvtepi32_ps(_mm256_srli_epi32(first, 4));
    w[3] = (Lanes)_mm256_cvtepi32_ps(_mm256_srli_epi32(second, 4));
  } else {
    for (int64_t i = 0; i < 4; ++i)
      w[i] = (Lanes)_mm256_cvtepi32_ps(
          _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 8 * i))));
  }
#else
  float decoded[kBlock];
  decode_block(block, bits, decoded);
  std::memcpy(w, decoded, sizeof(decoded));
#endif
}

// Block b of W's row ``row`` as floats, kVectors vectors: d q + m, d q exact, so rounded once.
// ``halves``: 1 (one d, m a block) or 2 (one a half-block of 16 weights, as Q6_K scales them).
__attribute__((always_inline)) inline void decode_weights(const uint8_t* q, const float* d, const float* m,
                                                          int64_t bits, int64_t halves, int64_t k, int64_t row,
                                                          int64_t b, Lanes* w) {
  const int64_t blocks = k / kBlock, s = (row * blocks + b) * halves, last = halves - 1;
  decode_raw(q + (row * blocks + b) * (kBlock * bits / 8), bits, w);
  for (int64_t v = 0; v < kVectors; ++v) {
    const int64_t half = v < kVectors / 2 ? 0 : last;
    w[v] = fma_lanes(w[v], splat(d[s + half]), splat(m ? m[s + half] : 0.0f));
  }
}

// Blocks [b0, b1) of rows [r0, r0 + rows) of W as floats into w [rows, (b1 - b0) * 32] (as block_dequantize
// computes them).
inline void dequantize_blocks(const uint8_t* q, const float* d, const float* m, int64_t bits, int64_t halves, int64_t k,
                              int64_t r0, int64_t rows, int64_t b0, int64_t b1, float* w) {
  const int64_t width = (b1 - b0) * kBlock;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = b0; b < b1; ++b) {
      Lanes decoded[kVectors];
      decode_weights(q, d, m, bits, halves, k, r0 + r, b, decoded);
      float* out = w + r * width + (b - b0) * kBlock;
      for (int64_t v = 0; v < kVectors; ++v) store_lanes(out + v * kLanes, decoded[v]);
    }
  }
}

// Rows [r0, r0 + rows) of W as floats into w [rows, K].
inline void dequantize_rows(const uint8_t* q, const float* d, const float* m, int64_t bits, int64_t halves, int64_t k,
                            int64_t r0, int64_t rows, float* w) {
  dequantize_blocks(q, d, m, bits, halves, k, r0, rows, 0, k / kBlock, w);
}

// acc + d * (the block's q times x), its sum taken a block (or a half-block, each with its own d) at a time: the
// order of every lanes-form sum, whatever the tile's shape.
__attribute__((always_inline)) inline Lanes add_block(const Lanes* w, const float* x, const float* scale,
                                                      int64_t halves, Lanes acc) {
  if (halves == 1) {
    Lanes sum = w[0] * load_lanes(x);
#pragma GCC unroll 4
    for (int64_t v = 1; v < kVectors; ++v) sum = fma_lanes(w[v], load_lanes(x + v * kLanes), sum);
    return fma_lanes(splat(scale[0]), sum, acc);
  }
  constexpr int64_t kHalf = kVectors / 2;
#pragma GCC unroll 2
  for (int64_t h = 0; h < 2; ++h) {
    Lanes sum = w[h * kHalf] * load_lanes(x + h * kHalf * kLanes);
#pragma GCC unroll 2
    for (int64_t v = h * kHalf + 1; v < (h + 1) * kHalf; ++v) sum = fma_lanes(w[v], load_lanes(x + v * kLanes), sum);
    acc = fma_lanes(splat(scale[h]), sum, acc);
  }
  return acc;
}

// The m terms of one output: sum over the row's blocks of m times that block's sum of x (``lows``: x's sums a block,
// or a half-block, for one token), in one order.
inline float low_terms(const float* m_row, const float* lows, int64_t count) {
  Lanes acc = {};
  int64_t i = 0;
  for (; i + kLanes <= count; i += kLanes) acc = fma_lanes(load_lanes(m_row + i), load_lanes(lows + i), acc);
  float tail = 0.0f;
  for (; i < count; ++i) tail = std::fma(m_row[i], lows[i], tail);
  return lane_sum(acc) + tail;
}

// The lanes form's tile: acc[r][t] holds output row r (of W's rows from r0) for token t, along K, each block's q
// times x scaled by its d (d q x summed as d (q x): one multiply-add a block instead of one a weight; 0.77x the time
// of decoding d q + m first at 1 token, 0.82x at 2, SmolLM2-135M's projections, 2 threads, AVX2 EPYC), and m times
// x's sum of the block added at the end (``lows`` [kT, K / 32 * halves]; null when m is). Each row's blocks are
// decoded into registers beside the multiply-adds that use them, once a tile; an output's sum is the same whatever
// the tile's shape.
template <int64_t kR, int64_t kT, int64_t kBits, int64_t kHalves>
inline void rows_tokens_tile(const uint8_t* q, const float* d, const float* m, int64_t k, int64_t r0, const float* x,
                             const float* lows, float* out, int64_t n) {
  const int64_t blocks = k / kBlock;
  Lanes acc[kR][kT] = {};
  for (int64_t b = 0; b < blocks; ++b) {
#pragma GCC unroll 4
    for (int64_t r = 0; r < kR; ++r) {
      Lanes w[kVectors];
      decode_raw(q + ((r0 + r) * blocks + b) * (kBlock * kBits / 8), kBits, w);
      const float* scale = d + ((r0 + r) * blocks + b) * kHalves;
#pragma GCC unroll 8
      for (int64_t t = 0; t < kT; ++t) acc[r][t] = add_block(w, x + t * k + b * kBlock, scale, kHalves, acc[r][t]);
    }
  }
  const int64_t count = blocks * kHalves;
  for (int64_t t = 0; t < kT; ++t)
    for (int64_t r = 0; r < kR; ++r)
      out[t * n + r] = lane_sum(acc[r][t]) + (lows ? low_terms(m + (r0 + r) * count, lows + t * count, count) : 0.0f);
}

// kR rows times ``tokens`` (1 to kWide) tokens in one tile.
template <int64_t kR, int64_t kBits, int64_t kHalves>
inline void rows_tokens_tiles(int64_t tokens, const uint8_t* q, const float* d, const float* m, int64_t k, int64_t r0,
                              const float* x, const float* lows, float* out, int64_t n) {
  switch (tokens) {
    case 1: rows_tokens_tile<kR, 1, kBits, kHalves>(q, d, m, k, r0, x, lows, out, n); break;
    case 2: rows_tokens_tile<kR, 2, kBits, kHalves>(q, d, m, k, r0, x, lows, out, n); break;
    case 3: rows_tokens_tile<kR, 3, kBits, kHalves>(q, d, m, k, r0, x, lows, out, n); break;
    case 4: rows_tokens_tile<kR, 4, kBits, kHalves>(q, d, m, k, r0, x, lows, out, n); break;
    case 5: rows_tokens_tile<kR, 5, kBits, kHalves>(q, d, m, k, r0, x, lows, out, n); break;
    case 6: rows_tokens_tile<kR, 6, kBits, kHalves>(q, d, m, k, r0, x, lows, out, n); break;
    case 7: rows_tokens_tile<kR, 7, kBits, kHalves>(q, d, m, k, r0, x, lows, out, n); break;
    default: rows_tokens_tile<kR, 8, kBits, kHalves>(q, d, m, k, r0, x, lows, out, n); break;
  }
}

// Rows [r0, r0 + rows) of W times the call's tokens: up to kTokens tokens kRows rows a tile (each row's blocks
// decoded once); more tokens a row at a time, kWide tokens a tile.
template <int64_t kBits, int64_t kHalves>
inline void rows_tokens(const uint8_t* q, const float* d, const float* m, int64_t k, int64_t r0, int64_t rows,
                        const float* x, const float* lows, int64_t tokens, float* out, int64_t n) {
  if (rows == kRows && tokens <= kTokens) {
    rows_tokens_tiles<kRows, kBits, kHalves>(tokens, q, d, m, k, r0, x, lows, out + r0, n);
    return;
  }
  const int64_t count = k / kBlock * kHalves, wide = tokens <= kTokens ? tokens : kWide;
  for (int64_t r = r0; r < r0 + rows; ++r)
    for (int64_t t0 = 0; t0 < tokens; t0 += wide)
      rows_tokens_tiles<1, kBits, kHalves>(std::min(wide, tokens - t0), q, d, m, k, r, x + t0 * k,
                           lows ? lows + t0 * count : nullptr, out + t0 * n + r, n);
}

// Groups [p0, p1) of kRows rows of W times the call's tokens. The block's type (bits, scales a block) is a template
// argument, so each type's loops are compiled without the other types' branches.
template <int64_t kBits, int64_t kHalves>
void panel_product(const float* x, const float* lows, const uint8_t* q, const float* d, const float* m, int64_t k,
                   int64_t n, int64_t tokens, int64_t p0, int64_t p1, float* out) {
  for (int64_t group = p0; group < p1; ++group) {
    const int64_t r0 = group * kRows, rows = std::min(kRows, n - r0);
    // The next group's q, d and m requested while this one is multiplied: a tile decoding its rows reads several
    // rows at once, which the hardware's prefetch follows poorly (Q8_0 [49152, 576] at 1 token, 2 threads, AVX2 EPYC:
    // 3.2 ms without the requests, 1.5 with them). Written here: moved into a function of their own, whose only
    // effect is a prefetch, GCC dropped its calls.
    if (group + 1 < p1) {
      const int64_t row_bytes = k * kBits / 8, scales = k / kBlock * kHalves;
      const char* next_q = reinterpret_cast<const char*>(q + (r0 + kRows) * row_bytes);
      for (int64_t o = 0; o < kRows * row_bytes; o += 64) _mm_prefetch(next_q + o, _MM_HINT_T0);
      const char* next_d = reinterpret_cast<const char*>(d + (r0 + kRows) * scales);
      for (int64_t o = 0; o < kRows * scales * 4; o += 64) _mm_prefetch(next_d + o, _MM_HINT_T0);
      if (m) {
        const char* next_m = reinterpret_cast<const char*>(m + (r0 + kRows) * scales);
        for (int64_t o = 0; o < kRows * scales * 4; o += 64) _mm_prefetch(next_m + o, _MM_HINT_T0);
      }
    }
    rows_tokens<kBits, kHalves>(q, d, m, k, r0, rows, x, lows, tokens, out, n);
  }
}

// The broadcast form's tile: acc[r][v] holds output row r (of W's rows from r0) for the kLanes tokens of vector v; x
// transposed, xt [K, tp] (tp tokens a row, whole vectors); outt [kR, tp]. Without a ``panel`` (those rows already
// dequantized, [kR, K]), the kR rows are decoded a block at a time into a buffer in L1, beside the multiply-adds that
// read it, the accumulators in registers throughout: decoding a 24-row panel first left the multiply-adds waiting
// (SmolLM2-135M's projections at 16 tokens, 2 threads, AVX-512 EPYC, against the float32 weights prepacked for oneDNN:
// 1.07-1.12x from a panel, 0.92-0.98x decoded in the tile).
template <int64_t kR, int64_t kV>
inline void broadcast_tile(const uint8_t* q, const float* d, const float* m, int64_t bits, int64_t halves, int64_t k,
                           int64_t r0, const float* panel, const float* xt, int64_t tp, float* outt) {
  Lanes acc[kR][kV] = {};
  alignas(64) float decoded[kR * kBlock];
  for (int64_t b = 0; b < k / kBlock; ++b) {
    const float* w = panel ? panel + b * kBlock : decoded;
    const int64_t stride = panel ? k : kBlock;
    if (!panel) dequantize_blocks(q, d, m, bits, halves, k, r0, kR, b, b + 1, decoded);
    const float* x = xt + b * kBlock * tp;
    for (int64_t kk = 0; kk < kBlock; ++kk) {
      Lanes xv[kV];
#pragma GCC unroll 4
      for (int64_t v = 0; v < kV; ++v) xv[v] = load_lanes(x + kk * tp + v * kLanes);
#pragma GCC unroll 12
      for (int64_t r = 0; r < kR; ++r) {
        const float weight = w[r * stride + kk];
#pragma GCC unroll 4
        for (int64_t v = 0; v < kV; ++v) acc[r][v] += xv[v] * weight;
      }
    }
  }
  for (int64_t r = 0; r < kR; ++r)
    for (int64_t v = 0; v < kV; ++v) std::memcpy(outt + r * tp + v * kLanes, &acc[r][v], sizeof(Lanes));
}

// Rows [r0, r0 + rows) (``panel``: those rows dequantized, or null) times kV vectors of tokens, in tiles of kR rows
// with about 24 (AVX-512) or 12 (AVX2) accumulators; rows beyond whole tiles one at a time.
template <int64_t kV>
inline void broadcast_rows(const uint8_t* q, const float* d, const float* m, int64_t bits, int64_t halves, int64_t k,
                           int64_t r0, int64_t rows, const float* panel, const float* xt, int64_t tp, float* outt) {
#if defined(__AVX512F__)
  constexpr int64_t kR = kV == 1 ? 12 : (kV == 2 ? 12 : (kV == 3 ? 8 : 6));
#else
  constexpr int64_t kR = kV == 1 ? 12 : 6;
#endif
  int64_t r = 0;
  for (; r + kR <= rows; r += kR)
    broadcast_tile<kR, kV>(q, d, m, bits, halves, k, r0 + r, panel ? panel + r * k : nullptr, xt, tp, outt + r * tp);
  for (; r < rows; ++r)
    broadcast_tile<1, kV>(q, d, m, bits, halves, k, r0 + r, panel ? panel + r * k : nullptr, xt, tp, outt + r * tp);
}

#if defined(__AVX2__)
// Columns c of the 8 x 8 floats at src (rows ``stride`` apart) into cols[c].
inline void transpose8(const float* src, int64_t stride, __m256* cols) {
  __m256 r[8], t[8], s[8];
  for (int64_t i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(src + i * stride);
  for (int64_t i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);      // columns 0, 1 | 4, 5 of rows i, i + 1, interleaved
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);  // columns 2, 3 | 6, 7
  }
  for (int64_t i = 0; i < 8; i += 4) {
    s[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);      // column 0 | 4 of rows i .. i + 3
    s[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);  // column 1 | 5
    s[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    s[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  for (int64_t c = 0; c < 4; ++c) {
    cols[c] = _mm256_permute2f128_ps(s[c], s[c + 4], 0x20);
    cols[c + 4] = _mm256_permute2f128_ps(s[c], s[c + 4], 0x31);
  }
}
#endif

// outt [rows, tp] (a panel's rows, its tokens along a row) into out [tokens, n] from column 0 of out's pointer:
// 8 x 8 tiles transposed in registers, so out takes whole vectors ([3072, 576] at 64 tokens, AVX-512 EPYC, against
// the float32 time: copied a value at a time row by row 1.33x, token by token 1.03x, in tiles 0.99x).
inline void panel_to_rows(const float* outt, int64_t tp, int64_t rows, int64_t tokens, int64_t n, float* out) {
  int64_t r = 0;
#if defined(__AVX2__)
  for (; r + 8 <= rows; r += 8) {
    for (int64_t t = 0; t < tokens; t += 8) {  // tp holds whole vectors of 8 or 16 tokens: t + 8 <= tp
      __m256 cols[8];
      transpose8(outt + r * tp + t, tp, cols);
      const int64_t count = std::min<int64_t>(8, tokens - t);
      for (int64_t c = 0; c < count; ++c) _mm256_storeu_ps(out + (t + c) * n + r, cols[c]);
    }
  }
#endif
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t rest = r; rest < rows; ++rest) out[t * n + rest] = outt[rest * tp + t];
}

void broadcast_product(const float* xt, int64_t tp, const uint8_t* q, const float* d, const float* m, int64_t bits,
                       int64_t halves, int64_t k, int64_t n, int64_t tokens, int64_t p0, int64_t p1, float* out) {
  const int64_t vectors = tp / kLanes;
  // More tokens than one chunk: the panel's rows dequantized once for all chunks (decoded in each chunk's tiles
  // instead, 384 tokens took 1.14x the float32 time against 1.10x).
  const bool whole = vectors > kChunkVectors;
  std::vector<float> outt(kPanelRows * tp), w(whole ? kPanelRows * k : 0);
  for (int64_t panel = p0; panel < p1; ++panel) {
    const int64_t r0 = panel * kPanelRows, rows = std::min(kPanelRows, n - r0);
    if (whole) dequantize_rows(q, d, m, bits, halves, k, r0, rows, w.data());
    const float* rows_w = whole ? w.data() : nullptr;
    for (int64_t v0 = 0; v0 < vectors; v0 += kChunkVectors) {
      const float* x0 = xt + v0 * kLanes;
      float* o0 = outt.data() + v0 * kLanes;
      switch (std::min(kChunkVectors, vectors - v0)) {
        case 1: broadcast_rows<1>(q, d, m, bits, halves, k, r0, rows, rows_w, x0, tp, o0); break;
        case 2: broadcast_rows<2>(q, d, m, bits, halves, k, r0, rows, rows_w, x0, tp, o0); break;
#if defined(__AVX512F__)
        case 3: broadcast_rows<3>(q, d, m, bits, halves, k, r0, rows, rows_w, x0, tp, o0); break;
        default: broadcast_rows<4>(q, d, m, bits, halves, k, r0, rows, rows_w, x0, tp, o0); break;
#endif
      }
    }
    panel_to_rows(outt.data(), tp, rows, tokens, n, out + r0);
  }
}

// The weight's tensors; returns K, its weights a row.
int64_t check_weight(const at::Tensor& q, const at::Tensor& d, const std::optional<at::Tensor>& m, int64_t bits) {
  TORCH_CHECK(bits == 4 || bits == 8, "block_linear: bits must be 4 or 8, got ", bits);
  TORCH_CHECK(q.dim() == 2 && (q.scalar_type() == at::kByte || q.scalar_type() == at::kChar),
              "block_linear: q [N, K * bits / 8] uint8 or int8");
  const int64_t k = q.size(1) * 8 / bits;
  TORCH_CHECK(k % kBlock == 0, "block_linear: rows of ", k, " weights are not whole blocks of 32");
  TORCH_CHECK(d.scalar_type() == at::kFloat && d.dim() == 2 && d.size(0) == q.size(0) &&
                  (d.size(1) == k / kBlock || d.size(1) == 2 * k / kBlock),
              "block_linear: d [N, K / 32] or [N, K / 16] float32");
  if (m) TORCH_CHECK(m->scalar_type() == at::kFloat && m->sizes() == d.sizes(), "block_linear: m like d");
  return k;
}

// Scales a block: 1, or 2 (one a half-block).
inline int64_t halves_of(const at::Tensor& d, int64_t k) { return d.size(1) * kBlock / k; }

}  // namespace

// Rows of W dequantized to float32, [N, K] (the reference, and the dense path's tiles).
at::Tensor block_dequantize(at::Tensor q, at::Tensor d, std::optional<at::Tensor> m, int64_t bits) {
  const int64_t k = check_weight(q, d, m, bits), halves = halves_of(d, k);
  auto qs = q.contiguous();
  auto ds = d.contiguous();
  at::Tensor ms = m ? m->contiguous() : at::Tensor();
  const int64_t n = qs.size(0);
  auto out = at::empty({n, k}, ds.options());
  const uint8_t* q_data = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const float* d_data = ds.data_ptr<float>();
  const float* m_data = m ? ms.data_ptr<float>() : nullptr;
  float* out_data = out.data_ptr<float>();
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    dequantize_rows(q_data, d_data, m_data, bits, halves, k, begin, end - begin, out_data + begin * k);
  });
  return out;
}

// x [T, K] times w [N, K] transposed, by oneDNN with w reordered for T tokens where torch has oneDNN (at::mm
// otherwise): at::mm's MKL sgemm takes 1.12x the time at 1,600 tokens of [3072, 576] on an AVX-512 EPYC.
at::Tensor dense_product(const at::Tensor& x, const at::Tensor& w) {
  static const auto reorder = c10::Dispatcher::singleton().findOp({"mkldnn::_reorder_linear_weight", ""});
  static const auto linear = c10::Dispatcher::singleton().findOp({"mkldnn::_linear_pointwise", ""});
  if (!reorder || !linear) return at::mm(x, w.t());
  std::vector<c10::IValue> stack{w, std::optional<int64_t>(x.size(0))};
  reorder->callBoxed(&stack);
  stack = {x, stack[0].toTensor(), std::optional<at::Tensor>(), c10::string_view("none"),
           c10::List<std::optional<at::Scalar>>(), std::optional<c10::string_view>()};
  linear->callBoxed(&stack);
  return stack[0].toTensor();
}

// The product in a given form: 0 lanes, 1 broadcast, 2 dense (block_linear picks one by the call's tokens; the
// calibration and the tests ask for each).
at::Tensor block_linear_form(at::Tensor x, at::Tensor q, at::Tensor d, std::optional<at::Tensor> m, int64_t bits,
                             int64_t form) {
  const int64_t k = check_weight(q, d, m, bits), n = q.size(0), halves = halves_of(d, k);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.size(-1) == k, "block_linear: x float32 [..., ", k,
              "]: q holds ", k, " weights a row, x has ", x.size(-1));
  TORCH_CHECK(form >= 0 && form <= 2, "block_linear: form 0 (lanes), 1 (broadcast) or 2 (dense), got ", form);
  auto flat = x.reshape({-1, k}).contiguous();
  const int64_t tokens = flat.size(0);
  auto shape = x.sizes().vec();
  shape.back() = n;
  if (form == 2) {  // rows dequantized a tile at a time, multiplied by the dense GEMM
    if (n <= kDenseRows) return dense_product(flat, block_dequantize(q, d, m, bits)).view(shape);
    auto out = at::empty({tokens, n}, flat.options());
    for (int64_t n0 = 0; n0 < n; n0 += kDenseRows) {
      const int64_t n1 = std::min(n, n0 + kDenseRows);
      auto rows = block_dequantize(q.slice(0, n0, n1), d.slice(0, n0, n1),
                                   m ? std::optional<at::Tensor>(m->slice(0, n0, n1)) : std::nullopt, bits);
      out.slice(1, n0, n1).copy_(dense_product(flat, rows));
    }
    return out.view(shape);
  }
  auto qs = q.contiguous();
  auto ds = d.contiguous();
  at::Tensor ms = m ? m->contiguous() : at::Tensor();
  auto out = at::empty({tokens, n}, flat.options());
  const uint8_t* q_data = reinterpret_cast<const uint8_t*>(qs.data_ptr());
  const float* d_data = ds.data_ptr<float>();
  const float* m_data = m ? ms.data_ptr<float>() : nullptr;
  float* out_data = out.data_ptr<float>();
  const float* x_data = flat.data_ptr<float>();
  if (form == 1) {
    const int64_t tp = (tokens + kLanes - 1) / kLanes * kLanes;
    auto xt = at::empty({k, tp}, flat.options());  // x transposed, the tokens past the last one zero
    float* xt_data = xt.data_ptr<float>();
    at::parallel_for(0, k, 64, [&](int64_t begin, int64_t end) {
      for (int64_t kk = begin; kk < end; ++kk) {
        for (int64_t t = 0; t < tokens; ++t) xt_data[kk * tp + t] = x_data[t * k + kk];
        std::fill(xt_data + kk * tp + tokens, xt_data + (kk + 1) * tp, 0.0f);
      }
    });
    at::parallel_for(0, (n + kPanelRows - 1) / kPanelRows, 2, [&](int64_t begin, int64_t end) {
      broadcast_product(xt_data, tp, q_data, d_data, m_data, bits, halves, k, n, tokens, begin, end, out_data);
    });
    return out.view(shape);
  }
  // With m, x's sum over each block (or half-block) of each token, the lanes form's m terms: summed in order.
  const int64_t count = k / kBlock * halves, span = k / count;
  std::vector<float> lows(m ? tokens * count : 0);
  for (int64_t i = 0; i < static_cast<int64_t>(lows.size()); ++i) {
    float sum = 0.0f;
    for (int64_t j = 0; j < span; ++j) sum += x_data[i * span + j];
    lows[i] = sum;
  }
  const float* lows_data = m ? lows.data() : nullptr;
  const auto product = bits == 4 ? (halves == 1 ? panel_product<4, 1> : panel_product<4, 2>)
                                  : (halves == 1 ? panel_product<8, 1> : panel_product<8, 2>);
  at::parallel_for(0, (n + kRows - 1) / kRows, 8, [&](int64_t begin, int64_t end) {
    product(x_data, lows_data, q_data, d_data, m_data, k, n, tokens, begin, end, out_data);
  });
  return out.view(shape);
}

// Where the broadcast form takes over: kBroadcastFrom until set_block_broadcast_from (timed once a machine,
// gguf_blocks.choose_block_forms).
std::atomic<int64_t> broadcast_from{kBroadcastFrom};

// The token count from which block_linear dequantizes for the dense GEMM (Python reads it for its timings).
int64_t block_dense_from() { return kDenseFrom; }

void set_block_broadcast_from(int64_t tokens) {
  TORCH_CHECK(tokens >= 1, "set_block_broadcast_from: tokens >= 1, got ", tokens);
  broadcast_from.store(tokens);
}

at::Tensor block_linear(at::Tensor x, at::Tensor q, at::Tensor d, std::optional<at::Tensor> m, int64_t bits) {
  const int64_t tokens = x.numel() / std::max<int64_t>(x.size(-1), 1);
  const int64_t form = tokens >= kDenseFrom ? 2 : (tokens >= broadcast_from.load() ? 1 : 0);
  return block_linear_form(x, q, d, m, bits, form);
}

TORCH_LIBRARY_FRAGMENT(specbatch, m) {
  m.def("block_linear(Tensor x, Tensor q, Tensor d, Tensor? m, int bits) -> Tensor");
  m.def("block_dequantize(Tensor q, Tensor d, Tensor? m, int bits) -> Tensor");
  m.def("block_linear_form(Tensor x, Tensor q, Tensor d, Tensor? m, int bits, int form) -> Tensor");
  m.def("set_block_broadcast_from(int tokens) -> ()");
  m.def("block_dense_from() -> int", &block_dense_from);  // no tensors: a catch-all
}

TORCH_LIBRARY_IMPL(specbatch, CPU, m) {
  m.impl("block_linear", &block_linear);
  m.impl("block_dequantize", &block_dequantize);
  m.impl("block_linear_form", &block_linear_form);
}

TORCH_LIBRARY_IMPL(specbatch, CatchAll, m) { m.impl("set_block_broadcast_from", &set_block_broadcast_from); }
