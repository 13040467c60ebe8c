// trace_json.cpp -- JSON reading and writing of a Trace (see trace_json.h).
#include "core/trace_json.h"

#include <fstream>
#include <sstream>

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

int64_t get_int(const json& rec, const std::string& where, const char* name) {
  const json& v = field(rec, where, name);
  MEMSCHED_CHECK(v.is_number_integer(), "trace: ", where, " field '", name,
                 "' must be an integer, got ", type_name(v));
  return v.get<int64_t>();
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
    t.uses.push_back(uses[u].get<int64_t>());
  }
  t.freed_after_op = get_int(j, where, "freed_after_op");
  if (j.contains("label")) t.label = get_string(j, where, "label");
  return t;
}

}  // namespace

std::string trace_to_json(const Trace& trace, int indent) {
  trace.validate();  // write nothing that trace_from_json would refuse (See Note [Trace value bounds])
  json j;
  j["version"] = trace.version;
  j["device"] = trace.device;
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
    if (!t.label.empty()) rec["label"] = t.label;
    tensors.push_back(std::move(rec));
  }
  j["ops"] = std::move(ops);
  j["tensors"] = std::move(tensors);
  return j.dump(indent);
}

Trace trace_from_json(const std::string& text) {
  json j;
  try {
    j = json::parse(text);
  } catch (const json::parse_error& e) {
    MEMSCHED_CHECK(false, "trace: not valid JSON (", e.what(), ")");
  }
  MEMSCHED_CHECK(j.is_object(), "trace: the top level must be an object, got ", type_name(j));
  Trace trace;
  trace.version = static_cast<int>(get_int(j, "the top level", "version"));
  MEMSCHED_CHECK(trace.version == kTraceVersion, "trace: field 'version' is ", trace.version,
                 " but this memsched reads version ", kTraceVersion, "; re-profile the step");
  if (j.contains("device")) trace.device = get_string(j, "the top level", "device");
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
