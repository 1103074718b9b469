// Kernel timeline of any CUDA process, CUDA graph nodes included, without Nsight Systems
// (the device machine has Nsight Compute only, which serialises kernels and so hides the
// overlap that programmatic launch buys). A CUPTI injection library: the CUDA driver loads
// it at the process's first CUDA call when CUDA_INJECTION64_PATH names it, and it records
// every kernel's start and end (GPU timestamps, ns) through CUPTI's activity API, written
// at exit as CSV: start_ns,end_ns,graph_node,grid_x,grid_y,grid_z,block_x,dyn_smem,name.
// With KTRACE_MEMCPY=1 it also records copies (name memcpy_<kind>, bytes as grid_x).
//
// Build and use on the device (nvcc and CUPTI are there):
//   nvcc -O2 -shared -Xcompiler -fPIC -I/usr/local/cuda/extras/CUPTI/include -o /tmp/libktrace.so
//       bench/gpu/kernel_trace.c -L/usr/local/cuda/extras/CUPTI/lib64 -lcupti -lcuda
//   LD_LIBRARY_PATH=/usr/local/cuda/extras/CUPTI/lib64 CUDA_INJECTION64_PATH=/tmp/libktrace.so
//       KTRACE_OUT=/tmp/trace.csv tessera bench --device cuda ...
// bench/gpu/kernel_timeline.py summarises a trace per decode step.
#include <cupti.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#define KTRACE_BUF (16u << 20)

static FILE *ktrace_out;

static void CUPTIAPI ktrace_request(uint8_t **buffer, size_t *size, size_t *max_records) {
    *size = KTRACE_BUF;
    *buffer = (uint8_t *)aligned_alloc(8, KTRACE_BUF);
    *max_records = 0;
}

static void CUPTIAPI ktrace_complete(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size, size_t valid) {
    (void)ctx;
    (void)stream;
    (void)size;
    CUpti_Activity *rec = NULL;
    while (cuptiActivityGetNextRecord(buffer, valid, &rec) == CUPTI_SUCCESS) {
        if (rec->kind == CUPTI_ACTIVITY_KIND_MEMCPY) {
            // The fields every version of CUPTI's memcpy record starts with.
            const struct {
                CUpti_ActivityKind kind;
                uint8_t copy_kind, src_kind, dst_kind, flags;
                uint64_t bytes, start, end;
            } *m = (const void *)rec;
            static const char *kinds[] = {"unknown", "HtoD", "DtoH", "HtoA", "AtoH", "AtoA", "AtoD", "DtoA", "DtoD", "HtoH", "PtoP"};
            if (ktrace_out)
                fprintf(ktrace_out, "%llu,%llu,0,%llu,0,0,0,0,memcpy_%s\n", (unsigned long long)m->start,
                        (unsigned long long)m->end, (unsigned long long)m->bytes,
                        m->copy_kind < 11 ? kinds[m->copy_kind] : "other");
            continue;
        }
        if (rec->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && rec->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
        const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)rec;
        if (ktrace_out)
            fprintf(ktrace_out, "%llu,%llu,%llu,%d,%d,%d,%d,%d,%s\n", (unsigned long long)k->start,
                    (unsigned long long)k->end, (unsigned long long)k->graphNodeId, k->gridX, k->gridY, k->gridZ,
                    k->blockX, k->dynamicSharedMemory, k->name ? k->name : "?");
    }
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped) == CUPTI_SUCCESS && dropped && ktrace_out)
        fprintf(ktrace_out, "# dropped %zu records\n", dropped);
    free(buffer);
}

static void ktrace_flush(void) {
    cuptiActivityFlushAll(1);
    if (ktrace_out) fclose(ktrace_out);
    ktrace_out = NULL;
}

int InitializeInjection(void) {
    const char *path = getenv("KTRACE_OUT");
    ktrace_out = fopen(path ? path : "/tmp/ktrace.csv", "w");
    if (!ktrace_out) return 0;
    fprintf(ktrace_out, "start_ns,end_ns,graph_node,grid_x,grid_y,grid_z,block_x,dyn_smem,name\n");
    if (cuptiActivityRegisterCallbacks(ktrace_request, ktrace_complete) != CUPTI_SUCCESS) return 0;
    if (cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) return 0;
    // KTRACE_MEMCPY=1: copies too, as rows named memcpy_<kind> with their bytes as grid_x.
    const char *mc = getenv("KTRACE_MEMCPY");
    if (mc && mc[0] == '1' && cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY) != CUPTI_SUCCESS) return 0;
    atexit(ktrace_flush);
    return 1;
}
