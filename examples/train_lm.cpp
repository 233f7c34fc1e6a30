// train_lm: a two-layer language model trained with latte's backward on
// multi-query associative recall (MQAR, Arora et al. 2023 "Zoology"; paper 001
// §5.1 trains Latte on it).
//
// The model (pre-norm residual blocks, everything outside the attention layer
// written here with Eigen):
//
//   h = E[token]                                   embedding [V, C]
//   2 x { h += Layer(RMSNorm(h))                    latte's layer, its own backward
//         h += W2 silu(RMSNorm(h) W1 + b1) + b2 }   MLP, hidden 4C
//   logits = RMSNorm(h) W_out                       [C, V], at the query positions only
//   loss = mean cross-entropy of the recalled values
//
// with Layer = latte::MacchiatoLayer<Causal, RGLRU> (paper 000's Latte-RGLRU-SWA:
// the RG-LRU feeds Latte's latent logits, RoPE on the sliding window) or, for the
// baseline, exact softmax attention behind the same RG-LRU mixer
// (AttentionLayer<SoftmaxAttention<Causal>, RGLRU>). AdamW, linear warm-up then
// cosine decay, gradient clipping at norm 1.
//
// The task, generated here and (same seed, same settings) by the Python example,
// so both train on the same data. One SplitMix64 stream per split (train: seed,
// eval: seed ^ 0x5DEECE66D), sequences drawn one after the other; below(n) is
// next() % n. Tokens: 0 = filler, keys 1 .. V/2 - 1, values V/2 .. V - 1. Per
// sequence of T tokens with K pairs:
//   1. keys: a partial Fisher-Yates over [1, 2, ..., V/2 - 1]: for i < K,
//      j = i + below(V/2 - 1 - i), swap(a[i], a[j]); key_i = a[i];
//   2. values: value_i = V/2 + below(V/2), i = 0 .. K-1;
//   3. context: token[2i] = key_i, token[2i + 1] = value_i;
//   4. queries: S = (T - 2K) / 2 slots, Q of them asked (Q = S unless --queries
//      says fewer); for j < Q a partial Fisher-Yates over [0, 1, ..., S - 1]
//      picks slot_j, then pair i = below(K): token[2K + 2 slot_j] = key_i,
//      token[2K + 2 slot_j + 1] = value_i, and the model must predict value_i
//      at position 2K + 2 slot_j (the key), the only positions with a label.
// Accuracy is the fraction of those predictions right (argmax), on a held-out
// set of sequences from the eval stream.
//
//   train_lm [--attention macchiato|softmax] [--steps N] [--tokens T] [--pairs K]
//            [--queries Q] [--batch B] [--vocab V] [--lr R] [--seed S] [--eval-every N]
//            [--eval-sequences N] [--csv FILE] [--check-gradient] [--print-task N]
//
// --check-gradient first compares the whole model's gradient (this file's
// backward plus latte's) with a central difference of the loss along random
// directions, then trains; the run fails if they disagree or the loss does not
// fall. --print-task N prints the first N training sequences (a header line, then
// per sequence its T tokens, " |", its T labels) and exits: tests/golden/mqar_*
// holds such output, which examples/python/mqar.py must reproduce. Plot a CSV (one
// or more) with examples/plot_training.py.
#include "example_support.hpp"

#include <Eigen/Core>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <functional>
#include <numeric>
#include <string_view>
#include <unistd.h>
#include <vector>

namespace {

using latte::index_t;
using Matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using Vector = Eigen::RowVectorXf;

// ------------------------------------------------------------------ data --

struct SplitMix64 {
  std::uint64_t state;
  std::uint64_t next() {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  index_t below(index_t n) { return static_cast<index_t>(next() % static_cast<std::uint64_t>(n)); }
};

struct Task {
  index_t tokens = 256, pairs = 8, vocab = 128;
  index_t queries = 0;  ///< Q; 0: every slot, (T - 2K) / 2
  [[nodiscard]] index_t slots() const { return (tokens - 2 * pairs) / 2; }
  [[nodiscard]] index_t asked() const { return queries == 0 ? slots() : queries; }
};

/// B sequences: tokens [B * T], labels [B * T] (-1 where nothing is asked).
struct Batch {
  std::vector<int> tokens, labels;
};

/// The generator of the file comment, steps 1-4.
void draw_sequence(const Task& task, SplitMix64& rng, int* tokens, int* labels) {
  const index_t T = task.tokens, K = task.pairs, half = task.vocab / 2;
  std::fill(tokens, tokens + T, 0);
  std::fill(labels, labels + T, -1);
  std::vector<int> keys(static_cast<std::size_t>(half - 1)), values(static_cast<std::size_t>(K));
  std::iota(keys.begin(), keys.end(), 1);
  for (index_t i = 0; i < K; ++i) std::swap(keys[i], keys[i + rng.below(half - 1 - i)]);
  for (index_t i = 0; i < K; ++i) values[i] = static_cast<int>(half + rng.below(half));
  for (index_t i = 0; i < K; ++i) {
    tokens[2 * i] = keys[i];
    tokens[2 * i + 1] = values[i];
  }
  const index_t slots = task.slots();
  std::vector<index_t> slot(static_cast<std::size_t>(slots));
  std::iota(slot.begin(), slot.end(), index_t{0});
  for (index_t j = 0; j < task.asked(); ++j) {
    std::swap(slot[j], slot[j + rng.below(slots - j)]);
    const index_t i = rng.below(K), at = 2 * K + 2 * slot[j];
    tokens[at] = keys[i];
    tokens[at + 1] = values[i];
    labels[at] = values[i];
  }
}

Batch draw_batch(const Task& task, SplitMix64& rng, index_t batch) {
  Batch out{std::vector<int>(static_cast<std::size_t>(batch * task.tokens)),
            std::vector<int>(static_cast<std::size_t>(batch * task.tokens))};
  for (index_t b = 0; b < batch; ++b)
    draw_sequence(task, rng, out.tokens.data() + b * task.tokens, out.labels.data() + b * task.tokens);
  return out;
}

// ----------------------------------------------------------------- model --

/// The attention layer's weights and everything around it, for one model; the
/// same struct holds the gradients.
template <class Layer>
struct Parameters {
  struct Block {
    typename Layer::Weights attention;
    Vector norm1, norm2, b1, b2;
    Matrix w1, w2;  // [C, 4C], [4C, C]
  };
  Matrix embedding;  // [V, C]
  std::vector<Block> blocks;
  Vector final_norm;
  Matrix unembed;  // [C, V]
};

/// One parameter tensor: its values, their count, and whether AdamW decays it.
struct Slot {
  float* data;
  index_t size;
  bool decay;
};

/// Every parameter tensor of `p`, in one order, so that the slots of weights,
/// gradients and optimiser moments line up index by index.
template <class Layer>
std::vector<Slot> slots_of(Parameters<Layer>& p) {
  std::vector<Slot> slots;
  const auto add = [&](auto& m, bool decay) { slots.push_back({m.data(), static_cast<index_t>(m.size()), decay}); };
  add(p.embedding, false);
  for (auto& block : p.blocks) {
    for (auto& projection : block.attention.projections) add(projection, true);
    add(block.attention.output, true);
    auto& mixer = block.attention.mixer;  // RG-LRU: gates decay, biases and Lambda do not
    add(mixer.recurrence_gate, true);
    add(mixer.input_gate, true);
    add(mixer.recurrence_bias, false);
    add(mixer.input_bias, false);
    add(mixer.lambda, false);
    add(block.norm1, false);
    add(block.norm2, false);
    add(block.w1, true);
    add(block.b1, false);
    add(block.w2, true);
    add(block.b2, false);
  }
  add(p.final_norm, false);
  add(p.unembed, true);
  return slots;
}

template <class Layer>
Parameters<Layer> zeros_like(const Parameters<Layer>& p, const std::vector<Layer>& layers) {
  Parameters<Layer> z = p;
  for (const Slot& slot : slots_of(z)) std::fill_n(slot.data, slot.size, 0.0f);
  for (std::size_t l = 0; l < layers.size(); ++l) z.blocks[l].attention = layers[l].zero_weights();
  return z;
}

Matrix normal_matrix(SplitMix64& rng, index_t rows, index_t cols, double stddev) {
  std::mt19937_64 engine(rng.next());
  std::normal_distribution<double> normal(0.0, stddev);
  Matrix m(rows, cols);
  for (index_t i = 0; i < m.size(); ++i) m.data()[i] = static_cast<float>(normal(engine));
  return m;
}

template <class Layer>
struct Model {
  typename Layer::attention_type attention;
  index_t vocab, dim, hidden;
  Parameters<Layer> weights;

