// Paged attention on a CPU for decode, tree verification and drafting: each query reads only its own row's blocks.
//
// The queries of row r are tokens [row_starts[r], row_starts[r + 1]). Query n sees the keys at logical positions
// [0, prefix_len[n]) of its row, and the row's tentative tree keys at prefix_len[n] + t for every bit t set in
// tree_mask[n] (words of 64 bits: bit t is bit t % 64 of word t / 64). Position p of row r lives at offset p % block_size of block block_tables[r][p / block_size].
// Caches: keys [blocks, kv_heads, head_dim, block_size] (each block's keys transposed, so a query scores a block's
// keys with vector multiply-adds and no horizontal sums), values [blocks, kv_heads, block_size, head_dim]. The query
// heads that share a key/value head are scored together, so each key and value is read once per row (grouped-query
// attention without copies); an online softmax runs over the blocks.
// ATen's own headers, not <torch/extension.h> (the whole C++ API and pybind11): 15 CPU-s to compile this file
// instead of 37 (2-core Xeon, -O3).
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <mutex>
#include <unordered_map>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kTile = 8;  // query vectors scored together against one loaded key chunk
constexpr int64_t kPieceTokens = 32;  // query tokens of one work item: a multiple of kTile vectors at any group

template <typename T>
inline Vec load_floats(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    float tmp[Vec::size()];
    for (int64_t i = 0; i < Vec::size(); ++i) tmp[i] = static_cast<float>(p[i]);
    return Vec::loadu(tmp);
  }
}

// scores[v][j] = query[v] . key j, for query vectors [0, count) and the block's keys [0, block_size).
template <typename T, int kCount>
inline void score_tile(const float* query, int64_t dim, const T* keys_t, int64_t block_size, float* scores,
                       int64_t score_stride) {
  for (int64_t c = 0; c < block_size; c += Vec::size()) {
    Vec acc[kCount];
    for (int v = 0; v < kCount; ++v) acc[v] = Vec(0.f);
    for (int64_t d = 0; d < dim; ++d) {
      const Vec k = load_floats(keys_t + d * block_size + c);
      for (int v = 0; v < kCount; ++v) acc[v] = at::vec::fmadd(Vec(query[v * dim + d]), k, acc[v]);
    }
    for (int v = 0; v < kCount; ++v) acc[v].store(scores + v * score_stride + c);
  }
}

// Tiles whose vectors see no key at or after p0 (vector_upto: one past each vector's last visible key) are not
// scored: a prefill's queries see a causal triangle, so about half of the blocks are skipped.
template <typename T>
inline void score(const float* query, int64_t count, int64_t dim, const T* keys_t, int64_t block_size,
                  float* scores, const int64_t* vector_upto, int64_t p0) {
  for (int64_t v0 = 0; v0 < count; v0 += kTile) {
    if (*std::max_element(vector_upto + v0, vector_upto + std::min(count, v0 + kTile)) <= p0) continue;
    const float* q = query + v0 * dim;
    float* s = scores + v0 * block_size;
    switch (std::min<int64_t>(kTile, count - v0)) {
      case 1: score_tile<T, 1>(q, dim, keys_t, block_size, s, block_size); break;
      case 2: score_tile<T, 2>(q, dim, keys_t, block_size, s, block_size); break;
      case 3: score_tile<T, 3>(q, dim, keys_t, block_size, s, block_size); break;
      case 4: score_tile<T, 4>(q, dim, keys_t, block_size, s, block_size); break;
      case 5: score_tile<T, 5>(q, dim, keys_t, block_size, s, block_size); break;
      case 6: score_tile<T, 6>(q, dim, keys_t, block_size, s, block_size); break;
      case 7: score_tile<T, 7>(q, dim, keys_t, block_size, s, block_size); break;
      default: score_tile<T, 8>(q, dim, keys_t, block_size, s, block_size); break;
    }
  }
}

