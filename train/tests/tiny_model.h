// The tiny GPT the trainer tests train: 2 blocks of width 32 (4 heads), 16 positions.
#pragma once

#include "train/gpt.h"

namespace zinf::train {

inline GptConfig TinyModel() {
  GptConfig c;
  c.layers = 2;
  c.d_model = 32;
  c.heads = 4;
  c.max_seq = 16;
  c.name = "test";
  return c;
}

}  // namespace zinf::train
