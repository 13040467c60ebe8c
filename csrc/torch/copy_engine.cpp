// copy_engine.cpp -- see copy_engine.h, Notes [Offload copy ordering], [Draining completions in
// order] and [Copy events come from a pool].
#include "torch/copy_engine.h"

#include <ATen/ATen.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include "core/check.h"

namespace memsched {

// See Note [Copy events come from a pool].
class CopyEventPool : public std::enable_shared_from_this<CopyEventPool> {
 public:
  explicit CopyEventPool(c10::DeviceType type) : type_(type) {}

  PooledEvent get(bool timing) {
    c10::Event* raw = nullptr;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto& free = timing ? timing_ : sync_;
      if (!free.empty()) {
        raw = free.back().release();
        free.pop_back();
      }
    }
    if (raw == nullptr) {
      raw = new c10::Event(type_, timing ? c10::EventFlag::BACKEND_DEFAULT : c10::EventFlag::PYTORCH_DEFAULT);
    }
    std::weak_ptr<CopyEventPool> pool = weak_from_this();
    return PooledEvent(raw, [pool, timing](c10::Event* e) {
      // Destroyed on whichever thread drops the last reference (Python's, autograd's).
      if (auto p = pool.lock()) {
        std::lock_guard<std::mutex> lock(p->mu_);
        (timing ? p->timing_ : p->sync_).emplace_back(e);
      } else {
        delete e;
      }
    });
  }

  size_t idle() {
    std::lock_guard<std::mutex> lock(mu_);
    return timing_.size() + sync_.size();
  }

 private:
  c10::DeviceType type_;
  std::mutex mu_;
  std::vector<std::unique_ptr<c10::Event>> timing_, sync_;
};

namespace {

using CopyRow = std::tuple<const char*, double, double, int64_t>;

const char* kind_name(bool d2h) { return d2h ? "d2h" : "h2d"; }

at::Tensor empty_device_bytes(int64_t nbytes, const at::Device& device) {
  return at::empty({nbytes}, at::TensorOptions().dtype(at::kByte).device(device));
}

}  // namespace

// -- StepCopyLog ------------------------------------------------------------------------------------

void StepCopyLog::mark_end(const std::shared_ptr<CopyEventPool>& pool) {
  if (!compute) return;
  if (end == nullptr) end = pool->get(/*timing=*/true);
  end->record(*compute);
}

bool StepCopyLog::ready() const {
  if (!compute) return true;
  if (end == nullptr || !end->query()) return false;
  // WARNING: copies run on the copy streams, which the end mark does not wait for (a D2H copy whose
  // tensor backward never fetched, a copy issued at end_step): each copy's own event must be done too.
  for (const Copy& c : copies) {
    if (c.done != nullptr && !c.done->query()) return false;
  }
  for (const auto& stall : stalls) {
    if (!stall.second->query()) return false;  // a wait on another stream than the end mark's (below)
  }
  return true;
}

std::tuple<double, double, std::vector<CopyRow>> StepCopyLog::resolve() const {
  MEMSCHED_CHECK(compute && begin != nullptr && end != nullptr,
                 "StepCopyLog.resolve: an accelerator step's log needs mark_end() first");
  // Everything recorded on the compute stream before the end mark (begin, most stalls) has completed
  // with it; the copies, on their own streams, are waited for one by one: c10::Event::elapsedTime
  // refuses an event that has not completed ("Both events must be completed").
  end->synchronize();
  for (const Copy& c : copies) {
    if (c.done != nullptr) c.done->synchronize();  // after its start event, on the same stream
  }
  // WARNING: a stall is timed on the stream current at the wait: in a backward that runs ops on the
  // stream their forward used, that need not be the compute stream the end mark is on.
  for (const auto& stall : stalls) stall.second->synchronize();
  const double duration_s = begin->elapsedTime(*end) / 1e3;
  double stall_s = 0.0;
  for (const auto& [before, after] : stalls) stall_s += before->elapsedTime(*after) / 1e3;
  std::vector<CopyRow> rows;
  rows.reserve(copies.size());
  for (const Copy& c : copies) {
    if (c.start == nullptr || c.done == nullptr) continue;
    const double start_s = begin->elapsedTime(*c.start) / 1e3;
    rows.emplace_back(kind_name(c.d2h), start_s, start_s + c.start->elapsedTime(*c.done) / 1e3, c.nbytes);
  }
  return {duration_s, stall_s, std::move(rows)};
}

