#include "sim/bert_kernels.h"

namespace pf::sim {
namespace {

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
  k.backward_weight.push_back(memory_kernel(e * rows * out_dim));
}

// Dropout forward writes its output and a one-byte mask; backward reads both.
double dropout_bytes(double elements, double e) {
  return elements * (2.0 * e + 1.0);
}

}  // namespace

PieceKernels encoder_layer_kernels(const Workload& w, const LayerKernelOptions& options) {
  const auto& c = w.config;
  const double T = w.tokens(), H = c.hidden_size, I = c.intermediate_size, a = c.num_heads;
  const double b = w.micro_batch_size, S = w.seq_len, e = element_bytes(w.precision);
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
    return kernel;
  };
  // Self-attention: Q, K, V; heads split (copies of Q and of K transposed); scores Q K^T;
  // scale; mask; softmax; dropout; V split; probabilities x V; heads merged.
  for (int i = 0; i < 3; ++i) linear_forward(f, p, e, T, H, H);
  f.push_back(memory_kernel(2.0 * e * T * H, 2));
  f.push_back(attention(2.0 * b * S * S * H, e * (2.0 * T * H + N)));
  f.push_back(memory_kernel(2.0 * e * N, 3));  // scale, + mask, softmax
  f.push_back(memory_kernel(dropout_bytes(N, e)));
  f.push_back(memory_kernel(2.0 * e * T * H));
  f.push_back(attention(2.0 * b * S * S * H, e * (N + 2.0 * T * H)));
  f.push_back(memory_kernel(2.0 * e * T * H));
  // Attention output: dense, dropout, residual add, LayerNorm.
  linear_forward(f, p, e, T, H, H);
  f.push_back(memory_kernel(dropout_bytes(T * H, e)));
  f.push_back(memory_kernel(3.0 * e * T * H));
  f.push_back(memory_kernel(2.0 * e * T * H));
  // FFN: dense H -> I, GELU, dense I -> H, dropout, residual add, LayerNorm.
  linear_forward(f, p, e, T, H, I);
  f.push_back(memory_kernel(2.0 * e * T * I));
  linear_forward(f, p, e, T, I, H);
  f.push_back(memory_kernel(dropout_bytes(T * H, e)));
  f.push_back(memory_kernel(3.0 * e * T * H));
  f.push_back(memory_kernel(2.0 * e * T * H));

  // Backward, in autograd's order. LayerNorm: dx (reads dy, x; writes dx) is activation work,
  // d gamma / d beta (reads dy, x) parameter work.
  auto& bi = k.backward_input;
  auto& bw = k.backward_weight;
  auto layer_norm_backward = [&] {
    bi.push_back(memory_kernel(3.0 * e * T * H));
    bw.push_back(memory_kernel(2.0 * e * T * H));
  };
  layer_norm_backward();
  bi.push_back(memory_kernel(dropout_bytes(T * H, e)));
  linear_backward(k, p, e, T, I, H, true);
  bi.push_back(memory_kernel(3.0 * e * T * I));  // GELU backward
  linear_backward(k, p, e, T, H, I, true);
  bi.push_back(memory_kernel(3.0 * e * T * H));  // residual gradient + FFN input gradient
  layer_norm_backward();
  bi.push_back(memory_kernel(dropout_bytes(T * H, e)));
  linear_backward(k, p, e, T, H, H, true);
  bi.push_back(memory_kernel(2.0 * e * T * H));                         // heads merged
  bi.push_back(attention(2.0 * b * S * S * H, e * (N + 2.0 * T * H)));  // d probabilities
  bi.push_back(attention(2.0 * b * S * S * H, e * (N + 2.0 * T * H)));  // d V
  bi.push_back(memory_kernel(2.0 * e * T * H));                         // V split
  bi.push_back(memory_kernel(dropout_bytes(N, e)));
  bi.push_back(memory_kernel(3.0 * e * N));                             // softmax
  bi.push_back(memory_kernel(2.0 * e * N));                             // scale
  bi.push_back(attention(2.0 * b * S * S * H, e * (N + 2.0 * T * H)));  // d Q
  bi.push_back(attention(2.0 * b * S * S * H, e * (N + 2.0 * T * H)));  // d K
  bi.push_back(memory_kernel(2.0 * e * T * H, 2));                      // Q, K split
  for (int i = 0; i < 3; ++i) linear_backward(k, p, e, T, H, H, options.input_requires_grad);
  // The input's gradient sums the residual's and those of Q, K and V.
  if (options.input_requires_grad) bi.push_back(memory_kernel(3.0 * e * T * H, 3));
  if (options.separate_grad_accumulation) {
    // .grad += new gradient for the 16 parameters: 6 weights, 6 biases, 2 LayerNorms x 2.
    bw.push_back(memory_kernel(3.0 * e * H * H, 4));
    bw.push_back(memory_kernel(3.0 * e * H * I, 2));
    bw.push_back(memory_kernel(3.0 * e * H, 9));
    bw.push_back(memory_kernel(3.0 * e * I, 1));
  }
  return k;
}

