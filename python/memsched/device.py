"""Device models for the planners and the simulator: JSON presets and measurement.

Entry points:
  device_presets() -> names;  load_device(name_or_path) -> DeviceModel
  measure_device(device="cuda") -> DeviceModel measured with CUDA events (needs a GPU)
  resolve_device(device, trace=None, durations="auto") -> DeviceModel ready to plan with

See Note [Op time model] in csrc/core/device_model.h for what the fields mean.
"""
import json
import math
import os

from memsched import _C

DeviceModel = _C.DeviceModel
PRESET_DIR = os.path.join(os.path.dirname(__file__), "presets")
DEFAULT_DEVICE = "h100-pcie"
_ALIASES = {"h100": "h100-sxm", "h100-sxm5": "h100-sxm", "h100-pcie5": "h100-pcie", "default": DEFAULT_DEVICE}
_FIELDS = ("peak_flops", "hbm_bw_gbps", "d2h_bw_gbps", "h2d_bw_gbps", "d2h_latency_us", "h2d_latency_us",
           "memory_bytes")


def device_presets():
    """Names of the JSON presets shipped in memsched/presets (aliases not included)."""
    return sorted(f[:-5] for f in os.listdir(PRESET_DIR) if f.endswith(".json"))


def _read_preset(name_or_path):
    if not isinstance(name_or_path, (str, os.PathLike)):
        raise ValueError(f"device: expected a preset name ({', '.join(device_presets())}) or a path to a device "
                         f"JSON file, got {type(name_or_path).__name__}")
    path = os.fspath(name_or_path)
    if os.path.isdir(path):
        raise ValueError(f"device file {path}: is a folder; give a preset name or a JSON file path")
    if not os.path.isfile(path) and path.endswith(".json") and (os.sep in path or os.path.dirname(path)):
        raise ValueError(f"device file {path}: no such file; give a preset name ({', '.join(device_presets())}) "
                         f"or the path of an existing device JSON file")
    if not os.path.isfile(path):
        name = _ALIASES.get(name_or_path, name_or_path)
        path = os.path.join(PRESET_DIR, f"{name}.json")
        if not os.path.isfile(path):
            raise ValueError(f"device: unknown preset {name_or_path!r}; known presets: "
                             f"{', '.join(device_presets())} (aliases: {', '.join(sorted(_ALIASES))}), "
                             f"or a path to a JSON file with fields {', '.join(_FIELDS)}")
    try:
        with open(path, encoding="utf-8") as f:
            spec = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"device file {path}: not valid JSON ({e.msg} at line {e.lineno}, column {e.colno}); "
                         f"a device file is a JSON object with fields {', '.join(_FIELDS)}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"device file {path}: not UTF-8 text ({e.reason} at byte {e.start}); a device file "
                         f"is a JSON object with fields {', '.join(_FIELDS)}") from None
    except OSError as e:
        raise ValueError(f"device file {path}: cannot read it ({e.strerror or e})") from None
    if not isinstance(spec, dict):
        raise ValueError(f"device file {path}: expected a JSON object with fields {', '.join(_FIELDS)}, got a "
                         f"JSON {type(spec).__name__}")
    return spec


def _model_from_spec(spec, where):
    """DeviceModel from a parsed preset; errors name the file (`where`), the field and the fix."""
    d = DeviceModel()
    for field in ("name", "source", "kind"):
        if field in spec and not isinstance(spec[field], str):
            raise ValueError(f"device preset {where}: field '{field}' must be a string, got "
                             f"{json.dumps(spec[field])}")
    d.name = spec.get("name", where)
    for field in _FIELDS:
        if field not in spec:
            raise ValueError(f"device preset {where}: field '{field}' is missing; add it (fields: "
                             f"{', '.join(_FIELDS)})")
        value = spec[field]
        whole = field == "memory_bytes"
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                or (whole and value != int(value)) or value < 0 or (whole and value > 2**63 - 1):
            kind = "a whole number of bytes in [0, 2**63 - 1]" if whole else "a finite number >= 0"
            raise ValueError(f"device preset {where}: field '{field}' must be {kind}, got {json.dumps(value)}")
        setattr(d, field, int(value) if whole else float(value))
    d.source = spec.get("source", "")
    try:
        d.validate()
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"device preset {where}: {e}") from None
    return d


def load_device(name_or_path):
    """DeviceModel from a preset name ("h100-pcie", "h100-sxm", "cpu", aliases "h100-pcie5", ...)
    or a JSON file path."""
    spec = _read_preset(name_or_path)
    return _model_from_spec(spec, name_or_path)


def device_kind(name_or_path):
    """"cuda" or "cpu": the kind of device a preset describes."""
    return _read_preset(name_or_path).get("kind", "cuda")


