// placement_planner.cpp -- see placement_planner.h, Note [Greedy interval packing].
#include "core/alloc/placement_planner.h"

#include <algorithm>
#include <limits>
#include <numeric>

#include "core/check.h"

namespace memsched {

namespace {

struct Item {
  int64_t id;     // tensor id
  int64_t size;   // aligned bytes
  int64_t start;  // first live op
  int64_t end;    // last live op
};

struct Placed {
  int64_t offset;
  const Item* item;
};

// Place `order` greedily; returns the arena size and fills offsets[id].
int64_t pack(const std::vector<Item>& items, const std::vector<size_t>& order,
             std::vector<int64_t>& offsets) {
  std::vector<Placed> placed;  // kept sorted by offset
  placed.reserve(items.size());
  int64_t arena = 0;
  std::vector<const Placed*> overlapping;
  for (size_t index : order) {
    const Item& item = items[index];
    overlapping.clear();
    for (const Placed& p : placed) {
      if (p.item->start <= item.end && item.start <= p.item->end) overlapping.push_back(&p);
    }
    // `placed` is sorted by offset, so `overlapping` is too.
    int64_t best_offset = -1;
    int64_t best_gap = std::numeric_limits<int64_t>::max();
    int64_t cursor = 0;
    for (const Placed* p : overlapping) {
      const int64_t gap = p->offset - cursor;
      if (gap >= item.size && gap < best_gap) {
        best_gap = gap;
        best_offset = cursor;
      }
      cursor = std::max(cursor, p->offset + p->item->size);
    }
    if (best_offset < 0) best_offset = cursor;
    offsets[item.id] = best_offset;
    arena = std::max(arena, best_offset + item.size);
    const Placed entry{best_offset, &item};
    auto at = std::upper_bound(placed.begin(), placed.end(), entry,
                               [](const Placed& a, const Placed& b) { return a.offset < b.offset; });
    placed.insert(at, entry);
  }
  return arena;
}

}  // namespace

Placement plan_placement(const Trace& trace, const PlacementOptions& options) {
  MEMSCHED_CHECK(options.alignment_bytes > 0, "plan_placement: options.alignment_bytes must be > 0, got ",
                 options.alignment_bytes);
  // Rounding a size up adds at most alignment - 1 to at most kMaxTraceBytes:
  // with this bound it fits in int64 (See Note [Trace value bounds]).
  MEMSCHED_CHECK(options.alignment_bytes <= kMaxTraceBytes, "plan_placement: options.alignment_bytes is ",
                 options.alignment_bytes, ", above the bound ", kMaxTraceBytes, " (2^62); use an alignment such as 512");
  trace.validate();
  const int64_t align = options.alignment_bytes;
  Placement result;
  const size_t n = trace.tensors.size();
  result.offsets.assign(n, -1);
  result.sizes.assign(n, 0);
  result.lower_bound_bytes = trace.peak_bytes();
  if (trace.ops.empty()) return result;

  std::vector<Item> items;
  int64_t total_size = 0;  // bounds the arena: every offset + size fits in int64 when this does
  for (const TensorRecord& t : trace.tensors) {
    if (t.bytes <= 0) continue;
    const int64_t size = (t.bytes + align - 1) / align * align;
    MEMSCHED_CHECK(size <= std::numeric_limits<int64_t>::max() - total_size, "plan_placement: the tensors' sizes "
                   "rounded up to alignment_bytes (", align, ") overflow int64 at tensor ", t.id,
                   "; use a smaller alignment");
    total_size += size;
    result.sizes[t.id] = size;
    items.push_back(Item{t.id, size, trace.live_start(t), trace.live_end(t)});
  }
  std::vector<size_t> base(items.size());
  std::iota(base.begin(), base.end(), 0);
  auto by = [&](auto key) {
    std::vector<size_t> order = base;
    std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return key(items[a], items[b]); });
    return order;
  };
  const std::pair<const char*, std::vector<size_t>> orders[] = {
      {"size", by([](const Item& a, const Item& b) {
         if (a.size != b.size) return a.size > b.size;
         return (a.end - a.start) > (b.end - b.start);
       })},
      {"area", by([](const Item& a, const Item& b) {
         return static_cast<double>(a.size) * (a.end - a.start + 1) >
                static_cast<double>(b.size) * (b.end - b.start + 1);
       })},
      {"start", by([](const Item& a, const Item& b) {
         if (a.start != b.start) return a.start < b.start;
         return a.size > b.size;
       })},
  };
  result.arena_bytes = std::numeric_limits<int64_t>::max();
  std::vector<int64_t> offsets(n, -1);
  for (const auto& [name, order] : orders) {
    std::fill(offsets.begin(), offsets.end(), -1);
    const int64_t arena = pack(items, order, offsets);
    if (arena < result.arena_bytes) {
      result.arena_bytes = arena;
      result.offsets = offsets;
      result.strategy = name;
    }
  }
  if (items.empty()) result.arena_bytes = 0;
  return result;
}

void Placement::check_invariants(const Trace& trace, int64_t alignment_bytes) const {
  MEMSCHED_CHECK(alignment_bytes > 0, "Placement::check_invariants: alignment_bytes must be > 0, got ", alignment_bytes);
  trace.validate();
  MEMSCHED_CHECK(offsets.size() == trace.tensors.size() && sizes.size() == trace.tensors.size(),
                 "Placement invariant: one offset and size per tensor expected");
  std::vector<const TensorRecord*> placed;
  for (const TensorRecord& t : trace.tensors) {
    const int64_t off = offsets[t.id];
    if (t.bytes <= 0) {
      MEMSCHED_CHECK(off == -1, "Placement invariant: empty tensor ", t.id, " has an offset");
      continue;
    }
    MEMSCHED_CHECK(off >= 0 && off % alignment_bytes == 0 && sizes[t.id] >= t.bytes &&
                       off + sizes[t.id] <= arena_bytes,
                   "Placement invariant: tensor ", t.id, " at offset ", off, " size ", sizes[t.id],
                   " does not fit an arena of ", arena_bytes, " bytes aligned to ", alignment_bytes);
    placed.push_back(&t);
  }
  for (size_t i = 0; i < placed.size(); ++i) {
    const TensorRecord& a = *placed[i];
    for (size_t j = i + 1; j < placed.size(); ++j) {
      const TensorRecord& b = *placed[j];
      const bool time = trace.live_start(a) <= trace.live_end(b) && trace.live_start(b) <= trace.live_end(a);
      const bool space = offsets[a.id] < offsets[b.id] + sizes[b.id] &&
                         offsets[b.id] < offsets[a.id] + sizes[a.id];
      MEMSCHED_CHECK(!(time && space), "Placement invariant: tensors ", a.id, " and ", b.id,
                     " are live together and overlap in the arena");
    }
  }
}

}  // namespace memsched
