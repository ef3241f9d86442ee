// The training step's elementwise work that eager PyTorch spreads over many passes over
// memory, written as one pass each, on CPU (aiayn/fast/):
//
// 1. the label-smoothed loss's softmax and its gradient, row by row (at the end of the file);
// 2. scaled dot-product attention over short sequences, per (sequence, head) (before it);
// 3. the post-LN residual block (next):
//
//     y = LayerNorm(x + Dropout(out))      (Section 3.1 / 5.4 of the paper)
//
// forward and backward, for x in float32 and out in float32 or bfloat16 (bf16 autocast gives
// a bf16 sub-layer output and an fp32 residual stream). PyTorch's eager ops take eight passes
// for this (the mask's random bits, compare, cast, scale, multiply, add, layer norm, and as
// many again in backward) plus an autograd node each; here one pass each way, row by row.
//
// Dropout's keep rule is aiayn.fast.dropout's: 16 random bits per element read as an
// int16, kept when >= threshold (probability 1 - k / 65536 for k = round(p * 65536)),
// scaled by 65536 / (65536 - k). The bits come from a counter-based generator (splitmix64
// over (seed, row, word)), so a mask depends on the seed alone, not on the thread count or
// on how rows are split among threads; the seed, a one-element int64 tensor, is drawn from
// torch's generator (Python side), and read here without a trip through Python.
//
// Built when training starts by torch.utils.cpp_extension (aiayn/fast/extension.py),
// compiled for
// the instruction set torch itself dispatches to, and vectorized by the compiler: the
// reductions need -fassociative-math (the sums' order is the compiler's, not the loop's).
// Attention's (sequence, head) tasks and the row kernels' rows are split over torch's threads
// by at::parallel_for, OpenMP pragmas that need -fopenmp.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <tuple>
#include <limits>
#include <vector>

#if defined(__SSE__)
#include <xmmintrin.h>
#endif

namespace {

// Before every loop that reads and writes through pointers into different buffers: the
// buffers never overlap (fresh outputs, per-call scratch), and saying so keeps the compiler
// from versioning the loop, i.e. from choosing at run time, by the buffers' addresses,
// between its vectorized form and a scalar one. The two round differently (a row's sum in
// another order), so a result depended on where the allocator had put the buffers: on a CPU
// with AMX, two-process runs sometimes parted when a residual block's forward call, given
// identical inputs, returned another y (bench/README.md, "two_process_drift.py").
// tests/test_kernels.py compiles this file and checks that no loop is versioned so.
#if defined(__clang__)
#define KERNEL_LOOP _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define KERNEL_LOOP _Pragma("GCC ivdep")
#else
#define KERNEL_LOOP
#endif

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

// The row kernels (the residual block, the loss's softmax) split their rows over torch's
// threads. Every row is computed alike whatever the split; the residual block's weight-gradient
// sums are added per block of kSumRows rows, then block after block, so that they too do not
// depend on the thread count. Each kernel's rows are a function of its own that takes every
// value by value (forward_range, backward_range, softmax_range), called from the threads'
// lambda: written as the lambda's body, reading the row width and the keep rule through
// captured references, gcc left the dropout loop and the generator's loop scalar (a store
// might change what they read), and the forward pass ran several times slower on one thread
// (bench/README.md has the figures). The two-thread kernels measured before (ed1b132) had
// that form, which is why they made the step slower then (bench/README.md, "the row kernels
// on two threads").
constexpr int64_t kRowGrain = 64;
constexpr int64_t kSumRows = 256;

template <typename F>
inline void across_threads(int64_t rows, const F& body) {
  at::parallel_for(0, rows, kRowGrain, body);
}

struct Keep {
  int16_t threshold;
  float scale;
};

// The keep rule (threshold, scale) comes from aiayn.fast.dropout.keep_threshold, written once.
Keep keep_rule(int64_t threshold, double scale) {
  TORCH_CHECK(threshold >= -32768 && threshold <= 32767 && scale >= 1.0,
              "keep threshold ", threshold, " and scale ", scale,
              " are not aiayn.fast.dropout.keep_threshold's");
  return {static_cast<int16_t>(threshold), static_cast<float>(scale)};
}

void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// Rows [begin, end) of the forward pass (every value by value: see across_threads).
template <typename out_t>
void forward_range(const float* x, const out_t* out, const float* gamma, const float* beta,
                   float* y, float* xhat, uint8_t* mask, float* rstd, int64_t begin,
                   int64_t end, int64_t d, Keep keep, float eps, uint64_t seed) {
  const int64_t words = (d + 3) / 4;
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
    KERNEL_LOOP
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
    KERNEL_LOOP
    for (int64_t j = 0; j < d; ++j) {
      const float h = (zr[j] - mean) * rs;
      hr[j] = h;
      yr[j] = h * gamma[j] + beta[j];
    }
  }
}

template <typename out_t>
void forward_rows(const float* x, const out_t* out, const float* gamma, const float* beta,
                  float* y, float* xhat, uint8_t* mask, float* rstd, int64_t rows, int64_t d,
                  Keep keep, float eps, uint64_t seed) {
  across_threads(rows, [=](int64_t begin, int64_t end) {
    forward_range(x, out, gamma, beta, y, xhat, mask, rstd, begin, end, d, keep, eps, seed);
  });
}

// Rows [begin, end) of the backward pass; dgamma and dbeta add these rows' sums (every
// value by value: see across_threads).
template <typename out_t>
void backward_range(const float* dy, const float* xhat, const uint8_t* mask, const float* rstd,
                    const float* gamma, float* dx, out_t* dout, float* dgamma, float* dbeta,
                    int64_t begin, int64_t end, int64_t d, float scale) {
  for (int64_t r = begin; r < end; ++r) {
    const float* dyr = dy + r * d;
    const float* hr = xhat + r * d;
    const uint8_t* mr = mask + r * d;
    float c1 = 0.f, c2 = 0.f;
    KERNEL_LOOP
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
    KERNEL_LOOP
    for (int64_t j = 0; j < d; ++j) {
      const float dz = rs * (dyr[j] * gamma[j] - c2 - hr[j] * c1);
      dxr[j] = dz;
      store(doutr + j, mr[j] ? dz * scale : 0.f);
    }
  }
}

