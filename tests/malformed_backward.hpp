#pragma once
// The malformed-call machinery (malformed_cases.hpp) for entry points with
// several outputs: a backward takes the forward's inputs and d_out and writes
// one gradient per input. Each row changes one thing of an otherwise valid call:
// each extent of each argument off by one, null data, a feature stride of 2, a
// negative stride; each gradient over the start and over the tail of each input
// and of each earlier gradient, and with a zero stride. Every buffer is compared
// byte for byte before and after.
#include <algorithm>
#include <cstddef>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "malformed_cases.hpp"

namespace latte::test::malformed {

/// An entry point with tensor inputs and several tensor outputs.
template <std::size_t N>
struct MultiOutputEntry {
  std::string entry;
  std::vector<Arg<N>> inputs, outputs;
  std::array<const char*, N> dim_names{};
  std::function<void(const std::vector<TensorView<const float, N>>&,
                     const std::vector<TensorView<float, N>>&)>
      invoke;
  /// The argument an error must name when extent `dim` of argument `arg`
  /// (inputs first, then outputs) is off; empty: the argument itself.
  std::function<std::string(std::size_t arg, std::size_t dim)> blame;
};

/// The buffers of one call: inputs filled with small finite numbers, outputs
/// with kSentinel. A Malformation's `arg` and `other` count inputs first, then
/// outputs; out_aliases / out_tail put output `arg` over argument `other`.
template <std::size_t N>
struct MultiBuffers {
  std::vector<std::vector<float>> storage, snapshot;
  std::vector<TensorView<const float, N>> inputs;
  std::vector<TensorView<float, N>> outputs;

  [[nodiscard]] bool untouched() const { return storage == snapshot; }
  [[nodiscard]] bool outputs_fully_written(std::size_t first_output) const {
    for (std::size_t j = first_output; j < storage.size(); ++j)
      for (float x : storage[j])
        if (x == kSentinel) return false;
    return true;
  }
};

template <std::size_t N>
std::shared_ptr<MultiBuffers<N>> make_multi_buffers(const MultiOutputEntry<N>& entry,
                                                    const Malformation& m) {
  auto buffers = std::make_shared<MultiBuffers<N>>();
  const std::size_t k = entry.inputs.size(), count = k + entry.outputs.size();
  std::vector<std::array<index_t, N>> extents(count), strides(count);
  std::vector<index_t> offsets(count, 0), needed(count, 0);
  for (std::size_t j = 0; j < count; ++j) {
    extents[j] = j < k ? entry.inputs[j].extents : entry.outputs[j - k].extents;
    if (m.fault == Fault::extent && m.arg == j) extents[j][m.dim] += 1;
    strides[j] = contiguous_strides(extents[j]);
    needed[j] = element_count(extents[j]);
    if (m.arg == j && m.fault == Fault::feature_stride) {
      for (index_t& s : strides[j]) s *= 2;
      needed[j] *= 2;
    }
    if (m.arg == j && m.fault == Fault::negative_stride) {
      offsets[j] = (extents[j][0] - 1) * strides[j][0];
      strides[j][0] = -strides[j][0];
    }
    if (m.arg == j && m.fault == Fault::out_zero_stride) strides[j][0] = 0;
  }
  const bool over = m.fault == Fault::out_aliases || m.fault == Fault::out_tail;
  index_t over_offset = 0;
  if (over) {
    over_offset = m.fault == Fault::out_tail ? needed[m.other] / 2 : 0;
    needed[m.other] = std::max(needed[m.other], over_offset + needed[m.arg]);
  }
  buffers->storage.resize(count);
  for (std::size_t j = 0; j < count; ++j) {
    auto& buffer = buffers->storage[j];
    buffer.resize(static_cast<std::size_t>(std::max<index_t>(needed[j], 1)));
    for (std::size_t i = 0; i < buffer.size(); ++i)
      buffer[i] = j < k ? 0.05f * static_cast<float>((i * 7 + j * 3) % 13) - 0.25f : kSentinel;
  }
  auto data_of = [&](std::size_t j) -> float* {
    if (m.fault == Fault::null_data && m.arg == j) return nullptr;
    if (over && m.arg == j) return buffers->storage[m.other].data() + over_offset;
    return buffers->storage[j].data() + offsets[j];
  };
  for (std::size_t j = 0; j < count; ++j) {
    if (j < k)
      buffers->inputs.emplace_back(data_of(j), extents[j], strides[j]);
    else
      buffers->outputs.emplace_back(data_of(j), extents[j], strides[j]);
  }
  buffers->snapshot = buffers->storage;
  return buffers;
}

template <std::size_t N>
Outcome run_multi_entry(const MultiOutputEntry<N>& entry, const Malformation& m) {
  const auto buffers = make_multi_buffers(entry, m);
  return attempt([&] { entry.invoke(buffers->inputs, buffers->outputs); },
                 [&] { return buffers->untouched(); });
}

/// The valid call: must not throw and must write every element of every output.
template <std::size_t N>
ValidCall<N> run_valid_multi(const MultiOutputEntry<N>& entry) {
  ValidCall<N> result;
  const auto buffers = make_multi_buffers(entry, Malformation{});
  try {
    entry.invoke(buffers->inputs, buffers->outputs);
  } catch (const std::exception& error) {
    result.threw = true;
    result.what = error.what();
  }
  result.out_written = buffers->outputs_fully_written(entry.inputs.size());
  return result;
}

template <std::size_t N>
void add_multi_output_rows(Table& table, const MultiOutputEntry<N>& entry) {
  const std::size_t k = entry.inputs.size(), count = k + entry.outputs.size();
  auto name_of = [&](std::size_t j) {
    return j < k ? entry.inputs[j].name : entry.outputs[j - k].name;
  };
  auto add = [&](std::string case_name, std::string argument, Malformation m) {
    table.push_back({entry.entry, std::move(case_name), std::move(argument),
                     [entry, m] { return run_multi_entry(entry, m); }});
  };
  for (std::size_t j = 0; j < count; ++j) {
    const std::string name = name_of(j);
    for (std::size_t d = 0; d < N; ++d)
      add(name + ": extent " + entry.dim_names[d] + " + 1", entry.blame ? entry.blame(j, d) : name,
          {.fault = Fault::extent, .arg = j, .dim = d});
    add(name + ": null data", name, {.fault = Fault::null_data, .arg = j});
    add(name + ": feature stride 2", name, {.fault = Fault::feature_stride, .arg = j});
    add(name + ": negative stride", name, {.fault = Fault::negative_stride, .arg = j});
  }
  for (std::size_t j = k; j < count; ++j) {
    const std::string name = name_of(j);
    for (std::size_t other = 0; other < j; ++other) {  // every input, every earlier output
      add(name + " aliases " + name_of(other), name,
          {.fault = Fault::out_aliases, .arg = j, .other = other});
      add(name + " overlaps the tail of " + name_of(other), name,
          {.fault = Fault::out_tail, .arg = j, .other = other});
    }
    add(name + ": stride 0 on dimension " + entry.dim_names[0], name,
        {.fault = Fault::out_zero_stride, .arg = j});
  }
}

}  // namespace latte::test::malformed