std::vector<CopyRow> StepCopyLog::host_copies() const {
  std::vector<CopyRow> rows;
  rows.reserve(copies.size());
  for (const Copy& c : copies) rows.emplace_back(kind_name(c.d2h), c.issued_s, c.finished_s, c.nbytes);
  return rows;
}

// -- CopyEngine -------------------------------------------------------------------------------------

CopyEngine::CopyEngine(at::Device device, std::shared_ptr<HostTensorPool> host, int64_t limit_bytes,
                       bool timeline)
    : device_(device),
      accel_(device.type() != c10::DeviceType::CPU),
      limit_bytes(limit_bytes),
      host_(std::move(host)),
      timeline_(timeline),
      events_(std::make_shared<CopyEventPool>(device.type())),
      log_(std::make_shared<StepCopyLog>()),
      t0_(std::chrono::steady_clock::now()) {
  MEMSCHED_CHECK(host_ != nullptr, "CopyEngine: a HostTensorPool is required");
  if (accel_) {
    if (!device_.has_index()) {
      c10::impl::VirtualGuardImpl impl(device_.type());
      device_ = c10::Device(device_.type(), impl.getDevice().index());
    }
    c10::impl::VirtualGuardImpl impl(device_.type());
    d2h_stream_ = impl.getStreamFromGlobalPool(device_, /*isHighPriority=*/false);
    h2d_stream_ = impl.getStreamFromGlobalPool(device_, /*isHighPriority=*/false);
  }
}

CopyEngine::~CopyEngine() {
  // Copies still in flight read what the queues hold: wait for them before dropping it.
  try {
    release();
  } catch (...) {  // NOLINT(bugprone-empty-catch): a destructor must not throw
  }
}

c10::Stream CopyEngine::compute_stream() const {
  c10::impl::VirtualGuardImpl impl(device_.type());
  return impl.getStream(device_);
}

double CopyEngine::now_s() const {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0_).count();
}

int64_t CopyEngine::host_live_bytes() const {
  return static_cast<int64_t>(host_->pool().stats().requested_bytes[kAggregatePool].current);
}

bool CopyEngine::has_room(int64_t nbytes) const { return limit_bytes < 0 || host_live_bytes() + nbytes <= limit_bytes; }

void CopyEngine::begin_step() {
  log_ = std::make_shared<StepCopyLog>();
  t0_ = std::chrono::steady_clock::now();
  if (accel_) {
    log_->compute = compute_stream();
    log_->begin = events_->get(/*timing=*/true);
    log_->begin->record(*log_->compute);
  }
}

void CopyEngine::wait_for_compute(const c10::Stream& stream) {
  const c10::Stream compute = compute_stream();  // the current stream: call before a guard sets `stream`
  if (stream == compute) return;
  PooledEvent mark = events_->get(/*timing=*/false);
  mark->record(compute);
  mark->block(stream);
}

void CopyEngine::copy_on(const c10::Stream& stream, CopyTicket& t, const at::Tensor& src) {
  PooledEvent start;
  if (timeline_) {
    start = events_->get(/*timing=*/true);
    start->record(stream);
  }
  t.dst.copy_(src, /*non_blocking=*/true);
  // Timing needs a timing event at both ends; a sync event is enough otherwise.
  t.done = events_->get(/*timing=*/timeline_);
  t.done->record(stream);
  (t.d2h ? log_->d2h_bytes : log_->h2d_bytes) += t.nbytes;
  if (timeline_) log_->copies.push_back({t.d2h, t.nbytes, 0.0, 0.0, start, t.done});
}

