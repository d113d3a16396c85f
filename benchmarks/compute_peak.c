/* The machine's 8-bit multiply-add peak, for benchmarks/read_floor.py's many-row passes: each
   thread runs twelve independent chains of 512-bit vpdpbusd (64 multiply-adds each; twelve
   chains cover the instruction's latency at its issue rate), the instruction the q8 products
   spend most of their time in. Returns multiply-adds a second over all threads, or 0 where the
   build has no AVX-512 VNNI. */
#include <omp.h>
#include <stdint.h>
#if defined(__AVX512VNNI__)
#include <immintrin.h>
#endif

double vnni_peak(int64_t reps, int nthreads) {
#if defined(__AVX512VNNI__)
    int64_t sink = 0;
    const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(nthreads) reduction(+ : sink)
    {
        __m512i a[12];
        for (int i = 0; i < 12; i++) a[i] = _mm512_set1_epi32(i);
        __m512i x = _mm512_set1_epi32(0x01010101 + omp_get_thread_num());
        const __m512i y = _mm512_set1_epi32(0x02020202);
        for (int64_t r = 0; r < reps; r++) {
#pragma GCC unroll 12
            for (int i = 0; i < 12; i++) a[i] = _mm512_dpbusd_epi32(a[i], x, y);
            __asm__ volatile("" : "+v"(x)); /* (the loop is not folded away) */
        }
        for (int i = 0; i < 12; i++) sink += _mm512_reduce_add_epi32(a[i]);
    }
    const double t = omp_get_wtime() - t0;
    return sink == 1 ? 0.0 : (double)reps * 12 * 64 * nthreads / t; /* (sink: kept) */
#else
    (void)reps, (void)nthreads;
    return 0.0;
#endif
}