PieceKernels embeddings_kernels(const Workload& w) {
  const double T = w.tokens(), H = w.config.hidden_size, e = element_bytes(w.precision);
  PieceKernels k;
  // Word, position and type gathers, two adds, LayerNorm, dropout.
  k.forward.push_back(memory_kernel(e * T * H, 3));
  k.forward.push_back(memory_kernel(3.0 * e * T * H, 2));
  k.forward.push_back(memory_kernel(2.0 * e * T * H));
  k.forward.push_back(memory_kernel(dropout_bytes(T * H, e)));
  // Backward: dropout, LayerNorm (dx; d gamma, d beta), three scatter-adds into the tables
  // (all of it feeds parameter gradients, so it is weight-gradient work).
  k.backward_weight.push_back(memory_kernel(dropout_bytes(T * H, e)));
  k.backward_weight.push_back(memory_kernel(3.0 * e * T * H));
  k.backward_weight.push_back(memory_kernel(2.0 * e * T * H));
  k.backward_weight.push_back(memory_kernel(3.0 * e * T * H, 3));
  return k;
}

PieceKernels heads_kernels(const Workload& w) {
  const auto& c = w.config;
  const double H = c.hidden_size, V = c.vocab_size, b = w.micro_batch_size;
  const double P = b * w.predictions(), e = element_bytes(w.precision);
  const Precision p = w.precision;
  PieceKernels k;
  auto& f = k.forward;
  // MLM: gather the scored positions, transform dense, GELU, LayerNorm, decoder (tied weight)
  // + bias, softmax cross-entropy over fp32 logits (log-softmax, loss).
  f.push_back(memory_kernel(2.0 * e * P * H));
  linear_forward(f, p, e, P, H, H);
  f.push_back(memory_kernel(2.0 * e * P * H, 2));
  linear_forward(f, p, e, P, H, V);
  f.push_back(memory_kernel(4.0 * P * V * 2.0));
  f.push_back(memory_kernel(4.0 * P * V));
  // Pooler (first token, dense, tanh) and NSP classifier.
  linear_forward(f, p, e, b, H, H);
  f.push_back(memory_kernel(2.0 * e * b * H));
  linear_forward(f, p, e, b, H, 2);
  // Backward: loss gradient over the logits, decoder, LayerNorm, GELU, transform, scatter back;
  // pooler and NSP.
  k.backward_input.push_back(memory_kernel(4.0 * P * V * 2.0));
  linear_backward(k, p, e, P, H, V, true);
  k.backward_input.push_back(memory_kernel(3.0 * e * P * H, 2));
  k.backward_weight.push_back(memory_kernel(2.0 * e * P * H));
  linear_backward(k, p, e, P, H, H, true);
  k.backward_input.push_back(memory_kernel(2.0 * e * P * H));
  linear_backward(k, p, e, b, H, 2, true);
  k.backward_input.push_back(memory_kernel(3.0 * e * b * H));
  linear_backward(k, p, e, b, H, H, true);
  return k;
}

}  // namespace pf::sim
