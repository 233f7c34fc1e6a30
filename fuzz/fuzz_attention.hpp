// The libFuzzer harness behind fuzz_attention (fuzz_attention.cpp is its entry point;
// fuzz_attention_{float,double}.cpp instantiate it per dtype, so the two compile in parallel).
//
// It drives latte's validation layer and its reference and cpu backends.
//
// The input bytes decode into one call sequence: a mechanism and its policies,
// the direction, a dtype, sizes (small, sometimes 0 or negative), one layout per
// tensor argument (contiguous, padded, permuted, broadcast, and invalid ones:
// overlapping output elements, negative strides, a strided feature dimension,
// null data, mismatched or huge extents, an output that aliases an input),
// parameters (windows, M, r, leap_factor, levels, scales, angles) and
// values (normal, wide spreads, inf / NaN / huge, raw bit patterns). Causal
// mechanisms then go through make_state, forward(..., state), step, save and
// load_state / restore of intact, truncated and corrupted bytes (half of the
// edited buffers re-signed with a valid CRC-32C, so the checks behind it run).
//
// Every input must end in one of two ways: a latte::Error, or a normal return.
// Anything else stops the run: a crash or a sanitizer report, another exception
// type, an output that aliases an input or addresses an element twice and was
// accepted, a saved state that does not reload to the same bytes, or a
// non-finite output where the math is finite (finite, moderate inputs to a
// mechanism whose every output is a weighted mean of finite values).
//
// Every buffer the harness hands over is exactly as long as the view that
// addresses it, so AddressSanitizer sees any access outside a view; a view too
// large for the harness to back is built so that validation must refuse it.
// Sizes that only latte allocates from (batch, heads, windows, KV-cache and
// context capacities, levels) are not capped: they reach latte up to 2^62 and
// past it, and memory_cap.hpp bounds what is really allocated, so a product of
// sizes that overflows must be a latte::Error and one that fits but exceeds the
// memory cap may also be std::bad_alloc.
#pragma once
#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <iterator>
#include <new>
#include <limits>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "latte/attention.hpp"
#include "memory_cap.hpp"
#include "../tests/half_shadow.hpp"
#include "../tests/state_bytes.hpp"

namespace latte_fuzz {

using latte::index_t;
using latte::TensorView;

/// The most elements one of the harness's own buffers (behind a view) may hold:
/// a view needing more is built so that validation must refuse it (see Fuzz::layout).
constexpr index_t kMaxElements = index_t{1} << 15;

/// The input's dtype, direction and common sizes, for fail()'s message.
inline std::string current_input;

[[noreturn]] inline void fail(const std::string& what) {
  std::fprintf(stderr, "fuzz_attention: %s (%s)\n", what.c_str(), current_input.c_str());
  std::fflush(stderr);
  std::abort();
}

/// What the harness knows about the values it wrote into one tensor.
struct ValueStats {
  bool finite = true;
  double max_abs = 0;
  [[nodiscard]] bool moderate(double bound) const { return finite && max_abs <= bound; }
};

/// A view's extents and strides, and the elements a buffer needs for it.
template <std::size_t N>
struct Layout {
  std::array<index_t, N> extents{}, strides{};
  index_t span = 1;          ///< elements allocated (>= 1)
  bool valid = true;         ///< extents >= 0, strides >= 0, last stride 1 where it matters, not null
  bool distinct = true;      ///< every index addresses its own element
  bool null_data = false;
  bool oversized = false;    ///< extents too large to back with memory: must be refused
};

/// One tensor argument: a buffer exactly as long as its layout needs.
template <class T, std::size_t N>
struct Argument {
  Layout<N> layout;
  std::shared_ptr<T[]> buffer;  // shared: an aliasing output points into an input's buffer
  index_t buffer_elements = 0;
  index_t offset = 0;
  ValueStats stats;
  [[nodiscard]] T* data() const { return layout.null_data ? nullptr : buffer.get() + offset; }
  [[nodiscard]] TensorView<T, N> view() const {
    return TensorView<T, N>(data(), layout.extents, layout.strides);
  }
  [[nodiscard]] TensorView<const T, N> cview() const { return view(); }
};

/// Brute force: the sorted offsets of the elements `layout` addresses, plus `base`
/// (none for an empty view; the layout must be small enough to enumerate).
template <std::size_t N>
std::vector<index_t> element_offsets(const Layout<N>& layout, index_t base = 0) {
  index_t count = 1;
  for (index_t e : layout.extents) count *= std::max<index_t>(e, 0);
  std::vector<index_t> offsets;
  offsets.reserve(static_cast<std::size_t>(count));
  std::array<index_t, N> at{};
  for (index_t i = 0; i < count; ++i) {
    index_t offset = base;
    for (std::size_t d = 0; d < N; ++d) offset += at[d] * layout.strides[d];
    offsets.push_back(offset);
    for (std::size_t d = N; d-- > 0;) {
      if (++at[d] < layout.extents[d]) break;
      at[d] = 0;
    }
  }
  std::sort(offsets.begin(), offsets.end());
  return offsets;
}

/// Does `layout` address each of its elements once? (Independent of the
/// library's stride-sorting check.)
template <std::size_t N>
bool addresses_distinct(const Layout<N>& layout) {
  const auto offsets = element_offsets(layout);
  return std::adjacent_find(offsets.begin(), offsets.end()) == offsets.end();
}

class Fuzz {
 public:
  explicit Fuzz(const std::uint8_t* data, std::size_t size)
      : in_(data, size), rng_(in_.ConsumeIntegral<std::uint64_t>()) {}

  FuzzedDataProvider& in() { return in_; }
  bool coin(int one_in) { return in_.ConsumeIntegralInRange<int>(0, one_in - 1) == 0; }
  template <class V>
  V pick(std::initializer_list<V> values) {
    const auto i = in_.ConsumeIntegralInRange<std::size_t>(0, values.size() - 1);
    return *(values.begin() + i);
  }

  /// A size that shapes tensors (B, T, H, L, Dk, Dv, d, r): usually in [low, high],
  /// sometimes 0 or negative, rarely huge (views it makes too large to back are
  /// refused by construction; states, tables and empty views are not).
  index_t size(index_t low, index_t high) {
    switch (in_.ConsumeIntegralInRange<int>(0, 31)) {
      case 0: case 1: return 0;
      case 2: case 3: return pick<index_t>({-1, -7, std::numeric_limits<index_t>::min()});
      case 4: return huge();
      default: return in_.ConsumeIntegralInRange<index_t>(low, high);
    }
  }
  /// A size past any memory: 2^31 to 2^62 and the int64 limit.
  index_t huge() {
    return pick<index_t>({index_t{1} << 31, index_t{1} << 40, index_t{1} << 62,
                          (index_t{1} << 62) - 1, std::numeric_limits<index_t>::max() - 1,
                          std::numeric_limits<index_t>::max()});
  }
  /// A parameter that shapes no tensor (windows, M, levels, leap_factor): as
  /// size(), and sometimes huge.
  index_t parameter(index_t low, index_t high) {
    if (coin(12)) return huge();
    return size(low, high);
  }

  /// Extents for one argument: `expected`, or (rarely) that with one dimension changed.
  template <std::size_t N>
  std::array<index_t, N> extents(std::array<index_t, N> expected) {
    if (!coin(10)) return expected;
    const auto d = in_.ConsumeIntegralInRange<std::size_t>(0, N - 1);
    index_t changed = 0;
    switch (in_.ConsumeIntegralInRange<int>(0, 5)) {
      case 0: if (!__builtin_add_overflow(expected[d], 1, &changed)) expected[d] = changed; break;
      case 1: if (!__builtin_sub_overflow(expected[d], 1, &changed)) expected[d] = changed; break;
      case 2: expected[d] = 0; break;
      case 3: expected[d] = expected[d] > 0 ? -expected[d] : -1; break;
      case 4: expected[d] = in_.ConsumeIntegralInRange<index_t>(0, 40); break;
      default:  // at most one huge extent per call, so two arguments never agree on it
        if (!huge_given_) {
          huge_given_ = true;
          expected[d] = pick<index_t>({index_t{1} << 33, index_t{1} << 45,
                                       std::numeric_limits<index_t>::max() / 64});
        }
    }
    return expected;
  }

  /// A layout for extents (strides, span), drawn from valid and invalid kinds.
  template <std::size_t N>
  Layout<N> layout(const std::array<index_t, N>& extents) {
    Layout<N> layout;
    layout.extents = extents;
    contiguous(layout);
    const int kind = in_.ConsumeIntegralInRange<int>(0, 15);
    const auto d = in_.ConsumeIntegralInRange<std::size_t>(0, N - 1);
    const auto outer = N > 1 ? in_.ConsumeIntegralInRange<std::size_t>(0, N - 2) : 0;
    switch (kind) {
      case 8: {  // padded: every outer stride spans more than its inner block
        index_t stride = 1;
        for (std::size_t i = N; i-- > 0;) {
          layout.strides[i] = stride;
          stride = stride * std::clamp<index_t>(extents[i], 1, kMaxElements) +
                   (i ? in_.ConsumeIntegralInRange<index_t>(0, 3) : 0);
        }
        break;
      }
      case 9: {  // the outer dimensions in another order ([T, B, H, D] in memory, ...)
        std::array<std::size_t, N> order{};
        for (std::size_t i = 0; i < N; ++i) order[i] = i;
        if (N > 2) std::swap(order[0], order[in_.ConsumeIntegralInRange<std::size_t>(1, N - 2)]);
        index_t stride = 1;
        for (std::size_t i = N; i-- > 0;) {
          layout.strides[order[i]] = stride;
          stride *= std::clamp<index_t>(extents[order[i]], 1, kMaxElements);
        }
        break;
      }
      case 10:  // broadcast along an outer dimension (valid for inputs only)
        if (N > 1) layout.strides[outer] = 0;
        break;
      case 11:  // an outer stride smaller than the block it steps over
        if (N > 1 && layout.strides[outer] > 1)
          layout.strides[outer] = in_.ConsumeIntegralInRange<index_t>(1, layout.strides[outer] - 1);
        break;
      case 12: layout.strides[d] = -1 - in_.ConsumeIntegralInRange<index_t>(0, 3); break;
      case 13: layout.strides[N - 1] = pick<index_t>({0, 2, 3}); break;
      case 14: layout.null_data = true; break;
      default: break;  // contiguous
    }
    finish(layout);
    return layout;
  }

