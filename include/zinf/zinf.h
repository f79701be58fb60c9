/* zinf C API: the engine's functions for embedding from C and other languages.
 *
 * Conventions: functions return 0 on success and non-zero on failure; after a failure,
 * zinf_last_error() returns a message (per thread) saying what failed and what to do.
 * Pointers documented as "out" are written only on success. No C++ exception crosses this API:
 * running out of memory is a failure with a message.
 *
 * Handles (zinf_swap_store*, zinf_engine*) carry a magic number their close/destroy clears:
 * using a handle after that (a double close included) fails with a message as long as its
 * memory has not been reused by the program; after that, and for pointers that never were
 * handles, behaviour is undefined, as it is for buffers shorter than documented. */
#ifndef ZINF_ZINF_H_
#define ZINF_ZINF_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The message of the last failed call on this thread ("" when the last call succeeded). */
const char* zinf_last_error(void);

/* ---- Aligned memory ---------------------------------------------------------------------- */

/* Memory aligned for O_DIRECT I/O (4096 bytes), size rounded up to 4096. NULL on failure
 * (a size that cannot be rounded, or more than there is). */
void* zinf_alloc_aligned(size_t size);
void zinf_free_aligned(void* ptr);

/* ---- Swap store (NVMe tier) ------------------------------------------------------------- */

typedef struct zinf_swap_store zinf_swap_store;

typedef struct zinf_swap_options {
  const char* const* paths; /* folders that hold the swap files (1..N, striped over) */
  size_t num_paths;
  uint64_t capacity_per_path;     /* bytes to preallocate per path; 0 = grow on demand */
  uint64_t max_capacity_per_path; /* growth limit per path; 0 = until the disk is full */
  uint64_t chunk_size;            /* stripe unit across paths; 0 = 1 MiB */
  uint64_t block_size;            /* largest single I/O request; 0 = 1 MiB */
  uint32_t queue_depth;           /* requests in flight; 0 = 32 */
  const char* backend;            /* "io_uring" (NULL = default), "libaio" or "psync" */
  int checksums;                  /* 1: per-chunk xxhash written and verified on read */
  int reopen;                     /* 1: load the index left by a previous zinf_swap_close */
  int overwrite; /* 1: a new store (reopen 0) replaces one the folders hold; 0: that is refused */
} zinf_swap_options;

/* Fills *options with the defaults (no paths). */
void zinf_swap_options_init(zinf_swap_options* options);

/* Opens a store; *out receives it. */
int zinf_swap_open(const zinf_swap_options* options, zinf_swap_store** out);

/* Starts writing `size` bytes of `buf` under `key`. `buf` must be aligned to
 * zinf_swap_alignment() and hold `capacity` >= size rounded up to that alignment bytes;
 * it must stay valid and unchanged until zinf_swap_wait(*ticket) returns. */
int zinf_swap_write(zinf_swap_store* store, const char* key, const void* buf, size_t size,
                    size_t capacity, uint64_t* ticket);

/* Starts reading the tensor `key` into `buf` (same alignment and capacity rules). */
int zinf_swap_read(zinf_swap_store* store, const char* key, void* buf, size_t capacity,
                   uint64_t* ticket);

/* Waits for a ticket; returns its outcome. Each ticket is waited for once. */
int zinf_swap_wait(zinf_swap_store* store, uint64_t ticket);

/* Size in bytes of the tensor `key`, or -1 (and a last error) when it is not stored. */
int64_t zinf_swap_size(zinf_swap_store* store, const char* key);

/* Frees the extents of `key`. */
int zinf_swap_remove(zinf_swap_store* store, const char* key);

/* Required alignment of buffers and their capacities, in bytes. */
size_t zinf_swap_alignment(const zinf_swap_store* store);

/* Waits for every outstanding request, writes the index (so the store can be reopened),
 * closes the files and frees the store. Returns the first error met; the store is freed
 * either way. */
int zinf_swap_close(zinf_swap_store* store);

/* ---- CPU optimizers (cpu_adam) ----------------------------------------------------------- */
/* (declared by the cpu_adam component below this line) */

