#pragma once
// The machinery of the malformed-call table (test_malformed_table.cpp).
//
// A row is one entry point called with exactly one thing wrong. Running it
// records what was thrown (latte::Error, another exception, or nothing), the
// argument the error names, and whether every buffer the call could write
// (out, the inputs it may alias, the decode state) is byte-for-byte as before.
// Tensor arguments get the same malformations everywhere (TensorEntry +
// add_tensor_rows): each extent off by one, null data, a feature stride of 2,
// a negative stride, out aliasing each input, out overlapping the tail of an
// input, out addressing an element twice.
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "state_bytes.hpp"
#include "support.hpp"

namespace latte::test::malformed {

/// What a row's call did.
struct Outcome {
  enum class Thrown { nothing, latte_error, other } thrown = Thrown::nothing;
  std::string argument;   ///< latte::Error::argument()
  std::string what;       ///< what() of whatever was thrown
  bool untouched = true;  ///< nothing the call could write changed
};

struct Row {
  std::string entry;      ///< "LatteAttention<causal,running_max,vapor>::step [cpu]"
  std::string case_name;  ///< "values: extent H + 1"
  std::string argument;   ///< the argument the error must name
  std::function<Outcome()> run;
};
using Table = std::vector<Row>;

/// Runs `call` and records what it threw; `untouched` is asked afterwards.
template <class Call, class Untouched>
Outcome attempt(Call&& call, Untouched&& untouched) {
  Outcome outcome;
  try {
    call();
  } catch (const latte::Error& error) {
    outcome.thrown = Outcome::Thrown::latte_error;
    outcome.argument = error.argument();
    outcome.what = error.what();
  } catch (const std::exception& error) {
    outcome.thrown = Outcome::Thrown::other;
    outcome.what = error.what();
  } catch (...) {
    outcome.thrown = Outcome::Thrown::other;
    outcome.what = "<not a std::exception>";
  }
  outcome.untouched = untouched();
  return outcome;
}

/// A row whose call has no output to check (constructors, make_state, load_state).
inline void add_call_row(Table& table, std::string entry, std::string case_name,
                         std::string argument, std::function<void()> call) {
  table.push_back({std::move(entry), std::move(case_name), std::move(argument),
                   [call = std::move(call)] { return attempt(call, [] { return true; }); }});
}

/// Output of attention is bounded by the values; no valid call writes this.
constexpr float kSentinel = -1.0e30f;

/// A named tensor argument and its valid extents.
template <std::size_t N>
struct Arg {
  std::string name;
  std::array<index_t, N> extents;
};

enum class Fault {
  none,
  extent,           ///< extents[dim] + 1
  null_data,        ///< data() == nullptr with the valid extents
  feature_stride,   ///< every stride doubled: the feature dimension is not contiguous
  negative_stride,  ///< stride of dimension 0 negated (data still in bounds)
  out_aliases,      ///< out starts at the buffer of input `other`
  out_tail,         ///< out starts in the middle of input `other`'s buffer
  out_zero_stride,  ///< out's dimension 0 has stride 0: elements addressed twice
};

struct Malformation {
  Fault fault = Fault::none;
  std::size_t arg = 0;    ///< inputs 0..k-1, k = out
  std::size_t dim = 0;    ///< for Fault::extent
  std::size_t other = 0;  ///< the aliased input for out_aliases / out_tail
};

/// The buffers behind one call, inputs filled with small finite numbers and
/// out with kSentinel, plus a snapshot of every buffer taken before the call.
template <std::size_t N>
struct Buffers {
  std::vector<std::vector<float>> storage;
  std::vector<std::vector<float>> snapshot;
  std::vector<TensorView<const float, N>> inputs;
  TensorView<float, N> out;

