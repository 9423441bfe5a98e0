/* One-row GEMVs of llama.cpp's block formats (GGUF's quantized types, hfquant.core.blocks) by integer dot products.
 *
 * Weight: (N, K / B * S) uint8, each row its blocks in input order, each block the bytes of ggml-common.h's
 * block_<type> (B = 32 or 256 weights, S bytes; the layouts hfquant.core.blocks documents and its torch dequantizers
 * read). x: (K,) bfloat16. y: (N,) bfloat16, y[n] = x_hat . w_hat[n] summed in float32 and rounded once, where w_hat
 * is the dequantized weight (hfquant.core.blocks.dequantize) and x_hat the activation row quantized once per call:
 *   - for the 256-weight types (Q2_K..Q6_K, IQ4_XS): per 256 inputs, xs = max|x| / 127 and xq = round(x / xs) (to
 *     nearest even) in int8, with the sums of xq per 16 inputs (the role of llama.cpp's block_q8_K);
 *   - for the 32-weight types (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL, hfquant's HQ3_0, HQ3_NL) and hfquant's HQ3_R
 *     (64-weight blocks after a 2-byte row header): the same per 32 inputs, with the sum per 32.
 * So |x_hat[k] - x[k]| <= max|x_block| / 254 for the block of k, and |y[n] - x . w_hat[n]| <= sum_k |w_hat[n, k]| *
 * max|x_block(k)| / 254 plus float32 summation and the final bfloat16 rounding.
 *
 * How, per block: the codes are widened to one unsigned byte per weight in 32-byte registers (masks, shifts and ors
 * of the packed bits; IQ4 grid values by a byte shuffle, signed codes of Q8_0 / IQ4 by their magnitude with the sign
 * moved onto the activation), multiplied with the int8 activations four products per 32-bit lane (vpdpbusd on
 * AVX512-VNNI CPUs, vpmaddubsw + vpmaddwd on AVX2 ones), each sub-block's integer sums times its integer scale (Q3_K,
 * Q4_K, Q5_K and Q6_K: vpmaddubsw's int16 pair sums times the int16 scales by vpdpwssd / vpmaddwd), and one float
 * multiply per super-block (k-quants) or block (32-weight types). The codes' constant offsets (Q6_K's -32, Q3_K's -4,
 * Q4_0's -8, Q5_0's -16) and the minimums (Q2_K, Q4_K, Q5_K, Q4_1, Q5_1) multiply the activation sums instead of
 * every weight. On AVX512-VNNI CPUs Q8_0 takes two blocks per 512-bit step (blocks_body.h's BK_ROW32_PAIRS), Q3_K
 * and Q6_K four sub-blocks (k16_group_), Q4_K and Q5_K two (k4_dots_, against a copy of the activation in their
 * nibbles' order, ActRow.qk), Q4_0, Q4_1, Q5_0, Q5_1, IQ4_NL and IQ4_XS four 32-weight blocks (one 128-bit lane each:
 * a register of their low nibbles and one of their high nibbles against ActRow.qn, the activation in that order;
 * IQ4_XS's dots started from ActRow.startxs and each block's float lanes times its float scale, no integer scale
 * multiply; the AVX2 body two blocks per register the same way): the same integers, products and float additions in
 * the same order, so the same bytes as one block at a time or the other body (Q4_K 0.7x the time, Q4_0 0.7-0.8x,
 * Q4_1 0.77x, Q5_0 0.84x and Q5_1 0.91x of two blocks per step; IQ4_XS 0.8-0.85x of its former four-block step:
 * docs/performance.md). But IQ4_XS and IQ4_NL on AVX2: their rows sum a super-block's blocks times their integer
 * scales (IQ4_XS) or a block's two nibble halves (IQ4_NL) in int32 before one float product, the same integers in
 * another float order than the AVX-512 body's (within float32 rounding and a bfloat16 step of it; 1.07-1.22x).
 * One OpenMP region per call: the threads split the activation blocks to quantize, then the rows.
 * hfquant_block_gemv_group takes several weights reading the same x (a fused q/k/v or gate/up group; types and block
 * sizes may differ, as a Q4_K_M file's Q4_K q/k and Q6_K v or an IQ4_NL file's IQ4_NL q/k and Q5_K v): x quantized
 * once per activation block size it needs (32, 256), one region, each weight's outputs the bytes of its own call.
 * The quantized row lives on the caller's stack (one allocation only past ACT_STACK bytes). HQ3_R on AVX512-VNNI
 * takes one 64-weight block per 512-bit step on its grid plus 128 (unsigned), its dot started from -128 times the
 * activation sums per 4 inputs (bias4) and its four sub-block scales from a level table (dxs: the activation scales
 * per 16 inputs), both computed once per call with the quantized row; where the CPU has AVX512-VBMI, BITALG and GFNI
 * it takes four blocks per step instead, each int32 lane one sub-block (hq3r_body.h; the row's activations also in
 * that step's order: qt; bias16 per 16 inputs). IQ4_NL takes the same start for its grid plus 128, in qn's order
 * (biasn; no sign moved onto the activation: 1.27x as fast).
 *
 * IQ4_NL and IQ4_XS weights may also lie in the R8 compute layout (type | BLOCK_ROWS8: 8 rows interleaved block by
 * block, r8_offset below), whose GEMVs (blocks_r8_body.h, the AVX2 body only) serve 8 rows per activation broadcast,
 * and IQ4_XS weights in the R16 layout (BLOCK_ROWS16: 16 rows, r16_offset), whose GEMV is the AVX512-VNNI body's.
 * Written from the block layouts, not from llama.cpp's kernels. Returns 0, 1 for a refused type / shape / CPU
 * (hfquant_block_gemv_supported), 2 when memory runs out.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifdef _OPENMP
#include <omp.h>
#endif

/* the calling thread's index in its OpenMP team, and the most threads a region may have (0 and 1 without OpenMP) */
static inline int64_t omp_thread_index(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#endif
    return 0;
}
static inline int64_t omp_thread_limit(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#endif
    return 1;
}

#include "bf16_bits.h"
#include "hfquant_kernels.h"

enum {
    GGML_Q4_0 = 2,
    GGML_Q4_1 = 3,
    GGML_Q5_0 = 6,
    GGML_Q5_1 = 7,
    GGML_Q8_0 = 8,
    GGML_Q2_K = 10,
    GGML_Q3_K = 11,
    GGML_Q4_K = 12,
    GGML_Q5_K = 13,
    GGML_Q6_K = 14,
    GGML_IQ4_NL = 20,
    GGML_IQ4_XS = 23,
    HQ3_0 = 1000, /* hfquant's own (hfquant.core.blocks.hq3), not a GGUF type */
    HQ3_NL = 1001, /* hfquant's own: HQ3_0's bytes, codes on the grid HQ3_NL_GRID */
    HQ3_R = 1002,  /* hfquant's own (hfquant.core.blocks.hq3r): a float16 row header, then 64-weight blocks */
    HQ3_R_GFNI = -1002, /* HQ3_R's rows by the VNNI body's GFNI step (hq3r_body.h): a BlockPart type, no caller's */
    Q3_K_GFNI = -11,    /* Q3_K's rows by the VNNI body's GFNI step (blocks_body.h row_q3_k_gfni): a BlockPart type */
};

/* bytes before a row's blocks (HQ3_R's float16 row scale D; GGUF types have none) */
static inline int64_t row_header(int type) { return type == HQ3_R ? 2 : 0; }

static const int16_t *rows_map(int64_t type, int *rows);

/* weights per block and bytes per block of a GGML type (0: not one of ours); an R8 or R16 code (type | BLOCK_ROWS8,
 * type | BLOCK_ROWS16) has its plain type's shape where the type has that layout (rows_map), else none */
