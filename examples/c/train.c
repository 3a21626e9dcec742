/* train.c — the smallest complete training loop through libctr's C ABI.
 *
 * Builds a tiny GPT in memory (no graph file), makes its own byte-level text,
 * trains 60 steps on one CPU rank and prints the loss every 10. It uses nothing
 * but include/ctr/ctr.h, so it is also the template for a host program in C and
 * the shape every language binding wraps.
 *
 * It doubles as a test: it exits with status 1 if any call fails (printing the
 * status name and ctr_last_error(), which says what and where), and also if the
 * final loss is not below the first, i.e. if training did not train.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ctr/ctr.h"

enum { BATCH = 8, SEQ = 64, STEPS = 60, TEXT_BYTES = 1 << 16 };

/* Every libctr handle this program may hold, so one function can free them
 * all on any exit path. _free(NULL) is a no-op, so unset handles are fine. */
typedef struct {
  ctr_options *options;
  ctr_graph *graph;
  ctr_mesh *mesh;
  ctr_step *step;
  unsigned char *text;
  int32_t *tokens;
  int32_t *targets;
} handles;

static void release(handles *h) {
  ctr_step_free(h->step);
  ctr_mesh_free(h->mesh);
  ctr_graph_free(h->graph);
  ctr_options_free(h->options);
  free(h->text);
  free(h->tokens);
  free(h->targets);
}

/* Reports a failed call and ends the program. The message must be read before
 * any other libctr call, which would replace it. */
static void check(ctr_status status, const char *what, handles *h) {
  if (status == CTR_STATUS_OK) return;
  fprintf(stderr, "train: %s failed: %s: %s\n", what, ctr_status_string(status),
          ctr_last_error());
  release(h);
  exit(1);
}

/* A small xorshift generator: the example's own randomness, independent of the
 * library, so the text and the batches are the same on every run. */
static uint32_t next_random(uint32_t *state) {
  uint32_t x = *state;
  x ^= x << 13;
  x ^= x >> 17;
  x ^= x << 5;
  *state = x;
  return x;
}

/* Byte-level text: short sentences from a few word lists, repetitive enough
 * that a 2-layer model learns it within tens of steps. */
static void make_text(unsigned char *text, size_t size) {
  static const char *const names[] = {"the cat", "a dog", "the bird", "my friend", "the fox"};
  static const char *const verbs[] = {"sees", "likes", "follows", "finds"};
  static const char *const things[] = {"the red ball", "a small fish", "the old tree",
                                       "a green leaf"};
  uint32_t rng = 12345;
  size_t at = 0;
  while (at < size) {
    char sentence[128];
    int n = snprintf(sentence, sizeof sentence, "%s %s %s. ", names[next_random(&rng) % 5],
                     verbs[next_random(&rng) % 4], things[next_random(&rng) % 4]);
    size_t i;
    for (i = 0; i < (size_t)n && at < size; ++i) text[at++] = (unsigned char)sentence[i];
  }
}

int main(void) {
  handles h;
  size_t i;
  int64_t params = 0, arena = 0, param_bytes = 0, optimizer_bytes = 0;
  double first_loss = 0.0, loss = 0.0;
  uint32_t rng = 7;
  int step;
  const size_t count = (size_t)BATCH * SEQ; /* elements of each input */

  memset(&h, 0, sizeof h);

  /* The model: gpt preset, small enough to train in seconds on a CPU. */
  check(ctr_options_create(&h.options), "ctr_options_create", &h);
  check(ctr_options_set_int(h.options, "layers", 2), "set layers", &h);
  check(ctr_options_set_int(h.options, "dim", 128), "set dim", &h);
  check(ctr_options_set_int(h.options, "heads", 4), "set heads", &h);
  check(ctr_options_set_int(h.options, "vocab", 256), "set vocab", &h);
  check(ctr_options_set_int(h.options, "seq", SEQ), "set seq", &h);
  check(ctr_graph_create_preset("gpt", h.options, &h.graph), "ctr_graph_create_preset", &h);
  ctr_options_free(h.options);
  h.options = NULL;
  check(ctr_graph_param_count(h.graph, &params), "ctr_graph_param_count", &h);

  /* One CPU rank; NULL options take every default. */
  check(ctr_mesh_create(NULL, &h.mesh), "ctr_mesh_create", &h);

  /* The compiled step: autodiff, memory plan, AdamW state. */
  check(ctr_options_create(&h.options), "ctr_options_create", &h);
  check(ctr_options_set_int(h.options, "batch", BATCH), "set batch", &h);
  check(ctr_options_set_int(h.options, "seq", SEQ), "set seq", &h);
  check(ctr_options_set_float(h.options, "lr", 1e-3), "set lr", &h);
  check(ctr_options_set_int(h.options, "warmup_steps", 10), "set warmup_steps", &h);
  check(ctr_step_create(h.mesh, h.graph, h.options, &h.step), "ctr_step_create", &h);
  ctr_options_free(h.options);
  h.options = NULL;
  check(ctr_step_memory(h.step, &arena, &param_bytes, &optimizer_bytes), "ctr_step_memory", &h);
  printf("gpt: %lld params, %.1f MiB planned\n", (long long)params,
         (double)(arena + param_bytes + optimizer_bytes) / (1024.0 * 1024.0));

  h.text = (unsigned char *)malloc(TEXT_BYTES);
  h.tokens = (int32_t *)malloc(count * sizeof(int32_t));
  h.targets = (int32_t *)malloc(count * sizeof(int32_t));
  if (h.text == NULL || h.tokens == NULL || h.targets == NULL) {
    fprintf(stderr, "train: out of memory\n");
    release(&h);
    return 1;
  }
  make_text(h.text, TEXT_BYTES);

  for (step = 1; step <= STEPS; ++step) {
    ctr_step_metrics metrics;
    int row;
    /* Each row is SEQ + 1 consecutive bytes from a random offset; the target
     * of each position is the byte after it. */
    for (row = 0; row < BATCH; ++row) {
      size_t start = next_random(&rng) % (TEXT_BYTES - SEQ - 1);
      for (i = 0; i < SEQ; ++i) {
        h.tokens[row * SEQ + i] = h.text[start + i];
        h.targets[row * SEQ + i] = h.text[start + i + 1];
      }
    }
    check(ctr_step_set_input(h.step, "tokens", h.tokens, count * sizeof(int32_t)),
          "ctr_step_set_input(tokens)", &h);
    check(ctr_step_set_input(h.step, "targets", h.targets, count * sizeof(int32_t)),
          "ctr_step_set_input(targets)", &h);

    memset(&metrics, 0, sizeof metrics);
    metrics.size = sizeof metrics; /* tells the library how much this caller knows */
    check(ctr_step_run(h.step, &metrics), "ctr_step_run", &h);
    loss = metrics.loss;
    if (step == 1) first_loss = loss;
    if (step == 1 || step % 10 == 0)
      printf("step %2d | loss %.4f | lr %.2e | %.0f ms\n", step, loss, metrics.lr,
             metrics.step_ms);
  }

  release(&h);
  if (!(loss < first_loss)) {
    fprintf(stderr, "train: the loss did not fall: %.4f at step 1, %.4f at step %d\n",
            first_loss, loss, STEPS);
    return 1;
  }
  printf("loss %.4f -> %.4f\n", first_loss, loss);
  return 0;
}