def resolve_device(device=None, trace=None, durations="auto"):
    """The DeviceModel to plan and simulate with.

    device: None (the default preset, h100-pcie), a preset name or JSON path, or a DeviceModel (used
    as given unless `durations` says otherwise).
    durations: "measured" (use each op's measured duration_us when present), "roofline" (always
    the roofline), or "auto": for a preset, measured durations only when the trace was recorded on
    the same kind of device as the preset ("cpu" trace + "cpu" preset, "cuda..." trace + GPU
    preset; a trace from another source, e.g. synthetic, keeps its durations); for a
    DeviceModel, its own use_measured_durations.
    """
    if durations not in ("auto", "measured", "roofline"):
        raise ValueError(f"durations: expected 'auto', 'measured' or 'roofline', got {durations!r}")
    if isinstance(device, DeviceModel):
        _check_model_fields(device)
        model = _copy(device)
        kind = None
    elif device is None or isinstance(device, (str, os.PathLike)):
        name = DEFAULT_DEVICE if device is None else os.fspath(device)
        spec = _read_preset(name)
        model = _model_from_spec(spec, name)
        kind = spec.get("kind", "cuda")
    else:
        raise ValueError(f"device: expected None, a preset name or a memsched.DeviceModel, got "
                         f"{type(device).__name__}")
    if durations == "measured":
        model.use_measured_durations = True
    elif durations == "roofline":
        model.use_measured_durations = False
    elif kind is not None:
        recorded = (getattr(trace, "device", "") or "") if trace is not None else ""
        recorded_kind = "cuda" if recorded.startswith("cuda") else "cpu" if recorded.startswith("cpu") else None
        model.use_measured_durations = recorded_kind is None or recorded_kind == kind
    return model


def _check_model_fields(d):
    """The checks of a preset file's fields, for a DeviceModel built in Python: DeviceModel.validate()
    lets infinite latencies, bandwidths and FLOP/s through, and the simulator then reports an infinite
    step time and a NaN stall."""
    for field in _FIELDS:
        value = getattr(d, field)
        if not math.isfinite(value):
            raise ValueError(f"device: DeviceModel '{d.name}' field '{field}' must be a finite number, got "
                             f"{value!r}")
    try:
        d.validate()
    except (ValueError, RuntimeError) as e:
        raise ValueError(f"device: {e}") from None


def _copy(d):
    c = DeviceModel()
    for field in _FIELDS + ("name", "source", "use_measured_durations"):
        setattr(c, field, getattr(d, field))
    return c


def measure_device(device="cuda", copy_bytes=256 << 20, matmul_n=8192, repeats=5):
    """Measure this GPU: pinned copy bandwidth and latency each way, HBM bandwidth (device copy) and
    float32 matmul FLOP/s, all timed with CUDA events (median of `repeats`). Returns a DeviceModel.

    Raises memsched.MemschedError on a machine without a CUDA device.
    """
    import torch

    if not torch.cuda.is_available():
        raise _C.MemschedError("measure_device: no CUDA device is available (torch.cuda.is_available() is "
                               "False); use a preset instead, e.g. memsched.load_device('h100-pcie')")
    dev = torch.device(device)
    stream = torch.cuda.Stream(device=dev)

    def timed_us(fn):
        times = []
        with torch.cuda.stream(stream):
            fn()  # warm-up
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                fn()
                end.record(stream)
                end.synchronize()
                times.append(start.elapsed_time(end) * 1e3)
        times.sort()
        return times[len(times) // 2]

    n_elem = copy_bytes // 4
    host = torch.empty(n_elem, dtype=torch.float32, pin_memory=True)
    dev_buf = torch.empty(n_elem, dtype=torch.float32, device=dev)
    dev_buf2 = torch.empty_like(dev_buf)
    small_host = torch.empty(1024, dtype=torch.float32, pin_memory=True)
    small_dev = torch.empty(1024, dtype=torch.float32, device=dev)
    d2h_lat = timed_us(lambda: small_host.copy_(small_dev, non_blocking=True))
    h2d_lat = timed_us(lambda: small_dev.copy_(small_host, non_blocking=True))
    d2h_us = timed_us(lambda: host.copy_(dev_buf, non_blocking=True))
    h2d_us = timed_us(lambda: dev_buf.copy_(host, non_blocking=True))
    dd_us = timed_us(lambda: dev_buf2.copy_(dev_buf))
    a = torch.randn(matmul_n, matmul_n, device=dev)
    b = torch.randn(matmul_n, matmul_n, device=dev)
    mm_us = timed_us(lambda: torch.mm(a, b))

    d = DeviceModel()
    d.name = f"measured:{torch.cuda.get_device_name(dev)}"
    d.d2h_latency_us = d2h_lat
    d.h2d_latency_us = h2d_lat
    d.d2h_bw_gbps = copy_bytes / max(d2h_us - d2h_lat, 1e-3) / 1e3
    d.h2d_bw_gbps = copy_bytes / max(h2d_us - h2d_lat, 1e-3) / 1e3
    d.hbm_bw_gbps = 2 * copy_bytes / dd_us / 1e3  # read + write
    d.peak_flops = 2.0 * matmul_n ** 3 / (mm_us * 1e-6)
    d.memory_bytes = torch.cuda.get_device_properties(dev).total_memory
    d.use_measured_durations = True
    d.source = (f"measured by memsched.measure_device() on {torch.cuda.get_device_name(dev)} "
                f"(torch {torch.__version__}, CUDA {torch.version.cuda}): median of {repeats} CUDA-event "
                f"timings; {copy_bytes} B pinned copies, {matmul_n}^3 float32 matmul")
    d.validate()
    return d


def save_device(model, path):
    """Write a DeviceModel as a preset JSON file (e.g. the output of measure_device())."""
    spec = {"name": model.name, "kind": "cuda"}
    for field in _FIELDS:
        spec[field] = getattr(model, field)
    spec["source"] = model.source
    with open(path, "w") as f:
        json.dump(spec, f, indent=2)