  Model(typename Layer::attention_type attention_, index_t vocab_, index_t dim_, index_t blocks,
        std::uint64_t seed)
      : attention(std::move(attention_)), vocab(vocab_), dim(dim_), hidden(4 * dim_) {
    SplitMix64 rng{seed};
    weights.embedding = normal_matrix(rng, vocab, dim, 1.0);
    for (index_t l = 0; l < blocks; ++l) {
      typename Parameters<Layer>::Block block;
      // Two statements, not two next() calls in one argument list (whose order C++ leaves open).
      const std::uint64_t mixer_seed = rng.next(), projection_seed = rng.next();
      block.attention = Layer::random_weights(attention, dim, projection_seed,
                                              latte::RGLRU::Weights<float>::initial(dim, mixer_seed));
      block.norm1 = block.norm2 = Vector::Ones(dim);
      block.w1 = normal_matrix(rng, dim, hidden, 1.0 / std::sqrt(double(dim)));
      block.w2 = normal_matrix(rng, hidden, dim, 1.0 / std::sqrt(double(hidden * 2 * blocks)));
      block.b1 = Vector::Zero(hidden);
      block.b2 = Vector::Zero(dim);
      weights.blocks.push_back(std::move(block));
    }
    weights.final_norm = Vector::Ones(dim);
    weights.unembed = normal_matrix(rng, dim, vocab, 1.0 / std::sqrt(double(dim)));
  }

  /// The layers over the current weights (a layer owns a copy of its weights).
  [[nodiscard]] std::vector<Layer> layers() const {
    std::vector<Layer> out;
    for (const auto& block : weights.blocks) out.emplace_back(attention, dim, block.attention);
    return out;
  }
};

// RMSNorm: y = x / rms(x) * g, rms(x) = sqrt(mean(x^2) + eps), row by row.
constexpr float rms_eps = 1e-6f;

void rms_norm(const Matrix& x, const Vector& gain, Matrix& y, Eigen::VectorXf& inverse_rms) {
  inverse_rms = ((x.array().square().rowwise().sum() / float(x.cols())) + rms_eps).rsqrt();
  y = (x.array().colwise() * inverse_rms.array()).rowwise() * gain.array();
}

/// d_x += the RMSNorm backward of d_y; d_gain += sum over rows of d_y * x_hat.
void rms_norm_backward(const Matrix& x, const Vector& gain, const Eigen::VectorXf& inverse_rms,
                       const Matrix& d_y, Matrix& d_x, Vector& d_gain) {
  const Matrix x_hat = x.array().colwise() * inverse_rms.array();
  d_gain += (d_y.array() * x_hat.array()).colwise().sum().matrix();
  const Matrix d_x_hat = d_y.array().rowwise() * gain.array();
  const Eigen::VectorXf mean = (d_x_hat.array() * x_hat.array()).rowwise().sum() / float(x.cols());
  d_x.array() += (d_x_hat.array() - x_hat.array().colwise() * mean.array()).colwise() * inverse_rms.array();
}

float silu(float z) { return z / (1.0f + std::exp(-z)); }
float silu_derivative(float z) {
  const float s = 1.0f / (1.0f + std::exp(-z));
  return s * (1.0f + z * (1.0f - s));
}

latte::TensorView<const float, 3> sequences(const Matrix& m, index_t B, index_t T) {
  return latte::TensorView<const float, 3>(m.data(), {B, T, m.cols()}, {T * m.cols(), m.cols(), 1});
}
latte::TensorView<float, 3> sequences(Matrix& m, index_t B, index_t T) {
  return latte::TensorView<float, 3>(m.data(), {B, T, m.cols()}, {T * m.cols(), m.cols(), 1});
}

struct Result {
  double loss = 0;
  index_t correct = 0, asked = 0;
};

/// Loss and accuracy over `batch`; with `gradients`, the gradient of the mean
/// loss is accumulated into it (+=).
template <class Layer>
Result run(const Model<Layer>& model, const std::vector<Layer>& layers, const Batch& batch, index_t B,
           index_t T, std::type_identity_t<Parameters<Layer>>* gradients) {
  const index_t N = B * T, C = model.dim;
  const auto& w = model.weights;
  struct Saved {
    Matrix h_in, u1, h_mid, u2, z, g;
    Eigen::VectorXf r1, r2;
  };
  std::vector<Saved> saved(layers.size());
  Matrix h(N, C);
  for (index_t i = 0; i < N; ++i) h.row(i) = w.embedding.row(batch.tokens[i]);
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const auto& block = w.blocks[l];
    Saved& s = saved[l];
    s.h_in = h;
    rms_norm(h, block.norm1, s.u1, s.r1);
    Matrix a(N, C);
    layers[l].forward(latte::exec::cpu, sequences(s.u1, B, T), sequences(a, B, T));
    h += a;
    s.h_mid = h;
    rms_norm(h, block.norm2, s.u2, s.r2);
    s.z = (s.u2 * block.w1).rowwise() + block.b1;
    s.g = s.z.unaryExpr(&silu);
    h.noalias() += s.g * block.w2;
    h.rowwise() += block.b2;
  }
  // The head, at the asked positions only.
  std::vector<index_t> asked;
  for (index_t i = 0; i < N; ++i)
    if (batch.labels[i] >= 0) asked.push_back(i);
  const index_t A = static_cast<index_t>(asked.size());
  Matrix h_asked(A, C);
  for (index_t a = 0; a < A; ++a) h_asked.row(a) = h.row(asked[a]);
  Matrix u;
  Eigen::VectorXf r;
  rms_norm(h_asked, w.final_norm, u, r);
  Matrix logits = u * w.unembed;
  Result result;
  result.asked = A;
  for (index_t a = 0; a < A; ++a) {  // softmax in place; loss and argmax on the way
    auto row = logits.row(a);
    index_t best = 0;
    const float top = row.maxCoeff(&best);
    row = (row.array() - top).exp();
    const float sum = row.sum();
    row /= sum;
    const int label = batch.labels[asked[a]];
    result.loss -= std::log(std::max(double(row(label)), 1e-30));
    result.correct += best == label;
  }
  result.loss /= double(A);
  if (gradients == nullptr) return result;

