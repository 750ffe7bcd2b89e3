// Google Benchmark of the moegrad CPU kernels through the C++ API (plan_* once, then
// Executor::run in the timed loop), at DeepSeek-V3 and GPT-OSS shapes, fp32, bf16 and fp16, on 1 and 2
// threads. The Python harness (python -m moegrad.bench, docs/performance.md) is the reference
// benchmark with baselines; this binary isolates the kernels from Python and dispatch overhead.
//
//   moegrad_bench_kernels [--tokens=16,2048] [--benchmark_filter=swiglu] [other benchmark flags]
//
// Method, as in the Python harness:
// * bytes = every input read once + every output written once (same table as bench.py);
//   reported as bytes_per_second, and as the counter "roof" = achieved / copy bandwidth, where
//   the copy bandwidth is a memcpy of a large buffer measured once per thread count at start-up
//   (counted as 2 x size: read + write).
// * Each benchmark owns enough buffer sets (inputs, outputs, planned executor, workspace) that
//   the rotation touches at least 4 x the last-level cache, so calls do not run from cache.
// * Real (wall) time, the thread count set with moegrad::set_num_threads.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <numeric>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "moegrad/moegrad.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace {

using moegrad::DType;
using moegrad::TensorView;

// ------------------------------------------------------------------------------------------
// machine facts
// ------------------------------------------------------------------------------------------
int64_t llc_bytes() {
  int64_t best_level = 0, best = 0;
  for (int i = 0; i < 16; ++i) {
    std::string dir = "/sys/devices/system/cpu/cpu0/cache/index" + std::to_string(i) + "/";
    std::ifstream type(dir + "type"), level(dir + "level"), size(dir + "size");
    if (!type || !level || !size) continue;
    std::string t, s;
    int64_t l = 0;
    type >> t;
    level >> l;
    size >> s;
    if (t == "Instruction" || s.empty()) continue;
    int64_t mult = 1;
    char unit = s.back();
    if (unit == 'K') mult = 1 << 10;
    if (unit == 'M') mult = 1 << 20;
    if (unit == 'G') mult = int64_t{1} << 30;
    int64_t v = std::atoll(s.c_str()) * mult;
    if (l >= best_level) {
      best_level = l;
      best = v;
    }
  }
  return best > 0 ? best : int64_t{64} << 20;
}

// memcpy bandwidth (GB/s, 2 x size) on `threads` threads: each thread copies its slice.
double copy_gbps(int threads) {
  static std::map<int, double> cache;
  auto it = cache.find(threads);
  if (it != cache.end()) return it->second;
  const size_t bytes = std::max<size_t>(size_t{256} << 20, 4 * static_cast<size_t>(llc_bytes()));
  std::vector<char> a(bytes, 1), b(bytes, 0);
  auto once = [&] {  // each of `threads` std::threads copies its slice
    if (threads <= 1) {
      std::memcpy(b.data(), a.data(), bytes);
      return;
    }
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
      size_t lo = bytes * t / threads, hi = bytes * (t + 1) / threads;
      pool.emplace_back([&, lo, hi] { std::memcpy(b.data() + lo, a.data() + lo, hi - lo); });
    }
    for (auto& th : pool) th.join();
  };
  once();
  std::vector<double> times;
  for (int r = 0; r < 11; ++r) {
    auto t0 = std::chrono::steady_clock::now();
    once();
    times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(times.begin(), times.end());
  double gbps = 2.0 * static_cast<double>(bytes) / times[times.size() / 2] / 1e9;
  cache[threads] = gbps;
  return gbps;
}

// ------------------------------------------------------------------------------------------
// buffers
// ------------------------------------------------------------------------------------------
struct Buffer {
  std::unique_ptr<unsigned char, void (*)(void*)> p{nullptr, std::free};
  size_t bytes = 0;
  explicit Buffer(size_t n) : bytes(n) {
    size_t rounded = (std::max<size_t>(n, 1) + 63) / 64 * 64;
    p.reset(static_cast<unsigned char*>(std::aligned_alloc(64, rounded)));
    if (!p) throw std::bad_alloc();
  }
  template <typename T>
  T* as() { return reinterpret_cast<T*>(p.get()); }
};