static void block_shape(int type, int64_t *block, int64_t *bytes) {
    if (type & (BLOCK_ROWS8 | BLOCK_ROWS16)) {
        int rows;
        if (rows_map(type, &rows) == NULL) type = 0;
        type &= ~(BLOCK_ROWS8 | BLOCK_ROWS16);
    }
    static const int64_t table[][3] = {
        {GGML_Q4_0, 32, 18},  {GGML_Q4_1, 32, 20},   {GGML_Q5_0, 32, 22},   {GGML_Q5_1, 32, 24},
        {GGML_Q8_0, 32, 34},  {GGML_Q2_K, 256, 84},  {GGML_Q3_K, 256, 110}, {GGML_Q4_K, 256, 144},
        {GGML_Q5_K, 256, 176}, {GGML_Q6_K, 256, 210}, {GGML_IQ4_NL, 32, 18}, {GGML_IQ4_XS, 256, 136},
        {HQ3_0, 32, 14},      {HQ3_NL, 32, 14},     {HQ3_R, 64, 27},
    };
    *block = 0;
    *bytes = 0;
    for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
        if (table[i][0] == type) {
            *block = table[i][1];
            *bytes = table[i][2];
        }
}

/* ---- The R8 compute layout (type | BLOCK_ROWS8): 8 rows interleaved block by block, so that one activation broadcast
 * serves 8 rows and one vector holds the 8 rows' block scales (blocks_r8_body.h's GEMVs; issue #32). The rows stay
 * where GGUF's layout has their group: rows 8g..8g + 7 own the same 8 * row_bytes bytes, and there block b of all
 * eight rows lies at 8 * bytes * b as one "R8 block" of 8 * bytes bytes. Inside an R8 block (r: the row in its group,
 * 0..7; "code byte c" of a 32-weight block: its byte 2 + c, whose low nibble is weight c, high nibble weight 16 + c):
 *   IQ4_NL (18-byte blocks, 144 bytes): row r's float16 d at 2r; then 4 chunks j = 0..3 of 32 bytes, chunk j at 16 +
 *     32j holding code bytes 4j..4j + 3 of row r at 16 + 32j + 4r (int32 lane r of a 256-bit load is row r's).
 *   IQ4_XS (136-byte super-blocks, 1088 bytes): row r's float16 d at 2r; its scales_h (2 bytes) at 16 + 2r; its
 *     scales_l (4 bytes) at 32 + 4r (lane r of a 256-bit load); then per 32-weight sub-block s = 0..7 (the 16 bytes
 *     at 8 + 16s of the row's super-block) 128 bytes at 64 + 128s, as IQ4_NL's four chunks: code byte 4j + i of
 *     row r's sub-block s at 64 + 128s + 32j + 4r + i.
 *   Q3_K (110-byte super-blocks: hmask[32], qs[64], scales[12], d; 880 bytes; blocks_r8k_body.h): row r's float16 d
 *     at 2r; its scale bytes 4g..4g + 3 (g = 0, 1, 2) at 16 + 32g + 4r (three 256-bit loads, lane r row r's); then
 *     per t = 0..7 96 bytes at 112 + 96t: hmask bytes 4t..4t + 3 of row r at 112 + 96t + 4r, qs bytes 4t..4t + 3
 *     (codes of weights 32j + 4t..32j + 4t + 3, j = 0..3) at 112 + 96t + 32 + 4r, qs bytes 32 + 4t..35 + 4t (weights
 *     128 + 32j + 4t..) at 112 + 96t + 64 + 4r: one hmask and two qs loads give all 8 of the rows' codes of 4t..4t + 3
 *     in each 32-weight quarter.
 * r8_offset below is that map; hfquant_block_interleave and the dequantization read it through R8_MAP.
 *
 * The R16 layout (type | BLOCK_ROWS16, IQ4_XS only) interleaves 16 rows the same way, super-block by super-block (an
 * "R16 block" of 16 * 136 = 2176 bytes): row r's float16 d at 2r, its scales_h at 32 + 2r, its scales_l at 64 + 4r
 * (lane r of a 512-bit load), then per sub-block s 256 bytes at 128 + 256s: code byte 4j + i of row r's sub-block s
 * at 128 + 256s + 64j + 4r + i, so that int32 lane r of a 512-bit load is row r's (r16_offset). ---- */

/* r8_offset of Q3_K (see above) */
static int r8_offset_q3_k(int r, int i) {
    if (i < 32) return 112 + 96 * (i / 4) + 4 * r + i % 4; /* hmask */
    if (i < 96) {                                          /* qs */
        const int c = i - 32, l = c % 32;
        return 112 + 96 * (l / 4) + 32 + 32 * (c / 32) + 4 * r + l % 4;
    }
    if (i < 108) return 16 + 32 * ((i - 96) / 4) + 4 * r + (i - 96) % 4; /* scales */
    return 2 * r + (i - 108);                                              /* d */
}

/* where byte i (0 <= i < bytes) of row r's block lies in its R8 block (see above); type: IQ4_NL, IQ4_XS or Q3_K */
static int r8_offset(int type, int r, int i) {
    if (type == GGML_Q3_K) return r8_offset_q3_k(r, i);
    if (i < 2) return 2 * r + i; /* d */
    if (type == GGML_IQ4_NL) {
        const int c = i - 2;
        return 16 + 32 * (c / 4) + 4 * r + c % 4;
    }
    if (i < 4) return 16 + 2 * r + (i - 2); /* scales_h */
    if (i < 8) return 32 + 4 * r + (i - 4); /* scales_l */
    const int s = (i - 8) / 16, c = (i - 8) % 16;
    return 64 + 128 * s + 32 * (c / 4) + 4 * r + c % 4;
}

/* where byte i (0 <= i < 136) of row r's IQ4_XS super-block lies in its R16 block (see above) */
static int r16_offset(int r, int i) {
    if (i < 2) return 2 * r + i;             /* d */
    if (i < 4) return 32 + 2 * r + (i - 2);  /* scales_h */
    if (i < 8) return 64 + 4 * r + (i - 4);  /* scales_l */
    const int s = (i - 8) / 16, c = (i - 8) % 16;
    return 128 + 256 * s + 64 * (c / 4) + 4 * r + c % 4;
}

/* R8_MAP_NL[r][i] / R8_MAP_XS[r][i] / R8_MAP_Q3K[r][i]: r8_offset of the three types, R16_MAP_XS r16_offset, tabled
 * once */
static int16_t R8_MAP_NL[8][18], R8_MAP_XS[8][136], R8_MAP_Q3K[8][110], R16_MAP_XS[16][136];

__attribute__((constructor)) static void r8_map_init(void) {
    for (int r = 0; r < 8; r++) {
        for (int i = 0; i < 18; i++) R8_MAP_NL[r][i] = (int16_t)r8_offset(GGML_IQ4_NL, r, i);
        for (int i = 0; i < 136; i++) R8_MAP_XS[r][i] = (int16_t)r8_offset(GGML_IQ4_XS, r, i);
        for (int i = 0; i < 110; i++) R8_MAP_Q3K[r][i] = (int16_t)r8_offset(GGML_Q3_K, r, i);
    }
    for (int r = 0; r < 16; r++)
        for (int i = 0; i < 136; i++) R16_MAP_XS[r][i] = (int16_t)r16_offset(r, i);
}

/* the map of an interleaved type code and its rows per group (NULL: none): type | BLOCK_ROWS16 the R16 layout (IQ4_XS
 * only), a plain type or type | BLOCK_ROWS8 the R8 layout (IQ4_NL, IQ4_XS, Q3_K) */
static const int16_t *rows_map(int64_t type, int *rows) {
    if (type & BLOCK_ROWS16) {
        *rows = 16;
        return (type & ~(int64_t)BLOCK_ROWS16) == GGML_IQ4_XS ? &R16_MAP_XS[0][0] : NULL;
    }
    *rows = 8;
    type &= ~(int64_t)BLOCK_ROWS8;
    return type == GGML_IQ4_NL   ? &R8_MAP_NL[0][0]
           : type == GGML_IQ4_XS ? &R8_MAP_XS[0][0]
           : type == GGML_Q3_K   ? &R8_MAP_Q3K[0][0]
                                 : NULL;
}

/* row `row`'s block b of an interleaved weight (groups of `rows` rows of row_bytes, blocks of `bytes`) gathered into
 * GGUF's bytes at out */
