// The emulated CUDA device (tests/cuda_emu): the data types of the CUDA math
// libraries, with the toolkit's numbers.
#pragma once

typedef enum cudaDataType_t {
  CUDA_R_32F = 0,
  CUDA_R_64F = 1,
  CUDA_R_16F = 2,
  CUDA_R_16BF = 14,
} cudaDataType_t;