  /// Fills `count` values at the elements `layout` addresses.
  template <class T>
  ValueStats fill(T* data, index_t span, int mode, double scale) {
    ValueStats stats;
    std::normal_distribution<double> normal(0.0, scale);
    std::uniform_real_distribution<double> uniform(-scale, scale);
    const T specials[] = {std::numeric_limits<T>::quiet_NaN(),
                          std::numeric_limits<T>::infinity(),
                          -std::numeric_limits<T>::infinity(),
                          std::numeric_limits<T>::max(),
                          -std::numeric_limits<T>::max(),
                          std::numeric_limits<T>::denorm_min(),
                          T(0),
                          T(-0.0),
                          static_cast<T>(1e30)};
    for (index_t i = 0; i < span; ++i) {
      T value;
      switch (mode) {
        case 0: value = static_cast<T>(normal(rng_)); break;
        case 1: value = static_cast<T>(uniform(rng_)); break;
        case 2:
          value = (rng_() % 8 == 0) ? specials[rng_() % std::size(specials)]
                                    : static_cast<T>(normal(rng_));
          break;
        default: {  // raw bit patterns
          std::uint64_t bits = rng_();
          std::memcpy(&value, &bits, sizeof(T));
        }
      }
      data[i] = value;
      if (!std::isfinite(value)) stats.finite = false;
      else stats.max_abs = std::max(stats.max_abs, std::fabs(static_cast<double>(value)));
    }
    return stats;
  }

  /// A value mode and scale for the tensors of one call.
  struct Values {
    int mode;
    double scale;
  };
  Values values() {
    return {in_.ConsumeIntegralInRange<int>(0, 9) < 7 ? in_.ConsumeIntegralInRange<int>(0, 1)
                                                       : in_.ConsumeIntegralInRange<int>(2, 3),
            pick<double>({0.5, 1.0, 3.0, 30.0, 1e3, 1e4})};
  }

  /// Input arguments of `expected` extents and an output; the output may alias an input.
  template <class T, std::size_t N>
  struct Call {
    std::vector<Argument<T, N>> inputs;
    Argument<T, N> out;
    int aliased = -1;  ///< the input the output's buffer overlaps, or -1
  };
  template <class T, std::size_t N>
  Call<T, N> call(const std::vector<std::array<index_t, N>>& input_extents,
                  const std::array<index_t, N>& out_extents, const Values& values) {
    Call<T, N> call;
    for (const auto& expected : input_extents) {
      Argument<T, N> argument;
      argument.layout = layout(extents(expected));
      argument.buffer_elements = argument.layout.span;
      call.inputs.push_back(std::move(argument));
    }
    call.out.layout = layout(extents(out_extents));
    call.out.buffer_elements = call.out.layout.span;
    if (!call.inputs.empty() && coin(12)) {  // the output lies in an input's buffer
      const auto j = in_.ConsumeIntegralInRange<std::size_t>(0, call.inputs.size() - 1);
      Argument<T, N>& input = call.inputs[j];
      const auto gap = coin(2) ? interleave(input.layout, call.out.layout) : std::nullopt;
      call.out.offset = gap ? *gap : in_.ConsumeIntegralInRange<index_t>(0, input.layout.span - 1);
      // interleave() re-strides the input too: its buffer follows its new span.
      input.buffer_elements = std::max(input.layout.span, call.out.offset + call.out.layout.span);
      call.aliased = static_cast<int>(j);
    }
    for (auto& input : call.inputs) {
      input.buffer = std::shared_ptr<T[]>(new T[static_cast<std::size_t>(input.buffer_elements)]);
      input.stats = fill(input.buffer.get(), input.buffer_elements, values.mode, values.scale);
    }
    if (call.aliased >= 0) {
      call.out.buffer = call.inputs[static_cast<std::size_t>(call.aliased)].buffer;
    } else {
      call.out.buffer = std::shared_ptr<T[]>(new T[static_cast<std::size_t>(call.out.buffer_elements)]);
      // Poison the output: a kernel that leaves an element unwritten shows as NaN.
      std::fill_n(call.out.buffer.get(), call.out.buffer_elements, std::numeric_limits<T>::quiet_NaN());
    }
    return call;
  }

  /// Bytes for load_state / restore: `saved` intact, truncated, extended or corrupted.
  std::vector<std::byte> corrupt(std::vector<std::byte> bytes) {
    switch (in_.ConsumeIntegralInRange<int>(0, 7)) {
      case 0: bytes.resize(in_.ConsumeIntegralInRange<std::size_t>(0, bytes.size())); break;
      case 1: bytes.push_back(std::byte{0}); break;
      case 2:
      case 3: {  // a few bytes overwritten (header, sizes, counts or data)
        const int flips = in_.ConsumeIntegralInRange<int>(1, 4);
        for (int i = 0; i < flips && !bytes.empty(); ++i) {
          const std::size_t at = rng_() % std::min<std::size_t>(bytes.size(), coin(2) ? 160 : bytes.size());
          bytes[at] = static_cast<std::byte>(in_.ConsumeIntegral<std::uint8_t>());
        }
        break;
      }
      case 4: {  // random bytes
        bytes.resize(in_.ConsumeIntegralInRange<std::size_t>(0, 512));
        for (auto& b : bytes) b = static_cast<std::byte>(rng_());
        break;
      }
      default: return bytes;  // intact
    }
    // Half of the edited buffers get a valid CRC-32C trailer again, so the
    // loaders' structural and content checks behind the checksum are reached.
    if (bytes.size() >= 12 && coin(2)) latte::test::resign(bytes);
    return bytes;
  }

 private:
  /// Lays `a` and `b` out in one buffer, interleaved along an outer dimension
  /// (a's rows at even slots, b's at odd ones: the byte ranges overlap, no
  /// element is shared); returns b's offset, or nullopt for views it cannot take.
  template <std::size_t N>
  std::optional<index_t> interleave(Layout<N>& a, Layout<N>& b) {
    static_assert(N >= 2);
    for (const Layout<N>* l : {&a, &b})
      if (!l->valid || l->oversized || l->null_data || !l->distinct || l->span <= 1) return std::nullopt;
    const auto d = in_.ConsumeIntegralInRange<std::size_t>(0, N - 2);
    index_t block = 1;
    for (Layout<N>* l : {&a, &b}) {  // dimensions inside d: contiguous
      index_t stride = 1;
      for (std::size_t i = N; i-- > d + 1;) {
        l->strides[i] = stride;
        stride *= l->extents[i];
      }
      block = std::max(block, stride);
    }
    index_t stride = 2 * block;
    for (std::size_t i = d + 1; i-- > 0;) {  // d and outside it: shared, every slot doubled
      a.strides[i] = b.strides[i] = stride;
      stride *= std::max(a.extents[i], b.extents[i]);
    }
    finish(a);
    finish(b);
    return block;
  }

  template <std::size_t N>
  static void contiguous(Layout<N>& layout) {
    index_t stride = 1;
    for (std::size_t i = N; i-- > 0;) {
      layout.strides[i] = stride;
      stride *= std::max<index_t>(1, std::min<index_t>(layout.extents[i], kMaxElements));
    }
  }

  /// Span, validity and distinctness; a view of more than kMaxElements elements
  /// (or spanning more) is backed by one element and must be refused.
  template <std::size_t N>
  void finish(Layout<N>& layout) {
    bool empty = false, negative = false;
    for (std::size_t d = 0; d < N; ++d) {
      negative = negative || layout.extents[d] < 0 || layout.strides[d] < 0;
      empty = empty || layout.extents[d] <= 0;
    }
    double span = 1, elements = 1;
    for (std::size_t d = 0; d < N; ++d) elements *= std::max(0.0, double(layout.extents[d]));
    for (std::size_t d = 0; d < N; ++d)
      span += std::max(0.0, double(layout.extents[d]) - 1) *
              double(std::max<index_t>(0, layout.strides[d]));
    layout.valid = !negative && !(layout.null_data && !empty) &&
                   !(layout.extents[N - 1] > 1 && layout.strides[N - 1] != 1);
    if (empty || negative) {
      layout.span = 1;
    } else if (span > double(kMaxElements) || elements > double(kMaxElements)) {
      // Too large to back with memory. Such a view may still be a valid call
      // (large padded strides), which latte cannot tell from a raw pointer and
      // would run on the 1-element buffer: give it a negative leading extent so
      // that the call is invalid whatever else it is, and must be refused.
      layout.span = 1;
      layout.oversized = true;
      layout.extents[0] = -1;
      layout.valid = false;
    } else {
      layout.span = static_cast<index_t>(span);
    }
    layout.distinct = empty || negative || layout.oversized || addresses_distinct(layout);
  }

