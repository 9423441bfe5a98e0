/* The instruction sets hfquant's kernels may use in this process: the one place that decides which body of a kernel
 * with several runs (blocks_cpu.c's VNNI or AVX2 body and its HQ3_R's GFNI or shift step, int8_cpu.c's W8A16 (VNNI or
 * AVX2) or float body, int4_intdot_cpu.c's AVX-512 or AVX2 W4A8 GEMV, sinq_cpu.c's AVX-512, AVX2 or portable pass,
 * iq4_search_cpu.c's AVX-512, AVX2 or portable IQ4 search, bf16_cpu.c's AVX512-BF16 or AVX2 bfloat16 GEMV and
 * AVX-512, AVX2 or C bfloat16 x float32 GEMV) and whether the AVX-512 kernels run at all
 * (hfquant_int4_cpu_supported). Every such check asks hfquant_isa().
 *
 * hfquant_isa() returns the HFQUANT_ISA_* bits (hfquant_kernels.h) of what the CPU has (__builtin_cpu_supports),
 * lowered by the environment variable HFQUANT_ISA, read once when the library loads:
 *   unset, "" or "native": everything the CPU has;
 *   "avx512vnni": AVX-512 F/BW/VL, BF16 and VNNI without VBMI, BITALG and GFNI, as on Cascade / Cooper Lake (the
 *     block GEMVs' VNNI body with HQ3_R's shift step instead of its GFNI one);
 *   "avx512": AVX-512 F/BW/VL and BF16 without VNNI (the int8 GEMV's float body; the block GEMVs' AVX2 body);
 *   "avx2": AVX2, FMA and F16C only, as on a CPU without AVX-512 (Haswell to Zen 3): the AVX-512 kernels refuse,
 *     the block, W4A8 and int8 GEMVs and the IQ4 search take their AVX2 bodies;
 *   "generic": none (every x86 kernel refuses; hfquant computes with torch ops).
 * So tests (and anyone checking a report from an AVX2 machine) run the other bodies on an AVX-512 machine without a
 * rebuild: the bodies of one kernel use the same integers, the outputs are compared in tests/ops/test_isa.py. A value
 * HFQUANT_ISA can only lower what the CPU has. Any other value gives HFQUANT_ISA_REFUSED alone (no kernel runs;
 * hfquant.ops.native raises ValueError naming the value).
 *
 * Not covered: rtn_cpu.c's AVX-512 loops (chosen when compiling, -DRTN_FORCE_GENERIC) and the target_clones of
 * sinq_cpu.c, blocks_quant_cpu.c, fold_chunk_cpu.c and bf16_cpu.c's C body (the loader picks the clone for the CPU;
 * the clones are the same C code).
 */
#include <stdlib.h>
#include <string.h>

#include "hfquant_kernels.h"

static int isa_bits = HFQUANT_ISA_REFUSED; /* set when the library loads (read_isa) */

int hfquant_isa(void) { return isa_bits; }

/* what the CPU has, as HFQUANT_ISA_* bits */
static int cpu_bits(void) {
    int bits = 0;
#if defined(__x86_64__) && defined(__GNUC__)
    __builtin_cpu_init(); /* needed before any constructor-time __builtin_cpu_supports */
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
        bits |= HFQUANT_ISA_AVX2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl"))
        bits |= HFQUANT_ISA_AVX512;
    if (__builtin_cpu_supports("avx512bf16")) bits |= HFQUANT_ISA_AVX512_BF16;
    if (__builtin_cpu_supports("avx512vnni")) bits |= HFQUANT_ISA_AVX512_VNNI;
    if (__builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("avx512bitalg") &&
        __builtin_cpu_supports("gfni"))
        bits |= HFQUANT_ISA_AVX512_VBMI_GFNI;
#endif
    return bits;
}

/* the bits HFQUANT_ISA allows (-1: all), HFQUANT_ISA_REFUSED for a value not understood */
static int allowed_bits(const char *value) {
    if (value == NULL || !strcmp(value, "") || !strcmp(value, "native")) return -1;
    if (!strcmp(value, "avx512vnni"))
        return HFQUANT_ISA_AVX2 | HFQUANT_ISA_AVX512 | HFQUANT_ISA_AVX512_BF16 | HFQUANT_ISA_AVX512_VNNI;
    if (!strcmp(value, "avx512")) return HFQUANT_ISA_AVX2 | HFQUANT_ISA_AVX512 | HFQUANT_ISA_AVX512_BF16;
    if (!strcmp(value, "avx2")) return HFQUANT_ISA_AVX2;
    if (!strcmp(value, "generic")) return 0;
    return HFQUANT_ISA_REFUSED;
}

__attribute__((constructor)) static void read_isa(void) {
    const int allowed = allowed_bits(getenv("HFQUANT_ISA"));
    isa_bits = allowed == HFQUANT_ISA_REFUSED ? HFQUANT_ISA_REFUSED : cpu_bits() & allowed;
}
