// LossScaler: DeepSpeed's dynamic loss scaling step by step (the window, the hysteresis, the
// floor), the static scale, and a state restored elsewhere continuing the same.
#include "engine/core/loss_scaler.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "tests/engine_test_model.h"

namespace zinf {
namespace {

LossScaleSettings Dynamic(int power, uint64_t window, int hysteresis, double min_scale = 1,
                          bool consecutive = false) {
  LossScaleSettings s;
  s.initial_scale_power = power;
  s.window = window;
  s.hysteresis = hysteresis;
  s.min_scale = min_scale;
  s.consecutive_hysteresis = consecutive;
  return s;
}

TEST(LossScalerTest, TheScaleDoublesAfterEachWindowWithoutOverflow) {
  LossScaler l(LossScaleSettings{});  // DeepSpeed's defaults: 2^16, window 1000, hysteresis 2
  EXPECT_EQ(l.scale(), 65536.0);
  for (int i = 0; i < 1000; ++i) ASSERT_TRUE(l.Update(false).ok());
  EXPECT_EQ(l.scale(), 65536.0);
  ASSERT_TRUE(l.Update(false).ok());  // the step after 1000 without overflow
  EXPECT_EQ(l.scale(), 131072.0);
  for (int i = 0; i < 1000; ++i) ASSERT_TRUE(l.Update(false).ok());
  EXPECT_EQ(l.scale(), 262144.0);
  EXPECT_EQ(l.skipped_steps(), 0u);
}

TEST(LossScalerTest, HysteresisTakesOverflowsBeforeTheScaleHalves) {
  LossScaler l(Dynamic(32, 4, 2));
  ASSERT_TRUE(l.Update(true).ok());  // taken by the hysteresis
  EXPECT_EQ(l.scale(), std::ldexp(1.0, 32));
  ASSERT_TRUE(l.Update(true).ok());  // halves
  EXPECT_EQ(l.scale(), std::ldexp(1.0, 31));
  ASSERT_TRUE(l.Update(true).ok());  // halves again: the hysteresis is used up until a window
  EXPECT_EQ(l.scale(), std::ldexp(1.0, 30));
  EXPECT_EQ(l.skipped_steps(), 3u);
  // The window counts from the last overflow: the step after 4 clean ones doubles and refills
  // the hysteresis.
  for (int i = 0; i < 4; ++i) ASSERT_TRUE(l.Update(false).ok());
  EXPECT_EQ(l.scale(), std::ldexp(1.0, 30));
  ASSERT_TRUE(l.Update(false).ok());
  EXPECT_EQ(l.scale(), std::ldexp(1.0, 31));
  ASSERT_TRUE(l.Update(true).ok());  // taken again
  EXPECT_EQ(l.scale(), std::ldexp(1.0, 31));
  EXPECT_EQ(l.skipped_steps(), 4u);
}

TEST(LossScalerTest, ConsecutiveHysteresisRefillsAfterEachCleanStep) {
  LossScaler l(Dynamic(10, 100, 2, 1, /*consecutive=*/true));
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(l.Update(true).ok());   // taken
    ASSERT_TRUE(l.Update(false).ok());  // refilled
  }
  EXPECT_EQ(l.scale(), 1024.0);
  ASSERT_TRUE(l.Update(true).ok());
  ASSERT_TRUE(l.Update(true).ok());  // two in a row: halves
  EXPECT_EQ(l.scale(), 512.0);
}

TEST(LossScalerTest, AnOverflowAtTheFloorFailsAndChangesNothing) {
  LossScaler l(Dynamic(2, 1000, 1, /*min_scale=*/1));
  ASSERT_TRUE(l.Update(true).ok());
  ASSERT_TRUE(l.Update(true).ok());
  EXPECT_EQ(l.scale(), 1.0);
  const LossScaler::State before = l.state();
  Status s = l.Update(true);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("fp16.min_loss_scale"), std::string::npos) << s.message();
  EXPECT_EQ(l.state().scale, before.scale);
  EXPECT_EQ(l.state().iteration, before.iteration);
  EXPECT_EQ(l.skipped_steps(), before.skipped_steps);
  // A start below the floor: an overflow lifts the scale to the floor (DeepSpeed's max), and
  // only an overflow at the floor fails.
  LossScaler low(Dynamic(0, 1000, 1, /*min_scale=*/4));
  EXPECT_EQ(low.scale(), 1.0);
  ASSERT_TRUE(low.Update(true).ok());
  EXPECT_EQ(low.scale(), 4.0);
  EXPECT_FALSE(low.Update(true).ok());
  // A floor that is not a power of two is kept, not passed.
  LossScaler odd(Dynamic(3, 1000, 1, /*min_scale=*/3));
  ASSERT_TRUE(odd.Update(true).ok());
  EXPECT_EQ(odd.scale(), 4.0);
  ASSERT_TRUE(odd.Update(true).ok());
  EXPECT_EQ(odd.scale(), 3.0);
  EXPECT_FALSE(odd.Update(true).ok());
}