// acc = acc * correction + sum over keys j of weights[j] * values[j] for one query vector (kChunks vectors of a
// head). Keys outer, the head's vectors inner: each vector's sum is taken in key order as before, and its
// multiply-adds interleave with the other vectors' instead of waiting on their own latency (at a head of 64, a
// prefill's attention took ~4x the cycles of its multiply-adds' throughput).
template <typename T, int kChunks>
inline void accumulate(float* acc, const float* weights, const T* values, int64_t keys, float correction) {
  constexpr int64_t dim = kChunks * Vec::size();
  Vec sums[kChunks];
  for (int c = 0; c < kChunks; ++c) sums[c] = Vec::loadu(acc + c * Vec::size()) * Vec(correction);
  for (int64_t j = 0; j < keys; ++j) {
    const Vec weight(weights[j]);
    for (int c = 0; c < kChunks; ++c) {
      sums[c] = at::vec::fmadd(weight, load_floats(values + j * dim + c * Vec::size()), sums[c]);
    }
  }
  for (int c = 0; c < kChunks; ++c) sums[c].store(acc + c * Vec::size());
}

template <typename T>
void attend(at::Tensor& out, const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
            const at::Tensor& block_tables, const at::Tensor& row_starts, const at::Tensor& prefix_len,
            const at::Tensor& tree_mask, double scale) {
  const int64_t rows = row_starts.size(0) - 1, q_heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = k_cache.size(1), block_size = k_cache.size(3), group = q_heads / kv_heads;
  const int64_t k_block_stride = k_cache.stride(0), k_head_stride = k_cache.stride(1);
  const int64_t v_block_stride = v_cache.stride(0), v_head_stride = v_cache.stride(1);
  const T* qp = q.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int64_t table_stride = block_tables.stride(0);
  const int32_t* starts = row_starts.data_ptr<int32_t>();
  const int32_t* prefixes = prefix_len.data_ptr<int32_t>();
  const int64_t* masks = tree_mask.data_ptr<int64_t>();
  const int64_t words = tree_mask.size(1), mask_stride = tree_mask.stride(0);
  const float neg_inf = -std::numeric_limits<float>::infinity();

  // Work items: a row's queries in pieces of kPieceTokens tokens, for each key/value head. A piece's running
  // sums and scores stay in cache while its keys stream past (a whole long prefill row's did not: 1,500 tokens'
  // accumulators are over a megabyte); a piece's vectors are a whole number of tiles, so they are scored exactly
  // as in one pass over the row.
  std::vector<int64_t> piece_row, piece_first;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t t = starts[r]; t < starts[r + 1]; t += kPieceTokens) {
      piece_row.push_back(r);
      piece_first.push_back(t);
    }
  }
  const int64_t pieces = static_cast<int64_t>(piece_row.size());
  at::parallel_for(0, pieces * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query, acc, scores, running_max, running_sum;
    std::vector<int64_t> vector_upto, vector_full;  // per query vector: one past its last visible key; keys
                                                    // [0, full) all visible (no per-key mask needed there)
    for (int64_t item = begin; item < end; ++item) {
      const int64_t piece = item / kv_heads, h = item % kv_heads, r = piece_row[piece];
      const int64_t first = piece_first[piece], tokens = std::min<int64_t>(kPieceTokens, starts[r + 1] - first);
      const int64_t vectors = tokens * group;  // query vectors: (token, query head of the group)
      query.resize(vectors * dim);
      acc.assign(vectors * dim, 0.f);
      scores.resize(vectors * block_size);
      running_max.assign(vectors, neg_inf);
      running_sum.assign(vectors, 0.f);
      vector_upto.resize(vectors);
      vector_full.resize(vectors);
      int64_t upto = 0;  // keys any query of the row sees
      for (int64_t t = 0; t < tokens; ++t) {
        const int64_t n = first + t, prefix = prefixes[n];
        int64_t last = prefix, full = prefix;
        for (int64_t w = words - 1; w >= 0; --w) {
          const uint64_t bits = static_cast<uint64_t>(masks[n * mask_stride + w]);
          if (bits) {
            last = prefix + 64 * w + 64 - __builtin_clzll(bits);
            break;
          }
        }
        for (int64_t w = 0; w < words; ++w) {  // the run of visible tree keys from the first: a chain's ancestors
          const uint64_t bits = static_cast<uint64_t>(masks[n * mask_stride + w]);
          if (~bits == 0) {
            full += 64;
            continue;
          }
          full += __builtin_ctzll(~bits);
          break;
        }
        upto = std::max(upto, last);
        for (int64_t i = 0; i < group; ++i) {
          vector_upto[t * group + i] = last;
          vector_full[t * group + i] = full;
          const T* src = qp + n * q.stride(0) + (h * group + i) * q.stride(1);
          float* dst = query.data() + (t * group + i) * dim;
          for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(src[d]) * static_cast<float>(scale);
        }
      }
      const int32_t* table = tables + r * table_stride;
      const int64_t block_bytes = dim * block_size * static_cast<int64_t>(sizeof(T));  // one head's keys (or values)
      for (int64_t p0 = 0; p0 < upto; p0 += block_size) {
        const int64_t keys = std::min(block_size, upto - p0);
        const int64_t block = table[p0 / block_size];
        if (p0 + block_size < upto) {
          // The next block's keys and values, requested while this one is scored: blocks lie anywhere in the pool
          // (a page apart or more), where the hardware prefetcher does not follow.
          const int64_t next = table[p0 / block_size + 1];
          const char* next_keys = reinterpret_cast<const char*>(kp + next * k_block_stride + h * k_head_stride);
          const char* next_values = reinterpret_cast<const char*>(vp + next * v_block_stride + h * v_head_stride);
          for (int64_t offset = 0; offset < block_bytes; offset += 64) {
            __builtin_prefetch(next_keys + offset);
            __builtin_prefetch(next_values + offset);
          }
        }
        const T* values = vp + block * v_block_stride + h * v_head_stride;
        score(query.data(), vectors, dim, kp + block * k_block_stride + h * k_head_stride, block_size,
              scores.data(), vector_upto.data(), p0);
        for (int64_t vector = 0; vector < vectors; ++vector) {
          if (vector_upto[vector] <= p0) continue;  // nothing visible from here on (its tile may be unscored)
          float* s = scores.data() + vector * block_size;
          if (p0 + block_size > vector_full[vector]) {
            const int64_t n = first + vector / group, prefix = prefixes[n];
            const int64_t* bits = masks + n * mask_stride;
            for (int64_t j = 0; j < block_size; ++j) {
              const int64_t offset = p0 + j - prefix;
              if (j >= keys || (offset >= 0 && (offset >= 64 * words ||
                                                !((static_cast<uint64_t>(bits[offset / 64]) >> (offset % 64)) & 1)))) {
                s[j] = neg_inf;
              }
            }
          }
          const float block_max = at::vec::reduce_all<float>([](Vec& a, Vec& b) { return at::vec::maximum(a, b); },
                                                             s, block_size);
          if (block_max == neg_inf) continue;  // nothing visible in this block for this query
          const float new_max = std::max(running_max[vector], block_max);
          // Most blocks after the first raise no maximum: their correction is exactly 1.
          const float correction = new_max == running_max[vector] ? 1.f : std::exp(running_max[vector] - new_max);
          at::vec::map([new_max](Vec x) { return (x - Vec(new_max)).exp(); }, s, s, block_size);
          running_sum[vector] = running_sum[vector] * correction +
                                at::vec::reduce_all<float>([](Vec& a, Vec& b) { return a + b; }, s, block_size);
          running_max[vector] = new_max;
          float* a = acc.data() + vector * dim;
          switch (dim / Vec::size()) {
            case 1: accumulate<T, 1>(a, s, values, keys, correction); break;
            case 2: accumulate<T, 2>(a, s, values, keys, correction); break;
            case 4: accumulate<T, 4>(a, s, values, keys, correction); break;
            case 8: accumulate<T, 8>(a, s, values, keys, correction); break;
            default:
              for (int64_t d = 0; d < dim; d += Vec::size()) {
                Vec sum = Vec::loadu(a + d) * Vec(correction);
                for (int64_t j = 0; j < keys; ++j) sum = at::vec::fmadd(Vec(s[j]), load_floats(values + j * dim + d), sum);
                sum.store(a + d);
              }
          }
        }
      }
      for (int64_t vector = 0; vector < vectors; ++vector) {
        const int64_t n = first + vector / group, head = h * group + vector % group;
        T* dst = op + n * out.stride(0) + head * out.stride(1);
        const float inverse = running_sum[vector] > 0.f ? 1.f / running_sum[vector] : 0.f;
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[vector * dim + d] * inverse);
      }
    }
  });
}

