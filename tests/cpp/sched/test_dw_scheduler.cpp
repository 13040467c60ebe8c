// Tests for core/dw_scheduler: contribution counting (tied weights, a layer
// called twice), byte-limit flushes, priority order, DDP bucket readiness, clear
// errors, and a random operation sequence against a simple reference model.
#include <gtest/gtest.h>

#include <map>
#include <random>
#include <set>
#include <vector>

#include "core/check.h"
#include "core/dw_scheduler.h"

namespace memsched {
namespace {

std::vector<int64_t> drain(DwScheduler& s) {
  std::vector<int64_t> order;
  for (int64_t id = s.pop(); id >= 0; id = s.pop()) {
    order.push_back(id);
    s.complete(id);
    s.check_invariants();
  }
  return order;
}

TEST(DwScheduler, SingleUseParamsAreFinalAfterTheirItem) {
  DwScheduler s;
  const int32_t w = s.add_param(400);
  const int32_t b = s.add_param(40);
  s.begin_iteration();
  s.expect_contribution(w);
  s.expect_contribution(b);
  const int64_t id = s.enqueue({w, b}, 1000);
  EXPECT_EQ(s.held_bytes(), 1000);
  EXPECT_FALSE(s.is_final(w));
  EXPECT_EQ(s.next_urgent(), -1);  // no limit, no buckets: nothing is urgent
  EXPECT_EQ(s.pop(), id);
  EXPECT_EQ(s.held_bytes(), 1000);  // in flight still holds its inputs
  DwCompletion c = s.complete(id);
  EXPECT_EQ(c.final_params, (std::vector<int32_t>{w, b}));
  EXPECT_TRUE(c.ready_buckets.empty());
  EXPECT_EQ(s.held_bytes(), 0);
  EXPECT_TRUE(s.is_final(w));
  s.end_iteration();
  s.check_invariants();
}

TEST(DwScheduler, TiedWeightIsFinalOnlyAfterEveryContribution) {
  // Embedding (autograd path) + LM head (deferred) share one weight; a second
  // Linear is called twice.
  DwScheduler s;
  const int32_t tied = s.add_param(1000);
  const int32_t twice = s.add_param(100);
  s.begin_iteration();
  s.expect_contribution(tied);   // embedding use (autograd accumulates once)
  s.expect_contribution(twice);  // call 1
  s.expect_contribution(twice);  // call 2
  s.expect_contribution(tied);   // head use (deferred)
  const int64_t head = s.enqueue({tied}, 64);
  const int64_t call2 = s.enqueue({twice}, 32);
  const int64_t call1 = s.enqueue({twice}, 32);
  // call2 and call1 each leave one contribution missing for `twice` (1 and 0
  // after the other) -- the head item leaves `tied` missing one: all have
  // missing_after 1 at first, so the biggest held bytes go first.
  EXPECT_EQ(s.pop(), head);
  EXPECT_TRUE(s.complete(head).final_params.empty());
  EXPECT_FALSE(s.is_final(tied));
  EXPECT_EQ(s.pop(), call2);
  EXPECT_TRUE(s.complete(call2).final_params.empty());
  EXPECT_EQ(s.pop(), call1);
  EXPECT_EQ(s.complete(call1).final_params, std::vector<int32_t>{twice});
  EXPECT_EQ(s.contribute(tied).final_params, std::vector<int32_t>{tied});
  s.end_iteration();
}

TEST(DwScheduler, ItemThatFinishesAParameterRunsBeforeOneThatDoesNot) {
  DwScheduler s;
  const int32_t a = s.add_param(10);
  const int32_t b = s.add_param(10);
  s.begin_iteration();
  s.expect_contribution(a);
  s.expect_contribution(a);
  s.expect_contribution(b);
  const int64_t a1 = s.enqueue({a}, 500);  // a still misses one after this
  const int64_t b1 = s.enqueue({b}, 100);  // b final after this
  EXPECT_EQ(drain(s), (std::vector<int64_t>{b1, a1}));
  const int64_t a2 = s.enqueue({a}, 1);
  EXPECT_EQ(drain(s), std::vector<int64_t>{a2});
  s.end_iteration();
}

TEST(DwScheduler, FinishingAPartlyReceivedParameterGoesFirst) {
  DwScheduler s;
  const int32_t tied = s.add_param(1000);
  const int32_t other = s.add_param(10);
  s.begin_iteration();
  s.expect_contribution(tied);
  s.expect_contribution(tied);
  s.expect_contribution(other);
  const int64_t big = s.enqueue({other}, 5000);   // frees more held bytes
  const int64_t head = s.enqueue({tied}, 10);
  s.contribute(tied);                              // the embedding's gradient is in: 1000 B held
  EXPECT_EQ(drain(s), (std::vector<int64_t>{head, big}));
  s.end_iteration();
}

TEST(DwScheduler, ByteLimitMakesTheBestItemUrgent) {
  DwScheduler s(/*max_deferred_bytes=*/250);
  std::vector<int32_t> p;
  for (int i = 0; i < 4; ++i) p.push_back(s.add_param(8));
  s.begin_iteration();
  for (int32_t q : p) s.expect_contribution(q);
  s.enqueue({p[0]}, 100);
  EXPECT_EQ(s.next_urgent(), -1);
  const int64_t big = s.enqueue({p[1]}, 120);
  EXPECT_EQ(s.next_urgent(), -1);  // 220 <= 250
  s.enqueue({p[2]}, 50);            // 270 > 250
  const int64_t u = s.next_urgent();
  EXPECT_EQ(u, big);  // frees the most bytes
  EXPECT_EQ(s.stats().limit_flushes, 1);
  s.complete(u);
  EXPECT_EQ(s.held_bytes(), 150);
  EXPECT_EQ(s.next_urgent(), -1);
  EXPECT_EQ(s.stats().peak_held_bytes, 270);
  s.enqueue({p[3]}, 10);
  drain(s);
  s.end_iteration();
  EXPECT_EQ(s.stats().enqueued, 4);
  EXPECT_EQ(s.stats().completed, 4);
}

TEST(DwScheduler, ZeroLimitRunsEverythingAtOnce) {
  DwScheduler s(0);
  const int32_t w = s.add_param(8);
  s.begin_iteration();
  s.expect_contribution(w);
  const int64_t id = s.enqueue({w}, 1);
  EXPECT_EQ(s.next_urgent(), id);
  s.complete(id);
  s.end_iteration();
}

TEST(DwScheduler, NextBucketIsCompletedFirstAndLaterBucketsWait) {
  // Buckets as DDP builds them: bucket 0 holds the last layers (ready first).
  DwScheduler s;
  const int32_t w3 = s.add_param(10, 0), b3 = s.add_param(1, 0);
  const int32_t w2 = s.add_param(10, 1);
  const int32_t w1 = s.add_param(10, 1), ln = s.add_param(1, 1);  // ln: autograd path
  s.begin_iteration();
  for (int32_t p : {w1, ln, w2, w3, b3}) s.expect_contribution(p);
  const int64_t i3 = s.enqueue({w3, b3}, 100);
  // bucket 0 is complete once i3 runs: urgent at once.
  EXPECT_EQ(s.next_urgent(), i3);
  EXPECT_EQ(s.next_urgent(), -1);
  DwCompletion c = s.complete(i3);
  EXPECT_EQ(c.ready_buckets, std::vector<int32_t>{0});
  EXPECT_TRUE(s.bucket_ready(0));
  const int64_t i2 = s.enqueue({w2}, 100);
  EXPECT_EQ(s.next_urgent(), -1);  // bucket 1 still misses w1 and ln
  const int64_t i1 = s.enqueue({w1}, 100);
  EXPECT_EQ(s.next_urgent(), -1);  // ln (autograd) not in yet
  EXPECT_TRUE(s.contribute(ln).ready_buckets.empty());
  const int64_t u1 = s.next_urgent();
  const int64_t u2 = s.next_urgent();
  EXPECT_EQ(std::set<int64_t>({u1, u2}), std::set<int64_t>({i1, i2}));
  EXPECT_TRUE(s.complete(u1).ready_buckets.empty());
  EXPECT_EQ(s.complete(u2).ready_buckets, std::vector<int32_t>{1});
  s.end_iteration();
}

TEST(DwScheduler, PopPrefersTheEarliestUnreadyBucket) {
  DwScheduler s;
  const int32_t late = s.add_param(10, 1);
  const int32_t early = s.add_param(10, 0);
  const int32_t early2 = s.add_param(10, 0);
  s.begin_iteration();
  for (int32_t p : {late, early, early2}) s.expect_contribution(p);
  const int64_t il = s.enqueue({late}, 1000);
  const int64_t ie = s.enqueue({early}, 1);
  EXPECT_EQ(s.next_urgent(), -1);  // bucket 0 misses early2
  EXPECT_EQ(s.pop(), ie);
  s.complete(ie);
  EXPECT_EQ(s.pop(), il);
  s.complete(il);
  s.enqueue({early2}, 1);
  drain(s);
  s.end_iteration();
}

TEST(DwScheduler, ClearErrors) {
  DwScheduler s;
  const int32_t w = s.add_param(8);
  EXPECT_THROW(s.add_param(-1), Error);
  EXPECT_THROW(s.expect_contribution(w), Error);  // before begin_iteration
  s.begin_iteration();
  EXPECT_THROW(s.expect_contribution(7), Error);
  s.expect_contribution(w);
  s.enqueue({w}, 8);
  try {
    s.enqueue({w}, 8);
    FAIL() << "a second contribution for one counted use must throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expect_contribution"), std::string::npos) << e.what();
  }
  EXPECT_THROW(s.complete(12345), Error);
  try {
    s.end_iteration();
    FAIL() << "ending with queued work must throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("flush"), std::string::npos) << e.what();
  }
  EXPECT_THROW(s.begin_iteration(), Error);
  drain(s);
  s.end_iteration();
  s.begin_iteration();
  s.expect_contribution(w);
  EXPECT_THROW(s.end_iteration(), Error);  // expected 1, received 0
}

