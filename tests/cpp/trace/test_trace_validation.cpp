// Tests for Note [Trace value bounds]: a trace whose byte sums could overflow
// int64, whose op ids are out of range, whose numbers are not finite or whose
// names are not UTF-8 gets an error naming the record and the field -- from
// validate(), from every derived view and consumer (which validate first), and
// from JSON loading -- never a negative peak or a read out of range.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/alloc/placement_planner.h"
#include "core/alloc/trace_replay.h"
#include "core/check.h"
#include "core/device_model.h"
#include "core/plan.h"
#include "core/planner.h"
#include "core/simulator.h"
#include "core/trace.h"
#include "core/trace_json.h"

#include "trace_fixtures.h"

namespace memsched {
namespace {

constexpr int64_t kInt64Max = std::numeric_limits<int64_t>::max();

// fwd0 -> fwd1 -> bwd2 -> bwd3; a parameter, two activations and a gradient.
Trace four_op_trace() {
  Trace t;
  const Phase phases[] = {Phase::kForward, Phase::kForward, Phase::kBackward, Phase::kBackward};
  for (int i = 0; i < 4; ++i) {
    Op op;
    op.id = i;
    op.name = "op" + std::to_string(i);
    op.phase = phases[i];
    op.duration_us = 10.0;
    t.ops.push_back(op);
  }
  auto add = [&](int64_t bytes, TensorKind kind, int64_t producer, std::vector<int64_t> uses, int64_t freed) {
    test_traces::add_tensor(t, bytes, kind, producer, std::move(uses), freed);
  };
  add(1000, TensorKind::kParameter, kBeforeStep, {0, 3}, kAfterStep);
  add(100, TensorKind::kActivation, 0, {1, 3}, 3);
  add(200, TensorKind::kActivation, 1, {2}, 2);
  add(1000, TensorKind::kGradient, 3, {}, kAfterStep);
  return t;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

void expect_words(const std::string& message, const std::vector<std::string>& words) {
  ASSERT_FALSE(message.empty()) << "no error";
  for (const std::string& w : words) EXPECT_NE(message.find(w), std::string::npos) << "'" << w << "' not in: " << message;
}

// Every entry point that consumes a Trace, by name.
std::vector<std::pair<std::string, std::function<void(const Trace&)>>> consumers() {
  return {
      {"validate", [](const Trace& t) { t.validate(); }},
      {"live_bytes", [](const Trace& t) { t.live_bytes(); }},
      {"peak_bytes", [](const Trace& t) { t.peak_bytes(); }},
      {"peak_op", [](const Trace& t) { t.peak_op(); }},
      {"activation_bytes", [](const Trace& t) { t.activation_bytes(); }},
      {"bytes_of_kind", [](const Trace& t) { t.bytes_of_kind(TensorKind::kParameter); }},
      {"trace_to_json", [](const Trace& t) { trace_to_json(t); }},
      {"analyze_offload", [](const Trace& t) { analyze_offload(t); }},
      {"make_plan dp", [](const Trace& t) { make_plan(t, DeviceModel(), kInt64Max, "dp"); }},
      {"make_plan greedy", [](const Trace& t) { make_plan(t, DeviceModel(), kInt64Max, "greedy"); }},
      {"make_plan keep_all", [](const Trace& t) { make_plan(t, DeviceModel(), kInt64Max, "keep_all"); }},
      {"simulate", [](const Trace& t) { simulate(t, Plan(), DeviceModel()); }},
      {"plan_placement", [](const Trace& t) { plan_placement(t); }},
      {"Placement::check_invariants", [](const Trace& t) { Placement().check_invariants(t, 512); }},
      {"replay_trace", [](const Trace& t) { replay_trace(t, PoolOptions(), 1); }},
  };
}

TEST(TraceValidation, EveryConsumerRefusesAnOutOfRangeOpId) {
  Trace t = four_op_trace();
  t.tensors[2].freed_after_op = 100000000;  // the probe: out of range, built field by field
  for (const auto& [name, consume] : consumers()) {
    SCOPED_TRACE(name);
    expect_words(error_of([&] { consume(t); }), {"tensors[2]", "freed_after_op", "100000000"});
  }
}

TEST(TraceValidation, EveryConsumerRefusesAProducerOutOfRange) {
  Trace t = four_op_trace();
  t.tensors[1].producer_op = 4;
  t.tensors[1].uses = {};
  t.tensors[1].freed_after_op = kAfterStep;
  for (const auto& [name, consume] : consumers()) {
    SCOPED_TRACE(name);
    expect_words(error_of([&] { consume(t); }), {"tensors[1]", "producer_op", "4"});
  }
}

TEST(TraceValidation, BytesAtInt64MaxAreRefusedNotANegativePeak) {
  Trace t = four_op_trace();
  t.tensors[1].bytes = kInt64Max;
  for (const auto& [name, consume] : consumers()) {
    SCOPED_TRACE(name);
    expect_words(error_of([&] { consume(t); }), {"tensors[1]", "'bytes'", "2^62"});
  }
}

TEST(TraceValidation, SeveralBytesOf2To62AreRefusedByTheirSum) {
  Trace t = four_op_trace();
  for (auto& r : t.tensors) r.bytes = int64_t{1} << 62;  // each within the bound; the sum overflows
  expect_words(error_of([&] { t.peak_bytes(); }), {"tensors[1]", "'bytes'", "together", "overflow"});
  expect_words(error_of([&] { t.activation_bytes(); }), {"tensors[1]", "'bytes'"});
}

TEST(TraceValidation, BytesSummingExactlyToTheBoundAreExact) {
  Trace t = four_op_trace();
  const int64_t quarter = kMaxTraceBytes / 4;
  for (auto& r : t.tensors) r.bytes = quarter;
  ASSERT_NO_THROW(t.validate());
  EXPECT_EQ(t.bytes_of_kind(TensorKind::kActivation), 2 * quarter);
  // Op 3 holds the parameter, activation 1 and the gradient; op 1 and 2 hold 3 as well.
  EXPECT_EQ(t.peak_bytes(), 3 * quarter);
  EXPECT_GT(t.peak_bytes(), 0);
  t.tensors[3].bytes = quarter + 1;
  expect_words(error_of([&] { t.validate(); }), {"tensors[3]", "'bytes'"});
}

TEST(TraceValidation, OpBytesReadPlusWrittenMustFit) {
  Trace t = four_op_trace();
  t.ops[2].bytes_read = kInt64Max;
  t.ops[2].bytes_written = 1;
  expect_words(error_of([&] { t.validate(); }), {"ops[2]", "bytes_read", "bytes_written"});
  EXPECT_FALSE(error_of([&] { simulate(t, Plan(), DeviceModel()); }).empty());
}

TEST(TraceValidation, OpNumbersMustBeFiniteAndBounded) {
  struct Case {
    const char* field;
    double value;
    const char* word;
  };
  const double inf = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (const Case& c : {Case{"flops", inf, "finite"}, Case{"flops", nan, "finite"}, Case{"flops", 1e31, "bound"},
                        Case{"flops", -1.0, "negative"}, Case{"duration_us", inf, "finite"},
                        Case{"duration_us", nan, "finite"}, Case{"duration_us", 1e16, "bound"},
                        Case{"duration_us", -inf, "negative"}}) {
    SCOPED_TRACE(std::string(c.field) + "=" + std::to_string(c.value));
    Trace t = four_op_trace();
    (std::string(c.field) == "flops" ? t.ops[1].flops : t.ops[1].duration_us) = c.value;
    expect_words(error_of([&] { t.validate(); }), {"ops[1]", c.field, c.word});
    expect_words(error_of([&] { make_plan(t, DeviceModel(), kInt64Max, "dp"); }), {"ops[1]", c.field});
  }
  Trace t = four_op_trace();
  t.ops[1].flops = kMaxOpFlops;
  t.ops[1].duration_us = kMaxOpDurationUs;
  EXPECT_NO_THROW(t.validate());
}

TEST(TraceValidation, NamesMustBeUtf8) {
  const std::string bad = "lin\xff";
  struct Case {
    const char* record;
    const char* field;
    std::function<void(Trace&)> set;
  };
  const Case cases[] = {
      {"ops[1]", "name", [&](Trace& t) { t.ops[1].name = bad; }},
      {"ops[2]", "module_path", [&](Trace& t) { t.ops[2].module_path = bad; }},
      {"tensors[3]", "dtype", [&](Trace& t) { t.tensors[3].dtype = bad; }},
      {"tensors[0]", "label", [&](Trace& t) { t.tensors[0].label = bad; }},
      {"the top level", "device", [&](Trace& t) { t.device = bad; }},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.field);
    Trace t = four_op_trace();
    c.set(t);
    expect_words(error_of([&] { t.validate(); }), {c.record, c.field, "UTF-8"});
    // trace_to_json would otherwise throw nlohmann's bare "invalid UTF-8 byte".
    expect_words(error_of([&] { trace_to_json(t); }), {c.record, c.field, "UTF-8"});
  }
}

TEST(TraceValidation, Utf8Check) {
  EXPECT_TRUE(is_valid_utf8(""));
  EXPECT_TRUE(is_valid_utf8("layers.0.fc1"));
  EXPECT_TRUE(is_valid_utf8("caf\xc3\xa9"));               // é
  EXPECT_TRUE(is_valid_utf8("\xe2\x82\xac"));              // €
  EXPECT_TRUE(is_valid_utf8("\xf0\x9f\x98\x80"));          // U+1F600
  EXPECT_FALSE(is_valid_utf8("\xff"));
  EXPECT_FALSE(is_valid_utf8("\x80"));                     // continuation first
  EXPECT_FALSE(is_valid_utf8("\xc3"));                     // truncated
  EXPECT_FALSE(is_valid_utf8("\xc0\x80"));                 // overlong NUL
  EXPECT_FALSE(is_valid_utf8("\xe0\x80\xaf"));             // overlong '/'
  EXPECT_FALSE(is_valid_utf8("\xed\xa0\x80"));             // surrogate U+D800
  EXPECT_FALSE(is_valid_utf8("\xf4\x90\x80\x80"));         // above U+10FFFF
}

// JSON: the text a user edits. Errors nlohmann raises itself name the record and field too.
std::string json_error(const std::string& text) { return error_of([&] { trace_from_json(text); }); }

std::string good_json() { return trace_to_json(four_op_trace(), 1); }

// The good JSON with one value written as raw text that nlohmann cannot hold
// (1e400, 2^64 - 1): `set` puts a sentinel there, which is then replaced.
std::string with_raw(const std::function<void(nlohmann::json&, int64_t)>& set, const std::string& raw) {
  constexpr int64_t kSentinel = 987654321;
  nlohmann::json j = nlohmann::json::parse(good_json());
  set(j, kSentinel);
  std::string text = j.dump(1);
  const size_t at = text.find(std::to_string(kSentinel));
  EXPECT_NE(at, std::string::npos);
  return text.replace(at, std::to_string(kSentinel).size(), raw);
}

TEST(TraceValidationJson, FlopsBeyondADoubleNamesRecordAndField) {
  const std::string text = with_raw([](nlohmann::json& j, int64_t s) { j["ops"][2]["flops"] = s; }, "1e400");
  expect_words(json_error(text), {"ops[2]", "field 'flops'", "out of range", "finite"});
}

TEST(TraceValidationJson, NegativeDurationBeyondADoubleNamesRecordAndField) {
  const std::string text = with_raw([](nlohmann::json& j, int64_t s) { j["ops"][1]["duration_us"] = s; }, "-1e999");
  expect_words(json_error(text), {"ops[1]", "field 'duration_us'", "out of range"});
}

TEST(TraceValidationJson, UseBeyondADoubleNamesTheIndex) {
  const std::string text = with_raw([](nlohmann::json& j, int64_t s) { j["tensors"][1]["uses"] = {1, s}; }, "1e500");
  expect_words(json_error(text), {"tensors[1]", "field 'uses[1]'", "out of range"});
}

TEST(TraceValidationJson, FlopsAboveTheBoundNamesRecordAndField) {
  const std::string text = with_raw([](nlohmann::json& j, int64_t s) { j["ops"][3]["flops"] = s; }, "1e300");
  expect_words(json_error(text), {"ops[3]", "'flops'", "bound"});
}

TEST(TraceValidationJson, IntegerBeyondInt64IsNotWrappedNegative) {
  const std::string text =
      with_raw([](nlohmann::json& j, int64_t s) { j["tensors"][2]["bytes"] = s; }, "18446744073709551615");
  expect_words(json_error(text), {"tensors[2]", "'bytes'", "18446744073709551615", "64-bit"});
}

TEST(TraceValidationJson, BytesOverflowingTheSumAreRefused) {
  nlohmann::json j = nlohmann::json::parse(good_json());
  j["tensors"][0]["bytes"] = kInt64Max;
  expect_words(json_error(j.dump()), {"tensors[0]", "'bytes'", "2^62"});
  j["tensors"][0]["bytes"] = int64_t{1} << 62;
  j["tensors"][1]["bytes"] = int64_t{1} << 62;
  expect_words(json_error(j.dump()), {"tensors[1]", "'bytes'", "overflow"});
}

TEST(TraceValidationJson, InvalidUtf8NameNamesRecordAndField) {
  const std::string text = with_raw([](nlohmann::json& j, int64_t s) { j["ops"][1]["name"] = s; }, "\"op\xff\"");
  const std::string message = json_error(text);
  expect_words(message, {"ops[1]", "field 'name'", "UTF-8"});
  EXPECT_TRUE(is_valid_utf8(message)) << "the message quotes the bad bytes";
}

TEST(TraceValidationJson, LoneSurrogateEscapeNamesRecordAndField) {
  const std::string text =
      with_raw([](nlohmann::json& j, int64_t s) { j["ops"][3]["name"] = s; }, "\"op\\ud800\"");
  const std::string message = json_error(text);
  expect_words(message, {"ops[3]", "field 'name'"});
}

TEST(TraceValidationJson, OtherSyntaxErrorsSayWhere) {
  const std::string text =
      with_raw([](nlohmann::json& j, int64_t s) { j["ops"][2]["name"] = s; }, "op2");  // an unquoted name
  expect_words(json_error(text), {"not valid JSON", "ops[2]", "'name'"});
}

TEST(TraceValidationJson, VersionBeyondIntIsNotTruncated) {
  nlohmann::json j = nlohmann::json::parse(good_json());
  j["version"] = (int64_t{1} << 32) + 1;  // truncates to 1 in an int
  expect_words(json_error(j.dump()), {"version", "4294967297"});
}

}  // namespace
}  // namespace memsched
