// Selection and aggregation of sparse payloads (gravac.kernels.sparse):
//  * exact top-k by magnitude: an ordered stream compaction of every element whose magnitude key
//    is above a key range and of those inside it (the candidates, refined exactly by the caller);
//    the range comes from a sample (the caller) or from a 4096-bin histogram of the key;
//  * threshold selection |x| >= t with the same ordered compaction (torch.nonzero's order);
//  * scatter-add of gathered (index, value) pairs.
// Compaction is deterministic: a count pass per tile, an exclusive scan, and a write pass that
// ranks each tile's hits with warp ballots, so indices come out ascending within each stream.

#define BIN_BITS 12
#define NBINS (1 << BIN_BITS)
// The key is 31 bits (sign bit cleared): its top BIN_BITS bits are the bin.
#define KEY_SHIFT (31 - BIN_BITS)
#define TILE_THREADS 256
#define TILE_ITEMS 8
#define TILE (TILE_THREADS * TILE_ITEMS)
#define WARPS (TILE_THREADS / 32)
#define FIND_THREADS 1024
#define BINS_PER_THREAD (NBINS / FIND_THREADS)

// A 31-bit key, weakly increasing in |x|, with NaN >= +-Inf >= every finite value: the bit
// pattern of |x| read as an unsigned integer (float64: its upper 32 bits).
__device__ __forceinline__ u32 mag_key(float v) { return __float_as_uint(v) & 0x7FFFFFFFu; }
__device__ __forceinline__ u32 mag_key(double v) {
  return (u32)((u64)__double_as_longlong(v) >> 32) & 0x7FFFFFFFu;
}
__device__ __forceinline__ u32 mag_key(half_t v) { return mag_key(to_float(v)); }
__device__ __forceinline__ u32 mag_key(bf16_t v) { return mag_key(to_float(v)); }

// Grid-stride over tiles; each thread loads its TILE_ITEMS keys first (independent loads in
// flight), then lanes with the same bin add once per warp (__match_any_sync), so clustered
// magnitudes do not serialise on one shared-memory counter. Needs blockDim.x == TILE_THREADS.
template <typename T>
__global__ void mag_histogram(const T* __restrict__ x, i64 n, u32* __restrict__ hist) {
  __shared__ u32 local[NBINS];
  for (int i = threadIdx.x; i < NBINS; i += blockDim.x) local[i] = 0;
  __syncthreads();
  const int lane = threadIdx.x & 31;
  for (i64 tile0 = (i64)blockIdx.x * TILE; tile0 < n; tile0 += (i64)gridDim.x * TILE) {
    u32 bins[TILE_ITEMS];
#pragma unroll
    for (int r = 0; r < TILE_ITEMS; ++r) {
      i64 e = tile0 + r * TILE_THREADS + threadIdx.x;
      bins[r] = e < n ? mag_key(x[e]) >> KEY_SHIFT : (u32)NBINS;
    }
#pragma unroll
    for (int r = 0; r < TILE_ITEMS; ++r) {
      u32 peers = __match_any_sync(0xFFFFFFFFu, bins[r]);
      if (lane == __ffs(peers) - 1 && bins[r] < NBINS) atomicAdd(&local[bins[r]], __popc(peers));
    }
  }
  __syncthreads();
  for (int i = threadIdx.x; i < NBINS; i += blockDim.x)
    if (local[i]) atomicAdd(&hist[i], local[i]);
}

// One block of FIND_THREADS threads. out = {bin holding the k-th largest key, number of elements
// in higher bins, number of elements in that bin}; needs 1 <= k <= n.
extern "C" __global__ void find_bin(const u32* __restrict__ hist, i64 k, i64* __restrict__ out) {
  __shared__ i64 sums[FIND_THREADS];
  int t = threadIdx.x;
  i64 c[BINS_PER_THREAD];
  i64 own = 0;
  for (int j = 0; j < BINS_PER_THREAD; ++j) {
    c[j] = hist[NBINS - 1 - (BINS_PER_THREAD * t + j)];  // highest bins first
    own += c[j];
  }
  sums[t] = own;
  __syncthreads();
  for (int off = 1; off < FIND_THREADS; off <<= 1) {
    i64 v = t >= off ? sums[t - off] : 0;
    __syncthreads();
    sums[t] += v;
    __syncthreads();
  }
  i64 before = t ? sums[t - 1] : 0;
  if (before < k && sums[t] >= k) {
    i64 run = before;
    for (int j = 0; j < BINS_PER_THREAD; ++j) {
      if (run + c[j] >= k) {
        out[0] = NBINS - 1 - (BINS_PER_THREAD * t + j);
        out[1] = run;
        out[2] = c[j];
        break;
      }
      run += c[j];
    }
  }
}

// Stream of x[i] for a compaction: 0 (dropped), 1 or 2.
// MODE 0 (top-k split): 1 when mag_key > hi_key, 2 when lo_key <= mag_key <= hi_key.
// MODE 1 (threshold): 1 when |x| >= t, compared as torch's CUDA comparison does (float for 16- and
// 32-bit inputs, double for float64).
template <int MODE, typename T>
__device__ __forceinline__ int classify(T v, u32 lo_key, u32 hi_key, double threshold) {
  if (MODE == 0) {
    u32 key = mag_key(v);
    return key > hi_key ? 1 : (key >= lo_key ? 2 : 0);
  }
  return fabsf(to_float(v)) >= (float)threshold ? 1 : 0;
}
template <>
__device__ __forceinline__ int classify<1, double>(double v, u32 lo_key, u32 hi_key,
                                                   double threshold) {
  return fabs(v) >= threshold ? 1 : 0;
}

