// Tests for core/trace: derived views (memory curve, peak, activation bytes),
// JSON round trip, and a clear error for every malformed field.
#include <gtest/gtest.h>

#include <cstdio>
#include <string>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/trace.h"
#include "core/trace_json.h"

#include "trace_fixtures.h"

namespace memsched {
namespace {

// fwd0 -> fwd1 -> bwd2 -> bwd3 -> opt4
//   W   (parameter, 1000 B, before step, used by 0 and 3, outlives the step)
//   a0  (activation, 100 B, made by 0, used 1 and 3, freed after 3)
//   a1  (activation, 200 B, made by 1, used 2, freed after 2)
//   tmp (temporary, 50 B, made by 1, freed after 1)
//   g   (gradient, 1000 B, made by 3, used 4, outlives the step)
Trace small_trace() {
  Trace t;
  t.device = "cpu";
  const Phase phases[] = {Phase::kForward, Phase::kForward, Phase::kBackward, Phase::kBackward,
                          Phase::kOptimizer};
  for (int i = 0; i < 5; ++i) {
    Op op;
    op.id = i;
    op.name = "op" + std::to_string(i);
    op.module_path = "layers." + std::to_string(i);
    op.phase = phases[i];
    op.duration_us = 10.0 * (i + 1);
    op.flops = 1e6 * i;
    op.bytes_read = 100 * i;
    op.bytes_written = 10 * i;
    t.ops.push_back(op);
  }
  auto add = [&](int64_t bytes, TensorKind kind, int64_t producer, std::vector<int64_t> uses, int64_t freed) {
    test_traces::add_tensor(t, bytes, kind, producer, std::move(uses), freed);
  };
  add(1000, TensorKind::kParameter, kBeforeStep, {0, 3}, kAfterStep);
  add(100, TensorKind::kActivation, 0, {1, 3}, 3);
  add(200, TensorKind::kActivation, 1, {2}, 2);
  add(50, TensorKind::kTemporary, 1, {}, 1);
  add(1000, TensorKind::kGradient, 3, {4}, kAfterStep);
  t.tensors[2].label = "layers.1:0:[50]";
  return t;
}

TEST(Trace, MemoryCurveByHand) {
  const Trace t = small_trace();
  t.validate();
  // op0: W + a0 = 1100; op1: W + a0 + a1 + tmp = 1350; op2: W + a0 + a1 = 1300;
  // op3: W + a0 + g = 2100; op4: W + g = 2000.
  EXPECT_EQ(t.live_bytes(), (std::vector<int64_t>{1100, 1350, 1300, 2100, 2000}));
  EXPECT_EQ(t.peak_bytes(), 2100);
  EXPECT_EQ(t.peak_op(), 3);
  EXPECT_EQ(t.activation_bytes(), 300);
  EXPECT_EQ(t.bytes_of_kind(TensorKind::kParameter), 1000);
  EXPECT_EQ(t.bytes_of_kind(TensorKind::kTemporary), 50);
}

TEST(Trace, EmptyTraceHasNoPeak) {
  Trace t;
  t.validate();
  EXPECT_TRUE(t.live_bytes().empty());
  EXPECT_EQ(t.peak_bytes(), 0);
  EXPECT_EQ(t.peak_op(), -1);
}

TEST(TraceJson, RoundTripIsExact) {
  const Trace t = small_trace();
  const std::string text = trace_to_json(t);
  const Trace back = trace_from_json(text);
  EXPECT_EQ(trace_to_json(back), text);
  ASSERT_EQ(back.ops.size(), t.ops.size());
  ASSERT_EQ(back.tensors.size(), t.tensors.size());
  for (size_t i = 0; i < t.ops.size(); ++i) {
    EXPECT_EQ(back.ops[i].name, t.ops[i].name);
    EXPECT_EQ(back.ops[i].module_path, t.ops[i].module_path);
    EXPECT_EQ(back.ops[i].phase, t.ops[i].phase);
    EXPECT_DOUBLE_EQ(back.ops[i].duration_us, t.ops[i].duration_us);
    EXPECT_DOUBLE_EQ(back.ops[i].flops, t.ops[i].flops);
    EXPECT_EQ(back.ops[i].bytes_read, t.ops[i].bytes_read);
    EXPECT_EQ(back.ops[i].bytes_written, t.ops[i].bytes_written);
  }
  for (size_t i = 0; i < t.tensors.size(); ++i) {
    EXPECT_EQ(back.tensors[i].bytes, t.tensors[i].bytes);
    EXPECT_EQ(back.tensors[i].kind, t.tensors[i].kind);
    EXPECT_EQ(back.tensors[i].producer_op, t.tensors[i].producer_op);
    EXPECT_EQ(back.tensors[i].uses, t.tensors[i].uses);
    EXPECT_EQ(back.tensors[i].freed_after_op, t.tensors[i].freed_after_op);
    EXPECT_EQ(back.tensors[i].label, t.tensors[i].label);
  }
  EXPECT_EQ(back.peak_bytes(), t.peak_bytes());
}

TEST(TraceJson, FileRoundTrip) {
  const Trace t = small_trace();
  const std::string path = ::testing::TempDir() + "/memsched_trace_roundtrip.json";
  save_trace(t, path);
  const Trace back = load_trace(path);
  EXPECT_EQ(trace_to_json(back), trace_to_json(t));
  std::remove(path.c_str());
}

TEST(TraceJson, MissingFileIsAClearError) {
  try {
    load_trace("/nonexistent/trace.json");
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("/nonexistent/trace.json"), std::string::npos);
  }
}

// One malformed input: a mutation of the good JSON and the words the error must contain.
struct Malformed {
  const char* name;
  void (*mutate)(nlohmann::json&);
  std::vector<std::string> expect;
};

std::string error_for(const std::string& text) {
  try {
    trace_from_json(text);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

// Readable test names in ctest output instead of a byte dump.
void PrintTo(const Malformed& m, std::ostream* os) { *os << m.name; }

class TraceJsonMalformed : public ::testing::TestWithParam<Malformed> {};

TEST_P(TraceJsonMalformed, ErrorNamesRecordAndField) {
  nlohmann::json j = nlohmann::json::parse(trace_to_json(small_trace()));
  GetParam().mutate(j);
  const std::string message = error_for(j.dump());
  ASSERT_FALSE(message.empty()) << "malformed trace was accepted";
  for (const std::string& word : GetParam().expect)
    EXPECT_NE(message.find(word), std::string::npos) << "'" << word << "' not in: " << message;
}

const Malformed kMalformed[] = {
    {"missing_version", [](nlohmann::json& j) { j.erase("version"); }, {"version", "missing"}},
    {"wrong_version", [](nlohmann::json& j) { j["version"] = 99; }, {"version", "99"}},
    {"ops_not_array", [](nlohmann::json& j) { j["ops"] = 3; }, {"'ops'", "array"}},
    {"missing_tensors", [](nlohmann::json& j) { j.erase("tensors"); }, {"tensors", "missing"}},
    {"op_missing_name", [](nlohmann::json& j) { j["ops"][2].erase("name"); }, {"ops[2]", "'name'", "missing"}},
    {"op_duration_wrong_type", [](nlohmann::json& j) { j["ops"][1]["duration_us"] = "fast"; },
     {"ops[1]", "duration_us", "number"}},
    {"op_negative_duration", [](nlohmann::json& j) { j["ops"][1]["duration_us"] = -1.0; },
     {"ops[1]", "duration_us", "negative"}},
    {"op_negative_bytes_read", [](nlohmann::json& j) { j["ops"][3]["bytes_read"] = -5; },
     {"ops[3]", "bytes_read", "negative"}},
    {"op_unknown_phase", [](nlohmann::json& j) { j["ops"][0]["phase"] = "sideways"; },
     {"ops[0]", "phase", "sideways"}},
    {"op_duplicate_id", [](nlohmann::json& j) { j["ops"][2]["id"] = 1; }, {"ops[2]", "'id'", "duplicate"}},
    {"op_not_object", [](nlohmann::json& j) { j["ops"][0] = 7; }, {"ops[0]", "object"}},
    {"tensor_negative_bytes", [](nlohmann::json& j) { j["tensors"][1]["bytes"] = -100; },
     {"tensors[1]", "'bytes'", "negative"}},
    {"tensor_bytes_float", [](nlohmann::json& j) { j["tensors"][1]["bytes"] = 1.5; },
     {"tensors[1]", "'bytes'", "integer"}},
    {"tensor_unknown_kind", [](nlohmann::json& j) { j["tensors"][0]["kind"] = "weights"; },
     {"tensors[0]", "kind", "weights"}},
    {"tensor_duplicate_id", [](nlohmann::json& j) { j["tensors"][3]["id"] = 0; },
     {"tensors[3]", "'id'", "duplicate"}},
    {"tensor_producer_out_of_range", [](nlohmann::json& j) { j["tensors"][2]["producer_op"] = 17; },
     {"tensors[2]", "producer_op", "17"}},
    {"tensor_use_out_of_range", [](nlohmann::json& j) { j["tensors"][1]["uses"][1] = 9; },
     {"tensors[1]", "uses[1]", "9"}},
    {"tensor_use_before_producer", [](nlohmann::json& j) { j["tensors"][2]["uses"] = {0}; },
     {"tensors[2]", "uses[0]", "before its producer"}},
    {"tensor_uses_not_sorted", [](nlohmann::json& j) { j["tensors"][1]["uses"] = {3, 1}; },
     {"tensors[1]", "ascending"}},
    {"tensor_uses_not_array", [](nlohmann::json& j) { j["tensors"][1]["uses"] = "1,3"; },
     {"tensors[1]", "uses", "array"}},
    {"tensor_freed_before_last_use", [](nlohmann::json& j) { j["tensors"][1]["freed_after_op"] = 2; },
     {"tensors[1]", "freed_after_op", "last use"}},
    {"tensor_freed_out_of_range", [](nlohmann::json& j) { j["tensors"][1]["freed_after_op"] = 42; },
     {"tensors[1]", "freed_after_op", "42"}},
    {"tensor_missing_producer", [](nlohmann::json& j) { j["tensors"][4].erase("producer_op"); },
     {"tensors[4]", "producer_op", "missing"}},
};

INSTANTIATE_TEST_SUITE_P(AllCases, TraceJsonMalformed, ::testing::ValuesIn(kMalformed),
                         [](const ::testing::TestParamInfo<Malformed>& info) { return info.param.name; });

TEST(TraceJson, NotJsonAtAll) {
  const std::string message = error_for("{ops: [");
  EXPECT_NE(message.find("not valid JSON"), std::string::npos) << message;
}

}  // namespace
}  // namespace memsched