/* One torch.optim.Adam (adamw = 0) or torch.optim.AdamW (adamw = 1) step, amsgrad=False, over
 * n elements, updating param, exp_avg and exp_avg_sq in place. `step` counts steps from 1
 * (torch's state["step"] after its increment). Runs on every CPU the process may use
 * (oneTBB), with the widest SIMD kernel this CPU supports (ZINF_CPU_ISA=scalar|avx2|avx512
 * forces one). The buffers must not overlap. Fails, changing nothing, on: a NULL buffer when
 * n > 0, step < 1, a NaN or infinite hyper-parameter, lr < 0, eps < 0, weight_decay < 0,
 * beta1 or beta2 outside [0, 1), adamw other than 0 or 1. */
int zinf_adam_step_f32(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, size_t n,
                       int64_t step, float lr, float beta1, float beta2, float eps,
                       float weight_decay, int adamw);

/* The mixed-precision step: bf16 gradients in, and (when param_bf16_out is not NULL) the
 * updated parameters written as bf16 (round to nearest even) in the same pass. Same rules as
 * zinf_adam_step_f32. */
int zinf_adam_step_bf16(float* param, const uint16_t* grad_bf16, float* exp_avg, float* exp_avg_sq,
                        uint16_t* param_bf16_out, size_t n, int64_t step, float lr, float beta1,
                        float beta2, float eps, float weight_decay, int adamw);

/* The kernel the two calls above use: "scalar", "avx2", "avx512" or "avx512_bf16".
 * NULL (and a last error) when ZINF_CPU_ISA names an unknown or unsupported set. */
const char* zinf_cpu_adam_kernel(void);

/* ---- Engine (one rank on the host device) ---------------------------------------------- */

typedef struct zinf_engine zinf_engine;

typedef struct zinf_step_stats {
  int64_t step;      /* optimizer steps taken */
  int optimizer_ran; /* this call ended an accumulation window */
  double step_seconds;
  double overlap_efficiency;
  uint64_t nvme_read_bytes;
  uint64_t nvme_write_bytes;
  double grad_norm; /* when gradient_clipping is on */
} zinf_step_stats;

/* Creates an engine from a DeepSpeed-style JSON config text (NULL or "" = defaults: everything
 * in memory) on a host device (host memory stands in for the GPU). Unknown config
 * keys print a warning each. zinf.device_budget_bytes sets the host device's memory budget;
 * 0 (the default) means what the device reports, as in C++ and zinf-train: the machine's
 * physical memory. Under an address-space limit (ulimit -v) the device reserves twice its
 * budget of address space beside the pinned arena: a budget of 0 is lowered to fit (with a
 * warning), an explicit one that cannot fit is refused (InvalidArgument, before anything is
 * allocated). With a launcher's variables set (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT or
 * ZINF_STORE_FOLDER; zinf/comm.h ProcessGroupFromEnv) the engine is this process's rank of a
 * group over gloo, and creation waits for every rank (zinf.collective_timeout_seconds).
 * Gradients handed over by the ranks are summed (divide by the number of ranks for a mean). */
int zinf_engine_create(const char* config_json, zinf_engine** out);

/* Registers a parameter (layer order); `init` holds its numel initial fp32 values (copied).
 * *id receives its id. Names are unique, non-empty UTF-8; shapes have at most 2^48 elements
 * (larger ones, and overflowing ones, are refused before anything is allocated). */
int zinf_engine_register(zinf_engine* engine, const char* name, const int64_t* shape, size_t ndim,
                         const float* init, uint32_t* id);

/* Gathers parameters; ptrs[i] receives parameter ids[i] (fp32, or bf16 with "bf16", fp16 with
 * "fp16"), valid until released. */
int zinf_engine_acquire(zinf_engine* engine, const uint32_t* ids, size_t n, void** ptrs);
int zinf_engine_release(zinf_engine* engine, const uint32_t* ids, size_t n);

/* Hands over the full fp32 gradient of a parameter (numel values; copied before return). */
int zinf_engine_reduce_gradient(zinf_engine* engine, uint32_t id, const float* grad);
/* The gradient of micro-batch `micro_batch` of the accumulation window (zinf.schedule
 * "layer-major": one step per window, each parameter's gradients in micro-batch order). */
