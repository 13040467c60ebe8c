"""Copies between device and host for the offload executor, and when their memory may be reused.

Entry point: CopyEngine(device, host_buffers). offload(src) starts a
device-to-host copy, fetch(host) a host-to-device copy; each returns a
CopyTicket that the consumer waits on. The same calls run on CPU, where the
"device" is the CPU, copies happen at once, in order, and every ticket is
complete when it is returned.

Note [Offload copy ordering]
  Rationale: a saved activation may leave device memory only once the copy that
  reads it has finished, and a prefetched tensor may be read only once the copy
  that writes it has finished.
  Approach (CUDA):
  - D2H: an event recorded on the compute stream when the tensor is packed; the
    D2H stream waits for it, then copies into a pinned host block. The engine
    keeps a reference to the source storage (and the host block) in `pending_`
    with the copy's done-event; `poll()` drops references whose event has
    completed. So the caching allocator gets the device block back only after
    the copy finished -- no record_stream, whose deferral would hide the real
    release time from our measurements.
  - H2D: the destination is allocated on the compute stream; the H2D stream
    waits for an event recorded there at that moment (the block may still be
    in use by earlier compute-stream kernels), then copies. The consumer makes
    the compute stream wait for the copy's done-event before use (`wait()`).
    The host block stays referenced in `pending_` until that copy finished.
  - end_step() leaves copies in flight with their holds (no host wait; Note [No host
    synchronisation in a step] in executor.py); finish() -- at the end of a Run or of a step
    that raised -- synchronises both copy streams and empties `pending_`.
  - on_compute_stream (plans with copies_on_compute_stream, i.e. offload_all_sync
    -- torch's save_on_cpu): the same copies, events and holds, on the compute
    stream, so compute waits for every copy.
  Approach (CPU): copy_() runs synchronously; tickets are complete at birth.
  Limitations: polling happens at hook calls (every pack / unpack), so the
  release of a device block can lag its copy's completion by one hook call.
"""
import time

import torch


class CopyTicket:
    """One copy in flight: its destination, size, and how to wait for it."""

    __slots__ = ("dst", "nbytes", "done", "start_event", "issued_s", "finished_s", "kind")

    def __init__(self, dst, nbytes, kind, done=None, start_event=None, issued_s=0.0, finished_s=None):
        self.dst = dst                  # tensor written by the copy (flat uint8)
        self.nbytes = nbytes            # bytes copied
        self.kind = kind                # "d2h" or "h2d"
        self.done = done                # torch.cuda.Event recorded after the copy; None on CPU
        self.start_event = start_event  # torch.cuda.Event before the copy (timing); None on CPU
        self.issued_s = issued_s        # host clock when issued (perf_counter seconds)
        self.finished_s = finished_s    # host clock when finished (CPU only; CUDA: from events)

    def is_complete(self):
        return self.done is None or self.done.query()


