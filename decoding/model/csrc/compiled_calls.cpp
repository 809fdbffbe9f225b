// C entry points through which an AOTInductor package calls the kernels directly (its
// ``aot_inductor.custom_ops_to_c_shims``), instead of through its proxy executor, which boxes every call's arguments
// into a stack and dispatches by the op's schema (~150 calls a decode step of SmolLM2-135M). compiled_forward.py
// declares these signatures; the shim's name is AOTInductor's: aoti_torch_<device>_<op name>.
#include <ATen/core/Tensor.h>
#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/utils.h>

#include <optional>

at::Tensor paged_attention(at::Tensor k_cache, at::Tensor v_cache, at::Tensor q, at::Tensor k, at::Tensor v,
                           at::Tensor slots, at::Tensor block_tables, at::Tensor row_starts, at::Tensor prefix_len,
                           at::Tensor tree_mask, double scale);
at::Tensor packed_linear(at::Tensor x, at::Tensor weight, std::optional<at::Tensor> bias);
at::Tensor block_linear(at::Tensor x, at::Tensor q, at::Tensor d, std::optional<at::Tensor> m, int64_t bits);

namespace {

using torch::aot_inductor::new_tensor_handle;
using torch::aot_inductor::pointer_to_optional;
using torch::aot_inductor::tensor_handle_to_tensor_pointer;

inline const at::Tensor& tensor(AtenTensorHandle handle) { return *tensor_handle_to_tensor_pointer(handle); }

}  // namespace

extern "C" {

AOTITorchError aoti_torch_cpu_paged_attention(AtenTensorHandle k_cache, AtenTensorHandle v_cache, AtenTensorHandle q,
                                              AtenTensorHandle k, AtenTensorHandle v, AtenTensorHandle slots,
                                              AtenTensorHandle block_tables, AtenTensorHandle row_starts,
                                              AtenTensorHandle prefix_len, AtenTensorHandle tree_mask, double scale,
                                              AtenTensorHandle* out) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *out = new_tensor_handle(paged_attention(tensor(k_cache), tensor(v_cache), tensor(q), tensor(k), tensor(v),
                                             tensor(slots), tensor(block_tables), tensor(row_starts),
                                             tensor(prefix_len), tensor(tree_mask), scale));
  });
}

AOTITorchError aoti_torch_cpu_packed_linear(AtenTensorHandle x, AtenTensorHandle weight, AtenTensorHandle* bias,
                                            AtenTensorHandle* out) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *out = new_tensor_handle(packed_linear(tensor(x), tensor(weight), pointer_to_optional<at::Tensor>(bias)));
  });
}

AOTITorchError aoti_torch_cpu_block_linear(AtenTensorHandle x, AtenTensorHandle q, AtenTensorHandle d,
                                           AtenTensorHandle* m, int64_t bits, AtenTensorHandle* out) {
  AOTI_TORCH_CONVERT_EXCEPTION_TO_ERROR_CODE({
    *out = new_tensor_handle(block_linear(tensor(x), tensor(q), tensor(d), pointer_to_optional<at::Tensor>(m), bits));
  });
}

}  // extern "C"
