// The training step's elementwise work that eager PyTorch spreads over many passes over
// memory, written as one pass each, on CPU (aiayn/kernels.py):
//
// 1. the label-smoothed loss's softmax and its gradient, row by row (at the end of the file);
// 2. the post-LN residual block (next):
//
//     y = LayerNorm(x + Dropout(out))      (Section 3.1 / 5.4 of the paper)
//
// forward and backward, for x in float32 and out in float32 or bfloat16 (bf16 autocast gives
// a bf16 sub-layer output and an fp32 residual stream). PyTorch's eager ops take eight passes
// for this (the mask's random bits, compare, cast, scale, multiply, add, layer norm, and as
// many again in backward) plus an autograd node each; here one pass each way, row by row.
//
// Dropout's keep rule is aiayn.kernels.dropout's: 16 random bits per element read as an
// int16, kept when >= threshold (probability 1 - k / 65536 for k = round(p * 65536)),
// scaled by 65536 / (65536 - k). The bits come from a counter-based generator (splitmix64
// over (seed, row, word)), so a mask depends on the seed alone, not on the thread count or
// on how rows are split among threads; the seed, a one-element int64 tensor, is drawn from
// torch's generator (Python side), and read here without a trip through Python.
//
// Built when training starts by torch.utils.cpp_extension (aiayn/kernels.py), compiled for
// the instruction set torch itself dispatches to, and vectorized by the compiler: the
// reductions need -fassociative-math (the sums' order is the compiler's, not the loop's).

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <limits>
#include <vector>

namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

inline uint64_t mix64(uint64_t z) {  // splitmix64's finalizer
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
  return z ^ (z >> 31);
}

inline float load(float v) { return v; }
inline float load(c10::BFloat16 v) {
  uint32_t bits = static_cast<uint32_t>(v.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void store(float* p, float v) { *p = v; }
inline void store(c10::BFloat16* p, float v) {  // round to nearest even, NaN kept NaN
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  p->x = static_cast<uint16_t>(std::isnan(v) ? 0x7FC0u : rounded);
}

struct Keep {
  int16_t threshold;
  float scale;
};

// The keep rule (threshold, scale) comes from aiayn.kernels.keep_threshold, written once.
Keep keep_rule(int64_t threshold, double scale) {
  TORCH_CHECK(threshold >= -32768 && threshold <= 32767 && scale >= 1.0,
              "keep threshold ", threshold, " and scale ", scale,
              " are not aiayn.kernels.keep_threshold's");
  return {static_cast<int16_t>(threshold), static_cast<float>(scale)};
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

template <typename out_t>
void forward_rows(const float* x, const out_t* out, const float* gamma, const float* beta,
                  float* y, float* xhat, uint8_t* mask, float* rstd, int64_t rows, int64_t d,
                  Keep keep, float eps, uint64_t seed) {
  const int64_t words = (d + 3) / 4;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<uint64_t> bits(words);
    std::vector<float> z(d);
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * d;
      const out_t* outr = out + r * d;
      uint8_t* mr = mask + r * d;
      uint64_t* b = bits.data();
      const uint64_t base = seed + static_cast<uint64_t>(r * words) * kGolden;
      for (int64_t w = 0; w < words; ++w) b[w] = mix64(base + static_cast<uint64_t>(w) * kGolden);
      const int16_t* v = reinterpret_cast<const int16_t*>(b);
      float* zr = z.data();
      float sum = 0.f;
      for (int64_t j = 0; j < d; ++j) {
        const uint8_t kept = v[j] >= keep.threshold;
        mr[j] = kept;
        const float s = kept ? keep.scale : 0.f;
        zr[j] = xr[j] + load(outr[j]) * s;
        sum += zr[j];
      }
      const float mean = sum / static_cast<float>(d);
      float var = 0.f;
      for (int64_t j = 0; j < d; ++j) {
        const float c = zr[j] - mean;
        var += c * c;
      }
      const float rs = 1.f / std::sqrt(var / static_cast<float>(d) + eps);
      rstd[r] = rs;
      float* yr = y + r * d;
      float* hr = xhat + r * d;
      for (int64_t j = 0; j < d; ++j) {
        const float h = (zr[j] - mean) * rs;
        hr[j] = h;
        yr[j] = h * gamma[j] + beta[j];
      }
    }
  });
}

