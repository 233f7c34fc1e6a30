// latte-cuda-bench: the CUDA kernels of latte on this GPU, one CSV row per run
// with latte-compare's header
//   mechanism,direction,backend,B,T,H,L,D,seconds,tokens_per_s,gflops,extra_bytes
//
//   latte-cuda-bench [--t 1024,4096,...] [--b 1] [--h 8] [--l 64] [--d 64]
//                    [--dtype bf16|fp16|fp32] [--time-cap S]
//
// Timed with CUDA events over repeated calls after a warm-up (median of 5 timed
// batches). FLOP formulas (multiply-add = 2), the same as latte-compare's:
//   latte causal / bidirectional:  4 * B*T*H*L*D
//   softmax causal:                2 * B*H*T*(T+1)/2 * (Dk+Dv)
//   softmax sliding window (w):    2 * B*H*sum_t min(t+1, w+1) * (Dk+Dv)
//   decode step (per token):       latte 4*B*H*L*D; softmax 2*B*H*context*(Dk+Dv)
// extra_bytes: the device workspace the call allocates (stream-ordered).
// backend is latte-cuda-<dtype>.
#include <latte/attention.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

namespace {
using namespace latte;

void check(cudaError_t status, const char* what) { cuda::check(status, what); }

template <class T>
T* device_random(std::size_t count, float low, float high, std::mt19937& rng) {
  std::uniform_real_distribution<float> uniform(low, high);
  std::vector<T> host(count);
  for (auto& x : host) {
    const float value = uniform(rng);
    if constexpr (std::is_same_v<T, float>) x = value;
    else if constexpr (std::is_same_v<T, __half>) x = __float2half_rn(value);
    else x = __float2bfloat16_rn(value);
  }
  T* device = nullptr;
  check(cudaMalloc(reinterpret_cast<void**>(&device), count * sizeof(T)), "cudaMalloc");
  check(cudaMemcpy(device, host.data(), count * sizeof(T), cudaMemcpyHostToDevice), "cudaMemcpy");
  return device;
}

/// Median seconds per call of `call` (timed with events; at least 3 calls per batch).
double time_call(const std::function<void()>& call, double time_cap) {
  cudaEvent_t start, stop;
  check(cudaEventCreate(&start), "cudaEventCreate");
  check(cudaEventCreate(&stop), "cudaEventCreate");
  call();  // warm-up (and first-call setup)
  check(cudaDeviceSynchronize(), "warm-up");
  check(cudaEventRecord(start), "cudaEventRecord");
  call();
  check(cudaEventRecord(stop), "cudaEventRecord");
  check(cudaEventSynchronize(stop), "cudaEventSynchronize");
  float first_ms = 0;
  check(cudaEventElapsedTime(&first_ms, start, stop), "cudaEventElapsedTime");
  const double first = first_ms / 1e3;
  if (first * 3 > time_cap) return first;
  const int repeats = std::max(3, static_cast<int>(std::min(200.0, 0.05 / std::max(first, 1e-7))));
  std::vector<double> batches;
  for (int batch = 0; batch < 5; ++batch) {
    check(cudaEventRecord(start), "cudaEventRecord");
    for (int r = 0; r < repeats; ++r) call();
    check(cudaEventRecord(stop), "cudaEventRecord");
    check(cudaEventSynchronize(stop), "cudaEventSynchronize");
    float ms = 0;
    check(cudaEventElapsedTime(&ms, start, stop), "cudaEventElapsedTime");
    batches.push_back(ms / 1e3 / repeats);
  }
  std::sort(batches.begin(), batches.end());
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  return batches[batches.size() / 2];
}

std::vector<index_t> parse_list(const std::string& text) {
  std::vector<index_t> values;
  std::stringstream stream(text);
  std::string item;
  while (std::getline(stream, item, ',')) values.push_back(std::stoll(item));
  return values;
}

struct Options {
  std::vector<index_t> lengths{1024, 2048, 4096, 8192, 16384, 32768, 65536};
  index_t B = 1, H = 8, L = 64, D = 64, window = 128;
  std::string dtype = "bf16";
  double time_cap = 2.0;
};

void row(const char* mechanism, const char* direction, const Options& o, index_t T,
         double seconds, double flops, double extra_bytes, index_t tokens) {
  std::printf("%s,%s,latte-cuda-%s,%td,%td,%td,%td,%td,%.6e,%.6e,%.3f,%.0f\n", mechanism,
              direction, o.dtype.c_str(), o.B, T, o.H, o.L, o.D, seconds,
              seconds > 0 ? double(tokens) / seconds : 0.0, flops / seconds / 1e9, extra_bytes);
  std::fflush(stdout);
}

template <class T>
void run(const Options& o) {
  std::mt19937 rng(7);
  const index_t B = o.B, H = o.H, L = o.L, D = o.D;
  for (index_t Tn : o.lengths) {
    const std::size_t latent_count = static_cast<std::size_t>(B * Tn * H * L);
    const std::size_t value_count = static_cast<std::size_t>(B * Tn * H * D);
    T* q = device_random<T>(latent_count, -2, 2, rng);
    T* k = device_random<T>(latent_count, -2, 2, rng);
    T* v = device_random<T>(value_count, -1, 1, rng);
    T* out = device_random<T>(value_count, 0, 0, rng);
    const TensorView<const T, 4> qv(q, {B, Tn, H, L}), kv(k, {B, Tn, H, L});
    const TensorView<const T, 4> vv(v, {B, Tn, H, D});
    const TensorView<T, 4> ov(out, {B, Tn, H, D});
    const double latte_flops = 4.0 * B * Tn * H * L * D;
    const auto plan = cuda::plan_latte(B, Tn, H, L, D, cuda::shared_memory_limit());
    const double workspace = double(plan.workspace_floats + B * H * L * (2 + D)) * sizeof(float);
    {
      const LatteAttention<Causal> attention({H, L, D});
      const double s = time_call([&] { attention.forward(exec::cuda, qv, kv, vv, ov); }, o.time_cap);
      row("latte", "causal", o, Tn, s, latte_flops, workspace, B * Tn);
    }
    {
      const LatteAttention<Causal, RunningMax, VAPOR> attention({H, L, D});
      const double s = time_call([&] { attention.forward(exec::cuda, qv, kv, vv, ov); }, o.time_cap);
      row("latte_vapor", "causal", o, Tn, s, latte_flops, workspace, B * Tn);
    }
    {
      const LatteAttention<Bidirectional> attention({H, L, D});
      const double s = time_call([&] { attention.forward(exec::cuda, qv, kv, vv, ov); }, o.time_cap);
      row("latte", "bidirectional", o, Tn, s, latte_flops, workspace, B * Tn);
    }
    // Softmax baseline (Dk = L here so the same q/k buffers serve): O(T^2), capped.
    const double softmax_flops = 2.0 * B * H * (double(Tn) * (Tn + 1) / 2) * (L + D);
    if (Tn <= 16384) {
      const SoftmaxAttention<Causal> attention({H, L, D});
      const double s = time_call([&] { attention.forward(exec::cuda, qv, kv, vv, ov); }, o.time_cap);
      row("softmax", "causal", o, Tn, s, softmax_flops, 0, B * Tn);
    }
    {
      const index_t w = o.window;
      double pairs = 0;
      for (index_t t = 0; t < Tn; ++t) pairs += double(std::min(t + 1, w + 1));
      const SoftmaxAttention<Causal, SlidingWindow> attention({H, L, D}, {w, 0});
      const double s = time_call([&] { attention.forward(exec::cuda, qv, kv, vv, ov); }, o.time_cap);
      row("softmax_window128", "causal", o, Tn, s, 2.0 * B * H * pairs * (L + D), 0, B * Tn);
    }
    // Decode: one Latte step (state O(L D), independent of T) and one KV-cache
    // step over a context of T tokens.
    {
      float *running_max, *normaliser, *memory;
      check(cudaMalloc(reinterpret_cast<void**>(&running_max), B * H * L * sizeof(float)), "cudaMalloc");
      check(cudaMalloc(reinterpret_cast<void**>(&normaliser), B * H * L * sizeof(float)), "cudaMalloc");
      check(cudaMalloc(reinterpret_cast<void**>(&memory), B * H * L * D * sizeof(float)), "cudaMalloc");
      std::vector<float> minus_inf(B * H * L, -__builtin_huge_valf());
      check(cudaMemcpy(running_max, minus_inf.data(), minus_inf.size() * sizeof(float), cudaMemcpyHostToDevice), "cudaMemcpy");
      check(cudaMemset(normaliser, 0, B * H * L * sizeof(float)), "cudaMemset");
      check(cudaMemset(memory, 0, B * H * L * D * sizeof(float)), "cudaMemset");
      const cuda::LatteDeviceCarry carry{running_max, normaliser, memory};
      const TensorView<const T, 3> q1(q, {B, H, L}), k1(k, {B, H, L}), v1(v, {B, H, D});
      const TensorView<T, 3> o1(out, {B, H, D});
      long long position = Tn;
      const double s = time_call(
          [&] { cuda::latte_step<NoPositional>(nullptr, q1, k1, v1, o1, nullptr, position++, carry); },
          o.time_cap);
      row("latte_decode_step", "causal", o, Tn, s, 4.0 * B * H * L * D, 0, B);
      T *keys, *values;
      const index_t capacity = Tn + 1;
      check(cudaMalloc(reinterpret_cast<void**>(&keys), B * H * capacity * L * sizeof(T)), "cudaMalloc");
      check(cudaMalloc(reinterpret_cast<void**>(&values), B * H * capacity * D * sizeof(T)), "cudaMalloc");
      check(cudaMemset(keys, 0, B * H * capacity * L * sizeof(T)), "cudaMemset");
      check(cudaMemset(values, 0, B * H * capacity * D * sizeof(T)), "cudaMemset");
      const cuda::KVDeviceCache<T> cache{keys, values, capacity};
      const float scale = 1.0f / std::sqrt(float(L));
      const double s2 = time_call(
          [&] { cuda::softmax_step(nullptr, q1, k1, v1, o1, cache, scale, Tn, Tn + 1); }, o.time_cap);
      row("softmax_decode_step", "causal", o, Tn, s2, 2.0 * B * H * (Tn + 1) * (L + D), 0, B);
      cudaFree(running_max);
      cudaFree(normaliser);
      cudaFree(memory);
      cudaFree(keys);
      cudaFree(values);
    }
    cudaFree(q);
    cudaFree(k);
    cudaFree(v);
    cudaFree(out);
  }
}

}  // namespace

