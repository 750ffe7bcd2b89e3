// moegrad._C: the nanobind module. Wraps the C++ API only; tensors arrive through DLPack (any
// framework), absent optionals are None. Errors become moegrad.MoeError (see __init__.py).
#include <algorithm>

#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <array>
#include <optional>
#include <string>
#include <vector>

#include "core/check.h"
#include "core/host.h"
#include "core/stream_probe.h"
#include "moegrad/moegrad.h"

namespace nb = nanobind;
using namespace moegrad;

namespace {

PyObject* g_error_class = nullptr;  // moegrad.MoeError, registered at import

// ---- tensor arguments (issue 12g): a cheaper DLPack import of torch CPU tensors ----
// nanobind imports a torch tensor through Tensor.__dlpack__, a Python method whose argument
// handling costs about 1.5-2.5 us per tensor, several microseconds of every call (4-8 tensors
// per op). For a torch.Tensor (the exact type: subclasses may override __dlpack__) that does
// not require grad, the capsule comes from torch's C function torch._C._to_dlpack instead
// (about 0.3 us), which makes the same capsule; the import is then kept only for CPU tensors.
// Anything else (other frameworks, subclasses, tensors requiring grad, CUDA tensors with
// __dlpack__'s device checks) takes nanobind's regular path with its regular errors.
struct Arr : nb::ndarray<> {
  Arr() = default;
  explicit Arr(nb::ndarray<> a) : nb::ndarray<>(std::move(a)) {}
};

struct TorchDlpack {
  PyTypeObject* tensor = nullptr;  // torch.Tensor, once torch is imported
  PyObject* to_dlpack = nullptr;   // torch._C._to_dlpack
  PyObject* requires_grad = nullptr;
  bool ready() {
    if (tensor) return true;
    PyObject* torch = PyImport_GetModule(nb::str("torch").ptr());  // no import of our own
    if (!torch) {
      PyErr_Clear();
      return false;
    }
    PyObject* t = PyObject_GetAttrString(torch, "Tensor");
    PyObject* c = PyObject_GetAttrString(torch, "_C");
    PyObject* f = c ? PyObject_GetAttrString(c, "_to_dlpack") : nullptr;
    Py_DECREF(torch);
    Py_XDECREF(c);
    if (!t || !f || !PyType_Check(t)) {
      PyErr_Clear();
      Py_XDECREF(t);
      Py_XDECREF(f);
      return false;
    }
    requires_grad = PyUnicode_InternFromString("requires_grad");
    to_dlpack = f;
    tensor = reinterpret_cast<PyTypeObject*>(t);  // both kept for the life of the process
    return true;
  }
};
TorchDlpack g_torch;

}  // namespace

namespace nanobind::detail {
template <>
struct type_caster<Arr> {
  NB_TYPE_CASTER(Arr, const_name("ndarray"))
  bool from_python(handle src, uint32_t flags, cleanup_list* cleanup) noexcept {
    make_caster<nb::ndarray<>> inner;
    if (Py_TYPE(src.ptr()) != nullptr && g_torch.ready() && Py_TYPE(src.ptr()) == g_torch.tensor) {
      PyObject* rg = PyObject_GetAttr(src.ptr(), g_torch.requires_grad);
      const bool plain = rg == Py_False;
      Py_XDECREF(rg);
      if (!rg) PyErr_Clear();
      if (plain) {
        PyObject* cap = PyObject_CallOneArg(g_torch.to_dlpack, src.ptr());
        if (cap) {
          const bool ok = inner.from_python(handle(cap), flags, cleanup);
          Py_DECREF(cap);
          if (ok && inner.value.device_type() == nb::device::cpu::value) {
            value = Arr(std::move(inner.value));
            return true;
          }
          inner.value = nb::ndarray<>();
        } else {
          PyErr_Clear();
        }
      }
    }
    if (!inner.from_python(src, flags, cleanup)) return false;
    value = Arr(std::move(inner.value));
    return true;
  }
  static handle from_cpp(const Arr&, rv_policy, cleanup_list*) noexcept { return handle(); }
};
}  // namespace nanobind::detail