template <typename out_t>
void backward_rows(const float* dy, const float* xhat, const uint8_t* mask, const float* rstd,
                   const float* gamma, float* dx, out_t* dout, float* partial, int64_t rows,
                   int64_t d, float scale) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    float* dgamma = partial + static_cast<int64_t>(at::get_thread_num()) * 2 * d;
    float* dbeta = dgamma + d;
    for (int64_t r = begin; r < end; ++r) {
      const float* dyr = dy + r * d;
      const float* hr = xhat + r * d;
      const uint8_t* mr = mask + r * d;
      float c1 = 0.f, c2 = 0.f;
      for (int64_t j = 0; j < d; ++j) {
        const float g = dyr[j] * gamma[j];
        c1 += g * hr[j];
        c2 += g;
        dgamma[j] += dyr[j] * hr[j];
        dbeta[j] += dyr[j];
      }
      c1 /= static_cast<float>(d);
      c2 /= static_cast<float>(d);
      const float rs = rstd[r];
      float* dxr = dx + r * d;
      out_t* doutr = dout + r * d;
      for (int64_t j = 0; j < d; ++j) {
        const float dz = rs * (dyr[j] * gamma[j] - c2 - hr[j] * c1);
        dxr[j] = dz;
        store(doutr + j, mr[j] ? dz * scale : 0.f);
      }
    }
  });
}

}  // namespace

// (y, xhat, mask, rstd): y = LayerNorm(x + Dropout(out)); the rest is what backward needs.
std::vector<at::Tensor> residual_norm_forward(const at::Tensor& x, const at::Tensor& out,
                                              const at::Tensor& gamma, const at::Tensor& beta,
                                              int64_t threshold, double scale, double eps,
                                              const at::Tensor& seed) {
  for (auto [t, name] : {std::pair{&x, "x"}, {&out, "out"}, {&gamma, "weight"}, {&beta, "bias"}})
    check_rows(*t, name);
  TORCH_CHECK(x.scalar_type() == at::kFloat, "x must be float32, got ", x.scalar_type());
  TORCH_CHECK(out.scalar_type() == at::kFloat || out.scalar_type() == at::kBFloat16,
              "out must be float32 or bfloat16, got ", out.scalar_type());
  TORCH_CHECK(x.sizes() == out.sizes(), "x and out differ in shape: ", x.sizes(), " and ",
              out.sizes());
  TORCH_CHECK(x.dim() >= 1 && x.size(-1) > 0, "x needs a last dimension to normalize");
  const int64_t d = x.size(-1), rows = x.numel() / d;
  TORCH_CHECK(gamma.scalar_type() == at::kFloat && beta.scalar_type() == at::kFloat &&
                  gamma.numel() == d && beta.numel() == d,
              "weight and bias must be float32 vectors of ", d);
  const Keep keep = keep_rule(threshold, scale);
  auto y = at::empty_like(x), xhat = at::empty_like(x);
  auto mask = at::empty(x.sizes(), x.options().dtype(at::kByte));
  auto rstd = at::empty({rows}, x.options());
  TORCH_CHECK(seed.device().is_cpu() && seed.scalar_type() == at::kLong && seed.numel() == 1,
              "seed must be one int64 on the CPU");
  const auto s = static_cast<uint64_t>(*seed.data_ptr<int64_t>());
  if (out.scalar_type() == at::kBFloat16)
    forward_rows(x.data_ptr<float>(), out.data_ptr<c10::BFloat16>(), gamma.data_ptr<float>(),
                 beta.data_ptr<float>(), y.data_ptr<float>(), xhat.data_ptr<float>(),
                 mask.data_ptr<uint8_t>(), rstd.data_ptr<float>(), rows, d, keep,
                 static_cast<float>(eps), s);
  else
    forward_rows(x.data_ptr<float>(), out.data_ptr<float>(), gamma.data_ptr<float>(),
                 beta.data_ptr<float>(), y.data_ptr<float>(), xhat.data_ptr<float>(),
                 mask.data_ptr<uint8_t>(), rstd.data_ptr<float>(), rows, d, keep,
                 static_cast<float>(eps), s);
  return {y, xhat, mask, rstd};
}

