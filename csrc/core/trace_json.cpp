// trace_json.cpp -- JSON reading and writing of a Trace (see trace_json.h).
#include "core/trace_json.h"

#include <cstdint>
#include <fstream>
#include <sstream>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/check.h"

namespace memsched {
namespace {

using json = nlohmann::json;

const char* type_name(const json& j) { return j.type_name(); }

// Field accessors that name the record and the field on any problem.
const json& field(const json& rec, const std::string& where, const char* name) {
  MEMSCHED_CHECK(rec.is_object(), "trace: ", where, " must be an object, got ", type_name(rec));
  auto it = rec.find(name);
  MEMSCHED_CHECK(it != rec.end(), "trace: ", where, " is missing field '", name, "'");
  return *it;
}

// An integer above int64's range parses as unsigned; get<int64_t> would wrap it negative.
int64_t to_int64(const json& v, const std::string& where, const std::string& name) {
  MEMSCHED_CHECK(v.is_number_integer(), "trace: ", where, " field '", name, "' must be an integer, got ",
                 type_name(v));
  MEMSCHED_CHECK(!v.is_number_unsigned() || v.get<uint64_t>() <= static_cast<uint64_t>(INT64_MAX), "trace: ", where,
                 " field '", name, "' is ", v.get<uint64_t>(), ", beyond the range of a 64-bit signed integer");
  return v.get<int64_t>();
}

int64_t get_int(const json& rec, const std::string& where, const char* name) {
  return to_int64(field(rec, where, name), where, name);
}

double get_number(const json& rec, const std::string& where, const char* name) {
  const json& v = field(rec, where, name);
  MEMSCHED_CHECK(v.is_number(), "trace: ", where, " field '", name, "' must be a number, got ",
                 type_name(v));
  return v.get<double>();
}

std::string get_string(const json& rec, const std::string& where, const char* name) {
  const json& v = field(rec, where, name);
  MEMSCHED_CHECK(v.is_string(), "trace: ", where, " field '", name, "' must be a string, got ",
                 type_name(v));
  return v.get<std::string>();
}

Op op_from_json(const json& j, size_t index) {
  const std::string where = "ops[" + std::to_string(index) + "]";
  Op op;
  op.id = get_int(j, where, "id");
  op.name = get_string(j, where, "name");
  op.module_path = get_string(j, where, "module_path");
  const std::string phase = get_string(j, where, "phase");
  MEMSCHED_CHECK(parse_phase(phase, &op.phase), "trace: ", where, " field 'phase' is '", phase,
                 "'; expected one of forward, backward, optimizer");
  op.duration_us = get_number(j, where, "duration_us");
  op.flops = get_number(j, where, "flops");
  op.bytes_read = get_int(j, where, "bytes_read");
  op.bytes_written = get_int(j, where, "bytes_written");
  // Optional (traces written before it lack it): derived from the name by default.
  op.rng = is_rng_op_name(op.name);
  if (j.contains("rng")) {
    const json& v = j.at("rng");
    MEMSCHED_CHECK(v.is_boolean(), "trace: ", where, " field 'rng' must be true or false (whether the op draws "
                   "random numbers), got ", type_name(v), "; omit it to derive it from the op name");
    op.rng = v.get<bool>();
  }
  return op;
}

TensorRecord tensor_from_json(const json& j, size_t index) {
  const std::string where = "tensors[" + std::to_string(index) + "]";
  TensorRecord t;
  t.id = get_int(j, where, "id");
  t.bytes = get_int(j, where, "bytes");
  t.dtype = get_string(j, where, "dtype");
  const std::string kind = get_string(j, where, "kind");
  MEMSCHED_CHECK(parse_tensor_kind(kind, &t.kind), "trace: ", where, " field 'kind' is '", kind,
                 "'; expected one of parameter, gradient, activation, optimizer_state, temporary");
  t.producer_op = get_int(j, where, "producer_op");
  const json& uses = field(j, where, "uses");
  MEMSCHED_CHECK(uses.is_array(), "trace: ", where, " field 'uses' must be an array of op ids, got ",
                 type_name(uses));
  for (size_t u = 0; u < uses.size(); ++u) {
    MEMSCHED_CHECK(uses[u].is_number_integer(), "trace: ", where, " field 'uses[", u,
                   "]' must be an integer op id, got ", type_name(uses[u]));
    t.uses.push_back(to_int64(uses[u], where, "uses[" + std::to_string(u) + "]"));
  }
  t.freed_after_op = get_int(j, where, "freed_after_op");
  if (j.contains("held_until_op")) t.held_until_op = get_int(j, where, "held_until_op");
  if (j.contains("save_counters")) t.save_counters = get_int(j, where, "save_counters");
  if (j.contains("label")) t.label = get_string(j, where, "label");
  return t;
}

// Note [Where a JSON parse error is]
//   nlohmann's own errors give a byte offset ("number overflow parsing
//   '1e400'", "ill-formed UTF-8 byte"), not the record. When the plain parse
//   fails, a second parse with a callback keeps the path to the value being
//   parsed -- "ops[2] field 'flops'" -- so that those errors name the record
//   and field like every other trace error. The callback costs only on the
//   error path.
class JsonPath {
 public:
  bool on_event(json::parse_event_t event, const json& parsed) {
    switch (event) {
      case json::parse_event_t::object_start: frames_.push_back({false, 0, ""}); break;
      case json::parse_event_t::array_start: frames_.push_back({true, 0, ""}); break;
      case json::parse_event_t::key: frames_.back().key = parsed.is_string() ? parsed.get<std::string>() : ""; break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        frames_.pop_back();
        [[fallthrough]];
      case json::parse_event_t::value:
        if (!frames_.empty() && frames_.back().is_array) ++frames_.back().index;
        break;
    }
    return true;
  }