template <typename out_t>
void backward_rows(const float* dy, const float* xhat, const uint8_t* mask, const float* rstd,
                   const float* gamma, float* dx, out_t* dout, float* sums, int64_t rows,
                   int64_t d, float scale) {
  // Each block of kSumRows rows sums its dgamma and dbeta into a partial of its own; the
  // partials are added in block order at the end.
  const int64_t blocks = (rows + kSumRows - 1) / kSumRows;
  std::vector<float> partial(static_cast<size_t>(blocks * 2 * d), 0.f);
  float* parts = partial.data();
  at::parallel_for(0, blocks, 1, [=](int64_t first, int64_t last) {
    for (int64_t blk = first; blk < last; ++blk)
      backward_range(dy, xhat, mask, rstd, gamma, dx, dout, parts + blk * 2 * d,
                     parts + blk * 2 * d + d, blk * kSumRows,
                     std::min(rows, (blk + 1) * kSumRows), d, scale);
  });
  for (int64_t blk = 0; blk < blocks; ++blk) {
    const float* p = parts + blk * 2 * d;
    KERNEL_LOOP
    for (int64_t j = 0; j < 2 * d; ++j) sums[j] += p[j];
  }
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
  auto sums = at::zeros({2, d}, dy.options());
  if (out_dtype == at::kBFloat16)
    backward_rows(dy.data_ptr<float>(), xhat.data_ptr<float>(), mask.data_ptr<uint8_t>(),
                  rstd.data_ptr<float>(), gamma.data_ptr<float>(), dx.data_ptr<float>(),
                  dout.data_ptr<c10::BFloat16>(), sums.data_ptr<float>(), rows, d, scale);
  else
    backward_rows(dy.data_ptr<float>(), xhat.data_ptr<float>(), mask.data_ptr<uint8_t>(),
                  rstd.data_ptr<float>(), gamma.data_ptr<float>(), dx.data_ptr<float>(),
                  dout.data_ptr<float>(), sums.data_ptr<float>(), rows, d, scale);
  return {dx, dout, sums[0], sums[1]};
}

// ------------------------------------------------------------------------------------------
// The label-smoothed loss's softmax over one chunk of logits, and its gradient in place
// (aiayn.fast.loss): per row, in one thread's cache,
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
// (relative error ~1e-7 near 0, growing to ~4e-6 near -87: -fassociative-math lets the
// compiler fold the two-constant reduction below into one; a probability's absolute error
// stays under 2e-8, nothing beside a row's sum of at least 1). Below -87, exp is under
// fp32's smallest normal; it is taken as exp(-87) (~1.6e-38), as little. NaN stays NaN.
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

// One vector register of floats as one value (GCC's vector extension): 16 where the target has
// 512-bit registers, else 8 (one AVX2 register; a 16-float value built for AVX2 ran attention's
// products slower). The row's max is a lane-wise blend, which the compiler does not
// vectorize from a scalar loop unless it may assume that no value is NaN.
#ifdef __AVX512F__
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
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

// Rows [begin, end) of the softmax (every value by value: see across_threads).
template <typename scalar_t>
void softmax_range(scalar_t* logits, const int64_t* labels, const float* mean_logit,
                   float* loss, float* nll, int64_t begin, int64_t end, int64_t width,
                   int64_t vocab, float eps, bool grad) {
  const float off = eps / static_cast<float>(vocab);
  std::vector<float> buf(vocab);
  float* e = buf.data();
  for (int64_t r = begin; r < end; ++r) {
    scalar_t* z = logits + r * width;
    const int64_t y = labels[r];
    TORCH_CHECK(y >= 0 && y < vocab, "label ", y, " is outside the vocabulary of ", vocab);
    int64_t j;
    KERNEL_LOOP
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
    KERNEL_LOOP
    for (j = 0; j < vocab; ++j) store(z + j, e[j] * inv - off);
    for (j = vocab; j < width; ++j) store(z + j, 0.f);
    store(z + y, e[y] * inv - off - (1.f - eps));
  }
}