static void rows_gather(const uint8_t *weight, int64_t row, int64_t b, int64_t row_bytes, int64_t bytes,
                        const int16_t *map, int rows, uint8_t *out) {
    const uint8_t *group = weight + (row / rows) * rows * row_bytes + b * rows * bytes;
    const int16_t *m = map + (row % rows) * bytes;
    for (int64_t i = 0; i < bytes; i++) out[i] = group[m[i]];
}

/* The runs of a map: within one row's block, the bytes i0..i0 + len - 1 that go to consecutive R8 offsets (d: 2 bytes,
 * scales and code bytes: 4 or more), so that the permutation copies runs instead of bytes (0.74 GB/s byte by byte on
 * one Zen 3 thread: about 0.4 s of a 1.2B model's load). At most `bytes` runs per row. */
typedef struct {
    int16_t from, to, len;
} R8Run;

static int r8_runs(const int16_t *m, int64_t bytes, R8Run *runs) {
    int count = 0;
    for (int64_t i = 0; i < bytes; i++) {
        if (count && runs[count - 1].from + runs[count - 1].len == i && runs[count - 1].to + runs[count - 1].len == m[i])
            runs[count - 1].len++;
        else
            runs[count++] = (R8Run){(int16_t)i, m[i], 1};
    }
    return count;
}

/* one run's bytes: the usual lengths (2, 4) as single moves the compiler inlines, not a memcpy call each */
static inline void r8_copy(uint8_t *to, const uint8_t *from, int len) {
    if (len == 4)
        memcpy(to, from, 4);
    else if (len == 2)
        memcpy(to, from, 2);
    else
        memcpy(to, from, (size_t)len);
}

static int r16_interleave_xs(const uint8_t *src, uint8_t *dst, int64_t n, int64_t nb);

int hfquant_block_interleave(const uint8_t *src, uint8_t *dst, int64_t n, int64_t k, int64_t type, int64_t inverse) {
    if (!inverse && type == (GGML_IQ4_XS | BLOCK_ROWS16) && n > 0 && n % 16 == 0 && k > 0 && k % 256 == 0) {
        const int done = r16_interleave_xs(src, dst, n, k / 256);
        if (done) return done < 0 ? 2 : 0;
    }
    if (src == dst && n > 0) return 1; /* in place: only the gather path above */
    int rows;
    const int16_t *map = rows_map(type, &rows);
    int64_t block, bytes;
    block_shape((int)(type & ~(int64_t)(BLOCK_ROWS8 | BLOCK_ROWS16)), &block, &bytes);
    if (map == NULL || !block || n < 0 || n % rows || k <= 0 || k % block) return 1;
    const int64_t nb = k / block, row_bytes = nb * bytes;
    R8Run runs[16][256];
    int counts[16];
    for (int r = 0; r < rows; r++) counts[r] = r8_runs(map + r * bytes, bytes, runs[r]);
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < n / rows; g++)
        for (int64_t r = 0; r < rows; r++)
            for (int64_t b = 0; b < nb; b++) {
                const int64_t plain = (rows * g + r) * row_bytes + b * bytes;
                const int64_t r8 = rows * g * row_bytes + b * rows * bytes;
                for (int j = 0; j < counts[r]; j++) {
                    const R8Run run = runs[r][j];
                    if (inverse)
                        r8_copy(dst + plain + run.from, src + r8 + run.to, run.len);
                    else
                        r8_copy(dst + r8 + run.to, src + plain + run.from, run.len);
                }
            }
    return 0;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

