/* xlang.c — the reference of the cross-language bit-identity test.
 *
 * Trains a fixed recipe for 10 steps through include/ctr/ctr.h only and prints
 * `step <i> loss <%.17g>` per step. The Rust, Go and Python programs next to it
 * run the same recipe through their bindings; tests/bindings/run_xlang.py
 * checks that all outputs are byte-identical, i.e. that no binding changes a
 * value on its way through (an option typed differently, a float narrowed, a
 * buffer misaligned or a call reordered would all show up in the 17th digit).
 *
 * Recipe: gpt preset layers=2 dim=64 heads=4 vocab=256 seq=64; default mesh;
 * step batch=4 seed=1 lr=1e-3 warmup_steps=2 decay_steps=10; built-in corpus
 * loader with seq=64 seed=0, 4 rows per step into "tokens" and "targets".
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "ctr/ctr.h"

enum { LAYERS = 2, DIM = 64, HEADS = 4, VOCAB = 256, SEQ = 64, BATCH = 4, STEPS = 10 };

static ctr_options *options;
static ctr_graph *graph;
static ctr_mesh *mesh;
static ctr_step *step;
static ctr_loader *loader;

static void release(void) {
  ctr_step_free(step);
  ctr_loader_free(loader);
  ctr_mesh_free(mesh);
  ctr_graph_free(graph);
  ctr_options_free(options);
}

/* The message is read before any other libctr call, which would replace it. */
static void check(ctr_status status, const char *what) {
  if (status == CTR_STATUS_OK) return;
  fprintf(stderr, "xlang: %s failed: %s: %s\n", what, ctr_status_string(status), ctr_last_error());
  release();
  exit(1);
}

/* A fresh option set, replacing (and freeing) the previous one. */
static void fresh_options(void) {
  ctr_options_free(options);
  options = NULL;
  check(ctr_options_create(&options), "ctr_options_create");
}

int main(void) {
  static int32_t tokens[BATCH * SEQ], targets[BATCH * SEQ];
  int i;

  if (ctr_abi_version() != CTR_ABI_VERSION) {
    fprintf(stderr, "xlang: libctr ABI %d, built for %d\n", ctr_abi_version(), CTR_ABI_VERSION);
    return 1;
  }

  fresh_options();
  check(ctr_options_set_int(options, "layers", LAYERS), "set layers");
  check(ctr_options_set_int(options, "dim", DIM), "set dim");
  check(ctr_options_set_int(options, "heads", HEADS), "set heads");
  check(ctr_options_set_int(options, "vocab", VOCAB), "set vocab");
  check(ctr_options_set_int(options, "seq", SEQ), "set seq");
  check(ctr_graph_create_preset("gpt", options, &graph), "ctr_graph_create_preset");

  check(ctr_mesh_create(NULL, &mesh), "ctr_mesh_create");

  fresh_options();
  check(ctr_options_set_int(options, "batch", BATCH), "set batch");
  check(ctr_options_set_int(options, "seed", 1), "set seed");
  check(ctr_options_set_float(options, "lr", 1e-3), "set lr");
  check(ctr_options_set_int(options, "warmup_steps", 2), "set warmup_steps");
  check(ctr_options_set_int(options, "decay_steps", 10), "set decay_steps");
  check(ctr_step_create(mesh, graph, options, &step), "ctr_step_create");

  fresh_options();
  check(ctr_options_set_int(options, "seq", SEQ), "set seq");
  check(ctr_options_set_int(options, "seed", 0), "set seed");
  check(ctr_loader_create(NULL, options, &loader), "ctr_loader_create");

  for (i = 1; i <= STEPS; ++i) {
    ctr_step_metrics metrics = {0};
    metrics.size = sizeof metrics;
    check(ctr_loader_next(loader, BATCH, tokens, targets), "ctr_loader_next");
    check(ctr_step_set_input(step, "tokens", tokens, sizeof tokens), "set tokens");
    check(ctr_step_set_input(step, "targets", targets, sizeof targets), "set targets");
    check(ctr_step_run(step, &metrics), "ctr_step_run");
    printf("step %d loss %.17g\n", i, metrics.loss);
  }

  release();
  return 0;
}