template <typename scalar_t>
void softmax_rows(scalar_t* logits, const int64_t* labels, const float* mean_logit, float* loss,
                  float* nll, int64_t rows, int64_t width, int64_t vocab, float eps,
                  bool grad) {
  across_threads(rows, [=](int64_t begin, int64_t end) {
    softmax_range(logits, labels, mean_logit, loss, nll, begin, end, width, vocab, eps, grad);
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

// R-Drop's loss of a label seen by two passes (aiayn.fast.loss.projected_rdrop_loss): with z1, z2
// the two rows of logits, l = log softmax, p = softmax, LS the label-smoothed loss above and
// d = l1 - l2, per label
//
//     loss = (LS1 + LS2) / 2 + alpha / 4 * sum_j (p1_j - p2_j) d_j
//     d loss / d z1 = (p1 - q) / 2 + alpha / 4 * (p1 (d - sum_j p1_j d_j) + p1 - p2)
//     d loss / d z2 = (p2 - q) / 2 + alpha / 4 * (p2 (sum_j p2_j d_j - d) + p2 - p1)
//
// q = (1 - eps) onehot + eps / vocab. Rows [begin, end) of both (every value by value).
namespace {

template <typename scalar_t>
void rdrop_range(scalar_t* logits1, scalar_t* logits2, const int64_t* labels,
                 const float* mean1, const float* mean2, float* loss, float* nll,
                 int64_t begin, int64_t end, int64_t width, int64_t vocab, float eps,
                 float alpha, bool grad) {
  const float off = eps / static_cast<float>(vocab);
  const float kl = 0.25f * alpha;
  std::vector<float> buf(2 * vocab);
  float* e1 = buf.data();
  float* e2 = e1 + vocab;
  for (int64_t r = begin; r < end; ++r) {
    scalar_t* z1 = logits1 + r * width;
    scalar_t* z2 = logits2 + r * width;
    const int64_t y = labels[r];
    TORCH_CHECK(y >= 0 && y < vocab, "label ", y, " is outside the vocabulary of ", vocab);
    int64_t j;
    KERNEL_LOOP
    for (j = 0; j < vocab; ++j) {
      e1[j] = load(z1[j]);
      e2[j] = load(z2[j]);
    }
    const float top1 = row_max(e1, vocab), top2 = row_max(e2, vocab);
    const float target1 = e1[y], target2 = e2[y];
    float sum1 = 0.f, sum2 = 0.f;
    for (j = 0; j < vocab; ++j) {
      e1[j] = exp_nonpositive(e1[j] - top1);
      sum1 += e1[j];
    }
    for (j = 0; j < vocab; ++j) {
      e2[j] = exp_nonpositive(e2[j] - top2);
      sum2 += e2[j];
    }
    const float lse1 = top1 + std::log(sum1), lse2 = top2 + std::log(sum2);
    const float inv1 = 1.f / sum1, inv2 = 1.f / sum2;
    // d_j = l1_j - l2_j = (z1_j - z2_j) - (lse1 - lse2)
    const float shift = lse1 - lse2;
    float both = 0.f, mean_d1 = 0.f, mean_d2 = 0.f;
    for (j = 0; j < vocab; ++j) {
      const float p1 = e1[j] * inv1, p2 = e2[j] * inv2;
      const float d = load(z1[j]) - load(z2[j]) - shift;
      both += (p1 - p2) * d;
      mean_d1 += p1 * d;
      mean_d2 += p2 * d;
    }
    const float nll1 = lse1 - target1, nll2 = lse2 - target2;
    const float ls1 = lse1 - (1.f - eps) * target1 - eps * mean1[r];
    const float ls2 = lse2 - (1.f - eps) * target2 - eps * mean2[r];
    nll[r] = 0.5f * (nll1 + nll2);
    loss[r] = 0.5f * (ls1 + ls2) + kl * both;
    if (!grad) continue;
    KERNEL_LOOP
    for (j = 0; j < vocab; ++j) {
      const float p1 = e1[j] * inv1, p2 = e2[j] * inv2;
      const float d = load(z1[j]) - load(z2[j]) - shift;
      const float g1 = 0.5f * (p1 - off) + kl * (p1 * (d - mean_d1) + p1 - p2);
      const float g2 = 0.5f * (p2 - off) + kl * (p2 * (mean_d2 - d) + p2 - p1);
      e1[j] = g1;
      e2[j] = g2;
    }
    e1[y] -= 0.5f * (1.f - eps);
    e2[y] -= 0.5f * (1.f - eps);
    KERNEL_LOOP
    for (j = 0; j < vocab; ++j) {
      store(z1 + j, e1[j]);
      store(z2 + j, e2[j]);
    }
    for (j = vocab; j < width; ++j) store(z1 + j, 0.f);
    for (j = vocab; j < width; ++j) store(z2 + j, 0.f);
  }
}

template <typename scalar_t>
void rdrop_rows(scalar_t* logits1, scalar_t* logits2, const int64_t* labels, const float* mean1,
                const float* mean2, float* loss, float* nll, int64_t rows, int64_t width,
                int64_t vocab, float eps, float alpha, bool grad) {
  across_threads(rows, [=](int64_t begin, int64_t end) {
    rdrop_range(logits1, logits2, labels, mean1, mean2, loss, nll, begin, end, width, vocab,
                eps, alpha, grad);
  });
}

}  // namespace

// Writes loss and nll (fp32, one per row pair); with grad, overwrites both rows of logits with
// the loss's gradient with respect to them (in their dtype, rounded once).
void rdrop_softmax_(at::Tensor& logits1, at::Tensor& logits2, const at::Tensor& labels,
                    const at::Tensor& mean1, const at::Tensor& mean2, at::Tensor& loss,
                    at::Tensor& nll, int64_t vocab, double eps, double alpha, bool grad) {
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&logits1, "logits1"},
                         {&logits2, "logits2"}, {&labels, "labels"}, {&mean1, "mean1"},
                         {&mean2, "mean2"}, {&loss, "loss"}, {&nll, "nll"}})
    check_rows(*t, name);
  TORCH_CHECK(logits1.dim() == 2 && logits1.sizes() == logits2.sizes(),
              "logits1 and logits2 must be (rows, width) alike, got ", logits1.sizes(), " and ",
              logits2.sizes());
  TORCH_CHECK(logits1.scalar_type() == logits2.scalar_type(), "logits of two dtypes");
  const int64_t rows = logits1.size(0), width = logits1.size(1);
  TORCH_CHECK(vocab >= 1 && vocab <= width, "vocab ", vocab, " must be in [1, ", width, "]");
  TORCH_CHECK(labels.scalar_type() == at::kLong && labels.numel() == rows,
              "labels must be ", rows, " int64 values");
  for (auto [t, name] : {std::pair<const at::Tensor*, const char*>{&mean1, "mean1"},
                         {&mean2, "mean2"}, {&loss, "loss"}, {&nll, "nll"}})
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->numel() == rows, name, " must be ", rows,
                " float32 values");
  const auto e = static_cast<float>(eps);
  const auto a = static_cast<float>(alpha);
  if (logits1.scalar_type() == at::kBFloat16)
    rdrop_rows(logits1.data_ptr<c10::BFloat16>(), logits2.data_ptr<c10::BFloat16>(),
               labels.data_ptr<int64_t>(), mean1.data_ptr<float>(), mean2.data_ptr<float>(),
               loss.data_ptr<float>(), nll.data_ptr<float>(), rows, width, vocab, e, a, grad);
  else if (logits1.scalar_type() == at::kFloat)
    rdrop_rows(logits1.data_ptr<float>(), logits2.data_ptr<float>(),
               labels.data_ptr<int64_t>(), mean1.data_ptr<float>(), mean2.data_ptr<float>(),
               loss.data_ptr<float>(), nll.data_ptr<float>(), rows, width, vocab, e, a, grad);
  else
    TORCH_CHECK(false, "logits must be float32 or bfloat16, got ", logits1.scalar_type());
}

