// THC compression fused into one pass (gravac.compressors.thc; Li et al., NSDI 2024), one CUDA
// block per rotation block of B = 2^log_b elements, the block held in shared memory:
//   v = x * sign                      Rademacher diagonal hashed from (position, sign seed)
//   r = H_B v * 2^(-log_b / 2)        butterflies h = 1, 2, ..., B/2, in torch's order
//   y = clamp(nan0(r * scale[blk]), +-t);  u = clamp((y + t) * kfac, 0, g)
//   z = SQ_T(u) with uniforms hashed from (bits(u), position, rounding seed)
//   out: table value T[z] in the lane type (levels), or z packed 8 / bits to a byte (packed).
// Every operation is the torch reference's, in its order and precision, so the payload is
// bit-identical. thc_encode_rotated reads an already rotated (and normalised) input of the
// compute type instead: the path for blocks larger than shared memory holds.

// Rademacher signs, 32 to a hash: the sign of position p is bit p % 32 of the hash of p / 32
// (gravac.kernels.quantize.hash_signs), -1 where it is set.
#define SIGNS_SHIFT 5
__device__ __forceinline__ u32 sign_word(u64 pos, u32 seed_lo, u32 seed_hi) {
  return position_hash(0u, pos >> SIGNS_SHIFT, seed_lo, seed_hi);
}
__device__ __forceinline__ float sign_of(u32 word, u64 pos) {
  return (word >> (pos & 31)) & 1u ? -1.0f : 1.0f;
}

// z = SQ_T(u) of one normalised rotated value r of block scale sc at padded position pos.
__device__ __forceinline__ float floor_c(float v) { return floorf(v); }
__device__ __forceinline__ double floor_c(double v) { return floor(v); }

// levels, inv_width: the table and the reciprocals of its interval widths in the compute type
// (gravac.kernels.quantize.table_intervals); cell_index: int32 (quantize.table_cells).
template <typename C>
__device__ __forceinline__ int thc_round(C r, C sc, i64 pos, C clamp, C kfac, C granularity,
                                         i64 lo_level, i64 hi_level,
                                         const C* __restrict__ levels,
                                         const C* __restrict__ inv_width,
                                         const int* __restrict__ cell_index, u32 round_lo,
                                         u32 round_hi) {
  C y = r * sc;
  if (y != y) y = (C)0;
  y = y < -clamp ? -clamp : (y > clamp ? clamp : y);
  C u = (y + clamp) * kfac;
  u = u < (C)0 ? (C)0 : (u > granularity ? granularity : u);
  float uni = (float)(round_hash(bits32(u), (u64)pos, round_lo, round_hi) >> 8) *
              (1.0f / 16777216.0f);
  // gravac.kernels.quantize.stochastic_quantize
  C lo = (C)lo_level, hi = (C)hi_level;
  C v = u < lo ? lo : (u > hi ? hi : u);
  int cell = (int)floor_c(v) - (int)lo_level;
  const int top = (int)(hi_level - lo_level) - 1;
  cell = cell < 0 ? 0 : (cell > top ? top : cell);
  const int lower = cell_index[cell];
  return lower + (((C)uni < (v - levels[lower]) * inv_width[lower]) ? 1 : 0);
}

#define THC_ROUND_ARGS                                                                   \
  clamp, kfac, granularity, lo_level, hi_level, levels, inv_width, cell_index, round_lo, round_hi

// One CUDA block per rotation block of B = 2^log_b <= 4096 elements, held in shared memory.
// n: input elements (the rest of the padded length is zeros); norm: 2^(-log_b / 2); clamp: t;
// kfac: g / (2t); lo_level, hi_level: the table's first and last levels; bits: per packed index.
template <typename In, typename C, typename Out, bool PACKED>
__global__ void thc_encode_block(const In* __restrict__ x, const C* __restrict__ scale,
                                 const C* __restrict__ levels,
                                 const C* __restrict__ inv_width,
                                 const int* __restrict__ cell_index,
                                 const Out* __restrict__ lane_table, Out* __restrict__ out, i64 n,
                                 int log_b, C norm, C clamp, C kfac, C granularity,
                                 i64 lo_level, i64 hi_level, u32 sign_lo, u32 sign_hi,
                                 u32 round_lo, u32 round_hi, int bits) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int B = 1 << log_b;
  C* s = (C*)smem;
  u8* idx = smem + (size_t)B * sizeof(C);
  const i64 base = (i64)blockIdx.x * B;
  for (int i = threadIdx.x; i < B; i += blockDim.x) {
    i64 e = base + i;
    C v = e < n ? widen<C>(x[e]) : (C)0;
    s[i] = v * (C)sign_of(sign_word((u64)e, sign_lo, sign_hi), (u64)e);
  }
  __syncthreads();
  for (int h = 1; h < B; h <<= 1) {
    for (int q = threadIdx.x; q < B / 2; q += blockDim.x) {
      int i = ((q & ~(h - 1)) << 1) | (q & (h - 1));
      C a = s[i], b = s[i + h];
      s[i] = a + b;
      s[i + h] = a - b;
    }
    __syncthreads();
  }
  const C sc = scale[blockIdx.x];
  for (int i = threadIdx.x; i < B; i += blockDim.x) {
    int z = thc_round(s[i] * norm, sc, base + i, THC_ROUND_ARGS);
    if (PACKED) {
      idx[i] = (u8)z;
    } else {
      out[base + i] = lane_table[z];
    }
  }
  if (PACKED) {
    __syncthreads();
    const int per_byte = 8 / bits;
    const int nbytes = B / per_byte;
    u8* packed = (u8*)out + (i64)blockIdx.x * nbytes;
    for (int j = threadIdx.x; j < nbytes; j += blockDim.x) {
      u32 byte = 0;
      for (int k = 0; k < per_byte; ++k) byte |= (u32)idx[j * per_byte + k] << (k * bits);
      packed[j] = (u8)byte;
    }
  }
}

// The same for B = 2^log_b in [128, 4096], B / 4 threads, each holding 4 consecutive elements in
// registers: stages h = 1, 2 inside the thread, h = 4 ... 64 across the warp by shuffles, the rest
// (h >= 128) in shared memory; each butterfly is still (a + b, a - b) of the same two values, in
// the same stage order, so the result is bit-identical to the reference.
#define FAST_ITEMS 4
#define WARP_STAGES 5
template <typename In, typename C, typename Out, bool PACKED>
__global__ void thc_encode_fast(const In* __restrict__ x, const C* __restrict__ scale,
                                const C* __restrict__ levels,
                                const C* __restrict__ inv_width,
                                const int* __restrict__ cell_index,
                                const Out* __restrict__ lane_table, Out* __restrict__ out, i64 n,
                                int log_b, C norm, C clamp, C kfac, C granularity, i64 lo_level,
                                i64 hi_level, u32 sign_lo, u32 sign_hi, u32 round_lo,
                                u32 round_hi, int bits) {
  extern __shared__ __align__(16) unsigned char smem[];
  const int B = 1 << log_b;
  C* s = (C*)smem;
  const int t = threadIdx.x, lane = t & 31;
  const i64 base = (i64)blockIdx.x * B;
  const i64 first = base + FAST_ITEMS * t;
  C v[FAST_ITEMS];
  const u32 signs = sign_word((u64)first, sign_lo, sign_hi);  // FAST_ITEMS divides 32
#pragma unroll
  for (int k = 0; k < FAST_ITEMS; ++k) {
    i64 e = first + k;
    C w = e < n ? widen<C>(x[e]) : (C)0;
    v[k] = w * (C)sign_of(signs, (u64)e);
  }
  C a, b;
  a = v[0]; b = v[1]; v[0] = a + b; v[1] = a - b;  // h = 1
  a = v[2]; b = v[3]; v[2] = a + b; v[3] = a - b;
  a = v[0]; b = v[2]; v[0] = a + b; v[2] = a - b;  // h = 2
  a = v[1]; b = v[3]; v[1] = a + b; v[3] = a - b;
#pragma unroll
  for (int j = 0; j < WARP_STAGES; ++j) {  // h = 4 << j: the partner is lane ^ (1 << j)
    const int m = 1 << j;
    const bool low = (lane & m) == 0;  // holds the lower index of each pair
#pragma unroll
    for (int k = 0; k < FAST_ITEMS; ++k) {
      C other = __shfl_xor_sync(0xFFFFFFFFu, v[k], m);
      v[k] = low ? v[k] + other : other - v[k];
    }
  }
  if (B > FAST_ITEMS * 32) {
#pragma unroll
    for (int k = 0; k < FAST_ITEMS; ++k) s[FAST_ITEMS * t + k] = v[k];
    __syncthreads();
    for (int h = FAST_ITEMS * 32; h < B; h <<= 1) {
      for (int q = t; q < B / 2; q += blockDim.x) {
        int i = ((q & ~(h - 1)) << 1) | (q & (h - 1));
        C p = s[i], r = s[i + h];
        s[i] = p + r;
        s[i + h] = p - r;
      }
      __syncthreads();
    }
#pragma unroll
    for (int k = 0; k < FAST_ITEMS; ++k) v[k] = s[FAST_ITEMS * t + k];
  }
  const C sc = scale[blockIdx.x];
  u32 word = 0;
#pragma unroll
  for (int k = 0; k < FAST_ITEMS; ++k) {
    int z = thc_round(v[k] * norm, sc, first + k, THC_ROUND_ARGS);
    if (PACKED) {
      word |= (u32)z << (k * bits);
    } else {
      out[first + k] = lane_table[z];
    }
  }
  if (PACKED) {
    u8* packed = (u8*)out + (base * bits) / 8;
    if (bits == 1) {  // 4 bits a thread: even threads write their nibble and the next one's
      u32 next = __shfl_down_sync(0xFFFFFFFFu, word, 1);
      if ((t & 1) == 0) packed[t >> 1] = (u8)(word | (next << 4));
    } else {
      const int nbytes = FAST_ITEMS * bits / 8;
      for (int m = 0; m < nbytes; ++m) packed[t * nbytes + m] = (u8)(word >> (8 * m));
    }
  }
}

