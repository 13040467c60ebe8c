"""Partition: where each op of a step runs, and what that costs (Note [Partition model] in
csrc/core/partition/partition_problem.h).

Entry points: Partition (.device_of_op, .makespan_us, .peak_bytes, .transfers, .to_json(path),
Partition.from_json(path), .summary()).
"""
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

from memsched.units import format_bytes

JSON_VERSION = 1


@dataclass
class Partition:
    method: str                      # "s3", "even", "flops", "metis", "milp"
    device_of_op: List[int]          # one device index per trace op
    devices: List[str]               # device names, by index
    caps: List[int]                  # bytes per device
    makespan_us: float               # simulated step time
    peak_bytes: List[int]            # per device: params, grads, optimizer state and activations it holds
    busy_us: List[float]             # per device: time its ops take
    bytes_moved: int                 # sum over transfers
    transfers: List[Dict] = field(default_factory=list)   # {tensor, from, to, bytes, ready_us, arrive_us}
    fits: bool = True
    link_bw_gbps: Optional[float] = 0.0   # GB/s of every link; None when `links` gives one per pair
    link_latency_us: float = 0.0
    seconds: float = 0.0             # time the method took
    node_device: Optional[Dict[str, int]] = None  # fx node name -> device (partitions of a GraphModule)
    node_ops: Optional[Dict[str, List[int]]] = None  # fx node name -> its forward, backward, optimizer op ids
    note: str = ""                   # e.g. S3's winning start
    links: List[List[float]] = field(default_factory=list)  # links=[[...]] as simulated: row a, column b, a -> b
                                                            # GB/s; empty when every link is link_bw_gbps

    @property
    def num_devices(self):
        return len(self.devices)

    def ops_on(self, device):
        return [i for i, d in enumerate(self.device_of_op) if d == device]

    def summary(self):
        peaks = ", ".join(format_bytes(p) for p in self.peak_bytes)
        return (f"{self.method}: makespan {self.makespan_us / 1e3:.3f} ms on {self.num_devices} devices, "
                f"peaks [{peaks}], {format_bytes(self.bytes_moved)} moved in {len(self.transfers)} transfers"
                + ("" if self.fits else " -- BREAKS A CAP"))

    def to_dict(self):
        d = asdict(self)
        d["version"] = JSON_VERSION
        return d

    def to_json(self, path):
        with open(os.fspath(path), "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f)

    @classmethod
    def from_json(cls, path):
        with open(os.fspath(path), encoding="utf-8") as f:
            d = json.load(f)
        if not isinstance(d, dict) or d.get("version") != JSON_VERSION:
            raise ValueError(f"partition file {path}: not a memsched partition (version {JSON_VERSION}) JSON file")
        d.pop("version")
        try:
            return cls(**d)
        except TypeError as e:
            raise ValueError(f"partition file {path}: {e}") from None
