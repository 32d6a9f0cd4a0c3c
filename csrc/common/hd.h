// Host/device function qualifier shared by the rule headers.
#pragma once
#if defined(__CUDACC__)
#define DE_HD __host__ __device__ __forceinline__
#else
#define DE_HD inline
#endif