int zinf_engine_reduce_gradient_of(zinf_engine* engine, uint32_t id, const float* grad,
                                   int micro_batch);

/* Ends a micro-step (the optimizer runs at accumulation boundaries). `stats` may be NULL. */
int zinf_engine_step(zinf_engine* engine, zinf_step_stats* stats);

/* The parameter's fp32 master values (numel floats). */
int zinf_engine_gather_master(zinf_engine* engine, uint32_t id, float* out);

/* The learning rate of the optimizer steps from the next micro-step on (finite, >= 0). */
int zinf_engine_set_learning_rate(zinf_engine* engine, float lr);

/* Parameter groups (Engine::SetParamGroup): group == the number of groups adds one (while
 * parameters are still registered), a smaller one changes its hyperparameters from the next
 * micro-step on; group 0 is the config's optimizer.params. zinf_engine_register_in_group
 * registers a parameter in a group that exists (zinf_engine_register: group 0). */
int zinf_engine_set_param_group(zinf_engine* engine, size_t group, float lr, float beta1,
                                float beta2, float eps, float weight_decay);
int zinf_engine_register_in_group(zinf_engine* engine, const char* name, const int64_t* shape,
                                  size_t ndim, const float* init, size_t param_group, uint32_t* id);

/* Optimizer steps taken (after a resume: the step resumed at); -1 for a NULL engine. */
int64_t zinf_engine_global_step(const zinf_engine* engine);

/* fp16 ("fp16": {"enabled": true}): the loss scale to multiply the loss's gradient by before
 * the backward (the engine divides the gradients by it at the step, and skips a step whose
 * gradients hold inf or NaN on any rank), and the steps skipped so far (Engine::loss_scale,
 * skipped_steps). 1 and 0 without fp16; -1 for a NULL engine. */
double zinf_engine_loss_scale(const zinf_engine* engine);
int64_t zinf_engine_skipped_steps(const zinf_engine* engine);

/* Freeing device memory between phases (Engine::OffloadStates / ReloadStates, DeepSpeed's
 * offload_states / reload_states), between optimizer steps. `include`: a mask of
 * ZINF_OFFLOAD_* (0: all). `device`: "cpu" (NULL: "cpu") or "nvme" (everything, include 0,
 * written under the first nvme_path or ./zinf-swap, and the pinned host memory released too;
 * blocking). `pin_memory`, `non_blocking`: 0 or 1. Any call that reads the states reloads them
 * first. With several ranks, every rank calls both. */
#define ZINF_OFFLOAD_PARAMS 1u           /* lp_params */
#define ZINF_OFFLOAD_OPTIMIZER_STATES 2u /* optim_states, hp_params */
#define ZINF_OFFLOAD_GRADIENTS 4u        /* lp_grads, contiguous_grad_buffer */
int zinf_engine_offload_states(zinf_engine* engine, uint32_t include, const char* device,
                               int pin_memory, int non_blocking);
int zinf_engine_reload_states(zinf_engine* engine, int non_blocking);
/* 1 while offloaded, 0 otherwise, -1 for a NULL engine. */
int zinf_engine_states_offloaded(const zinf_engine* engine);

/* Checkpoints (Engine::SaveCheckpoint / LoadCheckpoint), between optimizer steps.
 * `user_data`: a NUL-terminated text stored with the checkpoint (NULL: none). On load,
 * `user_data` (may be NULL) receives up to capacity - 1 bytes of it, NUL-terminated, and
 * `*user_data_len` (may be NULL) its full length, so a short buffer is detectable. */
int zinf_engine_save_checkpoint(zinf_engine* engine, const char* dir, const char* user_data);
int zinf_engine_load_checkpoint(zinf_engine* engine, const char* dir, char* user_data,
                                size_t capacity, size_t* user_data_len);

/* Durable mode ("zinf": {"durable": true}): after registering every parameter and before the
 * first acquire or step, continues from the swap store's last committed step
 * (Engine::ResumeFromStore). Fails (and the engine refuses to train) when the store has no
 * commit or holds another model. */
int zinf_engine_resume_from_store(zinf_engine* engine);

void zinf_engine_destroy(zinf_engine* engine);

#ifdef __cplusplus
}
#endif

#endif /* ZINF_ZINF_H_ */