template <typename T>
void write(at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& k, const at::Tensor& v,
           const at::Tensor& slots) {
  const int64_t tokens = k.size(0), kv_heads = k.size(1), dim = k.size(2), block_size = k_cache.size(3);
  const int64_t* sp = slots.data_ptr<int64_t>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  for (int64_t n = 0; n < tokens; ++n) {
    const int64_t block = sp[n] / block_size, offset = sp[n] % block_size;
    for (int64_t h = 0; h < kv_heads; ++h) {
      const T* ks = k.data_ptr<T>() + n * k.stride(0) + h * k.stride(1);
      const T* vs = v.data_ptr<T>() + n * v.stride(0) + h * v.stride(1);
      T* kd = kc + block * k_cache.stride(0) + h * k_cache.stride(1) + offset;
      T* vd = vc + block * v_cache.stride(0) + h * v_cache.stride(1) + offset * dim;
      for (int64_t d = 0; d < dim; ++d) {
        kd[d * block_size] = ks[d * k.stride(2)];
        vd[d] = vs[d * v.stride(2)];
      }
    }
  }
}

}  // namespace

at::Tensor paged_attention(at::Tensor k_cache, at::Tensor v_cache, at::Tensor q, at::Tensor k, at::Tensor v,
                           at::Tensor slots, at::Tensor block_tables, at::Tensor row_starts, at::Tensor prefix_len,
                           at::Tensor tree_mask, double scale) {
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "caches must be contiguous");
  TORCH_CHECK(k_cache.size(3) % Vec::size() == 0, "block_size must be a multiple of ", Vec::size());
  TORCH_CHECK(q.size(2) % Vec::size() == 0, "head_dim must be a multiple of ", Vec::size());
  auto out = at::empty(q.sizes(), q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "paged_attention", [&] {
    TORCH_CHECK(k_cache.scalar_type() == q.scalar_type(), "cache and query dtypes differ");
    write<scalar_t>(k_cache, v_cache, k.to(q.scalar_type()), v.to(q.scalar_type()), slots.to(at::kLong));
    attend<scalar_t>(out, q.contiguous(), k_cache, v_cache, block_tables, row_starts, prefix_len, tree_mask, scale);
  });
  return out;
}

