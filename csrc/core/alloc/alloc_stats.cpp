// alloc_stats.cpp -- see alloc_stats.h.
#include "core/alloc/alloc_stats.h"

namespace memsched {

namespace {
template <typename F>
void for_each_stat_array(AllocatorStats& s, F f) {
  for (StatArray* a : {&s.allocation, &s.segment, &s.active, &s.inactive_split, &s.allocated_bytes,
                       &s.reserved_bytes, &s.active_bytes, &s.inactive_split_bytes,
                       &s.requested_bytes}) {
    for (Stat& stat : *a) f(stat);
  }
}
}  // namespace

void AllocatorStats::reset_peak() {
  for_each_stat_array(*this, [](Stat& s) { s.reset_peak(); });
}

void AllocatorStats::reset_accumulated() {
  for_each_stat_array(*this, [](Stat& s) { s.reset_accumulated(); });
  num_alloc_retries = 0;
  num_ooms = 0;
  num_sync_all_streams = 0;
  num_device_alloc = 0;
  num_device_free = 0;
}

std::vector<std::pair<std::string, int64_t>> flatten_stats(const AllocatorStats& stats) {
  std::vector<std::pair<std::string, int64_t>> out;
  const char* pools[kNumPoolIndices] = {"all", "small_pool", "large_pool"};
  auto add = [&](const char* name, const StatArray& a) {
    for (int p = 0; p < kNumPoolIndices; ++p) {
      const std::string prefix = std::string(name) + "." + pools[p] + ".";
      out.emplace_back(prefix + "current", a[p].current);
      out.emplace_back(prefix + "peak", a[p].peak);
      out.emplace_back(prefix + "allocated", a[p].allocated);
      out.emplace_back(prefix + "freed", a[p].freed);
    }
  };
  add("allocation", stats.allocation);
  add("segment", stats.segment);
  add("active", stats.active);
  add("inactive_split", stats.inactive_split);
  add("allocated_bytes", stats.allocated_bytes);
  add("reserved_bytes", stats.reserved_bytes);
  add("active_bytes", stats.active_bytes);
  add("inactive_split_bytes", stats.inactive_split_bytes);
  add("requested_bytes", stats.requested_bytes);
  out.emplace_back("num_alloc_retries", stats.num_alloc_retries);
  out.emplace_back("num_ooms", stats.num_ooms);
  out.emplace_back("num_sync_all_streams", stats.num_sync_all_streams);
  out.emplace_back("num_device_alloc", stats.num_device_alloc);
  out.emplace_back("num_device_free", stats.num_device_free);
  return out;
}

}  // namespace memsched
