// pool_json.cpp -- see pool_json.h.
#include "core/alloc/pool_json.h"

#include <nlohmann/json.hpp>

namespace memsched {

std::string pool_state_json(const BlockPool& pool, int device, bool include_history) {
  using nlohmann::json;
  json out;
  json stats = json::object();
  for (const auto& [key, value] : flatten_stats(pool.stats())) stats[key] = value;
  out["stats"] = stats;
  json segments = json::array();
  for (const SegmentInfo& seg : pool.snapshot()) {
    json blocks = json::array();
    for (const BlockInfo& b : seg.blocks) {
      blocks.push_back({{"address", b.address},
                        {"size", b.size},
                        {"requested_size", b.requested_size},
                        {"state", to_string(b.state)},
                        {"frames", json::array()}});
    }
    segments.push_back({{"device", device},
                        {"address", seg.address},
                        {"total_size", seg.total_size},
                        {"allocated_size", seg.allocated_size},
                        {"active_size", seg.active_size},
                        {"requested_size", seg.requested_size},
                        {"stream", seg.stream},
                        {"segment_type", seg.is_small ? "small" : "large"},
                        {"segment_pool_id", json::array({0, 0})},
                        {"is_expandable", false},
                        {"frames", json::array()},
                        {"blocks", blocks}});
  }
  out["segments"] = segments;
  json traces = json::array();
  for (int d = 0; d <= device; ++d) traces.push_back(json::array());
  if (include_history) {
    json& mine = traces[device];
    for (const TraceEntry& e : pool.history()) {
      mine.push_back({{"action", to_string(e.action)},
                      {"addr", e.address},
                      {"size", e.size},
                      {"stream", e.stream},
                      {"time_us", e.time_us},
                      {"frames", json::array()},
                      {"device_free", 0}});
    }
  }
  out["device_traces"] = traces;
  out["backend"] = pool.backend_name();
  return out.dump();
}

}  // namespace memsched
