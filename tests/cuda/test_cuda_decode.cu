// Decode steps on the GPU: cuda::latte_step over a device LatteDeviceCarry and
// cuda::softmax_step over a device KV cache, token by token (and after a CUDA
// prefill), against the explicit long-double oracle of the whole sequence.
#include "cuda_test_main.hpp"

#include <cstdio>
#include <limits>

#include "cuda_tolerances.hpp"
#include "oracles/latte_oracle.hpp"
#include "oracles/softmax_oracle.hpp"

namespace {
using namespace latte;
using namespace latte::test;

/// Output row t of a [B, T, H, D] tensor filled from a [B, H, D] device step output.
void store_step(Tensor<float, 4>& whole, index_t t, const Tensor<float, 3>& row) {
  set_time_step(whole, t, row);
}

template <class T, class Pos>
void latte_decode(std::uint64_t seed, long long first_position, index_t prefill) {
  Rng rng(seed);
  const index_t B = 2, Tn = 97, H = 3, L = 9, Dv = 12;
  const auto q = rounded_to<T>(random_tensor<float, 4>(rng, {B, Tn, H, L}, 2.0));
  const auto k = rounded_to<T>(random_tensor<float, 4>(rng, {B, Tn, H, L}, 2.0));
  const auto v = rounded_to<T>(uniform_tensor<float, 4>(rng, {B, Tn, H, Dv}, -1, 1));
  typename Pos::Params params{};
  std::vector<long double> angles_ld;
  if constexpr (Pos::rotates_values) {
    params.angles = uniform_tensor<double, 2>(rng, {H, Dv / 2}, 0.01, 1.0);
    for (index_t i = 0; i < params.angles.size(); ++i) angles_ld.push_back(params.angles.data()[i]);
  }
  const auto table = Pos::resolve_angles(params, H, Dv);
  DeviceArray<double> theta(table.size());
  if (!table.empty()) theta.upload(table);

  DeviceArray<float> running_max(B * H * L), normaliser(B * H * L), memory(B * H * L * Dv);
  running_max.upload(std::vector<float>(B * H * L, -std::numeric_limits<float>::infinity()));
  normaliser.fill_bytes(0);
  memory.fill_bytes(0);
  const cuda::LatteDeviceCarry carry{running_max.data(), normaliser.data(), memory.data()};

  Tensor<float, 4> whole(v.extents());
  if (prefill > 0) {
    const DeviceTensor<T, 4> qd(time_slice(q, 0, prefill)), kd(time_slice(k, 0, prefill)),
        vd(time_slice(v, 0, prefill));
    DeviceTensor<T, 4> od(vd.extents);
    cuda::latte_forward<true, Pos>(nullptr, qd.cview(), kd.cview(), vd.cview(), od.view(), table,
                                   first_position, carry);
    const auto host = od.to_host();
    for (index_t t = 0; t < prefill; ++t) store_step(whole, t, time_step(host, t));
  }
  for (index_t t = prefill; t < Tn; ++t) {
    const DeviceTensor<T, 3> qt(time_step(q, t)), kt(time_step(k, t)), vt(time_step(v, t));
    DeviceTensor<T, 3> ot(vt.extents);
    cuda::latte_step<Pos>(nullptr, qt.cview(), kt.cview(), vt.cview(), ot.view(),
                          table.empty() ? nullptr : theta.data(), first_position + t, carry);
    store_step(whole, t, ot.to_host());
  }
  synchronize();
  const double error = relative_error(whole, latte_oracle(true, q, k, v, angles_ld));
  CHECK_MESSAGE(error <= CudaTolerance<T>::relative,
                Pos::name << " first position " << first_position << " prefill " << prefill
                          << " error " << error);
  std::printf("[cuda decode] Latte %-13s %-8s first=%lld prefill=%lld max_rel_error=%.3e\n",
              Pos::name, cuda::element_name<T>(), first_position, static_cast<long long>(prefill),
              error);
}

template <class T>
void softmax_decode(std::uint64_t seed, index_t window_left) {
  Rng rng(seed);
  const index_t B = 2, Tn = gpu_or_emulated(300, 60), H = 3, Dk = 16, Dv = 40;
  const auto q = rounded_to<T>(random_tensor<float, 4>(rng, {B, Tn, H, Dk}, 1.0));
  const auto k = rounded_to<T>(random_tensor<float, 4>(rng, {B, Tn, H, Dk}, 1.0));
  const auto v = rounded_to<T>(uniform_tensor<float, 4>(rng, {B, Tn, H, Dv}, -1, 1));
  const index_t capacity = window_left >= 0 ? window_left + 1 : Tn;
  DeviceArray<T> keys(B * H * capacity * Dk), values(B * H * capacity * Dv);
  const cuda::KVDeviceCache<T> cache{keys.data(), values.data(), capacity};
  const float scale = 1.0f / std::sqrt(float(Dk));
  Tensor<float, 4> whole(v.extents());
  for (index_t t = 0; t < Tn; ++t) {
    const DeviceTensor<T, 3> qt(time_step(q, t)), kt(time_step(k, t)), vt(time_step(v, t));
    DeviceTensor<T, 3> ot(vt.extents);
    const long long visible = std::min<long long>(t + 1, capacity);
    cuda::softmax_step(nullptr, qt.cview(), kt.cview(), vt.cview(), ot.view(), cache, scale, t,
                       visible);
    store_step(whole, t, ot.to_host());
  }
  synchronize();
  const MaskSpec mask{.causal = true, .left = window_left};
  const double error =
      relative_error(whole, softmax_oracle(mask, 1.0L / std::sqrt((long double)Dk), q, k, v));
  CHECK_MESSAGE(error <= CudaTolerance<T>::relative, "window left " << window_left);
  std::printf("[cuda decode] softmax KV cache %-8s left=%lld max_rel_error=%.3e\n",
              cuda::element_name<T>(), static_cast<long long>(window_left), error);
}

}  // namespace

TEST_CASE("cuda Latte decode steps == oracle") {
  latte_decode<float, NoPositional>(3101, 0, 0);
  latte_decode<float, NoPositional>(3102, 0, 40);
  latte_decode<float, VAPOR>(3103, 0, 0);
  latte_decode<float, VAPOR>(3104, 9'999'000, 65);
  latte_decode<__half, VAPOR>(3105, 1'000'003, 30);
  latte_decode<__nv_bfloat16, NoPositional>(3106, 0, 30);
}

TEST_CASE("cuda softmax KV-cache decode steps == oracle") {
  softmax_decode<float>(3201, -1);
  softmax_decode<float>(3202, 0);
  softmax_decode<float>(3203, 37);
  softmax_decode<__half>(3204, -1);
  softmax_decode<__nv_bfloat16>(3205, 37);
}
