// trace_builder.h -- records one training step, event by event, into a Trace.
//
// The profiler (python/memsched/profiler) feeds it what it observes: ops as
// they begin and end, and storages as they are allocated, used, saved and
// freed. The builder de-duplicates by storage key, assigns ids and fills
// producer_op / uses / freed_after_op. Entry point: TraceBuilder; finish()
// returns the validated Trace.
//
// Note [Trace builder events]
//   Rationale: the profiler sees tensors, the Trace wants storages; keeping the
//   bookkeeping in C++ (no torch) makes it testable with GoogleTest and keeps
//   the Python side a thin observer.
//   Approach: a storage key (See Note [Storage identity], a StorageImpl address)
//   maps to the record of the storage *live now*. Events:
//     begin_op / end_op          ops strictly alternate; ids 0, 1, 2, ...
//     tensor_existing(key, ..)   a storage that exists before the step
//                                (producer_op = kBeforeStep)
//     tensor_allocated(key, ..)  produced by the current op; a key already live
//                                (a view, an in-place result) makes no new
//                                record -- only bytes grow to the larger size
//     tensor_used(key)           read by the current op (recorded once per op)
//     tensor_freed(key)          died after the last op begun: freed_after_op;
//                                the key may then name a new storage
//     tensor_held(key)           something besides the step's saves holds it
//                                during the last op begun: held_until_op
//                                (Note [Held by the caller] in trace.h)
//     tensor_save_counters(key, n) its saves came through n version counters
//                                (Note [Saves through several counters])
//     upgrade_kind(key, kind)    raise the kind, never lower it, in the order
//                                temporary < activation < gradient <
//                                optimizer_state < parameter (e.g. a temporary
//                                that autograd saves becomes an activation)
//   Limitations: a storage freed before the first op was never live during an
//   op; finish() drops its record (ids are assigned after dropping).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "core/trace.h"

namespace memsched {

class TraceBuilder {
 public:
  explicit TraceBuilder(std::string device = "");

  // Opens op number num_ops(); returns its id. Throws if an op is open.
  int64_t begin_op(const std::string& name, const std::string& module_path, Phase phase);
  // Closes the open op with its measurements. Throws if none is open.
  void end_op(double duration_us, double flops, int64_t bytes_read, int64_t bytes_written);
  // The profiler's hot path in one call: begin_op; tensor_used(k) for k in
  // `used`; tensor_allocated(key, bytes, dtype, kTemporary) for each output
  // (key, bytes, dtype); end_op. Same checks and results as the separate calls.
  struct OutputInfo {
    uint64_t key = 0;     // storage key
    int64_t bytes = 0;    // storage bytes
    std::string dtype;    // e.g. "float32"
  };
  int64_t record_op(const std::string& name, const std::string& module_path, Phase phase,
                    const std::vector<uint64_t>& used, const std::vector<OutputInfo>& outputs,
                    double duration_us, double flops, int64_t bytes_read, int64_t bytes_written);
  // Sets a duration measured later (CUDA events resolve after the step).
  void set_duration_us(int64_t op_id, double duration_us);

  // Returns the record index (not final id) of the storage; See Note [Trace builder events].
  int64_t tensor_existing(uint64_t key, int64_t bytes, const std::string& dtype, TensorKind kind,
                          const std::string& label = "");
  // Returns true when a new record was made (false: the key was live already).
  bool tensor_allocated(uint64_t key, int64_t bytes, const std::string& dtype, TensorKind kind,
                        const std::string& label = "");
  void tensor_used(uint64_t key);
  void tensor_freed(uint64_t key);
  void tensor_held(uint64_t key);
  void tensor_save_counters(uint64_t key, int64_t counters);
  void upgrade_kind(uint64_t key, TensorKind kind, const std::string& label = "");

  bool is_live(uint64_t key) const { return live_.count(key) != 0; }
  std::vector<uint64_t> live_keys() const;
  int64_t num_ops() const { return static_cast<int64_t>(ops_.size()); }
  int64_t num_records() const { return static_cast<int64_t>(records_.size()); }
  bool in_op() const { return in_op_; }

  // The Trace so far, validated; the builder is left empty. Throws if an op is open.
  Trace finish();

  // live_ points at records not yet freed; uses ascending; in_op_ only with ops.
  void check_invariants() const;

 private:
  int64_t live_record(uint64_t key, const char* event) const;
  int64_t new_record(uint64_t key, int64_t bytes, const std::string& dtype, TensorKind kind,
                     const std::string& label, int64_t producer_op);

  std::string device_;
  std::vector<Op> ops_;
  std::vector<TensorRecord> records_;          // index = record index (pre-drop)
  std::vector<char> dropped_;                  // 1: freed before any op; removed by finish()
  std::unordered_map<uint64_t, int64_t> live_; // storage key -> record index of the live storage
  bool in_op_ = false;                         // between begin_op and end_op
};

}  // namespace memsched
