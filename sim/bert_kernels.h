#pragma once
// The kernels one micro-batch of each piece of BERT launches (an encoder layer, the embeddings,
// the pooler + MLM/NSP heads), forward and backward, op by op as an eager framework runs them
// (Hugging Face BertLayer on PyTorch), the attention core as Workload::attention says (batched
// products, or the fused kernel of sim/attention_kernels.h). docs/simulator.md lists them with
// their FLOPs and bytes.
// Notation: b micro-batch size, S sequence length, T = b S tokens, H hidden, I intermediate,
// a heads, V vocabulary, P = b x predictions, e bytes per element, N = b a S^2 attention scores.
#include "sim/bert_costs.h"
#include "sim/kernel_costs.h"

namespace pf::sim {

// How the layer is run, beyond the model: what a harness measuring one layer alone changes.
struct LayerKernelOptions {
  // The layer's input needs a gradient (every layer inside a model). PipeFisher's per-layer
  // benchmark feeds a tensor without one: no input-gradient products of Q, K and V.
  bool input_requires_grad = true;
  // Parameter gradients are added into .grad by separate kernels (PyTorch's AccumulateGrad when
  // .grad already exists) instead of by the weight-gradient products themselves.
  bool separate_grad_accumulation = false;
};

// Forward, backward-input (activation gradients) and backward-weight (parameter gradients)
// kernels of one micro-batch. A fused backward runs backward_input then backward_weight.
struct PieceKernels {
  Kernels forward;
  Kernels backward_input;
  Kernels backward_weight;
};

PieceKernels encoder_layer_kernels(const Workload& w, const LayerKernelOptions& options = {});
PieceKernels embeddings_kernels(const Workload& w);
PieceKernels heads_kernels(const Workload& w);

}  // namespace pf::sim
