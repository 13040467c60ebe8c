// copy_engine.h -- the offload executor's device<->host copies, their events and the memory they
// hold, in C++ (memsched._C.CopyEngine; used by python/memsched/offload/executor.py).
//
// Note [Offload copy ordering]
//   Rationale: a saved activation may leave device memory only once the copy that reads it has
//   finished, and a prefetched tensor may be read only once the copy that writes it has finished.
//   Approach (accelerator, e.g. CUDA; device-generic c10::Stream / c10::Event, as dw_runtime):
//   - D2H: an event recorded on the compute stream when the queued saves are issued (one event
//     for every copy issued together: offload_many); the D2H stream waits for it, then copies into
//     a host block of the HostTensorPool (pinned on CUDA). The engine keeps a reference to the
//     source storage with the copy's done-event in the D2H stream's pending queue, and poll()
//     drops it when the event has completed. So the caching allocator gets the device block back
//     only after the copy finished -- no record_stream, whose deferral would hide the real release
//     time from our measurements. The destination is held too: a ticket dropped early (a step that
//     raised) must not hand its block back while the copy still writes it.
//   - H2D: the destination is allocated on the compute stream; the H2D stream waits for an event
//     recorded there at that moment (the block may still be in use by earlier compute-stream
//     kernels) and for the D2H copy that wrote the host block, then copies. The consumer makes the
//     compute stream wait for the copy's done-event before use (wait()). The host block stays
//     referenced in the H2D queue until that copy finished; the device block only until that
//     wait (Note [Releases in stream order]).
//   - on_compute_stream (plans with copies_on_compute_stream: offload_all_sync, torch's
//     save_on_cpu): the same copies, events and holds, on the compute stream.
//   - end_step() leaves copies in flight with their holds (no host wait: Note [No host
//     synchronisation in a step] in executor.py); finish() and release() -- at the end of a Run or
//     of a step that raised -- synchronise both copy streams and drop every hold.
//   On CPU (the "device" is the CPU) copies run at once, in order, and tickets are complete at
//   birth; nothing is ever pending.
//
// Note [Releases in stream order]
//   Rationale: poll() gives a source back once the host sees its copy's event complete. On a GPU
//   the host runs ahead of the device -- by up to a whole forward on a model whose kernels are
//   longer than their launches -- so the host sees few copies complete during the forward, the
//   caching allocator (which accounts in host order) gets no block back, and the step's peak
//   approaches keeping everything, whatever the plan says (issue 11: dp at 50% measured above
//   plain on an H100).
//   Approach: release_in_stream_order(bytes) makes the compute stream wait for the done-event of
//   the newest of the oldest pending D2H copies that cover `bytes` (copies on one stream finish in
//   order, so one wait covers every earlier one), then drops their sources at once. It counts and
//   drops only holds that free a block now: the storage's last reference, allocated on the stream
//   that waits (the caching allocator returns a block to its allocation stream's pool, so a wait on
//   another stream would order nothing); others stay until poll() sees their copy complete. The
//   allocator may hand a dropped block to the next compute-stream allocation: every kernel that
//   writes it runs after that wait, i.e. after the copy read it -- the ordering record_stream
//   would give, without waiting for the host to notice. The entry stays in the queue (the host
//   block is still being written) until poll() sees it complete. A wait on a copy the device has
//   already finished costs nothing; on one it has not, the compute stream stalls (timed as a
//   stall, as wait() is). The executor calls it from the memory guard (Note [Memory guard] in
//   saved_tensor_offload.cpp) when the allocator's count nears the budget. A fetched block is the
//   same case the other way round: once wait() has made the compute stream wait for its H2D copy
//   (at its unpack), the engine drops its hold, so the block is freed when the backward is done
//   with it, not when the host next notices the copy completed.
//
// Note [Draining completions in order]
//   Rationale: the hooks poll at every pack and unpack while copies are in flight. Querying every
//   pending copy's event there made a step with n copies in flight cost O(n^2) event queries (the
//   Python engine did that: hundreds of copies in flight in an offload-everything forward).
//   Approach: copies on one stream complete in the order they were issued, so each stream has a
//   FIFO of pending copies and poll() pops from its front while the front's event has completed,
//   stopping at the first that has not: O(1) amortised per poll.
//
// Note [Copy events come from a pool]
//   Events are recycled: a ticket's events return to the engine's pool when the last reference to
//   the ticket (the executor's handle, a step's log) is gone, and a recycled event is simply
//   recorded again. Timing events (start of each copy, the compute stream's stall around a wait,
//   the step's first and last marks) are a separate kind from the synchronisation events, which
//   are created without timing as torch's own default events are. Copies are timed only when the
//   timeline is on (optimize(timeline=True)); stalls and the step's duration are always timed.
#pragma once

