/* The random-row read bandwidth of one core, for benchmarks/bench_scale.py's floor: the sum of `reads` rows
 * table[ids[r]] (rows of `dim` float32) into out, each row prefetched whole 8 reads ahead; where a `cols`-wide
 * column slice of the table fits the last-level cache (cols < dim), one pass per slice instead, as the ext
 * gather does. Returns the calling thread's CPU seconds. Built by bench_scale.py with the C compiler at hand. */
#define _POSIX_C_SOURCE 199309L
#include <stdint.h>
#include <time.h>

static double thread_seconds(void) {
  struct timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec + 1e-9 * t.tv_nsec;
}

double read_rows(const float* table, int64_t dim, const int64_t* ids, int64_t reads, int64_t cols, float* out) {
  const double start = thread_seconds();
  for (int64_t c0 = 0; c0 < dim; c0 += cols) {
    const int64_t c1 = c0 + cols < dim ? c0 + cols : dim;
    for (int64_t r = 0; r < reads; ++r) {
      if (r + 8 < reads) {
        const char* ahead = (const char*)(table + ids[r + 8] * dim + c0);
        for (int64_t b = 0; b < (c1 - c0) * 4; b += 64) __builtin_prefetch(ahead + b);
      }
      const float* row = table + ids[r] * dim;
      for (int64_t d = c0; d < c1; ++d) out[d] += row[d];
    }
  }
  return thread_seconds() - start;
}