uint16_t to_f16(float f) {  // round to nearest even (the compiler's conversion)
  const _Float16 h = static_cast<_Float16>(f);
  uint16_t u;
  std::memcpy(&u, &h, 2);
  return u;
}

uint16_t to_bf16(float f) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}

size_t elem_size(DType dt) {
  switch (dt) {
    case DType::kFloat32:
    case DType::kInt32:
      return 4;
    case DType::kInt64:
      return 8;
    case DType::kFloat8E4M3FN:
    case DType::kFloat8E5M2:
    case DType::kUInt8:
      return 1;
    default:
      return 2;
  }
}

// A fast generator: uniform values in [lo, hi) (values only steer data-dependent branches).
struct Rng {
  uint64_t s;
  explicit Rng(uint64_t seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
  uint64_t next() {
    s ^= s << 13;
    s ^= s >> 7;
    s ^= s << 17;
    return s;
  }
  float uniform(float lo, float hi) {
    return lo + (hi - lo) * static_cast<float>(next() >> 40) * (1.0f / 16777216.0f);
  }
};

struct Tensor {
  Buffer buf;
  TensorView view;
  Tensor(DType dt, const std::vector<int64_t>& shape)
      : buf(static_cast<size_t>(std::accumulate(shape.begin(), shape.end(), int64_t{1},
                                                std::multiplies<int64_t>())) * elem_size(dt)) {
    view = TensorView::contiguous(buf.p.get(), dt, shape);
  }
  int64_t numel() const { return view.numel(); }
  void fill_uniform(Rng& r, float lo, float hi) {
    const int64_t n = numel();
    if (view.dtype == DType::kFloat32) {
      for (int64_t i = 0; i < n; ++i) buf.as<float>()[i] = r.uniform(lo, hi);
    } else if (view.dtype == DType::kFloat16) {
      for (int64_t i = 0; i < n; ++i) buf.as<uint16_t>()[i] = to_f16(r.uniform(lo, hi));
    } else {
      for (int64_t i = 0; i < n; ++i) buf.as<uint16_t>()[i] = to_bf16(r.uniform(lo, hi));
    }
  }
};

// ------------------------------------------------------------------------------------------
// models and cases
// ------------------------------------------------------------------------------------------
struct Model {
  const char* name;
  int64_t E, K, group_count, k_group, group_select_mode, norm_type, renorm;
  double rsf;
  bool bias;
  int64_t H, F;
  double clamp;
};
const Model kModels[] = {
    {"deepseek_v3", 256, 8, 8, 4, 1, 1, 0, 2.5, true, 7168, 2048, -1.0},
    {"gpt_oss", 32, 4, 1, 1, 0, 0, 1, 1.0, false, 2880, 2880, 7.0},
};

enum class Op {
  kGatingTopK,
  kGatingTopKBackward,
  kFinalizeRouting,
  kFinalizeRoutingGrad,
  kSwiglu,
  kSwigluGrad,
  kSwigluQuant,
  kInitRoutingGrad
};
const char* op_name(Op op) {
  switch (op) {
    case Op::kGatingTopK: return "moe_gating_top_k";
    case Op::kGatingTopKBackward: return "moe_gating_top_k_backward";
    case Op::kFinalizeRouting: return "moe_finalize_routing";
    case Op::kFinalizeRoutingGrad: return "moe_finalize_routing_grad";
    case Op::kSwiglu: return "swiglu_group";
    case Op::kSwigluGrad: return "swiglu_group_quant_backward";
    case Op::kSwigluQuant: return "swiglu_group_quant";
    case Op::kInitRoutingGrad: return "moe_init_routing_grad";
  }
  return "?";
}

// One buffer set: the tensors and the planned executor over them.
struct Set {
  std::vector<std::unique_ptr<Tensor>> tensors;
  moegrad::ExecutorPtr exec;
  std::vector<unsigned char> workspace;
  size_t bytes = 0;  // inputs read once + outputs written once

