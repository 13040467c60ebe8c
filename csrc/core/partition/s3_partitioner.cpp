// s3_partitioner.cpp -- critical-path clustering, cluster mapping, memory
// repair and refinement (See Note [S3 partitioner]).
#include "core/partition/s3_partitioner.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <numeric>
#include <random>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "core/check.h"
#include "core/partition/contiguous_split.h"
#include "core/partition/memory_ledger.h"

namespace memsched {
namespace {

using Clock = std::chrono::steady_clock;

// Tensors live at an op: a segment tree whose nodes list the intervals that cover them.
class LiveIndex {
 public:
  explicit LiveIndex(const PartitionProblem& p) : n_(p.num_ops()) {
    size_ = 1;
    while (size_ < n_) size_ *= 2;
    lists_.resize(2 * size_);
    const auto& tensors = p.tensors();
    for (size_t t = 0; t < tensors.size(); ++t) insert(1, 0, size_ - 1, tensors[t].start, tensors[t].end, t);
  }
  template <typename F>
  void for_each_live(int64_t op, F&& f) const {
    for (int64_t node = size_ + op; node >= 1; node /= 2)
      for (int64_t t : lists_[node]) f(t);
  }

 private:
  void insert(int64_t node, int64_t lo, int64_t hi, int64_t l, int64_t r, size_t t) {
    if (r < lo || hi < l) return;
    if (l <= lo && hi <= r) {
      lists_[node].push_back(static_cast<int64_t>(t));
      return;
    }
    const int64_t mid = (lo + hi) / 2;
    insert(2 * node, lo, mid, l, r, t);
    insert(2 * node + 1, mid + 1, hi, l, r, t);
  }
  int64_t n_, size_ = 1;
  std::vector<std::vector<int64_t>> lists_;
};

struct Context {
  const PartitionProblem& p;
  const std::vector<int64_t>& caps;
  const LiveIndex& live;
  Clock::time_point deadline;
  int64_t max_trials;
};

// Move `ops` to `to`, remembering where they were.
void move_all(MemoryLedger& ledger, const std::vector<int64_t>& ops, int to, std::vector<std::pair<int64_t, int>>* undo) {
  for (int64_t op : ops) {
    if (ledger.device_of(op) == to) continue;
    if (undo != nullptr) undo->emplace_back(op, ledger.device_of(op));
    ledger.move(op, to);
  }
}

void undo_all(MemoryLedger& ledger, std::vector<std::pair<int64_t, int>>& undo) {
  for (auto it = undo.rbegin(); it != undo.rend(); ++it) ledger.move(it->first, it->second);
  undo.clear();
}

// Step 3 of Note [S3 partitioner]. True when every cap holds at the end.
// One scan of what is present at the worst device's peak yields up to
// kUnitCandidates units and kTensorCandidates tensors (by bytes there); they
// are tried in turn, each moved to its best device while that lowers (total
// excess, the bytes at the peak op, bytes moved), until that op is under the
// cap. Then the next peak is scanned.
bool repair(const Context& ctx, MemoryLedger& ledger, bool honour_deadline) {
  const auto& p = ctx.p;
  const int nd = static_cast<int>(p.num_devices());
  const auto& tensors = p.tensors();
  const int64_t max_iterations = 8 * p.num_ops() + 1000;
  constexpr size_t kUnitCandidates = 64;
  constexpr size_t kTensorCandidates = 16;
  std::vector<std::pair<int64_t, int>> undo;
  std::vector<int64_t> ops;
  std::unordered_map<int64_t, int64_t> unit_bytes;
  std::vector<std::pair<int64_t, int64_t>> units, tensor_bytes;
  auto by_bytes = [](const auto& a, const auto& b) { return a.first != b.first ? a.first > b.first : a.second < b.second; };
  auto top = [&](std::vector<std::pair<int64_t, int64_t>>& v, size_t k) {
    k = std::min(k, v.size());
    std::partial_sort(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(k), v.end(), by_bytes);
    v.resize(k);
  };
  using Score = std::tuple<int64_t, int64_t, int64_t>;
  for (int64_t it = 0; it < max_iterations; ++it) {
    if (ledger.excess(ctx.caps) == 0) return true;
    if (honour_deadline && Clock::now() > ctx.deadline) return false;
    int d = 0;
    for (int k = 1; k < nd; ++k)
      if (ledger.peak(k) - ctx.caps[k] > ledger.peak(d) - ctx.caps[d]) d = k;
    const int64_t at = ledger.peak_op(d);
    unit_bytes.clear();
    tensor_bytes.clear();
    ctx.live.for_each_live(at, [&](int64_t t) {
      if (ledger.count(t, d) == 0) return;
      const auto& tensor = tensors[t];
      for (int64_t op : tensor.reasons)
        if (ledger.device_of(op) == d) {
          unit_bytes[p.unit_of(op)] += tensor.bytes;
          break;
        }
      if (!tensor.reasons.empty()) tensor_bytes.emplace_back(tensor.bytes, t);
    });
    units.clear();
    for (const auto& [unit, bytes] : unit_bytes) units.emplace_back(bytes, unit);
    top(units, kUnitCandidates);
    top(tensor_bytes, kTensorCandidates);
    bool moved = false;
    for (size_t c = 0; c < units.size() + tensor_bytes.size(); ++c) {
      if (ledger.value_at(d, at) <= ctx.caps[d]) break;  // this peak is fixed
      ops.clear();
      if (c < units.size()) {
        for (int64_t op : p.unit_ops(units[c].second))
          if (ledger.device_of(op) == d) ops.push_back(op);
      } else {
        for (int64_t op : tensors[tensor_bytes[c - units.size()].second].reasons)
          if (ledger.device_of(op) == d) ops.push_back(op);
      }
      if (ops.empty()) continue;
      const Score current{ledger.excess(ctx.caps), ledger.value_at(d, at), ledger.bytes_moved()};
      Score best = current;
      int best_device = -1;
      for (int b = 0; b < nd; ++b) {
        if (b == d) continue;
        move_all(ledger, ops, b, &undo);
        const Score s{ledger.excess(ctx.caps), ledger.value_at(d, at), ledger.bytes_moved()};
        undo_all(ledger, undo);
        if (s < best) {
          best = s;
          best_device = b;
        }
      }
      if (best_device < 0) continue;
      move_all(ledger, ops, best_device, nullptr);
      moved = true;
    }
    if (!moved) return false;  // nothing lowers the excess or the bytes at the peak
  }
  return ledger.excess(ctx.caps) == 0;
}

// Step 4 of Note [S3 partitioner]: first-improvement local search on the makespan.
double refine(const Context& ctx, MemoryLedger& ledger) {
  const auto& p = ctx.p;
  const int nd = static_cast<int>(p.num_devices());
  const bool all_devices = p.num_ops() <= 4096;
  const bool single_ops = p.num_ops() <= 256;
  double best = simulate_makespan(p, ledger.assignment());
  int64_t trials = 0;
  std::vector<std::pair<int64_t, int>> undo;
  std::vector<char> neighbour(nd);
  auto try_move = [&](const std::vector<int64_t>& ops) -> bool {
    std::fill(neighbour.begin(), neighbour.end(), 0);
    bool cut = false;
    for (int64_t op : ops) {
      const int own = ledger.device_of(op);
      for (int64_t t : p.touched(op))
        for (int64_t other : p.tensors()[t].reasons) {
          const int od = ledger.device_of(other);
          if (od != own) {
            neighbour[od] = 1;
            cut = true;
          }
        }
      if (own != ledger.device_of(ops.front())) cut = true;  // a unit split across devices
      neighbour[own] = 1;
    }
    if (!cut && !all_devices) return false;
    for (int b = 0; b < nd; ++b) {
      if (!(neighbour[b] || all_devices)) continue;
      bool all_on_b = true;
      for (int64_t op : ops) all_on_b = all_on_b && ledger.device_of(op) == b;
      if (all_on_b) continue;
      if (trials >= ctx.max_trials || Clock::now() > ctx.deadline) return false;
      ++trials;
      move_all(ledger, ops, b, &undo);
      if (ledger.excess(ctx.caps) == 0) {
        const double m = simulate_makespan(p, ledger.assignment());
        if (m < best * (1 - 1e-9)) {
          best = m;
          undo.clear();
          return true;
        }
      }
      undo_all(ledger, undo);
    }
    return false;
  };
  std::vector<int64_t> one(1);
  for (bool improved = true; improved && trials < ctx.max_trials && Clock::now() <= ctx.deadline;) {
    improved = false;
    for (int64_t u = 0; u < p.num_units(); ++u) improved = try_move(p.unit_ops(u)) || improved;
    if (single_ops) {
      for (int64_t op = 0; op < p.num_ops(); ++op) {
        one[0] = op;
        improved = try_move(one) || improved;
      }
    }
  }
  return best;
}

}  // namespace

std::vector<int> s3_cluster_mapping(const PartitionProblem& p, int64_t* num_clusters) {
  const int64_t n = p.num_ops();
  const int nd = static_cast<int>(p.num_devices());
  const auto& tensors = p.tensors();
  std::vector<double> w(n, 0.0), ec(tensors.size());
  for (int64_t i = 0; i < n; ++i) {
    for (int d = 0; d < nd; ++d) w[i] += p.op_us(i, d);
    w[i] /= nd;
  }
  for (size_t t = 0; t < tensors.size(); ++t) ec[t] = p.mean_comm_us(tensors[t].bytes);
  std::vector<double> tl(n, 0.0), bl(n, 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t t : p.inputs(i))
      if (tensors[t].producer >= 0) {
        const int64_t q = tensors[t].producer;
        tl[i] = std::max(tl[i], tl[q] + w[q] + ec[t]);
      }
  for (int64_t i = n - 1; i >= 0; --i) {
    bl[i] = w[i];
    for (int64_t t : p.touched(i)) {
      if (tensors[t].producer != i) continue;
      for (size_t k = 1; k < tensors[t].reasons.size(); ++k)
        bl[i] = std::max(bl[i], w[i] + ec[t] + bl[tensors[t].reasons[k]]);
    }
  }
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return tl[a] + bl[a] > tl[b] + bl[b]; });
  std::vector<int64_t> cluster(n, -1);
  std::vector<std::vector<int64_t>> clusters;
  for (int64_t v : order) {
    if (cluster[v] >= 0) continue;
    const auto c = static_cast<int64_t>(clusters.size());
    clusters.push_back({v});
    cluster[v] = c;
    for (int64_t cur = v;;) {  // forward
      int64_t next = -1;
      double key = -1;
      for (int64_t t : p.touched(cur)) {
        if (tensors[t].producer != cur) continue;
        for (size_t k = 1; k < tensors[t].reasons.size(); ++k) {
          const int64_t u = tensors[t].reasons[k];
          if (cluster[u] < 0 && ec[t] + bl[u] > key) {
            key = ec[t] + bl[u];
            next = u;
          }
        }
      }
      if (next < 0) break;
      cluster[next] = c;
      clusters[c].push_back(next);
      cur = next;
    }
    for (int64_t cur = v;;) {  // backward
      int64_t prev = -1;
      double key = -1;
      for (int64_t t : p.inputs(cur)) {
        const int64_t q = tensors[t].producer;
        if (q >= 0 && cluster[q] < 0 && tl[q] + w[q] + ec[t] > key) {
          key = tl[q] + w[q] + ec[t];
          prev = q;
        }
      }
      if (prev < 0) break;
      cluster[prev] = c;
      clusters[c].push_back(prev);
      cur = prev;
    }
  }
  if (num_clusters != nullptr) *num_clusters = static_cast<int64_t>(clusters.size());

  // Mapping (step 2): clusters by descending weight; cost = estimated delay + transfers to mapped neighbours.
  std::vector<double> cw(clusters.size(), 0.0);
  for (size_t c = 0; c < clusters.size(); ++c)
    for (int64_t i : clusters[c]) cw[c] += w[i];
  std::vector<int64_t> corder(clusters.size());
  std::iota(corder.begin(), corder.end(), 0);
  std::stable_sort(corder.begin(), corder.end(), [&](int64_t a, int64_t b) { return cw[a] > cw[b]; });
  double span = 0;
  for (int64_t i = 0; i < n; ++i) span = std::max(span, tl[i] + bl[i]);
  constexpr int kBuckets = 1024;
  const double width = std::max(span, 1e-9) / kBuckets;
  auto bucket = [&](int64_t i) { return std::min(kBuckets - 1, static_cast<int>(tl[i] / width)); };
  std::vector<double> occ(static_cast<size_t>(nd) * kBuckets, 0.0), load(nd, 0.0), cost(nd);
  std::vector<int> device(n, -1);
  for (int64_t c : corder) {
    std::fill(cost.begin(), cost.end(), 0.0);
    for (int64_t i : clusters[c]) {
      const int b = bucket(i);
      for (int d = 0; d < nd; ++d) cost[d] += std::min(1.0, occ[d * kBuckets + b] / width) * w[i];
      for (int64_t t : p.touched(i))
        for (int64_t other : tensors[t].reasons)
          if (other != i && device[other] >= 0 && cluster[other] != c)
            for (int d = 0; d < nd; ++d)
              if (d != device[other]) cost[d] += ec[t];
    }
    int best = 0;
    for (int d = 1; d < nd; ++d)
      if (cost[d] < cost[best] || (cost[d] == cost[best] && load[d] < load[best])) best = d;
    for (int64_t i : clusters[c]) {
      device[i] = best;
      occ[best * kBuckets + bucket(i)] += w[i];
      load[best] += w[i];
    }
  }
  return device;
}