// ------------------------------------------------------------------------------------------
// Scaled dot-product attention over short sequences, forward and backward
// (aiayn.fast.attention), one (sequence, head) at a time on each thread:
//
//     S = Q K^T / sqrt(d_k)   (masked)     P = softmax(S)     O = Dropout(P) V
//
// Q, K and V are read where the projections wrote them, (B, T, H * d) with any row stride (the
// fused QKV product's columns), and O is written as (B, Tq, H * d_v), the output projection's
// input: eager PyTorch moves every head into (B, H, T, d) and back, casts it to fp32 and back,
// and runs a product per (sequence, head) through the batched GEMM, whose set-up costs more
// than the products when sequences are ~23 tokens long. Scores, softmax and products are fp32
// (bf16 inputs widened exactly); P is kept (fp32) for backward, dropout's mask is drawn again
// from its seed. Dropout follows the keep rule above; bits per (sequence, head, query) row.
// A row with no key allowed (an empty sequence) averages the values, as the eager path's
// lowest-float fill makes it do.

namespace {

// Every product of the pass is a small dense one, C (rows x width) = A (rows x n) B (n x width),
// with rows a multiple of 4 and width one of kLanes (the operands' buffers are padded with
// zeros to those sizes): four rows of C by kLanes columns stay in registers while n runs, each
// row of B loaded once for four rows of A, and nothing is summed across lanes. (The pass first
// took one dot product per (query, key), each ending in a sum across lanes; bench/README.md,
// "attention's products in registers".)
inline void small_product(const float* a, int64_t lda, const float* b, int64_t ldb, float* c,
                          int64_t ldc, int64_t rows, int64_t n, int64_t width) {
  for (int64_t i = 0; i < rows; i += 4) {
    const float* a0 = a + i * lda;
    const float* a1 = a0 + lda;
    const float* a2 = a1 + lda;
    const float* a3 = a2 + lda;
    for (int64_t j = 0; j < width; j += kLanes) {
      Lanes c0 = Lanes{}, c1 = Lanes{}, c2 = Lanes{}, c3 = Lanes{};
      for (int64_t k = 0; k < n; ++k) {
        Lanes bk;
        std::memcpy(&bk, b + k * ldb + j, sizeof bk);
        c0 += a0[k] * bk;
        c1 += a1[k] * bk;
        c2 += a2[k] * bk;
        c3 += a3[k] * bk;
      }
      float* ci = c + i * ldc + j;
      std::memcpy(ci, &c0, sizeof c0);
      std::memcpy(ci + ldc, &c1, sizeof c1);
      std::memcpy(ci + 2 * ldc, &c2, sizeof c2);
      std::memcpy(ci + 3 * ldc, &c3, sizeof c3);
    }
  }
}

inline int64_t round_up(int64_t n, int64_t m) { return (n + m - 1) / m * m; }

// rows x n values of a (B, T, H * n) view, from row pointer ``base`` with row stride ``stride``,
// widened into an fp32 block with row stride ``ld`` (``transposed``: column i of a block with
// row stride ``ld``). Rows from ``real`` on are padding of a packed sequence: zeros.
template <typename scalar_t>
inline void gather_rows(const scalar_t* base, int64_t stride, int64_t rows, int64_t real,
                        int64_t n, float* dst, int64_t ld, bool transposed = false) {
  for (int64_t i = 0; i < rows; ++i) {
    const scalar_t* r = base + i * stride;
    if (i >= real) {
      for (int64_t c = 0; c < n; ++c) (transposed ? dst[c * ld + i] : dst[i * ld + c]) = 0.f;
    } else if (transposed) {
      KERNEL_LOOP
      for (int64_t c = 0; c < n; ++c) dst[c * ld + i] = load(r[c]);
    } else {
      KERNEL_LOOP
      for (int64_t c = 0; c < n; ++c) dst[i * ld + c] = load(r[c]);
    }
  }
}

template <typename scalar_t>
inline void scatter_rows(const float* src, int64_t ld, int64_t rows, int64_t n, scalar_t* base,
                         int64_t stride) {
  for (int64_t i = 0; i < rows; ++i) {
    scalar_t* r = base + i * stride;
    const float* s = src + i * ld;
    KERNEL_LOOP
    for (int64_t c = 0; c < n; ++c) store(r + c, s[c]);
  }
}

struct HeadLayout {  // one (B, T, H * d) operand: data, its batch and row strides
  int64_t batch_stride, row_stride;
};

HeadLayout layout_of(const at::Tensor& t, const char* name, int64_t b, int64_t width) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 3 && t.size(0) == b && t.size(2) == width, name,
              " must be (B, T, ", width, ") with B = ", b, ", got ", t.sizes());
  TORCH_CHECK(t.stride(2) == 1, name, " must have unit stride along its last dimension");
  return {t.stride(0), t.stride(1)};
}

// The 16-bit dropout draws of one (sequence, head, query) row of keys, as in forward_rows.
inline void row_bits(uint64_t seed, int64_t row, int64_t words, uint64_t* bits) {
  const uint64_t base = seed + static_cast<uint64_t>(row * words) * kGolden;
  for (int64_t w = 0; w < words; ++w) bits[w] = mix64(base + static_cast<uint64_t>(w) * kGolden);
}

