/* A kernel plan's launches in one native call (shmask_launch.h).
 *
 * Why in C: an eager capture is 5-10 launches, and a launch through
 * Triton's Python-facing launcher costs 5-7 us of host time (argument
 * parsing, a context check, its Python frame); the driver's own enqueue is
 * about 1-2 us. Here each step's parameters are prebuilt bytes (Python
 * packed them once, as Triton's launcher would: kernels/launch_plan.py),
 * only the call's tensor addresses change, and the loop makes the same
 * cuLaunchKernelEx calls Triton's launcher makes, with the same
 * configuration and attributes. */
#define _GNU_SOURCE /* RTLD_NOLOAD */
#include "shmask_launch.h"
#include "shmask_core.h"

#include <dlfcn.h>
#include <pthread.h>
#include <string.h>

/* The driver API's launch configuration (cuda.h, CUDA 12.0 on; the core is
 * built without CUDA's headers). An attribute is its 4-byte id, padding to
 * 8, and a 64-byte value union; the two attributes used here take an int. */
typedef struct {
    int id;
    char pad[4];
    union {
        char bytes[64];
        int value;
    } value;
} cu_launch_attribute;

typedef struct {
    unsigned grid_x, grid_y, grid_z;
    unsigned block_x, block_y, block_z;
    unsigned shared_bytes;
    void *stream;
    cu_launch_attribute *attrs;
    unsigned n_attrs;
} cu_launch_config;

_Static_assert(sizeof(cu_launch_attribute) == 72, "CUlaunchAttribute is 72 bytes");

enum { CU_ATTRIBUTE_COOPERATIVE = 2, CU_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6 };

typedef int (*cu_launch_kernel_ex_fn)(const cu_launch_config *config, void *function,
                                      void **params, void **extra);

static cu_launch_kernel_ex_fn driver_launch(void) {
    static cu_launch_kernel_ex_fn resolved;
    if (!resolved) {
        /* The process launches kernels, so torch loaded the driver: find
         * that same library rather than load another. */
        void *driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
        if (driver) resolved = (cu_launch_kernel_ex_fn)dlsym(driver, "cuLaunchKernelEx");
    }
    return resolved;
}

int shm_launch_plan(const shm_launch_step *steps, uint32_t n_steps, uint8_t *args,
                    uint32_t args_bytes, const shm_launch_hole *holes, uint32_t n_holes,
                    const uint64_t *pointers, uint32_t n_pointers, uint64_t stream,
                    uint64_t launch_fn, uint32_t *failed_step) {
    cu_launch_kernel_ex_fn launch =
        launch_fn ? (cu_launch_kernel_ex_fn)(uintptr_t)launch_fn : driver_launch();
    if (!launch) return SHM_E_LAUNCH_PLAN;
    /* Check the whole plan before anything is written or launched: a bad
     * plan launches nothing. */
    for (uint32_t h = 0; h < n_holes; h++) {
        if (holes[h].slot >= n_pointers || (uint64_t)holes[h].byte + 8 > args_bytes)
            return SHM_E_LAUNCH_PLAN;
    }
    for (uint32_t s = 0; s < n_steps; s++) {
        const shm_launch_step *step = &steps[s];
        if (step->n_params > SHM_LAUNCH_MAX_PARAMS ||
            8 * ((uint64_t)step->first_param + step->n_params) > args_bytes)
            return SHM_E_LAUNCH_PLAN;
    }
    for (uint32_t h = 0; h < n_holes; h++) {
        uint64_t address = pointers[holes[h].slot] + (uint64_t)holes[h].offset;
        memcpy(args + holes[h].byte, &address, sizeof address);
    }
    for (uint32_t s = 0; s < n_steps; s++) {
        const shm_launch_step *step = &steps[s];
        if ((uint64_t)step->grid_x * step->grid_y * step->grid_z == 0) continue;
        void *params[SHM_LAUNCH_MAX_PARAMS];
        for (uint32_t i = 0; i < step->n_params; i++)
            params[i] = args + 8 * ((uint64_t)step->first_param + i);
        cu_launch_attribute attrs[2];
        memset(attrs, 0, sizeof attrs);
        unsigned n_attrs = 0;
        if (step->pdl) {
            attrs[n_attrs].id = CU_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n_attrs++].value.value = 1;
        }
        if (step->cooperative) {
            attrs[n_attrs].id = CU_ATTRIBUTE_COOPERATIVE;
            attrs[n_attrs++].value.value = 1;
        }
        cu_launch_config config = {
            .grid_x = step->grid_x, .grid_y = step->grid_y, .grid_z = step->grid_z,
            .block_x = step->threads, .block_y = 1, .block_z = 1,
            .shared_bytes = step->shared_bytes, .stream = (void *)(uintptr_t)stream,
            .attrs = attrs, .n_attrs = n_attrs,
        };
        int rc = launch(&config, (void *)(uintptr_t)step->function, params, NULL);
        if (rc) {
            if (failed_step) *failed_step = s;
            return -1000 - rc; /* CUDA error e as -1000 - e, as shm_direct_launch */
        }
    }
    return SHM_OK;
}

