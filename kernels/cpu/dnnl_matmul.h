// One matrix product on oneDNN's matmul primitive, on the calling thread: the
// engine under gemm.cc's products in f32 and bf16 alike.
//
// oneDNN picks its code at run time from cpuid (features.cc caps it where
// CTR_CPU_FEATURES turns features off): brgemm kernels for AVX-512 or AVX2 in
// f32; AMX tile products where the CPU has them, AVX512_BF16 dot products
// otherwise, in bf16. It runs single-threaded here (its OpenMP team is kept to
// one thread on every thread that calls it); gemm.cc cuts large products over
// the process pool itself.
#pragma once

#include <cstdint>
#include <string>

namespace ctr::cpu::dnnl_mm {

enum class Type : uint8_t { f32, bf16 };

// C[M,N] = alpha op(A) op(B) (+ bias[N]) + beta C, row-major with row strides
// lda/ldb/ldc; A and B of type `in`, C and bias of type `out` (bf16 C only
// with beta 0, a bias only with alpha 1 and beta 0). M, N and K are positive.
struct Product {
  Type in, out;
  bool ta, tb;
  int64_t M, N, K;
  float alpha;
  const void *A;
  int64_t lda;
  const void *B;
  int64_t ldb;
  float beta;
  void *C;
  int64_t ldc;
  const void *bias;
};

enum class Outcome : uint8_t {
  done,
  // oneDNN has only its reference implementation for this product (no JIT
  // code for the CPU): the caller runs it another way.
  declined,
  failed,
};

// Never throws (it runs on the pool's threads); on `failed`, *error says why.
Outcome run(const Product &p, std::string *error);

}  // namespace ctr::cpu::dnnl_mm