/* llama.cpp's IQ4 grid (kvalues_iq4nl, ggml-common.h): the value of each 4-bit code */
static const int8_t IQ4_GRID[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

/* hfquant's HQ3_NL grid (hq3.py `NL_VALUES`): the value of each 3-bit code, padded to 16 bytes for a byte shuffle */
static const int8_t HQ3_NL_GRID[16] = {-127, -87, -56, -29, 0, 29, 58, 94, 0, 0, 0, 0, 0, 0, 0, 0};

/* HQ3_R's sub-block scale magnitudes relative to D, 2^(-e / 8) rounded to float32 (hq3r.py `LEVELS`, the same bits) */
static const float HQ3R_LEVELS[32] = {0x1.000000p+0f, 0x1.d5818ep-1f, 0x1.ae89fap-1f, 0x1.8ace54p-1f, 0x1.6a09e6p-1f, 0x1.4bfdacp-1f, 0x1.306fe0p-1f, 0x1.172b84p-1f, 0x1.000000p-1f, 0x1.d5818ep-2f, 0x1.ae89fap-2f, 0x1.8ace54p-2f, 0x1.6a09e6p-2f, 0x1.4bfdacp-2f, 0x1.306fe0p-2f, 0x1.172b84p-2f, 0x1.000000p-2f, 0x1.d5818ep-3f, 0x1.ae89fap-3f, 0x1.8ace54p-3f, 0x1.6a09e6p-3f, 0x1.4bfdacp-3f, 0x1.306fe0p-3f, 0x1.172b84p-3f, 0x1.000000p-3f, 0x1.d5818ep-4f, 0x1.ae89fap-4f, 0x1.8ace54p-4f, 0x1.6a09e6p-4f, 0x1.4bfdacp-4f, 0x1.306fe0p-4f, 0x1.172b84p-4f};

/* HQ3_R's 64 field values as signed scales relative to D: LEVELS[e], negated for s = 1 (the GEMV's table) */
static const float HQ3R_SIGNED[64] = {
    0x1.000000p+0f, 0x1.d5818ep-1f, 0x1.ae89fap-1f, 0x1.8ace54p-1f,
    0x1.6a09e6p-1f, 0x1.4bfdacp-1f, 0x1.306fe0p-1f, 0x1.172b84p-1f,
    0x1.000000p-1f, 0x1.d5818ep-2f, 0x1.ae89fap-2f, 0x1.8ace54p-2f,
    0x1.6a09e6p-2f, 0x1.4bfdacp-2f, 0x1.306fe0p-2f, 0x1.172b84p-2f,
    0x1.000000p-2f, 0x1.d5818ep-3f, 0x1.ae89fap-3f, 0x1.8ace54p-3f,
    0x1.6a09e6p-3f, 0x1.4bfdacp-3f, 0x1.306fe0p-3f, 0x1.172b84p-3f,
    0x1.000000p-3f, 0x1.d5818ep-4f, 0x1.ae89fap-4f, 0x1.8ace54p-4f,
    0x1.6a09e6p-4f, 0x1.4bfdacp-4f, 0x1.306fe0p-4f, 0x1.172b84p-4f,
    -0x1.000000p+0f, -0x1.d5818ep-1f, -0x1.ae89fap-1f, -0x1.8ace54p-1f,
    -0x1.6a09e6p-1f, -0x1.4bfdacp-1f, -0x1.306fe0p-1f, -0x1.172b84p-1f,
    -0x1.000000p-1f, -0x1.d5818ep-2f, -0x1.ae89fap-2f, -0x1.8ace54p-2f,
    -0x1.6a09e6p-2f, -0x1.4bfdacp-2f, -0x1.306fe0p-2f, -0x1.172b84p-2f,
    -0x1.000000p-2f, -0x1.d5818ep-3f, -0x1.ae89fap-3f, -0x1.8ace54p-3f,
    -0x1.6a09e6p-3f, -0x1.4bfdacp-3f, -0x1.306fe0p-3f, -0x1.172b84p-3f,
    -0x1.000000p-3f, -0x1.d5818ep-4f, -0x1.ae89fap-4f, -0x1.8ace54p-4f,
    -0x1.6a09e6p-4f, -0x1.4bfdacp-4f, -0x1.306fe0p-4f, -0x1.172b84p-4f,
};

/* HQ3_R: sub-block i's scale of a block (the fields in its first 3 bytes), D * LEVELS[e] negated for s = 1 */
static inline float hq3r_scale(const uint8_t *w, int i, float d_row) {
    const uint32_t fields = (uint32_t)w[0] | ((uint32_t)w[1] << 8) | ((uint32_t)w[2] << 16);
    const uint32_t f = (fields >> (6 * i)) & 63;
    const float s = d_row * HQ3R_LEVELS[f & 31];
    return (f & 32) ? -s : s;
}

/* The quantized activation row: d (a float32 scale per block of `per` inputs), q (K int8), sums (the int32 sum of q
 * per 16 inputs when per = 256, per 32 when per = 32). */
typedef struct {
    float *d;
    int8_t *q;
    int32_t *sums;
    int32_t *sums32; /* per = 256: the sum of q per 32 inputs (pairs of sums), for the 32-weight minimums of Q4_K */
    int16_t *sums16; /* per = 256: sums as int16 (|sum| <= 16 * 127), for Q3_K / Q6_K's offsets by one vpmaddwd */
    int32_t *bias4;  /* per = 32 on AVX-512 (else NULL): -128 times the sum of q per 4 inputs, the start of the dots of
                      * codes + 128 (HQ3_R, IQ4_NL) */
    float *dxs;      /* with bias4: d of each input's block, once per 16 inputs (HQ3_R: one per sub-block), in
                      * dxs_lane's order */
    int8_t *qt;      /* with bias4: q in hq3r_body.h's group order (qt_index), for HQ3_R's GFNI step */
    int32_t *bias16; /* with bias4: -128 times the sum of q per 16 inputs, in input order */
    int8_t *qk;      /* per = 256 on AVX-512 with a Q4_K / Q5_K weight (else NULL): q with the middle 32-input quarters
                      * of every 128 inputs swapped (inputs 0-31, 64-95, 32-63, 96-127: blocks_body.h's k4_dots_ reads
                      * one sub-block per 256-bit half in the order of the codes' low and high nibbles) */
    int8_t *qn;      /* with an IQ4_XS, Q4_0, Q4_1, Q5_0, Q5_1 or IQ4_NL weight (else NULL): q in the order of four
                      * 32-weight blocks' nibbles, per 128 inputs the first 16 inputs of each 32, then the last 16
                      * (qn_index), so that one 512-bit register of four blocks' codes dots their low nibbles, another
                      * their high ones */
    int32_t *biasn;  /* with qn and bias4: bias4 in qn's order (the int32 lane of inputs e..e + 3 at
                      * qn_index(e) / 4) */
    int32_t *off8n;  /* with qn and bias4: per 128 inputs 16 int32, lane 4c = -8 times block c's sum, the others 0: the
                      * start of Q4_0's low-nibble dots (its codes' offset 8 in lane 0 of each block; Q5_0's twice) */
    int32_t *startxs; /* per = 256 on AVX-512 with an IQ4_XS weight (else NULL): per 128 inputs (four 32-input blocks
                       * c) 16 int32, lane 4c + l = -128 times the sum of block c's inputs 4l..4l + 3 and 16 + 4l..
                       * 19 + 4l: the start of IQ4_XS's dots of its grid + 128 whose low- and high-nibble products go
                       * into one lane (the signed dot's lane, as the AVX2 body's) */
    int8_t *q3k;      /* with a Q3_K_GFNI part (else NULL): q in row_q3_k_gfni's order, per 256 inputs for j = 0..3
                       * inputs 32j..32j + 31, then 128 + 32j..128 + 32j + 31 (the codes j of both qs halves) */
    int8_t *qa;       /* with an R8 part (else NULL): |q| in input order (at most 127), the unsigned operand of the R8
                       * GEMVs' vpmaddubsw against the grid values with q's signs (blocks_r8_body.h) */
} ActRow;

static inline float fp16_to_float(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF;
    uint32_t bits;
    if (exponent == 0x1F) {
        bits = sign | 0x7F800000u | (mantissa << 13);
    } else if (exponent) {
        bits = sign | ((exponent + 112) << 23) | (mantissa << 13);
    } else if (mantissa) { /* subnormal: mantissa * 2^-24, exact in float32 */
        float f = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -f : f;
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* Q4_K / Q5_K: the eight 6-bit block scales and minimums packed in 12 bytes */
static inline void k4_scales(const uint8_t *s, uint8_t *sc, uint8_t *mn) {
    for (int j = 0; j < 4; j++) {
        sc[j] = s[j] & 63;
        mn[j] = s[j + 4] & 63;
        sc[j + 4] = (s[j + 8] & 15) | ((s[j] >> 6) << 4);
        mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
    }
}

/* Q3_K: the sixteen 6-bit block scales packed in 12 bytes (low 4 bits in bytes 0-7, high 2 bits in bytes 8-11), minus
 * 32 */
static inline void k3_scales(const uint8_t *s, int8_t *sc) {
    for (int j = 0; j < 16; j++) {
        const int low = j < 8 ? s[j] & 15 : s[j - 8] >> 4;
        const int high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        sc[j] = (int8_t)((low | (high << 4)) - 32);
    }
}

/* The byte indices and lane orders of HQ3_R's GFNI step (hq3r_body.h), into a group of four blocks (block j at byte
 * 27 j, after the row header; group g's code bytes qs at 3 + 12 g, its 32 high bits qh at 11 + 12 g). Qword m = 2j + g
 * of the codes holds the 8 qs bytes of block j's group g as they lie (byte l: codes 8p + l, p = 0..3, in bits 2p,
 * 2p + 1), qword m of the high bits that group's 4 qh bytes twice (byte p: the third bits of codes 8p + l in
 * bit l). */
typedef struct {
    uint8_t codes[64];  /* byte 8m + l: qs byte l of block j, group g (m = 2j + g) */
    uint8_t qh[64];     /* byte 8m + 4h + p: qh byte p of block j, group g (h = 0, 1) */
    uint8_t fields[64]; /* int32 lane 4s + j: bytes 0-3 of block j (its scale fields) */
    int32_t pair0[16];  /* lane 4s + j (s = 2g + h): lane 2m of the t = 0, 1 dots (h = 0), 2m + 1 of the t = 2, 3
                         * dots (16 + 2m + 1; h = 1) */
    int32_t pair1[16];  /* the same lanes' other halves: 2m + 1 (h = 0), 16 + 2m (h = 1) */
} Hq3rOrder;

static Hq3rOrder HQ3R_ORDER;

__attribute__((constructor)) static void hq3r_order_init(void) {
    for (int j = 0; j < 4; j++)
        for (int g = 0; g < 2; g++) {
            const int m = 2 * j + g;
            for (int l = 0; l < 8; l++) {
                HQ3R_ORDER.codes[8 * m + l] = (uint8_t)(27 * j + 3 + 12 * g + l);
                HQ3R_ORDER.qh[8 * m + l] = (uint8_t)(27 * j + 11 + 12 * g + l % 4);
            }
            for (int h = 0; h < 2; h++) {
                const int lane = 4 * (2 * g + h) + j;
                HQ3R_ORDER.pair0[lane] = h == 0 ? 2 * m : 16 + 2 * m + 1;
                HQ3R_ORDER.pair1[lane] = h == 0 ? 2 * m + 1 : 16 + 2 * m;
            }
        }
    for (int lane = 0; lane < 16; lane++)
        for (int r = 0; r < 4; r++) HQ3R_ORDER.fields[4 * lane + r] = (uint8_t)(27 * (lane % 4) + r);
}

/* Q4_K / Q5_K's AVX-512 step g = 2h + i (blocks_body.h's k4_dots_: sub-blocks s0 = 4h + i and s1 = s0 + 2 in the
 * 256-bit halves), loaded rather than built from immediates in every row: K4_PICK, the 32 int16 indices of s0's and
 * s1's scales among k4_unpack_'s words (scale s at word s + 4 (s >= 4)); K4_BITS, Q5_K's qh bit of s0 / s1 in every
 * byte of the half */
static int16_t K4_PICK[4][32];
static uint8_t K4_BITS[4][64];

__attribute__((constructor)) static void k4_tables_init(void) {
    for (int g = 0; g < 4; g++) {
        const int s0 = 4 * (g / 2) + g % 2, s1 = s0 + 2;
        for (int e = 0; e < 32; e++) K4_PICK[g][e] = (int16_t)(e < 16 ? s0 + 4 * (s0 >= 4) : s1 + 4 * (s1 >= 4));
        for (int e = 0; e < 64; e++) K4_BITS[g][e] = (uint8_t)(e < 32 ? 1u << s0 : 1u << s1);
    }
}

#define AVX512_TARGET __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni")))
#define BK_GFNI_TARGET \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512vnni,gfni,avx512vbmi,avx512bitalg")))
#define AVX2_ONLY_TARGET __attribute__((target("avx2,fma,f16c")))
/* inlined whatever GCC's size heuristics say: a row loop's helpers taking a constant (Q4_K / Q5_K's `five`) must be
 * specialized, else the loop tests it and rebuilds its constants every super-block (1.3x the time) */
#define BK_INLINE static inline __attribute__((always_inline))

/* which body runs: hfquant_isa (isa_cpu.c) decides, so HFQUANT_ISA=avx2 picks the AVX2 body on a VNNI CPU */
static int cpu_vnni(void) {
#ifdef BK_FORCE_AVX2 /* or build with -DBK_FORCE_AVX2: the AVX2 body here, the other kernels unchanged */
    return 0;
#endif
    return HFQUANT_ISA_HAS(HFQUANT_ISA_AVX512 | HFQUANT_ISA_AVX512_VNNI);
}

/* The R16 interleave of IQ4_XS (r16_offset) by AVX-512 gathers, where the load's in-place interleave of every layer
 * took 0.11 s of the 1.2B's load by runs (about 6 GB/s on two threads): per R16 block, each row's first two 32-bit
 * words (d with scales_h, scales_l) and its 32 words of codes gathered across the 16 rows, one 64-byte store each:
 * 21-26 GB/s on two threads of the AVX-512 Xeon, the load's interleave 0.11 -> 0.036 s. In place (src == dst) each
 * thread first copies its group of 16 rows into `copies` (16 row_bytes per thread), where the load copied every
 * weight whole before. */
__attribute__((target("avx512f"))) static void r16_gather_xs(const uint8_t *src, uint8_t *dst, int64_t n, int64_t nb,
                                                             uint8_t *copies) {
    const int64_t row_bytes = nb * 136;
    const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32((int)row_bytes));
#pragma omp parallel for schedule(static)
    for (int64_t g = 0; g < n / 16; g++) {
        const uint8_t *group = src + g * 16 * row_bytes;
        if (copies != NULL) {
            uint8_t *copy = copies + omp_thread_index() * 16 * row_bytes;
            memcpy(copy, group, (size_t)(16 * row_bytes));
            group = copy;
        }
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *from = group + b * 136;
            uint8_t *to = dst + g * 16 * row_bytes + b * 2176;
            const __m512i head = _mm512_i32gather_epi32(rows, (const void *)from, 1); /* d | scales_h << 16 */
            _mm256_storeu_si256((__m256i *)to, _mm512_cvtepi32_epi16(head));
            _mm256_storeu_si256((__m256i *)(to + 32), _mm512_cvtepi32_epi16(_mm512_srli_epi32(head, 16)));
            _mm512_storeu_si512((void *)(to + 64), _mm512_i32gather_epi32(rows, (const void *)(from + 4), 1));
            for (int c = 0; c < 32; c++) /* code word c (bytes 8 + 4c..) of every row */
                _mm512_storeu_si512((void *)(to + 128 + 64 * c),
                                    _mm512_i32gather_epi32(rows, (const void *)(from + 8 + 4 * c), 1));
        }
    }
}

/* r16_gather_xs where the VNNI body runs: 1 done, -1 out of memory (nothing written), 0 elsewhere (the caller
 * permutes by runs, or refuses an in-place call) */
static int r16_interleave_xs(const uint8_t *src, uint8_t *dst, int64_t n, int64_t nb) {
    if (!cpu_vnni() || nb * 136 * 15 > INT32_MAX) return 0; /* gather offsets are int32 */
    uint8_t *copies = NULL;
    if (src == dst) {
        const int64_t threads = omp_thread_limit();
        copies = (uint8_t *)malloc((size_t)(threads * 16 * nb * 136));
        if (copies == NULL) return -1;
    }
    r16_gather_xs(src, dst, n, nb, copies);
    free(copies);
    return 1;
}

static int cpu_avx2(void) { return HFQUANT_ISA_HAS(HFQUANT_ISA_AVX2); }

/* the type the rows of a `type` weight run as: HQ3_R_GFNI / Q3_K_GFNI for HQ3_R / Q3_K where the VNNI body runs and
 * the CPU has AVX512-VBMI, BITALG and GFNI (hq3r_body.h's GFNI step, blocks_body.h's row_q3_k_gfni) */
static int64_t row_type(int64_t type, int vnni) {
    if (!vnni || !HFQUANT_ISA_HAS(HFQUANT_ISA_AVX512_VBMI_GFNI)) return type;
    return type == HQ3_R ? HQ3_R_GFNI : type == GGML_Q3_K ? Q3_K_GFNI : type;
}

/* where the scale of HQ3_R sub-block t (inputs 16 t to 16 t + 15) is in dxs: per group of four 64-input blocks, 16
 * floats, lane 4i + j for block j's sub-block i (hq3_r_scales4_'s order) */
static inline int64_t dxs_lane(int64_t t) { return 16 * (t / 16) + 4 * (t % 4) + (t % 16) / 4; }

/* where input e is in qt, the activation row in the order of HQ3_R's GFNI step (hq3r_body.h): per 256 inputs (eight
 * 32-input chunks c, c = 2j + g for group g of block j), vector t (64 bytes) holds inputs 8t to 8t + 7 of every chunk,
 * chunk c at bytes 8c to 8c + 7: the weights whose 2-bit codes are bits 2t, 2t + 1 of the chunk's qs bytes 0-7 */
static inline int64_t qt_index(int64_t e) {
    const int64_t c = (e % 256) / 32, t = (e % 32) / 8;
    return 256 * (e / 256) + 64 * t + 8 * c + e % 8;
}

/* where input e is in qn: per 128 inputs (four 32-input blocks c), the low-nibble inputs 0-15 of block c at 16 c,
 * the high-nibble inputs 16-31 at 64 + 16 c */
static inline int64_t qn_index(int64_t e) {
    const int64_t c = (e % 128) / 32, i = e % 32;
    return 128 * (e / 128) + 64 * (i / 16) + 16 * c + i % 16;
}

/* HQ3_R's GFNI step's entries of activation block b (32 inputs; q and bias4 already made): qt (8 bytes at a time)
 * and bias16 */
static void quantize_hq3_r_order(const int8_t *q, int64_t b, const ActRow *a) {
    for (int64_t i = 0; i < 32; i += 8) memcpy(a->qt + qt_index(32 * b + i), q + i, 8);
    for (int64_t h = 0; h < 2; h++) {
        const int32_t *b4 = a->bias4 + 8 * b + 4 * h;
        a->bias16[2 * b + h] = b4[0] + b4[1] + b4[2] + b4[3];
    }
}

/* Activation block b of x (K bfloat16) -> its entries of the ActRow: d[b] = max|x_block| / 127, q = round(x * 127 /
 * max) to nearest even, the int32 sums of q per `sum_every` inputs (16 or 32) and, for 16, per 32 (sums32) and the
 * per-16 sums again as int16 (sums16); with a->qk / a->qn, q again in qk's / qn's order (and, per = 32, biasn and
 * off8n). Each block's values depend on that block alone, so the threads of a GEMV quantize the blocks in any split
 * and the row is the same bytes. AVX2 (the values do not depend on the instruction set: IEEE multiply, round to
 * nearest even). */
AVX2_ONLY_TARGET static void quantize_block(const uint16_t *x, int64_t b, int64_t per, int64_t sum_every,
                                            const ActRow *a) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const uint16_t *xb = x + b * per;
    __m256 largest = _mm256_setzero_ps();
    for (int64_t i = 0; i < per; i += 8) {
        const __m256 v = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(xb + i))), 16));
        largest = _mm256_max_ps(largest, _mm256_andnot_ps(sign, v));
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, largest);
    float top = lanes[0];
    for (int j = 1; j < 8; j++) top = lanes[j] > top ? lanes[j] : top;
    a->d[b] = top / 127.0f;
    const __m256 to_int = _mm256_set1_ps(top > 0.0f ? 127.0f / top : 0.0f);
    int8_t *q = a->q + b * per;
    for (int64_t i = 0; i < per; i += 8) {
        const __m256 v = _mm256_castsi256_ps(
            _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(xb + i))), 16));
        int32_t iq[8];
        _mm256_storeu_si256((__m256i *)iq, _mm256_cvtps_epi32(_mm256_mul_ps(v, to_int)));
        for (int j = 0; j < 8; j++) q[i + j] = (int8_t)iq[j]; /* |q| <= 127 */
    }
    int32_t *sums = a->sums + b * (per / sum_every);
    for (int64_t s = 0; s < per / sum_every; s++) {
        int32_t total = 0;
        for (int64_t j = 0; j < sum_every; j++) total += q[s * sum_every + j];
        sums[s] = total;
    }
    if (sum_every == 16) {
        for (int64_t s = 0; s < per / 32; s++) a->sums32[b * (per / 32) + s] = sums[2 * s] + sums[2 * s + 1];
        for (int64_t s = 0; s < per / 16; s++) a->sums16[b * (per / 16) + s] = (int16_t)sums[s];
    }
    if (a->bias4 != NULL)
        for (int64_t s = 0; s < per / 4; s++) {
            a->bias4[b * (per / 4) + s] = -128 * (q[4 * s] + q[4 * s + 1] + q[4 * s + 2] + q[4 * s + 3]);
            if (s % 4 == 0) a->dxs[dxs_lane(b * (per / 16) + s / 4)] = a->d[b];
        }
    if (a->qt != NULL) quantize_hq3_r_order(q, b, a);
    if (a->qn != NULL)
        for (int64_t i = 0; i < per; i += 16) memcpy(a->qn + qn_index(b * per + i), q + i, 16);
    if (a->qn != NULL && a->bias4 != NULL) { /* per = 32 */
        for (int64_t s = 0; s < 8; s++) a->biasn[qn_index(32 * b + 4 * s) / 4] = a->bias4[8 * b + s];
        int32_t *off = a->off8n + 16 * (b / 4) + 4 * (b % 4);
        off[0] = -8 * a->sums[b];
        off[1] = off[2] = off[3] = 0;
    }
    if (a->startxs != NULL) /* per = 256 */
        for (int64_t c = 0; c < 8; c++)
            for (int64_t l = 0; l < 4; l++) {
                const int8_t *s = q + 32 * c + 4 * l;
                a->startxs[32 * b + 16 * (c / 4) + 4 * (c % 4) + l] =
                    -128 * (s[0] + s[1] + s[2] + s[3] + s[16] + s[17] + s[18] + s[19]);
            }
    if (a->qa != NULL) /* |q| <= 127: vpabsb never meets -128 */
        for (int64_t i = 0; i < per; i += 32)
            _mm256_storeu_si256((__m256i *)(a->qa + b * per + i),
                                _mm256_abs_epi8(_mm256_loadu_si256((const __m256i *)(q + i))));
    if (a->q3k != NULL) /* per = 256 */
        for (int64_t i = 0; i < per; i += 32) memcpy(a->q3k + b * per + 64 * (i % 128 / 32) + i / 128 * 32, q + i, 32);
    if (a->qk != NULL)
        for (int64_t i = 0; i < per; i += 32) {
            const int64_t quarter = i % 128 / 32; /* 0 1 2 3 -> 0 2 1 3 */
            memcpy(a->qk + b * per + i - 32 * quarter + 32 * ((quarter & 1) * 2 + (quarter >> 1)), q + i, 32);
        }
}

