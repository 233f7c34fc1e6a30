// The malformed-call table (issue 7, item 1): every public entry point of every
// mechanism x every malformed case, in one place, checked the same way.
//
// Entry points: forward, forward with a state, forward_packed, StatePool (every causal mechanism),
// the same four with bf16 activations (HalfPrecision; LatteAttention's own bf16 forward
// on exec::cpu, and the bidirectional one with latte::bf16_products) for Latte, softmax, Macchiato, the linear family, LAVO and conv-compression,
// make_state, step, State::restore,
// backward (SoftmaxAttention, LatteAttention, LatteMacchiato, LinearAttention and
// its cross_backward, reference + cpu; malformed_backward.hpp),
// load_state and the constructors of LatteAttention (reference + cpu),
// SoftmaxAttention (reference + cpu), LatteMacchiato, LinearAttention, CosFormer
// and LeaPformer (reference + cpu), Lavo, ConvCompressedAttention, cross_forward where a
// mechanism has it, and the orthonormal_bases helper (plus the LeaPModule and
// angle-table builders).
//
// Each row changes exactly one thing in an otherwise valid call and must
//  - throw latte::Error (not another exception type, not nothing),
//  - name the expected argument in argument() and in what(),
//  - leave every buffer the call could write (out, inputs it might alias, the
//    decode state's saved bytes) byte-for-byte unchanged.
// The valid call of every tensor entry is run first and must succeed and write
// all of out, so no row passes because the fixture itself is broken.
//
// Conventions the expected names encode: a forward takes B and T from its
// first tensor, so a first tensor with another B or T is reported on the next
// tensor, which then disagrees; a step takes B from the state, so a state of
// another batch is reported on the first step tensor. A float64 state cannot
// be passed to a float32 call at all (checked at compile time below).
#include <doctest/doctest.h>

#include <array>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "malformed_backward.hpp"
#include "half_shadow.hpp"
#include "malformed_cases.hpp"
#include "state_bytes.hpp"
#include "support.hpp"

namespace test_malformed_table {  // every test file's own namespace: tests/CMakeLists.txt

namespace {
using namespace latte;
using namespace latte::test;
using namespace latte::test::malformed;

constexpr index_t kB = 2, kT = 5, kH = 3, kL = 4, kDk = 4, kDv = 6, kWindow = 2;
constexpr index_t kSource = 7;     // cross-attention source length (!= kT)
constexpr index_t kCapacity = 64;  // KV-cache / context capacity / cosFormer M for decode
constexpr index_t kLavoBases = 3;  // r < d = kDk
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInf = std::numeric_limits<double>::infinity();

using In4 = std::vector<TensorView<const float, 4>>;
using In3 = std::vector<TensorView<const float, 3>>;
using Out4 = TensorView<float, 4>;
using Out3 = TensorView<float, 3>;
constexpr std::array<const char*, 4> kSequenceDims{"B", "T", "H", "F"};
constexpr std::array<const char*, 3> kStepDims{"B", "H", "F"};

/// Calls f(in[0], ..., in[K-1]).
template <std::size_t K, class F, class V>
decltype(auto) spread(F&& f, const V& in) {
  auto call = [&]<std::size_t... I>(std::index_sequence<I...>) -> decltype(auto) {
    return f(in[I]...);
  };
  return call(std::make_index_sequence<K>{});
}

struct Feature {
  std::string name;
  index_t dim;
};

// ------------------------------------------------------------- mechanisms --
// One adapter per configuration: its attention type, how to build it, the
// names and feature sizes of its tensors, and how to make its states.

struct LatteVapor {
  using A = LatteAttention<Causal, RunningMax, VAPOR>;
  static constexpr const char* name = "LatteAttention<causal,running_max,vapor>";
  static constexpr std::size_t arity = 3;
  static A make(index_t heads = kH) { return A({.heads = heads, .latents = kL, .value_dim = kDv}); }
  static std::vector<Feature> features() {
    return {{"query_logits", kL}, {"key_logits", kL}, {"values", kDv}};
  }
  static constexpr index_t out_dim = kDv;
  template <Real T>
  static auto make_state(const A& a, index_t batch) {
    return a.template make_state<T>(batch);
  }
  static auto other_kind_state(index_t batch) {  // same State type, no VAPOR
    return LatteAttention<Causal>({.heads = kH, .latents = kL, .value_dim = kDv})
        .make_state<float>(batch);
  }
};

struct LatteBidirectional {
  using A = LatteAttention<Bidirectional>;
  static constexpr const char* name = "LatteAttention<bidirectional>";
  static constexpr std::size_t arity = 3;
  static A make(index_t heads = kH) { return A({.heads = heads, .latents = kL, .value_dim = kDv}); }
  static std::vector<Feature> features() { return LatteVapor::features(); }
  static constexpr index_t out_dim = kDv;
};

struct SoftmaxCausal {
  using A = SoftmaxAttention<Causal>;
  static constexpr const char* name = "SoftmaxAttention<causal>";
  static constexpr std::size_t arity = 3;
  static A make(index_t heads = kH) {
    return A({.heads = heads, .key_dim = kDk, .value_dim = kDv});
  }
  static std::vector<Feature> features() {
    return {{"queries", kDk}, {"keys", kDk}, {"values", kDv}};
  }
  static constexpr index_t out_dim = kDv;
  template <Real T>
  static auto make_state(const A& a, index_t batch) {
    return a.template make_state<T>(batch, kCapacity);
  }
  static auto other_kind_state(index_t batch) {  // same KVCache type, a sliding window
    return SoftmaxAttention<Causal, SlidingWindow>({.heads = kH, .key_dim = kDk, .value_dim = kDv},
                                                   SlidingWindow{.left = kCapacity - 1})
        .make_state<float>(batch);
  }
};

struct SoftmaxWindowed {
  using A = SoftmaxAttention<Bidirectional, SlidingWindow>;
  static constexpr const char* name = "SoftmaxAttention<bidirectional,sliding_window>";
  static constexpr std::size_t arity = 3;
  static A make(index_t heads = kH) {
    return A({.heads = heads, .key_dim = kDk, .value_dim = kDv},
             SlidingWindow{.left = 2, .right = 1});
  }
  static std::vector<Feature> features() { return SoftmaxCausal::features(); }
  static constexpr index_t out_dim = kDv;
};

using MacchiatoType = LatteMacchiato<Causal, RunningMax, VAPOR, RoPE>;
struct Macchiato {
  using A = MacchiatoType;
  static constexpr const char* name = "LatteMacchiato<causal,running_max,vapor,rope>";
  static constexpr std::size_t arity = 5;
  static A make(index_t heads = kH) {
    return A({.heads = heads, .latents = kL, .key_dim = kDk, .value_dim = kDv, .window = kWindow});
  }
  static std::vector<Feature> features() {
    return {{"query_logits", kL + 1},
            {"key_logits", kL},
            {"window_queries", kDk},
            {"window_keys", kDk},
            {"values", kDv}};
  }
  static constexpr index_t out_dim = kDv;
  template <Real T>
  static auto make_state(const A& a, index_t batch) {
    return a.template make_state<T>(batch);
  }
  static auto other_kind_state(index_t batch) {  // VAPOR over every state: another kind
    return A({.heads = kH, .latents = kL, .key_dim = kDk, .value_dim = kDv, .window = kWindow},
             {.scale = std::nullopt, .vapor_scope = VaporScope::all_states})
        .make_state<float>(batch);
  }
};

struct MacchiatoBidirectional {
  using A = LatteMacchiato<Bidirectional>;
  static constexpr const char* name = "LatteMacchiato<bidirectional>";
  static constexpr std::size_t arity = 5;
  static A make(index_t heads = kH) {
    return A({.heads = heads, .latents = kL, .key_dim = kDk, .value_dim = kDv, .window = kWindow});
  }
  static std::vector<Feature> features() { return Macchiato::features(); }
  static constexpr index_t out_dim = kDv;
};

struct LinearElu {
  using A = LinearAttention<Causal, EluPlusOne>;
  static constexpr const char* name = "LinearAttention<causal,elu_plus_one>";
  static constexpr std::size_t arity = 3;
  static A make(index_t heads = kH) {
    return A({.heads = heads, .key_dim = kDk, .value_dim = kDv});
  }
  static std::vector<Feature> features() { return SoftmaxCausal::features(); }
  static constexpr index_t out_dim = kDv;
  template <Real T>
  static auto make_state(const A& a, index_t batch) {
    return a.template make_state<T>(batch);
  }
  static auto other_kind_state(index_t batch) {  // same LinearState type, another feature map
    return LinearAttention<Causal, Relu>({.heads = kH, .key_dim = kDk, .value_dim = kDv})
        .make_state<float>(batch);
  }
};

struct LinearBidirectional {
  using A = LinearAttention<Bidirectional, Relu>;
  static constexpr const char* name = "LinearAttention<bidirectional,relu>";
  static constexpr std::size_t arity = 3;
  static A make(index_t heads = kH) {
    return A({.heads = heads, .key_dim = kDk, .value_dim = kDv});
  }
  static std::vector<Feature> features() { return SoftmaxCausal::features(); }
  static constexpr index_t out_dim = kDv;
};

struct CosFormerCausal {
  using A = CosFormer<Causal>;
  static constexpr const char* name = "CosFormer<causal>";
  static constexpr std::size_t arity = 3;
  static A make(index_t heads = kH) {
    return A({.heads = heads, .key_dim = kDk, .value_dim = kDv},
             {.reweight = {.length = kCapacity}});
  }
  static std::vector<Feature> features() { return SoftmaxCausal::features(); }
  static constexpr index_t out_dim = kDv;
  template <Real T>
  static auto make_state(const A& a, index_t batch) {
    return a.template make_state<T>(batch);
  }
  static auto other_kind_state(index_t batch) {  // LinearState of plain ReLU linear attention
    return LinearElu::other_kind_state(batch);
  }
};

/// LeaP modules D -> D / 4 -> 1 with small finite weights.
LeaPModule leap_module() {
  const index_t hidden = kDk / 4;
  LeaPModule module;
  module.w1 = Tensor<double, 2>({hidden, kDk}, 0.25);
  module.b1 = Tensor<double, 1>({hidden}, 0.1);
  module.w2 = Tensor<double, 1>({hidden}, -0.5);
  module.b2 = 0.2;
  return module;
}

struct LeapCausal {
  using A = LeaPformer<Causal>;
  static constexpr const char* name = "LeaPformer<causal>";
  static constexpr std::size_t arity = 3;
  static A make(index_t heads = kH) {
    return A({.heads = heads, .key_dim = kDk, .value_dim = kDv},
             {.reweight = {.query_module = leap_module(), .key_module = leap_module()}});
  }
  static std::vector<Feature> features() { return SoftmaxCausal::features(); }
  static constexpr index_t out_dim = kDv;
  template <Real T>
  static auto make_state(const A& a, index_t batch) {
    return a.template make_state<T>(batch);
  }
  static auto other_kind_state(index_t batch) {  // a cosFormer state: same streams, another kind
    return CosFormerCausal::make_state<float>(CosFormerCausal::make(), batch);
  }
};

struct LavoCausal {
  using A = Lavo<Causal>;
  static constexpr const char* name = "Lavo<causal>";
  static constexpr std::size_t arity = 3;
  static A make(index_t heads = kH) {
    return A({.heads = heads, .dim = kDk, .bases = kLavoBases, .window = kWindow});
  }
  static std::vector<Feature> features() {
    return {{"queries", kDk}, {"keys", kDk}, {"values", kDk}};
  }
  static constexpr index_t out_dim = kDk;
  template <Real T>
  static auto make_state(const A& a, index_t batch) {
    return a.template make_state<T>(batch);
  }
};

struct LavoBidirectional {
  using A = Lavo<Bidirectional>;
  static constexpr const char* name = "Lavo<bidirectional>";
  static constexpr std::size_t arity = 3;
  static A make(index_t heads = kH) {
    return A({.heads = heads, .dim = kDk, .bases = kLavoBases, .window = kWindow});
  }
  static std::vector<Feature> features() { return LavoCausal::features(); }
  static constexpr index_t out_dim = kDk;
};

ConvCompressedDims conv_dims(index_t heads = kH) {
  return {.heads = heads, .key_dim = kDk, .value_dim = kDv, .group_size = 2, .levels = 2};
}

struct ConvCausal {
  using A = ConvCompressedAttention<Causal>;
  static constexpr const char* name = "ConvCompressedAttention<causal>";
  static constexpr std::size_t arity = 3;
  static A make(index_t heads = kH) {
    return A(conv_dims(heads), ConvCompressedParams::zeros(conv_dims(heads)));
  }
  static std::vector<Feature> features() { return SoftmaxCausal::features(); }
  static constexpr index_t out_dim = kDv;
  template <Real T>
  static auto make_state(const A& a, index_t batch) {
    return a.template make_state<T>(batch, kCapacity);
  }
};

struct ConvBidirectional {
  using A = ConvCompressedAttention<Bidirectional>;
  static constexpr const char* name = "ConvCompressedAttention<bidirectional>";
  static constexpr std::size_t arity = 3;
  static A make(index_t heads = kH) {
    ConvCompressedDims dims = conv_dims(heads);
    return A(dims, ConvCompressedParams::zeros(dims));
  }
  static std::vector<Feature> features() { return SoftmaxCausal::features(); }
  static constexpr index_t out_dim = kDv;
};

template <class M>
concept HasOtherKind = requires {
  M::other_kind_state(index_t{1});
};

template <class M>
using StateOf = typename M::A::template State<float>;

// ------------------------------------------------------------ tensor args --

template <class M>
std::vector<Arg<4>> sequence_args(index_t batch = kB, index_t time = kT) {
  std::vector<Arg<4>> args;
  for (const Feature& f : M::features()) args.push_back({f.name, {batch, time, kH, f.dim}});
  return args;
}
template <class M>
Arg<4> sequence_out(index_t batch = kB, index_t time = kT) {
  return {"out", {batch, time, kH, M::out_dim}};
}
template <class M>
std::vector<Arg<3>> step_args(index_t batch = kB) {
  std::vector<Arg<3>> args;
  for (const Feature& f : M::features()) args.push_back({f.name, {batch, kH, f.dim}});
  return args;
}
template <class M>
Arg<3> step_out(index_t batch = kB) {
  return {"out", {batch, kH, M::out_dim}};
}

/// A self-attention forward takes B and T from its first tensor: a first
/// tensor with another B or T is reported on the second.
inline auto first_defines_batch_and_time(const std::vector<Arg<4>>& inputs) {
  const std::string second = inputs.at(1).name;
  return [second](std::size_t arg, std::size_t dim) -> std::optional<std::string> {
    (void)arg;
    if (arg == 0 && dim < 2) return second;
    return std::nullopt;  // replaced below by the argument's own name
  };
}

template <class M>
std::string entry_name(const char* call, const char* exec) {
  return std::string(M::name) + "::" + call + " [" + exec + "]";
}

/// Everything the table is built from.
/// One edited buffer through load_state and through State::restore: the two
/// must give the same verdict (issue 23, class 4).
struct VerdictPair {
  std::string entry, case_name;
  std::function<Outcome()> load, restore;
};

struct Registry {
  Table rows;
  std::vector<TensorEntry<4>> sequence_entries;
  std::vector<TensorEntry<3>> step_entries;
  std::vector<MultiOutputEntry<4>> backward_entries;
  std::vector<VerdictPair> verdicts;