struct AttentionShape {
  int64_t b, heads, tq, tk, dk, dv;
  bool causal, dropout;
  float scale;  // 1 / sqrt(d_k)
  Keep keep;
  uint64_t seed;
  // Packed queries (and keys and values, for self-attention: kv_packed): sequence b's rows are
  // rows offsets[b] .. offsets[b + 1] of a (N, H * d) operand, at most tq of them, and the
  // output is (N, H * d_v) likewise. The pass computes each sequence as tq rows (tk keys),
  // the rows past its own zeros, and writes back its own rows only. nullptr: (B, T, H * d).
  const int64_t* offsets;
  bool kv_packed;

  int64_t queries(int64_t bi) const { return offsets ? offsets[bi + 1] - offsets[bi] : tq; }
  int64_t keys(int64_t bi) const { return kv_packed ? queries(bi) : tk; }
  int64_t q_start(HeadLayout l, int64_t bi) const {
    return offsets ? offsets[bi] * l.row_stride : bi * l.batch_stride;
  }
  int64_t kv_start(HeadLayout l, int64_t bi) const {
    return kv_packed ? offsets[bi] * l.row_stride : bi * l.batch_stride;
  }
  int64_t out_row(int64_t bi) const { return offsets ? offsets[bi] : bi * tq; }
};

// The padded sizes of one (sequence, head)'s blocks: rows to a multiple of 4 (tq4, tk4),
// columns to one of kLanes (tkl, dkl, dvl).
struct Padded {
  int64_t tq4, tk4, tkl, dkl, dvl;
  explicit Padded(const AttentionShape& s)
      : tq4(round_up(s.tq, 4)), tk4(round_up(s.tk, 4)), tkl(round_up(s.tk, kLanes)),
        dkl(round_up(s.dk, kLanes)), dvl(round_up(s.dv, kLanes)) {}
};

// Dropout's multipliers of one query's row of keys: the keep scale or 0. Without dropout the
// callers keep rows of ones, filled once per thread.
inline void row_keep(const AttentionShape& s, int64_t row, uint64_t* bits, float* m) {
  row_bits(s.seed, row, (s.tk + 3) / 4, bits);
  const int16_t* draw = reinterpret_cast<const int16_t*>(bits);
  for (int64_t j = 0; j < s.tk; ++j) m[j] = draw[j] >= s.keep.threshold ? s.keep.scale : 0.f;
}

// Denormal floats flushed to zero, inputs and results, for as long as it lives (x86; elsewhere
// nothing). A peaked softmax leaves weights near fp32's smallest normal, and their products
// with small values and gradients are denormal, which x86 computes in microcode, far
// slower: on inputs of standard deviation 16 (scores in the hundreds), forward + backward ran
// markedly longer without the flush (bench/README.md, "attention's products in registers").
// What is flushed is below 1.2e-38.
class FlushDenormals {
 public:
#if defined(__SSE__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }  // FTZ | DAZ
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned int saved_;
#endif
};

// Each thread's blocks are zero on allocation and only their unpadded parts are written, so
// the padding stays zero for every (sequence, head) the thread takes.
template <typename scalar_t>
void attention_forward_heads(const scalar_t* q, HeadLayout lq, const scalar_t* k, HeadLayout lk,
                             const scalar_t* v, HeadLayout lv, const bool* mask,
                             scalar_t* out, float* probs, const AttentionShape& s) {
  const Padded z(s);
  at::parallel_for(0, s.b * s.heads, 1, [&](int64_t begin, int64_t end) {
    const FlushDenormals flush;
    std::vector<float> Q(z.tq4 * z.dkl), KT(z.dkl * z.tkl), V(s.tk * z.dvl);
    std::vector<float> S(z.tq4 * z.tkl), W(z.tq4 * s.tk), O(z.tq4 * z.dvl), m(s.tk, 1.f);
    std::vector<uint64_t> bits((s.tk + 3) / 4);
    std::vector<uint8_t> allowed(s.tk);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / s.heads, h = bh % s.heads;
      const int64_t nq = s.queries(b), nk = s.keys(b);
      gather_rows(q + s.q_start(lq, b) + h * s.dk, lq.row_stride, s.tq, nq, s.dk, Q.data(),
                  z.dkl);
      gather_rows(k + s.kv_start(lk, b) + h * s.dk, lk.row_stride, s.tk, nk, s.dk, KT.data(),
                  z.tkl, true);
      gather_rows(v + s.kv_start(lv, b) + h * s.dv, lv.row_stride, s.tk, nk, s.dv, V.data(),
                  z.dvl);
      for (int64_t j = 0; j < s.tk; ++j) allowed[j] = mask == nullptr || mask[b * s.tk + j];
      small_product(Q.data(), z.dkl, KT.data(), z.tkl, S.data(), z.tkl, z.tq4, s.dk, z.tkl);
      for (int64_t i = 0; i < s.tq; ++i) {
        float* p = probs + (bh * s.tq + i) * s.tk;
        const float* si = S.data() + i * z.tkl;
        const int64_t span = s.causal ? i + 1 : s.tk;  // keys past it are out (causal)
        float top = -std::numeric_limits<float>::infinity();
        bool any = false;
        for (int64_t j = 0; j < span; ++j) {
          if (!allowed[j]) continue;
          top = si[j] > top ? si[j] : top;
          any = true;
        }
        if (!any) {  // no key allowed: the mean of all values
          for (int64_t j = 0; j < s.tk; ++j) p[j] = 1.f / static_cast<float>(s.tk);
        } else {
          float sum = 0.f;
          for (int64_t j = 0; j < s.tk; ++j) {
            const float e =
                (j < span && allowed[j]) ? exp_nonpositive((si[j] - top) * s.scale) : 0.f;
            p[j] = e;
            sum += e;
          }
          const float inv = 1.f / sum;
          for (int64_t j = 0; j < s.tk; ++j) p[j] *= inv;
        }
        if (s.dropout) row_keep(s, bh * s.tq + i, bits.data(), m.data());
        float* wi = W.data() + i * s.tk;
        KERNEL_LOOP
        for (int64_t j = 0; j < s.tk; ++j) wi[j] = p[j] * m[j];
      }
      small_product(W.data(), s.tk, V.data(), z.dvl, O.data(), z.dvl, z.tq4, s.tk, z.dvl);
      scatter_rows(O.data(), z.dvl, nq, s.dv, out + s.out_row(b) * s.heads * s.dv + h * s.dv,
                   s.heads * s.dv);
    }
  });
}