/* One weight of a (possibly fused) block GEMV: n rows of `row_bytes` bytes (nb blocks) of GGUF type `type`, outputs
 * at y; row: the activation row it reads (0: blocks of 32, for the 32- and 64-weight types; 1: of 256). */
typedef struct {
    const uint8_t *weight;
    int64_t type, n, row_bytes, nb, row;
    uint16_t *y;
} BlockPart;

#define BK_TARGET AVX512_TARGET
#define BK_SUFFIX vnni
#define BK_DOT(acc, u, s) _mm256_dpbusd_epi32((acc), (u), (s))
#define BK_MASKED 1 /* AVX512BW byte masks for a 32-bit field of high bits */
#include "blocks_body.h"
#undef BK_TARGET
#undef BK_SUFFIX
#undef BK_DOT
#undef BK_MASKED

/* the R8 GEMVs (blocks_r8_body.h, after the AVX2 body whose helpers they use), dispatched from its part_rows_ */
AVX2_ONLY_TARGET static void r8_rows_avx2(int type, const uint8_t *weight, const ActRow *a, uint16_t *y, int64_t n,
                                          int64_t row_bytes, int64_t nb);
/* Q3_K's (blocks_r8k_body.h), dispatched from r8_rows_avx2 */
AVX2_ONLY_TARGET static void r8k_rows_avx2(int type, const uint8_t *weight, const ActRow *a, uint16_t *y, int64_t n,
                                           int64_t row_bytes, int64_t nb);