std::vector<std::shared_ptr<CopyTicket>> CopyEngine::offload_many(const std::vector<at::Tensor>& sources,
                                                                   bool hold) {
  MEMSCHED_CHECK(hold || on_compute_stream || !accel_,
                 "CopyEngine.offload_many(hold=False): only for copies on the compute stream (on_compute_stream)");
  std::vector<std::shared_ptr<CopyTicket>> tickets;
  tickets.reserve(sources.size());
  if (sources.empty()) return tickets;
  if (!accel_) {
    for (const at::Tensor& src : sources) {
      auto t = std::make_shared<CopyTicket>();
      t->nbytes = src.numel();
      const double issued = timeline_ ? now_s() : 0.0;
      t->dst = host_->empty_bytes(t->nbytes);
      t->dst.copy_(src);
      log_->d2h_bytes += t->nbytes;
      if (timeline_) log_->copies.push_back({true, t->nbytes, issued, now_s(), nullptr, nullptr});
      tickets.push_back(std::move(t));
    }
    return tickets;
  }
  const c10::Stream stream = on_compute_stream ? compute_stream() : *d2h_stream_;
  const c10::Stream compute = compute_stream();  // where the sources were allocated (and are used)
  wait_for_compute(stream);  // one event for every save issued together
  c10::StreamGuard guard(stream);
  c10::impl::VirtualGuardImpl impl(device_.type());
  for (const at::Tensor& src : sources) {
    auto t = std::make_shared<CopyTicket>();
    t->nbytes = src.numel();
    t->dst = host_->empty_bytes(t->nbytes);
    copy_on(stream, *t, src);
    // hold=false: the caller frees src at once, ordered after the copy only on the stream the block
    // was allocated on; recorded here, a block made under another stream waits for the copy too.
    if (!hold) impl.recordDataPtrOnStream(src.storage().data_ptr(), stream);
    // WARNING: src is read on the D2H stream: keep it until `done` (Note [Offload copy ordering]).
    d2h_pending_.push_back({t, t->done, hold ? src : at::Tensor(), t->dst, compute});
    if (hold) {
      d2h_pending_.back().held_bytes = static_cast<int64_t>(src.nbytes());
      held_source_bytes_ += d2h_pending_.back().held_bytes;
    }
    tickets.push_back(std::move(t));
  }
  return tickets;
}

std::shared_ptr<CopyTicket> CopyEngine::fetch(const at::Tensor& host, const std::shared_ptr<CopyTicket>& after) {
  return fetch_into(empty_device_bytes(host.numel(), device_), host, after);  // a compute-stream block
}

std::shared_ptr<CopyTicket> CopyEngine::fetch_into(const at::Tensor& dst, const at::Tensor& host,
                                                   const std::shared_ptr<CopyTicket>& after) {
  MEMSCHED_CHECK(dst.numel() == host.numel() && dst.scalar_type() == at::kByte && host.scalar_type() == at::kByte,
                 "CopyEngine.fetch_into: dst and host must be flat uint8 tensors of one size");
  auto t = std::make_shared<CopyTicket>();
  t->d2h = false;
  t->nbytes = host.numel();
  t->dst = dst;
  if (!accel_) {
    const double issued = timeline_ ? now_s() : 0.0;
    t->dst.copy_(host);
    log_->h2d_bytes += t->nbytes;
    if (timeline_) log_->copies.push_back({false, t->nbytes, issued, now_s(), nullptr, nullptr});
    return t;
  }
  const c10::Stream stream = on_compute_stream ? compute_stream() : *h2d_stream_;
  const c10::Stream compute = compute_stream();  // where dst was allocated
  wait_for_compute(stream);  // dst was allocated on the compute stream
  c10::StreamGuard guard(stream);
  if (after != nullptr && after->done != nullptr) after->done->block(stream);
  copy_on(stream, *t, host);
  // WARNING: host is read on the H2D stream: keep it until `done`.
  h2d_pending_.push_back({t, t->done, host, t->dst, compute});
  return t;
}

bool CopyEngine::wait(const CopyTicket& ticket) {
  if (ticket.done == nullptr) return false;
  const c10::Stream compute = compute_stream();
  PooledEvent before = events_->get(/*timing=*/true);
  PooledEvent after = events_->get(/*timing=*/true);
  before->record(compute);
  ticket.done->block(compute);
  after->record(compute);
  log_->stalls.emplace_back(std::move(before), std::move(after));
  if (!ticket.d2h) {
    // See Note [Releases in stream order]: every later use and free of the fetched block is ordered
    // after the copy now, so the engine need not keep it until the host sees the copy complete --
    // when the stream that waited is the one the block was allocated on (its pool's stream).
    for (Pending& p : h2d_pending_) {
      if (p.ticket.get() != &ticket || p.compute != compute) continue;
      p.dst = at::Tensor();
      p.ticket.reset();  // the ticket holds the block too; the entry keeps only its event
      p.released = true;
      break;
    }
  }
  return true;
}

