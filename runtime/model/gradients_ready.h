#pragma once
// The hook data-parallel training needs to overlap its gradient all-reduce with the backward:
// during a micro-batch's weight-gradient pass (BertChunk::backward_weight, and so backward) the
// chunk says which parameter gradients that micro-batch has finished adding to, as ranges of
// its flat gradient array (BertChunk::flat_grads), as soon as each is finished: the head's,
// then each encoder layer's from the last to the first, then the embeddings'. The ranges are
// adjacent and descending and together cover every parameter of the chunk. On the step's last
// micro-batch of a chunk they are the step's final gradients, ready to be reduced.
#include <cstdint>

namespace pf::model {

class GradientsReady {
 public:
  virtual ~GradientsReady() = default;
  // Elements [begin, end) of flat_grads() hold this micro-batch's contribution.
  virtual void on_gradients_ready(std::int64_t begin, std::int64_t end) = 0;
};

}  // namespace pf::model
