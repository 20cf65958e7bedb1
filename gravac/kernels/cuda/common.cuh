// Shared device helpers of gravac's CuPy kernels (docs/design.md section 13). Self-contained: NVRTC
// ships no standard headers, so fixed-width types and the 16-bit conversions are spelled out here
// (the conversions are the PTX instructions torch's own CUDA casts compile to, so results match
// torch bit for bit, NaN patterns included).

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

// 16-bit floats travel as their bit patterns.
struct half_t { u16 bits; };
struct bf16_t { u16 bits; };

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(double v) { return (float)v; }
__device__ __forceinline__ float to_float(half_t v) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
  return f;
}
__device__ __forceinline__ float to_float(bf16_t v) {
  return __uint_as_float(((u32)v.bits) << 16);
}

// Widening to the compute type C (float or double): exact for every input type.
template <typename C> __device__ __forceinline__ C widen(float v) { return (C)v; }
template <typename C> __device__ __forceinline__ C widen(double v) { return (C)v; }
template <typename C> __device__ __forceinline__ C widen(half_t v) { return (C)to_float(v); }
template <typename C> __device__ __forceinline__ C widen(bf16_t v) { return (C)to_float(v); }

template <typename T> __device__ __forceinline__ T narrow(float f);
template <> __device__ __forceinline__ float narrow<float>(float f) { return f; }
template <> __device__ __forceinline__ half_t narrow<half_t>(float f) {
  half_t h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
  return h;
}
template <> __device__ __forceinline__ bf16_t narrow<bf16_t>(float f) {
  bf16_t h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h.bits) : "f"(f));
  return h;
}

// lowbias32 finaliser (C. Wellons, hash-prospector), as gravac.kernels.quantize._mix32.
__device__ __forceinline__ u32 mix32(u32 z) {
  z ^= z >> 16;
  z *= 0x7FEB352Du;
  z ^= z >> 15;
  z *= 0x846CA68Bu;
  z ^= z >> 16;
  return z;
}

// 2^32 / golden ratio, negated mod 2^32: spreads consecutive positions (quantize._POSITION_MUL).
#define POSITION_MUL 0x61C88647u

// The hash of gravac.kernels.quantize.hash_signs' words (quantize._hash32).
__device__ __forceinline__ u32 position_hash(u32 bits, u64 pos, u32 seed_lo, u32 seed_hi) {
  u32 z = bits + (u32)pos * POSITION_MUL + seed_lo;
  return mix32(mix32(z) ^ seed_hi);
}

// The hash of gravac.kernels.quantize.hash_uniform (one multiply-xorshift-multiply round),
// before its top 24 bits are taken.
__device__ __forceinline__ u32 round_hash(u32 bits, u64 pos, u32 seed_lo, u32 seed_hi) {
  u32 z = bits ^ ((u32)pos * POSITION_MUL + (seed_lo ^ seed_hi));
  z *= 0x7FEB352Du;
  z ^= z >> 16;
  return z * 0x846CA68Bu;
}

__device__ __forceinline__ u32 bits32(float v) { return __float_as_uint(v); }
__device__ __forceinline__ u32 bits32(double v) {
  u64 b = (u64)__double_as_longlong(v);
  return (u32)b ^ (u32)(b >> 32);
}