// Blocks too large for shared memory: x is already rotated and normalised (padded length n);
// one thread per output lane value, or per packed byte.
template <typename C, typename Out, bool PACKED>
__global__ void thc_encode_rotated(const C* __restrict__ x, const C* __restrict__ scale,
                                   const C* __restrict__ levels,
                                   const C* __restrict__ inv_width,
                                   const int* __restrict__ cell_index,
                                   const Out* __restrict__ lane_table, Out* __restrict__ out,
                                   i64 n, int log_b, C clamp, C kfac, C granularity,
                                   i64 lo_level, i64 hi_level, u32 round_lo, u32 round_hi,
                                   int bits) {
  const int per_unit = PACKED ? 8 / bits : 1;
  const i64 units = n / per_unit;
  i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 j = (i64)blockIdx.x * blockDim.x + threadIdx.x; j < units; j += stride) {
    u32 byte = 0;
    for (int k = 0; k < per_unit; ++k) {
      i64 e = j * per_unit + k;
      int z = thc_round(x[e], scale[e >> log_b], e, THC_ROUND_ARGS);
      if (PACKED) {
        byte |= (u32)z << (k * bits);
      } else {
        out[e] = lane_table[z];
      }
    }
    if (PACKED) ((u8*)out)[j] = (u8)byte;
  }
}

// The receiver's side of the packed transport: out[i] = sum over sources r of
// levels[index i of source r], with 8 / bits indices per byte, the first in the lowest bits.
extern "C" __global__ void thc_unpack_sum(const u64* __restrict__ sources, int n_sources,
                                          i64 numel, int bits, const i64* __restrict__ levels,
                                          i64* __restrict__ out) {
  const int per_byte = 8 / bits;
  const u32 mask = (1u << bits) - 1u;
  i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < numel; i += stride) {
    i64 byte = i / per_byte;
    int shift = (int)(i % per_byte) * bits;
    i64 sum = 0;
    for (int r = 0; r < n_sources; ++r) {
      const u8* src = (const u8*)sources[r];
      sum += levels[(src[byte] >> shift) & mask];
    }
    out[i] = sum;
  }
}