namespace {
// ---- end of the tensor arguments block ----

using Opt = std::optional<Arr>;  // None: an absent (or null) tensor

DType dtype_from_dlpack(const nb::dlpack::dtype& t) {
  using C = nb::dlpack::dtype_code;
  const auto code = static_cast<C>(t.code);
  if (t.lanes != 1) return DType::kOther;
  if (code == C::Float && t.bits == 32) return DType::kFloat32;
  if (code == C::Float && t.bits == 16) return DType::kFloat16;
  if (code == C::Bfloat && t.bits == 16) return DType::kBFloat16;
  if (code == C::Int && t.bits == 32) return DType::kInt32;
  if (code == C::Int && t.bits == 64) return DType::kInt64;
  // Dtypes no operator takes keep their aclDataType code, so errors name them.
  if (code == C::Float && t.bits == 64) return static_cast<DType>(11);
  if (code == C::Int && t.bits == 8) return static_cast<DType>(2);
  if (code == C::UInt && t.bits == 8) return static_cast<DType>(4);
  if (code == C::Int && t.bits == 16) return static_cast<DType>(6);
  if (code == C::Bool) return static_cast<DType>(12);
  if (code == C::Complex && t.bits == 64) return static_cast<DType>(16);
  if (code == C::Complex && t.bits == 128) return static_cast<DType>(17);
  return DType::kOther;
}

// Turns the call's arrays (alive for the duration of the call) into views.
class Args {
 public:
  const TensorView* operator()(const Opt& h) {
    if (!h) return nullptr;
    const nb::ndarray<>& a = *h;
    TensorView v;
    v.data = a.data();
    v.dtype = dtype_from_dlpack(a.dtype());
    // A rank above kMaxDims keeps its value (the validator refuses it by the argument's name);
    // only the dims a view holds are copied.
    v.ndim = static_cast<int32_t>(std::min<size_t>(a.ndim(), 1u << 20));
    for (int i = 0; i < std::min(v.ndim, kMaxDims); ++i) {
      v.shape[i] = static_cast<int64_t>(a.shape(i));
      v.strides[i] = static_cast<int64_t>(a.stride(i));
    }
    // DLPack device codes equal Device's (cpu 1, cuda 2); any other is rejected in stage one.
    v.device = static_cast<Device>(a.device_type());
    v.device_id = a.device_id();
    if (n_ == views_.size()) throw Error(kErrParamInvalid, "tensor: too many tensor arguments");
    views_[n_] = v;
    return &views_[n_++];
  }

 private:
  std::array<TensorView, 16> views_;  // no allocation per call
  size_t n_ = 0;
};

// ---- CUDA backend: one-shot calls on CUDA tensors ----
// The torch front registers hook(device, workspace_bytes) -> (stream, workspace or None): torch's
// current stream of the device and a uint8 workspace from its caching allocator, kept alive until
// the launch is enqueued (the allocator reuses it in stream order).
PyObject* g_cuda_hook = nullptr;

void run(ExecutorPtr e) {
  if (e->device() == Device::kCUDA) {
    if (g_cuda_hook == nullptr) {
      throw Error(kErrParamInvalid, "moegrad: device: CUDA tensors need the torch front "
                                    "(import moegrad) to provide the stream");
    }
    const uint64_t bytes = e->workspace_size();
    const int dev = e->device_id();
    nb::tuple ctx = nb::cast<nb::tuple>(
        nb::handle(g_cuda_hook)(dev, static_cast<unsigned long long>(bytes)));
    void* stream = reinterpret_cast<void*>(nb::cast<uintptr_t>(ctx[0]));
    void* ws = ctx[1].is_none() ? nullptr : nb::cast<nb::ndarray<>>(ctx[1]).data();
    nb::gil_scoped_release release;
    e->run(ws, bytes, stream);
    return;
  }
  nb::gil_scoped_release release;
  run_now(*e);
}

using Shapes = std::vector<Shape>;

// The one-shot calls below (inputs and outputs in one call) follow the C API's rules, int32
// indices included; the plan_* / run pair is the Python front's path and takes int64 too.
void c_index_rule(const char* op, const Opt& t, const char* arg) {
  if (t) {
    Args a;
    require_index32(op, a(t), arg);
  }
}

// A plan made without outputs (stage one of the Python front). Holds views of the inputs: the
// caller keeps them alive until run().
struct Plan {
  ExecutorPtr exec;
};

// (plan, [(shape, dtype code), ...], workspace bytes): what Python needs to allocate.
nb::tuple planned(ExecutorPtr e) {
  const std::vector<OutputSpec>& outs = e->outputs();
  nb::list specs;
  for (const OutputSpec& o : outs) {
    nb::list shape;
    for (int64_t d : o.shape) shape.append(d);
    specs.append(nb::make_tuple(shape, static_cast<int>(o.dtype)));
  }
  const uint64_t ws = e->workspace_size();
  return nb::make_tuple(Plan{std::move(e)}, specs, ws);
}

// Stage two: binds the outputs and runs without the GIL (so Python threads run concurrently).
void run_plan(Plan& plan, const std::vector<Opt>& outs, const Opt& workspace, uintptr_t stream) {
  Args a;
  std::array<const TensorView*, 8> views{};
  if (outs.size() > views.size()) {
    throw Error(kErrParamInvalid, cat("run: outputs: at most 8; got ", outs.size()));
  }
  for (size_t i = 0; i < outs.size(); ++i) views[i] = a(outs[i]);
  if (!plan.exec) throw Error(kErrParamInvalid, "run: plan: already consumed; got a used plan");
  const TensorView* ws = a(workspace);
  if (ws && (ws->device != plan.exec->device() ||
             (ws->device == Device::kCUDA && ws->device_id != plan.exec->device_id()))) {
    throw Error(kErrParamInvalid, "run: workspace: must be on the device of the call's tensors");
  }
  void* ws_data = ws ? ws->data : nullptr;
  const uint64_t ws_bytes = workspace ? static_cast<uint64_t>(workspace->nbytes()) : 0;
  ExecutorPtr e = std::move(plan.exec);  // one run per plan
  nb::gil_scoped_release release;
  e->run(views.data(), outs.size(), ws_data, ws_bytes, reinterpret_cast<void*>(stream));
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "moegrad native module: plans (validation, shapes, backend, workspace) and runs.";

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      if (g_error_class == nullptr) {
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return;
      }
      PyObject* args = Py_BuildValue("(si)", e.what(), static_cast<int>(e.code()));
      PyErr_SetObject(g_error_class, args);
      Py_XDECREF(args);
    }
  });

  m.def("_set_error_class", [](nb::object cls) {
    Py_XINCREF(cls.ptr());
    g_error_class = cls.ptr();
  });
  m.def("_set_cuda_hook", [](nb::object hook) {
    Py_XINCREF(hook.ptr());
    g_cuda_hook = hook.ptr();
  });