TEST(DwScheduler, AllowMissingReturnsTheShortParameters) {
  DwScheduler s;
  const int32_t a = s.add_param(8), b = s.add_param(8), c = s.add_param(8);
  s.begin_iteration();
  for (int32_t p : {a, b, b, c}) s.expect_contribution(p);
  s.contribute(a);
  s.contribute(b);  // the second use of b never reached the loss; c not at all
  EXPECT_EQ(s.end_iteration(/*allow_missing=*/true), (std::vector<int32_t>{b, c}));
  s.begin_iteration();  // counts start again from zero
  EXPECT_EQ(s.expected(b), 0);
  EXPECT_EQ(s.received(b), 0);
}

TEST(DwScheduler, GapInBucketNumbersIsRejected) {
  DwScheduler s;
  s.add_param(8, 1);
  EXPECT_THROW(s.begin_iteration(), Error);
}

// A random sequence of enqueue / urgent / pop / complete / contribute against a
// reference that counts by hand; check_invariants after every operation.
TEST(DwScheduler, RandomSequencesAgreeWithReference) {
  std::mt19937 rng(7);
  for (int round = 0; round < 50; ++round) {
    const int n = 1 + static_cast<int>(rng() % 8);
    const int buckets = static_cast<int>(rng() % 3);
    const int64_t limit = (rng() % 2) ? -1 : static_cast<int64_t>(rng() % 500);
    DwScheduler s(limit);
    std::vector<int32_t> bucket(n, -1);
    for (int p = 0; p < n; ++p) {
      if (buckets > 0) bucket[p] = (p < buckets) ? p : static_cast<int32_t>(rng() % buckets);
      s.add_param(8, bucket[p]);
    }
    for (int iter = 0; iter < 3; ++iter) {
      s.begin_iteration();
      std::vector<int> uses(n), deferred(n), received(n, 0);
      for (int p = 0; p < n; ++p) {
        uses[p] = 1 + static_cast<int>(rng() % 3);
        deferred[p] = static_cast<int>(rng() % (uses[p] + 1));  // rest: one autograd contribution
        if (uses[p] - deferred[p] > 1) deferred[p] = uses[p] - 1;
        for (int u = 0; u < uses[p]; ++u) s.expect_contribution(p);
      }
      std::vector<int> to_enqueue;
      for (int p = 0; p < n; ++p)
        for (int d = 0; d < deferred[p]; ++d) to_enqueue.push_back(p);
      std::shuffle(to_enqueue.begin(), to_enqueue.end(), rng);
      std::map<int64_t, int32_t> param_of;
      std::set<int32_t> final_seen, ready_seen;
      auto record = [&](const DwCompletion& c) {
        for (int32_t p : c.final_params) {
          EXPECT_TRUE(final_seen.insert(p).second);
          EXPECT_EQ(received[p], uses[p]);
        }
        for (int32_t b : c.ready_buckets) {
          EXPECT_TRUE(ready_seen.insert(b).second);
          for (int p = 0; p < n; ++p)
            if (bucket[p] == b) EXPECT_EQ(received[p], uses[p]);
        }
      };
      auto run = [&](int64_t id) {
        received[param_of.at(id)] += 1;
        record(s.complete(id));
        param_of.erase(id);
      };
      for (int32_t p : to_enqueue) {
        const int64_t id = s.enqueue({p}, static_cast<int64_t>(rng() % 200));
        param_of[id] = p;
        for (int64_t u = s.next_urgent(); u >= 0; u = s.next_urgent()) run(u);
        if (limit >= 0) EXPECT_LE(s.held_bytes(), limit);
        s.check_invariants();
      }
      for (int p = 0; p < n; ++p) {
        if (uses[p] > deferred[p]) {
          received[p] += 1;
          record(s.contribute(p));
          s.check_invariants();
        }
      }
      for (int64_t id = s.pop(); id >= 0; id = s.pop()) run(id);
      s.end_iteration();
      s.check_invariants();
      EXPECT_EQ(static_cast<int>(final_seen.size()), n);
      EXPECT_EQ(static_cast<int>(ready_seen.size()), s.num_buckets());
    }
  }
}

}  // namespace
}  // namespace memsched