class CopyEngine:
    """Side-stream (CUDA) or in-order (CPU) copies plus deferred release of the memory they touch."""

    def __init__(self, device, host_buffers):
        self.device = torch.device(device)
        self.host = host_buffers
        self.is_cuda = self.device.type == "cuda"
        if self.is_cuda:
            self.d2h_stream = torch.cuda.Stream(device=self.device)
            self.h2d_stream = torch.cuda.Stream(device=self.device)
        self.on_compute_stream = False  # True: copies run on the compute stream (plan of offload_all_sync)
        self.pending_ = []     # [(ticket, refs)]: refs kept alive until ticket completes
        self.log_ = []         # [(kind, nbytes, issued_s, finished_s, start_event, done)] this step, for
                               #   the timeline -- never the tensors, which must die with their users
        self.bytes_d2h = 0     # SUM this step
        self.bytes_h2d = 0     # SUM this step

    def offload(self, src_bytes, hold=True):
        """Copy the flat uint8 device tensor `src_bytes` to a fresh host buffer; returns the ticket.

        The engine holds `src_bytes` until the copy completes (See Note [Offload copy ordering]).
        hold=False, only with on_compute_stream: the caller may free the source at once -- the
        caching allocator reuses its block in compute-stream order, after the copy.
        """
        nbytes = src_bytes.numel()
        host = self.host.empty(nbytes)
        issued = time.perf_counter()
        if not self.is_cuda:
            host.copy_(src_bytes)
            ticket = CopyTicket(host, nbytes, "d2h", issued_s=issued, finished_s=time.perf_counter())
        else:
            compute = torch.cuda.current_stream(self.device)
            stream = compute if self.on_compute_stream else self.d2h_stream
            produced = torch.cuda.Event()
            produced.record(compute)
            start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                stream.wait_event(produced)
                start.record(stream)
                host.copy_(src_bytes, non_blocking=True)
                done.record(stream)
            ticket = CopyTicket(host, nbytes, "d2h", done=done, start_event=start, issued_s=issued)
            # WARNING: src_bytes is read on the D2H stream: keep it until `done`.
            if hold or not self.on_compute_stream:
                self.pending_.append((ticket, (src_bytes,)))
        self.bytes_d2h += nbytes
        self._log(ticket)
        return ticket

    def fetch(self, host, after=None):
        """Copy the flat uint8 host tensor `host` to a fresh device tensor; returns the ticket.

        `after`: the D2H ticket that wrote `host`; the H2D copy is ordered after it.
        """
        dst = torch.empty(host.numel(), dtype=torch.uint8, device=self.device)  # compute-stream block
        return self.fetch_into(dst, host, after)

    def fetch_into(self, dst, host, after=None):
        """Copy the flat uint8 host tensor `host` into the flat uint8 device tensor `dst`, whose
        memory was just allocated on the compute stream; returns the ticket (ordered as fetch())."""
        nbytes = host.numel()
        issued = time.perf_counter()
        if not self.is_cuda:
            dst.copy_(host)
            ticket = CopyTicket(dst, nbytes, "h2d", issued_s=issued, finished_s=time.perf_counter())
        else:
            compute = torch.cuda.current_stream(self.device)
            stream = compute if self.on_compute_stream else self.h2d_stream
            allocated = torch.cuda.Event()
            allocated.record(compute)
            start, done = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                stream.wait_event(allocated)
                if after is not None and after.done is not None:
                    stream.wait_event(after.done)
                start.record(stream)
                dst.copy_(host, non_blocking=True)
                done.record(stream)
            ticket = CopyTicket(dst, nbytes, "h2d", done=done, start_event=start, issued_s=issued)
            # WARNING: host is read on the H2D stream: keep it until `done`.
            self.pending_.append((ticket, (host,)))
        self.bytes_h2d += nbytes
        self._log(ticket)
        return ticket

    def _log(self, t):
        self.log_.append((t.kind, t.nbytes, t.issued_s, t.finished_s, t.start_event, t.done))

    def wait(self, ticket):
        """Make the compute stream wait for `ticket` (no host blocking). No-op on CPU.

        Returns (before, after) timing events around the wait on the compute stream, whose
        elapsed time after the step is the time the compute stream stood still for this copy
        (None on CPU, where copies finish before fetch() returns).
        """
        if ticket.done is None:
            return None
        compute = torch.cuda.current_stream(self.device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(compute)
        compute.wait_event(ticket.done)
        after.record(compute)
        return before, after

    def poll(self):
        """Drop references held for copies that have completed."""
        if self.pending_:
            self.pending_ = [(t, refs) for t, refs in self.pending_ if not t.is_complete()]

    def pending_count(self):
        return len(self.pending_)

    def release(self):
        """Wait for every copy and drop what the copies held; the log and byte counts stay."""
        if self.is_cuda:
            self.d2h_stream.synchronize()
            self.h2d_stream.synchronize()
        self.pending_ = []

    def end_step(self):
        """The step's copy log and bytes moved, without waiting: copies in flight keep what they read
        until they complete (poll()). Returns (copy log, (d2h bytes, h2d bytes))."""
        self.poll()
        log = self.log_
        self.log_ = []
        moved = (self.bytes_d2h, self.bytes_h2d)
        self.bytes_d2h = self.bytes_h2d = 0
        return log, moved

    def finish(self):
        """Wait for every copy, release everything held; returns (copy log, (d2h bytes, h2d bytes)).

        Log entries: (kind, nbytes, issued_s, finished_s, start_event, done_event).
        """
        if self.is_cuda:
            self.d2h_stream.synchronize()
            self.h2d_stream.synchronize()
        self.pending_ = []
        log = self.log_
        self.log_ = []
        moved = (self.bytes_d2h, self.bytes_h2d)
        self.bytes_d2h = self.bytes_h2d = 0
        return log, moved

    def check_invariants(self):
        for ticket, refs in self.pending_:
            assert ticket.done is not None, "CPU copies are complete at birth and never pending"
            assert refs, "a pending copy must hold what it reads"