#define BK_TARGET AVX2_ONLY_TARGET
#define BK_SUFFIX avx2
#define BK_DOT(acc, u, s) \
    _mm256_add_epi32((acc), _mm256_madd_epi16(_mm256_maddubs_epi16((u), (s)), _mm256_set1_epi16(1)))
#define BK_MASKED 0
#include "blocks_body.h"
#undef BK_TARGET
#undef BK_SUFFIX
#undef BK_DOT
#undef BK_MASKED

#include "blocks_r8_body.h"
#include "blocks_r8k_body.h"

/* One block of `type` -> its float32 weights (32, 64 or 256), computed as w = d * sc * q - dmin * m etc. in float32
 * (the formulas of hfquant.core.blocks' dequantizers, possibly in another order: within a float32 rounding of them);
 * d_row: the row header's scale (HQ3_R), unused by the other types */
static void decode_block(int type, const uint8_t *w, float d_row, float *out) {
    switch (type) {
        case HQ3_R: { /* hq3r.dequantize_hq3_r's order: (D * LEVELS[e]), negated, times the grid value */
            for (int i = 0; i < 4; i++) {
                const float s = hq3r_scale(w, i, d_row);
                for (int j = 0; j < 16; j++) {
                    const int e = 16 * i + j, l = e % 32;
                    const uint8_t *g = w + 3 + 12 * (e / 32);
                    const int u = ((g[l % 8] >> (2 * (l / 8))) & 3) | (((g[8 + l / 8] >> (l % 8)) & 1) << 2);
                    out[e] = s * (float)HQ3_NL_GRID[u];
                }
            }
            return;
        }
        case GGML_Q4_0: case GGML_Q4_1: case GGML_Q5_0: case GGML_Q5_1: case GGML_IQ4_NL: {
            const int affine = type == GGML_Q4_1 || type == GGML_Q5_1, five = type == GGML_Q5_0 || type == GGML_Q5_1;
            const float d = fp16_to_float(w), m = affine ? fp16_to_float(w + 2) : 0.0f;
            uint32_t qh = 0;
            if (five) memcpy(&qh, w + 2 + 2 * affine, 4);
            const uint8_t *qs = w + 2 + 2 * affine + 4 * five;
            for (int i = 0; i < 32; i++) {
                const int nibble = i < 16 ? qs[i] & 15 : qs[i - 16] >> 4;
                if (type == GGML_IQ4_NL) {
                    out[i] = d * (float)IQ4_GRID[nibble];
                    continue;
                }
                const int u = nibble | (five ? (int)((qh >> i) & 1) << 4 : 0);
                out[i] = affine ? d * (float)u + m : d * (float)(u - (five ? 16 : 8));
            }
            return;
        }
        case GGML_Q8_0: {
            const float d = fp16_to_float(w);
            for (int i = 0; i < 32; i++) out[i] = d * (float)(int8_t)w[2 + i];
            return;
        }
        case HQ3_0: case HQ3_NL: {
            const float d = fp16_to_float(w);
            for (int i = 0; i < 32; i++) {
                const int u = ((w[2 + i % 8] >> (2 * (i / 8))) & 3) | (((w[10 + i / 8] >> (i % 8)) & 1) << 2);
                out[i] = d * (float)(type == HQ3_NL ? HQ3_NL_GRID[u] : u - 4);
            }
            return;
        }
        case GGML_IQ4_XS: {
            const float d = fp16_to_float(w);
            uint16_t high;
            memcpy(&high, w + 2, 2);
            for (int j = 0; j < 8; j++) {
                const int ls = ((w[4 + j / 2] >> (4 * (j % 2))) & 15) | (((high >> (2 * j)) & 3) << 4);
                const float dl = d * (float)(ls - 32);
                const uint8_t *qs = w + 8 + 16 * j;
                for (int i = 0; i < 32; i++) out[32 * j + i] = dl * (float)IQ4_GRID[i < 16 ? qs[i] & 15 : qs[i - 16] >> 4];
            }
            return;
        }
        case GGML_Q4_K: case GGML_Q5_K: {
            const int five = type == GGML_Q5_K;
            uint8_t sc[8], mn[8];
            k4_scales(w + 4, sc, mn);
            const float d = fp16_to_float(w), dmin = fp16_to_float(w + 2);
            const uint8_t *qh = w + 16, *qs = w + (five ? 48 : 16);
            for (int e = 0; e < 256; e++) {
                const int j = e / 64, l = e % 32, hi = (e / 32) % 2, s = e / 32;
                int u = hi ? qs[32 * j + l] >> 4 : qs[32 * j + l] & 15;
                if (five) u |= ((qh[l] >> s) & 1) << 4;
                out[e] = d * (float)sc[s] * (float)u - dmin * (float)mn[s];
            }
            return;
        }
        case GGML_Q6_K: {
            const int8_t *sc = (const int8_t *)(w + 192);
            const float d = fp16_to_float(w + 208);
            for (int e = 0; e < 256; e++) {
                const int h = e / 128, i = (e % 128) / 32, l = e % 32;
                const uint8_t low = w[64 * h + 32 * (i % 2) + l];
                const int u = (i < 2 ? low & 15 : low >> 4) | (((w[128 + 32 * h + l] >> (2 * i)) & 3) << 4);
                out[e] = d * (float)sc[e / 16] * (float)(u - 32);
            }
            return;
        }
        case GGML_Q3_K: {
            int8_t sc[16];
            k3_scales(w + 96, sc);
            const float d = fp16_to_float(w + 108);
            for (int e = 0; e < 256; e++) {
                const int h = e / 128, j = (e % 128) / 32, l = e % 32;
                const int u = ((w[32 + 32 * h + l] >> (2 * j)) & 3) | (((w[l] >> (4 * h + j)) & 1) << 2);
                out[e] = d * (float)sc[e / 16] * (float)(u - 4);
            }
            return;
        }
        case GGML_Q2_K: {
            const float d = fp16_to_float(w + 80), dmin = fp16_to_float(w + 82);
            for (int e = 0; e < 256; e++) {
                const int h = e / 128, j = (e % 128) / 32, l = e % 32, s = w[e / 16];
                const int u = (w[16 + 32 * h + l] >> (2 * j)) & 3;
                out[e] = d * (float)(s & 15) * (float)u - dmin * (float)(s >> 4);
            }
            return;
        }
        default: return;
    }
}