// With W = P * M (M dropout's multipliers): dV = W^T dO, dP = (dO V^T) * M,
// dS = P * (dP - rowsum(P * dP)) / sqrt(d_k), dQ = dS K, dK = dS^T Q.
template <typename scalar_t>
void attention_backward_heads(const scalar_t* dout, const scalar_t* q, HeadLayout lq,
                              const scalar_t* k, HeadLayout lk, const scalar_t* v, HeadLayout lv,
                              const bool* mask, const float* probs, scalar_t* dq, HeadLayout ldq,
                              scalar_t* dk,
                              HeadLayout ldk, scalar_t* dv, HeadLayout ldv,
                              const AttentionShape& s) {
  const Padded z(s);
  at::parallel_for(0, s.b * s.heads, 1, [&](int64_t begin, int64_t end) {
    const FlushDenormals flush;
    std::vector<float> Q(s.tq * z.dkl), K(s.tk * z.dkl), VT(z.dvl * z.tkl);
    std::vector<float> dO(z.tq4 * z.dvl), WT(z.tk4 * s.tq), dP(z.tq4 * z.tkl);
    std::vector<float> dS(z.tq4 * s.tk), dST(z.tk4 * s.tq), M(s.tq * s.tk, 1.f);
    std::vector<float> dQ(z.tq4 * z.dkl), dK(z.tk4 * z.dkl), dV(z.tk4 * z.dvl);
    std::vector<uint64_t> bits((s.tk + 3) / 4);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / s.heads, h = bh % s.heads;
      const int64_t nq = s.queries(b), nk = s.keys(b);
      gather_rows(q + s.q_start(lq, b) + h * s.dk, lq.row_stride, s.tq, nq, s.dk, Q.data(),
                  z.dkl);
      gather_rows(k + s.kv_start(lk, b) + h * s.dk, lk.row_stride, s.tk, nk, s.dk, K.data(),
                  z.dkl);
      gather_rows(v + s.kv_start(lv, b) + h * s.dv, lv.row_stride, s.tk, nk, s.dv, VT.data(),
                  z.tkl, true);
      gather_rows(dout + s.out_row(b) * s.heads * s.dv + h * s.dv, s.heads * s.dv, s.tq, nq,
                  s.dv, dO.data(), z.dvl);
      const float* P = probs + bh * s.tq * s.tk;
      for (int64_t i = 0; i < s.tq; ++i) {
        float* mi = M.data() + i * s.tk;
        if (s.dropout) row_keep(s, bh * s.tq + i, bits.data(), mi);
        KERNEL_LOOP
        for (int64_t j = 0; j < s.tk; ++j) WT[j * s.tq + i] = P[i * s.tk + j] * mi[j];
      }
      small_product(WT.data(), s.tq, dO.data(), z.dvl, dV.data(), z.dvl, z.tk4, s.tq, z.dvl);
      small_product(dO.data(), z.dvl, VT.data(), z.tkl, dP.data(), z.tkl, z.tq4, s.dv, z.tkl);
      // A sequence with no key allowed averages the values: its scores were a constant fill,
      // so the queries and keys get no gradient from it (as through masked_fill).
      bool any_key = true;
      if (mask != nullptr)
        any_key = std::any_of(mask + b * s.tk, mask + (b + 1) * s.tk, [](bool a) { return a; });
      for (int64_t i = 0; i < s.tq; ++i) {
        const float* pi = P + i * s.tk;
        const float* mi = M.data() + i * s.tk;
        float* dpi = dP.data() + i * z.tkl;
        float row = 0.f;  // sum_j P_ij dP_ij
        KERNEL_LOOP
        for (int64_t j = 0; j < s.tk; ++j) {
          dpi[j] = pi[j] == 0.f ? 0.f : dpi[j] * mi[j];  // a masked key's weight has no gradient
          row += pi[j] * dpi[j];
        }
        float* dsi = dS.data() + i * s.tk;
        KERNEL_LOOP
        for (int64_t j = 0; j < s.tk; ++j) {
          const float ds = any_key ? pi[j] * (dpi[j] - row) * s.scale : 0.f;
          dsi[j] = ds;
          dST[j * s.tq + i] = ds;
        }
      }
      small_product(dS.data(), s.tk, K.data(), z.dkl, dQ.data(), z.dkl, z.tq4, s.tk, z.dkl);
      small_product(dST.data(), s.tq, Q.data(), z.dkl, dK.data(), z.dkl, z.tk4, s.tq, z.dkl);
      scatter_rows(dQ.data(), z.dkl, nq, s.dk, dq + s.q_start(ldq, b) + h * s.dk,
                   ldq.row_stride);
      scatter_rows(dK.data(), z.dkl, nk, s.dk, dk + s.kv_start(ldk, b) + h * s.dk,
                   ldk.row_stride);
      scatter_rows(dV.data(), z.dvl, nk, s.dv, dv + s.kv_start(ldv, b) + h * s.dv,
                   ldv.row_stride);
    }
  });
}

struct AttentionOperands {
  AttentionShape shape;
  HeadLayout lq, lk, lv;
  const bool* mask;
};