// (dx, dout, dweight, dbias) for the incoming gradient dy of y; dout in out_dtype.
std::vector<at::Tensor> residual_norm_backward(const at::Tensor& dy_in, const at::Tensor& xhat,
                                               const at::Tensor& mask, const at::Tensor& rstd,
                                               const at::Tensor& gamma, double keep_scale,
                                               at::ScalarType out_dtype) {
  const at::Tensor dy = dy_in.contiguous().to(at::kFloat);
  TORCH_CHECK(dy.sizes() == xhat.sizes(), "the gradient's shape ", dy.sizes(),
              " is not the output's ", xhat.sizes());
  TORCH_CHECK(out_dtype == at::kFloat || out_dtype == at::kBFloat16,
              "out must be float32 or bfloat16");
  const int64_t d = dy.size(-1), rows = dy.numel() / d;
  const float scale = keep_rule(0, keep_scale).scale;
  auto dx = at::empty_like(dy);
  auto dout = at::empty(dy.sizes(), dy.options().dtype(out_dtype));
  auto partial = at::zeros({at::get_num_threads(), 2, d}, dy.options());
  if (out_dtype == at::kBFloat16)
    backward_rows(dy.data_ptr<float>(), xhat.data_ptr<float>(), mask.data_ptr<uint8_t>(),
                  rstd.data_ptr<float>(), gamma.data_ptr<float>(), dx.data_ptr<float>(),
                  dout.data_ptr<c10::BFloat16>(), partial.data_ptr<float>(), rows, d, scale);
  else
    backward_rows(dy.data_ptr<float>(), xhat.data_ptr<float>(), mask.data_ptr<uint8_t>(),
                  rstd.data_ptr<float>(), gamma.data_ptr<float>(), dx.data_ptr<float>(),
                  dout.data_ptr<float>(), partial.data_ptr<float>(), rows, d, scale);
  auto sums = partial.sum(0);
  return {dx, dout, sums[0], sums[1]};
}

// ------------------------------------------------------------------------------------------
// The label-smoothed loss's softmax over one chunk of logits, and its gradient in place
// (aiayn.kernels, section 1): per row, in one thread's cache,
//
//     lse  = log sum_v exp(z_v)        nll = lse - z_y
//     loss = lse - (1 - eps) z_y - eps * mean_v z_v
//     dz_v = softmax(z)_v - (1 - eps) [v = y] - eps / V      (v < V; columns past V: 0)
//
// where eager PyTorch takes about ten passes over a (rows x V) block (the fp32 copy, max,
// subtract, exp, sum, gather, the gradient, the label's scatter, the copy back) and as many
// small ops per block. The mean logit comes in (the dot product with the mean embedding row,
// as the eager path computes it), so both give the same loss.

namespace {

// exp(x) for x <= 0 (a logit minus its row's max), in a form the compiler vectorizes:
// 2^n * p(r) with r = x - n ln 2, |r| <= ln 2 / 2, and Cephes' degree-6 polynomial
// (relative error ~1e-7). Below -87, exp is under fp32's smallest normal; it is taken as
// exp(-87) (~1.6e-38), nothing beside a row's sum of at least 1. NaN stays NaN.
inline float exp_nonpositive(float x) {
  x = x < -87.f ? -87.f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// 16 floats as one value (GCC's vector extension; two AVX2 or four SSE registers where the
// target has no 512-bit ones): the row's max as a lane-wise blend, which the compiler does not
// vectorize from a scalar loop unless it may assume that no value is NaN.
constexpr int kLanes = 16;
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float))));

// The largest of e[0..n), NaNs passed over (they reach the loss through the exp and sum).
inline float row_max(const float* e, int64_t n) {
  float top = -std::numeric_limits<float>::infinity();
  Lanes m = top - Lanes{};  // every lane -inf
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes) {
    Lanes v;
    std::memcpy(&v, e + j, sizeof v);
    m = v > m ? v : m;
  }
  for (int k = 0; k < kLanes; ++k) top = m[k] > top ? m[k] : top;
  for (; j < n; ++j) top = e[j] > top ? e[j] : top;
  return top;
}

