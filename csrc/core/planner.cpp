// planner.cpp -- the planner registry and the shared budget error (see planner.h).
#include "core/planner.h"

#include <functional>
#include <sstream>
#include <utility>

#include "core/baseline_planners.h"
#include "core/check.h"
#include "core/dp_planner.h"
#include "core/greedy_planner.h"
#include "core/hybrid_planner.h"

namespace memsched {

namespace {

using Factory = std::function<std::unique_ptr<Planner>()>;

const std::vector<std::pair<std::string, Factory>>& registry() {
  static const std::vector<std::pair<std::string, Factory>> kRegistry = {
      {"keep_all", [] { return std::make_unique<KeepAllPlanner>(); }},
      {"offload_all_sync", [] { return std::make_unique<OffloadAllSyncPlanner>(); }},
      {"offload_all_prefetch", [] { return std::make_unique<OffloadAllPrefetchPlanner>(); }},
      {"vdnn", [] { return std::make_unique<VdnnPlanner>(); }},
      {"greedy", [] { return std::make_unique<GreedyPlanner>(); }},
      {"dp", [] { return std::make_unique<DpPlanner>(); }},
      {"hybrid", [] { return std::make_unique<HybridPlanner>(); }},
  };
  return kRegistry;
}

}  // namespace

std::vector<std::string> planner_names() {
  std::vector<std::string> names;
  for (const auto& entry : registry()) names.push_back(entry.first);
  return names;
}

std::unique_ptr<Planner> create_planner(const std::string& name) {
  for (const auto& entry : registry())
    if (entry.first == name) return entry.second();
  std::ostringstream known;
  for (const auto& entry : registry()) known << (known.tellp() > 0 ? ", " : "") << entry.first;
  MEMSCHED_CHECK(false, "unknown planner '", name, "'; known planners: ", known.str());
  return nullptr;
}

Plan make_plan(const Trace& trace, const DeviceModel& device, int64_t budget_bytes, const std::string& planner) {
  device.validate();
  MEMSCHED_CHECK(budget_bytes >= 0, "plan: budget must not be negative (got ", budget_bytes, " bytes)");
  Plan p = create_planner(planner)->make_plan(trace, device, budget_bytes);
  p.planner = planner;
  p.budget_bytes = budget_bytes;
  return p;
}

void throw_budget_unreachable(const std::string& planner, int64_t budget_bytes, int64_t planner_least_bytes,
                              int64_t global_least_bytes, const std::string& why) {
  std::ostringstream os;
  if (budget_bytes < global_least_bytes || planner_least_bytes <= global_least_bytes) {
    os << "budget " << budget_bytes << " bytes is below the least budget any plan can reach on this trace: "
       << global_least_bytes << " bytes (every activation offloaded right after its last forward use and "
       << "fetched on demand); raise the budget to at least " << global_least_bytes << " bytes";
  } else {
    os << "planner '" << planner << "' cannot meet budget " << budget_bytes << " bytes: it needs at least "
       << planner_least_bytes << " bytes";
    if (!why.empty()) os << " (" << why << ")";
    os << "; raise the budget to at least " << planner_least_bytes << " bytes, or use planner 'greedy', which "
       << "reaches the least budget any plan can reach: " << global_least_bytes << " bytes";
  }
  throw Error(os.str());
}

}  // namespace memsched