#include <ATen/Tensor.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <tuple>
#include <vector>

#include "torch/host_tensor.h"

namespace memsched {

class CopyEventPool;

// A pooled event (See Note [Copy events come from a pool]); goes back to its pool when released.
using PooledEvent = std::shared_ptr<c10::Event>;

// One copy: what it writes, and how to tell it has finished.
struct CopyTicket {
  at::Tensor dst;                 // flat uint8: the host block (D2H) or the device tensor (H2D)
  int64_t nbytes = 0;
  bool d2h = true;
  PooledEvent done;               // recorded after the copy on its stream; null on CPU
  bool is_complete() const { return done == nullptr || done->query(); }
};

// A step's copies and stalls, to be read once its events have completed (one step later).
class StepCopyLog {
 public:
  struct Copy {
    bool d2h;
    int64_t nbytes;
    double issued_s;              // host seconds since the step began (CPU timing)
    double finished_s;
    PooledEvent start;            // accelerator timing; null on CPU
    PooledEvent done;
  };
  int64_t d2h_bytes = 0;
  int64_t h2d_bytes = 0;
  std::vector<Copy> copies;       // timeline only
  std::vector<std::pair<PooledEvent, PooledEvent>> stalls;  // compute stream before/after a wait
  PooledEvent begin;              // the step's first mark on the compute stream (accelerator)
  PooledEvent end;                // set by mark_end()
  std::optional<c10::Stream> compute;

  // Record the step's end on the compute stream (run.step() marks again after the update).
  void mark_end(const std::shared_ptr<CopyEventPool>& pool);
  // Whether every event needed by resolve() has completed: the end mark and each timed copy's
  // done-event (the copy streams are not ordered before the end mark). Never waits.
  bool ready() const;
  // (duration_s, stall_s, [(kind, start_s, end_s, nbytes)]); waits for the end mark and the copies.
  // Accelerator only: on CPU the executor times the step with the host clock.
  std::tuple<double, double, std::vector<std::tuple<const char*, double, double, int64_t>>> resolve() const;
  // CPU copies [(kind, issued_s, finished_s, nbytes)] relative to the step's start.
  std::vector<std::tuple<const char*, double, double, int64_t>> host_copies() const;
};

class CopyEngine {
 public:
  // host: where host blocks come from (pinned on CUDA); limit_bytes: most host bytes alive at
  // once (Note [Host memory limit] in host_buffers.py), < 0 for none; timeline: time every copy.
  CopyEngine(at::Device device, std::shared_ptr<HostTensorPool> host, int64_t limit_bytes, bool timeline);
  ~CopyEngine();

  bool is_accelerator() const { return accel_; }
  bool on_compute_stream = false;
  int64_t limit_bytes;            // most host bytes alive at once; < 0: no limit

  // Whether a host copy of nbytes keeps the host copies within the limit.
  bool has_room(int64_t nbytes) const;
  // Bytes of host copies alive: the pool's requested bytes, not its block sizes (rounded to 512 B,
  // and a cached large block may carry up to 1 MiB more than asked), so the limit is compared with
  // what the plan keeps in host memory (Note [Plans within host_memory_limit] in offload/host_limit.py).
  int64_t host_live_bytes() const;