// Linear layers over weights prepacked for oneDNN, callable from a compiled graph. A graph takes dense weights as
// inputs (a packed oneDNN tensor cannot be one); the packed copy made for each is found by the dense weight's data
// pointer, and a weight without one runs as a plain linear. Why: on a CPU a decode step streams every weight once,
// and the packed GEMV reads at memory bandwidth where the dense one does not (SmolLM2-135M's 30 layers at one row:
// 14.4 ms packed, 25.7 ms dense, 10.6 ms the bandwidth bound; its 49152-row head: 2.8 against 7.1 ms).
namespace {
std::mutex packed_mutex;
std::unordered_map<const void*, at::Tensor> packed_weights;
}  // namespace

void remember_packed(at::Tensor dense, at::Tensor packed) {
  std::lock_guard<std::mutex> guard(packed_mutex);
  packed_weights[dense.data_ptr()] = packed;
}

void forget_packed(at::Tensor dense) {
  std::lock_guard<std::mutex> guard(packed_mutex);
  packed_weights.erase(dense.data_ptr());
}

at::Tensor packed_linear(at::Tensor x, at::Tensor weight, std::optional<at::Tensor> bias) {
  at::Tensor packed;
  {
    std::lock_guard<std::mutex> guard(packed_mutex);
    auto found = packed_weights.find(weight.data_ptr());
    if (found != packed_weights.end()) packed = found->second;
  }
  if (!packed.defined()) return at::linear(x, weight, bias);
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  auto flat = x.reshape({-1, x.size(-1)}).contiguous();
  std::vector<c10::IValue> stack{flat, packed, bias, c10::string_view("none"),
                                 c10::List<std::optional<at::Scalar>>(), std::optional<c10::string_view>()};
  op.callBoxed(&stack);
  auto out = stack[0].toTensor();
  auto shape = x.sizes().vec();
  shape.back() = weight.size(0);
  return out.view(shape);
}

