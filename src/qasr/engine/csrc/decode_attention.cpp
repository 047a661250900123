// Decode attention over a token pool: one query token per sequence, keys/values of each sequence
// stored contiguously in a (kv_heads, pool_tokens, head_dim) pool. One call serves the whole batch,
// parallel over (sequence, kv head); each task streams its keys and values once, accumulating in
// float32. No padding to the longest sequence, no gather, no per-sequence Python call.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

template <typename T>
static inline float as_float(T x) { return static_cast<float>(x); }

template <typename T>
static void run(const T* q, const T* kpool, const T* vpool, T* out, const int64_t* starts,
                const int64_t* lens, int64_t batch, int64_t heads, int64_t kv_heads, int64_t pool,
                int64_t dim, float scale) {
  const int64_t rep = heads / kv_heads;
  // Small batches run on the calling thread: waking a thread team costs more than the work, and far
  // more when the cores are busy with other processes.
  int64_t total = 0;
  for (int64_t b = 0; b < batch; ++b) total += lens[b];
  const int64_t grain = total * kv_heads * dim < (int64_t(1) << 18) ? batch * kv_heads : 1;
  at::parallel_for(0, batch * kv_heads, grain, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(rep * dim), acc(rep * dim), scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / kv_heads, g = task % kv_heads;
      const int64_t start = starts[b], len = lens[b];
      scores.assign(rep * len, 0.f);
      for (int64_t r = 0; r < rep; ++r)
        for (int64_t d = 0; d < dim; ++d)
          qf[r * dim + d] = as_float(q[(b * heads + g * rep + r) * dim + d]) * scale;
      const T* kbase = kpool + (g * pool + start) * dim;
      for (int64_t t = 0; t < len; ++t) {
        const T* k = kbase + t * dim;
        for (int64_t r = 0; r < rep; ++r) {
          const float* qr = qf.data() + r * dim;
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int64_t d = 0; d < dim; ++d) s += qr[d] * as_float(k[d]);
          scores[r * len + t] = s;
        }
      }
      for (int64_t r = 0; r < rep; ++r) {
        float* sr = scores.data() + r * len;
        float mx = -INFINITY;
        for (int64_t t = 0; t < len; ++t) mx = std::max(mx, sr[t]);
        float sum = 0.f;
        for (int64_t t = 0; t < len; ++t) { sr[t] = std::exp(sr[t] - mx); sum += sr[t]; }
        const float inv = 1.f / sum;
        for (int64_t t = 0; t < len; ++t) sr[t] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      const T* vbase = vpool + (g * pool + start) * dim;
      for (int64_t t = 0; t < len; ++t) {
        const T* v = vbase + t * dim;
        for (int64_t r = 0; r < rep; ++r) {
          const float p = scores[r * len + t];
          float* ar = acc.data() + r * dim;
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) ar[d] += p * as_float(v[d]);
        }
      }
      for (int64_t r = 0; r < rep; ++r)
        for (int64_t d = 0; d < dim; ++d)
          out[(b * heads + g * rep + r) * dim + d] = static_cast<T>(acc[r * dim + d]);
    }
  });
}

// q: (B, H, D); kpool, vpool: (KVH, P, D); starts, lens: (B,) int64 -> out (B, H, D)
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor kpool, torch::Tensor vpool,
                               torch::Tensor starts, torch::Tensor lens, double scale) {
  TORCH_CHECK(q.is_contiguous() && kpool.is_contiguous() && vpool.is_contiguous(), "contiguous inputs");
  TORCH_CHECK(q.scalar_type() == kpool.scalar_type() && kpool.scalar_type() == vpool.scalar_type());
  auto out = torch::empty_like(q);
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KVH = kpool.size(0), P = kpool.size(1);
  auto st = starts.contiguous(), ln = lens.contiguous();
  if (q.scalar_type() == at::kBFloat16) {
    run<at::BFloat16>(q.data_ptr<at::BFloat16>(), kpool.data_ptr<at::BFloat16>(),
                      vpool.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), st.data_ptr<int64_t>(),
                      ln.data_ptr<int64_t>(), B, H, KVH, P, D, static_cast<float>(scale));
  } else if (q.scalar_type() == at::kFloat) {
    run<float>(q.data_ptr<float>(), kpool.data_ptr<float>(), vpool.data_ptr<float>(), out.data_ptr<float>(),
               st.data_ptr<int64_t>(), ln.data_ptr<int64_t>(), B, H, KVH, P, D, static_cast<float>(scale));
  } else {
    TORCH_CHECK(false, "decode_attention supports float32 and bfloat16");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "batched single-token attention over a token pool");
}
