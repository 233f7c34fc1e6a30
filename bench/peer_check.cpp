// latte-peer-check: latte's own forward on inputs written by a peer script, so
// that the PyTorch transcriptions in bench/peers/torch_mechanisms.py are checked
// against latte (not against themselves) before they are timed.
//
//   latte-peer-check <mechanism> <float32|float64> <dir>
//
// mechanism: macchiato (causal, RunningMax, RoPE on the window; latte-compare's
// macchiato rows), lavo (causal), conv_compressed (causal). <dir> holds
// `meta.txt` (lines `name value`: B, T, H and the mechanism's sizes) and one raw
// little-endian file per array, `<name>.bin`: the inputs in the given dtype, in
// latte's layout [B, T, H, *], and the learned parameters in float64 in the
// layouts of latte's parameter structs (LavoParams, ConvCompressedParams). It
// runs the forward on exec::cpu and writes `out.bin` ([B, T, H, Dv], the dtype).
#include <latte/attention.hpp>

#include <array>
#include <cstdio>
#include <fstream>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace {

using latte::index_t;

struct Inputs {
  std::string dir;
  std::map<std::string, index_t> meta;

  index_t operator[](const std::string& name) const {
    const auto at = meta.find(name);
    if (at == meta.end()) throw std::runtime_error("meta.txt lacks " + name);
    return at->second;
  }

  /// Reads `<name>.bin` into `data` (its size: the element count expected).
  template <class T>
  void read(const std::string& name, T* data, index_t count) const {
    std::ifstream in(dir + "/" + name + ".bin", std::ios::binary | std::ios::ate);
    if (!in) throw std::runtime_error("cannot open " + dir + "/" + name + ".bin");
    const auto bytes = static_cast<std::streamoff>(count * index_t(sizeof(T)));
    if (in.tellg() != bytes)
      throw std::runtime_error(name + ".bin: expected " + std::to_string(bytes) + " bytes");
    in.seekg(0);
    in.read(reinterpret_cast<char*>(data), bytes);
  }

  template <class T, std::size_t N>
  latte::Tensor<T, N> tensor(const std::string& name, const std::array<index_t, N>& extents) const {
    latte::Tensor<T, N> x(extents);
    read(name, x.data(), x.size());
    return x;
  }
};

Inputs load(const std::string& dir) {
  Inputs inputs{dir, {}};
  std::ifstream meta(dir + "/meta.txt");
  if (!meta) throw std::runtime_error("cannot open " + dir + "/meta.txt");
  std::string name;
  long long value = 0;
  while (meta >> name >> value) inputs.meta[name] = static_cast<index_t>(value);
  return inputs;
}

template <class T>
void write(const std::string& dir, const latte::Tensor<T, 4>& out) {
  std::ofstream file(dir + "/out.bin", std::ios::binary);
  file.write(reinterpret_cast<const char*>(out.data()),
             static_cast<std::streamsize>(out.size() * index_t(sizeof(T))));
  if (!file) throw std::runtime_error("cannot write " + dir + "/out.bin");
}

/// A mechanism with (queries, keys, values) inputs: reads them, runs its forward, writes out.
template <class T, class Attention>
void qkv_forward(const Inputs& in, const Attention& attention, index_t Dk, index_t Dv) {
  const index_t B = in["B"], T_ = in["T"], H = in["H"];
  const auto q = in.tensor<T, 4>("queries", {B, T_, H, Dk});
  const auto k = in.tensor<T, 4>("keys", {B, T_, H, Dk});
  const auto v = in.tensor<T, 4>("values", {B, T_, H, Dv});
  latte::Tensor<T, 4> out({B, T_, H, Dv});
  attention.forward(latte::exec::cpu, q, k, v, out.view());
  write(in.dir, out);
}