// Each row's first largest value's index (torch.argmax's answer, NaN counting as largest) and, where asked, its
// log-sum-exp, over logits [M, V] float32 (exp to within 20 ulp, as torch's CPU softmax: a statistic's precision).
// One op where torch runs argmax and logsumexp as several passes: 6 tree nodes x 49152 logits, 2 threads, 85 + 133 us
// in torch.
std::tuple<at::Tensor, at::Tensor> argmax_logsumexp(at::Tensor logits, bool with_logsumexp) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat, "argmax_logsumexp: logits [M, V] float32");
  auto x = logits.contiguous();
  const int64_t rows = x.size(0), vocab = x.size(1);
  TORCH_CHECK(vocab > 0, "argmax_logsumexp: an empty vocabulary");
  auto index = at::empty({rows}, x.options().dtype(at::kLong));
  auto lse = at::empty({with_logsumexp ? rows : 0}, x.options());
  const float* data = x.data_ptr<float>();
  int64_t* index_out = index.data_ptr<int64_t>();
  float* lse_out = lse.data_ptr<float>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = data + r * vocab;
      const float top = at::vec::reduce_all<float>(
          [](Vec& a, Vec& b) { return at::vec::maximum(a, b); }, row, vocab);
      int64_t at = 0;
      if (std::isnan(top)) {
        while (!std::isnan(row[at])) ++at;
      } else {  // whole vectors first: the first holding the largest value, then its lane
        const Vec wanted(top);
        const int none = (1 << Vec::size()) - 1;  // zero_mask: a bit per lane that compares unequal
        while (at + Vec::size() <= vocab && (Vec::loadu(row + at) == wanted).zero_mask() == none) at += Vec::size();
        while (row[at] != top) ++at;
      }
      index_out[r] = at;
      if (!with_logsumexp) continue;
      if (std::isnan(top) || std::isinf(top)) {  // -inf: an empty law; +inf, NaN: what torch returns
        lse_out[r] = top;
        continue;
      }
      const float sum = at::vec::map_reduce_all<float>(
          [top](Vec v) { return (v - Vec(top)).exp_u20(); }, [](Vec& a, Vec& b) { return a + b; }, row, vocab);
      lse_out[r] = top + std::log(sum);
    }
  });
  return {index, lse};
}

