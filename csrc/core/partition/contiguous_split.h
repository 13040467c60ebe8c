// contiguous_split.h -- the baselines PyTorch users reach for: cut the
// model's layers into one contiguous run per device, evenly by count
// (torch.distributed.pipelining's split by layer count) or balanced by FLOPs.
//
// Entry points: even_layer_split(problem), flop_balanced_split(problem).
//
// Note [Layers]
//   A layer is a forward module path cut at its first all-digit component
//   (layer_key(): "blocks.3.attn" -> "blocks.3", "layer2.1.conv1" ->
//   "layer2.1", "head" -> "head"), in order of first appearance in forward.
//   Every op of that key -- forward and backward -- belongs to the layer. An
//   op outside every forward layer (the loss, the optimizer's updates) joins
//   the layer of the first parameter it reads, else the highest layer whose op
//   produced one of its inputs, else the previous op's layer. A trace without
//   module paths makes each forward op a layer. Layers are cut into
//   num_devices() contiguous runs; device k holds run k.
#pragma once

#include <vector>

#include "core/partition/partition_problem.h"

namespace memsched {

// Layer l on device floor(l * D / L).
std::vector<int> even_layer_split(const PartitionProblem& problem);
// Contiguous runs minimising the largest run's FLOPs (op count where the trace has no FLOPs).
std::vector<int> flop_balanced_split(const PartitionProblem& problem);
// Device of each layer -> device of each op.
std::vector<int> assign_by_layer(const PartitionProblem& problem, const std::vector<int>& device_of_layer);

}  // namespace memsched