namespace {

S3Result run_s3(const PartitionProblem& p, const std::vector<int64_t>& caps, const S3Options& options) {
  const auto started = Clock::now();
  const int64_t n = p.num_ops();
  const int nd = static_cast<int>(p.num_devices());
  int64_t edges = 0;
  for (const auto& t : p.tensors()) edges += static_cast<int64_t>(t.reasons.size());
  const int64_t trials = options.max_refine_trials >= 0
                             ? options.max_refine_trials
                             : std::max<int64_t>(64, static_cast<int64_t>(2e8 / static_cast<double>(n + edges)));
  LiveIndex live(p);
  const auto deadline =
      started + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(options.time_limit_s));
  Context ctx{p, caps, live, deadline, trials};

  S3Result result;
  std::vector<std::pair<std::string, std::vector<int>>> starts;
  starts.emplace_back("clusters", s3_cluster_mapping(p, &result.num_clusters));
  if (options.contiguous_starts) {
    starts.emplace_back("flops", flop_balanced_split(p));
    starts.emplace_back("even", even_layer_split(p));
    starts.emplace_back("device0", std::vector<int>(n, 0));
  }
  for (const auto& [name, assignment] : options.extra_starts) {
    check_assignment(p, assignment);
    starts.emplace_back(name, assignment);
  }
  if (n <= 64 && nd > 1) {
    std::mt19937_64 rng(options.seed);
    std::uniform_int_distribution<int> pick(0, nd - 1);
    const int64_t restarts = options.restarts >= 0 ? options.restarts : 24;
    for (int64_t r = 0; r < restarts; ++r) {
      std::vector<int> a(n);
      for (auto& x : a) x = pick(rng);
      starts.emplace_back("random", std::move(a));
    }
  }
  bool have = false;
  int64_t best_excess = 0;
  double best_makespan = 0;
  for (auto& [name, assignment] : starts) {
    MemoryLedger ledger(p, assignment);
    const bool fits = repair(ctx, ledger, /*honour_deadline=*/have && result.fits);
    const int64_t excess = ledger.excess(caps);
    const double makespan = fits ? refine(ctx, ledger) : simulate_makespan(p, ledger.assignment());
    const bool better = !have || (fits && !result.fits) ||
                        (fits == result.fits && (fits ? makespan < best_makespan : excess < best_excess));
    if (better) {
      have = true;
      result.fits = fits;
      result.start = name;
      result.device_of_op = ledger.assignment();
      best_excess = excess;
      best_makespan = makespan;
    }
  }
  result.seconds = std::chrono::duration<double>(Clock::now() - started).count();
  return result;
}

}  // namespace