#ifdef MOEGRAD_WITH_CUDA
  m.attr("cuda_built") = true;
#else
  m.attr("cuda_built") = false;
#endif
  // The C/C++ functions read n <= 0 as "the OpenMP default"; Python refuses a negative count,
  // which is a mistake rather than a request (docs/decisions.md L173).
  m.def("set_num_threads", [](int n) {
    if (n < 0) {
      throw Error(kErrParamInvalid,
                  cat("set_num_threads: n: must be >= 0 (0: the OpenMP default); got ", n));
    }
    set_num_threads(n);
  }, nb::arg("n"));
  m.def("get_num_threads", &get_num_threads);
  m.def("_validation_count", &validation_count);
  // Huge-page advice for a large host tensor moegrad allocates outside a plan (the expert GEMM
  // outputs of moegrad.nn); addresses come from torch's data_ptr.
  m.def("_advise_huge_pages", [](uintptr_t data, uint64_t bytes) {
    advise_huge_pages(reinterpret_cast<void*>(data), bytes);
  }, nb::arg("data"), nb::arg("bytes"));
  // The operators' advice policy (core/host.h): the smallest output advised for a
  // MOEGRAD_HUGE_PAGES value (None: unset), with or without free page reporting; -1 for never.
  m.def("_huge_page_min_bytes", [](std::optional<std::string> setting, bool reporting) {
    const uint64_t b = huge_page_min_bytes(setting ? setting->c_str() : nullptr, reporting);
    return b == ~uint64_t{0} ? int64_t{-1} : static_cast<int64_t>(b);
  }, nb::arg("setting").none(), nb::arg("reporting"));
  m.def("_free_page_reporting", [](std::optional<std::string> features_glob) {
    return free_page_reporting(features_glob ? features_glob->c_str() : nullptr);
  }, nb::arg("features_glob").none() = nb::none());
  // The benchmark's streaming roof (core/stream_probe.h): fp32 buffers given by address and
  // element count (torch data_ptr / numel), on moegrad's thread count.
  m.def("_stream_read", [](uintptr_t data, int64_t n) {
    nb::gil_scoped_release release;
    return stream_read(reinterpret_cast<const float*>(data), n);
  }, nb::arg("data"), nb::arg("n"));
  m.def("_stream_write", [](uintptr_t data, int64_t n, float value) {
    nb::gil_scoped_release release;
    stream_write(reinterpret_cast<float*>(data), n, value);
  }, nb::arg("data"), nb::arg("n"), nb::arg("value"));
  m.def("_stream_copy", [](uintptr_t src, uintptr_t dst, int64_t n) {
    nb::gil_scoped_release release;
    stream_copy(reinterpret_cast<const float*>(src), reinterpret_cast<float*>(dst), n);
  }, nb::arg("src"), nb::arg("dst"), nb::arg("n"));
  m.def("_dependent_adds", [](int64_t n) {
    nb::gil_scoped_release release;
    return dependent_adds(n);
  }, nb::arg("n"));

  // ---- the two stages of the Python front: plan_<op>(inputs, attrs) -> (plan, outputs,
  // workspace bytes); run(plan, outputs, workspace, stream) ----
  nb::class_<Plan>(m, "Plan");
  m.def("run", &run_plan, nb::arg("plan"), nb::arg("outputs"), nb::arg("workspace").none(),
        nb::arg("stream"));
  m.def("plan_moe_gating_top_k",
        [](const Opt& x, const Opt& bias, int64_t k, int64_t k_group, int64_t group_count,
           int64_t group_select_mode, int64_t renorm, int64_t norm_type, bool out_flag,
           double rsf, double eps, bool no_renorm) {
          Args a;
          GatingTopKAttrs at{k, k_group, group_count, group_select_mode, renorm, norm_type,
                             out_flag, rsf, eps, no_renorm};
          return planned(prepare_moe_gating_top_k(a(x), a(bias), at));
        },
        nb::arg("x").none(), nb::arg("bias").none(), nb::arg("k"), nb::arg("k_group"),
        nb::arg("group_count"), nb::arg("group_select_mode"), nb::arg("renorm"),
        nb::arg("norm_type"), nb::arg("out_flag"), nb::arg("rsf"), nb::arg("eps"),
        nb::arg("no_renorm") = false);
  m.def("plan_moe_gating_top_k_backward",
        [](const Opt& x_norm, const Opt& grad_y, const Opt& expert_idx, int64_t renorm,
           int64_t norm_type, double rsf, double eps, bool no_renorm) {
          Args a;
          GatingTopKBackwardAttrs at{renorm, norm_type, rsf, eps, no_renorm};
          return planned(
              prepare_moe_gating_top_k_backward(a(x_norm), a(grad_y), a(expert_idx), at));
        },
        nb::arg("x_norm").none(), nb::arg("grad_y").none(), nb::arg("expert_idx").none(),
        nb::arg("renorm"), nb::arg("norm_type"), nb::arg("rsf"), nb::arg("eps"),
        nb::arg("no_renorm") = false);
  m.def("plan_moe_gating_replay",
        [](const Opt& x, const Opt& expert_idx, const Opt& bias, int64_t renorm,
           int64_t norm_type, double rsf, double eps, bool no_renorm) {
          Args a;
          GatingReplayAttrs at{renorm, norm_type, rsf, eps, no_renorm};
          return planned(prepare_moe_gating_replay(a(x), a(expert_idx), a(bias), at));
        });
  m.def("plan_moe_finalize_routing",
        [](const Opt& ex, const Opt& idx, const Opt& x1, const Opt& x2, const Opt& bias,
           const Opt& scales, const Opt& eidx, int64_t mode, int64_t k, bool padded) {
          Args a;
          return planned(prepare_moe_finalize_routing(a(ex), a(idx), a(x1), a(x2), a(bias),
                                                      a(scales), a(eidx),
                                                      FinalizeRoutingAttrs{mode, padded}, k));
        },
        nb::arg("ex").none(), nb::arg("idx").none(), nb::arg("x1").none(), nb::arg("x2").none(),
        nb::arg("bias").none(), nb::arg("scales").none(), nb::arg("eidx").none(),
        nb::arg("mode"), nb::arg("k"), nb::arg("padded") = false);
  m.def("plan_moe_finalize_routing_grad",
        [](const Opt& gy, const Opt& idx, const Opt& ex, const Opt& scales, const Opt& eidx,
           const Opt& bias, int64_t mode, int64_t active_num, int64_t expert_num,
           int64_t expert_capacity, int64_t padded_rows) {
          Args a;
          FinalizeRoutingGradAttrs at{mode, active_num, expert_num, expert_capacity,
                                      padded_rows};
          return planned(prepare_moe_finalize_routing_grad(a(gy), a(idx), a(ex), a(scales),
                                                           a(eidx), a(bias), at));
        },
        nb::arg("gy").none(), nb::arg("idx").none(), nb::arg("ex").none(),
        nb::arg("scales").none(), nb::arg("eidx").none(), nb::arg("bias").none(),
        nb::arg("mode"), nb::arg("active_num"), nb::arg("expert_num"),
        nb::arg("expert_capacity"), nb::arg("padded_rows") = 0);
  m.def("plan_moe_finalize_routing_bias_grad",
        [](const Opt& gy, const Opt& eidx, const Opt& scales, int64_t expert_num) {
          Args a;
          return planned(prepare_moe_finalize_routing_bias_grad(
              a(gy), a(eidx), a(scales), FinalizeRoutingBiasGradAttrs{expert_num}));
        });
  m.def("plan_swiglu_group",
        [](const Opt& x, const Opt& weight, const Opt& group_index, double clamp_limit) {
          Args a;
          return planned(
              prepare_swiglu_group(a(x), a(weight), a(group_index), SwigluAttrs{clamp_limit}));
        });
  m.def("plan_swiglu_group_quant_backward",
        [](const Opt& gy, const Opt& x, const Opt& weight, const Opt& y_origin,
           const Opt& group_index, double clamp_limit) {
          Args a;
          return planned(prepare_swiglu_group_quant_grad(a(gy), a(x), a(weight), a(y_origin),
                                                         a(group_index),
                                                         SwigluAttrs{clamp_limit}));
        });
  m.def("plan_clipped_swiglu",
        [](const Opt& x, const Opt& group_index, int64_t dim, double alpha, double limit,
           double bias, bool interleaved, int64_t clamp_mode) {
          Args a;
          const ClippedSwigluAttrs at{dim, alpha, limit, bias, interleaved, clamp_mode};
          return planned(prepare_clipped_swiglu(a(x), a(group_index), at));
        });
  m.def("plan_clipped_swiglu_grad",
        [](const Opt& gy, const Opt& x, const Opt& group_index, int64_t dim, double alpha,
           double limit, double bias, bool interleaved, int64_t clamp_mode) {
          Args a;
          const ClippedSwigluAttrs at{dim, alpha, limit, bias, interleaved, clamp_mode};
          return planned(prepare_clipped_swiglu_grad(a(gy), a(x), a(group_index), at));
        });

  // ---- one-shot calls with outputs (tests, kernel benchmarks); C API rules ----

  // ---- gating top-k ----
  m.def("moe_gating_top_k",
        [](const Opt& x, const Opt& bias, int64_t k, int64_t k_group, int64_t group_count,
           int64_t group_select_mode, int64_t renorm, int64_t norm_type, bool out_flag,
           double rsf, double eps, const Opt& y, const Opt& expert_idx, const Opt& norm_out,
           bool no_renorm) {
          Args a;
          GatingTopKAttrs at{k, k_group, group_count, group_select_mode, renorm, norm_type,
                             out_flag, rsf, eps, no_renorm};
          run(plan_moe_gating_top_k(a(x), a(bias), at, a(y), a(expert_idx), a(norm_out)));
        },
        nb::arg("x").none(), nb::arg("bias").none(), nb::arg("k"), nb::arg("k_group"),
        nb::arg("group_count"), nb::arg("group_select_mode"), nb::arg("renorm"),
        nb::arg("norm_type"), nb::arg("out_flag"), nb::arg("rsf"), nb::arg("eps"),
        nb::arg("y").none(), nb::arg("expert_idx").none(), nb::arg("norm_out").none(),
        nb::arg("no_renorm") = false);
  m.def("infer_moe_gating_top_k",
        [](const Opt& x, const Opt& bias, int64_t k, int64_t k_group, int64_t group_count,
           int64_t group_select_mode, int64_t renorm, int64_t norm_type, bool out_flag,
           double rsf, double eps) -> Shapes {
          Args a;
          GatingTopKAttrs at{k, k_group, group_count, group_select_mode, renorm, norm_type,
                             out_flag, rsf, eps};
          return infer_moe_gating_top_k(a(x), a(bias), at);
        });
  m.def("moe_gating_top_k_backward",
        [](const Opt& x_norm, const Opt& grad_y, const Opt& expert_idx, int64_t renorm,
           int64_t norm_type, double rsf, double eps, const Opt& grad_x, bool no_renorm) {
          Args a;
          GatingTopKBackwardAttrs at{renorm, norm_type, rsf, eps, no_renorm};
          c_index_rule("moe_gating_top_k_backward", expert_idx, "expert_idx");
          run(plan_moe_gating_top_k_backward(a(x_norm), a(grad_y), a(expert_idx), at,
                                             a(grad_x)));
        },
        nb::arg("x_norm").none(), nb::arg("grad_y").none(), nb::arg("expert_idx").none(),
        nb::arg("renorm"), nb::arg("norm_type"), nb::arg("rsf"), nb::arg("eps"),
        nb::arg("grad_x").none(), nb::arg("no_renorm") = false);
  m.def("moe_gating_replay",
        [](const Opt& x, const Opt& expert_idx, const Opt& bias, int64_t renorm,
           int64_t norm_type, double rsf, double eps, bool no_renorm, const Opt& y,
           const Opt& norm_out) {
          Args a;
          GatingReplayAttrs at{renorm, norm_type, rsf, eps, no_renorm};
          c_index_rule("moe_gating_replay", expert_idx, "expert_idx");
          run(plan_moe_gating_replay(a(x), a(expert_idx), a(bias), at, a(y), a(norm_out)));
        });
  m.def("infer_moe_gating_replay",
        [](const Opt& x, const Opt& expert_idx, const Opt& bias, int64_t renorm,
           int64_t norm_type, double rsf, double eps, bool no_renorm) -> Shapes {
          Args a;
          GatingReplayAttrs at{renorm, norm_type, rsf, eps, no_renorm};
          return infer_moe_gating_replay(a(x), a(expert_idx), a(bias), at);
        });
  m.def("infer_moe_gating_top_k_backward",
        [](const Opt& x_norm, const Opt& grad_y, const Opt& expert_idx, int64_t renorm,
           int64_t norm_type, double rsf, double eps) -> Shapes {
          Args a;
          GatingTopKBackwardAttrs at{renorm, norm_type, rsf, eps};
          return infer_moe_gating_top_k_backward(a(x_norm), a(grad_y), a(expert_idx), at);
        });

  // ---- finalize routing ----
  m.def("moe_finalize_routing",
        [](const Opt& ex, const Opt& idx, const Opt& x1, const Opt& x2, const Opt& bias,
           const Opt& scales, const Opt& eidx, int64_t mode, const Opt& out) {
          Args a;
          c_index_rule("moe_finalize_routing", idx, "expanded_row_idx");
          c_index_rule("moe_finalize_routing", eidx, "expert_idx");
          run(plan_moe_finalize_routing(a(ex), a(idx), a(x1), a(x2), a(bias), a(scales),
                                        a(eidx), FinalizeRoutingAttrs{mode}, a(out)));
        });
  m.def("infer_moe_finalize_routing",
        [](const Opt& ex, const Opt& idx, const Opt& x1, const Opt& x2, const Opt& bias,
           const Opt& scales, const Opt& eidx, int64_t mode, int64_t k) -> Shapes {
          Args a;
          return infer_moe_finalize_routing(a(ex), a(idx), a(x1), a(x2), a(bias), a(scales),
                                            a(eidx), FinalizeRoutingAttrs{mode}, k);
        });
  m.def("moe_finalize_routing_grad",
        [](const Opt& gy, const Opt& idx, const Opt& ex, const Opt& scales, const Opt& eidx,
           const Opt& bias, int64_t mode, int64_t active_num, int64_t expert_num,
           int64_t expert_capacity, const Opt& gex, const Opt& gs) {
          Args a;
          FinalizeRoutingGradAttrs at{mode, active_num, expert_num, expert_capacity};
          c_index_rule("moe_finalize_routing_grad", idx, "expanded_row_idx");
          if (scales && bias) c_index_rule("moe_finalize_routing_grad", eidx, "expert_idx");
          run(plan_moe_finalize_routing_grad(a(gy), a(idx), a(ex), a(scales), a(eidx), a(bias),
                                             at, a(gex), a(gs)));
        });
  m.def("infer_moe_finalize_routing_grad",
        [](const Opt& gy, const Opt& idx, const Opt& ex, const Opt& scales, const Opt& eidx,
           const Opt& bias, int64_t mode, int64_t active_num, int64_t expert_num,
           int64_t expert_capacity) -> Shapes {
          Args a;
          FinalizeRoutingGradAttrs at{mode, active_num, expert_num, expert_capacity};
          return infer_moe_finalize_routing_grad(a(gy), a(idx), a(ex), a(scales), a(eidx),
                                                 a(bias), at);
        });

  // ---- finalize routing bias gradient (moegrad extension, D23) ----
  m.def("moe_finalize_routing_bias_grad",
        [](const Opt& gy, const Opt& eidx, const Opt& scales, int64_t expert_num,
           const Opt& gb) {
          Args a;
          c_index_rule("moe_finalize_routing_bias_grad", eidx, "expert_idx");
          run(plan_moe_finalize_routing_bias_grad(a(gy), a(eidx), a(scales),
                                                  FinalizeRoutingBiasGradAttrs{expert_num},
                                                  a(gb)));
        });
  m.def("infer_moe_finalize_routing_bias_grad",
        [](const Opt& gy, const Opt& eidx, const Opt& scales, int64_t expert_num) -> Shapes {
          Args a;
          return infer_moe_finalize_routing_bias_grad(a(gy), a(eidx), a(scales),
                                                      FinalizeRoutingBiasGradAttrs{expert_num});
        });

  // ---- SwiGLU ----
  m.def("swiglu_group",
        [](const Opt& x, const Opt& weight, const Opt& group_index, double clamp_limit,
           const Opt& y) {
          Args a;
          run(plan_swiglu_group(a(x), a(weight), a(group_index), SwigluAttrs{clamp_limit},
                                a(y)));
        });
  m.def("infer_swiglu_group",
        [](const Opt& x, const Opt& weight, const Opt& group_index,
           double clamp_limit) -> Shapes {
          Args a;
          return infer_swiglu_group(a(x), a(weight), a(group_index), SwigluAttrs{clamp_limit});
        });
  m.def("swiglu_group_quant_backward",
        [](const Opt& gy, const Opt& x, const Opt& weight, const Opt& y_origin,
           const Opt& group_index, double clamp_limit, const Opt& gx, const Opt& gw) {
          Args a;
          run(plan_swiglu_group_quant_grad(a(gy), a(x), a(weight), a(y_origin), a(group_index),
                                           SwigluAttrs{clamp_limit}, a(gx), a(gw)));
        });
  m.def("infer_swiglu_group_quant_backward",
        [](const Opt& gy, const Opt& x, const Opt& weight, const Opt& y_origin,
           const Opt& group_index, double clamp_limit) -> Shapes {
          Args a;
          return infer_swiglu_group_quant_grad(a(gy), a(x), a(weight), a(y_origin),
                                               a(group_index), SwigluAttrs{clamp_limit});
        });

  // ---- ClippedSwiglu (docs/operators.md §9) ----
  m.def("clipped_swiglu",
        [](const Opt& x, const Opt& group_index, int64_t dim, double alpha, double limit,
           double bias, bool interleaved, int64_t clamp_mode, const Opt& y) {
          Args a;
          const ClippedSwigluAttrs at{dim, alpha, limit, bias, interleaved, clamp_mode};
          run(plan_clipped_swiglu(a(x), a(group_index), at, a(y)));
        });
  m.def("clipped_swiglu_grad",
        [](const Opt& gy, const Opt& x, const Opt& group_index, int64_t dim, double alpha,
           double limit, double bias, bool interleaved, int64_t clamp_mode, const Opt& gx) {
          Args a;
          const ClippedSwigluAttrs at{dim, alpha, limit, bias, interleaved, clamp_mode};
          run(plan_clipped_swiglu_grad(a(gy), a(x), a(group_index), at, a(gx)));
        });

  // ---- SwiGLU quantised forward (D24); FP8 / e8m0 outputs are bound as uint8 views ----
  // One call with preallocated outputs (the benchmark's kernel timing).
  m.def("swiglu_group_quant",
        [](const Opt& x, const Opt& weight, const Opt& group_index, const Opt& scale,
           int64_t dst_type, int64_t quant_mode, int64_t block_size, bool round_scale,
           double clamp_limit, double dst_type_max, bool output_origin, const Opt& y,
           const Opt& y_scale, const Opt& y_origin) {
          Args a;
          SwigluQuantAttrs at{dst_type,    quant_mode,   block_size,   round_scale,
                              clamp_limit, dst_type_max, output_origin};
          run(plan_swiglu_group_quant(a(x), a(weight), a(group_index), a(scale), at, a(y),
                                      a(y_scale), a(y_origin)));
        });
  m.def("plan_swiglu_group_quant",
        [](const Opt& x, const Opt& weight, const Opt& group_index, const Opt& scale,
           int64_t dst_type, int64_t quant_mode, int64_t block_size, bool round_scale,
           double clamp_limit, double dst_type_max, bool output_origin) {
          Args a;
          // dst_type as the Python caller gave it (vendor or torch codes): the validator
          // translates it and reports it unchanged (L153).
          SwigluQuantAttrs at{dst_type,    quant_mode,   block_size,    round_scale,
                              clamp_limit, dst_type_max, output_origin, true};
          return planned(prepare_swiglu_group_quant(a(x), a(weight), a(group_index), a(scale), at));
        });

  // ---- init routing (token permutation) ----
  m.def("moe_init_routing",
        [](const Opt& x, const Opt& eidx, int64_t active_num, int64_t expert_capacity,
           int64_t expert_num, int64_t drop_pad_mode, int64_t tokens_type, bool tokens_flag,
           bool has_range, int64_t start, int64_t end, int64_t row_idx_type, const Opt& ex,
           const Opt& idx, const Opt& tokens) {
          Args a;
          InitRoutingAttrs at{active_num, expert_capacity, expert_num, drop_pad_mode,
                              tokens_type, tokens_flag, has_range, start, end, row_idx_type};
          run(plan_moe_init_routing(a(x), a(eidx), at, a(ex), a(idx), a(tokens)));
        });
  m.def("infer_moe_init_routing",
        [](const Opt& x, const Opt& eidx, int64_t active_num, int64_t expert_capacity,
           int64_t expert_num, int64_t drop_pad_mode, int64_t tokens_type, bool tokens_flag,
           bool has_range, int64_t start, int64_t end, int64_t row_idx_type) -> Shapes {
          Args a;
          InitRoutingAttrs at{active_num, expert_capacity, expert_num, drop_pad_mode,
                              tokens_type, tokens_flag, has_range, start, end, row_idx_type};
          Shapes shapes = infer_moe_init_routing(a(x), a(eidx), at);
          shapes.resize(3);  // padded_offsets: only with align_block (plan_moe_init_routing)
          return shapes;
        });
  m.def("moe_init_routing_grad",
        [](const Opt& gex, const Opt& idx, int64_t top_k, int64_t drop_pad_mode,
           int64_t active_num, const Opt& gx) {
          Args a;
          InitRoutingGradAttrs at{top_k, drop_pad_mode, active_num};
          run(plan_moe_init_routing_grad(a(gex), a(idx), at, a(gx)));
        });
  m.def("plan_moe_init_routing",
        [](const Opt& x, const Opt& eidx, int64_t active_num, int64_t expert_capacity,
           int64_t expert_num, int64_t drop_pad_mode, int64_t tokens_type, bool tokens_flag,
           bool has_range, int64_t start, int64_t end, int64_t row_idx_type,
           int64_t align_block) {
          Args a;
          InitRoutingAttrs at{active_num, expert_capacity, expert_num, drop_pad_mode,
                              tokens_type, tokens_flag, has_range, start, end, row_idx_type,
                              align_block};
          return planned(prepare_moe_init_routing(a(x), a(eidx), at));
        },
        nb::arg("x").none(), nb::arg("eidx").none(), nb::arg("active_num"),
        nb::arg("expert_capacity"), nb::arg("expert_num"), nb::arg("drop_pad_mode"),
        nb::arg("tokens_type"), nb::arg("tokens_flag"), nb::arg("has_range"), nb::arg("start"),
        nb::arg("end"), nb::arg("row_idx_type"), nb::arg("align_block") = 0);
  m.def("plan_moe_init_routing_grad",
        [](const Opt& gex, const Opt& idx, int64_t top_k, int64_t drop_pad_mode,
           int64_t active_num, int64_t padded_rows) {
          Args a;
          InitRoutingGradAttrs at{top_k, drop_pad_mode, active_num, padded_rows};
          return planned(prepare_moe_init_routing_grad(a(gex), a(idx), at));
        },
        nb::arg("gex").none(), nb::arg("idx").none(), nb::arg("top_k"),
        nb::arg("drop_pad_mode"), nb::arg("active_num"), nb::arg("padded_rows") = 0);
  m.def("infer_moe_init_routing_grad",
        [](const Opt& gex, const Opt& idx, int64_t top_k, int64_t drop_pad_mode,
           int64_t active_num) -> Shapes {
          Args a;
          InitRoutingGradAttrs at{top_k, drop_pad_mode, active_num};
          return infer_moe_init_routing_grad(a(gex), a(idx), at);
        });
}