  Tensor* add(DType dt, const std::vector<int64_t>& shape) {
    tensors.push_back(std::make_unique<Tensor>(dt, shape));
    bytes += tensors.back()->buf.bytes;
    return tensors.back().get();
  }
};

void fill_perm(Tensor* t, Rng& r) {
  int32_t* p = t->buf.as<int32_t>();
  const int64_t n = t->numel();
  std::iota(p, p + n, 0);
  for (int64_t i = n - 1; i > 0; --i) std::swap(p[i], p[r.next() % static_cast<uint64_t>(i + 1)]);
}

// SwiGLU inputs of both SwiGLU benchmarks: x in the model's clamp range, weights in [0, 1), and
// a random split of the rows over the E groups.
void fill_swiglu_inputs(Tensor* x, Tensor* w, Tensor* gi, Rng& r, const Model& m) {
  x->fill_uniform(r, m.clamp > 0 ? -9.f : -4.f, m.clamp > 0 ? 9.f : 4.f);
  w->fill_uniform(r, 0.f, 1.f);
  int64_t* g = gi->buf.as<int64_t>();
  std::fill(g, g + gi->numel(), int64_t{0});
  for (int64_t i = 0; i < x->view.shape[0]; ++i) {
    ++g[r.next() % static_cast<uint64_t>(gi->numel())];
  }
}

std::unique_ptr<Set> make_set(Op op, const Model& m, DType dt, int64_t T, uint64_t seed) {
  auto s = std::make_unique<Set>();
  Rng r(seed);
  const int64_t E = m.E, K = m.K, H = m.H, F = m.F, Tk = T * K;
  switch (op) {
    case Op::kGatingTopK: {
      Tensor* x = s->add(dt, {T, E});
      Tensor* bias = m.bias ? s->add(dt, {E}) : nullptr;
      Tensor* y = s->add(dt, {T, K});
      Tensor* idx = s->add(DType::kInt32, {T, K});
      Tensor* norm = s->add(DType::kFloat32, {T, E});
      x->fill_uniform(r, -4.f, 4.f);
      if (bias) bias->fill_uniform(r, -0.1f, 0.1f);
      moegrad::GatingTopKAttrs a;
      a.k = K;
      a.k_group = m.k_group;
      a.group_count = m.group_count;
      a.group_select_mode = m.group_select_mode;
      a.renorm = m.renorm;
      a.norm_type = m.norm_type;
      a.out_flag = m.norm_type == 1;
      a.routed_scaling_factor = m.rsf;
      s->exec = moegrad::plan_moe_gating_top_k(&x->view, bias ? &bias->view : nullptr, a,
                                               &y->view, &idx->view, &norm->view);
      break;
    }
    case Op::kGatingTopKBackward: {
      Tensor* xn = s->add(DType::kFloat32, {T, E});
      Tensor* gy = s->add(dt, {T, K});
      Tensor* idx = s->add(DType::kInt32, {T, K});
      Tensor* gx = s->add(dt, {T, E});
      xn->fill_uniform(r, 0.01f, 0.99f);
      gy->fill_uniform(r, -1.f, 1.f);
      std::vector<int32_t> row(E);
      for (int64_t i = 0; i < T; ++i) {  // K distinct experts per row
        std::iota(row.begin(), row.end(), 0);
        for (int64_t j = 0; j < K; ++j) {
          std::swap(row[j], row[j + r.next() % static_cast<uint64_t>(E - j)]);
          idx->buf.as<int32_t>()[i * K + j] = row[j];
        }
      }
      moegrad::GatingTopKBackwardAttrs a;
      a.routed_scaling_factor = m.rsf;
      s->exec = moegrad::plan_moe_gating_top_k_backward(&xn->view, &gy->view, &idx->view, a,
                                                        &gx->view);
      break;
    }
    case Op::kFinalizeRouting: {
      Tensor* ex = s->add(dt, {Tk, H});
      Tensor* idx = s->add(DType::kInt32, {Tk});
      Tensor* x1 = s->add(dt, {T, H});
      Tensor* sc = s->add(dt, {T, K});
      Tensor* out = s->add(dt, {T, H});
      ex->fill_uniform(r, -2.f, 2.f);
      fill_perm(idx, r);
      x1->fill_uniform(r, -2.f, 2.f);
      sc->fill_uniform(r, 0.f, 1.f);
      moegrad::FinalizeRoutingAttrs a;  // drop_pad_mode 0 (column layout)
      s->exec = moegrad::plan_moe_finalize_routing(&ex->view, &idx->view, &x1->view, nullptr,
                                                   nullptr, &sc->view, nullptr, a, &out->view);
      break;
    }
    case Op::kFinalizeRoutingGrad: {
      Tensor* gy = s->add(dt, {T, H});
      Tensor* idx = s->add(DType::kInt32, {Tk});
      Tensor* ex = s->add(dt, {Tk, H});
      Tensor* sc = s->add(dt, {T, K});
      Tensor* gex = s->add(dt, {Tk, H});
      Tensor* gsc = s->add(dt, {T, K});
      gy->fill_uniform(r, -2.f, 2.f);
      fill_perm(idx, r);
      ex->fill_uniform(r, -2.f, 2.f);
      sc->fill_uniform(r, 0.f, 1.f);
      moegrad::FinalizeRoutingGradAttrs a;  // dropless, row layout
      s->exec = moegrad::plan_moe_finalize_routing_grad(&gy->view, &idx->view, &ex->view,
                                                        &sc->view, nullptr, nullptr, a,
                                                        &gex->view, &gsc->view);
      break;
    }
    case Op::kInitRoutingGrad: {
      Tensor* gex = s->add(dt, {Tk, H});
      Tensor* idx = s->add(DType::kInt32, {Tk});
      Tensor* gx = s->add(dt, {T, H});
      gex->fill_uniform(r, -2.f, 2.f);
      fill_perm(idx, r);  // src -> dst, dropless (row layout)
      moegrad::InitRoutingGradAttrs a;
      a.top_k = K;
      s->exec = moegrad::plan_moe_init_routing_grad(&gex->view, &idx->view, a, &gx->view);
      break;
    }
    case Op::kSwigluQuant: {
      // FP8 e4m3fn blocks of 128 with fp32 scales (quant_mode 0), as in the Python harness.
      Tensor* x = s->add(dt, {Tk, 2 * F});
      Tensor* w = s->add(DType::kFloat32, {Tk});
      Tensor* gi = s->add(DType::kInt64, {E});
      fill_swiglu_inputs(x, w, gi, r, m);
      Tensor* y = s->add(DType::kFloat8E4M3FN, {Tk, F});
      Tensor* ys = s->add(DType::kFloat32, {Tk, (F + 127) / 128});
      moegrad::SwigluQuantAttrs a;
      a.clamp_limit = m.clamp;
      s->exec = moegrad::plan_swiglu_group_quant(&x->view, &w->view, &gi->view, nullptr, a,
                                                 &y->view, &ys->view, nullptr);
      break;
    }
    case Op::kSwiglu:
    case Op::kSwigluGrad: {
      const bool grad = op == Op::kSwigluGrad;
      Tensor* gy = grad ? s->add(dt, {Tk, F}) : nullptr;
      Tensor* x = s->add(dt, {Tk, 2 * F});
      Tensor* w = s->add(DType::kFloat32, {Tk});
      Tensor* yo = grad ? s->add(dt, {Tk, F}) : nullptr;
      Tensor* gi = s->add(DType::kInt64, {E});
      fill_swiglu_inputs(x, w, gi, r, m);
      moegrad::SwigluAttrs a;
      a.clamp_limit = m.clamp;
      if (!grad) {
        Tensor* y = s->add(dt, {Tk, F});
        s->exec = moegrad::plan_swiglu_group(&x->view, &w->view, &gi->view, a, &y->view);
      } else {
        gy->fill_uniform(r, -1.f, 1.f);
        yo->fill_uniform(r, -1.f, 1.f);
        Tensor* gx = s->add(dt, {Tk, 2 * F});
        Tensor* gw = s->add(DType::kFloat32, {Tk});
        s->exec = moegrad::plan_swiglu_group_quant_grad(&gy->view, &x->view, &w->view,
                                                        &yo->view, &gi->view, a, &gx->view,
                                                        &gw->view);
      }
      break;
    }
  }
  s->workspace.resize(s->exec->workspace_size());
  return s;
}

void BM_Op(benchmark::State& state, Op op, const Model& m, DType dt) {
  const int64_t T = state.range(0);
  const int threads = static_cast<int>(state.range(1));
  moegrad::set_num_threads(threads);
  std::vector<std::unique_ptr<Set>> sets;
  sets.push_back(make_set(op, m, dt, T, 1));
  const size_t bytes = sets[0]->bytes;
  const int64_t llc = llc_bytes();
  size_t n_sets = static_cast<size_t>((4 * llc + static_cast<int64_t>(bytes) - 1) /
                                      std::max<int64_t>(static_cast<int64_t>(bytes), 1));
  n_sets = std::min<size_t>(std::max<size_t>(n_sets, bytes < size_t(8 * llc) ? 2 : 1), 1024);
  // MOEGRAD_BENCH_SETS=1: one buffer set, i.e. in cache where it fits (compute cost alone).
  if (const char* env = std::getenv("MOEGRAD_BENCH_SETS")) {
    n_sets = std::max<size_t>(1, std::strtoul(env, nullptr, 10));
  }
  for (size_t i = 1; i < n_sets; ++i) sets.push_back(make_set(op, m, dt, T, i + 1));
  for (auto& s : sets) s->exec->run(s->workspace.data(), s->workspace.size(), nullptr);  // warm-up
  size_t i = 0;
  for (auto _ : state) {
    Set& s = *sets[i++ % sets.size()];
    s.exec->run(s.workspace.empty() ? nullptr : s.workspace.data(), s.workspace.size(), nullptr);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * static_cast<int64_t>(bytes));
  state.counters["MB"] = static_cast<double>(bytes) / 1e6;
  state.counters["sets"] = static_cast<double>(sets.size());
  const double copy = copy_gbps(threads);
  state.counters["copy_GBps"] = copy;
  // roof = bytes / time / copy bandwidth, computed by the framework per iteration:
  // bytes/1e9/copy seconds of ideal time per iteration, as a rate it reads "roof" directly.
  state.counters["roof"] = benchmark::Counter(static_cast<double>(bytes) / 1e9 / copy,
                                              benchmark::Counter::kIsIterationInvariantRate);
  moegrad::set_num_threads(0);
}

// The ceiling of a read-mostly loop on this machine: K sequential fp32 input streams of
// 64 MB summed into one output with non-temporal stores (what the gather-sum kernels do at
// best: the init routing grad and finalize routing read K rows per token and stream one row
// out), bytes = (K + 1) x 64 MB, timed in alternation with a copy of 128 MB with ordinary
// stores (as Tensor.copy_, the Python harness's reference; 2 x size). "roof" = the median
// read-sum rate over the median copy rate of the same iterations: how far above the copy
// bandwidth such a loop can go when nothing but memory limits it (docs/decisions.md L142).
#if defined(__x86_64__) && defined(__GNUC__)
// Whole 64-byte lines per load and store where the CPU has AVX-512 (the kernels' width);
// returns the first element not done. o + lo must be 64-byte aligned for the stores.
__attribute__((target("avx512f"))) size_t read_sum_avx512(const float* const* in, size_t K,
                                                           float* o, size_t lo, size_t hi) {
  size_t i = lo;
  for (; i < hi && reinterpret_cast<uintptr_t>(o + i) % 64 != 0; ++i) {
    float acc = 0.0f;
    for (size_t k = 0; k < K; ++k) acc += in[k][i];
    o[i] = acc;
  }
  for (; i + 16 <= hi; i += 16) {
    __m512 acc = _mm512_setzero_ps();
    for (size_t k = 0; k < K; ++k) acc = _mm512_add_ps(acc, _mm512_loadu_ps(in[k] + i));
    _mm512_stream_ps(o + i, acc);
  }
  _mm_sfence();
  return i;
}
#endif

void BM_StreamReadSum(benchmark::State& state) {
  const size_t K = static_cast<size_t>(state.range(0));
  const int threads = std::max(1, static_cast<int>(state.range(1)));
  const size_t n = (size_t{64} << 20) / sizeof(float), cn = 2 * n;
  std::vector<std::vector<float>> in(K, std::vector<float>(n, 1.0f));
  std::vector<float> out(n + 16, 0.0f), src(cn, 1.0f), dst(cn + 16, 0.0f);
  float* o = out.data();
  while (reinterpret_cast<uintptr_t>(o) % 16 != 0) ++o;
  std::vector<const float*> ptrs;
  for (auto& v : in) ptrs.push_back(v.data());
  auto read_sum = [&](size_t lo, size_t hi) {
    size_t i = lo;
#if defined(__x86_64__) && defined(__GNUC__)
    if (__builtin_cpu_supports("avx512f")) i = read_sum_avx512(ptrs.data(), K, o, lo, hi);
#endif
#if defined(__SSE2__)
    for (; i + 4 <= hi; i += 4) {
      __m128 acc = _mm_setzero_ps();
      for (size_t k = 0; k < K; ++k) acc = _mm_add_ps(acc, _mm_loadu_ps(in[k].data() + i));
      _mm_stream_ps(o + i, acc);
    }
    _mm_sfence();
#endif
    for (; i < hi; ++i) {
      float acc = 0.0f;
      for (size_t k = 0; k < K; ++k) acc += in[k][i];
      o[i] = acc;
    }
  };
  auto copy = [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) dst[i] = src[i];
  };
  auto timed = [&](size_t len, auto&& body) {  // seconds of body over `threads` slices
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> pool;
    auto cut = [&](int t) { return len * static_cast<size_t>(t) / threads / 4 * 4; };
    for (int t = 1; t < threads; ++t) {
      pool.emplace_back([&, t] { body(cut(t), t + 1 == threads ? len : cut(t + 1)); });
    }
    body(0, threads > 1 ? cut(1) : len);
    for (auto& th : pool) th.join();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  timed(n, read_sum);
  timed(cn, copy);
  const double bytes = static_cast<double>((K + 1) * n * sizeof(float));
  std::vector<double> rs, cp;
  for (auto _ : state) {
    const double c = timed(cn, copy);
    const double t = timed(n, read_sum);
    state.SetIterationTime(t);
    cp.push_back(2.0 * static_cast<double>(cn * sizeof(float)) / c / 1e9);
    rs.push_back(bytes / t / 1e9);
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v.empty() ? 0.0 : v[v.size() / 2];
  };
  state.SetBytesProcessed(static_cast<int64_t>(static_cast<double>(state.iterations()) * bytes));
  state.counters["copy_GBps"] = median(cp);
  state.counters["roof"] = median(rs) / std::max(median(cp), 1e-9);
}

std::vector<int64_t> parse_tokens(int* argc, char** argv) {
  std::vector<int64_t> tokens = {16, 2048};
  int out = 1;
  for (int i = 1; i < *argc; ++i) {
    const char* prefix = "--tokens=";
    if (std::strncmp(argv[i], prefix, std::strlen(prefix)) == 0) {
      tokens.clear();
      std::string list = argv[i] + std::strlen(prefix);
      size_t pos = 0;
      while (pos < list.size()) {
        size_t comma = list.find(',', pos);
        if (comma == std::string::npos) comma = list.size();
        tokens.push_back(std::atoll(list.substr(pos, comma - pos).c_str()));
        pos = comma + 1;
      }
    } else {
      argv[out++] = argv[i];
    }
  }
  *argc = out;
  return tokens;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<int64_t> tokens = parse_tokens(&argc, argv);
  const Op ops[] = {Op::kGatingTopK, Op::kGatingTopKBackward, Op::kFinalizeRouting,
                    Op::kFinalizeRoutingGrad, Op::kSwiglu, Op::kSwigluGrad,
                    Op::kSwigluQuant, Op::kInitRoutingGrad};
  const std::pair<DType, const char*> dtypes[] = {
      {DType::kFloat32, "fp32"}, {DType::kBFloat16, "bf16"}, {DType::kFloat16, "fp16"}};
  for (Op op : ops) {
    for (const Model& m : kModels) {
      for (const auto& d : dtypes) {
        std::string name = std::string(op_name(op)) + "/" + m.name + "/" + d.second;
        auto* b = benchmark::RegisterBenchmark(name.c_str(), BM_Op, op, m, d.first);
        b->ArgNames({"T", "threads"})->UseRealTime()->Unit(benchmark::kMicrosecond);
        for (int64_t t : tokens) {
          for (int64_t th : {1, 2}) b->Args({t, th});
        }
      }
    }
  }
  benchmark::RegisterBenchmark("stream_read_sum", BM_StreamReadSum)
      ->ArgNames({"K", "threads"})
      ->Args({4, 2})
      ->Args({8, 2})
      ->UseManualTime()
      ->Unit(benchmark::kMillisecond);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  std::printf("LLC %lld MiB; copy bandwidth measured per thread count (memcpy, 2 x size)\n",
              static_cast<long long>(llc_bytes() >> 20));
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
