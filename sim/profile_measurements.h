#pragma once
// A measured profile (pipefisher_train --profile-out) as calibration records
// (sim/calibration.h): each chunk's forward and backward, each Linear's K-FAC curvature,
// inversion and preconditioning, and the optimizer step, with the model and the shapes they ran
// at, so that `pipefisher_sim calibrate` can fit a device to training runs and predict others.
#include <nlohmann/json.hpp>

#include "runtime/model/bert_config.h"
#include "scheduler/schedule.h"
#include "sim/attention_kernels.h"
#include "sim/device.h"
#include "sim/measured_cost_model.h"

namespace pf::sim {

struct ProfileWorkload {
  model::BertConfig config;
  int seq_len = 128;
  int micro_batch_size = 8;
  Precision precision = Precision::kFp32;  // of the matrix products
  // What activations and gradients are stored in: pipefisher_train keeps them in fp32 whatever
  // its product precision (BertChunk<float>). Written as the records' "storage_precision" when it
  // differs from `precision`.
  Precision storage_precision = Precision::kFp32;
  // The run's attention core (pipefisher_train --attention); written as the records' "attention"
  // when fused, so that a device fitted to them prices the layers as they ran.
  AttentionAlgorithm attention = AttentionAlgorithm::kBatched;
};

// The measurements file (format_version 1). Every record carries the model (an inline Hugging
// Face config), seq_len, micro_batch_size, precision (storage_precision and attention where they
// are not the defaults) and the fields of `tags` (for --hold-out,
// e.g. {"run": "p2-mb8"}). Entries of the profile that time nothing (0 s) are left out; a
// profile entry for a chunk or Linear the schedule does not hold is an error naming it.
nlohmann::json measurements_from_profile(const Profile& profile, const sched::Schedule& schedule,
                                         const ProfileWorkload& workload,
                                         const nlohmann::json& tags = nlohmann::json::object());

}  // namespace pf::sim
