"""memsched.partition: place a training step's ops on several devices under per-device memory caps
(source S3, ParDNN), beside the baselines PyTorch users reach for.

    p = memsched.partition(trace, devices=4, cap="8GiB")          # S3 (C++), a Partition
    rows = memsched.partition.compare(trace, 4, "50%")             # s3, even, flops, metis, milp
    print(memsched.partition.format_table(rows)); p.to_json("partition.json")

The package itself is callable: memsched.partition(...) is memsched.partition.partition(...).
"""
import sys
import types

from memsched.partition.api import METHODS, CapsError, compare, partition
from memsched.partition.devices import resolve_devices
from memsched.partition.result import Partition
from memsched.partition.table import best_row, format_table

__all__ = ["METHODS", "CapsError", "Partition", "best_row", "compare", "format_table", "partition",
           "resolve_devices"]


class _CallablePackage(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return partition(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage
