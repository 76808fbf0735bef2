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

#endif