  void add(const TensorEntry<4>& entry) {
    sequence_entries.push_back(entry);
    add_tensor_rows(rows, entry);
  }
  void add(const TensorEntry<3>& entry) {
    step_entries.push_back(entry);
    add_tensor_rows(rows, entry);
  }
  void add(const MultiOutputEntry<4>& entry) {
    backward_entries.push_back(entry);
    add_multi_output_rows(rows, entry);
  }
};

/// blame = the first tensor's B/T go to the second tensor; everything else names itself.
template <std::size_t N>
void set_self_attention_blame(TensorEntry<N>& entry) {
  if constexpr (N == 4) {
    auto first = first_defines_batch_and_time(entry.inputs);
    const std::size_t k = entry.inputs.size();
    std::vector<std::string> names;
    for (const auto& arg : entry.inputs) names.push_back(arg.name);
    names.push_back(entry.out.name);
    entry.blame = [first, names, k](std::size_t arg,
                                    std::size_t dim) -> std::optional<std::string> {
      if (auto blamed = first(arg, dim)) return blamed;
      (void)k;
      return names[arg];
    };
  }
}

// ---------------------------------------------------------- entry builders --

template <class M, class E>
TensorEntry<4> forward_entry(E exec_tag) {
  auto attention = std::make_shared<const typename M::A>(M::make());
  TensorEntry<4> entry;
  entry.entry = entry_name<M>("forward", E::name);
  entry.inputs = sequence_args<M>();
  entry.out = sequence_out<M>();
  entry.dim_names = kSequenceDims;
  entry.invoke = [attention, exec_tag](const In4& in, Out4 out) {
    spread<M::arity>([&](auto... x) { attention->forward(exec_tag, x..., out); }, in);
  };
  set_self_attention_blame(entry);
  return entry;
}

template <class M>
struct StatefulContext {
  typename M::A attention = M::make();
  StateOf<M> state;
};

template <class M, class E>
TensorEntry<4> forward_state_entry(E exec_tag, std::shared_ptr<StatefulContext<M>> context) {
  TensorEntry<4> entry;
  entry.entry = entry_name<M>("forward(state)", E::name);
  entry.inputs = sequence_args<M>();
  entry.out = sequence_out<M>();
  entry.dim_names = kSequenceDims;
  entry.prepare = [context] {
    context->state = M::template make_state<float>(context->attention, kB);
  };
  entry.invoke = [context, exec_tag](const In4& in, Out4 out) {
    spread<M::arity>(
        [&](auto... x) { context->attention.forward(exec_tag, x..., out, context->state); }, in);
  };
  entry.state_bytes = [context] { return context->state.save(); };
  set_self_attention_blame(entry);
  return entry;
}

template <class M, class E>
TensorEntry<3> step_entry(E exec_tag, std::shared_ptr<StatefulContext<M>> context) {
  TensorEntry<3> entry;
  entry.entry = entry_name<M>("step", E::name);
  entry.inputs = step_args<M>();
  entry.out = step_out<M>();
  entry.dim_names = kStepDims;
  entry.prepare = [context] {
    context->state = M::template make_state<float>(context->attention, kB);
  };
  entry.invoke = [context, exec_tag](const In3& in, Out3 out) {
    spread<M::arity>(
        [&](auto... x) { context->attention.step(exec_tag, context->state, x..., out); }, in);
  };
  entry.state_bytes = [context] { return context->state.save(); };
  return entry;
}

/// The state cases shared by forward(state) and step: a state of another
/// batch, of another kind, of other dims, and a default-constructed one.
template <class M, std::size_t N>
void add_state_rows(Registry& registry, const TensorEntry<N>& entry,
                    const std::shared_ptr<StatefulContext<M>>& context) {
  // forward(state) takes B from the inputs and blames the state; step takes B
  // from the state and blames the first step tensor, which then disagrees.
  const std::string batch_blame = N == 4 ? "state" : entry.inputs.front().name;
  add_context_row(registry.rows, entry, "state of batch B + 1", batch_blame, [context] {
    context->state = M::template make_state<float>(context->attention, kB + 1);
  });
  add_context_row(registry.rows, entry, "default-constructed state", "state",
                  [context] { context->state = StateOf<M>{}; });
  add_context_row(
      registry.rows, entry, "state of an attention with H + 1 heads", "state",
      [context] { context->state = M::template make_state<float>(M::make(kH + 1), kB); });
  if constexpr (HasOtherKind<M>)
    add_context_row(registry.rows, entry, "state of another attention type (kind)", "state",
                    [context] { context->state = M::other_kind_state(kB); });
}

/// forward, forward(state), step (+ their state rows) on one backend.
/// forward_packed: three sequences (2, 0 and kT - 2 tokens) packed as [1, kT, H, F],
/// each with its own state. The inputs are named by position, as forward_packed
/// names them; a packed view's B and T are checked by forward_packed (the out's
/// T is total_T, so an out of another T disagrees with cu_seqlens), H and F by
/// the mechanism under its own names.
template <class M>
struct PackedContext {
  typename M::A attention = M::make();
  std::vector<StateOf<M>> states;
  std::vector<StateOf<M>*> pointers;
  std::vector<index_t> cu_seqlens;
};

template <class M, class E>
TensorEntry<4> packed_entry(E exec_tag, std::shared_ptr<PackedContext<M>> context) {
  TensorEntry<4> entry;
  entry.entry = entry_name<M>("forward_packed", E::name);
  const std::vector<Arg<4>> own = sequence_args<M>(1, kT);
  for (std::size_t j = 0; j < own.size(); ++j)
    entry.inputs.push_back({"inputs[" + std::to_string(j) + "]", own[j].extents});
  entry.out = sequence_out<M>(1, kT);
  entry.dim_names = kSequenceDims;
  entry.prepare = [context] {
    context->states.clear();
    for (int i = 0; i < 3; ++i) context->states.push_back(M::template make_state<float>(context->attention, 1));
    context->pointers.clear();
    for (auto& state : context->states) context->pointers.push_back(&state);
    context->cu_seqlens = {0, 2, 2, kT};
  };
  entry.invoke = [context, exec_tag](const In4& in, Out4 out) {
    spread<M::arity>(
        [&](auto... x) {
          forward_packed(context->attention, exec_tag, std::span<const index_t>(context->cu_seqlens),
                         std::make_tuple(x...), out, std::span<StateOf<M>* const>(context->pointers));
        },
        in);
  };
  entry.state_bytes = [context] {
    std::vector<std::byte> bytes;
    for (const auto& state : context->states) {
      const std::vector<std::byte> one = state.save();
      bytes.insert(bytes.end(), one.begin(), one.end());
    }
    return bytes;
  };
  std::vector<std::string> names;
  for (const Arg<4>& arg : own) names.push_back(arg.name);
  entry.blame = [names](std::size_t arg, std::size_t dim) -> std::optional<std::string> {
    const bool input = arg < names.size();
    if (dim == 0) return input ? "inputs[" + std::to_string(arg) + "]" : std::string("out");
    if (dim == 1) return input ? "inputs[" + std::to_string(arg) + "]" : std::string("cu_seqlens");
    return input ? names[arg] : std::string("out");
  };
  return entry;
}

/// The packed entry, and its calls with a malformed cu_seqlens or set of states.
template <class M, class E>
void add_packed(Registry& registry, E exec_tag) {
  auto context = std::make_shared<PackedContext<M>>();
  const TensorEntry<4> entry = packed_entry<M>(exec_tag, context);
  registry.add(entry);
  const auto row = [&](std::string case_name, std::string argument, std::function<void(PackedContext<M>&)> edit) {
    add_context_row(registry.rows, entry, std::move(case_name), std::move(argument),
                    [context, edit = std::move(edit)] { edit(*context); });
  };
  row("cu_seqlens[0] = 1", "cu_seqlens", [](auto& c) { c.cu_seqlens = {1, 2, 2, kT}; });
  row("cu_seqlens decreasing", "cu_seqlens", [](auto& c) { c.cu_seqlens = {0, 3, 2, kT}; });
  row("cu_seqlens[N] = total_T - 1", "cu_seqlens", [](auto& c) { c.cu_seqlens = {0, 2, 2, kT - 1}; });
  row("cu_seqlens of one offset", "cu_seqlens", [](auto& c) { c.cu_seqlens = {kT}; });
  row("cu_seqlens[1] = -2^62", "cu_seqlens", [](auto& c) { c.cu_seqlens = {0, -(index_t{1} << 62), 2, kT}; });
  row("one state too few", "states", [](auto& c) { c.pointers.pop_back(); });
  row("the same state for two sequences", "states", [](auto& c) { c.pointers[2] = c.pointers[0]; });
  row("a null state", "states", [](auto& c) { c.pointers[1] = nullptr; });
  row("a state of batch 2", "states[1]", [](auto& c) {
    c.states[1] = M::template make_state<float>(c.attention, 2);
  });
  row("a default-constructed state", "states[2]", [](auto& c) { c.states[2] = StateOf<M>{}; });
  row("a state of an attention with H + 1 heads", "states[0]", [](auto& c) {
    c.states[0] = M::template make_state<float>(M::make(kH + 1), 1);
  });
  if constexpr (HasOtherKind<M>)
    row("a state of another attention type (kind)", "states[1]",
        [](auto& c) { c.states[1] = M::other_kind_state(1); });
}

/// A pool of `slots` states as the attention makes them (a KV cache or a context
/// buffer with kCapacity tokens).
template <class A>
inline constexpr bool sized_up_front = false;
template <class Dir, class Win>
inline constexpr bool sized_up_front<SoftmaxAttention<Dir, Win>> = true;
template <class Dir>
inline constexpr bool sized_up_front<ConvCompressedAttention<Dir>> = true;

template <class M, class Pool>
void emplace_pool(std::optional<Pool>& pool, const typename M::A& attention, index_t slots) {
  if constexpr (sized_up_front<typename M::A>)
    pool.emplace(attention, slots, kCapacity);
  else
    pool.emplace(attention, slots);
}

/// StatePool (exec::cpu, a pool of 3 slots: two live, one released): every refused
/// call names its argument and leaves every live slot's saved bytes unchanged.
template <class M>
void add_pool_rows(Registry& registry) {
  using Pool = StatePool<typename M::A, float>;
  struct Context {
    typename M::A attention = M::make();
    std::optional<Pool> pool, other;
    PoolSlot a, b, released;
    Context() {
      emplace_pool<M>(pool, attention, 3);
      emplace_pool<M>(other, attention, 1);
      a = pool->acquire();
      b = pool->acquire();
      released = pool->acquire();
      pool->release(released);
    }
    std::vector<std::vector<std::byte>> bytes() const { return {pool->save(a), pool->save(b)}; }
  };
  const std::string entry = entry_name<M>("StatePool", "cpu");
  const auto row = [&](std::string case_name, std::string argument, std::function<void(Context&)> call) {
    registry.rows.push_back({entry, std::move(case_name), std::move(argument), [call] {
                               auto c = std::make_shared<Context>();
                               const auto before = c->bytes();
                               return attempt([&] { call(*c); }, [&] { return c->bytes() == before; });
                             }});
  };
  // Inputs of `rows` steps (or of one packed call of 4 tokens) with small finite values.
  const auto filled = [](const auto& args) {
    using Arg = std::remove_cvref_t<decltype(args.front())>;
    std::vector<Tensor<float, std::tuple_size_v<decltype(Arg{}.extents)>>> tensors;
    for (const auto& arg : args) tensors.emplace_back(arg.extents, 0.25f);
    return tensors;
  };
  const auto step = [filled](Context& c, std::vector<PoolSlot> slots, index_t rows, index_t out_rows) {
    const auto inputs = filled(step_args<M>(rows));
    Tensor<float, 3> out(step_out<M>(out_rows).extents);
    spread<M::arity>([&](const auto&... x) {
      c.pool->step(exec::cpu, slots, std::make_tuple(x.cview()...), out.view());
    }, inputs);
  };
  add_call_row(registry.rows, entry, "0 slots", "slots", [] {
    std::optional<Pool> pool;
    emplace_pool<M>(pool, M::make(), 0);
  });
  row("acquire from a full pool", "pool", [](Context& c) {
    (void)c.pool->acquire();
    (void)c.pool->acquire();
  });
  row("release a released slot", "slot", [](Context& c) { c.pool->release(c.released); });
  row("release a default handle", "slot", [](Context& c) { c.pool->release(PoolSlot{}); });
  row("release another pool's slot", "slot", [](Context& c) { c.pool->release(c.other->acquire()); });
  row("save a slot index out of range", "slot", [](Context& c) {
    PoolSlot slot = c.a;
    slot.index = 7;
    (void)c.pool->save(slot);
  });
  row("step: a slot twice", "slots", [step](Context& c) { step(c, {c.a, c.b, c.a}, 3, 3); });
  row("step: a released slot", "slots", [step](Context& c) { step(c, {c.a, c.released}, 2, 2); });
  row("step: out with a row too many", "out", [step](Context& c) { step(c, {c.a, c.b}, 2, 3); });
  row("step: inputs with a row too few", "inputs[0]", [step](Context& c) { step(c, {c.a, c.b}, 1, 2); });
  // The same step with bf16 activations (the pool widens each slot's rows itself).
  const auto step_bf16 = [](Context& c, std::vector<PoolSlot> slots, index_t rows, index_t out_rows) {
    std::vector<Tensor<bfloat16, 3>> inputs;
    for (const auto& arg : step_args<M>(rows)) inputs.emplace_back(arg.extents, bfloat16(0.25f));
    Tensor<bfloat16, 3> out(step_out<M>(out_rows).extents);
    spread<M::arity>([&](const auto&... x) {
      c.pool->step(exec::cpu, slots, std::make_tuple(x.cview()...), out.view());
    }, inputs);
  };
  row("step (bf16): a slot twice", "slots", [step_bf16](Context& c) { step_bf16(c, {c.a, c.b, c.a}, 3, 3); });
  row("step (bf16): a released slot", "slots", [step_bf16](Context& c) { step_bf16(c, {c.a, c.released}, 2, 2); });
  row("step (bf16): out with a row too many", "out", [step_bf16](Context& c) { step_bf16(c, {c.a, c.b}, 2, 3); });
  row("step (bf16): inputs with a row too few", "inputs[0]", [step_bf16](Context& c) { step_bf16(c, {c.a, c.b}, 1, 2); });
  row("restore damaged bytes", "bytes", [](Context& c) {
    std::vector<std::byte> bytes = c.pool->save(c.a);
    bytes[bytes.size() / 2] ^= std::byte{1};
    c.pool->restore(c.a, bytes);
  });
  row("forward_packed into a released slot", "slots", [filled](Context& c) {
    const auto inputs = filled(sequence_args<M>(1, 4));
    Tensor<float, 4> out(sequence_out<M>(1, 4).extents);
    const std::vector<index_t> cu{0, 2, 4};
    spread<M::arity>([&](const auto&... x) {
      c.pool->forward_packed(exec::cpu, std::vector<PoolSlot>{c.a, c.released}, cu, std::make_tuple(x.cview()...),
                             out.view());
    }, inputs);
  });
}

template <class M, class E>
void add_sequence_and_decode(Registry& registry, E exec_tag) {
  registry.add(forward_entry<M>(exec_tag));
  if constexpr (requires { M::template make_state<float>(M::make(), 1); }) {
    auto forward_context = std::make_shared<StatefulContext<M>>();
    const auto with_state = forward_state_entry<M>(exec_tag, forward_context);
    registry.add(with_state);
    add_state_rows<M>(registry, with_state, forward_context);
    auto step_context = std::make_shared<StatefulContext<M>>();
    const auto step = step_entry<M>(exec_tag, step_context);
    registry.add(step);
    add_state_rows<M>(registry, step, step_context);
    add_packed<M>(registry, exec_tag);
  }
}

// ---------------------------------------------------- 16-bit activations --

/// The bf16 twin of an fp32 entry: the same rows, the call made on bf16 twins
/// of its buffers (half_shadow.hpp) through HalfPrecision, or LatteAttention's
/// own bf16 forward on exec::cpu. Where HalfPrecision converts (every other
/// call), it checks the 16-bit views before the attention sees its fp32 copies
/// and names them by place (inputs[j]); their extents are the attention's to
/// check, under its own names.
template <std::size_t N, class Call>
TensorEntry<N> bf16_entry(TensorEntry<N> entry, bool named_by_place, Call call) {
  entry.entry += " (bf16)";
  if (named_by_place) {
    std::vector<std::string> names;
    for (const auto& arg : entry.inputs) names.push_back(arg.name);
    names.push_back(entry.out.name);
    entry.blame = [names, blame = entry.blame](std::size_t arg, std::size_t dim) -> std::optional<std::string> {
      return blame ? blame(arg, dim) : std::optional<std::string>(names[arg]);
    };
    for (std::size_t j = 0; j < entry.inputs.size(); ++j) entry.inputs[j].name = "inputs[" + std::to_string(j) + "]";
  }
  entry.invoke = [call](const std::vector<TensorView<const float, N>>& in, TensorView<float, N> out) {
    call_in_bf16(in, out, call);
  };
  return entry;
}

template <class A>
inline constexpr bool is_latte_attention = false;
template <class Dir, class Stab, class Pos, class Sum>
inline constexpr bool is_latte_attention<LatteAttention<Dir, Stab, Pos, Sum>> = true;

/// forward, forward(state), step and forward_packed with bf16 activations.
template <class M, class E>
void add_bf16_entries(Registry& registry, E exec_tag) {
  constexpr bool reads_bf16 = is_latte_attention<typename M::A> && std::is_same_v<E, exec::cpu_t>;
  auto attention = std::make_shared<const typename M::A>(M::make());
  registry.add(bf16_entry(forward_entry<M>(exec_tag), !reads_bf16, [attention, exec_tag](const auto& in, const auto& out) {
    spread<M::arity>([&](auto... x) { HalfPrecision(*attention).forward(exec_tag, x..., out); }, in);
  }));
  if constexpr (reads_bf16 && !M::A::direction::is_causal) {  // latte::bf16_products
    auto products = bf16_entry(forward_entry<M>(exec_tag), false, [attention](const auto& in, const auto& out) {
      spread<M::arity>([&](auto... x) { attention->forward(exec::cpu, bf16_products, x..., out); }, in);
    });
    products.entry.replace(products.entry.rfind(" (bf16)"), 7, " (bf16 products)");
    registry.add(products);
  }
  if constexpr (requires { M::template make_state<float>(M::make(), 1); }) {
    auto context = std::make_shared<StatefulContext<M>>();
    const auto with_state =
        bf16_entry(forward_state_entry<M>(exec_tag, context), !reads_bf16, [context, exec_tag](const auto& in, const auto& out) {
          spread<M::arity>([&](auto... x) { HalfPrecision(context->attention).forward(exec_tag, x..., out, context->state); },
                           in);
        });
    registry.add(with_state);
    if (reads_bf16) add_state_rows<M>(registry, with_state, context);
    auto step_context = std::make_shared<StatefulContext<M>>();
    registry.add(bf16_entry(step_entry<M>(exec_tag, step_context), true, [step_context, exec_tag](const auto& in, const auto& out) {
      spread<M::arity>(
          [&](auto... x) { HalfPrecision(step_context->attention).step(exec_tag, step_context->state, x..., out); }, in);
    }));
    auto packed = std::make_shared<PackedContext<M>>();
    registry.add(bf16_entry(packed_entry<M>(exec_tag, packed), false, [packed, exec_tag](const auto& in, const auto& out) {
      spread<M::arity>(
          [&](auto... x) {
            forward_packed(HalfPrecision(packed->attention), exec_tag, std::span<const index_t>(packed->cu_seqlens),
                           std::make_tuple(x...), out, std::span<StateOf<M>* const>(packed->pointers));
          },
          in);
    }));
  }
}

/// make_state: batch 0 and -1.
template <class M>
void add_make_state_batch_rows(Registry& registry) {
  const std::string entry = entry_name<M>("make_state", "-");
  for (index_t batch : {index_t{0}, index_t{-1}})
    add_call_row(registry.rows, entry, "batch " + std::to_string(batch), "batch",
                 [batch] { (void)M::template make_state<float>(M::make(), batch); });
}

/// State::restore and load_state: damaged bytes, bytes of another dtype, of
/// other dims, of another kind, and (restore only) of another batch; and the
/// verdict pairs: each of those buffers of the same batch, and the valid bytes
/// re-signed at other saved positions, through both paths.
template <class M>
void add_state_bytes_rows(Registry& registry, std::vector<BadBytes> extra = {},
                          std::vector<BadBytes> extra_restore_only = {}) {
  using State = StateOf<M>;
  const auto attention = std::make_shared<const typename M::A>(M::make());
  auto fresh = [attention] { return M::template make_state<float>(*attention, kB); };
  // Valid bytes with non-trivial content: a state after one step of small inputs.
  State stepped = fresh();
  {
    const auto buffers = make_buffers(step_args<M>(), step_out<M>(), Malformation{});
    spread<M::arity>(
        [&](auto... x) { attention->step(exec::reference, stepped, x..., buffers->out); },
        buffers->inputs);
  }
  const std::vector<std::byte> valid = stepped.save();
  std::vector<BadBytes> both = damaged_bytes(valid);
  both.push_back({"float64 bytes into a float32 state",
                  M::template make_state<double>(*attention, kB).save()});
  both.push_back({"bytes of an attention with H + 1 heads",
                  M::template make_state<float>(M::make(kH + 1), kB).save()});
  if constexpr (HasOtherKind<M>)
    both.push_back({"bytes of another attention type (kind)", M::other_kind_state(kB).save()});
  for (auto& bad : extra) both.push_back(std::move(bad));
  std::vector<BadBytes> restore_only = both;
  restore_only.push_back(
      {"bytes of batch B + 1", M::template make_state<float>(*attention, kB + 1).save()});
  for (auto& bad : extra_restore_only) restore_only.push_back(std::move(bad));

  add_restore_rows<State>(registry.rows, entry_name<M>("State::restore", "-"), fresh, restore_only);
  add_restore_rows<State>(registry.rows, entry_name<M>("State::restore", "-") + " (default state)",
                          [] { return State{}; }, {{"valid bytes into a default state", valid}});
  add_load_rows(
      registry.rows, entry_name<M>("load_state", "-"),
      [attention](std::span<const std::byte> bytes) {
        return attention->template load_state<float>(bytes);
      },
      both);

  std::vector<BadBytes> edited = both;
  for (std::int64_t position : {std::int64_t{0}, std::int64_t{1}, std::int64_t{kCapacity},
                                std::int64_t{kCapacity + 1}, std::int64_t{1} << 40,
                                std::numeric_limits<std::int64_t>::max()})
    edited.push_back({"position " + std::to_string(position) + " (re-signed)",
                      with_saved_position(valid, position)});
  for (BadBytes& bytes : edited) {
    auto shared = std::make_shared<const std::vector<std::byte>>(std::move(bytes.bytes));
    registry.verdicts.push_back(
        {entry_name<M>("load_state / State::restore", "-"), bytes.case_name,
         [attention, shared] {
           return attempt([&] { (void)attention->template load_state<float>(*shared); },
                          [] { return true; });
         },
         [fresh, shared] {
           auto state = fresh();
           const auto before = state.save();
           return attempt([&] { state.restore(*shared); }, [&] { return state.save() == before; });
         }});
  }
}

/// backward(queries, keys, values, d_out, {d_queries, d_keys, d_values}) of a
/// softmax attention: B and T come from queries, so queries' B or T is
/// reported on keys.
template <class M, class E>
MultiOutputEntry<4> softmax_backward_entry(E exec_tag) {
  auto attention = std::make_shared<const typename M::A>(M::make());
  MultiOutputEntry<4> entry;
  entry.entry = entry_name<M>("backward", E::name);
  entry.inputs = sequence_args<M>();
  entry.inputs.push_back({"d_out", {kB, kT, kH, kDv}});
  entry.outputs = {{"d_queries", {kB, kT, kH, kDk}},
                   {"d_keys", {kB, kT, kH, kDk}},
                   {"d_values", {kB, kT, kH, kDv}}};
  entry.dim_names = kSequenceDims;
  entry.invoke = [attention, exec_tag](const In4& in, const std::vector<Out4>& out) {
    attention->backward(exec_tag, in[0], in[1], in[2], in[3],
                        SoftmaxGradients<float>{out[0], out[1], out[2]});
  };
  entry.blame = [names = std::vector<std::string>{"queries", "keys", "values", "d_out",
                                                  "d_queries", "d_keys", "d_values"}](
                    std::size_t arg, std::size_t dim) {
    return arg == 0 && dim < 2 ? names[1] : names[arg];
  };
  return entry;
}

/// backward(query_logits, key_logits, values, d_out, {d_query_logits,
/// d_key_logits, d_values}) of a Latte attention: B and T come from
/// query_logits, so its B or T is reported on key_logits.
template <class M, class E>
MultiOutputEntry<4> latte_backward_entry(E exec_tag) {
  auto attention = std::make_shared<const typename M::A>(M::make());
  MultiOutputEntry<4> entry;
  entry.entry = entry_name<M>("backward", E::name);
  entry.inputs = sequence_args<M>();
  entry.inputs.push_back({"d_out", {kB, kT, kH, kDv}});
  entry.outputs = {{"gradients.d_query_logits", {kB, kT, kH, kL}},
                   {"gradients.d_key_logits", {kB, kT, kH, kL}},
                   {"gradients.d_values", {kB, kT, kH, kDv}}};
  entry.dim_names = kSequenceDims;
  entry.invoke = [attention, exec_tag](const In4& in, const std::vector<Out4>& out) {
    attention->backward(exec_tag, in[0], in[1], in[2], in[3],
                        LatteGradients<float>{out[0], out[1], out[2]});
  };
  entry.blame = [names = std::vector<std::string>{
                     "query_logits", "key_logits", "values", "d_out", "gradients.d_query_logits",
                     "gradients.d_key_logits", "gradients.d_values"}](std::size_t arg,
                                                                      std::size_t dim) {
    return arg == 0 && dim < 2 ? names[1] : names[arg];
  };
  return entry;
}

/// backward(q, k, q', k', v, d_out, {5 gradients}) of a Latte Macchiato: B and
/// T come from query_logits and are reported on key_logits.
template <class M, class E>
MultiOutputEntry<4> macchiato_backward_entry(E exec_tag) {
  auto attention = std::make_shared<const typename M::A>(M::make());
  MultiOutputEntry<4> entry;
  entry.entry = entry_name<M>("backward", E::name);
  entry.inputs = sequence_args<M>();
  entry.inputs.push_back({"d_out", {kB, kT, kH, kDv}});
  entry.outputs = {{"gradients.d_query_logits", {kB, kT, kH, kL + 1}},
                   {"gradients.d_key_logits", {kB, kT, kH, kL}},
                   {"gradients.d_window_queries", {kB, kT, kH, kDk}},
                   {"gradients.d_window_keys", {kB, kT, kH, kDk}},
                   {"gradients.d_values", {kB, kT, kH, kDv}}};
  entry.dim_names = kSequenceDims;
  entry.invoke = [attention, exec_tag](const In4& in, const std::vector<Out4>& out) {
    attention->backward(exec_tag, in[0], in[1], in[2], in[3], in[4], in[5],
                        MacchiatoGradients<float>{out[0], out[1], out[2], out[3], out[4]});
  };
  entry.blame = [names = std::vector<std::string>{
                     "query_logits", "key_logits", "window_queries", "window_keys", "values",
                     "d_out", "gradients.d_query_logits", "gradients.d_key_logits",
                     "gradients.d_window_queries", "gradients.d_window_keys",
                     "gradients.d_values"}](std::size_t arg, std::size_t dim) {
    return arg == 0 && dim < 2 ? names[1] : names[arg];
  };
  return entry;
}

/// backward(queries, keys, values, d_out, {d_queries, d_keys, d_values}) of a
/// convolutional-compression attention: B and T come from queries and are
/// reported on keys.
template <class M, class E>
MultiOutputEntry<4> conv_backward_entry(E exec_tag) {
  auto attention = std::make_shared<const typename M::A>(M::make());
  MultiOutputEntry<4> entry;
  entry.entry = entry_name<M>("backward", E::name);
  entry.inputs = sequence_args<M>();
  entry.inputs.push_back({"d_out", {kB, kT, kH, kDv}});
  entry.outputs = {{"gradients.d_queries", {kB, kT, kH, kDk}},
                   {"gradients.d_keys", {kB, kT, kH, kDk}},
                   {"gradients.d_values", {kB, kT, kH, kDv}}};
  entry.dim_names = kSequenceDims;
  entry.invoke = [attention, exec_tag](const In4& in, const std::vector<Out4>& out) {
    attention->backward(exec_tag, in[0], in[1], in[2], in[3],
                        ConvCompressedGradients<float>{out[0], out[1], out[2]});
  };
  entry.blame = [names = std::vector<std::string>{"queries", "keys", "values", "d_out",
                                                  "gradients.d_queries", "gradients.d_keys",
                                                  "gradients.d_values"}](std::size_t arg,
                                                                         std::size_t dim) {
    return arg == 0 && dim < 2 ? names[1] : names[arg];
  };
  return entry;
}

/// backward(queries, keys, values, d_out, {d_queries, d_keys, d_values}) of a
/// LAVO attention (d = kDk for all three): B and T come from queries and are
/// reported on keys.
template <class M, class E>
MultiOutputEntry<4> lavo_backward_entry(E exec_tag) {
  auto attention = std::make_shared<const typename M::A>(M::make());
  MultiOutputEntry<4> entry;
  entry.entry = entry_name<M>("backward", E::name);
  entry.inputs = sequence_args<M>();
  entry.inputs.push_back({"d_out", {kB, kT, kH, kDk}});
  entry.outputs = {{"gradients.d_queries", {kB, kT, kH, kDk}},
                   {"gradients.d_keys", {kB, kT, kH, kDk}},
                   {"gradients.d_values", {kB, kT, kH, kDk}}};
  entry.dim_names = kSequenceDims;
  entry.invoke = [attention, exec_tag](const In4& in, const std::vector<Out4>& out) {
    attention->backward(exec_tag, in[0], in[1], in[2], in[3],
                        LavoGradients<float>{out[0], out[1], out[2]});
  };
  entry.blame = [names = std::vector<std::string>{"queries", "keys", "values", "d_out",
                                                  "gradients.d_queries", "gradients.d_keys",
                                                  "gradients.d_values"}](std::size_t arg,
                                                                         std::size_t dim) {
    return arg == 0 && dim < 2 ? names[1] : names[arg];
  };
  return entry;
}

/// cross_backward(queries, source, d_out, {d_queries, d_source}) of a LAVO
/// attention: queries' B is reported on source, its T on d_out, the source's
/// length S on d_source.
template <class M, class E>
MultiOutputEntry<4> lavo_cross_backward_entry(E exec_tag) {
  auto attention = std::make_shared<const typename M::A>(M::make());
  MultiOutputEntry<4> entry;
  entry.entry = entry_name<M>("cross_backward", E::name);
  entry.inputs = {{"queries", {kB, kT, kH, kDk}},
                  {"source", {kB, kSource, kH, kDk}},
                  {"d_out", {kB, kT, kH, kDk}}};
  entry.outputs = {{"gradients.d_queries", {kB, kT, kH, kDk}},
                   {"gradients.d_source", {kB, kSource, kH, kDk}}};
  entry.dim_names = kSequenceDims;
  entry.invoke = [attention, exec_tag](const In4& in, const std::vector<Out4>& out) {
    attention->cross_backward(exec_tag, in[0], in[1], in[2],
                              LavoCrossGradients<float>{out[0], out[1]});
  };
  entry.blame = [names = std::vector<std::string>{"queries", "source", "d_out",
                                                  "gradients.d_queries", "gradients.d_source"}](
                    std::size_t arg, std::size_t dim) {
    if (arg == 0 && dim == 0) return names[1];
    if (arg == 0 && dim == 1) return names[2];  // T: d_out
    if (arg == 1 && dim == 1) return names[4];  // S: d_source
    return names[arg];
  };
  return entry;
}

/// backward(queries, keys, values, d_out, {d_queries, d_keys, d_values}) of a
/// linear attention, or its cross_backward (keys and values over a source of
/// S tokens): B comes from queries and is reported on keys; T from queries
/// (reported on keys, or on d_out for cross); S from keys (reported on values).
template <class M, class E>
MultiOutputEntry<4> linear_backward_entry(E exec_tag, bool cross) {
  auto attention = std::make_shared<const typename M::A>(M::make());
  MultiOutputEntry<4> entry;
  entry.entry = entry_name<M>(cross ? "cross_backward" : "backward", E::name);
  entry.inputs = sequence_args<M>();
  entry.inputs.push_back({"d_out", {kB, kT, kH, kDv}});
  entry.outputs = {{"gradients.d_queries", {kB, kT, kH, kDk}},
                   {"gradients.d_keys", {kB, kT, kH, kDk}},
                   {"gradients.d_values", {kB, kT, kH, kDv}}};
  entry.dim_names = kSequenceDims;
  entry.invoke = [attention, exec_tag, cross](const In4& in, const std::vector<Out4>& out) {
    const LinearGradients<float> gradients{out[0], out[1], out[2]};
    if constexpr (!M::A::direction::is_causal) {
      if (cross) {
        attention->cross_backward(exec_tag, in[0], in[1], in[2], in[3], gradients);
        return;
      }
    } else {
      (void)cross;  // a causal attention has no cross form
    }
    attention->backward(exec_tag, in[0], in[1], in[2], in[3], gradients);
  };
  entry.blame = [cross, names = std::vector<std::string>{
                            "queries", "keys", "values", "d_out", "gradients.d_queries",
                            "gradients.d_keys", "gradients.d_values"}](std::size_t arg,
                                                                       std::size_t dim) {
    if (!cross) return arg == 0 && dim < 2 ? names[1] : names[arg];
    if (arg == 0 && dim == 0) return names[1];
    if (arg == 0 && dim == 1) return names[3];  // T: d_out
    if (arg == 1 && dim == 1) return names[2];  // S: values
    return names[arg];
  };
  return entry;
}

// ------------------------------------------------------ cross-attention --

/// Cross-attention blame: queries' B is reported on the next source tensor,
/// queries' T on out, the source length S on the tensor after the first source
/// tensor (or nowhere when the source is one tensor: S is free).
inline std::function<std::optional<std::string>(std::size_t, std::size_t)> cross_blame(
    std::vector<std::string> names) {
  return [names](std::size_t arg, std::size_t dim) -> std::optional<std::string> {
    const std::size_t k = names.size() - 1;
    if (arg == 0 && dim == 0) return names[1];
    if (arg == 0 && dim == 1) return names[k];  // out
    if (arg == 1 && dim == 1) {
      if (k == 2) return std::nullopt;  // a single source tensor: any S is valid
      return names[2];
    }
    return names[arg];
  };
}

// ------------------------------------------------------------- the table --

Registry build_registry() {
  Registry registry;
  Table& rows = registry.rows;

  // ---- LatteAttention (reference + cpu)
  add_sequence_and_decode<LatteVapor>(registry, exec::reference);
  add_sequence_and_decode<LatteVapor>(registry, exec::cpu);
  add_sequence_and_decode<LatteBidirectional>(registry, exec::reference);
  add_sequence_and_decode<LatteBidirectional>(registry, exec::cpu);
  add_make_state_batch_rows<LatteVapor>(registry);
  add_call_row(rows, entry_name<LatteVapor>("make_state", "-"), "first_position -1",
               "first_position", [] { (void)LatteVapor::make().make_state<float>(kB, -1); });
  add_state_bytes_rows<LatteVapor>(registry);
  add_pool_rows<LatteVapor>(registry);
  add_bf16_entries<LatteVapor>(registry, exec::reference);
  add_bf16_entries<LatteVapor>(registry, exec::cpu);
  add_bf16_entries<LatteBidirectional>(registry, exec::reference);
  add_bf16_entries<LatteBidirectional>(registry, exec::cpu);
  {
    const std::string ctor = entry_name<LatteVapor>("LatteAttention()", "-");
    using A = LatteVapor::A;
    const LatteDims good{.heads = kH, .latents = kL, .value_dim = kDv};
    auto with = [good](auto change) {
      return [good, change] {
        LatteDims dims = good;
        change(dims);
        (void)A(dims);
      };
    };
    add_call_row(rows, ctor, "heads 0", "dims.heads", with([](LatteDims& d) { d.heads = 0; }));
    add_call_row(rows, ctor, "latents 0", "dims.latents",
                 with([](LatteDims& d) { d.latents = 0; }));
    add_call_row(rows, ctor, "latents -1", "dims.latents",
                 with([](LatteDims& d) { d.latents = -1; }));
    add_call_row(rows, ctor, "value_dim 0", "dims.value_dim",
                 with([](LatteDims& d) { d.value_dim = 0; }));
    auto with_angles = [good](Tensor<double, 2> angles) {
      return [good, angles] { (void)A(good, {.angles = angles}); };
    };
    add_call_row(rows, ctor, "VAPOR angles [H + 1, Dv/2]", "angles",
                 with_angles(Tensor<double, 2>({kH + 1, kDv / 2}, 0.1)));
    add_call_row(rows, ctor, "VAPOR angles [H, Dv/2 + 1]", "angles",
                 with_angles(Tensor<double, 2>({kH, kDv / 2 + 1}, 0.1)));
    Tensor<double, 2> nan_angles({kH, kDv / 2}, 0.1);
    nan_angles(1, 2) = kNaN;
    add_call_row(rows, ctor, "VAPOR angle NaN", "angles", with_angles(nan_angles));
    Tensor<double, 2> inf_angles({kH, kDv / 2}, 0.1);
    inf_angles(0, 0) = kInf;
    add_call_row(rows, ctor, "VAPOR angle inf", "angles", with_angles(inf_angles));
    add_call_row(rows, ctor, "VAPOR base 1", "base",
                 [good] { (void)A(good, {.angles = {}, .base = 1.0}); });
    add_call_row(rows, ctor, "VAPOR base inf", "base",
                 [good] { (void)A(good, {.angles = {}, .base = kInf}); });
    add_call_row(rows, ctor, "LatteAttention<bidirectional> heads 0", "dims.heads", [] {
      (void)LatteAttention<Bidirectional>({.heads = 0, .latents = kL, .value_dim = kDv});
    });
    Tensor<float, 2> strided_angles({kH, kDv});
    add_call_row(rows, entry_name<LatteVapor>("VAPOR::params_from", "-"), "feature stride 2",
                 "angles", [strided_angles] {
                   (void)VAPOR::params_from<float>(
                       TensorView<const float, 2>(strided_angles.data(), {kH, kDv / 2}, {kDv, 2}));
                 });
    add_call_row(
        rows, entry_name<LatteVapor>("VAPOR::params_from", "-"), "null data", "angles", [] {
          (void)VAPOR::params_from<float>(TensorView<const float, 2>(nullptr, {kH, kDv / 2}));
        });
  }

  // ---- SoftmaxAttention (reference + cpu)
  add_sequence_and_decode<SoftmaxCausal>(registry, exec::reference);
  add_sequence_and_decode<SoftmaxCausal>(registry, exec::cpu);
  add_sequence_and_decode<SoftmaxWindowed>(registry, exec::reference);
  add_sequence_and_decode<SoftmaxWindowed>(registry, exec::cpu);
  add_bf16_entries<SoftmaxCausal>(registry, exec::cpu);
  add_pool_rows<SoftmaxCausal>(registry);
  add_bf16_entries<SoftmaxWindowed>(registry, exec::cpu);
  registry.add(latte_backward_entry<LatteVapor>(exec::reference));
  registry.add(latte_backward_entry<LatteVapor>(exec::cpu));
  registry.add(latte_backward_entry<LatteBidirectional>(exec::reference));
  registry.add(latte_backward_entry<LatteBidirectional>(exec::cpu));
  registry.add(softmax_backward_entry<SoftmaxCausal>(exec::reference));
  registry.add(softmax_backward_entry<SoftmaxCausal>(exec::cpu));
  registry.add(softmax_backward_entry<SoftmaxWindowed>(exec::reference));
  registry.add(softmax_backward_entry<SoftmaxWindowed>(exec::cpu));
  for (const bool cross : {false, true}) {
    if (!cross) {
      registry.add(linear_backward_entry<LinearElu>(exec::reference, false));
      registry.add(linear_backward_entry<LinearElu>(exec::cpu, false));
    }
    registry.add(linear_backward_entry<LinearBidirectional>(exec::reference, cross));
    registry.add(linear_backward_entry<LinearBidirectional>(exec::cpu, cross));
  }
  add_make_state_batch_rows<SoftmaxCausal>(registry);
  for (index_t capacity : {index_t{-1}}) {
    add_call_row(rows, entry_name<SoftmaxCausal>("make_state", "-"),
                 "capacity " + std::to_string(capacity), "capacity",
                 [capacity] { (void)SoftmaxCausal::make().make_state<float>(kB, capacity); });
  }
  add_call_row(rows, entry_name<SoftmaxCausal>("make_state", "-"), "capacity 0 (no window)",
               "capacity", [] { (void)SoftmaxCausal::make().make_state<float>(kB, 0); });
  add_state_bytes_rows<SoftmaxCausal>(registry);
  for (auto exec_name : {"reference", "cpu"}) {
    const bool cpu = std::string(exec_name) == "cpu";
    // A full KV cache (no window): capacity 1 after one token.
    auto context = std::make_shared<StatefulContext<SoftmaxCausal>>();
    TensorEntry<3> step = cpu ? step_entry<SoftmaxCausal>(exec::cpu, context)
                              : step_entry<SoftmaxCausal>(exec::reference, context);
    add_context_row(rows, step, "KV cache full (capacity 1, position 1)", "state", [context] {
      context->state = context->attention.make_state<float>(kB, 1);
      context->state.advance(1);
    });
    auto forward_context = std::make_shared<StatefulContext<SoftmaxCausal>>();
    TensorEntry<4> forward =
        cpu ? forward_state_entry<SoftmaxCausal>(exec::cpu, forward_context)
            : forward_state_entry<SoftmaxCausal>(exec::reference, forward_context);
    add_context_row(rows, forward, "KV cache of capacity T - 1", "state", [forward_context] {
      forward_context->state = forward_context->attention.make_state<float>(kB, kT - 1);
    });
  }
  {
    const std::string ctor = entry_name<SoftmaxCausal>("SoftmaxAttention()", "-");
    const SoftmaxDims good{.heads = kH, .key_dim = kDk, .value_dim = kDv};
    auto with = [good](auto change) {
      return [good, change] {
        SoftmaxDims dims = good;
        change(dims);
        (void)SoftmaxAttention<Causal>(dims);
      };
    };
    add_call_row(rows, ctor, "heads 0", "dims.heads", with([](SoftmaxDims& d) { d.heads = 0; }));
    add_call_row(rows, ctor, "key_dim 0", "dims.key_dim",
                 with([](SoftmaxDims& d) { d.key_dim = 0; }));
    add_call_row(rows, ctor, "value_dim -2", "dims.value_dim",
                 with([](SoftmaxDims& d) { d.value_dim = -2; }));
    add_call_row(rows, ctor, "scale NaN", "scale",
                 [good] { (void)SoftmaxAttention<Causal>(good, {}, kNaN); });
    add_call_row(rows, ctor, "scale inf", "scale",
                 [good] { (void)SoftmaxAttention<Causal>(good, {}, kInf); });
    add_call_row(rows, ctor, "window.left -1", "window.left", [good] {
      (void)SoftmaxAttention<Bidirectional, SlidingWindow>(good, {.left = -1, .right = 1});
    });
    add_call_row(rows, ctor, "window.right -1", "window.right", [good] {
      (void)SoftmaxAttention<Bidirectional, SlidingWindow>(good, {.left = 1, .right = -1});
    });
    add_call_row(rows, ctor, "causal window.right 1", "window.right", [good] {
      (void)SoftmaxAttention<Causal, SlidingWindow>(good, {.left = 1, .right = 1});
    });
  }

  // ---- LatteMacchiato (reference)
  add_sequence_and_decode<Macchiato>(registry, exec::reference);
  add_sequence_and_decode<MacchiatoBidirectional>(registry, exec::reference);
  add_bf16_entries<Macchiato>(registry, exec::cpu);
  add_pool_rows<Macchiato>(registry);
  for (auto backward : {macchiato_backward_entry<Macchiato>(exec::reference),
                        macchiato_backward_entry<Macchiato>(exec::cpu),
                        macchiato_backward_entry<MacchiatoBidirectional>(exec::reference),
                        macchiato_backward_entry<MacchiatoBidirectional>(exec::cpu)})
    registry.add(backward);
  add_make_state_batch_rows<Macchiato>(registry);
  add_call_row(rows, entry_name<Macchiato>("make_state", "-"), "first_position -1",
               "first_position", [] { (void)Macchiato::make().make_state<float>(kB, -1); });
  add_call_row(
      rows, entry_name<Macchiato>("make_state", "-"),
      "float32 state of window 2^24 (fill count not exact)", "dims.window", [] {
        (void)MacchiatoType(
            {.heads = 1, .latents = 1, .key_dim = 1, .value_dim = 1, .window = index_t{1} << 24})
            .make_state<float>(1);
      });
  {
    // window_fill is the last field (one T, before the 4-byte checksum) of a
    // state at position 0: 0.5 and w + 2 are not fill counts, and no state at
    // position 0 holds a token (the ring would be read before token 0).
    auto corrupted_fill = [](float fill) {
      auto state = Macchiato::make_state<float>(Macchiato::make(), kB);
      auto bytes = state.save();
      std::memcpy(bytes.data() + bytes.size() - 4 - sizeof(float), &fill, sizeof fill);
      return resigned(std::move(bytes));
    };
    add_state_bytes_rows<Macchiato>(
        registry, {{"window_fill 0.5", corrupted_fill(0.5f)},
                   {"window_fill w + 2", corrupted_fill(static_cast<float>(kWindow + 2))},
                   {"window_fill -1", corrupted_fill(-1.0f)},
                   {"window_fill 1 at position 0", corrupted_fill(1.0f)}});
    auto context = std::make_shared<StatefulContext<Macchiato>>();
    const auto step = step_entry<Macchiato>(exec::reference, context);
    add_context_row(rows, step, "state with window_fill 0.5 (written through field())", "state",
                    [context] { *context->state.field(7) = 0.5f; });
    auto forward_context = std::make_shared<StatefulContext<Macchiato>>();
    const auto forward = forward_state_entry<Macchiato>(exec::reference, forward_context);
    add_context_row(
        rows, forward, "state with window_fill w + 2 (written through field())", "state",
        [forward_context] { *forward_context->state.field(7) = static_cast<float>(kWindow + 2); });
  }
  {
    const std::string ctor = entry_name<Macchiato>("LatteMacchiato()", "-");
    const MacchiatoDims good{
        .heads = kH, .latents = kL, .key_dim = kDk, .value_dim = kDv, .window = kWindow};
    auto with = [good](auto change) {
      return [good, change] {
        MacchiatoDims dims = good;
        change(dims);
        (void)MacchiatoType(dims);
      };
    };
    add_call_row(rows, ctor, "heads 0", "dims.heads", with([](MacchiatoDims& d) { d.heads = 0; }));
    add_call_row(rows, ctor, "latents 0", "dims.latents",
                 with([](MacchiatoDims& d) { d.latents = 0; }));
    add_call_row(rows, ctor, "key_dim 0", "dims.key_dim",
                 with([](MacchiatoDims& d) { d.key_dim = 0; }));
    add_call_row(rows, ctor, "value_dim 0", "dims.value_dim",
                 with([](MacchiatoDims& d) { d.value_dim = 0; }));
    add_call_row(rows, ctor, "window 0", "dims.window",
                 with([](MacchiatoDims& d) { d.window = 0; }));
    add_call_row(rows, ctor, "window -1", "dims.window",
                 with([](MacchiatoDims& d) { d.window = -1; }));
    add_call_row(rows, ctor, "options.scale NaN", "options.scale",
                 [good] { (void)MacchiatoType(good, {.scale = kNaN}); });
    add_call_row(rows, ctor, "latent (VAPOR) angles [H, Dv/2 + 1]", "latent_positional.angles",
                 [good] {
                   (void)MacchiatoType(good, {}, {.angles = Tensor<double, 2>({kH, kDv / 2 + 1})});
                 });
    add_call_row(
        rows, ctor, "window (RoPE) angles [H, Dv/2] instead of [H, Dk/2]",
        "window_positional.angles", [good] {
          (void)MacchiatoType(good, {}, {}, {.angles = Tensor<double, 2>({kH, kDv / 2}, 0.1)});
        });
    add_call_row(rows, ctor, "window (RoPE) base 0.5", "window_positional.base",
                 [good] { (void)MacchiatoType(good, {}, {}, {.angles = {}, .base = 0.5}); });
  }

  // ---- LinearAttention (reference)
  add_sequence_and_decode<LinearElu>(registry, exec::reference);
  add_sequence_and_decode<LinearBidirectional>(registry, exec::reference);
  add_sequence_and_decode<LinearElu>(registry, exec::cpu);
  add_sequence_and_decode<LinearBidirectional>(registry, exec::cpu);
  add_bf16_entries<LinearElu>(registry, exec::cpu);
  add_pool_rows<LinearElu>(registry);
  add_pool_rows<CosFormerCausal>(registry);
  add_pool_rows<LeapCausal>(registry);
  add_make_state_batch_rows<LinearElu>(registry);
  add_call_row(rows, entry_name<LinearElu>("make_state", "-"), "first_position -1",
               "first_position", [] { (void)LinearElu::make().make_state<float>(kB, -1); });
  add_state_bytes_rows<LinearElu>(registry);
  {
    // cross_forward: queries [B, T, H, Dk] over keys / values [B, S, H, *].
    auto attention = std::make_shared<const LinearBidirectional::A>(LinearBidirectional::make());
    TensorEntry<4> cross;
    cross.entry = entry_name<LinearBidirectional>("cross_forward", "reference");
    cross.inputs = {{"queries", {kB, kT, kH, kDk}},
                    {"keys", {kB, kSource, kH, kDk}},
                    {"values", {kB, kSource, kH, kDv}}};
    cross.out = {"out", {kB, kT, kH, kDv}};
    cross.dim_names = kSequenceDims;
    cross.invoke = [attention](const In4& in, Out4 out) {
      attention->cross_forward(exec::reference, in[0], in[1], in[2], out);
    };
    cross.blame = cross_blame({"queries", "keys", "values", "out"});
    registry.add(cross);
  }
  {
    const std::string ctor = entry_name<LinearElu>("LinearAttention()", "-");
    using A = LinearElu::A;
    const LinearDims good{.heads = kH, .key_dim = kDk, .value_dim = kDv};
    add_call_row(rows, ctor, "heads 0", "dims.heads", [] { (void)A({0, kDk, kDv}); });
    add_call_row(rows, ctor, "key_dim 0", "dims.key_dim", [] { (void)A({kH, 0, kDv}); });
    add_call_row(rows, ctor, "value_dim 0", "dims.value_dim", [] { (void)A({kH, kDk, 0}); });
    add_call_row(rows, ctor, "normaliser epsilon 0", "normaliser",
                 [good] { (void)A(good, {.normaliser = Normaliser::additive(0.0)}); });
    add_call_row(rows, ctor, "normaliser clamp_min -1", "normaliser",
                 [good] { (void)A(good, {.normaliser = Normaliser::clamp_min(-1.0)}); });
    add_call_row(rows, ctor, "normaliser epsilon NaN", "normaliser",
                 [good] { (void)A(good, {.normaliser = Normaliser::additive(kNaN)}); });
    add_call_row(rows, ctor, "rope_denominator rotated without RoPE", "rope_denominator",
                 [good] { (void)A(good, {.rope_denominator = RopeDenominator::rotated}); });
    using Rope = LinearAttention<Causal, Relu, NoReweight, RoPE>;
    add_call_row(rows, ctor, "RoPE angles [H, Dk/2 + 1]", "angles", [good] {
      (void)Rope(good, {.positional = {.angles = Tensor<double, 2>({kH, kDk / 2 + 1}, 0.1)}});
    });
    add_call_row(rows, ctor, "RoPE angles [H - 1, Dk/2]", "angles", [good] {
      (void)Rope(good, {.positional = {.angles = Tensor<double, 2>({kH - 1, kDk / 2}, 0.1)}});
    });
    Tensor<double, 2> nan_angles({kH, kDk / 2}, 0.1);
    nan_angles(2, 1) = kNaN;
    add_call_row(rows, ctor, "RoPE angle NaN", "angles",
                 [good, nan_angles] { (void)Rope(good, {.positional = {.angles = nan_angles}}); });
    add_call_row(rows, ctor, "RoPE base 0", "base",
                 [good] { (void)Rope(good, {.positional = {.angles = {}, .base = 0.0}}); });
  }

  // ---- CosFormer (reference)
  add_sequence_and_decode<CosFormerCausal>(registry, exec::reference);
  add_sequence_and_decode<CosFormerCausal>(registry, exec::cpu);
  add_state_bytes_rows<CosFormerCausal>(
      registry, {{"bytes of a cosFormer with another length M",
                  CosFormer<Causal>({kH, kDk, kDv}, {.reweight = {.length = kCapacity + 1}})
                      .make_state<float>(kB)
                      .save()},
                 {"position M + 1 (re-signed)",
                  with_saved_position(
                      CosFormerCausal::make_state<float>(CosFormerCausal::make(), kB).save(),
                      kCapacity + 1)}});
  {
    const std::string make = entry_name<CosFormerCausal>("make_state", "-");
    add_call_row(rows, make, "no length M given (decode needs M)", "length", [] {
      (void)CosFormer<Causal>({kH, kDk, kDv}).make_state<float>(kB);
    });
    add_call_row(rows, make, "first_position M + 1 (M: the state after the last token)", "first_position",
                 [] { (void)CosFormerCausal::make().make_state<float>(kB, kCapacity + 1); });
    add_call_row(rows, make, "batch 0", "batch",
                 [] { (void)CosFormerCausal::make().make_state<float>(0); });
    const std::string ctor = entry_name<CosFormerCausal>("CosFormer()", "-");
    add_call_row(rows, ctor, "length M 0", "length", [] {
      (void)CosFormer<Causal>({kH, kDk, kDv}, {.reweight = {.length = 0}});
    });
    add_call_row(rows, ctor, "length M -3 (bidirectional)", "length", [] {
      (void)CosFormer<Bidirectional>({kH, kDk, kDv}, {.reweight = {.length = -3}});
    });
    // M < T: forward without a state, with a state past M, step at position M.
    auto short_attention = std::make_shared<const CosFormer<Causal>>(
        CosFormer<Causal>({kH, kDk, kDv}, {.reweight = {.length = kT - 1}}));
    TensorEntry<4> short_forward = forward_entry<CosFormerCausal>(exec::reference);
    short_forward.invoke = [short_attention](const In4& in, Out4 out) {
      short_attention->forward(exec::reference, in[0], in[1], in[2], out);
    };
    add_context_row(rows, short_forward, "length M = T - 1 < T", "length", [] {});
    auto context = std::make_shared<StatefulContext<CosFormerCausal>>();
    const auto with_state = forward_state_entry<CosFormerCausal>(exec::reference, context);
    add_context_row(rows, with_state, "state at position M - 2, T = 5 tokens pass M", "length",
                    [context] { context->state.advance(kCapacity - 2); });
    auto step_context = std::make_shared<StatefulContext<CosFormerCausal>>();
    const auto step = step_entry<CosFormerCausal>(exec::reference, step_context);
    add_context_row(rows, step, "state at position M", "length",
                    [step_context] { step_context->state.advance(kCapacity); });
    // Bidirectional cross_forward with M < max(S, T).
    auto cross_attention = std::make_shared<const CosFormer<Bidirectional>>(
        CosFormer<Bidirectional>({kH, kDk, kDv}, {.reweight = {.length = kT}}));
    TensorEntry<4> cross;
    cross.entry = "CosFormer<bidirectional>::cross_forward [reference]";
    cross.inputs = {{"queries", {kB, kT, kH, kDk}},
                    {"keys", {kB, kSource, kH, kDk}},
                    {"values", {kB, kSource, kH, kDv}}};
    cross.out = {"out", {kB, kT, kH, kDv}};
    cross.dim_names = kSequenceDims;
    cross.invoke = [cross_attention](const In4& in, Out4 out) {
      cross_attention->cross_forward(exec::reference, in[0], in[1], in[2], out);
    };
    add_context_row(rows, cross, "length M = T < S", "length", [] {});
  }

  // ---- LeaPformer (reference)
  add_sequence_and_decode<LeapCausal>(registry, exec::reference);
  add_sequence_and_decode<LeapCausal>(registry, exec::cpu);
  add_state_bytes_rows<LeapCausal>(registry);
  {
    using A = LeaPformer<Causal>;
    const LinearDims dims{kH, kDk, kDv};
    const std::string ctor = entry_name<LeapCausal>("LeaPformer()", "-");
    auto with = [dims](auto change) {
      return [dims, change] {
        LeaPReweight::Params params{.query_module = leap_module(), .key_module = leap_module()};
        change(params);
        (void)A(dims, {.reweight = params});
      };
    };
    add_call_row(rows, ctor, "leap_factor 3 (does not divide Dk = 4)", "leap_factor",
                 with([](LeaPReweight::Params& p) { p.leap_factor = 3; }));
    add_call_row(rows, ctor, "leap_factor 0", "leap_factor",
                 with([](LeaPReweight::Params& p) { p.leap_factor = 0; }));
    add_call_row(rows, ctor, "leap_factor -2", "leap_factor",
                 with([](LeaPReweight::Params& p) { p.leap_factor = -2; }));
    add_call_row(rows, ctor, "leap_factor 8 > Dk", "leap_factor",
                 with([](LeaPReweight::Params& p) { p.leap_factor = 8; }));
    add_call_row(rows, ctor, "query module only", "key_module",
                 with([](LeaPReweight::Params& p) { p.key_module.reset(); }));
    add_call_row(rows, ctor, "key module only", "query_module",
                 with([](LeaPReweight::Params& p) { p.query_module.reset(); }));
    add_call_row(rows, ctor, "query_module.w1 [2, Dk]", "query_module.w1",
                 with([](LeaPReweight::Params& p) {
                   p.query_module->w1 = Tensor<double, 2>({2, kDk});
                 }));
    add_call_row(rows, ctor, "key_module.b1 [2]", "key_module.b1",
                 with([](LeaPReweight::Params& p) { p.key_module->b1 = Tensor<double, 1>({2}); }));
    add_call_row(rows, ctor, "query_module.w2 NaN", "query_module.w2",
                 with([](LeaPReweight::Params& p) { p.query_module->w2(0) = kNaN; }));
    add_call_row(rows, ctor, "key_module.b2 inf", "key_module.b2",
                 with([](LeaPReweight::Params& p) { p.key_module->b2 = kInf; }));
    Tensor<float, 2> w1({1, 2 * kDk});
    Tensor<float, 1> b1({1});
    add_call_row(rows, "LeaPModule::from [-]", "w1 with feature stride 2", "w1", [w1, b1] {
      (void)LeaPModule::from<float>(TensorView<const float, 2>(w1.data(), {1, kDk}, {2 * kDk, 2}),
                                    b1.cview(), b1.cview(), 0.0f);
    });
    add_call_row(rows, "LeaPModule::from [-]", "b1 null data", "b1", [w1, b1] {
      (void)LeaPModule::from<float>(TensorView<const float, 2>(w1.data(), {1, kDk}),
                                    TensorView<const float, 1>(nullptr, {1}), b1.cview(), 0.0f);
    });
  }
  {
    // LeaP without modules: proportions per call, [B, T, H] (forward) and [B, H] (step).
    using A = LeaPformer<Causal>;
    auto attention = std::make_shared<const A>(A({kH, kDk, kDv}));
    struct Proportions {
      Tensor<float, 3> queries = Tensor<float, 3>({kB, kT, kH}, 0.25f);
      Tensor<float, 3> keys = Tensor<float, 3>({kB, kT, kH}, 0.75f);
      Tensor<float, 2> step_queries = Tensor<float, 2>({kB, kH}, 0.5f);
      Tensor<float, 2> step_keys = Tensor<float, 2>({kB, kH}, 0.125f);
      SequenceProportions<float> sequence;
      StepProportions<float> step;
      Tensor<float, 3> spare;  // backing of a malformed proportion view
      Tensor<float, 2> step_spare;
      void reset() {
        sequence = {queries.cview(), keys.cview()};
        step = {step_queries.cview(), step_keys.cview()};
      }
    };
    auto proportions = std::make_shared<Proportions>();
    proportions->reset();
    TensorEntry<4> forward;
    forward.entry = "LeaPformer<causal>(no modules)::forward(proportions) [reference]";
    forward.inputs = sequence_args<LeapCausal>();
    forward.out = sequence_out<LeapCausal>();
    forward.dim_names = kSequenceDims;
    forward.prepare = [proportions] { proportions->reset(); };
    forward.invoke = [attention, proportions](const In4& in, Out4 out) {
      attention->forward(exec::reference, in[0], in[1], in[2], proportions->sequence, out);
    };
    set_self_attention_blame(forward);
    registry.add(forward);

    auto state = std::make_shared<A::State<float>>();
    TensorEntry<4> forward_state = forward;
    forward_state.entry = "LeaPformer<causal>(no modules)::forward(proportions, state) [reference]";
    forward_state.prepare = [proportions, attention, state] {
      proportions->reset();
      *state = attention->make_state<float>(kB);
    };
    forward_state.invoke = [attention, proportions, state](const In4& in, Out4 out) {
      attention->forward(exec::reference, in[0], in[1], in[2], proportions->sequence, out, *state);
    };
    forward_state.state_bytes = [state] { return state->save(); };
    registry.add(forward_state);

    TensorEntry<3> step;
    step.entry = "LeaPformer<causal>(no modules)::step(proportions) [reference]";
    step.inputs = step_args<LeapCausal>();
    step.out = step_out<LeapCausal>();
    step.dim_names = kStepDims;
    step.prepare = forward_state.prepare;
    step.invoke = [attention, proportions, state](const In3& in, Out3 out) {
      attention->step(exec::reference, *state, in[0], in[1], in[2], proportions->step, out);
    };
    step.state_bytes = forward_state.state_bytes;
    registry.add(step);

    // Proportion tensors: each extent off, null, feature stride, values outside [0, 1], aliasing
    // out.
    for (const auto* entry4 : {&forward, &forward_state}) {
      for (int which = 0; which < 2; ++which) {
        const std::string name = which == 0 ? "query_proportions" : "key_proportions";
        auto set = [proportions, which](TensorView<const float, 3> view) {
          (which == 0 ? proportions->sequence.queries : proportions->sequence.keys) = view;
        };
        for (std::size_t d = 0; d < 3; ++d)
          add_context_row(rows, *entry4,
                          name + ": extent " + std::string("BTH").substr(d, 1) + " + 1", name,
                          [proportions, set, d] {
                            std::array<index_t, 3> extents{kB, kT, kH};
                            extents[d] += 1;
                            proportions->spare = Tensor<float, 3>(extents, 0.5f);
                            set(proportions->spare.cview());
                          });
        add_context_row(rows, *entry4, name + ": null data", name, [set] {
          set(TensorView<const float, 3>(nullptr, {kB, kT, kH}));
        });
        add_context_row(rows, *entry4, name + ": feature stride 2", name, [proportions, set] {
          proportions->spare = Tensor<float, 3>({kB, kT, 2 * kH}, 0.5f);
          set(TensorView<const float, 3>(proportions->spare.data(), {kB, kT, kH},
                                         {kT * 2 * kH, 2 * kH, 2}));
        });
        for (float bad : {1.5f, -0.25f, std::numeric_limits<float>::quiet_NaN()})
          add_context_row(rows, *entry4, name + ": a value " + std::to_string(bad), name,
                          [proportions, set, bad] {
                            proportions->spare = Tensor<float, 3>({kB, kT, kH}, 0.5f);
                            proportions->spare(1, kT - 1, 2) = bad;
                            set(proportions->spare.cview());
                          });
      }
      add_context_row(rows, *entry4, "empty proportion views ([0, 0, 0])", "query_proportions",
                      [proportions] { proportions->sequence = {}; });
    }
    for (int which = 0; which < 2; ++which) {
      const std::string name = which == 0 ? "query_proportions" : "key_proportions";
      auto set = [proportions, which](TensorView<const float, 2> view) {
        (which == 0 ? proportions->step.queries : proportions->step.keys) = view;
      };
      for (std::size_t d = 0; d < 2; ++d)
        add_context_row(rows, step, name + ": extent " + std::string("BH").substr(d, 1) + " + 1",
                        name, [proportions, set, d] {
                          std::array<index_t, 2> extents{kB, kH};
                          extents[d] += 1;
                          proportions->step_spare = Tensor<float, 2>(extents, 0.5f);
                          set(proportions->step_spare.cview());
                        });
      add_context_row(rows, step, name + ": null data", name, [set] {
        set(TensorView<const float, 2>(nullptr, {kB, kH}));
      });
      for (float bad : {1.0001f, -1e-7f, std::numeric_limits<float>::infinity()})
        add_context_row(rows, step, name + ": a value " + std::to_string(bad), name,
                        [proportions, set, bad] {
                          proportions->step_spare = Tensor<float, 2>({kB, kH}, 0.5f);
                          proportions->step_spare(0, 1) = bad;
                          set(proportions->step_spare.cview());
                        });
    }
    // out aliasing a proportion tensor: proportions placed inside out's buffer.
    {
      const std::string entry = "LeaPformer<causal>(no modules)::forward(proportions) [reference]";
      for (int which = 0; which < 2; ++which) {
        const std::string name = which == 0 ? "query_proportions" : "key_proportions";
        rows.push_back(
            {entry, "out aliases " + name, "out", [attention, which] {
               const auto buffers = make_buffers(sequence_args<LeapCausal>(),
                                                 sequence_out<LeapCausal>(), Malformation{});
               const TensorView<const float, 3> inside(buffers->out.data(), {kB, kT, kH});
               const Tensor<float, 3> other({kB, kT, kH}, 0.5f);
               SequenceProportions<float> given{which == 0 ? inside : other.cview(),
                                                which == 0 ? other.cview() : inside};
               return attempt(
                   [&] {
                     attention->forward(exec::reference, buffers->inputs[0], buffers->inputs[1],
                                        buffers->inputs[2], given, buffers->out);
                   },
                   [&] { return buffers->untouched(); });
             }});
        rows.push_back({"LeaPformer<causal>(no modules)::step(proportions) [reference]",
                        "out aliases " + name, "out", [attention, which] {
                          auto state = attention->make_state<float>(kB);
                          const auto before = state.save();
                          const auto buffers = make_buffers(step_args<LeapCausal>(),
                                                            step_out<LeapCausal>(), Malformation{});
                          const TensorView<const float, 2> inside(buffers->out.data(), {kB, kH});
                          const Tensor<float, 2> other({kB, kH}, 0.5f);
                          StepProportions<float> given{which == 0 ? inside : other.cview(),
                                                       which == 0 ? other.cview() : inside};
                          return attempt(
                              [&] {
                                attention->step(exec::reference, state, buffers->inputs[0],
                                                buffers->inputs[1], buffers->inputs[2], given,
                                                buffers->out);
                              },
                              [&] { return buffers->untouched() && state.save() == before; });
                        }});
      }
    }
    // The no-proportion step overload on a module-less LeaP: its own entry.
    rows.push_back({"LeaPformer<causal>(no modules)::step [reference]",
                    "no proportions, no modules", "proportions", [attention] {
                      auto state = attention->make_state<float>(kB);
                      const auto before = state.save();
                      const auto buffers = make_buffers(step_args<LeapCausal>(),
                                                        step_out<LeapCausal>(), Malformation{});
                      return attempt(
                          [&] {
                            attention->step(exec::reference, state, buffers->inputs[0],
                                            buffers->inputs[1], buffers->inputs[2], buffers->out);
                          },
                          [&] { return buffers->untouched() && state.save() == before; });
                    }});
    rows.push_back({"LeaPformer<causal>(no modules)::forward [reference]",
                    "no proportions, no modules", "proportions", [attention] {
                      const auto buffers = make_buffers(sequence_args<LeapCausal>(),
                                                        sequence_out<LeapCausal>(), Malformation{});
                      return attempt(
                          [&] {
                            attention->forward(exec::reference, buffers->inputs[0],
                                               buffers->inputs[1], buffers->inputs[2],
                                               buffers->out);
                          },
                          [&] { return buffers->untouched(); });
                    }});
  }
  {
    // LeaP cross-attention with proportions P_q [B, T, H], P_k [B, S, H].
    using A = LeaPformer<Bidirectional>;
    auto attention = std::make_shared<const A>(A({kH, kDk, kDv}));
    auto queries = std::make_shared<Tensor<float, 3>>(std::array<index_t, 3>{kB, kT, kH}, 0.25f);
    auto keys = std::make_shared<Tensor<float, 3>>(std::array<index_t, 3>{kB, kSource, kH}, 0.75f);
    auto given = std::make_shared<SequenceProportions<float>>();
    TensorEntry<4> cross;
    cross.entry = "LeaPformer<bidirectional>(no modules)::cross_forward(proportions) [reference]";
    cross.inputs = {{"queries", {kB, kT, kH, kDk}},
                    {"keys", {kB, kSource, kH, kDk}},
                    {"values", {kB, kSource, kH, kDv}}};
    cross.out = {"out", {kB, kT, kH, kDv}};
    cross.dim_names = kSequenceDims;
    cross.prepare = [given, queries, keys] { *given = {queries->cview(), keys->cview()}; };
    cross.invoke = [attention, given](const In4& in, Out4 out) {
      attention->cross_forward(exec::reference, in[0], in[1], in[2], *given, out);
    };
    cross.blame = cross_blame({"queries", "keys", "values", "out"});
    registry.add(cross);
    auto spare = std::make_shared<Tensor<float, 3>>();
    add_context_row(rows, cross, "key_proportions [B, T, H] instead of [B, S, H]",
                    "key_proportions", [given, spare] {
                      *spare = Tensor<float, 3>({kB, kT, kH}, 0.5f);
                      given->keys = spare->cview();
                    });
    add_context_row(rows, cross, "query_proportions [B, S, H] instead of [B, T, H]",
                    "query_proportions", [given, spare] {
                      *spare = Tensor<float, 3>({kB, kSource, kH}, 0.5f);
                      given->queries = spare->cview();
                    });
  }

  // ---- Lavo (reference)
  add_sequence_and_decode<LavoCausal>(registry, exec::reference);
  add_sequence_and_decode<LavoBidirectional>(registry, exec::reference);
  add_bf16_entries<LavoCausal>(registry, exec::cpu);
  add_pool_rows<LavoCausal>(registry);
  add_make_state_batch_rows<LavoCausal>(registry);
  add_state_bytes_rows<LavoCausal>(registry);
  for (auto backward : {lavo_backward_entry<LavoCausal>(exec::reference),
                        lavo_backward_entry<LavoCausal>(exec::cpu),
                        lavo_backward_entry<LavoBidirectional>(exec::reference),
                        lavo_backward_entry<LavoBidirectional>(exec::cpu),
                        lavo_cross_backward_entry<LavoBidirectional>(exec::reference),
                        lavo_cross_backward_entry<LavoBidirectional>(exec::cpu)})
    registry.add(backward);
  {
    auto attention = std::make_shared<const LavoBidirectional::A>(LavoBidirectional::make());
    TensorEntry<4> cross;
    cross.entry = entry_name<LavoBidirectional>("cross_forward", "reference");
    cross.inputs = {{"queries", {kB, kT, kH, kDk}}, {"source", {kB, kSource, kH, kDk}}};
    cross.out = {"out", {kB, kT, kH, kDk}};
    cross.dim_names = kSequenceDims;
    cross.invoke = [attention](const In4& in, Out4 out) {
      attention->cross_forward(exec::reference, in[0], in[1], out);
    };
    cross.blame = cross_blame({"queries", "source", "out"});
    registry.add(cross);
  }
  {
    const std::string ctor = entry_name<LavoCausal>("Lavo()", "-");
    using A = Lavo<Causal>;
    const LavoDims good{.heads = kH, .dim = kDk, .bases = kLavoBases, .window = kWindow};
    auto with = [good](auto change) {
      return [good, change] {
        LavoDims dims = good;
        change(dims);
        (void)A(dims);
      };
    };
    add_call_row(rows, ctor, "heads 0", "dims.heads", with([](LavoDims& d) { d.heads = 0; }));
    add_call_row(rows, ctor, "dim 0", "dims.dim", with([](LavoDims& d) { d.dim = 0; }));
    add_call_row(rows, ctor, "bases 0", "dims.bases", with([](LavoDims& d) { d.bases = 0; }));
    add_call_row(rows, ctor, "bases r = d + 1 > d", "dims.bases",
                 with([](LavoDims& d) { d.bases = d.dim + 1; }));
    add_call_row(rows, ctor, "window 0", "dims.window", with([](LavoDims& d) { d.window = 0; }));
    add_call_row(rows, ctor, "window -1", "dims.window", with([](LavoDims& d) { d.window = -1; }));
    add_call_row(rows, ctor, "window 2^30 + 1", "dims.window",
                 with([](LavoDims& d) { d.window = (index_t{1} << 30) + 1; }));
    add_call_row(rows, ctor, "bases tensor [H, r, d + 1]", "bases", [good] {
      (void)A(good, {.bases = Tensor<double, 3>({kH, kLavoBases, kDk + 1}, 0.1)});
    });
    add_call_row(rows, ctor, "bases tensor with a NaN", "bases", [good] {
      Tensor<double, 3> bases = orthonormal_bases(kH, kLavoBases, kDk, 3);
      bases(2, 0, 1) = kNaN;
      (void)A(good, {.bases = bases});
    });
    add_call_row(rows, ctor, "relative_bias [H, 2w]", "relative_bias", [good] {
      (void)A(good, {.relative_bias = Tensor<double, 2>({kH, 2 * kWindow}, 0.0)});
    });
    add_call_row(rows, ctor, "relative_bias [H + 1, 2w - 1]", "relative_bias", [good] {
      (void)A(good, {.relative_bias = Tensor<double, 2>({kH + 1, 2 * kWindow - 1}, 0.0)});
    });
    add_call_row(rows, ctor, "relative_bias with inf", "relative_bias", [good] {
      Tensor<double, 2> bias({kH, 2 * kWindow - 1}, 0.0);
      bias(0, 2) = kInf;
      (void)A(good, {.relative_bias = bias});
    });
    add_call_row(rows, ctor, "scale NaN", "scale", [good] { (void)A(good, {.scale = kNaN}); });
    add_call_row(rows, ctor, "empty_memory not an enumerator", "empty_memory",
                 [good] { (void)A(good, {.empty_memory = static_cast<LavoEmptyMemory>(7)}); });
  }

  // ---- ConvCompressedAttention (reference)
  add_sequence_and_decode<ConvCausal>(registry, exec::reference);
  add_sequence_and_decode<ConvBidirectional>(registry, exec::reference);
  add_bf16_entries<ConvCausal>(registry, exec::cpu);
  add_pool_rows<ConvCausal>(registry);
  for (auto backward : {conv_backward_entry<ConvCausal>(exec::reference),
                        conv_backward_entry<ConvCausal>(exec::cpu),
                        conv_backward_entry<ConvBidirectional>(exec::reference),
                        conv_backward_entry<ConvBidirectional>(exec::cpu)})
    registry.add(backward);
  add_make_state_batch_rows<ConvCausal>(registry);
  add_call_row(rows, entry_name<ConvCausal>("make_state", "-"), "context_capacity 0",
               "context_capacity", [] { (void)ConvCausal::make().make_state<float>(kB, 0); });
  add_state_bytes_rows<ConvCausal>(
      registry,
      {{"position context_capacity + 1 (re-signed)",
        with_saved_position(ConvCausal::make().make_state<float>(kB, kCapacity).save(),
                            kCapacity + 1)}},
      {{"bytes of another context_capacity",
        ConvCausal::make().make_state<float>(kB, kCapacity + 1).save()}});
  {
    auto context = std::make_shared<StatefulContext<ConvCausal>>();
    const auto step = step_entry<ConvCausal>(exec::reference, context);
    add_context_row(rows, step, "state full (context_capacity 1, position 1)", "state", [context] {
      context->state = context->attention.make_state<float>(kB, 1);
      context->state.advance(1);
    });
    auto forward_context = std::make_shared<StatefulContext<ConvCausal>>();
    const auto forward = forward_state_entry<ConvCausal>(exec::reference, forward_context);
    add_context_row(rows, forward, "state of context_capacity T - 1", "state", [forward_context] {
      forward_context->state = forward_context->attention.make_state<float>(kB, kT - 1);
    });
  }
  {
    const std::string ctor = entry_name<ConvCausal>("ConvCompressedAttention()", "-");
    using A = ConvCompressedAttention<Causal>;
    auto with_dims = [](auto change) {
      return [change] {
        ConvCompressedDims dims = conv_dims();
        const ConvCompressedParams params = ConvCompressedParams::zeros(dims);
        change(dims);
        (void)A(dims, params);
      };
    };
    add_call_row(rows, ctor, "heads 0", "dims.heads",
                 with_dims([](ConvCompressedDims& d) { d.heads = 0; }));
    add_call_row(rows, ctor, "key_dim 0", "dims.key_dim",
                 with_dims([](ConvCompressedDims& d) { d.key_dim = 0; }));
    add_call_row(rows, ctor, "value_dim 0", "dims.value_dim",
                 with_dims([](ConvCompressedDims& d) { d.value_dim = 0; }));
    add_call_row(rows, ctor, "group_size 0", "dims.group_size",
                 with_dims([](ConvCompressedDims& d) { d.group_size = 0; }));
    add_call_row(rows, ctor, "levels 0", "dims.levels",
                 with_dims([](ConvCompressedDims& d) { d.levels = 0; }));
    add_call_row(rows, ctor, "levels -1", "dims.levels",
                 with_dims([](ConvCompressedDims& d) { d.levels = -1; }));
    add_call_row(rows, ctor, "window_left -1", "dims.window_left",
                 with_dims([](ConvCompressedDims& d) { d.window_left = -1; }));
    add_call_row(rows, ctor, "causal window_right 1", "dims.window_right",
                 with_dims([](ConvCompressedDims& d) { d.window_right = 1; }));
    add_call_row(rows, ctor, "bidirectional window_right -1", "dims.window_right", [] {
      ConvCompressedDims dims = conv_dims();
      dims.window_right = -1;
      (void)ConvCompressedAttention<Bidirectional>(dims, ConvCompressedParams::zeros(conv_dims()));
    });
    add_call_row(rows, ctor, "scale NaN", "scale",
                 [] { (void)A(conv_dims(), ConvCompressedParams::zeros(conv_dims()), kNaN); });
    auto with_params = [](auto change) {
      return [change] {
        ConvCompressedParams params = ConvCompressedParams::zeros(conv_dims());
        change(params);
        (void)A(conv_dims(), params);
      };
    };
    add_call_row(rows, ctor, "conv_weight: one tensor for two levels", "params.conv_weight",
                 with_params([](ConvCompressedParams& p) { p.conv_weight.pop_back(); }));
    add_call_row(rows, ctor, "conv_weight[1] [H, M + 1, Dv, Dv]", "params.conv_weight[1]",
                 with_params([](ConvCompressedParams& p) {
                   p.conv_weight[1] = Tensor<double, 4>({kH, 3, kDv, kDv});
                 }));
    add_call_row(rows, ctor, "conv_bias[0] [H, Dv + 1]", "params.conv_bias[0]",
                 with_params([](ConvCompressedParams& p) {
                   p.conv_bias[0] = Tensor<double, 2>({kH, kDv + 1});
                 }));
    add_call_row(rows, ctor, "level_query: two tensors for L - 1 = 1", "params.level_query",
                 with_params([](ConvCompressedParams& p) {
                   p.level_query.push_back(p.level_query.front());
                 }));
    add_call_row(rows, ctor, "level_key[0] [H, Dv, Dv] instead of [H, Dk, Dv]",
                 "params.level_key[0]", with_params([](ConvCompressedParams& p) {
                   p.level_key[0] = Tensor<double, 3>({kH, kDv, kDv});
                 }));
    add_call_row(rows, ctor, "level_value[0] NaN", "params.level_value[0]",
                 with_params([](ConvCompressedParams& p) { p.level_value[0](1, 2, 3) = kNaN; }));
    add_call_row(rows, ctor, "cross_query [H - 1, Dk, Dv]", "params.cross_query",
                 with_params([](ConvCompressedParams& p) {
                   p.cross_query = Tensor<double, 3>({kH - 1, kDk, kDv});
                 }));
    add_call_row(rows, ctor, "cross_value inf", "params.cross_value",
                 with_params([](ConvCompressedParams& p) { p.cross_value(0, 0, 0) = kInf; }));
    add_call_row(rows, "ConvCompressedParams::zeros [-]", "levels 0", "dims.levels", [] {
      ConvCompressedDims dims = conv_dims();
      dims.levels = 0;
      (void)ConvCompressedParams::zeros(dims);
    });
  }

  // ---- orthonormal_bases
  {
    const std::string entry = "orthonormal_bases [-]";
    add_call_row(rows, entry, "heads 0", "heads", [] { (void)orthonormal_bases(0, 2, 4, 1); });
    add_call_row(rows, entry, "bases 0", "bases", [] { (void)orthonormal_bases(2, 0, 4, 1); });
    add_call_row(rows, entry, "dim 0", "dim", [] { (void)orthonormal_bases(2, 2, 0, 1); });
    add_call_row(rows, entry, "bases -1", "bases", [] { (void)orthonormal_bases(2, -1, 4, 1); });
    add_call_row(rows, entry, "bases r = d + 1 > d", "bases",
                 [] { (void)orthonormal_bases(2, 5, 4, 1); });
  }
  return registry;
}

const Registry& registry() {
  static const Registry built = build_registry();
  return built;
}

// A float64 state never reaches a float32 call: the mismatch is a compile error.
template <class A, class State, class Input, class Output>
concept StepsWith = requires(const A& a, State& s, Input x, Output o) {
  a.step(exec::reference, s, x, x, x, o);
};
static_assert(StepsWith<LatteVapor::A, StateOf<LatteVapor>, TensorView<const float, 3>, Out3>);
static_assert(
    !StepsWith<LatteVapor::A, LatteVapor::A::State<double>, TensorView<const float, 3>, Out3>);
static_assert(!StepsWith<SoftmaxCausal::A, SoftmaxCausal::A::State<double>,
                         TensorView<const float, 3>, Out3>);
static_assert(
    !StepsWith<LinearElu::A, LinearElu::A::State<double>, TensorView<const float, 3>, Out3>);
static_assert(
    !StepsWith<LavoCausal::A, LavoCausal::A::State<double>, TensorView<const float, 3>, Out3>);
static_assert(
    !StepsWith<ConvCausal::A, ConvCausal::A::State<double>, TensorView<const float, 3>, Out3>);

TEST_CASE("the table's checks can fail: entries that validate nothing are caught") {
  // An entry that checks nothing and writes out[0]: every row must see no
  // exception and (out not null) a changed buffer.
  TensorEntry<4> careless;
  careless.entry = "careless";
  careless.inputs = sequence_args<SoftmaxCausal>();
  careless.out = sequence_out<SoftmaxCausal>();
  careless.dim_names = kSequenceDims;
  careless.invoke = [](const In4&, Out4 out) {
    if (out.data() != nullptr) out.data()[0] = 0.0f;
  };
  set_self_attention_blame(careless);
  Table table;
  add_tensor_rows(table, careless);
  REQUIRE(table.size() > 20);
  for (const Row& row : table) {
    INFO(row.case_name);
    const Outcome outcome = row.run();
    CHECK(outcome.thrown == Outcome::Thrown::nothing);
    CHECK(outcome.untouched == (row.case_name == "out: null data"));
  }
  // An entry that throws the wrong type, or latte::Error naming another argument.
  careless.invoke = [](const In4&, Out4) { throw std::invalid_argument("not a latte::Error"); };
  CHECK(run_entry(careless, {}).thrown == Outcome::Thrown::other);
  careless.invoke = [](const In4&, Out4) { throw Error("keys", "wrong name"); };
  const Outcome named = run_entry(careless, {.fault = Fault::extent, .arg = 2, .dim = 3});
  CHECK(named.thrown == Outcome::Thrown::latte_error);
  CHECK(named.argument == "keys");  // the table expects "values" here: that row would fail

  // The same for an entry with several outputs (a backward) that checks nothing
  // and writes the first element of each output.
  MultiOutputEntry<4> careless_backward = softmax_backward_entry<SoftmaxCausal>(exec::reference);
  careless_backward.invoke = [](const In4&, const std::vector<Out4>& outputs) {
    for (const Out4& out : outputs)
      if (out.data() != nullptr) out.data()[0] = 0.0f;
  };
  Table backward_table;
  add_multi_output_rows(backward_table, careless_backward);
  REQUIRE(backward_table.size() > 40);
  for (const Row& row : backward_table) {
    INFO(row.case_name);
    const Outcome outcome = row.run();
    CHECK(outcome.thrown == Outcome::Thrown::nothing);
    CHECK_FALSE(outcome.untouched);  // each call writes at least one output
  }
}

TEST_CASE("every tensor entry's valid call succeeds and writes all of out") {
  const Registry& r = registry();
  auto check = [](const auto& entry) {
    const auto result = run_valid(entry);
    INFO(entry.entry << ": " << result.what);
    CHECK_FALSE(result.threw);
    CHECK(result.out_written);
  };
  for (const auto& entry : r.sequence_entries) check(entry);
  for (const auto& entry : r.step_entries) check(entry);
  for (const auto& entry : r.backward_entries) {
    const auto result = run_valid_multi(entry);
    INFO(entry.entry << ": " << result.what);
    CHECK_FALSE(result.threw);
    CHECK(result.out_written);
  }
  MESSAGE("tensor entry points: " << r.sequence_entries.size() + r.step_entries.size() +
                                         r.backward_entries.size());
}

TEST_CASE("load_state and State::restore give every edited buffer the same verdict") {
  // Accepted by both, or refused by both with latte::Error naming 'bytes' and
  // the restored-into state unchanged.
  const Registry& r = registry();
  auto verdict = [](const Outcome& outcome) -> std::string {
    if (outcome.thrown == Outcome::Thrown::nothing) return "accepted";
    if (outcome.thrown == Outcome::Thrown::latte_error && outcome.argument == "bytes")
      return "refused";
    return "refused by something else";
  };
  int disagreements = 0, accepted = 0;
  for (const VerdictPair& pair : r.verdicts) {
    const Outcome loaded = pair.load(), restored = pair.restore();
    const std::string by_load = verdict(loaded), by_restore = verdict(restored);
    accepted += by_load == "accepted";
    const bool kept_if_refused = by_restore == "accepted" || restored.untouched;
    if (by_load == by_restore && by_load != "refused by something else" && kept_if_refused)
      continue;
    ++disagreements;
    FAIL_CHECK(pair.entry << " | " << pair.case_name << ": load_state " << by_load << " ("
                          << loaded.what << "), restore " << by_restore << " (" << restored.what
                          << ")" << (kept_if_refused ? "" : ", state changed"));
  }
  MESSAGE("verdict pairs: " << r.verdicts.size() << ", accepted by both: " << accepted
                            << ", disagreements: " << disagreements);
}

TEST_CASE(
    "malformed-call table: every row throws latte::Error naming its argument, writes nothing") {
  const Registry& r = registry();
  std::map<std::string, int> rows_per_entry;
  int failures = 0;
  for (const Row& row : r.rows) {
    ++rows_per_entry[row.entry];
    const Outcome outcome = row.run();
    const bool ok =
        outcome.thrown == Outcome::Thrown::latte_error && outcome.argument == row.argument &&
        outcome.what.rfind("latte: argument '" + row.argument + "'", 0) == 0 && outcome.untouched;
    if (ok) continue;
    ++failures;
    const std::string thrown = outcome.thrown == Outcome::Thrown::latte_error ? "latte::Error"
                               : outcome.thrown == Outcome::Thrown::other     ? "another exception"
                                                                              : "nothing";
    FAIL_CHECK(row.entry << " | " << row.case_name << ": expected latte::Error naming '"
                         << row.argument << "', got " << thrown << " naming '" << outcome.argument
                         << "' (" << outcome.what << "), outputs untouched: "
                         << std::string(outcome.untouched ? "yes" : "NO"));
  }
  // Rows per mechanism (the entry name up to "::" or " ["), for the closing note.
  std::map<std::string, int> rows_per_mechanism;
  for (const auto& [entry, count] : rows_per_entry) {
    std::string mechanism = entry.substr(0, entry.find_first_of(":["));
    while (!mechanism.empty() && mechanism.back() == ' ') mechanism.pop_back();
    rows_per_mechanism[mechanism] += count;
  }
  std::string breakdown;
  for (const auto& [mechanism, count] : rows_per_mechanism)
    breakdown += "\n  " + mechanism + ": " + std::to_string(count);
  MESSAGE("malformed-call table: " << r.rows.size() << " rows over " << rows_per_entry.size()
                                   << " entry points; failures: " << failures << breakdown);
}

}  // namespace

}  // namespace test_malformed_table