// Each token's LoRA delta for one projection group, computed for the tokens that have an adapter only (punica's
// shrink and expand gathered per token, as its SGMV kernel does): token t of adapter u = index[t] >= 0 gets, in part
// p's columns, B_p[u] (A_p[u] x_t); a base token's row stays zero. x [N, in] and every tensor float32; a [P*U*R, in]
// holds part p's rows of adapter u from (p*U + u)*R; parts[p] [U*R, out_p]. Why: the masked matmul pair computes
// every token against every present adapter in six small GEMMs a layer (SmolLM2-135M, 16 tokens, one rank-16
// q/k/v/o adapter: 3.6 ms a forward where the multiply-adds of the adapter rows' tokens take a tenth of that).
at::Tensor lora_delta(at::Tensor x, at::Tensor a, std::vector<at::Tensor> parts, at::Tensor index, int64_t rank) {
  TORCH_CHECK(x.dim() == 2 && a.dim() == 2 && x.scalar_type() == at::kFloat && a.scalar_type() == at::kFloat,
              "lora_delta: x [N, in] and a [P*U*R, in] float32");
  TORCH_CHECK(!parts.empty() && rank > 0 && a.size(1) == x.size(1), "lora_delta: parts, rank and shapes");
  const int64_t n = x.size(0), in = x.size(1), count = static_cast<int64_t>(parts.size());
  TORCH_CHECK(a.size(0) % (count * rank) == 0, "lora_delta: a's rows are not parts x adapters x rank");
  const int64_t adapters = a.size(0) / (count * rank);
  auto xs = x.contiguous();
  auto as = a.contiguous();
  auto rows = index.to(at::kLong).contiguous();
  TORCH_CHECK(rows.numel() == n, "lora_delta: one index a token");
  std::vector<at::Tensor> bs;
  std::vector<int64_t> offsets;
  int64_t total = 0;
  for (const auto& part : parts) {
    TORCH_CHECK(part.dim() == 2 && part.scalar_type() == at::kFloat && part.size(0) == adapters * rank,
                "lora_delta: each part [U*R, out] float32");
    bs.push_back(part.contiguous());
    offsets.push_back(total);
    total += part.size(1);
  }
  const int64_t* adapter_of = rows.data_ptr<int64_t>();
  // The tokens that have an adapter, grouped by adapter: a block of up to kBlock of them reads its A rows once.
  std::vector<int64_t> order;
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(adapter_of[t] < adapters, "lora_delta: index past the adapters");
    if (adapter_of[t] >= 0) order.push_back(t);
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t l, int64_t r) { return adapter_of[l] < adapter_of[r]; });
  auto out = at::zeros({n, total}, xs.options());
  const float* x_data = xs.data_ptr<float>();
  const float* a_data = as.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  constexpr int64_t kBlock = 4;
  const int64_t macs = count * rank * (in + total / count);  // a token's multiply-adds
  const int64_t grain = std::max<int64_t>(kBlock, (int64_t{1} << 18) / std::max<int64_t>(macs, 1));
  at::parallel_for(0, static_cast<int64_t>(order.size()), grain, [&](int64_t begin, int64_t end) {
    std::vector<float> shrunk(kBlock * rank);
    for (int64_t i = begin; i < end;) {
      const int64_t u = adapter_of[order[i]];
      int64_t k = 1;
      while (k < kBlock && i + k < end && adapter_of[order[i + k]] == u) ++k;
      const float* tokens[kBlock];
      for (int64_t q = 0; q < k; ++q) tokens[q] = x_data + order[i + q] * in;
      for (int64_t p = 0; p < count; ++p) {
        const float* a_rows = a_data + (p * adapters + u) * rank * in;
        for (int64_t r = 0; r < rank; ++r) {  // shrink: each A row read once for the block's tokens
          const float* a_row = a_rows + r * in;
          Vec sums[kBlock];
          for (int64_t q = 0; q < kBlock; ++q) sums[q] = Vec(0.0f);
          int64_t j = 0;
          for (; j + Vec::size() <= in; j += Vec::size()) {
            const Vec weights = Vec::loadu(a_row + j);
            for (int64_t q = 0; q < k; ++q) sums[q] = at::vec::fmadd(weights, Vec::loadu(tokens[q] + j), sums[q]);
          }
          for (int64_t q = 0; q < k; ++q) {
            float sum = at::vec::vec_reduce_all<float>([](Vec& l, Vec& r) { return l + r; }, sums[q]);
            for (int64_t tail = j; tail < in; ++tail) sum += a_row[tail] * tokens[q][tail];
            shrunk[q * rank + r] = sum;
          }
        }
        const int64_t width = bs[p].size(1);
        const float* b_rows = bs[p].data_ptr<float>() + u * rank * width;
        for (int64_t q = 0; q < k; ++q) {  // expand
          float* row = out_data + order[i + q] * total + offsets[p];
          for (int64_t r = 0; r < rank; ++r) {
            const float scale = shrunk[q * rank + r];
            const float* b = b_rows + r * width;
            int64_t c = 0;
            for (; c + Vec::size() <= width; c += Vec::size())
              at::vec::fmadd(Vec(scale), Vec::loadu(b + c), Vec::loadu(row + c)).store(row + c);
            for (; c < width; ++c) row[c] += scale * b[c];
          }
        }
      }
      i += k;
    }
  });
  return out;
}

// Declared without mutation annotations although it writes the new entries into the caches: a compiled graph reads
// the caches only through this op, each layer's slice once, so nothing can observe the write out of order. Declared
// (a!), AOTInductor's exported layer stack read a stale copy of the cache (logits off by ~1 once entries from an
// earlier forward were read).
TORCH_LIBRARY(specbatch, m) {
  m.def("paged_attention(Tensor k_cache, Tensor v_cache, Tensor q, Tensor k, Tensor v, Tensor slots, "
        "Tensor block_tables, Tensor row_starts, Tensor prefix_len, Tensor tree_mask, float scale) -> Tensor");
  m.def("remember_packed(Tensor dense, Tensor packed) -> ()", &remember_packed);  // any layout: a catch-all
  m.def("forget_packed(Tensor dense) -> ()", &forget_packed);
  m.def("packed_linear(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("argmax_logsumexp(Tensor logits, bool with_logsumexp) -> (Tensor, Tensor)");
  m.def("lora_delta(Tensor x, Tensor a, Tensor[] parts, Tensor index, int rank) -> Tensor");
}

TORCH_LIBRARY_IMPL(specbatch, CPU, m) {
  m.impl("paged_attention", &paged_attention);
  m.impl("packed_linear", &packed_linear);
  m.impl("argmax_logsumexp", &argmax_logsumexp);
  m.impl("lora_delta", &lora_delta);
}