int main(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string flag = argv[i];
    if (i + 1 >= argc) {
      std::fprintf(stderr, "latte-cuda-bench: %s needs a value\n", flag.c_str());
      return 2;
    }
    const std::string value = argv[++i];
    if (flag == "--t") o.lengths = parse_list(value);
    else if (flag == "--b") o.B = std::stoll(value);
    else if (flag == "--h") o.H = std::stoll(value);
    else if (flag == "--l") o.L = std::stoll(value);
    else if (flag == "--d") o.D = std::stoll(value);
    else if (flag == "--dtype") o.dtype = value;
    else if (flag == "--time-cap") o.time_cap = std::stod(value);
    else {
      std::fprintf(stderr, "latte-cuda-bench: unknown flag %s\n", flag.c_str());
      return 2;
    }
  }
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::fprintf(stderr, "latte-cuda-bench: no CUDA device\n");
    return 77;
  }
  std::printf("mechanism,direction,backend,B,T,H,L,D,seconds,tokens_per_s,gflops,extra_bytes\n");
  try {
    if (o.dtype == "bf16") run<__nv_bfloat16>(o);
    else if (o.dtype == "fp16") run<__half>(o);
    else if (o.dtype == "fp32") run<float>(o);
    else {
      std::fprintf(stderr, "latte-cuda-bench: --dtype bf16|fp16|fp32, given %s\n", o.dtype.c_str());
      return 2;
    }
  } catch (const std::exception& error) {
    std::fprintf(stderr, "latte-cuda-bench: %s\n", error.what());
    return 1;
  }
  return 0;
}