void CopyEngine::poll() {
  // See Note [Draining completions in order].
  while (!d2h_pending_.empty() && d2h_pending_.front().done->query()) {
    drop_source(d2h_pending_.front());
    d2h_pending_.pop_front();
  }
  while (!h2d_pending_.empty() && h2d_pending_.front().done->query()) h2d_pending_.pop_front();
}

std::pair<int64_t, int64_t> CopyEngine::release_in_stream_order(int64_t bytes) {
  // See Note [Releases in stream order].
  if (!accel_ || on_compute_stream || bytes <= 0) return {0, 0};
  const c10::Stream compute = compute_stream();
  // Only what goes back to the allocator now: a hold that is its storage's last reference, on a block
  // of the stream that will wait (a block returns to the pool of the stream it was allocated on).
  auto frees = [&](const Pending& p) {
    return !p.released && p.source.defined() && p.compute == compute && p.source.storage().use_count() == 1;
  };
  int64_t copies = 0;
  int64_t freed = 0;
  const CopyTicket* newest = nullptr;
  auto end = d2h_pending_.begin();
  for (; end != d2h_pending_.end() && freed < bytes; ++end) {
    if (!frees(*end)) continue;
    ++copies;
    newest = end->ticket.get();
    freed += static_cast<int64_t>(end->source.storage().nbytes());
  }
  if (newest == nullptr) return {0, 0};
  wait(*newest);  // the D2H stream runs its copies in order: this wait covers the older ones
  c10::impl::VirtualGuardImpl impl(device_.type());
  for (auto p = d2h_pending_.begin(); p != end; ++p) {
    if (!frees(*p)) continue;
    // WARNING: p->compute is the stream current when the copy was issued, not necessarily the one the
    // block was allocated on (an op run under another stream made it): its pool's stream might reuse
    // it before the copy read it. Recorded on the stream that waited, the free is ordered after the
    // wait whatever that stream; on the allocation stream itself this is a no-op.
    impl.recordDataPtrOnStream(p->source.storage().data_ptr(), compute);
    drop_source(*p);
    p->released = true;
  }
  return {copies, freed};
}

std::shared_ptr<StepCopyLog> CopyEngine::end_step() {
  poll();
  auto log = std::move(log_);
  log_ = std::make_shared<StepCopyLog>();
  return log;
}

void CopyEngine::release() {
  if (accel_) {
    d2h_stream_->synchronize();
    h2d_stream_->synchronize();
    if (on_compute_stream && (!d2h_pending_.empty() || !h2d_pending_.empty())) compute_stream().synchronize();
  }
  d2h_pending_.clear();
  h2d_pending_.clear();
  held_source_bytes_ = 0;
}

void CopyEngine::drop_source(Pending& p) {
  if (!p.source.defined()) return;
  p.source = at::Tensor();
  held_source_bytes_ -= p.held_bytes;
  p.held_bytes = 0;
}

void CopyEngine::check_invariants() const {
  for (const auto* queue : {&d2h_pending_, &h2d_pending_}) {
    for (const Pending& p : *queue) {
      MEMSCHED_CHECK(accel_, "CopyEngine: CPU copies are complete at birth and never pending");
      MEMSCHED_CHECK(p.done != nullptr, "CopyEngine: a pending copy has no done-event");
      MEMSCHED_CHECK(p.ticket != nullptr || p.released, "CopyEngine: a pending copy lost its ticket unreleased");
      // A released entry no longer holds its device tensor (Note [Releases in stream order]).
      const bool d2h = queue == &d2h_pending_;
      const bool holds_device = (d2h ? p.source : p.dst).defined();
      const bool holds_host = (d2h ? p.dst : p.source).defined();
      MEMSCHED_CHECK(holds_host && (holds_device || p.released || (d2h && on_compute_stream)),
                     "CopyEngine: a pending copy must hold what it reads and what it writes");
    }
  }
  int64_t held = 0;
  for (const Pending& p : d2h_pending_) held += p.source.defined() ? p.held_bytes : 0;
  MEMSCHED_CHECK(held == held_source_bytes_, "CopyEngine: held_source_bytes is ", held_source_bytes_,
                 " but the D2H copies in flight hold ", held, " bytes of their sources");
}

}  // namespace memsched
