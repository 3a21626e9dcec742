/* sgemm_peak — the best single-precision GEMM rate OpenBLAS reaches on this machine.
 *
 *   cc -O2 -o sgemm_peak tools/bench/sgemm_peak.c -lopenblas
 *   ./sgemm_peak [--threads N] [--seconds S]
 *
 * Prints one JSON line: {"sgemm_gflops": best, "threads": N, ..., "shapes": [...]}.
 *
 * The benchmark drivers divide a training step's achieved FLOP rate by this number, so it is
 * measured on the shapes a small transformer actually multiplies: a square 1024^3 and the
 * (B*T) x C x 4C / (B*T) x 4C x C products of an MLP, in the row-major "x W^T" form that
 * torch.nn.Linear and libctr's CPU backend use. Each shape is timed repeatedly for a fixed
 * wall-clock budget and the fastest call counts, because the question is "what can the
 * hardware do", not "what does a cold call cost".
 */
#include <cblas.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------------------------------------ */

typedef struct {
    int m, k, n;
    int trans_b; /* 1: C = A B^T with B stored [n, k], as a linear layer's weight */
} shape;

static const shape k_shapes[] = {
    {1024, 1024, 1024, 0},
    {2048, 256, 1024, 1},
    {2048, 1024, 256, 1},
    {2048, 256, 256, 1},
    {2048, 256, 768, 1},
};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static float *alloc_filled(size_t count, unsigned *state) {
    float *p = NULL;
    if (posix_memalign((void **)&p, 64, count * sizeof(float)) != 0) return NULL;
    for (size_t i = 0; i < count; ++i) {
        /* A small LCG is enough: the values only need to be ordinary finite floats. */
        *state = *state * 1664525u + 1013904223u;
        p[i] = (float)((*state >> 8) & 0xffff) / 65536.0f - 0.5f;
    }
    return p;
}

/* Fastest time of one sgemm call on this shape, over repeated calls for `budget_s`. */
static double best_call_s(const shape *s, double budget_s, unsigned *seed) {
    float *a = alloc_filled((size_t)s->m * s->k, seed);
    float *b = alloc_filled((size_t)s->k * s->n, seed);
    float *c = alloc_filled((size_t)s->m * s->n, seed);
    if (!a || !b || !c) {
        free(a); free(b); free(c);
        return -1.0;
    }
    const enum CBLAS_TRANSPOSE tb = s->trans_b ? CblasTrans : CblasNoTrans;
    const int ldb = s->trans_b ? s->k : s->n;

    /* The first call pays for thread start-up and page faults; it is not counted. */
    cblas_sgemm(CblasRowMajor, CblasNoTrans, tb, s->m, s->n, s->k, 1.0f, a, s->k, b, ldb, 0.0f,
                c, s->n);

    double best = 1e30;
    const double start = now_s();
    int calls = 0;
    while (calls < 3 || now_s() - start < budget_s) {
        const double t0 = now_s();
        cblas_sgemm(CblasRowMajor, CblasNoTrans, tb, s->m, s->n, s->k, 1.0f, a, s->k, b, ldb,
                    0.0f, c, s->n);
        const double dt = now_s() - t0;
        if (dt < best) best = dt;
        ++calls;
    }
    free(a); free(b); free(c);
    return best;
}

/* ------------------------------------------------------------------------------------------ */

static void usage(const char *argv0) {
    fprintf(stderr, "usage: %s [--threads N] [--seconds S]\n", argv0);
}

int main(int argc, char **argv) {
    int threads = 0; /* 0: OpenBLAS's own choice (OPENBLAS_NUM_THREADS or all cores) */
    double budget_s = 0.5;
    for (int i = 1; i < argc; ++i) {
        if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc) {
            threads = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--seconds") == 0 && i + 1 < argc) {
            budget_s = atof(argv[++i]);
        } else {
            usage(argv[0]);
            return 2;
        }
    }
    if (threads > 0) openblas_set_num_threads(threads);

    const size_t n_shapes = sizeof k_shapes / sizeof k_shapes[0];
    double gflops[sizeof k_shapes / sizeof k_shapes[0]];
    double best = 0.0;
    unsigned seed = 12345u;
    for (size_t i = 0; i < n_shapes; ++i) {
        const shape *s = &k_shapes[i];
        const double t = best_call_s(s, budget_s, &seed);
        if (t <= 0.0) {
            fprintf(stderr, "sgemm_peak: out of memory for %dx%dx%d\n", s->m, s->k, s->n);
            return 1;
        }
        gflops[i] = 2.0 * s->m * s->k * s->n / t / 1e9;
        if (gflops[i] > best) best = gflops[i];
    }

    /* The config string holds no quotes or backslashes, so it is printed as is. */
    printf("{\"sgemm_gflops\": %.1f, \"threads\": %d, \"openblas\": \"%s\", \"shapes\": [",
           best, openblas_get_num_threads(), openblas_get_config());
    for (size_t i = 0; i < n_shapes; ++i) {
        const shape *s = &k_shapes[i];
        printf("%s{\"m\": %d, \"k\": %d, \"n\": %d, \"b\": \"%s\", \"gflops\": %.1f}",
               i ? ", " : "", s->m, s->k, s->n, s->trans_b ? "T" : "N", gflops[i]);
    }
    printf("]}\n");
    return 0;
}
