// Saved states detect corruption (issue 23, class 3). For a saved state of every
// mechanism that has one, fp32 and fp64, after a short prefill (so the data is
// not all zeros): every single-bit flip and every truncation of the bytes is
// refused by load_state and by State::restore with latte::Error naming 'bytes',
// and the state restored into keeps its bytes. States of format 2 (no checksum)
// are refused with a message that says so. And the CRC-32C itself: published
// check values, and the SSE4.2 path agrees with the portable one.
#include <doctest/doctest.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "latte/core/crc32c.hpp"
#include "support.hpp"

namespace test_state_integrity {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;

constexpr index_t kB = 1, kH = 2, kL = 3, kDk = 4, kDv = 2, kWindow = 2, kCapacity = 8;

/// Runs `tokens` tokens of seeded inputs with `features` [B, T, H, F] through
/// `attention`'s forward with `state` (exec::reference).
template <class T, class A, class State, std::size_t N>
void prefill(const A& attention, State& state, std::array<index_t, N> features, index_t out_dim,
             index_t tokens, std::uint64_t seed) {
  Rng rng(seed);
  std::vector<Tensor<T, 4>> inputs;
  for (index_t feature : features)
    inputs.push_back(random_tensor<T, 4>(rng, {kB, tokens, kH, feature}, 0.5));
  Tensor<T, 4> out({kB, tokens, kH, out_dim});
  [&]<std::size_t... I>(std::index_sequence<I...>) {
    attention.forward(exec::reference, inputs[I].cview()..., out.view(), state);
  }(std::make_index_sequence<N>{});
}

/// How the corrupted variants of one saved state fared.
struct Verdicts {
  int cases = 0;
  int accepted = 0;        ///< load_state or restore took the bytes
  int wrong_error = 0;     ///< refused, but not with latte::Error naming 'bytes'
  int target_changed = 0;  ///< restore refused, yet the state's bytes changed
  std::string first_failure;
};

/// Every single-bit flip and every truncation of `bytes` (a valid saved state)
/// through `load` and through `target.restore`.
template <class State, class Load>
Verdicts try_corruptions(const std::vector<std::byte>& bytes, Load&& load, State& target) {
  const std::vector<std::byte> target_before = target.save();
  Verdicts verdicts;
  auto refuses = [&](auto&& call) {
    try {
      call();
    } catch (const Error& error) {
      return error.argument() == "bytes" ? 1 : -1;
    } catch (...) {
      return -1;
    }
    return 0;
  };
  auto attempt = [&](std::span<const std::byte> bad, const std::string& what) {
    ++verdicts.cases;
    const int loaded = refuses([&] { (void)load(bad); });
    const int restored = refuses([&] { target.restore(bad); });
    const bool changed = target.save() != target_before;
    verdicts.accepted += (loaded == 0) + (restored == 0);
    verdicts.wrong_error += (loaded < 0) + (restored < 0);
    verdicts.target_changed += changed;
    if ((loaded != 1 || restored != 1 || changed) && verdicts.first_failure.empty())
      verdicts.first_failure = what + " (load_state " + std::to_string(loaded) + ", restore " +
                               std::to_string(restored) + ", target changed " +
                               std::to_string(changed) + ")";
    if (changed) target.restore(target_before);
  };
  std::vector<std::byte> flipped = bytes;
  for (std::size_t bit = 0; bit < 8 * bytes.size(); ++bit) {
    flipped[bit / 8] ^= std::byte(1u << (bit % 8));
    attempt(flipped, "bit " + std::to_string(bit) + " flipped");
    flipped[bit / 8] ^= std::byte(1u << (bit % 8));
  }
  for (std::size_t length = 0; length < bytes.size(); ++length)
    attempt(std::span(bytes).first(length), "truncated to " + std::to_string(length) + " bytes");
  return verdicts;
}

/// The whole check for one attention and dtype: `make` makes an empty state of
/// it, `features` and `out_dim` are its forward's.
template <class T, class A, class Make, std::size_t N>
void check_integrity(const A& attention, Make&& make, std::array<index_t, N> features,
                     index_t out_dim) {
  auto saved = make();
  prefill<T>(attention, saved, features, out_dim, 5, 1);
  const std::vector<std::byte> bytes = saved.save();
  CHECK(bytes.size() == saved.saved_size());
  auto target = make();  // another content, so an unchanged target is not a coincidence
  prefill<T>(attention, target, features, out_dim, 3, 2);
  REQUIRE(target.save() != bytes);
  auto load = [&](std::span<const std::byte> b) { return attention.template load_state<T>(b); };
  // The valid bytes go through both paths.
  REQUIRE(load(bytes).save() == bytes);
  {
    auto copy = target;
    copy.restore(bytes);
    REQUIRE(copy.save() == bytes);
  }
  const Verdicts v = try_corruptions(bytes, load, target);
  INFO(saved.kind() << ", " << bytes.size() << " bytes; first failure: " << v.first_failure);
  CHECK(v.cases == 9 * static_cast<int>(bytes.size()));
  CHECK(v.accepted == 0);
  CHECK(v.wrong_error == 0);
  CHECK(v.target_changed == 0);
}

template <class T>
void check_every_mechanism() {
  constexpr std::array<index_t, 3> latte_features{kL, kL, kDv};
  constexpr std::array<index_t, 3> qkv{kDk, kDk, kDv};
  {
    const LatteAttention<Causal> a({.heads = kH, .latents = kL, .value_dim = kDv});
    check_integrity<T>(a, [&] { return a.template make_state<T>(kB); }, latte_features, kDv);
  }
  {
    const LatteAttention<Causal, RunningMax, VAPOR> a({.heads = kH, .latents = kL, .value_dim = kDv});
    check_integrity<T>(a, [&] { return a.template make_state<T>(kB); }, latte_features, kDv);
  }
  {
    const SoftmaxAttention<Causal> a({.heads = kH, .key_dim = kDk, .value_dim = kDv});
    check_integrity<T>(a, [&] { return a.template make_state<T>(kB, kCapacity); }, qkv, kDv);
  }
  {
    const SoftmaxAttention<Causal, SlidingWindow> a({.heads = kH, .key_dim = kDk, .value_dim = kDv},
                                                    SlidingWindow{.left = kWindow});
    check_integrity<T>(a, [&] { return a.template make_state<T>(kB); }, qkv, kDv);
  }
  {
    const LatteMacchiato<Causal, RunningMax, VAPOR, RoPE> a(
        {.heads = kH, .latents = kL, .key_dim = kDk, .value_dim = kDv, .window = kWindow});
    check_integrity<T>(a, [&] { return a.template make_state<T>(kB); },
                       std::array<index_t, 5>{kL + 1, kL, kDk, kDk, kDv}, kDv);
  }
  {
    const LinearAttention<Causal, EluPlusOne> a({.heads = kH, .key_dim = kDk, .value_dim = kDv});
    check_integrity<T>(a, [&] { return a.template make_state<T>(kB); }, qkv, kDv);
  }
  {
    const CosFormer<Causal> a({.heads = kH, .key_dim = kDk, .value_dim = kDv},
                              {.reweight = {.length = 64}});
    check_integrity<T>(a, [&] { return a.template make_state<T>(kB); }, qkv, kDv);
  }
  {
    LeaPModule module;
    module.w1 = Tensor<double, 2>({1, kDk}, 0.25);
    module.b1 = Tensor<double, 1>({1}, 0.1);
    module.w2 = Tensor<double, 1>({1}, -0.5);
    module.b2 = 0.2;
    const LeaPformer<Causal> a({.heads = kH, .key_dim = kDk, .value_dim = kDv},
                               {.reweight = {.query_module = module, .key_module = module}});
    check_integrity<T>(a, [&] { return a.template make_state<T>(kB); }, qkv, kDv);
  }
  {
    const LinearAttention<Causal, Relu, NoReweight, RoPE> a(
        {.heads = kH, .key_dim = kDk, .value_dim = kDv});
    check_integrity<T>(a, [&] { return a.template make_state<T>(kB); }, qkv, kDv);
  }
  {
    const Lavo<Causal> a({.heads = kH, .dim = kDk, .bases = 3, .window = kWindow});
    check_integrity<T>(a, [&] { return a.template make_state<T>(kB); },
                       std::array<index_t, 3>{kDk, kDk, kDk}, kDk);
  }
  {
    const ConvCompressedDims dims{
        .heads = kH, .key_dim = kDk, .value_dim = kDv, .group_size = 2, .levels = 2};
    const ConvCompressedAttention<Causal> a(dims, ConvCompressedParams::zeros(dims));
    check_integrity<T>(a, [&] { return a.template make_state<T>(kB, kCapacity); }, qkv, kDv);
  }
}

TEST_CASE("every bit flip and every truncation of a saved state is refused, fp32") {
  check_every_mechanism<float>();
}
TEST_CASE("every bit flip and every truncation of a saved state is refused, fp64") {
  check_every_mechanism<double>();
}

TEST_CASE("a state saved by format 2 (no checksum) is refused, saying why") {
  const LatteAttention<Causal> a({.heads = kH, .latents = kL, .value_dim = kDv});
  auto state = a.make_state<float>(kB);
  prefill<float>(a, state, std::array<index_t, 3>{kL, kL, kDv}, kDv, 4, 3);
  // Format 2 is format 3 without the checksum, magic "latteST2".
  std::vector<std::byte> format2 = state.save();
  format2.resize(format2.size() - 4);
  format2[7] = std::byte{'2'};
  auto target = a.make_state<float>(kB);
  const auto before = target.save();
  for (auto call : {std::function<void()>([&] { (void)a.load_state<float>(format2); }),
                    std::function<void()>([&] { target.restore(format2); })}) {
    try {
      call();
      FAIL("format 2 bytes were accepted");
    } catch (const Error& error) {
      CHECK(error.argument() == "bytes");
      CHECK(std::string(error.what()).find("format 2") != std::string::npos);
      CHECK(std::string(error.what()).find("no checksum") != std::string::npos);
    }
  }
  CHECK(target.save() == before);
}

std::span<const std::byte> as_bytes(std::string_view text) {
  return std::as_bytes(std::span(text.data(), text.size()));
}

TEST_CASE("CRC-32C: published check values (RFC 3720 B.4)") {
  CHECK(crc32c({}) == 0u);
  CHECK(crc32c(as_bytes("123456789")) == 0xE3069283u);
  std::array<std::byte, 32> zeros{}, ones{}, ascending{}, descending{};
  for (std::size_t i = 0; i < 32; ++i) {
    ones[i] = std::byte{0xFF};
    ascending[i] = std::byte(i);
    descending[i] = std::byte(31 - i);
  }
  for (auto crc : {crc32c, detail::crc32c_portable}) {
    CHECK(crc(zeros) == 0x8A9136AAu);
    CHECK(crc(ones) == 0x62A8AB43u);
    CHECK(crc(ascending) == 0x46DD794Eu);
    CHECK(crc(descending) == 0x113FDB5Cu);
  }
}

TEST_CASE("CRC-32C: the SSE4.2 instruction path agrees with the portable tables") {
#if defined(__SSE4_2__)
  Rng rng(7);
  std::vector<std::byte> buffer((1u << 20) + 64);
  for (auto& byte : buffer) byte = std::byte(rng() & 0xFF);
  // Every length 0..300 at every offset 0..7 (all head/tail splits of the
  // 8-byte loop), then a whole MiB.
  int disagreements = 0;
  for (std::size_t offset = 0; offset < 8; ++offset)
    for (std::size_t length = 0; length <= 300; ++length) {
      const auto part = std::span<const std::byte>(buffer).subspan(offset, length);
      disagreements += detail::crc32c_sse42(part) != detail::crc32c_portable(part);
    }
  CHECK(disagreements == 0);
  const auto mib = std::span<const std::byte>(buffer).subspan(3, 1u << 20);
  CHECK(detail::crc32c_sse42(mib) == detail::crc32c_portable(mib));
  CHECK(crc32c(mib) == detail::crc32c_sse42(mib));
#else
  MESSAGE("built without SSE4.2: crc32c is the portable path, checked above");
#endif
}

}  // namespace

}  // namespace test_state_integrity