  void take_snapshot() { snapshot = storage; }
  [[nodiscard]] bool untouched() const {
    for (std::size_t i = 0; i < storage.size(); ++i)
      if (storage[i].size() != snapshot[i].size() ||
          std::memcmp(storage[i].data(), snapshot[i].data(), storage[i].size() * sizeof(float)))
        return false;
    return true;
  }
  /// Every element of a valid out was written (none still holds the sentinel).
  [[nodiscard]] bool out_fully_written() const {
    bool written = true;
    const std::size_t k = inputs.size();
    for (float x : storage[k]) written = written && x != kSentinel;
    return written;
  }
};

template <std::size_t N>
[[nodiscard]] std::array<index_t, N> contiguous_strides(const std::array<index_t, N>& extents) {
  std::array<index_t, N> strides{};
  index_t stride = 1;
  for (std::size_t d = N; d-- > 0;) {
    strides[d] = stride;
    stride *= extents[d];
  }
  return strides;
}

template <std::size_t N>
[[nodiscard]] index_t element_count(const std::array<index_t, N>& extents) {
  index_t count = 1;
  for (index_t e : extents) count *= e;
  return count;
}

/// Buffers for `inputs` and `out` with malformation `m` applied.
template <std::size_t N>
std::shared_ptr<Buffers<N>> make_buffers(const std::vector<Arg<N>>& inputs, const Arg<N>& out,
                                         const Malformation& m) {
  auto buffers = std::make_shared<Buffers<N>>();
  const std::size_t k = inputs.size();
  buffers->storage.resize(k + 1);
  std::vector<std::array<index_t, N>> extents(k + 1), strides(k + 1);
  std::vector<index_t> offsets(k + 1, 0), needed(k + 1, 0);
  for (std::size_t j = 0; j <= k; ++j) {
    extents[j] = j < k ? inputs[j].extents : out.extents;
    if (m.fault == Fault::extent && m.arg == j) extents[j][m.dim] += 1;
    strides[j] = contiguous_strides(extents[j]);
    needed[j] = element_count(extents[j]);
    if (m.arg == j && m.fault == Fault::feature_stride) {
      for (index_t& s : strides[j]) s *= 2;
      needed[j] *= 2;
    }
    if (m.arg == j && m.fault == Fault::negative_stride) {
      offsets[j] = (extents[j][0] - 1) * strides[j][0];  // element 0 of the last slice
      strides[j][0] = -strides[j][0];
    }
    if (j == k && m.fault == Fault::out_zero_stride) strides[j][0] = 0;
  }
  // Out written over an input's buffer: that buffer must hold both.
  index_t out_offset = 0;
  if (m.fault == Fault::out_aliases || m.fault == Fault::out_tail) {
    out_offset = m.fault == Fault::out_tail ? needed[m.other] / 2 : 0;
    needed[m.other] = std::max(needed[m.other], out_offset + needed[k]);
  }
  for (std::size_t j = 0; j <= k; ++j) {
    auto& buffer = buffers->storage[j];
    buffer.resize(static_cast<std::size_t>(std::max<index_t>(needed[j], 1)));
    for (std::size_t i = 0; i < buffer.size(); ++i)
      buffer[i] = j < k ? 0.05f * static_cast<float>((i * 7 + j * 3) % 13) - 0.25f : kSentinel;
  }
  for (std::size_t j = 0; j < k; ++j) {
    const float* data = buffers->storage[j].data() + offsets[j];
    if (m.fault == Fault::null_data && m.arg == j) data = nullptr;
    buffers->inputs.emplace_back(data, extents[j], strides[j]);
  }
  float* out_data = buffers->storage[k].data() + offsets[k];
  if (m.fault == Fault::out_aliases || m.fault == Fault::out_tail)
    out_data = buffers->storage[m.other].data() + out_offset;
  if (m.fault == Fault::null_data && m.arg == k) out_data = nullptr;
  buffers->out = TensorView<float, N>(out_data, extents[k], strides[k]);
  buffers->take_snapshot();
  return buffers;
}

/// An entry point with N-dimensional tensor arguments (inputs..., out). The
/// closures share whatever else the call needs (the attention, a state).
template <std::size_t N>
struct TensorEntry {
  std::string entry;
  std::vector<Arg<N>> inputs;
  Arg<N> out;
  std::array<const char*, N> dim_names{};
  /// Sets up a fresh context (e.g. a new decode state) before each call; may be empty.
  std::function<void()> prepare;
  std::function<void(const std::vector<TensorView<const float, N>>&, TensorView<float, N>)> invoke;
  /// The saved bytes of the state the call may change; may be empty (stateless).
  std::function<std::vector<std::byte>()> state_bytes;
  /// The argument an error must name when extent `dim` of argument `arg`
  /// (k = out) is off; nullopt when that extent is free (not a malformation).
  /// Empty: the argument itself.
  std::function<std::optional<std::string>(std::size_t arg, std::size_t dim)> blame;
};

/// Runs `entry` on buffers with malformation `m`.
template <std::size_t N>
Outcome run_entry(const TensorEntry<N>& entry, const Malformation& m) {
  if (entry.prepare) entry.prepare();
  const auto buffers = make_buffers(entry.inputs, entry.out, m);
  const std::vector<std::byte> before =
      entry.state_bytes ? entry.state_bytes() : std::vector<std::byte>{};
  return attempt([&] { entry.invoke(buffers->inputs, buffers->out); },
                 [&] {
                   const bool state_same = !entry.state_bytes || entry.state_bytes() == before;
                   return buffers->untouched() && state_same;
                 });
}

/// The valid call of an entry: must not throw and must write every output element.
template <std::size_t N>
struct ValidCall {
  bool threw = false;
  std::string what;
  bool out_written = false;
};
template <std::size_t N>
ValidCall<N> run_valid(const TensorEntry<N>& entry) {
  ValidCall<N> result;
  if (entry.prepare) entry.prepare();
  const auto buffers = make_buffers(entry.inputs, entry.out, Malformation{});
  try {
    entry.invoke(buffers->inputs, buffers->out);
  } catch (const std::exception& error) {
    result.threw = true;
    result.what = error.what();
  }
  result.out_written = buffers->out_fully_written();
  return result;
}

/// The generic rows of a tensor entry: every extent of every argument off by
/// one, null data, feature stride 2, a negative stride; out aliasing every
/// input, overlapping the tail of every input, and with a zero stride.
template <std::size_t N>
void add_tensor_rows(Table& table, const TensorEntry<N>& entry) {
  const std::size_t k = entry.inputs.size();
  auto name_of = [&](std::size_t j) { return j < k ? entry.inputs[j].name : entry.out.name; };
  auto add = [&](std::string case_name, std::string argument, Malformation m) {
    table.push_back({entry.entry, std::move(case_name), std::move(argument),
                     [entry, m] { return run_entry(entry, m); }});
  };
  for (std::size_t j = 0; j <= k; ++j) {
    const std::string name = name_of(j);
    for (std::size_t d = 0; d < N; ++d) {
      std::optional<std::string> blamed = name;
      if (entry.blame) blamed = entry.blame(j, d);
      if (!blamed) continue;
      add(name + ": extent " + entry.dim_names[d] + " + 1", *blamed,
          {.fault = Fault::extent, .arg = j, .dim = d});
    }
    add(name + ": null data", name, {.fault = Fault::null_data, .arg = j});
    add(name + ": feature stride 2", name, {.fault = Fault::feature_stride, .arg = j});
    add(name + ": negative stride", name, {.fault = Fault::negative_stride, .arg = j});
  }
  for (std::size_t i = 0; i < k; ++i) {
    add("out aliases " + entry.inputs[i].name, entry.out.name,
        {.fault = Fault::out_aliases, .arg = k, .other = i});
    add("out overlaps the tail of " + entry.inputs[i].name, entry.out.name,
        {.fault = Fault::out_tail, .arg = k, .other = i});
  }
  if (entry.out.extents[0] > 1)
    add("out: stride 0 on dimension " + std::string(entry.dim_names[0]), entry.out.name,
        {.fault = Fault::out_zero_stride, .arg = k});
}

/// A call on the valid buffers of `entry` after `tamper` changed its context
/// (e.g. swapped in a wrong state): the error must name `argument` and no
/// buffer or state may change.
template <std::size_t N>
void add_context_row(Table& table, const TensorEntry<N>& entry, std::string case_name,
                     std::string argument, std::function<void()> tamper) {
  table.push_back(
      {entry.entry, std::move(case_name), std::move(argument), [entry, tamper = std::move(tamper)] {
         if (entry.prepare) entry.prepare();
         tamper();
         const auto buffers = make_buffers(entry.inputs, entry.out, Malformation{});
         const std::vector<std::byte> before =
             entry.state_bytes ? entry.state_bytes() : std::vector<std::byte>{};
         return attempt([&] { entry.invoke(buffers->inputs, buffers->out); },
                        [&] {
                          return buffers->untouched() &&
                                 (!entry.state_bytes || entry.state_bytes() == before);
                        });
       }});
}

// ------------------------------------------------------------ state bytes --

/// Bytes that are not a valid state of the target: each is a case of its own.
struct BadBytes {
  std::string case_name;
  std::vector<std::byte> bytes;
};

/// The offset of the saved position in saved bytes: after the magic (8), the
/// kind (u64 length + text) and the sizes (u64 count, then u64 length + name
/// and i64 value each); docs/state-format.md.
inline std::size_t saved_position_offset(const std::vector<std::byte>& bytes) {
  std::size_t at = 8;
  auto u64_at = [&](std::size_t offset) {
    std::uint64_t value = 0;
    std::memcpy(&value, bytes.data() + offset, sizeof value);
    return static_cast<std::size_t>(value);
  };
  at += 8 + u64_at(at);
  const std::size_t size_count = u64_at(at);
  at += 8;
  for (std::size_t i = 0; i < size_count; ++i) at += 8 + u64_at(at) + 8;
  return at;
}

/// `bytes` with the saved position replaced by `position`, re-signed.
inline std::vector<std::byte> with_saved_position(std::vector<std::byte> bytes,
                                                  std::int64_t position) {
  std::memcpy(bytes.data() + saved_position_offset(bytes), &position, sizeof position);
  return resigned(std::move(bytes));
}

/// Variants of valid saved bytes that a loader must refuse: truncations, a
/// trailing byte, an empty buffer, garbage, a corrupted magic, a flipped bit in
/// the data or the checksum, format 2 bytes; and, re-signed so that the check
/// behind the checksum is what refuses them, a corrupted kind, sizes, position
/// and field table. `valid` must be a saved state.
inline std::vector<BadBytes> damaged_bytes(const std::vector<std::byte>& valid) {
  std::vector<BadBytes> cases;
  cases.push_back({"truncated by one byte", {valid.begin(), valid.end() - 1}});
  cases.push_back({"truncated to half", {valid.begin(), valid.begin() + valid.size() / 2}});
  cases.push_back({"truncated inside the magic", {valid.begin(), valid.begin() + 5}});
  auto longer = valid;
  longer.push_back(std::byte{0});
  cases.push_back({"one trailing byte", longer});
  auto inner = valid;
  inner.insert(inner.end() - 4, std::byte{0});
  cases.push_back({"one byte more data (re-signed)", resigned(inner)});
  cases.push_back({"empty buffer", {}});
  std::vector<std::byte> garbage(valid.size());
  for (std::size_t i = 0; i < garbage.size(); ++i)
    garbage[i] = static_cast<std::byte>((i * 131 + 17) & 0xff);
  cases.push_back({"garbage of the same length", garbage});
  auto magic = valid;
  magic[0] = std::byte{'X'};
  cases.push_back({"corrupted magic", magic});
  auto format2 = valid;
  format2[7] = std::byte{'2'};
  format2.resize(format2.size() - 4);
  cases.push_back({"format 2 bytes (no checksum)", format2});
  auto data_bit = valid;
  data_bit[valid.size() - 5] ^= std::byte{0x01};
  cases.push_back({"one bit flipped in the last data byte", data_bit});
  auto checksum_bit = valid;
  checksum_bit.back() ^= std::byte{0x80};
  cases.push_back({"one bit flipped in the checksum", checksum_bit});
  // After the magic (8) the kind string: u64 length + text.
  std::uint64_t kind_length = 0;
  std::memcpy(&kind_length, valid.data() + 8, sizeof kind_length);
  auto kind = valid;
  kind[16] = static_cast<std::byte>(static_cast<unsigned char>(kind[16]) ^ 0x20);  // case flip
  cases.push_back({"corrupted kind string", resigned(kind)});
  auto huge_kind = valid;
  const std::uint64_t huge = ~std::uint64_t{0} / 2;
  std::memcpy(huge_kind.data() + 8, &huge, sizeof huge);
  cases.push_back({"kind length beyond the buffer", resigned(huge_kind)});
  // Sizes: u64 count, then (u64 length + name, i64 value) each; then i64 position.
  std::size_t at = 16 + kind_length;
  auto many_sizes = valid;
  const std::uint64_t too_many = 1u << 20;
  std::memcpy(many_sizes.data() + at, &too_many, sizeof too_many);
  cases.push_back({"size count 2^20", resigned(many_sizes)});
  at += 8;
  const std::size_t first_size_value = at + 8 + [&] {
    std::uint64_t n = 0;
    std::memcpy(&n, valid.data() + at, sizeof n);
    return static_cast<std::size_t>(n);
  }();
  auto big_batch = valid;
  const std::int64_t batch = std::int64_t{1} << 40;
  std::memcpy(big_batch.data() + first_size_value, &batch, sizeof batch);
  cases.push_back({"batch 2^40", resigned(big_batch)});
  auto negative_batch = valid;
  const std::int64_t minus_one = -1;
  std::memcpy(negative_batch.data() + first_size_value, &minus_one, sizeof minus_one);
  cases.push_back({"batch -1", resigned(negative_batch)});
  cases.push_back({"position -1", with_saved_position(valid, -1)});
  at = saved_position_offset(valid) + 8;
  auto fields = valid;
  std::uint64_t field_count = 0;
  std::memcpy(&field_count, valid.data() + at, sizeof field_count);
  const std::uint64_t one_more = field_count + 1;
  std::memcpy(fields.data() + at, &one_more, sizeof one_more);
  cases.push_back({"field count + 1", resigned(fields)});
  // First field: u64 length + name, then u64 count.
  at += 8;
  std::uint64_t name_length = 0;
  std::memcpy(&name_length, valid.data() + at, sizeof name_length);
  auto field_size = valid;
  std::uint64_t count = 0;
  std::memcpy(&count, valid.data() + at + 8 + name_length, sizeof count);
  ++count;
  std::memcpy(field_size.data() + at + 8 + name_length, &count, sizeof count);
  cases.push_back({"first field one element longer", resigned(field_size)});
  return cases;
}

/// restore() rows: `fresh` makes the target state, each bad buffer must be
/// refused naming "bytes", and the state must be unchanged afterwards.
template <class State>
void add_restore_rows(Table& table, const std::string& entry, std::function<State()> fresh,
                      const std::vector<BadBytes>& cases) {
  for (const BadBytes& bad : cases)
    table.push_back({entry, bad.case_name, "bytes", [fresh, bytes = bad.bytes] {
                       auto state = std::make_shared<State>(fresh());
                       const auto before = state->save();
                       return attempt([&] { state->restore(bytes); },
                                      [&] { return state->save() == before; });
                     }});
}

/// load_state() rows: every bad buffer must be refused naming "bytes".
template <class Load>
void add_load_rows(Table& table, const std::string& entry, Load load,
                   const std::vector<BadBytes>& cases) {
  for (const BadBytes& bad : cases)
    add_call_row(table, entry, bad.case_name, "bytes",
                 [load, bytes = bad.bytes] { (void)load(std::span<const std::byte>(bytes)); });
}

}  // namespace latte::test::malformed