/* hfquant_block_dequantize_t: rows start..stop-1 of the (N, K) block weight, dequantized (decode_block) and rounded
 * once to bfloat16 (out_float32 = 0) or kept in float32 (1: for CPUs whose float GEMM runs in float32,
 * hfquant.ops.machine.gemm_dtype), written transposed into out (K, stop - start): the operand torch.mm reads in the
 * chunked prefill GEMM. OpenMP threads split the rows. Returns 1 for an unknown type, K not whole blocks or a bad row
 * range. */
int hfquant_block_dequantize_t(const uint8_t *weight, void *out, int64_t n, int64_t k, int64_t type, int64_t start,
                               int64_t stop, int64_t out_float32) {
    int64_t block, bytes;
    block_shape((int)type, &block, &bytes);
    if (!block || k <= 0 || k % block || start < 0 || stop > n || start >= stop) return 1;
    const int64_t nb = k / block, cols = stop - start, header = row_header((int)type), row_bytes = header + nb * bytes;
    /* an R8 or R16 weight: each block gathered back to its plain type's bytes, then decoded as those */
    const int plain = (int)(type & ~(int64_t)(BLOCK_ROWS8 | BLOCK_ROWS16));
    int group_rows = 1;
    const int16_t *map = type & (BLOCK_ROWS8 | BLOCK_ROWS16) ? rows_map(type, &group_rows) : NULL;
    /* A tile of DEQ_TILE rows at a time, block by block: each output row (one input feature) then gets DEQ_TILE
     * adjacent values per write instead of one value per cache line (the transposed writes cost most of the time). */
    enum { DEQ_TILE = 16 };
    /* one tile (a decode step's embedding row) runs on the calling thread: no team to wake for a few microseconds */
#pragma omp parallel for schedule(static) if (cols > DEQ_TILE)
    for (int64_t r0 = start; r0 < stop; r0 += DEQ_TILE) {
        float values[DEQ_TILE][256];
        uint8_t gathered[256]; /* an R8 weight's block in GGUF's bytes */
        const int64_t rows = stop - r0 < DEQ_TILE ? stop - r0 : DEQ_TILE;
        for (int64_t b = 0; b < nb; b++) {
            for (int64_t t = 0; t < rows; t++) {
                const uint8_t *row = weight + (r0 + t) * row_bytes;
                if (map != NULL) {
                    rows_gather(weight, r0 + t, b, row_bytes, bytes, map, group_rows, gathered);
                    decode_block(plain, gathered, 0.0f, values[t]);
                    continue;
                }
                decode_block((int)type, row + header + b * bytes, header ? fp16_to_float(row) : 0.0f, values[t]);
            }
            for (int64_t i = 0; i < block; i++) {
                const int64_t at = (b * block + i) * cols + (r0 - start);
                if (out_float32)
                    for (int64_t t = 0; t < rows; t++) ((float *)out)[at + t] = values[t][i];
                else
                    for (int64_t t = 0; t < rows; t++) ((uint16_t *)out)[at + t] = float_to_bf16(values[t][i]);
            }
        }
    }
    return 0;
}

int hfquant_block_gemv_supported(int64_t type) {
    int64_t block, bytes;
    block_shape((int)type, &block, &bytes);
    /* R8 codes: blocks_r8_body.h's AVX2 GEMVs, on AVX-512 CPUs too (a model interleaved on an AVX2 CPU and pickled
     * must still run there, `hfquant_block_gemv_group` takes the AVX2 parts for a call with an R8 part); the plan
     * interleaves only where the VNNI row kernels do not run (native.block_rows8_supported) */
    if (type & BLOCK_ROWS8) return block > 0 && cpu_avx2();
    if (type & BLOCK_ROWS16) return block > 0 && cpu_vnni(); /* the VNNI body's GEMV only */
    return block > 0 && (cpu_vnni() || cpu_avx2());
}

/* The activation row's scratch: d, q, sums, sums32, sums16, (activation blocks of 32 on AVX-512: starts) bias4, dxs,
 * qt, bias16, (Q4_K / Q5_K on AVX-512: k4) qk, (IQ4_XS and the 32-weight 4- and 5-bit types: nibbles) qn and (on
 * AVX-512 also starts) biasn, off8n, (IQ4_XS on AVX-512) startxs, (Q3_K's GFNI step) q3k in one buffer, each part
 * 64-byte aligned; on the caller's stack up to ACT_STACK bytes (K up to about 40000 inputs, 26000 for Q3_K's GFNI
 * step, 21000 for IQ4_XS on AVX-512, 10000 with starts and nibbles: the 1.2B's down projection, K = 8192, stays
 * there), else one allocation. */
enum { ACT_STACK = 65536 };

