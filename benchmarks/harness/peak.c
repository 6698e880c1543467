/* This CPU's multiply-add peaks, per thread: independent chains of the
 * widest fp32 FMA and the widest u8 x s8 -> int32 dot product the compiler
 * targets (-march=native), with no loads, so only the vector pipes bound
 * them. benchmarks/harness/peak.py builds this, runs one copy per thread and
 * divides the multiply-adds done by the wall time. Each function returns
 * the multiply-adds it did; the sums go to *sink so that nothing is folded
 * away. */
#include <immintrin.h>

#define CHAINS 12 /* more than FMA latency x pipes (4-5 x 2) on current cores */
/* each product is made anew: the compiler must not share or hoist a product of
 * loop-invariant operands */
#define OPAQUE(v) __asm__ volatile("" : "+x"(v))

long fp32_macs(long iters, float *sink) {
#if defined(__AVX512F__)
    __m512 acc[CHAINS], a = _mm512_set1_ps(1e-7f), b = _mm512_set1_ps(*sink);
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_setzero_ps();
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 12
        for (int c = 0; c < CHAINS; c++) {
            OPAQUE(a);
            acc[c] = _mm512_fmadd_ps(a, b, acc[c]);
        }
    }
    float total = 0;
    for (int c = 0; c < CHAINS; c++) total += _mm512_reduce_add_ps(acc[c]);
    *sink = total;
    return iters * CHAINS * 16;
#elif defined(__AVX2__) && defined(__FMA__)
    __m256 acc[CHAINS], a = _mm256_set1_ps(1e-7f), b = _mm256_set1_ps(*sink);
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_setzero_ps();
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 12
        for (int c = 0; c < CHAINS; c++) {
            OPAQUE(a);
            acc[c] = _mm256_fmadd_ps(a, b, acc[c]);
        }
    }
    float lanes[8], total = 0;
    for (int c = 0; c < CHAINS; c++) {
        _mm256_storeu_ps(lanes, acc[c]);
        for (int l = 0; l < 8; l++) total += lanes[l];
    }
    *sink = total;
    return iters * CHAINS * 8;
#else
    (void)iters, (void)sink;
    return 0;
#endif
}

/* u8 x s8 products summed into int32 lanes, as the int8 route's kernels and
 * llama.cpp's Q8_0 dot products make them: VNNI's vpdpbusd (4 per lane),
 * else vpmaddubsw's int16 pairs widened by vpmaddwd against ones. */
long int8_macs(long iters, float *sink) {
#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
    __m512i acc[CHAINS], a = _mm512_set1_epi8(1), b = _mm512_set1_epi8((char)*sink);
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_setzero_si512();
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 12
        for (int c = 0; c < CHAINS; c++) {
            OPAQUE(a);
            acc[c] = _mm512_dpbusd_epi32(acc[c], a, b);
        }
    }
    int total = 0;
    for (int c = 0; c < CHAINS; c++) total += _mm512_reduce_add_epi32(acc[c]);
    *sink = (float)total;
    return iters * CHAINS * 64;
#elif defined(__AVX512BW__)
    __m512i acc[CHAINS], a = _mm512_set1_epi8(1), b = _mm512_set1_epi8((char)*sink);
    __m512i ones = _mm512_set1_epi16(1);
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm512_setzero_si512();
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 12
        for (int c = 0; c < CHAINS; c++) {
            OPAQUE(a);
            acc[c] = _mm512_add_epi32(acc[c], _mm512_madd_epi16(_mm512_maddubs_epi16(a, b), ones));
        }
    }
    int total = 0;
    for (int c = 0; c < CHAINS; c++) total += _mm512_reduce_add_epi32(acc[c]);
    *sink = (float)total;
    return iters * CHAINS * 64;
#elif defined(__AVXVNNI__)
    __m256i acc[CHAINS], a = _mm256_set1_epi8(1), b = _mm256_set1_epi8((char)*sink);
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_setzero_si256();
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 12
        for (int c = 0; c < CHAINS; c++) {
            OPAQUE(a);
            acc[c] = _mm256_dpbusd_avx_epi32(acc[c], a, b);
        }
    }
    int lanes[8], total = 0;
    for (int c = 0; c < CHAINS; c++) {
        _mm256_storeu_si256((__m256i *)lanes, acc[c]);
        for (int l = 0; l < 8; l++) total += lanes[l];
    }
    *sink = (float)total;
    return iters * CHAINS * 32;
#elif defined(__AVX2__)
    __m256i acc[CHAINS], a = _mm256_set1_epi8(1), b = _mm256_set1_epi8((char)*sink);
    __m256i ones = _mm256_set1_epi16(1);
    for (int c = 0; c < CHAINS; c++) acc[c] = _mm256_setzero_si256();
    for (long i = 0; i < iters; i++) {
#pragma GCC unroll 12
        for (int c = 0; c < CHAINS; c++) {
            OPAQUE(a);
            acc[c] = _mm256_add_epi32(acc[c], _mm256_madd_epi16(_mm256_maddubs_epi16(a, b), ones));
        }
    }
    int lanes[8], total = 0;
    for (int c = 0; c < CHAINS; c++) {
        _mm256_storeu_si256((__m256i *)lanes, acc[c]);
        for (int l = 0; l < 8; l++) total += lanes[l];
    }
    *sink = (float)total;
    return iters * CHAINS * 32;
#else
    (void)iters, (void)sink;
    return 0;
#endif
}
