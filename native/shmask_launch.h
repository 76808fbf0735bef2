/* A kernel plan's launches in one native call (shmask_launch.c; issue 35:
 * kernels/launch_plan.py records an eager call's launches once per call
 * shape, then replays them here). Return codes: shmask_core.h. */
#ifndef SHMASK_LAUNCH_H
#define SHMASK_LAUNCH_H

#include <stdint.h>

/* One launch: the compiled kernel's CUfunction, its grid and block, and
 * where its parameters lie in the plan's argument bytes: each parameter has
 * an 8-byte cell, parameter i of the step at args + 8 * (first_param + i). */
typedef struct {
    uint64_t function;
    uint32_t grid_x, grid_y, grid_z;
    uint32_t threads;          /* block size: 32 x the kernel's warps */
    uint32_t shared_bytes;     /* dynamic shared memory */
    uint32_t pdl;              /* programmatic stream serialization (sm90+) */
    uint32_t cooperative;      /* a cooperative grid */
    uint32_t first_param;
    uint32_t n_params;
} shm_launch_step;

/* A per-call pointer: args[byte .. byte + 8) = pointers[slot] + offset,
 * written before the launches (the call's tensors). */
typedef struct {
    uint32_t byte;
    uint32_t slot;
    int64_t offset;
} shm_launch_hole;

/* Fills the holes from `pointers` (n_pointers of them), then launches each
 * step on `stream` with cuLaunchKernelEx, in order, skipping a step whose
 * grid is empty. `launch_fn`: the address of cuLaunchKernelEx, or 0 for
 * the one of the libcuda.so.1 this process has loaded. Returns SHM_OK;
 * SHM_E_LAUNCH_PLAN for a plan that does not hold together (a hole or a
 * parameter's cell outside args_bytes, a slot past n_pointers, more than
 * SHM_LAUNCH_MAX_PARAMS parameters) or no driver loaded, with nothing
 * launched; or -1000 - e for CUDA error e from step *failed_step (the
 * steps before it were launched). */
#define SHM_E_LAUNCH_PLAN -34 /* a plan that does not hold together, or no CUDA driver loaded */
#define SHM_LAUNCH_MAX_PARAMS 128
int shm_launch_plan(const shm_launch_step *steps, uint32_t n_steps, uint8_t *args,
                    uint32_t args_bytes, const shm_launch_hole *holes, uint32_t n_holes,
                    const uint64_t *pointers, uint32_t n_pointers, uint64_t stream,
                    uint64_t launch_fn, uint32_t *failed_step);

/* The same launches as one CUDA graph (issue 35: an eager call's launches
 * cost the host about 2 us each in the driver; a graph's launch costs
 * about the same for all of them). shm_launch_plan_graph fills the holes
 * from `pointers` and records the steps, as shm_launch_plan would launch
 * them, by stream capture (thread-local mode) on `capture_stream`, which
 * the caller owns and uses for nothing else; nothing runs. *graph_exec is
 * then an instantiated graph to launch with shm_graph_launch on any
 * stream of the same context, as often as the call's tensors are at those
 * same addresses, and to free with shm_graph_destroy. Returns SHM_OK;
 * SHM_E_LAUNCH_PLAN as shm_launch_plan's, or where the driver lacks
 * graphs; -1000 - e for CUDA error e (the capture is ended and nothing is
 * kept). */
int shm_launch_plan_graph(const shm_launch_step *steps, uint32_t n_steps, uint8_t *args,
                          uint32_t args_bytes, const shm_launch_hole *holes, uint32_t n_holes,
                          const uint64_t *pointers, uint32_t n_pointers,
                          uint64_t capture_stream, uint64_t *graph_exec, uint32_t *failed_step);
/* A graph of shm_launch_plan_graph, launched on `stream`: SHM_OK or
 * -1000 - e (SHM_E_LAUNCH_PLAN without a driver). */
int shm_graph_launch(uint64_t graph_exec, uint64_t stream);
/* Frees a graph of shm_launch_plan_graph (not launched again after). */
int shm_graph_destroy(uint64_t graph_exec);
/* A new non-blocking stream of the calling thread's current context, for
 * shm_launch_plan_graph's captures: SHM_OK or -1000 - e. */
int shm_capture_stream(uint64_t *stream);

#endif