static int64_t act_layout(int64_t k, int64_t block, int64_t sum_every, int starts, int k4, int nibbles, int xs,
                          int q3k, int magnitudes, int64_t offsets[16]) {
    const int64_t groups = (k + 255) / 256; /* dxs, qt, bias16: whole groups of 256 inputs */
    const int64_t whole = (k + 127) / 128 * 128, nibble_starts = nibbles && starts; /* qn: whole groups of 128 */
    const int64_t sizes[16] = {(k / block) * 4,      k,
                               (k / sum_every) * 4,  (k / 32) * 4,
                               (k / sum_every) * 2,  starts ? k : 0 /* bias4 */,
                               starts ? groups * 64 : 0 /* dxs */, starts ? groups * 256 : 0 /* qt */,
                               starts ? groups * 64 : 0 /* bias16 */, k4 ? k : 0 /* qk */,
                               nibbles ? whole : 0 /* qn */, nibble_starts ? whole : 0 /* biasn */,
                               nibble_starts ? whole / 2 : 0 /* off8n */, xs ? k / 2 : 0 /* startxs */,
                               q3k ? k : 0 /* q3k */, magnitudes ? k : 0 /* qa */};
    int64_t total = 0;
    for (int i = 0; i < 16; i++) {
        offsets[i] = total;
        total += (sizes[i] + 63) & ~(int64_t)63;
    }
    return total;
}

/* Activation row r (0: blocks of 32, 1: of 256) with the orders the parts reading it need, its scratch at base
 * (act_layout's parts); returns the scratch's bytes (only them when base is NULL) */
static int64_t act_row(ActRow *a, uint8_t *base, int64_t k, int r, const BlockPart *parts, int64_t count, int vnni) {
    const int64_t per = r ? 256 : 32, sum_every = r ? 16 : 32;
    const int starts = vnni && !r; /* the AVX-512 steps of HQ3_R and IQ4_NL read bias4 (HQ3_R also dxs) */
    /* HQ3_R's GFNI step reads qt and bias16; Q4_K and Q5_K's qk; IQ4_XS, Q4_0, Q4_1, Q5_0, Q5_1 and IQ4_NL qn (Q4_0,
     * Q5_0 and IQ4_NL with off8n / biasn) */
    int transposed = 0, k4 = 0, nibbles = 0, xs = 0, q3k = 0, magnitudes = 0;
    for (int64_t p = 0; p < count; p++) {
        const int64_t t = parts[p].type;
        if (parts[p].row != r) continue;
        magnitudes |= (t & BLOCK_ROWS8) && t != (GGML_Q3_K | BLOCK_ROWS8); /* the R8 GEMVs of the grids read qa */
        transposed |= t == HQ3_R_GFNI;
        k4 |= vnni && (t == GGML_Q4_K || t == GGML_Q5_K);
        xs |= vnni && t == GGML_IQ4_XS;
        q3k |= t == Q3_K_GFNI;
        nibbles |= t == GGML_IQ4_XS || t == GGML_Q4_0 || t == GGML_IQ4_NL || t == GGML_Q4_1 || t == GGML_Q5_0 ||
                   t == GGML_Q5_1;
    }
    int64_t at[16];
    const int64_t need = act_layout(k, per, sum_every, starts, k4, nibbles, xs, q3k, magnitudes, at);
    if (base == NULL) return need;
    a->d = (float *)(base + at[0]);
    a->q = (int8_t *)(base + at[1]);
    a->sums = (int32_t *)(base + at[2]);
    a->sums32 = (int32_t *)(base + at[3]);
    a->sums16 = (int16_t *)(base + at[4]);
    a->bias4 = starts ? (int32_t *)(base + at[5]) : NULL;
    a->dxs = starts ? (float *)(base + at[6]) : NULL;
    a->qt = transposed ? (int8_t *)(base + at[7]) : NULL;
    a->bias16 = transposed ? (int32_t *)(base + at[8]) : NULL;
    a->qk = k4 ? (int8_t *)(base + at[9]) : NULL;
    a->qn = nibbles ? (int8_t *)(base + at[10]) : NULL;
    a->biasn = nibbles && starts ? (int32_t *)(base + at[11]) : NULL;
    a->off8n = nibbles && starts ? (int32_t *)(base + at[12]) : NULL;
    a->startxs = xs ? (int32_t *)(base + at[13]) : NULL;
    a->q3k = q3k ? (int8_t *)(base + at[14]) : NULL;
    a->qa = magnitudes ? (int8_t *)(base + at[15]) : NULL;
    return need;
}

int hfquant_block_gemv_group(const uint16_t *x, const uint8_t *const *weights, const int64_t *types, const int64_t *ns,
                             uint16_t *y, int64_t count, int64_t k) {
    enum { MAX_PARTS = 8 };
    if (count < 1 || count > MAX_PARTS || k <= 0) return 1;
    int rows8 = 0; /* an R8 part: the whole call on the AVX2 parts, whose bodies are the only R8 GEMVs */
    for (int64_t p = 0; p < count; p++) rows8 |= (types[p] & BLOCK_ROWS8) != 0;
    const int vnni = cpu_vnni() && !rows8;
    BlockPart parts[MAX_PARTS];
    int64_t offset = 0, act_blocks[2] = {0, 0}; /* activation blocks of 32 and of 256 (0: no part reads that row) */
    for (int64_t p = 0; p < count; p++) {
        int64_t block, bytes;
        block_shape((int)types[p], &block, &bytes);
        if (!block || !hfquant_block_gemv_supported(types[p]) || ns[p] <= 0 || k % block) return 1;
        if ((types[p] & BLOCK_ROWS8) && ns[p] % 8) return 1; /* R8: whole groups of 8 rows */
        if ((types[p] & BLOCK_ROWS16) && (ns[p] % 16 || !vnni)) return 1; /* R16: 16 rows, the VNNI body */
        parts[p].weight = weights[p];
        parts[p].type = row_type(types[p], vnni);
        parts[p].n = ns[p];
        parts[p].nb = k / block;
        parts[p].row_bytes = row_header((int)types[p]) + parts[p].nb * bytes;
        parts[p].row = block == 256; /* HQ3_R's 64-weight blocks: activation blocks of 32, two each */
        parts[p].y = y + offset;
        act_blocks[parts[p].row] = k / (block == 256 ? 256 : 32);
        offset += ns[p];
    }
    int64_t need[2] = {0, 0};
    for (int r = 0; r < 2; r++)
        if (act_blocks[r]) need[r] = act_row(NULL, NULL, k, r, parts, count, vnni);
    _Alignas(64) uint8_t local[ACT_STACK];
    uint8_t *scratch = need[0] + need[1] <= ACT_STACK ? local : (uint8_t *)_mm_malloc((size_t)(need[0] + need[1]), 64);
    if (scratch == NULL) return 2;
    ActRow rows[2];
    memset(rows, 0, sizeof rows);
    for (int r = 0; r < 2; r++)
        if (act_blocks[r]) act_row(rows + r, scratch + (r ? need[0] : 0), k, r, parts, count, vnni);
    if (vnni)
        gemv_parts_vnni(x, rows, act_blocks, parts, count);
    else
        gemv_parts_avx2(x, rows, act_blocks, parts, count);
    if (scratch != local) _mm_free(scratch);
    return 0;
}

int hfquant_block_gemv(const uint16_t *x, const uint8_t *weight, uint16_t *y, int64_t n, int64_t k, int64_t type) {
    return hfquant_block_gemv_group(x, &weight, &type, &n, y, 1, k);
}

#else

static int r16_interleave_xs(const uint8_t *src, uint8_t *dst, int64_t n, int64_t nb) {
    (void)src; (void)dst; (void)n; (void)nb;
    return 0;
}

int hfquant_block_gemv_supported(int64_t type) {
    (void)type;
    return 0;
}

int hfquant_block_gemv(const uint16_t *x, const uint8_t *weight, uint16_t *y, int64_t n, int64_t k, int64_t type) {
    (void)x; (void)weight; (void)y; (void)n; (void)k; (void)type;
    return 1;
}

int hfquant_block_gemv_group(const uint16_t *x, const uint8_t *const *weights, const int64_t *types, const int64_t *ns,
                             uint16_t *y, int64_t count, int64_t k) {
    (void)x; (void)weights; (void)types; (void)ns; (void)y; (void)count; (void)k;
    return 1;
}

int hfquant_block_dequantize_t(const uint8_t *weight, void *out, int64_t n, int64_t k, int64_t type, int64_t start,
                               int64_t stop, int64_t out_float32) {
    (void)weight; (void)out; (void)n; (void)k; (void)type; (void)start; (void)stop; (void)out_float32;
    return 1;
}

#endif
