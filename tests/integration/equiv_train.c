/* One rank of a data-parallel training run, through the public C ABI only.
 *
 * usage: equiv_train PRESET MESH GLOBAL_BATCH STEPS OUT_FILE [reshard(0/1)] [micro_batches]
 *   PRESET: gpt, llama or moe (4 experts, top-2, a shared expert)
 *   Options of the program itself in the list: top_k=K (moe), zero_router=1 (moe:
 *   router weights set to zero, so every token ties and goes to experts 0..K-1),
 *   vocab=V (the words of the model and the data; 64 by default).
 *                    [KEY=VALUE,...]   (more step options, e.g. prefetch=2,recompute=all)
 *
 * Rank and world come from the environment (ctr launch sets them). Every rank
 * builds the same global batch of a learnable token pattern and feeds its own
 * contiguous slice of rows (its data share: the ranks of one tensor-parallel
 * group feed the same rows), so any mesh trains on the same data. Rank 0
 * writes one loss per line, exactly (17 significant digits), and then the checksum of
 * a few parameters, for the driver to compare across meshes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "ctr/ctr.h"

#define CHECK(call)                                                                      \
  do {                                                                                   \
    ctr_status st_ = (call);                                                             \
    if (st_ != CTR_STATUS_OK) {                                                          \
      fprintf(stderr, "%s failed: %s: %s\n", #call, ctr_status_string(st_), ctr_last_error()); \
      exit(1);                                                                           \
    }                                                                                    \
  } while (0)

int main(int argc, char **argv) {
  const char *preset, *mesh_spec, *out_path, *extra = "";
  int global_batch, steps, reshard = 1, micro = 1;
  const int T = 16;
  int V = 64;
  ctr_options *mo, *go, *so;
  ctr_mesh *mesh;
  ctr_graph *graph;
  ctr_step *step;
  int rank, world, data_rank, data_size, local, r, t, s, zero_router = 0, top_k = 2;
  int32_t *tok, *tgt;
  FILE *out = NULL;

  if (argc < 6) {
    fprintf(stderr, "usage: %s PRESET MESH GLOBAL_BATCH STEPS OUT [reshard] [micro]\n", argv[0]);
    return 2;
  }
  preset = argv[1];
  mesh_spec = argv[2];
  global_batch = atoi(argv[3]);
  steps = atoi(argv[4]);
  out_path = argv[5];
  if (argc > 6) reshard = atoi(argv[6]);
  if (argc > 7) micro = atoi(argv[7]);
  if (argc > 8) extra = argv[8];

  CHECK(ctr_options_create(&mo));
  CHECK(ctr_options_set_string(mo, "mesh", mesh_spec));
  CHECK(ctr_options_set_float(mo, "timeout", 60.0));
  /* The GPU suite runs the same programs on another device. */
  if (getenv("CTR_TEST_DEVICE") && *getenv("CTR_TEST_DEVICE"))
    CHECK(ctr_options_set_string(mo, "device", getenv("CTR_TEST_DEVICE")));
  if (getenv("CTR_TEST_TRANSPORT") && *getenv("CTR_TEST_TRANSPORT"))
    CHECK(ctr_options_set_string(mo, "transport", getenv("CTR_TEST_TRANSPORT")));
  CHECK(ctr_mesh_create_from_env(mo, &mesh));
  rank = ctr_mesh_rank(mesh);
  world = ctr_mesh_world_size(mesh);
  data_rank = ctr_mesh_data_rank(mesh);
  data_size = ctr_mesh_data_size(mesh);
  if (data_size < 1 || data_size > world || data_rank < 0 || data_rank >= data_size) {
    fprintf(stderr, "data share %d of %d on a world of %d\n", data_rank, data_size, world);
    return 1;
  }
  if (global_batch % (data_size * micro) != 0) {
    fprintf(stderr, "global batch %d does not split over %d data shares x %d micro-batches\n",
            global_batch, data_size, micro);
    return 2;
  }
  local = global_batch / data_size / micro;
  if (strstr(extra, "top_k=")) top_k = atoi(strstr(extra, "top_k=") + 6);
  if (strstr(extra, "vocab=")) V = atoi(strstr(extra, "vocab=") + 6);

  CHECK(ctr_options_create(&go));
  CHECK(ctr_options_set_int(go, "layers", 2));
  CHECK(ctr_options_set_int(go, "dim", 32));
  CHECK(ctr_options_set_int(go, "heads", 4));
  if (strcmp(preset, "gpt") != 0) CHECK(ctr_options_set_int(go, "kv_heads", 2));
  if (strcmp(preset, "moe") == 0) {
    CHECK(ctr_options_set_int(go, "experts", 4));
    CHECK(ctr_options_set_int(go, "top_k", top_k));
    CHECK(ctr_options_set_int(go, "ffn_dim", 32));
    CHECK(ctr_options_set_int(go, "shared_ffn_dim", 16));
  }
  CHECK(ctr_options_set_int(go, "vocab", V));
  CHECK(ctr_options_set_int(go, "seq", T));
  CHECK(ctr_graph_create_preset(preset, go, &graph));

  CHECK(ctr_options_create(&so));
  CHECK(ctr_options_set_int(so, "batch", local));
  CHECK(ctr_options_set_int(so, "micro_batches", micro));
  CHECK(ctr_options_set_int(so, "seed", 5));
  CHECK(ctr_options_set_float(so, "lr", 3e-3));
  CHECK(ctr_options_set_int(so, "warmup_steps", 3));
  CHECK(ctr_options_set_int(so, "decay_steps", steps));
  CHECK(ctr_options_set_float(so, "grad_clip", 0.5));
  CHECK(ctr_options_set_int(so, "reshard_after_forward", reshard));
  while (*extra) {
    char key[64], value[64], *end;
    long number;
    int used = 0;
    if (sscanf(extra, "%63[^=]=%63[^,]%n", key, value, &used) != 2) {
      fprintf(stderr, "bad step option list at '%s' (want KEY=VALUE,...)\n", extra);
      return 2;
    }
    number = strtol(value, &end, 10);
    if (strcmp(key, "zero_router") == 0)
      zero_router = (int)number;
    else if (strcmp(key, "top_k") == 0 || strcmp(key, "vocab") == 0)
      ;
    else if (*end == '\0')
      CHECK(ctr_options_set_int(so, key, number));
    else
      CHECK(ctr_options_set_string(so, key, value));
    extra += used;
    if (*extra == ',') ++extra;
  }
  {
    /* A mesh the model cannot take is refused here: say why and leave cleanly
     * (every rank refuses alike, so the mesh is torn down collectively). */
    ctr_status st = ctr_step_create(mesh, graph, so, &step);
    if (st != CTR_STATUS_OK) {
      fprintf(stderr, "ctr_step_create failed: %s: %s\n", ctr_status_string(st), ctr_last_error());
      ctr_graph_free(graph);
      ctr_mesh_free(mesh);
      ctr_options_free(mo);
      ctr_options_free(go);
      ctr_options_free(so);
      return 1;
    }
  }
  if (zero_router) {
    float zeros[4 * 32] = {0};
    CHECK(ctr_step_set_param(step, "layers.0.moe.router.weight", zeros, 4 * 32));
    CHECK(ctr_step_set_param(step, "layers.1.moe.router.weight", zeros, 4 * 32));
  }

  tok = malloc(sizeof(int32_t) * (size_t)(local * micro * T));
  tgt = malloc(sizeof(int32_t) * (size_t)(local * micro * T));
  if (rank == 0) {
    out = fopen(out_path, "w");
    if (!out) {
      perror(out_path);
      return 1;
    }
  }
  for (s = 0; s < steps; ++s) {
    ctr_step_metrics met;
    /* Rows of this data share: [d * local * micro, (d + 1) * local * micro) of the global batch. */
    for (r = 0; r < local * micro; ++r) {
      int g = data_rank * local * micro + r;
      int stride = 1 + (g + s) % 3, start = (g * 5 + s * 11) % V;
      for (t = 0; t < T; ++t) {
        tok[r * T + t] = (start + stride * t) % V;
        tgt[r * T + t] = (start + stride * (t + 1)) % V;
      }
    }
    CHECK(ctr_step_set_input(step, "tokens", tok, sizeof(int32_t) * (size_t)(local * micro * T)));
    CHECK(ctr_step_set_input(step, "targets", tgt, sizeof(int32_t) * (size_t)(local * micro * T)));
    met.size = sizeof met;
    CHECK(ctr_step_run(step, &met));
    if (out) fprintf(out, "%.17g %.17g\n", met.loss, met.grad_norm);
  }
  {
    /* Every rank takes part in gathering sharded parameters (for moe an
     * expert weight, split over ep: 4 experts x [32, 32]). */
    const int moe = strcmp(preset, "moe") == 0;
    size_t n = (size_t)(moe ? 4 * 32 * 32 : V * 32);
    float *w = malloc(sizeof(float) * n);
    double sum = 0;
    size_t i;
    const char *name = moe ? "layers.1.moe.experts.w2" : strcmp(preset, "llama") == 0 ? "output.weight" : "wte";
    CHECK(ctr_step_get_param(step, name, w, n));
    for (i = 0; i < n; ++i) sum += w[i] * (double)(i % 7 + 1);
    if (out) fprintf(out, "param %.17g\n", sum);
    free(w);
  }
  if (strcmp(preset, "moe") != 0) {
    /* A weight that tensor parallelism splits on its input dim (row-parallel):
     * 2 layers' output projections of the MLP, [32, 128] (gpt) or [32, ffn] (llama). */
    const char *name = strcmp(preset, "llama") == 0 ? "layers.1.feed_forward.w2.weight" : "layers.1.mlp.proj.weight";
    ctr_dtype dtype;
    int64_t dims[4];
    size_t ndim = 0, n = 1, i;
    float *w;
    double sum = 0;
    CHECK(ctr_graph_tensor_info(graph, name, &dtype, dims, 4, &ndim));
    for (i = 0; i < ndim; ++i) n *= (size_t)dims[i];
    w = malloc(sizeof(float) * n);
    CHECK(ctr_step_get_param(step, name, w, n));
    for (i = 0; i < n; ++i) sum += w[i] * (double)(i % 5 + 1);
    if (out) fprintf(out, "param2 %.17g\n", sum);
    free(w);
  }
  {
    /* Per-rank bytes of parameters and optimizer state: ~1/N under fsdp=N. */
    int64_t arena = 0, pbytes = 0, obytes = 0;
    CHECK(ctr_step_memory(step, &arena, &pbytes, &obytes));
    if (out) fprintf(out, "memory %lld %lld %lld\n", (long long)pbytes, (long long)obytes, (long long)arena);
  }
  if (out) fclose(out);
  free(tok);
  free(tgt);
  ctr_step_free(step);
  ctr_graph_free(graph);
  ctr_mesh_free(mesh);
  ctr_options_free(mo);
  ctr_options_free(go);
  ctr_options_free(so);
  return 0;
}
