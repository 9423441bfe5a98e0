/*
 * A chunk of a weight as the block searches read it on load (`hfquant.nn.linear._quantize_blocks`): float32 rows of a
 * bfloat16 or float32 weight, each row times its fold's row scale, each column divided by the fold's column scale, in
 * one pass, with a flag for NaN or Inf among the results. The same float32 operations as torch's
 * `out.copy_(w); out.mul_(row_scale[:, None]); out.div_(col_scale)` (an exact widening, one product, one quotient;
 * no fused multiply-add), which took four passes and a fifth (`torch.aminmax`) for the check: 0.3-0.4 CPU s of the
 * 1.2B's load on its main thread (docs/performance.md, issue #32, twelfth session). One thread: the chunk is 4 MiB.
 */
#pragma GCC optimize("fp-contract=off") /* the product and the quotient rounded as written */
#include <math.h>
#include <stdint.h>

#include "bf16_bits.h"
#include "hfquant_kernels.h"

#define HFQ_CLONES
#if defined(__x86_64__) && defined(__GNUC__) && defined(__linux__) && !defined(__clang__)
#undef HFQ_CLONES
#define HFQ_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#endif

/* one row: out[i] = float(w[i]) (* row) (/ col[i]); returns whether any result is NaN or infinite */
HFQ_CLONES static int fold_row(const void *w, int bf16, int64_t k, int scaled, float row, const float *col,
                               float *out) {
    const uint16_t *w16 = (const uint16_t *)w;
    const float *w32 = (const float *)w;
    int bad = 0;
    for (int64_t i = 0; i < k; i++) {
        float v = bf16 ? bf16_to_float(w16[i]) : w32[i];
        if (scaled) v = v * row;
        if (col != NULL) v = v / col[i];
        out[i] = v;
        bad |= !(fabsf(v) <= 3.40282347e38f);
    }
    return bad;
}

/*
 * out (rows, k) float32 = w (rows, k) (bfloat16 when `bf16`, else float32) with row r times row_scale[r] (NULL:
 * none) and column i divided by col_scale[i] (NULL: none). Returns 0, 1 for bad sizes, 3 when a result is NaN or
 * infinite (a non-finite weight, or a scale's overflow).
 */
int hfquant_fold_chunk(const void *w, int64_t bf16, int64_t rows, int64_t k, const float *row_scale,
                       const float *col_scale, float *out) {
    if (rows < 0 || k < 0) return 1;
    int bad = 0;
    const int64_t size = bf16 ? 2 : 4;
    for (int64_t r = 0; r < rows; r++)
        bad |= fold_row((const char *)w + r * k * size, (int)bf16, k, row_scale != NULL,
                        row_scale != NULL ? row_scale[r] : 1.0f, col_scale, out + r * k);
    return bad ? 3 : 0;
}

/*
 * Elements start .. start + count - 1 of the weight w (rows, k) in row-major order (a span that may cross rows)
 * into out (count,) float32, as hfquant_fold_chunk computes them; returns whether one is NaN or infinite. The IQ4
 * search folds its groups of blocks with it (iq4_search_cpu.c, `hfquant_iq4_quantize_fold`).
 */
int hfquant_fold_span(const void *w, int64_t bf16, int64_t k, int64_t start, int64_t count, const float *row_scale,
                      const float *col_scale, float *out) {
    int bad = 0;
    const int64_t size = bf16 ? 2 : 4;
    while (count > 0) {
        const int64_t r = start / k, c = start % k, n = count < k - c ? count : k - c;
        bad |= fold_row((const char *)w + start * size, (int)bf16, n, row_scale != NULL,
                        row_scale != NULL ? row_scale[r] : 1.0f, col_scale != NULL ? col_scale + c : NULL, out);
        start += n, count -= n, out += n;
    }
    return bad;
}