template <class T>
void macchiato(const Inputs& in) {
  const index_t B = in["B"], T_ = in["T"], H = in["H"], L = in["L"], Dk = in["Dk"], Dv = in["Dv"];
  using Macchiato = latte::LatteMacchiato<latte::Causal, latte::RunningMax, latte::NoPositional,
                                          latte::RoPE>;
  const Macchiato attention(
      {.heads = H, .latents = L, .key_dim = Dk, .value_dim = Dv, .window = in["window"]});
  const auto q = in.tensor<T, 4>("query_logits", {B, T_, H, L + 1});
  const auto k = in.tensor<T, 4>("key_logits", {B, T_, H, L});
  const auto wq = in.tensor<T, 4>("window_queries", {B, T_, H, Dk});
  const auto wk = in.tensor<T, 4>("window_keys", {B, T_, H, Dk});
  const auto v = in.tensor<T, 4>("values", {B, T_, H, Dv});
  latte::Tensor<T, 4> out({B, T_, H, Dv});
  attention.forward(latte::exec::cpu, q, k, wq, wk, v, out.view());
  write(in.dir, out);
}

template <class T>
void lavo(const Inputs& in) {
  const index_t H = in["H"], d = in["d"], r = in["r"], w = in["window"];
  latte::LavoParams params;
  params.bases = in.tensor<double, 3>("bases", {H, r, d});
  params.relative_bias = in.tensor<double, 2>("relative_bias", {H, 2 * w - 1});
  const latte::Lavo<latte::Causal> attention({.heads = H, .dim = d, .bases = r, .window = w},
                                             std::move(params));
  qkv_forward<T>(in, attention, d, d);
}

template <class T>
void conv_compressed(const Inputs& in) {
  const index_t H = in["H"], Dk = in["Dk"], Dv = in["Dv"];
  const latte::ConvCompressedDims dims{.heads = H, .key_dim = Dk, .value_dim = Dv,
                                       .group_size = in["M"], .levels = in["levels"]};
  auto params = latte::ConvCompressedParams::zeros(dims);
  auto fill = [&](const std::string& name, auto& tensor) { in.read(name, tensor.data(), tensor.size()); };
  for (std::size_t i = 0; i < params.conv_weight.size(); ++i) {
    fill("conv_weight_" + std::to_string(i), params.conv_weight[i]);
    fill("conv_bias_" + std::to_string(i), params.conv_bias[i]);
  }
  for (std::size_t i = 0; i < params.level_query.size(); ++i) {
    fill("level_query_" + std::to_string(i), params.level_query[i]);
    fill("level_key_" + std::to_string(i), params.level_key[i]);
    fill("level_value_" + std::to_string(i), params.level_value[i]);
  }
  fill("cross_query", params.cross_query);
  fill("cross_key", params.cross_key);
  fill("cross_value", params.cross_value);
  qkv_forward<T>(in, latte::ConvCompressedAttention<latte::Causal>(dims, params), Dk, Dv);
}

template <class T>
void run(const std::string& mechanism, const Inputs& in) {
  if (mechanism == "macchiato") macchiato<T>(in);
  else if (mechanism == "lavo") lavo<T>(in);
  else if (mechanism == "conv_compressed") conv_compressed<T>(in);
  else throw std::runtime_error("unknown mechanism " + mechanism);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 4) {
    std::fprintf(stderr,
                 "usage: latte-peer-check <macchiato|lavo|conv_compressed> <float32|float64> <dir>\n");
    return 2;
  }
  try {
    const std::string mechanism = argv[1], dtype = argv[2];
    const Inputs inputs = load(argv[3]);
    if (dtype == "float32") run<float>(mechanism, inputs);
    else if (dtype == "float64") run<double>(mechanism, inputs);
    else throw std::runtime_error("dtype must be float32 or float64, not " + dtype);
  } catch (const std::exception& error) {
    std::fprintf(stderr, "latte-peer-check: %s\n", error.what());
    return 1;
  }
  return 0;
}
