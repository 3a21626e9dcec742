// Scalar math shared by every backend: each function is the single definition of
// an element-wise formula, compiled for host and (later) device code alike, so the
// CPU reference and a GPU kernel cannot drift apart.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define CTR_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define CTR_HOST_DEVICE inline
#endif

namespace ctr::math {

constexpr float kGeluC = 0.7978845608028654f;  // sqrt(2/pi)
constexpr float kGeluA = 0.044715f;

CTR_HOST_DEVICE float gelu(float x) {
  float u = kGeluC * (x + kGeluA * x * x * x);
  return 0.5f * x * (1.0f + tanhf(u));
}

CTR_HOST_DEVICE float gelu_grad(float x) {
  float x2 = x * x;
  float u = kGeluC * (x + kGeluA * x2 * x);
  float t = tanhf(u);
  float du = kGeluC * (1.0f + 3.0f * kGeluA * x2);
  return 0.5f * (1.0f + t) + 0.5f * x * (1.0f - t * t) * du;
}

// Exact GELU (torch's approximate="none"): x * Phi(x), Phi the normal CDF.
// d/dx = Phi(x) + x * phi(x), phi the normal density.
constexpr float kSqrtHalf = 0.7071067811865476f;     // 1/sqrt(2)
constexpr float kInvSqrtTwoPi = 0.3989422804014327f;  // 1/sqrt(2 pi)

CTR_HOST_DEVICE float gelu_exact(float x) { return 0.5f * x * (1.0f + erff(x * kSqrtHalf)); }

CTR_HOST_DEVICE float gelu_exact_grad(float x) {
  return 0.5f * (1.0f + erff(x * kSqrtHalf)) + x * kInvSqrtTwoPi * expf(-0.5f * x * x);
}

CTR_HOST_DEVICE float sigmoid(float x) { return 1.0f / (1.0f + expf(-x)); }

CTR_HOST_DEVICE float silu(float x) { return x * sigmoid(x); }

CTR_HOST_DEVICE float silu_grad(float x) {
  float s = sigmoid(x);
  return s * (1.0f + x * (1.0f - s));
}

// ---------------------------------------------------------------------------
// Element-wise unary ops (the file ops exp, log, tanh, erf, rsqrt, sqrt, neg,
// reciprocal, sigmoid, relu, clamp and pow). Each is a functor: value(x) is the op, grad(v)
// its derivative d value / dx written in terms of what the op's backward reads.
// That is the forward output y where the derivative is a function of y alone
// (exp, tanh, sigmoid, sqrt, rsqrt, reciprocal: one multiply instead of a
// transcendental, as PyTorch's backward formulas do), and the input x otherwise
// (log, erf, relu, clamp, pow); neg reads neither. They call libm, which is exact to about an
// ulp: these ops serve traced code, not the presets' hot loops.
//
// Nothing checks domains, here or in the kernels: log, sqrt and rsqrt need
// x > 0, reciprocal x != 0, and pow with a non-integer exponent x > 0; outside
// them the result is whatever libm gives (NaN or an infinity).

constexpr float kTwoOverSqrtPi = 1.1283791670955126f;  // 2/sqrt(pi)

struct Exp {
  CTR_HOST_DEVICE float value(float x) const { return expf(x); }
  CTR_HOST_DEVICE float grad(float y) const { return y; }
};

struct Log {
  CTR_HOST_DEVICE float value(float x) const { return logf(x); }
  CTR_HOST_DEVICE float grad(float x) const { return 1.0f / x; }
};

struct Tanh {
  CTR_HOST_DEVICE float value(float x) const { return tanhf(x); }
  CTR_HOST_DEVICE float grad(float y) const { return 1.0f - y * y; }
};

struct Erf {
  CTR_HOST_DEVICE float value(float x) const { return erff(x); }
  CTR_HOST_DEVICE float grad(float x) const { return kTwoOverSqrtPi * expf(-x * x); }
};

// 1 / sqrt(x); d/dx = -x^(-3/2) / 2 = -y^3 / 2.
struct Rsqrt {
  CTR_HOST_DEVICE float value(float x) const { return 1.0f / sqrtf(x); }
  CTR_HOST_DEVICE float grad(float y) const { return -0.5f * y * y * y; }
};

struct Sqrt {
  CTR_HOST_DEVICE float value(float x) const { return sqrtf(x); }
  CTR_HOST_DEVICE float grad(float y) const { return 0.5f / y; }
};

struct Neg {
  CTR_HOST_DEVICE float value(float x) const { return -x; }
  CTR_HOST_DEVICE float grad(float) const { return -1.0f; }
};

// 1 / x; d/dx = -1 / x^2 = -y^2.
struct Reciprocal {
  CTR_HOST_DEVICE float value(float x) const { return 1.0f / x; }
  CTR_HOST_DEVICE float grad(float y) const { return -y * y; }
};

struct Sigmoid {
  CTR_HOST_DEVICE float value(float x) const { return sigmoid(x); }
  CTR_HOST_DEVICE float grad(float y) const { return y * (1.0f - y); }
};

// max(x, 0), NaN kept; d/dx = 1 where x > 0, else 0 (at 0 too, as PyTorch's
// threshold_backward gives).
struct Relu {
  CTR_HOST_DEVICE float value(float x) const { return x < 0.0f ? 0.0f : x; }
  CTR_HOST_DEVICE float grad(float x) const { return x > 0.0f ? 1.0f : 0.0f; }
};

// x held to [lo, hi] (an infinite bound: none), NaN kept; d/dx = 1 where
// lo <= x <= hi, bounds included, as PyTorch's clamp_backward gives.
struct Clamp {
  float lo, hi;
  CTR_HOST_DEVICE float value(float x) const { return x < lo ? lo : (x > hi ? hi : x); }
  CTR_HOST_DEVICE float grad(float x) const { return x >= lo && x <= hi ? 1.0f : 0.0f; }
};

// x^p; d/dx = p x^(p-1) (powf handles negative x for integer p).
struct Pow {
  float p;
  CTR_HOST_DEVICE float value(float x) const { return powf(x, p); }
  CTR_HOST_DEVICE float grad(float x) const { return p * powf(x, p - 1.0f); }
};

// ---------------------------------------------------------------------------
// Forms that vectorise. A libm call (expf, tanhf) keeps a CPU loop scalar unless the
// whole build uses -ffast-math, so the CPU kernels use these instead; each equals
// its counterpart above in exact arithmetic and differs by a few float ulps.

// A fused multiply-add where the target has one; a libm fmaf without hardware
// support would be a slow software routine.
CTR_HOST_DEVICE float fmadd(float a, float b, float c) {
#if defined(__CUDA_ARCH__) || defined(__FMA__)
  return fmaf(a, b, c);
#else
  return a * b + c;
#endif
}

CTR_HOST_DEVICE float bits_to_float(int32_t i) {
#if defined(__CUDA_ARCH__)
  return __int_as_float(i);
#else
  float f;
  std::memcpy(&f, &i, sizeof f);
  return f;
#endif
}

// exp(x) by x = n ln2 + r, |r| <= ln2/2, and the degree-7 Taylor polynomial of e^r,
// whose truncation error (< 1e-8 relative) is below float rounding. Results that
// would be subnormal flush to 0, large inputs saturate at exp(88.3) instead of
// overflowing, and NaN propagates.
CTR_HOST_DEVICE float exp_fast(float x) {
  const float hi = 88.3f, lo = -87.3f;
  float xc = x > hi ? hi : x;
  xc = xc < lo ? lo : xc;
  // Adding 1.5 * 2^23 rounds to the nearest integer in the current (nearest) mode.
  const float shifter = 12582912.0f;
  float n = fmadd(xc, 1.44269504088896341f, shifter) - shifter;
  // ln2 split in two so that r keeps its low bits (Cody and Waite): the high part
  // has enough trailing zero bits that n * hi is exact for every |n| <= 127.
  float r = fmadd(-n, 0.693145751953125f, xc);
  r = fmadd(-n, 1.42860682030941723e-6f, r);
  float p = 1.0f / 5040.0f;
  p = fmadd(p, r, 1.0f / 720.0f);
  p = fmadd(p, r, 1.0f / 120.0f);
  p = fmadd(p, r, 1.0f / 24.0f);
  p = fmadd(p, r, 1.0f / 6.0f);
  p = fmadd(p, r, 0.5f);
  p = fmadd(p, r, 1.0f);
  p = fmadd(p, r, 1.0f);
  // NaN has no integer value (converting it is undefined behaviour); any
  // exponent does, since p is already NaN and carries it into y.
  const float nn = n == n ? n : 0.0f;
  float s = bits_to_float((static_cast<int32_t>(nn) + 127) << 23);
  float y = p * s;
  return x < lo ? 0.0f : y;
}

CTR_HOST_DEVICE float sigmoid_fast(float x) { return 1.0f / (1.0f + exp_fast(-x)); }

// tanh(x): sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) where |x| >= 1/4 (1 - e >= 0.39,
// no cancellation), else the odd Taylor series to x^9 (its remainder, below 62/2835 x^11,
// is under 3e-8 of x there). Both are computed and one selected, so a loop vectorises.
CTR_HOST_DEVICE float tanh_fast(float x) {
  const float a = x < 0.0f ? -x : x;
  const float e = exp_fast(-2.0f * a);
  float big = (1.0f - e) / (1.0f + e);
  big = x < 0.0f ? -big : big;
  const float x2 = x * x;
  float p = fmadd(x2, 62.0f / 2835.0f, -17.0f / 315.0f);
  p = fmadd(p, x2, 2.0f / 15.0f);
  p = fmadd(p, x2, -1.0f / 3.0f);
  const float small = fmadd(x * x2, p, x);
  return a < 0.25f ? small : big;
}

// 0.5 (1 + tanh(u)) = sigmoid(2u), so gelu(x) = x * sigmoid(2u): no cancellation
// for large negative x. The derivatives use 1 + t = 2s, 1 - t^2 = 4 s (1 - s), and
// take 1 - s as e * s with e = exp(-z), s = 1 / (1 + e), which stays accurate when
// s is close to 1 (1.0f - s would keep only the few bits left after cancellation).
CTR_HOST_DEVICE float gelu_fast(float x) {
  float u = kGeluC * fmadd(kGeluA * x, x * x, x);
  return x * sigmoid_fast(2.0f * u);
}

CTR_HOST_DEVICE float gelu_grad_fast(float x) {
  float x2 = x * x;
  float u = kGeluC * fmadd(kGeluA * x, x2, x);
  float e = exp_fast(-2.0f * u);
  float s = 1.0f / (1.0f + e);
  float du = kGeluC * fmadd(3.0f * kGeluA, x2, 1.0f);
  return fmadd(2.0f * x * du, s * (e * s), s);
}

CTR_HOST_DEVICE float silu_fast(float x) { return x * sigmoid_fast(x); }

// The normal CDF Phi(x) = erfc(-x / sqrt 2) / 2, with erfc(z), z >= 0, as
// t exp(-z^2 + P(t)), t = 1 / (1 + z/2) (the Chebyshev fit of Numerical Recipes,
// relative error below 1.2e-7 for every z >= 0; evaluated in float, within
// 1.5e-6 relative): for x < 0 Phi is that term itself, so the left tail keeps
// its relative accuracy; for x >= 0 it is one minus it. No libm call, so the
// loops over it vectorise.
CTR_HOST_DEVICE float normal_cdf_fast(float x) {
  const float z = (x < 0.0f ? -x : x) * kSqrtHalf;
  const float t = 1.0f / fmadd(0.5f, z, 1.0f);
  float p = 0.17087277f;
  p = fmadd(p, t, -0.82215223f);
  p = fmadd(p, t, 1.48851587f);
  p = fmadd(p, t, -1.13520398f);
  p = fmadd(p, t, 0.27886807f);
  p = fmadd(p, t, -0.18628806f);
  p = fmadd(p, t, 0.09678418f);
  p = fmadd(p, t, 0.37409196f);
  p = fmadd(p, t, 1.00002368f);
  p = fmadd(p, t, -1.26551223f);
  const float half_erfc = 0.5f * t * exp_fast(fmadd(-z, z, p));
  return x < 0.0f ? half_erfc : 1.0f - half_erfc;
}

// Exact GELU and its derivative on normal_cdf_fast (the CPU kernels' form).
CTR_HOST_DEVICE float gelu_exact_fast(float x) { return x * normal_cdf_fast(x); }

CTR_HOST_DEVICE float gelu_exact_grad_fast(float x) {
  return fmadd(x * kInvSqrtTwoPi, exp_fast(-0.5f * x * x), normal_cdf_fast(x));
}

CTR_HOST_DEVICE float silu_grad_fast(float x) {
  float e = exp_fast(-x);
  float s = 1.0f / (1.0f + e);
  return s * fmadd(x, e * s, 1.0f);
}

}  // namespace ctr::math
