// y = narrow(clamp(float(x), -limit, limit) * scale): the 16-bit casts of the fp16 / bf16
// compressors fused with the world-size scaling (gravac.kernels.cast.scaled_cast). NaN passes
// through (as torch.clamp), +-Inf is clamped to the largest finite wire value.
template <typename In, typename Out>
__global__ void scaled_cast(const In* __restrict__ x, Out* __restrict__ y, i64 n, float limit,
                            float scale) {
  i64 stride = (i64)gridDim.x * blockDim.x;
  for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
    float v = to_float(x[i]);
    if (v == v) v = fminf(fmaxf(v, -limit), limit);
    y[i] = narrow<Out>(v * scale);
  }
}