  void begin_step();
  // Copy each flat uint8 device tensor to a fresh host block, after what the compute stream has
  // queued so far. The engine holds each source until its copy completes; hold=false (copies on the
  // compute stream only) lets the caller free it at once: the caching allocator reuses its block in
  // compute-stream order, after the copy.
  std::vector<std::shared_ptr<CopyTicket>> offload_many(const std::vector<at::Tensor>& sources, bool hold = true);
  // Copy the flat uint8 host tensor to a fresh device tensor, after `after` (the D2H that wrote it).
  std::shared_ptr<CopyTicket> fetch(const at::Tensor& host, const std::shared_ptr<CopyTicket>& after);
  // The same into `dst`, a flat uint8 device tensor just allocated on the compute stream.
  std::shared_ptr<CopyTicket> fetch_into(const at::Tensor& dst, const at::Tensor& host,
                                         const std::shared_ptr<CopyTicket>& after);
  // Make the compute stream wait for the ticket (no host blocking); the stall is timed. An H2D
  // ticket's device block is no longer held after it (Note [Releases in stream order]). Returns
  // whether a wait was queued (false on CPU, where tickets have no event).
  bool wait(const CopyTicket& ticket);
  void poll();                    // See Note [Draining completions in order]
  // Give back the sources of the oldest D2H copies in flight once the compute stream waits for
  // them, until `bytes` of storage nothing else holds are released (Note [Releases in stream
  // order]). Returns {copies released, bytes released}; {0, 0} on CPU and on the compute stream.
  std::pair<int64_t, int64_t> release_in_stream_order(int64_t bytes);
  int64_t pending_count() const { return static_cast<int64_t>(d2h_pending_.size() + h2d_pending_.size()); }
  // Device bytes the engine keeps allocated for D2H copies in flight: sources it holds until the
  // host sees their copy complete or releases them in stream order (Note [Where the peak went] in
  // python/memsched/offload/peak_gap.py). A running count, O(1).
  int64_t held_source_bytes() const { return held_source_bytes_; }
  // The step's log, without waiting: copies in flight keep what they read.
  std::shared_ptr<StepCopyLog> end_step();
  // Wait for every copy and drop what the copies held (a Run's end, a step that raised).
  void release();
  void check_invariants() const;
  const std::shared_ptr<CopyEventPool>& events() const { return events_; }

 private:
  struct Pending {
    std::shared_ptr<CopyTicket> ticket;  // null once a released H2D entry let it go
    PooledEvent done;             // the ticket's done-event: what poll() waits for
    at::Tensor source;            // read by the copy: kept until ticket->done (undefined: hold=false)
    at::Tensor dst;               // written by the copy: kept until ticket->done, even if the ticket dies
    c10::Stream compute;          // the compute stream when issued: where the device tensor was allocated
    bool released = false;        // device tensor dropped after a compute-stream wait (Note [Releases in stream order])
    int64_t held_bytes = 0;       // D2H: source bytes counted in held_source_bytes_ while `source` is held
  };
  void drop_source(Pending& p);   // D2H: let go of p.source and take its bytes off held_source_bytes_
  c10::Stream compute_stream() const;
  double now_s() const;
  // `stream` (a side stream) waits for what the compute (current) stream has queued so far; no-op
  // on it. Call it before a StreamGuard makes `stream` current.
  void wait_for_compute(const c10::Stream& stream);
  // t.dst <- src on `stream` (the current stream), with t.done recorded after it and the step's log
  // updated (a timed start event too with timeline).
  void copy_on(const c10::Stream& stream, CopyTicket& t, const at::Tensor& src);

  at::Device device_;
  bool accel_;
  std::shared_ptr<HostTensorPool> host_;
  bool timeline_;
  std::optional<c10::Stream> d2h_stream_, h2d_stream_;
  std::shared_ptr<CopyEventPool> events_;
  std::deque<Pending> d2h_pending_, h2d_pending_;
  int64_t held_source_bytes_ = 0;  // SUM held_bytes over d2h_pending_ entries that hold their source
  std::shared_ptr<StepCopyLog> log_;
  std::chrono::steady_clock::time_point t0_;
};

}  // namespace memsched
