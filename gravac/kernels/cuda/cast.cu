// y = narrow(clamp(float(x), -limit, limit) * scale): the 16-bit casts of the fp16 / bf16
// compressors fused with the world-size scaling (gravac.kernels.cast.scaled_cast). NaN passes
// through (as torch.clamp), +-Inf is clamped to the largest finite wire value.
// Each thread loads CAST_ITEMS elements a stride apart before converting (loads in flight).
#define CAST_ITEMS 4
template <typename In, typename Out>
__global__ void scaled_cast(const In* __restrict__ x, Out* __restrict__ y, i64 n, float limit,
                            float scale) {
  const i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 i0 = (i64)blockIdx.x * blockDim.x + threadIdx.x; i0 < n; i0 += CAST_ITEMS * stride) {
    float v[CAST_ITEMS];
#pragma unroll
    for (int k = 0; k < CAST_ITEMS; ++k) {
      i64 i = i0 + k * stride;
      v[k] = i < n ? to_float(x[i]) : 0.0f;
    }
#pragma unroll
    for (int k = 0; k < CAST_ITEMS; ++k) {
      i64 i = i0 + k * stride;
      float w = v[k];
      if (w == w) w = fminf(fmaxf(w, -limit), limit);
      if (i < n) y[i] = narrow<Out>(w * scale);
    }
  }
}
