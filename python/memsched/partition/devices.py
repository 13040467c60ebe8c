"""The devices of a partition: models, per-device memory caps and the links between them.

Entry point: resolve_devices(devices, cap, trace_peak, links=None, link_latency_us=5.0) -> DeviceSet.

Note [Partition devices and links]
  devices: an int n (n of the default preset, h100-sxm), or a list whose items are preset names,
  device JSON paths or memsched.DeviceModel objects. cap: one value for every device or one per
  device; each is bytes (int or "8GiB") or "P%" of the trace's single-device peak (everything on
  one device: the trace's own peak); None: each device's memory_bytes (80 GiB for the H100
  presets). links: None (a default from the devices: NVLink 4 between
  h100-sxm devices, 450 GB/s each way -- 18 links x 25 GB/s per direction, NVIDIA's H100 SXM5
  datasheet: 900 GB/s bidirectional; otherwise the slowest device's host copy bandwidth, as peer
  copies through PCIe), a number (GB/s for every pair) or a D x D matrix (GB/s, a -> b; the diagonal
  is ignored).
"""
import math
import numbers
import os
from dataclasses import dataclass, field
from typing import List

from memsched.device import DeviceModel, load_device, resolve_device
from memsched.units import format_bytes, parse_bytes

DEFAULT_PRESET = "h100-sxm"
NVLINK4_GBPS = 450.0   # per direction between two H100 SXM5 (See Note [Partition devices and links])


@dataclass
class DeviceSet:
    models: List[DeviceModel]
    caps: List[int]
    names: List[str]
    link_bw_gbps: float = NVLINK4_GBPS          # every pair, unless `links` is given
    links: List[float] = field(default_factory=list)  # D*D row-major, a -> b, GB/s; empty: link_bw_gbps
    link_latency_us: float = 5.0

    def __len__(self):
        return len(self.models)


def _refuse_more_devices_than_ops(n, trace):
    """A device beyond the op count holds nothing, and 10**9 of them filled the host's memory first."""
    ops = len(trace.ops) if trace is not None else None
    if ops is not None and n > ops:
        raise ValueError(f"devices: {n} devices for a trace of {ops} ops; a device holds at least one op, so give at "
                         f"most {ops}")


def _models(devices, trace, durations):
    if isinstance(devices, bool) or devices is None:
        raise ValueError(f"devices: expected a device count (e.g. 4) or a list of presets/DeviceModels, got {devices!r}")
    if isinstance(devices, numbers.Integral):
        if devices < 1:
            raise ValueError(f"devices: need at least 1 device, got {devices}")
        _refuse_more_devices_than_ops(int(devices), trace)
        devices = [DEFAULT_PRESET] * int(devices)
    if isinstance(devices, (str, os.PathLike, DeviceModel)):
        devices = [devices]
    try:
        devices = list(devices)
    except TypeError:  # 2.5, an object: was "'float' object is not iterable"
        raise ValueError(f"devices: expected a device count (e.g. 4) or a list of presets/DeviceModels, got "
                         f"{devices!r}") from None
    if not devices:
        raise ValueError("devices: the list is empty; give a device count or at least one preset/DeviceModel")
    _refuse_more_devices_than_ops(len(devices), trace)
    models, names = [], []
    for k, d in enumerate(devices):
        try:
            m = resolve_device(d, trace, durations)
        except ValueError as e:
            raise ValueError(f"devices[{k}]: {e}") from None
        models.append(m)
        names.append(m.name)
    return models, names


def _cap(value, peak, where):
    if isinstance(value, str) and value.strip().endswith("%"):
        text = value.strip()[:-1]
        try:
            pct = float(text)
        except ValueError:
            raise ValueError(f"{where}: cannot read {value!r} as a percentage; write e.g. '50%'") from None
        if not (math.isfinite(pct) and 0 < pct <= 1000):
            raise ValueError(f"{where}: a percentage must be in (0, 1000], got {value!r}")
        return int(peak * pct / 100)
    return parse_bytes(value, name=where)


def resolve_devices(devices, cap, trace_peak, *, links=None, link_latency_us=5.0, trace=None, durations="auto"):
    """DeviceSet for `devices` with caps resolved to bytes (Note [Partition devices and links])."""
    models, names = _models(devices, trace, durations)
    n = len(models)
    if cap is None:
        caps = [m.memory_bytes if m.memory_bytes > 0 else 2**62 for m in models]
    elif isinstance(cap, (list, tuple)):
        if len(cap) != n:
            raise ValueError(f"cap: {len(cap)} caps for {n} devices; give one cap, or one per device")
        caps = [_cap(c, trace_peak, f"cap[{k}]") for k, c in enumerate(cap)]
    else:
        caps = [_cap(cap, trace_peak, "cap")] * n
    if isinstance(link_latency_us, bool) or not isinstance(link_latency_us, numbers.Real) \
            or not math.isfinite(link_latency_us) or link_latency_us < 0:
        raise ValueError(f"link_latency_us: expected a finite number >= 0 (microseconds), got {link_latency_us!r}")
    out = DeviceSet(models, caps, names, link_latency_us=float(link_latency_us))
    if links is None:
        out.link_bw_gbps = NVLINK4_GBPS if all(nm == "h100-sxm" for nm in names) else \
            min(min(m.d2h_bw_gbps, m.h2d_bw_gbps) for m in models)
    elif isinstance(links, numbers.Real) and not isinstance(links, bool):
        if not (math.isfinite(links) and links > 0):
            raise ValueError(f"links: a bandwidth must be a finite number > 0 (GB/s), got {links!r}")
        out.link_bw_gbps = float(links)
    else:
        rows = [list(r) for r in links]
        if len(rows) != n or any(len(r) != n for r in rows):
            raise ValueError(f"links: expected a {n}x{n} matrix of GB/s (row a, column b: a -> b)")
        for a in range(n):
            for b in range(n):
                v = rows[a][b]
                if a != b and (isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v)
                               or v <= 0):
                    raise ValueError(f"links[{a}][{b}]: a bandwidth must be a finite number > 0 (GB/s), got {v!r}")
        out.links = [float(rows[a][b]) if a != b else 0.0 for a in range(n) for b in range(n)]
    return out


def describe_caps(caps):
    """'8.00 GiB each' or '8.00 GiB, 4.00 GiB, ...'."""
    if len(set(caps)) == 1:
        return f"{format_bytes(caps[0])} each"
    return ", ".join(format_bytes(c) for c in caps)