  // Backward. d logits = (p - onehot) / A.
  auto& d = *gradients;
  for (index_t a = 0; a < A; ++a) logits(a, batch.labels[asked[a]]) -= 1.0f;
  logits /= float(A);
  d.unembed.noalias() += u.transpose() * logits;
  const Matrix d_u = logits * w.unembed.transpose();
  Matrix d_h_asked = Matrix::Zero(A, C);
  rms_norm_backward(h_asked, w.final_norm, r, d_u, d_h_asked, d.final_norm);
  Matrix d_h = Matrix::Zero(N, C);
  for (index_t a = 0; a < A; ++a) d_h.row(asked[a]) = d_h_asked.row(a);
  for (std::size_t l = layers.size(); l-- > 0;) {
    const auto& block = w.blocks[l];
    auto& d_block = d.blocks[l];
    Saved& s = saved[l];
    // h_out = h_mid + silu(u2 W1 + b1) W2 + b2
    d_block.w2.noalias() += s.g.transpose() * d_h;
    d_block.b2 += d_h.colwise().sum();
    Matrix d_z = d_h * block.w2.transpose();
    d_z.array() *= s.z.unaryExpr(&silu_derivative).array();
    d_block.w1.noalias() += s.u2.transpose() * d_z;
    d_block.b1 += d_z.colwise().sum();
    const Matrix d_u2 = d_z * block.w1.transpose();
    rms_norm_backward(s.h_mid, block.norm2, s.r2, d_u2, d_h, d_block.norm2);
    // h_mid = h_in + Layer(u1): latte's layer backward gives d_u1 and its weights' gradients.
    Matrix d_u1(N, C);
    const Matrix& d_a = d_h;
    layers[l].backward(latte::exec::cpu, sequences(s.u1, B, T), sequences(d_a, B, T),
                       sequences(d_u1, B, T), &d_block.attention);
    rms_norm_backward(s.h_in, block.norm1, s.r1, d_u1, d_h, d_block.norm1);
  }
  for (index_t i = 0; i < N; ++i) d.embedding.row(batch.tokens[i]) += d_h.row(i);
  return result;
}

// ------------------------------------------------------------- training --

struct Settings {
  std::string attention = "macchiato";
  index_t steps = 2000, batch = 32, eval_every = 100, eval_sequences = 512;
  index_t print_task = 0;  ///< N > 0: print the first N training sequences and exit
  double lr = 3e-3, weight_decay = 0.1;
  std::uint64_t seed = 1;
  std::string csv;
  bool check_gradient = false;
  Task task;
};

/// AdamW (decoupled weight decay), bias-corrected.
template <class Layer>
struct AdamW {
  Parameters<Layer> m, v;
  index_t t = 0;
  void step(Parameters<Layer>& weights, Parameters<Layer>& gradients, double lr, double decay) {
    constexpr double beta1 = 0.9, beta2 = 0.98, eps = 1e-8;
    ++t;
    const double c1 = 1 - std::pow(beta1, double(t)), c2 = 1 - std::pow(beta2, double(t));
    const auto w = slots_of(weights), g = slots_of(gradients), ms = slots_of(m), vs = slots_of(v);
    for (std::size_t k = 0; k < w.size(); ++k)
      for (index_t i = 0; i < w[k].size; ++i) {
        float &mk = ms[k].data[i], &vk = vs[k].data[i], &wk = w[k].data[i];
        const double gk = g[k].data[i];
        mk = float(beta1 * mk + (1 - beta1) * gk);
        vk = float(beta2 * vk + (1 - beta2) * gk * gk);
        if (w[k].decay) wk -= float(lr * decay * wk);
        wk -= float(lr * (mk / c1) / (std::sqrt(vk / c2) + eps));
      }
  }
};

template <class Layer>
double norm_of(Parameters<Layer>& p) {
  double sum = 0;
  for (const Slot& slot : slots_of(p))
    for (index_t i = 0; i < slot.size; ++i) sum += double(slot.data[i]) * slot.data[i];
  return std::sqrt(sum);
}

/// <gradient, direction> against (loss(w + e d) - loss(w - e d)) / 2e along
/// random directions, the whole model at once.
template <class Layer>
bool check_gradient(Model<Layer>& model, const Task& task, std::uint64_t seed) {
  const index_t B = 2, T = task.tokens;
  SplitMix64 rng{seed ^ 0xC0FFEEull};
  const Batch batch = draw_batch(task, rng, B);
  const auto layers = model.layers();
  Parameters<Layer> gradients = zeros_like(model.weights, layers);
  run(model, layers, batch, B, T, &gradients);
  bool ok = true;
  for (int trial = 0; trial < 3; ++trial) {
    Parameters<Layer> direction = zeros_like(model.weights, layers);
    std::mt19937_64 engine(rng.next());
    std::normal_distribution<float> normal(0.0f, 1.0f);
    const auto along = slots_of(direction), g = slots_of(gradients);
    double analytic = 0;
    for (std::size_t k = 0; k < along.size(); ++k)
      for (index_t i = 0; i < along[k].size; ++i) {
        along[k].data[i] = normal(engine);
        analytic += double(g[k].data[i]) * along[k].data[i];
      }
    const double step = 1e-2 / norm_of(direction) * norm_of(model.weights);
    const auto loss_at = [&](double e) {
      Model<Layer> moved = model;
      const auto w = slots_of(moved.weights);
      for (std::size_t k = 0; k < w.size(); ++k)
        for (index_t i = 0; i < w[k].size; ++i) w[k].data[i] += float(e * along[k].data[i]);
      return run(moved, moved.layers(), batch, B, T, nullptr).loss;
    };
    // Richardson: (4 D(e/2) - D(e)) / 3 cancels the e^2 term of the central difference.
    const double d1 = (loss_at(step) - loss_at(-step)) / (2 * step);
    const double d2 = (loss_at(step / 2) - loss_at(-step / 2)) / step;
    const double numeric = (4 * d2 - d1) / 3;
    const double error = std::fabs(numeric - analytic) / std::max(std::fabs(numeric), 1e-3);
    std::printf("gradient check %d: backward %.6e, central difference %.6e, rel. error %.1e\n", trial,
                analytic, numeric, error);
    ok = ok && error < 2e-2;
  }
  return ok;
}

template <class Layer>
int train(typename Layer::attention_type attention, const Settings& s, const char* label) {
  const Task& task = s.task;
  Model<Layer> model(std::move(attention), task.vocab, /*dim=*/64, /*blocks=*/2, s.seed);
  if (s.check_gradient && !check_gradient(model, task, s.seed)) {
    std::fprintf(stderr, "train_lm: the model's gradient disagrees with a central difference\n");
    return 1;
  }
  SplitMix64 train_stream{s.seed}, eval_stream{s.seed ^ 0x5DEECE66Dull};
  const Batch eval = draw_batch(task, eval_stream, s.eval_sequences);
  const auto evaluate = [&](const std::vector<Layer>& layers) {
    Result total;
    const index_t chunk = 64;
    for (index_t first = 0; first < s.eval_sequences; first += chunk) {
      const index_t n = std::min(chunk, s.eval_sequences - first);
      const auto offset = static_cast<std::ptrdiff_t>(first * task.tokens);
      const auto length = static_cast<std::ptrdiff_t>(n * task.tokens);
      const Batch part{{eval.tokens.begin() + offset, eval.tokens.begin() + offset + length},
                       {eval.labels.begin() + offset, eval.labels.begin() + offset + length}};
      const Result r = run(model, layers, part, n, task.tokens, nullptr);
      total.loss += r.loss * double(r.asked);
      total.correct += r.correct;
      total.asked += r.asked;
    }
    total.loss /= double(total.asked);
    return total;
  };
  std::ofstream csv;
  if (!s.csv.empty()) {
    csv.open(s.csv);
    csv << "attention,step,seconds,train_loss,eval_loss,eval_accuracy\n";
  }
  AdamW<Layer> adam{zeros_like(model.weights, model.layers()), zeros_like(model.weights, model.layers())};
  const bool terminal = isatty(fileno(stderr));
  const auto start = std::chrono::steady_clock::now();
  double first_loss = 0, smoothed = 0;
  Result last_eval;
  std::printf("%s: T = %td, %td pairs, vocab %td, batch %td, %td steps\n", label, task.tokens, task.pairs,
              task.vocab, s.batch, s.steps);
  for (index_t step = 1; step <= s.steps; ++step) {
    const auto layers = model.layers();
    const Batch batch = draw_batch(task, train_stream, s.batch);
    Parameters<Layer> gradients = zeros_like(model.weights, layers);
    const Result r = run(model, layers, batch, s.batch, task.tokens, &gradients);
    if (step == 1) first_loss = smoothed = r.loss;
    smoothed = 0.95 * smoothed + 0.05 * r.loss;
    const double norm = norm_of(gradients);
    if (norm > 1.0)  // clip the global norm at 1
      for (const Slot& slot : slots_of(gradients))
        for (index_t i = 0; i < slot.size; ++i) slot.data[i] = float(slot.data[i] / norm);
    const index_t warmup = std::min<index_t>(100, s.steps / 10 + 1);
    const double progress = double(step - warmup) / double(std::max<index_t>(1, s.steps - warmup));
    const double lr = step <= warmup ? s.lr * double(step) / double(warmup)
                                     : s.lr * (0.1 + 0.45 * (1 + std::cos(3.141592653589793 * progress)));
    adam.step(model.weights, gradients, lr, s.weight_decay);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const bool evaluating = step % s.eval_every == 0 || step == s.steps;
    if (evaluating) {
      last_eval = evaluate(model.layers());
      if (csv.is_open())
        csv << label << ',' << step << ',' << seconds << ',' << r.loss << ',' << last_eval.loss << ','
            << double(last_eval.correct) / double(last_eval.asked) << std::endl;  // a curve to plot mid-run
    }
    const double accuracy = last_eval.asked ? double(last_eval.correct) / double(last_eval.asked) : 0.0;
    if (terminal) {  // a progress bar, redrawn in place
      const int width = 30, filled = int(width * step / s.steps);
      std::fprintf(stderr, "\r[%.*s%*s] %5td/%td  loss %.3f  eval acc %5.1f%%  %.0f s ", filled,
                   "##############################", width - filled, "", step, s.steps, smoothed,
                   100 * accuracy, seconds);
      if (step == s.steps) std::fputc('\n', stderr);
    } else if (evaluating) {
      std::printf("step %5td  loss %.4f  eval loss %.4f  eval accuracy %5.1f%%  %.1f s\n", step, smoothed,
                  last_eval.loss, 100 * accuracy, seconds);
    }
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double accuracy = double(last_eval.correct) / double(last_eval.asked);
  std::printf("%s: eval accuracy %.1f%% (%td of %td recalls), eval loss %.4f after %td steps in %.1f s\n",
              label, 100 * accuracy, last_eval.correct, last_eval.asked, last_eval.loss, s.steps, seconds);
  if (!(last_eval.loss < first_loss)) {
    std::fprintf(stderr, "train_lm: the loss did not fall (%.4f -> %.4f)\n", first_loss, last_eval.loss);
    return 1;
  }
  return 0;
}

[[noreturn]] void usage(const char* program) {
  std::fprintf(stderr,
               "usage: %s [--attention macchiato|softmax] [--steps N] [--tokens T] [--pairs K] [--queries Q]\n"
               "          [--batch B]"
               " [--vocab V] [--lr R] [--seed S] [--eval-every N] [--eval-sequences N] [--csv FILE]\n"
               "          [--check-gradient] [--print-task N]\n",
               program);
  std::exit(2);
}

Settings parse(int argc, char** argv) {
  Settings s;
  for (int i = 1; i < argc; ++i) {
    const std::string_view flag = argv[i];
    if (flag == "--check-gradient") {
      s.check_gradient = true;
      continue;
    }
    if (i + 1 >= argc) usage(argv[0]);
    const char* value = argv[++i];
    const auto count = [&] {
      const long n = std::atol(value);
      if (n < 1) usage(argv[0]);
      return static_cast<index_t>(n);
    };
    if (flag == "--attention") s.attention = value;
    else if (flag == "--steps") s.steps = count();
    else if (flag == "--tokens") s.task.tokens = count();
    else if (flag == "--pairs") s.task.pairs = count();
    else if (flag == "--queries") s.task.queries = count();
    else if (flag == "--batch") s.batch = count();
    else if (flag == "--vocab") s.task.vocab = count();
    else if (flag == "--eval-every") s.eval_every = count();
    else if (flag == "--eval-sequences") s.eval_sequences = count();
    else if (flag == "--lr") s.lr = std::atof(value);
    else if (flag == "--seed") s.seed = std::strtoull(value, nullptr, 10);
    else if (flag == "--csv") s.csv = value;
    else if (flag == "--print-task") s.print_task = count();
    else usage(argv[0]);
  }
  const bool fits = s.task.vocab >= 2 * (s.task.pairs + 1) + 2 && s.task.tokens >= 2 * s.task.pairs + 2 &&
                    s.task.asked() <= s.task.slots();
  if (!fits || s.lr <= 0 || (s.attention != "macchiato" && s.attention != "softmax")) {
    std::fprintf(stderr, "train_lm: needs vocab >= 2 (pairs + 1) + 2, tokens >= 2 pairs + 2, queries <= "
                         "(tokens - 2 pairs) / 2, lr > 0, attention macchiato or softmax\n");
    std::exit(2);
  }
  return s;
}

}  // namespace

int main(int argc, char** argv) {
  const Settings s = parse(argc, argv);
  if (s.print_task > 0) {  // the first training sequences, as the train stream draws them
    SplitMix64 train_stream{s.seed};
    const Batch batch = draw_batch(s.task, train_stream, s.print_task);
    std::printf("# train_lm --print-task %td --tokens %td --pairs %td --vocab %td --queries %td --seed %llu\n",
                s.print_task, s.task.tokens, s.task.pairs, s.task.vocab, s.task.asked(),
                static_cast<unsigned long long>(s.seed));
    for (std::size_t b = 0, T = std::size_t(s.task.tokens); b < std::size_t(s.print_task); ++b) {
      for (std::size_t t = 0; t < T; ++t) std::printf("%d ", batch.tokens[b * T + t]);
      std::printf("|");
      for (std::size_t t = 0; t < T; ++t) std::printf(" %d", batch.labels[b * T + t]);
      std::printf("\n");
    }
    return 0;
  }
  // Four heads of 16 features over a 64-wide model, for both attentions.
  if (s.attention == "softmax") {
    using Softmax = latte::SoftmaxAttention<latte::Causal>;
    return train<latte::AttentionLayer<Softmax, latte::RGLRU>>(
        Softmax({.heads = 4, .key_dim = 16, .value_dim = 16}), s, "softmax-rglru");
  }
  // Latte-RGLRU-SWA: 16 latent states per head, a window of 32 tokens with RoPE.
  using Macchiato = latte::LatteMacchiato<latte::Causal, latte::RunningMax, latte::NoPositional, latte::RoPE>;
  return train<latte::MacchiatoLayer<latte::Causal, latte::RGLRU>>(
      Macchiato({.heads = 4, .latents = 16, .key_dim = 16, .value_dim = 16, .window = 32}), s,
      "latte-rglru-swa");
}