/* The driver's graph API (cuda.h, CUDA 11.4 on), found as cuLaunchKernelEx
 * is: capture mode 1 is CU_STREAM_CAPTURE_MODE_THREAD_LOCAL (only this
 * thread's calls may disturb the capture; other threads' work, an engine's
 * own graph capture among it, is left alone). */
typedef int (*cu_begin_capture_fn)(void *stream, int mode);
typedef int (*cu_end_capture_fn)(void *stream, void **graph);
typedef int (*cu_instantiate_fn)(void **exec, void *graph, unsigned long long flags);
typedef int (*cu_graph_launch_fn)(void *exec, void *stream);
typedef int (*cu_destroy_fn)(void *handle);
typedef int (*cu_stream_create_fn)(void **stream, unsigned flags);
enum { CU_CAPTURE_THREAD_LOCAL = 1, CU_STREAM_NON_BLOCKING = 1 };

static struct {
    cu_begin_capture_fn begin_capture;
    cu_end_capture_fn end_capture;
    cu_instantiate_fn instantiate;
    cu_graph_launch_fn launch;
    cu_destroy_fn destroy_exec, destroy_graph;
    cu_stream_create_fn stream_create;
} graph_api;
static pthread_once_t graph_api_once = PTHREAD_ONCE_INIT;

/* Once a process: a plan's graph is made only after Triton's path has
 * launched its kernels, so the driver is loaded by then. */
static void resolve_graph_api(void) {
    void *driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (driver) {
        graph_api.begin_capture = (cu_begin_capture_fn)dlsym(driver, "cuStreamBeginCapture_v2");
        graph_api.end_capture = (cu_end_capture_fn)dlsym(driver, "cuStreamEndCapture");
        graph_api.instantiate = (cu_instantiate_fn)dlsym(driver, "cuGraphInstantiateWithFlags");
        graph_api.launch = (cu_graph_launch_fn)dlsym(driver, "cuGraphLaunch");
        graph_api.destroy_exec = (cu_destroy_fn)dlsym(driver, "cuGraphExecDestroy");
        graph_api.destroy_graph = (cu_destroy_fn)dlsym(driver, "cuGraphDestroy");
        graph_api.stream_create = (cu_stream_create_fn)dlsym(driver, "cuStreamCreate");
    }
}

static int graphs_available(void) {
    pthread_once(&graph_api_once, resolve_graph_api);
    return graph_api.begin_capture && graph_api.end_capture && graph_api.instantiate &&
           graph_api.launch && graph_api.destroy_exec && graph_api.destroy_graph &&
           graph_api.stream_create && driver_launch();
}

int shm_launch_plan_graph(const shm_launch_step *steps, uint32_t n_steps, uint8_t *args,
                          uint32_t args_bytes, const shm_launch_hole *holes, uint32_t n_holes,
                          const uint64_t *pointers, uint32_t n_pointers,
                          uint64_t capture_stream, uint64_t *graph_exec, uint32_t *failed_step) {
    if (!graph_exec || !capture_stream || !graphs_available()) return SHM_E_LAUNCH_PLAN;
    *graph_exec = 0;
    void *stream = (void *)(uintptr_t)capture_stream;
    int rc = graph_api.begin_capture(stream, CU_CAPTURE_THREAD_LOCAL);
    if (rc) return -1000 - rc;
    int launched = shm_launch_plan(steps, n_steps, args, args_bytes, holes, n_holes, pointers,
                                   n_pointers, capture_stream, 0, failed_step);
    void *graph = NULL;
    rc = graph_api.end_capture(stream, &graph); /* always: the stream leaves capture */
    if (launched != SHM_OK) {
        if (graph) graph_api.destroy_graph(graph);
        return launched;
    }
    if (rc) return -1000 - rc;
    void *exec = NULL;
    rc = graph_api.instantiate(&exec, graph, 0);
    graph_api.destroy_graph(graph); /* the instantiated graph keeps what it needs */
    if (rc) return -1000 - rc;
    *graph_exec = (uint64_t)(uintptr_t)exec;
    return SHM_OK;
}

int shm_graph_launch(uint64_t graph_exec, uint64_t stream) {
    if (!graph_exec || !graphs_available()) return SHM_E_LAUNCH_PLAN;
    int rc = graph_api.launch((void *)(uintptr_t)graph_exec, (void *)(uintptr_t)stream);
    return rc ? -1000 - rc : SHM_OK;
}

int shm_graph_destroy(uint64_t graph_exec) {
    if (!graph_exec || !graphs_available()) return SHM_E_LAUNCH_PLAN;
    int rc = graph_api.destroy_exec((void *)(uintptr_t)graph_exec);
    return rc ? -1000 - rc : SHM_OK;
}

int shm_capture_stream(uint64_t *stream) {
    if (!stream || !graphs_available()) return SHM_E_LAUNCH_PLAN;
    void *made = NULL;
    int rc = graph_api.stream_create(&made, CU_STREAM_NON_BLOCKING);
    if (rc) return -1000 - rc;
    *stream = (uint64_t)(uintptr_t)made;
    return SHM_OK;
}