// A packed operand, (N, width): its rows as a (B, T, width) layout whose rows the offsets
// place (the batch stride is not used).
HeadLayout packed_layout_of(const at::Tensor& t, const char* name, int64_t rows,
                            int64_t width) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be on the CPU");
  TORCH_CHECK(t.dim() == 2 && t.size(0) == rows && t.size(1) == width, name,
              " must be packed rows (N, ", width, ") with N = ", rows, ", got ", t.sizes());
  TORCH_CHECK(t.stride(1) == 1, name, " must have unit stride along its last dimension");
  return {0, t.stride(0)};
}

// offsets: empty, or int64 (B + 1) placing each sequence's rows in packed q (and k and v when
// they are 2-D), ``length`` rows at most each (module comment at AttentionShape).
AttentionOperands attention_operands(const at::Tensor& q, const at::Tensor& k,
                                     const at::Tensor& v, const at::Tensor& mask, int64_t heads,
                                     bool causal, bool dropout, int64_t threshold,
                                     double keep_scale, const at::Tensor& seed,
                                     const at::Tensor& offsets, int64_t length) {
  TORCH_CHECK(heads >= 1, "heads must be positive, got ", heads);
  const bool packed = offsets.numel() > 0;
  const bool kv_packed = packed && k.dim() == 2;
  TORCH_CHECK(q.dim() == (packed ? 2 : 3) && k.dim() == (kv_packed ? 2 : 3) && v.dim() == k.dim(),
              packed ? "packed q must be (N, H * d), k and v (N, H * d) or (B, T, H * d)"
                     : "q, k and v must be (B, T, H * d)");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type() &&
                  (q.scalar_type() == at::kFloat || q.scalar_type() == at::kBFloat16),
              "q, k and v must all be float32 or all bfloat16");
  const int64_t wq = q.size(-1), wk = k.size(-1), wv = v.size(-1);
  const int64_t* off = nullptr;
  int64_t b = q.size(0);
  if (packed) {
    check_rows(offsets, "offsets");
    TORCH_CHECK(offsets.scalar_type() == at::kLong && offsets.dim() == 1 && length >= 0,
                "offsets must be int64 (B + 1) and length >= 0");
    b = offsets.numel() - 1;
    off = offsets.data_ptr<int64_t>();
    TORCH_CHECK(off[0] == 0 && off[b] == q.size(0), "offsets must run from 0 to the ",
                q.size(0), " packed rows");
    for (int64_t i = 0; i < b; ++i)
      TORCH_CHECK(off[i + 1] >= off[i] && off[i + 1] - off[i] <= length, "sequence ", i,
                  " has ", off[i + 1] - off[i], " packed rows, not 0 to ", length);
  }
  TORCH_CHECK(wq % heads == 0 && wv % heads == 0 && wk == wq,
              "q and k need H * d_k columns and v H * d_v, for H = ", heads);
  const int64_t tq = packed ? length : q.size(1);
  const int64_t tk = kv_packed ? length : k.size(1);
  AttentionOperands o;
  o.shape = {b, heads, tq, tk, wq / heads, wv / heads, causal, dropout,
             static_cast<float>(1.0 / std::sqrt(static_cast<double>(wq / heads))),
             keep_rule(threshold, keep_scale), 0, off, kv_packed};
  TORCH_CHECK(v.size(0) == k.size(0) && (kv_packed || v.size(1) == k.size(1)),
              "k and v must have as many keys");
  TORCH_CHECK(!causal || tq == tk, "causal attention needs as many queries as keys");
  o.lq = packed ? packed_layout_of(q, "q", q.size(0), wq) : layout_of(q, "q", b, wq);
  o.lk = kv_packed ? packed_layout_of(k, "k", q.size(0), wk) : layout_of(k, "k", b, wk);
  o.lv = kv_packed ? packed_layout_of(v, "v", q.size(0), wv) : layout_of(v, "v", b, wv);
  o.mask = nullptr;
  if (mask.numel() > 0) {
    check_rows(mask, "mask");
    TORCH_CHECK(mask.scalar_type() == at::kBool && mask.dim() == 2 && mask.size(0) == b &&
                    mask.size(1) == tk,
                "mask must be bool (B, Tk) = (", b, ", ", tk, "), got ", mask.sizes());
    o.mask = mask.data_ptr<bool>();
  }
  TORCH_CHECK(seed.device().is_cpu() && seed.scalar_type() == at::kLong && seed.numel() == 1,
              "seed must be one int64 on the CPU");
  o.shape.seed = static_cast<uint64_t>(*seed.data_ptr<int64_t>());
  return o;
}

}  // namespace

// (out, probs): out (B, Tq, H * d_v) in q's dtype, or (N, H * d_v) for packed q (offsets
// not empty), probs (B, H, Tq, Tk) fp32 for backward. mask: bool (B, Tk), True where a key
// is allowed, or an empty tensor for none.
std::vector<at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k,
                                          const at::Tensor& v, const at::Tensor& mask,
                                          int64_t heads, bool causal, bool dropout,
                                          int64_t threshold, double keep_scale,
                                          const at::Tensor& seed, const at::Tensor& offsets,
                                          int64_t length) {
  const auto o = attention_operands(q, k, v, mask, heads, causal, dropout, threshold, keep_scale,
                                    seed, offsets, length);
  const auto& s = o.shape;
  auto out = s.offsets ? at::empty({q.size(0), heads * s.dv}, q.options())
                       : at::empty({s.b, s.tq, heads * s.dv}, q.options());
  auto probs = at::empty({s.b, heads, s.tq, s.tk}, q.options().dtype(at::kFloat));
  if (q.scalar_type() == at::kBFloat16)
    attention_forward_heads(q.data_ptr<c10::BFloat16>(), o.lq, k.data_ptr<c10::BFloat16>(), o.lk,
                            v.data_ptr<c10::BFloat16>(), o.lv, o.mask,
                            out.data_ptr<c10::BFloat16>(), probs.data_ptr<float>(), s);
  else
    attention_forward_heads(q.data_ptr<float>(), o.lq, k.data_ptr<float>(), o.lk,
                            v.data_ptr<float>(), o.lv, o.mask, out.data_ptr<float>(),
                            probs.data_ptr<float>(), s);
  return {out, probs};
}