// counts[s * tiles + tile]: hits of stream s + 1 in tile (TILE consecutive elements), stream-major
// so that the scan over tiles runs along contiguous memory.
template <int MODE, typename T>
__global__ void compact_count(const T* __restrict__ x, i64 n, u32 lo_key, u32 hi_key,
                              double threshold, int* __restrict__ counts) {
  __shared__ int total[2];
  if (threadIdx.x == 0) total[0] = total[1] = 0;
  __syncthreads();
  i64 tile0 = (i64)blockIdx.x * TILE;
  int c1 = 0, c2 = 0;
#pragma unroll
  for (int r = 0; r < TILE_ITEMS; ++r) {
    i64 e = tile0 + r * TILE_THREADS + threadIdx.x;
    int cls = e < n ? classify<MODE>(x[e], lo_key, hi_key, threshold) : 0;
    c1 += cls == 1;
    c2 += cls == 2;
  }
  for (int off = 16; off; off >>= 1) {
    c1 += __shfl_down_sync(0xFFFFFFFFu, c1, off);
    c2 += __shfl_down_sync(0xFFFFFFFFu, c2, off);
  }
  if ((threadIdx.x & 31) == 0) {
    atomicAdd(&total[0], c1);
    atomicAdd(&total[1], c2);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    counts[blockIdx.x] = total[0];
    counts[gridDim.x + blockIdx.x] = total[1];
  }
}

// Writes the flat index of every hit of stream s at out_s[offsets[s * tiles + tile] + rank], rank
// ascending with the index inside the tile (element r * TILE_THREADS + tid of the tile is in round
// r). Every thread classifies its TILE_ITEMS elements first; warp ballots give the ranks inside a
// (round, warp) slot, and one warp per stream scans the TILE_ITEMS * WARPS = 64 slot totals.
// out2 may be null when MODE has no stream 2.
#define SLOTS (TILE_ITEMS * WARPS)
template <int MODE, typename T>
__global__ void compact_write(const T* __restrict__ x, i64 n, u32 lo_key, u32 hi_key,
                              double threshold, const i64* __restrict__ offsets,
                              i64* __restrict__ out1, i64* __restrict__ out2) {
  __shared__ int slot_total[2][SLOTS];
  __shared__ i64 slot_base[2][SLOTS];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const i64 tile0 = (i64)blockIdx.x * TILE;
  int cls[TILE_ITEMS];
#pragma unroll
  for (int r = 0; r < TILE_ITEMS; ++r) {
    i64 e = tile0 + r * TILE_THREADS + tid;
    cls[r] = e < n ? classify<MODE>(x[e], lo_key, hi_key, threshold) : 0;
  }
  u32 b1[TILE_ITEMS], b2[TILE_ITEMS];
#pragma unroll
  for (int r = 0; r < TILE_ITEMS; ++r) {
    b1[r] = __ballot_sync(0xFFFFFFFFu, cls[r] == 1);
    b2[r] = __ballot_sync(0xFFFFFFFFu, cls[r] == 2);
    if (lane == 0) {
      slot_total[0][r * WARPS + warp] = __popc(b1[r]);
      slot_total[1][r * WARPS + warp] = __popc(b2[r]);
    }
  }
  __syncthreads();
  if (warp < 2) {  // warp s scans stream s: lane l holds slots 2l and 2l + 1
    const int s = warp;
    int a = slot_total[s][2 * lane], b = slot_total[s][2 * lane + 1];
    int inc = a + b;
    for (int off = 1; off < 32; off <<= 1) {
      int v = __shfl_up_sync(0xFFFFFFFFu, inc, off);
      if (lane >= off) inc += v;
    }
    i64 start = offsets[s * gridDim.x + blockIdx.x] + (inc - a - b);
    slot_base[s][2 * lane] = start;
    slot_base[s][2 * lane + 1] = start + a;
  }
  __syncthreads();
  const u32 lower_lanes = (1u << lane) - 1u;
#pragma unroll
  for (int r = 0; r < TILE_ITEMS; ++r) {
    if (cls[r]) {
      int s = cls[r] - 1;
      i64 pos = slot_base[s][r * WARPS + warp] + __popc((s ? b2[r] : b1[r]) & lower_lanes);
      (s ? out2 : out1)[pos] = tile0 + r * TILE_THREADS + tid;
    }
  }
}

// out[idx[i]] += val[i]. 16-bit values: compare-and-swap on the aligned 32-bit word, each
// addition rounded once to the value type (as torch's atomic index_add_).
__device__ __forceinline__ void atomic_add(float* p, float v) { atomicAdd(p, v); }
__device__ __forceinline__ void atomic_add(double* p, double v) { atomicAdd(p, v); }
template <typename H>
__device__ __forceinline__ void atomic_add_16(H* p, H v) {
  u32* word = (u32*)((u64)p & ~(u64)3);
  u32 shift = ((u64)p & 2) ? 16u : 0u;
  u32 old = *word, assumed;
  do {
    assumed = old;
    H cur;
    cur.bits = (u16)(assumed >> shift);
    H sum = narrow<H>(to_float(cur) + to_float(v));
    u32 next = (assumed & ~(0xFFFFu << shift)) | ((u32)sum.bits << shift);
    old = atomicCAS(word, assumed, next);
  } while (assumed != old);
}
__device__ __forceinline__ void atomic_add(half_t* p, half_t v) { atomic_add_16(p, v); }
__device__ __forceinline__ void atomic_add(bf16_t* p, bf16_t v) { atomic_add_16(p, v); }

template <typename V, typename I>
__global__ void scatter_add(V* __restrict__ out, const I* __restrict__ idx,
                            const V* __restrict__ val, i64 k) {
  i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < k; i += stride)
    atomic_add(out + idx[i], val[i]);
}