template <typename scalar_t>
void softmax_rows(scalar_t* logits, const int64_t* labels, const float* mean_logit, float* loss,
                  float* nll, int64_t rows, int64_t width, int64_t vocab, float eps,
                  bool grad) {
  const float off = eps / static_cast<float>(vocab);
  at::parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(vocab);
    float* e = buf.data();
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* z = logits + r * width;
      const int64_t y = labels[r];
      TORCH_CHECK(y >= 0 && y < vocab, "label ", y, " is outside the vocabulary of ", vocab);
      int64_t j;
      for (j = 0; j < vocab; ++j) e[j] = load(z[j]);
      const float top = row_max(e, vocab);
      const float target = e[y];
      float sum = 0.f;
      for (j = 0; j < vocab; ++j) {
        e[j] = exp_nonpositive(e[j] - top);
        sum += e[j];
      }
      const float lse = top + std::log(sum);
      nll[r] = lse - target;
      loss[r] = lse - (1.f - eps) * target - eps * mean_logit[r];
      if (!grad) continue;
      const float inv = 1.f / sum;
      for (j = 0; j < vocab; ++j) store(z + j, e[j] * inv - off);
      for (j = vocab; j < width; ++j) store(z + j, 0.f);
      store(z + y, e[y] * inv - off - (1.f - eps));
    }
  });
}

}  // namespace

// Writes loss and nll (fp32, one per row); with grad, overwrites the logits with the loss's
// gradient with respect to them (in their dtype, rounded once).
void label_smoothed_softmax_(at::Tensor& logits, const at::Tensor& labels,
                             const at::Tensor& mean_logit, at::Tensor& loss, at::Tensor& nll,
                             int64_t vocab, double eps, bool grad) {
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&logits, "logits"},
                         {&labels, "labels"},
                         {&mean_logit, "mean_logit"}, {&loss, "loss"}, {&nll, "nll"}})
    check_rows(*t, name);
  TORCH_CHECK(logits.dim() == 2, "logits must be (rows, width), got ", logits.sizes());
  const int64_t rows = logits.size(0), width = logits.size(1);
  TORCH_CHECK(vocab >= 1 && vocab <= width, "vocab ", vocab, " must be in [1, ", width, "]");
  TORCH_CHECK(labels.scalar_type() == at::kLong && labels.numel() == rows,
              "labels must be ", rows, " int64 values");
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&mean_logit, "mean_logit"},
                         {&loss, "loss"}, {&nll, "nll"}})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == rows, name, " must be ", rows,
                " float32 values");
  const auto e = static_cast<float>(eps);
  if (logits.scalar_type() == at::kBFloat16)
    softmax_rows(logits.data_ptr<c10::BFloat16>(), labels.data_ptr<int64_t>(),
                 mean_logit.data_ptr<float>(), loss.data_ptr<float>(), nll.data_ptr<float>(),
                 rows, width, vocab, e, grad);
  else if (logits.scalar_type() == at::kFloat)
    softmax_rows(logits.data_ptr<float>(), labels.data_ptr<int64_t>(),
                 mean_logit.data_ptr<float>(), loss.data_ptr<float>(), nll.data_ptr<float>(),
                 rows, width, vocab, e, grad);
  else
    TORCH_CHECK(false, "logits must be float32 or bfloat16, got ", logits.scalar_type());
}

// How many of torch's threads at::parallel_for hands work to here (tests): 1 when the module
// was compiled without OpenMP, whose pragmas at::parallel_for's inline code is made of.
int64_t parallel_threads(int64_t items) {
  std::vector<uint8_t> seen(at::get_num_threads(), 0);
  at::parallel_for(0, items, 1, [&](int64_t, int64_t) { seen[at::get_thread_num()] = 1; });
  return std::count(seen.begin(), seen.end(), 1);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("forward", &residual_norm_forward, "y, xhat, mask, rstd = LayerNorm(x + Dropout(out))");
  m.def("backward", &residual_norm_backward, "dx, dout, dweight, dbias");
  m.def("label_smoothed_softmax_", &label_smoothed_softmax_,
        "loss and nll per row; with grad, the logits become their gradient");
  m.def("parallel_threads", &parallel_threads, "threads that at::parallel_for used (tests)");
}