// Writes the gradients of q, k and v into dq, dk and dv (views of q's, k's and v's shapes and
// dtype, e.g. column ranges of one fused gradient), every element.
void attention_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& mask, const at::Tensor& probs,
                        int64_t heads, bool causal, bool dropout, int64_t threshold,
                        double keep_scale, const at::Tensor& seed, at::Tensor& dq,
                        at::Tensor& dk, at::Tensor& dv, const at::Tensor& offsets,
                        int64_t length) {
  const auto o = attention_operands(q, k, v, mask, heads, causal, dropout, threshold, keep_scale,
                                    seed, offsets, length);
  const auto& s = o.shape;
  const at::Tensor dout = grad_out.to(q.scalar_type()).contiguous();
  TORCH_CHECK(s.offsets ? dout.sizes() == at::IntArrayRef({q.size(0), heads * s.dv})
                        : dout.dim() == 3 && dout.size(0) == s.b && dout.size(1) == s.tq &&
                              dout.size(2) == heads * s.dv,
              "the output's gradient must be the output's shape, got ", dout.sizes());
  check_rows(probs, "probs");
  TORCH_CHECK(probs.scalar_type() == at::kFloat &&
                  probs.sizes() == at::IntArrayRef({s.b, heads, s.tq, s.tk}),
              "probs must be forward's (B, H, Tq, Tk) float32");
  for (auto [t, src, name] : {std::tuple{&dq, &q, "dq"}, {&dk, &k, "dk"}, {&dv, &v, "dv"}})
    TORCH_CHECK(t->sizes() == src->sizes() && t->scalar_type() == src->scalar_type(), name,
                " must match its input's shape and dtype");
  const auto ldq = s.offsets ? packed_layout_of(dq, "dq", q.size(0), q.size(1))
                            : layout_of(dq, "dq", s.b, q.size(2));
  const auto ldk = s.kv_packed ? packed_layout_of(dk, "dk", k.size(0), k.size(1))
                               : layout_of(dk, "dk", s.b, k.size(2));
  const auto ldv = s.kv_packed ? packed_layout_of(dv, "dv", v.size(0), v.size(1))
                               : layout_of(dv, "dv", s.b, v.size(2));
  if (q.scalar_type() == at::kBFloat16)
    attention_backward_heads(dout.data_ptr<c10::BFloat16>(), q.data_ptr<c10::BFloat16>(), o.lq,
                             k.data_ptr<c10::BFloat16>(), o.lk, v.data_ptr<c10::BFloat16>(), o.lv,
                             o.mask, probs.data_ptr<float>(), dq.data_ptr<c10::BFloat16>(), ldq,
                             dk.data_ptr<c10::BFloat16>(), ldk, dv.data_ptr<c10::BFloat16>(), ldv,
                             s);
  else
    attention_backward_heads(dout.data_ptr<float>(), q.data_ptr<float>(), o.lq,
                             k.data_ptr<float>(), o.lk, v.data_ptr<float>(), o.lv, o.mask,
                             probs.data_ptr<float>(), dq.data_ptr<float>(), ldq,
                             dk.data_ptr<float>(), ldk, dv.data_ptr<float>(), ldv, s);
}

// ReLU's gradient in place for a 16-bit ``grad`` and ``out`` (the ReLU's output, >= 0 or
// NaN): zero where out <= 0, as aten::threshold_backward(grad, out, 0), which runs several
// times a plain copy's time on bf16 here (bench/README.md, "the FFN in one function"). On the bits, the gradient is kept where out is a positive int16
// (out > 0, +inf, a positive NaN) or any NaN (its magnitude above the exponent's all-ones):
// NaN <= 0 is false, so aten keeps it too. 16-bit tensors only: fp32 keeps aten's op.
void relu_backward_(at::Tensor& grad, const at::Tensor& out) {
  check_rows(grad, "grad");
  check_rows(out, "out");
  TORCH_CHECK(grad.sizes() == out.sizes() && grad.scalar_type() == out.scalar_type() &&
                  (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kHalf),
              "relu_backward_ takes bf16 or fp16 grad and out of one shape");
  const int16_t nan_above = out.scalar_type() == at::kBFloat16 ? 0x7F80 : 0x7C00;
  int16_t* __restrict g = reinterpret_cast<int16_t*>(grad.data_ptr());
  const int16_t* __restrict h = reinterpret_cast<const int16_t*>(out.data_ptr());
  at::parallel_for(0, grad.numel(), 1 << 16, [&](int64_t begin, int64_t end) {
    KERNEL_LOOP
    for (int64_t i = begin; i < end; ++i) {  // branch-free, so that it vectorizes
      const int16_t b = h[i];
      const int16_t keep = static_cast<int16_t>(
          -static_cast<int16_t>((b > 0) | (static_cast<int16_t>(b & 0x7FFF) > nan_above)));
      g[i] = static_cast<int16_t>(g[i] & keep);
    }
  });
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
  m.def("attention_forward", &attention_forward, "out, probs = attention of short sequences");
  m.def("attention_backward", &attention_backward, "dq, dk, dv written in place");
  m.def("label_smoothed_softmax_", &label_smoothed_softmax_,
        "loss and nll per row; with grad, the logits become their gradient");
  m.def("rdrop_softmax_", &rdrop_softmax_,
        "R-Drop's loss and nll per row pair; with grad, both logits become their gradient");
  m.def("relu_backward_", &relu_backward_, "grad zeroed in place where the ReLU's out <= 0");
  m.def("parallel_threads", &parallel_threads, "threads that at::parallel_for used (tests)");
}