S3Result partition_s3(const PartitionProblem& problem, const S3Options& options) {
  S3Result result = run_s3(problem, problem.devices().caps_bytes, options);
  result.eval = evaluate_partition(problem, result.device_of_op);
  MEMSCHED_DEBUG_ASSERT(result.eval.fits == result.fits);
  return result;
}

int64_t least_uniform_cap(const PartitionProblem& problem, const S3Options& options, double tolerance) {
  const int nd = static_cast<int>(problem.num_devices());
  const auto single = evaluate_partition(problem, std::vector<int>(problem.num_ops(), 0));
  int64_t hi = single.peak_bytes[0];  // everything on device 0 fits this
  int64_t lo = 0;
  for (const auto& t : problem.tensors()) lo = std::max(lo, t.bytes);
  lo = std::max(lo, hi / nd) - 1;  // infeasible below the trace's peak shared evenly (lo itself may fit)
  S3Options quick = options;
  quick.max_refine_trials = 0;
  const int64_t step = std::max<int64_t>(1, static_cast<int64_t>(tolerance * static_cast<double>(hi)));
  while (hi - lo > step) {
    const int64_t mid = lo + (hi - lo) / 2;
    if (run_s3(problem, std::vector<int64_t>(nd, mid), quick).fits) hi = mid;
    else lo = mid;
  }
  return hi;
}

}  // namespace memsched