  FuzzedDataProvider in_;
  std::mt19937_64 rng_;
  bool huge_given_ = false;
};

// ------------------------------------------------------------------ oracles --

/// A call that returned: what validation must have refused, and finiteness.
/// The aliasing rule: an output in an input's buffer must be refused when some
/// output element shares a byte with some input element (one dtype, so: the same
/// element offset); interleaved, it is valid. Brute force over the small buffers.
/// (Before issue 23 class 4 latte refused any overlap of the two byte ranges.)
template <class T, std::size_t N>
bool must_refuse_aliasing(const Argument<T, N>& out, const Argument<T, N>& input) {
  auto elements = [](const Argument<T, N>& a) {
    const Layout<N>& l = a.layout;
    const bool none = l.oversized || l.null_data ||
                      std::any_of(l.extents.begin(), l.extents.end(), [](index_t e) { return e <= 0; });
    return none ? std::vector<index_t>{} : element_offsets(l, a.offset);
  };
  const auto written = elements(out), read = elements(input);
  std::vector<index_t> shared;
  std::set_intersection(written.begin(), written.end(), read.begin(), read.end(),
                        std::back_inserter(shared));
  return !shared.empty();
}

template <class T, std::size_t N>
void check_accepted(const Fuzz::Call<T, N>& call, bool expect_finite, const char* what) {
  if (call.aliased >= 0 &&
      must_refuse_aliasing(call.out, call.inputs[static_cast<std::size_t>(call.aliased)]))
    fail(std::string(what) + ": an output sharing an element with an input was accepted");
  for (const auto& input : call.inputs)
    if (input.layout.oversized) fail(std::string(what) + ": a view larger than its memory was accepted");
  if (call.out.layout.oversized) fail(std::string(what) + ": an output larger than its memory was accepted");
  if (!call.out.layout.distinct)
    fail(std::string(what) + ": an output that addresses an element twice was accepted");
  if (!call.out.layout.valid) fail(std::string(what) + ": an invalid output view was accepted");
  for (const auto& input : call.inputs)
    if (!input.layout.valid) fail(std::string(what) + ": an invalid input view was accepted");
  if (!expect_finite || call.aliased >= 0) return;
  const auto& layout = call.out.layout;
  index_t count = 1;
  for (index_t e : layout.extents) count *= e;
  std::array<index_t, N> at{};
  for (index_t i = 0; i < count; ++i) {
    index_t offset = 0;
    for (std::size_t d = 0; d < N; ++d) offset += at[d] * layout.strides[d];
    if (!std::isfinite(call.out.data()[offset]))
      fail(std::string(what) + ": non-finite output for finite, moderate inputs");
    for (std::size_t d = N; d-- > 0;) {
      if (++at[d] < layout.extents[d]) break;
      at[d] = 0;
    }
  }
}

template <class T, std::size_t N>
bool inputs_moderate(const Fuzz::Call<T, N>& call, double bound) {
  return std::all_of(call.inputs.begin(), call.inputs.end(),
                     [&](const auto& input) { return input.stats.moderate(bound); });
}

/// Runs `body`, a call whose sizes make `demand` (memory_cap.hpp) of the allocator;
/// whether it returns. A latte::Error is always an accepted outcome, std::bad_alloc
/// only above the memory cap, a return only where the sizes do not overflow.
template <class Body>
bool attempt(Body&& body, Demand demand = Demand::fits) {
  try {
    body();
  } catch (const latte::Error&) {
    return false;
  } catch (const std::bad_alloc&) {
    if (demand == Demand::over_cap) return false;
    fail(demand == Demand::fits ? "std::bad_alloc from a call whose sizes fit the memory cap"
                                : "std::bad_alloc (not latte::Error) for sizes whose byte count overflows");
  } catch (const std::exception& e) {
    fail(std::string("unexpected exception (not latte::Error): ") + e.what());
  } catch (...) {
    fail("unexpected exception of unknown type");
  }
  if (demand == Demand::overflows) fail("a call whose sizes overflow int64 bytes was accepted");
  return true;
}

// --------------------------------------------------------- generic driving --

/// The argument sizes of one mechanism: features of each input and of the output,
/// and how large inputs may be while its outputs must stay finite.
struct Features {
  std::vector<index_t> inputs;
  index_t out;
  double finite_bound;  ///< inputs with |x| <= this (all finite) give finite outputs; 0: no check
};

template <std::size_t N>
std::vector<std::array<index_t, N>> input_extents(const Features& f, index_t batch, index_t time,
                                                   index_t heads) {
  std::vector<std::array<index_t, N>> extents;
  for (index_t features : f.inputs) {
    if constexpr (N == 4) extents.push_back({batch, time, heads, features});
    else extents.push_back({batch, heads, features});
  }
  return extents;
}

/// forward(inputs..., out) on a [B, T, H, *] call.
template <class T, class Forward>
void drive_forward(Fuzz& fuzz, const Features& f, index_t batch, index_t time, index_t heads,
                   const char* what, Forward&& forward) {
  const auto values = fuzz.values();
  auto call = fuzz.call<T, 4>(input_extents<4>(f, batch, time, heads), {batch, time, heads, f.out},
                              values);
  if (attempt([&] { forward(call); }))
    check_accepted(call, f.finite_bound > 0 && inputs_moderate(call, f.finite_bound), what);
}

/// forward(inputs..., out) with bf16 activations: a fuzzed fp32 call whose buffers
/// are twinned in bf16 (tests/half_shadow.hpp: layouts, null pointers and aliasing
/// kept element for element), made by `forward(bf16 inputs, bf16 out)`. An accepted
/// call's output is widened back and checked as an fp32 one is.
/// bf16 twins of a fuzzed fp32 call's buffers (an aliasing out shares its input's),
/// its views mapped onto them element for element (tests/half_shadow.hpp).
template <std::size_t N>
latte::test::HalfShadow<N> bf16_twins(const Fuzz::Call<float, N>& call) {
  std::vector<latte::test::FloatBuffer> buffers;
  std::vector<TensorView<const float, N>> inputs;
  for (const auto& input : call.inputs) {
    buffers.push_back({input.buffer.get(), input.buffer_elements});
    inputs.push_back(input.cview());
  }
  if (call.aliased < 0) buffers.push_back({call.out.buffer.get(), call.out.buffer_elements});
  return latte::test::HalfShadow<N>(buffers, inputs, call.out.view());
}

template <class Forward>
void drive_bf16_forward(Fuzz& fuzz, const Features& f, index_t batch, index_t time, index_t heads,
                        const char* what, Forward&& forward) {
  const auto values = fuzz.values();
  auto call = fuzz.call<float, 4>(input_extents<4>(f, batch, time, heads), {batch, time, heads, f.out},
                                  values);
  const latte::test::HalfShadow<4> shadow = bf16_twins(call);
  if (attempt([&] { forward(shadow.inputs(), shadow.out()); })) {
    shadow.write_back(call.out.view());
    check_accepted(call, f.finite_bound > 0 && inputs_moderate(call, f.finite_bound), what);
  }
}

/// backward(inputs..., d_out, gradients): the first gradient comes with the
/// forward's inputs and d_out in one fuzzed call (layouts, aliasing an input,
/// interleaving); the others are fuzzed outputs of their own, or now and then
/// the first gradient's own view (two gradients sharing elements: refused).
/// `backward(call, second, third)` runs it. Accepted calls are checked like
/// forwards; gradients must be finite when every input is finite and at most
/// `finite_bound` (0: not checked).
template <class T, class Backward>
void drive_backward(Fuzz& fuzz, const std::vector<std::array<index_t, 4>>& input_extents,
                    const std::array<std::array<index_t, 4>, 3>& gradient_extents,
                    double finite_bound, const char* what, Backward&& backward) {
  const auto values = fuzz.values();
  auto call = fuzz.call<T, 4>(input_extents, gradient_extents[0], values);
  auto second = fuzz.call<T, 4>({}, gradient_extents[1], values);
  auto third = fuzz.call<T, 4>({}, gradient_extents[2], values);
  const bool shared = fuzz.coin(16) && gradient_extents[1] == gradient_extents[0];
  if (shared) second.out = call.out;
  if (!attempt([&] { backward(call, second, third); })) return;
  const auto& extents = call.out.layout.extents;
  const bool has_elements = std::all_of(extents.begin(), extents.end(), [](index_t e) { return e > 0; });
  if (shared && has_elements)  // an empty gradient shares nothing
    fail(std::string(what) + ": two gradients sharing their elements were accepted");
  const bool finite = finite_bound > 0 && inputs_moderate(call, finite_bound);
  check_accepted(call, finite, what);
  check_accepted(second, finite && call.aliased < 0, what);
  check_accepted(third, finite && call.aliased < 0, what);
}

/// drive_backward for a self-attention backward(inputs..., d_out, {d_first,
/// d_second, d_values}) whose gradients have their inputs' shapes; d_out
/// sometimes has one feature too many. Fails when a call whose d_out or
/// gradient shape differs from its input's is accepted.
template <class T, class Backward>
void drive_self_backward(Fuzz& fuzz, const Features& f, index_t batch, index_t time,
                         index_t heads, double finite_bound, const char* what,
                         Backward&& backward) {
  const auto sequence = input_extents<4>(f, batch, time, heads);
  const std::array<index_t, 4> values_extents{batch, time, heads, f.out};
  std::vector<std::array<index_t, 4>> inputs = sequence;
  inputs.push_back(fuzz.coin(8) ? std::array<index_t, 4>{batch, time, heads, f.out + 1}
                                : values_extents);  // d_out
  drive_backward<T>(fuzz, inputs, {sequence[0], sequence[1], values_extents}, finite_bound, what,
                    [&](auto& c, auto& second, auto& third) {
                      backward(c, second, third);
                      const auto& in = c.inputs;
                      if (in[3].layout.extents != in[2].layout.extents ||
                          c.out.layout.extents != in[0].layout.extents ||
                          second.out.layout.extents != in[1].layout.extents ||
                          third.out.layout.extents != in[2].layout.extents)
                        fail(std::string(what) + ": a gradient or d_out whose shape is not its "
                                                 "input's was accepted");
                    });
}

/// make_state, forward(..., state), step, save, load_state / restore: every
/// outcome a latte::Error or a return; saved bytes reload to the same bytes.
/// `state_demand(batch)`: what make_state(batch) asks of the allocator (the
/// largest of the state's fields, from the harness's own sizes).
template <class T, class Make, class StateDemand, class ForwardState, class Step, class Load>
void drive_decode(Fuzz& fuzz, const Features& f, index_t batch, index_t time, index_t heads,
                  const char* what, Make&& make, StateDemand&& state_demand, ForwardState&& forward,
                  Step&& step, Load&& load) {
  using State = std::decay_t<decltype(make(index_t{}))>;
  std::optional<State> state;
  const index_t state_batch = fuzz.coin(8) ? fuzz.size(1, 3) : batch;
  if (!attempt([&] { state.emplace(make(state_batch)); }, state_demand(state_batch))) return;
  const auto values = fuzz.values();
  // Outputs must be finite while every token the state absorbed was finite and moderate.
  bool clean = f.finite_bound > 0;
  if (fuzz.coin(2)) {
    auto call = fuzz.call<T, 4>(input_extents<4>(f, batch, time, heads),
                                {batch, time, heads, f.out}, values);
    if (attempt([&] { forward(call, *state); })) {
      clean = clean && inputs_moderate(call, f.finite_bound);
      check_accepted(call, clean, what);
    }
  }
  const int steps = fuzz.in().ConsumeIntegralInRange<int>(0, 4);
  for (int i = 0; i < steps; ++i) {
    auto call = fuzz.call<T, 3>(input_extents<3>(f, batch, 0, heads), {batch, heads, f.out}, values);
    if (attempt([&] { step(call, *state); })) {
      clean = clean && inputs_moderate(call, f.finite_bound);
      check_accepted(call, clean, what);
    }
  }
  const std::vector<std::byte> saved = state->save();
  std::optional<State> loaded;
  if (attempt([&] { loaded.emplace(load(std::span<const std::byte>(saved))); })) {
    if (loaded->save() != saved) fail(std::string(what) + ": load_state(save()) saves different bytes");
  } else {
    fail(std::string(what) + ": load_state refused the bytes save() wrote");
  }
  const std::vector<std::byte> bytes = fuzz.corrupt(saved);
  if (fuzz.coin(2)) {
    attempt([&] { loaded.emplace(load(std::span<const std::byte>(bytes))); });
  } else {
    const std::vector<std::byte> before = loaded->save();
    if (!attempt([&] { loaded->restore(bytes); }) && loaded->save() != before)
      fail(std::string(what) + ": a refused restore changed the state");
  }
  auto call = fuzz.call<T, 3>(input_extents<3>(f, batch, 0, heads), {batch, heads, f.out}, values);
  // The restored numbers may be anything: validation is checked, finiteness is not.
  if (attempt([&] { step(call, *loaded); })) check_accepted(call, false, what);
}

/// forward_packed (serving/packed_prefill.hpp) over `Inputs` fuzzed [B, T, H, *]
/// inputs (B sometimes 2: refused) cut by a fuzzed cu_seqlens (sometimes edited
/// to be malformed), fresh or with one state per sequence from `make(batch)`
/// (sometimes of another batch, repeated, null, or one too few). A refused call
/// must leave every state's saved bytes unchanged; an accepted one is checked
/// like a forward.
template <class T, std::size_t Inputs, class Attention, class Make, class StateDemand>
void drive_packed(Fuzz& fuzz, const Features& f, index_t time, index_t heads, const char* what,
                  const Attention& a, Make&& make, StateDemand&& state_demand) {
  using State = std::decay_t<decltype(make(index_t{1}))>;
  const index_t batch = fuzz.coin(8) ? 2 : 1;
  const auto values = fuzz.values();
  auto call = fuzz.call<T, 4>(input_extents<4>(f, batch, time, heads), {batch, time, heads, f.out}, values);
  std::vector<index_t> cu{0, std::max<index_t>(time, 0)};
  for (int cuts = fuzz.in().ConsumeIntegralInRange<int>(0, 5); cuts > 0; --cuts)
    cu.push_back(fuzz.in().ConsumeIntegralInRange<index_t>(0, std::max<index_t>(time, 0)));
  std::sort(cu.begin(), cu.end());
  if (fuzz.coin(8))
    cu[fuzz.in().ConsumeIntegralInRange<std::size_t>(0, cu.size() - 1)] +=
        fuzz.pick<index_t>({-1, 1, index_t{1} << 40, std::numeric_limits<index_t>::min() / 2});
  if (fuzz.coin(32)) cu.resize(1);
  const std::size_t sequences = cu.size() - 1;
  std::vector<std::optional<State>> states(sequences + 1);
  std::vector<State*> pointers;
  if (fuzz.coin(2)) {
    const std::size_t count = fuzz.coin(16) ? sequences - (sequences > 0) : sequences;
    for (std::size_t i = 0; i < count; ++i) {
      const index_t state_batch = fuzz.coin(16) ? 2 : 1;
      if (!attempt([&] { states[i].emplace(make(state_batch)); }, state_demand(state_batch))) return;
      pointers.push_back(&*states[i]);
    }
    if (pointers.size() >= 2 && fuzz.coin(16)) pointers[1] = pointers[0];
    if (!pointers.empty() && fuzz.coin(32)) pointers.back() = nullptr;
  }
  std::vector<std::vector<std::byte>> before;
  for (State* state : pointers)
    if (state) before.push_back(state->save());
  const auto views = [&]<std::size_t... I>(std::index_sequence<I...>) {
    return std::make_tuple(call.inputs[I].cview()...);
  }(std::make_index_sequence<Inputs>{});
  const std::span<const index_t> offsets(cu);
  const bool accepted = attempt([&] {
    if (pointers.empty())
      latte::forward_packed(a, latte::exec::cpu, offsets, views, call.out.view());
    else
      latte::forward_packed(a, latte::exec::cpu, offsets, views, call.out.view(),
                            std::span<State* const>(pointers));
  });
  if (accepted) {
    if (batch != 1) fail(std::string(what) + ": a packed call of batch 2 was accepted");
    // Finite while fresh: a state's restored numbers are not fuzzed here, but its position is.
    check_accepted(call, pointers.empty() && f.finite_bound > 0 && inputs_moderate(call, f.finite_bound), what);
    return;
  }
  std::size_t next = 0;
  for (State* state : pointers)
    if (state && state->save() != before[next++])
      fail(std::string(what) + ": a refused forward_packed moved a state");
}

/// StatePool (serving/state_pool.hpp) of a fuzzed slot count (sometimes 0 or -1:
/// refused), then a fuzzed run of acquire (a full pool refused), release (and the
/// same handle again: refused), step over fuzzed slot lists (live, repeated,
/// released, another pool's, default) with fuzzed [N, H, *] views (sometimes a
/// row too many), and restore of corrupted saved bytes. A refused call must leave
/// every live slot's saved bytes unchanged; an accepted step is checked like a
/// forward (its positions may be anything, so not for finiteness).
template <class T, std::size_t K, class Attention, class... StateArgs>
void drive_pool(Fuzz& fuzz, const Features& f, index_t heads, const char* what, const Attention& a,
                StateArgs... state_args) {
  using Pool = latte::StatePool<Attention, T>;
  std::optional<Pool> pool, other;
  const index_t slots = fuzz.coin(16) ? fuzz.pick<index_t>({0, -1}) : fuzz.size(1, 4);
  if (!attempt([&] { pool.emplace(a, slots, state_args...); }, Demand::over_cap)) return;
  if (!attempt([&] { other.emplace(a, 1, state_args...); }, Demand::over_cap)) return;
  const latte::PoolSlot foreign = other->acquire();
  std::vector<latte::PoolSlot> live, released;
  const auto live_bytes = [&] {
    std::vector<std::vector<std::byte>> bytes;
    for (const latte::PoolSlot& slot : live) bytes.push_back(pool->save(slot));
    return bytes;
  };
  const auto refused_unchanged = [&](const std::vector<std::vector<std::byte>>& before) {
    if (live_bytes() != before) fail(std::string(what) + ": a refused StatePool call changed a live slot");
  };
  for (int op = fuzz.in().ConsumeIntegralInRange<int>(1, 8); op > 0; --op) {
    const auto before = live_bytes();
    switch (fuzz.in().ConsumeIntegralInRange<int>(0, 3)) {
      case 0: {
        latte::PoolSlot slot;
        if (attempt([&] { slot = pool->acquire(); })) {
          live.push_back(slot);
        } else {
          if (pool->live() != pool->capacity()) fail(std::string(what) + ": acquire refused with a free slot");
          refused_unchanged(before);
        }
        break;
      }
      case 1: {
        if (live.empty()) break;
        const std::size_t i = fuzz.in().ConsumeIntegralInRange<std::size_t>(0, live.size() - 1);
        const latte::PoolSlot slot = live[i];
        if (!attempt([&] { pool->release(slot); })) fail(std::string(what) + ": release of a live slot refused");
        live.erase(live.begin() + static_cast<std::ptrdiff_t>(i));
        released.push_back(slot);
        const auto after = live_bytes();
        if (attempt([&] { pool->release(slot); })) fail(std::string(what) + ": a double release was accepted");
        refused_unchanged(after);
        break;
      }
      case 2: {
        std::vector<latte::PoolSlot> chosen;
        for (const latte::PoolSlot& slot : live)
          if (fuzz.coin(2)) chosen.push_back(slot);
        bool bad = false;
        if (!chosen.empty() && fuzz.coin(8)) chosen.push_back(chosen.front()), bad = true;
        if (!released.empty() && fuzz.coin(8)) chosen.push_back(released.back()), bad = true;
        if (fuzz.coin(16)) chosen.push_back(foreign), bad = true;
        if (fuzz.coin(16)) chosen.push_back(latte::PoolSlot{}), bad = true;
        const auto N = static_cast<index_t>(chosen.size());
        const index_t rows = fuzz.coin(8) ? N + 1 : N;
        const auto values = fuzz.values();
        auto call = fuzz.call<T, 3>(input_extents<3>(f, rows, 0, heads), {rows, heads, f.out}, values);
        const auto views = [&]<std::size_t... I>(std::index_sequence<I...>) {
          return std::make_tuple(call.inputs[I].cview()...);
        }(std::make_index_sequence<K>{});
        bool accepted = false, stepped = false;
        if constexpr (std::is_same_v<T, float>) {
          if (fuzz.coin(4)) {  // bf16 activations: twins of the fuzzed buffers
            const latte::test::HalfShadow<3> shadow = bf16_twins(call);
            const auto half_views = [&]<std::size_t... I>(std::index_sequence<I...>) {
              return std::make_tuple(shadow.inputs()[I]...);
            }(std::make_index_sequence<K>{});
            accepted = attempt([&] { pool->step(latte::exec::cpu, chosen, half_views, shadow.out()); });
            stepped = true;
          }
        }
        if (!stepped) accepted = attempt([&] { pool->step(latte::exec::cpu, chosen, views, call.out.view()); });
        if (accepted) {
          if (bad || rows != N) fail(std::string(what) + ": a step over bad slots or rows was accepted");
          check_accepted(call, false, what);
        } else {
          refused_unchanged(before);
        }
        break;
      }
      default: {
        if (live.empty()) break;
        const latte::PoolSlot slot = live[fuzz.in().ConsumeIntegralInRange<std::size_t>(0, live.size() - 1)];
        const std::vector<std::byte> bytes = fuzz.corrupt(pool->save(slot));
        if (!attempt([&] { pool->restore(slot, bytes); })) refused_unchanged(before);
        break;
      }
    }
  }
}

// ------------------------------------------------------------- mechanisms --

/// Common sizes of one call.
struct Sizes {
  index_t batch, time, heads;
};

template <class Dir>
constexpr bool causal = Dir::is_causal;

/// Angles [H, D/2] for VAPOR / RoPE: the default schedule, or a given tensor
/// (sometimes of the wrong shape or with non-finite entries).
inline latte::detail::PairRotation::Params angles(Fuzz& fuzz, index_t heads, index_t dim) {
  latte::detail::PairRotation::Params params;
  if (fuzz.coin(3)) params.base = fuzz.pick<double>({10000.0, 1.0, 0.5, 0.0, -1.0, NAN, INFINITY});
  if (!fuzz.coin(2)) return params;
  index_t rows = std::clamp<index_t>(heads, 0, 8), cols = std::clamp<index_t>(dim / 2, 0, 16);
  if (fuzz.coin(6)) rows = fuzz.in().ConsumeIntegralInRange<index_t>(0, 5);
  if (fuzz.coin(6)) cols = fuzz.in().ConsumeIntegralInRange<index_t>(0, 9);
  params.angles = latte::Tensor<double, 2>({rows, cols});
  for (index_t i = 0; i < params.angles.size(); ++i)
    params.angles.data()[i] = fuzz.coin(40) ? fuzz.pick<double>({NAN, INFINITY, 1e300})
                                            : fuzz.in().ConsumeFloatingPointInRange<double>(-10, 10);
  return params;
}

inline std::optional<double> scale(Fuzz& fuzz) {
  if (!fuzz.coin(4)) return std::nullopt;
  return fuzz.pick<double>({0.37, 1.0, -2.0, 0.0, 1e-30, 1e30, NAN, INFINITY});
}
/// A scale under which moderate scores stay finite (1e30 * q . k does not).
inline bool tame(const std::optional<double>& scale) { return !scale || std::fabs(*scale) <= 10; }

/// The first position of a decode state: small, near 2^31, near 2^53, or near the end.
inline std::int64_t first_position(Fuzz& fuzz) {
  if (!fuzz.coin(3)) return 0;
  return fuzz.pick<std::int64_t>({1, 1000, (std::int64_t{1} << 31) - 2, std::int64_t{1} << 31,
                                  (std::int64_t{1} << 53) + 1,
                                  std::numeric_limits<std::int64_t>::max() - 3, -1});
}

template <class T, class E, class Dir, class Pos>
void latte_attention(Fuzz& fuzz, const Sizes& s) {
  const index_t L = fuzz.size(1, 16), Dv = fuzz.size(1, 16);
  std::optional<latte::LatteAttention<Dir, latte::RunningMax, Pos>> attention;
  typename Pos::Params params{};
  if constexpr (Pos::rotates_values) {
    const auto given = angles(fuzz, s.heads, Dv);
    params.angles = given.angles;
    params.base = given.base;
  }
  // VAPOR's angle table: [H, Dv / 2] doubles.
  const Demand tables = Pos::rotates_values ? demand({s.heads, Dv / 2}, 8) : Demand::fits;
  if (!attempt([&] { attention.emplace(latte::LatteDims{s.heads, L, Dv}, params); }, tables)) return;
  // RunningMax: o_t is a convex combination of values for any finite logits;
  // |v| <= 1e30 keeps the sums of at most 40 of them finite in float.
  const Features f{{L, L, Dv}, Dv, 1e30};
  const auto& a = *attention;
  drive_forward<T>(fuzz, f, s.batch, s.time, s.heads, "LatteAttention forward", [&](auto& c) {
    a.forward(E{}, c.inputs[0].cview(), c.inputs[1].cview(), c.inputs[2].cview(), c.out.view());
  });
  if constexpr (std::is_same_v<T, float>)  // its own bf16 rows on exec::cpu, HalfPrecision's copies on reference
    if (fuzz.coin(3))
      drive_bf16_forward(fuzz, f, s.batch, s.time, s.heads, "LatteAttention forward (bf16)",
                         [&](const auto& in, const auto& out) {
                           latte::HalfPrecision(a).forward(E{}, in[0], in[1], in[2], out);
                         });
  if constexpr (std::is_same_v<T, float> && std::is_same_v<E, latte::exec::cpu_t> && !Dir::is_causal)
    if (fuzz.coin(3))  // bf16 dot products (latte::bf16_products)
      drive_bf16_forward(fuzz, f, s.batch, s.time, s.heads, "LatteAttention forward (bf16 products)",
                         [&](const auto& in, const auto& out) {
                           a.forward(E{}, latte::bf16_products, in[0], in[1], in[2], out);
                         });
  if (fuzz.coin(3)) {
    latte::Tensor<T, 2> d_angles({Pos::rotates_values && fuzz.coin(2) ? s.heads : 0, Dv / 2});
    // Gradients of logits spread over 1e3 stay finite: |g|, |v| <= 1e3, T <= 40.
    drive_self_backward<T>(fuzz, f, s.batch, s.time, s.heads, 1e3, "LatteAttention backward",
                           [&](auto& c, auto& second, auto& third) {
                             a.backward(E{}, c.inputs[0].cview(), c.inputs[1].cview(),
                                        c.inputs[2].cview(), c.inputs[3].cview(),
                                        latte::LatteGradients<T>{c.out.view(), second.out.view(),
                                                                 third.out.view(), d_angles.view()});
                           });
  }
  if constexpr (causal<Dir>) {
    const auto first = first_position(fuzz);
    const auto make = [&](index_t batch) { return a.template make_state<T>(batch, first); };
    const auto state_demand = [&](index_t batch) { return demand({batch, s.heads, L, Dv}, sizeof(T)); };  // memory
    drive_decode<T>(
        fuzz, f, s.batch, s.time, s.heads, "LatteAttention decode", make, state_demand,
        [&](auto& c, auto& state) {
          a.forward(E{}, c.inputs[0].cview(), c.inputs[1].cview(), c.inputs[2].cview(),
                    c.out.view(), state);
        },
        [&](auto& c, auto& state) {
          a.step(E{}, state, c.inputs[0].cview(), c.inputs[1].cview(), c.inputs[2].cview(),
                 c.out.view());
        },
        [&](std::span<const std::byte> bytes) { return a.template load_state<T>(bytes); });
    drive_packed<T, 3>(fuzz, f, s.time, s.heads, "LatteAttention forward_packed", a, make, state_demand);
    drive_pool<T, 3>(fuzz, f, s.heads, "LatteAttention StatePool", a, first);
  }
}

template <class T, class E, class Dir, class Win>
void softmax_attention(Fuzz& fuzz, const Sizes& s) {
  const index_t Dk = fuzz.size(1, 16), Dv = fuzz.size(1, 16);
  Win window{};
  const bool decode = causal<Dir> && fuzz.coin(2);
  if constexpr (std::is_same_v<Win, latte::SlidingWindow>) {
    window.left = fuzz.parameter(0, 45);
    window.right = causal<Dir> ? (fuzz.coin(8) ? fuzz.parameter(0, 3) : 0) : fuzz.parameter(0, 45);
  }
  std::optional<latte::SoftmaxAttention<Dir, Win>> attention;
  const auto given_scale = scale(fuzz);
  if (!attempt([&] { attention.emplace(latte::SoftmaxDims{s.heads, Dk, Dv}, window, given_scale); }))
    return;
  // Scores scale * q . k stay finite for |q|, |k| <= 1e3 (Dk <= 16); o_t is a mean of values.
  const Features f{{Dk, Dk, Dv}, Dv, tame(given_scale) ? 1e3 : 0};
  const auto& a = *attention;
  drive_forward<T>(fuzz, f, s.batch, s.time, s.heads, "SoftmaxAttention forward", [&](auto& c) {
    a.forward(E{}, c.inputs[0].cview(), c.inputs[1].cview(), c.inputs[2].cview(), c.out.view());
  });
  if constexpr (std::is_same_v<T, float>)
    if (fuzz.coin(4))
      drive_bf16_forward(fuzz, f, s.batch, s.time, s.heads, "SoftmaxAttention forward (bf16)",
                         [&](const auto& in, const auto& out) {
                           latte::HalfPrecision(a).forward(E{}, in[0], in[1], in[2], out);
                         });
  if (!decode && fuzz.coin(3))
    drive_self_backward<T>(fuzz, f, s.batch, s.time, s.heads, tame(given_scale) ? 1e2 : 0,
                           "SoftmaxAttention backward",
                           [&](auto& c, auto& second, auto& third) {
                             a.backward(E{}, c.inputs[0].cview(), c.inputs[1].cview(),
                                        c.inputs[2].cview(), c.inputs[3].cview(),
                                        latte::SoftmaxGradients<T>{c.out.view(), second.out.view(),
                                                                   third.out.view()});
                           });
  if constexpr (causal<Dir>) {
    if (!decode) return;
    const index_t capacity = fuzz.parameter(1, 48);
    // The cache holds left + 1 tokens with a window (capacity without): keys (Dk each)
    // and values (Dv each) in two fields.
    index_t slots = capacity;
    if constexpr (std::is_same_v<Win, latte::SlidingWindow>)
      if (__builtin_add_overflow(window.left, 1, &slots)) slots = -1;
    const auto make = [&](index_t batch) { return a.template make_state<T>(batch, capacity); };
    const auto state_demand = [&](index_t batch) {
      return slots < 0 ? Demand::overflows
                       : demand({batch, s.heads, slots, std::max(Dk, Dv)}, sizeof(T));
    };
    drive_decode<T>(
        fuzz, f, s.batch, s.time, s.heads, "SoftmaxAttention decode", make, state_demand,
        [&](auto& c, auto& state) {
          a.forward(E{}, c.inputs[0].cview(), c.inputs[1].cview(), c.inputs[2].cview(),
                    c.out.view(), state);
        },
        [&](auto& c, auto& state) {
          a.step(E{}, state, c.inputs[0].cview(), c.inputs[1].cview(), c.inputs[2].cview(),
                 c.out.view());
        },
        [&](std::span<const std::byte> bytes) { return a.template load_state<T>(bytes); });
    drive_packed<T, 3>(fuzz, f, s.time, s.heads, "SoftmaxAttention forward_packed", a, make, state_demand);
    if (fuzz.coin(2)) drive_pool<T, 3>(fuzz, f, s.heads, "SoftmaxAttention StatePool", a, capacity);
  }
}

template <class T, class Dir, class LatentPos, class WindowPos>
void macchiato(Fuzz& fuzz, const Sizes& s) {
  const index_t L = fuzz.size(1, 16), Dk = fuzz.size(1, 16), Dv = fuzz.size(1, 16);
  const index_t window = fuzz.parameter(1, 45);
  const bool decode = causal<Dir> && fuzz.coin(2);
  latte::MacchiatoOptions options{scale(fuzz), fuzz.coin(2) ? latte::VaporScope::latent_states
                                                             : latte::VaporScope::all_states};
  typename LatentPos::Params latent{};
  typename WindowPos::Params local{};
  if constexpr (LatentPos::rotates_values) {
    const auto given = angles(fuzz, s.heads, Dv);
    latent.angles = given.angles;
    latent.base = given.base;
  }
  if constexpr (WindowPos::rotates_queries_keys) {
    const auto given = angles(fuzz, s.heads, Dk);
    local.angles = given.angles;
    local.base = given.base;
  }
  std::optional<latte::LatteMacchiato<Dir, latte::RunningMax, LatentPos, WindowPos>> attention;
  // The angle tables: [H, Dv / 2] (VAPOR) and [H, Dk / 2] (RoPE) doubles.
  const Demand tables = (LatentPos::rotates_values ? demand({s.heads, Dv / 2}, 8) : Demand::fits) |
                        (WindowPos::rotates_queries_keys ? demand({s.heads, Dk / 2}, 8) : Demand::fits);
  if (!attempt([&] {
        attention.emplace(latte::MacchiatoDims{s.heads, L, Dk, Dv, window}, options, latent, local);
      }, tables))
    return;
  const Features f{{L + 1, L, Dk, Dk, Dv}, Dv, tame(options.scale) ? 1e3 : 0};
  const auto& a = *attention;
  auto forward = [&](auto& c) {
    a.forward(latte::exec::reference, c.inputs[0].cview(), c.inputs[1].cview(), c.inputs[2].cview(),
              c.inputs[3].cview(), c.inputs[4].cview(), c.out.view());
  };
  drive_forward<T>(fuzz, f, s.batch, s.time, s.heads, "LatteMacchiato forward", forward);
  if (!decode && fuzz.coin(3)) {
    // backward(q, k, q', k', v, d_out, gradients): d_query_logits, d_key_logits and
    // d_values fuzzed, the window's two gradients well-formed buffers of their own.
    const auto sequence = input_extents<4>(f, s.batch, s.time, s.heads);
    std::vector<std::array<index_t, 4>> inputs = sequence;
    inputs.push_back(fuzz.coin(8) ? std::array<index_t, 4>{s.batch, s.time, s.heads, Dv + 1}
                                  : sequence[4]);  // d_out
    latte::Tensor<T, 2> d_angles({LatentPos::rotates_values && fuzz.coin(2) ? s.heads : 0, Dv / 2});
    const bool cpu = fuzz.coin(2);
    drive_backward<T>(
        fuzz, inputs, {sequence[0], sequence[1], sequence[4]}, tame(options.scale) ? 1e2 : 0,
        "LatteMacchiato backward", [&](auto& c, auto& second, auto& third) {
          const auto& in = c.inputs;
          latte::Tensor<T, 4> d_window_queries(in[2].layout.extents),
              d_window_keys(in[3].layout.extents);
          const latte::MacchiatoGradients<T> gradients{
              c.out.view(), second.out.view(), d_window_queries.view(), d_window_keys.view(),
              third.out.view(), d_angles.view()};
          auto run = [&](auto exec) {
            a.backward(exec, in[0].cview(), in[1].cview(), in[2].cview(), in[3].cview(),
                       in[4].cview(), in[5].cview(), gradients);
          };
          if (cpu) run(latte::exec::cpu);
          else run(latte::exec::reference);
          if (in[5].layout.extents != in[4].layout.extents ||
              c.out.layout.extents != in[0].layout.extents ||
              second.out.layout.extents != in[1].layout.extents ||
              third.out.layout.extents != in[4].layout.extents)
            fail("LatteMacchiato backward: a gradient or d_out whose shape is not its input's "
                 "was accepted");
        });
  }
  if constexpr (causal<Dir>) {
    if (!decode) return;
    const auto first = first_position(fuzz);
    const auto make = [&](index_t batch) { return a.template make_state<T>(batch, first); };
    const auto state_demand = [&](index_t batch) {  // the latent memory and the ring of w + 1 keys
      index_t slots = 0;
      if (__builtin_add_overflow(window, 1, &slots)) return Demand::overflows;
      return demand({batch, s.heads, L, Dv}, sizeof(T)) | demand({batch, s.heads, slots, Dk}, sizeof(T));
    };
    drive_decode<T>(
        fuzz, f, s.batch, s.time, s.heads, "LatteMacchiato decode", make, state_demand,
        [&](auto& c, auto& state) {
          a.forward(latte::exec::reference, c.inputs[0].cview(), c.inputs[1].cview(),
                    c.inputs[2].cview(), c.inputs[3].cview(), c.inputs[4].cview(), c.out.view(),
                    state);
        },
        [&](auto& c, auto& state) {
          a.step(latte::exec::reference, state, c.inputs[0].cview(), c.inputs[1].cview(),
                 c.inputs[2].cview(), c.inputs[3].cview(), c.inputs[4].cview(), c.out.view());
        },
        [&](std::span<const std::byte> bytes) { return a.template load_state<T>(bytes); });
    drive_packed<T, 5>(fuzz, f, s.time, s.heads, "LatteMacchiato forward_packed", a, make, state_demand);
    if (fuzz.coin(2)) drive_pool<T, 5>(fuzz, f, s.heads, "LatteMacchiato StatePool", a, first);
  }
}

inline latte::Normaliser normaliser(Fuzz& fuzz, latte::Normaliser fallback) {
  if (!fuzz.coin(4)) return fallback;
  latte::Normaliser n;
  n.kind = fuzz.coin(2) ? latte::Normaliser::Kind::additive : latte::Normaliser::Kind::clamp_min;
  n.value = fuzz.pick<double>({1e-6, 0.1, 1.0, 0.0, -1.0, 1e-300, NAN, INFINITY});
  return n;
}

inline latte::LeaPModule leap_module(Fuzz& fuzz, index_t features, index_t hidden) {
  index_t rows = std::clamp<index_t>(hidden, 0, 16), cols = std::clamp<index_t>(features, 0, 32);
  if (fuzz.coin(8)) rows = fuzz.in().ConsumeIntegralInRange<index_t>(0, 5);
  latte::LeaPModule m;
  m.w1 = latte::Tensor<double, 2>({rows, cols});
  m.b1 = latte::Tensor<double, 1>({fuzz.coin(8) ? rows + 1 : rows});
  m.w2 = latte::Tensor<double, 1>({rows});
  for (index_t i = 0; i < m.w1.size(); ++i) m.w1.data()[i] = fuzz.in().ConsumeFloatingPointInRange<double>(-2, 2);
  for (index_t i = 0; i < m.b1.size(); ++i) m.b1.data()[i] = fuzz.in().ConsumeFloatingPointInRange<double>(-2, 2);
  for (index_t i = 0; i < m.w2.size(); ++i) m.w2.data()[i] = fuzz.in().ConsumeFloatingPointInRange<double>(-2, 2);
  m.b2 = fuzz.coin(30) ? NAN : fuzz.in().ConsumeFloatingPointInRange<double>(-2, 2);
  if (m.w1.size() && fuzz.coin(30)) m.w1.data()[0] = INFINITY;
  return m;
}

template <class T, class Dir, class Map, class Rw, class Pos>
void linear_attention(Fuzz& fuzz, const Sizes& s) {
  using Attention = latte::LinearAttention<Dir, Map, Rw, Pos>;
  const index_t Dk = fuzz.size(1, 16), Dv = fuzz.size(1, 16);
  typename Attention::Options options;
  options.normaliser = normaliser(fuzz, Rw::default_normaliser());
  if constexpr (Attention::position_proportions) {
    if (fuzz.coin(3) || causal<Dir>) options.reweight.length = fuzz.parameter(1, 60);
  }
  if constexpr (Attention::learned_proportions) {
    const index_t features = latte::detail::feature_dim_of<Map>(std::clamp<index_t>(Dk, 1, 16));
    options.reweight.leap_factor = fuzz.coin(4) ? fuzz.parameter(1, 8)
                                                : fuzz.pick<index_t>({1, 2, 4, features});
    if (fuzz.coin(2)) {
      const index_t factor = std::max<index_t>(1, options.reweight.leap_factor);
      options.reweight.query_module = leap_module(fuzz, features, features / factor);
      if (!fuzz.coin(20)) options.reweight.key_module = leap_module(fuzz, features, features / factor);
    }
  }
  if constexpr (Pos::rotates_queries_keys) {
    const index_t features = latte::detail::feature_dim_of<Map>(std::clamp<index_t>(Dk, 1, 16));
    const auto given = angles(fuzz, s.heads, features);
    options.positional.angles = given.angles;
    options.positional.base = given.base;
    if (fuzz.coin(2)) options.rope_denominator = latte::RopeDenominator::rotated;
  } else if (fuzz.coin(20)) {
    options.rope_denominator = latte::RopeDenominator::rotated;  // must be refused
  }
  std::optional<Attention> attention;
  // RoPE's angle table: [H, F / 2] doubles, F >= Dk features.
  const Demand tables = Pos::rotates_queries_keys ? demand({s.heads, Dk / 2}, 8) : Demand::fits;
  if (!attempt([&] { attention.emplace(latte::LinearDims{s.heads, Dk, Dv}, options); }, tables)) return;
  const auto& a = *attention;
  // phi(q) . phi(k) and the state's sums stay finite for |x| <= 1e3; N(D) >= its
  // minimum keeps the quotient finite (Identity and RoPE may make D <= 0: clamped).
  const Features f{{Dk, Dk, Dv}, Dv, a.options().normaliser.value >= 1e-6 ? 1e3 : 0};
  const int variant = fuzz.in().ConsumeIntegralInRange<int>(0, 2);
  if (variant == 1 && !causal<Dir>) {
    // Cross-attention: a source of its own length.
    const index_t source = fuzz.in().ConsumeIntegralInRange<index_t>(0, 40);
    const auto values = fuzz.values();
    auto call = fuzz.call<T, 4>({{s.batch, s.time, s.heads, Dk}, {s.batch, source, s.heads, Dk},
                                 {s.batch, source, s.heads, Dv}},
                                {s.batch, s.time, s.heads, Dv}, values);
    if constexpr (!causal<Dir>) {
      if (attempt([&] {
            a.cross_forward(latte::exec::reference, call.inputs[0].cview(), call.inputs[1].cview(),
                            call.inputs[2].cview(), call.out.view());
          }))
        check_accepted(call, f.finite_bound > 0 && inputs_moderate(call, 1e3), "LinearAttention cross_forward");
    }
    return;
  }
  if constexpr (Attention::learned_proportions) {
    if (variant == 2) {  // precomputed proportions [B, T, H] in [0, 1] (or not)
      const auto values = fuzz.values();
      auto call = fuzz.call<T, 4>(input_extents<4>(f, s.batch, s.time, s.heads),
                                  {s.batch, s.time, s.heads, Dv}, values);
      auto props = fuzz.call<T, 3>({{s.batch, s.time, s.heads}, {s.batch, s.time, s.heads}},
                                   {0, 0, 0}, {fuzz.coin(4) ? 3 : 1, 1.0});
      for (auto& p : props.inputs)  // mostly valid proportions: |x| from U(-1, 1)
        if (!fuzz.coin(4))
          for (index_t i = 0; i < p.buffer_elements; ++i) p.buffer[i] = std::fabs(p.buffer[i]);
      const latte::SequenceProportions<T> proportions{props.inputs[0].cview(), props.inputs[1].cview()};
      if (attempt([&] {
            a.forward(latte::exec::reference, call.inputs[0].cview(), call.inputs[1].cview(),
                      call.inputs[2].cview(), proportions, call.out.view());
          }))
        check_accepted(call, false, "LeaPformer forward with proportions");
      return;
    }
  }
  drive_forward<T>(fuzz, f, s.batch, s.time, s.heads, "LinearAttention forward", [&](auto& c) {
    a.forward(latte::exec::reference, c.inputs[0].cview(), c.inputs[1].cview(),
              c.inputs[2].cview(), c.out.view());
  });
  if (fuzz.coin(3)) {
    // Gradients stay finite for |x| <= 1e2: 1 / N(D) <= 1e6 enters squared.
    const bool on_cpu = fuzz.coin(2);
    drive_self_backward<T>(fuzz, f, s.batch, s.time, s.heads, f.finite_bound > 0 ? 1e2 : 0,
                           "LinearAttention backward",
                           [&](auto& c, auto& second, auto& third) {
                             const latte::LinearGradients<T> gradients{
                                 c.out.view(), second.out.view(), third.out.view()};
                             if (on_cpu)
                               a.backward(latte::exec::cpu, c.inputs[0].cview(), c.inputs[1].cview(),
                                          c.inputs[2].cview(), c.inputs[3].cview(), gradients);
                             else
                               a.backward(latte::exec::reference, c.inputs[0].cview(),
                                          c.inputs[1].cview(), c.inputs[2].cview(),
                                          c.inputs[3].cview(), gradients);
                           });
  }
  if constexpr (causal<Dir>) {
    const auto first = first_position(fuzz);
    const auto make = [&](index_t batch) { return a.template make_state<T>(batch, first); };
    const auto state_demand = [&](index_t batch) { return demand({batch, s.heads, Dk, Dv}, sizeof(T)); };  // memory, F >= Dk
    drive_decode<T>(
        fuzz, f, s.batch, s.time, s.heads, "LinearAttention decode", make, state_demand,
        [&](auto& c, auto& state) {
          a.forward(latte::exec::reference, c.inputs[0].cview(), c.inputs[1].cview(),
                    c.inputs[2].cview(), c.out.view(), state);
        },
        [&](auto& c, auto& state) {
          a.step(latte::exec::reference, state, c.inputs[0].cview(), c.inputs[1].cview(),
                 c.inputs[2].cview(), c.out.view());
        },
        [&](std::span<const std::byte> bytes) { return a.template load_state<T>(bytes); });
    drive_packed<T, 3>(fuzz, f, s.time, s.heads, "LinearAttention forward_packed", a, make, state_demand);
    if (fuzz.coin(2)) drive_pool<T, 3>(fuzz, f, s.heads, "LinearAttention StatePool", a, first);
  }
}

template <class T, class Dir>
void lavo(Fuzz& fuzz, const Sizes& s) {
  const index_t d = fuzz.size(1, 16), r = fuzz.size(1, 16);
  const index_t window = fuzz.parameter(1, 45);
  latte::LavoParams params;
  params.basis_seed = fuzz.in().ConsumeIntegral<std::uint64_t>();
  params.scale = scale(fuzz);
  const bool tame_scale = tame(params.scale);
  params.empty_memory = fuzz.coin(2) ? latte::LavoEmptyMemory::zero : latte::LavoEmptyMemory::local_only;
  // Sizes for which the harness builds the given tensors itself.
  const bool small = s.heads >= 0 && s.heads <= 8 && r >= 0 && r <= 16 && d >= 0 && d <= 16 &&
                     window >= 1 && window <= 64;
  if (small && fuzz.coin(3)) {
    params.bases = latte::Tensor<double, 3>({s.heads, r, fuzz.coin(8) ? d + 1 : d});
    for (index_t i = 0; i < params.bases.size(); ++i)
      params.bases.data()[i] = fuzz.coin(60) ? NAN : fuzz.in().ConsumeFloatingPointInRange<double>(-1, 1);
  }
  if (small && fuzz.coin(3)) {
    params.relative_bias = latte::Tensor<double, 2>({s.heads, fuzz.coin(8) ? 2 * window : 2 * window - 1});
    for (index_t i = 0; i < params.relative_bias.size(); ++i)
      params.relative_bias.data()[i] = fuzz.coin(60) ? INFINITY : fuzz.in().ConsumeFloatingPointInRange<double>(-5, 5);
  }
  std::optional<latte::Lavo<Dir>> attention;
  // The bases [H, r, d] and the relative bias P [H, 2w - 1], doubles.
  index_t offsets = 0;
  const Demand tables =
      __builtin_mul_overflow(window, 2, &offsets)
          ? Demand::overflows
          : demand({s.heads, r, d}, 8) | demand({s.heads, offsets - 1}, 8);
  if (!attempt([&] { attention.emplace(latte::LavoDims{s.heads, d, r, window}, std::move(params)); },
               tables))
    return;
  const auto& a = *attention;
  const Features f{{d, d, d}, d, tame_scale ? 1e3 : 0};
  if constexpr (!causal<Dir>) {
    if (fuzz.coin(3)) {
      const index_t source = fuzz.in().ConsumeIntegralInRange<index_t>(0, 40);
      const auto values = fuzz.values();
      auto call = fuzz.call<T, 4>({{s.batch, s.time, s.heads, d}, {s.batch, source, s.heads, d}},
                                  {s.batch, s.time, s.heads, d}, values);
      if (attempt([&] {
            a.cross_forward(latte::exec::reference, call.inputs[0].cview(), call.inputs[1].cview(),
                            call.out.view());
          }))
        check_accepted(call, tame_scale && inputs_moderate(call, 1e3), "Lavo cross_forward");
      return;
    }
  }
  drive_forward<T>(fuzz, f, s.batch, s.time, s.heads, "Lavo forward", [&](auto& c) {
    a.forward(latte::exec::reference, c.inputs[0].cview(), c.inputs[1].cview(),
              c.inputs[2].cview(), c.out.view());
  });
  if (fuzz.coin(4)) {  // backward(q, k, v, d_out, {dq, dk, dv}) on either backend
    const bool on_cpu = fuzz.coin(2);
    drive_self_backward<T>(fuzz, f, s.batch, s.time, s.heads, tame_scale ? 1e2 : 0,
                           "Lavo backward", [&](auto& c, auto& second, auto& third) {
                             const latte::LavoGradients<T> gradients{c.out.view(), second.out.view(),
                                                                     third.out.view()};
                             if (on_cpu)
                               a.backward(latte::exec::cpu, c.inputs[0].cview(), c.inputs[1].cview(),
                                          c.inputs[2].cview(), c.inputs[3].cview(), gradients);
                             else
                               a.backward(latte::exec::reference, c.inputs[0].cview(),
                                          c.inputs[1].cview(), c.inputs[2].cview(),
                                          c.inputs[3].cview(), gradients);
                           });
  }
  if constexpr (causal<Dir>) {
    const auto make = [&](index_t batch) { return a.template make_state<T>(batch); };
    const auto state_demand = [&](index_t batch) {  // the key ring [w, d] and the memory [r, d]
      return demand({batch, s.heads, window, d}, sizeof(T)) | demand({batch, s.heads, r, d}, sizeof(T));
    };
    drive_decode<T>(
        fuzz, f, s.batch, s.time, s.heads, "Lavo decode", make, state_demand,
        [&](auto& c, auto& state) {
          a.forward(latte::exec::reference, c.inputs[0].cview(), c.inputs[1].cview(),
                    c.inputs[2].cview(), c.out.view(), state);
        },
        [&](auto& c, auto& state) {
          a.step(latte::exec::reference, state, c.inputs[0].cview(), c.inputs[1].cview(),
                 c.inputs[2].cview(), c.out.view());
        },
        [&](std::span<const std::byte> bytes) { return a.template load_state<T>(bytes); });
    drive_packed<T, 3>(fuzz, f, s.time, s.heads, "Lavo forward_packed", a, make, state_demand);
    if (fuzz.coin(2)) drive_pool<T, 3>(fuzz, f, s.heads, "Lavo StatePool", a);
  }
}

template <class T, class Dir>
void conv_compressed(Fuzz& fuzz, const Sizes& s) {
  latte::ConvCompressedDims dims{s.heads, fuzz.size(1, 16), fuzz.size(1, 16), fuzz.parameter(1, 6),
                                 fuzz.coin(8) ? fuzz.parameter(1, 4) : fuzz.in().ConsumeIntegralInRange<index_t>(1, 3)};
  if (fuzz.coin(4)) dims.window_left = fuzz.parameter(0, 45);
  if (fuzz.coin(4)) dims.window_right = fuzz.parameter(0, 45);
  // The weights are [H, M, Dv, Dv] per level: only sizes that fit get real ones;
  // the others get an empty set, which validation must refuse.
  const bool small = dims.heads >= 1 && dims.heads <= 8 && dims.key_dim >= 1 && dims.key_dim <= 16 &&
                     dims.value_dim >= 1 && dims.value_dim <= 16 && dims.group_size >= 1 &&
                     dims.group_size <= 8 && dims.levels >= 1 && dims.levels <= 4;
  latte::ConvCompressedParams params;
  if (small) {
    params = latte::ConvCompressedParams::zeros(dims);
    std::normal_distribution<double> normal(0.0, 0.3);
    std::mt19937_64 weights_rng(fuzz.in().ConsumeIntegral<std::uint64_t>());
    auto fill = [&](auto& tensor) {
      for (index_t i = 0; i < tensor.size(); ++i) tensor.data()[i] = normal(weights_rng);
    };
    for (auto& t : params.conv_weight) fill(t);
    for (auto& t : params.conv_bias) fill(t);
    for (auto& t : params.level_query) fill(t);
    for (auto& t : params.level_key) fill(t);
    for (auto& t : params.level_value) fill(t);
    fill(params.cross_query);
    fill(params.cross_key);
    fill(params.cross_value);
    switch (fuzz.in().ConsumeIntegralInRange<int>(0, 12)) {
      case 0: params.conv_weight.pop_back(); break;
      case 1: params.cross_key = latte::Tensor<double, 3>({dims.heads, dims.key_dim + 1, dims.value_dim}); break;
      case 2: params.conv_bias.front().data()[0] = NAN; break;
      case 3: if (!params.level_value.empty()) params.level_value.back() = {}; break;
      default: break;
    }
  }
  std::optional<latte::ConvCompressedAttention<Dir>> attention;
  const auto given_scale = scale(fuzz);
  if (!attempt([&] { attention.emplace(dims, params, given_scale); })) return;
  const auto& a = *attention;
  const auto& resolved = a.dims();
  const Features f{{resolved.key_dim, resolved.key_dim, resolved.value_dim}, resolved.value_dim,
                   tame(given_scale) ? 1e3 : 0};
  drive_forward<T>(fuzz, f, s.batch, s.time, s.heads, "ConvCompressedAttention forward", [&](auto& c) {
    a.forward(latte::exec::reference, c.inputs[0].cview(), c.inputs[1].cview(),
              c.inputs[2].cview(), c.out.view());
  });
  if (fuzz.coin(4)) {  // backward(q, k, v, d_out, {dq, dk, dv}) on either backend
    const bool on_cpu = fuzz.coin(2);
    drive_self_backward<T>(fuzz, f, s.batch, s.time, s.heads, tame(given_scale) ? 1e2 : 0,
                           "ConvCompressedAttention backward", [&](auto& c, auto& second, auto& third) {
                             const latte::ConvCompressedGradients<T> gradients{
                                 c.out.view(), second.out.view(), third.out.view()};
                             if (on_cpu)
                               a.backward(latte::exec::cpu, c.inputs[0].cview(), c.inputs[1].cview(),
                                          c.inputs[2].cview(), c.inputs[3].cview(), gradients);
                             else
                               a.backward(latte::exec::reference, c.inputs[0].cview(),
                                          c.inputs[1].cview(), c.inputs[2].cview(),
                                          c.inputs[3].cview(), gradients);
                           });
  }
  if constexpr (causal<Dir>) {
    const index_t capacity = fuzz.parameter(1, 60);
    // The window rings hold min(left + 1, capacity) keys; one group sum per level;
    // the store holds capacity / M^levels compressed keys and values.
    const index_t left = *resolved.window_left;
    const index_t ring = left >= capacity ? capacity : left + 1;
    index_t span = 1;  // M^levels, saturated
    for (index_t level = 0; level < resolved.levels && span <= capacity; ++level)
      if (__builtin_mul_overflow(span, resolved.group_size, &span)) span = capacity + 1;
    const index_t stored = capacity / span;
    const auto make = [&](index_t batch) { return a.template make_state<T>(batch, capacity); };
    const auto state_demand = [&](index_t batch) {
      return demand({batch, s.heads, resolved.levels, ring, resolved.key_dim}, sizeof(T)) |
             demand({batch, s.heads, resolved.levels, ring, resolved.value_dim}, sizeof(T)) |
             demand({batch, s.heads, resolved.levels, resolved.value_dim}, sizeof(T)) |
             demand({batch, s.heads, stored, resolved.value_dim}, sizeof(T)) |
             demand({batch, s.heads, stored, resolved.key_dim}, sizeof(T));
    };
    drive_decode<T>(
        fuzz, f, s.batch, s.time, s.heads, "ConvCompressedAttention decode", make, state_demand,
        [&](auto& c, auto& state) {
          a.forward(latte::exec::reference, c.inputs[0].cview(), c.inputs[1].cview(),
                    c.inputs[2].cview(), c.out.view(), state);
        },
        [&](auto& c, auto& state) {
          a.step(latte::exec::reference, state, c.inputs[0].cview(), c.inputs[1].cview(),
                 c.inputs[2].cview(), c.out.view());
        },
        [&](std::span<const std::byte> bytes) { return a.template load_state<T>(bytes); });
    if (fuzz.coin(4)) {  // backward from a state and to its gradient (training in chunks)
      using State = typename latte::ConvCompressedAttention<Dir>::template State<T>;
      std::optional<State> initial, d_final, d_initial;
      const index_t prelude = fuzz.parameter(0, 12);
      if (!attempt([&] {
            initial.emplace(make(s.batch));
            d_final.emplace(a.template make_state<T>(s.batch, fuzz.coin(4) ? capacity + 1 : capacity));
            d_initial.emplace(make(1));
            latte::Tensor<T, 4> q({s.batch, prelude, s.heads, resolved.key_dim});
            latte::Tensor<T, 4> v({s.batch, prelude, s.heads, resolved.value_dim}), out(v.extents());
            for (index_t i = 0; i < q.size(); ++i) q.data()[i] = T(0.25) * std::sin(T(i));
            for (index_t i = 0; i < v.size(); ++i) v.data()[i] = std::cos(T(i));
            a.forward(latte::exec::reference, q.cview(), q.cview(), v.cview(), out.view(), *initial);
            for (int field = 0; field < 5; ++field)
              std::fill_n(d_final->field(field), d_final->field_size(field), T(0.5));
          }, state_demand(s.batch) |
                 demand({s.batch, prelude, s.heads, resolved.key_dim + resolved.value_dim}, sizeof(T))))
        return;
      const int shape = fuzz.in().template ConsumeIntegralInRange<int>(0, 3);
      const latte::ConvCompressedStateGradients<T> states{
          .initial = shape == 3 ? nullptr : &*initial,
          .d_final = shape == 1 ? nullptr : &*d_final,
          .d_initial = shape == 2 ? &*initial : &*d_initial};  // 2: d_initial is initial (refused)
      const bool on_cpu = fuzz.coin(2);
      drive_self_backward<T>(fuzz, f, s.batch, s.time, s.heads, tame(given_scale) ? 1e2 : 0,
                             "ConvCompressedAttention backward with states",
                             [&](auto& c, auto& second, auto& third) {
                               const latte::ConvCompressedGradients<T> gradients{
                                   c.out.view(), second.out.view(), third.out.view()};
                               if (on_cpu)
                                 a.backward(latte::exec::cpu, c.inputs[0].cview(), c.inputs[1].cview(),
                                            c.inputs[2].cview(), c.inputs[3].cview(), gradients, states);
                               else
                                 a.backward(latte::exec::reference, c.inputs[0].cview(),
                                            c.inputs[1].cview(), c.inputs[2].cview(),
                                            c.inputs[3].cview(), gradients, states);
                               if (shape == 2) fail("ConvCompressedAttention backward: d_initial = initial accepted");
                               for (int field = 0; field < 5; ++field)
                                 for (std::size_t i = 0; i < d_initial->field_size(field); ++i)
                                   if (!std::isfinite(static_cast<double>(d_initial->field(field)[i])) &&
                                       tame(given_scale))
                                     fail("ConvCompressedAttention backward: a state gradient is not finite");
                             });
    }
    drive_packed<T, 3>(fuzz, f, s.time, s.heads, "ConvCompressedAttention forward_packed", a, make, state_demand);
    if (fuzz.coin(2)) drive_pool<T, 3>(fuzz, f, s.heads, "ConvCompressedAttention StatePool", a, capacity);
  }
}

// --------------------------------------------------------------- dispatch --

template <class T, class Dir>
void run_direction(Fuzz& fuzz, const Sizes& s) {
  using namespace latte;
  const bool cpu = fuzz.coin(2);
  switch (fuzz.in().ConsumeIntegralInRange<int>(0, 17)) {
    case 0: cpu ? latte_attention<T, exec::cpu_t, Dir, NoPositional>(fuzz, s)
                : latte_attention<T, exec::reference_t, Dir, NoPositional>(fuzz, s); break;
    case 1: cpu ? latte_attention<T, exec::cpu_t, Dir, VAPOR>(fuzz, s)
                : latte_attention<T, exec::reference_t, Dir, VAPOR>(fuzz, s); break;
    case 2: cpu ? softmax_attention<T, exec::cpu_t, Dir, NoWindow>(fuzz, s)
                : softmax_attention<T, exec::reference_t, Dir, NoWindow>(fuzz, s); break;
    case 3: cpu ? softmax_attention<T, exec::cpu_t, Dir, SlidingWindow>(fuzz, s)
                : softmax_attention<T, exec::reference_t, Dir, SlidingWindow>(fuzz, s); break;
    case 4: macchiato<T, Dir, NoPositional, NoPositional>(fuzz, s); break;
    case 5: macchiato<T, Dir, VAPOR, NoPositional>(fuzz, s); break;
    case 6: macchiato<T, Dir, NoPositional, RoPE>(fuzz, s); break;
    case 7: macchiato<T, Dir, VAPOR, RoPE>(fuzz, s); break;
    case 8: linear_attention<T, Dir, Relu, NoReweight, NoPositional>(fuzz, s); break;
    case 9: linear_attention<T, Dir, EluPlusOne, NoReweight, NoPositional>(fuzz, s); break;
    case 10: linear_attention<T, Dir, Identity, NoReweight, NoPositional>(fuzz, s); break;
    case 11: linear_attention<T, Dir, Relu, NoReweight, RoPE>(fuzz, s); break;
    case 12: linear_attention<T, Dir, Relu, CosFormerReweight, NoPositional>(fuzz, s); break;
    case 13: linear_attention<T, Dir, Relu, LeaPReweight, NoPositional>(fuzz, s); break;
    case 14: lavo<T, Dir>(fuzz, s); break;
    case 15: conv_compressed<T, Dir>(fuzz, s); break;
    case 16: cpu ? latte_attention<T, exec::cpu_t, Dir, NoPositional>(fuzz, s)
                 : softmax_attention<T, exec::cpu_t, Dir, NoWindow>(fuzz, s); break;
    default: linear_attention<T, Dir, EluPlusOne, CosFormerReweight, RoPE>(fuzz, s); break;
  }
}


/// One input's calls in dtype T (instantiated in fuzz_attention_<dtype>.cpp).
template <class T>
void run(Fuzz& fuzz, const Sizes& s, bool is_causal) {
  is_causal ? run_direction<T, latte::Causal>(fuzz, s) : run_direction<T, latte::Bidirectional>(fuzz, s);
}
extern template void run<float>(Fuzz&, const Sizes&, bool);
extern template void run<double>(Fuzz&, const Sizes&, bool);

}  // namespace latte_fuzz
