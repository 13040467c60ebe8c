// test_trace_rng.cpp -- Op::rng: derived from the op name by default, an
// optional JSON field written only where it differs from that default, and a
// wrong type named with its field.
#include <gtest/gtest.h>

#include <string>

#include <nlohmann/json.hpp>

#include "core/check.h"
#include "core/trace.h"
#include "core/trace_json.h"

namespace memsched {
namespace {

TEST(TraceRng, DerivedFromTheNameAndOptionalInJson) {
  for (const char* name : {"aten::native_dropout", "aten::bernoulli_", "aten::randn", "aten::rrelu_with_noise",
                           "aten::normal_", "Dropout"})
    EXPECT_TRUE(is_rng_op_name(name)) << name;
  for (const char* name : {"aten::linear", "aten::layer_norm", "aten::native_batch_norm", "aten::relu", ""})
    EXPECT_FALSE(is_rng_op_name(name)) << name;
  Trace t;
  for (const char* name : {"aten::linear", "my_custom_op", "aten::native_dropout"}) {
    Op op;
    op.id = static_cast<int64_t>(t.ops.size());
    op.name = name;
    op.rng = is_rng_op_name(name);
    t.ops.push_back(op);
  }
  t.ops[1].rng = true;  // a custom op the name does not reveal
  const std::string text = trace_to_json(t);
  ASSERT_NE(text.find("\"rng\":true"), std::string::npos);
  EXPECT_EQ(text.find("\"rng\":true"), text.rfind("\"rng\":true"));  // written once: only where not the default
  EXPECT_EQ(text.find("\"rng\":false"), std::string::npos);
  const Trace back = trace_from_json(text);
  for (size_t i = 0; i < t.ops.size(); ++i) EXPECT_EQ(back.ops[i].rng, t.ops[i].rng) << "op " << i;
  // A version-1 file without the field: derived from the name.
  nlohmann::json j = nlohmann::json::parse(text);
  for (auto& op : j["ops"]) op.erase("rng");
  const Trace old = trace_from_json(j.dump());
  EXPECT_FALSE(old.ops[1].rng);
  EXPECT_TRUE(old.ops[2].rng);
  j["ops"][2]["rng"] = "yes";
  try {
    trace_from_json(j.dump());
    FAIL() << "expected an error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("ops[2] field 'rng' must be true or false"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace memsched