TEST(LossScalerTest, AStaticScaleNeverMovesAndStillCountsSkippedSteps) {
  LossScaleSettings s;
  s.static_scale = 128;
  LossScaler l(s);
  EXPECT_FALSE(l.dynamic());
  for (int i = 0; i < 3000; ++i) ASSERT_TRUE(l.Update(i % 7 == 0).ok());
  EXPECT_EQ(l.scale(), 128.0);
  EXPECT_EQ(l.skipped_steps(), 429u);  // 0, 7, ..., 2996
}

// DeepSpeed's DynamicLossScaler.update_scale as its source reads (0.17.1 on), step for step:
// the oracle for a long run of overflows.
struct Oracle {
  double cur_scale, min_scale;
  int64_t cur_iter = 0, last_overflow_iter = -1;
  int delayed_shift, cur_hysteresis;
  uint64_t scale_window;
  bool consecutive;
  void update(bool overflow) {
    if (overflow) {
      if (delayed_shift == 1 || cur_hysteresis == 1) {
        cur_scale = std::max(cur_scale / 2, min_scale);
      } else {
        cur_hysteresis -= 1;
      }
      last_overflow_iter = cur_iter;
    } else {
      if (consecutive) cur_hysteresis = delayed_shift;
      const int64_t stable_interval = (cur_iter - last_overflow_iter) - 1;
      if (stable_interval > 0 && stable_interval % static_cast<int64_t>(scale_window) == 0) {
        if (!consecutive) cur_hysteresis = delayed_shift;
        cur_scale *= 2;
      }
    }
    cur_iter += 1;
  }
};

TEST(LossScalerTest, FollowsDeepSpeedsUpdateOverARandomRun) {
  for (bool consecutive : {false, true}) {
    for (int hysteresis : {1, 2, 3}) {
      const LossScaleSettings s = Dynamic(20, 7, hysteresis, std::ldexp(1.0, -200), consecutive);
      LossScaler l(s);
      Oracle o{std::ldexp(1.0, 20), s.min_scale, 0, -1, hysteresis, hysteresis, 7, consecutive};
      int halved = 0, doubled = 0;
      for (size_t i = 0; i < 5000; ++i) {
        // As in training: gradients overflow above some scale (2^24 here), and now and then
        // at any scale.
        const bool overflow = l.scale() > std::ldexp(1.0, 24) ||
                              testing::HashUniform(hysteresis, consecutive, i) > 0.94f;
        const double before = l.scale();
        ASSERT_TRUE(l.Update(overflow).ok()) << i;
        o.update(overflow);
        ASSERT_EQ(l.scale(), o.cur_scale) << "step " << i;
        halved += l.scale() < before;
        doubled += l.scale() > before;
      }
      // The run moved the scale both ways, often.
      EXPECT_GT(halved, 50);
      EXPECT_GT(doubled, 50);
    }
  }
}

TEST(LossScalerTest, ARestoredStateContinuesTheSame) {
  const LossScaleSettings s = Dynamic(16, 5, 2);
  LossScaler a(s), b(s);
  for (size_t i = 0; i < 37; ++i) ASSERT_TRUE(a.Update(testing::HashUniform(1, 2, i) > 0.5f).ok());
  ASSERT_TRUE(b.Restore(a.state()).ok());
  for (size_t i = 0; i < 200; ++i) {
    const bool overflow = testing::HashUniform(3, 4, i) > 0.7f;
    ASSERT_TRUE(a.Update(overflow).ok());
    ASSERT_TRUE(b.Update(overflow).ok());
    ASSERT_EQ(a.scale(), b.scale()) << i;
    ASSERT_EQ(a.skipped_steps(), b.skipped_steps());
  }
  LossScaler::State bad = a.state();
  bad.scale = NAN;
  EXPECT_EQ(b.Restore(bad).code(), StatusCode::kInvalidArgument);
  bad = a.state();
  bad.hysteresis_left = 0;
  EXPECT_EQ(b.Restore(bad).code(), StatusCode::kInvalidArgument);
  // A run resumed with a lower hysteresis than it saved under: taken as the new whole one.
  LossScaler::State higher = a.state();
  higher.hysteresis_left = 3;
  ASSERT_TRUE(b.Restore(higher).ok());
  EXPECT_EQ(b.state().hysteresis_left, 2);
  bad = a.state();
  bad.last_overflow = static_cast<int64_t>(bad.iteration);
  EXPECT_EQ(b.Restore(bad).code(), StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace zinf