  // "ops[2] field 'flops'", "the top level field 'device'", or "" outside any object.
  std::string where() const {
    // The record is the path up to the innermost object's key; the field is that key and any indices after it.
    size_t last_object = frames_.size();
    for (size_t i = frames_.size(); i-- > 0;)
      if (!frames_[i].is_array) { last_object = i; break; }
    if (last_object == frames_.size()) return "";
    std::string record;
    for (size_t i = 0; i < last_object; ++i) record += step(i);
    std::string field = frames_[last_object].key;
    for (size_t i = last_object + 1; i < frames_.size(); ++i) field += step(i);
    return (record.empty() ? "the top level" : record) + " field '" + field + "'";
  }

 private:
  struct Frame {
    bool is_array;
    size_t index;     // arrays: the element being parsed
    std::string key;  // objects: the key being parsed
  };
  std::string step(size_t i) const {
    const Frame& f = frames_[i];
    if (f.is_array) return "[" + std::to_string(f.index) + "]";
    return i == 0 ? f.key : "." + f.key;
  }
  std::vector<Frame> frames_;
};

json parse_located(const std::string& text) {
  try {
    return json::parse(text);  // the fast path: no callback
  } catch (const json::exception&) {
  }
  JsonPath path;  // parse again, keeping the path, to say where the error is
  try {
    return json::parse(text, [&path](int, json::parse_event_t event, json& parsed) {
      return path.on_event(event, parsed);
    });
  } catch (const json::exception& e) {
    const std::string where = path.where();
    const std::string what = e.what();
    if (what.find("number overflow") != std::string::npos)
      MEMSCHED_CHECK(false, "trace: ", where.empty() ? "a number" : where, " is out of range of a double (", what,
                     "); write a finite number");
    if (what.find("UTF-8") != std::string::npos) {  // nlohmann's message quotes the bad bytes: leave it out
      const auto* parse = dynamic_cast<const json::parse_error*>(&e);
      MEMSCHED_CHECK(false, "trace: ", where.empty() ? "a string" : where, " is not valid UTF-8",
                     parse ? " (byte " + std::to_string(parse->byte) + ")" : std::string(),
                     "; names must be UTF-8 text");
    }
    MEMSCHED_CHECK(false, "trace: not valid JSON", where.empty() ? "" : " at " + where, " (", what, ")");
  }
  return json();
}

}  // namespace

std::string trace_to_json(const Trace& trace, int indent) {
  trace.validate();  // write nothing that trace_from_json would refuse (See Note [Trace value bounds])
  json j;
  j["version"] = trace.version;
  j["device"] = trace.device;
  if (trace.min_offload_bytes != 0) j["min_offload_bytes"] = trace.min_offload_bytes;  // optional, default 0
  json ops = json::array();
  for (const Op& op : trace.ops) {
    ops.push_back({{"id", op.id},
                   {"name", op.name},
                   {"module_path", op.module_path},
                   {"phase", to_string(op.phase)},
                   {"duration_us", op.duration_us},
                   {"flops", op.flops},
                   {"bytes_read", op.bytes_read},
                   {"bytes_written", op.bytes_written}});
    if (op.rng != is_rng_op_name(op.name)) ops.back()["rng"] = op.rng;  // written only where not the default
  }
  json tensors = json::array();
  for (const TensorRecord& t : trace.tensors) {
    json rec = {{"id", t.id},
                {"bytes", t.bytes},
                {"dtype", t.dtype},
                {"kind", to_string(t.kind)},
                {"producer_op", t.producer_op},
                {"uses", t.uses},
                {"freed_after_op", t.freed_after_op}};
    if (t.held_until_op != kNotHeld) rec["held_until_op"] = t.held_until_op;  // optional, default -1
    if (t.save_counters != 1) rec["save_counters"] = t.save_counters;          // optional, default 1
    if (!t.label.empty()) rec["label"] = t.label;
    tensors.push_back(std::move(rec));
  }
  j["ops"] = std::move(ops);
  j["tensors"] = std::move(tensors);
  return j.dump(indent);
}

Trace trace_from_json(const std::string& text) {
  const json j = parse_located(text);
  MEMSCHED_CHECK(j.is_object(), "trace: the top level must be an object, got ", type_name(j));
  Trace trace;
  const int64_t version = get_int(j, "the top level", "version");
  MEMSCHED_CHECK(version == kTraceVersion, "trace: field 'version' is ", version,
                 " but this memsched reads version ", kTraceVersion, "; re-profile the step");
  trace.version = kTraceVersion;
  if (j.contains("device")) trace.device = get_string(j, "the top level", "device");
  if (j.contains("min_offload_bytes")) trace.min_offload_bytes = get_int(j, "the top level", "min_offload_bytes");
  const json& ops = field(j, "the top level", "ops");
  MEMSCHED_CHECK(ops.is_array(), "trace: field 'ops' must be an array, got ", type_name(ops));
  for (size_t i = 0; i < ops.size(); ++i) trace.ops.push_back(op_from_json(ops[i], i));
  const json& tensors = field(j, "the top level", "tensors");
  MEMSCHED_CHECK(tensors.is_array(), "trace: field 'tensors' must be an array, got ", type_name(tensors));
  for (size_t i = 0; i < tensors.size(); ++i) trace.tensors.push_back(tensor_from_json(tensors[i], i));
  trace.validate();
  return trace;
}

void save_trace(const Trace& trace, const std::string& path) {
  std::ofstream out(path);
  MEMSCHED_CHECK(out.good(), "cannot open '", path, "' for writing");
  out << trace_to_json(trace, 1) << "\n";
  MEMSCHED_CHECK(out.good(), "failed writing trace to '", path, "'");
}

Trace load_trace(const std::string& path) {
  std::ifstream in(path);
  MEMSCHED_CHECK(in.good(), "cannot open trace file '", path, "'");
  std::stringstream buffer;
  buffer << in.rdbuf();
  try {
    return trace_from_json(buffer.str());
  } catch (const Error& e) {
    throw Error(std::string(e.what()) + " (in '" + path + "')");
  }
}

}  // namespace memsched
