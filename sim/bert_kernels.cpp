#include "sim/bert_kernels.h"

#include <algorithm>

namespace pf::sim {
namespace {

// Dropout forward writes its output and a one-byte mask; backward reads both.
double dropout_bytes(double elements, double e) {
  return elements * (2.0 * e + 1.0);
}

// Per-element arithmetic of the element-wise kernels (approximate counts of what each evaluates
// per element; priced only by devices with the memory class's per-element terms, DeviceSpec):
// sums and scales 1 FLOP; LayerNorm forward 8 (mean, variance, normalize, affine), its input
// gradient 10, its parameter gradients 3; softmax 4 and an exp, its backward 4; GELU 4 and an
// erf, its backward 8 with an erf and an exp; tanh 2 and a tanh; dropout 2 and a random number
// forward, 2 backward (the mask is read); cross-entropy 4 and an exp per logit, its gradient 3.
ElementWork sums(double elements) {
  return per_element(elements, {.flops = 1});
}
ElementWork layer_norm(double elements) {
  return per_element(elements, {.flops = 8});
}
ElementWork dropout_forward(double elements) {
  return per_element(elements, {.flops = 2, .random_numbers = 1});
}
ElementWork dropout_backward(double elements) {
  return per_element(elements, {.flops = 2});
}

// y = x W^T + b over `rows` tokens: the bias broadcast into y, then the product accumulating
// onto it (PyTorch's addmm).
void linear_forward(Kernels& out, Precision p, double e, double rows, double in, double out_dim) {
  out.push_back(memory_kernel(e * rows * out_dim));
  Kernel product = gemm_kernel(p, rows, out_dim, in, e);
  product.bytes += e * rows * out_dim;  // reads the bias-filled output (beta = 1)
  out.push_back(product);
}

// Backward of a Linear: dx = dy W (when the input needs it), dW = dy^T x, db = column sums.
void linear_backward(PieceKernels& k, Precision p, double e, double rows, double in, double out_dim,
                     bool input_gradient) {
  if (input_gradient) k.backward_input.push_back(gemm_kernel(p, rows, in, out_dim, e));
  k.backward_weight.push_back(gemm_kernel(p, out_dim, in, rows, e));
  k.backward_weight.push_back(elementwise_kernel(e * rows * out_dim, sums(rows * out_dim)));
}

}  // namespace

PieceKernels encoder_layer_kernels(const Workload& w, const LayerKernelOptions& options) {
  const auto& c = w.config;
  const double T = w.tokens(), H = c.hidden_size, I = c.intermediate_size, a = c.num_heads;
  const double b = w.micro_batch_size, S = w.seq_len, e = w.storage_bytes();
  const double N = b * a * S * S;  // attention scores
  const Precision p = w.precision;
  PieceKernels k;
  auto& f = k.forward;
  auto attention = [&](double flops, double bytes) {
    Kernel kernel;
    kernel.op_class = OpClass::kAttention;
    kernel.precision = p;
    kernel.flops = flops;
    kernel.bytes = bytes;
    kernel.size = std::min(S, H / a);            // per-head products: S x S x head width
    kernel.mean_size = 3.0 / (2.0 / S + a / H);  // their harmonic mean (both products alike)
    return kernel;
  };
  // Self-attention: Q, K, V, then the attention core. Batched: heads split (copies of Q and of
  // K transposed); scores Q K^T; scale; mask; softmax; dropout; V split; probabilities x V;
  // heads merged. Fused: one kernel reading Q, K and V in place and writing the merged heads.
  const bool fused = w.attention == AttentionAlgorithm::kFused;
  const AttentionCoreKernels fused_core =
      fused ? fused_attention_kernels(attention_shape(w)) : AttentionCoreKernels{};
  for (int i = 0; i < 3; ++i) linear_forward(f, p, e, T, H, H);
  if (fused) {
    f.insert(f.end(), fused_core.forward.begin(), fused_core.forward.end());
  } else {
    f.push_back(memory_kernel(2.0 * e * T * H, 2));
    f.push_back(attention(2.0 * b * S * S * H, e * (2.0 * T * H + N)));
    f.push_back(elementwise_kernel(2.0 * e * N, sums(N), 2));  // scale, + mask
    f.push_back(elementwise_kernel(2.0 * e * N,
                                   per_element(N, {.flops = 4, .exponentials = 1})));  // softmax
    f.push_back(elementwise_kernel(dropout_bytes(N, e), dropout_forward(N)));
    f.push_back(memory_kernel(2.0 * e * T * H));
    f.push_back(attention(2.0 * b * S * S * H, e * (N + 2.0 * T * H)));
    f.push_back(memory_kernel(2.0 * e * T * H));
  }
  // Attention output: dense, dropout, residual add, LayerNorm.
  linear_forward(f, p, e, T, H, H);
  f.push_back(elementwise_kernel(dropout_bytes(T * H, e), dropout_forward(T * H)));
  f.push_back(elementwise_kernel(3.0 * e * T * H, sums(T * H)));
  f.push_back(elementwise_kernel(2.0 * e * T * H, layer_norm(T * H)));
  // FFN: dense H -> I, GELU (an erf per element), dense I -> H, dropout, residual add, LayerNorm.
  linear_forward(f, p, e, T, H, I);
  f.push_back(
      elementwise_kernel(2.0 * e * T * I, per_element(T * I, {.flops = 4, .error_functions = 1})));
  linear_forward(f, p, e, T, I, H);
  f.push_back(elementwise_kernel(dropout_bytes(T * H, e), dropout_forward(T * H)));
  f.push_back(elementwise_kernel(3.0 * e * T * H, sums(T * H)));
  f.push_back(elementwise_kernel(2.0 * e * T * H, layer_norm(T * H)));

  // Backward, in autograd's order. LayerNorm: dx (reads dy, x; writes dx) is activation work,
  // d gamma / d beta (reads dy, x) parameter work.
  auto& bi = k.backward_input;
  auto& bw = k.backward_weight;
  auto layer_norm_backward = [&] {
    bi.push_back(elementwise_kernel(3.0 * e * T * H, per_element(T * H, {.flops = 10})));
    bw.push_back(elementwise_kernel(2.0 * e * T * H, per_element(T * H, {.flops = 3})));
  };
  layer_norm_backward();
  bi.push_back(elementwise_kernel(dropout_bytes(T * H, e), dropout_backward(T * H)));
  linear_backward(k, p, e, T, I, H, true);
  bi.push_back(elementwise_kernel(
      3.0 * e * T * I,
      per_element(T * I, {.flops = 8, .exponentials = 1, .error_functions = 1})));  // GELU'
  linear_backward(k, p, e, T, H, I, true);
  // Residual gradient + FFN input gradient.
  bi.push_back(elementwise_kernel(3.0 * e * T * H, sums(T * H)));
  layer_norm_backward();
  bi.push_back(elementwise_kernel(dropout_bytes(T * H, e), dropout_backward(T * H)));
  linear_backward(k, p, e, T, H, H, true);
  if (fused) {  // rowsum(dO O), the key-block kernel (recomputes the scores), the dQ sum
    bi.insert(bi.end(), fused_core.backward.begin(), fused_core.backward.end());
  } else {
    bi.push_back(memory_kernel(2.0 * e * T * H));                         // heads merged
    bi.push_back(attention(2.0 * b * S * S * H, e * (N + 2.0 * T * H)));  // d probabilities
    bi.push_back(attention(2.0 * b * S * S * H, e * (N + 2.0 * T * H)));  // d V
    bi.push_back(memory_kernel(2.0 * e * T * H));                         // V split
    bi.push_back(elementwise_kernel(dropout_bytes(N, e), dropout_backward(N)));
    bi.push_back(elementwise_kernel(3.0 * e * N, per_element(N, {.flops = 4})));  // softmax
    bi.push_back(elementwise_kernel(2.0 * e * N, sums(N)));                       // scale
    bi.push_back(attention(2.0 * b * S * S * H, e * (N + 2.0 * T * H)));          // d Q
    bi.push_back(attention(2.0 * b * S * S * H, e * (N + 2.0 * T * H)));          // d K
    bi.push_back(memory_kernel(2.0 * e * T * H, 2));                              // Q, K split
  }
  for (int i = 0; i < 3; ++i) linear_backward(k, p, e, T, H, H, options.input_requires_grad);
  // The input's gradient sums the residual's and those of Q, K and V.
  if (options.input_requires_grad) {
    bi.push_back(elementwise_kernel(3.0 * e * T * H, sums(T * H), 3));
  }
  if (options.separate_grad_accumulation) {
    // .grad += new gradient for the 16 parameters: 6 weights, 6 biases, 2 LayerNorms x 2.
    bw.push_back(elementwise_kernel(3.0 * e * H * H, sums(H * H), 4));
    bw.push_back(elementwise_kernel(3.0 * e * H * I, sums(H * I), 2));
    bw.push_back(elementwise_kernel(3.0 * e * H, sums(H), 9));
    bw.push_back(elementwise_kernel(3.0 * e * I, sums(I), 1));
  }
  return k;
}

PieceKernels embeddings_kernels(const Workload& w) {
  const double T = w.tokens(), H = w.config.hidden_size, e = w.storage_bytes();
  PieceKernels k;
  // Word, position and type gathers, two adds, LayerNorm, dropout.
  k.forward.push_back(memory_kernel(e * T * H, 3));
  k.forward.push_back(elementwise_kernel(3.0 * e * T * H, sums(T * H), 2));
  k.forward.push_back(elementwise_kernel(2.0 * e * T * H, layer_norm(T * H)));
  k.forward.push_back(elementwise_kernel(dropout_bytes(T * H, e), dropout_forward(T * H)));
  // Backward: dropout, LayerNorm (dx; d gamma, d beta), three scatter-adds into the tables
  // (all of it feeds parameter gradients, so it is weight-gradient work).
  k.backward_weight.push_back(elementwise_kernel(dropout_bytes(T * H, e), dropout_backward(T * H)));
  k.backward_weight.push_back(
      elementwise_kernel(3.0 * e * T * H, per_element(T * H, {.flops = 10})));
  k.backward_weight.push_back(
      elementwise_kernel(2.0 * e * T * H, per_element(T * H, {.flops = 3})));
  k.backward_weight.push_back(elementwise_kernel(3.0 * e * T * H, sums(T * H), 3));
  return k;
}

PieceKernels heads_kernels(const Workload& w) {
  const auto& c = w.config;
  const double H = c.hidden_size, V = c.vocab_size, b = w.micro_batch_size;
  const double P = b * w.predictions(), e = w.storage_bytes();
  const Precision p = w.precision;
  PieceKernels k;
  auto& f = k.forward;
  // MLM: gather the scored positions, transform dense, GELU, LayerNorm, decoder (tied weight)
  // + bias, softmax cross-entropy over fp32 logits (log-softmax, loss).
  f.push_back(memory_kernel(2.0 * e * P * H));
  linear_forward(f, p, e, P, H, H);
  f.push_back(elementwise_kernel(2.0 * e * P * H,
                                 per_element(P * H, {.flops = 4, .error_functions = 1})));  // GELU
  f.push_back(elementwise_kernel(2.0 * e * P * H, layer_norm(P * H)));
  linear_forward(f, p, e, P, H, V);
  f.push_back(
      elementwise_kernel(4.0 * P * V * 2.0, per_element(P * V, {.flops = 4, .exponentials = 1})));
  f.push_back(elementwise_kernel(4.0 * P * V, sums(P * V)));
  // Pooler (first token, dense, tanh) and NSP classifier.
  linear_forward(f, p, e, b, H, H);
  f.push_back(elementwise_kernel(2.0 * e * b * H,
                                 per_element(b * H, {.flops = 2, .exponentials = 1})));  // tanh
  linear_forward(f, p, e, b, H, 2);
  // Backward: loss gradient over the logits, decoder, LayerNorm, GELU, transform, scatter back;
  // pooler and NSP.
  k.backward_input.push_back(
      elementwise_kernel(4.0 * P * V * 2.0, per_element(P * V, {.flops = 3})));
  linear_backward(k, p, e, P, H, V, true);
  k.backward_input.push_back(
      elementwise_kernel(3.0 * e * P * H, per_element(P * H, {.flops = 10})));
  k.backward_input.push_back(elementwise_kernel(
      3.0 * e * P * H,
      per_element(P * H, {.flops = 8, .exponentials = 1, .error_functions = 1})));  // GELU'
  k.backward_weight.push_back(
      elementwise_kernel(2.0 * e * P * H, per_element(P * H, {.flops = 3})));
  linear_backward(k, p, e, P, H, H, true);
  k.backward_input.push_back(memory_kernel(2.0 * e * P * H));
  linear_backward(k, p, e, b, H, 2, true);
  k.backward_input.push_back(elementwise_kernel(3.0 * e * b * H, per_element(b * H, {.flops = 3})));
  linear_backward(k, p, e, b, H, H, true);
  return k;
}

}  // namespace pf::sim
